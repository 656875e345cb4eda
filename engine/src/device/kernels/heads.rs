//! Moving attention heads into and out of rows.

use super::check::{float, rows_of};
use super::{Kernel, KernelSpec, Operand};
use crate::{Buffer, Error, Result};

/// Attention heads out of rows: `src` holds `rows = batch * seq` rows of `width`
/// elements; columns `offset + h * dim + i` of row `(b, t)` go to `dst[b][h][t][i]`
/// (`dst` is `batch * heads * seq * dim`, `dim = dst.len / (rows * heads)`).
#[derive(Clone, Debug, PartialEq)]
pub struct SplitHeads {
    pub src: Buffer,
    pub dst: Buffer,
    pub seq: usize,
    pub heads: usize,
    pub width: usize,
    pub offset: usize,
}

/// The inverse: `src[b][h][t][i]` to column `offset + h * dim + i` of row `(b, t)` of
/// `dst`; other columns of `dst` are left as they are. `heads * dim`, `width` and
/// `offset` must be even, so that no 16-bit word is shared with a column outside.
#[derive(Clone, Debug, PartialEq)]
pub struct MergeHeads {
    pub src: Buffer,
    pub dst: Buffer,
    pub seq: usize,
    pub heads: usize,
    pub width: usize,
    pub offset: usize,
}

/// The geometry of a [`SplitHeads`] or [`MergeHeads`] launch, worked out once for
/// validation and for every backend.
#[derive(Clone, Copy, Debug)]
pub struct HeadsLayout {
    /// Rows to heads (split) or heads to rows (merge).
    pub split: bool,
    /// The buffer in row layout (`rows x width`) and the one in head layout.
    pub rows_buf: Buffer,
    pub heads_buf: Buffer,
    pub rows: usize,
    pub seq: usize,
    pub heads: usize,
    pub dim: usize,
    pub width: usize,
    pub offset: usize,
}

impl HeadsLayout {
    /// Sizes are only meaningful once the kernel's checks have passed.
    fn new(
        split: bool,
        rows_buf: Buffer,
        heads_buf: Buffer,
        seq: usize,
        heads: usize,
        width: usize,
        offset: usize,
    ) -> HeadsLayout {
        let rows = rows_buf.len / width.max(1);
        let dim = if rows == 0 || heads == 0 {
            0
        } else {
            heads_buf.len / (rows * heads)
        };
        HeadsLayout {
            split,
            rows_buf,
            heads_buf,
            rows,
            seq,
            heads,
            dim,
            width,
            offset,
        }
    }

    /// Row-layout index of element `e` of the head layout `(b, h, t, i)`.
    pub fn row_index(&self, e: usize) -> usize {
        let (d, t, h) = (self.dim, self.seq, self.heads);
        let (i, ti, hi, b) = (e % d, (e / d) % t, (e / (d * t)) % h, e / (d * t * h));
        (b * t + ti) * self.width + self.offset + hi * d + i
    }

    /// The checks of both kernels: floats, whole sequences and heads, columns within
    /// the row, and a merge's even spans.
    fn check(&self, k: &str) -> Result<()> {
        let (seq, heads, width, offset) = (self.seq, self.heads, self.width, self.offset);
        float(
            k,
            "src",
            if self.split {
                &self.rows_buf
            } else {
                &self.heads_buf
            },
        )?;
        float(
            k,
            "dst",
            if self.split {
                &self.heads_buf
            } else {
                &self.rows_buf
            },
        )?;
        let rows = rows_of(k, &self.rows_buf, width)?;
        if rows == 0 && self.heads_buf.len == 0 {
            return Ok(());
        }
        if rows == 0
            || seq == 0
            || rows % seq != 0
            || heads == 0
            || !self.heads_buf.len.is_multiple_of(rows * heads)
        {
            return Err(Error::InvalidArgument(format!(
                "{k}: {rows} rows are not whole sequences of {seq}, or {} head elements do not split into {heads} heads per row",
                self.heads_buf.len
            )));
        }
        let span = heads * self.dim;
        if offset + span > width {
            return Err(Error::InvalidArgument(format!(
                "{k}: columns {offset}..{} run past the row width {width}",
                offset + span
            )));
        }
        let even = span.is_multiple_of(2) && width.is_multiple_of(2) && offset.is_multiple_of(2);
        if !self.split && !even {
            return Err(Error::InvalidArgument(format!(
                "merge_heads: heads*dim ({span}), width ({width}) and offset ({offset}) must be even"
            )));
        }
        Ok(())
    }
}

impl SplitHeads {
    pub fn layout(&self) -> HeadsLayout {
        HeadsLayout::new(
            true,
            self.src,
            self.dst,
            self.seq,
            self.heads,
            self.width,
            self.offset,
        )
    }
}

impl MergeHeads {
    pub fn layout(&self) -> HeadsLayout {
        HeadsLayout::new(
            false,
            self.dst,
            self.src,
            self.seq,
            self.heads,
            self.width,
            self.offset,
        )
    }
}

impl KernelSpec for SplitHeads {
    fn name(&self) -> &'static str {
        "split_heads"
    }

    fn operands_mut(&mut self) -> Vec<Operand<'_>> {
        vec![Operand::read(&mut self.src), Operand::write(&mut self.dst)]
    }

    fn check(&self) -> Result<()> {
        self.layout().check(self.name())
    }

    fn flops_per_element(&self) -> f64 {
        0.0
    }
}

impl KernelSpec for MergeHeads {
    fn name(&self) -> &'static str {
        "merge_heads"
    }

    fn operands_mut(&mut self) -> Vec<Operand<'_>> {
        vec![Operand::read(&mut self.src), Operand::write(&mut self.dst)]
    }

    fn check(&self) -> Result<()> {
        self.layout().check(self.name())
    }

    fn flops_per_element(&self) -> f64 {
        0.0
    }
}

impl Kernel {
    /// The geometry of a head split or merge (`None` for other kernels). Sizes are only
    /// meaningful once [`Kernel::validate`](crate::Kernel::validate) has passed.
    pub fn heads_layout(&self) -> Option<HeadsLayout> {
        match self {
            Kernel::SplitHeads(k) => Some(k.layout()),
            Kernel::MergeHeads(k) => Some(k.layout()),
            _ => None,
        }
    }
}
