//! Host-side checkpoints: bit-exact round trips, verification errors that name the
//! file, crash leftovers, a dangling `latest`, and retention.

mod common;

use std::path::Path;

use half::{bf16, f16};
use kiln_engine::train::checkpoint::{
    self, dir_name, load, load_latest, save, CheckpointError, CheckpointFile, HostTensor,
    SaveOptions, MANIFEST_FILE, MODEL_FILE, OPTIMIZER_FILE,
};
use kiln_engine::{DType, HostData};
use serde_json::{json, Value};

/// Model weights in three dtypes, with values that only survive a bit-exact path
/// (NaN payloads, signed zero, infinities, subnormals).
fn model_file(seed: u32) -> CheckpointFile {
    let s = seed as f32;
    let wte: Vec<f16> = (0..12)
        .map(|i| f16::from_f32((i as f32 - 5.5) * 0.37 + s))
        .chain([
            f16::from_bits(0x7e01),
            f16::NEG_ZERO,
            f16::INFINITY,
            f16::from_bits(0x0001),
        ])
        .collect();
    let ln: Vec<bf16> = (0..4)
        .map(|i| bf16::from_f32(1.0 + i as f32 / 3.0 + s))
        .collect();
    let bias: Vec<f32> = vec![0.1 + s, -0.0, f32::from_bits(0x7fc0_1234), 1e-40];
    CheckpointFile::new(
        MODEL_FILE,
        vec![
            HostTensor::new("transformer.wte.weight", vec![4, 4], HostData::F16(wte)),
            HostTensor::new("transformer.ln_f.weight", vec![4], HostData::BF16(ln)),
            HostTensor::new("transformer.ln_f.bias", vec![2, 2], HostData::F32(bias)),
        ],
    )
}

fn optimizer_file(seed: u32) -> CheckpointFile {
    let mut tensors = Vec::new();
    for (k, name) in ["master", "exp_avg", "exp_avg_sq"].iter().enumerate() {
        let v: Vec<f32> = (0..16)
            .map(|i| ((i * 7 + k as u32 * 3 + seed) as f32).sin() / 3.0)
            .collect();
        tensors.push(HostTensor::new(
            format!("{name}.transformer.wte.weight"),
            vec![4, 4],
            HostData::F32(v),
        ));
    }
    tensors.push(HostTensor::new(
        "rng.state",
        vec![2],
        HostData::U32(vec![0xdead_beef, seed]),
    ));
    CheckpointFile::new(OPTIMIZER_FILE, tensors)
}

fn state(step: u64) -> Value {
    json!({
        "loss_scaler": {"scale": 65536.0, "good_steps": 17, "hysteresis": 2},
        "schedule": {"step": step, "warmup": 10},
        "data": {"epoch": 1, "offset": 123_456_789_u64},
        "rng": {"state": 0xdead_beef_cafe_babe_u64},
        "counters": {"skipped": 3, "tokens": 1_000_000_u64},
    })
}

fn save_step(run: &Path, step: u64, keep: usize) -> checkpoint::Saved {
    save(
        run,
        step,
        &[model_file(step as u32), optimizer_file(step as u32)],
        &state(step),
        &SaveOptions { keep_last: keep },
    )
    .unwrap()
}

fn assert_same_files(a: &[CheckpointFile], b: &[CheckpointFile]) {
    assert_eq!(a.len(), b.len());
    for (fa, fb) in a.iter().zip(b) {
        assert_eq!(fa.name, fb.name);
        assert_eq!(fa.tensors.len(), fb.tensors.len());
        for (ta, tb) in fa.tensors.iter().zip(&fb.tensors) {
            assert_eq!(ta.name, tb.name);
            assert_eq!(ta.shape, tb.shape, "{}", ta.name);
            assert_eq!(ta.data.dtype(), tb.data.dtype(), "{}", ta.name);
            assert_eq!(ta.data.bits(), tb.data.bits(), "{}", ta.name);
        }
    }
}

fn model_path(run: &Path, step: u64) -> std::path::PathBuf {
    run.join("checkpoints")
        .join(dir_name(step))
        .join(MODEL_FILE)
}

#[test]
fn save_then_load_is_bit_exact_with_the_same_state() {
    let run = common::scratch("ckpt-roundtrip");
    let saved = save_step(&run, 100, 3);
    assert_eq!(saved.dir, run.join("checkpoints/step-00000100"));
    assert!(saved.removed.is_empty() && saved.notes.is_empty());
    assert_eq!(
        std::fs::read_to_string(run.join("checkpoints/latest")).unwrap(),
        "step-00000100\n"
    );
    // Nothing temporary is left behind.
    let names: Vec<String> = std::fs::read_dir(run.join("checkpoints"))
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    assert!(names.iter().all(|n| !n.contains(".tmp-")), "{names:?}");

    let ck = load_latest(&run).unwrap();
    assert!(ck.notes.is_empty(), "{:?}", ck.notes);
    assert_eq!(ck.step(), 100);
    assert_eq!(ck.state(), &state(100));
    assert_same_files(&ck.files, &[model_file(100), optimizer_file(100)]);
    assert_eq!(ck.dir, saved.dir);
    // `load` of the directory gives the same.
    let direct = load(&saved.dir).unwrap();
    assert_same_files(&direct.files, &ck.files);

    // The manifest records sizes, checksums and tensor lists.
    let m: Value =
        serde_json::from_str(&std::fs::read_to_string(saved.dir.join(MANIFEST_FILE)).unwrap())
            .unwrap();
    assert_eq!(m["format_version"], 1);
    assert_eq!(m["step"], 100);
    assert_eq!(m["state"], state(100));
    let f0 = &m["files"][0];
    assert_eq!(f0["name"], MODEL_FILE);
    assert_eq!(
        f0["bytes"].as_u64().unwrap(),
        std::fs::metadata(saved.dir.join(MODEL_FILE)).unwrap().len()
    );
    assert_eq!(f0["sha256"].as_str().unwrap().len(), 64);
    assert_eq!(
        f0["tensors"][0],
        json!({"name": "transformer.wte.weight", "dtype": "f16", "shape": [4, 4]})
    );
    assert_eq!(m["files"][1]["tensors"][3]["dtype"], "u32");

    // Fetching by name.
    let t = ck.tensor(MODEL_FILE, "transformer.ln_f.weight").unwrap();
    assert_eq!(t.data.dtype(), DType::BF16);
    ck.tensor_checked(
        OPTIMIZER_FILE,
        "master.transformer.wte.weight",
        DType::F32,
        &[4, 4],
    )
    .unwrap();
    let e = ck.tensor(MODEL_FILE, "lm_head.weight").unwrap_err();
    assert!(matches!(e, CheckpointError::NoSuchTensor { .. }));
    let msg = e.to_string();
    assert!(
        msg.contains("lm_head.weight") && msg.contains(MODEL_FILE),
        "{msg}"
    );
    let msg = ck.file("scaler.safetensors").unwrap_err().to_string();
    assert!(
        msg.contains("scaler.safetensors") && msg.contains(OPTIMIZER_FILE),
        "{msg}"
    );
    let msg = ck
        .tensor_checked(MODEL_FILE, "transformer.wte.weight", DType::BF16, &[4, 4])
        .unwrap_err()
        .to_string();
    assert!(
        msg.contains("f16 [4, 4]") && msg.contains("bf16 [4, 4]"),
        "{msg}"
    );
}

/// The tensor files are written a tensor at a time by a writer that makes files
/// private; they keep the permissions any file created there gets, as the manifest.
#[cfg(unix)]
#[test]
fn tensor_files_get_the_permissions_of_the_checkpoints_other_files() {
    use std::os::unix::fs::PermissionsExt;
    let run = common::scratch("ckpt-permissions");
    let saved = save_step(&run, 7, 3);
    let mode = |name: &str| {
        let m = std::fs::metadata(saved.dir.join(name)).unwrap();
        m.permissions().mode() & 0o777
    };
    let manifest = mode("manifest.json");
    assert_eq!(mode(MODEL_FILE), manifest);
    assert_eq!(mode(OPTIMIZER_FILE), manifest);
}

#[test]
fn a_corrupted_byte_is_a_checksum_error_naming_the_file() {
    let run = common::scratch("ckpt-corrupt");
    save_step(&run, 100, 3);
    let path = model_path(&run, 100);
    let mut bytes = std::fs::read(&path).unwrap();
    let last = bytes.len() - 3;
    bytes[last] ^= 0x10;
    std::fs::write(&path, &bytes).unwrap();
    let e = load_latest(&run).unwrap_err();
    assert!(matches!(e, CheckpointError::Checksum { .. }), "{e}");
    let msg = e.to_string();
    assert!(msg.contains(&path.display().to_string()), "{msg}");
    assert!(
        msg.contains("corrupt") && msg.contains("earlier checkpoint"),
        "{msg}"
    );
}

#[test]
fn a_truncated_file_is_an_error_with_both_sizes() {
    let run = common::scratch("ckpt-truncated");
    save_step(&run, 100, 3);
    let path = run.join("checkpoints/step-00000100").join(OPTIMIZER_FILE);
    let bytes = std::fs::read(&path).unwrap();
    let full = bytes.len();
    std::fs::write(&path, &bytes[..full / 2]).unwrap();
    let e = load_latest(&run).unwrap_err();
    assert!(matches!(e, CheckpointError::Truncated { .. }), "{e}");
    let msg = e.to_string();
    assert!(msg.contains(&path.display().to_string()), "{msg}");
    assert!(
        msg.contains(&format!("{} of {full} bytes", full / 2)),
        "{msg}"
    );
    // A file that is gone altogether.
    std::fs::remove_file(&path).unwrap();
    let e = load_latest(&run).unwrap_err();
    assert!(matches!(e, CheckpointError::MissingFile { .. }), "{e}");
    assert!(e.to_string().contains(OPTIMIZER_FILE));
}

#[test]
fn a_missing_or_unlisted_tensor_is_an_error_naming_tensor_and_file() {
    let run = common::scratch("ckpt-missing-tensor");
    let dir = save_step(&run, 100, 3).dir;
    let mpath = dir.join(MANIFEST_FILE);
    let original: Value = serde_json::from_str(&std::fs::read_to_string(&mpath).unwrap()).unwrap();

    // Rewrite the model file without one tensor, with a manifest whose size and
    // checksum match the new file, so only the tensor check can catch it.
    let mut model = model_file(100);
    model.tensors.retain(|t| t.name != "transformer.ln_f.bias");
    let other = common::scratch("ckpt-missing-tensor-src");
    let src = save(&other, 1, &[model], &json!(null), &SaveOptions::default()).unwrap();
    std::fs::copy(src.dir.join(MODEL_FILE), dir.join(MODEL_FILE)).unwrap();
    let new_manifest: Value =
        serde_json::from_str(&std::fs::read_to_string(src.dir.join(MANIFEST_FILE)).unwrap())
            .unwrap();
    let mut m = original.clone();
    m["files"][0]["bytes"] = new_manifest["files"][0]["bytes"].clone();
    m["files"][0]["sha256"] = new_manifest["files"][0]["sha256"].clone();
    std::fs::write(&mpath, serde_json::to_vec(&m).unwrap()).unwrap();
    let e = load(&dir).unwrap_err();
    assert!(matches!(e, CheckpointError::MissingTensor { .. }), "{e}");
    let msg = e.to_string();
    assert!(
        msg.contains("transformer.ln_f.bias")
            && msg.contains(&dir.join(MODEL_FILE).display().to_string()),
        "{msg}"
    );

    // Now drop a tensor from the manifest only: the file holds one it does not list.
    let mut m = new_manifest.clone();
    m["files"][0]["tensors"].as_array_mut().unwrap().pop();
    m["state"] = json!({});
    std::fs::write(src.dir.join(MANIFEST_FILE), serde_json::to_vec(&m).unwrap()).unwrap();
    let e = load(&src.dir).unwrap_err();
    assert!(matches!(e, CheckpointError::UnlistedTensor { .. }), "{e}");
    assert!(e.to_string().contains(MODEL_FILE), "{e}");

    // A manifest that is not JSON.
    std::fs::write(&mpath, b"{\"format\": \"kiln-chec").unwrap();
    let e = load(&dir).unwrap_err();
    assert!(matches!(e, CheckpointError::BadManifest { .. }), "{e}");
    assert!(e.to_string().contains(MANIFEST_FILE));
}

#[test]
fn a_crash_before_the_rename_leaves_the_previous_checkpoint_loadable() {
    let run = common::scratch("ckpt-crash");
    save_step(&run, 100, 3);
    // A save of step 200 died after writing part of its temporary directory.
    let tmp = run.join("checkpoints/step-00000200.tmp-4242");
    std::fs::create_dir_all(&tmp).unwrap();
    std::fs::write(
        tmp.join(MODEL_FILE),
        b"\x10\x00\x00\x00\x00\x00\x00\x00{\"a\":",
    )
    .unwrap();
    // And one died while replacing `latest`.
    std::fs::write(run.join("checkpoints/latest.tmp-4242"), b"step-0000").unwrap();
    let ck = load_latest(&run).unwrap();
    assert_eq!(ck.step(), 100);
    assert_same_files(&ck.files, &[model_file(100), optimizer_file(100)]);
    assert!(
        ck.notes
            .iter()
            .any(|n| n.contains("step-00000200.tmp-4242")),
        "{:?}",
        ck.notes
    );

    // The next successful save removes the leftovers.
    save_step(&run, 200, 3);
    assert!(!tmp.exists());
    assert!(!run.join("checkpoints/latest.tmp-4242").exists());
    let ck = load_latest(&run).unwrap();
    assert_eq!(ck.step(), 200);
    assert!(ck.notes.is_empty(), "{:?}", ck.notes);
}

#[test]
fn a_dangling_latest_falls_back_to_the_newest_complete_checkpoint_with_a_note() {
    let run = common::scratch("ckpt-dangling");
    save_step(&run, 100, 3);
    save_step(&run, 200, 3);
    let latest = run.join("checkpoints/latest");
    std::fs::write(&latest, "step-00000300\n").unwrap();
    let ck = load_latest(&run).unwrap();
    assert_eq!(ck.step(), 200);
    assert_same_files(&ck.files, &[model_file(200), optimizer_file(200)]);
    let notes = ck.notes.join("\n");
    assert!(
        notes.contains("step-00000300") && notes.contains("newest complete"),
        "{notes}"
    );

    // No pointer at all.
    std::fs::remove_file(&latest).unwrap();
    let ck = load_latest(&run).unwrap();
    assert_eq!(ck.step(), 200);
    assert!(ck.notes.join("\n").contains("missing"), "{:?}", ck.notes);

    // A crash after the rename but before `latest` moved: `latest` still names 100.
    std::fs::write(&latest, "step-00000100").unwrap();
    let ck = load_latest(&run).unwrap();
    assert_eq!(ck.step(), 100);
    assert!(ck.notes.join("\n").contains("newer"), "{:?}", ck.notes);

    // Every checkpoint gone: an error that names the run and says what to do.
    std::fs::remove_dir_all(run.join("checkpoints/step-00000100")).unwrap();
    std::fs::remove_dir_all(run.join("checkpoints/step-00000200")).unwrap();
    let e = load_latest(&run).unwrap_err();
    assert!(matches!(e, CheckpointError::NoCheckpoint { .. }), "{e}");
    let msg = e.to_string();
    assert!(
        msg.contains("without --resume") && msg.contains("step-00000100"),
        "{msg}"
    );
    let e = load_latest(&common::scratch("ckpt-none")).unwrap_err();
    assert!(matches!(e, CheckpointError::NoCheckpoint { .. }), "{e}");
}

#[test]
fn retention_keeps_the_newest_k() {
    let run = common::scratch("ckpt-retention");
    for step in 1..=5 {
        let saved = save_step(&run, step * 10, 2);
        if step >= 3 {
            assert_eq!(
                saved.removed,
                vec![run.join("checkpoints").join(dir_name((step - 2) * 10))]
            );
        }
    }
    let steps: Vec<u64> = checkpoint::list(&run)
        .unwrap()
        .into_iter()
        .map(|(s, _)| s)
        .collect();
    assert_eq!(steps, vec![40, 50]);
    assert_eq!(load_latest(&run).unwrap().step(), 50);

    // keep_last 0 keeps everything.
    let all = common::scratch("ckpt-retention-all");
    for step in 1..=4 {
        assert!(save_step(&all, step, 0).removed.is_empty());
    }
    assert_eq!(checkpoint::list(&all).unwrap().len(), 4);
}

#[test]
fn resaving_after_resuming_from_an_earlier_step() {
    let run = common::scratch("ckpt-resave");
    save_step(&run, 10, 5);
    save_step(&run, 20, 5);
    // Resumed at 10; reaches 20 again with different contents: the old 20 is replaced.
    let saved = save(
        &run,
        20,
        &[model_file(77)],
        &json!({"again": true}),
        &SaveOptions { keep_last: 5 },
    )
    .unwrap();
    assert!(saved.notes.is_empty(), "{:?}", saved.notes);
    let ck = load_latest(&run).unwrap();
    assert_eq!(ck.state(), &json!({"again": true}));
    assert_same_files(&ck.files, &[model_file(77)]);
    // Resumed at 10 and saved at 15: 20 is kept and the caller is told.
    let saved = save_step(&run, 15, 5);
    assert!(
        saved.notes.join("\n").contains("step-00000020"),
        "{:?}",
        saved.notes
    );
    let entries: Vec<String> = std::fs::read_dir(run.join("checkpoints"))
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    assert!(entries.iter().all(|n| !n.contains(".tmp-")), "{entries:?}");
}

#[test]
fn bad_input_is_refused_before_anything_is_written() {
    let run = common::scratch("ckpt-bad-input");
    let opts = SaveOptions::default();
    let bad_shape = CheckpointFile::new(
        MODEL_FILE,
        vec![HostTensor::new(
            "w",
            vec![3, 3],
            HostData::F32(vec![0.0; 8]),
        )],
    );
    let e = save(&run, 1, &[bad_shape], &json!({}), &opts).unwrap_err();
    assert!(matches!(e, CheckpointError::InvalidInput(_)), "{e}");
    assert!(e.to_string().contains("[3, 3]"), "{e}");
    for name in ["../x.safetensors", MANIFEST_FILE, "", "a.tmp-1"] {
        let f = CheckpointFile::new(name, vec![]);
        let e = save(&run, 1, &[f], &json!({}), &opts).unwrap_err();
        assert!(matches!(e, CheckpointError::InvalidInput(_)), "{name}: {e}");
    }
    let e = save(&run, 1, &[model_file(1), model_file(2)], &json!({}), &opts).unwrap_err();
    assert!(e.to_string().contains("twice"), "{e}");
    assert!(checkpoint::list(&run).unwrap().is_empty());
    assert!(!run.join("checkpoints/latest").exists());
}

/// A hostile header length (2^64 - 1) in model.safetensors is named as what it is, not
/// only as a checksum mismatch; with the manifest missing or damaged as well, the
/// damaged header is still what the error reports first.
#[test]
fn a_hostile_header_length_is_named_with_or_without_the_manifest() {
    let run = common::scratch("ckpt-hostile-header");
    let dir = save_step(&run, 100, 3).dir;
    let path = model_path(&run, 100);
    let mut bytes = std::fs::read(&path).unwrap();
    bytes[..8].copy_from_slice(&u64::MAX.to_le_bytes());
    std::fs::write(&path, &bytes).unwrap();
    let says = |e: &CheckpointError, also: &str| {
        assert!(matches!(e, CheckpointError::InvalidFile { .. }), "{e}");
        let msg = e.to_string();
        assert!(msg.contains(&path.display().to_string()), "{msg}");
        assert!(
            msg.contains("header length field says 18446744073709551615 bytes")
                && msg.contains(also),
            "{msg}"
        );
    };
    says(&load(&dir).unwrap_err(), "");
    let mpath = dir.join(MANIFEST_FILE);
    std::fs::write(&mpath, b"{\"format\": ").unwrap();
    says(&load(&dir).unwrap_err(), "its manifest is unreadable too");
    std::fs::remove_file(&mpath).unwrap();
    says(&load(&dir).unwrap_err(), "its manifest is missing too");
    // With sound files, a missing manifest is reported as before.
    let run2 = common::scratch("ckpt-no-manifest");
    let dir2 = save_step(&run2, 100, 3).dir;
    std::fs::remove_file(dir2.join(MANIFEST_FILE)).unwrap();
    let e = load(&dir2).unwrap_err();
    assert!(matches!(e, CheckpointError::MissingFile { .. }), "{e}");
}
