//! Model configs as files give them: GPT-2's and Llama's sizes with their checks, and
//! the model file `kiln train --model` reads (`"architecture"` picks the model).

use serde::Deserialize;

use super::{gpt, llama, tensor_elements, Model, MAX_LAYERS, MAX_PARAMETERS};
use crate::graph::Attention;
use crate::{DType, Error, Result, RopeFreqs, RopeScaling};

/// Model sizes, as in a GPT-2 config file.
#[derive(Clone, Debug, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct GptConfig {
    pub n_layer: usize,
    pub n_head: usize,
    pub n_embd: usize,
    pub block_size: usize,
    /// The real vocabulary: token ids, targets and sampled tokens are below it.
    pub vocab_size: usize,
    /// The rows of the token embedding and the LM head's columns, when larger than
    /// `vocab_size`: llm.c and nanoGPT pad GPT-2's 50257 to 50304 (a multiple of 64 and
    /// 128) for faster matmuls. The padding rows are never a target (the loss leaves
    /// them out) and never sampled. `None`: no padding.
    #[serde(default)]
    pub padded_vocab_size: Option<usize>,
}

impl GptConfig {
    /// The token embedding's rows (and the logits' columns): the padded vocabulary.
    pub fn padded_vocab(&self) -> usize {
        self.padded_vocab_size.unwrap_or(self.vocab_size)
    }

    /// Ψ: the number of parameter elements (the LM head is tied to the embedding);
    /// `usize::MAX` where that overflows ([`GptConfig::check`] refuses such sizes).
    pub fn parameter_count(&self) -> usize {
        self.checked_parameter_count().unwrap_or(usize::MAX)
    }

    /// Ψ, or `None` where it overflows.
    pub fn checked_parameter_count(&self) -> Option<usize> {
        let c = self.n_embd;
        let embeddings = self
            .padded_vocab()
            .checked_add(self.block_size)?
            .checked_mul(c)?;
        let block = c
            .checked_mul(c)?
            .checked_mul(12)?
            .checked_add(c.checked_mul(13)?)?;
        embeddings
            .checked_add(self.n_layer.checked_mul(block)?)?
            .checked_add(c.checked_mul(2)?)
    }

    /// Checks the sizes before anything is built from them: a layer count Kiln builds,
    /// tensors whose element counts fit, and a parameter count that does.
    pub fn check(&self) -> Result<()> {
        let (l, c, v) = (self.n_layer, self.n_embd, self.vocab_size);
        if l == 0 || l > MAX_LAYERS {
            return Err(Error::InvalidArgument(format!(
                "gpt: n_layer is {l}; Kiln builds 1 to {MAX_LAYERS} layers (GPT-3 has 96)"
            )));
        }
        if c == 0 || v == 0 || self.block_size == 0 || self.n_head == 0 {
            return Err(Error::InvalidArgument(format!(
                "gpt: n_embd ({c}), n_head ({}), block_size ({}) and vocab_size ({v}) must all \
                 be at least 1",
                self.n_head, self.block_size
            )));
        }
        if let Some(p) = self.padded_vocab_size {
            if p < v {
                return Err(Error::InvalidArgument(format!(
                    "gpt: padded_vocab_size {p} is below vocab_size {v}; the padded vocabulary \
                     holds the real one and the padding after it (e.g. 50304 for GPT-2's \
                     50257), or leave padded_vocab_size out"
                )));
            }
        }
        let rows = if self.padded_vocab_size.is_some() {
            "padded_vocab_size"
        } else {
            "vocab_size"
        };
        tensor_elements(
            &format!("gpt: the token embedding ({rows} × n_embd)"),
            &[self.padded_vocab(), c],
        )?;
        tensor_elements(
            "gpt: the position embedding (block_size × n_embd)",
            &[self.block_size, c],
        )?;
        tensor_elements("gpt: the MLP weight (n_embd × 4 · n_embd)", &[c, 4, c])?;
        match self.checked_parameter_count() {
            Some(n) if n <= MAX_PARAMETERS => Ok(()),
            _ => Err(Error::InvalidArgument(format!(
                "gpt: {l} layers of n_embd {c} with vocab_size {v} have more than \
                 {MAX_PARAMETERS} parameters, past any device or host; make the model smaller"
            ))),
        }
    }
}

/// Model sizes; the optional ones default as Llama's do.
#[derive(Clone, Debug, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct LlamaConfig {
    pub n_layer: usize,
    pub n_head: usize,
    /// K/V heads (grouped-query attention); default `n_head`.
    #[serde(default)]
    pub n_kv_head: Option<usize>,
    pub n_embd: usize,
    pub block_size: usize,
    pub vocab_size: usize,
    /// The SwiGLU MLP's width; default 8/3 · n_embd rounded up to a multiple of 8.
    #[serde(default)]
    pub intermediate_size: Option<usize>,
    #[serde(default = "default_theta")]
    pub rope_theta: f32,
    #[serde(default = "default_eps")]
    pub rms_norm_eps: f32,
    /// The LM head reads the token embedding (one tensor) instead of its own.
    #[serde(default)]
    pub tie_word_embeddings: bool,
    /// Each attention head's width D; default n_embd / n_head (Mistral-Nemo's 128 is
    /// not 5120 / 32). q is (H·D, C), k and v (K·D, C), o (C, H·D).
    #[serde(default)]
    pub head_dim: Option<usize>,
    /// q, k and v projections with biases (Qwen2); o and the MLP have none.
    #[serde(default)]
    pub qkv_bias: bool,
    /// Llama 3's rotary frequencies rescaled per band; none: plain `rope_theta`.
    #[serde(default)]
    pub rope_scaling: Option<RopeScaling>,
    /// Mistral's sliding window: each position attends to at most this many (itself
    /// included). Kiln computes full causal attention, which equals it while sequences
    /// are no longer than the window, so longer ones are refused.
    #[serde(default)]
    pub sliding_window: Option<usize>,
    /// The positions the model reaches (Hugging Face's `max_position_embeddings`),
    /// where it is more than `block_size`, the sequence Kiln trains on: kept for export.
    #[serde(default)]
    pub max_position_embeddings: Option<usize>,
}

fn default_theta() -> f32 {
    10000.0
}

fn default_eps() -> f32 {
    1e-5
}

impl LlamaConfig {
    pub fn kv_heads(&self) -> usize {
        self.n_kv_head.unwrap_or(self.n_head)
    }

    /// Parameters per block: input norm, q, k, v, (q, k, v biases,) o, post-attention
    /// norm, gate, up, down.
    pub fn per_block(&self) -> usize {
        if self.qkv_bias {
            12
        } else {
            9
        }
    }

    /// The positions the model reaches: its `max_position_embeddings`, else block_size.
    pub fn reach(&self) -> usize {
        self.max_position_embeddings
            .unwrap_or(self.block_size)
            .max(self.block_size)
    }

    /// D, each head's width.
    pub fn head_dim(&self) -> usize {
        self.head_dim.unwrap_or(self.n_embd / self.n_head.max(1))
    }

    /// The rotary embedding's frequencies.
    pub fn rope(&self) -> RopeFreqs {
        RopeFreqs {
            theta: self.rope_theta,
            scaling: self.rope_scaling,
        }
    }

    /// The MLP width (saturating where 8/3 · n_embd overflows, which
    /// [`LlamaConfig::check`] refuses).
    pub fn intermediate(&self) -> usize {
        self.intermediate_size.unwrap_or_else(|| {
            self.n_embd
                .saturating_mul(8)
                .div_ceil(3)
                .checked_next_multiple_of(8)
                .unwrap_or(usize::MAX)
        })
    }

    /// Ψ, or `None` where it overflows.
    pub fn checked_parameter_count(&self) -> Option<usize> {
        let (e, v, i) = (self.n_embd, self.vocab_size, self.intermediate());
        let q = self.n_head.checked_mul(self.head_dim())?;
        let kv = self.kv_heads().checked_mul(self.head_dim())?;
        let heads = if self.tie_word_embeddings { 1 } else { 2 };
        let biases = if self.qkv_bias {
            q.checked_add(kv.checked_mul(2)?)?
        } else {
            0
        };
        let block = q
            .checked_mul(e)?
            .checked_mul(2)?
            .checked_add(kv.checked_mul(e)?.checked_mul(2)?)?
            .checked_add(i.checked_mul(e)?.checked_mul(3)?)?
            .checked_add(e.checked_mul(2)?)?
            .checked_add(biases)?;
        v.checked_mul(e)?
            .checked_mul(heads)?
            .checked_add(self.n_layer.checked_mul(block)?)?
            .checked_add(e)
    }

    /// Checks the sizes before anything is built from them: a layer count Kiln builds,
    /// tensors whose element counts fit, and a parameter count that does.
    pub fn check(&self) -> Result<()> {
        let (l, e, v) = (self.n_layer, self.n_embd, self.vocab_size);
        if l == 0 || l > MAX_LAYERS {
            return Err(Error::InvalidArgument(format!(
                "llama: n_layer is {l}; Kiln builds 1 to {MAX_LAYERS} layers (the largest \
                 Llama has 126)"
            )));
        }
        if e == 0 || v == 0 || self.block_size == 0 || self.n_head == 0 || self.intermediate() == 0
        {
            return Err(Error::InvalidArgument(format!(
                "llama: n_embd ({e}), n_head ({}), block_size ({}), vocab_size ({v}) and \
                 intermediate_size ({}) must all be at least 1",
                self.n_head,
                self.block_size,
                self.intermediate()
            )));
        }
        tensor_elements("llama: the token embedding (vocab_size × n_embd)", &[v, e])?;
        if self.head_dim == Some(0) || self.sliding_window == Some(0) {
            return Err(Error::InvalidArgument(
                "llama: head_dim and sliding_window must be at least 1 where given".into(),
            ));
        }
        if self.head_dim.is_none() && !e.is_multiple_of(self.n_head) {
            return Err(Error::InvalidArgument(format!(
                "llama: n_embd {e} does not split into n_head {} heads; give head_dim, or \
                 a head count that divides n_embd",
                self.n_head
            )));
        }
        if let Some(why) = self.rope_scaling.as_ref().and_then(RopeScaling::problem) {
            return Err(Error::InvalidArgument(format!("llama: {why}")));
        }
        tensor_elements(
            "llama: a projection (n_head × head_dim × n_embd)",
            &[self.n_head, self.head_dim(), e],
        )?;
        tensor_elements(
            "llama: an MLP weight (intermediate_size × n_embd)",
            &[self.intermediate(), e],
        )?;
        match self.checked_parameter_count() {
            Some(n) if n <= MAX_PARAMETERS => Ok(()),
            _ => Err(Error::InvalidArgument(format!(
                "llama: {l} layers of n_embd {e} with vocab_size {v} have more than \
                 {MAX_PARAMETERS} parameters, past any device or host; make the model smaller"
            ))),
        }
    }

    /// Checks the heads, the sequence and the micro-batch's activations before a
    /// forward pass is recorded, and picks the attention (`pinned` if set).
    pub fn check_batch(
        &self,
        (batch, seq): (usize, usize),
        dtype: DType,
        pinned: Option<Attention>,
    ) -> Result<Attention> {
        let c = self;
        let (h, k) = (c.n_head, c.kv_heads());
        let even_heads = match c.head_dim {
            Some(d) => d > 0 && d.is_multiple_of(2),
            None => c.n_embd.is_multiple_of(h) && (c.n_embd / h).is_multiple_of(2),
        };
        if h == 0 || k == 0 || !even_heads || !h.is_multiple_of(k) {
            return Err(Error::InvalidArgument(format!(
                "llama: n_embd {} must split into n_head {h} heads of an even size (or \
                 head_dim be even), and n_head into n_kv_head {k} groups",
                c.n_embd
            )));
        }
        if let Some(w) = c.sliding_window.filter(|&w| seq > w) {
            return Err(Error::InvalidArgument(format!(
                "llama: sequences of {seq} tokens are longer than the sliding window of {w}; \
                 Kiln computes full causal attention, equal to the window's only up to {w} \
                 tokens: train with seq <= {w}"
            )));
        }
        if seq == 0 || seq > c.block_size || batch == 0 || c.n_layer == 0 {
            return Err(Error::InvalidArgument(format!(
                "llama: need 1 <= seq ({}) <= block_size ({}), batch >= 1, n_layer >= 1",
                seq, c.block_size
            )));
        }
        let d = c.head_dim();
        let attention = Attention::choose(pinned, (d, dtype, seq), "llama")?;
        let t = seq;
        tensor_elements(
            "llama: the logits (micro-batch × seq × vocab_size)",
            &[batch, t, c.vocab_size],
        )?;
        tensor_elements(
            "llama: the MLP activations (micro-batch × seq × intermediate_size)",
            &[
                batch,
                t,
                c.intermediate().max(c.n_embd).max(c.n_head * c.head_dim()),
            ],
        )?;
        if attention == Attention::Straightforward {
            tensor_elements(
                "llama: the attention scores (micro-batch × n_head × seq × seq)",
                &[batch, h, t, t],
            )?;
        }
        Ok(attention)
    }
}

impl std::fmt::Display for LlamaConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} layers, {} embd, {} heads, {} kv heads, vocab {}",
            self.n_layer,
            self.n_embd,
            self.n_head,
            self.kv_heads(),
            self.vocab_size
        )
    }
}

/// A model file for `kiln train --model`: `{"architecture": "gpt2" | "llama", …sizes}`,
/// GPT-2 when `architecture` is absent. Every other key is the architecture's config,
/// read strictly (an unknown key is an error naming it).
#[derive(Clone, Debug, PartialEq)]
pub enum ModelConfig {
    Gpt2(gpt::GptConfig),
    Llama(llama::LlamaConfig),
}

impl ModelConfig {
    /// The architectures a model file may name.
    pub const ARCHITECTURES: [&'static str; 2] = ["gpt2", "llama"];

    /// Reads a model file's JSON.
    pub fn parse(text: &str) -> std::result::Result<ModelConfig, String> {
        // Editors on Windows may start a UTF-8 file with a byte-order mark.
        let text = text.strip_prefix('\u{feff}').unwrap_or(text);
        let mut v: serde_json::Value =
            serde_json::from_str(text).map_err(|e| format!("not valid JSON: {e}"))?;
        let obj = v
            .as_object_mut()
            .ok_or("expected a JSON object of model sizes")?;
        let arch = match obj.remove("architecture") {
            None => "gpt2".to_string(),
            Some(serde_json::Value::String(s)) => s,
            Some(other) => return Err(format!("`architecture` must be a string, not {other}")),
        };
        let strict =
            |e: serde_json::Error, fields: &str| format!("{arch} model: {e} (expected {fields})");
        match arch.as_str() {
            "gpt2" => serde_json::from_value(v)
                .map(ModelConfig::Gpt2)
                .map_err(|e| {
                    strict(
                        e,
                        "\"n_layer\", \"n_head\", \"n_embd\", \"block_size\", \"vocab_size\"; \
                         optional \"padded_vocab_size\"",
                    )
                }),
            "llama" => serde_json::from_value(v)
                .map(ModelConfig::Llama)
                .map_err(|e| {
                    strict(
                        e,
                        "\"n_layer\", \"n_head\", \"n_embd\", \"block_size\", \"vocab_size\"; \
                     optional \"n_kv_head\", \"intermediate_size\", \"rope_theta\", \
                     \"rms_norm_eps\", \"tie_word_embeddings\", \"head_dim\", \"qkv_bias\", \
                     \"rope_scaling\", \"sliding_window\", \"max_position_embeddings\"",
                    )
                }),
            other => Err(format!(
                "unknown architecture `{other}`; expected one of {}",
                ModelConfig::ARCHITECTURES.join(", ")
            )),
        }
    }

    /// The sizes checked as the architecture checks them (see each config's `check`).
    pub fn check(&self) -> Result<()> {
        match self {
            ModelConfig::Gpt2(c) => c.check(),
            ModelConfig::Llama(c) => c.check(),
        }
    }

    /// The longest sequence the model takes (its trained length).
    pub fn block_size(&self) -> usize {
        match self {
            ModelConfig::Gpt2(c) => c.block_size,
            ModelConfig::Llama(c) => c.block_size,
        }
    }

    pub fn vocab_size(&self) -> usize {
        match self {
            ModelConfig::Gpt2(c) => c.vocab_size,
            ModelConfig::Llama(c) => c.vocab_size,
        }
    }

    /// `--seq`: trains on sequences of `seq` tokens ([`ModelConfig::set_block_size`]),
    /// refused outside 1 to the model's block_size.
    pub fn set_seq(&mut self, seq: usize) -> Result<()> {
        let most = self.block_size();
        if seq == 0 || seq > most {
            return Err(Error::InvalidArgument(format!(
                "--seq {seq}: give 1 to {most} tokens (the model's block_size, the longest \
                 sequence it has positions for)"
            )));
        }
        self.set_block_size(seq);
        Ok(())
    }

    /// Trains on sequences of `t` tokens (GPT-2's position embedding keeps its first `t`
    /// rows).
    pub fn set_block_size(&mut self, t: usize) {
        match self {
            ModelConfig::Gpt2(c) => c.block_size = t,
            ModelConfig::Llama(c) => {
                // RoPE has no table: the positions past t stay the model's.
                c.max_position_embeddings = Some(c.reach()).filter(|&p| p > t);
                c.block_size = t;
            }
        }
    }

    /// Sizes the vocabulary to the data's.
    pub fn set_vocab_size(&mut self, v: usize) {
        match self {
            ModelConfig::Gpt2(c) => c.vocab_size = v,
            ModelConfig::Llama(c) => c.vocab_size = v,
        }
    }

    /// The model, trained on sequences of `seq` tokens.
    pub fn build(&self, seq: usize) -> std::sync::Arc<dyn Model> {
        match self {
            ModelConfig::Gpt2(c) => std::sync::Arc::new(gpt::Gpt::new(c.clone(), seq)),
            ModelConfig::Llama(c) => std::sync::Arc::new(llama::Llama::new(c.clone(), seq)),
        }
    }

    /// The settings as a run records them (GPT-2's five sizes, as runs always have;
    /// other architectures every setting and their name).
    pub fn record(&self) -> serde_json::Value {
        match self {
            ModelConfig::Gpt2(c) => {
                let mut v = serde_json::json!({
                    "n_layer": c.n_layer,
                    "n_head": c.n_head,
                    "n_embd": c.n_embd,
                    "block_size": c.block_size,
                    "vocab_size": c.vocab_size,
                });
                // Only where set, so the runs recorded before it compare the same.
                if let Some(p) = c.padded_vocab_size {
                    v["padded_vocab_size"] = p.into();
                }
                v
            }
            ModelConfig::Llama(c) => {
                let mut v = serde_json::json!({
                "architecture": "llama",
                "n_layer": c.n_layer,
                "n_head": c.n_head,
                "n_kv_head": c.kv_heads(),
                "n_embd": c.n_embd,
                "block_size": c.block_size,
                "vocab_size": c.vocab_size,
                "intermediate_size": c.intermediate(),
                "rope_theta": c.rope_theta,
                "rms_norm_eps": c.rms_norm_eps,
                "tie_word_embeddings": c.tie_word_embeddings,
                });
                // Only where set, so the runs recorded before them compare the same.
                if let Some(d) = c.head_dim {
                    v["head_dim"] = d.into();
                }
                if c.qkv_bias {
                    v["qkv_bias"] = true.into();
                }
                if let Some(s) = c.rope_scaling {
                    v["rope_scaling"] = serde_json::to_value(s).unwrap_or_default();
                }
                if let Some(w) = c.sliding_window {
                    v["sliding_window"] = w.into();
                }
                if let Some(p) = c.max_position_embeddings {
                    v["max_position_embeddings"] = p.into();
                }
                v
            }
        }
    }
}
