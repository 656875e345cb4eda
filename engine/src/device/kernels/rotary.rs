//! Rotary position embedding, at positions known when recording or read from the device.

use super::check::{float, rows_of, same_dtype, same_len};
use super::{KernelSpec, Operand};
use crate::{Buffer, DType, Error, Result, RopeFreqs};

/// The most positions a [`Kernel::Rope`](crate::Kernel::Rope) sequence may have: every position is then an
/// exact f32.
pub const ROPE_MAX_SEQ: usize = 1 << 24;

/// Rotary position embedding, the "rotate half" form of Hugging Face's Llama: `x`
/// holds rows of `cols` = heads x `dim` elements, row `r` at position
/// `t = r % seq`. Each head's `dim` (even) values split into halves; for
/// `i < dim / 2` and `a = t * f_i` (`f_i = theta^(-2i / dim)`, rescaled per band
/// where `freqs` has a scaling: [`RopeFreqs`]):
/// `out[i] = x[i] cos a - x[i + dim/2] sin a`,
/// `out[i + dim/2] = x[i + dim/2] cos a + x[i] sin a`.
/// With `inverse`, the rotation by `-a`: the backward pass (`dx` from `dout`).
/// GPUs compute the angle in f32, as Hugging Face's f32 path does: the inverse
/// frequency to a few f32 ulps and one rounding of the product, so the angle's error
/// is a few f32 epsilons times `|a|` (under 2e-3 rad for angles up to 4096 rad: the
/// f32 convention's own limit; frequency 1's angle, `t`, is exact). It is then
/// reduced modulo 2 pi in exact-product parts (within 3e-7 rad at any position), so
/// `sin` and `cos` never see a large argument. The CPU reference is exact (f64).
#[derive(Clone, Debug, PartialEq)]
pub struct Rope {
    pub x: Buffer,
    pub out: Buffer,
    pub cols: usize,
    pub dim: usize,
    pub seq: usize,
    pub freqs: RopeFreqs,
    pub inverse: bool,
}

impl KernelSpec for Rope {
    fn name(&self) -> &'static str {
        match self {
            Rope { inverse: false, .. } => "rope",
            Rope { inverse: true, .. } => "rope_backward",
        }
    }

    fn operands_mut(&mut self) -> Vec<Operand<'_>> {
        vec![Operand::read(&mut self.x), Operand::write(&mut self.out)]
    }

    fn check(&self) -> Result<()> {
        let k = self.name();
        let Rope {
            x,
            out,
            cols,
            dim,
            seq,
            freqs,
            ..
        } = self;
        if *dim == 0 || !dim.is_multiple_of(2) {
            return Err(Error::InvalidArgument(format!(
                "{k}: the head dim {dim} must be even and positive (each head's values \
                 rotate in pairs: i with i + dim/2)"
            )));
        }
        if *cols == 0 || !cols.is_multiple_of(*dim) {
            return Err(Error::InvalidArgument(format!(
                "{k}: rows of {cols} elements are not whole heads of {dim}; pass \
                 cols = heads x dim"
            )));
        }
        let rows = rows_of(k, x, *cols)?;
        float(k, "out", out)?;
        same_len(k, "out", out, x.len)?;
        if *seq == 0 || *seq > ROPE_MAX_SEQ || !rows.is_multiple_of(*seq) {
            return Err(Error::InvalidArgument(format!(
                "{k}: {rows} rows are not whole sequences of {seq} positions (seq \
                 must be 1..={ROPE_MAX_SEQ} and divide the rows)"
            )));
        }
        if let Some(why) = freqs.problem() {
            return Err(Error::InvalidArgument(format!("{k}: {why}")));
        }
        Ok(())
    }

    fn flops_per_element(&self) -> f64 {
        6.0
    }
}

/// [`Kernel::Rope`](crate::Kernel::Rope) (forward) with each row's position read from the device: row `r`
/// of `x` (rows of `cols` = heads x `dim`) turns by its angles at position
/// `positions[r]`, so one recorded launch serves every generation step, and packed
/// documents restart their positions. Same angle computation and accuracy as
/// [`Kernel::Rope`](crate::Kernel::Rope); `inverse` turns by minus the angles (the
/// backward pass).
#[derive(Clone, Debug, PartialEq)]
pub struct RopeAt {
    pub x: Buffer,
    pub out: Buffer,
    /// u32, one per row of `x`.
    pub positions: Buffer,
    pub cols: usize,
    pub dim: usize,
    pub freqs: RopeFreqs,
    pub inverse: bool,
}

impl KernelSpec for RopeAt {
    fn name(&self) -> &'static str {
        "rope_at"
    }

    fn operands_mut(&mut self) -> Vec<Operand<'_>> {
        vec![
            Operand::read(&mut self.x),
            Operand::write(&mut self.out),
            Operand::read(&mut self.positions),
        ]
    }

    fn check(&self) -> Result<()> {
        let k = self.name();
        let RopeAt {
            x,
            out,
            positions,
            cols,
            dim,
            freqs,
            ..
        } = self;
        if *dim == 0 || !dim.is_multiple_of(2) || *cols == 0 || !cols.is_multiple_of(*dim) {
            return Err(Error::InvalidArgument(format!(
                "{k}: rows of {cols} elements must be whole heads of an even, positive \
                 head dim {dim} (pass cols = heads x dim)"
            )));
        }
        let rows = rows_of(k, x, *cols)?;
        float(k, "out", out)?;
        same_len(k, "out", out, x.len)?;
        same_dtype(k, "positions", positions, DType::U32)?;
        same_len(k, "positions", positions, rows)?;
        if let Some(why) = freqs.problem() {
            return Err(Error::InvalidArgument(format!("{k}: {why}")));
        }
        Ok(())
    }

    fn flops_per_element(&self) -> f64 {
        6.0
    }
}
