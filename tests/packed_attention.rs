//! Fused attention over packed sequences (`Documents`: each row's document start):
//! - the CPU reference equals attention over each document alone (the boundary holds:
//!   the same batch without its documents differs);
//! - every GPU path (wgpu native and packed f16, GL, raw Vulkan's GLSL passes) equals
//!   the CPU reference, forward and backward, over documents of 1 row, documents that
//!   cross a workgroup's rows, grouped-query heads and head dims off the vector width.

mod common;

use common::*;
use kiln::cpu::CpuDevice;
use kiln::engine::kernels::{self, AttentionBackward, Documents};
use kiln::engine::{DType, Device, HostData, Kernel};

/// Sequences of `seq` rows, each packed with documents of the given lengths (summing
/// to `seq`), `heads` query heads per sequence over `heads / group` K/V heads.
#[derive(Clone, Debug)]
struct Case {
    seq: usize,
    docs: Vec<Vec<usize>>,
    heads: usize,
    group: usize,
    dim: usize,
    dtype: DType,
}

impl Case {
    fn batch_heads(&self) -> usize {
        self.docs.len() * self.heads
    }
    fn q_len(&self) -> usize {
        self.batch_heads() * self.seq * self.dim
    }
    fn kv_len(&self) -> usize {
        self.q_len() / self.group
    }
    /// Each (sequence, row)'s document start.
    fn starts(&self) -> Vec<u32> {
        let mut starts = vec![];
        for lens in &self.docs {
            assert_eq!(lens.iter().sum::<usize>(), self.seq, "{self:?}");
            let mut first = 0;
            for &n in lens {
                starts.extend(std::iter::repeat_n(first as u32, n));
                first += n;
            }
        }
        starts
    }
}

/// q, k, v, dout: q and k in [-2, 2), v and dout in [-1, 1), as tests/attention.rs.
fn inputs(c: &Case, seed: u64) -> [HostData; 4] {
    let mut rng = Rng::new(seed);
    let mut gen = |n: usize, w: f32| -> HostData {
        let v: Vec<f32> = (0..n).map(|_| rng.uniform(-w, w)).collect();
        HostData::from_f32(c.dtype, &v)
    };
    [
        gen(c.q_len(), 2.0),
        gen(c.kv_len(), 2.0),
        gen(c.kv_len(), 1.0),
        gen(c.q_len(), 1.0),
    ]
}

/// (out, lse, dq, dk, dv) of `c` on `dev`, with its documents when `packed`. The
/// backward takes `saved` (out, lse) when given, so that a GPU's backward is judged on
/// the CPU's forward.
fn run(
    dev: &dyn Device,
    c: &Case,
    data: &[HostData; 4],
    packed: bool,
    saved: Option<(&HostData, &HostData)>,
) -> [HostData; 5] {
    let [q, k, v, dout] = data.each_ref().map(|d| put(dev, d));
    let starts = put(dev, &HostData::U32(c.starts()));
    let documents = packed.then_some(Documents {
        starts,
        heads: c.heads,
    });
    let (bh, seq, dim) = (c.batch_heads(), c.seq, c.dim);
    let scale = 1.0 / (dim as f32).sqrt();
    let out = dev.alloc(c.dtype, c.q_len()).unwrap();
    let lse = dev.alloc(DType::F32, bh * seq).unwrap();
    dev.launch(&Kernel::Attention(kernels::Attention {
        q,
        k,
        v,
        out,
        lse,
        batch_heads: bh,
        group: c.group,
        seq,
        dim,
        scale,
        causal: true,
        documents,
    }))
    .unwrap();
    let (bout, blse) = match saved {
        Some((o, l)) => (put(dev, o), put(dev, l)),
        None => (out, lse),
    };
    let dq = dev.alloc(c.dtype, c.q_len()).unwrap();
    let dk = dev.alloc(c.dtype, c.kv_len()).unwrap();
    let dv = dev.alloc(c.dtype, c.kv_len()).unwrap();
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
        batch_heads: bh,
        group: c.group,
        seq,
        dim,
        scale,
        causal: true,
        documents,
    }))
    .unwrap();
    dev.submit().unwrap();
    [out, lse, dq, dk, dv].map(|b| dev.download(b).unwrap())
}

/// Rows `first..first + n` of every head of a `(heads, seq, dim)` tensor.
fn rows(x: &[f32], heads: usize, seq: usize, dim: usize, first: usize, n: usize) -> Vec<f32> {
    (0..heads)
        .flat_map(|h| x[(h * seq + first) * dim..(h * seq + first + n) * dim].to_vec())
        .collect()
}

/// The CPU reference over packed sequences equals the CPU's plain causal attention
/// over each document as a sequence of its own, forward and backward, in f32 to 1e-6
/// relative (both sum in f64: only the final roundings differ). And the boundary
/// matters: the same batch without its documents differs by far more, so a kernel
/// that ignored the starts could not pass the GPU tests below.
#[test]
fn the_cpu_reference_equals_each_document_alone() {
    let cpu = CpuDevice::new();
    let c = Case {
        seq: 13,
        docs: vec![vec![1, 5, 7], vec![13], vec![4, 1, 1, 7]],
        heads: 4,
        group: 2,
        dim: 6,
        dtype: DType::F32,
    };
    let data = inputs(&c, 7);
    let packed = run(&cpu, &c, &data, true, None);
    let whole = run(&cpu, &c, &data, false, None);
    let (kv, d, t) = (c.heads / c.group, c.dim, c.seq);
    let mut worst = 0f64;
    for (b, lens) in c.docs.iter().enumerate() {
        let mut first = 0;
        for &n in lens {
            // Document `n` rows at `first` of sequence b, as a batch of one sequence.
            let alone = Case {
                seq: n,
                docs: vec![vec![n]],
                ..c.clone()
            };
            let part = |x: &HostData, heads: usize, w: usize| -> Vec<f32> {
                let x = x.to_f32();
                let per = heads * t * w;
                rows(&x[b * per..(b + 1) * per], heads, t, w, first, n)
            };
            let sub = [
                part(&data[0], c.heads, d),
                part(&data[1], kv, d),
                part(&data[2], kv, d),
                part(&data[3], c.heads, d),
            ]
            .map(HostData::F32);
            let want = run(&cpu, &alone, &sub, false, None);
            for (i, (heads, w)) in [(c.heads, d), (c.heads, 1), (c.heads, d), (kv, d), (kv, d)]
                .into_iter()
                .enumerate()
            {
                let got = part(&packed[i], heads, w);
                let want = want[i].to_f32();
                for (g, w) in got.iter().zip(&want) {
                    let e = (g - w).abs() as f64 / (w.abs() as f64).max(1e-2);
                    worst = worst.max(e);
                    assert!(
                        e <= 1e-6,
                        "sequence {b}, document at row {first} ({n} rows), tensor {i}: \
                         {g} packed against {w} alone"
                    );
                }
            }
            first += n;
        }
    }
    eprintln!("packed against each document alone: largest relative error {worst:.1e}");
    let apart = rel_err(&whole[0], &packed[0]);
    assert!(
        apart > 0.1,
        "without its documents the output should differ (error {apart:.1e})"
    );
}

/// Largest error of `got` against `want`, relative to the tensor's largest |want| (at
/// least 0.01), as tests/attention.rs measures.
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

/// tests/attention.rs's tolerances: f32 1e-4 of the largest element (another summation
/// order than the f64 reference); 16-bit one ulp of the largest more; lse 1e-5.
fn tolerance(dtype: DType) -> f64 {
    match dtype {
        DType::F16 => 2f64.powi(-10) + 1e-4,
        DType::BF16 => 2f64.powi(-7) + 1e-4,
        _ => 1e-4,
    }
}

/// The cases every GPU path runs: one row; 1-row documents and a document through a
/// whole sequence; 150 rows (past one workgroup's rows on every plan) with documents
/// that start and end inside workgroups, under grouped-query heads; head dim 6 in f16
/// (scalar loads, 16-bit stores). Dims and dtypes are tests/attention.rs's, so their
/// pipelines are the ones that test builds.
fn cases() -> Vec<Case> {
    let case = |seq, docs: Vec<Vec<usize>>, heads, group, dim, dtype| Case {
        seq,
        docs,
        heads,
        group,
        dim,
        dtype,
    };
    vec![
        case(1, vec![vec![1]], 1, 1, 32, DType::F32),
        case(13, vec![vec![1, 5, 7], vec![13]], 2, 1, 32, DType::F32),
        case(
            150,
            vec![vec![3, 70, 1, 60, 16], vec![9, 141]],
            2,
            2,
            32,
            DType::F32,
        ),
        case(13, vec![vec![4, 1, 1, 7]], 3, 1, 6, DType::F16),
    ]
}

fn check_on(name: &str, dev: &dyn Device) {
    let cpu = CpuDevice::new();
    for (n, c) in cases().iter().enumerate() {
        let data = inputs(c, 100 + n as u64);
        let want = run(&cpu, c, &data, true, None);
        let got = run(dev, c, &data, true, Some((&want[0], &want[1])));
        let names = ["out", "lse", "dq", "dk", "dv"];
        let mut report = vec![];
        let mut bad = false;
        for i in 0..5 {
            let tol = if i == 1 { 1e-5 } else { tolerance(c.dtype) };
            let e = rel_err(&got[i], &want[i]);
            report.push(format!("{} {e:.1e}", names[i]));
            bad |= e.is_nan() || e > tol;
        }
        eprintln!("{name} {c:?}: {}", report.join(", "));
        assert!(
            !bad,
            "{name} {c:?}: errors relative to each tensor's largest element (tolerance \
             {:.1e}, lse 1e-5): {}",
            tolerance(c.dtype),
            report.join(", ")
        );
    }
}

#[test]
fn vulkan_native_f16_packed_sequences_match_cpu() {
    let path = gpu_path(0);
    check_on(path.name, path.dev.as_ref());
}

#[test]
fn vulkan_packed_f16_packed_sequences_match_cpu() {
    let path = gpu_path(1);
    check_on(path.name, path.dev.as_ref());
}

/// GL: no subgroups (every lane loads each block row itself, the starts included).
#[test]
fn gl_packed_sequences_match_cpu() {
    let path = gpu_path(2);
    check_on(path.name, path.dev.as_ref());
}

/// Raw Vulkan: the GLSL passes (8 rows per lane), then the GPU-shaped plan (64 lanes,
/// no subgroup operations).
#[test]
fn vk_packed_sequences_match_cpu() {
    let vk = vk_device(false);
    check_on("vk (GLSL passes)", &vk);
    assert_eq!(vk.attention_launches(), 3 * cases().len() as u64);
    vk.force_attention_plan(Some(kiln::wgpu::AttentionPlan {
        sg: 8,
        wg: 64,
        rows: 1,
        shared: false,
    }));
    check_on("vk (GLSL passes, GPU-shaped)", &vk);
}

/// Documents the kernels cannot honour are refused by name: bidirectional attention,
/// starts that are not u32 or not one per (sequence, row), heads per sequence that do
/// not divide the batch's heads or split a K/V group.
#[test]
fn bad_documents_are_refused() {
    let cpu = CpuDevice::new();
    let c = Case {
        seq: 4,
        docs: vec![vec![1, 3], vec![4]],
        heads: 2,
        group: 2,
        dim: 4,
        dtype: DType::F32,
    };
    let [q, k, v, _] = inputs(&c, 1).each_ref().map(|d| put(&cpu, d));
    let out = cpu.alloc(DType::F32, c.q_len()).unwrap();
    let lse = cpu.alloc(DType::F32, c.batch_heads() * c.seq).unwrap();
    let starts = put(&cpu, &HostData::U32(c.starts()));
    let short = put(&cpu, &HostData::U32(vec![0; 7]));
    let floats = put(&cpu, &HostData::F32(vec![0.0; 8]));
    let launch = |causal, starts, heads| {
        cpu.launch(&Kernel::Attention(kernels::Attention {
            q,
            k,
            v,
            out,
            lse,
            batch_heads: c.batch_heads(),
            group: c.group,
            seq: c.seq,
            dim: c.dim,
            scale: 0.5,
            causal,
            documents: Some(Documents { starts, heads }),
        }))
        .map_err(|e| e.to_string())
    };
    assert!(launch(true, starts, 2).is_ok());
    for (causal, starts, heads, says) in [
        (false, starts, 2, "documents need causal attention"),
        (true, short, 2, "documents.starts"),
        (true, floats, 2, "documents.starts"),
        (true, starts, 3, "heads must divide batch_heads"),
        (true, starts, 1, "be a multiple of group"),
    ] {
        let err = launch(causal, starts, heads).unwrap_err();
        assert!(err.contains(says), "{err}");
    }
}
