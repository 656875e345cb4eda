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
use super::{Attention, Op, Tensor};
use crate::kernels::dropout_seed;
use crate::kernels::{
    self, Activation, ActivationBackward, AttentionBackward, Binary, CacheWrite, CachedAttention,
    CrossEntropy, CrossEntropyBackward, Dropout, DropoutBackward, Embedding, EmbeddingBackward,
    Gelu, GeluBackward, LayerNorm, LayerNormBackward, MergeHeads, MseBackward, MseLoss, RmsNorm,
    RmsNormBackward, Rope, RopeAt, Scale, Softmax, SoftmaxBackward, SplitHeads, SwiGlu,
    SwiGluBackward,
};
use crate::{BinaryOp, Buffer, DType, Kernel, Matmul, Result, RopeFreqs};

/// What an op's backward reads besides its operands and output.
pub(super) enum Saved {
    None,
    /// Per-row f32 mean and 1/std.
    LayerNorm {
        mean: Buffer,
        rstd: Buffer,
    },
    /// Heads: q and yh (B*H, T, D), k and v (B*KV, T, D); fused, one f32 log-sum-exp
    /// per query row; straightforward, the (B*H, T, T) probabilities.
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
            e.launch(Kernel::Embedding(Embedding {
                tokens: e.val(tokens),
                table: e.val(table),
                out: o,
                dim: g.t(out).cols(),
            }))?;
            Ok(Saved::None)
        }
        Op::Linear {
            x,
            w,
            b,
            out,
            trans_w,
            scale,
            acc,
        } => {
            // out (M, N) = scale · x (M, K) w (K, N) [or w^T, w (N, K)] + b (N) [+ acc,
            // written over acc's buffer: beta 1]
            let (m, k, n) = (g.t(x).rows(), g.t(x).cols(), g.t(out).cols());
            let (o, beta) = match acc {
                Some(acc) => (e.define_over(out, acc)?, 1.0),
                None => (e.define(out), 0.0),
            };
            let mut mm = Matmul::new(e.val(x), e.val(w), o, m, n, k)
                .transpose(false, trans_w)
                .scaled(scale, beta);
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
            e.launch(Kernel::LayerNorm(LayerNorm {
                x: e.val(x),
                weight: e.val(weight),
                bias: e.val(bias),
                out: o,
                mean,
                rstd,
                cols: g.t(x).cols(),
                eps,
            }))?;
            Ok(Saved::LayerNorm { mean, rstd })
        }
        Op::Gelu { x, out } => {
            let o = e.define(out);
            e.launch(Kernel::Gelu(Gelu {
                x: e.val(x),
                out: o,
            }))?;
            Ok(Saved::None)
        }
        Op::Activation { kind, x, out } => {
            // out = f(x), elementwise; backward reads x.
            let o = e.define(out);
            e.launch(Kernel::Activation(Activation {
                kind,
                x: e.val(x),
                out: o,
            }))?;
            Ok(Saved::None)
        }
        Op::Softmax { x, out } => {
            // out (M, C) = softmax over each row; backward reads out. stats (2M) scratch.
            let stats = e.scratch(DType::F32, 2 * g.t(x).rows());
            let o = e.define(out);
            e.launch(Kernel::Softmax(Softmax {
                x: e.val(x),
                out: o,
                stats,
                cols: g.t(x).cols(),
                scale: 1.0,
                causal: false,
            }))?;
            Ok(Saved::None)
        }
        Op::Dropout { x, out, p } => {
            // out = x * mask / (1 - p); the seed (from the plan's random state and this
            // op's index) is set per step, and backward recomputes the mask from it.
            let o = e.define(out);
            e.random.push((e.launches.len(), e.op));
            e.launch(Kernel::Dropout(Dropout {
                x: e.val(x),
                out: o,
                p,
                seed: dropout_seed(0, e.op),
            }))?;
            Ok(Saved::None)
        }
        Op::Add { a, b, out } => {
            let o = e.define(out);
            e.launch(Kernel::Binary(Binary {
                op: BinaryOp::Add,
                a: e.val(a),
                b: e.val(b),
                out: o,
            }))?;
            Ok(Saved::None)
        }
        Op::CausalAttention {
            qkv,
            out,
            heads: h,
            mode,
            documents,
        } => {
            let s = &g.t(qkv).shape;
            let (b, t, c) = (s[0], s[1], s[2] / 3);
            let (d, act) = (c / h, g.t(qkv).dtype);
            let src = e.val(qkv);
            // q, k, v (B, H, T, D) out of the columns of qkv (B, T, 3C).
            let mut qkv_heads = [src; 3];
            for (i, dst) in qkv_heads.iter_mut().enumerate() {
                *dst = e.scratch(act, b * t * c);
                e.launch(Kernel::SplitHeads(SplitHeads {
                    src,
                    dst: *dst,
                    seq: t,
                    heads: h,
                    width: 3 * c,
                    offset: i * c,
                }))?;
            }
            let [q, k, v] = qkv_heads;
            let yh = e.scratch(act, b * t * c);
            let docs = documents.map(|x| e.val(x));
            let heads = Heads {
                b,
                t,
                d,
                h,
                kv: h,
                docs,
            };
            let att = attend(e, mode, heads, act, [q, k, v], yh)?;
            // out (B, T, C) <- yh (B, H, T, D)
            let o = e.define(out);
            e.launch(Kernel::MergeHeads(MergeHeads {
                src: yh,
                dst: o,
                seq: t,
                heads: h,
                width: c,
                offset: 0,
            }))?;
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
            e.launch(Kernel::RmsNorm(RmsNorm {
                x: e.val(x),
                weight: e.val(weight),
                out: o,
                rstd,
                cols: g.t(x).cols(),
                eps,
            }))?;
            Ok(Saved::RmsNorm { rstd })
        }
        Op::Rope {
            x,
            out,
            heads,
            freqs,
            positions,
        } => {
            // out (B, T, C) = x rotated per head (D = C / H), row (b, t) by angles of t;
            // decoding or packed, row r by angles of positions[r].
            let o = e.define(out);
            let p = positions.map(|p| e.val(p));
            e.launch(rope(g, x, heads, freqs, p, [e.val(x), o], false))?;
            Ok(Saved::None)
        }
        Op::SwiGlu { gate, up, out } => {
            // out = silu(gate) * up, elementwise.
            let o = e.define(out);
            e.launch(Kernel::SwiGlu(SwiGlu {
                gate: e.val(gate),
                up: e.val(up),
                out: o,
            }))?;
            Ok(Saved::None)
        }
        Op::GroupedAttention {
            q,
            k,
            v,
            out,
            heads: h,
            kv_heads: kv,
            mode,
            documents,
        } => {
            let s = &g.t(q).shape;
            let (b, t, d, act) = (s[0], s[1], s[2] / h, g.t(q).dtype);
            // q (B, H, T, D) <- (B, T, H*D); k, v (B, KV, T, D) <- (B, T, KV*D).
            let mut split = |x: Tensor, n: usize| -> Result<Buffer> {
                let dst = e.scratch(act, b * n * t * d);
                e.launch(Kernel::SplitHeads(SplitHeads {
                    src: e.val(x),
                    dst,
                    seq: t,
                    heads: n,
                    width: n * d,
                    offset: 0,
                }))?;
                Ok(dst)
            };
            let (qh, kh, vh) = (split(q, h)?, split(k, kv)?, split(v, kv)?);
            let yh = e.scratch(act, b * h * t * d);
            let docs = documents.map(|x| e.val(x));
            let heads = Heads {
                b,
                t,
                d,
                h,
                kv,
                docs,
            };
            let att = attend(e, mode, heads, act, [qh, kh, vh], yh)?;
            // out (B, T, H*D) <- yh (B, H, T, D)
            let o = e.define(out);
            e.launch(Kernel::MergeHeads(MergeHeads {
                src: yh,
                dst: o,
                seq: t,
                heads: h,
                width: h * d,
                offset: 0,
            }))?;
            Ok(Saved::Attention {
                q: qh,
                k: kh,
                v: vh,
                yh,
                att,
            })
        }
        Op::CachedAttention {
            q,
            k,
            v,
            offsets,
            k_cache,
            v_cache,
            positions,
            out,
            heads: h,
            kv_heads: kv,
        } => {
            // k, v rows -> caches (KV, max_len, D) at positions; then out (1, R, H*D):
            // row r of q against cache rows 0..=positions[r].
            let (d, max_len) = (g.t(out).cols() / h, g.t(k_cache).shape[1]);
            let pos = e.val(positions);
            for (src, offset, cache) in [(k, offsets[1], k_cache), (v, offsets[2], v_cache)] {
                e.launch(Kernel::CacheWrite(CacheWrite {
                    src: e.val(src),
                    cache: e.val(cache),
                    positions: pos,
                    heads: kv,
                    dim: d,
                    width: g.t(src).cols(),
                    offset,
                    max_len,
                }))?;
            }
            let o = e.define(out);
            e.launch(Kernel::CachedAttention(CachedAttention {
                q: e.val(q),
                k_cache: e.val(k_cache),
                v_cache: e.val(v_cache),
                positions: pos,
                out: o,
                heads: h,
                group: h / kv,
                dim: d,
                width: g.t(q).cols(),
                offset: offsets[0],
                max_len,
                scale: 1.0 / (d as f32).sqrt(),
            }))?;
            Ok(Saved::None)
        }
        Op::LastRow { x, out } => {
            // out (1, C) = x (M, C) [M - 1], a gather of one row by a constant index.
            let index = e.pinned(DType::U32, 1);
            let last = g.t(x).rows().saturating_sub(1) as u32;
            e.constants.push((index, crate::HostData::U32(vec![last])));
            let o = e.define(out);
            e.launch(Kernel::Embedding(Embedding {
                tokens: index,
                table: e.val(x),
                out: o,
                dim: g.t(x).cols(),
            }))?;
            Ok(Saved::None)
        }
        Op::CrossEntropy {
            logits,
            targets,
            losses,
            classes,
        } => {
            // losses (M) = logsumexp(logits (M, V)) - logits[targets]; lse (M) saved.
            let lse = e.scratch(DType::F32, g.t(logits).rows());
            let l = e.define(losses);
            e.launch(Kernel::CrossEntropy(CrossEntropy {
                logits: e.val(logits),
                targets: e.val(targets),
                losses: l,
                lse,
                vocab: g.t(logits).cols(),
                classes,
            }))?;
            Ok(Saved::CrossEntropy { lse })
        }
        Op::Mse {
            pred,
            target,
            losses,
        } => {
            // losses (M) = mean over C of (pred (M, C) - target (M, C))^2
            let l = e.define(losses);
            e.launch(Kernel::MseLoss(MseLoss {
                pred: e.val(pred),
                target: e.val(target),
                losses: l,
                cols: g.t(pred).cols(),
            }))?;
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
            e.launch(Kernel::EmbeddingBackward(EmbeddingBackward {
                tokens: e.val(tokens),
                dout: dout(),
                dtable,
                dim: g.t(out).cols(),
            }))
        }
        (
            &Op::Linear {
                x,
                w,
                b,
                out,
                trans_w,
                scale,
                acc,
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
                e.launch(Kernel::Matmul(
                    mm.transpose(true, false).scaled(scale, beta),
                ))?;
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
                        .scaled(scale, beta),
                ))?;
            }
            if let Some(acc) = acc.filter(|&a| gr.needs(a)) {
                // dacc = dout, handed over after the reads above (acc is read by this op
                // alone, so its gradient is complete here), as an add hands its on.
                let donate = gr.donatable(out);
                gr.add_from(e, acc, dout, donate)?;
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
            e.launch(Kernel::LayerNormBackward(LayerNormBackward {
                x: e.val(x),
                weight: e.val(weight),
                mean,
                rstd,
                dout: dout(),
                dx: dx.buf,
                dweight,
                dbias,
                cols: g.t(x).cols(),
            }))?;
            gr.finish(e, dx)
        }
        (&Op::Gelu { x, .. }, _) => {
            // dx = dout * gelu'(x)
            if !gr.needs(x) {
                return Ok(());
            }
            let dx = gr.overwriting(e, x)?;
            e.launch(Kernel::GeluBackward(GeluBackward {
                x: e.val(x),
                dout: dout(),
                dx: dx.buf,
            }))?;
            gr.finish(e, dx)
        }
        (&Op::Activation { kind, x, .. }, _) => {
            // dx = dout * f'(x)
            if !gr.needs(x) {
                return Ok(());
            }
            let dx = gr.overwriting(e, x)?;
            e.launch(Kernel::ActivationBackward(ActivationBackward {
                kind,
                x: e.val(x),
                dout: dout(),
                dx: dx.buf,
            }))?;
            gr.finish(e, dx)
        }
        (&Op::Softmax { x, out }, _) => {
            // dx (M, C) = p * (dout - sum_j p_j dout_j) per row, p = out; stats scratch.
            if !gr.needs(x) {
                return Ok(());
            }
            let stats = e.scratch(DType::F32, 2 * g.t(x).rows());
            let dx = gr.overwriting(e, x)?;
            e.launch(Kernel::SoftmaxBackward(SoftmaxBackward {
                p: e.val(out),
                dout: dout(),
                dx: dx.buf,
                stats,
                cols: g.t(x).cols(),
                scale: 1.0,
            }))?;
            gr.finish(e, dx)
        }
        (&Op::Dropout { x, p, .. }, _) => {
            // dx = dout * mask / (1 - p), the forward's mask recomputed from its seed.
            if !gr.needs(x) {
                return Ok(());
            }
            let dx = gr.overwriting(e, x)?;
            e.random.push((e.launches.len(), e.op));
            e.launch(Kernel::DropoutBackward(DropoutBackward {
                dout: dout(),
                dx: dx.buf,
                p,
                seed: dropout_seed(0, e.op),
            }))?;
            gr.finish(e, dx)
        }
        (&Op::Add { a, b, out: add_out }, _) => {
            // da += dout, db += dout. When a and b are one tensor it gets 2 dout.
            let dout = dout();
            if a == b {
                if gr.needs(a) {
                    let twice = e.scratch(dout.dtype, dout.len);
                    e.launch(Kernel::Scale(Scale {
                        alpha: 2.0,
                        x: dout,
                        out: twice,
                    }))?;
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
                documents,
                ..
            },
            &Saved::Attention { q, k, v, yh, att },
        ) => {
            if !gr.needs(qkv) {
                return Ok(());
            }
            let s = &g.t(qkv).shape;
            let (b, t, c) = (s[0], s[1], s[2] / 3);
            let (d, act) = (c / h, g.t(qkv).dtype);
            // dyh (B, H, T, D) <- dout (B, T, C)
            let dyh = e.scratch(act, b * t * c);
            e.launch(Kernel::SplitHeads(SplitHeads {
                src: dout(),
                dst: dyh,
                seq: t,
                heads: h,
                width: c,
                offset: 0,
            }))?;
            let (dq, dk, dv) = (
                e.scratch(act, b * t * c),
                e.scratch(act, b * t * c),
                e.scratch(act, b * t * c),
            );
            let docs = documents.map(|x| e.val(x));
            let heads = Heads {
                b,
                t,
                d,
                h,
                kv: h,
                docs,
            };
            attend_backward(e, mode, heads, act, [q, k, v, yh, att, dyh], [dq, dk, dv])?;
            // dqkv (B, T, 3C) <- dq, dk, dv (B, H, T, D): the three merges write every
            // column, so together they overwrite.
            let dqkv = gr.overwriting(e, qkv)?;
            for (i, src) in [dq, dk, dv].into_iter().enumerate() {
                e.launch(Kernel::MergeHeads(MergeHeads {
                    src,
                    dst: dqkv.buf,
                    seq: t,
                    heads: h,
                    width: 3 * c,
                    offset: i * c,
                }))?;
            }
            gr.finish(e, dqkv)
        }
        (&Op::RmsNorm { x, weight, .. }, &Saved::RmsNorm { rstd }) => {
            // dx (M, C) overwritten; dweight (C) f32 accumulated.
            let dweight = gr.accumulating(e, weight)?;
            let dx = gr.overwriting(e, x)?;
            e.launch(Kernel::RmsNormBackward(RmsNormBackward {
                x: e.val(x),
                weight: e.val(weight),
                rstd,
                dout: dout(),
                dx: dx.buf,
                dweight,
                cols: g.t(x).cols(),
            }))?;
            gr.finish(e, dx)
        }
        (
            &Op::Rope {
                x,
                heads,
                freqs,
                positions,
                ..
            },
            _,
        ) => {
            // dx = dout rotated back: a rotation's inverse is its transpose.
            if !gr.needs(x) {
                return Ok(());
            }
            let dx = gr.overwriting(e, x)?;
            let p = positions.map(|p| e.val(p));
            e.launch(rope(g, x, heads, freqs, p, [dout(), dx.buf], true))?;
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
            e.launch(Kernel::SwiGluBackward(SwiGluBackward {
                gate: e.val(gate),
                up: e.val(up),
                dout: dout(),
                dgate: dgate.buf,
                dup: dup.buf,
            }))?;
            gr.finish(e, dgate)?;
            gr.finish(e, dup)
        }
        (
            &Op::GroupedAttention {
                q: qt,
                k: kt,
                v: vt,
                heads: h,
                kv_heads: kv,
                mode,
                documents,
                ..
            },
            &Saved::Attention { q, k, v, yh, att },
        ) => {
            if ![qt, kt, vt].iter().any(|&x| gr.needs(x)) {
                return Ok(());
            }
            let s = &g.t(qt).shape;
            let (b, t, d, act) = (s[0], s[1], s[2] / h, g.t(qt).dtype);
            // dyh (B, H, T, D) <- dout (B, T, H*D)
            let dyh = e.scratch(act, b * h * t * d);
            e.launch(Kernel::SplitHeads(SplitHeads {
                src: dout(),
                dst: dyh,
                seq: t,
                heads: h,
                width: h * d,
                offset: 0,
            }))?;
            let (dq, dk, dv) = (
                e.scratch(act, b * h * t * d),
                e.scratch(act, b * kv * t * d),
                e.scratch(act, b * kv * t * d),
            );
            let docs = documents.map(|x| e.val(x));
            let heads = Heads {
                b,
                t,
                d,
                h,
                kv,
                docs,
            };
            attend_backward(e, mode, heads, act, [q, k, v, yh, att, dyh], [dq, dk, dv])?;
            // dq (B, T, H*D), dk and dv (B, T, KV*D) <- head layout; each merge writes
            // every column. A tensor passed twice (k = v) gets its second contribution
            // added by `finish`.
            for (x, src, n) in [(qt, dq, h), (kt, dk, kv), (vt, dv, kv)] {
                if !gr.needs(x) {
                    continue;
                }
                let dst = gr.overwriting(e, x)?;
                e.launch(Kernel::MergeHeads(MergeHeads {
                    src,
                    dst: dst.buf,
                    seq: t,
                    heads: n,
                    width: n * d,
                    offset: 0,
                }))?;
                gr.finish(e, dst)?;
            }
            Ok(())
        }
        (
            &Op::CrossEntropy {
                logits,
                targets,
                classes,
                ..
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
            e.launch(Kernel::CrossEntropyBackward(CrossEntropyBackward {
                logits: e.val(logits),
                targets: e.val(targets),
                lse,
                dlogits: dlogits.buf,
                vocab: g.t(logits).cols(),
                classes,
                scale: 1.0,
            }))?;
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
            e.launch(Kernel::MseBackward(MseBackward {
                pred: e.val(pred),
                target: e.val(target),
                dpred: dpred.buf,
                cols: g.t(pred).cols(),
                scale: 1.0,
            }))?;
            gr.finish(e, dpred)
        }
        // Decoding ops have no backward: Graph::compile refuses a decoding graph.
        _ => unreachable!("forward saves what each op's backward reads"),
    }
}

/// The rotary-embedding launch of `x` (B, T, C) in `heads` heads, `src` to `dst`: row
/// (b, t) at position t, or at `positions`' (one per row) when given.
fn rope(
    g: &super::Graph,
    x: super::Tensor,
    heads: usize,
    freqs: RopeFreqs,
    positions: Option<Buffer>,
    [src, dst]: [Buffer; 2],
    inverse: bool,
) -> Kernel {
    let s = &g.t(x).shape;
    if let Some(positions) = positions {
        return Kernel::RopeAt(RopeAt {
            x: src,
            out: dst,
            positions,
            cols: s[2],
            dim: s[2] / heads,
            freqs,
            inverse,
        });
    }
    Kernel::Rope(Rope {
        x: src,
        out: dst,
        cols: s[2],
        dim: s[2] / heads,
        seq: s[1],
        freqs,
        inverse,
    })
}

/// The heads of one attention op: `b * h` query heads and `b * kv` K/V heads of
/// (T, D), query head `h` of a batch reading its K/V head `h / group`.
#[derive(Clone, Copy)]
struct Heads {
    b: usize,
    t: usize,
    d: usize,
    h: usize,
    kv: usize,
    /// Packed sequences: each (b, t)'s document start (u32).
    docs: Option<Buffer>,
}

impl Heads {
    /// The documents the fused kernels keep apart.
    fn documents(&self) -> Option<kernels::Documents> {
        self.docs.map(|starts| kernels::Documents {
            starts,
            heads: self.h,
        })
    }

    fn group(&self) -> usize {
        self.h / self.kv
    }

    fn scale(&self) -> f32 {
        1.0 / (self.d as f32).sqrt()
    }
}

/// Causal attention in head layout: yh (B, H, T, D) from q (B, H, T, D) and k, v
/// (B, KV, T, D). Returns what the backward reads besides the heads: straightforward,
/// the probabilities att (B*H, T, T); fused, the lse (B*H, T) f32.
///
/// Straightforward GQA needs no kernel of its own: the `group` query heads of one K/V
/// head are adjacent in q, so one batched GEMM over B*KV with M = group*T computes
/// their scores against K_j, rows (g, i) of a batch being query head g's row i. The
/// causal softmax masks by row % T, which is i. With group 1 these are the GEMMs of
/// multi-head attention exactly.
fn attend(
    e: &mut Emitter,
    mode: Attention,
    s: Heads,
    act: DType,
    [q, k, v]: [Buffer; 3],
    yh: Buffer,
) -> Result<Buffer> {
    let (t, d, g, bh, bkv) = (s.t, s.d, s.group(), s.b * s.h, s.b * s.kv);
    match mode {
        Attention::Straightforward if s.docs.is_some() => Err(crate::Error::InvalidArgument(
            "graph: packed documents need the fused attention (Graph::pack_documents picks it)"
                .into(),
        )),
        Attention::Straightforward => {
            // scores (B*KV, G*T, T) = q (B*KV, G*T, D) k^T / sqrt(D), scaled inside the
            // GEMM (in f32) so a large dot product cannot overflow 16-bit scores; the
            // causal softmax gives att; yh (B*KV, G*T, D) = att v.
            let scores = e.scratch(act, bh * t * t);
            let att = e.scratch(act, bh * t * t);
            let stats = e.scratch(DType::F32, 2 * bh * t);
            e.launch(Kernel::Matmul(
                Matmul::new(q, k, scores, g * t, t, d)
                    .transpose(false, true)
                    .batched(bkv, g * t * d, t * d, g * t * t)
                    .scaled(s.scale(), 0.0),
            ))?;
            e.launch(Kernel::Softmax(Softmax {
                x: scores,
                out: att,
                stats,
                cols: t,
                scale: 1.0,
                causal: true,
            }))?;
            e.launch(Kernel::Matmul(
                Matmul::new(att, v, yh, g * t, d, t).batched(bkv, g * t * t, t * d, g * t * d),
            ))?;
            Ok(att)
        }
        Attention::Fused => {
            // Tile by tile; saves one f32 log-sum-exp per (head, row).
            let lse = e.scratch(DType::F32, bh * t);
            e.launch(Kernel::Attention(kernels::Attention {
                q,
                k,
                v,
                out: yh,
                lse,
                batch_heads: bh,
                group: g,
                seq: t,
                dim: d,
                scale: s.scale(),
                causal: true,
                documents: s.documents(),
            }))?;
            Ok(lse)
        }
    }
}

/// The backward of [`attend`]: dq (B, H, T, D), dk and dv (B, KV, T, D), overwritten,
/// from dyh (B, H, T, D); `saved` is q, k, v, yh, att (or lse) and dyh.
fn attend_backward(
    e: &mut Emitter,
    mode: Attention,
    s: Heads,
    act: DType,
    [q, k, v, yh, att, dyh]: [Buffer; 6],
    [dq, dk, dv]: [Buffer; 3],
) -> Result<()> {
    let (t, d, g, bh, bkv) = (s.t, s.d, s.group(), s.b * s.h, s.b * s.kv);
    match mode {
        Attention::Straightforward if s.docs.is_some() => Err(crate::Error::InvalidArgument(
            "graph: packed documents need the fused attention (Graph::pack_documents picks it)"
                .into(),
        )),
        Attention::Straightforward => {
            // Per K/V head j and its query rows (G*T): datt = dyh v^T; dv = att^T dyh
            // (the K = G*T reduction sums the group); dscores = softmax backward (with
            // the 1/sqrt(D) of the forward GEMM); dq = dscores k; dk = dscores^T q.
            let datt = e.scratch(act, bh * t * t);
            let dscores = e.scratch(act, bh * t * t);
            let stats = e.scratch(DType::F32, 2 * bh * t);
            e.launch(Kernel::Matmul(
                Matmul::new(dyh, v, datt, g * t, t, d)
                    .transpose(false, true)
                    .batched(bkv, g * t * d, t * d, g * t * t),
            ))?;
            e.launch(Kernel::Matmul(
                Matmul::new(att, dyh, dv, t, d, g * t)
                    .transpose(true, false)
                    .batched(bkv, g * t * t, g * t * d, t * d),
            ))?;
            e.launch(Kernel::SoftmaxBackward(SoftmaxBackward {
                p: att,
                dout: datt,
                dx: dscores,
                stats,
                cols: t,
                scale: s.scale(),
            }))?;
            e.launch(Kernel::Matmul(
                Matmul::new(dscores, k, dq, g * t, d, t).batched(bkv, g * t * t, t * d, g * t * d),
            ))?;
            e.launch(Kernel::Matmul(
                Matmul::new(dscores, q, dk, t, d, g * t)
                    .transpose(true, false)
                    .batched(bkv, g * t * t, g * t * d, t * d),
            ))
        }
        Attention::Fused => {
            // Recomputes the probabilities from q, k and the saved lse; dk and dv sum
            // each K/V head's group inside the kernel.
            e.launch(Kernel::AttentionBackward(AttentionBackward {
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
                group: g,
                seq: t,
                dim: d,
                scale: s.scale(),
                causal: true,
                documents: s.documents(),
            }))
        }
    }
}
