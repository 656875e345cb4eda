//! A wgpu device behind Kiln's device contract: the device and its state (here), and
//! a file per concern: opening (`open.rs`), the buffers behind handles (`buffers.rs`),
//! building one pipeline (`pipelines.rs`), building a plan's pipelines ahead on worker
//! threads (`compile_queue.rs`), recording a dispatch (`dispatch.rs`), the lowering's
//! `Recorder` (`recorder.rs`) and the `Device` contract (`contract.rs`).
//!
//! Resource lifetimes, explicitly:
//! - buffers live in `State::buffers` from `alloc` to `free`;
//! - pipelines and bind-group layouts are created on first use and kept for the
//!   device's life; bind groups are cached per (pipeline, buffers) and dropped when
//!   one of their buffers is freed;
//! - launches are recorded into one open command encoder (the stream); their
//!   parameters go into a uniform arena, bound with dynamic offsets and written once
//!   per submit, so a step of N launches is one `queue.submit`, not N. How each kernel
//!   becomes dispatches is the shared lowering's (`kiln-lowering`; `recorder.rs` is
//!   its `Recorder`).

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard};

use kiln_engine::device::compiling::{self, log_enabled as compile_log};
use kiln_engine::device::profile::{span, SpanKind};
use kiln_engine::device::{check_alloc, check_upload, check_view, KernelTiming};
use kiln_engine::{
    Buffer, Capabilities, DType, Device, Error, HostData, Kernel, PendingDownload, Result,
};

use kiln_lowering::pipeline_cache::mesa_cache_on;
use kiln_lowering::shader::{self, Access, KernelSource, Repr};
use kiln_lowering::{
    band_partials_bytes, scratch_bytes, DeviceOptions, Dispatch, Readiness, Recorder,
    BAND_PARTIALS_ID, DUMMY_BYTES, DUMMY_ID, PARTIALS_ID, SCRATCH_ID,
};

use crate::adapter::{capabilities, raw_adapters};
use crate::context::{self, Broken, ContextLock, Guarded};
use crate::primer::{Prime, Primer};

mod buffers;
mod compile_queue;
mod contract;
mod dispatch;
mod open;
mod pipelines;
mod recorder;

/// Bytes of the largest launch parameters (`shaders/common/matmul_params.wgsl`).
const PARAMS_MAX: u64 = shader::MATMUL_PARAMS_SIZE;

/// Launches whose parameters fit one arena; past that the stream is submitted early.
const ARENA_SLOTS: u64 = 4096;

pub struct WgpuDevice {
    pub(crate) caps: Capabilities,
    /// The adapter's GL context lock (GL only), taken around every call that can reach
    /// the driver (`context.rs`).
    context: ContextLock,
    /// Set when wgpu panicked in a call: every later call fails with `failure`.
    broken: Broken,
    failure: std::sync::OnceLock<String>,
    pub(crate) device: Guarded<wgpu::Device>,
    pub(crate) queue: Guarded<wgpu::Queue>,
    /// Alignment of dynamic uniform offsets.
    arena_stride: u64,
    arena: Guarded<wgpu::Buffer>,
    /// Partials of a reduction's first pass; also bound where a kernel's optional
    /// operand is absent.
    pub(crate) scratch: Guarded<wgpu::Buffer>,
    /// Partials of a reduction over a buffer bound band by band (each band's first
    /// pass writes its own REDUCE_GROUPS of them).
    pub(crate) band_partials: Guarded<wgpu::Buffer>,
    /// Bound read-only where a kernel's optional input is absent (a buffer may not be
    /// bound both read-only and writable in one dispatch, so it cannot be `scratch`).
    pub(crate) dummy: Guarded<wgpu::Buffer>,
    /// Validation errors wgpu reports out of band; checked at submit.
    errors: Arc<Mutex<Vec<String>>>,
    state: Guarded<Mutex<State>>,
    /// `KILN_PROFILE=1`: each launch is submitted and waited for alone, its wall time
    /// added up per kernel; the table is printed when the device is dropped. Slows
    /// everything down (no batching), so it is for finding hot spots, not for totals.
    profile: Option<Mutex<HashMap<String, (u32, f64)>>>,
    /// Compiled pipelines kept across runs, where the backend supports it.
    disk_cache: Option<Arc<crate::pipeline_cache::DiskCache>>,
    built: Guarded<Built>,
    /// Where this device was opened and how: a software driver's big GEMM blocks get
    /// their first run on a second device opened alike (`primer.rs`).
    adapter: wgpu::Adapter,
    features: wgpu::Features,
    limits: wgpu::Limits,
    primer: std::sync::OnceLock<Option<Arc<Primer>>>,
    /// Pipelines the primer ran: their first run here compiles nothing.
    primed_keys: Arc<Mutex<std::collections::HashSet<PipelineKey>>>,
    /// Held by the compile worker building a big GEMM block.
    slow_lane: Arc<Mutex<()>>,
    /// The compile workers' queues, emptied when the device drops, and the jobs they
    /// are running: a process must not exit while a worker is inside the driver's
    /// compiler (lavapipe's LLVM tears itself down at exit under the running thread).
    compile_queues: Mutex<Vec<std::sync::Weak<Mutex<Vec<Job>>>>>,
    busy: Arc<(Mutex<usize>, std::sync::Condvar)>,
}

struct Slot {
    buffer: wgpu::Buffer,
    meta: Buffer,
    /// A view: the buffer it views (whose wgpu buffer `buffer` is) and its first byte.
    view_of: Option<(u64, u64)>,
}

#[derive(Clone, PartialEq, Eq, Hash)]
struct PipelineKey {
    name: &'static str,
    reprs: Vec<Repr>,
    consts: Vec<(&'static str, u32)>,
    overrides: Vec<(&'static str, u32)>,
}

impl PipelineKey {
    /// The pipeline-overridable constants, as pipeline creation takes them.
    fn constants(&self) -> Vec<(&'static str, f64)> {
        self.overrides
            .iter()
            .map(|&(name, v)| (name, v as f64))
            .collect()
    }
}

/// A kernel's module: (name, reprs, assembly constants).
type ModuleKey = (&'static str, Vec<Repr>, Vec<(&'static str, u32)>);

#[derive(Clone, PartialEq, Eq, Hash)]
struct BindKey {
    pipeline: PipelineKey,
    buffers: Vec<u64>,
    ranges: Vec<(usize, u64, u64)>,
}

#[derive(Default)]
#[doc(hidden)]
pub struct State {
    next_id: u64,
    buffers: HashMap<u64, Slot>,
    allocated: u64,
    layouts: HashMap<(Vec<Access>, u64), (wgpu::BindGroupLayout, wgpu::PipelineLayout)>,
    /// One module per (kernel, reprs, assembly constants): pipelines that differ only in
    /// their overrides (tile shapes, epilogue flags) share it.
    modules: HashMap<ModuleKey, wgpu::ShaderModule>,
    pipelines: HashMap<PipelineKey, wgpu::ComputePipeline>,
    bind_groups: HashMap<BindKey, wgpu::BindGroup>,
    encoder: Option<wgpu::CommandEncoder>,
    /// Parameters of the launches recorded since the last submit.
    params: Vec<u8>,
    /// f32 split-K partials of GEMMs (grown on demand, kept for reuse).
    pub(crate) partials: Option<wgpu::Buffer>,
    /// Begun downloads: the staging buffer and the submission that fills it.
    staged: HashMap<u64, (wgpu::Buffer, Option<wgpu::SubmissionIndex>)>,
    /// Timestamp queries of an open profile (`Device::profile_begin`).
    pub(crate) profiling: Option<crate::timestamps::Profiling>,
    /// While [`Device::prepare`] looks for missing pipelines: dispatches are collected
    /// here instead of recorded.
    collect: Option<Vec<Wanted>>,
    /// Prepared pipelines a software driver has not run yet, so not compiled yet
    /// (lavapipe compiles a pipeline on its first dispatch, on its one queue thread).
    first_runs: std::collections::HashSet<PipelineKey>,
    /// Pipelines the compile workers are building (see [`WgpuDevice::take_built`]).
    building: std::collections::HashSet<PipelineKey>,
    /// GEMM launches that ran a smaller block while their own was building.
    stand_ins: u64,
    /// Measured GEMM blocks (CPU-class adapters).
    pub(crate) tuner: kiln_lowering::gemm_select::Tuner,
}

/// One pipeline for the compile workers.
struct Job {
    /// Expected build time, by proxy: the assembled source's length (unrolled GEMM
    /// blocks are long and slow to build).
    cost: usize,
    key: PipelineKey,
    module: wgpu::ShaderModule,
    layout: wgpu::PipelineLayout,
    /// Run first on the primer's device (a software driver's big GEMM block).
    prime: Option<(Arc<Primer>, Prime)>,
}

/// Pipelines the compile workers finished (or failed to build), and a signal for a
/// dispatch waiting for one.
type Built = Arc<(
    Mutex<HashMap<PipelineKey, std::result::Result<wgpu::ComputePipeline, String>>>,
    std::sync::Condvar,
)>;

/// A pipeline a prepared launch needs.
struct Wanted {
    key: PipelineKey,
    kernel: &'static KernelSource,
}

/// Runs `f` (an object's creation) with every kind of wgpu error caught on this
/// thread: validation, the driver's own failures (`Internal`: a pipeline the driver's
/// compiler refuses, seen on NVIDIA) and out-of-memory. An error of a kind left
/// uncaught would reach the device's uncaptured handler instead, and show up later as
/// a failed submission that names nothing.
pub(crate) fn caught<T>(
    device: &wgpu::Device,
    f: impl FnOnce() -> T,
) -> std::result::Result<T, String> {
    let memory = device.push_error_scope(wgpu::ErrorFilter::OutOfMemory);
    let internal = device.push_error_scope(wgpu::ErrorFilter::Internal);
    let validation = device.push_error_scope(wgpu::ErrorFilter::Validation);
    let value = f();
    let errors = [
        pollster::block_on(validation.pop()),
        pollster::block_on(internal.pop()),
        pollster::block_on(memory.pop()),
    ];
    match errors.into_iter().flatten().next() {
        Some(e) => Err(e.to_string()),
        None => Ok(value),
    }
}

impl State {
    /// Gives `buffer` a new handle of `len` `dtype` values (`view_of`: the parent's
    /// id and the view's byte offset in it).
    fn register(
        &mut self,
        buffer: wgpu::Buffer,
        dtype: DType,
        len: usize,
        view_of: Option<(u64, u64)>,
    ) -> Buffer {
        let id = self.next_id;
        self.next_id += 1;
        let meta = Buffer { id, dtype, len };
        self.buffers.insert(
            id,
            Slot {
                buffer,
                meta,
                view_of,
            },
        );
        meta
    }

    /// Byte offset of a buffer in the wgpu buffer behind it (a view's start; 0 else).
    pub(crate) fn base(&self, id: u64) -> u64 {
        self.buffers
            .get(&id)
            .and_then(|slot| slot.view_of)
            .map_or(0, |(_, base)| base)
    }
}

impl WgpuDevice {
    /// Runs one device call: inside the GL context lock on GL, refused once wgpu has
    /// panicked on this device, and a panic in it turned into an error naming the
    /// device (`context.rs`). Every public entry point that can reach wgpu goes
    /// through here; calls nest (the lock is reentrant).
    pub(crate) fn call<R>(&self, f: impl FnOnce() -> Result<R>) -> Result<R> {
        let _held = context::enter(self.context);
        if let Some(why) = self.failure.get() {
            return Err(self.unusable(why));
        }
        std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)).unwrap_or_else(|payload| {
            let why = context::panic_message(&*payload);
            self.broken
                .store(true, std::sync::atomic::Ordering::Release);
            Err(self.unusable(self.failure.get_or_init(|| why)))
        })
    }

    fn unusable(&self, why: &str) -> Error {
        self.backend_error(format!(
            "wgpu panicked in a call on this device ({why}); the device is unusable and its \
             resources are left unfreed: open a new device (restart the run), and report the \
             driver and this message if it repeats"
        ))
    }

    pub(crate) fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub(crate) fn backend_error(&self, detail: impl Into<String>) -> Error {
        Error::Backend {
            device: self.caps.name.clone(),
            detail: detail.into(),
        }
    }

    /// Reports errors wgpu raised since the last check.
    fn check_errors(&self) -> Result<()> {
        let mut errs = self.errors.lock().unwrap_or_else(|e| e.into_inner());
        if errs.is_empty() {
            return Ok(());
        }
        let all = std::mem::take(&mut *errs).join("; ");
        Err(self.backend_error(all))
    }

    pub(crate) fn unknown(&self, id: u64) -> Error {
        Error::UnknownBuffer {
            id,
            device: self.caps.name.clone(),
        }
    }

    pub(crate) fn encoder<'s>(&self, s: &'s mut State) -> &'s mut wgpu::CommandEncoder {
        s.encoder.get_or_insert_with(|| {
            self.device
                .create_command_encoder(&wgpu::CommandEncoderDescriptor {
                    label: Some("kiln stream"),
                })
        })
    }

    /// Submits the open stream, if any, with its parameters.
    pub(crate) fn flush(&self, s: &mut State) -> Result<Option<wgpu::SubmissionIndex>> {
        let Some(encoder) = s.encoder.take() else {
            return Ok(None);
        };
        let _span = span("submit", SpanKind::Submit);
        if !s.params.is_empty() {
            self.queue.write_buffer(&self.arena, 0, &s.params);
            s.params.clear();
        }
        let index = self.queue.submit([encoder.finish()]);
        self.check_errors()?;
        Ok(Some(index))
    }

    /// Submits the open stream and waits for the device to finish it.
    pub(crate) fn finish(&self, s: &mut State) -> Result<()> {
        self.flush(s)?;
        self.device
            .poll(wgpu::PollType::wait_indefinitely())
            .map_err(|e| self.backend_error(format!("waiting for the device: {e}")))?;
        Ok(())
    }

    /// Whether `prepare` is listing pipelines (nothing runs then).
    pub(crate) fn collecting(s: &State) -> bool {
        s.collect.is_some()
    }

    /// The measured GEMM blocks so far (shape class, block name), sorted.
    pub fn gemm_winners(&self) -> Vec<(String, String)> {
        let s = self.lock();
        let mut w: Vec<_> = s
            .tuner
            .winners
            .iter()
            .map(|(c, v)| (c.clone(), v.name()))
            .collect();
        w.sort();
        w
    }
}

impl Drop for WgpuDevice {
    fn drop(&mut self) {
        // Pipelines not started are not needed any more; those being built are waited
        // for (see `busy`).
        for q in self
            .compile_queues
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .iter()
            .filter_map(std::sync::Weak::upgrade)
        {
            q.lock().unwrap_or_else(|e| e.into_inner()).clear();
        }
        if let Some(p) = self.primer.get().and_then(Option::as_ref) {
            p.hold(false);
        }
        let (count, idle) = &*self.busy;
        let mut n = count.lock().unwrap_or_else(|e| e.into_inner());
        while *n > 0 {
            n = idle.wait(n).unwrap_or_else(|e| e.into_inner());
        }
        drop(n);
        // The wgpu objects drop after this, each inside the context lock (`Guarded`).
        let _held = context::enter(self.context);
        // Pipelines built after the plan's (evaluation, later micro-batches).
        if let Some(c) = self
            .disk_cache
            .as_ref()
            .filter(|_| self.failure.get().is_none())
        {
            c.save();
        }
        let Some(profile) = &self.profile else { return };
        let p = profile.lock().unwrap_or_else(|e| e.into_inner());
        let mut rows: Vec<_> = p.iter().collect();
        rows.sort_by(|a, b| b.1 .1.total_cmp(&a.1 .1));
        let total: f64 = rows.iter().map(|r| r.1 .1).sum();
        eprintln!("KILN_PROFILE {}: {total:.1} ms in launches", self.caps.name);
        for (k, (n, ms)) in rows {
            eprintln!("{ms:10.1} ms {:5.1}% {n:6} x  {k}", 100.0 * ms / total);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `caught` returns a creation's error to its caller and keeps it from the
    /// device's uncaptured handler (where it would surface later, naming nothing).
    /// lavapipe raises only validation errors on demand; the driver's own failures
    /// (`Internal`, a device lost to a pipeline NVIDIA's compiler refused) go through
    /// the same scopes, as the H200 run in benches/RESULTS.md showed.
    #[test]
    fn a_creation_error_is_returned_where_it_happens() {
        let adapter = raw_adapters()
            .iter()
            .find(|a| a.get_info().backend == wgpu::Backend::Vulkan)
            .expect("no wgpu Vulkan adapter: install mesa-vulkan-drivers (scripts/setup.sh)");
        let (device, _queue) =
            pollster::block_on(adapter.request_device(&wgpu::DeviceDescriptor::default()))
                .expect("opening the Vulkan adapter");
        let uncaptured = Arc::new(Mutex::new(0usize));
        let count = uncaptured.clone();
        device.on_uncaptured_error(Arc::new(move |_| *count.lock().unwrap() += 1));
        let buffer = |size| wgpu::BufferDescriptor {
            label: Some("caught test"),
            size,
            usage: wgpu::BufferUsages::STORAGE,
            mapped_at_creation: false,
        };
        let too_big = device.limits().max_buffer_size + 4;
        let err = caught(&device, || device.create_buffer(&buffer(too_big))).unwrap_err();
        assert!(err.contains("size"), "{err}");
        assert!(caught(&device, || device.create_buffer(&buffer(256))).is_ok());
        assert_eq!(*uncaptured.lock().unwrap(), 0);
    }
}
