//! The trainer's part for a pipeline ([`Pipeline`]): a DeepSpeed config's micro-batch,
//! precision, optimizer, learning-rate schedule, gradient clipping and loss scaler
//! driving one model split over several devices. The loss scaler sees the pipeline's
//! one overflow flag, so every stage skips or applies together.
//!
//! Several devices per stage make data-parallel replicas of the pipeline (pp × dp),
//! the config resolved for the replicas (its world size is dp, as DeepSpeed counts a
//! pipeline's data-parallel ranks); its `zero_optimization.stage` 1 or 2 shards each
//! stage's optimizer state over the stage's replicas.
//!
//! Like `Trainer`, it counts steps, watches for divergence, and writes and reads
//! checkpoints of whole tensors in the `Trainer`'s format, so a run continues on either
//! engine, any number of stages and any number of replicas.

use std::sync::Arc;

use super::checkpoint::{self, Checkpoint};
use super::loss_scaler::{LossScaler, StepDecision};
use super::trainer::{
    precision, read_states, save_states, watch_divergence, StepStats, TrainerState,
};
use crate::models::{MicroBatch, Model, ModelStateBytes, NetworkOptions, ParamState};
use crate::parallel::pipeline::{replicas, Pipeline, StepOptions, StepReport};
use crate::parallel::pipeline_partition::PartitionMethod;
use crate::{Device, Error, Result, TrainConfig};

/// A model trained as a pipeline under a training config.
pub struct PipelineTrainer {
    pipe: Pipeline,
    /// Per device, the model states it holds.
    memory: Vec<ModelStateBytes>,
    config: TrainConfig,
    scaler: LossScaler,
    /// Steps attempted (applied + skipped).
    steps: u64,
    last: Option<StepReport>,
    /// The divergence watch's counters (see `Trainer`'s): skips in a row, and steps in
    /// a row at the dynamic scaler's minimum.
    watch: (u64, u64),
}

impl PipelineTrainer {
    /// Builds `model` over `devs` in `stages` stages (cut by `method`), as
    /// `devs.len() / stages` replicas: device `s * dp + r` runs stage `s` of replica
    /// `r`. `config` gives the micro-batch, precision, optimizer and ZeRO stage, and
    /// must be resolved for dp data-parallel ranks; `seed` fixes the weights as it does
    /// for one device.
    pub fn new(
        devs: Vec<Box<dyn Device>>,
        model: Arc<dyn Model>,
        config: TrainConfig,
        seed: u64,
        method: &PartitionMethod,
        stages: usize,
    ) -> Result<PipelineTrainer> {
        let dp = replicas(devs.len(), stages)?;
        // Activation checkpointing is the model recorded with its blocks recomputed;
        // each stage recomputes the ranges it holds.
        let model: Arc<dyn Model> = match config.activation_checkpointing {
            Some(every) => Arc::new(crate::models::checkpointed::Checkpointed::new(
                model, every,
            )?),
            None => model,
        };
        if config.batch.world != dp {
            return Err(Error::InvalidArgument(format!(
                "the config was resolved for {} data-parallel ranks, but {} devices in \
                 {stages} pipeline stages make {dp} replicas; resolve it with {dp} (the \
                 devices divided by the stages)",
                config.batch.world,
                devs.len()
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
        let zero = u32::from(config.zero.stage);
        let offload = config.zero.offload_optimizer;
        let memory = model_states(
            model.as_ref(),
            &options,
            method,
            (stages, dp),
            (zero, offload),
        )?;
        let pipe = Pipeline::replicated(devs, model, &options, method, stages, zero, offload)?;
        Ok(PipelineTrainer {
            pipe,
            memory,
            config,
            scaler,
            steps: 0,
            last: None,
            watch: (0, 0),
        })
    }

    /// One optimizer step over `gradient_accumulation_steps` micro-batches per
    /// replica, given in the data loader's order (replica `r` takes the `r`-th run of
    /// them, as data-parallel rank `r` does): the schedule's learning rate, the
    /// scaler's loss scale and the config's clipping; the scaler then decides on the
    /// pipeline's overflow flag.
    pub fn step(&mut self, micro: &[MicroBatch]) -> Result<StepStats> {
        let m = self.config.batch.grad_accum;
        let dp = self.pipe.replicas();
        if micro.len() != m * dp {
            let per = if dp == 1 {
                String::new()
            } else {
                format!(" per replica × {dp} replicas")
            };
            return Err(Error::InvalidArgument(format!(
                "a step takes gradient_accumulation_steps = {m} micro-batches (the \
                 pipeline's m){per}, got {}",
                micro.len()
            )));
        }
        let applied = u64::from(self.pipe.steps_applied());
        let lr = self.config.schedule.lr_at(applied);
        let loss_scale = self.scaler.scale();
        let o = StepOptions {
            loss_scale,
            clip: self.config.gradient_clipping,
            lr,
        };
        let r = self.pipe.step(micro, o)?;
        self.steps += 1;
        let decision = self
            .scaler
            .update(r.overflow)
            .map_err(|e| Error::Diverged {
                step: self.steps,
                detail: match e {
                    Error::InvalidArgument(m) => m,
                    other => other.to_string(),
                },
            })?;
        debug_assert_eq!(decision == StepDecision::Skip, r.overflow);
        watch_divergence(
            (&mut self.watch.0, &mut self.watch.1),
            self.steps,
            &self.scaler,
            &self.config,
            (r.overflow, loss_scale),
        )?;
        let stats = StepStats {
            loss: r.loss,
            lr,
            loss_scale,
            skipped: r.overflow,
            applied: u64::from(self.pipe.steps_applied()),
        };
        self.last = Some(r);
        Ok(stats)
    }

    /// The pipeline: stages, copies, memory, weights.
    pub fn pipeline(&self) -> &Pipeline {
        &self.pipe
    }

    /// Sets the frozen weights (a LoRA run's base) on every stage
    /// ([`Pipeline::set_frozen`]); the trained parameters and the optimizer state stay.
    pub fn set_frozen(&mut self, weights: &[crate::device::host::HostTensor]) -> Result<()> {
        self.pipe.set_frozen(weights)
    }

    /// Per device (stage-major, as [`PipelineTrainer::new`] takes them), the model
    /// states it holds.
    pub fn model_state_bytes(&self) -> Vec<ModelStateBytes> {
        self.memory.clone()
    }

    /// The last step's pipeline report (measured bubble, bytes moved).
    pub fn last_report(&self) -> Option<&StepReport> {
        self.last.as_ref()
    }

    /// Every parameter's training state as whole tensors (what a checkpoint holds).
    pub fn param_states(&self) -> Result<Vec<ParamState>> {
        self.pipe.param_states()
    }

    /// The loss scaler (its scale follows the overflows).
    pub fn scaler(&self) -> &LossScaler {
        &self.scaler
    }

    /// The config the pipeline trains under.
    pub fn config(&self) -> &TrainConfig {
        &self.config
    }

    /// Steps skipped in a row up to the last one (0 after an applied step).
    pub fn consecutive_skips(&self) -> u64 {
        self.watch.0
    }

    /// The counters and scaler a checkpoint holds (as `Trainer::state`).
    pub fn state(&self) -> TrainerState {
        TrainerState {
            steps: self.steps,
            applied: u64::from(self.pipe.steps_applied()),
            scaler: self.scaler.clone(),
            consecutive_skips: self.watch.0,
            steps_at_min_scale: self.watch.1,
        }
    }

    /// Mean loss of `batch` and every row's predicted class, no update (evaluation).
    pub fn predict(&self, batch: &MicroBatch) -> Result<(f64, Vec<u32>)> {
        self.pipe.predict(batch)
    }

    /// Writes a checkpoint in the format `Trainer::save_checkpoint` writes (whole
    /// tensors under the model's names, the counters under `"trainer"`, the caller's
    /// `state` keys beside them): it resumes on one device, data-parallel, or another
    /// number of stages.
    pub fn save_checkpoint(
        &self,
        run_dir: &std::path::Path,
        step: u64,
        state: serde_json::Map<String, serde_json::Value>,
        keep: usize,
    ) -> checkpoint::Result<checkpoint::Saved> {
        let states = self.param_states()?;
        save_states(run_dir, step, states, &self.state(), state, keep)
    }

    /// Restores a checkpoint any engine wrote (`Trainer` or `PipelineTrainer`, any
    /// topology) into every stage; returns the manifest's state, the caller's keys
    /// included. A checkpoint of another model or precision is an error naming the
    /// tensor.
    pub fn load_checkpoint(&mut self, ck: &Checkpoint) -> checkpoint::Result<serde_json::Value> {
        let trainer = TrainerState::from_checkpoint(ck)?;
        let applied = trainer.check(&self.scaler)?;
        let specs = self.pipe.model().parameters();
        let (dtype, _) = precision(&self.config)?;
        // The frozen weights (a LoRA run's base) are not in checkpoints.
        let states = read_states(ck, specs.iter().filter(|s| !s.frozen), dtype)?;
        self.pipe.load_param_states(&states, applied)?;
        self.steps = trainer.steps;
        self.scaler = trainer.scaler;
        self.watch = (trainer.consecutive_skips, trainer.steps_at_min_scale);
        Ok(ck.state().clone())
    }
}

/// Per device (stage-major), the model states of `stages` stages in `dp` replicas:
/// ZeRO 1 and 2 leave each replica a 1/dp shard of its stage's optimizer state (to
/// within one element's rounding), in host memory when `offload`ed; under 2 a stage's
/// alike blocks share one set of gradient buffers.
fn model_states(
    model: &dyn Model,
    options: &NetworkOptions,
    method: &PartitionMethod,
    (stages, dp): (usize, usize),
    (zero, offload): (u32, bool),
) -> Result<Vec<ModelStateBytes>> {
    let sharded = zero >= 1 && dp > 1;
    Ok(Pipeline::memory(model, options, method, stages)?
        .iter()
        .flat_map(|m| {
            let bytes = ModelStateBytes {
                weights: m.weights + m.frozen,
                gradients: if zero == 2 && dp > 1 {
                    m.shared_gradients
                } else {
                    m.gradients
                },
                optimizer: match (sharded, offload) {
                    (true, false) => m.optimizer.div_ceil(dp as u64),
                    (true, true) => 0,
                    (false, _) => m.optimizer,
                },
                offloaded: match (sharded, offload) {
                    (true, true) => m.optimizer.div_ceil(dp as u64),
                    _ => 0,
                },
            };
            std::iter::repeat_n(bytes, dp)
        })
        .collect())
}
