//! The run ledger: per-step metrics, a summary, a chart, and the listing and diffing
//! of runs behind `kiln runs` and `kiln runs diff A B`.
//!
//! A run directory `runs/NAME/` holds `config.json` (the resolved configuration,
//! written with [`write_config`]), `metrics.jsonl` (one [`StepRecord`] per line, written
//! by [`MetricsWriter`]), `summary.json` ([`Summary`]), `chart.svg` (`runs_chart`, the
//! `chart` feature)
//! and `checkpoints/` (see [`crate::train::checkpoint`]). The ledger's rule is one variable
//! at a time: [`diff_runs`] says so when two runs differ in more than one config key.

use std::collections::BTreeMap;
use std::fmt;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::SystemTime;

use serde::{Deserialize, Deserializer, Serialize};
use serde_json::Value;

use crate::fsutil::{self, ctx, IoFailure};
use crate::train::checkpoint;

pub const CONFIG_FILE: &str = "config.json";
pub const METRICS_FILE: &str = "metrics.jsonl";
pub const SUMMARY_FILE: &str = "summary.json";
pub const CHART_FILE: &str = "chart.svg";
/// Locked by the process training into the run (see [`RunLock`]); holds its pid.
pub const LOCK_FILE: &str = ".kiln-run.lock";
/// Steps left out of the mean throughput by default (shader compilation, warm-up).
pub const DEFAULT_WARMUP_STEPS: usize = 5;
/// Config keys (matched on the last path segment) shown in a run's one-line summary.
pub const SUMMARY_KEYS: &[&str] = &[
    "model",
    "n_layer",
    "n_head",
    "n_embd",
    "block_size",
    "vocab_size",
    "precision",
    "dtype",
    "batch",
    "batch_size",
    "seq",
    "seq_len",
    "grad_accum",
    "lr",
    "device",
];

/// Everything that can go wrong with a run directory. Each message names the path.
#[derive(Debug, thiserror::Error)]
pub enum RunError {
    #[error("{action} `{}`: {err} (check that the path exists and is writable and that the disk is not full)", .path.display())]
    Io {
        action: &'static str,
        path: PathBuf,
        err: std::io::Error,
    },

    #[error("`{}` is not a run directory: {missing}. Runs are created by training with a run name; `kiln runs` lists them", .dir.display())]
    NotARun { dir: PathBuf, missing: String },

    #[error("no runs directory `{}`: nothing has been trained there yet (train with a run name, or pass the directory that holds the runs)", .root.display())]
    NoRunsDir { root: PathBuf },

    #[error("`{}`{}: not valid JSON ({detail}); the file was edited or damaged: fix or remove {}", .path.display(), .line.map(|l| format!(" line {l}")).unwrap_or_default(), if .line.is_some() { "that line" } else { "the file" })]
    BadJson {
        path: PathBuf,
        line: Option<usize>,
        detail: String,
    },

    #[error("writing `{}`: cannot encode it as JSON ({detail})", .path.display())]
    Encode { path: PathBuf, detail: String },

    #[error("drawing the chart `{}`: {detail}", .path.display())]
    Chart { path: PathBuf, detail: String },

    #[error("`{}` is in use: another kiln process ({holder}) is training into it. Wait for it to end (--resume continues it then), or pick another --out", .dir.display())]
    InUse { dir: PathBuf, holder: String },
}

/// An exclusive OS advisory lock on a run directory, held by the process that trains
/// into it for the run's life. The OS releases it when the process ends, however it
/// ends (a crash or a kill included), so a lock file left behind by a dead process is
/// no obstacle: only a live holder refuses a second run (two started at once, or a
/// `--resume` of a run still going).
#[derive(Debug)]
pub struct RunLock {
    _file: std::fs::File,
}

impl RunLock {
    /// Takes the lock of the existing directory `dir`, or says which process holds it.
    pub fn acquire(dir: &Path) -> Result<RunLock> {
        let path = dir.join(LOCK_FILE);
        let mut file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .open(&path)
            .map_err(|err| RunError::Io {
                action: "opening the run lock",
                path: path.clone(),
                err,
            })?;
        match file.try_lock() {
            Ok(()) => {}
            Err(std::fs::TryLockError::WouldBlock) => {
                let mut pid = String::new();
                let _ = std::io::Read::read_to_string(&mut file, &mut pid);
                let holder = match pid.trim() {
                    "" => "its pid not yet written".to_string(),
                    p => format!("pid {p}"),
                };
                return Err(RunError::InUse {
                    dir: dir.to_path_buf(),
                    holder,
                });
            }
            Err(std::fs::TryLockError::Error(err)) => {
                return Err(RunError::Io {
                    action: "locking",
                    path,
                    err,
                })
            }
        }
        let pid = std::process::id().to_string();
        file.set_len(0)
            .and_then(|()| std::io::Write::write_all(&mut &file, pid.as_bytes()))
            .map_err(|err| RunError::Io {
                action: "writing the run lock",
                path,
                err,
            })?;
        Ok(RunLock { _file: file })
    }
}

impl From<IoFailure> for RunError {
    fn from(f: IoFailure) -> Self {
        RunError::Io {
            action: f.action,
            path: f.path,
            err: f.err,
        }
    }
}

pub type Result<T, E = RunError> = std::result::Result<T, E>;

/// Non-finite floats are written as `null` by JSON; read them back as NaN.
fn nan_if_null<'de, D, T>(d: D) -> std::result::Result<T, D::Error>
where
    D: Deserializer<'de>,
    T: Deserialize<'de> + From<f32>,
{
    Ok(Option::<T>::deserialize(d)?.unwrap_or_else(|| T::from(f32::NAN)))
}

/// One optimizer step, one line of `metrics.jsonl`. Non-finite values (an overflowed
/// loss) are written as `null` and read back as NaN; so are the eval values, which are
/// absent at steps without an evaluation (`None`).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct StepRecord {
    pub step: u64,
    #[serde(deserialize_with = "nan_if_null")]
    pub loss: f32,
    #[serde(deserialize_with = "nan_if_null")]
    pub lr: f32,
    #[serde(deserialize_with = "nan_if_null")]
    pub loss_scale: f32,
    /// The step was skipped (gradient overflow): weights untouched.
    pub skipped: bool,
    #[serde(deserialize_with = "nan_if_null")]
    pub tokens_per_s: f64,
    #[serde(deserialize_with = "nan_if_null")]
    pub step_ms: f64,
    /// Time the step waited for its input batch.
    #[serde(deserialize_with = "nan_if_null")]
    pub input_stall_ms: f64,
    pub device_memory_bytes: u64,
    /// The process's peak resident host memory so far (Linux's VmHWM; absent where the
    /// system does not say): what the host check's figure is compared with.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub host_peak_bytes: Option<u64>,
    /// Data parallelism: time spent exchanging gradients through the host, the share
    /// of it hidden behind compute, and the bytes moved (0 on one device).
    #[serde(default)]
    pub comm_ms: f64,
    #[serde(default)]
    pub comm_overlap: f64,
    #[serde(default)]
    pub comm_bytes: u64,
    /// ZeRO-Offload: the host's optimizer step over the offloaded shards (ms), and the
    /// part of it the devices waited for (not hidden behind the updated weights'
    /// uploads). Absent without offload.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub offload_ms: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub offload_exposed_ms: Option<f64>,
    /// ZeRO stage 3: host time loading the blocks' weights into the devices (ms, all
    /// devices) and the share of it hidden behind the devices' work. Absent below
    /// stage 3.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gather_ms: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gather_hidden: Option<f64>,
    /// Pipeline parallelism: the share of the step the stages waited for a neighbour
    /// (measured, the mean over stages), the schedule's `(p-1)/(m+p-1)`, and the bytes
    /// of activations and their gradients sent between stages. Absent without stages.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pipeline_bubble: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pipeline_bubble_theory: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pipeline_bytes: Option<u64>,
    /// Pipeline: the mean over devices of the time each waited for a message its peer
    /// had already posted (transfer not hidden behind compute), in milliseconds.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pipeline_exposed_ms: Option<f64>,
    #[serde(
        default,
        skip_serializing_if = "Option::is_none",
        deserialize_with = "some_nan_if_null"
    )]
    pub eval_loss: Option<f32>,
    #[serde(
        default,
        skip_serializing_if = "Option::is_none",
        deserialize_with = "some_nan_if_null"
    )]
    pub eval_accuracy: Option<f32>,
    /// The first step its process recorded (a fresh start or a resume; set by
    /// [`MetricsWriter`]): its time includes compiling every kernel, so throughput
    /// leaves it, and the warm-up steps after it, out.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub started: bool,
}

/// For an optional value that is absent when there is none (`#[serde(default)]`): a
/// `null` there is a non-finite value, NaN, not "none".
fn some_nan_if_null<'de, D>(d: D) -> std::result::Result<Option<f32>, D::Error>
where
    D: Deserializer<'de>,
{
    Ok(Some(Option::<f32>::deserialize(d)?.unwrap_or(f32::NAN)))
}

/// A summary's value as it was, NaN and infinities included: a number when finite, else
/// the string `"NaN"`, `"inf"` or `"-inf"` (JSON has no such numbers, and `null` reads
/// back as "no value").
mod as_it_was {
    use serde::{Deserialize, Deserializer, Serializer};

    pub fn serialize<S: Serializer>(v: &Option<f32>, s: S) -> Result<S::Ok, S::Error> {
        match v {
            None => s.serialize_none(),
            Some(x) if x.is_finite() => s.serialize_f32(*x),
            Some(x) if x.is_nan() => s.serialize_str("NaN"),
            Some(x) if *x > 0.0 => s.serialize_str("inf"),
            Some(_) => s.serialize_str("-inf"),
        }
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Option<f32>, D::Error> {
        #[derive(Deserialize)]
        #[serde(untagged)]
        enum Either {
            Number(f32),
            Word(String),
        }
        match Option::<Either>::deserialize(d)? {
            None => Ok(None),
            Some(Either::Number(x)) => Ok(Some(x)),
            Some(Either::Word(w)) => match w.as_str() {
                "NaN" => Ok(Some(f32::NAN)),
                "inf" => Ok(Some(f32::INFINITY)),
                "-inf" => Ok(Some(f32::NEG_INFINITY)),
                _ => Err(serde::de::Error::custom(format!(
                    "`{w}` is not a number, \"NaN\", \"inf\" or \"-inf\""
                ))),
            },
        }
    }
}

fn require_run(dir: &Path) -> Result<()> {
    let missing = if !dir.is_dir() {
        "the directory does not exist".to_string()
    } else if !dir.join(CONFIG_FILE).is_file() {
        format!("it has no {CONFIG_FILE}")
    } else {
        return Ok(());
    };
    Err(RunError::NotARun {
        dir: dir.to_path_buf(),
        missing,
    })
}

/// Creates `run_dir` if needed and writes the resolved configuration to its
/// `config.json` atomically.
pub fn write_config(run_dir: &Path, config: &Value) -> Result<()> {
    ctx(std::fs::create_dir_all(run_dir), "creating", run_dir)?;
    let path = run_dir.join(CONFIG_FILE);
    let mut text = encode_json(&path, config, true)?;
    text.push('\n');
    fsutil::write_atomic(&path, text.as_bytes())?;
    Ok(())
}

/// Reads a run's `config.json`.
pub fn read_config(run_dir: &Path) -> Result<Value> {
    require_run(run_dir)?;
    read_json(&run_dir.join(CONFIG_FILE))
}

fn encode_json<T: Serialize>(path: &Path, value: &T, pretty: bool) -> Result<String> {
    let text = if pretty {
        serde_json::to_string_pretty(value)
    } else {
        serde_json::to_string(value)
    };
    text.map_err(|e| RunError::Encode {
        path: path.to_path_buf(),
        detail: e.to_string(),
    })
}

fn read_json<T: serde::de::DeserializeOwned>(path: &Path) -> Result<T> {
    let text = ctx(std::fs::read_to_string(path), "reading", path)?;
    serde_json::from_str(&text).map_err(|e| RunError::BadJson {
        path: path.to_path_buf(),
        line: None,
        detail: e.to_string(),
    })
}

/// The records of a metrics file with the raw line each came from. A last line
/// without its newline that does not parse is a write cut short by a crash and is
/// left out; any other line that does not parse is an error naming it.
struct MetricsFile {
    records: Vec<(StepRecord, String)>,
    /// The file needs rewriting to end cleanly (cut-short or unterminated last line).
    unclean_end: bool,
}

fn parse_metrics(path: &Path) -> Result<MetricsFile> {
    let text = match std::fs::read_to_string(path) {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => String::new(),
        Err(err) => {
            return Err(RunError::Io {
                action: "reading",
                path: path.to_path_buf(),
                err,
            })
        }
    };
    let mut out = MetricsFile {
        records: Vec::new(),
        unclean_end: !text.is_empty() && !text.ends_with('\n'),
    };
    let lines: Vec<&str> = text.split_terminator('\n').collect();
    for (i, line) in lines.iter().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        match serde_json::from_str::<StepRecord>(line) {
            Ok(r) => out.records.push((r, line.to_string())),
            Err(_) if i + 1 == lines.len() && out.unclean_end => {}
            Err(e) => {
                return Err(RunError::BadJson {
                    path: path.to_path_buf(),
                    line: Some(i + 1),
                    detail: e.to_string(),
                })
            }
        }
    }
    Ok(out)
}

/// All step records of a run, in file order (a crash-cut last line left out).
pub fn read_metrics(run_dir: &Path) -> Result<Vec<StepRecord>> {
    Ok(parse_metrics(&run_dir.join(METRICS_FILE))?
        .records
        .into_iter()
        .map(|(r, _)| r)
        .collect())
}

/// Appends step records to `metrics.jsonl`, one JSON object per line, each line
/// handed to the operating system as it is written (a crash of the process loses
/// nothing already appended; [`MetricsWriter::sync`] also survives power loss).
#[derive(Debug)]
pub struct MetricsWriter {
    path: PathBuf,
    file: std::fs::File,
    dropped: usize,
    /// Nothing appended yet: the next record is marked [`StepRecord::started`].
    fresh: bool,
}

impl MetricsWriter {
    /// Starts a fresh `metrics.jsonl` in `run_dir` (created if needed), replacing any.
    pub fn create(run_dir: &Path) -> Result<MetricsWriter> {
        ctx(std::fs::create_dir_all(run_dir), "creating", run_dir)?;
        let path = run_dir.join(METRICS_FILE);
        let file = ctx(std::fs::File::create(&path), "creating", &path)?;
        Ok(MetricsWriter {
            path,
            file,
            dropped: 0,
            fresh: true,
        })
    }

    /// Continues the metrics of a run resumed from the checkpoint at `resume_step`:
    /// records with a step after it (written after that checkpoint, before the
    /// interruption) are dropped, so the steps about to be redone appear once. The
    /// file is rewritten atomically when anything is dropped.
    pub fn resume(run_dir: &Path, resume_step: u64) -> Result<MetricsWriter> {
        ctx(std::fs::create_dir_all(run_dir), "creating", run_dir)?;
        let path = run_dir.join(METRICS_FILE);
        let parsed = parse_metrics(&path)?;
        let total = parsed.records.len();
        let kept: Vec<&str> = parsed
            .records
            .iter()
            .filter(|(r, _)| r.step <= resume_step)
            .map(|(_, line)| line.as_str())
            .collect();
        let dropped = total - kept.len();
        if dropped > 0 || parsed.unclean_end {
            let mut text = String::new();
            for line in &kept {
                text.push_str(line);
                text.push('\n');
            }
            fsutil::write_atomic(&path, text.as_bytes())?;
        }
        let file = ctx(
            std::fs::OpenOptions::new()
                .create(true)
                .append(true)
                .open(&path),
            "opening for appending",
            &path,
        )?;
        Ok(MetricsWriter {
            path,
            file,
            dropped,
            fresh: true,
        })
    }

    /// Appends one record as one line; the first this writer appends is marked
    /// [`StepRecord::started`].
    pub fn append(&mut self, record: &StepRecord) -> Result<()> {
        let marked;
        let record = if self.fresh {
            marked = StepRecord {
                started: true,
                ..record.clone()
            };
            &marked
        } else {
            record
        };
        let mut line = encode_json(&self.path, record, false)?;
        line.push('\n');
        ctx(
            self.file.write_all(line.as_bytes()),
            "appending to",
            &self.path,
        )?;
        self.fresh = false;
        Ok(())
    }

    /// Flushes everything appended so far to disk.
    pub fn sync(&self) -> Result<()> {
        ctx(self.file.sync_data(), "flushing", &self.path)?;
        Ok(())
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// How many records [`MetricsWriter::resume`] dropped.
    pub fn dropped(&self) -> usize {
        self.dropped
    }
}

/// The outcome of a run, `summary.json`.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Summary {
    /// Step records.
    pub steps: usize,
    pub last_step: Option<u64>,
    pub skipped_steps: usize,
    /// The last step's loss, as it was: NaN or infinite too (see `non_finite`).
    #[serde(default, with = "as_it_was")]
    pub final_loss: Option<f32>,
    /// The best finite values.
    pub best_loss: Option<f32>,
    pub best_loss_step: Option<u64>,
    /// The last evaluation's values, as they were.
    #[serde(default, with = "as_it_was")]
    pub final_eval_loss: Option<f32>,
    pub best_eval_loss: Option<f32>,
    #[serde(default, with = "as_it_was")]
    pub final_eval_accuracy: Option<f32>,
    pub best_eval_accuracy: Option<f32>,
    /// One line per final value above that is not finite, with the last finite one: a
    /// run that ended diverged says so rather than showing an older, better number.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub non_finite: Vec<String>,
    /// Why the run has no evaluation (too little data to hold any out); filled in by the
    /// caller.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub no_held_out_data: Option<String>,
    /// Tokens over time across the steps after the warm-up ones: the first
    /// `warmup_steps` of each start of the process (the run's, and each resume's), whose
    /// times include compiling kernels; every step when that would leave none.
    pub mean_tokens_per_s: Option<f64>,
    /// Steps left out of the throughput (warm-up steps of every start, in all).
    pub warmup_steps_excluded: usize,
    pub mean_step_ms: Option<f64>,
    pub mean_input_stall_ms: Option<f64>,
    /// Data parallelism (0 on one device): mean gradient-exchange time per step, the
    /// share of it overlapped with compute, and bytes moved per step.
    #[serde(default)]
    pub mean_comm_ms: f64,
    #[serde(default)]
    pub mean_comm_overlap: f64,
    #[serde(default)]
    pub comm_bytes_per_step: u64,
    /// Sum of step times unless the caller sets the wall-clock time.
    pub total_time_s: f64,
    pub peak_device_memory_bytes: u64,
    /// The process's peak resident host memory over the records (where reported).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub peak_host_bytes: Option<u64>,
    /// Filled in by the caller.
    pub devices: Vec<String>,
    /// Per device, the model states' bytes as allocated (filled in by the caller).
    #[serde(default)]
    pub model_states: Vec<crate::models::ModelStateBytes>,
}

fn finite<T: Into<f64> + Copy>(v: T) -> Option<T> {
    v.into().is_finite().then_some(v)
}

fn mean(values: impl Iterator<Item = f64>) -> Option<f64> {
    let (sum, n) = values
        .filter(|v| v.is_finite())
        .fold((0.0, 0usize), |(s, n), v| (s + v, n + 1));
    (n > 0).then(|| sum / n as f64)
}

impl Summary {
    /// Summarizes step records, leaving the first `warmup_steps` after every start (the
    /// first record and each one marked [`StepRecord::started`]) out of throughput.
    pub fn from_records(records: &[StepRecord], warmup_steps: usize) -> Summary {
        let mut s = Summary {
            steps: records.len(),
            last_step: records.last().map(|r| r.step),
            skipped_steps: records.iter().filter(|r| r.skipped).count(),
            ..Summary::default()
        };
        // The last finite value of each series and its step, for the non-finite notes.
        let (mut finite_loss, mut finite_eval, mut finite_acc) = (None, None, None);
        for r in records {
            s.final_loss = Some(r.loss);
            if let Some(l) = finite(r.loss) {
                finite_loss = Some((l, r.step));
                if s.best_loss.is_none_or(|b| l < b) {
                    s.best_loss = Some(l);
                    s.best_loss_step = Some(r.step);
                }
            }
            if let Some(l) = r.eval_loss {
                s.final_eval_loss = Some(l);
                if let Some(l) = finite(l) {
                    finite_eval = Some((l, r.step));
                    s.best_eval_loss = Some(s.best_eval_loss.map_or(l, |b| b.min(l)));
                }
            }
            if let Some(a) = r.eval_accuracy {
                s.final_eval_accuracy = Some(a);
                if let Some(a) = finite(a) {
                    finite_acc = Some((a, r.step));
                    s.best_eval_accuracy = Some(s.best_eval_accuracy.map_or(a, |b| b.max(a)));
                }
            }
            s.peak_device_memory_bytes = s.peak_device_memory_bytes.max(r.device_memory_bytes);
            if let Some(h) = r.host_peak_bytes {
                s.peak_host_bytes = Some(s.peak_host_bytes.map_or(h, |p| p.max(h)));
            }
        }
        let last = |has: fn(&StepRecord) -> bool| records.iter().rev().find(|r| has(r));
        let series = [
            ("loss", s.final_loss, last(|_| true), finite_loss),
            (
                "eval loss",
                s.final_eval_loss,
                last(|r| r.eval_loss.is_some()),
                finite_eval,
            ),
            (
                "eval accuracy",
                s.final_eval_accuracy,
                last(|r| r.eval_accuracy.is_some()),
                finite_acc,
            ),
        ];
        for (what, value, at, before) in series {
            let (Some(v), Some(at)) = (value, at) else {
                continue;
            };
            if v.is_finite() {
                continue;
            }
            let before = before.map_or(format!("no {what} was finite"), |(x, step)| {
                format!("the last finite {what} was {x:.4} at step {step}")
            });
            s.non_finite.push(format!(
                "the final {what} (step {}) is {v}; {before}",
                at.step
            ));
        }
        // A resumed run compiles its kernels again: each start's first steps are slow.
        let mut since_start = 0;
        let mut warm: Vec<&StepRecord> = vec![];
        for (i, r) in records.iter().enumerate() {
            if i == 0 || r.started {
                since_start = 0;
            }
            if since_start >= warmup_steps {
                warm.push(r);
            }
            since_start += 1;
        }
        let timed: Vec<&StepRecord> = if warm.is_empty() {
            records.iter().collect()
        } else {
            warm
        };
        s.warmup_steps_excluded = records.len() - timed.len();
        // Weighted by step time: total tokens over total time, not a mean of rates.
        let (tokens, ms) = timed
            .iter()
            .filter(|r| r.tokens_per_s.is_finite() && r.step_ms.is_finite() && r.step_ms > 0.0)
            .fold((0.0, 0.0), |(t, m), r| {
                (t + r.tokens_per_s * r.step_ms / 1e3, m + r.step_ms)
            });
        s.mean_tokens_per_s = if ms > 0.0 {
            Some(tokens / (ms / 1e3))
        } else {
            mean(timed.iter().map(|r| r.tokens_per_s))
        };
        s.mean_step_ms = mean(timed.iter().map(|r| r.step_ms));
        s.mean_input_stall_ms = mean(timed.iter().map(|r| r.input_stall_ms));
        s.mean_comm_ms = mean(timed.iter().map(|r| r.comm_ms)).unwrap_or(0.0);
        s.mean_comm_overlap = mean(timed.iter().map(|r| r.comm_overlap)).unwrap_or(0.0);
        s.comm_bytes_per_step = timed.iter().map(|r| r.comm_bytes).max().unwrap_or(0);
        s.total_time_s = records
            .iter()
            .filter(|r| r.step_ms.is_finite())
            .map(|r| r.step_ms)
            .sum::<f64>()
            / 1e3;
        s
    }

    /// Writes `run_dir/summary.json` atomically.
    pub fn write(&self, run_dir: &Path) -> Result<()> {
        let path = run_dir.join(SUMMARY_FILE);
        let mut text = encode_json(&path, self, true)?;
        text.push('\n');
        fsutil::write_atomic(&path, text.as_bytes())?;
        Ok(())
    }

    /// Reads `run_dir/summary.json`.
    pub fn read(run_dir: &Path) -> Result<Summary> {
        read_json(&run_dir.join(SUMMARY_FILE))
    }
}

// ---------------------------------------------------------------------------------
// Listing

pub(crate) fn run_name(dir: &Path) -> String {
    dir.file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_else(|| dir.display().to_string())
}

/// One run, as `kiln runs` shows it.
#[derive(Clone, Debug)]
pub struct RunInfo {
    pub name: String,
    pub dir: PathBuf,
    /// Latest modification of its config, metrics or summary.
    pub modified: SystemTime,
    /// The last step recorded.
    pub steps: Option<u64>,
    pub final_loss: Option<f32>,
    pub tokens_per_s: Option<f64>,
    pub final_eval_accuracy: Option<f32>,
    /// A one-line summary of the config (see [`config_summary`]).
    pub config: String,
    /// Complete checkpoints.
    pub checkpoints: usize,
    /// `summary.json` is there and up to date with the metrics.
    pub finished: bool,
    /// Why some of the above is missing (a damaged metrics file, say).
    pub note: Option<String>,
}

/// The summary of a run: `summary.json` when it covers every recorded step, else one
/// computed from the metrics (a run still going, or one that stopped early).
fn outcome(dir: &Path) -> Result<(Summary, bool)> {
    let records = read_metrics(dir)?;
    let saved = if dir.join(SUMMARY_FILE).is_file() {
        Some(Summary::read(dir)?)
    } else {
        None
    };
    let last = records.last().map(|r| r.step);
    match saved {
        Some(s) if s.last_step == last => Ok((s, true)),
        saved => {
            let mut s = Summary::from_records(&records, DEFAULT_WARMUP_STEPS);
            if let Some(old) = saved {
                s.devices = old.devices;
                s.no_held_out_data = old.no_held_out_data;
            }
            Ok((s, false))
        }
    }
}

/// The details of one run directory.
pub fn run_info(dir: &Path) -> Result<RunInfo> {
    require_run(dir)?;
    let mut modified = SystemTime::UNIX_EPOCH;
    for f in [CONFIG_FILE, METRICS_FILE, SUMMARY_FILE] {
        if let Ok(t) = std::fs::metadata(dir.join(f)).and_then(|m| m.modified()) {
            modified = modified.max(t);
        }
    }
    let mut info = RunInfo {
        name: run_name(dir),
        dir: dir.to_path_buf(),
        modified,
        steps: None,
        final_loss: None,
        tokens_per_s: None,
        final_eval_accuracy: None,
        config: String::new(),
        checkpoints: 0,
        finished: false,
        note: None,
    };
    let mut notes = Vec::new();
    match read_config(dir) {
        Ok(c) => info.config = config_summary(&c),
        Err(e) => notes.push(e.to_string()),
    }
    match outcome(dir) {
        Ok((s, finished)) => {
            info.steps = s.last_step;
            info.final_loss = s.final_loss;
            info.tokens_per_s = s.mean_tokens_per_s;
            info.final_eval_accuracy = s.final_eval_accuracy;
            info.finished = finished;
        }
        Err(e) => notes.push(e.to_string()),
    }
    match checkpoint::list(dir) {
        Ok(c) => info.checkpoints = c.len(),
        Err(e) => notes.push(e.to_string()),
    }
    if !notes.is_empty() {
        info.note = Some(notes.join("; "));
    }
    Ok(info)
}

/// Every run under `root` (directories with a `config.json`), oldest first. A run
/// whose files are damaged is listed with a note rather than failing the listing.
pub fn list_runs(root: &Path) -> Result<Vec<RunInfo>> {
    if !root.is_dir() {
        return Err(RunError::NoRunsDir {
            root: root.to_path_buf(),
        });
    }
    let mut runs = Vec::new();
    for entry in ctx(std::fs::read_dir(root), "listing", root)? {
        let path = ctx(entry, "listing", root)?.path();
        if path.join(CONFIG_FILE).is_file() {
            runs.push(run_info(&path)?);
        }
    }
    runs.sort_by(|a, b| a.modified.cmp(&b.modified).then(a.name.cmp(&b.name)));
    Ok(runs)
}

/// A one-line summary of a config: the leaves named in [`SUMMARY_KEYS`], in that
/// order, as `key=value`.
pub fn config_summary(config: &Value) -> String {
    let flat = flatten_json(config);
    let mut parts = Vec::new();
    for want in SUMMARY_KEYS {
        let hit = flat
            .iter()
            .find(|(k, _)| k.rsplit('.').next() == Some(want));
        if let Some((_, v)) = hit {
            parts.push(format!("{want}={}", show_value(v)));
        }
    }
    if parts.is_empty() {
        format!("{} keys", flat.len())
    } else {
        parts.join(" ")
    }
}

/// Formats a time as UTC `YYYY-MM-DD HH:MM`.
pub fn format_utc(t: SystemTime) -> String {
    let secs = t
        .duration_since(SystemTime::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0);
    let (mut days, rem) = (secs / 86_400, secs % 86_400);
    let leap = |y: u64| (y.is_multiple_of(4) && !y.is_multiple_of(100)) || y.is_multiple_of(400);
    let mut year = 1970;
    loop {
        let len = if leap(year) { 366 } else { 365 };
        if days < len {
            break;
        }
        days -= len;
        year += 1;
    }
    let mut month_len = [31, 28, 31, 30, 31, 30, 31, 31, 30, 31, 30, 31];
    if leap(year) {
        month_len[1] = 29;
    }
    let mut month = 0;
    while days >= month_len[month] {
        days -= month_len[month];
        month += 1;
    }
    format!(
        "{year:04}-{:02}-{:02} {:02}:{:02}",
        month + 1,
        days + 1,
        rem / 3600,
        rem % 3600 / 60
    )
}

fn fmt_opt<T>(v: Option<T>, f: impl Fn(T) -> String) -> String {
    v.map(f).unwrap_or_else(|| "-".to_string())
}

/// Writes rows as left-aligned columns two spaces apart, with a leading indent.
fn write_table(f: &mut fmt::Formatter<'_>, indent: &str, rows: &[Vec<String>]) -> fmt::Result {
    let cols = rows.iter().map(Vec::len).max().unwrap_or(0);
    let widths: Vec<usize> = (0..cols)
        .map(|c| {
            rows.iter()
                .filter_map(|r| r.get(c))
                .map(|s| s.chars().count())
                .max()
                .unwrap_or(0)
        })
        .collect();
    for row in rows {
        let mut line = indent.to_string();
        for (c, cell) in row.iter().enumerate() {
            if c + 1 == row.len() {
                line.push_str(cell);
            } else {
                line.push_str(cell);
                line.push_str(&" ".repeat(widths[c] - cell.chars().count() + 2));
            }
        }
        writeln!(f, "{}", line.trim_end())?;
    }
    Ok(())
}

/// [`list_runs`]'s result as a table.
pub struct RunsTable<'a>(pub &'a [RunInfo]);

impl fmt::Display for RunsTable<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.0.is_empty() {
            return writeln!(f, "no runs");
        }
        let mut rows = vec![[
            "name",
            "date (UTC)",
            "steps",
            "final loss",
            "tokens/s",
            "eval acc",
            "ckpts",
            "config",
        ]
        .map(String::from)
        .to_vec()];
        for r in self.0 {
            let mut name = r.name.clone();
            if !r.finished && r.steps.is_some() {
                name.push('*');
            }
            rows.push(vec![
                name,
                format_utc(r.modified),
                fmt_opt(r.steps, |s| s.to_string()),
                fmt_opt(r.final_loss, |l| format!("{l:.4}")),
                fmt_opt(r.tokens_per_s, |t| format!("{t:.0}")),
                fmt_opt(r.final_eval_accuracy, |a| format!("{a:.4}")),
                r.checkpoints.to_string(),
                r.config.clone(),
            ]);
        }
        write_table(f, "", &rows)?;
        if self.0.iter().any(|r| !r.finished && r.steps.is_some()) {
            writeln!(
                f,
                "* no up-to-date summary.json: still running or stopped early"
            )?;
        }
        for r in self.0 {
            if let Some(note) = &r.note {
                writeln!(f, "{}: {note}", r.name)?;
            }
        }
        Ok(())
    }
}

// ---------------------------------------------------------------------------------
// Diff

/// Flattens JSON to `a.b.c = leaf` (array elements by index: `layers.0`). Empty
/// objects and arrays are leaves.
pub fn flatten_json(value: &Value) -> BTreeMap<String, Value> {
    fn walk(prefix: &str, v: &Value, out: &mut BTreeMap<String, Value>) {
        let key = |k: &str| {
            if prefix.is_empty() {
                k.to_string()
            } else {
                format!("{prefix}.{k}")
            }
        };
        match v {
            Value::Object(m) if !m.is_empty() => {
                for (k, child) in m {
                    walk(&key(k), child, out);
                }
            }
            Value::Array(a) if !a.is_empty() => {
                for (i, child) in a.iter().enumerate() {
                    walk(&key(&i.to_string()), child, out);
                }
            }
            leaf => {
                out.insert(prefix.to_string(), leaf.clone());
            }
        }
    }
    let mut out = BTreeMap::new();
    walk("", value, &mut out);
    out
}

/// JSON leaves compared as values: `1` and `1.0` are the same number.
fn same_value(a: &Value, b: &Value) -> bool {
    match (a, b) {
        (Value::Number(x), Value::Number(y)) => x == y || x.as_f64() == y.as_f64(),
        _ => a == b,
    }
}

fn show_value(v: &Value) -> String {
    match v {
        Value::String(s) => s.clone(),
        other => other.to_string(),
    }
}

/// How a config key differs between run A and run B.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ChangeKind {
    Added,
    Removed,
    Changed,
}

/// One config key that differs; `a`/`b` are `None` where the key is absent.
#[derive(Clone, Debug, PartialEq)]
pub struct ConfigChange {
    pub key: String,
    pub a: Option<Value>,
    pub b: Option<Value>,
}

impl ConfigChange {
    pub fn kind(&self) -> ChangeKind {
        match (&self.a, &self.b) {
            (None, _) => ChangeKind::Added,
            (_, None) => ChangeKind::Removed,
            _ => ChangeKind::Changed,
        }
    }
}

/// What a run achieved, for comparison.
#[derive(Clone, Debug)]
pub struct RunOutcome {
    pub name: String,
    pub dir: PathBuf,
    pub summary: Summary,
}

/// Two runs compared: config keys that differ, then results.
#[derive(Clone, Debug)]
pub struct RunDiff {
    pub a: RunOutcome,
    pub b: RunOutcome,
    /// Sorted by key.
    pub changes: Vec<ConfigChange>,
    /// Set when the runs ran different numbers of steps (a config does not hold the
    /// length, so identical configs can differ there): the last step both ran, and
    /// each run's loss at it.
    pub common_step: Option<(u64, Option<f32>, Option<f32>)>,
}

fn ratio(a: Option<f64>, b: Option<f64>) -> Option<f64> {
    match (a, b) {
        (Some(a), Some(b)) if a != 0.0 && a.is_finite() && b.is_finite() => Some(b / a),
        _ => None,
    }
}

impl RunDiff {
    pub fn changed_keys(&self) -> Vec<&str> {
        self.changes.iter().map(|c| c.key.as_str()).collect()
    }

    /// The runs differ in exactly one config key, as the ledger's rule wants.
    pub fn is_one_variable(&self) -> bool {
        self.changes.len() == 1
    }

    /// B's throughput over A's.
    pub fn tokens_per_s_ratio(&self) -> Option<f64> {
        ratio(
            self.a.summary.mean_tokens_per_s,
            self.b.summary.mean_tokens_per_s,
        )
    }

    /// B's final loss over A's.
    pub fn final_loss_ratio(&self) -> Option<f64> {
        ratio(
            self.a.summary.final_loss.map(f64::from),
            self.b.summary.final_loss.map(f64::from),
        )
    }
}

/// Compares two runs: their flattened `config.json` files key by key, then their
/// results.
pub fn diff_runs(a: &Path, b: &Path) -> Result<RunDiff> {
    type Side = (RunOutcome, BTreeMap<String, Value>, Vec<StepRecord>);
    let side = |dir: &Path| -> Result<Side> {
        let config = read_config(dir)?;
        let (summary, _) = outcome(dir)?;
        Ok((
            RunOutcome {
                name: run_name(dir),
                dir: dir.to_path_buf(),
                summary,
            },
            flatten_json(&config),
            read_metrics(dir)?,
        ))
    };
    let (a, ca, ra) = side(a)?;
    let (b, cb, rb) = side(b)?;
    let common_step = match (a.summary.last_step, b.summary.last_step) {
        (Some(x), Some(y)) if x != y => {
            let at = x.min(y);
            let loss = |r: &[StepRecord]| {
                r.iter()
                    .find(|r| r.step == at)
                    .map(|r| r.loss)
                    .filter(|l| l.is_finite())
            };
            Some((at, loss(&ra), loss(&rb)))
        }
        _ => None,
    };
    let mut changes = Vec::new();
    for (key, va) in &ca {
        match cb.get(key) {
            None => changes.push(ConfigChange {
                key: key.clone(),
                a: Some(va.clone()),
                b: None,
            }),
            Some(vb) if !same_value(va, vb) => changes.push(ConfigChange {
                key: key.clone(),
                a: Some(va.clone()),
                b: Some(vb.clone()),
            }),
            Some(_) => {}
        }
    }
    for (key, vb) in &cb {
        if !ca.contains_key(key) {
            changes.push(ConfigChange {
                key: key.clone(),
                a: None,
                b: Some(vb.clone()),
            });
        }
    }
    changes.sort_by(|x, y| x.key.cmp(&y.key));
    Ok(RunDiff {
        a,
        b,
        changes,
        common_step,
    })
}

impl fmt::Display for RunDiff {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let (an, bn) = (&self.a.name, &self.b.name);
        writeln!(f, "A = {} ({})", an, self.a.dir.display())?;
        writeln!(f, "B = {} ({})", bn, self.b.dir.display())?;
        writeln!(f)?;
        let lengths = self.common_step.map(|(at, la, lb)| {
            let steps = |s: &Summary| fmt_opt(s.last_step, |s| s.to_string());
            let loss = |l: Option<f32>| fmt_opt(l, |l| format!("{l:.4}"));
            format!(
                "the runs ran different numbers of steps (A {}, B {}), so the results below \
                 compare different lengths; at step {at}, the last both ran, the loss was A \
                 {}, B {}",
                steps(&self.a.summary),
                steps(&self.b.summary),
                loss(la),
                loss(lb)
            )
        });
        match (self.changes.len(), &lengths) {
            (0, Some(l)) => writeln!(f, "config: identical, but {l}")?,
            (0, None) => writeln!(f, "config: identical")?,
            (1, _) => writeln!(f, "config: 1 key differs")?,
            (n, _) => {
                writeln!(f, "config: {n} keys differ")?;
                writeln!(
                    f,
                    "WARNING: more than one config key differs, so the difference in results cannot be put down to one change (the ledger's rule is one variable at a time)"
                )?;
            }
        }
        if !self.changes.is_empty() {
            let mut rows = vec![vec![
                String::new(),
                "key".to_string(),
                "A".to_string(),
                "B".to_string(),
            ]];
            for c in &self.changes {
                let mark = match c.kind() {
                    ChangeKind::Added => "+",
                    ChangeKind::Removed => "-",
                    ChangeKind::Changed => "~",
                };
                rows.push(vec![
                    mark.to_string(),
                    c.key.clone(),
                    c.a.as_ref().map_or("(absent)".into(), show_value),
                    c.b.as_ref().map_or("(absent)".into(), show_value),
                ]);
            }
            write_table(f, "  ", &rows)?;
            if let Some(l) = &lengths {
                writeln!(f, "steps: {l}")?;
            }
        }
        writeln!(f)?;
        let (sa, sb) = (&self.a.summary, &self.b.summary);
        let ratio_cell = |r: Option<f64>| fmt_opt(r, |r| format!("{r:.3}x"));
        let loss = |l: Option<f32>| fmt_opt(l, |l| format!("{l:.4}"));
        let f64r = |a: Option<f32>, b: Option<f32>| ratio(a.map(f64::from), b.map(f64::from));
        let rows = vec![
            vec![
                "result".to_string(),
                "A".to_string(),
                "B".to_string(),
                "B/A".to_string(),
            ],
            vec![
                "steps".to_string(),
                fmt_opt(sa.last_step, |s| s.to_string()),
                fmt_opt(sb.last_step, |s| s.to_string()),
                String::new(),
            ],
            vec![
                "tokens/s".to_string(),
                fmt_opt(sa.mean_tokens_per_s, |t| format!("{t:.1}")),
                fmt_opt(sb.mean_tokens_per_s, |t| format!("{t:.1}")),
                ratio_cell(self.tokens_per_s_ratio()),
            ],
            vec![
                "final loss".to_string(),
                loss(sa.final_loss),
                loss(sb.final_loss),
                ratio_cell(self.final_loss_ratio()),
            ],
            vec![
                "best loss".to_string(),
                loss(sa.best_loss),
                loss(sb.best_loss),
                ratio_cell(f64r(sa.best_loss, sb.best_loss)),
            ],
            vec![
                "eval loss".to_string(),
                loss(sa.final_eval_loss),
                loss(sb.final_eval_loss),
                ratio_cell(f64r(sa.final_eval_loss, sb.final_eval_loss)),
            ],
            vec![
                "eval accuracy".to_string(),
                loss(sa.final_eval_accuracy),
                loss(sb.final_eval_accuracy),
                ratio_cell(f64r(sa.final_eval_accuracy, sb.final_eval_accuracy)),
            ],
            vec![
                "skipped steps".to_string(),
                sa.skipped_steps.to_string(),
                sb.skipped_steps.to_string(),
                String::new(),
            ],
        ];
        write_table(f, "  ", &rows)
    }
}
