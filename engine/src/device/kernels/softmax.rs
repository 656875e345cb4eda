//! Row softmax (optionally causal) and its backward.

use super::check::{float, rows_of, same_dtype, same_len};
use super::{KernelSpec, Operand};
use crate::{Buffer, DType, Error, Result};

/// Row softmax of `scale * x` over rows of `cols`, statistics in f32. With `causal`,
/// row r sees only columns `j <= r % cols` (rows are stacked T x T score matrices)
/// and the masked entries are 0. `stats` (f32, 2 per row: max and sum) is scratch
/// that the pass writes.
#[derive(Clone, Debug, PartialEq)]
pub struct Softmax {
    pub x: Buffer,
    pub out: Buffer,
    pub stats: Buffer,
    pub cols: usize,
    pub scale: f32,
    pub causal: bool,
}

impl KernelSpec for Softmax {
    fn name(&self) -> &'static str {
        "softmax"
    }

    fn operands_mut(&mut self) -> Vec<Operand<'_>> {
        vec![
            Operand::read(&mut self.x),
            Operand::write(&mut self.out),
            Operand::write(&mut self.stats),
        ]
    }

    fn check(&self) -> Result<()> {
        let k = self.name();
        let Softmax {
            x,
            out,
            stats,
            cols,
            scale,
            ..
        } = self;
        let rows = rows_of(k, x, *cols)?;
        float(k, "out", out)?;
        same_len(k, "out", out, x.len)?;
        same_dtype(k, "stats", stats, DType::F32)?;
        same_len(k, "stats", stats, 2 * rows)?;
        if !scale.is_finite() {
            return Err(Error::InvalidArgument(format!("softmax: scale is {scale}")));
        }
        Ok(())
    }

    fn flops_per_element(&self) -> f64 {
        5.0
    }
}

/// `dx = scale * p * (dout - sum_j p_j dout_j)` per row, from the softmax output `p`;
/// `stats` (f32, 2 per row) is scratch.
#[derive(Clone, Debug, PartialEq)]
pub struct SoftmaxBackward {
    pub p: Buffer,
    pub dout: Buffer,
    pub dx: Buffer,
    pub stats: Buffer,
    pub cols: usize,
    pub scale: f32,
}

impl KernelSpec for SoftmaxBackward {
    fn name(&self) -> &'static str {
        "softmax_backward"
    }

    fn operands_mut(&mut self) -> Vec<Operand<'_>> {
        vec![
            Operand::read(&mut self.p),
            Operand::read(&mut self.dout),
            Operand::write(&mut self.dx),
            Operand::write(&mut self.stats),
        ]
    }

    fn check(&self) -> Result<()> {
        let k = self.name();
        let SoftmaxBackward {
            p,
            dout,
            dx,
            stats,
            cols,
            scale,
        } = self;
        let rows = rows_of(k, p, *cols)?;
        for (name, b) in [("dout", dout), ("dx", dx)] {
            float(k, name, b)?;
            same_len(k, name, b, p.len)?;
        }
        same_dtype(k, "stats", stats, DType::F32)?;
        same_len(k, "stats", stats, 2 * rows)?;
        if !scale.is_finite() {
            return Err(Error::InvalidArgument(format!(
                "softmax_backward: scale is {scale}"
            )));
        }
        Ok(())
    }

    fn flops_per_element(&self) -> f64 {
        4.0
    }
}
