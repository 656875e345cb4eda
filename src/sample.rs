//! `kiln sample`: text from a trained model. A [`Source`] is a model as `kiln train`
//! left it (a run directory's latest checkpoint, or one checkpoint directory) with the
//! sizes, precision and tokenizer of its run, or GPT-2 weights imported from a file; [`generate`] feeds a prompt and draws
//! new tokens one at a time through a [`Decoder`], streaming each as it comes.

use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::{bail, Context, Result};
use serde_json::Value;

use kiln_engine::data::hf_tokenizer::TOKENIZER_FILE;
use kiln_engine::data::{Addition, HfTokenizer, Sidecar, Tokenizer};
use kiln_engine::models::generate::Generator;
use kiln_engine::models::gpt::Gpt;
use kiln_engine::models::import_llama;
use kiln_engine::models::llama::Llama;
use kiln_engine::models::sample::TokenSampler;
use kiln_engine::models::{MicroBatch, ModelConfig, Network, NetworkOptions, ParamSpec};
use kiln_engine::train::checkpoint::{self, HostTensor, MODEL_FILE};
use kiln_engine::train::runs;
use kiln_engine::{DType, Device, HostData, Optimizer, IGNORE_TARGET};

/// How token ids become text and back, as the run's data was tokenized.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum TextCodec {
    /// The built-in addition task's 13 tokens (digits, `+`, `=`, newline).
    Addition,
    /// `kiln prepare`'s tokenizers: GPT-2's BPE, one token per byte, or a Hugging Face
    /// model's.
    Tokens(Tokenizer),
}

impl TextCodec {
    /// Ids the tokenizer has: only these are ever sampled, whatever rows a (padded)
    /// model vocabulary has beyond them.
    pub fn vocab_size(&self) -> usize {
        match self {
            TextCodec::Addition => Addition::vocab_size(),
            TextCodec::Tokens(t) => t.vocab_size(),
        }
    }

    pub fn name(&self) -> &'static str {
        match self {
            TextCodec::Addition => "addition",
            TextCodec::Tokens(t) => t.name(),
        }
    }

    /// The ids of `text`, or an error naming the first character the vocabulary lacks.
    pub fn encode(&self, text: &str) -> Result<Vec<u32>> {
        match self {
            TextCodec::Addition => Addition::encode(text).ok_or_else(|| {
                let bad = text
                    .chars()
                    .find(|&c| Addition::encode(&c.to_string()).is_none())
                    .unwrap_or('?');
                anyhow::anyhow!(
                    "the prompt {text:?} holds {bad:?}, which the addition model's vocabulary \
                     lacks: it knows the digits 0-9, `+`, `=` and newline (try \"47+85=\")"
                )
            }),
            TextCodec::Tokens(t) => Ok(t.encode(text.as_bytes(), Path::new("the prompt"))?),
        }
    }

    /// The bytes of one token.
    fn bytes(&self, id: u32) -> Result<Vec<u8>> {
        Ok(match self {
            TextCodec::Addition => Addition::decode(&[id]).into_bytes(),
            TextCodec::Tokens(t) => t.decode_bytes(&[id])?,
        })
    }
}

/// Turns tokens into text as they come: a GPT-2 or byte token may end in the middle of
/// a UTF-8 character, which is held back until the bytes that complete it arrive. A
/// Hugging Face tokenizer's decoder may depend on the tokens before (SentencePiece drops
/// the space that starts the text), so its text is the decoded whole less what was
/// shown, held back while it ends in an incomplete character.
pub struct TextStream {
    codec: TextCodec,
    pending: Vec<u8>,
    /// A Hugging Face codec's ids so far and the bytes of their text already shown.
    ids: Vec<u32>,
    shown: usize,
}

impl TextStream {
    pub fn new(codec: TextCodec) -> TextStream {
        TextStream {
            codec,
            pending: vec![],
            ids: vec![],
            shown: 0,
        }
    }

    /// Starts after `prompt`, shown already: a Hugging Face decoder then renders the
    /// first new token as it follows the prompt (with the space between them).
    pub fn after(mut self, prompt: &[u32]) -> Result<TextStream> {
        if let TextCodec::Tokens(Tokenizer::Hf(t)) = &self.codec {
            self.ids = prompt.to_vec();
            self.shown = t.decode(prompt)?.len();
        }
        Ok(self)
    }

    /// The text that `id` completes (possibly empty).
    pub fn push(&mut self, id: u32) -> Result<String> {
        if let TextCodec::Tokens(Tokenizer::Hf(t)) = &self.codec {
            self.ids.push(id);
            let text = t.decode(&self.ids)?;
            if text.ends_with('\u{FFFD}') || !text.is_char_boundary(self.shown.min(text.len())) {
                return Ok(String::new());
            }
            let new = text.get(self.shown..).unwrap_or_default().to_string();
            self.shown = self.shown.max(text.len());
            return Ok(new);
        }
        self.pending.extend(self.codec.bytes(id)?);
        let mut out = String::new();
        loop {
            match std::str::from_utf8(&self.pending) {
                Ok(s) => {
                    out.push_str(s);
                    self.pending.clear();
                    return Ok(out);
                }
                Err(e) => {
                    let good = e.valid_up_to();
                    out.push_str(std::str::from_utf8(&self.pending[..good]).expect("valid"));
                    match e.error_len() {
                        // Bytes that can never be valid: shown as U+FFFD, as decoding
                        // a whole text would.
                        Some(n) => {
                            out.push('\u{FFFD}');
                            self.pending.drain(..good + n);
                        }
                        // An incomplete character at the end: wait for more.
                        None => {
                            self.pending.drain(..good);
                            return Ok(out);
                        }
                    }
                }
            }
        }
    }

    /// What is left at the end (an incomplete character, as U+FFFD).
    pub fn finish(&mut self) -> String {
        if let TextCodec::Tokens(Tokenizer::Hf(t)) = &self.codec {
            let text = t.decode(&self.ids).unwrap_or_default();
            let rest = text.get(self.shown..).unwrap_or_default().to_string();
            self.shown = self.shown.max(text.len());
            return rest;
        }
        let s = String::from_utf8_lossy(&self.pending).into_owned();
        self.pending.clear();
        s
    }
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
            anyhow::anyhow!("{}: {what}; {SOURCE_HELP}", path.display())
        })?;
        if let Some(d) = dtype {
            if !d.is_float() {
                bail!("--dtype {d}: a model runs in f32, f16 or bf16");
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
            bail!(
                "{}: not a file or directory (a device or a pipe); {SOURCE_HELP}",
                path.display()
            );
        }
        let is_run = path.join(runs::CONFIG_FILE).is_file();
        if !is_run && !path.join(checkpoint::MANIFEST_FILE).is_file() {
            bail!(
                "{}: holds neither a run ({}), a checkpoint ({}) nor a model.safetensors; \
                 {SOURCE_HELP}",
                path.display(),
                runs::CONFIG_FILE,
                checkpoint::MANIFEST_FILE
            );
        }
        let (run_dir, ck) = if is_run {
            let ck = match checkpoint::load_latest(path) {
                Err(checkpoint::CheckpointError::NoCheckpoint { detail, .. }) => bail!(
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
                bail!(
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
            anyhow::anyhow!(
                "{}: its `model` is not a model config ({e}); the run was not written by this \
                 version of kiln train",
                run_dir.join(runs::CONFIG_FILE).display()
            )
        })?;
        let weights = ck.file(MODEL_FILE)?.tensors.clone();
        let stored = weights
            .first()
            .map(|t| t.data.dtype())
            .ok_or_else(|| anyhow::anyhow!("{}: {MODEL_FILE} holds no tensor", ck.dir.display()))?;
        let mut notes = ck.notes.clone();
        let codec = codec_of(&record, &model, &mut notes).map_err(|e| format!("{e:#}"));
        Ok(Source {
            run_dir: Some(run_dir),
            origin: ck.dir.clone(),
            step: Some(ck.step()),
            weights,
            context: model.block_size(),
            model,
            dtype: dtype.unwrap_or(stored),
            record,
            codec,
            notes,
        })
    }

    /// Runs with a context of `seq` positions instead (`kiln eval --seq`): at most the
    /// model's block_size.
    pub fn with_context(mut self, seq: usize) -> Result<Source> {
        let most = self.model.block_size();
        if seq == 0 || seq > most {
            bail!(
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
            anyhow::anyhow!(
                "{why}, so text cannot be turned into its tokens or back; `kiln eval \
                 SOURCE --data FILE.bin` scores token ids without a tokenizer"
            )
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
                anyhow::anyhow!(
                    "{}: no tensor `{}` {:?}; it was saved from another model",
                    self.origin.display(),
                    spec.name,
                    spec.shape
                )
            })?;
        if t.shape != spec.shape {
            bail!(
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
    /// ([`MicroBatch::packed`](kiln_engine::models::MicroBatch::packed)).
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
        bail!(
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
    let imported = kiln_engine::models::import::read(path)?;
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
                Tokenizer::of_sidecar(&s, &Sidecar::path_for(path)).with_context(|| {
                    format!(
                        "{}: the token file's tokenizer",
                        Sidecar::path_for(path).display()
                    )
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
            None if path.is_file() => bail!(
                "the run trained on {data:?}, which has no sidecar {} naming its tokenizer \
                 (it was not made by kiln prepare), and a vocabulary of {v} is neither \
                 GPT-2's nor bytes'",
                Sidecar::path_for(path).display()
            ),
            None => bail!(
                "the run trained on {data:?}, which is not here to say its tokenizer (no \
                 sidecar {}), and a vocabulary of {v} is neither GPT-2's nor bytes': run kiln \
                 from the directory the run was started in",
                Sidecar::path_for(path).display()
            ),
        }
    };
    if v < codec.vocab_size() {
        bail!(
            "the model's vocabulary of {v} is smaller than the {} tokenizer's {}: the run's \
             {} does not match its data",
            codec.name(),
            codec.vocab_size(),
            runs::CONFIG_FILE
        );
    }
    Ok(codec)
}

/// What produces next-token logits: fed a prompt, then one token at a time.
pub trait Decoder {
    /// The most tokens it can hold (the model's block_size).
    fn context(&self) -> usize;
    /// Starts a sequence with `prompt`; the logits after its last token.
    fn prefill(&mut self, dev: &dyn Device, prompt: &[u32]) -> Result<Vec<f32>>;
    /// Appends `token`; the logits after it.
    fn step(&mut self, dev: &dyn Device, token: u32) -> Result<Vec<f32>>;
}

/// The reference decoder: every token runs the whole sequence through the training
/// network again (O(T²) work per token). Tests compare faster decoders with it; it is
/// not how `kiln sample` should generate.
pub struct Recompute {
    net: Network,
    tokens: Vec<u32>,
}

impl Recompute {
    /// `net` must run micro-batches of one sequence.
    pub fn new(net: Network) -> Result<Recompute> {
        if net.options().batch != 1 {
            bail!("the reference decoder runs one sequence at a time (batch 1)");
        }
        Ok(Recompute {
            net,
            tokens: vec![],
        })
    }

    fn logits(&self, dev: &dyn Device) -> Result<Vec<f32>> {
        let t = self.context();
        let n = self.tokens.len();
        // Positions after the sequence are filled with token 0: attention is causal,
        // so they change nothing before them; none is scored.
        let mut tok = self.tokens.clone();
        tok.resize(t, 0);
        let tgt = vec![IGNORE_TARGET; t];
        self.net.loss(dev, &MicroBatch::tokens(&tok, &tgt))?;
        let buf = self
            .net
            .output(self.net.prediction())
            .expect("the prediction is a graph output");
        let all = dev.download(buf)?.to_f32();
        let v = all.len() / t;
        Ok(all[(n - 1) * v..n * v].to_vec())
    }
}

impl Decoder for Recompute {
    fn context(&self) -> usize {
        self.net.graph().shape(self.net.prediction())[1]
    }

    fn prefill(&mut self, dev: &dyn Device, prompt: &[u32]) -> Result<Vec<f32>> {
        if prompt.is_empty() || prompt.len() > self.context() {
            bail!(
                "a prompt of {} tokens: the model takes 1 to {}",
                prompt.len(),
                self.context()
            );
        }
        self.tokens = prompt.to_vec();
        self.logits(dev)
    }

    fn step(&mut self, dev: &dyn Device, token: u32) -> Result<Vec<f32>> {
        if self.tokens.len() >= self.context() {
            bail!(
                "the sequence already fills the model's {} positions",
                self.context()
            );
        }
        self.tokens.push(token);
        self.logits(dev)
    }
}

/// The decoder `kiln sample` uses: the prompt runs once, then each new token runs
/// only its own position against the keys and values cached on the device.
pub struct Cached(pub Generator);

impl Decoder for Cached {
    fn context(&self) -> usize {
        self.0.max_len()
    }

    fn prefill(&mut self, dev: &dyn Device, prompt: &[u32]) -> Result<Vec<f32>> {
        self.0.reset();
        Ok(self.0.prefill(dev, prompt)?)
    }

    fn step(&mut self, dev: &dyn Device, token: u32) -> Result<Vec<f32>> {
        Ok(self.0.step(dev, token)?)
    }
}

/// How long a generation took, prompt and new tokens apart.
#[derive(Clone, Copy, Debug, Default)]
pub struct Timing {
    pub prompt_tokens: usize,
    pub prompt_s: f64,
    pub new_tokens: usize,
    /// Drawing the new tokens and feeding each back.
    pub decode_s: f64,
}

impl Timing {
    pub fn prompt_rate(&self) -> f64 {
        self.prompt_tokens as f64 / self.prompt_s.max(1e-9)
    }

    pub fn decode_rate(&self) -> f64 {
        self.new_tokens as f64 / self.decode_s.max(1e-9)
    }
}

/// Checks that a prompt of `prompt` tokens and `new` more fit `context` positions.
/// The last new token is predicted, never fed, so a sequence may reach `context + 1`
/// tokens. Kiln stops at the context rather than sliding a window over it: a window
/// would change what the model sees without saying so.
pub fn check_length(prompt: usize, new: usize, context: usize) -> Result<()> {
    if prompt == 0 {
        bail!("the prompt is empty: give the model some text to continue (--prompt TEXT)");
    }
    if prompt > context {
        bail!(
            "the prompt is {prompt} tokens, longer than the model's context of {context} \
             (its block_size): shorten it"
        );
    }
    if prompt + new > context + 1 {
        bail!(
            "--tokens {new}: after the prompt's {prompt} tokens the model's context of {context} \
             (its block_size) has room for at most {} new tokens (the last one is predicted, \
             not fed back); kiln sample stops at the context rather than sliding a window",
            context + 1 - prompt
        );
    }
    Ok(())
}

/// Feeds `prompt` and draws `new` tokens, handing each to `emit` as it comes; a token
/// of `stop` (the model's end of text) ends it early and is not handed on.
pub fn generate(
    decoder: &mut dyn Decoder,
    dev: &dyn Device,
    prompt: &[u32],
    new: usize,
    sampler: &mut TokenSampler,
    stop: &[u32],
    emit: &mut dyn FnMut(u32) -> Result<()>,
) -> Result<Timing> {
    check_length(prompt.len(), new, decoder.context())?;
    let t0 = Instant::now();
    let mut logits = decoder.prefill(dev, prompt)?;
    let t1 = Instant::now();
    let mut made = 0;
    for i in 0..new {
        let id = sampler.sample(&logits)?;
        // The model's end of text: drawn, not shown or counted.
        if stop.contains(&id) {
            break;
        }
        made += 1;
        emit(id)?;
        if i + 1 < new {
            logits = decoder.step(dev, id)?;
        }
    }
    Ok(Timing {
        prompt_tokens: prompt.len(),
        prompt_s: (t1 - t0).as_secs_f64(),
        new_tokens: made,
        decode_s: t1.elapsed().as_secs_f64(),
    })
}

/// Writes `text` to stdout at once (each token is seen as it comes); a reader that
/// went away (`| head`) ends the output quietly.
pub fn write_now(text: &str) -> Result<()> {
    let mut out = std::io::stdout().lock();
    match out.write_all(text.as_bytes()).and_then(|_| out.flush()) {
        Err(e) if e.kind() != std::io::ErrorKind::BrokenPipe => {
            Err(anyhow::Error::new(e).context("writing the output"))
        }
        _ => Ok(()),
    }
}

/// The one device `--devices` names (default: the best adapter, as `kiln train`).
pub fn open_one_device(devices: &[String]) -> Result<Box<dyn Device>> {
    let specs = if devices.is_empty() {
        vec![crate::devices::default_device()?]
    } else {
        crate::devices::parse_devices(devices)?
    };
    if specs.len() != 1 {
        bail!(
            "--devices {}: names {} devices, and this runs on one; name one (`kiln devices` \
             lists them)",
            devices.join(","),
            specs.len()
        );
    }
    Ok(crate::devices::open_device(
        &specs[0],
        &kiln_wgpu::DeviceOptions::default(),
    )?)
}

/// What `kiln sample` is told.
#[derive(Clone, Debug)]
pub struct SampleOptions {
    /// A run directory or a checkpoint directory.
    pub source: PathBuf,
    /// The text to continue.
    pub prompt: Option<String>,
    /// A file of prompts, one per line, each continued in turn.
    pub prompts: Option<PathBuf>,
    /// New tokens per prompt; `None`: as many as the context holds, at most 256.
    pub tokens: Option<usize>,
    pub sampling: kiln_engine::models::sample::SamplingOptions,
    pub seed: u64,
    pub devices: Vec<String>,
    /// Run in this dtype; `None`: the checkpoint's own (16-bit for imported files).
    pub dtype: Option<DType>,
    /// Each prompt is a user's message, put in the model's chat template (an instruct
    /// model's Hugging Face tokenizer has one); the model answers it.
    pub chat: bool,
}

/// New tokens when `--tokens` is not given, if the context has room for them.
const DEFAULT_NEW_TOKENS: usize = 256;

/// Reads the prompts and checks every one (vocabulary, length) before any device opens.
fn prompts(opts: &SampleOptions, source: &Source) -> Result<Vec<(String, Vec<u32>, usize)>> {
    let texts: Vec<String> = match (&opts.prompt, &opts.prompts) {
        (Some(_), Some(_)) => bail!("pass --prompt TEXT or --prompts FILE, not both"),
        (Some(p), None) => vec![p.clone()],
        (None, Some(file)) => {
            let text = std::fs::read_to_string(file)
                .with_context(|| format!("reading the prompts file {}", file.display()))?;
            let lines: Vec<String> = text
                .lines()
                .filter(|l| !l.trim().is_empty())
                .map(str::to_string)
                .collect();
            if lines.is_empty() {
                bail!("{}: no prompt in it (one per line)", file.display());
            }
            lines
        }
        (None, None) => bail!("no prompt: pass --prompt TEXT (or --prompts FILE, one per line)"),
    };
    let context = source.block_size();
    let codec = source.text_codec()?;
    if opts.tokens == Some(0) {
        bail!(
            "--tokens 0 asks for no new token: pass 1 to {context} (this model's context), or \
             leave it out for as many as the context holds, at most {DEFAULT_NEW_TOKENS}"
        );
    }
    let chat = match (&codec, opts.chat) {
        (_, false) => None,
        (TextCodec::Tokens(Tokenizer::Hf(t)), true) => Some(t.clone()),
        (other, true) => bail!(
            "--chat needs a Hugging Face tokenizer with a chat template, and this model's \
             tokenizer is {}",
            other.name()
        ),
    };
    texts
        .into_iter()
        .map(|text| {
            let (text, ids) = match &chat {
                // The template marks its own special tokens (BOS included): none added.
                Some(t) => {
                    let rendered = t.chat(&[("user", &text)], true)?;
                    let ids = t.encode(&rendered, false, Path::new("the chat prompt"))?;
                    (format!("{text}\n"), ids)
                }
                None => {
                    let ids = codec.encode(&text)?;
                    (text, ids)
                }
            };
            let room = (context + 1).saturating_sub(ids.len());
            let new = opts.tokens.unwrap_or(DEFAULT_NEW_TOKENS.min(room));
            check_length(ids.len(), new, context).with_context(|| format!("prompt {text:?}"))?;
            Ok((text, ids, new))
        })
        .collect()
}

/// Continues each prompt, streaming the text to stdout; returns the time taken.
pub fn sample(opts: &SampleOptions) -> Result<Timing> {
    let source = Source::open(&opts.source, opts.dtype)?;
    for note in &source.notes {
        crate::say::say(format!("note: {note}"));
    }
    let codec = source.text_codec()?;
    let mut sampler = TokenSampler::new(opts.sampling, codec.vocab_size(), opts.seed)?;
    let work = prompts(opts, &source)?;
    let dev = open_one_device(&opts.devices)?;
    let dev: &dyn Device = dev.as_ref();
    let mut decoder = Cached(source.generator(dev)?);
    // A Hugging Face model's end-of-text tokens end a continuation early.
    let stop = match &codec {
        TextCodec::Tokens(Tokenizer::Hf(t)) => t.eos.clone(),
        _ => vec![],
    };
    let mut total = Timing::default();
    for (text, ids, new) in work {
        write_now(&text)?;
        let mut stream = TextStream::new(codec.clone()).after(&ids)?;
        let mut last = text.chars().last();
        let timing = generate(
            &mut decoder,
            dev,
            &ids,
            new,
            &mut sampler,
            &stop,
            &mut |id| {
                let piece = stream.push(id)?;
                if let Some(c) = piece.chars().last() {
                    last = Some(c);
                }
                write_now(&piece)
            },
        )?;
        let rest = stream.finish();
        if let Some(c) = rest.chars().last() {
            last = Some(c);
        }
        write_now(&rest)?;
        if last != Some('\n') {
            write_now("\n")?;
        }
        total.prompt_tokens += timing.prompt_tokens;
        total.prompt_s += timing.prompt_s;
        total.new_tokens += timing.new_tokens;
        total.decode_s += timing.decode_s;
    }
    crate::say::say(format!(
        "prompt: {} tokens in {:.1} ms ({:.1} tokens/s); decode: {} tokens in {:.1} ms ({:.1} \
         tokens/s); {} on {} ({})",
        total.prompt_tokens,
        total.prompt_s * 1e3,
        total.prompt_rate(),
        total.new_tokens,
        total.decode_s * 1e3,
        total.decode_rate(),
        source.dtype,
        dev.caps().name,
        dev.caps().backend
    ));
    Ok(total)
}
