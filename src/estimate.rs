//! `kiln estimate`: per-device memory of a GPT for each ZeRO stage, before training.
//!
//! Model states come from the same layout `Gpt::new` allocates (`GptMemory::of`, tested
//! equal to a device's allocator); stages 1–3 divide the parts each partitions by the
//! device count, as ZeRO's formulas do: stage 0 (2+2+12)Ψ, stage 1 2Ψ+2Ψ+12Ψ/N,
//! stage 2 2Ψ+(2+12)Ψ/N, stage 3 (2+2+12)Ψ/N for fp16 with Adam. Stages 1 and 2 are
//! what Kiln allocates: a rank's slice also has an f32 reduced gradient and a model
//! copy, and stage 2's full-size gradients are one block's (shared by all blocks) plus
//! the embeddings' and final norm's, not 2Ψ/N.

use std::fmt::Write as _;

use anyhow::Result;
use kiln_engine::models::gpt::{Attention, GptConfig, GptMemory};
use kiln_engine::models::mlp::Precision;

/// One ZeRO stage's per-device bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StageMemory {
    pub stage: u8,
    pub weights: u64,
    pub gradients: u64,
    pub optimizer: u64,
    pub activations: u64,
    /// Kiln trains with this stage today.
    pub implemented: bool,
}

impl StageMemory {
    pub fn total(&self) -> u64 {
        self.weights + self.gradients + self.optimizer + self.activations
    }
}

/// Per-device memory for stages 0..=3 on `world` devices.
pub fn stages(
    model: &GptConfig,
    micro_batch: usize,
    seq: usize,
    precision: Precision,
    world: usize,
) -> Result<Vec<StageMemory>> {
    let head_dim = model.n_embd / model.n_head.max(1);
    let m = GptMemory::of(
        model,
        micro_batch,
        seq,
        precision,
        Attention::best(head_dim, precision, seq),
    )?;
    let n = world.max(1) as u64;
    let psi = model.parameter_count() as u64;
    // A ZeRO rank's slice: f32 master and moments, the f32 reduced gradient, and the
    // slice's updated model copy (zero.rs); whole tensors keep their arenas' gaps.
    let slice = psi.div_ceil(n);
    let sharded = (12 + precision.dtype().size() as u64) * slice;
    let one = |stage, weights, gradients, optimizer, implemented| StageMemory {
        stage,
        weights,
        gradients,
        optimizer,
        activations: m.activations,
        implemented,
    };
    Ok(vec![
        one(0, m.weights, m.gradients, m.optimizer, true),
        // One device: the single shard is the whole state, stage 0's layout.
        if n > 1 {
            one(1, m.weights, m.gradients + 4 * slice, sharded, true)
        } else {
            one(1, m.weights, m.gradients, m.optimizer, true)
        },
        // Stage 2 holds one block's gradients at a time (the blocks share them) next
        // to the embeddings' and final norm's.
        if n > 1 {
            one(2, m.weights, m.shared_gradients + 4 * slice, sharded, true)
        } else {
            one(2, m.weights, m.gradients, m.optimizer, true)
        },
        one(
            3,
            m.weights.div_ceil(n),
            m.gradients.div_ceil(n),
            m.optimizer.div_ceil(n),
            false,
        ),
    ])
}

fn mib(b: u64) -> String {
    format!("{:.1} MiB", b as f64 / (1u64 << 20) as f64)
}

/// The table `kiln estimate` prints.
pub fn report(
    model: &GptConfig,
    micro_batch: usize,
    seq: usize,
    precision: Precision,
    world: usize,
    adapters: &[(String, u64)],
) -> Result<String> {
    let mut out = String::new();
    let psi = model.parameter_count();
    writeln!(
        out,
        "GPT {} layers, {} embd, {} heads, vocab {}: Ψ = {psi} parameters; {:?}, micro-batch \
         {micro_batch} × T {seq}, {world} device(s)",
        model.n_layer, model.n_embd, model.n_head, model.vocab_size, precision
    )?;
    writeln!(
        out,
        "{:<7} {:>12} {:>12} {:>14} {:>13} {:>12}  note",
        "stage", "weights", "gradients", "master+Adam", "activations", "per device"
    )?;
    let rows = stages(model, micro_batch, seq, precision, world)?;
    for s in &rows {
        writeln!(
            out,
            "{:<7} {:>12} {:>12} {:>14} {:>13} {:>12}  {}",
            s.stage,
            mib(s.weights),
            mib(s.gradients),
            mib(s.optimizer),
            mib(s.activations),
            mib(s.total()),
            if s.implemented {
                ""
            } else {
                "what it would give (not implemented yet)"
            }
        )?;
    }
    // The token embedding's master, moments and gradient are f32 in every precision.
    let biggest = ((model.vocab_size * model.n_embd * 4) as u64).max(
        (micro_batch * seq * model.vocab_size).max(micro_batch * model.n_head * seq * seq) as u64
            * precision.dtype().size() as u64,
    );
    for (name, max_binding) in adapters {
        writeln!(
            out,
            "{name}: total memory is not reported through wgpu, so compare the per-device \
             figure with the adapter's; largest single buffer {} vs its binding limit {} ({})",
            mib(biggest),
            mib(*max_binding),
            if biggest <= *max_binding {
                "fits"
            } else {
                "over: the GEMMs split it, other kernels report an error"
            }
        )?;
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stages_follow_the_zero_formulas() {
        let cfg = GptConfig {
            n_layer: 12,
            n_head: 12,
            n_embd: 768,
            block_size: 1024,
            vocab_size: 50304,
        };
        let psi = cfg.parameter_count() as u64;
        let r = stages(&cfg, 1, 1024, Precision::F16, 4).unwrap();
        let state = |s: &StageMemory| s.weights + s.gradients + s.optimizer;
        // fp16 weights (2Ψ) and Adam in f32 (12Ψ); gradients are 2Ψ but for the f32
        // ones of embeddings and norms (the embeddings are most of a small GPT's Ψ).
        assert_eq!(r[0].weights, 2 * psi);
        assert_eq!(r[0].optimizer, 12 * psi);
        assert!(r[0].gradients >= 2 * psi && r[0].gradients <= 4 * psi);
        assert_eq!(r[1].optimizer, 14 * psi.div_ceil(4));
        assert_eq!(r[1].gradients, r[0].gradients + 4 * psi.div_ceil(4));
        assert_eq!(r[3].weights, (2 * psi).div_ceil(4));
        // Stage 2 keeps one of the 12 blocks' gradients and an f32 slice of all.
        let m = GptMemory::of(
            &cfg,
            1,
            1024,
            Precision::F16,
            Attention::best(64, Precision::F16, 1024),
        )
        .unwrap();
        assert_eq!(r[2].gradients, m.shared_gradients + 4 * psi.div_ceil(4));
        assert!(r.iter().take(3).all(|s| s.implemented) && !r[3].implemented);
        assert!(state(&r[0]) > state(&r[1]) && state(&r[1]) > state(&r[2]));
        assert!(state(&r[2]) > state(&r[3]));
        assert!(r.iter().all(|s| s.activations == r[0].activations));
    }
}
