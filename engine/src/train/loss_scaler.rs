//! Loss scaling for fp16 training, with DeepSpeed's dynamic-scaler semantics.
//!
//! fp16 gradients underflow unless the loss is multiplied by a large factor before
//! backward; the scaler picks that factor. Every step reports whether any gradient
//! overflowed (inf/NaN after unscaling); the scaler then decides:
//!
//! - **overflow**: the step is skipped (no weight, moment or LR-schedule update). If the
//!   hysteresis budget is down to its last unit (or hysteresis is 1), the scale halves,
//!   never below `min_scale`; otherwise one unit of hysteresis is spent and the scale
//!   stays. Overflowing while already at `min_scale` is an error: the run cannot make
//!   progress and should stop with a clear message rather than skip forever.
//! - **clean step**: with `consecutive_hysteresis` the budget refills at once. When
//!   `window` steps have passed since the last overflow (counting from step -1 at the
//!   start), the scale doubles (and without `consecutive_hysteresis` the budget refills
//!   only then). There is no upper cap.
//!
//! One deliberate difference from DeepSpeed: the defaults below apply whether or not the
//! config spells the sub-keys out (DeepSpeed silently starts at 2^32 with no hysteresis
//! when `fp16` holds only `enabled`).

use serde::{Deserialize, Serialize};

pub use crate::config::DynamicScaling;
use crate::{Error, Result};

/// What the trainer must do with this step's gradients.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StepDecision {
    /// Apply the optimizer step (and advance the LR schedule).
    Apply,
    /// Discard the gradients; leave weights, moments and the LR schedule untouched.
    Skip,
}

/// The scaler's whole state: what a checkpoint saves to resume bit-identically.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub enum LossScaler {
    /// A fixed scale (`fp16.loss_scale` > 0): overflow steps are still skipped.
    Static { scale: f32 },
    Dynamic {
        config: DynamicScaling,
        scale: f32,
        /// Steps seen so far (DeepSpeed's `cur_iter`).
        iter: u64,
        /// Step of the last overflow; -1 before any.
        last_overflow: i64,
        /// Overflows left before the next halving.
        hysteresis_left: u32,
    },
}

impl LossScaler {
    /// A dynamic scaler; checks the settings.
    pub fn dynamic(config: DynamicScaling) -> Result<LossScaler> {
        let bad = |m: String| Err(Error::InvalidArgument(format!("fp16 loss scaler: {m}")));
        if config.initial_scale_power > 127 {
            return bad(format!(
                "initial_scale_power {} overflows f32 (2^{} is infinite); use at most 127 (16 is typical)",
                config.initial_scale_power, config.initial_scale_power
            ));
        }
        if config.window == 0 || config.window > i64::MAX as u64 {
            return bad(format!(
                "loss_scale_window must be from 1 to {} (it counts steps in 64 bits), not {}",
                i64::MAX,
                config.window
            ));
        }
        if config.hysteresis == 0 {
            return bad(
                "hysteresis must be at least 1 (1 halves the scale on every overflow)".into(),
            );
        }
        let scale = 2f32.powi(config.initial_scale_power as i32);
        if !(config.min_scale > 0.0 && config.min_scale.is_finite()) {
            return bad(format!(
                "min_loss_scale must be a positive number, not {}",
                config.min_scale
            ));
        }
        if config.min_scale > scale {
            return bad(format!(
                "min_loss_scale {} is above the initial scale 2^{} = {scale}",
                config.min_scale, config.initial_scale_power
            ));
        }
        Ok(LossScaler::Dynamic {
            hysteresis_left: config.hysteresis,
            config,
            scale,
            iter: 0,
            last_overflow: -1,
        })
    }

    /// A fixed scale.
    pub fn fixed(scale: f32) -> Result<LossScaler> {
        if !(scale > 0.0 && scale.is_finite()) {
            return Err(Error::InvalidArgument(format!(
                "fp16 loss_scale must be a positive number (0 selects dynamic scaling), not {scale}"
            )));
        }
        Ok(LossScaler::Static { scale })
    }

    /// The factor the loss is multiplied by this step (gradients are divided by it).
    pub fn scale(&self) -> f32 {
        match self {
            LossScaler::Static { scale } | LossScaler::Dynamic { scale, .. } => *scale,
        }
    }

    /// Records this step's overflow flag and says whether to apply the step.
    pub fn update(&mut self, overflow: bool) -> Result<StepDecision> {
        let LossScaler::Dynamic {
            config,
            scale,
            iter,
            last_overflow,
            hysteresis_left,
        } = self
        else {
            return Ok(if overflow {
                StepDecision::Skip
            } else {
                StepDecision::Apply
            });
        };
        let decision = if overflow {
            if config.hysteresis == 1 || *hysteresis_left == 1 {
                if *scale <= config.min_scale {
                    return Err(Error::InvalidArgument(format!(
                        "fp16 gradients overflow even at the minimum loss scale {} (step {}, \
                         counting from 1): training is diverging or the data holds inf/NaN. Lower \
                         the learning rate, check the inputs, try bf16, or lower \
                         fp16.min_loss_scale",
                        config.min_scale,
                        *iter + 1
                    )));
                }
                *scale = (*scale / 2.0).max(config.min_scale);
            } else {
                *hysteresis_left -= 1;
            }
            *last_overflow = *iter as i64;
            StepDecision::Skip
        } else {
            if config.consecutive_hysteresis {
                *hysteresis_left = config.hysteresis;
            }
            if (*iter as i64 - *last_overflow) % config.window as i64 == 0 {
                if !config.consecutive_hysteresis {
                    *hysteresis_left = config.hysteresis;
                }
                *scale *= 2.0;
            }
            StepDecision::Apply
        };
        *iter += 1;
        Ok(decision)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn scaler(power: u32, window: u64, hysteresis: u32, consecutive: bool, min: f32) -> LossScaler {
        LossScaler::dynamic(DynamicScaling {
            initial_scale_power: power,
            window,
            hysteresis,
            consecutive_hysteresis: consecutive,
            min_scale: min,
        })
        .unwrap()
    }

    /// Feeds a pattern ('o' overflow, '.' clean) and returns the scale after each step.
    fn run(s: &mut LossScaler, pattern: &str) -> Vec<f32> {
        pattern
            .chars()
            .map(|c| {
                let d = s.update(c == 'o').unwrap();
                assert_eq!(d == StepDecision::Skip, c == 'o');
                s.scale()
            })
            .collect()
    }

    #[test]
    fn defaults_are_deepspeeds_documented_ones() {
        let s = LossScaler::dynamic(DynamicScaling::default()).unwrap();
        assert_eq!(s.scale(), 65536.0);
        let LossScaler::Dynamic {
            config,
            hysteresis_left,
            last_overflow,
            ..
        } = s
        else {
            panic!()
        };
        assert_eq!(
            (config.window, config.hysteresis, hysteresis_left),
            (1000, 2, 2)
        );
        assert!(!config.consecutive_hysteresis);
        assert_eq!((config.min_scale, last_overflow), (1.0, -1));
    }

    #[test]
    fn overflow_halves_immediately_without_hysteresis() {
        let mut s = scaler(4, 1000, 1, false, 1.0);
        assert_eq!(run(&mut s, "ooo"), [8.0, 4.0, 2.0]);
    }

    #[test]
    fn hysteresis_tolerates_overflows_before_halving() {
        // hysteresis 3: two overflows spend the budget, the third halves, and from then on
        // every overflow halves until a doubling refills the budget.
        let mut s = scaler(4, 1000, 3, false, 1.0);
        assert_eq!(run(&mut s, "ooooo"), [16.0, 16.0, 8.0, 4.0, 2.0]);
    }

    #[test]
    fn clean_steps_do_not_refill_hysteresis_until_a_doubling() {
        // window 4, hysteresis 2. Step 0 overflows (budget 2 -> 1, scale stays 16);
        // steps 1-3 are clean but (iter - 0) % 4 != 0, so no refill; step 4 is clean and
        // (4 - 0) % 4 == 0: double to 32 and refill; steps 5 and 6 overflow: the first
        // spends the budget, the second halves.
        let mut s = scaler(4, 4, 2, false, 1.0);
        assert_eq!(
            run(&mut s, "o....oo"),
            [16.0, 16.0, 16.0, 16.0, 32.0, 32.0, 16.0]
        );
        // Without a doubling in between, clean steps leave the budget spent: overflow at
        // step 0 and step 2 -> the second halves.
        let mut s = scaler(4, 4, 2, false, 1.0);
        assert_eq!(run(&mut s, "o.o"), [16.0, 16.0, 8.0]);
    }

    #[test]
    fn consecutive_hysteresis_refills_after_every_clean_step() {
        // Same pattern as above: with the budget refilled by the clean step 1, the
        // overflow at step 2 is tolerated again.
        let mut s = scaler(4, 4, 2, true, 1.0);
        assert_eq!(run(&mut s, "o.o"), [16.0, 16.0, 16.0]);
        // Two overflows in a row still halve.
        let mut s = scaler(4, 4, 2, true, 1.0);
        assert_eq!(run(&mut s, "o.oo"), [16.0, 16.0, 16.0, 8.0]);
    }

    #[test]
    fn doubling_counts_from_step_minus_one_and_from_each_overflow() {
        // No overflow yet: last_overflow = -1, so the first doubling is at iter 2 for
        // window 3 ((2 - -1) % 3 == 0), then every 3 steps, uncapped.
        let mut s = scaler(0, 3, 2, false, 1.0);
        assert_eq!(run(&mut s, "......"), [1.0, 1.0, 2.0, 2.0, 2.0, 4.0]);
        // After an overflow at iter 6 (budget spent, scale stays 4), clean steps 7, 8 do
        // not double; iter 9 does ((9 - 6) % 3 == 0).
        assert_eq!(run(&mut s, "o..."), [4.0, 4.0, 4.0, 8.0]);
    }

    #[test]
    fn the_scale_stops_at_the_minimum_and_overflowing_there_is_an_error() {
        let mut s = scaler(2, 1000, 1, false, 2.0);
        assert_eq!(run(&mut s, "o"), [2.0]);
        let e = s.update(true).unwrap_err().to_string();
        assert!(e.contains("minimum loss scale 2"), "{e}");
        assert!(e.contains("learning rate"), "{e}");
        // Halving clamps to a minimum that is not a power of two.
        let mut s = scaler(3, 1000, 1, false, 3.0);
        assert_eq!(run(&mut s, "oo"), [4.0, 3.0]);
        assert!(s.update(true).is_err());
    }

    #[test]
    fn a_static_scale_never_changes_but_still_skips_overflow_steps() {
        let mut s = LossScaler::fixed(128.0).unwrap();
        assert_eq!(s.update(true).unwrap(), StepDecision::Skip);
        assert_eq!(s.update(false).unwrap(), StepDecision::Apply);
        assert_eq!(s.scale(), 128.0);
    }

    #[test]
    fn bad_settings_are_errors() {
        let d = DynamicScaling::default;
        for (cfg, needle) in [
            (DynamicScaling { window: 0, ..d() }, "loss_scale_window"),
            // Library callers skip the config's range check: the 64-bit step count
            // arithmetic must not wrap either.
            (
                DynamicScaling {
                    window: u64::MAX,
                    ..d()
                },
                "loss_scale_window must be from 1 to 9223372036854775807",
            ),
            (
                DynamicScaling {
                    hysteresis: 0,
                    ..d()
                },
                "hysteresis",
            ),
            (
                DynamicScaling {
                    initial_scale_power: 200,
                    ..d()
                },
                "initial_scale_power",
            ),
            (
                DynamicScaling {
                    min_scale: 0.0,
                    ..d()
                },
                "min_loss_scale",
            ),
            (
                DynamicScaling {
                    min_scale: 1e9,
                    ..d()
                },
                "above the initial scale",
            ),
        ] {
            let e = LossScaler::dynamic(cfg).unwrap_err().to_string();
            assert!(e.contains(needle), "{e}");
        }
        assert!(LossScaler::fixed(-1.0).is_err());
        assert!(LossScaler::fixed(f32::INFINITY).is_err());
    }

    #[test]
    fn state_round_trips_through_json() {
        let mut s = scaler(8, 5, 2, true, 1.0);
        run(&mut s, "o..o.");
        let text = serde_json::to_string(&s).unwrap();
        let back: LossScaler = serde_json::from_str(&text).unwrap();
        assert_eq!(back, s);
    }
}
