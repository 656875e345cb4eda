//! Kiln's backend-independent core.
//!
//! Everything above the device contract ([`device::Device`]) is generic over it:
//! a backend implements that one small trait and the rest of the engine runs on it.

pub mod checkpoint;
pub mod config;
pub mod data;
pub mod device;
pub mod dtype;
pub mod error;
mod fsutil;
pub mod gpt;
pub mod graph;
pub mod host;
pub mod kernel;
pub mod loss_scaler;
pub mod matmul;
pub mod mlp;
pub mod optim;
pub mod runs;
pub mod safetensors_io;
pub mod trainer;
pub mod zero;

pub use config::{ConfigError, TrainConfig};
pub use device::{Buffer, Capabilities, Device, PendingDownload};
pub use dtype::DType;
pub use error::{Error, Result};
pub use host::HostData;
pub use kernel::{
    Activation, BinaryOp, HeadsLayout, Kernel, ReduceOp, ATTENTION_MAX_DIM, IGNORE_TARGET,
};
pub use loss_scaler::{DynamicScaling, LossScaler, StepDecision};
pub use matmul::Matmul;
pub use optim::{AdamStep, Optimizer, SgdStep};
