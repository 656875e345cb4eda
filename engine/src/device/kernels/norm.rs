//! LayerNorm and RMSNorm over rows, forward and backward.

use super::check::{float, rows_of, same_dtype, same_len};
use super::{KernelSpec, Operand};
use crate::{Buffer, DType, Error, Result};

/// Layer norm over rows of `cols` elements: `out = (x - mean) * rstd * weight + bias`.
/// Saves each row's `mean` and `rstd` (f32, one per row) for the backward pass.
#[derive(Clone, Debug, PartialEq)]
pub struct LayerNorm {
    pub x: Buffer,
    pub weight: Buffer,
    pub bias: Buffer,
    pub out: Buffer,
    pub mean: Buffer,
    pub rstd: Buffer,
    pub cols: usize,
    pub eps: f32,
}

impl KernelSpec for LayerNorm {
    fn name(&self) -> &'static str {
        "layernorm"
    }

    fn operands_mut(&mut self) -> Vec<Operand<'_>> {
        vec![
            Operand::read(&mut self.x),
            Operand::read(&mut self.weight),
            Operand::read(&mut self.bias),
            Operand::write(&mut self.out),
            Operand::write(&mut self.mean),
            Operand::write(&mut self.rstd),
        ]
    }

    fn check(&self) -> Result<()> {
        let k = self.name();
        let LayerNorm {
            x,
            weight,
            bias,
            out,
            mean,
            rstd,
            cols,
            eps,
        } = self;
        let rows = rows_of(k, x, *cols)?;
        for (name, b, n) in [
            ("weight", weight, *cols),
            ("bias", bias, *cols),
            ("out", out, x.len),
        ] {
            float(k, name, b)?;
            same_len(k, name, b, n)?;
        }
        for (name, b) in [("mean", mean), ("rstd", rstd)] {
            same_dtype(k, name, b, DType::F32)?;
            same_len(k, name, b, rows)?;
        }
        if !(*eps > 0.0 && eps.is_finite()) {
            return Err(Error::InvalidArgument(format!(
                "layernorm: eps must be positive, not {eps}"
            )));
        }
        Ok(())
    }

    fn flops_per_element(&self) -> f64 {
        8.0
    }
}

/// Layer-norm backward: `dx` is overwritten; `dweight` and `dbias` (f32, `cols`)
/// are accumulated into (`+=`), as gradients over micro-batches are.
#[derive(Clone, Debug, PartialEq)]
pub struct LayerNormBackward {
    pub x: Buffer,
    pub weight: Buffer,
    pub mean: Buffer,
    pub rstd: Buffer,
    pub dout: Buffer,
    pub dx: Buffer,
    pub dweight: Buffer,
    pub dbias: Buffer,
    pub cols: usize,
}

impl KernelSpec for LayerNormBackward {
    fn name(&self) -> &'static str {
        "layernorm_backward"
    }

    fn operands_mut(&mut self) -> Vec<Operand<'_>> {
        vec![
            Operand::read(&mut self.x),
            Operand::read(&mut self.weight),
            Operand::read(&mut self.mean),
            Operand::read(&mut self.rstd),
            Operand::read(&mut self.dout),
            Operand::write(&mut self.dx),
            Operand::write(&mut self.dweight),
            Operand::write(&mut self.dbias),
        ]
    }

    fn check(&self) -> Result<()> {
        let k = self.name();
        let LayerNormBackward {
            x,
            weight,
            mean,
            rstd,
            dout,
            dx,
            dweight,
            dbias,
            cols,
        } = self;
        let rows = rows_of(k, x, *cols)?;
        for (name, b, n) in [
            ("weight", weight, *cols),
            ("dout", dout, x.len),
            ("dx", dx, x.len),
        ] {
            float(k, name, b)?;
            same_len(k, name, b, n)?;
        }
        for (name, b, n) in [
            ("mean", mean, rows),
            ("rstd", rstd, rows),
            ("dweight", dweight, *cols),
            ("dbias", dbias, *cols),
        ] {
            same_dtype(k, name, b, DType::F32)?;
            same_len(k, name, b, n)?;
        }
        Ok(())
    }

    fn flops_per_element(&self) -> f64 {
        12.0
    }
}

/// RMS norm over rows of `cols` elements (Llama's): `out = x * rstd * weight` with
/// `rstd = 1 / sqrt(mean(x^2) + eps)`, the mean of squares in f32. Saves each row's
/// `rstd` (f32, one per row) for the backward pass.
#[derive(Clone, Debug, PartialEq)]
pub struct RmsNorm {
    pub x: Buffer,
    pub weight: Buffer,
    pub out: Buffer,
    pub rstd: Buffer,
    pub cols: usize,
    pub eps: f32,
}

impl KernelSpec for RmsNorm {
    fn name(&self) -> &'static str {
        "rmsnorm"
    }

    fn operands_mut(&mut self) -> Vec<Operand<'_>> {
        vec![
            Operand::read(&mut self.x),
            Operand::read(&mut self.weight),
            Operand::write(&mut self.out),
            Operand::write(&mut self.rstd),
        ]
    }

    fn check(&self) -> Result<()> {
        let k = self.name();
        let RmsNorm {
            x,
            weight,
            out,
            rstd,
            cols,
            eps,
        } = self;
        let rows = rows_of(k, x, *cols)?;
        for (name, b, n) in [("weight", weight, *cols), ("out", out, x.len)] {
            float(k, name, b)?;
            same_len(k, name, b, n)?;
        }
        same_dtype(k, "rstd", rstd, DType::F32)?;
        same_len(k, "rstd", rstd, rows)?;
        if !(*eps > 0.0 && eps.is_finite()) {
            return Err(Error::InvalidArgument(format!(
                "rmsnorm: eps must be positive, not {eps} (a zero row would divide by 0)"
            )));
        }
        Ok(())
    }

    fn flops_per_element(&self) -> f64 {
        8.0
    }
}

/// RMS-norm backward from the saved `rstd`, with `xhat = x * rstd`:
/// `dx = rstd * (dy * w - xhat * mean(dy * w * xhat))` is overwritten; `dweight`
/// (f32, `cols`) is accumulated into (`+= sum over rows of dy * xhat`).
#[derive(Clone, Debug, PartialEq)]
pub struct RmsNormBackward {
    pub x: Buffer,
    pub weight: Buffer,
    pub rstd: Buffer,
    pub dout: Buffer,
    pub dx: Buffer,
    pub dweight: Buffer,
    pub cols: usize,
}

impl KernelSpec for RmsNormBackward {
    fn name(&self) -> &'static str {
        "rmsnorm_backward"
    }

    fn operands_mut(&mut self) -> Vec<Operand<'_>> {
        vec![
            Operand::read(&mut self.x),
            Operand::read(&mut self.weight),
            Operand::read(&mut self.rstd),
            Operand::read(&mut self.dout),
            Operand::write(&mut self.dx),
            Operand::write(&mut self.dweight),
        ]
    }

    fn check(&self) -> Result<()> {
        let k = self.name();
        let RmsNormBackward {
            x,
            weight,
            rstd,
            dout,
            dx,
            dweight,
            cols,
        } = self;
        let rows = rows_of(k, x, *cols)?;
        for (name, b, n) in [
            ("weight", weight, *cols),
            ("dout", dout, x.len),
            ("dx", dx, x.len),
        ] {
            float(k, name, b)?;
            same_len(k, name, b, n)?;
        }
        for (name, b, n) in [("rstd", rstd, rows), ("dweight", dweight, *cols)] {
            same_dtype(k, name, b, DType::F32)?;
            same_len(k, name, b, n)?;
        }
        Ok(())
    }

    fn flops_per_element(&self) -> f64 {
        12.0
    }
}
