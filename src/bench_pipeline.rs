//! `kiln bench pipeline`: a GPT split into 1, 2, 4… pipeline stages over devices of one
//! adapter and trained with the 1F1B schedule at several micro-batch counts: step time,
//! tokens/s, the bubble measured (each stage's time spent waiting for a neighbour, as a
//! share of the step) beside the schedule's `(p - 1) / (m + p - 1)`, the bytes moved
//! between stages, and each stage's device memory.

use std::sync::Arc;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use serde::Serialize;

use kiln_engine::models::{MicroBatch, ModelConfig, NetworkOptions};
use kiln_engine::parallel::pipeline::{Pipeline, StepOptions};
use kiln_engine::parallel::pipeline_partition::PartitionMethod;
use kiln_engine::{DType, Device, Optimizer};
use kiln_wgpu::{DeviceOptions, WgpuDevice};

use crate::bench_train::BenchModel;

/// One (stages, micro-batches) measurement.
#[derive(Clone, Debug, Serialize)]
pub struct PipelineRow {
    pub adapter: String,
    pub model: String,
    pub stages: usize,
    pub micro_batches: usize,
    pub step_ms: f64,
    pub tokens_per_s: f64,
    /// Mean over stages of the share of the step each waited for a neighbour.
    pub bubble_measured: f64,
    /// The schedule's idle share: (p - 1) / (m + p - 1).
    pub bubble_theory: f64,
    /// Activations and activation gradients between stages, per step.
    pub mb_moved: f64,
    /// Per stage: device bytes (weights, gradients, master weights and moments,
    /// activations of its in-flight micro-batches).
    pub stage_mib: Vec<f64>,
}

/// The schedule's idle share of a step: each stage idles `p - 1` of `m + p - 1` slots.
pub fn theoretical_bubble(p: usize, m: usize) -> f64 {
    (p - 1) as f64 / (m + p - 1) as f64
}

/// Trains `model` split into `stages` stages, one device each, opened on adapter
/// `adapter`, for a warm-up step (it compiles) and `steps` timed steps of
/// `micro_batches` micro-batches of random tokens.
pub fn measure(
    adapter: usize,
    model: &BenchModel,
    stages: usize,
    micro_batches: usize,
    steps: usize,
) -> Result<PipelineRow> {
    let ModelConfig::Gpt2(gpt) = &model.config else {
        bail!(
            "kiln bench pipeline measures GPT models; {} is not one",
            model.name
        );
    };
    let (seq, vocab) = (gpt.block_size, gpt.vocab_size);
    let built: Arc<dyn kiln_engine::models::Model> = model.config.build(seq);
    if built.blocks().len() < stages {
        bail!(
            "{} has {} blocks; {stages} stages need at least as many (use a deeper model or \
             fewer stages)",
            model.name,
            built.blocks().len()
        );
    }
    let options = NetworkOptions {
        batch: model.micro_batch,
        dtype: DType::F32,
        optimizer: Optimizer::adamw(1e-3, 0.0),
        seed: 1,
    };
    let method = PartitionMethod::Parameters;
    let memory = Pipeline::memory(built.as_ref(), &options, &method, stages)?;
    let mut devs: Vec<Box<dyn Device>> = vec![];
    for _ in 0..stages {
        devs.push(Box::new(WgpuDevice::open(
            adapter,
            &DeviceOptions::default(),
        )?));
    }
    let name = devs[0].caps().name.clone();
    let mut pipe = Pipeline::new(devs, built, &options, &method)
        .with_context(|| format!("{stages} stages of {}", model.name))?;
    // Random tokens below the vocabulary (a fixed sequence: the time does not depend
    // on the values).
    let mut state = 0x9E37_79B9_7F4A_7C15u64;
    let mut token = move || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        (state % vocab as u64) as u32
    };
    let n = model.micro_batch * seq;
    let micro: Vec<MicroBatch> = (0..micro_batches)
        .map(|_| {
            let x: Vec<u32> = (0..n).map(|_| token()).collect();
            let y: Vec<u32> = (0..n).map(|_| token()).collect();
            MicroBatch::tokens(&x, &y)
        })
        .collect();
    let o = StepOptions {
        loss_scale: 1.0,
        clip: 1.0,
        lr: 1e-3,
    };
    pipe.step(&micro, o)?;
    let (mut seconds, mut waited, mut bytes) = (0.0, 0.0, 0u64);
    let start = Instant::now();
    for _ in 0..steps.max(1) {
        let r = pipe.step(&micro, o)?;
        seconds += r.seconds;
        waited += r.waited.iter().sum::<f64>() / stages as f64;
        bytes += r.bytes_moved;
    }
    let wall = start.elapsed().as_secs_f64();
    let steps = steps.max(1) as f64;
    Ok(PipelineRow {
        adapter: name,
        model: model.name.clone(),
        stages,
        micro_batches,
        step_ms: wall / steps * 1e3,
        tokens_per_s: (micro_batches * n) as f64 * steps / wall,
        bubble_measured: waited / seconds,
        bubble_theory: theoretical_bubble(stages, micro_batches),
        mb_moved: bytes as f64 / steps / 1e6,
        stage_mib: memory
            .iter()
            .map(|m| m.total() as f64 / (1u64 << 20) as f64)
            .collect(),
    })
}

/// The rows as an aligned table.
pub fn format_rows(rows: &[PipelineRow]) -> String {
    let mut table = vec![[
        "stages",
        "m",
        "step ms",
        "tokens/s",
        "bubble measured",
        "bubble theory",
        "MB moved/step",
        "MiB per stage",
    ]
    .map(String::from)
    .to_vec()];
    for r in rows {
        let mib: Vec<String> = r.stage_mib.iter().map(|m| format!("{m:.1}")).collect();
        table.push(vec![
            r.stages.to_string(),
            r.micro_batches.to_string(),
            format!("{:.1}", r.step_ms),
            format!("{:.0}", r.tokens_per_s),
            format!("{:.1}%", 100.0 * r.bubble_measured),
            format!("{:.1}%", 100.0 * r.bubble_theory),
            format!("{:.2}", r.mb_moved),
            mib.join(" / "),
        ]);
    }
    crate::bench::align(&table)
}

#[cfg(test)]
mod tests {
    #[test]
    fn the_schedules_bubble_is_p_minus_1_of_m_plus_p_minus_1_slots() {
        assert_eq!(super::theoretical_bubble(1, 8), 0.0);
        assert_eq!(super::theoretical_bubble(2, 2), 1.0 / 3.0);
        assert_eq!(super::theoretical_bubble(4, 16), 3.0 / 19.0);
    }
}
