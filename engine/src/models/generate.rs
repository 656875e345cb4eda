//! Text generation with a key/value cache on the device: each new token runs the model
//! for its own position only, attending to the keys and values every earlier position
//! left in the cache, instead of recomputing the whole prefix.
//!
//! A [`Generator`] holds one sequence of any [`Decoder`] (GPT-2, the Llama family):
//! the weights in the activation dtype, a K and a V cache per layer, `(KV, max_len, D)`,
//! and one forward pass per row count ("pass"). A pass is the model's own forward,
//! recorded on a decoding graph ([`Graph::decoding`]: attention reads and extends the
//! caches, RoPE and position embeddings read each row's position from the device),
//! pruned to what the next token's logits need ([`Graph::decode_pass`]: no loss; the
//! final norm and head on the last row) and compiled once ([`Graph::compile_forward`]).
//! Each call uploads the token ids and their positions into the pass's two small u32
//! buffers and replays it, so nothing is recompiled per token and no architecture has
//! a second, hand-written forward. A prompt runs as passes of 64, 32, … 1 rows (its
//! binary decomposition): every row of a pass writes its K/V first, then attends over
//! the cache up to its own position, which is causal attention within the pass.
//!
//! Shapes: KV K/V heads, D the head dim, V vocabulary, R rows of a pass.

use std::collections::BTreeMap;

use super::Decoder;
use crate::graph::{ForwardPlan, Graph, Tensor};
use crate::{Buffer, DType, Device, Error, HostData, Result};

/// The most rows one prefill pass runs at once: a longer prompt is several passes.
/// Larger passes save launches on long prompts but cost activation memory per pass.
pub const PREFILL_ROWS: usize = 64;

/// One compiled forward pass over `rows` new tokens.
struct Pass {
    rows: usize,
    tokens: Buffer,
    positions: Option<Buffer>,
    /// The last row's logits, (Vp) in the activation dtype.
    logits: Buffer,
    plan: ForwardPlan,
}

/// A language model on one device that generates one sequence token by token.
pub struct Generator {
    model: Box<dyn Decoder>,
    dtype: DType,
    max_len: usize,
    /// Logits that are classes (a padded vocabulary's real size).
    vocab: usize,
    /// Parameters in [`Model::parameters`](super::Model::parameters) order, in `dtype`.
    weights: Vec<Buffer>,
    /// (K, V) per layer, each `(KV, max_len, D)` in `dtype`.
    caches: Vec<(Buffer, Buffer)>,
    passes: BTreeMap<usize, Pass>,
    position: usize,
}

impl Generator {
    /// Uploads `weights` (every parameter of `model` by its name or its tied name, as
    /// [`Network::parameters`](super::Network::parameters) returns them, f32, rounded
    /// once to `dtype`) and allocates caches for `max_len` positions (at most what the
    /// model allows: [`Decoder::check_context`]).
    pub fn new(
        dev: &dyn Device,
        model: &dyn Decoder,
        weights: &[(String, Vec<f32>)],
        dtype: DType,
        max_len: usize,
    ) -> Result<Generator> {
        if !dtype.is_float() {
            return Err(Error::InvalidArgument(format!(
                "generate: activations must be f32, f16 or bf16, not {dtype}"
            )));
        }
        model.check_sizes()?;
        model.check_context(max_len)?;
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
            model: model.with_seq(1),
            dtype,
            max_len,
            vocab: 0,
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
            gen.pass(dev, 1)
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
        let vocab = self.vocab;
        if let Some(&t) = tokens.iter().find(|&&t| t as usize >= vocab) {
            return Err(Error::InvalidArgument(format!(
                "generate: token {t} is outside the vocabulary of {vocab}; check the \
                 tokenizer matches the model"
            )));
        }
        if self.position + tokens.len() > self.max_len {
            return Err(Error::InvalidArgument(format!(
                "generate: {} more tokens after {} would pass max_len {}; reset the \
                 generator or make max_len larger (as far as the model allows)",
                tokens.len(),
                self.position,
                self.max_len,
            )));
        }
        let (start, mut rest) = (self.position, tokens);
        let mut logits = None;
        while !rest.is_empty() {
            // The largest power of two that fits: a bounded set of passes serves any
            // prompt length.
            let rows = 1 << rest.len().min(PREFILL_ROWS).ilog2();
            let (chunk, tail) = rest.split_at(rows);
            match self.run(dev, chunk, tail.is_empty()) {
                Ok(l) => logits = Some(l),
                Err(e) => {
                    // All or nothing: the sequence stays as it was before the call (the
                    // cache rows the earlier passes wrote are overwritten later).
                    self.position = start;
                    return Err(e);
                }
            }
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
        self.vocab
    }

    /// The activation (and weight, and cache) dtype.
    pub fn dtype(&self) -> DType {
        self.dtype
    }

    /// Releases every device buffer.
    pub fn free(self, dev: &dyn Device) -> Result<()> {
        let mut first = Ok(());
        let mut keep = |r: Result<()>| {
            if first.is_ok() {
                first = r;
            }
        };
        for mut p in self.passes.into_values() {
            keep(p.plan.free(dev));
            keep(dev.free(p.tokens));
            if let Some(b) = p.positions {
                keep(dev.free(b));
            }
        }
        for (k, v) in self.caches {
            keep(dev.free(k));
            keep(dev.free(v));
        }
        for b in self.weights {
            keep(dev.free(b));
        }
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
        if let Some(p) = pass.positions {
            dev.upload(p, &HostData::U32((start..start + rows as u32).collect()))?;
        }
        pass.plan.run(dev)?;
        self.position += rows;
        if read {
            let mut logits = dev.download(pass.logits)?.to_f32();
            logits.truncate(self.vocab);
            Ok(Some(logits))
        } else {
            Ok(None)
        }
    }

    /// Records and compiles the pass over `rows` tokens unless it exists; the first
    /// one allocates the caches its graph asks for.
    fn pass(&mut self, dev: &dyn Device, rows: usize) -> Result<()> {
        if self.passes.contains_key(&rows) {
            return Ok(());
        }
        let (dtype, model) = (self.dtype, self.model.with_seq(rows));
        let mut g = Graph::decoding(self.max_len);
        let params = super::declare_params(&mut g, &model.parameters(), dtype)?;
        let forward = model.forward(&mut g, &params, 1, dtype)?;
        self.vocab = g.classes_of(forward.prediction);
        let (g, logits) = g.decode_pass(forward.prediction)?;
        let token_input = g.decode_tokens()?;
        if self.caches.is_empty() {
            for &(k, v) in g.decode_caches() {
                super::tensor_elements(
                    "generate: a layer's K/V cache (K/V heads × max_len × head dim)",
                    g.shape(k),
                )?;
                let len = |t: Tensor| g.shape(t).iter().product::<usize>();
                let kb = dev.alloc(dtype, len(k))?;
                match dev.alloc(dtype, len(v)) {
                    Ok(vb) => self.caches.push((kb, vb)),
                    Err(e) => {
                        let _ = dev.free(kb);
                        return Err(e);
                    }
                }
            }
        }
        if self.caches.len() != g.decode_caches().len() {
            return Err(Error::InvalidArgument(format!(
                "generate: {} records {} attention layers in a pass of {rows} rows but {} in \
                 one of 1; its forward must not depend on the sequence length",
                model.describe(),
                g.decode_caches().len(),
                self.caches.len()
            )));
        }
        let tokens = dev.alloc(DType::U32, rows)?;
        let positions = match g.decode_positions() {
            Some(_) => match dev.alloc(DType::U32, rows) {
                Ok(p) => Some(p),
                Err(e) => {
                    let _ = dev.free(tokens);
                    return Err(e);
                }
            },
            None => None,
        };
        let mut inputs = vec![(token_input, tokens)];
        inputs.extend(g.decode_positions().zip(positions));
        for (&(k, v), &(kb, vb)) in g.decode_caches().iter().zip(&self.caches) {
            inputs.extend([(k, kb), (v, vb)]);
        }
        match g.compile_forward(dev, &self.weights, &inputs) {
            Ok(plan) => {
                let logits = plan
                    .buffer(logits)
                    .expect("the logits are the pass's output");
                let pass = Pass {
                    rows,
                    tokens,
                    positions,
                    logits,
                    plan,
                };
                self.passes.insert(rows, pass);
                Ok(())
            }
            Err(e) => {
                let _ = dev.free(tokens);
                positions.map(|p| dev.free(p));
                Err(e)
            }
        }
    }
}

impl std::fmt::Debug for Generator {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Generator")
            .field("model", &self.model.describe())
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
            self.plan.launch_count()
        )
    }
}
