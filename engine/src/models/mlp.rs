//! A two-layer MLP classifier trained end to end on a device: the smallest model that
//! exercises every training kernel — GEMM with bias, GELU, fused softmax-cross-entropy,
//! mixed precision with a dynamic loss scaler, the overflow check and AdamW. Its
//! forward pass is written once on the graph; the backward is derived and the whole
//! step compiled into a plan (see `graph`).
//!
//! Shapes (B = batch, I = inputs, H = hidden, C = classes):
//!   x  (B, I)  --W1 (I, H), b1 (H)-->  a1 (B, H)  --gelu-->  h (B, H)
//!   h  (B, H)  --W2 (H, C), b2 (C)-->  logits (B, C)  --cross-entropy(y)-->  loss (B)

use crate::graph::{Bindings, Graph, Plan, Tensor};
use crate::train::loss_scaler::{DynamicScaling, LossScaler};
use crate::{Buffer, DType, Device, HostData, Optimizer, Result};

/// Storage precision of weights, activations and gradients (masters are always f32).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Precision {
    F32,
    /// fp16 with dynamic loss scaling.
    F16,
    /// bf16, no loss scaling.
    BF16,
}

impl Precision {
    pub fn dtype(self) -> DType {
        match self {
            Precision::F32 => DType::F32,
            Precision::F16 => DType::F16,
            Precision::BF16 => DType::BF16,
        }
    }
}

#[derive(Clone, Debug)]
pub struct MlpConfig {
    pub inputs: usize,
    pub hidden: usize,
    pub classes: usize,
    pub batch: usize,
    pub precision: Precision,
    pub lr: f32,
    pub weight_decay: f32,
    pub seed: u64,
}

use crate::device::optim::ParamBuffers as Param;

pub struct Mlp {
    pub config: MlpConfig,
    w1: Param,
    b1: Param,
    w2: Param,
    b2: Param,
    // The batch, uploaded before each step.
    x: Buffer,
    y: Buffer,
    logits: Tensor,
    /// Forward, derived backward, overflow check and AdamW, compiled once.
    plan: Plan,
    pub scaler: LossScaler,
    step: u32,
}

/// What one training step did.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct StepStats {
    /// Mean cross-entropy of the batch.
    pub loss: f32,
    /// The step overflowed and updated nothing.
    pub skipped: bool,
    /// Loss scale used for this step.
    pub scale: f32,
}

/// Deterministic uniform numbers for initialisation and data (splitmix64).
pub struct SplitMix(pub u64);

impl SplitMix {
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    /// Uniform in [-1, 1).
    pub fn symmetric(&mut self) -> f32 {
        (self.next_u64() >> 40) as f32 / (1u64 << 23) as f32 - 1.0
    }
}

impl Mlp {
    pub fn new(dev: &dyn Device, config: MlpConfig) -> Result<Mlp> {
        let act = config.precision.dtype();
        let (b, i, h, c) = (config.batch, config.inputs, config.hidden, config.classes);
        let mut rng = SplitMix(config.seed);
        let mut param = |len: usize, fan_in: usize| -> Result<Param> {
            // Uniform(-1/sqrt(fan_in), 1/sqrt(fan_in)), PyTorch's Linear default bound.
            let bound = 1.0 / (fan_in as f32).sqrt();
            let init: Vec<f32> = (0..len).map(|_| rng.symmetric() * bound).collect();
            Param::new(dev, &init, act, act)
        };
        let (w1, b1, w2, b2) = (
            param(i * h, i)?,
            param(h, i)?,
            param(h * c, h)?,
            param(c, h)?,
        );
        // The model, written once. Every tensor is decayed (this classifier's choice).
        let mut g = Graph::new();
        let x = g.input("x", &[b, i], act);
        let y = g.input("y", &[b], DType::U32);
        let fc1_w = g.param("fc1.weight", &[i, h], act, act, true)?;
        let fc1_b = g.param("fc1.bias", &[h], act, act, true)?;
        let fc2_w = g.param("fc2.weight", &[h, c], act, act, true)?;
        let fc2_b = g.param("fc2.bias", &[c], act, act, true)?;
        let a1 = g.linear(x, fc1_w, Some(fc1_b))?;
        let hidden = g.gelu(a1)?;
        let logits = g.linear(hidden, fc2_w, Some(fc2_b))?;
        g.cross_entropy(logits, y)?;
        g.output(logits)?;
        let (xb, yb) = (dev.alloc(act, b * i)?, dev.alloc(DType::U32, b)?);
        let optimizer = Optimizer::Adam {
            lr: config.lr,
            betas: [0.9, 0.999],
            eps: 1e-8,
            weight_decay: config.weight_decay,
            decoupled: true,
        };
        let bindings = Bindings {
            params: vec![w1, b1, w2, b2],
            inputs: vec![(x, xb), (y, yb)],
            groups: vec![],
        };
        let plan = g.compile(dev, &bindings, Some(&optimizer))?;
        let scaler = match config.precision {
            Precision::F16 => LossScaler::dynamic(DynamicScaling::default())?,
            _ => LossScaler::fixed(1.0)?,
        };
        Ok(Mlp {
            x: xb,
            y: yb,
            logits,
            plan,
            w1,
            b1,
            w2,
            b2,
            scaler,
            step: 0,
            config,
        })
    }

    fn upload_batch(&self, dev: &dyn Device, x: &[f32], y: &[u32]) -> Result<()> {
        dev.upload(
            self.x,
            &HostData::from_f32(self.config.precision.dtype(), x),
        )?;
        dev.upload(self.y, &HostData::U32(y.to_vec()))
    }

    /// One optimizer step on a batch (`x`: B×I row-major, `y`: B class indices). One
    /// readback: the overflow flag and the losses.
    pub fn train_step(&mut self, dev: &dyn Device, x: &[f32], y: &[u32]) -> Result<StepStats> {
        let b = self.config.batch;
        self.upload_batch(dev, x, y)?;
        // The loss is the batch mean: each row's loss weighs 1/B.
        let st = self.plan.step(
            dev,
            &mut self.scaler,
            1.0 / b as f32,
            (self.config.lr, self.step + 1, 0.0),
            true,
        )?;
        if !st.skipped {
            self.step += 1;
        }
        Ok(StepStats {
            loss: st.loss.unwrap_or(f64::NAN) as f32,
            skipped: st.skipped,
            scale: st.scale,
        })
    }

    /// Mean loss and accuracy on a batch, without training.
    pub fn evaluate(&self, dev: &dyn Device, x: &[f32], y: &[u32]) -> Result<(f32, f32)> {
        self.upload_batch(dev, x, y)?;
        self.plan.forward(dev)?;
        let loss = self.plan.loss_sum(dev)? / y.len() as f64;
        let logits = self
            .plan
            .buffer(self.logits)
            .expect("the logits are a graph output");
        let logits = dev.download(logits)?.to_f32();
        let c = self.config.classes;
        let correct = y
            .iter()
            .enumerate()
            .filter(|(r, &t)| {
                let row = &logits[r * c..(r + 1) * c];
                let best = (0..c)
                    .max_by(|&a, &b| row[a].total_cmp(&row[b]))
                    .unwrap_or(0);
                best == t as usize
            })
            .count();
        Ok((loss as f32, correct as f32 / y.len() as f32))
    }

    /// Every tensor a checkpoint holds: model weights, f32 masters and Adam moments,
    /// named `fc1.weight`, `fc1.weight.master`, `fc1.weight.adam_m`, ….
    pub fn tensors(&self) -> Vec<crate::train::safetensors_io::NamedTensor> {
        let c = &self.config;
        let mut out = vec![];
        for (name, p, shape) in [
            ("fc1.weight", &self.w1, vec![c.inputs, c.hidden]),
            ("fc1.bias", &self.b1, vec![c.hidden]),
            ("fc2.weight", &self.w2, vec![c.hidden, c.classes]),
            ("fc2.bias", &self.b2, vec![c.classes]),
        ] {
            for (suffix, buffer) in [
                ("", p.value),
                (".master", p.master),
                (".adam_m", p.m),
                (".adam_v", p.v),
            ] {
                out.push(crate::train::safetensors_io::NamedTensor {
                    name: format!("{name}{suffix}"),
                    buffer,
                    shape: shape.clone(),
                });
            }
        }
        out
    }

    /// The f32 master weights (W1, b1, W2, b2), for comparisons and export.
    pub fn masters(&self, dev: &dyn Device) -> Result<Vec<Vec<f32>>> {
        [&self.w1, &self.b1, &self.w2, &self.b2]
            .iter()
            .map(|p| Ok(dev.download(p.master)?.to_f32()))
            .collect()
    }
}

/// Gaussian clusters: `classes` random centres in `inputs` dimensions, points at a
/// centre plus noise. Deterministic for a seed.
pub fn clusters(
    inputs: usize,
    classes: usize,
    n: usize,
    noise: f32,
    seed: u64,
) -> (Vec<f32>, Vec<u32>) {
    let mut centres = SplitMix(seed);
    let c: Vec<f32> = (0..classes * inputs)
        .map(|_| centres.symmetric() * 2.0)
        .collect();
    let mut rng = SplitMix(seed ^ 0xDA7A);
    let mut x = Vec::with_capacity(n * inputs);
    let mut y = Vec::with_capacity(n);
    for _ in 0..n {
        let k = (rng.next_u64() % classes as u64) as usize;
        y.push(k as u32);
        for d in 0..inputs {
            x.push(c[k * inputs + d] + noise * rng.symmetric());
        }
    }
    (x, y)
}
