//! Compiled pipelines kept across runs: wgpu's `PipelineCache` (Vulkan's
//! `VkPipelineCache`) loaded from and saved to the user cache directory, where the
//! backend supports it.
//!
//! One file per adapter, driver, host CPU (a CPU adapter's pipelines are the host's
//! machine code) and kernel sources, named by a hash of all of them and carrying that
//! key inside too, with a checksum of the driver's bytes: the driver only ever sees
//! data it wrote itself for this very key. Anything else — a damaged, truncated or
//! foreign file — is ignored with a note and replaced on the next save; a cache that
//! cannot be read or written never fails a run. Saves replace the file atomically, so
//! concurrent runs see one complete file or another.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};

use crate::adapter::DeviceOptions;

const MAGIC: &[u8; 8] = b"KILNPC1\n";
/// Magic, key, payload length, payload checksum.
const HEADER: usize = 8 + 8 + 8 + 8;

pub(crate) struct DiskCache {
    pub cache: wgpu::PipelineCache,
    pub path: PathBuf,
    key: u64,
    /// Pipelines were built since the last save.
    pub dirty: AtomicBool,
}

/// FNV-1a: stable across builds and platforms (std's hasher is not).
pub fn fnv(bytes: &[u8]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for &b in bytes {
        h ^= b as u64;
        h = h.wrapping_mul(0x100_0000_01b3);
    }
    h
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
        env!("KILN_SHADER_HASH"),
        wgpu::util::pipeline_cache_key(info).unwrap_or_default(),
        env!("CARGO_PKG_VERSION"),
    )
    .as_bytes())
}

fn note(what: String) {
    eprintln!("kiln: note: {what}");
}

/// The driver's bytes in `file`, if it is a whole cache file written for `key`;
/// otherwise why not.
pub fn payload(file: &[u8], key: u64) -> Result<&[u8], &'static str> {
    let word = |i: usize| u64::from_le_bytes(file[i..i + 8].try_into().expect("8 bytes"));
    if file.len() < HEADER || &file[..8] != MAGIC {
        return Err("not a Kiln pipeline cache (damaged?)");
    }
    if word(8) != key {
        return Err("written for another adapter, driver, host CPU or kernel version");
    }
    let data = &file[HEADER..];
    if word(16) != data.len() as u64 || word(24) != fnv(data) {
        return Err("damaged or truncated (its checksum does not match)");
    }
    Ok(data)
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

/// The directory cache files live in: the options' `pipeline_cache_dir`, else the
/// user cache directory's `pipelines` (also the raw Vulkan backend's).
pub fn dir(options: &DeviceOptions) -> Option<PathBuf> {
    match &options.pipeline_cache_dir {
        Some(d) => Some(d.clone()),
        None => Some(kiln_engine::fsutil::cache_dir()?.join("pipelines")),
    }
}

/// A cache file: the header (magic, `key`, length, checksum) and the driver's `data`.
pub fn encode(key: u64, data: &[u8]) -> Vec<u8> {
    let mut file = Vec::with_capacity(HEADER + data.len());
    file.extend_from_slice(MAGIC);
    file.extend_from_slice(&key.to_le_bytes());
    file.extend_from_slice(&(data.len() as u64).to_le_bytes());
    file.extend_from_slice(&fnv(data).to_le_bytes());
    file.extend_from_slice(data);
    file
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

/// Replaces `path` with `bytes` atomically, making its directory first.
pub fn write(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir)?;
    }
    kiln_engine::fsutil::replace_file(path, bytes)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn file(key: u64, data: &[u8]) -> Vec<u8> {
        encode(key, data)
    }

    #[test]
    fn only_a_whole_file_for_this_key_reaches_the_driver() {
        let good = file(7, b"driver bytes");
        assert_eq!(payload(&good, 7), Ok(&b"driver bytes"[..]));
        assert!(payload(&good, 8).unwrap_err().contains("another adapter"));
        let mut flipped = good.clone();
        *flipped.last_mut().unwrap() ^= 1;
        assert!(payload(&flipped, 7).unwrap_err().contains("checksum"));
        assert!(payload(&good[..good.len() - 1], 7)
            .unwrap_err()
            .contains("truncated"));
        assert!(payload(b"garbage", 7).unwrap_err().contains("not a Kiln"));
        assert!(payload(b"", 7).unwrap_err().contains("not a Kiln"));
    }
}
