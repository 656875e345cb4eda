//! Kiln's backend-neutral lowering, shared by the wgpu and raw Vulkan backends: how each
//! engine `Kernel` becomes dispatches of the hand-written WGSL kernels in `shaders/`
//! (written once against [`Recorder`]), the GEMM and attention planners, WGSL assembly
//! per dtype, and the on-disk pipeline cache's format. A backend supplies a `Recorder`
//! and its own device code; nothing here knows wgpu or Vulkan.
//!
//! The files import in one direction (the workspace's `tests/import_cycles.rs`), lowest
//! first: `shader`, `options`; `dispatch`; `gemm_plan`, `pipeline_cache`;
//! `gemm_select`, `recorder`; `gemm`, `attention`; `launch`.

mod attention;
mod dispatch;
mod gemm;
mod gemm_plan;
/// Measured GEMM selection: what is timed, the budget, and the winners file.
pub mod gemm_select;
mod launch;
mod options;
/// The on-disk pipeline cache file format and place, shared by both backends.
pub mod pipeline_cache;
mod recorder;
pub mod shader;

pub use attention::{
    geometry as attention_geometry, launches as attention_launches, plan as plan_attention,
    stand_in as attention_stand_in, AttentionLaunch, AttentionPass, AttentionPlan,
};
pub use dispatch::{
    band_partials_bytes, scratch_bytes, Dispatch, Readiness, BAND_PARTIALS_ID, DUMMY_BYTES,
    DUMMY_ID, PARTIALS_ID, SCRATCH_ID,
};
pub use gemm::{
    record_matmul, record_whole, split_finish, split_partial_bytes, split_partials, whole_dispatch,
};
pub use gemm_plan::{
    ladder_of, plan as plan_matmul, stand_in as gemm_stand_in, MatmulPlan, MatmulVariant,
    CPU_LADDER, GPU_LADDER, SLOW_ROWS,
};
pub use launch::record_kernel;
pub use options::{planned, DeviceOptions, PLANNED_AS_GPU, PLAN_AS_GPU_ENV};
pub use recorder::Recorder;

/// A fingerprint of every kernel source in `shaders/` (pipeline caches are keyed by it).
pub const SHADER_HASH: &str = env!("KILN_SHADER_HASH");
