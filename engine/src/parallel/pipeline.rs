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
//! [`Plan::backward_with`]: crate::graph::Plan::backward_with

use std::sync::mpsc::{channel, Receiver, Sender};
use std::sync::Arc;

use std::time::Instant;

use super::pipeline_partition::{partition, PartitionMethod};
use super::pipeline_run::{decide, stage_name, Decision, Links, Report, Run, StageStats, Transfer};
pub use super::pipeline_run::{StepOptions, StepReport};
use super::pipeline_schedule::Schedule;
use super::pipeline_stages::{
    compile_slot, cut, local_blocks, stage_costs, stage_data, stage_memory, Cut, Stage,
};
use super::zero::{shard_bytes_of, Offload, Shards};
use crate::device::optim::ParamBuffers;
use crate::graph::{Loss, Op};
use crate::models::{
    check_sharing, draw_initial, hand_over_groups, host_memory_available, shared_gradients,
    MicroBatch, Model, NetworkMemory, NetworkOptions, ParamSpec, ParamState,
};
use crate::rng::SplitMix;
use crate::{DType, Device, Error, HostData, Result};

/// A model trained over several devices as a pipeline.
pub struct Pipeline {
    model: Arc<dyn Model>,
    options: NetworkOptions,
    /// The trained parameters.
    specs: Vec<ParamSpec>,
    /// The frozen weights (a LoRA run's base), in model order: what each stage's
    /// `part.frozen` indexes.
    frozen_specs: Vec<ParamSpec>,
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
        Pipeline::replicated(devs, model, options, method, p, 0, false)
    }

    /// `devs.len() / stages` replicas of `model` cut into `stages` stages (pp × dp):
    /// device `s * dp + r` runs stage `s` of replica `r`. Every replica starts from
    /// the same weights; with `zero_stage` 1 or 2 and more than one replica, each
    /// stage's optimizer state is sharded over the stage's replicas (in host memory
    /// with `offload`), and under 2 its alike blocks share one block's gradient
    /// buffers (see the module doc).
    pub fn replicated(
        devs: Vec<Box<dyn Device>>,
        model: Arc<dyn Model>,
        options: &NetworkOptions,
        method: &PartitionMethod,
        stages: usize,
        zero_stage: u32,
        offload: bool,
    ) -> Result<Pipeline> {
        let dp = replicas(devs.len(), stages)?;
        if offload && !(zero_stage >= 1 && dp > 1) {
            return Err(Error::InvalidArgument(format!(
                "pipeline: zero_optimization.offload_optimizer moves the shards of each \
                 stage's optimizer state that ZeRO stage 1 or 2 spreads over the stage's \
                 data-parallel replicas, and this pipeline has {dp} replica(s) at stage \
                 {zero_stage}: give at least twice as many devices as stages with stage 1 \
                 or 2, or remove offload_optimizer (with one replica a stage's gradients \
                 are not brought to the host)"
            )));
        }
        if zero_stage > 2 {
            return Err(Error::InvalidArgument(format!(
                "pipeline: zero_optimization.stage {zero_stage}: ZeRO stage 3 is not \
                 supported with pipeline stages (a stage's blocks do not take turns in one \
                 set of weight buffers); a pipeline shards the optimizer state (stage 1) or \
                 also the gradients (stage 2) over its replicas: set stage 1 or 2, or train \
                 at stage 3 without pipeline stages"
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
        // Sharded, a stage's devices are built without its optimizer state, beside
        // their slice of it (none on the device when offloaded).
        let sharded = zero_stage >= 1 && dp > 1;
        // Stage 3 (and so parameter offload) is refused with pipeline stages.
        let offload = Offload {
            optimizer: offload,
            params: false,
        };
        if sharded {
            for (m, part) in memory.iter_mut().zip(&parts) {
                let sizes: Vec<usize> = part.params.iter().map(|&i| specs[i].len()).collect();
                let act = options.dtype;
                *m = m.with_shards(shard_bytes_of(&sizes, dp, 0..dp, act, offload));
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
        let trained = specs.iter().filter(|s| !s.frozen).count();
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
            for r in 0..dp {
                let dev = devs[s * dp + r].as_ref();
                // Sharded, the shards hold the optimizer state: one empty buffer stands
                // for every master and moment, and the plans compile without an update.
                let empty = match sharded {
                    true => Some(dev.alloc(DType::F32, 0)?),
                    false => None,
                };
                let mut params = vec![];
                for &i in &part.params {
                    let grad = if specs[i].f32_grad { DType::F32 } else { act };
                    params.push(match empty {
                        None => ParamBuffers::new(dev, &inits[i], act, grad)?,
                        Some(e) => ParamBuffers::without_state(dev, &inits[i], act, grad, e)?,
                    });
                }
                // The frozen weights it reads (after the trained ones in model order).
                let mut frozen = vec![];
                for &(k, _) in &part.frozen {
                    let values = &inits[trained + k];
                    let b = dev.alloc(act, values.len())?;
                    dev.upload(b, &HostData::from_f32(act, values))?;
                    frozen.push(b);
                }
                // The sharing blocks' own gradient buffers go: they write the first
                // block's.
                for (k, shared) in sharing.iter().enumerate() {
                    if let Some(q) = *shared {
                        dev.free(params[k].grad)?;
                        params[k].grad = params[q].grad;
                    }
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
                    slots.push(compile_slot(
                        dev,
                        &part,
                        (&params, &frozen),
                        options,
                        update,
                    )?);
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
                    frozen,
                    slots,
                    input_pos,
                    targets,
                    loss_rows,
                    hand_over,
                });
            }
            shards.push(if sharded {
                let group: Vec<&dyn Device> = (0..dp).map(|r| devs[s * dp + r].as_ref()).collect();
                let masters: Vec<&[f32]> = part.params.iter().map(|&i| &inits[i][..]).collect();
                Some(Shards::from_masters(
                    &group,
                    &masters,
                    &vec![act; part.params.len()],
                    None,
                    offload,
                )?)
            } else {
                None
            });
        }
        let mut specs = specs;
        let frozen_specs = specs.split_off(trained);
        Ok(Pipeline {
            model,
            options: options.clone(),
            specs,
            frozen_specs,
            devs,
            stages: built,
            dp,
            shards,
            holders,
            blocks: ranges,
            steps: 0,
        })
    }

    /// Sets the frozen weights (a LoRA run's base) on every stage that reads them, in
    /// every replica, from host tensors named as the model names them (a tied one also
    /// under its other name), rounded once to the storage dtype. Every frozen weight
    /// must be given with its shape, and no other tensor; checked before anything is
    /// written.
    pub fn set_frozen(&mut self, weights: &[crate::device::host::HostTensor]) -> Result<()> {
        let specs: Vec<&ParamSpec> = self.frozen_specs.iter().collect();
        let found = crate::models::match_frozen(
            &specs,
            weights,
            self.options.dtype,
            &self.model.describe(),
        )?;
        let act = self.options.dtype;
        for (f, stage) in self.stages.iter().enumerate() {
            let dev = self.devs[f].as_ref();
            for (&(k, _), &b) in stage.part.frozen.iter().zip(&stage.frozen) {
                dev.upload(b, &HostData::from_f32(act, &found[k].data.to_f32()))?;
            }
        }
        Ok(())
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
    /// overflow). The loss is the mean over the trained rows of every micro-batch of
    /// every replica.
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
        let trained: usize = data[(p - 1) * dp..]
            .iter()
            .flat_map(|per| per.iter().map(|d| d.1))
            .sum();
        let per_row = dp as f32 / trained.max(1) as f32;
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
                    per_row,
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
            let super::zero::Updated { wholes, .. } =
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
            let best = crate::models::best_per_row(dev, buf, cols, classes).map_err(at_stage)?;
            return Ok((loss, best));
        }
        unreachable!("a pipeline has at least one stage")
    }
}
