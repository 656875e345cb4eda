//! Kiln's WebGPU backend: every adapter wgpu can reach (Vulkan, Metal, DX12, GL),
//! running the hand-written WGSL kernels in `shaders/`.

mod adapter;
mod attention;
mod context;
mod device;
mod launch;
pub mod lower;
mod matmul;
mod peak;
/// The on-disk pipeline cache file format and place, shared with the raw Vulkan backend.
pub mod pipeline_cache;
mod primer;
mod profile;
pub mod shader;
mod spirv;
/// Measured GEMM block selection on CPU-class adapters (`KILN_GEMM_TUNE`).
pub mod tune;

pub use adapter::{adapters, find_adapter, AdapterSummary, DeviceOptions, NO_ADAPTER_HINT};
pub use attention::{
    geometry as attention_geometry, launches as attention_launches, plan as plan_attention,
    AttentionLaunch, AttentionPass, AttentionPlan,
};
pub use device::WgpuDevice;
pub use matmul::{
    plan as plan_matmul, split_finish, split_partial_bytes, split_partials,
    stand_in as gemm_stand_in, MatmulPlan, MatmulVariant,
};
pub use peak::Peak;
pub use primer::mesa_cache_on;
pub use spirv::{SpirvGemm, SpirvMatmul, SpirvTile};

/// A fingerprint of every kernel source in `shaders/` (pipeline caches are keyed by it).
pub const SHADER_HASH: &str = env!("KILN_SHADER_HASH");
