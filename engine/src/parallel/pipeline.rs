//! Pipeline parallelism: one model split over `p` devices, trained with the
//! synchronous 1F1B schedule ([`Schedule`]).
//!
//! The model's forward is recorded once and cut at the graph level
//! ([`Graph::split`]): each block's parameters go to the stage the partition gives
//! its block, every other op runs on the latest stage among its operands. Each stage
//! is a compiled plan on its own device, in as many activation slots as it holds
//! micro-batches at once (at most `p - s` on stage `s`, never more than `m`): one plan
//! per slot, all sharing the stage's parameters, gradients and optimizer state, so
//! memory does not grow with the micro-batches. One thread per stage runs its
//! instruction list; activations go forward and their gradients back device → host →
//! device, each message carrying the tensors' shapes, which the receiver checks. A
//! stage queues each outgoing copy behind the launch that produced it and goes on
//! recording its next work; a courier thread of its own waits for the copy and sends
//! it, so the transfer overlaps the stage's next compute.
//!
//! The step's end is decided once for the whole pipeline: a parameter several stages
//! hold (a tied embedding) has its gradients summed on the host in stage order and
//! written back to every copy, so the copies stay bit-identical; the overflow flag is
//! any stage's; the squared norm is every stage's, with each replicated parameter
//! counted once (its summed gradient); the clip factor and the loss scale give one
//! gradient factor every stage's optimizer applies. A stage that fails closes its
//! channels, so every other stage stops at its next transfer with an error instead
//! of waiting.
//!
//! Dropout draws what one device would: every op keeps the index it had in the whole
//! graph, and micro-batch `i` of a step runs under the key a [`Network`] would use.
//!
//! Transfers are staged per activation slot: a stage queues each outgoing copy (its
//! `begin_download`) as soon as the producing launch is recorded, so every message
//! of the micro-batches it holds can be in flight at once, not one; its courier
//! finishes them in order. A receiver uploads into the buffers of the slot the
//! micro-batch goes to, so a message never waits for the previous one's compute.
//! What a stage still waits for is reported per step in two parts
//! ([`StepReport::waited`], [`StepReport::exposed`]): all of its waiting, and the
//! exposed transfer time, the part of each wait after its peer had posted the
//! message (recorded the producing work and queued the copy behind it) until the
//! message arrived. On a device that runs a launch before the next is recorded (the
//! CPU) that is exactly the time the transfer itself cost the receiver; on a GPU,
//! whose posted work may still be computing, it is an upper bound.
//!
//! `dp` replicas of the pipeline (pp × dp, [`Pipeline::replicated`]) share the cut:
//! devices come stage-major (`devs[s * dp + r]` is stage `s` of replica `r`), each
//! replica takes `m` consecutive micro-batches of the step's `dp · m` (the
//! data-parallel ranks' split of a global batch, with the same dropout keys), and at
//! the step's end every stage's gradients come to the host: a tied parameter's copies
//! summed within each replica (stage order), then each tensor folded over the
//! replicas in replica order and averaged ([`exchange::fold`]; a stage's own tensors
//! as soon as its replicas have reported, which the last stage does first, so the
//! host's sums overlap the earlier stages' last backwards), so the overflow flag
//! and the norm ([`exchange::inspect`], tensors in model order) are those of a
//! data-parallel group, and every stage of every replica takes the one decision.
//! Under ZeRO stage 1 or 2 each stage's f32 masters and moments are sharded over its
//! dp group ([`Shards`], the stage's parameters a model of their own to it): a rank
//! receives only its slice of the averaged gradient, updates it and the updated model
//! copies are gathered back to every replica of the stage.
//!
//! ZeRO stage 2 over replicas also partitions the gradients, as
//! [`Network::share_block_gradients`] does for a data-parallel rank: the stage's
//! blocks alike to its first write their gradients into that block's buffers (the
//! parameters outside blocks — embeddings, a tied copy, the final norm and head —
//! keep their own), so a device holds one block's gradients instead of all its
//! blocks'. Every slot's plan is compiled over those shared buffers and so writes each
//! micro-batch's gradients afresh; each backward ([`Plan::backward_with`]) hands over
//! each group of parameters ([`Network::ready_groups`]' cut: each block in two parts,
//! then the rest) as soon as its gradients are final, its copies queued in-stream
//! before the next block overwrites them, and a downloader thread per stage fetches
//! them. 1F1B runs a stage's backwards in micro-batch order (the forwards between
//! them never touch gradients), so the downloader adds each replica's micro-batches
//! on the host in order, `old + new` in f32 as the device accumulation it replaces,
//! and the coordinator folds the replicas as for stage 1; each rank's shard then takes
//! its slice. At one micro-batch per replica that is ZeRO-0's sum bit for bit. With
//! more it rounds differently wherever a device kernel accumulates into the gradient
//! other than as `old + new` (the CPU reference GEMM adds the old gradient before its
//! one rounding; its norm kernels add row by row), within 1e-5 in fp32; in fp16 ZeRO-0
//! adds the micro-batches in the f16 gradient buffers, stage 2 adds the f16 gradients
//! in f32. A stage with one block (or none alike) has nothing to share and
//! accumulates on the device as under stage 1. With one replica the one shard is the
//! whole state and nothing is partitioned, as in the data-parallel trainer.
//!
//! Activation checkpointing per stage would recompute a slot's forward before its
//! backward instead of keeping `p - s` slots; it is not here.
//!
//! [`exchange::fold`]: super::exchange::fold
//! [`exchange::inspect`]: super::exchange::inspect
//! [`Network`]: crate::models::Network
//! [`Network::share_block_gradients`]: crate::models::Network::share_block_gradients
//! [`Network::ready_groups`]: crate::models::Network::ready_groups

use std::sync::mpsc::{channel, Receiver, Sender};
use std::sync::Arc;

use std::time::Instant;

use super::exchange::{combine, fold, inspect};
use super::pipeline_partition::{partition, PartitionMethod, StageCosts};
use super::pipeline_schedule::{Instr, Schedule};
use super::zero::Shards;
use crate::device::optim::{grad_scale_reference, ParamBuffers};
use crate::graph::{Bindings, Loss, Op, Plan, StageGraph, Tensor};
use crate::models::{
    batch_input, check_ids, check_sharing, check_specs, draw_initial, hand_over_groups,
    host_memory_available, random_key, record, shared_gradients, MicroBatch, Model, NetworkMemory,
    NetworkOptions, ParamSpec, ParamState,
};
use crate::rng::SplitMix;
use crate::{Buffer, DType, Device, Error, HostData, PendingDownload, Result, IGNORE_TARGET};

/// How one step is taken: the caller's loss scaler and clipping decide these.
#[derive(Clone, Copy, Debug)]
pub struct StepOptions {
    /// The scale the loss is multiplied by before backward (1 in fp32).
    pub loss_scale: f32,
    /// Clip the unscaled gradients to this global L2 norm; 0: no clipping.
    pub clip: f32,
    /// The learning rate of this step.
    pub lr: f32,
}

/// What a step did.
#[derive(Clone, Debug, PartialEq)]
pub struct StepReport {
    /// Mean loss over the step's micro-batches (the last stage's).
    pub loss: f32,
    /// Some stage's gradients held an inf or NaN: no stage updated.
    pub overflow: bool,
    /// Squared L2 norm of the whole model's (scaled) gradients, each parameter once.
    pub sum_squares: f64,
    /// The factor the optimizer multiplied the gradients by (1 / (loss scale × clip
    /// factor)); 0 when the step was skipped.
    pub grad_scale: f32,
    /// Wall time of the step.
    pub seconds: f64,
    /// Per device (stage-major: stage `s` of replica `r` at `s * dp + r`): seconds it
    /// waited for a neighbour's activations or gradients (the measured bubble; the
    /// schedule's is `(p - 1) / (m + p - 1)` of the step).
    pub waited: Vec<f64>,
    /// Per device, as `waited`: the exposed transfer time, the part of its waits after
    /// the peer had posted the awaited message until it arrived (see the module doc).
    pub exposed: Vec<f64>,
    /// Bytes of activations and activation gradients sent between stages.
    pub bytes_moved: u64,
}

/// What one stage measured during a step.
#[derive(Clone, Copy, Debug, Default)]
struct StageStats {
    waited: f64,
    exposed: f64,
    sent: u64,
}

/// One activation slot: a compiled plan and the buffers bound to its inputs.
struct Slot {
    plan: Plan,
    /// Per [`StageGraph::inputs`] entry.
    inputs: Vec<Buffer>,
    /// Per [`StageGraph::activations_in`] entry.
    acts_in: Vec<Buffer>,
    /// Per [`StageGraph::activations_out`] entry with a gradient.
    seeds: Vec<Option<Buffer>>,
    /// Rows trained on in the micro-batch held (last stage: its loss weight).
    trained: usize,
}

/// One stage: its part of the graph, its parameters and its slots.
struct Stage {
    part: StageGraph,
    /// Per `part.params` entry.
    params: Vec<ParamBuffers>,
    slots: Vec<Slot>,
    /// Per `part.inputs` entry: its place in a [`MicroBatch`].
    input_pos: Vec<usize>,
    /// The `part.inputs` entry holding the loss's targets, if this stage has the loss.
    targets: Option<usize>,
    /// Rows of the loss (a regression loss weighs each 1 / rows).
    loss_rows: usize,
    /// ZeRO stage 2 over replicas, where the stage's alike blocks share one set of
    /// gradient buffers: the groups of `part.params` positions each backward hands
    /// over as their gradients are final (every micro-batch's, summed on the host).
    hand_over: Option<Vec<Vec<usize>>>,
}

impl Stage {
    /// The buffer in `slot` holding the outgoing activation `local`: the stage's own
    /// output, or — a tensor passed on to a later stage — the input it arrived in.
    fn outgoing(&self, slot: &Slot, local: Tensor) -> Buffer {
        slot.plan.buffer(local).unwrap_or_else(|| {
            let k = self
                .part
                .activations_in
                .iter()
                .position(|i| i.local == local)
                .expect("an outgoing tensor is made here or passed on");
            slot.acts_in[k]
        })
    }
}

/// A message between neighbouring stages: micro-batch, (shape, data) per tensor, and
/// when the sender posted it (queued its copies behind the producing launch).
type Transfer = (usize, Vec<(Vec<usize>, HostData)>, Instant);

/// What a stage reports at the end of its ticks.
struct Report {
    overflow: bool,
    sum_squares: f64,
    /// (parameter index in the model, gradient) of every parameter other stages hold
    /// too; with replicas (dp > 1), of every parameter the stage holds, and the
    /// overflow flag and norm are the coordinator's.
    grads: Vec<(usize, Vec<f32>)>,
    loss: Option<f64>,
}

/// The pipeline's decision, sent to every stage.
struct Decision {
    /// The gradient to write back of every parameter the stage reported.
    grads: Vec<(usize, Arc<Vec<f32>>)>,
    /// The gradient factor, or `None`: no update on this stage's thread (skipped, or
    /// ZeRO's shards update after the threads).
    grad_scale: Option<f32>,
}

/// The coordinator's decision: the gradient factor (`None`: skip), per model
/// parameter the gradient every copy takes (`None`: keep its own), and the report.
type Decided = (Option<f32>, Vec<Option<Arc<Vec<f32>>>>, StepReport);

/// A model trained over several devices as a pipeline.
pub struct Pipeline {
    model: Arc<dyn Model>,
    options: NetworkOptions,
    specs: Vec<ParamSpec>,
    /// Stage-major: stage `s` of replica `r` at `s * dp + r` (so are `stages`).
    devs: Vec<Box<dyn Device>>,
    stages: Vec<Stage>,
    /// Pipeline replicas (the data-parallel degree).
    dp: usize,
    /// Per stage, with ZeRO stage 1 or 2 over more than one replica: its dp group's
    /// shards of the stage's optimizer state (the stage's parameters in `part.params`
    /// order).
    shards: Vec<Option<Shards>>,
    /// Per model parameter: the stages that hold it, in order (the first is the one
    /// read for the weights).
    holders: Vec<Vec<usize>>,
    /// Per stage: the block range the partition gave it.
    blocks: Vec<std::ops::Range<usize>>,
    steps: u32,
}

impl Pipeline {
    /// Builds `model` over `devs`, one stage per device, cut by `method` between the
    /// model's blocks ([`Model::blocks`]). Weights start as a [`Network`] seeded
    /// `options.seed` would start them; every stage's slots are compiled for
    /// micro-batches of `options.batch` examples.
    ///
    /// [`Network`]: crate::models::Network
    pub fn new(
        devs: Vec<Box<dyn Device>>,
        model: Arc<dyn Model>,
        options: &NetworkOptions,
        method: &PartitionMethod,
    ) -> Result<Pipeline> {
        let p = devs.len();
        Pipeline::replicated(devs, model, options, method, p, 0)
    }

    /// `devs.len() / stages` replicas of `model` cut into `stages` stages (pp × dp):
    /// device `s * dp + r` runs stage `s` of replica `r`. Every replica starts from
    /// the same weights; with `zero_stage` 1 or 2 and more than one replica, each
    /// stage's optimizer state is sharded over the stage's replicas, and under 2 its
    /// alike blocks share one block's gradient buffers (see the module doc).
    pub fn replicated(
        devs: Vec<Box<dyn Device>>,
        model: Arc<dyn Model>,
        options: &NetworkOptions,
        method: &PartitionMethod,
        stages: usize,
        zero_stage: u32,
    ) -> Result<Pipeline> {
        let dp = replicas(devs.len(), stages)?;
        if zero_stage > 2 {
            return Err(Error::InvalidArgument(format!(
                "pipeline: zero_optimization.stage {zero_stage}: parameter partitioning \
                 (stage 3) is not implemented; a pipeline shards optimizer state (stage 1) \
                 or also gradients (stage 2) over its replicas"
            )));
        }
        let p = stages;
        let Cut {
            specs,
            inputs: forward_inputs,
            parts,
            holders,
            ranges,
            blocks,
        } = cut(model.as_ref(), options, method, p)?;
        // ZeRO stage 2 over replicas: a stage's blocks alike to its first share that
        // block's gradient buffers. On one replica the one shard is the whole state, as
        // in the data-parallel trainer: nothing is partitioned.
        let partitioned = zero_stage == 2 && dp > 1;
        // Before the first buffer: a stage that cannot fit its device is refused with
        // what it needs, not found out by an allocation that aborts.
        let mut memory = stage_memory(&specs, &parts, &blocks, &ranges, options)?;
        if partitioned {
            for m in &mut memory {
                m.gradients = m.shared_gradients;
            }
        }
        for (f, dev) in devs.iter().enumerate() {
            let s = f / dp;
            let what = if dp == 1 {
                format!("pipeline stage {s} of {}", model.describe())
            } else {
                format!(
                    "pipeline stage {s} (replica {}) of {}",
                    f % dp,
                    model.describe()
                )
            };
            memory[s].check_fit(&what, options.dtype, &[dev.caps()], host_memory_available())?;
        }
        // Every parameter drawn in model order, as one device would.
        let mut rng = SplitMix(options.seed);
        let inits: Vec<Vec<f32>> = specs
            .iter()
            .map(|spec| {
                let mut v = vec![0.0; spec.len()];
                draw_initial(spec, &mut rng, &mut v);
                v
            })
            .collect();
        let act = options.dtype;
        let sharded = zero_stage >= 1 && dp > 1;
        let mut built = vec![];
        let mut shards = vec![];
        for (s, part) in parts.into_iter().enumerate() {
            let local = local_blocks(&part, &blocks, &ranges[s]);
            let local_specs: Vec<ParamSpec> =
                part.params.iter().map(|&i| specs[i].clone()).collect();
            let sharing = if partitioned {
                shared_gradients(&local_specs, &local)
            } else {
                vec![None; part.params.len()]
            };
            let shares = sharing.iter().any(Option::is_some);
            let mut masters = vec![];
            for r in 0..dp {
                let dev = devs[s * dp + r].as_ref();
                let mut params = vec![];
                for &i in &part.params {
                    let grad = if specs[i].f32_grad { DType::F32 } else { act };
                    params.push(ParamBuffers::new(dev, &inits[i], act, grad)?);
                }
                // The sharing blocks' own gradient buffers go: they write the first
                // block's.
                for (k, shared) in sharing.iter().enumerate() {
                    if let Some(q) = *shared {
                        dev.free(params[k].grad)?;
                        params[k].grad = params[q].grad;
                    }
                }
                if sharded {
                    // The shards hold the optimizer state: the stage's own copies go
                    // before its plans are compiled without an update.
                    let empty = dev.alloc(DType::F32, 0)?;
                    let mut mine = vec![];
                    for b in &mut params {
                        mine.push(dev.download(b.master)?.to_f32());
                        for x in [b.master, b.m, b.v] {
                            dev.free(x)?;
                        }
                        (b.master, b.m, b.v) = (empty, empty, empty);
                    }
                    masters.push(mine);
                }
                let input_pos = part
                    .inputs
                    .iter()
                    .map(|(t, _)| {
                        forward_inputs
                            .iter()
                            .position(|i| i == t)
                            .expect("a stage's inputs are the model's")
                    })
                    .collect();
                let g = &part.graph;
                let targets = match g.loss() {
                    Some(Loss::CrossEntropy { targets }) => {
                        part.inputs.iter().position(|&(_, l)| l == targets)
                    }
                    _ => None,
                };
                let loss_rows = g.losses().map_or(0, |l| g.shape(l).iter().product());
                // At most p - s micro-batches are alive on stage s (see Schedule).
                let count = p - s;
                let mut slots = vec![];
                for k in 0..count {
                    let update = k == 0 && !sharded;
                    slots.push(compile_slot(dev, &part, &params, options, update)?);
                }
                // Shared buffers hold one block's gradients at a time: each block's
                // must be final before the next block's backward starts writing, and
                // each backward hands them over as they are.
                let hand_over = if shares {
                    let plan = &slots[0].plan;
                    let writes = |k: usize| plan.gradient_writes(k);
                    check_sharing(&local, &sharing, &writes, &model.describe())?;
                    let len = |k: usize| local_specs[k].len();
                    Some(hand_over_groups(
                        local.clone(),
                        part.params.len(),
                        &len,
                        &writes,
                    ))
                } else {
                    None
                };
                built.push(Stage {
                    part: part.clone(),
                    params,
                    slots,
                    input_pos,
                    targets,
                    loss_rows,
                    hand_over,
                });
            }
            shards.push(if sharded {
                let group: Vec<&dyn Device> = (0..dp).map(|r| devs[s * dp + r].as_ref()).collect();
                Some(Shards::from_masters(
                    &group,
                    &masters,
                    &vec![act; part.params.len()],
                    None,
                )?)
            } else {
                None
            });
        }
        Ok(Pipeline {
            model,
            options: options.clone(),
            specs,
            devs,
            stages: built,
            dp,
            shards,
            holders,
            blocks: ranges,
            steps: 0,
        })
    }

    /// What [`Pipeline::new`] allocates on each of `stages` devices, computed without
    /// a device: parameters (model copy, gradient, f32 master and moments) of every
    /// parameter the stage holds, and its activation slots' plans and input buffers.
    /// `shared_gradients` is a stage's gradient bytes under ZeRO stage 2 over
    /// replicas ([`Pipeline::replicated`]): its blocks alike to its first block share
    /// that block's buffers.
    pub fn memory(
        model: &dyn Model,
        options: &NetworkOptions,
        method: &PartitionMethod,
        stages: usize,
    ) -> Result<Vec<NetworkMemory>> {
        let c = cut(model, options, method, stages)?;
        stage_memory(&c.specs, &c.parts, &c.blocks, &c.ranges, options)
    }

    /// The blocks each of `stages` stages would run for `model` under `method` (what
    /// [`Pipeline::new`] cuts; `kiln estimate` shows it).
    pub fn stage_blocks_of(
        model: &dyn Model,
        method: &PartitionMethod,
        stages: usize,
    ) -> Result<Vec<std::ops::Range<usize>>> {
        let specs = model.parameters();
        partition(method, &stage_costs(&specs, &model.blocks()), stages)
    }

    /// The devices, stage-major: stage `s` of replica `r` at `s * replicas() + r`.
    pub fn devices(&self) -> &[Box<dyn Device>] {
        &self.devs
    }

    /// Number of stages.
    pub fn stages(&self) -> usize {
        self.stages.len() / self.dp
    }

    /// Number of pipeline replicas (the data-parallel degree).
    pub fn replicas(&self) -> usize {
        self.dp
    }

    /// Per stage: the model's blocks it runs.
    pub fn stage_blocks(&self) -> &[std::ops::Range<usize>] {
        &self.blocks
    }

    /// Per model parameter: the stages holding a copy of it, in order.
    pub fn holders(&self) -> &[Vec<usize>] {
        &self.holders
    }

    /// Activation slots (micro-batches held at once) per stage.
    pub fn slots(&self) -> Vec<usize> {
        self.stages
            .iter()
            .step_by(self.dp)
            .map(|s| s.slots.len())
            .collect()
    }

    /// Optimizer steps applied (skipped steps do not count).
    pub fn steps_applied(&self) -> u32 {
        self.steps
    }

    pub fn model(&self) -> &Arc<dyn Model> {
        &self.model
    }

    /// One training step over `micro` (the step's micro-batches, in order; with `dp`
    /// replicas, `dp · m` of them, replica `r` taking `micro[r·m..(r+1)·m]`): the 1F1B
    /// schedule on every replica, the replicated parameters' gradients summed (and,
    /// with replicas, averaged over them), one overflow check, norm and gradient
    /// factor for all stages, then every stage's optimizer (skipped everywhere on
    /// overflow). Each micro-batch's mean loss weighs 1 / m, and each replica 1 / dp.
    pub fn step(&mut self, micro: &[MicroBatch], o: StepOptions) -> Result<StepReport> {
        let (dp, p) = (self.dp, self.stages());
        if !micro.len().is_multiple_of(dp) {
            return Err(Error::InvalidArgument(format!(
                "pipeline: {} micro-batches do not split evenly over {dp} replicas; a step \
                 takes replicas × gradient_accumulation_steps micro-batches",
                micro.len()
            )));
        }
        let m = micro.len() / dp;
        if !(o.loss_scale.is_finite() && o.loss_scale > 0.0) {
            return Err(Error::InvalidArgument(format!(
                "pipeline: loss scale {}; it must be finite and positive",
                o.loss_scale
            )));
        }
        if !(o.clip.is_finite() && o.clip >= 0.0) {
            return Err(Error::InvalidArgument(format!(
                "pipeline: gradient clipping at {}; give a finite norm, or 0 for none",
                o.clip
            )));
        }
        let tied = self.holders.iter().any(|h| h.len() > 1);
        let schedule = Schedule::one_forward_one_backward(p, m, tied)?;
        let name = |f: usize| stage_name(f / dp, f % dp, dp);
        // Every micro-batch's inputs are checked before anything runs.
        let mut data = vec![];
        for (f, stage) in self.stages.iter_mut().enumerate() {
            let r = f % dp;
            let mut per = vec![];
            for (i, b) in micro[r * m..(r + 1) * m].iter().enumerate() {
                per.push(stage_data(stage, b).map_err(|e| {
                    Error::InvalidArgument(format!("pipeline {}, micro-batch {i}: {e}", name(f)))
                })?);
            }
            data.push(per);
            for slot in &mut stage.slots {
                slot.plan.start_step(o.loss_scale);
            }
        }
        // Channels within each replica: activations s -> s + 1, gradients s + 1 -> s,
        // reports to the coordinator (this thread) and its decision back. Indexed as
        // the devices.
        let n = p * dp;
        let mut act_tx: Vec<Option<Sender<Transfer>>> = (0..n).map(|_| None).collect();
        let mut act_rx: Vec<Option<Receiver<Transfer>>> = (0..n).map(|_| None).collect();
        let mut grad_tx: Vec<Option<Sender<Transfer>>> = (0..n).map(|_| None).collect();
        let mut grad_rx: Vec<Option<Receiver<Transfer>>> = (0..n).map(|_| None).collect();
        for s in 1..p {
            for r in 0..dp {
                let (before, after) = ((s - 1) * dp + r, s * dp + r);
                let (tx, rx) = channel();
                act_tx[before] = Some(tx);
                act_rx[after] = Some(rx);
                let (tx, rx) = channel();
                grad_tx[after] = Some(tx);
                grad_rx[before] = Some(rx);
            }
        }
        let (seed, steps) = (self.options.seed, self.steps);
        let holders = &self.holders;
        let stage_params: Vec<Vec<usize>> = self
            .stages
            .iter()
            .step_by(dp)
            .map(|st| st.part.params.clone())
            .collect();
        let sharded = self.shards.iter().any(Option::is_some);
        let started = Instant::now();
        let (results, decided) = std::thread::scope(|scope| {
            let mut handles = vec![];
            let mut report_rx = vec![];
            let mut decision_tx = vec![];
            for (f, ((stage, dev), data)) in self
                .stages
                .iter_mut()
                .zip(&self.devs)
                .zip(&data)
                .enumerate()
            {
                let (rtx, rrx) = channel::<Report>();
                let (dtx, drx) = channel::<Decision>();
                report_rx.push(rrx);
                decision_tx.push(dtx);
                let links = Links {
                    act_in: act_rx[f].take(),
                    act_out: act_tx[f].take(),
                    grad_in: grad_rx[f].take(),
                    grad_out: grad_tx[f].take(),
                    report: rtx,
                    decision: drx,
                };
                let (s, r) = (f / dp, f % dp);
                let run = Run {
                    s,
                    r,
                    dp,
                    m,
                    data,
                    o,
                    seed,
                    steps,
                    holders,
                };
                let (ticks, end) = (&schedule.ticks[s], &schedule.end[s]);
                let dev = dev.as_ref();
                handles.push(scope.spawn(move || run.stage(stage, dev, ticks, end, links)));
            }
            let decided = decide(&report_rx, holders, &stage_params, dp, o);
            if let Ok((grad_scale, grads, _)) = &decided {
                for (f, tx) in decision_tx.iter().enumerate() {
                    // ZeRO's shards take the gradients after the threads, not the
                    // stages' own buffers.
                    let grads = match sharded {
                        true => vec![],
                        false => stage_params[f / dp]
                            .iter()
                            .filter_map(|&i| grads[i].clone().map(|g| (i, g)))
                            .collect(),
                    };
                    // A stage that stopped meanwhile has its own error to report.
                    let _ = tx.send(Decision {
                        grads,
                        grad_scale: if sharded { None } else { *grad_scale },
                    });
                }
            }
            // Without a decision every stage waiting for one stops.
            drop(decision_tx);
            let results: Vec<Result<StageStats>> = handles
                .into_iter()
                .enumerate()
                .map(|(f, h)| {
                    h.join().unwrap_or_else(|_| {
                        Err(Error::InvalidArgument(format!(
                            "pipeline {} panicked",
                            name(f)
                        )))
                    })
                })
                .collect();
            (results, decided)
        });
        let failed: Vec<String> = results
            .iter()
            .enumerate()
            .filter_map(|(f, r)| r.as_ref().err().map(|e| format!("{}: {e}", name(f))))
            .collect();
        if !failed.is_empty() {
            // The stages that failed first, then those that stopped because of them.
            let (mut first, stopped): (Vec<String>, Vec<String>) = failed
                .iter()
                .cloned()
                .partition(|e| !e.contains(": stopped: "));
            let count = failed.len();
            first.extend(stopped);
            // Before the decision no stage updates; after it, some may have.
            let state = if decided.is_ok() && !sharded {
                "after the update was decided, so some stages may have updated and others \
                 not: resume from the last checkpoint"
            } else {
                "so no stage updated"
            };
            let of = if dp == 1 {
                format!("{p} stages")
            } else {
                format!("{n} stages ({p} stages × {dp} replicas)")
            };
            return Err(Error::InvalidArgument(format!(
                "pipeline step failed on {count} of {of}, {state}: {}",
                first.join("; ")
            )));
        }
        let (grad_scale, grads, mut report) = decided?;
        if let (Some(grad_scale), true) = (grad_scale, sharded) {
            self.apply_shards(&grads, o.lr, grad_scale)?;
        }
        let stats: Vec<StageStats> = results.into_iter().flatten().collect();
        report.seconds = started.elapsed().as_secs_f64();
        report.waited = stats.iter().map(|s| s.waited).collect();
        report.exposed = stats.iter().map(|s| s.exposed).collect();
        report.bytes_moved = stats.iter().map(|s| s.sent).sum();
        if !report.overflow {
            self.steps += 1;
        }
        Ok(report)
    }

    /// ZeRO's update: each stage's dp group updates its shards from the averaged
    /// gradients `grads` (per model parameter) and every replica of the stage takes
    /// the gathered model copies.
    fn apply_shards(
        &mut self,
        grads: &[Option<Arc<Vec<f32>>>],
        lr: f32,
        grad_scale: f32,
    ) -> Result<()> {
        let dp = self.dp;
        let optimizer = &self.options.optimizer;
        for (s, shards) in self.shards.iter().enumerate() {
            let Some(shards) = shards else { continue };
            let group: Vec<&dyn Device> = (0..dp).map(|r| self.devs[s * dp + r].as_ref()).collect();
            let params = &self.stages[s * dp].part.params;
            let mut sum = vec![];
            let mut layout = vec![];
            for &i in params {
                let g = grads[i]
                    .as_ref()
                    .expect("with replicas every gradient is reduced");
                sum.push(g.as_ref().clone());
                layout.push((self.specs[i].len(), self.options.dtype, self.specs[i].decay));
            }
            let step = u64::from(self.steps) + 1;
            let (wholes, _) =
                shards.update(&group, optimizer, &layout, (&sum, lr, grad_scale, step))?;
            for (r, dev) in group.iter().enumerate() {
                let stage = &self.stages[s * dp + r];
                for (b, whole) in stage.params.iter().zip(&wholes) {
                    dev.upload(b.value, whole)?;
                }
                dev.wait()?;
            }
        }
        Ok(())
    }

    /// Every parameter's full training state, whole tensors in model order, from the
    /// first stage holding each: what a checkpoint saves, whatever the topology.
    pub fn param_states(&self) -> Result<Vec<ParamState>> {
        // Under ZeRO a stage's masters and moments are gathered from its dp group.
        let mut gathered: Vec<Option<Vec<ParamState>>> = vec![];
        for (s, shards) in self.shards.iter().enumerate() {
            gathered.push(match shards {
                Some(shards) => {
                    let mut local = self.stage_states(s, |_| HostData::F32(vec![]));
                    shards.gather(&self.group(s), &mut local)?;
                    Some(local)
                }
                None => None,
            });
        }
        let mut out = vec![];
        for (i, spec) in self.specs.iter().enumerate() {
            let (f, b) = self.buffers(i, 0)?;
            let dev = self.devs[f].as_ref();
            let value = dev.download(b.value)?;
            let s = f / self.dp;
            let state = match &gathered[s] {
                Some(local) => {
                    let k = self.stages[f].part.params.iter().position(|&p| p == i);
                    let st = &local[k.expect("holders list the stages declaring it")];
                    ParamState {
                        value,
                        ..st.clone()
                    }
                }
                None => ParamState {
                    name: spec.name.clone(),
                    shape: spec.shape.clone(),
                    value,
                    master: dev.download(b.master)?.to_f32(),
                    m: dev.download(b.m)?.to_f32(),
                    v: dev.download(b.v)?.to_f32(),
                },
            };
            out.push(state);
        }
        Ok(out)
    }

    /// Stage `s`'s parameters as host states (name and shape; `value` from `value`,
    /// the rest empty), in its `part.params` order: what its shards fill or read.
    fn stage_states(&self, s: usize, value: impl Fn(usize) -> HostData) -> Vec<ParamState> {
        self.stages[s * self.dp]
            .part
            .params
            .iter()
            .map(|&i| ParamState {
                name: self.specs[i].name.clone(),
                shape: self.specs[i].shape.clone(),
                value: value(i),
                master: vec![],
                m: vec![],
                v: vec![],
            })
            .collect()
    }

    /// Stage `s`'s devices, replica order.
    fn group(&self, s: usize) -> Vec<&dyn Device> {
        (0..self.dp)
            .map(|r| self.devs[s * self.dp + r].as_ref())
            .collect()
    }

    /// Restores what [`Pipeline::param_states`] or [`Network::param_states`] saved
    /// (whole tensors: a checkpoint of any topology) into every copy of every
    /// parameter, and the count of applied steps (Adam's bias correction and the
    /// schedule continue from it). Checked in full before the first byte is written:
    /// every parameter present under its name (or its tied name) with its shape, the
    /// storage dtype and every vector's length.
    ///
    /// [`Network::param_states`]: crate::models::Network::param_states
    pub fn load_param_states(&mut self, states: &[ParamState], steps: u32) -> Result<()> {
        let what = self.model.describe();
        if states.len() != self.specs.len() {
            return Err(Error::InvalidArgument(format!(
                "the checkpoint holds {} parameters but {what} has {}: it was saved from a \
                 different model config",
                states.len(),
                self.specs.len()
            )));
        }
        let mut found = vec![];
        for spec in &self.specs {
            let s = states
                .iter()
                .find(|s| s.name == spec.name || spec.tied.as_ref() == Some(&s.name))
                .ok_or_else(|| {
                    Error::InvalidArgument(format!(
                        "the checkpoint has no parameter `{}`: it was saved from a different \
                         model config than {what}",
                        spec.name
                    ))
                })?;
            let n = spec.len();
            if s.shape != spec.shape {
                return Err(Error::InvalidArgument(format!(
                    "`{}` has shape {:?} in the checkpoint but {:?} in {what}: the model \
                     config differs from the one the checkpoint was saved with",
                    spec.name, s.shape, spec.shape
                )));
            }
            if s.value.dtype() != self.options.dtype {
                return Err(Error::InvalidArgument(format!(
                    "`{}` is stored as {} in the checkpoint but this run trains in {}: resume \
                     with the precision the checkpoint was saved with",
                    spec.name,
                    s.value.dtype(),
                    self.options.dtype
                )));
            }
            for (part, len) in [
                ("value", s.value.len()),
                ("master", s.master.len()),
                ("exp_avg", s.m.len()),
                ("exp_avg_sq", s.v.len()),
            ] {
                if len != n {
                    return Err(Error::LenMismatch {
                        what: format!("checkpoint {part} of `{}`", spec.name),
                        expected: n,
                        found: len,
                    });
                }
            }
            found.push(s);
        }
        for (i, s) in found.iter().enumerate() {
            for k in 0..self.holders[i].len() * self.dp {
                let (f, b) = self.buffers(i, k)?;
                let dev = self.devs[f].as_ref();
                dev.upload(b.value, &s.value)?;
                if self.shards[f / self.dp].is_some() {
                    continue;
                }
                dev.upload(b.master, &HostData::F32(s.master.clone()))?;
                dev.upload(b.m, &HostData::F32(s.m.clone()))?;
                dev.upload(b.v, &HostData::F32(s.v.clone()))?;
            }
        }
        for (s, shards) in self.shards.iter().enumerate() {
            if let Some(shards) = shards {
                let local: Vec<ParamState> = self.stages[s * self.dp]
                    .part
                    .params
                    .iter()
                    .map(|&i| found[i].clone())
                    .collect();
                shards.scatter(&self.group(s), &local)?;
            }
        }
        self.steps = steps;
        Ok(())
    }

    /// (name, f32 master values) of every parameter, in model order.
    pub fn parameters(&self) -> Result<Vec<(String, Vec<f32>)>> {
        Ok(self
            .param_states()?
            .into_iter()
            .map(|s| (s.name, s.master))
            .collect())
    }

    /// Parameter `index`'s model copy and f32 master on every device holding it (the
    /// device's index, stage-major: every replica of every stage holding it), in
    /// device order; all copies must be equal. Under ZeRO the masters are the
    /// shards' and come back empty here.
    pub fn copies(&self, index: usize) -> Result<Vec<(usize, HostData, Vec<f32>)>> {
        let n = self.holders.get(index).map_or(0, |h| h.len()) * self.dp;
        (0..n)
            .map(|k| {
                let (s, b) = self.buffers(index, k)?;
                let dev = self.devs[s].as_ref();
                Ok((s, dev.download(b.value)?, dev.download(b.master)?.to_f32()))
            })
            .collect()
    }

    /// The buffers of parameter `index`'s `k`-th copy (its holders' replicas, stage
    /// by stage), and the device holding it.
    fn buffers(&self, index: usize, k: usize) -> Result<(usize, ParamBuffers)> {
        let s = *self
            .holders
            .get(index)
            .and_then(|h| h.get(k / self.dp))
            .ok_or_else(|| {
                Error::InvalidArgument(format!(
                    "pipeline: parameter {index} (copy {k}) does not exist; the model has {}",
                    self.specs.len()
                ))
            })?;
        let f = s * self.dp + k % self.dp;
        let stage = &self.stages[f];
        let at = stage
            .part
            .params
            .iter()
            .position(|&p| p == index)
            .expect("holders list the stages declaring it");
        Ok((f, stage.params[at]))
    }
}

/// A model cut into stages, before any device is touched.
struct Cut {
    specs: Vec<ParamSpec>,
    /// The model's inputs, in [`MicroBatch`] order.
    inputs: Vec<Tensor>,
    parts: Vec<StageGraph>,
    /// Per parameter: the stages holding it.
    holders: Vec<Vec<usize>>,
    /// Per stage: its blocks.
    ranges: Vec<std::ops::Range<usize>>,
    /// The model's blocks (parameter indices per block).
    blocks: Vec<Vec<usize>>,
}

/// Checks `model`, records its forward pass and cuts it into `p` stages by `method`.
fn cut(
    model: &dyn Model,
    options: &NetworkOptions,
    method: &PartitionMethod,
    p: usize,
) -> Result<Cut> {
    if p == 0 {
        return Err(Error::InvalidArgument(
            "pipeline: no devices; give one device per stage".into(),
        ));
    }
    model.check_sizes()?;
    let specs = model.parameters();
    check_specs(model, &specs)?;
    let blocks = model.blocks();
    if blocks.is_empty() {
        return Err(Error::InvalidArgument(format!(
            "pipeline: {} names no blocks (Model::blocks), so there is nothing to cut into \
             stages; train it data-parallel instead",
            model.describe()
        )));
    }
    let costs = stage_costs(&specs, &blocks);
    let ranges = partition(method, &costs, p)?;
    let mut param_stage = vec![None; specs.len()];
    for (s, r) in ranges.iter().enumerate() {
        for b in r.clone() {
            for &i in &blocks[b] {
                param_stage[i] = Some(s);
            }
        }
    }
    let recorded = record(model, &specs, options)?;
    let parts = recorded.graph.split(&param_stage, p)?;
    let mut holders = vec![vec![]; specs.len()];
    for (s, part) in parts.iter().enumerate() {
        for &i in &part.params {
            holders[i].push(s);
        }
    }
    Ok(Cut {
        specs,
        inputs: recorded.forward.inputs,
        parts,
        holders,
        ranges,
        blocks,
    })
}

/// The blocks `range` of `blocks` as positions in `part.params` (the stage plan's
/// parameter indices).
fn local_blocks(
    part: &StageGraph,
    blocks: &[Vec<usize>],
    range: &std::ops::Range<usize>,
) -> Vec<Vec<usize>> {
    blocks[range.clone()]
        .iter()
        .map(|b| {
            b.iter()
                .map(|i| {
                    part.params
                        .iter()
                        .position(|p| p == i)
                        .expect("a stage holds its blocks' parameters")
                })
                .collect()
        })
        .collect()
}

/// Per stage, the bytes [`Pipeline::new`] allocates: each held parameter's five
/// buffers, and per activation slot its plan (as compiling would share its buffers,
/// over stand-ins) and its input buffers; and the gradients' bytes where the stage's
/// alike blocks share one set (ZeRO stage 2 over replicas).
fn stage_memory(
    specs: &[ParamSpec],
    parts: &[StageGraph],
    blocks: &[Vec<usize>],
    ranges: &[std::ops::Range<usize>],
    options: &NetworkOptions,
) -> Result<Vec<NetworkMemory>> {
    let act = options.dtype;
    let p = parts.len();
    let f = |n: usize| DType::F32.padded_bytes(n);
    // The initial values are drawn on the host for every parameter at once.
    let drawn: u64 = specs.iter().map(|s| f(s.len())).sum();
    let mut out = vec![];
    for (s, part) in parts.iter().enumerate() {
        let mut m = NetworkMemory::default();
        let mut ids = 0;
        let mut stand_in = |dtype: DType, len: usize| {
            ids += 1;
            Buffer {
                id: ids,
                dtype,
                len,
            }
        };
        let local_specs: Vec<ParamSpec> = part.params.iter().map(|&i| specs[i].clone()).collect();
        let sharing = shared_gradients(&local_specs, &local_blocks(part, blocks, &ranges[s]));
        let mut params = vec![];
        for (&i, shared) in part.params.iter().zip(&sharing) {
            let n = specs[i].len();
            let grad = if specs[i].f32_grad { DType::F32 } else { act };
            m.weights += act.padded_bytes(n);
            m.gradients += grad.padded_bytes(n);
            if shared.is_none() {
                m.shared_gradients += grad.padded_bytes(n);
            }
            m.gradient_tensors += (grad.size() * n) as u64;
            m.optimizer += 3 * f(n);
            m.largest_parameter_buffer = m.largest_parameter_buffer.max(f(n));
            params.push(ParamBuffers {
                value: stand_in(act, n),
                master: stand_in(DType::F32, n),
                grad: stand_in(grad, n),
                m: stand_in(DType::F32, n),
                v: stand_in(DType::F32, n),
            });
        }
        let g = &part.graph;
        let mut inputs = vec![];
        let mut input_bytes = 0;
        for t in g.inputs() {
            let (_, shape, dtype) = g.describe(t);
            let n: usize = shape.iter().product();
            input_bytes += dtype.padded_bytes(n);
            inputs.push((t, stand_in(dtype, n)));
        }
        let bindings = Bindings {
            params,
            inputs,
            groups: vec![],
        };
        let (mut largest, mut bound) = (0, 0);
        for k in 0..p - s {
            let plan = g.memory(&bindings, (k == 0).then_some(&options.optimizer))?;
            m.activations += plan.total() + input_bytes;
            largest = plan.largest.max(largest);
            bound = plan.largest_bound.max(bound);
        }
        m.largest_buffer = largest.max(m.largest_parameter_buffer);
        m.largest_binding = bound;
        m.host = drawn.max(m.weights + m.optimizer);
        out.push(m);
    }
    Ok(out)
}

/// Parameters per block and outside them: those declared before the first block's
/// count for the first stage, the rest (and tied ones, read at both ends) the last.
fn stage_costs(specs: &[ParamSpec], blocks: &[Vec<usize>]) -> StageCosts {
    let in_block: std::collections::HashSet<usize> = blocks.iter().flatten().copied().collect();
    let first = blocks.iter().flatten().copied().min().unwrap_or(0);
    let (mut embedding_params, mut head_params) = (0u64, 0u64);
    for (i, s) in specs.iter().enumerate() {
        if in_block.contains(&i) {
            continue;
        }
        if i < first {
            embedding_params += s.len() as u64;
        }
        if i > first || s.tied.is_some() {
            head_params += s.len() as u64;
        }
    }
    StageCosts {
        block_params: blocks
            .iter()
            .map(|b| b.iter().map(|&i| specs[i].len() as u64).sum())
            .collect(),
        embedding_params,
        head_params,
    }
}

/// Compiles one activation slot of `part`: its own input buffers and intermediates,
/// the stage's parameters; the update only in the first slot.
fn compile_slot(
    dev: &dyn Device,
    part: &StageGraph,
    params: &[ParamBuffers],
    options: &NetworkOptions,
    update: bool,
) -> Result<Slot> {
    let g = &part.graph;
    let alloc = |t: Tensor| -> Result<Buffer> {
        let (_, shape, dtype) = g.describe(t);
        dev.alloc(dtype, shape.iter().product())
    };
    let mut bound = vec![];
    let mut inputs = vec![];
    for &(_, l) in &part.inputs {
        let b = alloc(l)?;
        inputs.push(b);
        bound.push((l, b));
    }
    let mut acts_in = vec![];
    for a in &part.activations_in {
        let b = alloc(a.local)?;
        acts_in.push(b);
        bound.push((a.local, b));
    }
    let mut seeds = vec![];
    for a in &part.activations_out {
        seeds.push(match a.grad {
            Some(t) => {
                let b = alloc(t)?;
                bound.push((t, b));
                Some(b)
            }
            None => None,
        });
    }
    let bindings = Bindings {
        params: params.to_vec(),
        inputs: bound,
        groups: vec![],
    };
    let plan = g.compile(dev, &bindings, update.then_some(&options.optimizer))?;
    Ok(Slot {
        plan,
        inputs,
        acts_in,
        seeds,
        trained: 0,
    })
}

/// A micro-batch's data for `stage`'s inputs, checked (count, lengths, dtypes, ids in
/// range) and converted to the inputs' dtypes; and the rows trained on.
fn stage_data(stage: &Stage, batch: &MicroBatch) -> Result<(Vec<HostData>, usize)> {
    let g = &stage.part.graph;
    let mut data = vec![];
    for (&(_, l), &pos) in stage.part.inputs.iter().zip(&stage.input_pos) {
        let given = batch.0.get(pos).ok_or_else(|| {
            Error::InvalidArgument(format!(
                "a micro-batch holds {} inputs, but `{}` is input {}",
                batch.0.len(),
                g.describe(l).0,
                pos + 1
            ))
        })?;
        data.push(batch_input(g, l, given)?);
    }
    let inputs: Vec<Tensor> = stage.part.inputs.iter().map(|&(_, l)| l).collect();
    check_ids(g, &inputs, &data)?;
    let trained = match stage.targets.map(|k| &data[k]) {
        Some(HostData::U32(t)) => t.iter().filter(|&&x| x != IGNORE_TARGET).count(),
        _ => stage.loss_rows,
    };
    Ok((data, trained))
}

/// A stage's channels for one step.
struct Links {
    act_in: Option<Receiver<Transfer>>,
    act_out: Option<Sender<Transfer>>,
    grad_in: Option<Receiver<Transfer>>,
    grad_out: Option<Sender<Transfer>>,
    report: Sender<Report>,
    decision: Receiver<Decision>,
}

/// What every stage thread of a step shares.
#[derive(Clone, Copy)]
struct Run<'a> {
    s: usize,
    /// The replica, and how many there are.
    r: usize,
    dp: usize,
    /// Micro-batches in the step.
    m: usize,
    /// Per micro-batch: this stage's inputs and the rows trained on.
    data: &'a [(Vec<HostData>, usize)],
    o: StepOptions,
    seed: u64,
    steps: u32,
    holders: &'a [Vec<usize>],
}

/// How many pipeline replicas `devices` devices make in `stages` stages (devices
/// come stage-major), or why they make none.
pub fn replicas(devices: usize, stages: usize) -> Result<usize> {
    if stages == 0 || devices == 0 {
        return Err(Error::InvalidArgument(format!(
            "pipeline: {devices} devices in {stages} stages; give at least one stage and one \
             device per stage"
        )));
    }
    if !devices.is_multiple_of(stages) {
        return Err(Error::InvalidArgument(format!(
            "pipeline: {devices} devices do not split into {stages} stages; give stages × \
             replicas devices (device s·dp + r runs stage s of replica r), e.g. {} or {} \
             devices for {stages} stages",
            stages * (devices / stages).max(1),
            stages * (devices / stages + 1)
        )));
    }
    Ok(devices / stages)
}

/// How errors name stage `s` of replica `r` (of `dp`).
fn stage_name(s: usize, r: usize, dp: usize) -> String {
    if dp == 1 {
        format!("stage {s}")
    } else {
        format!("stage {s} of replica {r}")
    }
}

/// The error of a stage whose neighbour (or the coordinator) stopped.
fn peer_stopped(me: &str, peer: &str) -> Error {
    Error::InvalidArgument(format!(
        "stopped: {peer} stopped during the step (its own error says why), so {me} cannot \
         go on"
    ))
}

/// Checks a received message against what `s` expects: the micro-batch and each
/// tensor's shape.
fn check_transfer(
    s: usize,
    what: &str,
    (micro, tensors, _): &Transfer,
    want_micro: usize,
    want: &[(String, Vec<usize>)],
) -> Result<()> {
    let shapes: Vec<&Vec<usize>> = tensors.iter().map(|(shape, _)| shape).collect();
    let wanted: Vec<&Vec<usize>> = want.iter().map(|(_, shape)| shape).collect();
    if *micro != want_micro || shapes != wanted {
        let names: Vec<&str> = want.iter().map(|(n, _)| n.as_str()).collect();
        return Err(Error::InvalidArgument(format!(
            "stage {s} received {what} of micro-batch {micro} shaped {shapes:?}, but expected \
             micro-batch {want_micro}'s {names:?} shaped {wanted:?}: the stages were built for \
             different micro-batch shapes"
        )));
    }
    for ((shape, data), (name, _)) in tensors.iter().zip(want) {
        let len: usize = shape.iter().product();
        if data.len() != len {
            return Err(Error::InvalidArgument(format!(
                "stage {s} received `{name}` shaped {shape:?} holding {} values",
                data.len()
            )));
        }
    }
    Ok(())
}

/// Downloads queued on a stage's device for one neighbour: towards the next stage
/// (activations) or the one before (their gradients), of a micro-batch.
type Parcel = (bool, usize, Vec<(Vec<usize>, PendingDownload)>, Instant);

/// Gradient copies a stage queued during one backward (ZeRO stage 2's hand-over):
/// (`part.params` position, download) per parameter of a ready group.
type Staged = Vec<(usize, PendingDownload)>;

/// Per `part.params` entry: the host sum of its handed-over gradients, and how many
/// micro-batches it holds.
type Handed = Vec<(Vec<f32>, usize)>;

/// A ZeRO-2 stage's line to its downloader: the staged copies out, the sums back.
type Handing = (Sender<Staged>, Receiver<Result<Handed>>);

/// A ZeRO-2 stage's gradient downloader: waits for each staged copy in the order the
/// backwards queued them (micro-batches in order) and adds it to the parameter's sum
/// on the host, `old + new` in f32, as the stage's own buffers would have accumulated
/// it; the sums go to `done` once the stage stops handing over.
fn downloader(dev: &dyn Device, staged: Receiver<Staged>, n: usize, done: Sender<Result<Handed>>) {
    let mut sums: Handed = vec![(vec![], 0); n];
    let mut failed = None;
    for group in staged {
        for (k, pending) in group {
            // After a failure every staged copy is still finished, so none stays held.
            let got = dev.finish_download(pending);
            if failed.is_some() {
                continue;
            }
            match got {
                Ok(g) => {
                    let (sum, count) = &mut sums[k];
                    if *count == 0 {
                        *sum = g.to_f32();
                    } else {
                        sum.iter_mut().zip(g.to_f32()).for_each(|(a, b)| *a += b);
                    }
                    *count += 1;
                }
                Err(e) => failed = Some(e),
            }
        }
    }
    // The stage may have stopped meanwhile: it has its own error then.
    let _ = done.send(match failed {
        Some(e) => Err(e),
        None => Ok(sums),
    });
}

/// A stage's courier: waits for each queued download and sends it on, while the stage
/// thread records its next work (the transfer overlaps the next compute).
fn courier(
    (s, r, dp): (usize, usize, usize),
    dev: &dyn Device,
    parcels: Receiver<Parcel>,
    act_out: Option<Sender<Transfer>>,
    grad_out: Option<Sender<Transfer>>,
) -> Result<()> {
    for (forward, micro, pending, posted) in parcels {
        let tensors = pending
            .into_iter()
            .map(|(shape, p)| Ok((shape, dev.finish_download(p)?)))
            .collect::<Result<Vec<_>>>()?;
        let (tx, peer) = if forward {
            (act_out.as_ref(), s + 1)
        } else {
            (grad_out.as_ref(), s.wrapping_sub(1))
        };
        tx.expect("a stage sends only to the neighbours it has")
            .send((micro, tensors, posted))
            .map_err(|_| peer_stopped(&stage_name(s, r, dp), &stage_name(peer, r, dp)))?;
    }
    Ok(())
}

impl Run<'_> {
    /// Runs stage `s`: its instructions and its part of the step's end on this thread,
    /// the outgoing transfers on a courier thread.
    fn stage(
        self,
        stage: &mut Stage,
        dev: &dyn Device,
        ticks: &[Vec<Instr>],
        end: &[Instr],
        mut links: Links,
    ) -> Result<StageStats> {
        let (act_out, grad_out) = (links.act_out.take(), links.grad_out.take());
        let (parcels, inbox) = channel::<Parcel>();
        std::thread::scope(|scope| {
            let (s, r, dp) = (self.s, self.r, self.dp);
            let sent = scope.spawn(move || courier((s, r, dp), dev, inbox, act_out, grad_out));
            let handing = stage.hand_over.is_some().then(|| {
                let (to_downloader, staged) = channel::<Staged>();
                let (done, sums) = channel::<Result<Handed>>();
                let n = stage.params.len();
                scope.spawn(move || downloader(dev, staged, n, done));
                (to_downloader, sums)
            });
            // Ends the courier's (and downloader's) loop when this returns, whichever way.
            let ran = self.run(stage, dev, (ticks, end), &links, (parcels, handing));
            let sent = sent.join().unwrap_or_else(|_| {
                Err(Error::InvalidArgument(format!(
                    "{}'s transfer thread panicked",
                    stage_name(s, r, dp)
                )))
            });
            match (ran, sent) {
                // A courier that failed is why the stage stopped: its error says why.
                (Err(e), Err(c)) if e.to_string().contains("stopped: ") => Err(c),
                (Err(e), _) => Err(e),
                (Ok(stats), sent) => sent.map(|()| stats),
            }
        })
    }

    fn run(
        self,
        stage: &mut Stage,
        dev: &dyn Device,
        (ticks, end): (&[Vec<Instr>], &[Instr]),
        links: &Links,
        (parcels, mut handing): (Sender<Parcel>, Option<Handing>),
    ) -> Result<StageStats> {
        let s = self.s;
        let me = stage_name(s, self.r, self.dp);
        let peer_name = |peer: usize| stage_name(peer, self.r, self.dp);
        let sent = std::cell::Cell::new(0u64);
        let (mut waited, mut exposed) = (0f64, 0f64);
        // Waits for a neighbour's message: all of the wait counts as waiting, the part
        // after the peer posted the message as exposed transfer.
        let mut receive = |rx: &Receiver<Transfer>, peer: usize| -> Result<Transfer> {
            let wait = Instant::now();
            let msg = rx.recv().map_err(|_| peer_stopped(&me, &peer_name(peer)))?;
            let got = Instant::now();
            waited += (got - wait).as_secs_f64();
            exposed += got.saturating_duration_since(wait.max(msg.2)).as_secs_f64();
            Ok(msg)
        };
        let post = |forward: bool, micro: usize, bufs: Vec<(Vec<usize>, Buffer)>| {
            let mut pending = vec![];
            for (shape, b) in bufs {
                sent.set(sent.get() + (b.len * b.dtype.size()) as u64);
                pending.push((shape, dev.begin_download(b)?));
            }
            parcels
                .send((forward, micro, pending, Instant::now()))
                .map_err(|_| peer_stopped(&me, &format!("{me}'s transfer thread")))
        };
        let slots = stage.slots.len().min(self.m);
        let g = &stage.part.graph;
        let described = |t: Tensor| (g.describe(t).0.to_string(), g.shape(t).to_vec());
        let ins: Vec<(String, Vec<usize>)> = stage
            .part
            .activations_in
            .iter()
            .map(|a| described(a.local))
            .collect();
        let grads_in: Vec<(String, Vec<usize>)> = stage
            .part
            .activations_out
            .iter()
            .filter_map(|a| a.grad.map(described))
            .collect();
        let has_loss = g.losses().is_some();
        for instr in ticks.iter().flatten() {
            match *instr {
                Instr::Load { micro } => {
                    let (data, trained) = &self.data[micro];
                    let slot = &mut stage.slots[micro % slots];
                    for (&b, d) in slot.inputs.iter().zip(data) {
                        dev.upload(b, d)?;
                    }
                    slot.trained = *trained;
                }
                Instr::RecvActivation { micro } => {
                    let rx = links.act_in.as_ref().expect("a later stage receives");
                    let msg = receive(rx, s - 1)?;
                    check_transfer(s, "activations", &msg, micro, &ins)?;
                    let slot = &stage.slots[micro % slots];
                    for (&b, (_, d)) in slot.acts_in.iter().zip(&msg.1) {
                        dev.upload(b, d)?;
                    }
                }
                Instr::Forward { micro, buffer } => {
                    let slot = &mut stage.slots[buffer % slots];
                    // Replica r's micro-batches are the data-parallel rank r's: keyed
                    // as a network at micro offset r · m keys them.
                    let key = random_key(self.seed, self.steps, self.r * self.m + micro);
                    slot.plan.set_random_state(key);
                    slot.plan.forward_only(dev)?;
                }
                Instr::SendActivation { micro } => {
                    let slot = &stage.slots[micro % slots];
                    let mut bufs = vec![];
                    for a in &stage.part.activations_out {
                        bufs.push((g.shape(a.local).to_vec(), stage.outgoing(slot, a.local)));
                    }
                    post(true, micro, bufs)?;
                }
                Instr::RecvGrad { micro } => {
                    let rx = links.grad_in.as_ref().expect("an earlier stage receives");
                    let msg = receive(rx, s + 1)?;
                    check_transfer(s, "activation gradients", &msg, micro, &grads_in)?;
                    let slot = &stage.slots[micro % slots];
                    for (&b, (_, d)) in slot.seeds.iter().flatten().zip(&msg.1) {
                        dev.upload(b, d)?;
                    }
                }
                Instr::Backward { micro, buffer } => {
                    let slot = &mut stage.slots[buffer % slots];
                    // The loss of each micro-batch is its trained rows' mean; the step's
                    // the micro-batches' mean. Other stages start from the seeds.
                    let weight = if has_loss {
                        1.0 / slot.trained.max(1) as f32 / self.m as f32
                    } else {
                        1.0
                    };
                    let scalars = (self.o.loss_scale, weight, micro);
                    match (&stage.hand_over, &handing) {
                        (Some(groups), Some((to_downloader, _))) => {
                            // Each group's copies are queued in-stream right behind its
                            // last gradient write, before the next block overwrites the
                            // shared buffers.
                            let params = &stage.params;
                            let mut ready = |group: &[usize]| -> Result<()> {
                                let mut staged = vec![];
                                for &k in group {
                                    match dev.begin_download(params[k].grad) {
                                        Ok(pending) => staged.push((k, pending)),
                                        Err(e) => {
                                            for (_, pending) in staged {
                                                let _ = dev.finish_download(pending);
                                            }
                                            return Err(e);
                                        }
                                    }
                                }
                                to_downloader.send(staged).map_err(|_| {
                                    peer_stopped(&me, &format!("{me}'s gradient downloader"))
                                })
                            };
                            slot.plan.backward_with(dev, scalars, groups, &mut ready)?;
                        }
                        _ => slot.plan.backward(dev, scalars)?,
                    }
                }
                Instr::SendGrad { micro } => {
                    let slot = &stage.slots[micro % slots];
                    let mut bufs = vec![];
                    for a in &stage.part.activations_in {
                        if a.grad.is_some() {
                            let b = slot
                                .plan
                                .input_gradient(a.local)
                                .expect("the plan copies out every input gradient");
                            bufs.push((g.shape(a.local).to_vec(), b));
                        }
                    }
                    post(false, micro, bufs)?;
                }
                Instr::ReduceTiedGrads | Instr::ReduceGrads | Instr::OptimizerStep => {
                    unreachable!("end instructions come after the ticks")
                }
            }
        }
        for instr in end {
            // The tied gradients are summed in the same round as the step's decision
            // (one exchange with the coordinator); a data-parallel exchange within a
            // stage has nothing to do with one replica.
            if *instr == Instr::OptimizerStep {
                let handed = match handing.take() {
                    Some((to_downloader, sums)) => {
                        drop(to_downloader);
                        let gone = || peer_stopped(&me, &format!("{me}'s gradient downloader"));
                        Some(sums.recv().map_err(|_| gone())??)
                    }
                    None => None,
                };
                self.finish(stage, dev, links, handed)?;
            }
        }
        Ok(StageStats {
            waited,
            exposed,
            sent: sent.get(),
        })
    }

    /// The step's end on this stage: report overflow, squared norm, replicated
    /// gradients (with replicas: every gradient; `handed`: those the backwards handed
    /// over, summed on the host) and loss; take the decision; write the summed
    /// gradients back; update.
    fn finish(
        &self,
        stage: &mut Stage,
        dev: &dyn Device,
        links: &Links,
        handed: Option<Handed>,
    ) -> Result<()> {
        let s = self.s;
        let has_loss = stage.part.graph.losses().is_some();
        let all = self.dp > 1;
        let plan = &mut stage.slots[0].plan;
        // With replicas the coordinator checks the averaged gradients instead.
        let (overflow, sum_squares) = if all {
            (false, 0.0)
        } else {
            plan.measure(dev)?;
            (plan.overflowed(dev)?, plan.sum_squares(dev)? as f64)
        };
        let loss = if has_loss {
            Some(plan.step_loss(dev)?)
        } else {
            None
        };
        let mut grads = vec![];
        match handed {
            Some(handed) => {
                for ((sum, count), &i) in handed.into_iter().zip(&stage.part.params) {
                    if count != self.m {
                        return Err(Error::InvalidArgument(format!(
                            "{}: parameter {i}'s gradients were handed over {count} times in \
                             a step of {} micro-batches",
                            stage_name(s, self.r, self.dp),
                            self.m
                        )));
                    }
                    grads.push((i, sum));
                }
            }
            None => {
                for (k, &i) in stage.part.params.iter().enumerate() {
                    if all || self.holders[i].len() > 1 {
                        grads.push((i, dev.download(stage.params[k].grad)?.to_f32()));
                    }
                }
            }
        }
        links
            .report
            .send(Report {
                overflow,
                sum_squares,
                grads,
                loss,
            })
            .map_err(|_| peer_stopped(&stage_name(s, self.r, self.dp), "the coordinator"))?;
        let decision = links
            .decision
            .recv()
            .map_err(|_| peer_stopped(&stage_name(s, self.r, self.dp), "another stage"))?;
        for (i, grad) in &decision.grads {
            let k = stage
                .part
                .params
                .iter()
                .position(|p| p == i)
                .expect("decisions carry the stage's own parameters");
            let b = stage.params[k].grad;
            dev.upload(b, &HostData::from_f32(b.dtype, grad))?;
        }
        if let Some(grad_scale) = decision.grad_scale {
            let plan = &mut stage.slots[0].plan;
            plan.apply(dev, self.o.lr, self.steps + 1, grad_scale)?;
        }
        dev.wait()
    }
}

/// The coordinator's part: every stage's report (in device order), one overflow flag,
/// one squared norm counting each parameter once, one gradient factor (`None`: skip),
/// and per parameter the gradient every copy takes.
///
/// One replica: the replicated parameters' gradients summed in stage order, the norm
/// the stages' (each copy's share replaced by the sum's). Several: within each
/// replica the copies summed in stage order, then every tensor folded over the
/// replicas in replica order and averaged (a stage's own tensors as soon as its
/// replicas have reported, while earlier stages are still in backward), and flag and
/// norm taken from the averages in model order, as a data-parallel group takes them.
fn decide(
    reports: &[Receiver<Report>],
    holders: &[Vec<usize>],
    stage_params: &[Vec<usize>],
    dp: usize,
    o: StepOptions,
) -> Result<Decided> {
    let p = stage_params.len();
    let mut grads: Vec<Option<Arc<Vec<f32>>>> = vec![None; holders.len()];
    let mut inspected = vec![(false, 0f64); holders.len()];
    let average = |parts: &[Vec<f32>]| {
        let mut avg = vec![];
        fold(&mut avg, parts, Some(1.0 / dp as f32));
        (inspect(&avg), Some(Arc::new(avg)))
    };
    // 1F1B ends the last stage's backwards first and the first stage's last: with
    // replicas, a stage's own gradients are averaged as soon as all its replicas have
    // reported, while earlier stages still compute. Copies on several stages wait for
    // every holder (below).
    let mut got: Vec<Option<Report>> = (0..reports.len()).map(|_| None).collect();
    for s in (0..p).rev() {
        for r in 0..dp {
            let f = s * dp + r;
            got[f] = Some(reports[f].recv().map_err(|_| {
                Error::InvalidArgument(format!(
                    "{} stopped before the step's end",
                    stage_name(s, r, dp)
                ))
            })?);
        }
        if dp == 1 {
            continue;
        }
        for &i in stage_params[s].iter().filter(|&&i| holders[i].len() == 1) {
            let parts: Vec<Vec<f32>> = got[s * dp..(s + 1) * dp]
                .iter_mut()
                .map(|report| {
                    let report = report.as_mut().expect("received above");
                    let k = report.grads.iter().position(|(j, _)| *j == i);
                    report
                        .grads
                        .swap_remove(k.expect("every replica reports every gradient"))
                        .1
                })
                .collect();
            (inspected[i], grads[i]) = average(&parts);
        }
    }
    let mut got: Vec<Report> = got.into_iter().flatten().collect();
    // Per replica, per parameter: its copies' sum, in stage order.
    let mut summed: Vec<Vec<Option<Vec<f32>>>> = vec![vec![None; holders.len()]; dp];
    let mut sum_squares = 0f64;
    let mut overflow = false;
    for s in 0..p {
        for (r, acc) in summed.iter_mut().enumerate() {
            let report = &mut got[s * dp + r];
            overflow |= report.overflow;
            sum_squares += report.sum_squares;
            for (i, g) in std::mem::take(&mut report.grads) {
                if dp == 1 {
                    // Each copy's own share leaves the norm; the sum enters it once below.
                    sum_squares -= g.iter().map(|&x| (x as f64) * (x as f64)).sum::<f64>();
                }
                match &mut acc[i] {
                    Some(acc) => acc.iter_mut().zip(&g).for_each(|(a, b)| *a += b),
                    None => acc[i] = Some(g),
                }
            }
        }
    }
    if dp == 1 {
        for (i, acc) in summed.remove(0).into_iter().enumerate() {
            if let Some(acc) = acc {
                debug_assert!(holders[i].len() > 1);
                sum_squares += acc.iter().map(|&x| (x as f64) * (x as f64)).sum::<f64>();
                overflow |= acc.iter().any(|x| !x.is_finite());
                grads[i] = Some(Arc::new(acc));
            }
        }
    } else {
        // The copies on several stages, each replica's summed in stage order above.
        for i in (0..holders.len()).filter(|&i| holders[i].len() > 1) {
            let parts: Vec<Vec<f32>> = summed
                .iter_mut()
                .map(|r| r[i].take().expect("every replica reports every gradient"))
                .collect();
            (inspected[i], grads[i]) = average(&parts);
        }
        // In model order, whatever order the stages reported in: the same bits.
        (overflow, sum_squares) = combine(&inspected);
    }
    // Subtracting the copies' shares can leave rounding below zero.
    let sum_squares = if overflow {
        f64::NAN
    } else {
        sum_squares.max(0.0)
    };
    let grad_scale = (!overflow).then(|| grad_scale_reference(sum_squares, o.loss_scale, o.clip));
    // Each replica's loss as a data-parallel rank reports it (f32), averaged in f64.
    let losses: f64 = got
        .iter()
        .filter_map(|r| r.loss)
        .map(|l| l as f32 as f64)
        .sum();
    let loss = (losses / dp as f64) as f32;
    Ok((
        grad_scale,
        grads,
        StepReport {
            loss,
            overflow,
            sum_squares,
            grad_scale: grad_scale.unwrap_or(0.0),
            seconds: 0.0,
            waited: vec![],
            exposed: vec![],
            bytes_moved: 0,
        },
    ))
}

/// Evaluation: one micro-batch's forward pass through every stage in turn.
impl Pipeline {
    /// Mean loss of `batch` and the index of the largest prediction in every row (the
    /// next token at every position), as [`Network::predict`] gives them on one
    /// device: each stage runs its forward pass without dropout and hands its
    /// activations to the next through the host, no update. It uses the first slot's
    /// buffers, which the next step overwrites.
    ///
    /// [`Network::predict`]: crate::models::Network::predict
    pub fn predict(&self, batch: &MicroBatch) -> Result<(f64, Vec<u32>)> {
        // Replica 0 evaluates: every replica holds the same weights.
        let p = self.stages();
        let mut carried: Vec<HostData> = vec![];
        for s in 0..p {
            let (stage, dev) = (&self.stages[s * self.dp], self.devs[s * self.dp].as_ref());
            let at_stage = |e: Error| Error::InvalidArgument(format!("pipeline stage {s}: {e}"));
            let (data, trained) = stage_data(stage, batch).map_err(at_stage)?;
            let slot = &stage.slots[0];
            for (&b, d) in slot.inputs.iter().zip(&data) {
                dev.upload(b, d).map_err(at_stage)?;
            }
            for (&b, d) in slot.acts_in.iter().zip(&carried) {
                dev.upload(b, d).map_err(at_stage)?;
            }
            slot.plan.evaluate(dev).map_err(at_stage)?;
            let g = &stage.part.graph;
            if s + 1 < p {
                carried = vec![];
                for a in &stage.part.activations_out {
                    let b = stage.outgoing(slot, a.local);
                    carried.push(dev.download(b).map_err(at_stage)?);
                }
                continue;
            }
            // The model's prediction: what the loss reads (the stage's outputs also hold
            // the per-row losses), else the whole graph's one output.
            let t = g
                .ops
                .iter()
                .find_map(|op| match *op {
                    Op::CrossEntropy { logits, .. } => Some(logits),
                    _ => None,
                })
                .or_else(|| g.outputs.iter().copied().find(|&o| Some(o) != g.losses()))
                .ok_or_else(|| {
                    Error::InvalidArgument("pipeline: the last stage has no prediction".into())
                })?;
            let loss = slot.plan.loss_sum(dev).map_err(at_stage)? / trained.max(1) as f64;
            let cols = (*g.shape(t).last().unwrap_or(&1)).max(1);
            let classes = g.classes_of(t).clamp(1, cols);
            let buf = slot
                .plan
                .buffer(t)
                .expect("the prediction is a graph output");
            let values = dev.download(buf).map_err(at_stage)?.to_f32();
            let best = crate::models::best_per_row(&values, cols, classes);
            return Ok((loss, best));
        }
        unreachable!("a pipeline has at least one stage")
    }
}
