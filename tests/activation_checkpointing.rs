//! Activation checkpointing: each block's forward recomputed before its backward gives
//! the same bits as keeping its activations (losses and weights after several steps,
//! fp32 and fp16, GPT and Llama, with dropout, under ZeRO-2 on two devices), and the
//! activation memory stops growing with the blocks but for their boundaries.

mod common;

use std::sync::Arc;

use common::*;
use kiln::cpu::CpuDevice;
use kiln::engine::graph::Attention;
use kiln::engine::models::checkpointed::Checkpointed;
use kiln::engine::models::gpt::{Gpt, GptConfig};
use kiln::engine::models::llama::{Llama, LlamaConfig};
use kiln::engine::models::lora::{Lora, LoraConfig, Targets};
use kiln::engine::models::{MicroBatch, Model, Network, NetworkOptions};
use kiln::engine::train::trainer::Trainer;
use kiln::engine::{DType, Device};

fn llama(layers: usize, t: usize) -> Arc<dyn Model> {
    let cfg: LlamaConfig = serde_json::from_str(&format!(
        r#"{{"n_layer": {layers}, "n_head": 4, "n_kv_head": 2, "n_embd": 16, "block_size": 32,
            "vocab_size": 11, "intermediate_size": 24}}"#
    ))
    .unwrap();
    Arc::new(Llama::new(cfg, t).with_attention(Attention::Fused))
}

fn gpt(layers: usize, t: usize) -> Arc<dyn Model> {
    let cfg = GptConfig {
        n_layer: layers,
        n_head: 2,
        n_embd: 16,
        block_size: 32,
        vocab_size: 11,
        padded_vocab_size: None,
    };
    Arc::new(Gpt::new(cfg, t).with_attention(Attention::Fused))
}

/// LoRA with dropout on the adapters' inputs: the masks must replay in the recompute.
fn with_dropout(base: Arc<dyn Model>) -> Arc<dyn Model> {
    let cfg = LoraConfig {
        r: 2,
        alpha: 4.0,
        dropout: 0.2,
        target_modules: Targets::All("all-linear".into()),
        use_rslora: false,
    };
    Arc::new(Lora::new(base, cfg).unwrap())
}

fn tokens(seed: u64, n: usize) -> MicroBatch {
    let mut rng = Rng::new(seed);
    let t: Vec<u32> = (0..n + 1).map(|_| rng.next_u32() % 11).collect();
    MicroBatch::tokens(&t[..n], &t[1..])
}

/// Losses of `steps` steps and the weights after them, on `devs` (one replica each).
fn train(
    devs: &[&dyn Device],
    model: Arc<dyn Model>,
    dtype: DType,
    zero: Option<u64>,
) -> (Vec<u32>, Vec<Vec<u32>>) {
    let (b, t) = (2, 16);
    let mut config = ds_config(b, 2, dtype, devs.len());
    if let Some(stage) = zero {
        config.zero.stage = stage as _;
    }
    let mut trainer = Trainer::new_group(devs, model, config, 3).unwrap();
    let mut losses = vec![];
    for step in 0..3u64 {
        let micro: Vec<Vec<MicroBatch>> = (0..devs.len() as u64)
            .map(|r| {
                vec![
                    tokens(10 * step + 2 * r, b * t),
                    tokens(10 * step + 2 * r + 1, b * t),
                ]
            })
            .collect();
        let s = trainer.step_group(devs, &micro).unwrap();
        losses.push(s.loss.to_bits());
    }
    let weights = trainer
        .model
        .param_states(devs[0])
        .map(|s| s.into_iter().map(|p| p.value.bits()).collect())
        .unwrap_or_default();
    (losses, weights)
}

#[test]
fn checkpointed_training_is_bit_identical_to_keeping_the_activations() {
    let cpu = CpuDevice::new();
    let models: Vec<(&str, Arc<dyn Model>)> = vec![
        ("gpt", gpt(3, 16)),
        ("llama", llama(3, 16)),
        ("llama + lora dropout", with_dropout(llama(3, 16))),
        ("gpt + lora dropout", with_dropout(gpt(3, 16))),
    ];
    for (name, model) in &models {
        for dtype in [DType::F32, DType::F16] {
            let checkpointed = Arc::new(Checkpointed::new(model.clone(), 1).unwrap());
            let plain = train(&[&cpu], model.clone(), dtype, None);
            let ckpt = train(&[&cpu], checkpointed, dtype, None);
            assert_eq!(plain.0, ckpt.0, "{name} {dtype}: losses");
            assert!(plain.1 == ckpt.1, "{name} {dtype}: weights differ");
        }
    }
    // Under ZeRO-2 on two devices, and with ranges of two blocks.
    let (a, b) = (CpuDevice::new(), CpuDevice::new());
    let model = llama(4, 16);
    let plain = train(&[&a, &b], model.clone(), DType::F16, Some(2));
    for every in [1, 2] {
        let checkpointed = Arc::new(Checkpointed::new(model.clone(), every).unwrap());
        let ckpt = train(&[&a, &b], checkpointed, DType::F16, Some(2));
        assert_eq!(plain.0, ckpt.0, "ZeRO-2, every {every}: losses");
    }
}

#[test]
fn activation_memory_grows_by_the_boundaries_only() {
    let options = NetworkOptions {
        batch: 4,
        dtype: DType::F16,
        optimizer: adamw(),
        seed: 1,
        packed: false,
    };
    let mem = |m: Arc<dyn Model>| Network::memory(m.as_ref(), &options).unwrap().activations;
    for (name, make) in [
        ("gpt", gpt as fn(usize, usize) -> Arc<dyn Model>),
        ("llama", llama),
    ] {
        let plain: Vec<u64> = [4, 8].iter().map(|&n| mem(make(n, 32))).collect();
        let ckpt: Vec<u64> = [4, 8]
            .iter()
            .map(|&n| mem(Arc::new(Checkpointed::new(make(n, 32), 1).unwrap())))
            .collect();
        let per_block = (plain[1] - plain[0]) / 4;
        let per_block_ckpt = (ckpt[1] - ckpt[0]) / 4;
        assert!(ckpt[1] < plain[1], "{name}");
        assert!(
            per_block_ckpt * 3 < per_block,
            "{name}: {per_block_ckpt} vs {per_block}"
        );
        // The boundaries: one (B, T, C) activation per block, 4 x 32 x 16 in f16.
        assert_eq!(per_block_ckpt, 4 * 32 * 16 * 2, "{name}");
        // What the estimate says is what the allocator holds.
        let dev = CpuDevice::new();
        let model: Arc<dyn Model> = Arc::new(Checkpointed::new(make(8, 32), 1).unwrap());
        let _net = Network::new(&dev, model.clone(), &options).unwrap();
        let m = Network::memory(model.as_ref(), &options).unwrap();
        assert_eq!(m.total(), dev.allocated_bytes(), "{name}");
    }
}

/// Two pipeline stages recompute the ranges each holds: the same losses as the
/// pipeline without checkpointing, bit for bit (fp16).
#[test]
fn pipeline_stages_recompute_their_blocks_with_the_same_bits() {
    use kiln::engine::parallel::pipeline_partition::PartitionMethod;
    use kiln::engine::train::pipeline_trainer::PipelineTrainer;
    let (b, t) = (2, 16);
    let model = llama(4, t);
    let run = |checkpointing: Option<usize>| {
        let devs: Vec<Box<dyn Device>> = (0..2)
            .map(|_| Box::new(CpuDevice::new()) as Box<dyn Device>)
            .collect();
        let mut config = ds_config(b, 2, DType::F16, 1);
        config.activation_checkpointing = checkpointing;
        let mut pipe =
            PipelineTrainer::new(devs, model.clone(), config, 3, &PartitionMethod::Uniform, 2)
                .unwrap();
        let losses: Vec<u32> = (0..3u64)
            .map(|step| {
                let micro = [tokens(10 * step, b * t), tokens(10 * step + 1, b * t)];
                pipe.step(&micro).unwrap().loss.to_bits()
            })
            .collect();
        losses
    };
    let (plain, ckpt) = (run(None), run(Some(1)));
    assert_eq!(plain, ckpt);
}
