//! Llama-family checkpoints as the Hugging Face hub ships them (`LlamaForCausalLM`:
//! SmolLM2, TinyLlama, Llama 2 and 3.x with `llama3` rope scaling; `Qwen2ForCausalLM`:
//! Qwen2 and Qwen2.5, biases on q, k and v; `MistralForCausalLM`, its sliding window
//! taken as full attention up to the window and refused past it): a directory with
//! `config.json` and `model.safetensors`, or shards `model-0000N-of-0000M.safetensors`
//! listed by `model.safetensors.index.json`. The weights are read memory-mapped and
//! copied once, in the file's dtype (f32, f16 or bf16).
//!
//! Layout. Kiln's Llama ([`Llama`]) declares Hugging Face's names and layouts: linear
//! weights (out, in), and rotary embeddings in the "rotate half" arrangement of
//! `modeling_llama.py` (in each head, element i turns with element i + D/2), which is
//! the arrangement Kiln's RoPE kernels compute. So q and k projections are taken as
//! they are — no row permutation, unlike converters for interleaved-pair RoPE — and
//! every tensor keeps its name.
//!
//! Strict: the architecture comes from `config.json`, and a setting that changes the
//! math and that Kiln's Llama does not implement (rope scaling other than `llama3`, an
//! o-projection or MLP bias, another activation, Qwen2's per-layer sliding window,
//! attention dropout) is an error naming it; so are missing shards, tensors listed
//! twice, and a tensor of the wrong shape or dtype. A `head_dim` other than hidden /
//! heads is computed (q is then (heads × head_dim, hidden)).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use safetensors::SafeTensors;
use serde_json::Value;

use super::import::{bad, copy_view, map, read_json_object, weight_dtype, wrap};
use super::llama::{Llama, LlamaConfig};
use super::Model;
use crate::device::host::HostTensor;
use crate::{Result, RopeScaling};

/// A sharded checkpoint's index (tensor name → shard file).
pub const HF_INDEX: &str = "model.safetensors.index.json";

/// The architectures this module reads, as `config.json`'s `model_type` names them.
pub const LLAMA_TYPES: &[&str] = &["llama", "mistral", "qwen2"];

/// A Llama read from a Hugging Face directory: its sizes, one tensor per parameter of
/// `Llama::new(config, …)` in parameter order under Kiln's (= Hugging Face's) names,
/// and the weight files read.
#[derive(Clone, Debug)]
pub struct ImportedLlama {
    pub config: LlamaConfig,
    pub weights: Vec<HostTensor>,
    pub files: Vec<PathBuf>,
}

/// The `model_type` of the Hugging Face model in `dir` (its `config.json`), if it has
/// one: what decides which reader to use.
pub fn model_type(dir: &Path) -> Result<Option<String>> {
    let path = dir.join(super::import::HF_CONFIG);
    let obj = read_json_object(&path)?;
    Ok(obj
        .get("model_type")
        .and_then(Value::as_str)
        .map(str::to_string))
}

fn positive(path: &Path, obj: &serde_json::Map<String, Value>, key: &str) -> Result<usize> {
    let v = obj.get(key).ok_or_else(|| {
        bad(
            path,
            format!(
                "no `{key}`; a Llama config.json gives hidden_size, num_hidden_layers, \
                 num_attention_heads, intermediate_size, vocab_size and \
                 max_position_embeddings"
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

fn number(
    path: &Path,
    obj: &serde_json::Map<String, Value>,
    key: &str,
    default: f64,
) -> Result<f64> {
    match obj.get(key) {
        None | Some(Value::Null) => Ok(default),
        Some(v) => v
            .as_f64()
            .filter(|x| x.is_finite())
            .ok_or_else(|| bad(path, format!("`{key}` is {v}; it must be a number"))),
    }
}

/// Reads a Hugging Face Llama, Qwen2 or Mistral `config.json` (`path`) into Kiln's
/// sizes, refusing what Kiln's Llama does not compute.
pub fn read_config(path: &Path) -> Result<LlamaConfig> {
    let obj = read_json_object(path)?;
    let kind = obj.get("model_type").and_then(Value::as_str).unwrap_or("");
    if !LLAMA_TYPES.contains(&kind) {
        return Err(bad(
            path,
            format!(
                "model_type is `{kind}`; Kiln imports Hugging Face models of type {} \
                 (LlamaForCausalLM: SmolLM2, TinyLlama, Llama 2/3.x; Qwen2ForCausalLM: \
                 Qwen2/2.5; MistralForCausalLM) and gpt2",
                LLAMA_TYPES.join(", ")
            ),
        ));
    }
    let refuse = |key: &str, why: &str| -> Result<()> {
        match obj.get(key) {
            None | Some(Value::Null) | Some(Value::Bool(false)) => Ok(()),
            Some(v) => Err(bad(
                path,
                format!("`{key}` is {v}: {why}; Kiln cannot import this {kind} model yet"),
            )),
        }
    };
    refuse(
        "attention_bias",
        "an o projection with a bias is not implemented (Qwen2's q/k/v biases are)",
    )?;
    refuse(
        "mlp_bias",
        "MLP projections with biases are not implemented",
    )?;
    let sliding_window = match kind {
        // Hugging Face's MistralConfig default where the key is absent.
        "mistral" => match obj.get("sliding_window") {
            None => Some(4096),
            Some(Value::Null) => None,
            Some(_) => Some(positive(path, &obj, "sliding_window")?),
        },
        // Qwen2 keeps `sliding_window` but applies it only with use_sliding_window.
        "qwen2" => {
            refuse(
                "use_sliding_window",
                "sliding-window attention on some layers is not implemented",
            )?;
            None
        }
        _ => {
            refuse(
                "sliding_window",
                "sliding-window attention is not implemented",
            )?;
            None
        }
    };
    let act = obj
        .get("hidden_act")
        .and_then(Value::as_str)
        .unwrap_or("silu");
    if act != "silu" {
        return Err(bad(
            path,
            format!("`hidden_act` is `{act}`; Kiln's Llama MLP is SwiGLU with SiLU (`silu`)"),
        ));
    }
    let dropout = number(path, &obj, "attention_dropout", 0.0)?;
    if dropout != 0.0 {
        return Err(bad(
            path,
            format!(
                "`attention_dropout` is {dropout}; Kiln's Llama has no attention dropout \
                 (set it to 0.0 to fine-tune without)"
            ),
        ));
    }
    let n_embd = positive(path, &obj, "hidden_size")?;
    let n_head = positive(path, &obj, "num_attention_heads")?;
    let n_kv_head = match obj.get("num_key_value_heads") {
        None | Some(Value::Null) => n_head,
        Some(_) => positive(path, &obj, "num_key_value_heads")?,
    };
    // Recorded only where it differs from hidden / heads, as Kiln's own configs leave it.
    let head_dim = match obj.get("head_dim") {
        None | Some(Value::Null) => None,
        Some(_) => Some(positive(path, &obj, "head_dim")?)
            .filter(|&d| n_embd % n_head != 0 || d != n_embd / n_head),
    };
    let tie = match obj.get("tie_word_embeddings") {
        None | Some(Value::Null) => false,
        Some(Value::Bool(b)) => *b,
        Some(v) => {
            return Err(bad(
                path,
                format!("`tie_word_embeddings` is {v}; it must be true or false"),
            ))
        }
    };
    let config = LlamaConfig {
        n_layer: positive(path, &obj, "num_hidden_layers")?,
        n_head,
        n_kv_head: Some(n_kv_head),
        n_embd,
        block_size: positive(path, &obj, "max_position_embeddings")?,
        vocab_size: positive(path, &obj, "vocab_size")?,
        intermediate_size: Some(positive(path, &obj, "intermediate_size")?),
        rope_theta: match obj.get("rope_parameters").and_then(Value::as_object) {
            // transformers 5 writes the rotary settings as one `rope_parameters` object.
            Some(p) if p.contains_key("rope_theta") => number(path, p, "rope_theta", 10000.0)?,
            _ => number(path, &obj, "rope_theta", 10000.0)?,
        } as f32,
        // Hugging Face's LlamaConfig default.
        rms_norm_eps: number(path, &obj, "rms_norm_eps", 1e-6)? as f32,
        tie_word_embeddings: tie,
        head_dim,
        qkv_bias: kind == "qwen2",
        rope_scaling: match obj.get("rope_scaling") {
            None | Some(Value::Null) => {
                rope_scaling(path, "rope_parameters", obj.get("rope_parameters"))?
            }
            v => rope_scaling(path, "rope_scaling", v)?,
        },
        sliding_window,
        max_position_embeddings: None,
    };
    config.check().map_err(|e| wrap(path, e))?;
    Ok(config)
}

/// `rope_scaling` (or transformers 5's `rope_parameters`, as `key` says): none, or
/// Llama 3's band rescaling; other kinds are refused by name.
fn rope_scaling(path: &Path, key: &str, value: Option<&Value>) -> Result<Option<RopeScaling>> {
    let scaling = match value {
        None | Some(Value::Null) => return Ok(None),
        Some(Value::Object(m)) => m,
        Some(v) => {
            return Err(bad(
                path,
                format!("`{key}` is {v}; it must be null or an object"),
            ))
        }
    };
    // Older configs name the kind `type`.
    let kind = scaling
        .get("rope_type")
        .or_else(|| scaling.get("type"))
        .and_then(Value::as_str)
        .unwrap_or("");
    match kind {
        "default" => return Ok(None),
        // rope_parameters of an unscaled model may give the theta alone.
        "" if key == "rope_parameters" => return Ok(None),
        "llama3" => {}
        other => {
            return Err(bad(
                path,
                format!(
                    "`{key}` is of type `{other}`; Kiln implements `llama3` (Llama \
                     3.1/3.2) only, not linear, dynamic, yarn or longrope scaling"
                ),
            ))
        }
    }
    let field = |field: &str| {
        scaling
            .get(field)
            .and_then(Value::as_f64)
            .filter(|x| x.is_finite())
            .ok_or_else(|| {
                bad(
                    path,
                    format!(
                        "`{key}.{field}` is missing or not a number; llama3 scaling \
                             gives factor, low_freq_factor, high_freq_factor and \
                             original_max_position_embeddings"
                    ),
                )
            })
    };
    let original = field("original_max_position_embeddings")?;
    let s = RopeScaling {
        factor: field("factor")? as f32,
        low_freq_factor: field("low_freq_factor")? as f32,
        high_freq_factor: field("high_freq_factor")? as f32,
        original_max_position_embeddings: if original >= 1.0 && original.fract() == 0.0 {
            original as usize
        } else {
            0
        },
    };
    match s.problem() {
        Some(why) => Err(bad(path, format!("`{key}`: {why}"))),
        None => Ok(Some(s)),
    }
}

/// Which shard file each tensor is in, as a sharded checkpoint's index says.
type Placement = BTreeMap<String, PathBuf>;

/// The weight files of the model in `dir`: `model.safetensors`, or the shards its
/// index names (each once, in the index's order), with the shard each tensor is in.
fn weight_files(dir: &Path) -> Result<(Vec<PathBuf>, Option<Placement>)> {
    let single = dir.join(super::import::HF_WEIGHTS);
    let index = dir.join(HF_INDEX);
    if !index.exists() {
        if !single.exists() {
            return Err(bad(
                dir,
                format!(
                    "no {} and no {HF_INDEX}: a Hugging Face model directory holds its \
                     weights in one or the other",
                    super::import::HF_WEIGHTS
                ),
            ));
        }
        return Ok((vec![single], None));
    }
    let obj = read_json_object(&index)?;
    let map_obj = obj
        .get("weight_map")
        .and_then(Value::as_object)
        .ok_or_else(|| bad(&index, "no `weight_map` object (tensor name → shard file)"))?;
    let mut files: Vec<PathBuf> = vec![];
    let mut place = BTreeMap::new();
    for (name, file) in map_obj {
        let file = file
            .as_str()
            .filter(|f| !f.is_empty() && !f.contains('/') && !f.contains('\\') && *f != "..")
            .ok_or_else(|| {
                bad(
                    &index,
                    format!("tensor `{name}` maps to {file}, not a file name in the directory"),
                )
            })?;
        let path = dir.join(file);
        if !files.contains(&path) {
            if !path.is_file() {
                return Err(bad(
                    &index,
                    format!(
                        "shard `{file}` (of tensor `{name}`) is missing from {}; download \
                         every shard the index lists",
                        dir.display()
                    ),
                ));
            }
            files.push(path.clone());
        }
        place.insert(name.clone(), path);
    }
    Ok((files, Some(place)))
}

/// Reads a Hugging Face Llama from `dir` (see the module docs).
pub fn read_hf(dir: &Path) -> Result<ImportedLlama> {
    let config_path = dir.join(super::import::HF_CONFIG);
    let config = read_config(&config_path)?;
    let (files, place) = weight_files(dir)?;
    let says = format!(
        "{} says {} layers, hidden {}, {} heads ({} K/V), MLP {}, vocab {}",
        config_path.display(),
        config.n_layer,
        config.n_embd,
        config.n_head,
        config.kv_heads(),
        config.intermediate(),
        config.vocab_size
    );
    let want: Vec<(String, Vec<usize>)> = Llama::new(config.clone(), 1)
        .parameters()
        .into_iter()
        .map(|p| (p.name, p.shape))
        .collect();
    let mut found: Vec<Option<HostTensor>> = vec![None; want.len()];
    let mut where_found: Vec<Option<PathBuf>> = vec![None; want.len()];
    let mut lm_head = None;
    for file in &files {
        let mapped = map(file)?;
        let st = SafeTensors::deserialize(&mapped).map_err(|e| {
            bad(
                file,
                format!("not a valid safetensors file (truncated or corrupted?): {e}"),
            )
        })?;
        for (name, view) in st.tensors() {
            // Rotary frequencies some older checkpoints store: recomputed, not weights.
            if name.ends_with(".rotary_emb.inv_freq") {
                continue;
            }
            if let Some(p) = place.as_ref().and_then(|p| p.get(&name)) {
                if p != file {
                    return Err(bad(
                        file,
                        format!(
                            "tensor `{name}` is in this shard, but {HF_INDEX} puts it in {}",
                            p.display()
                        ),
                    ));
                }
            }
            let dtype = weight_dtype(file, &name, &view)?;
            let shape = view.shape().to_vec();
            let copy = |name: &str| copy_view(name, &view, dtype);
            if config.tie_word_embeddings && name == "lm_head.weight" {
                // A tied head may be saved too; it must then be the embedding.
                lm_head = Some(copy(&name));
                continue;
            }
            let Some(i) = want.iter().position(|(n, _)| *n == name) else {
                return Err(bad(
                    file,
                    format!(
                        "tensor `{name}` is no parameter of the Llama that {says}: the weights \
                         and config.json are of different models"
                    ),
                ));
            };
            if let Some(first) = &where_found[i] {
                return Err(bad(
                    file,
                    format!(
                        "tensor `{name}` is also in {}: listed twice",
                        first.display()
                    ),
                ));
            }
            if shape != want[i].1 {
                return Err(bad(
                    file,
                    format!(
                        "tensor `{name}` has shape {shape:?}, but {says}, which makes it {:?}: \
                         the weights and config.json are of different models",
                        want[i].1
                    ),
                ));
            }
            found[i] = Some(copy(&name));
            where_found[i] = Some(file.clone());
        }
    }
    let weights = found
        .into_iter()
        .zip(&want)
        .map(|(t, (n, _))| {
            t.ok_or_else(|| {
                bad(
                    dir,
                    format!(
                        "no tensor `{n}`, which the Llama that {says} has: the checkpoint is \
                         incomplete (a shard missing?) or of another model"
                    ),
                )
            })
        })
        .collect::<Result<Vec<_>>>()?;
    if let Some(head) = lm_head {
        let embed = &weights[0];
        if head.shape != embed.shape || head.data != embed.data {
            return Err(bad(
                dir,
                "`lm_head.weight` differs from `model.embed_tokens.weight`, but config.json \
                 says tie_word_embeddings: the head would be dropped; fix config.json",
            ));
        }
    }
    Ok(ImportedLlama {
        config,
        weights,
        files,
    })
}

/// The Hugging Face family a config is: Qwen2 (q/k/v biases), Mistral (a sliding
/// window) or Llama; with its `architectures` name.
pub fn family(config: &LlamaConfig) -> (&'static str, &'static str) {
    if config.qkv_bias {
        ("qwen2", "Qwen2ForCausalLM")
    } else if config.sliding_window.is_some() {
        ("mistral", "MistralForCausalLM")
    } else {
        ("llama", "LlamaForCausalLM")
    }
}

/// The `config.json` of `config` as Hugging Face's family config reads it.
fn hf_config(config: &LlamaConfig, dtype: crate::DType) -> Value {
    let (model_type, arch) = family(config);
    let mut cfg = serde_json::json!({
        "architectures": [arch],
        "model_type": model_type,
        "hidden_size": config.n_embd,
        "intermediate_size": config.intermediate(),
        "num_hidden_layers": config.n_layer,
        "num_attention_heads": config.n_head,
        "num_key_value_heads": config.kv_heads(),
        "head_dim": config.head_dim(),
        "vocab_size": config.vocab_size,
        "max_position_embeddings": config.reach(),
        "rms_norm_eps": config.rms_norm_eps,
        "rope_theta": config.rope_theta,
        "tie_word_embeddings": config.tie_word_embeddings,
        "hidden_act": "silu",
        "attention_dropout": 0.0,
        "torch_dtype": match dtype {
            crate::DType::F16 => "float16",
            crate::DType::BF16 => "bfloat16",
            _ => "float32",
        },
    });
    cfg["rope_scaling"] = match config.rope_scaling {
        None => Value::Null,
        Some(s) => serde_json::json!({
            "rope_type": "llama3",
            "factor": s.factor,
            "low_freq_factor": s.low_freq_factor,
            "high_freq_factor": s.high_freq_factor,
            "original_max_position_embeddings": s.original_max_position_embeddings,
        }),
    };
    match model_type {
        "qwen2" => {
            cfg["use_sliding_window"] = false.into();
        }
        "mistral" => cfg["sliding_window"] = config.sliding_window.into(),
        _ => {
            cfg["attention_bias"] = false.into();
            cfg["mlp_bias"] = false.into();
        }
    }
    cfg
}

/// Writes `weights` (one per parameter of `Llama::new(config, …)`, by name, as
/// [`read_hf`] returns them or a checkpoint holds them) as a Hugging Face directory of
/// the config's family: `model.safetensors` in each tensor's own dtype, under
/// Hugging Face's names (Kiln's), a tied head not repeated, and `config.json`. What
/// [`read_hf`] reads back is the same config and the same bits.
pub fn write_hf(dir: &Path, config: &LlamaConfig, weights: &[HostTensor]) -> Result<()> {
    config.check()?;
    if config.qkv_bias && config.sliding_window.is_some() {
        // No Hugging Face family has both: Qwen2 would drop the window.
        return Err(crate::Error::InvalidArgument(
            "export: a model with q/k/v biases and a sliding window is neither a Qwen2 nor \
             a Mistral; Hugging Face has no family for it"
                .into(),
        ));
    }
    let specs = Llama::new(config.clone(), 1).parameters();
    let mut named = Vec::with_capacity(specs.len());
    for spec in &specs {
        let t = weights
            .iter()
            .find(|t| t.name == spec.name || Some(&t.name) == spec.tied.as_ref())
            .ok_or_else(|| {
                crate::Error::InvalidArgument(format!(
                    "export: no tensor `{}` among the weights",
                    spec.name
                ))
            })?;
        if t.shape != spec.shape || !t.data.dtype().is_float() {
            return Err(crate::Error::InvalidArgument(format!(
                "export: tensor `{}` is {} {:?}, but the model has a float {:?}",
                t.name,
                t.data.dtype(),
                t.shape,
                spec.shape
            )));
        }
        named.push((spec.name.as_str(), t.shape.as_slice(), &t.data));
    }
    let dtype = named[0].2.dtype();
    let bytes = crate::device::safetensors_io::encode(&named).map_err(|e| bad(dir, e))?;
    std::fs::create_dir_all(dir).map_err(|e| bad(dir, format!("cannot create it: {e}")))?;
    let text =
        serde_json::to_string_pretty(&hf_config(config, dtype)).expect("a JSON value serializes");
    for (name, bytes) in [
        (super::import::HF_WEIGHTS, bytes),
        (super::import::HF_CONFIG, text.into_bytes()),
    ] {
        crate::fsutil::write_atomic(&dir.join(name), &bytes)
            .map_err(|f| bad(&f.path, format!("{}: {}", f.action, f.err)))?;
    }
    // A sharded checkpoint's index would now name shards that are not there.
    let index = dir.join(HF_INDEX);
    if index.exists() {
        std::fs::remove_file(&index).map_err(|e| bad(&index, format!("cannot remove it: {e}")))?;
    }
    Ok(())
}
