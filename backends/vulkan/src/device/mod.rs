//! A raw Vulkan device behind Kiln's device contract.
//!
//! Resource lifetimes, explicitly:
//! - buffers are gpu-allocator allocations from `alloc` to `free`; a freed buffer (and
//!   every staging buffer, parameter arena and command buffer) is retired with the
//!   timeline value of the last submission that can use it, and released once the
//!   device's timeline semaphore has passed that value;
//! - pipelines (one per kernel, dtype representation, constants and overrides) and
//!   their layouts are created on first use and kept for the device's life, all
//!   through one `VkPipelineCache`;
//! - launches are recorded into one open command buffer (the stream); their
//!   parameters go into a host-visible arena bound as a uniform buffer by push
//!   descriptor, and the stream is submitted as one batch that signals the next value
//!   of the timeline semaphore;
//! - where the device has a dedicated transfer queue family, downloads are copied on
//!   that queue ([`Transfer`]), with its own command pool and timeline: a copy waits
//!   for the compute value that wrote its source, and only a compute stream that
//!   overwrites a buffer a copy still reads waits for the copy's transfer value, so
//!   the copy runs beside the rest of the compute work. Its staging buffer, its
//!   command buffer and a buffer freed while a copy reads it are retired by both
//!   timelines' values ([`Tag`]).

use std::collections::HashMap;
use std::sync::{Mutex, MutexGuard};

use ash::vk;
use gpu_allocator::vulkan::{
    Allocation, AllocationCreateDesc, AllocationScheme, Allocator, AllocatorCreateDesc,
};
use gpu_allocator::MemoryLocation;
use kiln_engine::device::compiling::{self, log_enabled as compile_log};
use kiln_engine::device::cost::KernelCost;
use kiln_engine::device::profile::{span, SpanKind};
use kiln_engine::device::{
    check_alloc, check_profile_begin, check_upload, check_view, KernelTiming,
};
use kiln_engine::{
    Buffer, Capabilities, DType, Device, Error, HostData, Kernel, PendingDownload, Result,
};
use kiln_lowering::shader::{Access, KernelSource, Repr, MATMUL_PARAMS_SIZE};
use kiln_lowering::{
    attention_geometry, attention_launches, band_partials_bytes, gemm_stand_in, plan_matmul,
    record_kernel, scratch_bytes, split_finish, split_partials, AttentionPlan, DeviceOptions,
    Dispatch, MatmulVariant, Readiness, Recorder, BAND_PARTIALS_ID, DUMMY_BYTES, DUMMY_ID,
    PARTIALS_ID, SCRATCH_ID,
};
use naga::back::spv::Capability;

use crate::attention;
use crate::coopmat::{self, CoopMat, CoopMatPlan};
use crate::gemm::{self, GemmDevice, GemmRoute, GpuGemmPlan, SpirvGemmPlan};
use crate::instance::{Features, Instance};
use crate::primer::{AttentionRecipe, Block, Job, PrimeOn, Primed, Primer};

mod attention_launch;
mod cache;
mod contract;
mod dispatch;
mod gemm_launch;
mod gemm_selection;
mod open;
mod priming;
#[cfg(feature = "test-hooks")]
mod test_hooks;
mod timeline;
mod transfer;

/// KILN_GEMM_LOG=1: say which GEMM each product runs on, and why not the others.
fn gemm_log() -> bool {
    std::env::var_os("KILN_GEMM_LOG").is_some_and(|v| v != "0")
}

/// Launches whose parameters fit one arena; past that the stream is submitted early.
const ARENA_SLOTS: u64 = 4096;

/// A buffer and its memory.
struct Mem {
    buffer: vk::Buffer,
    alloc: Allocation,
    size: u64,
    /// A parameter arena, reused by later streams once its submission is done.
    arena: bool,
}

struct Slot {
    meta: Buffer,
    /// A buffer of its own, or a view: the buffer it views and its first byte.
    kind: SlotKind,
}

enum SlotKind {
    Own(Mem),
    View { parent: u64, base: u64 },
}

#[derive(Clone, PartialEq, Eq, Hash)]
struct PipelineKey {
    name: &'static str,
    reprs: Vec<Repr>,
    consts: Vec<(&'static str, u32)>,
    overrides: Vec<(&'static str, u32)>,
}

/// What a submission holds until the device has run it.
#[derive(Default)]
struct Retired {
    mems: Vec<Mem>,
    commands: Vec<vk::CommandBuffer>,
    /// Command buffers of the transfer queue's pool.
    transfer_commands: Vec<vk::CommandBuffer>,
    /// Texel views the CPU-class GEMM read A and B through (made per launch).
    views: Vec<vk::BufferView>,
}

/// When something retired is unused: once the compute timeline has passed the first
/// value and the transfer timeline the second (0: no wait on that one).
type Tag = (u64, u64);

/// The open stream.
struct Stream {
    cmd: vk::CommandBuffer,
    arena: Mem,
    /// Bytes of the arena used.
    used: u64,
    /// The transfer timeline value the stream must wait for before it runs (0: none):
    /// it writes a buffer a transfer copy still reads.
    wait_transfer: u64,
}

/// KILN_VK_TRANSFER: where downloads run.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum TransferChoice {
    /// Unset: on the device's dedicated transfer family where it has one.
    Auto,
    /// `0`: on the compute stream, as a device without a transfer family does.
    Off,
    /// `same-queue` (for tests): the whole transfer path (its own command pool,
    /// timeline and waits) on the compute queue, so a device without a transfer
    /// family, such as lavapipe, runs it.
    SameQueue,
}

fn transfer_choice(var: Option<&std::ffi::OsStr>) -> Result<TransferChoice> {
    match var.map(|v| v.to_str()) {
        None => Ok(TransferChoice::Auto),
        Some(Some("0")) => Ok(TransferChoice::Off),
        Some(Some("same-queue")) => Ok(TransferChoice::SameQueue),
        Some(v) => Err(Error::InvalidArgument(format!(
            "KILN_VK_TRANSFER={}: use 0 (downloads on the compute queue) or unset it (on a \
             dedicated transfer queue where the device has one)",
            v.unwrap_or("<not UTF-8>")
        ))),
    }
}

/// The queue downloads are copied on, beside the compute stream: its own command
/// pool and timeline semaphore. Its copies wait for the compute timeline value that
/// wrote their source; compute submissions that write a buffer a copy still reads
/// wait for the copy's transfer value, and a buffer freed meanwhile is released only
/// after the copy.
struct Transfer {
    queue: vk::Queue,
    family: u32,
    pool: vk::CommandPool,
    timeline: vk::Semaphore,
    /// Last transfer timeline value submitted.
    submitted: u64,
    free_commands: Vec<vk::CommandBuffer>,
    /// Test hook ([`VkDevice::hold_transfers`]): a timeline semaphore every copy
    /// also waits for (value 1) until the host signals it, and whether it is holding.
    gate: Option<(vk::Semaphore, bool)>,
}

#[doc(hidden)]
pub struct State {
    next_id: u64,
    buffers: HashMap<u64, Slot>,
    allocated: u64,
    allocator: Option<Allocator>,
    layouts: HashMap<(Vec<Access>, u64), (vk::DescriptorSetLayout, vk::PipelineLayout)>,
    pipelines: HashMap<PipelineKey, vk::Pipeline>,
    /// Hand-written kernels (shaders/vulkan's GLSL, the cooperative-matrix modules), by
    /// name: pipeline, set and pipeline layouts.
    glsl: HashMap<String, (vk::Pipeline, vk::DescriptorSetLayout, vk::PipelineLayout)>,
    /// The SPIR-V GEMM's pipelines (one per module and specialization) and their
    /// shared layouts.
    gemm: HashMap<SpirvGemmPlan, vk::Pipeline>,
    /// GEMM blocks (pipeline keys) recorded here outside `prepare`: their first run,
    /// which compiles their machine code on a software driver, is behind them.
    ran: std::collections::HashSet<SpirvGemmPlan>,
    /// Attention kernels (their pipelines' names) recorded here outside `prepare`.
    ran_attention: std::collections::HashSet<String>,
    /// The tiled GEMM's and the GEMV's SPIR-V twins' pipelines, by specialization.
    gemm_gpu: HashMap<GpuGemmPlan, vk::Pipeline>,
    /// The SPIR-V GEMMs' layouts: A and B as storage buffers, and as texel buffers.
    gemm_layout: [Option<(vk::DescriptorSetLayout, vk::PipelineLayout)>; 2],
    /// The measured GEMM selection's winners and what it has spent
    /// (`gemm_selection.rs`).
    tuner: kiln_lowering::gemm_select::Tuner,
    stream: Option<Stream>,
    /// Last timeline value submitted.
    submitted: u64,
    /// Resources waiting for the timelines to pass their values.
    retired: Vec<(Tag, Retired)>,
    /// Command buffers and arenas free for reuse.
    free_commands: Vec<vk::CommandBuffer>,
    free_arenas: Vec<Mem>,
    partials: Option<Mem>,
    scratch: Option<Mem>,
    band_partials: Option<Mem>,
    dummy: Option<Mem>,
    /// Begun downloads: their staging buffer and the timeline values (compute,
    /// transfer; one of them 0) after which it is filled.
    staged: HashMap<u64, (Mem, Tag)>,
    /// The transfer queue, where downloads have one.
    transfer: Option<Transfer>,
    /// Buffers (views resolved to their own buffer) a transfer copy may still read, and
    /// the transfer value after which it no longer does; kept until a compute stream
    /// waits for it, the buffer is freed, or the host has waited for the copy (dropping
    /// it when the device alone has run the copy would make whether a wait is added
    /// depend on timing).
    transfer_reads: HashMap<vk::Buffer, u64>,
    /// Timestamps of an open profile (`Device::profile_begin`).
    profiling: Option<Profiling>,
    /// While [`Device::prepare`] looks for missing pipelines: dispatches are collected
    /// here instead of recorded, and nothing else is recorded.
    collect: Option<Vec<(PipelineKey, &'static KernelSource)>>,
}

/// Timestamps per query pool of a profile.
const PER_POOL: u32 = 4096;
/// Calibration round trips at `profile_begin`.
const CALIBRATIONS: usize = 3;

/// GPU timestamps around every launch of a profiled stretch: one written after
/// everything before a launch and one after the launch (each command is followed by a
/// full barrier, so the launch runs between them), read back once at `profile_end`.
/// Ticks are put on the host's clock by calibration stamps at `profile_begin`, as the
/// wgpu backend does: the midpoint of the tightest of a few submit-and-wait round trips.
struct Profiling {
    pools: Vec<vk::QueryPool>,
    used: u32,
    launches: Vec<(KernelCost, u32, u32)>,
    /// A calibration stamp and the host instants around its submission and completion.
    calibration: (u32, std::time::Instant, std::time::Instant),
}

pub struct VkDevice {
    caps: Capabilities,
    features: Features,
    allowed: naga::FastHashSet<Capability>,
    device: ash::Device,
    push: ash::khr::push_descriptor::Device,
    queue: vk::Queue,
    /// The compute queue's family (read by a test hook).
    #[cfg_attr(not(feature = "test-hooks"), allow(dead_code))]
    family: u32,
    pool: vk::CommandPool,
    timeline: vk::Semaphore,
    cache: vk::PipelineCache,
    /// Where the pipeline cache is saved when the device is dropped, and its key.
    disk_cache: Option<(std::path::PathBuf, u64)>,
    /// Pipelines were built since the cache was loaded.
    built: std::sync::atomic::AtomicBool,
    /// Where to write each kernel's SPIR-V as it is built ([`VkDevice::dump_spirv_to`]).
    dump: Mutex<Option<std::path::PathBuf>>,
    arena_stride: u64,
    /// `Kernel::Matmul` launches recorded by the SPIR-V GEMM, by the naga path and by
    /// the cooperative-matrix GEMM.
    gemm_counts: [std::sync::atomic::AtomicU64; 3],
    /// Dispatches of the hand-written fused attention recorded so far.
    attention_count: std::sync::atomic::AtomicU64,
    /// The attention plan tests force ([`VkDevice::force_attention_plan`]).
    attention_plan: Mutex<Option<AttentionPlan>>,
    /// The GEMM kernel tests force ([`VkDevice::force_gemm_variant`]).
    gemm_variant: Mutex<Option<MatmulVariant>>,
    /// The CPU-class GEMM reads A and B through texel views where it can (tests turn
    /// it off: [`VkDevice::use_texel_gemm`]).
    texel_gemm: std::sync::atomic::AtomicBool,
    /// CPU-class GEMM launches recorded that read A and B through texel views.
    texel_count: std::sync::atomic::AtomicU64,
    /// What the cooperative-matrix GEMM runs with here, or why it does not run.
    coopmat: std::result::Result<CoopMat, String>,
    /// Runs big GEMM blocks and attention passes first on a second device (software
    /// drivers; `primer.rs`).
    primer: Option<std::sync::Arc<Primer>>,
    /// GEMM and attention launches that ran a stand-in while theirs was primed.
    stand_ins: std::sync::atomic::AtomicU64,
    /// Submissions fail as on a lost device ([`VkDevice::simulate_device_lost`]).
    lost: std::sync::atomic::AtomicBool,
    /// The compute and a dedicated transfer family, which user buffers are shared
    /// between (`SharingMode::CONCURRENT`); empty without a dedicated one.
    shared_families: Vec<u32>,
    /// Submissions to the transfer queue, and compute submissions that waited for one.
    transfer_counts: [std::sync::atomic::AtomicU64; 2],
    state: Mutex<State>,
    /// Dropped after `Drop` has destroyed the device, it destroys the instance last;
    /// read only for the validation layer's reports ([`VkDevice::validated`]).
    instance: Instance,
}

impl VkDevice {
    /// From now on, writes the SPIR-V of every pipeline this device builds into `dir`
    /// (one `.spv` file per kernel, dtype representation, constants and overrides), so
    /// that tools (`spirv-val`, `spirv-dis`) can check what the device runs.
    pub fn dump_spirv_to(&self, dir: &std::path::Path) -> Result<()> {
        std::fs::create_dir_all(dir)
            .map_err(|e| Error::InvalidArgument(format!("cannot create {}: {e}", dir.display())))?;
        *self.dump.lock().unwrap_or_else(|e| e.into_inner()) = Some(dir.to_path_buf());
        Ok(())
    }

    fn dump_spirv(&self, key: &PipelineKey, words: &[u32]) -> Result<()> {
        let dir = self.dump.lock().unwrap_or_else(|e| e.into_inner()).clone();
        let Some(dir) = dir else { return Ok(()) };
        let what = format!("{:?}{:?}{:?}", key.reprs, key.consts, key.overrides);
        let name = format!(
            "{}-{:016x}.spv",
            key.name,
            kiln_lowering::pipeline_cache::fnv(what.as_bytes())
        );
        let bytes: Vec<u8> = words.iter().flat_map(|w| w.to_le_bytes()).collect();
        std::fs::write(dir.join(&name), bytes)
            .map_err(|e| self.backend_error(format!("writing {name} into {}: {e}", dir.display())))
    }

    /// Pipelines built so far (tests check that a prepared plan's launches add none).
    pub fn pipeline_count(&self) -> usize {
        let s = self.lock();
        s.pipelines.len() + s.gemm.len() + s.gemm_gpu.len() + s.glsl.len()
    }

    /// Which GEMM a `Kernel::Matmul` of `mm` runs here, and why (see [`GemmRoute`]).
    pub fn gemm_route(&self, mm: &kiln_engine::Matmul) -> Result<GemmRoute> {
        mm.validate()?;
        let s = self.lock();
        self.check_live(&s, "matmul", &mm.buffers())?;
        Ok(match self.coopmat_plan(&s, mm)? {
            Ok(p) => GemmRoute::CoopMat(p),
            Err(_) => self.route(&s, mm)?,
        })
    }

    /// Whether the cooperative-matrix GEMM runs `mm` here: its plan, or why not (on a
    /// device without cooperative matrices: "no cooperative matrix: ...").
    pub fn coopmat_route(
        &self,
        mm: &kiln_engine::Matmul,
    ) -> Result<std::result::Result<CoopMatPlan, String>> {
        mm.validate()?;
        let s = self.lock();
        self.check_live(&s, "matmul", &mm.buffers())?;
        self.coopmat_plan(&s, mm)
    }

    /// What the cooperative-matrix GEMM runs with on this device (its tile shape and
    /// workgroup), or why it does not run here.
    pub fn cooperative_matrix(&self) -> std::result::Result<CoopMat, String> {
        self.coopmat.clone()
    }

    fn coopmat_plan(
        &self,
        s: &State,
        mm: &kiln_engine::Matmul,
    ) -> Result<std::result::Result<CoopMatPlan, String>> {
        let offset = |id| -> Result<u64> { Ok(self.resolve(s, id)?.1) };
        let offsets = coopmat::Offsets {
            a: offset(mm.a.id)?,
            b: offset(mm.b.id)?,
            c: offset(mm.c.id)?,
        };
        let coop = self.coopmat.as_ref().map(|c| *c).map_err(|e| e.as_str());
        Ok(coopmat::route(mm, &self.caps, coop, offsets))
    }

    fn route(&self, s: &State, mm: &kiln_engine::Matmul) -> Result<GemmRoute> {
        let pinned = *self.gemm_variant.lock().unwrap_or_else(|e| e.into_inner());
        self.route_with(s, mm, pinned)
    }

    /// [`VkDevice::route`] with the planner made to pick `force` (a pin, or a
    /// candidate of the measured selection).
    fn route_with(
        &self,
        s: &State,
        mm: &kiln_engine::Matmul,
        force: Option<MatmulVariant>,
    ) -> Result<GemmRoute> {
        let (_, b_offset, _) = self.resolve(s, mm.b.id)?;
        let (_, a_offset, _) = self.resolve(s, mm.a.id)?;
        let dev = GemmDevice {
            subgroup_control: self.features.subgroup_control.map(|c| c.sizes),
            b_offset,
            a_offset,
            max_shared: self.features.max_shared,
            max_invocations: self.features.max_invocations,
            max_group_x: self.features.max_group_x,
            force,
            texel: self.features.texel.filter(|_| {
                self.texel_gemm.load(std::sync::atomic::Ordering::Relaxed)
                    && self.texel_room(s, mm.a.id)
                    && self.texel_room(s, mm.b.id)
            }),
        };
        Ok(gemm::route(mm, &self.caps, dev))
    }

    /// Whether buffer `id` (a view: its parent) was made for texel views, with the 256
    /// bytes past its data that `texel_view` may size a view into
    /// (`contract::texel_buffer_size`).
    fn texel_room(&self, s: &State, id: u64) -> bool {
        let Some(slot) = s.buffers.get(&id) else {
            return false;
        };
        let (mem, end) = match &slot.kind {
            SlotKind::Own(m) => (m, slot.meta.bytes()),
            SlotKind::View { parent, base } => match s.buffers.get(parent).map(|p| &p.kind) {
                Some(SlotKind::Own(m)) => (m, base + slot.meta.bytes()),
                _ => return false,
            },
        };
        mem.size >= end + 256
    }

    /// `Kernel::Matmul` launches so far: (by the SPIR-V GEMMs — the CPU-class kernel
    /// and the tiled GEMM's and the GEMV's twins —, by the naga path); the
    /// cooperative-matrix GEMM's are [`VkDevice::coopmat_launches`].
    pub fn gemm_launches(&self) -> (u64, u64) {
        let get = |i: usize| self.gemm_counts[i].load(std::sync::atomic::Ordering::Relaxed);
        (get(0), get(1))
    }

    /// `Kernel::Matmul` launches the cooperative-matrix GEMM recorded so far.
    pub fn coopmat_launches(&self) -> u64 {
        self.gemm_counts[2].load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Dispatches of the hand-written fused attention (`shaders/vulkan/attention.comp`)
    /// recorded so far: every `Kernel::Attention` and `Kernel::AttentionBackward` runs
    /// there (tests check the route by it).
    pub fn attention_launches(&self) -> u64 {
        self.attention_count
            .load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Plans every GEMM with `variant` instead of the planner's choice (`None`: the
    /// planner's again), so that tests reach the tiled GEMM's SPIR-V twin on a CPU
    /// driver. Only the SPIR-V route follows it: a product it sends to the naga path
    /// runs the planner's own kernel there.
    #[doc(hidden)]
    pub fn force_gemm_variant(&self, variant: Option<MatmulVariant>) {
        *self.gemm_variant.lock().unwrap_or_else(|e| e.into_inner()) = variant;
    }

    /// `Kernel::Matmul` launches the CPU-class SPIR-V GEMM recorded reading A and B
    /// through texel views (of [`VkDevice::gemm_launches`]' first count).
    pub fn texel_gemm_launches(&self) -> u64 {
        self.texel_count.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Lets the CPU-class SPIR-V GEMM read A and B through texel views where the device
    /// has them (`true`, the default) or makes it use storage loads, so that tests and
    /// benchmarks compare the two (the same sums).
    #[doc(hidden)]
    pub fn use_texel_gemm(&self, on: bool) {
        self.texel_gemm
            .store(on, std::sync::atomic::Ordering::Relaxed);
    }

    /// Records `kernel` (validated, its buffers live): a GEMM the SPIR-V kernel covers
    /// through it, fused attention through the GLSL passes, everything else through the
    /// shared lowering.
    fn record(&self, s: &mut State, kernel: &Kernel) -> Result<()> {
        if matches!(kernel, Kernel::Attention(_) | Kernel::AttentionBackward(_)) {
            return self.record_attention(s, kernel);
        }
        if let Kernel::Matmul(mm) = kernel {
            let route = match self.coopmat_plan(s, mm)? {
                Ok(p) => GemmRoute::CoopMat(p),
                Err(why) => {
                    // Where the device has the cooperative-matrix GEMM, every product it
                    // does not take says why (a device without it said so at open).
                    if self.coopmat.is_ok() && gemm_log() {
                        eprintln!(
                            "kiln: vk {}x{}x{} (batch {}) GEMM not on the cooperative-matrix \
                             GEMM: {why}",
                            mm.m, mm.n, mm.k, mm.batch
                        );
                    }
                    let planned = self.route(s, mm)?;
                    self.selected_route(s, mm, planned)?
                }
            };
            if s.collect.is_none() {
                let which = match route {
                    GemmRoute::Spirv(_) | GemmRoute::SpirvGpu(_) => 0,
                    GemmRoute::Naga(_) => 1,
                    GemmRoute::CoopMat(_) => 2,
                };
                self.gemm_counts[which].fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            }
            match route {
                GemmRoute::CoopMat(p) => return self.record_coopmat_gemm(s, mm, &p),
                GemmRoute::Spirv(p) => {
                    let block = self.gemm_block(s, mm, &p);
                    if s.collect.is_some() && block != p {
                        // `prepare` builds the planned block's pipeline too, so the
                        // switch once it is primed builds nothing.
                        self.gemm_pipeline(s, &p)?;
                    }
                    return self.record_spirv_gemm(s, mm, &block);
                }
                GemmRoute::SpirvGpu(p) => return self.record_gpu_gemm(s, mm, &p),
                GemmRoute::Naga(why) => {
                    if gemm_log() {
                        eprintln!(
                            "kiln: vk {}x{}x{} (batch {}) GEMM on the naga path: {why}",
                            mm.m, mm.n, mm.k, mm.batch
                        );
                    }
                }
            }
        }
        record_kernel(self, s, kernel)
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn backend_error(&self, detail: impl Into<String>) -> Error {
        Error::Backend {
            device: self.caps.name.clone(),
            detail: detail.into(),
        }
    }

    /// A Vulkan error as Kiln reports it: a lost device and exhausted memory by name,
    /// with what to do.
    fn vk_error(&self, what: &str, e: vk::Result) -> Error {
        if e == vk::Result::ERROR_DEVICE_LOST {
            // It stays lost: later waits fail too (see `wait_on`).
            self.lost.store(true, std::sync::atomic::Ordering::Relaxed);
        }
        match e {
            vk::Result::ERROR_DEVICE_LOST => self.backend_error(format!(
                "{what}: the Vulkan device was lost (the driver reset it or crashed; a \
                 kernel that ran too long can cause it). Its buffers are gone: reopen the \
                 device and resume from a checkpoint"
            )),
            vk::Result::ERROR_OUT_OF_DEVICE_MEMORY | vk::Result::ERROR_OUT_OF_HOST_MEMORY => {
                Error::OutOfMemory {
                    device: self.caps.name.clone(),
                    detail: format!("{what}: {e}"),
                }
            }
            e => self.backend_error(format!("{what}: {e}")),
        }
    }

    /// The validation layer's errors since the last sync point, as an error: every
    /// sync point asks, so a launch the layer rejects fails the test (or run) that made
    /// it, without the test looking.
    fn validated(&self) -> Result<()> {
        let errors = self.instance.take_validation_errors();
        let Some(first) = errors.first() else {
            return Ok(());
        };
        // One bad kernel repeats its message per build: each different one is named once.
        let mut others: Vec<&str> = vec![];
        for e in &errors[1..] {
            if e != first && !others.contains(&e.as_str()) {
                others.push(e);
            }
        }
        let more = match (errors.len() - 1, others.is_empty()) {
            (0, _) => String::new(),
            (n, true) => format!(" (reported {} times)", n + 1),
            (n, false) => format!(" (and {n} more, among them: {})", others.join(" | ")),
        };
        Err(self.backend_error(format!(
            "Vulkan validation error: {first}{more}. This is a fault in Kiln's `vk` backend \
             (please report it); KILN_VK_VALIDATION=0 runs without the validation layer"
        )))
    }

    fn unknown(&self, id: u64) -> Error {
        Error::UnknownBuffer {
            id,
            device: self.caps.name.clone(),
        }
    }

    /// A buffer with memory at `location`, used by the compute queue only.
    fn make(
        &self,
        s: &mut State,
        size: u64,
        usage: vk::BufferUsageFlags,
        location: MemoryLocation,
    ) -> Result<Mem> {
        self.make_shared(s, size, usage, location, false)
    }

    /// [`VkDevice::make`], with `shared`: usable by the compute and a dedicated
    /// transfer queue alike (concurrent sharing, so no ownership transfers).
    fn make_shared(
        &self,
        s: &mut State,
        size: u64,
        usage: vk::BufferUsageFlags,
        location: MemoryLocation,
        shared: bool,
    ) -> Result<Mem> {
        let size = size.max(16);
        let info = vk::BufferCreateInfo::default()
            .size(size)
            .usage(usage)
            .sharing_mode(vk::SharingMode::EXCLUSIVE);
        let info = if shared && self.shared_families.len() > 1 {
            info.sharing_mode(vk::SharingMode::CONCURRENT)
                .queue_family_indices(&self.shared_families)
        } else {
            info
        };
        // SAFETY: a valid create info on a live device.
        let buffer = unsafe { self.device.create_buffer(&info, None) }
            .map_err(|e| self.vk_error("creating a buffer", e))?;
        // SAFETY: `buffer` was just created on this device.
        let requirements = unsafe { self.device.get_buffer_memory_requirements(buffer) };
        let allocator = s.allocator.as_mut().expect("allocator lives until drop");
        let alloc = match allocator.allocate(&AllocationCreateDesc {
            name: "kiln",
            requirements,
            location,
            linear: true,
            allocation_scheme: AllocationScheme::GpuAllocatorManaged,
        }) {
            Ok(a) => a,
            Err(e) => {
                // SAFETY: the buffer has no memory and is used nowhere.
                unsafe { self.device.destroy_buffer(buffer, None) };
                return Err(match e {
                    gpu_allocator::AllocationError::OutOfMemory => Error::OutOfMemory {
                        device: self.caps.name.clone(),
                        detail: format!(
                            "allocating {size} bytes ({} bytes already allocated). Try a \
                             smaller micro-batch (with more gradient accumulation) or \
                             sequence, fp16/bf16 storage or a smaller model; `kiln estimate` \
                             shows what each needs",
                            s.allocated
                        ),
                    },
                    e => self.backend_error(format!("allocating {size} bytes: {e}")),
                });
            }
        };
        // SAFETY: the allocation satisfies the buffer's requirements.
        if let Err(e) = unsafe {
            self.device
                .bind_buffer_memory(buffer, alloc.memory(), alloc.offset())
        } {
            // SAFETY: as above; the allocation goes back unused.
            unsafe { self.device.destroy_buffer(buffer, None) };
            let _ = allocator.free(alloc);
            return Err(self.vk_error("binding buffer memory", e));
        }
        Ok(Mem {
            buffer,
            alloc,
            size,
            arena: false,
        })
    }

    /// Releases a buffer the device no longer uses.
    fn destroy(&self, s: &mut State, mem: Mem) {
        // SAFETY: callers pass buffers no pending submission uses.
        unsafe { self.device.destroy_buffer(mem.buffer, None) };
        if let Some(a) = s.allocator.as_mut() {
            let _ = a.free(mem.alloc);
        }
    }
}

impl Drop for VkDevice {
    fn drop(&mut self) {
        // Copies held by a test hook would keep the device busy for ever.
        #[cfg(feature = "test-hooks")]
        let _ = self.release_transfers();
        // SAFETY: after the device is idle nothing uses any object below; each is
        // destroyed once, the device after them and the instance (a field) last.
        unsafe {
            let _ = self.device.device_wait_idle();
            let mut s = self.state.lock().unwrap_or_else(|e| e.into_inner());
            let mut mems: Vec<Mem> = vec![];
            if let Some(st) = s.stream.take() {
                mems.push(st.arena);
            }
            for (_, r) in std::mem::take(&mut s.retired) {
                mems.extend(r.mems);
                for v in r.views {
                    self.device.destroy_buffer_view(v, None);
                }
            }
            mems.extend(std::mem::take(&mut s.free_arenas));
            for (_, slot) in std::mem::take(&mut s.buffers) {
                if let SlotKind::Own(m) = slot.kind {
                    mems.push(m);
                }
            }
            for (_, (m, _)) in std::mem::take(&mut s.staged) {
                mems.push(m);
            }
            mems.extend(
                [
                    s.partials.take(),
                    s.scratch.take(),
                    s.band_partials.take(),
                    s.dummy.take(),
                ]
                .into_iter()
                .flatten(),
            );
            for m in mems {
                self.destroy(&mut s, m);
            }
            if let Some(p) = s.profiling.take() {
                for pool in p.pools {
                    self.device.destroy_query_pool(pool, None);
                }
            }
            for (_, (p, set, pl)) in s.glsl.drain() {
                self.device.destroy_pipeline(p, None);
                self.device.destroy_pipeline_layout(pl, None);
                self.device.destroy_descriptor_set_layout(set, None);
            }
            for (_, p) in s.pipelines.drain() {
                self.device.destroy_pipeline(p, None);
            }
            for (_, p) in s.gemm.drain() {
                self.device.destroy_pipeline(p, None);
            }
            for (_, p) in s.gemm_gpu.drain() {
                self.device.destroy_pipeline(p, None);
            }
            for (set, pl) in s.gemm_layout.iter_mut().filter_map(Option::take) {
                self.device.destroy_pipeline_layout(pl, None);
                self.device.destroy_descriptor_set_layout(set, None);
            }
            for (_, (set, pl)) in s.layouts.drain() {
                self.device.destroy_pipeline_layout(pl, None);
                self.device.destroy_descriptor_set_layout(set, None);
            }
            drop(s.allocator.take());
            self.save_cache();
            self.device.destroy_pipeline_cache(self.cache, None);
            self.device.destroy_semaphore(self.timeline, None);
            self.device.destroy_command_pool(self.pool, None);
            if let Some(x) = s.transfer.take() {
                if let Some((gate, _)) = x.gate {
                    self.device.destroy_semaphore(gate, None);
                }
                self.device.destroy_semaphore(x.timeline, None);
                self.device.destroy_command_pool(x.pool, None);
            }
            self.device.destroy_device(None);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::gemm_launch::{spirv_words, GEMM_F32_SPV};
    use super::*;

    #[test]
    fn kiln_vk_transfer_chooses_where_downloads_are_copied() {
        use std::ffi::OsStr;
        assert_eq!(transfer_choice(None).unwrap(), TransferChoice::Auto);
        assert_eq!(
            transfer_choice(Some(OsStr::new("0"))).unwrap(),
            TransferChoice::Off
        );
        assert_eq!(
            transfer_choice(Some(OsStr::new("same-queue"))).unwrap(),
            TransferChoice::SameQueue
        );
        let e = transfer_choice(Some(OsStr::new("dma")))
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("KILN_VK_TRANSFER=dma") && e.contains("use 0"),
            "{e}"
        );
    }

    #[test]
    fn a_damaged_spv_is_an_error_naming_the_file_and_the_fix() {
        for bad in [
            &b""[..],
            b"garbage!",
            &GEMM_F32_SPV[..GEMM_F32_SPV.len() - 1],
        ] {
            let e = spirv_words("gemm_f32", bad).unwrap_err();
            assert!(
                e.contains("shaders/vulkan/spv/gemm_f32.spv")
                    && e.contains("shaders/vulkan/build.sh"),
                "{e}"
            );
        }
        assert_eq!(
            spirv_words("gemm_f32", GEMM_F32_SPV).unwrap().len() * 4,
            GEMM_F32_SPV.len()
        );
    }
}
