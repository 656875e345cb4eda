//! A trained model, loaded: a `kiln train` checkpoint with what its run recorded (sizes,
//! precision, data and so its tokenizer), or weights imported from a Hugging Face GPT-2
//! or Llama-family directory or an llm.c `.bin`. [`Source`] builds the network that
//! scores it ([`evaluate`](super::evaluate)) and the generator that samples from it;
//! `kiln eval`, `kiln sample`, an app and the web build all load models through here.

use std::path::{Path, PathBuf};

use serde_json::Value;

use super::checkpoint::{self, CheckpointError, HostTensor, MODEL_FILE};
use super::runs::{self, RunError};
use crate::data::hf_tokenizer::TOKENIZER_FILE;
use crate::data::text_codec::TextCodec;
use crate::data::{DataError, HfTokenizer, Sidecar, Tokenizer};
use crate::models::generate::Generator;
use crate::models::gpt::Gpt;
use crate::models::import_llama;
use crate::models::llama::Llama;
use crate::models::lora::{read_peft, Lora, LoraConfig};
use crate::models::Model;
use crate::models::{ModelConfig, Network, NetworkOptions, ParamSpec};
use crate::{DType, Device, HostData, Optimizer};

/// Why a model could not be loaded or built: the message names the file and the fix.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct LoadError(String);

impl LoadError {
    pub fn msg(m: impl Into<String>) -> LoadError {
        LoadError(m.into())
    }
}

impl From<crate::Error> for LoadError {
    fn from(e: crate::Error) -> LoadError {
        LoadError(e.to_string())
    }
}

impl From<CheckpointError> for LoadError {
    fn from(e: CheckpointError) -> LoadError {
        LoadError(e.to_string())
    }
}

impl From<RunError> for LoadError {
    fn from(e: RunError) -> LoadError {
        LoadError(e.to_string())
    }
}

impl From<DataError> for LoadError {
    fn from(e: DataError) -> LoadError {
        LoadError(e.to_string())
    }
}

pub type Result<T, E = LoadError> = std::result::Result<T, E>;

/// Returns a [`LoadError`] with the formatted message.
macro_rules! fail {
    ($($t:tt)*) => {
        return Err(LoadError(format!($($t)*)))
    };
}

/// A trained model: the weights of a `kiln train` checkpoint with what its run recorded
/// (sizes, precision, data), or GPT-2 weights imported from a Hugging Face directory or
/// an llm.c `.bin`.
pub struct Source {
    /// The run directory the checkpoint belongs to; `None` for an imported file.
    pub run_dir: Option<PathBuf>,
    /// The checkpoint directory or the imported file.
    pub origin: PathBuf,
    /// The checkpoint's step; `None` for an imported file.
    pub step: Option<u64>,
    /// One tensor per parameter, under the model's names.
    pub weights: Vec<HostTensor>,
    pub model: ModelConfig,
    /// The dtype the model runs in: the run's storage dtype, or what `--dtype` chose.
    pub dtype: DType,
    /// The run's `config.json` (null for an imported file).
    pub record: Value,
    /// How its token ids become text, or why that cannot be told (an imported vocabulary
    /// of neither GPT-2's nor bytes' size, a token file without a sidecar): only
    /// sampling needs it ([`Source::text_codec`]); scoring token ids does not.
    pub codec: std::result::Result<TextCodec, String>,
    /// What the user should know (a dangling `latest`, a tokenizer inferred).
    pub notes: Vec<String>,
    /// The context it runs with: positions per scored row, the generator's cache. The
    /// model's block_size, except for an imported Llama (see [`IMPORT_CONTEXT`]).
    pub context: usize,
    /// LoRA adapters were merged into the weights (a LoRA run, or `--adapter`).
    pub lora: bool,
}

/// The longest context an imported Llama runs with unless asked (`kiln eval --seq`):
/// their configs give what the model can reach (8192 for SmolLM2, 131072 for Llama
/// 3.2), whose activations or K/V cache would not fit a small device.
pub const IMPORT_CONTEXT: usize = 1024;

const SOURCE_HELP: &str = "pass a run directory (runs/NAME, written by `kiln train`), one of \
                           its checkpoints (runs/NAME/checkpoints/step-N), a Hugging Face GPT-2 \
                           or Llama-family directory (config.json + model.safetensors or \
                           shards) or an llm.c .bin";

/// The dtype imported weights run in when `--dtype` does not say: 16-bit, as training
/// stores its weights (an f32 GPT-2's embedding is over lavapipe's 128 MiB binding).
pub const IMPORT_DTYPE: DType = DType::F16;

impl Source {
    /// Opens a run directory (its latest checkpoint), a checkpoint directory, or a model
    /// file to import. `dtype`: run in this dtype instead of the weights' own (rounded
    /// once, to nearest even).
    pub fn open(path: &Path, dtype: Option<DType>) -> Result<Source> {
        let meta = std::fs::metadata(path).map_err(|e| {
            let what = if e.kind() == std::io::ErrorKind::NotFound {
                "does not exist".to_string()
            } else {
                format!("cannot read it ({e})")
            };
            LoadError::msg(format!("{}: {what}; {SOURCE_HELP}", path.display()))
        })?;
        if let Some(d) = dtype {
            if !d.is_float() {
                fail!("--dtype {d}: a model runs in f32, f16 or bf16");
            }
        }
        // A Hugging Face directory has a config.json as a run does, and a
        // model.safetensors as a checkpoint does, but no manifest.json; a run never holds
        // a model.safetensors at its top.
        let hf_dir = meta.is_dir()
            && (path.join(MODEL_FILE).is_file() || path.join(import_llama::HF_INDEX).is_file())
            && !path.join(checkpoint::MANIFEST_FILE).is_file();
        if meta.is_file() || hf_dir {
            return import(path, dtype);
        }
        if !meta.is_dir() {
            fail!(
                "{}: not a file or directory (a device or a pipe); {SOURCE_HELP}",
                path.display()
            );
        }
        let is_run = path.join(runs::CONFIG_FILE).is_file();
        if !is_run && !path.join(checkpoint::MANIFEST_FILE).is_file() {
            fail!(
                "{}: holds neither a run ({}), a checkpoint ({}) nor a model.safetensors; \
                 {SOURCE_HELP}",
                path.display(),
                runs::CONFIG_FILE,
                checkpoint::MANIFEST_FILE
            );
        }
        let (run_dir, ck) = if is_run {
            let ck = match checkpoint::load_latest(path) {
                Err(checkpoint::CheckpointError::NoCheckpoint { detail, .. }) => fail!(
                    "{}: the run saved no checkpoint{detail}, so there are no weights to load; \
                     let it train to its first checkpoint (kiln train --resume --out {})",
                    path.display(),
                    path.display()
                ),
                r => r?,
            };
            (path.to_path_buf(), ck)
        } else {
            // runs/NAME/checkpoints/step-N: the run is two levels up.
            let run = path
                .parent()
                .filter(|p| p.file_name() == Some(checkpoint::CHECKPOINTS_DIR.as_ref()))
                .and_then(Path::parent)
                .filter(|r| r.join(runs::CONFIG_FILE).is_file());
            let Some(run) = run else {
                fail!(
                    "{}: a checkpoint outside a run directory: the model's sizes are in the \
                     run's {}, two levels up (runs/NAME/checkpoints/step-N); keep the \
                     checkpoint inside its run directory",
                    path.display(),
                    runs::CONFIG_FILE
                );
            };
            (run.to_path_buf(), checkpoint::load(path)?)
        };
        let record = runs::read_config(&run_dir)?;
        let model = ModelConfig::parse(&record["model"].to_string()).map_err(|e| {
            LoadError::msg(format!(
                "{}: its `model` is not a model config ({e}); the run was not written by this \
                 version of kiln train",
                run_dir.join(runs::CONFIG_FILE).display()
            ))
        })?;
        let mut weights = ck.file(MODEL_FILE)?.tensors.clone();
        let stored = weights.first().map(|t| t.data.dtype()).ok_or_else(|| {
            LoadError::msg(format!(
                "{}: {MODEL_FILE} holds no tensor",
                ck.dir.display()
            ))
        })?;
        let mut notes = ck.notes.clone();
        if let Some(lora) = record.get("lora") {
            weights = lora_run_weights(&run_dir, &record, lora, &ck, &model, &mut notes)?;
        }
        let codec = codec_of(&record, &model, &mut notes).map_err(|e| e.to_string());
        Ok(Source {
            run_dir: Some(run_dir),
            origin: ck.dir.clone(),
            step: Some(ck.step()),
            weights,
            context: model.block_size(),
            model,
            dtype: dtype.unwrap_or(stored),
            lora: record.get("lora").is_some(),
            record,
            codec,
            notes,
        })
    }

    /// The model with the LoRA adapter in `dir` (PEFT's format: `adapter_config.json`,
    /// `adapter_model.safetensors`) merged into its weights (`--adapter`): refused when
    /// the adapter was trained on another base (names, shapes, targets).
    pub fn with_adapter(mut self, dir: &Path) -> Result<Source> {
        let adapter = read_peft(dir)?;
        let lora = Lora::new(self.model.build(self.context), adapter.config.clone())
            .map_err(|e| LoadError::msg(format!("--adapter {}: {e}", dir.display())))?;
        let names = lora.adapter_names();
        if let Some(t) = adapter.tensors.iter().find(|t| !names.contains(&t.name)) {
            fail!(
                "--adapter {}: it holds `{}`, which {} does not have: it was trained on \
                 another base model",
                dir.display(),
                t.name,
                lora.describe()
            );
        }
        self.weights = lora
            .merge(&self.weights, &adapter.tensors)
            .map_err(|e| LoadError::msg(format!("--adapter {}: {e}", dir.display())))?;
        self.notes.push(format!(
            "LoRA adapter {} (r {}, {} modules) merged into the weights",
            dir.display(),
            lora.config.r,
            lora.adapted.len()
        ));
        self.lora = true;
        Ok(self)
    }

    /// Runs with a context of `seq` positions instead (`kiln eval --seq`): at most the
    /// model's block_size.
    pub fn with_context(mut self, seq: usize) -> Result<Source> {
        let most = self.model.block_size();
        if seq == 0 || seq > most {
            fail!(
                "--seq {seq}: give 1 to {most} positions (the model's block_size, the longest \
                 context it has weights or training for)"
            );
        }
        self.context = seq;
        Ok(self)
    }

    /// The tokenizer that turns text into this model's ids and back, or an error saying
    /// why there is none here and what works without one.
    pub fn text_codec(&self) -> Result<TextCodec> {
        self.codec.clone().map_err(|why| {
            LoadError::msg(format!(
                "{why}, so text cannot be turned into its tokens or back; `kiln eval \
                 SOURCE --data FILE.bin` scores token ids without a tokenizer"
            ))
        })
    }

    /// What to tell the user where the context is shorter than the model takes.
    pub fn context_note(&self) -> Option<String> {
        let most = self.model.block_size();
        (self.context < most).then(|| {
            format!(
                "running with a context of {} positions (the model takes up to {most}); \
                 kiln eval --seq N changes it",
                self.context
            )
        })
    }

    /// The context the model runs with ([`Source::context`]).
    pub fn block_size(&self) -> usize {
        self.context
    }

    /// The weights of `spec` in the source's dtype, checked against its shape.
    fn weight(&self, spec: &ParamSpec) -> Result<HostData> {
        let t = self
            .weights
            .iter()
            .find(|t| t.name == spec.name || Some(&t.name) == spec.tied.as_ref())
            .ok_or_else(|| {
                LoadError::msg(format!(
                    "{}: no tensor `{}` {:?}; it was saved from another model",
                    self.origin.display(),
                    spec.name,
                    spec.shape
                ))
            })?;
        if t.shape != spec.shape {
            fail!(
                "{}: tensor `{}` is {:?}, but the model expects {:?}",
                self.origin.display(),
                t.name,
                t.shape,
                spec.shape
            );
        }
        Ok(if t.data.dtype() == self.dtype {
            t.data.clone()
        } else {
            // Widening to f32 is exact, so this rounds once.
            HostData::from_f32(self.dtype, &t.data.to_f32())
        })
    }

    /// The model on `dev` with the source's weights, for micro-batches of `batch`
    /// sequences of `block_size` tokens; `packed`: rows that pack several documents
    /// ([`MicroBatch::packed`](crate::models::MicroBatch::packed)).
    pub fn network(&self, dev: &dyn Device, batch: usize, packed: bool) -> Result<Network> {
        let options = NetworkOptions {
            batch,
            dtype: self.dtype,
            // Never stepped: the network only runs forward.
            optimizer: Optimizer::adamw(0.0, 0.0),
            seed: 0,
            packed,
        };
        let net = Network::new(dev, self.model.build(self.block_size()), &options)?;
        let specs: Vec<_> = net.specs().cloned().collect();
        for (i, spec) in specs.iter().enumerate() {
            net.set_value(dev, i, &self.weight(spec)?)?;
        }
        Ok(net)
    }

    /// The model on `dev` with the source's weights, generating with a key/value cache
    /// on the device (GPT-2 and Llama models).
    pub fn generator(&self, dev: &dyn Device) -> Result<Generator> {
        let block_size = self.block_size();
        let model = self.model.build(block_size);
        let weights = model
            .parameters()
            .iter()
            .map(|spec| Ok((spec.name.clone(), self.weight(spec)?.to_f32())))
            .collect::<Result<Vec<_>>>()?;
        Ok(match &self.model {
            ModelConfig::Gpt2(cfg) => {
                let gpt = Gpt::new(cfg.clone(), block_size);
                Generator::new(dev, &gpt, &weights, self.dtype, block_size)?
            }
            ModelConfig::Llama(cfg) => {
                let llama = Llama::new(cfg.clone(), block_size);
                Generator::new(dev, &llama, &weights, self.dtype, block_size)?
            }
        })
    }
}

/// The weights of a LoRA run's checkpoint `ck`: its base model read again from where
/// the run started (`init_from` in its record) with the checkpoint's adapters (their
/// f32 masters) merged in.
fn lora_run_weights(
    run_dir: &Path,
    record: &Value,
    lora: &Value,
    ck: &checkpoint::Checkpoint,
    model: &ModelConfig,
    notes: &mut Vec<String>,
) -> Result<Vec<HostTensor>> {
    let config: LoraConfig = serde_json::from_value(lora.clone()).map_err(|e| {
        LoadError::msg(format!(
            "{}: its `lora` settings do not read ({e})",
            run_dir.join(runs::CONFIG_FILE).display()
        ))
    })?;
    let Some(from) = record.get("init_from").and_then(Value::as_str) else {
        fail!(
            "{}: a LoRA run on random base weights (no --init-from): its checkpoints hold \
             the adapters only, and the base is not saved anywhere to merge them into",
            run_dir.display()
        );
    };
    let base = Source::open(Path::new(from), None).map_err(|e| {
        LoadError::msg(format!(
            "{}: a LoRA run's base model is read from {from}, where it started: {e}",
            run_dir.display()
        ))
    })?;
    let adapters = ck.masters()?;
    let lora = Lora::new(model.build(model.block_size()), config)?;
    // The run may train a GPT-2 on fewer positions than the base has (--seq): its
    // position table cut as the run's was.
    let mut base_weights = base.weights;
    if let ModelConfig::Gpt2(c) = model {
        if c.block_size < base.model.block_size() {
            crate::models::import::cut_positions(&mut base_weights, c.block_size)?;
        }
    }
    // The base must be the one the adapters were trained on: a run directory given as
    // --init-from may have trained on since (a resume refuses the same). The run
    // fingerprinted it as --init-from reads it: a Kiln checkpoint's f32 masters.
    if let Some(want) = record.get("base_fingerprint").and_then(Value::as_str) {
        let mut read = match base.run_dir {
            Some(_) => checkpoint::load(&base.origin)?.trained_weights()?,
            None => base_weights.clone(),
        };
        if let ModelConfig::Gpt2(c) = model {
            if c.block_size < base.model.block_size() {
                crate::models::import::cut_positions(&mut read, c.block_size)?;
            }
        }
        if crate::models::lora::base_fingerprint(&read) != want {
            fail!(
                "{}: a LoRA run's base model is read from {from}, where it started, but its \
                 weights are no longer the ones the adapters were trained on (their \
                 fingerprint differs): merging would give another model. Point the run at \
                 the original base, or use its adapters (RUN/adapter) with that base \
                 through --adapter",
                run_dir.display()
            );
        }
    }
    let merged = lora.merge(&base_weights, &adapters)?;
    notes.push(format!(
        "a LoRA run: its adapters (r {}, {} modules) merged into the base from {from}",
        lora.config.r,
        lora.adapted.len()
    ));
    Ok(merged)
}

/// A Hugging Face Llama-family directory, decoded with its `tokenizer.json`: it runs
/// with a context of at most [`IMPORT_CONTEXT`] (and its sliding window).
fn import_llama_dir(path: &Path, dtype: Option<DType>) -> Result<Source> {
    let m = import_llama::read_hf(path)?;
    let codec = hf_codec(path, m.config.vocab_size)?;
    let most = m.config.block_size;
    let context = most
        .min(IMPORT_CONTEXT)
        .min(m.config.sliding_window.unwrap_or(usize::MAX));
    // The checkpoint's own 16-bit dtype: Llama 3 and Qwen2 are published in bf16, and
    // their activations can overflow f16's range.
    let stored = m.weights.first().map(|t| t.data.dtype());
    let own = stored.filter(|d| d.size() == 2).unwrap_or(IMPORT_DTYPE);
    Ok(Source {
        run_dir: None,
        origin: path.to_path_buf(),
        step: None,
        weights: m.weights,
        model: ModelConfig::Llama(m.config),
        dtype: dtype.unwrap_or(own),
        lora: false,
        record: Value::Null,
        codec,
        notes: vec![],
        context,
    })
}

/// The tokenizer of a Hugging Face model directory: its `tokenizer.json`, whose ids must
/// all be rows of the model's embedding (it may have more rows, padding). `Err` (a
/// reason) where the directory has none; a tokenizer that does not fit is an error.
pub fn hf_codec(dir: &Path, vocab_rows: usize) -> Result<std::result::Result<TextCodec, String>> {
    if !dir.join(TOKENIZER_FILE).is_file() {
        return Ok(Err(format!(
            "{} has no {TOKENIZER_FILE} (download it with the weights)",
            dir.display()
        )));
    }
    let t = HfTokenizer::open(dir)?;
    if t.vocab_size() > vocab_rows {
        fail!(
            "{}: the tokenizer has {} ids but the model's embedding only {vocab_rows} rows: \
             they are of different models",
            t.file.display(),
            t.vocab_size()
        );
    }
    Ok(Ok(TextCodec::Tokens(Tokenizer::Hf(std::sync::Arc::new(t)))))
}

/// GPT-2 weights from a Hugging Face directory or `.safetensors` file, or an llm.c
/// `.bin` (the importer tells them apart); the tokenizer follows the vocabulary. A
/// Hugging Face Llama-family directory goes to [`import_llama_dir`].
fn import(path: &Path, dtype: Option<DType>) -> Result<Source> {
    if path.is_dir() {
        let kind = import_llama::model_type(path)?;
        if kind.is_some_and(|k| import_llama::LLAMA_TYPES.contains(&k.as_str())) {
            return import_llama_dir(path, dtype);
        }
    }
    let imported = crate::models::import::read(path)?;
    let cfg = imported.config.clone();
    let codec = if cfg.vocab_size == Tokenizer::Gpt2.vocab_size() {
        Ok(TextCodec::Tokens(Tokenizer::Gpt2))
    } else if cfg.vocab_size == Tokenizer::Bytes.vocab_size() {
        Ok(TextCodec::Tokens(Tokenizer::Bytes))
    } else {
        Err(format!(
            "{}: a vocabulary of {} is neither GPT-2's ({}) nor bytes' (256), the two \
             tokenizers Kiln has",
            path.display(),
            cfg.vocab_size,
            Tokenizer::Gpt2.vocab_size()
        ))
    };
    Ok(Source {
        run_dir: None,
        origin: imported.path.clone(),
        step: None,
        weights: imported.weights,
        context: cfg.block_size,
        model: ModelConfig::Gpt2(cfg),
        dtype: dtype.unwrap_or(IMPORT_DTYPE),
        lora: false,
        record: Value::Null,
        codec,
        notes: vec![],
    })
}

/// The tokenizer of a run's data: the addition task's own; a token file's sidecar; one
/// token per byte for a text file.
fn codec_of(record: &Value, model: &ModelConfig, notes: &mut Vec<String>) -> Result<TextCodec> {
    let data = record["data"].as_str().unwrap_or_default();
    let v = model.vocab_size();
    let codec = if data.starts_with("addition (") {
        TextCodec::Addition
    } else {
        let path = Path::new(data);
        let is_bin = path
            .extension()
            .is_some_and(|e| e.eq_ignore_ascii_case("bin"));
        let side = if is_bin {
            Sidecar::read_for(path)?
        } else {
            None
        };
        match side {
            Some(s) => TextCodec::Tokens(
                Tokenizer::of_sidecar(&s, &Sidecar::path_for(path)).map_err(|e| {
                    LoadError::msg(format!(
                        "{}: the token file's tokenizer: {e}",
                        Sidecar::path_for(path).display()
                    ))
                })?,
            ),
            None if !is_bin && !data.is_empty() => TextCodec::Tokens(Tokenizer::Bytes),
            // The token file moved (or was named relative to another directory): its
            // vocabulary size still says which tokenizer made it.
            // (A GPT-2 vocabulary, padded or not: a Llama's larger one is another
            // tokenizer's, which only the sidecar can name.)
            None if matches!(model, ModelConfig::Gpt2(_)) && v >= Tokenizer::Gpt2.vocab_size() => {
                notes.push(format!(
                    "the run's data {data:?} is not here to say its tokenizer; decoding with \
                     GPT-2's (the model's vocabulary is {v})"
                ));
                TextCodec::Tokens(Tokenizer::Gpt2)
            }
            None if v == Tokenizer::Bytes.vocab_size() => TextCodec::Tokens(Tokenizer::Bytes),
            // The file is here, made by another tool: nothing tells its tokenizer.
            None if path.is_file() => fail!(
                "the run trained on {data:?}, which has no sidecar {} naming its tokenizer \
                 (it was not made by kiln prepare), and a vocabulary of {v} is neither \
                 GPT-2's nor bytes'",
                Sidecar::path_for(path).display()
            ),
            None => fail!(
                "the run trained on {data:?}, which is not here to say its tokenizer (no \
                 sidecar {}), and a vocabulary of {v} is neither GPT-2's nor bytes': run kiln \
                 from the directory the run was started in",
                Sidecar::path_for(path).display()
            ),
        }
    };
    if v < codec.vocab_size() {
        fail!(
            "the model's vocabulary of {v} is smaller than the {} tokenizer's {}: the run's \
             {} does not match its data",
            codec.name(),
            codec.vocab_size(),
            runs::CONFIG_FILE
        );
    }
    Ok(codec)
}
