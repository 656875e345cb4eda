//! The data pipeline: where training tokens come from and in which order they are read.
//!
//! Training consumes a stream of token ids (`u32`, like the model's token and target
//! buffers). A *sample* is a row of `T + 1` consecutive tokens: the model's inputs are
//! the first `T`, its targets the last `T` (each input's next token).
//!
//! - [`TokenSource`]: a stream of tokens with a length. Implemented by
//!   [`MemorySource`] (tokens held in memory, e.g. the synthetic [`addition`] data),
//!   [`ByteTextSource`] (a text file, one token per byte, vocabulary 256) and
//!   [`TokenFile`] (a memory-mapped `.bin` of little-endian `u16` tokens, the nanoGPT
//!   layout, with an optional `.json` sidecar written by [`prepare()`]).
//! - [`Sampler`]: cuts the stream into non-overlapping windows of `T + 1` tokens and
//!   visits them in a seeded, per-epoch permutation. Which window a sample reads is a
//!   pure function of (seed, sample index), so a checkpoint stores one counter.
//! - [`Loader`]: worker threads that build the batches ahead of the training step, handed
//!   out in the same order whatever the worker count.
//! - [`prepare`](prepare::prepare): text file to `.bin` token file (GPT-2 BPE or bytes).
//! - [`clusters()`]: a synthetic classification task for small examples.
//!
//! Token ids are checked against the model's vocabulary lazily, once per batch, when the
//! batch is built (on a loader worker): see [`Sampler::read_rows`].

pub mod addition;
pub mod clusters;
pub mod memory;
pub mod prefetch;
pub mod prefix;
pub mod prepare;
pub mod sampler;
pub mod text;
pub mod token_file;

use std::path::{Path, PathBuf};

pub use addition::{accuracy, Addition, EvalProblem, EvalRows, DEFAULT_DIGITS};
pub use clusters::clusters;
pub use memory::MemorySource;
pub use prefetch::{Fetched, Loader, LoaderConfig};
pub use prefix::Prefix;
pub use prepare::{prepare, write_token_file, Tokenizer};
pub use sampler::{Batch, BatchLayout, Sampler};
pub use text::ByteTextSource;
pub use token_file::{Sidecar, TokenFile};

pub type Result<T, E = DataError> = std::result::Result<T, E>;

/// Errors of the data pipeline. Each names the file (or source) and says how to fix it.
#[derive(Debug, thiserror::Error)]
pub enum DataError {
    #[error("{path}: {action} failed: {source}")]
    Io {
        path: PathBuf,
        action: &'static str,
        #[source]
        source: std::io::Error,
    },

    #[error("{path}: no such file. Check the path{hint}")]
    NotFound { path: PathBuf, hint: &'static str },

    /// The file exists but cannot be used as it is (empty, truncated, too short, ...).
    #[error("{path}: {detail}")]
    Format { path: PathBuf, detail: String },

    #[error(
        "{source_name}: token id {id} at token {position} is not below the model's vocabulary \
         size {vocab}. The data was tokenized for a larger vocabulary: prepare it again with the \
         model's tokenizer, or give the model a vocab_size of at least {needed}",
        needed = *id as u64 + 1
    )]
    TokenOutOfRange {
        source_name: String,
        position: u64,
        id: u32,
        vocab: usize,
    },

    #[error("{source_name}: its tokenizer has a vocabulary of {data_vocab} ids but the model's vocab_size is {model_vocab}. Give the model a vocab_size of at least {data_vocab}, or prepare the data with a smaller tokenizer")]
    VocabTooSmall {
        source_name: String,
        data_vocab: usize,
        model_vocab: usize,
    },

    #[error("invalid argument: {0}")]
    InvalidArgument(String),

    #[error("data loader: {0}")]
    Loader(String),
}

impl DataError {
    pub(crate) fn io(path: &Path, action: &'static str, source: std::io::Error) -> DataError {
        if source.kind() == std::io::ErrorKind::NotFound {
            DataError::NotFound {
                path: path.to_path_buf(),
                hint: " (a .bin token file is made from a text file with `prepare`)",
            }
        } else {
            DataError::Io {
                path: path.to_path_buf(),
                action,
                source,
            }
        }
    }

    pub(crate) fn format(path: &Path, detail: impl Into<String>) -> DataError {
        DataError::Format {
            path: path.to_path_buf(),
            detail: detail.into(),
        }
    }
}

impl From<DataError> for crate::Error {
    fn from(e: DataError) -> crate::Error {
        crate::Error::InvalidArgument(e.to_string())
    }
}

/// A stream of token ids that can be read at any position (thread-safe: loader workers
/// read it concurrently).
pub trait TokenSource: Send + Sync {
    /// Number of tokens in the stream.
    fn len(&self) -> u64;

    fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Copies tokens `start .. start + out.len()` into `out`. Errors if that range is not
    /// inside the stream.
    fn read(&self, start: u64, out: &mut [u32]) -> Result<()>;

    /// The vocabulary size of the tokenizer that made this stream (every id is below
    /// it), when known: 256 for bytes, the sidecar's value for a prepared `.bin`.
    fn vocab_hint(&self) -> Option<usize>;

    /// Human-readable name for messages (usually the path).
    fn name(&self) -> String;
}

/// Checks up front what can be checked without reading the data: the source holds at
/// least one row of `t + 1` tokens and its tokenizer's vocabulary (when known) fits the
/// model's `model_vocab`. Individual ids are checked per batch by [`Sampler::read_rows`].
pub fn check_source(source: &dyn TokenSource, t: usize, model_vocab: usize) -> Result<()> {
    if t == 0 {
        return Err(DataError::InvalidArgument(
            "the sequence length T must be at least 1".into(),
        ));
    }
    let row = t as u64 + 1;
    if source.len() < row {
        return Err(DataError::InvalidArgument(format!(
            "{}: holds {} tokens, shorter than one row of T + 1 = {row} tokens. Use more data \
             or a shorter sequence length",
            source.name(),
            source.len()
        )));
    }
    if let Some(v) = source.vocab_hint() {
        if v > model_vocab {
            return Err(DataError::VocabTooSmall {
                source_name: source.name(),
                data_vocab: v,
                model_vocab,
            });
        }
    }
    Ok(())
}

/// Opens a file as a token source by its extension: `.bin` is a [`TokenFile`] (u16
/// tokens), anything else a [`ByteTextSource`] (one token per byte).
pub fn open_path(path: &Path) -> Result<Box<dyn TokenSource>> {
    if path
        .extension()
        .is_some_and(|e| e.eq_ignore_ascii_case("bin"))
    {
        Ok(Box::new(TokenFile::open(path)?))
    } else {
        Ok(Box::new(ByteTextSource::open(path)?))
    }
}

/// Checks that `start .. start + n` lies in a stream of `len` tokens.
pub(crate) fn check_range(name: &str, len: u64, start: u64, n: usize) -> Result<()> {
    match start.checked_add(n as u64) {
        Some(end) if end <= len => Ok(()),
        _ => Err(DataError::InvalidArgument(format!(
            "{name}: read of {n} tokens at {start} is past the end of the stream ({len} tokens)"
        ))),
    }
}

/// SplitMix64's finaliser: a bijective 64-bit mixer. Used for every seeded decision in
/// this module so that each is a pure function of its inputs.
pub(crate) fn mix64(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// Hash of several words, order-sensitive.
pub(crate) fn hash(words: &[u64]) -> u64 {
    words
        .iter()
        .fold(0x243F_6A88_85A3_08D3, |h, &w| mix64(h ^ mix64(w)))
}

#[cfg(test)]
pub(crate) mod test_util {
    use std::path::PathBuf;
    use std::sync::atomic::{AtomicU64, Ordering};

    /// A fresh empty directory under the system temp dir, removed on drop.
    pub struct TempDir(pub PathBuf);

    impl TempDir {
        pub fn new() -> TempDir {
            static N: AtomicU64 = AtomicU64::new(0);
            let p = std::env::temp_dir().join(format!(
                "kiln-data-test-{}-{}",
                std::process::id(),
                N.fetch_add(1, Ordering::Relaxed)
            ));
            let _ = std::fs::remove_dir_all(&p);
            std::fs::create_dir_all(&p).unwrap();
            TempDir(p)
        }
        pub fn path(&self, name: &str) -> PathBuf {
            self.0.join(name)
        }
    }

    impl Drop for TempDir {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn check_source_rejects_short_streams_and_big_vocabularies() {
        let s = MemorySource::new("mem", vec![1, 2, 3, 4], Some(300));
        assert!(check_source(&s, 3, 300).is_ok());
        let e = check_source(&s, 4, 300).unwrap_err().to_string();
        assert!(
            e.contains("mem") && e.contains("shorter than one row"),
            "{e}"
        );
        let e = check_source(&s, 3, 256).unwrap_err().to_string();
        assert!(e.contains("vocab_size is 256") && e.contains("300"), "{e}");
        assert!(check_source(&s, 0, 300).is_err());
    }

    #[test]
    fn hash_depends_on_every_word_and_order() {
        assert_ne!(hash(&[1, 2]), hash(&[2, 1]));
        assert_ne!(hash(&[1, 2]), hash(&[1, 3]));
        assert_eq!(hash(&[7, 9]), hash(&[7, 9]));
    }
}
