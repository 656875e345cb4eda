//! Kiln's CPU reference backend.
//!
//! Plain, obviously-correct code: the oracle every GPU kernel is tested against.
//! Launches run at once (there is no queue to batch into), so `submit` and `wait`
//! have nothing to do. Elementwise math follows the GPU contract exactly — widen to
//! f32, compute in f32, round to nearest-even on store — while reductions accumulate
//! in f64 so that they are a tighter reference than any kernel.

use kiln_engine::kernels::{
    self, Activation, ActivationBackward, ArgMax, AttentionBackward, Axpy, Binary, CacheWrite,
    CachedAttention, Cast, CrossEntropy, CrossEntropyBackward, Dropout, DropoutBackward, Embedding,
    EmbeddingBackward, Fill, Gelu, GeluBackward, GradScale, LayerNorm, LayerNormBackward,
    MergeHeads, MseBackward, MseLoss, NonFinite, Reduce, RmsNorm, RmsNormBackward, Rope, RopeAt,
    Scale, Softmax, SoftmaxBackward, SplitHeads, SwiGlu, SwiGluBackward,
};
use std::borrow::Cow;
use std::collections::HashMap;
use std::sync::Mutex;

use half::{bf16, f16};
use kiln_engine::device::optim::{host_step, HostState, Optimizer};
use kiln_engine::device::{check_upload, check_view, KernelTiming, RopeFreqs};
use kiln_engine::kernels::matmul::{gelu_f64, gelu_grad_f64};
use kiln_engine::kernels::{dropout_hash, dropout_scale, dropout_threshold, mse_grad_factor};
use kiln_engine::{
    device::PendingDownload, ActivationKind, AdamStep, BinaryOp, Buffer, Capabilities, DType,
    Device, Error, HostData, Kernel, Matmul, ReduceOp, Result, SgdStep, IGNORE_TARGET,
};

pub struct CpuDevice {
    caps: Capabilities,
    state: Mutex<State>,
    /// Begun downloads: next ticket, and each ticket's data.
    staged: Mutex<(u64, HashMap<u64, HostData>)>,
    /// Launch timings between `profile_begin` and `profile_end`.
    profile: Mutex<Option<Vec<KernelTiming>>>,
}

#[derive(Default)]
struct State {
    next_id: u64,
    buffers: HashMap<u64, HostData>,
    /// Views: id -> (parent id, first element).
    views: HashMap<u64, (u64, usize)>,
}

impl Default for CpuDevice {
    fn default() -> Self {
        Self::new()
    }
}

impl CpuDevice {
    pub fn new() -> Self {
        CpuDevice {
            caps: Capabilities {
                name: "cpu reference".into(),
                backend: "cpu".into(),
                device_type: "cpu".into(),
                vendor: 0,
                driver: concat!("kiln-cpu ", env!("CARGO_PKG_VERSION")).into(),
                f16_arithmetic: false,
                subgroup_sizes: None,
                timestamp_queries: false,
                max_storage_binding: u64::MAX,
                max_buffer: isize::MAX as u64,
                memory_budget: None,
                memory_heap: None,
                memory_limit: None,
            },
            staged: Mutex::new((0, HashMap::new())),
            profile: Mutex::new(None),
            state: Mutex::new(State {
                next_id: 1,
                ..State::default()
            }),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        // A panic elsewhere cannot leave a half-written HashMap entry we care about.
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }
}

impl State {
    /// A buffer's contents; a view's are copied out of its parent.
    fn get(&self, b: Buffer, device: &str) -> Result<Cow<'_, HostData>> {
        let unknown = || Error::UnknownBuffer {
            id: b.id,
            device: device.into(),
        };
        if let Some(&(parent, offset)) = self.views.get(&b.id) {
            let whole = self.buffers.get(&parent).ok_or_else(unknown)?;
            let size = b.dtype.size();
            let bytes = &whole.as_bytes()[offset * size..(offset + b.len) * size];
            return Ok(Cow::Owned(HostData::from_bytes(b.dtype, b.len, bytes)));
        }
        self.buffers
            .get(&b.id)
            .map(Cow::Borrowed)
            .ok_or_else(unknown)
    }

    fn f32s(&self, b: Buffer, device: &str) -> Result<Vec<f32>> {
        Ok(self.get(b, device)?.to_f32())
    }

    fn put(&mut self, b: Buffer, values: HostData, device: &str) -> Result<()> {
        if let Some(&(parent, offset)) = self.views.get(&b.id) {
            let whole = self
                .buffers
                .get_mut(&parent)
                .ok_or_else(|| Error::UnknownBuffer {
                    id: b.id,
                    device: device.into(),
                })?;
            let size = b.dtype.size();
            let mut bytes = whole.as_bytes().to_vec();
            bytes[offset * size..(offset + b.len) * size].copy_from_slice(values.as_bytes());
            *whole = HostData::from_bytes(whole.dtype(), whole.len(), &bytes);
            return Ok(());
        }
        let slot = self
            .buffers
            .get_mut(&b.id)
            .ok_or_else(|| Error::UnknownBuffer {
                id: b.id,
                device: device.into(),
            })?;
        *slot = values;
        Ok(())
    }
}

impl CpuDevice {
    /// Runs one launch now (the CPU has no stream to defer it to).
    fn execute(&self, kernel: &Kernel) -> Result<()> {
        kernel.validate()?;
        let name = self.caps.name.as_str();
        let mut s = self.lock();
        for b in kernel.buffers() {
            s.get(b, name)?;
        }
        match kernel {
            Kernel::Fill(Fill { dst, value }) => {
                let v = match dst.dtype {
                    DType::U32 => HostData::U32(vec![*value as u32; dst.len]),
                    // Rounds once, from the f64 value, as the GPU fill pattern does.
                    dt => fill_float(dt, *value, dst.len),
                };
                s.put(*dst, v, name)
            }
            Kernel::Copy(kernels::Copy { src, dst }) => {
                let v = s.get(*src, name)?.into_owned();
                s.put(*dst, v, name)
            }
            Kernel::Cast(Cast { src, dst }) => {
                let v = s.f32s(*src, name)?;
                s.put(*dst, HostData::from_f32(dst.dtype, &v), name)
            }
            Kernel::Binary(Binary { op, a, b, out }) => {
                let (x, y) = (s.f32s(*a, name)?, s.f32s(*b, name)?);
                let r: Vec<f32> = match op {
                    BinaryOp::Add => x.iter().zip(&y).map(|(p, q)| p + q).collect(),
                    BinaryOp::Mul => x.iter().zip(&y).map(|(p, q)| p * q).collect(),
                };
                s.put(*out, HostData::from_f32(out.dtype, &r), name)
            }
            Kernel::Scale(Scale { alpha, x, out }) => {
                let r: Vec<f32> = s.f32s(*x, name)?.iter().map(|v| alpha * v).collect();
                s.put(*out, HostData::from_f32(out.dtype, &r), name)
            }
            Kernel::Axpy(Axpy { alpha, x, y }) => {
                let xs = s.f32s(*x, name)?;
                let ys = s.f32s(*y, name)?;
                let r: Vec<f32> = xs.iter().zip(&ys).map(|(a, b)| alpha * a + b).collect();
                s.put(*y, HostData::from_f32(y.dtype, &r), name)
            }
            Kernel::Reduce(Reduce { op, src, dst }) => {
                let xs = s.f32s(*src, name)?;
                let r = match op {
                    ReduceOp::Sum => xs.iter().map(|&v| v as f64).sum::<f64>() as f32,
                    ReduceOp::Max => xs.iter().copied().fold(f32::NEG_INFINITY, f32::max),
                    ReduceOp::SumSquares => {
                        xs.iter().map(|&v| v as f64 * v as f64).sum::<f64>() as f32
                    }
                };
                s.put(*dst, HostData::F32(vec![r]), name)
            }
            Kernel::ArgMax(ArgMax {
                x,
                out,
                cols,
                classes,
            }) => {
                let xs = s.f32s(*x, name)?;
                let best = xs
                    .chunks_exact(*cols)
                    .map(|row| {
                        // The first of the largest numbers; NaN never wins.
                        let mut best: Option<usize> = None;
                        for (i, &v) in row[..*classes].iter().enumerate() {
                            if !v.is_nan() && best.is_none_or(|b| v > row[b]) {
                                best = Some(i);
                            }
                        }
                        best.unwrap_or(0) as u32
                    })
                    .collect();
                s.put(*out, HostData::U32(best), name)
            }
            Kernel::NonFinite(NonFinite { srcs, flag }) => {
                let mut any = false;
                for b in srcs {
                    any |= s.f32s(*b, name)?.iter().any(|v| !v.is_finite());
                }
                s.put(*flag, HostData::U32(vec![any as u32]), name)
            }
            Kernel::Matmul(mm) => matmul(&mut s, mm, name),
            Kernel::GradScale(GradScale {
                sum_squares,
                out,
                loss_scale,
                clip,
            }) => {
                let ss = s.f32s(*sum_squares, name)?[0] as f64;
                let v = kiln_engine::device::optim::grad_scale_reference(ss, *loss_scale, *clip);
                s.put(*out, HostData::F32(vec![v]), name)
            }
            Kernel::Adam(a) => adam(&mut s, a, name),
            Kernel::Sgd(step) => sgd(&mut s, step, name),
            Kernel::Gelu(Gelu { x, out }) => {
                let r: Vec<f32> = s
                    .f32s(*x, name)?
                    .iter()
                    .map(|&v| gelu_f64(v as f64) as f32)
                    .collect();
                s.put(*out, HostData::from_f32(out.dtype, &r), name)
            }
            Kernel::GeluBackward(GeluBackward { x, dout, dx }) => {
                let (xs, ds) = (s.f32s(*x, name)?, s.f32s(*dout, name)?);
                let r: Vec<f32> = xs
                    .iter()
                    .zip(&ds)
                    .map(|(&v, &d)| (d as f64 * gelu_grad_f64(v as f64)) as f32)
                    .collect();
                s.put(*dx, HostData::from_f32(dx.dtype, &r), name)
            }
            Kernel::Activation(Activation { kind, x, out }) => {
                let r: Vec<f32> = s
                    .f32s(*x, name)?
                    .iter()
                    .map(|&v| activation(*kind, v))
                    .collect();
                s.put(*out, HostData::from_f32(out.dtype, &r), name)
            }
            Kernel::ActivationBackward(ActivationBackward { kind, x, dout, dx }) => {
                let (xs, ds) = (s.f32s(*x, name)?, s.f32s(*dout, name)?);
                let r: Vec<f32> = xs
                    .iter()
                    .zip(&ds)
                    .map(|(&v, &d)| activation_backward(*kind, v, d))
                    .collect();
                s.put(*dx, HostData::from_f32(dx.dtype, &r), name)
            }
            Kernel::Dropout(Dropout {
                x: src,
                out: dst,
                p,
                seed,
            })
            | Kernel::DropoutBackward(DropoutBackward {
                dout: src,
                dx: dst,
                p,
                seed,
            }) => {
                // The GPU contract exactly: one f32 product for kept elements, +0 else.
                let (t, k) = (dropout_threshold(*p), dropout_scale(*p));
                let r: Vec<f32> = s
                    .f32s(*src, name)?
                    .iter()
                    .enumerate()
                    .map(|(i, &v)| match dropout_hash(*seed, i as u32) >= t {
                        true => v * k,
                        false => 0.0,
                    })
                    .collect();
                s.put(*dst, HostData::from_f32(dst.dtype, &r), name)
            }
            Kernel::MseLoss(MseLoss {
                pred,
                target,
                losses,
                cols,
            }) => {
                let (ps, ts) = (s.f32s(*pred, name)?, s.f32s(*target, name)?);
                let l: Vec<f32> = ps
                    .chunks(*cols)
                    .zip(ts.chunks(*cols))
                    .map(|(p, t)| {
                        let sum: f64 = p
                            .iter()
                            .zip(t)
                            .map(|(&a, &b)| (a as f64 - b as f64).powi(2))
                            .sum();
                        (sum / *cols as f64) as f32
                    })
                    .collect();
                s.put(*losses, HostData::F32(l), name)
            }
            Kernel::MseBackward(MseBackward {
                pred,
                target,
                dpred,
                cols,
                scale,
            }) => {
                // The kernel's contract: an f32 difference times one f32 factor.
                let (ps, ts) = (s.f32s(*pred, name)?, s.f32s(*target, name)?);
                let f = mse_grad_factor(*scale, *cols);
                let d: Vec<f32> = ps.iter().zip(&ts).map(|(&a, &b)| (a - b) * f).collect();
                s.put(*dpred, HostData::from_f32(dpred.dtype, &d), name)
            }
            Kernel::LayerNorm(LayerNorm {
                x,
                weight,
                bias,
                out,
                mean,
                rstd,
                cols,
                eps,
            }) => {
                let (xs, w, b) = (
                    s.f32s(*x, name)?,
                    s.f32s(*weight, name)?,
                    s.f32s(*bias, name)?,
                );
                let rows = xs.len() / cols;
                let (mut o, mut mu, mut rs) =
                    (vec![0f32; xs.len()], vec![0f32; rows], vec![0f32; rows]);
                for r in 0..rows {
                    let row = &xs[r * cols..(r + 1) * cols];
                    let m = row.iter().map(|&v| v as f64).sum::<f64>() / *cols as f64;
                    let var =
                        row.iter().map(|&v| (v as f64 - m).powi(2)).sum::<f64>() / *cols as f64;
                    let inv = 1.0 / (var + *eps as f64).sqrt();
                    for c in 0..*cols {
                        let xhat = (row[c] as f64 - m) * inv;
                        o[r * cols + c] = (xhat * w[c] as f64 + b[c] as f64) as f32;
                    }
                    mu[r] = m as f32;
                    rs[r] = inv as f32;
                }
                s.put(*out, HostData::from_f32(out.dtype, &o), name)?;
                s.put(*mean, HostData::F32(mu), name)?;
                s.put(*rstd, HostData::F32(rs), name)
            }
            Kernel::SplitHeads(SplitHeads { src, dst, .. })
            | Kernel::MergeHeads(MergeHeads { src, dst, .. }) => {
                let l = kernel.heads_layout().expect("a heads kernel");
                let from = s.f32s(*src, name)?;
                let mut to = s.f32s(*dst, name)?;
                for e in 0..l.heads_buf.len {
                    let r = l.row_index(e);
                    if l.split {
                        to[e] = from[r];
                    } else {
                        to[r] = from[e];
                    }
                }
                s.put(*dst, HostData::from_f32(dst.dtype, &to), name)
            }
            Kernel::Softmax(Softmax {
                x,
                out,
                stats,
                cols,
                scale,
                causal,
            }) => {
                let xs = s.f32s(*x, name)?;
                let mut o = vec![0f32; xs.len()];
                let mut st = vec![0f32; 2 * xs.len() / cols];
                for r in 0..xs.len() / cols {
                    let seen = if *causal { r % cols + 1 } else { *cols };
                    let row: Vec<f64> = xs[r * cols..r * cols + seen]
                        .iter()
                        .map(|&v| *scale as f64 * v as f64)
                        .collect();
                    let m = row.iter().fold(f64::NEG_INFINITY, |a, &v| a.max(v));
                    let z: f64 = row.iter().map(|&v| (v - m).exp()).sum();
                    for (j, &v) in row.iter().enumerate() {
                        o[r * cols + j] = ((v - m).exp() / z) as f32;
                    }
                    st[2 * r] = m as f32;
                    st[2 * r + 1] = z as f32;
                }
                s.put(*out, HostData::from_f32(out.dtype, &o), name)?;
                s.put(*stats, HostData::F32(st), name)
            }
            Kernel::SoftmaxBackward(SoftmaxBackward {
                p,
                dout,
                dx,
                stats,
                cols,
                scale,
            }) => {
                let (ps, ds) = (s.f32s(*p, name)?, s.f32s(*dout, name)?);
                let mut d = vec![0f32; ps.len()];
                let mut st = vec![0f32; 2 * ps.len() / cols];
                for r in 0..ps.len() / cols {
                    let row = r * cols..(r + 1) * cols;
                    let dot: f64 = ps[row.clone()]
                        .iter()
                        .zip(&ds[row.clone()])
                        .map(|(&a, &b)| a as f64 * b as f64)
                        .sum();
                    for e in row {
                        d[e] = (*scale as f64 * ps[e] as f64 * (ds[e] as f64 - dot)) as f32;
                    }
                    st[2 * r] = dot as f32;
                }
                s.put(*dx, HostData::from_f32(dx.dtype, &d), name)?;
                s.put(*stats, HostData::F32(st), name)
            }
            Kernel::Attention(kernels::Attention {
                q,
                k,
                v,
                out,
                lse,
                batch_heads,
                group,
                seq,
                dim,
                scale,
                causal,
                documents,
            }) => {
                let shape = AttnShape {
                    heads: *batch_heads,
                    group: *group,
                    seq: *seq,
                    dim: *dim,
                    scale: *scale as f64,
                    causal: *causal,
                    documents: match documents {
                        Some(d) => Some((s.get(d.starts, name)?.bits(), d.heads)),
                        None => None,
                    },
                };
                let (qs, ks, vs) = (s.f32s(*q, name)?, s.f32s(*k, name)?, s.f32s(*v, name)?);
                let (o, z) = attention(&shape, &qs, &ks, &vs);
                s.put(*out, HostData::from_f32(out.dtype, &o), name)?;
                s.put(*lse, HostData::F32(z), name)
            }
            Kernel::AttentionBackward(AttentionBackward {
                q,
                k,
                v,
                out,
                dout,
                lse,
                dq,
                dk,
                dv,
                batch_heads,
                group,
                seq,
                dim,
                scale,
                causal,
                documents,
            }) => {
                let shape = AttnShape {
                    heads: *batch_heads,
                    group: *group,
                    seq: *seq,
                    dim: *dim,
                    scale: *scale as f64,
                    causal: *causal,
                    documents: match documents {
                        Some(d) => Some((s.get(d.starts, name)?.bits(), d.heads)),
                        None => None,
                    },
                };
                let ins = [*q, *k, *v, *out, *dout, *lse]
                    .iter()
                    .map(|b| s.f32s(*b, name))
                    .collect::<Result<Vec<_>>>()?;
                let [g_q, g_k, g_v] = attention_backward(&shape, &ins);
                s.put(*dq, HostData::from_f32(dq.dtype, &g_q), name)?;
                s.put(*dk, HostData::from_f32(dk.dtype, &g_k), name)?;
                s.put(*dv, HostData::from_f32(dv.dtype, &g_v), name)
            }
            Kernel::CrossEntropy(CrossEntropy {
                logits,
                targets,
                losses,
                lse,
                vocab,
                classes,
            }) => {
                let l = s.f32s(*logits, name)?;
                let t = s.get(*targets, name)?.bits();
                let (mut loss, mut lses) = (vec![0f32; t.len()], vec![0f32; t.len()]);
                for (r, &target) in t.iter().enumerate() {
                    // Padding columns past `classes` are no class: out of the softmax.
                    let row = &l[r * vocab..r * vocab + classes];
                    let m = row.iter().fold(f64::NEG_INFINITY, |a, &v| a.max(v as f64));
                    let z = m + row.iter().map(|&v| (v as f64 - m).exp()).sum::<f64>().ln();
                    lses[r] = z as f32;
                    loss[r] = match row.get(target as usize) {
                        _ if target == IGNORE_TARGET => 0.0,
                        Some(&v) => (z - v as f64) as f32,
                        None => f32::NAN,
                    };
                }
                s.put(*losses, HostData::F32(loss), name)?;
                s.put(*lse, HostData::F32(lses), name)
            }
            Kernel::CrossEntropyBackward(CrossEntropyBackward {
                logits,
                targets,
                lse,
                dlogits,
                vocab,
                classes,
                scale,
            }) => {
                let l = s.f32s(*logits, name)?;
                let t = s.get(*targets, name)?.bits();
                let z = s.f32s(*lse, name)?;
                let d: Vec<f32> = l
                    .iter()
                    .enumerate()
                    .map(|(e, &v)| {
                        let (r, j) = (e / vocab, e % vocab);
                        if t[r] == IGNORE_TARGET || j >= *classes {
                            return 0.0;
                        }
                        let p = (v as f64 - z[r] as f64).exp();
                        ((p - (j as u32 == t[r]) as u8 as f64) * *scale as f64) as f32
                    })
                    .collect();
                s.put(*dlogits, HostData::from_f32(dlogits.dtype, &d), name)
            }
            Kernel::Embedding(Embedding {
                tokens,
                table,
                out,
                dim,
            }) => {
                let t = s.get(*tokens, name)?.bits();
                let w = s.f32s(*table, name)?;
                let rows = w.len() / dim;
                let mut o = Vec::with_capacity(t.len() * dim);
                for &tok in &t {
                    match (tok as usize) < rows {
                        true => {
                            o.extend_from_slice(&w[tok as usize * dim..(tok as usize + 1) * dim])
                        }
                        false => o.extend(std::iter::repeat_n(f32::NAN, *dim)),
                    }
                }
                s.put(*out, HostData::from_f32(out.dtype, &o), name)
            }
            Kernel::EmbeddingBackward(EmbeddingBackward {
                tokens,
                dout,
                dtable,
                dim,
            }) => {
                let t = s.get(*tokens, name)?.bits();
                let d = s.f32s(*dout, name)?;
                let mut g = s.f32s(*dtable, name)?;
                let rows = g.len() / dim;
                for (i, &tok) in t.iter().enumerate() {
                    if (tok as usize) < rows {
                        for c in 0..*dim {
                            g[tok as usize * dim + c] += d[i * dim + c];
                        }
                    }
                }
                s.put(*dtable, HostData::F32(g), name)
            }
            Kernel::LayerNormBackward(LayerNormBackward {
                x,
                weight,
                mean,
                rstd,
                dout,
                dx,
                dweight,
                dbias,
                cols,
            }) => layernorm_backward(
                &mut s,
                [*x, *weight, *mean, *rstd, *dout, *dx, *dweight, *dbias],
                *cols,
                name,
            ),
            Kernel::RmsNorm(RmsNorm {
                x,
                weight,
                out,
                rstd,
                cols,
                eps,
            }) => {
                let (xs, w) = (s.f32s(*x, name)?, s.f32s(*weight, name)?);
                let rows = xs.len() / cols;
                let (mut o, mut rs) = (vec![0f32; xs.len()], vec![0f32; rows]);
                for r in 0..rows {
                    let row = &xs[r * cols..(r + 1) * cols];
                    let ms = row.iter().map(|&v| v as f64 * v as f64).sum::<f64>() / *cols as f64;
                    let inv = 1.0 / (ms + *eps as f64).sqrt();
                    for c in 0..*cols {
                        o[r * cols + c] = (row[c] as f64 * inv * w[c] as f64) as f32;
                    }
                    rs[r] = inv as f32;
                }
                s.put(*out, HostData::from_f32(out.dtype, &o), name)?;
                s.put(*rstd, HostData::F32(rs), name)
            }
            Kernel::RmsNormBackward(RmsNormBackward {
                x,
                weight,
                rstd,
                dout,
                dx,
                dweight,
                cols,
            }) => rmsnorm_backward(
                &mut s,
                [*x, *weight, *rstd, *dout, *dx, *dweight],
                *cols,
                name,
            ),
            Kernel::Rope(Rope {
                x,
                out,
                cols,
                dim,
                seq,
                freqs,
                inverse,
            }) => {
                let xs = s.f32s(*x, name)?;
                let o = rope(&xs, (*cols, *dim, *seq), freqs, *inverse);
                s.put(*out, HostData::from_f32(out.dtype, &o), name)
            }
            Kernel::SwiGlu(SwiGlu { gate, up, out }) => {
                let (g, u) = (s.f32s(*gate, name)?, s.f32s(*up, name)?);
                let o: Vec<f32> = g
                    .iter()
                    .zip(&u)
                    .map(|(&g, &u)| (silu_f64(g as f64).0 * u as f64) as f32)
                    .collect();
                s.put(*out, HostData::from_f32(out.dtype, &o), name)
            }
            Kernel::SwiGluBackward(SwiGluBackward {
                gate,
                up,
                dout,
                dgate,
                dup,
            }) => {
                let (g, u, d) = (
                    s.f32s(*gate, name)?,
                    s.f32s(*up, name)?,
                    s.f32s(*dout, name)?,
                );
                let (mut dg, mut du) = (vec![0f32; g.len()], vec![0f32; g.len()]);
                for i in 0..g.len() {
                    let (silu, grad) = silu_f64(g[i] as f64);
                    dg[i] = (d[i] as f64 * u[i] as f64 * grad) as f32;
                    du[i] = (d[i] as f64 * silu) as f32;
                }
                s.put(*dgate, HostData::from_f32(dgate.dtype, &dg), name)?;
                s.put(*dup, HostData::from_f32(dup.dtype, &du), name)
            }
            Kernel::RopeAt(RopeAt {
                x,
                out,
                positions,
                cols,
                dim,
                freqs,
                inverse,
            }) => {
                let xs = s.f32s(*x, name)?;
                let pos = s.get(*positions, name)?.bits();
                let o = rope_rows(&xs, (*cols, *dim), |r| pos[r] as f64, freqs, *inverse);
                s.put(*out, HostData::from_f32(out.dtype, &o), name)
            }
            Kernel::CacheWrite(CacheWrite {
                src,
                cache,
                positions,
                heads,
                dim,
                width,
                offset,
                max_len,
            }) => {
                let l = kernel.cache_layout().expect("a cache kernel");
                let pos = s.get(*positions, name)?.bits();
                let from = s.f32s(*src, name)?;
                let mut to = s.f32s(*cache, name)?;
                for (r, &t) in pos.iter().enumerate() {
                    let t = t as usize;
                    if t >= *max_len {
                        continue;
                    }
                    for h in 0..*heads {
                        for i in 0..*dim {
                            to[l.index(l.sequence(r), h, t, i)] =
                                from[r * width + offset + h * dim + i];
                        }
                    }
                }
                s.put(*cache, HostData::from_f32(cache.dtype, &to), name)
            }
            Kernel::CachedAttention(CachedAttention {
                q,
                k_cache,
                v_cache,
                positions,
                out,
                heads,
                group,
                dim,
                width,
                offset,
                max_len,
                scale,
            }) => {
                let l = kernel.cache_layout().expect("a cache kernel");
                let pos = s.get(*positions, name)?.bits();
                let (qs, ks, vs) = (
                    s.f32s(*q, name)?,
                    s.f32s(*k_cache, name)?,
                    s.f32s(*v_cache, name)?,
                );
                let d = *dim;
                let mut o = vec![0f32; l.rows * heads * d];
                for (r, &t) in pos.iter().enumerate() {
                    let b = l.sequence(r);
                    for h in 0..*heads {
                        let row = &mut o[(r * heads + h) * d..(r * heads + h + 1) * d];
                        if t as usize >= *max_len {
                            row.fill(f32::NAN);
                            continue;
                        }
                        // Two passes in f64 (max, then weights): the oracle the
                        // kernels' one-pass online softmax is held to.
                        let qr = &qs[r * width + offset + h * d..][..d];
                        let kv = h / group;
                        let scores: Vec<f64> = (0..=t as usize)
                            .map(|j| {
                                let kr = &ks[l.index(b, kv, j, 0)..][..d];
                                *scale as f64
                                    * qr.iter()
                                        .zip(kr)
                                        .map(|(&a, &c)| a as f64 * c as f64)
                                        .sum::<f64>()
                            })
                            .collect();
                        let m = scores.iter().fold(f64::NEG_INFINITY, |x, &y| x.max(y));
                        let z: f64 = scores.iter().map(|&x| (x - m).exp()).sum();
                        for (i, out) in row.iter_mut().enumerate() {
                            let acc: f64 = scores
                                .iter()
                                .enumerate()
                                .map(|(j, &x)| (x - m).exp() * vs[l.index(b, kv, j, i)] as f64)
                                .sum();
                            *out = (acc / z) as f32;
                        }
                    }
                }
                s.put(*out, HostData::from_f32(out.dtype, &o), name)
            }
        }
    }
}

impl Device for CpuDevice {
    fn caps(&self) -> &Capabilities {
        &self.caps
    }

    fn alloc(&self, dtype: DType, len: usize) -> Result<Buffer> {
        let mut s = self.lock();
        let id = s.next_id;
        s.next_id += 1;
        s.buffers.insert(id, HostData::zeros(dtype, len));
        Ok(Buffer { id, dtype, len })
    }

    fn free(&self, buf: Buffer) -> Result<()> {
        let mut s = self.lock();
        if s.views.remove(&buf.id).is_some() {
            return Ok(());
        }
        if s.views.values().any(|&(parent, _)| parent == buf.id) {
            return Err(Error::InvalidArgument(format!(
                "buffer #{} still has views on `{}`: free them first",
                buf.id, self.caps.name
            )));
        }
        s.buffers
            .remove(&buf.id)
            .map(|_| ())
            .ok_or_else(|| Error::UnknownBuffer {
                id: buf.id,
                device: self.caps.name.clone(),
            })
    }

    fn view(&self, parent: Buffer, offset: usize, len: usize) -> Result<Buffer> {
        check_view(parent, offset, len)?;
        let mut s = self.lock();
        if s.views.contains_key(&parent.id) {
            return Err(Error::InvalidArgument(format!(
                "buffer #{} is itself a view: take views of the buffer it views",
                parent.id
            )));
        }
        let whole = s.get(parent, &self.caps.name)?;
        if whole.dtype() != parent.dtype || whole.len() != parent.len {
            return Err(Error::InvalidArgument(format!(
                "handle for buffer #{} does not describe it (a handle from another device?)",
                parent.id
            )));
        }
        let id = s.next_id;
        s.next_id += 1;
        s.views.insert(id, (parent.id, offset));
        Ok(Buffer {
            id,
            dtype: parent.dtype,
            len,
        })
    }

    fn upload(&self, buf: Buffer, data: &HostData) -> Result<()> {
        check_upload(buf, data)?;
        self.lock().put(buf, data.clone(), &self.caps.name)
    }

    fn begin_download(&self, buf: Buffer) -> Result<PendingDownload> {
        // Launches run as they are recorded here, so the copy is the data as of now.
        let data = self.lock().get(buf, &self.caps.name)?.into_owned();
        let mut staged = self.staged.lock().unwrap_or_else(|e| e.into_inner());
        let ticket = staged.0;
        staged.0 += 1;
        staged.1.insert(ticket, data);
        Ok(PendingDownload {
            ticket,
            buffer: buf,
        })
    }

    fn finish_download(&self, pending: PendingDownload) -> Result<HostData> {
        let mut staged = self.staged.lock().unwrap_or_else(|e| e.into_inner());
        staged.1.remove(&pending.ticket).ok_or_else(|| {
            Error::InvalidArgument(format!(
                "download ticket {} is not pending on `{}` (already finished, or begun on \
                 another device)",
                pending.ticket, self.caps.name
            ))
        })
    }

    fn launch(&self, kernel: &Kernel) -> Result<()> {
        if self
            .profile
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .is_none()
        {
            return self.execute(kernel);
        }
        // Launches run as they are recorded here, so the host clock times them.
        let start = std::time::Instant::now();
        self.execute(kernel)?;
        let dur = start.elapsed();
        if let Some(t) = &mut *self.profile.lock().unwrap_or_else(|e| e.into_inner()) {
            t.push(KernelTiming {
                cost: kernel.cost(),
                start,
                dur,
            });
        }
        Ok(())
    }

    fn profile_begin(&self) -> Result<()> {
        *self.profile.lock().unwrap_or_else(|e| e.into_inner()) = Some(vec![]);
        Ok(())
    }

    fn profile_end(&self) -> Result<Vec<KernelTiming>> {
        self.profile
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take()
            .ok_or_else(|| {
                Error::InvalidArgument(format!(
                    "profile_end on `{}` without profile_begin",
                    self.caps.name
                ))
            })
    }

    fn submit(&self) -> Result<()> {
        Ok(())
    }

    fn wait(&self) -> Result<()> {
        Ok(())
    }

    fn allocated_bytes(&self) -> u64 {
        self.lock()
            .buffers
            .values()
            .map(|d| d.dtype().padded_bytes(d.len()))
            .sum()
    }
}

/// An activation in f64, rounded once to f32 (ReLU is exact: a select, +0 for x <= 0
/// and NaN, as the kernel's).
fn activation(kind: ActivationKind, x: f32) -> f32 {
    let v = x as f64;
    match kind {
        ActivationKind::Relu if x > 0.0 => x,
        ActivationKind::Relu => 0.0,
        ActivationKind::Tanh => v.tanh() as f32,
        ActivationKind::Silu => (v / (1.0 + (-v).exp())) as f32,
    }
}

/// `dout * f'(x)` in f64, rounded once (ReLU passes `dout` through or gives +0).
fn activation_backward(kind: ActivationKind, x: f32, dout: f32) -> f32 {
    let v = x as f64;
    let grad = match kind {
        ActivationKind::Relu => return if x > 0.0 { dout } else { 0.0 },
        // 1 / cosh^2 rather than 1 - tanh^2, which is 0 in f64 past |x| ~ 19.
        ActivationKind::Tanh => 1.0 / v.cosh().powi(2),
        ActivationKind::Silu => {
            // d/dx [x s(x)] = s (1 + x (1 - s))
            let s = 1.0 / (1.0 + (-v).exp());
            s * (1.0 + v * (1.0 - s))
        }
    };
    (dout as f64 * grad) as f32
}

fn fill_float(dtype: DType, value: f64, len: usize) -> HostData {
    match dtype {
        DType::F32 => HostData::F32(vec![value as f32; len]),
        DType::F16 => HostData::F16(vec![f16::from_f64(value); len]),
        DType::BF16 => HostData::BF16(vec![bf16::from_f64(value); len]),
        DType::U32 => unreachable!("u32 fills are handled by the caller"),
    }
}

/// The reference GEMM: products summed in f64, the epilogue in f64, one rounding to
/// C's dtype at the end. Tighter than any f32-accumulating kernel, so GPU results are
/// judged against an error bound, not against another f32 ordering.
fn matmul(s: &mut State, mm: &Matmul, name: &str) -> Result<()> {
    let a = s.f32s(mm.a, name)?;
    let b = s.f32s(mm.b, name)?;
    let mut c = s.get(mm.c, name)?.to_f32();
    let bias = match mm.bias {
        Some(bb) => Some(s.f32s(bb, name)?),
        None => None,
    };
    let mut c32 = match mm.c_f32 {
        Some(cf) => Some(s.f32s(cf, name)?),
        None => None,
    };
    let mut row = vec![0f64; mm.n];
    for g in 0..mm.batch {
        for i in 0..mm.m {
            row.iter_mut().for_each(|v| *v = 0.0);
            for kk in 0..mm.k {
                let av = a[mm.a_index(g, i, kk)] as f64;
                for (j, r) in row.iter_mut().enumerate() {
                    *r += av * b[mm.b_index(g, kk, j)] as f64;
                }
            }
            for (j, &acc) in row.iter().enumerate() {
                let at = g * mm.stride_c + i * mm.n + j;
                let mut v = mm.alpha as f64 * acc;
                if mm.beta != 0.0 {
                    v += mm.beta as f64 * c[at] as f64;
                }
                if let Some(bias) = &bias {
                    v += bias[j] as f64;
                }
                if mm.gelu {
                    v = gelu_f64(v);
                }
                c[at] = v as f32;
                if let Some(c32) = &mut c32 {
                    c32[at] = v as f32;
                }
            }
        }
    }
    s.put(mm.c, HostData::from_f32(mm.c.dtype, &c), name)?;
    if let (Some(cf), Some(c32)) = (mm.c_f32, c32) {
        s.put(cf, HostData::F32(c32), name)?;
    }
    Ok(())
}

/// Geometry of an attention launch: `heads` query heads, K/V head `h / group` for
/// query head `h`.
struct AttnShape {
    heads: usize,
    group: usize,
    seq: usize,
    dim: usize,
    scale: f64,
    causal: bool,
    /// Each (sequence, row)'s document start and the query heads per sequence.
    documents: Option<(Vec<u32>, usize)>,
}

impl AttnShape {
    /// Keys query row `i` of query head `h` sees: up to itself when causal, from its
    /// document's first row when sequences are packed.
    fn keys(&self, h: usize, i: usize) -> std::ops::Range<usize> {
        let end = if self.causal { i + 1 } else { self.seq };
        let start = match &self.documents {
            Some((starts, heads)) => starts[h / heads * self.seq + i] as usize,
            None => 0,
        };
        start..end
    }

    /// Row of key (and value) `j` of query head `h`'s K/V head.
    fn kv_row(&self, h: usize, j: usize) -> usize {
        h / self.group * self.seq + j
    }

    /// `scale * q_i . k_j` of query head `h`, in f64.
    fn score(&self, q: &[f32], k: &[f32], h: usize, i: usize, j: usize) -> f64 {
        let (d, t) = (self.dim, self.seq);
        let (qi, kj) = ((h * t + i) * d, self.kv_row(h, j) * d);
        self.scale
            * (0..d)
                .map(|c| q[qi + c] as f64 * k[kj + c] as f64)
                .sum::<f64>()
    }
}

/// Reference attention in f64, one row at a time: (out, lse).
fn attention(a: &AttnShape, q: &[f32], k: &[f32], v: &[f32]) -> (Vec<f32>, Vec<f32>) {
    let (d, t) = (a.dim, a.seq);
    let mut out = vec![0f32; a.heads * t * d];
    let mut lse = vec![0f32; a.heads * t];
    for h in 0..a.heads {
        for i in 0..t {
            let keys = a.keys(h, i);
            let s: Vec<f64> = keys.clone().map(|j| a.score(q, k, h, i, j)).collect();
            let m = s.iter().fold(f64::NEG_INFINITY, |x, &y| x.max(y));
            let z: f64 = s.iter().map(|&x| (x - m).exp()).sum();
            for c in 0..d {
                let o: f64 = s
                    .iter()
                    .zip(keys.clone())
                    .map(|(&x, j)| (x - m).exp() * v[a.kv_row(h, j) * d + c] as f64)
                    .sum();
                out[(h * t + i) * d + c] = (o / z) as f32;
            }
            lse[h * t + i] = (m + z.ln()) as f32;
        }
    }
    (out, lse)
}

/// Reference attention backward in f64 from the saved `lse` (as the kernels do):
/// p = exp(s - lse), ds = p (dout . v_j - rowsum(dout * out)), dq = scale ds k,
/// dk = scale ds^T q, dv = p^T dout; a K/V head's dk and dv sum over its group of
/// query heads. `ins` is q, k, v, out, dout, lse.
fn attention_backward(a: &AttnShape, ins: &[Vec<f32>]) -> [Vec<f32>; 3] {
    let [q, k, v, out, dout, lse] = [0, 1, 2, 3, 4, 5].map(|i| ins[i].as_slice());
    let (d, t) = (a.dim, a.seq);
    let (n, nkv) = (a.heads * t * d, a.heads / a.group * t * d);
    let (mut dq, mut dk, mut dv) = (vec![0f64; n], vec![0f64; nkv], vec![0f64; nkv]);
    let dot = |x: &[f32], y: &[f32], r1: usize, r2: usize| -> f64 {
        (0..d)
            .map(|c| x[r1 * d + c] as f64 * y[r2 * d + c] as f64)
            .sum()
    };
    for h in 0..a.heads {
        for i in 0..t {
            let row = h * t + i;
            let delta = dot(dout, out, row, row);
            for j in a.keys(h, i) {
                let col = a.kv_row(h, j);
                let p = (a.score(q, k, h, i, j) - lse[row] as f64).exp();
                let ds = p * (dot(dout, v, row, col) - delta);
                for c in 0..d {
                    dq[row * d + c] += a.scale * ds * k[col * d + c] as f64;
                    dk[col * d + c] += a.scale * ds * q[row * d + c] as f64;
                    dv[col * d + c] += p * dout[row * d + c] as f64;
                }
            }
        }
    }
    [dq, dk, dv].map(|g| g.iter().map(|&x| x as f32).collect())
}

/// Adam/AdamW in f32, in the order the kernel computes it (the engine's host step).
fn adam(s: &mut State, a: &AdamStep, name: &str) -> Result<()> {
    let scale = s.f32s(a.grad_scale, name)?[0];
    let grads = s.f32s(a.grads, name)?;
    let mut w = s.f32s(a.master, name)?;
    let mut m = s.f32s(a.m, name)?;
    let mut v = s.f32s(a.v, name)?;
    let adam = Optimizer::Adam {
        lr: a.lr,
        betas: [a.beta1, a.beta2],
        eps: a.eps,
        weight_decay: a.weight_decay,
        decoupled: a.decoupled,
    };
    let state = HostState {
        master: &mut w,
        m: &mut m,
        v: &mut v,
    };
    host_step(&adam, (a.lr, a.weight_decay, a.step), scale, &grads, state)?;
    if let Some(p) = a.params {
        s.put(p, HostData::from_f32(p.dtype, &w), name)?;
    }
    s.put(a.m, HostData::F32(m), name)?;
    s.put(a.v, HostData::F32(v), name)?;
    s.put(a.master, HostData::F32(w), name)
}

/// SGD with momentum in f32, PyTorch's form (the engine's host step).
fn sgd(s: &mut State, step: &SgdStep, name: &str) -> Result<()> {
    let scale = s.f32s(step.grad_scale, name)?[0];
    let grads = s.f32s(step.grads, name)?;
    let mut w = s.f32s(step.master, name)?;
    let mut buf = s.f32s(step.momentum_buf, name)?;
    let sgd = Optimizer::Sgd {
        lr: step.lr,
        momentum: step.momentum,
        weight_decay: step.weight_decay,
    };
    let state = HostState {
        master: &mut w,
        m: &mut buf,
        v: &mut [],
    };
    host_step(&sgd, (step.lr, step.weight_decay, 1), scale, &grads, state)?;
    if let Some(p) = step.params {
        s.put(p, HostData::from_f32(p.dtype, &w), name)?;
    }
    s.put(step.momentum_buf, HostData::F32(buf), name)?;
    s.put(step.master, HostData::F32(w), name)
}

/// Layer-norm backward in f64 from the saved statistics:
/// dx = rstd * (dy*w - mean(dy*w) - xhat * mean(dy*w*xhat)), dw += sum dy*xhat, db += sum dy.
fn layernorm_backward(s: &mut State, b: [Buffer; 8], cols: usize, name: &str) -> Result<()> {
    let [x, weight, mean, rstd, dout, dx, dweight, dbias] = b;
    let (xs, w, mu, rs, dy) = (
        s.f32s(x, name)?,
        s.f32s(weight, name)?,
        s.f32s(mean, name)?,
        s.f32s(rstd, name)?,
        s.f32s(dout, name)?,
    );
    let (mut dw, mut db) = (s.f32s(dweight, name)?, s.f32s(dbias, name)?);
    let mut d = vec![0f32; xs.len()];
    for r in 0..xs.len() / cols {
        let (m, inv) = (mu[r] as f64, rs[r] as f64);
        let xhat = |c: usize| (xs[r * cols + c] as f64 - m) * inv;
        let dyw = |c: usize| dy[r * cols + c] as f64 * w[c] as f64;
        let a = (0..cols).map(dyw).sum::<f64>() / cols as f64;
        let bb = (0..cols).map(|c| dyw(c) * xhat(c)).sum::<f64>() / cols as f64;
        for c in 0..cols {
            d[r * cols + c] = (inv * (dyw(c) - a - xhat(c) * bb)) as f32;
            dw[c] += (dy[r * cols + c] as f64 * xhat(c)) as f32;
            db[c] += dy[r * cols + c];
        }
    }
    s.put(dx, HostData::from_f32(dx.dtype, &d), name)?;
    s.put(dweight, HostData::F32(dw), name)?;
    s.put(dbias, HostData::F32(db), name)
}

/// RMS-norm backward in f64 from the saved rstd, with xhat = x * rstd:
/// dx = rstd * (dy*w - xhat * mean(dy*w*xhat)), dw += sum dy*xhat.
fn rmsnorm_backward(s: &mut State, b: [Buffer; 6], cols: usize, name: &str) -> Result<()> {
    let [x, weight, rstd, dout, dx, dweight] = b;
    let (xs, w, rs, dy) = (
        s.f32s(x, name)?,
        s.f32s(weight, name)?,
        s.f32s(rstd, name)?,
        s.f32s(dout, name)?,
    );
    let mut dw = s.f32s(dweight, name)?;
    let mut d = vec![0f32; xs.len()];
    for r in 0..xs.len() / cols {
        let inv = rs[r] as f64;
        let xhat = |c: usize| xs[r * cols + c] as f64 * inv;
        let dyw = |c: usize| dy[r * cols + c] as f64 * w[c] as f64;
        let m = (0..cols).map(|c| dyw(c) * xhat(c)).sum::<f64>() / cols as f64;
        for c in 0..cols {
            d[r * cols + c] = (inv * (dyw(c) - xhat(c) * m)) as f32;
            dw[c] += (dy[r * cols + c] as f64 * xhat(c)) as f32;
        }
    }
    s.put(dx, HostData::from_f32(dx.dtype, &d), name)?;
    s.put(dweight, HostData::F32(dw), name)
}

/// Rotary embedding in f64 with exact angles `t * f_i` (`f_i` = `theta^(-2i / dim)`,
/// rescaled per band by `freqs`' scaling; the GPU's are f32): rows of `cols`, row r at
/// position r % seq, each head's halves rotated pairwise; `inverse` rotates by the
/// negative angle.
fn rope(
    x: &[f32],
    (cols, dim, seq): (usize, usize, usize),
    freqs: &RopeFreqs,
    inverse: bool,
) -> Vec<f32> {
    rope_rows(x, (cols, dim), |r| (r % seq) as f64, freqs, inverse)
}

/// Rotary embedding with row `r` at position `position(r)`.
fn rope_rows(
    x: &[f32],
    (cols, dim): (usize, usize),
    position: impl Fn(usize) -> f64,
    freqs: &RopeFreqs,
    inverse: bool,
) -> Vec<f32> {
    let half = dim / 2;
    let sign = if inverse { -1.0 } else { 1.0 };
    let mut out = vec![0f32; x.len()];
    for (r, row) in x.chunks(cols).enumerate() {
        let t = position(r);
        for h in (0..cols).step_by(dim) {
            for i in 0..half {
                let a = t * freqs.inv_freq(i, dim);
                let (sin, cos) = (sign * a.sin(), a.cos());
                let (lo, hi) = (row[h + i] as f64, row[h + i + half] as f64);
                out[r * cols + h + i] = (lo * cos - hi * sin) as f32;
                out[r * cols + h + i + half] = (hi * cos + lo * sin) as f32;
            }
        }
    }
    out
}

/// `(silu(x), silu'(x))` in f64: silu = x s with s = sigmoid(x), silu' = s (1 + x (1 - s)).
fn silu_f64(x: f64) -> (f64, f64) {
    let s = 1.0 / (1.0 + (-x).exp());
    (x * s, s * (1.0 + x * (1.0 - s)))
}
