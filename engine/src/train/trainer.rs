//! The training engine: any [`Model`] built from a resolved [`TrainConfig`] on one
//! device or a data-parallel group, stepped one optimizer step at a time. It owns what
//! DeepSpeed's engine owns — precision, loss scaling, the learning-rate schedule,
//! clipping, gradient accumulation, data parallelism and ZeRO 1/2 — so that a training
//! loop is "get micro-batches, call `step`, log the stats".
//!
//! ```text
//! let mut engine = Trainer::new(dev, Arc::new(model), train_config, seed)?;
//! let stats = engine.step(dev, &micro_batches)?;   // one optimizer step
//! ```

use std::sync::Arc;

use serde::{Deserialize, Serialize};

use crate::config::{LossScaling, Precision, TrainConfig};
use crate::device::optim::grad_scale_reference;
use crate::device::profile::{span, SpanKind};
use crate::graph::StreamStats;
use crate::models::{
    host_memory_available, in_file, weight_copies, MicroBatch, Model, ModelStateBytes, Network,
    NetworkOptions, ParamSpec, ParamState, Partition,
};
use crate::parallel::collective::{Ownership, Processes};
use crate::parallel::exchange::{self, During};
use crate::parallel::zero::{self, check_host_fits, Offload, OffloadTime, Shards};
use crate::train::checkpoint::{
    self, Checkpoint, CheckpointError, CheckpointFile, HostTensor, SaveOptions, MODEL_FILE,
    OPTIMIZER_FILE,
};
use crate::train::loss_scaler::LossScaler;
use crate::{DType, Device, Error, Result, StepDecision};

/// What one optimizer step did.
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct StepStats {
    /// Mean loss over the step's micro-batches.
    pub loss: f32,
    /// The learning rate the step used (applied or not).
    pub lr: f32,
    /// The fp16 loss scale the step ran with (1 without fp16).
    pub loss_scale: f32,
    /// The gradients overflowed: nothing but the loss scaler changed.
    pub skipped: bool,
    /// Optimizer steps applied so far, this one included.
    pub applied: u64,
}

/// The engine's counters and scaler: with the parameters, everything a checkpoint must
/// hold to continue bit-identically.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct TrainerState {
    /// Steps attempted (applied + skipped): the data position follows this.
    pub steps: u64,
    /// Steps applied: the LR schedule and Adam's bias correction follow this.
    pub applied: u64,
    pub scaler: LossScaler,
    /// Steps skipped in a row up to here (absent in older checkpoints: 0).
    #[serde(default)]
    pub consecutive_skips: u64,
    /// Steps in a row the dynamic fp16 scaler ran at its minimum without growing.
    #[serde(default)]
    pub steps_at_min_scale: u64,
}

impl TrainerState {
    /// Checks a restored state against an engine whose loss scaler is `scaler` (the
    /// run's precision); returns the applied steps as the engine counts them.
    pub(crate) fn check(&self, scaler: &LossScaler) -> Result<u32> {
        let state = self;
        let applied = u32::try_from(state.applied).map_err(|_| {
            Error::InvalidArgument(format!(
                "checkpoint: {} applied steps is more than this engine counts",
                state.applied
            ))
        })?;
        if state.applied > state.steps {
            return Err(Error::InvalidArgument(format!(
                "checkpoint: {} applied steps out of {} attempted is impossible: the checkpoint \
                 state is corrupt",
                state.applied, state.steps
            )));
        }
        if std::mem::discriminant(&state.scaler) != std::mem::discriminant(scaler) {
            return Err(Error::InvalidArgument(
                "checkpoint: its loss scaler (static vs dynamic) differs from this config's \
                 fp16 settings; resume with the config the run was started with"
                    .into(),
            ));
        }
        Ok(applied)
    }

    /// The state a checkpoint [`Trainer::save_checkpoint`] wrote holds, checked against
    /// its manifest's step: what [`Trainer::load_checkpoint`] restores, readable before
    /// any device is open.
    pub fn from_checkpoint(ck: &Checkpoint) -> checkpoint::Result<TrainerState> {
        let state: TrainerState = ck
            .state()
            .get("trainer")
            .cloned()
            .and_then(|t| serde_json::from_value(t).ok())
            .ok_or_else(|| CheckpointError::BadState {
                dir: ck.dir.clone(),
                what: "trainer",
            })?;
        // The manifest's step is what callers report and count metrics from; the state
        // is what the engine continues from. They are written together, so a difference
        // is an edit or damage that the checksums (they cover the tensors, not the
        // manifest) cannot catch.
        if state.steps != ck.step() {
            return Err(CheckpointError::StepMismatch {
                dir: ck.dir.clone(),
                manifest: ck.step(),
                state: state.steps,
            });
        }
        Ok(state)
    }
}

/// What a data-parallel step spent exchanging gradients through the host.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize)]
pub struct CommStats {
    /// Exchange time the step paid: downloading, reducing and uploading gradients,
    /// counted from the end of the last device's backward (earlier work overlapped it).
    pub ms: f64,
    /// Bytes copied between devices and host (both directions, all devices; stage 3's
    /// weight loads included).
    pub bytes: u64,
    /// Share of the exchanged bytes reduced while some device was still in backward
    /// (in a multi-process job: of the bytes exchanged between processes).
    pub overlap: f64,
    /// Bytes this process sent to and received from the other processes of a
    /// multi-process job.
    pub process_bytes: u64,
    /// ZeRO-Offload: the host's optimizer step (ms) and the part of it not hidden
    /// behind the updated weights' uploads (what the devices waited for).
    pub offload_ms: f64,
    pub offload_exposed_ms: f64,
    /// ZeRO stage 3: the host time spent loading the blocks' weights into the devices
    /// during forward and backward (all devices), the part of it spent while the
    /// device was still running earlier work (hidden), and the bytes loaded.
    pub gather_ms: f64,
    pub gather_hidden_ms: f64,
    pub gather_bytes: u64,
}

pub struct Trainer {
    /// Rank 0's network: the one checkpoints and evaluation read.
    pub model: Network,
    /// Ranks 1.. of a data-parallel group: identical replicas on their own devices.
    pub replicas: Vec<Network>,
    pub config: TrainConfig,
    /// The fp16 loss scaler (a fixed scale of 1 without fp16), one for the group.
    pub scaler: LossScaler,
    steps: u64,
    /// Divergence watch: see [`Trainer::watch`].
    consecutive_skips: u64,
    steps_at_min_scale: u64,
    /// The last data-parallel step's exchange.
    pub last_comm: CommStats,
    /// ZeRO stages 1 and 2: every rank's slice of the optimizer state.
    shards: Option<Shards>,
    /// ZeRO stage 2: the replicas' alike blocks share one set of gradient buffers, each
    /// micro-batch's gradients are reduced during backward, and a rank keeps only its
    /// shard of the result (in its segments' gradient buffers).
    partitioned: bool,
    /// A multi-process job: the other processes' ranks join every exchange.
    procs: Option<Processes>,
}

/// The storage dtype and loss scaler a config's precision section asks for.
pub fn precision(config: &TrainConfig) -> Result<(DType, LossScaler)> {
    let scaler = match &config.precision {
        Precision::Fp16 { loss_scaling, .. } => match loss_scaling {
            LossScaling::Dynamic(d) => LossScaler::dynamic(d.clone())?,
            LossScaling::Static(s) => LossScaler::fixed(*s)?,
        },
        // bf16 has fp32's exponent range: no scaling.
        Precision::Fp32 | Precision::Bf16 => LossScaler::fixed(1.0)?,
    };
    Ok((config.precision.dtype(), scaler))
}

impl Trainer {
    /// Builds `model` on `dev` for `config`'s micro-batch and precision; `seed` fixes
    /// the weights.
    pub fn new(
        dev: &dyn Device,
        model: Arc<dyn Model>,
        config: TrainConfig,
        seed: u64,
    ) -> Result<Trainer> {
        Trainer::new_group(&[dev], model, config, seed)
    }

    /// A data-parallel group: one identical replica per device (the same seed gives the
    /// same weights), `config` resolved for `devs.len()` ranks.
    pub fn new_group(
        devs: &[&dyn Device],
        model: Arc<dyn Model>,
        config: TrainConfig,
        seed: u64,
    ) -> Result<Trainer> {
        Trainer::new_processes(devs, model, config, seed, None)
    }

    /// This process's part of a multi-process data-parallel job (`procs`): one replica
    /// per local device, `config` resolved for every process's devices together. Every
    /// process calls this with the same config, model and seed (checked: a process
    /// started differently is refused on every process).
    pub fn new_processes(
        devs: &[&dyn Device],
        model: Arc<dyn Model>,
        config: TrainConfig,
        seed: u64,
        mut procs: Option<Processes>,
    ) -> Result<Trainer> {
        // Activation checkpointing is the model recorded with its blocks recomputed.
        let model: Arc<dyn Model> = match config.activation_checkpointing {
            Some(every) => Arc::new(crate::models::checkpointed::Checkpointed::new(
                model, every,
            )?),
            None => model,
        };
        let world = procs.as_ref().map_or(devs.len(), Processes::world);
        if let Some(p) = &procs {
            if p.devices.get(p.rank()) != Some(&devs.len()) {
                return Err(Error::InvalidArgument(format!(
                    "process {} drives {} devices but told the job {:?}",
                    p.rank(),
                    devs.len(),
                    p.devices.get(p.rank())
                )));
            }
            p.check_same(
                "configs, models or seeds",
                &format!("{config:?}\n{}\n{seed}", model.describe()),
            )?;
        }
        if devs.is_empty() || config.batch.world != world {
            return Err(Error::InvalidArgument(format!(
                "the config was resolved for {} data-parallel ranks but {world} devices were \
                 given; resolve it with the number of devices",
                config.batch.world,
            )));
        }
        let (dtype, scaler) = precision(&config)?;
        let options = NetworkOptions {
            batch: config.batch.micro_batch,
            dtype,
            optimizer: config.optimizer.clone(),
            seed,
            packed: config.packed_rows,
        };
        let first = procs.as_ref().map_or(0, Processes::first_rank);
        // ZeRO: each rank's slice of the optimizer state, on its device or offloaded
        // to host memory. On one device the single shard is the whole state: stage 0's
        // layout (unless it goes to the host).
        let offload = Offload {
            optimizer: config.zero.offload_optimizer,
            params: config.zero.offload_param,
        };
        if offload.optimizer && config.zero.stage == 0 {
            return Err(Error::InvalidArgument(
                "zero_optimization.offload_optimizer needs ZeRO stage 1, 2 or 3 (the host \
                 steps each rank's shard of the optimizer state): set zero_optimization.stage"
                    .into(),
            ));
        }
        if offload.params && config.zero.stage != 3 {
            return Err(Error::InvalidArgument(
                "zero_optimization.offload_param needs ZeRO stage 3 (below it every device \
                 holds every weight it computes with): set zero_optimization.stage to 3"
                    .into(),
            ));
        }
        // Stage 3 on one device still streams its blocks' weights from host memory.
        let stage3 = config.zero.stage == 3;
        let sharded = config.zero.stage >= 1 && (world > 1 || offload.optimizer || stage3);
        let partitioned = (config.zero.stage == 2 && world > 1) || stage3;
        let partition = match stage3 {
            true => Partition::Stage3 {
                persistence_threshold: config.zero.param_persistence_threshold as usize,
            },
            false => Partition::Whole,
        };
        let shard_bytes = if sharded {
            // Sizes first: an absurd model is named, not listed parameter by parameter.
            model.check_sizes()?;
            let ranks = first..first + devs.len();
            let shards = zero::shard_bytes(model.as_ref(), world, ranks, dtype, offload);
            if offload.optimizer {
                check_host_fits(shards.host, host_memory_available())?;
            }
            Some(shards)
        } else {
            None
        };
        // The whole group at once, before the first replica: devices that share the
        // host's memory (CPU adapters) add up, and a model that cannot fit is refused
        // before anything is allocated.
        Network::check_memory(model.as_ref(), &options, devs, (shard_bytes, partition))?;
        let mut models: Vec<Network> = vec![];
        let mut masters = vec![];
        for &dev in devs {
            if let Partition::Stage3 {
                persistence_threshold,
            } = partition
            {
                // The replicas share one host copy of the streamed weights.
                let (net, m) = Network::new_stage3(
                    dev,
                    model.clone(),
                    &options,
                    persistence_threshold,
                    models.first(),
                )?;
                models.push(net);
                masters = m;
            } else if sharded {
                // The shards take the initial masters (every replica draws the same).
                let (net, m) = Network::new_without_optimizer(dev, model.clone(), &options)?;
                models.push(net);
                masters = m;
            } else {
                models.push(Network::new(dev, model.clone(), &options)?);
            }
        }
        for (rank, m) in models.iter_mut().enumerate() {
            m.set_micro_offset((first + rank) * config.batch.grad_accum);
        }
        let mut shards = None;
        if sharded {
            let dtypes: Vec<DType> = models[0].parameter_layout().iter().map(|l| l.2).collect();
            let masters: Vec<&[f32]> = masters.iter().map(Vec::as_slice).collect();
            shards = Some(Shards::from_masters(
                devs,
                &masters,
                &dtypes,
                procs.as_ref(),
                offload,
            )?);
            if let Some(p) = &mut procs {
                // Each process then receives only the gradients its ranks update.
                let sizes: Vec<usize> = (0..models[0].parameter_tensors())
                    .map(|i| models[0].parameter_len(i))
                    .collect();
                p.owners = Some(Arc::new(Ownership::new(&sizes, &p.devices)));
            }
            if partitioned {
                for (m, &dev) in models.iter_mut().zip(devs) {
                    m.share_block_gradients(dev)?;
                }
            }
        }
        let model = models.remove(0);
        Ok(Trainer {
            model,
            replicas: models,
            config,
            scaler,
            steps: 0,
            consecutive_skips: 0,
            steps_at_min_scale: 0,
            last_comm: CommStats::default(),
            shards,
            partitioned,
            procs,
        })
    }

    /// Devices in the group (this process's, in a multi-process job).
    pub fn world(&self) -> usize {
        1 + self.replicas.len()
    }

    /// Data-parallel ranks in the whole job: every process's devices.
    pub fn global_world(&self) -> usize {
        self.procs.as_ref().map_or(self.world(), Processes::world)
    }

    /// The other processes of a multi-process job, if any.
    pub fn processes(&self) -> Option<&Processes> {
        self.procs.as_ref()
    }

    /// One optimizer step over `gradient_accumulation_steps` micro-batches.
    pub fn step(&mut self, dev: &dyn Device, micro: &[MicroBatch]) -> Result<StepStats> {
        // A multi-process job exchanges; one device's offloaded state steps on the host.
        if self.procs.is_some() || (self.shards.is_some() && self.world() == 1) {
            return self.step_group(&[dev], &[micro.to_vec()]);
        }
        if self.world() > 1 {
            return Err(Error::InvalidArgument(format!(
                "this engine drives {} devices: step it with step_group",
                self.world()
            )));
        }
        let want = self.config.batch.grad_accum;
        if micro.len() != want {
            return Err(Error::InvalidArgument(format!(
                "a step takes gradient_accumulation_steps = {want} micro-batches, got {}",
                micro.len()
            )));
        }
        let applied = self.model.steps_applied() as u64;
        let lr = self.config.schedule.lr_at(applied);
        let loss_scale = self.scaler.scale();
        self.model.accumulate(dev, micro, loss_scale)?;
        let (overflow, loss) = self.model.check(dev, self.config.gradient_clipping)?;
        let skipped = self.decide(overflow)? == StepDecision::Skip;
        if !skipped {
            let _span = span("optimizer", SpanKind::Optimizer);
            self.model.update(dev, lr)?;
        }
        self.steps += 1;
        self.watch(skipped, loss_scale)?;
        Ok(StepStats {
            loss,
            lr,
            loss_scale,
            skipped,
            applied: self.model.steps_applied() as u64,
        })
    }

    /// One data-parallel optimizer step: `micro[r]` are rank r's micro-batches. Each
    /// device runs forward and backward on its shard; the gradients are averaged on the
    /// host in f32 (rank order, so the sum is deterministic) and the overflow check, the
    /// global norm and the loss scaler run once on the result, so every rank takes the
    /// same decision and applies the same update. One device: [`Trainer::step`].
    pub fn step_group(
        &mut self,
        devs: &[&dyn Device],
        micro: &[Vec<MicroBatch>],
    ) -> Result<StepStats> {
        let world = self.world();
        if devs.len() != world || micro.len() != world {
            return Err(Error::InvalidArgument(format!(
                "a step of this {world}-device group takes {world} devices and {world} \
                 micro-batch lists, got {} and {}",
                devs.len(),
                micro.len()
            )));
        }
        if world == 1 && self.procs.is_none() && self.shards.is_none() {
            return self.step(devs[0], &micro[0]);
        }
        let want = self.config.batch.grad_accum;
        if let Some(m) = micro.iter().find(|m| m.len() != want) {
            return Err(Error::InvalidArgument(format!(
                "a step takes gradient_accumulation_steps = {want} micro-batches per rank, got {}",
                m.len()
            )));
        }
        let applied = self.model.steps_applied() as u64;
        let lr = self.config.schedule.lr_at(applied);
        let loss_scale = self.scaler.scale();
        let clip = self.config.gradient_clipping;
        let zero = &self.config.zero;
        let during = During {
            bucket: zero.reduce_bucket_size as usize,
            upload: self.shards.is_none(),
            partitioned: self.partitioned,
            overlap: zero.overlap_comm,
            loss_scale,
        };
        if let Some(p) = &self.procs {
            // Every process reaches the step before any waits inside a collective: a
            // process that died or hangs is named here.
            p.comm
                .arrive(&format!("step {}'s gradient exchange", self.steps + 1))?;
        }
        // Loads since the last step (an evaluation's) are not this step's.
        for m in self.models() {
            m.take_stream_stats();
        }
        let procs = self.procs.clone();
        let ex = {
            let models = self.models_mut();
            if during.overlap || during.partitioned {
                exchange::during_backward(models, devs, micro, &during, procs.as_ref())?
            } else {
                let bucket = during.bucket;
                exchange::after_backward(models, devs, micro, loss_scale, procs.as_ref(), bucket)?
            }
        };
        let (t0, mut bytes) = (ex.started, ex.bytes);
        let decision = self.decide(ex.overflow)?;
        self.steps += 1;
        let mut gathered = StreamStats::default();
        for m in self.models() {
            gathered.add(m.take_stream_stats());
        }
        let comm = |bytes: u64| CommStats {
            ms: t0.elapsed().as_secs_f64() * 1e3 + ex.blocked_ms,
            // Stage 3's weight loads are copies between host and devices too.
            bytes: bytes + gathered.bytes,
            overlap: ex.overlap,
            process_bytes: ex.process_bytes,
            offload_ms: 0.0,
            offload_exposed_ms: 0.0,
            gather_ms: gathered.ms,
            gather_hidden_ms: gathered.hidden_ms,
            gather_bytes: gathered.bytes,
        };
        if decision == StepDecision::Skip {
            self.last_comm = comm(bytes);
            self.watch(true, loss_scale)?;
            return Ok(StepStats {
                loss: ex.loss,
                lr,
                loss_scale,
                skipped: true,
                applied,
            });
        }
        let grad_scale = grad_scale_reference(
            if clip > 0.0 { ex.sum_squares } else { 0.0 },
            loss_scale,
            clip,
        );
        let optimizer = self.config.optimizer.clone();
        let mut offload = OffloadTime::default();
        let shards = self.shards.take();
        let mut models = self.models_mut();
        let optimizer_span = span("optimizer", SpanKind::Optimizer);
        let applied_ok = match &shards {
            None => models.iter_mut().zip(devs).try_for_each(|(m, dev)| {
                if !ex.uploaded {
                    m.set_gradients(*dev, &ex.avg)?;
                    bytes += m.gradient_bytes();
                }
                m.apply(*dev, lr, grad_scale)
            }),
            Some(shards) => {
                let step = (&ex.avg[..], lr, grad_scale, applied + 1);
                shards
                    .apply(&mut models, devs, &optimizer, step)
                    .map(|(b, t)| {
                        bytes += b;
                        offload = t;
                    })
            }
        };
        drop(optimizer_span);
        self.shards = shards;
        applied_ok?;
        self.last_comm = CommStats {
            offload_ms: offload.host_ms,
            offload_exposed_ms: offload.exposed_ms,
            ..comm(bytes)
        };
        self.watch(false, loss_scale)?;
        Ok(StepStats {
            loss: ex.loss,
            lr,
            loss_scale,
            skipped: false,
            applied: applied + 1,
        })
    }

    /// The loss scaler's decision on this step's overflow flag. Its only error, an
    /// overflow at the minimum scale, is the run diverging: reported as such.
    fn decide(&mut self, overflow: bool) -> Result<StepDecision> {
        self.scaler.update(overflow).map_err(|e| Error::Diverged {
            step: self.steps + 1,
            detail: match e {
                Error::InvalidArgument(m) => m,
                other => other.to_string(),
            },
        })
    }

    /// Stops a run that can no longer make progress, instead of letting it skip steps
    /// forever. Without dynamic loss scaling nothing changes after a skipped step, so
    /// `kiln.max_consecutive_skips` skips in a row are divergence; a dynamic scaler that
    /// has sat at `min_loss_scale` for a whole window without growing is overflowing
    /// at a scale it cannot lower. Called once per step, after the step is counted.
    fn watch(&mut self, skipped: bool, loss_scale: f32) -> Result<()> {
        watch_divergence(
            (&mut self.consecutive_skips, &mut self.steps_at_min_scale),
            self.steps,
            &self.scaler,
            &self.config,
            (skipped, loss_scale),
        )
    }

    /// Steps skipped in a row up to the last one (0 after an applied step).
    pub fn consecutive_skips(&self) -> u64 {
        self.consecutive_skips
    }

    /// Every rank's network, mutably, rank 0 first.
    fn models_mut(&mut self) -> Vec<&mut Network> {
        std::iter::once(&mut self.model)
            .chain(self.replicas.iter_mut())
            .collect()
    }

    /// Every parameter's full training state (gathered from the ZeRO shards when the
    /// optimizer state is partitioned): what a checkpoint holds, whatever the group.
    pub fn param_states(&self, devs: &[&dyn Device]) -> Result<Vec<ParamState>> {
        self.check_devices(devs)?;
        let mut states = self.model.param_states(devs[0])?;
        if let Some(shards) = &self.shards {
            shards.gather(devs, &mut states)?;
        }
        Ok(states)
    }

    /// Restores what [`Trainer::param_states`] gave, into every rank (each ZeRO rank
    /// taking its slices): a checkpoint resumes on any number of devices.
    pub fn load_param_states(&self, devs: &[&dyn Device], states: &[ParamState]) -> Result<()> {
        self.check_devices(devs)?;
        let Some(shards) = &self.shards else {
            for (m, dev) in self.models().zip(devs) {
                m.load_param_states(*dev, states)?;
            }
            return Ok(());
        };
        let layout = self.model.parameter_layout();
        if states.len() != layout.len() {
            return Err(Error::InvalidArgument(format!(
                "the checkpoint holds {} parameters but this model has {}",
                states.len(),
                layout.len()
            )));
        }
        // Whole-model checks (names, shapes, dtypes) are the unsharded loader's; the
        // states must be listed in model order here.
        for (st, (name, shape, dtype, _)) in states.iter().zip(&layout) {
            let n: usize = shape.iter().product();
            for (what, len) in [
                ("value", st.value.len()),
                ("master", st.master.len()),
                ("exp_avg", st.m.len()),
                ("exp_avg_sq", st.v.len()),
            ] {
                if len != n {
                    return Err(Error::LenMismatch {
                        what: format!("checkpoint {what} of `{name}`"),
                        expected: n,
                        found: len,
                    });
                }
            }
            if &st.name != name || &st.shape != shape || st.value.dtype() != *dtype {
                return Err(Error::InvalidArgument(format!(
                    "checkpoint parameter `{}` {:?} {} does not match this model's `{name}` \
                     {shape:?} {dtype}: resume with the model and precision it was saved with",
                    st.name,
                    st.shape,
                    st.value.dtype()
                )));
            }
        }
        for (i, st) in states.iter().enumerate() {
            // One host copy for every replica where stage 3 keeps it there.
            let value = Arc::new(st.value.clone());
            for (m, dev) in self.models().zip(devs) {
                m.set_value_shared(*dev, i, &value)?;
            }
        }
        shards.scatter(devs, states)
    }

    /// Sets the whole group's weights from host tensors named as the model's
    /// parameters are (a tied parameter also under its other name, e.g. GPT-2's
    /// `lm_head.weight`), as [`Network::set_weights`] does for one network: on every
    /// rank the model copy (rounded once, to nearest even, where the values are not
    /// already in the storage dtype) and the f32 master (the values widened exactly),
    /// or under ZeRO each rank's slice of the masters; every optimizer moment zeroed.
    /// The engine then starts afresh, as [`Trainer::new_group`] left it: no steps
    /// taken or applied (the schedule and Adam's bias correction start again), the
    /// loss scaler at its initial scale, no skips counted. So a fine-tune from
    /// imported weights trains exactly like a trainer built with them.
    ///
    /// All or nothing: every parameter must be given once, with its shape, in f32,
    /// f16 or bf16, finite and within the storage dtype's range; anything else is
    /// refused, naming the tensor, before anything is written. `devs` are the group's
    /// devices, rank 0 first.
    pub fn set_weights(&mut self, devs: &[&dyn Device], weights: &[HostTensor]) -> Result<()> {
        self.check_devices(devs)?;
        let matched = self.model.match_weights(weights)?;
        let dtype = self.model.options().dtype;
        for (i, t) in matched.iter().enumerate() {
            let (value, master) = weight_copies(&t.data, dtype);
            match &self.shards {
                None => {
                    for (m, dev) in self.models().zip(devs) {
                        m.write_weights(*dev, i, &value, Some(&master), true)?;
                    }
                }
                Some(shards) => {
                    let value = Arc::new(value.into_owned());
                    for (m, dev) in self.models().zip(devs) {
                        m.set_value_shared(*dev, i, &value)?;
                    }
                    shards.set_weights(devs, i, &master)?;
                }
            }
        }
        for m in self.models_mut() {
            m.set_steps_applied(0);
        }
        self.steps = 0;
        self.scaler = precision(&self.config)?.1;
        self.consecutive_skips = 0;
        self.steps_at_min_scale = 0;
        self.last_comm = CommStats::default();
        Ok(())
    }

    /// Sets every replica's frozen weights (a LoRA run's base model) as
    /// [`Network::set_frozen`] does, leaving the trained parameters, the optimizer
    /// state and the step count alone. Checked in full before anything is written.
    pub fn set_frozen(&mut self, devs: &[&dyn Device], weights: &[HostTensor]) -> Result<()> {
        self.check_devices(devs)?;
        self.model.match_frozen(weights)?;
        for (m, dev) in self.models().zip(devs) {
            m.set_frozen(*dev, weights)?;
        }
        Ok(())
    }

    /// [`Trainer::set_weights`] from the safetensors file at `path` (read whole, see
    /// `safetensors_io::read`): a file `safetensors_io::save` wrote from
    /// [`Network::tensors`], or any file holding exactly this model's tensors under its
    /// names. Errors name the file.
    pub fn load_weights(&mut self, devs: &[&dyn Device], path: &std::path::Path) -> Result<()> {
        let weights = crate::device::safetensors_io::read(path)?;
        self.set_weights(devs, &weights)
            .map_err(|e| in_file(path, e))
    }

    /// Rank `rank`'s model states on its device as allocated: its replica's model
    /// copy and gradients, and its optimizer state (whole, or its ZeRO slices: master,
    /// moments, reduced gradient, updated model copy and the step's gradient factor).
    pub fn model_state_bytes(&self, rank: usize) -> ModelStateBytes {
        let Some(m) = self.models().nth(rank) else {
            return ModelStateBytes::default();
        };
        let mut bytes = m.model_state_bytes();
        if let Some(shards) = &self.shards {
            shards.add_bytes(rank, &mut bytes);
        }
        bytes
    }

    /// Elements of the optimizer state rank `rank` holds (master + moments count once).
    pub fn optimizer_state_elements(&self, rank: usize) -> usize {
        match &self.shards {
            Some(shards) => shards.elements(rank),
            None => self
                .model
                .parameter_layout()
                .iter()
                .map(|l| l.1.iter().product::<usize>())
                .sum(),
        }
    }

    fn check_devices(&self, devs: &[&dyn Device]) -> Result<()> {
        if devs.len() != self.world() {
            return Err(Error::InvalidArgument(format!(
                "this group has {} devices but {} were given",
                self.world(),
                devs.len()
            )));
        }
        Ok(())
    }

    /// Every rank's network, rank 0 first.
    pub fn models(&self) -> impl Iterator<Item = &Network> {
        std::iter::once(&self.model).chain(&self.replicas)
    }

    pub fn state(&self) -> TrainerState {
        TrainerState {
            steps: self.steps,
            applied: self.model.steps_applied() as u64,
            scaler: self.scaler.clone(),
            consecutive_skips: self.consecutive_skips,
            steps_at_min_scale: self.steps_at_min_scale,
        }
    }

    /// Restores counters and scaler saved by [`Trainer::state`] (the parameters are
    /// restored separately, see [`Trainer::load_param_states`]).
    pub fn restore(&mut self, state: &TrainerState) -> Result<()> {
        let applied = state.check(&self.scaler)?;
        self.steps = state.steps;
        for m in self.models_mut() {
            m.set_steps_applied(applied);
        }
        self.scaler = state.scaler.clone();
        self.consecutive_skips = state.consecutive_skips;
        self.steps_at_min_scale = state.steps_at_min_scale;
        Ok(())
    }

    /// Writes a checkpoint of everything needed to continue bit-identically into
    /// `run_dir`'s `checkpoints/` (atomically; the `keep` newest are kept): the weights
    /// under the model's names in `model.safetensors`, the f32 masters and moments
    /// (`master.`, `exp_avg.`, `exp_avg_sq.` + name) in `optimizer.safetensors`, and in
    /// the manifest the trainer's counters and loss scaler under `"trainer"` beside the
    /// caller's own keys (a data position, say). `step` names it.
    ///
    /// In a multi-process job every process calls it (the ZeRO shards are gathered
    /// from all of them) and process 0 alone writes, whole tensors: the checkpoint
    /// resumes on any number of processes and devices. The others are told where
    /// process 0 put it.
    pub fn save_checkpoint(
        &self,
        devs: &[&dyn Device],
        run_dir: &std::path::Path,
        step: u64,
        state: serde_json::Map<String, serde_json::Value>,
        keep: usize,
    ) -> checkpoint::Result<checkpoint::Saved> {
        let states = self.param_states(devs)?;
        if self.procs.as_ref().is_some_and(|p| p.rank() != 0) {
            return Ok(checkpoint::Saved {
                dir: run_dir
                    .join(checkpoint::CHECKPOINTS_DIR)
                    .join(checkpoint::dir_name(step)),
                removed: vec![],
                notes: vec![],
            });
        }
        save_states(run_dir, step, states, &self.state(), state, keep)
    }

    /// Restores a checkpoint [`Trainer::save_checkpoint`] wrote, into every rank (whole
    /// tensors: a run resumes on another number of devices); returns the manifest's
    /// state, the caller's keys included. A checkpoint of another model or precision is
    /// an error naming the tensor.
    pub fn load_checkpoint(
        &mut self,
        devs: &[&dyn Device],
        ck: &Checkpoint,
    ) -> checkpoint::Result<serde_json::Value> {
        let trainer = TrainerState::from_checkpoint(ck)?;
        let states = read_states(ck, self.model.specs(), self.model.options().dtype)?;
        self.load_param_states(devs, &states)?;
        self.restore(&trainer)?;
        Ok(ck.state().clone())
    }
}

/// Stops a run that can no longer make progress (see `Trainer::watch`), for any engine
/// with a trainer's counters: `consecutive_skips` and `steps_at_min_scale` are updated
/// for the step `step` (already counted) that ran at `loss_scale` and was `skipped` or
/// not.
pub(crate) fn watch_divergence(
    (consecutive_skips, steps_at_min_scale): (&mut u64, &mut u64),
    step: u64,
    scaler: &LossScaler,
    config: &TrainConfig,
    (skipped, loss_scale): (bool, f32),
) -> Result<()> {
    *consecutive_skips = if skipped { *consecutive_skips + 1 } else { 0 };
    let precision = &config.precision;
    match (scaler, precision) {
        (
            LossScaler::Dynamic {
                config: dynamic,
                scale,
                ..
            },
            _,
        ) => {
            let at_min = loss_scale <= dynamic.min_scale && *scale <= dynamic.min_scale;
            *steps_at_min_scale = if at_min { *steps_at_min_scale + 1 } else { 0 };
            if *steps_at_min_scale >= dynamic.window {
                return Err(Error::Diverged {
                    step,
                    detail: format!(
                        "the fp16 loss scale has stayed at its minimum {} (fp16.min_loss_scale) \
                         for a whole window of {} steps (fp16.loss_scale_window) because the \
                         gradients keep overflowing ({} skipped in a row now). Lower the \
                         learning rate (or warm it up longer), set gradient_clipping (1.0 is \
                         typical), lower fp16.min_loss_scale, or train in bf16",
                        dynamic.min_scale, dynamic.window, *consecutive_skips
                    ),
                });
            }
        }
        (LossScaler::Static { scale }, precision) => {
            let max = config.kiln.max_consecutive_skips;
            if *consecutive_skips >= max {
                let (what, advice) = match precision {
                    Precision::Fp16 { .. } => (
                        format!(
                            "the fp16 gradients overflowed at the static loss scale {scale} \
                             (fp16.loss_scale)"
                        ),
                        "use dynamic loss scaling (fp16.loss_scale 0) or a lower static \
                         scale, lower the learning rate, set gradient_clipping (1.0 is \
                         typical), or train in bf16",
                    ),
                    _ => (
                        format!(
                            "the gradients were not finite (NaN or infinite) in this {} run",
                            precision.name()
                        ),
                        "lower the learning rate (or warm it up longer), set \
                         gradient_clipping (1.0 is typical), and check the data and the \
                         model's initialisation",
                    ),
                };
                return Err(Error::Diverged {
                    step,
                    detail: format!(
                        "{what} for {} steps in a row (kiln.max_consecutive_skips = {max}); \
                         the skipped steps left the weights as they were, and without \
                         dynamic loss scaling nothing changes from one step to the next, \
                         so every further step would be skipped too. Try: {advice}",
                        *consecutive_skips
                    ),
                });
            }
        }
    }
    Ok(())
}

/// Writes `states` (whole tensors) as a checkpoint: the weights under the model's names
/// in `model.safetensors`, the f32 masters and moments in `optimizer.safetensors`, and
/// `trainer` under `"trainer"` in the manifest beside the caller's keys. What every
/// engine writes, so a checkpoint resumes whatever engine and topology wrote it.
pub(crate) fn save_states(
    run_dir: &std::path::Path,
    step: u64,
    states: Vec<ParamState>,
    trainer: &TrainerState,
    mut state: serde_json::Map<String, serde_json::Value>,
    keep: usize,
) -> checkpoint::Result<checkpoint::Saved> {
    let mut model = vec![];
    let mut optimizer = vec![];
    for p in states {
        let f32s = |v: Vec<f32>| crate::HostData::F32(v);
        model.push(HostTensor::new(&p.name, p.shape.clone(), p.value));
        for (what, v) in [("master", p.master), ("exp_avg", p.m), ("exp_avg_sq", p.v)] {
            let name = format!("{what}.{}", p.name);
            optimizer.push(HostTensor::new(name, p.shape.clone(), f32s(v)));
        }
    }
    let trainer = serde_json::to_value(trainer).expect("the state serializes");
    state.insert("trainer".into(), trainer);
    checkpoint::save(
        run_dir,
        step,
        &[
            CheckpointFile::new(MODEL_FILE, model),
            CheckpointFile::new(OPTIMIZER_FILE, optimizer),
        ],
        &serde_json::Value::Object(state),
        &SaveOptions { keep_last: keep },
    )
}

/// Every parameter of `specs` as [`save_states`] wrote it, checked against its shape
/// and the run's storage `dtype`.
pub(crate) fn read_states<'a>(
    ck: &Checkpoint,
    specs: impl IntoIterator<Item = &'a ParamSpec>,
    dtype: DType,
) -> checkpoint::Result<Vec<ParamState>> {
    let mut states = vec![];
    for spec in specs {
        let n = &spec.name;
        let value = ck.tensor_checked(MODEL_FILE, n, dtype, &spec.shape)?;
        let f32s = |prefix: &str| -> checkpoint::Result<Vec<f32>> {
            let name = format!("{prefix}.{n}");
            let t = ck.tensor_checked(OPTIMIZER_FILE, &name, DType::F32, &spec.shape)?;
            Ok(t.data.to_f32())
        };
        states.push(ParamState {
            name: n.clone(),
            shape: spec.shape.clone(),
            value: value.data.clone(),
            master: f32s("master")?,
            m: f32s("exp_avg")?,
            v: f32s("exp_avg_sq")?,
        });
    }
    Ok(states)
}
