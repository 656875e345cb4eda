//! Kiln's raw Vulkan backend, on `ash`: the same [`kiln_engine::Device`] contract as
//! the wgpu backend, with Vulkan's own memory (gpu-allocator), push descriptors,
//! timeline semaphores and a pipeline cache. Its kernels are the WGSL sources in
//! `shaders/`, assembled per launch exactly as for wgpu and translated to SPIR-V by
//! naga, and the kernel -> dispatch lowering is the one `kiln-lowering` holds for both
//! backends ([`kiln_lowering::record_kernel`]), so both run one op set from one source.
//!
//! Devices are named `vk:N` (the N-th Vulkan physical device, deduplicated by its
//! device UUID), beside wgpu's `vulkan:N`, so the two host APIs can be compared on
//! one GPU and mixed in one device group.

mod attention;
pub mod coopmat;
mod device;
mod gemm;
mod instance;
mod primer;
mod spirv;

pub use coopmat::{CoopMat, CoopMatPlan, CoopMatShape};
pub use device::VkDevice;
pub use gemm::{GemmRoute, GpuGemmPlan, GpuKernel, SpirvGemmPlan};
pub use instance::{physical_devices, VkSummary, NO_VULKAN_HINT};
