//! `kiln bench train` on lavapipe with a tiny model: the figures are positive, a step
//! is never faster than its own GEMMs, the JSON has every field; bad input is refused
//! with the fix before any device is opened.

use std::process::Command;
use std::time::Duration;

use kiln::bench_train::{bench_model, measure, precision_config, TrainBenchOptions, Variant};
use kiln::wgpu::{find_adapter, DeviceOptions, WgpuDevice};

fn scratch(name: &str) -> std::path::PathBuf {
    let d = std::env::temp_dir().join(format!("kiln-bench-train-{name}-{}", std::process::id()));
    std::fs::remove_dir_all(&d).ok();
    std::fs::create_dir_all(&d).unwrap();
    d
}

#[test]
fn a_tiny_model_measures_positive_and_no_faster_than_its_gemms() {
    let dir = scratch("tiny");
    let model = dir.join("tiny.json");
    std::fs::write(
        &model,
        r#"{"n_layer": 2, "n_head": 2, "n_embd": 32, "block_size": 16, "vocab_size": 64}"#,
    )
    .unwrap();
    let m = bench_model(model.to_str().unwrap(), Some(4)).unwrap();
    assert_eq!(m.micro_batch, 4);
    let options = DeviceOptions {
        pipeline_cache_dir: Some(dir.join("pipelines")),
        ..DeviceOptions::default()
    };
    let dev = WgpuDevice::open(find_adapter("vulkan").unwrap(), &options).unwrap();
    let mut opts = TrainBenchOptions {
        variant: Variant::parse("full").unwrap(),
        lora: kiln::engine::models::lora::LoraConfig::parse_flag("r=4").unwrap(),
        steps: 2,
        gemm_budget: Duration::from_millis(20),
        // 1 GFLOP/s: the MFU must be computed against it, not any cached peak.
        peak_tflops: Some(0.001),
    };
    let r = measure(&dev, &m, "fp32", &opts).unwrap();
    // LoRA with activation checkpointing: the adapters' elements trained (at this size
    // the adapters' activations outweigh what the frozen base saves: no memory claim).
    opts.variant = Variant::parse("lora+ckpt").unwrap();
    let small = measure(&dev, &m, "fp32", &opts).unwrap();
    assert_eq!(
        (r.variant.as_str(), small.variant.as_str()),
        ("full", "lora+ckpt")
    );
    assert_eq!(r.trained, r.parameters);
    assert!(
        small.trained < r.parameters / 4,
        "{} of {}",
        small.trained,
        r.parameters
    );
    assert!(small.memory_bytes > 0 && small.step_ms > 0.0);
    assert!(Variant::parse("half")
        .unwrap_err()
        .to_string()
        .contains("lora+ckpt"));
    opts.variant = Variant::parse("full").unwrap();
    for (what, x) in [
        ("first_step_s", r.first_step_s),
        ("step_ms", r.step_ms),
        ("tokens_per_s", r.tokens_per_s),
        ("step_gflop", r.step_gflop),
        ("achieved_gflops", r.achieved_gflops),
        ("gemm_bound_ms", r.gemm_bound_ms),
    ] {
        assert!(x.is_finite() && x > 0.0, "{what} = {x}");
    }
    assert!(r.memory_bytes > 0);
    assert!(r.parameters > 12 * 32 * 32, "{} parameters", r.parameters);
    assert_eq!((r.seq, r.micro_batch), (16, 4));
    assert!((r.tokens_per_s - 64.0 / (r.step_ms / 1e3)).abs() < 1e-6 * r.tokens_per_s);
    // Forward, input and weight gradients of the four projections and the LM head at
    // least; each distinct one timed once.
    assert!(r.gemm_launches >= 12, "{} GEMM launches", r.gemm_launches);
    assert!(r.gemm_shapes >= 3 && r.gemm_shapes <= r.gemm_launches);
    assert!(
        r.step_over_gemm >= 1.0,
        "a step of {} ms beat its GEMMs' {} ms",
        r.step_ms,
        r.gemm_bound_ms
    );
    assert!((r.step_over_gemm - r.step_ms / r.gemm_bound_ms).abs() < 1e-9);
    assert_eq!(r.peak_gflops, Some(1.0));
    assert!((r.mfu.unwrap() - r.achieved_gflops).abs() < 1e-9);
    let json = serde_json::to_value(&r).unwrap();
    for field in [
        "model",
        "parameters",
        "adapter",
        "backend",
        "precision",
        "micro_batch",
        "seq",
        "first_step_s",
        "step_ms",
        "tokens_per_s",
        "step_gflop",
        "achieved_gflops",
        "peak_gflops",
        "mfu",
        "memory_bytes",
        "gemm_launches",
        "gemm_shapes",
        "gemm_bound_ms",
        "step_over_gemm",
    ] {
        assert!(json.get(field).is_some(), "no `{field}` in {json}");
    }
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn unknown_models_and_precisions_are_refused_with_the_choices() {
    let e = bench_model("huge", None).unwrap_err().to_string();
    assert!(
        e.contains("unknown model `huge`") && e.contains("small, demo, gpt2") && e.contains("JSON"),
        "{e}"
    );
    let e = precision_config("fp8").unwrap_err().to_string();
    assert!(
        e.contains("unknown precision `fp8`") && e.contains("fp32, fp16 or bf16"),
        "{e}"
    );
    let e = bench_model("small", Some(0)).unwrap_err().to_string();
    assert!(e.contains("--micro-batch 0"), "{e}");
    for name in ["small", "demo", "gpt2"] {
        bench_model(name, None).unwrap();
    }
    // --activation-checkpointing: each variant, then its checkpointed twin, once each.
    let names = |list: &[&str], ckpt: bool| -> Vec<&'static str> {
        let list: Vec<String> = list.iter().map(|s| s.to_string()).collect();
        kiln::bench_train::variants(&list, ckpt)
            .unwrap()
            .iter()
            .map(|v| v.name())
            .collect()
    };
    assert_eq!(
        names(&["full", "lora"], true),
        ["full", "ckpt", "lora", "lora+ckpt"]
    );
    assert_eq!(names(&["full", "ckpt"], true), ["full", "ckpt"]);
    assert_eq!(names(&["lora", "full"], false), ["lora", "full"]);
    assert!(kiln::bench_train::variants(&["half".into()], true).is_err());
    // The command checks everything before it opens a device or compiles anything.
    for (args, want) in [
        (&["--model", "huge"][..], "unknown model `huge`"),
        (&["--precision", "fp32,fp8"][..], "unknown precision `fp8`"),
        (&["--peak-tflops=0"][..], "--peak-tflops 0"),
    ] {
        let out = Command::new(env!("CARGO_BIN_EXE_kiln"))
            .args(["bench", "train"])
            .args(args)
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{args:?}: {err}");
        assert!(err.contains(want), "{args:?}: {err}");
        assert!(!err.contains("panicked"), "{err}");
    }
}
