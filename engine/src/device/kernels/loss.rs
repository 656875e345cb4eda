//! Losses per row and their gradients: mean squared error and fused softmax cross-entropy.

use super::check::{classes_within, float, rows_of, same_dtype, same_len};
use super::{KernelSpec, Operand};
use crate::{Buffer, DType, Error, Result};

/// The target id that marks a position as not trained on (PyTorch's `ignore_index`):
/// cross-entropy gives it loss 0 and zero gradient.
pub const IGNORE_TARGET: u32 = u32::MAX;

/// The factor of [`Kernel::MseBackward`](crate::Kernel::MseBackward): `2 * scale / cols`, rounded to f32 once.
pub fn mse_grad_factor(scale: f32, cols: usize) -> f32 {
    (2.0 * scale as f64 / cols as f64) as f32
}

/// Mean squared error per row of `cols`: `losses[r] = sum_j (pred - target)^2 / cols`
/// over row r, accumulated in f32; `target` may have any float dtype.
#[derive(Clone, Debug, PartialEq)]
pub struct MseLoss {
    pub pred: Buffer,
    pub target: Buffer,
    pub losses: Buffer,
    pub cols: usize,
}

impl KernelSpec for MseLoss {
    fn name(&self) -> &'static str {
        "mse_loss"
    }

    fn operands_mut(&mut self) -> Vec<Operand<'_>> {
        vec![
            Operand::read(&mut self.pred),
            Operand::read(&mut self.target),
            Operand::write(&mut self.losses),
        ]
    }

    fn check(&self) -> Result<()> {
        let k = self.name();
        let MseLoss {
            pred,
            target,
            losses,
            cols,
        } = self;
        let rows = rows_of(k, pred, *cols)?;
        float(k, "target", target)?;
        same_len(k, "target", target, pred.len)?;
        same_dtype(k, "losses", losses, DType::F32)?;
        same_len(k, "losses", losses, rows)
    }

    fn flops_per_element(&self) -> f64 {
        3.0
    }
}

/// `dpred = (pred - target) * mse_grad_factor(scale, cols)`, i.e.
/// `2 (pred - target) / cols * scale` (scale: d loss / d losses_r times the loss
/// scale, as [`Kernel::CrossEntropyBackward`](crate::Kernel::CrossEntropyBackward)'s).
#[derive(Clone, Debug, PartialEq)]
pub struct MseBackward {
    pub pred: Buffer,
    pub target: Buffer,
    pub dpred: Buffer,
    pub cols: usize,
    pub scale: f32,
}

impl KernelSpec for MseBackward {
    fn name(&self) -> &'static str {
        "mse_backward"
    }

    fn operands_mut(&mut self) -> Vec<Operand<'_>> {
        vec![
            Operand::read_split(&mut self.pred),
            Operand::read_split(&mut self.target),
            Operand::write_split(&mut self.dpred),
        ]
    }

    fn check(&self) -> Result<()> {
        let k = self.name();
        let MseBackward {
            pred,
            target,
            dpred,
            cols,
            scale,
        } = self;
        rows_of(k, pred, *cols)?;
        for (name, b) in [("target", target), ("dpred", dpred)] {
            float(k, name, b)?;
            same_len(k, name, b, pred.len)?;
        }
        if !scale.is_finite() {
            return Err(Error::InvalidArgument(format!(
                "mse_backward: scale is {scale}"
            )));
        }
        Ok(())
    }

    fn flops_per_element(&self) -> f64 {
        3.0
    }
}

/// Fused softmax + cross-entropy over rows of `vocab` logits: `losses[r] =
/// logsumexp(logits[r]) - logits[r][targets[r]]`, statistics in f32; saves `lse` per
/// row for the backward pass. A target of [`IGNORE_TARGET`] gives loss 0 (a position
/// that is not trained on: padding, prompts); any other target outside the
/// vocabulary gives a NaN loss. Only the first `classes` columns are classes: the
/// rest pad the row (a vocabulary padded to a multiple of 64 for faster matmuls) and
/// are left out of the logsumexp, and a target among them gives a NaN loss.
#[derive(Clone, Debug, PartialEq)]
pub struct CrossEntropy {
    pub logits: Buffer,
    pub targets: Buffer,
    pub losses: Buffer,
    pub lse: Buffer,
    pub vocab: usize,
    pub classes: usize,
}

impl KernelSpec for CrossEntropy {
    fn name(&self) -> &'static str {
        "cross_entropy"
    }

    fn operands_mut(&mut self) -> Vec<Operand<'_>> {
        // Bound band by band of rows where the logits are over the binding limit.
        vec![
            Operand::read_split(&mut self.logits),
            Operand::read_split(&mut self.targets),
            Operand::write_split(&mut self.losses),
            Operand::write_split(&mut self.lse),
        ]
    }

    fn check(&self) -> Result<()> {
        let k = self.name();
        let CrossEntropy {
            logits,
            targets,
            losses,
            lse,
            vocab,
            classes,
        } = self;
        let rows = rows_of(k, logits, *vocab)?;
        classes_within(k, *classes, *vocab)?;
        same_dtype(k, "targets", targets, DType::U32)?;
        same_len(k, "targets", targets, rows)?;
        for (name, b) in [("losses", losses), ("lse", lse)] {
            same_dtype(k, name, b, DType::F32)?;
            same_len(k, name, b, rows)?;
        }
        Ok(())
    }

    fn flops_per_element(&self) -> f64 {
        5.0
    }
}

/// `dlogits = (softmax(logits) - onehot(target)) * scale` (scale: d loss / d loss_r,
/// e.g. loss scale / rows), from the saved `lse`; rows whose target is
/// [`IGNORE_TARGET`] get zero gradient, and so do the padding columns from `classes`
/// on (they took no part in the softmax).
#[derive(Clone, Debug, PartialEq)]
pub struct CrossEntropyBackward {
    pub logits: Buffer,
    pub targets: Buffer,
    pub lse: Buffer,
    pub dlogits: Buffer,
    pub vocab: usize,
    pub classes: usize,
    pub scale: f32,
}

impl KernelSpec for CrossEntropyBackward {
    fn name(&self) -> &'static str {
        "cross_entropy_backward"
    }

    fn operands_mut(&mut self) -> Vec<Operand<'_>> {
        // Banded by rows as the forward is.
        vec![
            Operand::read_split(&mut self.logits),
            Operand::read_split(&mut self.targets),
            Operand::read_split(&mut self.lse),
            Operand::write_split(&mut self.dlogits),
        ]
    }

    fn check(&self) -> Result<()> {
        let k = self.name();
        let CrossEntropyBackward {
            logits,
            targets,
            lse,
            dlogits,
            vocab,
            classes,
            scale,
        } = self;
        let rows = rows_of(k, logits, *vocab)?;
        classes_within(k, *classes, *vocab)?;
        same_dtype(k, "targets", targets, DType::U32)?;
        same_len(k, "targets", targets, rows)?;
        same_dtype(k, "lse", lse, DType::F32)?;
        same_len(k, "lse", lse, rows)?;
        float(k, "dlogits", dlogits)?;
        same_len(k, "dlogits", dlogits, logits.len)?;
        if !scale.is_finite() {
            return Err(Error::InvalidArgument(format!(
                "cross_entropy_backward: scale is {scale}"
            )));
        }
        Ok(())
    }

    fn flops_per_element(&self) -> f64 {
        4.0
    }
}
