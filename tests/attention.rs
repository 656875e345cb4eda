//! Fused attention (`Kernel::Attention`, `Kernel::AttentionBackward`):
//! - the CPU reference against central finite differences of itself (f64 inside);
//! - every GPU path against the CPU reference over head dims, sequence lengths, the
//!   causal mask and storage dtypes;
//! - device memory linear in T;
//! - the GPT with fused attention against the straightforward version.

mod common;

use common::*;
use kiln::cpu::CpuDevice;
use kiln::engine::{Buffer, DType, Device, HostData, Kernel};

#[derive(Clone, Copy, Debug)]
struct Case {
    heads: usize,
    seq: usize,
    dim: usize,
    causal: bool,
    dtype: DType,
}

impl Case {
    fn scale(&self) -> f32 {
        1.0 / (self.dim as f32).sqrt()
    }
    fn len(&self) -> usize {
        self.heads * self.seq * self.dim
    }
}

/// q, k in [-2, 2) (scores of a few units: softmax rows neither flat nor one-hot),
/// v and dout in [-1, 1).
fn inputs(c: &Case, seed: u64) -> [HostData; 4] {
    let mut rng = Rng::new(seed);
    let mut gen = |w: f32| -> HostData {
        let v: Vec<f32> = (0..c.len()).map(|_| rng.uniform(-w, w)).collect();
        HostData::from_f32(c.dtype, &v)
    };
    [gen(2.0), gen(2.0), gen(1.0), gen(1.0)]
}

fn forward(dev: &dyn Device, c: &Case, q: Buffer, k: Buffer, v: Buffer) -> (Buffer, Buffer) {
    let out = dev.alloc(c.dtype, c.len()).unwrap();
    let lse = dev.alloc(DType::F32, c.heads * c.seq).unwrap();
    dev.launch(&Kernel::Attention {
        q,
        k,
        v,
        out,
        lse,
        batch_heads: c.heads,
        seq: c.seq,
        dim: c.dim,
        scale: c.scale(),
        causal: c.causal,
    })
    .unwrap();
    (out, lse)
}

/// (out, lse, dq, dk, dv) on `dev`. The backward takes `saved` (out, lse) when given
/// (the CPU's, so that the GPU backward is judged on the same inputs as the CPU's).
fn run(
    dev: &dyn Device,
    c: &Case,
    data: &[HostData; 4],
    saved: Option<(&HostData, &HostData)>,
) -> [HostData; 5] {
    let [q, k, v, dout] = data.each_ref().map(|d| put(dev, d));
    let (out, lse) = forward(dev, c, q, k, v);
    let (bout, blse) = match saved {
        Some((o, l)) => (put(dev, o), put(dev, l)),
        None => (out, lse),
    };
    let grads = [0; 3].map(|_| dev.alloc(c.dtype, c.len()).unwrap());
    dev.launch(&Kernel::AttentionBackward {
        q,
        k,
        v,
        out: bout,
        dout,
        lse: blse,
        dq: grads[0],
        dk: grads[1],
        dv: grads[2],
        batch_heads: c.heads,
        seq: c.seq,
        dim: c.dim,
        scale: c.scale(),
        causal: c.causal,
    })
    .unwrap();
    dev.submit().unwrap();
    let res = [out, lse, grads[0], grads[1], grads[2]].map(|b| dev.download(b).unwrap());
    for b in [q, k, v, dout, out, lse, grads[0], grads[1], grads[2]] {
        dev.free(b).unwrap();
    }
    if saved.is_some() {
        dev.free(bout).unwrap();
        dev.free(blse).unwrap();
    }
    res
}

/// Largest error of `got` against `want`, relative to the largest |want| of the tensor.
fn rel_err(got: &HostData, want: &HostData) -> f64 {
    let (g, w) = (got.to_f32(), want.to_f32());
    assert_eq!(g.len(), w.len());
    let scale = w
        .iter()
        .fold(0f64, |a, &x| a.max(x.abs() as f64))
        .max(1e-30);
    g.iter()
        .zip(&w)
        .map(|(&a, &b)| {
            if a.is_nan() {
                f64::INFINITY
            } else {
                (a as f64 - b as f64).abs() / scale
            }
        })
        .fold(0.0, f64::max)
}

/// Tolerance relative to a tensor's largest element. f32: the kernels sum in f32 in
/// another order than the f64 reference (measured errors ~1e-6; 1e-4 leaves room for
/// T = 512 sums). 16-bit: one rounding of the result to the dtype (half an ulp, 2^-11
/// for f16 and 2^-8 for bf16, relative to the element, at most that relative to the
/// largest) plus the f32 error can cross a rounding boundary: one ulp of the largest.
fn tolerance(dtype: DType) -> f64 {
    match dtype {
        DType::F32 => 1e-4,
        DType::F16 => 2f64.powi(-10) + 1e-4,
        DType::BF16 => 2f64.powi(-7) + 1e-4,
        DType::U32 => unreachable!(),
    }
}

/// Runs `c` on the GPU and the CPU; panics with every tensor's error if one is off.
fn check(path: &Path, c: &Case, seed: u64) {
    let cpu = CpuDevice::new();
    let data = inputs(c, seed);
    let want = run(&cpu, c, &data, None);
    let got = run(path.dev.as_ref(), c, &data, Some((&want[0], &want[1])));
    let names = ["out", "lse", "dq", "dk", "dv"];
    let mut report = vec![];
    let mut bad = false;
    for i in 0..5 {
        let tol = if i == 1 { 1e-5 } else { tolerance(c.dtype) };
        let e = rel_err(&got[i], &want[i]);
        report.push(format!("{} {e:.2e} (tol {tol:.1e})", names[i]));
        bad |= !(e <= tol);
    }
    eprintln!("{} {c:?}: {}", path.name, report.join(", "));
    assert!(!bad, "{} {c:?}: {}", path.name, report.join(", "));
}

#[test]
fn smoke() {
    let paths = gpu_paths();
    for p in &paths[..1] {
        for dim in [64] {
            for seq in [7, 64] {
                for causal in [false, true] {
                    check(
                        p,
                        &Case {
                            heads: 2,
                            seq,
                            dim,
                            causal,
                            dtype: DType::F32,
                        },
                        1,
                    );
                }
            }
        }
    }
}
