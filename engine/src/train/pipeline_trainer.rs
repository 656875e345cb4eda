//! The trainer's part for a pipeline ([`Pipeline`]): a DeepSpeed config's micro-batch,
//! precision, optimizer, learning-rate schedule, gradient clipping and loss scaler
//! driving one model split over several devices. The loss scaler sees the pipeline's
//! one overflow flag, so every stage skips or applies together.
//!
//! What `Trainer` adds beyond this (checkpoints with the trainer's counters, the
//! divergence watch, data-parallel replicas of the pipeline, ZeRO) is not wired here
//! yet; `param_states` gives whole tensors for a checkpoint.

use std::sync::Arc;

use super::loss_scaler::{LossScaler, StepDecision};
use super::trainer::{precision, StepStats};
use crate::models::{MicroBatch, Model, NetworkOptions, ParamState};
use crate::parallel::pipeline::{Pipeline, StepOptions, StepReport};
use crate::parallel::pipeline_partition::PartitionMethod;
use crate::{Device, Error, Result, TrainConfig};

/// A model trained as a pipeline under a training config.
pub struct PipelineTrainer {
    pipe: Pipeline,
    config: TrainConfig,
    scaler: LossScaler,
    /// Steps attempted (applied + skipped).
    steps: u64,
    last: Option<StepReport>,
}

impl PipelineTrainer {
    /// Builds `model` over `devs` (one stage each, cut by `method`) for `config`'s
    /// micro-batch, precision and optimizer; `seed` fixes the weights as it does for
    /// one device.
    pub fn new(
        devs: Vec<Box<dyn Device>>,
        model: Arc<dyn Model>,
        config: TrainConfig,
        seed: u64,
        method: &PartitionMethod,
    ) -> Result<PipelineTrainer> {
        let (dtype, scaler) = precision(&config)?;
        let options = NetworkOptions {
            batch: config.batch.micro_batch,
            dtype,
            optimizer: config.optimizer.clone(),
            seed,
        };
        let pipe = Pipeline::new(devs, model, &options, method)?;
        Ok(PipelineTrainer {
            pipe,
            config,
            scaler,
            steps: 0,
            last: None,
        })
    }

    /// One optimizer step over `gradient_accumulation_steps` micro-batches: the
    /// schedule's learning rate, the scaler's loss scale and the config's clipping; the
    /// scaler then decides on the pipeline's overflow flag.
    pub fn step(&mut self, micro: &[MicroBatch]) -> Result<StepStats> {
        let want = self.config.batch.grad_accum;
        if micro.len() != want {
            return Err(Error::InvalidArgument(format!(
                "a step takes gradient_accumulation_steps = {want} micro-batches (the \
                 pipeline's m), got {}",
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
}
