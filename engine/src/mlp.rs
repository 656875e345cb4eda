//! A two-layer MLP classifier trained end to end on a device, forward and backward
//! written out side by side (no autodiff yet): the smallest model that exercises every
//! training kernel — GEMM with bias, GELU, fused softmax-cross-entropy, mixed precision
//! with a dynamic loss scaler, the overflow check and AdamW.
//!
//! Shapes (B = batch, I = inputs, H = hidden, C = classes), activations in `act`:
//!   x  (B, I)  --W1 (I, H), b1 (H)-->  a1 (B, H)  --gelu-->  h (B, H)
//!   h  (B, H)  --W2 (H, C), b2 (C)-->  logits (B, C)  --cross-entropy(y)-->  loss (B)

use crate::loss_scaler::{DynamicScaling, LossScaler, StepDecision};
use crate::{Buffer, DType, Device, HostData, Kernel, Matmul, Result};

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

use crate::optim::ParamBuffers as Param;

pub struct Mlp {
    pub config: MlpConfig,
    w1: Param,
    b1: Param,
    w2: Param,
    b2: Param,
    // Activations and their gradients, allocated once for the batch size.
    x: Buffer,
    y: Buffer,
    a1: Buffer,
    h: Buffer,
    logits: Buffer,
    losses: Buffer,
    lse: Buffer,
    dlogits: Buffer,
    dh: Buffer,
    da1: Buffer,
    ones: Buffer,
    flag: Buffer,
    zero: Buffer,
    grad_scale: Buffer,
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
        let ones = dev.alloc(act, b)?;
        dev.upload(ones, &HostData::from_f32(act, &vec![1.0; b]))?;
        let scaler = match config.precision {
            Precision::F16 => LossScaler::dynamic(DynamicScaling::default())?,
            _ => LossScaler::fixed(1.0)?,
        };
        Ok(Mlp {
            x: dev.alloc(act, b * i)?,
            y: dev.alloc(DType::U32, b)?,
            a1: dev.alloc(act, b * h)?,
            h: dev.alloc(act, b * h)?,
            logits: dev.alloc(act, b * c)?,
            losses: dev.alloc(DType::F32, b)?,
            lse: dev.alloc(DType::F32, b)?,
            dlogits: dev.alloc(act, b * c)?,
            dh: dev.alloc(act, b * h)?,
            da1: dev.alloc(act, b * h)?,
            ones,
            flag: dev.alloc(DType::U32, 1)?,
            zero: dev.alloc(DType::F32, 1)?,
            grad_scale: dev.alloc(DType::F32, 1)?,
            w1,
            b1,
            w2,
            b2,
            scaler,
            step: 0,
            config,
        })
    }

    /// Records the forward pass for the batch already in `x`.
    fn forward(&self, dev: &dyn Device) -> Result<()> {
        let (b, i, h, c) = (
            self.config.batch,
            self.config.inputs,
            self.config.hidden,
            self.config.classes,
        );
        // a1 = x W1 + b1; h = gelu(a1) (a1 is kept: the backward needs it).
        dev.launch(&Kernel::Matmul(
            Matmul::new(self.x, self.w1.value, self.a1, b, h, i).with_bias(self.b1.value),
        ))?;
        dev.launch(&Kernel::Gelu {
            x: self.a1,
            out: self.h,
        })?;
        // logits = h W2 + b2; loss = cross-entropy(logits, y).
        dev.launch(&Kernel::Matmul(
            Matmul::new(self.h, self.w2.value, self.logits, b, c, h).with_bias(self.b2.value),
        ))?;
        dev.launch(&Kernel::CrossEntropy {
            logits: self.logits,
            targets: self.y,
            losses: self.losses,
            lse: self.lse,
            vocab: c,
        })
    }

    fn upload_batch(&self, dev: &dyn Device, x: &[f32], y: &[u32]) -> Result<()> {
        dev.upload(
            self.x,
            &HostData::from_f32(self.config.precision.dtype(), x),
        )?;
        dev.upload(self.y, &HostData::U32(y.to_vec()))
    }

    /// One optimizer step on a batch (`x`: B×I row-major, `y`: B class indices).
    pub fn train_step(&mut self, dev: &dyn Device, x: &[f32], y: &[u32]) -> Result<StepStats> {
        let (b, i, h, c) = (
            self.config.batch,
            self.config.inputs,
            self.config.hidden,
            self.config.classes,
        );
        let scale = self.scaler.scale();
        self.upload_batch(dev, x, y)?;
        self.forward(dev)?;
        // dlogits = (softmax - onehot) * scale / B: the gradient of the scaled mean loss.
        dev.launch(&Kernel::CrossEntropyBackward {
            logits: self.logits,
            targets: self.y,
            lse: self.lse,
            dlogits: self.dlogits,
            vocab: c,
            scale: scale / b as f32,
        })?;
        // dW2 = h^T dlogits (H×C); db2 = 1^T dlogits; dh = dlogits W2^T (B×H).
        dev.launch(&Kernel::Matmul(
            Matmul::new(self.h, self.dlogits, self.w2.grad, h, c, b).transpose(true, false),
        ))?;
        dev.launch(&Kernel::Matmul(Matmul::new(
            self.ones,
            self.dlogits,
            self.b2.grad,
            1,
            c,
            b,
        )))?;
        dev.launch(&Kernel::Matmul(
            Matmul::new(self.dlogits, self.w2.value, self.dh, b, h, c).transpose(false, true),
        ))?;
        // da1 = dh * gelu'(a1); dW1 = x^T da1 (I×H); db1 = 1^T da1.
        dev.launch(&Kernel::GeluBackward {
            x: self.a1,
            dout: self.dh,
            dx: self.da1,
        })?;
        dev.launch(&Kernel::Matmul(
            Matmul::new(self.x, self.da1, self.w1.grad, i, h, b).transpose(true, false),
        ))?;
        dev.launch(&Kernel::Matmul(Matmul::new(
            self.ones,
            self.da1,
            self.b1.grad,
            1,
            h,
            b,
        )))?;
        // One readback per step: the overflow flag and the losses.
        let params = [&self.w1, &self.b1, &self.w2, &self.b2];
        dev.launch(&Kernel::NonFinite {
            srcs: params.iter().map(|p| p.grad).collect(),
            flag: self.flag,
        })?;
        dev.submit()?;
        let overflow = dev.download(self.flag)?.bits()[0] != 0;
        let losses = dev.download(self.losses)?.to_f32();
        let loss = losses.iter().map(|&v| v as f64).sum::<f64>() / b as f64;
        let decision = self.scaler.update(overflow)?;
        if decision == StepDecision::Skip {
            return Ok(StepStats {
                loss: loss as f32,
                skipped: true,
                scale,
            });
        }
        self.step += 1;
        // Unscale on the device: grad_scale = 1 / loss scale (no clipping here).
        dev.launch(&Kernel::GradScale {
            sum_squares: self.zero,
            out: self.grad_scale,
            loss_scale: scale,
            clip: 0.0,
        })?;
        for p in params {
            dev.launch(&p.adamw(
                self.grad_scale,
                self.config.lr,
                0.999,
                self.config.weight_decay,
                self.step,
            ))?;
        }
        dev.submit()?;
        Ok(StepStats {
            loss: loss as f32,
            skipped: false,
            scale,
        })
    }

    /// Mean loss and accuracy on a batch, without training.
    pub fn evaluate(&self, dev: &dyn Device, x: &[f32], y: &[u32]) -> Result<(f32, f32)> {
        self.upload_batch(dev, x, y)?;
        self.forward(dev)?;
        dev.submit()?;
        let losses = dev.download(self.losses)?.to_f32();
        let logits = dev.download(self.logits)?.to_f32();
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
        let loss = losses.iter().map(|&v| v as f64).sum::<f64>() / y.len() as f64;
        Ok((loss as f32, correct as f32 / y.len() as f32))
    }

    /// Every tensor a checkpoint holds: model weights, f32 masters and Adam moments,
    /// named `fc1.weight`, `fc1.weight.master`, `fc1.weight.adam_m`, ….
    pub fn tensors(&self) -> Vec<crate::safetensors_io::NamedTensor> {
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
                out.push(crate::safetensors_io::NamedTensor {
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
