//! Kiln: mixed-precision neural network training on any GPU, through WebGPU and Vulkan.
//!
//! The engine ([`engine`]) is generic over one small device contract
//! ([`engine::Device`]); [`cpu`] is the reference backend and [`wgpu`] reaches every
//! adapter wgpu can open; [`vulkan`] is the raw Vulkan backend (`vk:N`) running the same
//! kernels as SPIR-V. [`open_device`] turns a device spec into a device.

pub use kiln_cpu as cpu;
pub use kiln_engine as engine;
pub use kiln_vulkan as vulkan;
pub use kiln_wgpu as wgpu;

pub mod bench;
pub mod bench_dp;
pub mod bench_pipeline;
pub mod bench_report;
pub mod bench_sample;
pub mod bench_train;
pub mod devices;
pub mod estimate;
pub mod eval;
pub mod export;
pub mod init_from;
pub mod profile;
pub mod sample;
pub mod say;
pub mod template;
pub mod train;

pub use devices::{open_device, DeviceSpec};
