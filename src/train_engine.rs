//! What `kiln train`'s loop drives: the data-parallel [`Trainer`] (one device or
//! several, one process or several) or a [`PipelineTrainer`] (a model split into
//! stages). One loop serves both: it asks this for a step, an evaluation and a
//! checkpoint, and both write and read the same checkpoint format.

use std::path::Path;

use kiln_engine::models::{MicroBatch, ModelStateBytes};
use kiln_engine::parallel::pipeline::StepReport;
use kiln_engine::train::checkpoint::{self, Checkpoint};
use kiln_engine::train::loss_scaler::LossScaler;
use kiln_engine::train::pipeline_trainer::PipelineTrainer;
use kiln_engine::train::trainer::{CommStats, StepStats, Trainer};
use kiln_engine::Device;

/// The engine a run trains with, owning its devices.
pub(crate) enum Engine {
    /// One model per device, gradients averaged (one device: no exchange).
    Data {
        trainer: Box<Trainer>,
        devs: Vec<Box<dyn Device>>,
    },
    /// One model cut into stages, one device per stage and replica; `memory`: each
    /// device's model states (stage-major).
    Pipeline {
        trainer: Box<PipelineTrainer>,
        memory: Vec<ModelStateBytes>,
    },
}

impl Engine {
    /// The devices, in rank (or stage) order.
    pub(crate) fn devices(&self) -> Vec<&dyn Device> {
        match self {
            Engine::Data { devs, .. } => devs.iter().map(|d| d.as_ref()).collect(),
            Engine::Pipeline { trainer: p, .. } => {
                p.pipeline().devices().iter().map(|d| d.as_ref()).collect()
            }
        }
    }

    /// One optimizer step: `micro[r]` are data-parallel rank r's micro-batches (a
    /// pipeline replica is one rank).
    pub(crate) fn step(&mut self, micro: &[Vec<MicroBatch>]) -> kiln_engine::Result<StepStats> {
        match self {
            Engine::Data { trainer, devs } => {
                let devs: Vec<&dyn Device> = devs.iter().map(|d| d.as_ref()).collect();
                trainer.step_group(&devs, micro)
            }
            // Replica r takes the r-th run of m micro-batches, as rank r reads them.
            Engine::Pipeline { trainer: p, .. } => p.step(&micro.concat()),
        }
    }

    /// The last step's gradient exchange (none in a pipeline of one replica).
    pub(crate) fn comm(&self) -> CommStats {
        match self {
            Engine::Data { trainer, .. } => trainer.last_comm,
            Engine::Pipeline { .. } => CommStats::default(),
        }
    }

    /// A pipeline's last step: its measured waits and the bytes sent between stages.
    pub(crate) fn pipeline_report(&self) -> Option<&StepReport> {
        match self {
            Engine::Data { .. } => None,
            Engine::Pipeline { trainer: p, .. } => p.last_report(),
        }
    }

    /// Mean loss and predicted classes of one micro-batch, no update.
    pub(crate) fn predict(&self, batch: &MicroBatch) -> kiln_engine::Result<(f64, Vec<u32>)> {
        match self {
            Engine::Data { trainer, devs } => trainer.model.predict(devs[0].as_ref(), batch),
            Engine::Pipeline { trainer: p, .. } => p.predict(batch),
        }
    }

    pub(crate) fn scaler(&self) -> &LossScaler {
        match self {
            Engine::Data { trainer, .. } => &trainer.scaler,
            Engine::Pipeline { trainer: p, .. } => p.scaler(),
        }
    }

    pub(crate) fn consecutive_skips(&self) -> u64 {
        match self {
            Engine::Data { trainer, .. } => trainer.consecutive_skips(),
            Engine::Pipeline { trainer: p, .. } => p.consecutive_skips(),
        }
    }

    /// Steps attempted so far (a resumed run's included).
    pub(crate) fn steps(&self) -> u64 {
        match self {
            Engine::Data { trainer, .. } => trainer.state().steps,
            Engine::Pipeline { trainer: p, .. } => p.state().steps,
        }
    }

    /// Per device, the model states it holds.
    pub(crate) fn model_state_bytes(&self) -> Vec<ModelStateBytes> {
        match self {
            Engine::Data { trainer, devs } => (0..devs.len())
                .map(|r| trainer.model_state_bytes(r))
                .collect(),
            Engine::Pipeline { memory, .. } => memory.clone(),
        }
    }

    /// Writes a checkpoint (whole tensors, the engine's counters, the caller's
    /// `state` keys) that either engine resumes.
    pub(crate) fn save_checkpoint(
        &self,
        dir: &Path,
        step: u64,
        state: serde_json::Map<String, serde_json::Value>,
        keep: usize,
    ) -> checkpoint::Result<checkpoint::Saved> {
        match self {
            Engine::Data { trainer, devs } => {
                let devs: Vec<&dyn Device> = devs.iter().map(|d| d.as_ref()).collect();
                trainer.save_checkpoint(&devs, dir, step, state, keep)
            }
            Engine::Pipeline { trainer: p, .. } => p.save_checkpoint(dir, step, state, keep),
        }
    }

    /// Restores a checkpoint either engine wrote, on any topology.
    pub(crate) fn load_checkpoint(
        &mut self,
        ck: &Checkpoint,
    ) -> checkpoint::Result<serde_json::Value> {
        match self {
            Engine::Data { trainer, devs } => {
                let devs: Vec<&dyn Device> = devs.iter().map(|d| d.as_ref()).collect();
                trainer.load_checkpoint(&devs, ck)
            }
            Engine::Pipeline { trainer: p, .. } => p.load_checkpoint(ck),
        }
    }
}
