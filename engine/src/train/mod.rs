//! Training machinery above the models: the engine that steps a model (`trainer`), the
//! fp16 loss scaler, checkpoints, safetensors I/O and the run ledger.

pub mod checkpoint;
mod fsutil;
pub mod loss_scaler;
pub mod runs;
pub mod safetensors_io;
pub mod trainer;
