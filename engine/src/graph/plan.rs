//! Compiling a graph into a plan, and replaying it.
//!
//! Compilation emits forward, backward, the overflow check and the optimizer step as
//! one flat list of [`Kernel`] launches. Intermediate buffers are first *placeholders*
//! (buffers with ids at or above [`PLACEHOLDER`], which no device hands out); once the
//! list is complete, each placeholder's live range is the span from the first to the
//! last launch that touches it, and placeholders of one dtype and length whose ranges
//! do not overlap share one device buffer. Then every launch is rewritten to real
//! buffers, checked, and kept. A step replays the list: no allocation, no pipeline
//! or buffer creation above the device; one submit per micro-batch's forward +
//! backward, one for the overflow check and one for the update; the only readbacks
//! are the overflow flag and, when asked, the loss.
//!
//! Segments of the list: forward | loss accumulation + backward | overflow check and
//! gradient factor | update. A step of several micro-batches runs the first two once
//! per micro-batch (the first micro-batch writes the parameter gradients, later ones
//! add to them: see autodiff.rs; where parameters share a gradient buffer, every
//! micro-batch writes afresh), then the last two once. The check, the norm and the
//! update take one launch per optimizer group ([`Group`]: flat buffers of several
//! parameters), not one per tensor.
//!
//! Every placeholder's first launch writes all of it (never reads it), which is what
//! makes sharing safe: a buffer's old contents are never seen. The tests poison the
//! shared buffers with NaN between steps to hold the plan to that.

use crate::kernels::{
    self, Axpy, Binary, Cast, CrossEntropyBackward, Dropout, DropoutBackward, Fill, GradScale,
    LayerNormBackward, MseBackward, NonFinite, Reduce, RmsNormBackward,
};
use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap};

use super::autodiff;
use super::ops::{self, Saved};
use super::weight_stream::{self, StreamStats, WeightStream};
use super::{Graph, Source, Tensor};
use crate::device::optim::{Optimizer, ParamBuffers};
use crate::{Buffer, DType, Device, Error, HostData, Kernel, ReduceOp, Result};

/// Ids from here up are placeholders. Devices count buffer ids up from 1, so a real
/// buffer never reaches 2^62 (that would take 4.6e18 allocations).
const PLACEHOLDER: u64 = 1 << 62;

/// The device buffers a compiled plan runs on, owned by the caller.
#[derive(Clone, Debug, Default)]
pub struct Bindings {
    /// One per [`Graph::params`] entry, in declaration order: the model copy (the
    /// tensor's dtype) and gradient (the declared grad dtype) forward and backward use;
    /// with no `groups`, the f32 master and moments the update uses too. Two
    /// parameters may name one gradient buffer (ZeRO stage 2's shared block
    /// gradients): then every micro-batch writes its gradients afresh, and the caller
    /// takes them as they become final ([`Plan::accumulate_with`],
    /// [`Plan::backward_with`]). Two parameters may name one model-copy buffer (ZeRO
    /// stage 3): they take turns in it, each loaded from the host copy given with
    /// [`Plan::set_streamed`] before the first launch that reads it (compiled without
    /// an optimizer).
    pub params: Vec<ParamBuffers>,
    /// A buffer for every input tensor, of its dtype and length.
    pub inputs: Vec<(Tensor, Buffer)>,
    /// The optimizer's groups: flat buffers that hold several parameters (whose
    /// `params` entries are views of them), so one launch per group updates, checks
    /// for overflow or measures the norm of all of them. Empty: every parameter is a
    /// group of its own.
    pub groups: Vec<Group>,
}

/// One optimizer group: its flat buffers, and whether weight decay applies to it.
#[derive(Clone, Copy, Debug)]
pub struct Group {
    pub buffers: ParamBuffers,
    pub decay: bool,
}

/// Device bytes a plan holds, besides the caller's parameters and inputs.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct PlanMemory {
    /// Intermediate buffers (activations, saved statistics, gradients of activations,
    /// scratch) if each had its own allocation.
    pub without_reuse: u64,
    /// The same after liveness-based sharing: what is allocated.
    pub with_reuse: u64,
    /// Buffers never shared: outputs read after a step (losses), constants, the
    /// loss accumulator, the overflow flag and the gradient factor.
    pub pinned: u64,
    /// Intermediate placeholders, and the device buffers they share.
    pub placeholders: usize,
    pub slots: usize,
    /// Bytes of the largest single buffer the plan allocates.
    pub largest: u64,
    /// Bytes of the largest buffer a launch binds whole ([`Kernel::bound_whole`]): over
    /// the device's per-binding limit it cannot run (backends split the other buffers).
    pub largest_bound: u64,
}

impl PlanMemory {
    /// Everything the plan allocates.
    pub fn total(&self) -> u64 {
        self.with_reuse + self.pinned
    }
}

/// Builds the launch list over placeholders while a graph is compiled.
pub(super) struct Emitter<'g> {
    pub g: &'g Graph,
    pub launches: Vec<Kernel>,
    /// Each tensor's forward buffer (external or placeholder), once emitted.
    pub value: Vec<Option<Buffer>>,
    /// Placeholders never shared, and constants to upload once.
    pub pinned: Vec<Buffer>,
    pub constants: Vec<(Buffer, HostData)>,
    /// Placeholders standing for the caller's buffers: each parameter's gradient has
    /// one of its own, so the launches that write it can be told apart even where
    /// several parameters share one buffer; so has each model copy that shares.
    pub external: HashMap<u64, Buffer>,
    /// The placeholders of model copies that share a buffer, to their parameter.
    pub streamed: HashMap<u64, usize>,
    /// The loss op's backward launches (cross-entropy or MSE): their scale is the loss
    /// seed, set per step.
    pub seeds: Vec<usize>,
    /// Dropout launches, forward and backward, with the index of their op: their seed
    /// comes from the plan's random state ([`Plan::set_random_state`]).
    pub random: Vec<(usize, usize)>,
    /// The index of the op being emitted (forward or backward).
    pub op: usize,
    /// Launches run on a step's first micro-batch only (zeroing the loss accumulator).
    pub first_only: Vec<usize>,
    /// Zero fills that start a parameter gradient (before a kernel that accumulates):
    /// first micro-batch only, unless every micro-batch's gradients are fresh.
    pub grad_fills: Vec<usize>,
    /// GEMMs that write a parameter gradient with beta 0 on the first micro-batch and
    /// add to it with beta 1 on later ones.
    pub first_betas: Vec<usize>,
    ones: HashMap<(DType, usize), Buffer>,
    next: u64,
}

impl<'g> Emitter<'g> {
    pub(super) fn new(g: &'g Graph) -> Emitter<'g> {
        Emitter {
            g,
            launches: vec![],
            value: vec![None; g.tensors.len()],
            pinned: vec![],
            constants: vec![],
            external: HashMap::new(),
            streamed: HashMap::new(),
            seeds: vec![],
            random: vec![],
            op: 0,
            first_only: vec![],
            grad_fills: vec![],
            first_betas: vec![],
            ones: HashMap::new(),
            next: PLACEHOLDER,
        }
    }

    /// A new placeholder buffer.
    pub fn scratch(&mut self, dtype: DType, len: usize) -> Buffer {
        let b = Buffer {
            id: self.next,
            dtype,
            len,
        };
        self.next += 1;
        b
    }

    /// A new placeholder that keeps its own buffer.
    pub(super) fn pinned(&mut self, dtype: DType, len: usize) -> Buffer {
        let b = self.scratch(dtype, len);
        self.pinned.push(b);
        b
    }

    /// `len` ones of `dtype`: `ones^T dout` sums a gradient over rows (bias gradients).
    pub fn ones(&mut self, dtype: DType, len: usize) -> Buffer {
        if let Some(&b) = self.ones.get(&(dtype, len)) {
            return b;
        }
        let b = self.pinned(dtype, len);
        self.constants
            .push((b, HostData::from_f32(dtype, &vec![1.0; len])));
        self.ones.insert((dtype, len), b);
        b
    }

    /// The forward buffer of `t` (emitted before it is read: ops are in order).
    pub fn val(&self, t: Tensor) -> Buffer {
        self.value[t.0].expect("ops are emitted in recording order")
    }

    /// A placeholder for op output `t` (pinned when it is a graph output).
    pub fn define(&mut self, t: Tensor) -> Buffer {
        let i = self.g.t(t);
        let b = if self.g.outputs.contains(&t) {
            self.pinned(i.dtype, i.len())
        } else {
            self.scratch(i.dtype, i.len())
        };
        self.value[t.0] = Some(b);
        b
    }

    /// The buffer of op output `t` when the op writes it over `acc`'s (a linear adding
    /// into its input: `acc` is read by that op alone). A graph output keeps a buffer of
    /// its own, and so does `t` where `acc`'s buffer is not this plan's to overwrite (a
    /// pipeline stage's received input, a pinned output): `acc` is copied into it first.
    pub fn define_over(&mut self, t: Tensor, acc: Tensor) -> Result<Buffer> {
        let src = self.val(acc);
        let owned = src.id >= PLACEHOLDER
            && !self.external.contains_key(&src.id)
            && !self.pinned.contains(&src);
        let b = if self.g.outputs.contains(&t) || !owned {
            let b = self.define(t);
            self.launch(Kernel::Copy(kernels::Copy { src, dst: b }))?;
            b
        } else {
            src
        };
        self.value[t.0] = Some(b);
        Ok(b)
    }

    /// Records a launch, checked now so a bad graph fails at compile time.
    pub fn launch(&mut self, k: Kernel) -> Result<()> {
        k.validate()?;
        self.launches.push(k);
        Ok(())
    }
}

/// A compiled training step: launches over device buffers, replayed every step.
pub struct Plan {
    launches: Vec<Kernel>,
    /// Ends of forward, of loss accumulation + backward, of the overflow check and
    /// gradient factor; the update runs to the end.
    forward_end: usize,
    backward_end: usize,
    check_end: usize,
    /// The global norm's launches (skipped when a step does not clip).
    norm: std::ops::Range<usize>,
    seeds: Vec<usize>,
    /// Dropout launches and their op's index (see [`Plan::set_random_state`]).
    random: Vec<(usize, usize)>,
    /// Per launch: runs on a step's first micro-batch only.
    first_only: Vec<bool>,
    first_betas: Vec<usize>,
    /// `loss_acc += loss_weight * losses`, and the accumulator (f32, one per row); a
    /// graph without a loss (a pipeline stage before the last) has neither launch and
    /// an accumulator of one zero.
    loss_axpy: Option<usize>,
    loss_acc: Buffer,
    /// The loss scale of the step being accumulated (the gradient factor divides by it).
    loss_scale: f32,
    grad_scale_launch: usize,
    /// The optimizer steps, one per group; none when compiled without an optimizer.
    updates: Vec<usize>,
    /// Per parameter: the launch after which its gradient is final (one past the last
    /// backward launch that writes it).
    grad_final: Vec<usize>,
    /// Per parameter: the first backward launch that writes its gradient.
    grad_first: Vec<usize>,
    /// Every buffer the plan allocated (shared slots and pinned).
    owned: Vec<Buffer>,
    slots: Vec<Buffer>,
    /// Graph outputs (losses included) by tensor.
    outputs: HashMap<Tensor, Buffer>,
    /// The gradients of [`Graph::grad_inputs`], by tensor, copied out after backward.
    input_grads: HashMap<Tensor, Buffer>,
    /// The sum of squares of every gradient (f32, one element), kept readable.
    sum_squares: Buffer,
    losses: Buffer,
    flag: Buffer,
    grad_scale: Buffer,
    memory: PlanMemory,
    /// Model copies that take turns in shared buffers, loaded from host memory before
    /// the launches that read them (ZeRO stage 3); `None` when no two parameters share.
    stream: Option<WeightStream>,
    /// Whether the device was asked to compile every launch's pipelines (before the
    /// first run, all at once: a backend compiles them concurrently).
    prepared: std::sync::atomic::AtomicBool,
    eval_prepared: std::sync::atomic::AtomicBool,
}

impl Graph {
    /// Compiles forward, the derived backward, the overflow check and the update with
    /// `optimizer` into a [`Plan`] over `bindings`, allocating its buffers on `dev`
    /// once. Without an optimizer the plan has no update (a ZeRO rank whose optimizer
    /// state lives elsewhere); masters and moments are then not bound.
    pub fn compile(
        &self,
        dev: &dyn Device,
        bindings: &Bindings,
        optimizer: Option<&Optimizer>,
    ) -> Result<Plan> {
        let (e, plan) = self.emit(bindings, optimizer)?;
        let sharing = share(&e)?;
        allocate(dev, e, sharing, plan)
    }

    /// The device bytes [`Graph::compile`] would allocate for `bindings`, computed
    /// without a device: the same emission and the same sharing. The bindings' buffers
    /// only need distinct ids, dtypes and lengths.
    pub fn memory(&self, bindings: &Bindings, optimizer: Option<&Optimizer>) -> Result<PlanMemory> {
        let (e, _) = self.emit(bindings, optimizer)?;
        Ok(share(&e)?.memory)
    }

    /// The launch list over placeholders, and the plan's bookkeeping around it.
    fn emit(
        &self,
        bindings: &Bindings,
        optimizer: Option<&Optimizer>,
    ) -> Result<(Emitter<'_>, Plan)> {
        if self.decode.is_some() {
            return Err(Error::InvalidArgument(
                "graph: recorded for decoding (Graph::decoding), which has no backward; \
                 compile it with Graph::compile_forward"
                    .into(),
            ));
        }
        if self.loss.is_none() && self.grad_seeds.is_empty() {
            return Err(Error::InvalidArgument(
                "graph: nothing to differentiate; end the forward pass with a loss: \
                 cross_entropy or mse"
                    .into(),
            ));
        }
        if self.params.is_empty() {
            return Err(Error::InvalidArgument(
                "graph: no parameters to train; declare them with Graph::param".into(),
            ));
        }
        let mut e = Emitter::new(self);
        let (param_grads, fresh) = bind(self, bindings, optimizer.is_some(), &mut e)?;
        // Forward, in recording order.
        let mut saved: Vec<Saved> = vec![];
        for (i, op) in self.ops.iter().enumerate() {
            e.op = self.op_id(i);
            saved.push(ops::forward(op, &mut e)?);
        }
        let forward_end = e.launches.len();
        // The step's loss, summed on the device over micro-batches, each row weighted.
        let losses = match self.loss {
            Some(loss) => e.val(loss),
            None => e.pinned(DType::F32, 1),
        };
        let loss_acc = match self.loss {
            Some(_) => e.pinned(DType::F32, losses.len),
            None => losses,
        };
        e.first_only.push(e.launches.len());
        e.launch(Kernel::Fill(Fill {
            dst: loss_acc,
            value: 0.0,
        }))?;
        let loss_axpy = match self.loss {
            Some(_) => {
                e.launch(Kernel::Axpy(Axpy {
                    alpha: 1.0,
                    x: losses,
                    y: loss_acc,
                }))?;
                Some(e.launches.len() - 1)
            }
            None => None,
        };
        // The outputs as the forward made them (a checkpointed range is made again in
        // backward; outputs are never in one).
        let outputs: Vec<(Tensor, Buffer)> = self.outputs.iter().map(|&t| (t, e.val(t))).collect();
        // Backward, derived.
        let proxies: Vec<Buffer> = self.params.iter().map(|p| param_grads[&p.tensor]).collect();
        let input_grads = autodiff::backward(self, &mut e, &mut saved, &param_grads)?;
        let backward_end = e.launches.len();
        // First and last backward launch writing each buffer, in one pass: scanning the
        // launches once per parameter grows with layers squared (minutes at 1000 layers).
        let mut written: HashMap<u64, (usize, usize)> = HashMap::new();
        for i in forward_end..backward_end {
            for w in e.launches[i].written() {
                written.entry(w.id).or_insert((i, i)).1 = i;
            }
        }
        let grad_first = proxies
            .iter()
            .map(|g| written.get(&g.id).map_or(backward_end, |r| r.0))
            .collect();
        let grad_final = proxies
            .iter()
            .map(|g| written.get(&g.id).map_or(backward_end, |r| r.1 + 1))
            .collect();
        // Overflow check over every gradient, then the factor the optimizer multiplies
        // them by: 1 / (loss scale x clip factor), from the global norm when clipping.
        // Both one launch per optimizer group (its flat gradient buffer).
        let groups = groups(self, bindings);
        let mut grads: Vec<Buffer> = vec![];
        for g in &groups {
            if !grads.iter().any(|x| x.id == g.buffers.grad.id) {
                grads.push(g.buffers.grad);
            }
        }
        let flag = e.pinned(DType::U32, 1);
        e.launch(Kernel::NonFinite(NonFinite {
            srcs: grads.clone(),
            flag,
        }))?;
        // The norm: per-group sums of squares, added up in group order.
        let norm_start = e.launches.len();
        let mut sum_squares: Option<Buffer> = None;
        for &g in &grads {
            let part = e.scratch(DType::F32, 1);
            e.launch(Kernel::Reduce(Reduce {
                op: ReduceOp::SumSquares,
                src: g,
                dst: part,
            }))?;
            sum_squares = Some(match sum_squares {
                None => part,
                Some(prev) => {
                    let sum = e.scratch(DType::F32, 1);
                    e.launch(Kernel::Binary(Binary {
                        op: crate::BinaryOp::Add,
                        a: prev,
                        b: part,
                        out: sum,
                    }))?;
                    sum
                }
            });
        }
        let norm = norm_start..e.launches.len();
        let sum_squares = sum_squares.expect("a graph with parameters has gradients");
        // Kept readable for a caller that decides the step across devices.
        let kept = e.pinned(DType::F32, 1);
        e.launch(Kernel::Copy(kernels::Copy {
            src: sum_squares,
            dst: kept,
        }))?;
        let norm = norm.start..e.launches.len();
        let grad_scale = e.pinned(DType::F32, 1);
        let grad_scale_launch = e.launches.len();
        e.launch(Kernel::GradScale(GradScale {
            sum_squares,
            out: grad_scale,
            loss_scale: 1.0,
            clip: 0.0,
        }))?;
        let check_end = e.launches.len();
        // The update, one launch per group; lr and step are set per step.
        let mut updates = vec![];
        if let Some(opt) = optimizer {
            for g in &groups {
                let decay = if g.decay { opt.weight_decay() } else { 0.0 };
                updates.push(e.launches.len());
                e.launch(g.buffers.step(opt, grad_scale, opt.lr(), decay, 1))?;
            }
        }
        let stream = match e.streamed.is_empty() {
            true => None,
            false if optimizer.is_some() => {
                return Err(Error::InvalidArgument(
                    "plan: parameters share a model-copy buffer (ZeRO stage 3), so the \
                     optimizer cannot update them on the device; compile without one"
                        .into(),
                ))
            }
            false => {
                let reads = weight_stream::placeholder_reads(&e.launches, &e.streamed);
                let mut slot = vec![None; self.params.len()];
                for &p in e.streamed.values() {
                    slot[p] = Some(bindings.params[p].value);
                }
                let name = |p: usize| self.params[p].name.clone();
                Some(WeightStream::new(reads, slot, &name)?)
            }
        };
        // Fresh gradients every micro-batch: the first-write forms stay as emitted.
        let mut first_only = vec![false; e.launches.len()];
        for &i in e
            .first_only
            .iter()
            .chain(if fresh { &[][..] } else { &e.grad_fills })
        {
            first_only[i] = true;
        }
        let first_betas = if fresh { vec![] } else { e.first_betas.clone() };
        let plan = Plan {
            launches: vec![],
            forward_end,
            backward_end,
            check_end,
            norm,
            seeds: e.seeds.clone(),
            random: e.random.clone(),
            first_only,
            first_betas,
            loss_axpy,
            loss_acc,
            loss_scale: 1.0,
            grad_scale_launch,
            updates,
            grad_final,
            grad_first,
            owned: vec![],
            slots: vec![],
            outputs: outputs.into_iter().collect(),
            input_grads: input_grads.into_iter().collect(),
            sum_squares: kept,
            losses,
            flag,
            grad_scale,
            memory: PlanMemory::default(),
            stream,
            prepared: Default::default(),
            eval_prepared: Default::default(),
        };
        Ok((e, plan))
    }
}

/// The optimizer groups: the bound ones, or each parameter alone.
fn groups(g: &Graph, b: &Bindings) -> Vec<Group> {
    if !b.groups.is_empty() {
        return b.groups.clone();
    }
    g.params
        .iter()
        .zip(&b.params)
        .map(|(decl, &buffers)| Group {
            buffers,
            decay: decl.decay,
        })
        .collect()
}

/// Checks the bindings against the graph and enters them; returns each parameter's
/// gradient placeholder by tensor, and whether gradients are fresh every micro-batch
/// (two parameters share a gradient buffer).
fn bind(
    g: &Graph,
    b: &Bindings,
    update: bool,
    e: &mut Emitter,
) -> Result<(HashMap<Tensor, Buffer>, bool)> {
    if b.params.len() != g.params.len() {
        return Err(Error::InvalidArgument(format!(
            "plan: the graph declares {} parameters but {} were bound; bind one ParamBuffers \
             per Graph::params entry, in order",
            g.params.len(),
            b.params.len()
        )));
    }
    let external = check_external;
    let mut grads = HashMap::new();
    let mut fresh = false;
    // Model copies bound to more than one parameter take turns in their buffer (ZeRO
    // stage 3): each parameter reads its own placeholder, so the launches that read it
    // can be told apart.
    let mut value_uses: HashMap<u64, usize> = HashMap::new();
    for p in &b.params {
        *value_uses.entry(p.value.id).or_default() += 1;
    }
    // A set, not a look back over the earlier parameters (layers squared when deep).
    let mut grad_ids = std::collections::HashSet::new();
    for (k, (decl, p)) in g.params.iter().zip(&b.params).enumerate() {
        let i = g.t(decl.tensor);
        let n = i.len();
        external(format!("value of `{}`", decl.name), p.value, i.dtype, n)?;
        external(format!("gradient of `{}`", decl.name), p.grad, decl.grad, n)?;
        if update && b.groups.is_empty() {
            for (what, buf) in [
                ("master", p.master),
                ("first moment", p.m),
                ("second moment", p.v),
            ] {
                external(format!("{what} of `{}`", decl.name), buf, DType::F32, n)?;
            }
        }
        fresh |= !grad_ids.insert(p.grad.id);
        e.value[decl.tensor.0] = Some(if value_uses[&p.value.id] > 1 {
            let proxy = e.scratch(p.value.dtype, n);
            e.external.insert(proxy.id, p.value);
            e.streamed.insert(proxy.id, k);
            proxy
        } else {
            p.value
        });
        let proxy = e.scratch(p.grad.dtype, n);
        e.external.insert(proxy.id, p.grad);
        grads.insert(decl.tensor, proxy);
    }
    for (k, grp) in b.groups.iter().enumerate() {
        let n = grp.buffers.grad.len;
        let what = |x: &str| format!("{x} of optimizer group {k}");
        external(
            what("gradient"),
            grp.buffers.grad,
            grp.buffers.grad.dtype,
            n,
        )?;
        if update {
            external(
                what("model copy"),
                grp.buffers.value,
                grp.buffers.value.dtype,
                n,
            )?;
            for (x, buf) in [
                ("master", grp.buffers.master),
                ("first moment", grp.buffers.m),
                ("second moment", grp.buffers.v),
            ] {
                external(what(x), buf, DType::F32, n)?;
            }
        }
    }
    bind_data(g, e, &b.inputs, |_| true)?;
    if let Some((t, _)) = b.inputs.iter().find(|(t, _)| {
        !matches!(
            g.tensors.get(t.0).map(|i| i.source),
            Some(Source::Input | Source::Frozen)
        )
    }) {
        return Err(Error::InvalidArgument(format!(
            "plan: tensor #{} is bound as an input but is not one of this graph's inputs",
            t.0
        )));
    }
    Ok((grads, fresh))
}

/// Enters the graph's constants (pinned, uploaded once) and the caller's input buffers
/// into `e`, for the tensors `wanted` keeps: each input exactly once in `inputs`, of its
/// dtype and length.
pub(super) fn bind_data(
    g: &Graph,
    e: &mut Emitter,
    inputs: &[(Tensor, Buffer)],
    wanted: impl Fn(Tensor) -> bool,
) -> Result<()> {
    for (t, info) in g.tensors.iter().enumerate() {
        if !wanted(Tensor(t)) {
            continue;
        }
        if let Source::Constant(k) = info.source {
            let b = e.pinned(info.dtype, info.len());
            e.constants.push((b, g.constants[k].clone()));
            e.value[t] = Some(b);
            continue;
        }
        if !matches!(info.source, Source::Input | Source::Frozen) {
            continue;
        }
        let mut bound = inputs.iter().filter(|(x, _)| x.0 == t);
        let (Some(&(_, buf)), None) = (bound.next(), bound.next()) else {
            return Err(Error::InvalidArgument(format!(
                "plan: {} `{}` must be bound to exactly one buffer ({} {:?})",
                if info.source == Source::Frozen {
                    "frozen weight"
                } else {
                    "input"
                },
                info.name,
                info.dtype,
                info.shape
            )));
        };
        check_external(
            format!("input `{}`", info.name),
            buf,
            info.dtype,
            info.len(),
        )?;
        e.value[t] = Some(buf);
    }
    Ok(())
}

/// Checks a caller's buffer bound to a graph tensor (`what`): a device buffer of the
/// tensor's dtype and length.
pub(super) fn check_external(what: String, buf: Buffer, dtype: DType, len: usize) -> Result<()> {
    if buf.id >= PLACEHOLDER {
        return Err(Error::InvalidArgument(format!(
            "plan: {what} (buffer #{}) is not a device buffer",
            buf.id
        )));
    }
    if buf.dtype != dtype {
        return Err(Error::DTypeMismatch {
            what: format!("plan: {what}"),
            expected: dtype,
            found: buf.dtype,
        });
    }
    if buf.len != len {
        return Err(Error::LenMismatch {
            what: format!("plan: {what}"),
            expected: len,
            found: buf.len,
        });
    }
    Ok(())
}

/// Which device buffer each placeholder gets: pinned ones their own, the others a
/// shared slot, decided without a device.
pub(super) struct Sharing {
    /// Placeholder id -> index into `slots` (shared) or into the emitter's pinned list
    /// (offset by the number of slots).
    place: HashMap<u64, usize>,
    slots: Vec<(DType, usize)>,
    pub memory: PlanMemory,
}

/// Live ranges and greedy interval sharing in order of first use: a placeholder takes a
/// free slot of its dtype and length whose last user ran strictly before its first
/// launch (a launch never gets one buffer for two operands).
pub(super) fn share(e: &Emitter) -> Result<Sharing> {
    // First and last launch of every placeholder.
    let mut range: HashMap<u64, (usize, usize, Buffer)> = HashMap::new();
    for (i, k) in e.launches.iter().enumerate() {
        for b in k.buffers().into_iter().filter(|b| b.id >= PLACEHOLDER) {
            range.entry(b.id).or_insert((i, i, b)).1 = i;
        }
    }
    let mut memory = PlanMemory::default();
    let mut place = HashMap::new();
    let mut slots: Vec<(DType, usize)> = vec![];
    let mut shared: Vec<(usize, usize, Buffer)> = range
        .into_values()
        .filter(|(_, _, b)| !e.external.contains_key(&b.id) && !e.pinned.contains(b))
        .collect();
    shared.sort_by_key(|&(first, _, b)| (first, b.id));
    let mut free: HashMap<(DType, usize), Vec<usize>> = HashMap::new();
    let mut busy: BinaryHeap<Reverse<(usize, usize, usize)>> = BinaryHeap::new();
    for (taken, (first, last, p)) in shared.into_iter().enumerate() {
        if reads_old_contents(&e.launches[first], p) {
            return Err(Error::InvalidArgument(format!(
                "plan: launch {first} ({}) reads an intermediate buffer before anything writes \
                 it; the graph's emission is wrong (a bug in kiln, please report it)",
                e.launches[first].name()
            )));
        }
        // Slots whose last user ran before this launch are free again, handed out in
        // the order they were taken. A heap by last use, not a scan of every live slot:
        // the saved activations stay live through backward, so a scan per placeholder
        // grows with layers squared.
        let mut done = vec![];
        while busy
            .peek()
            .is_some_and(|Reverse((until, _, _))| *until < first)
        {
            let Reverse((_, order, slot)) = busy.pop().expect("peeked");
            done.push((order, slot));
        }
        done.sort_unstable();
        for (_, slot) in done {
            free.entry(slots[slot]).or_default().push(slot);
        }
        memory.without_reuse += p.bytes();
        memory.placeholders += 1;
        let slot = match free.get_mut(&(p.dtype, p.len)).and_then(|v| v.pop()) {
            Some(slot) => slot,
            None => {
                slots.push((p.dtype, p.len));
                memory.with_reuse += p.bytes();
                slots.len() - 1
            }
        };
        busy.push(Reverse((last, taken, slot)));
        place.insert(p.id, slot);
        memory.largest = memory.largest.max(p.bytes());
    }
    for (k, p) in e.pinned.iter().enumerate() {
        memory.pinned += p.bytes();
        memory.largest = memory.largest.max(p.bytes());
        place.insert(p.id, slots.len() + k);
    }
    memory.slots = slots.len();
    memory.largest_bound = e
        .launches
        .iter()
        .flat_map(|k| k.bound_whole())
        .map(|b| b.bytes())
        .max()
        .unwrap_or(0);
    Ok(Sharing {
        place,
        slots,
        memory,
    })
}

/// A plan's launches on device buffers, and the buffers it allocated for them.
pub(super) struct Placed {
    pub launches: Vec<Kernel>,
    /// Every buffer allocated (the shared slots first).
    pub owned: Vec<Buffer>,
    pub slots: Vec<Buffer>,
    /// Placeholder id -> device buffer.
    map: HashMap<u64, Buffer>,
}

impl Placed {
    /// The device buffer a placeholder became (a real buffer is itself).
    pub fn map(&self, b: Buffer) -> Buffer {
        self.map.get(&b.id).copied().unwrap_or(b)
    }
}

/// Allocates the slots and pinned buffers, uploads the constants and rewrites every
/// launch to real buffers; on an error, frees what it allocated.
pub(super) fn place(dev: &dyn Device, e: Emitter, sharing: &Sharing) -> Result<Placed> {
    let mut owned = vec![];
    let placed = (|| {
        for &(dtype, len) in &sharing.slots {
            owned.push(dev.alloc(dtype, len)?);
        }
        for p in &e.pinned {
            owned.push(dev.alloc(p.dtype, p.len)?);
        }
        let mut map: HashMap<u64, Buffer> = e.external.clone();
        for (&id, &k) in &sharing.place {
            map.insert(id, owned[k]);
        }
        let mapped = |b: Buffer| map.get(&b.id).copied().unwrap_or(b);
        for (p, data) in &e.constants {
            dev.upload(mapped(*p), data)?;
        }
        let mut launches = e.launches.clone();
        for k in &mut launches {
            for b in k.buffers_mut() {
                *b = mapped(*b);
            }
            k.validate()?;
        }
        Ok((launches, map))
    })();
    match placed {
        Ok((launches, map)) => Ok(Placed {
            launches,
            slots: owned[..sharing.slots.len()].to_vec(),
            owned,
            map,
        }),
        Err(e) => {
            for b in owned {
                let _ = dev.free(b);
            }
            Err(e)
        }
    }
}

/// Allocates the slots and pinned buffers and rewrites every launch to real buffers.
fn allocate(dev: &dyn Device, e: Emitter, sharing: Sharing, mut plan: Plan) -> Result<Plan> {
    let placed = place(dev, e, &sharing)?;
    let map = |b: Buffer| placed.map(b);
    plan.losses = map(plan.losses);
    plan.loss_acc = map(plan.loss_acc);
    plan.flag = map(plan.flag);
    plan.grad_scale = map(plan.grad_scale);
    plan.sum_squares = map(plan.sum_squares);
    for b in plan
        .outputs
        .values_mut()
        .chain(plan.input_grads.values_mut())
    {
        *b = map(*b);
    }
    plan.memory = sharing.memory;
    plan.launches = placed.launches;
    plan.owned = placed.owned;
    plan.slots = placed.slots;
    Ok(plan)
}

/// Whether launch `k` reads what `b` held before it: `b` is an operand it does not
/// write, or one it adds into. (A head merge writes only some columns of its
/// destination; the merges of one op together write all of them.)
fn reads_old_contents(k: &Kernel, b: Buffer) -> bool {
    if !k.written().iter().any(|w| w.id == b.id) {
        return true;
    }
    match k {
        Kernel::Axpy(Axpy { y, .. }) => y.id == b.id,
        Kernel::Matmul(mm) => mm.c.id == b.id && mm.beta != 0.0,
        Kernel::LayerNormBackward(LayerNormBackward { dweight, dbias, .. }) => {
            dweight.id == b.id || dbias.id == b.id
        }
        Kernel::RmsNormBackward(RmsNormBackward { dweight, .. }) => dweight.id == b.id,
        Kernel::EmbeddingBackward(_) | Kernel::Adam(_) | Kernel::Sgd(_) => true,
        _ => false,
    }
}

impl Plan {
    /// Device bytes the plan holds, with and without sharing.
    pub fn memory(&self) -> PlanMemory {
        self.memory
    }

    /// The buffer of a graph output (see [`Graph::output`]; the losses always are one).
    pub fn buffer(&self, t: Tensor) -> Option<Buffer> {
        self.outputs.get(&t).copied()
    }

    /// The per-row losses (f32) of the last forward pass.
    pub fn losses(&self) -> Buffer {
        self.losses
    }

    /// The buffers intermediates share. Their contents between steps mean nothing:
    /// tests fill them with NaN to check that no step reads what another left.
    pub fn shared_buffers(&self) -> &[Buffer] {
        &self.slots
    }

    /// Per parameter: the span of backward launches that write its gradient (empty when
    /// none does). Parameters whose spans do not overlap can share one gradient buffer,
    /// each handed over before the next one's writes begin.
    pub fn gradient_writes(&self, param: usize) -> std::ops::Range<usize> {
        self.grad_first[param]..self.grad_final[param].max(self.grad_first[param])
    }

    /// Launches per full step (forward, backward, check, update).
    pub fn launch_count(&self) -> usize {
        self.launches.len()
    }

    /// Records launches `from..to` and submits them; `later_micro` skips what only a
    /// step's first micro-batch runs.
    fn run(&self, dev: &dyn Device, from: usize, to: usize, later_micro: bool) -> Result<()> {
        self.prepare_device(dev)?;
        for (i, (k, &only)) in self.launches[from..to]
            .iter()
            .zip(&self.first_only[from..to])
            .enumerate()
        {
            if !(only && later_micro) {
                if let Some(s) = &self.stream {
                    s.before(dev, from + i)?;
                }
                dev.launch(k)?;
            }
        }
        dev.submit()
    }

    /// Has `dev` compile what every launch of the plan needs, once, before the first
    /// one is recorded. Launches a micro-batch after the first varies (GEMMs that add
    /// into their output) compile when first run: without accumulation none do.
    fn prepare_device(&self, dev: &dyn Device) -> Result<()> {
        use std::sync::atomic::Ordering;
        if self.prepared.swap(true, Ordering::Relaxed) {
            return Ok(());
        }
        dev.prepare(&self.launches)
    }

    /// Records and submits the forward pass alone, as training runs it (dropout
    /// included, with the current random state).
    pub fn forward(&self, dev: &dyn Device) -> Result<()> {
        self.run(dev, 0, self.forward_end, false)
    }

    /// The forward pass for evaluation: as [`Plan::forward`], but every dropout is the
    /// identity (its output is a copy of its input). One submit.
    pub fn evaluate(&self, dev: &dyn Device) -> Result<()> {
        let launches: Vec<Kernel> = self.launches[..self.forward_end]
            .iter()
            .map(|k| match *k {
                Kernel::Dropout(Dropout { x, out, .. }) if x.dtype == out.dtype => {
                    Kernel::Copy(kernels::Copy { src: x, dst: out })
                }
                Kernel::Dropout(Dropout { x, out, .. }) => Kernel::Cast(Cast { src: x, dst: out }),
                _ => k.clone(),
            })
            .collect();
        // Evaluation alone (`kiln eval`) compiles the forward pass only.
        if !self
            .eval_prepared
            .swap(true, std::sync::atomic::Ordering::Relaxed)
        {
            dev.prepare(&launches)?;
        }
        for (i, k) in launches.iter().enumerate() {
            if let Some(s) = &self.stream {
                s.before(dev, i)?;
            }
            dev.launch(k)?;
        }
        dev.submit()
    }

    /// Sets the random state every dropout mask derives from: each dropout op's seed is
    /// [`crate::kernels::dropout_seed`]`(key, op index)`, so two ops never share a mask
    /// and a key gives the same masks on any device or backend (a trainer resumes
    /// exactly by passing a key made of its seed, step and micro-batch). Forward and
    /// backward of a micro-batch must run under one key; a plan starts at key 0.
    pub fn set_random_state(&mut self, key: u64) {
        for &(i, op) in &self.random {
            match &mut self.launches[i] {
                Kernel::Dropout(Dropout { seed, .. })
                | Kernel::DropoutBackward(DropoutBackward { seed, .. }) => {
                    *seed = crate::kernels::dropout_seed(key, op)
                }
                _ => unreachable!("random launches are dropouts"),
            }
        }
    }

    /// Forward and backward of micro-batch `micro` (0-based) of a step, one submit.
    /// Micro-batch 0 writes the parameter gradients, later ones add to them.
    /// `loss_weight` is d loss / d loss_r for each row (1 / the rows trained on, for a
    /// mean; divided by the micro-batches when they are averaged); the gradients come
    /// out multiplied by `loss_scale`, which must be the same for a step's micro-batches.
    pub fn accumulate(
        &mut self,
        dev: &dyn Device,
        loss_scale: f32,
        loss_weight: f32,
        micro: usize,
    ) -> Result<()> {
        self.prepare(loss_scale, loss_weight, micro)?;
        self.run(dev, 0, self.backward_end, micro > 0)
    }

    /// [`Plan::accumulate`], submitting and calling `ready(group)` as soon as every
    /// gradient of a group of parameter indices is final, in the order backward
    /// finishes them (a data-parallel group starts exchanging those gradients while
    /// the rest of backward runs). Groups are the caller's (e.g. one per block).
    pub fn accumulate_with(
        &mut self,
        dev: &dyn Device,
        scalars: (f32, f32, usize),
        groups: &[Vec<usize>],
        ready: &mut dyn FnMut(&[usize]) -> Result<()>,
    ) -> Result<()> {
        self.run_handing_over(dev, 0, scalars, groups, ready)
    }

    /// [`Plan::backward`], handing over each group of parameters as its gradients are
    /// final as [`Plan::accumulate_with`] does: a pipeline stage whose blocks share one
    /// set of gradient buffers (ZeRO stage 2) takes every micro-batch's block by block.
    pub fn backward_with(
        &mut self,
        dev: &dyn Device,
        scalars: (f32, f32, usize),
        groups: &[Vec<usize>],
        ready: &mut dyn FnMut(&[usize]) -> Result<()>,
    ) -> Result<()> {
        self.run_handing_over(dev, self.forward_end, scalars, groups, ready)
    }

    /// Runs launches `from..` the end of backward, submitting and calling `ready` at
    /// each group's last gradient write (never inside the forward pass).
    fn run_handing_over(
        &mut self,
        dev: &dyn Device,
        from: usize,
        (loss_scale, loss_weight, micro): (f32, f32, usize),
        groups: &[Vec<usize>],
        ready: &mut dyn FnMut(&[usize]) -> Result<()>,
    ) -> Result<()> {
        let n = self.grad_final.len();
        let mut cuts = vec![];
        for g in groups {
            if let Some(&p) = g.iter().find(|&&p| p >= n) {
                return Err(Error::InvalidArgument(format!(
                    "plan: parameter index {p} in a ready group; the graph has {n} parameters"
                )));
            }
            let end = g.iter().map(|&p| self.grad_final[p]).max().unwrap_or(0);
            cuts.push((end.max(self.forward_end), g));
        }
        cuts.sort_by_key(|&(end, _)| end);
        self.prepare(loss_scale, loss_weight, micro)?;
        let mut from = from;
        for (end, g) in cuts {
            if end > from {
                self.run(dev, from, end, micro > 0)?;
                from = end;
            }
            ready(g)?;
        }
        if from < self.backward_end {
            self.run(dev, from, self.backward_end, micro > 0)?;
        }
        Ok(())
    }

    /// Forward alone of a micro-batch whose backward runs later ([`Plan::backward`]),
    /// as a pipeline stage runs them: nothing else may run on this plan in between (its
    /// shared buffers hold the activations backward reads). One submit.
    pub fn forward_only(&self, dev: &dyn Device) -> Result<()> {
        self.run(dev, 0, self.forward_end, false)
    }

    /// Backward of micro-batch `micro` of a step, after its [`Plan::forward_only`]: the
    /// loss accumulation (if the graph has a loss) and the derived backward, from the
    /// loss seed and the uploaded seeds of [`Graph::grad_seeds`]. Micro-batch 0 writes
    /// the parameter gradients, later ones add to them (several plans may share the
    /// gradients: micro-batch 0 must then be the first backward of the step among
    /// them). One submit.
    pub fn backward(
        &mut self,
        dev: &dyn Device,
        (loss_scale, loss_weight, micro): (f32, f32, usize),
    ) -> Result<()> {
        self.prepare(loss_scale, loss_weight, micro)?;
        self.run(dev, self.forward_end, self.backward_end, micro > 0)
    }

    /// Starts a step at `loss_scale` without running anything: for a plan whose first
    /// backward of the step is not micro-batch 0 (a pipeline stage's other activation
    /// slots), so its micro-batches are held to the step's scale.
    pub fn start_step(&mut self, loss_scale: f32) {
        self.loss_scale = loss_scale;
    }

    /// The buffer backward copies the gradient of input `t` to (a
    /// [`Graph::grad_inputs`] entry; scaled like every gradient).
    pub fn input_gradient(&self, t: Tensor) -> Option<Buffer> {
        self.input_grads.get(&t).copied()
    }

    /// Sets a micro-batch's scalars: the loss seed, the loss weight, the GEMM betas.
    fn prepare(&mut self, loss_scale: f32, loss_weight: f32, micro: usize) -> Result<()> {
        let seed = loss_scale * loss_weight;
        if !(seed.is_finite() && loss_scale > 0.0) {
            return Err(Error::InvalidArgument(format!(
                "plan: loss scale {loss_scale} x loss weight {loss_weight} must be finite and \
                 the scale positive"
            )));
        }
        if micro > 0 && loss_scale != self.loss_scale {
            return Err(Error::InvalidArgument(format!(
                "plan: micro-batch {micro} runs at loss scale {loss_scale} but the step began \
                 at {}; a step's gradients must share one scale",
                self.loss_scale
            )));
        }
        self.loss_scale = loss_scale;
        for &i in &self.seeds {
            match &mut self.launches[i] {
                Kernel::CrossEntropyBackward(CrossEntropyBackward { scale, .. })
                | Kernel::MseBackward(MseBackward { scale, .. }) => *scale = seed,
                _ => unreachable!("seed launches are loss backwards"),
            }
        }
        if let Some(Kernel::Axpy(Axpy { alpha, .. })) =
            self.loss_axpy.map(|i| &mut self.launches[i])
        {
            *alpha = loss_weight;
        }
        let beta = if micro == 0 { 0.0 } else { 1.0 };
        for &i in &self.first_betas {
            if let Kernel::Matmul(mm) = &mut self.launches[i] {
                mm.beta = beta;
            }
        }
        Ok(())
    }

    /// After a step's micro-batches: the overflow check over every gradient and the
    /// factor the update multiplies them by (unscaling, and clipping the unscaled
    /// gradients to global L2 norm `clip` when it is above 0). One submit.
    pub fn check(&mut self, dev: &dyn Device, clip: f32) -> Result<()> {
        self.check_with(dev, clip, clip > 0.0)
    }

    fn check_with(&mut self, dev: &dyn Device, clip: f32, norm: bool) -> Result<()> {
        if !(clip.is_finite() && clip >= 0.0) {
            return Err(Error::InvalidArgument(format!(
                "plan: gradient clipping at {clip}; give a finite norm, or 0 for none"
            )));
        }
        if let Kernel::GradScale(GradScale {
            loss_scale,
            clip: c,
            ..
        }) = &mut self.launches[self.grad_scale_launch]
        {
            *loss_scale = self.loss_scale;
            *c = clip;
        }
        self.run_check(dev, norm)
    }

    /// The check segment; without `norm` the sum of squares is not computed (without
    /// clipping GradScale ignores it).
    fn run_check(&mut self, dev: &dyn Device, norm: bool) -> Result<()> {
        self.prepare_device(dev)?;
        let skip = if norm { 0..0 } else { self.norm.clone() };
        for (i, k) in self.launches[self.backward_end..self.check_end]
            .iter()
            .enumerate()
        {
            if !skip.contains(&(self.backward_end + i)) {
                dev.launch(k)?;
            }
        }
        dev.submit()
    }

    /// For a caller that decides the step across devices (a pipeline's stages): the
    /// overflow flag and the sum of squares of this plan's gradients, at the loss
    /// scale they were accumulated at, read by [`Plan::overflowed`] and
    /// [`Plan::sum_squares`]; the step is then [`Plan::apply`]. One submit.
    pub fn measure(&mut self, dev: &dyn Device) -> Result<()> {
        self.check_with(dev, 0.0, true)
    }

    /// The sum of squares of every gradient measured by the last [`Plan::measure`] (or
    /// [`Plan::check`] with clipping); waits for the device.
    pub fn sum_squares(&self, dev: &dyn Device) -> Result<f32> {
        Ok(dev.download(self.sum_squares)?.to_f32()[0])
    }

    /// Whether the gradients checked by the last [`Plan::check`] hold an inf or NaN
    /// (the one readback a step needs; it waits for the device).
    pub fn overflowed(&self, dev: &dyn Device) -> Result<bool> {
        Ok(dev.download(self.flag)?.bits()[0] != 0)
    }

    /// Sum of the last forward pass's per-row losses, in f64.
    pub fn loss_sum(&self, dev: &dyn Device) -> Result<f64> {
        let l = dev.download(self.losses)?.to_f32();
        Ok(l.iter().map(|&x| x as f64).sum())
    }

    /// The step's loss: each accumulated micro-batch's rows weighted by its
    /// `loss_weight`, summed (in f64 over the f32 accumulator).
    pub fn step_loss(&self, dev: &dyn Device) -> Result<f64> {
        let l = dev.download(self.loss_acc)?.to_f32();
        Ok(l.iter().map(|&x| x as f64).sum())
    }

    /// The factor the last [`Plan::check`] computed (1 / (loss scale x clip factor)).
    pub fn grad_scale(&self, dev: &dyn Device) -> Result<f32> {
        Ok(dev.download(self.grad_scale)?.to_f32()[0])
    }

    /// The optimizer step at learning rate `lr`; `step` is 1-based (Adam's bias
    /// correction). One submit.
    pub fn update(&mut self, dev: &dyn Device, lr: f32, step: u32) -> Result<()> {
        if self.updates.is_empty() {
            return Err(Error::InvalidArgument(
                "plan: compiled without an optimizer, so it has no update (the optimizer \
                 state lives elsewhere)"
                    .into(),
            ));
        }
        for &i in &self.updates {
            match &mut self.launches[i] {
                Kernel::Adam(a) => {
                    a.lr = lr;
                    a.step = step;
                }
                Kernel::Sgd(s) => s.lr = lr,
                _ => unreachable!("update launches are optimizer steps"),
            }
        }
        self.run(dev, self.check_end, self.launches.len(), false)
    }

    /// The update when the host has decided the step (a data-parallel group checked
    /// the reduced gradients): every gradient multiplied by `grad_scale` (1 / (loss
    /// scale x clip factor)), learning rate `lr`, 1-based `step`.
    pub fn apply(&mut self, dev: &dyn Device, lr: f32, step: u32, grad_scale: f32) -> Result<()> {
        dev.upload(self.grad_scale, &HostData::F32(vec![grad_scale]))?;
        self.update(dev, lr, step)
    }

    /// Whether parameter `p`'s model copy takes turns in a shared buffer (ZeRO stage
    /// 3): it lives in host memory ([`Plan::set_streamed`]) and is loaded before use.
    pub fn streams(&self, p: usize) -> bool {
        self.stream.as_ref().is_some_and(|s| s.streams(p))
    }

    /// Sets streamed parameter `p`'s model copy (dtype and length of its buffer); the
    /// next launch that reads it loads it.
    pub fn set_streamed(&self, p: usize, data: std::sync::Arc<HostData>) -> Result<()> {
        match &self.stream {
            Some(s) => s.set(p, data),
            None => Err(Error::InvalidArgument(format!(
                "plan: parameter {p} is not streamed; its weights live on the device"
            ))),
        }
    }

    /// Streamed parameter `p`'s model copy in host memory.
    pub fn streamed(&self, p: usize) -> Option<std::sync::Arc<HostData>> {
        self.stream.as_ref().and_then(|s| s.get(p))
    }

    /// What the streamed weights' loads moved since the last call (zeros without any).
    pub fn take_stream_stats(&self) -> StreamStats {
        self.stream
            .as_ref()
            .map_or_else(StreamStats::default, WeightStream::take_stats)
    }

    /// Moves the streamed weights' host copies from `old` (a plan compiled before
    /// over the same parameters) into this one.
    pub fn adopt_streamed(&self, old: &Plan) -> Result<()> {
        match (&self.stream, &old.stream) {
            (Some(new), Some(old)) => new.put_host(old.take_host()),
            (None, None) => Ok(()),
            _ => Err(Error::InvalidArgument(
                "plan: compiled again with other streamed weights than before".into(),
            )),
        }
    }

    /// Releases every buffer the plan allocated (not the caller's bindings); the plan
    /// must not run afterwards.
    pub fn free(&mut self, dev: &dyn Device) -> Result<()> {
        for b in self.owned.drain(..) {
            dev.free(b)?;
        }
        Ok(())
    }
}
