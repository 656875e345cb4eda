//! Training machinery above the models: the engine that steps a model (`trainer`) or
//! a pipeline of it (`pipeline_trainer`), the one contract both meet (`engine`), the
//! fp16 loss scaler, checkpoints, evaluation (`evaluate`: the loss over trained
//! targets), the profiler's trace and the run ledger.

pub mod checkpoint;
pub mod engine;
pub mod evaluate;
pub mod loss_scaler;
pub mod pipeline_trainer;
pub mod profile;
pub mod runs;
#[cfg(feature = "chart")]
pub mod runs_chart;
pub mod source;
pub mod trainer;
