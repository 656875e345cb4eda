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
//!   layout, or `u32` past 65536 ids, with an optional `.json` sidecar written by
//!   [`prepare()`]).
//! - [`Sampler`]: cuts the stream into non-overlapping windows of `T + 1` tokens and
//!   visits them in a seeded, per-epoch permutation. Which window a sample reads is a
//!   pure function of (seed, sample index), so a checkpoint stores one counter.
//! - [`Loader`]: worker threads that build the batches ahead of the training step, handed
//!   out in the same order whatever the worker count.
//! - [`prepare`](prepare::prepare): text file to `.bin` token file (GPT-2 BPE, bytes or a
//!   Hugging Face `tokenizer.json`, [`HfTokenizer`]).
//! - [`records`]: fine-tuning datasets as rows (JSON Lines, JSON arrays), their format
//!   (text, prompt/completion, messages, ShareGPT) told from their columns;
//!   [`chat_template`](mod@chat_template): conversations rendered as `transformers` renders
//!   them, with the assistant's spans; [`examples`]: rows to example files of tokens
//!   and loss masks (what is trained: the completion, the assistant's turns).
//! - [`clusters()`]: a synthetic classification task for small examples.
//!
//! Token ids are checked against the model's vocabulary once over the whole source when
//! training opens it ([`check_ids`]: the first bad id is named with its position, before
//! any step runs), and again per batch as the batch is built ([`Sampler::read_rows`]).

pub mod addition;
#[cfg(feature = "arrow")]
pub mod arrow_rows;
#[cfg(feature = "tokenizers")]
pub mod chat_template;
pub mod clusters;
pub mod example_rows;
#[cfg(feature = "tokenizers")]
pub mod examples;
mod gpt2_bpe;
#[cfg(feature = "tokenizers")]
pub mod hf_tokenizer;
#[cfg(not(feature = "tokenizers"))]
#[path = "hf_tokenizer_absent.rs"]
pub mod hf_tokenizer;
pub mod memory;
#[cfg(feature = "parquet")]
pub mod parquet_rows;
pub mod prefetch;
pub mod prefix;
pub mod prepare;
pub mod records;
pub mod sampler;
pub mod text;
pub mod text_codec;
pub mod token_file;

use std::path::{Path, PathBuf};

pub use addition::{accuracy, Addition, EvalProblem, EvalRows, DEFAULT_DIGITS};
pub use clusters::clusters;
pub use example_rows::ExampleRows;
pub use hf_tokenizer::HfTokenizer;
pub use memory::MemorySource;
pub use prefetch::{Fetched, Loader, LoaderConfig};
pub use prefix::Prefix;
pub use prepare::{prepare, write_token_file, Tokenizer};
pub use sampler::{Batch, BatchLayout, Sampler};
pub use text::ByteTextSource;
pub use token_file::{Sidecar, TokenDtype, TokenFile};

pub type Result<T, E = DataError> = std::result::Result<T, E>;

/// Errors of the data pipeline. Each names the file (or source) and says how to fix it.
#[derive(Debug, thiserror::Error)]
pub enum DataError {
    // The I/O error is part of the message and deliberately not a `source`: a caller
    // printing the chain (anyhow's `{:#}`) would print it twice.
    #[error("{path}: {action} failed: {err}")]
    Io {
        path: PathBuf,
        action: &'static str,
        err: std::io::Error,
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

    /// Text that the tokenizer cannot take, the message naming what and why.
    #[error("{0}")]
    Text(String),

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
                err: source,
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

    /// Whether tokens `start .. start + out.len()` are trained on as targets (1) or not
    /// (0: a prompt, padding), written into `out`; `false`, leaving `out` alone, for a
    /// stream without a loss mask (every token is trained on).
    fn read_mask(&self, start: u64, out: &mut [u8]) -> Result<bool> {
        let _ = (start, out);
        Ok(false)
    }

    /// For rows that pack several documents: each of tokens `start .. start +
    /// out.len()`'s document start, as a token index within its row of `T + 1`,
    /// written into `out`; `false`, leaving `out` alone, where a row is one document.
    fn read_documents(&self, start: u64, out: &mut [u32]) -> Result<bool> {
        let _ = (start, out);
        Ok(false)
    }

    /// The first token whose id is `limit` or more, as (position, id), or `None`: a scan
    /// of the whole stream.
    fn find_id_at_least(&self, limit: u32) -> Result<Option<(u64, u32)>> {
        const BLOCK: u64 = 1 << 16;
        let mut buf = vec![0u32; BLOCK as usize];
        let mut start = 0;
        while start < self.len() {
            let n = (self.len() - start).min(BLOCK) as usize;
            self.read(start, &mut buf[..n])?;
            if let Some(k) = buf[..n].iter().position(|&id| id >= limit) {
                return Ok(Some((start + k as u64, buf[k])));
            }
            start += n as u64;
        }
        Ok(None)
    }
}

/// The targets of the row at `start` (`targets[k]` is token `start + k + 1`) with those
/// `source`'s loss mask leaves out set to [`IGNORE_TARGET`](crate::IGNORE_TARGET).
pub fn mask_targets(source: &dyn TokenSource, start: u64, targets: &mut [u32]) -> Result<()> {
    let mut mask = vec![1u8; targets.len() + 1];
    if source.read_mask(start, &mut mask)? {
        for (target, &m) in targets.iter_mut().zip(&mask[1..]) {
            if m == 0 {
                *target = crate::IGNORE_TARGET;
            }
        }
    }
    Ok(())
}

/// Checks up front what can be checked without reading the data: the source holds at
/// least one row of `t + 1` tokens and its tokenizer's vocabulary (when known) fits the
/// model's `model_vocab`. [`check_ids`] then reads every id.
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

/// Reads every id of `source` once and errors at the first one that is not below its
/// vocabulary: the vocabulary its sidecar declares (the file is then damaged, or the
/// sidecar is another file's), else the model's `model_vocab`. Call it after
/// [`check_source`] (which ensures the declared vocabulary fits the model). Returns the
/// time the scan took, for the log.
pub fn check_ids(source: &dyn TokenSource, model_vocab: usize) -> Result<std::time::Duration> {
    let started = std::time::Instant::now();
    let declared = source.vocab_hint();
    let limit = declared.map_or(model_vocab, |d| d.min(model_vocab));
    let limit = u32::try_from(limit).unwrap_or(u32::MAX);
    match source.find_id_at_least(limit)? {
        None => Ok(started.elapsed()),
        Some((position, id)) => match declared {
            Some(d) if id as usize >= d => Err(DataError::InvalidArgument(format!(
                "{}: token id {id} at token {position} is not below the vocabulary of {d} ids \
                 that its .json sidecar declares: the file is damaged, or the sidecar belongs \
                 to another file. Prepare the data again with `kiln prepare`",
                source.name()
            ))),
            _ => Err(DataError::TokenOutOfRange {
                source_name: source.name(),
                position,
                id,
                vocab: model_vocab,
            }),
        },
    }
}

/// Whether `path` names a `.bin` token file, by its extension.
fn has_bin_extension(path: &Path) -> bool {
    path.extension()
        .is_some_and(|e| e.eq_ignore_ascii_case("bin"))
}

/// Opens a file as a token source for rows of `t + 1` tokens. A `.bin` is a
/// [`TokenFile`] (u16 tokens, with its sidecar when there is one), or, when its sidecar
/// describes examples, [`ExampleRows`] (one example per row, its loss mask applied);
/// any other file is a [`ByteTextSource`] (one token per
/// byte), unless a token-file sidecar (`<file>.json`) lies next to it: then it is a
/// token file with the wrong name, and reading its bytes as text would train on
/// garbage, so it is refused. A sidecar itself is refused too (it names its token file).
pub fn open_path(path: &Path, t: usize) -> Result<Box<dyn TokenSource>> {
    if has_bin_extension(path) {
        let side = Sidecar::read_for(path)?;
        if side.is_some_and(|s| s.examples.is_some()) {
            return Ok(Box::new(ExampleRows::open(path, t)?));
        }
        return Ok(Box::new(TokenFile::open(path)?));
    }
    let name = path.as_os_str().to_string_lossy();
    if let Some(bin) = name.strip_suffix(".json") {
        let bin = Path::new(bin);
        if has_bin_extension(bin) && bin.is_file() {
            return Err(DataError::format(
                path,
                format!(
                    "this is the sidecar of the token file {}, not training data: pass \
                     --data {}",
                    bin.display(),
                    bin.display()
                ),
            ));
        }
    }
    let source = ByteTextSource::open(path)?;
    // Only JSON that reads as a sidecar counts: an unrelated `notes.txt.json` next to a
    // text file is left alone.
    if let Ok(Some(side)) = Sidecar::read_for(path) {
        let bin = path.with_extension("bin");
        return Err(DataError::format(
            path,
            format!(
                "{} next to it is a token-file sidecar ({} tokenizer, vocabulary {}, {} \
                 tokens), so this is a token file written by `kiln prepare`, but only a .bin \
                 file is read as tokens: any other file is read as text, one token per byte. \
                 Rename both (to {} and {}), or, to train on the file's bytes, delete the \
                 sidecar",
                Sidecar::path_for(path).display(),
                side.tokenizer,
                side.vocab_size,
                side.tokens,
                bin.display(),
                Sidecar::path_for(&bin).display()
            ),
        ));
    }
    Ok(Box::new(source))
}

/// An error for a path that exists but is not a regular file (a directory, a device such
/// as `/dev/zero`, a pipe, a socket), saying what was `expected` there instead; `None`
/// for a regular file. Reading a device or pipe would never end, and mapping a directory
/// fails with a cryptic "No such device".
pub(crate) fn not_a_regular_file(
    path: &Path,
    meta: &std::fs::Metadata,
    expected: &str,
) -> Option<DataError> {
    if meta.is_file() {
        return None;
    }
    let what = if meta.is_dir() {
        "is a directory"
    } else {
        "is not a regular file (a device, a pipe or a socket, which may never end)"
    };
    Some(DataError::format(path, format!("{what}: {expected}")))
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

    fn write_u16(path: &Path, ids: &[u16]) {
        let bytes: Vec<u8> = ids.iter().flat_map(|t| t.to_le_bytes()).collect();
        std::fs::write(path, bytes).unwrap();
    }

    #[test]
    fn check_ids_names_the_first_bad_id_wherever_it_is() {
        let dir = test_util::TempDir::new();
        let p = dir.path("t.bin");
        // Far from the tail that training holds out, in no particular batch.
        let mut ids = vec![3u16; 100_000];
        ids[70_001] = 500;
        ids[90_000] = 999;
        write_u16(&p, &ids);
        let f = TokenFile::open(&p).unwrap();
        let e = check_ids(&f, 100).unwrap_err().to_string();
        assert!(
            e.contains("t.bin") && e.contains("token id 500 at token 70001") && e.contains("100"),
            "{e}"
        );
        assert!(check_ids(&f, 1000).is_ok());
        // Through the generic (block by block) scan as well.
        let m = MemorySource::new("mem", ids.iter().map(|&i| i as u32).collect(), None);
        let e = check_ids(&m, 100).unwrap_err().to_string();
        assert!(e.contains("token id 500 at token 70001"), "{e}");

        // An id beyond what the sidecar declares: the file contradicts its sidecar.
        std::fs::write(
            Sidecar::path_for(&p),
            r#"{"tokenizer":"bytes","vocab_size":256,"tokens":100000}"#,
        )
        .unwrap();
        let f = TokenFile::open(&p).unwrap();
        let e = check_ids(&f, 50_000).unwrap_err().to_string();
        assert!(
            e.contains("token id 500 at token 70001") && e.contains("sidecar declares"),
            "{e}"
        );
    }

    #[test]
    fn a_sidecar_not_the_extension_says_a_file_holds_tokens() {
        let dir = test_util::TempDir::new();
        let bin = dir.path("data.bin");
        prepare::write_token_file(&bin, &[1, 2, 3, 4], "bytes", 256).unwrap();
        assert_eq!(open_path(&bin, 8).unwrap().vocab_hint(), Some(256));
        // The same token file under a text name: refused, not read as bytes.
        let txt = dir.path("data.txt");
        std::fs::copy(&bin, &txt).unwrap();
        std::fs::copy(Sidecar::path_for(&bin), Sidecar::path_for(&txt)).unwrap();
        let e = open_path(&txt, 8).err().unwrap().to_string();
        assert!(
            e.contains("data.txt.json")
                && e.contains("token-file sidecar")
                && e.contains("data.bin")
                && e.contains("delete the sidecar"),
            "{e}"
        );
        // JSON that is not a sidecar does not make a text file a token file.
        std::fs::write(Sidecar::path_for(&txt), r#"{"author": "me"}"#).unwrap();
        assert_eq!(open_path(&txt, 8).unwrap().vocab_hint(), Some(256));
        assert_eq!(open_path(&txt, 8).unwrap().len(), 8);
        // The sidecar itself is not data.
        let e = open_path(&Sidecar::path_for(&bin), 8)
            .err()
            .unwrap()
            .to_string();
        assert!(
            e.contains("sidecar of the token file") && e.contains("--data"),
            "{e}"
        );
    }

    #[test]
    fn a_directory_or_device_as_data_is_named_once_with_what_is_expected() {
        let dir = test_util::TempDir::new();
        for p in [dir.0.clone(), dir.path("sub.bin")] {
            std::fs::create_dir_all(&p).unwrap();
            let e = open_path(&p, 8).err().unwrap().to_string();
            assert!(
                e.contains(&*p.to_string_lossy())
                    && e.contains("is a directory")
                    && e.contains("kiln prepare"),
                "{e}"
            );
        }
        #[cfg(unix)]
        {
            let e = open_path(Path::new("/dev/null"), 8)
                .err()
                .unwrap()
                .to_string();
            assert!(e.contains("not a regular file"), "{e}");
        }
        // An I/O error's text appears once, not again as its source.
        let e = DataError::io(
            Path::new("x"),
            "read",
            std::io::Error::from_raw_os_error(19),
        );
        assert!(std::error::Error::source(&e).is_none());
    }

    #[test]
    fn hash_depends_on_every_word_and_order() {
        assert_ne!(hash(&[1, 2]), hash(&[2, 1]));
        assert_ne!(hash(&[1, 2]), hash(&[1, 3]));
        assert_eq!(hash(&[7, 9]), hash(&[7, 9]));
    }
}
