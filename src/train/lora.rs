//! `kiln train` with LoRA: the run's adapter settings (`--lora`, `--adapter`,
//! `kiln.lora`) resolved into one, the base model frozen under them, the base's
//! fingerprint that a resume checks, and the adapters written in PEFT's format beside
//! each checkpoint (`RUN/adapter`).

use std::path::{Path, PathBuf};
use std::sync::Arc;

use anyhow::{bail, Context, Result};

use kiln_engine::config::LoraSection;
use kiln_engine::device::host::HostTensor;
use kiln_engine::models::lora::{read_peft, Lora, LoraConfig, PeftAdapter};
use kiln_engine::models::Model;
use kiln_engine::train::checkpoint;

use super::options::TrainOptions;

/// Where the latest checkpoint's adapters are written in PEFT's format.
pub(crate) const ADAPTER_DIR: &str = "adapter";

/// A LoRA run: the adapted model, and the adapters to start from (`--adapter`).
pub(crate) struct LoraRun {
    pub model: Arc<Lora>,
    pub start: Option<PeftAdapter>,
    /// What `adapter_config.json` records as the base (`--init-from`'s path).
    pub base_name: String,
}

/// The run's LoRA settings: `--lora`, else `kiln.lora`, else a resumed run's own
/// (`recorded`, its config.json's `lora`), else `--adapter`'s own; where `--adapter`
/// and a setting are both given they must agree on what shapes the adapters (r,
/// targets) and how they scale (alpha, rsLoRA).
pub(crate) fn settings(
    opts: &TrainOptions,
    section: Option<&LoraSection>,
    recorded: Option<&serde_json::Value>,
) -> Result<Option<(LoraConfig, Option<PeftAdapter>)>> {
    let given = match (
        crate::estimate::lora_settings(opts.lora.as_deref(), section)?,
        recorded,
    ) {
        (Some(c), _) => Some(c),
        (None, Some(r)) => Some(serde_json::from_value(r.clone()).map_err(|e| {
            anyhow::anyhow!("--resume: the run's recorded `lora` settings do not read ({e})")
        })?),
        (None, None) => None,
    };
    let start = match &opts.adapter {
        Some(dir) => Some(read_peft(dir)?),
        None => None,
    };
    Ok(match (given, start) {
        (None, None) => None,
        (Some(c), None) => Some((c, None)),
        (None, Some(a)) => Some((a.config.clone(), Some(a))),
        (Some(c), Some(a)) => {
            let shape = |c: &LoraConfig| (c.r, c.alpha, c.use_rslora, c.target_modules.clone());
            if shape(&c) != shape(&a.config) {
                bail!(
                    "--adapter {}: its adapter_config.json says r {}, alpha {}, targets {:?}, \
                     but the run's LoRA settings say r {}, alpha {}, targets {:?}; drop --lora \
                     (and kiln.lora) to continue the adapter as it is",
                    opts.adapter.as_deref().unwrap_or(Path::new("")).display(),
                    a.config.r,
                    a.config.alpha,
                    a.config.target_modules,
                    c.r,
                    c.alpha,
                    c.target_modules
                );
            }
            Some((c, Some(a)))
        }
    })
}

/// Freezes `base` under `config`: errors name targets that match nothing (listing the
/// model's linear modules) and ranks over a module's size.
pub(crate) fn adapt(
    base: Arc<dyn Model>,
    (config, start): (LoraConfig, Option<PeftAdapter>),
    base_name: String,
) -> Result<LoraRun> {
    let model = Arc::new(Lora::new(base, config)?);
    if let Some(a) = &start {
        check_adapter(&model, a)?;
    }
    Ok(LoraRun {
        model,
        start,
        base_name,
    })
}

/// Refuses an adapter whose tensors are not the adapted model's (another base, other
/// targets or rank), naming the first that differs.
fn check_adapter(model: &Lora, a: &PeftAdapter) -> Result<()> {
    let specs = model.parameters();
    let names = model.adapter_names();
    for t in &a.tensors {
        let Some(s) = specs.iter().find(|s| s.name == t.name) else {
            bail!(
                "the adapter holds `{}`, which {} does not have: it was trained on another \
                 base model (or other target modules)",
                t.name,
                model.describe()
            );
        };
        if s.shape != t.shape {
            bail!(
                "the adapter's `{}` is {:?} but {} has {:?} for it: it was trained on a base \
                 model of other sizes",
                t.name,
                t.shape,
                model.describe(),
                s.shape
            );
        }
    }
    if let Some(missing) = names
        .iter()
        .find(|n| !a.tensors.iter().any(|t| &t.name == *n))
    {
        bail!(
            "the adapter has no `{missing}`, which {} adapts; it was trained with other \
             target modules",
            model.describe()
        );
    }
    Ok(())
}

/// A fingerprint of the base weights (`kiln_engine::models::lora::base_fingerprint`).
pub(crate) fn fingerprint(weights: &[HostTensor]) -> String {
    kiln_engine::models::lora::base_fingerprint(weights)
}

/// Writes the adapters of the checkpoint in `ckpt` (their f32 masters) to
/// `run/adapter` in PEFT's format, replacing what an earlier checkpoint wrote there.
pub(crate) fn write_adapter(run: &LoraRun, run_dir: &Path, ckpt: &Path) -> Result<PathBuf> {
    let ck = checkpoint::load(ckpt)?;
    let masters = ck.masters()?;
    let dir = run_dir.join(ADAPTER_DIR);
    run.model
        .save_peft(&dir, &masters, &run.base_name)
        .with_context(|| format!("writing the adapter into {}", dir.display()))?;
    Ok(dir)
}
