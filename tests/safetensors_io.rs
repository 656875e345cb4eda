//! Saving and loading named device tensors as safetensors: bit-exact round trips,
//! atomic writes, and clear errors for truncated, corrupted or mismatched files.

mod common;

use common::*;
use std::sync::Arc;

use kiln::engine::data::clusters;
use kiln::engine::device::safetensors_io::save;
use kiln::engine::models::mlp::Mlp;
use kiln::engine::models::MicroBatch;
use kiln::engine::train::trainer::Trainer;
use kiln::engine::Device;

/// A 5-7-3 MLP in fp16 (dynamic loss scaling), AdamW at lr 1e-2.
fn mlp(dev: &dyn Device, seed: u64) -> Trainer {
    let config = kiln::engine::config::parse(
        r#"{"train_micro_batch_size_per_gpu": 8, "fp16": {"enabled": true},
            "optimizer": {"type": "AdamW", "params": {"lr": 0.01, "weight_decay": 0.0}}}"#,
        1,
    )
    .unwrap();
    let model = Mlp {
        inputs: 5,
        hidden: 7,
        classes: 3,
    };
    Trainer::new(dev, Arc::new(model), config, seed).unwrap()
}

fn dir() -> std::path::PathBuf {
    let d = std::env::temp_dir().join(format!(
        "kiln-st-{}-{:?}",
        std::process::id(),
        std::thread::current().id()
    ));
    std::fs::create_dir_all(&d).unwrap();
    d
}

#[test]
fn export_then_import_round_trips_bit_exactly() {
    let dev = gpu("vulkan", false);
    let mut a = mlp(dev.as_ref(), 1);
    let (x, y) = clusters(5, 3, 24, 1.0, 2);
    for s in 0..3 {
        let batch = MicroBatch::features(&x[s * 40..(s + 1) * 40], &y[s * 8..(s + 1) * 8]);
        a.step(dev.as_ref(), &[batch]).unwrap();
    }
    let (a, mut b) = (a.model, mlp(dev.as_ref(), 99).model);
    let path = dir().join("mlp.safetensors");
    save(dev.as_ref(), &a.tensors().unwrap(), &path).unwrap();
    b.load_weights(dev.as_ref(), &path).unwrap();
    for (ta, tb) in a.tensors().unwrap().iter().zip(b.tensors().unwrap()) {
        let (ha, hb) = (
            dev.download(ta.buffer).unwrap(),
            dev.download(tb.buffer).unwrap(),
        );
        assert_eq!(ha.bits(), hb.bits(), "{}", ta.name);
    }
    // Same weights, same predictions.
    let batch = MicroBatch::features(&x[..40], &y[..8]);
    assert_eq!(
        a.predict(dev.as_ref(), &batch).unwrap(),
        b.predict(dev.as_ref(), &batch).unwrap()
    );
    assert_eq!(a.tensors().unwrap().len(), 4);
}

#[test]
fn bad_files_are_clear_errors_and_a_failed_write_keeps_the_old_file() {
    let dev = gpu("vulkan", false);
    let mut m = mlp(dev.as_ref(), 1).model;
    let d = dir();
    let good = d.join("good.safetensors");
    save(dev.as_ref(), &m.tensors().unwrap(), &good).unwrap();
    let bytes = std::fs::read(&good).unwrap();

    // Truncated.
    let cut = d.join("cut.safetensors");
    std::fs::write(&cut, &bytes[..bytes.len() / 2]).unwrap();
    let e = m.load_weights(dev.as_ref(), &cut).unwrap_err().to_string();
    assert!(
        e.contains("cut.safetensors") && e.contains("truncated or corrupted"),
        "{e}"
    );
    // Corrupted header byte.
    let mut bad = bytes.clone();
    bad[10] = b'}';
    let broken = d.join("broken.safetensors");
    std::fs::write(&broken, &bad).unwrap();
    let e = m
        .load_weights(dev.as_ref(), &broken)
        .unwrap_err()
        .to_string();
    assert!(e.contains("broken.safetensors"), "{e}");
    // A parameter the file lacks.
    let fewer = d.join("fewer.safetensors");
    save(dev.as_ref(), &m.tensors().unwrap()[1..], &fewer).unwrap();
    let e = m
        .load_weights(dev.as_ref(), &fewer)
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("fewer.safetensors") && e.contains("missing: `fc1.weight`"),
        "{e}"
    );
    // A shape that differs.
    let mut reshaped = m.tensors().unwrap();
    reshaped[0].shape = vec![7, 5];
    let other = d.join("reshaped.safetensors");
    save(dev.as_ref(), &reshaped, &other).unwrap();
    let e = m
        .load_weights(dev.as_ref(), &other)
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("`fc1.weight` has shape [7, 5]") && e.contains("[5, 7]"),
        "{e}"
    );
    // A write that cannot finish (its directory is gone) leaves the good file intact,
    // and a crash's leftover temporary file does not affect it either.
    let e = save(
        dev.as_ref(),
        &m.tensors().unwrap(),
        &d.join("missing/dir/x.safetensors"),
    );
    assert!(e.is_err());
    std::fs::write(good.with_extension("safetensors.tmp"), b"half a file").unwrap();
    assert_eq!(std::fs::read(&good).unwrap(), bytes);
    m.load_weights(dev.as_ref(), &good).unwrap();
}
