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
//!   checkpointing, pipeline, ZeRO stage 3, offload, ...) are errors saying so, unless
//!   they are set to their no-op value (`"amp": {"enabled": false}`, `null`, ...).
//! - **Keys that only configure logging** (`tensorboard`, `wandb`, ...) are accepted and
//!   listed in [`TrainConfig::warnings`] as ignored.
//! - **Every problem is reported at once** ([`ConfigError::problems`]), each with its key
//!   path, what was expected, what was found and how to fix it.
//! - Kiln's own settings (devices, data workers, step count, evaluation and checkpoint
//!   intervals, seed) live in a `kiln` section ([`KilnSettings`]), checked as strictly.
//! - `null` means "not set", as DeepSpeed's `None` does. The string `"auto"` is rejected:
//!   it is a placeholder the HuggingFace Trainer fills in, not a value.
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

mod error;
mod ignored;
mod keys;
mod provenance;
mod reader;
mod strict_json;
mod suggest;
mod unsupported;

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::Path;

use serde::Serialize;
use serde_json::{Map, Value};

pub use crate::optim::Optimizer;
pub use error::{ConfigError, Problem};
pub use provenance::Provenance;

use crate::loss_scaler::DynamicScaling;
use keys::{Inert, Spec};
use reader::{describe, join, Bad, Range, Reader};
use strict_json::StrictValue;
use suggest::suggest;

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
    /// Print per-phase timings (forward, backward, step).
    pub wall_clock_breakdown: bool,
    /// Print memory use at each logging step.
    pub memory_breakdown: bool,
    /// Print the full engine state at start-up.
    pub dump_state: bool,
    pub zero: ZeroConfig,
    /// Kiln's own settings (the `kiln` section).
    pub kiln: KilnSettings,
    /// Things the user should know that are not errors: ignored logging sections, settings
    /// that override others, differences from DeepSpeed's behaviour.
    pub warnings: Vec<String>,
    /// Where each resolved value came from, keyed by its DeepSpeed key path
    /// (`"fp16.loss_scale_window"`, `"optimizer.params.lr"`, `"world_size"`). A key that
    /// is absent here counts as [`Provenance::Default`]. Only [`TrainConfig::explain`]
    /// reads it, so code that edits the fields afterwards should update it too.
    pub provenance: BTreeMap<String, Provenance>,
}

/// Kiln's own settings, from the config's `kiln` section: what DeepSpeed leaves to its
/// launcher or to the user's script. Command-line flags of `kiln train` override them.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct KilnSettings {
    /// Devices to train on, as `kiln devices` names them; empty: the best adapter.
    pub devices: Vec<String>,
    /// Threads building batches ahead of the step.
    pub data_workers: usize,
    /// Batches built ahead (the prefetch queue's bound).
    pub prefetch_depth: usize,
    /// Optimizer steps in all; `None`: the scheduler's `total_num_steps`, else 1000.
    pub steps: Option<u64>,
    /// Evaluate every this many steps (and at the end); 0: only at the end.
    pub eval_every: u64,
    /// Checkpoint every this many steps (and at the end); 0: only at the end.
    pub checkpoint_every: u64,
    /// Checkpoints kept; older ones are deleted once a newer one is complete. 0: all.
    pub keep_checkpoints: usize,
    /// Seeds the weights and the data order.
    pub seed: u64,
}

impl Default for KilnSettings {
    fn default() -> Self {
        KilnSettings {
            devices: vec![],
            data_workers: 2,
            prefetch_depth: 4,
            steps: None,
            eval_every: 50,
            checkpoint_every: 200,
            keep_checkpoints: 3,
            seed: 1,
        }
    }
}

/// Batch geometry. Invariant: `train_batch_size == micro_batch * grad_accum * world`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct BatchConfig {
    /// Samples per optimizer step over all data-parallel ranks (`train_batch_size`).
    pub train_batch_size: usize,
    /// Samples per forward/backward on one rank (`train_micro_batch_size_per_gpu`).
    pub micro_batch: usize,
    /// Micro-batches accumulated per optimizer step (`gradient_accumulation_steps`).
    pub grad_accum: usize,
    /// Data-parallel ranks; given by the caller, never read from the file.
    pub world: usize,
}

/// Arithmetic of the model's weights, activations and gradients.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub enum Precision {
    Fp32,
    Fp16 {
        loss_scaling: LossScaling,
        /// DeepSpeed's `fp16.auto_cast`: cast floating-point model inputs to fp16.
        auto_cast: bool,
    },
    /// bf16 has fp32's exponent range, so it needs no loss scaling.
    Bf16,
}

/// How the fp16 loss is scaled before backward.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub enum LossScaling {
    /// `fp16.loss_scale == 0`: the scale adapts to overflows.
    Dynamic(DynamicScaling),
    /// `fp16.loss_scale > 0`: this fixed scale.
    Static(f32),
}

/// Shape of the warmup ramp.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub enum WarmupType {
    /// `gamma = ln(s + 1) / ln(N)`: fast at first, DeepSpeed's default.
    Log,
    /// `gamma = s / N`.
    Linear,
}

/// Learning rate as a function of the optimizer step, with DeepSpeed's formulas.
///
/// In every variant the effective warmup length is `N = max(2, warmup_steps)`, as in
/// DeepSpeed (which avoids dividing by `ln(1) = 0`).
#[derive(Clone, Debug, PartialEq, Serialize)]
pub enum Schedule {
    /// No `scheduler` section: the optimizer's lr at every step.
    Constant { lr: f32 },
    /// Ramp from `min_lr` to `max_lr` over the warmup, then stay at `max_lr`. `max_lr`
    /// replaces the optimizer's lr, as in DeepSpeed.
    WarmupLr {
        min_lr: f32,
        max_lr: f32,
        warmup_steps: u64,
        warmup_type: WarmupType,
    },
    /// WarmupLR, then linear decay to `min_lr` at `total_steps`.
    WarmupDecayLr {
        min_lr: f32,
        max_lr: f32,
        warmup_steps: u64,
        total_steps: u64,
        warmup_type: WarmupType,
    },
    /// `base_lr` (the optimizer's lr) times a ratio that warms up from
    /// `warmup_min_ratio` to 1, then follows a half cosine down to `cos_min_ratio`.
    WarmupCosineLr {
        base_lr: f32,
        warmup_min_ratio: f32,
        warmup_steps: u64,
        total_steps: u64,
        cos_min_ratio: f32,
        warmup_type: WarmupType,
    },
}

/// Warmup progress in [0, 1] at step `s`, with `N = max(2, warmup_steps)`.
fn warmup_gamma(s: u64, warmup_steps: u64, warmup_type: WarmupType) -> f64 {
    let n = warmup_steps.max(2);
    if s >= n {
        return 1.0;
    }
    match warmup_type {
        WarmupType::Log => ((s + 1) as f64).ln() / (n as f64).ln(),
        WarmupType::Linear => s as f64 / n as f64,
    }
}

impl Schedule {
    /// The learning rate for the optimizer step that follows `step` applied steps
    /// (0 for the first step). Steps skipped for fp16 overflow do not count, so the
    /// trainer passes its count of applied steps, not of attempted ones.
    pub fn lr_at(&self, step: u64) -> f32 {
        let s = step;
        let lr = match *self {
            Schedule::Constant { lr } => lr as f64,
            Schedule::WarmupLr {
                min_lr,
                max_lr,
                warmup_steps,
                warmup_type,
            } => {
                let g = warmup_gamma(s, warmup_steps, warmup_type);
                min_lr as f64 + (max_lr as f64 - min_lr as f64) * g
            }
            Schedule::WarmupDecayLr {
                min_lr,
                max_lr,
                warmup_steps,
                total_steps,
                warmup_type,
            } => {
                let n = warmup_steps.max(2);
                let g = if s < n {
                    warmup_gamma(s, warmup_steps, warmup_type)
                } else {
                    let span = (total_steps as f64 - n as f64).max(1.0);
                    ((total_steps as f64 - s as f64) / span).max(0.0)
                };
                min_lr as f64 + (max_lr as f64 - min_lr as f64) * g
            }
            Schedule::WarmupCosineLr {
                base_lr,
                warmup_min_ratio,
                warmup_steps,
                total_steps,
                cos_min_ratio,
                warmup_type,
            } => {
                let n = warmup_steps.max(2);
                let ratio = if s < n {
                    let g = warmup_gamma(s, warmup_steps, warmup_type);
                    warmup_min_ratio as f64 + g * (1.0 - warmup_min_ratio as f64)
                } else {
                    let span = (total_steps as f64 - n as f64).max(1.0);
                    // Clamped at the end of the run: past total_steps the cosine would
                    // climb back up, which no one wants from a decay schedule.
                    let x = ((s - n + 1) as f64 / span).min(1.0);
                    let c = cos_min_ratio as f64;
                    (c + (1.0 - c) * (1.0 + (std::f64::consts::PI * x).cos()) / 2.0).max(0.0)
                };
                base_lr as f64 * ratio
            }
        };
        lr as f32
    }
}

/// ZeRO data-parallel sharding (DeepSpeed's `zero_optimization`), stages 0 to 2.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct ZeroConfig {
    /// 0: plain data parallel; 1: optimizer states sharded; 2: gradients too.
    pub stage: u8,
    /// Copy gradients into one contiguous buffer as they are produced.
    pub contiguous_gradients: bool,
    /// Reduce gradients with reduce-scatter rather than all-reduce.
    pub reduce_scatter: bool,
    /// Elements reduced per bucket.
    pub reduce_bucket_size: u64,
    /// Gather updated parameter shards with all-gather.
    pub allgather_partitions: bool,
    /// Elements gathered per bucket.
    pub allgather_bucket_size: u64,
    /// Overlap gradient communication with backward.
    pub overlap_comm: bool,
    /// Spread gradient copies over ranks round-robin.
    pub round_robin_gradients: bool,
}

impl Default for ZeroConfig {
    /// DeepSpeed's defaults for stages 0 to 2.
    fn default() -> Self {
        ZeroConfig {
            stage: 0,
            contiguous_gradients: true,
            reduce_scatter: true,
            reduce_bucket_size: 500_000_000,
            allgather_partitions: true,
            allgather_bucket_size: 500_000_000,
            overlap_comm: false,
            round_robin_gradients: false,
        }
    }
}

const DEFAULT_LR: f64 = 1e-3;
const DEFAULT_BETAS: [f32; 2] = [0.9, 0.999];
const DEFAULT_EPS: f64 = 1e-8;

fn default_optimizer() -> Optimizer {
    Optimizer::Adam {
        lr: DEFAULT_LR as f32,
        betas: DEFAULT_BETAS,
        eps: DEFAULT_EPS as f32,
        weight_decay: 0.0,
        decoupled: true,
    }
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
            memory_breakdown: false,
            dump_state: false,
            zero: ZeroConfig::default(),
            kiln: KilnSettings::default(),
            warnings: Vec::new(),
            provenance,
        }
    }

    /// Every resolved setting, one per line as `key.path = value (origin)`, where origin
    /// is `(default)`, `(file)`, `(caller)` or `(inferred: how)`; then one
    /// `warning: ...` line per warning. Meant to be printed at start-up so users can see
    /// what DeepSpeed's implicit rules made of their file.
    pub fn explain(&self) -> String {
        let mut out = String::new();
        let mut line = |key: &str, value: String| {
            let origin = self
                .provenance
                .get(key)
                .cloned()
                .unwrap_or(Provenance::Default);
            let _ = writeln!(out, "{key} = {value} {origin}");
        };
        let b = &self.batch;
        line("world_size", b.world.to_string());
        line("train_batch_size", b.train_batch_size.to_string());
        line("train_micro_batch_size_per_gpu", b.micro_batch.to_string());
        line("gradient_accumulation_steps", b.grad_accum.to_string());

        let (fp16, bf16) = match self.precision {
            Precision::Fp32 => (false, false),
            Precision::Fp16 { .. } => (true, false),
            Precision::Bf16 => (false, true),
        };
        line("fp16.enabled", fp16.to_string());
        line("bf16.enabled", bf16.to_string());
        if let Precision::Fp16 {
            loss_scaling,
            auto_cast,
        } = &self.precision
        {
            line("fp16.auto_cast", auto_cast.to_string());
            match loss_scaling {
                LossScaling::Static(scale) => line("fp16.loss_scale", format!("{scale:?}")),
                LossScaling::Dynamic(d) => {
                    line("fp16.loss_scale", "0 (dynamic)".to_string());
                    line(
                        "fp16.initial_scale_power",
                        d.initial_scale_power.to_string(),
                    );
                    line("fp16.loss_scale_window", d.window.to_string());
                    line("fp16.hysteresis", d.hysteresis.to_string());
                    line(
                        "fp16.consecutive_hysteresis",
                        d.consecutive_hysteresis.to_string(),
                    );
                    line("fp16.min_loss_scale", format!("{:?}", d.min_scale));
                }
            }
        }

        match &self.optimizer {
            Optimizer::Adam {
                lr,
                betas,
                eps,
                weight_decay,
                decoupled,
            } => {
                let name = if *decoupled { "AdamW" } else { "Adam" };
                line("optimizer.type", name.to_string());
                line("optimizer.params.lr", format!("{lr:?}"));
                line(
                    "optimizer.params.betas",
                    format!("[{:?}, {:?}]", betas[0], betas[1]),
                );
                line("optimizer.params.eps", format!("{eps:?}"));
                line("optimizer.params.weight_decay", format!("{weight_decay:?}"));
                line("optimizer.params.adam_w_mode", decoupled.to_string());
            }
            Optimizer::Sgd {
                lr,
                momentum,
                weight_decay,
            } => {
                line("optimizer.type", "SGD".to_string());
                line("optimizer.params.lr", format!("{lr:?}"));
                line("optimizer.params.momentum", format!("{momentum:?}"));
                line("optimizer.params.weight_decay", format!("{weight_decay:?}"));
            }
        }

        let p = "scheduler.params.";
        let wt = |t: &WarmupType| match t {
            WarmupType::Log => "log".to_string(),
            WarmupType::Linear => "linear".to_string(),
        };
        match &self.schedule {
            Schedule::Constant { lr } => {
                line("scheduler.type", format!("none (constant lr {lr:?})"));
            }
            Schedule::WarmupLr {
                min_lr,
                max_lr,
                warmup_steps,
                warmup_type,
            } => {
                line("scheduler.type", "WarmupLR".to_string());
                line(&format!("{p}warmup_min_lr"), format!("{min_lr:?}"));
                line(&format!("{p}warmup_max_lr"), format!("{max_lr:?}"));
                line(&format!("{p}warmup_num_steps"), warmup_steps.to_string());
                line(&format!("{p}warmup_type"), wt(warmup_type));
            }
            Schedule::WarmupDecayLr {
                min_lr,
                max_lr,
                warmup_steps,
                total_steps,
                warmup_type,
            } => {
                line("scheduler.type", "WarmupDecayLR".to_string());
                line(&format!("{p}warmup_min_lr"), format!("{min_lr:?}"));
                line(&format!("{p}warmup_max_lr"), format!("{max_lr:?}"));
                line(&format!("{p}warmup_num_steps"), warmup_steps.to_string());
                line(&format!("{p}total_num_steps"), total_steps.to_string());
                line(&format!("{p}warmup_type"), wt(warmup_type));
            }
            Schedule::WarmupCosineLr {
                base_lr: _,
                warmup_min_ratio,
                warmup_steps,
                total_steps,
                cos_min_ratio,
                warmup_type,
            } => {
                line("scheduler.type", "WarmupCosineLR".to_string());
                line(
                    &format!("{p}warmup_min_ratio"),
                    format!("{warmup_min_ratio:?}"),
                );
                line(&format!("{p}warmup_num_steps"), warmup_steps.to_string());
                line(&format!("{p}total_num_steps"), total_steps.to_string());
                line(&format!("{p}cos_min_ratio"), format!("{cos_min_ratio:?}"));
                line(&format!("{p}warmup_type"), wt(warmup_type));
            }
        }

        line("gradient_clipping", format!("{:?}", self.gradient_clipping));
        line("steps_per_print", self.steps_per_print.to_string());
        line(
            "wall_clock_breakdown",
            self.wall_clock_breakdown.to_string(),
        );
        line("memory_breakdown", self.memory_breakdown.to_string());
        line("dump_state", self.dump_state.to_string());

        let z = &self.zero;
        let zp = "zero_optimization.";
        line(&format!("{zp}stage"), z.stage.to_string());
        line(
            &format!("{zp}contiguous_gradients"),
            z.contiguous_gradients.to_string(),
        );
        line(&format!("{zp}reduce_scatter"), z.reduce_scatter.to_string());
        line(
            &format!("{zp}reduce_bucket_size"),
            z.reduce_bucket_size.to_string(),
        );
        line(
            &format!("{zp}allgather_partitions"),
            z.allgather_partitions.to_string(),
        );
        line(
            &format!("{zp}allgather_bucket_size"),
            z.allgather_bucket_size.to_string(),
        );
        line(&format!("{zp}overlap_comm"), z.overlap_comm.to_string());
        line(
            &format!("{zp}round_robin_gradients"),
            z.round_robin_gradients.to_string(),
        );

        let k = &self.kiln;
        line("kiln.devices", format!("{:?}", k.devices));
        line("kiln.data_workers", k.data_workers.to_string());
        line("kiln.prefetch_depth", k.prefetch_depth.to_string());
        line(
            "kiln.steps",
            k.steps
                .map_or("(scheduler total_num_steps, else 1000)".into(), |n| {
                    n.to_string()
                }),
        );
        line("kiln.eval_every", k.eval_every.to_string());
        line("kiln.checkpoint_every", k.checkpoint_every.to_string());
        line("kiln.keep_checkpoints", k.keep_checkpoints.to_string());
        line("kiln.seed", k.seed.to_string());

        for w in &self.warnings {
            let _ = writeln!(out, "warning: {w}");
        }
        out
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
        });
    };
    resolve(&root, world)
}

/// Reads and resolves a DeepSpeed config file; errors name the file.
pub fn load(path: &Path, world: usize) -> Result<TrainConfig, ConfigError> {
    let text = std::fs::read_to_string(path).map_err(|e| ConfigError {
        file: Some(path.to_path_buf()),
        problems: vec![Problem {
            path: String::new(),
            message: format!("cannot read the file: {e}"),
            fix: "check the path and its permissions".to_string(),
        }],
    })?;
    parse(&text, world).map_err(|mut e| {
        e.file = Some(path.to_path_buf());
        e
    })
}

// ---------------------------------------------------------------------------------------
// Key tables
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
        "memory_breakdown",
        "dump_state",
        "zero_optimization",
        "kiln",
    ],
    ignored: ignored::TOP_LEVEL,
    unsupported: unsupported::TOP_LEVEL,
    hints: suggest::MISPLACED,
};

const FP16_KEYS: &[&str] = &[
    "enabled",
    "auto_cast",
    "loss_scale",
    "initial_scale_power",
    "loss_scale_window",
    "hysteresis",
    "consecutive_hysteresis",
    "min_loss_scale",
];

/// fp16 keys that only matter to the dynamic scaler.
const DYNAMIC_KEYS: &[&str] = &[
    "initial_scale_power",
    "loss_scale_window",
    "hysteresis",
    "consecutive_hysteresis",
    "min_loss_scale",
];

const KILN: Spec = Spec::keys(&[
    "devices",
    "data_workers",
    "prefetch_depth",
    "steps",
    "eval_every",
    "checkpoint_every",
    "keep_checkpoints",
    "seed",
]);

const STAGE3_ONLY: &str = "it is only used by ZeRO stage 3";

const ZERO: Spec = Spec {
    keys: &[
        "stage",
        "contiguous_gradients",
        "reduce_scatter",
        "reduce_bucket_size",
        "allgather_partitions",
        "allgather_bucket_size",
        "overlap_comm",
        "round_robin_gradients",
    ],
    ignored: &[
        ("stage3_prefetch_bucket_size", STAGE3_ONLY),
        ("stage3_param_persistence_threshold", STAGE3_ONLY),
        ("stage3_model_persistence_threshold", STAGE3_ONLY),
        ("stage3_max_live_parameters", STAGE3_ONLY),
        ("stage3_max_reuse_distance", STAGE3_ONLY),
        ("stage3_gather_16bit_weights_on_model_save", STAGE3_ONLY),
        ("stage3_gather_fp16_weights_on_model_save", STAGE3_ONLY),
        ("stage3_use_all_reduce_for_fetch_params", STAGE3_ONLY),
        ("stage3_module_granularity_threshold", STAGE3_ONLY),
        ("sub_group_size", STAGE3_ONLY),
    ],
    unsupported: &[
        (
            "offload_optimizer",
            Inert::NoOffload,
            "offloading optimizer state to CPU or NVMe (not yet)",
        ),
        (
            "offload_param",
            Inert::NoOffload,
            "offloading parameters to CPU or NVMe (not yet)",
        ),
        (
            "cpu_offload",
            Inert::Bool(false),
            "offloading optimizer state to CPU (not yet)",
        ),
        (
            "cpu_offload_params",
            Inert::Bool(false),
            "offloading parameters to CPU (not yet)",
        ),
        (
            "elastic_checkpoint",
            Inert::Bool(false),
            "elastic ZeRO checkpoints",
        ),
        (
            "load_from_fp32_weights",
            Inert::Bool(true),
            "resuming from 16-bit weights instead of the fp32 master copy",
        ),
        (
            "ignore_unused_parameters",
            Inert::Bool(true),
            "failing on parameters that receive no gradient",
        ),
        (
            "zero_quantized_weights",
            Inert::Bool(false),
            "quantized weight communication (ZeRO++)",
        ),
        (
            "zero_quantized_nontrainable_weights",
            Inert::Bool(false),
            "quantized weight communication (ZeRO++)",
        ),
        (
            "zero_quantized_gradients",
            Inert::Bool(false),
            "quantized gradient communication (ZeRO++)",
        ),
        (
            "zero_hpz_partition_size",
            Inert::Num(1.0),
            "hierarchical partitioning (ZeRO++)",
        ),
        ("mics_shard_size", Inert::Num(-1.0), "MiCS sharding"),
        ("legacy_stage1", Inert::Bool(false), "legacy ZeRO stage 1"),
    ],
    hints: &[],
};

const ADAM_IGNORED: &[(&str, &str)] = &[
    (
        "torch_adam",
        "it selects DeepSpeed's PyTorch Adam over its fused kernel; Kiln has one Adam kernel, \
         so it is a no-op",
    ),
    (
        "fused",
        "it selects a fused Adam kernel; Kiln's Adam is always one fused launch, so it is a no-op",
    ),
];

const ADAM_UNSUPPORTED: &[(&str, Inert, &str)] = &[
    ("amsgrad", Inert::Bool(false), "AMSGrad"),
    (
        "bias_correction",
        Inert::Bool(true),
        "Adam without bias correction",
    ),
];

const SUPPORTED_OPTIMIZERS: &str = "Adam, AdamW, SGD";

/// Optimizer types DeepSpeed knows that Kiln does not implement.
const OTHER_OPTIMIZERS: &[&str] = &[
    "Lamb",
    "OneBitAdam",
    "OneBitLamb",
    "ZeroOneAdam",
    "Adagrad",
    "Lion",
    "MuAdam",
    "MuAdamW",
    "MuSGD",
    "Adafactor",
];

const SCHEDULERS: &[&str] = &["WarmupLR", "WarmupDecayLR", "WarmupCosineLR"];
const OTHER_SCHEDULERS: &[&str] = &["OneCycle", "LRRangeTest"];

const SCHED_UNSUPPORTED: &[(&str, Inert, &str)] = &[(
    "last_batch_iteration",
    Inert::Num(-1.0),
    "starting the schedule at a given step (Kiln resumes it from the checkpoint)",
)];

impl Reader {
    // -----------------------------------------------------------------------------------
    // Sections
    // -----------------------------------------------------------------------------------

    fn batch(&mut self, root: &Map<String, Value>, world: usize) -> BatchConfig {
        const B: &str = "train_batch_size";
        const M: &str = "train_micro_batch_size_per_gpu";
        const G: &str = "gradient_accumulation_steps";
        let max = usize::MAX as u64;
        let b = self.uint(root, "", B, 1, max, None);
        let m = self.uint(root, "", M, 1, max, None);
        let g = self.uint(root, "", G, 1, max, None);
        self.mark("world_size", Provenance::Caller);
        let failed = BatchConfig {
            train_batch_size: 0,
            micro_batch: 0,
            grad_accum: 0,
            world,
        };
        if world == 0 {
            self.problem(
                "world_size",
                "the data-parallel world size passed by the program is 0",
                "pass the number of data-parallel ranks (1 for a single GPU)",
            );
            return failed;
        }
        let (Ok(b), Ok(m), Ok(g)) = (b, m, g) else {
            return failed;
        };
        let w = world as u64;
        for (key, v) in [(B, b), (M, m), (G, g)] {
            if v.is_some() {
                self.mark(key, Provenance::File);
            }
        }
        // Products in u128: three usizes cannot overflow it.
        let prod = |xs: &[u64]| xs.iter().map(|&x| x as u128).product::<u128>();
        let (b, m, g): (u128, u128, u128) = match (b, m, g) {
            (Some(b), Some(m), Some(g)) => {
                let want = prod(&[m, g, w]);
                if b as u128 != want {
                    let mut fixes = vec![format!("set {B} to {want}")];
                    if (b as u128).is_multiple_of(prod(&[m, w])) {
                        fixes.push(format!("set {G} to {}", b as u128 / prod(&[m, w])));
                    }
                    if (b as u128).is_multiple_of(prod(&[g, w])) {
                        fixes.push(format!("set {M} to {}", b as u128 / prod(&[g, w])));
                    }
                    fixes.push("remove one of the three keys and let Kiln infer it".to_string());
                    self.problem(
                        B,
                        format!(
                            "{B} {b} != {M} {m} × {G} {g} × world size {w} = {want} \
                             ({B} must be the product of the other three)"
                        ),
                        fixes.join(", or "),
                    );
                    return failed;
                }
                (b as u128, m as u128, g as u128)
            }
            (Some(b), Some(m), None) => {
                let Some(g) = self.divide(b, &[(M, m), ("world size", w)], G) else {
                    return failed;
                };
                self.mark(
                    G,
                    Provenance::Inferred(format!("{B} / ({M} × world size) = {b} / ({m} × {w})")),
                );
                (b as u128, m as u128, g)
            }
            (Some(b), None, Some(g)) => {
                let Some(m) = self.divide(b, &[("world size", w), (G, g)], M) else {
                    return failed;
                };
                self.mark(
                    M,
                    Provenance::Inferred(format!("{B} / (world size × {G}) = {b} / ({w} × {g})")),
                );
                (b as u128, m, g as u128)
            }
            (None, Some(m), Some(g)) => {
                self.mark(
                    B,
                    Provenance::Inferred(format!("{M} × {G} × world size = {m} × {g} × {w}")),
                );
                (prod(&[m, g, w]), m as u128, g as u128)
            }
            (Some(b), None, None) => {
                let Some(m) = self.divide(b, &[("world size", w)], M) else {
                    return failed;
                };
                self.mark(G, Provenance::Inferred(format!("1 when only {B} is set")));
                self.mark(
                    M,
                    Provenance::Inferred(format!("{B} / world size = {b} / {w}")),
                );
                (b as u128, m, 1)
            }
            (None, Some(m), None) => {
                self.mark(G, Provenance::Inferred(format!("1 when only {M} is set")));
                self.mark(
                    B,
                    Provenance::Inferred(format!("{M} × world size = {m} × {w}")),
                );
                (prod(&[m, w]), m as u128, 1)
            }
            (None, None, _) => {
                self.problem(
                    B,
                    format!("neither {B} nor {M} is set, so the batch size is unknown"),
                    format!(
                        "set {M} (samples per forward/backward on one GPU); Kiln then infers \
                         {B} = {M} × {G} × world size"
                    ),
                );
                return failed;
            }
        };
        let fits = |x: u128| usize::try_from(x).ok();
        match (fits(b), fits(m), fits(g)) {
            (Some(b), Some(m), Some(g)) => BatchConfig {
                train_batch_size: b,
                micro_batch: m,
                grad_accum: g,
                world,
            },
            _ => {
                self.problem(
                    B,
                    format!("{B} {b} does not fit in this machine's integers"),
                    "use smaller batch sizes",
                );
                failed
            }
        }
    }

    /// `total / product(factors)`, or a problem when it does not divide exactly: rounding
    /// down would silently drop samples from every step, rounding up would add some.
    fn divide(&mut self, total: u64, factors: &[(&str, u64)], inferred: &str) -> Option<u128> {
        const B: &str = "train_batch_size";
        let d: u128 = factors.iter().map(|&(_, x)| x as u128).product();
        let t = total as u128;
        let shown = factors
            .iter()
            .map(|(name, x)| format!("{name} {x}"))
            .collect::<Vec<_>>()
            .join(" × ");
        if t.is_multiple_of(d) {
            return Some(t / d);
        }
        let lower = t / d * d;
        let upper = lower + d;
        let q = t / d;
        let consequence = if q == 0 {
            format!("{inferred} would be 0")
        } else {
            format!(
                "{inferred} would be {t} / {d} = {q} rounded down, silently dropping {} sample(s) \
                 from every step",
                t - lower
            )
        };
        let choices = if lower > 0 {
            format!("{lower} or {upper}")
        } else {
            upper.to_string()
        };
        self.problem(
            B,
            format!("{B} {t} is not a multiple of {shown} = {d}: {consequence}"),
            format!("set {B} to a multiple of {d} such as {choices}, or set {inferred} explicitly"),
        );
        None
    }

    fn precision(&mut self, root: &Map<String, Value>) -> (Precision, bool) {
        let empty = Map::new();
        let fp16 = self.section(root, "", "fp16").ok().flatten();
        if let Some(f) = fp16 {
            self.check_keys(f, "fp16", &Spec::keys(FP16_KEYS));
        }
        let f = fp16.unwrap_or(&empty);
        let p = "fp16";
        let fp16_on = self.bool_or(f, p, "enabled", false);
        let auto_cast = self.bool_or(f, p, "auto_cast", false);
        let loss_scale = self.float_or(f, p, "loss_scale", Range::AtLeast(0.0), 0.0);
        let power = self.uint_or(f, p, "initial_scale_power", (0, 127), 16) as u32;
        let window = self.uint_or(f, p, "loss_scale_window", (1, u64::MAX), 1000);
        let hysteresis = self.uint_or(f, p, "hysteresis", (1, u32::MAX as u64), 2) as u32;
        let consecutive = self.bool_or(f, p, "consecutive_hysteresis", false);
        let min_scale = self.float_or(f, p, "min_loss_scale", Range::Above(0.0), 1.0);

        let bf16_key = match (root.contains_key("bf16"), root.contains_key("bfloat16")) {
            (true, true) => {
                self.problem(
                    "bfloat16",
                    "both \"bf16\" and its old name \"bfloat16\" are present",
                    "keep only \"bf16\"",
                );
                "bf16"
            }
            (false, true) => "bfloat16",
            _ => "bf16",
        };
        let bf16 = self.section(root, "", bf16_key).ok().flatten();
        if let Some(b) = bf16 {
            self.check_keys(b, bf16_key, &Spec::keys(&["enabled"]));
        }
        let bf16_on = self.bool_or(bf16.unwrap_or(&empty), bf16_key, "enabled", false);
        if bf16_key == "bfloat16" {
            if let Some(p) = self.provenance.remove("bfloat16.enabled") {
                self.mark("bf16.enabled", p);
            }
        }

        if fp16_on && bf16_on {
            self.problem(
                "fp16.enabled",
                "fp16 and bf16 are both enabled; a run uses one 16-bit format",
                "set one of fp16.enabled / bf16.enabled to false (bf16 needs no loss scaling \
                 where the GPU supports it; fp16 runs everywhere)",
            );
        }
        if !fp16_on {
            let precision = if bf16_on {
                Precision::Bf16
            } else {
                Precision::Fp32
            };
            return (precision, false);
        }
        let dynamic_given: Vec<&str> = DYNAMIC_KEYS
            .iter()
            .copied()
            .filter(|k| f.get(*k).is_some_and(|v| !v.is_null()))
            .collect();
        if loss_scale > 0.0 {
            if !dynamic_given.is_empty() {
                self.warnings.push(format!(
                    "fp16.loss_scale {loss_scale} selects a static loss scale, so these dynamic \
                     loss-scale settings have no effect: {}",
                    dynamic_given
                        .iter()
                        .map(|k| format!("fp16.{k}"))
                        .collect::<Vec<_>>()
                        .join(", ")
                ));
            }
            let scaling = LossScaling::Static(loss_scale as f32);
            return (
                Precision::Fp16 {
                    loss_scaling: scaling,
                    auto_cast,
                },
                false,
            );
        }
        let initial = 2f64.powi(power as i32);
        if min_scale > initial {
            self.problem(
                "fp16.min_loss_scale",
                format!(
                    "min_loss_scale {min_scale} is above the initial scale 2^{power} = {initial}"
                ),
                "lower fp16.min_loss_scale or raise fp16.initial_scale_power",
            );
        }
        let scaling = LossScaling::Dynamic(DynamicScaling {
            initial_scale_power: power,
            window,
            hysteresis,
            consecutive_hysteresis: consecutive,
            min_scale: min_scale as f32,
        });
        let bare = dynamic_given.is_empty();
        (
            Precision::Fp16 {
                loss_scaling: scaling,
                auto_cast,
            },
            bare,
        )
    }

    fn optimizer(&mut self, root: &Map<String, Value>) -> (Optimizer, bool) {
        let fallback = (default_optimizer(), false);
        let sec = match self.section(root, "", "optimizer") {
            Ok(Some(s)) => s,
            Ok(None) => return fallback,
            Err(Bad) => return fallback,
        };
        self.check_keys(sec, "optimizer", &Spec::keys(&["type", "params"]));
        let ty = match self.string(sec, "optimizer", "type", "an optimizer name") {
            Ok(Some(t)) => t,
            Ok(None) => {
                self.problem(
                    "optimizer.type",
                    "the optimizer section has no \"type\"",
                    format!("add \"type\": \"AdamW\" (supported: {SUPPORTED_OPTIMIZERS})"),
                );
                return fallback;
            }
            Err(Bad) => return fallback,
        };
        #[derive(PartialEq)]
        enum Kind {
            Adam,
            AdamW,
            Sgd,
        }
        // Case-insensitive, as DeepSpeed compares lower-cased names.
        let kind = match ty.to_ascii_lowercase().as_str() {
            "adam" => Kind::Adam,
            "adamw" => Kind::AdamW,
            "sgd" => Kind::Sgd,
            _ => {
                let known = OTHER_OPTIMIZERS.iter().any(|o| o.eq_ignore_ascii_case(ty));
                let fix = match suggest(ty, ["Adam", "AdamW", "SGD"]) {
                    Some(s) if !known => format!("did you mean \"{s}\"?"),
                    _ => format!("use one of {SUPPORTED_OPTIMIZERS}"),
                };
                self.problem(
                    "optimizer.type",
                    format!(
                        "optimizer type \"{ty}\" is not supported by Kiln; supported: \
                         {SUPPORTED_OPTIMIZERS}"
                    ),
                    fix,
                );
                return fallback;
            }
        };
        self.mark("optimizer.type", Provenance::File);
        let empty = Map::new();
        let params = self.section(sec, "optimizer", "params").ok().flatten();
        let pp = "optimizer.params";
        let p = params.unwrap_or(&empty);
        if kind == Kind::Sgd {
            if let Some(params) = params {
                self.check_keys(
                    params,
                    pp,
                    &Spec {
                        keys: &["lr", "momentum", "weight_decay"],
                        ignored: &[],
                        unsupported: &[
                            ("dampening", Inert::Num(0.0), "SGD dampening"),
                            ("nesterov", Inert::Bool(false), "Nesterov momentum"),
                        ],
                        hints: &[],
                    },
                );
            }
            let lr_given = p.get("lr").is_some_and(|v| !v.is_null());
            let lr = self.float_or(p, pp, "lr", Range::AtLeast(0.0), DEFAULT_LR) as f32;
            let momentum = self.float_or(p, pp, "momentum", Range::HalfOpen(0.0, 1.0), 0.0) as f32;
            let weight_decay =
                self.float_or(p, pp, "weight_decay", Range::AtLeast(0.0), 0.0) as f32;
            let sgd = Optimizer::Sgd {
                lr,
                momentum,
                weight_decay,
            };
            return (sgd, lr_given);
        }

        if let Some(params) = params {
            self.check_keys(
                params,
                pp,
                &Spec {
                    keys: &["lr", "betas", "eps", "weight_decay", "adam_w_mode"],
                    ignored: ADAM_IGNORED,
                    unsupported: ADAM_UNSUPPORTED,
                    hints: &[
                        ("beta1", "write \"betas\": [beta1, beta2]"),
                        ("beta2", "write \"betas\": [beta1, beta2]"),
                    ],
                },
            );
        }
        let lr_given = p.get("lr").is_some_and(|v| !v.is_null());
        let lr = self.float_or(p, pp, "lr", Range::AtLeast(0.0), DEFAULT_LR) as f32;
        let betas = self.betas(p, pp);
        let eps = self.float_or(p, pp, "eps", Range::Above(0.0), DEFAULT_EPS) as f32;
        // torch.optim.AdamW's default decay; DeepSpeed's Adam (and torch's) default is 0.
        let wd_default = if kind == Kind::AdamW { 0.01 } else { 0.0 };
        let weight_decay =
            self.float_or(p, pp, "weight_decay", Range::AtLeast(0.0), wd_default) as f32;
        let mode_path = "optimizer.params.adam_w_mode";
        let decoupled = match (&kind, self.boolean(p, pp, "adam_w_mode", Some(true))) {
            (Kind::AdamW, Ok(Some(false))) => {
                self.problem(
                    mode_path,
                    "adam_w_mode false contradicts type \"AdamW\" (DeepSpeed silently keeps \
                     AdamW's decoupled decay)",
                    "remove adam_w_mode, or use type \"Adam\" with adam_w_mode false for L2 \
                     regularisation added to the gradient",
                );
                true
            }
            (Kind::AdamW, _) => {
                self.mark(mode_path, Provenance::Inferred("type AdamW".to_string()));
                true
            }
            (_, Ok(Some(m))) => {
                self.mark(mode_path, Provenance::File);
                m
            }
            (_, _) => {
                self.mark(mode_path, Provenance::Default);
                true
            }
        };
        if kind == Kind::Adam && decoupled {
            self.mark(
                "optimizer.type",
                Provenance::Inferred(
                    "type Adam with adam_w_mode true (DeepSpeed's default) is AdamW".to_string(),
                ),
            );
        }
        let adam = Optimizer::Adam {
            lr,
            betas,
            eps,
            weight_decay,
            decoupled,
        };
        (adam, lr_given)
    }

    fn betas(&mut self, p: &Map<String, Value>, prefix: &str) -> [f32; 2] {
        let path = join(prefix, "betas");
        let expected = "an array of two numbers in [0, 1), like [0.9, 0.999]";
        let default = Some("[0.9, 0.999]");
        let v = match self.raw(p, &path, "betas", expected, default) {
            Ok(Some(v)) => v,
            _ => {
                self.mark(&path, Provenance::Default);
                return DEFAULT_BETAS;
            }
        };
        let parsed = v.as_array().filter(|a| a.len() == 2).and_then(|a| {
            let b0 = a[0].as_f64()?;
            let b1 = a[1].as_f64()?;
            let ok = |b: f64| (0.0..1.0).contains(&b);
            (ok(b0) && ok(b1)).then_some([b0 as f32, b1 as f32])
        });
        match parsed {
            Some(b) => {
                self.mark(&path, Provenance::File);
                b
            }
            None => {
                self.wrong_value(&path, expected, v, default);
                DEFAULT_BETAS
            }
        }
    }

    fn warmup_type(&mut self, p: &Map<String, Value>, prefix: &str) -> WarmupType {
        let path = join(prefix, "warmup_type");
        let got = self.string(p, prefix, "warmup_type", "\"log\" or \"linear\"");
        match got {
            Ok(Some("log")) => {
                self.mark(&path, Provenance::File);
                WarmupType::Log
            }
            Ok(Some("linear")) => {
                self.mark(&path, Provenance::File);
                WarmupType::Linear
            }
            Ok(Some(other)) => {
                let fix = match suggest(other, ["log", "linear"]) {
                    Some(s) => format!("did you mean \"{s}\"?"),
                    None => "write \"log\" or \"linear\" (default \"log\")".to_string(),
                };
                self.problem(
                    &path,
                    format!("expected \"log\" or \"linear\", found the string \"{other}\""),
                    fix,
                );
                WarmupType::Log
            }
            _ => {
                self.mark(&path, Provenance::Default);
                WarmupType::Log
            }
        }
    }

    fn scheduler(
        &mut self,
        root: &Map<String, Value>,
        opt: &Optimizer,
        lr_given: bool,
    ) -> Schedule {
        let constant = Schedule::Constant { lr: opt.lr() };
        let sec = match self.section(root, "", "scheduler") {
            Ok(Some(s)) => s,
            _ => {
                self.mark(
                    "scheduler.type",
                    Provenance::Inferred("no scheduler section".to_string()),
                );
                return constant;
            }
        };
        self.check_keys(sec, "scheduler", &Spec::keys(&["type", "params"]));
        let ty = match self.string(sec, "scheduler", "type", "a scheduler name") {
            Ok(Some(t)) => t,
            Ok(None) => {
                self.problem(
                    "scheduler.type",
                    "the scheduler section has no \"type\"",
                    format!("add \"type\" (one of {})", SCHEDULERS.join(", ")),
                );
                return constant;
            }
            Err(Bad) => return constant,
        };
        if !SCHEDULERS.contains(&ty) {
            let other = OTHER_SCHEDULERS.contains(&ty);
            let message = if other {
                format!(
                    "scheduler \"{ty}\" is not supported by Kiln; supported: {}",
                    SCHEDULERS.join(", ")
                )
            } else {
                format!(
                    "unknown scheduler \"{ty}\" (names are case-sensitive); supported: {}",
                    SCHEDULERS.join(", ")
                )
            };
            let fix = match suggest(ty, SCHEDULERS.iter().copied()) {
                Some(s) if !other => format!("did you mean \"{s}\"?"),
                _ => format!("use one of {}", SCHEDULERS.join(", ")),
            };
            self.problem("scheduler.type", message, fix);
            return constant;
        }
        self.mark("scheduler.type", Provenance::File);
        let empty = Map::new();
        let params = self.section(sec, "scheduler", "params").ok().flatten();
        let p = params.unwrap_or(&empty);
        let pp = "scheduler.params";
        let cosine = ty == "WarmupCosineLR";
        let decay = ty == "WarmupDecayLR";
        if let Some(params) = params {
            let keys: &[&str] = if cosine {
                &[
                    "total_num_steps",
                    "warmup_min_ratio",
                    "warmup_num_steps",
                    "cos_min_ratio",
                    "warmup_type",
                ]
            } else if decay {
                &[
                    "warmup_min_lr",
                    "warmup_max_lr",
                    "warmup_num_steps",
                    "warmup_type",
                    "total_num_steps",
                ]
            } else {
                &[
                    "warmup_min_lr",
                    "warmup_max_lr",
                    "warmup_num_steps",
                    "warmup_type",
                ]
            };
            let cosine_hint = "WarmupCosineLR scales optimizer.params.lr by ratios: set the peak \
                               as optimizer.params.lr and the start as warmup_min_ratio";
            let hints: &[(&str, &str)] = if cosine {
                &[
                    ("warmup_min_lr", cosine_hint),
                    ("warmup_max_lr", cosine_hint),
                ]
            } else {
                &[(
                    "total_num_steps",
                    "WarmupLR stays at warmup_max_lr after the warmup; use WarmupDecayLR or \
                     WarmupCosineLR to decay until total_num_steps",
                )]
            };
            self.check_keys(
                params,
                pp,
                &Spec {
                    keys,
                    ignored: &[],
                    unsupported: SCHED_UNSUPPORTED,
                    hints,
                },
            );
        }
        let warmup_steps = self.uint_or(p, pp, "warmup_num_steps", (0, u64::MAX), 1000);
        let n = warmup_steps.max(2);
        if warmup_steps < 2 {
            self.warnings.push(format!(
                "scheduler.params.warmup_num_steps {warmup_steps} counts as 2 (DeepSpeed's \
                 minimum), so the first step runs at the warmup's starting rate"
            ));
        }
        let warmup_type = self.warmup_type(p, pp);
        let total = if cosine || decay {
            let t = self.uint(p, pp, "total_num_steps", 1, u64::MAX, None);
            match t {
                Ok(Some(t)) => {
                    self.mark("scheduler.params.total_num_steps", Provenance::File);
                    if t <= n {
                        self.problem(
                            "scheduler.params.total_num_steps",
                            format!(
                                "total_num_steps {t} must be greater than the warmup length \
                                 max(2, warmup_num_steps) = {n}: {ty} decays between the two"
                            ),
                            "raise total_num_steps to the number of optimizer steps in the run, \
                             or shorten warmup_num_steps",
                        );
                    }
                    t
                }
                Ok(None) => {
                    self.problem(
                        "scheduler.params.total_num_steps",
                        format!(
                            "{ty} needs total_num_steps, the length of the run in optimizer steps"
                        ),
                        "add \"total_num_steps\": <optimizer steps in the run>",
                    );
                    n + 1
                }
                Err(Bad) => n + 1,
            }
        } else {
            0
        };

        if cosine {
            let warmup_min_ratio =
                self.float_or(p, pp, "warmup_min_ratio", Range::Closed(0.0, 1.0), 0.0) as f32;
            let cos_min_ratio =
                self.float_or(p, pp, "cos_min_ratio", Range::Closed(0.0, 1.0), 1e-4) as f32;
            return Schedule::WarmupCosineLr {
                base_lr: opt.lr(),
                warmup_min_ratio,
                warmup_steps,
                total_steps: total,
                cos_min_ratio,
                warmup_type,
            };
        }

        let min_lr = self.float_or(p, pp, "warmup_min_lr", Range::AtLeast(0.0), 0.0) as f32;
        let max_given = p.get("warmup_max_lr").is_some_and(|v| !v.is_null());
        let max_lr = self.float_or(p, pp, "warmup_max_lr", Range::AtLeast(0.0), 1e-3) as f32;
        if min_lr > max_lr {
            self.problem(
                "scheduler.params.warmup_min_lr",
                format!("warmup_min_lr {min_lr:?} is above warmup_max_lr {max_lr:?}"),
                "the warmup ramps from warmup_min_lr up to warmup_max_lr: swap them",
            );
        }
        // DeepSpeed issue #7303: the optimizer's lr is silently replaced.
        if lr_given && opt.lr() != max_lr {
            let origin = if max_given { "" } else { " (its default)" };
            self.warnings.push(format!(
                "optimizer.params.lr {:?} is overridden by scheduler.params.warmup_max_lr \
                 {max_lr:?}{origin}: {ty} ramps to warmup_max_lr and ignores the optimizer's lr, \
                 as in DeepSpeed; set warmup_max_lr to {:?} if that is the peak you meant",
                opt.lr(),
                opt.lr()
            ));
        }
        if decay {
            Schedule::WarmupDecayLr {
                min_lr,
                max_lr,
                warmup_steps,
                total_steps: total,
                warmup_type,
            }
        } else {
            Schedule::WarmupLr {
                min_lr,
                max_lr,
                warmup_steps,
                warmup_type,
            }
        }
    }

    fn kiln(&mut self, root: &Map<String, Value>) -> KilnSettings {
        let empty = Map::new();
        let sec = self.section(root, "", "kiln").ok().flatten();
        let kp = "kiln";
        if let Some(s) = sec {
            self.check_keys(s, kp, &KILN);
        }
        let k = sec.unwrap_or(&empty);
        let d = KilnSettings::default();
        let path = "kiln.devices";
        let expected = "a list of device names such as [\"vulkan:0\"] (see `kiln devices`)";
        let devices = match self.raw(k, path, "devices", expected, None) {
            Ok(Some(Value::String(s))) => {
                self.mark(path, Provenance::File);
                s.split(',').map(|d| d.trim().to_string()).collect()
            }
            Ok(Some(Value::Array(list))) if list.iter().all(Value::is_string) => {
                self.mark(path, Provenance::File);
                list.iter()
                    .filter_map(|v| v.as_str().map(str::to_string))
                    .collect()
            }
            Ok(Some(v)) => {
                self.wrong_value(path, expected, v, None);
                vec![]
            }
            _ => {
                self.mark(path, Provenance::Default);
                vec![]
            }
        };
        let steps = self.uint(k, kp, "steps", 1, u64::MAX, None);
        let steps = match steps {
            Ok(Some(n)) => {
                self.mark("kiln.steps", Provenance::File);
                Some(n)
            }
            _ => None,
        };
        let count = (1, 1024);
        KilnSettings {
            devices,
            data_workers: self.uint_or(k, kp, "data_workers", count, d.data_workers as u64)
                as usize,
            prefetch_depth: self.uint_or(k, kp, "prefetch_depth", count, d.prefetch_depth as u64)
                as usize,
            steps,
            eval_every: self.uint_or(k, kp, "eval_every", (0, u64::MAX), d.eval_every),
            checkpoint_every: self.uint_or(
                k,
                kp,
                "checkpoint_every",
                (0, u64::MAX),
                d.checkpoint_every,
            ),
            keep_checkpoints: self.uint_or(
                k,
                kp,
                "keep_checkpoints",
                (0, 1_000_000),
                d.keep_checkpoints as u64,
            ) as usize,
            seed: self.uint_or(k, kp, "seed", (0, u64::MAX), d.seed),
        }
    }

    fn zero(&mut self, root: &Map<String, Value>) -> ZeroConfig {
        let empty = Map::new();
        let sec = self.section(root, "", "zero_optimization").ok().flatten();
        let zp = "zero_optimization";
        if let Some(s) = sec {
            self.check_keys(s, zp, &ZERO);
        }
        let z = sec.unwrap_or(&empty);
        let d = ZeroConfig::default();
        let stage = self.uint_or(z, zp, "stage", (0, 3), 0) as u8;
        if stage == 3 {
            self.problem(
                "zero_optimization.stage",
                "ZeRO stage 3 (partitioned parameters) is not supported by Kiln yet",
                "use stage 2 (shards gradients and optimizer states) or stage 1",
            );
        }
        let size = (1, u64::MAX);
        ZeroConfig {
            stage,
            contiguous_gradients: self.bool_or(
                z,
                zp,
                "contiguous_gradients",
                d.contiguous_gradients,
            ),
            reduce_scatter: self.bool_or(z, zp, "reduce_scatter", d.reduce_scatter),
            reduce_bucket_size: self.uint_or(
                z,
                zp,
                "reduce_bucket_size",
                size,
                d.reduce_bucket_size,
            ),
            allgather_partitions: self.bool_or(
                z,
                zp,
                "allgather_partitions",
                d.allgather_partitions,
            ),
            allgather_bucket_size: self.uint_or(
                z,
                zp,
                "allgather_bucket_size",
                size,
                d.allgather_bucket_size,
            ),
            overlap_comm: self.bool_or(z, zp, "overlap_comm", d.overlap_comm),
            round_robin_gradients: self.bool_or(
                z,
                zp,
                "round_robin_gradients",
                d.round_robin_gradients,
            ),
        }
    }
}

fn resolve(root: &Map<String, Value>, world: usize) -> Result<TrainConfig, ConfigError> {
    let mut r = Reader::default();
    r.check_keys(root, "", &TOP);
    let batch = r.batch(root, world);
    let (precision, bare_fp16) = r.precision(root);
    let (optimizer, lr_given) = r.optimizer(root);
    let schedule = r.scheduler(root, &optimizer, lr_given);
    let gradient_clipping =
        r.float_or(root, "", "gradient_clipping", Range::AtLeast(0.0), 0.0) as f32;
    let steps_per_print = r.uint_or(root, "", "steps_per_print", (1, u64::MAX), 10);
    let wall_clock_breakdown = r.bool_or(root, "", "wall_clock_breakdown", false);
    let memory_breakdown = r.bool_or(root, "", "memory_breakdown", false);
    let dump_state = r.bool_or(root, "", "dump_state", false);
    let zero = r.zero(root);
    let kiln = r.kiln(root);
    if bare_fp16 && zero.stage >= 1 {
        r.warnings.push(
            "fp16 sets only \"enabled\": Kiln starts the dynamic loss scale at 2^16 with \
             hysteresis 2 (DeepSpeed's documented defaults), while DeepSpeed with ZeRO starts \
             such a config at 2^32 without hysteresis; set fp16.initial_scale_power 32 and \
             fp16.hysteresis 1 to reproduce DeepSpeed"
                .to_string(),
        );
    }
    if !r.problems.is_empty() {
        return Err(ConfigError {
            file: None,
            problems: r.problems,
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
        memory_breakdown,
        dump_state,
        zero,
        kiln,
        warnings: r.warnings,
        provenance: r.provenance,
    })
}
