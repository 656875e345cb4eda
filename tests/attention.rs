//! Fused attention (`Kernel::Attention`, `Kernel::AttentionBackward`):
//! - the CPU reference against central finite differences of itself (f64 inside);
//! - every GPU path against the CPU reference over head dims, sequence lengths, the
//!   causal mask and storage dtypes;
//! - device memory linear in T;
//! - the GPT with fused attention against the straightforward version.

mod common;

use common::*;
use kiln::cpu::CpuDevice;
use kiln::engine::kernels::{self, AttentionBackward};
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
    dev.launch(&Kernel::Attention(kernels::Attention {
        q,
        k,
        v,
        out,
        lse,
        batch_heads: c.heads,
        group: 1,
        seq: c.seq,
        dim: c.dim,
        scale: c.scale(),
        causal: c.causal,
        documents: None,
    }))
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
    dev.launch(&Kernel::AttentionBackward(AttentionBackward {
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
        group: 1,
        seq: c.seq,
        dim: c.dim,
        scale: c.scale(),
        causal: c.causal,
        documents: None,
    }))
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

/// Largest error of `got` against `want`, relative to the largest |want| of the tensor,
/// or to 0.01 when all of it is smaller: at T = 1 dq and dk are exactly 0 (dout . v and
/// rowsum(dout * out) cancel), and f32 rounding noise of the O(1) terms is what is left.
fn rel_err(got: &HostData, want: &HostData) -> f64 {
    let (g, w) = (got.to_f32(), want.to_f32());
    assert_eq!(g.len(), w.len());
    let scale = w.iter().fold(0.01f64, |a, &x| a.max(x.abs() as f64));
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

/// Runs `c` on `dev` and the CPU; panics with every tensor's error if one is off.
fn check_on(name: &str, dev: &dyn Device, c: &Case, seed: u64) {
    let cpu = CpuDevice::new();
    let data = inputs(c, seed);
    let want = run(&cpu, c, &data, None);
    let got = run(dev, c, &data, Some((&want[0], &want[1])));
    let names = ["out", "lse", "dq", "dk", "dv"];
    let mut report = vec![];
    let mut bad = false;
    for i in 0..5 {
        // lse is f32 whatever the dtype: a log of a sum of f32 terms, ~1e-7 relative.
        let tol = if i == 1 { 1e-5 } else { tolerance(c.dtype) };
        let e = rel_err(&got[i], &want[i]);
        report.push(format!("{} {e:.1e}", names[i]));
        bad |= e.is_nan() || e > tol;
    }
    eprintln!("{} {c:?}: {}", name, report.join(", "));
    assert!(
        !bad,
        "{} {c:?}: errors relative to each tensor's largest element (tolerance {:.1e}, lse 1e-5): {}",
        name,
        tolerance(c.dtype),
        report.join(", ")
    );
}

/// Every case of `dims` x `seqs` x (no mask, causal) for one dtype, heads = 3.
fn sweep(path: &Path, dtype: DType, dims: &[usize], seqs: &[usize]) {
    sweep_on(path.name, path.dev.as_ref(), dtype, dims, seqs);
}

/// [`sweep`] on any device; the number of cases.
fn sweep_on(name: &str, dev: &dyn Device, dtype: DType, dims: &[usize], seqs: &[usize]) -> u64 {
    let mut cases = 0;
    for &dim in dims {
        for &seq in seqs {
            for causal in [false, true] {
                let c = Case {
                    heads: 3,
                    seq,
                    dim,
                    causal,
                    dtype,
                };
                check_on(name, dev, &c, (dim * 1000 + seq) as u64);
                cases += 1;
            }
        }
    }
    cases
}

const SEQS: [usize; 4] = [1, 7, 64, 129];

/// Every head dim and length in f32 (T = 512 at d = 64), f16 and bf16 at d = 64, and
/// head dims that are not a multiple of 4 (5 in f32, 6 in f16: scalar loads and stores).
#[test]
fn vulkan_native_f16_matches_cpu() {
    let path = gpu_path(0);
    sweep(&path, DType::F32, &[32, 64, 128], &SEQS);
    sweep(&path, DType::F32, &[64], &[512]);
    sweep(&path, DType::F16, &[64], &SEQS);
    sweep(&path, DType::BF16, &[64], &[7, 129]);
    sweep(&path, DType::F32, &[5], &[7, 129]);
    sweep(&path, DType::F16, &[6], &[7, 129]);
}

/// The packed-f16 representation (no SHADER_F16) on the subgroup kernels.
#[test]
fn vulkan_packed_f16_matches_cpu() {
    let path = gpu_path(1);
    sweep(&path, DType::F16, &[32, 64], &SEQS);
    sweep(&path, DType::F16, &[32], &[512]);
    sweep(&path, DType::BF16, &[32], &[7, 129]);
    sweep(&path, DType::F16, &[6], &[7]);
}

/// GL (llvmpipe): no subgroups, so the kernels where every lane loads every key row.
/// (Slow to build and run on two cores: T = 512 is covered on the Vulkan paths.)
#[test]
fn gl_matches_cpu() {
    let path = gpu_path(2);
    sweep(&path, DType::F32, &[32], &SEQS);
    sweep(&path, DType::F16, &[64], &[7, 129]);
    sweep(&path, DType::BF16, &[128], &[7]);
}

/// The raw Vulkan backend (`vk:0`) runs every fused attention launch on its hand-written
/// GLSL passes (shaders/vulkan/attention.comp; a case here is one dispatch per pass):
/// head dims up to 128 and ones that are not a multiple of 4 (scalar loads and stores),
/// f32, f16 and bf16 in 16-bit storage, T = 1 to past one workgroup's rows, causal or
/// not. Then the GPU-shaped specialization (64-lane workgroups, every lane loading each
/// key row, no subgroup operations), which the device picks on a GPU, forced here.
/// Each head dim, dtype and shape is a pipeline compile on lavapipe (seconds each).
#[test]
fn vk_runs_the_glsl_passes_and_matches_cpu() {
    let vk = vk_device(false);
    let name = "vk (GLSL passes)";
    let mut cases = 0;
    cases += sweep_on(name, &vk, DType::F32, &[32], &[1, 7, 129]);
    cases += sweep_on(name, &vk, DType::F32, &[128], &[7]);
    cases += sweep_on(name, &vk, DType::F32, &[5], &[7, 129]);
    cases += sweep_on(name, &vk, DType::F16, &[64], &[7, 129]);
    cases += sweep_on(name, &vk, DType::F16, &[6], &[7]);
    cases += sweep_on(name, &vk, DType::BF16, &[32], &[7, 129]);
    assert_eq!(vk.attention_launches(), 3 * cases);
    let gpu_shaped = kiln::wgpu::AttentionPlan {
        sg: 8,
        wg: 64,
        rows: 1,
        shared: false,
    };
    vk.force_attention_plan(Some(gpu_shaped));
    let name = "vk (GLSL passes, GPU-shaped)";
    cases += sweep_on(name, &vk, DType::F32, &[32], &[7, 129]);
    cases += sweep_on(name, &vk, DType::BF16, &[6], &[13]);
    assert_eq!(vk.attention_launches(), 3 * cases);
}

/// `vk:0` opened without f16 has no 16-bit storage: the `_packed` builds of the GLSL
/// passes keep f16 and bf16 two to a word, as the WGSL packed representation does.
#[test]
fn vk_packed_f16_runs_the_glsl_passes_and_matches_cpu() {
    let vk = vk_device(true);
    let name = "vk (GLSL passes, packed f16)";
    let mut cases = 0;
    cases += sweep_on(name, &vk, DType::F16, &[32], &[7, 129]);
    cases += sweep_on(name, &vk, DType::F16, &[6], &[7]);
    cases += sweep_on(name, &vk, DType::BF16, &[32], &[7]);
    cases += sweep_on(name, &vk, DType::F32, &[5], &[7]);
    assert_eq!(vk.attention_launches(), 3 * cases);
}

/// Central finite differences of L = sum(dout * out) through the CPU forward (f64 inside,
/// f32 results) against the CPU backward, so that the oracle itself is checked.
#[test]
fn cpu_backward_matches_finite_differences() {
    let cpu = CpuDevice::new();
    for causal in [false, true] {
        let c = Case {
            heads: 2,
            seq: 5,
            dim: 3,
            causal,
            dtype: DType::F32,
        };
        let data = inputs(&c, 9);
        let grads = run(&cpu, &c, &data, None);
        let dout = data[3].to_f32();
        let loss = |which: usize, e: usize, h: f32| -> f64 {
            let mut d = data.clone();
            let mut x = d[which].to_f32();
            x[e] += h;
            d[which] = HostData::F32(x);
            let [q, k, v, _] = d.each_ref().map(|x| put(&cpu, x));
            let (out, _) = forward(&cpu, &c, q, k, v);
            let o = cpu.download(out).unwrap().to_f32();
            o.iter()
                .zip(&dout)
                .map(|(&a, &b)| a as f64 * b as f64)
                .sum()
        };
        let h = 1e-2f32;
        for (which, name) in [(0, "q"), (1, "k"), (2, "v")] {
            for (e, &g) in grads[2 + which].to_f32().iter().enumerate() {
                let fd = (loss(which, e, h) - loss(which, e, -h)) / (2.0 * h as f64);
                // O(h^2) truncation (~1e-4 here) and f32 outputs (1e-7 / h).
                assert!(
                    (fd - g as f64).abs() < 2e-4 + 1e-3 * fd.abs(),
                    "causal {causal}: d{name}[{e}] finite difference {fd}, backward {g}"
                );
            }
        }
    }
}

/// Device memory of the fused version's buffers (q, k, v, dout, out, lse, dq, dk, dv) at
/// T = 2048 is exactly twice that at T = 1024; the straightforward version's T x T
/// scores alone grow four times. Both sizes also run forward and backward.
#[test]
fn fused_memory_is_linear_in_seq() {
    let dev = gpu("vulkan", false);
    let dev = dev.as_ref();
    let (heads, dim) = (2, 64);
    let mut bytes = vec![];
    for seq in [1024, 2048] {
        let c = Case {
            heads,
            seq,
            dim,
            causal: true,
            dtype: DType::F32,
        };
        let before = dev.allocated_bytes();
        let data = inputs(&c, 4);
        let [q, k, v, dout] = data.each_ref().map(|d| put(dev, d));
        let (out, lse) = forward(dev, &c, q, k, v);
        let g = [0; 3].map(|_| dev.alloc(c.dtype, c.len()).unwrap());
        bytes.push(dev.allocated_bytes() - before);
        dev.launch(&Kernel::AttentionBackward(AttentionBackward {
            q,
            k,
            v,
            out,
            dout,
            lse,
            dq: g[0],
            dk: g[1],
            dv: g[2],
            batch_heads: heads,
            group: 1,
            seq,
            dim,
            scale: c.scale(),
            causal: true,
            documents: None,
        }))
        .unwrap();
        dev.submit().unwrap();
        for b in [out, g[0], g[1], g[2]] {
            let x = dev.download(b).unwrap().to_f32();
            assert!(
                x.iter().all(|v| v.is_finite()),
                "T = {seq}: non-finite output"
            );
        }
        for b in [q, k, v, dout, out, lse, g[0], g[1], g[2]] {
            dev.free(b).unwrap();
        }
        assert_eq!(dev.allocated_bytes(), before);
    }
    // 8 tensors of T*d f32 and one f32 per row: (8 * 64 + 1) * 4 bytes per row and head.
    assert_eq!(bytes[0], (heads * 1024 * (8 * dim + 1) * 4) as u64);
    assert_eq!(
        bytes[1],
        2 * bytes[0],
        "fused attention memory is not linear in T"
    );
}

/// Launch checks: sizes, dtypes, head dims and aliasing, each with its own message.
#[test]
fn validation_rejects_bad_launches() {
    let cpu = CpuDevice::new();
    let t = |dtype, n| cpu.alloc(dtype, n).unwrap();
    let (h, s, d) = (2, 4, 6);
    let n = h * s * d;
    let [q, k, v] = [0; 3].map(|_| t(DType::F32, n));
    let lse = t(DType::F32, h * s);
    let fwd = |out: Buffer, lse: Buffer, dim: usize, k: Buffer| {
        Kernel::Attention(kernels::Attention {
            q,
            k,
            v,
            out,
            lse,
            batch_heads: h,
            group: 1,
            seq: s,
            dim,
            scale: 0.5,
            causal: true,
            documents: None,
        })
    };
    let err = |k: Kernel| k.validate().unwrap_err().to_string();
    let out = t(DType::F32, n);
    assert!(fwd(out, lse, d, k).validate().is_ok());
    assert!(err(fwd(out, t(DType::F16, h * s), d, k)).contains("lse"));
    assert!(err(fwd(out, lse, d, t(DType::F32, n + 1))).contains("`k`"));
    let wide = t(DType::F32, h * s * 130);
    let e = Kernel::Attention(kernels::Attention {
        q: wide,
        k: wide,
        v: wide,
        out: t(DType::F32, h * s * 130),
        lse,
        batch_heads: h,
        group: 1,
        seq: s,
        dim: 130,
        scale: 0.5,
        causal: false,
        documents: None,
    });
    assert!(err(e).contains("1..=128"));
    let [q5, k5, v5] = [0; 3].map(|_| t(DType::F32, h * s * 5));
    let odd = Kernel::Attention(kernels::Attention {
        q: q5,
        k: k5,
        v: v5,
        out: t(DType::F16, h * s * 5),
        lse,
        batch_heads: h,
        group: 1,
        seq: s,
        dim: 5,
        scale: 0.5,
        causal: true,
        documents: None,
    });
    assert!(err(odd).contains("even head dim"));
    let mut nan = fwd(out, lse, d, k);
    if let Kernel::Attention(kernels::Attention { scale, .. }) = &mut nan {
        *scale = f32::NAN;
    }
    assert!(err(nan).contains("scale"));
    // Writing q's buffer, or two gradients into one buffer, is refused.
    assert!(err(fwd(q, lse, d, k)).contains("both written"));
    let dq = t(DType::F32, n);
    let bwd = Kernel::AttentionBackward(AttentionBackward {
        q,
        k,
        v,
        out,
        dout: t(DType::F32, n),
        lse,
        dq,
        dk: dq,
        dv: t(DType::F32, n),
        batch_heads: h,
        group: 1,
        seq: s,
        dim: d,
        scale: 0.5,
        causal: true,
        documents: None,
    });
    assert!(err(bwd).contains("both written"));
}

/// The GPT with fused attention against the straightforward version, fp32, same
/// weights and batch: loss and every parameter's gradient, on the CPU reference and on
/// Vulkan. Only the order of f32 sums (and exp2 for exp) differs, so the tolerances are
/// f32-sized: loss 1e-5 relative, each gradient 1e-4 of its tensor's largest element.
#[test]
fn gpt_fused_matches_straightforward() {
    use kiln::engine::graph::Attention;
    use kiln::engine::models::gpt::GptConfig;
    use kiln::engine::models::{MicroBatch, Network, NetworkOptions};
    use kiln::engine::{DType, Optimizer};
    let cfg = GptConfig {
        n_layer: 2,
        n_head: 2,
        n_embd: 32,
        block_size: 16,
        vocab_size: 13,
        padded_vocab_size: None,
    };
    let (b, t) = (2, 11);
    let mut rng = Rng::new(8);
    let tokens: Vec<u32> = (0..b * t + 1).map(|_| rng.next_u32() % 13).collect();
    let (tok, tgt) = (&tokens[..b * t], &tokens[1..]);
    let gpu = gpu("vulkan", false);
    let cpu = CpuDevice::new();
    for dev in [gpu.as_ref(), &cpu as &dyn Device] {
        let run = |attention: Attention| {
            let options = NetworkOptions {
                batch: b,
                dtype: DType::F32,
                optimizer: Optimizer::adamw(1e-2, 0.0),
                seed: 5,
                packed: false,
            };
            let mut gpt = Network::new(dev, gpt_model(&cfg, t, attention), &options).unwrap();
            let loss = gpt
                .loss_and_gradients(dev, &MicroBatch::tokens(tok, tgt))
                .unwrap();
            (loss, gpt.gradients(dev).unwrap())
        };
        let (lf, gf) = run(Attention::Fused);
        let (ls, gs) = run(Attention::Straightforward);
        let name = &dev.caps().name;
        assert!(
            (lf - ls).abs() <= 1e-5 * ls.abs(),
            "{name}: loss fused {lf}, straightforward {ls}"
        );
        let mut worst = 0f64;
        for ((n, a), (_, s)) in gf.iter().zip(&gs) {
            let scale = s.iter().fold(1e-12f64, |m, &x| m.max(x.abs() as f64));
            for (e, (&x, &y)) in a.iter().zip(s).enumerate() {
                let err = (x as f64 - y as f64).abs() / scale;
                worst = worst.max(err);
                assert!(
                    err <= 1e-4,
                    "{name}: {n}[{e}] fused {x}, straightforward {y} (largest {scale})"
                );
            }
        }
        eprintln!(
            "{name}: loss {lf} vs {ls}, worst gradient error {worst:.1e} of the tensor's largest"
        );
    }
}
