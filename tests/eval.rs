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
