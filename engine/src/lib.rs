//! Kiln's backend-independent core.
//!
//! Everything above the device contract ([`device::Device`]) is generic over it:
//! a backend implements that one small trait and the rest of the engine runs on it.

pub mod config;
pub mod data;
pub mod device;
pub mod error;
pub mod fsutil;
pub mod graph;
pub mod models;
pub mod parallel;
pub mod partition;
pub mod rng;
pub mod train;

pub use config::{ConfigError, TrainConfig};
pub use device::dtype::DType;
pub use device::host::HostData;
pub use device::kernels::{
    self as kernels, ActivationKind, AdamStep, BinaryOp, HeadsLayout, Kernel, Matmul, ReduceOp,
    SgdStep, ATTENTION_MAX_DIM, IGNORE_TARGET,
};
pub use device::optim::Optimizer;
pub use device::{Buffer, Capabilities, Device, PendingDownload, RopeFreqs, RopeScaling};
pub use error::{Error, Result};
pub use train::loss_scaler::{DynamicScaling, LossScaler, StepDecision};
