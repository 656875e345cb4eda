//! wgpu's `PipelineCache` loaded from and saved to the on-disk cache
//! (`kiln_lowering::pipeline_cache`: the file format and place both backends share),
//! where the backend supports it.

use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};

use kiln_lowering::pipeline_cache::{dir, encode, fnv, payload, write};
use kiln_lowering::{DeviceOptions, SHADER_HASH};

pub(crate) struct DiskCache {
    pub cache: wgpu::PipelineCache,
    pub path: PathBuf,
    key: u64,
    /// Pipelines were built since the last save.
    pub dirty: AtomicBool,
}

/// What the cache file is keyed by (the GEMM selection file too).
pub(crate) fn key(info: &wgpu::AdapterInfo) -> u64 {
    let host = if info.device_type == wgpu::DeviceType::Cpu {
        kiln_engine::fsutil::host_cpu()
    } else {
        String::new()
    };
    fnv(format!(
        "{}|{:?}|{}|{}|{}|{}|{}|{}|wgpu {}|kiln-wgpu {}",
        info.name,
        info.backend,
        info.vendor,
        info.device,
        info.driver,
        info.driver_info,
        host,
        SHADER_HASH,
        wgpu::util::pipeline_cache_key(info).unwrap_or_default(),
        env!("CARGO_PKG_VERSION"),
    )
    .as_bytes())
}

fn note(what: String) {
    eprintln!("kiln: note: {what}");
}

/// The file and the cache loaded from it, for a device of `adapter` that was opened
/// with `Features::PIPELINE_CACHE`; `None` where the options turn it off or there is
/// no cache directory.
pub(crate) fn open(
    device: &wgpu::Device,
    adapter: &wgpu::Adapter,
    options: &DeviceOptions,
) -> Option<DiskCache> {
    if options.no_pipeline_cache {
        return None;
    }
    let dir = dir(options)?;
    let info = adapter.get_info();
    let key = key(&info);
    let path = dir.join(format!("{key:016x}.bin"));
    let file = match std::fs::read(&path) {
        Ok(bytes) => Some(bytes),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => None,
        Err(e) => {
            note(format!(
                "could not read the pipeline cache {} ({e}); kernels compile from source",
                path.display()
            ));
            None
        }
    };
    let data = file.as_deref().and_then(|f| {
        payload(f, key)
            .map_err(|why| {
                note(format!(
                    "ignoring the pipeline cache {}: {why}; it is rebuilt as kernels compile",
                    path.display()
                ))
            })
            .ok()
    });
    // SAFETY: `data` is only ever bytes this driver returned from `get_data` for this
    // very adapter, driver and host (the key and checksum above); `fallback` makes wgpu
    // start empty if it still rejects them.
    let cache = unsafe {
        device.create_pipeline_cache(&wgpu::PipelineCacheDescriptor {
            label: Some("kiln pipelines"),
            data,
            fallback: true,
        })
    };
    Some(DiskCache {
        cache,
        path,
        key,
        dirty: AtomicBool::new(false),
    })
}

impl DiskCache {
    /// Writes the cache if pipelines were built since the last save. Failures are
    /// notes: the run goes on, the next one compiles again.
    pub fn save(&self) {
        if !self.dirty.swap(false, Ordering::Relaxed) {
            return;
        }
        let Some(data) = self.cache.get_data() else {
            return;
        };
        if let Err(e) = write(&self.path, &encode(self.key, &data)) {
            note(format!(
                "could not save compiled kernels to {} ({e}); the next run compiles them again",
                self.path.display()
            ));
        }
    }
}
