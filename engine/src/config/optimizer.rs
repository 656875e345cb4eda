//! The `optimizer` section: Adam, AdamW and SGD with DeepSpeed's defaults; the other
//! optimizers DeepSpeed knows are rejected by name. The resolved value is
//! [`crate::device::optim::Optimizer`], which the config re-exports.

use serde_json::{Map, Value};

use super::keys::{Inert, Spec};
use super::provenance::Provenance;
use super::reader::{join, Bad, Range, Reader};
use super::suggest::suggest;
use crate::device::optim::Optimizer;

pub(super) const DEFAULT_LR: f64 = 1e-3;
const DEFAULT_BETAS: [f32; 2] = [0.9, 0.999];
const DEFAULT_EPS: f64 = 1e-8;

pub(super) fn default_optimizer() -> Optimizer {
    Optimizer::Adam {
        lr: DEFAULT_LR as f32,
        betas: DEFAULT_BETAS,
        eps: DEFAULT_EPS as f32,
        weight_decay: 0.0,
        decoupled: true,
    }
}

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

impl Reader {
    pub(super) fn optimizer(&mut self, root: &Map<String, Value>) -> (Optimizer, bool) {
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
}
