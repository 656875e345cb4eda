//! Elementwise arithmetic and activations, forward and backward.

use super::check::floats_of_len;
use super::{KernelSpec, Operand};
use crate::{Buffer, Result};

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum BinaryOp {
    Add,
    Mul,
}

/// An elementwise activation of [`Kernel::Activation`](crate::Kernel::Activation) (GELU, which the GPT uses, has
/// kernels of its own).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ActivationKind {
    /// `max(x, 0)`; its derivative at 0 is taken as 0 (as PyTorch does).
    Relu,
    Tanh,
    /// `x * sigmoid(x)` (swish).
    Silu,
}

impl ActivationKind {
    pub const ALL: [ActivationKind; 3] = [
        ActivationKind::Relu,
        ActivationKind::Tanh,
        ActivationKind::Silu,
    ];

    pub fn name(self) -> &'static str {
        match self {
            ActivationKind::Relu => "relu",
            ActivationKind::Tanh => "tanh",
            ActivationKind::Silu => "silu",
        }
    }
}

/// `out[i] = a[i] op b[i]`.
#[derive(Clone, Debug, PartialEq)]
pub struct Binary {
    pub op: BinaryOp,
    pub a: Buffer,
    pub b: Buffer,
    pub out: Buffer,
}

impl KernelSpec for Binary {
    fn name(&self) -> &'static str {
        match self {
            Binary {
                op: BinaryOp::Add, ..
            } => "add",
            Binary {
                op: BinaryOp::Mul, ..
            } => "mul",
        }
    }

    fn operands_mut(&mut self) -> Vec<Operand<'_>> {
        vec![
            Operand::read_split(&mut self.a),
            Operand::read_split(&mut self.b),
            Operand::write_split(&mut self.out),
        ]
    }

    fn check(&self) -> Result<()> {
        floats_of_len(
            self.name(),
            self.a.len,
            &[("a", &self.a), ("b", &self.b), ("out", &self.out)],
        )
    }

    fn flops_per_element(&self) -> f64 {
        1.0
    }
}

/// `out[i] = alpha * x[i]`.
#[derive(Clone, Debug, PartialEq)]
pub struct Scale {
    pub alpha: f32,
    pub x: Buffer,
    pub out: Buffer,
}

impl KernelSpec for Scale {
    fn name(&self) -> &'static str {
        "scale"
    }

    fn operands_mut(&mut self) -> Vec<Operand<'_>> {
        vec![
            Operand::read_split(&mut self.x),
            Operand::write_split(&mut self.out),
        ]
    }

    fn check(&self) -> Result<()> {
        floats_of_len(
            self.name(),
            self.x.len,
            &[("x", &self.x), ("out", &self.out)],
        )
    }

    fn flops_per_element(&self) -> f64 {
        1.0
    }
}

/// `y[i] = alpha * x[i] + y[i]`.
#[derive(Clone, Debug, PartialEq)]
pub struct Axpy {
    pub alpha: f32,
    pub x: Buffer,
    pub y: Buffer,
}

impl KernelSpec for Axpy {
    fn name(&self) -> &'static str {
        "axpy"
    }

    fn operands_mut(&mut self) -> Vec<Operand<'_>> {
        vec![
            Operand::read_split(&mut self.x),
            Operand::write_split(&mut self.y),
        ]
    }

    fn check(&self) -> Result<()> {
        floats_of_len(self.name(), self.x.len, &[("x", &self.x), ("y", &self.y)])
    }

    fn flops_per_element(&self) -> f64 {
        2.0
    }
}

/// `out = gelu(x)`, tanh form, elementwise.
#[derive(Clone, Debug, PartialEq)]
pub struct Gelu {
    pub x: Buffer,
    pub out: Buffer,
}

impl KernelSpec for Gelu {
    fn name(&self) -> &'static str {
        "gelu"
    }

    fn operands_mut(&mut self) -> Vec<Operand<'_>> {
        vec![
            Operand::read_split(&mut self.x),
            Operand::write_split(&mut self.out),
        ]
    }

    fn check(&self) -> Result<()> {
        floats_of_len(
            self.name(),
            self.x.len,
            &[("x", &self.x), ("out", &self.out)],
        )
    }

    fn flops_per_element(&self) -> f64 {
        8.0
    }
}

/// `dx = dout * gelu'(x)`, elementwise.
#[derive(Clone, Debug, PartialEq)]
pub struct GeluBackward {
    pub x: Buffer,
    pub dout: Buffer,
    pub dx: Buffer,
}

impl KernelSpec for GeluBackward {
    fn name(&self) -> &'static str {
        "gelu_backward"
    }

    fn operands_mut(&mut self) -> Vec<Operand<'_>> {
        vec![
            Operand::read_split(&mut self.x),
            Operand::read_split(&mut self.dout),
            Operand::write_split(&mut self.dx),
        ]
    }

    fn check(&self) -> Result<()> {
        floats_of_len(
            self.name(),
            self.x.len,
            &[("x", &self.x), ("dout", &self.dout), ("dx", &self.dx)],
        )
    }

    fn flops_per_element(&self) -> f64 {
        8.0
    }
}

/// `out = f(x)` elementwise for the activation `kind`, in f32.
#[derive(Clone, Debug, PartialEq)]
pub struct Activation {
    pub kind: ActivationKind,
    pub x: Buffer,
    pub out: Buffer,
}

impl KernelSpec for Activation {
    fn name(&self) -> &'static str {
        let Activation { kind, .. } = self;
        kind.name()
    }

    fn operands_mut(&mut self) -> Vec<Operand<'_>> {
        vec![
            Operand::read_split(&mut self.x),
            Operand::write_split(&mut self.out),
        ]
    }

    fn check(&self) -> Result<()> {
        floats_of_len(
            self.name(),
            self.x.len,
            &[("x", &self.x), ("out", &self.out)],
        )
    }

    fn flops_per_element(&self) -> f64 {
        4.0
    }
}

/// `dx = dout * f'(x)`, elementwise, from the forward's input `x`.
#[derive(Clone, Debug, PartialEq)]
pub struct ActivationBackward {
    pub kind: ActivationKind,
    pub x: Buffer,
    pub dout: Buffer,
    pub dx: Buffer,
}

impl KernelSpec for ActivationBackward {
    fn name(&self) -> &'static str {
        let ActivationBackward { kind, .. } = self;
        match kind {
            ActivationKind::Relu => "relu_backward",
            ActivationKind::Tanh => "tanh_backward",
            ActivationKind::Silu => "silu_backward",
        }
    }

    fn operands_mut(&mut self) -> Vec<Operand<'_>> {
        vec![
            Operand::read_split(&mut self.x),
            Operand::read_split(&mut self.dout),
            Operand::write_split(&mut self.dx),
        ]
    }

    fn check(&self) -> Result<()> {
        floats_of_len(
            self.name(),
            self.x.len,
            &[("x", &self.x), ("dout", &self.dout), ("dx", &self.dx)],
        )
    }

    fn flops_per_element(&self) -> f64 {
        4.0
    }
}

/// SwiGLU's gate (Llama's MLP): `out = silu(gate) * up` elementwise, with
/// `silu(g) = g * sigmoid(g)` in f32.
#[derive(Clone, Debug, PartialEq)]
pub struct SwiGlu {
    pub gate: Buffer,
    pub up: Buffer,
    pub out: Buffer,
}

impl KernelSpec for SwiGlu {
    fn name(&self) -> &'static str {
        "swiglu"
    }

    fn operands_mut(&mut self) -> Vec<Operand<'_>> {
        vec![
            Operand::read_split(&mut self.gate),
            Operand::read_split(&mut self.up),
            Operand::write_split(&mut self.out),
        ]
    }

    fn check(&self) -> Result<()> {
        floats_of_len(
            self.name(),
            self.gate.len,
            &[("gate", &self.gate), ("up", &self.up), ("out", &self.out)],
        )
    }

    fn flops_per_element(&self) -> f64 {
        6.0
    }
}

/// Its backward in one pass: `dgate = dout * up * silu'(gate)` and
/// `dup = dout * silu(gate)`, both overwritten.
#[derive(Clone, Debug, PartialEq)]
pub struct SwiGluBackward {
    pub gate: Buffer,
    pub up: Buffer,
    pub dout: Buffer,
    pub dgate: Buffer,
    pub dup: Buffer,
}

impl KernelSpec for SwiGluBackward {
    fn name(&self) -> &'static str {
        "swiglu_backward"
    }

    fn operands_mut(&mut self) -> Vec<Operand<'_>> {
        vec![
            Operand::read_split(&mut self.gate),
            Operand::read_split(&mut self.up),
            Operand::read_split(&mut self.dout),
            Operand::write_split(&mut self.dgate),
            Operand::write_split(&mut self.dup),
        ]
    }

    fn check(&self) -> Result<()> {
        floats_of_len(
            self.name(),
            self.gate.len,
            &[
                ("gate", &self.gate),
                ("up", &self.up),
                ("dout", &self.dout),
                ("dgate", &self.dgate),
                ("dup", &self.dup),
            ],
        )
    }

    fn flops_per_element(&self) -> f64 {
        10.0
    }
}
