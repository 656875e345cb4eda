//! How a flat list of tensors is cut across ranks: each rank owns one contiguous
//! range of the whole, as segments of the tensors it touches (ZeRO's optimizer state,
//! and the collectives that move those shards).

use std::ops::Range;

/// The part of one tensor a rank owns.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Segment {
    /// Index of the tensor in model order.
    pub param: usize,
    /// Elements of that tensor.
    pub range: Range<usize>,
}

/// The flat range rank `rank` of `world` owns out of `total` elements.
pub fn shard_range(total: usize, world: usize, rank: usize) -> Range<usize> {
    let (base, extra) = (total / world, total % world);
    let start = rank * base + rank.min(extra);
    start..start + base + usize::from(rank < extra)
}

/// Rank `rank`'s segments, for tensors of `sizes` elements.
pub fn segments(sizes: &[usize], world: usize, rank: usize) -> Vec<Segment> {
    let total = sizes.iter().sum();
    let mine = shard_range(total, world, rank);
    let mut out = vec![];
    let mut offset = 0;
    for (param, &n) in sizes.iter().enumerate() {
        let (lo, hi) = (mine.start.max(offset), mine.end.min(offset + n));
        if lo < hi {
            out.push(Segment {
                param,
                range: lo - offset..hi - offset,
            });
        }
        offset += n;
    }
    out
}
