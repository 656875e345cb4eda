//! Text file to `.bin` token file (little-endian `u16`, no header), with the GPT-2 BPE or
//! one token per byte, plus a `<out>.json` sidecar naming the tokenizer, its vocabulary
//! size and the token count (read back by [`TokenFile`](super::TokenFile)).
//!
//! The GPT-2 BPE is tiktoken's `r50k_base` as packaged by the `tiktoken-rs` crate, whose
//! merge table is compiled into the binary (`include_str!`): nothing is downloaded at run
//! time.

use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};
use std::str::FromStr;

use super::{DataError, Result, Sidecar};

/// How text becomes token ids.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Tokenizer {
    /// GPT-2's byte-level BPE (tiktoken `r50k_base`), 50257 ids. Text must be UTF-8.
    /// The text is encoded as ordinary text: a literal `<|endoftext|>` in it is not the
    /// special token.
    Gpt2,
    /// Each byte is one token, 256 ids. Any file.
    Bytes,
}

impl Tokenizer {
    /// The name written in the sidecar: `"gpt2"` or `"bytes"`.
    pub fn name(&self) -> &'static str {
        match self {
            Tokenizer::Gpt2 => "gpt2",
            Tokenizer::Bytes => "bytes",
        }
    }

    pub fn vocab_size(&self) -> usize {
        match self {
            Tokenizer::Gpt2 => 50257,
            Tokenizer::Bytes => 256,
        }
    }

    /// Token ids of `text`. `what` names the text in errors (usually its path).
    pub fn encode(&self, text: &[u8], what: &Path) -> Result<Vec<u32>> {
        match self {
            Tokenizer::Bytes => Ok(text.iter().map(|&b| b as u32).collect()),
            Tokenizer::Gpt2 => {
                let text = std::str::from_utf8(text).map_err(|e| {
                    DataError::format(
                        what,
                        format!(
                            "not UTF-8 text (invalid byte at offset {}), which the GPT-2 \
                             tokenizer needs: convert it to UTF-8, or use the bytes tokenizer",
                            e.valid_up_to()
                        ),
                    )
                })?;
                Ok(tiktoken_rs::r50k_base_singleton().encode_ordinary(text))
            }
        }
    }

    /// Text of token ids (invalid UTF-8 from partial byte sequences is replaced by
    /// U+FFFD). Errors on an id outside the vocabulary.
    pub fn decode(&self, ids: &[u32]) -> Result<String> {
        if let Some(&id) = ids.iter().find(|&&id| id as usize >= self.vocab_size()) {
            return Err(DataError::InvalidArgument(format!(
                "{} tokenizer: id {id} is outside its vocabulary of {}",
                self.name(),
                self.vocab_size()
            )));
        }
        let bytes = match self {
            Tokenizer::Bytes => ids.iter().map(|&id| id as u8).collect(),
            Tokenizer::Gpt2 => tiktoken_rs::r50k_base_singleton()
                .decode_bytes(ids)
                .map_err(|e| DataError::InvalidArgument(format!("gpt2 tokenizer: {e:?}")))?,
        };
        Ok(String::from_utf8_lossy(&bytes).into_owned())
    }
}

impl FromStr for Tokenizer {
    type Err = DataError;
    fn from_str(s: &str) -> Result<Tokenizer> {
        match s {
            "gpt2" | "r50k_base" => Ok(Tokenizer::Gpt2),
            "bytes" | "byte" => Ok(Tokenizer::Bytes),
            _ => Err(DataError::InvalidArgument(format!(
                "unknown tokenizer `{s}`: use `gpt2` (GPT-2 BPE, r50k_base) or `bytes`"
            ))),
        }
    }
}

/// Tokenizes the text file `input` into the token file `output` (and `<output>.json`),
/// each written atomically. Returns the number of tokens.
pub fn prepare(input: &Path, output: &Path, tokenizer: Tokenizer) -> Result<u64> {
    let text = std::fs::read(input).map_err(|e| DataError::io(input, "read", e))?;
    if text.is_empty() {
        return Err(DataError::format(
            input,
            "the text file is empty: there is nothing to tokenize",
        ));
    }
    let tokens = tokenizer.encode(&text, input)?;
    write_token_file(output, &tokens, tokenizer.name(), tokenizer.vocab_size())
}

/// Writes `tokens` as a `.bin` of little-endian `u16` at `path`, then the sidecar
/// `<path>.json`, each through a temporary file that is synced and renamed into place
/// (a reader never sees a partial file). Errors if an id does not fit in `u16` or is not
/// below `vocab_size`. Returns the number of tokens.
pub fn write_token_file(
    path: &Path,
    tokens: &[u32],
    tokenizer: &str,
    vocab_size: usize,
) -> Result<u64> {
    if let Some((i, &id)) = tokens
        .iter()
        .enumerate()
        .find(|(_, &id)| id > u16::MAX as u32 || id as usize >= vocab_size)
    {
        let detail = if id > u16::MAX as u32 {
            format!(
                "token id {id} (token {i}) does not fit in the u16 of a .bin token file \
                 (ids up to 65535): use a tokenizer with at most 65536 ids"
            )
        } else {
            format!(
                "token id {id} (token {i}) is not below the {tokenizer} vocabulary of {vocab_size}"
            )
        };
        return Err(DataError::format(path, detail));
    }
    let mut bytes = Vec::with_capacity(tokens.len() * 2);
    for &id in tokens {
        bytes.extend_from_slice(&(id as u16).to_le_bytes());
    }
    write_atomically(path, &bytes)?;
    let sidecar = Sidecar {
        tokenizer: tokenizer.to_string(),
        vocab_size,
        tokens: tokens.len() as u64,
    };
    let json = serde_json::to_string_pretty(&sidecar).expect("a sidecar serialises");
    write_atomically(&Sidecar::path_for(path), json.as_bytes())?;
    Ok(tokens.len() as u64)
}

/// Writes `bytes` to a temporary file next to `path`, syncs it, renames it to `path` and
/// syncs the directory (where the platform allows), so that `path` holds either the old
/// content or all of the new.
fn write_atomically(path: &Path, bytes: &[u8]) -> Result<()> {
    let mut tmp_name = path.as_os_str().to_owned();
    tmp_name.push(format!(".tmp-{}", std::process::id()));
    let tmp = PathBuf::from(tmp_name);
    let result = (|| {
        let file = File::create(&tmp).map_err(|e| DataError::io(&tmp, "create", e))?;
        let mut w = BufWriter::new(file);
        w.write_all(bytes)
            .map_err(|e| DataError::io(&tmp, "write", e))?;
        let file = w
            .into_inner()
            .map_err(|e| DataError::io(&tmp, "write", e.into_error()))?;
        file.sync_all()
            .map_err(|e| DataError::io(&tmp, "sync", e))?;
        drop(file);
        std::fs::rename(&tmp, path).map_err(|e| DataError::io(path, "rename into place", e))
    })();
    if result.is_err() {
        let _ = std::fs::remove_file(&tmp);
        return result;
    }
    // Persist the rename itself. Directories cannot be opened for syncing everywhere
    // (Windows), so this part is best effort.
    let dir = match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d,
        _ => Path::new("."),
    };
    if let Ok(d) = File::open(dir) {
        let _ = d.sync_all();
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::data::test_util::TempDir;
    use crate::data::{TokenFile, TokenSource};

    fn read_all(f: &TokenFile) -> Vec<u32> {
        let mut out = vec![0; f.len() as usize];
        f.read(0, &mut out).unwrap();
        out
    }

    #[test]
    fn bytes_round_trip_exactly() {
        let dir = TempDir::new();
        let (input, output) = (dir.path("in.txt"), dir.path("out.bin"));
        let text: Vec<u8> = (0..=255u8).chain(*b"Hello\n\xff\x00").collect();
        std::fs::write(&input, &text).unwrap();
        assert_eq!(prepare(&input, &output, Tokenizer::Bytes).unwrap(), 264);
        let f = TokenFile::open(&output).unwrap();
        let ids = read_all(&f);
        assert_eq!(ids.iter().map(|&t| t as u8).collect::<Vec<_>>(), text);
        assert_eq!(
            f.sidecar().unwrap(),
            &Sidecar {
                tokenizer: "bytes".into(),
                vocab_size: 256,
                tokens: 264
            }
        );
        assert_eq!(f.vocab_hint(), Some(256));
        assert_eq!(std::fs::read(&output).unwrap().len(), 2 * 264);
        // No temporary files are left behind.
        let names: Vec<_> = std::fs::read_dir(&dir.0)
            .unwrap()
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .collect();
        assert_eq!(names.len(), 3, "{names:?}");
    }

    #[test]
    fn gpt2_gives_the_known_ids() {
        let dir = TempDir::new();
        let (input, output) = (dir.path("in.txt"), dir.path("out.bin"));
        std::fs::write(&input, "Hello world").unwrap();
        assert_eq!(prepare(&input, &output, Tokenizer::Gpt2).unwrap(), 2);
        let f = TokenFile::open(&output).unwrap();
        assert_eq!(read_all(&f), [15496, 995]);
        assert_eq!(f.vocab_hint(), Some(50257));
        assert_eq!(f.sidecar().unwrap().tokenizer, "gpt2");
        let t = Tokenizer::Gpt2;
        let ids = t
            .encode("The quick brown fox.".as_bytes(), Path::new("-"))
            .unwrap();
        assert_eq!(ids, [464, 2068, 7586, 21831, 13]);
        assert_eq!(t.decode(&ids).unwrap(), "The quick brown fox.");
        assert!(t.decode(&[50257]).is_err());
    }

    #[test]
    fn errors_name_the_file() {
        let dir = TempDir::new();
        let out = dir.path("out.bin");
        let e = prepare(&dir.path("missing.txt"), &out, Tokenizer::Bytes)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("missing.txt") && e.contains("no such file"),
            "{e}"
        );

        let empty = dir.path("empty.txt");
        std::fs::write(&empty, "").unwrap();
        let e = prepare(&empty, &out, Tokenizer::Bytes)
            .unwrap_err()
            .to_string();
        assert!(e.contains("empty.txt") && e.contains("empty"), "{e}");

        let latin1 = dir.path("latin1.txt");
        std::fs::write(&latin1, b"caf\xe9").unwrap();
        let e = prepare(&latin1, &out, Tokenizer::Gpt2)
            .unwrap_err()
            .to_string();
        assert!(e.contains("latin1.txt") && e.contains("offset 3"), "{e}");

        let e = write_token_file(&out, &[1, 70_000], "big", 100_000)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("out.bin") && e.contains("70000") && e.contains("u16"),
            "{e}"
        );
        let e = write_token_file(&out, &[1, 300], "bytes", 256)
            .unwrap_err()
            .to_string();
        assert!(e.contains("300") && e.contains("256"), "{e}");
        assert!(!out.exists());
    }

    #[test]
    fn rewriting_replaces_file_and_sidecar() {
        let dir = TempDir::new();
        let out = dir.path("t.bin");
        write_token_file(&out, &[1, 2, 3], "bytes", 256).unwrap();
        write_token_file(&out, &[4, 5], "custom", 10).unwrap();
        let f = TokenFile::open(&out).unwrap();
        assert_eq!(read_all(&f), [4, 5]);
        assert_eq!(f.sidecar().unwrap().tokenizer, "custom");
        assert_eq!("gpt2".parse::<Tokenizer>().unwrap(), Tokenizer::Gpt2);
        assert_eq!("bytes".parse::<Tokenizer>().unwrap(), Tokenizer::Bytes);
        assert!("sentencepiece".parse::<Tokenizer>().is_err());
    }
}
