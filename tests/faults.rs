//! Faults and bad inputs against training: signals and closed pipes lose nothing,
//! diverged runs stop with a clear error instead of skipping forever, a tampered
//! manifest is refused, a resumed run keeps its own settings, and a run that fails to
//! start leaves nothing behind.

use std::io::{BufRead, BufReader, Read};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::AtomicBool;
use std::sync::Arc;
use std::time::{Duration, Instant};

use kiln::engine::config::parse;
use kiln::engine::models::mlp::Mlp;
use kiln::engine::models::MicroBatch;
use kiln::engine::train::checkpoint::{self, MANIFEST_FILE};
use kiln::engine::train::runs;
use kiln::engine::train::trainer::Trainer;
use kiln::engine::Error;
use kiln::train::{train, TrainOptions};

/// A fresh scratch directory per test.
fn scratch(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("kiln-faults-{name}-{}", std::process::id()));
    std::fs::remove_dir_all(&d).ok();
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// A tiny GPT (its first step compiles in seconds on lavapipe) and an fp32 config.
fn files(dir: &Path, extra: &str) -> (PathBuf, PathBuf) {
    let model = dir.join("model.json");
    std::fs::write(
        &model,
        r#"{"n_layer": 1, "n_head": 2, "n_embd": 16, "block_size": 9, "vocab_size": 13}"#,
    )
    .unwrap();
    let config = dir.join("ds.json");
    std::fs::write(
        &config,
        format!(
            r#"{{"train_micro_batch_size_per_gpu": 4, {extra}
                "optimizer": {{"type": "AdamW", "params": {{"lr": 0.003}}}},
                "scheduler": {{"type": "WarmupDecayLR",
                  "params": {{"warmup_num_steps": 2, "total_num_steps": 40}}}}}}"#
        ),
    )
    .unwrap();
    (config, model)
}

/// `kiln train` on the tiny model, with stdout and stderr piped.
fn spawn_train(dir: &Path, out: &str, args: &[&str]) -> Child {
    let (config, model) = files(dir, "");
    Command::new(env!("CARGO_BIN_EXE_kiln"))
        .args([
            "train",
            "--config",
            config.to_str().unwrap(),
            "--model",
            model.to_str().unwrap(),
            "--devices",
            "vulkan",
            "--out",
            dir.join(out).to_str().unwrap(),
        ])
        .args(args)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("run kiln")
}

/// Metrics records written so far (0 while the run directory is not there yet).
fn records(run: &Path) -> usize {
    std::fs::read_to_string(run.join(runs::METRICS_FILE))
        .map(|t| t.lines().count())
        .unwrap_or(0)
}

/// Sends `signal` to a running `kiln train` once it has done a few steps; returns its
/// exit code and stderr.
fn signal_mid_run(dir: &Path, out: &str, signal: &str) -> (Option<i32>, String) {
    let mut child = spawn_train(dir, out, &["--steps", "100000", "--checkpoint-every", "0"]);
    // Read stderr as it comes, so the pipe never fills and blocks the run.
    let mut err = child.stderr.take().unwrap();
    let reader = std::thread::spawn(move || {
        let mut s = String::new();
        err.read_to_string(&mut s).ok();
        s
    });
    let start = Instant::now();
    while records(&dir.join(out)) < 3 {
        assert!(
            start.elapsed() < Duration::from_secs(120),
            "no steps after two minutes"
        );
        if let Some(status) = child.try_wait().unwrap() {
            panic!("kiln exited early: {status}: {}", reader.join().unwrap());
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    let sent = Command::new("kill")
        .args([&format!("-{signal}"), &child.id().to_string()])
        .status()
        .unwrap();
    assert!(sent.success());
    let status = child.wait().unwrap();
    (status.code(), reader.join().unwrap())
}

#[test]
fn sigterm_and_sighup_stop_like_ctrl_c_with_a_checkpoint_summary_and_resume_command() {
    let dir = scratch("signals");
    for signal in ["TERM", "HUP"] {
        let out = format!("run-{signal}");
        let (code, err) = signal_mid_run(&dir, &out, signal);
        let run = dir.join(&out);
        assert!(
            code.is_some() && code != Some(0),
            "SIG{signal}: exit {code:?}, must be a non-zero exit, not death by the signal: {err}"
        );
        let at = checkpoint::load_latest(&run)
            .unwrap_or_else(|e| panic!("SIG{signal}: no checkpoint: {e}\n{err}"))
            .step();
        assert!(at >= 3, "SIG{signal}: checkpoint of step {at}");
        let summary = std::fs::read_to_string(run.join(runs::SUMMARY_FILE))
            .unwrap_or_else(|e| panic!("SIG{signal}: no summary: {e}\n{err}"));
        assert!(
            summary.contains(&format!("\"last_step\": {at}")),
            "{summary}"
        );
        assert!(err.contains("--resume"), "SIG{signal}: {err}");
        assert!(err.contains(run.to_str().unwrap()), "SIG{signal}: {err}");
    }
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn closed_stdout_and_stderr_neither_panic_nor_stop_training() {
    let dir = scratch("pipe");
    let mut child = spawn_train(&dir, "run", &["--steps", "25", "--eval-every", "5"]);
    // Like `kiln train 2>&1 | head -1`: one line read, then both pipes closed.
    let mut err = BufReader::new(child.stderr.take().unwrap());
    let mut first = String::new();
    err.read_line(&mut first).unwrap();
    assert!(!first.is_empty());
    drop(err);
    drop(child.stdout.take());
    let status = child.wait().unwrap();
    assert_eq!(
        status.code(),
        Some(0),
        "exit {status} (101 is a panic on the broken pipe)"
    );
    let run = dir.join("run");
    assert_eq!(checkpoint::load_latest(&run).unwrap().step(), 25);
    assert_eq!(records(&run), 25);
    assert!(run.join(runs::SUMMARY_FILE).is_file());
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn the_first_step_shows_that_it_is_compiling_kernels() {
    let dir = scratch("compile");
    let out = spawn_train(&dir, "run", &["--steps", "2"])
        .wait_with_output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{err}");
    let compiling = err
        .find("compiling kernels for the first step")
        .unwrap_or_else(|| panic!("no compile message: {err}"));
    let took = err
        .find("first step took")
        .unwrap_or_else(|| panic!("no first-step time: {err}"));
    assert!(compiling < took, "{err}");
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn steps_zero_is_an_error_before_anything_is_created() {
    let dir = scratch("steps0");
    let out = spawn_train(&dir, "run", &["--steps", "0"])
        .wait_with_output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(err.contains("--steps 0") && err.contains(">= 1"), "{err}");
    assert!(
        !dir.join("run").exists(),
        "a failed start left a run directory"
    );
    std::fs::remove_dir_all(&dir).ok();
}

/// A `--steps` whose samples overflow the 64-bit data position is refused, as the same
/// count in the config is, before anything is created.
#[test]
fn steps_beyond_the_sample_counter_are_an_error_before_anything_is_created() {
    let dir = scratch("steps-max");
    let out = spawn_train(&dir, "run", &["--steps", &u64::MAX.to_string()])
        .wait_with_output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(err.contains("64-bit count of samples"), "{err}");
    assert!(
        !dir.join("run").exists(),
        "a failed start left a run directory"
    );
    std::fs::remove_dir_all(&dir).ok();
}

/// A run directory another live process is training into is refused, naming that
/// process: two runs started at once into one `--out` used to interleave their
/// checkpoints and metrics, both passing the existing-run check (issue 34). The test
/// holds the directory's lock as a run that has just started does (no config.json yet).
/// A lock file left by a process that has ended stops nothing.
#[test]
fn a_run_directory_another_process_trains_into_is_refused_naming_it() {
    let dir = scratch("in-use");
    let run = dir.join("run");
    std::fs::create_dir_all(&run).unwrap();
    let refused = |args: &[&str]| {
        let out = spawn_train(&dir, "run", args).wait_with_output().unwrap();
        let err = String::from_utf8_lossy(&out.stderr).into_owned();
        assert_eq!(out.status.code(), Some(1), "{args:?}: {err}");
        let holder = format!(
            "another kiln process (pid {}) is training into it",
            std::process::id()
        );
        assert!(
            err.contains("is in use") && err.contains(&holder),
            "{args:?}: {err}"
        );
        assert!(err.contains("pick another --out"), "{err}");
    };
    let held = runs::RunLock::acquire(&run).unwrap();
    refused(&["--steps", "2"]);
    assert!(
        !run.join(runs::CONFIG_FILE).exists() && !run.join(checkpoint::CHECKPOINTS_DIR).exists(),
        "the refused run wrote into the directory"
    );
    drop(held);
    let trains = |args: &[&str]| {
        let out = spawn_train(&dir, "run", args).wait_with_output().unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(out.status.success(), "{args:?}: {err}");
    };
    // The lock file is still there, its holder gone: the run goes ahead.
    assert!(run.join(runs::LOCK_FILE).exists());
    trains(&["--steps", "2"]);
    // A --resume of a run that is still going is refused the same way.
    let held = runs::RunLock::acquire(&run).unwrap();
    refused(&["--steps", "3", "--resume"]);
    drop(held);
    trains(&["--steps", "3", "--resume"]);
    std::fs::remove_dir_all(&dir).ok();
}

/// Library options for the tiny model.
fn options(dir: &Path, out: &str) -> TrainOptions {
    let (config, model) = files(dir, "");
    TrainOptions {
        config: Some(config),
        model: Some(model),
        devices: vec!["vulkan".into()],
        out: Some(dir.join(out)),
        progress: false,
        ..TrainOptions::default()
    }
}

#[test]
fn a_run_directory_without_a_checkpoint_says_how_to_free_the_name() {
    let dir = scratch("blocked");
    // What a run that failed before its first checkpoint leaves: it cannot be resumed,
    // so "continue it with --resume" would send the user in a circle.
    let run = dir.join("run");
    std::fs::create_dir_all(&run).unwrap();
    std::fs::write(run.join(runs::CONFIG_FILE), "{}").unwrap();
    let e = format!(
        "{:#}",
        train(&TrainOptions {
            steps: Some(2),
            ..options(&dir, "run")
        })
        .unwrap_err()
    );
    for needle in [
        "no checkpoint",
        "cannot be resumed",
        "delete",
        "another --out",
    ] {
        assert!(e.contains(needle), "`{needle}` missing from: {e}");
    }
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn resume_restores_the_runs_own_step_count_and_intervals_unless_overridden() {
    let dir = scratch("settings");
    // Interrupted after its first step; the config alone would say 40 steps (the
    // scheduler's total), evaluation every 50 and a checkpoint every 200.
    let r = train(&TrainOptions {
        steps: Some(6),
        eval_every: Some(2),
        checkpoint_every: Some(3),
        keep_checkpoints: Some(0),
        interrupt: Some(Arc::new(AtomicBool::new(true))),
        ..options(&dir, "run")
    })
    .unwrap();
    assert!(r.interrupted);
    assert_eq!(r.steps, 1);
    let r = train(&TrainOptions {
        resume: true,
        ..options(&dir, "run")
    })
    .unwrap();
    assert_eq!(r.steps, 6, "the run asked for 6 steps");
    let evals: Vec<u64> = runs::read_metrics(&r.dir)
        .unwrap()
        .iter()
        .filter(|r| r.eval_loss.is_some())
        .map(|r| r.step)
        .collect();
    assert_eq!(
        evals,
        [1, 2, 4, 6],
        "eval every 2 (and at the interruption)"
    );
    let kept: Vec<u64> = checkpoint::list(&r.dir)
        .unwrap()
        .iter()
        .map(|c| c.0)
        .collect();
    assert_eq!(kept, [1, 3, 6], "checkpoint every 3, all kept");
    // A flag still overrides.
    let r = train(&TrainOptions {
        resume: true,
        steps: Some(8),
        ..options(&dir, "run")
    })
    .unwrap();
    assert_eq!(r.steps, 8);
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn a_manifest_whose_step_disagrees_with_its_state_is_refused() {
    let dir = scratch("manifest");
    train(&TrainOptions {
        steps: Some(2),
        ..options(&dir, "run")
    })
    .unwrap();
    let ck = checkpoint::load_latest(&dir.join("run")).unwrap().dir;
    let path = ck.join(MANIFEST_FILE);
    let mut manifest: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    manifest["step"] = 1000.into();
    std::fs::write(&path, serde_json::to_string(&manifest).unwrap()).unwrap();
    let e = format!(
        "{:#}",
        train(&TrainOptions {
            resume: true,
            ..options(&dir, "run")
        })
        .unwrap_err()
    );
    for needle in ["step 1000", "done 2 steps", "edited", "earlier checkpoint"] {
        assert!(e.contains(needle), "`{needle}` missing from: {e}");
    }
    // The data position is the step's too: 2 steps of 4 samples.
    manifest["step"] = 2.into();
    assert_eq!(manifest["state"]["next_sample"], 8);
    manifest["state"]["next_sample"] = 4000.into();
    std::fs::write(&path, serde_json::to_string(&manifest).unwrap()).unwrap();
    let e = format!(
        "{:#}",
        train(&TrainOptions {
            resume: true,
            ..options(&dir, "run")
        })
        .unwrap_err()
    );
    for needle in ["next_sample 4000", "step 2", "global batch 4", "edited"] {
        assert!(e.contains(needle), "`{needle}` missing from: {e}");
    }
    assert_eq!(records(&dir.join("run")), 2, "nothing was trained on");
    std::fs::remove_dir_all(&dir).ok();
}

/// An MLP trainer on the CPU reference backend for `precision` (a DeepSpeed config
/// fragment) and `kiln` section.
fn mlp_trainer(dev: &dyn kiln::engine::Device, precision: &str, kiln: &str) -> Trainer {
    let config = parse(
        &format!(
            r#"{{"train_micro_batch_size_per_gpu": 8, {precision} "kiln": {{{kiln}}},
                "optimizer": {{"type": "AdamW", "params": {{"lr": 0.01}}}}}}"#
        ),
        1,
    )
    .unwrap();
    let mlp = Mlp {
        inputs: 4,
        hidden: 8,
        classes: 3,
    };
    Trainer::new(dev, Arc::new(mlp), config, 1).unwrap()
}

/// Steps `trainer` with its first weight poisoned with NaN until it errs (at most
/// `limit` steps); returns the skipped steps before and the error.
fn poisoned_steps(trainer: &mut Trainer, dev: &dyn kiln::engine::Device, limit: u64) -> Error {
    let n = trainer.model.parameter_layout()[0]
        .1
        .iter()
        .product::<usize>();
    trainer
        .model
        .set_parameter(dev, 0, &vec![f32::NAN; n])
        .unwrap();
    let x: Vec<f32> = (0..8 * 4).map(|i| (i % 5) as f32 * 0.1).collect();
    let y: Vec<u32> = (0..8).map(|i| i % 3).collect();
    for step in 1..=limit {
        match trainer.step(dev, &[MicroBatch::features(&x, &y)]) {
            Ok(s) => assert!(s.skipped, "step {step} applied NaN gradients"),
            Err(e) => return e,
        }
    }
    panic!("still skipping after {limit} steps");
}

#[test]
fn non_finite_gradients_without_loss_scaling_stop_the_trainer_after_a_few_skips() {
    let cpu = kiln::cpu::CpuDevice::new();
    for (precision, name) in [("", "fp32"), (r#""bf16": {"enabled": true},"#, "bf16")] {
        let mut t = mlp_trainer(&cpu, precision, "");
        let e = poisoned_steps(&mut t, &cpu, 50);
        let Error::Diverged { step, .. } = &e else {
            panic!("{name}: {e}")
        };
        assert_eq!(*step, 3, "{name}: the default tolerates 3 skips in a row");
        let text = e.to_string();
        for needle in [
            "step 3",
            name,
            "not finite",
            "3 steps in a row",
            "kiln.max_consecutive_skips",
            "learning rate",
            "gradient_clipping",
        ] {
            assert!(text.contains(needle), "{name}: `{needle}` missing: {text}");
        }
        assert!(!text.contains("fp16 gradients"), "{name}: {text}");
    }
    // The setting is the config's, explained, and at least 1.
    let mut t = mlp_trainer(&cpu, "", r#""max_consecutive_skips": 1"#);
    assert!(
        t.config
            .explain()
            .contains("kiln.max_consecutive_skips = 1 (file)"),
        "{}",
        t.config.explain()
    );
    let e = poisoned_steps(&mut t, &cpu, 50);
    assert!(matches!(e, Error::Diverged { step: 1, .. }), "{e}");
    let e = parse(
        r#"{"train_batch_size": 8, "kiln": {"max_consecutive_skips": 0}}"#,
        1,
    )
    .unwrap_err()
    .to_string();
    assert!(e.contains("kiln.max_consecutive_skips"), "{e}");
    // A static fp16 scale cannot adapt either.
    let mut t = mlp_trainer(&cpu, r#""fp16": {"enabled": true, "loss_scale": 128},"#, "");
    let e = poisoned_steps(&mut t, &cpu, 50).to_string();
    assert!(
        e.contains("step 3") && e.contains("static loss scale 128"),
        "{e}"
    );
}

#[test]
fn a_data_parallel_group_stops_the_same_way() {
    let (a, b) = (kiln::cpu::CpuDevice::new(), kiln::cpu::CpuDevice::new());
    let devs: [&dyn kiln::engine::Device; 2] = [&a, &b];
    let config = parse(
        r#"{"train_batch_size": 16, "train_micro_batch_size_per_gpu": 8,
            "optimizer": {"type": "AdamW", "params": {"lr": 0.01}}}"#,
        2,
    )
    .unwrap();
    let mlp = Mlp {
        inputs: 4,
        hidden: 8,
        classes: 3,
    };
    let mut group = Trainer::new_group(&devs, Arc::new(mlp), config, 1).unwrap();
    // One rank's NaN makes the averaged gradients NaN.
    let n = group.model.parameter_layout()[0]
        .1
        .iter()
        .product::<usize>();
    group
        .model
        .set_parameter(&a, 0, &vec![f32::NAN; n])
        .unwrap();
    let x: Vec<f32> = (0..8 * 4).map(|i| (i % 5) as f32 * 0.1).collect();
    let y: Vec<u32> = (0..8).map(|i| i % 3).collect();
    let micro = vec![
        vec![MicroBatch::features(&x, &y)],
        vec![MicroBatch::features(&x, &y)],
    ];
    for _ in 0..2 {
        assert!(group.step_group(&devs, &micro).unwrap().skipped);
    }
    let e = group.step_group(&devs, &micro).unwrap_err();
    assert!(matches!(e, Error::Diverged { step: 3, .. }), "{e}");
}

#[test]
fn an_fp16_scaler_stuck_at_its_minimum_for_a_window_stops_the_trainer() {
    let cpu = kiln::cpu::CpuDevice::new();
    // Starting at the minimum scale with a hysteresis budget larger than the window:
    // the scaler itself would tolerate 4 overflows there; a window of 3 stops it at 3.
    let mut t = mlp_trainer(
        &cpu,
        r#""fp16": {"enabled": true, "initial_scale_power": 0, "min_loss_scale": 1,
                    "hysteresis": 5, "loss_scale_window": 3},"#,
        "",
    );
    let e = poisoned_steps(&mut t, &cpu, 50);
    assert!(matches!(e, Error::Diverged { step: 3, .. }), "{e}");
    let text = e.to_string();
    for needle in [
        "minimum 1 (fp16.min_loss_scale)",
        "window of 3 steps",
        "learning rate",
    ] {
        assert!(text.contains(needle), "`{needle}` missing: {text}");
    }
    // An overflow at the minimum with the hysteresis spent is divergence too.
    let mut t = mlp_trainer(
        &cpu,
        r#""fp16": {"enabled": true, "initial_scale_power": 0, "hysteresis": 1},"#,
        "",
    );
    let e = poisoned_steps(&mut t, &cpu, 50);
    assert!(matches!(e, Error::Diverged { step: 1, .. }), "{e}");
}

#[test]
fn a_diverging_fp32_run_stops_naming_the_step_the_checkpoint_and_what_to_try() {
    let dir = scratch("diverge");
    // A learning rate of 1e37 sends the weights towards f32's limit after one step;
    // the next forward pass overflows, and from then on every gradient is NaN.
    let (config, model) = files(&dir, "");
    let text = std::fs::read_to_string(&config).unwrap().replace(
        "\"total_num_steps\": 40",
        "\"total_num_steps\": 40, \"warmup_max_lr\": 1e37",
    );
    std::fs::write(&config, text).unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_kiln"))
        .args([
            "train",
            "--config",
            config.to_str().unwrap(),
            "--model",
            model.to_str().unwrap(),
            "--devices",
            "vulkan",
            "--out",
            dir.join("run").to_str().unwrap(),
            "--steps",
            "40",
            "--checkpoint-every",
            "1",
            "--keep-checkpoints",
            "0",
        ])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(err.contains("gradients are not finite"), "{err}");
    assert!(
        !err.contains("fp16"),
        "an fp32 run's log mentions fp16: {err}"
    );
    let run = dir.join("run");
    // The metrics hold the steps that returned: the two skips before the third, which
    // is the error.
    let recs = runs::read_metrics(&run).unwrap();
    let last = recs.last().unwrap().step;
    assert!(last < 40, "ran all 40 steps: {err}");
    let first_skip = recs.iter().find(|r| r.skipped).unwrap().step;
    assert_eq!(last, first_skip + 1, "stops at the third skip in a row");
    for needle in [
        format!("diverged at step {}", last + 1),
        format!("last good checkpoint is step {}", first_skip - 1),
        "learning rate".to_string(),
        "new run".to_string(),
    ] {
        assert!(err.contains(&needle), "`{needle}` missing: {err}");
    }
    assert!(run.join(runs::SUMMARY_FILE).is_file(), "no summary");
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn other_commands_neither_panic_on_a_closed_reader_nor_hide_a_full_disk() {
    let dir = scratch("reader");
    let (config, _) = files(&dir, "");
    for args in [
        vec!["config", "explain", config.to_str().unwrap()],
        vec!["config", "check", config.to_str().unwrap()],
        vec!["runs", "--root", dir.to_str().unwrap()],
    ] {
        // The reading end is closed before kiln writes: every write fails (EPIPE).
        let mut child = Command::new(env!("CARGO_BIN_EXE_kiln"))
            .args(&args)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        drop(child.stdout.take());
        let out = child.wait_with_output().unwrap();
        assert_eq!(
            out.status.code(),
            Some(0),
            "kiln {args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        // Output that cannot be stored (a full disk) is an error, not a panic.
        let out = Command::new(env!("CARGO_BIN_EXE_kiln"))
            .args(&args)
            .stdout(std::fs::File::create("/dev/full").unwrap())
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "kiln {args:?}: {err}");
        assert!(err.contains("writing the output"), "kiln {args:?}: {err}");
    }
    std::fs::remove_dir_all(&dir).ok();
}
