//! The generation cache: appending K/V rows and attending over them.

use super::check::{float, rows_of, same_dtype, same_len};
use super::{Kernel, KernelSpec, Operand, ATTENTION_MAX_DIM};
use crate::device::cost::{bytes_of, KernelCost};
use crate::{Buffer, DType, Error, Result};

/// The geometry of a [`Kernel::CacheWrite`](crate::Kernel::CacheWrite) or [`Kernel::CachedAttention`](crate::Kernel::CachedAttention) launch,
/// worked out once for validation and for every backend.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CacheLayout {
    /// New rows (tokens) in the launch, over all sequences.
    pub rows: usize,
    /// Sequences (the cache's first dimension).
    pub batch: usize,
    /// K/V heads in the cache.
    pub kv_heads: usize,
    pub max_len: usize,
    pub dim: usize,
}

impl CacheLayout {
    /// The sequence row `r` belongs to.
    pub fn sequence(&self, r: usize) -> usize {
        r / (self.rows / self.batch).max(1)
    }

    /// Cache index of element `i` of K/V head `h` at position `t` of sequence `b`.
    pub fn index(&self, b: usize, h: usize, t: usize, i: usize) -> usize {
        ((b * self.kv_heads + h) * self.max_len + t) * self.dim + i
    }
}

impl CacheLayout {
    /// Sizes are only meaningful once the kernel's checks have passed.
    fn new(
        rows_buf: &Buffer,
        cache: &Buffer,
        kv_heads: usize,
        dim: usize,
        width: usize,
        max_len: usize,
    ) -> CacheLayout {
        let per_sequence = kv_heads * max_len * dim;
        CacheLayout {
            rows: rows_buf.len / width.max(1),
            batch: cache.len / per_sequence.max(1),
            kv_heads,
            max_len,
            dim,
        }
    }
}

impl CacheWrite {
    pub fn layout(&self) -> CacheLayout {
        CacheLayout::new(
            &self.src,
            &self.cache,
            self.heads,
            self.dim,
            self.width,
            self.max_len,
        )
    }
}

impl CachedAttention {
    pub fn layout(&self) -> CacheLayout {
        let kv_heads = self.heads / self.group.max(1);
        CacheLayout::new(
            &self.q,
            &self.k_cache,
            kv_heads,
            self.dim,
            self.width,
            self.max_len,
        )
    }
}

impl Kernel {
    /// The geometry of a cache write or cached attention (`None` for other kernels).
    /// Sizes are only meaningful once [`Kernel::validate`](crate::Kernel::validate) has passed.
    pub fn cache_layout(&self) -> Option<CacheLayout> {
        match self {
            Kernel::CacheWrite(k) => Some(k.layout()),
            Kernel::CachedAttention(k) => Some(k.layout()),
            _ => None,
        }
    }
}

/// Appends new K or V rows to a generation cache at positions read from the device,
/// so that one recorded launch serves every step. `src` holds `rows` rows of `width`
/// elements (the new tokens, `rows / batch` per sequence, in sequence order); the
/// cache is `(batch, heads, max_len, dim)` with
/// `batch = cache.len / (heads * max_len * dim)`. Row `r` (sequence
/// `b = r / (rows / batch)`) goes to
/// `cache[b][h][positions[r]][i] = src[r][offset + h * dim + i]`. A position at or past
/// `max_len` writes nothing. `dim` must be even when the cache is 16-bit (rows that
///   share no 32-bit word).
#[derive(Clone, Debug, PartialEq)]
pub struct CacheWrite {
    pub src: Buffer,
    pub cache: Buffer,
    /// u32, one per row of `src`.
    pub positions: Buffer,
    pub heads: usize,
    pub dim: usize,
    pub width: usize,
    pub offset: usize,
    pub max_len: usize,
}

impl KernelSpec for CacheWrite {
    fn name(&self) -> &'static str {
        "cache_write"
    }

    fn operands_mut(&mut self) -> Vec<Operand<'_>> {
        vec![
            Operand::read(&mut self.src),
            Operand::write(&mut self.cache),
            Operand::read(&mut self.positions),
        ]
    }

    fn check(&self) -> Result<()> {
        let k = self.name();
        let CacheWrite {
            src,
            cache,
            positions,
            heads,
            dim,
            width,
            offset,
            ..
        } = self;
        let l = self.layout();
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

    fn flops_per_element(&self) -> f64 {
        0.0
    }
}

/// Attention of new query rows over a generation cache (what decoding runs instead
/// of [`Kernel::Attention`](crate::Kernel::Attention)): `q` holds rows of `width` elements with query head `h`
/// at columns `offset + h * dim`; row `r` (sequence `b`, as in [`Kernel::CacheWrite`](crate::Kernel::CacheWrite))
/// attends K/V head `h / group` of its sequence over cache rows `0..=positions[r]`:
/// `out[r][h * dim + i] = softmax_j(q . k_j * scale) v_j[i]`, `out` rows of
/// `heads * dim`. Scores, the running max and sum and the accumulators are f32 (the
/// online-softmax recurrence, stable for any scores). A position at or past `max_len`
/// gives NaN rows. `dim` is 1..=[`ATTENTION_MAX_DIM`], even when `out` is 16-bit.
#[derive(Clone, Debug, PartialEq)]
pub struct CachedAttention {
    pub q: Buffer,
    pub k_cache: Buffer,
    pub v_cache: Buffer,
    /// u32, one per query row.
    pub positions: Buffer,
    pub out: Buffer,
    /// Query heads.
    pub heads: usize,
    /// Query heads per K/V head (1: multi-head attention).
    pub group: usize,
    pub dim: usize,
    pub width: usize,
    pub offset: usize,
    pub max_len: usize,
    pub scale: f32,
}

impl KernelSpec for CachedAttention {
    fn name(&self) -> &'static str {
        "cached_attention"
    }

    fn operands_mut(&mut self) -> Vec<Operand<'_>> {
        vec![
            Operand::read(&mut self.q),
            Operand::read(&mut self.k_cache),
            Operand::read(&mut self.v_cache),
            Operand::read(&mut self.positions),
            Operand::write(&mut self.out),
        ]
    }

    fn check(&self) -> Result<()> {
        let k = self.name();
        let CachedAttention {
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
        } = self;
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
        let l = self.layout();
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

    fn flops_per_element(&self) -> f64 {
        0.0
    }

    fn cost(&self) -> KernelCost {
        // At most `max_len` keys per query row and head (positions are on the device,
        // so the bound is what the shapes give).
        let rows = (self.q.len / self.width.max(1)) as f64;
        let flops = 4.0 * rows * (self.heads * self.max_len * self.dim) as f64;
        KernelCost::of(
            self.name(),
            flops,
            self.buffers().iter().map(bytes_of).sum(),
        )
    }
}

/// Checks shared by [`Kernel::CacheWrite`](crate::Kernel::CacheWrite) and [`Kernel::CachedAttention`](crate::Kernel::CachedAttention): `rows`
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
