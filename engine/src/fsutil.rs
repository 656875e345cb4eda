//! Durable file writes shared by the checkpoint, run-ledger and safetensors code.
//!
//! A durable write is: write the bytes, `fsync` the file, and `fsync` the directory
//! that holds its name. An atomic replacement writes a temporary file beside the
//! target, makes it durable, renames it over the target and `fsync`s the directory,
//! so a reader sees either the old contents or the new ones, never a mix.

use std::io::Write;
use std::path::{Path, PathBuf};

/// An I/O failure with what was being done and to which path.
#[derive(Debug)]
pub(crate) struct IoFailure {
    pub action: &'static str,
    pub path: PathBuf,
    pub err: std::io::Error,
}

pub(crate) type IoResult<T> = std::result::Result<T, IoFailure>;

/// Attaches an action and a path to an I/O result.
pub(crate) fn ctx<T>(r: std::io::Result<T>, action: &'static str, path: &Path) -> IoResult<T> {
    r.map_err(|err| IoFailure {
        action,
        path: path.to_path_buf(),
        err,
    })
}

/// The temporary name this process uses for `path` while writing it.
pub(crate) fn tmp_path(path: &Path) -> PathBuf {
    let mut name = path.file_name().unwrap_or_default().to_os_string();
    name.push(format!(".tmp-{}", std::process::id()));
    path.with_file_name(name)
}

/// Flushes a directory entry to disk: new, renamed or removed names in `dir` survive
/// a power loss. A no-op where directories cannot be opened for syncing (Windows).
pub(crate) fn sync_dir(dir: &Path) -> IoResult<()> {
    #[cfg(unix)]
    {
        let f = ctx(std::fs::File::open(dir), "opening directory", dir)?;
        ctx(f.sync_all(), "flushing directory", dir)
    }
    #[cfg(not(unix))]
    {
        let _ = dir;
        Ok(())
    }
}

/// Creates (or truncates) `path`, writes `bytes` and flushes the file to disk.
pub(crate) fn write_synced(path: &Path, bytes: &[u8]) -> IoResult<()> {
    let mut f = ctx(std::fs::File::create(path), "creating", path)?;
    ctx(f.write_all(bytes), "writing", path)?;
    ctx(f.sync_all(), "flushing", path)
}

/// The directory holding `path`'s name (`.` for a bare file name).
pub(crate) fn parent_dir(path: &Path) -> &Path {
    match path.parent() {
        Some(p) if !p.as_os_str().is_empty() => p,
        _ => Path::new("."),
    }
}

/// Replaces `path` with `bytes` atomically and durably.
pub(crate) fn write_atomic(path: &Path, bytes: &[u8]) -> IoResult<()> {
    let tmp = tmp_path(path);
    if let Err(e) = write_synced(&tmp, bytes) {
        let _ = std::fs::remove_file(&tmp);
        return Err(e);
    }
    if let Err(err) = std::fs::rename(&tmp, path) {
        let _ = std::fs::remove_file(&tmp);
        return Err(IoFailure {
            action: "renaming the finished temporary file to",
            path: path.to_path_buf(),
            err,
        });
    }
    sync_dir(parent_dir(path))
}
