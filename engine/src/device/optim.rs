//! Optimizer steps as kernel launches over flat buffers.
//!
//! Parameters, gradients and moments live in flat buffers (one per dtype group), so one
//! launch updates every tensor: the multi-tensor kernel is simply a kernel over one
//! long array. Gradients arrive scaled (by the fp16 loss scale) and are multiplied by
//! `grad_scale[0]`, a device value produced by [`crate::Kernel::GradScale`] from the
//! gradient norm, so unscaling and clipping need no host round trip.

use crate::{AdamStep, Buffer, DType, Device, HostData, Kernel, Result, SgdStep};

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
