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

/// Why `path` could not be created (`e`, from creating a file or a directory there),
/// in words that send the user the right way: a parent that is missing, or one that is
/// there but takes no new entry (no write permission, a read-only or virtual file
/// system such as /proc, where creating reports "not found" too). `None` for other
/// failures (a full disk, too many open files), which their own message says best.
pub fn cannot_create(path: &Path, e: &std::io::Error) -> Option<String> {
    use std::io::ErrorKind;
    let dir = path
        .parent()
        .filter(|d| !d.as_os_str().is_empty())
        .unwrap_or(Path::new("."));
    match e.kind() {
        ErrorKind::NotFound if !dir.is_dir() => Some(format!(
            "its directory does not exist ({}): create it first, or write somewhere else",
            dir.display()
        )),
        ErrorKind::NotFound | ErrorKind::PermissionDenied | ErrorKind::ReadOnlyFilesystem => {
            Some(format!(
                "cannot create it in {} ({e}): the directory exists but does not take new \
                 entries (no write permission, a read-only or virtual file system); write \
                 somewhere else",
                dir.display()
            ))
        }
        _ => None,
    }
}

/// A temporary name for `path` while it is written: this process's and this write's
/// own, so two threads saving the same file (two devices of one adapter saving their
/// pipeline cache) do not rename each other's temporary file away.
pub(crate) fn tmp_path(path: &Path) -> PathBuf {
    static WRITES: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let n = WRITES.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let mut name = path.file_name().unwrap_or_default().to_os_string();
    name.push(format!(".tmp-{}-{n}", std::process::id()));
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

/// The user cache directory Kiln keeps measured data in: `$KILN_CACHE_DIR`, else the
/// platform's (`$XDG_CACHE_HOME/kiln` or `~/.cache/kiln`, `~/Library/Caches/kiln`,
/// `%LOCALAPPDATA%\kiln`).
pub fn cache_dir() -> Option<PathBuf> {
    if let Some(d) = std::env::var_os("KILN_CACHE_DIR") {
        return Some(PathBuf::from(d));
    }
    if cfg!(windows) {
        return std::env::var_os("LOCALAPPDATA").map(|d| PathBuf::from(d).join("kiln"));
    }
    if cfg!(target_os = "macos") {
        return std::env::var_os("HOME").map(|h| PathBuf::from(h).join("Library/Caches/kiln"));
    }
    if let Some(d) = std::env::var_os("XDG_CACHE_HOME").filter(|d| !d.is_empty()) {
        return Some(PathBuf::from(d).join("kiln"));
    }
    std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache/kiln"))
}

/// The host CPU's model and vector width: a CPU adapter's speed depends on it (lavapipe
/// reports one adapter name on every host), so it is part of the key of what is
/// cached per adapter (a peak, compiled pipelines, which hold host machine code).
pub fn host_cpu() -> String {
    let info = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
    let model = info
        .lines()
        .find_map(|l| l.strip_prefix("model name"))
        .and_then(|l| l.split_once(':'))
        .map(|(_, m)| m.trim().to_string())
        .unwrap_or_else(|| std::env::consts::ARCH.to_string());
    let flags = info
        .lines()
        .find(|l| l.starts_with("flags"))
        .unwrap_or_default();
    let vector = if flags.contains(" avx512f") {
        ", AVX-512"
    } else if flags.contains(" avx2") {
        ", AVX2"
    } else {
        ""
    };
    format!("{model}{vector}")
}

/// Replaces `path` with `bytes` atomically (a reader sees the old file or the new one,
/// never a mix), for caches that other processes may read meanwhile.
pub fn replace_file(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    write_atomic(path, bytes).map_err(|f| {
        std::io::Error::new(
            f.err.kind(),
            format!("{} {}: {}", f.action, f.path.display(), f.err),
        )
    })
}

#[cfg(test)]
mod tests {
    #[test]
    fn threads_replacing_one_file_at_once_all_succeed() {
        // Two devices of one adapter save the same pipeline cache file when their
        // compiles finish: with one temporary name per process, one thread renamed the
        // other's file away and the other's save failed.
        let dir = std::env::temp_dir().join(format!("kiln-fsutil-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("cache.bin");
        let barrier = std::sync::Barrier::new(4);
        std::thread::scope(|s| {
            for t in 0..4u8 {
                let (path, barrier) = (&path, &barrier);
                s.spawn(move || {
                    barrier.wait();
                    for _ in 0..50 {
                        super::write_atomic(path, &[t; 4096]).unwrap();
                    }
                });
            }
        });
        let kept = std::fs::read(&path).unwrap();
        assert!(kept.len() == 4096 && kept.iter().all(|&b| b == kept[0]));
        let left: Vec<_> = std::fs::read_dir(&dir).unwrap().collect();
        assert_eq!(left.len(), 1, "temporary files left behind");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
