//! Kiln's WebGPU backend: every adapter wgpu can reach (Vulkan, Metal, DX12, GL),
//! running the hand-written WGSL kernels in `shaders/` as `kiln-lowering` lowers them.

mod adapter;
mod context;
mod device;
mod gemm_timing;
mod peak;
mod pinned_matmul;
/// wgpu's pipeline cache kept on disk (`kiln_lowering::pipeline_cache`'s format).
mod pipeline_cache;
mod primer;
mod profile;
mod spirv;
mod timestamps;
/// Measured GEMM block selection on CPU-class adapters (`KILN_GEMM_TUNE`).
mod tune;

pub use adapter::{adapters, find_adapter, AdapterSummary, NO_ADAPTER_HINT};
pub use device::WgpuDevice;
// The planners live in the shared lowering; named here too, as the wgpu backend's API
// for benchmarks and tests that pin a kernel.
/// The measured GEMM selection (its budget, threshold and winners file), shared with vk.
pub use kiln_lowering::gemm_select;
pub use kiln_lowering::{
    attention_geometry, attention_launches, plan_attention, plan_matmul, AttentionLaunch,
    AttentionPass, AttentionPlan, DeviceOptions, MatmulPlan, MatmulVariant, GPU_LADDER,
    PLANNED_AS_GPU, PLAN_AS_GPU_ENV,
};
pub use peak::Peak;
pub use spirv::{SpirvGemm, SpirvMatmul, SpirvTile};
