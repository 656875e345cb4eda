//! How a model's token ids become text and back: the tokenizer its data was prepared
//! with ([`TextCodec`]), and text shown as tokens arrive ([`TextStream`]), whole
//! characters only.

use std::path::Path;

use super::{Addition, DataError, Result, Tokenizer};

/// How token ids become text and back, as the run's data was tokenized.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum TextCodec {
    /// The built-in addition task's 13 tokens (digits, `+`, `=`, newline).
    Addition,
    /// `kiln prepare`'s tokenizers: GPT-2's BPE, one token per byte, or a Hugging Face
    /// model's.
    Tokens(Tokenizer),
}

impl TextCodec {
    /// Ids the tokenizer has: only these are ever sampled, whatever rows a (padded)
    /// model vocabulary has beyond them.
    pub fn vocab_size(&self) -> usize {
        match self {
            TextCodec::Addition => Addition::vocab_size(),
            TextCodec::Tokens(t) => t.vocab_size(),
        }
    }

    pub fn name(&self) -> &'static str {
        match self {
            TextCodec::Addition => "addition",
            TextCodec::Tokens(t) => t.name(),
        }
    }

    /// The ids of `text`, or an error naming the first character the vocabulary lacks.
    pub fn encode(&self, text: &str) -> Result<Vec<u32>> {
        match self {
            TextCodec::Addition => Addition::encode(text).ok_or_else(|| {
                let bad = text
                    .chars()
                    .find(|&c| Addition::encode(&c.to_string()).is_none())
                    .unwrap_or('?');
                DataError::Text(format!(
                    "the prompt {text:?} holds {bad:?}, which the addition model's vocabulary \
                     lacks: it knows the digits 0-9, `+`, `=` and newline (try \"47+85=\")"
                ))
            }),
            TextCodec::Tokens(t) => t.encode(text.as_bytes(), Path::new("the prompt")),
        }
    }

    /// The bytes of one token.
    fn bytes(&self, id: u32) -> Result<Vec<u8>> {
        Ok(match self {
            TextCodec::Addition => Addition::decode(&[id]).into_bytes(),
            TextCodec::Tokens(t) => t.decode_bytes(&[id])?,
        })
    }
}

/// Turns tokens into text as they come: a GPT-2 or byte token may end in the middle of
/// a UTF-8 character, which is held back until the bytes that complete it arrive. A
/// Hugging Face tokenizer's decoder may depend on the tokens before (SentencePiece drops
/// the space that starts the text), so its text is the decoded whole less what was
/// shown, held back while it ends in an incomplete character.
pub struct TextStream {
    codec: TextCodec,
    pending: Vec<u8>,
    /// A Hugging Face codec's ids so far and the bytes of their text already shown.
    ids: Vec<u32>,
    shown: usize,
}

impl TextStream {
    pub fn new(codec: TextCodec) -> TextStream {
        TextStream {
            codec,
            pending: vec![],
            ids: vec![],
            shown: 0,
        }
    }

    /// Starts after `prompt`, shown already: a Hugging Face decoder then renders the
    /// first new token as it follows the prompt (with the space between them).
    pub fn after(mut self, prompt: &[u32]) -> Result<TextStream> {
        if let TextCodec::Tokens(Tokenizer::Hf(t)) = &self.codec {
            self.ids = prompt.to_vec();
            self.shown = t.decode(prompt)?.len();
        }
        Ok(self)
    }

    /// The text that `id` completes (possibly empty).
    pub fn push(&mut self, id: u32) -> Result<String> {
        if let TextCodec::Tokens(Tokenizer::Hf(t)) = &self.codec {
            self.ids.push(id);
            let text = t.decode(&self.ids)?;
            if text.ends_with('\u{FFFD}') || !text.is_char_boundary(self.shown.min(text.len())) {
                return Ok(String::new());
            }
            let new = text.get(self.shown..).unwrap_or_default().to_string();
            self.shown = self.shown.max(text.len());
            return Ok(new);
        }
        self.pending.extend(self.codec.bytes(id)?);
        let mut out = String::new();
        loop {
            match std::str::from_utf8(&self.pending) {
                Ok(s) => {
                    out.push_str(s);
                    self.pending.clear();
                    return Ok(out);
                }
                Err(e) => {
                    let good = e.valid_up_to();
                    out.push_str(std::str::from_utf8(&self.pending[..good]).expect("valid"));
                    match e.error_len() {
                        // Bytes that can never be valid: shown as U+FFFD, as decoding
                        // a whole text would.
                        Some(n) => {
                            out.push('\u{FFFD}');
                            self.pending.drain(..good + n);
                        }
                        // An incomplete character at the end: wait for more.
                        None => {
                            self.pending.drain(..good);
                            return Ok(out);
                        }
                    }
                }
            }
        }
    }

    /// What is left at the end (an incomplete character, as U+FFFD).
    pub fn finish(&mut self) -> String {
        if let TextCodec::Tokens(Tokenizer::Hf(t)) = &self.codec {
            let text = t.decode(&self.ids).unwrap_or_default();
            let rest = text.get(self.shown..).unwrap_or_default().to_string();
            self.shown = self.shown.max(text.len());
            return rest;
        }
        let s = String::from_utf8_lossy(&self.pending).into_owned();
        self.pending.clear();
        s
    }
}
