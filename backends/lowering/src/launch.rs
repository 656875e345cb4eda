//! Kernel launches: how each engine `Kernel` becomes the dispatches that run it,
//! written once against [`Recorder`] (GEMMs in `gemm.rs`, attention in
//! `attention.rs`). The wgpu device records them through wgpu; `kiln-vulkan` records
//! the same dispatches (the same WGSL, translated to SPIR-V by naga) through raw
//! Vulkan, so both backends run one op set.

use kiln_engine::kernels::{
    self, Activation, ActivationBackward, ArgMax, Axpy, Binary, CacheWrite, CachedAttention, Cast,
    CrossEntropy, CrossEntropyBackward, Dropout, DropoutBackward, Embedding, EmbeddingBackward,
    Fill, Gelu, GeluBackward, GradScale, LayerNorm, LayerNormBackward, MergeHeads, MseBackward,
    MseLoss, NonFinite, Reduce, RmsNorm, RmsNormBackward, Rope, RopeAt, Scale, Softmax,
    SoftmaxBackward, SplitHeads, SwiGlu, SwiGluBackward,
};
use kiln_engine::kernels::{dropout_scale, dropout_threshold, mse_grad_factor};
use kiln_engine::{ActivationKind, BinaryOp, Buffer, DType, Kernel, ReduceOp, Result, RopeFreqs};

use crate::attention::LowerAttention;
use crate::dispatch::{
    groups, Dispatch, BAND_PARTIALS_ID, MAX_BANDS, MAX_GROUPS, PARTIALS_ID, REDUCE_GROUPS,
    SCRATCH_ID,
};
use crate::gemm::LowerMatmul;
use crate::recorder::Recorder;
use crate::shader::{self, KernelSource, Repr};

/// How each engine kernel becomes dispatches, for any backend that records them.
pub(crate) trait Lower: Recorder {
    /// A norm's backward (LayerNorm's and RMSNorm's are the same three passes): per
    /// row, the statistics dx needs into the partials (`stat_bytes` a row); dx by pairs
    /// of elements; the weight (and bias) gradients by columns. `saved` are the
    /// forward's per-row statistics (mean and rstd, or rstd), `grads` the parameter
    /// gradients (dweight and dbias, or dweight).
    #[allow(clippy::type_complexity)]
    fn norm_backward(
        &self,
        s: &mut Self::State,
        [stats, dx_pass, params]: [&'static KernelSource; 3],
        [x, weight, dout, dx]: [&Buffer; 4],
        (saved, grads): (&[&Buffer], &[&Buffer]),
        (cols, stat_bytes): (usize, u64),
    ) -> Result<()> {
        if x.len == 0 {
            return Ok(());
        }
        let h = |b: &&Buffer| b.id;
        let (n, cols) = (x.len as u32, cols as u32);
        let rows = n / cols;
        self.partials(s, rows as u64 * stat_bytes)?;
        let reprs = |bs: &[&Buffer]| bs.iter().map(|b| self.repr(b.dtype)).collect();
        let (lanes, grid) = self.row_plan(rows, cols);
        let mut buffers: Vec<u64> = [x, weight, dout].iter().map(h).collect();
        buffers.extend(saved.iter().map(h));
        buffers.push(PARTIALS_ID);
        self.dispatch(
            s,
            Dispatch::new(
                stats,
                reprs(&[x, weight, dout]),
                buffers,
                vec![rows, 0, 0, cols],
                grid,
            )
            .with_overrides(lanes),
        )?;
        let words = pairs(x.len);
        let mut buffers: Vec<u64> = [x, weight, dout, dx].iter().map(h).collect();
        buffers.extend(saved.iter().map(h));
        buffers.push(PARTIALS_ID);
        self.dispatch(
            s,
            Dispatch::new(
                dx_pass,
                reprs(&[x, weight, dout, dx]),
                buffers,
                vec![n, words, 0, cols],
                (groups(words), 1, 1),
            ),
        )?;
        let mut buffers: Vec<u64> = [x, dout].iter().map(h).collect();
        buffers.extend(saved.iter().chain(grads).map(h));
        self.dispatch(
            s,
            Dispatch::new(
                params,
                reprs(&[x, dout]),
                buffers,
                vec![rows, 0, 0, cols],
                (groups(cols), 1, 1),
            ),
        )
    }

    /// Records `kernel` (already validated: its buffers are live on the device).
    fn record_kernel(&self, s: &mut Self::State, kernel: &Kernel) -> Result<()> {
        let h = |b: &Buffer| b.id;
        match kernel {
            Kernel::Fill(Fill { dst, value }) => {
                let bands = self.bands("fill", dst.len, dst.dtype.size())?;
                for band in bands {
                    let words = (dst.dtype.padded_bytes(band.len) / 4) as u32;
                    let mut d = Dispatch::new(
                        &shader::FILL,
                        vec![],
                        vec![h(dst)],
                        vec![band.len as u32, words, 0, fill_pattern(dst.dtype, *value)],
                        (groups(words), 1, 1),
                    );
                    d.ranges = band.ranges([(0, dst)]);
                    self.dispatch(s, d)?;
                }
            }
            Kernel::Copy(kernels::Copy { src, dst }) => self.copy(s, src, dst)?,
            Kernel::Cast(Cast { src, dst }) => {
                self.elementwise(s, &shader::CAST, None, &[src, dst], 0.0)?
            }
            Kernel::Binary(Binary { op, a, b, out }) => {
                let code = match op {
                    BinaryOp::Add => 0,
                    BinaryOp::Mul => 1,
                };
                self.elementwise(s, &shader::BINARY, Some(("OP", code)), &[a, b, out], 0.0)?
            }
            Kernel::Scale(Scale { alpha, x, out }) => {
                self.elementwise(s, &shader::SCALE, None, &[x, out], *alpha)?
            }
            Kernel::Axpy(Axpy { alpha, x, y }) => {
                self.elementwise(s, &shader::AXPY, None, &[x, y], *alpha)?
            }
            Kernel::Reduce(Reduce { op, src, dst }) => {
                let code = match op {
                    ReduceOp::Sum | ReduceOp::SumSquares => 0,
                    ReduceOp::Max => 1,
                };
                let square = (*op == ReduceOp::SumSquares) as u32;
                // Pass 1: data -> one partial per workgroup; pass 2: partials -> dst.
                // A source over the binding limit is folded band by band, each band
                // into its own REDUCE_GROUPS partials (all written: a workgroup with no
                // elements writes the identity), and pass 2 folds them all.
                let bands = self.bands("reduce", src.len, src.dtype.size())?;
                if bands.len() > MAX_BANDS {
                    return Err(kiln_engine::Error::Unsupported {
                        device: self.caps().name.clone(),
                        what: format!(
                            "a reduction over {} elements: {} bands of the per-binding \
                             limit, over the {MAX_BANDS} one reduction folds",
                            src.len,
                            bands.len()
                        ),
                    });
                }
                let partial_bytes = DType::F32.padded_bytes(REDUCE_GROUPS as usize);
                let whole = bands[0].whole;
                let partials = if whole { SCRATCH_ID } else { BAND_PARTIALS_ID };
                let mut g = 0;
                for (i, &band) in bands.iter().enumerate() {
                    let words = pairs(band.len);
                    let mut d = Dispatch::new(
                        &shader::REDUCE,
                        vec![self.repr(src.dtype)],
                        vec![h(src), partials],
                        vec![band.len as u32, words, 0, 0],
                        (groups(words).min(REDUCE_GROUPS), 1, 1),
                    )
                    .with_overrides(vec![("OP", code), ("SQUARE", square)]);
                    if !band.whole {
                        d.groups.0 = REDUCE_GROUPS;
                        d.ranges = band.ranges([(0, src)]);
                        d.ranges.push((1, i as u64 * partial_bytes, partial_bytes));
                    }
                    g += d.groups.0;
                    self.dispatch(s, d)?;
                }
                let mut d = Dispatch::new(
                    &shader::REDUCE,
                    vec![Repr::F32],
                    vec![partials, h(dst)],
                    vec![g, pairs(g as usize), 0, 0],
                    (1, 1, 1),
                )
                .with_overrides(vec![("OP", code)]);
                if !whole {
                    d.ranges = vec![(0, 0, DType::F32.padded_bytes(g as usize))];
                }
                self.dispatch(s, d)?;
            }
            Kernel::Matmul(mm) => {
                let plan = self.launch_plan(s, mm)?;
                self.matmul(s, mm, &plan)?;
            }
            Kernel::Gelu(Gelu { x, out }) => {
                self.elementwise(s, &shader::GELU_FORWARD, None, &[x, out], 0.0)?
            }
            Kernel::GeluBackward(GeluBackward { x, dout, dx }) => {
                self.elementwise(s, &shader::GELU_BACKWARD, None, &[x, dout, dx], 0.0)?
            }
            Kernel::Activation(Activation { kind, x, out }) => self.elementwise(
                s,
                &shader::ACTIVATION,
                Some(("KIND", activation_code(*kind))),
                &[x, out],
                0.0,
            )?,
            Kernel::ActivationBackward(ActivationBackward { kind, x, dout, dx }) => self
                .elementwise(
                    s,
                    &shader::ACTIVATION_BACKWARD,
                    Some(("KIND", activation_code(*kind))),
                    &[x, dout, dx],
                    0.0,
                )?,
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
                if src.len > 0 {
                    let words = pairs(src.len);
                    self.dispatch(
                        s,
                        Dispatch::new(
                            &shader::DROPOUT,
                            vec![self.repr(src.dtype), self.repr(dst.dtype)],
                            vec![h(src), h(dst)],
                            vec![
                                src.len as u32,
                                words,
                                dropout_scale(*p).to_bits(),
                                dropout_threshold(*p),
                                *seed as u32,
                                (*seed >> 32) as u32,
                                0,
                                0,
                            ],
                            (groups(words), 1, 1),
                        ),
                    )?;
                }
            }
            Kernel::MseLoss(MseLoss {
                pred,
                target,
                losses,
                cols,
            }) => {
                let rows = (pred.len / cols) as u32;
                let (lanes, grid) = self.row_plan(rows, *cols as u32);
                self.dispatch(
                    s,
                    Dispatch::new(
                        &shader::MSE_LOSS,
                        vec![self.repr(pred.dtype), self.repr(target.dtype)],
                        vec![h(pred), h(target), h(losses)],
                        vec![rows, 0, 0, *cols as u32],
                        grid,
                    )
                    .with_overrides(lanes),
                )?;
            }
            Kernel::MseBackward(MseBackward {
                pred,
                target,
                dpred,
                cols,
                scale,
            }) => self.elementwise(
                s,
                &shader::MSE_BACKWARD,
                None,
                &[pred, target, dpred],
                mse_grad_factor(*scale, *cols),
            )?,
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
                let (n, cols) = (x.len as u32, *cols as u32);
                let rows = n / cols;
                // Pass 1: per row -> mean, rstd. Pass 2: pairs of elements.
                let (lanes, grid) = self.row_plan(rows, cols);
                self.dispatch(
                    s,
                    Dispatch::new(
                        &shader::LAYERNORM_STATS,
                        vec![self.repr(x.dtype)],
                        vec![h(x), h(mean), h(rstd)],
                        vec![rows, 0, eps.to_bits(), cols],
                        grid,
                    )
                    .with_overrides(lanes),
                )?;
                let words = pairs(x.len);
                self.dispatch(
                    s,
                    Dispatch::new(
                        &shader::LAYERNORM_APPLY,
                        [x, weight, bias, out]
                            .iter()
                            .map(|b| self.repr(b.dtype))
                            .collect(),
                        vec![h(x), h(weight), h(bias), h(out), h(mean), h(rstd)],
                        vec![n, words, 0, cols],
                        (groups(words), 1, 1),
                    ),
                )?;
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
            }) => self.norm_backward(
                s,
                [
                    &shader::LAYERNORM_BACKWARD_STATS,
                    &shader::LAYERNORM_BACKWARD_DX,
                    &shader::LAYERNORM_BACKWARD_PARAMS,
                ],
                [x, weight, dout, dx],
                (&[mean, rstd], &[dweight, dbias]),
                (*cols, 8),
            )?,
            Kernel::RmsNorm(RmsNorm {
                x,
                weight,
                out,
                rstd,
                cols,
                eps,
            }) => {
                if x.len == 0 {
                    return Ok(());
                }
                let (n, cols) = (x.len as u32, *cols as u32);
                let rows = n / cols;
                // Pass 1: per row -> rstd. Pass 2: pairs of elements.
                let (lanes, grid) = self.row_plan(rows, cols);
                self.dispatch(
                    s,
                    Dispatch::new(
                        &shader::RMSNORM_STATS,
                        vec![self.repr(x.dtype)],
                        vec![h(x), h(rstd)],
                        vec![rows, 0, eps.to_bits(), cols],
                        grid,
                    )
                    .with_overrides(lanes),
                )?;
                let words = pairs(x.len);
                self.dispatch(
                    s,
                    Dispatch::new(
                        &shader::RMSNORM_APPLY,
                        [x, weight, out]
                            .iter()
                            .map(|b| self.repr(b.dtype))
                            .collect(),
                        vec![h(x), h(weight), h(out), h(rstd)],
                        vec![n, words, 0, cols],
                        (groups(words), 1, 1),
                    ),
                )?;
            }
            Kernel::RmsNormBackward(RmsNormBackward {
                x,
                weight,
                rstd,
                dout,
                dx,
                dweight,
                cols,
            }) => self.norm_backward(
                s,
                [
                    &shader::RMSNORM_BACKWARD_STATS,
                    &shader::RMSNORM_BACKWARD_DX,
                    &shader::RMSNORM_BACKWARD_PARAMS,
                ],
                [x, weight, dout, dx],
                (&[rstd], &[dweight]),
                (*cols, 4),
            )?,
            Kernel::Rope(Rope {
                x,
                out,
                cols,
                dim,
                seq,
                freqs,
                inverse,
            }) => {
                if x.len > 0 {
                    let [step_hi, step_lo] = rope_step(freqs.theta, *dim);
                    let words = (x.len / 2) as u32;
                    let sign: f32 = if *inverse { -1.0 } else { 1.0 };
                    self.dispatch(
                        s,
                        Dispatch::new(
                            &shader::ROPE,
                            vec![self.repr(x.dtype), self.repr(out.dtype)],
                            vec![h(x), h(out)],
                            vec![
                                x.len as u32,
                                words,
                                *cols as u32,
                                *dim as u32,
                                *seq as u32,
                                sign.to_bits(),
                                step_hi.to_bits(),
                                step_lo.to_bits(),
                            ]
                            .into_iter()
                            .chain(rope_scaling(freqs))
                            .collect(),
                            (groups(words), 1, 1),
                        ),
                    )?;
                }
            }
            Kernel::SwiGlu(SwiGlu { gate, up, out }) => {
                self.elementwise(s, &shader::SWIGLU_FORWARD, None, &[gate, up, out], 0.0)?
            }
            Kernel::SwiGluBackward(SwiGluBackward {
                gate,
                up,
                dout,
                dgate,
                dup,
            }) => self.elementwise(
                s,
                &shader::SWIGLU_BACKWARD,
                None,
                &[gate, up, dout, dgate, dup],
                0.0,
            )?,
            Kernel::RopeAt(RopeAt {
                x,
                out,
                positions,
                cols,
                dim,
                freqs,
                inverse,
            }) => {
                if x.len > 0 {
                    let [step_hi, step_lo] = rope_step(freqs.theta, *dim);
                    let words = (x.len / 2) as u32;
                    let sign: f32 = if *inverse { -1.0 } else { 1.0 };
                    self.dispatch(
                        s,
                        Dispatch::new(
                            &shader::ROPE_AT,
                            vec![self.repr(x.dtype), self.repr(out.dtype)],
                            vec![h(x), h(out), h(positions)],
                            vec![
                                x.len as u32,
                                words,
                                *cols as u32,
                                *dim as u32,
                                1,
                                sign.to_bits(),
                                step_hi.to_bits(),
                                step_lo.to_bits(),
                            ]
                            .into_iter()
                            .chain(rope_scaling(freqs))
                            .collect(),
                            (groups(words), 1, 1),
                        ),
                    )?;
                }
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
                let total = l.rows * heads * dim;
                if total > 0 {
                    let words = pairs(total);
                    let params = cache_params(
                        words,
                        (*heads, *dim, *width, *offset, *max_len),
                        (l.rows / l.batch, l.kv_heads, 1),
                        1.0,
                        total,
                    );
                    self.dispatch(
                        s,
                        Dispatch::new(
                            &shader::CACHE_WRITE,
                            vec![self.repr(src.dtype), self.repr(cache.dtype)],
                            vec![h(src), h(cache), h(positions)],
                            params,
                            (groups(words), 1, 1),
                        ),
                    )?;
                }
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
                let items = (l.rows * heads) as u32;
                if items > 0 {
                    let params = cache_params(
                        items,
                        (*heads, *dim, *width, *offset, *max_len),
                        (l.rows / l.batch, l.kv_heads, *group),
                        *scale,
                        0,
                    );
                    self.dispatch(
                        s,
                        Dispatch::new(
                            &shader::CACHED_ATTENTION,
                            [q, k_cache, v_cache, out]
                                .iter()
                                .map(|b| self.repr(b.dtype))
                                .collect(),
                            vec![h(q), h(k_cache), h(v_cache), h(out), h(positions)],
                            params,
                            row_groups(items),
                        ),
                    )?;
                }
            }
            Kernel::SplitHeads(SplitHeads { src, dst, .. })
            | Kernel::MergeHeads(MergeHeads { src, dst, .. }) => {
                let l = kernel.heads_layout().expect("a heads kernel");
                if l.rows > 0 && l.heads_buf.len > 0 {
                    // Split walks destination pairs; merge walks the words of each row's span.
                    let (shader, words) = if l.split {
                        (&shader::SPLIT_HEADS, pairs(dst.len))
                    } else {
                        (&shader::MERGE_HEADS, (l.rows * l.heads * l.dim / 2) as u32)
                    };
                    let params = [
                        l.heads_buf.len,
                        words as usize,
                        l.seq,
                        l.heads,
                        l.width,
                        l.offset,
                        l.dim,
                        0,
                    ];
                    self.dispatch(
                        s,
                        Dispatch::new(
                            shader,
                            vec![self.repr(src.dtype), self.repr(dst.dtype)],
                            vec![h(src), h(dst)],
                            params.map(|v| v as u32).to_vec(),
                            (groups(words), 1, 1),
                        ),
                    )?;
                }
            }
            Kernel::Softmax(Softmax {
                x,
                out,
                stats,
                cols,
                scale,
                causal,
            }) => {
                let (n, cols) = (x.len as u32, *cols as u32);
                let mask = vec![("CAUSAL", *causal as u32)];
                let (lanes, grid) = self.row_plan(n / cols, cols);
                self.dispatch(
                    s,
                    Dispatch::new(
                        &shader::SOFTMAX_STATS,
                        vec![self.repr(x.dtype)],
                        vec![h(x), h(stats)],
                        vec![n / cols, 0, scale.to_bits(), cols],
                        grid,
                    )
                    .with_overrides([mask.clone(), lanes].concat()),
                )?;
                let words = pairs(x.len);
                self.dispatch(
                    s,
                    Dispatch::new(
                        &shader::SOFTMAX_APPLY,
                        vec![self.repr(x.dtype), self.repr(out.dtype)],
                        vec![h(x), h(out), h(stats)],
                        vec![n, words, scale.to_bits(), cols],
                        (groups(words), 1, 1),
                    )
                    .with_overrides(mask),
                )?;
            }
            Kernel::SoftmaxBackward(SoftmaxBackward {
                p,
                dout,
                dx,
                stats,
                cols,
                scale,
            }) => {
                let (n, cols) = (p.len as u32, *cols as u32);
                let (lanes, grid) = self.row_plan(n / cols, cols);
                self.dispatch(
                    s,
                    Dispatch::new(
                        &shader::SOFTMAX_BACKWARD_STATS,
                        vec![self.repr(p.dtype), self.repr(dout.dtype)],
                        vec![h(p), h(dout), h(stats)],
                        vec![n / cols, 0, 0, cols],
                        grid,
                    )
                    .with_overrides(lanes),
                )?;
                let words = pairs(p.len);
                self.dispatch(
                    s,
                    Dispatch::new(
                        &shader::SOFTMAX_BACKWARD_DX,
                        [p, dout, dx].iter().map(|b| self.repr(b.dtype)).collect(),
                        vec![h(p), h(dout), h(dx), h(stats)],
                        vec![n, words, scale.to_bits(), cols],
                        (groups(words), 1, 1),
                    ),
                )?;
            }
            Kernel::Attention(_) | Kernel::AttentionBackward(_) => self.attention(s, kernel)?,
            Kernel::CrossEntropy(CrossEntropy {
                logits,
                targets,
                losses,
                lse,
                vocab,
                classes,
            }) => {
                // Logits over the binding limit (micro-batch x T x a 50k vocabulary) are
                // bound band by band of whole rows, each band on 256-byte boundaries.
                let rows = logits.len / vocab;
                let band = self.row_band("the cross-entropy", rows, &[(logits, *vocab)])?;
                // The lanes per row follow the whole kernel's rows, so a short last band
                // reduces its rows as the others do: the same bits as one binding.
                let (lanes, _) = self.row_plan(rows as u32, *classes as u32);
                for first in (0..rows.max(1)).step_by(band) {
                    let n = band.min(rows - first);
                    let per_group = 256 / lanes[0].1;
                    let grid = row_groups((n as u32).div_ceil(per_group));
                    let lanes = lanes.clone();
                    let mut d = Dispatch::new(
                        &shader::CROSS_ENTROPY,
                        vec![self.repr(logits.dtype)],
                        vec![h(logits), h(targets), h(losses), h(lse)],
                        vec![n as u32, 0, 0, *vocab as u32, *classes as u32, 0, 0, 0],
                        grid,
                    )
                    .with_overrides(lanes);
                    if band < rows {
                        d.ranges = row_ranges(
                            first,
                            n,
                            *vocab,
                            &[(0, logits)],
                            &[(1, targets), (2, losses), (3, lse)],
                        );
                    }
                    self.dispatch(s, d)?;
                }
            }
            Kernel::ArgMax(ArgMax {
                x,
                out,
                cols,
                classes,
            }) => {
                // Banded by rows as the cross-entropy is (the logits of a large
                // vocabulary over the binding limit).
                let rows = x.len / cols;
                let band = self.row_band("the argmax", rows, &[(x, *cols)])?;
                let (lanes, _) = self.row_plan(rows as u32, *classes as u32);
                for first in (0..rows.max(1)).step_by(band) {
                    let n = band.min(rows - first);
                    let grid = row_groups((n as u32).div_ceil(256 / lanes[0].1));
                    let mut d = Dispatch::new(
                        &shader::ARGMAX,
                        vec![self.repr(x.dtype)],
                        vec![h(x), h(out)],
                        vec![n as u32, 0, 0, *cols as u32, *classes as u32, 0, 0, 0],
                        grid,
                    )
                    .with_overrides(lanes.clone());
                    if band < rows {
                        d.ranges = row_ranges(first, n, *cols, &[(0, x)], &[(1, out)]);
                    }
                    self.dispatch(s, d)?;
                }
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
                // Banded as the forward is (rows on 256-byte boundaries in every buffer).
                let rows = logits.len / vocab;
                let band = self.row_band(
                    "the cross-entropy backward",
                    rows,
                    &[(logits, *vocab), (dlogits, *vocab)],
                )?;
                for first in (0..rows.max(1)).step_by(band) {
                    let n = band.min(rows - first);
                    let len = if band < rows { n * vocab } else { logits.len };
                    let words = pairs(len);
                    let mut d = Dispatch::new(
                        &shader::CROSS_ENTROPY_BACKWARD,
                        vec![self.repr(logits.dtype), self.repr(dlogits.dtype)],
                        vec![h(logits), h(dlogits), h(targets), h(lse)],
                        vec![
                            len as u32,
                            words,
                            scale.to_bits(),
                            *vocab as u32,
                            *classes as u32,
                            0,
                            0,
                            0,
                        ],
                        (groups(words), 1, 1),
                    );
                    if band < rows {
                        d.ranges = row_ranges(
                            first,
                            n,
                            *vocab,
                            &[(0, logits), (1, dlogits)],
                            &[(2, targets), (3, lse)],
                        );
                    }
                    self.dispatch(s, d)?;
                }
            }
            Kernel::Embedding(Embedding {
                tokens,
                table,
                out,
                dim,
            }) => {
                if out.len > 0 {
                    let words = pairs(out.len);
                    let rows = (table.len / dim) as u32;
                    self.dispatch(
                        s,
                        Dispatch::new(
                            &shader::EMBEDDING,
                            vec![self.repr(table.dtype), self.repr(out.dtype)],
                            vec![h(table), h(out), h(tokens)],
                            vec![out.len as u32, words, rows, *dim as u32],
                            (groups(words), 1, 1),
                        ),
                    )?;
                }
            }
            Kernel::EmbeddingBackward(EmbeddingBackward {
                tokens,
                dout,
                dtable,
                dim,
            }) => {
                // A table over the binding limit (GPT-2's f32 token-embedding gradient,
                // 154 MB, on lavapipe's 128 MiB) is bound band by band of whole rows,
                // each band on a 256-byte boundary; each walk skips other bands' rows.
                let rows = dtable.len / dim;
                let step = 64 / gcd(*dim, 64);
                let limit = self.caps().max_storage_binding as usize;
                let band = if dtable.bytes() as usize <= limit {
                    rows.max(1)
                } else {
                    (limit / (4 * dim)) / step * step
                };
                if band == 0 {
                    return Err(kiln_engine::Error::Unsupported {
                        device: self.caps().name.clone(),
                        what: format!(
                            "the embedding backward of a {rows} x {dim} table: the \
                             per-binding limit of {limit} bytes holds no band of {step} rows"
                        ),
                    });
                }
                for first in (0..rows.max(1)).step_by(band) {
                    let n = band.min(rows - first);
                    let mut d = Dispatch::new(
                        &shader::EMBEDDING_BACKWARD,
                        vec![self.repr(dout.dtype)],
                        vec![h(dout), h(tokens), h(dtable)],
                        vec![tokens.len as u32, first as u32, n as u32, *dim as u32],
                        (groups(*dim as u32), 1, 1),
                    );
                    let rows_band = Band {
                        start: first * dim,
                        len: n * dim,
                        whole: band >= rows,
                    };
                    d.ranges = rows_band.ranges([(2, dtable)]);
                    self.dispatch(s, d)?;
                }
            }
            Kernel::GradScale(GradScale {
                sum_squares,
                out,
                loss_scale,
                clip,
            }) => {
                self.dispatch(
                    s,
                    Dispatch::new(
                        &shader::GRAD_SCALE,
                        vec![],
                        vec![h(sum_squares), h(out)],
                        vec![1, 1, loss_scale.to_bits(), clip.to_bits()],
                        (1, 1, 1),
                    ),
                )?;
            }
            Kernel::Adam(a) => {
                let (bias1, bias2) = a.bias_corrections();
                let optional = a.params.map_or(SCRATCH_ID, |p| h(&p));
                self.optimizer(
                    s,
                    &shader::ADAM,
                    vec![
                        h(&a.master),
                        h(&a.grads),
                        h(&a.m),
                        h(&a.v),
                        optional,
                        h(&a.grad_scale),
                    ],
                    vec![a.master, a.grads, a.m, a.v, a.params.unwrap_or(a.master)],
                    vec![
                        ("DECOUPLED", a.decoupled as u32),
                        ("WRITE_PARAMS", a.params.is_some() as u32),
                    ],
                    [
                        a.lr,
                        a.beta1,
                        a.beta2,
                        a.eps,
                        a.weight_decay,
                        bias1,
                        bias2,
                        0.0,
                    ],
                )?;
            }
            Kernel::Sgd(step) => {
                let optional = step.params.map_or(SCRATCH_ID, |p| h(&p));
                self.optimizer(
                    s,
                    &shader::SGD,
                    vec![
                        h(&step.master),
                        h(&step.grads),
                        h(&step.momentum_buf),
                        optional,
                        h(&step.grad_scale),
                    ],
                    vec![
                        step.master,
                        step.grads,
                        step.momentum_buf,
                        step.params.unwrap_or(step.master),
                    ],
                    vec![("WRITE_PARAMS", step.params.is_some() as u32)],
                    [
                        step.lr,
                        0.0,
                        0.0,
                        0.0,
                        step.weight_decay,
                        1.0,
                        1.0,
                        step.momentum,
                    ],
                )?;
            }
            Kernel::NonFinite(NonFinite { srcs, flag }) => {
                self.clear(s, flag)?;
                for src in srcs {
                    if src.len == 0 {
                        continue;
                    }
                    let kind = match src.dtype {
                        DType::F32 => 0,
                        DType::F16 => 1,
                        _ => 2,
                    };
                    let bands = self.bands("nonfinite", src.len, src.dtype.size())?;
                    for band in bands {
                        let words = match src.dtype {
                            DType::F32 => band.len as u32,
                            _ => pairs(band.len),
                        };
                        let mut d = Dispatch::new(
                            &shader::NONFINITE,
                            vec![],
                            vec![h(src), h(flag)],
                            vec![band.len as u32, words, 0, 0],
                            (groups(words), 1, 1),
                        )
                        .with_overrides(vec![("KIND", kind)]);
                        d.ranges = band.ranges([(0, src)]);
                        self.dispatch(s, d)?;
                    }
                }
            }
        }
        Ok(())
    }

    /// An optimizer step: `typed` gives the dtypes of the typed slots (an absent
    /// optional slot repeats the master, f32, and is never written); `values` are
    /// lr, beta1, beta2, eps, weight_decay, bias1, bias2, momentum.
    fn optimizer(
        &self,
        s: &mut Self::State,
        kernel: &'static KernelSource,
        buffers: Vec<u64>,
        typed: Vec<Buffer>,
        overrides: Vec<(&'static str, u32)>,
        values: [f32; 8],
    ) -> Result<()> {
        let n = typed[0].len;
        if n == 0 {
            return Ok(());
        }
        let widest = typed.iter().map(|b| b.dtype.size()).max().unwrap_or(4);
        for band in self.bands(kernel.name, n, widest)? {
            let words = pairs(band.len);
            let mut params = vec![band.len as u32, words];
            params.extend(values.iter().map(|v| v.to_bits()));
            params.extend([0, 0]);
            // An absent optional slot is bound to the scratch buffer, not banded.
            let ranges = band.ranges(
                typed
                    .iter()
                    .enumerate()
                    .filter(|(i, _)| buffers[*i] != SCRATCH_ID),
            );
            self.dispatch(
                s,
                Dispatch {
                    kernel,
                    reprs: typed.iter().map(|b| self.repr(b.dtype)).collect(),
                    consts: vec![],
                    overrides: overrides.clone(),
                    buffers: buffers.clone(),
                    ranges,
                    params,
                    groups: (groups(words), 1, 1),
                },
            )?;
        }
        Ok(())
    }

    /// An elementwise kernel over typed slots that all have the first slot's length.
    fn elementwise(
        &self,
        s: &mut Self::State,
        kernel: &'static KernelSource,
        constant: Option<(&'static str, u32)>,
        slots: &[&Buffer],
        alpha: f32,
    ) -> Result<()> {
        let len = slots[0].len;
        if len == 0 {
            return Ok(());
        }
        let widest = slots.iter().map(|b| b.dtype.size()).max().unwrap_or(4);
        for band in self.bands(kernel.name, len, widest)? {
            let words = pairs(band.len);
            let ranges = band.ranges(slots.iter().enumerate().map(|(i, b)| (i, *b)));
            self.dispatch(
                s,
                Dispatch {
                    kernel,
                    reprs: slots.iter().map(|b| self.repr(b.dtype)).collect(),
                    consts: vec![],
                    overrides: constant.into_iter().collect(),
                    buffers: slots.iter().map(|b| b.id).collect(),
                    ranges,
                    params: vec![band.len as u32, words, alpha.to_bits(), 0],
                    groups: (groups(words), 1, 1),
                },
            )?;
        }
        Ok(())
    }

    /// How a row kernel (`common/row_reduce.wgsl`) covers `rows` rows of `cols`: its
    /// ROW_LANES override and grid. CPU adapters walk a row per invocation when there
    /// are rows enough to fill the workgroups: a barrier there costs a switch through
    /// every invocation of the workgroup, which dominated the GPT's step on lavapipe
    /// (measured with KILN_PROFILE: softmax and layer norm were 45% of it). GPUs give a
    /// short row one warp-sized group and a long row the whole workgroup.
    /// Rows per band of a row-wise kernel whose `wide` buffers hold `cols` elements a
    /// row (its per-row u32/f32 buffers one element a row): all of them when every
    /// buffer fits one binding, else the most that do, a multiple of the rows that put
    /// every buffer's band on a 256-byte boundary.
    fn row_band(&self, what: &str, rows: usize, wide: &[(&Buffer, usize)]) -> Result<usize> {
        let limit = self.caps().max_storage_binding as usize;
        let row_bytes: Vec<usize> = wide.iter().map(|(b, cols)| b.dtype.size() * cols).collect();
        let widest = row_bytes.iter().copied().max().unwrap_or(4).max(4);
        if rows * widest <= limit {
            return Ok(rows.max(1));
        }
        // 64 rows of 4 bytes; a 16-bit row of odd length needs 128.
        let step = row_bytes
            .iter()
            .map(|&rb| 256 / gcd(rb, 256))
            .fold(64, |a, b| a / gcd(a, b) * b);
        let band = (limit / widest) / step * step;
        if band == 0 {
            return Err(kiln_engine::Error::Unsupported {
                device: self.caps().name.clone(),
                what: format!(
                    "{what} over rows of {widest} bytes: the per-binding limit of {limit} \
                     bytes holds no band of {step} rows"
                ),
            });
        }
        Ok(band)
    }

    fn row_plan(&self, rows: u32, cols: u32) -> (Overrides, (u32, u32, u32)) {
        let lanes = if self.caps().device_type == "cpu" {
            if rows >= 128 {
                1
            } else {
                256
            }
        } else if cols <= 256 {
            32
        } else {
            256
        };
        (
            vec![("ROW_LANES", lanes)],
            row_groups(rows.div_ceil(256 / lanes)),
        )
    }

    /// How an elementwise kernel over `len` elements, of which the widest buffer holds
    /// `widest` bytes each, walks its buffers within the adapter's per-binding limit:
    /// bands, one bound whole when everything fits. A flat buffer of parameters
    /// or moments is larger than lavapipe's 128 MiB binding from GPT-2 small up, and
    /// these kernels touch each element alone, so a buffer bound band by band gives the
    /// same values as one bound whole.
    fn bands(&self, what: &str, len: usize, widest: usize) -> Result<Vec<Band>> {
        let limit = self.caps().max_storage_binding;
        if (len * widest) as u64 <= limit {
            return Ok(vec![Band {
                start: 0,
                len,
                whole: true,
            }]);
        }
        let band = (limit as usize / widest) / BAND_GRANULE * BAND_GRANULE;
        if band == 0 {
            return Err(kiln_engine::Error::Unsupported {
                device: self.caps().name.clone(),
                what: format!(
                    "`{what}` over {len} elements in bands: a per-binding limit of {limit} \
                     bytes holds fewer than {BAND_GRANULE} elements of {widest} bytes"
                ),
            });
        }
        Ok((0..len)
            .step_by(band)
            .map(|start| Band {
                start,
                len: band.min(len - start),
                whole: false,
            })
            .collect())
    }
}

impl<R: Recorder + ?Sized> Lower for R {}

/// Records `kernel` (validated, its buffers live on the device) through `r`.
pub fn record_kernel<R: Recorder + ?Sized>(r: &R, s: &mut R::State, kernel: &Kernel) -> Result<()> {
    Lower::record_kernel(r, s, kernel)
}

/// The KIND override of the activation kernels (common/activation.wgsl).
fn activation_code(kind: ActivationKind) -> u32 {
    match kind {
        ActivationKind::Relu => 0,
        ActivationKind::Tanh => 1,
        ActivationKind::Silu => 2,
    }
}

/// A 2-D grid of at least `rows` workgroups (one per row; 65535 per dimension).
/// Pipeline-overridable constants of one dispatch.
type Overrides = Vec<(&'static str, u32)>;

fn row_groups(rows: u32) -> (u32, u32, u32) {
    let x = rows.clamp(1, MAX_GROUPS);
    (x, rows.div_ceil(x).max(1), 1)
}

/// The rotary embedding's exponent step `2 log2(theta) / dim` (so that `theta^(-2i /
/// dim) = 2^(-i step)`), worked out in f64 and split into a high part of 11 significant
/// bits, whose product with any frequency index below 2^13 is exact in f32, and the rest.
fn rope_step(theta: f32, dim: usize) -> [f32; 2] {
    let step = 2.0 * (theta as f64).log2() / dim as f64;
    let hi = f32::from_bits((step as f32).to_bits() & !0x1fff);
    [hi, (step - hi as f64) as f32]
}

/// The band rescaling's parameters of `shaders/common/rope_params.wgsl`: the original
/// context over 2 pi, the low and high factors, and 1 / factor (1: no scaling, which the
/// shader skips).
fn rope_scaling(freqs: &RopeFreqs) -> [u32; 4] {
    let [ctx, lo, hi, slow] = match freqs.scaling {
        None => [0.0, 0.0, 1.0, 1.0],
        Some(s) => [
            (s.original_max_position_embeddings as f64 / std::f64::consts::TAU) as f32,
            s.low_freq_factor,
            s.high_freq_factor,
            (1.0 / s.factor as f64) as f32,
        ],
    };
    [ctx.to_bits(), lo.to_bits(), hi.to_bits(), slow.to_bits()]
}

fn gcd(a: usize, b: usize) -> usize {
    if b == 0 {
        a
    } else {
        gcd(b, a % b)
    }
}

/// The parameter block of `shaders/common/cache_params.wgsl`.
fn cache_params(
    n: u32,
    (heads, dim, width, offset, max_len): (usize, usize, usize, usize, usize),
    (rows_per_seq, kv_heads, group): (usize, usize, usize),
    scale: f32,
    total: usize,
) -> Vec<u32> {
    let mut p: Vec<u32> = [
        heads,
        dim,
        width,
        offset,
        max_len,
        rows_per_seq,
        kv_heads,
        group,
    ]
    .iter()
    .map(|&v| v as u32)
    .collect();
    p.insert(0, n);
    p.extend([scale.to_bits(), total as u32, 0]);
    p
}

/// Pairs of elements an elementwise kernel walks.
fn pairs(len: usize) -> u32 {
    len.div_ceil(2) as u32
}

/// Elements a band starts on a multiple of: 256 bytes (WebGPU's storage offset
/// alignment on every adapter) of the narrowest dtype, 16-bit.
const BAND_GRANULE: usize = 128;

/// The `(slot, byte offset, byte size)` ranges binding rows `first..first + n` of a
/// row-wise kernel: `wide` buffers hold `cols` elements a row, `narrow` ones one.
fn row_ranges(
    first: usize,
    n: usize,
    cols: usize,
    wide: &[(usize, &Buffer)],
    narrow: &[(usize, &Buffer)],
) -> Vec<(usize, u64, u64)> {
    let band = |start, len| Band {
        start,
        len,
        whole: false,
    };
    let mut r = band(first * cols, n * cols).ranges(wide.iter().copied());
    r.extend(band(first, n).ranges(narrow.iter().copied()));
    r
}

/// Elements `[start, start + len)` of a kernel's buffers, one pass of it; `whole` when
/// the pass covers them all and they fit one binding, so they are bound whole.
#[derive(Clone, Copy)]
pub(crate) struct Band {
    start: usize,
    len: usize,
    whole: bool,
}

impl Band {
    /// The `(slot, byte offset, byte size)` ranges that bind `slots` to this band; none
    /// for a band bound whole.
    fn ranges<'b>(
        self,
        slots: impl IntoIterator<Item = (usize, &'b Buffer)>,
    ) -> Vec<(usize, u64, u64)> {
        if self.whole {
            return vec![];
        }
        slots
            .into_iter()
            .map(|(slot, b)| {
                (
                    slot,
                    (self.start * b.dtype.size()) as u64,
                    b.dtype.padded_bytes(self.len),
                )
            })
            .collect()
    }
}

/// The 32-bit word `fill` writes for `value` in `dtype`.
fn fill_pattern(dtype: DType, value: f64) -> u32 {
    match dtype {
        DType::F32 => (value as f32).to_bits(),
        DType::F16 => {
            let h = half::f16::from_f64(value).to_bits() as u32;
            h | (h << 16)
        }
        DType::BF16 => {
            let h = half::bf16::from_f64(value).to_bits() as u32;
            h | (h << 16)
        }
        DType::U32 => value as u32,
    }
}
