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
//! add to them: see autodiff.rs), then the last two once.
//!
//! Every placeholder's first launch writes all of it (never reads it), which is what
//! makes sharing safe: a buffer's old contents are never seen. The tests poison the
//! shared buffers with NaN between steps to hold the plan to that.

use std::collections::HashMap;

use super::autodiff;
use super::ops::{self, Saved};
use super::{Graph, Source, Tensor};
use crate::loss_scaler::{LossScaler, StepDecision};
use crate::optim::{Optimizer, ParamBuffers};
use crate::{Buffer, DType, Device, Error, HostData, Kernel, ReduceOp, Result};

/// Ids from here up are placeholders. Devices count buffer ids up from 1, so a real
/// buffer never reaches 2^62 (that would take 4.6e18 allocations).
const PLACEHOLDER: u64 = 1 << 62;

/// The device buffers a compiled plan runs on, owned by the caller.
#[derive(Clone, Debug, Default)]
pub struct Bindings {
    /// One per [`Graph::params`] entry, in declaration order: the model copy (the
    /// tensor's dtype), f32 master, gradient (the declared grad dtype) and moments.
    pub params: Vec<ParamBuffers>,
    /// A buffer for every input tensor, of its dtype and length.
    pub inputs: Vec<(Tensor, Buffer)>,
}

/// The optimizer part of a plan.
#[derive(Clone, Debug, PartialEq)]
pub struct Training {
    /// The update (and the weight decay, applied to parameters declared with decay).
    pub optimizer: Optimizer,
    /// Clip the unscaled gradients to this global L2 norm; 0: no clipping.
    pub clip: f32,
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
    /// overflow flag and the gradient factor.
    pub pinned: u64,
    /// Intermediate placeholders, and the device buffers they share.
    pub placeholders: usize,
    pub slots: usize,
}

impl PlanMemory {
    /// Everything the plan allocates.
    pub fn total(&self) -> u64 {
        self.with_reuse + self.pinned
    }
}

/// What one replayed step did.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct PlanStep {
    /// The step's loss (see [`Plan::step_loss`]); `None` unless asked for.
    pub loss: Option<f64>,
    /// The gradients overflowed: nothing was updated.
    pub skipped: bool,
    /// The loss scale the step ran at.
    pub scale: f32,
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
    /// Cross-entropy backward launches: their scale is the loss seed, set per step.
    pub seeds: Vec<usize>,
    /// Launches run on a step's first micro-batch only (zeroing accumulators).
    pub first_only: Vec<usize>,
    /// GEMMs that write a parameter gradient with beta 0 on the first micro-batch and
    /// add to it with beta 1 on later ones.
    pub first_betas: Vec<usize>,
    ones: HashMap<(DType, usize), Buffer>,
    next: u64,
}

impl<'g> Emitter<'g> {
    fn new(g: &'g Graph) -> Emitter<'g> {
        Emitter {
            g,
            launches: vec![],
            value: vec![None; g.tensors.len()],
            pinned: vec![],
            constants: vec![],
            seeds: vec![],
            first_only: vec![],
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
    fn pinned(&mut self, dtype: DType, len: usize) -> Buffer {
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
    seeds: Vec<usize>,
    /// Per launch: runs on a step's first micro-batch only.
    first_only: Vec<bool>,
    first_betas: Vec<usize>,
    /// `loss_acc += loss_weight * losses`, and the accumulator (f32, one per row).
    loss_axpy: usize,
    loss_acc: Buffer,
    /// The loss scale of the step being accumulated (the gradient factor divides by it).
    loss_scale: f32,
    grad_scale_launch: usize,
    updates: Vec<usize>,
    /// Per parameter: the launch after which its gradient is final (one past the last
    /// backward launch that writes it).
    grad_final: Vec<usize>,
    /// Every buffer the plan allocated (shared slots and pinned).
    owned: Vec<Buffer>,
    slots: Vec<Buffer>,
    /// Graph outputs (losses included) by tensor.
    outputs: HashMap<Tensor, Buffer>,
    losses: Buffer,
    flag: Buffer,
    grad_scale: Buffer,
    memory: PlanMemory,
}

impl Graph {
    /// Compiles forward, the derived backward, the overflow check and `training`'s
    /// update into a [`Plan`] over `bindings`, allocating its buffers on `dev` once.
    pub fn compile(
        &self,
        dev: &dyn Device,
        bindings: &Bindings,
        training: &Training,
    ) -> Result<Plan> {
        let loss = self.loss.ok_or_else(|| {
            Error::InvalidArgument(
                "graph: nothing to differentiate; end the forward pass with cross_entropy".into(),
            )
        })?;
        let mut e = Emitter::new(self);
        let param_grads = bind(self, bindings, &mut e)?;
        // Forward, in recording order.
        let mut saved: Vec<Saved> = vec![];
        for op in &self.ops {
            saved.push(ops::forward(op, &mut e)?);
        }
        let forward_end = e.launches.len();
        // The step's loss, summed on the device over micro-batches, each row weighted.
        let losses = e.val(loss);
        let loss_acc = e.pinned(DType::F32, losses.len);
        e.first_only.push(e.launches.len());
        e.launch(Kernel::Fill {
            dst: loss_acc,
            value: 0.0,
        })?;
        let loss_axpy = e.launches.len();
        e.launch(Kernel::Axpy {
            alpha: 1.0,
            x: losses,
            y: loss_acc,
        })?;
        // Backward, derived.
        autodiff::backward(self, &mut e, &saved, &param_grads)?;
        let backward_end = e.launches.len();
        let grad_final = bindings
            .params
            .iter()
            .map(|p| {
                (forward_end..backward_end)
                    .rev()
                    .find(|&i| e.launches[i].written().iter().any(|w| w.id == p.grad.id))
                    .map_or(backward_end, |i| i + 1)
            })
            .collect();
        // Overflow check over every gradient, then the factor the optimizer multiplies
        // them by: 1 / (loss scale x clip factor), from the global norm when clipping.
        let flag = e.pinned(DType::U32, 1);
        let grads: Vec<Buffer> = bindings.params.iter().map(|p| p.grad).collect();
        e.launch(Kernel::NonFinite {
            srcs: grads.clone(),
            flag,
        })?;
        let sum_squares = if training.clip > 0.0 {
            let mut acc: Option<Buffer> = None;
            for &g in &grads {
                let part = e.scratch(DType::F32, 1);
                e.launch(Kernel::Reduce {
                    op: ReduceOp::SumSquares,
                    src: g,
                    dst: part,
                })?;
                acc = Some(match acc {
                    None => part,
                    Some(prev) => {
                        let sum = e.scratch(DType::F32, 1);
                        e.launch(Kernel::Binary {
                            op: crate::BinaryOp::Add,
                            a: prev,
                            b: part,
                            out: sum,
                        })?;
                        sum
                    }
                });
            }
            acc.expect("a graph with a loss has parameters")
        } else {
            // No clipping: GradScale reads a norm of 0 and ignores it.
            e.pinned(DType::F32, 1)
        };
        let grad_scale = e.pinned(DType::F32, 1);
        let grad_scale_launch = e.launches.len();
        e.launch(Kernel::GradScale {
            sum_squares,
            out: grad_scale,
            loss_scale: 1.0,
            clip: training.clip,
        })?;
        let check_end = e.launches.len();
        // The update; lr and step are set per step.
        let mut updates = vec![];
        for (decl, p) in self.params.iter().zip(&bindings.params) {
            let decay = if decl.decay {
                training.optimizer.weight_decay()
            } else {
                0.0
            };
            updates.push(e.launches.len());
            e.launch(p.step(
                &training.optimizer,
                grad_scale,
                training.optimizer.lr(),
                decay,
                1,
            ))?;
        }
        let outputs: Vec<(Tensor, Buffer)> = self.outputs.iter().map(|&t| (t, e.val(t))).collect();
        let Emitter {
            launches,
            pinned,
            constants,
            seeds,
            first_only,
            first_betas,
            ..
        } = e;
        let mut only = vec![false; launches.len()];
        for i in first_only {
            only[i] = true;
        }
        allocate(
            dev,
            launches,
            &pinned,
            &constants,
            Plan {
                launches: vec![],
                forward_end,
                backward_end,
                check_end,
                seeds,
                first_only: only,
                first_betas,
                loss_axpy,
                loss_acc,
                loss_scale: 1.0,
                grad_scale_launch,
                updates,
                grad_final,
                owned: vec![],
                slots: vec![],
                outputs: outputs.into_iter().collect(),
                losses,
                flag,
                grad_scale,
                memory: PlanMemory::default(),
            },
        )
    }
}

/// Checks the bindings against the graph and enters them; returns each parameter's
/// gradient buffer by tensor.
fn bind(g: &Graph, b: &Bindings, e: &mut Emitter) -> Result<HashMap<Tensor, Buffer>> {
    if b.params.len() != g.params.len() {
        return Err(Error::InvalidArgument(format!(
            "plan: the graph declares {} parameters but {} were bound; bind one ParamBuffers \
             per Graph::params entry, in order",
            g.params.len(),
            b.params.len()
        )));
    }
    let external = |what: String, buf: Buffer, dtype: DType, len: usize| -> Result<()> {
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
    };
    let mut grads = HashMap::new();
    for (decl, p) in g.params.iter().zip(&b.params) {
        let i = g.t(decl.tensor);
        let n = i.len();
        external(format!("value of `{}`", decl.name), p.value, i.dtype, n)?;
        external(format!("gradient of `{}`", decl.name), p.grad, decl.grad, n)?;
        for (what, buf) in [
            ("master", p.master),
            ("first moment", p.m),
            ("second moment", p.v),
        ] {
            external(format!("{what} of `{}`", decl.name), buf, DType::F32, n)?;
        }
        e.value[decl.tensor.0] = Some(p.value);
        grads.insert(decl.tensor, p.grad);
    }
    for (t, info) in g.tensors.iter().enumerate() {
        if info.source != Source::Input {
            continue;
        }
        let mut bound = b.inputs.iter().filter(|(x, _)| x.0 == t);
        let (Some(&(_, buf)), None) = (bound.next(), bound.next()) else {
            return Err(Error::InvalidArgument(format!(
                "plan: input `{}` must be bound to exactly one buffer ({} {:?})",
                info.name, info.dtype, info.shape
            )));
        };
        external(
            format!("input `{}`", info.name),
            buf,
            info.dtype,
            info.len(),
        )?;
        e.value[t] = Some(buf);
    }
    if let Some((t, _)) = b
        .inputs
        .iter()
        .find(|(t, _)| g.tensors.get(t.0).map(|i| i.source) != Some(Source::Input))
    {
        return Err(Error::InvalidArgument(format!(
            "plan: tensor #{} is bound as an input but is not one of this graph's inputs",
            t.0
        )));
    }
    Ok(grads)
}

/// Live ranges, sharing, allocation and the rewrite of every launch to real buffers.
fn allocate(
    dev: &dyn Device,
    mut launches: Vec<Kernel>,
    pinned: &[Buffer],
    constants: &[(Buffer, HostData)],
    mut plan: Plan,
) -> Result<Plan> {
    // First and last launch of every placeholder.
    let mut range: HashMap<u64, (usize, usize, Buffer)> = HashMap::new();
    for (i, k) in launches.iter().enumerate() {
        for b in k.buffers().into_iter().filter(|b| b.id >= PLACEHOLDER) {
            range.entry(b.id).or_insert((i, i, b)).1 = i;
        }
    }
    let mut real: HashMap<u64, Buffer> = HashMap::new();
    let mut memory = PlanMemory::default();
    for &p in pinned {
        let b = dev.alloc(p.dtype, p.len)?;
        plan.owned.push(b);
        memory.pinned += b.bytes();
        real.insert(p.id, b);
    }
    // Greedy interval sharing in order of first use: a placeholder takes a free buffer
    // of its dtype and length whose last user ran strictly before its first launch
    // (a launch never gets one buffer for two operands).
    let mut shared: Vec<(usize, usize, Buffer)> = range
        .into_values()
        .filter(|(_, _, b)| !real.contains_key(&b.id))
        .collect();
    shared.sort_by_key(|&(first, _, b)| (first, b.id));
    let mut free: HashMap<(DType, usize), Vec<Buffer>> = HashMap::new();
    let mut busy: Vec<(usize, Buffer)> = vec![];
    for (first, last, p) in shared {
        if reads_old_contents(&launches[first], p) {
            return Err(Error::InvalidArgument(format!(
                "plan: launch {first} ({}) reads an intermediate buffer before anything writes \
                 it; the graph's emission is wrong (a bug in kiln, please report it)",
                launches[first].name()
            )));
        }
        busy.retain(|&(until, slot)| {
            let done = until < first;
            if done {
                free.entry((slot.dtype, slot.len)).or_default().push(slot);
            }
            !done
        });
        memory.without_reuse += p.bytes();
        memory.placeholders += 1;
        let slot = match free.get_mut(&(p.dtype, p.len)).and_then(|v| v.pop()) {
            Some(slot) => slot,
            None => {
                let slot = dev.alloc(p.dtype, p.len)?;
                plan.owned.push(slot);
                plan.slots.push(slot);
                memory.with_reuse += slot.bytes();
                slot
            }
        };
        busy.push((last, slot));
        real.insert(p.id, slot);
    }
    memory.slots = plan.slots.len();
    for (p, data) in constants {
        dev.upload(real[&p.id], data)?;
    }
    let map = |b: Buffer| if b.id >= PLACEHOLDER { real[&b.id] } else { b };
    for k in &mut launches {
        for b in k.buffers_mut() {
            *b = map(*b);
        }
        k.validate()?;
    }
    plan.launches = launches;
    plan.losses = map(plan.losses);
    plan.loss_acc = map(plan.loss_acc);
    plan.flag = map(plan.flag);
    plan.grad_scale = map(plan.grad_scale);
    for b in plan.outputs.values_mut() {
        *b = map(*b);
    }
    plan.memory = memory;
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
        Kernel::Axpy { y, .. } => y.id == b.id,
        Kernel::Matmul(mm) => mm.c.id == b.id && mm.beta != 0.0,
        Kernel::LayerNormBackward { dweight, dbias, .. } => dweight.id == b.id || dbias.id == b.id,
        Kernel::EmbeddingBackward { .. } | Kernel::Adam(_) | Kernel::Sgd(_) => true,
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

    /// Launches per full step (forward, backward, check, update).
    pub fn launch_count(&self) -> usize {
        self.launches.len()
    }

    /// Records launches `from..to` and submits them; `later_micro` skips what only a
    /// step's first micro-batch runs.
    fn run(&self, dev: &dyn Device, from: usize, to: usize, later_micro: bool) -> Result<()> {
        for (k, &only) in self.launches[from..to]
            .iter()
            .zip(&self.first_only[from..to])
        {
            if !(only && later_micro) {
                dev.launch(k)?;
            }
        }
        dev.submit()
    }

    /// Records and submits the forward pass alone (evaluation).
    pub fn forward(&self, dev: &dyn Device) -> Result<()> {
        self.run(dev, 0, self.forward_end, false)
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
        let mut from = 0;
        for (end, g) in cuts {
            if end > from {
                self.run(dev, from, end, micro > 0)?;
                from = end;
            }
            ready(g)?;
        }
        self.run(dev, from, self.backward_end, micro > 0)
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
            if let Kernel::CrossEntropyBackward { scale, .. } = &mut self.launches[i] {
                *scale = seed;
            }
        }
        if let Kernel::Axpy { alpha, .. } = &mut self.launches[self.loss_axpy] {
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
    /// factor the update multiplies them by (unscaling, and clipping when compiled
    /// with it). One submit.
    pub fn check(&mut self, dev: &dyn Device) -> Result<()> {
        if let Kernel::GradScale { loss_scale, .. } = &mut self.launches[self.grad_scale_launch] {
            *loss_scale = self.loss_scale;
        }
        self.run(dev, self.backward_end, self.check_end, false)
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

    /// One training step of one micro-batch with `scaler`'s loss scale: accumulate,
    /// check, read the overflow flag (and the loss when `want_loss`), let the scaler
    /// decide, update unless it skips. `step` is the 1-based count of applied updates
    /// this one would be.
    pub fn step(
        &mut self,
        dev: &dyn Device,
        scaler: &mut LossScaler,
        loss_weight: f32,
        lr: f32,
        step: u32,
        want_loss: bool,
    ) -> Result<PlanStep> {
        let scale = scaler.scale();
        self.accumulate(dev, scale, loss_weight, 0)?;
        self.finish_step(dev, scaler, lr, step, want_loss)
    }

    /// The end of a step whose micro-batches were accumulated: check, read the flag
    /// (and the loss), let `scaler` decide, update unless it skips.
    pub fn finish_step(
        &mut self,
        dev: &dyn Device,
        scaler: &mut LossScaler,
        lr: f32,
        step: u32,
        want_loss: bool,
    ) -> Result<PlanStep> {
        let scale = self.loss_scale;
        self.check(dev)?;
        let overflow = self.overflowed(dev)?;
        let loss = if want_loss {
            Some(self.step_loss(dev)?)
        } else {
            None
        };
        let skipped = scaler.update(overflow)? == StepDecision::Skip;
        if !skipped {
            self.update(dev, lr, step)?;
        }
        Ok(PlanStep {
            loss,
            skipped,
            scale,
        })
    }

    /// Releases every buffer the plan allocated (not the caller's bindings).
    pub fn free(self, dev: &dyn Device) -> Result<()> {
        for b in self.owned {
            dev.free(b)?;
        }
        Ok(())
    }
}
