//! Training configuration: reads DeepSpeed's `ds_config.json` and resolves it into a
//! [`TrainConfig`] in which every value is settled.
//!
//! Users bring the config files they already have, so the keys, defaults and batch-size
//! arithmetic follow DeepSpeed. Where DeepSpeed is lenient in ways that cost people runs,
//! Kiln is strict:
//!
//! - **Unknown keys are errors** with a "did you mean" suggestion (DeepSpeed ignores
//!   unknown top-level keys, so `grandient_accumulation_steps` silently trains with 1).
//! - **Keys that would change training but are not implemented** (activation
//!   checkpointing, ZeRO stage 3, offload, ...) are errors saying so, unless
//!   they are set to their no-op value (`"amp": {"enabled": false}`, `null`, ...).
//! - **Keys that change nothing here** (logging like `tensorboard`, speed-only switches
//!   like `graph_harvesting`, machinery Kiln lacks like `aio`) are accepted: with a note
//!   in [`TrainConfig::notes`] when they ask for nothing, listed in
//!   [`TrainConfig::warnings`] as ignored when they ask for something Kiln will not do.
//!   Every top-level key of DeepSpeed's runtime config (as of 2025) is in one of these
//!   groups, so only typos are "unknown".
//! - **Every problem is reported at once** ([`ConfigError::problems`]), each with its key
//!   path, what was expected, what was found and how to fix it; past the first 50 they
//!   are only counted, so the work per key is bounded.
//! - **Integers are checked against what the engine holds**: batch sizes and their
//!   product up to [`MAX_BATCH`], the run's samples (steps × batch) within 64 bits, the
//!   loss-scale window within the scaler's i64 arithmetic.
//! - Kiln's own settings (devices, data workers, step count, evaluation and checkpoint
//!   intervals, seed) live in a `kiln` section ([`KilnSettings`]), checked as strictly.
//! - `null` means "not set", as DeepSpeed's `None` does. `"auto"`, the Hugging Face
//!   Trainer's placeholder, is filled in where the rest of the file determines it and
//!   otherwise asked for, all such keys in one problem (see `auto.rs`).
//! - A UTF-8 byte-order mark at the start of the file is skipped (Windows editors write
//!   one; JSON parsers that reject it give a baffling error at line 1, column 1).
//!
//! Deliberate differences from DeepSpeed's behaviour (all on the side of fewer surprises):
//!
//! - fp16 dynamic loss scaling always uses the documented defaults (2^16, hysteresis 2);
//!   DeepSpeed starts ZeRO runs whose `fp16` holds only `enabled` at 2^32 without
//!   hysteresis. A warning says so when that case arises.
//! - `WarmupCosineLR` stays at `cos_min_ratio` after `total_num_steps` instead of
//!   following the cosine back up.
//! - Scheduler settings that cannot describe a sensible run are errors (DeepSpeed logs a
//!   warning or divides by zero): `total_num_steps` not above the warmup,
//!   `warmup_min_lr > warmup_max_lr`.
//!
//! The files, each using only those listed before it:
//!
//! - `error.rs`: [`Problem`] and [`ConfigError`], which reports every problem at once.
//! - `provenance.rs`: where each resolved value came from ([`Provenance`]).
//! - `strict_json.rs`: JSON parsing that rejects a key given twice.
//! - `suggest.rs`: "did you mean" for unknown keys, and fixes for top-level keys that
//!   belong elsewhere.
//! - `reader.rs`: the `Reader` that walks the JSON, checks each value's type and range,
//!   and collects problems, warnings and provenance.
//! - `keys.rs`: the keys one object may hold (`Spec`) and the check of an object
//!   against them.
//! - `flops_profiler.rs`: the `flops_profiler` section, which the profiler honours.
//! - `ignored.rs`: top-level keys accepted with a warning (logging and monitoring);
//!   `unsupported.rs`: top-level features rejected unless switched off.
//! - One file per section, with its resolved type and how the section is read:
//!   `batch.rs` (the three batch-size keys and how the missing ones are inferred),
//!   `precision.rs` (`fp16` / `bf16` and loss scaling), `optimizer.rs`, `scheduler.rs`
//!   (the learning-rate schedules and their formulas), `zero.rs`
//!   (`zero_optimization`), `pipeline.rs` (`pipeline`), `kiln.rs` (Kiln's own `kiln`
//!   section).
//! - this file: [`TrainConfig`], [`parse`] / [`load`], the top-level keys, and the
//!   resolution that reads each section in turn.
//! - `auto.rs`: Hugging Face's `"auto"`: where the Trainer takes each value, and the one
//!   problem for those Kiln cannot know.
//! - `explain.rs`: [`TrainConfig::explain`], every value with its origin.

mod activation_checkpointing;
mod auto;
mod batch;
mod error;
mod explain;
mod flops_profiler;
mod ignored;
mod keys;
mod kiln;
mod lora;
mod optimizer;
mod pipeline;
mod precision;
mod provenance;
mod reader;
mod scheduler;
mod strict_json;
mod suggest;
mod unsupported;
mod zero;

use std::collections::BTreeMap;
use std::path::Path;

use serde::Serialize;
use serde_json::{Map, Value};

pub use crate::device::optim::Optimizer;
pub use batch::{BatchConfig, MAX_BATCH};
pub use error::{ConfigError, Problem};
pub use flops_profiler::FlopsProfiler;
pub use kiln::KilnSettings;
pub use lora::LoraSection;
pub use pipeline::{PartitionMethod, PipelineConfig, MAX_PIPELINE_STAGES};
pub use precision::{DynamicScaling, LossScaling, Precision};
pub use provenance::Provenance;
pub use scheduler::{Schedule, WarmupType};
pub use zero::ZeroConfig;

use keys::Spec;
use optimizer::{default_optimizer, DEFAULT_LR};
use reader::{auto_at, describe, Range, Reader};
use strict_json::StrictValue;

// ---------------------------------------------------------------------------------------
// Resolved configuration
// ---------------------------------------------------------------------------------------

/// A fully resolved training configuration: no optional values, no strings to interpret.
///
/// Built by [`parse`] / [`load`] from a DeepSpeed config, or by [`TrainConfig::default_for`]
/// when the user brings none. [`TrainConfig::explain`] prints it with the origin of
/// every value.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct TrainConfig {
    pub batch: BatchConfig,
    pub precision: Precision,
    /// The optimizer's settings. Its `lr` is the base rate; the rate actually applied at
    /// each step comes from [`TrainConfig::schedule`], which may override it (WarmupLR).
    pub optimizer: Optimizer,
    /// The learning rate per optimizer step: always use [`Schedule::lr_at`].
    pub schedule: Schedule,
    /// Clip the global gradient norm to this value; 0 turns clipping off.
    pub gradient_clipping: f32,
    /// Log every this many optimizer steps.
    pub steps_per_print: u64,
    /// Profile a few steps (as `kiln train --profile`): a trace of every kernel and host
    /// span, and where each step's time went.
    pub wall_clock_breakdown: bool,
    /// DeepSpeed's FLOPs profiler, honoured by the same profile.
    pub flops_profiler: FlopsProfiler,
    /// Print memory use at each logging step.
    pub memory_breakdown: bool,
    /// Print the full engine state at start-up.
    pub dump_state: bool,
    pub zero: ZeroConfig,
    /// Pipeline stages and how the model is cut into them (`pipeline`, or
    /// `kiln.pipeline_stages`); 1 stage: no pipeline.
    pub pipeline: PipelineConfig,
    /// Kiln's own settings (the `kiln` section).
    pub kiln: KilnSettings,
    /// Activation checkpointing: blocks per recomputed range (`kiln.activation_
    /// checkpointing`, or 1 where the `activation_checkpointing` section is given);
    /// `None`: off.
    pub activation_checkpointing: Option<usize>,
    /// Things the user should know that are not errors: ignored logging sections, settings
    /// that override others, differences from DeepSpeed's behaviour.
    pub warnings: Vec<String>,
    /// Things that need no action, shown by [`TrainConfig::explain`]: DeepSpeed keys
    /// accepted because they change nothing here, defaults that differ from other tools'.
    /// Not part of a run's settings (not serialized).
    #[serde(skip)]
    pub notes: Vec<String>,
    /// Micro-batches pack several documents a row (an example file under
    /// `kiln.packing`): the trainer builds its networks packed. Set by whoever opens
    /// the data (`kiln train`), not a config key; false as parsed.
    #[serde(skip)]
    pub packed_rows: bool,
    /// Where each resolved value came from, keyed by its DeepSpeed key path
    /// (`"fp16.loss_scale_window"`, `"optimizer.params.lr"`, `"world_size"`). A key that
    /// is absent here counts as [`Provenance::Default`]. Only [`TrainConfig::explain`]
    /// reads it, so code that edits the fields afterwards should update it too.
    pub provenance: BTreeMap<String, Provenance>,
}

impl TrainConfig {
    /// Settings for a user who brings no config file: micro-batch 8 per rank, no
    /// accumulation (so `train_batch_size = 8 * world`), fp32, Adam with DeepSpeed's
    /// defaults (lr 1e-3, betas (0.9, 0.999), eps 1e-8, no weight decay) at a constant
    /// rate, no clipping, no ZeRO. fp32 because it works on every GPU and needs no loss
    /// scaling; mixed precision is opt-in through `fp16`/`bf16`.
    ///
    /// Panics if `world` is 0.
    pub fn default_for(world: usize) -> TrainConfig {
        assert!(
            world >= 1,
            "the data-parallel world size must be at least 1"
        );
        let micro = 8;
        let mut provenance = BTreeMap::new();
        provenance.insert("world_size".to_string(), Provenance::Caller);
        provenance.insert(
            "train_batch_size".to_string(),
            Provenance::Inferred(format!(
                "train_micro_batch_size_per_gpu {micro} × gradient_accumulation_steps 1 × world size {world}"
            )),
        );
        TrainConfig {
            batch: BatchConfig {
                train_batch_size: micro * world,
                micro_batch: micro,
                grad_accum: 1,
                world,
            },
            precision: Precision::Fp32,
            optimizer: default_optimizer(),
            schedule: Schedule::Constant {
                lr: DEFAULT_LR as f32,
            },
            gradient_clipping: 0.0,
            steps_per_print: 10,
            wall_clock_breakdown: false,
            flops_profiler: FlopsProfiler::default(),
            memory_breakdown: false,
            dump_state: false,
            zero: ZeroConfig::default(),
            pipeline: PipelineConfig::default(),
            kiln: KilnSettings::default(),
            activation_checkpointing: None,
            warnings: Vec::new(),
            notes: Vec::new(),
            provenance,
            packed_rows: false,
        }
    }
}

// ---------------------------------------------------------------------------------------
// Entry points
// ---------------------------------------------------------------------------------------

/// Resolves a DeepSpeed config given as JSON text, for `world` data-parallel ranks.
///
/// `world` comes from the launcher, never from the file, as in DeepSpeed; it is needed
/// because the three batch-size keys are related through it.
pub fn parse(text: &str, world: usize) -> Result<TrainConfig, ConfigError> {
    let text = text.strip_prefix('\u{feff}').unwrap_or(text);
    let root = match serde_json::from_str::<StrictValue>(text) {
        Ok(v) => v.0,
        Err(e) => {
            // serde_json appends " at line L column C"; the message states it once.
            let full = e.to_string();
            let what = full
                .rsplit_once(" at line ")
                .map_or(full.as_str(), |(m, _)| m);
            return Err(ConfigError {
                file: None,
                problems: vec![Problem {
                    path: String::new(),
                    message: format!(
                        "invalid JSON at line {}, column {}: {what}",
                        e.line(),
                        e.column(),
                    ),
                    fix: "correct the text there (JSON allows no comments, trailing commas, \
                          single quotes or NaN, and each key once per object)"
                        .to_string(),
                }],
                omitted: 0,
            });
        }
    };
    let Value::Object(root) = root else {
        return Err(ConfigError {
            file: None,
            problems: vec![Problem {
                path: String::new(),
                message: format!("expected a JSON object, found {}", describe(&root)),
                fix: "write the config as { \"train_batch_size\": ..., ... }".to_string(),
            }],
            omitted: 0,
        });
    };
    resolve(&root, world)
}

/// Reads and resolves a DeepSpeed config file; errors name the file.
pub fn load(path: &Path, world: usize) -> Result<TrainConfig, ConfigError> {
    let unreadable = |message: String, fix: &str| ConfigError {
        file: Some(path.to_path_buf()),
        problems: vec![Problem {
            path: String::new(),
            message,
            fix: fix.to_string(),
        }],
        omitted: 0,
    };
    // Only a regular file: a device such as /dev/zero would be read until memory ran out.
    match std::fs::metadata(path) {
        Ok(m) if !m.is_file() => {
            return Err(unreadable(
                "it is not a regular file (a directory, a device or a pipe)".to_string(),
                "pass the path of a JSON config file",
            ))
        }
        _ => {}
    }
    let text = std::fs::read_to_string(path).map_err(|e| {
        unreadable(
            format!("cannot read the file: {e}"),
            "check the path and its permissions",
        )
    })?;
    parse(&text, world).map_err(|mut e| {
        e.file = Some(path.to_path_buf());
        e
    })
}

// ---------------------------------------------------------------------------------------
// Top level
// ---------------------------------------------------------------------------------------

const TOP: Spec = Spec {
    keys: &[
        "train_batch_size",
        "train_micro_batch_size_per_gpu",
        "gradient_accumulation_steps",
        "fp16",
        "bf16",
        "bfloat16",
        "optimizer",
        "scheduler",
        "gradient_clipping",
        "steps_per_print",
        "wall_clock_breakdown",
        "flops_profiler",
        "memory_breakdown",
        "dump_state",
        "zero_optimization",
        "pipeline",
        "kiln",
        "activation_checkpointing",
    ],
    ignored: ignored::TOP_LEVEL,
    unsupported: unsupported::TOP_LEVEL,
    hints: suggest::MISPLACED,
};

fn resolve(root: &Map<String, Value>, world: usize) -> Result<TrainConfig, ConfigError> {
    let mut r = Reader::default();
    r.check_keys(root, "", &TOP);
    let batch = r.batch(root, world);
    let (precision, bare_fp16) = r.precision(root);
    let (optimizer, lr_given) = r.optimizer(root);
    let schedule = r.scheduler(root, &optimizer, lr_given);
    let gradient_clipping = if auto_at(root, "gradient_clipping") {
        r.hf_guess("gradient_clipping", "--max_grad_norm 1.0", "1.0");
        1.0
    } else {
        r.float_or(root, "", "gradient_clipping", Range::AtLeast(0.0), 0.0) as f32
    };
    let steps_per_print = r.uint_or(root, "", "steps_per_print", (1, u64::MAX), 10);
    let wall_clock_breakdown = r.bool_or(root, "", "wall_clock_breakdown", false);
    let flops_profiler = r.flops_profiler(root);
    let memory_breakdown = r.bool_or(root, "", "memory_breakdown", false);
    let dump_state = r.bool_or(root, "", "dump_state", false);
    let zero = r.zero(root);
    let kiln = r.kiln(root);
    let activation_checkpointing = r.activation_checkpointing(root);
    let pipeline = r.pipeline(root, kiln.pipeline_stages);
    if bare_fp16 && zero.stage >= 1 {
        r.warnings.push(
            "fp16 sets only \"enabled\": Kiln starts the dynamic loss scale at 2^16 with \
             hysteresis 2 (DeepSpeed's documented defaults), while DeepSpeed with ZeRO starts \
             such a config at 2^32 without hysteresis; set fp16.initial_scale_power 32 and \
             fp16.hysteresis 1 to reproduce DeepSpeed"
                .to_string(),
        );
    }
    r.run_fits(&batch, &kiln, &schedule);
    r.finish_autos();
    if !r.problems.is_empty() {
        return Err(ConfigError {
            file: None,
            problems: r.problems,
            omitted: r.omitted,
        });
    }
    Ok(TrainConfig {
        batch,
        precision,
        optimizer,
        schedule,
        gradient_clipping,
        steps_per_print,
        wall_clock_breakdown,
        flops_profiler,
        memory_breakdown,
        dump_state,
        zero,
        pipeline,
        kiln,
        activation_checkpointing,
        warnings: r.warnings,
        notes: r.notes,
        provenance: r.provenance,
        packed_rows: false,
    })
}

impl Reader {
    /// The run's length times its batch must fit the 64-bit count of samples drawn (the
    /// data position a checkpoint stores). The length is `kiln.steps`, else the
    /// scheduler's `total_num_steps`, which `kiln train` runs when no step count is given.
    fn run_fits(&mut self, batch: &BatchConfig, kiln: &KilnSettings, schedule: &Schedule) {
        if batch.train_batch_size == 0 {
            return; // the batch is already a problem
        }
        let (path, steps) = match (kiln.steps, schedule) {
            (Some(n), _) => ("kiln.steps", n),
            (
                None,
                Schedule::WarmupDecayLr { total_steps, .. }
                | Schedule::WarmupCosineLr { total_steps, .. },
            ) => ("scheduler.params.total_num_steps", *total_steps),
            _ => return,
        };
        let max = batch.max_steps();
        if steps > max {
            let b = batch.train_batch_size;
            self.problem(
                path,
                format!(
                    "{steps} steps × train_batch_size {b} samples is more samples than the \
                     64-bit count of samples drawn can hold"
                ),
                format!("use at most {max} steps at train_batch_size {b}"),
            );
        }
    }
}
