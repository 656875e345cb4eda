//! The profiler on lavapipe: profiling changes no numbers, times every launch, writes a
//! valid trace and a table whose parts add up to each step's time, falls back to host
//! spans without GPU timestamps; `kiln bench peak` measures, caches and survives a
//! corrupt cache.

mod common;

use kiln::engine::kernels::{self, Binary};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;
use std::time::Instant;

use common::*;
use kiln::engine::device::KernelTiming;
use kiln::engine::models::gpt::GptConfig;
use kiln::engine::models::MicroBatch;
use kiln::engine::train::checkpoint::{self, MODEL_FILE, OPTIMIZER_FILE};
use kiln::engine::train::runs;
use kiln::engine::{Buffer, Capabilities, DType, Device, HostData, Kernel, PendingDownload};
use kiln::train::{train, TrainOptions};
use kiln::wgpu::{find_adapter, DeviceOptions, WgpuDevice};
use serde_json::Value;

/// Host spans are recorded process-wide, one profile at a time: tests that profile take
/// turns.
static ONE_PROFILE: Mutex<()> = Mutex::new(());

fn scratch(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("kiln-profile-{name}-{}", std::process::id()));
    std::fs::remove_dir_all(&d).ok();
    std::fs::create_dir_all(&d).unwrap();
    d
}

fn tiny_run(dir: &Path, out: &str, profile: Option<u64>) -> TrainOptions {
    let model = dir.join("model.json");
    std::fs::write(
        &model,
        r#"{"n_layer": 1, "n_head": 2, "n_embd": 32, "block_size": 16, "vocab_size": 13}"#,
    )
    .unwrap();
    let config = dir.join("ds_config.json");
    std::fs::write(
        &config,
        r#"{"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2,
            "fp16": {"enabled": true, "initial_scale_power": 12},
            "optimizer": {"type": "AdamW", "params": {"lr": 0.003, "weight_decay": 0.01}}}"#,
    )
    .unwrap();
    TrainOptions {
        config: Some(config),
        model: Some(model),
        devices: vec!["vulkan".into()],
        out: Some(dir.join(out)),
        steps: Some(4),
        eval_every: Some(0),
        checkpoint_every: Some(0),
        profile,
        // 1 GFLOP/s per device: the MFU line must use it rather than any cached peak.
        peak_tflops: Some(0.001),
        ..TrainOptions::default()
    }
}

fn checkpoint_bits(run: &Path) -> Vec<(String, Vec<u32>)> {
    let ck = checkpoint::load_latest(run).unwrap();
    let mut out = vec![];
    for file in [MODEL_FILE, OPTIMIZER_FILE] {
        for t in &ck.file(file).unwrap().tensors {
            out.push((format!("{file}:{}", t.name), t.data.bits()));
        }
    }
    out.sort_by(|a, b| a.0.cmp(&b.0));
    out
}

fn loss_bits(run: &Path) -> Vec<(u64, u32)> {
    runs::read_metrics(run)
        .unwrap()
        .iter()
        .map(|r| (r.step, r.loss.to_bits()))
        .collect()
}

/// `step N: total = compute + comm + input + host + idle` lines of profile.txt.
fn step_lines(table: &str) -> Vec<(u64, [f64; 6])> {
    table
        .lines()
        .filter_map(|l| l.strip_prefix("step "))
        .filter_map(|l| {
            let (step, rest) = l.split_once(':')?;
            let nums: Vec<f64> = rest
                .split(['=', '+'])
                .map(|x| x.trim().parse().unwrap())
                .collect();
            Some((step.trim().parse().ok()?, nums.try_into().ok()?))
        })
        .collect()
}

#[test]
fn a_profiled_run_is_bit_identical_and_its_trace_and_table_add_up() {
    let _one = ONE_PROFILE.lock().unwrap_or_else(|e| e.into_inner());
    let dir = scratch("identical");
    let plain = train(&tiny_run(&dir, "plain", None)).unwrap();
    let profiled = train(&tiny_run(&dir, "profiled", Some(2))).unwrap();
    assert_eq!(loss_bits(&plain.dir), loss_bits(&profiled.dir));
    assert_eq!(checkpoint_bits(&plain.dir), checkpoint_bits(&profiled.dir));
    assert!(!plain.dir.join("trace.json").exists());

    // The trace: valid JSON, a named track for the device and one for the host thread,
    // every launch of steps 2 and 3 as a complete event, each step's frame.
    let trace: Value =
        serde_json::from_slice(&std::fs::read(profiled.dir.join("trace.json")).unwrap()).unwrap();
    let events = trace["traceEvents"].as_array().unwrap();
    let adapter = find_adapter("vulkan").unwrap();
    let name = kiln::wgpu::adapters()[adapter].caps.name.clone();
    assert!(events.iter().any(|e| e["ph"] == "M"
        && e["pid"] == 1
        && e["name"] == "thread_name"
        && e["args"]["name"] == name.as_str()));
    assert!(events
        .iter()
        .any(|e| e["ph"] == "M" && e["pid"] == 2 && e["name"] == "thread_name"));
    let complete: Vec<&Value> = events.iter().filter(|e| e["ph"] == "X").collect();
    for e in &complete {
        assert!(
            e["ts"].as_f64().unwrap() >= 0.0 && e["dur"].as_f64().unwrap() >= 0.0,
            "{e}"
        );
    }
    let frame = |step: u64| {
        let f = complete
            .iter()
            .find(|e| e["name"] == format!("step {step}").as_str())
            .unwrap_or_else(|| panic!("no frame for step {step}"));
        let ts = f["ts"].as_f64().unwrap();
        (ts, ts + f["dur"].as_f64().unwrap())
    };
    // Steps 2 and 3 follow each other.
    let split = frame(3).0;
    assert!(frame(2).1 <= split);
    // (start µs, name, duration µs) of every launch, in device order.
    let mut launches: Vec<(f64, &str, f64)> = complete
        .iter()
        .filter(|e| e["pid"] == 1 && e["cat"] == "kernel")
        .map(|e| {
            let ts = e["ts"].as_f64().unwrap();
            (ts, e["name"].as_str().unwrap(), e["dur"].as_f64().unwrap())
        })
        .collect();
    launches.sort_by(|a, b| a.0.total_cmp(&b.0));
    let kernels = complete.iter().filter(|e| e["pid"] == 1).count();
    let records = complete.iter().filter(|e| e["cat"] == "record").count();
    // Both steps launch the same kernels in the same order; each launch has its device
    // event and its host recording span. The device clock is mapped onto the host's
    // with one offset for the whole profile (calibrated at its start), whose error is
    // well under 1 ms on a quiet host and over 1 ms on a loaded CI host, and the gap
    // between two frames can be shorter than that, so the steps are told apart by
    // order: the first half of the launches is step 2's, the second half step 3's.
    assert!(kernels > 20, "{kernels} kernel events");
    assert_eq!(kernels % 2, 0);
    assert_eq!(launches.len(), kernels);
    let (step_2, step_3) = launches.split_at(kernels / 2);
    let names =
        |half: &[(f64, &str, f64)]| half.iter().map(|l| l.1.to_string()).collect::<Vec<_>>();
    assert_eq!(names(step_2), names(step_3));
    // A profiled step's frame runs until its devices finish, so one shift of the device
    // events (the calibration's error, the same for every event) puts each step's
    // kernels inside its own frame: the shifts that fit step 2 and those that fit step 3
    // overlap (to 0.1 ms), and include one within 20 ms (a gross error is a bug).
    let shifts = |half: &[(f64, &str, f64)], (lo, hi): (f64, f64)| {
        let first = half.iter().map(|l| l.0).fold(f64::INFINITY, f64::min);
        let last = half
            .iter()
            .map(|l| l.0 + l.2)
            .fold(f64::NEG_INFINITY, f64::max);
        (lo - first, hi - last)
    };
    let (a2, b2) = shifts(step_2, frame(2));
    let (a3, b3) = shifts(step_3, frame(3));
    let (lo, hi) = (a2.max(a3), b2.min(b3));
    assert!(
        lo <= hi + 100.0 && lo <= 20e3 && hi >= -20e3,
        "no one clock shift puts each step's kernels in its frame: step 2 fits \
         {a2:.0}..{b2:.0} µs, step 3 {a3:.0}..{b3:.0} µs"
    );
    assert!(split >= frame(2).1);
    assert_eq!(records, kernels);
    for cat in ["submit", "input"] {
        assert!(complete.iter().any(|e| e["cat"] == cat), "no {cat} span");
    }
    assert!(complete
        .iter()
        .any(|e| e["pid"] == 1 && e["name"].as_str().unwrap().starts_with("matmul ")));

    // The table: each profiled step's parts add up to its total, and the total is the
    // step time metrics.jsonl records. Values are printed to 0.01 ms, so the parts may
    // differ from the total by up to 5 roundings: tolerance 0.05 ms.
    let table = std::fs::read_to_string(profiled.dir.join("profile.txt")).unwrap();
    let lines = step_lines(&table);
    assert_eq!(
        lines.iter().map(|l| l.0).collect::<Vec<_>>(),
        [2, 3],
        "{table}"
    );
    let records = runs::read_metrics(&profiled.dir).unwrap();
    for (step, [total, parts @ ..]) in lines {
        let sum: f64 = parts.iter().sum();
        assert!(
            (sum - total).abs() <= 0.05,
            "step {step}: {parts:?} vs {total}\n{table}"
        );
        let measured = records.iter().find(|r| r.step == step).unwrap().step_ms;
        assert!(
            (measured - total).abs() <= 0.05,
            "step {step}: table {total} ms, metrics {measured} ms"
        );
        assert!(parts[0] > 0.0, "no compute in step {step}\n{table}");
    }
    // One in-order queue runs one kernel at a time, so a step's compute part is the time
    // its frame holds kernels: every kernel event's overlap with the frame, summed, within
    // 0.1 ms (printed to 0.01 ms). (That the frame holds all of the step's own kernels,
    // its optimizer's included, which run after the loss is read, is the shift check
    // above: the calibration's error moves events across the frame's edges, 0.36 ms of
    // step 2's once on a loaded CI host.)
    let in_frame_ms = |step: u64| {
        let (lo, hi) = frame(step);
        launches
            .iter()
            .map(|&(ts, _, dur)| ((ts + dur).min(hi) - ts.max(lo)).max(0.0) / 1e3)
            .sum::<f64>()
    };
    for (step, [_, compute, ..]) in step_lines(&table) {
        let held = in_frame_ms(step);
        assert!(
            (held - compute).abs() <= 0.1,
            "step {step}: kernels in the frame {held:.2} ms, compute {compute} ms\n{table}"
        );
    }
    assert!(table.contains("% of 1.0 GFLOP/s peak"), "{table}");
}

/// Forwards to a device and counts the launches it records.
struct Counting {
    inner: Box<dyn Device>,
    launches: AtomicUsize,
}

impl Device for Counting {
    fn caps(&self) -> &Capabilities {
        self.inner.caps()
    }
    fn alloc(&self, dtype: DType, len: usize) -> kiln::engine::Result<Buffer> {
        self.inner.alloc(dtype, len)
    }
    fn free(&self, buf: Buffer) -> kiln::engine::Result<()> {
        self.inner.free(buf)
    }
    fn view(&self, parent: Buffer, offset: usize, len: usize) -> kiln::engine::Result<Buffer> {
        self.inner.view(parent, offset, len)
    }
    fn upload(&self, buf: Buffer, data: &HostData) -> kiln::engine::Result<()> {
        self.inner.upload(buf, data)
    }
    fn begin_download(&self, buf: Buffer) -> kiln::engine::Result<PendingDownload> {
        self.inner.begin_download(buf)
    }
    fn finish_download(&self, pending: PendingDownload) -> kiln::engine::Result<HostData> {
        self.inner.finish_download(pending)
    }
    fn launch(&self, kernel: &Kernel) -> kiln::engine::Result<()> {
        self.launches.fetch_add(1, Ordering::SeqCst);
        self.inner.launch(kernel)
    }
    fn submit(&self) -> kiln::engine::Result<()> {
        self.inner.submit()
    }
    fn wait(&self) -> kiln::engine::Result<()> {
        self.inner.wait()
    }
    fn allocated_bytes(&self) -> u64 {
        self.inner.allocated_bytes()
    }
    fn profile_begin(&self) -> kiln::engine::Result<()> {
        self.inner.profile_begin()
    }
    fn profile_end(&self) -> kiln::engine::Result<Vec<KernelTiming>> {
        self.inner.profile_end()
    }
}

#[test]
fn every_launch_of_a_step_gets_a_gpu_timing_in_order_within_the_step() {
    every_launch_timed(gpu("vulkan", false));
}

/// The same on the raw Vulkan backend (`vk:0`), whose timestamps are its own.
#[test]
fn every_launch_of_a_step_gets_a_gpu_timing_on_vk() {
    every_launch_timed(vk(false));
}

fn every_launch_timed(inner: Box<dyn Device>) {
    let dev = Counting {
        inner,
        launches: AtomicUsize::new(0),
    };
    let cfg: GptConfig = serde_json::from_str(
        r#"{"n_layer": 1, "n_head": 2, "n_embd": 16, "block_size": 8, "vocab_size": 13}"#,
    )
    .unwrap();
    let mut trainer = gpt_trainer(&dev, &cfg, (2, 8), DType::F32, 1);
    let tokens: Vec<u32> = (0..16).map(|i| i % 13).collect();
    let targets: Vec<u32> = (1..17).map(|i| i % 13).collect();
    let micro = [MicroBatch::tokens(&tokens, &targets)];
    trainer.step(&dev, &micro).unwrap(); // compiles
    let before = Instant::now();
    dev.profile_begin().unwrap();
    dev.launches.store(0, Ordering::SeqCst);
    trainer.step(&dev, &micro).unwrap();
    let timings = dev.profile_end().unwrap();
    let after = Instant::now();
    let launched = dev.launches.load(Ordering::SeqCst);
    assert!(launched > 20);
    assert_eq!(timings.len(), launched);
    for w in timings.windows(2) {
        assert!(
            w[1].start >= w[0].start,
            "{:?} before {:?}",
            w[1].cost,
            w[0].cost
        );
    }
    // On the host's clock: inside the profiled stretch, give or take the calibration's
    // half round trip (1 ms is far above it on lavapipe).
    let slack = std::time::Duration::from_millis(1);
    assert!(timings[0].start + slack >= before);
    let last = timings.last().unwrap();
    assert!(last.start + last.dur <= after + slack);
    assert!(timings
        .iter()
        .any(|t| t.cost.kind == "matmul" && t.cost.flops > 0.0));
    assert!(timings.iter().any(|t| t.cost.kind == "adam"));
    // A second profile_end without a begin is an error, not an empty profile.
    let e = dev.profile_end().unwrap_err().to_string();
    assert!(e.contains("without profile_begin"), "{e}");
}

#[test]
fn without_gpu_timestamps_the_profile_says_so_and_keeps_host_spans() {
    let _one = ONE_PROFILE.lock().unwrap_or_else(|e| e.into_inner());
    let index = find_adapter("vulkan").unwrap();
    let dev = WgpuDevice::open(
        index,
        &DeviceOptions {
            disable_timestamps: true,
            ..Default::default()
        },
    )
    .unwrap();
    let e = dev.profile_begin().unwrap_err().to_string();
    assert!(
        e.contains("timestamp") && e.contains("host spans only"),
        "{e}"
    );

    let devs: Vec<&dyn Device> = vec![&dev];
    let mut p = kiln::profile::Profiler::new((1, 1), &devs, Some(1.0)).unwrap();
    p.before_step(1, &devs).unwrap();
    let start = Instant::now();
    let x = put(&dev, &HostData::F32(vec![1.0; 4096]));
    let y = dev.alloc(DType::F32, 4096).unwrap();
    dev.launch(&Kernel::Copy(kernels::Copy { src: x, dst: y }))
        .unwrap();
    dev.download(y).unwrap();
    let end = Instant::now();
    p.after_step(1, start, end, &devs).unwrap();
    let dir = scratch("untimed");
    let table = p.finish(&dir, &devs).unwrap().unwrap();
    assert!(table.contains("without GPU timestamps"), "{table}");
    let trace: Value =
        serde_json::from_slice(&std::fs::read(dir.join("trace.json")).unwrap()).unwrap();
    let events = trace["traceEvents"].as_array().unwrap();
    assert!(!events.iter().any(|e| e["ph"] == "X" && e["pid"] == 1));
    assert!(events
        .iter()
        .any(|e| e["ph"] == "X" && e["pid"] == 2 && e["cat"] == "transfer"));
}

#[test]
fn the_cpu_reference_times_each_launch_on_the_host() {
    let dev = kiln::cpu::CpuDevice::new();
    let n = 1 << 16;
    let a = put(&dev, &HostData::F32(vec![1.0; n]));
    let b = put(&dev, &HostData::F32(vec![2.0; n]));
    let out = dev.alloc(DType::F32, n).unwrap();
    let before = Instant::now();
    dev.profile_begin().unwrap();
    let add = Kernel::Binary(Binary {
        op: kiln::engine::BinaryOp::Add,
        a,
        b,
        out,
    });
    dev.launch(&add).unwrap();
    dev.launch(&add).unwrap();
    let t = dev.profile_end().unwrap();
    let after = Instant::now();
    assert_eq!(t.len(), 2);
    assert_eq!(t[0].cost, add.cost());
    assert!(t[0].start >= before && t[1].start >= t[0].start + t[0].dur);
    assert!(t[1].start + t[1].dur <= after);
    // Off again: launches are not timed.
    dev.launch(&add).unwrap();
    assert!(dev.profile_end().is_err());
}

fn kiln_cmd(cache: &Path, args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_kiln"))
        .args(args)
        .env("KILN_CACHE_DIR", cache)
        .output()
        .unwrap()
}

#[test]
fn bench_peak_measures_caches_and_feeds_the_profiles_mfu_and_a_corrupt_cache_is_ignored() {
    let dir = scratch("peak");
    let cache = dir.join("cache");
    let out = kiln_cmd(&cache, &["bench", "peak", "--devices", "vulkan", "--json"]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    let rows: Value = serde_json::from_slice(&out.stdout).unwrap();
    let row = &rows[0];
    let gflops = row["gflops"].as_f64().unwrap();
    assert!(gflops > 0.0 && row["gbps"].as_f64().unwrap() > 0.0, "{row}");
    assert!(!row["adapter"].as_str().unwrap().is_empty());
    assert!(!row["host_cpu"].as_str().unwrap().is_empty());
    let cached: Value =
        serde_json::from_slice(&std::fs::read(cache.join("peak.json")).unwrap()).unwrap();
    assert_eq!(cached["peaks"].as_object().unwrap().len(), 1, "{cached}");
    assert_eq!(
        cached["peaks"]
            .as_object()
            .unwrap()
            .values()
            .next()
            .unwrap(),
        row
    );

    // A profiled run takes its MFU's peak from the cache.
    let run = dir.join("run");
    let out = kiln_cmd(
        &cache,
        &[
            "train",
            "--steps",
            "2",
            "--profile",
            "1",
            "--eval-every",
            "0",
            "--out",
        ],
    );
    assert!(!out.status.success(), "--out without a value must fail");
    let out = Command::new(env!("CARGO_BIN_EXE_kiln"))
        .args([
            "train",
            "--devices",
            "vulkan",
            "--steps",
            "2",
            "--profile",
            "1",
        ])
        .args(["--eval-every", "0", "--out"])
        .arg(&run)
        .env("KILN_CACHE_DIR", &cache)
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    assert!(
        stderr.contains(&format!("of {gflops:.1} GFLOP/s peak")),
        "{stderr}"
    );
    assert!(run.join("trace.json").exists() && run.join("profile.txt").exists());

    // A corrupt cache is reported and replaced, never a crash.
    std::fs::write(cache.join("peak.json"), "{\"peaks\": {\"x\": 12").unwrap();
    let out = kiln_cmd(&cache, &["bench", "peak", "--devices", "vulkan"]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    assert!(stderr.contains("ignoring the peak cache"), "{stderr}");
    assert!(String::from_utf8_lossy(&out.stdout).contains("GFLOP/s"));
    let cached: Value =
        serde_json::from_slice(&std::fs::read(cache.join("peak.json")).unwrap()).unwrap();
    assert_eq!(cached["peaks"].as_object().unwrap().len(), 1, "{cached}");
}
