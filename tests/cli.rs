//! The `kiln` binary as a user runs it.

use std::process::Command;

fn kiln(args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_kiln"))
        .args(args)
        .output()
        .expect("run kiln")
}

#[test]
fn devices_json_lists_the_lavapipe_and_gl_adapters() {
    let out = kiln(&["devices", "--json"]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let list: serde_json::Value = serde_json::from_slice(&out.stdout).expect("JSON");
    let list = list.as_array().expect("an array");
    let backends: Vec<&str> = list
        .iter()
        .map(|d| d["backend"].as_str().unwrap())
        .collect();
    assert!(
        backends.contains(&"vulkan"),
        "{backends:?}: no Vulkan adapter; install mesa-vulkan-drivers"
    );
    assert!(backends.contains(&"gl"), "{backends:?}");
    assert_eq!(backends.last(), Some(&"cpu"));
    let vk = list.iter().find(|d| d["backend"] == "vulkan").unwrap();
    assert_eq!(vk["f16_arithmetic"], true);
    assert!(vk["max_storage_binding"].as_u64().unwrap() >= 1 << 27);
    // The same device through the raw Vulkan backend, named `vk:0`.
    let raw = list
        .iter()
        .find(|d| d["spec"] == "vk:0")
        .unwrap_or_else(|| panic!("no vk:0 in {backends:?}"));
    assert_eq!(raw["backend"], "vk");
    assert_eq!(raw["name"], vk["name"]);
    // The device-local heap, asked of the driver through wgpu's Vulkan instance and
    // through Kiln's own: one number, reported (lavapipe's: 2 GiB on Mesa 22).
    let heap = vk["memory_heap"]
        .as_u64()
        .expect("the Vulkan adapter's heap");
    assert!(heap >= 1 << 30, "{heap}");
    assert_eq!(raw["memory_heap"].as_u64(), Some(heap));
    let gl = list.iter().find(|d| d["backend"] == "gl").unwrap();
    assert!(gl["memory_heap"].is_null(), "{gl}");
    // The table's memory column says the same.
    let out = kiln(&["devices"]);
    let table = String::from_utf8_lossy(&out.stdout);
    let shown = format!("{:.1} GiB", heap as f64 / (1u64 << 30) as f64);
    let row = table.lines().find(|l| l.starts_with("vk:0")).unwrap();
    assert!(row.contains(&shown), "{row} / {shown}");
}

#[test]
fn bench_matmul_json_has_the_documented_fields_and_real_numbers() {
    let path = std::env::temp_dir().join(format!("kiln-bench-{}.json", std::process::id()));
    let out = kiln(&[
        "bench",
        "matmul",
        "--devices",
        "vulkan",
        "--dtypes",
        "f16",
        "--sizes",
        "96",
        "--budget-ms",
        "20",
        "--json",
        path.to_str().unwrap(),
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let rows: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    std::fs::remove_file(&path).ok();
    let rows = rows.as_array().unwrap();
    // The planner's kernel, the naive baseline, and the Device path's (a product this
    // small keeps the table's block: timing blocks could not pay for itself).
    assert_eq!(rows.len(), 3, "{rows:?}");
    assert_eq!(rows[1]["variant"], "naive");
    assert_eq!(
        rows[2]["variant"],
        format!(
            "table {} (too small to measure)",
            rows[0]["variant"].as_str().unwrap()
        )
    );
    for r in rows {
        for field in [
            "adapter",
            "dtype",
            "m",
            "n",
            "k",
            "variant",
            "gflops",
            "cpu_gflops",
        ] {
            assert!(!r[field].is_null(), "missing `{field}` in {r}");
        }
        assert_eq!(r["m"], 96);
        assert!(r["gflops"].as_f64().unwrap() > 0.0);
        assert!(r["cpu_gflops"].as_f64().unwrap() > 0.0);
    }
    // The table is on stdout too.
    assert!(String::from_utf8_lossy(&out.stdout).contains("GFLOP/s"));
}

/// `kiln bench matmul` times each product a second way, through `Kernel::Matmul` as
/// training launches it, and names the block the measured selection chose there;
/// `--no-tune` makes that row the table's block, and says so.
#[test]
fn bench_matmul_shows_the_measured_selection_beside_the_table() {
    // A cache of its own, so that the selection is measured in this run, not
    // remembered from an earlier one.
    let cache = std::env::temp_dir().join(format!("kiln-bench-sel-{}", std::process::id()));
    std::fs::create_dir_all(&cache).unwrap();
    let run = |extra: &[&str]| -> (Vec<serde_json::Value>, String) {
        let path = cache.join(format!("rows-{}.json", extra.len()));
        let mut args = extra.to_vec();
        args.extend([
            "bench",
            "matmul",
            "--devices",
            "vulkan",
            "--dtypes",
            "f32",
            // Large enough to be measured (2^26 multiply-adds and up), small enough
            // that its candidates build in under a second.
            "--sizes",
            "448",
            "--naive-up-to",
            "0",
            "--budget-ms",
            "20",
            "--json",
            path.to_str().unwrap(),
        ]);
        let out = Command::new(env!("CARGO_BIN_EXE_kiln"))
            .args(&args)
            .env("KILN_CACHE_DIR", &cache)
            .env("KILN_COMPILE_LOG", "1")
            .output()
            .expect("run kiln");
        let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
        assert!(out.status.success(), "{stderr}");
        let rows: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
        let rows = rows.as_array().unwrap().clone();
        assert_eq!(
            rows.len(),
            2,
            "the table's row, then the selected one: {rows:?}"
        );
        for r in &rows {
            assert!(r["gflops"].as_f64().unwrap() > 0.0, "{r}");
            assert!(r["cpu_gflops"].as_f64().unwrap() > 0.0, "{r}");
            assert!(r["ratio"].as_f64().unwrap() > 0.0, "{r}");
        }
        (rows, stderr)
    };
    let is_cpu_block = |name: &str| {
        name.strip_prefix("cpu")
            .and_then(|b| b.split_once('x'))
            .is_some_and(|(m, n)| m.parse::<u32>().is_ok() && n.parse::<u32>().is_ok())
    };
    let (rows, log) = run(&[]);
    let table = rows[0]["variant"].as_str().unwrap();
    let selected = rows[1]["variant"].as_str().unwrap();
    let block = selected
        .strip_prefix("selected ")
        .unwrap_or_else(|| panic!("not a selected row: {selected}"));
    assert!(is_cpu_block(block), "{selected}: not a CPU block");
    assert!(is_cpu_block(table), "{table}");
    // The block named is the one the launch path measured and chose.
    assert!(
        log.contains(&format!("GEMM 448x448x448 b1 t00 F32/F32/F32: {block} of ")),
        "{log}"
    );
    let (rows, log) = run(&["--no-tune"]);
    let table = rows[0]["variant"].as_str().unwrap();
    assert_eq!(rows[1]["variant"], format!("table {table} (--no-tune)"));
    assert!(
        !log.contains("GEMM 448x448x448"),
        "measured under --no-tune: {log}"
    );
    std::fs::remove_dir_all(&cache).ok();
}

/// `kiln bench attention`, `kiln bench train` and `kiln bench sample` take the raw
/// Vulkan backend's `vk:0` beside wgpu's `vulkan` (the same lavapipe device through both
/// host APIs), one row each, in the order given, with real figures.
#[test]
fn bench_attention_train_and_sample_put_vk_beside_wgpu() {
    let dir = std::env::temp_dir().join(format!("kiln-bench-vk2-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let (attention, train, model) = (
        dir.join("attention.json"),
        dir.join("train.json"),
        dir.join("tiny.json"),
    );
    std::fs::write(
        &model,
        r#"{"n_layer": 1, "n_head": 2, "n_embd": 16, "block_size": 8, "vocab_size": 32}"#,
    )
    .unwrap();
    let runs: [(&std::path::Path, &str, Vec<&str>); 2] = [
        (
            &attention,
            "fused_ms",
            vec![
                "attention",
                "--seqs",
                "32",
                "--dim",
                "16",
                "--heads",
                "2",
                "--budget-ms",
                "5",
            ],
        ),
        (
            &train,
            "step_ms",
            vec![
                "train",
                "--model",
                model.to_str().unwrap(),
                "--micro-batch",
                "2",
                "--steps",
                "1",
                "--gemm-budget-ms",
                "2",
                "--peak-tflops",
                "1",
            ],
        ),
    ];
    for (path, figure, args) in runs {
        let mut all = vec!["bench"];
        all.extend(&args);
        all.extend(["--devices", "vk:0,vulkan", "--json", path.to_str().unwrap()]);
        let out = kiln(&all);
        assert!(
            out.status.success(),
            "{all:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let rows: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
        let rows = rows.as_array().unwrap();
        let backends: Vec<&str> = rows
            .iter()
            .map(|r| r["backend"].as_str().unwrap())
            .collect();
        assert_eq!(backends, ["vk", "vulkan"], "{all:?}");
        for r in rows {
            assert!(r[figure].as_f64().unwrap() > 0.0, "{r}");
        }
        assert_eq!(rows[0]["adapter"], rows[1]["adapter"]);
    }
    // `bench sample` names the backend in the adapter column.
    let sample = dir.join("sample.json");
    let args = [
        "bench",
        "sample",
        "--models",
        "addition",
        "--layers",
        "1",
        "--prompt",
        "4",
        "--tokens",
        "2",
        "--devices",
        "vk:0,vulkan",
        "--json",
    ];
    let out = kiln(&[&args[..], &[sample.to_str().unwrap()]].concat());
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let rows: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&sample).unwrap()).unwrap();
    let rows = rows.as_array().unwrap();
    assert_eq!(rows.len(), 2, "{rows:?}");
    for (r, backend) in rows.iter().zip(["(vk)", "(vulkan)"]) {
        assert!(r["adapter"].as_str().unwrap().ends_with(backend), "{r}");
        assert!(r["decode_tok_s"].as_f64().unwrap() > 0.0, "{r}");
    }
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn bench_matmul_puts_vk_wgpu_and_the_spirv_gemm_side_by_side() {
    let path = std::env::temp_dir().join(format!("kiln-bench-vk-{}.json", std::process::id()));
    let out = kiln(&[
        "bench",
        "matmul",
        "--devices",
        "vk:0,vulkan",
        "--spirv",
        "--dtypes",
        "f32",
        "--sizes",
        "96",
        "--naive-up-to",
        "0",
        "--variants",
        "tiled32x32x8,naive",
        "--budget-ms",
        "20",
        "--json",
        path.to_str().unwrap(),
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let rows: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    std::fs::remove_file(&path).ok();
    let got: Vec<(String, String)> = rows
        .as_array()
        .unwrap()
        .iter()
        .map(|r| {
            assert!(r["gflops"].as_f64().unwrap() > 0.0, "{r}");
            (
                r["backend"].as_str().unwrap().to_string(),
                r["variant"].as_str().unwrap().to_string(),
            )
        })
        .collect();
    // wgpu's planner choice and the pinned WGSL kernels, the hand-written SPIR-V GEMM
    // through wgpu, and the raw Vulkan backend running the planner's choice as that
    // SPIR-V GEMM (its tile specialized), reading A and B as texels and then with
    // storage loads, the pinned tiled kernel as its twin, and the planner's kernel
    // through naga where the pin (naive) has no twin, as it says.
    let names: Vec<(&str, &str)> = got.iter().map(|(b, v)| (b.as_str(), v.as_str())).collect();
    assert_eq!(names.len(), 9, "{names:?}");
    assert_eq!(names[0].0, "vulkan");
    assert_eq!(names[1], ("vulkan", "tiled32x32x8"));
    assert_eq!(names[2], ("vulkan", "naive"));
    assert_eq!(names[3], ("vulkan", "spirv cpu16x8"));
    assert_eq!(names[4], ("vulkan", "table cpu16x8 (too small to measure)"));
    assert_eq!(names[5], ("vk", "spirv cpu16x8 texel"));
    assert_eq!(names[6], ("vk", "spirv cpu16x8"));
    assert_eq!(names[7], ("vk", "spirv tiled32x32x8"));
    assert_eq!(
        names[8],
        ("vk", "cpu16x8 (pinned naive is not on the SPIR-V route)")
    );
    assert_eq!(names[0].1, "cpu16x8");
    // Only a wgpu Vulkan adapter runs the passthrough SPIR-V.
    let out = kiln(&[
        "bench",
        "matmul",
        "--devices",
        "vk:0",
        "--spirv",
        "--sizes",
        "96",
    ]);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("add --devices vulkan"));
}

#[test]
fn bad_arguments_are_clear_errors() {
    let out = kiln(&["bench", "matmul", "--dtypes", "u32"]);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("f32, f16 or bf16"));
    let out = kiln(&["bench", "matmul", "--devices", "vulkan:9"]);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("kiln devices"));
    let out = kiln(&["bench", "matmul", "--variants", "cpu3x5"]);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("unknown matmul variant"));
}

/// A scratch directory for one test.
fn scratch(name: &str) -> std::path::PathBuf {
    let d = std::env::temp_dir().join(format!("kiln-cli-{name}-{}", std::process::id()));
    std::fs::remove_dir_all(&d).ok();
    std::fs::create_dir_all(&d).unwrap();
    d
}

#[test]
fn config_check_lists_every_problem_with_a_fix_and_explain_shows_origins() {
    let dir = scratch("config");
    let bad = dir.join("bad.json");
    std::fs::write(
        &bad,
        r#"{"train_batch_size": 33, "train_micro_batch_size_per_gpu": 17,
            "grandient_accumulation_steps": 2, "fp16": {"enabled": true, "loss_scale_window": "1000"}}"#,
    )
    .unwrap();
    let out = kiln(&["config", "check", bad.to_str().unwrap(), "--world", "2"]);
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    for needle in [
        "bad.json",
        "did you mean \"gradient_accumulation_steps\"",
        "fp16.loss_scale_window",
        "remove the quotes",
        "train_batch_size",
    ] {
        assert!(err.contains(needle), "`{needle}` missing from:\n{err}");
    }

    let good = dir.join("good.json");
    std::fs::write(
        &good,
        r#"{"train_batch_size": 32, "gradient_accumulation_steps": 2, "bf16": {"enabled": true}}"#,
    )
    .unwrap();
    let out = kiln(&["config", "check", good.to_str().unwrap(), "--world", "2"]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        text.contains("micro-batch 8 × accumulation 2 × world 2"),
        "{text}"
    );
    let out = kiln(&["config", "explain", good.to_str().unwrap(), "--world", "2"]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("bf16.enabled = true (file)"), "{text}");
    assert!(
        text.contains("train_micro_batch_size_per_gpu = 8 (inferred"),
        "{text}"
    );
    assert!(text.contains("fp16.enabled = false (default)"), "{text}");
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn prepare_tokenizes_with_gpt2_bpe_and_bytes() {
    let dir = scratch("prepare");
    let text = dir.join("t.txt");
    std::fs::write(&text, "Hello world").unwrap();
    let bin = dir.join("t.bin");
    let out = kiln(&["prepare", text.to_str().unwrap(), bin.to_str().unwrap()]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    // GPT-2's ids for "Hello" and " world", as little-endian u16.
    assert_eq!(std::fs::read(&bin).unwrap(), [0x88, 0x3c, 0xe3, 0x03]);
    let bytes = dir.join("b.bin");
    let out = kiln(&[
        "prepare",
        text.to_str().unwrap(),
        bytes.to_str().unwrap(),
        "--tokenizer",
        "bytes",
    ]);
    assert!(out.status.success());
    let ids: Vec<u16> = std::fs::read(&bytes)
        .unwrap()
        .chunks(2)
        .map(|c| u16::from_le_bytes([c[0], c[1]]))
        .collect();
    assert_eq!(
        ids,
        "Hello world".bytes().map(u16::from).collect::<Vec<_>>()
    );
    let out = kiln(&["prepare", "/nonexistent.txt", bytes.to_str().unwrap()]);
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).contains("/nonexistent.txt"));
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn train_then_runs_lists_and_diffs_the_runs() {
    let dir = scratch("runs");
    let model = dir.join("model.json");
    std::fs::write(
        &model,
        r#"{"n_layer": 1, "n_head": 2, "n_embd": 16, "block_size": 9, "vocab_size": 13}"#,
    )
    .unwrap();
    let cfg = |name: &str, lr: f64| {
        let p = dir.join(name);
        std::fs::write(
            &p,
            format!(
                r#"{{"train_micro_batch_size_per_gpu": 4,
                    "optimizer": {{"type": "AdamW", "params": {{"lr": {lr}}}}}}}"#
            ),
        )
        .unwrap();
        p
    };
    for (name, lr) in [("a", 0.001), ("b", 0.003)] {
        let c = cfg(&format!("{name}.json"), lr);
        let out = kiln(&[
            "train",
            "--config",
            c.to_str().unwrap(),
            "--model",
            model.to_str().unwrap(),
            "--devices",
            "vulkan",
            "--steps",
            "4",
            "--out",
            dir.join("runs").join(name).to_str().unwrap(),
        ]);
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let text = String::from_utf8_lossy(&out.stdout);
        assert!(text.contains("4 steps (0 skipped)"), "{text}");
        assert!(text.contains("held-out exact match"), "{text}");
    }
    let root = dir.join("runs");
    let out = kiln(&["runs", "--root", root.to_str().unwrap()]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success() && text.contains('a') && text.contains('b'),
        "{text}"
    );
    let out = kiln(&[
        "runs",
        "diff",
        root.join("a").to_str().unwrap(),
        root.join("b").to_str().unwrap(),
    ]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    // Exactly the learning rate differs: the optimizer's and the constant schedule's.
    assert!(text.contains("optimizer") && text.contains("lr"), "{text}");
    assert!(!text.contains("seed"), "{text}");
    std::fs::remove_dir_all(&dir).ok();
}

/// scripts/gpu-check.sh, checked here without a GPU: it parses (`bash -n`), and its dry
/// run lists every step for the devices it picks or is given, in quick and full mode:
/// the kernel tests on both backends through KILN_TEST_VULKAN / KILN_TEST_VK, the
/// cooperative-matrix GEMM's test (required on a GPU unless `--no-coopmat`, not on a
/// CPU driver), the peak, and the GEMM and attention benches (GPT-2 shapes in full
/// mode) with both devices, f16 GEMMs also without the cooperative-matrix GEMM.
/// (Its quick mode runs the steps for real on lavapipe in under a minute; that run is
/// not a test here, as it builds and runs tests itself.)
#[test]
fn gpu_check_script_lists_its_steps_for_both_backends() {
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/scripts/gpu-check.sh");
    let status = Command::new("bash").args(["-n", script]).status().unwrap();
    assert!(status.success(), "bash -n {script}");
    let run = |args: &[&str]| {
        let out = Command::new("bash")
            .arg(script)
            .args(args)
            .env("KILN", env!("CARGO_BIN_EXE_kiln"))
            .output()
            .unwrap();
        (
            out.status.code(),
            String::from_utf8_lossy(&out.stdout).into_owned(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    };
    // No GPU here: the first device of each backend, lavapipe.
    let (code, quick, err) = run(&["--quick", "--dry-run"]);
    assert_eq!(code, Some(0), "{err}");
    for want in [
        "quick mode, wgpu device vulkan:0, raw Vulkan device vk:0",
        "KILN_TEST_VULKAN=vulkan:0 KILN_TEST_VK=vk:0 cargo test",
        "bench peak --devices vulkan:0",
        "bench matmul --devices vk:0,vulkan:0 --spirv",
        "bench attention --devices vk:0,vulkan:0",
        // lavapipe is a CPU driver: the test runs, showing the route refuse it.
        "KILN_TEST_VK=vk:0 KILN_TEST_COOPMAT=0 KILN_GEMM_LOG=1 cargo test",
        "-p kiln --test vk -- cooperative_matrix_gemm",
    ] {
        assert!(quick.contains(want), "no `{want}` in:\n{quick}");
    }
    let (code, full, err) = run(&["--dry-run", "--vk", "vk:3", "--vulkan", "vulkan:2"]);
    assert_eq!(code, Some(0), "{err}");
    for want in [
        "full mode, wgpu device vulkan:2, raw Vulkan device vk:3",
        "--release -p kiln --test kernels --test matmul --test gemm_tiles --test attention",
        "bench matmul --devices vk:3,vulkan:2 --spirv --dtypes f32,f16",
        "bench attention --devices vk:3,vulkan:2 --heads 12 --dim 64 --seqs 1024",
        "bench train --model gpt2 --devices vk:3,vulkan:2",
        "KILN_TEST_VK=vk:3 KILN_TEST_COOPMAT=1 KILN_GEMM_LOG=1 cargo test --release -p kiln \
         --test vk -- cooperative_matrix_gemm",
        "KILN_VK_COOPMAT=0",
    ] {
        assert!(full.contains(want), "no `{want}` in:\n{full}");
    }
    let (code, plain, err) = run(&[
        "--dry-run",
        "--vk",
        "vk:3",
        "--vulkan",
        "vulkan:2",
        "--no-coopmat",
    ]);
    assert_eq!(code, Some(0), "{err}");
    assert!(
        plain.contains("KILN_TEST_COOPMAT=0") && !plain.contains("KILN_VK_COOPMAT=0"),
        "{plain}"
    );
    let (code, _, err) = run(&["--fast"]);
    assert_eq!(code, Some(2));
    assert!(err.contains("unknown argument `--fast`"), "{err}");
}

/// An empty `--devices` is called empty (there is no comma to remove), before anything
/// is created; a real stray comma is still named as one.
#[test]
fn an_empty_devices_list_is_named_as_such() {
    let out_dir = std::env::temp_dir().join(format!("kiln-empty-devices-{}", std::process::id()));
    let run = out_dir.join("run");
    for (devices, want, not) in [
        (
            "",
            "--devices is empty: name at least one device",
            "stray comma",
        ),
        ("cpu,", "remove the stray comma", "is empty"),
    ] {
        let out = kiln(&[
            "train",
            "--devices",
            devices,
            "--steps",
            "1",
            "--out",
            run.to_str().unwrap(),
        ]);
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{devices:?}: {err}");
        assert!(
            err.contains(want) && !err.contains(not),
            "{devices:?}: {err}"
        );
        assert!(
            !run.exists(),
            "{devices:?}: a refused run created its directory"
        );
    }
}

/// A model file's impossible size is refused naming the file and the field, before the
/// data (the addition task's rows of block_size + 1 tokens) makes another error of it.
#[test]
fn a_model_with_block_size_0_is_refused_naming_the_file_and_field() {
    let dir = std::env::temp_dir().join(format!("kiln-block0-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let model = dir.join("model.json");
    std::fs::write(
        &model,
        r#"{"n_layer": 1, "n_head": 2, "n_embd": 16, "block_size": 0, "vocab_size": 13}"#,
    )
    .unwrap();
    let run = dir.join("run");
    let out = kiln(&[
        "train",
        "--model",
        model.to_str().unwrap(),
        "--steps",
        "1",
        "--out",
        run.to_str().unwrap(),
    ]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(
        err.contains(&format!("{}: ", model.display()))
            && err.contains("gpt: ")
            && err.contains("block_size (0)"),
        "{err}"
    );
    assert!(!err.contains("T + 1"), "{err}");
    assert!(!run.exists());
    std::fs::remove_dir_all(&dir).ok();
}

/// The same causes met through other commands and flags: a run directory where none can
/// be made, a config that is not there, `estimate` on an impossible model.
#[test]
fn sibling_refusals_name_the_real_cause_too() {
    let cases: [(&[&str], &[&str]); 3] = [
        (
            &["train", "--steps", "1", "--out", "/proc/kiln-run"],
            &["cannot create it in /proc", "does not take new entries"],
        ),
        (
            &["train", "--config", "/nonexistent/ds.json", "--steps", "1"],
            &["reading the config /nonexistent/ds.json: it does not exist"],
        ),
        (
            &["estimate", "--model", "/nonexistent/m.json"],
            &["it does not exist"],
        ),
    ];
    for (args, wants) in cases {
        let out = kiln(args);
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{args:?}: {err}");
        for want in wants {
            assert!(err.contains(want), "{args:?}: `{want}` missing from {err}");
        }
    }
    let dir = std::env::temp_dir().join(format!("kiln-estimate0-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let model = dir.join("m.json");
    std::fs::write(
        &model,
        r#"{"n_layer": 1, "n_head": 2, "n_embd": 16, "block_size": 0, "vocab_size": 13}"#,
    )
    .unwrap();
    let out = kiln(&["estimate", "--model", model.to_str().unwrap()]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(
        err.contains(&format!("{}: ", model.display())) && err.contains("block_size (0)"),
        "{err}"
    );
    std::fs::remove_dir_all(&dir).ok();
}
