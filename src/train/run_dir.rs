//! The run directory: checked before anything opens, created (and locked) once every
//! setting is valid, and the record of what the run is, which a resume must match.

use std::path::Path;

use anyhow::{bail, Result};
use serde_json::{json, Value};

use kiln_engine::config::TrainConfig;
use kiln_engine::models::ModelConfig;
use kiln_engine::train::checkpoint;
use kiln_engine::train::runs::{self, MetricsWriter};

use super::options::TrainOptions;
use crate::say::say;

/// Refuses a run directory whose files would overwrite an input: `--data` saved as
/// `runs/x/metrics.jsonl`, say (truncated while it is memory-mapped), or a file under
/// `checkpoints/`, which old checkpoints are pruned from.
pub(super) fn check_inputs_survive(dir: &Path, opts: &TrainOptions) -> Result<()> {
    let inputs = [
        ("--data", &opts.data),
        ("--config", &opts.config),
        ("--model", &opts.model),
    ];
    for (flag, path) in inputs {
        if let Some(path) = path {
            check_input_survives(dir, flag, path)?;
        }
    }
    Ok(())
}

/// Refuses an input (`flag path`) that a run in `dir` would overwrite or prune.
pub fn check_input_survives(dir: &Path, flag: &str, path: &Path) -> Result<()> {
    let written = [
        runs::CONFIG_FILE,
        runs::METRICS_FILE,
        runs::SUMMARY_FILE,
        runs::CHART_FILE,
    ]
    .map(|f| dir.join(f));
    let checkpoints = dir.join(checkpoint::CHECKPOINTS_DIR).canonicalize().ok();
    let Ok(meta) = std::fs::metadata(path) else {
        return Ok(());
    };
    let clash = written
        .iter()
        .find(|w| same_file(&meta, w))
        .map(|w| format!("it is the run's own {}, which training writes", w.display()))
        .or_else(|| {
            let inside = path
                .canonicalize()
                .ok()
                .zip(checkpoints.as_ref())
                .is_some_and(|(p, c)| p.starts_with(c));
            inside.then(|| "it lies in the run's checkpoints, which are pruned".to_string())
        });
    if let Some(why) = clash {
        bail!(
            "{flag} {}: {why}. The run directory {} holds the run's config, metrics, \
             summary, chart and checkpoints: move the input out of it, or pick another --out",
            path.display(),
            dir.display()
        );
    }
    Ok(())
}

/// Whether `other` is the file `meta` describes (same device and inode on Unix, so hard
/// links and other spellings of the path count).
fn same_file(meta: &std::fs::Metadata, other: &Path) -> bool {
    let Ok(m) = std::fs::metadata(other) else {
        return false;
    };
    #[cfg(unix)]
    {
        use std::os::unix::fs::MetadataExt;
        m.dev() == meta.dev() && m.ino() == meta.ino()
    }
    #[cfg(not(unix))]
    {
        let _ = (meta, m);
        false
    }
}

/// Settings a resumed run may change: where it runs and how the global batch is split.
const RESHARDABLE: [&str; 6] = [
    "device",
    // Recomputing activations gives the same bits.
    "deepspeed.activation_checkpointing",
    "deepspeed.zero.stage",
    "deepspeed.batch.world",
    "deepspeed.batch.micro_batch",
    "deepspeed.batch.grad_accum",
];

/// What identifies a run: every setting that changes its numbers, and nothing per-run
/// (name, paths), so `kiln runs diff` compares like with like.
pub(super) fn run_record(
    ds: &TrainConfig,
    model: &ModelConfig,
    data: &str,
    seed: u64,
    device: &str,
) -> Value {
    let mut config = serde_json::to_value(ds).expect("the resolved config serializes");
    if let Some(obj) = config.as_object_mut() {
        // Not settings of the run's numbers: where values came from, notes, and the
        // `kiln` section (devices, workers, intervals; the seed is recorded below).
        obj.remove("provenance");
        obj.remove("warnings");
        obj.remove("kiln");
    }
    tidy_floats(&mut config);
    json!({
        "deepspeed": config,
        "model": model.record(),
        "data": data,
        "seed": seed,
        "device": device,
    })
}

/// Writes each number that is an f32 widened to f64 (every float of the config) as the
/// f32's shortest decimal: `0.003`, not `0.003000000026077032`.
fn tidy_floats(v: &mut Value) {
    match v {
        Value::Number(n) if n.is_f64() => {
            let x = n.as_f64().unwrap_or(0.0);
            let short: f64 = (x as f32).to_string().parse().unwrap_or(x);
            if (x as f32) as f64 == x {
                if let Some(m) = serde_json::Number::from_f64(short) {
                    *n = m;
                }
            }
        }
        Value::Array(a) => a.iter_mut().for_each(tidy_floats),
        Value::Object(o) => o.values_mut().for_each(tidy_floats),
        _ => {}
    }
}

/// Checks, before anything is opened or written, that `dir` can take a new run or
/// holds one to resume.
pub fn check_run_dir(dir: &Path, resume: bool) -> Result<()> {
    let has_run = dir.join(runs::CONFIG_FILE).exists();
    if !resume && has_run {
        if checkpoint::list(dir).map(|l| l.is_empty()).unwrap_or(false) {
            bail!(
                "{} already holds a run, which saved no checkpoint and so cannot be resumed; \
                 delete that directory to start over there, or pick another --out",
                dir.display()
            );
        }
        bail!(
            "{} already holds a run; continue it with --resume, or pick another --out",
            dir.display()
        );
    }
    if resume && !has_run {
        bail!(
            "--resume: {} holds no run (no {}); pass the --out of an earlier run",
            dir.display(),
            runs::CONFIG_FILE
        );
    }
    Ok(())
}

/// Creates the directory of a new run, locks it for this process and records what the
/// run is. Another run that got there first since [`check_run_dir`] holds the lock, or
/// has written its config.json: either way this one stops, touching nothing of it.
fn create_run_dir(dir: &Path, record: &Value) -> Result<runs::RunLock> {
    std::fs::create_dir_all(dir).map_err(|e| {
        let why = kiln_engine::fsutil::cannot_create(dir, &e).unwrap_or_else(|| e.to_string());
        anyhow::anyhow!("creating the run directory {}: {why}", dir.display())
    })?;
    let lock = runs::RunLock::acquire(dir)?;
    check_run_dir(dir, false)?;
    runs::write_config(dir, record)?;
    Ok(lock)
}

/// Checks that a resumed run has the settings it was started with (`recorded`, its
/// config.json), but for where it runs and how its global batch is split.
pub(super) fn check_same_run(dir: &Path, recorded: &Value, record: &Value) -> Result<()> {
    let old = runs::flatten_json(recorded);
    let new = runs::flatten_json(record);
    let mut diffs = vec![];
    let show = |v: Option<&Value>| v.map_or("(absent)".to_string(), |v| v.to_string());
    for key in old
        .keys()
        .chain(new.keys().filter(|k| !old.contains_key(*k)))
    {
        let (a, b) = (old.get(key), new.get(key));
        if a == b {
            continue;
        }
        // Checkpoints hold whole tensors, so a run may continue on other devices or
        // another number of them, or of pipeline stages, with the same global batch.
        if RESHARDABLE.contains(&key.as_str()) || key.starts_with("deepspeed.pipeline.") {
            say(format!(
                "note: resuming with {key} {} (was {})",
                show(b),
                show(a)
            ));
            continue;
        }
        diffs.push(format!("  {key}: {} -> {}", show(a), show(b)));
    }
    if !diffs.is_empty() {
        bail!(
            "--resume: these settings differ from the ones {} was started with, so it would not \
             continue the same run:\n{}\nResume with the original --config/--model/--data/--seed \
             (and device), or start a new run with another --out",
            dir.display(),
            diffs.join("\n")
        );
    }
    Ok(())
}

/// Everything is valid: only now does the run directory get written. A resumed run
/// appends to its metrics (those past its checkpoint dropped), a new one creates and
/// locks its directory (the lock kept in `run_lock`); `None` in a process that does not
/// write the run.
pub(super) fn open_metrics(
    dir: &Path,
    writer: bool,
    resumed: Option<&checkpoint::Checkpoint>,
    record: &Value,
    run_lock: &mut Option<runs::RunLock>,
) -> Result<Option<MetricsWriter>> {
    Ok(match resumed {
        _ if !writer => None,
        Some(ck) => Some({
            say(format!(
                "resuming {} from step {} ({})",
                dir.display(),
                ck.step(),
                ck.dir.display()
            ));
            let w = MetricsWriter::resume(dir, ck.step())?;
            if w.dropped() > 0 {
                say(format!(
                    "note: dropped {} metrics records written after step {} (they belong to \
                     the interrupted continuation)",
                    w.dropped(),
                    ck.step()
                ));
            }
            w
        }),
        None => {
            *run_lock = Some(create_run_dir(dir, record)?);
            Some(MetricsWriter::create(dir)?)
        }
    })
}
