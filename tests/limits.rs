//! Resources are bounded before they are taken: a model, a device count or a benchmark
//! size that cannot fit is refused up front, with what it needs and what would fit,
//! never found out by an allocation that aborts, a hang or NaN rows; and `runs diff`
//! compares like with like.

mod common;

use std::process::Command;
use std::sync::Arc;
use std::time::{Duration, Instant};

use kiln::engine::models::gpt::{Gpt, GptConfig};
use kiln::engine::models::llama::{Llama, LlamaConfig};
use kiln::engine::models::{
    Forward, Init, MicroBatch, Model, Network, NetworkMemory, NetworkOptions, ParamSpec,
};
use kiln::engine::train::runs::{
    diff_runs, read_metrics, write_config, MetricsWriter, StepRecord, Summary,
};
use kiln::engine::train::trainer::Trainer;
use kiln::engine::{Capabilities, DType, Device, Error};
use kiln::wgpu::{find_adapter, DeviceOptions, WgpuDevice};

fn kiln(args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_kiln"))
        .args(args)
        .output()
        .expect("run kiln")
}

/// `kiln` under an address-space limit (`ulimit -v`, KiB), so that a command which
/// would allocate what it should refuse dies of it quickly instead of taking the
/// machine's memory.
fn kiln_limited(kib: u64, args: &[&str]) -> std::process::Output {
    let quoted: Vec<String> = args.iter().map(|a| format!("'{a}'")).collect();
    Command::new("bash")
        .arg("-c")
        .arg(format!(
            "ulimit -v {kib}; exec '{}' {}",
            env!("CARGO_BIN_EXE_kiln"),
            quoted.join(" ")
        ))
        .output()
        .expect("run kiln through bash")
}

fn text(out: &std::process::Output) -> String {
    format!(
        "status {:?}\nstdout: {}\nstderr: {}",
        out.status.code(),
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

fn scratch(name: &str) -> std::path::PathBuf {
    let d = std::env::temp_dir().join(format!("kiln-limits-{name}-{}", std::process::id()));
    std::fs::remove_dir_all(&d).ok();
    std::fs::create_dir_all(&d).unwrap();
    d
}

fn options(batch: usize, dtype: DType) -> NetworkOptions {
    NetworkOptions {
        batch,
        dtype,
        optimizer: common::adamw(),
        seed: 1,
        packed: false,
    }
}

fn gpt(n_layer: usize, n_embd: usize, vocab_size: usize, block_size: usize) -> Gpt {
    let cfg = GptConfig {
        n_layer,
        n_head: 1,
        n_embd,
        block_size,
        vocab_size,
        padded_vocab_size: None,
    };
    Gpt::new(cfg, block_size)
}

/// GPT-3's sizes on one device: 2.6 TiB per device. The issue saw `kiln train` take
/// 20 GB of host memory before failing; now it is refused before anything is allocated,
/// with the figures and the fix, on the CPU backend (host memory) and on lavapipe
/// (whose largest buffer the embedding's f32 master weights exceed, too).
#[test]
fn a_gpt3_sized_model_is_refused_before_anything_is_allocated() {
    let dir = scratch("gpt3");
    let model = dir.join("gpt3.json");
    std::fs::write(
        &model,
        r#"{"n_layer": 96, "n_head": 96, "n_embd": 12288, "block_size": 2048, "vocab_size": 50257}"#,
    )
    .unwrap();
    let config = dir.join("ds.json");
    std::fs::write(
        &config,
        r#"{"train_micro_batch_size_per_gpu": 1, "fp16": {"enabled": true}}"#,
    )
    .unwrap();
    for device in ["cpu", "vulkan"] {
        let t0 = Instant::now();
        let out = kiln_limited(
            4_000_000,
            &[
                "train",
                "--model",
                model.to_str().unwrap(),
                "--config",
                config.to_str().unwrap(),
                "--devices",
                device,
                "--steps",
                "1",
                "--out",
                dir.join(format!("run-{device}")).to_str().unwrap(),
            ],
        );
        let all = text(&out);
        assert_eq!(out.status.code(), Some(1), "{device}: {all}");
        for want in [
            "does not fit, so nothing was allocated",
            "2.6 TiB per device",
            "f32 master + optimizer 1.9 TiB",
            "the host needs",
            "a smaller model",
        ] {
            assert!(all.contains(want), "{device}: no `{want}` in {all}");
        }
        if device == "vulkan" {
            assert!(all.contains("largest buffer of 2.0 GiB"), "{all}");
            assert!(all.contains("embedding"), "{all}");
        }
        assert!(t0.elapsed() < Duration::from_secs(60), "{device}: {all}");
    }
    std::fs::remove_dir_all(&dir).ok();
}

/// Sizes whose counts overflow or grow without bound are errors naming the setting,
/// from the library (Network, Trainer, the memory estimate) as from the CLI: n_layer
/// 2⁶⁴−1 used to hang building per-layer tables, n_embd 2³² to panic on an overflowed
/// product (abort on a 223 GB allocation in release).
#[test]
fn absurd_sizes_are_errors_not_hangs_or_aborts() {
    let dev = kiln::cpu::CpuDevice::new();
    let t0 = Instant::now();
    let cases: Vec<(Arc<dyn Model>, &str)> = vec![
        (
            Arc::new(gpt(usize::MAX, 4, 16, 8)),
            "n_layer is 18446744073709551615",
        ),
        (
            Arc::new(gpt(kiln::engine::models::MAX_LAYERS + 1, 4, 16, 8)),
            "Kiln builds 1 to 4096 layers",
        ),
        (Arc::new(gpt(1, 1 << 32, 16, 8)), "token embedding"),
        (Arc::new(gpt(1, 1 << 40, 1 << 40, 8)), "token embedding"),
        (Arc::new(gpt(1, 4, usize::MAX, 8)), "token embedding"),
        (
            Arc::new(Llama::new(
                LlamaConfig {
                    n_layer: 2,
                    n_head: 2,
                    n_kv_head: None,
                    n_embd: 1 << 62,
                    block_size: 8,
                    vocab_size: 16,
                    intermediate_size: None,
                    rope_theta: 10000.0,
                    rms_norm_eps: 1e-5,
                    tie_word_embeddings: false,
                    head_dim: None,
                    qkv_bias: false,
                    rope_scaling: None,
                    sliding_window: None,
                    max_position_embeddings: None,
                },
                8,
            )),
            "llama: the token embedding",
        ),
    ];
    for (model, want) in &cases {
        let e = Network::memory(model.as_ref(), &options(1, DType::F16)).unwrap_err();
        assert!(e.to_string().contains(want), "{e}");
        let e = Network::new(&dev, model.clone(), &options(1, DType::F16))
            .err()
            .unwrap();
        assert!(e.to_string().contains(want), "{e}");
        let e = Trainer::new(
            &dev,
            model.clone(),
            common::ds_config(1, 1, DType::F16, 1),
            1,
        )
        .err()
        .unwrap();
        assert!(e.to_string().contains(want), "{e}");
    }
    // A micro-batch whose logits cannot be one tensor is named before it is recorded.
    let e = Network::memory(&gpt(1, 4, 50257, 1024), &options(1 << 20, DType::F16)).unwrap_err();
    assert!(e.to_string().contains("the logits"), "{e}");
    assert!(t0.elapsed() < Duration::from_secs(20), "{:?}", t0.elapsed());
}

/// Any model, through the generic path: a parameter shape whose element count
/// overflows is an error naming it (it was a multiply-overflow panic).
#[test]
fn a_models_overflowing_parameter_shape_is_an_error_naming_it() {
    struct Huge;
    impl Model for Huge {
        fn describe(&self) -> String {
            "huge".into()
        }
        fn parameters(&self) -> Vec<ParamSpec> {
            vec![ParamSpec::new(
                "w",
                &[usize::MAX / 2, 4, 3],
                Init::Const(0.0),
            )]
        }
        fn forward(
            &self,
            _: &mut kiln::engine::graph::Graph,
            _: &[kiln::engine::graph::Tensor],
            _: usize,
            _: DType,
        ) -> kiln::engine::Result<Forward> {
            unreachable!("the parameters are refused first")
        }
    }
    let e = Network::memory(&Huge, &options(1, DType::F32)).unwrap_err();
    let msg = e.to_string();
    assert!(
        msg.contains("parameter `w`") && msg.contains("one tensor may hold"),
        "{msg}"
    );
    let dev = kiln::cpu::CpuDevice::new();
    let e = Network::new(&dev, Arc::new(Huge), &options(1, DType::F32))
        .err()
        .unwrap();
    assert!(e.to_string().contains("parameter `w`"), "{e}");
}

/// The embedding lookup binds its table whole: a table larger than the adapter's
/// per-binding limit used to be found out at the first step, after every buffer was
/// allocated and the plan compiled. `Network::new` refuses it; the same model in fp16
/// (half the table) builds and trains on the same device, its f32 master weights and
/// moments, twice the limit, updated band by band (tests/bands.rs).
#[test]
fn an_embedding_table_over_the_binding_limit_is_refused_at_build() {
    let limit = 1 << 20;
    let dev = WgpuDevice::open(
        find_adapter("vulkan").unwrap(),
        &DeviceOptions {
            max_storage_binding: Some(limit),
            ..Default::default()
        },
    )
    .unwrap();
    // wte: 8192 x 64 = 2 MiB in f32, 1 MiB in f16.
    let gpt = || {
        Arc::new(Gpt::new(
            GptConfig {
                n_layer: 1,
                n_head: 2,
                n_embd: 64,
                block_size: 8,
                vocab_size: 8192,
                padded_vocab_size: None,
            },
            8,
        ))
    };
    let e = Network::new(&dev, gpt(), &options(1, DType::F32))
        .err()
        .unwrap();
    let msg = e.to_string();
    assert!(msg.contains("per-binding limit of 1.0 MiB"), "{msg}");
    assert!(msg.contains("(a parameter tensor)"), "{msg}");
    assert!(msg.contains("a smaller largest parameter tensor"), "{msg}");
    assert_eq!(dev.allocated_bytes(), 0, "{msg}");
    let mut net = Network::new(&dev, gpt(), &options(1, DType::F16)).unwrap();
    let batch = MicroBatch::tokens(&[1, 2, 3, 4, 5, 6, 7, 8], &[2, 3, 4, 5, 6, 7, 8, 9]);
    net.accumulate(&dev, &[batch], 1.0).unwrap();
    let (overflow, loss) = net.check(&dev, 0.0).unwrap();
    net.update(&dev, 1e-3).unwrap();
    assert!(!overflow && loss.is_finite(), "{loss}");
}

fn caps(name: &str, device_type: &str, budget: Option<u64>) -> Capabilities {
    Capabilities {
        name: name.into(),
        backend: "vulkan".into(),
        device_type: device_type.into(),
        vendor: 0,
        driver: String::new(),
        f16_arithmetic: true,
        subgroup_sizes: None,
        timestamp_queries: false,
        max_storage_binding: 1 << 30,
        max_buffer: 1 << 32,
        memory_budget: budget,
        memory_heap: None,
        memory_limit: None,
    }
}

/// A ZeRO group's check: the network without its optimizer state beside its shard.
/// The whole state's f32 arena leaves the largest buffer, the shard's largest f32
/// slice enters it (a device that cannot allocate it is refused, not left to fail in
/// the allocator), the shard's bytes replace the optimizer's, and offloaded bytes are
/// the host's.
#[test]
fn a_zero_group_is_checked_with_its_shards_buffers() {
    use kiln::engine::models::ShardBytes;
    let mib = 1u64 << 20;
    let m = NetworkMemory {
        weights: 100 * mib,
        gradients: 100 * mib,
        optimizer: 600 * mib,
        activations: 50 * mib,
        largest_buffer: 400 * mib,
        largest_parameter_buffer: 400 * mib,
        largest_plan_buffer: 30 * mib,
        largest_stateless_buffer: 100 * mib,
        host: 800 * mib,
        ..Default::default()
    };
    let slice = ShardBytes {
        device: 350 * mib,
        host: 0,
        largest: 200 * mib,
    };
    let z = m.with_shards(slice);
    assert_eq!(
        z.total(),
        250 * mib + DType::F32.padded_bytes(0) + 350 * mib
    );
    assert_eq!(
        (z.largest_buffer, z.largest_parameter_buffer),
        (200 * mib, 200 * mib)
    );
    let mut small = caps("small", "discrete", Some(gib_of(4)));
    small.max_buffer = 150 * mib;
    let e = z
        .check_fit("model", DType::F16, &[&small], None)
        .unwrap_err()
        .to_string();
    assert!(e.contains("its largest buffer, 200.0 MiB"), "{e}");
    small.max_buffer = 250 * mib;
    z.check_fit("model", DType::F16, &[&small], None).unwrap();
    // Offloaded: no optimizer bytes on the device beyond the empty buffer, the host's
    // peak raised by the offloaded slices.
    let off = m.with_shards(ShardBytes {
        device: 0,
        host: 300 * mib,
        largest: 0,
    });
    assert_eq!(off.optimizer, DType::F32.padded_bytes(0));
    assert_eq!((off.largest_buffer, off.host), (100 * mib, 1100 * mib));
}

fn gib_of(n: u64) -> u64 {
    n << 30
}

/// Each limit the check knows, with the fix that helps against it: a driver's memory
/// budget, the host (where CPU adapters' replicas add up), f32 storage and an
/// activation-heavy model; a model that fits passes.
#[test]
fn the_memory_check_names_each_limit_and_the_fix_that_helps() {
    let gib = 1u64 << 30;
    let m = NetworkMemory {
        weights: gib,
        gradients: gib,
        optimizer: 6 * gib,
        activations: 8 * gib,
        largest_buffer: 1 << 20,
        largest_parameter_buffer: 1 << 20,
        largest_binding: 1 << 20,
        host: 7 * gib,
        ..Default::default()
    };
    let gpu = caps("big gpu", "discrete", Some(12 * gib));
    let e = m
        .check_fit("model", DType::F32, &[&gpu], Some(64 * gib))
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("16.0 GiB per device is over `big gpu` (vulkan)'s memory budget of 12.0 GiB"),
        "{e}"
    );
    assert!(e.contains("a smaller micro-batch"), "{e}");
    assert!(e.contains("fp16 or bf16"), "{e}");
    assert!(e.contains("ZeRO stage 1 or 2 over more devices"), "{e}");
    assert!(e.contains("offload_optimizer"), "{e}");
    assert!(!e.contains("host needs"), "{e}");

    // The same on a 32 GiB budget fits; fp16 storage is not advised where it is used.
    let roomy = caps("big gpu", "discrete", Some(32 * gib));
    m.check_fit("model", DType::F32, &[&roomy], Some(64 * gib))
        .unwrap();
    // Three replicas on a CPU adapter share the host: 7 + 3 × 16 GiB.
    let cpu = caps("llvmpipe", "cpu", None);
    let e = m
        .check_fit("model", DType::F16, &[&cpu, &cpu, &cpu], Some(40 * gib))
        .unwrap_err()
        .to_string();
    assert!(e.contains("the host needs 55.0 GiB"), "{e}");
    assert!(e.contains("3 × 16.0 GiB"), "{e}");
    assert!(e.contains("fewer devices on a CPU adapter"), "{e}");
    assert!(!e.contains("fp16 or bf16"), "{e}");
    // Unknown host memory and no budget: nothing to refuse on.
    m.check_fit("model", DType::F16, &[&cpu], None).unwrap();
}

/// Without a budget a GPU's device-local heap bounds a run, naming LoRA and
/// checkpointing among the fixes; a CPU driver's heap (lavapipe's 2 GiB) is nominal
/// and bounds nothing (the host check does); a memory limit replaces budget and heap
/// alike, larger or smaller, and is named as such; a LoRA network (frozen base) is not
/// told to use LoRA.
#[test]
fn a_gpu_heap_bounds_a_run_and_a_memory_limit_replaces_budget_and_heap() {
    let gib = 1u64 << 30;
    let m = NetworkMemory {
        weights: gib,
        gradients: gib,
        optimizer: 4 * gib,
        activations: 2 * gib,
        largest_buffer: 1 << 20,
        largest_parameter_buffer: 1 << 20,
        largest_binding: 1 << 20,
        host: gib,
        ..Default::default()
    };
    let refused = |m: &NetworkMemory, c: &Capabilities| {
        m.check_fit("model", DType::F16, &[c], Some(64 * gib))
            .unwrap_err()
            .to_string()
    };
    let mut gpu = caps("gpu", "discrete", None);
    gpu.memory_heap = Some(6 * gib);
    let e = refused(&m, &gpu);
    assert!(
        e.contains(
            "8.0 GiB per device is over `gpu` (vulkan)'s device-local memory heap of 6.0 GiB"
        ),
        "{e}"
    );
    assert!(e.contains("LoRA (`--lora`"), "{e}");
    assert!(e.contains("activation checkpointing"), "{e}");
    // A limit over the heap lets it run (a driver that pages device memory out); one
    // under the need refuses, naming the flag.
    m.check_fit(
        "model",
        DType::F16,
        &[&gpu.clone().with_memory_limit(Some(9 * gib))],
        Some(64 * gib),
    )
    .unwrap();
    let e = refused(&m, &gpu.with_memory_limit(Some(7 * gib)));
    assert!(e.contains("--memory-limit of 7.0 GiB"), "{e}");
    // lavapipe: a 2 GiB heap, device memory in host memory; the limit holds it to a size.
    let mut lavapipe = caps("llvmpipe", "cpu", None);
    lavapipe.memory_heap = Some(2 * gib);
    m.check_fit("model", DType::F16, &[&lavapipe], Some(64 * gib))
        .unwrap();
    let held = lavapipe.clone().with_memory_limit(Some(2 * gib));
    let e = refused(&m, &held);
    assert!(e.contains("--memory-limit of 2.0 GiB"), "{e}");
    // A reported budget wins over the heap.
    let mut budgeted = caps("gpu", "discrete", Some(5 * gib));
    budgeted.memory_heap = Some(16 * gib);
    let e = refused(&m, &budgeted);
    assert!(e.contains("memory budget of 5.0 GiB"), "{e}");
    // A LoRA network over the limit is not told to use LoRA.
    let lora = NetworkMemory {
        frozen: 3 * gib,
        ..m
    };
    let e = refused(&lora, &held);
    assert!(e.contains("frozen base 3.0 GiB"), "{e}");
    assert!(!e.contains("LoRA (`--lora`"), "{e}");
}

/// `--devices vulkan:0x100` used to open 100 devices and compile for minutes (and a
/// count of 2⁶⁴−1 to grow memory without end); `metal` on Linux suggested installing
/// Mesa. Both are refused at parse time with what to do instead.
#[test]
fn device_counts_are_capped_and_missing_backends_say_so() {
    use kiln::devices::{os_backends, parse_devices, MAX_DEVICES};
    let items = |s: &str| vec![s.to_string()];
    for spec in ["vulkan:0x100", "vulkan:0x18446744073709551615", "cpux65"] {
        let e = parse_devices(&items(spec)).unwrap_err().to_string();
        assert!(e.contains(&format!("at most {MAX_DEVICES}")), "{spec}: {e}");
    }
    let many: Vec<String> = (0..MAX_DEVICES + 1).map(|_| "cpu".to_string()).collect();
    let e = parse_devices(&many).unwrap_err().to_string();
    assert!(e.contains("names 65 devices"), "{e}");
    assert_eq!(parse_devices(&items("cpux64")).unwrap().len(), 64);

    let absent = ["metal", "dx12", "vulkan", "gl"]
        .into_iter()
        .find(|b| !os_backends().contains(b))
        .expect("no system has every backend");
    let e = parse_devices(&items(absent)).unwrap_err().to_string();
    assert!(e.contains("does not exist on"), "{e}");
    assert!(e.contains(&os_backends().join(", ")), "{e}");
    assert!(!e.contains("apt-get"), "{e}");
    // Through the CLI too.
    let out = kiln(&["train", "--devices", absent, "--steps", "1"]);
    assert_eq!(out.status.code(), Some(1), "{}", text(&out));
    assert!(text(&out).contains("does not exist on"), "{}", text(&out));
}

/// Benchmarks refuse what has no rate (a size of 0, a bandwidth of 0) or cannot fit
/// (an operand over what a kernel indexes, over the host's memory) before measuring:
/// they printed NaN and 0% rows, or aborted on a 40 GB allocation.
#[test]
fn benches_refuse_empty_and_oversized_work_up_front() {
    let run = |args: &[&str]| {
        let out = kiln_limited(4_000_000, args);
        assert_eq!(out.status.code(), Some(1), "{args:?}: {}", text(&out));
        assert!(!text(&out).contains("NaN"), "{args:?}: {}", text(&out));
        text(&out)
    };
    let m = |size: &str, dtype: &str| {
        run(&[
            "bench",
            "matmul",
            "--devices",
            "vulkan",
            "--dtypes",
            dtype,
            "--sizes",
            size,
            "--budget-ms",
            "1",
        ])
    };
    assert!(m("0", "f32").contains("at least 1"));
    let e = m("100000", "f16");
    assert!(e.contains("over the 4294967295 a kernel indexes"), "{e}");
    let e = m("40000", "f32");
    assert!(e.contains("largest buffer"), "{e}");
    // Fits the adapter in f16, but the CPU reference alone needs 3 × 3.6 GB.
    let e = m("30000", "f16");
    assert!(e.contains("of host memory"), "{e}");
    let e = run(&["bench", "dp", "--pcie-gbps", "0"]);
    assert!(
        e.contains("--pcie-gbps 0: a bandwidth must be a positive number"),
        "{e}"
    );
    let e = run(&["bench", "dp", "--host-gbps=-3"]);
    assert!(e.contains("--host-gbps -3"), "{e}");
    let e = run(&["bench", "dp", "--counts", "1,65"]);
    assert!(e.contains("at most 64"), "{e}");
    let e = run(&["bench", "attention", "--devices", "vulkan", "--seqs", "0"]);
    assert!(e.contains("at least 1"), "{e}");
    let e = run(&[
        "bench",
        "attention",
        "--devices",
        "vulkan",
        "--seqs",
        "10000000",
    ]);
    assert!(e.contains("largest buffer"), "{e}");
}

/// Plans are measured in time linear in depth: the per-parameter scans of backward
/// and of the live buffers made 2048 layers take most of a minute (and the layer cap
/// would have let a config ask for hours).
#[test]
fn a_deep_model_is_measured_quickly() {
    let t0 = Instant::now();
    let m = Network::memory(&gpt(2048, 4, 16, 8), &options(1, DType::F32)).unwrap();
    assert!(m.total() > 0);
    assert!(t0.elapsed() < Duration::from_secs(10), "{:?}", t0.elapsed());
}

fn step(step: u64, tokens_per_s: f64, step_ms: f64) -> StepRecord {
    StepRecord {
        step,
        loss: 3.0 - step as f32 * 0.01,
        lr: 1e-3,
        loss_scale: 1.0,
        tokens_per_s,
        step_ms,
        ..Default::default()
    }
}

/// A resumed run compiles its kernels again; that step is not throughput. Two runs of
/// one config, one interrupted and resumed, used to differ 5.5× in tokens/s; runs of
/// different lengths were "config: identical" with nothing said about the length.
#[test]
fn runs_diff_leaves_restarts_out_of_throughput_and_names_different_lengths() {
    let root = scratch("diff");
    let config = serde_json::json!({"deepspeed": {"lr": 0.001}, "seed": 1});
    // Each part is one process: (first step, last step + 1).
    let write = |name: &str, parts: &[(u64, u64)]| {
        let dir = root.join(name);
        write_config(&dir, &config).unwrap();
        for (i, &(start, end)) in parts.iter().enumerate() {
            let mut w = if i == 0 {
                MetricsWriter::create(&dir).unwrap()
            } else {
                MetricsWriter::resume(&dir, start - 1).unwrap()
            };
            for s in start..end {
                // Each process's first step compiles: 100x slower.
                let ms = if s == start { 2000.0 } else { 20.0 };
                w.append(&step(s, 1000.0 * 20.0 / ms, ms)).unwrap();
            }
        }
        dir
    };
    let a = write("a", &[(1, 41)]);
    let b = write("b", &[(1, 21), (21, 41)]);
    let records = read_metrics(&b).unwrap();
    assert!(records[0].started && records[20].started, "{records:?}");
    assert_eq!(records.iter().filter(|r| r.started).count(), 2);
    let s = Summary::from_records(&records, 5);
    assert_eq!(s.warmup_steps_excluded, 10);
    assert!(
        (s.mean_tokens_per_s.unwrap() - 1000.0).abs() < 1e-6,
        "{s:?}"
    );
    let d = diff_runs(&a, &b).unwrap();
    let ratio = d.tokens_per_s_ratio().unwrap();
    assert!((ratio - 1.0).abs() < 1e-9, "{ratio}\n{d}");
    assert!(d.to_string().contains("config: identical\n"), "{d}");

    let short = write("short", &[(1, 11)]);
    let d = diff_runs(&a, &short).unwrap();
    let shown = d.to_string();
    assert!(
        shown.contains(
            "config: identical, but the runs ran different numbers of steps (A 40, B 10)"
        ),
        "{shown}"
    );
    assert!(
        shown.contains("at step 10, the last both ran, the loss was A 2.9000, B 2.9000"),
        "{shown}"
    );
    std::fs::remove_dir_all(&root).ok();
}

/// An adapter's out-of-memory error gives advice that applies to training (it said
/// "split the tensor", which a user of `kiln train` cannot do).
#[test]
fn out_of_memory_errors_advise_what_a_user_can_change() {
    let dev = common::gpu("vulkan", false);
    let too_big = (dev.caps().max_buffer / 4 + 1) as usize;
    let e = dev.alloc(DType::F32, too_big).unwrap_err();
    assert!(matches!(e, Error::OutOfMemory { .. }), "{e}");
    let msg = e.to_string();
    assert!(!msg.contains("split the tensor"), "{msg}");
    assert!(
        msg.contains("micro-batch") && msg.contains("kiln estimate"),
        "{msg}"
    );
}

/// `kiln estimate` says what `kiln train` would do on the devices named: the same
/// refusal (the binding limit GPT-2 small's f32 token embedding, 154 MB, exceeds on
/// lavapipe: the lookup binds its table whole), or that it fits (in fp16 the table
/// is 77 MB; the f32 master weights and moments are updated band by band).
#[test]
fn estimate_gives_trains_verdict() {
    let dir = scratch("estimate");
    let model = dir.join("gpt2.json");
    std::fs::write(
        &model,
        r#"{"n_layer": 2, "n_head": 12, "n_embd": 768, "block_size": 64, "vocab_size": 50257}"#,
    )
    .unwrap();
    let out = kiln(&[
        "estimate",
        "--model",
        model.to_str().unwrap(),
        "--devices",
        "vulkan",
    ]);
    assert!(
        text(&out).contains("kiln train on these 1 device(s) and this host: fits"),
        "{}",
        text(&out)
    );
    let fp32 = dir.join("fp32.json");
    std::fs::write(&fp32, r#"{"train_micro_batch_size_per_gpu": 1}"#).unwrap();
    let out = kiln(&[
        "estimate",
        "--model",
        model.to_str().unwrap(),
        "--config",
        fp32.to_str().unwrap(),
        "--devices",
        "vulkan",
    ]);
    let all = text(&out);
    assert!(out.status.success(), "{all}");
    assert!(
        all.contains("kiln train on these 1 device(s) and this host: refused"),
        "{all}"
    );
    assert!(all.contains("per-binding limit of 128.0 MiB"), "{all}");
    let out = kiln(&[
        "estimate",
        "--model",
        model.to_str().unwrap(),
        "--devices",
        "cpu",
    ]);
    assert!(
        text(&out).contains("kiln train on these 1 device(s) and this host: fits"),
        "{}",
        text(&out)
    );
    std::fs::remove_dir_all(&dir).ok();
}

/// End to end: `kiln train` marks each process's first step, so a run resumed halfway
/// leaves the warm-up steps of both starts out of its summary's throughput.
#[test]
fn a_resumed_runs_summary_leaves_out_each_starts_warm_up() {
    let dir = scratch("resume-throughput");
    let model = dir.join("model.json");
    std::fs::write(
        &model,
        r#"{"n_layer": 1, "n_head": 2, "n_embd": 16, "block_size": 9, "vocab_size": 13}"#,
    )
    .unwrap();
    let config = dir.join("ds.json");
    std::fs::write(&config, r#"{"train_micro_batch_size_per_gpu": 4}"#).unwrap();
    let out_dir = dir.join("run");
    for (steps, resume) in [("6", false), ("12", true)] {
        let mut args = vec![
            "train",
            "--config",
            config.to_str().unwrap(),
            "--model",
            model.to_str().unwrap(),
            "--devices",
            "vulkan",
            "--steps",
            steps,
            "--eval-every",
            "0",
            "--out",
            out_dir.to_str().unwrap(),
        ];
        if resume {
            args.push("--resume");
        }
        let out = kiln(&args);
        assert!(out.status.success(), "{}", text(&out));
    }
    let records = read_metrics(&out_dir).unwrap();
    let starts: Vec<u64> = records
        .iter()
        .filter(|r| r.started)
        .map(|r| r.step)
        .collect();
    assert_eq!(starts, [1, 7], "{records:?}");
    let summary = Summary::read(&out_dir).unwrap();
    assert_eq!(summary.warmup_steps_excluded, 10, "{summary:?}");
    std::fs::remove_dir_all(&dir).ok();
}
