//! The optimizer kernels' arguments (one Adam or SGD step over flat buffers) and
//! their checks; `optim.rs` launches them.

use super::{KernelSpec, Operand};
use crate::device::cost::{bytes_of, KernelCost};
use crate::{Buffer, DType, Error, Result};

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
        bias_corrections(self.beta1, self.beta2, self.step)
    }
}

/// Adam's `1 - beta1^step` and `1 - beta2^step`, computed in f64 once per step: what
/// every implementation of the step (kernels and host) divides by.
pub fn bias_corrections(beta1: f32, beta2: f32, step: u32) -> (f32, f32) {
    let t = step as i32;
    (
        (1.0 - (beta1 as f64).powi(t)) as f32,
        (1.0 - (beta2 as f64).powi(t)) as f32,
    )
}

impl SgdStep {
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

impl KernelSpec for AdamStep {
    fn name(&self) -> &'static str {
        "adam"
    }

    fn operands_mut(&mut self) -> Vec<Operand<'_>> {
        step_operands(
            &mut self.master,
            &mut self.grads,
            [&mut self.m, &mut self.v],
            &mut self.grad_scale,
            self.params.as_mut(),
        )
    }

    fn check(&self) -> Result<()> {
        self.validate()
    }

    fn flops_per_element(&self) -> f64 {
        14.0
    }

    fn cost(&self) -> KernelCost {
        step_cost(
            self,
            &self.master,
            &self.grads,
            &[&self.m, &self.v],
            self.params.as_ref(),
        )
    }
}

impl KernelSpec for SgdStep {
    fn name(&self) -> &'static str {
        "sgd"
    }

    fn operands_mut(&mut self) -> Vec<Operand<'_>> {
        step_operands(
            &mut self.master,
            &mut self.grads,
            [&mut self.momentum_buf],
            &mut self.grad_scale,
            self.params.as_mut(),
        )
    }

    fn check(&self) -> Result<()> {
        self.validate()
    }

    fn flops_per_element(&self) -> f64 {
        6.0
    }

    fn cost(&self) -> KernelCost {
        step_cost(
            self,
            &self.master,
            &self.grads,
            &[&self.momentum_buf],
            self.params.as_ref(),
        )
    }
}

/// An optimizer step's buffers: the f32 master weights and the state (moments,
/// momentum) updated in place, the gradients and the gradient scale read, the model's
/// copy written; all split at the binding limit (each element is its own update).
fn step_operands<'a, const N: usize>(
    master: &'a mut Buffer,
    grads: &'a mut Buffer,
    state: [&'a mut Buffer; N],
    grad_scale: &'a mut Buffer,
    params: Option<&'a mut Buffer>,
) -> Vec<Operand<'a>> {
    [Operand::write_split(master), Operand::read_split(grads)]
        .into_iter()
        .chain(state.map(Operand::write_split))
        .chain([Operand::read_split(grad_scale)])
        .chain(params.map(Operand::write_split))
        .collect()
}

/// An optimizer step's cost: the master weights and the state read and written, the
/// gradients read, the model's copy, if any, written.
fn step_cost(
    step: &impl KernelSpec,
    master: &Buffer,
    grads: &Buffer,
    state: &[&Buffer],
    params: Option<&Buffer>,
) -> KernelCost {
    let bytes = 2.0 * (bytes_of(master) + state.iter().map(|b| bytes_of(b)).sum::<f64>())
        + bytes_of(grads)
        + params.map_or(0.0, bytes_of);
    KernelCost::of(
        step.name(),
        step.flops_per_element() * master.len as f64,
        bytes,
    )
}
