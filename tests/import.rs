//! GPT-2 checkpoints as people have them: a Hugging Face directory and an llm.c `.bin`,
//! each written here by hand in its own layout, give the same logits and loss as the
//! same weights set in memory (CPU and Vulkan); export and re-import is bit-exact in
//! both formats; damaged and hostile files are refused with the file and tensor named.

mod common;

use std::path::Path;

use common::*;
use kiln::cpu::CpuDevice;
use kiln::engine::device::host::HostTensor;
use kiln::engine::graph::Attention;
use kiln::engine::models::gpt::{Gpt, GptConfig};
use kiln::engine::models::import::{self, Format};
use kiln::engine::models::{MicroBatch, Model, Network, NetworkOptions};
use kiln::engine::{DType, Device, HostData};

const V: usize = 13;
const VP: usize = 64;
const C: usize = 16;
const L: usize = 2;
const POSITIONS: usize = 8;
const T: usize = 6;
const B: usize = 2;

fn cfg(padded: bool) -> GptConfig {
    GptConfig {
        n_layer: L,
        n_head: 2,
        n_embd: C,
        block_size: POSITIONS,
        vocab_size: V,
        padded_vocab_size: padded.then_some(VP),
    }
}

/// Random weights for every parameter of `cfg`'s GPT (Kiln names and layout), f32.
/// Padding rows of the embedding get values as large as the real ones, so a loss that
/// let them in would differ.
fn weights(cfg: &GptConfig, seed: u64) -> Vec<HostTensor> {
    let mut rng = Rng::new(seed);
    Gpt::new(cfg.clone(), cfg.block_size)
        .parameters()
        .into_iter()
        .map(|p| {
            let n = p.len();
            let v: Vec<f32> = (0..n).map(|_| rng.uniform(-0.5, 0.5)).collect();
            HostTensor::new(p.name, p.shape, HostData::F32(v))
        })
        .collect()
}

fn tmp(name: &str) -> std::path::PathBuf {
    let d = std::env::temp_dir().join(format!("kiln-import-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// Writes an HF GPT-2 directory the way `transformers` saves one: `transformer.`
/// names, Conv1D (in, out) weights, the causal-mask buffers, a tied `lm_head.weight`.
fn write_hf_by_hand(dir: &Path, cfg: &GptConfig, w: &[HostTensor], config: serde_json::Value) {
    let mut views = vec![];
    for t in w {
        views.push((t.name.clone(), t.shape.clone(), t.data.as_bytes().to_vec()));
    }
    let mask: Vec<u8> = (0..POSITIONS * POSITIONS)
        .flat_map(|i| {
            if i % POSITIONS <= i / POSITIONS {
                1f32
            } else {
                0f32
            }
            .to_le_bytes()
        })
        .collect();
    for l in 0..cfg.n_layer {
        views.push((
            format!("transformer.h.{l}.attn.bias"),
            vec![1, 1, POSITIONS, POSITIONS],
            mask.clone(),
        ));
        views.push((
            format!("transformer.h.{l}.attn.masked_bias"),
            vec![],
            (-1e4f32).to_le_bytes().to_vec(),
        ));
    }
    views.push((
        "lm_head.weight".into(),
        w[0].shape.clone(),
        w[0].data.as_bytes().to_vec(),
    ));
    let st: Vec<_> = views
        .iter()
        .map(|(n, s, b)| {
            (
                n.clone(),
                safetensors::tensor::TensorView::new(safetensors::Dtype::F32, s.clone(), b)
                    .unwrap(),
            )
        })
        .collect();
    std::fs::write(
        dir.join("model.safetensors"),
        safetensors::serialize(st, None).unwrap(),
    )
    .unwrap();
    std::fs::write(dir.join("config.json"), config.to_string()).unwrap();
}

/// Writes an llm.c `.bin` (version 3, f32) by hand: the header, then each kind of
/// tensor stacked over the layers, projections (out, in).
fn write_llmc_by_hand(path: &Path, cfg: &GptConfig, w: &[HostTensor]) {
    let get = |n: &str| w.iter().find(|t| t.name == n).unwrap();
    let mut out: Vec<u8> = vec![];
    let mut header = [0i32; 256];
    header[..8].copy_from_slice(&[
        20240326,
        3,
        cfg.block_size as i32,
        cfg.vocab_size as i32,
        cfg.n_layer as i32,
        cfg.n_head as i32,
        cfg.n_embd as i32,
        cfg.padded_vocab() as i32,
    ]);
    header.iter().for_each(|v| out.extend(v.to_le_bytes()));
    let mut put = |t: &HostTensor, transpose: bool| {
        let v = t.data.to_f32();
        if transpose {
            let (rows, cols) = (t.shape[0], t.shape[1]);
            for c in 0..cols {
                for r in 0..rows {
                    out.extend(v[r * cols + c].to_le_bytes());
                }
            }
        } else {
            v.iter().for_each(|x| out.extend(x.to_le_bytes()));
        }
    };
    put(get("transformer.wte.weight"), false);
    put(get("transformer.wpe.weight"), false);
    for (kind, tr) in [
        ("ln_1.weight", false),
        ("ln_1.bias", false),
        ("attn.c_attn.weight", true),
        ("attn.c_attn.bias", false),
        ("attn.c_proj.weight", true),
        ("attn.c_proj.bias", false),
        ("ln_2.weight", false),
        ("ln_2.bias", false),
        ("mlp.c_fc.weight", true),
        ("mlp.c_fc.bias", false),
        ("mlp.c_proj.weight", true),
        ("mlp.c_proj.bias", false),
    ] {
        for l in 0..cfg.n_layer {
            put(get(&format!("transformer.h.{l}.{kind}")), tr);
        }
    }
    put(get("transformer.ln_f.weight"), false);
    put(get("transformer.ln_f.bias"), false);
    std::fs::write(path, out).unwrap();
}

fn batch() -> MicroBatch {
    let tok: Vec<u32> = (0..B * T).map(|i| (i * 5 % V) as u32).collect();
    let tgt: Vec<u32> = (0..B * T).map(|i| ((i * 5 + 3) % V) as u32).collect();
    MicroBatch::tokens(&tok, &tgt)
}

/// The loss and the logits of one forward pass of `cfg`'s GPT (T positions) holding `w`.
fn forward(dev: &dyn Device, cfg: &GptConfig, w: &[HostTensor]) -> (f64, HostData) {
    let options = NetworkOptions {
        batch: B,
        dtype: DType::F32,
        optimizer: adamw(),
        seed: 1,
        packed: false,
    };
    let model = std::sync::Arc::new(Gpt::new(cfg.clone(), T).with_attention(Attention::Fused));
    let mut net = Network::new(dev, model, &options).unwrap();
    net.set_weights(dev, w).unwrap();
    let loss = net.loss(dev, &batch()).unwrap();
    let logits = dev.download(net.output(net.prediction()).unwrap()).unwrap();
    (loss, logits)
}

fn bits(h: &HostData) -> Vec<u32> {
    h.to_f32().iter().map(|v| v.to_bits()).collect()
}

#[test]
fn hf_and_llmc_files_give_the_logits_of_the_same_weights_in_memory() {
    let dir = tmp("same-logits");
    let cpu = CpuDevice::new();
    let vulkan = gpu_path(0);
    for padded in [false, true] {
        let cfg = cfg(padded);
        let w = weights(&cfg, 7);
        let hf = dir.join(format!("hf-{padded}"));
        std::fs::create_dir_all(&hf).unwrap();
        let mut config = serde_json::json!({
            "model_type": "gpt2", "n_layer": L, "n_head": 2, "n_embd": C,
            "n_ctx": POSITIONS, "vocab_size": cfg.padded_vocab(),
            "activation_function": "gelu_new", "layer_norm_epsilon": 1e-5,
        });
        if padded {
            config["kiln_vocab_size"] = V.into();
        }
        write_hf_by_hand(&hf, &cfg, &w, config);
        let bin = dir.join(format!("model-{padded}.bin"));
        write_llmc_by_hand(&bin, &cfg, &w);
        for (file, format) in [(hf.clone(), Format::HuggingFace), (bin, Format::LlmC)] {
            let imported = import::read(&file).unwrap();
            assert_eq!(imported.format, format);
            assert_eq!(imported.config, cfg, "{format}: sizes from the file");
            for dev in [&cpu as &dyn Device, vulkan.dev.as_ref()] {
                let what = format!("{format}, padded {padded}, {}", dev.caps().name);
                let want = forward(dev, &cfg, &w);
                let got = forward(dev, &cfg, &imported.weights);
                assert_eq!(got.0.to_bits(), want.0.to_bits(), "{what}: loss");
                assert_eq!(bits(&got.1), bits(&want.1), "{what}: logits");
            }
        }
        if padded {
            // The padding rows take no part in the loss: the unpadded model holding the
            // first V rows has the same loss.
            let mut small = w.clone();
            small[0] = HostTensor::new(
                "transformer.wte.weight",
                vec![V, C],
                HostData::F32(w[0].data.to_f32()[..V * C].to_vec()),
            );
            for dev in [&cpu as &dyn Device, vulkan.dev.as_ref()] {
                let (a, _) = forward(dev, &cfg, &w);
                let (b, _) = forward(dev, &self::cfg(false), &small);
                assert!(
                    (a - b).abs() <= 1e-6 * b.abs(),
                    "{}: padded loss {a} vs unpadded {b}",
                    dev.caps().name
                );
            }
        }
    }
    // Without the prefix and without a head, as the hub's gpt2 repository has it.
    let cfg = cfg(false);
    let w = weights(&cfg, 8);
    let bare = dir.join("bare");
    std::fs::create_dir_all(&bare).unwrap();
    let st: Vec<_> = w
        .iter()
        .map(|t| {
            (
                t.name.strip_prefix("transformer.").unwrap().to_string(),
                safetensors::tensor::TensorView::new(
                    safetensors::Dtype::F32,
                    t.shape.clone(),
                    t.data.as_bytes(),
                )
                .unwrap(),
            )
        })
        .collect();
    std::fs::write(
        bare.join("model.safetensors"),
        safetensors::serialize(st, None).unwrap(),
    )
    .unwrap();
    std::fs::write(
        bare.join("config.json"),
        serde_json::json!({"n_layer": L, "n_head": 2, "n_embd": C, "n_positions": POSITIONS,
            "vocab_size": V})
        .to_string(),
    )
    .unwrap();
    let imported = import::read(&bare.join("model.safetensors")).unwrap();
    for (a, b) in imported.weights.iter().zip(&w) {
        assert_eq!((&a.name, bits(&a.data)), (&b.name, bits(&b.data)));
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

/// Export then import gives back the same sizes and the same bits, in both formats and
/// every dtype each holds.
#[test]
fn export_and_import_round_trip_bit_exact() {
    let dir = tmp("round-trip");
    for padded in [false, true] {
        let cfg = cfg(padded);
        for dtype in [DType::F32, DType::F16, DType::BF16] {
            let w: Vec<HostTensor> = weights(&cfg, 9)
                .into_iter()
                .map(|t| {
                    HostTensor::new(t.name, t.shape, HostData::from_f32(dtype, &t.data.to_f32()))
                })
                .collect();
            let hf = dir.join(format!("hf-{padded}-{dtype}"));
            import::write_hf(&hf, &cfg, &w).unwrap();
            let mut files = vec![(hf, Format::HuggingFace)];
            if dtype != DType::F16 {
                let bin = dir.join(format!("{padded}-{dtype}.bin"));
                import::write_llmc(&bin, &cfg, &w, dtype).unwrap();
                files.push((bin, Format::LlmC));
            }
            for (path, format) in files {
                let back = import::read(&path).unwrap();
                let what = format!("{format} {dtype} padded {padded}");
                assert_eq!(back.format, format, "{what}");
                assert_eq!(back.config, cfg, "{what}");
                assert_eq!(back.weights.len(), w.len(), "{what}");
                for (a, b) in back.weights.iter().zip(&w) {
                    assert_eq!(a.name, b.name, "{what}");
                    assert_eq!(a.shape, b.shape, "{what}: {}", a.name);
                    assert_eq!(a.data.dtype(), dtype, "{what}: {}", a.name);
                    assert_eq!(a.data.as_bytes(), b.data.as_bytes(), "{what}: {}", a.name);
                }
            }
        }
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

/// `block_size` below the checkpoint's positions keeps the first rows of wpe.
#[test]
fn block_size_may_be_cut_below_the_checkpoints_positions() {
    let dir = tmp("cut");
    let cfg = cfg(false);
    let w = weights(&cfg, 10);
    import::write_hf(&dir, &cfg, &w).unwrap();
    let cut = import::read(&dir).unwrap().with_block_size(T).unwrap();
    assert_eq!(cut.config.block_size, T);
    let wpe = cut
        .weights
        .iter()
        .find(|t| t.name == "transformer.wpe.weight")
        .unwrap();
    assert_eq!(wpe.shape, vec![T, C]);
    assert_eq!(wpe.data.to_f32(), w[1].data.to_f32()[..T * C].to_vec());
    let e = import::read(&dir)
        .unwrap()
        .with_block_size(POSITIONS + 1)
        .unwrap_err()
        .to_string();
    assert!(e.contains("block_size 9") && e.contains("at most 8"), "{e}");
    std::fs::remove_dir_all(&dir).unwrap();
}

fn err(path: &Path) -> String {
    import::read(path).unwrap_err().to_string()
}

fn has(e: &str, parts: &[&str]) {
    for p in parts {
        assert!(e.contains(p), "`{p}` not in: {e}");
    }
}

#[test]
fn damaged_and_hostile_hf_files_are_refused_naming_file_and_tensor() {
    let dir = tmp("hostile-hf");
    let cfg = cfg(false);
    let w = weights(&cfg, 11);
    let good = dir.join("good");
    import::write_hf(&good, &cfg, &w).unwrap();
    let bytes = std::fs::read(good.join("model.safetensors")).unwrap();
    let config = std::fs::read_to_string(good.join("config.json")).unwrap();
    let case = |name: &str, st: &[u8], config: &str| {
        let d = dir.join(name);
        std::fs::create_dir_all(&d).unwrap();
        std::fs::write(d.join("model.safetensors"), st).unwrap();
        std::fs::write(d.join("config.json"), config).unwrap();
        (d.join("model.safetensors").display().to_string(), err(&d))
    };
    // The header's length is beyond the file.
    let mut long = bytes.clone();
    long[..8].copy_from_slice(&(1u64 << 40).to_le_bytes());
    let (file, e) = case("header-beyond", &long, &config);
    has(&e, &[&file, "not a valid safetensors file"]);
    // Truncated: the data is shorter than the header says.
    let (file, e) = case("truncated", &bytes[..bytes.len() - 10], &config);
    has(&e, &[&file, "truncated or corrupted"]);
    // A header claiming a terabyte tensor backed by 64 bytes: refused from the header
    // and the file's length, before any copy.
    let header = br#"{"transformer.wte.weight":{"dtype":"F32","shape":[1099511627776,16],"data_offsets":[0,64]}}"#;
    let mut forged = (header.len() as u64).to_le_bytes().to_vec();
    forged.extend_from_slice(header);
    forged.extend_from_slice(&[0u8; 64]);
    let (file, e) = case("forged-shape", &forged, &config);
    has(&e, &[&file, "not a valid safetensors file"]);
    // config.json disagrees with the shapes.
    let wider = config.replace("\"n_embd\": 16", "\"n_embd\": 32");
    assert_ne!(wider, config);
    let (file, e) = case("wider", &bytes, &wider);
    // Tensors are checked in the file's order: whichever comes first is named.
    has(
        &e,
        &[
            &file,
            "tensor `transformer.",
            "has shape",
            "n_embd 32",
            "config.json",
            "different models",
        ],
    );
    // Absurd sizes in config.json: refused before anything is allocated.
    let absurd = config.replace("\"n_embd\": 16", "\"n_embd\": 1000000000000");
    let (_, e) = case("absurd", &bytes, &absurd);
    has(&e, &["config.json", "n_embd", "smaller"]);
    assert_eq!(e.matches("invalid argument").count(), 1, "{e}");
    // A missing tensor.
    let fewer: Vec<_> = w
        .iter()
        .filter(|t| t.name != "transformer.h.1.mlp.c_fc.bias")
        .collect();
    let st: Vec<_> = fewer
        .iter()
        .map(|t| {
            (
                t.name.clone(),
                safetensors::tensor::TensorView::new(
                    safetensors::Dtype::F32,
                    t.shape.clone(),
                    t.data.as_bytes(),
                )
                .unwrap(),
            )
        })
        .collect();
    let (file, e) = case(
        "missing",
        &safetensors::serialize(st, None).unwrap(),
        &config,
    );
    has(&e, &[&file, "no tensor `h.1.mlp.c_fc.bias`"]);
    // An LM head that is not the embedding: Kiln cannot untie it.
    let mut head = w[0].data.to_f32();
    head[3] += 1.0;
    let mut st: Vec<_> = w
        .iter()
        .map(|t| {
            (
                t.name.clone(),
                safetensors::tensor::TensorView::new(
                    safetensors::Dtype::F32,
                    t.shape.clone(),
                    t.data.as_bytes(),
                )
                .unwrap(),
            )
        })
        .collect();
    let head_bytes: Vec<u8> = head.iter().flat_map(|v| v.to_le_bytes()).collect();
    st.push((
        "lm_head.weight".into(),
        safetensors::tensor::TensorView::new(safetensors::Dtype::F32, vec![V, C], &head_bytes)
            .unwrap(),
    ));
    let (file, e) = case(
        "untied",
        &safetensors::serialize(st, None).unwrap(),
        &config,
    );
    has(
        &e,
        &[
            &file,
            "lm_head.weight",
            "differs from the token embedding",
            "ties",
        ],
    );
    // No config.json.
    let d = dir.join("no-config");
    std::fs::create_dir_all(&d).unwrap();
    std::fs::write(d.join("model.safetensors"), &bytes).unwrap();
    has(&err(&d), &["config.json", "beside model.safetensors"]);
    // Another architecture's config.
    let (_, e) = case("llama", &bytes, &config.replace("\"gpt2\"", "\"llama\""));
    has(&e, &["model_type is `llama`", "GPT-2"]);
    // Not there at all.
    has(&err(&dir.join("nope")), &["nope", "does not exist"]);
    // Not a model at all.
    let junk = dir.join("notes.txt");
    std::fs::write(&junk, "hello").unwrap();
    has(
        &err(&junk),
        &["notes.txt", "not a model Kiln can import", "llm.c"],
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn damaged_and_hostile_llmc_files_are_refused_naming_the_file() {
    let dir = tmp("hostile-llmc");
    let cfg = cfg(true);
    let w = weights(&cfg, 12);
    let good = dir.join("good.bin");
    import::write_llmc(&good, &cfg, &w, DType::F32).unwrap();
    let bytes = std::fs::read(&good).unwrap();
    let case = |name: &str, b: &[u8]| {
        let p = dir.join(name);
        std::fs::write(&p, b).unwrap();
        (
            p.display().to_string(),
            import::read_llmc(&p).unwrap_err().to_string(),
        )
    };
    let set = |i: usize, v: i32| {
        let mut b = bytes.clone();
        b[4 * i..4 * i + 4].copy_from_slice(&v.to_le_bytes());
        b
    };
    let (file, e) = case("short.bin", &bytes[..100]);
    has(&e, &[&file, "shorter than llm.c's 1024-byte header"]);
    let (file, e) = case("truncated.bin", &bytes[..bytes.len() - 4]);
    has(
        &e,
        &[&file, "truncated", &format!("{} bytes", bytes.len() - 4)],
    );
    let (file, e) = case("magic.bin", &set(0, 7));
    has(&e, &[&file, "magic number 7"]);
    let (file, e) = case("v1.bin", &set(1, 1));
    has(&e, &[&file, "version 1", "3 (f32) and 5 (bf16)"]);
    let (file, e) = case("vp.bin", &set(7, 5));
    has(&e, &[&file, "padded_vocab_size 5 is below vocab_size 13"]);
    let (file, e) = case("negative.bin", &set(6, -16));
    has(&e, &[&file, "channels is -16"]);
    // Sizes whose weights would be terabytes: refused from the header and the file's
    // length alone (the test would run out of memory otherwise).
    let (file, e) = case("huge.bin", &set(6, 1 << 20));
    has(&e, &[&file]);
    assert!(e.contains("make") || e.contains("truncated"), "{e}");
    let (file, e) = case("layers.bin", &set(4, 3));
    has(
        &e,
        &[&file, "3 layers", "truncated, or its header is damaged"],
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

/// Evaluation's argmax never picks a padding column, even where its logit is the
/// largest (pad rows of an imported embedding need not be zero).
#[test]
fn predictions_of_a_padded_model_are_real_tokens() {
    let cfg = cfg(true);
    let mut w = weights(&cfg, 13);
    let mut wte = w[0].data.to_f32();
    for j in V..VP {
        for c in 0..C {
            wte[j * C + c] = 50.0 * wte[(j % V) * C + c];
        }
    }
    w[0] = HostTensor::new(w[0].name.clone(), w[0].shape.clone(), HostData::F32(wte));
    let dev = CpuDevice::new();
    let options = NetworkOptions {
        batch: B,
        dtype: DType::F32,
        optimizer: adamw(),
        seed: 1,
        packed: false,
    };
    let model = std::sync::Arc::new(Gpt::new(cfg.clone(), T).with_attention(Attention::Fused));
    let mut net = Network::new(&dev, model, &options).unwrap();
    net.set_weights(&dev, &w).unwrap();
    let (_, predicted) = net.predict(&dev, &batch()).unwrap();
    let logits = dev
        .download(net.output(net.prediction()).unwrap())
        .unwrap()
        .to_f32();
    let argmax =
        |row: &[f32]| (0..row.len()).fold(0, |a, i| if row[i] > row[a] { i } else { a }) as u32;
    let rows: Vec<&[f32]> = logits.chunks(VP).collect();
    assert!(
        rows.iter().any(|r| argmax(r) >= V as u32),
        "the test needs a row whose largest logit is a padding column"
    );
    let want: Vec<u32> = rows.iter().map(|r| argmax(&r[..V])).collect();
    assert_eq!(predicted, want);
}
