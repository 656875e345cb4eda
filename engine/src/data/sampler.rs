//! Deterministic, resumable sampling of rows from a token stream.
//!
//! The stream is cut into `W = len / (T + 1)` non-overlapping windows of `T + 1` tokens
//! (a tail shorter than a window is never read). Samples are numbered by one global `u64`
//! counter: sample `i` belongs to epoch `i / W` and reads window `perm_e(i % W)`, where
//! `perm_e` is a permutation of `0..W` keyed by (seed, epoch). So every epoch visits
//! every window exactly once, in a fresh order, and the window of any sample is a pure
//! function of (seed, sample index): a checkpoint stores the counter, and resuming from it
//! reads bit-identical batches. Nothing is materialised, so any number of loader threads
//! can compute rows independently.
//!
//! The permutation is a 4-round Feistel network over the smallest even power of two
//! `>= W`, with cycle walking (re-applying it until the value falls below `W`; a
//! permutation's cycle through an index below `W` always returns below `W`, and the
//! domain is under `4 W`, so this takes a few rounds on average).
//!
//! Batches: one optimizer step consumes `global_batch = B * grad_accum * world`
//! consecutive samples starting at the step's counter. Rank `r` takes the contiguous
//! share `[r * B * grad_accum, (r + 1) * B * grad_accum)` of it, and its micro-batch `m`
//! the `B` samples at `m * B` within that share. Shards are disjoint and together are the
//! single-rank global batch.

use super::{hash, DataError, Result, TokenSource};

/// Rows of `T + 1` tokens, split into model inputs and next-token targets.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Batch {
    /// `rows * T` input ids, row-major: row `j` is tokens `0..T` of its window.
    pub tokens: Vec<u32>,
    /// `rows * T` target ids: row `j` is tokens `1..T+1` of its window.
    pub targets: Vec<u32>,
    /// Global sample index of the first row (row `j` is sample `first_sample + j`).
    pub first_sample: u64,
    /// Tokens per row (the model's T).
    pub seq: usize,
    /// Rows that pack several documents: each token's document start (its row index
    /// where the document begins), row-major like `tokens`. `None`: a row is one
    /// window or one example.
    pub documents: Option<Vec<u32>>,
}

/// How the samples of one optimizer step are split into micro-batches and ranks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BatchLayout {
    /// Rows per micro-batch (the model's B).
    pub micro_batch: usize,
    /// Micro-batches per rank per optimizer step.
    pub grad_accum: usize,
    /// Number of ranks (data-parallel replicas).
    pub world: usize,
}

impl BatchLayout {
    pub fn new(micro_batch: usize, grad_accum: usize, world: usize) -> Result<BatchLayout> {
        if micro_batch == 0 || grad_accum == 0 || world == 0 {
            return Err(DataError::InvalidArgument(format!(
                "batch layout: micro batch {micro_batch}, grad accumulation {grad_accum} and \
                 world size {world} must all be at least 1"
            )));
        }
        Ok(BatchLayout {
            micro_batch,
            grad_accum,
            world,
        })
    }

    /// Samples per optimizer step over all ranks: `B * grad_accum * world`.
    pub fn global_batch(&self) -> u64 {
        (self.micro_batch * self.grad_accum * self.world) as u64
    }

    /// Global index of the first sample of micro-batch `micro` of rank `rank` in the step
    /// that starts at sample counter `step_start`.
    pub fn first_sample(&self, step_start: u64, micro: usize, rank: usize) -> Result<u64> {
        if micro >= self.grad_accum || rank >= self.world {
            return Err(DataError::InvalidArgument(format!(
                "micro-batch {micro} of rank {rank} does not exist: there are {} micro-batches \
                 per step and {} ranks",
                self.grad_accum, self.world
            )));
        }
        let per_rank = (self.micro_batch * self.grad_accum) as u64;
        Ok(step_start + rank as u64 * per_rank + (micro * self.micro_batch) as u64)
    }
}

/// Maps global sample indices to windows of the stream. See the module docs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Sampler {
    t: usize,
    windows: u64,
    seed: u64,
}

impl Sampler {
    /// A sampler over a stream of `source_len` tokens with rows of `t + 1` tokens.
    pub fn new(source_len: u64, t: usize, seed: u64) -> Result<Sampler> {
        if t == 0 {
            return Err(DataError::InvalidArgument(
                "the sequence length T must be at least 1".into(),
            ));
        }
        let row = t as u64 + 1;
        if source_len < row {
            return Err(DataError::InvalidArgument(format!(
                "the token stream holds {source_len} tokens, shorter than one row of T + 1 = \
                 {row} tokens. Use more data or a shorter sequence length"
            )));
        }
        Ok(Sampler {
            t,
            windows: source_len / row,
            seed,
        })
    }

    /// The model's sequence length `T` (a row is `T + 1` tokens).
    pub fn t(&self) -> usize {
        self.t
    }

    /// Number of windows, i.e. samples per epoch.
    pub fn windows(&self) -> u64 {
        self.windows
    }

    /// Epoch that sample `sample_index` belongs to.
    pub fn epoch(&self, sample_index: u64) -> u64 {
        sample_index / self.windows
    }

    /// Window (0..windows) read by sample `sample_index`.
    pub fn window(&self, sample_index: u64) -> u64 {
        let epoch = sample_index / self.windows;
        let key = hash(&[self.seed, epoch]);
        permute(sample_index % self.windows, self.windows, key)
    }

    /// Stream position of the first token of sample `sample_index`'s row.
    pub fn row_start(&self, sample_index: u64) -> u64 {
        self.window(sample_index) * (self.t as u64 + 1)
    }

    /// Reads samples `first_sample .. first_sample + rows` into a batch, checking every id
    /// against `model_vocab`.
    ///
    /// Ids are checked here, per batch, rather than by a scan when the file is opened: a
    /// scan reads the whole file up front (minutes for a large corpus, and it pulls every
    /// page of the map into memory) while this check costs one comparison per token
    /// already in cache, on a loader thread, off the training step. The price is that a
    /// bad id is reported when its batch comes up, not at start-up; sources whose
    /// tokenizer vocabulary is known (bytes, a `.bin` with a sidecar) are also checked
    /// up front by [`check_source`](super::check_source).
    pub fn read_rows(
        &self,
        source: &dyn TokenSource,
        first_sample: u64,
        rows: usize,
        model_vocab: usize,
    ) -> Result<Batch> {
        let t = self.t;
        let mut row = vec![0u32; t + 1];
        let mut tokens = Vec::with_capacity(rows * t);
        let mut targets = Vec::with_capacity(rows * t);
        let mut documents: Option<Vec<u32>> = None;
        let mut starts = vec![0u32; t];
        for j in 0..rows as u64 {
            let start = self.row_start(first_sample + j);
            source.read(start, &mut row)?;
            if let Some(k) = row.iter().position(|&id| id as usize >= model_vocab) {
                return Err(DataError::TokenOutOfRange {
                    source_name: source.name(),
                    position: start + k as u64,
                    id: row[k],
                    vocab: model_vocab,
                });
            }
            tokens.extend_from_slice(&row[..t]);
            targets.extend_from_slice(&row[1..]);
            let at = targets.len() - t;
            super::mask_targets(source, start, &mut targets[at..])?;
            if source.read_documents(start, &mut starts)? {
                documents
                    .get_or_insert_with(|| Vec::with_capacity(rows * t))
                    .extend_from_slice(&starts);
            }
        }
        Ok(Batch {
            tokens,
            targets,
            first_sample,
            seq: t,
            documents,
        })
    }

    /// Micro-batch `micro` of rank `rank` for optimizer step `step`, whose samples start
    /// at counter `step * layout.global_batch()`.
    pub fn batch(
        &self,
        source: &dyn TokenSource,
        layout: &BatchLayout,
        step: u64,
        micro: usize,
        rank: usize,
        model_vocab: usize,
    ) -> Result<Batch> {
        let first = layout.first_sample(step * layout.global_batch(), micro, rank)?;
        self.read_rows(source, first, layout.micro_batch, model_vocab)
    }
}

/// A keyed permutation of `0..n`, evaluated at `i < n`.
fn permute(i: u64, n: u64, key: u64) -> u64 {
    debug_assert!(i < n);
    if n <= 1 {
        return 0;
    }
    let bits = 64 - (n - 1).leading_zeros(); // bits needed for n - 1, >= 1
    let half = bits.div_ceil(2);
    let mask = (1u64 << half) - 1;
    let mut x = i;
    loop {
        let (mut l, mut r) = (x >> half, x & mask);
        for round in 0..4u64 {
            let f = hash(&[key, round, r]) & mask;
            (l, r) = (r, l ^ f);
        }
        x = (l << half) | r;
        if x < n {
            return x;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::data::MemorySource;

    fn source(n: u32) -> MemorySource {
        MemorySource::new("seq", (0..n).collect(), None)
    }

    #[test]
    fn permutation_is_a_bijection_for_many_sizes() {
        for n in [1u64, 2, 3, 4, 5, 7, 8, 9, 16, 17, 100, 1000, 1025] {
            for key in [0u64, 1, 0xDEAD_BEEF] {
                let mut seen = vec![false; n as usize];
                for i in 0..n {
                    let p = permute(i, n, key);
                    assert!(p < n && !seen[p as usize], "n {n} key {key} i {i} -> {p}");
                    seen[p as usize] = true;
                }
            }
        }
        // And it shuffles: not the identity for a non-trivial size.
        assert!((0..100).any(|i| permute(i, 100, 3) != i));
    }

    #[test]
    fn every_window_once_per_epoch_and_epochs_differ() {
        // 1000 tokens, T = 9: 100 windows.
        let s = Sampler::new(1000, 9, 42).unwrap();
        assert_eq!(s.windows(), 100);
        let mut orders = Vec::new();
        for epoch in 0..3u64 {
            let order: Vec<u64> = (0..100).map(|k| s.window(epoch * 100 + k)).collect();
            let mut sorted = order.clone();
            sorted.sort_unstable();
            assert_eq!(sorted, (0..100).collect::<Vec<_>>(), "epoch {epoch}");
            assert_eq!(s.epoch(epoch * 100 + 99), epoch);
            orders.push(order);
        }
        assert_ne!(orders[0], orders[1]);
        assert_ne!(orders[1], orders[2]);
        // Row starts are window starts: multiples of T + 1, inside the stream.
        for i in 0..300 {
            let st = s.row_start(i);
            assert!(st.is_multiple_of(10) && st + 10 <= 1000);
        }
    }

    #[test]
    fn batches_are_deterministic_and_depend_on_the_seed() {
        let src = source(5000);
        let layout = BatchLayout::new(4, 2, 1).unwrap();
        let a = Sampler::new(src.len(), 15, 7).unwrap();
        let b = Sampler::new(src.len(), 15, 7).unwrap();
        let c = Sampler::new(src.len(), 15, 8).unwrap();
        let x = a.batch(&src, &layout, 3, 1, 0, 5000).unwrap();
        assert_eq!(x, b.batch(&src, &layout, 3, 1, 0, 5000).unwrap());
        assert_ne!(x, c.batch(&src, &layout, 3, 1, 0, 5000).unwrap());
        assert_eq!(x.first_sample, 3 * 8 + 4);
        assert_eq!(x.tokens.len(), 4 * 15);
        // Targets are the inputs shifted by one, within each row (the source counts up).
        for j in 0..4 {
            let row = &x.tokens[j * 15..(j + 1) * 15];
            let tgt = &x.targets[j * 15..(j + 1) * 15];
            assert_eq!(row[0] as u64, a.row_start(x.first_sample + j as u64));
            for k in 0..15 {
                assert_eq!(tgt[k], row[k] + 1);
            }
        }
    }

    #[test]
    fn rank_shards_are_disjoint_and_make_up_the_global_batch() {
        let src = source(20_000);
        let s = Sampler::new(src.len(), 7, 1).unwrap();
        let (b, accum, world) = (3, 2, 4);
        let single = BatchLayout::new(b * accum * world, 1, 1).unwrap();
        let multi = BatchLayout::new(b, accum, world).unwrap();
        assert_eq!(single.global_batch(), multi.global_batch());
        for step in [0u64, 5] {
            let whole = s.batch(&src, &single, step, 0, 0, 20_000).unwrap();
            let mut union = Vec::new();
            let mut starts = std::collections::HashSet::new();
            for rank in 0..world {
                for micro in 0..accum {
                    let part = s.batch(&src, &multi, step, micro, rank, 20_000).unwrap();
                    for j in 0..b {
                        assert!(starts.insert(part.tokens[j * 7]), "row read twice");
                    }
                    union.extend(part.tokens);
                }
            }
            assert_eq!(union, whole.tokens, "step {step}");
        }
        assert!(multi.first_sample(0, 2, 0).is_err());
        assert!(multi.first_sample(0, 0, 4).is_err());
        assert!(BatchLayout::new(0, 1, 1).is_err());
    }

    #[test]
    fn resuming_from_a_counter_reads_the_same_batches() {
        let src = source(600);
        let layout = BatchLayout::new(5, 1, 1).unwrap();
        let s = Sampler::new(src.len(), 11, 99).unwrap();
        // A run of 30 steps (crossing epochs: 50 windows, 5 samples per step) ...
        let run: Vec<Batch> = (0..30)
            .map(|st| s.batch(&src, &layout, st, 0, 0, 600).unwrap())
            .collect();
        // ... and one restarted at step 17 with a fresh sampler from the saved counter.
        let counter = 17 * layout.global_batch();
        let resumed = Sampler::new(src.len(), 11, 99).unwrap();
        assert!(s.epoch(29 * 5) >= 2);
        for (k, want) in run[17..].iter().enumerate() {
            let got = resumed
                .read_rows(&src, counter + 5 * k as u64, 5, 600)
                .unwrap();
            assert_eq!(&got, want);
        }
    }
}
