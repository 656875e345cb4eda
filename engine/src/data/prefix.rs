//! The first `len` tokens of another source: what training samples from when the
//! source's tail is held out for evaluation.

use std::sync::Arc;

use super::{DataError, Result, TokenSource};

pub struct Prefix {
    inner: Arc<dyn TokenSource>,
    len: u64,
}

impl Prefix {
    pub fn new(inner: Arc<dyn TokenSource>, len: u64) -> Result<Prefix> {
        if len > inner.len() {
            return Err(DataError::InvalidArgument(format!(
                "a prefix of {len} tokens of {}, which holds only {}",
                inner.name(),
                inner.len()
            )));
        }
        Ok(Prefix { inner, len })
    }
}

impl Prefix {
    /// Tokens `start .. start + n` lie in the prefix.
    fn check(&self, start: u64, n: usize) -> Result<()> {
        if start + n as u64 > self.len {
            return Err(DataError::InvalidArgument(format!(
                "tokens {start}..{} are past the first {} of {} (the rest is held out)",
                start + n as u64,
                self.len,
                self.inner.name()
            )));
        }
        Ok(())
    }
}

impl TokenSource for Prefix {
    fn len(&self) -> u64 {
        self.len
    }

    fn read(&self, start: u64, out: &mut [u32]) -> Result<()> {
        self.check(start, out.len())?;
        self.inner.read(start, out)
    }

    fn read_mask(&self, start: u64, out: &mut [u8]) -> Result<bool> {
        self.check(start, out.len())?;
        self.inner.read_mask(start, out)
    }

    fn read_documents(&self, start: u64, out: &mut [u32]) -> Result<bool> {
        self.check(start, out.len())?;
        self.inner.read_documents(start, out)
    }

    fn vocab_hint(&self) -> Option<usize> {
        self.inner.vocab_hint()
    }

    fn name(&self) -> String {
        format!("{} (first {} tokens)", self.inner.name(), self.len)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::data::MemorySource;

    #[test]
    fn reads_inside_the_prefix_and_refuses_the_tail() {
        let src = Arc::new(MemorySource::new("m", (0..10).collect(), None));
        let p = Prefix::new(src.clone(), 6).unwrap();
        assert_eq!(p.len(), 6);
        let mut out = [0u32; 3];
        p.read(3, &mut out).unwrap();
        assert_eq!(out, [3, 4, 5]);
        assert!(p.read(4, &mut out).is_err());
        assert!(Prefix::new(src, 11).is_err());
    }
}
