//! A run's own settings (seed, step count, evaluation and checkpoint intervals,
//! retention): from the flags, a resumed run's checkpoint, or the config.

use serde_json::Value;

use kiln_engine::config::{self, Schedule, TrainConfig};

use super::options::TrainOptions;

/// Training steps when neither `--steps` nor the scheduler's `total_num_steps` says.
const DEFAULT_STEPS: u64 = 1000;

/// A run's own settings: restored by `--resume` unless a flag overrides them.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(super) struct RunSettings {
    pub seed: u64,
    pub steps: u64,
    pub eval_every: u64,
    pub checkpoint_every: u64,
    pub keep_checkpoints: usize,
}

/// The key of a checkpoint's state that holds [`RunSettings`] (the seed is in the run's
/// config.json).
pub(super) const RUN_STATE_KEY: &str = "run";

pub(super) struct ResolvedSettings {
    pub run: RunSettings,
    /// What the user should know: settings restored, overridden, or differing from the
    /// config.
    pub notes: Vec<String>,
}

/// Flags first; on `--resume`, then the run's own settings (so a run started with
/// `--steps 30` resumes to 30, not to the config's count); then the config.
pub(super) fn resolve_settings(
    opts: &TrainOptions,
    ds: &TrainConfig,
    resumed: Option<(&Value, &Value)>,
) -> ResolvedSettings {
    let k = &ds.kiln;
    let config_steps = k.steps.unwrap_or(match ds.schedule {
        Schedule::WarmupDecayLr { total_steps, .. }
        | Schedule::WarmupCosineLr { total_steps, .. } => total_steps,
        _ => DEFAULT_STEPS,
    });
    let mut notes = vec![];
    let Some((recorded, state)) = resumed else {
        let run = RunSettings {
            seed: opts.seed.unwrap_or(k.seed),
            steps: opts.steps.unwrap_or(config_steps),
            eval_every: opts.eval_every.unwrap_or(k.eval_every),
            checkpoint_every: opts.checkpoint_every.unwrap_or(k.checkpoint_every),
            keep_checkpoints: opts.keep_checkpoints.unwrap_or(k.keep_checkpoints),
        };
        return ResolvedSettings { run, notes };
    };
    let stored = &state[RUN_STATE_KEY];
    if stored.is_null() {
        notes.push(
            "the checkpoint predates saved run settings: the step count, evaluation and \
             checkpoint intervals and retention come from the flags and the config"
                .to_string(),
        );
    }
    let from_file = |key: &str| ds.provenance.get(key) == Some(&config::Provenance::File);
    let mut restored = vec![];
    let mut pick = |name: &str, flag: Option<u64>, run: Option<u64>, config: u64| -> u64 {
        let flag_name = format!("--{}", name.replace('_', "-"));
        match (flag, run) {
            (Some(f), Some(r)) if f != r => {
                notes.push(format!("{flag_name} {f} replaces the run's {name} {r}"));
                f
            }
            (Some(f), _) => f,
            (None, Some(r)) => {
                if from_file(&format!("kiln.{name}")) && config != r {
                    notes.push(format!(
                        "kiln.{name} {config} in the config differs from the run's {r}; the \
                         run's is kept (pass {flag_name} {config} to change it)"
                    ));
                }
                restored.push(format!("{name} {r}"));
                r
            }
            (None, None) => config,
        }
    };
    let run = RunSettings {
        seed: pick("seed", opts.seed, recorded["seed"].as_u64(), k.seed),
        steps: pick(
            "steps",
            opts.steps,
            stored["steps"].as_u64().filter(|&n| n > 0),
            config_steps,
        ),
        eval_every: pick(
            "eval_every",
            opts.eval_every,
            stored["eval_every"].as_u64(),
            k.eval_every,
        ),
        checkpoint_every: pick(
            "checkpoint_every",
            opts.checkpoint_every,
            stored["checkpoint_every"].as_u64(),
            k.checkpoint_every,
        ),
        keep_checkpoints: pick(
            "keep_checkpoints",
            opts.keep_checkpoints.map(|n| n as u64),
            stored["keep_checkpoints"].as_u64(),
            k.keep_checkpoints as u64,
        ) as usize,
    };
    if !restored.is_empty() {
        notes.push(format!(
            "resuming with the run's own {} (the flags of the same names change them)",
            restored.join(", ")
        ));
    }
    ResolvedSettings { run, notes }
}
