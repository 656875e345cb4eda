//! Hugging Face tokenizers: a model directory's `tokenizer.json`, read and run by the
//! `tokenizers` crate (byte-level BPE of Llama 3, Qwen2 and SmolLM2, SentencePiece-style
//! BPE of Llama 2 and Mistral, WordPiece, ...), with the special tokens the model's
//! `tokenizer_config.json` and `generation_config.json` name (BOS, EOS — several for
//! instruct models — and the chat template).
//!
//! A tokenizer is known by the SHA-256 of its `tokenizer.json`: `kiln prepare` records it
//! in the token file's sidecar, and training refuses data whose tokenizer is not the
//! model's (the same ids would mean other text).

use std::path::{Path, PathBuf};

use serde_json::Value;
use sha2::{Digest, Sha256};

use super::{DataError, Result};

pub use tokenizers;

/// The file a Hugging Face model directory keeps its tokenizer in.
pub const TOKENIZER_FILE: &str = "tokenizer.json";

/// The chat template's own file, where a model has one (else it is in
/// `tokenizer_config.json`).
pub const CHAT_TEMPLATE_FILE: &str = "chat_template.jinja";

/// The instructions a chat template may run for one conversation (minijinja's fuel):
/// real templates take thousands; a runaway loop stops here, with an error.
const CHAT_FUEL: u64 = 10_000_000;

/// A Hugging Face tokenizer with its model's special tokens.
#[derive(Clone)]
pub struct HfTokenizer {
    inner: tokenizers::Tokenizer,
    /// The `tokenizer.json` it was read from.
    pub file: PathBuf,
    /// SHA-256 of that file, lowercase hex.
    pub sha256: String,
    /// The beginning-of-sequence token, where the model has one.
    pub bos: Option<u32>,
    /// Tokens that end generation (an instruct model may have several, e.g. Llama 3's
    /// `<|eot_id|>` beside `<|end_of_text|>`).
    pub eos: Vec<u32>,
    /// The Jinja chat template (`chat_template.jinja`, else `tokenizer_config.json`'s),
    /// where there is one.
    pub chat_template: Option<String>,
    /// The largest id plus one (ids of a tokenizer.json need not be dense).
    vocab_size: usize,
}

impl std::fmt::Debug for HfTokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HfTokenizer")
            .field("file", &self.file)
            .field("vocab_size", &self.vocab_size())
            .field("bos", &self.bos)
            .field("eos", &self.eos)
            .finish()
    }
}

impl PartialEq for HfTokenizer {
    /// The same `tokenizer.json` bytes.
    fn eq(&self, other: &Self) -> bool {
        self.sha256 == other.sha256
    }
}

impl Eq for HfTokenizer {}

fn sha256_hex(bytes: &[u8]) -> String {
    Sha256::digest(bytes)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

/// `strftime_now` of chat templates (Llama 3.1's puts today's date in the system turn):
/// `format` with `%d %m %Y %y %b %B %H %M %S %%` filled from `now` in UTC.
fn strftime(format: &str, now: std::time::SystemTime) -> Result<String, minijinja::Error> {
    const MONTHS: [&str; 12] = [
        "January",
        "February",
        "March",
        "April",
        "May",
        "June",
        "July",
        "August",
        "September",
        "October",
        "November",
        "December",
    ];
    let secs = now
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs()) as i64;
    let (days, rem) = (secs.div_euclid(86_400), secs.rem_euclid(86_400));
    // The proleptic Gregorian date of a day count since 1970-01-01, by 400-year eras.
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    let mut out = String::new();
    let mut chars = format.chars();
    while let Some(c) = chars.next() {
        if c != '%' {
            out.push(c);
            continue;
        }
        let name = MONTHS[(month - 1) as usize];
        match chars.next() {
            Some('d') => out += &format!("{day:02}"),
            Some('m') => out += &format!("{month:02}"),
            Some('Y') => out += &year.to_string(),
            Some('y') => out += &format!("{:02}", year % 100),
            Some('b') => out += &name[..3],
            Some('B') => out += name,
            Some('H') => out += &format!("{:02}", rem / 3600),
            Some('M') => out += &format!("{:02}", rem / 60 % 60),
            Some('S') => out += &format!("{:02}", rem % 60),
            Some('%') => out.push('%'),
            other => {
                return Err(minijinja::Error::new(
                    minijinja::ErrorKind::InvalidOperation,
                    format!(
                        "strftime_now: %{} is not supported (use %d %m %Y %y %b %B %H %M %S)",
                        other.map_or(String::new(), String::from)
                    ),
                ))
            }
        }
    }
    Ok(out)
}

/// A special token as `tokenizer_config.json` gives it: a string, or an added-token
/// object with its `content`.
fn token_text(v: &Value) -> Option<&str> {
    v.as_str()
        .or_else(|| v.get("content").and_then(Value::as_str))
}

/// A JSON file beside the tokenizer, if there is one; an unreadable one is an error.
fn side_json(dir: &Path, name: &str) -> Result<Option<serde_json::Map<String, Value>>> {
    let path = dir.join(name);
    let text = match std::fs::read_to_string(&path) {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(DataError::io(&path, "read", e)),
    };
    match serde_json::from_str(text.strip_prefix('\u{feff}').unwrap_or(&text)) {
        Ok(Value::Object(m)) => Ok(Some(m)),
        Ok(_) => Err(DataError::format(&path, "not a JSON object")),
        Err(e) => Err(DataError::format(&path, format!("not valid JSON: {e}"))),
    }
}

impl HfTokenizer {
    /// Reads `path`: a `tokenizer.json`, or a model directory holding one (with its
    /// `tokenizer_config.json` and `generation_config.json`, read where present).
    pub fn open(path: &Path) -> Result<HfTokenizer> {
        let file = if path.is_dir() {
            path.join(TOKENIZER_FILE)
        } else {
            path.to_path_buf()
        };
        let bytes = std::fs::read(&file).map_err(|e| {
            if e.kind() == std::io::ErrorKind::NotFound {
                DataError::format(
                    &file,
                    format!(
                        "no such file: a Hugging Face tokenizer is a {TOKENIZER_FILE} (download \
                         it with the model: huggingface-cli download REPO {TOKENIZER_FILE} \
                         tokenizer_config.json)"
                    ),
                )
            } else {
                DataError::io(&file, "read", e)
            }
        })?;
        let mut inner = tokenizers::Tokenizer::from_bytes(&bytes).map_err(|e| {
            DataError::format(
                &file,
                format!("not a Hugging Face tokenizer.json the tokenizers crate reads: {e}"),
            )
        })?;
        // transformers saves the last call's truncation and padding in the file: they
        // would cut a corpus to max_length tokens, or pad a prompt, without a word.
        inner
            .with_truncation(None)
            .map_err(|e| DataError::format(&file, format!("cannot turn truncation off: {e}")))?;
        inner.with_padding(None);
        let mut t = HfTokenizer {
            inner,
            sha256: sha256_hex(&bytes),
            file: file.clone(),
            bos: None,
            eos: vec![],
            chat_template: None,
            vocab_size: 0,
        };
        t.vocab_size = t
            .inner
            .get_vocab(true)
            .values()
            .max()
            .map_or(0, |&m| m as usize + 1);
        let dir = file.parent().unwrap_or(Path::new("."));
        let id_of = |what: &str, text: &str, from: &Path| {
            t.inner.token_to_id(text).ok_or_else(|| {
                DataError::format(
                    from,
                    format!("its {what} `{text}` is not a token of {}", file.display()),
                )
            })
        };
        let (mut bos, mut eos, mut template) = (None, vec![], None);
        if let Some(cfg) = side_json(dir, "tokenizer_config.json")? {
            let from = dir.join("tokenizer_config.json");
            if let Some(b) = cfg.get("bos_token").and_then(token_text) {
                bos = Some(id_of("bos_token", b, &from)?);
            }
            if let Some(e) = cfg.get("eos_token").and_then(token_text) {
                eos.push(id_of("eos_token", e, &from)?);
            }
            template = match cfg.get("chat_template") {
                Some(Value::String(s)) => Some(s.clone()),
                // A list of named templates: the default one.
                Some(Value::Array(list)) => list
                    .iter()
                    .find(|t| t.get("name").and_then(Value::as_str) == Some("default"))
                    .and_then(|t| t.get("template"))
                    .and_then(Value::as_str)
                    .map(str::to_string),
                _ => None,
            };
        }
        // transformers saves a template of its own file (`chat_template.jinja`) since
        // 2025, and reads it before tokenizer_config.json's.
        let jinja = dir.join(CHAT_TEMPLATE_FILE);
        match std::fs::read_to_string(&jinja) {
            Ok(t) => template = Some(t),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => return Err(DataError::io(&jinja, "read", e)),
        }
        if let Some(gen) = side_json(dir, "generation_config.json")? {
            // Ids here; an instruct model lists every token that ends a turn.
            let ids = |v: Option<&Value>| -> Vec<u32> {
                match v {
                    Some(Value::Number(n)) => n.as_u64().map(|x| x as u32).into_iter().collect(),
                    Some(Value::Array(a)) => a
                        .iter()
                        .filter_map(Value::as_u64)
                        .map(|x| x as u32)
                        .collect(),
                    _ => vec![],
                }
            };
            for id in ids(gen.get("eos_token_id")) {
                if !eos.contains(&id) {
                    eos.push(id);
                }
            }
            bos = bos.or(ids(gen.get("bos_token_id")).first().copied());
        }
        let vocab = t.vocab_size();
        if let Some(&bad) = eos.iter().chain(&bos).find(|&&id| id as usize >= vocab) {
            return Err(DataError::format(
                dir,
                format!("a BOS/EOS id {bad} is outside the tokenizer's {vocab} ids"),
            ));
        }
        (t.bos, t.eos, t.chat_template) = (bos, eos, template);
        Ok(t)
    }

    /// Every id the tokenizer gives (added tokens included) is below this.
    pub fn vocab_size(&self) -> usize {
        self.vocab_size
    }

    /// The ids of `text`; `special`: with the tokens the tokenizer's post-processor adds
    /// (Llama's BOS, for one).
    pub fn encode(&self, text: &str, special: bool, what: &Path) -> Result<Vec<u32>> {
        self.inner
            .encode_fast(text, special)
            .map(|e| e.get_ids().to_vec())
            .map_err(|e| DataError::format(what, format!("the tokenizer failed on it: {e}")))
    }

    /// The text of `ids`, special tokens included. Ids outside the vocabulary are errors.
    pub fn decode(&self, ids: &[u32]) -> Result<String> {
        if let Some(&id) = ids.iter().find(|&&id| id as usize >= self.vocab_size()) {
            return Err(DataError::InvalidArgument(format!(
                "{}: id {id} is outside its vocabulary of {}",
                self.file.display(),
                self.vocab_size()
            )));
        }
        self.inner
            .decode(ids, false)
            .map_err(|e| DataError::InvalidArgument(format!("{}: {e}", self.file.display())))
    }

    /// The text of a conversation as the model was tuned on it: `messages` (role,
    /// content) through the tokenizer's chat template, with the assistant's header
    /// after them where `generation_prompt` (Hugging Face's `add_generation_prompt`).
    /// The template is Jinja, run by minijinja with Python's string methods
    /// (`.strip()`, …) and `raise_exception`; it sees `bos_token` and `eos_token`.
    pub fn chat(&self, messages: &[(&str, &str)], generation_prompt: bool) -> Result<String> {
        let template = self.chat_template.as_deref().ok_or_else(|| {
            DataError::InvalidArgument(format!(
                "{}: the tokenizer has no chat_template (in tokenizer_config.json): the \
                 model is not a chat model, so give it text to continue instead",
                self.file.display()
            ))
        })?;
        let fail = |e: minijinja::Error| {
            DataError::InvalidArgument(format!(
                "{}: the chat template failed: {e:#}",
                self.file.display()
            ))
        };
        // Set up as transformers renders chat templates: blocks trimmed and
        // left-stripped, no trailing newline kept. A template comes with a downloaded
        // model and is untrusted: minijinja has no file or process access (none is
        // registered here), and fuel bounds the work, so a template that loops for
        // ever is stopped.
        let mut env = minijinja::Environment::new();
        env.set_trim_blocks(true);
        env.set_lstrip_blocks(true);
        env.set_fuel(Some(CHAT_FUEL));
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function(
            "raise_exception",
            |msg: String| -> std::result::Result<String, minijinja::Error> {
                Err(minijinja::Error::new(
                    minijinja::ErrorKind::InvalidOperation,
                    msg,
                ))
            },
        );
        env.add_function("strftime_now", |format: String| {
            strftime(&format, std::time::SystemTime::now())
        });
        env.add_template("chat", template).map_err(fail)?;
        let token = |id: Option<&u32>| id.and_then(|&i| self.inner.id_to_token(i));
        let messages: Vec<_> = messages
            .iter()
            .map(|(role, content)| minijinja::context! { role => role, content => content })
            .collect();
        env.get_template("chat")
            .and_then(|t| {
                t.render(minijinja::context! {
                    messages => messages,
                    // As transformers passes them when a conversation has none.
                    tools => minijinja::Value::from(()),
                    documents => minijinja::Value::from(()),
                    add_generation_prompt => generation_prompt,
                    bos_token => token(self.bos.as_ref()).unwrap_or_default(),
                    eos_token => token(self.eos.first()).unwrap_or_default(),
                })
            })
            .map_err(fail)
    }

    /// Whether text may be encoded in pieces cut after a newline that non-whitespace
    /// follows, with the same ids as encoding it whole: true for byte-level BPE
    /// (GPT-2, Llama 3, Qwen2, SmolLM2: their pre-tokenizers never join a newline with
    /// the character after it) with no normalizer or a Unicode-form one; false for
    /// SentencePiece-style tokenizers, which mark where a text starts.
    pub fn cuts_at_lines(&self) -> bool {
        use tokenizers::normalizers::NormalizerWrapper as N;
        use tokenizers::pre_tokenizers::PreTokenizerWrapper as P;
        let byte_level = match self.inner.get_pre_tokenizer() {
            Some(P::ByteLevel(_)) => true,
            Some(P::Sequence(seq)) => {
                let parts = seq.as_ref();
                parts.iter().any(|p| matches!(p, P::ByteLevel(_)))
                    && parts
                        .iter()
                        .all(|p| matches!(p, P::ByteLevel(_) | P::Split(_) | P::Digits(_)))
            }
            _ => false,
        };
        let normal = matches!(
            self.inner.get_normalizer(),
            None | Some(N::NFC(_) | N::NFD(_) | N::NFKC(_) | N::NFKD(_))
        );
        byte_level && normal
    }

    /// The ids the post-processor puts before and after a text's (Llama 3's BOS
    /// before; none for GPT-2's), so that pieces encoded without them can be joined.
    pub fn special_affixes(&self, what: &Path) -> Result<(Vec<u32>, Vec<u32>)> {
        let plain = self.encode("a", false, what)?;
        let with = self.encode("a", true, what)?;
        let at = with
            .windows(plain.len().max(1))
            .position(|w| w == plain.as_slice())
            .ok_or_else(|| {
                DataError::format(
                    &self.file,
                    "its post-processor changes a text's own tokens, so a long text cannot \
                     be encoded in pieces",
                )
            })?;
        Ok((with[..at].to_vec(), with[at + plain.len()..].to_vec()))
    }

    /// The tokenizers crate's tokenizer itself.
    pub fn inner(&self) -> &tokenizers::Tokenizer {
        &self.inner
    }
}

#[cfg(test)]
mod tests {
    use super::strftime;
    use std::time::{Duration, UNIX_EPOCH};

    /// Dates worked out by hand: the epoch, a leap day, and 2026-12-05 12:34:56 UTC
    /// (1,796,474,096 s: 20,792 days and 45,296 s).
    #[test]
    fn strftime_now_formats_dates() {
        let at = |s: u64| UNIX_EPOCH + Duration::from_secs(s);
        assert_eq!(strftime("%d %b %Y", at(0)).unwrap(), "01 Jan 1970");
        // 2024-02-29: 19,782 days after the epoch.
        assert_eq!(
            strftime("%Y-%m-%d", at(19_782 * 86_400)).unwrap(),
            "2024-02-29"
        );
        assert_eq!(
            strftime("%d %B %y %H:%M:%S %%", at(1_796_474_096)).unwrap(),
            "05 December 26 12:34:56 %"
        );
        assert!(strftime("%A", at(0)).is_err());
    }
}
