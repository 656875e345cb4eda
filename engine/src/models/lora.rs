//! LoRA (low-rank adaptation) on any model of the contract, with PEFT's semantics and
//! file format. The base model's parameters are frozen (held once, no gradient, master
//! or moments); each adapted linear gains two small trained matrices:
//!
//!   x (M, in) --W (frozen)-------------------------------------> (M, out) --+--> y
//!   x (M, in) --dropout--> A (r, in): (M, r) --B (out, r), · alpha/r--> (M, out)
//!
//! A starts Kaiming-uniform (PEFT's bound 1 / sqrt(in)), B at zero, so a fresh adapter
//! leaves the model's outputs as they were. Which linears a run adapts is found by
//! recording the base model's forward pass once: every linear reading a weight is a
//! module (named as its weight, less `.weight`), the one producing the prediction (the
//! LM head) is the output layer `"all-linear"` leaves out, as PEFT does.
//!
//! Files: `adapter_model.safetensors` (`base_model.model.<module>.lora_A.weight` (r, in)
//! and `.lora_B.weight` (out, r)) and `adapter_config.json`, what
//! `peft.PeftModel.from_pretrained` reads.

use std::collections::BTreeSet;
use std::path::Path;
use std::sync::Arc;

use serde::{Deserialize, Serialize};

use super::{Forward, Init, Model, ParamSpec};
use crate::device::host::HostTensor;
use crate::graph::{Graph, Tensor};
use crate::{DType, Error, HostData, Result};

/// The modules to adapt: a list of names (a module matches a name it equals or ends
/// with after a dot, as PEFT matches) or every linear but the output layer.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum Targets {
    List(Vec<String>),
    /// `"all-linear"`.
    All(String),
}

/// A LoRA run's settings: PEFT's names and meaning.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LoraConfig {
    /// The rank: A is (r, in), B (out, r).
    pub r: usize,
    /// The adapter's output is scaled by alpha / r (alpha / sqrt(r) with `use_rslora`).
    #[serde(default = "default_alpha")]
    pub alpha: f32,
    /// Dropout on the adapter's input (0: none).
    #[serde(default)]
    pub dropout: f32,
    #[serde(default = "default_targets")]
    pub target_modules: Targets,
    #[serde(default)]
    pub use_rslora: bool,
}

fn default_alpha() -> f32 {
    8.0
}

fn default_targets() -> Targets {
    Targets::All("all-linear".into())
}

impl LoraConfig {
    /// `alpha / r`, or `alpha / sqrt(r)` with rsLoRA.
    pub fn scale(&self) -> f32 {
        match self.use_rslora {
            true => self.alpha / (self.r as f32).sqrt(),
            false => self.alpha / self.r as f32,
        }
    }

    /// Checks what does not depend on the model: r > 0, dropout in [0, 1), alpha
    /// finite, targets a non-empty list or `"all-linear"`.
    pub fn check(&self) -> Result<()> {
        let bad = |why: String| Err(Error::InvalidArgument(format!("lora: {why}")));
        if self.r == 0 {
            return bad("r = 0; the rank must be at least 1 (8 to 64 is usual)".into());
        }
        if !(0.0..1.0).contains(&self.dropout) {
            return bad(format!(
                "dropout {} must be in [0, 1) (0.05 is usual)",
                self.dropout
            ));
        }
        if !self.alpha.is_finite() {
            return bad(format!("alpha {} must be a finite number", self.alpha));
        }
        match &self.target_modules {
            Targets::All(s) if s == "all-linear" => Ok(()),
            Targets::All(s) => bad(format!(
                "target_modules \"{s}\": give a list of module names (e.g. [\"q_proj\", \
                 \"v_proj\"]) or \"all-linear\""
            )),
            Targets::List(l) if l.is_empty() => {
                bad("target_modules is empty; name the modules to adapt or \"all-linear\"".into())
            }
            Targets::List(_) => Ok(()),
        }
    }

    /// Reads `--lora r=16,alpha=32,dropout=0.05,targets=q_proj+v_proj` (targets joined
    /// by `+`, or `all-linear`; `rslora=true`). Unset keys take PEFT's defaults.
    pub fn parse_flag(text: &str) -> Result<LoraConfig> {
        let mut c = LoraConfig {
            r: 0,
            alpha: default_alpha(),
            dropout: 0.0,
            target_modules: default_targets(),
            use_rslora: false,
        };
        let bad = |why: String| {
            Error::InvalidArgument(format!(
                "--lora {text}: {why}; write it as r=16,alpha=32,dropout=0.05,\
                 targets=q_proj+k_proj+v_proj+o_proj (or targets=all-linear)"
            ))
        };
        for part in text.split(',').filter(|p| !p.trim().is_empty()) {
            let (k, v) = part
                .split_once('=')
                .ok_or_else(|| bad(format!("`{part}` is not key=value")))?;
            let (k, v) = (k.trim(), v.trim());
            let num = |what: &str| bad(format!("{what} `{v}` is not a number"));
            match k {
                "r" => c.r = v.parse().map_err(|_| num("r"))?,
                "alpha" => c.alpha = v.parse().map_err(|_| num("alpha"))?,
                "dropout" => c.dropout = v.parse().map_err(|_| num("dropout"))?,
                "rslora" => {
                    c.use_rslora = v
                        .parse()
                        .map_err(|_| bad(format!("rslora `{v}` is not true or false")))?
                }
                "targets" if v == "all-linear" => c.target_modules = default_targets(),
                "targets" => {
                    c.target_modules = Targets::List(v.split('+').map(str::to_string).collect())
                }
                _ => return Err(bad(format!("unknown key `{k}`"))),
            }
        }
        if c.r == 0 {
            return Err(bad("r is missing or 0".into()));
        }
        c.check()?;
        Ok(c)
    }
}

/// One adapted module.
#[derive(Clone, Debug, PartialEq)]
pub struct Adapted {
    /// The module's name: its weight's, less `.weight` (`model.layers.0.self_attn.q_proj`).
    pub module: String,
    /// The base parameter (index into the base model's parameters).
    pub weight: usize,
    pub fan_in: usize,
    pub fan_out: usize,
    /// The weight is stored (in, out) (GPT-2's Conv1D: PEFT's `fan_in_fan_out`).
    pub fan_in_fan_out: bool,
}

/// The base model with LoRA adapters: trained parameters are the adapters (A, B per
/// module, in the base model's order), then every base parameter, frozen.
pub struct Lora {
    pub base: Arc<dyn Model>,
    pub config: LoraConfig,
    pub adapted: Vec<Adapted>,
    base_specs: Vec<ParamSpec>,
}

/// The linear modules of `model` (name, base parameter, in, out, stored (in, out)) and
/// whether each produces the prediction (the output layer).
fn linear_modules(model: &dyn Model) -> Result<Vec<(Adapted, bool)>> {
    let specs = model.parameters();
    let mut g = Graph::new();
    let params = super::declare_params(&mut g, &specs, DType::F32)?;
    let forward = model.forward(&mut g, &params, 1, DType::F32)?;
    let mut out = vec![];
    for (w, fan_in, fan_out, in_out, o) in g.linears() {
        let Some(p) = params.iter().position(|&t| t == w) else {
            continue;
        };
        let s = &specs[p];
        let module = s
            .name
            .strip_suffix(".weight")
            .unwrap_or(&s.name)
            .to_string();
        out.push((
            Adapted {
                module,
                weight: p,
                fan_in,
                fan_out,
                fan_in_fan_out: in_out,
            },
            o == forward.prediction,
        ));
    }
    Ok(out)
}

/// Whether `module` is named by `target` (equal, or its last dotted parts).
fn matches(module: &str, target: &str) -> bool {
    module == target || module.ends_with(&format!(".{target}"))
}

impl Lora {
    /// Adapts `base`'s modules `config` names. Errors: a target naming no linear module
    /// (the model's are listed), r over a module's smaller side, a model with no linear.
    pub fn new(base: Arc<dyn Model>, config: LoraConfig) -> Result<Lora> {
        config.check()?;
        base.check_sizes()?;
        let modules = linear_modules(base.as_ref())?;
        let names = || {
            let kinds: BTreeSet<String> = modules
                .iter()
                .map(|(m, _)| m.module.rsplit('.').next().unwrap_or(&m.module).to_string())
                .collect();
            kinds.into_iter().collect::<Vec<_>>().join(", ")
        };
        let adapted: Vec<Adapted> = match &config.target_modules {
            Targets::All(_) => modules
                .iter()
                .filter(|(_, head)| !head)
                .map(|(m, _)| m.clone())
                .collect(),
            Targets::List(list) => {
                let missing: Vec<&String> = list
                    .iter()
                    .filter(|t| !modules.iter().any(|(m, _)| matches(&m.module, t)))
                    .collect();
                if !missing.is_empty() {
                    return Err(Error::InvalidArgument(format!(
                        "lora: target_modules {missing:?} match no linear module of {}; its \
                         linear modules are: {} (or use \"all-linear\")",
                        base.describe(),
                        names()
                    )));
                }
                let chosen: Vec<Adapted> = modules
                    .iter()
                    .filter(|(m, _)| list.iter().any(|t| matches(&m.module, t)))
                    .map(|(m, _)| m.clone())
                    .collect();
                let specs = base.parameters();
                if let Some(m) = chosen.iter().find(|m| specs[m.weight].tied.is_some()) {
                    return Err(Error::InvalidArgument(format!(
                        "lora: `{}` is tied to the token embedding (the same tensor is read as \
                         a table), so an adapter on it would change the embedding too; adapt \
                         the other modules",
                        m.module
                    )));
                }
                chosen
            }
        };
        if adapted.is_empty() {
            return Err(Error::InvalidArgument(format!(
                "lora: {} has no linear module to adapt but its output layer",
                base.describe()
            )));
        }
        if let Some(m) = adapted.iter().find(|m| config.r > m.fan_in.min(m.fan_out)) {
            return Err(Error::InvalidArgument(format!(
                "lora: r = {} is over the smaller side of `{}` ({} in, {} out); a rank \
                 must be at most min(in, out)",
                config.r, m.module, m.fan_in, m.fan_out
            )));
        }
        let base_specs = base.parameters();
        Ok(Lora {
            base,
            config,
            adapted,
            base_specs,
        })
    }

    /// The adapters' parameter names in Kiln (`<module>.lora_A.weight`, `…lora_B…`).
    pub fn adapter_names(&self) -> Vec<String> {
        self.adapted
            .iter()
            .flat_map(|m| {
                [
                    format!("{}.lora_A.weight", m.module),
                    format!("{}.lora_B.weight", m.module),
                ]
            })
            .collect()
    }

    /// Elements of the adapters (what trains).
    pub fn adapter_parameters(&self) -> usize {
        let r = self.config.r;
        self.adapted
            .iter()
            .map(|m| r * (m.fan_in + m.fan_out))
            .sum()
    }

    /// The base weights with every adapter merged in, `W + scale · B A` (transposed
    /// for a weight stored (in, out)), summed in f32 and stored in each base weight's
    /// dtype: a model that needs no adapters to give the adapted model's outputs.
    /// `base` are the base model's tensors by name, `adapters` the adapters' (Kiln's
    /// names).
    pub fn merge(&self, base: &[HostTensor], adapters: &[HostTensor]) -> Result<Vec<HostTensor>> {
        let find = |list: &[HostTensor], name: &str| -> Result<Vec<f32>> {
            list.iter()
                .find(|t| t.name == name)
                .map(|t| t.data.to_f32())
                .ok_or_else(|| Error::InvalidArgument(format!("lora merge: `{name}` is not given")))
        };
        let scale = self.config.scale();
        let r = self.config.r;
        let mut out = base.to_vec();
        for m in &self.adapted {
            let name = &self.base_specs[m.weight].name;
            let a = find(adapters, &format!("{}.lora_A.weight", m.module))?;
            let b = find(adapters, &format!("{}.lora_B.weight", m.module))?;
            let t = out.iter_mut().find(|t| &t.name == name).ok_or_else(|| {
                Error::InvalidArgument(format!("lora merge: `{name}` is not given"))
            })?;
            let mut w = t.data.to_f32();
            for o in 0..m.fan_out {
                for i in 0..m.fan_in {
                    let d: f32 = (0..r).map(|k| b[o * r + k] * a[k * m.fan_in + i]).sum();
                    let at = match m.fan_in_fan_out {
                        true => i * m.fan_out + o,
                        false => o * m.fan_in + i,
                    };
                    w[at] += scale * d;
                }
            }
            t.data = HostData::from_f32(t.data.dtype(), &w);
        }
        Ok(out)
    }

    /// Writes the adapters (Kiln's names, any float dtype) in PEFT's format into `dir`:
    /// `adapter_model.safetensors` (f32) and `adapter_config.json`. `base_model` is what
    /// PEFT records as `base_model_name_or_path` (a directory or a Hub id).
    pub fn save_peft(&self, dir: &Path, adapters: &[HostTensor], base_model: &str) -> Result<()> {
        std::fs::create_dir_all(dir).map_err(|e| {
            Error::InvalidArgument(format!("lora: cannot create `{}`: {e}", dir.display()))
        })?;
        let mut tensors = vec![];
        for name in self.adapter_names() {
            let t = adapters.iter().find(|t| t.name == name).ok_or_else(|| {
                Error::InvalidArgument(format!("lora: adapter `{name}` is not given"))
            })?;
            tensors.push(HostTensor::new(
                format!("base_model.model.{name}"),
                t.shape.clone(),
                HostData::F32(t.data.to_f32()),
            ));
        }
        crate::device::safetensors_io::write(&dir.join("adapter_model.safetensors"), &tensors)?;
        // As configured: names as given match by their dotted suffix, as PEFT matches
        // them, so the same modules are adapted when it is read back (PEFT or Kiln).
        let targets = match &self.config.target_modules {
            Targets::List(l) => serde_json::json!(l),
            Targets::All(s) => serde_json::json!(s),
        };
        let config = serde_json::json!({
            "peft_type": "LORA",
            "task_type": "CAUSAL_LM",
            "base_model_name_or_path": base_model,
            "r": self.config.r,
            "lora_alpha": self.config.alpha,
            "lora_dropout": self.config.dropout,
            "target_modules": targets,
            "bias": "none",
            "fan_in_fan_out": self.adapted.iter().any(|m| m.fan_in_fan_out),
            "use_rslora": self.config.use_rslora,
            "inference_mode": true,
            "init_lora_weights": true,
            "modules_to_save": null,
            "layers_to_transform": null,
            "revision": null,
        });
        let text = serde_json::to_string_pretty(&config).expect("json");
        crate::fsutil::replace_file(&dir.join("adapter_config.json"), text.as_bytes())
            .map_err(|e| Error::InvalidArgument(format!("lora: cannot write: {e}")))
    }
}

/// A fingerprint of base weights (names, shapes, dtypes and bytes, in name order):
/// SHA-256, so it stays the same across builds and hosts. A LoRA run records it, and a
/// resume refuses a base whose fingerprint changed.
pub fn base_fingerprint(weights: &[HostTensor]) -> String {
    use sha2::{Digest, Sha256};
    let mut h = Sha256::new();
    let mut sorted: Vec<&HostTensor> = weights.iter().collect();
    sorted.sort_by(|a, b| a.name.cmp(&b.name));
    for t in sorted {
        h.update(t.name.as_bytes());
        h.update([0]);
        for &d in &t.shape {
            h.update((d as u64).to_le_bytes());
        }
        h.update(t.data.dtype().to_string().as_bytes());
        h.update(t.data.as_bytes());
    }
    h.finalize().iter().map(|b| format!("{b:02x}")).collect()
}

/// A PEFT adapter directory read back: its settings and tensors (Kiln's names).
#[derive(Clone, Debug)]
pub struct PeftAdapter {
    pub config: LoraConfig,
    /// `base_model_name_or_path` as recorded.
    pub base_model: Option<String>,
    pub tensors: Vec<HostTensor>,
}

/// Reads a PEFT LoRA adapter directory (`adapter_config.json` and
/// `adapter_model.safetensors`). What Kiln cannot honour is refused, naming the key:
/// a PEFT type other than LORA, `bias` other than "none", `modules_to_save`,
/// per-layer ranks (`rank_pattern`, `alpha_pattern`), DoRA.
pub fn read_peft(dir: &Path) -> Result<PeftAdapter> {
    let bad = |why: String| Error::InvalidArgument(format!("adapter `{}`: {why}", dir.display()));
    let path = dir.join("adapter_config.json");
    let text = std::fs::read_to_string(&path).map_err(|e| {
        bad(format!(
            "cannot read adapter_config.json ({e}); is it a PEFT adapter directory?"
        ))
    })?;
    let v: serde_json::Value =
        serde_json::from_str(&text).map_err(|e| bad(format!("adapter_config.json: {e}")))?;
    let get = |k: &str| v.get(k).filter(|x| !x.is_null());
    if let Some(t) = get("peft_type")
        .and_then(|t| t.as_str())
        .filter(|t| *t != "LORA")
    {
        return Err(bad(format!("peft_type {t}; Kiln reads LORA adapters")));
    }
    if let Some(b) = get("bias")
        .and_then(|b| b.as_str())
        .filter(|b| *b != "none")
    {
        return Err(bad(format!(
            "bias \"{b}\": trained biases are not supported; only \"none\""
        )));
    }
    for k in ["modules_to_save", "layers_to_transform", "layers_pattern"] {
        if get(k).is_some_and(|x| x.as_array().is_none_or(|a| !a.is_empty())) {
            return Err(bad(format!(
                "{k} is set; Kiln adapts whole target modules only"
            )));
        }
    }
    for k in ["rank_pattern", "alpha_pattern"] {
        if get(k).is_some_and(|x| x.as_object().is_none_or(|o| !o.is_empty())) {
            return Err(bad(format!(
                "{k} is set; Kiln uses one rank and alpha for all modules"
            )));
        }
    }
    if get("use_dora").and_then(|d| d.as_bool()) == Some(true) {
        return Err(bad("use_dora is true; DoRA is not supported".into()));
    }
    let r = get("r")
        .and_then(|r| r.as_u64())
        .ok_or_else(|| bad("adapter_config.json has no rank `r`".into()))? as usize;
    let target_modules = match get("target_modules") {
        Some(serde_json::Value::Array(a)) => Targets::List(
            a.iter()
                .map(|x| x.as_str().map(str::to_string))
                .collect::<Option<_>>()
                .ok_or_else(|| bad("target_modules holds a non-string".into()))?,
        ),
        Some(serde_json::Value::String(s)) => Targets::All(s.clone()),
        _ => return Err(bad("adapter_config.json has no target_modules".into())),
    };
    let config = LoraConfig {
        r,
        alpha: get("lora_alpha").and_then(|a| a.as_f64()).unwrap_or(8.0) as f32,
        dropout: get("lora_dropout").and_then(|a| a.as_f64()).unwrap_or(0.0) as f32,
        target_modules,
        use_rslora: get("use_rslora").and_then(|a| a.as_bool()).unwrap_or(false),
    };
    config.check().map_err(|e| bad(e.to_string()))?;
    let file = dir.join("adapter_model.safetensors");
    let mut tensors = crate::device::safetensors_io::read(&file)?;
    for t in &mut tensors {
        let name = t.name.strip_prefix("base_model.model.").ok_or_else(|| {
            bad(format!(
                "tensor `{}` is not named base_model.model.…",
                t.name
            ))
        })?;
        // PEFT names the default adapter's weights `lora_A.weight` on save; older files
        // may carry the adapter name (`lora_A.default.weight`).
        t.name = name
            .replace(".lora_A.default.", ".lora_A.")
            .replace(".lora_B.default.", ".lora_B.");
    }
    Ok(PeftAdapter {
        config,
        base_model: get("base_model_name_or_path")
            .and_then(|b| b.as_str())
            .map(str::to_string),
        tensors,
    })
}

impl Model for Lora {
    fn describe(&self) -> String {
        format!(
            "{} + LoRA r {} on {} modules",
            self.base.describe(),
            self.config.r,
            self.adapted.len()
        )
    }

    fn check_sizes(&self) -> Result<()> {
        self.base.check_sizes()
    }

    fn parameters(&self) -> Vec<ParamSpec> {
        let r = self.config.r;
        let mut p = vec![];
        for m in &self.adapted {
            // Kaiming-uniform with a = sqrt(5): bound 1 / sqrt(in), std bound / sqrt(3).
            let a_std = 1.0 / (3.0 * m.fan_in as f32).sqrt();
            p.push(
                ParamSpec::new(
                    format!("{}.lora_A.weight", m.module),
                    &[r, m.fan_in],
                    Init::Uniform(a_std),
                )
                .decayed(),
            );
            p.push(
                ParamSpec::new(
                    format!("{}.lora_B.weight", m.module),
                    &[m.fan_out, r],
                    Init::Const(0.0),
                )
                .decayed(),
            );
        }
        p.extend(self.base_specs.iter().cloned().map(ParamSpec::frozen));
        p
    }

    fn forward(&self, g: &mut Graph, p: &[Tensor], batch: usize, dtype: DType) -> Result<Forward> {
        let n = 2 * self.adapted.len();
        let base = &p[n..];
        for (i, m) in self.adapted.iter().enumerate() {
            g.adapt(
                base[m.weight],
                (p[2 * i], p[2 * i + 1]),
                self.config.scale(),
                self.config.dropout,
            )?;
        }
        self.base.forward(g, base, batch, dtype)
    }

    /// The base model's blocks, each holding the adapters of its modules.
    fn blocks(&self) -> Vec<Vec<usize>> {
        self.base
            .blocks()
            .iter()
            .map(|b| {
                self.adapted
                    .iter()
                    .enumerate()
                    .filter(|(_, m)| b.contains(&m.weight))
                    .flat_map(|(i, _)| [2 * i, 2 * i + 1])
                    .collect::<Vec<_>>()
            })
            .filter(|b| !b.is_empty())
            .collect()
    }
}
