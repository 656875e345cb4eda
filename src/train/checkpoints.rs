//! A run's checkpoints as `kiln train` writes and resumes them: the engine's state,
//! the data position and the run's own settings.

use std::path::Path;

use anyhow::{bail, Result};
use serde_json::{json, Value};

use kiln_engine::train::checkpoint;
use kiln_engine::train::engine::TrainingEngine;

use super::settings::{RunSettings, RUN_STATE_KEY};

/// Writes a checkpoint of everything `--resume` needs, the run's own settings included.
pub(super) fn save(
    engine: &dyn TrainingEngine,
    dir: &Path,
    step: u64,
    next_sample: u64,
    run: &RunSettings,
) -> Result<checkpoint::Saved> {
    let mut state = serde_json::Map::new();
    state.insert("next_sample".into(), json!(next_sample));
    state.insert(
        RUN_STATE_KEY.into(),
        json!({
            "steps": run.steps,
            "eval_every": run.eval_every,
            "checkpoint_every": run.checkpoint_every,
            "keep_checkpoints": run.keep_checkpoints,
        }),
    );
    Ok(engine.save_checkpoint(dir, step, state, run.keep_checkpoints)?)
}

/// Restores a checkpoint into the engine; returns the data position to continue from.
pub(super) fn restore(
    engine: &mut dyn TrainingEngine,
    ck: &checkpoint::Checkpoint,
    global: u64,
) -> Result<u64> {
    engine.load_checkpoint(ck)?;
    data_position(ck, global)
}

/// The data position a checkpoint continues from, checked against its step and the
/// run's global batch.
pub(super) fn data_position(ck: &checkpoint::Checkpoint, global: u64) -> Result<u64> {
    let next = ck
        .state()
        .get("next_sample")
        .and_then(Value::as_u64)
        .ok_or_else(|| {
            anyhow::anyhow!(
                "{}: the manifest's state has no valid `next_sample`; the checkpoint was not \
                 written by this version of kiln train",
                ck.dir.display()
            )
        })?;
    // Every step reads one global batch, and a resumed run keeps its global batch, so
    // the data position follows from the step; anything else is an edited manifest that
    // would silently train on other data.
    if Some(next) != ck.step().checked_mul(global) {
        bail!(
            "{}: the manifest's data position (next_sample {next}) disagrees with its step {} \
             × the global batch {global}: the manifest was edited or damaged; resume from an \
             earlier checkpoint or delete this directory",
            ck.dir.display(),
            ck.step()
        );
    }
    Ok(next)
}
