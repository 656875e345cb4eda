//! Text file to `.bin` token file (little-endian `u16`, or `u32` for a vocabulary past
//! 65536 ids; no header), with the GPT-2 BPE, one token per byte or a Hugging Face
//! `tokenizer.json`, plus a `<out>.json` sidecar naming the tokenizer (a Hugging Face
//! one by its file and SHA-256), its vocabulary size, the id width and the token count
//! (read back by [`TokenFile`](super::TokenFile)).
//!
//! The GPT-2 BPE is tiktoken's `r50k_base` as packaged by the `tiktoken-rs` crate, whose
//! merge table is compiled into the binary (`include_str!`): nothing is downloaded at run
//! time.

use std::fs::File;
use std::io::{BufWriter, Read, Write};
use std::path::{Path, PathBuf};
use std::str::FromStr;

use std::sync::Arc;

use super::hf_tokenizer::HfTokenizer;
use super::token_file::TokenDtype;
use super::{not_a_regular_file, DataError, Result, Sidecar};

/// How text becomes token ids.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Tokenizer {
    /// GPT-2's byte-level BPE (tiktoken `r50k_base`), 50257 ids. Text must be UTF-8.
    /// The text is encoded as ordinary text: a literal `<|endoftext|>` in it is not the
    /// special token.
    Gpt2,
    /// Each byte is one token, 256 ids. Any file.
    Bytes,
    /// A Hugging Face `tokenizer.json` (the model directory's). Text must be UTF-8.
    Hf(Arc<HfTokenizer>),
}

impl Tokenizer {
    /// The name written in the sidecar: `"gpt2"`, `"bytes"` or `"huggingface"`.
    pub fn name(&self) -> &'static str {
        match self {
            Tokenizer::Gpt2 => "gpt2",
            Tokenizer::Bytes => "bytes",
            Tokenizer::Hf(_) => HF_NAME,
        }
    }

    pub fn vocab_size(&self) -> usize {
        match self {
            Tokenizer::Gpt2 => 50257,
            Tokenizer::Bytes => 256,
            Tokenizer::Hf(t) => t.vocab_size(),
        }
    }

    /// `gpt2` or `bytes` by name, or a Hugging Face tokenizer: a `tokenizer.json` or a
    /// model directory holding one.
    pub fn open(spec: &str) -> Result<Tokenizer> {
        // Names first: a directory called `gpt2` (a downloaded model) is `./gpt2`.
        if let Ok(t) = spec.parse() {
            return Ok(t);
        }
        let path = Path::new(spec);
        if !path.exists() {
            return Err(DataError::InvalidArgument(format!(
                "unknown tokenizer `{spec}`: use `gpt2` (GPT-2 BPE, r50k_base), `bytes`, or the \
                 path of a Hugging Face tokenizer.json or model directory (no such file)"
            )));
        }
        Ok(Tokenizer::Hf(Arc::new(HfTokenizer::open(path)?)))
    }

    /// The tokenizer a sidecar names: by name, or a Hugging Face one from the file it
    /// records, which must still have the recorded SHA-256.
    pub fn of_sidecar(side: &Sidecar, sidecar_path: &Path) -> Result<Tokenizer> {
        if side.tokenizer != HF_NAME {
            return side.tokenizer.parse();
        }
        let (Some(file), Some(sha)) = (&side.tokenizer_file, &side.tokenizer_sha256) else {
            return Err(DataError::format(
                sidecar_path,
                "names a Hugging Face tokenizer but not its tokenizer_file and \
                 tokenizer_sha256: prepare the data again",
            ));
        };
        let t = HfTokenizer::open(file)?;
        if &t.sha256 != sha {
            return Err(DataError::format(
                sidecar_path,
                format!(
                    "the data was made with a tokenizer.json of SHA-256 {sha}, but {} now has \
                     {}: the file changed since; prepare the data again",
                    file.display(),
                    t.sha256
                ),
            ));
        }
        Ok(Tokenizer::Hf(Arc::new(t)))
    }

    /// Token ids of `text`. `what` names the text in errors (usually its path).
    pub fn encode(&self, text: &[u8], what: &Path) -> Result<Vec<u32>> {
        match self {
            Tokenizer::Bytes => Ok(text.iter().map(|&b| b as u32).collect()),
            Tokenizer::Hf(t) => {
                let text = std::str::from_utf8(text).map_err(|e| {
                    DataError::format(
                        what,
                        format!(
                            "not UTF-8 text (invalid byte at offset {}), which a Hugging Face \
                             tokenizer needs: convert it to UTF-8",
                            e.valid_up_to()
                        ),
                    )
                })?;
                t.encode(text, true, what)
            }
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
                super::gpt2_bpe::encode(text)
            }
        }
    }

    /// Text of token ids (invalid UTF-8 from partial byte sequences is replaced by
    /// U+FFFD). Errors on an id outside the vocabulary.
    pub fn decode(&self, ids: &[u32]) -> Result<String> {
        Ok(String::from_utf8_lossy(&self.decode_bytes(ids)?).into_owned())
    }

    /// The bytes token ids stand for: a token may end inside a UTF-8 character, so text
    /// streamed a token at a time is assembled from these. Errors on an id outside the
    /// vocabulary.
    pub fn decode_bytes(&self, ids: &[u32]) -> Result<Vec<u8>> {
        if let Some(&id) = ids.iter().find(|&&id| id as usize >= self.vocab_size()) {
            return Err(DataError::InvalidArgument(format!(
                "{} tokenizer: id {id} is outside its vocabulary of {}",
                self.name(),
                self.vocab_size()
            )));
        }
        Ok(match self {
            Tokenizer::Bytes => ids.iter().map(|&id| id as u8).collect(),
            Tokenizer::Hf(t) => t.decode(ids)?.into_bytes(),
            Tokenizer::Gpt2 => super::gpt2_bpe::decode_bytes(ids)?,
        })
    }
}

/// The sidecar's name of a Hugging Face tokenizer.
pub const HF_NAME: &str = "huggingface";

impl FromStr for Tokenizer {
    type Err = DataError;
    fn from_str(s: &str) -> Result<Tokenizer> {
        match s {
            "gpt2" | "r50k_base" if cfg!(feature = "tokenizers") => Ok(Tokenizer::Gpt2),
            "gpt2" | "r50k_base" => Err(super::gpt2_bpe::absent()),
            "bytes" | "byte" => Ok(Tokenizer::Bytes),
            _ => Err(DataError::InvalidArgument(format!(
                "unknown tokenizer `{s}`: use `gpt2` (GPT-2 BPE, r50k_base) or `bytes`"
            ))),
        }
    }
}

/// Bytes of input read at a time. `prepare` holds about this much text (and its tokens)
/// whatever the input's size: a 48 MB text took 164 MB of memory when it was read whole
/// (335 MB with the bytes tokenizer), 22 MB streamed.
const READ_BYTES: usize = 1 << 20;

/// The most text held while looking for a place to cut it (see [`safe_cut`]). Text with
/// no whitespace and no letter-or-digit-to-punctuation step in this much is not prose;
/// the GPT-2 tokenizer would make one piece of it, and its merges grow with the square
/// of a piece's length.
const MAX_UNCUT_BYTES: usize = 16 << 20;

/// The longest whitespace run given to the GPT-2 tokenizer. Its pattern backtracks one
/// character at a time over a run that more text follows (`\s+(?!\S)`), and tiktoken
/// panics when the regex engine's stack of 1,000,000 entries overflows: at about 950,000
/// characters.
pub const MAX_WHITESPACE_RUN: usize = 100_000;

/// Tokenizes the text file `input` into the token file `output` (and `<output>.json`),
/// each written atomically. Returns the number of tokens.
///
/// The input is read as a stream, a MiB at a time, and the tokens are written as they
/// come, so memory does not grow with the file. GPT-2 text is cut only where
/// the tokenizer's pre-tokenizer splits anyway (see [`safe_cut`]), so the tokens are
/// exactly those of the whole text encoded at once.
///
/// Refused: an input that is not a regular file (a directory; a device such as
/// `/dev/zero` or a pipe, which may never end) or that is a token file already (it has a
/// sidecar), an output that is the input itself (or whose sidecar is), an output not
/// named `.bin` (`kiln train` reads any other file as text).
pub fn prepare(input: &Path, output: &Path, tokenizer: Tokenizer) -> Result<u64> {
    prepare_chunked(input, output, tokenizer, READ_BYTES, MAX_UNCUT_BYTES)
}

fn prepare_chunked(
    input: &Path,
    output: &Path,
    tokenizer: Tokenizer,
    read_bytes: usize,
    max_uncut: usize,
) -> Result<u64> {
    let file = File::open(input).map_err(|e| DataError::io(input, "open", e))?;
    let meta = file
        .metadata()
        .map_err(|e| DataError::io(input, "stat", e))?;
    if let Some(e) = not_a_regular_file(
        input,
        &meta,
        "`prepare` reads a text file; save the text to a file first",
    ) {
        return Err(e);
    }
    if meta.len() == 0 {
        return Err(DataError::format(
            input,
            "the text file is empty: there is nothing to tokenize",
        ));
    }
    if let Ok(Some(side)) = Sidecar::read_for(input) {
        return Err(DataError::format(
            input,
            format!(
                "is a token file already ({} tokens of the {} tokenizer, says {}): `prepare` \
                 takes the text it was made from",
                side.tokens,
                side.tokenizer,
                Sidecar::path_for(input).display()
            ),
        ));
    }
    check_outputs(
        input,
        &meta,
        &[
            (output.to_path_buf(), "output"),
            (Sidecar::path_for(output), "sidecar"),
        ],
    )?;
    check_token_file_name(output)?;
    let (name, vocab) = (tokenizer.name(), tokenizer.vocab_size());
    let dtype = TokenDtype::for_vocab(vocab);
    let count = write_atomically(output, |w| {
        let mut count = 0u64;
        let mut emit = |ids: &[u32]| {
            write_ids(w, output, ids, count, (name, vocab, dtype))?;
            count += ids.len() as u64;
            Ok(())
        };
        match &tokenizer {
            // Byte-level BPE: read and encoded a piece at a time, cut after newlines.
            Tokenizer::Hf(t) if t.cuts_at_lines() => {
                let (before, after) = t.special_affixes(input)?;
                emit(&before)?;
                encode_lines(file, input, t, read_bytes, &mut emit)?;
                emit(&after)?;
            }
            // Other Hugging Face tokenizers (SentencePiece marks the text's start): no
            // cut is known to be safe, so the whole text is encoded at once, in memory.
            Tokenizer::Hf(t) => {
                let mut text = String::new();
                let mut file = file;
                file.read_to_string(&mut text).map_err(|e| {
                    if e.kind() == std::io::ErrorKind::InvalidData {
                        DataError::format(
                            input,
                            "not UTF-8 text, which a Hugging Face tokenizer needs: convert \
                             it to UTF-8",
                        )
                    } else {
                        DataError::io(input, "read", e)
                    }
                })?;
                emit(&t.encode(&text, true, input)?)?;
            }
            _ => encode_stream(file, input, &tokenizer, read_bytes, max_uncut, emit)?,
        }
        if count == 0 {
            // The file was emptied between the size check and the read.
            return Err(DataError::format(
                input,
                "the text file is empty: there is nothing to tokenize",
            ));
        }
        Ok(count)
    })?;
    write_sidecar(output, &tokenizer, count, None)?;
    Ok(count)
}

/// Refuses outputs (`(path, what it is)`) that are the input file `input` (of
/// `meta`) itself, under any name, or directories.
pub(super) fn check_outputs(
    input: &Path,
    meta: &std::fs::Metadata,
    outputs: &[(PathBuf, &str)],
) -> Result<()> {
    for (out, what) in outputs {
        if same_file(meta, out) {
            return Err(DataError::format(
                out,
                format!(
                    "the {what} is the input file {} itself: writing tokens there would \
                     destroy the text. Write the tokens to another file, e.g. {}",
                    input.display(),
                    suggested_output(input, meta).display()
                ),
            ));
        }
        if let Ok(m) = std::fs::metadata(out) {
            if m.is_dir() {
                return Err(DataError::format(
                    out,
                    format!("is a directory: the {what} must be a file path"),
                ));
            }
        }
    }
    Ok(())
}

/// Whether `other` is the file `meta` describes: the same device and inode (a hard link,
/// a symlink, `./a/../a.txt` all count). Elsewhere than Unix, no two paths match here;
/// the temporary file and rename still keep the input intact until the rename.
fn same_file(meta: &std::fs::Metadata, other: &Path) -> bool {
    #[cfg(unix)]
    {
        use std::os::unix::fs::MetadataExt;
        std::fs::metadata(other).is_ok_and(|m| m.dev() == meta.dev() && m.ino() == meta.ino())
    }
    #[cfg(not(unix))]
    {
        let _ = (meta, other);
        false
    }
}

/// `<input without its extension>.bin`, or `.tokens.bin` when that is the input.
fn suggested_output(input: &Path, meta: &std::fs::Metadata) -> PathBuf {
    let bin = input.with_extension("bin");
    if bin == input || same_file(meta, &bin) {
        input.with_extension("tokens.bin")
    } else {
        bin
    }
}

/// Token files are named `.bin`: `kiln train` (and nanoGPT-style tools) read a `.bin`
/// as u16 tokens and any other file as text, so a token file named `out.txt` would be
/// trained on as raw bytes.
pub(super) fn check_token_file_name(path: &Path) -> Result<()> {
    let is_bin = path
        .extension()
        .is_some_and(|e| e.eq_ignore_ascii_case("bin"));
    if is_bin {
        return Ok(());
    }
    Err(DataError::format(
        path,
        format!(
            "a token file must be named .bin: `kiln train` reads a .bin as tokens and any other \
             file as text (one token per byte). Use {}",
            path.with_extension("bin").display()
        ),
    ))
}

/// Reads `input` to its end, `read_bytes` at a time, and hands `emit` the token ids
/// of each piece in order. Bytes are emitted as read; GPT-2 text is cut at
/// [`safe_cut`] points, so that the ids are those of the whole text.
fn encode_stream(
    mut input: impl Read,
    what: &Path,
    tokenizer: &Tokenizer,
    read_bytes: usize,
    max_uncut: usize,
    mut emit: impl FnMut(&[u32]) -> Result<()>,
) -> Result<()> {
    let mut buf: Vec<u8> = Vec::with_capacity(read_bytes);
    // File offset of buf[0], for the byte offsets in errors.
    let mut base = 0u64;
    let mut eof = false;
    while !eof {
        let start = buf.len();
        buf.resize(start + read_bytes, 0);
        let mut filled = 0;
        while filled < read_bytes {
            match input.read(&mut buf[start + filled..]) {
                Ok(0) => {
                    eof = true;
                    break;
                }
                Ok(n) => filled += n,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) => return Err(DataError::io(what, "read", e)),
            }
        }
        buf.truncate(start + filled);
        if *tokenizer == Tokenizer::Bytes {
            let ids: Vec<u32> = buf.iter().map(|&b| b as u32).collect();
            emit(&ids)?;
            buf.clear();
            continue;
        }
        // A UTF-8 sequence cut by the read waits for its end in the next one.
        let valid = match std::str::from_utf8(&buf) {
            Ok(_) => buf.len(),
            Err(e) if e.error_len().is_none() && !eof => e.valid_up_to(),
            Err(e) => return Err(not_utf8(what, base + e.valid_up_to() as u64)),
        };
        let text = std::str::from_utf8(&buf[..valid]).expect("validated above");
        if let Some((at, chars)) = whitespace_run_over(text, MAX_WHITESPACE_RUN) {
            return Err(DataError::format(
                what,
                format!(
                    "a run of {chars} or more whitespace characters at byte {}: the GPT-2 \
                     tokenizer handles runs of up to {MAX_WHITESPACE_RUN}. Squeeze the \
                     whitespace (e.g. `tr -s ' \\n'`), or use --tokenizer bytes",
                    base + at as u64
                ),
            ));
        }
        let cut = if eof { valid } else { safe_cut(text) };
        if cut == 0 {
            if buf.len() >= max_uncut {
                return Err(DataError::format(
                    what,
                    format!(
                        "no whitespace in {} MiB of text from byte {base}: this does not look \
                         like text, and the GPT-2 tokenizer would make one piece of it. Use \
                         --tokenizer bytes",
                        buf.len() >> 20
                    ),
                ));
            }
            continue;
        }
        let ids = super::gpt2_bpe::encode(&text[..cut])?;
        emit(&ids)?;
        buf.drain(..cut);
        base += cut as u64;
    }
    Ok(())
}

/// Reads `input` to its end, `read_bytes` at a time, and hands `emit` the ids of each
/// piece cut after a newline that non-whitespace follows (see
/// [`HfTokenizer::cuts_at_lines`]), encoded without the post-processor's specials.
fn encode_lines(
    mut input: impl Read,
    what: &Path,
    t: &HfTokenizer,
    read_bytes: usize,
    emit: &mut impl FnMut(&[u32]) -> Result<()>,
) -> Result<()> {
    let mut buf: Vec<u8> = Vec::with_capacity(read_bytes);
    let mut base = 0u64;
    let mut eof = false;
    while !eof {
        let start = buf.len();
        buf.resize(start + read_bytes, 0);
        let mut filled = 0;
        while filled < read_bytes {
            match input.read(&mut buf[start + filled..]) {
                Ok(0) => {
                    eof = true;
                    break;
                }
                Ok(n) => filled += n,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) => return Err(DataError::io(what, "read", e)),
            }
        }
        buf.truncate(start + filled);
        let valid = match std::str::from_utf8(&buf) {
            Ok(_) => buf.len(),
            Err(e) if e.error_len().is_none() && !eof => e.valid_up_to(),
            Err(e) => {
                return Err(DataError::format(
                    what,
                    format!(
                        "not UTF-8 text (invalid byte at offset {}), which a Hugging Face \
                         tokenizer needs: convert it to UTF-8",
                        base + e.valid_up_to() as u64
                    ),
                ))
            }
        };
        let text = std::str::from_utf8(&buf[..valid]).expect("validated above");
        let cut = if eof { valid } else { line_cut(text) };
        if cut == 0 {
            // No line ends here yet: read on (a text without newlines is encoded whole).
            continue;
        }
        emit(&t.encode(&text[..cut], false, what)?)?;
        buf.drain(..cut);
        base += cut as u64;
    }
    Ok(())
}

/// The byte offset just after the last newline in `text` that a non-whitespace
/// character follows; 0 if there is none.
fn line_cut(text: &str) -> usize {
    let b = text.as_bytes();
    (1..b.len())
        .rev()
        .find(|&i| {
            b[i - 1] == b'\n' && !(b[i] as char).is_ascii_whitespace() && text.is_char_boundary(i)
        })
        .filter(|&i| !text[i..].starts_with(char::is_whitespace))
        .unwrap_or(0)
}

/// The byte offset of the last place in `text` where the GPT-2 pre-tokenizer splits
/// whatever follows, so that encoding `text[..cut]` and the rest separately gives the
/// ids of encoding them together; 0 if there is none.
///
/// The pre-tokenizer (r50k_base's pattern, `'(?:[sdmt]|ll|ve|re)| ?\p{L}++| ?\p{N}++|
/// ?[^\s\p{L}\p{N}]++|\s++$|\s+(?!\S)|\s`) has no look-behind, and every piece that
/// holds a non-whitespace character holds whitespace only as a leading space. So a piece
/// ends between a non-whitespace character and a whitespace character, and the piece
/// that ends there matches the same at the end of the text. The same holds between an
/// ASCII letter or digit and ASCII punctuation (the letter and number runs stop there),
/// which cuts text without whitespace, like minified JSON. Never inside a whitespace
/// run: how a run splits depends on what follows it.
fn safe_cut(text: &str) -> usize {
    let mut after: Option<char> = None;
    for (i, c) in text.char_indices().rev() {
        if let Some(a) = after {
            let split = (!c.is_whitespace() && a.is_whitespace())
                || (c.is_ascii_alphanumeric() && a.is_ascii_punctuation());
            if split {
                return i + c.len_utf8();
            }
        }
        after = Some(c);
    }
    0
}

/// The byte offset and length (in characters) of the first whitespace run in `text`
/// longer than `max` characters.
fn whitespace_run_over(text: &str, max: usize) -> Option<(usize, usize)> {
    let mut run = (0, 0);
    for (i, c) in text.char_indices() {
        if !c.is_whitespace() {
            run.1 = 0;
            continue;
        }
        if run.1 == 0 {
            run.0 = i;
        }
        run.1 += 1;
        if run.1 > max {
            return Some(run);
        }
    }
    None
}

fn not_utf8(what: &Path, offset: u64) -> DataError {
    DataError::format(
        what,
        format!(
            "not UTF-8 text (invalid byte at offset {offset}), which the GPT-2 tokenizer \
             needs: convert it to UTF-8, or use the bytes tokenizer"
        ),
    )
}

/// Writes `ids` (token `first` on) as little-endian `dtype`, refusing an id that does
/// not fit in it or is not below `vocab_size`.
pub(super) fn write_ids(
    w: &mut impl Write,
    path: &Path,
    ids: &[u32],
    first: u64,
    (tokenizer, vocab_size, dtype): (&str, usize, TokenDtype),
) -> Result<()> {
    let most = dtype.max_id();
    if let Some((i, &id)) = ids
        .iter()
        .enumerate()
        .find(|(_, &id)| id > most || id as usize >= vocab_size)
    {
        let i = first + i as u64;
        let detail = if id > most {
            format!(
                "token id {id} (token {i}) does not fit in the {dtype} of this .bin token \
                 file (ids up to {most}): give the vocabulary size it needs (past 65536 ids \
                 the file is u32)"
            )
        } else {
            format!(
                "token id {id} (token {i}) is not below the {tokenizer} vocabulary of {vocab_size}"
            )
        };
        return Err(DataError::format(path, detail));
    }
    let mut bytes = Vec::with_capacity(ids.len() * dtype.bytes());
    for &id in ids {
        match dtype {
            TokenDtype::U16 => bytes.extend_from_slice(&(id as u16).to_le_bytes()),
            TokenDtype::U32 => bytes.extend_from_slice(&id.to_le_bytes()),
        }
    }
    w.write_all(&bytes)
        .map_err(|e| DataError::io(path, "write", e))
}

/// Writes `tokens` as a `.bin` of little-endian `u16` (`u32` where `vocab_size` is past
/// 65536) at `path`, then the sidecar `<path>.json`, each through a temporary file that
/// is synced and renamed into place (a reader never sees a partial file). Errors if an
/// id is not below `vocab_size`, or if `path` is not named `.bin`. Returns the number of
/// tokens.
pub fn write_token_file(
    path: &Path,
    tokens: &[u32],
    tokenizer: &str,
    vocab_size: usize,
) -> Result<u64> {
    check_token_file_name(path)?;
    let dtype = TokenDtype::for_vocab(vocab_size);
    write_atomically(path, |w| {
        write_ids(w, path, tokens, 0, (tokenizer, vocab_size, dtype))
    })?;
    let sidecar = Sidecar::new(tokenizer, vocab_size, tokens.len() as u64);
    write_sidecar_file(path, &sidecar)?;
    Ok(tokens.len() as u64)
}

/// The sidecar of `tokens` ids made by `tokenizer` (a Hugging Face one by its file and
/// SHA-256).
pub(super) fn write_sidecar(
    bin: &Path,
    tokenizer: &Tokenizer,
    tokens: u64,
    examples: Option<super::token_file::ExampleSet>,
) -> Result<()> {
    let mut sidecar = Sidecar::new(tokenizer.name(), tokenizer.vocab_size(), tokens);
    sidecar.examples = examples;
    if let Tokenizer::Hf(t) = tokenizer {
        // Absolute, so the data still finds its tokenizer from another directory.
        sidecar.tokenizer_file = Some(std::path::absolute(&t.file).unwrap_or(t.file.clone()));
        sidecar.tokenizer_sha256 = Some(t.sha256.clone());
    }
    write_sidecar_file(bin, &sidecar)
}

fn write_sidecar_file(bin: &Path, sidecar: &Sidecar) -> Result<()> {
    let json = serde_json::to_string_pretty(sidecar).expect("a sidecar serialises");
    write_atomically(&Sidecar::path_for(bin), |w| {
        w.write_all(json.as_bytes())
            .map_err(|e| DataError::io(bin, "write", e))
    })
}

/// Runs `write` on a temporary file next to `path`, syncs it, renames it to `path` and
/// syncs the directory (where the platform allows), so that `path` holds either the old
/// content or all of the new. On an error the temporary file is removed and `path` is
/// untouched.
pub(super) fn write_atomically<T>(
    path: &Path,
    write: impl FnOnce(&mut BufWriter<File>) -> Result<T>,
) -> Result<T> {
    let mut tmp_name = path.as_os_str().to_owned();
    tmp_name.push(format!(".tmp-{}", std::process::id()));
    let tmp = PathBuf::from(tmp_name);
    let result = (|| {
        let file =
            File::create(&tmp).map_err(|e| match crate::fsutil::cannot_create(path, &e) {
                Some(why) => DataError::format(path, why),
                None => DataError::io(&tmp, "create", e),
            })?;
        let mut w = BufWriter::new(file);
        let value = write(&mut w)?;
        let file = w
            .into_inner()
            .map_err(|e| DataError::io(&tmp, "write", e.into_error()))?;
        file.sync_all()
            .map_err(|e| DataError::io(&tmp, "sync", e))?;
        drop(file);
        std::fs::rename(&tmp, path).map_err(|e| DataError::io(path, "rename into place", e))?;
        Ok(value)
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
    result
}

#[cfg(all(test, feature = "tokenizers"))] // most use the GPT-2 BPE
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
        assert_eq!(f.sidecar().unwrap(), &Sidecar::new("bytes", 256, 264));
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

        let e = write_token_file(&out, &[1, 300], "bytes", 256)
            .unwrap_err()
            .to_string();
        assert!(e.contains("300") && e.contains("256"), "{e}");
        assert!(!out.exists());
        let e = write_token_file(&out, &[1, 100_000], "big", 100_000)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("out.bin") && e.contains("100000") && e.contains("vocabulary"),
            "{e}"
        );
        // Past 65536 ids the file is u32, and says so.
        write_token_file(&out, &[1, 70_000], "big", 100_000).unwrap();
        let f = TokenFile::open(&out).unwrap();
        assert_eq!(f.sidecar().unwrap().dtype, TokenDtype::U32);
        assert_eq!(read_all(&f), [1, 70_000]);
        assert_eq!(std::fs::read(&out).unwrap().len(), 8);
    }

    /// Text with what the GPT-2 pre-tokenizer treats specially: contractions, runs of
    /// spaces and newlines, CRLF, non-ASCII letters and whitespace, digits, punctuation
    /// without spaces, marks, emoji; cut by the reads at every possible place.
    fn tricky_text(len: usize) -> String {
        let parts = [
            "Hello",
            " world",
            "it's",
            " they'll",
            "'re",
            "x'",
            "'",
            "  ",
            "   ",
            "\n",
            "\n\n",
            "\r\n",
            "\t",
            " \n ",
            "\u{3000}",
            "\u{a0}",
            "日本語",
            "é",
            "e\u{301}",
            "12345",
            "a1b2",
            "{\"k\":[1,2.5]}",
            "--",
            "...",
            "🙂",
            "naïve",
            "\u{2028}",
            ",",
            "Ünïcödé",
        ];
        let mut state = 0x2545_f491_4f6c_dd1du64;
        let mut text = String::from("  \n leading whitespace");
        while text.len() < len {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            text.push_str(parts[(state % parts.len() as u64) as usize]);
        }
        text.push_str("  \n ");
        text
    }

    #[test]
    #[cfg(feature = "tokenizers")] // compares with tiktoken-rs itself
    fn chunked_encoding_equals_encoding_the_whole_text() {
        let dir = TempDir::new();
        let (input, output) = (dir.path("in.txt"), dir.path("out.bin"));
        let text = tricky_text(20_000);
        std::fs::write(&input, &text).unwrap();
        let whole = Tokenizer::Gpt2.encode(text.as_bytes(), &input).unwrap();
        // Reads of one byte cut inside every UTF-8 sequence and whitespace run; 4096
        // still gives several chunks.
        for read in [1, 2, 3, 7, 64, 4096] {
            let n = prepare_chunked(&input, &output, Tokenizer::Gpt2, read, 1 << 20).unwrap();
            let f = TokenFile::open(&output).unwrap();
            assert_eq!(n, whole.len() as u64);
            assert!(
                read_all(&f) == whole,
                "reads of {read} bytes changed the tokens"
            );
        }
        let n = prepare_chunked(&input, &output, Tokenizer::Bytes, 7, 1 << 20).unwrap();
        let f = TokenFile::open(&output).unwrap();
        assert_eq!(n, text.len() as u64);
        let bytes: Vec<u8> = read_all(&f).iter().map(|&b| b as u8).collect();
        assert_eq!(bytes, text.as_bytes());

        // Cut at every safe place at once: the pieces still encode to the same ids.
        let mut cuts = vec![text.len()];
        while let c @ 1.. = safe_cut(&text[..*cuts.last().unwrap()]) {
            cuts.push(c);
        }
        cuts.push(0);
        cuts.reverse();
        assert!(cuts.len() > 1000, "{}", cuts.len());
        let bpe = tiktoken_rs::r50k_base_singleton();
        let ids: Vec<u32> = cuts
            .windows(2)
            .flat_map(|w| bpe.encode_ordinary(&text[w[0]..w[1]]))
            .collect();
        assert!(ids == whole);
    }

    #[test]
    fn text_the_tokenizer_cannot_take_is_an_error_not_a_panic() {
        let dir = TempDir::new();
        let (input, output) = (dir.path("in.txt"), dir.path("out.bin"));
        let mut text = String::from("x");
        text.extend(std::iter::repeat_n(' ', MAX_WHITESPACE_RUN));
        text.push('a');
        std::fs::write(&input, &text).unwrap();
        // The longest run allowed is tokenized (the regex engine copes with it)...
        let n = prepare(&input, &output, Tokenizer::Gpt2).unwrap();
        assert!(n > 1);
        // ...one more is refused before it reaches the tokenizer, wherever it starts.
        text.insert(1, '\n');
        std::fs::write(&input, &text).unwrap();
        for read in [1000, 1 << 20] {
            let e = prepare_chunked(&input, &output, Tokenizer::Gpt2, read, 1 << 24)
                .unwrap_err()
                .to_string();
            assert!(
                e.contains("in.txt") && e.contains("at byte 1") && e.contains("--tokenizer bytes"),
                "{e}"
            );
        }
        // The bytes tokenizer takes anything.
        prepare(&input, &output, Tokenizer::Bytes).unwrap();

        // No place to cut in `max_uncut` bytes: refused, not held in memory.
        std::fs::write(&input, "a".repeat(1000)).unwrap();
        let e = prepare_chunked(&input, &output, Tokenizer::Gpt2, 64, 256)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("no whitespace") && e.contains("from byte 0"),
            "{e}"
        );
        // With room for it, such text still encodes as one piece.
        assert_eq!(
            prepare_chunked(&input, &output, Tokenizer::Gpt2, 64, 4096).unwrap(),
            Tokenizer::Gpt2
                .encode("a".repeat(1000).as_bytes(), &input)
                .unwrap()
                .len() as u64
        );
        // Invalid UTF-8 is named at its offset in the file, across chunks.
        let mut bad = "ab cd ".repeat(50).into_bytes();
        bad.push(0xff);
        std::fs::write(&input, &bad).unwrap();
        let e = prepare_chunked(&input, &output, Tokenizer::Gpt2, 16, 1 << 20)
            .unwrap_err()
            .to_string();
        assert!(e.contains("offset 300"), "{e}");
    }

    #[test]
    fn token_files_are_named_bin_and_never_the_input() {
        let dir = TempDir::new();
        let input = dir.path("in.txt");
        std::fs::write(&input, "some text").unwrap();
        let e = prepare(&input, &dir.path("out.txt"), Tokenizer::Bytes)
            .unwrap_err()
            .to_string();
        assert!(e.contains("out.txt") && e.contains("out.bin"), "{e}");
        let e = write_token_file(&dir.path("t.tokens"), &[1], "bytes", 256)
            .unwrap_err()
            .to_string();
        assert!(e.contains("must be named .bin"), "{e}");
        // The output's sidecar is the input.
        let side_input = dir.path("t.bin.json");
        std::fs::write(&side_input, "some text").unwrap();
        let e = prepare(&side_input, &dir.path("t.bin"), Tokenizer::Bytes)
            .unwrap_err()
            .to_string();
        assert!(e.contains("sidecar is the input file"), "{e}");
        assert_eq!(std::fs::read(&side_input).unwrap(), b"some text");
        // A token file is not text to prepare again.
        prepare(&input, &dir.path("t2.bin"), Tokenizer::Bytes).unwrap();
        let e = prepare(&dir.path("t2.bin"), &dir.path("t3.bin"), Tokenizer::Bytes)
            .unwrap_err()
            .to_string();
        assert!(e.contains("token file already"), "{e}");
        let e = prepare(&input, &dir.path("nodir/x.bin"), Tokenizer::Bytes)
            .unwrap_err()
            .to_string();
        assert!(e.contains("directory does not exist"), "{e}");
        // A directory that is there but takes no file is not called missing.
        let e = prepare(&input, Path::new("/proc/kiln-x.bin"), Tokenizer::Bytes)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("cannot create it in /proc") && e.contains("does not take new entries"),
            "{e}"
        );
        assert!(!e.contains("does not exist"), "{e}");
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
