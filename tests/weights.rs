//! One way to set weights: `Trainer::set_weights` / `Network::set_weights` (and their
//! `load_weights` from a file) write the model copy, the f32 master and a fresh
//! optimizer state on every rank and ZeRO stage, so a model trained after an import
//! trains bit for bit like one built with the same weights.

mod common;

use common::*;
use kiln::cpu::CpuDevice;
use kiln::engine::device::host::HostTensor;
use kiln::engine::device::safetensors_io;
use kiln::engine::graph::Attention;
use kiln::engine::models::gpt::GptConfig;
use kiln::engine::models::{MicroBatch, Network, NetworkOptions, ParamState};
use kiln::engine::train::trainer::{StepStats, Trainer};
use kiln::engine::{DType, Device, HostData};

const B: usize = 2;
const T: usize = 8;
const V: usize = 13;

fn cfg() -> GptConfig {
    GptConfig {
        n_layer: 2,
        n_head: 2,
        n_embd: 16,
        block_size: T,
        vocab_size: V,
        padded_vocab_size: None,
    }
}

/// A group of `devs.len()` ranks training the 2-layer GPT in `dtype` at ZeRO `stage`,
/// weights drawn from `seed`.
fn trainer(devs: &[&dyn Device], dtype: DType, stage: u8, seed: u64) -> Trainer {
    let mut c = ds_config(B, 1, dtype, devs.len());
    c.zero.stage = stage;
    let model = gpt_model(&cfg(), T, Attention::Fused);
    Trainer::new_group(devs, model, c, seed).unwrap()
}

/// Per step, one micro-batch per rank: counting mod V from a random start.
fn data(steps: usize, world: usize) -> Vec<Vec<Vec<MicroBatch>>> {
    let mut rng = Rng::new(21);
    (0..steps)
        .map(|_| {
            (0..world)
                .map(|_| {
                    let (mut tok, mut tgt) = (vec![], vec![]);
                    for _ in 0..B {
                        let s = rng.next_u32() % V as u32;
                        tok.extend((0..T as u32).map(|i| (s + i) % V as u32));
                        tgt.extend((1..=T as u32).map(|i| (s + i) % V as u32));
                    }
                    vec![MicroBatch::tokens(&tok, &tgt)]
                })
                .collect()
        })
        .collect()
}

/// Every step's stats, then every parameter's full state (value, master, moments;
/// gathered from the ZeRO shards) and the engine's counters.
fn train(
    t: &mut Trainer,
    devs: &[&dyn Device],
    data: &[Vec<Vec<MicroBatch>>],
) -> (Vec<StepStats>, Vec<ParamState>) {
    let stats = data
        .iter()
        .map(|step| t.step_group(devs, step).unwrap())
        .collect();
    (stats, t.param_states(devs).unwrap())
}

/// Bit-for-bit equality of two runs, naming the first step or tensor that differs.
fn assert_same(
    what: &str,
    a: &(Vec<StepStats>, Vec<ParamState>),
    b: &(Vec<StepStats>, Vec<ParamState>),
) {
    for (i, (x, y)) in a.0.iter().zip(&b.0).enumerate() {
        assert!(
            x.loss.to_bits() == y.loss.to_bits() && x == y,
            "{what}: step {} differs: {x:?} vs {y:?}",
            i + 1
        );
    }
    assert_eq!(a.0.len(), b.0.len());
    for (x, y) in a.1.iter().zip(&b.1) {
        assert_eq!(
            x.value.bits(),
            y.value.bits(),
            "{what}: value of {}",
            x.name
        );
        for (part, p, q) in [
            ("master", &x.master, &y.master),
            ("exp_avg", &x.m, &y.m),
            ("exp_avg_sq", &x.v, &y.v),
        ] {
            let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
            assert!(bits(p) == bits(q), "{what}: {part} of {} differs", x.name);
        }
    }
}

/// The f32 masters of a trainer as host tensors under the model's names.
fn masters(t: &Trainer, devs: &[&dyn Device]) -> Vec<HostTensor> {
    t.param_states(devs)
        .unwrap()
        .into_iter()
        .map(|p| HostTensor::new(p.name, p.shape, HostData::F32(p.master)))
        .collect()
}

fn temp(name: &str) -> std::path::PathBuf {
    let d = std::env::temp_dir().join(format!("kiln-weights-{}", std::process::id()));
    std::fs::create_dir_all(&d).unwrap();
    d.join(name)
}

/// Model A is saved before training; B (another seed) loads the file; A' is A built
/// afresh. B and A' trained 5 steps on the same data agree bit for bit: losses, model
/// copies, masters and moments. (Loading into the model copy alone leaves B's random
/// masters in place, and its step-2 loss differs.)
fn imported_trains_like_built(dev: &dyn Device, dtype: DType) {
    let devs = [dev];
    let a = trainer(&devs, dtype, 0, 1);
    let path = temp(&format!("a-{dtype}.safetensors"));
    // fp32: the model copy is the whole truth. 16-bit: the f32 masters, so the model
    // copy B derives (rounded once) must be A's.
    if dtype == DType::F32 {
        safetensors_io::save(dev, &a.model.tensors().unwrap(), &path).unwrap();
    } else {
        safetensors_io::write(&path, &masters(&a, &devs)).unwrap();
    }
    let mut b = trainer(&devs, dtype, 0, 2);
    b.load_weights(&devs, &path).unwrap();
    std::fs::remove_file(&path).ok();
    let mut fresh = trainer(&devs, dtype, 0, 1);
    let d = data(5, 1);
    let run_b = train(&mut b, &devs, &d);
    let run_a = train(&mut fresh, &devs, &d);
    assert_same(&format!("{} {dtype}", dev.caps().name), &run_b, &run_a);
}

#[test]
fn imported_weights_train_like_the_same_weights_built_in_memory() {
    let cpu = CpuDevice::new();
    imported_trains_like_built(&cpu, DType::F32);
    imported_trains_like_built(&cpu, DType::F16);
    let vk = gpu("vulkan", false);
    imported_trains_like_built(vk.as_ref(), DType::F32);
    imported_trains_like_built(vk.as_ref(), DType::BF16);
}

/// A data-parallel group of two devices at ZeRO stages 1 and 2, trained 3 steps, then
/// given new weights: every rank's model copy and its shard of the masters are set and
/// the moments, step counts and fp16 loss scaler start afresh, so it trains exactly
/// like a fresh group given the same weights and like the group those weights were
/// drawn in.
#[test]
fn a_trained_group_given_weights_trains_like_a_fresh_one_at_every_zero_stage() {
    let boxes: Vec<Box<dyn Device>> = (0..2).map(|_| gpu("vulkan", false)).collect();
    let devs: Vec<&dyn Device> = boxes.iter().map(|d| d.as_ref()).collect();
    let d = data(6, 2);
    for stage in [1u8, 2] {
        let what = format!("zero stage {stage}");
        let mut drawn = trainer(&devs, DType::F16, stage, 7);
        let weights = masters(&drawn, &devs);
        let mut used = trainer(&devs, DType::F16, stage, 1);
        let before = train(&mut used, &devs, &d[..3]);
        // The moments the new weights must not inherit.
        assert!(before.1.iter().any(|p| p.m.iter().any(|&x| x != 0.0)));
        used.set_weights(&devs, &weights).unwrap();
        assert_eq!(used.state().applied, 0);
        let mut fresh = trainer(&devs, DType::F16, stage, 3);
        fresh.set_weights(&devs, &weights).unwrap();
        let run_used = train(&mut used, &devs, &d[3..]);
        let run_fresh = train(&mut fresh, &devs, &d[3..]);
        let run_drawn = train(&mut drawn, &devs, &d[3..]);
        assert_same(
            &format!("{what}, trained then set vs fresh"),
            &run_used,
            &run_fresh,
        );
        assert_same(&format!("{what}, set vs built"), &run_fresh, &run_drawn);
        // Every rank holds the same model copy.
        for m in used.replicas.iter() {
            for (i, st) in run_used.1.iter().enumerate() {
                assert_eq!(
                    m.value(devs[1], i).unwrap().bits(),
                    st.value.bits(),
                    "{what}: rank 1 {}",
                    st.name
                );
            }
        }
    }
}

/// The parameters of a fresh fp16 CPU network, as f32 host tensors in model order.
fn gpt_f16() -> (CpuDevice, kiln::engine::models::Network, Vec<HostTensor>) {
    let dev = CpuDevice::new();
    let net = gpt_network(&dev, &cfg(), (B, T), DType::F16);
    let weights = net
        .specs()
        .zip(net.parameters(&dev).unwrap())
        .map(|(s, (name, w))| HostTensor::new(name, s.shape.clone(), HostData::F32(w)))
        .collect();
    (dev, net, weights)
}

/// An fp32 file into an fp16 model: the model copy is each value rounded once to
/// nearest even (ties included), the master the f32 value itself; 16-bit values into
/// a 16-bit model are kept exactly, master included (no second rounding).
#[test]
fn fp32_weights_round_once_into_an_fp16_model_and_16_bit_ones_stay_exact() {
    let (dev, mut net, mut weights) = gpt_f16();
    // 1 + 2^-11 is halfway between f16's 1 and 1 + 2^-10: even is 1 (0x3c00);
    // 1 + 3·2^-11 is halfway between 1 + 2^-10 and 1 + 2^-9: even is 0x3c02.
    let (tie_down, tie_up) = (f32::from_bits(0x3f80_1000), f32::from_bits(0x3f80_3000));
    let HostData::F32(wte) = &mut weights[0].data else {
        unreachable!()
    };
    wte[0] = tie_down;
    wte[1] = tie_up;
    wte[2] = -65504.0;
    let want: Vec<Vec<f32>> = weights.iter().map(|t| t.data.to_f32()).collect();
    net.set_weights(&dev, &weights).unwrap();
    let wte_value = net.value(&dev, 0).unwrap().bits();
    assert_eq!(&wte_value[..3], &[0x3c00, 0x3c02, 0xfbff]);
    for (i, ((name, master), want)) in net.parameters(&dev).unwrap().iter().zip(&want).enumerate() {
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(master), bits(want), "master of {name}");
        let rounded: Vec<u32> = want
            .iter()
            .map(|&x| half::f16::from_f32(x).to_bits() as u32)
            .collect();
        assert_eq!(
            net.value(&dev, i).unwrap().bits(),
            rounded,
            "value of {name}"
        );
    }
    // The same weights as f16: master = the f16 value widened, value unchanged.
    let halves: Vec<HostTensor> = weights
        .iter()
        .map(|t| {
            HostTensor::new(
                &t.name,
                t.shape.clone(),
                HostData::from_f32(DType::F16, &t.data.to_f32()),
            )
        })
        .collect();
    net.set_weights(&dev, &halves).unwrap();
    for (i, (t, (name, master))) in halves.iter().zip(net.parameters(&dev).unwrap()).enumerate() {
        assert_eq!(
            net.value(&dev, i).unwrap().bits(),
            t.data.bits(),
            "value of {name}"
        );
        assert_eq!(master, t.data.to_f32(), "master of {name}");
    }
    assert_eq!(net.parameters(&dev).unwrap()[0].1[0], 1.0);
}

/// Weights that do not fit the model are refused, naming the tensor and what differs,
/// and nothing is written: the model keeps its weights.
#[test]
fn weights_that_do_not_fit_are_clear_errors_and_change_nothing() {
    let (dev, mut net, weights) = gpt_f16();
    let before = net.parameters(&dev).unwrap();
    let mut fails = |w: Vec<HostTensor>| -> String {
        let e = net.set_weights(&dev, &w).unwrap_err().to_string();
        assert_eq!(net.parameters(&dev).unwrap(), before, "after: {e}");
        e
    };
    let with = |f: &dyn Fn(&mut Vec<HostTensor>)| {
        let mut w = weights.clone();
        f(&mut w);
        w
    };
    let e = fails(with(&|w| {
        w.push(HostTensor::new(
            "transformer.h.2.ln_1.weight",
            vec![16],
            HostData::F32(vec![1.0; 16]),
        ))
    }));
    assert!(
        e.contains("`transformer.h.2.ln_1.weight` is not a parameter of GPT-2 (2 layers"),
        "{e}"
    );
    let e = fails(with(&|w| {
        let c = &mut w[4];
        c.shape = vec![48, 16];
    }));
    assert!(
        e.contains("`transformer.h.0.attn.c_attn.weight` has shape [48, 16]")
            && e.contains("has [16, 48]"),
        "{e}"
    );
    let e = fails(with(&|w| {
        w.remove(3);
    }));
    assert!(
        e.contains("1 of the 28 parameters") && e.contains("missing: `transformer.h.0.ln_1.bias`"),
        "{e}"
    );
    let e = fails(with(&|w| w.push(w[5].clone())));
    assert!(
        e.contains("`transformer.h.0.attn.c_attn.bias` is given twice"),
        "{e}"
    );
    let e = fails(with(&|w| w[1].data = HostData::U32(vec![0; T * 16])));
    assert!(e.contains("`transformer.wpe.weight` is u32"), "{e}");
    let e = fails(with(&|w| {
        let HostData::F32(x) = &mut w[6].data else {
            unreachable!()
        };
        x[3] = f32::NAN;
    }));
    assert!(
        e.contains("element 3 of `transformer.h.0.attn.c_proj.weight` is NaN"),
        "{e}"
    );
    let e = fails(with(&|w| {
        let HostData::F32(x) = &mut w[6].data else {
            unreachable!()
        };
        x[2] = 70000.0;
    }));
    assert!(
        e.contains("70000, beyond f16's largest value 65504") && e.contains("bf16 or fp32"),
        "{e}"
    );
    // The tied head: either name sets the embedding; both only if they agree.
    let e = fails(with(&|w| {
        let mut head = w[0].clone();
        head.name = "lm_head.weight".into();
        let HostData::F32(x) = &mut head.data else {
            unreachable!()
        };
        x[5] += 1.0;
        w.push(head);
    }));
    assert!(
        e.contains(
            "`transformer.wte.weight` and `lm_head.weight` are both given and differ (element 5)"
        ),
        "{e}"
    );
    let mut renamed = weights.clone();
    renamed[0].name = "lm_head.weight".into();
    let mut both = weights.clone();
    both.push(renamed[0].clone());
    net.set_weights(&dev, &renamed).unwrap();
    net.set_weights(&dev, &both).unwrap();
    assert_eq!(net.parameters(&dev).unwrap(), before);
}

/// Mean, standard deviation and the share of values within one and beyond three
/// standard deviations `std` of 0.
fn moments(w: &[f32], std: f64) -> (f64, f64, f64, f64) {
    let n = w.len() as f64;
    let mean = w.iter().map(|&x| x as f64).sum::<f64>() / n;
    let var = w.iter().map(|&x| (x as f64 - mean).powi(2)).sum::<f64>() / n;
    let share =
        |f: &dyn Fn(f64) -> bool| w.iter().filter(|&&x| f((x as f64).abs())).count() as f64 / n;
    (
        mean,
        var.sqrt(),
        share(&|a| a <= std),
        share(&|a| a > 3.0 * std),
    )
}

/// GPT-2's initialisation: normal with std 0.02 (residual projections 0.02/√(2·n_layer)),
/// biases 0, layer norms 1; drawn on the host from the seed, so every backend starts
/// from the same bits.
#[test]
fn fresh_gpt_weights_are_gpt2s_normal_initialisation() {
    let cfg = GptConfig {
        n_layer: 2,
        n_head: 4,
        n_embd: 256,
        block_size: 8,
        vocab_size: 13,
        padded_vocab_size: None,
    };
    let cpu = CpuDevice::new();
    let net = gpt_network(&cpu, &cfg, (1, 8), DType::F32);
    let params = net.parameters(&cpu).unwrap();
    let proj = 0.02 / (2.0f64 * 2.0).sqrt();
    for (name, w) in &params {
        let want = if name.ends_with("c_proj.weight") {
            proj
        } else if name.ends_with("bias") || name.contains("ln_") {
            let c = if name.ends_with("weight") { 1.0 } else { 0.0 };
            assert!(w.iter().all(|&x| x == c), "{name} is not all {c}");
            continue;
        } else {
            0.02
        };
        let (mean, std, within1, beyond3) = moments(w, want);
        let n = w.len() as f64;
        // Sampling errors for N draws: the mean's std/√N, the std's std/√(2N), a share
        // p's √(p(1−p)/N). Tolerances are 5 of those (a false failure under 1e-6 per
        // check), bounded below for the small tables (wpe: 2048 values). A uniform
        // draw of the same std has 57.7% within 1σ and none beyond 3σ, far outside.
        let tol = |p: f64| 5.0 * (p * (1.0 - p) / n).sqrt();
        assert!(mean.abs() < 5.0 * want / n.sqrt(), "{name}: mean {mean}");
        assert!(
            (std - want).abs() < 5.0 * want / (2.0 * n).sqrt(),
            "{name}: std {std}, want {want}"
        );
        assert!(
            (within1 - 0.6827).abs() < tol(0.6827),
            "{name}: {within1} within 1σ"
        );
        assert!(
            (beyond3 - 0.0027).abs() < tol(0.0027).max(0.002),
            "{name}: {beyond3} beyond 3σ"
        );
    }
    // The same seed, the same bits on another backend; another seed, other values.
    let vk = gpu("vulkan", false);
    let on_vulkan = gpt_network(vk.as_ref(), &cfg, (1, 8), DType::F32);
    assert!(on_vulkan.parameters(vk.as_ref()).unwrap() == params);
    let options = NetworkOptions {
        batch: 1,
        dtype: DType::F32,
        optimizer: adamw(),
        seed: 6,
        packed: false,
    };
    let other = Network::new(&cpu, gpt_model(&cfg, 8, Attention::Fused), &options).unwrap();
    let other = other.parameters(&cpu).unwrap();
    assert!(other.iter().zip(&params).all(|(a, b)| a.0 == b.0));
    assert!(other[0].1 != params[0].1 && other[4].1 != params[4].1);
}
