//! `kiln config` and `kiln train` on configs that used to pass the check and then fail
//! (or silently change) the run.

use std::process::Command;

fn kiln(args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_kiln"))
        .args(args)
        .output()
        .expect("run kiln")
}

fn scratch(name: &str) -> std::path::PathBuf {
    let d = std::env::temp_dir().join(format!("kiln-config-cli-{name}-{}", std::process::id()));
    std::fs::remove_dir_all(&d).ok();
    std::fs::create_dir_all(&d).unwrap();
    d
}

#[test]
fn config_check_refuses_a_micro_batch_the_engine_cannot_hold() {
    let dir = scratch("huge");
    let path = dir.join("ds.json");
    std::fs::write(
        &path,
        r#"{"train_micro_batch_size_per_gpu": 18446744073709551615}"#,
    )
    .unwrap();
    let out = kiln(&["config", "check", path.to_str().unwrap(), "--world", "1"]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(
        err.contains("train_micro_batch_size_per_gpu: expected an integer from 1 to 4294967295"),
        "{err}"
    );
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn a_byte_order_mark_hides_nothing_in_the_config() {
    let dir = scratch("bom");
    let path = dir.join("ds.json");
    let with_bom = |json: &str| {
        let mut bytes = vec![0xEF, 0xBB, 0xBF];
        bytes.extend_from_slice(json.as_bytes());
        bytes
    };
    std::fs::write(&path, with_bom(r#"{"train_micro_batch_size_per_gpu": 2}"#)).unwrap();
    let out = kiln(&["config", "check", path.to_str().unwrap(), "--world", "2"]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    // kiln train reads kiln.devices before the rest (it sets the world size): the mark
    // must not make it fall back to the default device. A name no adapter has shows
    // that the list was read, before anything is built.
    std::fs::write(
        &path,
        with_bom(r#"{"train_micro_batch_size_per_gpu": 2, "kiln": {"devices": ["nosuchdevice"]}}"#),
    )
    .unwrap();
    let out = kiln(&[
        "train",
        "--config",
        path.to_str().unwrap(),
        "--steps",
        "1",
        "--out",
        dir.join("run").to_str().unwrap(),
    ]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{err}");
    assert!(err.contains("nosuchdevice"), "{err}");
    std::fs::remove_dir_all(&dir).ok();
}

/// `kiln config check` reads one regular JSON file (a device would be read until memory
/// ran out) and a world no run can have is an error, as `kiln train`'s device cap is.
#[test]
fn config_check_refuses_devices_and_impossible_worlds() {
    let out = kiln(&["config", "check", "/dev/zero", "--world", "1"]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(err.contains("not a regular file"), "{err}");
    let dir = scratch("world");
    let path = dir.join("ds.json");
    std::fs::write(&path, r#"{"train_micro_batch_size_per_gpu": 2}"#).unwrap();
    let out = kiln(&[
        "config",
        "check",
        path.to_str().unwrap(),
        "--world",
        "18446744073709551615",
    ]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(err.contains("at most 64 devices"), "{err}");
    std::fs::remove_dir_all(&dir).ok();
}

/// `config check` shows the notes `config explain` does: a key accepted but doing
/// nothing at this stage (stage 3's model persistence threshold at stage 2) is said, not
/// passed over.
#[test]
fn config_check_notes_a_key_that_does_nothing_here() {
    let dir = scratch("inert");
    let path = dir.join("ds.json");
    std::fs::write(
        &path,
        r#"{"train_micro_batch_size_per_gpu": 2,
            "zero_optimization": {"stage": 2, "stage3_model_persistence_threshold": 5000}}"#,
    )
    .unwrap();
    let out = kiln(&["config", "check", path.to_str().unwrap(), "--world", "2"]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let note = text
        .lines()
        .find(|l| l.starts_with("note:") && l.contains("stage3_model_persistence_threshold"))
        .unwrap_or_else(|| panic!("no note on the stage-3 key: {text}"));
    assert!(note.contains("Kiln's stage 3 does not have"), "{note}");
    assert!(text.contains(": ok ("), "{text}");
    std::fs::remove_dir_all(&dir).ok();
}
