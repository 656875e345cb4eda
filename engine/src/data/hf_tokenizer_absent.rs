//! What `hf_tokenizer` is in a build without the `tokenizers` feature (the web build):
//! the same names, no tokenizer. [`HfTokenizer::open`] refuses, saying which feature
//! brings it, so no value of the type exists and its methods cannot be reached.

use std::convert::Infallible;
use std::path::{Path, PathBuf};

use super::{DataError, Result};

/// The file a Hugging Face model directory keeps its tokenizer in.
pub const TOKENIZER_FILE: &str = "tokenizer.json";

/// The chat template's own file, where a model has one.
pub const CHAT_TEMPLATE_FILE: &str = "chat_template.jinja";

/// A Hugging Face tokenizer: none in this build.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HfTokenizer {
    absent: Infallible,
    pub file: PathBuf,
    pub sha256: String,
    pub bos: Option<u32>,
    pub eos: Vec<u32>,
}

impl HfTokenizer {
    /// Refuses: this build has no Hugging Face tokenizers.
    pub fn open(path: &Path) -> Result<HfTokenizer> {
        Err(DataError::InvalidArgument(format!(
            "{}: this build of kiln-engine reads no Hugging Face tokenizers; build it with \
             the `tokenizers` feature (on by default)",
            path.display()
        )))
    }

    pub fn vocab_size(&self) -> usize {
        match self.absent {}
    }

    pub fn encode(&self, _: &str, _: bool, _: &Path) -> Result<Vec<u32>> {
        match self.absent {}
    }

    pub fn decode(&self, _: &[u32]) -> Result<String> {
        match self.absent {}
    }

    pub fn chat(&self, _: &[(&str, &str)], _: bool) -> Result<String> {
        match self.absent {}
    }

    pub fn cuts_at_lines(&self) -> bool {
        match self.absent {}
    }

    pub fn special_affixes(&self, _: &Path) -> Result<(Vec<u32>, Vec<u32>)> {
        match self.absent {}
    }
}
