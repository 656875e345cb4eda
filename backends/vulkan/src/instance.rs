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

/// The loader and an instance; dropped together.
pub(crate) struct Instance {
    /// Keeps the loader library loaded while the instance lives (and loads the
    /// instance-level functions of device extensions).
    entry: ash::Entry,
    pub instance: ash::Instance,
    pub api: u32,
}

impl Instance {
    pub fn new() -> Result<Instance> {
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
        let info = vk::InstanceCreateInfo::default().application_info(&app);
        // SAFETY: a valid create info without layers or extensions.
        let instance =
            unsafe { entry.create_instance(&info, None) }.map_err(|e| Error::NoAdapter {
                hint: format!("creating a Vulkan instance failed ({e}). {NO_VULKAN_HINT}"),
            })?;
        Ok(Instance {
            entry,
            instance,
            api,
        })
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
        // SAFETY: `pd` came from this instance.
        let families = unsafe {
            self.instance
                .get_physical_device_queue_family_properties(pd)
        };
        families
            .iter()
            .position(|f| f.queue_flags.contains(vk::QueueFlags::COMPUTE))
            .map(|i| i as u32)
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
        }
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

fn p13_max_buffer(p13: &vk::PhysicalDeviceVulkan13Properties) -> u64 {
    if p13.max_buffer_size == 0 {
        u64::MAX
    } else {
        p13.max_buffer_size
    }
}

impl Drop for Instance {
    fn drop(&mut self) {
        // SAFETY: every object made from the instance is gone (the device drops first).
        unsafe { self.instance.destroy_instance(None) };
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
        }
    }
}

/// The Vulkan devices Kiln can open, as `vk:N` numbers them (none without a loader).
pub fn physical_devices() -> Vec<VkSummary> {
    let Ok(instance) = Instance::new() else {
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
