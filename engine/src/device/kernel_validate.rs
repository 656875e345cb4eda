//! Argument checks of every [`Kernel`]: dtypes, lengths, shapes and aliasing, once
//! here, so every backend rejects the same bad launches with the same words.

use super::kernel::{CacheLayout, Kernel, ATTENTION_MAX_DIM, ROPE_MAX_SEQ};
use crate::{Buffer, DType, Error, Result};

impl Kernel {
    /// Checks dtypes, lengths and aliasing; backends call this before recording anything.
    pub fn validate(&self) -> Result<()> {
        self.validate_args()?;
        // A buffer a launch writes may not be any of its other operands: GPUs cannot
        // bind one buffer both read-only and writable in a dispatch, and in-place
        // variants of these kernels would race.
        let all = self.buffers();
        for w in self.written() {
            if all.iter().filter(|b| b.id == w.id).count() > 1 {
                return Err(Error::InvalidArgument(format!(
                    "{}: buffer #{} is both written and used as another operand; write to a separate buffer",
                    self.name(),
                    w.id
                )));
            }
        }
        Ok(())
    }

    fn validate_args(&self) -> Result<()> {
        let k = self.name();
        match self {
            Kernel::Fill { dst, value } => {
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
            Kernel::Copy { src, dst } => {
                same_dtype(k, "dst", dst, src.dtype)?;
                same_len(k, "dst", dst, src.len)
            }
            Kernel::Cast { src, dst } => {
                float(k, "src", src)?;
                float(k, "dst", dst)?;
                same_len(k, "dst", dst, src.len)
            }
            Kernel::Binary { a, b, out, .. } => {
                float(k, "a", a)?;
                float(k, "b", b)?;
                float(k, "out", out)?;
                same_len(k, "b", b, a.len)?;
                same_len(k, "out", out, a.len)
            }
            Kernel::Scale { x, out, .. } => {
                float(k, "x", x)?;
                float(k, "out", out)?;
                same_len(k, "out", out, x.len)
            }
            Kernel::Axpy { x, y, .. } => {
                float(k, "x", x)?;
                float(k, "y", y)?;
                same_len(k, "y", y, x.len)
            }
            Kernel::Reduce { src, dst, .. } => {
                float(k, "src", src)?;
                same_dtype(k, "dst", dst, DType::F32)?;
                same_len(k, "dst", dst, 1)
            }
            Kernel::NonFinite { srcs, flag } => {
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
            Kernel::Matmul(mm) => mm.validate(),
            Kernel::GradScale {
                sum_squares,
                out,
                loss_scale,
                clip,
            } => {
                same_dtype(k, "sum_squares", sum_squares, DType::F32)?;
                same_len(k, "sum_squares", sum_squares, 1)?;
                same_dtype(k, "out", out, DType::F32)?;
                same_len(k, "out", out, 1)?;
                let valid =
                    *loss_scale > 0.0 && loss_scale.is_finite() && *clip >= 0.0 && clip.is_finite();
                if !valid {
                    return Err(Error::InvalidArgument(format!(
                        "grad_scale: loss_scale ({loss_scale}) must be positive and clip ({clip}) non-negative (0: no clipping)"
                    )));
                }
                Ok(())
            }
            Kernel::Adam(a) => a.validate(),
            Kernel::Sgd(s) => s.validate(),
            Kernel::Gelu { x, out } => {
                float(k, "x", x)?;
                float(k, "out", out)?;
                same_len(k, "out", out, x.len)
            }
            Kernel::GeluBackward { x, dout, dx } => {
                for (name, b) in [("x", x), ("dout", dout), ("dx", dx)] {
                    float(k, name, b)?;
                    same_len(k, name, b, x.len)?;
                }
                Ok(())
            }
            Kernel::Activation { x, out, .. } => {
                float(k, "x", x)?;
                float(k, "out", out)?;
                same_len(k, "out", out, x.len)
            }
            Kernel::ActivationBackward { x, dout, dx, .. } => {
                for (name, b) in [("x", x), ("dout", dout), ("dx", dx)] {
                    float(k, name, b)?;
                    same_len(k, name, b, x.len)?;
                }
                Ok(())
            }
            Kernel::Dropout { x, out, p, .. }
            | Kernel::DropoutBackward {
                dout: x,
                dx: out,
                p,
                ..
            } => {
                let (input, output) = match self {
                    Kernel::Dropout { .. } => ("x", "out"),
                    _ => ("dout", "dx"),
                };
                float(k, input, x)?;
                float(k, output, out)?;
                same_len(k, output, out, x.len)?;
                if !(0.0..1.0).contains(p) {
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
            Kernel::MseLoss {
                pred,
                target,
                losses,
                cols,
            } => {
                let rows = rows_of(k, pred, *cols)?;
                float(k, "target", target)?;
                same_len(k, "target", target, pred.len)?;
                same_dtype(k, "losses", losses, DType::F32)?;
                same_len(k, "losses", losses, rows)
            }
            Kernel::MseBackward {
                pred,
                target,
                dpred,
                cols,
                scale,
            } => {
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
            Kernel::LayerNorm {
                x,
                weight,
                bias,
                out,
                mean,
                rstd,
                cols,
                eps,
            } => {
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
            Kernel::SplitHeads { src, dst, .. } | Kernel::MergeHeads { src, dst, .. } => {
                let l = self.heads_layout().expect("a heads kernel");
                let (seq, heads, width, offset) = (l.seq, l.heads, l.width, l.offset);
                float(k, "src", src)?;
                float(k, "dst", dst)?;
                let rows = rows_of(k, &l.rows_buf, width)?;
                if rows == 0 && l.heads_buf.len == 0 {
                    return Ok(());
                }
                if rows == 0
                    || seq == 0
                    || rows % seq != 0
                    || heads == 0
                    || !l.heads_buf.len.is_multiple_of(rows * heads)
                {
                    return Err(Error::InvalidArgument(format!(
                        "{k}: {rows} rows are not whole sequences of {seq}, or {} head elements do not split into {heads} heads per row",
                        l.heads_buf.len
                    )));
                }
                let span = heads * l.dim;
                if offset + span > width {
                    return Err(Error::InvalidArgument(format!(
                        "{k}: columns {offset}..{} run past the row width {width}",
                        offset + span
                    )));
                }
                let even =
                    span.is_multiple_of(2) && width.is_multiple_of(2) && offset.is_multiple_of(2);
                if !l.split && !even {
                    return Err(Error::InvalidArgument(format!(
                        "merge_heads: heads*dim ({span}), width ({width}) and offset ({offset}) must be even"
                    )));
                }
                Ok(())
            }
            Kernel::Softmax {
                x,
                out,
                stats,
                cols,
                scale,
                ..
            } => {
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
            Kernel::SoftmaxBackward {
                p,
                dout,
                dx,
                stats,
                cols,
                scale,
            } => {
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
            Kernel::Attention {
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
                ..
            } => attention_args(
                k,
                &[("q", q, Q), ("k", key, KV), ("v", v, KV)],
                &[("out", out, Q)],
                lse,
                (*batch_heads, *group, *seq, *dim, *scale),
            ),
            Kernel::AttentionBackward {
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
                ..
            } => attention_args(
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
            ),
            Kernel::CrossEntropy {
                logits,
                targets,
                losses,
                lse,
                vocab,
                classes,
            } => {
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
            Kernel::CrossEntropyBackward {
                logits,
                targets,
                lse,
                dlogits,
                vocab,
                classes,
                scale,
            } => {
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
            Kernel::Embedding {
                tokens,
                table,
                out,
                dim,
            } => {
                rows_of(k, table, *dim)?;
                same_dtype(k, "tokens", tokens, DType::U32)?;
                float(k, "out", out)?;
                same_len(k, "out", out, tokens.len * dim)
            }
            Kernel::EmbeddingBackward {
                tokens,
                dout,
                dtable,
                dim,
            } => {
                same_dtype(k, "tokens", tokens, DType::U32)?;
                float(k, "dout", dout)?;
                same_len(k, "dout", dout, tokens.len * dim)?;
                same_dtype(k, "dtable", dtable, DType::F32)?;
                rows_of(k, dtable, *dim).map(|_| ())
            }
            Kernel::LayerNormBackward {
                x,
                weight,
                mean,
                rstd,
                dout,
                dx,
                dweight,
                dbias,
                cols,
            } => {
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
            Kernel::RmsNorm {
                x,
                weight,
                out,
                rstd,
                cols,
                eps,
            } => {
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
            Kernel::RmsNormBackward {
                x,
                weight,
                rstd,
                dout,
                dx,
                dweight,
                cols,
            } => {
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
            Kernel::Rope {
                x,
                out,
                cols,
                dim,
                seq,
                freqs,
                ..
            } => {
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
            Kernel::RopeAt {
                x,
                out,
                positions,
                cols,
                dim,
                freqs,
            } => {
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
            Kernel::CacheWrite {
                src,
                cache,
                positions,
                heads,
                dim,
                width,
                offset,
                ..
            } => {
                let l = self.cache_layout().expect("a cache kernel");
                float(k, "cache", cache)?;
                cache_args(k, src, positions, &l, (*heads, *width, *offset), cache)?;
                if cache.dtype.size() == 2 && !dim.is_multiple_of(2) {
                    return Err(Error::InvalidArgument(format!(
                        "{k}: the cache (buffer #{}) is {} but the head dim {dim} is odd; 16-bit \
                         caches need an even head dim (rows that share no 32-bit word)",
                        cache.id, cache.dtype
                    )));
                }
                Ok(())
            }
            Kernel::CachedAttention {
                q,
                k_cache,
                v_cache,
                positions,
                out,
                heads,
                group,
                dim,
                width,
                offset,
                scale,
                ..
            } => {
                if *dim == 0 || *dim > ATTENTION_MAX_DIM {
                    return Err(Error::InvalidArgument(format!(
                        "{k}: head dim {dim} is outside 1..={ATTENTION_MAX_DIM} (a query row \
                         lives in registers)"
                    )));
                }
                if *group == 0 || !heads.is_multiple_of(*group) {
                    return Err(Error::InvalidArgument(format!(
                        "{k}: {heads} query heads are not a multiple of group {group} (query \
                         heads per K/V head, 1 for multi-head attention)"
                    )));
                }
                let l = self.cache_layout().expect("a cache kernel");
                float(k, "k_cache", k_cache)?;
                float(k, "v_cache", v_cache)?;
                same_len(k, "v_cache", v_cache, k_cache.len)?;
                cache_args(k, q, positions, &l, (*heads, *width, *offset), k_cache)?;
                float(k, "out", out)?;
                same_len(k, "out", out, l.rows * heads * dim)?;
                if out.dtype.size() == 2 && !dim.is_multiple_of(2) {
                    return Err(Error::InvalidArgument(format!(
                        "{k}: `out` (buffer #{}) is {} but the head dim {dim} is odd; 16-bit \
                         outputs need an even head dim",
                        out.id, out.dtype
                    )));
                }
                if !scale.is_finite() {
                    return Err(Error::InvalidArgument(format!("{k}: scale is {scale}")));
                }
                Ok(())
            }
            Kernel::SwiGlu { gate, up, out } => {
                for (name, b) in [("gate", gate), ("up", up), ("out", out)] {
                    float(k, name, b)?;
                    same_len(k, name, b, gate.len)?;
                }
                Ok(())
            }
            Kernel::SwiGluBackward {
                gate,
                up,
                dout,
                dgate,
                dup,
            } => {
                for (name, b) in [
                    ("gate", gate),
                    ("up", up),
                    ("dout", dout),
                    ("dgate", dgate),
                    ("dup", dup),
                ] {
                    float(k, name, b)?;
                    same_len(k, name, b, gate.len)?;
                }
                Ok(())
            }
        }
    }
}

/// Whether an attention tensor is shaped as the query heads (q, out, dout, dq) or as
/// the K/V heads (k, v, dk, dv).
const Q: bool = false;
const KV: bool = true;

/// Checks of [`Kernel::Attention`] and [`Kernel::AttentionBackward`]: the query-side
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

/// Checks shared by [`Kernel::CacheWrite`] and [`Kernel::CachedAttention`]: `rows`
/// (new tokens: `src` rows of `width`, `heads` of `dim` from `offset`) with one u32
/// position each, and a cache of whole sequences `(batch, kv_heads, max_len, dim)`
/// that the rows divide evenly between.
fn cache_args(
    kernel: &str,
    rows_buf: &Buffer,
    positions: &Buffer,
    l: &CacheLayout,
    (heads, width, offset): (usize, usize, usize),
    cache: &Buffer,
) -> Result<()> {
    let rows = rows_of(kernel, rows_buf, width)?;
    if heads == 0 || l.dim == 0 || l.max_len == 0 {
        return Err(Error::InvalidArgument(format!(
            "{kernel}: heads ({heads}), dim ({}) and max_len ({}) must be positive",
            l.dim, l.max_len
        )));
    }
    if offset + heads * l.dim > width {
        return Err(Error::InvalidArgument(format!(
            "{kernel}: columns {offset}..{} run past the row width {width}",
            offset + heads * l.dim
        )));
    }
    same_dtype(kernel, "positions", positions, DType::U32)?;
    same_len(kernel, "positions", positions, rows)?;
    let per_sequence = l.kv_heads * l.max_len * l.dim;
    if l.batch == 0 || cache.len != l.batch * per_sequence || !rows.is_multiple_of(l.batch) {
        return Err(Error::InvalidArgument(format!(
            "{kernel}: the cache (buffer #{}, {} elements) is not whole sequences of {} K/V \
             heads x {} positions x {} dims that the {rows} new rows divide evenly between",
            cache.id, cache.len, l.kv_heads, l.max_len, l.dim
        )));
    }
    if cache.len > u32::MAX as usize {
        return Err(Error::InvalidArgument(format!(
            "{kernel}: a cache of {} elements does not fit 32-bit indices; shorten max_len",
            cache.len
        )));
    }
    Ok(())
}

/// Rows of a row-major matrix with `cols` columns held in `x`.
fn rows_of(kernel: &str, x: &Buffer, cols: usize) -> Result<usize> {
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
fn classes_within(kernel: &str, classes: usize, cols: usize) -> Result<()> {
    if classes == 0 || classes > cols {
        return Err(Error::InvalidArgument(format!(
            "{kernel}: {classes} classes in rows of {cols} logits; need 1 <= classes <= the \
             row's length (the padded vocabulary)"
        )));
    }
    Ok(())
}

fn same_dtype(kernel: &str, what: &str, b: &Buffer, expected: DType) -> Result<()> {
    if b.dtype != expected {
        return Err(Error::DTypeMismatch {
            what: format!("{kernel}: `{what}` (buffer #{})", b.id),
            expected,
            found: b.dtype,
        });
    }
    Ok(())
}

fn same_len(kernel: &str, what: &str, b: &Buffer, expected: usize) -> Result<()> {
    if b.len != expected {
        return Err(Error::LenMismatch {
            what: format!("{kernel}: `{what}` (buffer #{})", b.id),
            expected,
            found: b.len,
        });
    }
    Ok(())
}

fn float(kernel: &str, what: &str, b: &Buffer) -> Result<()> {
    if !b.dtype.is_float() {
        return Err(Error::InvalidArgument(format!(
            "{kernel}: `{what}` (buffer #{}) is {}, but this kernel takes f32, f16 or bf16",
            b.id, b.dtype
        )));
    }
    Ok(())
}
