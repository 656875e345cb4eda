//! Llama's ops end to end: RMSNorm, rotary position embedding (RoPE) and the SwiGLU
//! gate, as kernels and as graph ops.
//! - RoPE against a rotation worked out by hand on two positions, on the CPU and every
//!   GPU path; at large positions against the CPU's exact (f64) angles.
//! - Each kernel's backward against central finite differences of its forward (CPU,
//!   f32 storage, f64 arithmetic inside).
//! - GPU against the CPU reference on all three paths (Vulkan native f16, Vulkan packed
//!   f16, GL packed f16), f32/f16/bf16 storage and mixes, awkward shapes.
//! - Each graph op's derived gradient against central differences of a small model's
//!   loss, the model ending in linear + cross-entropy as in tests/graph.rs.
//! - Bad shapes and arguments are errors that name the problem.

mod common;

use common::*;
use kiln::cpu::CpuDevice;
use kiln::engine::device::optim::ParamBuffers;
use kiln::engine::graph::{Bindings, Graph, Tensor};
use kiln::engine::kernels::{RmsNorm, RmsNormBackward, Rope, SwiGlu, SwiGluBackward};
use kiln::engine::{
    Buffer, DType, Device, HostData, Kernel, Optimizer, RopeFreqs, RopeScaling, IGNORE_TARGET,
};

fn vals(rng: &mut Rng, n: usize, lo: f32, hi: f32) -> Vec<f32> {
    (0..n).map(|_| rng.uniform(lo, hi)).collect()
}

fn f32s(dev: &dyn Device, b: Buffer) -> Vec<f32> {
    dev.download(b).unwrap().to_f32()
}

/// One unit in the last place of a value of magnitude `v` stored as `dtype`, at most
/// (the spacing below v's binade top); f16's spacing stops shrinking at 2^-24.
fn ulp16(dtype: DType, v: f32) -> f32 {
    match dtype {
        DType::F16 => 2f32.powi(-10) * v.abs() + 2f32.powi(-24),
        DType::BF16 => 2f32.powi(-7) * v.abs(),
        _ => 0.0,
    }
}

/// |gpu - cpu| <= tol * (|cpu| + scale) + one ulp of `dtype` at |cpu|, where scale is
/// the largest |cpu| of the output (at least 1e-3): a relative error plus an absolute
/// one at the output's scale, for results that may cancel. A 16-bit result may differ
/// by one ulp: both sides round slightly different f32 values to nearest.
fn near(what: &str, got: &[f32], want: &[f32], tol: f32, dtype: DType) {
    let scale = want.iter().map(|v| v.abs()).fold(0f32, f32::max).max(1e-3);
    assert_eq!(got.len(), want.len(), "{what}: length");
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        let t = tol * (w.abs() + scale) + ulp16(dtype, *w) + 1e-30;
        assert!(
            (g - w).abs() <= t,
            "{what}: element {i}: gpu {g}, cpu {w} (tol {t})"
        );
    }
}

/// |gpu - cpu| <= tol * mag + one ulp of `dtype` at |cpu|, with `mag` each result's
/// magnitude before cancellation (the sum of its terms' absolute values). Below the
/// smallest normal f32 a GPU may flush to zero (WGSL allows it).
fn near_mag(what: &str, got: &[f32], want: &[f32], mag: &[f32], tol: f32, dtype: DType) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    for (i, ((g, w), m)) in got.iter().zip(want).zip(mag).enumerate() {
        let t = tol * m + ulp16(dtype, *w) + f32::MIN_POSITIVE;
        assert!(
            (g - w).abs() <= t,
            "{what}: element {i}: gpu {g}, cpu {w} (tol {t}, magnitude {m})"
        );
    }
}

// ---------------------------------------------------------------------------------
// RMSNorm kernels

/// Storage dtypes of x, weight and out (dout is stored as out, dx as x): each dtype
/// alone, then the mixes training uses (16-bit activations with f32 norm weights) and
/// one of everything.
fn rms_dtype_sets() -> Vec<[DType; 3]> {
    use DType::*;
    vec![
        [F32, F32, F32],
        [F16, F16, F16],
        [BF16, BF16, BF16],
        [F16, F32, F16],
        [BF16, F32, F32],
        [F32, BF16, F16],
    ]
}

struct Rms {
    x: Vec<f32>,
    w: Vec<f32>,
    cols: usize,
}

/// Forward on `dev`: buffers (x, w, out, rstd), stored as `[x, w, out]` dtypes.
fn rms_forward(dev: &dyn Device, rms: &Rms, [dx, dw, dout]: [DType; 3]) -> [Buffer; 4] {
    let rows = rms.x.len() / rms.cols;
    let x = put(dev, &HostData::from_f32(dx, &rms.x));
    let w = put(dev, &HostData::from_f32(dw, &rms.w));
    let out = dev.alloc(dout, rms.x.len()).unwrap();
    let rstd = dev.alloc(DType::F32, rows).unwrap();
    dev.launch(&Kernel::RmsNorm(RmsNorm {
        x,
        weight: w,
        out,
        rstd,
        cols: rms.cols,
        eps: 1e-5,
    }))
    .unwrap();
    [x, w, out, rstd]
}

/// Backward on `dev` with dout = r: (dx, dweight). dweight starts at 0.5 to check that
/// it accumulates.
fn rms_backward(
    dev: &dyn Device,
    rms: &Rms,
    r: &[f32],
    dtypes: [DType; 3],
) -> (Vec<f32>, Vec<f32>) {
    let [x, w, _, rstd] = rms_forward(dev, rms, dtypes);
    let dout = put(dev, &HostData::from_f32(dtypes[2], r));
    let dx = dev.alloc(dtypes[0], rms.x.len()).unwrap();
    let dweight = put(dev, &HostData::F32(vec![0.5; rms.cols]));
    dev.launch(&Kernel::RmsNormBackward(RmsNormBackward {
        x,
        weight: w,
        rstd,
        dout,
        dx,
        dweight,
        cols: rms.cols,
    }))
    .unwrap();
    dev.submit().unwrap();
    (f32s(dev, dx), f32s(dev, dweight))
}

/// L = sum r * rmsnorm(x), in f64 from the kernel's f32 outputs.
fn rms_loss(dev: &CpuDevice, rms: &Rms, r: &[f32]) -> f64 {
    let [.., out, _] = rms_forward(dev, rms, [DType::F32; 3]);
    f32s(dev, out)
        .iter()
        .zip(r)
        .map(|(&o, &r)| o as f64 * r as f64)
        .sum()
}

#[test]
fn rmsnorm_backward_matches_finite_differences() {
    let dev = CpuDevice::new();
    let mut rng = Rng::new(1);
    let (rows, cols) = (3, 7);
    let rms = Rms {
        x: vals(&mut rng, rows * cols, -2.0, 2.0),
        w: vals(&mut rng, cols, 0.5, 1.5),
        cols,
    };
    let r = vals(&mut rng, rows * cols, -1.0, 1.0);
    let (dx, dw) = rms_backward(&dev, &rms, &r, [DType::F32; 3]);
    let h = 1e-2f32;
    let fd = |f: &dyn Fn(&mut Rms, f32)| {
        let mut up = Rms {
            x: rms.x.clone(),
            w: rms.w.clone(),
            cols,
        };
        let mut down = Rms {
            x: rms.x.clone(),
            w: rms.w.clone(),
            cols,
        };
        f(&mut up, h);
        f(&mut down, -h);
        (rms_loss(&dev, &up, &r) - rms_loss(&dev, &down, &r)) / (2.0 * h as f64)
    };
    // Central differences: O(h^2) truncation (curvature of unit-scale rows, ~1e-4) plus
    // the f32 rounding of 21 outputs divided by 2h (~1e-5).
    let close = |what: &str, fd: f64, got: f32| {
        assert!(
            (fd - got as f64).abs() < 2e-3 * (1.0 + fd.abs()),
            "{what}: fd {fd} vs backward {got}"
        );
    };
    for (i, &g) in dx.iter().enumerate() {
        close(&format!("dx[{i}]"), fd(&|m, d| m.x[i] += d), g);
    }
    for (c, &g) in dw.iter().enumerate() {
        close(&format!("dweight[{c}]"), fd(&|m, d| m.w[c] += d), g - 0.5);
    }
}

#[test]
fn gpu_rmsnorm_matches_cpu_on_all_paths() {
    let cpu = CpuDevice::new();
    let mut rng = Rng::new(2);
    for p in gpu_paths() {
        let dev = p.dev.as_ref();
        for dtypes in rms_dtype_sets() {
            // One element, odd rows of an odd width, a row longer than a workgroup, a
            // prime number of short rows past the CPU adapters' one-row-per-lane
            // threshold (128), a Llama-like width.
            for (rows, cols) in [(1, 1), (3, 7), (2, 1001), (131, 5), (4, 256)] {
                let rms = Rms {
                    x: vals(&mut rng, rows * cols, -3.0, 3.0),
                    w: vals(&mut rng, cols, 0.5, 1.5),
                    cols,
                };
                let what = format!("{}: rmsnorm {dtypes:?} {rows}x{cols}", p.name);
                let [.., og, rg] = rms_forward(dev, &rms, dtypes);
                let [.., oc, rc] = rms_forward(&cpu, &rms, dtypes);
                // A sum of `cols` positive f32 terms against f64: its rounding errors
                // walk randomly, a few f32 ulps times sqrt(cols) (as for layer norm);
                // inverseSqrt adds 2 ulps.
                let tol = 4e-7 * (cols as f32).sqrt().max(1.0);
                near(
                    &format!("{what}: rstd"),
                    &f32s(dev, rg),
                    &f32s(&cpu, rc),
                    tol,
                    DType::F32,
                );
                // out = x * rstd * w: rstd's error and two roundings.
                near(
                    &format!("{what}: out"),
                    &f32s(dev, og),
                    &f32s(&cpu, oc),
                    2.0 * tol,
                    dtypes[2],
                );
                let r = vals(&mut rng, rows * cols, -1.0, 1.0);
                let (dxg, dwg) = rms_backward(dev, &rms, &r, dtypes);
                let (dxc, dwc) = rms_backward(&cpu, &rms, &r, dtypes);
                // Both results are sums whose terms may cancel (with one column, dx is
                // rstd dy w eps / (x^2 + eps): nearly all of it cancels), so their error
                // is relative to the terms' magnitudes, worked out from the values as
                // stored: dx's rstd (|dy w| + |xhat| mean |dy w xhat|) and dweight's
                // 0.5 + sum |dy xhat|.
                let xs = HostData::from_f32(dtypes[0], &rms.x).to_f32();
                let ws = HostData::from_f32(dtypes[1], &rms.w).to_f32();
                let dys = HostData::from_f32(dtypes[2], &r).to_f32();
                let rstd = f32s(&cpu, rc);
                let term = |e: usize| (dys[e] * ws[e % cols]).abs();
                let xhat = |e: usize| (xs[e] * rstd[e / cols]).abs();
                let mean_abs: Vec<f32> = (0..rows)
                    .map(|row| {
                        let row = row * cols..(row + 1) * cols;
                        row.map(|e| term(e) * xhat(e)).sum::<f32>() / cols as f32
                    })
                    .collect();
                let dx_mag: Vec<f32> = (0..rows * cols)
                    .map(|e| rstd[e / cols] * (term(e) + xhat(e) * mean_abs[e / cols]))
                    .collect();
                let dw_mag: Vec<f32> = (0..cols)
                    .map(|c| {
                        0.5 + (0..rows)
                            .map(|row| (dys[row * cols + c] * xhat(row * cols + c)).abs())
                            .sum::<f32>()
                    })
                    .collect();
                // dx: the row sum m (f32 against f64, as rstd), rstd entering cubed and a
                // few roundings.
                near_mag(
                    &format!("{what}: dx"),
                    &dxg,
                    &dxc,
                    &dx_mag,
                    8.0 * tol,
                    dtypes[0],
                );
                // dweight: a column sum over `rows` rows in f32; (rows) f32 epsilons of
                // the terms' magnitude is the worst case of a sequential sum.
                let acc = 4e-7 * (rows as f32).max(1.0);
                near_mag(
                    &format!("{what}: dweight"),
                    &dwg,
                    &dwc,
                    &dw_mag,
                    acc,
                    DType::F32,
                );
            }
        }
    }
}

// ---------------------------------------------------------------------------------
// RoPE kernels

/// RoPE of `x` (rows of `cols`) on `dev`, stored as `[x, out]` dtypes.
fn rope_on(
    dev: &dyn Device,
    x: &[f32],
    (cols, dim, seq): (usize, usize, usize),
    freqs: impl Into<RopeFreqs>,
    inverse: bool,
    [dx, dout]: [DType; 2],
) -> Vec<f32> {
    let xb = put(dev, &HostData::from_f32(dx, x));
    let out = dev.alloc(dout, x.len()).unwrap();
    dev.launch(&Kernel::Rope(Rope {
        x: xb,
        out,
        cols,
        dim,
        seq,
        freqs: freqs.into(),
        inverse,
    }))
    .unwrap();
    dev.submit().unwrap();
    let o = f32s(dev, out);
    dev.free(xb).unwrap();
    dev.free(out).unwrap();
    o
}

/// The rotation of two positions worked out by hand. theta = 100, two heads of D = 4:
/// frequency 0 turns 1 rad per position, frequency 1 turns 100^(-2/4) = 0.1 rad. Row 0
/// (t = 0) is unchanged; row 1 (t = 1) turns pairs (0, 2) by 1 rad and (1, 3) by
/// 0.1 rad in each head, with
///   cos 1 = 0.5403023058681398,   sin 1 = 0.8414709848078965,
///   cos 0.1 = 0.9950041652780258, sin 0.1 = 0.09983341664682815.
/// Head 0 of row 1 is (1, 2, 3, 4):
///   out0 = 1 cos 1 - 3 sin 1     = 0.5403023058681398 - 2.5244129544236895 = -1.98411064855555
///   out1 = 2 cos 0.1 - 4 sin 0.1 = 1.9900083305560516 - 0.3993336665873126 =  1.59067466396874
///   out2 = 3 cos 1 + 1 sin 1     = 1.6209069176044194 + 0.8414709848078965 =  2.46237790241232
///   out3 = 4 cos 0.1 + 2 sin 0.1 = 3.9800166611121032 + 0.1996668332936563 =  4.17968349440576
/// Head 1 is (-0.5, 0.25, 2, -1):
///   out4 = -0.5 cos 1 - 2 sin 1       = -0.2701511529340699 - 1.6829419696157930 = -1.95309312254986
///   out5 = 0.25 cos 0.1 - (-1) sin 0.1 =  0.2487510413195065 + 0.0998334166468282 =  0.34858445796633
///   out6 = 2 cos 1 + (-0.5) sin 1     =  1.0806046117362796 - 0.4207354924039483 =  0.65986911933233
///   out7 = -1 cos 0.1 + 0.25 sin 0.1  = -0.9950041652780258 + 0.0249583541617070 = -0.97004581111632
const ROPE_HAND_X: [f32; 16] = [
    0.5, -1.0, 1.5, -2.0, 3.0, 0.75, -0.25, 1.0, // t = 0
    1.0, 2.0, 3.0, 4.0, -0.5, 0.25, 2.0, -1.0, // t = 1
];
const ROPE_HAND_OUT: [f64; 16] = [
    0.5,
    -1.0,
    1.5,
    -2.0,
    3.0,
    0.75,
    -0.25,
    1.0,
    -1.98411064855555,
    1.59067466396874,
    2.46237790241232,
    4.17968349440576,
    -1.95309312254986,
    0.34858445796633,
    0.65986911933233,
    -0.97004581111632,
];

#[test]
fn rope_matches_a_rotation_worked_out_by_hand() {
    let mut devices: Vec<(String, Box<dyn Device>)> =
        vec![("cpu".into(), Box::new(CpuDevice::new()))];
    for p in gpu_paths() {
        devices.push((p.name.into(), p.dev));
    }
    let shape = (8, 4, 2); // cols = 2 heads x 4, seq 2
    for (name, dev) in &devices {
        let got = rope_on(
            dev.as_ref(),
            &ROPE_HAND_X,
            shape,
            100.0,
            false,
            [DType::F32; 2],
        );
        // Angles of at most 1 rad: f32 angles, sin and cos are within ~1e-7 rad, so
        // outputs of magnitude <= 5 are within a few f32 ulps (2e-6 allows 4 ulps at 4).
        for (i, (&g, &w)) in got.iter().zip(&ROPE_HAND_OUT).enumerate() {
            assert!(
                (g as f64 - w).abs() <= 2e-6,
                "{name}: rope element {i}: {g}, by hand {w}"
            );
        }
        // The inverse rotation of the hand-computed output gives x back.
        let out: Vec<f32> = ROPE_HAND_OUT.iter().map(|&v| v as f32).collect();
        let back = rope_on(dev.as_ref(), &out, shape, 100.0, true, [DType::F32; 2]);
        for (i, (&g, &w)) in back.iter().zip(&ROPE_HAND_X).enumerate() {
            assert!(
                (g - w).abs() <= 2e-6,
                "{name}: inverse rope element {i}: {g}, expected x = {w}"
            );
        }
    }
}

/// Each element's error bound for RoPE of `x` on a GPU against the CPU's f64 rotation:
/// `(|x_i| + |x_partner|) * (ANGLE_REL * |a| + ANGLE_ABS)` plus a 16-bit output's ulp.
/// The angle `a = t theta^(-2i/D)` is f32 on the GPU: its inverse frequency is within a
/// few f32 ulps (exp2 of a fraction, the exponent split exactly) and the product rounds
/// once, so its error grows with |a| (ANGLE_REL, 4 f32 epsilons). Reduction modulo 2 pi
/// (<= 2.5e-7 rad), sin and cos of the reduced angle and the multiply-adds (~3 ulps of
/// the inputs' magnitude) stay below ANGLE_ABS at every position.
const ANGLE_REL: f64 = 4.0 * f32::EPSILON as f64;
const ANGLE_ABS: f64 = 2e-6;

fn rope_bounds(
    x: &[f32],
    (cols, dim, seq): (usize, usize, usize),
    freqs: impl Into<RopeFreqs>,
) -> Vec<f64> {
    let freqs = freqs.into();
    let half = dim / 2;
    (0..x.len())
        .map(|e| {
            let t = ((e / cols) % seq) as f64;
            let c = e % dim;
            let (i, partner) = if c < half {
                (c, e + half)
            } else {
                (c - half, e - half)
            };
            let a = t * freqs.inv_freq(i, dim);
            (x[e].abs() as f64 + x[partner].abs() as f64) * (ANGLE_REL * a + ANGLE_ABS)
        })
        .collect()
}

fn assert_rope_within(what: &str, got: &[f32], want: &[f32], bounds: &[f64], dtype: DType) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    for (e, ((&g, &w), &b)) in got.iter().zip(want).zip(bounds).enumerate() {
        let tol = b + ulp16(dtype, w) as f64;
        assert!(
            (g as f64 - w as f64).abs() <= tol,
            "{what}: element {e}: gpu {g}, cpu {w} (tol {tol:e})"
        );
    }
}

/// Llama 3's band rescaling with a short original context (64), so that the small
/// heads' frequencies fall in every band: with theta 10^4 and D = 10 the wavelengths
/// are 6.3 (kept: under 64 / 4), 40 (blended), 251 and more (slowed by the factor).
const SCALED: RopeFreqs = RopeFreqs {
    theta: 10000.0,
    scaling: Some(RopeScaling {
        factor: 8.0,
        low_freq_factor: 1.0,
        high_freq_factor: 4.0,
        original_max_position_embeddings: 64,
    }),
};

#[test]
fn gpu_rope_matches_cpu_on_all_paths() {
    let cpu = CpuDevice::new();
    let mut rng = Rng::new(3);
    // (batch, seq, heads, dim): the smallest head (D = 2), one position, odd halves
    // (D = 6: a 16-bit word holds one element of each half), 1 and 3 heads, a prime
    // sequence length, and a Llama head size.
    let shapes = [
        (1, 1, 1, 2),
        (1, 7, 3, 2),
        (2, 5, 3, 6),
        (3, 13, 1, 10),
        (1, 37, 2, 64),
    ];
    let mut dtype_pairs = vec![];
    for a in DType::FLOATS {
        for b in DType::FLOATS {
            dtype_pairs.push([a, b]);
        }
    }
    for p in gpu_paths() {
        let dev = p.dev.as_ref();
        for &(b, t, heads, dim) in &shapes {
            let cols = heads * dim;
            let x = vals(&mut rng, b * t * cols, -2.0, 2.0);
            for freqs in [10000.0.into(), 500000.0.into(), SCALED] {
                for dtypes in &dtype_pairs {
                    // Compare on the values as stored.
                    let xs = HostData::from_f32(dtypes[0], &x).to_f32();
                    let bounds = rope_bounds(&xs, (cols, dim, t), freqs);
                    for inverse in [false, true] {
                        let what = format!(
                            "{}: rope {dtypes:?} B{b} T{t} H{heads} D{dim} {freqs:?} \
                             inverse {inverse}",
                            p.name
                        );
                        let got = rope_on(dev, &xs, (cols, dim, t), freqs, inverse, *dtypes);
                        let want = rope_on(&cpu, &xs, (cols, dim, t), freqs, inverse, *dtypes);
                        assert_rope_within(&what, &got, &want, &bounds, dtypes[1]);
                    }
                }
            }
        }
    }
}

/// Far positions. With D = 2 the only frequency is 1, so the angle is the position
/// itself, exact in f32: the GPU's error is then the reduction modulo 2 pi, sin and cos
/// alone, and must stay at ANGLE_ABS (no growth with t) up to t = 2^18 (rows past 2^15 x
/// 2 pi also exercise the split multiple of 2 pi). With D = 8 the other frequencies'
/// angles carry the f32 inverse frequency's error, within ANGLE_REL |a|.
#[test]
fn gpu_rope_stays_accurate_at_large_positions() {
    let cpu = CpuDevice::new();
    let mut rng = Rng::new(4);
    let p = gpu_path(0);
    let dev = p.dev.as_ref();
    for (seq, dim, theta) in [(1usize << 18, 2usize, 10000.0f32), (20000, 8, 10000.0)] {
        let x = vals(&mut rng, seq * dim, -2.0, 2.0);
        let shape = (dim, dim, seq);
        let got = rope_on(dev, &x, shape, theta, false, [DType::F32; 2]);
        let want = rope_on(&cpu, &x, shape, theta, false, [DType::F32; 2]);
        let bounds: Vec<f64> = if dim == 2 {
            // a = t exactly: no ANGLE_REL term.
            (0..x.len())
                .map(|e| (x[e].abs() as f64 + x[e ^ 1].abs() as f64) * ANGLE_ABS)
                .collect()
        } else {
            rope_bounds(&x, shape, theta)
        };
        let what = format!("{}: rope T{seq} D{dim}", p.name);
        assert_rope_within(&what, &got, &want, &bounds, DType::F32);
    }
}

/// RoPE is linear, so its backward (the inverse rotation of dout) must equal the finite
/// differences of L = sum r * rope(x) up to rounding.
#[test]
fn rope_backward_matches_finite_differences() {
    let dev = CpuDevice::new();
    let mut rng = Rng::new(5);
    let (b, t, heads, dim) = (2, 3, 3, 4);
    let shape = (heads * dim, dim, t);
    let x = vals(&mut rng, b * t * heads * dim, -2.0, 2.0);
    let r = vals(&mut rng, x.len(), -1.0, 1.0);
    let dx = rope_on(&dev, &r, shape, 10.0, true, [DType::F32; 2]);
    let loss = |x: &[f32]| -> f64 {
        let o = rope_on(&dev, x, shape, 10.0, false, [DType::F32; 2]);
        o.iter().zip(&r).map(|(&a, &b)| a as f64 * b as f64).sum()
    };
    let h = 1e-2f32;
    for (i, &g) in dx.iter().enumerate() {
        let (mut up, mut down) = (x.clone(), x.clone());
        up[i] += h;
        down[i] -= h;
        let fd = (loss(&up) - loss(&down)) / (2.0 * h as f64);
        // Linear: no truncation error; f32 rounding of 36 outputs over 2h, ~1e-5.
        assert!(
            (fd - g as f64).abs() < 1e-4 * (1.0 + fd.abs()),
            "dx[{i}]: fd {fd} vs backward {g}"
        );
    }
}

// ---------------------------------------------------------------------------------
// SwiGLU kernels

/// silu(gate) * up on `dev` and its backward with dout = r: (out, dgate, dup), stored
/// as `[gate, up, out/dout, dgate, dup]` dtypes.
fn swiglu_on(
    dev: &dyn Device,
    gate: &[f32],
    up: &[f32],
    r: &[f32],
    [dg, du, dout, ddg, ddu]: [DType; 5],
) -> [Vec<f32>; 3] {
    let n = gate.len();
    let g = put(dev, &HostData::from_f32(dg, gate));
    let u = put(dev, &HostData::from_f32(du, up));
    let out = dev.alloc(dout, n).unwrap();
    dev.launch(&Kernel::SwiGlu(SwiGlu {
        gate: g,
        up: u,
        out,
    }))
    .unwrap();
    let d = put(dev, &HostData::from_f32(dout, r));
    let (dgate, dup) = (dev.alloc(ddg, n).unwrap(), dev.alloc(ddu, n).unwrap());
    dev.launch(&Kernel::SwiGluBackward(SwiGluBackward {
        gate: g,
        up: u,
        dout: d,
        dgate,
        dup,
    }))
    .unwrap();
    dev.submit().unwrap();
    let res = [f32s(dev, out), f32s(dev, dgate), f32s(dev, dup)];
    for b in [g, u, out, d, dgate, dup] {
        dev.free(b).unwrap();
    }
    res
}

#[test]
fn swiglu_backward_matches_finite_differences() {
    let dev = CpuDevice::new();
    let mut rng = Rng::new(6);
    let n = 40;
    let gate = vals(&mut rng, n, -6.0, 6.0);
    let up = vals(&mut rng, n, -2.0, 2.0);
    let r = vals(&mut rng, n, -1.0, 1.0);
    let f32s5 = [DType::F32; 5];
    let [_, dgate, dup] = swiglu_on(&dev, &gate, &up, &r, f32s5);
    let loss = |g: &[f32], u: &[f32]| -> f64 {
        let [o, ..] = swiglu_on(&dev, g, u, &r, f32s5);
        o.iter().zip(&r).map(|(&a, &b)| a as f64 * b as f64).sum()
    };
    let h = 1e-2f32;
    for i in 0..n {
        let (mut gu, mut gd) = (gate.clone(), gate.clone());
        gu[i] += h;
        gd[i] -= h;
        let fd_g = (loss(&gu, &up) - loss(&gd, &up)) / (2.0 * h as f64);
        let (mut uu, mut ud) = (up.clone(), up.clone());
        uu[i] += h;
        ud[i] -= h;
        let fd_u = (loss(&gate, &uu) - loss(&gate, &ud)) / (2.0 * h as f64);
        // O(h^2) truncation (silu''' is at most ~0.5) plus output rounding / 2h; exact
        // in `up`, where the output is linear.
        for (what, fd, got) in [("dgate", fd_g, dgate[i]), ("dup", fd_u, dup[i])] {
            assert!(
                (fd - got as f64).abs() < 1e-3 * (1.0 + fd.abs()),
                "{what}[{i}] at gate {}: fd {fd} vs backward {got}",
                gate[i]
            );
        }
    }
}

#[test]
fn gpu_swiglu_matches_cpu_on_all_paths() {
    use DType::*;
    let mut rng = Rng::new(7);
    // [gate, up, out (and dout), dgate, dup]: each dtype alone, then mixes.
    let sets = [
        [F32, F32, F32, F32, F32],
        [F16, F16, F16, F16, F16],
        [BF16, BF16, BF16, BF16, BF16],
        [F16, F16, F16, F32, F32],
        [BF16, F32, BF16, F16, F32],
        [F32, BF16, F16, BF16, F16],
    ];
    let cpu = CpuDevice::new();
    for p in gpu_paths() {
        let dev = p.dev.as_ref();
        for dtypes in sets {
            // One element, odd and prime lengths, past a workgroup of pairs.
            for n in [1usize, 7, 513, 4099] {
                let mut gate = vals(&mut rng, n, -12.0, 12.0);
                // Saturation both ways (exp(-g) overflows f32 at g = -100), and 0.
                for (slot, v) in gate.iter_mut().zip([-100.0, 100.0, 0.0, -1.2785]) {
                    *slot = v;
                }
                let up = vals(&mut rng, n, -2.0, 2.0);
                let r = vals(&mut rng, n, -1.0, 1.0);
                // Both sides read the values as stored.
                let gate = HostData::from_f32(dtypes[0], &gate).to_f32();
                let up = HostData::from_f32(dtypes[1], &up).to_f32();
                let r = HostData::from_f32(dtypes[2], &r).to_f32();
                let got = swiglu_on(dev, &gate, &up, &r, dtypes);
                let want = swiglu_on(&cpu, &gate, &up, &r, dtypes);
                let what = format!("{}: swiglu {dtypes:?} x{n}", p.name);
                // Each result's magnitude before cancellation, s = sigmoid(gate): out
                // |g s up|, dup |dout g s|, dgate |dout up| (s + |g| s (1 - s)) (silu'
                // crosses zero near g = -1.28 by cancellation of its two terms), times
                // its error in f32 ulps: exp(-g) is within 3 + 2|g| ulps (WGSL's bound:
                // exp2 of a rounded g log2(e)), which s = 1 / (1 + e) keeps for g < 0,
                // and 1 / (1 + e) and two or three products add about one each, against
                // the CPU's f64 rounded once: (8 + 2|g|) f32 epsilons.
                let mut mags = [vec![], vec![], vec![]];
                for i in 0..n {
                    let (g, u, d) = (gate[i] as f64, up[i] as f64, r[i] as f64);
                    let s = 1.0 / (1.0 + (-g).exp());
                    let ulps = 8.0 + 2.0 * g.abs();
                    mags[0].push((ulps * (g * s * u).abs()) as f32);
                    mags[1].push((ulps * (d * u).abs() * (s + g.abs() * s * (1.0 - s))) as f32);
                    mags[2].push((ulps * (d * g * s).abs()) as f32);
                }
                let tol = f32::EPSILON;
                for (k, name) in ["out", "dgate", "dup"].into_iter().enumerate() {
                    let dtype = dtypes[[2, 3, 4][k]];
                    let what = format!("{what}: {name}");
                    near_mag(&what, &got[k], &want[k], &mags[k], tol, dtype);
                }
            }
        }
    }
}

// ---------------------------------------------------------------------------------
// Graph ops: derived gradients against finite differences (as tests/graph.rs).

struct Model {
    g: Graph,
    params: Vec<ParamBuffers>,
    inputs: Vec<(Tensor, Buffer)>,
    /// d loss / d losses_r: 1 / the rows trained on.
    weight: f32,
}

/// Builds models: parameters uniform in a range, token ids and targets.
struct Builder<'a> {
    dev: &'a dyn Device,
    rng: Rng,
    g: Graph,
    params: Vec<ParamBuffers>,
    inputs: Vec<(Tensor, Buffer)>,
}

impl<'a> Builder<'a> {
    fn new(dev: &'a dyn Device, seed: u64) -> Builder<'a> {
        Builder {
            dev,
            rng: Rng::new(seed),
            g: Graph::new(),
            params: vec![],
            inputs: vec![],
        }
    }

    fn param(&mut self, name: &str, shape: &[usize], (lo, hi): (f32, f32)) -> Tensor {
        let n: usize = shape.iter().product();
        let init = vals(&mut self.rng, n, lo, hi);
        self.params
            .push(ParamBuffers::new(self.dev, &init, DType::F32, DType::F32).unwrap());
        self.g
            .param(name, shape, DType::F32, DType::F32, true)
            .unwrap()
    }

    fn ids(&mut self, name: &str, shape: &[usize], values: Vec<u32>) -> Tensor {
        let t = self.g.input(name, shape, DType::U32);
        self.inputs.push((t, put(self.dev, &HostData::U32(values))));
        t
    }

    /// Tokens (B, T) in 0..v.
    fn tokens(&mut self, b: usize, t: usize, v: usize) -> Tensor {
        let tok = (0..b * t).map(|_| self.rng.next_u32() % v as u32).collect();
        self.ids("tokens", &[b, t], tok)
    }

    /// Logits (B, T, V) -> cross-entropy against targets in 0..v, row 1 not trained on.
    fn loss(mut self, logits: Tensor) -> Model {
        let s = self.g.shape(logits).to_vec();
        let rows = s[0] * s[1];
        let mut tgt: Vec<u32> = (0..rows)
            .map(|_| self.rng.next_u32() % s[2] as u32)
            .collect();
        tgt[1] = IGNORE_TARGET;
        let y = self.ids("targets", &s[..2], tgt);
        self.g.cross_entropy(logits, y).unwrap();
        Model {
            g: self.g,
            params: self.params,
            inputs: self.inputs,
            weight: 1.0 / (rows - 1) as f32,
        }
    }
}

/// Every gradient element of every parameter against central differences of the loss.
fn check_gradients(dev: &CpuDevice, m: &Model) {
    let bindings = Bindings {
        params: m.params.clone(),
        inputs: m.inputs.clone(),
        groups: vec![],
    };
    let adamw = Optimizer::adamw(1e-2, 0.1);
    let mut plan = m.g.compile(dev, &bindings, Some(&adamw)).unwrap();
    plan.accumulate(dev, 1.0, m.weight, 0).unwrap();
    check_finite_differences(dev, &m.g, &m.params, &plan, m.weight);
    plan.free(dev).unwrap();
}

/// tokens -> embedding -> rmsnorm -> linear -> loss: the norm's weight gradient, and its
/// dx through the embedding table's.
#[test]
fn graph_rmsnorm_matches_finite_differences() {
    let dev = CpuDevice::new();
    let mut m = Builder::new(&dev, 11);
    let (b, t, c, v) = (2, 3, 6, 7);
    let tokens = m.tokens(b, t, v);
    let wte = m.param("wte", &[v, c], (-1.0, 1.0));
    let norm = m.param("norm.w", &[c], (0.5, 1.5));
    let head = m.param("head.w", &[c, v], (-1.0, 1.0));
    let x = m.g.embedding(tokens, wte).unwrap();
    let h = m.g.rmsnorm(x, norm, 1e-5).unwrap();
    let logits = m.g.linear(h, head, None).unwrap();
    check_gradients(&dev, &m.loss(logits));
}

/// tokens -> embedding -> linear -> rope (3 heads of 4) -> linear -> loss: RoPE's
/// backward carries the gradient to the projection before it and the table.
#[test]
fn graph_rope_matches_finite_differences() {
    let dev = CpuDevice::new();
    let mut m = Builder::new(&dev, 12);
    let (b, t, c, v, heads) = (2, 4, 12, 5, 3);
    let tokens = m.tokens(b, t, v);
    let wte = m.param("wte", &[v, c], (-1.0, 1.0));
    let wq = m.param("q.w", &[c, c], (-0.5, 0.5));
    let bq = m.param("q.b", &[c], (-0.3, 0.3));
    let head = m.param("head.w", &[c, v], (-0.7, 0.7));
    let x = m.g.embedding(tokens, wte).unwrap();
    let q = m.g.linear(x, wq, Some(bq)).unwrap();
    // theta 100: frequencies 1 and 0.1 rad per position, both felt over 4 positions.
    let q = m.g.rope(q, heads, 100.0).unwrap();
    let logits = m.g.linear(q, head, None).unwrap();
    check_gradients(&dev, &m.loss(logits));
}

/// tokens -> embedding -> gate and up projections -> swiglu -> down projection -> loss.
#[test]
fn graph_swiglu_matches_finite_differences() {
    let dev = CpuDevice::new();
    let mut m = Builder::new(&dev, 13);
    let (b, t, c, f, v) = (2, 3, 4, 6, 5);
    let tokens = m.tokens(b, t, v);
    let wte = m.param("wte", &[v, c], (-1.0, 1.0));
    let wg = m.param("gate.w", &[c, f], (-1.0, 1.0));
    let wu = m.param("up.w", &[c, f], (-1.0, 1.0));
    let wd = m.param("down.w", &[f, v], (-1.0, 1.0));
    let x = m.g.embedding(tokens, wte).unwrap();
    let gate = m.g.linear(x, wg, None).unwrap();
    let up = m.g.linear(x, wu, None).unwrap();
    let a = m.g.swiglu(gate, up).unwrap();
    let logits = m.g.linear(a, wd, None).unwrap();
    check_gradients(&dev, &m.loss(logits));
}

/// A Llama-shaped block: rmsnorm -> q projection -> rope -> residual add, then rmsnorm
/// -> swiglu MLP -> residual add, a final rmsnorm and the head. Also swiglu(u, u), one
/// tensor as both operands (its two gradient contributions must add up).
#[test]
fn graph_llama_block_matches_finite_differences() {
    let dev = CpuDevice::new();
    let mut m = Builder::new(&dev, 14);
    let (b, t, c, f, v, heads) = (2, 3, 4, 6, 5, 2);
    let tokens = m.tokens(b, t, v);
    let wte = m.param("wte", &[v, c], (-1.0, 1.0));
    let n1 = m.param("n1.w", &[c], (0.5, 1.5));
    let wq = m.param("q.w", &[c, c], (-0.7, 0.7));
    let n2 = m.param("n2.w", &[c], (0.5, 1.5));
    let wg = m.param("gate.w", &[c, f], (-1.0, 1.0));
    let wu = m.param("up.w", &[c, f], (-1.0, 1.0));
    let wd = m.param("down.w", &[f, c], (-0.7, 0.7));
    let ws = m.param("self.w", &[c, f], (-1.0, 1.0));
    let wsd = m.param("self_down.w", &[f, c], (-0.7, 0.7));
    let nf = m.param("nf.w", &[c], (0.5, 1.5));
    let g = &mut m.g;
    let x = g.embedding(tokens, wte).unwrap();
    let h = g.rmsnorm(x, n1, 1e-5).unwrap();
    let q = g.linear(h, wq, None).unwrap();
    let q = g.rope(q, heads, 10.0).unwrap();
    let x = g.add(x, q).unwrap();
    let h = g.rmsnorm(x, n2, 1e-5).unwrap();
    let gate = g.linear(h, wg, None).unwrap();
    let up = g.linear(h, wu, None).unwrap();
    let a = g.swiglu(gate, up).unwrap();
    let d = g.linear(a, wd, None).unwrap();
    let x = g.add(x, d).unwrap();
    let s = g.linear(x, ws, None).unwrap();
    let s = g.swiglu(s, s).unwrap();
    let d = g.linear(s, wsd, None).unwrap();
    let x = g.add(x, d).unwrap();
    let x = g.rmsnorm(x, nf, 1e-5).unwrap();
    let logits = g.linear_transposed(x, wte, None).unwrap();
    check_gradients(&dev, &m.loss(logits));
}

// ---------------------------------------------------------------------------------
// Errors

#[test]
fn bad_llama_ops_are_errors_that_name_the_problem() {
    let mut g = Graph::new();
    let x = g.input("x", &[2, 3, 6], DType::F32);
    let flat = g.input("flat", &[6, 6], DType::F32);
    let e = g.rope(x, 2, 10000.0).unwrap_err().to_string();
    assert!(
        e.contains("rope") && e.contains("head dim 3") && e.contains("even"),
        "{e}"
    );
    let e = g.rope(x, 4, 10000.0).unwrap_err().to_string();
    assert!(e.contains("divisible by the 4 heads"), "{e}");
    let e = g.rope(flat, 1, 10000.0).unwrap_err().to_string();
    assert!(e.contains("`flat`") && e.contains("(B, T, C)"), "{e}");
    let e = g.rope(x, 3, 0.0).unwrap_err().to_string();
    assert!(e.contains("theta"), "{e}");

    let w5 = g.param("w5", &[5], DType::F32, DType::F32, false).unwrap();
    let e = g.rmsnorm(x, w5, 1e-5).unwrap_err().to_string();
    assert!(e.contains("`w5`") && e.contains("one per feature"), "{e}");
    let w16 = g.param("w16", &[6], DType::F32, DType::F16, false).unwrap();
    let e = g.rmsnorm(x, w16, 1e-5).unwrap_err().to_string();
    assert!(e.contains("f32 gradient"), "{e}");
    let w = g.param("w", &[6], DType::F32, DType::F32, false).unwrap();
    let e = g.rmsnorm(x, w, 0.0).unwrap_err().to_string();
    assert!(e.contains("eps"), "{e}");
    let e = g.rmsnorm(x, flat, 1e-5).unwrap_err().to_string();
    assert!(e.contains("must be a parameter"), "{e}");

    let e = g.swiglu(x, flat).unwrap_err().to_string();
    assert!(
        e.contains("swiglu") && e.contains("[2, 3, 6]") && e.contains("[6, 6]"),
        "{e}"
    );

    // Kernel arguments, checked once for every backend.
    let buf = |id, dtype, len| Buffer { id, dtype, len };
    let rope = |dim, seq| {
        Kernel::Rope(Rope {
            x: buf(1, DType::F32, 24),
            out: buf(2, DType::F16, 24),
            cols: 6,
            dim,
            seq,
            freqs: 10000.0f32.into(),
            inverse: false,
        })
    };
    let e = rope(3, 2).validate().unwrap_err().to_string();
    assert!(e.contains("rope") && e.contains("even"), "{e}");
    let e = rope(4, 2).validate().unwrap_err().to_string();
    assert!(e.contains("whole heads"), "{e}");
    let e = rope(2, 3).validate().unwrap_err().to_string();
    assert!(e.contains("whole sequences of 3"), "{e}");
    rope(2, 4).validate().unwrap();
    let e = Kernel::RmsNorm(RmsNorm {
        x: buf(1, DType::F16, 12),
        weight: buf(2, DType::F32, 4),
        out: buf(3, DType::F16, 12),
        rstd: buf(4, DType::F16, 3),
        cols: 4,
        eps: 1e-5,
    })
    .validate()
    .unwrap_err()
    .to_string();
    assert!(e.contains("rmsnorm") && e.contains("`rstd`"), "{e}");
    let e = Kernel::RmsNormBackward(RmsNormBackward {
        x: buf(1, DType::F16, 12),
        weight: buf(2, DType::F32, 4),
        rstd: buf(3, DType::F32, 3),
        dout: buf(4, DType::F16, 12),
        dx: buf(5, DType::F16, 12),
        dweight: buf(6, DType::BF16, 4),
        cols: 4,
    })
    .validate()
    .unwrap_err()
    .to_string();
    assert!(e.contains("`dweight`"), "{e}");
    let e = Kernel::SwiGluBackward(SwiGluBackward {
        gate: buf(1, DType::F32, 10),
        up: buf(2, DType::F32, 10),
        dout: buf(3, DType::F32, 10),
        dgate: buf(4, DType::F32, 9),
        dup: buf(5, DType::F32, 10),
    })
    .validate()
    .unwrap_err()
    .to_string();
    assert!(
        e.contains("swiglu_backward") && e.contains("`dgate`"),
        "{e}"
    );
    let e = Kernel::SwiGlu(SwiGlu {
        gate: buf(1, DType::F32, 10),
        up: buf(2, DType::F32, 10),
        out: buf(1, DType::F32, 10),
    })
    .validate()
    .unwrap_err()
    .to_string();
    assert!(e.contains("both written and used"), "{e}");
}
