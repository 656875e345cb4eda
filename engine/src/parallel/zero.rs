//! ZeRO partitioning: which part of the optimizer state each data-parallel rank owns.
//!
//! The parameters, concatenated in model order, form one flat vector of Ψ elements.
//! Rank r owns the contiguous range `[r·Ψ/N, (r+1)·Ψ/N)` (the first Ψ mod N ranks one
//! element more), whatever the tensor boundaries — not whole tensors dealt round-robin,
//! which leaves ranks as uneven as the largest tensor. A range crosses tensors, so it is
//! kept as segments, one per tensor it touches: each segment is updated with its own
//! tensor's settings (weight decay applies to matrices only).

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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shards_cover_every_element_once_and_differ_by_at_most_one() {
        let sizes = [5, 1, 7, 3, 11];
        let total: usize = sizes.iter().sum();
        for world in 1..=7 {
            let mut seen = vec![0u32; total];
            let lens: Vec<usize> = (0..world)
                .map(|r| shard_range(total, world, r).len())
                .collect();
            assert!(lens.iter().max().unwrap() - lens.iter().min().unwrap() <= 1);
            for rank in 0..world {
                let mut flat = shard_range(total, world, rank);
                for seg in segments(&sizes, world, rank) {
                    let off: usize = sizes[..seg.param].iter().sum();
                    for i in seg.range.clone() {
                        assert_eq!(flat.next(), Some(off + i), "contiguous, in order");
                        seen[off + i] += 1;
                    }
                }
                assert_eq!(flat.next(), None);
            }
            assert!(seen.iter().all(|&c| c == 1), "world {world}: {seen:?}");
        }
        // 27 elements over 2 ranks: 14 + 13, the first rank's range ending inside
        // the third tensor.
        assert_eq!(
            segments(&sizes, 2, 0),
            [
                Segment {
                    param: 0,
                    range: 0..5
                },
                Segment {
                    param: 1,
                    range: 0..1
                },
                Segment {
                    param: 2,
                    range: 0..7
                },
                Segment {
                    param: 3,
                    range: 0..1
                },
            ]
        );
    }
}
