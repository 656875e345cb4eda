//! GPT-2 written on the graph against the hand-written `Gpt`: the same parameters
//! (names, shapes, order, initial values), the same loss and every parameter's
//! gradient on the CPU and on Vulkan (lavapipe) in f32 and f16, the same weights after
//! training steps, and a plan whose shared buffers use less memory than one buffer
//! per intermediate.

mod common;

use common::*;
use kiln::cpu::CpuDevice;
use kiln::engine::gpt::{Attention, Gpt, GptConfig, GptMemory, GptTraining};
use kiln::engine::graph::gpt::GptGraph;
use kiln::engine::mlp::Precision;
use kiln::engine::{Device, Optimizer, IGNORE_TARGET};

fn training(b: usize, t: usize, precision: Precision, attention: Attention) -> GptTraining {
    GptTraining {
        batch: b,
        seq: t,
        precision,
        optimizer: Optimizer::adamw(1e-2, 0.1),
        seed: 5,
        attention,
    }
}

fn small() -> GptConfig {
    GptConfig {
        n_layer: 2,
        n_head: 2,
        n_embd: 8,
        block_size: 8,
        vocab_size: 11,
    }
}

/// The reference size: 2 layers, n_embd 64, 4 heads, T 32, vocab 97.
fn reference() -> GptConfig {
    GptConfig {
        n_layer: 2,
        n_head: 4,
        n_embd: 64,
        block_size: 32,
        vocab_size: 97,
    }
}

/// Random tokens, their next-token targets, two positions not trained on.
fn batch(rng: &mut Rng, n: usize, vocab: usize) -> (Vec<u32>, Vec<u32>) {
    let t: Vec<u32> = (0..n + 1).map(|_| rng.next_u32() % vocab as u32).collect();
    let mut tgt = t[1..].to_vec();
    tgt[1] = IGNORE_TARGET;
    tgt[n - 2] = IGNORE_TARGET;
    (t[..n].to_vec(), tgt)
}

/// Both models on `dev` from the same seed; the graph's weights are checked equal to
/// the hand-written model's bit for bit (same layout, same initialisation).
fn pair(dev: &dyn Device, cfg: &GptConfig, tr: &GptTraining) -> (Gpt, GptGraph) {
    let gpt = Gpt::new(dev, cfg.clone(), tr.clone()).unwrap();
    let graph = GptGraph::new(dev, cfg.clone(), tr.clone()).unwrap();
    assert_eq!(graph.parameter_layout(), gpt.parameter_layout());
    for i in 0..gpt.parameter_tensors() {
        assert_eq!(
            graph.value(dev, i).unwrap().bits(),
            gpt.value(dev, i).unwrap().bits(),
            "parameter {i} starts differently"
        );
    }
    (gpt, graph)
}

/// Loss and every gradient of both models; returns the worst gradient difference
/// relative to its tensor's largest gradient. Fails past `loss_tol` (relative) or
/// `grad_tol`.
fn compare(
    dev: &dyn Device,
    cfg: &GptConfig,
    tr: &GptTraining,
    loss_tol: f64,
    grad_tol: f32,
) -> f32 {
    let (gpt, mut graph) = pair(dev, cfg, tr);
    let mut rng = Rng::new(7);
    let (tok, tgt) = batch(&mut rng, tr.batch * tr.seq, cfg.vocab_size);
    let lh = gpt.loss_and_gradients(dev, &tok, &tgt).unwrap();
    let lg = graph.loss_and_gradients(dev, &tok, &tgt).unwrap();
    assert!(
        (lh - lg).abs() <= loss_tol * lh.abs(),
        "loss: graph {lg}, hand-written {lh}"
    );
    let mut worst = 0f32;
    for ((name, gh), (_, gg)) in gpt
        .gradients(dev)
        .unwrap()
        .iter()
        .zip(graph.gradients(dev).unwrap())
    {
        let scale = gh.iter().fold(0f32, |a, v| a.max(v.abs())).max(1e-12);
        let d = gh
            .iter()
            .zip(&gg)
            .map(|(a, b)| (a - b).abs())
            .fold(0f32, f32::max);
        assert!(
            d <= grad_tol * scale,
            "{name}: worst |graph - hand-written| {d} vs max |grad| {scale}"
        );
        worst = worst.max(d / scale);
    }
    worst
}

#[test]
fn cpu_loss_and_every_gradient_equal_the_hand_written_gpt() {
    let dev = CpuDevice::new();
    for attention in [Attention::Fused, Attention::Straightforward] {
        // The graph records the same kernels in the same order, and adds every
        // gradient's contributions in the same order: the results are bit-identical
        // (tolerance 0).
        let tr = training(2, 5, Precision::F32, attention);
        compare(&dev, &small(), &tr, 0.0, 0.0);
    }
    // The reference size, fused attention, f32 and f16 storage.
    for precision in [Precision::F32, Precision::F16] {
        let tr = training(2, 32, precision, Attention::Fused);
        compare(&dev, &reference(), &tr, 0.0, 0.0);
    }
}

#[test]
fn cpu_training_steps_equal_the_hand_written_gpt() {
    let dev = CpuDevice::new();
    let cfg = small();
    let tr = training(2, 5, Precision::F32, Attention::Fused);
    let (mut gpt, mut graph) = pair(&dev, &cfg, &tr);
    let mut rng = Rng::new(8);
    for s in 0..3 {
        let (tok, tgt) = batch(&mut rng, 10, cfg.vocab_size);
        let a = gpt.train_step(&dev, &tok, &tgt).unwrap();
        let b = graph.train_step(&dev, &tok, &tgt).unwrap();
        assert_eq!(a, b, "step {s}");
    }
    // AdamW with decay on the matrices only, through the plan's update: bit-identical.
    for ((name, a), (_, b)) in gpt
        .parameters(&dev)
        .unwrap()
        .iter()
        .zip(graph.parameters(&dev).unwrap())
    {
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(a), bits(&b), "{name} after 3 steps");
    }
}

#[test]
fn micro_batches_and_clipping_equal_the_hand_written_gpt() {
    // Two micro-batches per step accumulate into the parameter gradients (GEMMs with
    // beta 1, zero fills skipped after the first), and the global norm clips them.
    let dev = CpuDevice::new();
    let cfg = small();
    let tr = training(2, 5, Precision::F32, Attention::Straightforward);
    let clip = 0.5;
    let mut gpt = Gpt::new(&dev, cfg.clone(), tr.clone()).unwrap();
    let mut graph = GptGraph::with_clip(&dev, cfg.clone(), tr, clip).unwrap();
    let mut rng = Rng::new(9);
    for s in 0..3 {
        let (a, b) = (batch(&mut rng, 10, 11), batch(&mut rng, 10, 11));
        let micro: [(&[u32], &[u32]); 2] = [(&a.0, &a.1), (&b.0, &b.1)];
        let x = gpt.step(&dev, &micro, 1e-2, clip).unwrap();
        let y = graph.step(&dev, &micro, 1e-2).unwrap();
        assert_eq!(x, y, "step {s}");
        let (gs, ps) = (
            gpt.last_grad_scale(&dev).unwrap(),
            graph.last_grad_scale(&dev).unwrap(),
        );
        // Gpt sums the norm's squares per flat buffer, the plan per tensor: the same
        // f32 terms in another order, within a few ulps.
        assert!(
            (gs - ps).abs() <= 4.0 * f32::EPSILON * gs,
            "step {s}: gradient factor {gs} vs {ps}"
        );
        assert!(
            gs < 1.0,
            "step {s}: the norm should exceed {clip} and clip ({gs})"
        );
    }
    for ((name, a), (_, b)) in gpt
        .parameters(&dev)
        .unwrap()
        .iter()
        .zip(graph.parameters(&dev).unwrap())
    {
        // Adam divides by the root of the second moment, so an ulp in the factor can
        // move a weight by a few ulps of lr: 1e-6 absolute at lr 1e-2.
        for (x, y) in a.iter().zip(&b) {
            assert!(
                (x - y).abs() <= 1e-6,
                "{name} after 3 clipped steps of 2 micro-batches: {x} vs {y}"
            );
        }
    }
}

#[test]
fn an_overflowing_fp16_step_is_skipped_as_the_hand_written_gpt_skips_it() {
    let dev = CpuDevice::new();
    let cfg = small();
    let tr = training(2, 5, Precision::F16, Attention::Fused);
    let (mut gpt, mut graph) = pair(&dev, &cfg, &tr);
    let mut rng = Rng::new(10);
    let (tok, tgt) = batch(&mut rng, 10, cfg.vocab_size);
    assert_eq!(
        gpt.train_step(&dev, &tok, &tgt).unwrap(),
        graph.train_step(&dev, &tok, &tgt).unwrap()
    );
    // Poison one embedding row with f16's largest value in both: the forward
    // overflows, the flag is set, the scaler skips (twice: hysteresis 2) and halves.
    let (name, wte) = gpt.parameters(&dev).unwrap()[0].clone();
    assert_eq!(name, "transformer.wte.weight");
    let mut poisoned = wte;
    poisoned[tok[0] as usize * cfg.n_embd] = 65504.0;
    gpt.set_parameter(&dev, 0, &poisoned).unwrap();
    graph
        .set_parameter(&dev, 0, &gpt.value(&dev, 0).unwrap(), &poisoned)
        .unwrap();
    let before = graph.parameters(&dev).unwrap();
    for s in 0..2 {
        let x = gpt.train_step(&dev, &tok, &tgt).unwrap();
        let y = graph.train_step(&dev, &tok, &tgt).unwrap();
        // The loss is NaN in both (the overflow reached it), so fields one by one.
        assert!(y.skipped && x.skipped, "step {s}: {x:?} {y:?}");
        assert!(y.loss.is_nan() && x.loss.is_nan(), "step {s}: {x:?} {y:?}");
        assert_eq!(x.scale, y.scale, "step {s}");
    }
    assert_eq!(
        graph.parameters(&dev).unwrap(),
        before,
        "a skipped step moved weights"
    );
    assert_eq!(graph.steps_applied(), 1);
    assert_eq!(graph.scaler.scale(), gpt.scaler.scale());
}

#[test]
fn ready_groups_arrive_final_in_the_hand_written_order_and_apply_equals_it() {
    // The data-parallel path: `ready(params)` fires mid-backward once those gradients
    // are final. Each group's gradients, read inside the callback, must already equal
    // the finished backward's; the order must be the hand-written model's; and the
    // host-decided update (`apply`) must move the weights the same way.
    let dev = CpuDevice::new();
    let cfg = small();
    let tr = training(2, 5, Precision::F32, Attention::Fused);
    let (mut gpt, mut graph) = pair(&dev, &cfg, &tr);
    let mut rng = Rng::new(11);
    let (a, b) = (batch(&mut rng, 10, 11), batch(&mut rng, 10, 11));
    let micro: [(&[u32], &[u32]); 2] = [(&a.0, &a.1), (&b.0, &b.1)];
    let mut order_hand = vec![];
    gpt.accumulate_with(&dev, &micro, &mut |g: &[usize]| {
        order_hand.push(g.to_vec());
        Ok(())
    })
    .unwrap();
    let mut seen: Vec<(usize, Vec<f32>)> = vec![];
    let mut order = vec![];
    let bufs: Vec<_> = (0..gpt.parameter_tensors())
        .map(|i| graph.gradient_buffer(i))
        .collect();
    graph
        .accumulate_with(&dev, &micro, &mut |g: &[usize]| {
            order.push(g.to_vec());
            for &p in g {
                seen.push((p, dev.download(bufs[p])?.to_f32()));
            }
            Ok(())
        })
        .unwrap();
    assert_eq!(order, order_hand);
    assert_eq!(seen.len(), gpt.parameter_tensors());
    let final_grads = graph.gradients(&dev).unwrap();
    let hand = gpt.gradient_values(&dev).unwrap();
    for (p, g) in &seen {
        assert_eq!(
            g, &final_grads[*p].1,
            "{}: changed after ready",
            final_grads[*p].0
        );
        assert_eq!(
            g, &hand[*p],
            "{}: differs from the hand-written",
            final_grads[*p].0
        );
    }
    gpt.apply(&dev, 1e-2, 0.5).unwrap();
    graph.apply(&dev, 1e-2, 0.5).unwrap();
    assert_eq!(
        gpt.parameters(&dev).unwrap(),
        graph.parameters(&dev).unwrap()
    );
}

#[test]
fn the_gpt_plan_shares_buffers_and_needs_less_than_the_hand_written_model() {
    let dev = CpuDevice::new();
    let cfg = reference();
    for attention in [Attention::Fused, Attention::Straightforward] {
        let tr = training(2, 32, Precision::F16, attention);
        let graph = GptGraph::new(&dev, cfg.clone(), tr.clone()).unwrap();
        let m = graph.memory();
        let hand = GptMemory::of(&cfg, 2, 32, Precision::F16, attention).activations;
        eprintln!(
            "{attention:?}: {} placeholders in {} buffers: {} bytes shared ({} without \
             sharing) + {} pinned; the hand-written Gpt holds {hand} bytes of activations \
             and scratch; {} launches per step",
            m.placeholders,
            m.slots,
            m.with_reuse,
            m.without_reuse,
            m.pinned,
            graph.plan().launch_count()
        );
        assert!(m.with_reuse < m.without_reuse, "{m:?}");
        assert!(m.total() < hand, "{m:?} vs hand-written {hand}");
    }
}

#[test]
fn vulkan_loss_and_every_gradient_equal_the_hand_written_gpt_in_f32_and_f16() {
    let cfg = reference();
    // f32: both models run the same kernels on the same device, so any difference is
    // the GPU's own nondeterminism (none expected); 1e-6 of the tensor's largest
    // gradient allows for a reordered reduction.
    let dev = gpu("vulkan", false);
    let tr = training(2, 32, Precision::F32, Attention::Fused);
    let w = compare(dev.as_ref(), &cfg, &tr, 1e-6, 1e-6);
    eprintln!("vulkan f32: worst relative gradient difference {w:e}");
    // f16 storage, native f16 arithmetic and packed (f16 off): the same kernels again,
    // so the same bits; 1e-3 allows one f16 rounding step (2^-11) of difference.
    for p in [gpu_path(0), gpu_path(1)] {
        let tr = training(2, 32, Precision::F16, Attention::Fused);
        let w = compare(p.dev.as_ref(), &cfg, &tr, 1e-3, 1e-3);
        eprintln!("{}: worst relative gradient difference {w:e}", p.name);
    }
}
