//! Text generation with a key/value cache on the device: each new token runs the model
//! for its own position only, attending to the keys and values every earlier position
//! left in the cache, instead of recomputing the whole prefix.
//!
//! A [`Generator`] holds one sequence: the weights in the activation dtype, a K and a V
//! cache per layer, `(1, H, max_len, D)`, and one forward pass per row count ("pass"),
//! recorded once as a list of kernel launches over fixed buffers and replayed for every
//! call: the token ids and their positions are uploaded into small u32 buffers that the
//! launches read ([`Kernel::CacheWrite`], [`Kernel::CachedAttention`] and the position
//! embedding), so nothing is recompiled per token and the backend's pipelines and bind
//! groups are made once. A prompt runs as passes of 64, 32, … 1 rows (its binary
//! decomposition): every row of a pass writes its K/V first, then attends over the
//! cache up to its own position, which is causal attention within the pass.
//!
//! Shapes: C = n_embd, H heads, D = C / H, V vocabulary, R rows of a pass.

use std::collections::BTreeMap;

use super::gpt::Gpt;
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

/// A GPT-2 on one device that generates one sequence token by token.
pub struct Generator {
    model: Gpt,
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
        use super::Model;
        let cfg = &model.config;
        cfg.check()?;
        if !dtype.is_float() {
            return Err(Error::InvalidArgument(format!(
                "generate: activations must be f32, f16 or bf16, not {dtype}"
            )));
        }
        let (c, h) = (cfg.n_embd, cfg.n_head);
        if h == 0 || c % h != 0 || c % 2 != 0 {
            return Err(Error::InvalidArgument(format!(
                "generate: n_embd {c} must be even and divisible by n_head {h}"
            )));
        }
        let dim = c / h;
        if dim > crate::ATTENTION_MAX_DIM || (dtype.size() == 2 && dim % 2 != 0) {
            return Err(Error::InvalidArgument(format!(
                "generate: the cached attention takes head dims up to {} (even for 16-bit \
                 activations), not {dim} (n_embd {c} / n_head {h})",
                crate::ATTENTION_MAX_DIM
            )));
        }
        if max_len == 0 || max_len > cfg.block_size {
            return Err(Error::InvalidArgument(format!(
                "generate: max_len {max_len} must be 1..={} (the model's block_size: its \
                 position embedding has that many rows)",
                cfg.block_size
            )));
        }
        super::tensor_elements(
            "generate: a layer's K/V cache (n_head × max_len × head dim)",
            &[h, max_len, dim],
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
            model: model.clone(),
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
            for _ in 0..cfg.n_layer {
                let k = dev.alloc(dtype, h * max_len * dim)?;
                match dev.alloc(dtype, h * max_len * dim) {
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
        let vocab = self.model.config.vocab_size;
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
                self.model.config.block_size
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
        self.model.config.vocab_size
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

    /// The launches of GPT-2's forward for `rows` new tokens, mirroring
    /// [`Gpt`]'s recorded forward op for op (so that the same roundings happen), with
    /// attention over the cache and the head applied to the last row only.
    fn record(&self, dev: &dyn Device, rows: usize, owned: &mut Vec<Buffer>) -> Result<Pass> {
        let cfg = &self.model.config;
        let (c, h, v) = (cfg.n_embd, cfg.n_head, cfg.vocab_size);
        let dim = c / h;
        let act = self.dtype;
        let mut alloc = |dtype: DType, len: usize| -> Result<Buffer> {
            let b = dev.alloc(dtype, len)?;
            owned.push(b);
            Ok(b)
        };
        let tokens = alloc(DType::U32, rows)?;
        let positions = alloc(DType::U32, rows)?;
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
        let logits = alloc(act, v)?;
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
        // Only the last row's logits are needed: gather it (an embedding lookup of row
        // R - 1 of x) so that the final norm and the V-wide head run on one row.
        let n = w.len();
        let last = if rows > 1 {
            let index = alloc(DType::U32, 1)?;
            dev.upload(index, &HostData::U32(vec![rows as u32 - 1]))?;
            let row = alloc(act, c)?;
            launches.push(Kernel::Embedding {
                tokens: index,
                table: x0,
                out: row,
                dim: c,
            });
            row
        } else {
            x0
        };
        let xf = alloc(act, c)?;
        let (mean1, rstd1) = (alloc(DType::F32, 1)?, alloc(DType::F32, 1)?);
        launches.push(Kernel::LayerNorm {
            x: last,
            weight: w[n - 2],
            bias: w[n - 1],
            out: xf,
            mean: mean1,
            rstd: rstd1,
            cols: c,
            eps: LN_EPS,
        });
        // Tied head: logits (1, V) = xf wte^T.
        launches.push(Kernel::Matmul(
            Matmul::new(xf, wte, logits, 1, v, c).transpose(false, true),
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
}

impl std::fmt::Debug for Generator {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Generator")
            .field("model", &self.model.config)
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
