//! A model on a device: its parameters in flat buffers per optimizer group, and one
//! compiled plan (forward, derived backward, overflow check, norm, update) replayed
//! every step. Everything here is the same for every [`Model`]; what a model is comes
//! only through the contract.
//!
//! A step is three phases, so a data-parallel group can put its exchange between them:
//! [`Network::accumulate`] (forward and backward over the micro-batches, gradients
//! summed), [`Network::check`] (overflow flag, norm, the step's loss) and
//! [`Network::update`] (the optimizer) or [`Network::apply`] (the optimizer with a
//! gradient factor the host decided). The loss scaler lives with the trainer, which
//! decides between the last two.

use std::cell::Cell;
use std::collections::HashSet;
use std::sync::Arc;

use super::network_build::{
    check_sharing, draw_initial, hand_over_groups, prepare, shared_gradients, NetworkOptions,
    Partition, Prepared, Recorded,
};
use super::network_memory::{host_memory_available, ModelStateBytes, NetworkMemory, ShardBytes};
use super::{Model, ParamSpec};
use crate::data;
use crate::device::optim::ParamBuffers;
use crate::graph::{
    Bindings, Graph, Group, Loss, Plan, Tensor, DOCUMENT_POSITIONS, DOCUMENT_STARTS,
};
use crate::kernels::ArgMax;
use crate::rng::SplitMix;
use crate::{Buffer, Capabilities, DType, Device, Error, HostData, Kernel, Result, IGNORE_TARGET};

/// The data of one micro-batch: one host vector per input of the model's forward pass,
/// in [`Forward::inputs`] order. Float inputs may be given as f32 (rounded to the
/// input's dtype on upload).
///
/// [`Forward::inputs`]: super::Forward::inputs
#[derive(Clone, Debug, PartialEq)]
pub struct MicroBatch(pub Vec<HostData>);

impl MicroBatch {
    /// A language model's micro-batch: token ids and next-token targets.
    pub fn tokens(tokens: &[u32], targets: &[u32]) -> MicroBatch {
        MicroBatch(vec![
            HostData::U32(tokens.to_vec()),
            HostData::U32(targets.to_vec()),
        ])
    }

    /// A language model's micro-batch of packed rows (for a network built `packed`):
    /// tokens and targets as [`MicroBatch::tokens`], and each token's document start
    /// (`starts`, row-major like the tokens: the row index where its document begins,
    /// in rows of `seq`). The positions in each document follow from the starts.
    pub fn packed(tokens: &[u32], targets: &[u32], starts: &[u32], seq: usize) -> MicroBatch {
        let positions = starts
            .iter()
            .enumerate()
            .map(|(i, &s)| ((i % seq.max(1)) as u32).wrapping_sub(s))
            .collect();
        MicroBatch(vec![
            HostData::U32(tokens.to_vec()),
            HostData::U32(targets.to_vec()),
            HostData::U32(starts.to_vec()),
            HostData::U32(positions),
        ])
    }

    /// A classifier's micro-batch: f32 features (row-major) and class ids.
    pub fn features(x: &[f32], classes: &[u32]) -> MicroBatch {
        MicroBatch(vec![
            HostData::F32(x.to_vec()),
            HostData::U32(classes.to_vec()),
        ])
    }
}

impl From<&data::Batch> for MicroBatch {
    fn from(b: &data::Batch) -> MicroBatch {
        match &b.documents {
            Some(starts) => MicroBatch::packed(&b.tokens, &b.targets, starts, b.seq),
            None => MicroBatch::tokens(&b.tokens, &b.targets),
        }
    }
}

/// The buffers a plan binds with the inputs: each micro-batch input's, then each frozen
/// weight's (declared in that order: a frozen weight is the graph's `Frozen` tensor of
/// the same place among them).
fn bound_inputs(
    r: &Recorded,
    inputs: &[Buffer],
    frozen: &[(ParamSpec, Buffer)],
) -> Vec<(Tensor, Buffer)> {
    let data = r.forward.inputs.iter().copied().zip(inputs.iter().copied());
    let weights = r
        .graph
        .frozen_weights()
        .into_iter()
        .zip(frozen.iter().map(|f| f.1));
    data.chain(weights).collect()
}

/// Called with parameter indices whose gradients just became final.
pub type Ready<'a> = &'a mut dyn FnMut(&[usize]) -> Result<()>;

/// A named parameter: its buffers (model copy, master, gradient, moments).
pub(super) struct Param {
    pub(super) spec: ParamSpec,
    pub(super) buffers: ParamBuffers,
}

/// A [`Model`] on a device, ready to train.
pub struct Network {
    pub(super) model: Arc<dyn Model>,
    pub(super) options: NetworkOptions,
    pub(super) params: Vec<Param>,
    /// Weights that are not trained (a LoRA run's base), one buffer each in the
    /// storage dtype, after the trained parameters in the model's order.
    pub(super) frozen: Vec<(ParamSpec, Buffer)>,
    /// The flat buffers every parameter's buffers are views of: the optimizer's groups
    /// (one launch each updates, checks or measures every tensor in it).
    pub(super) arenas: Vec<Group>,
    /// The forward pass as recorded, and its compiled step.
    recorded: Recorded,
    pub(super) plan: Plan,
    /// One device buffer per input, in [`Forward::inputs`] order.
    ///
    /// [`Forward::inputs`]: super::Forward::inputs
    inputs: Vec<Buffer>,
    /// Which input holds the cross-entropy targets (its trained rows weigh the loss).
    targets: Option<usize>,
    /// Rows of the loss (a regression loss weighs each 1 / rows).
    loss_rows: usize,
    pub(super) step: u32,
    /// This network's first micro-batch in the global batch of a step (rank × micro-
    /// batches per rank): dropout masks follow the global index, so a data-parallel
    /// group draws what one device accumulating the same batch would.
    micro_offset: usize,
    /// Alike blocks write their gradients into the first block's buffers (ZeRO stage
    /// 2): each micro-batch's block gradients must be handed over before the next
    /// block runs.
    shared_block_grads: bool,
    /// Rows of the uploaded micro-batch that are trained on (targets that are not
    /// IGNORE_TARGET; every row for a regression loss).
    trained: Cell<usize>,
    /// Once the blocks share gradients: the gradient buffers that remain (the arenas'
    /// are freed).
    own_grads: Vec<Buffer>,
    /// Built without the optimizer state ([`Network::new_without_optimizer`]): the
    /// empty buffer every master and moment names.
    pub(super) released: Option<Buffer>,
    /// Whole, or ZeRO stage 3's shared block buffers ([`Network::new_stage3`]).
    partition: Partition,
    /// Stage 3: the model copies of sharing tensors under the persistence threshold.
    persistent: Vec<Buffer>,
}

impl Network {
    /// Builds `model` on `dev`: parameters initialised from `options.seed` in declared
    /// order, packed into flat buffers per optimizer group; the forward pass recorded
    /// for `options.batch` examples, its backward derived and the whole step compiled.
    pub fn new(
        dev: &dyn Device,
        model: Arc<dyn Model>,
        options: &NetworkOptions,
    ) -> Result<Network> {
        Ok(Network::build(dev, model, options, true, Partition::Whole, None)?.0)
    }

    /// [`Network::new`] without the optimizer state: the model copy, gradients, plan and
    /// inputs, for a ZeRO group whose shards hold the f32 master weights and moments
    /// (on the devices or in host memory, see `parallel::zero`), so a device never
    /// holds the whole state, not even while the group is built. Returns the network
    /// and every trained parameter's initial f32 master, in model order: what the
    /// shards start from. It checks the device and the host memory building it takes;
    /// the group's peak on the host (a checkpoint's gather, offloaded shards) is
    /// [`Network::check_memory`]'s to check, before the first replica.
    pub fn new_without_optimizer(
        dev: &dyn Device,
        model: Arc<dyn Model>,
        options: &NetworkOptions,
    ) -> Result<(Network, Vec<Vec<f32>>)> {
        Network::build(dev, model, options, false, Partition::Whole, None)
    }

    /// A ZeRO stage-3 replica ([`Partition::Stage3`]): as
    /// [`Network::new_without_optimizer`], and alike blocks share the first block's
    /// gradient buffers (as after [`Network::share_block_gradients`]) and, for tensors
    /// of at least `persistence_threshold` elements, its model-copy buffers: each
    /// block's model copy lives in host memory and is loaded before the launches that
    /// read it. The host copies are taken from `alike` (another replica of the same
    /// model and options, so a process holds one copy) when given, else made from the
    /// initial weights.
    pub fn new_stage3(
        dev: &dyn Device,
        model: Arc<dyn Model>,
        options: &NetworkOptions,
        persistence_threshold: usize,
        alike: Option<&Network>,
    ) -> Result<(Network, Vec<Vec<f32>>)> {
        let partition = Partition::Stage3 {
            persistence_threshold,
        };
        Network::build(dev, model, options, false, partition, alike)
    }

    fn build(
        dev: &dyn Device,
        model: Arc<dyn Model>,
        options: &NetworkOptions,
        optimizer_state: bool,
        partition: Partition,
        alike: Option<&Network>,
    ) -> Result<(Network, Vec<Vec<f32>>)> {
        let Prepared {
            specs,
            frozen: frozen_specs,
            recorded,
            layout,
            mut memory,
            share,
            streamed,
        } = prepare(model.as_ref(), options, partition)?;
        if !optimizer_state {
            memory = memory.without_optimizer();
            // A ZeRO replica: its group's check (`check_memory`) counted the host's
            // peak (a checkpoint's gather, the shards); the replica checks what
            // building it takes, which the replicas built before it have not freed.
            memory.host = memory.build_host;
        }
        // Before the first host vector or device buffer: a model that cannot fit is
        // refused with what it needs, not found out by an allocation that aborts.
        memory.check_fit(
            &model.describe(),
            options.dtype,
            &[dev.caps()],
            host_memory_available(),
        )?;
        let act = options.dtype;
        let mut rng = SplitMix(options.seed);
        // Initial values in model order (the draws do not depend on the layout), each
        // written at its place in its arena (the gaps stay zero for good) or, for a
        // tensor that takes the first block's buffers, kept on the host.
        let mut inits: Vec<Vec<f32>> = layout.arenas.iter().map(|a| vec![0.0; a.2]).collect();
        let mut loose: Vec<Vec<f32>> = vec![vec![]; specs.len()];
        for (i, (spec, place)) in specs.iter().zip(&layout.places).enumerate() {
            let values = match *place {
                Some((arena, at)) => &mut inits[arena][at..at + spec.len()],
                None => {
                    loose[i] = vec![0.0; spec.len()];
                    &mut loose[i][..]
                }
            };
            draw_initial(spec, &mut rng, values);
        }
        // The frozen weights are drawn after the trained ones, as the model lists them.
        let mut frozen = vec![];
        for spec in frozen_specs {
            let mut values = vec![0.0; spec.len()];
            draw_initial(&spec, &mut rng, &mut values);
            let buf = dev.alloc(act, values.len())?;
            dev.upload(buf, &HostData::from_f32(act, &values))?;
            frozen.push((spec, buf));
        }
        // Without the optimizer state one empty buffer stands for every master and
        // moment.
        let released = match optimizer_state {
            true => None,
            false => Some(dev.alloc(DType::F32, 0)?),
        };
        let mut arenas = vec![];
        for (&(f32_grad, decay, _), init) in layout.arenas.iter().zip(&inits) {
            let grad = if f32_grad { DType::F32 } else { act };
            let buffers = match released {
                None => ParamBuffers::new(dev, init, act, grad)?,
                Some(empty) => ParamBuffers::without_state(dev, init, act, grad, empty)?,
            };
            arenas.push(Group { buffers, decay });
        }
        let mut params: Vec<Param> = vec![];
        let mut masters = vec![];
        let mut persistent = vec![];
        for (i, (spec, place)) in specs.into_iter().zip(&layout.places).enumerate() {
            let n = spec.len();
            let buffers = match (*place, share[i], released) {
                (Some((arena, at)), _, _) => {
                    let whole = &arenas[arena].buffers;
                    let view = |b: Buffer| match released {
                        Some(empty) if b == empty => Ok(empty),
                        _ => dev.view(b, at, n),
                    };
                    if released.is_some() {
                        masters.push(inits[arena][at..at + n].to_vec());
                    }
                    ParamBuffers {
                        value: view(whole.value)?,
                        master: view(whole.master)?,
                        grad: view(whole.grad)?,
                        m: view(whole.m)?,
                        v: view(whole.v)?,
                    }
                }
                (None, Some(q), Some(empty)) => {
                    let first = params[q].buffers;
                    let value = if streamed[i] {
                        first.value
                    } else {
                        let own = dev.alloc(act, n)?;
                        dev.upload(own, &HostData::from_f32(act, &loose[i]))?;
                        persistent.push(own);
                        own
                    };
                    masters.push(std::mem::take(&mut loose[i]));
                    ParamBuffers {
                        value,
                        grad: first.grad,
                        master: empty,
                        m: empty,
                        v: empty,
                    }
                }
                _ => unreachable!("a tensor without a place shares, and only without state"),
            };
            params.push(Param { buffers, spec });
        }
        let g = &recorded.graph;
        let mut inputs = vec![];
        for &t in &recorded.forward.inputs {
            let (_, shape, dtype) = g.describe(t);
            inputs.push(dev.alloc(dtype, shape.iter().product())?);
        }
        let targets = match g.loss() {
            Some(Loss::CrossEntropy { targets }) => {
                recorded.forward.inputs.iter().position(|&i| i == targets)
            }
            _ => None,
        };
        let loss_rows = g.losses().map_or(0, |l| g.shape(l).iter().product());
        let stage3 = partition != Partition::Whole;
        let bindings = Bindings {
            params: params.iter().map(|p| p.buffers).collect(),
            inputs: bound_inputs(&recorded, &inputs, &frozen),
            // Stage 3's gradients are shared as stage 2's: each tensor its own group.
            groups: if stage3 { vec![] } else { arenas.clone() },
        };
        let optimizer = released.is_none().then_some(&options.optimizer);
        let plan = g.compile(dev, &bindings, optimizer)?;
        if stage3 {
            // As stage 2: the blocks that share gradient buffers must write them one
            // after another.
            let writes = |p: usize| plan.gradient_writes(p);
            check_sharing(&model.blocks(), &share, &writes, &model.describe())?;
        }
        for (p, &s) in streamed.iter().enumerate() {
            if !s {
                continue;
            }
            let host = match alike.and_then(|a| a.plan.streamed(p)) {
                Some(h) => h,
                None => Arc::new(HostData::from_f32(act, &masters[p])),
            };
            plan.set_streamed(p, host)?;
        }
        let network = Network {
            model,
            options: options.clone(),
            params,
            frozen,
            arenas,
            recorded,
            plan,
            inputs,
            targets,
            loss_rows,
            step: 0,
            micro_offset: 0,
            shared_block_grads: stage3,
            trained: Cell::new(0),
            own_grads: vec![],
            released,
            partition,
            persistent,
        };
        Ok((network, masters))
    }

    /// What [`Network::new`] allocates for `model` with `options`, computed without a
    /// device (tested equal to a device's allocator): the forward pass is recorded and
    /// the plan's buffers assigned as compiling would, over stand-in buffers.
    pub fn memory(model: &dyn Model, options: &NetworkOptions) -> Result<NetworkMemory> {
        Network::memory_partitioned(model, options, Partition::Whole)
    }

    /// [`Network::memory`] of a replica laid out as `partition` says (ZeRO stage 3:
    /// [`Network::new_stage3`], whose optimizer state the shards hold).
    pub fn memory_partitioned(
        model: &dyn Model,
        options: &NetworkOptions,
        partition: Partition,
    ) -> Result<NetworkMemory> {
        Ok(prepare(model, options, partition)?.memory)
    }

    /// [`Network::memory`] for a data-parallel group of one replica per device in
    /// `devs`, refused where it cannot fit (see [`NetworkMemory::check_fit`]): the
    /// replicas of devices that share the host's memory add up. [`Network::new`] checks
    /// one device; a group checks all of them before building the first. With
    /// `shards` the group is built with [`Network::new_without_optimizer`] and ZeRO's
    /// shards: each device holds its slice of the optimizer state (none when
    /// offloaded) in place of the whole, and the host the offloaded slices; with
    /// `partition` stage 3, each replica is laid out as [`Network::new_stage3`] does.
    pub fn check_memory(
        model: &dyn Model,
        options: &NetworkOptions,
        devs: &[&dyn Device],
        (shards, partition): (Option<ShardBytes>, Partition),
    ) -> Result<NetworkMemory> {
        let mut m = Network::memory_partitioned(model, options, partition)?;
        if let Some(shards) = shards {
            m = m.with_shards(shards);
        }
        let caps: Vec<&Capabilities> = devs.iter().map(|d| d.caps()).collect();
        m.check_fit(
            &model.describe(),
            options.dtype,
            &caps,
            host_memory_available(),
        )?;
        Ok(m)
    }

    /// The model this network runs.
    pub fn model(&self) -> &Arc<dyn Model> {
        &self.model
    }

    pub fn options(&self) -> &NetworkOptions {
        &self.options
    }

    /// The recorded graph (forward pass and loss).
    pub fn graph(&self) -> &Graph {
        &self.recorded.graph
    }

    /// The device buffer of a graph output kept readable after a step (the prediction
    /// and the per-row losses always are; see [`Graph::output`]).
    pub fn output(&self, t: Tensor) -> Option<Buffer> {
        self.plan.buffer(t)
    }

    /// The prediction tensor (the logits) of the recorded forward pass.
    pub fn prediction(&self) -> Tensor {
        self.recorded.forward.prediction
    }

    /// Compiles the plan again after the buffers it binds changed: the blocks share
    /// gradients (no arenas' gradients to check: each parameter is its own group) or
    /// the optimizer state went (no update). The old plan's buffers are freed first.
    pub(super) fn recompile(&mut self, dev: &dyn Device) -> Result<()> {
        let r = &self.recorded;
        let bindings = Bindings {
            params: self.params.iter().map(|p| p.buffers).collect(),
            inputs: bound_inputs(r, &self.inputs, &self.frozen),
            groups: if self.shared_block_grads {
                vec![]
            } else {
                self.arenas.clone()
            },
        };
        let optimizer = self.released.is_none().then_some(&self.options.optimizer);
        self.plan.free(dev)?;
        let plan = r.graph.compile(dev, &bindings, optimizer)?;
        plan.adopt_streamed(&self.plan)?;
        self.plan = plan;
        Ok(())
    }

    /// Checks a micro-batch against the inputs (count, dtypes, lengths, ids in range)
    /// and uploads it.
    fn upload(&self, dev: &dyn Device, batch: &MicroBatch) -> Result<()> {
        let g = &self.recorded.graph;
        let names = &self.recorded.forward.inputs;
        let whole;
        let batch = match g.packed_inputs()?[..] {
            [starts, positions] if batch.0.len() + 2 == names.len() => {
                let mut inputs = batch.0.clone();
                for t in [starts, positions] {
                    let (name, shape, _) = g.describe(t);
                    inputs.extend(one_document_per_row(name, shape));
                }
                whole = MicroBatch(inputs);
                &whole
            }
            _ => batch,
        };
        if batch.0.len() != names.len() {
            let list: Vec<&str> = names.iter().map(|&t| g.describe(t).0).collect();
            return Err(Error::InvalidArgument(format!(
                "a micro-batch of {} holds {} inputs ({}), got {}",
                self.model.describe(),
                names.len(),
                list.join(", "),
                batch.0.len()
            )));
        }
        let mut data = vec![];
        for (&t, given) in names.iter().zip(&batch.0) {
            data.push(batch_input(g, t, given)?);
        }
        check_ids(g, names, &data)?;
        check_documents(g, names, &data)?;
        let trained = match self.targets.map(|k| &data[k]) {
            Some(HostData::U32(t)) => t.iter().filter(|&&x| x != IGNORE_TARGET).count(),
            _ => self.loss_rows,
        };
        self.trained.set(trained);
        for (&buf, d) in self.inputs.iter().zip(&data) {
            dev.upload(buf, d)?;
        }
        Ok(())
    }

    /// 1 / the rows of the uploaded micro-batch that are trained on: the loss is their
    /// mean (ignored positions weigh nothing; a batch with none has loss 0).
    fn per_row(&self) -> f32 {
        1.0 / self.trained.get().max(1) as f32
    }

    /// Mean of the trained rows' losses, summed in f64 (finite differences need the
    /// digits).
    fn mean_loss(&self, dev: &dyn Device) -> Result<f64> {
        Ok(self.plan.loss_sum(dev)? / self.trained.get().max(1) as f64)
    }

    /// Mean loss of a micro-batch, no update (evaluation: dropout off).
    pub fn loss(&self, dev: &dyn Device, batch: &MicroBatch) -> Result<f64> {
        self.upload(dev, batch)?;
        self.plan.evaluate(dev)?;
        self.mean_loss(dev)
    }

    /// Forward and backward with loss scale 1; returns the loss. Gradients are left in
    /// the parameters' grad buffers (see [`Network::gradients`]).
    pub fn loss_and_gradients(&mut self, dev: &dyn Device, batch: &MicroBatch) -> Result<f64> {
        self.upload(dev, batch)?;
        self.plan.set_random_state(self.random_key(0));
        self.plan.accumulate(dev, 1.0, self.per_row(), 0)?;
        self.mean_loss(dev)
    }

    /// Mean loss of a micro-batch and the index of the largest prediction in every row
    /// of the prediction (a language model's next token at every position, a
    /// classifier's class): one forward pass, for evaluation.
    pub fn predict(&self, dev: &dyn Device, batch: &MicroBatch) -> Result<(f64, Vec<u32>)> {
        let loss = self.loss(dev, batch)?;
        let t = self.recorded.forward.prediction;
        let cols = *self.recorded.graph.shape(t).last().unwrap_or(&1);
        // A padded vocabulary's padding columns are no token: never predicted.
        let classes = self.recorded.graph.classes_of(t).clamp(1, cols.max(1));
        let buf = self
            .plan
            .buffer(t)
            .expect("the prediction is a graph output");
        Ok((loss, best_per_row(dev, buf, cols, classes)?))
    }

    /// (name, gradient) of every parameter, as f32.
    pub fn gradients(&self, dev: &dyn Device) -> Result<Vec<(String, Vec<f32>)>> {
        self.check_own_gradients()?;
        self.params
            .iter()
            .map(|p| Ok((p.spec.name.clone(), dev.download(p.buffers.grad)?.to_f32())))
            .collect()
    }

    pub(super) fn param(&self, index: usize) -> Result<&Param> {
        self.params.get(index).ok_or_else(|| {
            Error::InvalidArgument(format!(
                "network: parameter {index} does not exist; {} has {}",
                self.model.describe(),
                self.params.len()
            ))
        })
    }

    /// Optimizer steps applied so far (skipped steps do not count; the LR schedule and
    /// Adam's bias correction follow this).
    pub fn steps_applied(&self) -> u32 {
        self.step
    }

    /// Every parameter as declared.
    pub fn specs(&self) -> impl Iterator<Item = &ParamSpec> {
        self.params.iter().map(|p| &p.spec)
    }

    /// A step's first phase: forward and backward over the micro-batches at
    /// `loss_scale`, each micro-batch's mean loss weighing 1/n, so the grad buffers end
    /// up holding the scaled gradient of the step's mean loss. Submitted, not waited
    /// for: several devices can compute at once.
    pub fn accumulate(
        &mut self,
        dev: &dyn Device,
        micro: &[MicroBatch],
        loss_scale: f32,
    ) -> Result<()> {
        let per_row = 1.0 / self.trained_rows(micro).max(1) as f32;
        self.accumulate_hooked(dev, micro, loss_scale, per_row, None)
    }

    /// The rows of `micro` that are trained on: targets that are not
    /// [`IGNORE_TARGET`] (every row of a loss without targets). A step's loss is the
    /// mean over the trained rows of its whole global batch — every micro-batch of
    /// every rank — not a mean of per-micro-batch means, which would weigh a token of a
    /// micro-batch with few trained rows more than one of a micro-batch with many.
    pub fn trained_rows(&self, micro: &[MicroBatch]) -> usize {
        micro
            .iter()
            .map(|b| match self.targets.and_then(|k| b.0.get(k)) {
                Some(HostData::U32(t)) => t.iter().filter(|&&x| x != IGNORE_TARGET).count(),
                _ => self.loss_rows,
            })
            .sum()
    }

    /// [`Network::accumulate`] with each trained row's loss weighing `per_row` (1 / the
    /// trained rows of the global batch, see [`Network::trained_rows`], times the ranks
    /// an exchange averages over), calling `ready(params)` during the last micro-batch's
    /// backward as soon as those parameters' gradients are final and submitted: each
    /// block's (the model's [`Model::blocks`], in the order backward finishes them),
    /// then the parameters outside blocks. A data-parallel group starts exchanging them
    /// while the rest of backward runs. With [`Network::share_block_gradients`] every
    /// micro-batch's gradients are written afresh and handed over: the caller sums them.
    pub fn accumulate_with(
        &mut self,
        dev: &dyn Device,
        micro: &[MicroBatch],
        loss_scale: f32,
        per_row: f32,
        ready: Option<Ready<'_>>,
    ) -> Result<()> {
        self.accumulate_hooked(dev, micro, loss_scale, per_row, ready)
    }

    /// The groups [`Network::accumulate_with`] hands over: each block in two parts,
    /// then the parameters outside blocks. A block's first part is what its backward
    /// finishes first, up to at least half the block's elements (a GPT block's MLP);
    /// handing it over at once lets the exchange of that part overlap the rest of the
    /// block's backward, which matters most for the last block backward reaches: as a
    /// whole, its gradients could only be exchanged after backward (an eighth of an
    /// 8-layer GPT's). Two parts, not one per kernel: each part costs a submission.
    pub fn ready_groups(&self) -> Vec<Vec<usize>> {
        let len = |p: usize| self.params.get(p).map_or(0, |x| x.spec.len());
        let writes = |p: usize| self.plan.gradient_writes(p);
        hand_over_groups(self.model.blocks(), self.params.len(), &len, &writes)
    }

    fn accumulate_hooked(
        &mut self,
        dev: &dyn Device,
        micro: &[MicroBatch],
        loss_scale: f32,
        per_row: f32,
        mut ready: Option<Ready<'_>>,
    ) -> Result<()> {
        if micro.is_empty() {
            return Err(Error::InvalidArgument(
                "network: a step needs at least one micro-batch".into(),
            ));
        }
        if self.shared_block_grads && ready.is_none() {
            return Err(Error::InvalidArgument(
                "network: the blocks share one set of gradient buffers (ZeRO stage 2), so \
                 each block's gradients must be handed over as they are made: give \
                 accumulate_with a ready callback"
                    .into(),
            ));
        }
        let groups = self.ready_groups();
        let count = micro.len();
        for (i, batch) in micro.iter().enumerate() {
            self.upload(dev, batch)?;
            self.plan.set_random_state(self.random_key(i));
            match &mut ready {
                Some(r) if self.shared_block_grads || i + 1 == count => {
                    self.plan
                        .accumulate_with(dev, (loss_scale, per_row, i), &groups, &mut **r)?
                }
                _ => self.plan.accumulate(dev, loss_scale, per_row, i)?,
            }
        }
        Ok(())
    }

    /// Places this network's micro-batches at `offset` in a step's global batch (a
    /// data-parallel rank's first); see [`Network::random_key`].
    pub fn set_micro_offset(&mut self, offset: usize) {
        self.micro_offset = offset;
    }

    /// The key dropout masks derive from for micro-batch `micro` of the step being
    /// taken: a function of the seed, the steps applied and the micro-batch's place in
    /// the global batch, so a resumed run draws the masks it would have drawn.
    pub fn random_key(&self, micro: usize) -> u64 {
        random_key(self.options.seed, self.step, self.micro_offset + micro)
    }

    /// After [`Network::accumulate`]: the overflow check over every gradient and the
    /// factor the update will multiply them by (unscaling, and clipping to global L2
    /// norm `clip` when above 0). Returns whether the gradients overflowed and the
    /// step's loss (waits for the device).
    pub fn check(&mut self, dev: &dyn Device, clip: f32) -> Result<(bool, f32)> {
        self.plan.check(dev, clip)?;
        let overflow = self.plan.overflowed(dev)?;
        Ok((overflow, self.plan.step_loss(dev)? as f32))
    }

    /// The optimizer step at learning rate `lr`, with the factor [`Network::check`]
    /// computed on the device.
    pub fn update(&mut self, dev: &dyn Device, lr: f32) -> Result<()> {
        self.plan.update(dev, lr, self.step + 1)?;
        self.step += 1;
        Ok(())
    }

    /// A step's last phase when the host has decided it (a data-parallel group: the
    /// overflow check, norm and scaler ran on the reduced gradients): applies the
    /// optimizer with every gradient multiplied by `grad_scale` (1 / (loss scale × clip
    /// factor)) at learning rate `lr`.
    pub fn apply(&mut self, dev: &dyn Device, lr: f32, grad_scale: f32) -> Result<()> {
        self.plan.apply(dev, lr, self.step + 1, grad_scale)?;
        self.step += 1;
        Ok(())
    }

    /// The factor the last step multiplied gradients by (1 / (loss scale * clip factor)).
    pub fn last_grad_scale(&self, dev: &dyn Device) -> Result<f32> {
        self.plan.grad_scale(dev)
    }

    /// Parameter `index`'s gradient as f32 (waits for the work that writes it).
    pub fn gradient(&self, dev: &dyn Device, index: usize) -> Result<Vec<f32>> {
        self.check_own_gradients()?;
        Ok(dev.download(self.param(index)?.buffers.grad)?.to_f32())
    }

    /// Overwrites parameter `index`'s gradient (rounded to its dtype).
    pub fn set_gradient(&self, dev: &dyn Device, index: usize, grad: &[f32]) -> Result<()> {
        self.check_own_gradients()?;
        let g = self.param(index)?.buffers.grad;
        dev.upload(g, &HostData::from_f32(g.dtype, grad))
    }

    /// Shared block gradients hold whichever block ran last: reading them as one
    /// parameter's gradient would be wrong without saying so.
    fn check_own_gradients(&self) -> Result<()> {
        if self.shared_block_grads {
            return Err(Error::InvalidArgument(
                "network: the blocks share one set of gradient buffers (ZeRO stage 2); a \
                 block's gradients exist only while accumulate_with hands them over"
                    .into(),
            ));
        }
        Ok(())
    }

    /// ZeRO stage 2's gradient partitioning on this replica: every block that looks
    /// like the model's first writes its gradients into the first block's buffers, and
    /// the arenas' gradients are freed, so a device holds one block's gradients (plus
    /// those outside blocks) instead of all of them. [`Network::accumulate_with`] then
    /// hands over each block's gradients of every micro-batch before the next block
    /// overwrites them (the copy to staging memory is queued in-stream ahead of that
    /// block's backward), and the group keeps only each rank's reduced shard. The plan
    /// is compiled again over the shared buffers; a model whose blocks' backward
    /// passes interleave cannot share and is refused.
    pub fn share_block_gradients(&mut self, dev: &dyn Device) -> Result<()> {
        if self.shared_block_grads {
            return Ok(());
        }
        let specs: Vec<ParamSpec> = self.params.iter().map(|p| p.spec.clone()).collect();
        let blocks = self.model.blocks();
        let sharing = shared_gradients(&specs, &blocks);
        // The blocks that share must write their gradients one after another.
        let writes = |p: usize| self.plan.gradient_writes(p);
        check_sharing(&blocks, &sharing, &writes, &self.model.describe())?;
        let mut grads = vec![];
        for (p, shared) in self.params.iter().zip(&sharing) {
            grads.push(match shared {
                Some(_) => None,
                None => Some(dev.alloc(p.buffers.grad.dtype, p.buffers.grad.len)?),
            });
        }
        for p in &self.params {
            dev.free(p.buffers.grad)?;
        }
        for a in &self.arenas {
            dev.free(a.buffers.grad)?;
        }
        for i in 0..self.params.len() {
            let g = match (grads[i], sharing[i]) {
                (Some(g), _) => g,
                (None, Some(q)) => grads[q].expect("the first block has its own"),
                (None, None) => unreachable!("a parameter either shares or owns"),
            };
            self.params[i].buffers.grad = g;
        }
        self.own_grads = grads.into_iter().flatten().collect();
        self.shared_block_grads = true;
        self.recompile(dev)
    }

    /// Whether parameter `index`'s model copy lives in host memory and is loaded before
    /// use (a ZeRO stage-3 replica's block weights, see [`Network::new_stage3`]).
    pub fn streams(&self, index: usize) -> bool {
        self.plan.streams(index)
    }

    /// What loading streamed weights moved since the last call (ZeRO stage 3).
    pub fn take_stream_stats(&self) -> crate::graph::StreamStats {
        self.plan.take_stream_stats()
    }

    /// Parameter `index`'s gradient buffer (a data-parallel group downloads it from
    /// another thread while this network records the rest of backward).
    pub fn gradient_buffer(&self, index: usize) -> Buffer {
        self.params[index].buffers.grad
    }

    /// Elements of parameter `index`.
    pub fn parameter_len(&self, index: usize) -> usize {
        self.params[index].spec.len()
    }

    /// Ψ: parameter elements in all (a tied tensor once).
    pub fn parameter_count(&self) -> usize {
        self.params.iter().map(|p| p.spec.len()).sum()
    }

    /// Number of parameter tensors.
    pub fn parameter_tensors(&self) -> usize {
        self.params.len()
    }

    /// Mean loss of the micro-batches the last [`Network::accumulate`] ran (waits for
    /// them).
    pub fn accumulated_loss(&self, dev: &dyn Device) -> Result<f32> {
        Ok(self.plan.step_loss(dev)? as f32)
    }

    /// Device bytes of this replica's model states as allocated: model copy,
    /// gradients (shared ones once) and f32 master + moments (one empty buffer when
    /// built by [`Network::new_without_optimizer`]).
    pub fn model_state_bytes(&self) -> ModelStateBytes {
        let whole = |f: fn(&ParamBuffers) -> u64| -> u64 {
            self.arenas.iter().map(|a| f(&a.buffers)).sum()
        };
        ModelStateBytes {
            weights: whole(|b| b.value.bytes())
                + self.frozen.iter().map(|f| f.1.bytes()).sum::<u64>()
                + self.persistent.iter().map(|b| b.bytes()).sum::<u64>(),
            // Stage 3's shared gradients are the arenas' (built shared).
            gradients: if self.shared_block_grads && self.partition == Partition::Whole {
                self.own_grads.iter().map(|g| g.bytes()).sum()
            } else {
                whole(|b| b.grad.bytes())
            },
            optimizer: match self.released {
                Some(empty) => empty.bytes(),
                None => whole(|b| b.master.bytes() + b.m.bytes() + b.v.bytes()),
            },
            offloaded: 0,
        }
    }

    /// Bytes of all gradient buffers as stored on the device (shared ones once).
    pub fn gradient_bytes(&self) -> u64 {
        let mut seen = HashSet::new();
        self.params
            .iter()
            .filter(|p| seen.insert(p.buffers.grad.id))
            .map(|p| p.buffers.grad.bytes())
            .sum()
    }

    /// Every parameter's gradient as f32, in parameter order (waits for the device).
    pub fn gradient_values(&self, dev: &dyn Device) -> Result<Vec<Vec<f32>>> {
        self.check_own_gradients()?;
        self.params
            .iter()
            .map(|p| Ok(dev.download(p.buffers.grad)?.to_f32()))
            .collect()
    }

    /// Overwrites every gradient (rounded to the grad buffers' dtypes): how a
    /// data-parallel group hands back the gradients it reduced on the host.
    pub fn set_gradients(&self, dev: &dyn Device, grads: &[Vec<f32>]) -> Result<()> {
        if grads.len() != self.params.len() {
            return Err(Error::InvalidArgument(format!(
                "network: {} gradients for {} parameters",
                grads.len(),
                self.params.len()
            )));
        }
        self.check_own_gradients()?;
        for (p, g) in self.params.iter().zip(grads) {
            dev.upload(p.buffers.grad, &HostData::from_f32(p.buffers.grad.dtype, g))?;
        }
        Ok(())
    }

    /// (name, shape, storage dtype, weight decay applies) of every parameter, in order.
    pub fn parameter_layout(&self) -> Vec<(String, Vec<usize>, DType, bool)> {
        self.params
            .iter()
            .map(|p| {
                let s = &p.spec;
                (
                    s.name.clone(),
                    s.shape.clone(),
                    p.buffers.value.dtype,
                    s.decay,
                )
            })
            .collect()
    }
}

/// A micro-batch's value for graph input `t`, checked against its shape and converted
/// to its dtype (f32 given for a 16-bit input is rounded once).
pub(crate) fn batch_input(g: &Graph, t: Tensor, given: &HostData) -> Result<HostData> {
    let (name, shape, dtype) = g.describe(t);
    let len: usize = shape.iter().product();
    if given.len() != len {
        return Err(Error::InvalidArgument(format!(
            "`{name}` of a micro-batch holds {len} values ({shape:?} {dtype}), got {}",
            given.len()
        )));
    }
    match (given, dtype.is_float()) {
        (HostData::F32(x), true) if dtype != DType::F32 => Ok(HostData::from_f32(dtype, x)),
        _ if given.dtype() == dtype => Ok(given.clone()),
        _ => Err(Error::DTypeMismatch {
            what: format!("`{name}` of a micro-batch"),
            expected: dtype,
            found: given.dtype(),
        }),
    }
}

/// Checks the token ids among `data` (the values of graph inputs `inputs`, in order)
/// against the graph's vocabulary limits. Checked on the host: on the device an
/// out-of-range id would quietly give NaN losses or skip every step. Targets may be
/// IGNORE_TARGET (not trained on). Limits of tensors not among `inputs` are skipped.
pub(crate) fn check_ids(g: &Graph, inputs: &[Tensor], data: &[HostData]) -> Result<()> {
    for (t, bound, what, ignore) in g.id_limits() {
        let Some(k) = inputs.iter().position(|&i| i == t) else {
            continue;
        };
        let HostData::U32(ids) = &data[k] else {
            continue;
        };
        let bad = ids
            .iter()
            .enumerate()
            .find(|&(_, &id)| id as usize >= bound && !(ignore && id == IGNORE_TARGET));
        if let Some((i, &id)) = bad {
            return Err(Error::InvalidArgument(format!(
                "{what} {id} at position {i} of `{}` is outside the vocabulary of {bound}",
                g.describe(t).0
            )));
        }
    }
    Ok(())
}

/// The value of a packed graph's input `name` of `shape` (B, T) for a micro-batch given
/// without its documents: each row is one (evaluation scores held-out examples one per
/// row). `None` for any other input.
pub(crate) fn one_document_per_row(name: &str, shape: &[usize]) -> Option<HostData> {
    let (n, seq) = (
        shape.iter().product::<usize>(),
        shape.get(1).copied()?.max(1),
    );
    match name {
        DOCUMENT_STARTS => Some(HostData::U32(vec![0; n])),
        DOCUMENT_POSITIONS => Some(HostData::U32((0..n).map(|i| (i % seq) as u32).collect())),
        _ => None,
    }
}

/// Checks the packing inputs of a micro-batch, which the attention kernels trust:
/// in each row every token's document starts at or before it, where the token before
/// it starts (the same document) or at the token itself (a new one), and its position
/// is its distance from that start.
pub(crate) fn check_documents(g: &Graph, inputs: &[Tensor], data: &[HostData]) -> Result<()> {
    // Found by name, so a pipeline stage's part of a packed graph is checked too; a
    // stage may read only one of the two (a GPT stage after the embedding reads no
    // positions), which is then checked alone.
    let named = |n: &str| inputs.iter().position(|&t| g.describe(t).0 == n);
    let values = |k: Option<usize>| match k.map(|k| &data[k]) {
        Some(HostData::U32(v)) => Some(v.as_slice()),
        _ => None,
    };
    let (k_starts, k_positions) = (named(DOCUMENT_STARTS), named(DOCUMENT_POSITIONS));
    let (starts, positions) = (values(k_starts), values(k_positions));
    let Some(k) = k_starts.or(k_positions) else {
        return Ok(());
    };
    let seq = g.describe(inputs[k]).1[1].max(1);
    let n = starts.or(positions).map_or(0, |v| v.len());
    let mut previous = 0;
    for i in 0..n {
        let (row, t) = (i / seq, (i % seq) as u32);
        // Where one is missing, what the other implies.
        let start = starts.map_or_else(|| t.wrapping_sub(positions.unwrap()[i]), |s| s[i]);
        let pos = positions.map_or_else(|| t.wrapping_sub(start), |p| p[i]);
        let continues = t > 0 && start == previous;
        if start > t || !(continues || start == t) || pos != t - start {
            return Err(Error::InvalidArgument(format!(
                "packed micro-batch: row {row}, token {t}: document start {start} and \
                 position {pos}; a token's document starts where the previous token's does \
                 or at the token itself, and its position is its distance from that start"
            )));
        }
        previous = start;
    }
    Ok(())
}

/// The key dropout masks derive from for micro-batch `micro` (its place in the global
/// batch) of the step after `steps` applied ones, for a network seeded `seed`.
pub(crate) fn random_key(seed: u64, steps: u32, micro: usize) -> u64 {
    let step = u64::from(steps).wrapping_mul(0xD1B5_4A32_D192_ED03);
    let at = (micro as u64).wrapping_mul(0x8CB9_2BA7_2F3D_8DD7);
    SplitMix(seed ^ step ^ at).next_u64()
}

/// The index of the largest of the first `classes` values of each row of `values`
/// (rows of `cols`), the first of equal ones, computed on the device
/// ([`ArgMax`]): evaluation downloads 4 bytes a row instead of the logits (a GPT-2
/// micro-batch of 8 x 1024 positions: 32 KiB rather than 800 MiB of f16 logits).
pub(crate) fn best_per_row(
    dev: &dyn Device,
    values: Buffer,
    cols: usize,
    classes: usize,
) -> Result<Vec<u32>> {
    let out = dev.alloc(DType::U32, values.len / cols.max(1))?;
    let best = (|| {
        dev.launch(&Kernel::ArgMax(ArgMax {
            x: values,
            out,
            cols,
            classes,
        }))?;
        dev.submit()?;
        match dev.download(out)? {
            HostData::U32(v) => Ok(v),
            other => Err(Error::DTypeMismatch {
                what: "argmax: the predictions downloaded".into(),
                expected: DType::U32,
                found: other.dtype(),
            }),
        }
    })();
    dev.free(out)?;
    best
}
