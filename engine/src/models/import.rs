//! GPT-2 weights in the files people have them, read into host tensors and written back
//! out: Hugging Face's `model.safetensors` with its `config.json`, and llm.c's
//! `gpt2_124M.bin`.
//!
//! This module lives in `models/` because what it produces is a [`GptConfig`] and one
//! host tensor per parameter of [`Gpt`], named and shaped as [`Model::parameters`]
//! declares them (it asks [`Gpt`] for the list, so the two cannot drift apart); it needs
//! the device layer's host types and nothing above. It reads and writes files only:
//! putting the weights on devices is `Trainer::set_weights` (train/), and finding a
//! Kiln run's latest checkpoint is the caller's (train/checkpoint, the CLI).
//!
//! Layouts. Hugging Face stores GPT-2's projections as `Conv1D` weights, (in, out):
//! Kiln's layout, so they are taken as they are. llm.c stores them as PyTorch `Linear`
//! weights, (out, in), stacked over the layers: they are transposed. Both keep the token
//! embedding as (vocabulary, n_embd); llm.c pads it to `Vp` rows (50304 for GPT-2's
//! 50257), which becomes [`GptConfig::padded_vocab_size`].
//!
//! Hostile files: every size a header states is checked against the file's length
//! before anything is allocated from it, and every error names the file and, where one
//! is at fault, the tensor.

use std::fs::File;
use std::path::{Path, PathBuf};

use memmap2::Mmap;
use safetensors::tensor::{Dtype as StDtype, TensorView};
use safetensors::SafeTensors;
use serde_json::Value;

use super::config::GptConfig;
use super::gpt::Gpt;
use super::Model;
use crate::device::host::HostTensor;
use crate::{DType, Error, HostData, Result};

/// A Hugging Face model directory's weights file.
pub const HF_WEIGHTS: &str = "model.safetensors";
/// A Hugging Face model directory's config file.
pub const HF_CONFIG: &str = "config.json";
/// The first i32 of an llm.c model file.
pub const LLMC_MAGIC: i32 = 20240326;
/// llm.c's header: 256 little-endian i32.
const LLMC_HEADER_BYTES: usize = 256 * 4;
/// The config key an exported padded model records its real vocabulary under
/// (Hugging Face's `vocab_size` must be the embedding's rows, the padded size).
const KILN_VOCAB_KEY: &str = "kiln_vocab_size";

/// Where imported weights came from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Format {
    /// `model.safetensors` + `config.json`.
    HuggingFace,
    /// llm.c's `.bin` (header version 3, f32, or 5, bf16).
    LlmC,
}

impl std::fmt::Display for Format {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Format::HuggingFace => "Hugging Face safetensors",
            Format::LlmC => "llm.c",
        })
    }
}

/// A model read from a file: its sizes and one tensor per parameter of
/// `Gpt::new(config, …)`, in parameter order, under Kiln's names and layout, in the
/// file's dtype (f32, f16 or bf16: setting them rounds once to the model's).
#[derive(Clone, Debug)]
pub struct Imported {
    pub config: GptConfig,
    pub weights: Vec<HostTensor>,
    pub format: Format,
    /// The weights file read.
    pub path: PathBuf,
}

impl Imported {
    /// The model trained on sequences of at most `block_size` tokens: the position
    /// embedding keeps its first `block_size` rows (a model trained on 1024 positions
    /// fine-tuned on 256).
    pub fn with_block_size(mut self, block_size: usize) -> Result<Imported> {
        cut_positions(&mut self.weights, block_size).map_err(|e| wrap(&self.path, e))?;
        self.config.block_size = block_size;
        Ok(self)
    }
}

/// Keeps the first `block_size` rows of GPT-2's position embedding among `weights`
/// (Kiln names): the model fine-tuned on shorter sequences than it was trained on.
pub fn cut_positions(weights: &mut [HostTensor], block_size: usize) -> Result<()> {
    let wpe = weights
        .iter_mut()
        .find(|t| t.name == WPE)
        .ok_or_else(|| Error::InvalidArgument(format!("no position embedding `{WPE}`")))?;
    let (have, c) = match wpe.shape[..] {
        [rows, cols] if rows.checked_mul(cols) == Some(wpe.data.len()) => (rows, cols),
        _ => {
            return Err(Error::InvalidArgument(format!(
                "`{WPE}` has shape {:?} and {} values, not (positions, n_embd) with one \
                 value per element",
                wpe.shape,
                wpe.data.len()
            )))
        }
    };
    if block_size == 0 || block_size > have {
        return Err(Error::InvalidArgument(format!(
            "block_size {block_size} is not within the model's 1 to {have} positions (its \
             position embedding has {have} rows); pick a block_size of at most {have}"
        )));
    }
    let e = wpe.data.dtype().size();
    let bytes = &wpe.data.as_bytes()[..block_size * c * e];
    wpe.data = HostData::from_bytes(wpe.data.dtype(), block_size * c, bytes);
    wpe.shape = vec![block_size, c];
    Ok(())
}

const WPE: &str = "transformer.wpe.weight";
const PREFIX: &str = "transformer.";

pub(super) fn bad(path: &Path, msg: impl std::fmt::Display) -> Error {
    Error::InvalidArgument(format!("`{}`: {msg}", path.display()))
}

/// `e` with the file it is about.
pub(super) fn wrap(path: &Path, e: Error) -> Error {
    match e {
        Error::InvalidArgument(m) => bad(path, m),
        other => other,
    }
}

/// Maps a file read-only, refusing what is not a regular file.
pub(super) fn map(path: &Path) -> Result<Mmap> {
    let file = File::open(path).map_err(|e| bad(path, format!("cannot open it: {e}")))?;
    let meta = file
        .metadata()
        .map_err(|e| bad(path, format!("cannot stat it: {e}")))?;
    if !meta.is_file() {
        return Err(bad(
            path,
            "not a regular file; give a model.safetensors, a directory holding one with its \
             config.json, or an llm.c .bin",
        ));
    }
    if meta.len() == 0 {
        return Err(bad(path, "the file is empty"));
    }
    // SAFETY: read-only and private; model files are not expected to change while they
    // are read, and every tensor is copied out before this function's caller returns.
    unsafe { Mmap::map(&file) }.map_err(|e| bad(path, format!("cannot memory-map it: {e}")))
}

/// Reads GPT-2 weights from `path`: a directory holding `model.safetensors` and
/// `config.json`, a `.safetensors` file (its `config.json` beside it), or an llm.c
/// `.bin` (told by its magic number).
pub fn read(path: &Path) -> Result<Imported> {
    let meta = std::fs::metadata(path).map_err(|e| match e.kind() {
        std::io::ErrorKind::NotFound => bad(path, "does not exist".to_string()),
        _ => bad(path, format!("cannot read it: {e}")),
    })?;
    if meta.is_dir() {
        return read_hf(path);
    }
    let mut head = [0u8; 4];
    let is_llmc = File::open(path)
        .and_then(|mut f| std::io::Read::read_exact(&mut f, &mut head))
        .is_ok()
        && i32::from_le_bytes(head) == LLMC_MAGIC;
    if is_llmc {
        read_llmc(path)
    } else if path.extension().is_some_and(|e| e == "safetensors") {
        read_hf(path)
    } else {
        Err(bad(
            path,
            format!(
                "not a model Kiln can import: expected a Hugging Face directory (model.safetensors \
                 + config.json), a .safetensors file with its config.json beside it, or an llm.c \
                 .bin (which starts with the magic number {LLMC_MAGIC})"
            ),
        ))
    }
}

/// A positive integer field of a config file.
fn size_field(path: &Path, obj: &serde_json::Map<String, Value>, keys: &[&str]) -> Result<usize> {
    let (key, v) = keys
        .iter()
        .find_map(|k| obj.get(*k).map(|v| (*k, v)))
        .ok_or_else(|| {
            bad(
                path,
                format!(
                    "no `{}`; a GPT-2 config.json gives n_layer, n_head, n_embd, n_positions \
                     and vocab_size",
                    keys.join("` or `")
                ),
            )
        })?;
    v.as_u64()
        .filter(|&n| n > 0)
        .and_then(|n| usize::try_from(n).ok())
        .ok_or_else(|| {
            bad(
                path,
                format!("`{key}` is {v}; it must be a positive integer"),
            )
        })
}

/// A model directory's JSON file (`config.json`, a shard index) as an object.
pub(super) fn read_json_object(path: &Path) -> Result<serde_json::Map<String, Value>> {
    let meta = std::fs::metadata(path).map_err(|e| {
        bad(
            path,
            format!(
                "cannot read it ({e}); a Hugging Face model needs its config.json beside \
                 model.safetensors"
            ),
        )
    })?;
    // A config is a few kB; anything past 16 MiB is not one (and not read into memory).
    if !meta.is_file() || meta.len() > 16 << 20 {
        return Err(bad(
            path,
            "not a model JSON file (not a file, or over 16 MiB)",
        ));
    }
    let text =
        std::fs::read_to_string(path).map_err(|e| bad(path, format!("cannot read it: {e}")))?;
    let v: Value = serde_json::from_str(text.strip_prefix('\u{feff}').unwrap_or(&text))
        .map_err(|e| bad(path, format!("not valid JSON: {e}")))?;
    match v {
        Value::Object(obj) => Ok(obj),
        _ => Err(bad(path, "expected a JSON object of model settings")),
    }
}

/// Reads a Hugging Face GPT-2 `config.json`.
pub fn read_hf_config(path: &Path) -> Result<GptConfig> {
    let obj = &read_json_object(path)?;
    if let Some(t) = obj.get("model_type").and_then(Value::as_str) {
        if t != "gpt2" {
            return Err(bad(
                path,
                format!(
                    "model_type is `{t}`; this reads GPT-2 (`gpt2`) checkpoints (a Llama \
                     directory, model_type `llama`, is read by `models::import_llama`, as \
                     `--init-from` does)"
                ),
            ));
        }
    }
    let vocab = size_field(path, obj, &["vocab_size"])?;
    let (vocab_size, padded) = match obj.get(KILN_VOCAB_KEY) {
        None => (vocab, None),
        Some(_) => {
            let real = size_field(path, obj, &[KILN_VOCAB_KEY])?;
            if real > vocab {
                return Err(bad(
                    path,
                    format!(
                        "{KILN_VOCAB_KEY} {real} is above vocab_size {vocab} (the padded size)"
                    ),
                ));
            }
            (real, (real < vocab).then_some(vocab))
        }
    };
    let config = GptConfig {
        n_layer: size_field(path, obj, &["n_layer"])?,
        n_head: size_field(path, obj, &["n_head"])?,
        n_embd: size_field(path, obj, &["n_embd"])?,
        block_size: size_field(path, obj, &["n_positions", "n_ctx"])?,
        vocab_size,
        padded_vocab_size: padded,
    };
    config.check().map_err(|e| wrap(path, e))?;
    Ok(config)
}

/// The parameters of the GPT `config` describes: (Kiln name, shape), in order.
fn expected(config: &GptConfig) -> Vec<(String, Vec<usize>)> {
    Gpt::new(config.clone(), config.block_size)
        .parameters()
        .into_iter()
        .map(|p| (p.name, p.shape))
        .collect()
}

fn host_dtype(d: StDtype) -> Option<DType> {
    match d {
        StDtype::F32 => Some(DType::F32),
        StDtype::F16 => Some(DType::F16),
        StDtype::BF16 => Some(DType::BF16),
        _ => None,
    }
}

/// The dtype of tensor `name` of `file`, which weights must have (f32, f16 or bf16).
pub(super) fn weight_dtype(file: &Path, name: &str, view: &TensorView) -> Result<DType> {
    host_dtype(view.dtype()).ok_or_else(|| {
        bad(
            file,
            format!(
                "tensor `{name}` is {:?}; weights must be F32, F16 or BF16",
                view.dtype()
            ),
        )
    })
}

/// A safetensors view copied into a host tensor named `name`, in its `dtype`.
pub(super) fn copy_view(name: &str, view: &TensorView, dtype: DType) -> HostTensor {
    let len = view.shape().iter().product();
    HostTensor::new(
        name,
        view.shape().to_vec(),
        HostData::from_bytes(dtype, len, view.data()),
    )
}

/// Reads a Hugging Face GPT-2: `path` is the directory or its `model.safetensors`.
pub fn read_hf(path: &Path) -> Result<Imported> {
    let (weights_path, config_path) = if path.is_dir() {
        (path.join(HF_WEIGHTS), path.join(HF_CONFIG))
    } else {
        (path.to_path_buf(), path.with_file_name(HF_CONFIG))
    };
    let config = read_hf_config(&config_path)?;
    let map = map(&weights_path)?;
    // The crate checks the header's length against the file, and every tensor's
    // offsets against its shape and the data that follows, before handing out views.
    let file = SafeTensors::deserialize(&map).map_err(|e| {
        bad(
            &weights_path,
            format!("not a valid safetensors file (truncated or corrupted?): {e}"),
        )
    })?;
    let says = format!(
        "{} says n_layer {}, n_embd {}, n_positions {}, vocab_size {}",
        config_path.display(),
        config.n_layer,
        config.n_embd,
        config.block_size,
        config.padded_vocab()
    );
    let want = expected(&config);
    let mut found: Vec<Option<HostTensor>> = vec![None; want.len()];
    let mut lm_head = None;
    for (name, view) in file.tensors() {
        let bare = name.strip_prefix(PREFIX).unwrap_or(&name);
        // Buffers, not weights: the causal mask and its fill value.
        if bare.ends_with(".attn.bias") || bare.ends_with(".attn.masked_bias") {
            continue;
        }
        let dtype = weight_dtype(&weights_path, &name, &view)?;
        let shape = view.shape().to_vec();
        // Copied only once its shape is checked (a view's bytes are within the file).
        let copy = |name: &str| copy_view(name, &view, dtype);
        if bare == "lm_head.weight" {
            if shape != want[0].1 {
                return Err(bad(
                    &weights_path,
                    format!(
                        "tensor `{name}` has shape {shape:?}, but {says}, which makes the tied \
                         LM head {:?}",
                        want[0].1
                    ),
                ));
            }
            lm_head = Some(copy(&name));
            continue;
        }
        let Some(i) = want
            .iter()
            .position(|(n, _)| n.strip_prefix(PREFIX).unwrap_or(n) == bare)
        else {
            return Err(bad(
                &weights_path,
                format!(
                    "tensor `{name}` is no parameter of the GPT-2 that {says}: the weights and \
                     config.json are of different models"
                ),
            ));
        };
        if found[i].is_some() {
            return Err(bad(
                &weights_path,
                format!(
                    "tensor `{bare}` is there twice (with and without the `transformer.` prefix)"
                ),
            ));
        }
        if shape != want[i].1 {
            return Err(bad(
                &weights_path,
                format!(
                    "tensor `{name}` has shape {shape:?}, but {says}, which makes it {:?}: the \
                     weights and config.json are of different models",
                    want[i].1
                ),
            ));
        }
        found[i] = Some(copy(&want[i].0));
    }
    let weights = found
        .into_iter()
        .zip(&want)
        .map(|(t, (n, _))| {
            t.ok_or_else(|| {
                bad(
                    &weights_path,
                    format!(
                        "no tensor `{}` (nor `{n}`), which the GPT-2 that {says} has: the file \
                         is incomplete or of a smaller model",
                        n.strip_prefix(PREFIX).unwrap_or(n)
                    ),
                )
            })
        })
        .collect::<Result<Vec<_>>>()?;
    if let Some(head) = lm_head {
        // Kiln ties the LM head to the token embedding: a head that differs cannot be
        // kept, and dropping it silently would change the model.
        let wte = &weights[0];
        if head.shape != wte.shape
            || head.data.as_bytes() != wte.data.as_bytes()
            || head.data.dtype() != wte.data.dtype()
        {
            return Err(bad(
                &weights_path,
                format!(
                    "tensor `{}` differs from the token embedding `{}`; Kiln ties the LM head \
                     to the token embedding, so a model with an untied head cannot be imported",
                    head.name, wte.name
                ),
            ));
        }
    }
    Ok(Imported {
        config,
        weights,
        format: Format::HuggingFace,
        path: weights_path,
    })
}

/// The model's tensors by Kiln name, in parameter order, each of its declared shape.
fn by_name<'a>(config: &GptConfig, weights: &'a [HostTensor]) -> Result<Vec<&'a HostTensor>> {
    expected(config)
        .iter()
        .map(|(name, shape)| {
            let t = weights.iter().find(|t| &t.name == name).ok_or_else(|| {
                Error::InvalidArgument(format!("export: no tensor `{name}` among the weights"))
            })?;
            if &t.shape != shape || t.data.len() != shape.iter().product::<usize>() {
                return Err(Error::InvalidArgument(format!(
                    "export: tensor `{name}` has shape {:?} ({} values) but the model has {shape:?}",
                    t.shape,
                    t.data.len()
                )));
            }
            if !t.data.dtype().is_float() {
                return Err(Error::InvalidArgument(format!(
                    "export: tensor `{name}` is {}; weights are f32, f16 or bf16",
                    t.data.dtype()
                )));
            }
            Ok(t)
        })
        .collect()
}

/// Writes `weights` (Kiln names, as [`Imported::weights`] or a checkpoint holds them) as
/// a Hugging Face GPT-2 directory: `model.safetensors` in each tensor's own dtype, under
/// the names GPT-2 checkpoints use, and `config.json`. A padded vocabulary is written
/// whole (its `vocab_size` the padded one, as the embedding's rows must be) with the
/// real size under `kiln_vocab_size`.
pub fn write_hf(dir: &Path, config: &GptConfig, weights: &[HostTensor]) -> Result<()> {
    config.check()?;
    let tensors = by_name(config, weights)?;
    std::fs::create_dir_all(dir).map_err(|e| bad(dir, format!("cannot create it: {e}")))?;
    let named: Vec<_> = tensors
        .iter()
        .map(|t| (t.name.as_str(), t.shape.as_slice(), &t.data))
        .collect();
    let bytes = crate::device::safetensors_io::encode(&named).map_err(|e| bad(dir, e))?;
    let mut cfg = serde_json::json!({
        "model_type": "gpt2",
        "architectures": ["GPT2LMHeadModel"],
        "n_layer": config.n_layer,
        "n_head": config.n_head,
        "n_embd": config.n_embd,
        "n_positions": config.block_size,
        "n_ctx": config.block_size,
        "vocab_size": config.padded_vocab(),
        "tie_word_embeddings": true,
    });
    if config.padded_vocab_size.is_some() {
        cfg[KILN_VOCAB_KEY] = config.vocab_size.into();
    }
    let text = serde_json::to_string_pretty(&cfg).expect("a JSON value serializes");
    for (name, bytes) in [(HF_WEIGHTS, bytes), (HF_CONFIG, text.into_bytes())] {
        crate::fsutil::write_atomic(&dir.join(name), &bytes)
            .map_err(|f| bad(&f.path, format!("{}: {}", f.action, f.err)))?;
    }
    Ok(())
}

/// One kind of llm.c tensor: the Kiln parameter it is (per layer where `layered`: llm.c
/// stacks each kind over the layers), its (rows, cols) as llm.c stores one layer's, and
/// whether Kiln stores it transposed ((in, out) against llm.c's (out, in)).
struct LlmcTensor {
    kiln: &'static str,
    layered: bool,
    /// (rows, cols) of one layer's slice as llm.c stores it.
    rows_cols: fn(&GptConfig) -> (usize, usize),
    /// Kiln stores it transposed: (cols, rows).
    transposed: bool,
}

const fn t(
    kiln: &'static str,
    layered: bool,
    rows_cols: fn(&GptConfig) -> (usize, usize),
    transposed: bool,
) -> LlmcTensor {
    LlmcTensor {
        kiln,
        layered,
        rows_cols,
        transposed,
    }
}

/// llm.c's sixteen parameter tensors, in the order its file holds them.
const LLMC_TENSORS: [LlmcTensor; 16] = [
    t("wte.weight", false, |c| (c.padded_vocab(), c.n_embd), false),
    t("wpe.weight", false, |c| (c.block_size, c.n_embd), false),
    t("ln_1.weight", true, |c| (1, c.n_embd), false),
    t("ln_1.bias", true, |c| (1, c.n_embd), false),
    t(
        "attn.c_attn.weight",
        true,
        |c| (3 * c.n_embd, c.n_embd),
        true,
    ),
    t("attn.c_attn.bias", true, |c| (1, 3 * c.n_embd), false),
    t("attn.c_proj.weight", true, |c| (c.n_embd, c.n_embd), true),
    t("attn.c_proj.bias", true, |c| (1, c.n_embd), false),
    t("ln_2.weight", true, |c| (1, c.n_embd), false),
    t("ln_2.bias", true, |c| (1, c.n_embd), false),
    t("mlp.c_fc.weight", true, |c| (4 * c.n_embd, c.n_embd), true),
    t("mlp.c_fc.bias", true, |c| (1, 4 * c.n_embd), false),
    t(
        "mlp.c_proj.weight",
        true,
        |c| (c.n_embd, 4 * c.n_embd),
        true,
    ),
    t("mlp.c_proj.bias", true, |c| (1, c.n_embd), false),
    t("ln_f.weight", false, |c| (1, c.n_embd), false),
    t("ln_f.bias", false, |c| (1, c.n_embd), false),
];

impl LlmcTensor {
    fn name(&self, layer: usize) -> String {
        if self.layered {
            format!("{PREFIX}h.{layer}.{}", self.kiln)
        } else {
            format!("{PREFIX}{}", self.kiln)
        }
    }
}

/// (rows, cols) of `bytes` (elements of `e` bytes) transposed.
fn transpose(bytes: &[u8], rows: usize, cols: usize, e: usize) -> Vec<u8> {
    let mut out = vec![0u8; bytes.len()];
    for r in 0..rows {
        for c in 0..cols {
            let (src, dst) = ((r * cols + c) * e, (c * rows + r) * e);
            out[dst..dst + e].copy_from_slice(&bytes[src..src + e]);
        }
    }
    out
}

/// Reads llm.c's `gpt2_*.bin`: a header of 256 i32 (magic, version 3 for f32 or 5 for
/// bf16, max positions, vocabulary, layers, heads, channels, padded vocabulary), then
/// the sixteen tensors.
pub fn read_llmc(path: &Path) -> Result<Imported> {
    let map = map(path)?;
    if map.len() < LLMC_HEADER_BYTES {
        return Err(bad(
            path,
            format!(
                "{} bytes, shorter than llm.c's {LLMC_HEADER_BYTES}-byte header: truncated, or \
                 not an llm.c model file",
                map.len()
            ),
        ));
    }
    let h = |i: usize| i32::from_le_bytes(map[4 * i..4 * i + 4].try_into().expect("4 bytes"));
    if h(0) != LLMC_MAGIC {
        return Err(bad(
            path,
            format!(
                "magic number {} is not llm.c's {LLMC_MAGIC}: not an llm.c model file",
                h(0)
            ),
        ));
    }
    let dtype = match h(1) {
        3 => DType::F32,
        5 => DType::BF16,
        v => {
            return Err(bad(
                path,
                format!(
                    "llm.c model file version {v}; Kiln reads versions 3 (f32) and 5 (bf16), \
                     which have the padded vocabulary: export it again with llm.c's \
                     train_gpt2.py"
                ),
            ))
        }
    };
    let field = |i: usize, what: &str| -> Result<usize> {
        usize::try_from(h(i))
            .ok()
            .filter(|&n| n > 0)
            .ok_or_else(|| {
                bad(
                    path,
                    format!("header's {what} is {}; it must be positive", h(i)),
                )
            })
    };
    let (max_t, v, l, nh, c, vp) = (
        field(2, "max_seq_len")?,
        field(3, "vocab_size")?,
        field(4, "num_layers")?,
        field(5, "num_heads")?,
        field(6, "channels")?,
        field(7, "padded_vocab_size")?,
    );
    let config = GptConfig {
        n_layer: l,
        n_head: nh,
        n_embd: c,
        block_size: max_t,
        vocab_size: v,
        padded_vocab_size: (vp != v).then_some(vp),
    };
    // Refuses absurd sizes (and Vp < V) before any size is computed from them.
    config.check().map_err(|e| wrap(path, e))?;
    let e = dtype.size();
    let elements = config.parameter_count();
    let want = elements
        .checked_mul(e)
        .and_then(|b| b.checked_add(LLMC_HEADER_BYTES));
    if want != Some(map.len()) {
        return Err(bad(
            path,
            format!(
                "its header says {l} layers, {c} channels, {max_t} positions and a vocabulary \
                 of {v} padded to {vp}: {elements} {dtype} weights, {} bytes with the header, \
                 but the file has {} bytes: it is truncated, or its header is damaged",
                want.map_or("more than addressable".to_string(), |w| w.to_string()),
                map.len()
            ),
        ));
    }
    let mut weights: Vec<HostTensor> = Vec::with_capacity(2 + 12 * l + 2);
    let mut at = LLMC_HEADER_BYTES;
    for spec in &LLMC_TENSORS {
        let (rows, cols) = (spec.rows_cols)(&config);
        let layers = if spec.layered { l } else { 1 };
        for layer in 0..layers {
            let n = rows * cols;
            let bytes = &map[at..at + n * e];
            at += n * e;
            let (shape, bytes) = if spec.transposed {
                (vec![cols, rows], transpose(bytes, rows, cols, e))
            } else if rows == 1 {
                (vec![cols], bytes.to_vec())
            } else {
                (vec![rows, cols], bytes.to_vec())
            };
            weights.push(HostTensor::new(
                spec.name(layer),
                shape,
                HostData::from_bytes(dtype, n, &bytes),
            ));
        }
    }
    // Into Kiln's parameter order (llm.c groups by kind, Kiln by layer).
    let order = expected(&config);
    let mut sorted = Vec::with_capacity(order.len());
    for (name, shape) in &order {
        let i = weights
            .iter()
            .position(|t| &t.name == name)
            .expect("llm.c's tensors are Kiln's parameters");
        let t = weights.swap_remove(i);
        debug_assert_eq!(&t.shape, shape);
        sorted.push(t);
    }
    Ok(Imported {
        config,
        weights: sorted,
        format: Format::LlmC,
        path: path.to_path_buf(),
    })
}

/// Writes `weights` (Kiln names) as an llm.c model file in `dtype`: F32 (version 3) or
/// BF16 (version 5). Each tensor is converted to `dtype` (rounded to nearest even where
/// it narrows) unless it already is.
pub fn write_llmc(
    path: &Path,
    config: &GptConfig,
    weights: &[HostTensor],
    dtype: DType,
) -> Result<()> {
    let version = match dtype {
        DType::F32 => 3,
        DType::BF16 => 5,
        other => {
            return Err(Error::InvalidArgument(format!(
                "export: llm.c model files hold f32 or bf16 weights, not {other}"
            )))
        }
    };
    config.check()?;
    let tensors = by_name(config, weights)?;
    let find = |name: &str| -> &HostTensor {
        tensors
            .iter()
            .find(|t| t.name == name)
            .expect("by_name checked every parameter")
    };
    let as_i32 = |what: &str, n: usize| {
        i32::try_from(n).map_err(|_| {
            Error::InvalidArgument(format!(
                "export: {what} {n} does not fit llm.c's 32-bit header"
            ))
        })
    };
    let mut header = [0i32; 256];
    header[0] = LLMC_MAGIC;
    header[1] = version;
    header[2] = as_i32("block_size", config.block_size)?;
    header[3] = as_i32("vocab_size", config.vocab_size)?;
    header[4] = as_i32("n_layer", config.n_layer)?;
    header[5] = as_i32("n_head", config.n_head)?;
    header[6] = as_i32("n_embd", config.n_embd)?;
    header[7] = as_i32("padded_vocab_size", config.padded_vocab())?;
    let mut out: Vec<u8> =
        Vec::with_capacity(LLMC_HEADER_BYTES + config.parameter_count() * dtype.size());
    for v in header {
        out.extend_from_slice(&v.to_le_bytes());
    }
    for spec in &LLMC_TENSORS {
        let (rows, cols) = (spec.rows_cols)(config);
        let layers = if spec.layered { config.n_layer } else { 1 };
        for layer in 0..layers {
            let t = find(&spec.name(layer));
            let data = if t.data.dtype() == dtype {
                t.data.clone()
            } else {
                HostData::from_f32(dtype, &t.data.to_f32())
            };
            if spec.transposed {
                out.extend(transpose(data.as_bytes(), cols, rows, dtype.size()));
            } else {
                out.extend_from_slice(data.as_bytes());
            }
        }
    }
    crate::fsutil::write_atomic(path, &out)
        .map_err(|f| bad(&f.path, format!("{}: {}", f.action, f.err)))
}
