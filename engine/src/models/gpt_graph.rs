//! GPT-2 written once, as a forward pass on the graph: token + learned position
//! embeddings, pre-LN blocks (causal self-attention, GELU MLP, residual adds), a final
//! layer norm and an LM head tied to the token embedding, cross-entropy over the
//! vocabulary. Backward and the update are derived and compiled into the plan that
//! [`crate::models::gpt::Gpt`] replays; the parameters are `gpt::param_specs`' table.
//!
//! Shapes: B batch, T sequence, C = n_embd, V vocabulary.

use crate::graph::{Graph, Tensor};
use crate::models::gpt::{GptConfig, GptTraining, ParamSpec};
use crate::{DType, Result};

/// The recorded model: its graph and the tensors the caller binds or reads.
pub(crate) struct Recorded {
    pub graph: Graph,
    /// (B, T) u32 each.
    pub tokens: Tensor,
    pub targets: Tensor,
    pub positions: Tensor,
    /// (B, T, V), kept readable after forward (predictions).
    pub logits: Tensor,
}

/// Records the forward pass over `specs`' parameters, declared in their order.
pub(crate) fn record(
    config: &GptConfig,
    training: &GptTraining,
    specs: &[ParamSpec],
) -> Result<Recorded> {
    let (b, t, h) = (training.batch, training.seq, config.n_head);
    let act = training.precision.dtype();
    let mut g = Graph::new();
    let tokens = g.input("tokens", &[b, t], DType::U32);
    let targets = g.input("targets", &[b, t], DType::U32);
    let positions = g.input("positions", &[b, t], DType::U32);
    let mut p = vec![];
    for s in specs {
        let grad = if s.f32_grad { DType::F32 } else { act };
        p.push(g.param(&s.name, &s.shape, act, grad, s.decay)?);
    }
    let (wte, wpe) = (p[0], p[1]);
    // x (B, T, C) = wte[tokens] + wpe[positions]
    let tok = g.embedding(tokens, wte)?;
    let pos = g.embedding(positions, wpe)?;
    let mut x = g.add(tok, pos)?;
    for l in 0..config.n_layer {
        let w = &p[2 + 12 * l..2 + 12 * (l + 1)];
        // x = x + proj(attention(c_attn(ln_1(x))))
        let a = g.layernorm(x, w[0], w[1])?;
        let qkv = g.linear(a, w[2], Some(w[3]))?; // (B, T, 3C)
        let y = g.causal_attention(qkv, h, training.attention)?; // (B, T, C)
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
    // Tied LM head: logits (B, T, V) = xf wte^T.
    let logits = g.linear_transposed(xf, wte, None)?;
    g.output(logits)?;
    g.cross_entropy(logits, targets)?;
    Ok(Recorded {
        graph: g,
        tokens,
        targets,
        positions,
        logits,
    })
}
