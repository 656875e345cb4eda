//! Optimizer steps as kernel launches over flat buffers.
//!
//! Parameters, gradients and moments live in flat buffers (one per dtype group), so one
//! launch updates every tensor: the multi-tensor kernel is simply a kernel over one
//! long array. Gradients arrive scaled (by the fp16 loss scale) and are multiplied by
//! `grad_scale[0]`, a device value produced by [`crate::Kernel::GradScale`] from the
//! gradient norm, so unscaling and clipping need no host round trip.

use crate::{Buffer, DType, Device, Error, HostData, Kernel, Result};

/// One Adam or AdamW step (PyTorch's formulas, bias-corrected, 1-based `step`).
#[derive(Clone, Debug, PartialEq)]
pub struct AdamStep {
    /// f32 master weights, updated in place.
    pub master: Buffer,
    /// Gradients (any float dtype), multiplied by `grad_scale[0]` first.
    pub grads: Buffer,
    /// f32 first and second moments, updated in place.
    pub m: Buffer,
    pub v: Buffer,
    /// The model's copy of the weights (f16, bf16 or f32), rewritten from the master.
    pub params: Option<Buffer>,
    /// f32[1]: factor applied to every gradient (1 / (loss scale * clip factor)).
    pub grad_scale: Buffer,
    pub lr: f32,
    pub beta1: f32,
    pub beta2: f32,
    pub eps: f32,
    pub weight_decay: f32,
    /// AdamW: decay the weights directly. Adam: add `weight_decay * w` to the gradient.
    pub decoupled: bool,
    pub step: u32,
}

/// One SGD step with momentum (PyTorch's form, no dampening).
#[derive(Clone, Debug, PartialEq)]
pub struct SgdStep {
    pub master: Buffer,
    pub grads: Buffer,
    /// f32 momentum buffer, updated in place.
    pub momentum_buf: Buffer,
    pub params: Option<Buffer>,
    pub grad_scale: Buffer,
    pub lr: f32,
    pub momentum: f32,
    pub weight_decay: f32,
}

fn check_state(kernel: &str, n: usize, named: &[(&str, Buffer, Option<DType>)]) -> Result<()> {
    for (name, b, dtype) in named {
        if let Some(d) = dtype {
            if b.dtype != *d {
                return Err(Error::DTypeMismatch {
                    what: format!("{kernel}: `{name}` (buffer #{})", b.id),
                    expected: *d,
                    found: b.dtype,
                });
            }
        } else if !b.dtype.is_float() {
            return Err(Error::InvalidArgument(format!(
                "{kernel}: `{name}` (buffer #{}) is {}, expected f32, f16 or bf16",
                b.id, b.dtype
            )));
        }
        if b.len != n {
            return Err(Error::LenMismatch {
                what: format!("{kernel}: `{name}` (buffer #{})", b.id),
                expected: n,
                found: b.len,
            });
        }
    }
    Ok(())
}

fn check_scale(kernel: &str, b: Buffer) -> Result<()> {
    if b.dtype != DType::F32 || b.len != 1 {
        return Err(Error::InvalidArgument(format!(
            "{kernel}: grad_scale (buffer #{}) must be one f32, it is {} x {}",
            b.id, b.len, b.dtype
        )));
    }
    Ok(())
}

fn finite(kernel: &str, values: &[(&str, f32)]) -> Result<()> {
    for (name, v) in values {
        if !v.is_finite() {
            return Err(Error::InvalidArgument(format!(
                "{kernel}: {name} is {v}; it must be finite"
            )));
        }
    }
    Ok(())
}

impl AdamStep {
    pub fn buffers(&self) -> Vec<Buffer> {
        let mut v = vec![self.master, self.grads, self.m, self.v, self.grad_scale];
        v.extend(self.params);
        v
    }

    pub fn validate(&self) -> Result<()> {
        let n = self.master.len;
        let mut named = vec![
            ("master", self.master, Some(DType::F32)),
            ("grads", self.grads, None),
            ("m", self.m, Some(DType::F32)),
            ("v", self.v, Some(DType::F32)),
        ];
        if let Some(p) = self.params {
            named.push(("params", p, None));
        }
        check_state("adam", n, &named)?;
        check_scale("adam", self.grad_scale)?;
        finite(
            "adam",
            &[
                ("lr", self.lr),
                ("eps", self.eps),
                ("weight_decay", self.weight_decay),
            ],
        )?;
        for (name, b) in [("beta1", self.beta1), ("beta2", self.beta2)] {
            if !(0.0..1.0).contains(&b) {
                return Err(Error::InvalidArgument(format!(
                    "adam: {name} is {b}; it must be in [0, 1)"
                )));
            }
        }
        if self.step == 0 {
            return Err(Error::InvalidArgument(
                "adam: step counts from 1 (bias correction divides by 1 - beta^step)".into(),
            ));
        }
        Ok(())
    }

    /// `1 - beta1^step` and `1 - beta2^step`, computed in f64 once per step.
    pub fn bias_corrections(&self) -> (f32, f32) {
        let t = self.step as i32;
        (
            (1.0 - (self.beta1 as f64).powi(t)) as f32,
            (1.0 - (self.beta2 as f64).powi(t)) as f32,
        )
    }
}

impl SgdStep {
    pub fn buffers(&self) -> Vec<Buffer> {
        let mut v = vec![self.master, self.grads, self.momentum_buf, self.grad_scale];
        v.extend(self.params);
        v
    }

    pub fn validate(&self) -> Result<()> {
        let n = self.master.len;
        let mut named = vec![
            ("master", self.master, Some(DType::F32)),
            ("grads", self.grads, None),
            ("momentum_buf", self.momentum_buf, Some(DType::F32)),
        ];
        if let Some(p) = self.params {
            named.push(("params", p, None));
        }
        check_state("sgd", n, &named)?;
        check_scale("sgd", self.grad_scale)?;
        finite(
            "sgd",
            &[
                ("lr", self.lr),
                ("momentum", self.momentum),
                ("weight_decay", self.weight_decay),
            ],
        )
    }
}

/// The factor gradients are multiplied by, DeepSpeed's way: with `norm` the L2 norm of
/// the scaled gradients, `combined = loss_scale * max(1, (norm / loss_scale + 1e-6) / clip)`
/// when clipping (`clip > 0`), else `loss_scale`; the factor is `1 / combined`.
pub fn grad_scale_reference(sum_squares: f64, loss_scale: f32, clip: f32) -> f32 {
    let ls = loss_scale as f64;
    let combined = if clip > 0.0 {
        ls * ((sum_squares.sqrt() / ls + 1e-6) / clip as f64).max(1.0)
    } else {
        ls
    };
    (1.0 / combined) as f32
}

/// One trainable tensor on a device: the model's copy (`value`, in the activation
/// dtype), its f32 master, its gradient and Adam's two f32 moments.
#[derive(Clone, Copy, Debug)]
pub struct ParamBuffers {
    pub value: Buffer,
    pub master: Buffer,
    pub grad: Buffer,
    pub m: Buffer,
    pub v: Buffer,
}

impl ParamBuffers {
    /// Allocates the buffers and uploads `init` to the master and (rounded) the value.
    pub fn new(dev: &dyn Device, init: &[f32], value: DType, grad: DType) -> Result<ParamBuffers> {
        let n = init.len();
        let master = dev.alloc(DType::F32, n)?;
        dev.upload(master, &HostData::F32(init.to_vec()))?;
        let v = dev.alloc(value, n)?;
        dev.upload(v, &HostData::from_f32(value, init))?;
        Ok(ParamBuffers {
            value: v,
            master,
            grad: dev.alloc(grad, n)?,
            m: dev.alloc(DType::F32, n)?,
            v: dev.alloc(DType::F32, n)?,
        })
    }

    /// The AdamW step for this tensor (beta1 0.9, eps 1e-8), writing the model copy too.
    pub fn adamw(
        &self,
        grad_scale: Buffer,
        lr: f32,
        beta2: f32,
        weight_decay: f32,
        step: u32,
    ) -> Kernel {
        let adamw = Optimizer::Adam {
            lr,
            betas: [0.9, beta2],
            eps: 1e-8,
            weight_decay,
            decoupled: true,
        };
        self.step(&adamw, grad_scale, lr, weight_decay, step)
    }

    /// This tensor's update under `optimizer` at learning rate `lr` (the schedule's value
    /// for this step) with `weight_decay` (0 for tensors that are not decayed); `step` is
    /// 1-based and drives Adam's bias correction. SGD keeps its momentum in `m`.
    pub fn step(
        &self,
        optimizer: &Optimizer,
        grad_scale: Buffer,
        lr: f32,
        weight_decay: f32,
        step: u32,
    ) -> Kernel {
        match *optimizer {
            Optimizer::Adam {
                betas: [beta1, beta2],
                eps,
                decoupled,
                ..
            } => Kernel::Adam(AdamStep {
                master: self.master,
                grads: self.grad,
                m: self.m,
                v: self.v,
                params: Some(self.value),
                grad_scale,
                lr,
                beta1,
                beta2,
                eps,
                weight_decay,
                decoupled,
                step,
            }),
            Optimizer::Sgd { momentum, .. } => Kernel::Sgd(SgdStep {
                master: self.master,
                grads: self.grad,
                momentum_buf: self.m,
                params: Some(self.value),
                grad_scale,
                lr,
                momentum,
                weight_decay,
            }),
        }
    }
}

/// Which optimizer updates the weights, with its hyper-parameters. `lr` is the base
/// rate; a schedule may scale or replace it step by step (see `config::Schedule`).
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub enum Optimizer {
    /// Adam; `decoupled` makes it AdamW (decay applied to the weights, not the gradient).
    Adam {
        lr: f32,
        betas: [f32; 2],
        eps: f32,
        weight_decay: f32,
        decoupled: bool,
    },
    /// SGD with (PyTorch-style, undampened) momentum.
    Sgd {
        lr: f32,
        momentum: f32,
        weight_decay: f32,
    },
}

impl Optimizer {
    /// AdamW with the betas small transformers train well with (0.9, 0.95).
    pub fn adamw(lr: f32, weight_decay: f32) -> Optimizer {
        Optimizer::Adam {
            lr,
            betas: [0.9, 0.95],
            eps: 1e-8,
            weight_decay,
            decoupled: true,
        }
    }

    pub fn lr(&self) -> f32 {
        match *self {
            Optimizer::Adam { lr, .. } | Optimizer::Sgd { lr, .. } => lr,
        }
    }

    pub fn weight_decay(&self) -> f32 {
        match *self {
            Optimizer::Adam { weight_decay, .. } | Optimizer::Sgd { weight_decay, .. } => {
                weight_decay
            }
        }
    }
}
