//! The Vulkan loader, physical devices and what each can do.

use std::ffi::CStr;

use ash::vk;
use kiln_engine::{Capabilities, Error, Result};

use crate::coopmat::{describe, select, CoopMat, CoopMatProps, CoopMatShape};

/// What to do when no Vulkan device is found.
pub const NO_VULKAN_HINT: &str = "Kiln's raw Vulkan backend (`vk:N`) needs a Vulkan 1.2 driver \
     and the loader: on Debian/Ubuntu `apt install libvulkan1 mesa-vulkan-drivers` (lavapipe \
     runs Vulkan on the CPU); check with `vulkaninfo --summary`";

/// One physical device as `kiln devices` lists it.
#[derive(Clone, Debug)]
pub struct VkSummary {
    /// N in `vk:N`.
    pub index: usize,
    pub caps: Capabilities,
}

/// The Khronos validation layer, as the loader names it.
const VALIDATION_LAYER: &CStr = c"VK_LAYER_KHRONOS_validation";

/// What to do when KILN_VK_VALIDATION=1 finds no validation layer.
const NO_LAYER_HINT: &str = "on Debian/Ubuntu `apt-get install vulkan-validationlayers` \
     (or set KILN_VK_VALIDATION=0)";

/// Whether to run under the validation layer: KILN_VK_VALIDATION=0|1 where set, else on
/// in debug builds (tests) and off in release builds, where its checks cost too much.
fn validation_wanted(var: Option<&std::ffi::OsStr>, debug: bool) -> Result<bool> {
    match var.map(|v| v.to_str()) {
        None => Ok(debug),
        Some(Some("0")) => Ok(false),
        Some(Some("1")) => Ok(true),
        Some(v) => Err(Error::InvalidArgument(format!(
            "KILN_VK_VALIDATION={}: use 1 (run the `vk` backend under the Vulkan \
             validation layer) or 0 (without it)",
            v.unwrap_or("<not UTF-8>")
        ))),
    }
}

/// Whether to enable the validation layer: where it is `wanted` and `installed`; wanted
/// but missing, an error if it was `required` (KILN_VK_VALIDATION=1), else a run
/// without it (a debug build on a machine without the layer).
fn use_layer(wanted: bool, required: bool, installed: bool) -> Result<bool> {
    if wanted && required && !installed {
        return Err(Error::InvalidArgument(format!(
            "KILN_VK_VALIDATION=1 asks for the Vulkan validation layer \
             (VK_LAYER_KHRONOS_validation), which is not installed: {NO_LAYER_HINT}"
        )));
    }
    Ok(wanted && installed)
}

/// What the validation layer reported through the debug messenger, until a sync point
/// of the device takes it (see [`Instance::take_validation_errors`]).
#[derive(Default)]
struct Reports {
    errors: Vec<String>,
    /// Message IDs of the warnings already printed (each is printed once).
    warned: Vec<i32>,
}

/// The validation layer and its debug messenger, where they are on.
struct Validation {
    utils: ash::ext::debug_utils::Instance,
    messenger: vk::DebugUtilsMessengerEXT,
    /// Shared with the messenger callback, which gets the pointer as its user data:
    /// boxed so that it stays put while the instance moves.
    reports: Box<std::sync::Mutex<Reports>>,
}

/// The debug messenger's callback: errors are kept for the device's next sync point,
/// validation warnings are printed once per message ID, performance warnings and
/// information are dropped (they are advice, not faults). It must not unwind into the
/// driver, so nothing in it can panic past `catch_unwind`.
unsafe extern "system" fn on_message(
    severity: vk::DebugUtilsMessageSeverityFlagsEXT,
    types: vk::DebugUtilsMessageTypeFlagsEXT,
    data: *const vk::DebugUtilsMessengerCallbackDataEXT<'_>,
    user: *mut std::ffi::c_void,
) -> vk::Bool32 {
    let _ = std::panic::catch_unwind(|| {
        if data.is_null() || user.is_null() {
            return;
        }
        // SAFETY: the layer passes a valid callback data for the call's duration, and
        // `user` is the `Reports` box of the live instance that made the messenger.
        let (data, reports) = unsafe { (&*data, &*(user as *const std::sync::Mutex<Reports>)) };
        // No message is filtered out: none of those Kiln's tests meet is a false
        // positive of the layer (a known one would be skipped here by its ID, with why).
        let id = data.message_id_number;
        // SAFETY: null or a NUL-terminated string living for the call.
        let text = unsafe { data.message_as_c_str() }
            .map(|c| c.to_string_lossy().into_owned())
            .unwrap_or_default();
        let mut r = reports.lock().unwrap_or_else(|e| e.into_inner());
        if severity.contains(vk::DebugUtilsMessageSeverityFlagsEXT::ERROR) {
            r.errors.push(text);
        } else if severity.contains(vk::DebugUtilsMessageSeverityFlagsEXT::WARNING)
            && !types.contains(vk::DebugUtilsMessageTypeFlagsEXT::PERFORMANCE)
            && !r.warned.contains(&id)
        {
            r.warned.push(id);
            eprintln!("kiln: Vulkan validation warning: {text}");
        }
    });
    // The call that raised the message goes on as it would without the layer.
    vk::FALSE
}

/// The loader and an instance; dropped together.
pub(crate) struct Instance {
    /// Keeps the loader library loaded while the instance lives (and loads the
    /// instance-level functions of device extensions).
    entry: ash::Entry,
    pub instance: ash::Instance,
    pub api: u32,
    validation: Option<Validation>,
}

impl Instance {
    /// An instance under the validation layer where KILN_VK_VALIDATION or the build
    /// asks for it (see [`validation_wanted`]) and the layer is installed; asked for
    /// explicitly and missing, an error naming the package.
    pub fn new() -> Result<Instance> {
        let wanted = validation_wanted(
            std::env::var_os("KILN_VK_VALIDATION").as_deref(),
            cfg!(debug_assertions),
        )?;
        let explicit = std::env::var_os("KILN_VK_VALIDATION").is_some();
        Instance::create(wanted, explicit)
    }

    /// An instance without the validation layer, for listing devices: nothing runs on
    /// them to check.
    pub fn unchecked() -> Result<Instance> {
        Instance::create(false, false)
    }

    /// Whether this instance runs under the validation layer.
    #[cfg(test)]
    pub fn validating(&self) -> bool {
        self.validation.is_some()
    }

    /// The validation errors reported since the last call, oldest first.
    pub fn take_validation_errors(&self) -> Vec<String> {
        self.validation.as_ref().map_or_else(Vec::new, |v| {
            std::mem::take(&mut v.reports.lock().unwrap_or_else(|e| e.into_inner()).errors)
        })
    }

    /// `validate`: run under the layer if it is installed; `required`: a missing layer
    /// is an error rather than a run without it.
    fn create(validate: bool, required: bool) -> Result<Instance> {
        // SAFETY: loading the system's Vulkan loader library; its symbols are
        // resolved by ash against the Vulkan ABI.
        let entry = unsafe { ash::Entry::load() }.map_err(|e| Error::NoAdapter {
            hint: format!("the Vulkan loader could not be loaded ({e}). {NO_VULKAN_HINT}"),
        })?;
        // SAFETY: plain queries through a loaded entry.
        let loader = unsafe { entry.try_enumerate_instance_version() }
            .ok()
            .flatten()
            .unwrap_or(vk::API_VERSION_1_0);
        if loader < vk::API_VERSION_1_2 {
            return Err(Error::NoAdapter {
                hint: format!(
                    "the Vulkan loader is version {}.{}, Kiln's `vk` backend needs 1.2. {NO_VULKAN_HINT}",
                    vk::api_version_major(loader),
                    vk::api_version_minor(loader)
                ),
            });
        }
        let api = loader.min(vk::API_VERSION_1_3);
        let app = vk::ApplicationInfo::default()
            .application_name(c"kiln")
            .engine_name(c"kiln")
            .api_version(api);
        // SAFETY: a plain query through a loaded entry.
        let installed = validate
            && unsafe { entry.enumerate_instance_layer_properties() }
                .unwrap_or_default()
                .iter()
                .any(|l| l.layer_name_as_c_str() == Ok(VALIDATION_LAYER));
        let layer_present = use_layer(validate, required, installed)?;
        let reports = Box::new(std::sync::Mutex::new(Reports::default()));
        use vk::DebugUtilsMessageSeverityFlagsEXT as Sev;
        use vk::DebugUtilsMessageTypeFlagsEXT as Ty;
        let mut messenger_info = vk::DebugUtilsMessengerCreateInfoEXT::default()
            .message_severity(Sev::ERROR | Sev::WARNING)
            .message_type(Ty::GENERAL | Ty::VALIDATION | Ty::PERFORMANCE)
            .pfn_user_callback(Some(on_message))
            .user_data(&*reports as *const std::sync::Mutex<Reports> as *mut std::ffi::c_void);
        let layers = [VALIDATION_LAYER.as_ptr()];
        let extensions = [
            ash::ext::debug_utils::NAME.as_ptr(),
            ash::ext::validation_features::NAME.as_ptr(),
        ];
        // Beyond the layer's default checks, synchronization validation: the hazards a
        // missing or too narrow barrier leaves, which a driver such as lavapipe, running
        // each command to completion in order, never shows.
        let checks = [vk::ValidationFeatureEnableEXT::SYNCHRONIZATION_VALIDATION];
        let mut features =
            vk::ValidationFeaturesEXT::default().enabled_validation_features(&checks);
        let mut info = vk::InstanceCreateInfo::default().application_info(&app);
        if layer_present {
            // Chained here too, the messenger also hears about instance creation.
            info = info
                .enabled_layer_names(&layers)
                .enabled_extension_names(&extensions)
                .push_next(&mut messenger_info)
                .push_next(&mut features);
        }
        // SAFETY: a valid create info; the layer was found above (it brings both
        // extensions).
        let instance =
            unsafe { entry.create_instance(&info, None) }.map_err(|e| Error::NoAdapter {
                hint: if layer_present {
                    format!(
                        "creating a Vulkan instance under the validation layer failed ({e}); \
                         KILN_VK_VALIDATION=0 runs without the layer"
                    )
                } else {
                    format!("creating a Vulkan instance failed ({e}). {NO_VULKAN_HINT}")
                },
            })?;
        let mut made = Instance {
            entry,
            instance,
            api,
            validation: None,
        };
        if layer_present {
            let utils = ash::ext::debug_utils::Instance::new(&made.entry, &made.instance);
            // SAFETY: the extension is enabled; the user data outlives the messenger
            // (both are dropped together, the messenger first).
            let messenger = unsafe { utils.create_debug_utils_messenger(&messenger_info, None) }
                .map_err(|e| Error::NoAdapter {
                    hint: format!(
                        "creating the Vulkan validation layer's messenger failed ({e}); set \
                         KILN_VK_VALIDATION=0 to run without the layer"
                    ),
                })?;
            made.validation = Some(Validation {
                utils,
                messenger,
                reports,
            });
        }
        Ok(made)
    }

    /// Physical devices that can run Kiln (Vulkan 1.2, a compute queue), one per device
    /// UUID: a driver listed twice by the loader (two ICD files) is one device.
    pub fn physical_devices(&self) -> Vec<vk::PhysicalDevice> {
        // SAFETY: queries on a live instance.
        let all = unsafe { self.instance.enumerate_physical_devices() }.unwrap_or_default();
        let mut seen = vec![];
        let mut out = vec![];
        for pd in all {
            let mut id = vk::PhysicalDeviceIDProperties::default();
            let mut props = vk::PhysicalDeviceProperties2::default().push_next(&mut id);
            // SAFETY: `pd` came from this instance.
            unsafe {
                self.instance
                    .get_physical_device_properties2(pd, &mut props)
            };
            if props.properties.api_version < vk::API_VERSION_1_2
                || self.compute_family(pd).is_none()
            {
                continue;
            }
            if seen.contains(&id.device_uuid) {
                continue;
            }
            seen.push(id.device_uuid);
            out.push(pd);
        }
        out
    }

    /// A queue family with compute.
    pub fn compute_family(&self, pd: vk::PhysicalDevice) -> Option<u32> {
        compute_family(&self.queue_families(pd))
    }

    pub fn queue_families(&self, pd: vk::PhysicalDevice) -> Vec<vk::QueueFamilyProperties> {
        // SAFETY: `pd` came from this instance.
        unsafe {
            self.instance
                .get_physical_device_queue_family_properties(pd)
        }
    }

    pub fn has_extension(&self, pd: vk::PhysicalDevice, name: &CStr) -> bool {
        // SAFETY: `pd` came from this instance.
        unsafe { self.instance.enumerate_device_extension_properties(pd) }
            .unwrap_or_default()
            .iter()
            .any(|e| e.extension_name_as_c_str() == Ok(name))
    }

    /// What a physical device offers Kiln (see [`Features`]).
    pub fn features(&self, pd: vk::PhysicalDevice) -> Features {
        let mut f11 = vk::PhysicalDeviceVulkan11Features::default();
        let mut f12 = vk::PhysicalDeviceVulkan12Features::default();
        let mut f2 = vk::PhysicalDeviceFeatures2::default()
            .push_next(&mut f11)
            .push_next(&mut f12);
        // SAFETY: `pd` came from this instance; the chain is well formed.
        unsafe { self.instance.get_physical_device_features2(pd, &mut f2) };
        let mut p11 = vk::PhysicalDeviceVulkan11Properties::default();
        let mut driver = vk::PhysicalDeviceDriverProperties::default();
        let mut p2 = vk::PhysicalDeviceProperties2::default()
            .push_next(&mut p11)
            .push_next(&mut driver);
        // SAFETY: as above.
        unsafe { self.instance.get_physical_device_properties2(pd, &mut p2) };
        let props = p2.properties;
        let mut p13 = vk::PhysicalDeviceVulkan13Properties::default();
        let mut max_buffer = p11.max_memory_allocation_size;
        let mut subgroup_range = (p11.subgroup_size, p11.subgroup_size);
        if props.api_version >= vk::API_VERSION_1_3 && self.api >= vk::API_VERSION_1_3 {
            let mut q = vk::PhysicalDeviceProperties2::default().push_next(&mut p13);
            // SAFETY: as above.
            unsafe { self.instance.get_physical_device_properties2(pd, &mut q) };
            max_buffer = max_buffer.min(p13_max_buffer(&p13));
            if p13.min_subgroup_size > 0 {
                subgroup_range = (p13.min_subgroup_size, p13.max_subgroup_size);
            }
        }
        let subgroup_control = self.subgroup_control(pd, props.api_version);
        let f16 = f12.shader_float16 == vk::TRUE
            && f11.storage_buffer16_bit_access == vk::TRUE
            && f11.uniform_and_storage_buffer16_bit_access == vk::TRUE;
        let coopmat = self.cooperative_matrix(pd, f16, f12.vulkan_memory_model == vk::TRUE);
        use vk::SubgroupFeatureFlags as S;
        // What the WGSL subgroup kernels use (wgpu's SUBGROUP feature asks the same).
        let wanted =
            S::BASIC | S::VOTE | S::ARITHMETIC | S::BALLOT | S::SHUFFLE | S::SHUFFLE_RELATIVE;
        let subgroups = p11
            .subgroup_supported_stages
            .contains(vk::ShaderStageFlags::COMPUTE)
            && p11.subgroup_supported_operations.contains(wanted);
        Features {
            f16,
            coopmat: coopmat.map(|shape| CoopMat {
                shape,
                lanes: p11.subgroup_size,
            }),
            timeline: f12.timeline_semaphore == vk::TRUE,
            push_descriptor: self.has_extension(pd, ash::khr::push_descriptor::NAME),
            subgroup_ops: if subgroups {
                p11.subgroup_supported_operations
            } else {
                S::empty()
            },
            subgroup_range,
            subgroup_control,
            name: props
                .device_name_as_c_str()
                .map(|c| c.to_string_lossy().into_owned())
                .unwrap_or_default(),
            device_type: match props.device_type {
                vk::PhysicalDeviceType::DISCRETE_GPU => "discrete",
                vk::PhysicalDeviceType::INTEGRATED_GPU => "integrated",
                vk::PhysicalDeviceType::VIRTUAL_GPU => "virtual",
                vk::PhysicalDeviceType::CPU => "cpu",
                _ => "other",
            },
            vendor: props.vendor_id,
            device_id: props.device_id,
            driver_version: props.driver_version,
            cache_uuid: props.pipeline_cache_uuid,
            driver: format!(
                "{} {}",
                driver
                    .driver_name_as_c_str()
                    .map(|c| c.to_string_lossy().into_owned())
                    .unwrap_or_default(),
                driver
                    .driver_info_as_c_str()
                    .map(|c| c.to_string_lossy().into_owned())
                    .unwrap_or_default()
            )
            .trim()
            .to_string(),
            timestamp_bits: self.compute_family(pd).map_or(0, |f| {
                // SAFETY: `pd` came from this instance.
                let families = unsafe {
                    self.instance
                        .get_physical_device_queue_family_properties(pd)
                };
                families[f as usize].timestamp_valid_bits
            }),
            timestamp_period: props.limits.timestamp_period,
            max_storage_binding: props.limits.max_storage_buffer_range as u64,
            max_buffer,
            min_uniform_align: props.limits.min_uniform_buffer_offset_alignment,
            min_storage_align: props.limits.min_storage_buffer_offset_alignment,
            memory_budget: self.memory_budget(pd),
            memory_heap: device_local_heap(&self.instance, pd),
            max_shared: props.limits.max_compute_shared_memory_size,
            max_invocations: props.limits.max_compute_work_group_invocations,
            max_group_x: props.limits.max_compute_work_group_size[0],
            texel: self.texel_views(pd, &props.limits),
        }
    }

    /// Whether every format the texel GEMM views A and B as (f32, f16 and bf16's bits,
    /// one and four to a texel) can be a uniform texel buffer, and the limits on views.
    fn texel_views(
        &self,
        pd: vk::PhysicalDevice,
        limits: &vk::PhysicalDeviceLimits,
    ) -> Option<crate::gemm::TexelViews> {
        let all = crate::gemm::TEXEL_FORMATS.iter().all(|&f| {
            // SAFETY: `pd` came from this instance.
            let props = unsafe { self.instance.get_physical_device_format_properties(pd, f) };
            props
                .buffer_features
                .contains(vk::FormatFeatureFlags::UNIFORM_TEXEL_BUFFER)
        });
        all.then_some(crate::gemm::TexelViews {
            max_elements: limits.max_texel_buffer_elements as u64,
            offset_align: limits.min_texel_buffer_offset_alignment.max(1),
        })
    }

    /// How a pipeline can require a subgroup size (`requiredSubgroupSize`): the
    /// sizes it may ask for, where the device has `subgroupSizeControl` (Vulkan 1.3, or
    /// VK_EXT_subgroup_size_control) for compute shaders.
    fn subgroup_control(&self, pd: vk::PhysicalDevice, device_api: u32) -> Option<SubgroupControl> {
        let core = device_api >= vk::API_VERSION_1_3 && self.api >= vk::API_VERSION_1_3;
        let ext = !core && self.has_extension(pd, ash::ext::subgroup_size_control::NAME);
        if !core && !ext {
            return None;
        }
        let mut f = vk::PhysicalDeviceSubgroupSizeControlFeatures::default();
        let mut f2 = vk::PhysicalDeviceFeatures2::default().push_next(&mut f);
        // SAFETY: `pd` came from this instance; the struct is core in 1.3 and the
        // extension's otherwise, checked above.
        unsafe { self.instance.get_physical_device_features2(pd, &mut f2) };
        let mut p = vk::PhysicalDeviceSubgroupSizeControlProperties::default();
        let mut p2 = vk::PhysicalDeviceProperties2::default().push_next(&mut p);
        // SAFETY: as above.
        unsafe { self.instance.get_physical_device_properties2(pd, &mut p2) };
        (f.subgroup_size_control == vk::TRUE
            && p.required_subgroup_size_stages
                .contains(vk::ShaderStageFlags::COMPUTE)
            && p.min_subgroup_size > 0)
            .then_some(SubgroupControl {
                sizes: (p.min_subgroup_size, p.max_subgroup_size),
                extension: ext,
            })
    }

    /// The cooperative-matrix shape the GEMM would run with here (see
    /// [`crate::coopmat::select`]), or why there is none.
    fn cooperative_matrix(
        &self,
        pd: vk::PhysicalDevice,
        f16: bool,
        memory_model: bool,
    ) -> std::result::Result<CoopMatShape, String> {
        if !self.has_extension(pd, ash::khr::cooperative_matrix::NAME) {
            return Err("the driver does not offer VK_KHR_cooperative_matrix".into());
        }
        let mut f = vk::PhysicalDeviceCooperativeMatrixFeaturesKHR::default();
        let mut f2 = vk::PhysicalDeviceFeatures2::default().push_next(&mut f);
        // SAFETY: `pd` came from this instance and offers the extension (checked above).
        unsafe { self.instance.get_physical_device_features2(pd, &mut f2) };
        if f.cooperative_matrix != vk::TRUE {
            return Err("VK_KHR_cooperative_matrix is offered with `cooperativeMatrix` off".into());
        }
        let mut p = vk::PhysicalDeviceCooperativeMatrixPropertiesKHR::default();
        let mut p2 = vk::PhysicalDeviceProperties2::default().push_next(&mut p);
        // SAFETY: as above.
        unsafe { self.instance.get_physical_device_properties2(pd, &mut p2) };
        if !p
            .cooperative_matrix_supported_stages
            .contains(vk::ShaderStageFlags::COMPUTE)
        {
            return Err("cooperative matrices are not offered in compute shaders".into());
        }
        if !f16 {
            return Err("f16 arithmetic or 16-bit storage is missing".into());
        }
        if !memory_model {
            return Err(
                "the Vulkan memory model (`vulkanMemoryModel`), which cooperative-matrix \
                 shaders declare, is missing"
                    .into(),
            );
        }
        let ext = ash::khr::cooperative_matrix::Instance::new(&self.entry, &self.instance);
        // SAFETY: the extension is present; `pd` came from this instance.
        let list = unsafe { ext.get_physical_device_cooperative_matrix_properties(pd) }
            .map_err(|e| format!("listing its cooperative-matrix shapes failed ({e})"))?;
        let props: Vec<CoopMatProps> = list.iter().map(CoopMatProps::from).collect();
        select(&props).ok_or_else(|| {
            format!(
                "none of its cooperative-matrix shapes is f16 x f16 -> f32 at subgroup scope \
                 with sides multiples of 8 up to 64 ({})",
                describe(&props)
            )
        })
    }

    /// Device-local memory the driver lets this process use, where the driver reports
    /// it (`VK_EXT_memory_budget`).
    fn memory_budget(&self, pd: vk::PhysicalDevice) -> Option<u64> {
        if !self.has_extension(pd, ash::ext::memory_budget::NAME) {
            return None;
        }
        let mut budget = vk::PhysicalDeviceMemoryBudgetPropertiesEXT::default();
        let mut p = vk::PhysicalDeviceMemoryProperties2::default().push_next(&mut budget);
        // SAFETY: the extension is present; the chain is well formed.
        unsafe {
            self.instance
                .get_physical_device_memory_properties2(pd, &mut p)
        };
        let props = p.memory_properties;
        let heaps = &props.memory_heaps[..props.memory_heap_count as usize];
        let total: u64 = heaps
            .iter()
            .enumerate()
            .filter(|(_, h)| h.flags.contains(vk::MemoryHeapFlags::DEVICE_LOCAL))
            .map(|(i, _)| budget.heap_budget[i])
            .sum();
        (total > 0).then_some(total)
    }
}

/// The summed size of `pd`'s device-local memory heaps (on a CPU driver such as
/// lavapipe, host memory it may hand out), or `None` when it reports none.
fn device_local_heap(instance: &ash::Instance, pd: vk::PhysicalDevice) -> Option<u64> {
    // SAFETY: `pd` was enumerated from `instance`, which is alive.
    let props = unsafe { instance.get_physical_device_memory_properties(pd) };
    kiln_engine::device::device_local_total(
        props.memory_heaps[..props.memory_heap_count as usize]
            .iter()
            .map(|h| (h.size, h.flags.contains(vk::MemoryHeapFlags::DEVICE_LOCAL))),
    )
}

fn p13_max_buffer(p13: &vk::PhysicalDeviceVulkan13Properties) -> u64 {
    if p13.max_buffer_size == 0 {
        u64::MAX
    } else {
        p13.max_buffer_size
    }
}

impl Drop for Instance {
    fn drop(&mut self) {
        let validation = self.validation.take();
        if let Some(v) = &validation {
            // SAFETY: the messenger belongs to this instance.
            unsafe { v.utils.destroy_debug_utils_messenger(v.messenger, None) };
        }
        // SAFETY: every object made from the instance is gone (the device drops first).
        // The messenger chained at creation reports the destruction into `reports`,
        // which lives until after it.
        unsafe { self.instance.destroy_instance(None) };
        if let Some(v) = validation {
            // What the layer reported after the device's last sync point (its teardown
            // included) can fail nothing, since a drop cannot: it is printed instead.
            let mut r = v.reports.lock().unwrap_or_else(|e| e.into_inner());
            for e in std::mem::take(&mut r.errors) {
                eprintln!("kiln: Vulkan validation error after the device's last sync point: {e}");
            }
        }
    }
}

/// What Kiln uses of a physical device.
#[derive(Clone, Debug)]
pub(crate) struct Features {
    /// shaderFloat16 with 16-bit storage-buffer access.
    pub f16: bool,
    /// What the cooperative-matrix GEMM runs with here, or why it cannot.
    pub coopmat: std::result::Result<CoopMat, String>,
    pub timeline: bool,
    pub push_descriptor: bool,
    /// Subgroup operations in compute shaders; empty when the kernels' set is missing.
    pub subgroup_ops: vk::SubgroupFeatureFlags,
    pub subgroup_range: (u32, u32),
    /// Where pipelines can require a subgroup size (none: the driver picks).
    pub subgroup_control: Option<SubgroupControl>,
    pub name: String,
    pub device_type: &'static str,
    pub vendor: u32,
    pub device_id: u32,
    pub driver_version: u32,
    /// Pipeline cache data is only valid for drivers with this UUID.
    pub cache_uuid: [u8; 16],
    pub driver: String,
    /// Valid bits of the compute queue's timestamps (0: none) and ns per tick.
    pub timestamp_bits: u32,
    pub timestamp_period: f32,
    pub max_storage_binding: u64,
    pub max_buffer: u64,
    pub min_uniform_align: u64,
    pub min_storage_align: u64,
    pub memory_budget: Option<u64>,
    pub memory_heap: Option<u64>,
    /// `maxComputeSharedMemorySize`, `maxComputeWorkGroupInvocations` and
    /// `maxComputeWorkGroupSize[0]` (the GEMM route checks the hand-written tiled GEMM
    /// and GEMV against them).
    pub max_shared: u32,
    pub max_invocations: u32,
    pub max_group_x: u32,
    /// Uniform texel buffers the CPU-class GEMM reads A and B through
    /// (`crate::gemm::TexelViews`), or none: a format it needs is not supported for
    /// them here.
    pub texel: Option<crate::gemm::TexelViews>,
}

/// `subgroupSizeControl` for compute shaders.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct SubgroupControl {
    /// The sizes a pipeline may require (`minSubgroupSize..=maxSubgroupSize`).
    pub sizes: (u32, u32),
    /// Through VK_EXT_subgroup_size_control (a Vulkan 1.2 device), not core 1.3.
    pub extension: bool,
}

impl Features {
    pub fn caps(&self, disable_f16: bool) -> Capabilities {
        Capabilities {
            name: self.name.clone(),
            backend: "vk".into(),
            device_type: self.device_type.into(),
            vendor: self.vendor,
            driver: self.driver.clone(),
            f16_arithmetic: self.f16 && !disable_f16,
            subgroup_sizes: (!self.subgroup_ops.is_empty()).then_some(self.subgroup_range),
            timestamp_queries: self.timestamp_bits > 0 && self.timestamp_period > 0.0,
            max_storage_binding: self.max_storage_binding,
            max_buffer: self.max_buffer,
            memory_budget: self.memory_budget,
            memory_heap: self.memory_heap,
            memory_limit: None,
        }
    }
}

/// The first queue family with compute (and a queue).
pub(crate) fn compute_family(families: &[vk::QueueFamilyProperties]) -> Option<u32> {
    families
        .iter()
        .position(|f| f.queue_count > 0 && f.queue_flags.contains(vk::QueueFlags::COMPUTE))
        .map(|i| i as u32)
}

/// The queue family downloads run on beside the compute family: one that transfers
/// and does neither graphics nor compute, which on discrete GPUs is a copy (DMA) engine
/// that runs beside the kernels. None where the device has no such family: a family
/// that also computes shares the compute engines, so a copy there would gain nothing.
pub(crate) fn transfer_family(families: &[vk::QueueFamilyProperties], compute: u32) -> Option<u32> {
    let engines = vk::QueueFlags::GRAPHICS | vk::QueueFlags::COMPUTE;
    families
        .iter()
        .enumerate()
        .position(|(i, f)| {
            i as u32 != compute
                && f.queue_count > 0
                && f.queue_flags.contains(vk::QueueFlags::TRANSFER)
                && !f.queue_flags.intersects(engines)
        })
        .map(|i| i as u32)
}

/// The Vulkan devices Kiln can open, as `vk:N` numbers them (none without a loader).
pub fn physical_devices() -> Vec<VkSummary> {
    let Ok(instance) = Instance::unchecked() else {
        return vec![];
    };
    instance
        .physical_devices()
        .into_iter()
        .enumerate()
        .map(|(index, pd)| VkSummary {
            index,
            caps: instance.features(pd).caps(false),
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::ffi::OsStr;

    #[test]
    fn validation_is_on_in_debug_builds_unless_kiln_vk_validation_says_otherwise() {
        assert!(validation_wanted(None, true).unwrap());
        assert!(!validation_wanted(None, false).unwrap());
        assert!(!validation_wanted(Some(OsStr::new("0")), true).unwrap());
        assert!(validation_wanted(Some(OsStr::new("1")), false).unwrap());
        let e = validation_wanted(Some(OsStr::new("yes")), true)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("KILN_VK_VALIDATION=yes") && e.contains("use 1"),
            "{e}"
        );
    }

    #[test]
    fn a_missing_layer_is_an_error_only_where_kiln_vk_validation_1_asks_for_it() {
        let e = use_layer(true, true, false).unwrap_err().to_string();
        assert!(
            e.contains("VK_LAYER_KHRONOS_validation")
                && e.contains("apt-get install vulkan-validationlayers"),
            "{e}"
        );
        // A debug build on a machine without the layer runs without it.
        assert!(!use_layer(true, false, false).unwrap());
        assert!(use_layer(true, false, true).unwrap());
        assert!(!use_layer(false, false, true).unwrap());
    }

    fn families(flags: &[vk::QueueFlags]) -> Vec<vk::QueueFamilyProperties> {
        flags
            .iter()
            .map(|&queue_flags| vk::QueueFamilyProperties {
                queue_flags,
                queue_count: 1,
                ..Default::default()
            })
            .collect()
    }

    /// Downloads get a queue of their own only on a family that copies and neither
    /// computes nor draws (a DMA engine), never on the compute family itself.
    #[test]
    fn the_transfer_family_is_a_copy_only_family_beside_compute() {
        use vk::QueueFlags as Q;
        // An NVIDIA-like device: graphics+compute, copy-only, compute-only, video.
        let nv = families(&[
            Q::GRAPHICS | Q::COMPUTE | Q::TRANSFER | Q::SPARSE_BINDING,
            Q::TRANSFER | Q::SPARSE_BINDING,
            Q::COMPUTE | Q::TRANSFER | Q::SPARSE_BINDING,
            Q::VIDEO_DECODE_KHR,
        ]);
        assert_eq!(compute_family(&nv), Some(0));
        assert_eq!(transfer_family(&nv, 0), Some(1));
        // lavapipe, Intel: one family that does everything.
        let one = families(&[Q::GRAPHICS | Q::COMPUTE | Q::TRANSFER]);
        assert_eq!(compute_family(&one), Some(0));
        assert_eq!(transfer_family(&one, 0), None);
        // A compute-only family with transfers is not a DMA engine.
        let two = families(&[
            Q::GRAPHICS | Q::COMPUTE | Q::TRANSFER,
            Q::COMPUTE | Q::TRANSFER,
        ]);
        assert_eq!(transfer_family(&two, 0), None);
        // A graphics family without compute (transfers implied) is no copy engine either.
        let gfx = families(&[Q::COMPUTE | Q::TRANSFER, Q::GRAPHICS | Q::TRANSFER]);
        assert_eq!(transfer_family(&gfx, 0), None);
        // Transfer bits after the compute family: the first such family is taken.
        let amd = families(&[Q::TRANSFER, Q::COMPUTE, Q::TRANSFER | Q::SPARSE_BINDING]);
        assert_eq!(compute_family(&amd), Some(1));
        assert_eq!(transfer_family(&amd, 1), Some(0));
        // The compute family is never its own transfer family, and a family without
        // queues is skipped.
        assert_eq!(transfer_family(&families(&[Q::TRANSFER]), 0), None);
        let mut empty = families(&[Q::COMPUTE, Q::TRANSFER, Q::TRANSFER]);
        empty[1].queue_count = 0;
        assert_eq!(transfer_family(&empty, 0), Some(2));
        assert_eq!(compute_family(&families(&[Q::GRAPHICS, Q::TRANSFER])), None);
    }

    /// The layer is installed here (scripts/setup.sh installs it): asked for, the
    /// instance runs under it; not asked for, it does not.
    #[test]
    fn the_instance_runs_under_the_layer_exactly_when_asked() {
        let on = Instance::create(true, true).unwrap_or_else(|e| panic!("{e}"));
        assert!(on.validating());
        assert!(on.take_validation_errors().is_empty());
        assert!(!Instance::create(false, false).unwrap().validating());
        assert!(!Instance::unchecked().unwrap().validating());
    }
}
