//! `kiln train --init-from PATH`: the weights a new run starts from, and the model
//! sizes that come with them.
//!
//! PATH is a Kiln run directory (its latest checkpoint), one of its checkpoint
//! directories, a Hugging Face directory — GPT-2, or a Llama-family model (`model_type`
//! `llama`, `qwen2` or `mistral`: SmolLM2, TinyLlama, Llama 2/3.x, Qwen2.5, Mistral; one
//! `model.safetensors` or shards with their index) — or a GPT-2 `model.safetensors` (with its `config.json`),
//! or an llm.c `.bin`.
//!
//! Only the weights are taken, never the optimizer state: a fine-tuning run has its own
//! learning rate, schedule and data, and Adam's moments and step count from another run
//! would bias its first steps (their bias correction assumes they were built on this
//! loss). From a Kiln checkpoint the f32 master weights are taken (not the 16-bit model
//! copy), so nothing of the earlier run's precision is lost. To continue the *same* run,
//! optimizer included, there is `--resume`.

use std::path::Path;

use anyhow::{bail, Context, Result};

use kiln_engine::data::hf_tokenizer::TOKENIZER_FILE;
use kiln_engine::data::{HfTokenizer, Sidecar};
use kiln_engine::device::host::HostTensor;
use kiln_engine::models::ModelConfig;
use kiln_engine::models::{import, import_llama};
use kiln_engine::train::checkpoint;
use kiln_engine::train::runs;

/// GPT-2's BPE vocabulary (`kiln prepare --tokenizer gpt2`).
const GPT2_VOCAB: usize = 50257;
/// The bytes tokenizer's vocabulary.
const BYTES_VOCAB: usize = 256;

/// Weights to start a run from, with the model they belong to.
#[derive(Clone, Debug)]
pub struct InitWeights {
    pub model: ModelConfig,
    /// One per parameter, under the model's names.
    pub weights: Vec<HostTensor>,
    /// The path given.
    pub source: String,
    /// What was read, for the log: "the latest checkpoint (step 40) of run …".
    pub describe: String,
    /// A Hugging Face directory's tokenizer (its `tokenizer.json`), which the data
    /// must have been prepared with.
    pub tokenizer: Option<HfTokenizer>,
}

/// The Hugging Face tokenizer a run's data was prepared with (its sidecar names it),
/// which data for a run started from its weights must share; `None` where the data is
/// not a Hugging Face token file (or is not here to say).
fn run_tokenizer(record: &serde_json::Value) -> Result<Option<HfTokenizer>> {
    let data = Path::new(record["data"].as_str().unwrap_or_default());
    let is_bin = data
        .extension()
        .is_some_and(|e| e.eq_ignore_ascii_case("bin"));
    let side = match is_bin {
        true => Sidecar::read_for(data)?,
        false => None,
    };
    match side {
        Some(s) if s.tokenizer == kiln_engine::data::prepare::HF_NAME => {
            match kiln_engine::data::Tokenizer::of_sidecar(&s, &Sidecar::path_for(data))? {
                kiln_engine::data::Tokenizer::Hf(t) => Ok(Some((*t).clone())),
                _ => Ok(None),
            }
        }
        _ => Ok(None),
    }
}

fn vocabulary_name(v: usize) -> &'static str {
    match v {
        GPT2_VOCAB => " (GPT-2's BPE)",
        BYTES_VOCAB => " (bytes)",
        _ => "",
    }
}

impl InitWeights {
    /// Reads PATH (see the module docs); every size and tensor is checked here, before
    /// any device opens.
    pub fn load(path: &Path) -> Result<InitWeights> {
        let source = path.display().to_string();
        let meta = std::fs::metadata(path).map_err(|e| {
            let what = if e.kind() == std::io::ErrorKind::NotFound {
                "does not exist".to_string()
            } else {
                format!("cannot read it ({e})")
            };
            anyhow::anyhow!(
                "--init-from {source}: {what}; give a Kiln run or checkpoint directory, a \
                 Hugging Face GPT-2 directory (model.safetensors + config.json) or an llm.c .bin"
            )
        })?;
        // A Kiln checkpoint holds a model.safetensors too: its manifest tells it apart.
        let kiln_checkpoint = path.join(checkpoint::MANIFEST_FILE).is_file();
        let hf_weights =
            path.join(import::HF_WEIGHTS).exists() || path.join(import_llama::HF_INDEX).exists();
        if meta.is_dir() && !kiln_checkpoint && hf_weights {
            let kind = import_llama::model_type(path)?;
            if kind
                .as_deref()
                .is_some_and(|k| import_llama::LLAMA_TYPES.contains(&k))
            {
                return InitWeights::from_llama(path, source);
            }
        }
        if meta.is_dir() && (kiln_checkpoint || !hf_weights) {
            let (ck, run_dir) = if kiln_checkpoint {
                let ck = checkpoint::load(path)?;
                // <run>/checkpoints/step-…/
                let run = path
                    .parent()
                    .and_then(Path::parent)
                    .map(Path::to_path_buf)
                    .unwrap_or_default();
                (ck, run)
            } else if path.join(checkpoint::CHECKPOINTS_DIR).is_dir() {
                (checkpoint::load_latest(path)?, path.to_path_buf())
            } else {
                bail!(
                    "--init-from {source}: this directory is neither a Kiln run (no \
                     checkpoints/), a Kiln checkpoint (no manifest.json) nor a Hugging Face \
                     model (no model.safetensors); give one of those, or an llm.c .bin"
                );
            };
            return InitWeights::from_checkpoint(&ck, &run_dir, source);
        }
        let imported = import::read(path)?;
        let describe = format!(
            "{} {source} ({} layers, {} embd, {} heads, {} positions, vocab {})",
            imported.format,
            imported.config.n_layer,
            imported.config.n_embd,
            imported.config.n_head,
            imported.config.block_size,
            imported.config.vocab_size
        );
        Ok(InitWeights {
            model: ModelConfig::Gpt2(imported.config),
            weights: imported.weights,
            source,
            describe,
            tokenizer: None,
        })
    }

    /// A Hugging Face Llama directory's weights and sizes.
    fn from_llama(path: &Path, source: String) -> Result<InitWeights> {
        let m = import_llama::read_hf(path)?;
        let c = &m.config;
        let describe = format!(
            "Hugging Face Llama {source} ({} layers, {} embd, {} heads / {} K/V, MLP {}, \
             vocab {}{}, {} file(s))",
            c.n_layer,
            c.n_embd,
            c.n_head,
            c.kv_heads(),
            c.intermediate(),
            c.vocab_size,
            if c.tie_word_embeddings {
                ", tied head"
            } else {
                ""
            },
            m.files.len()
        );
        let tokenizer = match path.join(TOKENIZER_FILE).is_file() {
            true => Some(HfTokenizer::open(path)?),
            false => None,
        };
        if let Some(t) = tokenizer.as_ref().filter(|t| t.vocab_size() > c.vocab_size) {
            bail!(
                "--init-from {source}: its tokenizer has {} ids but the model's embedding only \
                 {} rows: {} and the weights are of different models",
                t.vocab_size(),
                c.vocab_size,
                t.file.display()
            );
        }
        Ok(InitWeights {
            model: ModelConfig::Llama(m.config),
            weights: m.weights,
            source,
            describe,
            tokenizer,
        })
    }

    /// A Kiln checkpoint's weights (its f32 masters where it has them), the sizes from
    /// its run's config.json.
    fn from_checkpoint(
        ck: &checkpoint::Checkpoint,
        run_dir: &Path,
        source: String,
    ) -> Result<InitWeights> {
        let record = runs::read_config(run_dir).with_context(|| {
            format!(
                "--init-from {source}: the model's sizes are recorded in its run's {}, which \
                 cannot be read; give the run directory that holds the checkpoint",
                runs::CONFIG_FILE
            )
        })?;
        if record.get("lora").is_some() {
            anyhow::bail!(
                "--init-from {source}: a LoRA run, whose checkpoints hold its adapters only; \
                 write the base with them merged in (kiln export {} --merge --out DIR) and \
                 start from DIR, or continue the adapters with --init-from BASE --adapter {}",
                run_dir.display(),
                run_dir.join("adapter").display()
            );
        }
        let model = ModelConfig::parse(&record["model"].to_string()).map_err(|e| {
            anyhow::anyhow!(
                "--init-from {source}: the model recorded in {}: {e}",
                run_dir.join(runs::CONFIG_FILE).display()
            )
        })?;
        let weights = ck.trained_weights()?;
        Ok(InitWeights {
            describe: format!(
                "the checkpoint at step {} in {} ({})",
                ck.step(),
                ck.dir.display(),
                model.record()
            ),
            model,
            weights,
            source,
            tokenizer: run_tokenizer(&record)?,
        })
    }

    /// A `--model` given with `--init-from` must describe the same model; only its
    /// `block_size` may be smaller (the position embedding is cut to it).
    pub fn check_model(&self, model: &ModelConfig, path: &Path) -> Result<()> {
        let strip = |m: &ModelConfig| {
            let mut r = m.record();
            if let Some(o) = r.as_object_mut() {
                o.remove("block_size");
                o.remove("max_position_embeddings");
            }
            r
        };
        let (given, have) = (strip(model), strip(&self.model));
        if given != have {
            let mut diffs = vec![];
            let (g, h) = (runs::flatten_json(&given), runs::flatten_json(&have));
            for key in g.keys().chain(h.keys().filter(|k| !g.contains_key(*k))) {
                let show = |v: Option<&serde_json::Value>| {
                    v.map_or("(absent)".to_string(), |v| v.to_string())
                };
                if g.get(key) != h.get(key) {
                    diffs.push(format!(
                        "{key} {} vs {}",
                        show(g.get(key)),
                        show(h.get(key))
                    ));
                }
            }
            bail!(
                "--model {} disagrees with the weights of --init-from {}: {}. The sizes come \
                 from the weights: leave --model out, or give the same sizes (only block_size \
                 may be smaller)",
                path.display(),
                self.source,
                diffs.join(", ")
            );
        }
        if model.block_size() > self.model.block_size() {
            bail!(
                "--model {} asks for block_size {}, but the weights of --init-from {} have {} \
                 positions; a block_size of at most {} fits them",
                path.display(),
                model.block_size(),
                self.source,
                self.model.block_size(),
                self.model.block_size()
            );
        }
        Ok(())
    }

    /// Data for a Hugging Face model with a tokenizer must be made with that tokenizer:
    /// its sidecar (`sidecar`, where the data has one) records the same tokenizer.json
    /// SHA-256. Returns whether it does (the data's vocabulary may then be smaller than
    /// the embedding's rows, as Qwen2's is); `false` where the model has no tokenizer.
    pub fn check_tokenizer(&self, sidecar: Option<&Sidecar>, data_name: &str) -> Result<bool> {
        let Some(t) = &self.tokenizer else {
            return Ok(false);
        };
        let fix = format!(
            "prepare it with the model's tokenizer: kiln prepare TEXT OUT.bin --tokenizer {}",
            self.source
        );
        match sidecar {
            Some(s) if s.tokenizer_sha256.as_deref() == Some(t.sha256.as_str()) => Ok(true),
            Some(s) => bail!(
                "{data_name} was tokenized by {}, but the weights of --init-from {} read the \
                 ids of {} (SHA-256 {}): the same ids would stand for other text; {fix}",
                match (&s.tokenizer_file, &s.tokenizer_sha256) {
                    (Some(f), Some(h)) => format!("{} (SHA-256 {h})", f.display()),
                    _ => format!("the `{}` tokenizer", s.tokenizer),
                },
                self.source,
                t.file.display(),
                t.sha256
            ),
            None => bail!(
                "{data_name} has no sidecar naming its tokenizer (a text file is read one token \
                 per byte), but the weights of --init-from {} read the ids of {}; {fix}",
                self.source,
                t.file.display()
            ),
        }
    }

    /// The data's token ids must be the ones the weights were trained on: the same
    /// vocabulary (a byte file fed to GPT-2 would train it on nonsense ids).
    pub fn check_vocabulary(
        &self,
        model: &ModelConfig,
        data_vocab: Option<usize>,
        data_name: &str,
    ) -> Result<()> {
        let v = model.vocab_size();
        match data_vocab {
            Some(d) if d != v => bail!(
                "{data_name} holds token ids of a vocabulary of {d}{}, but the weights of \
                 --init-from {} have a vocabulary of {v}{}: the ids would stand for other \
                 tokens. Prepare the data with the model's tokenizer{}",
                vocabulary_name(d),
                self.source,
                vocabulary_name(v),
                if v == GPT2_VOCAB {
                    " (`kiln prepare --tokenizer gpt2 TEXT OUT.bin`)"
                } else {
                    ""
                }
            ),
            _ => Ok(()),
        }
    }

    /// The weights for `model` (checked by [`InitWeights::check_model`]): GPT-2's
    /// position embedding cut to its block_size.
    pub fn weights_for(&self, model: &ModelConfig) -> Result<Vec<HostTensor>> {
        let mut w = self.weights.clone();
        if let ModelConfig::Gpt2(c) = model {
            if c.block_size < self.model.block_size() {
                import::cut_positions(&mut w, c.block_size)
                    .with_context(|| format!("--init-from {}", self.source))?;
            }
        }
        Ok(w)
    }
}
