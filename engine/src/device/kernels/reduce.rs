//! Reductions: to one value (sums and maxima, the overflow check, the gradient scale)
//! and per row (the argmax).

use super::check::{float, rows_of, same_dtype, same_len};
use super::{KernelSpec, Operand};
use crate::{Buffer, DType, Error, Result};

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ReduceOp {
    Sum,
    Max,
    /// Sum of squares (for gradient norms).
    SumSquares,
}

/// `dst[0] = op over src`, accumulated in f32; `dst` is a 1-element f32 buffer.
/// The sum of an empty buffer is 0, its max is -inf. Inputs are expected to be
/// finite: check with [`Kernel::NonFinite`](crate::Kernel::NonFinite) first (the max of a NaN is unspecified).
#[derive(Clone, Debug, PartialEq)]
pub struct Reduce {
    pub op: ReduceOp,
    pub src: Buffer,
    pub dst: Buffer,
}

impl KernelSpec for Reduce {
    fn name(&self) -> &'static str {
        match self {
            Reduce {
                op: ReduceOp::Sum, ..
            } => "sum",
            Reduce {
                op: ReduceOp::Max, ..
            } => "max",
            Reduce {
                op: ReduceOp::SumSquares,
                ..
            } => "sumsq",
        }
    }

    fn operands_mut(&mut self) -> Vec<Operand<'_>> {
        vec![
            Operand::read_split(&mut self.src),
            Operand::write_split(&mut self.dst),
        ]
    }

    fn check(&self) -> Result<()> {
        let k = self.name();
        let Reduce { src, dst, .. } = self;
        float(k, "src", src)?;
        same_dtype(k, "dst", dst, DType::F32)?;
        same_len(k, "dst", dst, 1)
    }

    fn flops_per_element(&self) -> f64 {
        1.0
    }
}

/// `flag[0] = 1` if any element of any `srcs` is inf or NaN, else 0.
/// `flag` is a 1-element u32 buffer; one launch checks all of `srcs`.
#[derive(Clone, Debug, PartialEq)]
pub struct NonFinite {
    pub srcs: Vec<Buffer>,
    pub flag: Buffer,
}

impl KernelSpec for NonFinite {
    fn name(&self) -> &'static str {
        "nonfinite"
    }

    fn operands_mut(&mut self) -> Vec<Operand<'_>> {
        self.srcs
            .iter_mut()
            .map(Operand::read_split)
            .chain([Operand::write_split(&mut self.flag)])
            .collect()
    }

    fn check(&self) -> Result<()> {
        let k = self.name();
        let NonFinite { srcs, flag } = self;
        if srcs.is_empty() {
            return Err(Error::InvalidArgument(
                "nonfinite: no buffers to check; pass at least one".into(),
            ));
        }
        for (i, s) in srcs.iter().enumerate() {
            float(k, &format!("srcs[{i}]"), s)?;
        }
        same_dtype(k, "flag", flag, DType::U32)?;
        same_len(k, "flag", flag, 1)
    }

    fn flops_per_element(&self) -> f64 {
        1.0
    }
}

/// `out[0] = 1 / combined scale` from the gradients' sum of squares `sum_squares[0]`
/// (both 1-element f32); see [`crate::device::optim::grad_scale_reference`].
#[derive(Clone, Debug, PartialEq)]
pub struct GradScale {
    pub sum_squares: Buffer,
    pub out: Buffer,
    pub loss_scale: f32,
    pub clip: f32,
}

impl KernelSpec for GradScale {
    fn name(&self) -> &'static str {
        "grad_scale"
    }

    fn operands_mut(&mut self) -> Vec<Operand<'_>> {
        vec![
            Operand::read(&mut self.sum_squares),
            Operand::write(&mut self.out),
        ]
    }

    fn check(&self) -> Result<()> {
        let k = self.name();
        let GradScale {
            sum_squares,
            out,
            loss_scale,
            clip,
        } = self;
        same_dtype(k, "sum_squares", sum_squares, DType::F32)?;
        same_len(k, "sum_squares", sum_squares, 1)?;
        same_dtype(k, "out", out, DType::F32)?;
        same_len(k, "out", out, 1)?;
        let valid = *loss_scale > 0.0 && loss_scale.is_finite() && *clip >= 0.0 && clip.is_finite();
        if !valid {
            return Err(Error::InvalidArgument(format!(
                "grad_scale: loss_scale ({loss_scale}) must be positive and clip ({clip}) non-negative (0: no clipping)"
            )));
        }
        Ok(())
    }

    fn flops_per_element(&self) -> f64 {
        4.0
    }
}

/// The most columns [`ArgMax`] looks at: every index is then an exact f32 (the GPU
/// kernels reduce indices as floats).
pub const ARGMAX_MAX_CLASSES: usize = 1 << 24;

/// Row argmax: `out[r]` (u32) is the index of the largest of the first `classes` values
/// of row `r` of `x` (rows of `cols`; the columns from `classes` on pad the row, as a
/// padded vocabulary's do, and are never chosen), the first of equal ones. NaN is never
/// chosen; a row without a number gives 0. What evaluation reads instead of the
/// logits: 4 bytes a row rather than `cols` values.
#[derive(Clone, Debug, PartialEq)]
pub struct ArgMax {
    pub x: Buffer,
    pub out: Buffer,
    pub cols: usize,
    pub classes: usize,
}

impl KernelSpec for ArgMax {
    fn name(&self) -> &'static str {
        "argmax"
    }

    fn operands_mut(&mut self) -> Vec<Operand<'_>> {
        // Banded by rows where the logits are over the binding limit.
        vec![
            Operand::read_split(&mut self.x),
            Operand::write_split(&mut self.out),
        ]
    }

    fn check(&self) -> Result<()> {
        let k = self.name();
        let rows = rows_of(k, &self.x, self.cols)?;
        if self.classes == 0 || self.classes > self.cols.min(ARGMAX_MAX_CLASSES) {
            return Err(Error::InvalidArgument(format!(
                "{k}: {} classes in rows of {}; need 1 <= classes <= the row's length and \
                 <= {ARGMAX_MAX_CLASSES}",
                self.classes, self.cols
            )));
        }
        same_dtype(k, "out", &self.out, DType::U32)?;
        same_len(k, "out", &self.out, rows)
    }

    fn flops_per_element(&self) -> f64 {
        1.0
    }
}
