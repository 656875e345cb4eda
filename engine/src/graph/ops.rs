//! Each op's forward launches and its backward rule, side by side.
//!
//! `forward` emits an op's launches and returns what its backward needs besides the
//! operands (norm statistics, attention heads). `backward` emits the launches that
//! turn the output's gradient into the operands' gradients, asking [`Grads`] where
//! each contribution goes: a kernel that can add into its destination (GEMM with
//! beta 1, the norm and embedding weight kernels) accumulates there; one that can
//! only overwrite writes to scratch that is then added. Shapes are in the comments;
//! M rows, K inputs, N outputs, B batch, T sequence, C channels, H heads, D = C / H.

use super::autodiff::Grads;
use super::plan::Emitter;
use super::{Attention, Op};
use crate::device::kernel::dropout_seed;
use crate::{BinaryOp, Buffer, DType, Kernel, Matmul, Result};

/// What an op's backward reads besides its operands and output.
pub(super) enum Saved {
    None,
    /// Per-row f32 mean and 1/std.
    LayerNorm {
        mean: Buffer,
        rstd: Buffer,
    },
    /// Heads (B*H, T, D) and, fused, one f32 log-sum-exp per row; straightforward,
    /// the (B*H, T, T) probabilities.
    Attention {
        q: Buffer,
        k: Buffer,
        v: Buffer,
        yh: Buffer,
        att: Buffer,
    },
    /// Per-row f32 log-sum-exp of the logits.
    CrossEntropy {
        lse: Buffer,
    },
    /// Per-row f32 1/rms.
    RmsNorm {
        rstd: Buffer,
    },
}

pub(super) fn forward(op: &Op, e: &mut Emitter) -> Result<Saved> {
    let g = e.g;
    match *op {
        Op::Embedding { tokens, table, out } => {
            // out (..., C) = table (V, C) [tokens (...)]
            let o = e.define(out);
            e.launch(Kernel::Embedding {
                tokens: e.val(tokens),
                table: e.val(table),
                out: o,
                dim: g.t(out).cols(),
            })?;
            Ok(Saved::None)
        }
        Op::Linear {
            x,
            w,
            b,
            out,
            trans_w,
        } => {
            // out (M, N) = x (M, K) w (K, N) [or w^T, w (N, K)] + b (N)
            let (m, k, n) = (g.t(x).rows(), g.t(x).cols(), g.t(out).cols());
            let o = e.define(out);
            let mut mm = Matmul::new(e.val(x), e.val(w), o, m, n, k).transpose(false, trans_w);
            if let Some(b) = b {
                mm = mm.with_bias(e.val(b));
            }
            e.launch(Kernel::Matmul(mm))?;
            Ok(Saved::None)
        }
        Op::LayerNorm {
            x,
            weight,
            bias,
            out,
            eps,
        } => {
            // out (M, C) = (x - mean) * rstd * weight + bias; mean, rstd (M) f32 saved.
            let rows = g.t(x).rows();
            let (mean, rstd) = (e.scratch(DType::F32, rows), e.scratch(DType::F32, rows));
            let o = e.define(out);
            e.launch(Kernel::LayerNorm {
                x: e.val(x),
                weight: e.val(weight),
                bias: e.val(bias),
                out: o,
                mean,
                rstd,
                cols: g.t(x).cols(),
                eps,
            })?;
            Ok(Saved::LayerNorm { mean, rstd })
        }
        Op::Gelu { x, out } => {
            let o = e.define(out);
            e.launch(Kernel::Gelu {
                x: e.val(x),
                out: o,
            })?;
            Ok(Saved::None)
        }
        Op::Activation { kind, x, out } => {
            // out = f(x), elementwise; backward reads x.
            let o = e.define(out);
            e.launch(Kernel::Activation {
                kind,
                x: e.val(x),
                out: o,
            })?;
            Ok(Saved::None)
        }
        Op::Softmax { x, out } => {
            // out (M, C) = softmax over each row; backward reads out. stats (2M) scratch.
            let stats = e.scratch(DType::F32, 2 * g.t(x).rows());
            let o = e.define(out);
            e.launch(Kernel::Softmax {
                x: e.val(x),
                out: o,
                stats,
                cols: g.t(x).cols(),
                scale: 1.0,
                causal: false,
            })?;
            Ok(Saved::None)
        }
        Op::Dropout { x, out, p } => {
            // out = x * mask / (1 - p); the seed (from the plan's random state and this
            // op's index) is set per step, and backward recomputes the mask from it.
            let o = e.define(out);
            e.random.push((e.launches.len(), e.op));
            e.launch(Kernel::Dropout {
                x: e.val(x),
                out: o,
                p,
                seed: dropout_seed(0, e.op),
            })?;
            Ok(Saved::None)
        }
        Op::Add { a, b, out } => {
            let o = e.define(out);
            e.launch(Kernel::Binary {
                op: BinaryOp::Add,
                a: e.val(a),
                b: e.val(b),
                out: o,
            })?;
            Ok(Saved::None)
        }
        Op::CausalAttention {
            qkv,
            out,
            heads: h,
            mode,
        } => {
            let s = &g.t(qkv).shape;
            let (b, t, c) = (s[0], s[1], s[2] / 3);
            let (d, act) = (c / h, g.t(qkv).dtype);
            let src = e.val(qkv);
            // q, k, v (B, H, T, D) out of the columns of qkv (B, T, 3C).
            let mut qkv_heads = [src; 3];
            for (i, dst) in qkv_heads.iter_mut().enumerate() {
                *dst = e.scratch(act, b * t * c);
                e.launch(Kernel::SplitHeads {
                    src,
                    dst: *dst,
                    seq: t,
                    heads: h,
                    width: 3 * c,
                    offset: i * c,
                })?;
            }
            let [q, k, v] = qkv_heads;
            let yh = e.scratch(act, b * t * c);
            let scale = 1.0 / (d as f32).sqrt();
            let att = match mode {
                Attention::Straightforward => {
                    // scores (B*H, T, T) = q k^T / sqrt(D), scaled inside the GEMM (in
                    // f32) so a large dot product cannot overflow 16-bit scores; the
                    // causal softmax gives att; yh = att v.
                    let scores = e.scratch(act, b * h * t * t);
                    let att = e.scratch(act, b * h * t * t);
                    let stats = e.scratch(DType::F32, 2 * b * h * t);
                    e.launch(Kernel::Matmul(
                        Matmul::new(q, k, scores, t, t, d)
                            .transpose(false, true)
                            .batched(b * h, t * d, t * d, t * t)
                            .scaled(scale, 0.0),
                    ))?;
                    e.launch(Kernel::Softmax {
                        x: scores,
                        out: att,
                        stats,
                        cols: t,
                        scale: 1.0,
                        causal: true,
                    })?;
                    e.launch(Kernel::Matmul(Matmul::new(att, v, yh, t, d, t).batched(
                        b * h,
                        t * t,
                        t * d,
                        t * d,
                    )))?;
                    att
                }
                Attention::Fused => {
                    // Tile by tile; saves one f32 log-sum-exp per (head, row).
                    let lse = e.scratch(DType::F32, b * h * t);
                    e.launch(Kernel::Attention {
                        q,
                        k,
                        v,
                        out: yh,
                        lse,
                        batch_heads: b * h,
                        seq: t,
                        dim: d,
                        scale,
                        causal: true,
                    })?;
                    lse
                }
            };
            // out (B, T, C) <- yh (B, H, T, D)
            let o = e.define(out);
            e.launch(Kernel::MergeHeads {
                src: yh,
                dst: o,
                seq: t,
                heads: h,
                width: c,
                offset: 0,
            })?;
            Ok(Saved::Attention { q, k, v, yh, att })
        }
        Op::RmsNorm {
            x,
            weight,
            out,
            eps,
        } => {
            // out (M, C) = x * rstd * weight; rstd (M) f32 saved.
            let rstd = e.scratch(DType::F32, g.t(x).rows());
            let o = e.define(out);
            e.launch(Kernel::RmsNorm {
                x: e.val(x),
                weight: e.val(weight),
                out: o,
                rstd,
                cols: g.t(x).cols(),
                eps,
            })?;
            Ok(Saved::RmsNorm { rstd })
        }
        Op::Rope {
            x,
            out,
            heads,
            theta,
        } => {
            // out (B, T, C) = x rotated per head (D = C / H), row (b, t) by angles of t.
            let o = e.define(out);
            e.launch(rope(g, x, heads, theta, e.val(x), o, false))?;
            Ok(Saved::None)
        }
        Op::SwiGlu { gate, up, out } => {
            // out = silu(gate) * up, elementwise.
            let o = e.define(out);
            e.launch(Kernel::SwiGlu {
                gate: e.val(gate),
                up: e.val(up),
                out: o,
            })?;
            Ok(Saved::None)
        }
        Op::CrossEntropy {
            logits,
            targets,
            losses,
        } => {
            // losses (M) = logsumexp(logits (M, V)) - logits[targets]; lse (M) saved.
            let lse = e.scratch(DType::F32, g.t(logits).rows());
            let l = e.define(losses);
            e.launch(Kernel::CrossEntropy {
                logits: e.val(logits),
                targets: e.val(targets),
                losses: l,
                lse,
                vocab: g.t(logits).cols(),
            })?;
            Ok(Saved::CrossEntropy { lse })
        }
        Op::Mse {
            pred,
            target,
            losses,
        } => {
            // losses (M) = mean over C of (pred (M, C) - target (M, C))^2
            let l = e.define(losses);
            e.launch(Kernel::MseLoss {
                pred: e.val(pred),
                target: e.val(target),
                losses: l,
                cols: g.t(pred).cols(),
            })?;
            Ok(Saved::None)
        }
    }
}

/// Emits `op`'s backward. `dout` is the output's gradient (unused by the loss ops,
/// cross-entropy and MSE, whose gradient is the loss seed, set per step).
pub(super) fn backward(
    op: &Op,
    saved: &Saved,
    dout: Option<Buffer>,
    e: &mut Emitter,
    gr: &mut Grads,
) -> Result<()> {
    let g = e.g;
    let dout = || dout.expect("ops other than the loss are reached with a gradient");
    match (op, saved) {
        (&Op::Embedding { tokens, table, out }, _) => {
            // dtable[tokens[r]] += dout[r]  (f32, accumulated)
            let dtable = gr.accumulating(e, table)?;
            e.launch(Kernel::EmbeddingBackward {
                tokens: e.val(tokens),
                dout: dout(),
                dtable,
                dim: g.t(out).cols(),
            })
        }
        (
            &Op::Linear {
                x,
                w,
                b,
                out,
                trans_w,
            },
            _,
        ) => {
            let (m, k, n) = (g.t(x).rows(), g.t(x).cols(), g.t(out).cols());
            let dout = dout();
            if gr.needs(w) {
                let (dw, beta) = gr.gemm(e, w);
                let mm = if trans_w {
                    // dW (N, K) = dout^T (N, M) x (M, K)
                    Matmul::new(dout, e.val(x), dw, n, k, m)
                } else {
                    // dW (K, N) = x^T (K, M) dout (M, N)
                    Matmul::new(e.val(x), dout, dw, k, n, m)
                };
                e.launch(Kernel::Matmul(mm.transpose(true, false).scaled(1.0, beta)))?;
            }
            if let Some(b) = b.filter(|&b| gr.needs(b)) {
                // db (N) = 1^T (1, M) dout (M, N)
                let ones = e.ones(dout.dtype, m);
                let (db, beta) = gr.gemm(e, b);
                e.launch(Kernel::Matmul(
                    Matmul::new(ones, dout, db, 1, n, m).scaled(1.0, beta),
                ))?;
            }
            if gr.needs(x) {
                // dx (M, K) = dout (M, N) w^T (N, K) [or w (N, K) when stored transposed]
                let (dx, beta) = gr.gemm(e, x);
                e.launch(Kernel::Matmul(
                    Matmul::new(dout, e.val(w), dx, m, k, n)
                        .transpose(false, !trans_w)
                        .scaled(1.0, beta),
                ))?;
            }
            Ok(())
        }
        (
            &Op::LayerNorm {
                x, weight, bias, ..
            },
            &Saved::LayerNorm { mean, rstd },
        ) => {
            // dx (M, C) overwritten; dweight, dbias (C) f32 accumulated.
            let dweight = gr.accumulating(e, weight)?;
            let dbias = gr.accumulating(e, bias)?;
            let dx = gr.overwriting(e, x)?;
            e.launch(Kernel::LayerNormBackward {
                x: e.val(x),
                weight: e.val(weight),
                mean,
                rstd,
                dout: dout(),
                dx: dx.buf,
                dweight,
                dbias,
                cols: g.t(x).cols(),
            })?;
            gr.finish(e, dx)
        }
        (&Op::Gelu { x, .. }, _) => {
            // dx = dout * gelu'(x)
            if !gr.needs(x) {
                return Ok(());
            }
            let dx = gr.overwriting(e, x)?;
            e.launch(Kernel::GeluBackward {
                x: e.val(x),
                dout: dout(),
                dx: dx.buf,
            })?;
            gr.finish(e, dx)
        }
        (&Op::Activation { kind, x, .. }, _) => {
            // dx = dout * f'(x)
            if !gr.needs(x) {
                return Ok(());
            }
            let dx = gr.overwriting(e, x)?;
            e.launch(Kernel::ActivationBackward {
                kind,
                x: e.val(x),
                dout: dout(),
                dx: dx.buf,
            })?;
            gr.finish(e, dx)
        }
        (&Op::Softmax { x, out }, _) => {
            // dx (M, C) = p * (dout - sum_j p_j dout_j) per row, p = out; stats scratch.
            if !gr.needs(x) {
                return Ok(());
            }
            let stats = e.scratch(DType::F32, 2 * g.t(x).rows());
            let dx = gr.overwriting(e, x)?;
            e.launch(Kernel::SoftmaxBackward {
                p: e.val(out),
                dout: dout(),
                dx: dx.buf,
                stats,
                cols: g.t(x).cols(),
                scale: 1.0,
            })?;
            gr.finish(e, dx)
        }
        (&Op::Dropout { x, p, .. }, _) => {
            // dx = dout * mask / (1 - p), the forward's mask recomputed from its seed.
            if !gr.needs(x) {
                return Ok(());
            }
            let dx = gr.overwriting(e, x)?;
            e.random.push((e.launches.len(), e.op));
            e.launch(Kernel::DropoutBackward {
                dout: dout(),
                dx: dx.buf,
                p,
                seed: dropout_seed(0, e.op),
            })?;
            gr.finish(e, dx)
        }
        (&Op::Add { a, b, out: add_out }, _) => {
            // da += dout, db += dout. When a and b are one tensor it gets 2 dout.
            let dout = dout();
            if a == b {
                if gr.needs(a) {
                    let twice = e.scratch(dout.dtype, dout.len);
                    e.launch(Kernel::Scale {
                        alpha: 2.0,
                        x: dout,
                        out: twice,
                    })?;
                    gr.add_from(e, a, twice, true)?;
                }
                return Ok(());
            }
            // dout is read by nothing after this op (unless it is itself an alias), so
            // one operand may take it over and the other read it too (Grads::alias),
            // as a hand-written backward passes one residual gradient along.
            let mut owner = None;
            for t in [a, b] {
                if !gr.needs(t) {
                    continue;
                }
                if let Some(o) = owner {
                    if gr.alias(t, dout, o) {
                        continue;
                    }
                }
                let donate = owner.is_none() && gr.donatable(add_out);
                if gr.add_from(e, t, dout, donate)? {
                    owner = Some(t);
                }
            }
            Ok(())
        }
        (
            &Op::CausalAttention {
                qkv,
                heads: h,
                mode,
                ..
            },
            &Saved::Attention { q, k, v, yh, att },
        ) => {
            if !gr.needs(qkv) {
                return Ok(());
            }
            let s = &g.t(qkv).shape;
            let (b, t, c) = (s[0], s[1], s[2] / 3);
            let (d, act, bh) = (c / h, g.t(qkv).dtype, b * h);
            let scale = 1.0 / (d as f32).sqrt();
            // dyh (B, H, T, D) <- dout (B, T, C)
            let dyh = e.scratch(act, b * t * c);
            e.launch(Kernel::SplitHeads {
                src: dout(),
                dst: dyh,
                seq: t,
                heads: h,
                width: c,
                offset: 0,
            })?;
            let (dq, dk, dv) = (
                e.scratch(act, b * t * c),
                e.scratch(act, b * t * c),
                e.scratch(act, b * t * c),
            );
            match mode {
                Attention::Straightforward => {
                    // datt = dyh v^T; dv = att^T dyh; dscores = softmax backward (with
                    // the 1/sqrt(D) of the forward GEMM); dq = dscores k; dk = dscores^T q.
                    let datt = e.scratch(act, bh * t * t);
                    let dscores = e.scratch(act, bh * t * t);
                    let stats = e.scratch(DType::F32, 2 * bh * t);
                    e.launch(Kernel::Matmul(
                        Matmul::new(dyh, v, datt, t, t, d)
                            .transpose(false, true)
                            .batched(bh, t * d, t * d, t * t),
                    ))?;
                    e.launch(Kernel::Matmul(
                        Matmul::new(att, dyh, dv, t, d, t)
                            .transpose(true, false)
                            .batched(bh, t * t, t * d, t * d),
                    ))?;
                    e.launch(Kernel::SoftmaxBackward {
                        p: att,
                        dout: datt,
                        dx: dscores,
                        stats,
                        cols: t,
                        scale,
                    })?;
                    e.launch(Kernel::Matmul(
                        Matmul::new(dscores, k, dq, t, d, t).batched(bh, t * t, t * d, t * d),
                    ))?;
                    e.launch(Kernel::Matmul(
                        Matmul::new(dscores, q, dk, t, d, t)
                            .transpose(true, false)
                            .batched(bh, t * t, t * d, t * d),
                    ))?;
                }
                Attention::Fused => {
                    // Recomputes the probabilities from q, k and the saved lse.
                    e.launch(Kernel::AttentionBackward {
                        q,
                        k,
                        v,
                        out: yh,
                        dout: dyh,
                        lse: att,
                        dq,
                        dk,
                        dv,
                        batch_heads: bh,
                        seq: t,
                        dim: d,
                        scale,
                        causal: true,
                    })?;
                }
            }
            // dqkv (B, T, 3C) <- dq, dk, dv (B, H, T, D): the three merges write every
            // column, so together they overwrite.
            let dqkv = gr.overwriting(e, qkv)?;
            for (i, src) in [dq, dk, dv].into_iter().enumerate() {
                e.launch(Kernel::MergeHeads {
                    src,
                    dst: dqkv.buf,
                    seq: t,
                    heads: h,
                    width: 3 * c,
                    offset: i * c,
                })?;
            }
            gr.finish(e, dqkv)
        }
        (&Op::RmsNorm { x, weight, .. }, &Saved::RmsNorm { rstd }) => {
            // dx (M, C) overwritten; dweight (C) f32 accumulated.
            let dweight = gr.accumulating(e, weight)?;
            let dx = gr.overwriting(e, x)?;
            e.launch(Kernel::RmsNormBackward {
                x: e.val(x),
                weight: e.val(weight),
                rstd,
                dout: dout(),
                dx: dx.buf,
                dweight,
                cols: g.t(x).cols(),
            })?;
            gr.finish(e, dx)
        }
        (
            &Op::Rope {
                x, heads, theta, ..
            },
            _,
        ) => {
            // dx = dout rotated back: a rotation's inverse is its transpose.
            if !gr.needs(x) {
                return Ok(());
            }
            let dx = gr.overwriting(e, x)?;
            e.launch(rope(g, x, heads, theta, dout(), dx.buf, true))?;
            gr.finish(e, dx)
        }
        (&Op::SwiGlu { gate, up, .. }, _) => {
            // dgate = dout * up * silu'(gate), dup = dout * silu(gate): one launch. When
            // gate and up are one tensor the second destination is scratch added after.
            if !gr.needs(gate) && !gr.needs(up) {
                return Ok(());
            }
            let dgate = gr.overwriting(e, gate)?;
            let dup = gr.overwriting(e, up)?;
            e.launch(Kernel::SwiGluBackward {
                gate: e.val(gate),
                up: e.val(up),
                dout: dout(),
                dgate: dgate.buf,
                dup: dup.buf,
            })?;
            gr.finish(e, dgate)?;
            gr.finish(e, dup)
        }
        (
            &Op::CrossEntropy {
                logits, targets, ..
            },
            &Saved::CrossEntropy { lse },
        ) => {
            // dlogits (M, V) = (softmax(logits) - onehot(targets)) * seed, where the seed
            // (loss scale x d loss / d losses_r) is set per step.
            if !gr.needs(logits) {
                return Ok(());
            }
            let dlogits = gr.overwriting(e, logits)?;
            e.seeds.push(e.launches.len());
            e.launch(Kernel::CrossEntropyBackward {
                logits: e.val(logits),
                targets: e.val(targets),
                lse,
                dlogits: dlogits.buf,
                vocab: g.t(logits).cols(),
                scale: 1.0,
            })?;
            gr.finish(e, dlogits)
        }
        (&Op::Mse { pred, target, .. }, _) => {
            // dpred (M, C) = 2 (pred - target) / C * seed, the seed (loss scale x
            // d loss / d losses_r) set per step.
            if !gr.needs(pred) {
                return Ok(());
            }
            let dpred = gr.overwriting(e, pred)?;
            e.seeds.push(e.launches.len());
            e.launch(Kernel::MseBackward {
                pred: e.val(pred),
                target: e.val(target),
                dpred: dpred.buf,
                cols: g.t(pred).cols(),
                scale: 1.0,
            })?;
            gr.finish(e, dpred)
        }
        _ => unreachable!("forward saves what each op's backward reads"),
    }
}

/// The rotary-embedding launch of `x` (B, T, C) in `heads` heads, `src` to `dst`.
fn rope(
    g: &super::Graph,
    x: super::Tensor,
    heads: usize,
    theta: f32,
    src: Buffer,
    dst: Buffer,
    inverse: bool,
) -> Kernel {
    let s = &g.t(x).shape;
    Kernel::Rope {
        x: src,
        out: dst,
        cols: s[2],
        dim: s[2] / heads,
        seq: s[1],
        theta,
        inverse,
    }
}
