//! `kiln bench pipeline`: a GPT split into 1, 2, 4… pipeline stages over devices of one
//! adapter and trained with the 1F1B schedule at several micro-batch counts: step time,
//! tokens/s, the bubble measured (each stage's time spent waiting for a neighbour, as a
//! share of the step) beside the schedule's `(p - 1) / (m + p - 1)`, the bytes moved
//! between stages, and each stage's device memory. From those measurements it also
//! models a box of real GPUs, one per stage, each on its own PCIe link
//! ([`model_1f1b`]): what the step, the bubble and the exposed transfers would be there.

use std::sync::Arc;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use serde::Serialize;

use kiln_engine::models::{MicroBatch, ModelConfig, NetworkOptions};
use kiln_engine::parallel::pipeline::{Pipeline, StepOptions};
use kiln_engine::parallel::pipeline_partition::PartitionMethod;
use kiln_engine::parallel::pipeline_schedule::{theoretical_bubble, Instr, Schedule};
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
    /// Per stage: milliseconds of a micro-batch's forward and backward, measured (the
    /// stage's busy time in a step, its waits taken out, over `m`; it includes the
    /// stage's share of the step's end, the optimizer step).
    pub compute_ms: Vec<f64>,
    /// Bytes a boundary between stages moves per micro-batch each way (the activation
    /// forward, its gradient back), from the model's shapes.
    pub boundary_bytes: u64,
    /// The same (p, m) modelled on one real GPU per stage ([`model_1f1b`]).
    pub model_step_ms: f64,
    pub model_bubble: f64,
    /// Share of the modelled step spent on transfers compute could not hide.
    pub model_exposed_transfer: f64,
}

/// The box [`model_1f1b`] models: how much faster than the measured device each GPU
/// computes, and the link between a GPU and the host.
#[derive(Clone, Copy, Debug, Serialize)]
pub struct GpuBox {
    /// Measured compute time ÷ this = a GPU's compute time (1: as measured).
    pub gpu_speedup: f64,
    /// Each GPU's link to the host, GB/s each way (full duplex).
    pub link_gbps: f64,
    /// Fixed cost of each copy over a link (submit, DMA start, fence), microseconds.
    pub latency_us: f64,
}

impl GpuBox {
    /// Refuses a box the model cannot mean anything for, naming the flag to fix.
    pub fn check(&self) -> Result<()> {
        crate::bench_dp::check_bandwidth("link-gbps", self.link_gbps)?;
        if !(self.gpu_speedup.is_finite() && self.gpu_speedup > 0.0) {
            bail!(
                "--gpu-speedup {}: a factor above 0 (a GPU 20 times faster than this \
                 device: 20; 1 models the compute times as measured)",
                self.gpu_speedup
            );
        }
        if !(self.latency_us.is_finite() && self.latency_us >= 0.0) {
            bail!(
                "--link-latency-us {}: microseconds of 0 or more per copy (a host-synchronised \
                 PCIe copy costs about 10)",
                self.latency_us
            );
        }
        Ok(())
    }
}

/// One step of the 1F1B schedule on real GPUs, modelled.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Modelled {
    pub step_ms: f64,
    /// Mean over stages of the share of the step each is not computing.
    pub bubble: f64,
    /// (step − the same step over a link that costs nothing) ÷ step.
    pub exposed_transfer: f64,
}

/// Models a step of `m` micro-batches on one GPU per stage: stage `s` computes a
/// micro-batch's forward in `forward_ms[s]` and its backward in `backward_ms[s]`, in
/// the order the engine's 1F1B [`Schedule`] gives it. Every boundary moves `bytes`
/// per micro-batch each way, staged through the host as Kiln does: a copy down the
/// sender's link, then up the receiver's, each `latency_us` plus `bytes` at
/// `link_gbps`. A link carries one copy at a time in each direction (PCIe is full
/// duplex); a sender's copies leave in the order it computes them, a receiver's
/// arrive in the order it uses them, and copies overlap compute (double-buffered
/// staging). The step's end (optimizer step, tied-embedding sum) is not modelled.
pub fn model_1f1b(
    forward_ms: &[f64],
    backward_ms: &[f64],
    m: usize,
    bytes: f64,
    link_gbps: f64,
    latency_us: f64,
) -> Result<Modelled> {
    if forward_ms.len() != backward_ms.len() || forward_ms.is_empty() {
        bail!(
            "the pipeline model needs one forward and one backward time per stage, got {} and {}",
            forward_ms.len(),
            backward_ms.len()
        );
    }
    let hop_ms = latency_us / 1e3 + crate::bench_dp::transfer_ms(bytes, link_gbps);
    let (step, busy) = simulate_1f1b(forward_ms, backward_ms, m, hop_ms)?;
    let (free, _) = simulate_1f1b(forward_ms, backward_ms, m, 0.0)?;
    let p = forward_ms.len() as f64;
    Ok(Modelled {
        step_ms: step,
        bubble: busy.iter().map(|b| (step - b) / step).sum::<f64>() / p,
        exposed_transfer: (step - free) / step,
    })
}

/// The step's length and each stage's compute time, copies between stages taking
/// `hop_ms` per link crossed.
fn simulate_1f1b(
    forward_ms: &[f64],
    backward_ms: &[f64],
    m: usize,
    hop_ms: f64,
) -> Result<(f64, Vec<f64>)> {
    let p = forward_ms.len();
    let schedule = Schedule::one_forward_one_backward(p, m, false)?;
    // Per stage, its computations in order: (forward?, micro-batch).
    let ops: Vec<Vec<(bool, usize)>> = schedule
        .ticks
        .iter()
        .map(|ticks| {
            ticks
                .iter()
                .flatten()
                .filter_map(|i| match *i {
                    Instr::Forward { micro, .. } => Some((true, micro)),
                    Instr::Backward { micro, .. } => Some((false, micro)),
                    _ => None,
                })
                .collect()
        })
        .collect();
    // When stage s's output activation / input gradient of a micro-batch reached the host.
    let mut act_at = vec![vec![None::<f64>; m]; p];
    let mut grad_at = vec![vec![None::<f64>; m]; p];
    let (mut next, mut free, mut busy) = (vec![0; p], vec![0.0f64; p], vec![0.0; p]);
    let (mut down_free, mut up_free) = (vec![0.0f64; p], vec![0.0f64; p]);
    loop {
        let mut progressed = false;
        for s in 0..p {
            while let Some(&(forward, i)) = ops[s].get(next[s]) {
                // Its input on the host, if a neighbour sends it (the first stage's
                // forward reads the batch, the last stage's backward its own loss).
                let staged = match (forward, s) {
                    (true, 0) => None,
                    (true, _) => Some(act_at[s - 1][i]),
                    (false, s) if s + 1 == p => None,
                    (false, _) => Some(grad_at[s + 1][i]),
                };
                let mut start = free[s];
                if let Some(at) = staged {
                    let Some(at) = at else { break };
                    let up = at.max(up_free[s]) + hop_ms;
                    up_free[s] = up;
                    start = start.max(up);
                }
                let took = if forward {
                    forward_ms[s]
                } else {
                    backward_ms[s]
                };
                free[s] = start + took;
                busy[s] += took;
                let sent = if forward && s + 1 < p {
                    Some(&mut act_at[s][i])
                } else if !forward && s > 0 {
                    Some(&mut grad_at[s][i])
                } else {
                    None
                };
                if let Some(slot) = sent {
                    down_free[s] = free[s].max(down_free[s]) + hop_ms;
                    *slot = Some(down_free[s]);
                }
                next[s] += 1;
                progressed = true;
            }
        }
        if next.iter().zip(&ops).all(|(n, o)| *n == o.len()) {
            break;
        }
        if !progressed {
            bail!(
                "the pipeline model found no stage able to go on ({p} stages, {m} micro-batches)"
            );
        }
    }
    Ok((free.iter().copied().fold(0.0, f64::max), busy))
}

/// Trains `model` split into `stages` stages, one device each, opened on adapter
/// `adapter`, for a warm-up step (it compiles) and `steps` timed steps of
/// `micro_batches` micro-batches of random tokens; and the same step modelled on `gpus`.
pub fn measure(
    adapter: usize,
    model: &BenchModel,
    stages: usize,
    micro_batches: usize,
    steps: usize,
    gpus: &GpuBox,
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
        packed: false,
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
    let mut busy = vec![0.0; stages];
    let start = Instant::now();
    for _ in 0..steps.max(1) {
        let r = pipe.step(&micro, o)?;
        seconds += r.seconds;
        waited += r.waited.iter().sum::<f64>() / stages as f64;
        bytes += r.bytes_moved;
        for (b, w) in busy.iter_mut().zip(&r.waited) {
            *b += r.seconds - w;
        }
    }
    let wall = start.elapsed().as_secs_f64();
    let steps = steps.max(1) as f64;
    let compute_ms: Vec<f64> = busy
        .iter()
        .map(|b| b / steps / micro_batches as f64 * 1e3)
        .collect();
    // Between blocks a GPT passes its residual stream, [micro-batch, T, n_embd], in the
    // run's dtype; its gradient has the same shape.
    let boundary_bytes = (model.micro_batch * seq * gpt.n_embd * options.dtype.size()) as u64;
    // Backward computes two products (input and weight gradients) per forward one,
    // so a measured forward + backward splits 1 : 2.
    let gpu = |c: &f64| c / gpus.gpu_speedup;
    let forward: Vec<f64> = compute_ms.iter().map(|c| gpu(c) / 3.0).collect();
    let backward: Vec<f64> = compute_ms.iter().map(|c| gpu(c) * 2.0 / 3.0).collect();
    let modelled = model_1f1b(
        &forward,
        &backward,
        micro_batches,
        boundary_bytes as f64,
        gpus.link_gbps,
        gpus.latency_us,
    )?;
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
        compute_ms,
        boundary_bytes,
        model_step_ms: modelled.step_ms,
        model_bubble: modelled.bubble,
        model_exposed_transfer: modelled.exposed_transfer,
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
        "model step ms",
        "model bubble",
        "model exposed xfer",
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
            format!("{:.2}", r.model_step_ms),
            format!("{:.1}%", 100.0 * r.model_bubble),
            // Copies are often microseconds against milliseconds of compute: the time
            // shows what a percentage would round to 0.
            format!(
                "{:.3} ms ({:.2}%)",
                r.model_exposed_transfer * r.model_step_ms,
                100.0 * r.model_exposed_transfer
            ),
        ]);
    }
    crate::bench::align(&table)
}

#[cfg(test)]
mod tests {
    use kiln_engine::parallel::pipeline_schedule::theoretical_bubble;

    #[test]
    fn the_schedules_bubble_is_p_minus_1_of_m_plus_p_minus_1_slots() {
        assert_eq!(theoretical_bubble(1, 8), 0.0);
        assert_eq!(theoretical_bubble(2, 2), 1.0 / 3.0);
        assert_eq!(theoretical_bubble(4, 16), 3.0 / 19.0);
    }

    #[test]
    fn over_a_free_link_equal_stages_idle_the_schedules_bubble() {
        // p = 2, m = 4, forward 1 ms, backward 2 ms: (m + p - 1)(1 + 2) = 15 ms, each
        // stage computing 4 x 3 = 12 of them: bubble 3/15 = (p - 1)/(m + p - 1).
        let r = super::model_1f1b(&[1.0, 1.0], &[2.0, 2.0], 4, 0.0, 25.0, 0.0).unwrap();
        assert_eq!(r.step_ms, 15.0);
        assert_eq!(r.bubble, theoretical_bubble(2, 4));
        assert_eq!(r.exposed_transfer, 0.0);
        // Four stages, eight micro-batches: 11 slots of 3 ms.
        let r = super::model_1f1b(&[1.0; 4], &[2.0; 4], 8, 0.0, 25.0, 0.0).unwrap();
        assert_eq!(r.step_ms, 33.0);
        assert!((r.bubble - theoretical_bubble(4, 8)).abs() < 1e-15);
        // One stage: its micro-batches back to back, nothing moved, no bubble.
        let r = super::model_1f1b(&[1.0], &[2.0], 4, 1e9, 1.0, 10.0).unwrap();
        assert_eq!((r.step_ms, r.bubble, r.exposed_transfer), (12.0, 0.0, 0.0));
    }

    #[test]
    fn a_link_slower_than_compute_bounds_the_step() {
        // p = 2, m = 4, forward 1 ms, backward 2 ms; 100 MB at 25 GB/s: 4 ms a hop, a
        // copy from stage to stage 8 ms (down to the host, up to the other GPU).
        // Stage 0: F0 0-1 (reaches stage 1 at 9), F1 1-2 (its copy queues behind F0's
        // on stage 0's link: at stage 1 at 13). Stage 1: F0 9-10, B0 10-12 (back at
        // 20), F1 13-14, B1 14-16 (queued behind B0's: back at 24). Stage 0: B0 20-22,
        // F2 22-23 (at stage 1 at 31), B1 24-26, F3 26-27 (at 35). Stage 1: F2 31-32,
        // B2 32-34 (back at 42), F3 35-36, B3 36-38 (back at 46). Stage 0: B2 42-44,
        // B3 46-48. A 48 ms step for 15 ms of schedule: 33/48 exposed; each stage
        // computes 12 of 48 ms.
        let r = super::model_1f1b(&[1.0, 1.0], &[2.0, 2.0], 4, 1e8, 25.0, 0.0).unwrap();
        assert!((r.step_ms - 48.0).abs() < 1e-9, "{r:?}");
        assert!((r.exposed_transfer - 33.0 / 48.0).abs() < 1e-12, "{r:?}");
        assert!((r.bubble - 36.0 / 48.0).abs() < 1e-12, "{r:?}");
        // A fast link: 4 MB at 25 GB/s is 0.16 ms, plus 10 µs latency, 0.17 ms a hop.
        // The longest chain is F0 (stage 0), copy, F0 B0 (stage 1), copy, B0 F2
        // (stage 0), copy, F2 B2 F3 B3 (stage 1), copy, B3 (stage 0): 15 ms of compute
        // and 4 copies of 2 hops.
        let r = super::model_1f1b(&[1.0, 1.0], &[2.0, 2.0], 4, 4e6, 25.0, 10.0).unwrap();
        assert!((r.step_ms - (15.0 + 8.0 * 0.17)).abs() < 1e-9, "{r:?}");
        assert!((r.exposed_transfer - 1.36 / 16.36).abs() < 1e-9, "{r:?}");
    }

    #[test]
    fn the_models_inputs_are_checked() {
        let ok = super::GpuBox {
            gpu_speedup: 1.0,
            link_gbps: 25.0,
            latency_us: 10.0,
        };
        ok.check().unwrap();
        let err = super::GpuBox {
            gpu_speedup: 0.0,
            ..ok
        };
        assert!(err
            .check()
            .unwrap_err()
            .to_string()
            .contains("--gpu-speedup 0"));
        let err = super::GpuBox {
            link_gbps: f64::NAN,
            ..ok
        };
        assert!(err
            .check()
            .unwrap_err()
            .to_string()
            .contains("--link-gbps NaN"));
        let err = super::GpuBox {
            latency_us: -1.0,
            ..ok
        };
        assert!(err
            .check()
            .unwrap_err()
            .to_string()
            .contains("--link-latency-us -1"));
        assert!(super::model_1f1b(&[1.0], &[], 1, 0.0, 1.0, 0.0).is_err());
    }
}
