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
use kiln_engine::device::compiling;
use kiln_engine::device::cost::KernelCost;
use kiln_engine::device::profile::{span, SpanKind};
use kiln_engine::device::{check_upload, check_view, KernelTiming};
use kiln_engine::{
    Buffer, Capabilities, DType, Device, Error, HostData, Kernel, PendingDownload, Result,
};
use kiln_wgpu::lower::{
    self, band_partials_bytes, scratch_bytes, Dispatch, Readiness, Recorder, BAND_PARTIALS_ID,
    DUMMY_BYTES, DUMMY_ID, PARTIALS_ID, SCRATCH_ID,
};
use kiln_wgpu::shader::{Access, KernelSource, Repr, MATMUL_PARAMS_SIZE};
use kiln_wgpu::{
    attention_geometry, attention_launches, gemm_stand_in, plan_matmul, split_finish,
    split_partials, AttentionPlan, DeviceOptions, MatmulVariant,
};
use naga::back::spv::Capability;

use crate::attention;
use crate::coopmat::{self, CoopMat, CoopMatPlan};
use crate::gemm::{self, GemmDevice, GemmRoute, GpuGemmPlan, SpirvGemmPlan};
use crate::instance::{Features, Instance};
use crate::primer::{AttentionRecipe, Block, Job, Primed, Primer};

/// KILN_GEMM_LOG=1: say which GEMM each product runs on, and why not the others.
fn gemm_log() -> bool {
    std::env::var_os("KILN_GEMM_LOG").is_some_and(|v| v != "0")
}

/// KILN_COMPILE_LOG=1: say what each pipeline build (and each priming) took.
pub(crate) fn compile_log() -> bool {
    std::env::var_os("KILN_COMPILE_LOG").is_some_and(|v| v != "0")
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
    gemm_layout: Option<(vk::DescriptorSetLayout, vk::PipelineLayout)>,
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
    /// The compute queue's family.
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
    /// Opens a new, independent device on `vk:index` (see `kiln devices`).
    pub fn open(index: usize, options: &DeviceOptions) -> Result<VkDevice> {
        Self::open_with(index, options, true)
    }

    /// Opens `vk:index` without a primer (see `primer.rs`): big GEMM blocks then
    /// compile at their first run here, as on a GPU driver.
    #[doc(hidden)]
    pub fn open_unprimed(index: usize, options: &DeviceOptions) -> Result<VkDevice> {
        Self::open_with(index, options, false)
    }

    fn open_with(index: usize, options: &DeviceOptions, primed: bool) -> Result<VkDevice> {
        let instance = Instance::new()?;
        let pds = instance.physical_devices();
        let pd = *pds.get(index).ok_or_else(|| {
            if pds.is_empty() {
                Error::NoAdapter {
                    hint: format!("no Vulkan device found. {}", crate::NO_VULKAN_HINT),
                }
            } else {
                Error::InvalidArgument(format!(
                    "device `vk:{index}`: only {} Vulkan device(s) found (numbered from 0); \
                     run `kiln devices` to list them",
                    pds.len()
                ))
            }
        })?;
        let features = instance.features(pd);
        let caps = features.caps(options.disable_f16);
        let unsupported = |what: &str| Error::Unsupported {
            device: caps.name.clone(),
            what: what.to_string(),
        };
        if !features.timeline {
            return Err(unsupported(
                "timeline semaphores (Vulkan 1.2 `timelineSemaphore`), which Kiln's `vk` \
                 backend submits with: update the driver, or use its wgpu device (`vulkan:N`)",
            ));
        }
        if !features.push_descriptor {
            return Err(unsupported(
                "VK_KHR_push_descriptor, which Kiln's `vk` backend binds buffers with: update \
                 the driver, or use its wgpu device (`vulkan:N`)",
            ));
        }
        let families = instance.queue_families(pd);
        let family = crate::instance::compute_family(&families)
            .ok_or_else(|| unsupported("a compute queue"))?;
        let choice = transfer_choice(std::env::var_os("KILN_VK_TRANSFER").as_deref())?;
        let dedicated = match choice {
            TransferChoice::Auto => crate::instance::transfer_family(&families, family),
            TransferChoice::Off | TransferChoice::SameQueue => None,
        };
        let f16 = caps.f16_arithmetic;
        let coopmat = match &features.coopmat {
            Ok(_) if !f16 => Err("f16 is turned off for this device (disable_f16)".into()),
            Ok(_) if std::env::var_os("KILN_VK_COOPMAT").is_some_and(|v| v == "0") => {
                Err("turned off by KILN_VK_COOPMAT=0".into())
            }
            other => other.clone(),
        };
        if gemm_log() {
            match &coopmat {
                Ok(c) => eprintln!(
                    "kiln: vk:{index} ({}) runs aligned f16 GEMMs on the cooperative-matrix \
                     GEMM, {} tiles, {} lanes",
                    caps.name, c.shape, c.lanes
                ),
                Err(why) => eprintln!(
                    "kiln: vk:{index} ({}) has no cooperative-matrix GEMM: {why}",
                    caps.name
                ),
            }
            eprintln!(
                "kiln: vk:{index} ({}) {}",
                caps.name,
                match (dedicated, choice) {
                    (Some(f), _) => format!(
                        "copies downloads on its dedicated transfer queue (family {f}), beside \
                         the compute queue (family {family})"
                    ),
                    (None, TransferChoice::Off) => {
                        "copies downloads on its compute queue (KILN_VK_TRANSFER=0)".into()
                    }
                    (None, TransferChoice::SameQueue) => "copies downloads through the \
                        transfer path on its compute queue (KILN_VK_TRANSFER=same-queue)"
                        .into(),
                    (None, TransferChoice::Auto) => "has no dedicated transfer queue family: \
                        downloads are copied on its compute queue"
                        .into(),
                }
            );
        }
        let mut f11 = vk::PhysicalDeviceVulkan11Features::default()
            .storage_buffer16_bit_access(f16)
            .uniform_and_storage_buffer16_bit_access(f16);
        let mut f12 = vk::PhysicalDeviceVulkan12Features::default()
            .shader_float16(f16)
            .timeline_semaphore(true)
            .vulkan_memory_model(coopmat.is_ok());
        let priorities = [1.0];
        let mut queues = vec![vk::DeviceQueueCreateInfo::default()
            .queue_family_index(family)
            .queue_priorities(&priorities)];
        if let Some(f) = dedicated {
            queues.push(
                vk::DeviceQueueCreateInfo::default()
                    .queue_family_index(f)
                    .queue_priorities(&priorities),
            );
        }
        let mut extensions = vec![ash::khr::push_descriptor::NAME.as_ptr()];
        // The SPIR-V GEMM requires its subgroup size where the device lets it.
        let mut size_control =
            vk::PhysicalDeviceSubgroupSizeControlFeatures::default().subgroup_size_control(true);
        let mut info = vk::DeviceCreateInfo::default()
            .queue_create_infos(&queues)
            .push_next(&mut f11)
            .push_next(&mut f12);
        if let Some(control) = features.subgroup_control {
            if control.extension {
                extensions.push(ash::ext::subgroup_size_control::NAME.as_ptr());
            }
            info = info.push_next(&mut size_control);
        }
        // Only where the cooperative-matrix GEMM was selected (the device reported a
        // shape it runs): nothing else uses the extension.
        let mut coop_features =
            vk::PhysicalDeviceCooperativeMatrixFeaturesKHR::default().cooperative_matrix(true);
        if coopmat.is_ok() {
            extensions.push(ash::khr::cooperative_matrix::NAME.as_ptr());
            info = info.push_next(&mut coop_features);
        }
        let info = info.enabled_extension_names(&extensions);
        let backend = |what: &str, e: vk::Result| Error::Backend {
            device: caps.name.clone(),
            detail: format!("{what}: {e}"),
        };
        // SAFETY: every feature and extension asked for was checked above.
        let device = unsafe { instance.instance.create_device(pd, &info, None) }
            .map_err(|e| backend("could not open a Vulkan device", e))?;
        let push = ash::khr::push_descriptor::Device::new(&instance.instance, &device);
        // SAFETY: the family and index exist (one queue asked for).
        let queue = unsafe { device.get_device_queue(family, 0) };
        let pool_info = vk::CommandPoolCreateInfo::default()
            .queue_family_index(family)
            .flags(vk::CommandPoolCreateFlags::RESET_COMMAND_BUFFER);
        let mut sem_type = vk::SemaphoreTypeCreateInfo::default()
            .semaphore_type(vk::SemaphoreType::TIMELINE)
            .initial_value(0);
        let sem_info = vk::SemaphoreCreateInfo::default().push_next(&mut sem_type);
        // SAFETY: valid create infos on a live device.
        let made = unsafe {
            (
                device.create_command_pool(&pool_info, None),
                device.create_semaphore(&sem_info, None),
                open_cache(&device, &features, options),
            )
        };
        let (pool, timeline, (cache, disk_cache)) = match made {
            (Ok(p), Ok(t), Ok(c)) => (p, t, c),
            (p, t, c) => {
                let e = [p.err(), t.err(), c.err()].into_iter().flatten().next();
                // SAFETY: nothing was made from the device yet that outlives it.
                unsafe { device.destroy_device(None) };
                return Err(backend(
                    "could not create the command pool, semaphore or pipeline cache",
                    e.unwrap_or(vk::Result::ERROR_UNKNOWN),
                ));
            }
        };
        let transfer = match choice {
            TransferChoice::Off => None,
            TransferChoice::SameQueue => Some((family, queue)),
            TransferChoice::Auto => dedicated.map(|f| {
                // SAFETY: the family was asked for one queue at creation.
                (f, unsafe { device.get_device_queue(f, 0) })
            }),
        };
        let transfer = match transfer {
            Some((f, q)) => match make_transfer(&device, f, q) {
                Ok(x) => Some(x),
                Err(e) => {
                    // SAFETY: as above; pool, semaphore and cache are unused yet.
                    unsafe {
                        device.destroy_pipeline_cache(cache, None);
                        device.destroy_semaphore(timeline, None);
                        device.destroy_command_pool(pool, None);
                        device.destroy_device(None);
                    }
                    return Err(backend("could not set up the transfer queue", e));
                }
            },
            None => None,
        };
        let allocator = Allocator::new(&AllocatorCreateDesc {
            instance: instance.instance.clone(),
            device: device.clone(),
            physical_device: pd,
            debug_settings: Default::default(),
            buffer_device_address: false,
            allocation_sizes: Default::default(),
        })
        .map_err(|e| Error::Backend {
            device: caps.name.clone(),
            detail: format!("could not create the memory allocator: {e}"),
        })?;
        let allowed = crate::spirv::capabilities(&features, f16);
        let arena_stride = MATMUL_PARAMS_SIZE.next_multiple_of(features.min_uniform_align.max(16));
        // Only a software driver compiles at first run, on its queue's thread; without
        // Mesa's disk cache nothing a primer ran would be kept.
        let primer = (primed && caps.device_type == "cpu" && kiln_wgpu::mesa_cache_on())
            .then(|| Primer::shared(index, options));
        let dev = VkDevice {
            caps,
            features,
            allowed,
            device,
            push,
            queue,
            family,
            pool,
            timeline,
            cache,
            disk_cache,
            built: Default::default(),
            dump: Mutex::new(None),
            arena_stride,
            gemm_counts: Default::default(),
            attention_count: Default::default(),
            attention_plan: Mutex::new(None),
            gemm_variant: Mutex::new(None),
            coopmat,
            primer,
            stand_ins: Default::default(),
            lost: Default::default(),
            shared_families: dedicated.map_or(vec![], |f| vec![family, f]),
            transfer_counts: Default::default(),
            state: Mutex::new(State {
                next_id: 1,
                buffers: HashMap::new(),
                allocated: 0,
                allocator: Some(allocator),
                layouts: HashMap::new(),
                pipelines: HashMap::new(),
                glsl: HashMap::new(),
                gemm: HashMap::new(),
                ran: Default::default(),
                ran_attention: Default::default(),
                gemm_gpu: HashMap::new(),
                gemm_layout: None,
                stream: None,
                submitted: 0,
                retired: vec![],
                free_commands: vec![],
                free_arenas: vec![],
                partials: None,
                scratch: None,
                band_partials: None,
                dummy: None,
                staged: HashMap::new(),
                transfer,
                transfer_reads: HashMap::new(),
                profiling: None,
                collect: None,
            }),
            instance,
        };
        {
            let mut s = dev.lock();
            let storage = vk::BufferUsageFlags::STORAGE_BUFFER | vk::BufferUsageFlags::TRANSFER_DST;
            s.scratch =
                Some(dev.make(&mut s, scratch_bytes(), storage, MemoryLocation::GpuOnly)?);
            s.band_partials = Some(dev.make(
                &mut s,
                band_partials_bytes(),
                storage,
                MemoryLocation::GpuOnly,
            )?);
            s.dummy = Some(dev.make(&mut s, DUMMY_BYTES, storage, MemoryLocation::GpuOnly)?);
        }
        dev.validated()?;
        Ok(dev)
    }

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
            kiln_wgpu::pipeline_cache::fnv(what.as_bytes())
        );
        let bytes: Vec<u8> = words.iter().flat_map(|w| w.to_le_bytes()).collect();
        std::fs::write(dir.join(&name), bytes)
            .map_err(|e| self.backend_error(format!("writing {name} into {}: {e}", dir.display())))
    }

    /// Test hook: records two fills of one internal buffer with no barrier between
    /// them (a write-after-write hazard for synchronization validation,
    /// SYNC-HAZARD-WRITE-AFTER-WRITE) and a pipeline barrier the layer rejects (a
    /// source access, shader writes, that its source stage, transfers, cannot make;
    /// VUID-vkCmdPipelineBarrier-srcAccessMask-02815), all of which drivers run safely,
    /// to show that the next sync point reports them.
    #[doc(hidden)]
    pub fn provoke_validation_error(&self) -> Result<()> {
        let mut s = self.lock();
        let (dummy, _, size) = self.resolve(&s, DUMMY_ID)?;
        let cmd = self.stream(&mut s)?.cmd;
        // SAFETY: `cmd` is recording; the placeholder buffer holds `size` bytes and is
        // never read for its contents.
        unsafe {
            self.device.cmd_fill_buffer(cmd, dummy, 0, size, 0);
            self.device.cmd_fill_buffer(cmd, dummy, 0, size, 0);
        }
        let bad = vk::MemoryBarrier::default()
            .src_access_mask(vk::AccessFlags::SHADER_WRITE)
            .dst_access_mask(vk::AccessFlags::TRANSFER_READ);
        // SAFETY: `cmd` is recording; the masks are invalid only as the layer checks
        // them, and drivers execute a barrier with extra access bits as a wider one.
        unsafe {
            self.device.cmd_pipeline_barrier(
                cmd,
                vk::PipelineStageFlags::TRANSFER,
                vk::PipelineStageFlags::TRANSFER,
                vk::DependencyFlags::empty(),
                &[bad],
                &[],
                &[],
            )
        };
        // What follows sees the fills, as after any command.
        self.barrier(cmd);
        Ok(())
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
        let (_, b_offset, _) = self.resolve(s, mm.b.id)?;
        let (_, a_offset, _) = self.resolve(s, mm.a.id)?;
        let dev = GemmDevice {
            subgroup_control: self.features.subgroup_control.map(|c| c.sizes),
            b_offset,
            a_offset,
            max_shared: self.features.max_shared,
            max_invocations: self.features.max_invocations,
            max_group_x: self.features.max_group_x,
            force: *self.gemm_variant.lock().unwrap_or_else(|e| e.into_inner()),
        };
        Ok(gemm::route(mm, &self.caps, dev))
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

    /// Runs the fused attention with `plan` instead of the device's own (`None`: its
    /// own again), so that tests reach the GPU-shaped kernel (`shared: false`, a
    /// 64-lane workgroup) on a CPU driver.
    #[doc(hidden)]
    pub fn force_attention_plan(&self, plan: Option<AttentionPlan>) {
        *self
            .attention_plan
            .lock()
            .unwrap_or_else(|e| e.into_inner()) = plan;
    }

    /// Plans every GEMM with `variant` instead of the planner's choice (`None`: the
    /// planner's again), so that tests reach the tiled GEMM's SPIR-V twin on a CPU
    /// driver. Only the SPIR-V route follows it: a product it sends to the naga path
    /// runs the planner's own kernel there.
    #[doc(hidden)]
    pub fn force_gemm_variant(&self, variant: Option<MatmulVariant>) {
        *self.gemm_variant.lock().unwrap_or_else(|e| e.into_inner()) = variant;
    }

    /// Records a validated attention kernel with the hand-written GLSL passes, over the
    /// WGSL kernels' launches (bands, parameters and the delta scratch are theirs).
    fn record_attention(&self, s: &mut State, kernel: &Kernel) -> Result<()> {
        let dim = attention_geometry(kernel).3;
        let forced = *self
            .attention_plan
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        let plan = forced.unwrap_or_else(|| attention::plan(&self.caps, dim));
        let (Some(primer), None, true) = (&self.primer, forced, plan.rows > 1) else {
            return self.record_attention_with(s, kernel, &plan);
        };
        // A pass with several rows per lane takes tens of seconds to compile at its
        // first run on a software driver: until the primer has run it, one row per
        // lane stands in (each row's sums are the same, in the same order).
        let key = self.attention_names(kernel, &plan)?;
        let block = Block::Attention(key.clone());
        let ready = s.ran_attention.contains(&key)
            || matches!(primer.state(&block), Some(Primed::Done | Primed::Failed));
        if ready {
            self.record_attention_with(s, kernel, &plan)?;
            if s.collect.is_none() {
                s.ran_attention.insert(key);
            }
            return Ok(());
        }
        primer.ask(Job {
            block,
            attention: Some(attention_recipe(kernel, plan)),
        });
        if s.collect.is_some() {
            // `prepare` builds the planned passes' pipelines too, so the switch once
            // they are primed builds nothing.
            self.record_attention_with(s, kernel, &plan)?;
        } else {
            self.stand_ins
                .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        }
        self.record_attention_with(s, kernel, &AttentionPlan { rows: 1, ..plan })
    }

    /// The names of the pipelines `kernel`'s passes run with `plan`.
    fn attention_names(&self, kernel: &Kernel, plan: &AttentionPlan) -> Result<String> {
        let dim = attention_geometry(kernel).3;
        let (launches, _) = attention_launches(&self.caps, kernel, plan)?;
        let mut names: Vec<String> = launches
            .iter()
            .map(|l| {
                let module = attention::module(l.pass, !self.caps.f16_arithmetic).0;
                attention::pipeline_name(module, &attention::spec(plan, dim, &l.typed))
            })
            .collect();
        names.dedup();
        Ok(names.join("; "))
    }

    /// Records `kernel` with the GLSL passes shaped by `plan`.
    fn record_attention_with(
        &self,
        s: &mut State,
        kernel: &Kernel,
        plan: &AttentionPlan,
    ) -> Result<()> {
        let dim = attention_geometry(kernel).3;
        let plan = *plan;
        let (launches, scratch) = attention_launches(&self.caps, kernel, &plan)?;
        if scratch > 0 {
            Recorder::partials(self, s, scratch)?;
        }
        let subgroup =
            attention::required_subgroup(&plan, self.features.subgroup_control.map(|c| c.sizes));
        for l in &launches {
            let spec = attention::spec(&plan, dim, &l.typed);
            // Without f16 the device has no 16-bit storage either (see `open`).
            let (module, bytes) = attention::module(l.pass, !self.caps.f16_arithmetic);
            let (pipeline, layout) = self.glsl_pipeline_with(
                s,
                &attention::pipeline_name(module, &spec),
                || spirv_words(module, bytes),
                (attention::bindings(l.pass), attention::PUSH_BYTES),
                &spec,
                subgroup,
            )?;
            if s.collect.is_some() {
                // `prepare` wanted the pipeline, now built.
                continue;
            }
            let mut infos = vec![];
            for id in l.typed.iter().map(|b| b.id).chain(l.f32s.iter().copied()) {
                infos.push(self.buffer_info(s, id)?);
            }
            let writes = buffer_writes(&infos, None);
            let push: Vec<u8> = l.params.iter().flat_map(|w| w.to_le_bytes()).collect();
            let cmd = self.stream(s)?.cmd;
            self.record_compute(cmd, (pipeline, layout), &writes, &push, l.groups);
            self.attention_count
                .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        }
        Ok(())
    }

    /// Records `kernel` (validated, its buffers live): a GEMM the SPIR-V kernel covers
    /// through it, fused attention through the GLSL passes, everything else through the
    /// shared lowering.
    fn record(&self, s: &mut State, kernel: &Kernel) -> Result<()> {
        if matches!(
            kernel,
            Kernel::Attention { .. } | Kernel::AttentionBackward { .. }
        ) {
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
                    self.route(s, mm)?
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
        lower::record_kernel(self, s, kernel)
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

    /// The timeline value after which something used by the stream so far is unused.
    fn tag(s: &State) -> u64 {
        s.submitted + s.stream.is_some() as u64
    }

    fn retire(s: &mut State, mem: Mem) {
        let tag = (Self::tag(s), 0);
        Self::retire_at(s, mem, tag);
    }

    /// Retires `mem` until both timelines pass `tag`.
    fn retire_at(s: &mut State, mem: Mem, tag: Tag) {
        Self::retired_at(s, tag).mems.push(mem);
    }

    /// The entry of what is released once both timelines pass `tag`.
    fn retired_at(s: &mut State, tag: Tag) -> &mut Retired {
        if s.retired.last().is_none_or(|(t, _)| *t != tag) {
            s.retired.push((tag, Retired::default()));
        }
        &mut s.retired.last_mut().expect("pushed above").1
    }

    /// The compute timeline's value now.
    fn completed(&self) -> Result<u64> {
        self.counter(self.timeline)
    }

    fn counter(&self, semaphore: vk::Semaphore) -> Result<u64> {
        // SAFETY: a timeline semaphore of this device.
        unsafe { self.device.get_semaphore_counter_value(semaphore) }
            .map_err(|e| self.vk_error("reading the timeline", e))
    }

    /// Releases what finished submissions held.
    fn reclaim(&self, s: &mut State) -> Result<()> {
        let done = self.completed()?;
        let copied = match &s.transfer {
            Some(x) => self.counter(x.timeline)?,
            None => 0,
        };
        let (ready, waiting): (Vec<_>, Vec<_>) = std::mem::take(&mut s.retired)
            .into_iter()
            .partition(|((c, x), _)| *c <= done && *x <= copied);
        s.retired = waiting;
        for (_, r) in ready {
            for m in r.mems {
                if m.arena {
                    s.free_arenas.push(m);
                } else {
                    self.destroy(s, m);
                }
            }
            s.free_commands.extend(r.commands);
            if let Some(x) = s.transfer.as_mut() {
                x.free_commands.extend(r.transfer_commands);
            }
        }
        Ok(())
    }

    /// Waits until the compute timeline reaches `value`.
    fn wait_for(&self, value: u64) -> Result<()> {
        self.wait_on(self.timeline, value)
    }

    /// Waits until `semaphore`'s timeline reaches `value`.
    fn wait_on(&self, semaphore: vk::Semaphore, value: u64) -> Result<()> {
        if self.lost.load(std::sync::atomic::Ordering::Relaxed) {
            // What the device was to finish is gone (the timeline was signalled from
            // the host so that no wait hangs): nothing waited for is valid.
            return Err(self.vk_error("waiting for the device", vk::Result::ERROR_DEVICE_LOST));
        }
        let semaphores = [semaphore];
        let values = [value];
        let info = vk::SemaphoreWaitInfo::default()
            .semaphores(&semaphores)
            .values(&values);
        // SAFETY: a timeline semaphore of this device.
        unsafe { self.device.wait_semaphores(&info, u64::MAX) }
            .map_err(|e| self.vk_error("waiting for the device", e))?;
        self.validated()
    }

    /// The open stream, begun on first use.
    fn stream<'s>(&self, s: &'s mut State) -> Result<&'s mut Stream> {
        if s.stream.is_none() {
            self.reclaim(s)?;
            let cmd = match s.free_commands.pop() {
                Some(c) => c,
                None => {
                    let info = vk::CommandBufferAllocateInfo::default()
                        .command_pool(self.pool)
                        .level(vk::CommandBufferLevel::PRIMARY)
                        .command_buffer_count(1);
                    // SAFETY: the pool belongs to this device; access is under the lock.
                    unsafe { self.device.allocate_command_buffers(&info) }
                        .map_err(|e| self.vk_error("allocating a command buffer", e))?[0]
                }
            };
            let arena = match s.free_arenas.pop() {
                Some(a) => a,
                None => Mem {
                    arena: true,
                    ..self.make(
                        s,
                        self.arena_stride * ARENA_SLOTS,
                        vk::BufferUsageFlags::UNIFORM_BUFFER,
                        MemoryLocation::CpuToGpu,
                    )?
                },
            };
            let begin = vk::CommandBufferBeginInfo::default()
                .flags(vk::CommandBufferUsageFlags::ONE_TIME_SUBMIT);
            // SAFETY: the command buffer is not in use (fresh, or its submission done).
            unsafe {
                self.device
                    .reset_command_buffer(cmd, vk::CommandBufferResetFlags::empty())
                    .and_then(|()| self.device.begin_command_buffer(cmd, &begin))
            }
            .map_err(|e| self.vk_error("beginning a command buffer", e))?;
            s.stream = Some(Stream {
                cmd,
                arena,
                used: 0,
                wait_transfer: 0,
            });
        }
        Ok(s.stream.as_mut().expect("opened above"))
    }

    /// Makes every earlier command's writes visible to every later command.
    fn barrier(&self, cmd: vk::CommandBuffer) {
        let all = vk::AccessFlags::SHADER_READ
            | vk::AccessFlags::SHADER_WRITE
            | vk::AccessFlags::TRANSFER_READ
            | vk::AccessFlags::TRANSFER_WRITE
            | vk::AccessFlags::UNIFORM_READ;
        let barrier = vk::MemoryBarrier::default()
            .src_access_mask(vk::AccessFlags::SHADER_WRITE | vk::AccessFlags::TRANSFER_WRITE)
            .dst_access_mask(all);
        let stages = vk::PipelineStageFlags::COMPUTE_SHADER | vk::PipelineStageFlags::TRANSFER;
        // SAFETY: `cmd` is recording.
        unsafe {
            self.device.cmd_pipeline_barrier(
                cmd,
                stages,
                stages,
                vk::DependencyFlags::empty(),
                &[barrier],
                &[],
                &[],
            )
        };
    }

    /// Submits the open stream, if any; returns the timeline value it signals.
    fn flush(&self, s: &mut State) -> Result<u64> {
        let Some(stream) = s.stream.take() else {
            self.validated()?;
            return Ok(s.submitted);
        };
        let _span = span("submit", SpanKind::Submit);
        let value = s.submitted + 1;
        // A stream that writes what a transfer copy still reads starts after the copy;
        // its commands wait at the stages they write in (and everything later on the
        // queue waits with them).
        let waits: Vec<(vk::Semaphore, u64)> = match &s.transfer {
            Some(x) if stream.wait_transfer > 0 => vec![(x.timeline, stream.wait_transfer)],
            _ => vec![],
        };
        // SAFETY: the command buffer is recording; ending and submitting it under the
        // lock, with a signal value above every earlier one, waiting for values that
        // were submitted to be signalled.
        let result = unsafe {
            self.device.end_command_buffer(stream.cmd).and_then(|()| {
                let cmds = [stream.cmd];
                let signals = [self.timeline];
                let values = [value];
                let wait_sems: Vec<vk::Semaphore> = waits.iter().map(|w| w.0).collect();
                let wait_values: Vec<u64> = waits.iter().map(|w| w.1).collect();
                let stages = vec![
                    vk::PipelineStageFlags::COMPUTE_SHADER
                        | vk::PipelineStageFlags::TRANSFER;
                    waits.len()
                ];
                let mut timeline = vk::TimelineSemaphoreSubmitInfo::default()
                    .wait_semaphore_values(&wait_values)
                    .signal_semaphore_values(&values);
                let submit = vk::SubmitInfo::default()
                    .command_buffers(&cmds)
                    .wait_semaphores(&wait_sems)
                    .wait_dst_stage_mask(&stages)
                    .signal_semaphores(&signals)
                    .push_next(&mut timeline);
                // Counted as submitted: tests check that the wait reaches the queue.
                if submit.wait_semaphore_count > 0 {
                    self.transfer_counts[1].fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                }
                self.queue_submit(self.queue, submit)
            })
        };
        // Whatever the stream used is retired with its value (it was tagged with it).
        s.submitted = value;
        let r = Self::retired_at(s, (value, 0));
        r.commands.push(stream.cmd);
        r.mems.push(stream.arena);
        if let Err(e) = result {
            return Err(self.failed_submit(self.timeline, value, "submitting work", e));
        }
        self.validated()?;
        Ok(value)
    }

    /// After a submission of `semaphore`'s `value` failed with `e`: nothing will signal
    /// that value, so the host does, once the queues are idle (a host signal must not
    /// pass work still pending; a lost device returns at once), lest a wait for it
    /// never end. A lost device stays lost: every later wait says so.
    fn failed_submit(
        &self,
        semaphore: vk::Semaphore,
        value: u64,
        what: &str,
        e: vk::Result,
    ) -> Error {
        // SAFETY: the caller holds the state lock, under which every queue of this
        // device is used; then a host signal of a timeline semaphore to a value above
        // every one submitted to it, none pending any more.
        unsafe {
            let _ = self.device.device_wait_idle();
            let _ = self.device.signal_semaphore(
                &vk::SemaphoreSignalInfo::default()
                    .semaphore(semaphore)
                    .value(value),
            );
        }
        self.vk_error(what, e)
    }

    /// Submits one batch to `queue`, or fails as a lost device does where a test said
    /// the device is lost ([`VkDevice::simulate_device_lost`]).
    ///
    /// # Safety
    /// As `vkQueueSubmit`: `submit` is valid and `queue`'s use is externally
    /// synchronized (the caller holds the state lock).
    unsafe fn queue_submit(
        &self,
        queue: vk::Queue,
        submit: vk::SubmitInfo,
    ) -> std::result::Result<(), vk::Result> {
        if self.lost.load(std::sync::atomic::Ordering::Relaxed) {
            return Err(vk::Result::ERROR_DEVICE_LOST);
        }
        self.device
            .queue_submit(queue, &[submit], vk::Fence::null())
    }

    /// Test hook: from now on every queue submission fails with
    /// `VK_ERROR_DEVICE_LOST`, as on a device the driver lost (lavapipe never loses
    /// one), so that tests see what a lost device does to each call.
    #[doc(hidden)]
    pub fn simulate_device_lost(&self) {
        self.lost.store(true, std::sync::atomic::Ordering::Relaxed);
    }

    /// The Vulkan buffer, byte offset and size bound for `id`.
    /// The descriptor info binding buffer `id` (a view: its range of the parent).
    fn buffer_info(&self, s: &State, id: u64) -> Result<vk::DescriptorBufferInfo> {
        let (buffer, offset, range) = self.resolve(s, id)?;
        Ok(vk::DescriptorBufferInfo {
            buffer,
            offset,
            range,
        })
    }

    fn resolve(&self, s: &State, id: u64) -> Result<(vk::Buffer, u64, u64)> {
        let own = |m: &Option<Mem>| {
            m.as_ref()
                .map(|m| (m.buffer, 0, m.size))
                .ok_or_else(|| self.backend_error("an internal buffer is missing"))
        };
        match id {
            SCRATCH_ID => own(&s.scratch),
            DUMMY_ID => own(&s.dummy),
            BAND_PARTIALS_ID => own(&s.band_partials),
            PARTIALS_ID => own(&s.partials),
            _ => {
                let slot = s.buffers.get(&id).ok_or_else(|| self.unknown(id))?;
                match &slot.kind {
                    SlotKind::Own(m) => Ok((m.buffer, 0, slot.meta.bytes())),
                    SlotKind::View { parent, base } => {
                        let p = s.buffers.get(parent).ok_or_else(|| self.unknown(*parent))?;
                        match &p.kind {
                            SlotKind::Own(m) => Ok((m.buffer, *base, slot.meta.bytes())),
                            SlotKind::View { .. } => Err(self.backend_error("a view of a view")),
                        }
                    }
                }
            }
        }
    }

    fn check_live(&self, s: &State, kernel: &str, buffers: &[Buffer]) -> Result<()> {
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

    fn layout(
        &self,
        s: &mut State,
        kernel: &KernelSource,
    ) -> Result<(vk::DescriptorSetLayout, vk::PipelineLayout)> {
        let accesses: Vec<Access> = kernel.slots.iter().map(|slot| slot.access).collect();
        let key = (accesses, kernel.params_size);
        if let Some(l) = s.layouts.get(&key) {
            return Ok(*l);
        }
        let mut bindings = vec![vk::DescriptorSetLayoutBinding::default()
            .binding(0)
            .descriptor_type(vk::DescriptorType::UNIFORM_BUFFER)
            .descriptor_count(1)
            .stage_flags(vk::ShaderStageFlags::COMPUTE)];
        for i in 0..kernel.slots.len() {
            bindings.push(
                vk::DescriptorSetLayoutBinding::default()
                    .binding(i as u32 + 1)
                    .descriptor_type(vk::DescriptorType::STORAGE_BUFFER)
                    .descriptor_count(1)
                    .stage_flags(vk::ShaderStageFlags::COMPUTE),
            );
        }
        let info = vk::DescriptorSetLayoutCreateInfo::default()
            .flags(vk::DescriptorSetLayoutCreateFlags::PUSH_DESCRIPTOR_KHR)
            .bindings(&bindings);
        // SAFETY: valid create infos on a live device.
        let set = unsafe { self.device.create_descriptor_set_layout(&info, None) }
            .map_err(|e| self.vk_error("creating a descriptor set layout", e))?;
        let sets = [set];
        let pl_info = vk::PipelineLayoutCreateInfo::default().set_layouts(&sets);
        // SAFETY: as above.
        let pl = unsafe { self.device.create_pipeline_layout(&pl_info, None) }
            .map_err(|e| self.vk_error("creating a pipeline layout", e))?;
        s.layouts.insert(key, (set, pl));
        Ok((set, pl))
    }

    fn pipeline(
        &self,
        s: &mut State,
        key: &PipelineKey,
        kernel: &KernelSource,
    ) -> Result<vk::Pipeline> {
        if let Some(p) = s.pipelines.get(key) {
            return Ok(*p);
        }
        if kernel.subgroups && self.caps.subgroup_sizes.is_none() {
            return Err(Error::Unsupported {
                device: self.caps.name.clone(),
                what: format!(
                    "subgroup operations in compute shaders, which kernel {} needs",
                    kernel.name
                ),
            });
        }
        let t0 = std::time::Instant::now();
        let words = crate::spirv::translate(
            kernel,
            &key.reprs,
            &key.consts,
            &key.overrides,
            &self.allowed,
        )
        .map_err(|e| Error::Unsupported {
            device: self.caps.name.clone(),
            what: format!("kernel {} ({:?}): {e}", kernel.name, key.reprs),
        })?;
        self.dump_spirv(key, &words)?;
        let (_, layout) = self.layout(s, kernel)?;
        // SAFETY: naga's validated SPIR-V for the capabilities the device has, on the
        // layout made for its bindings.
        let pipeline = unsafe { self.compute_pipeline(&words, layout, &[], None) }
            .map_err(|e| self.vk_error(&format!("building kernel {}", kernel.name), e))?;
        s.pipelines.insert(key.clone(), pipeline);
        self.built.store(true, std::sync::atomic::Ordering::Relaxed);
        if compile_log() {
            eprintln!(
                "kiln: vk built {} {:?} {:?} {:?}: {:.2} s",
                key.name,
                key.reprs,
                key.consts,
                key.overrides,
                t0.elapsed().as_secs_f64()
            );
        }
        Ok(pipeline)
    }

    fn record_dispatch(&self, s: &mut State, d: Dispatch) -> Result<()> {
        if let Some(wanted) = &mut s.collect {
            let key = PipelineKey {
                name: d.kernel.name,
                reprs: d.reprs,
                consts: d.consts,
                overrides: d.overrides,
            };
            if !s.pipelines.contains_key(&key) && !wanted.iter().any(|w| w.0 == key) {
                wanted.push((key, d.kernel));
            }
            return Ok(());
        }
        // Each slot's buffer, offset and size: a view's range of its parent, a range
        // asked of a view relative to the view's start.
        let mut bound = vec![];
        for (i, &id) in d.buffers.iter().enumerate() {
            let (buffer, base, size) = self.resolve(s, id)?;
            let (offset, size) = match d.ranges.iter().find(|r| r.0 == i) {
                Some(&(_, off, size)) => (base + off, size),
                None => (base, size),
            };
            let limit = self.caps.max_storage_binding;
            if size > limit {
                return Err(Error::Unsupported {
                    device: self.caps.name.clone(),
                    what: format!(
                        "`{}` on a {size}-byte buffer: over the device's per-binding limit of \
                         {limit} bytes (GEMMs, elementwise kernels, reductions, the optimizers \
                         and the embedding's backward split such operands; this kernel cannot). \
                         Use smaller tensors, e.g. a smaller batch or sequence",
                        d.kernel.name
                    ),
                });
            }
            bound.push(vk::DescriptorBufferInfo {
                buffer,
                offset,
                range: size,
            });
        }
        let key = PipelineKey {
            name: d.kernel.name,
            reprs: d.reprs,
            consts: d.consts,
            overrides: d.overrides,
        };
        let pipeline = self.pipeline(s, &key, d.kernel)?;
        let (_, layout) = self.layout(s, d.kernel)?;
        let (cmd, arena, offset) = self.put_params(s, &d.params)?;
        // The parameters at binding 0, the kernel's buffers after them.
        bound.insert(
            0,
            vk::DescriptorBufferInfo {
                buffer: arena,
                offset,
                range: d.kernel.params_size,
            },
        );
        let writes = buffer_writes(&bound, Some(0));
        self.record_compute(cmd, (pipeline, layout), &writes, &[], d.groups);
        Ok(())
    }

    /// Writes a launch's parameters into the open stream's arena (submitting the
    /// stream first when the arena is full): the stream's command buffer, the arena and
    /// the parameters' offset in it.
    fn put_params(
        &self,
        s: &mut State,
        params: &[u32],
    ) -> Result<(vk::CommandBuffer, vk::Buffer, u64)> {
        if s.stream
            .as_ref()
            .is_some_and(|st| st.used + self.arena_stride > st.arena.size)
        {
            self.flush(s)?;
        }
        let stride = self.arena_stride;
        let stream = self.stream(s)?;
        let offset = stream.used;
        let bytes: Vec<u8> = params.iter().flat_map(|w| w.to_le_bytes()).collect();
        let mapped = stream
            .arena
            .alloc
            .mapped_slice_mut()
            .ok_or_else(|| Error::Backend {
                device: String::new(),
                detail: "the parameter arena is not host-visible".into(),
            })?;
        mapped[offset as usize..offset as usize + bytes.len()].copy_from_slice(&bytes);
        stream.used += stride;
        Ok((stream.cmd, stream.arena.buffer, offset))
    }

    /// Records one compute dispatch into `cmd`: binds `pipeline`, pushes the
    /// descriptor `writes` (and `push` constants, when any), dispatches `groups`, and
    /// puts a barrier behind it so the next launch sees its writes.
    fn record_compute(
        &self,
        cmd: vk::CommandBuffer,
        (pipeline, layout): (vk::Pipeline, vk::PipelineLayout),
        writes: &[vk::WriteDescriptorSet],
        push: &[u8],
        groups: (u32, u32, u32),
    ) {
        // SAFETY: `cmd` is recording; the pipeline, layout and buffers are live and
        // stay so until the submission is done (freed buffers are retired).
        unsafe {
            self.device
                .cmd_bind_pipeline(cmd, vk::PipelineBindPoint::COMPUTE, pipeline);
            self.push.cmd_push_descriptor_set(
                cmd,
                vk::PipelineBindPoint::COMPUTE,
                layout,
                0,
                writes,
            );
            if !push.is_empty() {
                self.device
                    .cmd_push_constants(cmd, layout, vk::ShaderStageFlags::COMPUTE, 0, push);
            }
            self.device.cmd_dispatch(cmd, groups.0, groups.1, groups.2);
        }
        self.barrier(cmd);
    }

    /// When a profile is open, writes a timestamp after everything recorded so far and
    /// returns its index.
    fn stamp(&self, s: &mut State) -> Result<Option<u32>> {
        let Some(used) = s.profiling.as_ref().map(|p| p.used) else {
            return Ok(None);
        };
        let cmd = self.stream(s)?.cmd;
        let p = s.profiling.as_mut().expect("checked above");
        if used / PER_POOL == p.pools.len() as u32 {
            let info = vk::QueryPoolCreateInfo::default()
                .query_type(vk::QueryType::TIMESTAMP)
                .query_count(PER_POOL);
            // SAFETY: a valid create info on a live device.
            let pool = unsafe { self.device.create_query_pool(&info, None) }
                .map_err(|e| self.vk_error("creating a timestamp query pool", e))?;
            // SAFETY: `cmd` is recording; a new pool's queries start unavailable.
            unsafe { self.device.cmd_reset_query_pool(cmd, pool, 0, PER_POOL) };
            p.pools.push(pool);
        }
        let pool = p.pools[(used / PER_POOL) as usize];
        p.used += 1;
        // SAFETY: `cmd` is recording; the query was reset and is written once.
        unsafe {
            self.device.cmd_write_timestamp(
                cmd,
                vk::PipelineStageFlags::BOTTOM_OF_PIPE,
                pool,
                used % PER_POOL,
            )
        };
        Ok(Some(used))
    }

    /// Records a copy between two ranges of buffers (`(buffer, offset)`), then a barrier.
    fn record_copy(
        &self,
        s: &mut State,
        (from, src_off): (vk::Buffer, u64),
        (to, dst_off): (vk::Buffer, u64),
        size: u64,
    ) -> Result<()> {
        let cmd = self.stream(s)?.cmd;
        let region = vk::BufferCopy {
            src_offset: src_off,
            dst_offset: dst_off,
            size,
        };
        // SAFETY: `cmd` is recording; both buffers are live and hold the ranges.
        unsafe { self.device.cmd_copy_buffer(cmd, from, to, &[region]) };
        self.barrier(cmd);
        Ok(())
    }
}

impl VkDevice {
    /// Makes the open stream wait for the transfer copies still reading any of
    /// `buffers` (ids; views count as the buffer they view), which the stream is about
    /// to write: a copy reads its source while later compute runs, so only a command
    /// that overwrites it must wait for the copy.
    fn after_transfer_reads(&self, s: &mut State, buffers: &[Buffer]) -> Result<()> {
        if s.transfer_reads.is_empty() {
            return Ok(());
        }
        let mut wait = 0;
        for b in buffers {
            let (buffer, _, _) = self.resolve(s, b.id)?;
            // Once the stream waits, so does everything after it on the queue.
            if let Some(x) = s.transfer_reads.remove(&buffer) {
                wait = wait.max(x);
            }
        }
        if wait > 0 {
            let stream = self.stream(s)?;
            stream.wait_transfer = stream.wait_transfer.max(wait);
        }
        Ok(())
    }

    /// Submits a copy of `src` (buffer, offset) into `staging` on the transfer queue,
    /// after the compute timeline reaches `after`: the transfer timeline value it
    /// signals.
    fn submit_transfer_copy(
        &self,
        s: &mut State,
        (src, base): (vk::Buffer, u64),
        staging: vk::Buffer,
        size: u64,
        after: u64,
    ) -> Result<u64> {
        let x = s.transfer.as_mut().expect("called with a transfer queue");
        let cmd = match x.free_commands.pop() {
            Some(c) => c,
            None => {
                let info = vk::CommandBufferAllocateInfo::default()
                    .command_pool(x.pool)
                    .level(vk::CommandBufferLevel::PRIMARY)
                    .command_buffer_count(1);
                // SAFETY: the pool belongs to this device; access is under the lock.
                unsafe { self.device.allocate_command_buffers(&info) }
                    .map_err(|e| self.vk_error("allocating a command buffer", e))?[0]
            }
        };
        let value = x.submitted + 1;
        let (queue, timeline) = (x.queue, x.timeline);
        let gate = x.gate.filter(|g| g.1).map(|g| g.0);
        let begin = vk::CommandBufferBeginInfo::default()
            .flags(vk::CommandBufferUsageFlags::ONE_TIME_SUBMIT);
        let region = vk::BufferCopy {
            src_offset: base,
            dst_offset: 0,
            size,
        };
        let to_host = vk::MemoryBarrier::default()
            .src_access_mask(vk::AccessFlags::TRANSFER_WRITE)
            .dst_access_mask(vk::AccessFlags::HOST_READ);
        // SAFETY: the command buffer is not in use (fresh, or its submission done);
        // both buffers are live and hold the ranges; it is submitted under the lock with
        // a signal value above every earlier one, waiting for a compute value already
        // submitted.
        let result = unsafe {
            self.device
                .reset_command_buffer(cmd, vk::CommandBufferResetFlags::empty())
                .and_then(|()| self.device.begin_command_buffer(cmd, &begin))
                .and_then(|()| {
                    self.device.cmd_copy_buffer(cmd, src, staging, &[region]);
                    self.device.cmd_pipeline_barrier(
                        cmd,
                        vk::PipelineStageFlags::TRANSFER,
                        vk::PipelineStageFlags::HOST,
                        vk::DependencyFlags::empty(),
                        &[to_host],
                        &[],
                        &[],
                    );
                    self.device.end_command_buffer(cmd)
                })
                .and_then(|()| {
                    let cmds = [cmd];
                    let signals = [timeline];
                    let values = [value];
                    let mut waits = vec![];
                    let mut wait_values = vec![];
                    if after > 0 {
                        waits.push(self.timeline);
                        wait_values.push(after);
                    }
                    if let Some(g) = gate {
                        waits.push(g);
                        wait_values.push(1);
                    }
                    let stages = vec![vk::PipelineStageFlags::TRANSFER; waits.len()];
                    let mut sems = vk::TimelineSemaphoreSubmitInfo::default()
                        .wait_semaphore_values(&wait_values)
                        .signal_semaphore_values(&values);
                    let submit = vk::SubmitInfo::default()
                        .command_buffers(&cmds)
                        .wait_semaphores(&waits)
                        .wait_dst_stage_mask(&stages)
                        .signal_semaphores(&signals)
                        .push_next(&mut sems);
                    self.queue_submit(queue, submit)
                })
        };
        s.transfer.as_mut().expect("checked above").submitted = value;
        Self::retired_at(s, (0, value)).transfer_commands.push(cmd);
        if let Err(e) = result {
            return Err(self.failed_submit(timeline, value, "submitting a download", e));
        }
        self.transfer_counts[0].fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let read = s.transfer_reads.entry(src).or_default();
        *read = (*read).max(value);
        Ok(value)
    }

    /// Test hook: from now on, downloads take the transfer path (their own command
    /// pool, timeline semaphore and waits) on the compute queue, as on a device with a
    /// dedicated transfer family, which lavapipe lacks. (KILN_VK_TRANSFER=same-queue
    /// does the same from the open.)
    #[doc(hidden)]
    pub fn use_transfer_path_on_compute_queue(&self) -> Result<()> {
        let mut s = self.lock();
        if s.transfer.is_some() {
            return Ok(());
        }
        let x = make_transfer(&self.device, self.family, self.queue)
            .map_err(|e| self.vk_error("setting up the transfer path", e))?;
        s.transfer = Some(x);
        Ok(())
    }

    /// Test hook: transfer copies submitted from now on wait (on the device) until
    /// [`VkDevice::release_transfers`], so that a test can act while a copy is still
    /// pending, as on a GPU whose copy engine is busy. With the transfer path on the
    /// compute queue, later compute submissions wait behind them too: nothing may wait
    /// for the device before the release.
    #[doc(hidden)]
    pub fn hold_transfers(&self) -> Result<()> {
        let mut s = self.lock();
        let x = s.transfer.as_mut().ok_or_else(|| {
            Error::InvalidArgument("hold_transfers without a transfer path".into())
        })?;
        if x.gate.is_some() {
            return Err(Error::InvalidArgument(
                "hold_transfers holds a device's transfers once".into(),
            ));
        }
        let mut sem_type = vk::SemaphoreTypeCreateInfo::default()
            .semaphore_type(vk::SemaphoreType::TIMELINE)
            .initial_value(0);
        let info = vk::SemaphoreCreateInfo::default().push_next(&mut sem_type);
        // SAFETY: a valid create info on a live device.
        let gate = unsafe { self.device.create_semaphore(&info, None) }
            .map_err(|e| self.vk_error("creating a semaphore", e))?;
        x.gate = Some((gate, true));
        Ok(())
    }

    /// Test hook: bytes of buffers freed (or otherwise retired) that submissions
    /// still pending may use, after releasing what the device has finished with.
    #[doc(hidden)]
    pub fn retired_bytes(&self) -> Result<u64> {
        let mut s = self.lock();
        self.reclaim(&mut s)?;
        Ok(s.retired
            .iter()
            .flat_map(|(_, r)| &r.mems)
            .filter(|m| !m.arena)
            .map(|m| m.size)
            .sum())
    }

    /// Lets the copies held by [`VkDevice::hold_transfers`] run.
    #[doc(hidden)]
    pub fn release_transfers(&self) -> Result<()> {
        let mut s = self.lock();
        if let Some((gate, held)) = s.transfer.as_mut().and_then(|x| x.gate.as_mut()) {
            if *held {
                *held = false;
                // SAFETY: a host signal of a timeline semaphore of this device, once.
                unsafe {
                    self.device.signal_semaphore(
                        &vk::SemaphoreSignalInfo::default().semaphore(*gate).value(1),
                    )
                }
                .map_err(|e| self.vk_error("releasing the transfers", e))?;
            }
        }
        Ok(())
    }

    /// The queue family downloads are copied on, where they take the transfer path
    /// (a dedicated transfer family, or the compute family under
    /// KILN_VK_TRANSFER=same-queue); None where they are copied in the compute stream.
    pub fn transfer_family(&self) -> Option<u32> {
        self.lock().transfer.as_ref().map(|x| x.family)
    }

    /// Copies submitted to the transfer queue so far, and compute submissions that
    /// waited for one (they overwrote a buffer a copy was still reading).
    #[doc(hidden)]
    pub fn transfer_counts(&self) -> (u64, u64) {
        use std::sync::atomic::Ordering::Relaxed;
        (
            self.transfer_counts[0].load(Relaxed),
            self.transfer_counts[1].load(Relaxed),
        )
    }
}

/// The transfer queue's command pool and timeline semaphore on `family`'s `queue`.
fn make_transfer(
    device: &ash::Device,
    family: u32,
    queue: vk::Queue,
) -> std::result::Result<Transfer, vk::Result> {
    let pool_info = vk::CommandPoolCreateInfo::default()
        .queue_family_index(family)
        .flags(vk::CommandPoolCreateFlags::RESET_COMMAND_BUFFER);
    let mut sem_type = vk::SemaphoreTypeCreateInfo::default()
        .semaphore_type(vk::SemaphoreType::TIMELINE)
        .initial_value(0);
    let sem_info = vk::SemaphoreCreateInfo::default().push_next(&mut sem_type);
    // SAFETY: valid create infos on a live device.
    let pool = unsafe { device.create_command_pool(&pool_info, None) }?;
    // SAFETY: as above.
    let timeline = match unsafe { device.create_semaphore(&sem_info, None) } {
        Ok(t) => t,
        Err(e) => {
            // SAFETY: the pool was just made and holds nothing.
            unsafe { device.destroy_command_pool(pool, None) };
            return Err(e);
        }
    };
    Ok(Transfer {
        queue,
        family,
        pool,
        timeline,
        submitted: 0,
        free_commands: vec![],
        gate: None,
    })
}

/// What the cache file is keyed by: the device, driver, host CPU (a CPU device's
/// pipelines are the host's machine code) and kernel sources.
fn cache_key(f: &Features) -> u64 {
    let host = if f.device_type == "cpu" {
        kiln_engine::fsutil::host_cpu()
    } else {
        String::new()
    };
    kiln_wgpu::pipeline_cache::fnv(
        format!(
            "vk|{}|{}|{}|{}|{:?}|{}|{}|{}|kiln-vulkan {}",
            f.name,
            f.vendor,
            f.device_id,
            f.driver_version,
            f.cache_uuid,
            f.driver,
            host,
            kiln_wgpu::SHADER_HASH,
            env!("CARGO_PKG_VERSION")
        )
        .as_bytes(),
    )
}

/// The device's `VkPipelineCache`, loaded from the cache directory (the wgpu
/// backend's file format: only whole files this driver wrote for this key reach it;
/// anything else is ignored with a note), and where to save it.
fn open_cache(
    device: &ash::Device,
    features: &Features,
    options: &DeviceOptions,
) -> std::result::Result<(vk::PipelineCache, Option<(std::path::PathBuf, u64)>), vk::Result> {
    let place = (!options.no_pipeline_cache)
        .then(|| kiln_wgpu::pipeline_cache::dir(options))
        .flatten()
        .map(|dir| {
            let key = cache_key(features);
            (dir.join(format!("vk-{key:016x}.bin")), key)
        });
    let file = place
        .as_ref()
        .and_then(|(path, _)| std::fs::read(path).ok());
    let data = match (&file, &place) {
        (Some(f), Some((path, key))) => match kiln_wgpu::pipeline_cache::payload(f, *key) {
            Ok(d) => d,
            Err(why) => {
                eprintln!(
                    "kiln: note: ignoring the pipeline cache {}: {why}; it is rebuilt as kernels compile",
                    path.display()
                );
                &[]
            }
        },
        _ => &[],
    };
    let info = vk::PipelineCacheCreateInfo::default().initial_data(data);
    // SAFETY: `data` is empty or bytes this driver returned for this very device,
    // driver and host (key and checksum checked); a driver also checks its own header.
    match unsafe { device.create_pipeline_cache(&info, None) } {
        Ok(c) => Ok((c, place)),
        // SAFETY: as above, with no initial data.
        Err(_) if !data.is_empty() => unsafe {
            device
                .create_pipeline_cache(&vk::PipelineCacheCreateInfo::default(), None)
                .map(|c| (c, place))
        },
        Err(e) => Err(e),
    }
}

impl VkDevice {
    /// Writes the pipeline cache if pipelines were built. Failures are notes: the next
    /// run compiles again.
    fn save_cache(&self) {
        let Some((path, key)) = &self.disk_cache else {
            return;
        };
        if !self.built.swap(false, std::sync::atomic::Ordering::Relaxed) {
            return;
        }
        // SAFETY: the cache belongs to this live device.
        let Ok(data) = (unsafe { self.device.get_pipeline_cache_data(self.cache) }) else {
            return;
        };
        let file = kiln_wgpu::pipeline_cache::encode(*key, &data);
        if let Err(e) = kiln_wgpu::pipeline_cache::write(path, &file) {
            eprintln!(
                "kiln: note: could not save compiled kernels to {} ({e}); the next run compiles them again",
                path.display()
            );
        }
    }
}

/// The committed SPIR-V of a hand-written kernel (`shaders/vulkan/NAME.spv`), as words;
/// an error names a damaged file and how to rebuild it.
fn spirv_words(name: &str, bytes: &[u8]) -> std::result::Result<Vec<u32>, String> {
    if !bytes.len().is_multiple_of(4)
        || bytes.len() < 20
        || bytes[..4] != 0x0723_0203u32.to_le_bytes()
    {
        return Err(format!(
            "shaders/vulkan/spv/{name}.spv is not a SPIR-V module ({} bytes): rebuild it \
             with `bash shaders/vulkan/build.sh`",
            bytes.len()
        ));
    }
    Ok(bytes
        .chunks_exact(4)
        .map(|w| u32::from_le_bytes([w[0], w[1], w[2], w[3]]))
        .collect())
}

const GEMM_F32_SPV: &[u8] = include_bytes!("../../../shaders/vulkan/spv/gemm_f32.spv");

impl VkDevice {
    /// The pipeline of a hand-written kernel with `buffers` storage bindings and
    /// `push` bytes of push constants, built on first use.
    fn glsl_pipeline(
        &self,
        s: &mut State,
        name: &str,
        words: impl FnOnce() -> std::result::Result<Vec<u32>, String>,
        buffers: u32,
        push: u32,
    ) -> Result<(vk::Pipeline, vk::PipelineLayout)> {
        self.glsl_pipeline_with(s, name, words, (buffers, push), &[], None)
    }

    /// A compute pipeline of SPIR-V `words` (entry point `main`) on `layout`, with
    /// `spec` as its specialization constants (id, 32-bit value) and, where given, its
    /// subgroup size required; the shader module is destroyed once it is built.
    ///
    /// # Safety
    /// `words` is a valid compute module whose bindings and push constants `layout`
    /// declares, and `subgroup` is a size the device lets a pipeline require.
    unsafe fn compute_pipeline(
        &self,
        words: &[u32],
        layout: vk::PipelineLayout,
        spec: &[(u32, u32)],
        subgroup: Option<u32>,
    ) -> std::result::Result<vk::Pipeline, vk::Result> {
        let module = self
            .device
            .create_shader_module(&vk::ShaderModuleCreateInfo::default().code(words), None)?;
        let entries: Vec<_> = (0..)
            .zip(spec)
            .map(|(i, &(id, _))| vk::SpecializationMapEntry {
                constant_id: id,
                offset: 4 * i,
                size: 4,
            })
            .collect();
        let data: Vec<u8> = spec.iter().flat_map(|(_, v)| v.to_le_bytes()).collect();
        let spec_info = vk::SpecializationInfo::default()
            .map_entries(&entries)
            .data(&data);
        let mut required = vk::PipelineShaderStageRequiredSubgroupSizeCreateInfo::default()
            .required_subgroup_size(subgroup.unwrap_or(0));
        let mut stage = vk::PipelineShaderStageCreateInfo::default()
            .stage(vk::ShaderStageFlags::COMPUTE)
            .module(module)
            .name(c"main")
            .specialization_info(&spec_info);
        if subgroup.is_some() {
            stage = stage.push_next(&mut required);
        }
        let made = self.device.create_compute_pipelines(
            self.cache,
            &[vk::ComputePipelineCreateInfo::default()
                .stage(stage)
                .layout(layout)],
            None,
        );
        self.device.destroy_shader_module(module, None);
        made.map(|p| p[0]).map_err(|(_, e)| e)
    }

    /// [`VkDevice::glsl_pipeline`] with specialization constants (`(constant_id,
    /// value)`, 32-bit each) and, where given, a required subgroup size. `name` must
    /// tell every specialization apart: it keys the pipeline.
    fn glsl_pipeline_with(
        &self,
        s: &mut State,
        name: &str,
        words: impl FnOnce() -> std::result::Result<Vec<u32>, String>,
        (buffers, push): (u32, u32),
        spec: &[(u32, u32)],
        subgroup: Option<u32>,
    ) -> Result<(vk::Pipeline, vk::PipelineLayout)> {
        if let Some(&(p, _, l)) = s.glsl.get(name) {
            return Ok((p, l));
        }
        let words = words().map_err(|e| self.backend_error(e))?;
        let bindings: Vec<_> = (0..buffers)
            .map(|i| {
                vk::DescriptorSetLayoutBinding::default()
                    .binding(i)
                    .descriptor_type(vk::DescriptorType::STORAGE_BUFFER)
                    .descriptor_count(1)
                    .stage_flags(vk::ShaderStageFlags::COMPUTE)
            })
            .collect();
        let info = vk::DescriptorSetLayoutCreateInfo::default()
            .flags(vk::DescriptorSetLayoutCreateFlags::PUSH_DESCRIPTOR_KHR)
            .bindings(&bindings);
        // SAFETY: valid create infos on a live device; every object made is kept in
        // `s.glsl` or destroyed on the error paths below.
        unsafe {
            let set = self
                .device
                .create_descriptor_set_layout(&info, None)
                .map_err(|e| self.vk_error("creating a descriptor set layout", e))?;
            let sets = [set];
            let ranges = [vk::PushConstantRange::default()
                .stage_flags(vk::ShaderStageFlags::COMPUTE)
                .size(push)];
            let pl_info = vk::PipelineLayoutCreateInfo::default()
                .set_layouts(&sets)
                .push_constant_ranges(&ranges);
            let layout = match self.device.create_pipeline_layout(&pl_info, None) {
                Ok(l) => l,
                Err(e) => {
                    self.device.destroy_descriptor_set_layout(set, None);
                    return Err(self.vk_error("creating a pipeline layout", e));
                }
            };
            let fail = |e: vk::Result| {
                self.device.destroy_pipeline_layout(layout, None);
                self.device.destroy_descriptor_set_layout(set, None);
                self.vk_error(&format!("building kernel {name}"), e)
            };
            let pipeline = self
                .compute_pipeline(&words, layout, spec, subgroup)
                .map_err(fail)?;
            s.glsl.insert(name.to_string(), (pipeline, set, layout));
            self.built.store(true, std::sync::atomic::Ordering::Relaxed);
            Ok((pipeline, layout))
        }
    }

    /// Records `mm` with the hand-written GLSL GEMM (`shaders/vulkan/gemm_f32.comp`): f32
    /// operands, no transposes, one matrix, `alpha` 1 and `beta` 0, no epilogue — the
    /// start of the SPIR-V kernel family of issue 13, pinned by tests. Other products
    /// are an error naming what the kernel lacks.
    pub fn launch_glsl_gemm(&self, mm: &kiln_engine::Matmul) -> Result<()> {
        let kernel = Kernel::Matmul(mm.clone());
        kernel.validate()?;
        let plain = [mm.a, mm.b, mm.c].iter().all(|b| b.dtype == DType::F32)
            && !mm.trans_a
            && !mm.trans_b
            && mm.batch == 1
            && mm.alpha == 1.0
            && mm.beta == 0.0
            && mm.bias.is_none()
            && !mm.gelu
            && mm.c_f32.is_none();
        if !plain {
            return Err(Error::InvalidArgument(format!(
                "the GLSL GEMM computes C = A B for one f32 matrix without transposes, \
                 alpha, beta or epilogue; launch this product as Kernel::Matmul on `{}`",
                self.caps.name
            )));
        }
        if mm.m == 0 || mm.n == 0 {
            return Ok(());
        }
        let (m, n, k) = (mm.m as u32, mm.n as u32, mm.k as u32);
        if n.div_ceil(16) > 65535 || m.div_ceil(16) > 65535 {
            return Err(Error::InvalidArgument(format!(
                "the GLSL GEMM: {m} x {n} needs more than 65535 workgroups in a dimension"
            )));
        }
        let mut s = self.lock();
        self.check_live(&s, "matmul", &mm.buffers())?;
        // C may be what a transfer copy still reads.
        self.after_transfer_reads(&mut s, &[mm.c])?;
        let (pipeline, layout) = self.glsl_pipeline(
            &mut s,
            "gemm_f32",
            || spirv_words("gemm_f32", GEMM_F32_SPV),
            3,
            12,
        )?;
        let mut infos = vec![];
        for b in [mm.a, mm.b, mm.c] {
            let info = self.buffer_info(&s, b.id)?;
            if info.range > self.caps.max_storage_binding {
                return Err(Error::Unsupported {
                    device: self.caps.name.clone(),
                    what: format!(
                        "the GLSL GEMM on a {}-byte operand, over the per-binding limit \
                         (Kernel::Matmul splits such products)",
                        info.range
                    ),
                });
            }
            infos.push(info);
        }
        let writes = buffer_writes(&infos, None);
        let push: Vec<u8> = [m, n, k].iter().flat_map(|v| v.to_le_bytes()).collect();
        let cmd = self.stream(&mut s)?.cmd;
        let groups = (n.div_ceil(16), m.div_ceil(16), 1);
        self.record_compute(cmd, (pipeline, layout), &writes, &push, groups);
        Ok(())
    }
}

impl VkDevice {
    /// The set and pipeline layouts of the SPIR-V GEMM: A, B and C as storage buffers
    /// (bindings 0-2), its parameters as a uniform (binding 3), and the epilogue
    /// modules' bias and f32 copy of C (storage, 4 and 5), pushed per launch.
    fn gemm_layout(&self, s: &mut State) -> Result<(vk::DescriptorSetLayout, vk::PipelineLayout)> {
        if let Some(l) = s.gemm_layout {
            return Ok(l);
        }
        let binding = |i: u32, ty: vk::DescriptorType| {
            vk::DescriptorSetLayoutBinding::default()
                .binding(i)
                .descriptor_type(ty)
                .descriptor_count(1)
                .stage_flags(vk::ShaderStageFlags::COMPUTE)
        };
        let storage = vk::DescriptorType::STORAGE_BUFFER;
        let bindings = [
            binding(0, storage),
            binding(1, storage),
            binding(2, storage),
            binding(3, vk::DescriptorType::UNIFORM_BUFFER),
            binding(4, storage),
            binding(5, storage),
        ];
        let info = vk::DescriptorSetLayoutCreateInfo::default()
            .flags(vk::DescriptorSetLayoutCreateFlags::PUSH_DESCRIPTOR_KHR)
            .bindings(&bindings);
        // SAFETY: valid create infos on a live device; both objects are kept in
        // `s.gemm_layout` (destroyed on drop) or destroyed on the error path.
        unsafe {
            let set = self
                .device
                .create_descriptor_set_layout(&info, None)
                .map_err(|e| self.vk_error("creating a descriptor set layout", e))?;
            let sets = [set];
            let pl_info = vk::PipelineLayoutCreateInfo::default().set_layouts(&sets);
            let layout = self
                .device
                .create_pipeline_layout(&pl_info, None)
                .map_err(|e| {
                    self.device.destroy_descriptor_set_layout(set, None);
                    self.vk_error("creating a pipeline layout", e)
                })?;
            s.gemm_layout = Some((set, layout));
            Ok((set, layout))
        }
    }

    /// The SPIR-V GEMM's pipeline for `p`: its committed module with the tile shape as
    /// specialization constants and, where the device allows, its subgroup size
    /// required; built on first use.
    fn gemm_pipeline(
        &self,
        s: &mut State,
        p: &SpirvGemmPlan,
    ) -> Result<(vk::Pipeline, vk::PipelineLayout)> {
        let (_, layout) = self.gemm_layout(s)?;
        let p = &p.pipeline_key();
        if let Some(&pipeline) = s.gemm.get(p) {
            return Ok((pipeline, layout));
        }
        // constant_id 1-11 of matmul_cpu.comp: TM, NV, the epilogue's BIAS, GELU and
        // COPY_F32 (32-bit booleans), and the `_mixed` modules' storage of A, B, C and
        // the bias, PARTIAL and USE_BETA; a module without some ignores their entries.
        let storage = p.mixed.unwrap_or([p.dtype; 4]).map(gemm::storage_code);
        let values = [
            p.tm,
            p.nv,
            p.bias as u32,
            p.gelu as u32,
            p.copy_f32 as u32,
            storage[0],
            storage[1],
            storage[2],
            storage[3],
            p.partial() as u32,
            p.use_beta as u32,
        ];
        let spec: Vec<(u32, u32)> = (1..).zip(values).collect();
        // `gemm::route` asks for the subgroup size only where the device can require it.
        let subgroup = p.require_subgroup.then_some(gemm::LANES);
        let shape = format!(
            "TM={} NV={} (subgroup size {})",
            p.tm,
            p.nv,
            if p.require_subgroup {
                "required"
            } else {
                "fixed"
            }
        );
        let pipeline =
            self.build_gemm_pipeline(layout, gemm::module(p), &spec, subgroup, &shape)?;
        s.gemm.insert(*p, pipeline);
        Ok((pipeline, layout))
    }

    /// A hand-written GEMM's pipeline from its committed module `(name, bytes)` on the
    /// GEMM layout, specialized by `spec` (constant 1 up), `subgroup` required where
    /// given; `shape` names it in `KILN_COMPILE_LOG`'s line.
    fn build_gemm_pipeline(
        &self,
        layout: vk::PipelineLayout,
        (name, bytes): (&str, &[u8]),
        spec: &[(u32, u32)],
        subgroup: Option<u32>,
        shape: &str,
    ) -> Result<vk::Pipeline> {
        let t0 = std::time::Instant::now();
        let words = spirv_words(name, bytes).map_err(|e| self.backend_error(e))?;
        // SAFETY: a module checked as SPIR-V (the committed output of glslangValidator,
        // validated by tests/spirv.rs), on a live device; its bindings are the
        // layout's, every load index it makes is clamped into the buffers a launch
        // binds, `gemm::route` checked its shared memory and workgroup against the
        // device's limits and asks for a subgroup size only where the device can
        // require it.
        let pipeline = unsafe { self.compute_pipeline(&words, layout, spec, subgroup) }
            .map_err(|e| self.vk_error(&format!("building kernel {name}"), e))?;
        self.built.store(true, std::sync::atomic::Ordering::Relaxed);
        if compile_log() {
            eprintln!(
                "kiln: vk built {name} {shape}: {:.2} s",
                t0.elapsed().as_secs_f64()
            );
        }
        Ok(pipeline)
    }

    /// Records `mm` with the SPIR-V GEMM as `p` plans it: one dispatch over every
    /// tile and matrix. (The planner's row chunks keep a GPU's dispatches short for
    /// its watchdog; this kernel runs on CPU-class devices only, as one dispatch.)
    fn record_spirv_gemm(
        &self,
        s: &mut State,
        mm: &kiln_engine::Matmul,
        p: &SpirvGemmPlan,
    ) -> Result<()> {
        // Built now, also where `prepare` only collects.
        self.gemm_pipeline(s, p)?;
        self.record_gemm_with(s, mm, p.partial(), (p.splits, p.k_chunk), |dev, s, cf| {
            let pipeline = dev.gemm_pipeline(s, p)?;
            dev.dispatch_gemm(s, mm, pipeline, &p.params(mm), p.groups(mm), cf)?;
            s.ran.insert(p.pipeline_key());
            Ok(())
        })
    }

    /// Records a hand-written GEMM of `mm` (its pipelines built): `dispatch` binds and
    /// dispatches it given where the f32 copy of C goes; with `partial`, that is the
    /// planner's f32 partials (`split`: its K split), which the WGSL `matmul_finish`
    /// (through naga) then sums with the epilogue. While `prepare` collects, only the
    /// finish's pipeline is collected.
    fn record_gemm_with(
        &self,
        s: &mut State,
        mm: &kiln_engine::Matmul,
        partial: bool,
        split: (u32, u32),
        dispatch: impl FnOnce(&Self, &mut State, u64) -> Result<()>,
    ) -> Result<()> {
        let plan = if partial {
            let force = *self.gemm_variant.lock().unwrap_or_else(|e| e.into_inner());
            let plan = plan_matmul(mm, &self.caps, force)?;
            debug_assert_eq!((plan.splits, plan.k_chunk), split);
            Some(plan)
        } else {
            None
        };
        if s.collect.is_some() {
            if let Some(plan) = &plan {
                split_finish(self, s, mm, plan)?;
            }
            return Ok(());
        }
        if let Some(plan) = &plan {
            split_partials(self, s, mm, plan)?;
        }
        let cf = if plan.is_some() {
            PARTIALS_ID
        } else {
            mm.c_f32.map_or(DUMMY_ID, |b| b.id)
        };
        dispatch(self, s, cf)?;
        if let Some(plan) = &plan {
            split_finish(self, s, mm, plan)?;
        }
        Ok(())
    }

    /// Records one dispatch of a hand-written GEMM's `pipeline` over `groups`: A, B
    /// and C at bindings 0-2, `params` as the uniform at 3, the bias (a stand-in where
    /// the launch has none: the modules that read it declare it) at 4 and `cf` (the f32
    /// copy of C or the partials) at 5; see `gemm_layout`.
    fn dispatch_gemm(
        &self,
        s: &mut State,
        mm: &kiln_engine::Matmul,
        pipeline: (vk::Pipeline, vk::PipelineLayout),
        params: &[u32; 16],
        groups: (u64, u64, u64),
        cf: u64,
    ) -> Result<()> {
        let mut infos = vec![];
        for id in [mm.a.id, mm.b.id, mm.c.id] {
            infos.push(self.buffer_info(s, id)?);
        }
        let (cmd, arena, offset) = self.put_params(s, params)?;
        infos.push(vk::DescriptorBufferInfo {
            buffer: arena,
            offset,
            range: 4 * params.len() as u64,
        });
        infos.push(self.buffer_info(s, mm.bias.map_or(DUMMY_ID, |b| b.id))?);
        infos.push(self.buffer_info(s, cf)?);
        let writes = buffer_writes(&infos, Some(3));
        let (x, y, z) = groups;
        self.record_compute(cmd, pipeline, &writes, &[], (x as u32, y as u32, z as u32));
        Ok(())
    }

    /// The block a launch planned as `p` runs: `p`, unless it is a big block whose
    /// first run the primer still has to make (then it is asked for, and a stand-in of
    /// the same K split runs: the same sums in the same order).
    fn gemm_block(&self, s: &State, mm: &kiln_engine::Matmul, p: &SpirvGemmPlan) -> SpirvGemmPlan {
        let Some(primer) = &self.primer else {
            return *p;
        };
        if self
            .gemm_variant
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .is_some()
        {
            // A pinned block (a benchmark's row, a test) runs as pinned.
            return *p;
        }
        let best = MatmulVariant::Cpu { tm: p.tm, nv: p.nv };
        let with = |v: MatmulVariant| match v {
            MatmulVariant::Cpu { tm, nv } => Some(SpirvGemmPlan { tm, nv, ..*p }),
            _ => None,
        };
        let readiness = |v: MatmulVariant| {
            let Some(q) = with(v) else {
                return Readiness::Absent;
            };
            let key = q.pipeline_key();
            if s.ran.contains(&key) {
                return Readiness::Ready;
            }
            match primer.state(&Block::Gemm(key)) {
                Some(Primed::Done) => Readiness::Ready,
                // The planned block then compiles at its first run here, as without a
                // primer; a smaller one that failed is no stand-in (it would too).
                Some(Primed::Failed) if v == best => Readiness::Ready,
                Some(Primed::Queued) => Readiness::Building,
                _ => Readiness::Absent,
            }
        };
        // The ladder's rule: blocks of 32 rows and more take seconds to compile.
        if p.tm >= 32 && readiness(best) == Readiness::Absent {
            primer.ask(Job {
                block: Block::Gemm(p.pipeline_key()),
                attention: None,
            });
        }
        let ran = gemm_stand_in(best, readiness);
        match with(ran) {
            Some(q) if q != *p && s.collect.is_none() => {
                let (x, y, z) = q.groups(mm);
                if x.max(y).max(z) > 65535 {
                    // Its grid does not fit one dispatch: the planned block compiles
                    // here instead.
                    return *p;
                }
                self.stand_ins
                    .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                q
            }
            Some(q) => q,
            None => *p,
        }
    }

    /// Runs `job`'s kernel once (here, on the primer's device), so that the driver
    /// compiles its machine code and keeps it in Mesa's cache.
    pub(crate) fn prime(&self, job: &Job) -> Result<()> {
        match (&job.block, &job.attention) {
            (Block::Gemm(p), _) => self.prime_gemm(p),
            (Block::Attention(_), Some(r)) => self.prime_attention(r),
            (Block::Attention(names), None) => Err(self.backend_error(format!(
                "priming attention passes {names} without their kernel"
            ))),
        }
    }

    /// Runs the attention kernel `r` describes once, over one K/V head of 16 rows.
    fn prime_attention(&self, r: &AttentionRecipe) -> Result<()> {
        let seq = 16;
        let (heads, dim) = (r.group, r.dim);
        let q_len = heads * seq * dim;
        let kv_len = seq * dim;
        // Lengths in `Kernel::buffers` order: q, k, v, out, lse forward; q, k, v,
        // out, dout, lse, dq, dk, dv backward.
        let lens: Vec<usize> = if r.backward {
            vec![
                q_len,
                kv_len,
                kv_len,
                q_len,
                q_len,
                heads * seq,
                q_len,
                kv_len,
                kv_len,
            ]
        } else {
            vec![q_len, kv_len, kv_len, q_len, heads * seq]
        };
        if lens.len() != r.dtypes.len() {
            return Err(self.backend_error("an attention recipe with the wrong buffer count"));
        }
        let specs: Vec<(DType, usize)> = r.dtypes.iter().copied().zip(lens).collect();
        self.with_buffers(&specs, |bufs| {
            let (scale, causal, group) = (1.0, r.causal, r.group);
            let kernel = if r.backward {
                Kernel::AttentionBackward {
                    q: bufs[0],
                    k: bufs[1],
                    v: bufs[2],
                    out: bufs[3],
                    dout: bufs[4],
                    lse: bufs[5],
                    dq: bufs[6],
                    dk: bufs[7],
                    dv: bufs[8],
                    batch_heads: heads,
                    group,
                    seq,
                    dim,
                    scale,
                    causal,
                }
            } else {
                Kernel::Attention {
                    q: bufs[0],
                    k: bufs[1],
                    v: bufs[2],
                    out: bufs[3],
                    lse: bufs[4],
                    batch_heads: heads,
                    group,
                    seq,
                    dim,
                    scale,
                    causal,
                }
            };
            // With the training device's plan, so that the driver sees its pipelines.
            kernel.validate()?;
            let mut s = self.lock();
            self.record_attention_with(&mut s, &kernel, &r.plan)?;
            let value = self.flush(&mut s)?;
            drop(s);
            self.wait_for(value)
        })
    }

    /// Runs `p`'s pipeline once over one tile (on the primer's device).
    fn prime_gemm(&self, p: &SpirvGemmPlan) -> Result<()> {
        let storage = p.mixed.unwrap_or([p.dtype; 4]);
        // One tile: TM rows, the lanes' columns, and two subgroup steps of K (one per
        // K chunk when split) — enough for every load the block makes to land inside.
        let (m, n, k) = (p.tm as usize, (gemm::LANES * 4 * p.nv) as usize, 16);
        let mut specs = vec![
            (storage[0], m * k),
            (storage[1], k * n),
            (storage[2], m * n),
        ];
        if p.bias {
            specs.push((storage[3], n));
        }
        if p.copy_f32 {
            specs.push((DType::F32, m * n));
        }
        self.with_buffers(&specs, |bufs| {
            let mut mm = kiln_engine::Matmul::new(bufs[0], bufs[1], bufs[2], m, n, k);
            mm.trans_a = p.trans_a;
            mm.trans_b = p.trans_b;
            mm.bias = p.bias.then(|| bufs[3]);
            mm.gelu = p.gelu;
            mm.c_f32 = p.copy_f32.then(|| bufs[bufs.len() - 1]);
            let q = SpirvGemmPlan {
                splits: if p.partial() { 2 } else { 1 },
                k_chunk: if p.partial() { 8 } else { 16 },
                ..*p
            };
            let mut s = self.lock();
            let cf = if q.partial() {
                Recorder::partials(self, &mut s, 2 * (m * n) as u64 * 4)?;
                PARTIALS_ID
            } else {
                mm.c_f32.map_or(DUMMY_ID, |b| b.id)
            };
            let pipeline = self.gemm_pipeline(&mut s, &q)?;
            self.dispatch_gemm(&mut s, &mm, pipeline, &q.params(&mm), q.groups(&mm), cf)?;
            let value = self.flush(&mut s)?;
            drop(s);
            self.wait_for(value)
        })
    }

    /// Runs `f` over new buffers of `specs` (type, length each) and frees them all
    /// after, whatever happened (the primer's device lives on).
    fn with_buffers<T>(
        &self,
        specs: &[(DType, usize)],
        f: impl FnOnce(&[Buffer]) -> Result<T>,
    ) -> Result<T> {
        let mut bufs = vec![];
        let mut made = Ok(());
        for &(dtype, len) in specs {
            match self.alloc(dtype, len) {
                Ok(b) => bufs.push(b),
                Err(e) => {
                    made = Err(e);
                    break;
                }
            }
        }
        let result = made.and_then(|()| f(&bufs));
        for b in bufs {
            // Only an unknown buffer fails to free: these are all this device's.
            let _ = self.free(b);
        }
        result
    }

    /// Big GEMM blocks and attention kernels run first on the primer's device so far
    /// (0 without a primer; devices on one physical device share it).
    #[doc(hidden)]
    pub fn primed_blocks(&self) -> usize {
        self.primer.as_ref().map_or(0, |p| p.primed())
    }

    /// GEMM and attention launches that ran a stand-in (a smaller GEMM block, one
    /// attention row per lane) while theirs was being primed.
    #[doc(hidden)]
    pub fn gemm_stand_ins(&self) -> u64 {
        self.stand_ins.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Waits until the primer has run every block asked of it.
    #[doc(hidden)]
    pub fn wait_for_primer(&self) {
        if let Some(p) = &self.primer {
            p.wait_idle();
        }
    }

    /// Holds the primer before its next block (tests see the stand-ins run), or lets
    /// it go on.
    #[doc(hidden)]
    pub fn hold_primer(&self, held: bool) {
        if let Some(p) = &self.primer {
            p.hold(held);
        }
    }
}

impl VkDevice {
    /// The pipeline of the tiled GEMM's or the GEMV's SPIR-V twin for `p`: its
    /// committed module with everything specialized, on the SPIR-V GEMM's layout;
    /// built on first use.
    fn gpu_gemm_pipeline(
        &self,
        s: &mut State,
        p: &GpuGemmPlan,
    ) -> Result<(vk::Pipeline, vk::PipelineLayout)> {
        let (_, layout) = self.gemm_layout(s)?;
        let p = &p.pipeline_key();
        if let Some(&pipeline) = s.gemm_gpu.get(p) {
            return Ok((pipeline, layout));
        }
        let spec: Vec<(u32, u32)> = (1..).zip(p.spec()).collect();
        let shape = format!("{:?}", p.kernel);
        let pipeline =
            self.build_gemm_pipeline(layout, gemm::gpu_module(p), &spec, None, &shape)?;
        s.gemm_gpu.insert(*p, pipeline);
        Ok((pipeline, layout))
    }

    /// Records `mm` with the tiled GEMM's or the GEMV's SPIR-V twin as `p` plans it:
    /// a dispatch per chunk of the planner's rows over every column tile, matrix and K
    /// split, then (split) the WGSL `matmul_finish` over the partials, as
    /// [`VkDevice::record_spirv_gemm`] does.
    fn record_gpu_gemm(
        &self,
        s: &mut State,
        mm: &kiln_engine::Matmul,
        p: &GpuGemmPlan,
    ) -> Result<()> {
        let pipeline = self.gpu_gemm_pipeline(s, p)?;
        self.record_gemm_with(s, mm, p.partial(), (p.splits, p.k_chunk), |dev, s, cf| {
            for (row_base, groups) in p.dispatches(mm) {
                dev.dispatch_gemm(s, mm, pipeline, &p.params(mm, row_base), groups, cf)?;
            }
            Ok(())
        })
    }

    /// Records `mm` with the cooperative-matrix GEMM as `p` plans it: one dispatch, a
    /// workgroup (one subgroup) per tile of C and matrix. Its module is emitted for
    /// `p` when the pipeline is first built.
    fn record_coopmat_gemm(
        &self,
        s: &mut State,
        mm: &kiln_engine::Matmul,
        p: &CoopMatPlan,
    ) -> Result<()> {
        let name = p.name();
        let (pipeline, layout) =
            self.glsl_pipeline(s, &name, || Ok(coopmat::module(p)), 3, coopmat::PUSH_BYTES)?;
        if s.collect.is_some() {
            // `prepare` wanted the pipeline, now built.
            return Ok(());
        }
        let mut infos = vec![];
        for b in [mm.a, mm.b, mm.c] {
            infos.push(self.buffer_info(s, b.id)?);
        }
        let writes = buffer_writes(&infos, None);
        let cmd = self.stream(s)?.cmd;
        let (x, y, z) = p.groups(mm);
        self.record_compute(
            cmd,
            (pipeline, layout),
            &writes,
            &p.push(mm),
            (x as u32, y as u32, z as u32),
        );
        Ok(())
    }
}

/// One descriptor write per buffer, `infos[i]` at binding `i`: storage buffers, but
/// for the uniform at binding `uniform`.
fn buffer_writes(
    infos: &[vk::DescriptorBufferInfo],
    uniform: Option<usize>,
) -> Vec<vk::WriteDescriptorSet<'_>> {
    infos
        .iter()
        .enumerate()
        .map(|(i, info)| {
            let ty = if Some(i) == uniform {
                vk::DescriptorType::UNIFORM_BUFFER
            } else {
                vk::DescriptorType::STORAGE_BUFFER
            };
            vk::WriteDescriptorSet::default()
                .dst_binding(i as u32)
                .descriptor_type(ty)
                .buffer_info(std::slice::from_ref(info))
        })
        .collect()
}

impl Recorder for VkDevice {
    type State = State;

    fn caps(&self) -> &Capabilities {
        &self.caps
    }

    fn dispatch(&self, s: &mut State, d: Dispatch) -> Result<()> {
        self.record_dispatch(s, d)
    }

    fn copy(&self, s: &mut State, src: &Buffer, dst: &Buffer) -> Result<()> {
        if s.collect.is_some() {
            return Ok(());
        }
        let (a, a_off, _) = self.resolve(s, src.id)?;
        let (b, b_off, _) = self.resolve(s, dst.id)?;
        let size = src.bytes();
        if size == 0 {
            return Ok(());
        }
        if a == b {
            // Views of one buffer: a copy's regions must not overlap, so go through a
            // temporary buffer.
            let tmp = self.make(
                s,
                size,
                vk::BufferUsageFlags::TRANSFER_SRC | vk::BufferUsageFlags::TRANSFER_DST,
                MemoryLocation::GpuOnly,
            )?;
            let t = tmp.buffer;
            self.stream(s)?;
            Self::retire(s, tmp);
            self.record_copy(s, (a, a_off), (t, 0), size)?;
            self.record_copy(s, (t, 0), (b, b_off), size)
        } else {
            self.record_copy(s, (a, a_off), (b, b_off), size)
        }
    }

    fn clear(&self, s: &mut State, buf: &Buffer) -> Result<()> {
        if s.collect.is_some() {
            return Ok(());
        }
        let (b, off, size) = self.resolve(s, buf.id)?;
        let cmd = self.stream(s)?.cmd;
        // SAFETY: `cmd` is recording; the range lies in the buffer, in whole words.
        unsafe { self.device.cmd_fill_buffer(cmd, b, off, size, 0) };
        self.barrier(cmd);
        Ok(())
    }

    fn partials(&self, s: &mut State, bytes: u64) -> Result<()> {
        if s.collect.is_some() || s.partials.as_ref().is_some_and(|p| p.size >= bytes) {
            return Ok(());
        }
        let new = self.make(
            s,
            bytes.max(8),
            vk::BufferUsageFlags::STORAGE_BUFFER | vk::BufferUsageFlags::TRANSFER_DST,
            MemoryLocation::GpuOnly,
        )?;
        // Dispatches recorded earlier keep the old buffer until they have run.
        if let Some(old) = s.partials.replace(new) {
            Self::retire(s, old);
        }
        Ok(())
    }

    fn storage_offset_alignment(&self) -> u64 {
        self.features.min_storage_align.max(4)
    }
}

impl Device for VkDevice {
    fn caps(&self) -> &Capabilities {
        &self.caps
    }

    fn alloc(&self, dtype: DType, len: usize) -> Result<Buffer> {
        // The kernels take element counts as 32-bit integers.
        if len > u32::MAX as usize {
            return Err(Error::InvalidArgument(format!(
                "a buffer of {len} {dtype} elements on `{}`: the kernels index at most {} \
                 elements; use smaller tensors (a smaller micro-batch, sequence or model \
                 dimension)",
                self.caps.name,
                u32::MAX
            )));
        }
        let bytes = dtype.padded_bytes(len);
        let max = self.caps.max_buffer;
        if bytes > max {
            return Err(Error::OutOfMemory {
                device: self.caps.name.clone(),
                detail: format!(
                    "{len} {dtype} elements need {bytes} bytes, over the device's largest \
                     buffer of {max} bytes: use a smaller micro-batch or sequence, or smaller \
                     model dimensions; `kiln estimate` shows which"
                ),
            });
        }
        let mut s = self.lock();
        // Downloads may copy it on the transfer queue.
        let mem = self.make_shared(
            &mut s,
            bytes,
            vk::BufferUsageFlags::STORAGE_BUFFER
                | vk::BufferUsageFlags::TRANSFER_SRC
                | vk::BufferUsageFlags::TRANSFER_DST,
            MemoryLocation::GpuOnly,
            true,
        )?;
        // Zero-filled, in stream order (memory may be recycled).
        let (buffer, size) = (mem.buffer, mem.size);
        let cmd = match self.stream(&mut s) {
            Ok(st) => st.cmd,
            Err(e) => {
                self.destroy(&mut s, mem);
                return Err(e);
            }
        };
        // SAFETY: `cmd` is recording; the buffer is live, its size a multiple of 4.
        unsafe { self.device.cmd_fill_buffer(cmd, buffer, 0, size, 0) };
        self.barrier(cmd);
        let id = s.next_id;
        s.next_id += 1;
        let meta = Buffer { id, dtype, len };
        s.buffers.insert(
            id,
            Slot {
                meta,
                kind: SlotKind::Own(mem),
            },
        );
        s.allocated += bytes;
        Ok(meta)
    }

    fn free(&self, buf: Buffer) -> Result<()> {
        let mut s = self.lock();
        if s.buffers
            .values()
            .any(|v| matches!(v.kind, SlotKind::View { parent, .. } if parent == buf.id))
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
        if let SlotKind::Own(mem) = slot.kind {
            s.allocated -= slot.meta.bytes();
            // Launches already recorded that use it, and a transfer copy still reading
            // it, still complete.
            let copy = s.transfer_reads.remove(&mem.buffer).unwrap_or(0);
            let tag = (Self::tag(&s), copy);
            Self::retire_at(&mut s, mem, tag);
        }
        Ok(())
    }

    fn view(&self, parent: Buffer, offset: usize, len: usize) -> Result<Buffer> {
        check_view(parent, offset, len)?;
        let mut s = self.lock();
        let slot = s
            .buffers
            .get(&parent.id)
            .ok_or_else(|| self.unknown(parent.id))?;
        if matches!(slot.kind, SlotKind::View { .. }) {
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
        let id = s.next_id;
        s.next_id += 1;
        let meta = Buffer {
            id,
            dtype: parent.dtype,
            len,
        };
        let base = (offset * parent.dtype.size()) as u64;
        s.buffers.insert(
            id,
            Slot {
                meta,
                kind: SlotKind::View {
                    parent: parent.id,
                    base,
                },
            },
        );
        Ok(meta)
    }

    fn upload(&self, buf: Buffer, data: &HostData) -> Result<()> {
        check_upload(buf, data)?;
        let _span = span("upload", SpanKind::Transfer);
        let mut s = self.lock();
        let (target, base, _) = self.resolve(&s, buf.id)?;
        let bytes = data.as_bytes();
        if bytes.is_empty() {
            return Ok(());
        }
        let padded = buf.bytes();
        let mut staging = self.make(
            &mut s,
            padded,
            vk::BufferUsageFlags::TRANSFER_SRC,
            MemoryLocation::CpuToGpu,
        )?;
        let Some(mapped) = staging.alloc.mapped_slice_mut() else {
            self.destroy(&mut s, staging);
            return Err(self.backend_error("upload staging memory is not host-visible"));
        };
        mapped[..bytes.len()].copy_from_slice(bytes);
        mapped[bytes.len()..padded as usize].fill(0);
        let src = staging.buffer;
        if let Err(e) = self
            .after_transfer_reads(&mut s, &[buf])
            .and_then(|()| self.stream(&mut s).map(drop))
        {
            self.destroy(&mut s, staging);
            return Err(e);
        }
        Self::retire(&mut s, staging);
        self.record_copy(&mut s, (src, 0), (target, base), padded)
    }

    fn begin_download(&self, buf: Buffer) -> Result<PendingDownload> {
        let _span = span("begin download", SpanKind::Transfer);
        let mut s = self.lock();
        let (src, base, _) = self.resolve(&s, buf.id)?;
        let padded = buf.bytes();
        let staging = self.make(
            &mut s,
            padded,
            vk::BufferUsageFlags::TRANSFER_DST,
            MemoryLocation::GpuToCpu,
        )?;
        let dst = staging.buffer;
        if padded > 0 && s.transfer.is_some() {
            // The copy runs on the transfer queue once the compute work submitted so
            // far (which wrote the source) is done, beside whatever compute comes next.
            let copied = self.flush(&mut s).and_then(|after| {
                self.submit_transfer_copy(&mut s, (src, base), dst, padded, after)
            });
            return match copied {
                Ok(value) => {
                    let ticket = s.next_id;
                    s.next_id += 1;
                    s.staged.insert(ticket, (staging, (0, value)));
                    self.validated()?;
                    Ok(PendingDownload {
                        ticket,
                        buffer: buf,
                    })
                }
                Err(e) => {
                    let tag = (
                        Self::tag(&s),
                        s.transfer.as_ref().map_or(0, |x| x.submitted),
                    );
                    Self::retire_at(&mut s, staging, tag);
                    Err(e)
                }
            };
        }
        if padded > 0 {
            if let Err(e) = self.record_copy(&mut s, (src, base), (dst, 0), padded) {
                self.destroy(&mut s, staging);
                return Err(e);
            }
            let cmd = self.stream(&mut s)?.cmd;
            let to_host = vk::MemoryBarrier::default()
                .src_access_mask(vk::AccessFlags::TRANSFER_WRITE)
                .dst_access_mask(vk::AccessFlags::HOST_READ);
            // SAFETY: `cmd` is recording.
            unsafe {
                self.device.cmd_pipeline_barrier(
                    cmd,
                    vk::PipelineStageFlags::TRANSFER,
                    vk::PipelineStageFlags::HOST,
                    vk::DependencyFlags::empty(),
                    &[to_host],
                    &[],
                    &[],
                )
            };
        }
        let value = match self.flush(&mut s) {
            Ok(v) => v,
            Err(e) => {
                Self::retire(&mut s, staging);
                return Err(e);
            }
        };
        let ticket = s.next_id;
        s.next_id += 1;
        s.staged.insert(ticket, (staging, (value, 0)));
        Ok(PendingDownload {
            ticket,
            buffer: buf,
        })
    }

    fn finish_download(&self, pending: PendingDownload) -> Result<HostData> {
        let _span = span("download", SpanKind::Transfer);
        let (staging, tag, copies) = {
            let mut s = self.lock();
            let (staging, tag) = s.staged.remove(&pending.ticket).ok_or_else(|| {
                Error::InvalidArgument(format!(
                    "download ticket {} is not pending on `{}` (already finished, or begun \
                     on another device)",
                    pending.ticket, self.caps.name
                ))
            })?;
            (staging, tag, s.transfer.as_ref().map(|x| x.timeline))
        };
        let waited = match (tag, copies) {
            ((0, value), Some(timeline)) if value > 0 => self.wait_on(timeline, value),
            ((value, _), _) => self.wait_for(value),
        };
        let mut s = self.lock();
        if let Err(e) = waited {
            Self::retire_at(&mut s, staging, tag);
            return Err(e);
        }
        // The copies up to this one are done: what they read needs no wait any more.
        if tag.0 == 0 {
            s.transfer_reads.retain(|_, x| *x > tag.1);
        }
        let buf = pending.buffer;
        // SAFETY: the handle is only used to invalidate the mapping below, while the
        // allocation is alive.
        let memory = unsafe { staging.alloc.memory() };
        if !staging
            .alloc
            .memory_properties()
            .contains(vk::MemoryPropertyFlags::HOST_COHERENT)
        {
            let range = vk::MappedMemoryRange::default()
                .memory(memory)
                .offset(0)
                .size(vk::WHOLE_SIZE);
            // SAFETY: the memory is mapped (gpu-allocator maps host-visible blocks).
            if let Err(e) = unsafe { self.device.invalidate_mapped_memory_ranges(&[range]) } {
                self.destroy(&mut s, staging);
                return Err(self.vk_error("reading a download", e));
            }
        }
        let data = match staging.alloc.mapped_slice() {
            Some(bytes) => Ok(HostData::from_bytes(buf.dtype, buf.len, bytes)),
            None => Err(self.backend_error("download staging memory is not host-visible")),
        };
        self.destroy(&mut s, staging);
        data
    }

    fn launch(&self, kernel: &Kernel) -> Result<()> {
        kernel.validate()?;
        let mut s = self.lock();
        self.check_live(&s, kernel.name(), &kernel.buffers())?;
        self.after_transfer_reads(&mut s, &kernel.written())?;
        let Some(first) = self.stamp(&mut s)? else {
            return self.record(&mut s, kernel);
        };
        let _span = span("record", SpanKind::Record);
        self.record(&mut s, kernel)?;
        if let Some(last) = self.stamp(&mut s)? {
            if let Some(p) = s.profiling.as_mut() {
                p.launches.push((kernel.cost(), first, last));
            }
        }
        Ok(())
    }

    fn submit(&self) -> Result<()> {
        let mut s = self.lock();
        self.flush(&mut s).map(drop)
    }

    fn wait(&self) -> Result<()> {
        let _span = span("wait", SpanKind::Wait);
        let (value, copies) = {
            let s = self.lock();
            (
                s.submitted,
                s.transfer.as_ref().map(|x| (x.timeline, x.submitted)),
            )
        };
        self.wait_for(value)?;
        if let Some((timeline, copied)) = copies {
            self.wait_on(timeline, copied)?;
        }
        let mut s = self.lock();
        s.transfer_reads
            .retain(|_, x| *x > copies.map_or(0, |c| c.1));
        self.reclaim(&mut s)
    }

    fn allocated_bytes(&self) -> u64 {
        self.lock().allocated
    }

    /// Builds the pipelines `kernels` need that are not built yet, found by lowering
    /// them with recording off, reporting each to `compiling`. (A software driver such
    /// as lavapipe still compiles machine code on a pipeline's first run.)
    fn prepare(&self, kernels: &[Kernel]) -> Result<()> {
        let mut s = self.lock();
        s.collect = Some(vec![]);
        let mut result = Ok(());
        for k in kernels {
            result = k
                .validate()
                .and_then(|()| self.check_live(&s, k.name(), &k.buffers()))
                .and_then(|()| self.record(&mut s, k));
            if result.is_err() {
                break;
            }
        }
        let wanted = s.collect.take().unwrap_or_default();
        result?;
        compiling::queued(wanted.len());
        let mut result = Ok(());
        for (key, kernel) in wanted {
            // After a failure the rest are counted off unbuilt: nobody waits for them.
            if result.is_ok() {
                result = self.pipeline(&mut s, &key, kernel).map(drop);
            }
            compiling::finished();
        }
        result
    }

    fn profile_begin(&self) -> Result<()> {
        if !self.caps.timestamp_queries {
            return Err(Error::Unsupported {
                device: self.caps.name.clone(),
                what: "timestamps on its compute queue, so its kernels cannot be timed: a \
                       profile has host spans only"
                    .to_string(),
            });
        }
        let mut s = self.lock();
        if s.profiling.is_some() {
            return Err(Error::InvalidArgument(format!(
                "profile_begin on `{}` while a profile is already open: call profile_end first",
                self.caps.name
            )));
        }
        // Everything before the profiled stretch runs first, so it is not counted.
        self.flush(&mut s)?;
        drop(s);
        self.wait()?;
        let now = std::time::Instant::now();
        self.lock().profiling = Some(Profiling {
            pools: vec![],
            used: 0,
            launches: vec![],
            calibration: (0, now, now),
        });
        // The tightest of a few round trips: a thread wake-up on the way can stretch one.
        let mut best: Option<(u32, std::time::Instant, std::time::Instant)> = None;
        for _ in 0..CALIBRATIONS {
            let mut s = self.lock();
            let Some(query) = self.stamp(&mut s)? else {
                break;
            };
            let before = std::time::Instant::now();
            let value = self.flush(&mut s)?;
            drop(s);
            self.wait_for(value)?;
            let after = std::time::Instant::now();
            if best.is_none_or(|b| after - before < b.2 - b.1) {
                best = Some((query, before, after));
            }
        }
        if let (Some(p), Some(best)) = (self.lock().profiling.as_mut(), best) {
            p.calibration = best;
        }
        Ok(())
    }

    fn profile_end(&self) -> Result<Vec<KernelTiming>> {
        let mut s = self.lock();
        let Some(p) = s.profiling.take() else {
            return Err(Error::InvalidArgument(format!(
                "profile_end on `{}` without profile_begin",
                self.caps.name
            )));
        };
        let value = self.flush(&mut s);
        drop(s);
        let waited = value.and_then(|v| self.wait_for(v));
        let mut ticks = vec![0u64; p.used as usize];
        let mut read = Ok(());
        for (i, pool) in p.pools.iter().enumerate() {
            let first = i * PER_POOL as usize;
            let count = (p.used as usize)
                .saturating_sub(first)
                .min(PER_POOL as usize);
            if read.is_ok() && waited.is_ok() && count > 0 {
                // SAFETY: queries 0..count of the pool were reset and written by work
                // that has completed.
                read = unsafe {
                    self.device.get_query_pool_results(
                        *pool,
                        0,
                        &mut ticks[first..first + count],
                        vk::QueryResultFlags::TYPE_64 | vk::QueryResultFlags::WAIT,
                    )
                }
                .map_err(|e| self.vk_error("reading the profile's timestamps", e));
            }
            // SAFETY: the device is done with the pool (waited above, or lost).
            unsafe { self.device.destroy_query_pool(*pool, None) };
        }
        waited?;
        read?;
        let bits = self.features.timestamp_bits;
        let mask = if bits >= 64 {
            u64::MAX
        } else {
            (1u64 << bits) - 1
        };
        let ns_per_tick = self.features.timestamp_period as f64;
        let (query, before, after) = p.calibration;
        let anchor = before + (after - before) / 2;
        let zero = ticks.get(query as usize).map_or(0, |t| t & mask);
        let at = |q: u32| {
            let ns = (ticks[q as usize] & mask).saturating_sub(zero) as f64 * ns_per_tick;
            anchor + std::time::Duration::from_nanos(ns as u64)
        };
        Ok(p.launches
            .into_iter()
            .map(|(cost, first, last)| {
                let (start, stop) = (at(first), at(last));
                KernelTiming {
                    cost,
                    start,
                    dur: stop.saturating_duration_since(start),
                }
            })
            .collect())
    }
}

impl Drop for VkDevice {
    fn drop(&mut self) {
        // Held copies would keep the device busy for ever.
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
            if let Some((set, pl)) = s.gemm_layout.take() {
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

/// What the primer needs to run an attention kernel like `kernel` (see `primer.rs`).
fn attention_recipe(kernel: &Kernel, plan: AttentionPlan) -> AttentionRecipe {
    let (backward, group, dim, causal) = match *kernel {
        Kernel::Attention {
            group, dim, causal, ..
        } => (false, group, dim, causal),
        Kernel::AttentionBackward {
            group, dim, causal, ..
        } => (true, group, dim, causal),
        _ => (false, 1, 1, false),
    };
    AttentionRecipe {
        backward,
        dtypes: kernel.buffers().iter().map(|b| b.dtype).collect(),
        group: group.max(1),
        dim,
        causal,
        plan,
    }
}

#[cfg(test)]
mod tests {
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
