//! `kiln bench report` on lavapipe through wgpu (Vulkan), llvmpipe's GL, raw Vulkan
//! (`vk:0`) and the CPU reference, quick and on a short budget: every section has a
//! row per device, every number is a measurement (positive, finite) and agrees with
//! the others it is derived from (GFLOP/s with the peak and the CPU sgemm of the same
//! run, attention's rate with its time, tokens/s with the step time), and the commit
//! is the checkout's.

use std::process::Command;

use serde_json::Value;

/// As given, and as the report names them (`kiln devices`' specs).
const DEVICES: [&str; 4] = ["vulkan:0", "gl", "vk:0", "cpu"];
const SPECS: [&str; 4] = ["vulkan:0", "gl:0", "vk:0", "cpu"];

fn close(a: f64, b: f64, what: &str) {
    assert!(
        (a - b).abs() <= 1e-6 * a.abs().max(b.abs()).max(1e-12),
        "{what}: {a} vs {b}"
    );
}

fn num(v: &Value, key: &str) -> f64 {
    let x = v[key]
        .as_f64()
        .unwrap_or_else(|| panic!("`{key}` is not a number in {v}"));
    assert!(x.is_finite() && x > 0.0, "`{key}` = {x} in {v}");
    x
}

#[test]
fn a_quick_report_measures_every_backend_in_every_section() {
    let out_dir = std::env::temp_dir().join(format!("kiln-bench-report-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&out_dir);
    let out = Command::new(env!("CARGO_BIN_EXE_kiln"))
        .args([
            "bench",
            "report",
            "--quick",
            "--budget-ms",
            "20",
            "--devices",
        ])
        .arg(DEVICES.join(","))
        .arg("--out")
        .arg(&out_dir)
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{err}");
    let r: Value =
        serde_json::from_str(&std::fs::read_to_string(out_dir.join("report.json")).unwrap())
            .unwrap();

    // The host, and the commit as git says it (a build outside a checkout: unknown).
    let git = Command::new("git")
        .args(["rev-parse", "--short", "HEAD"])
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .output()
        .ok()
        .filter(|o| o.status.success())
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string());
    let commit = r["host"]["kiln_commit"].as_str().unwrap();
    match git {
        Some(head) => assert!(commit.starts_with(&head), "{commit} vs HEAD {head}"),
        None => assert_eq!(commit, "unknown"),
    }
    assert!(!r["host"]["cpu"].as_str().unwrap().is_empty());

    // Devices in the order given; the Vulkan ones report their heap; a wgpu adapter's
    // peak is measured, and vk:0 (the same lavapipe) takes the wgpu Vulkan adapter's.
    let devices = r["devices"].as_array().unwrap();
    let specs: Vec<&str> = devices
        .iter()
        .map(|d| d["spec"].as_str().unwrap())
        .collect();
    assert_eq!(specs, SPECS);
    let peak =
        |spec: &str| devices.iter().find(|d| d["spec"] == spec).unwrap()["peak_gflops"].as_f64();
    for spec in ["vulkan:0", "gl:0"] {
        assert!(peak(spec).is_some_and(|p| p > 0.0), "{spec}");
    }
    assert_eq!(peak("vk:0"), peak("vulkan:0"));
    assert_eq!(peak("cpu"), None);
    assert!(devices[0]["memory_heap"].as_u64().is_some());
    assert_eq!(devices[0]["memory_heap"], devices[2]["memory_heap"]);

    // GEMM: 4 shapes x 3 dtypes per device, each rate consistent with the peak and the
    // CPU sgemm measured for its shape in this run.
    let sgemm = r["cpu_sgemm"].as_array().unwrap();
    assert_eq!(sgemm.len(), 4);
    let gemm = r["gemm"].as_array().unwrap();
    assert_eq!(gemm.len(), DEVICES.len() * 4 * 3);
    for g in gemm {
        let spec = g["spec"].as_str().unwrap();
        let gflops = num(g, "gflops");
        let what = format!(
            "{} {}x{}x{} {}",
            g["shape"].as_str().unwrap(),
            g["m"],
            g["n"],
            g["k"],
            g["op"].as_str().unwrap()
        );
        let cpu = sgemm
            .iter()
            .find(|s| s[0] == what.as_str())
            .unwrap_or_else(|| panic!("no CPU sgemm for {what}"))[1]
            .as_f64()
            .unwrap();
        close(num(g, "vs_cpu_sgemm"), gflops / cpu, &what);
        match peak(spec) {
            Some(p) => close(num(g, "pct_of_peak"), 100.0 * gflops / p, &what),
            None => assert!(g["pct_of_peak"].is_null()),
        }
        if spec == "cpu" {
            assert_eq!(g["kernel"], "reference");
        }
    }

    // Attention: one sequence length per device; the rate is 7 T^2 D per head.
    let attention = r["attention"].as_array().unwrap();
    assert_eq!(attention.len(), DEVICES.len());
    for a in attention {
        let (t, d, h) = (num(a, "seq"), num(a, "dim"), num(a, "heads"));
        close(
            num(a, "gflops"),
            7.0 * t * t * d * h / (num(a, "fused_ms") * 1e-3) / 1e9,
            "attention",
        );
    }

    // Training: the demo's step on each device; tokens/s is the step's tokens over its
    // time.
    let train = r["train"].as_array().unwrap();
    assert_eq!(train.len(), DEVICES.len());
    for t in train {
        assert_eq!(t["model"], "demo");
        let tokens = num(t, "micro_batch") * num(t, "seq");
        close(
            num(t, "tokens_per_s"),
            tokens / (num(t, "step_ms") * 1e-3),
            "tokens/s",
        );
    }
    assert_eq!(
        r["not_measured"].as_array().unwrap().len(),
        0,
        "{}",
        r["not_measured"]
    );

    // The Markdown has every section with a row per device, the SVG a bar per device
    // and dtype at the square shape.
    let md = std::fs::read_to_string(out_dir.join("report.md")).unwrap();
    for section in [
        "## Host",
        "## Devices",
        "## GEMM",
        "## Attention",
        "## Training",
        "## Not measured",
    ] {
        assert!(md.contains(section), "{section} missing:\n{md}");
    }
    for spec in SPECS {
        let rows = md
            .lines()
            .filter(|l| l.starts_with(&format!("| {spec} |")))
            .count();
        // Devices 1, GEMM 12, attention 1, training 1.
        assert_eq!(rows, 15, "{spec}:\n{md}");
    }
    let svg = std::fs::read_to_string(out_dir.join("report.svg")).unwrap();
    assert!(svg.starts_with("<svg"), "{svg}");
    assert_eq!(svg.matches("<rect").count(), 1 + DEVICES.len() * 3, "{svg}");
    std::fs::remove_dir_all(&out_dir).unwrap();
}
