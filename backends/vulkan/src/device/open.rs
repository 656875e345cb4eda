//! Opening a device: the instance's physical device, its queues, features, memory
//! allocator, pipeline cache and primer.

use super::cache::open_cache;
use super::transfer::make_transfer;
use super::*;

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

    pub(super) fn open_with(
        index: usize,
        options: &DeviceOptions,
        primed: bool,
    ) -> Result<VkDevice> {
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
        let caps = kiln_lowering::planned(
            features
                .caps(options.disable_f16)
                .with_memory_limit(options.memory_limit),
        );
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
        let primer =
            (primed && caps.device_type == "cpu" && kiln_lowering::pipeline_cache::mesa_cache_on())
                .then(|| {
                    Primer::shared(index, options, |i, o| {
                        Ok(Box::new(VkDevice::open_unprimed(i, o)?) as Box<dyn PrimeOn>)
                    })
                });
        let tuner = super::gemm_selection::open_tuner(&features, options, &caps.device_type);
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
            texel_gemm: std::sync::atomic::AtomicBool::new(true),
            texel_count: std::sync::atomic::AtomicU64::new(0),
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
                gemm_layout: [None, None],
                tuner,
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
}
