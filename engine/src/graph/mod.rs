//! Graph and autodiff: a model is written once, as a forward pass over [`Tensor`]s;
//! the engine derives the backward pass and compiles forward + backward + optimizer
//! step into a [`Plan`] of kernel launches that is replayed every step.
//!
//! - this file: the recorder. Tensors are ids with a shape and a dtype. Parameters
//!   and inputs are external: the caller binds device buffers to them at compile time.
//!   Every op checks its operands here, when it is recorded, so a bad model is an
//!   error naming the op and the shapes, never a kernel failure mid-step.
//! - `ops.rs`: each op's forward launches and its backward rule, side by side.
//! - `autodiff.rs`: the reverse sweep and how a gradient with several contributions
//!   (a tensor used twice, the tied GPT embedding) is accumulated.
//! - `plan.rs`: compilation into a flat launch list over placeholders, liveness-based
//!   sharing of intermediate buffers, and replay.
//! - `decode.rs`: the same forward recorded for generation (attention over K/V caches
//!   at positions read from the device), and the pass that runs only what the next
//!   token's logits need; `forward_plan.rs` compiles a forward alone (no backward, no
//!   optimizer) over plain weight buffers.
//! - `packing.rs`: several documents per row (packed training examples): attention
//!   within each document, positions restarting at each.
//! - `weight_stream.rs`: parameters bound to one shared model-copy buffer (ZeRO stage
//!   3) loaded from host memory before the launches that read them.
//!
//! Shapes: the last dim is the feature dim; ops treat the leading dims as rows.

mod autodiff;
mod decode;
mod forward_plan;
mod ops;
mod packing;
pub use packing::{POSITIONS as DOCUMENT_POSITIONS, STARTS as DOCUMENT_STARTS};
mod plan;
mod split;
mod weight_stream;

pub use forward_plan::ForwardPlan;
pub use plan::{Bindings, Group, Plan, PlanMemory};
pub use split::{Boundary, StageGraph};
pub use weight_stream::StreamStats;

use crate::{ActivationKind, DType, Error, HostData, Result, RopeFreqs};

/// Sequences shorter than this use the straightforward attention by default.
pub const SHORTEST_FUSED: usize = 32;

/// How causal self-attention is computed. Both give the same results up to f32
/// rounding (tests/attention.rs).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Attention {
    /// [`crate::Kernel::Attention`] and [`crate::Kernel::AttentionBackward`]: tile by
    /// tile, memory linear in T (saves one f32 log-sum-exp per row).
    #[default]
    Fused,
    /// Batched GEMMs through a (B*H, T, T) score matrix and a causal softmax; memory
    /// quadratic in T. Head dims over [`crate::ATTENTION_MAX_DIM`] need it.
    Straightforward,
}

impl Attention {
    /// Whether the fused kernels take heads of `head_dim` with activations of `dtype`
    /// (at most [`crate::ATTENTION_MAX_DIM`], and even when activations are 16-bit).
    pub fn fused_takes(head_dim: usize, dtype: DType) -> bool {
        head_dim <= crate::ATTENTION_MAX_DIM && (dtype.size() == 4 || head_dim.is_multiple_of(2))
    }

    /// Fused where the kernels take the heads and the sequence is long enough for
    /// tiles to pay, else straightforward: at T = 9 (the demo) the T×T scores are a few
    /// hundred bytes a head and the batched GEMMs beat the fused kernels (measured:
    /// the 600-step demo took 68 s fused, 59 s straightforward); from T = 128 up the
    /// fused version is 2-4x faster (`kiln bench attention`).
    pub fn best(head_dim: usize, dtype: DType, seq: usize) -> Attention {
        if seq >= SHORTEST_FUSED && Attention::fused_takes(head_dim, dtype) {
            Attention::Fused
        } else {
            Attention::Straightforward
        }
    }

    /// A model's attention: `pinned` if set, else [`Attention::best`]; an error in the
    /// model's terms (`model`: "gpt", say) when the fused kernels cannot take its heads,
    /// before anything is recorded or allocated.
    pub fn choose(
        pinned: Option<Attention>,
        (head_dim, dtype, seq): (usize, DType, usize),
        model: &str,
    ) -> Result<Attention> {
        let attention = pinned.unwrap_or_else(|| Attention::best(head_dim, dtype, seq));
        if attention == Attention::Fused && !Attention::fused_takes(head_dim, dtype) {
            return Err(Error::InvalidArgument(format!(
                "{model}: fused attention takes head dims up to {} (even in fp16/bf16), not \
                 {head_dim}; use Attention::Straightforward",
                crate::ATTENTION_MAX_DIM
            )));
        }
        Ok(attention)
    }
}

/// A tensor of a [`Graph`]: an id, meaningful only in the graph that made it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Tensor(pub(crate) usize);

/// Where a tensor's values come from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Source {
    /// A trainable parameter: index into [`Graph::params`].
    Param(usize),
    /// Data the caller uploads (tokens, targets, features): no gradient.
    Input,
    /// A weight that is not trained (a LoRA run's base model): bound to a buffer the
    /// caller holds, as an input is, but never uploaded per micro-batch; no gradient
    /// is computed for it.
    Frozen,
    /// Values fixed when the graph is recorded (token positions), uploaded once by the
    /// plan: index into [`Graph::constants`].
    Constant(usize),
    /// An op's output.
    Op,
}

#[derive(Clone, Debug)]
pub(crate) struct TensorInfo {
    pub name: String,
    pub shape: Vec<usize>,
    pub dtype: DType,
    pub source: Source,
}

impl TensorInfo {
    pub fn len(&self) -> usize {
        self.shape.iter().product()
    }

    /// The feature (last) dim.
    pub fn cols(&self) -> usize {
        self.shape.last().copied().unwrap_or(1)
    }

    /// Elements over the feature dim: the leading dims flattened.
    pub fn rows(&self) -> usize {
        self.len() / self.cols().max(1)
    }
}

/// A trainable parameter as declared.
#[derive(Clone, Debug)]
pub struct ParamDecl {
    pub tensor: Tensor,
    pub name: String,
    pub shape: Vec<usize>,
    /// Gradient dtype (f32 for embedding tables and norm weights: their kernels
    /// accumulate in f32).
    pub grad: DType,
    /// Weight decay applies (matrices, not biases and norms, by GPT-2's convention).
    pub decay: bool,
}

/// One recorded op. Operands and results are tensor ids; what the backward needs
/// beyond them (norm statistics, attention heads) is saved when the op is emitted.
#[derive(Clone, Debug)]
pub(crate) enum Op {
    /// `out[r] = table[tokens[r]]`.
    Embedding {
        tokens: Tensor,
        table: Tensor,
        out: Tensor,
    },
    /// `out = x w + b`, `w` stored (K, N); with `trans_w`, `out = x w^T + b`, `w`
    /// stored (N, K) (a tied LM head reads the embedding table this way).
    Linear {
        x: Tensor,
        w: Tensor,
        b: Option<Tensor>,
        out: Tensor,
        trans_w: bool,
        /// The product is scaled by this before the bias (1 but in a LoRA adapter's
        /// up-projection, scaled by alpha / r).
        scale: f32,
        /// Added to the result, which is written over it (the GEMM's beta path, no
        /// separate add): a LoRA up-projection adds into its base linear's output.
        /// Read by this op alone.
        acc: Option<Tensor>,
    },
    LayerNorm {
        x: Tensor,
        weight: Tensor,
        bias: Tensor,
        out: Tensor,
        eps: f32,
    },
    Gelu {
        x: Tensor,
        out: Tensor,
    },
    Add {
        a: Tensor,
        b: Tensor,
        out: Tensor,
    },
    /// ReLU, tanh or SiLU, elementwise.
    Activation {
        kind: ActivationKind,
        x: Tensor,
        out: Tensor,
    },
    /// Softmax over the last dim.
    Softmax {
        x: Tensor,
        out: Tensor,
    },
    /// Inverted dropout with probability `p`; the mask's seed is the plan's, per op.
    Dropout {
        x: Tensor,
        out: Tensor,
        p: f32,
    },
    /// `qkv` (B, T, 3C) holding q, k, v side by side -> `out` (B, T, C), causal,
    /// scaled by 1/sqrt(C / heads).
    CausalAttention {
        qkv: Tensor,
        out: Tensor,
        heads: usize,
        mode: Attention,
        /// Packed: each row's document start (u32 (B, T)); rows see their own only.
        documents: Option<Tensor>,
    },
    /// `out = x * rstd * weight` per row, `rstd = 1 / sqrt(mean(x^2) + eps)`.
    RmsNorm {
        x: Tensor,
        weight: Tensor,
        out: Tensor,
        eps: f32,
    },
    /// Rotary position embedding of `x` (B, T, H * D), `heads` heads: position `t` of
    /// each sequence rotated by `t * f_i` (`f_i = theta^(-2i / D)`, rescaled per band
    /// where `freqs` says so).
    Rope {
        x: Tensor,
        out: Tensor,
        heads: usize,
        freqs: RopeFreqs,
        /// Decoding or packed: each row's position (u32, one per row) instead of `t`.
        positions: Option<Tensor>,
    },
    /// `out = silu(gate) * up`, elementwise.
    SwiGlu {
        gate: Tensor,
        up: Tensor,
        out: Tensor,
    },
    /// `q` (B, T, H*D), `k` and `v` (B, T, KV*D) -> `out` (B, T, H*D), causal, scaled
    /// by 1/sqrt(D); query head h reads K/V head h / (H / KV) (grouped-query attention).
    GroupedAttention {
        q: Tensor,
        k: Tensor,
        v: Tensor,
        out: Tensor,
        heads: usize,
        kv_heads: usize,
        mode: Attention,
        /// As in [`Op::CausalAttention`].
        documents: Option<Tensor>,
    },
    /// Per-row `losses = logsumexp(logits) - logits[target]`, 0 for IGNORE_TARGET; only
    /// the first `classes` columns take part (the rest pad the vocabulary).
    CrossEntropy {
        logits: Tensor,
        targets: Tensor,
        losses: Tensor,
        classes: usize,
    },
    /// Per-row `losses = mean over the last dim of (pred - target)^2`.
    Mse {
        pred: Tensor,
        target: Tensor,
        losses: Tensor,
    },
    /// Decoding ([`Graph::decoding`]) instead of either attention: the new rows' keys
    /// and values (`k`, `v` (1, R, width) from column `offsets[1]`, `offsets[2]`) are
    /// written into the layer's caches (KV, max_len, D) at `positions`, then query row
    /// `r` (`q` from column `offsets[0]`) attends over cache rows `0..=positions[r]`
    /// -> `out` (1, R, H*D). GPT-2's q, k and v are one tensor at three offsets.
    CachedAttention {
        q: Tensor,
        k: Tensor,
        v: Tensor,
        offsets: [usize; 3],
        k_cache: Tensor,
        v_cache: Tensor,
        positions: Tensor,
        out: Tensor,
        heads: usize,
        kv_heads: usize,
    },
    /// The last row of `x` (..., C) -> (1, .., 1, C): what a decode pass's row-wise
    /// tail (the final norm and head) reads. Forward only.
    LastRow {
        x: Tensor,
        out: Tensor,
    },
}

/// Which loss a graph ends in, and how a caller weights its rows: the graph's loss is
/// `sum_r weight * losses_r`, the weight passed to [`Plan::accumulate`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Loss {
    /// [`Graph::cross_entropy`]: weight 1 / the number of `targets` (u32 ids) that are
    /// not [`crate::IGNORE_TARGET`].
    CrossEntropy { targets: Tensor },
    /// [`Graph::mse`]: weight 1 / the rows of `target`.
    Mse { target: Tensor },
}

/// The recorder: declare parameters and inputs, then call ops in forward order.
#[derive(Clone, Debug, Default)]
pub struct Graph {
    pub(crate) tensors: Vec<TensorInfo>,
    pub(crate) ops: Vec<Op>,
    pub(crate) params: Vec<ParamDecl>,
    /// The per-row losses of the one loss op (cross-entropy or MSE): what backward
    /// differentiates.
    pub(crate) loss: Option<Tensor>,
    /// Tensors kept readable after a step (their buffers are never shared).
    pub(crate) outputs: Vec<Tensor>,
    /// The values of constant tensors.
    pub(crate) constants: Vec<HostData>,
    /// (tensor, input): the gradient of `tensor` comes from outside, uploaded into
    /// `input` before backward (a pipeline stage's outputs, whose gradients the next
    /// stage computes). A graph may have these instead of, or besides, a loss.
    pub(crate) grad_seeds: Vec<(Tensor, Tensor)>,
    /// Inputs whose gradient backward produces ([`Plan::input_gradient`]): a pipeline
    /// stage's incoming activations, whose gradients go back to the stage before.
    pub(crate) grad_inputs: Vec<Tensor>,
    /// Per op, the index it had in the graph it was cut from (empty: its own): dropout
    /// masks derive from it, so a stage draws the masks the whole model would.
    pub(crate) op_ids: Vec<usize>,
    /// Recorded for decoding ([`Graph::decoding`]): the caches and positions its
    /// attention ops read. Such a graph compiles with [`Graph::compile_forward`] only.
    pub(crate) decode: Option<decode::Decoding>,
    /// Recorded over packed documents ([`Graph::pack_documents`]).
    pub(crate) packing: Option<packing::Packing>,
    /// Low-rank adapters ([`Graph::adapt`]): a linear reading one of these weights adds
    /// its adapter's path.
    pub(crate) adapters: Vec<Adapter>,
    /// Activation checkpointing ([`Graph::checkpoint`]): op ranges whose forward is
    /// recomputed right before their backward, in order, disjoint.
    pub(crate) checkpoints: Vec<std::ops::Range<usize>>,
}

/// A LoRA adapter on a weight (see [`Graph::adapt`]).
#[derive(Clone, Copy, Debug)]
pub(crate) struct Adapter {
    pub weight: Tensor,
    /// (r, in) and (out, r), PEFT's layouts.
    pub a: Tensor,
    pub b: Tensor,
    pub scale: f32,
    pub dropout: f32,
}

impl Graph {
    pub fn new() -> Graph {
        Graph::default()
    }

    fn info(&self, t: Tensor) -> Result<&TensorInfo> {
        self.tensors.get(t.0).ok_or_else(|| {
            Error::InvalidArgument(format!(
                "graph: tensor #{} does not belong to this graph (it has {} tensors)",
                t.0,
                self.tensors.len()
            ))
        })
    }

    pub(crate) fn t(&self, t: Tensor) -> &TensorInfo {
        &self.tensors[t.0]
    }

    fn push(&mut self, name: String, shape: Vec<usize>, dtype: DType, source: Source) -> Tensor {
        self.tensors.push(TensorInfo {
            name,
            shape,
            dtype,
            source,
        });
        Tensor(self.tensors.len() - 1)
    }

    /// The parameters in declaration order: the order [`Bindings::params`] binds them.
    pub fn params(&self) -> &[ParamDecl] {
        &self.params
    }

    /// Shape of a tensor.
    pub fn shape(&self, t: Tensor) -> &[usize] {
        &self.t(t).shape
    }

    /// Declares a trainable parameter stored as `dtype` with gradients in `grad`.
    pub fn param(
        &mut self,
        name: &str,
        shape: &[usize],
        dtype: DType,
        grad: DType,
        decay: bool,
    ) -> Result<Tensor> {
        if !dtype.is_float() || !grad.is_float() {
            return Err(Error::InvalidArgument(format!(
                "graph: parameter `{name}` must be stored and differentiated in a float dtype, \
                 not {dtype} / {grad}"
            )));
        }
        let t = self.push(
            name.into(),
            shape.to_vec(),
            dtype,
            Source::Param(self.params.len()),
        );
        self.params.push(ParamDecl {
            tensor: t,
            name: name.into(),
            shape: shape.to_vec(),
            grad,
            decay,
        });
        Ok(t)
    }

    /// Declares a weight that is not trained, stored as `dtype`: bound to a buffer at
    /// compile time with the inputs ([`Bindings::inputs`]), but not data a micro-batch
    /// uploads ([`Graph::inputs`] leaves it out). No gradient is computed for it, and
    /// backward skips every launch only it would need.
    pub fn frozen(&mut self, name: &str, shape: &[usize], dtype: DType) -> Result<Tensor> {
        if !dtype.is_float() {
            return Err(Error::InvalidArgument(format!(
                "graph: frozen weight `{name}` must be stored in a float dtype, not {dtype}"
            )));
        }
        Ok(self.push(name.into(), shape.to_vec(), dtype, Source::Frozen))
    }

    /// The frozen weights ([`Graph::frozen`]), in the order they were declared.
    pub fn frozen_weights(&self) -> Vec<Tensor> {
        (0..self.tensors.len())
            .filter(|&t| self.tensors[t].source == Source::Frozen)
            .map(Tensor)
            .collect()
    }

    /// Adds a low-rank adapter (LoRA) to `weight`, a frozen weight or parameter that
    /// linears read as (out, in) or (in, out): every [`Graph::linear`] or
    /// [`Graph::linear_transposed`] recorded on it afterwards computes
    /// `x W + scale · dropout(x) Aᵀ Bᵀ` with `a` (r, in) and `b` (out, r) trainable
    /// parameters (PEFT's layouts; `scale` is alpha / r). Dropout (probability
    /// `dropout`) masks the adapter's input only.
    pub fn adapt(
        &mut self,
        weight: Tensor,
        (a, b): (Tensor, Tensor),
        scale: f32,
        dropout: f32,
    ) -> Result<()> {
        let wi = self.float("adapt", weight)?.clone();
        let ai = self.float("adapt", a)?.clone();
        let bi = self.float("adapt", b)?.clone();
        for i in [&ai, &bi] {
            if !matches!(i.source, Source::Param(_)) {
                return Err(Error::InvalidArgument(format!(
                    "graph: adapt: `{}` must be a parameter (declare it with Graph::param)",
                    i.name
                )));
            }
        }
        let ok = match (
            wi.shape.as_slice(),
            ai.shape.as_slice(),
            bi.shape.as_slice(),
        ) {
            (&[o, i], &[r, ai_], &[bo, br]) => {
                r > 0 && r == br && ((ai_ == i && bo == o) || (ai_ == o && bo == i))
            }
            _ => false,
        };
        if !ok {
            return Err(Error::InvalidArgument(format!(
                "graph: adapt: weight `{}` is {:?}, A `{}` {:?} and B `{}` {:?}; A must be (r, in) and B (out, r) for the weight's in and out features",
                wi.name, wi.shape, ai.name, ai.shape, bi.name, bi.shape
            )));
        }
        if !(0.0..1.0).contains(&dropout) || !scale.is_finite() {
            return Err(Error::InvalidArgument(format!(
                "graph: adapt `{}`: dropout {dropout} must be in [0, 1) and scale {scale} finite",
                wi.name
            )));
        }
        if self.adapters.iter().any(|x| x.weight == weight) {
            return Err(Error::InvalidArgument(format!(
                "graph: adapt: `{}` already has an adapter",
                wi.name
            )));
        }
        self.adapters.push(Adapter {
            weight,
            a,
            b,
            scale,
            dropout,
        });
        Ok(())
    }

    /// Recomputes ops `ops` (a range of recorded ops, such as a transformer block's)
    /// right before their backward instead of keeping what their backward reads from
    /// the forward pass (activation checkpointing): the range keeps only its inputs
    /// alive through the step, its activations live only while its backward runs.
    /// The values are the same bits (dropout masks derive from each op's index), so
    /// losses and gradients are too. Ranges are given in order and do not overlap.
    pub fn checkpoint(&mut self, ops: std::ops::Range<usize>) -> Result<()> {
        let after_last = self.checkpoints.last().map_or(0, |r| r.end);
        if ops.is_empty() || ops.start < after_last || ops.end > self.ops.len() {
            return Err(Error::InvalidArgument(format!(
                "graph: checkpoint {ops:?}: a range of the {} recorded ops, after the last \
                 one checkpointed (ending at {after_last})",
                self.ops.len()
            )));
        }
        // Recomputed, an op adding in place into a tensor made before the range would
        // add into the forward's finished value again.
        if self.range_start(ops.start) != ops.start || self.range_start(ops.end) != ops.end {
            return Err(Error::InvalidArgument(format!(
                "graph: checkpoint {ops:?}: a range may not cut between a linear and the \
                 adapter adding into its output; Graph::range_start gives where it may \
                 (a bug in the caller, please report it)"
            )));
        }
        self.checkpoints.push(ops);
        Ok(())
    }

    /// `i`, or the op before it where a checkpointed range starting at `i` would cut
    /// between a linear and the LoRA up-projection adding into its output (which must
    /// be recomputed together): the start of that linear.
    pub fn range_start(&self, i: usize) -> usize {
        let mut i = i.min(self.ops.len());
        loop {
            let added_into: Vec<Tensor> = self.ops[i..]
                .iter()
                .filter_map(|op| match op {
                    Op::Linear { acc: Some(a), .. } => Some(*a),
                    _ => None,
                })
                .collect();
            // The earliest linear before `i` whose output is added into at or after it.
            match self.ops[..i]
                .iter()
                .position(|op| added_into.contains(&autodiff::operands(op).1))
            {
                Some(k) => i = k,
                None => return i,
            }
        }
    }

    /// The ops recorded so far.
    pub fn op_count(&self) -> usize {
        self.ops.len()
    }

    /// The first op that reads any of `tensors`, if one does.
    pub fn first_op_reading(&self, tensors: &[Tensor]) -> Option<usize> {
        self.ops
            .iter()
            .position(|op| split::reads(op).iter().any(|t| tensors.contains(t)))
    }

    /// Declares data the caller uploads before each step (no gradient).
    pub fn input(&mut self, name: &str, shape: &[usize], dtype: DType) -> Tensor {
        self.push(name.into(), shape.to_vec(), dtype, Source::Input)
    }

    /// A tensor whose values are fixed now (token positions, say): the plan uploads
    /// them once. No gradient.
    pub fn constant(&mut self, name: &str, shape: &[usize], data: HostData) -> Result<Tensor> {
        let len: usize = shape.iter().product();
        if data.len() != len {
            return Err(Error::InvalidArgument(format!(
                "graph: constant `{name}` {shape:?} needs {len} values, got {}",
                data.len()
            )));
        }
        let source = Source::Constant(self.constants.len());
        let t = self.push(name.into(), shape.to_vec(), data.dtype(), source);
        self.constants.push(data);
        Ok(t)
    }

    /// The index op `i` had in the graph this one was cut from (its own index when it
    /// was recorded here).
    pub(crate) fn op_id(&self, i: usize) -> usize {
        self.op_ids.get(i).copied().unwrap_or(i)
    }

    /// Every input, in the order they were declared.
    pub fn inputs(&self) -> Vec<Tensor> {
        (0..self.tensors.len())
            .filter(|&t| self.tensors[t].source == Source::Input)
            .map(Tensor)
            .collect()
    }

    /// Name, shape and dtype of a tensor.
    pub fn describe(&self, t: Tensor) -> (&str, &[usize], DType) {
        let i = self.t(t);
        (&i.name, &i.shape, i.dtype)
    }

    /// The ids an input holds must stay below a bound: (input, bound, what the ids are,
    /// IGNORE_TARGET allowed). Token inputs of an embedding index its table's rows;
    /// cross-entropy targets index the logits' columns. Checked on the host before an
    /// upload, since on the device an id out of range only shows as NaN.
    pub fn id_limits(&self) -> Vec<(Tensor, usize, &'static str, bool)> {
        let mut out = vec![];
        for op in &self.ops {
            let (t, bound, what, ignore) = match *op {
                Op::Embedding { tokens, table, .. } => {
                    (tokens, self.t(table).shape[0], "token", false)
                }
                Op::CrossEntropy {
                    targets, classes, ..
                } => (targets, classes, "target", true),
                _ => continue,
            };
            if self.t(t).source == Source::Input
                && !out.iter().any(|o: &(Tensor, _, _, _)| o.0 == t)
            {
                out.push((t, bound, what, ignore));
            }
        }
        out
    }

    /// Keeps `t` readable after a step ([`Plan::buffer`]): its buffer is not shared.
    pub fn output(&mut self, t: Tensor) -> Result<()> {
        self.info(t)?;
        if !self.outputs.contains(&t) {
            self.outputs.push(t);
        }
        Ok(())
    }

    fn op_out(&mut self, what: &str, shape: Vec<usize>, dtype: DType) -> Tensor {
        let name = format!("{what}#{}", self.ops.len());
        self.push(name, shape, dtype, Source::Op)
    }

    fn float(&self, op: &str, t: Tensor) -> Result<&TensorInfo> {
        let i = self.info(t)?;
        if !i.dtype.is_float() {
            return Err(Error::InvalidArgument(format!(
                "graph: {op}: `{}` is {}, but this op takes f32, f16 or bf16",
                i.name, i.dtype
            )));
        }
        Ok(i)
    }

    /// A parameter whose gradient is f32: the norm and embedding kernels accumulate
    /// their weight gradients in f32.
    fn f32_grad_param(&self, op: &str, t: Tensor) -> Result<()> {
        let i = self.info(t)?;
        match i.source {
            Source::Param(p) if self.params[p].grad == DType::F32 => Ok(()),
            Source::Frozen => Ok(()),
            Source::Param(_) => Err(Error::InvalidArgument(format!(
                "graph: {op}: parameter `{}` needs an f32 gradient (its kernel accumulates in \
                 f32); declare it with grad DType::F32",
                i.name
            ))),
            _ => Err(Error::InvalidArgument(format!(
                "graph: {op}: `{}` must be a parameter (declare it with Graph::param)",
                i.name
            ))),
        }
    }

    /// `out[..., :] = table[tokens[...], :]`: tokens (...) u32, table (V, C) -> (..., C).
    pub fn embedding(&mut self, tokens: Tensor, table: Tensor) -> Result<Tensor> {
        let ti = self.info(tokens)?.clone();
        let tab = self.float("embedding", table)?.clone();
        if ti.dtype != DType::U32 || tab.shape.len() != 2 {
            return Err(Error::InvalidArgument(format!(
                "graph: embedding: tokens `{}` must be u32 (is {}) and the table `{}` (V, C) \
                 (is {:?})",
                ti.name, ti.dtype, tab.name, tab.shape
            )));
        }
        self.f32_grad_param("embedding", table)?;
        let mut shape = ti.shape.clone();
        shape.push(tab.shape[1]);
        let out = self.op_out("embedding", shape, tab.dtype);
        self.ops.push(Op::Embedding { tokens, table, out });
        Ok(out)
    }

    /// `x (..., K) w (K, N) + b (N) -> (..., N)`.
    pub fn linear(&mut self, x: Tensor, w: Tensor, b: Option<Tensor>) -> Result<Tensor> {
        self.linear_op(x, w, b, false, 1.0)
    }

    /// `x (..., K) w^T + b -> (..., N)` with `w` stored (N, K): a tied LM head.
    pub fn linear_transposed(&mut self, x: Tensor, w: Tensor, b: Option<Tensor>) -> Result<Tensor> {
        self.linear_op(x, w, b, true, 1.0)
    }

    fn linear_op(
        &mut self,
        x: Tensor,
        w: Tensor,
        b: Option<Tensor>,
        trans_w: bool,
        scale: f32,
    ) -> Result<Tensor> {
        let xi = self.float("linear", x)?.clone();
        let wi = self.float("linear", w)?.clone();
        let k = xi.cols();
        let (wk, n) = match (wi.shape.as_slice(), trans_w) {
            (&[r, c], false) => (r, c),
            (&[r, c], true) => (c, r),
            _ => (0, 0),
        };
        if wk != k || n == 0 {
            return Err(Error::InvalidArgument(format!(
                "graph: linear: `{}` {:?} has {k} features but the weight `{}` is {:?}{}; it \
                 must be ({k}, N){}",
                xi.name,
                xi.shape,
                wi.name,
                wi.shape,
                if trans_w { " (read transposed)" } else { "" },
                if trans_w { " transposed: (N, K)" } else { "" }
            )));
        }
        if let Some(b) = b {
            let bi = self.float("linear", b)?;
            if bi.len() != n {
                return Err(Error::InvalidArgument(format!(
                    "graph: linear: bias `{}` has {} elements; it needs one per output ({n})",
                    bi.name,
                    bi.len()
                )));
            }
        }
        let mut shape = xi.shape.clone();
        *shape.last_mut().expect("a float tensor has a feature dim") = n;
        let out = self.op_out("linear", shape, xi.dtype);
        self.ops.push(Op::Linear {
            x,
            w,
            b,
            out,
            trans_w,
            scale,
            acc: None,
        });
        let Some(ad) = self.adapters.iter().find(|a| a.weight == w).copied() else {
            return Ok(out);
        };
        if self.t(ad.a).shape[1] != k {
            return Err(Error::InvalidArgument(format!(
                "graph: linear: the adapter on `{}` takes {} features but `{}` has {k}",
                wi.name,
                self.t(ad.a).shape[1],
                xi.name
            )));
        }
        // out + scale · dropout(x) Aᵀ Bᵀ: (M, K) -> (M, r) -> (M, N), the up-projection
        // adding into the base output through the GEMM's beta (no add launch, no (M, N)
        // temporary; bit-identical to the base output when B = 0).
        let xd = match ad.dropout > 0.0 {
            true => self.dropout(x, ad.dropout)?,
            false => x,
        };
        let h = self.linear_op(xd, ad.a, None, true, 1.0)?;
        let (shape, dtype) = (self.t(out).shape.clone(), self.t(out).dtype);
        let sum = self.op_out("linear", shape, dtype);
        self.ops.push(Op::Linear {
            x: h,
            w: ad.b,
            b: None,
            out: sum,
            trans_w: true,
            scale: ad.scale,
            acc: Some(out),
        });
        Ok(sum)
    }

    /// Layer norm over the feature dim with parameters `weight` and `bias` (C each).
    pub fn layernorm(&mut self, x: Tensor, weight: Tensor, bias: Tensor) -> Result<Tensor> {
        let xi = self.float("layernorm", x)?.clone();
        for p in [weight, bias] {
            self.f32_grad_param("layernorm", p)?;
            let pi = self.info(p)?;
            if pi.len() != xi.cols() {
                return Err(Error::InvalidArgument(format!(
                    "graph: layernorm: `{}` has {} elements but `{}` has {} features",
                    pi.name,
                    pi.len(),
                    xi.name,
                    xi.cols()
                )));
            }
        }
        let out = self.op_out("layernorm", xi.shape.clone(), xi.dtype);
        self.ops.push(Op::LayerNorm {
            x,
            weight,
            bias,
            out,
            eps: 1e-5,
        });
        Ok(out)
    }

    /// GELU, tanh form, elementwise.
    pub fn gelu(&mut self, x: Tensor) -> Result<Tensor> {
        let xi = self.float("gelu", x)?.clone();
        let out = self.op_out("gelu", xi.shape, xi.dtype);
        self.ops.push(Op::Gelu { x, out });
        Ok(out)
    }

    /// ReLU, `max(x, 0)`, elementwise (derivative 0 at 0).
    pub fn relu(&mut self, x: Tensor) -> Result<Tensor> {
        self.activation(ActivationKind::Relu, x)
    }

    /// tanh, elementwise.
    pub fn tanh(&mut self, x: Tensor) -> Result<Tensor> {
        self.activation(ActivationKind::Tanh, x)
    }

    /// SiLU (swish), `x * sigmoid(x)`, elementwise.
    pub fn silu(&mut self, x: Tensor) -> Result<Tensor> {
        self.activation(ActivationKind::Silu, x)
    }

    fn activation(&mut self, kind: ActivationKind, x: Tensor) -> Result<Tensor> {
        let xi = self.float(kind.name(), x)?.clone();
        let out = self.op_out(kind.name(), xi.shape, xi.dtype);
        self.ops.push(Op::Activation { kind, x, out });
        Ok(out)
    }

    /// Softmax over the last dim of `x` (..., C) -> (..., C); statistics in f32.
    pub fn softmax(&mut self, x: Tensor) -> Result<Tensor> {
        let xi = self.float("softmax", x)?.clone();
        if xi.cols() == 0 {
            return Err(Error::InvalidArgument(format!(
                "graph: softmax: `{}` {:?} has an empty last dim; softmax needs at least one \
                 column",
                xi.name, xi.shape
            )));
        }
        let out = self.op_out("softmax", xi.shape, xi.dtype);
        self.ops.push(Op::Softmax { x, out });
        Ok(out)
    }

    /// Inverted dropout: each element of `x` is zeroed with probability `p` and the
    /// others are scaled by `1 / (1 - p)`. The mask comes from the plan's random state
    /// ([`Plan::set_random_state`]) and this op's index, so it is reproducible on any
    /// device; [`Plan::evaluate`] runs the forward pass with dropout as the identity,
    /// and a decoding graph ([`Graph::decoding`]) records none.
    pub fn dropout(&mut self, x: Tensor, p: f32) -> Result<Tensor> {
        let xi = self.float("dropout", x)?.clone();
        if !(0.0..1.0).contains(&p) {
            return Err(Error::InvalidArgument(format!(
                "graph: dropout: p = {p} for `{}`; it is the probability of zeroing an \
                 element and must be in [0, 1) (0 keeps every element)",
                xi.name
            )));
        }
        if xi.len() > u32::MAX as usize {
            return Err(Error::InvalidArgument(format!(
                "graph: dropout: `{}` {:?} has more than 2^32 - 1 elements, which the mask's \
                 32-bit element index cannot tell apart; split it",
                xi.name, xi.shape
            )));
        }
        if self.decode.is_some() {
            return Ok(x);
        }
        let out = self.op_out("dropout", xi.shape, xi.dtype);
        self.ops.push(Op::Dropout { x, out, p });
        Ok(out)
    }

    /// `a + b`, same shape (a residual connection).
    pub fn add(&mut self, a: Tensor, b: Tensor) -> Result<Tensor> {
        let ai = self.float("add", a)?.clone();
        let bi = self.float("add", b)?.clone();
        if ai.shape != bi.shape {
            return Err(Error::InvalidArgument(format!(
                "graph: add: `{}` is {:?} but `{}` is {:?}; they must match",
                ai.name, ai.shape, bi.name, bi.shape
            )));
        }
        let out = self.op_out("add", ai.shape, ai.dtype);
        self.ops.push(Op::Add { a, b, out });
        Ok(out)
    }

    /// Causal self-attention: `qkv` (B, T, 3C), q, k and v side by side as GPT-2's
    /// c_attn produces them, split into `heads` heads of C / heads -> (B, T, C).
    pub fn causal_attention(
        &mut self,
        qkv: Tensor,
        heads: usize,
        mode: Attention,
    ) -> Result<Tensor> {
        let qi = self.float("causal_attention", qkv)?.clone();
        let ok = qi.shape.len() == 3 && heads > 0 && qi.cols() % (3 * heads) == 0;
        if !ok {
            return Err(Error::InvalidArgument(format!(
                "graph: causal_attention: `{}` is {:?}; it must be (B, T, 3C) with C divisible \
                 by the {heads} heads",
                qi.name, qi.shape
            )));
        }
        let (c, dim) = (qi.cols() / 3, qi.cols() / 3 / heads);
        let precision_16 = qi.dtype.size() == 2;
        if !c.is_multiple_of(2) {
            return Err(Error::InvalidArgument(format!(
                "graph: causal_attention: C = {c} must be even (heads are merged back into \
                 rows a 32-bit word at a time)"
            )));
        }
        if mode == Attention::Fused
            && (dim > crate::ATTENTION_MAX_DIM || (precision_16 && dim % 2 != 0))
        {
            return Err(Error::InvalidArgument(format!(
                "graph: causal_attention: fused attention takes head dims up to {} (even for \
                 16-bit activations), not {dim}; use Attention::Straightforward",
                crate::ATTENTION_MAX_DIM
            )));
        }
        if self.decode.is_some() {
            return self.cached_attention([qkv; 3], [0, c, 2 * c], heads, heads, dim);
        }
        let mode = self.packed_mode("causal_attention", mode, dim, qi.dtype)?;
        let documents = self.packed_starts("causal_attention", &qi.shape)?;
        let shape = vec![qi.shape[0], qi.shape[1], c];
        let out = self.op_out("attention", shape, qi.dtype);
        self.ops.push(Op::CausalAttention {
            qkv,
            out,
            heads,
            mode,
            documents,
        });
        Ok(out)
    }

    /// RMS norm over the feature dim (Llama's): `x * rstd * weight` with
    /// `rstd = 1 / sqrt(mean(x^2) + eps)` per row, `weight` (C) a parameter with an f32
    /// gradient.
    pub fn rmsnorm(&mut self, x: Tensor, weight: Tensor, eps: f32) -> Result<Tensor> {
        let xi = self.float("rmsnorm", x)?.clone();
        self.f32_grad_param("rmsnorm", weight)?;
        let wi = self.info(weight)?;
        if wi.len() != xi.cols() {
            return Err(Error::InvalidArgument(format!(
                "graph: rmsnorm: weight `{}` {:?} has {} elements but `{}` {:?} has {} \
                 features; it needs one per feature",
                wi.name,
                wi.shape,
                wi.len(),
                xi.name,
                xi.shape,
                xi.cols()
            )));
        }
        if !(eps > 0.0 && eps.is_finite()) {
            return Err(Error::InvalidArgument(format!(
                "graph: rmsnorm of `{}`: eps must be positive (Llama uses 1e-5 or 1e-6), not \
                 {eps}",
                xi.name
            )));
        }
        let out = self.op_out("rmsnorm", xi.shape.clone(), xi.dtype);
        self.ops.push(Op::RmsNorm {
            x,
            weight,
            out,
            eps,
        });
        Ok(out)
    }

    /// Rotary position embedding (Hugging Face Llama's "rotate half" form) of `x`
    /// (B, T, C) split into `heads` heads of D = C / heads (even): at position `t`, each
    /// head's pair `(i, i + D/2)` is rotated by `t * theta^(-2i / D)` (`theta` is
    /// Llama's `rope_theta`, e.g. 10000; `freqs` is a plain `theta` or [`RopeFreqs`]
    /// with Llama 3's band rescaling).
    pub fn rope(&mut self, x: Tensor, heads: usize, freqs: impl Into<RopeFreqs>) -> Result<Tensor> {
        let freqs = freqs.into();
        let xi = self.float("rope", x)?.clone();
        if xi.shape.len() != 3 || heads == 0 || xi.cols() % heads != 0 {
            return Err(Error::InvalidArgument(format!(
                "graph: rope: `{}` is {:?}; it must be (B, T, C) with C divisible by the \
                 {heads} heads",
                xi.name, xi.shape
            )));
        }
        let dim = xi.cols() / heads;
        if !dim.is_multiple_of(2) {
            return Err(Error::InvalidArgument(format!(
                "graph: rope: `{}` {:?} in {heads} heads has head dim {dim}, which must be \
                 even (each head's halves rotate in pairs)",
                xi.name, xi.shape
            )));
        }
        if let Some(why) = freqs.problem() {
            return Err(Error::InvalidArgument(format!(
                "graph: rope of `{}`: {why}",
                xi.name
            )));
        }
        let positions = match self.decode_positions_for("rope", &xi.shape)? {
            Some(p) => Some(p),
            None => self.packed_positions("rope", &xi.shape)?,
        };
        let out = self.op_out("rope", xi.shape.clone(), xi.dtype);
        self.ops.push(Op::Rope {
            x,
            out,
            heads,
            freqs,
            positions,
        });
        Ok(out)
    }

    /// Causal attention with separate projections and grouped-query heads (Llama 2/3):
    /// `q` (B, T, heads*D), `k` and `v` (B, T, kv_heads*D) -> (B, T, heads*D), scaled by
    /// 1/sqrt(D). Each K/V head serves `heads / kv_heads` consecutive query heads
    /// (kv_heads = heads is multi-head attention, 1 is multi-query attention).
    pub fn attention(
        &mut self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        heads: usize,
        kv_heads: usize,
        mode: Attention,
    ) -> Result<Tensor> {
        let qi = self.float("attention", q)?.clone();
        let ki = self.float("attention", k)?.clone();
        let vi = self.float("attention", v)?.clone();
        if heads == 0 || kv_heads == 0 || !heads.is_multiple_of(kv_heads) {
            return Err(Error::InvalidArgument(format!(
                "graph: attention: {heads} query heads and {kv_heads} K/V heads; both must be \
                 positive and heads a multiple of kv_heads (each K/V head serves heads / \
                 kv_heads query heads)"
            )));
        }
        if qi.shape.len() != 3 || qi.cols() % heads != 0 || qi.cols() == 0 {
            return Err(Error::InvalidArgument(format!(
                "graph: attention: q `{}` is {:?}; it must be (B, T, heads * D) with {heads} \
                 heads of D > 0",
                qi.name, qi.shape
            )));
        }
        let (b, t, dim) = (qi.shape[0], qi.shape[1], qi.cols() / heads);
        let kv_shape = vec![b, t, kv_heads * dim];
        for i in [&ki, &vi] {
            if i.shape != kv_shape {
                return Err(Error::InvalidArgument(format!(
                    "graph: attention: `{}` is {:?} but q `{}` is {:?}: k and v must be \
                     {kv_shape:?}, (B, T, kv_heads * D) for {kv_heads} K/V heads of D = {dim}",
                    i.name, i.shape, qi.name, qi.shape
                )));
            }
        }
        if ki.dtype != qi.dtype || vi.dtype != qi.dtype {
            return Err(Error::InvalidArgument(format!(
                "graph: attention: q `{}` is {}, k `{}` {} and v `{}` {}; they must be one \
                 dtype",
                qi.name, qi.dtype, ki.name, ki.dtype, vi.name, vi.dtype
            )));
        }
        if !(kv_heads * dim).is_multiple_of(2) {
            return Err(Error::InvalidArgument(format!(
                "graph: attention: kv_heads * D = {kv_heads} * {dim} must be even (heads are \
                 merged back into rows a 32-bit word at a time)"
            )));
        }
        if mode == Attention::Fused
            && (dim > crate::ATTENTION_MAX_DIM || (qi.dtype.size() == 2 && dim % 2 != 0))
        {
            return Err(Error::InvalidArgument(format!(
                "graph: attention: fused attention takes head dims up to {} (even for \
                 16-bit activations), not {dim}; use Attention::Straightforward",
                crate::ATTENTION_MAX_DIM
            )));
        }
        if self.decode.is_some() {
            return self.cached_attention([q, k, v], [0; 3], heads, kv_heads, dim);
        }
        let mode = self.packed_mode("attention", mode, dim, qi.dtype)?;
        let documents = self.packed_starts("attention", &qi.shape)?;
        let out = self.op_out("attention", qi.shape.clone(), qi.dtype);
        self.ops.push(Op::GroupedAttention {
            q,
            k,
            v,
            out,
            heads,
            kv_heads,
            mode,
            documents,
        });
        Ok(out)
    }

    /// SwiGLU's gate (Llama's MLP): `silu(gate) * up`, elementwise; same shapes.
    pub fn swiglu(&mut self, gate: Tensor, up: Tensor) -> Result<Tensor> {
        let gi = self.float("swiglu", gate)?.clone();
        let ui = self.float("swiglu", up)?.clone();
        if gi.shape != ui.shape {
            return Err(Error::InvalidArgument(format!(
                "graph: swiglu: gate `{}` is {:?} but up `{}` is {:?}; they must match",
                gi.name, gi.shape, ui.name, ui.shape
            )));
        }
        let out = self.op_out("swiglu", gi.shape, gi.dtype);
        self.ops.push(Op::SwiGlu { gate, up, out });
        Ok(out)
    }

    /// The columns of `t` that are classes: those a cross-entropy on it counts (a padded
    /// vocabulary's real size), else all of them. What an argmax or a sampler may pick.
    pub fn classes_of(&self, t: Tensor) -> usize {
        self.ops
            .iter()
            .find_map(|op| match *op {
                Op::CrossEntropy {
                    logits, classes, ..
                } if logits == t => Some(classes),
                _ => None,
            })
            .unwrap_or_else(|| self.t(t).cols())
    }

    /// Fused softmax + cross-entropy over the last dim of `logits` (..., V) against
    /// `targets` (...) u32 -> per-row losses (...) f32. The graph's loss is their mean
    /// over the rows whose target is not IGNORE_TARGET; one per graph.
    pub fn cross_entropy(&mut self, logits: Tensor, targets: Tensor) -> Result<Tensor> {
        let cols = self.float("cross_entropy", logits)?.cols();
        self.cross_entropy_classes(logits, targets, cols)
    }

    /// [`Graph::cross_entropy`] where only the first `classes` columns of `logits` are
    /// classes and the rest pad the vocabulary (to a multiple of 64 or 128, for faster
    /// matmuls): padding columns stay out of the softmax and get no gradient, and a
    /// target among them is refused like any id past the vocabulary.
    pub fn cross_entropy_classes(
        &mut self,
        logits: Tensor,
        targets: Tensor,
        classes: usize,
    ) -> Result<Tensor> {
        let li = self.float("cross_entropy", logits)?.clone();
        if classes == 0 || classes > li.cols() {
            return Err(Error::InvalidArgument(format!(
                "graph: cross_entropy: {classes} classes but `{}` has rows of {} logits; need \
                 1 <= classes <= the row's length (the padded vocabulary)",
                li.name,
                li.cols()
            )));
        }
        let ti = self.info(targets)?.clone();
        if ti.dtype != DType::U32 || ti.len() != li.rows() {
            return Err(Error::InvalidArgument(format!(
                "graph: cross_entropy: targets `{}` must be {} u32 ids, one per row of `{}` \
                 {:?}; they are {:?} {}",
                ti.name,
                li.rows(),
                li.name,
                li.shape,
                ti.shape,
                ti.dtype
            )));
        }
        if self.loss.is_some() {
            return Err(Error::InvalidArgument(
                "graph: cross_entropy: the graph already has a loss; a graph differentiates \
                 one loss, cross_entropy or mse (add the logits first to combine heads)"
                    .into(),
            ));
        }
        let losses = self.op_out("losses", ti.shape, DType::F32);
        self.ops.push(Op::CrossEntropy {
            logits,
            targets,
            losses,
            classes,
        });
        self.loss = Some(losses);
        self.outputs.push(losses);
        Ok(losses)
    }

    /// Mean squared error over the last dim: `pred` (..., C) against `target` of the
    /// same shape (any float dtype; an input, or computed without parameters: no
    /// gradient flows to it) -> per-row losses (...) f32, `mean_j (pred - target)^2`.
    /// The graph's loss is their mean over rows; one loss per graph.
    pub fn mse(&mut self, pred: Tensor, target: Tensor) -> Result<Tensor> {
        let pi = self.float("mse", pred)?.clone();
        let ti = self.float("mse", target)?.clone();
        if pi.shape != ti.shape || pi.cols() == 0 {
            return Err(Error::InvalidArgument(format!(
                "graph: mse: prediction `{}` is {:?} and target `{}` is {:?}; they must have \
                 one shape, with a non-empty last dim",
                pi.name, pi.shape, ti.name, ti.shape
            )));
        }
        if self.depends_on_param(target) {
            return Err(Error::InvalidArgument(format!(
                "graph: mse: target `{}` depends on a parameter, but no gradient flows to the \
                 target; pass an input (Graph::input) or a tensor computed from inputs alone",
                ti.name
            )));
        }
        if self.loss.is_some() {
            return Err(Error::InvalidArgument(
                "graph: mse: the graph already has a loss; a graph differentiates one loss \
                 (cross_entropy or mse)"
                    .into(),
            ));
        }
        let shape = pi.shape[..pi.shape.len() - 1].to_vec();
        let losses = self.op_out("losses", shape, DType::F32);
        self.ops.push(Op::Mse {
            pred,
            target,
            losses,
        });
        self.loss = Some(losses);
        self.outputs.push(losses);
        Ok(losses)
    }

    /// The graph's loss, if one was recorded: which op, and the tensor its rows are
    /// weighted by (see [`Loss`]).
    pub fn loss(&self) -> Option<Loss> {
        let losses = self.loss?;
        self.ops.iter().find_map(|op| match *op {
            Op::CrossEntropy {
                targets, losses: l, ..
            } if l == losses => Some(Loss::CrossEntropy { targets }),
            Op::Mse {
                target, losses: l, ..
            } if l == losses => Some(Loss::Mse { target }),
            _ => None,
        })
    }

    /// Every linear's weight as recorded, once each in first-use order: (weight, its
    /// in features, out features, stored (in, out) rather than (out, in), the first
    /// linear's output). A LoRA run finds the modules it may adapt here, whatever the
    /// model.
    pub fn linears(&self) -> Vec<(Tensor, usize, usize, bool, Tensor)> {
        let mut out: Vec<(Tensor, usize, usize, bool, Tensor)> = vec![];
        for op in &self.ops {
            if let Op::Linear {
                x,
                w,
                out: o,
                trans_w,
                ..
            } = *op
            {
                if !out.iter().any(|l| l.0 == w) {
                    out.push((w, self.t(x).cols(), self.t(o).cols(), !trans_w, o));
                }
            }
        }
        out
    }

    /// The per-row losses (f32) of the graph's loss, if one was recorded.
    pub fn losses(&self) -> Option<Tensor> {
        self.loss
    }

    /// Whether `t`'s value depends on a parameter (a gradient could flow to it).
    fn depends_on_param(&self, t: Tensor) -> bool {
        let mut needs: Vec<bool> = self
            .tensors
            .iter()
            .map(|i| matches!(i.source, Source::Param(_)))
            .collect();
        for op in &self.ops {
            let (ins, out) = autodiff::operands(op);
            needs[out.0] = ins.iter().any(|i| needs[i.0]);
        }
        needs[t.0]
    }
}
