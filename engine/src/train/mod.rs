//! Training machinery above the models: the engine that steps a model (`trainer`), the
//! fp16 loss scaler, checkpoints and the run ledger.

pub mod checkpoint;
pub mod loss_scaler;
pub mod pipeline_trainer;
pub mod profile;
pub mod runs;
pub mod trainer;
