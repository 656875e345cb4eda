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

use super::chat_template::{model_chat, side_json, token_text, ChatTemplate, ModelChat};
use super::{DataError, Result};

pub use tokenizers;

/// The file a Hugging Face model directory keeps its tokenizer in.
pub const TOKENIZER_FILE: &str = "tokenizer.json";

/// The chat template's own file, where a model has one (else it is in
/// `tokenizer_config.json`).
pub use super::chat_template::CHAT_TEMPLATE_FILE;

/// A text's ids and each id's byte range in the text.
pub type Encoded = (Vec<u32>, Vec<(usize, usize)>);

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
    /// The model directory's chat template and the special tokens it sees (a BOS or EOS
    /// known only by id, from `generation_config.json`, by its text).
    pub chat: ModelChat,
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
            chat: ModelChat::default(),
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
        let mut chat = model_chat(dir)?;
        let (mut bos, mut eos) = (None, vec![]);
        if let Some(cfg) = side_json(dir, "tokenizer_config.json")? {
            let from = dir.join("tokenizer_config.json");
            if let Some(b) = cfg.get("bos_token").and_then(token_text) {
                bos = Some(id_of("bos_token", b, &from)?);
            }
            if let Some(e) = cfg.get("eos_token").and_then(token_text) {
                eos.push(id_of("eos_token", e, &from)?);
            }
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
        // A BOS or EOS known only by id (generation_config.json) by its text.
        for (name, id) in [("bos_token", bos), ("eos_token", eos.first().copied())] {
            if !chat.specials.iter().any(|(n, _)| n == name) {
                if let Some(text) = id.and_then(|i| t.inner.id_to_token(i)) {
                    chat.specials.push((name.to_string(), text));
                }
            }
        }
        (t.bos, t.eos, t.chat) = (bos, eos, chat);
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

    /// [`HfTokenizer::encode`] with each id's byte range in `text` (an id the
    /// post-processor adds has an empty one).
    pub fn encode_offsets(&self, text: &str, special: bool, what: &Path) -> Result<Encoded> {
        self.inner
            .encode(text, special)
            .map(|e| (e.get_ids().to_vec(), e.get_offsets().to_vec()))
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

    /// The model's chat template, with the special tokens it sees; `date` is what
    /// `strftime_now` gives (else each render's time). An error if the model has none or
    /// it does not compile.
    pub fn chat_template(&self, date: Option<std::time::SystemTime>) -> Result<ChatTemplate> {
        let dir = self.file.parent().unwrap_or(Path::new("."));
        self.chat.template(dir, date)
    }

    /// The text of a conversation as the model was tuned on it: `messages` (role,
    /// content) through the tokenizer's chat template, with the assistant's header
    /// after them where `generation_prompt` (Hugging Face's `add_generation_prompt`),
    /// rendered as `transformers` renders it ([`ChatTemplate`]).
    pub fn chat(&self, messages: &[(&str, &str)], generation_prompt: bool) -> Result<String> {
        let row = serde_json::json!({
            "messages": messages
                .iter()
                .map(|(role, content)| serde_json::json!({ "role": role, "content": content }))
                .collect::<Vec<_>>(),
        });
        Ok(self
            .chat_template(None)?
            .render(&row, generation_prompt)?
            .text)
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
