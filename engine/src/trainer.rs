//! The training engine: a GPT built from a resolved [`TrainConfig`], stepped one
//! optimizer step at a time. It owns what DeepSpeed's engine owns — precision, loss
//! scaling, the learning-rate schedule, clipping, gradient accumulation — so that a
//! training loop is "get micro-batches, call `step`, log the stats".
//!
//! ```text
//! let mut engine = Trainer::new(dev, model_config, train_config, seq, seed)?;
//! let stats = engine.step(dev, &micro_batches)?;   // one optimizer step
//! ```

use serde::{Deserialize, Serialize};

use crate::config::{LossScaling, Precision as ConfigPrecision, TrainConfig};
use crate::gpt::{Attention, Gpt, GptConfig, GptTraining};
use crate::loss_scaler::LossScaler;
use crate::mlp::Precision;
use crate::{Device, Error, Result};

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
}

pub struct Trainer {
    pub model: Gpt,
    pub config: TrainConfig,
    steps: u64,
}

impl Trainer {
    /// Builds the model for `config`'s micro-batch and precision; `seq` is the trained
    /// sequence length (at most the model's `block_size`), `seed` fixes the weights.
    pub fn new(
        dev: &dyn Device,
        model: GptConfig,
        config: TrainConfig,
        seq: usize,
        seed: u64,
    ) -> Result<Trainer> {
        if config.batch.world != 1 {
            return Err(Error::InvalidArgument(format!(
                "the config was resolved for {} data-parallel ranks, but this engine drives one \
                 device; resolve it with world size 1",
                config.batch.world
            )));
        }
        let (precision, scaler) = match &config.precision {
            ConfigPrecision::Fp32 => (Precision::F32, LossScaler::fixed(1.0)?),
            ConfigPrecision::Bf16 => (Precision::BF16, LossScaler::fixed(1.0)?),
            ConfigPrecision::Fp16 { loss_scaling, .. } => (
                Precision::F16,
                match loss_scaling {
                    LossScaling::Dynamic(d) => LossScaler::dynamic(d.clone())?,
                    LossScaling::Static(s) => LossScaler::fixed(*s)?,
                },
            ),
        };
        let training = GptTraining {
            batch: config.batch.micro_batch,
            seq,
            precision,
            optimizer: config.optimizer.clone(),
            seed,
            attention: Attention::best(model.n_embd / model.n_head.max(1), precision),
        };
        let mut model = Gpt::new(dev, model, training)?;
        model.scaler = scaler;
        Ok(Trainer {
            model,
            config,
            steps: 0,
        })
    }

    /// One optimizer step over `gradient_accumulation_steps` micro-batches, each
    /// (tokens, next-token targets) of micro_batch × seq ids.
    pub fn step(&mut self, dev: &dyn Device, micro: &[(&[u32], &[u32])]) -> Result<StepStats> {
        let want = self.config.batch.grad_accum;
        if micro.len() != want {
            return Err(Error::InvalidArgument(format!(
                "a step takes gradient_accumulation_steps = {want} micro-batches, got {}",
                micro.len()
            )));
        }
        let applied = self.model.steps_applied() as u64;
        let lr = self.config.schedule.lr_at(applied);
        let s = self
            .model
            .step(dev, micro, lr, self.config.gradient_clipping)?;
        self.steps += 1;
        Ok(StepStats {
            loss: s.loss,
            lr,
            loss_scale: s.scale,
            skipped: s.skipped,
            applied: self.model.steps_applied() as u64,
        })
    }

    pub fn state(&self) -> TrainerState {
        TrainerState {
            steps: self.steps,
            applied: self.model.steps_applied() as u64,
            scaler: self.model.scaler.clone(),
        }
    }

    /// Restores counters and scaler saved by [`Trainer::state`] (the parameters are
    /// restored separately, see [`Gpt::load_param_states`]).
    pub fn restore(&mut self, state: &TrainerState) -> Result<()> {
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
        if std::mem::discriminant(&state.scaler) != std::mem::discriminant(&self.model.scaler) {
            return Err(Error::InvalidArgument(
                "checkpoint: its loss scaler (static vs dynamic) differs from this config's \
                 fp16 settings; resume with the config the run was started with"
                    .into(),
            ));
        }
        self.steps = state.steps;
        self.model.set_steps_applied(applied);
        self.model.scaler = state.scaler.clone();
        Ok(())
    }
}
