//! The `kiln.lora` section: LoRA adapters, with PEFT's names and meaning (`r`,
//! `alpha` — PEFT's `lora_alpha` is accepted too —, `dropout`, `target_modules`,
//! `use_rslora`). What the run builds from it is `models::lora::Lora`; here the
//! section is only read and checked.

use serde::Serialize;
use serde_json::{Map, Value};

use super::keys::Spec;
use super::reader::{describe, Range, Reader};

/// The resolved `kiln.lora` section.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct LoraSection {
    pub r: usize,
    pub alpha: f32,
    pub dropout: f32,
    /// Module names, or `None`: every linear but the output layer (`"all-linear"`).
    pub target_modules: Option<Vec<String>>,
    pub use_rslora: bool,
}

const SPEC: Spec = Spec::keys(&[
    "r",
    "alpha",
    "lora_alpha",
    "dropout",
    "lora_dropout",
    "target_modules",
    "use_rslora",
]);

impl Reader {
    pub(super) fn lora(&mut self, kiln: &Map<String, Value>) -> Option<LoraSection> {
        let sec = self.section(kiln, "kiln", "lora").ok().flatten()?;
        let p = "kiln.lora";
        self.check_keys(sec, p, &SPEC);
        for (a, b) in [("alpha", "lora_alpha"), ("dropout", "lora_dropout")] {
            if sec.contains_key(a) && sec.contains_key(b) {
                self.problem(
                    &format!("{p}.{b}"),
                    format!("both `{a}` and `{b}` are set; they are one setting"),
                    "keep one of them",
                );
            }
        }
        let r = match self.uint(sec, p, "r", 1, 1 << 20, None) {
            Ok(Some(r)) => r as usize,
            Ok(None) => {
                self.problem(
                    &format!("{p}.r"),
                    "the LoRA rank `r` is missing",
                    "add \"r\": 16 (8 to 64 is usual)",
                );
                0
            }
            Err(_) => 0,
        };
        let alpha_key = if sec.contains_key("lora_alpha") {
            "lora_alpha"
        } else {
            "alpha"
        };
        let alpha = self.float_or(sec, p, alpha_key, Range::AtLeast(0.0), 8.0) as f32;
        let dropout_key = if sec.contains_key("lora_dropout") {
            "lora_dropout"
        } else {
            "dropout"
        };
        let dropout = self.float_or(sec, p, dropout_key, Range::HalfOpen(0.0, 1.0), 0.0) as f32;
        let path = format!("{p}.target_modules");
        let expected = "a list of module names such as [\"q_proj\", \"v_proj\"], or \"all-linear\"";
        let target_modules = match sec.get("target_modules") {
            None => None,
            Some(Value::String(s)) if s == "all-linear" => None,
            Some(Value::Array(list))
                if !list.is_empty()
                    && list
                        .iter()
                        .all(|v| v.as_str().is_some_and(|s| !s.is_empty())) =>
            {
                Some(
                    list.iter()
                        .filter_map(|v| v.as_str().map(str::to_string))
                        .collect(),
                )
            }
            Some(v) => {
                self.problem(
                    &path,
                    format!("expected {expected}, found {}", describe(v)),
                    "name the linear modules to adapt (PEFT's names: q_proj, k_proj, v_proj, \
                     o_proj, gate_proj, up_proj, down_proj; GPT-2's c_attn, c_proj, c_fc), \
                     or write \"all-linear\"",
                );
                None
            }
        };
        Some(LoraSection {
            r,
            alpha,
            dropout,
            target_modules,
            use_rslora: self.bool_or(sec, p, "use_rslora", false),
        })
    }
}
