//! Kernels that fill, copy and convert buffers.

use super::check::{floats_of_len, same_dtype, same_len};
use super::{KernelSpec, Operand};
use crate::{Buffer, DType, Error, Result};

/// `dst[i] = value` (rounded to `dst`'s dtype; must be an exact integer for u32).
#[derive(Clone, Debug, PartialEq)]
pub struct Fill {
    pub dst: Buffer,
    pub value: f64,
}

impl KernelSpec for Fill {
    fn name(&self) -> &'static str {
        "fill"
    }

    fn operands_mut(&mut self) -> Vec<Operand<'_>> {
        vec![Operand::write_split(&mut self.dst)]
    }

    fn check(&self) -> Result<()> {
        let Fill { dst, value } = self;
        if !value.is_finite() && !dst.dtype.is_float() {
            return Err(Error::InvalidArgument(format!(
                "fill: {value} cannot be stored in a u32 buffer"
            )));
        }
        if dst.dtype == DType::U32
            && (value.fract() != 0.0 || *value < 0.0 || *value > u32::MAX as f64)
        {
            return Err(Error::InvalidArgument(format!(
                "fill: {value} is not a u32; pass a whole number in 0..=4294967295"
            )));
        }
        Ok(())
    }

    fn flops_per_element(&self) -> f64 {
        0.0
    }
}

/// `dst = src`, bit for bit; same dtype and length.
#[derive(Clone, Debug, PartialEq)]
pub struct Copy {
    pub src: Buffer,
    pub dst: Buffer,
}

impl KernelSpec for Copy {
    fn name(&self) -> &'static str {
        "copy"
    }

    fn operands_mut(&mut self) -> Vec<Operand<'_>> {
        vec![
            Operand::read_split(&mut self.src),
            Operand::write_split(&mut self.dst),
        ]
    }

    fn check(&self) -> Result<()> {
        let k = self.name();
        let Copy { src, dst } = self;
        same_dtype(k, "dst", dst, src.dtype)?;
        same_len(k, "dst", dst, src.len)
    }

    fn flops_per_element(&self) -> f64 {
        0.0
    }
}

/// `dst[i] = src[i]` converted between float dtypes with round-to-nearest-even.
#[derive(Clone, Debug, PartialEq)]
pub struct Cast {
    pub src: Buffer,
    pub dst: Buffer,
}

impl KernelSpec for Cast {
    fn name(&self) -> &'static str {
        "cast"
    }

    fn operands_mut(&mut self) -> Vec<Operand<'_>> {
        vec![
            Operand::read_split(&mut self.src),
            Operand::write_split(&mut self.dst),
        ]
    }

    fn check(&self) -> Result<()> {
        floats_of_len(
            self.name(),
            self.src.len,
            &[("src", &self.src), ("dst", &self.dst)],
        )
    }

    fn flops_per_element(&self) -> f64 {
        0.0
    }
}
