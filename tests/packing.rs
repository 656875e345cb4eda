//! Packed training rows (`NetworkOptions::packed`): several documents in one row of
//! the micro-batch train exactly as each document alone in a row of its own — same
//! loss, same gradients — for GPT-2 (learned positions) and Llama (RoPE, grouped-query
//! heads), on the CPU reference and on the GPU paths; and a packed micro-batch whose
//! document starts contradict themselves is refused.

mod common;

use std::sync::Arc;

use common::*;
use kiln::cpu::CpuDevice;
use kiln::engine::graph::Attention;
use kiln::engine::models::gpt::{Gpt, GptConfig};
use kiln::engine::models::llama::{Llama, LlamaConfig};
use kiln::engine::models::mlp::Mlp;
use kiln::engine::models::{MicroBatch, Model, Network, NetworkOptions};
use kiln::engine::{DType, Device, HostData, IGNORE_TARGET};

const T: usize = 16;

/// Two rows of T: the first packs documents of 5, 1 and 10 tokens, the second one of 16.
const DOCS: [&[usize]; 2] = [&[5, 1, 10], &[16]];

fn gpt() -> Arc<dyn Model> {
    let cfg = GptConfig {
        n_layer: 2,
        n_head: 2,
        n_embd: 8,
        block_size: T,
        vocab_size: 11,
        padded_vocab_size: None,
    };
    Arc::new(Gpt::new(cfg, T).with_attention(Attention::Fused))
}

fn llama() -> Arc<dyn Model> {
    let cfg: LlamaConfig = serde_json::from_str(
        r#"{"n_layer": 2, "n_head": 4, "n_kv_head": 2, "n_embd": 16, "block_size": 16,
            "vocab_size": 11, "intermediate_size": 24}"#,
    )
    .unwrap();
    Arc::new(Llama::new(cfg, T).with_attention(Attention::Fused))
}

fn network(dev: &dyn Device, model: Arc<dyn Model>, batch: usize, packed: bool) -> Network {
    let options = NetworkOptions {
        batch,
        dtype: DType::F32,
        optimizer: adamw(),
        seed: 5,
        packed,
    };
    Network::new(dev, model, &options).unwrap()
}

/// Each document's tokens: the next-token targets inside it, none past its end (the
/// next document's first token is not its to predict).
fn documents() -> Vec<Vec<u32>> {
    let mut rng = Rng::new(3);
    DOCS.iter()
        .flat_map(|row| row.iter())
        .map(|&n| (0..n).map(|_| rng.next_u32() % 11).collect())
        .collect()
}

fn targets_of(doc: &[u32]) -> impl Iterator<Item = u32> + '_ {
    doc[1..].iter().copied().chain([IGNORE_TARGET])
}

/// The packed micro-batch of [`DOCS`].
fn packed_batch(docs: &[Vec<u32>]) -> MicroBatch {
    let (mut tokens, mut targets, mut starts) = (vec![], vec![], vec![]);
    let mut next = docs.iter();
    for row in DOCS {
        let mut first = 0;
        for _ in row.iter() {
            let doc = next.next().unwrap();
            tokens.extend(doc);
            targets.extend(targets_of(doc));
            starts.extend(std::iter::repeat_n(first as u32, doc.len()));
            first += doc.len();
        }
    }
    MicroBatch::packed(&tokens, &targets, &starts, T)
}

/// A document alone at the start of a row, the rest padding that nothing reads (causal
/// attention: earlier tokens never see later ones) and no target counts.
fn alone(doc: &[u32]) -> MicroBatch {
    let pad = T - doc.len();
    let tokens: Vec<u32> = doc
        .iter()
        .copied()
        .chain(std::iter::repeat_n(0, pad))
        .collect();
    let targets: Vec<u32> = targets_of(doc)
        .chain(std::iter::repeat_n(IGNORE_TARGET, pad))
        .collect();
    MicroBatch::tokens(&tokens, &targets)
}

/// The packed network's loss and gradients against the reference from documents
/// alone: the loss is the mean over every trained target of the batch, so it is the
/// sum over documents of (a document's mean x its targets) / all targets, and each
/// gradient the same sum of the documents' gradients. fp32; the sums run in another
/// order (one row against several), so 1e-5 relative to each tensor's largest value.
fn check(name: &str, dev: &dyn Device, model: Arc<dyn Model>) {
    let docs = documents();
    let mut packed = network(dev, model.clone(), DOCS.len(), true);
    let loss = packed
        .loss_and_gradients(dev, &packed_batch(&docs))
        .unwrap();
    let grads = packed.gradient_values(dev).unwrap();

    let mut single = network(dev, model, 1, false);
    let total: usize = docs.iter().map(|d| d.len() - 1).sum();
    let mut want_loss = 0.0;
    let mut want_grads: Vec<Vec<f64>> = grads.iter().map(|g| vec![0.0; g.len()]).collect();
    for doc in &docs {
        let weight = (doc.len() - 1) as f64 / total as f64;
        let l = single.loss_and_gradients(dev, &alone(doc)).unwrap();
        want_loss += l * weight;
        for (w, g) in want_grads
            .iter_mut()
            .zip(single.gradient_values(dev).unwrap())
        {
            for (w, g) in w.iter_mut().zip(g) {
                *w += g as f64 * weight;
            }
        }
    }
    let e = (loss - want_loss).abs() / want_loss.abs();
    assert!(
        e < 1e-5,
        "{name}: packed loss {loss} against {want_loss} alone"
    );
    let mut worst = 0f64;
    for (i, (got, want)) in grads.iter().zip(&want_grads).enumerate() {
        let scale = want.iter().fold(1e-6f64, |a, &x| a.max(x.abs()));
        for (g, w) in got.iter().zip(want) {
            let e = (*g as f64 - w).abs() / scale;
            worst = worst.max(e);
            assert!(
                e < 1e-5,
                "{name}: gradient {i}: {g} packed against {w} alone"
            );
        }
    }
    eprintln!("{name}: loss {loss:.6} (rel. error {e:.1e}), gradients within {worst:.1e}");

    // A batch without documents on a packed network is one document per row (how
    // held-out examples are scored).
    let doc = &docs[2];
    let mut one = network(dev, packed.model().clone(), 1, true);
    let l1 = one.loss_and_gradients(dev, &alone(doc)).unwrap();
    let l2 = single.loss_and_gradients(dev, &alone(doc)).unwrap();
    assert!(
        (l1 - l2).abs() <= 1e-6 * l2.abs(),
        "{name}: {l1} against {l2}"
    );

    // Without its documents the same rows let documents see each other (and count
    // positions from the row's start): the gradients move by far more than the
    // tolerance, so the match above is the boundary at work.
    let mut plain = network(dev, packed.model().clone(), DOCS.len(), false);
    let MicroBatch(inputs) = packed_batch(&docs);
    plain
        .loss_and_gradients(dev, &MicroBatch(inputs[..2].to_vec()))
        .unwrap();
    let mut apart = 0f64;
    for (got, want) in plain.gradient_values(dev).unwrap().iter().zip(&want_grads) {
        let scale = want.iter().fold(1e-6f64, |a, &x| a.max(x.abs()));
        for (g, w) in got.iter().zip(want) {
            apart = apart.max((*g as f64 - w).abs() / scale);
        }
    }
    assert!(
        apart > 1e-2,
        "{name}: without documents the gradients should differ (by {apart:.1e})"
    );
}

#[test]
fn packed_rows_train_as_each_document_alone_on_the_cpu() {
    let cpu = CpuDevice::new();
    check("cpu gpt", &cpu, gpt());
    check("cpu llama", &cpu, llama());
}

#[test]
fn packed_rows_train_as_each_document_alone_on_the_gpus() {
    for i in [0, 3] {
        let path = gpu_path(i);
        check(&format!("{} gpt", path.name), path.dev.as_ref(), gpt());
        check(&format!("{} llama", path.name), path.dev.as_ref(), llama());
    }
}

/// Starts the kernels could not trust are refused before anything runs, by row and
/// token; a model that cannot keep documents apart cannot be built packed.
#[test]
fn contradictory_documents_are_refused() {
    let cpu = CpuDevice::new();
    let mut net = network(&cpu, gpt(), DOCS.len(), true);
    let MicroBatch(good) = packed_batch(&documents());
    let mut bad = |k: usize, at: usize, value: u32| {
        let mut inputs = good.clone();
        let HostData::U32(v) = &mut inputs[k] else {
            unreachable!()
        };
        v[at] = value;
        net.loss_and_gradients(&cpu, &MicroBatch(inputs))
            .unwrap_err()
            .to_string()
    };
    // Token 7 of row 0 (in the 10-token document from 6) said to start at 9, after it.
    let e = bad(2, 7, 9);
    assert!(e.contains("row 0, token 7"), "{e}");
    // Token 3 of row 1 starting a document of its own while its position says 3.
    let e = bad(2, T + 3, 3);
    assert!(e.contains("row 1, token 3"), "{e}");
    // A position that is not the distance from the start.
    let e = bad(3, 2, 0);
    assert!(e.contains("row 0, token 2"), "{e}");

    let mlp = Arc::new(Mlp {
        inputs: 4,
        hidden: 8,
        classes: 3,
    });
    let options = NetworkOptions {
        batch: 2,
        dtype: DType::F32,
        optimizer: adamw(),
        seed: 5,
        packed: true,
    };
    let err = Network::new(&cpu, mlp, &options).err().unwrap().to_string();
    assert!(err.contains("has no attention"), "{err}");
}

/// Pipeline stages train packed rows as one device does: the document starts and
/// positions reach every stage's attention, whichever blocks it holds. GPT (learned
/// positions, read by the first stage only) and Llama (rotary, read in every block) on
/// 2 CPU stages, 2 micro-batches of the packed rows per step, fp32: the losses of 3
/// steps equal one device's within 1e-6 relative (the stages sum nothing in another
/// order; what differs is where the gradient norm's per-stage parts are added).
#[test]
fn pipeline_stages_train_packed_rows_as_one_device() {
    use kiln::engine::parallel::pipeline_partition::PartitionMethod;
    use kiln::engine::train::pipeline_trainer::PipelineTrainer;
    use kiln::engine::train::trainer::Trainer;
    let config = || {
        let mut c = kiln::engine::config::parse(
            r#"{"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2,
                "optimizer": {"type": "AdamW", "params": {"lr": 0.01}}}"#,
            1,
        )
        .unwrap();
        c.packed_rows = true;
        c
    };
    let batch = packed_batch(&documents());
    for (name, model) in [("gpt", gpt as fn() -> _), ("llama", llama)] {
        let cpu = CpuDevice::new();
        let mut one = Trainer::new(&cpu, model(), config(), 5).unwrap();
        let devs: Vec<Box<dyn Device>> = (0..2)
            .map(|_| Box::new(CpuDevice::new()) as Box<dyn Device>)
            .collect();
        let mut pipe =
            PipelineTrainer::new(devs, model(), config(), 5, &PartitionMethod::Uniform, 2).unwrap();
        for step in 0..3 {
            let micro = [batch.clone(), batch.clone()];
            let a = one.step(&cpu, &micro).unwrap().loss;
            let b = pipe.step(&micro).unwrap().loss;
            assert!(
                (a - b).abs() <= 1e-6 * a.abs(),
                "{name} step {step}: pipeline {b} vs one device {a}"
            );
        }
        // Contradictory document starts are refused by the stages too.
        let MicroBatch(mut inputs) = batch.clone();
        let HostData::U32(starts) = &mut inputs[2] else {
            unreachable!()
        };
        starts[7] = 9;
        let bad = MicroBatch(inputs);
        let e = pipe.step(&[bad.clone(), bad]).unwrap_err().to_string();
        assert!(e.contains("row 0, token 7"), "{name}: {e}");
    }
}

/// `kiln train` on an example file packs by default (the log says how, with the
/// padding share) and pads with `--no-packing`; both train and evaluate the held-out
/// examples, and so do pipeline stages.
#[test]
fn kiln_train_packs_an_example_file_unless_told_not_to() {
    let dir = scratch_dir("packing", "train");
    let p = |name: &str| dir.join(name).to_str().unwrap().to_string();
    // 120 sums of 5 to 9 bytes: 3 or 4 fit a row of T + 1 = 25 when packed.
    let jsonl: String = (0..120u32)
        .map(|i| {
            let (a, b) = ((i * 37) % 100, (i * 53 + 11) % 100);
            let row = serde_json::json!({"prompt": format!("{a}+{b}="), "completion": format!("{}", a + b)});
            format!("{row}\n")
        })
        .collect();
    std::fs::write(dir.join("rows.jsonl"), jsonl).unwrap();
    let kiln = |args: &[&str]| {
        let o = std::process::Command::new(env!("CARGO_BIN_EXE_kiln"))
            .args(args)
            .output()
            .unwrap();
        (
            o.status.success(),
            String::from_utf8_lossy(&o.stderr).to_string(),
        )
    };
    let (ok, err) = kiln(&[
        "prepare",
        &p("rows.jsonl"),
        &p("ex.bin"),
        "--tokenizer",
        "bytes",
    ]);
    assert!(ok, "{err}");
    std::fs::write(
        dir.join("model.json"),
        r#"{"n_layer": 1, "n_head": 2, "n_embd": 16, "block_size": 24, "vocab_size": 256}"#,
    )
    .unwrap();
    std::fs::write(
        dir.join("ds.json"),
        r#"{"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW", "params": {"lr": 0.01}}}"#,
    )
    .unwrap();
    let (cfg, model) = (p("ds.json"), p("model.json"));
    let train_on = |data: &str, out: &str, extra: &[&str]| {
        let mut args = vec![
            "train",
            "--config",
            &cfg,
            "--model",
            &model,
            "--data",
            &data,
            "--devices",
            "cpu",
            "--steps",
            "2",
            "--eval-every",
            "2",
        ];
        let out = p(out);
        args.extend(["--out", &out]);
        args.extend(extra);
        kiln(&args)
    };
    let data = p("ex.bin");
    let train = |out: &str, extra: &[&str]| train_on(&data, out, extra);
    let (ok, err) = train("packed", &[]);
    assert!(ok, "{err}");
    assert!(
        err.contains("packed into") && err.contains("% padding"),
        "{err}"
    );
    let summary = |run: &str, key: &str| -> f64 {
        let s = std::fs::read_to_string(dir.join(run).join("summary.json")).unwrap();
        let v: serde_json::Value = serde_json::from_str(&s).unwrap();
        v[key].as_f64().unwrap()
    };
    let eval_loss = |run: &str| summary(run, "final_eval_loss");
    assert!(eval_loss("packed").is_finite());
    let (ok, err) = train("padded", &["--no-packing"]);
    assert!(ok, "{err}");
    assert!(err.contains("one per row"), "{err}");
    assert!(eval_loss("padded").is_finite());
    // A second `--devices cpu` adds a device: two, for two stages (of a 2-layer model),
    // packed too.
    std::fs::write(
        dir.join("model2.json"),
        r#"{"n_layer": 2, "n_head": 2, "n_embd": 16, "block_size": 24, "vocab_size": 256}"#,
    )
    .unwrap();
    let (model2, pipe) = (p("model2.json"), p("pipe"));
    let (ok, err) = kiln(&[
        "train",
        "--config",
        &cfg,
        "--model",
        &model2,
        "--data",
        &data,
        "--devices",
        "cpu,cpu",
        "--steps",
        "2",
        "--eval-every",
        "2",
        "--out",
        &pipe,
        "--pipeline-stages",
        "2",
    ]);
    assert!(ok, "{err}");
    assert!(err.contains("packed into"), "{err}");
    assert!(eval_loss("pipe").is_finite());

    // The dataset itself as --data: prepared into the run directory with the tokenizer
    // given, then trained as the file `kiln prepare` made (the same loss to the bit).
    let rows = p("rows.jsonl");
    let (ok, err) = train_on(&rows, "direct", &["--tokenizer", "bytes"]);
    assert!(ok, "{err}");
    assert!(dir.join("direct/data/examples.bin").is_file());
    for key in ["final_loss", "final_eval_loss"] {
        assert_eq!(summary("direct", key), summary("packed", key), "{key}");
    }
    // A resume takes the examples prepared when the run started.
    let direct = p("direct");
    let (ok, err) = kiln(&[
        "train",
        "--config",
        &cfg,
        "--model",
        &model,
        "--data",
        &rows,
        "--devices",
        "cpu",
        "--steps",
        "3",
        "--out",
        &direct,
        "--resume",
    ]);
    assert!(ok, "{err}");
    assert!(err.contains("prepared from"), "{err}");
    // Without a tokenizer: refused, naming the flag, leaving no run directory.
    let (ok, err) = train_on(&rows, "untokenized", &[]);
    assert!(!ok);
    assert!(err.contains("--tokenizer"), "{err}");
    assert!(!dir.join("untokenized").exists());
    // A run that fails to start after preparing keeps the examples, saying where.
    let (ok, err) = train_on(
        &rows,
        "no-device",
        &["--tokenizer", "bytes", "--devices", "vk:9"],
    );
    assert!(!ok);
    assert!(dir.join("no-device/data/examples.bin").is_file(), "{err}");
    assert!(!dir.join("no-device/config.json").exists(), "{err}");
    assert!(
        err.contains("are kept in") && err.contains("--data"),
        "{err}"
    );
    // The same --out then trains on them.
    let kept = p("no-device/data/examples.bin");
    let (ok, err) = train_on(&kept, "no-device", &[]);
    assert!(ok, "{err}");
    assert_eq!(
        summary("no-device", "final_loss"),
        summary("packed", "final_loss")
    );
}
