//! Host-side training checkpoints: everything `--resume` needs to continue a run
//! bit-identically.
//!
//! A checkpoint is a directory `<run>/checkpoints/step-00000100/` holding one
//! safetensors file per group of tensors (the caller chooses: typically
//! [`MODEL_FILE`] with the model's weights under GPT-2 names and [`OPTIMIZER_FILE`]
//! with `master.<name>`, `exp_avg.<name>`, `exp_avg_sq.<name>`), and `manifest.json`
//! recording the format version, the step, the caller's state JSON (loss scaler,
//! schedule, data position, RNG, counters) and, per file, its byte size, SHA-256 and
//! tensor list.
//!
//! Saving is atomic: the files go into `step-00000100.tmp-<pid>-<n>/`, each is flushed to
//! disk, then the directory; it is renamed to its final name and the parent flushed;
//! only then is the `latest` pointer replaced (temporary file + rename) and are older
//! checkpoints beyond the caller's `keep_last` removed. A crash at any point leaves
//! the previous checkpoint loadable. Loading verifies sizes, checksums and every
//! listed tensor before handing anything back, and each error names the file and what
//! to do about it.

use std::collections::HashSet;
use std::fmt::Write as _;
use std::path::{Path, PathBuf};

use safetensors::SafeTensors;
use serde::{Deserialize, Serialize};
use serde_json::Value;
use sha2::{Digest, Sha256};

pub use crate::device::host::HostTensor;
use crate::device::safetensors_io::{encode_to_file, st_dtype};
use crate::fsutil::{self, ctx, IoFailure};
use crate::{DType, HostData};

/// The directory under a run that holds its checkpoints.
pub const CHECKPOINTS_DIR: &str = "checkpoints";
/// The pointer file naming the newest complete checkpoint directory.
pub const LATEST_FILE: &str = "latest";
/// The manifest inside each checkpoint directory.
pub const MANIFEST_FILE: &str = "manifest.json";
/// Conventional file name for the model's weights (GPT-2 tensor names).
pub const MODEL_FILE: &str = "model.safetensors";
/// Conventional file name for master weights and optimizer moments.
pub const OPTIMIZER_FILE: &str = "optimizer.safetensors";
/// The manifest format this build writes, and the newest it reads.
pub const FORMAT_VERSION: u32 = 1;
const FORMAT_NAME: &str = "kiln-checkpoint";
/// Marks a directory or file being written (or left over by a crash).
const TMP_MARK: &str = ".tmp-";

const FIX_DAMAGED: &str = "resume from an earlier checkpoint or delete this directory";

/// Everything that can go wrong saving or loading a checkpoint. Each message names
/// the path involved and the fix.
#[derive(Debug, thiserror::Error)]
pub enum CheckpointError {
    #[error("{action} `{}`: {err} (check that the path exists and is writable and that the disk is not full)", .path.display())]
    Io {
        action: &'static str,
        path: PathBuf,
        err: std::io::Error,
    },

    #[error("cannot save checkpoint: {0}")]
    InvalidInput(String),

    #[error("no checkpoint to resume from in `{}`{detail}: start the run without --resume, or point it at a run that has saved a checkpoint", .dir.display())]
    NoCheckpoint { dir: PathBuf, detail: String },

    #[error("checkpoint file `{}` is missing: the checkpoint is incomplete or was modified; {FIX_DAMAGED}", .path.display())]
    MissingFile { path: PathBuf },

    #[error("checkpoint manifest `{}` is unreadable ({detail}); {FIX_DAMAGED}", .path.display())]
    BadManifest { path: PathBuf, detail: String },

    #[error("checkpoint `{}` has format `{format}` version {version}, but this build reads `{FORMAT_NAME}` up to version {FORMAT_VERSION}: use the Kiln version that wrote it", .path.display())]
    Unsupported {
        path: PathBuf,
        format: String,
        version: u32,
    },

    #[error("checkpoint `{}` is truncated ({found} of {expected} bytes): the write was interrupted; {FIX_DAMAGED}", .path.display())]
    Truncated {
        path: PathBuf,
        found: u64,
        expected: u64,
    },

    #[error("checkpoint `{}` is {found} bytes but its manifest records {expected}: it was modified after saving; {FIX_DAMAGED}", .path.display())]
    Oversized {
        path: PathBuf,
        found: u64,
        expected: u64,
    },

    #[error("checkpoint `{}` is corrupt: its SHA-256 is {found} but the manifest records {expected} (damaged on disk or modified after saving); {FIX_DAMAGED}", .path.display())]
    Checksum {
        path: PathBuf,
        expected: String,
        found: String,
    },

    #[error("checkpoint `{}` is not a valid safetensors file ({detail}); {FIX_DAMAGED}", .path.display())]
    InvalidFile { path: PathBuf, detail: String },

    #[error("checkpoint `{}` has no tensor `{tensor}` although its manifest lists it; {FIX_DAMAGED}", .path.display())]
    MissingTensor { path: PathBuf, tensor: String },

    #[error("checkpoint `{}` holds tensor `{tensor}`, which its manifest does not list; {FIX_DAMAGED}", .path.display())]
    UnlistedTensor { path: PathBuf, tensor: String },

    #[error("checkpoint `{}`: tensor `{tensor}` {detail}; {FIX_DAMAGED}", .path.display())]
    TensorMismatch {
        path: PathBuf,
        tensor: String,
        detail: String,
    },

    #[error("checkpoint `{}` has no file `{file}` (it has: {available}): it was saved by a different training setup; resume with the configuration in the run's config.json", .dir.display())]
    NoSuchFile {
        dir: PathBuf,
        file: String,
        available: String,
    },

    #[error("checkpoint `{}` has no tensor `{tensor}` in `{file}` (which holds {count} tensors): it was saved from a different model; resume with the configuration in the run's config.json", .dir.display())]
    NoSuchTensor {
        dir: PathBuf,
        file: String,
        tensor: String,
        count: usize,
    },

    #[error("checkpoint `{}`: tensor `{tensor}` in `{file}` is {found} but the model expects {expected}: it was saved from a different model or precision; resume with the configuration in the run's config.json", .dir.display())]
    WrongTensor {
        dir: PathBuf,
        file: String,
        tensor: String,
        found: String,
        expected: String,
    },

    #[error("checkpoint `{}`: the manifest's state has no valid `{what}`; the checkpoint was not written by this version of Kiln", .dir.display())]
    BadState { dir: PathBuf, what: &'static str },

    #[error("checkpoint `{}`: its manifest says step {manifest} but the training state it holds has done {state} steps: the manifest was edited or damaged, and resuming would report one step and continue from the other; {FIX_DAMAGED}", .dir.display())]
    StepMismatch {
        dir: PathBuf,
        manifest: u64,
        state: u64,
    },

    /// Reading the state off the devices, or putting it back, failed.
    #[error(transparent)]
    Device(#[from] crate::Error),
}

impl From<IoFailure> for CheckpointError {
    fn from(f: IoFailure) -> Self {
        CheckpointError::Io {
            action: f.action,
            path: f.path,
            err: f.err,
        }
    }
}

pub type Result<T, E = CheckpointError> = std::result::Result<T, E>;

/// One safetensors file of a checkpoint: a plain file name and its tensors.
#[derive(Clone, Debug, PartialEq)]
pub struct CheckpointFile {
    pub name: String,
    pub tensors: Vec<HostTensor>,
}

impl CheckpointFile {
    pub fn new(name: impl Into<String>, tensors: Vec<HostTensor>) -> CheckpointFile {
        CheckpointFile {
            name: name.into(),
            tensors,
        }
    }

    pub fn tensor(&self, name: &str) -> Option<&HostTensor> {
        self.tensors.iter().find(|t| t.name == name)
    }
}

/// `manifest.json`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Manifest {
    pub format: String,
    pub format_version: u32,
    pub step: u64,
    /// The caller's training state, returned as saved.
    pub state: Value,
    pub files: Vec<FileEntry>,
}

/// One file as recorded in the manifest.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct FileEntry {
    pub name: String,
    pub bytes: u64,
    pub sha256: String,
    pub tensors: Vec<TensorEntry>,
}

/// One tensor as recorded in the manifest.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct TensorEntry {
    pub name: String,
    pub dtype: DType,
    pub shape: Vec<usize>,
}

/// How [`save`] treats older checkpoints.
#[derive(Clone, Copy, Debug)]
pub struct SaveOptions {
    /// How many checkpoints to keep, the new one included (0 keeps all). Older ones
    /// are removed only after the new one is complete and `latest` names it.
    pub keep_last: usize,
}

impl Default for SaveOptions {
    fn default() -> Self {
        SaveOptions { keep_last: 3 }
    }
}

/// What [`save`] did.
#[derive(Clone, Debug)]
pub struct Saved {
    /// The new checkpoint directory.
    pub dir: PathBuf,
    /// Older checkpoints removed by retention.
    pub removed: Vec<PathBuf>,
    /// Anything the caller should tell the user (a leftover that could not be
    /// removed, checkpoints newer than this step kept from before a resume).
    pub notes: Vec<String>,
}

/// A verified checkpoint, loaded into host memory.
#[derive(Clone, Debug)]
pub struct Checkpoint {
    pub dir: PathBuf,
    pub manifest: Manifest,
    /// The files, in manifest order, each with its tensors in manifest order.
    pub files: Vec<CheckpointFile>,
    /// What [`load_latest`] had to work around (a dangling `latest`, leftover
    /// temporary directories): the caller should show these to the user.
    pub notes: Vec<String>,
}

impl Checkpoint {
    pub fn step(&self) -> u64 {
        self.manifest.step
    }

    /// The caller's state JSON, exactly as saved.
    pub fn state(&self) -> &Value {
        &self.manifest.state
    }

    /// Every parameter's f32 master weights, under the parameter's name (the
    /// `master.<name>` tensors of [`OPTIMIZER_FILE`]).
    pub fn masters(&self) -> Result<Vec<HostTensor>> {
        Ok(self
            .file(OPTIMIZER_FILE)?
            .tensors
            .iter()
            .filter_map(|t| {
                t.name.strip_prefix("master.").map(|n| HostTensor {
                    name: n.to_string(),
                    shape: t.shape.clone(),
                    data: t.data.clone(),
                })
            })
            .collect())
    }

    /// The model's weights as training holds them: each tensor of the model file, its
    /// f32 master in its place where the checkpoint has one (a 16-bit run's weights
    /// start a new run, or are fingerprinted, at full precision).
    pub fn trained_weights(&self) -> Result<Vec<HostTensor>> {
        let masters = self.file(OPTIMIZER_FILE).ok();
        Ok(self
            .file(MODEL_FILE)?
            .tensors
            .iter()
            .map(
                |t| match masters.and_then(|m| m.tensor(&format!("master.{}", t.name))) {
                    Some(m) => HostTensor::new(&t.name, t.shape.clone(), m.data.clone()),
                    None => t.clone(),
                },
            )
            .collect())
    }

    /// A file by name, or an error naming it and the files there are.
    pub fn file(&self, file: &str) -> Result<&CheckpointFile> {
        self.files
            .iter()
            .find(|f| f.name == file)
            .ok_or_else(|| CheckpointError::NoSuchFile {
                dir: self.dir.clone(),
                file: file.to_string(),
                available: self
                    .files
                    .iter()
                    .map(|f| f.name.as_str())
                    .collect::<Vec<_>>()
                    .join(", "),
            })
    }

    /// A tensor by file and name, or an error naming both.
    pub fn tensor(&self, file: &str, name: &str) -> Result<&HostTensor> {
        let f = self.file(file)?;
        f.tensor(name).ok_or_else(|| CheckpointError::NoSuchTensor {
            dir: self.dir.clone(),
            file: file.to_string(),
            tensor: name.to_string(),
            count: f.tensors.len(),
        })
    }

    /// A tensor that must have the given dtype and shape (what the model being
    /// resumed allocates), or an error naming both descriptions.
    pub fn tensor_checked(
        &self,
        file: &str,
        name: &str,
        dtype: DType,
        shape: &[usize],
    ) -> Result<&HostTensor> {
        let t = self.tensor(file, name)?;
        if t.data.dtype() != dtype || t.shape != shape {
            return Err(CheckpointError::WrongTensor {
                dir: self.dir.clone(),
                file: file.to_string(),
                tensor: name.to_string(),
                found: format!("{} {:?}", t.data.dtype(), t.shape),
                expected: format!("{dtype} {shape:?}"),
            });
        }
        Ok(t)
    }
}

/// The directory name of the checkpoint for `step`: `step-00000100`.
pub fn dir_name(step: u64) -> String {
    format!("step-{step:08}")
}

/// The step of a final checkpoint directory name (`None` for anything else,
/// temporary directories included).
fn parse_dir_name(name: &str) -> Option<u64> {
    let digits = name.strip_prefix("step-")?;
    if digits.is_empty() || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    digits.parse().ok()
}

fn sha256_hex(bytes: &[u8]) -> String {
    hex(&Sha256::digest(bytes))
}

fn hex(digest: &[u8]) -> String {
    let mut s = String::with_capacity(64);
    for b in digest {
        let _ = write!(s, "{b:02x}");
    }
    s
}

/// Flushes the file at `path` to the disk and returns its length and SHA-256, read
/// back a few MiB at a time.
fn synced_digest(path: &Path) -> Result<(u64, String)> {
    use std::io::Read;
    // Writable: flushing a file needs write access on some systems (Windows).
    let open = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(path);
    let mut f = ctx(open, "opening", path)?;
    ctx(f.sync_all(), "flushing", path)?;
    let (mut hasher, mut len) = (Sha256::new(), 0u64);
    let mut buf = vec![0u8; 8 << 20];
    loop {
        let n = ctx(f.read(&mut buf), "reading back", path)?;
        if n == 0 {
            break;
        }
        hasher.update(&buf[..n]);
        len += n as u64;
    }
    Ok((len, hex(&hasher.finalize())))
}

/// A file name that stays inside the checkpoint directory.
fn is_plain_file_name(name: &str) -> bool {
    !name.is_empty()
        && name != "."
        && name != ".."
        && !name.contains(['/', '\\'])
        && !name.contains(TMP_MARK)
        && name != MANIFEST_FILE
}

fn validate(files: &[CheckpointFile]) -> Result<()> {
    let bad = |m: String| Err(CheckpointError::InvalidInput(m));
    let mut names = HashSet::new();
    for f in files {
        if !is_plain_file_name(&f.name) {
            return bad(format!(
                "file name `{}` must be a plain name (no path separators, not `{MANIFEST_FILE}`, no `{TMP_MARK}`), e.g. `{MODEL_FILE}`",
                f.name
            ));
        }
        if !names.insert(f.name.as_str()) {
            return bad(format!(
                "file `{}` is given twice: merge its tensors",
                f.name
            ));
        }
        let mut tensors = HashSet::new();
        for t in &f.tensors {
            if !tensors.insert(t.name.as_str()) {
                return bad(format!(
                    "tensor `{}` appears twice in `{}`: give each tensor a unique name",
                    t.name, f.name
                ));
            }
            let n: usize = t.shape.iter().product();
            if n != t.data.len() {
                return bad(format!(
                    "tensor `{}` in `{}` has shape {:?} ({n} elements) but {} values",
                    t.name,
                    f.name,
                    t.shape,
                    t.data.len()
                ));
            }
        }
    }
    Ok(())
}

/// Entries of a checkpoints directory: final checkpoints as (step, path), sorted by
/// step, and leftovers of interrupted writes.
struct Scan {
    complete: Vec<(u64, PathBuf)>,
    incomplete: Vec<PathBuf>,
    leftovers: Vec<PathBuf>,
}

fn scan(ckdir: &Path) -> Result<Scan> {
    let mut s = Scan {
        complete: Vec::new(),
        incomplete: Vec::new(),
        leftovers: Vec::new(),
    };
    let entries = ctx(std::fs::read_dir(ckdir), "listing", ckdir)?;
    for entry in entries {
        let entry = ctx(entry, "listing", ckdir)?;
        let path = entry.path();
        let name = entry.file_name().to_string_lossy().into_owned();
        if name.contains(TMP_MARK) {
            s.leftovers.push(path);
        } else if let Some(step) = parse_dir_name(&name) {
            if path.join(MANIFEST_FILE).is_file() {
                s.complete.push((step, path));
            } else if path.is_dir() {
                s.incomplete.push(path);
            }
        }
    }
    s.complete.sort();
    s.leftovers.sort();
    s.incomplete.sort();
    Ok(s)
}

/// The complete checkpoints of a run as (step, directory), oldest first. Empty when
/// the run has no checkpoints directory.
pub fn list(run_dir: &Path) -> Result<Vec<(u64, PathBuf)>> {
    let ckdir = run_dir.join(CHECKPOINTS_DIR);
    if !ckdir.is_dir() {
        return Ok(Vec::new());
    }
    Ok(scan(&ckdir)?.complete)
}

fn remove_path(path: &Path) -> std::io::Result<()> {
    if path.is_dir() {
        std::fs::remove_dir_all(path)
    } else {
        std::fs::remove_file(path)
    }
}

/// Writes the checkpoint for `step` under `run_dir/checkpoints/` atomically, points
/// `latest` at it, removes leftovers of interrupted saves and applies retention.
///
/// Serializes each file in memory before writing it, so peak host memory is about
/// twice the largest file.
pub fn save(
    run_dir: &Path,
    step: u64,
    files: &[CheckpointFile],
    state: &Value,
    options: &SaveOptions,
) -> Result<Saved> {
    validate(files)?;
    let ckdir = run_dir.join(CHECKPOINTS_DIR);
    if !ckdir.is_dir() {
        ctx(std::fs::create_dir_all(&ckdir), "creating", &ckdir)?;
        fsutil::sync_dir(fsutil::parent_dir(&ckdir))?;
    }
    let name = dir_name(step);
    let final_dir = ckdir.join(&name);
    let tmp_dir = fsutil::tmp_path(&final_dir);
    if tmp_dir.exists() {
        ctx(std::fs::remove_dir_all(&tmp_dir), "removing", &tmp_dir)?;
    }
    ctx(std::fs::create_dir(&tmp_dir), "creating", &tmp_dir)?;

    let written = write_contents(&tmp_dir, step, files, state);
    if let Err(e) = written {
        let _ = std::fs::remove_dir_all(&tmp_dir);
        return Err(e);
    }

    // A checkpoint of this step may exist already (a resume from an earlier step that
    // reached it again): move it aside, move the new one in, then drop the old one.
    if final_dir.exists() {
        let aside = ckdir.join(format!("{name}{TMP_MARK}{}-replaced", std::process::id()));
        if aside.exists() {
            ctx(std::fs::remove_dir_all(&aside), "removing", &aside)?;
        }
        ctx(
            std::fs::rename(&final_dir, &aside),
            "moving the old checkpoint aside",
            &final_dir,
        )?;
    }
    ctx(
        std::fs::rename(&tmp_dir, &final_dir),
        "renaming the finished checkpoint to",
        &final_dir,
    )?;
    fsutil::sync_dir(&ckdir)?;
    fsutil::write_atomic(&ckdir.join(LATEST_FILE), format!("{name}\n").as_bytes())?;

    let mut saved = Saved {
        dir: final_dir,
        removed: Vec::new(),
        notes: Vec::new(),
    };
    let s = scan(&ckdir)?;
    for leftover in &s.leftovers {
        if let Err(e) = remove_path(leftover) {
            saved.notes.push(format!(
                "could not remove `{}`, left by an interrupted save: {e}; delete it by hand",
                leftover.display()
            ));
        }
    }
    let (current, newer): (Vec<_>, Vec<_>) = s.complete.into_iter().partition(|(n, _)| *n <= step);
    for (_, dir) in &newer {
        saved.notes.push(format!(
            "kept `{}`: it is newer than step {step}, from before the run was resumed at an earlier step; delete it by hand if it is not wanted",
            dir.display()
        ));
    }
    if options.keep_last > 0 && current.len() > options.keep_last {
        let excess = current.len() - options.keep_last;
        for (_, dir) in &current[..excess] {
            match std::fs::remove_dir_all(dir) {
                Ok(()) => saved.removed.push(dir.clone()),
                Err(e) => saved.notes.push(format!(
                    "could not remove old checkpoint `{}`: {e}; delete it by hand",
                    dir.display()
                )),
            }
        }
    }
    if !saved.removed.is_empty() || !s.leftovers.is_empty() {
        fsutil::sync_dir(&ckdir)?;
    }
    Ok(saved)
}

/// Writes every file and the manifest into `dir`, each flushed, then flushes `dir`.
fn write_contents(dir: &Path, step: u64, files: &[CheckpointFile], state: &Value) -> Result<()> {
    let mut entries = Vec::with_capacity(files.len());
    for f in files {
        let path = dir.join(&f.name);
        let named: Vec<_> = f
            .tensors
            .iter()
            .map(|t| (t.name.as_str(), t.shape.as_slice(), &t.data))
            .collect();
        // Written a tensor at a time and hashed back from the file: a checkpoint never
        // holds a second, serialized copy of the model states in memory. The writer
        // makes the file private; it gets the permissions a file created here gets
        // (the umask's), as the other files of the checkpoint do.
        let mode = {
            let probe = ctx(std::fs::File::create(&path), "creating", &path)?;
            ctx(probe.metadata(), "reading the permissions of", &path)?.permissions()
        };
        match encode_to_file(&named, &path) {
            Err(e) if e.kind() == std::io::ErrorKind::InvalidInput => {
                return Err(CheckpointError::InvalidInput(format!(
                    "serializing `{}`: {e}",
                    path.display()
                )))
            }
            written => ctx(written, "writing", &path)?,
        }
        ctx(
            std::fs::set_permissions(&path, mode),
            "setting the permissions of",
            &path,
        )?;
        let (bytes, sha256) = synced_digest(&path)?;
        entries.push(FileEntry {
            name: f.name.clone(),
            bytes,
            sha256,
            tensors: f
                .tensors
                .iter()
                .map(|t| TensorEntry {
                    name: t.name.clone(),
                    dtype: t.data.dtype(),
                    shape: t.shape.clone(),
                })
                .collect(),
        });
    }
    let manifest = Manifest {
        format: FORMAT_NAME.to_string(),
        format_version: FORMAT_VERSION,
        step,
        state: state.clone(),
        files: entries,
    };
    let path = dir.join(MANIFEST_FILE);
    let text = serde_json::to_vec_pretty(&manifest).map_err(|e| {
        CheckpointError::InvalidInput(format!("serializing `{}`: {e}", path.display()))
    })?;
    fsutil::write_synced(&path, &text)?;
    fsutil::sync_dir(dir)?;
    Ok(())
}

/// Loads and verifies the checkpoint in `dir`: the manifest parses, every file has
/// its recorded size and SHA-256, and every listed tensor is there with its dtype and
/// shape (and nothing unlisted is).
pub fn load(dir: &Path) -> Result<Checkpoint> {
    let mpath = dir.join(MANIFEST_FILE);
    // Without a manifest to check them against, the data files' own headers are looked
    // at first: a damaged one is the bigger news (and says the copy went wrong).
    let without_manifest = |why: &str, e: CheckpointError| match damaged_header(dir) {
        Some((path, damage)) => CheckpointError::InvalidFile {
            path,
            detail: format!("{damage}; its manifest {why} too"),
        },
        None => e,
    };
    let text = match std::fs::read(&mpath) {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            let missing = CheckpointError::MissingFile { path: mpath };
            return Err(without_manifest("is missing", missing));
        }
        Err(err) => {
            return Err(CheckpointError::Io {
                action: "reading",
                path: mpath,
                err,
            })
        }
    };
    let manifest: Manifest = serde_json::from_slice(&text).map_err(|e| {
        let bad = CheckpointError::BadManifest {
            path: mpath.clone(),
            detail: e.to_string(),
        };
        without_manifest("is unreadable", bad)
    })?;
    if manifest.format != FORMAT_NAME || manifest.format_version > FORMAT_VERSION {
        return Err(CheckpointError::Unsupported {
            path: mpath,
            format: manifest.format,
            version: manifest.format_version,
        });
    }
    let mut names = HashSet::new();
    for f in &manifest.files {
        if !is_plain_file_name(&f.name) || !names.insert(f.name.as_str()) {
            return Err(CheckpointError::BadManifest {
                path: mpath,
                detail: format!("file name `{}` is not a plain, unique name", f.name),
            });
        }
    }
    let files = manifest
        .files
        .iter()
        .map(|entry| load_file(dir, entry))
        .collect::<Result<Vec<_>>>()?;
    Ok(Checkpoint {
        dir: dir.to_path_buf(),
        manifest,
        files,
        notes: Vec::new(),
    })
}

fn load_file(dir: &Path, entry: &FileEntry) -> Result<CheckpointFile> {
    let path = dir.join(&entry.name);
    let bytes = match std::fs::read(&path) {
        Ok(b) => b,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            return Err(CheckpointError::MissingFile { path })
        }
        Err(err) => {
            return Err(CheckpointError::Io {
                action: "reading",
                path,
                err,
            })
        }
    };
    let found = bytes.len() as u64;
    if found < entry.bytes {
        return Err(CheckpointError::Truncated {
            path,
            found,
            expected: entry.bytes,
        });
    }
    if found > entry.bytes {
        return Err(CheckpointError::Oversized {
            path,
            found,
            expected: entry.bytes,
        });
    }
    if let Some(damage) = header_damage(&bytes) {
        return Err(CheckpointError::InvalidFile {
            path,
            detail: damage,
        });
    }
    let sum = sha256_hex(&bytes);
    if !sum.eq_ignore_ascii_case(&entry.sha256) {
        return Err(CheckpointError::Checksum {
            path,
            expected: entry.sha256.clone(),
            found: sum,
        });
    }
    let st = SafeTensors::deserialize(&bytes).map_err(|e| CheckpointError::InvalidFile {
        path: path.clone(),
        detail: e.to_string(),
    })?;
    let mut tensors = Vec::with_capacity(entry.tensors.len());
    let mut listed = HashSet::new();
    for te in &entry.tensors {
        listed.insert(te.name.as_str());
        let view = st
            .tensor(&te.name)
            .map_err(|_| CheckpointError::MissingTensor {
                path: path.clone(),
                tensor: te.name.clone(),
            })?;
        if view.dtype() != st_dtype(te.dtype) || view.shape() != te.shape.as_slice() {
            return Err(CheckpointError::TensorMismatch {
                path: path.clone(),
                tensor: te.name.clone(),
                detail: format!(
                    "is {:?} {:?} in the file but {} {:?} in the manifest",
                    view.dtype(),
                    view.shape(),
                    te.dtype,
                    te.shape
                ),
            });
        }
        let n: usize = te.shape.iter().product();
        tensors.push(HostTensor {
            name: te.name.clone(),
            shape: te.shape.clone(),
            data: HostData::from_bytes(te.dtype, n, view.data()),
        });
    }
    if let Some(extra) = st.names().into_iter().find(|n| !listed.contains(*n)) {
        return Err(CheckpointError::UnlistedTensor {
            path,
            tensor: extra.to_string(),
        });
    }
    Ok(CheckpointFile {
        name: entry.name.clone(),
        tensors,
    })
}

/// What is wrong with the header of the safetensors file `bytes` (its first 8 bytes, a
/// little-endian length, then that many bytes of JSON), if anything: a length past the
/// file's end (a damaged or hostile one, up to 2^64 - 1) or a header that is not JSON.
fn header_damage(bytes: &[u8]) -> Option<String> {
    let Some((len, rest)) = bytes.split_first_chunk::<8>() else {
        return Some(format!(
            "{} bytes, shorter than a safetensors header's 8-byte length",
            bytes.len()
        ));
    };
    let len = u64::from_le_bytes(*len);
    if len > rest.len() as u64 {
        return Some(format!(
            "its header length field says {len} bytes, but only {} follow it",
            rest.len()
        ));
    }
    serde_json::from_slice::<serde_json::Value>(&rest[..len as usize])
        .err()
        .map(|e| format!("its {len}-byte header is not JSON ({e})"))
}

/// The first `.safetensors` file in `dir` (by name) whose header is damaged, read as
/// far as its header needs.
fn damaged_header(dir: &Path) -> Option<(PathBuf, String)> {
    let mut files: Vec<PathBuf> = std::fs::read_dir(dir)
        .ok()?
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.extension().is_some_and(|x| x == "safetensors") && p.is_file())
        .collect();
    files.sort();
    files.into_iter().find_map(|path| {
        use std::io::Read;
        let mut file = std::fs::File::open(&path).ok()?;
        let mut len = [0u8; 8];
        let got = file.read(&mut len).ok()?;
        let size = file.metadata().ok()?.len();
        let damage = if got < 8 {
            header_damage(&len[..got])
        } else {
            let n = u64::from_le_bytes(len);
            if n > size.saturating_sub(8) {
                Some(format!(
                    "its header length field says {n} bytes, but only {} follow it",
                    size.saturating_sub(8)
                ))
            } else {
                let mut head = len.to_vec();
                file.take(n).read_to_end(&mut head).ok()?;
                header_damage(&head)
            }
        };
        damage.map(|d| (path, d))
    })
}

/// Loads the checkpoint `run_dir/checkpoints/latest` names. Leftovers of interrupted
/// saves are ignored; if `latest` is missing, unreadable or names a directory that
/// does not exist, the newest complete checkpoint is loaded instead. Both cases are
/// reported in [`Checkpoint::notes`], never silently.
pub fn load_latest(run_dir: &Path) -> Result<Checkpoint> {
    let ckdir = run_dir.join(CHECKPOINTS_DIR);
    if !ckdir.is_dir() {
        return Err(CheckpointError::NoCheckpoint {
            dir: run_dir.to_path_buf(),
            detail: format!(" (it has no `{CHECKPOINTS_DIR}` directory)"),
        });
    }
    let s = scan(&ckdir)?;
    let mut notes = Vec::new();
    for leftover in &s.leftovers {
        notes.push(format!(
            "ignored `{}`, left by an interrupted save (the next save removes it)",
            leftover.display()
        ));
    }
    for dir in &s.incomplete {
        notes.push(format!(
            "ignored `{}`: it has no {MANIFEST_FILE}",
            dir.display()
        ));
    }
    let newest = s.complete.last().cloned();
    let latest_path = ckdir.join(LATEST_FILE);
    let pointed = match std::fs::read_to_string(&latest_path) {
        Ok(text) => {
            let name = text.trim();
            match parse_dir_name(name) {
                Some(step) if ckdir.join(name).join(MANIFEST_FILE).is_file() => {
                    Some((step, ckdir.join(name)))
                }
                Some(_) => {
                    notes.push(format!(
                        "`{}` names `{name}`, which does not exist or is incomplete",
                        latest_path.display()
                    ));
                    None
                }
                None => {
                    notes.push(format!(
                        "`{}` does not name a checkpoint (it holds {:?})",
                        latest_path.display(),
                        name
                    ));
                    None
                }
            }
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            if newest.is_some() {
                notes.push(format!("`{}` is missing", latest_path.display()));
            }
            None
        }
        Err(err) => {
            return Err(CheckpointError::Io {
                action: "reading",
                path: latest_path,
                err,
            })
        }
    };
    let (step, dir) = match (pointed, newest) {
        (Some((step, dir)), newest) => {
            if let Some((n, ndir)) = newest.filter(|(n, _)| *n > step) {
                notes.push(format!(
                    "`{}` (step {n}) is newer than `latest`, which names step {step}: it was kept from before a resume at an earlier step, or its save was interrupted before `latest` was updated; resuming from step {step}",
                    ndir.display()
                ));
            }
            (step, dir)
        }
        (None, Some((step, dir))) => {
            notes.push(format!(
                "resuming from the newest complete checkpoint `{}` (step {step}) instead",
                dir.display()
            ));
            (step, dir)
        }
        (None, None) => {
            let mut detail = String::new();
            if !notes.is_empty() {
                detail = format!(" ({})", notes.join("; "));
            }
            return Err(CheckpointError::NoCheckpoint {
                dir: run_dir.to_path_buf(),
                detail,
            });
        }
    };
    let mut ck = load(&dir)?;
    if ck.step() != step {
        ck.notes.push(format!(
            "`{}` records step {} although its name says {step}",
            dir.display(),
            ck.step()
        ));
    }
    notes.append(&mut ck.notes);
    ck.notes = notes;
    Ok(ck)
}
