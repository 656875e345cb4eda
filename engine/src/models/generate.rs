//! Text generation with a key/value cache on the device: each new token runs the model
//! for its own position only, attending to the keys and values every earlier position
//! left in the cache, instead of recomputing the whole prefix.
//!
//! A [`Generator`] (a GPT-2, [`Generator::new`], or a Llama, [`Generator::llama`])
//! holds one sequence: the weights in the activation dtype, a K and a V cache per
//! layer, `(1, KV, max_len, D)` (KV: the K/V heads; H for GPT-2), and one forward pass
//! per row count ("pass"), recorded once as a list of kernel launches over fixed
//! buffers and replayed for every call: the token ids and their positions are uploaded into small u32 buffers that the
//! launches read ([`Kernel::CacheWrite`], [`Kernel::CachedAttention`] and the position
//! embedding), so nothing is recompiled per token and the backend's pipelines and bind
//! groups are made once. A prompt runs as passes of 64, 32, … 1 rows (its binary
//! decomposition): every row of a pass writes its K/V first, then attends over the
//! cache up to its own position, which is causal attention within the pass.
//!
//! A Llama's positions reach RoPE through [`Kernel::RopeAt`], which reads them from the
//! same u32 buffer.
//!
//! Shapes: C = n_embd, H heads, KV K/V heads, D the head dim (C / H for GPT-2; a
//! Llama's may be given apart), V vocabulary, R rows of a pass.

use std::collections::BTreeMap;

use super::gpt::{Gpt, GptConfig};
use super::llama::{Llama, LlamaConfig};
use super::Model;
use crate::device::kernel::BinaryOp;
use crate::{Buffer, DType, Device, Error, HostData, Kernel, Matmul, Result};

/// The most rows one prefill pass runs at once: a longer prompt is several passes.
/// Larger passes save launches on long prompts but cost activation memory per pass.
pub const PREFILL_ROWS: usize = 64;

/// GPT-2's layer-norm epsilon, as the training graph records it.
const LN_EPS: f32 = 1e-5;

/// One recorded forward pass over `rows` new tokens.
struct Pass {
    rows: usize,
    tokens: Buffer,
    positions: Buffer,
    /// The last row's logits, (V) in the activation dtype.
    logits: Buffer,
    launches: Vec<Kernel>,
    /// Every buffer the pass allocated (freed with it).
    owned: Vec<Buffer>,
}

/// The architectures a generator runs, with the sizes it needs.
#[derive(Clone, Debug)]
enum Arch {
    Gpt(GptConfig),
    Llama(LlamaConfig),
}

impl Arch {
    /// (n_embd, query heads, K/V heads, vocabulary, block_size, layers).
    fn sizes(&self) -> (usize, usize, usize, usize, usize, usize) {
        match self {
            Arch::Gpt(c) => (
                c.n_embd,
                c.n_head,
                c.n_head,
                c.vocab_size,
                c.block_size,
                c.n_layer,
            ),
            Arch::Llama(c) => (
                c.n_embd,
                c.n_head,
                c.kv_heads(),
                c.vocab_size,
                c.block_size,
                c.n_layer,
            ),
        }
    }
}

impl Arch {
    /// D, each head's width (0 where n_embd does not split into GPT-2's heads).
    fn head_dim(&self) -> usize {
        match self {
            Arch::Gpt(c) if c.n_head > 0 && c.n_embd % c.n_head == 0 => c.n_embd / c.n_head,
            Arch::Gpt(_) => 0,
            Arch::Llama(c) => c.head_dim(),
        }
    }
}

/// A GPT-2 or a Llama on one device that generates one sequence token by token.
pub struct Generator {
    arch: Arch,
    dtype: DType,
    max_len: usize,
    /// Parameters in [`Model::parameters`](super::Model::parameters) order, in `dtype`.
    weights: Vec<Buffer>,
    /// (K, V) per layer, each `(H, max_len, D)` in `dtype`.
    caches: Vec<(Buffer, Buffer)>,
    passes: BTreeMap<usize, Pass>,
    position: usize,
}

impl Generator {
    /// Uploads `weights` (every parameter of `model` by its name or its tied name, as
    /// [`Network::parameters`](super::Network::parameters) returns them, f32, rounded
    /// once to `dtype`) and allocates caches for `max_len` positions (at most the
    /// model's `block_size`: GPT-2 has no position embedding past it).
    pub fn new(
        dev: &dyn Device,
        model: &Gpt,
        weights: &[(String, Vec<f32>)],
        dtype: DType,
        max_len: usize,
    ) -> Result<Generator> {
        model.config.check()?;
        let arch = Arch::Gpt(model.config.clone());
        Generator::build(dev, arch, model, weights, dtype, max_len)
    }

    /// [`Generator::new`] for a Llama: RoPE at each token's position, grouped-query
    /// attention over a cache of the K/V heads, `max_len` at most `block_size` (the
    /// positions it was trained on).
    pub fn llama(
        dev: &dyn Device,
        model: &Llama,
        weights: &[(String, Vec<f32>)],
        dtype: DType,
        max_len: usize,
    ) -> Result<Generator> {
        model.config.check()?;
        let arch = Arch::Llama(model.config.clone());
        Generator::build(dev, arch, model, weights, dtype, max_len)
    }

    fn build(
        dev: &dyn Device,
        arch: Arch,
        model: &dyn Model,
        weights: &[(String, Vec<f32>)],
        dtype: DType,
        max_len: usize,
    ) -> Result<Generator> {
        if !dtype.is_float() {
            return Err(Error::InvalidArgument(format!(
                "generate: activations must be f32, f16 or bf16, not {dtype}"
            )));
        }
        let (c, h, kvh, _, block_size, n_layer) = arch.sizes();
        let dim = arch.head_dim();
        if h == 0 || dim == 0 || !c.is_multiple_of(2) || kvh == 0 || !h.is_multiple_of(kvh) {
            return Err(Error::InvalidArgument(format!(
                "generate: n_embd {c} must be even and split into n_head {h} heads (or \
                 head_dim be given), and n_head a multiple of the {kvh} K/V heads"
            )));
        }
        let rope = matches!(arch, Arch::Llama(_));
        let odd = !dim.is_multiple_of(2);
        if dim > crate::ATTENTION_MAX_DIM || ((dtype.size() == 2 || rope) && odd) {
            return Err(Error::InvalidArgument(format!(
                "generate: the cached attention takes head dims up to {} (even for 16-bit \
                 activations and RoPE), not {dim} ({h} heads on n_embd {c})",
                crate::ATTENTION_MAX_DIM
            )));
        }
        if max_len == 0 || max_len > block_size {
            return Err(Error::InvalidArgument(format!(
                "generate: max_len {max_len} must be 1..={block_size} (the model's \
                 block_size: the positions it has weights or training for)"
            )));
        }
        if let Arch::Llama(LlamaConfig {
            sliding_window: Some(w),
            ..
        }) = &arch
        {
            if max_len > *w {
                return Err(Error::InvalidArgument(format!(
                    "generate: max_len {max_len} is past the model's sliding window of {w}; \
                     the cached attention is full attention, equal to the window's only up \
                     to {w} positions: generate at most {w}"
                )));
            }
        }
        super::tensor_elements(
            "generate: a layer's K/V cache (n_head × max_len × head dim)",
            &[kvh, max_len, dim],
        )?;
        let specs = model.parameters();
        let limit = dev.caps().max_storage_binding;
        let mut found = Vec::with_capacity(specs.len());
        for spec in &specs {
            let values = weights
                .iter()
                .find(|(n, _)| *n == spec.name || Some(n) == spec.tied.as_ref())
                .map(|(_, v)| v)
                .ok_or_else(|| {
                    Error::InvalidArgument(format!(
                        "generate: no weights for `{}` ({:?}); pass every parameter of {}",
                        spec.name,
                        spec.shape,
                        model.describe()
                    ))
                })?;
            if values.len() != spec.len() {
                return Err(Error::InvalidArgument(format!(
                    "generate: `{}` has {} values, but {} needs {:?} = {}",
                    spec.name,
                    values.len(),
                    model.describe(),
                    spec.shape,
                    spec.len()
                )));
            }
            let bytes = dtype.padded_bytes(values.len());
            if bytes > limit {
                return Err(Error::InvalidArgument(format!(
                    "generate: `{}` {:?} is {bytes} bytes in {dtype}, over the {limit} bytes one \
                     kernel binding can see on {}; generate with 16-bit activations (f16 or \
                     bf16) or on a device with larger bindings",
                    spec.name,
                    spec.shape,
                    dev.caps().name
                )));
            }
            found.push(values);
        }
        let mut gen = Generator {
            arch,
            dtype,
            max_len,
            weights: vec![],
            caches: vec![],
            passes: BTreeMap::new(),
            position: 0,
        };
        let built = (|| {
            for values in found {
                let b = dev.alloc(dtype, values.len())?;
                gen.weights.push(b);
                dev.upload(b, &HostData::from_f32(dtype, values))?;
            }
            for _ in 0..n_layer {
                let k = dev.alloc(dtype, kvh * max_len * dim)?;
                match dev.alloc(dtype, kvh * max_len * dim) {
                    Ok(v) => gen.caches.push((k, v)),
                    Err(e) => {
                        let _ = dev.free(k);
                        return Err(e);
                    }
                }
            }
            gen.pass(dev, 1)?;
            Ok(())
        })();
        match built {
            Ok(()) => Ok(gen),
            Err(e) => {
                // Whatever was allocated goes back before the error does.
                let _ = gen.free(dev);
                Err(e)
            }
        }
    }

    /// Appends `tokens` to the sequence (the prompt, or more of it) and returns the
    /// logits (V, f32) that follow the last of them. Earlier positions are never run
    /// again: their keys and values are in the cache.
    pub fn prefill(&mut self, dev: &dyn Device, tokens: &[u32]) -> Result<Vec<f32>> {
        if tokens.is_empty() {
            return Err(Error::InvalidArgument(
                "generate: prefill of no tokens; pass at least one (a start token for an \
                 empty prompt)"
                    .into(),
            ));
        }
        let (.., vocab, block_size, _) = self.arch.sizes();
        if let Some(&t) = tokens.iter().find(|&&t| t as usize >= vocab) {
            return Err(Error::InvalidArgument(format!(
                "generate: token {t} is outside the vocabulary of {vocab}; check the \
                 tokenizer matches the model"
            )));
        }
        if self.position + tokens.len() > self.max_len {
            return Err(Error::InvalidArgument(format!(
                "generate: {} more tokens after {} would pass max_len {}; reset the \
                 generator or make max_len larger (up to block_size {})",
                tokens.len(),
                self.position,
                self.max_len,
                block_size
            )));
        }
        let mut rest = tokens;
        let mut logits = None;
        while !rest.is_empty() {
            // The largest power of two that fits: a bounded set of passes serves any
            // prompt length.
            let rows = 1 << rest.len().min(PREFILL_ROWS).ilog2();
            let (chunk, tail) = rest.split_at(rows);
            logits = Some(self.run(dev, chunk, tail.is_empty())?);
            rest = tail;
        }
        Ok(logits.flatten().expect("the last pass reads its logits"))
    }

    /// Appends one token and returns the logits (V, f32) of the next.
    pub fn step(&mut self, dev: &dyn Device, token: u32) -> Result<Vec<f32>> {
        self.prefill(dev, &[token])
    }

    /// Starts a new sequence (the cache rows are overwritten as it grows).
    pub fn reset(&mut self) {
        self.position = 0;
    }

    /// Tokens in the sequence so far.
    pub fn position(&self) -> usize {
        self.position
    }

    /// The most tokens a sequence may hold.
    pub fn max_len(&self) -> usize {
        self.max_len
    }

    /// Logits per position.
    pub fn vocab(&self) -> usize {
        self.arch.sizes().3
    }

    /// The activation (and weight, and cache) dtype.
    pub fn dtype(&self) -> DType {
        self.dtype
    }

    /// Releases every device buffer.
    pub fn free(self, dev: &dyn Device) -> Result<()> {
        let mut first = Ok(());
        let mut release = |b: Buffer| {
            if let Err(e) = dev.free(b) {
                if first.is_ok() {
                    first = Err(e);
                }
            }
        };
        for p in self.passes.into_values() {
            p.owned.into_iter().for_each(&mut release);
        }
        for (k, v) in self.caches {
            release(k);
            release(v);
        }
        self.weights.into_iter().for_each(&mut release);
        first
    }

    /// Runs `tokens` (a pass's worth) at the next positions; downloads the last row's
    /// logits when `read`.
    fn run(&mut self, dev: &dyn Device, tokens: &[u32], read: bool) -> Result<Option<Vec<f32>>> {
        let rows = tokens.len();
        self.pass(dev, rows)?;
        let pass = &self.passes[&rows];
        let start = self.position as u32;
        dev.upload(pass.tokens, &HostData::U32(tokens.to_vec()))?;
        let positions = (start..start + rows as u32).collect();
        dev.upload(pass.positions, &HostData::U32(positions))?;
        for k in &pass.launches {
            dev.launch(k)?;
        }
        dev.submit()?;
        self.position += rows;
        if read {
            Ok(Some(dev.download(pass.logits)?.to_f32()))
        } else {
            Ok(None)
        }
    }

    /// Records the pass over `rows` tokens unless it exists.
    fn pass(&mut self, dev: &dyn Device, rows: usize) -> Result<()> {
        if self.passes.contains_key(&rows) {
            return Ok(());
        }
        let mut owned = vec![];
        let built = self.record(dev, rows, &mut owned);
        match built {
            Ok(pass) => {
                self.passes.insert(rows, pass);
                Ok(())
            }
            Err(e) => {
                for b in owned {
                    let _ = dev.free(b);
                }
                Err(e)
            }
        }
    }

    /// The launches of the model's forward for `rows` new tokens, mirroring its
    /// recorded forward op for op (so that the same roundings happen), with attention
    /// over the cache and the final norm and head applied to the last row only.
    fn record(&self, dev: &dyn Device, rows: usize, owned: &mut Vec<Buffer>) -> Result<Pass> {
        let (c, _, _, v, _, _) = self.arch.sizes();
        let act = self.dtype;
        let tokens = alloc(dev, owned, DType::U32, rows)?;
        let positions = alloc(dev, owned, DType::U32, rows)?;
        let (mut launches, x) = match &self.arch {
            Arch::Gpt(_) => self.gpt_layers(dev, rows, tokens, positions, owned)?,
            Arch::Llama(cfg) => self.llama_layers(dev, cfg, rows, tokens, positions, owned)?,
        };
        // Only the last row's logits are needed: gather it (an embedding lookup of row
        // R - 1 of x) so that the final norm and the V-wide head run on one row.
        let last = if rows > 1 {
            let index = alloc(dev, owned, DType::U32, 1)?;
            dev.upload(index, &HostData::U32(vec![rows as u32 - 1]))?;
            let row = alloc(dev, owned, act, c)?;
            launches.push(Kernel::Embedding {
                tokens: index,
                table: x,
                out: row,
                dim: c,
            });
            row
        } else {
            x
        };
        let xf = alloc(dev, owned, act, c)?;
        let rstd = alloc(dev, owned, DType::F32, 1)?;
        let w = &self.weights;
        let n = w.len();
        let head = match &self.arch {
            Arch::Gpt(_) => {
                let mean = alloc(dev, owned, DType::F32, 1)?;
                launches.push(Kernel::LayerNorm {
                    x: last,
                    weight: w[n - 2],
                    bias: w[n - 1],
                    out: xf,
                    mean,
                    rstd,
                    cols: c,
                    eps: LN_EPS,
                });
                w[0]
            }
            Arch::Llama(cfg) => {
                let norm = 1 + cfg.per_block() * cfg.n_layer;
                launches.push(Kernel::RmsNorm {
                    x: last,
                    weight: w[norm],
                    out: xf,
                    rstd,
                    cols: c,
                    eps: cfg.rms_norm_eps,
                });
                if cfg.tie_word_embeddings {
                    w[0]
                } else {
                    w[norm + 1]
                }
            }
        };
        // The head, (V, C) in both models: logits (1, V) = xf head^T.
        let logits = alloc(dev, owned, act, v)?;
        launches.push(Kernel::Matmul(
            Matmul::new(xf, head, logits, 1, v, c).transpose(false, true),
        ));
        for k in &launches {
            k.validate()?;
        }
        Ok(Pass {
            rows,
            tokens,
            positions,
            logits,
            launches,
            owned: std::mem::take(owned),
        })
    }

    /// GPT-2's embeddings and blocks over `rows` tokens; returns the launches and the
    /// buffer holding the residual stream after the last block.
    fn gpt_layers(
        &self,
        dev: &dyn Device,
        rows: usize,
        tokens: Buffer,
        positions: Buffer,
        owned: &mut Vec<Buffer>,
    ) -> Result<(Vec<Kernel>, Buffer)> {
        let (c, h, _, _, _, _) = self.arch.sizes();
        let dim = c / h;
        let act = self.dtype;
        let mut alloc = |dtype: DType, len: usize| alloc(dev, owned, dtype, len);
        let tok = alloc(act, rows * c)?;
        let pe = alloc(act, rows * c)?;
        let x0 = alloc(act, rows * c)?;
        let x1 = alloc(act, rows * c)?;
        let a = alloc(act, rows * c)?;
        let y = alloc(act, rows * c)?;
        let proj = alloc(act, rows * c)?;
        let mm = alloc(act, rows * c)?;
        let f2 = alloc(act, rows * c)?;
        let qkv = alloc(act, rows * 3 * c)?;
        let f = alloc(act, rows * 4 * c)?;
        let g = alloc(act, rows * 4 * c)?;
        let mean = alloc(DType::F32, rows)?;
        let rstd = alloc(DType::F32, rows)?;
        let w = &self.weights;
        let (wte, wpe) = (w[0], w[1]);
        let ln = |x: Buffer, weight: Buffer, bias: Buffer, out: Buffer| Kernel::LayerNorm {
            x,
            weight,
            bias,
            out,
            mean,
            rstd,
            cols: c,
            eps: LN_EPS,
        };
        let add = |a: Buffer, b: Buffer, out: Buffer| Kernel::Binary {
            op: BinaryOp::Add,
            a,
            b,
            out,
        };
        let linear = |x: Buffer, w: Buffer, b: Buffer, out: Buffer, n: usize, k: usize| {
            Kernel::Matmul(Matmul::new(x, w, out, rows, n, k).with_bias(b))
        };
        let mut launches = vec![
            Kernel::Embedding {
                tokens,
                table: wte,
                out: tok,
                dim: c,
            },
            Kernel::Embedding {
                tokens: positions,
                table: wpe,
                out: pe,
                dim: c,
            },
            add(tok, pe, x0),
        ];
        for (l, &(kc, vc)) in self.caches.iter().enumerate() {
            let p = &w[2 + 12 * l..2 + 12 * (l + 1)];
            launches.extend([
                ln(x0, p[0], p[1], a),
                linear(a, p[2], p[3], qkv, 3 * c, c),
                Kernel::CacheWrite {
                    src: qkv,
                    cache: kc,
                    positions,
                    heads: h,
                    dim,
                    width: 3 * c,
                    offset: c,
                    max_len: self.max_len,
                },
                Kernel::CacheWrite {
                    src: qkv,
                    cache: vc,
                    positions,
                    heads: h,
                    dim,
                    width: 3 * c,
                    offset: 2 * c,
                    max_len: self.max_len,
                },
                Kernel::CachedAttention {
                    q: qkv,
                    k_cache: kc,
                    v_cache: vc,
                    positions,
                    out: y,
                    heads: h,
                    group: 1,
                    dim,
                    width: 3 * c,
                    offset: 0,
                    max_len: self.max_len,
                    scale: 1.0 / (dim as f32).sqrt(),
                },
                linear(y, p[4], p[5], proj, c, c),
                add(x0, proj, x1),
                ln(x1, p[6], p[7], mm),
                linear(mm, p[8], p[9], f, 4 * c, c),
                Kernel::Gelu { x: f, out: g },
                linear(g, p[10], p[11], f2, c, 4 * c),
                add(x1, f2, x0),
            ]);
        }
        Ok((launches, x0))
    }

    /// A Llama's embedding and blocks over `rows` tokens (RoPE at the rows' positions,
    /// grouped-query attention over the cache); returns the launches and the residual
    /// stream after the last block.
    fn llama_layers(
        &self,
        dev: &dyn Device,
        cfg: &LlamaConfig,
        rows: usize,
        tokens: Buffer,
        positions: Buffer,
        owned: &mut Vec<Buffer>,
    ) -> Result<(Vec<Kernel>, Buffer)> {
        let (c, h, kvh, _, _, _) = self.arch.sizes();
        let (dim, inter) = (self.arch.head_dim(), cfg.intermediate());
        let qw = h * dim;
        let act = self.dtype;
        let mut alloc = |dtype: DType, len: usize| alloc(dev, owned, dtype, len);
        let x0 = alloc(act, rows * c)?;
        let x1 = alloc(act, rows * c)?;
        let n = alloc(act, rows * c)?;
        let q = alloc(act, rows * qw)?;
        let qr = alloc(act, rows * qw)?;
        let k = alloc(act, rows * kvh * dim)?;
        let kr = alloc(act, rows * kvh * dim)?;
        let v = alloc(act, rows * kvh * dim)?;
        let y = alloc(act, rows * qw)?;
        let o = alloc(act, rows * c)?;
        let gate = alloc(act, rows * inter)?;
        let up = alloc(act, rows * inter)?;
        let f = alloc(act, rows * inter)?;
        let d = alloc(act, rows * c)?;
        let rstd = alloc(DType::F32, rows)?;
        let w = &self.weights;
        let eps = cfg.rms_norm_eps;
        let norm = |x: Buffer, weight: Buffer, out: Buffer| Kernel::RmsNorm {
            x,
            weight,
            out,
            rstd,
            cols: c,
            eps,
        };
        // Every Llama linear reads its weight (out, in) transposed; only Qwen2's q, k
        // and v have biases.
        let biased = |x: Buffer, w: Buffer, b: Option<Buffer>, out, n_out, k_in| {
            let m = Matmul::new(x, w, out, rows, n_out, k_in).transpose(false, true);
            Kernel::Matmul(match b {
                Some(b) => m.with_bias(b),
                None => m,
            })
        };
        let linear = |x, w, out, n_out, k_in| biased(x, w, None, out, n_out, k_in);
        let add = |a: Buffer, b: Buffer, out: Buffer| Kernel::Binary {
            op: BinaryOp::Add,
            a,
            b,
            out,
        };
        let rope = |x: Buffer, out: Buffer, heads: usize| Kernel::RopeAt {
            x,
            out,
            positions,
            cols: heads * dim,
            dim,
            freqs: cfg.rope(),
        };
        let mut launches = vec![Kernel::Embedding {
            tokens,
            table: w[0],
            out: x0,
            dim: c,
        }];
        for (l, &(kc, vc)) in self.caches.iter().enumerate() {
            let per = cfg.per_block();
            let p = &w[1 + per * l..1 + per * (l + 1)];
            // The q, k, v biases (Qwen2) sit after their weights; the rest shift by 3.
            let (b, r) = match cfg.qkv_bias {
                true => ([Some(p[4]), Some(p[5]), Some(p[6])], &p[7..]),
                false => ([None; 3], &p[4..]),
            };
            let write = |src: Buffer, cache: Buffer| Kernel::CacheWrite {
                src,
                cache,
                positions,
                heads: kvh,
                dim,
                width: kvh * dim,
                offset: 0,
                max_len: self.max_len,
            };
            launches.extend([
                norm(x0, p[0], n),
                biased(n, p[1], b[0], q, qw, c),
                biased(n, p[2], b[1], k, kvh * dim, c),
                biased(n, p[3], b[2], v, kvh * dim, c),
                rope(q, qr, h),
                rope(k, kr, kvh),
                write(kr, kc),
                write(v, vc),
                Kernel::CachedAttention {
                    q: qr,
                    k_cache: kc,
                    v_cache: vc,
                    positions,
                    out: y,
                    heads: h,
                    group: h / kvh,
                    dim,
                    width: qw,
                    offset: 0,
                    max_len: self.max_len,
                    scale: 1.0 / (dim as f32).sqrt(),
                },
                linear(y, r[0], o, c, qw),
                add(x0, o, x1),
                norm(x1, r[1], n),
                linear(n, r[2], gate, inter, c),
                linear(n, r[3], up, inter, c),
                Kernel::SwiGlu { gate, up, out: f },
                linear(f, r[4], d, c, inter),
                add(x1, d, x0),
            ]);
        }
        Ok((launches, x0))
    }
}

/// Allocates a buffer that `owned` keeps (and frees if recording fails).
fn alloc(dev: &dyn Device, owned: &mut Vec<Buffer>, dtype: DType, len: usize) -> Result<Buffer> {
    let b = dev.alloc(dtype, len)?;
    owned.push(b);
    Ok(b)
}

impl std::fmt::Debug for Generator {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Generator")
            .field("model", &self.arch)
            .field("dtype", &self.dtype)
            .field("max_len", &self.max_len)
            .field("position", &self.position)
            .field("passes", &self.passes.keys().collect::<Vec<_>>())
            .finish()
    }
}

impl std::fmt::Debug for Pass {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "Pass({} rows, {} launches)",
            self.rows,
            self.launches.len()
        )
    }
}
