//! The run ledger: metrics appended and truncated on resume, summaries, charts for
//! any number of records, and listing and diffing run directories.

mod common;

use std::path::Path;
use std::time::{Duration, SystemTime};

use kiln_engine::train::runs::{
    diff_runs, format_utc, list_runs, read_metrics, write_config, ChangeKind, MetricsWriter,
    RunError, RunsTable, StepRecord, Summary, METRICS_FILE,
};
#[cfg(feature = "chart")]
use kiln_engine::train::runs_chart::{render_chart, write_chart};
use serde_json::json;

fn record(step: u64, loss: f32) -> StepRecord {
    StepRecord {
        step,
        loss,
        lr: 1e-3,
        loss_scale: 65536.0,
        skipped: false,
        tokens_per_s: 1000.0 + step as f64,
        step_ms: 20.0,
        input_stall_ms: 0.5,
        device_memory_bytes: 1 << 20,
        host_peak_bytes: None,
        comm_ms: 0.0,
        comm_overlap: 0.0,
        comm_bytes: 0,
        offload_ms: None,
        offload_exposed_ms: None,
        gather_ms: None,
        gather_hidden: None,
        pipeline_bubble: None,
        pipeline_bubble_theory: None,
        pipeline_bytes: None,
        pipeline_exposed_ms: None,
        eval_loss: None,
        eval_accuracy: None,
        started: false,
    }
}

fn steps(records: &[StepRecord]) -> Vec<u64> {
    records.iter().map(|r| r.step).collect()
}

#[test]
fn metrics_append_and_resume_drops_later_steps() {
    let run = common::scratch("runs-metrics");
    let mut w = MetricsWriter::create(&run).unwrap();
    let first: Vec<StepRecord> = (1..=10).map(|s| record(s, 5.0 - s as f32 * 0.1)).collect();
    for r in &first {
        w.append(r).unwrap();
    }
    // The writer marks the first step of its process (throughput leaves it out).
    let mut first = first;
    first[0].started = true;
    // Every line is in the file while the writer is still open: a crash loses nothing.
    assert_eq!(read_metrics(&run).unwrap(), first);
    drop(w);

    // Interrupted after step 10, resumed from the checkpoint at step 6.
    let mut w = MetricsWriter::resume(&run, 6).unwrap();
    assert_eq!(w.dropped(), 4);
    assert_eq!(read_metrics(&run).unwrap(), first[..6]);
    let redone: Vec<StepRecord> = (7..=8).map(|s| record(s, 9.0 + s as f32)).collect();
    for r in &redone {
        w.append(r).unwrap();
    }
    w.sync().unwrap();
    let all = read_metrics(&run).unwrap();
    assert_eq!(steps(&all), (1..=8).collect::<Vec<_>>());
    let mut redone = redone;
    redone[0].started = true;
    assert_eq!(all[6..], redone[..]);

    // A crash in the middle of writing a line: the cut line is ignored on reading and
    // removed on resume; nothing is dropped.
    drop(w);
    let path = run.join(METRICS_FILE);
    let mut text = std::fs::read_to_string(&path).unwrap();
    text.push_str("{\"step\":9,\"loss\":3.");
    std::fs::write(&path, &text).unwrap();
    assert_eq!(
        steps(&read_metrics(&run).unwrap()),
        (1..=8).collect::<Vec<_>>()
    );
    let mut w = MetricsWriter::resume(&run, 8).unwrap();
    assert_eq!(w.dropped(), 0);
    assert!(std::fs::read_to_string(&path).unwrap().ends_with("}\n"));
    // A skipped step with an overflowed loss: written as null, read back as NaN.
    let mut overflow = record(9, f32::NAN);
    overflow.skipped = true;
    overflow.eval_accuracy = Some(0.75);
    w.append(&overflow).unwrap();
    let all = read_metrics(&run).unwrap();
    assert_eq!(steps(&all), (1..=9).collect::<Vec<_>>());
    assert!(all[8].loss.is_nan() && all[8].skipped);
    assert_eq!(all[8].eval_accuracy, Some(0.75));

    // Resuming a run that never wrote metrics starts an empty file.
    let fresh = common::scratch("runs-metrics-fresh");
    let w = MetricsWriter::resume(&fresh, 100).unwrap();
    assert_eq!(w.dropped(), 0);
    assert!(read_metrics(&fresh).unwrap().is_empty());

    // A damaged line in the middle is an error naming the file and line.
    drop(w);
    let mut lines: Vec<String> = std::fs::read_to_string(&path)
        .unwrap()
        .lines()
        .map(String::from)
        .collect();
    lines[2] = "{not json".to_string();
    std::fs::write(&path, lines.join("\n") + "\n").unwrap();
    let e = read_metrics(&run).unwrap_err();
    assert!(matches!(e, RunError::BadJson { line: Some(3), .. }), "{e}");
    assert!(e.to_string().contains(METRICS_FILE) && e.to_string().contains("line 3"));
    assert!(MetricsWriter::resume(&run, 5).is_err());
}

#[test]
fn summary_of_records() {
    let mut records: Vec<StepRecord> = (1..=10).map(|s| record(s, 4.0 - s as f32 * 0.1)).collect();
    // Warm-up steps are slow and must not count toward throughput.
    records[0].tokens_per_s = 1.0;
    records[1].tokens_per_s = 1.0;
    // Later steps: half at 1000 tokens/s for 10 ms, half at 3000 for 30 ms.
    for (i, r) in records.iter_mut().enumerate().skip(2) {
        (r.tokens_per_s, r.step_ms) = if i % 2 == 0 {
            (1000.0, 10.0)
        } else {
            (3000.0, 30.0)
        };
    }
    records[4].skipped = true;
    records[4].loss = f32::INFINITY;
    records[9].loss = f32::NAN;
    records[6].eval_loss = Some(3.5);
    records[6].eval_accuracy = Some(0.4);
    records[8].eval_loss = Some(3.6);
    records[8].eval_accuracy = Some(0.5);
    records[3].device_memory_bytes = 7 << 20;
    // The host's peak where reported (a record without it, as off Linux, is skipped).
    records[2].host_peak_bytes = Some(9 << 20);
    records[5].host_peak_bytes = Some(8 << 20);
    let s = Summary::from_records(&records, 2);
    assert_eq!(s.peak_host_bytes, Some(9 << 20));
    assert_eq!(s.steps, 10);
    assert_eq!(s.last_step, Some(10));
    assert_eq!(s.skipped_steps, 1);
    // Step 10's loss is NaN: the final loss says so, and names the last finite one.
    assert!(s.final_loss.unwrap().is_nan());
    assert_eq!(
        s.non_finite,
        ["the final loss (step 10) is NaN; the last finite loss was 3.1000 at step 9"]
    );
    assert_eq!(s.best_loss, Some(4.0 - 9.0 * 0.1));
    assert_eq!(s.best_loss_step, Some(9));
    assert_eq!(s.final_eval_loss, Some(3.6));
    assert_eq!(s.best_eval_loss, Some(3.5));
    assert_eq!(s.final_eval_accuracy, Some(0.5));
    assert_eq!(s.best_eval_accuracy, Some(0.5));
    assert_eq!(s.warmup_steps_excluded, 2);
    // 4 steps of 10 tokens + 4 steps of 90 tokens over 160 ms = 2500 tokens/s.
    let tps = s.mean_tokens_per_s.unwrap();
    assert!((tps - 2500.0).abs() < 1e-9, "{tps}");
    assert_eq!(s.mean_step_ms, Some(20.0));
    assert!((s.total_time_s - 0.2).abs() < 1e-12, "{}", s.total_time_s);
    assert_eq!(s.peak_device_memory_bytes, 7 << 20);

    let run = common::scratch("runs-summary");
    let mut s = s;
    s.devices = vec!["llvmpipe (vulkan)".to_string()];
    s.total_time_s = 1.5;
    s.write(&run).unwrap();
    // NaN != NaN: compared through Debug, where it reads "NaN".
    assert_eq!(
        format!("{:?}", Summary::read(&run).unwrap()),
        format!("{s:?}")
    );

    // No records, or too few to leave warm-up out.
    let empty = Summary::from_records(&[], 5);
    assert_eq!(empty.steps, 0);
    assert_eq!(empty.final_loss, None);
    assert_eq!(empty.mean_tokens_per_s, None);
    assert_eq!(empty.peak_host_bytes, None);
    let short = Summary::from_records(&records[..2], 5);
    assert_eq!(short.warmup_steps_excluded, 0);
    assert_eq!(short.mean_tokens_per_s, Some(1.0));
}

#[test]
fn summary_reports_a_nan_eval_loss_as_it_was() {
    let run = common::scratch("runs-nan-eval");
    let mut w = MetricsWriter::create(&run).unwrap();
    let mut records: Vec<StepRecord> = (1..=10).map(|s| record(s, 3.0)).collect();
    records[3].eval_loss = Some(2.5);
    records[3].eval_accuracy = Some(0.25);
    records[6].eval_loss = Some(f32::NAN);
    records[6].eval_accuracy = Some(0.5);
    for r in &records {
        w.append(r).unwrap();
    }
    drop(w);
    // Through metrics.jsonl, as `kiln train` summarizes: the NaN is written as null and
    // must not read back as "no evaluation at this step".
    let back = read_metrics(&run).unwrap();
    assert!(back[6].eval_loss.unwrap().is_nan(), "{:?}", back[6]);
    assert_eq!(back[5].eval_loss, None);
    let s = Summary::from_records(&back, 2);
    assert!(s.final_eval_loss.unwrap().is_nan());
    assert_eq!(s.best_eval_loss, Some(2.5));
    assert_eq!(s.final_eval_accuracy, Some(0.5));
    assert_eq!(
        s.non_finite,
        ["the final eval loss (step 7) is NaN; the last finite eval loss was 2.5000 at step 4"]
    );
    s.write(&run).unwrap();
    let text = std::fs::read_to_string(run.join("summary.json")).unwrap();
    assert!(text.contains(r#""final_eval_loss": "NaN""#), "{text}");
    let read = Summary::read(&run).unwrap();
    assert!(read.final_eval_loss.unwrap().is_nan());
    assert_eq!(read.non_finite, s.non_finite);

    // An infinite loss and no finite eval at all.
    let mut inf = records.clone();
    inf[9].loss = f32::NEG_INFINITY;
    inf[3].eval_loss = None;
    let s = Summary::from_records(&inf, 2);
    assert_eq!(s.final_loss, Some(f32::NEG_INFINITY));
    assert_eq!(s.non_finite.len(), 2, "{:?}", s.non_finite);
    assert!(s.non_finite[0].contains("is -inf; the last finite loss was 3.0000 at step 9"));
    assert!(s.non_finite[1].contains("is NaN; no eval loss was finite"));
    s.write(&run).unwrap();
    assert!(std::fs::read_to_string(run.join("summary.json"))
        .unwrap()
        .contains(r#""final_loss": "-inf""#));
    assert_eq!(
        Summary::read(&run).unwrap().final_loss,
        Some(f32::NEG_INFINITY)
    );
}

/// A small well-formedness check: every tag closes in order and every `&` starts an
/// entity.
#[cfg(feature = "chart")]
fn assert_well_formed_svg(svg: &str) {
    assert!(
        svg.trim_start().starts_with("<svg"),
        "{}",
        &svg[..svg.len().min(200)]
    );
    assert!(svg.trim_end().ends_with("</svg>"));
    let mut stack: Vec<String> = Vec::new();
    let mut rest = svg;
    while let Some(i) = rest.find(['<', '&']) {
        rest = &rest[i..];
        if rest.starts_with('&') {
            assert!(
                ["&amp;", "&lt;", "&gt;", "&quot;", "&apos;", "&#"]
                    .iter()
                    .any(|e| rest.starts_with(e)),
                "bare & at {}",
                &rest[..rest.len().min(40)]
            );
            rest = &rest[1..];
            continue;
        }
        let end = rest.find('>').expect("unterminated tag");
        let tag = &rest[1..end];
        if let Some(name) = tag.strip_prefix('/') {
            assert_eq!(
                stack.pop().as_deref(),
                Some(name.trim()),
                "mismatched </{name}>"
            );
        } else if !tag.starts_with('?') && !tag.starts_with('!') && !tag.ends_with('/') {
            let name = tag.split(|c: char| c.is_whitespace()).next().unwrap();
            stack.push(name.to_string());
        }
        rest = &rest[end + 1..];
    }
    assert!(stack.is_empty(), "unclosed {stack:?}");
}

#[test]
#[cfg(feature = "chart")]
fn chart_for_zero_one_and_many_records() {
    // Zero, one (with eval), a single repeated value, many with eval and a NaN.
    let none: Vec<StepRecord> = vec![];
    let mut one = vec![record(0, 2.5)];
    one[0].eval_loss = Some(2.6);
    one[0].eval_accuracy = Some(0.1);
    let flat: Vec<StepRecord> = (0..3).map(|s| record(s, 1.0)).collect();
    let mut many: Vec<StepRecord> = (1..=200)
        .map(|s| record(s, 6.0 / (1.0 + s as f32 * 0.05)))
        .collect();
    for r in many.iter_mut().filter(|r| r.step % 50 == 0) {
        r.eval_loss = Some(r.loss + 0.1);
        r.eval_accuracy = Some(r.step as f32 / 250.0);
    }
    many[10].loss = f32::NAN;
    for (name, records) in [
        ("none", &none),
        ("one", &one),
        ("flat", &flat),
        ("many", &many),
    ] {
        let svg = render_chart(records, &format!("run <{name}> & co")).unwrap();
        assert_well_formed_svg(&svg);
        assert!(svg.contains("tokens/s"), "{name}");
        if name == "none" {
            assert!(svg.contains("no data yet"));
        }
        if name == "many" {
            assert!(svg.contains("polyline"));
            assert!(svg.contains("eval accuracy") && svg.contains("eval loss"));
        }
        if name == "one" {
            assert!(svg.contains("<circle"));
        }
    }

    // Written into a run directory, with and without metrics.
    let run = common::scratch("runs-chart");
    write_config(&run, &json!({})).unwrap();
    let path = write_chart(&run).unwrap();
    assert_eq!(path, run.join(kiln_engine::train::runs::CHART_FILE));
    assert_well_formed_svg(&std::fs::read_to_string(&path).unwrap());
    let mut w = MetricsWriter::create(&run).unwrap();
    for r in &many {
        w.append(r).unwrap();
    }
    write_chart(&run).unwrap();
    let svg = std::fs::read_to_string(&path).unwrap();
    assert_well_formed_svg(&svg);
    assert!(svg.contains("polyline"));
    let e = write_chart(&run.join("missing")).unwrap_err();
    assert!(matches!(e, RunError::NotARun { .. }), "{e}");
}

fn make_run(root: &Path, name: &str, config: serde_json::Value, losses: &[f32], tps: f64) {
    let dir = root.join(name);
    write_config(&dir, &config).unwrap();
    let mut w = MetricsWriter::create(&dir).unwrap();
    for (i, &l) in losses.iter().enumerate() {
        let mut r = record(i as u64 + 1, l);
        r.tokens_per_s = tps;
        w.append(&r).unwrap();
    }
}

fn base_config() -> serde_json::Value {
    json!({
        "model": {"n_layer": 2, "n_head": 4, "n_embd": 64, "block_size": 32, "vocab_size": 97},
        "training": {"batch": 8, "seq": 32, "precision": "f16", "lr": 0.001, "betas": [0.9, 0.95]},
        "data": "tiny.txt"
    })
}

#[test]
fn list_and_diff_runs() {
    let root = common::scratch("runs-ledger");
    let losses_a: Vec<f32> = (0..10).map(|i| 4.0 - i as f32 * 0.2).collect();
    make_run(&root, "a", base_config(), &losses_a, 1000.0);
    Summary::from_records(&read_metrics(&root.join("a")).unwrap(), 2)
        .write(&root.join("a"))
        .unwrap();
    let mut cb = base_config();
    cb["training"]["lr"] = json!(0.002);
    make_run(&root, "b", cb, &[4.0, 3.5, 3.0, 2.0], 1500.0);
    // Not runs: a stray directory and a file.
    std::fs::create_dir_all(root.join("scratch")).unwrap();
    std::fs::write(root.join("notes.txt"), "x").unwrap();
    // A checkpoint in run a.
    kiln_engine::train::checkpoint::save(&root.join("a"), 10, &[], &json!({}), &Default::default())
        .unwrap();

    let runs = list_runs(&root).unwrap();
    let mut names: Vec<&str> = runs.iter().map(|r| r.name.as_str()).collect();
    names.sort();
    assert_eq!(names, ["a", "b"]);
    let a = runs.iter().find(|r| r.name == "a").unwrap();
    assert_eq!(a.steps, Some(10));
    assert_eq!(a.final_loss, Some(losses_a[9]));
    assert_eq!(a.tokens_per_s, Some(1000.0));
    assert_eq!(a.checkpoints, 1);
    assert!(a.finished && a.note.is_none(), "{a:?}");
    assert!(
        a.config.contains("n_layer=2")
            && a.config.contains("precision=f16")
            && a.config.contains("lr=0.001"),
        "{}",
        a.config
    );
    let b = runs.iter().find(|r| r.name == "b").unwrap();
    assert_eq!(b.steps, Some(4));
    assert_eq!(b.final_loss, Some(2.0));
    assert!(!b.finished);
    let table = RunsTable(&runs).to_string();
    assert!(
        table.contains("final loss") && table.contains("b*"),
        "{table}"
    );
    assert!(table.lines().count() >= 3, "{table}");

    // One key differs.
    let d = diff_runs(&root.join("a"), &root.join("b")).unwrap();
    assert_eq!(d.changed_keys(), ["training.lr"]);
    assert!(d.is_one_variable());
    assert_eq!(d.changes[0].kind(), ChangeKind::Changed);
    assert_eq!(d.tokens_per_s_ratio(), Some(1.5));
    let r = d.final_loss_ratio().unwrap();
    assert!((r - 2.0 / losses_a[9] as f64).abs() < 1e-6, "{r}");
    let text = d.to_string();
    assert!(
        text.contains("1 key differs") && !text.contains("WARNING"),
        "{text}"
    );
    assert!(
        text.contains("training.lr") && text.contains("1.500x"),
        "{text}"
    );

    // Several keys: changed, added and removed, and the diff says so.
    let mut cc = base_config();
    cc["training"]["precision"] = json!("bf16");
    cc["training"]["betas"][1] = json!(0.99);
    cc["training"]["clip"] = json!(1.0);
    cc.as_object_mut().unwrap().remove("data");
    cc["model"]["n_layer"] = json!(2.0); // the same number
    make_run(&root, "c", cc, &[], 0.0);
    let d = diff_runs(&root.join("a"), &root.join("c")).unwrap();
    assert_eq!(
        d.changed_keys(),
        [
            "data",
            "training.betas.1",
            "training.clip",
            "training.precision"
        ]
    );
    let kinds: Vec<ChangeKind> = d.changes.iter().map(|c| c.kind()).collect();
    assert_eq!(
        kinds,
        [
            ChangeKind::Removed,
            ChangeKind::Changed,
            ChangeKind::Added,
            ChangeKind::Changed
        ]
    );
    assert!(!d.is_one_variable());
    assert_eq!(d.tokens_per_s_ratio(), None);
    let text = d.to_string();
    assert!(
        text.contains("4 keys differ") && text.contains("WARNING"),
        "{text}"
    );
    assert!(text.contains("one variable at a time"), "{text}");
    assert!(text.contains("(absent)") && text.contains("bf16"), "{text}");

    // Identical configs.
    let d = diff_runs(&root.join("a"), &root.join("a")).unwrap();
    assert!(d.changes.is_empty());
    assert!(d.to_string().contains("identical"));

    // Not runs.
    let e = diff_runs(&root.join("a"), &root.join("scratch")).unwrap_err();
    assert!(matches!(e, RunError::NotARun { .. }), "{e}");
    let msg = e.to_string();
    assert!(
        msg.contains("scratch") && msg.contains("config.json"),
        "{msg}"
    );
    let e = diff_runs(&root.join("nope"), &root.join("a")).unwrap_err();
    assert!(e.to_string().contains("does not exist"), "{e}");
    let e = list_runs(&root.join("nothing-here")).unwrap_err();
    assert!(matches!(e, RunError::NoRunsDir { .. }), "{e}");

    // A damaged metrics file is listed with a note, not a failed listing.
    std::fs::write(root.join("b").join(METRICS_FILE), "{oops\n{}\n").unwrap();
    let runs = list_runs(&root).unwrap();
    let b = runs.iter().find(|r| r.name == "b").unwrap();
    assert!(b.note.as_deref().unwrap_or("").contains("line 1"), "{b:?}");
    assert!(RunsTable(&runs).to_string().contains("b: "));
}

#[test]
fn utc_dates() {
    let at = |s: u64| format_utc(SystemTime::UNIX_EPOCH + Duration::from_secs(s));
    assert_eq!(at(0), "1970-01-01 00:00");
    assert_eq!(at(951_782_400), "2000-02-29 00:00");
    assert_eq!(at(1_700_000_000), "2023-11-14 22:13");
    assert_eq!(at(1_735_689_599), "2024-12-31 23:59");
}

/// A run being written, as a reader meets it: its live writer holds the run's lock and
/// its metrics end in the middle of a line. Listing and diffing read the complete lines
/// only (the half line is no error), and the lock refuses a second writer while it is
/// held, and nothing after it is released.
#[test]
fn a_run_being_written_reads_as_its_complete_lines_and_refuses_a_second_writer() {
    use kiln_engine::train::runs::RunLock;
    let root = common::scratch("runs-live");
    make_run(&root, "a", base_config(), &[4.0, 3.0], 1000.0);
    make_run(&root, "b", base_config(), &[4.0, 3.5, 3.2], 1000.0);
    let held = RunLock::acquire(&root.join("b")).unwrap();
    let metrics = root.join("b").join(METRICS_FILE);
    let mut text = std::fs::read_to_string(&metrics).unwrap();
    text.push_str(r#"{"step": 4, "loss": 3.0, "lr": 0.0"#);
    std::fs::write(&metrics, text).unwrap();
    assert_eq!(steps(&read_metrics(&root.join("b")).unwrap()), [1, 2, 3]);
    let b = list_runs(&root)
        .unwrap()
        .into_iter()
        .find(|r| r.name == "b")
        .unwrap();
    assert_eq!(b.steps, Some(3));
    diff_runs(&root.join("a"), &root.join("b")).unwrap();
    // A second writer is refused while the first holds the lock, from this process too
    // (an OS lock per open file).
    let e = RunLock::acquire(&root.join("b")).unwrap_err();
    assert!(matches!(e, RunError::InUse { .. }), "{e}");
    assert!(
        e.to_string()
            .contains(&format!("pid {}", std::process::id())),
        "{e}"
    );
    drop(held);
    let _again = RunLock::acquire(&root.join("b")).unwrap();
}
