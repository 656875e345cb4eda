//! Inverted dropout and its backward, with the counter-based mask every device computes alike.

use super::check::floats_of_len;
use super::{KernelSpec, Operand};
use crate::{Buffer, Error, Result};

/// The 32-bit hash that decides dropout's mask: element `i` of a launch with `seed` is
/// kept iff `dropout_hash(seed, i) >= dropout_threshold(p)`. Counter-based (no state, no
/// mask buffer: backward recomputes it) and only u32 wrapping arithmetic, so the CPU and
/// every GPU path give the same bits. Two rounds of xorshift-multiply, the seed's low
/// word mixed in before the first and its high word before the second: a change to
/// either word reshuffles the whole mask rather than shifting or permuting it in a
/// simple way. (Multipliers: the fractional bits of sqrt 2 and sqrt 3, odd.)
pub fn dropout_hash(seed: u64, i: u32) -> u32 {
    fn round(mut h: u32) -> u32 {
        h ^= h >> 16;
        h = h.wrapping_mul(0x6A09_E667);
        h ^= h >> 15;
        h = h.wrapping_mul(0xBB67_AE85);
        h ^ (h >> 16)
    }
    round(round(i ^ seed as u32) ^ (seed >> 32) as u32)
}

/// Dropout drops element `i` when its hash is below this: `p * 2^32`, rounded, so that
/// an element is kept with probability `1 - p` to within 2^-33.
pub fn dropout_threshold(p: f32) -> u32 {
    (p as f64 * 4_294_967_296.0).round().min(u32::MAX as f64) as u32
}

/// The factor kept elements are multiplied by, `1 / (1 - p)` rounded to f32 once (the
/// product is then one f32 multiplication, the same on every device).
pub fn dropout_scale(p: f32) -> f32 {
    1.0 / (1.0 - p)
}

/// The seed of the dropout op at graph op index `op` under a plan's random state `key`
/// ([`crate::graph::Plan::set_random_state`]): both mixed through a 64-bit
/// xorshift-multiply so that nearby keys or ops give unrelated seeds.
pub fn dropout_seed(key: u64, op: usize) -> u64 {
    fn mix(mut x: u64) -> u64 {
        x ^= x >> 32;
        x = x.wrapping_mul(0x6A09_E667_F3BC_C909);
        x ^= x >> 29;
        x = x.wrapping_mul(0xBB67_AE85_84CA_A73B);
        x ^ (x >> 32)
    }
    mix(mix(key) ^ (op as u64 + 1).wrapping_mul(0x9E37_79B9_7F4A_7C15))
}

/// Inverted dropout: `out[i] = x[i] * dropout_scale(p)` where element `i` is kept
/// (see [`dropout_hash`]), else 0. `0 <= p < 1`; the mask depends only on `seed`,
/// `p` and `i`, so it is the same on every device.
#[derive(Clone, Debug, PartialEq)]
pub struct Dropout {
    pub x: Buffer,
    pub out: Buffer,
    pub p: f32,
    pub seed: u64,
}

impl KernelSpec for Dropout {
    fn name(&self) -> &'static str {
        "dropout"
    }

    fn operands_mut(&mut self) -> Vec<Operand<'_>> {
        vec![Operand::read(&mut self.x), Operand::write(&mut self.out)]
    }

    fn check(&self) -> Result<()> {
        check_dropout(self.name(), ("x", &self.x), ("out", &self.out), self.p)
    }

    fn flops_per_element(&self) -> f64 {
        2.0
    }
}

/// `dx[i] = dout[i] * dropout_scale(p)` where the forward with the same `p` and
/// `seed` kept element `i`, else 0: the mask is recomputed, not stored.
#[derive(Clone, Debug, PartialEq)]
pub struct DropoutBackward {
    pub dout: Buffer,
    pub dx: Buffer,
    pub p: f32,
    pub seed: u64,
}

impl KernelSpec for DropoutBackward {
    fn name(&self) -> &'static str {
        "dropout_backward"
    }

    fn operands_mut(&mut self) -> Vec<Operand<'_>> {
        vec![Operand::read(&mut self.dout), Operand::write(&mut self.dx)]
    }

    fn check(&self) -> Result<()> {
        check_dropout(self.name(), ("dout", &self.dout), ("dx", &self.dx), self.p)
    }

    fn flops_per_element(&self) -> f64 {
        2.0
    }
}

/// The checks of both kernels: float operands of one length, `0 <= p < 1`, and 32-bit
/// element indices (the mask hashes them).
fn check_dropout(
    k: &str,
    (input, x): (&str, &Buffer),
    (output, out): (&str, &Buffer),
    p: f32,
) -> Result<()> {
    floats_of_len(k, x.len, &[(input, x), (output, out)])?;
    if !(0.0..1.0).contains(&p) {
        return Err(Error::InvalidArgument(format!(
            "{k}: p = {p}; the probability of dropping an element must be in \
                 [0, 1) (0 keeps every element)"
        )));
    }
    if x.len > u32::MAX as usize {
        return Err(Error::InvalidArgument(format!(
            "{k}: {} elements; the mask hashes 32-bit element indices, so a \
                 launch takes at most 2^32 - 1: split the tensor",
            x.len
        )));
    }
    Ok(())
}
