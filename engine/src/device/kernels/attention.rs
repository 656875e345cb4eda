//! Fused scaled-dot-product attention, forward and backward.

use super::check::{float, same_dtype, same_len};
use super::{KernelSpec, Operand};
use crate::device::cost::{bytes_of, causal_share, KernelCost};
use crate::{Buffer, DType, Error, Result};

/// The largest head dim the fused attention kernels take (their rows live in registers).
pub const ATTENTION_MAX_DIM: usize = 128;

/// Fused scaled-dot-product attention over `batch_heads` query heads:
/// `out = softmax(q k^T * scale [+ causal mask]) v` row by row, q and out
/// `(batch_heads, seq, dim)`, k and v `(batch_heads / group, seq, dim)`, in any float
/// dtype. Query head `h` reads K/V head `h / group` (grouped-query attention: with
/// heads ordered (batch, head), that is K/V head `head / group` of its batch; `group`
/// 1 is multi-head attention). Computed tile by tile with the online-softmax
/// recurrence (running max and sum in f32): no `seq x seq` buffer. With `causal`,
/// query row `i` sees keys `j <= i`. Saves `lse` (f32, one per `(head, row)`): the
/// natural log of the row's softmax denominator, including the max, which
/// [`Kernel::AttentionBackward`](crate::Kernel::AttentionBackward) recomputes the probabilities from. `dim` is
/// 1..=128, and even when `out` is 16-bit. With `documents` (packed sequences), row
/// `i` sees only the keys of its own document.
#[derive(Clone, Debug, PartialEq)]
pub struct Attention {
    pub q: Buffer,
    pub k: Buffer,
    pub v: Buffer,
    pub out: Buffer,
    pub lse: Buffer,
    pub batch_heads: usize,
    /// Query heads per K/V head (1: every query head has its own).
    pub group: usize,
    pub seq: usize,
    pub dim: usize,
    pub scale: f32,
    pub causal: bool,
    /// The documents packed into each sequence; `None`: one per sequence.
    pub documents: Option<Documents>,
}

/// The documents packed into the sequences of an attention kernel (packed training
/// examples): `starts` holds, for each `(sequence, row)`, the first row of the row's
/// document (u32, `(batch_heads / heads, seq)`), and each sequence has `heads` query
/// heads (heads ordered (sequence, head)). Causal query row `i` then sees the keys
/// `starts[i] <= j <= i`: no row attends across a document boundary, and no
/// `seq x seq` mask exists. The kernels trust what the data layer writes: within a
/// sequence the starts never decrease, and `starts[i] <= i` (a row starts its own
/// document or continues the one before it).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Documents {
    pub starts: Buffer,
    pub heads: usize,
}

impl Documents {
    /// The documents' operand, when there are any.
    fn operand(documents: &mut Option<Documents>) -> Vec<Operand<'_>> {
        documents
            .iter_mut()
            .map(|d| Operand::read(&mut d.starts))
            .collect()
    }

    /// Checks of `documents` against the kernel's geometry: u32 starts, one per
    /// (sequence, row); the query heads of a sequence a whole number of K/V groups;
    /// causal attention (a document's rows see no later rows anyway, and the kernels
    /// bound only the start of a row's keys).
    fn check(
        kernel: &str,
        documents: &Option<Documents>,
        (batch_heads, group, seq, causal): (usize, usize, usize, bool),
    ) -> Result<()> {
        let Some(Documents { starts, heads }) = documents else {
            return Ok(());
        };
        if !causal {
            return Err(Error::InvalidArgument(format!(
                "{kernel}: documents need causal attention; packing is for causal language \
                 models (pad the sequences of a bidirectional model instead)"
            )));
        }
        if *heads == 0 || !batch_heads.is_multiple_of(*heads) || !heads.is_multiple_of(group) {
            return Err(Error::InvalidArgument(format!(
                "{kernel}: documents for {heads} query heads per sequence, but batch_heads is \
                 {batch_heads} and group {group}; heads must divide batch_heads and be a \
                 multiple of group"
            )));
        }
        same_dtype(kernel, "documents.starts", starts, DType::U32)?;
        same_len(
            kernel,
            "documents.starts",
            starts,
            batch_heads / heads * seq,
        )
    }
}

impl KernelSpec for Attention {
    fn name(&self) -> &'static str {
        "attention"
    }

    fn operands_mut(&mut self) -> Vec<Operand<'_>> {
        vec![
            Operand::read(&mut self.q),
            Operand::read(&mut self.k),
            Operand::read(&mut self.v),
            Operand::write(&mut self.out),
            Operand::write(&mut self.lse),
        ]
        .into_iter()
        .chain(Documents::operand(&mut self.documents))
        .collect()
    }

    fn check(&self) -> Result<()> {
        let k = self.name();
        let Attention {
            q,
            k: key,
            v,
            out,
            lse,
            batch_heads,
            group,
            seq,
            dim,
            scale,
            causal,
            documents,
        } = self;
        Documents::check(k, documents, (*batch_heads, *group, *seq, *causal))?;
        attention_args(
            k,
            &[("q", q, Q), ("k", key, KV), ("v", v, KV)],
            &[("out", out, Q)],
            lse,
            (*batch_heads, *group, *seq, *dim, *scale),
        )
    }

    fn flops_per_element(&self) -> f64 {
        0.0
    }

    fn cost(&self) -> KernelCost {
        // q·kᵀ and p·v: two GEMMs of seq × seq × dim per head.
        let flops = 4.0 * scores(self.batch_heads, self.seq, self.causal) * self.dim as f64;
        KernelCost::of(
            self.name(),
            flops,
            self.buffers().iter().map(bytes_of).sum(),
        )
    }
}

/// Gradients of [`Kernel::Attention`](crate::Kernel::Attention): `dq`, `dk`, `dv` (overwritten) from `dout`, the
/// forward's `out` and `lse`, recomputing the probabilities from q and k; no
/// `seq x seq` buffer. Uses `rowsum(dout * out)` per row (f32, kept in the device's
/// scratch). `dq` is shaped as q, `dk` and `dv` as k and v: K/V head `j` gets the
/// sum over its query heads `j * group .. (j + 1) * group`, in f32 and in that
/// order. `dim` must be even when a gradient is 16-bit.
#[derive(Clone, Debug, PartialEq)]
pub struct AttentionBackward {
    pub q: Buffer,
    pub k: Buffer,
    pub v: Buffer,
    pub out: Buffer,
    pub dout: Buffer,
    pub lse: Buffer,
    pub dq: Buffer,
    pub dk: Buffer,
    pub dv: Buffer,
    pub batch_heads: usize,
    /// Query heads per K/V head, as in [`Kernel::Attention`](crate::Kernel::Attention).
    pub group: usize,
    pub seq: usize,
    pub dim: usize,
    pub scale: f32,
    pub causal: bool,
    /// As in [`Kernel::Attention`](crate::Kernel::Attention).
    pub documents: Option<Documents>,
}

impl KernelSpec for AttentionBackward {
    fn name(&self) -> &'static str {
        "attention_backward"
    }

    fn operands_mut(&mut self) -> Vec<Operand<'_>> {
        vec![
            Operand::read(&mut self.q),
            Operand::read(&mut self.k),
            Operand::read(&mut self.v),
            Operand::read(&mut self.out),
            Operand::read(&mut self.dout),
            Operand::read(&mut self.lse),
            Operand::write(&mut self.dq),
            Operand::write(&mut self.dk),
            Operand::write(&mut self.dv),
        ]
        .into_iter()
        .chain(Documents::operand(&mut self.documents))
        .collect()
    }

    fn check(&self) -> Result<()> {
        let k = self.name();
        let AttentionBackward {
            q,
            k: key,
            v,
            out,
            dout,
            lse,
            dq,
            dk,
            dv,
            batch_heads,
            group,
            seq,
            dim,
            scale,
            causal,
            documents,
        } = self;
        Documents::check(k, documents, (*batch_heads, *group, *seq, *causal))?;
        attention_args(
            k,
            &[
                ("q", q, Q),
                ("k", key, KV),
                ("v", v, KV),
                ("out", out, Q),
                ("dout", dout, Q),
            ],
            &[("dq", dq, Q), ("dk", dk, KV), ("dv", dv, KV)],
            lse,
            (*batch_heads, *group, *seq, *dim, *scale),
        )
    }

    fn flops_per_element(&self) -> f64 {
        0.0
    }

    fn cost(&self) -> KernelCost {
        // Recomputed q·kᵀ, then dv = pᵀ·dout, dp = dout·vᵀ, dq = ds·k, dk = dsᵀ·q.
        let flops = 10.0 * scores(self.batch_heads, self.seq, self.causal) * self.dim as f64;
        KernelCost::of(
            self.name(),
            flops,
            self.buffers().iter().map(bytes_of).sum(),
        )
    }
}

/// The query-key pairs scored over `batch_heads` heads of `seq` rows (a causal row `i`
/// scores `i + 1` keys).
fn scores(batch_heads: usize, seq: usize, causal: bool) -> f64 {
    (batch_heads * seq * seq) as f64 * causal_share(seq, causal)
}

/// Whether an attention tensor is shaped as the query heads (q, out, dout, dq) or as
/// the K/V heads (k, v, dk, dv).
const Q: bool = false;
const KV: bool = true;

/// Checks of [`Kernel::Attention`](crate::Kernel::Attention) and [`Kernel::AttentionBackward`](crate::Kernel::AttentionBackward): the query-side
/// tensors are `(batch_heads, seq, dim)`, the K/V side `(batch_heads / group, seq,
/// dim)`, all floats; `lse` is one f32 per query row.
fn attention_args(
    kernel: &str,
    inputs: &[(&str, &Buffer, bool)],
    outputs: &[(&str, &Buffer, bool)],
    lse: &Buffer,
    (batch_heads, group, seq, dim, scale): (usize, usize, usize, usize, f32),
) -> Result<()> {
    if dim == 0 || dim > ATTENTION_MAX_DIM {
        return Err(Error::InvalidArgument(format!(
            "{kernel}: head dim {dim} is outside 1..={ATTENTION_MAX_DIM}; use the unfused \
             attention (GEMMs and a softmax) for wider heads"
        )));
    }
    if group == 0 || !batch_heads.is_multiple_of(group) {
        return Err(Error::InvalidArgument(format!(
            "{kernel}: batch_heads {batch_heads} is not a multiple of group {group}; group \
             is the query heads per K/V head (1 for multi-head attention), and every K/V \
             head serves `group` consecutive query heads"
        )));
    }
    let rows = batch_heads.checked_mul(seq).ok_or_else(|| {
        Error::InvalidArgument(format!(
            "{kernel}: batch_heads {batch_heads} x seq {seq} overflows"
        ))
    })?;
    if rows > u32::MAX as usize / dim {
        return Err(Error::InvalidArgument(format!(
            "{kernel}: {rows} rows of {dim} elements do not fit 32-bit indices; split the batch"
        )));
    }
    for &(name, b, kv) in inputs.iter().chain(outputs) {
        float(kernel, name, b)?;
        if !kv {
            same_len(kernel, name, b, rows * dim)?;
        } else if b.len != rows / group * dim {
            return Err(Error::LenMismatch {
                what: format!(
                    "{kernel}: `{name}` (buffer #{}; K/V heads batch_heads {batch_heads} / \
                     group {group} = {}, x seq {seq} x dim {dim})",
                    b.id,
                    batch_heads / group
                ),
                expected: rows / group * dim,
                found: b.len,
            });
        }
    }
    for &(name, b, _) in outputs {
        if b.dtype.size() == 2 && !dim.is_multiple_of(2) {
            return Err(Error::InvalidArgument(format!(
                "{kernel}: `{name}` (buffer #{}) is {} but the head dim {dim} is odd; 16-bit \
                 outputs need an even head dim (rows that share no 32-bit word)",
                b.id, b.dtype
            )));
        }
    }
    same_dtype(kernel, "lse", lse, DType::F32)?;
    same_len(kernel, "lse", lse, rows)?;
    if !scale.is_finite() {
        return Err(Error::InvalidArgument(format!(
            "{kernel}: scale is {scale}"
        )));
    }
    Ok(())
}
