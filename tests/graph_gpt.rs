//! GPT-2 on the graph, beyond what tests/gpt.rs checks (finite differences, CPU against
//! Vulkan, learning): the ready groups a data-parallel exchange reads mid-backward, the
//! host-decided update, and the plan's memory against the hand-written model it
//! replaced. (Before that model was deleted, the plan-based `Gpt` was checked equal to
//! it bit for bit on the CPU: losses, gradients, weights after steps with
//! accumulation and clipping, in f32, f16 and bf16, fused and straightforward.)

mod common;

use common::*;
use kiln::cpu::CpuDevice;
use kiln::engine::graph::Attention;
use kiln::engine::models::gpt::GptConfig;
use kiln::engine::models::{MicroBatch, Network, NetworkOptions};
use kiln::engine::{DType, Device, Optimizer, IGNORE_TARGET};

fn options(b: usize, dtype: DType) -> NetworkOptions {
    NetworkOptions {
        batch: b,
        dtype,
        optimizer: Optimizer::adamw(1e-2, 0.1),
        seed: 5,
        packed: false,
    }
}

fn small() -> GptConfig {
    GptConfig {
        n_layer: 2,
        n_head: 2,
        n_embd: 8,
        block_size: 8,
        vocab_size: 11,
        padded_vocab_size: None,
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

#[test]
fn ready_groups_arrive_final_top_block_first_and_apply_equals_a_step() {
    // The data-parallel path: `ready(params)` fires mid-backward once those gradients
    // are final. Each group's gradients, read inside the callback, must equal what a
    // twin model's backward without callbacks leaves; the blocks come top first, then
    // the embeddings and the final norm; and the host-decided update (`apply` at
    // factor 1) must move the weights as a step without clipping does.
    let dev = CpuDevice::new();
    let cfg = small();
    let model = gpt_model(&cfg, 5, Attention::Fused);
    let mut hooked = Network::new(&dev, model.clone(), &options(2, DType::F32)).unwrap();
    let mut twin = Network::new(&dev, model.clone(), &options(2, DType::F32)).unwrap();
    let mut rng = Rng::new(11);
    let (a, b) = (batch(&mut rng, 10, 11), batch(&mut rng, 10, 11));
    let micro = [
        MicroBatch::tokens(&a.0, &a.1),
        MicroBatch::tokens(&b.0, &b.1),
    ];
    let n = hooked.parameter_tensors();
    let bufs: Vec<_> = (0..n).map(|i| hooked.gradient_buffer(i)).collect();
    let mut seen: Vec<(usize, Vec<f32>)> = vec![];
    let mut order = vec![];
    let per_row = 1.0 / hooked.trained_rows(&micro) as f32;
    hooked
        .accumulate_with(
            &dev,
            &micro,
            1.0,
            per_row,
            Some(&mut |g: &[usize]| {
                order.push(g.to_vec());
                for &p in g {
                    seen.push((p, dev.download(bufs[p])?.to_f32()));
                }
                Ok(())
            }),
        )
        .unwrap();
    // Each block in two parts: what backward finishes first up to half the block's
    // elements (the MLP's projection and c_fc weights: two thirds), then the rest (the
    // c_fc bias's gradient, a reduction over rows, is finished later than its weight's).
    let part = |l: usize, idx: &[usize]| idx.iter().map(|i| 2 + 12 * l + i).collect::<Vec<_>>();
    let (mlp, rest) = ([8, 10, 11], [0, 1, 2, 3, 4, 5, 6, 7, 9]);
    let order: Vec<Vec<usize>> = order
        .into_iter()
        .map(|mut g| {
            g.sort();
            g
        })
        .collect();
    assert_eq!(
        order,
        vec![
            part(1, &mlp),
            part(1, &rest),
            part(0, &mlp),
            part(0, &rest),
            vec![0, 1, n - 2, n - 1]
        ]
    );
    assert_eq!(seen.len(), n);
    twin.accumulate(&dev, &micro, 1.0).unwrap();
    let want = twin.gradient_values(&dev).unwrap();
    for (p, g) in &seen {
        assert_eq!(g, &want[*p], "parameter {p}: not final when handed over");
    }
    hooked.apply(&dev, 1e-2, 1.0).unwrap();
    // A step without clipping: the factor the device computes is 1 / loss scale = 1.
    let mut stepped = Network::new(&dev, model, &options(2, DType::F32)).unwrap();
    stepped.accumulate(&dev, &micro, 1.0).unwrap();
    let (overflow, _) = stepped.check(&dev, 0.0).unwrap();
    assert!(!overflow);
    stepped.update(&dev, 1e-2).unwrap();
    assert_eq!(
        hooked.parameters(&dev).unwrap(),
        stepped.parameters(&dev).unwrap()
    );
}

/// Activation and scratch bytes the hand-written model (deleted) allocated: each block
/// kept its own activations and backward had one set of scratch buffers.
fn hand_written_activations(cfg: &GptConfig, batch: usize, seq: usize, p: DType) -> u64 {
    let (f, a, u) = (
        |n: usize| DType::F32.padded_bytes(n),
        |n: usize| p.padded_bytes(n),
        |n: usize| DType::U32.padded_bytes(n),
    );
    let (c, h, v, l) = (cfg.n_embd, cfg.n_head, cfg.vocab_size, cfg.n_layer);
    let (bt, bhtt) = (batch * seq, batch * h * seq * seq);
    let block = 9 * a(bt * c) + a(bt * 3 * c) + a(bhtt) + 2 * a(bt * 4 * c) + 4 * f(bt);
    l as u64 * block
        + 3 * u(bt)
        + a(bt)
        + 2 * a(bt * c)
        + 4 * f(bt)
        + 2 * a(bt * v)
        + 9 * a(bt * c)
        + 2 * a(bt * 4 * c)
        + a(bt * 3 * c)
        + 2 * a(bhtt)
        + f(2 * batch * h * seq)
}

#[test]
fn the_plan_shares_buffers_and_needs_less_than_the_hand_written_model() {
    // The reference size: 2 layers, n_embd 64, 4 heads, T 32, vocab 97.
    let cfg = GptConfig {
        n_layer: 2,
        n_head: 4,
        n_embd: 64,
        block_size: 32,
        vocab_size: 97,
        padded_vocab_size: None,
    };
    let p = DType::F16;
    let model = gpt_model(&cfg, 32, Attention::Straightforward);
    let plan = Network::memory(model.as_ref(), &options(2, p))
        .unwrap()
        .activations;
    let hand = hand_written_activations(&cfg, 2, 32, p);
    eprintln!("straightforward attention, fp16: the plan holds {plan} bytes, the hand-written model held {hand}");
    assert!(plan < hand, "plan {plan} vs hand-written {hand}");
}
