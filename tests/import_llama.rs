//! Hugging Face Llama-family checkpoints (tests/fixtures/llama, written by an
//! independent NumPy implementation of the semantics of `modeling_llama.py`,
//! `modeling_qwen2.py` and `modeling_mistral.py`, see make_fixtures.py): the imported
//! model gives the reference's logits and loss on CPU, wgpu and raw Vulkan —
//! grouped-query attention with its own LM head (f32 weights), a tied head with one
//! K/V head and theta 1e5 (bf16 weights), three shards with an index (f16 weights),
//! Llama 3.2's rope scaling with a separate head dim, Qwen2's q/k/v biases, Mistral's
//! sliding window (f32) — and damaged or unsupported checkpoints are refused naming
//! the file, the tensor or the setting.

mod common;

use std::path::{Path, PathBuf};
use std::sync::Arc;

use common::*;
use kiln::cpu::CpuDevice;
use kiln::engine::graph::Attention;
use kiln::engine::models::generate::Generator;
use kiln::engine::models::import_llama::{self, ImportedLlama};
use kiln::engine::models::llama::Llama;
use kiln::engine::models::{MicroBatch, Network, NetworkOptions};
use kiln::engine::{DType, Device};
use serde_json::Value;

const FIXTURES: &[&str] = &[
    "gqa_f32",
    "tied_bf16",
    "sharded_f16",
    "llama3_f32",
    "qwen2_f32",
    "mistral_f32",
];

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/llama")
        .join(name)
}

struct Expected {
    tokens: Vec<u32>,
    targets: Vec<u32>,
    batch: usize,
    seq: usize,
    loss: f64,
    logits: Vec<f64>,
}

fn expected(name: &str) -> Expected {
    let text = std::fs::read_to_string(fixture(name).join("expected.json")).unwrap();
    let v: Value = serde_json::from_str(&text).unwrap();
    let ints = |k: &str| -> Vec<u32> {
        v[k].as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_u64().unwrap() as u32)
            .collect()
    };
    Expected {
        tokens: ints("tokens"),
        targets: ints("targets"),
        batch: v["batch"].as_u64().unwrap() as usize,
        seq: v["seq"].as_u64().unwrap() as usize,
        loss: v["loss"].as_f64().unwrap(),
        logits: v["logits"]
            .as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_f64().unwrap())
            .collect(),
    }
}

/// The loss and logits of `m` on the fixture's batch, activations in `dtype`.
fn run(dev: &dyn Device, m: &ImportedLlama, e: &Expected, dtype: DType) -> (f64, Vec<f32>) {
    let options = NetworkOptions {
        batch: e.batch,
        dtype,
        optimizer: adamw(),
        seed: 1,
        packed: false,
    };
    let model = Arc::new(Llama::new(m.config.clone(), e.seq).with_attention(Attention::Fused));
    let mut net = Network::new(dev, model, &options).unwrap();
    net.set_weights(dev, &m.weights).unwrap();
    let batch = MicroBatch::tokens(&e.tokens, &e.targets);
    let loss = net.loss(dev, &batch).unwrap();
    let logits = dev
        .download(net.output(net.prediction()).unwrap())
        .unwrap()
        .to_f32();
    (loss, logits)
}

/// (largest |logit - reference|, |loss - reference| / reference).
fn errors(got: &(f64, Vec<f32>), e: &Expected) -> (f64, f64) {
    assert_eq!(got.1.len(), e.logits.len(), "logit count");
    let max = got
        .1
        .iter()
        .zip(&e.logits)
        .map(|(&a, &b)| (a as f64 - b).abs())
        .fold(0.0, f64::max);
    (max, (got.0 - e.loss).abs() / e.loss.abs())
}

/// fp32: the import is exact (the stored values, widened) and only fp32 rounding of
/// the forward separates Kiln from the float64 reference — logits within 1e-4 and the
/// loss within 1e-5 relative, the bars of issue 29.
#[test]
fn imported_llamas_match_the_reference_in_fp32_on_every_backend() {
    let cpu = CpuDevice::new();
    let vulkan = gpu_path(0);
    let vk = gpu_path(3);
    for name in FIXTURES {
        let m = import_llama::read_hf(&fixture(name)).unwrap_or_else(|e| panic!("{name}: {e}"));
        let e = expected(name);
        for (dev, what) in [
            (&cpu as &dyn Device, "cpu"),
            (vulkan.dev.as_ref(), vulkan.name),
            (vk.dev.as_ref(), vk.name),
        ] {
            let (logit_err, loss_err) = errors(&run(dev, &m, &e, DType::F32), &e);
            assert!(
                logit_err <= 1e-4 && loss_err <= 1e-5,
                "{name} on {what}: logits off by {logit_err:.2e}, loss by {loss_err:.2e} relative"
            );
        }
    }
}

/// 16-bit activations (fp32 accumulation): every stored activation rounds to 8 (bf16)
/// or 11 (f16) significant bits, through two or three blocks. Measured on the CPU
/// backend (2026-12-05): bf16 logits off by up to 1.5e-1 (Qwen2), losses by 1.9e-3
/// relative; f16 logits by 4.9e-2, losses by 2.8e-4 (3.1e-4 on the GPUs, which round in other
/// places: fused attention, tiled GEMMs), all held to the same bars. The bars are
/// about twice the CPU's worst, far below what a wrong layout or rotary arrangement
/// gives (errors of the logits' own size, 1 to 3); the fp32 test above holds the exact
/// bars.
#[test]
fn imported_llamas_match_the_reference_with_16_bit_activations() {
    let cpu = CpuDevice::new();
    let vulkan = gpu_path(0);
    let vk = gpu_path(3);
    for name in FIXTURES {
        let m = import_llama::read_hf(&fixture(name)).unwrap();
        let e = expected(name);
        for (dev, what) in [
            (&cpu as &dyn Device, "cpu"),
            (vulkan.dev.as_ref(), vulkan.name),
            (vk.dev.as_ref(), vk.name),
        ] {
            for (dtype, logit_bar, loss_bar) in [(DType::BF16, 0.3, 4e-3), (DType::F16, 0.1, 6e-4)]
            {
                let (logit_err, loss_err) = errors(&run(dev, &m, &e, dtype), &e);
                eprintln!("{name} {dtype} on {what}: logits {logit_err:.2e}, loss {loss_err:.2e}");
                assert!(
                    logit_err <= logit_bar && loss_err <= loss_bar,
                    "{name} in {dtype} on {what}: logits off by {logit_err:.2e}, loss by \
                     {loss_err:.2e} relative"
                );
            }
        }
    }
}

#[test]
fn the_config_gives_the_sizes_and_the_weights_keep_their_names() {
    let m = import_llama::read_hf(&fixture("tied_bf16")).unwrap();
    let c = &m.config;
    assert_eq!(
        (
            c.n_layer,
            c.n_embd,
            c.n_head,
            c.kv_heads(),
            c.intermediate(),
            c.vocab_size
        ),
        (2, 32, 4, 1, 40, 37)
    );
    assert_eq!(
        (c.rope_theta, c.rms_norm_eps, c.tie_word_embeddings),
        (1e5, 1e-5, true)
    );
    assert_eq!(m.weights[0].name, "model.embed_tokens.weight");
    assert_eq!(m.weights[0].data.dtype(), DType::BF16);
    assert!(m.weights.iter().all(|t| t.name != "lm_head.weight"));
    let sharded = import_llama::read_hf(&fixture("sharded_f16")).unwrap();
    assert_eq!(sharded.files.len(), 3);
    assert_eq!(sharded.config.n_layer, 3);
    // Llama 3.2: the scaling and the head dim as config.json gives them.
    let c = import_llama::read_hf(&fixture("llama3_f32"))
        .unwrap()
        .config;
    let s = c.rope_scaling.expect("llama3 scaling");
    assert_eq!(
        (
            c.head_dim(),
            s.factor,
            s.low_freq_factor,
            s.high_freq_factor,
            s.original_max_position_embeddings
        ),
        (16, 32.0, 1.0, 4.0, 64)
    );
    // Qwen2: biases on q, k and v, named as Hugging Face names them; its
    // sliding_window is ignored (use_sliding_window is false).
    let q = import_llama::read_hf(&fixture("qwen2_f32")).unwrap();
    assert!(q.config.qkv_bias && q.config.sliding_window.is_none());
    let biases: Vec<&str> = q.weights[..8].iter().map(|t| t.name.as_str()).collect();
    assert_eq!(
        biases[5..],
        [
            "model.layers.0.self_attn.q_proj.bias",
            "model.layers.0.self_attn.k_proj.bias",
            "model.layers.0.self_attn.v_proj.bias"
        ]
    );
    let m = import_llama::read_hf(&fixture("mistral_f32")).unwrap();
    assert_eq!(m.config.sliding_window, Some(7));
    // transformers 5 writes theta and scaling as one `rope_parameters` object.
    for name in ["llama3_f32", "gqa_f32"] {
        let dir = copy(name, "rope-parameters");
        let path = dir.join("config.json");
        edit_json(&path, |c| {
            let mut p = match c.remove("rope_scaling") {
                Some(Value::Object(m)) => m,
                _ => serde_json::Map::from_iter([("rope_type".into(), "default".into())]),
            };
            p.insert("rope_theta".into(), c.remove("rope_theta").unwrap());
            c.insert("rope_parameters".into(), Value::Object(p));
        });
        let v5 = import_llama::read_hf(&dir).unwrap();
        let v4 = import_llama::read_hf(&fixture(name)).unwrap();
        assert_eq!(v5.config, v4.config, "{name}");
    }
}

/// Mistral's sliding window is full attention only up to its length: training on
/// longer sequences, or generating past it, is refused naming the window.
#[test]
fn sequences_past_a_sliding_window_are_refused() {
    let m = import_llama::read_hf(&fixture("mistral_f32")).unwrap();
    let cpu = CpuDevice::new();
    let options = NetworkOptions {
        batch: 1,
        dtype: DType::F32,
        optimizer: adamw(),
        seed: 1,
        packed: false,
    };
    let model = Arc::new(Llama::new(m.config.clone(), 8));
    let Err(e) = Network::new(&cpu, model, &options) else {
        panic!("a sequence of 8 past a window of 7 was accepted");
    };
    let e = e.to_string();
    assert!(
        e.contains("sliding window of 7") && e.contains("seq <= 7"),
        "{e}"
    );
    let weights: Vec<(String, Vec<f32>)> = m
        .weights
        .iter()
        .map(|t| (t.name.clone(), t.data.to_f32()))
        .collect();
    let model = Llama::new(m.config.clone(), 7);
    let e = Generator::new(&cpu, &model, &weights, DType::F32, 8)
        .unwrap_err()
        .to_string();
    assert!(e.contains("sliding window of 7"), "{e}");
    assert!(Generator::new(&cpu, &model, &weights, DType::F32, 7).is_ok());
}

/// A copy of fixture `name` in a scratch directory, for damaging.
fn copy(name: &str, tag: &str) -> PathBuf {
    let dir = scratch_dir("kiln-import-llama", tag);
    for f in std::fs::read_dir(fixture(name)).unwrap() {
        let f = f.unwrap().path();
        std::fs::copy(&f, dir.join(f.file_name().unwrap())).unwrap();
    }
    dir
}

fn edit_json(path: &Path, f: impl FnOnce(&mut serde_json::Map<String, Value>)) {
    let mut v: Value = serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    f(v.as_object_mut().unwrap());
    std::fs::write(path, serde_json::to_string(&v).unwrap()).unwrap();
}

fn refused(dir: &Path, parts: &[&str]) {
    let e = import_llama::read_hf(dir).unwrap_err().to_string();
    for p in parts {
        assert!(e.contains(p), "`{p}` not in: {e}");
    }
}

#[test]
fn unsupported_and_damaged_checkpoints_are_refused_naming_what() {
    // Settings Kiln's Llama does not compute.
    for (key, value, says) in [
        (
            "rope_scaling",
            serde_json::json!({"rope_type": "yarn", "factor": 8.0}),
            "of type `yarn`",
        ),
        (
            "rope_scaling",
            serde_json::json!({"rope_type": "llama3", "factor": 8.0}),
            "is missing or not a number",
        ),
        ("attention_bias", Value::Bool(true), "attention_bias"),
        ("sliding_window", Value::from(4), "sliding_window"),
        ("hidden_act", Value::from("gelu"), "hidden_act"),
        ("model_type", Value::from("gemma"), "model_type is `gemma`"),
    ] {
        let dir = copy("gqa_f32", key);
        edit_json(&dir.join("config.json"), |c| {
            c.insert(key.into(), value.clone());
        });
        refused(&dir, &[says, "config.json"]);
    }
    // Qwen2's sliding window on some layers.
    let dir = copy("qwen2_f32", "qwen-window");
    edit_json(&dir.join("config.json"), |c| {
        c.insert("use_sliding_window".into(), Value::Bool(true));
    });
    refused(&dir, &["use_sliding_window", "qwen2"]);
    // A Qwen2 checkpoint without its biases: the missing one named.
    let dir = copy("gqa_f32", "qwen-no-bias");
    edit_json(&dir.join("config.json"), |c| {
        c.insert("model_type".into(), Value::from("qwen2"));
    });
    refused(&dir, &["q_proj.bias"]);
    let dir = copy("gqa_f32", "no-config");
    std::fs::remove_file(dir.join("config.json")).unwrap();
    refused(&dir, &["config.json"]);
    // A config of another size than the weights: an MLP tensor and both shapes named.
    let dir = copy("gqa_f32", "other-size");
    edit_json(&dir.join("config.json"), |c| {
        c.insert("intermediate_size".into(), Value::from(48));
    });
    refused(&dir, &[".mlp.", "has shape", "MLP 48", "different models"]);
    // A missing shard, named with the tensor that needs it.
    let dir = copy("sharded_f16", "missing-shard");
    std::fs::remove_file(dir.join("model-00002-of-00003.safetensors")).unwrap();
    refused(&dir, &["model-00002-of-00003.safetensors", "missing"]);
    // A tensor in two shards: the index names one, the other shard holds it too.
    let dir = copy("sharded_f16", "twice");
    std::fs::copy(
        dir.join("model-00001-of-00003.safetensors"),
        dir.join("model-00002-of-00003.safetensors"),
    )
    .unwrap();
    refused(&dir, &["is in this shard", "model-00001-of-00003"]);
    // A truncated file.
    let dir = copy("gqa_f32", "truncated");
    let w = dir.join("model.safetensors");
    let bytes = std::fs::read(&w).unwrap();
    std::fs::write(&w, &bytes[..bytes.len() - 100]).unwrap();
    refused(&dir, &["model.safetensors", "truncated"]);
}

/// `kiln eval` on a Hugging Face Llama-family directory scores a token file with the
/// reference's loss (the fixture's stream, rows of T + 1 = 8; fp32 on the CPU, so the
/// fp32 bar holds), at the context asked for; Mistral's window caps the default
/// context. `kiln sample` says the tokenizer is what is missing, rather than guessing
/// one.
#[test]
fn kiln_eval_scores_a_llama_directory_with_the_reference_loss() {
    use kiln::eval::{eval, EvalOptions};
    let scratch = scratch_dir("kiln-import-llama", "eval");
    for (name, seq) in [
        ("qwen2_f32", Some(7)),
        ("llama3_f32", Some(7)),
        ("mistral_f32", None),
    ] {
        let text = std::fs::read_to_string(fixture(name).join("expected.json")).unwrap();
        let v: Value = serde_json::from_str(&text).unwrap();
        let stream: Vec<u32> = v["stream"]
            .as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_u64().unwrap() as u32)
            .collect();
        let want = v["stream_loss"].as_f64().unwrap();
        let bin = scratch.join(format!("{name}.bin"));
        kiln::engine::data::write_token_file(&bin, &stream, "fixture", 37).unwrap();
        let r = eval(&EvalOptions {
            source: fixture(name),
            data: Some(bin),
            devices: vec!["cpu".into()],
            dtype: Some(DType::F32),
            seq,
            ..EvalOptions::default()
        })
        .unwrap_or_else(|e| panic!("{name}: {e:#}"));
        assert_eq!((r.rows, r.seq, r.tokens), (2, 7, 14), "{name}");
        let rel = (r.loss as f64 - want).abs() / want;
        assert!(rel <= 1e-5, "{name}: loss {} vs reference {want}", r.loss);
    }
    // A context past the model's positions is refused.
    let e = eval(&EvalOptions {
        source: fixture("qwen2_f32"),
        data: Some(scratch.join("qwen2_f32.bin")),
        devices: vec!["cpu".into()],
        seq: Some(65),
        ..EvalOptions::default()
    })
    .unwrap_err();
    assert!(format!("{e:#}").contains("--seq 65: give 1 to 64"), "{e:#}");
    let source = kiln::sample::Source::open(&fixture("gqa_f32"), None).unwrap();
    let e = source.text_codec().unwrap_err();
    assert!(format!("{e:#}").contains("tokenizer.json"), "{e:#}");
    // Without --dtype a directory runs in its weights' 16-bit dtype (f16 for f32 ones).
    for (name, dtype) in [
        ("gqa_f32", DType::F16),
        ("tied_bf16", DType::BF16),
        ("sharded_f16", DType::F16),
    ] {
        let s = kiln::sample::Source::open(&fixture(name), None).unwrap();
        assert_eq!(s.dtype, dtype, "{name}");
    }
}

/// Export writes what import reads: every fixture (each family, tied or not, f32, f16
/// and bf16, sharded) read, written as a Hugging Face directory and read again gives
/// the same config and the same bits, under the same names; the config names the
/// family.
#[test]
fn export_then_import_is_bit_exact() {
    let scratch = scratch_dir("kiln-import-llama", "export");
    for name in FIXTURES {
        let m = import_llama::read_hf(&fixture(name)).unwrap();
        let out = scratch.join(name);
        import_llama::write_hf(&out, &m.config, &m.weights).unwrap();
        let back = import_llama::read_hf(&out).unwrap_or_else(|e| panic!("{name}: {e}"));
        assert_eq!(back.config, m.config, "{name}");
        assert_eq!(back.weights.len(), m.weights.len(), "{name}");
        for (a, b) in back.weights.iter().zip(&m.weights) {
            assert_eq!((&a.name, &a.shape), (&b.name, &b.shape), "{name}");
            assert_eq!(a.data.dtype(), b.data.dtype(), "{name}: {}", a.name);
            assert!(
                a.data.as_bytes() == b.data.as_bytes(),
                "{name}: {} differs",
                a.name
            );
        }
        let cfg: Value =
            serde_json::from_str(&std::fs::read_to_string(out.join("config.json")).unwrap())
                .unwrap();
        let want = match *name {
            "qwen2_f32" => "qwen2",
            "mistral_f32" => "mistral",
            _ => "llama",
        };
        assert_eq!(cfg["model_type"], want, "{name}");
    }
    std::fs::remove_dir_all(&scratch).ok();
}

/// `kiln prepare` of a prompt/completion set (JSON Lines and Parquet, the same rows)
/// with a model's tokenizer, then `kiln eval` of the example file, one example per row
/// and packed: the loss over the trained tokens (the completions and their EOS) equals
/// the reference's (eval_reference.py: NumPy in f64, each example run alone, sharing no
/// code with Kiln) on the CPU, wgpu and raw Vulkan. fp32 within 1e-5 relative: the
/// models are 2 layers of width 32, whose f32 sums differ from f64 by ~1e-7 relative,
/// and the GPU kernels sum in other orders; packing changes which rows hold an example,
/// not what it attends to.
#[test]
fn kiln_eval_of_prepared_examples_is_the_reference_completion_loss() {
    use kiln::eval::{eval, EvalOptions};
    let scratch = scratch_dir("kiln-import-llama", "examples");
    let here = fixture("");
    let tokenizer = here.join("sums_tokenizer");
    let text = std::fs::read_to_string(here.join("eval_expected.json")).unwrap();
    let expected: Value = serde_json::from_str(&text).unwrap();
    for input in ["sums.jsonl", "sums.parquet"] {
        let bin = scratch.join(format!("{input}.bin"));
        let o = std::process::Command::new(env!("CARGO_BIN_EXE_kiln"))
            .arg("prepare")
            .args([here.join(input), bin.clone()])
            .arg("--tokenizer")
            .arg(&tokenizer)
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&o.stderr);
        assert!(o.status.success(), "{input}: {err}");
        let models = ["llama3_f32", "qwen2_f32"];
        let devices = ["cpu", "vulkan", "vk:0"];
        for (name, device) in models.iter().flat_map(|m| devices.map(|d| (*m, d))) {
            let want = expected[name]["loss"].as_f64().unwrap();
            let tokens = expected[name]["tokens"].as_u64().unwrap() as usize;
            for packed in [false, true] {
                let what = format!("{input} on {name}, {device}, packed {packed}");
                let r = eval(&EvalOptions {
                    source: fixture(name),
                    data: Some(bin.clone()),
                    devices: vec![device.into()],
                    dtype: Some(DType::F32),
                    seq: Some(16),
                    micro_batch: Some(4),
                    packed,
                    ..EvalOptions::default()
                })
                .unwrap_or_else(|e| panic!("{what}: {e:#}"));
                assert_eq!(r.tokens, tokens, "{what}");
                // 12 examples of 101 tokens: one per row, or packed into rows of T + 1 =
                // 17 (at least 6; best-fit decreasing needs 7).
                let rows = if packed { 7 } else { 12 };
                assert_eq!(r.rows, rows, "{what}");
                let rel = (r.loss as f64 - want).abs() / want;
                assert!(rel <= 1e-5, "{what}: loss {} vs reference {want}", r.loss);
            }
        }
    }
    // --packed needs an example file.
    let stream = scratch.join("stream.bin");
    kiln::engine::data::write_token_file(&stream, &[1, 2, 3, 4, 5, 6, 7, 8], "fixture", 37)
        .unwrap();
    let e = eval(&EvalOptions {
        source: fixture("qwen2_f32"),
        data: Some(stream),
        devices: vec!["cpu".into()],
        seq: Some(3),
        packed: true,
        ..EvalOptions::default()
    })
    .unwrap_err();
    assert!(format!("{e:#}").contains("not an example file"), "{e:#}");
}
