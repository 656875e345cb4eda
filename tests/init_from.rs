//! `kiln train --init-from`: a run starts from another run's weights (its loss goes on
//! from where that run ended, not from ln V), from a Hugging Face directory or an llm.c
//! file; sizes, block_size and vocabulary are checked against the weights.

use std::path::{Path, PathBuf};

use kiln::engine::device::host::HostTensor;
use kiln::engine::models::gpt::{Gpt, GptConfig};
use kiln::engine::models::import;
use kiln::engine::models::Model;
use kiln::engine::train::runs;
use kiln::engine::{DType, HostData};
use kiln::train::{train, TrainOptions};

fn scratch(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("kiln-init-{name}-{}", std::process::id()));
    std::fs::remove_dir_all(&d).ok();
    std::fs::create_dir_all(&d).unwrap();
    d
}

const MODEL: &str =
    r#"{"n_layer": 1, "n_head": 2, "n_embd": 32, "block_size": 9, "vocab_size": 13}"#;

/// The addition demo on a tiny GPT, fp32 on the CPU, a fast constant learning rate.
fn options(dir: &Path, out: &str, model: &str) -> TrainOptions {
    let (config, model_path) = (dir.join("ds.json"), dir.join(format!("{out}.model.json")));
    std::fs::write(
        &config,
        r#"{"train_micro_batch_size_per_gpu": 32,
            "optimizer": {"type": "AdamW", "params": {"lr": 0.01}}}"#,
    )
    .unwrap();
    std::fs::write(&model_path, model).unwrap();
    TrainOptions {
        config: Some(config),
        model: Some(model_path),
        devices: vec!["cpu".into()],
        out: Some(dir.join(out)),
        eval_every: Some(0),
        ..TrainOptions::default()
    }
}

fn losses(run: &Path) -> Vec<f32> {
    runs::read_metrics(run)
        .unwrap()
        .iter()
        .map(|r| r.loss)
        .collect()
}

#[test]
fn a_run_started_from_another_runs_weights_goes_on_from_its_loss() {
    let dir = scratch("continue");
    let first = train(&TrainOptions {
        steps: Some(60),
        ..options(&dir, "first", MODEL)
    })
    .unwrap();
    let a = losses(&first.dir);
    let ln_v = (13f32).ln();
    // A fresh model starts at about ln V; 60 steps bring it well below.
    assert!((a[0] - ln_v).abs() < 0.3, "first loss {} vs ln 13", a[0]);
    let end = a[a.len() - 5..].iter().sum::<f32>() / 5.0;
    assert!(end < ln_v - 0.8, "the first run did not learn: {a:?}");
    // The model's sizes come from the run; no --model.
    let second = train(&TrainOptions {
        steps: Some(3),
        init_from: Some(first.dir.clone()),
        model: None,
        ..options(&dir, "second", MODEL)
    })
    .unwrap();
    let b = losses(&second.dir);
    assert!(
        (b[0] - end).abs() < 0.3,
        "the second run's first loss {} does not continue the first run's {end} (ln V is \
         {ln_v})",
        b[0]
    );
    let recorded = runs::read_config(&second.dir).unwrap();
    assert_eq!(recorded["init_from"], first.dir.display().to_string());
    // A checkpoint directory works the same.
    let ck = kiln::engine::train::checkpoint::load_latest(&first.dir).unwrap();
    let third = train(&TrainOptions {
        steps: Some(1),
        init_from: Some(ck.dir.clone()),
        ..options(&dir, "third", MODEL)
    })
    .unwrap();
    assert!((losses(&third.dir)[0] - end).abs() < 0.3);

    // A --model that disagrees is named with the weights it disagrees with.
    let e = format!(
        "{:#}",
        train(&TrainOptions {
            steps: Some(1),
            init_from: Some(first.dir.clone()),
            ..options(&dir, "wider", &MODEL.replace("32", "64"))
        })
        .unwrap_err()
    );
    for needle in [
        "wider.model.json",
        "disagrees",
        "n_embd 64 vs 32",
        "leave --model out",
    ] {
        assert!(e.contains(needle), "`{needle}` missing from: {e}");
    }
    assert!(e.contains(&first.dir.display().to_string()), "{e}");
    // block_size may shrink, not grow.
    let e = format!(
        "{:#}",
        train(&TrainOptions {
            steps: Some(1),
            init_from: Some(first.dir.clone()),
            ..options(
                &dir,
                "longer",
                &MODEL.replace("\"block_size\": 9", "\"block_size\": 12")
            )
        })
        .unwrap_err()
    );
    assert!(
        e.contains("block_size 12") && e.contains("at most 9"),
        "{e}"
    );
    // --resume continues a run from its own checkpoint: both at once is refused.
    let e = format!(
        "{:#}",
        train(&TrainOptions {
            resume: true,
            init_from: Some(first.dir.clone()),
            ..options(&dir, "first", MODEL)
        })
        .unwrap_err()
    );
    assert!(e.contains("--init-from with --resume"), "{e}");
    std::fs::remove_dir_all(&dir).ok();
}

/// A Llama run is a source as well: its sizes, architecture included, come from the
/// run, and the second run starts from the first one's loss.
#[test]
fn a_llama_run_started_from_another_llama_runs_weights_goes_on_from_its_loss() {
    let dir = scratch("llama");
    let llama = r#"{"architecture": "llama", "n_layer": 1, "n_head": 4, "n_kv_head": 2,
        "n_embd": 32, "block_size": 9, "vocab_size": 13}"#;
    let first = train(&TrainOptions {
        steps: Some(60),
        ..options(&dir, "first", llama)
    })
    .unwrap();
    let a = losses(&first.dir);
    let end = a[a.len() - 5..].iter().sum::<f32>() / 5.0;
    assert!(
        end < (13f32).ln() - 0.8,
        "the first run did not learn: {a:?}"
    );
    let second = train(&TrainOptions {
        steps: Some(3),
        init_from: Some(first.dir.clone()),
        model: None,
        ..options(&dir, "second", llama)
    })
    .unwrap();
    let b = losses(&second.dir);
    assert!(
        (b[0] - end).abs() < 0.3,
        "the second run's first loss {} does not continue the first run's {end}",
        b[0]
    );
    let recorded = runs::read_config(&second.dir).unwrap();
    assert_eq!(recorded["model"]["architecture"], "llama", "{recorded}");
    std::fs::remove_dir_all(&dir).ok();
}

/// A GPT-2 with GPT-2's vocabulary (tiny otherwise), written as a Hugging Face
/// directory.
fn gpt2_vocab_model(dir: &Path) -> GptConfig {
    let cfg = GptConfig {
        n_layer: 1,
        n_head: 1,
        n_embd: 8,
        block_size: 16,
        vocab_size: 50257,
        padded_vocab_size: None,
    };
    let w: Vec<HostTensor> = Gpt::new(cfg.clone(), 16)
        .parameters()
        .into_iter()
        .map(|p| {
            let n = p.len();
            HostTensor::new(
                p.name,
                p.shape,
                HostData::from_f32(DType::F32, &vec![0.01; n]),
            )
        })
        .collect();
    import::write_hf(dir, &cfg, &w).unwrap();
    cfg
}

#[test]
fn imported_weights_train_on_data_of_their_own_vocabulary_only() {
    let dir = scratch("vocab");
    let hf = dir.join("gpt2");
    gpt2_vocab_model(&hf);
    // Bytes (a text file, ids < 256) cannot feed GPT-2's BPE ids.
    let text = dir.join("notes.txt");
    std::fs::write(
        &text,
        "the quick brown fox jumps over the lazy dog. ".repeat(200),
    )
    .unwrap();
    let e = format!(
        "{:#}",
        train(&TrainOptions {
            steps: Some(1),
            init_from: Some(hf.clone()),
            model: None,
            data: Some(text.clone()),
            ..options(&dir, "bytes", MODEL)
        })
        .unwrap_err()
    );
    for needle in [
        "notes.txt",
        "vocabulary of 256 (bytes)",
        "50257 (GPT-2's BPE)",
        "kiln prepare --tokenizer gpt2",
    ] {
        assert!(e.contains(needle), "`{needle}` missing from: {e}");
    }
    // A prepared GPT-2 token file: trains, on a block_size cut below the 16 positions.
    let bin = dir.join("notes.bin");
    let ids: Vec<u32> = (0..4000u32).map(|i| (i * 7919) % 50257).collect();
    kiln::engine::data::write_token_file(&bin, &ids, "gpt2", 50257).unwrap();
    let model = r#"{"n_layer": 1, "n_head": 1, "n_embd": 8, "block_size": 8, "vocab_size": 50257}"#;
    let r = train(&TrainOptions {
        steps: Some(1),
        init_from: Some(hf.clone()),
        data: Some(bin),
        ..options(&dir, "tuned", model)
    })
    .unwrap();
    let first = losses(&r.dir)[0];
    // All-equal weights: every logit is the same, the loss exactly ln V (random weights
    // of std 0.02 would give about ln V + 2e-3).
    assert!(
        (first - (50257f32).ln()).abs() < 2e-4,
        "loss {first} from the imported weights"
    );
    std::fs::remove_dir_all(&dir).ok();
}

/// The flag reaches the command line: a path that is not there is named.
#[test]
fn the_cli_takes_init_from_and_names_a_missing_path() {
    let dir = scratch("cli");
    let missing = dir.join("no-such-model");
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_kiln"))
        .args(["train", "--devices", "cpu", "--steps", "1", "--out"])
        .arg(dir.join("run"))
        .arg("--init-from")
        .arg(&missing)
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(
        err.contains(&format!(
            "--init-from {}: does not exist",
            missing.display()
        )) && err.contains("Hugging Face GPT-2 directory"),
        "{err}"
    );
    assert!(
        !dir.join("run").exists(),
        "a run that failed to start wrote nothing"
    );
    std::fs::remove_dir_all(&dir).ok();
}

/// A Hugging Face Llama directory (the grouped-query fixture of tests/import_llama.rs,
/// vocabulary 37) starts a run: the recorded model is the directory's, and the
/// imported weights learn a deterministic next-token rule from its token file.
#[test]
fn a_hugging_face_llama_directory_starts_a_run() {
    let dir = scratch("hf-llama");
    let hf = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/llama/gqa_f32");
    // Every token is followed by (7 t + 3) mod 37: learnable from one token back.
    let mut ids = vec![1u32];
    while ids.len() < 4000 {
        ids.push((ids[ids.len() - 1] * 7 + 3) % 37);
    }
    let bin = dir.join("rule.bin");
    kiln::engine::data::write_token_file(&bin, &ids, "custom", 37).unwrap();
    let model = r#"{"architecture": "llama", "n_layer": 2, "n_head": 4, "n_kv_head": 2,
        "n_embd": 32, "block_size": 16, "vocab_size": 37, "intermediate_size": 40,
        "rms_norm_eps": 1e-5}"#;
    let r = train(&TrainOptions {
        steps: Some(40),
        init_from: Some(hf),
        data: Some(bin),
        ..options(&dir, "tuned", model)
    })
    .unwrap();
    let l = losses(&r.dir);
    let end = l[l.len() - 5..].iter().sum::<f32>() / 5.0;
    assert!(
        l[0] > 2.5 && end < l[0] - 1.5,
        "the imported Llama did not learn the rule: {l:?}"
    );
    let recorded = runs::read_config(&r.dir).unwrap();
    let m = &recorded["model"];
    assert_eq!(m["architecture"], "llama", "{recorded}");
    assert_eq!(
        (&m["n_kv_head"], &m["intermediate_size"], &m["vocab_size"]),
        (&2.into(), &40.into(), &37.into()),
        "{recorded}"
    );
    std::fs::remove_dir_all(&dir).ok();
}

/// A Hugging Face model directory with a tokenizer.json takes only data prepared with
/// that tokenizer (the sidecar's SHA-256 says so): data of another tokenizer, a text
/// file (bytes) or a bare token file would be trained on ids that mean other text.
#[test]
fn a_hugging_face_model_takes_only_data_of_its_own_tokenizer() {
    let dir = scratch("hf-llama-tokenizer");
    let hf = dir.join("model");
    std::fs::create_dir_all(&hf).unwrap();
    let fixture = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/llama/gqa_f32");
    for f in std::fs::read_dir(fixture).unwrap() {
        let f = f.unwrap().path();
        std::fs::copy(&f, hf.join(f.file_name().unwrap())).unwrap();
    }
    // A word-level tokenizer of the model's 37 ids, and one that numbers them in reverse.
    let tokenizer = |reverse: bool| {
        let vocab: serde_json::Map<String, serde_json::Value> = (0..37u32)
            .map(|i| (format!("w{i}"), (if reverse { 36 - i } else { i }).into()))
            .collect();
        serde_json::json!({
            "version": "1.0", "truncation": null, "padding": null, "added_tokens": [],
            "normalizer": null, "pre_tokenizer": {"type": "WhitespaceSplit"},
            "post_processor": null, "decoder": null,
            "model": {"type": "WordLevel", "vocab": vocab, "unk_token": "w0"}
        })
        .to_string()
    };
    std::fs::write(hf.join("tokenizer.json"), tokenizer(false)).unwrap();
    std::fs::write(hf.join("tokenizer_config.json"), r#"{"eos_token": "w36"}"#).unwrap();
    let other = dir.join("other.json");
    std::fs::write(&other, tokenizer(true)).unwrap();
    let text = dir.join("words.txt");
    let words: Vec<String> = (0..600).map(|i| format!("w{}", (i * 7 + 3) % 37)).collect();
    std::fs::write(&text, words.join(" ")).unwrap();
    let prepared = |name: &str, tok: &Path| {
        let bin = dir.join(name);
        let t = kiln::engine::data::Tokenizer::open(tok.to_str().unwrap()).unwrap();
        kiln::engine::data::prepare(&text, &bin, t).unwrap();
        bin
    };
    // The sizes from the directory, the sequence from --seq (the fixture's
    // max_position_embeddings is 64).
    let run = |data: PathBuf, out: &str| {
        train(&TrainOptions {
            steps: Some(2),
            init_from: Some(hf.clone()),
            data: Some(data),
            model: None,
            seq: Some(16),
            ..options(&dir, out, "")
        })
    };
    let own = prepared("own.bin", &hf);
    let r = run(own.clone(), "own").expect("data of the model's own tokenizer trains");
    let recorded = runs::read_config(&r.dir).unwrap();
    assert_eq!(recorded["model"]["block_size"], 16, "{recorded}");
    // Exported, the fine-tuned model is a Hugging Face Llama again: its own positions
    // (64, not the 16 it trained on), the tuned weights, the tokenizer beside them.
    let out = dir.join("export");
    let e = kiln::export::export(&r.dir, "hf", &out).unwrap();
    assert_eq!(e.model_type, "llama");
    let back = kiln::engine::models::import_llama::read_hf(&out).unwrap();
    assert_eq!(back.config.block_size, 64);
    let tuned = kiln::sample::Source::open(&r.dir, None).unwrap();
    for (a, b) in back.weights.iter().zip(&tuned.weights) {
        assert_eq!(a.name, b.name);
        assert!(a.data.as_bytes() == b.data.as_bytes(), "{} differs", a.name);
    }
    assert_eq!(
        std::fs::read(out.join("tokenizer.json")).unwrap(),
        std::fs::read(hf.join("tokenizer.json")).unwrap()
    );
    assert_eq!(e.tokenizer_files.len(), 2);
    let cfg: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("config.json")).unwrap()).unwrap();
    assert_eq!(cfg["eos_token_id"], 36, "{cfg}");
    let e = train(&TrainOptions {
        steps: Some(2),
        init_from: Some(hf.clone()),
        data: Some(own),
        model: None,
        seq: Some(65),
        ..options(&dir, "long", "")
    })
    .unwrap_err();
    assert!(format!("{e:#}").contains("--seq 65: give 1 to 64"), "{e:#}");
    // A run started from the tuned run's weights takes the same tokenizer's data only:
    // the tuned run's data sidecar names it.
    let again = |data: PathBuf, out: &str| {
        train(&TrainOptions {
            steps: Some(2),
            init_from: Some(r.dir.clone()),
            data: Some(data),
            model: None,
            ..options(&dir, out, "")
        })
    };
    again(dir.join("own.bin"), "again").expect("the same tokenizer's data trains");
    let e = format!(
        "{:#}",
        again(prepared("other2.bin", &other), "again-other").unwrap_err()
    );
    assert!(e.contains("was tokenized by"), "{e}");
    let e = format!(
        "{:#}",
        run(prepared("other.bin", &other), "other").unwrap_err()
    );
    assert!(
        e.contains("other.json") && e.contains("was tokenized by") && e.contains("kiln prepare"),
        "{e}"
    );
    let e = format!("{:#}", run(text.clone(), "text").unwrap_err());
    assert!(e.contains("has no sidecar naming its tokenizer"), "{e}");
    std::fs::remove_dir_all(&dir).ok();
}
