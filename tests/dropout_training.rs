//! Dropout in training: masks keyed by the seed, the applied steps and the micro-batch's
//! place in the global batch, so a resumed run draws exactly the masks it would have,
//! a data-parallel group draws what one device accumulating the same batch draws, and
//! evaluation runs without dropout.

use std::sync::Arc;

use kiln::cpu::CpuDevice;
use kiln::engine::data::clusters;
use kiln::engine::graph::{Graph, Tensor};
use kiln::engine::models::{Forward, Init, MicroBatch, Model, ParamSpec};
use kiln::engine::train::{checkpoint, trainer::Trainer};
use kiln::engine::{DType, Device};

/// x (B, 8) -> linear 32 -> GELU -> dropout(p) -> linear 4 -> cross-entropy.
struct DropMlp {
    p: Option<f32>,
}

impl Model for DropMlp {
    fn describe(&self) -> String {
        format!("MLP with dropout {:?}", self.p)
    }

    fn parameters(&self) -> Vec<ParamSpec> {
        vec![
            ParamSpec::new("fc1.weight", &[8, 32], Init::Uniform(0.2)).decayed(),
            ParamSpec::new("fc1.bias", &[32], Init::Const(0.0)),
            ParamSpec::new("fc2.weight", &[32, 4], Init::Uniform(0.2)).decayed(),
            ParamSpec::new("fc2.bias", &[4], Init::Const(0.0)),
        ]
    }

    fn forward(
        &self,
        g: &mut Graph,
        p: &[Tensor],
        batch: usize,
        dtype: DType,
    ) -> kiln::engine::Result<Forward> {
        let x = g.input("x", &[batch, 8], dtype);
        let y = g.input("y", &[batch], DType::U32);
        let h = g.linear(x, p[0], Some(p[1]))?;
        let mut h = g.gelu(h)?;
        if let Some(rate) = self.p {
            h = g.dropout(h, rate)?;
        }
        let logits = g.linear(h, p[2], Some(p[3]))?;
        g.cross_entropy(logits, y)?;
        Ok(Forward {
            inputs: vec![x, y],
            prediction: logits,
        })
    }
}

const B: usize = 16;

fn config(accum: usize, world: usize) -> kiln::engine::TrainConfig {
    kiln::engine::config::parse(
        &format!(
            r#"{{"train_micro_batch_size_per_gpu": {B}, "gradient_accumulation_steps": {accum},
                "optimizer": {{"type": "AdamW", "params": {{"lr": 0.01}}}}}}"#
        ),
        world,
    )
    .unwrap()
}

/// `n` micro-batches of B points of 4 clusters.
fn data(n: usize) -> Vec<MicroBatch> {
    let (x, y) = clusters(8, 4, B * n, 1.0, 9);
    (0..n)
        .map(|i| MicroBatch::features(&x[i * B * 8..(i + 1) * B * 8], &y[i * B..(i + 1) * B]))
        .collect()
}

#[test]
fn a_resumed_run_draws_the_same_masks() {
    let dev = CpuDevice::new();
    let model = Arc::new(DropMlp { p: Some(0.3) });
    let batches = data(10);
    let new = || Trainer::new(&dev, model.clone(), config(1, 1), 4).unwrap();
    let mut whole = new();
    let want: Vec<f32> = batches
        .iter()
        .map(|b| whole.step(&dev, std::slice::from_ref(b)).unwrap().loss)
        .collect();
    let dir = std::env::temp_dir().join(format!("kiln-dropout-resume-{}", std::process::id()));
    std::fs::remove_dir_all(&dir).ok();
    let mut first = new();
    let mut got: Vec<f32> = batches[..5]
        .iter()
        .map(|b| first.step(&dev, std::slice::from_ref(b)).unwrap().loss)
        .collect();
    first
        .save_checkpoint(&[&dev], &dir, 5, Default::default(), 1)
        .unwrap();
    let mut resumed = new();
    resumed
        .load_checkpoint(&[&dev], &checkpoint::load_latest(&dir).unwrap())
        .unwrap();
    got.extend(
        batches[5..]
            .iter()
            .map(|b| resumed.step(&dev, std::slice::from_ref(b)).unwrap().loss),
    );
    std::fs::remove_dir_all(&dir).ok();
    assert_eq!(got, want);
}

#[test]
fn a_data_parallel_group_draws_what_one_device_accumulating_draws() {
    let devs = [CpuDevice::new(), CpuDevice::new(), CpuDevice::new()];
    let model = Arc::new(DropMlp { p: Some(0.5) });
    let batches = data(12);
    let mut single = Trainer::new(&devs[0], model.clone(), config(2, 1), 4).unwrap();
    let pair: [&dyn Device; 2] = [&devs[1], &devs[2]];
    let mut group = Trainer::new_group(&pair, model.clone(), config(1, 2), 4).unwrap();
    for step in batches.chunks(2) {
        let s = single.step(&devs[0], step).unwrap();
        let per_rank: Vec<Vec<MicroBatch>> = step.iter().map(|b| vec![b.clone()]).collect();
        let g = group.step_group(&pair, &per_rank).unwrap();
        // f32; the sums happen in another order (device vs host): 1e-5 relative. With
        // another rank's masks the losses would differ in the first digits (p = 0.5).
        assert!(
            (s.loss - g.loss).abs() <= 1e-5 * s.loss,
            "{} vs {}",
            s.loss,
            g.loss
        );
    }
}

#[test]
fn evaluation_runs_without_dropout() {
    let dev = CpuDevice::new();
    let batch = data(1).remove(0);
    let mut with = Trainer::new(&dev, Arc::new(DropMlp { p: Some(0.5) }), config(1, 1), 4).unwrap();
    let without = Trainer::new(&dev, Arc::new(DropMlp { p: None }), config(1, 1), 4).unwrap();
    // Same parameters (same table, same seed): evaluation is the network without dropout.
    let a = with.model.predict(&dev, &batch).unwrap();
    let b = without.model.predict(&dev, &batch).unwrap();
    assert_eq!(a, b);
    assert_eq!(
        with.model.predict(&dev, &batch).unwrap(),
        a,
        "evaluation is deterministic"
    );
    // Training does drop: half the hidden units gone changes the loss.
    let trained = with.model.loss_and_gradients(&dev, &batch).unwrap();
    assert!(
        (trained - a.0).abs() > 1e-3,
        "training loss {trained} vs evaluation {}",
        a.0
    );
}
