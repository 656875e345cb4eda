//! How to open a GPU device, for either backend.

/// How to open a device.
#[derive(Clone, Debug, Default)]
pub struct DeviceOptions {
    /// Use the packed-f16 kernels even if the adapter computes in f16 natively
    /// (to test that path, or to work around a driver bug).
    pub disable_f16: bool,
    /// Open the device with this per-binding limit (`max_storage_buffer_binding_size`)
    /// instead of the adapter's, when smaller: kernels that split operands over the
    /// limit are tested this way with megabytes instead of gigabytes.
    pub max_storage_binding: Option<u64>,
    /// Open the device without GPU timestamp queries, as on an adapter that lacks them
    /// (the profiler's host-only fallback is tested this way).
    pub disable_timestamps: bool,
    /// Keep compiled pipelines here across runs instead of in the user cache
    /// directory (`$KILN_CACHE_DIR/pipelines`, else `~/.cache/kiln/pipelines`).
    pub pipeline_cache_dir: Option<std::path::PathBuf>,
    /// Compile every pipeline from source, reading and writing no pipeline cache.
    pub no_pipeline_cache: bool,
    /// Keep the planner's table of GEMM blocks instead of timing candidates at a
    /// shape's first use (`KILN_GEMM_TUNE=0` does the same).
    pub no_tune: bool,
    /// The device memory a run may use, in bytes, in place of what the driver reports
    /// (its budget, else its device-local heap); a run over it is refused at start.
    /// Less, to leave room for other work on a shared GPU or to check a run against a
    /// smaller device; more, where the driver keeps device memory elsewhere (lavapipe
    /// holds it in host memory, whatever heap it reports).
    pub memory_limit: Option<u64>,
}

/// `KILN_PLAN_AS_GPU=1`: every CPU driver (lavapipe, llvmpipe) a process opens is
/// planned for as a GPU. Its capabilities name it a [`PLANNED_AS_GPU`] device, so the
/// planners pick the GPU-class kernels (the tiled GEMM and its SPIR-V twins, the GEMV,
/// the GPU attention plan) and nothing CPU-class (no measured blocks, no primer): a
/// GPU's routing seen without one, for the tests `scripts/gpu-check.sh` runs on a GPU.
pub const PLAN_AS_GPU_ENV: &str = "KILN_PLAN_AS_GPU";

/// The device type a CPU driver reports under [`PLAN_AS_GPU_ENV`].
pub const PLANNED_AS_GPU: &str = "cpu planned as a gpu";

/// `caps` as the planners are to see them (see [`PLAN_AS_GPU_ENV`]).
pub fn planned(mut caps: kiln_engine::Capabilities) -> kiln_engine::Capabilities {
    let on = std::env::var(PLAN_AS_GPU_ENV).is_ok_and(|v| !matches!(v.trim(), "" | "0"));
    if on && caps.device_type == "cpu" {
        caps.device_type = PLANNED_AS_GPU.into();
    }
    caps
}
