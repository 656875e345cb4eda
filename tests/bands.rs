//! Kernels over buffers larger than one storage binding, bound band by band.
//!
//! Lavapipe binds at most 128 MiB at once; GPT-2 small's flat buffers of parameters and
//! moments (~85M f32 = 340 MB) and its f32 token-embedding gradient (154 MB) are over
//! it. The devices here are opened with the limit lowered to `LIMIT` bytes, so buffers
//! of a few thousand elements take several bands, and every result is compared with
//! the CPU reference (which binds nothing) — bit for bit where each element is computed
//! alone, to f32 rounding where a reduction's order of additions changes with bands.

mod common;

use kiln::engine::kernels::{Axpy, Cast, EmbeddingBackward, Fill, GradScale, NonFinite, Reduce};
use std::sync::Arc;

use common::*;
use kiln::engine::models::mlp::Mlp;
use kiln::engine::models::{MicroBatch, Network, NetworkOptions};
use kiln::engine::{AdamStep, Buffer, DType, Device, HostData, Kernel, ReduceOp, SgdStep};
use kiln::wgpu::{find_adapter, DeviceOptions, WgpuDevice};

/// Far below any adapter's limit and a multiple of no band: 2,048 f32 a band.
const LIMIT: u64 = 9_000;
/// A prime number of elements: five bands of f32, the last one short and odd.
const N: usize = 10_007;

fn limited(backend: &str, disable_f16: bool) -> WgpuDevice {
    let index = find_adapter(backend).unwrap_or_else(|e| panic!("{e}"));
    WgpuDevice::open(
        index,
        &DeviceOptions {
            disable_f16,
            max_storage_binding: Some(LIMIT),
            ..Default::default()
        },
    )
    .unwrap_or_else(|e| panic!("opening {backend}: {e}"))
}

fn paths() -> Vec<(&'static str, WgpuDevice)> {
    vec![
        ("vulkan (native f16)", limited("vulkan", false)),
        ("vulkan (packed f16)", limited("vulkan", true)),
        ("gl (packed f16)", limited("gl", false)),
    ]
}

fn values(n: usize, seed: u64, lo: f32, hi: f32) -> Vec<f32> {
    let mut rng = Rng::new(seed);
    (0..n).map(|_| rng.uniform(lo, hi)).collect()
}

/// Three optimizer steps over banded flat buffers, each after a banded sum of squares
/// and the clip factor it gives, on `dev`; returns the master, moments, model copy and
/// the factor of the last step.
fn optimizer_chain(
    dev: &dyn Device,
    kind: &str,
    grads: DType,
    params: DType,
) -> (Vec<HostData>, f32) {
    let w = values(N, 1, -1.0, 1.0);
    let g = values(N, 2, -12.0, 12.0);
    let master = put(dev, &HostData::F32(w.clone()));
    let grad = put(dev, &HostData::from_f32(grads, &g));
    let m = put(dev, &HostData::F32(vec![0.0; N]));
    let v = put(dev, &HostData::F32(vec![0.0; N]));
    let value = put(dev, &HostData::from_f32(params, &w));
    let sumsq = dev.alloc(DType::F32, 1).unwrap();
    let scale = dev.alloc(DType::F32, 1).unwrap();
    for step in 1..=3 {
        dev.launch(&Kernel::Reduce(Reduce {
            op: ReduceOp::SumSquares,
            src: grad,
            dst: sumsq,
        }))
        .unwrap();
        dev.launch(&Kernel::GradScale(GradScale {
            sum_squares: sumsq,
            out: scale,
            loss_scale: 1024.0,
            clip: 0.5,
        }))
        .unwrap();
        let k = if kind == "sgd" {
            Kernel::Sgd(SgdStep {
                master,
                grads: grad,
                momentum_buf: m,
                params: Some(value),
                grad_scale: scale,
                lr: 0.1,
                momentum: 0.9,
                weight_decay: 0.01,
            })
        } else {
            Kernel::Adam(AdamStep {
                master,
                grads: grad,
                m,
                v,
                params: Some(value),
                grad_scale: scale,
                lr: 1e-2,
                beta1: 0.9,
                beta2: 0.999,
                eps: 1e-8,
                weight_decay: 0.1,
                decoupled: true,
                step,
            })
        };
        dev.launch(&k).unwrap();
    }
    dev.submit().unwrap();
    let out: Vec<HostData> = [master, m, v, value]
        .iter()
        .map(|&b| dev.download(b).unwrap())
        .collect();
    (out, dev.download(scale).unwrap().to_f32()[0])
}

/// The clip factor comes from a sum of squares whose additions are grouped by band, so
/// it may differ from the CPU's in the last bits: the factor to 1e-6 relative, and the
/// states each to 4 ulps of f32 relative to the vector's scale plus that factor's share.
#[test]
fn optimizer_steps_and_their_norm_over_banded_flat_buffers_match_cpu() {
    let cpu = kiln::cpu::CpuDevice::new();
    for (name, dev) in paths() {
        for kind in ["adamw", "sgd"] {
            for (grads, params) in [(DType::F16, DType::F16), (DType::F32, DType::BF16)] {
                let what = format!("{name}: {kind}, grads {grads}, params {params}");
                let (got, gs) = optimizer_chain(&dev, kind, grads, params);
                let (want, cs) = optimizer_chain(&cpu, kind, grads, params);
                assert!(
                    ((gs - cs) / cs).abs() < 1e-6,
                    "{what}: clip factor {gs} vs cpu {cs}"
                );
                for (i, (g, w)) in got.iter().zip(&want).enumerate() {
                    let (g, w) = (g.to_f32(), w.to_f32());
                    let rms = (w.iter().map(|x| x * x).sum::<f32>() / N as f32).sqrt();
                    // The 16-bit copy is rounded once from the master: one of its ulps.
                    let rel = if i == 3 {
                        2f32.powi(-7)
                    } else {
                        2f32.powi(-18)
                    };
                    for (j, (a, b)) in g.iter().zip(&w).enumerate() {
                        assert!(
                            (a - b).abs() <= (b.abs() + rms) * rel,
                            "{what}: state {i} element {j}: gpu {a}, cpu {b}"
                        );
                    }
                }
            }
        }
    }
}

/// Without the clip factor every element is computed alone: bit for bit.
#[test]
fn elementwise_fill_cast_and_overflow_check_over_bands_match_cpu_bit_for_bit() {
    let x = values(N, 5, -3.0, 3.0);
    for (name, dev) in paths() {
        // Cast f32 -> f16 and axpy over five bands.
        let pairs = run_both(
            &dev,
            &[
                HostData::F32(x.clone()),
                HostData::from_f32(DType::F16, &vec![0.0; N]),
                HostData::F32(values(N, 6, -1.0, 1.0)),
            ],
            |b| {
                (
                    Kernel::Cast(Cast {
                        src: b[0],
                        dst: b[1],
                    }),
                    vec![1],
                )
            },
        );
        assert_bits_eq(&format!("{name}: cast"), &pairs[0].0, &pairs[0].1);
        let pairs = run_both(
            &dev,
            &[
                HostData::F32(x.clone()),
                HostData::F32(values(N, 6, -1.0, 1.0)),
            ],
            |b| {
                (
                    Kernel::Axpy(Axpy {
                        alpha: 0.37,
                        x: b[0],
                        y: b[1],
                    }),
                    vec![1],
                )
            },
        );
        assert_bits_eq(&format!("{name}: axpy"), &pairs[0].0, &pairs[0].1);
        // Fill an f16 buffer of an odd length: eleven bands of 16-bit elements.
        let f16 = HostData::from_f32(DType::F16, &x[..N - 2]);
        let pairs = run_both(&dev, &[f16], |b| {
            (
                Kernel::Fill(Fill {
                    dst: b[0],
                    value: 0.25,
                }),
                vec![0],
            )
        });
        assert_bits_eq(&format!("{name}: fill"), &pairs[0].0, &pairs[0].1);
        assert!(pairs[0].0.to_f32().iter().all(|&v| v == 0.25), "{name}");
        // One inf in the last band is found; none, nothing found.
        for inf_at in [None, Some(N - 3), Some(3000)] {
            let mut g = x.clone();
            if let Some(i) = inf_at {
                g[i] = f32::INFINITY;
            }
            for dtype in [DType::F32, DType::F16] {
                let src = put(&dev, &HostData::from_f32(dtype, &g));
                let flag = dev.alloc(DType::U32, 1).unwrap();
                dev.launch(&Kernel::NonFinite(NonFinite {
                    srcs: vec![src],
                    flag,
                }))
                .unwrap();
                dev.submit().unwrap();
                let found = dev.download(flag).unwrap().bits()[0] != 0;
                assert_eq!(found, inf_at.is_some(), "{name}: {dtype} inf at {inf_at:?}");
            }
        }
    }
}

/// The table gradient over the limit is written band by band of whole rows: rows of 7
/// (bands start on rows that are multiples of 64, where 7-element rows meet a 256-byte
/// boundary) and tokens spread over every band, repeated, and one past the table.
#[test]
fn embedding_backward_over_a_banded_table_matches_cpu_bit_for_bit() {
    let (rows, dim, tokens) = (400usize, 7usize, 97usize);
    let mut rng = Rng::new(9);
    let mut ids: Vec<u32> = (0..tokens).map(|_| rng.next_u32() % rows as u32).collect();
    ids[5] = ids[40];
    ids[60] = rows as u32 + 3;
    for (name, dev) in paths() {
        let pairs = run_both(
            &dev,
            &[
                HostData::U32(ids.clone()),
                HostData::from_f32(DType::F16, &values(tokens * dim, 10, -1.0, 1.0)),
                HostData::F32(values(rows * dim, 11, -1.0, 1.0)),
            ],
            |b: &[Buffer]| {
                (
                    Kernel::EmbeddingBackward(EmbeddingBackward {
                        tokens: b[0],
                        dout: b[1],
                        dtable: b[2],
                        dim,
                    }),
                    vec![2],
                )
            },
        );
        assert_bits_eq(
            &format!("{name}: embedding backward"),
            &pairs[0].0,
            &pairs[0].1,
        );
    }
}

/// A model whose flat buffers of parameters are over the limit (fc1: 64 x 300 f32 = 75
/// KiB against 9 KB) trains through banded optimizer steps, overflow checks and
/// gradient norms, with the losses of the same model on an unlimited device: bit for
/// bit without clipping (every banded kernel is elementwise then), to 1e-6 with it.
#[test]
fn a_model_over_the_binding_limit_trains_like_on_an_unlimited_device() {
    let model = || {
        Arc::new(Mlp {
            inputs: 64,
            hidden: 300,
            classes: 5,
        })
    };
    let options = NetworkOptions {
        batch: 4,
        dtype: DType::F16,
        optimizer: adamw(),
        seed: 1,
        packed: false,
    };
    let x = values(4 * 64, 12, -1.0, 1.0);
    let batch = MicroBatch::features(&x, &[1, 4, 0, 2]);
    let train = |dev: &dyn Device, clip: f32| -> Vec<f64> {
        let mut net = Network::new(dev, model(), &options).unwrap();
        (0..4)
            .map(|_| {
                net.accumulate(dev, std::slice::from_ref(&batch), 1.0)
                    .unwrap();
                let (overflow, loss) = net.check(dev, clip).unwrap();
                assert!(!overflow);
                net.update(dev, 1e-2).unwrap();
                loss as f64
            })
            .collect()
    };
    let free = gpu("vulkan", false);
    let tight = limited("vulkan", false);
    let mem = Network::memory(model().as_ref(), &options).unwrap();
    assert!(mem.largest_parameter_buffer > LIMIT, "{mem:?}");
    assert_eq!(train(free.as_ref(), 0.0), train(&tight, 0.0));
    let (a, b) = (train(free.as_ref(), 0.05), train(&tight, 0.05));
    for (x, y) in a.iter().zip(&b) {
        assert!((x - y).abs() <= 1e-6 * x.abs(), "{a:?} vs {b:?}");
    }
}

/// The cross-entropy, its backward and the argmax over logits larger than one binding, bound band by
/// band of whole rows: the same bits as the same adapter binding them whole (each row is
/// computed alone, by the same shader), and the CPU reference's values to f32 rounding.
/// 1,000 rows of 13 (a vocabulary padded from 11): f32 rows take 8 bands of 128, f16
/// rows 4 of 256; every 7th target is ignored.
#[test]
fn cross_entropy_over_banded_logits_matches_the_whole_binding_bit_for_bit() {
    use kiln::engine::kernels::{CrossEntropy, CrossEntropyBackward};
    let (rows, vocab, classes) = (1000, 13, 11);
    let run = |dev: &dyn Device, dtype: DType| -> Vec<HostData> {
        let logits = put(
            dev,
            &HostData::from_f32(dtype, &values(rows * vocab, 3, -6.0, 6.0)),
        );
        let t: Vec<u32> = (0..rows as u32)
            .map(|r| {
                if r % 7 == 0 {
                    kiln::engine::IGNORE_TARGET
                } else {
                    r * 5 % classes as u32
                }
            })
            .collect();
        let targets = put(dev, &HostData::U32(t));
        let losses = dev.alloc(DType::F32, rows).unwrap();
        let lse = dev.alloc(DType::F32, rows).unwrap();
        let dlogits = dev.alloc(dtype, rows * vocab).unwrap();
        dev.launch(&Kernel::CrossEntropy(CrossEntropy {
            logits,
            targets,
            losses,
            lse,
            vocab,
            classes,
        }))
        .unwrap();
        dev.launch(&Kernel::CrossEntropyBackward(CrossEntropyBackward {
            logits,
            targets,
            lse,
            dlogits,
            vocab,
            classes,
            scale: 0.25,
        }))
        .unwrap();
        let best = dev.alloc(DType::U32, rows).unwrap();
        dev.launch(&Kernel::ArgMax(kiln::engine::kernels::ArgMax {
            x: logits,
            out: best,
            cols: vocab,
            classes,
        }))
        .unwrap();
        [losses, lse, dlogits, best]
            .iter()
            .map(|&b| dev.download(b).unwrap())
            .collect()
    };
    let cpu = kiln::cpu::CpuDevice::new();
    for (name, dev) in paths() {
        let backend = if name.starts_with("gl") {
            "gl"
        } else {
            "vulkan"
        };
        let whole = WgpuDevice::open(
            find_adapter(backend).unwrap(),
            &DeviceOptions {
                disable_f16: name.contains("packed") && backend == "vulkan",
                ..Default::default()
            },
        )
        .unwrap();
        for dtype in [DType::F32, DType::F16] {
            let (banded, one) = (run(&dev, dtype), run(&whole, dtype));
            let reference = run(&cpu, dtype);
            // The argmax picks the same class everywhere (ties are unlikely in random
            // values and go to the first on every device).
            assert_eq!(banded[3], reference[3], "{name} {dtype} argmax");
            for (k, what) in ["losses", "lse", "dlogits", "argmax"].iter().enumerate() {
                assert_bits_eq(&format!("{name} {dtype} {what}"), &banded[k], &one[k]);
                // exp and log differ in the last bits between shaders and the CPU; the
                // 16-bit gradients round them to 2^-11.
                let tol = if k == 2 && dtype == DType::F16 {
                    2e-3
                } else {
                    1e-5
                };
                for (a, b) in banded[k].to_f32().iter().zip(reference[k].to_f32()) {
                    assert!(
                        (a - b).abs() <= tol * (1.0 + b.abs()),
                        "{name} {dtype} {what}: {a} vs {b}"
                    );
                }
            }
        }
    }
}
