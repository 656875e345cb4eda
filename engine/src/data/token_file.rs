//! `.bin` token files: little-endian `u16` token ids, no header (the nanoGPT layout),
//! memory-mapped; `u32` where the sidecar says so (vocabularies past 65536 ids: Llama 3's
//! 128256, Qwen2's 151936). An optional sidecar `<file>.json` (written by [`prepare`])
//! records the tokenizer (a Hugging Face one by its file and SHA-256), its vocabulary
//! size, the id width and the token count. Without a sidecar a file is `u16`.
//!
//! [`prepare`]: super::prepare::prepare

use std::ffi::OsString;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use super::text::{map_file, MappedFile};
use super::{check_range, DataError, Result, TokenSource};

/// The width of a token file's ids.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum TokenDtype {
    #[default]
    U16,
    U32,
}

impl TokenDtype {
    /// The narrowest width that holds every id below `vocab_size`.
    pub fn for_vocab(vocab_size: usize) -> TokenDtype {
        if vocab_size <= 1 << 16 {
            TokenDtype::U16
        } else {
            TokenDtype::U32
        }
    }

    pub fn bytes(self) -> usize {
        match self {
            TokenDtype::U16 => 2,
            TokenDtype::U32 => 4,
        }
    }

    pub fn max_id(self) -> u32 {
        match self {
            TokenDtype::U16 => u16::MAX as u32,
            TokenDtype::U32 => u32::MAX,
        }
    }

    fn read(self, b: &[u8]) -> u32 {
        match self {
            TokenDtype::U16 => u16::from_le_bytes([b[0], b[1]]) as u32,
            TokenDtype::U32 => u32::from_le_bytes([b[0], b[1], b[2], b[3]]),
        }
    }
}

impl std::fmt::Display for TokenDtype {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            TokenDtype::U16 => "u16",
            TokenDtype::U32 => "u32",
        })
    }
}

fn is_u16(d: &TokenDtype) -> bool {
    *d == TokenDtype::U16
}

/// Which end of a long example `max_length` keeps.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Truncation {
    #[default]
    KeepStart,
    KeepEnd,
}

impl std::str::FromStr for Truncation {
    type Err = DataError;
    fn from_str(s: &str) -> Result<Truncation> {
        match s {
            "keep_start" => Ok(Truncation::KeepStart),
            "keep_end" => Ok(Truncation::KeepEnd),
            other => Err(DataError::InvalidArgument(format!(
                "truncation `{other}`: give keep_start (keep an example's first tokens) or \
                 keep_end (its last)"
            ))),
        }
    }
}

/// What a prepared example file holds, in its sidecar.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ExampleSet {
    /// The dataset's format, as `records::Format::describe` says it.
    pub format: String,
    /// The columns read, by role (`prompt` → the column holding it).
    pub columns: std::collections::BTreeMap<String, String>,
    pub examples: u64,
    /// Tokens the loss is taken on.
    pub trained_tokens: u64,
    /// Examples cut to `max_length`.
    pub truncated: u64,
    /// Examples dropped: nothing left to train on.
    pub dropped: u64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_length: Option<usize>,
    pub truncation: Truncation,
    pub train_on_inputs: bool,
    /// How the assistant's text was found, for conversations.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub span_method: Option<String>,
    /// Where the chat template came from, for conversations.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub chat_template: Option<String>,
    /// The day the template's `strftime_now` gave, for conversations.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub date: Option<String>,
    /// Examples in which an end-of-turn or EOS token follows a trained stretch
    /// untrained (the template closes the assistant's turn outside its trained span),
    /// and the first such token.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub untrained_ends: u64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub untrained_end: Option<String>,
}

fn is_zero(n: &u64) -> bool {
    *n == 0
}

/// `out.bin.<ext>`: a file beside the token file `out.bin` (an example file's `mask`
/// and `examples`).
pub fn side_path(bin: &Path, ext: &str) -> PathBuf {
    let mut p = bin.as_os_str().to_owned();
    p.push(format!(".{ext}"));
    PathBuf::from(p)
}

/// The `<file>.json` written next to a prepared `.bin`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Sidecar {
    /// `"gpt2"` (tiktoken's r50k_base BPE), `"bytes"`, `"huggingface"`, or any name
    /// another tool wrote.
    pub tokenizer: String,
    /// Every id in the file is below this.
    pub vocab_size: usize,
    /// Number of tokens in the `.bin` (its byte length / the id width).
    pub tokens: u64,
    /// The ids' width; `u16` where absent (as sidecars before `u32` files were).
    #[serde(default, skip_serializing_if = "is_u16")]
    pub dtype: TokenDtype,
    /// A Hugging Face tokenizer's `tokenizer.json` (absolute path).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tokenizer_file: Option<PathBuf>,
    /// Its SHA-256, lowercase hex: what a model's tokenizer must match.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tokenizer_sha256: Option<String>,
    /// An example file's (`examples::prepare_examples`): how it was made and counts.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub examples: Option<ExampleSet>,
}

impl Sidecar {
    /// A sidecar of `tokens` ids below `vocab_size`, named `tokenizer`, as wide as the
    /// vocabulary needs.
    pub fn new(tokenizer: &str, vocab_size: usize, tokens: u64) -> Sidecar {
        Sidecar {
            tokenizer: tokenizer.to_string(),
            vocab_size,
            tokens,
            dtype: TokenDtype::for_vocab(vocab_size),
            tokenizer_file: None,
            tokenizer_sha256: None,
            examples: None,
        }
    }

    /// `<bin>.json`: the sidecar's path for a token file.
    pub fn path_for(bin: &Path) -> PathBuf {
        let mut s = OsString::from(bin.as_os_str());
        s.push(".json");
        PathBuf::from(s)
    }

    /// Reads the sidecar of `bin`, `None` if there is none.
    pub fn read_for(bin: &Path) -> Result<Option<Sidecar>> {
        let path = Sidecar::path_for(bin);
        let text = match std::fs::read_to_string(&path) {
            Ok(t) => t,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
            Err(e) => return Err(DataError::io(&path, "read", e)),
        };
        // An editor may have saved it with a UTF-8 byte-order mark.
        let text = text.strip_prefix('\u{feff}').unwrap_or(&text);
        serde_json::from_str(text).map(Some).map_err(|e| {
            DataError::format(
                &path,
                format!(
                    "not a valid token-file sidecar ({e}). Expected {{\"tokenizer\": ..., \
                     \"vocab_size\": ..., \"tokens\": ...}}: delete it or prepare the data again"
                ),
            )
        })
    }
}

/// A memory-mapped `.bin` of little-endian `u16` (or `u32`) tokens.
pub struct TokenFile {
    path: PathBuf,
    map: MappedFile,
    sidecar: Option<Sidecar>,
    dtype: TokenDtype,
}

impl TokenFile {
    /// Opens a token stream; an example file (whose sidecar describes examples) is
    /// refused: read as a stream, its prompts would be trained on and its examples run
    /// into each other (`ExampleRows` reads it).
    pub fn open(path: &Path) -> Result<TokenFile> {
        let file = TokenFile::open_ids(path)?;
        if let Some(set) = file.sidecar.as_ref().and_then(|s| s.examples.as_ref()) {
            return Err(DataError::format(
                path,
                format!(
                    "an example file ({} examples of {}, with a loss mask beside it), not a \
                     token stream: train or evaluate on it with `--data` (one example per \
                     row, its mask applied)",
                    set.examples, set.format
                ),
            ));
        }
        Ok(file)
    }

    /// The ids of a `.bin`, whatever it holds.
    pub(crate) fn open_ids(path: &Path) -> Result<TokenFile> {
        let map = map_file(path)?;
        if map.is_empty() {
            return Err(DataError::format(
                path,
                "the token file is empty. Prepare it again from a non-empty text",
            ));
        }
        let sidecar = Sidecar::read_for(path)?;
        let dtype = sidecar.as_ref().map_or(TokenDtype::U16, |s| s.dtype);
        if !map.len().is_multiple_of(dtype.bytes()) {
            return Err(DataError::format(
                path,
                format!(
                    "{} bytes is not a whole number of tokens, but this .bin token file holds \
                     {}-byte little-endian {dtype} tokens: the file is truncated or not a \
                     token file. Prepare it again",
                    map.len(),
                    dtype.bytes()
                ),
            ));
        }
        if let Some(s) = &sidecar {
            let tokens = (map.len() / dtype.bytes()) as u64;
            if s.tokens != tokens {
                return Err(DataError::format(
                    &Sidecar::path_for(path),
                    format!(
                        "says {} tokens but {} holds {tokens}: the sidecar is stale. Prepare the \
                         data again (or delete the sidecar)",
                        s.tokens,
                        path.display()
                    ),
                ));
            }
        }
        Ok(TokenFile {
            path: path.to_path_buf(),
            map,
            sidecar,
            dtype,
        })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    pub fn sidecar(&self) -> Option<&Sidecar> {
        self.sidecar.as_ref()
    }

    /// The largest id in the file: a full scan (it reads the whole file). Training checks
    /// ids with [`check_ids`](super::check_ids) instead, which names the first bad one.
    pub fn max_token(&self) -> u32 {
        self.map
            .chunks_exact(self.dtype.bytes())
            .map(|c| self.dtype.read(c))
            .max()
            .unwrap_or(0)
    }
}

impl TokenSource for TokenFile {
    fn len(&self) -> u64 {
        (self.map.len() / self.dtype.bytes()) as u64
    }

    fn read(&self, start: u64, out: &mut [u32]) -> Result<()> {
        check_range(&self.name(), self.len(), start, out.len())?;
        let w = self.dtype.bytes();
        let bytes = self.map.range(start as usize * w, out.len() * w)?;
        for (o, c) in out.iter_mut().zip(bytes.chunks_exact(w)) {
            *o = self.dtype.read(c);
        }
        Ok(())
    }

    fn vocab_hint(&self) -> Option<usize> {
        self.sidecar.as_ref().map(|s| s.vocab_size)
    }

    fn find_id_at_least(&self, limit: u32) -> Result<Option<(u64, u32)>> {
        // Straight off the map, without widening blocks through `read`.
        let w = self.dtype.bytes();
        Ok(self
            .map
            .chunks_exact(w)
            .position(|c| self.dtype.read(c) >= limit)
            .map(|k| (k as u64, self.dtype.read(&self.map[w * k..w * (k + 1)]))))
    }

    fn name(&self) -> String {
        self.path.display().to_string()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::data::test_util::TempDir;
    use crate::data::{check_source, Sampler};

    fn write_u16(path: &Path, ids: &[u16]) {
        let bytes: Vec<u8> = ids.iter().flat_map(|t| t.to_le_bytes()).collect();
        std::fs::write(path, bytes).unwrap();
    }

    #[test]
    fn a_sidecar_saved_with_a_byte_order_mark_is_read() {
        let dir = std::env::temp_dir().join(format!("kiln-sidecar-bom-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let bin = dir.join("t.bin");
        let json = r#"{"tokenizer": "bytes", "vocab_size": 256, "tokens": 3}"#;
        std::fs::write(Sidecar::path_for(&bin), format!("\u{feff}{json}")).unwrap();
        let read = Sidecar::read_for(&bin).unwrap().expect("a sidecar");
        let plain: Sidecar = serde_json::from_str(json).unwrap();
        assert_eq!(read, plain);
        std::fs::remove_dir_all(&dir).ok();
    }

    #[test]
    fn reads_back_little_endian_u16_through_the_map() {
        let dir = TempDir::new();
        let p = dir.path("t.bin");
        let ids: Vec<u16> = vec![0, 1, 255, 256, 50256, 65535, 7];
        write_u16(&p, &ids);
        let f = TokenFile::open(&p).unwrap();
        assert_eq!(f.len(), 7);
        assert_eq!(f.vocab_hint(), None);
        let mut out = vec![0u32; 7];
        f.read(0, &mut out).unwrap();
        assert_eq!(out, ids.iter().map(|&t| t as u32).collect::<Vec<_>>());
        let mut two = [0u32; 2];
        f.read(3, &mut two).unwrap();
        assert_eq!(two, [256, 50256]);
        assert!(f.read(6, &mut two).is_err());
        assert_eq!(f.max_token(), 65535);
    }

    #[test]
    fn bad_files_are_errors_that_name_the_file() {
        let dir = TempDir::new();
        let missing = dir.path("missing.bin");
        let e = TokenFile::open(&missing).err().unwrap().to_string();
        assert!(
            e.contains("missing.bin") && e.contains("no such file"),
            "{e}"
        );

        let empty = dir.path("empty.bin");
        std::fs::write(&empty, b"").unwrap();
        let e = TokenFile::open(&empty).err().unwrap().to_string();
        assert!(e.contains("empty.bin") && e.contains("empty"), "{e}");

        let odd = dir.path("odd.bin");
        std::fs::write(&odd, [1u8, 0, 2]).unwrap();
        let e = TokenFile::open(&odd).err().unwrap().to_string();
        assert!(
            e.contains("odd.bin") && e.contains("not a whole number"),
            "{e}"
        );

        let short = dir.path("short.bin");
        write_u16(&short, &[1, 2, 3]);
        let f = TokenFile::open(&short).unwrap();
        let e = check_source(&f, 3, 100).unwrap_err().to_string();
        assert!(
            e.contains("short.bin") && e.contains("shorter than one row"),
            "{e}"
        );
        let e = Sampler::new(f.len(), 3, 0).unwrap_err().to_string();
        assert!(e.contains("shorter than one row"), "{e}");
    }

    #[test]
    fn out_of_vocab_ids_are_found_when_the_batch_is_read() {
        let dir = TempDir::new();
        let p = dir.path("big.bin");
        write_u16(&p, &[1, 2, 3, 4, 5, 6, 99, 7]);
        let f = TokenFile::open(&p).unwrap();
        let s = Sampler::new(f.len(), 3, 0).unwrap();
        // Two windows, [1 2 3 4] and [5 6 99 7]: reading both must hit the 99.
        let e = s.read_rows(&f, 0, 2, 50).unwrap_err().to_string();
        assert!(
            e.contains("big.bin") && e.contains("token id 99") && e.contains("at token 6"),
            "{e}"
        );
        assert!(s.read_rows(&f, 0, 2, 100).is_ok());
    }

    #[test]
    fn sidecar_gives_the_vocabulary_and_is_checked() {
        let dir = TempDir::new();
        let p = dir.path("s.bin");
        write_u16(&p, &[1, 2, 3, 4]);
        let side = Sidecar::new("gpt2", 50257, 4);
        std::fs::write(Sidecar::path_for(&p), serde_json::to_string(&side).unwrap()).unwrap();
        let f = TokenFile::open(&p).unwrap();
        assert_eq!(f.sidecar(), Some(&side));
        assert_eq!(f.vocab_hint(), Some(50257));
        let e = check_source(&f, 2, 1000).unwrap_err().to_string();
        assert!(
            e.contains("s.bin") && e.contains("50257") && e.contains("1000"),
            "{e}"
        );
        assert!(check_source(&f, 2, 50304).is_ok());

        std::fs::write(
            Sidecar::path_for(&p),
            r#"{"tokenizer":"gpt2","vocab_size":50257,"tokens":9}"#,
        )
        .unwrap();
        let e = TokenFile::open(&p).err().unwrap().to_string();
        assert!(e.contains("s.bin.json") && e.contains("stale"), "{e}");

        std::fs::write(Sidecar::path_for(&p), "not json").unwrap();
        let e = TokenFile::open(&p).err().unwrap().to_string();
        assert!(e.contains("s.bin.json") && e.contains("not a valid"), "{e}");
    }
}
