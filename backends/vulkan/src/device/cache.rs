//! The on-disk pipeline cache: its key, loading and saving.

use super::*;

/// What the cache file is keyed by: the device, driver, host CPU (a CPU device's
/// pipelines are the host's machine code) and kernel sources.
pub(super) fn cache_key(f: &Features) -> u64 {
    let host = if f.device_type == "cpu" {
        kiln_engine::fsutil::host_cpu()
    } else {
        String::new()
    };
    kiln_lowering::pipeline_cache::fnv(
        format!(
            "vk|{}|{}|{}|{}|{:?}|{}|{}|{}|kiln-vulkan {}",
            f.name,
            f.vendor,
            f.device_id,
            f.driver_version,
            f.cache_uuid,
            f.driver,
            host,
            kiln_lowering::SHADER_HASH,
            env!("CARGO_PKG_VERSION")
        )
        .as_bytes(),
    )
}

/// The device's `VkPipelineCache`, loaded from the cache directory (the wgpu
/// backend's file format: only whole files this driver wrote for this key reach it;
/// anything else is ignored with a note), and where to save it.
pub(super) fn open_cache(
    device: &ash::Device,
    features: &Features,
    options: &DeviceOptions,
) -> std::result::Result<(vk::PipelineCache, Option<(std::path::PathBuf, u64)>), vk::Result> {
    let place = (!options.no_pipeline_cache)
        .then(|| kiln_lowering::pipeline_cache::dir(options))
        .flatten()
        .map(|dir| {
            let key = cache_key(features);
            (dir.join(format!("vk-{key:016x}.bin")), key)
        });
    let file = place
        .as_ref()
        .and_then(|(path, _)| std::fs::read(path).ok());
    let data = match (&file, &place) {
        (Some(f), Some((path, key))) => match kiln_lowering::pipeline_cache::payload(f, *key) {
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
    pub(super) fn save_cache(&self) {
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
        let file = kiln_lowering::pipeline_cache::encode(*key, &data);
        if let Err(e) = kiln_lowering::pipeline_cache::write(path, &file) {
            eprintln!(
                "kiln: note: could not save compiled kernels to {} ({e}); the next run compiles them again",
                path.display()
            );
        }
    }
}
