//! Grouped-query attention (GQA): `group` consecutive query heads share one K/V head.
//! - the fused kernels with group > 1 against multi-head attention (group 1) over the
//!   K/V heads repeated on the host, on the CPU reference and every GPU path: out, lse
//!   and dq bit for bit (each query head does exactly the repeated launch's work), dk
//!   and dv against the repeated heads' gradients summed over each group;
//! - every GPU path against the CPU reference with group 2 and 3 over awkward shapes
//!   (T = 1, primes, T past one workgroup's rows, head dims 2..128 including ones that
//!   are not a multiple of 4) and the storage dtypes;
//! - the CPU reference's grouped backward against finite differences of itself;
//! - launch and graph checks with their messages;
//! - `Graph::attention` with kv_heads < heads against the same op on repeated K/V, on
//!   the CPU and every GPU path, fused and straightforward.
//!
//! (The graph op's gradients against finite differences are in tests/graph.rs.)

mod common;

use kiln::engine::kernels::{self, AttentionBackward};
use std::sync::Mutex;

use common::*;
use kiln::cpu::CpuDevice;
use kiln::engine::device::optim::ParamBuffers;
use kiln::engine::graph::Attention;
use kiln::engine::graph::{Bindings, Graph};
use kiln::engine::{DType, Device, HostData, Kernel, Optimizer};

/// Tests of this file that use the GL adapter take turns: its devices share one
/// context, and opening one while another test's compile holds it panics in wgpu.
static GL: Mutex<()> = Mutex::new(());

#[derive(Clone, Copy, Debug)]
struct Case {
    /// K/V heads (batch x kv_heads, flattened), each serving `group` query heads.
    kv: usize,
    group: usize,
    seq: usize,
    dim: usize,
    causal: bool,
    dtype: DType,
}

impl Case {
    fn heads(&self) -> usize {
        self.kv * self.group
    }
    fn scale(&self) -> f32 {
        1.0 / (self.dim as f32).sqrt()
    }
    fn q_len(&self) -> usize {
        self.heads() * self.seq * self.dim
    }
    fn kv_len(&self) -> usize {
        self.kv * self.seq * self.dim
    }
    /// The same attention as multi-head attention: one K/V head per query head.
    fn repeated(&self) -> Case {
        Case {
            kv: self.heads(),
            group: 1,
            ..*self
        }
    }
}

/// q, k in [-2, 2) (scores of a few units: softmax rows neither flat nor one-hot),
/// v and dout in [-1, 1); q and dout over the query heads, k and v over the K/V heads.
fn inputs(c: &Case, seed: u64) -> [HostData; 4] {
    let mut rng = Rng::new(seed);
    let mut gen = |w: f32, n: usize| -> HostData {
        let v: Vec<f32> = (0..n).map(|_| rng.uniform(-w, w)).collect();
        HostData::from_f32(c.dtype, &v)
    };
    [
        gen(2.0, c.q_len()),
        gen(2.0, c.kv_len()),
        gen(1.0, c.kv_len()),
        gen(1.0, c.q_len()),
    ]
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
    let out = dev.alloc(c.dtype, c.q_len()).unwrap();
    let lse = dev.alloc(DType::F32, c.heads() * c.seq).unwrap();
    dev.launch(&Kernel::Attention(kernels::Attention {
        q,
        k,
        v,
        out,
        lse,
        batch_heads: c.heads(),
        group: c.group,
        seq: c.seq,
        dim: c.dim,
        scale: c.scale(),
        causal: c.causal,
        documents: None,
    }))
    .unwrap();
    let (bout, blse) = match saved {
        Some((o, l)) => (put(dev, o), put(dev, l)),
        None => (out, lse),
    };
    let dq = dev.alloc(c.dtype, c.q_len()).unwrap();
    let [dk, dv] = [0; 2].map(|_| dev.alloc(c.dtype, c.kv_len()).unwrap());
    dev.launch(&Kernel::AttentionBackward(AttentionBackward {
        q,
        k,
        v,
        out: bout,
        dout,
        lse: blse,
        dq,
        dk,
        dv,
        batch_heads: c.heads(),
        group: c.group,
        seq: c.seq,
        dim: c.dim,
        scale: c.scale(),
        causal: c.causal,
        documents: None,
    }))
    .unwrap();
    dev.submit().unwrap();
    let res = [out, lse, dq, dk, dv].map(|b| dev.download(b).unwrap());
    for b in [q, k, v, dout, out, lse, dq, dk, dv] {
        dev.free(b).unwrap();
    }
    if saved.is_some() {
        dev.free(bout).unwrap();
        dev.free(blse).unwrap();
    }
    res
}

/// Each K/V head's (seq, dim) block once per query head it serves, in query head order
/// (exact: the values are copied, not rounded again).
fn repeat_heads(c: &Case, x: &HostData) -> HostData {
    let v = x.to_f32();
    let blk = c.seq * c.dim;
    let out: Vec<f32> = (0..c.heads())
        .flat_map(|h| v[h / c.group * blk..][..blk].iter().copied())
        .collect();
    HostData::from_f32(x.dtype(), &out)
}

/// The gradient of each K/V head from the repeated heads' gradients: the sum over its
/// group, in f64.
fn sum_groups(c: &Case, x: &HostData) -> Vec<f64> {
    let v = x.to_f32();
    let blk = c.seq * c.dim;
    (0..c.kv_len())
        .map(|e| {
            let (j, r) = (e / blk, e % blk);
            (0..c.group)
                .map(|g| v[(j * c.group + g) * blk + r] as f64)
                .sum()
        })
        .collect()
}

/// Largest error of `got` against `want`, relative to the largest |want| of the tensor,
/// or to 0.01 when all of it is smaller (at T = 1 dq and dk are exactly 0, and f32
/// rounding noise of the O(1) terms is what is left).
fn rel_err(got: &[f32], want: &[f64]) -> f64 {
    rel_err_to(got, want, 0.01)
}

/// [`rel_err`] relative to at least `floor`.
fn rel_err_to(got: &[f32], want: &[f64], floor: f64) -> f64 {
    assert_eq!(got.len(), want.len());
    let scale = want.iter().fold(floor, |a, &x| a.max(x.abs()));
    got.iter()
        .zip(want)
        .map(|(&a, &b)| {
            if a.is_nan() {
                f64::INFINITY
            } else {
                (a as f64 - b).abs() / scale
            }
        })
        .fold(0.0, f64::max)
}

fn f64s(x: &HostData) -> Vec<f64> {
    x.to_f32().iter().map(|&v| v as f64).collect()
}

/// Tolerance against the CPU reference, relative to a tensor's largest element (as in
/// tests/attention.rs). f32: the kernels sum in f32 in another order than the f64
/// reference (measured errors ~1e-6). 16-bit: one rounding of the result to the dtype
/// (half an ulp, 2^-11 for f16 and 2^-8 for bf16) plus the f32 error can cross a
/// rounding boundary: one ulp of the largest.
fn tolerance(dtype: DType) -> f64 {
    match dtype {
        DType::F32 => 1e-4,
        DType::F16 => 2f64.powi(-10) + 1e-4,
        DType::BF16 => 2f64.powi(-7) + 1e-4,
        DType::U32 => unreachable!(),
    }
}

/// Half an ulp of `dtype` at 1, relative: the error of one rounding to it.
fn half_ulp(dtype: DType) -> f64 {
    match dtype {
        DType::F32 => 2f64.powi(-24),
        DType::F16 => 2f64.powi(-11),
        DType::BF16 => 2f64.powi(-8),
        DType::U32 => unreachable!(),
    }
}

/// `c` on `dev` against multi-head attention over the repeated K/V heads on `dev`.
fn check_repeated(dev: &dyn Device, name: &str, c: &Case, seed: u64) {
    let data = inputs(c, seed);
    let got = run(dev, c, &data, None);
    let r = c.repeated();
    let rdata = [
        data[0].clone(),
        repeat_heads(c, &data[1]),
        repeat_heads(c, &data[2]),
        data[3].clone(),
    ];
    let want = run(dev, &r, &rdata, None);
    // Query head h reads the same rows of k and v as head h of the repeated launch, in
    // the same order: out, lse and dq are the same bits.
    for (i, what) in [(0, "out"), (1, "lse"), (2, "dq")] {
        assert_bits_eq(&format!("{name} {c:?}: {what}"), &got[i], &want[i]);
    }
    // dk, dv: the grouped kernel sums the group's contributions in f32 and rounds once;
    // the repeated launch rounds each head's gradient to the dtype before they are
    // summed here. So: f32 sums in another order (1e-5, errors measured ~1e-7), and for
    // 16-bit up to `group` roundings of the parts and one of the result, half an ulp
    // each; relative to the largest element of the sums or of the parts (which can be
    // larger where a group's contributions cancel).
    let tol = 1e-5 + (c.group + 1) as f64 * half_ulp(c.dtype);
    for (i, what) in [(3, "dk"), (4, "dv")] {
        let parts = want[i]
            .to_f32()
            .iter()
            .fold(0.01f64, |a, &x| a.max(x.abs() as f64));
        let e = rel_err_to(&got[i].to_f32(), &sum_groups(c, &want[i]), parts);
        assert!(
            e <= tol,
            "{name} {c:?}: {what} is {e:.1e} (of its largest element) off the repeated \
             heads' gradients summed over each group; tolerance {tol:.1e}"
        );
    }
}

/// `c` on the GPU against the CPU reference; panics with every tensor's error if one is
/// off.
fn check_cpu(path: &Path, c: &Case, seed: u64) {
    let cpu = CpuDevice::new();
    let data = inputs(c, seed);
    let want = run(&cpu, c, &data, None);
    let got = run(path.dev.as_ref(), c, &data, Some((&want[0], &want[1])));
    let names = ["out", "lse", "dq", "dk", "dv"];
    let mut report = vec![];
    let mut bad = false;
    for i in 0..5 {
        // lse is f32 whatever the dtype: a log of a sum of f32 terms, ~1e-7 relative.
        let tol = if i == 1 { 1e-5 } else { tolerance(c.dtype) };
        let e = rel_err(&got[i].to_f32(), &f64s(&want[i]));
        report.push(format!("{} {e:.1e}", names[i]));
        bad |= e.is_nan() || e > tol;
    }
    eprintln!("{} {c:?}: {}", path.name, report.join(", "));
    assert!(
        !bad,
        "{} {c:?}: errors relative to each tensor's largest element (tolerance {:.1e}, lse \
         1e-5): {}",
        path.name,
        tolerance(c.dtype),
        report.join(", ")
    );
}

/// (K/V heads, group): an odd number of K/V heads with group 2, one K/V head for three
/// query heads (multi-query attention).
const GROUPS: [(usize, usize); 2] = [(3, 2), (1, 3)];

/// Every case of `dims` x `seqs` x GROUPS x (no mask, causal) for one dtype.
fn sweep(path: &Path, dtype: DType, dims: &[usize], seqs: &[usize]) {
    for &dim in dims {
        for &seq in seqs {
            for (kv, group) in GROUPS {
                for causal in [false, true] {
                    let c = Case {
                        kv,
                        group,
                        seq,
                        dim,
                        causal,
                        dtype,
                    };
                    check_cpu(path, &c, (dim * 1000 + seq * 10 + group) as u64);
                }
            }
        }
    }
}

/// The grouped launch against the repeated one on `path` for both groups and masks.
fn sweep_repeated(path: &Path, dtype: DType, dim: usize, seq: usize) {
    for (kv, group) in GROUPS {
        for causal in [false, true] {
            let c = Case {
                kv,
                group,
                seq,
                dim,
                causal,
                dtype,
            };
            check_repeated(path.dev.as_ref(), path.name, &c, 7 + group as u64);
        }
    }
}

/// f32 over head dims 2 (less than one vec4: scalar loads and stores) and 36 (nine
/// vec4 column groups), T = 37 past one workgroup's rows; f16 at d = 12 and bf16 at
/// d = 6 (scalar loads and stores). Head dims are assembly constants, and each one
/// costs a compile of the three kernels (about 10 s at d = 36 on lavapipe here).
#[test]
fn vulkan_native_f16_matches_cpu_and_repeated_heads() {
    let path = gpu_path(0);
    sweep(&path, DType::F32, &[2, 36], &[1, 13, 37]);
    sweep(&path, DType::F16, &[12], &[13]);
    sweep(&path, DType::BF16, &[6], &[7]);
    sweep_repeated(&path, DType::F32, 36, 37);
    sweep_repeated(&path, DType::F16, 12, 13);
}

/// The largest head dim, alone: its kernels take about 90 s to compile cold on lavapipe
/// here, seconds when tests/attention.rs has built the same pipelines first (the group
/// is a launch parameter, so they are the same; Mesa caches them on disk).
#[test]
fn vulkan_head_dim_128_matches_cpu() {
    let path = gpu_path(0);
    sweep(&path, DType::F32, &[128], &[7]);
}

/// The raw Vulkan backend (`vk:0`), whose attention is its GLSL passes: the dk/dv
/// pass's walk over each K/V head's query heads, against the CPU and repeated heads.
#[test]
fn vk_matches_cpu_and_repeated_heads() {
    let path = gpu_path(3);
    sweep(&path, DType::F32, &[2, 36], &[13, 37]);
    sweep(&path, DType::BF16, &[6], &[7]);
    sweep_repeated(&path, DType::F32, 36, 37);
}

/// The packed-f16 representation (no SHADER_F16) on the subgroup kernels.
#[test]
fn vulkan_packed_f16_matches_cpu_and_repeated_heads() {
    let path = gpu_path(1);
    sweep(&path, DType::F16, &[2, 36], &[1, 37]);
    sweep(&path, DType::BF16, &[6], &[7]);
    sweep_repeated(&path, DType::F16, 36, 37);
    sweep_repeated(&path, DType::BF16, 6, 7);
}

/// GL (llvmpipe): no subgroups, the kernels where every lane loads every row; its
/// workgroups own 16 rows, so T = 37 crosses them. (Small head dims: GL compiles the
/// unrolled kernels slowly.)
#[test]
fn gl_matches_cpu_and_repeated_heads() {
    let _gl = GL.lock().unwrap_or_else(|e| e.into_inner());
    let path = gpu_path(2);
    sweep(&path, DType::F32, &[5], &[1, 37]);
    sweep(&path, DType::F16, &[8], &[7]);
    sweep(&path, DType::BF16, &[2], &[13]);
    sweep_repeated(&path, DType::F32, 5, 37);
}

/// The CPU reference against itself on repeated heads, in f32 and bf16.
#[test]
fn cpu_reference_matches_repeated_heads() {
    let cpu = CpuDevice::new();
    for (dtype, dim, seq) in [(DType::F32, 3, 7), (DType::BF16, 8, 5)] {
        for (kv, group) in GROUPS {
            for causal in [false, true] {
                let c = Case {
                    kv,
                    group,
                    seq,
                    dim,
                    causal,
                    dtype,
                };
                check_repeated(&cpu, "cpu", &c, 3);
            }
        }
    }
}

/// Central finite differences of L = sum(dout * out) through the CPU forward (f64
/// inside, f32 results) against the CPU backward with group 2 and 3: a K/V element
/// moves the output of every query head of its group, so dk and dv must sum them.
#[test]
fn cpu_grouped_backward_matches_finite_differences() {
    let cpu = CpuDevice::new();
    for (kv, group) in [(2, 2), (1, 3)] {
        for causal in [false, true] {
            let c = Case {
                kv,
                group,
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
                let out = run(&cpu, &c, &d, None)[0].to_f32();
                out.iter()
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
                        "{c:?}: d{name}[{e}] finite difference {fd}, backward {g}"
                    );
                }
            }
        }
    }
}

/// Launch checks for the group: zero, not dividing the heads, K/V tensors of the query
/// heads' size, each with a message that names it.
#[test]
fn validation_rejects_bad_groups() {
    let cpu = CpuDevice::new();
    let t = |n| cpu.alloc(DType::F32, n).unwrap();
    let (bh, s, d) = (6, 4, 8);
    let (q, out, dout, dq) = (t(bh * s * d), t(bh * s * d), t(bh * s * d), t(bh * s * d));
    let lse = t(bh * s);
    let kv2 = |n| [0; 4].map(|_| t(bh / n * s * d));
    let fwd = |group: usize, k, v| {
        Kernel::Attention(kernels::Attention {
            q,
            k,
            v,
            out,
            lse,
            batch_heads: bh,
            group,
            seq: s,
            dim: d,
            scale: 0.5,
            causal: true,
            documents: None,
        })
    };
    let err = |k: Kernel| k.validate().unwrap_err().to_string();
    let [k2, v2, dk2, dv2] = kv2(2);
    let [k3, v3, ..] = kv2(3);
    let [kf, vf, ..] = kv2(1);
    assert!(fwd(2, k2, v2).validate().is_ok());
    assert!(fwd(3, k3, v3).validate().is_ok());
    assert!(fwd(1, kf, vf).validate().is_ok());
    let e = err(fwd(0, k2, v2));
    assert!(e.contains("group 0"), "{e}");
    let [k4, v4, ..] = [0; 4].map(|_| t(s * d));
    let e = err(fwd(4, k4, v4));
    assert!(
        e.contains("batch_heads 6 is not a multiple of group 4"),
        "{e}"
    );
    // Full-size k with group 2: the message names k and the K/V head count.
    let e = err(fwd(2, kf, v2));
    assert!(e.contains("`k`") && e.contains("= 3"), "{e}");
    let bwd = |dq, dk, dv| {
        Kernel::AttentionBackward(AttentionBackward {
            q,
            k: k2,
            v: v2,
            out,
            dout,
            lse,
            dq,
            dk,
            dv,
            batch_heads: bh,
            group: 2,
            seq: s,
            dim: d,
            scale: 0.5,
            causal: false,
            documents: None,
        })
    };
    assert!(bwd(dq, dk2, dv2).validate().is_ok());
    let e = err(bwd(dq, dk2, t(bh * s * d)));
    assert!(e.contains("`dv`"), "{e}");
    let e = err(bwd(dk2, dq, dv2));
    assert!(e.contains("`dq`"), "{e}");
}

/// (B, T, heads, kv_heads, D) of the graph checks.
type Dims = (usize, usize, usize, usize, usize);

/// The graph's output, loss and the gradients of q, k and v.
struct GraphRun {
    out: Vec<f32>,
    loss: f64,
    grads: [Vec<f32>; 3],
}

/// Parameters q (B, T, H*D), k and v (B, T, KV*D) -> `Graph::attention` -> the output
/// itself as the logits of a cross-entropy (a gradient that is neither uniform nor
/// sparse), forward and backward on `dev`, f32.
fn graph_run(
    dev: &dyn Device,
    mode: Attention,
    (b, t, h, kv, d): Dims,
    init: [&[f32]; 3],
    targets: &[u32],
) -> GraphRun {
    let mut g = Graph::new();
    let mut params = vec![];
    let mut tensors = vec![];
    for (name, width, x) in [("q", h, init[0]), ("k", kv, init[1]), ("v", kv, init[2])] {
        params.push(ParamBuffers::new(dev, x, DType::F32, DType::F32).unwrap());
        let shape = [b, t, width * d];
        tensors.push(
            g.param(name, &shape, DType::F32, DType::F32, false)
                .unwrap(),
        );
    }
    let y = g.input("targets", &[b, t], DType::U32);
    let a = g
        .attention(tensors[0], tensors[1], tensors[2], h, kv, mode)
        .unwrap();
    g.output(a).unwrap();
    g.cross_entropy(a, y).unwrap();
    let bindings = Bindings {
        params: params.clone(),
        inputs: vec![(y, put(dev, &HostData::U32(targets.to_vec())))],
        groups: vec![],
    };
    let adamw = Optimizer::adamw(1e-2, 0.0);
    let mut plan = g.compile(dev, &bindings, Some(&adamw)).unwrap();
    plan.accumulate(dev, 1.0, 1.0 / (b * t) as f32, 0).unwrap();
    let out = dev.download(plan.buffer(a).unwrap()).unwrap().to_f32();
    let loss = plan.loss_sum(dev).unwrap();
    let grads = [0, 1, 2].map(|i| dev.download(params[i].grad).unwrap().to_f32());
    plan.free(dev).unwrap();
    GraphRun { out, loss, grads }
}

/// `Graph::attention` with kv_heads < heads against the same op with kv_heads = heads
/// over K/V heads repeated on the host, in both modes, for two shapes: 3 K/V heads of
/// group 2, and one K/V head of group 3 (D = 2). Fused, each query head does the
/// repeated graph's work exactly; straightforward, the GEMMs have other shapes (M =
/// group * T, K = group * T for dk and dv) and may sum in another order: everything is
/// held to 1e-5 of each tensor's largest element (f32 sums, errors ~1e-7), dk and dv
/// against the repeated heads' gradients summed over each group (relative to the
/// largest part, which cancellation in a group can leave larger than the sums).
fn check_graph(dev: &dyn Device, name: &str) {
    for dims in [(2, 7, 6, 3, 4), (1, 5, 3, 1, 2)] {
        let (b, t, h, kv, d) = dims;
        let group = h / kv;
        let mut rng = Rng::new(11);
        let mut gen = |n: usize| -> Vec<f32> { (0..n).map(|_| rng.uniform(-2.0, 2.0)).collect() };
        let (q, k, v) = (gen(b * t * h * d), gen(b * t * kv * d), gen(b * t * kv * d));
        let targets: Vec<u32> = (0..b * t)
            .map(|_| rng.next_u32() % (h * d) as u32)
            .collect();
        // Row (b, t) of a repeated tensor: K/V head hd / group for each query head hd.
        let repeat = |x: &[f32]| -> Vec<f32> {
            (0..b * t)
                .flat_map(|r| (0..h * d).map(move |c| x[r * kv * d + c / d / group * d + c % d]))
                .collect()
        };
        let (kr, vr) = (repeat(&k), repeat(&v));
        for mode in [Attention::Fused, Attention::Straightforward] {
            let got = graph_run(dev, mode, dims, [&q, &k, &v], &targets);
            let want = graph_run(dev, mode, (b, t, h, h, d), [&q, &kr, &vr], &targets);
            let what = format!("{name} {mode:?} (B, T, H, KV, D) = {dims:?}");
            let lerr = (got.loss - want.loss).abs() / want.loss.abs();
            assert!(lerr <= 1e-5, "{what}: loss {} vs {}", got.loss, want.loss);
            let sum = |x: &[f32]| -> Vec<f64> {
                (0..b * t * kv * d)
                    .map(|e| {
                        let (r, j, i) = (e / (kv * d), e % (kv * d) / d, e % d);
                        (0..group)
                            .map(|g| x[r * h * d + (j * group + g) * d + i] as f64)
                            .sum()
                    })
                    .collect()
            };
            let want_f64 = |x: &[f32]| -> Vec<f64> { x.iter().map(|&v| v as f64).collect() };
            let largest = |x: &[f32]| x.iter().fold(0.01f64, |a, &v| a.max(v.abs() as f64));
            for (tensor, g, w, floor) in [
                ("out", &got.out, want_f64(&want.out), 0.01),
                ("dq", &got.grads[0], want_f64(&want.grads[0]), 0.01),
                (
                    "dk",
                    &got.grads[1],
                    sum(&want.grads[1]),
                    largest(&want.grads[1]),
                ),
                (
                    "dv",
                    &got.grads[2],
                    sum(&want.grads[2]),
                    largest(&want.grads[2]),
                ),
            ] {
                let e = rel_err_to(g, &w, floor);
                assert!(
                    e <= 1e-5,
                    "{what}: {tensor} is {e:.1e} of its largest element off the repeated heads'"
                );
            }
        }
    }
}

#[test]
fn graph_gqa_equals_repeated_heads_on_cpu() {
    check_graph(&CpuDevice::new(), "cpu");
}

#[test]
fn graph_gqa_equals_repeated_heads_on_vulkan() {
    for i in [0, 1] {
        let path = gpu_path(i);
        check_graph(path.dev.as_ref(), path.name);
    }
}

#[test]
fn graph_gqa_equals_repeated_heads_on_gl() {
    let _gl = GL.lock().unwrap_or_else(|e| e.into_inner());
    let path = gpu_path(2);
    check_graph(path.dev.as_ref(), path.name);
}

/// Recording checks of `Graph::attention`, each naming the problem.
#[test]
fn graph_attention_rejects_bad_operands() {
    let mut g = Graph::new();
    let q = g.input("q", &[2, 5, 12], DType::F32);
    let k = g.input("k", &[2, 5, 6], DType::F32);
    let v = g.input("v", &[2, 5, 6], DType::F32);
    let fused = Attention::Fused;
    // 4 heads of 3, 2 K/V heads of 3: fine.
    assert!(g.attention(q, k, v, 4, 2, fused).is_ok());
    let e = g.attention(q, k, v, 4, 3, fused).unwrap_err().to_string();
    assert!(e.contains("multiple of kv_heads"), "{e}");
    let e = g.attention(q, k, v, 5, 1, fused).unwrap_err().to_string();
    assert!(e.contains("(B, T, heads * D)"), "{e}");
    // 2 heads of 6 want k and v of 6 per K/V head.
    let e = g.attention(q, k, v, 2, 2, fused).unwrap_err().to_string();
    assert!(e.contains("`k`") && e.contains("[2, 5, 12]"), "{e}");
    let v16 = g.input("v16", &[2, 5, 6], DType::F16);
    let e = g.attention(q, k, v16, 4, 2, fused).unwrap_err().to_string();
    assert!(e.contains("one dtype"), "{e}");
    let short = g.input("short", &[2, 4, 6], DType::F32);
    let e = g
        .attention(q, k, short, 4, 2, fused)
        .unwrap_err()
        .to_string();
    assert!(e.contains("`short`"), "{e}");
    // One K/V head of 3: kv_heads * D odd.
    let k3 = g.input("k3", &[2, 5, 3], DType::F32);
    let e = g
        .attention(q, k3, k3, 4, 1, Attention::Straightforward)
        .unwrap_err()
        .to_string();
    assert!(e.contains("must be even"), "{e}");
    // Heads of 130 are too wide for the fused kernels, not for the GEMMs.
    let qw = g.input("qw", &[1, 3, 260], DType::F32);
    let kw = g.input("kw", &[1, 3, 130], DType::F32);
    let e = g
        .attention(qw, kw, kw, 2, 1, fused)
        .unwrap_err()
        .to_string();
    assert!(e.contains("Attention::Straightforward"), "{e}");
    assert!(g
        .attention(qw, kw, kw, 2, 1, Attention::Straightforward)
        .is_ok());
}
