//! Adapter discovery and device creation.

use std::sync::OnceLock;

use kiln_engine::{Capabilities, Error, Result};
use kiln_lowering::DeviceOptions;

/// One adapter as `kiln devices` shows it.
#[derive(Clone, Debug, serde::Serialize)]
pub struct AdapterSummary {
    pub index: usize,
    #[serde(flatten)]
    pub caps: Capabilities,
}

/// What to tell someone whose machine shows no adapter.
pub const NO_ADAPTER_HINT: &str =
    "On Debian/Ubuntu without a GPU, install Mesa's software Vulkan driver \
(lavapipe): `sudo apt-get install -y mesa-vulkan-drivers`. With a GPU, install its Vulkan driver.";

/// wgpu's defaults for the build, but never the driver's validation layers: in debug
/// builds wgpu would load the Vulkan validation layer wherever it is installed (as
/// scripts/setup.sh does, for the `vk` backend's checks), yet it only logs what the layer
/// reports (and keeps every message in memory), and Kiln installs no logger: it cost the
/// GPT tests of tests/vk.rs about 15% on lavapipe (run one at a time) and could fail
/// nothing. wgpu's own (WebGPU) validation is unaffected.
fn instance_flags() -> wgpu::InstanceFlags {
    wgpu::InstanceFlags::from_build_config() - wgpu::InstanceFlags::VALIDATION
}

pub(crate) fn instance() -> &'static wgpu::Instance {
    static INSTANCE: OnceLock<wgpu::Instance> = OnceLock::new();
    INSTANCE.get_or_init(|| {
        wgpu::Instance::new(wgpu::InstanceDescriptor {
            backends: wgpu::Backends::all(),
            flags: instance_flags(),
            ..wgpu::InstanceDescriptor::new_without_display_handle()
        })
    })
}

/// Every adapter wgpu finds, on every backend, in a stable order.
pub(crate) fn raw_adapters() -> &'static [wgpu::Adapter] {
    static ADAPTERS: OnceLock<Vec<wgpu::Adapter>> = OnceLock::new();
    ADAPTERS.get_or_init(|| {
        let mut list = pollster::block_on(instance().enumerate_adapters(wgpu::Backends::all()));
        // Vulkan first, then the rest, so that index 0 is the best-supported path.
        list.sort_by_key(|a| backend_rank(a.get_info().backend));
        list
    })
}

fn backend_rank(b: wgpu::Backend) -> u8 {
    match b {
        wgpu::Backend::Vulkan => 0,
        wgpu::Backend::Metal => 1,
        wgpu::Backend::Dx12 => 2,
        wgpu::Backend::Gl => 3,
        _ => 4,
    }
}

/// Lists every adapter with its capabilities.
pub fn adapters() -> Vec<AdapterSummary> {
    raw_adapters()
        .iter()
        .enumerate()
        .map(|(index, a)| AdapterSummary {
            index,
            caps: capabilities(a, &DeviceOptions::default()),
        })
        .collect()
}

/// Index of the first adapter on `backend` (`vulkan`, `gl`, `metal`, `dx12`).
pub fn find_adapter(backend: &str) -> Result<usize> {
    let all = adapters();
    all.iter()
        .find(|a| a.caps.backend == backend)
        .map(|a| a.index)
        .ok_or_else(|| Error::NoAdapter {
            hint: format!(
                "none on backend `{backend}` ({} adapter(s) on other backends). {NO_ADAPTER_HINT}",
                all.len()
            ),
        })
}

pub(crate) fn backend_name(b: wgpu::Backend) -> &'static str {
    match b {
        wgpu::Backend::Vulkan => "vulkan",
        wgpu::Backend::Metal => "metal",
        wgpu::Backend::Dx12 => "dx12",
        wgpu::Backend::Gl => "gl",
        wgpu::Backend::BrowserWebGpu => "webgpu",
        wgpu::Backend::Noop => "noop",
    }
}

/// Capabilities of an adapter as a device opened with `options` would have them.
pub(crate) fn capabilities(a: &wgpu::Adapter, options: &DeviceOptions) -> Capabilities {
    let disable_f16 = options.disable_f16;
    let info = a.get_info();
    let features = a.features();
    let limits = a.limits();
    let device_type = match info.device_type {
        wgpu::DeviceType::DiscreteGpu => "discrete",
        wgpu::DeviceType::IntegratedGpu => "integrated",
        wgpu::DeviceType::VirtualGpu => "virtual",
        wgpu::DeviceType::Cpu => "cpu",
        wgpu::DeviceType::Other => "other",
    };
    let driver = [info.driver.as_str(), info.driver_info.as_str()]
        .iter()
        .filter(|s| !s.is_empty())
        .copied()
        .collect::<Vec<_>>()
        .join(" ");
    Capabilities {
        name: info.name.clone(),
        backend: backend_name(info.backend).into(),
        device_type: device_type.into(),
        vendor: info.vendor,
        driver,
        f16_arithmetic: features.contains(wgpu::Features::SHADER_F16) && !disable_f16,
        subgroup_sizes: features
            .contains(wgpu::Features::SUBGROUP)
            .then_some((info.subgroup_min_size, info.subgroup_max_size)),
        timestamp_queries: features.contains(
            wgpu::Features::TIMESTAMP_QUERY | wgpu::Features::TIMESTAMP_QUERY_INSIDE_PASSES,
        ) && !options.disable_timestamps,
        max_storage_binding: options
            .max_storage_binding
            .map_or(limits.max_storage_buffer_binding_size, |l| {
                l.min(limits.max_storage_buffer_binding_size)
            }),
        max_buffer: limits.max_buffer_size,
        memory_budget: None,
        memory_heap: vulkan_heap(a),
        memory_limit: None,
    }
    .with_memory_limit(options.memory_limit)
}

/// The summed size of a Vulkan adapter's device-local memory heaps, asked of the
/// driver through wgpu's Vulkan layer (wgpu reports no memory sizes itself); `None` on
/// the other backends, which have no such query here.
#[cfg(not(any(target_arch = "wasm32", target_vendor = "apple")))]
fn vulkan_heap(a: &wgpu::Adapter) -> Option<u64> {
    use ash::vk;
    // SAFETY: the hal adapter is only read, while `a` keeps it alive.
    let hal = unsafe { a.as_hal::<wgpu::hal::api::Vulkan>() }?;
    let instance = hal.shared_instance().raw_instance();
    // SAFETY: the physical device was enumerated from this live instance.
    let props =
        unsafe { instance.get_physical_device_memory_properties(hal.raw_physical_device()) };
    kiln_engine::device::device_local_total(
        props.memory_heaps[..props.memory_heap_count as usize]
            .iter()
            .map(|h| (h.size, h.flags.contains(vk::MemoryHeapFlags::DEVICE_LOCAL))),
    )
}

#[cfg(any(target_arch = "wasm32", target_vendor = "apple"))]
fn vulkan_heap(_: &wgpu::Adapter) -> Option<u64> {
    None
}

#[cfg(test)]
mod tests {
    /// Debug builds (the tests) too: the layer's cost bought nothing through wgpu.
    #[test]
    fn wgpu_never_loads_the_drivers_validation_layers() {
        assert!(!super::instance_flags().contains(wgpu::InstanceFlags::VALIDATION));
    }
}
