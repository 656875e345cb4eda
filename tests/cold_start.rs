//! Cold start on lavapipe: a device compiles a plan's pipelines ahead of its launches
//! (counting them for the "compiling kernels (n/N)" line) without running anything;
//! compiled pipelines persist in the user cache directory, and a damaged or foreign
//! cache file is ignored with a note, never a crash or a changed number.

mod common;

use kiln::engine::kernels::{Gelu, Scale};
use std::path::{Path, PathBuf};
use std::process::Command;

use common::*;
use kiln::engine::device::compiling;
use kiln::engine::train::runs;
use kiln::engine::{DType, Device, HostData, Kernel, Matmul};
use kiln::wgpu::{find_adapter, DeviceOptions, WgpuDevice};

fn scratch(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("kiln-cold-{name}-{}", std::process::id()));
    std::fs::remove_dir_all(&d).ok();
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// A GEMM with bias, GELU on its output and a scaled copy: three pipelines.
fn launches(dev: &dyn Device) -> (Vec<Kernel>, Vec<kiln::engine::Buffer>) {
    let (m, n, k) = (8, 16, 32);
    let a = put(dev, &finite(DType::F32, m * k, 1));
    let b = put(dev, &finite(DType::F32, k * n, 2));
    let bias = put(dev, &finite(DType::F32, n, 3));
    let c = dev.alloc(DType::F32, m * n).unwrap();
    let g = dev.alloc(DType::F32, m * n).unwrap();
    let out = dev.alloc(DType::F32, m * n).unwrap();
    let ks = vec![
        Kernel::Matmul(Matmul::new(a, b, c, m, n, k).with_bias(bias)),
        Kernel::Gelu(Gelu { x: c, out: g }),
        Kernel::Scale(Scale {
            alpha: 0.5,
            x: g,
            out,
        }),
    ];
    (ks, vec![c, g, out])
}

#[test]
fn prepare_builds_what_the_launches_need_without_running_them() {
    let adapter = find_adapter("vulkan").unwrap();
    let dir = scratch("prepare");
    let opts = DeviceOptions {
        pipeline_cache_dir: Some(dir.clone()),
        ..DeviceOptions::default()
    };
    let dev = WgpuDevice::open(adapter, &opts).unwrap();
    let (ks, outs) = launches(&dev);
    let before = compiling::snapshot();
    dev.prepare(&ks).unwrap();
    let built = dev.pipeline_count();
    assert_eq!(
        built, 3,
        "pipelines built ahead for a GEMM, a GELU and a scale"
    );
    // lavapipe compiles a pipeline's machine code when it first runs it: two halves
    // counted per pipeline.
    let queued = compiling::snapshot().1 - before.1;
    assert_eq!(queued, 2 * built);
    // Nothing ran: the outputs still hold the zeros they were allocated with.
    for &o in &outs {
        assert!(dev.download(o).unwrap().to_f32().iter().all(|&x| x == 0.0));
    }
    // Preparing again finds nothing missing.
    dev.prepare(&ks).unwrap();
    assert_eq!(compiling::snapshot().1 - before.1, queued);
    for k in &ks {
        dev.launch(k).unwrap();
    }
    dev.submit().unwrap();
    dev.wait().unwrap();
    assert_eq!(
        dev.pipeline_count(),
        built,
        "the launches compiled something more"
    );
    let after = compiling::snapshot();
    assert_eq!(after.0 - before.0, queued, "every queued half counted done");
    // The same launches on a device that compiles each on first use: same bits.
    let plain = WgpuDevice::open(
        adapter,
        &DeviceOptions {
            no_pipeline_cache: true,
            ..DeviceOptions::default()
        },
    )
    .unwrap();
    let (ks2, outs2) = launches(&plain);
    for k in &ks2 {
        plain.launch(k).unwrap();
    }
    for (o, o2) in outs.iter().zip(&outs2) {
        assert_bits_eq(
            "prepared",
            &dev.download(*o).unwrap(),
            &plain.download(*o2).unwrap(),
        );
    }
    assert!(!dev
        .download(outs[2])
        .unwrap()
        .to_f32()
        .iter()
        .all(|&x| x == 0.0));
    drop(dev);
    // The cache was written where the options said (lavapipe keeps little in it, but
    // the file is there and valid for the next run).
    let files: Vec<_> = std::fs::read_dir(&dir).unwrap().flatten().collect();
    assert_eq!(files.len(), 1, "{files:?}");
    assert!(std::fs::read(files[0].path())
        .unwrap()
        .starts_with(b"KILNPC1\n"));
    std::fs::remove_dir_all(&dir).ok();
    let _ = HostData::F32(vec![]);
}

fn train(dir: &Path, out: &str) -> (Vec<(u64, u32)>, String) {
    let run = dir.join(out);
    let o = Command::new(env!("CARGO_BIN_EXE_kiln"))
        .args([
            "train",
            "--devices",
            "vulkan",
            "--steps",
            "3",
            "--eval-every",
            "0",
        ])
        .arg("--model")
        .arg(dir.join("model.json"))
        .arg("--config")
        .arg(dir.join("ds.json"))
        .arg("--out")
        .arg(&run)
        .env("KILN_CACHE_DIR", dir.join("cache"))
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&o.stderr).to_string();
    assert!(o.status.success(), "{err}");
    let losses = runs::read_metrics(&run)
        .unwrap()
        .iter()
        .map(|r| (r.step, r.loss.to_bits()))
        .collect();
    (losses, err)
}

fn cache_file(dir: &Path) -> PathBuf {
    let files: Vec<_> = std::fs::read_dir(dir.join("cache/pipelines"))
        .unwrap()
        .flatten()
        .map(|e| e.path())
        .collect();
    assert_eq!(files.len(), 1, "{files:?}");
    files[0].clone()
}

#[test]
fn a_garbage_or_foreign_pipeline_cache_is_ignored_and_changes_no_number() {
    let dir = scratch("garbage");
    std::fs::write(
        dir.join("model.json"),
        r#"{"n_layer": 1, "n_head": 2, "n_embd": 32, "block_size": 16, "vocab_size": 13}"#,
    )
    .unwrap();
    std::fs::write(
        dir.join("ds.json"),
        r#"{"train_micro_batch_size_per_gpu": 4, "optimizer": {"type": "AdamW", "params": {"lr": 0.003}}}"#,
    )
    .unwrap();
    let (clean, err) = train(&dir, "clean");
    assert!(!err.contains("pipeline cache"), "{err}");
    let file = cache_file(&dir);
    let good = std::fs::read(&file).unwrap();
    assert!(good.starts_with(b"KILNPC1\n"));

    std::fs::write(&file, b"\x00garbage that no driver should ever see\xff").unwrap();
    let (after_garbage, err) = train(&dir, "garbage");
    assert!(
        err.contains("ignoring the pipeline cache") && err.contains("not a Kiln pipeline cache"),
        "{err}"
    );
    assert_eq!(after_garbage, clean, "a damaged cache changed the losses");
    assert!(
        std::fs::read(&file).unwrap().starts_with(b"KILNPC1\n"),
        "not rewritten"
    );

    // Whole and well-formed, but written for another adapter or driver.
    let mut foreign = good.clone();
    foreign[8] ^= 0xff;
    std::fs::write(&file, &foreign).unwrap();
    let (after_foreign, err) = train(&dir, "foreign");
    assert!(err.contains("another adapter"), "{err}");
    assert_eq!(after_foreign, clean);
    std::fs::remove_dir_all(&dir).ok();
}
