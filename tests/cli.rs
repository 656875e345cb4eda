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
    // The planner's kernel and the naive baseline.
    assert_eq!(rows.len(), 2, "{rows:?}");
    assert_eq!(rows[1]["variant"], "naive");
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
