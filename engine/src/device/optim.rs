//! Optimizer steps as kernel launches over flat buffers.
//!
//! Parameters, gradients and moments live in flat buffers (one per dtype group), so one
//! launch updates every tensor: the multi-tensor kernel is simply a kernel over one
//! long array. Gradients arrive scaled (by the fp16 loss scale) and are multiplied by
//! `grad_scale[0]`, a device value produced by [`crate::Kernel::GradScale`] from the
//! gradient norm, so unscaling and clipping need no host round trip.
//!
//! [`host_step`] is the same step over host memory: the CPU backend's kernel and
//! ZeRO-Offload's update of a shard kept in host memory.

use rayon::prelude::*;

use crate::device::kernels::optim_step::bias_corrections;
use crate::{AdamStep, Buffer, DType, Device, Error, HostData, Kernel, Result, SgdStep};

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
        let mut b = ParamBuffers::without_copy(dev, init, grad)?;
        b.value = dev.alloc(value, init.len())?;
        dev.upload(b.value, &HostData::from_f32(value, init))?;
        Ok(b)
    }

    /// [`ParamBuffers::new`] without a model copy: `value` is the master, and the
    /// caller steps it without writing a copy (ZeRO's parameter offload, whose host
    /// rounds the downloaded master).
    pub fn without_copy(dev: &dyn Device, init: &[f32], grad: DType) -> Result<ParamBuffers> {
        let n = init.len();
        let master = dev.alloc(DType::F32, n)?;
        dev.upload(master, &HostData::F32(init.to_vec()))?;
        Ok(ParamBuffers {
            value: master,
            master,
            grad: dev.alloc(grad, n)?,
            m: dev.alloc(DType::F32, n)?,
            v: dev.alloc(DType::F32, n)?,
        })
    }

    /// [`ParamBuffers::new`] without the optimizer state: the value and gradient
    /// allocated, `empty` (a zero-length f32 buffer the caller owns) standing for the
    /// master and both moments. For a network whose optimizer state is elsewhere
    /// (ZeRO's shards).
    pub fn without_state(
        dev: &dyn Device,
        init: &[f32],
        value: DType,
        grad: DType,
        empty: Buffer,
    ) -> Result<ParamBuffers> {
        let v = dev.alloc(value, init.len())?;
        dev.upload(v, &HostData::from_f32(value, init))?;
        Ok(ParamBuffers {
            value: v,
            master: empty,
            grad: dev.alloc(grad, init.len())?,
            m: empty,
            v: empty,
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

/// One flat slice of optimizer state in host memory: the f32 master weights and the
/// moments (SGD keeps its momentum in `m`; `v` is then unused and may be empty).
pub struct HostState<'a> {
    pub master: &'a mut [f32],
    pub m: &'a mut [f32],
    pub v: &'a mut [f32],
}

/// Elements one host thread updates at a time.
const HOST_CHUNK: usize = 1 << 14;

/// `optimizer`'s step over host memory at learning rate `lr` with `weight_decay` (0
/// for tensors that are not decayed); `step` is 1-based. `grads` are multiplied by
/// `grad_scale` first, as the kernels multiply by `grad_scale[0]`. Every element goes
/// through the f32 operations of `shaders/adam.wgsl` / `sgd.wgsl` in their order, each
/// rounded on its own (no fused multiply-add), and elements are independent: the work
/// is split over the host's cores (rayon) without changing a bit.
pub fn host_step(
    optimizer: &Optimizer,
    (lr, weight_decay, step): (f32, f32, u32),
    grad_scale: f32,
    grads: &[f32],
    st: HostState,
) -> Result<()> {
    let n = st.master.len();
    let sgd = matches!(optimizer, Optimizer::Sgd { .. });
    if grads.len() != n || st.m.len() != n || (!sgd && st.v.len() != n) {
        return Err(Error::InvalidArgument(format!(
            "host optimizer step: {n} master weights but {} gradients, {} and {} moments",
            grads.len(),
            st.m.len(),
            st.v.len()
        )));
    }
    match *optimizer {
        Optimizer::Adam {
            betas: [beta1, beta2],
            eps,
            decoupled,
            ..
        } => {
            if step == 0 {
                return Err(Error::InvalidArgument(
                    "adam: step counts from 1 (bias correction divides by 1 - beta^step)".into(),
                ));
            }
            let (bc1, bc2) = bias_corrections(beta1, beta2, step);
            let one = |g: f32, w: &mut f32, m: &mut f32, v: &mut f32| {
                let mut g = g * grad_scale;
                if !decoupled {
                    g += weight_decay * *w;
                }
                *m = beta1 * *m + (1.0 - beta1) * g;
                *v = beta2 * *v + (1.0 - beta2) * g * g;
                if decoupled {
                    *w -= lr * weight_decay * *w;
                }
                *w -= lr * (*m / bc1) / ((*v / bc2).sqrt() + eps);
            };
            st.master
                .par_chunks_mut(HOST_CHUNK)
                .zip(st.m.par_chunks_mut(HOST_CHUNK))
                .zip(st.v.par_chunks_mut(HOST_CHUNK))
                .zip(grads.par_chunks(HOST_CHUNK))
                .for_each(|(((w, m), v), g)| {
                    for (((w, m), v), &g) in w.iter_mut().zip(m).zip(v).zip(g) {
                        one(g, w, m, v);
                    }
                });
        }
        Optimizer::Sgd { momentum, .. } => {
            st.master
                .par_chunks_mut(HOST_CHUNK)
                .zip(st.m.par_chunks_mut(HOST_CHUNK))
                .zip(grads.par_chunks(HOST_CHUNK))
                .for_each(|((w, buf), g)| {
                    for ((w, b), &g) in w.iter_mut().zip(buf).zip(g) {
                        let g = g * grad_scale + weight_decay * *w;
                        *b = momentum * *b + g;
                        *w -= lr * *b;
                    }
                });
        }
    }
    Ok(())
}
