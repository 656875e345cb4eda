//! One contract for what trains a model, whatever its topology: a [`DataParallel`]
//! group (one device or several, one process or several) or a [`PipelineTrainer`]
//! (the model cut into stages). A training loop (the CLI's, an app's) holds a
//! `Box<dyn TrainingEngine>` and asks it for steps, evaluations and checkpoints; both
//! write and read the same checkpoint format, so a run may resume on the other.

use std::path::Path;

use serde_json::{Map, Value};

use super::checkpoint::{self, Checkpoint};
use super::loss_scaler::LossScaler;
use super::pipeline_trainer::PipelineTrainer;
use super::trainer::{CommStats, StepStats, Trainer};
use crate::device::host::HostTensor;
use crate::models::{MicroBatch, ModelStateBytes};
use crate::parallel::pipeline::StepReport;
use crate::{Device, Result};

/// A model being trained on its devices.
pub trait TrainingEngine {
    /// The devices, in rank order (a pipeline's stage-major: device `s * dp + r` runs
    /// stage `s` of replica `r`).
    fn devices(&self) -> Vec<&dyn Device>;

    /// One optimizer step: `micro[r]` are data-parallel rank `r`'s micro-batches (a
    /// pipeline replica is one rank).
    fn step(&mut self, micro: &[Vec<MicroBatch>]) -> Result<StepStats>;

    /// The last step's gradient exchange between data-parallel ranks.
    fn comm(&self) -> CommStats;

    /// A pipeline's last step: its measured waits and the bytes sent between stages.
    fn pipeline_report(&self) -> Option<&StepReport>;

    /// Mean loss and every row's predicted class of one micro-batch, no update.
    fn predict(&self, batch: &MicroBatch) -> Result<(f64, Vec<u32>)>;

    /// The loss scaler (its scale follows the overflows).
    fn scaler(&self) -> &LossScaler;

    /// Steps skipped in a row up to the last one (0 after an applied step).
    fn consecutive_skips(&self) -> u64;

    /// Steps attempted so far (a resumed run's included).
    fn steps(&self) -> u64;

    /// Per device, the model states it holds.
    fn model_state_bytes(&self) -> Vec<ModelStateBytes>;

    /// Writes a checkpoint (whole tensors, the engine's counters, the caller's `state`
    /// keys) that either engine resumes, keeping the newest `keep`.
    fn save_checkpoint(
        &self,
        run_dir: &Path,
        step: u64,
        state: Map<String, Value>,
        keep: usize,
    ) -> checkpoint::Result<checkpoint::Saved>;

    /// Restores a checkpoint either engine wrote, on any topology; returns its state.
    fn load_checkpoint(&mut self, ck: &Checkpoint) -> checkpoint::Result<Value>;
}

/// The devices as the trainers take them.
fn refs(devs: &[Box<dyn Device>]) -> Vec<&dyn Device> {
    devs.iter().map(|d| d.as_ref()).collect()
}

/// A [`Trainer`] with the devices it runs on: one replica per device.
pub struct DataParallel {
    pub trainer: Trainer,
    devs: Vec<Box<dyn Device>>,
}

impl DataParallel {
    /// `trainer`, built over `devs` in this order.
    pub fn new(trainer: Trainer, devs: Vec<Box<dyn Device>>) -> DataParallel {
        DataParallel { trainer, devs }
    }

    /// Replaces every replica's weights ([`Trainer::set_weights`]): a fine-tune's start.
    pub fn set_weights(&mut self, weights: &[HostTensor]) -> Result<()> {
        self.trainer.set_weights(&refs(&self.devs), weights)
    }

    /// Sets every replica's frozen weights (a LoRA run's base; [`Trainer::set_frozen`]).
    pub fn set_frozen(&mut self, weights: &[HostTensor]) -> Result<()> {
        self.trainer.set_frozen(&refs(&self.devs), weights)
    }
}

impl TrainingEngine for DataParallel {
    fn devices(&self) -> Vec<&dyn Device> {
        refs(&self.devs)
    }

    fn step(&mut self, micro: &[Vec<MicroBatch>]) -> Result<StepStats> {
        self.trainer.step_group(&refs(&self.devs), micro)
    }

    fn comm(&self) -> CommStats {
        self.trainer.last_comm
    }

    fn pipeline_report(&self) -> Option<&StepReport> {
        None
    }

    fn predict(&self, batch: &MicroBatch) -> Result<(f64, Vec<u32>)> {
        self.trainer.model.predict(self.devs[0].as_ref(), batch)
    }

    fn scaler(&self) -> &LossScaler {
        &self.trainer.scaler
    }

    fn consecutive_skips(&self) -> u64 {
        self.trainer.consecutive_skips()
    }

    fn steps(&self) -> u64 {
        self.trainer.state().steps
    }

    fn model_state_bytes(&self) -> Vec<ModelStateBytes> {
        (0..self.devs.len())
            .map(|r| self.trainer.model_state_bytes(r))
            .collect()
    }

    fn save_checkpoint(
        &self,
        run_dir: &Path,
        step: u64,
        state: Map<String, Value>,
        keep: usize,
    ) -> checkpoint::Result<checkpoint::Saved> {
        self.trainer
            .save_checkpoint(&refs(&self.devs), run_dir, step, state, keep)
    }

    fn load_checkpoint(&mut self, ck: &Checkpoint) -> checkpoint::Result<Value> {
        self.trainer.load_checkpoint(&refs(&self.devs), ck)
    }
}

impl TrainingEngine for PipelineTrainer {
    fn devices(&self) -> Vec<&dyn Device> {
        refs(self.pipeline().devices())
    }

    /// Replica `r` takes the `r`-th run of micro-batches, as rank `r` reads them.
    fn step(&mut self, micro: &[Vec<MicroBatch>]) -> Result<StepStats> {
        PipelineTrainer::step(self, &micro.concat())
    }

    fn comm(&self) -> CommStats {
        CommStats::default()
    }

    fn pipeline_report(&self) -> Option<&StepReport> {
        self.last_report()
    }

    fn predict(&self, batch: &MicroBatch) -> Result<(f64, Vec<u32>)> {
        PipelineTrainer::predict(self, batch)
    }

    fn scaler(&self) -> &LossScaler {
        PipelineTrainer::scaler(self)
    }

    fn consecutive_skips(&self) -> u64 {
        PipelineTrainer::consecutive_skips(self)
    }

    fn steps(&self) -> u64 {
        self.state().steps
    }

    fn model_state_bytes(&self) -> Vec<ModelStateBytes> {
        PipelineTrainer::model_state_bytes(self)
    }

    fn save_checkpoint(
        &self,
        run_dir: &Path,
        step: u64,
        state: Map<String, Value>,
        keep: usize,
    ) -> checkpoint::Result<checkpoint::Saved> {
        PipelineTrainer::save_checkpoint(self, run_dir, step, state, keep)
    }

    fn load_checkpoint(&mut self, ck: &Checkpoint) -> checkpoint::Result<Value> {
        PipelineTrainer::load_checkpoint(self, ck)
    }
}
