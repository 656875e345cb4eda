//! The `optimizer` section: Adam, AdamW and SGD with DeepSpeed's defaults; the other
//! optimizers DeepSpeed knows are rejected by name. The resolved value is
//! [`crate::device::optim::Optimizer`], which the config re-exports.

use serde_json::{Map, Value};

use super::keys::{Inert, Spec};
use super::provenance::Provenance;
use super::reader::{auto_at, describe, join, shorten, Bad, Range, Reader};
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

const ADAM_IGNORED: &[(&str, Inert, &str)] = &[
    (
        "torch_adam",
        Inert::Bool(false),
        "it selects DeepSpeed's PyTorch Adam over its fused kernel; Kiln has one Adam kernel, \
         so it is a no-op",
    ),
    (
        "fused",
        Inert::Bool(false),
        "it selects a fused Adam kernel; Kiln's Adam is always one fused launch, so it is a no-op",
    ),
    (
        "set_grad_none",
        Inert::Any,
        "it frees PyTorch's gradient tensors after the step; Kiln's gradient buffers are its own",
    ),
];

/// Where DeepSpeed's optimizer-level gradient clipping goes in Kiln.
const MAX_GRAD_NORM_HINT: &str = "DeepSpeed hands optimizer.params.max_grad_norm to its fp16 \
    wrapper (and drops it in fp32); set the top-level \"gradient_clipping\" instead";

const SECTION: Spec = Spec {
    keys: &["type", "params"],
    ignored: &[(
        "legacy_fusion",
        Inert::Bool(false),
        "it selects DeepSpeed's older fused fp16 optimizer; Kiln has one fp16 path",
    )],
    unsupported: &[],
    hints: &[],
};

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
        self.check_keys(sec, "optimizer", &SECTION);
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
                        "optimizer type \"{}\" is not supported by Kiln; supported: \
                         {SUPPORTED_OPTIMIZERS}",
                        shorten(ty)
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
                        hints: &[("max_grad_norm", MAX_GRAD_NORM_HINT)],
                    },
                );
            }
            let lr_given = p.get("lr").is_some_and(|v| !v.is_null());
            let lr = self.float_or(p, pp, "lr", Range::AtLeast(0.0), DEFAULT_LR) as f32;
            let momentum = self.float_or(p, pp, "momentum", Range::HalfOpen(0.0, 1.0), 0.0) as f32;
            let weight_decay = self.hf_default(p, "weight_decay", "--weight_decay", 0.0, |r| {
                r.float_or(p, pp, "weight_decay", Range::AtLeast(0.0), 0.0)
            }) as f32;
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
                        ("max_grad_norm", MAX_GRAD_NORM_HINT),
                    ],
                },
            );
        }
        let lr_given = p.get("lr").is_some_and(|v| !v.is_null());
        let lr = self.float_or(p, pp, "lr", Range::AtLeast(0.0), DEFAULT_LR) as f32;
        let betas = if auto_at(p, "betas") {
            self.hf_guess(
                "optimizer.params.betas",
                "--adam_beta1 0.9, --adam_beta2 0.999",
                "[0.9, 0.999]",
            );
            DEFAULT_BETAS
        } else {
            self.betas(p, pp)
        };
        let eps = self.hf_default(p, "eps", "--adam_epsilon", DEFAULT_EPS, |r| {
            r.float_or(p, pp, "eps", Range::Above(0.0), DEFAULT_EPS)
        }) as f32;
        // DeepSpeed's Adam and AdamW do not decay by default (torch.optim.AdamW's 0.01 is
        // not DeepSpeed's); the note is for configs written with torch's default in mind.
        let weight_decay = self.hf_default(p, "weight_decay", "--weight_decay", 0.0, |r| {
            r.float_or(p, pp, "weight_decay", Range::AtLeast(0.0), 0.0)
        }) as f32;
        if kind == Kind::AdamW && p.get("weight_decay").is_none_or(Value::is_null) {
            self.note(
                "optimizer.params.weight_decay is 0.0, DeepSpeed's default for AdamW \
                 (torch.optim.AdamW's default, which Kiln used before, is 0.01): set it to \
                 decay the weights",
            );
        }
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
        let v = match self.raw(p, &path, "betas", expected) {
            Ok(Some(v)) => v,
            _ => {
                self.mark(&path, Provenance::Default);
                return DEFAULT_BETAS;
            }
        };
        let Some([b0, b1]) = v.as_array().map(Vec::as_slice) else {
            self.wrong_value(&path, expected, v, default);
            return DEFAULT_BETAS;
        };
        // Each element on its own, so the message says which one is wrong and why.
        let mut betas = DEFAULT_BETAS;
        let mut bad = Vec::new();
        for (i, (b, name)) in [(b0, "beta1"), (b1, "beta2")].into_iter().enumerate() {
            match b.as_f64() {
                // Checked as stored: 0.9999999999 rounds to an f32 1.0, and a beta of 1
                // divides by zero in the bias correction.
                Some(x) if (0.0..1.0).contains(&(x as f32)) => betas[i] = x as f32,
                Some(x) if (0.0..1.0).contains(&x) => bad.push(format!(
                    "betas[{i}] ({name}) is {x}, which becomes {} as the 32-bit float Kiln \
                     stores it as, outside [0, 1)",
                    x as f32
                )),
                Some(x) => bad.push(format!(
                    "betas[{i}] ({name}) is {x}, outside [0, 1): the moving average needs a \
                     decay of at least 0 and below 1"
                )),
                None => bad.push(format!(
                    "betas[{i}] ({name}) is {}, not a number",
                    describe(b)
                )),
            }
        }
        if bad.is_empty() {
            self.mark(&path, Provenance::File);
            return betas;
        }
        self.problem(
            &path,
            bad.join("; "),
            "write two numbers in [0, 1), like [0.9, 0.95], or remove the key for the \
             default [0.9, 0.999]",
        );
        DEFAULT_BETAS
    }

    /// A value the Hugging Face Trainer fills from one of its TrainingArguments: when it
    /// is `"auto"`, that argument's default (the same as DeepSpeed's), said once in a
    /// warning since the user's run may have changed it; otherwise `read` reads it.
    fn hf_default(
        &mut self,
        p: &Map<String, Value>,
        key: &str,
        flag: &str,
        default: f64,
        read: impl FnOnce(&mut Reader) -> f64,
    ) -> f64 {
        if !auto_at(p, key) {
            return read(self);
        }
        self.hf_guess(
            &format!("optimizer.params.{key}"),
            &format!("{flag} {default:?}"),
            &format!("{default:?}"),
        );
        default
    }
}
