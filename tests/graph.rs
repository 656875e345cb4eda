//! The graph: every op's derived backward against central finite differences (CPU,
//! f32 storage, differences taken in f64), tensors used twice, liveness-based buffer
//! sharing (poisoned between steps, results unchanged) and plan replay against
//! re-recording.

mod common;

use common::*;
use kiln::cpu::CpuDevice;
use kiln::engine::device::optim::ParamBuffers;
use kiln::engine::graph::Attention;
use kiln::engine::graph::{Bindings, Graph, Plan};
use kiln::engine::kernels::Fill;
use kiln::engine::{Buffer, DType, Device, HostData, Kernel, Optimizer, IGNORE_TARGET};

/// A graph with its parameters and inputs on a device, ready to compile.
struct Model {
    g: Graph,
    params: Vec<ParamBuffers>,
    inputs: Vec<(kiln::engine::graph::Tensor, Buffer)>,
    /// d loss / d losses_r: 1 / the rows trained on.
    weight: f32,
}

impl Model {
    fn bindings(&self) -> Bindings {
        Bindings {
            params: self.params.clone(),
            inputs: self.inputs.clone(),
            groups: vec![],
        }
    }

    fn compile(&self, dev: &dyn Device) -> Plan {
        let adamw = Optimizer::adamw(1e-2, 0.1);
        self.g.compile(dev, &self.bindings(), Some(&adamw)).unwrap()
    }
}

/// Parameters uniform in [lo, hi), f32.
fn param(
    dev: &dyn Device,
    g: &mut Graph,
    rng: &mut Rng,
    name: &str,
    shape: &[usize],
    (lo, hi): (f32, f32),
    params: &mut Vec<ParamBuffers>,
) -> kiln::engine::graph::Tensor {
    let n: usize = shape.iter().product();
    let init: Vec<f32> = (0..n).map(|_| rng.uniform(lo, hi)).collect();
    params.push(ParamBuffers::new(dev, &init, DType::F32, DType::F32).unwrap());
    g.param(name, shape, DType::F32, DType::F32, true).unwrap()
}

/// Token ids (or targets) as an input bound to a fresh buffer.
fn ids(
    dev: &dyn Device,
    g: &mut Graph,
    name: &str,
    shape: &[usize],
    values: Vec<u32>,
    inputs: &mut Vec<(kiln::engine::graph::Tensor, Buffer)>,
) -> kiln::engine::graph::Tensor {
    let t = g.input(name, shape, DType::U32);
    inputs.push((t, put(dev, &HostData::U32(values))));
    t
}

/// Targets in 0..v with row 1 not trained on; returns them and the loss weight.
fn targets(rng: &mut Rng, rows: usize, v: usize) -> (Vec<u32>, f32) {
    let mut t: Vec<u32> = (0..rows).map(|_| rng.next_u32() % v as u32).collect();
    t[1] = IGNORE_TARGET;
    (t, 1.0 / (rows - 1) as f32)
}

/// Every gradient element of every parameter against central differences of the loss.
fn check_gradients(dev: &CpuDevice, m: &Model) {
    let mut plan = m.compile(dev);
    plan.accumulate(dev, 1.0, m.weight, 0).unwrap();
    // (One element near the noise floor, a cancellation in the tied table, was checked
    // against an exact f64 evaluation of the model: the backward agrees to 5 digits.)
    check_finite_differences(dev, &m.g, &m.params, &plan, m.weight);
    plan.free(dev).unwrap();
}

/// x -> linear(W1, b1) -> gelu -> linear(W2, b2) -> cross-entropy: linear (weight,
/// bias, input), GELU and the loss.
fn mlp(dev: &dyn Device, seed: u64) -> Model {
    let mut rng = Rng::new(seed);
    let (b, i, h, c) = (4, 3, 5, 4);
    let mut g = Graph::new();
    let (mut params, mut inputs) = (vec![], vec![]);
    let x = g.input("x", &[b, i], DType::F32);
    let xs: Vec<f32> = (0..b * i).map(|_| rng.uniform(-1.0, 1.0)).collect();
    inputs.push((x, put(dev, &HostData::F32(xs))));
    let w1 = param(
        dev,
        &mut g,
        &mut rng,
        "w1",
        &[i, h],
        (-1.0, 1.0),
        &mut params,
    );
    let b1 = param(dev, &mut g, &mut rng, "b1", &[h], (-0.5, 0.5), &mut params);
    let w2 = param(
        dev,
        &mut g,
        &mut rng,
        "w2",
        &[h, c],
        (-1.0, 1.0),
        &mut params,
    );
    let b2 = param(dev, &mut g, &mut rng, "b2", &[c], (-0.5, 0.5), &mut params);
    let (tgt, weight) = targets(&mut rng, b, c);
    let y = ids(dev, &mut g, "y", &[b], tgt, &mut inputs);
    let a = g.linear(x, w1, Some(b1)).unwrap();
    let a = g.gelu(a).unwrap();
    let logits = g.linear(a, w2, Some(b2)).unwrap();
    g.cross_entropy(logits, y).unwrap();
    Model {
        g,
        params,
        inputs,
        weight,
    }
}

#[test]
fn linear_gelu_and_cross_entropy_match_finite_differences() {
    let dev = CpuDevice::new();
    check_gradients(&dev, &mlp(&dev, 1));
}

/// Tokens -> embedding(wte) -> layernorm -> h; h feeds both a GELU and a residual add
/// (used twice), add(r, r) (one tensor as both operands), then a tied LM head reading
/// wte again (the table used twice: its gradient is the head's GEMM plus the
/// embedding's scatter).
#[test]
fn embedding_layernorm_add_and_tensors_used_twice_match_finite_differences() {
    let dev = CpuDevice::new();
    let mut rng = Rng::new(2);
    let (b, t, c, v) = (2, 3, 6, 7);
    let mut g = Graph::new();
    let (mut params, mut inputs) = (vec![], vec![]);
    let tok: Vec<u32> = (0..b * t).map(|_| rng.next_u32() % v as u32).collect();
    let tokens = ids(&dev, &mut g, "tokens", &[b, t], tok, &mut inputs);
    let wte = param(
        &dev,
        &mut g,
        &mut rng,
        "wte",
        &[v, c],
        (-1.0, 1.0),
        &mut params,
    );
    let lw = param(
        &dev,
        &mut g,
        &mut rng,
        "ln.w",
        &[c],
        (0.5, 1.5),
        &mut params,
    );
    let lb = param(
        &dev,
        &mut g,
        &mut rng,
        "ln.b",
        &[c],
        (-0.5, 0.5),
        &mut params,
    );
    let (tgt, weight) = targets(&mut rng, b * t, v);
    let y = ids(&dev, &mut g, "targets", &[b, t], tgt, &mut inputs);
    let x = g.embedding(tokens, wte).unwrap();
    let h = g.layernorm(x, lw, lb).unwrap();
    let r = g.gelu(h).unwrap();
    let r = g.add(r, h).unwrap();
    let r = g.add(r, r).unwrap();
    let logits = g.linear_transposed(r, wte, None).unwrap();
    g.cross_entropy(logits, y).unwrap();
    check_gradients(
        &dev,
        &Model {
            g,
            params,
            inputs,
            weight,
        },
    );
}

/// The two operands of an add may share its output's gradient buffer instead of
/// copying it, but only where nothing writes the buffer before the read-only one is
/// read. Here `u = x w` reads `x` after `y = gelu(ln(x))` is made, so at `z = x + y`
/// the linear's backward adds into `x`'s gradient before GELU's backward reads `y`'s:
/// sharing must be refused there. (The GPT's residual adds, where it is safe, are
/// held to the same numbers by tests/gpt.rs.)
#[test]
fn adds_share_a_gradient_buffer_only_where_it_is_safe() {
    let dev = CpuDevice::new();
    let mut rng = Rng::new(4);
    let (b, t, c, v) = (2, 3, 6, 7);
    let mut g = Graph::new();
    let (mut params, mut inputs) = (vec![], vec![]);
    let tok: Vec<u32> = (0..b * t).map(|_| rng.next_u32() % v as u32).collect();
    let tokens = ids(&dev, &mut g, "tokens", &[b, t], tok, &mut inputs);
    let mut p = |g: &mut Graph, name: &str, shape: &[usize], range| {
        param(&dev, g, &mut rng, name, shape, range, &mut params)
    };
    let wte = p(&mut g, "wte", &[v, c], (-1.0, 1.0));
    let lw = p(&mut g, "ln.w", &[c], (0.5, 1.5));
    let lb = p(&mut g, "ln.b", &[c], (-0.5, 0.5));
    let w = p(&mut g, "w", &[c, c], (-0.5, 0.5));
    let (tgt, weight) = targets(&mut rng, b * t, v);
    let y_ids = ids(&dev, &mut g, "targets", &[b, t], tgt, &mut inputs);
    let x = g.embedding(tokens, wte).unwrap();
    let a = g.layernorm(x, lw, lb).unwrap();
    let y = g.gelu(a).unwrap();
    let u = g.linear(x, w, None).unwrap();
    let z = g.add(x, y).unwrap();
    let s = g.add(z, u).unwrap();
    let logits = g.linear_transposed(s, wte, None).unwrap();
    g.cross_entropy(logits, y_ids).unwrap();
    check_gradients(
        &dev,
        &Model {
            g,
            params,
            inputs,
            weight,
        },
    );
}

/// Embedding -> qkv linear -> causal attention -> projection -> loss, in both forms.
fn attention_model(dev: &dyn Device, mode: Attention) -> Model {
    let mut rng = Rng::new(3);
    let (b, t, c, heads, v) = (2, 5, 8, 2, 5);
    let mut g = Graph::new();
    let (mut params, mut inputs) = (vec![], vec![]);
    let tok: Vec<u32> = (0..b * t).map(|_| rng.next_u32() % v as u32).collect();
    let tokens = ids(dev, &mut g, "tokens", &[b, t], tok, &mut inputs);
    let wte = param(
        dev,
        &mut g,
        &mut rng,
        "wte",
        &[v, c],
        (-1.0, 1.0),
        &mut params,
    );
    let wqkv = param(
        dev,
        &mut g,
        &mut rng,
        "qkv.w",
        &[c, 3 * c],
        (-0.7, 0.7),
        &mut params,
    );
    let bqkv = param(
        dev,
        &mut g,
        &mut rng,
        "qkv.b",
        &[3 * c],
        (-0.3, 0.3),
        &mut params,
    );
    let wo = param(
        dev,
        &mut g,
        &mut rng,
        "out.w",
        &[c, v],
        (-0.7, 0.7),
        &mut params,
    );
    let (tgt, weight) = targets(&mut rng, b * t, v);
    let y = ids(dev, &mut g, "targets", &[b, t], tgt, &mut inputs);
    let x = g.embedding(tokens, wte).unwrap();
    let qkv = g.linear(x, wqkv, Some(bqkv)).unwrap();
    let a = g.causal_attention(qkv, heads, mode).unwrap();
    let logits = g.linear(a, wo, None).unwrap();
    g.cross_entropy(logits, y).unwrap();
    Model {
        g,
        params,
        inputs,
        weight,
    }
}

#[test]
fn causal_attention_matches_finite_differences_fused_and_straightforward() {
    let dev = CpuDevice::new();
    for mode in [Attention::Fused, Attention::Straightforward] {
        check_gradients(&dev, &attention_model(&dev, mode));
    }
}

/// Embedding -> separate q, k, v projections -> grouped-query attention (4 query heads
/// sharing 2 K/V heads, D = 2) -> projection -> loss. With `shared_kv` one projection
/// is both k and v: one tensor read twice by the op, whose two gradients must add.
fn gqa_model(dev: &dyn Device, mode: Attention, shared_kv: bool) -> Model {
    let mut rng = Rng::new(6);
    let (b, t, c, heads, kv, d, v) = (2, 5, 6, 4, 2, 2, 5);
    let mut g = Graph::new();
    let (mut params, mut inputs) = (vec![], vec![]);
    let tok: Vec<u32> = (0..b * t).map(|_| rng.next_u32() % v as u32).collect();
    let tokens = ids(dev, &mut g, "tokens", &[b, t], tok, &mut inputs);
    let mut p = |g: &mut Graph, name: &str, shape: &[usize], range| {
        param(dev, g, &mut rng, name, shape, range, &mut params)
    };
    let wte = p(&mut g, "wte", &[v, c], (-1.0, 1.0));
    let wq = p(&mut g, "q.w", &[c, heads * d], (-0.7, 0.7));
    let wk = p(&mut g, "k.w", &[c, kv * d], (-0.7, 0.7));
    let wv = (!shared_kv).then(|| p(&mut g, "v.w", &[c, kv * d], (-0.7, 0.7)));
    let wo = p(&mut g, "out.w", &[heads * d, v], (-0.7, 0.7));
    let (tgt, weight) = targets(&mut rng, b * t, v);
    let y = ids(dev, &mut g, "targets", &[b, t], tgt, &mut inputs);
    let x = g.embedding(tokens, wte).unwrap();
    let q = g.linear(x, wq, None).unwrap();
    let k = g.linear(x, wk, None).unwrap();
    let vv = match wv {
        Some(wv) => g.linear(x, wv, None).unwrap(),
        None => k,
    };
    let a = g.attention(q, k, vv, heads, kv, mode).unwrap();
    let logits = g.linear(a, wo, None).unwrap();
    g.cross_entropy(logits, y).unwrap();
    Model {
        g,
        params,
        inputs,
        weight,
    }
}

#[test]
fn grouped_query_attention_matches_finite_differences_fused_and_straightforward() {
    let dev = CpuDevice::new();
    for mode in [Attention::Fused, Attention::Straightforward] {
        for shared_kv in [false, true] {
            check_gradients(&dev, &gqa_model(&dev, mode, shared_kv));
        }
    }
}

/// Runs `steps` training steps, optionally poisoning the shared buffers with NaN
/// before each; returns the losses and every parameter's master after.
fn train(dev: &dyn Device, m: &Model, plan: &mut Plan, steps: u32, poison: bool) -> Vec<Vec<f32>> {
    let mut out = vec![];
    for s in 1..=steps {
        if poison {
            for &b in plan.shared_buffers() {
                dev.launch(&Kernel::Fill(Fill {
                    dst: b,
                    value: f64::NAN,
                }))
                .unwrap();
            }
        }
        plan.accumulate(dev, 1.0, m.weight, 0).unwrap();
        plan.check(dev, 0.0).unwrap();
        assert!(!plan.overflowed(dev).unwrap(), "step {s} overflowed");
        out.push(vec![plan.loss_sum(dev).unwrap() as f32]);
        plan.update(dev, 1e-2, s).unwrap();
    }
    for p in &m.params {
        out.push(dev.download(p.master).unwrap().to_f32());
    }
    out
}

#[test]
fn shared_buffers_hold_nothing_a_step_reads_and_replay_equals_recompiling() {
    let dev = CpuDevice::new();
    let steps = 3;
    // Reference: a fresh plan every step (re-recorded, its buffers new and zeroed).
    let fresh = attention_model(&dev, Attention::Straightforward);
    let mut reference = vec![];
    for s in 1..=steps {
        let mut plan = fresh.compile(&dev);
        plan.accumulate(&dev, 1.0, fresh.weight, 0).unwrap();
        plan.check(&dev, 0.0).unwrap();
        reference.push(vec![plan.loss_sum(&dev).unwrap() as f32]);
        plan.update(&dev, 1e-2, s).unwrap();
        plan.free(&dev).unwrap();
    }
    for p in &fresh.params {
        reference.push(dev.download(p.master).unwrap().to_f32());
    }
    // One plan replayed, its shared buffers poisoned with NaN before every step: any
    // launch that read a buffer before writing it would turn the results into NaN.
    for poison in [false, true] {
        let m = attention_model(&dev, Attention::Straightforward);
        let mut plan = m.compile(&dev);
        let mem = plan.memory();
        assert!(
            mem.with_reuse < mem.without_reuse && mem.slots < mem.placeholders,
            "{mem:?}"
        );
        let got = train(&dev, &m, &mut plan, steps, poison);
        assert_eq!(got.len(), reference.len());
        for (k, (a, b)) in got.iter().zip(&reference).enumerate() {
            let (a, b): (Vec<u32>, Vec<u32>) = (
                a.iter().map(|x| x.to_bits()).collect(),
                b.iter().map(|x| x.to_bits()).collect(),
            );
            assert_eq!(
                a, b,
                "poison {poison}: result {k} differs from re-recording"
            );
        }
    }
}

#[test]
fn bad_graphs_and_bindings_are_errors_that_name_the_problem() {
    let dev = CpuDevice::new();
    let mut g = Graph::new();
    let x = g.input("x", &[4, 3], DType::F32);
    let w = g.param("w", &[5, 2], DType::F32, DType::F32, true).unwrap();
    let e = g.linear(x, w, None).unwrap_err().to_string();
    assert!(e.contains("linear") && e.contains("(3, N)"), "{e}");
    let h = g.param("h", &[2], DType::F32, DType::F16, false).unwrap();
    let e = g.layernorm(x, h, h).unwrap_err().to_string();
    assert!(e.contains("f32 gradient"), "{e}");
    let e = g
        .causal_attention(x, 2, Attention::Fused)
        .unwrap_err()
        .to_string();
    assert!(e.contains("(B, T, 3C)"), "{e}");
    // No loss yet; then a missing input binding; then a wrong parameter binding.
    let adamw = Optimizer::adamw(1e-3, 0.0);
    let training = Some(&adamw);
    let e = g
        .compile(&dev, &Bindings::default(), training)
        .err()
        .unwrap()
        .to_string();
    assert!(e.contains("cross_entropy"), "{e}");
    let mut rng = Rng::new(9);
    let m = mlp(&dev, 4);
    let mut b = m.bindings();
    b.inputs.pop();
    let e = m.g.compile(&dev, &b, training).err().unwrap().to_string();
    assert!(e.contains("input `y`"), "{e}");
    let mut b = m.bindings();
    b.params[0] =
        ParamBuffers::new(&dev, &[rng.uniform(0.0, 1.0); 3], DType::F32, DType::F32).unwrap();
    let e = m.g.compile(&dev, &b, training).err().unwrap().to_string();
    assert!(e.contains("`w1`"), "{e}");
}
