//! `kiln eval`: the loss `kiln train` reported for held-out data, from the checkpoint.

mod demo_run;
use demo_run::{kiln, stderr};

use kiln::eval::{eval, EvalOptions};

#[test]
fn kiln_eval_gives_the_held_out_loss_and_exact_match_the_trainer_reported() {
    let (run, report) = demo_run::run("eval");
    let want_loss = report.summary.final_eval_loss.unwrap();
    let want_acc = report.summary.final_eval_accuracy.unwrap();
    let r = eval(&EvalOptions {
        source: run.clone(),
        devices: vec!["cpu".into()],
        ..EvalOptions::default()
    })
    .unwrap();
    // The same rows, micro-batches, weights and device: the same bits.
    assert_eq!(
        r.loss.to_bits(),
        want_loss.to_bits(),
        "{} vs {want_loss}",
        r.loss
    );
    assert_eq!(r.accuracy, Some(want_acc));
    assert_eq!((r.rows, r.seq, r.step), (256, demo_run::T, Some(6)));
    assert!((r.perplexity - (want_loss as f64).exp()).abs() < 1e-9);

    // The command's JSON says the same.
    let o = kiln(&["eval", run.to_str().unwrap(), "--devices", "cpu", "--json"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let j: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(j["loss"].as_f64().unwrap() as f32, want_loss);
    assert_eq!(j["accuracy"].as_f64().unwrap() as f32, want_acc);
    assert_eq!(j["step"], 6);
}

#[test]
fn kiln_eval_scores_a_whole_token_file_and_refuses_ids_outside_the_vocabulary() {
    let (run, _) = demo_run::run("eval");
    let dir = run.parent().unwrap();
    // 30 addition lines: 300 tokens, 30 rows of T + 1 = 10.
    let add = kiln::engine::data::Addition::new(2, 5).unwrap();
    let bin = dir.join("lines.bin");
    kiln::engine::data::write_token_file(&bin, &add.train_tokens(30), "addition", 13).unwrap();
    let r = eval(&EvalOptions {
        source: run.clone(),
        data: Some(bin.clone()),
        devices: vec!["cpu".into()],
        ..EvalOptions::default()
    })
    .unwrap();
    assert_eq!((r.rows, r.tokens), (30, 30 * demo_run::T));
    assert!(r.loss.is_finite() && r.loss > 0.0, "{}", r.loss);
    assert_eq!(r.accuracy, None);

    // A text file is bytes, ids far beyond the demo's 13.
    let text = dir.join("words.txt");
    std::fs::write(&text, "hello world, this is not arithmetic at all").unwrap();
    let o = kiln(&[
        "eval",
        run.to_str().unwrap(),
        "--devices",
        "cpu",
        "--data",
        text.to_str().unwrap(),
    ]);
    assert_eq!(o.status.code(), Some(1));
    assert!(stderr(&o).contains("vocabulary"), "{}", stderr(&o));

    let o = kiln(&["eval", dir.join("no-such-run").to_str().unwrap()]);
    assert_eq!(o.status.code(), Some(1));
    assert!(
        stderr(&o).contains("no-such-run: does not exist"),
        "{}",
        stderr(&o)
    );
}

#[test]
fn a_run_without_a_checkpoint_is_refused_with_what_to_do() {
    let (run, _) = demo_run::run("eval");
    let bare = run.parent().unwrap().join("bare-run");
    std::fs::create_dir_all(&bare).unwrap();
    std::fs::copy(
        run.join(kiln::engine::train::runs::CONFIG_FILE),
        bare.join(kiln::engine::train::runs::CONFIG_FILE),
    )
    .unwrap();
    for cmd in [&["eval"][..], &["sample", "--prompt", "1+1="][..]] {
        let mut args = vec![cmd[0], bare.to_str().unwrap()];
        args.extend_from_slice(&cmd[1..]);
        let o = kiln(&args);
        assert_eq!(o.status.code(), Some(1), "{args:?}");
        let e = stderr(&o);
        assert!(
            e.contains("the run saved no checkpoint") && e.contains("kiln train --resume --out"),
            "{args:?}: {e}"
        );
    }
}

/// A run on a data file: its held-out tail, found again from the path the run recorded.
#[test]
fn kiln_eval_scores_a_text_runs_held_out_tail_as_the_trainer_did() {
    let (run, report) = demo_run::text_run("eval");
    let want = report.summary.final_eval_loss.unwrap();
    let r = eval(&EvalOptions {
        source: run.clone(),
        devices: vec!["cpu".into()],
        ..EvalOptions::default()
    })
    .unwrap();
    assert_eq!(r.loss.to_bits(), want.to_bits(), "{} vs {want}", r.loss);
    assert_eq!(r.accuracy, None);
    assert!(r.data.ends_with("text.txt: held-out tail"), "{}", r.data);
}

/// A prompt/completion dataset prepared as an example file (bytes tokenizer: a token per
/// byte) trains one example per row with the loss on the completions alone. Checked
/// against a reference built here from the rows themselves, apart from `kiln prepare`
/// and the data pipeline: each held-out example's bytes, padded, its prompt's and the
/// padding's targets ignored, scored by a batch-1 fp32 network holding the checkpoint;
/// the mean over the completions' bytes is what the trainer reported and `kiln eval`
/// gives (fp32, summed in other orders and batches: 1e-5 relative), and the tokens
/// scored are those bytes.
#[test]
fn an_example_file_trains_and_scores_its_completions_only() {
    use kiln::engine::models::{gpt, MicroBatch, Network, NetworkOptions};
    use kiln::engine::train::checkpoint::{self, MODEL_FILE};
    use kiln::engine::{DType, Optimizer, IGNORE_TARGET};
    let dir = std::env::temp_dir().join(format!("kiln-eval-examples-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let p = |name: &str| dir.join(name).to_str().unwrap().to_string();
    // 200 sums; T + 1 = 13 holds the longest ("99+99=198"), so nothing is cut.
    let rows: Vec<(String, String)> = (0..200u32)
        .map(|i| {
            let (a, b) = ((i * 37) % 100, (i * 53 + 11) % 100);
            (format!("{a}+{b}="), format!("{}", a + b))
        })
        .collect();
    let jsonl: String = rows
        .iter()
        .map(|(q, a)| format!("{}\n", serde_json::json!({"prompt": q, "completion": a})))
        .collect();
    std::fs::write(dir.join("rows.jsonl"), jsonl).unwrap();
    let o = kiln(&[
        "prepare",
        &p("rows.jsonl"),
        &p("ex.bin"),
        "--tokenizer",
        "bytes",
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let (t, cfg) = (
        12,
        r#"{"n_layer": 1, "n_head": 2, "n_embd": 16, "block_size": 12, "vocab_size": 256}"#,
    );
    std::fs::write(dir.join("model.json"), cfg).unwrap();
    std::fs::write(
        dir.join("ds.json"),
        r#"{"train_micro_batch_size_per_gpu": 4, "optimizer": {"type": "AdamW", "params": {"lr": 0.01}}}"#,
    )
    .unwrap();
    let o = kiln(&[
        "train",
        "--config",
        &p("ds.json"),
        "--model",
        &p("model.json"),
        "--data",
        &p("ex.bin"),
        "--devices",
        "cpu",
        "--steps",
        "3",
        "--eval-every",
        "3",
        "--out",
        &p("run"),
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(
        stderr(&o).contains("200 examples of prompt/completion"),
        "{}",
        stderr(&o)
    );
    let summary: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("run/summary.json")).unwrap())
            .unwrap();
    let reported = summary["final_eval_loss"].as_f64().unwrap() as f32;

    // The reference: the last 5 % of the examples (13 · 200 · 0.05 / 13 = 10) are held out.
    let dev = kiln::cpu::CpuDevice::new();
    let model: std::sync::Arc<dyn kiln::engine::models::Model> =
        std::sync::Arc::new(gpt::Gpt::new(serde_json::from_str(cfg).unwrap(), t));
    let options = NetworkOptions {
        batch: 1,
        dtype: DType::F32,
        optimizer: Optimizer::adamw(0.0, 0.0),
        seed: 0,
        packed: false,
    };
    let net = Network::new(&dev, model, &options).unwrap();
    let ck = checkpoint::load_latest(&dir.join("run")).unwrap();
    let names: Vec<String> = net.specs().map(|s| s.name.clone()).collect();
    for (i, name) in names.iter().enumerate() {
        net.set_value(&dev, i, &ck.tensor(MODEL_FILE, name).unwrap().data)
            .unwrap();
    }
    let (mut sum, mut scored) = (0.0f64, 0usize);
    for (q, a) in &rows[190..] {
        let bytes: Vec<u32> = format!("{q}{a}").bytes().map(u32::from).collect();
        let mut row = bytes.clone();
        row.resize(t + 1, 0);
        let targets: Vec<u32> = (1..=t)
            .map(|k| {
                if k >= q.len() && k < bytes.len() {
                    row[k]
                } else {
                    IGNORE_TARGET
                }
            })
            .collect();
        let loss = net
            .loss(&dev, &MicroBatch::tokens(&row[..t], &targets))
            .unwrap();
        sum += loss * a.len() as f64;
        scored += a.len();
    }
    let want = (sum / scored as f64) as f32;
    let close = |x: f32| (x - want).abs() <= 1e-5 * want.abs();
    assert!(close(reported), "trainer {reported}, reference {want}");
    let r = eval(&EvalOptions {
        source: dir.join("run"),
        devices: vec!["cpu".into()],
        ..EvalOptions::default()
    })
    .unwrap();
    assert!(close(r.loss), "kiln eval {}, reference {want}", r.loss);
    assert_eq!((r.rows, r.tokens), (10, scored));
    // The whole file: every completion byte.
    let r = eval(&EvalOptions {
        source: dir.join("run"),
        data: Some(dir.join("ex.bin")),
        devices: vec!["cpu".into()],
        ..EvalOptions::default()
    })
    .unwrap();
    let all: usize = rows.iter().map(|(_, a)| a.len()).sum();
    assert_eq!((r.rows, r.tokens), (200, all));
    let _ = std::fs::remove_dir_all(&dir);
}
