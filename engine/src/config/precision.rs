//! The `fp16` and `bf16` sections (`bfloat16` is bf16's old name): the arithmetic of a
//! run, and for fp16 how the loss is scaled.

use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

use super::keys::{Inert, Spec};
use super::reader::{Range, Reader};

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

impl Precision {
    /// The storage dtype of weights, activations and gradients (masters are f32).
    pub fn dtype(&self) -> crate::DType {
        match self {
            Precision::Fp32 => crate::DType::F32,
            Precision::Fp16 { .. } => crate::DType::F16,
            Precision::Bf16 => crate::DType::BF16,
        }
    }

    /// As configs and logs name it: `fp32`, `fp16` or `bf16`.
    pub fn name(&self) -> &'static str {
        match self {
            Precision::Fp32 => "fp32",
            Precision::Fp16 { .. } => "fp16",
            Precision::Bf16 => "bf16",
        }
    }

    /// What a run's log says of it.
    pub fn describe(&self) -> &'static str {
        match self {
            Precision::Fp32 => "fp32",
            Precision::Fp16 { .. } => "fp16 (fp32 master weights, loss scaling)",
            Precision::Bf16 => "bf16 (fp32 master weights)",
        }
    }
}

/// Settings of the dynamic scaler; `Default` is DeepSpeed's documented defaults.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct DynamicScaling {
    /// The first scale is `2^initial_scale_power`.
    pub initial_scale_power: u32,
    /// Clean steps (since the last overflow) between doublings.
    pub window: u64,
    /// Overflows tolerated before the scale is halved.
    pub hysteresis: u32,
    /// Refill the hysteresis budget after every clean step, not only at a doubling.
    pub consecutive_hysteresis: bool,
    /// The scale never goes below this; overflowing at it is an error.
    pub min_scale: f32,
}

impl Default for DynamicScaling {
    fn default() -> Self {
        DynamicScaling {
            initial_scale_power: 16,
            window: 1000,
            hysteresis: 2,
            consecutive_hysteresis: false,
            min_scale: 1.0,
        }
    }
}

/// How the fp16 loss is scaled before backward.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub enum LossScaling {
    /// `fp16.loss_scale == 0`: the scale adapts to overflows.
    Dynamic(DynamicScaling),
    /// `fp16.loss_scale > 0`: this fixed scale.
    Static(f32),
}

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

impl Reader {
    pub(super) fn precision(&mut self, root: &Map<String, Value>) -> (Precision, bool) {
        let empty = Map::new();
        let fp16 = self.section(root, "", "fp16").ok().flatten();
        if let Some(f) = fp16 {
            self.check_keys(
                f,
                "fp16",
                &Spec {
                    keys: FP16_KEYS,
                    ignored: &[],
                    unsupported: &[(
                        "fp16_master_weights_and_grads",
                        Inert::Bool(false),
                        "fp16 master weights and gradients (Kiln keeps fp32 masters)",
                    )],
                    hints: &[],
                },
            );
        }
        let f = fp16.unwrap_or(&empty);
        let p = "fp16";
        let fp16_on = self.bool_or(f, p, "enabled", false);
        let auto_cast = self.bool_or(f, p, "auto_cast", false);
        let loss_scale = self.float_or(f, p, "loss_scale", Range::AtLeast(0.0), 0.0);
        let power = self.uint_or(f, p, "initial_scale_power", (0, 127), 16) as u32;
        // The scaler does its window arithmetic in i64 (the step of the last overflow
        // starts at -1).
        let window = self.uint_or(f, p, "loss_scale_window", (1, i64::MAX as u64), 1000);
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
}
