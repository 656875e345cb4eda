//! The measured GEMM selection (`kiln_lowering::gemm_select`) on wgpu: where a
//! device's winners file lives, keyed as its pipeline cache is.

use std::path::PathBuf;

use kiln_lowering::gemm_select::{enabled_by_env, Tuner};
use kiln_lowering::pipeline_cache;

/// The winners file's path and key for an adapter planned as `planned_type` (the
/// device type the planners see: a CPU driver under `KILN_PLAN_AS_GPU` keeps its tiles
/// apart from its blocks), under the pipeline cache's directory (`None`: no cache
/// directory).
pub(crate) fn file_for(
    info: &wgpu::AdapterInfo,
    options: &kiln_lowering::DeviceOptions,
    planned_type: &str,
) -> Option<(PathBuf, u64)> {
    let key = crate::pipeline_cache::key(info) ^ pipeline_cache::fnv(planned_type.as_bytes());
    let dir = pipeline_cache::dir(options)?;
    Some((dir.join(format!("{key:016x}.gemm")), key))
}

/// The tuner of a device of `info` planned as `planned_type`: on unless
/// `KILN_GEMM_TUNE=0` (`--no-tune`), with the winners of earlier runs.
pub(crate) fn open(
    info: &wgpu::AdapterInfo,
    options: &kiln_lowering::DeviceOptions,
    planned_type: &str,
) -> Tuner {
    let enabled = !options.no_tune && enabled_by_env();
    Tuner::open(enabled, file_for(info, options, planned_type))
}
