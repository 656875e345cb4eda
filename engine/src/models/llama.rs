//! A Llama-style language model on the graph: RMSNorm pre-norm blocks, rotary position
//! embeddings on queries and keys, grouped-query attention (`n_kv_head` K/V heads shared
//! by `n_head / n_kv_head` query heads each), a SwiGLU MLP, no biases, an LM head of its
//! own (or tied to the embedding). Tensors carry Hugging Face's Llama names and layouts
//! (`model.layers.0.self_attn.q_proj.weight`, linear weights stored (out, in)), so a
//! checkpoint's model file reads as a Hugging Face state dict.
//!
//! Shapes: B batch, T sequence, C = n_embd, H heads, K = n_kv_head, D = C / H,
//! I = intermediate_size, V vocabulary.

use serde::Deserialize;

use super::{tensor_elements, Forward, Init, Model, ParamSpec, MAX_LAYERS, MAX_PARAMETERS};
use crate::graph::{Attention, Graph, Tensor};
use crate::{DType, Error, Result};

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
        let kv = self.kv_heads().checked_mul(e / self.n_head.max(1))?;
        let heads = if self.tie_word_embeddings { 1 } else { 2 };
        let block = e
            .checked_mul(e)?
            .checked_mul(2)?
            .checked_add(kv.checked_mul(e)?.checked_mul(2)?)?
            .checked_add(i.checked_mul(e)?.checked_mul(3)?)?
            .checked_add(e.checked_mul(2)?)?;
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
        tensor_elements("llama: a projection (n_embd × n_embd)", &[e, e])?;
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
}

/// Llama trained on sequences of `seq` tokens (at most `block_size`).
#[derive(Clone, Debug)]
pub struct Llama {
    pub config: LlamaConfig,
    pub seq: usize,
    /// How attention is computed; `None`: [`Attention::best`] for the heads, the
    /// precision and the sequence length.
    pub attention: Option<Attention>,
}

/// Parameters per block: input norm, q, k, v, o, post-attention norm, gate, up, down.
const PER_BLOCK: usize = 9;

impl Llama {
    pub fn new(config: LlamaConfig, seq: usize) -> Llama {
        Llama {
            config,
            seq,
            attention: None,
        }
    }

    /// Computes attention with `attention` whatever the sizes.
    pub fn with_attention(mut self, attention: Attention) -> Llama {
        self.attention = Some(attention);
        self
    }

    fn check(&self, batch: usize, dtype: DType) -> Result<Attention> {
        let c = &self.config;
        let (h, k) = (c.n_head, c.kv_heads());
        let even_heads = c.n_embd.is_multiple_of(h) && (c.n_embd / h).is_multiple_of(2);
        if h == 0 || k == 0 || !even_heads || !h.is_multiple_of(k) {
            return Err(Error::InvalidArgument(format!(
                "llama: n_embd {} must split into n_head {h} heads of an even size, and n_head \
                 into n_kv_head {k} groups",
                c.n_embd
            )));
        }
        if self.seq == 0 || self.seq > c.block_size || batch == 0 || c.n_layer == 0 {
            return Err(Error::InvalidArgument(format!(
                "llama: need 1 <= seq ({}) <= block_size ({}), batch >= 1, n_layer >= 1",
                self.seq, c.block_size
            )));
        }
        let d = c.n_embd / h;
        let attention = Attention::choose(self.attention, (d, dtype, self.seq), "llama")?;
        let t = self.seq;
        tensor_elements(
            "llama: the logits (micro-batch × seq × vocab_size)",
            &[batch, t, c.vocab_size],
        )?;
        tensor_elements(
            "llama: the MLP activations (micro-batch × seq × intermediate_size)",
            &[batch, t, c.intermediate().max(c.n_embd)],
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

impl Model for Llama {
    fn describe(&self) -> String {
        let c = &self.config;
        format!(
            "Llama ({} layers, {} embd, {} heads, {} kv heads, T {}, vocab {})",
            c.n_layer,
            c.n_embd,
            c.n_head,
            c.kv_heads(),
            self.seq,
            c.vocab_size
        )
    }

    fn check_sizes(&self) -> Result<()> {
        self.config.check()
    }

    fn parameters(&self) -> Vec<ParamSpec> {
        let c = &self.config;
        let (e, v, i) = (c.n_embd, c.vocab_size, c.intermediate());
        let kv = c.kv_heads() * (e / c.n_head.max(1));
        let (std, out_std) = (0.02, 0.02 / (2.0 * c.n_layer as f32).sqrt());
        let norm = |name: String| ParamSpec::new(name, &[e], Init::Const(1.0)).f32_grad();
        let dense = |name: String, out: usize, inp: usize, s: f32| {
            ParamSpec::new(name, &[out, inp], Init::Uniform(s)).decayed()
        };
        let mut embed = ParamSpec::new("model.embed_tokens.weight", &[v, e], Init::Uniform(std));
        if c.tie_word_embeddings {
            embed = embed.tied("lm_head.weight");
        }
        let mut p = vec![embed.f32_grad()];
        for l in 0..c.n_layer {
            let n = |s: &str| format!("model.layers.{l}.{s}");
            p.extend([
                norm(n("input_layernorm.weight")),
                dense(n("self_attn.q_proj.weight"), e, e, std),
                dense(n("self_attn.k_proj.weight"), kv, e, std),
                dense(n("self_attn.v_proj.weight"), kv, e, std),
                dense(n("self_attn.o_proj.weight"), e, e, out_std),
                norm(n("post_attention_layernorm.weight")),
                dense(n("mlp.gate_proj.weight"), i, e, std),
                dense(n("mlp.up_proj.weight"), i, e, std),
                dense(n("mlp.down_proj.weight"), e, i, out_std),
            ]);
        }
        p.push(norm("model.norm.weight".into()));
        if !c.tie_word_embeddings {
            p.push(dense("lm_head.weight".into(), v, e, std));
        }
        p
    }

    fn forward(&self, g: &mut Graph, p: &[Tensor], batch: usize, dtype: DType) -> Result<Forward> {
        let attention = self.check(batch, dtype)?;
        let c = &self.config;
        let (h, k, theta, eps) = (c.n_head, c.kv_heads(), c.rope_theta, c.rms_norm_eps);
        let tokens = g.input("tokens", &[batch, self.seq], DType::U32);
        let targets = g.input("targets", &[batch, self.seq], DType::U32);
        // x (B, T, C) = embed[tokens]; every linear reads its weight (out, in) transposed.
        let mut x = g.embedding(tokens, p[0])?;
        for l in 0..c.n_layer {
            let w = &p[1 + PER_BLOCK * l..1 + PER_BLOCK * (l + 1)];
            // x = x + o(attention(rope(q(n)), rope(k(n)), v(n))), n = rmsnorm(x)
            let n = g.rmsnorm(x, w[0], eps)?;
            let q = g.linear_transposed(n, w[1], None)?; // (B, T, H*D)
            let kk = g.linear_transposed(n, w[2], None)?; // (B, T, K*D)
            let v = g.linear_transposed(n, w[3], None)?; // (B, T, K*D)
            let (q, kk) = (g.rope(q, h, theta)?, g.rope(kk, k, theta)?);
            let y = g.attention(q, kk, v, h, k, attention)?; // (B, T, C)
            let y = g.linear_transposed(y, w[4], None)?;
            x = g.add(x, y)?;
            // x = x + down(silu(gate(n)) * up(n)), n = rmsnorm(x)
            let n = g.rmsnorm(x, w[5], eps)?;
            let gate = g.linear_transposed(n, w[6], None)?; // (B, T, I)
            let up = g.linear_transposed(n, w[7], None)?; // (B, T, I)
            let f = g.swiglu(gate, up)?;
            let f = g.linear_transposed(f, w[8], None)?;
            x = g.add(x, f)?;
        }
        let last = 1 + PER_BLOCK * c.n_layer;
        let xf = g.rmsnorm(x, p[last], eps)?;
        let head = if c.tie_word_embeddings {
            p[0]
        } else {
            p[last + 1]
        };
        let logits = g.linear_transposed(xf, head, None)?; // (B, T, V)
        g.cross_entropy(logits, targets)?;
        Ok(Forward {
            inputs: vec![tokens, targets],
            prediction: logits,
        })
    }

    fn blocks(&self) -> Vec<Vec<usize>> {
        (0..self.config.n_layer)
            .map(|l| (1 + PER_BLOCK * l..1 + PER_BLOCK * (l + 1)).collect())
            .collect()
    }
}
