//! Optimizer kernels against the CPU reference: the whole fp16 update chain — sum of
//! squares of the scaled gradients, the device-side unscale/clip factor, and Adam,
//! AdamW or SGD over flat buffers writing f32 masters and 16-bit model weights.
//!
//! Tolerances: the GPU and CPU run the same f32 formulas in the same order, but a GPU
//! may fuse multiply-adds and WGSL's sqrt is not correctly rounded. An update like
//! `w - lr*wd*w - lr*u` can cancel to a value far smaller than its terms, so f32 state
//! is compared to 8 ulps of the vector's scale: |gpu - cpu| <= 2^-20 (|cpu| + rms(cpu)).
//! 16-bit weights, rounded once from those masters, to 1 ulp of their dtype.

mod common;

use common::*;
use kiln::engine::kernels::{GradScale, Reduce};
use kiln::engine::{AdamStep, Buffer, DType, Device, HostData, Kernel, ReduceOp, SgdStep};

fn close(what: &str, got: &HostData, want: &HostData) {
    let (g, w) = (got.to_f32(), want.to_f32());
    assert_eq!(g.len(), w.len(), "{what}");
    let rms = (w.iter().map(|x| x * x).sum::<f32>() / w.len() as f32).sqrt();
    for (i, (a, b)) in g.iter().zip(&w).enumerate() {
        let tol = (b.abs() + rms) * 2f32.powi(-20);
        assert!(
            (a - b).abs() <= tol,
            "{what}: element {i}: gpu {a}, cpu {b}"
        );
    }
}

struct Flat {
    master: Buffer,
    grads: Buffer,
    m: Buffer,
    v: Buffer,
    params: Option<Buffer>,
    sumsq: Buffer,
    scale: Buffer,
}

/// Uploads the same starting state to a device.
fn state(dev: &dyn Device, n: usize, grads: DType, params: Option<DType>) -> Flat {
    let mut rng = Rng::new(n as u64 + 3);
    let w: Vec<f32> = (0..n).map(|_| rng.uniform(-1.0, 1.0)).collect();
    // Gradients as the loss-scaled fp16 backward leaves them: around 1024 * 1e-2.
    let g: Vec<f32> = (0..n).map(|_| rng.uniform(-12.0, 12.0)).collect();
    Flat {
        master: put(dev, &HostData::F32(w.clone())),
        grads: put(dev, &HostData::from_f32(grads, &g)),
        m: put(dev, &HostData::F32(vec![0.0; n])),
        v: put(dev, &HostData::F32(vec![0.0; n])),
        params: params.map(|d| put(dev, &HostData::from_f32(d, &w))),
        sumsq: dev.alloc(DType::F32, 1).unwrap(),
        scale: dev.alloc(DType::F32, 1).unwrap(),
    }
}

/// Records three optimizer steps, each preceded by the norm and the scale factor.
fn steps(dev: &dyn Device, f: &Flat, kind: &str) {
    for step in 1..=3 {
        dev.launch(&Kernel::Reduce(Reduce {
            op: ReduceOp::SumSquares,
            src: f.grads,
            dst: f.sumsq,
        }))
        .unwrap();
        // Loss scale 1024, clip at global norm 0.001: below the unscaled norm (~0.02 and
        // up) of every multi-element case, so clipping is active there.
        dev.launch(&Kernel::GradScale(GradScale {
            sum_squares: f.sumsq,
            out: f.scale,
            loss_scale: 1024.0,
            clip: 0.001,
        }))
        .unwrap();
        let k = match kind {
            "sgd" => Kernel::Sgd(SgdStep {
                master: f.master,
                grads: f.grads,
                momentum_buf: f.m,
                params: f.params,
                grad_scale: f.scale,
                lr: 0.1,
                momentum: 0.9,
                weight_decay: 0.01,
            }),
            _ => Kernel::Adam(AdamStep {
                master: f.master,
                grads: f.grads,
                m: f.m,
                v: f.v,
                params: f.params,
                grad_scale: f.scale,
                lr: 1e-2,
                beta1: 0.9,
                beta2: 0.999,
                eps: 1e-8,
                weight_decay: 0.1,
                decoupled: kind == "adamw",
                step,
            }),
        };
        dev.launch(&k).unwrap();
    }
    dev.submit().unwrap();
}

#[test]
fn optimizer_chain_matches_cpu_on_both_f16_paths() {
    for p in gpu_paths() {
        for kind in ["adamw", "adam", "sgd"] {
            for (grads, params) in [
                (DType::F16, Some(DType::F16)),
                (DType::BF16, Some(DType::BF16)),
                (DType::F32, None),
            ] {
                for n in [1usize, 7, 4099] {
                    let what = format!("{}: {kind} grads {grads} params {params:?} n {n}", p.name);
                    let cpu = kiln::cpu::CpuDevice::new();
                    let (fg, fc) = (
                        state(p.dev.as_ref(), n, grads, params),
                        state(&cpu, n, grads, params),
                    );
                    steps(p.dev.as_ref(), &fg, kind);
                    steps(&cpu, &fc, kind);
                    let get = |d: &dyn Device, b: Buffer| d.download(b).unwrap();
                    let scale = get(p.dev.as_ref(), fg.scale).to_f32()[0];
                    let want_scale = get(&cpu, fc.scale).to_f32()[0];
                    assert!(
                        (scale - want_scale).abs() <= want_scale * 1e-6,
                        "{what}: scale {scale} vs {want_scale}"
                    );
                    if n > 1 {
                        let ss = get(&cpu, fc.sumsq).to_f32()[0];
                        assert!(
                            scale < 1.0 / 1024.0,
                            "{what}: clipping should be active: scale {scale}, sum of squares {ss}"
                        );
                    }
                    close(
                        &format!("{what}: master"),
                        &get(p.dev.as_ref(), fg.master),
                        &get(&cpu, fc.master),
                    );
                    close(
                        &format!("{what}: m"),
                        &get(p.dev.as_ref(), fg.m),
                        &get(&cpu, fc.m),
                    );
                    if kind != "sgd" {
                        close(
                            &format!("{what}: v"),
                            &get(p.dev.as_ref(), fg.v),
                            &get(&cpu, fc.v),
                        );
                    }
                    if let (Some(pg), Some(pc)) = (fg.params, fc.params) {
                        assert_ulps(
                            &format!("{what}: params"),
                            &get(p.dev.as_ref(), pg),
                            &get(&cpu, pc),
                            1,
                        );
                    }
                    // The master really moved: this is not a no-op kernel passing by luck.
                    let before = state(&cpu, n, grads, params);
                    assert_ne!(get(&cpu, before.master), get(&cpu, fc.master), "{what}");
                }
            }
        }
    }
}

#[test]
fn adam_matches_a_hand_computed_first_step() {
    // One element, w = 1, g = 2048 scaled by 1/1024 -> 2; no clipping. Step 1:
    // m = 0.1 * 2 = 0.2, v = 0.001 * 4 = 0.004, m^ = 2, v^ = 4, update = lr * 2 / (2 + eps)
    // = lr (to f32 precision). AdamW with wd 0.5, lr 0.1: w = 1 - 0.1 * 0.5 * 1 - 0.1 = 0.85.
    let dev = gpu("vulkan", false);
    let w = put(dev.as_ref(), &HostData::F32(vec![1.0]));
    let g = put(dev.as_ref(), &HostData::from_f32(DType::F16, &[2048.0]));
    let m = put(dev.as_ref(), &HostData::F32(vec![0.0]));
    let v = put(dev.as_ref(), &HostData::F32(vec![0.0]));
    let scale = put(dev.as_ref(), &HostData::F32(vec![1.0 / 1024.0]));
    let k = Kernel::Adam(AdamStep {
        master: w,
        grads: g,
        m,
        v,
        params: None,
        grad_scale: scale,
        lr: 0.1,
        beta1: 0.9,
        beta2: 0.999,
        eps: 1e-8,
        weight_decay: 0.5,
        decoupled: true,
        step: 1,
    });
    dev.launch(&k).unwrap();
    dev.submit().unwrap();
    let got = dev.download(w).unwrap().to_f32()[0];
    assert!((got - 0.85).abs() < 1e-6, "w = {got}");
    let mm = dev.download(m).unwrap().to_f32()[0];
    assert!((mm - 0.2).abs() < 1e-7, "m = {mm}");
}

#[test]
fn grad_scale_without_clipping_is_the_inverse_loss_scale() {
    for p in gpu_paths() {
        let ss = put(p.dev.as_ref(), &HostData::F32(vec![1e12]));
        let out = p.dev.alloc(DType::F32, 1).unwrap();
        p.dev
            .launch(&Kernel::GradScale(GradScale {
                sum_squares: ss,
                out,
                loss_scale: 65536.0,
                clip: 0.0,
            }))
            .unwrap();
        p.dev.submit().unwrap();
        assert_eq!(
            p.dev.download(out).unwrap(),
            HostData::F32(vec![1.0 / 65536.0]),
            "{}",
            p.name
        );
    }
}

#[test]
fn bad_optimizer_launches_are_errors() {
    let dev = gpu("vulkan", false);
    let f = state(dev.as_ref(), 8, DType::F16, Some(DType::F16));
    let short = dev.alloc(DType::F32, 7).unwrap();
    let base = AdamStep {
        master: f.master,
        grads: f.grads,
        m: f.m,
        v: f.v,
        params: f.params,
        grad_scale: f.scale,
        lr: 1e-3,
        beta1: 0.9,
        beta2: 0.999,
        eps: 1e-8,
        weight_decay: 0.0,
        decoupled: true,
        step: 1,
    };
    for (bad, needle) in [
        (
            AdamStep {
                m: short,
                ..base.clone()
            },
            "length",
        ),
        (
            AdamStep {
                master: f.grads,
                ..base.clone()
            },
            "dtype",
        ),
        (
            AdamStep {
                step: 0,
                ..base.clone()
            },
            "step counts from 1",
        ),
        (
            AdamStep {
                beta2: 1.0,
                ..base.clone()
            },
            "beta2",
        ),
        (
            AdamStep {
                lr: f32::NAN,
                ..base.clone()
            },
            "lr",
        ),
        (
            AdamStep {
                grad_scale: f.m,
                ..base.clone()
            },
            "grad_scale",
        ),
    ] {
        let e = dev.launch(&Kernel::Adam(bad)).unwrap_err().to_string();
        assert!(e.contains(needle), "{e}");
    }
}
