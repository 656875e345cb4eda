//! The on-disk pipeline cache both GPU backends keep compiled pipelines in across
//! runs (wgpu's `PipelineCache`, raw Vulkan's `VkPipelineCache`): its file format and
//! place. Each backend opens, loads and saves its own driver's cache with these.
//!
//! One file per adapter, driver, host CPU (a CPU adapter's pipelines are the host's
//! machine code) and kernel sources, named by a hash of all of them and carrying that
//! key inside too, with a checksum of the driver's bytes: the driver only ever sees
//! data it wrote itself for this very key. Anything else — a damaged, truncated or
//! foreign file — is ignored with a note and replaced on the next save; a cache that
//! cannot be read or written never fails a run. Saves replace the file atomically, so
//! concurrent runs see one complete file or another.

use std::path::{Path, PathBuf};

use crate::options::DeviceOptions;

const MAGIC: &[u8; 8] = b"KILNPC1\n";
/// Magic, key, payload length, payload checksum.
const HEADER: usize = 8 + 8 + 8 + 8;

/// Whether Mesa keeps compiled shaders on disk (its default): without it a first run
/// elsewhere leaves nothing behind, so nothing is primed.
pub fn mesa_cache_on() -> bool {
    let off = |name: &str| {
        std::env::var(name)
            .map(|v| matches!(v.to_ascii_lowercase().as_str(), "1" | "true" | "yes"))
            .unwrap_or(false)
    };
    !off("MESA_SHADER_CACHE_DISABLE") && !off("MESA_GLSL_CACHE_DISABLE")
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
