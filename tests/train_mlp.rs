//! End-to-end training of the MLP classifier on a device: every training kernel in one
//! loop. Learns a fixed synthetic task in fp32, fp16 (dynamic loss scaling) and bf16 to
//! stated thresholds, and matches the CPU reference step for step in fp32.

mod common;

use common::*;
use std::sync::Arc;

use kiln::engine::config::parse;
use kiln::engine::data::clusters;
use kiln::engine::models::mlp::Mlp;
use kiln::engine::models::{MicroBatch, Network};
use kiln::engine::train::trainer::Trainer;
use kiln::engine::{DType, Device};

const B: usize = 64;

fn model() -> Mlp {
    Mlp {
        inputs: 8,
        hidden: 32,
        classes: 4,
    }
}

/// AdamW (lr 1e-2, betas 0.9/0.999, weight decay 0.01) in `dtype`'s precision.
fn trainer(dev: &dyn Device, dtype: DType) -> Trainer {
    let precision = match dtype {
        DType::F16 => r#""fp16": {"enabled": true},"#,
        DType::BF16 => r#""bf16": {"enabled": true},"#,
        _ => "",
    };
    let config = parse(
        &format!(
            r#"{{"train_micro_batch_size_per_gpu": {B}, {precision}
                "optimizer": {{"type": "AdamW", "params": {{"lr": 0.01, "betas": [0.9, 0.999],
                "eps": 1e-8, "weight_decay": 0.01}}}}}}"#
        ),
        1,
    )
    .unwrap();
    Trainer::new(dev, Arc::new(model()), config, 11).unwrap()
}

/// Mean loss and accuracy of a batch, without training.
fn evaluate(net: &Network, dev: &dyn Device, x: &[f32], y: &[u32]) -> (f32, f32) {
    let (loss, predicted) = net.predict(dev, &MicroBatch::features(x, y)).unwrap();
    let right = predicted.iter().zip(y).filter(|(p, t)| p == t).count();
    (loss as f32, right as f32 / y.len() as f32)
}

/// Trains `steps` steps; returns the per-step losses and the held-out (loss, accuracy).
fn train(dev: &dyn Device, precision: DType, steps: usize) -> (Vec<f32>, f32, f32) {
    let cfg = model();
    let (x, y) = clusters(cfg.inputs, cfg.classes, B * steps, 2.0, 3);
    let (hx, hy) = clusters(cfg.inputs, cfg.classes, B * 4 + 7, 2.0, 3); // same centres
    let mut mlp = trainer(dev, precision);
    let mut losses = vec![];
    for s in 0..steps {
        let batch = MicroBatch::features(
            &x[s * B * cfg.inputs..(s + 1) * B * cfg.inputs],
            &y[s * B..(s + 1) * B],
        );
        losses.push(mlp.step(dev, &[batch]).unwrap().loss);
    }
    // Held out: the last 4 batches of a longer stream (its first 7 samples are skipped
    // so that they differ from the training stream's start).
    let (mut loss, mut acc) = (0.0, 0.0);
    for k in 0..4 {
        let off = 7 + k * B;
        let (l, a) = evaluate(
            &mlp.model,
            dev,
            &hx[off * cfg.inputs..(off + B) * cfg.inputs],
            &hy[off..off + B],
        );
        loss += l / 4.0;
        acc += a / 4.0;
    }
    (losses, loss, acc)
}

#[test]
fn mlp_learns_in_fp32_fp16_and_bf16_within_a_band_of_fp32() {
    let dev = gpu("vulkan", false);
    let steps = 60;
    let (l32, h32, a32) = train(dev.as_ref(), DType::F32, steps);
    assert!(
        l32[0] > 1.0,
        "first loss {} should be near ln 4 = 1.39",
        l32[0]
    );
    assert!(
        h32 < 0.3 && a32 > 0.9,
        "fp32: held-out loss {h32}, accuracy {a32}"
    );
    for (p, dev) in [
        (DType::F16, gpu("vulkan", false)),
        (DType::F16, gpu("gl", false)),
        (DType::BF16, gpu("vulkan", false)),
    ] {
        let (l, h, a) = train(dev.as_ref(), p, steps);
        let name = format!("{p:?} on {}", dev.caps().backend);
        assert!(
            h < 0.3 && a > 0.9,
            "{name}: held-out loss {h}, accuracy {a}"
        );
        // The mixed-precision curve stays within 0.15 of fp32 over the last 20 steps
        // (skipped fp16 steps early on and 16-bit rounding make it differ a little).
        for s in steps - 20..steps {
            assert!(
                (l[s] - l32[s]).abs() < 0.15,
                "{name}: step {s} loss {} vs fp32 {}",
                l[s],
                l32[s]
            );
        }
    }
}

#[test]
fn gpu_training_matches_the_cpu_reference_in_fp32() {
    let gpu_dev = gpu("vulkan", false);
    let cpu = kiln::cpu::CpuDevice::new();
    let cfg = model();
    let (x, y) = clusters(cfg.inputs, cfg.classes, B * 5, 0.8, 3);
    let mut g = trainer(gpu_dev.as_ref(), DType::F32);
    let mut c = trainer(&cpu, DType::F32);
    for s in 0..5 {
        let batch = MicroBatch::features(
            &x[s * B * cfg.inputs..(s + 1) * B * cfg.inputs],
            &y[s * B..(s + 1) * B],
        );
        let (lg, lc) = (
            g.step(gpu_dev.as_ref(), std::slice::from_ref(&batch))
                .unwrap(),
            c.step(&cpu, &[batch]).unwrap(),
        );
        // f32 GEMMs with different summation orders: 1e-5 relative per step.
        assert!(
            (lg.loss - lc.loss).abs() < 1e-5 * (1.0 + lc.loss),
            "step {s}: gpu {} cpu {}",
            lg.loss,
            lc.loss
        );
    }
    for ((k, wg), (_, wc)) in g
        .model
        .parameters(gpu_dev.as_ref())
        .unwrap()
        .iter()
        .zip(c.model.parameters(&cpu).unwrap())
    {
        for (a, b) in wg.iter().zip(&wc) {
            // Adam normalises each step to ~lr, so 5 steps of f32 differences stay tiny.
            assert!((a - b).abs() < 1e-4, "tensor {k}: gpu {a}, cpu {b}");
        }
    }
}
