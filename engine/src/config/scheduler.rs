//! The `scheduler` section: the learning-rate schedules WarmupLR, WarmupDecayLR and
//! WarmupCosineLR, their formulas as in DeepSpeed, and how the section is read.

use serde::Serialize;
use serde_json::{Map, Value};

use super::keys::{Inert, Spec};
use super::provenance::Provenance;
use super::reader::{auto_at, join, shorten, Bad, Range, Reader};
use super::suggest::suggest;
use crate::device::optim::Optimizer;

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

const SCHEDULERS: &[&str] = &["WarmupLR", "WarmupDecayLR", "WarmupCosineLR"];
const OTHER_SCHEDULERS: &[&str] = &["OneCycle", "LRRangeTest"];

const SCHED_UNSUPPORTED: &[(&str, Inert, &str)] = &[(
    "last_batch_iteration",
    Inert::Num(-1.0),
    "starting the schedule at a given step (Kiln resumes it from the checkpoint)",
)];

impl Reader {
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
                    format!(
                        "expected \"log\" or \"linear\", found the string \"{}\"",
                        shorten(other)
                    ),
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

    pub(super) fn scheduler(
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
            let ty = shorten(ty);
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
            let fix = match suggest(&ty, SCHEDULERS.iter().copied()) {
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
        let total_path = "scheduler.params.total_num_steps";
        // An "auto" warmup is asked for; comparing against its default would only confuse.
        let warmup_open = auto_at(p, "warmup_num_steps");
        let total = if (cosine || decay) && auto_at(p, "total_num_steps") {
            // The Trainer fills in the run's length; Kiln's is kiln.steps.
            let steps = root
                .get("kiln")
                .and_then(|k| k.get("steps"))
                .and_then(Value::as_u64)
                .filter(|&s| s >= 1);
            match steps {
                Some(t) => {
                    self.resolved_auto(total_path, format!("kiln.steps {t}"));
                    if !warmup_open {
                        self.total_after_warmup(t, n, ty);
                    }
                    t
                }
                None => {
                    self.autos
                        .push((total_path.to_string(), "an integer >= 1".to_string()));
                    n + 1
                }
            }
        } else if cosine || decay {
            let t = self.uint(p, pp, "total_num_steps", 1, u64::MAX, None);
            match t {
                Ok(Some(t)) => {
                    self.mark(total_path, Provenance::File);
                    if !warmup_open {
                        self.total_after_warmup(t, n, ty);
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

        let min_lr = if auto_at(p, "warmup_min_lr") {
            self.resolved_auto(
                "scheduler.params.warmup_min_lr",
                "0, as the Hugging Face Trainer fills it",
            );
            0.0
        } else {
            self.float_or(p, pp, "warmup_min_lr", Range::AtLeast(0.0), 0.0) as f32
        };
        let max_given = p.get("warmup_max_lr").is_some_and(|v| !v.is_null());
        let max_lr = if auto_at(p, "warmup_max_lr") {
            // The Trainer fills both from --learning_rate. When the optimizer's lr is
            // "auto" too, that one is asked for; this one follows it.
            self.resolved_auto(
                "scheduler.params.warmup_max_lr",
                format!(
                    "optimizer.params.lr {:?}, as the Hugging Face Trainer fills both from \
                     --learning_rate",
                    opt.lr()
                ),
            );
            opt.lr()
        } else {
            self.float_or(p, pp, "warmup_max_lr", Range::AtLeast(0.0), 1e-3) as f32
        };
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

    /// WarmupDecayLR and WarmupCosineLR decay between the warmup's end and
    /// `total_num_steps`, so it must come later.
    fn total_after_warmup(&mut self, t: u64, n: u64, ty: &str) {
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
    }
}
