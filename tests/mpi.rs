//! `mpirun -np N kiln train`: data parallelism and ZeRO across processes over MPI, as
//! a user runs it on one machine (Open MPI, each process driving its own lavapipe
//! device). Built with the `mpi` feature (the README's test command enables it).
//!
//! A job whose processes drive one device each trains bit for bit like one process
//! driving all the devices (same global batch, same sums in the same order); a
//! killed process stops the job, and its last checkpoint resumes on fewer processes
//! with the same losses; a hung process is named and the job stopped within the
//! timeout; processes started differently are refused.
#![cfg(feature = "mpi")]

use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

const KILN: &str = env!("CARGO_BIN_EXE_kiln");

/// One job at a time: each already runs a process per core, and jobs sharing the
/// cores would measure each other (the exchange's overlap, the timeouts).
static ONE_JOB: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn one_job() -> std::sync::MutexGuard<'static, ()> {
    ONE_JOB.lock().unwrap_or_else(|e| e.into_inner())
}

/// 8 blocks, so most gradient bytes are final well before backward ends.
const MODEL: &str =
    r#"{"n_layer": 8, "n_head": 4, "n_embd": 64, "block_size": 9, "vocab_size": 13}"#;

fn scratch(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("kiln-mpi-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// A config: fp32 (or fp16), ZeRO `stage`, the exchange overlapped with backward.
fn config(dir: &Path, name: &str, stage: u8, fp16: bool, timeout_s: u64) -> PathBuf {
    let precision = if fp16 {
        r#""fp16": {"enabled": true, "initial_scale_power": 10},"#
    } else {
        ""
    };
    let path = dir.join(name);
    std::fs::write(
        &path,
        format!(
            r#"{{"train_micro_batch_size_per_gpu": 32, "gradient_accumulation_steps": 1,
                "gradient_clipping": 1.0, "steps_per_print": 5, {precision}
                "zero_optimization": {{"stage": {stage}, "overlap_comm": true,
                                       "reduce_bucket_size": 20000}},
                "optimizer": {{"type": "AdamW", "params": {{"lr": 0.003, "weight_decay": 0.01}}}},
                "kiln": {{"eval_every": 0, "checkpoint_every": 4, "collective_timeout_s": {timeout_s}}}}}"#
        ),
    )
    .unwrap();
    path
}

fn model(dir: &Path) -> PathBuf {
    let path = dir.join("model.json");
    std::fs::write(&path, MODEL).unwrap();
    path
}

fn mpirun() -> Command {
    let mut c = Command::new("mpirun");
    c.args(["--allow-run-as-root", "--oversubscribe"]);
    c
}

/// `kiln train` arguments for a run into `out`.
fn train_args(config: &Path, model: &Path, out: &Path, devices: &str, steps: u64) -> Vec<String> {
    [
        "train",
        "--config",
        config.to_str().unwrap(),
        "--model",
        model.to_str().unwrap(),
        "--devices",
        devices,
        "--steps",
        &steps.to_string(),
        "--out",
        out.to_str().unwrap(),
    ]
    .map(String::from)
    .to_vec()
}

/// Runs `cmd` to completion within `limit`, or kills it and fails.
fn finish(mut cmd: Command, limit: Duration) -> (Output, Duration) {
    let child = cmd
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("mpirun (install openmpi-bin: bash scripts/setup.sh)");
    wait_out(child, limit)
}

/// Waits up to `limit` for `child` to exit, or kills it and fails with its stderr.
fn wait_out(mut child: std::process::Child, limit: Duration) -> (Output, Duration) {
    let started = Instant::now();
    while child.try_wait().unwrap().is_none() {
        if started.elapsed() > limit {
            let _ = child.kill();
            let out = child.wait_with_output().unwrap();
            panic!(
                "still running after {limit:?}: {}",
                String::from_utf8_lossy(&out.stderr)
            );
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    (child.wait_with_output().unwrap(), started.elapsed())
}

fn ok(out: &Output) -> String {
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(out.status.success(), "{text}");
    text
}

/// Per step: (loss, exchange overlap) from a run's metrics.
fn metrics(run: &Path) -> Vec<(f64, f64)> {
    std::fs::read_to_string(run.join("metrics.jsonl"))
        .unwrap()
        .lines()
        .map(|l| {
            let r: serde_json::Value = serde_json::from_str(l).unwrap();
            (
                r["loss"].as_f64().unwrap(),
                r["comm_overlap"].as_f64().unwrap(),
            )
        })
        .collect()
}

fn losses(run: &Path) -> Vec<f64> {
    metrics(run).into_iter().map(|m| m.0).collect()
}

/// The final checkpoint's files, bytes.
fn checkpoint(run: &Path, step: u64) -> Vec<Vec<u8>> {
    let dir = run.join(format!("checkpoints/step-{step:08}"));
    ["model.safetensors", "optimizer.safetensors"]
        .iter()
        .map(|f| std::fs::read(dir.join(f)).unwrap())
        .collect()
}

#[test]
fn two_processes_train_bit_identically_to_one_process_with_two_devices() {
    let _one = one_job();
    let dir = scratch("two");
    let m = model(&dir);
    for fp16 in [false, true] {
        let c = config(&dir, "c.json", 0, fp16, 120);
        let (one, two) = (
            dir.join(format!("one-{fp16}")),
            dir.join(format!("two-{fp16}")),
        );
        let mut single = Command::new(KILN);
        single.args(train_args(&c, &m, &one, "vulkan:0x2", 10));
        ok(&finish(single, Duration::from_secs(300)).0);
        let mut job = mpirun();
        job.args(["-np", "2", KILN])
            .args(train_args(&c, &m, &two, "vulkan", 10));
        let log = ok(&finish(job, Duration::from_secs(300)).0);
        assert!(log.contains("2 processes, 2 devices"), "{log}");
        let bits = |v: Vec<f64>| v.iter().map(|x| (*x as f32).to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(losses(&two)), bits(losses(&one)), "fp16 {fp16}");
        assert_eq!(losses(&two).len(), 10);
        // Weights, masters and moments, written once by process 0.
        assert!(
            checkpoint(&two, 10) == checkpoint(&one, 10),
            "fp16 {fp16}: checkpoints differ"
        );
        if !fp16 {
            // Resumed under mpirun, the job goes on as the one-process run does.
            let mut job = mpirun();
            job.args(["-np", "2", KILN])
                .args(train_args(&c, &m, &two, "vulkan", 14))
                .arg("--resume");
            ok(&finish(job, Duration::from_secs(300)).0);
            let mut single = Command::new(KILN);
            single
                .args(train_args(&c, &m, &one, "vulkan:0x2", 14))
                .arg("--resume");
            ok(&finish(single, Duration::from_secs(300)).0);
            assert_eq!(bits(losses(&two)), bits(losses(&one)), "resumed");
            assert_eq!(losses(&two).len(), 14);
            // Most of the processes' exchange happens while backward is still running.
            let overlap: Vec<f64> = metrics(&two)[1..10].iter().map(|m| m.1).collect();
            let mean = overlap.iter().sum::<f64>() / overlap.len() as f64;
            eprintln!("overlap per step {overlap:?}, mean {mean:.3}");
            // The issue's bar. Each block is handed over in two parts and a bucket is
            // summed where a part ends, so only the embeddings' gradients (0.4 %) wait
            // for the end of backward: measured 0.99 with other builds loading the cores.
            assert!(mean >= 0.8, "mean overlap {mean:.3}: {overlap:?}");
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn three_processes_at_zero_0_to_3_and_offloaded_train_like_one_process_at_stage_0() {
    let _one = one_job();
    let dir = scratch("three");
    let m = model(&dir);
    let c0 = config(&dir, "z0.json", 0, false, 120);
    let base = dir.join("base");
    let mut single = Command::new(KILN);
    single.args(train_args(&c0, &m, &base, "vulkan:0x3", 8));
    ok(&finish(single, Duration::from_secs(300)).0);
    // Stage 2 once more with every process's shards offloaded to its host memory, and
    // stage 3 (every block's matrices streamed: a threshold of 1000 elements) offloaded.
    for (stage, offload) in [(0, false), (1, false), (2, false), (2, true), (3, true)] {
        let c = config(&dir, &format!("z{stage}.json"), stage, false, 120);
        if offload {
            let text = std::fs::read_to_string(&c).unwrap().replace(
                r#""reduce_bucket_size": 20000"#,
                r#""reduce_bucket_size": 20000, "offload_optimizer": {"device": "cpu"},
                   "stage3_param_persistence_threshold": 1000"#,
            );
            assert!(text.contains("offload_optimizer"));
            std::fs::write(&c, text).unwrap();
        }
        let run = dir.join(format!(
            "zero{stage}{}",
            if offload { "_offload" } else { "" }
        ));
        let stage = format!("{stage}{}", if offload { " offloaded" } else { "" });
        let mut job = mpirun();
        job.args(["-np", "3", KILN])
            .args(train_args(&c, &m, &run, "vulkan", 8));
        ok(&finish(job, Duration::from_secs(400)).0);
        // Uneven slices (the model's size does not divide by 3), every process's state
        // gathered into process 0's checkpoint.
        assert_eq!(losses(&run), losses(&base), "ZeRO stage {stage}");
        // Offloaded for real: the host step is timed in every step's record.
        let metrics = std::fs::read_to_string(run.join("metrics.jsonl")).unwrap();
        assert_eq!(
            metrics.lines().all(|l| l.contains("\"offload_ms\"")),
            offload,
            "ZeRO stage {stage}"
        );
        // Stage 3's weight loads are measured in every record.
        assert_eq!(
            metrics.lines().all(|l| l.contains("\"gather_ms\"")),
            stage.starts_with('3'),
            "ZeRO stage {stage}"
        );
        assert!(
            checkpoint(&run, 8) == checkpoint(&base, 8),
            "ZeRO stage {stage}: checkpoints differ"
        );
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// The pid of rank `rank` among the `kiln` processes mpirun started for `out`.
fn rank_pid(out: &Path, rank: u32) -> Option<u32> {
    for entry in std::fs::read_dir("/proc").ok()? {
        let Ok(pid) = entry.ok()?.file_name().to_string_lossy().parse::<u32>() else {
            continue;
        };
        let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
        let cmdline = String::from_utf8_lossy(&cmdline);
        if !cmdline.starts_with(KILN) || !cmdline.contains(out.to_str().unwrap()) {
            continue;
        }
        let environ = std::fs::read(format!("/proc/{pid}/environ")).unwrap_or_default();
        let want = format!("OMPI_COMM_WORLD_RANK={rank}");
        if environ.split(|&b| b == 0).any(|v| v == want.as_bytes()) {
            return Some(pid);
        }
    }
    None
}

/// Starts a long 2-process job into `out` and waits until it has written a checkpoint.
fn start_long_job(c: &Path, m: &Path, out: &Path) -> std::process::Child {
    let mut job = mpirun();
    job.args(["-np", "2", KILN])
        .args(train_args(c, m, out, "vulkan", 100_000))
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    let child = job.spawn().expect("mpirun");
    let started = Instant::now();
    while !out.join("checkpoints").join("step-00000008").exists() {
        assert!(
            started.elapsed() < Duration::from_secs(300),
            "no checkpoint"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    child
}

fn kill(pid: u32, signal: &str) {
    Command::new("kill")
        .args([signal, &pid.to_string()])
        .status()
        .unwrap();
}

#[test]
fn a_killed_process_stops_the_job_and_its_checkpoint_resumes_on_one_process() {
    let _one = one_job();
    let dir = scratch("kill");
    let (c, m) = (config(&dir, "c.json", 1, false, 20), model(&dir));
    let run = dir.join("run");
    let job = start_long_job(&c, &m, &run);
    let victim = rank_pid(&run, 1).expect("rank 1's process");
    kill(victim, "-KILL");
    let (out, took) = wait_out(job, Duration::from_secs(60));
    let text =
        String::from_utf8_lossy(&out.stderr).to_string() + &String::from_utf8_lossy(&out.stdout);
    assert!(!out.status.success());
    // Open MPI's launcher names the dead rank and stops the others.
    assert!(text.contains("rank 1"), "{text}");
    eprintln!("the job stopped {:.1} s after the kill", took.as_secs_f64());
    // The latest checkpoint loads: one process with both devices continues from it
    // exactly as an uninterrupted one-process run does.
    let last = std::fs::read_dir(run.join("checkpoints"))
        .unwrap()
        .filter_map(|e| {
            e.ok()?
                .file_name()
                .to_str()?
                .strip_prefix("step-")?
                .parse::<u64>()
                .ok()
        })
        .max()
        .unwrap();
    let end = last + 4;
    let mut resume = Command::new(KILN);
    resume
        .args(train_args(&c, &m, &run, "vulkan:0x2", end))
        .arg("--resume");
    ok(&finish(resume, Duration::from_secs(300)).0);
    let reference = dir.join("reference");
    let mut straight = Command::new(KILN);
    straight.args(train_args(&c, &m, &reference, "vulkan:0x2", end));
    ok(&finish(straight, Duration::from_secs(300)).0);
    let (resumed, want) = (losses(&run), losses(&reference));
    assert_eq!(resumed.len() as u64, end, "metrics of every step");
    assert_eq!(
        resumed[last as usize..],
        want[last as usize..],
        "resumed after step {last}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_hung_process_is_named_and_the_job_stops_within_the_timeout() {
    let _one = one_job();
    let dir = scratch("hang");
    let (c, m) = (config(&dir, "c.json", 0, false, 5), model(&dir));
    let run = dir.join("run");
    let job = start_long_job(&c, &m, &run);
    let victim = rank_pid(&run, 1).expect("rank 1's process");
    kill(victim, "-STOP");
    let (out, took) = wait_out(job, Duration::from_secs(60));
    kill(victim, "-KILL");
    let text =
        String::from_utf8_lossy(&out.stderr).to_string() + &String::from_utf8_lossy(&out.stdout);
    assert!(!out.status.success());
    // Stopped between steps, process 0 names it at the next step; stopped inside a
    // sum, the watchdog stops the sum. Either way within the 5 s timeout (plus the
    // launcher's own shutdown).
    assert!(
        text.contains("process(es) [1] did not reach step")
            || text.contains("has not completed within 5 s"),
        "{text}"
    );
    assert!(
        text.contains("within 5 s (kiln.collective_timeout_s)"),
        "{text}"
    );
    assert!(took < Duration::from_secs(30), "took {took:?}");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn processes_started_with_different_settings_are_refused() {
    let _one = one_job();
    let dir = scratch("differ");
    let (c, m) = (config(&dir, "c.json", 0, false, 60), model(&dir));
    let run = dir.join("run");
    let mut job = mpirun();
    job.args(["-np", "1", KILN])
        .args(train_args(&c, &m, &run, "vulkan", 4))
        .args(["--seed", "1", ":", "-np", "1", KILN])
        .args(train_args(&c, &m, &run, "vulkan", 4))
        .args(["--seed", "2"]);
    let (out, _) = finish(job, Duration::from_secs(120));
    let text = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(
        text.contains("started with different configs, models or seeds: process(es) [1] differ"),
        "{text}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn bench_dp_under_mpirun_measures_the_processes_exchange() {
    let _one = one_job();
    let dir = scratch("bench");
    let m = model(&dir);
    let mut job = mpirun();
    job.args([
        "-np", "2", KILN, "bench", "dp", "--counts", "1", "--steps", "2",
    ])
    .args(["--micro", "2", "--model", m.to_str().unwrap()]);
    let text = ok(&finish(job, Duration::from_secs(300)).0);
    assert!(text.contains("2 processes × 1 device(s)"), "{text}");
    // Every step each of 2 processes sends half of its f32 sums to the other and
    // receives the other's half (reduce-scatter), then sends its summed half and
    // receives the other (all-gather): 2 × 4 bytes per parameter.
    let psi: f64 = text
        .split("Ψ = ")
        .nth(1)
        .and_then(|s| s.split(',').next())
        .and_then(|s| s.parse().ok())
        .expect("Ψ");
    let mb: f64 = text
        .split(" MB/step between processes")
        .next()
        .and_then(|s| s.rsplit(", ").next())
        .and_then(|s| s.parse().ok())
        .expect("MB/step");
    assert!(
        (mb - 8.0 * psi / 1e6).abs() < 0.006,
        "{mb} MB for Ψ = {psi}: {text}"
    );
    for n in [2, 4, 8, 16, 64] {
        assert!(
            text.contains(&format!("  {n} processes: scaling efficiency")),
            "{text}"
        );
    }
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn sigterm_stops_every_process_after_the_same_step_with_a_checkpoint() {
    let _one = one_job();
    let dir = scratch("interrupt");
    let (c, m) = (config(&dir, "c.json", 1, false, 60), model(&dir));
    let run = dir.join("run");
    let job = start_long_job(&c, &m, &run);
    // The processes' own signal (as a scheduler sends it), one after the other: each
    // sees it at its own step, and they still stop after the same one.
    for rank in [1, 0] {
        kill(rank_pid(&run, rank).expect("a rank's process"), "-TERM");
        std::thread::sleep(Duration::from_millis(300));
    }
    let (out, took) = wait_out(job, Duration::from_secs(120));
    let text =
        String::from_utf8_lossy(&out.stderr).to_string() + &String::from_utf8_lossy(&out.stdout);
    let step: u64 = text
        .split("interrupted after step ")
        .nth(1)
        .and_then(|s| s.split(';').next())
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| panic!("no interruption line: {text}"));
    assert!(
        text.contains("Continue with: mpirun -np 2 kiln train --resume"),
        "{text}"
    );
    // Process 0 checkpointed the step every process stopped after, and recorded it.
    assert!(
        run.join(format!("checkpoints/step-{step:08}")).is_dir(),
        "{text}"
    );
    assert_eq!(losses(&run).len() as u64, step);
    eprintln!(
        "stopped after step {step}, {:.1} s after the signal",
        took.as_secs_f64()
    );
    let _ = std::fs::remove_dir_all(&dir);
}
