//! Which blocks each pipeline stage runs. A model's blocks are cut into `p`
//! contiguous runs; the first stage also runs the embeddings and the last the final
//! norm and head, so their cost counts toward those stages.
//!
//! Methods (DeepSpeed's `partition_method` where they exist):
//! - `uniform`: blocks as evenly as counts allow, earlier stages taking the extra ones;
//! - `parameters`: the cut that minimises the largest stage's parameter count,
//!   embeddings and head included (DeepSpeed's default);
//! - an explicit list of block counts per stage;
//! - `measured`: the cut that minimises the slowest stage's time, given each stage's
//!   device's measured time per block (and for the ends, per embedding and head), so
//!   a faster adapter takes more blocks.
//!
//! The two balancing methods solve "split a sequence into p contiguous parts
//! minimising the largest part's cost" exactly, by dynamic programming over (stage,
//! blocks placed): the inputs are tens of blocks and a handful of stages.

use std::ops::Range;

pub use crate::partition::PartitionMethod;
use crate::{Error, Result};

/// What the model contributes: parameters per block, and of the embeddings and head.
#[derive(Clone, Debug, PartialEq)]
pub struct StageCosts {
    pub block_params: Vec<u64>,
    pub embedding_params: u64,
    pub head_params: u64,
}

/// The block range each of `stages` stages runs.
pub fn partition(
    method: &PartitionMethod,
    costs: &StageCosts,
    stages: usize,
) -> Result<Vec<Range<usize>>> {
    let n = costs.block_params.len();
    if stages == 0 || n < stages {
        return Err(Error::InvalidArgument(format!(
            "{stages} pipeline stages for a model of {n} blocks: every stage needs at least \
             one block; use at most {n} stages"
        )));
    }
    let counts = match method {
        PartitionMethod::Uniform => (0..stages)
            .map(|s| n / stages + usize::from(s < n % stages))
            .collect(),
        PartitionMethod::Blocks(counts) => {
            if counts.len() != stages || counts.contains(&0) || counts.iter().sum::<usize>() != n {
                return Err(Error::InvalidArgument(format!(
                    "pipeline partition {counts:?}: give {stages} block counts, each at least \
                     1, adding up to the model's {n} blocks"
                )));
            }
            counts.clone()
        }
        PartitionMethod::Parameters => {
            let block = |_: usize, b: usize| costs.block_params[b] as f64;
            let ends = (costs.embedding_params as f64, costs.head_params as f64);
            balance(n, stages, &block, ends)
        }
        PartitionMethod::Measured {
            per_block,
            embeddings,
            head,
        } => {
            let finite = |x: f64| x.is_finite() && x >= 0.0;
            if per_block.len() != stages
                || !per_block.iter().all(|&t| finite(t) && t > 0.0)
                || !finite(*embeddings)
                || !finite(*head)
            {
                return Err(Error::InvalidArgument(format!(
                    "measured pipeline partition: need {stages} positive times per block (one \
                     per stage's device), got {per_block:?}"
                )));
            }
            let block = |s: usize, _: usize| per_block[s];
            balance(n, stages, &block, (*embeddings, *head))
        }
    };
    let mut start = 0;
    Ok(counts
        .iter()
        .map(|&c| {
            let r = start..start + c;
            start += c;
            r
        })
        .collect())
}

/// Block counts per stage minimising the largest stage cost; `block(s, b)` is block
/// b's cost on stage s, `ends` the first stage's and the last stage's extra cost.
fn balance(
    n: usize,
    stages: usize,
    block: &dyn Fn(usize, usize) -> f64,
    (first, last): (f64, f64),
) -> Vec<usize> {
    let cost = |s: usize, blocks: Range<usize>| -> f64 {
        let mut c: f64 = blocks.map(|b| block(s, b)).sum();
        if s == 0 {
            c += first;
        }
        if s + 1 == stages {
            c += last;
        }
        c
    };
    // best[s][j]: the least largest cost of stages 0..=s running blocks 0..j; cut[s][j]
    // where stage s starts.
    let inf = f64::INFINITY;
    let mut best = vec![vec![inf; n + 1]; stages];
    let mut cut = vec![vec![0usize; n + 1]; stages];
    for (j, b) in best[0].iter_mut().enumerate().skip(1) {
        *b = cost(0, 0..j);
    }
    for s in 1..stages {
        for j in s + 1..=n {
            for i in s..j {
                let c = best[s - 1][i].max(cost(s, i..j));
                // Ties go to the later cut: earlier stages take the extra blocks.
                if c <= best[s][j] {
                    best[s][j] = c;
                    cut[s][j] = i;
                }
            }
        }
    }
    let mut counts = vec![0; stages];
    let mut j = n;
    for s in (1..stages).rev() {
        let i = cut[s][j];
        counts[s] = j - i;
        j = i;
    }
    counts[0] = j;
    counts
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lens(r: &[Range<usize>]) -> Vec<usize> {
        r.iter().map(|r| r.len()).collect()
    }

    fn costs(blocks: usize, emb: u64, head: u64) -> StageCosts {
        StageCosts {
            block_params: vec![100; blocks],
            embedding_params: emb,
            head_params: head,
        }
    }

    #[test]
    fn uniform_and_explicit_cuts() {
        let c = costs(10, 0, 0);
        assert_eq!(
            lens(&partition(&PartitionMethod::Uniform, &c, 4).unwrap()),
            [3, 3, 2, 2]
        );
        let r = partition(&PartitionMethod::Blocks(vec![1, 4, 5]), &c, 3).unwrap();
        assert_eq!(r, [0..1, 1..5, 5..10]);
        for bad in [vec![1, 4], vec![0, 5, 5], vec![2, 4, 5]] {
            let e = partition(&PartitionMethod::Blocks(bad), &c, 3)
                .unwrap_err()
                .to_string();
            assert!(e.contains("adding up to the model's 10 blocks"), "{e}");
        }
        let e = partition(&PartitionMethod::Uniform, &c, 11)
            .unwrap_err()
            .to_string();
        assert!(e.contains("use at most 10 stages"), "{e}");
    }

    #[test]
    fn parameters_balance_the_embeddings_and_head_too() {
        // 12 blocks of 100, a 250-parameter embedding and a 250 head. Over 4 stages
        // the best largest stage is 450: [2, 4, 4, 2] (250 + 2·100 at the ends, 400 in
        // the middle; one block fewer at an end leaves 5 for a middle stage, 500).
        // Checked against every cut.
        let c = costs(12, 250, 250);
        let got = partition(&PartitionMethod::Parameters, &c, 4).unwrap();
        let worst = |r: &[Range<usize>]| {
            r.iter()
                .enumerate()
                .map(|(s, r)| {
                    let mut x = 100 * r.len() as u64;
                    if s == 0 {
                        x += 250
                    }
                    if s == 3 {
                        x += 250
                    }
                    x
                })
                .max()
                .unwrap()
        };
        // Every cut of 12 blocks into 4 non-empty runs.
        let mut best = u64::MAX;
        for a in 1..12 {
            for b in a + 1..12 {
                for d in b + 1..12 {
                    best = best.min(worst(&[0..a, a..b, b..d, d..12]));
                }
            }
        }
        assert_eq!(worst(&got), best);
        assert_eq!(best, 450);
        // The ends take fewer blocks than the middle.
        let l = lens(&got);
        assert!(l[0] < l[1] && l[3] < l[2], "{l:?}");
    }

    #[test]
    fn measured_gives_a_faster_device_more_blocks() {
        // Device 0 is three times as fast as device 1: of 8 blocks it takes 6
        // (6 × 1 = 6 vs 2 × 3 = 6).
        let c = costs(8, 0, 0);
        let m = PartitionMethod::Measured {
            per_block: vec![1.0, 3.0],
            embeddings: 0.0,
            head: 0.0,
        };
        assert_eq!(lens(&partition(&m, &c, 2).unwrap()), [6, 2]);
        let bad = PartitionMethod::Measured {
            per_block: vec![1.0, f64::NAN],
            embeddings: 0.0,
            head: 0.0,
        };
        assert!(partition(&bad, &c, 2).is_err());
    }
}
