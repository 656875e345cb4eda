//! Layer kernels: GELU and layer norm, forward and backward.
//! - Backward passes against central finite differences of the forward pass, on the CPU
//!   backend (f32 storage, f64 arithmetic inside).
//! - GPU against the CPU reference on both f16 paths, over awkward shapes.

mod common;

use common::*;
use kiln::cpu::CpuDevice;
use kiln::engine::kernels::{
    Gelu, GeluBackward, LayerNorm, LayerNormBackward, MergeHeads, Softmax, SoftmaxBackward,
    SplitHeads,
};
use kiln::engine::{Buffer, DType, Device, HostData, Kernel};

fn vals(rng: &mut Rng, n: usize, lo: f32, hi: f32) -> Vec<f32> {
    (0..n).map(|_| rng.uniform(lo, hi)).collect()
}

fn f32s(dev: &dyn Device, b: Buffer) -> Vec<f32> {
    dev.download(b).unwrap().to_f32()
}

/// L = sum_i r_i * gelu(x_i), in f64 from the kernel's f32 outputs.
fn gelu_loss(dev: &CpuDevice, x: &[f32], r: &[f32]) -> f64 {
    let xb = put(dev, &HostData::F32(x.to_vec()));
    let out = dev.alloc(DType::F32, x.len()).unwrap();
    dev.launch(&Kernel::Gelu(Gelu { x: xb, out })).unwrap();
    f32s(dev, out)
        .iter()
        .zip(r)
        .map(|(&o, &r)| o as f64 * r as f64)
        .sum()
}

#[test]
fn gelu_backward_matches_finite_differences() {
    let dev = CpuDevice::new();
    let mut rng = Rng::new(1);
    let x = vals(&mut rng, 40, -4.0, 4.0);
    let r = vals(&mut rng, 40, -1.0, 1.0);
    let (xb, rb) = (
        put(&dev, &HostData::F32(x.clone())),
        put(&dev, &HostData::F32(r.clone())),
    );
    let dx = dev.alloc(DType::F32, 40).unwrap();
    dev.launch(&Kernel::GeluBackward(GeluBackward {
        x: xb,
        dout: rb,
        dx,
    }))
    .unwrap();
    let dx = f32s(&dev, dx);
    let h = 1e-2f32;
    for i in 0..x.len() {
        let (mut up, mut down) = (x.clone(), x.clone());
        up[i] += h;
        down[i] -= h;
        let fd = (gelu_loss(&dev, &up, &r) - gelu_loss(&dev, &down, &r)) / (2.0 * h as f64);
        // Central differences: O(h^2) truncation plus f32 output rounding / h.
        assert!(
            (fd - dx[i] as f64).abs() < 1e-3 * (1.0 + fd.abs()),
            "x={} fd {fd} vs {}",
            x[i],
            dx[i]
        );
    }
}

struct Ln {
    x: Vec<f32>,
    w: Vec<f32>,
    b: Vec<f32>,
    cols: usize,
}

/// Forward on `dev`: (out, mean, rstd) as f32, from inputs stored as `dtype`.
fn ln_forward(
    dev: &dyn Device,
    ln: &Ln,
    dtype: DType,
) -> (Buffer, Buffer, Buffer, Buffer, Buffer, Buffer) {
    let rows = ln.x.len() / ln.cols;
    let x = put(dev, &HostData::from_f32(dtype, &ln.x));
    let w = put(dev, &HostData::from_f32(dtype, &ln.w));
    let b = put(dev, &HostData::from_f32(dtype, &ln.b));
    let out = dev.alloc(dtype, ln.x.len()).unwrap();
    let mean = dev.alloc(DType::F32, rows).unwrap();
    let rstd = dev.alloc(DType::F32, rows).unwrap();
    dev.launch(&Kernel::LayerNorm(LayerNorm {
        x,
        weight: w,
        bias: b,
        out,
        mean,
        rstd,
        cols: ln.cols,
        eps: 1e-5,
    }))
    .unwrap();
    (x, w, b, out, mean, rstd)
}

fn ln_loss(dev: &CpuDevice, ln: &Ln, r: &[f32]) -> f64 {
    let (.., out, _, _) = ln_forward(dev, ln, DType::F32);
    f32s(dev, out)
        .iter()
        .zip(r)
        .map(|(&o, &r)| o as f64 * r as f64)
        .sum()
}

/// Backward on `dev` with dout = r: (dx, dweight, dbias). dweight/dbias start at 0.5
/// to check that they accumulate.
fn ln_backward(
    dev: &dyn Device,
    ln: &Ln,
    r: &[f32],
    dtype: DType,
) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
    let (x, w, _, _, mean, rstd) = ln_forward(dev, ln, dtype);
    let dout = put(dev, &HostData::from_f32(dtype, r));
    let dx = dev.alloc(dtype, ln.x.len()).unwrap();
    let dweight = put(dev, &HostData::F32(vec![0.5; ln.cols]));
    let dbias = put(dev, &HostData::F32(vec![0.5; ln.cols]));
    dev.launch(&Kernel::LayerNormBackward(LayerNormBackward {
        x,
        weight: w,
        mean,
        rstd,
        dout,
        dx,
        dweight,
        dbias,
        cols: ln.cols,
    }))
    .unwrap();
    dev.submit().unwrap();
    (f32s(dev, dx), f32s(dev, dweight), f32s(dev, dbias))
}

#[test]
fn layernorm_backward_matches_finite_differences() {
    let dev = CpuDevice::new();
    let mut rng = Rng::new(2);
    let (rows, cols) = (3, 7);
    let ln = Ln {
        x: vals(&mut rng, rows * cols, -2.0, 2.0),
        w: vals(&mut rng, cols, 0.5, 1.5),
        b: vals(&mut rng, cols, -0.5, 0.5),
        cols,
    };
    let r = vals(&mut rng, rows * cols, -1.0, 1.0);
    let (dx, dw, db) = ln_backward(&dev, &ln, &r, DType::F32);
    let h = 1e-2f32;
    let fd = |f: &dyn Fn(&mut Ln, f32)| {
        let (mut up, mut down) = (
            Ln {
                x: ln.x.clone(),
                w: ln.w.clone(),
                b: ln.b.clone(),
                cols,
            },
            Ln {
                x: ln.x.clone(),
                w: ln.w.clone(),
                b: ln.b.clone(),
                cols,
            },
        );
        f(&mut up, h);
        f(&mut down, -h);
        (ln_loss(&dev, &up, &r) - ln_loss(&dev, &down, &r)) / (2.0 * h as f64)
    };
    let close = |what: &str, fd: f64, got: f32| {
        assert!(
            (fd - got as f64).abs() < 2e-3 * (1.0 + fd.abs()),
            "{what}: fd {fd} vs backward {got}"
        );
    };
    for (i, &g) in dx.iter().enumerate() {
        close(&format!("dx[{i}]"), fd(&|l, d| l.x[i] += d), g);
    }
    for c in 0..cols {
        close(
            &format!("dweight[{c}]"),
            fd(&|l, d| l.w[c] += d),
            dw[c] - 0.5,
        );
        close(&format!("dbias[{c}]"), fd(&|l, d| l.b[c] += d), db[c] - 0.5);
    }
}

/// |gpu - cpu| <= tol * (|cpu| + scale) + one ulp of `dtype` at |cpu| (at least one
/// subnormal step for f16).
fn near(what: &str, got: &[f32], want: &[f32], tol: f32, dtype: DType) {
    let scale = want.iter().map(|v| v.abs()).fold(0f32, f32::max).max(1e-3);
    let ulp = match dtype {
        DType::F16 => 2f32.powi(-10),
        DType::BF16 => 2f32.powi(-7),
        _ => 0.0,
    };
    // Below 2^-14 f16 is subnormal: its spacing stops shrinking at 2^-24.
    let floor = if dtype == DType::F16 {
        2f32.powi(-24)
    } else {
        0.0
    };
    assert_eq!(got.len(), want.len(), "{what}");
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        let t = tol * (w.abs() + scale) + ulp * w.abs() + floor + 1e-30;
        assert!(
            (g - w).abs() <= t,
            "{what}: element {i}: gpu {g}, cpu {w} (tol {t})"
        );
    }
}

#[test]
fn gpu_layers_match_cpu_on_both_f16_paths() {
    let cpu = CpuDevice::new();
    let mut rng = Rng::new(3);
    for p in gpu_paths() {
        let dev = p.dev.as_ref();
        for dtype in DType::FLOATS {
            // GELU over awkward lengths.
            for n in [1usize, 7, 4099] {
                let x = HostData::from_f32(dtype, &vals(&mut rng, n, -6.0, 6.0));
                let out = run_both(dev, &[x.clone(), HostData::zeros(dtype, n)], |b| {
                    (Kernel::Gelu(Gelu { x: b[0], out: b[1] }), vec![1])
                });
                let what = format!("{}: gelu {dtype} x{n}", p.name);
                near(&what, &out[0].0.to_f32(), &out[0].1.to_f32(), 2e-6, dtype);
                let dy = HostData::from_f32(dtype, &vals(&mut rng, n, -1.0, 1.0));
                let out = run_both(dev, &[x, dy, HostData::zeros(dtype, n)], |b| {
                    (
                        Kernel::GeluBackward(GeluBackward {
                            x: b[0],
                            dout: b[1],
                            dx: b[2],
                        }),
                        vec![2],
                    )
                });
                near(
                    &format!("{what} backward"),
                    &out[0].0.to_f32(),
                    &out[0].1.to_f32(),
                    2e-6,
                    dtype,
                );
            }
            // Layer norm: one element, odd rows, a GPT width, a row longer than a
            // workgroup, many short rows.
            for (rows, cols) in [(1, 1), (3, 7), (5, 768), (2, 1001), (300, 5)] {
                let ln = Ln {
                    x: vals(&mut rng, rows * cols, -3.0, 3.0),
                    w: vals(&mut rng, cols, 0.5, 1.5),
                    b: vals(&mut rng, cols, -0.5, 0.5),
                    cols,
                };
                let what = format!("{}: layernorm {dtype} {rows}x{cols}", p.name);
                let (.., og, mg, rg) = ln_forward(dev, &ln, dtype);
                let (.., oc, mc, rc) = ln_forward(&cpu, &ln, dtype);
                // f32 reductions over `cols` against f64: a few ulps of f32 times cols.
                let tol = 4e-7 * (cols as f32).sqrt().max(1.0);
                near(
                    &format!("{what}: mean"),
                    &f32s(dev, mg),
                    &f32s(&cpu, mc),
                    tol,
                    DType::F32,
                );
                near(
                    &format!("{what}: rstd"),
                    &f32s(dev, rg),
                    &f32s(&cpu, rc),
                    tol,
                    DType::F32,
                );
                near(
                    &format!("{what}: out"),
                    &f32s(dev, og),
                    &f32s(&cpu, oc),
                    4.0 * tol,
                    dtype,
                );
                let r = vals(&mut rng, rows * cols, -1.0, 1.0);
                let (dxg, dwg, dbg) = ln_backward(dev, &ln, &r, dtype);
                let (dxc, dwc, dbc) = ln_backward(&cpu, &ln, &r, dtype);
                near(&format!("{what}: dx"), &dxg, &dxc, 8.0 * tol, dtype);
                let acc = 4e-7 * (rows as f32).max(1.0);
                near(&format!("{what}: dweight"), &dwg, &dwc, acc, DType::F32);
                near(&format!("{what}: dbias"), &dbg, &dbc, acc, DType::F32);
            }
        }
    }
}

/// Softmax of `x` (rows x cols) on `dev`, then its backward with dout = r.
fn softmax_both(
    dev: &dyn Device,
    x: &[f32],
    r: &[f32],
    cols: usize,
    causal: bool,
    dtype: DType,
) -> (Vec<f32>, Vec<f32>) {
    let rows = x.len() / cols;
    let xb = put(dev, &HostData::from_f32(dtype, x));
    let p = dev.alloc(dtype, x.len()).unwrap();
    let stats = dev.alloc(DType::F32, 2 * rows).unwrap();
    let scale = 0.37;
    dev.launch(&Kernel::Softmax(Softmax {
        x: xb,
        out: p,
        stats,
        cols,
        scale,
        causal,
    }))
    .unwrap();
    let dout = put(dev, &HostData::from_f32(dtype, r));
    let dx = dev.alloc(dtype, x.len()).unwrap();
    dev.launch(&Kernel::SoftmaxBackward(SoftmaxBackward {
        p,
        dout,
        dx,
        stats,
        cols,
        scale,
    }))
    .unwrap();
    dev.submit().unwrap();
    (f32s(dev, p), f32s(dev, dx))
}

#[test]
fn softmax_backward_matches_finite_differences() {
    let dev = CpuDevice::new();
    let mut rng = Rng::new(8);
    for causal in [false, true] {
        let (rows, cols) = (10, 5); // two stacked 5x5 score matrices when causal
        let x = vals(&mut rng, rows * cols, -3.0, 3.0);
        let r = vals(&mut rng, rows * cols, -1.0, 1.0);
        let (p, dx) = softmax_both(&dev, &x, &r, cols, causal, DType::F32);
        if causal {
            // Row 0 sees only column 0; row 6 (query 1 of the second matrix) columns 0-1.
            assert_eq!(p[0], 1.0);
            assert!(p[1..5].iter().all(|&v| v == 0.0), "{:?}", &p[..5]);
            assert!(p[30 + 2..35].iter().all(|&v| v == 0.0));
        }
        let loss = |x: &[f32]| -> f64 {
            let (p, _) = softmax_both(&dev, x, &r, cols, causal, DType::F32);
            p.iter().zip(&r).map(|(&a, &b)| a as f64 * b as f64).sum()
        };
        let h = 1e-2f32;
        for (i, &g) in dx.iter().enumerate() {
            let (mut up, mut down) = (x.clone(), x.clone());
            up[i] += h;
            down[i] -= h;
            let fd = (loss(&up) - loss(&down)) / (2.0 * h as f64);
            assert!(
                (fd - g as f64).abs() < 1e-3 * (1.0 + fd.abs()),
                "causal {causal} dx[{i}]: fd {fd} vs {g}"
            );
        }
    }
}

#[test]
fn gpu_softmax_matches_cpu_on_both_f16_paths() {
    let cpu = CpuDevice::new();
    let mut rng = Rng::new(9);
    for p in gpu_paths() {
        for dtype in DType::FLOATS {
            for (rows, cols, causal) in [
                (1, 1, false),
                (1, 1, true),
                (14, 7, true),
                (3, 1001, false),
                (128, 64, true),
                (259, 9, true),
            ] {
                let x = vals(&mut rng, rows * cols, -6.0, 6.0);
                let r = vals(&mut rng, rows * cols, -1.0, 1.0);
                let (pg, dg) = softmax_both(p.dev.as_ref(), &x, &r, cols, causal, dtype);
                let (pc, dc) = softmax_both(&cpu, &x, &r, cols, causal, dtype);
                let what = format!("{}: softmax {dtype} {rows}x{cols} causal {causal}", p.name);
                // exp and the f32 row statistics: a few ulps of f32 relative.
                near(&format!("{what}: p"), &pg, &pc, 2e-6, dtype);
                near(&format!("{what}: dx"), &dg, &dc, 4e-6, dtype);
            }
        }
    }
}

#[test]
fn split_and_merge_heads_match_cpu_and_invert_each_other() {
    let mut rng = Rng::new(10);
    for p in gpu_paths() {
        for dtype in DType::FLOATS {
            // batch 2, seq 3, 2 heads of 5 (odd head size), rows of q|k|v = 30 columns.
            let (b, t, heads, dim) = (2, 3, 2, 5);
            let width = 3 * heads * dim;
            let rows = HostData::from_f32(dtype, &vals(&mut rng, b * t * width, -1.0, 1.0));
            for offset in [0, heads * dim, 2 * heads * dim] {
                let what = format!("{}: heads {dtype} offset {offset}", p.name);
                let inputs = [rows.clone(), HostData::zeros(dtype, b * heads * t * dim)];
                let out = run_both(p.dev.as_ref(), &inputs, |bf| {
                    (
                        Kernel::SplitHeads(SplitHeads {
                            src: bf[0],
                            dst: bf[1],
                            seq: t,
                            heads,
                            width,
                            offset,
                        }),
                        vec![1],
                    )
                });
                assert_bits_eq(&format!("{what}: split"), &out[0].0, &out[0].1);
                // Merging back into a copy of the rows reproduces them exactly.
                let split = out[0].1.clone();
                let inputs = [split, rows.clone()];
                let back = run_both(p.dev.as_ref(), &inputs, |bf| {
                    (
                        Kernel::MergeHeads(MergeHeads {
                            src: bf[0],
                            dst: bf[1],
                            seq: t,
                            heads,
                            width,
                            offset,
                        }),
                        vec![1],
                    )
                });
                assert_bits_eq(&format!("{what}: merge"), &back[0].0, &rows);
                assert_bits_eq(&format!("{what}: merge cpu"), &back[0].1, &rows);
            }
        }
    }
}
