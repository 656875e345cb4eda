//! GPT-2, written once as a forward pass on the graph: token + learned position
//! embeddings, pre-LN blocks (causal self-attention, GELU MLP, residual adds), a final
//! layer norm and an LM head tied to the token embedding, cross-entropy over the
//! vocabulary. Parameter names follow GPT-2's (`transformer.h.0.attn.c_attn.weight`,
//! …), weights stored (in, out) as GPT-2's Conv1D does. Backward and the update are
//! derived and compiled by [`super::Network`].
//!
//! Shapes: B batch, T sequence, C = n_embd, H heads, V vocabulary (Vp padded).

pub use super::config::GptConfig;
use super::{tensor_elements, Decoder, Forward, Init, Model, ParamSpec};
use crate::graph::{Attention, Graph, Tensor};
use crate::{DType, Error, Result};

/// GPT-2 trained on sequences of `seq` tokens (at most `block_size`).
#[derive(Clone, Debug)]
pub struct Gpt {
    pub config: GptConfig,
    pub seq: usize,
    /// How self-attention is computed; `None`: [`Attention::best`] for the heads, the
    /// precision and the sequence length.
    pub attention: Option<Attention>,
}

/// Parameters per transformer block.
const PER_BLOCK: usize = 12;

impl Gpt {
    pub fn new(config: GptConfig, seq: usize) -> Gpt {
        Gpt {
            config,
            seq,
            attention: None,
        }
    }

    /// Computes self-attention with `attention` whatever the sizes.
    pub fn with_attention(mut self, attention: Attention) -> Gpt {
        self.attention = Some(attention);
        self
    }

    /// The attention the blocks use with activations of `dtype`.
    pub fn attention(&self, dtype: DType) -> Attention {
        let head_dim = self.config.n_embd / self.config.n_head.max(1);
        self.attention
            .unwrap_or_else(|| Attention::best(head_dim, dtype, self.seq))
    }

    /// Checks the sizes before anything is recorded.
    fn check(&self, batch: usize, dtype: DType) -> Result<()> {
        let cfg = &self.config;
        let (c, h, v, t) = (cfg.n_embd, cfg.n_head, cfg.padded_vocab(), self.seq);
        if h == 0 || c % h != 0 || c % 2 != 0 {
            return Err(Error::InvalidArgument(format!(
                "gpt: n_embd {c} must be even and divisible by n_head {h}"
            )));
        }
        if t == 0 || t > cfg.block_size || batch == 0 || v == 0 || cfg.n_layer == 0 {
            return Err(Error::InvalidArgument(format!(
                "gpt: need 1 <= seq ({t}) <= block_size ({}), batch >= 1, vocab >= 1, n_layer >= 1",
                cfg.block_size
            )));
        }
        tensor_elements(
            "gpt: the logits (micro-batch × seq × vocab_size)",
            &[batch, t, v],
        )?;
        tensor_elements(
            "gpt: the MLP activations (micro-batch × seq × 4 · n_embd)",
            &[batch, t, 4, c],
        )?;
        if self.attention(dtype) == Attention::Straightforward {
            tensor_elements(
                "gpt: the attention scores (micro-batch × n_head × seq × seq)",
                &[batch, h, t, t],
            )?;
        }
        Attention::choose(self.attention, (c / h, dtype, t), "gpt")?;
        Ok(())
    }
}

impl Model for Gpt {
    fn describe(&self) -> String {
        let c = &self.config;
        format!(
            "GPT-2 ({} layers, {} embd, {} heads, T {}, vocab {})",
            c.n_layer,
            c.n_embd,
            c.n_head,
            self.seq,
            match c.padded_vocab_size {
                Some(p) => format!("{} padded to {p}", c.vocab_size),
                None => c.vocab_size.to_string(),
            }
        )
    }

    fn check_sizes(&self) -> Result<()> {
        self.config.check()
    }

    /// wte, wpe, 12 per block, ln_f weight and bias.
    fn parameters(&self) -> Vec<ParamSpec> {
        let (c, v) = (self.config.n_embd, self.config.padded_vocab());
        // GPT-2's initialisation: weights normal with std 0.02; the two projections
        // that add into the residual stream (attn.c_proj, mlp.c_proj) scaled by
        // 1/√(2·n_layer), so the stream's variance does not grow with depth; biases 0,
        // layer norms 1 and 0.
        let normal = Init::Normal(0.02);
        let proj = Init::Normal(0.02 / (2.0 * self.config.n_layer as f32).sqrt());
        let (one, zero) = (Init::Const(1.0), Init::Const(0.0));
        let mut out = vec![
            ParamSpec::new("transformer.wte.weight", &[v, c], normal)
                .f32_grad()
                .tied("lm_head.weight"),
            // OpenAI's TensorFlow code drew wpe with std 0.01; nanoGPT and Hugging
            // Face's GPT2 draw both embeddings with 0.02. We follow the latter, the
            // implementations people train and compare against (an imported
            // checkpoint brings its own values either way).
            ParamSpec::new(
                "transformer.wpe.weight",
                &[self.config.block_size, c],
                normal,
            )
            .f32_grad(),
        ];
        for l in 0..self.config.n_layer {
            let p = |s: &str| format!("transformer.h.{l}.{s}");
            out.extend([
                ParamSpec::new(p("ln_1.weight"), &[c], one).f32_grad(),
                ParamSpec::new(p("ln_1.bias"), &[c], zero).f32_grad(),
                ParamSpec::new(p("attn.c_attn.weight"), &[c, 3 * c], normal).decayed(),
                ParamSpec::new(p("attn.c_attn.bias"), &[3 * c], zero),
                ParamSpec::new(p("attn.c_proj.weight"), &[c, c], proj).decayed(),
                ParamSpec::new(p("attn.c_proj.bias"), &[c], zero),
                ParamSpec::new(p("ln_2.weight"), &[c], one).f32_grad(),
                ParamSpec::new(p("ln_2.bias"), &[c], zero).f32_grad(),
                ParamSpec::new(p("mlp.c_fc.weight"), &[c, 4 * c], normal).decayed(),
                ParamSpec::new(p("mlp.c_fc.bias"), &[4 * c], zero),
                ParamSpec::new(p("mlp.c_proj.weight"), &[4 * c, c], proj).decayed(),
                ParamSpec::new(p("mlp.c_proj.bias"), &[c], zero),
            ]);
        }
        out.extend([
            ParamSpec::new("transformer.ln_f.weight", &[c], one).f32_grad(),
            ParamSpec::new("transformer.ln_f.bias", &[c], zero).f32_grad(),
        ]);
        out
    }

    fn forward(&self, g: &mut Graph, p: &[Tensor], batch: usize, dtype: DType) -> Result<Forward> {
        self.check(batch, dtype)?;
        let (b, t, h) = (batch, self.seq, self.config.n_head);
        let attention = self.attention(dtype);
        let tokens = g.input("tokens", &[b, t], DType::U32);
        let targets = g.input("targets", &[b, t], DType::U32);
        let positions = g.positions(b, t)?; // (B, T): t of each row, or decoding's
        let (wte, wpe) = (p[0], p[1]);
        // x (B, T, C) = wte[tokens] + wpe[positions]
        let tok = g.embedding(tokens, wte)?;
        let pos = g.embedding(positions, wpe)?;
        let mut x = g.add(tok, pos)?;
        for l in 0..self.config.n_layer {
            let w = &p[2 + PER_BLOCK * l..2 + PER_BLOCK * (l + 1)];
            // x = x + proj(attention(c_attn(ln_1(x))))
            let a = g.layernorm(x, w[0], w[1])?;
            let qkv = g.linear(a, w[2], Some(w[3]))?; // (B, T, 3C)
            let y = g.causal_attention(qkv, h, attention)?; // (B, T, C)
            let y = g.linear(y, w[4], Some(w[5]))?;
            x = g.add(x, y)?;
            // x = x + c_proj(gelu(c_fc(ln_2(x))))
            let m = g.layernorm(x, w[6], w[7])?;
            let f = g.linear(m, w[8], Some(w[9]))?; // (B, T, 4C)
            let f = g.gelu(f)?;
            let f = g.linear(f, w[10], Some(w[11]))?;
            x = g.add(x, f)?;
        }
        let n = p.len();
        let xf = g.layernorm(x, p[n - 2], p[n - 1])?;
        // Tied LM head: logits (B, T, Vp) = xf wte^T; the padding columns past V are no
        // class, so they stay out of the softmax.
        let logits = g.linear_transposed(xf, wte, None)?;
        g.cross_entropy_classes(logits, targets, self.config.vocab_size)?;
        Ok(Forward {
            inputs: vec![tokens, targets],
            prediction: logits,
        })
    }

    /// Each transformer block's twelve parameters.
    fn blocks(&self) -> Vec<Vec<usize>> {
        (0..self.config.n_layer)
            .map(|l| (2 + PER_BLOCK * l..2 + PER_BLOCK * (l + 1)).collect())
            .collect()
    }
}

impl Decoder for Gpt {
    fn check_context(&self, max_len: usize) -> Result<()> {
        let why = "GPT-2 has no position embedding past it";
        super::check_block_size(max_len, self.config.block_size, why)
    }

    fn with_seq(&self, seq: usize) -> Box<dyn Decoder> {
        Box::new(Gpt::new(self.config.clone(), seq))
    }
}
