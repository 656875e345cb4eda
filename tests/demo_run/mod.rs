//! A small addition-demo run, trained once per test binary, for the tests of the
//! commands that read runs (`kiln sample`, `kiln eval`).
#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::sync::OnceLock;

use kiln::engine::data::Addition;
use kiln::engine::models::{gpt, MicroBatch, Network, NetworkOptions};
use kiln::engine::train::checkpoint::{self, MODEL_FILE};
use kiln::engine::{Device, Optimizer, IGNORE_TARGET};
use kiln::train::{train, RunReport, TrainOptions};

/// The demo's block size: one problem line of 10 tokens is 9 fed and 1 predicted.
pub const T: usize = 9;

pub fn model_config() -> gpt::GptConfig {
    gpt::GptConfig {
        n_layer: 1,
        n_head: 2,
        n_embd: 16,
        block_size: T,
        vocab_size: 13,
        padded_vocab_size: None,
    }
}

/// A run of the addition demo (a smaller model, a few steps on the CPU backend), and
/// what `kiln train` reported for it.
pub fn run(tag: &str) -> &'static (PathBuf, RunReport) {
    static RUN: OnceLock<(PathBuf, RunReport)> = OnceLock::new();
    RUN.get_or_init(|| {
        let dir = std::env::temp_dir().join(format!("kiln-{tag}-{}", std::process::id()));
        std::fs::remove_dir_all(&dir).ok();
        std::fs::create_dir_all(&dir).unwrap();
        let model = dir.join("model.json");
        let c = model_config();
        std::fs::write(
            &model,
            format!(
                r#"{{"n_layer": {}, "n_head": {}, "n_embd": {}, "block_size": {}, "vocab_size": {}}}"#,
                c.n_layer, c.n_head, c.n_embd, c.block_size, c.vocab_size
            ),
        )
        .unwrap();
        let config = dir.join("ds_config.json");
        std::fs::write(
            &config,
            r#"{"train_micro_batch_size_per_gpu": 32, "gradient_accumulation_steps": 1,
                "fp16": {"enabled": true, "initial_scale_power": 12},
                "optimizer": {"type": "AdamW", "params": {"lr": 0.01}}}"#,
        )
        .unwrap();
        let out = dir.join("run");
        let report = train(&TrainOptions {
            config: Some(config),
            model: Some(model),
            devices: vec!["cpu".into()],
            out: Some(out.clone()),
            steps: Some(6),
            eval_every: Some(0),
            checkpoint_every: Some(0),
            progress: false,
            ..TrainOptions::default()
        })
        .unwrap();
        (out, report)
    })
}

pub fn kiln(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_kiln"))
        .args(args)
        .output()
        .expect("run kiln")
}

pub fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

/// The latest checkpoint's weights in a batch-1 network built here, apart from the
/// code under test.
pub fn network(run: &Path, dev: &dyn Device) -> Network {
    let model = std::sync::Arc::new(gpt::Gpt::new(model_config(), T));
    network_of(run, dev, model)
}

/// [`network`] for any model of the run's sizes.
pub fn network_of(
    run: &Path,
    dev: &dyn Device,
    model: std::sync::Arc<dyn kiln::engine::models::Model>,
) -> Network {
    let ck = checkpoint::load_latest(run).unwrap();
    let options = NetworkOptions {
        batch: 1,
        dtype: kiln::engine::DType::F16,
        optimizer: Optimizer::adamw(0.0, 0.0),
        seed: 0,
        packed: false,
    };
    let net = Network::new(dev, model, &options).unwrap();
    let names: Vec<String> = net.specs().map(|s| s.name.clone()).collect();
    for (i, name) in names.iter().enumerate() {
        net.set_value(dev, i, &ck.tensor(MODEL_FILE, name).unwrap().data)
            .unwrap();
    }
    net
}

/// Greedy continuation of `prompt` by `new` tokens, by Network::predict's argmax at
/// the last fed position of the whole (padded) sequence.
pub fn greedy(net: &Network, dev: &dyn Device, prompt: &str, new: usize) -> String {
    let mut ids = Addition::encode(prompt).unwrap();
    let start = ids.len();
    for _ in 0..new {
        let mut tok = ids.clone();
        tok.resize(T, 0);
        let (_, pred) = net
            .predict(dev, &MicroBatch::tokens(&tok, &[IGNORE_TARGET; T]))
            .unwrap();
        ids.push(pred[ids.len() - 1]);
    }
    Addition::decode(&ids[start..])
}

/// A byte-level run on a small text file (vocabulary 256, a held-out tail of 10 rows).
pub fn text_run(tag: &str) -> &'static (PathBuf, RunReport) {
    static RUN: OnceLock<(PathBuf, RunReport)> = OnceLock::new();
    RUN.get_or_init(|| {
        let dir = std::env::temp_dir().join(format!("kiln-{tag}-text-{}", std::process::id()));
        std::fs::remove_dir_all(&dir).ok();
        std::fs::create_dir_all(&dir).unwrap();
        let text = dir.join("text.txt");
        let line = "the quick brown fox jumps over the lazy dog; ünïcödé 日本語\n";
        std::fs::write(&text, line.repeat(40)).unwrap();
        let model = dir.join("model.json");
        std::fs::write(
            &model,
            format!(
                r#"{{"n_layer": 1, "n_head": 2, "n_embd": 16, "block_size": {T}, "vocab_size": 256}}"#
            ),
        )
        .unwrap();
        let config = dir.join("ds_config.json");
        std::fs::write(
            &config,
            r#"{"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1,
                "bf16": {"enabled": true},
                "optimizer": {"type": "AdamW", "params": {"lr": 0.01}}}"#,
        )
        .unwrap();
        let out = dir.join("run");
        let report = train(&TrainOptions {
            config: Some(config),
            model: Some(model),
            data: Some(text),
            devices: vec!["cpu".into()],
            out: Some(out.clone()),
            steps: Some(3),
            eval_every: Some(0),
            checkpoint_every: Some(0),
            progress: false,
            ..TrainOptions::default()
        })
        .unwrap();
        (out, report)
    })
}
