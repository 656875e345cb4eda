//! A model of your own, trained by Kiln: a residual MLP classifier written against the
//! model contract, trained with `Trainer` in fp16 (dynamic loss scaling, fp32 master
//! weights) on built-in synthetic data, checkpointed half way and resumed from the
//! checkpoint in a fresh trainer, which continues exactly where the first left off.
//!
//!     cargo run --release --example classifier -- [DEVICE] [STEPS]
//!
//! DEVICE is a spec from `kiln devices` (default `vulkan`).

use std::sync::Arc;

use kiln::engine::config::parse;
use kiln::engine::data::clusters;
use kiln::engine::graph::{Graph, Tensor};
use kiln::engine::models::{Forward, Init, MicroBatch, Model, ParamSpec};
use kiln::engine::train::{checkpoint, trainer::Trainer};
use kiln::engine::{DType, Device};

// ---- The model: everything Kiln needs to know of it. ---------------------------------

/// x (B, I) -> stem -> `blocks` × [x + W2 gelu(W1 layernorm(x))] -> head -> logits (B, C).
struct Classifier {
    inputs: usize,
    width: usize,
    classes: usize,
    blocks: usize,
}

impl Model for Classifier {
    fn describe(&self) -> String {
        format!("residual MLP ({} blocks of {})", self.blocks, self.width)
    }

    fn parameters(&self) -> Vec<ParamSpec> {
        let (i, w, c) = (self.inputs, self.width, self.classes);
        let dense = |name: String, rows: usize, cols: usize| {
            let init = Init::Uniform(1.0 / (rows as f32).sqrt());
            ParamSpec::new(name, &[rows, cols], init).decayed()
        };
        let mut p = vec![dense("stem.weight".into(), i, w)];
        for b in 0..self.blocks {
            p.push(
                ParamSpec::new(format!("blocks.{b}.norm.weight"), &[w], Init::Const(1.0))
                    .f32_grad(),
            );
            p.push(
                ParamSpec::new(format!("blocks.{b}.norm.bias"), &[w], Init::Const(0.0)).f32_grad(),
            );
            p.push(dense(format!("blocks.{b}.fc1.weight"), w, 2 * w));
            p.push(dense(format!("blocks.{b}.fc2.weight"), 2 * w, w));
        }
        p.push(dense("head.weight".into(), w, c));
        p.push(ParamSpec::new("head.bias", &[c], Init::Const(0.0)));
        p
    }

    fn forward(
        &self,
        g: &mut Graph,
        p: &[Tensor],
        batch: usize,
        dtype: DType,
    ) -> kiln::engine::Result<Forward> {
        let x = g.input("features", &[batch, self.inputs], dtype);
        let y = g.input("classes", &[batch], DType::U32);
        let mut h = g.linear(x, p[0], None)?;
        for w in p[1..1 + 4 * self.blocks].chunks(4) {
            let n = g.layernorm(h, w[0], w[1])?;
            let f = g.linear(n, w[2], None)?;
            let f = g.gelu(f)?;
            let f = g.linear(f, w[3], None)?;
            h = g.add(h, f)?;
        }
        let logits = g.linear(h, p[p.len() - 2], Some(p[p.len() - 1]))?;
        g.cross_entropy(logits, y)?;
        Ok(Forward {
            inputs: vec![x, y],
            prediction: logits,
        })
    }

    /// Each residual block: what data parallelism and ZeRO-2 cut along.
    fn blocks(&self) -> Vec<Vec<usize>> {
        (0..self.blocks)
            .map(|b| (1 + 4 * b..5 + 4 * b).collect())
            .collect()
    }
}

// ---- Training it. ---------------------------------------------------------------------

const BATCH: usize = 128;
const CONFIG: &str = r#"{
    "train_micro_batch_size_per_gpu": 128,
    "fp16": {"enabled": true},
    "optimizer": {"type": "AdamW", "params": {"lr": 0.003, "weight_decay": 0.01}},
    "gradient_clipping": 1.0
}"#;

/// What a run did.
#[allow(dead_code)]
pub struct Report {
    /// Loss of every step: the first half before the checkpoint, the rest after resuming.
    pub losses: Vec<f32>,
    /// The same steps' losses from a trainer that was never stopped.
    pub uninterrupted: Vec<f32>,
    pub held_out_accuracy: f32,
    pub skipped: usize,
}

/// Trains the classifier for `steps` steps on `dev`, checkpointing into `run_dir` half
/// way and continuing in a fresh trainer loaded from that checkpoint.
pub fn run(dev: &dyn Device, steps: usize, run_dir: &std::path::Path) -> anyhow::Result<Report> {
    let model = Arc::new(Classifier {
        inputs: 16,
        width: 64,
        classes: 10,
        blocks: 2,
    });
    let new_trainer = || -> anyhow::Result<Trainer> {
        Ok(Trainer::new(dev, model.clone(), parse(CONFIG, 1)?, 1)?)
    };
    // One stream of points: the first `steps` batches train, the last one is held out.
    let (x, y) = clusters(model.inputs, model.classes, BATCH * (steps + 1), 1.5, 7);
    let batch = |s: usize| {
        let (lo, hi) = (s * BATCH, (s + 1) * BATCH);
        MicroBatch::features(&x[lo * model.inputs..hi * model.inputs], &y[lo..hi])
    };
    let (mut losses, mut uninterrupted, mut skipped) = (vec![], vec![], 0);
    let mut trainer = new_trainer()?;
    let mut reference = new_trainer()?;
    for s in 0..steps {
        if s == steps / 2 {
            // Save, drop the trainer, and carry on from the checkpoint in a new one.
            trainer.save_checkpoint(&[dev], run_dir, s as u64, Default::default(), 1)?;
            trainer = new_trainer()?;
            trainer.load_checkpoint(&[dev], &checkpoint::load_latest(run_dir)?)?;
        }
        let st = trainer.step(dev, &[batch(s)])?;
        losses.push(st.loss);
        skipped += st.skipped as usize;
        uninterrupted.push(reference.step(dev, &[batch(s)])?.loss);
        if s % 50 == 0 || s + 1 == steps {
            println!(
                "step {s:4}  loss {:.4}  loss scale {}",
                st.loss, st.loss_scale
            );
        }
    }
    let held_out = batch(steps);
    let (_, predicted) = trainer.model.predict(dev, &held_out)?;
    let classes = &y[steps * BATCH..];
    let right = predicted
        .iter()
        .zip(classes)
        .filter(|(p, t)| p == t)
        .count();
    Ok(Report {
        losses,
        uninterrupted,
        held_out_accuracy: right as f32 / BATCH as f32,
        skipped,
    })
}

#[allow(dead_code)]
fn main() -> anyhow::Result<()> {
    kiln::devices::quiet_device_select();
    let args: Vec<String> = std::env::args().skip(1).collect();
    let spec: kiln::DeviceSpec = args.first().map_or("vulkan", |s| s.as_str()).parse()?;
    let steps: usize = match args.get(1) {
        Some(s) => s
            .parse()
            .map_err(|_| anyhow::anyhow!("STEPS must be a whole number, not `{s}`"))?,
        None => 300,
    };
    let dev = kiln::open_device(&spec, &Default::default())?;
    println!(
        "training a residual MLP in fp16 on {} ({})",
        dev.caps().name,
        dev.caps().backend
    );
    let dir = std::env::temp_dir().join(format!("kiln-classifier-{}", std::process::id()));
    let report = run(dev.as_ref(), steps, &dir)?;
    std::fs::remove_dir_all(&dir).ok();
    let same = report.losses == report.uninterrupted;
    println!(
        "held-out accuracy {:.1}% (chance 10%), {} fp16 steps skipped; resumed run {} the uninterrupted one",
        report.held_out_accuracy * 100.0,
        report.skipped,
        if same { "is bit-identical to" } else { "DIFFERS from" }
    );
    Ok(())
}
