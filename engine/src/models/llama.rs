//! A Llama-style language model on the graph: RMSNorm pre-norm blocks, rotary position
//! embeddings on queries and keys (Llama 3's band rescaling where the config has it),
//! grouped-query attention (`n_kv_head` K/V heads shared by `n_head / n_kv_head` query
//! heads each), a SwiGLU MLP, no biases but Qwen2's on q, k and v, an LM head of its
//! own (or tied to the embedding). The same model is Qwen2 (`qkv_bias`) and Mistral
//! (`sliding_window`, refused past the sequence length). Tensors carry Hugging Face's Llama names and layouts
//! (`model.layers.0.self_attn.q_proj.weight`, linear weights stored (out, in)), so a
//! checkpoint's model file reads as a Hugging Face state dict.
//!
//! Shapes: B batch, T sequence, C = n_embd, H heads, K = n_kv_head, D = head_dim
//! (C / H unless given), I = intermediate_size, V vocabulary.

pub use super::config::LlamaConfig;
use super::{Decoder, Forward, Init, Model, ParamSpec};
use crate::graph::{Attention, Graph, Tensor};
use crate::{DType, Error, Result};

/// Llama trained on sequences of `seq` tokens (at most `block_size`).
#[derive(Clone, Debug)]
pub struct Llama {
    pub config: LlamaConfig,
    pub seq: usize,
    /// How attention is computed; `None`: [`Attention::best`] for the heads, the
    /// precision and the sequence length.
    pub attention: Option<Attention>,
}

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
}

impl Model for Llama {
    fn describe(&self) -> String {
        format!("Llama ({}, T {})", self.config, self.seq)
    }

    fn check_sizes(&self) -> Result<()> {
        self.config.check()
    }

    fn parameters(&self) -> Vec<ParamSpec> {
        let c = &self.config;
        let (e, v, i) = (c.n_embd, c.vocab_size, c.intermediate());
        let (q, kv) = (c.n_head * c.head_dim(), c.kv_heads() * c.head_dim());
        let (std, out_std) = (0.02, 0.02 / (2.0 * c.n_layer as f32).sqrt());
        let norm = |name: String| ParamSpec::new(name, &[e], Init::Const(1.0)).f32_grad();
        let bias = |name: String, n: usize| ParamSpec::new(name, &[n], Init::Const(0.0));
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
                dense(n("self_attn.q_proj.weight"), q, e, std),
                dense(n("self_attn.k_proj.weight"), kv, e, std),
                dense(n("self_attn.v_proj.weight"), kv, e, std),
            ]);
            if c.qkv_bias {
                p.extend([
                    bias(n("self_attn.q_proj.bias"), q),
                    bias(n("self_attn.k_proj.bias"), kv),
                    bias(n("self_attn.v_proj.bias"), kv),
                ]);
            }
            p.extend([
                dense(n("self_attn.o_proj.weight"), e, q, out_std),
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
        let attention = self
            .config
            .check_batch((batch, self.seq), dtype, self.attention)?;
        let c = &self.config;
        let (h, k, rope, eps) = (c.n_head, c.kv_heads(), c.rope(), c.rms_norm_eps);
        let per = c.per_block();
        let tokens = g.input("tokens", &[batch, self.seq], DType::U32);
        let targets = g.input("targets", &[batch, self.seq], DType::U32);
        // x (B, T, C) = embed[tokens]; every linear reads its weight (out, in) transposed.
        let mut x = g.embedding(tokens, p[0])?;
        for l in 0..c.n_layer {
            let w = &p[1 + per * l..1 + per * (l + 1)];
            // The q, k, v biases (Qwen2) sit after their weights; the rest shift by 3.
            let (b, r) = match c.qkv_bias {
                true => ([Some(w[4]), Some(w[5]), Some(w[6])], &w[7..]),
                false => ([None; 3], &w[4..]),
            };
            // x = x + o(attention(rope(q(n)), rope(k(n)), v(n))), n = rmsnorm(x)
            let n = g.rmsnorm(x, w[0], eps)?;
            let q = g.linear_transposed(n, w[1], b[0])?; // (B, T, H*D)
            let kk = g.linear_transposed(n, w[2], b[1])?; // (B, T, K*D)
            let v = g.linear_transposed(n, w[3], b[2])?; // (B, T, K*D)
            let (q, kk) = (g.rope(q, h, rope)?, g.rope(kk, k, rope)?);
            let y = g.attention(q, kk, v, h, k, attention)?; // (B, T, H*D)
            let y = g.linear_transposed(y, r[0], None)?; // (B, T, C)
            x = g.add(x, y)?;
            // x = x + down(silu(gate(n)) * up(n)), n = rmsnorm(x)
            let n = g.rmsnorm(x, r[1], eps)?;
            let gate = g.linear_transposed(n, r[2], None)?; // (B, T, I)
            let up = g.linear_transposed(n, r[3], None)?; // (B, T, I)
            let f = g.swiglu(gate, up)?;
            let f = g.linear_transposed(f, r[4], None)?;
            x = g.add(x, f)?;
        }
        let last = 1 + per * c.n_layer;
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
        let per = self.config.per_block();
        (0..self.config.n_layer)
            .map(|l| (1 + per * l..1 + per * (l + 1)).collect())
            .collect()
    }
}

impl Decoder for Llama {
    fn check_context(&self, max_len: usize) -> Result<()> {
        let why = "the positions it was trained for";
        super::check_block_size(max_len, self.config.block_size, why)?;
        if let Some(w) = self.config.sliding_window.filter(|&w| max_len > w) {
            return Err(Error::InvalidArgument(format!(
                "generate: max_len {max_len} is past the model's sliding window of {w}; \
                 the cached attention is full attention, equal to the window's only up to \
                 {w} positions: generate at most {w}"
            )));
        }
        Ok(())
    }

    fn with_seq(&self, seq: usize) -> Box<dyn Decoder> {
        Box::new(Llama::new(self.config.clone(), seq))
    }
}
