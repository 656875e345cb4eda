//! Tokens held in memory (the synthetic datasets, tests).

use super::{check_range, Result, TokenSource};

/// A token stream held in a `Vec`.
#[derive(Clone, Debug)]
pub struct MemorySource {
    name: String,
    tokens: Vec<u32>,
    vocab: Option<usize>,
}

impl MemorySource {
    /// `vocab`: the vocabulary the ids come from, when known (every id must be below it).
    pub fn new(name: impl Into<String>, tokens: Vec<u32>, vocab: Option<usize>) -> MemorySource {
        MemorySource {
            name: name.into(),
            tokens,
            vocab,
        }
    }

    pub fn tokens(&self) -> &[u32] {
        &self.tokens
    }
}

impl TokenSource for MemorySource {
    fn len(&self) -> u64 {
        self.tokens.len() as u64
    }

    fn read(&self, start: u64, out: &mut [u32]) -> Result<()> {
        check_range(&self.name, self.len(), start, out.len())?;
        let s = start as usize;
        out.copy_from_slice(&self.tokens[s..s + out.len()]);
        Ok(())
    }

    fn vocab_hint(&self) -> Option<usize> {
        self.vocab
    }

    fn name(&self) -> String {
        self.name.clone()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_ranges_and_rejects_reads_past_the_end() {
        let s = MemorySource::new("m", (0..10).collect(), None);
        let mut out = [0u32; 3];
        s.read(7, &mut out).unwrap();
        assert_eq!(out, [7, 8, 9]);
        let e = s.read(8, &mut out).unwrap_err().to_string();
        assert!(e.contains("m:") && e.contains("past the end"), "{e}");
        assert!(s.read(u64::MAX, &mut out).is_err());
    }
}
