//! A Llama-style language model on the graph: RMSNorm pre-norm blocks, rotary position
//! embeddings on queries and keys, grouped-query attention (`n_kv_head` K/V heads shared
//! by `n_head / n_kv_head` query heads each), a SwiGLU MLP, no biases, an LM head of its
//! own (or tied to the embedding). Tensors carry Hugging Face's Llama names and layouts
//! (`model.layers.0.self_attn.q_proj.weight`, linear weights stored (out, in)), so a
//! checkpoint's model file reads as a Hugging Face state dict.
//!
//! Shapes: B batch, T sequence, C = n_embd, H heads, K = n_kv_head, D = C / H,
//! I = intermediate_size, V vocabulary.

pub use super::config::LlamaConfig;
use super::{Forward, Init, Model, ParamSpec};
use crate::graph::{Attention, Graph, Tensor};
use crate::{DType, Result};

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
        let attention = self
            .config
            .check_batch((batch, self.seq), dtype, self.attention)?;
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
