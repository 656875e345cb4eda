//! An example file (`examples::prepare_examples`: ids, loss mask, example offsets) read
//! as a stream of rows of `T + 1` tokens. A longer example is cut to its first `T + 1`
//! tokens. Padded ([`ExampleRows::open`]), each example has a row of its own; packed
//! ([`ExampleRows::packed`]), examples are laid end to end in rows by best-fit
//! decreasing (longest first, each into the fullest row it fits), and the rows say
//! where each document starts ([`TokenSource::read_documents`]), so that attention
//! stays within a document and positions restart (`graph/packing.rs`); a document's
//! first token is no target (the previous document's last token does not predict it).
//! Padding fills a row's tail: it comes after every document's tokens, so under causal
//! attention none of them sees it, and its mask is 0: padding neither attends nor
//! counts. Row `k` starts at token `k · (T + 1)`, so the
//! [`Sampler`](super::Sampler)'s windows are the rows, each visited once per epoch,
//! and a held-out tail is whole rows.

use std::path::Path;

use super::text::{map_file, MappedFile};
use super::token_file::{side_path, ExampleSet, TokenFile};
use super::{check_range, DataError, Result, TokenSource};

/// The id padding holds (any id in the vocabulary would do: it is never a target).
const PAD: u32 = 0;

pub struct ExampleRows {
    ids: TokenFile,
    mask: MappedFile,
    /// Each example's first token, and the total last.
    offsets: Vec<u64>,
    /// Tokens per row: `T + 1`.
    row: u64,
    set: ExampleSet,
    /// The examples of each row, in row order: row `r`'s are
    /// `order[row_starts[r]..row_starts[r + 1]]`.
    order: Vec<u64>,
    row_starts: Vec<u64>,
    packed: bool,
}

impl ExampleRows {
    /// The example file `path` (a `.bin` whose sidecar describes examples), one example
    /// per row of `t + 1`. Errors name a missing or inconsistent mask or offsets file.
    pub fn open(path: &Path, t: usize) -> Result<ExampleRows> {
        let mut rows = ExampleRows::open_file(path, t)?;
        let n = rows.file_examples();
        rows.order = (0..n).collect();
        rows.row_starts = (0..=n).collect();
        Ok(rows)
    }

    /// The first `examples` examples of the file `path` packed into rows of `t + 1`
    /// (see the module docs); the rest (a held-out tail) stay out of its rows.
    pub fn packed(path: &Path, t: usize, examples: u64) -> Result<ExampleRows> {
        let mut rows = ExampleRows::open_file(path, t)?;
        let lens: Vec<u64> = (0..examples.min(rows.file_examples()))
            .map(|k| {
                let (s, e) = rows.example(k);
                e - s
            })
            .collect();
        (rows.order, rows.row_starts) = best_fit_decreasing(&lens, rows.row);
        rows.packed = true;
        Ok(rows)
    }

    fn open_file(path: &Path, t: usize) -> Result<ExampleRows> {
        let ids = TokenFile::open_ids(path)?;
        let set = ids
            .sidecar()
            .and_then(|s| s.examples.clone())
            .ok_or_else(|| {
                DataError::format(
                    path,
                    "not an example file: its sidecar describes no examples",
                )
            })?;
        let mask_path = side_path(path, "mask");
        let offsets_path = side_path(path, "examples");
        let again = "prepare the dataset again with `kiln prepare`";
        let mask = map_file(&mask_path)?;
        if mask.len() as u64 != ids.len() {
            return Err(DataError::format(
                &mask_path,
                format!(
                    "holds {} mask bytes for the {} tokens of {}: {again}",
                    mask.len(),
                    ids.len(),
                    path.display()
                ),
            ));
        }
        let raw =
            std::fs::read(&offsets_path).map_err(|e| DataError::io(&offsets_path, "read", e))?;
        let offsets: Vec<u64> = raw
            .chunks_exact(8)
            .map(|c| u64::from_le_bytes(c.try_into().expect("8 bytes")))
            .collect();
        let sound = raw.len() % 8 == 0
            && offsets.len() as u64 == set.examples + 1
            && offsets.first() == Some(&0)
            && offsets.last() == Some(&ids.len())
            && offsets.windows(2).all(|w| w[0] < w[1]);
        if !sound {
            return Err(DataError::format(
                &offsets_path,
                format!(
                    "is not the offsets of {} examples over {} tokens: {again}",
                    set.examples,
                    ids.len()
                ),
            ));
        }
        Ok(ExampleRows {
            ids,
            mask,
            offsets,
            row: t as u64 + 1,
            set,
            order: vec![],
            row_starts: vec![0],
            packed: false,
        })
    }

    /// Whether rows pack several examples.
    pub fn is_packed(&self) -> bool {
        self.packed
    }

    /// Rows in all.
    pub fn rows(&self) -> u64 {
        self.row_starts.len() as u64 - 1
    }

    /// The share of the rows' tokens that is padding.
    pub fn padding_share(&self) -> f64 {
        let used: u64 = (self.order.iter())
            .map(|&k| {
                let (s, e) = self.example(k);
                e - s
            })
            .sum();
        let all = self.rows() * self.row;
        if all == 0 {
            0.0
        } else {
            1.0 - used as f64 / all as f64
        }
    }

    /// How the file was prepared (format, counts).
    pub fn set(&self) -> &ExampleSet {
        &self.set
    }

    /// Examples in the rows.
    pub fn examples(&self) -> u64 {
        self.order.len() as u64
    }

    fn file_examples(&self) -> u64 {
        self.offsets.len() as u64 - 1
    }

    /// Examples longer than a row (cut to their first `T + 1` tokens), and of those
    /// the ones left with no trained target.
    pub fn cut(&self) -> Result<(u64, u64)> {
        let (mut cut, mut empty) = (0, 0);
        for w in self.offsets.windows(2) {
            if w[1] - w[0] > self.row {
                cut += 1;
                let kept = self.mask.range(w[0] as usize + 1, self.row as usize - 1)?;
                empty += !kept.contains(&1) as u64;
            }
        }
        Ok((cut, empty))
    }

    /// A line for the run's log: what the file holds and what rows do to it.
    pub fn describe(&self) -> Result<String> {
        let (cut, empty) = self.cut()?;
        let padding = 100.0 * self.padding_share();
        let mut line = if self.packed {
            format!(
                "{}: {} of its {} examples of {}, packed into {} rows of T + 1 = {} tokens \
                 ({padding:.1} % padding; attention within each example, positions \
                 restarting; --no-packing gives each its own row)",
                self.name(),
                self.examples(),
                self.file_examples(),
                self.set.format,
                self.rows(),
                self.row
            )
        } else {
            format!(
                "{}: {} examples of {}, one per row of T + 1 = {} tokens ({padding:.1} % \
                 padding, which neither attends nor counts)",
                self.name(),
                self.examples(),
                self.set.format,
                self.row
            )
        };
        if cut > 0 {
            line += &format!(
                "; {cut} longer ones are cut to their first {} tokens{}: prepare with \
                 --max-length {} to choose which end is kept",
                self.row,
                if empty > 0 {
                    format!(", {empty} of them left with nothing to train on")
                } else {
                    String::new()
                },
                self.row
            );
        }
        Ok(line)
    }

    /// Example `k`'s token range, cut to a row.
    fn example(&self, k: u64) -> (u64, u64) {
        let (s, e) = (self.offsets[k as usize], self.offsets[k as usize + 1]);
        (s, e.min(s + self.row))
    }

    /// The documents of row `r`: (first token in the row, first token in the file,
    /// tokens), end to end from the row's start.
    fn placed(&self, r: u64) -> impl Iterator<Item = (u64, u64, u64)> + '_ {
        let examples = &self.order[self.row_starts[r as usize] as usize..][..self.in_row(r)];
        let mut at = 0;
        examples.iter().map(move |&k| {
            let (s, e) = self.example(k);
            let placed = (at, s, e - s);
            at += e - s;
            placed
        })
    }

    fn in_row(&self, r: u64) -> usize {
        (self.row_starts[r as usize + 1] - self.row_starts[r as usize]) as usize
    }

    /// Calls `each(row, row token, out index, tokens)` for each stretch of one row
    /// within stream tokens `start .. start + n`.
    fn rows_within(
        &self,
        start: u64,
        n: usize,
        mut each: impl FnMut(u64, u64, usize, usize) -> Result<()>,
    ) -> Result<()> {
        check_range(&self.name(), self.len(), start, n)?;
        let mut at = 0usize;
        while at < n {
            let pos = start + at as u64;
            let (r, within) = (pos / self.row, pos % self.row);
            let take = ((self.row - within) as usize).min(n - at);
            each(r, within, at, take)?;
            at += take;
        }
        Ok(())
    }

    /// Calls `each(out index, file token, tokens)` for the document tokens among stream
    /// tokens `start .. start + n` (the caller fills the rest as padding).
    fn stretches(
        &self,
        start: u64,
        n: usize,
        mut each: impl FnMut(usize, u64, usize) -> Result<()>,
    ) -> Result<()> {
        self.rows_within(start, n, |r, within, at, take| {
            let end = within + take as u64;
            for (first, src, len) in self.placed(r) {
                let (lo, hi) = (first.max(within), (first + len).min(end));
                if lo < hi {
                    each(
                        at + (lo - within) as usize,
                        src + lo - first,
                        (hi - lo) as usize,
                    )?;
                }
            }
            Ok(())
        })
    }
}

/// Best-fit decreasing: the examples of `lens` tokens into rows of `cap` tokens, the
/// longest first (ties in file order), each into the row with the least room that
/// holds it, else a new row. Returns the examples row by row and where each row's
/// begin (`rows + 1` entries). O(n log n) with the rows kept by room.
fn best_fit_decreasing(lens: &[u64], cap: u64) -> (Vec<u64>, Vec<u64>) {
    let mut by_len: Vec<u64> = (0..lens.len() as u64).collect();
    by_len.sort_by_key(|&k| std::cmp::Reverse(lens[k as usize]));
    let mut rows: Vec<Vec<u64>> = vec![];
    // (room left, row): the open rows with room.
    let mut room = std::collections::BTreeSet::new();
    for k in by_len {
        let len = lens[k as usize];
        let r = match room.range((len, 0)..).next().copied() {
            Some(fit @ (left, r)) => {
                room.remove(&fit);
                if left > len {
                    room.insert((left - len, r));
                }
                r
            }
            None => {
                rows.push(vec![]);
                if cap > len {
                    room.insert((cap - len, rows.len() - 1));
                }
                rows.len() - 1
            }
        };
        rows[r].push(k);
    }
    let mut starts = vec![0];
    let mut order = vec![];
    for row in rows {
        order.extend(&row);
        starts.push(order.len() as u64);
    }
    (order, starts)
}

impl TokenSource for ExampleRows {
    fn len(&self) -> u64 {
        self.rows() * self.row
    }

    fn read(&self, start: u64, out: &mut [u32]) -> Result<()> {
        out.fill(PAD);
        self.stretches(start, out.len(), |at, from, n| {
            self.ids.read(from, &mut out[at..at + n])
        })
    }

    /// The file's mask, except a packed document's first token: the token before it
    /// (another document's last) does not predict it.
    fn read_mask(&self, start: u64, out: &mut [u8]) -> Result<bool> {
        out.fill(0);
        self.stretches(start, out.len(), |at, from, n| {
            out[at..at + n].copy_from_slice(self.mask.range(from as usize, n)?);
            Ok(())
        })?;
        self.rows_within(start, out.len(), |r, within, at, take| {
            for (first, _, _) in self.placed(r) {
                if first > 0 && (within..within + take as u64).contains(&first) {
                    out[at + (first - within) as usize] = 0;
                }
            }
            Ok(())
        })?;
        Ok(true)
    }

    fn read_documents(&self, start: u64, out: &mut [u32]) -> Result<bool> {
        if !self.packed {
            return Ok(false);
        }
        self.rows_within(start, out.len(), |r, within, at, take| {
            // Padding after the last document is a document of its own.
            let used: u64 = self.placed(r).map(|(_, _, len)| len).sum();
            for i in 0..take {
                let pos = within + i as u64;
                let doc = self
                    .placed(r)
                    .find(|&(first, _, len)| (first..first + len).contains(&pos))
                    .map_or(used, |(first, _, _)| first);
                out[at + i] = doc as u32;
            }
            Ok(())
        })?;
        Ok(true)
    }

    fn vocab_hint(&self) -> Option<usize> {
        self.ids.vocab_hint()
    }

    fn name(&self) -> String {
        self.ids.name()
    }
}

#[cfg(all(test, feature = "tokenizers"))]
mod tests {
    use super::*;
    use crate::data::examples::{prepare_examples, ExampleOptions};
    use crate::data::test_util::TempDir;
    use crate::data::{BatchLayout, Sampler, Tokenizer};
    use crate::IGNORE_TARGET;

    /// Three prompt/completion examples of 5, 9 and 12 bytes in rows of T + 1 = 8:
    /// each row holds its example's first 8 tokens, padded, and the batch's targets are
    /// the completion's bytes alone (the prompt's and padding's are ignored).
    #[test]
    fn each_example_is_a_row_and_only_its_completion_is_a_target() {
        let dir = TempDir::new();
        let rows = dir.path("rows.jsonl");
        std::fs::write(
            &rows,
            "{\"prompt\": \"ab\", \"completion\": \"cde\"}\n\
             {\"prompt\": \"fgh\", \"completion\": \"ijklmn\"}\n\
             {\"prompt\": \"opqrstuvwx\", \"completion\": \"yz\"}\n",
        )
        .unwrap();
        let out = dir.path("ex.bin");
        let o = ExampleOptions::default();
        prepare_examples(&rows, &out, &Tokenizer::Bytes, &o, &mut |_| {}).unwrap();
        let src = ExampleRows::open(&out, 7).unwrap();
        assert_eq!((src.examples(), src.len()), (3, 24));
        // The second loses its last byte; the third is cut to "opqrstuv", nothing of its
        // completion left.
        assert_eq!(src.cut().unwrap(), (2, 1));
        let mut row = [9u32; 8];
        src.read(8, &mut row).unwrap();
        assert_eq!(row, b"fghijklm".map(u32::from));
        src.read(0, &mut row).unwrap();
        assert_eq!(row, [97, 98, 99, 100, 101, 0, 0, 0]);
        // Reads across rows.
        let mut two = [0u32; 4];
        src.read(6, &mut two).unwrap();
        assert_eq!(two, [0, 0, 102, 103]);

        let sampler = Sampler::new(src.len(), 7, 3).unwrap();
        assert_eq!(sampler.windows(), 3);
        let layout = BatchLayout::new(3, 1, 1).unwrap();
        let batch = sampler.batch(&src, &layout, 0, 0, 0, 256).unwrap();
        for j in 0..3 {
            let k = sampler.window(j as u64);
            let want: Vec<u32> = match k {
                0 => [b'c', b'd', b'e'].iter().map(|&b| b as u32).collect(),
                1 => b"ijklm".iter().map(|&b| b as u32).collect(),
                _ => vec![],
            };
            let got: Vec<u32> = batch.targets[j * 7..(j + 1) * 7]
                .iter()
                .copied()
                .filter(|&x| x != IGNORE_TARGET)
                .collect();
            assert_eq!(got, want, "example {k}");
        }
        // A bad offsets file is named.
        std::fs::write(dir.path("ex.bin.examples"), [0u8; 12]).unwrap();
        let e = ExampleRows::open(&out, 7).err().unwrap().to_string();
        assert!(
            e.contains("ex.bin.examples") && e.contains("kiln prepare"),
            "{e}"
        );
    }

    /// Five examples of 3, 5, 8, 2 and 6 bytes packed into rows of T + 1 = 8 by best-fit
    /// decreasing: [8], [6, 2], [5, 3], no padding. A row's tokens are its examples end
    /// to end; each token knows its document's start; a later document's first token is
    /// no target; the sampler's batch carries the starts.
    #[test]
    fn packing_lays_examples_end_to_end_and_marks_where_each_starts() {
        let dir = TempDir::new();
        let rows = dir.path("rows.jsonl");
        std::fs::write(
            &rows,
            "{\"prompt\": \"a\", \"completion\": \"bc\"}\n\
             {\"prompt\": \"de\", \"completion\": \"fgh\"}\n\
             {\"prompt\": \"ijkl\", \"completion\": \"mnop\"}\n\
             {\"prompt\": \"x\", \"completion\": \"y\"}\n\
             {\"prompt\": \"qrs\", \"completion\": \"tuv\"}\n",
        )
        .unwrap();
        let out = dir.path("ex.bin");
        let o = ExampleOptions::default();
        prepare_examples(&rows, &out, &Tokenizer::Bytes, &o, &mut |_| {}).unwrap();
        let padded = ExampleRows::open(&out, 7).unwrap();
        assert_eq!((padded.rows(), padded.is_packed()), (5, false));
        assert!((padded.padding_share() - 16.0 / 40.0).abs() < 1e-12);
        let mut starts = [9u32; 7];
        assert!(!padded.read_documents(0, &mut starts).unwrap());

        let src = ExampleRows::packed(&out, 7, 5).unwrap();
        assert_eq!((src.rows(), src.len(), src.padding_share()), (3, 24, 0.0));
        let bytes = |s: &str| s.bytes().map(u32::from).collect::<Vec<_>>();
        let mut row = [0u32; 8];
        for (r, want) in ["ijklmnop", "qrstuvxy", "defghabc"].iter().enumerate() {
            src.read(r as u64 * 8, &mut row).unwrap();
            assert_eq!(row.to_vec(), bytes(want), "row {r}");
        }
        src.read_documents(8, &mut starts).unwrap();
        assert_eq!(starts, [0, 0, 0, 0, 0, 0, 6]);
        src.read_documents(16, &mut starts).unwrap();
        assert_eq!(starts, [0, 0, 0, 0, 0, 5, 5]);
        let mut mask = [9u8; 8];
        src.read_mask(16, &mut mask).unwrap();
        // "de|fgh" then "a|bc": the completions, and not "a" (a document's first token).
        assert_eq!(mask, [0, 0, 1, 1, 1, 0, 1, 1]);

        let sampler = Sampler::new(src.len(), 7, 3).unwrap();
        let layout = BatchLayout::new(3, 1, 1).unwrap();
        let batch = sampler.batch(&src, &layout, 0, 0, 0, 256).unwrap();
        let docs = batch
            .documents
            .as_ref()
            .expect("packed rows carry their starts");
        for j in 0..3 {
            let r = sampler.window(j as u64);
            let mut want = [0u32; 7];
            src.read_documents(r * 8, &mut want).unwrap();
            assert_eq!(docs[j * 7..(j + 1) * 7], want, "row {r}");
            if r == 2 {
                // Targets "efghabc": prompt's, then f g h; "a" no target; b c.
                let t = &batch.targets[j * 7..(j + 1) * 7];
                let i = IGNORE_TARGET;
                assert_eq!(t, [i, 102, 103, 104, i, 98, 99]);
            }
        }
    }
}
