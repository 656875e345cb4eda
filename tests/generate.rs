//! Generation with a K/V cache (`Generator`, `Kernel::CacheWrite`,
//! `Kernel::CachedAttention`):
//! - the CPU reference of the cached attention against the CPU's causal attention;
//! - both kernels on every GPU path against the CPU reference over awkward shapes;
//! - cached generation against full recomputation by the training graph (the network's
//!   forward over the whole sequence), logits and 64 greedy tokens, on the CPU and
//!   every GPU path, for GPT-2, the Llama family and an architecture written here
//!   (the generator has no code of its own per architecture);
//! - the decode pass's shape: no loss, the head on the last row only.

mod common;

use kiln::engine::kernels::{self, CacheWrite, CachedAttention, Rope, RopeAt};
use std::sync::Arc;

use common::*;
use kiln::cpu::CpuDevice;
use kiln::engine::graph::{Graph, Tensor};
use kiln::engine::models::gpt::{Gpt, GptConfig};
use kiln::engine::models::llama::Llama;
use kiln::engine::models::{
    Decoder, Forward, Generator, Init, MicroBatch, Model, Network, NetworkOptions, ParamSpec,
};
use kiln::engine::{Buffer, DType, Device, HostData, Kernel, Optimizer, Result};

/// One cache-kernel case: `rows` new tokens of `batch` sequences.
#[derive(Clone, Copy, Debug)]
struct Case {
    batch: usize,
    rows: usize,
    heads: usize,
    group: usize,
    dim: usize,
    max_len: usize,
    dtype: DType,
}

impl Case {
    fn kv_heads(&self) -> usize {
        self.heads / self.group
    }
    /// Rows of (q | k | v) as a model's fused projection lays them out.
    fn width(&self) -> usize {
        (self.heads + 2 * self.kv_heads()) * self.dim
    }
    fn cache_len(&self) -> usize {
        self.batch * self.kv_heads() * self.max_len * self.dim
    }
}

/// Writes the new rows' K and V into caches that already hold random rows, then runs
/// the cached attention; returns (K cache, V cache, out). Positions: each sequence's
/// rows end at `last[b]` (so a row attends to earlier rows of its own launch too).
fn run_cache(dev: &dyn Device, c: &Case, last: &[usize], seed: u64) -> [HostData; 3] {
    let mut rng = Rng::new(seed);
    let mut gen = |n: usize, w: f32| -> HostData {
        HostData::from_f32(
            c.dtype,
            &(0..n).map(|_| rng.uniform(-w, w)).collect::<Vec<_>>(),
        )
    };
    let src = put(dev, &gen(c.rows * c.width(), 2.0));
    let kc = put(dev, &gen(c.cache_len(), 2.0));
    let vc = put(dev, &gen(c.cache_len(), 1.0));
    let per = c.rows / c.batch;
    let positions: Vec<u32> = (0..c.rows)
        .map(|r| (last[r / per] + 1 + r % per - per) as u32)
        .collect();
    let pos = put(dev, &HostData::U32(positions));
    let out = dev.alloc(c.dtype, c.rows * c.heads * c.dim).unwrap();
    let kv = c.kv_heads();
    let write = |cache: Buffer, offset: usize| {
        Kernel::CacheWrite(CacheWrite {
            src,
            cache,
            positions: pos,
            heads: kv,
            dim: c.dim,
            width: c.width(),
            offset,
            max_len: c.max_len,
        })
    };
    dev.launch(&write(kc, c.heads * c.dim)).unwrap();
    dev.launch(&write(vc, (c.heads + kv) * c.dim)).unwrap();
    dev.launch(&Kernel::CachedAttention(CachedAttention {
        q: src,
        k_cache: kc,
        v_cache: vc,
        positions: pos,
        out,
        heads: c.heads,
        group: c.group,
        dim: c.dim,
        width: c.width(),
        offset: 0,
        max_len: c.max_len,
        scale: 1.0 / (c.dim as f32).sqrt(),
    }))
    .unwrap();
    dev.submit().unwrap();
    let res = [kc, vc, out].map(|b| dev.download(b).unwrap());
    for b in [src, kc, vc, pos, out] {
        dev.free(b).unwrap();
    }
    res
}

/// Largest error relative to the tensor's largest |value| (NaN where the reference is
/// NaN is a match, elsewhere infinitely wrong).
fn rel_err(got: &[f32], want: &[f32]) -> f64 {
    assert_eq!(got.len(), want.len());
    let scale = want
        .iter()
        .filter(|x| x.is_finite())
        .fold(0.01f64, |a, &x| a.max(x.abs() as f64));
    got.iter()
        .zip(want)
        .map(|(&a, &b)| match (a.is_nan(), b.is_nan()) {
            (true, true) => 0.0,
            (false, false) => (a as f64 - b as f64).abs() / scale,
            _ => f64::INFINITY,
        })
        .fold(0.0, f64::max)
}

/// The kernels' attention against the f64 reference: f32 sums in another order
/// (~1e-6 relative), then one rounding of the output to the dtype (half an ulp of the
/// element, at most one ulp of the largest once the f32 error crosses a boundary).
fn tolerance(dtype: DType) -> f64 {
    match dtype {
        DType::F32 => 1e-5,
        DType::F16 => 2f64.powi(-10) + 1e-5,
        DType::BF16 => 2f64.powi(-7) + 1e-5,
        DType::U32 => unreachable!(),
    }
}

/// The awkward shapes: one head; prime heads, dims and lengths; head dims that are not
/// a multiple of the kernel's 64-key tile or of 4; a cache longer than one tile;
/// positions 0 and max_len - 1; grouped-query heads; two sequences in one launch.
fn cases(dtype: DType) -> Vec<(Case, Vec<usize>)> {
    let odd = dtype == DType::F32;
    let mut v = vec![];
    let case = |batch, rows, heads, group, dim, max_len| Case {
        batch,
        rows,
        heads,
        group,
        dim,
        max_len,
        dtype,
    };
    v.push((case(1, 1, 1, 1, 6, 1), vec![0]));
    v.push((case(1, 1, 3, 1, 30, 67), vec![66]));
    v.push((case(1, 1, 5, 1, 64, 131), vec![100]));
    v.push((case(1, 3, 4, 2, 2, 7), vec![6]));
    v.push((case(2, 6, 6, 3, 128, 70), vec![2, 69]));
    v.push((case(1, 5, 2, 1, 34, 257), vec![256]));
    if odd {
        v.push((case(1, 2, 3, 1, 1, 5), vec![4]));
        v.push((case(1, 1, 7, 7, 13, 65), vec![64]));
    }
    v
}

fn check_cache_kernels(path: &Path, dtypes: &[DType]) {
    let cpu = CpuDevice::new();
    for &dtype in dtypes {
        for (i, (c, last)) in cases(dtype).into_iter().enumerate() {
            let want = run_cache(&cpu, &c, &last, 40 + i as u64);
            let got = run_cache(path.dev.as_ref(), &c, &last, 40 + i as u64);
            // The caches are copies: bit for bit.
            for (n, name) in [(0, "k cache"), (1, "v cache")] {
                assert_eq!(
                    got[n].bits(),
                    want[n].bits(),
                    "{} {c:?}: the {name} differs from the CPU's",
                    path.name
                );
            }
            let e = rel_err(&got[2].to_f32(), &want[2].to_f32());
            eprintln!("{} {c:?} last {last:?}: out {e:.1e}", path.name);
            assert!(
                e <= tolerance(dtype),
                "{} {c:?}: cached attention off by {e:.1e} (tolerance {:.1e})",
                path.name,
                tolerance(dtype)
            );
        }
    }
}

/// The CPU's cached attention over a cache filled by cache writes equals its causal
/// attention (`Kernel::Attention`) over the same rows: the oracle checked against the
/// other oracle. Also a position at max_len: nothing written, a NaN row.
#[test]
fn cpu_cached_attention_equals_causal_attention() {
    let cpu = CpuDevice::new();
    let (heads, dim, seq, max_len) = (3, 5, 9, 11);
    let mut rng = Rng::new(3);
    let mut gen = |n: usize| -> Vec<f32> { (0..n).map(|_| rng.uniform(-2.0, 2.0)).collect() };
    // q, k, v heads (heads, seq, dim) and the same values as rows (seq, 3 * heads * dim).
    let (q, k, v) = (
        gen(heads * seq * dim),
        gen(heads * seq * dim),
        gen(heads * seq * dim),
    );
    let width = 3 * heads * dim;
    let mut rows = vec![0f32; seq * width];
    for h in 0..heads {
        for t in 0..seq {
            for i in 0..dim {
                let e = (h * seq + t) * dim + i;
                rows[t * width + h * dim + i] = q[e];
                rows[t * width + (heads + h) * dim + i] = k[e];
                rows[t * width + (2 * heads + h) * dim + i] = v[e];
            }
        }
    }
    let f = |x: &Vec<f32>| put(&cpu, &HostData::F32(x.clone()));
    let (bq, bk, bv) = (f(&q), f(&k), f(&v));
    let out = cpu.alloc(DType::F32, heads * seq * dim).unwrap();
    let lse = cpu.alloc(DType::F32, heads * seq).unwrap();
    let scale = 0.4;
    cpu.launch(&Kernel::Attention(kernels::Attention {
        q: bq,
        k: bk,
        v: bv,
        out,
        lse,
        batch_heads: heads,
        group: 1,
        seq,
        dim,
        scale,
        causal: true,
        documents: None,
    }))
    .unwrap();
    let want = cpu.download(out).unwrap().to_f32();
    let src = f(&rows);
    let kc = cpu.alloc(DType::F32, heads * max_len * dim).unwrap();
    let vc = cpu.alloc(DType::F32, heads * max_len * dim).unwrap();
    // Rows 0..seq at positions 0..seq, and one more row at max_len.
    let mut positions: Vec<u32> = (0..seq as u32).collect();
    positions[seq - 1] = max_len as u32;
    let pos = put(&cpu, &HostData::U32(positions));
    let y = cpu.alloc(DType::F32, seq * heads * dim).unwrap();
    for (cache, offset) in [(kc, heads * dim), (vc, 2 * heads * dim)] {
        cpu.launch(&Kernel::CacheWrite(CacheWrite {
            src,
            cache,
            positions: pos,
            heads,
            dim,
            width,
            offset,
            max_len,
        }))
        .unwrap();
    }
    cpu.launch(&Kernel::CachedAttention(CachedAttention {
        q: src,
        k_cache: kc,
        v_cache: vc,
        positions: pos,
        out: y,
        heads,
        group: 1,
        dim,
        width,
        offset: 0,
        max_len,
        scale,
    }))
    .unwrap();
    let got = cpu.download(y).unwrap().to_f32();
    for t in 0..seq {
        for h in 0..heads {
            for i in 0..dim {
                let g = got[(t * heads + h) * dim + i];
                if t == seq - 1 {
                    assert!(g.is_nan(), "a position at max_len gives NaN, not {g}");
                } else {
                    let w = want[(h * seq + t) * dim + i];
                    assert!((g - w).abs() <= 1e-6, "t {t} h {h} i {i}: {g} vs {w}");
                }
            }
        }
    }
    let kcache = cpu.download(kc).unwrap().to_f32();
    assert!(
        kcache[(seq - 1) * dim..]
            .iter()
            .take(dim)
            .all(|&x| x == 0.0),
        "the row at max_len wrote nothing (its slot seq - 1 stays zero)"
    );
}

#[test]
fn cache_kernels_vulkan_native_f16_match_cpu() {
    check_cache_kernels(&gpu_path(0), &[DType::F32, DType::F16, DType::BF16]);
}

#[test]
fn cache_kernels_vulkan_packed_f16_match_cpu() {
    check_cache_kernels(&gpu_path(1), &[DType::F16, DType::BF16]);
}

#[test]
fn cache_kernels_gl_match_cpu() {
    check_cache_kernels(&gpu_path(2), &[DType::F32, DType::F16]);
}

#[test]
fn bad_cache_launches_are_refused() {
    let cpu = CpuDevice::new();
    let src = cpu.alloc(DType::F16, 2 * 3 * 5).unwrap();
    let cache = cpu.alloc(DType::F16, 5 * 4).unwrap();
    let pos = cpu.alloc(DType::U32, 2).unwrap();
    let write = |offset: usize, max_len: usize, positions: Buffer| {
        Kernel::CacheWrite(CacheWrite {
            src,
            cache,
            positions,
            heads: 1,
            dim: 5,
            width: 15,
            offset,
            max_len,
        })
    };
    let e = cpu.launch(&write(5, 4, pos)).unwrap_err().to_string();
    assert!(e.contains("head dim 5 is odd"), "{e}");
    let e = cpu.launch(&write(11, 4, pos)).unwrap_err().to_string();
    assert!(e.contains("run past the row width 15"), "{e}");
    let e = cpu.launch(&write(5, 3, pos)).unwrap_err().to_string();
    assert!(e.contains("not whole sequences"), "{e}");
    let short = cpu.alloc(DType::U32, 1).unwrap();
    let e = cpu.launch(&write(5, 4, short)).unwrap_err().to_string();
    assert!(e.contains("positions"), "{e}");
}

// ---- generation against full recomputation ----

/// The tiny GPT of these tests: head dim 8, a vocabulary that is no power of two.
fn config() -> GptConfig {
    GptConfig {
        n_layer: 2,
        n_head: 4,
        n_embd: 32,
        block_size: 80,
        vocab_size: 67,
        padded_vocab_size: None,
    }
}

const PROMPT: [u32; 7] = [5, 60, 12, 0, 33, 66, 7];
const STEPS: usize = 64;

/// Random weights at a scale that keeps activations O(1) and spreads the logits over a
/// few units (GPT-2's own 0.02 init gives near-uniform logits whose greedy choice is a
/// coin toss decided by rounding).
fn weights(model: &dyn Model) -> Vec<(String, Vec<f32>)> {
    let mut rng = Rng::new(11);
    model
        .parameters()
        .into_iter()
        .map(|spec| {
            let n = spec.len();
            let name = spec.name.clone();
            let norm = name.contains("ln_") || name.contains("norm");
            let values: Vec<f32> = if norm && name.ends_with("weight") {
                (0..n).map(|_| rng.uniform(0.8, 1.2)).collect()
            } else if spec.shape.len() == 1 {
                (0..n).map(|_| rng.uniform(-0.1, 0.1)).collect()
            } else if name.contains("wte") || name.contains("wpe") {
                (0..n).map(|_| rng.uniform(-0.5, 0.5)).collect()
            } else {
                let bound = (3.0 / spec.shape[0] as f32).sqrt();
                (0..n).map(|_| rng.uniform(-bound, bound)).collect()
            };
            (name, values)
        })
        .collect()
}

fn argmax(row: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &x) in row.iter().enumerate() {
        if x > row[best] {
            best = i;
        }
    }
    best as u32
}

/// The two architectures under test, built for a sequence of `seq` tokens.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Arch {
    Gpt,
    /// 4 query heads over 2 K/V heads, an untied head.
    Llama,
    /// What Llama 3.2, Qwen2 and Mistral-Nemo add: q/k/v biases, a head dim (12) other
    /// than n_embd / n_head, llama3 rope scaling (original context 32, so that the
    /// heads' wavelengths of 6.3, 29 and 136+ are kept, blended and slowed), a tied head.
    Llama3,
    /// [`Tiny`], known to nothing in the engine.
    Tiny,
}

fn model(arch: Arch, seq: usize) -> Arc<dyn Model> {
    match arch {
        Arch::Gpt => Arc::new(Gpt::new(config(), seq)),
        Arch::Llama | Arch::Llama3 => Arc::new(llama(arch, seq)),
        Arch::Tiny => Arc::new(Tiny { seq }),
    }
}

/// An architecture of this test alone, mixing what the engine's models do: learned
/// positions added to the embedding and RoPE on q and k, multi-query attention (2
/// query heads, 1 K/V head of 16), a ReLU MLP, an RMS-normed untied head, vocabulary
/// 67. Shapes: T tokens, C = 32.
struct Tiny {
    seq: usize,
}

impl Model for Tiny {
    fn describe(&self) -> String {
        format!("tiny (T {})", self.seq)
    }

    fn parameters(&self) -> Vec<ParamSpec> {
        let p = |n: &str, shape: &[usize]| ParamSpec::new(n, shape, Init::Uniform(0.1));
        let mut out = vec![
            p("wte", &[67, 32]).f32_grad(),
            p("wpe", &[80, 32]).f32_grad(),
        ];
        for l in 0..2 {
            let n = |s: &str| format!("h.{l}.{s}");
            out.extend([
                p(&n("ln_1.weight"), &[32]).f32_grad(),
                p(&n("ln_1.bias"), &[32]).f32_grad(),
                p(&n("q"), &[32, 32]),
                p(&n("kv"), &[32, 16]), // k and v share one projection here
                p(&n("o"), &[32, 32]),
                p(&n("fc"), &[32, 48]),
                p(&n("fc.bias"), &[48]),
                p(&n("proj"), &[48, 32]),
            ]);
        }
        out.extend([p("norm.weight", &[32]).f32_grad(), p("head", &[32, 67])]);
        out
    }

    fn forward(&self, g: &mut Graph, p: &[Tensor], batch: usize, _: DType) -> Result<Forward> {
        let tokens = g.input("tokens", &[batch, self.seq], DType::U32);
        let targets = g.input("targets", &[batch, self.seq], DType::U32);
        let positions = g.positions(batch, self.seq)?;
        let (tok, pos) = (g.embedding(tokens, p[0])?, g.embedding(positions, p[1])?);
        let mut x = g.add(tok, pos)?; // (B, T, 32)
        for w in p[2..p.len() - 2].chunks(8) {
            let n = g.layernorm(x, w[0], w[1])?;
            let q = g.linear(n, w[2], None)?; // (B, T, 2 * 16)
            let kv = g.linear(n, w[3], None)?; // (B, T, 16)
            let (q, k) = (g.rope(q, 2, 10000.0)?, g.rope(kv, 1, 10000.0)?);
            let y = g.attention(q, k, kv, 2, 1, Default::default())?;
            let y = g.linear(y, w[4], None)?;
            x = g.add(x, y)?;
            let f = g.linear(x, w[5], Some(w[6]))?; // (B, T, 48)
            let f = g.relu(f)?;
            let f = g.linear(f, w[7], None)?;
            x = g.add(x, f)?;
        }
        let xf = g.rmsnorm(x, p[p.len() - 2], 1e-5)?;
        let logits = g.linear(xf, p[p.len() - 1], None)?; // (B, T, 67)
        g.cross_entropy(logits, targets)?;
        Ok(Forward {
            inputs: vec![tokens, targets],
            prediction: logits,
        })
    }
}

impl Decoder for Tiny {
    fn check_context(&self, max_len: usize) -> Result<()> {
        assert!(max_len <= 80, "the test stays inside wpe");
        Ok(())
    }

    fn with_seq(&self, seq: usize) -> Box<dyn Decoder> {
        Box::new(Tiny { seq })
    }
}

fn llama(arch: Arch, seq: usize) -> Llama {
    let extra = match arch {
        Arch::Llama3 => {
            r#""tie_word_embeddings": true, "qkv_bias": true, "head_dim": 12,
            "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 32}"#
        }
        _ => r#""tie_word_embeddings": false"#,
    };
    let cfg = serde_json::from_str(&format!(
        r#"{{"n_layer": 2, "n_head": 4, "n_kv_head": 2, "n_embd": 32, "block_size": 80,
            "vocab_size": 67, {extra}}}"#
    ))
    .unwrap();
    Llama::new(cfg, seq)
}

fn generator(dev: &dyn Device, arch: Arch, dtype: DType, max_len: usize) -> Generator {
    match arch {
        Arch::Gpt => {
            let m = Gpt::new(config(), 1);
            Generator::new(dev, &m, &weights(&m), dtype, max_len).unwrap()
        }
        Arch::Llama | Arch::Llama3 => {
            let m = llama(arch, 1);
            Generator::new(dev, &m, &weights(&m), dtype, max_len).unwrap()
        }
        Arch::Tiny => {
            let m = Tiny { seq: 1 };
            Generator::new(dev, &m, &weights(&m), dtype, max_len).unwrap()
        }
    }
}

/// Prefills the prompt and decodes STEPS greedy tokens; returns the whole sequence and
/// the logits after each of its positions from the prompt's last on.
fn generate(dev: &dyn Device, arch: Arch, dtype: DType) -> (Vec<u32>, Vec<Vec<f32>>) {
    let mut gen = generator(dev, arch, dtype, PROMPT.len() + STEPS);
    let mut seq = PROMPT.to_vec();
    let mut logits = vec![gen.prefill(dev, &PROMPT).unwrap()];
    assert_eq!(gen.position(), PROMPT.len());
    for _ in 0..STEPS - 1 {
        let next = argmax(logits.last().unwrap());
        seq.push(next);
        logits.push(gen.step(dev, next).unwrap());
    }
    seq.push(argmax(logits.last().unwrap()));
    assert_eq!(gen.position(), PROMPT.len() + STEPS - 1);
    gen.free(dev).unwrap();
    (seq, logits)
}

/// The reference: the training graph's forward over the whole sequence, every position
/// recomputed from the tokens. Causal, so position t's logits see tokens 0..=t only,
/// exactly what the generator had when it produced them.
fn recompute(dev: &dyn Device, arch: Arch, dtype: DType, seq: &[u32]) -> Vec<Vec<f32>> {
    let t = seq.len() - 1;
    let model = model(arch, t);
    let w = weights(model.as_ref());
    let options = NetworkOptions {
        batch: 1,
        dtype,
        optimizer: Optimizer::adamw(1e-3, 0.0),
        seed: 0,
        packed: false,
    };
    let net = Network::new(dev, model, &options).unwrap();
    for (i, (_, values)) in w.iter().enumerate() {
        net.set_parameter(dev, i, values).unwrap();
    }
    net.loss(dev, &MicroBatch::tokens(&seq[..t], &seq[1..]))
        .unwrap();
    let logits = dev
        .download(net.output(net.prediction()).unwrap())
        .unwrap()
        .to_f32();
    logits
        .chunks_exact(config().vocab_size)
        .skip(PROMPT.len() - 1)
        .map(|r| r.to_vec())
        .collect()
}

/// Tolerance of the logits, relative to the largest |logit| of the run. f32: the two
/// computations differ only in summation order (matrix products of one row against
/// many, attention over the cache against the fused or unfused kernels), errors of a
/// few f32 ulps per op through 2 layers: 1e-4 is ~1000 ulps of room. 16-bit: every
/// stored activation is rounded (2^-11 relative for f16, 2^-8 for bf16) and a value
/// summed in another order can round the other way, one ulp, which the next layers
/// carry forward; 8 ulps of the largest logit bounds what 2 layers accumulate.
fn logit_tolerance(dtype: DType) -> f64 {
    match dtype {
        DType::F32 => 1e-4,
        DType::F16 => 8.0 * 2f64.powi(-11),
        DType::BF16 => 8.0 * 2f64.powi(-8),
        DType::U32 => unreachable!(),
    }
}

fn check_generation(name: &str, dev: &dyn Device, arch: Arch, dtypes: &[DType]) {
    for &dtype in dtypes {
        let started = std::time::Instant::now();
        let (seq, got) = generate(dev, arch, dtype);
        let want = recompute(dev, arch, dtype, &seq);
        assert_eq!(got.len(), want.len());
        let flat = |x: &[Vec<f32>]| x.concat();
        let e = rel_err(&flat(&got), &flat(&want));
        // Greedy: the reference's own choice at every position is the token the
        // generator appended, so greedy decoding by full recomputation would have
        // produced the same 64 tokens.
        let chosen: Vec<u32> = want.iter().map(|r| argmax(r)).collect();
        eprintln!(
            "{name} {arch:?} {dtype}: logits off by {e:.1e} of the largest (tolerance \
             {:.1e}), {:.1}s",
            logit_tolerance(dtype),
            started.elapsed().as_secs_f64()
        );
        assert_eq!(
            &seq[PROMPT.len()..],
            &chosen[..],
            "{name} {arch:?} {dtype}: greedy tokens differ from full recomputation's"
        );
        assert!(
            e <= logit_tolerance(dtype),
            "{name} {arch:?} {dtype}: cached logits off by {e:.1e} of the largest, over {:.1e}",
            logit_tolerance(dtype)
        );
    }
}

#[test]
fn generation_matches_recomputation_cpu() {
    let cpu = CpuDevice::new();
    let all = [DType::F32, DType::F16, DType::BF16];
    check_generation("cpu", &cpu, Arch::Gpt, &all);
    check_generation("cpu", &cpu, Arch::Llama, &all);
    check_generation("cpu", &cpu, Arch::Llama3, &all);
    check_generation("cpu", &cpu, Arch::Tiny, &all);
}

#[test]
fn generation_matches_recomputation_vulkan_native_f16() {
    let p = gpu_path(0);
    let all = [DType::F32, DType::F16, DType::BF16];
    check_generation(p.name, p.dev.as_ref(), Arch::Gpt, &all);
    check_generation(
        p.name,
        p.dev.as_ref(),
        Arch::Llama,
        &[DType::F32, DType::F16],
    );
    check_generation(p.name, p.dev.as_ref(), Arch::Llama3, &[DType::F32]);
    check_generation(p.name, p.dev.as_ref(), Arch::Tiny, &[DType::F16]);
}

#[test]
fn generation_matches_recomputation_vulkan_packed_f16() {
    let p = gpu_path(1);
    check_generation(p.name, p.dev.as_ref(), Arch::Gpt, &[DType::F16]);
    check_generation(p.name, p.dev.as_ref(), Arch::Llama, &[DType::F16]);
}

/// The raw Vulkan backend (its own GEMM and attention SPIR-V) runs the decode passes too.
#[test]
fn generation_matches_recomputation_vk() {
    let p = gpu_path(3);
    check_generation(p.name, p.dev.as_ref(), Arch::Gpt, &[DType::F16]);
    check_generation(p.name, p.dev.as_ref(), Arch::Llama3, &[DType::F32]);
}

#[test]
fn generation_matches_recomputation_gl() {
    let p = gpu_path(2);
    check_generation(p.name, p.dev.as_ref(), Arch::Gpt, &[DType::F32, DType::F16]);
    check_generation(p.name, p.dev.as_ref(), Arch::Llama, &[DType::F16]);
}

/// Bad input is refused with the problem and the fix, before or without a panic.
#[test]
fn generator_refuses_bad_input() {
    let cpu = CpuDevice::new();
    let model = Gpt::new(config(), 1);
    let w = weights(&model);
    let e = Generator::new(&cpu, &model, &w, DType::F32, 81)
        .unwrap_err()
        .to_string();
    assert!(e.contains("max_len 81") && e.contains("block_size"), "{e}");
    let e = Generator::new(&cpu, &model, &w[1..], DType::F32, 8)
        .unwrap_err()
        .to_string();
    assert!(e.contains("no weights for `transformer.wte.weight`"), "{e}");
    let mut short = w.clone();
    short[3].1.pop();
    let e = Generator::new(&cpu, &model, &short, DType::F32, 8)
        .unwrap_err()
        .to_string();
    assert!(e.contains(&short[3].0) && e.contains("values"), "{e}");
    // The tied name loads the embedding too.
    let mut tied = w.clone();
    tied[0].0 = "lm_head.weight".into();
    let mut gen = Generator::new(&cpu, &model, &tied, DType::F32, 8).unwrap();
    let e = gen.prefill(&cpu, &[67]).unwrap_err().to_string();
    assert!(
        e.contains("token 67") && e.contains("vocabulary of 67"),
        "{e}"
    );
    let e = gen.prefill(&cpu, &[]).unwrap_err().to_string();
    assert!(e.contains("no tokens"), "{e}");
    gen.prefill(&cpu, &[1; 8]).unwrap();
    let e = gen.step(&cpu, 1).unwrap_err().to_string();
    assert!(e.contains("max_len 8") && e.contains("reset"), "{e}");
    gen.reset();
    assert_eq!(gen.position(), 0);
    gen.step(&cpu, 1).unwrap();
    gen.free(&cpu).unwrap();
    assert_eq!(cpu.allocated_bytes(), 0, "free releases every buffer");
}

/// A 70-token prompt runs as passes of 64, 4 and 2 rows (each row attending to the
/// earlier rows of its own pass through the cache); fed one token at a time it runs 70
/// one-row passes. Both leave the same cache: the logits after the prompt and after one
/// more token agree.
#[test]
fn prefill_in_passes_equals_token_by_token() {
    let cpu = CpuDevice::new();
    let model = Gpt::new(config(), 1);
    let w = weights(&model);
    let prompt: Vec<u32> = (0..70u32).map(|i| (i * 29 + 3) % 67).collect();
    let mut whole = Generator::new(&cpu, &model, &w, DType::F32, 72).unwrap();
    let mut single = Generator::new(&cpu, &model, &w, DType::F32, 72).unwrap();
    let a = [
        whole.prefill(&cpu, &prompt).unwrap(),
        whole.step(&cpu, 9).unwrap(),
    ];
    let mut last = vec![];
    for &t in &prompt {
        last = single.step(&cpu, t).unwrap();
    }
    let b = [last, single.step(&cpu, 9).unwrap()];
    for (x, y) in a.iter().zip(&b) {
        let e = rel_err(x, y);
        assert!(e <= 1e-6, "prefill in passes vs token by token: {e:.1e}");
    }
    let passes = format!("{whole:?}");
    assert!(passes.contains("passes: [1, 2, 4, 64]"), "{passes}");
}

/// `Kernel::RopeAt` (positions from a buffer) on the CPU equals `Kernel::Rope` at the
/// positions it implies (row r at r % seq), then every GPU path equals the CPU at
/// scattered positions up to 4095 (f16 and bf16 on the paths, f32 where noted):
/// the rotation is elementwise after an f32 angle, so the same tolerance as the
/// existing rope tests: the angle's f32 error at |a| < 4096 (2e-3 rad) times |x| <= 2.
/// Forward and inverse (the backward of packed training, whose positions restart).
fn rope_at_case(
    dev: &dyn Device,
    dtype: DType,
    positions: &[u32],
    seed: u64,
    inverse: bool,
) -> Vec<f32> {
    let (heads, dim) = (3, 10);
    let cols = heads * dim;
    let mut rng = Rng::new(seed);
    let x: Vec<f32> = (0..positions.len() * cols)
        .map(|_| rng.uniform(-2.0, 2.0))
        .collect();
    let bx = put(dev, &HostData::from_f32(dtype, &x));
    let pos = put(dev, &HostData::U32(positions.to_vec()));
    let out = dev.alloc(dtype, x.len()).unwrap();
    dev.launch(&Kernel::RopeAt(RopeAt {
        x: bx,
        out,
        positions: pos,
        cols,
        dim,
        freqs: 10000.0f32.into(),
        inverse,
    }))
    .unwrap();
    let got = dev.download(out).unwrap().to_f32();
    for b in [bx, pos, out] {
        dev.free(b).unwrap();
    }
    got
}

#[test]
fn rope_at_matches_rope_and_the_cpu() {
    let cpu = CpuDevice::new();
    // Against Rope: 2 sequences of 5 rows, positions 0..5 twice.
    let positions: Vec<u32> = (0..10).map(|r| r % 5).collect();
    for inverse in [false, true] {
        let got = rope_at_case(&cpu, DType::F32, &positions, 5, inverse);
        let mut rng = Rng::new(5);
        let x: Vec<f32> = (0..10 * 30).map(|_| rng.uniform(-2.0, 2.0)).collect();
        let bx = put(&cpu, &HostData::F32(x));
        let out = cpu.alloc(DType::F32, 300).unwrap();
        cpu.launch(&Kernel::Rope(Rope {
            x: bx,
            out,
            cols: 30,
            dim: 10,
            seq: 5,
            freqs: 10000.0f32.into(),
            inverse,
        }))
        .unwrap();
        assert_eq!(
            got,
            cpu.download(out).unwrap().to_f32(),
            "inverse {inverse}"
        );
    }
    let scattered = [0u32, 4095, 1, 17, 1000, 2, 333];
    for i in 0..3 {
        let p = gpu_path(i);
        for (dtype, inverse) in [
            (DType::F32, false),
            (DType::F16, false),
            (DType::BF16, false),
            (DType::F32, true),
            (DType::F16, true),
        ] {
            let want = rope_at_case(&cpu, dtype, &scattered, 9, inverse);
            let g = rope_at_case(p.dev.as_ref(), dtype, &scattered, 9, inverse);
            let tol = match dtype {
                DType::F32 => 4e-3,
                DType::F16 => 4e-3 + 2f64.powi(-10),
                _ => 4e-3 + 2f64.powi(-7),
            };
            let e = rel_err(&g, &want);
            assert!(
                e <= tol,
                "{} {dtype} (inverse {inverse}): rope_at off by {e:.1e} (tolerance {tol:.1e})",
                p.name
            );
        }
    }
}

/// `kiln bench sample` on the demo's shape: both rates measured and reported apart,
/// as JSON and as the table; zero tokens or an unknown model are clear errors.
#[test]
fn bench_sample_reports_prompt_and_decode_rates() {
    let kiln = |args: &[&str]| {
        std::process::Command::new(env!("CARGO_BIN_EXE_kiln"))
            .args(args)
            .output()
            .unwrap()
    };
    let out = kiln(&[
        "bench",
        "sample",
        "--devices",
        "vulkan",
        "--models",
        "addition",
        "--json",
        "-",
    ]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        stdout.contains("prompt tok/s") && stdout.contains("decode tok/s"),
        "{stdout}"
    );
    let json = &stdout[stdout.find('[').unwrap()..];
    let rows: serde_json::Value = serde_json::from_str(json).unwrap();
    let r = &rows[0];
    assert_eq!(
        (r["prompt_tokens"].as_u64(), r["decode_tokens"].as_u64()),
        (Some(6), Some(3))
    );
    assert!(r["prompt_tok_s"].as_f64().unwrap() > 0.0);
    assert!(r["decode_tok_s"].as_f64().unwrap() > 0.0);
    assert!(r["adapter"].as_str().unwrap().contains("vulkan"), "{r}");
    let out = kiln(&["bench", "sample", "--tokens", "0"]);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("at least 1"));
    let out = kiln(&["bench", "sample", "--models", "gpt5"]);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("use addition or gpt2-124m"));
}

/// A decode pass of R > 1 rows runs no loss, and its rows after the last attention's
/// output (projection, residual, MLP, final norm, head) on the last row alone, reading
/// the last row of the attention output and of the residual stream: 2 gathers more
/// than a one-row pass, which gathers nothing. A decoding graph does not train.
#[test]
fn decode_pass_keeps_what_the_next_token_needs() {
    let cpu = CpuDevice::new();
    let compiled = |rows: usize| -> (Vec<usize>, usize) {
        let m = Gpt::new(config(), rows);
        let mut g = Graph::decoding(8);
        let specs = m.parameters();
        let params: Vec<Tensor> = specs
            .iter()
            .map(|s| g.param(&s.name, &s.shape, DType::F32, DType::F32, false))
            .collect::<Result<_>>()
            .unwrap();
        let f = m.forward(&mut g, &params, 1, DType::F32).unwrap();
        let e = g
            .compile(&cpu, &Default::default(), None)
            .err()
            .unwrap()
            .to_string();
        assert!(e.contains("compile_forward"), "{e}");
        let (pass, logits) = g.decode_pass(f.prediction).unwrap();
        let mut owned = vec![];
        let mut buf = |dtype: DType, shape: &[usize]| {
            let b = cpu.alloc(dtype, shape.iter().product()).unwrap();
            owned.push(b);
            b
        };
        let weights: Vec<Buffer> = specs.iter().map(|s| buf(DType::F32, &s.shape)).collect();
        let tokens = pass.decode_tokens().unwrap();
        let mut inputs = vec![(tokens, buf(DType::U32, &[rows]))];
        let positions = pass.decode_positions().unwrap();
        inputs.push((positions, buf(DType::U32, &[rows])));
        for &(k, v) in pass.decode_caches() {
            inputs.push((k, buf(DType::F32, pass.shape(k))));
            inputs.push((v, buf(DType::F32, pass.shape(v))));
        }
        assert_eq!(pass.decode_caches().len(), 2, "one cache pair per layer");
        let mut plan = pass.compile_forward(&cpu, &weights, &inputs).unwrap();
        let launches = plan.launch_count();
        plan.free(&cpu).unwrap();
        for b in owned {
            cpu.free(b).unwrap();
        }
        (pass.shape(logits).to_vec(), launches)
    };
    // Embeddings 3; per layer: ln, qkv, 2 cache writes, cached attention, proj, add,
    // ln, fc, gelu, proj, add = 12; final ln and head 2: 29, and no cross-entropy.
    assert_eq!(compiled(1), (vec![1, 1, 67], 29));
    assert_eq!(compiled(4), (vec![1, 1, 67], 31));
    assert_eq!(cpu.allocated_bytes(), 0);
    let mut g = Graph::new();
    let x = g.input("x", &[2, 3], DType::F32);
    let e = g.decode_pass(x).unwrap_err().to_string();
    assert!(e.contains("Graph::decoding"), "{e}");

    // A linear whose weight is computed (not a parameter) needs all of it: it runs over
    // every row, and only its result's last row is gathered (embedding, add, linear,
    // gather: 4 launches).
    let mut g = Graph::decoding(8);
    let table = g
        .param("table", &[5, 4], DType::F32, DType::F32, false)
        .unwrap();
    let w = g
        .param("w", &[4, 6], DType::F32, DType::F32, false)
        .unwrap();
    let tokens = g.input("tokens", &[1, 3], DType::U32);
    let x = g.embedding(tokens, table).unwrap();
    let w2 = g.add(w, w).unwrap();
    let y = g.linear(x, w2, None).unwrap();
    let (pass, out) = g.decode_pass(y).unwrap();
    assert_eq!(pass.shape(out), [1, 1, 6]);
    let bufs = [
        cpu.alloc(DType::F32, 20).unwrap(),
        cpu.alloc(DType::F32, 24).unwrap(),
    ];
    let t = cpu.alloc(DType::U32, 3).unwrap();
    let mut plan = pass.compile_forward(&cpu, &bufs, &[(tokens, t)]).unwrap();
    assert_eq!(plan.launch_count(), 4);
    plan.free(&cpu).unwrap();
    for b in bufs.into_iter().chain([t]) {
        cpu.free(b).unwrap();
    }
}
