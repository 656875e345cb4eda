//! An example file (`examples::prepare_examples`: ids, loss mask, example offsets) read
//! as a stream of rows of `T + 1` tokens, one example per row: a longer example is cut
//! to its first `T + 1` tokens, a shorter one padded. Padding comes after the
//! example's tokens, so under causal attention no token of the example sees it, and its
//! mask is 0, so no loss is taken on it: padding neither attends nor counts. Row `k`
//! starts at token `k · (T + 1)`, so the [`Sampler`](super::Sampler)'s windows are the
//! examples, each visited once per epoch, and a held-out tail is whole examples.

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
}

impl ExampleRows {
    /// The example file `path` (a `.bin` whose sidecar describes examples) in rows of
    /// `t + 1`. Errors name a missing or inconsistent mask or offsets file.
    pub fn open(path: &Path, t: usize) -> Result<ExampleRows> {
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
        })
    }

    /// How the file was prepared (format, counts).
    pub fn set(&self) -> &ExampleSet {
        &self.set
    }

    pub fn examples(&self) -> u64 {
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
        let mut line = format!(
            "{}: {} examples of {}, one per row of T + 1 = {} tokens (padding neither \
             attends nor counts)",
            self.name(),
            self.examples(),
            self.set.format,
            self.row
        );
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

    /// Calls `each(out range, source range)` for the example stretches of stream
    /// tokens `start .. start + n`, after filling nothing: the caller pads the rest.
    fn stretches(
        &self,
        start: u64,
        n: usize,
        mut each: impl FnMut(usize, u64, usize) -> Result<()>,
    ) -> Result<()> {
        check_range(&self.name(), self.len(), start, n)?;
        let mut at = 0usize;
        while at < n {
            let pos = start + at as u64;
            let (k, within) = (pos / self.row, pos % self.row);
            let row_left = (self.row - within) as usize;
            let take = row_left.min(n - at);
            let (s, e) = self.example(k);
            let have = (e - s).saturating_sub(within) as usize;
            if have > 0 {
                each(at, s + within, have.min(take))?;
            }
            at += take;
        }
        Ok(())
    }
}

impl TokenSource for ExampleRows {
    fn len(&self) -> u64 {
        self.examples() * self.row
    }

    fn read(&self, start: u64, out: &mut [u32]) -> Result<()> {
        out.fill(PAD);
        self.stretches(start, out.len(), |at, from, n| {
            self.ids.read(from, &mut out[at..at + n])
        })
    }

    fn read_mask(&self, start: u64, out: &mut [u8]) -> Result<bool> {
        out.fill(0);
        self.stretches(start, out.len(), |at, from, n| {
            out[at..at + n].copy_from_slice(self.mask.range(from as usize, n)?);
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
}
