//! Fused softmax + cross-entropy and the token embedding, forward and backward, against
//! the CPU reference on both f16 paths, plus a finite-difference check of the loss
//! gradient on the CPU backend.

mod common;

use common::*;
use kiln::cpu::CpuDevice;
use kiln::engine::kernels::{CrossEntropy, CrossEntropyBackward, Embedding, EmbeddingBackward};
use kiln::engine::{DType, Device, HostData, Kernel, IGNORE_TARGET};

#[test]
fn cross_entropy_backward_matches_finite_differences() {
    let dev = CpuDevice::new();
    let mut rng = Rng::new(4);
    let (rows, vocab) = (3, 11);
    let logits: Vec<f32> = (0..rows * vocab).map(|_| rng.uniform(-3.0, 3.0)).collect();
    let targets = HostData::U32(vec![0, 10, 4]);
    let loss = |l: &[f32]| -> f64 {
        let lb = put(&dev, &HostData::F32(l.to_vec()));
        let t = put(&dev, &targets);
        let (losses, lse) = (
            dev.alloc(DType::F32, rows).unwrap(),
            dev.alloc(DType::F32, rows).unwrap(),
        );
        dev.launch(&Kernel::CrossEntropy(CrossEntropy {
            logits: lb,
            targets: t,
            losses,
            lse,
            vocab,
            classes: vocab,
        }))
        .unwrap();
        dev.download(losses)
            .unwrap()
            .to_f32()
            .iter()
            .map(|&v| v as f64)
            .sum::<f64>()
            / rows as f64
    };
    let lb = put(&dev, &HostData::F32(logits.clone()));
    let t = put(&dev, &targets);
    let (losses, lse) = (
        dev.alloc(DType::F32, rows).unwrap(),
        dev.alloc(DType::F32, rows).unwrap(),
    );
    dev.launch(&Kernel::CrossEntropy(CrossEntropy {
        logits: lb,
        targets: t,
        losses,
        lse,
        vocab,
        classes: vocab,
    }))
    .unwrap();
    let dl = dev.alloc(DType::F32, rows * vocab).unwrap();
    // d mean-loss / d loss_r = 1 / rows.
    let k = Kernel::CrossEntropyBackward(CrossEntropyBackward {
        logits: lb,
        targets: t,
        lse,
        dlogits: dl,
        vocab,
        classes: vocab,
        scale: 1.0 / rows as f32,
    });
    dev.launch(&k).unwrap();
    let grad = dev.download(dl).unwrap().to_f32();
    let h = 1e-2f32;
    for (i, &g) in grad.iter().enumerate() {
        let (mut up, mut down) = (logits.clone(), logits.clone());
        up[i] += h;
        down[i] -= h;
        let fd = (loss(&up) - loss(&down)) / (2.0 * h as f64);
        assert!(
            (fd - g as f64).abs() < 1e-3 * (1.0 + fd.abs()),
            "dlogits[{i}]: fd {fd} vs {g}"
        );
    }
}

fn near(what: &str, got: &[f32], want: &[f32], rel: f32, abs: f32) {
    assert_eq!(got.len(), want.len(), "{what}");
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        if w.is_nan() {
            assert!(g.is_nan(), "{what}: element {i}: gpu {g}, cpu NaN");
            continue;
        }
        assert!(
            (g - w).abs() <= rel * w.abs() + abs,
            "{what}: element {i}: gpu {g}, cpu {w}"
        );
    }
}

#[test]
fn cross_entropy_matches_cpu_on_both_f16_paths() {
    let mut rng = Rng::new(5);
    for p in gpu_paths() {
        for dtype in DType::FLOATS {
            for (rows, vocab) in [(1, 1), (3, 7), (5, 97), (2, 1001), (64, 50), (300, 13)] {
                let logits = HostData::from_f32(
                    dtype,
                    &(0..rows * vocab)
                        .map(|_| rng.uniform(-8.0, 8.0))
                        .collect::<Vec<_>>(),
                );
                // The last row's target is outside the vocabulary: its loss is NaN.
                let mut t: Vec<u32> = (0..rows).map(|_| rng.next_u32() % vocab as u32).collect();
                if rows > 1 {
                    t[rows - 1] = vocab as u32 + 3;
                }
                // The first row is not trained on: loss 0 and no gradient, exactly.
                let ignored = rows > 2;
                if ignored {
                    t[0] = IGNORE_TARGET;
                }
                let inputs = [
                    logits,
                    HostData::U32(t),
                    HostData::zeros(DType::F32, rows),
                    HostData::zeros(DType::F32, rows),
                    HostData::zeros(dtype, rows * vocab),
                ];
                let out = run_both(p.dev.as_ref(), &inputs, |b| {
                    (
                        Kernel::CrossEntropy(CrossEntropy {
                            logits: b[0],
                            targets: b[1],
                            losses: b[2],
                            lse: b[3],
                            vocab,
                            classes: vocab,
                        }),
                        vec![2, 3],
                    )
                });
                let what = format!("{}: cross-entropy {dtype} {rows}x{vocab}", p.name);
                // f32 statistics over `vocab` terms vs f64: relative ~1e-6 of the scale.
                near(
                    &format!("{what}: loss"),
                    &out[0].0.to_f32(),
                    &out[0].1.to_f32(),
                    1e-5,
                    1e-5,
                );
                near(
                    &format!("{what}: lse"),
                    &out[1].0.to_f32(),
                    &out[1].1.to_f32(),
                    1e-5,
                    1e-5,
                );
                let ulp = match dtype {
                    DType::F16 => 2f32.powi(-10),
                    DType::BF16 => 2f32.powi(-7),
                    _ => 0.0,
                };
                // The backward runs from the forward's lse, on each device.
                let dev = p.dev.as_ref();
                let cpu = CpuDevice::new();
                let grads = [dev, &cpu as &dyn Device].map(|d| {
                    let b: Vec<_> = inputs.iter().map(|h| put(d, h)).collect();
                    d.launch(&Kernel::CrossEntropy(CrossEntropy {
                        logits: b[0],
                        targets: b[1],
                        losses: b[2],
                        lse: b[3],
                        vocab,
                        classes: vocab,
                    }))
                    .unwrap();
                    d.launch(&Kernel::CrossEntropyBackward(CrossEntropyBackward {
                        logits: b[0],
                        targets: b[1],
                        lse: b[3],
                        dlogits: b[4],
                        vocab,
                        classes: vocab,
                        scale: 1024.0,
                    }))
                    .unwrap();
                    d.submit().unwrap();
                    d.download(b[4]).unwrap().to_f32()
                });
                near(
                    &format!("{what}: dlogits"),
                    &grads[0],
                    &grads[1],
                    1e-5 + ulp,
                    1024.0 * 1e-6,
                );
                if ignored {
                    assert_eq!(out[0].0.to_f32()[0], 0.0, "{what}: ignored row's loss");
                    assert!(
                        grads[0][..vocab].iter().all(|&g| g == 0.0),
                        "{what}: ignored row's gradient"
                    );
                }
            }
        }
    }
}

#[test]
fn embedding_matches_cpu_with_repeated_and_invalid_tokens() {
    let mut rng = Rng::new(6);
    for p in gpu_paths() {
        for dtype in DType::FLOATS {
            for (rows, dim) in [(1, 1), (5, 7), (97, 64)] {
                let table = HostData::from_f32(
                    dtype,
                    &(0..rows * dim)
                        .map(|_| rng.uniform(-1.0, 1.0))
                        .collect::<Vec<_>>(),
                );
                let mut tokens: Vec<u32> = (0..13).map(|_| rng.next_u32() % rows as u32).collect();
                tokens[3] = tokens[7]; // repeated: the backward must add both
                tokens[12] = rows as u32; // past the table: NaN forward, skipped backward
                let n = tokens.len();
                let inputs = [
                    table,
                    HostData::U32(tokens),
                    HostData::zeros(dtype, n * dim),
                ];
                let out = run_both(p.dev.as_ref(), &inputs, |b| {
                    (
                        Kernel::Embedding(Embedding {
                            tokens: b[1],
                            table: b[0],
                            out: b[2],
                            dim,
                        }),
                        vec![2],
                    )
                });
                let what = format!("{}: embedding {dtype} {rows}x{dim}", p.name);
                // A gather: bit-exact, the invalid row NaN on both.
                assert_bits_eq(&what, &out[0].0, &out[0].1);
                assert!(out[0].0.to_f32()[12 * dim].is_nan(), "{what}");
                let dout = HostData::from_f32(
                    dtype,
                    &(0..n * dim)
                        .map(|_| rng.uniform(-1.0, 1.0))
                        .collect::<Vec<_>>(),
                );
                let inputs = [
                    inputs[1].clone(),
                    dout,
                    HostData::F32(vec![0.25; rows * dim]),
                ];
                let out = run_both(p.dev.as_ref(), &inputs, |b| {
                    (
                        Kernel::EmbeddingBackward(EmbeddingBackward {
                            tokens: b[0],
                            dout: b[1],
                            dtable: b[2],
                            dim,
                        }),
                        vec![2],
                    )
                });
                // Same f32 additions in the same order (tokens in sequence): bit-exact.
                assert_bits_eq(&format!("{what} backward"), &out[0].0, &out[0].1);
            }
        }
    }
}

/// Runs the fused cross-entropy forward and backward on `dev`: (losses, dlogits).
fn cross_entropy_on(
    dev: &dyn Device,
    logits: &HostData,
    targets: &[u32],
    (vocab, classes): (usize, usize),
) -> (Vec<f32>, Vec<f32>) {
    let rows = targets.len();
    let (l, t) = (put(dev, logits), put(dev, &HostData::U32(targets.to_vec())));
    let (losses, lse) = (
        dev.alloc(DType::F32, rows).unwrap(),
        dev.alloc(DType::F32, rows).unwrap(),
    );
    let dl = dev.alloc(logits.dtype(), rows * vocab).unwrap();
    dev.launch(&Kernel::CrossEntropy(CrossEntropy {
        logits: l,
        targets: t,
        losses,
        lse,
        vocab,
        classes,
    }))
    .unwrap();
    dev.launch(&Kernel::CrossEntropyBackward(CrossEntropyBackward {
        logits: l,
        targets: t,
        lse,
        dlogits: dl,
        vocab,
        classes,
        scale: 64.0,
    }))
    .unwrap();
    dev.submit().unwrap();
    (
        dev.download(losses).unwrap().to_f32(),
        dev.download(dl).unwrap().to_f32(),
    )
}

/// A padded vocabulary: the padding columns hold large logits (as an imported model's
/// pad rows may give), yet the loss is the one over the real classes alone, their
/// gradient is exactly zero, and the real columns' gradient is the unpadded one. On the
/// CPU reference and both Vulkan f16 paths, in every float dtype, over awkward sizes.
#[test]
fn padding_columns_stay_out_of_the_cross_entropy() {
    let mut rng = Rng::new(15);
    let cpu = CpuDevice::new();
    let mut devices: Vec<(&str, Box<dyn Device>)> = vec![("cpu", Box::new(CpuDevice::new()))];
    for i in 0..2 {
        let p = gpu_path(i);
        devices.push((p.name, p.dev));
    }
    for (name, dev) in &devices {
        for dtype in DType::FLOATS {
            for (rows, classes, vocab) in [(1, 1, 2), (3, 7, 64), (5, 97, 128), (2, 257, 320)] {
                let real: Vec<f32> = (0..rows * classes)
                    .map(|_| rng.uniform(-4.0, 4.0))
                    .collect();
                let padded: Vec<f32> = (0..rows * vocab)
                    .map(|e| {
                        let (r, j) = (e / vocab, e % vocab);
                        if j < classes {
                            real[r * classes + j]
                        } else {
                            30.0
                        }
                    })
                    .collect();
                let targets: Vec<u32> = (0..rows)
                    .map(|r| {
                        if r == 0 {
                            classes as u32 - 1
                        } else {
                            rng.next_u32() % classes as u32
                        }
                    })
                    .collect();
                let what = format!("{name}: {dtype} {rows} rows, {classes} classes of {vocab}");
                let (want_loss, want_grad) = cross_entropy_on(
                    &cpu,
                    &HostData::from_f32(dtype, &real),
                    &targets,
                    (classes, classes),
                );
                let (loss, grad) = cross_entropy_on(
                    dev.as_ref(),
                    &HostData::from_f32(dtype, &padded),
                    &targets,
                    (vocab, classes),
                );
                near(&format!("{what}: loss"), &loss, &want_loss, 1e-5, 1e-5);
                let ulp = match dtype {
                    DType::F16 => 2f32.powi(-10),
                    DType::BF16 => 2f32.powi(-7),
                    _ => 0.0,
                };
                for r in 0..rows {
                    let row = &grad[r * vocab..(r + 1) * vocab];
                    assert!(
                        row[classes..].iter().all(|&g| g == 0.0),
                        "{what}: row {r}: padding got gradient {:?}",
                        &row[classes..]
                    );
                    near(
                        &format!("{what}: row {r} dlogits"),
                        &row[..classes],
                        &want_grad[r * classes..(r + 1) * classes],
                        1e-5 + ulp,
                        64.0 * 1e-6,
                    );
                }
                // A target among the padding columns is no class: NaN, as past the row.
                let mut bad = targets.clone();
                bad[rows - 1] = classes as u32;
                if classes < vocab {
                    let (loss, _) = cross_entropy_on(
                        dev.as_ref(),
                        &HostData::from_f32(dtype, &padded),
                        &bad,
                        (vocab, classes),
                    );
                    assert!(loss[rows - 1].is_nan(), "{what}: target in the padding");
                }
            }
        }
    }
    // Classes beyond the row are refused before any launch.
    let b = cpu.alloc(DType::F32, 4).unwrap();
    let t = cpu.alloc(DType::U32, 2).unwrap();
    let e = cpu
        .launch(&Kernel::CrossEntropy(CrossEntropy {
            logits: b,
            targets: t,
            losses: cpu.alloc(DType::F32, 2).unwrap(),
            lse: cpu.alloc(DType::F32, 2).unwrap(),
            vocab: 2,
            classes: 3,
        }))
        .unwrap_err()
        .to_string();
    assert!(e.contains("3 classes in rows of 2"), "{e}");
}
