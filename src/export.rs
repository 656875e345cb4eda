//! `kiln export`: a trained or imported model written as a Hugging Face directory that
//! `transformers` loads (`AutoModelForCausalLM.from_pretrained(DIR)`): GPT-2, or a Llama,
//! Qwen2 or Mistral as its config says, with the tokenizer files of a Hugging Face
//! tokenizer copied beside it. Weights keep their stored dtype, so an import exported
//! again is bit-exact.

use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};

use kiln_engine::data::Tokenizer;
use kiln_engine::models::{import, import_llama, ModelConfig};

use crate::sample::{Source, TextCodec};

/// The files of a Hugging Face tokenizer that travel with it.
const TOKENIZER_FILES: [&str; 5] = [
    "tokenizer.json",
    "tokenizer_config.json",
    "chat_template.jinja",
    "generation_config.json",
    "special_tokens_map.json",
];

/// What `kiln export` wrote.
#[derive(Debug)]
pub struct Exported {
    pub dir: PathBuf,
    /// The family written (`gpt2`, `llama`, `qwen2`, `mistral`).
    pub model_type: &'static str,
    /// Tokenizer files copied beside the weights.
    pub tokenizer_files: Vec<PathBuf>,
}

/// Writes the model of `source` (a run, a checkpoint or an importable file, as `kiln
/// sample` takes it) to `out` in `format` (`hf`).
pub fn export(source: &Path, format: &str, out: &Path) -> Result<Exported> {
    export_with(source, format, out, None, false)
}

/// [`export`] with LoRA adapters merged in (`merge`): a LoRA run's, or `adapter`'s (a
/// PEFT directory) into the source. A LoRA source without `merge` is refused, saying
/// where its adapter is: the whole model is written only when asked.
pub fn export_with(
    source: &Path,
    format: &str,
    out: &Path,
    adapter: Option<&Path>,
    merge: bool,
) -> Result<Exported> {
    if format != "hf" {
        bail!("--format {format}: Kiln exports `hf` (a Hugging Face model directory)");
    }
    if adapter.is_some() && !merge {
        bail!(
            "--adapter without --merge: exporting writes a whole model, the base with the \
             adapter merged in; pass --merge (the adapter itself is already in PEFT's format)"
        );
    }
    let mut src = Source::open(source, None)?;
    if let Some(dir) = adapter {
        src = src.with_adapter(dir)?;
    } else if src.lora && !merge {
        let run = src.run_dir.as_deref().unwrap_or(source);
        bail!(
            "{} is a LoRA run: its adapters are in PEFT's format in {} (what \
             peft.PeftModel.from_pretrained loads); pass --merge to write the base model \
             with them merged in",
            source.display(),
            run.join("adapter").display()
        );
    } else if merge && !src.lora {
        bail!(
            "--merge: {} has no LoRA adapters; pass --adapter DIR",
            source.display()
        );
    }
    if out.exists() && !out.is_dir() {
        bail!("--out {}: is a file; give a directory", out.display());
    }
    let model_type = match &src.model {
        ModelConfig::Gpt2(c) => {
            import::write_hf(out, c, &src.weights)?;
            "gpt2"
        }
        ModelConfig::Llama(c) => {
            import_llama::write_hf(out, c, &src.weights)?;
            import_llama::family(c).0
        }
    };
    let mut tokenizer_files = vec![];
    if let Ok(TextCodec::Tokens(Tokenizer::Hf(t))) = &src.codec {
        // transformers' generate reads BOS and EOS from config.json where no
        // generation_config.json says them.
        let path = out.join(import::HF_CONFIG);
        let text = std::fs::read_to_string(&path)
            .with_context(|| format!("reading back {}", path.display()))?;
        let mut cfg: serde_json::Value = serde_json::from_str(&text)?;
        if let Some(b) = t.bos {
            cfg["bos_token_id"] = b.into();
        }
        match t.eos.as_slice() {
            [] => {}
            [one] => cfg["eos_token_id"] = (*one).into(),
            many => cfg["eos_token_id"] = many.into(),
        }
        std::fs::write(&path, serde_json::to_string_pretty(&cfg)?)
            .with_context(|| format!("writing {}", path.display()))?;
        let from = t.file.parent().unwrap_or(Path::new("."));
        for name in TOKENIZER_FILES {
            let f = from.join(name);
            let to = out.join(name);
            if f.is_file() && f != to {
                std::fs::copy(&f, &to)
                    .with_context(|| format!("copying {} to {}", f.display(), to.display()))?;
                tokenizer_files.push(to);
            }
        }
    }
    Ok(Exported {
        dir: out.to_path_buf(),
        model_type,
        tokenizer_files,
    })
}
