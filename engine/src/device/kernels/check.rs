//! The argument checks the kernels share: each names the kernel, the operand and its
//! buffer, so every backend rejects the same bad launches with the same words.

use crate::{Buffer, DType, Error, Result};

/// Every buffer a float of `len` elements (an elementwise kernel's operands), checked in
/// order, each error naming its buffer.
pub(super) fn floats_of_len(kernel: &str, len: usize, bufs: &[(&str, &Buffer)]) -> Result<()> {
    for &(name, b) in bufs {
        float(kernel, name, b)?;
        same_len(kernel, name, b, len)?;
    }
    Ok(())
}

/// Rows of a row-major matrix with `cols` columns held in `x`.
pub(super) fn rows_of(kernel: &str, x: &Buffer, cols: usize) -> Result<usize> {
    float(kernel, "x", x)?;
    if cols == 0 || !x.len.is_multiple_of(cols) {
        return Err(Error::InvalidArgument(format!(
            "{kernel}: `x` (buffer #{}) has {} elements, not a whole number of rows of {cols}",
            x.id, x.len
        )));
    }
    Ok(x.len / cols)
}

/// A cross-entropy's classes: at least one, and no more than the row's columns.
pub(super) fn classes_within(kernel: &str, classes: usize, cols: usize) -> Result<()> {
    if classes == 0 || classes > cols {
        return Err(Error::InvalidArgument(format!(
            "{kernel}: {classes} classes in rows of {cols} logits; need 1 <= classes <= the \
             row's length (the padded vocabulary)"
        )));
    }
    Ok(())
}

pub(super) fn same_dtype(kernel: &str, what: &str, b: &Buffer, expected: DType) -> Result<()> {
    if b.dtype != expected {
        return Err(Error::DTypeMismatch {
            what: format!("{kernel}: `{what}` (buffer #{})", b.id),
            expected,
            found: b.dtype,
        });
    }
    Ok(())
}

pub(super) fn same_len(kernel: &str, what: &str, b: &Buffer, expected: usize) -> Result<()> {
    if b.len != expected {
        return Err(Error::LenMismatch {
            what: format!("{kernel}: `{what}` (buffer #{})", b.id),
            expected,
            found: b.len,
        });
    }
    Ok(())
}

pub(super) fn float(kernel: &str, what: &str, b: &Buffer) -> Result<()> {
    if !b.dtype.is_float() {
        return Err(Error::InvalidArgument(format!(
            "{kernel}: `{what}` (buffer #{}) is {}, but this kernel takes f32, f16 or bf16",
            b.id, b.dtype
        )));
    }
    Ok(())
}
