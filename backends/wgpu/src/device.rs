//! A wgpu device behind Kiln's device contract.
//!
//! Resource lifetimes, explicitly:
//! - buffers live in `State::buffers` from `alloc` to `free`;
//! - pipelines and bind-group layouts are created on first use and kept for the
//!   device's life; bind groups are cached per (pipeline, buffers) and dropped when
//!   one of their buffers is freed;
//! - launches are recorded into one open command encoder (the stream); their
//!   parameters go into a uniform arena, bound with dynamic offsets and written once
//!   per submit, so a step of N launches is one `queue.submit`, not N. How each kernel
//!   becomes dispatches is the shared lowering's (`kiln-lowering`; this file is its
//!   `Recorder`).

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
    pub(crate) tuner: crate::tune::Tuner,
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

/// Builds one pipeline; needs no state, so workers build several at once (wgpu
/// devices are `Sync` and error scopes are per thread). Marks the disk cache for
/// saving.
fn build(
    device: &wgpu::Device,
    cache: Option<&crate::pipeline_cache::DiskCache>,
    key: &PipelineKey,
    module: &wgpu::ShaderModule,
    layout: &wgpu::PipelineLayout,
) -> std::result::Result<wgpu::ComputePipeline, String> {
    let constants = key.constants();
    let pipeline = caught(device, || {
        device.create_compute_pipeline(&wgpu::ComputePipelineDescriptor {
            label: Some(key.name),
            layout: Some(layout),
            module,
            entry_point: Some("main"),
            compilation_options: wgpu::PipelineCompilationOptions {
                constants: &constants,
                zero_initialize_workgroup_memory: false,
            },
            cache: cache.map(|c| &c.cache),
        })
    })?;
    if let Some(c) = cache {
        c.dirty.store(true, std::sync::atomic::Ordering::Relaxed);
    }
    Ok(pipeline)
}

/// How a device is opened; the primer's device is opened alike, so the driver sees
/// the same shaders.
fn device_descriptor(
    features: wgpu::Features,
    limits: &wgpu::Limits,
) -> wgpu::DeviceDescriptor<'static> {
    wgpu::DeviceDescriptor {
        label: Some("kiln"),
        required_features: features,
        required_limits: limits.clone(),
        ..Default::default()
    }
}

/// A kernel's bindings: its launch parameters (binding 0, a uniform at a dynamic
/// offset in the arena), then one storage buffer per slot.
fn layout_entries(accesses: &[Access], params_size: u64) -> Vec<wgpu::BindGroupLayoutEntry> {
    let mut entries = vec![wgpu::BindGroupLayoutEntry {
        binding: 0,
        visibility: wgpu::ShaderStages::COMPUTE,
        ty: wgpu::BindingType::Buffer {
            ty: wgpu::BufferBindingType::Uniform,
            has_dynamic_offset: true,
            min_binding_size: wgpu::BufferSize::new(params_size),
        },
        count: None,
    }];
    for (i, a) in accesses.iter().enumerate() {
        entries.push(wgpu::BindGroupLayoutEntry {
            binding: i as u32 + 1,
            visibility: wgpu::ShaderStages::COMPUTE,
            ty: wgpu::BindingType::Buffer {
                ty: wgpu::BufferBindingType::Storage {
                    read_only: *a == Access::Read,
                },
                has_dynamic_offset: false,
                min_binding_size: None,
            },
            count: None,
        });
    }
    entries
}

/// A pipeline a prepared launch needs.
struct Wanted {
    key: PipelineKey,
    kernel: &'static KernelSource,
}

/// `KILN_COMPILE_LOG=1`: each pipeline's build and (software drivers) first-run time
/// on stderr, to see where a first step's compile time goes.
fn log_compile(what: &str, key: &PipelineKey, since: std::time::Instant) {
    if compile_log() {
        eprintln!(
            "kiln: {what} {} {:?} {:?} {:?}: {:.2} s",
            key.name,
            key.reprs,
            key.consts,
            key.overrides,
            since.elapsed().as_secs_f64()
        );
    }
}

/// A pipeline that takes seconds to build and to first run on a software driver, and
/// has a stand-in meanwhile: a CPU-class GEMM block of 16 rows and up
/// (`matmul::stand_in`), or a fused attention pass with several rows per lane (one row
/// per lane stands in, `attention::stand_in`).
fn slow_block(key: &PipelineKey) -> bool {
    let has =
        |name: &str, at_least: u32| key.consts.iter().any(|&(c, v)| c == name && v >= at_least);
    (key.name.starts_with("matmul_cpu") && has("TM", kiln_lowering::SLOW_ROWS))
        || (key.name.starts_with("attention") && has("R", 2))
}

/// Where a pipeline goes in the compile queue: 0 for the step's own, then the slow
/// ones (see [`slow_block`]) from the quickest to build and first run: 16-row GEMM
/// blocks, attention passes, 32-row and 64-row blocks.
fn slow_rank(key: &PipelineKey) -> u32 {
    if !slow_block(key) {
        return 0;
    }
    let tm = key
        .consts
        .iter()
        .find(|&&(c, _)| c == "TM")
        .map(|&(_, v)| v);
    match tm {
        Some(16) => 1,
        None => 2,
        Some(tm) => 2 + tm / 32,
    }
}

/// Worker threads that compile a plan's pipelines: one per core unless
/// `KILN_COMPILE_THREADS` says otherwise (1: one after another, as before).
fn compile_threads() -> usize {
    std::env::var("KILN_COMPILE_THREADS")
        .ok()
        .and_then(|v| v.parse().ok())
        .filter(|&n: &usize| n > 0)
        .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get()))
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
    /// Opens a new, independent device on adapter `index` (see `kiln devices`).
    /// Opening the same adapter again gives another device with its own memory and queue.
    pub fn open(index: usize, options: &DeviceOptions) -> Result<WgpuDevice> {
        let adapters = raw_adapters();
        let adapter = adapters.get(index).ok_or(Error::NoSuchAdapter {
            index,
            available: adapters.len(),
        })?;
        let caps = capabilities(adapter, options);
        let mut features = wgpu::Features::empty();
        if caps.f16_arithmetic {
            features |= wgpu::Features::SHADER_F16;
        }
        if caps.timestamp_queries {
            features |=
                wgpu::Features::TIMESTAMP_QUERY | wgpu::Features::TIMESTAMP_QUERY_INSIDE_PASSES;
        }
        if caps.subgroup_sizes.is_some() {
            features |= wgpu::Features::SUBGROUP;
        }
        let keep_pipelines = adapter.features().contains(wgpu::Features::PIPELINE_CACHE)
            && !options.no_pipeline_cache;
        if keep_pipelines {
            features |= wgpu::Features::PIPELINE_CACHE;
        }
        // Ask for everything the adapter offers: large buffers are the norm here.
        let limits = wgpu::Limits {
            max_storage_buffer_binding_size: caps.max_storage_binding,
            ..adapter.limits()
        };
        // Every device of a GL adapter shares its one context: opening one takes it.
        let lock = context::for_adapter(index, adapter.get_info().backend);
        let _held = context::enter(lock);
        let (device, queue) =
            pollster::block_on(adapter.request_device(&device_descriptor(features, &limits)))
                .map_err(|e| Error::Backend {
                    device: caps.name.clone(),
                    detail: format!("could not open a device: {e}"),
                })?;

        let errors = Arc::new(Mutex::new(Vec::new()));
        let sink = errors.clone();
        device.on_uncaptured_error(Arc::new(move |e: wgpu::Error| {
            sink.lock()
                .unwrap_or_else(|p| p.into_inner())
                .push(e.to_string());
        }));
        // A lost device fails every later submission with a message about submission
        // indices; the loss itself, with the driver's reason, is what the user needs.
        let lost = errors.clone();
        device.set_device_lost_callback(move |reason, message| {
            if reason != wgpu::DeviceLostReason::Destroyed {
                lost.lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .push(format!("the device was lost ({reason:?}): {message}"));
            }
        });

        let arena_stride =
            PARAMS_MAX.next_multiple_of(device.limits().min_uniform_buffer_offset_alignment as u64);
        let arena = device.create_buffer(&wgpu::BufferDescriptor {
            label: Some("kiln params arena"),
            size: arena_stride * ARENA_SLOTS,
            usage: wgpu::BufferUsages::UNIFORM | wgpu::BufferUsages::COPY_DST,
            mapped_at_creation: false,
        });
        let scratch = device.create_buffer(&wgpu::BufferDescriptor {
            label: Some("kiln reduce partials"),
            size: scratch_bytes(),
            usage: wgpu::BufferUsages::STORAGE,
            mapped_at_creation: false,
        });
        let band_partials = device.create_buffer(&wgpu::BufferDescriptor {
            label: Some("kiln banded reduce partials"),
            size: band_partials_bytes(),
            usage: wgpu::BufferUsages::STORAGE,
            mapped_at_creation: false,
        });
        let dummy = device.create_buffer(&wgpu::BufferDescriptor {
            label: Some("kiln absent operand"),
            size: DUMMY_BYTES,
            usage: wgpu::BufferUsages::STORAGE,
            mapped_at_creation: false,
        });
        let disk_cache = keep_pipelines
            .then(|| crate::pipeline_cache::open(&device, adapter, options))
            .flatten()
            .map(Arc::new);
        let tuner =
            crate::tune::Tuner::open(&adapter.get_info(), options, caps.device_type == "cpu");
        let broken = Broken::default();
        let held_buffer = |v| Guarded::new(v, lock, &broken);
        Ok(WgpuDevice {
            disk_cache,
            built: Guarded::new(Arc::default(), lock, &broken),
            adapter: adapter.clone(),
            features,
            limits,
            primer: std::sync::OnceLock::new(),
            primed_keys: Arc::default(),
            slow_lane: Arc::default(),
            compile_queues: Mutex::default(),
            busy: Arc::default(),
            dummy: held_buffer(dummy),
            band_partials: held_buffer(band_partials),
            arena: held_buffer(arena),
            scratch: held_buffer(scratch),
            caps,
            device: Guarded::new(device, lock, &broken),
            queue: Guarded::new(queue, lock, &broken),
            arena_stride,
            errors,
            state: Guarded::new(
                Mutex::new(State {
                    next_id: 1,
                    tuner,
                    ..State::default()
                }),
                lock,
                &broken,
            ),
            profile: std::env::var_os("KILN_PROFILE").map(|_| Mutex::new(HashMap::new())),
            context: lock,
            failure: std::sync::OnceLock::new(),
            broken,
        })
    }

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

    fn layout<'s>(
        &self,
        s: &'s mut State,
        kernel: &KernelSource,
    ) -> &'s (wgpu::BindGroupLayout, wgpu::PipelineLayout) {
        let accesses: Vec<Access> = kernel.slots.iter().map(|slot| slot.access).collect();
        let params_size = kernel.params_size;
        s.layouts
            .entry((accesses.clone(), params_size))
            .or_insert_with(|| {
                let entries = layout_entries(&accesses, params_size);
                let bgl = self
                    .device
                    .create_bind_group_layout(&wgpu::BindGroupLayoutDescriptor {
                        label: Some("kiln kernel bindings"),
                        entries: &entries,
                    });
                let pl = self
                    .device
                    .create_pipeline_layout(&wgpu::PipelineLayoutDescriptor {
                        label: Some("kiln kernel layout"),
                        bind_group_layouts: &[Some(&bgl)],
                        immediate_size: 0,
                    });
                (bgl, pl)
            })
    }

    fn pipeline(&self, s: &mut State, key: &PipelineKey, kernel: &KernelSource) -> Result<()> {
        if s.pipelines.contains_key(key) {
            return Ok(());
        }
        if s.building.contains(key) {
            return self.take_built(s, key);
        }
        self.check_kernel(kernel)?;
        let module = self.module(s, key, kernel);
        let layout = self.layout(s, kernel).1.clone();
        let pipeline = self.build_pipeline(key, kernel, &module, &layout)?;
        s.pipelines.insert(key.clone(), pipeline);
        Ok(())
    }

    fn check_kernel(&self, kernel: &KernelSource) -> Result<()> {
        if kernel.subgroups && self.caps.subgroup_sizes.is_none() {
            return Err(Error::Unsupported {
                device: self.caps.name.clone(),
                what: format!("subgroup operations, which kernel {} needs", kernel.name),
            });
        }
        Ok(())
    }

    /// The module of a pipeline key (created on first use: naga parses and validates
    /// the WGSL, which is quick; the driver compiles at pipeline creation).
    fn module(
        &self,
        s: &mut State,
        key: &PipelineKey,
        kernel: &KernelSource,
    ) -> wgpu::ShaderModule {
        let module_key = (kernel.name, key.reprs.clone(), key.consts.clone());
        if let Some(m) = s.modules.get(&module_key) {
            return m.clone();
        }
        let source = shader::assemble(kernel, &key.reprs, &key.consts);
        let desc = wgpu::ShaderModuleDescriptor {
            label: Some(kernel.name),
            source: wgpu::ShaderSource::Wgsl(source.into()),
        };
        let module = if kernel.trusted {
            // SAFETY: `trusted` kernels clamp every buffer index into range
            // themselves (see their sources) and their loops are bounded by launch
            // parameters, so the checks the compiler would add can never fire.
            unsafe {
                self.device
                    .create_shader_module_trusted(desc, wgpu::ShaderRuntimeChecks::unchecked())
            }
        } else {
            self.device.create_shader_module(desc)
        };
        s.modules.insert(module_key, module.clone());
        module
    }

    fn build_pipeline(
        &self,
        key: &PipelineKey,
        kernel: &KernelSource,
        module: &wgpu::ShaderModule,
        layout: &wgpu::PipelineLayout,
    ) -> Result<wgpu::ComputePipeline> {
        build(
            &self.device,
            self.disk_cache.as_deref(),
            key,
            module,
            layout,
        )
        .map_err(|e| self.backend_error(format!("kernel {} failed to build: {e}", kernel.name)))
    }

    /// The pipelines `kernels` need that are not built yet, found by recording them
    /// into a scratch encoder that is dropped unsubmitted (copies included), with the
    /// parameter arena restored: nothing runs and the open stream is untouched.
    fn missing_pipelines(&self, s: &mut State, kernels: &[Kernel]) -> Result<Vec<Wanted>> {
        let stream = s.encoder.take();
        let params = s.params.len();
        s.collect = Some(vec![]);
        let mut result = Ok(());
        for k in kernels {
            result = k
                .validate()
                .and_then(|()| self.check_live(s, k.name(), &k.buffers()))
                .and_then(|()| kiln_lowering::record_kernel(self, s, k));
            if result.is_err() {
                break;
            }
        }
        let wanted = s.collect.take().unwrap_or_default();
        s.encoder = stream;
        s.params.truncate(params);
        result.map(|()| wanted)
    }

    /// Starts building `wanted` on worker threads (one per core, `KILN_COMPILE_THREADS`
    /// to override) in launch order, and returns: a dispatch that needs one of them
    /// waits for it alone, so the first launches run — and a software driver compiles
    /// their machine code on its queue thread — while later pipelines still build.
    fn compile_all(&self, s: &mut State, wanted: Vec<Wanted>) -> Result<()> {
        if wanted.is_empty() {
            return Ok(());
        }
        for w in &wanted {
            self.check_kernel(w.kernel)?;
        }
        if self.context.is_some() {
            // GL: one thread at a time in the context (`context.rs`), so the pipelines
            // build here, in launch order, before the step that needs them.
            compiling::queued(wanted.len());
            for w in wanted {
                let t = std::time::Instant::now();
                let built = self.pipeline(s, &w.key, w.kernel);
                compiling::finished();
                log_compile("built", &w.key, t);
                built?;
            }
            return Ok(());
        }
        // A software driver compiles in two halves, each counted: the pipeline's
        // creation (its IR passes; on the workers) and its first run (machine code).
        let compiles_on_first_run = self.caps.device_type == "cpu";
        compiling::queued(wanted.len() * if compiles_on_first_run { 2 } else { 1 });
        // Modules and layouts need the state; they are cheap next to the driver's
        // compile, which happens in the workers.
        // GEMM blocks that take seconds to build (32 rows and up) and attention passes
        // with several rows per lane get a stand-in while they build
        // (`matmul::stand_in`, `attention::stand_in`, built ahead here), so they are off the
        // critical path: they build last, and every worker takes launch order, so the
        // step's own pipelines are ready first and the big blocks build while it runs.
        // Their first run, which compiles their machine code, happens on the primer's
        // device as part of their build, not on this device's queue.
        // Without stand-ins (no subgroups: no big blocks either), worker 0 takes the
        // costliest pipeline left, as those are the critical path then.
        let stand_ins = self.caps.subgroup_sizes.is_some() && compiles_on_first_run;
        let jobs: Vec<Job> = wanted
            .into_iter()
            .map(|w| {
                s.building.insert(w.key.clone());
                if compiles_on_first_run {
                    s.first_runs.insert(w.key.clone());
                }
                let source = shader::assemble(w.kernel, &w.key.reprs, &w.key.consts);
                let prime = (stand_ins && slow_block(&w.key))
                    .then(|| self.primer())
                    .flatten()
                    .map(|primer| {
                        let accesses: Vec<Access> =
                            w.kernel.slots.iter().map(|slot| slot.access).collect();
                        let prime = Prime {
                            entries: layout_entries(&accesses, w.kernel.params_size),
                            params_size: w.kernel.params_size,
                            trusted: w.kernel.trusted,
                            constants: w.key.constants(),
                            source: source.clone(),
                        };
                        (primer, prime)
                    });
                Job {
                    cost: source.len(),
                    module: self.module(s, &w.key, w.kernel),
                    layout: self.layout(s, w.kernel).1.clone(),
                    key: w.key,
                    prime,
                }
            })
            .collect();
        let mut jobs = jobs;
        let threads = compile_threads().min(jobs.len()).max(1);
        if stand_ins {
            // The slow ones last, cheapest first: a 16-row block is the stand-in of the
            // bigger ones and takes a second or two, a 64-row one half a minute.
            jobs.sort_by_key(|j| slow_rank(&j.key));
        }
        let queue = Arc::new(Mutex::new(jobs));
        {
            let mut queues = self
                .compile_queues
                .lock()
                .unwrap_or_else(|e| e.into_inner());
            queues.retain(|q| q.strong_count() > 0);
            queues.push(Arc::downgrade(&queue));
        }
        for worker in 0..threads {
            let (mine, built) = (queue.clone(), self.built.clone());
            let busy = self.busy.clone();
            let (primed_keys, slow_lane) = (self.primed_keys.clone(), self.slow_lane.clone());
            let device = self.device.clone();
            let cache = self.disk_cache.clone();
            let spawned = std::thread::Builder::new()
                .name("kiln-compile".into())
                .spawn(move || loop {
                    let job = {
                        let mut q = mine.lock().unwrap_or_else(|e| e.into_inner());
                        let pick = if worker == 0 && threads > 1 && !stand_ins {
                            (0..q.len()).max_by_key(|&i| (q[i].cost, std::cmp::Reverse(i)))
                        } else if stand_ins
                            && worker > 0
                            && q.first().is_some_and(|j| slow_block(&j.key))
                        {
                            // The big blocks (last in the queue) build one at a time on
                            // worker 0, so the step running their stand-ins keeps a core.
                            None
                        } else {
                            (!q.is_empty()).then_some(0)
                        };
                        match pick {
                            Some(i) => {
                                // Counted while the queue is locked, so that a drop that
                                // empties the queue then waits for this job.
                                *busy.0.lock().unwrap_or_else(|e| e.into_inner()) += 1;
                                q.remove(i)
                            }
                            None => return,
                        }
                    };
                    let _done = Finished(&busy);
                    // One big block at a time on the device, whichever `compile_all`
                    // asked for it (a measurement may ask for one during the step).
                    let _lane = (stand_ins && slow_block(&job.key))
                        .then(|| slow_lane.lock().unwrap_or_else(|e| e.into_inner()));
                    if let Some((primer, prime)) = &job.prime {
                        let t = std::time::Instant::now();
                        // Only time is at stake: where it fails, this device's first
                        // run compiles the block, as without a primer.
                        match std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                            primer.run_once(prime)
                        })) {
                            Ok(Ok(())) => {
                                primed_keys
                                    .lock()
                                    .unwrap_or_else(|e| e.into_inner())
                                    .insert(job.key.clone());
                                log_compile("first run (primer) of", &job.key, t)
                            }
                            Ok(Err(e)) => {
                                log_compile(&format!("priming failed ({e})"), &job.key, t)
                            }
                            Err(_) => log_compile("priming panicked", &job.key, t),
                        }
                    }
                    let t = std::time::Instant::now();
                    // A dispatch waits for this result: a panic must become an error,
                    // not a wait that never ends.
                    let p = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                        build(
                            &device,
                            cache.as_deref(),
                            &job.key,
                            &job.module,
                            &job.layout,
                        )
                    }))
                    .unwrap_or_else(|_| Err("the driver panicked while building it".into()));
                    log_compile("built", &job.key, t);
                    compiling::finished();
                    let (ready, cv) = &*built;
                    ready
                        .lock()
                        .unwrap_or_else(|e| e.into_inner())
                        .insert(job.key.clone(), p);
                    cv.notify_all();
                });
            if let Err(e) = spawned {
                if worker == 0 {
                    // Nobody builds them: they compile on first use, as without
                    // `prepare`.
                    let q = queue.lock().unwrap_or_else(|e| e.into_inner());
                    for job in q.iter() {
                        s.building.remove(&job.key);
                        s.first_runs.remove(&job.key);
                    }
                }
                return Err(self.backend_error(format!("could not start a compile thread: {e}")));
            }
        }
        Ok(())
    }

    /// The second device big GEMM blocks first run on (software drivers with Mesa's
    /// shader cache on), opened at first need.
    fn primer(&self) -> Option<Arc<Primer>> {
        self.primer
            .get_or_init(|| {
                if !mesa_cache_on() {
                    return None;
                }
                let desc = device_descriptor(self.features, &self.limits);
                Primer::open(&self.adapter, &desc).map(Arc::new)
            })
            .clone()
    }

    /// Takes a pipeline the workers build, waiting for it if it is not ready yet.
    fn take_built(&self, s: &mut State, key: &PipelineKey) -> Result<()> {
        let (ready, cv) = &**self.built;
        let mut done = ready.lock().unwrap_or_else(|e| e.into_inner());
        let result = loop {
            if let Some(r) = done.remove(key) {
                break r;
            }
            done = cv.wait(done).unwrap_or_else(|e| e.into_inner());
        };
        drop(done);
        s.building.remove(key);
        let pipeline = result.map_err(|e| {
            s.first_runs.remove(key);
            self.backend_error(format!("kernel {} failed to build: {e}", key.name))
        })?;
        s.pipelines.insert(key.clone(), pipeline);
        if s.building.is_empty() {
            if let Some(c) = &self.disk_cache {
                c.save();
            }
        }
        Ok(())
    }

    /// A zeroed buffer of `like`'s type and length, for measurements that must not
    /// touch `like` (recorded work keeps it alive; free it with [`Self::drop_scratch`]).
    pub(crate) fn scratch_like(&self, s: &mut State, like: Buffer) -> Buffer {
        let buffer = self.device.create_buffer(&wgpu::BufferDescriptor {
            label: Some("kiln measurement scratch"),
            size: like.dtype.padded_bytes(like.len),
            usage: wgpu::BufferUsages::STORAGE,
            mapped_at_creation: false,
        });
        s.register(buffer, like.dtype, like.len, None)
    }

    pub(crate) fn drop_scratch(&self, s: &mut State, buf: Buffer) {
        s.buffers.remove(&buf.id);
        s.bind_groups.retain(|k, _| !k.buffers.contains(&buf.id));
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

    /// GEMM and attention launches so far that ran a stand-in (a smaller CPU block, one
    /// attention row per lane: same results) because their own was still building on
    /// a compile worker.
    pub fn stand_in_launches(&self) -> u64 {
        self.lock().stand_ins
    }

    /// Whether big GEMM blocks first run on a primer (see `primer.rs`): a software
    /// driver whose big blocks build behind stand-ins, with Mesa's cache on.
    pub(crate) fn primes_big_blocks(&self) -> bool {
        self.caps.subgroup_sizes.is_some()
            && self.caps.device_type == "cpu"
            && self.primer().is_some()
    }

    /// Starts building `d`'s pipeline on a compile worker, unless it is built or
    /// building: for a block the GEMM selection will time once it is built.
    pub(crate) fn build_in_background(&self, s: &mut State, d: Dispatch) -> Result<()> {
        let key = PipelineKey {
            name: d.kernel.name,
            reprs: d.reprs,
            consts: d.consts,
            overrides: d.overrides,
        };
        if s.pipelines.contains_key(&key) || s.building.contains(&key) {
            return Ok(());
        }
        if compile_log() {
            eprintln!(
                "kiln: building {} {:?} in the background to measure it",
                key.name, key.consts
            );
        }
        self.compile_all(
            s,
            vec![Wanted {
                key,
                kernel: d.kernel,
            }],
        )
    }

    /// Holds the primer before its next first run (`true`), or lets it go on: tests see
    /// launches run stand-ins meanwhile. The primer opens if it has not yet.
    #[doc(hidden)]
    pub fn hold_primer(&self, held: bool) {
        if let Some(p) = self.primer() {
            p.hold(held);
        }
    }

    /// Pipelines whose first run (a software driver's machine code) happened on the
    /// primer's device rather than this one's queue (see `primer.rs`).
    pub fn primed_pipelines(&self) -> u64 {
        self.primer
            .get()
            .and_then(Option::as_ref)
            .map_or(0, |p| p.primed.load(std::sync::atomic::Ordering::Relaxed))
    }

    /// Waits until the compile workers have built every pipeline they were given.
    pub fn wait_for_builds(&self) {
        let (ready, cv) = &**self.built;
        loop {
            // The state's lock before the workers' results, as `take_built` takes them;
            // a launch on another thread may take a result meanwhile, so look again.
            let s = self.lock();
            let done = ready.lock().unwrap_or_else(|e| e.into_inner());
            if s.building.iter().all(|k| done.contains_key(k)) {
                return;
            }
            drop(s);
            let wait = std::time::Duration::from_millis(100);
            drop(cv.wait_timeout(done, wait));
        }
    }

    /// Pipelines built or being built (tests check that a prepared plan's launches add
    /// none).
    pub fn pipeline_count(&self) -> usize {
        let s = self.lock();
        s.pipelines.len() + s.building.len()
    }

    /// Records one compute dispatch into the stream.
    fn record_dispatch(&self, s: &mut State, mut d: Dispatch) -> Result<()> {
        // A view binds its range of the buffer it views; a range asked of a view is
        // relative to the view's start.
        for (i, id) in d.buffers.iter().enumerate() {
            let Some(slot) = s.buffers.get(id) else {
                continue;
            };
            if let Some((_, base)) = slot.view_of {
                match d.ranges.iter_mut().find(|r| r.0 == i) {
                    Some(r) => r.1 += base,
                    None => d.ranges.push((i, base, slot.meta.bytes())),
                }
            }
        }
        // WebGPU forbids one buffer bound both writable and read-only in a dispatch,
        // even through disjoint views: name the kernel rather than fail at submit.
        let under = |id: &u64| {
            s.buffers
                .get(id)
                .and_then(|slot| slot.view_of)
                .map_or(*id, |(parent, _)| parent)
        };
        for (i, a) in d.buffers.iter().enumerate() {
            for (j, b) in d.buffers.iter().enumerate().skip(i + 1) {
                let access = |k: usize| d.kernel.slots.get(k).map(|slot| slot.access);
                if under(a) == under(b) && access(i) != access(j) {
                    return Err(Error::InvalidArgument(format!(
                        "`{}` binds buffer #{a} and buffer #{b}, views of one buffer, once \
                         writable and once read-only: WebGPU forbids that; use separate buffers",
                        d.kernel.name
                    )));
                }
            }
        }
        // A whole buffer bound past the adapter's per-binding limit would be a wgpu
        // validation error at submit; say which kernel and what to do instead.
        let limit = self.caps.max_storage_binding;
        let buffers: Vec<wgpu::Buffer> = d
            .buffers
            .iter()
            .map(|&id| self.resolve(s, id))
            .collect::<Result<_>>()?;
        for (slot, buffer) in buffers.iter().enumerate() {
            let size = match d.ranges.iter().find(|r| r.0 == slot) {
                Some(r) => r.2,
                None => buffer.size(),
            };
            if size > limit {
                return Err(Error::Unsupported {
                    device: self.caps.name.clone(),
                    what: format!(
                        "`{}` on a {}-byte buffer: over the adapter's per-binding limit of \
                         {limit} bytes (GEMMs, elementwise kernels, reductions, the \
                         optimizers and the embedding's backward split such operands; \
                         this kernel cannot). Use smaller tensors, e.g. a smaller batch or sequence, or \
                         fused attention instead of a T x T score matrix",
                        d.kernel.name, size
                    ),
                });
            }
        }
        let key = PipelineKey {
            name: d.kernel.name,
            reprs: d.reprs,
            consts: d.consts,
            overrides: d.overrides,
        };
        if let Some(wanted) = &mut s.collect {
            if !s.pipelines.contains_key(&key)
                && !s.building.contains(&key)
                && !wanted.iter().any(|w| w.key == key)
            {
                wanted.push(Wanted {
                    key,
                    kernel: d.kernel,
                });
            }
            return Ok(());
        }
        self.pipeline(s, &key, d.kernel)?;
        if s.params.len() as u64 + self.arena_stride > self.arena.size() {
            self.flush(s)?;
        }
        let offset = s.params.len() as u32;
        debug_assert_eq!(d.params.len() as u64 * 4, d.kernel.params_size);
        s.params.extend_from_slice(bytemuck::cast_slice(&d.params));
        s.params
            .resize(offset as usize + self.arena_stride as usize, 0);

        let bind_key = BindKey {
            pipeline: key.clone(),
            buffers: d.buffers.clone(),
            ranges: d.ranges.clone(),
        };
        if !s.bind_groups.contains_key(&bind_key) {
            let mut entries = vec![wgpu::BindGroupEntry {
                binding: 0,
                resource: wgpu::BindingResource::Buffer(wgpu::BufferBinding {
                    buffer: &self.arena,
                    offset: 0,
                    size: wgpu::BufferSize::new(d.kernel.params_size),
                }),
            }];
            for (i, b) in buffers.iter().enumerate() {
                let resource = match d.ranges.iter().find(|r| r.0 == i) {
                    Some(&(_, offset, size)) => {
                        wgpu::BindingResource::Buffer(wgpu::BufferBinding {
                            buffer: b,
                            offset,
                            size: wgpu::BufferSize::new(size),
                        })
                    }
                    None => b.as_entire_binding(),
                };
                entries.push(wgpu::BindGroupEntry {
                    binding: i as u32 + 1,
                    resource,
                });
            }
            let layout = &self.layout(s, d.kernel).0;
            let bg = self.device.create_bind_group(&wgpu::BindGroupDescriptor {
                label: Some(d.kernel.file),
                layout,
                entries: &entries,
            });
            s.bind_groups.insert(bind_key.clone(), bg);
        }
        // Take what the pass needs out of `s` before borrowing the encoder mutably.
        let pipeline = s.pipelines[&key].clone();
        let bind_group = s.bind_groups[&bind_key].clone();
        let stamps = self.pass_timestamps(s);
        let timestamp_writes = stamps
            .as_ref()
            .map(|(set, i)| wgpu::ComputePassTimestampWrites {
                query_set: set,
                beginning_of_pass_write_index: Some(*i),
                end_of_pass_write_index: Some(*i + 1),
            });
        {
            let encoder = self.encoder(s);
            let mut pass = encoder.begin_compute_pass(&wgpu::ComputePassDescriptor {
                label: Some(d.kernel.file),
                timestamp_writes,
            });
            pass.set_pipeline(&pipeline);
            pass.set_bind_group(0, &bind_group, &[offset]);
            pass.dispatch_workgroups(d.groups.0, d.groups.1, d.groups.2);
        }
        // A software driver compiles a pipeline when it first runs it: run that launch
        // now, so the first step can count its kernels as they become ready. (Off
        // while a profile is open: its timestamps resolve per submit of a whole step.)
        if s.profiling.is_none() && s.first_runs.remove(&key) {
            let t = std::time::Instant::now();
            self.flush(s)?;
            self.device
                .poll(wgpu::PollType::wait_indefinitely())
                .map_err(|e| self.backend_error(format!("waiting for the device: {e}")))?;
            compiling::finished();
            log_compile("first run of", &key, t);
        }
        Ok(())
    }

    /// Records a launch, with timestamps around it when a profile is open.
    fn record_profiled(&self, s: &mut State, kernel: &Kernel) -> Result<()> {
        let Some(before) = self.launch_queries_begin(s) else {
            return kiln_lowering::record_kernel(self, s, kernel);
        };
        let _span = span("record", SpanKind::Record);
        kiln_lowering::record_kernel(self, s, kernel)?;
        self.launch_queries_end(s, before, kernel.cost());
        Ok(())
    }
}

impl WgpuDevice {
    /// Checks that each handle is live on this device and describes the buffer it
    /// names (a handle from another device can carry a valid id with the wrong size,
    /// and kernels trust the size).
    pub(crate) fn check_live(&self, s: &State, kernel: &str, buffers: &[Buffer]) -> Result<()> {
        for b in buffers {
            let slot = s.buffers.get(&b.id).ok_or_else(|| self.unknown(b.id))?;
            if slot.meta != *b {
                return Err(Error::InvalidArgument(format!(
                    "{kernel}: handle for buffer #{} says {} x {} but it holds {} x {} (a handle from another device?)",
                    b.id, b.len, b.dtype, slot.meta.len, slot.meta.dtype
                )));
            }
        }
        Ok(())
    }

    /// The wgpu buffer a dispatch binds for `id`: a user buffer (a view's parent) or
    /// one of the device's own.
    fn resolve(&self, s: &State, id: u64) -> Result<wgpu::Buffer> {
        Ok(match id {
            SCRATCH_ID => self.scratch.clone(),
            DUMMY_ID => self.dummy.clone(),
            BAND_PARTIALS_ID => self.band_partials.clone(),
            PARTIALS_ID => s
                .partials
                .clone()
                .ok_or_else(|| self.backend_error("a dispatch binds partials never sized"))?,
            _ => s
                .buffers
                .get(&id)
                .ok_or_else(|| self.unknown(id))?
                .buffer
                .clone(),
        })
    }
}

impl Recorder for WgpuDevice {
    type State = State;

    fn caps(&self) -> &Capabilities {
        &self.caps
    }

    fn readiness(&self, s: &State, d: &Dispatch) -> Readiness {
        let key = PipelineKey {
            name: d.kernel.name,
            reprs: d.reprs.clone(),
            consts: d.consts.clone(),
            overrides: d.overrides.clone(),
        };
        // `prepare` lists the planner's own pipelines: report them ready so that it does.
        if s.collect.is_some() || s.pipelines.contains_key(&key) {
            return Readiness::Ready;
        }
        if !s.building.contains(&key) {
            return Readiness::Absent;
        }
        let (ready, _) = &**self.built;
        if ready
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .contains_key(&key)
        {
            Readiness::Ready
        } else {
            Readiness::Building
        }
    }

    fn want_ahead(&self, s: &mut State, d: Dispatch) {
        let key = PipelineKey {
            name: d.kernel.name,
            reprs: d.reprs,
            consts: d.consts,
            overrides: d.overrides,
        };
        let known = s.pipelines.contains_key(&key) || s.building.contains(&key);
        if let Some(wanted) = &mut s.collect {
            if !known && !wanted.iter().any(|w| w.key == key) {
                wanted.push(Wanted {
                    key,
                    kernel: d.kernel,
                });
            }
        }
    }

    fn note_stand_in(&self, s: &mut State, planned: &str, ran: &str) {
        s.stand_ins += 1;
        if compile_log() {
            eprintln!("kiln: {ran} stands in for {planned}, still building");
        }
    }

    fn tuned_block(
        &self,
        s: &mut State,
        mm: &kiln_engine::Matmul,
        best: &kiln_lowering::MatmulPlan,
        state: &dyn Fn(kiln_lowering::MatmulVariant) -> Readiness,
        ran: &dyn Fn(kiln_lowering::MatmulVariant) -> bool,
    ) -> Result<Option<kiln_lowering::MatmulVariant>> {
        self.tune(s, mm, best, state, ran)
    }

    fn has_run(&self, s: &State, d: &Dispatch) -> bool {
        let key = PipelineKey {
            name: d.kernel.name,
            reprs: d.reprs.clone(),
            consts: d.consts.clone(),
            overrides: d.overrides.clone(),
        };
        // Built ahead and not run yet: its first run compiles the machine code, unless
        // it ran on the primer's device.
        !s.first_runs.contains(&key)
            || self
                .primed_keys
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .contains(&key)
    }

    fn dispatch(&self, s: &mut State, d: Dispatch) -> Result<()> {
        self.record_dispatch(s, d)
    }

    fn copy(&self, s: &mut State, src: &Buffer, dst: &Buffer) -> Result<()> {
        let (a, b) = (self.resolve(s, src.id)?, self.resolve(s, dst.id)?);
        let (from, to) = (s.base(src.id), s.base(dst.id));
        if a == b {
            // Views of one buffer: WebGPU copies only between distinct buffers.
            let tmp = self.device.create_buffer(&wgpu::BufferDescriptor {
                label: Some("kiln copy"),
                size: src.bytes(),
                usage: wgpu::BufferUsages::COPY_SRC | wgpu::BufferUsages::COPY_DST,
                mapped_at_creation: false,
            });
            let e = self.encoder(s);
            e.copy_buffer_to_buffer(&a, from, &tmp, 0, src.bytes());
            e.copy_buffer_to_buffer(&tmp, 0, &b, to, src.bytes());
        } else {
            self.encoder(s)
                .copy_buffer_to_buffer(&a, from, &b, to, src.bytes());
        }
        Ok(())
    }

    fn clear(&self, s: &mut State, buf: &Buffer) -> Result<()> {
        let f = self.resolve(s, buf.id)?;
        let base = s.base(buf.id);
        self.encoder(s).clear_buffer(&f, base, Some(buf.bytes()));
        Ok(())
    }

    fn storage_offset_alignment(&self) -> u64 {
        self.device.limits().min_storage_buffer_offset_alignment as u64
    }

    /// The GEMM partials buffer, at least `bytes` long.
    fn partials(&self, s: &mut State, bytes: u64) -> Result<()> {
        if s.partials.as_ref().is_some_and(|p| p.size() >= bytes) {
            return Ok(());
        }
        // Bind groups of the old buffer would keep it alive and bind the wrong size.
        s.bind_groups
            .retain(|k, _| !k.buffers.contains(&PARTIALS_ID));
        let p = self.device.create_buffer(&wgpu::BufferDescriptor {
            label: Some("kiln matmul partials"),
            size: bytes.max(8),
            usage: wgpu::BufferUsages::STORAGE,
            mapped_at_creation: false,
        });
        s.partials = Some(p);
        Ok(())
    }
}

/// Counts a compile job finished when the worker leaves it, also by a panic.
struct Finished<'a>(&'a (Mutex<usize>, std::sync::Condvar));

impl Drop for Finished<'_> {
    fn drop(&mut self) {
        *self.0 .0.lock().unwrap_or_else(|e| e.into_inner()) -= 1;
        self.0 .1.notify_all();
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

impl Device for WgpuDevice {
    fn caps(&self) -> &Capabilities {
        &self.caps
    }

    fn alloc(&self, dtype: DType, len: usize) -> Result<Buffer> {
        self.call(|| {
            let bytes = check_alloc(&self.caps, dtype, len)?;
            let scope = self.device.push_error_scope(wgpu::ErrorFilter::OutOfMemory);
            let buffer = self.device.create_buffer(&wgpu::BufferDescriptor {
                label: None,
                size: bytes,
                usage: wgpu::BufferUsages::STORAGE
                    | wgpu::BufferUsages::COPY_SRC
                    | wgpu::BufferUsages::COPY_DST,
                mapped_at_creation: false,
            });
            if let Some(e) = pollster::block_on(scope.pop()) {
                return Err(Error::OutOfMemory {
                    device: self.caps.name.clone(),
                    detail: format!(
                        "allocating {bytes} bytes ({} bytes already allocated): {e}. Try a \
                         smaller micro-batch (with more gradient accumulation) or sequence, \
                         fp16/bf16 storage or a smaller model; memory that runs out during \
                         training steps also shrinks with ZeRO stage 1 or 2 over more devices. \
                         `kiln estimate` shows what each needs",
                        self.lock().allocated
                    ),
                });
            }
            let mut s = self.lock();
            let meta = s.register(buffer, dtype, len, None);
            s.allocated += bytes;
            Ok(meta)
        })
    }

    fn free(&self, buf: Buffer) -> Result<()> {
        self.call(|| {
            let mut s = self.lock();
            if s.buffers
                .values()
                .any(|v| v.view_of.is_some_and(|(parent, _)| parent == buf.id))
            {
                return Err(Error::InvalidArgument(format!(
                    "buffer #{} still has views on `{}`: free them first",
                    buf.id, self.caps.name
                )));
            }
            let slot = s
                .buffers
                .remove(&buf.id)
                .ok_or_else(|| self.unknown(buf.id))?;
            if slot.view_of.is_none() {
                s.allocated -= slot.meta.bytes();
            }
            s.bind_groups.retain(|k, _| !k.buffers.contains(&buf.id));
            // Launches already recorded keep their own reference; wgpu frees it after them.
            drop(slot);
            Ok(())
        })
    }

    fn view(&self, parent: Buffer, offset: usize, len: usize) -> Result<Buffer> {
        self.call(|| {
            check_view(parent, offset, len)?;
            let mut s = self.lock();
            let slot = s
                .buffers
                .get(&parent.id)
                .ok_or_else(|| self.unknown(parent.id))?;
            if slot.view_of.is_some() {
                return Err(Error::InvalidArgument(format!(
                    "buffer #{} is itself a view: take views of the buffer it views",
                    parent.id
                )));
            }
            if slot.meta != parent {
                return Err(Error::InvalidArgument(format!(
                    "handle for buffer #{} says {} x {} but it holds {} x {} (a handle from \
                     another device?)",
                    parent.id, parent.len, parent.dtype, slot.meta.len, slot.meta.dtype
                )));
            }
            let buffer = slot.buffer.clone();
            let base = (offset * parent.dtype.size()) as u64;
            Ok(s.register(buffer, parent.dtype, len, Some((parent.id, base))))
        })
    }

    fn upload(&self, buf: Buffer, data: &HostData) -> Result<()> {
        self.call(|| {
            check_upload(buf, data)?;
            let _span = span("upload", SpanKind::Transfer);
            let mut s = self.lock();
            let base = s.base(buf.id);
            let target = &s
                .buffers
                .get(&buf.id)
                .ok_or_else(|| self.unknown(buf.id))?
                .buffer;
            let bytes = data.as_bytes();
            if bytes.is_empty() {
                return Ok(());
            }
            // write_buffer runs before the next submit's commands, so with launches pending
            // it would jump ahead of them; then the copy goes through the stream instead.
            let padded = buf.bytes();
            if s.encoder.is_none() {
                let mut view = self
                    .queue
                    .write_buffer_with(
                        target,
                        base,
                        wgpu::BufferSize::new(padded).expect("padded > 0"),
                    )
                    .ok_or_else(|| self.backend_error("could not stage an upload"))?;
                view.slice(..bytes.len()).copy_from_slice(bytes);
                view.slice(bytes.len()..).fill(0);
            } else {
                let staging = self.device.create_buffer(&wgpu::BufferDescriptor {
                    label: Some("kiln upload"),
                    size: padded,
                    usage: wgpu::BufferUsages::COPY_SRC | wgpu::BufferUsages::MAP_WRITE,
                    mapped_at_creation: true,
                });
                staging
                    .slice(..)
                    .get_mapped_range_mut()
                    .map_err(|e| self.backend_error(format!("staging an upload: {e}")))?
                    .slice(..bytes.len())
                    .copy_from_slice(bytes);
                staging.unmap();
                let target = target.clone();
                self.encoder(&mut s)
                    .copy_buffer_to_buffer(&staging, 0, &target, base, padded);
            }
            Ok(())
        })
    }

    fn begin_download(&self, buf: Buffer) -> Result<PendingDownload> {
        self.call(|| {
            let _span = span("begin download", SpanKind::Transfer);
            let mut s = self.lock();
            let base = s.base(buf.id);
            let src = s
                .buffers
                .get(&buf.id)
                .ok_or_else(|| self.unknown(buf.id))?
                .buffer
                .clone();
            let padded = buf.bytes();
            let readback = self.device.create_buffer(&wgpu::BufferDescriptor {
                label: Some("kiln download"),
                size: padded,
                usage: wgpu::BufferUsages::COPY_DST | wgpu::BufferUsages::MAP_READ,
                mapped_at_creation: false,
            });
            self.encoder(&mut s)
                .copy_buffer_to_buffer(&src, base, &readback, 0, padded);
            let index = self.flush(&mut s)?;
            let ticket = s.next_id;
            s.next_id += 1;
            s.staged.insert(ticket, (readback, index));
            Ok(PendingDownload {
                ticket,
                buffer: buf,
            })
        })
    }

    fn finish_download(&self, pending: PendingDownload) -> Result<HostData> {
        self.call(|| {
            let _span = span("download", SpanKind::Transfer);
            let (readback, index) =
                self.lock().staged.remove(&pending.ticket).ok_or_else(|| {
                    Error::InvalidArgument(format!(
                        "download ticket {} is not pending on `{}` (already finished, or begun on \
                     another device)",
                        pending.ticket, self.caps.name
                    ))
                })?;
            let buf = pending.buffer;
            let slice = readback.slice(..);
            let (tx, rx) = std::sync::mpsc::channel();
            slice.map_async(wgpu::MapMode::Read, move |r| {
                let _ = tx.send(r);
            });
            // Wait for the copy's own submission, not for work queued after it.
            self.device
                .poll(wgpu::PollType::Wait {
                    submission_index: index,
                    timeout: None,
                })
                .map_err(|e| {
                    // A failed submission's cause (a pipeline the driver refused, a lost
                    // device) was reported to the error sink; name it first.
                    match self.check_errors() {
                        Err(Error::Backend { detail, .. }) => {
                            self.backend_error(format!("waiting for a download: {detail} ({e})"))
                        }
                        _ => self.backend_error(format!("waiting for a download: {e}")),
                    }
                })?;
            rx.recv()
                .map_err(|_| self.backend_error("download was cancelled"))?
                .map_err(|e| self.backend_error(format!("mapping a download: {e}")))?;
            let view = slice
                .get_mapped_range()
                .map_err(|e| self.backend_error(format!("reading a download: {e}")))?;
            let data = HostData::from_bytes(buf.dtype, buf.len, &view);
            drop(view);
            readback.unmap();
            self.check_errors()?;
            Ok(data)
        })
    }

    fn launch(&self, kernel: &Kernel) -> Result<()> {
        self.call(|| {
            kernel.validate()?;
            let mut s = self.lock();
            self.check_live(&s, kernel.name(), &kernel.buffers())?;
            let Some(profile) = &self.profile else {
                return self.record_profiled(&mut s, kernel);
            };
            self.flush(&mut s)?;
            self.wait()?;
            let t0 = std::time::Instant::now();
            self.record_profiled(&mut s, kernel)?;
            self.flush(&mut s)?;
            self.wait()?;
            let ms = t0.elapsed().as_secs_f64() * 1e3;
            let key = match kernel {
                Kernel::Matmul(m) => format!("matmul {}x{}x{} b{}", m.m, m.n, m.k, m.batch),
                k => k.name().to_string(),
            };
            let mut p = profile.lock().unwrap_or_else(|e| e.into_inner());
            let e = p.entry(key).or_insert((0, 0.0));
            e.0 += 1;
            e.1 += ms;
            Ok(())
        })
    }

    fn prepare(&self, kernels: &[Kernel]) -> Result<()> {
        self.call(|| {
            let mut s = self.lock();
            let wanted = self.missing_pipelines(&mut s, kernels)?;
            self.compile_all(&mut s, wanted)
        })
    }

    fn submit(&self) -> Result<()> {
        self.call(|| {
            let mut s = self.lock();
            self.flush(&mut s).map(drop)
        })
    }

    fn wait(&self) -> Result<()> {
        self.call(|| {
            let _span = span("wait", SpanKind::Wait);
            self.device
                .poll(wgpu::PollType::wait_indefinitely())
                .map_err(|e| self.backend_error(format!("waiting for the device: {e}")))?;
            self.check_errors()
        })
    }

    fn allocated_bytes(&self) -> u64 {
        self.lock().allocated
    }

    fn profile_begin(&self) -> Result<()> {
        self.call(|| self.begin_profile())
    }

    fn profile_end(&self) -> Result<Vec<KernelTiming>> {
        self.call(|| self.end_profile())
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
