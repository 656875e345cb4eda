//! Library example: start from a checkpoint, fine-tune it with `Trainer`, read the loss,
//! and generate text with the KV-cached `Generator`.
//!
//! The checkpoint is made here first (a short run of the built-in addition task), so
//! the example needs no download; with GPT-2's files, `import::read("gpt2")` gives the
//! same `GptConfig` + host tensors that `weights_of` reads from a Kiln checkpoint.
//!
//! `cargo run --release --example finetune [DEVICE]` (default `vulkan`).

use std::path::Path;
use std::sync::Arc;

use kiln::engine::config::parse;
use kiln::engine::data::Addition;
use kiln::engine::device::host::HostTensor;
use kiln::engine::models::generate::Generator;
use kiln::engine::models::gpt::{Gpt, GptConfig};
use kiln::engine::models::sample::argmax;
use kiln::engine::models::MicroBatch;
use kiln::engine::train::checkpoint::{self, MODEL_FILE};
use kiln::engine::train::trainer::Trainer;
use kiln::engine::{DType, Device};

/// One problem line (`47+85=231\n`, the sum reversed) is 10 tokens: 9 fed, 9 predicted.
const T: usize = 9;
const BATCH: usize = 32;
const CONFIG: &str = r#"{
    "train_micro_batch_size_per_gpu": 32,
    "gradient_clipping": 1.0,
    "fp16": {"enabled": true, "initial_scale_power": 12},
    "optimizer": {"type": "AdamW", "params": {"lr": 0.003, "betas": [0.9, 0.95], "weight_decay": 0.01}}
}"#;
/// Fine-tuning starts Adam afresh: its first updates are about `lr` per weight whatever
/// the gradient, so at the pre-training rate they throw a trained model back up the
/// loss (measured here: 0.31 -> 1.81 in one step at 0.003). A tenth of it, warmed up.
const FINETUNE: &str = r#"{
    "train_micro_batch_size_per_gpu": 32,
    "gradient_clipping": 1.0,
    "fp16": {"enabled": true, "initial_scale_power": 12},
    "optimizer": {"type": "AdamW", "params": {"lr": 0.0003, "betas": [0.9, 0.95], "weight_decay": 0.01}},
    "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0, "warmup_max_lr": 0.0003, "warmup_num_steps": 10}}
}"#;

fn model() -> Arc<Gpt> {
    let config = GptConfig {
        n_layer: 2,
        n_head: 4,
        n_embd: 64,
        block_size: T,
        vocab_size: Addition::VOCAB_SIZE,
        padded_vocab_size: None,
    };
    Arc::new(Gpt::new(config, T))
}

/// Training batch `step`: `BATCH` problem lines, each one row; only the answers are
/// trained (the operands are random digits).
fn batch(data: &Addition, step: usize) -> MicroBatch {
    let lines = data.train_tokens(((step + 1) * BATCH) as u64);
    let (mut tokens, mut targets) = (vec![], vec![]);
    for line in lines[step * BATCH * (T + 1)..].chunks(T + 1) {
        tokens.extend_from_slice(&line[..T]);
        targets.extend_from_slice(&line[1..]);
    }
    Addition::mask_prompts(&tokens, &mut targets, T);
    MicroBatch::tokens(&tokens, &targets)
}

/// A checkpoint's model weights as host tensors, by parameter name.
fn weights_of(run_dir: &Path) -> anyhow::Result<Vec<HostTensor>> {
    let ck = checkpoint::load_latest(run_dir)?;
    Ok(ck.file(MODEL_FILE)?.tensors.clone())
}

/// What the example did.
#[allow(dead_code)]
pub struct Report {
    /// The pre-training run's losses (the run that wrote the checkpoint).
    pub pretrain: Vec<f32>,
    /// The fine-tuning run's losses, starting from the checkpoint's weights.
    pub finetune: Vec<f32>,
    /// The prompt and what greedy decoding appended to it.
    pub text: String,
}

/// Pre-trains `pretrain` steps into `run_dir`, then fine-tunes a fresh trainer from
/// that checkpoint for `finetune` steps and completes `prompt` greedily.
pub fn run(
    dev: &dyn Device,
    pretrain: usize,
    finetune: usize,
    prompt: &str,
    run_dir: &Path,
) -> anyhow::Result<Report> {
    let data = Addition::new(2, 1)?;
    // 1. A checkpoint to start from.
    let mut first = Trainer::new(dev, model(), parse(CONFIG, 1)?, 1)?;
    let pretrain: Vec<f32> = (0..pretrain)
        .map(|s| Ok(first.step(dev, &[batch(&data, s)])?.loss))
        .collect::<anyhow::Result<_>>()?;
    first.save_checkpoint(
        &[dev],
        run_dir,
        pretrain.len() as u64,
        Default::default(),
        1,
    )?;
    drop(first);

    // 2. Load its weights into a new trainer (another seed: its own weights are
    //    replaced) and fine-tune on later problems; the optimizer starts afresh.
    let mut trainer = Trainer::new(dev, model(), parse(FINETUNE, 1)?, 2)?;
    trainer.set_weights(&[dev], &weights_of(run_dir)?)?;
    let finetune: Vec<f32> = (0..finetune)
        .map(|s| Ok(trainer.step(dev, &[batch(&data, pretrain.len() + s)])?.loss))
        .collect::<anyhow::Result<_>>()?;

    // 3. Generate from the fine-tuned weights (the f32 masters, rounded once to f16).
    let weights = trainer.model.parameters(dev)?;
    let mut gen = Generator::new(dev, model().as_ref(), &weights, DType::F16, T)?;
    let ids = Addition::encode(prompt)
        .ok_or_else(|| anyhow::anyhow!("`{prompt}`: the addition task reads digits, + and ="))?;
    let mut logits = gen.prefill(dev, &ids)?;
    let mut out = ids.clone();
    loop {
        let next = argmax(&logits);
        out.push(next);
        // The line's end, or the last position the model has an embedding for.
        if next == Addition::SEP || gen.position() == gen.max_len() {
            break;
        }
        logits = gen.step(dev, next)?;
    }
    gen.free(dev)?;
    Ok(Report {
        pretrain,
        finetune,
        text: Addition::decode(&out),
    })
}

#[allow(dead_code)]
fn main() -> anyhow::Result<()> {
    kiln::devices::quiet_device_select();
    let spec: kiln::DeviceSpec = std::env::args()
        .nth(1)
        .as_deref()
        .unwrap_or("vulkan")
        .parse()?;
    let dev = kiln::open_device(&spec, &Default::default())?;
    let dir = std::env::temp_dir().join(format!("kiln-finetune-{}", std::process::id()));
    let report = run(dev.as_ref(), 400, 100, "47+85=", &dir)?;
    std::fs::remove_dir_all(&dir).ok();
    let last = |l: &[f32]| l.iter().rev().take(10).sum::<f32>() / 10.0;
    println!(
        "pre-training: loss {:.3} -> {:.3}; fine-tuning from its checkpoint: {:.3} -> {:.3}",
        report.pretrain[0],
        last(&report.pretrain),
        report.finetune[0],
        last(&report.finetune)
    );
    println!("{} (the sum is written reversed)", report.text.trim_end());
    Ok(())
}
