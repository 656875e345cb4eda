//! LoRA on GPT-2 and the Llama family: a fresh adapter changes no output bit, adapter
//! gradients equal finite differences and the CPU reference, training moves only the
//! adapters (the base's bytes stay), merging gives the adapted model's logits, PEFT's
//! file format round-trips, the allocator holds what `Network::memory` says (no
//! gradient, master or moments for the base), and bad settings are named.

mod common;

use std::sync::Arc;

use common::*;
use kiln::cpu::CpuDevice;
use kiln::engine::device::host::HostTensor;
use kiln::engine::graph::{Attention, Graph};
use kiln::engine::models::gpt::{Gpt, GptConfig};
use kiln::engine::models::import_llama;
use kiln::engine::models::llama::{Llama, LlamaConfig};
use kiln::engine::models::lora::{read_peft, Lora, LoraConfig, Targets};
use kiln::engine::models::{MicroBatch, Model, Network, NetworkOptions};
use kiln::engine::train::trainer::Trainer;
use kiln::engine::{DType, Device, HostData};

fn llama_cfg() -> LlamaConfig {
    serde_json::from_str(
        r#"{"n_layer": 2, "n_head": 4, "n_kv_head": 2, "n_embd": 16, "block_size": 16,
            "vocab_size": 11, "intermediate_size": 24}"#,
    )
    .unwrap()
}

fn gpt_cfg() -> GptConfig {
    GptConfig {
        n_layer: 2,
        n_head: 2,
        n_embd: 16,
        block_size: 16,
        vocab_size: 11,
        padded_vocab_size: None,
    }
}

/// The two base models, on sequences of `t`.
fn bases(t: usize) -> Vec<(&'static str, Arc<dyn Model>)> {
    vec![
        (
            "llama",
            Arc::new(Llama::new(llama_cfg(), t).with_attention(Attention::Fused)),
        ),
        (
            "gpt",
            Arc::new(Gpt::new(gpt_cfg(), t).with_attention(Attention::Fused)),
        ),
    ]
}

fn lora(r: usize, alpha: f32, dropout: f32, targets: Targets) -> LoraConfig {
    LoraConfig {
        r,
        alpha,
        dropout,
        target_modules: targets,
        use_rslora: false,
    }
}

fn all_linear() -> Targets {
    Targets::All("all-linear".into())
}

fn options(batch: usize, dtype: DType) -> NetworkOptions {
    NetworkOptions {
        batch,
        dtype,
        optimizer: adamw(),
        seed: 5,
        packed: false,
    }
}

fn tokens(seed: u64, n: usize) -> MicroBatch {
    let mut rng = Rng::new(seed);
    let t: Vec<u32> = (0..n + 1).map(|_| rng.next_u32() % 11).collect();
    MicroBatch::tokens(&t[..n], &t[1..])
}

/// The base network's weights as host tensors (f32 masters).
fn weights(dev: &dyn Device, net: &Network) -> Vec<HostTensor> {
    let shapes: Vec<Vec<usize>> = net.specs().map(|s| s.shape.clone()).collect();
    net.parameters(dev)
        .unwrap()
        .into_iter()
        .zip(shapes)
        .map(|((name, v), shape)| HostTensor::new(name, shape, HostData::F32(v)))
        .collect()
}

fn logits(dev: &dyn Device, net: &Network, mb: &MicroBatch) -> (f64, HostData) {
    let (loss, _) = net.predict(dev, mb).unwrap();
    let buf = net.output(net.prediction()).unwrap();
    (loss, dev.download(buf).unwrap())
}

/// Sets every B to small random values (a fresh one is zero: no gradient reaches A).
fn randomize_b(dev: &dyn Device, net: &Network, seed: u64) {
    let mut rng = Rng::new(seed);
    let specs: Vec<_> = net.specs().cloned().collect();
    for (i, s) in specs.iter().enumerate() {
        if s.name.ends_with("lora_B.weight") {
            let v: Vec<f32> = (0..s.len()).map(|_| rng.uniform(-0.5, 0.5)).collect();
            net.set_parameter(dev, i, &v).unwrap();
        }
    }
}

#[test]
fn a_fresh_adapter_leaves_every_output_bit_as_the_base_model_has_it() {
    let cpu = CpuDevice::new();
    let gpus = gpu_paths();
    let mut devs: Vec<(&str, &dyn Device)> = vec![("cpu", &cpu)];
    devs.extend(gpus.iter().map(|p| (p.name, p.dev.as_ref())));
    let (b, t) = (2, 16);
    let mb = tokens(1, b * t);
    for (name, base) in bases(t) {
        for dtype in [DType::F32, DType::F16] {
            for &(dev_name, dev) in &devs {
                let plain = Network::new(dev, base.clone(), &options(b, dtype)).unwrap();
                let adapted = Arc::new(lora(4, 8.0, 0.0, all_linear()));
                let adapted = Lora::new(base.clone(), (*adapted).clone()).unwrap();
                let net = Network::new(dev, Arc::new(adapted), &options(b, dtype)).unwrap();
                net.set_frozen(dev, &weights(dev, &plain)).unwrap();
                let (lp, xp) = logits(dev, &plain, &mb);
                let (la, xa) = logits(dev, &net, &mb);
                let what = format!("{name} {dtype} {dev_name}");
                assert_eq!(lp.to_bits(), la.to_bits(), "{what}: loss");
                assert_bits_eq(&what, &xa, &xp);
            }
        }
    }
}

/// The up-projection adds into the base linear's output through the GEMM's beta: three
/// GEMMs and no add (four launches with the ReLU after it; the add would make five),
/// and a graph output gets a buffer of its own (the base output copied into it
/// first). Values against a hand computation in f64 (f32 GEMMs over 5 terms: 1e-5).
#[test]
fn the_up_projection_adds_into_the_base_output_without_an_add_launch() {
    let dev = CpuDevice::new();
    let (m, k, n, r, scale) = (3, 5, 7, 2, 1.5f32);
    let val = |len: usize, seed: usize| -> Vec<f32> {
        (0..len)
            .map(|i| (((i * 7 + seed * 13) % 11) as f32 - 5.0) / 4.0)
            .collect()
    };
    let (x, w, bias, a, b) = (
        val(m * k, 1),
        val(n * k, 2),
        val(n, 3),
        val(r * k, 4),
        val(n * r, 5),
    );
    let mut want = vec![0f64; m * n];
    for i in 0..m {
        for j in 0..n {
            let mut base = bias[j] as f64;
            let mut low = 0f64;
            for c in 0..k {
                base += x[i * k + c] as f64 * w[j * k + c] as f64;
            }
            for q in 0..r {
                let h: f64 = (0..k)
                    .map(|c| x[i * k + c] as f64 * a[q * k + c] as f64)
                    .sum();
                low += h * b[j * r + q] as f64;
            }
            want[i * n + j] = base + scale as f64 * low;
        }
    }
    for relu in [true, false] {
        let mut g = Graph::new();
        let xt = g.input("x", &[m, k], DType::F32);
        let wt = g.frozen("w", &[n, k], DType::F32).unwrap();
        let bt = g
            .param("bias", &[n], DType::F32, DType::F32, false)
            .unwrap();
        let at = g
            .param("a", &[r, k], DType::F32, DType::F32, false)
            .unwrap();
        let bb = g
            .param("b", &[n, r], DType::F32, DType::F32, false)
            .unwrap();
        g.adapt(wt, (at, bb), scale, 0.0).unwrap();
        let y = g.linear_transposed(xt, wt, Some(bt)).unwrap();
        let out = if relu { g.relu(y).unwrap() } else { y };
        g.output(out).unwrap();
        if relu {
            // Ops: base linear, x·Aᵀ, the up-projection adding into the base output,
            // ReLU. A checkpointed range must take the base linear and the up-projection
            // together (recomputed alone, the latter would add into the forward's
            // finished sum again).
            assert_eq!(
                (g.range_start(1), g.range_start(2), g.range_start(3)),
                (0, 0, 3)
            );
            let mut cut = g.clone();
            let e = cut.checkpoint(1..4).unwrap_err().to_string();
            assert!(
                e.contains("may not cut between a linear and the adapter"),
                "{e}"
            );
            cut.checkpoint(0..4).unwrap();
        }
        let up = |v: &[f32]| {
            let buf = dev.alloc(DType::F32, v.len()).unwrap();
            dev.upload(buf, &HostData::F32(v.to_vec())).unwrap();
            buf
        };
        let params = [up(&bias), up(&a), up(&b)];
        let inputs = [(xt, up(&x)), (wt, up(&w))];
        let mut plan = g.compile_forward(&dev, &params, &inputs).unwrap();
        assert_eq!(plan.launch_count(), 4, "relu {relu}");
        plan.run(&dev).unwrap();
        let got = dev.download(plan.buffer(out).unwrap()).unwrap().to_f32();
        for (i, (&g, &w)) in got.iter().zip(&want).enumerate() {
            let w = if relu { w.max(0.0) } else { w };
            assert!(
                (g as f64 - w).abs() <= 1e-5 * (1.0 + w.abs()),
                "relu {relu} [{i}]: {g} vs {w}"
            );
        }
        plan.free(&dev).unwrap();
        for buf in params.into_iter().chain(inputs.map(|(_, b)| b)) {
            dev.free(buf).unwrap();
        }
    }
}

/// PEFT's own files (tests/fixtures/lora/peft_gqa, saved by peft 0.21.2 through
/// make_peft_fixture.py: r 4, alpha 8 on q_proj, v_proj and down_proj of the Llama
/// fixture, B random) read by Kiln: `kiln export BASE --adapter DIR --merge`, imported
/// back, gives PeftModel's float64 logits within 1e-4 (an fp32 forward, the bar the
/// base fixture meets in tests/import_llama.rs); the adapter moves them by far more.
#[test]
fn an_adapter_peft_saved_merges_to_the_logits_peft_computes() {
    let fixtures = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures");
    let base = fixtures.join("llama/gqa_f32");
    let adapter = fixtures.join("lora/peft_gqa");
    let out = std::env::temp_dir().join(format!("kiln-peft-merge-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&out);
    let r = std::process::Command::new(env!("CARGO_BIN_EXE_kiln"))
        .arg("export")
        .arg(&base)
        .arg("--adapter")
        .arg(&adapter)
        .args(["--merge", "--out"])
        .arg(&out)
        .output()
        .unwrap();
    assert!(r.status.success(), "{}", String::from_utf8_lossy(&r.stderr));
    let json = |p: std::path::PathBuf| -> serde_json::Value {
        serde_json::from_str(&std::fs::read_to_string(p).unwrap()).unwrap()
    };
    let want = json(adapter.join("expected.json"));
    let floats = |v: &serde_json::Value| -> Vec<f64> {
        v.as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_f64().unwrap())
            .collect()
    };
    let tokens: Vec<u32> = want["tokens"]
        .as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap() as u32)
        .collect();
    let (batch, seq) = (
        want["batch"].as_u64().unwrap() as usize,
        want["seq"].as_u64().unwrap() as usize,
    );
    let m = import_llama::read_hf(&out).unwrap();
    let dev = CpuDevice::new();
    let model = Arc::new(Llama::new(m.config.clone(), seq).with_attention(Attention::Fused));
    let mut net = Network::new(&dev, model, &options(batch, DType::F32)).unwrap();
    net.set_weights(&dev, &m.weights).unwrap();
    net.loss(&dev, &MicroBatch::tokens(&tokens, &tokens))
        .unwrap();
    let got = dev
        .download(net.output(net.prediction()).unwrap())
        .unwrap()
        .to_f32();
    let peft = floats(&want["logits"]);
    assert_eq!(got.len(), peft.len());
    let worst = got
        .iter()
        .zip(&peft)
        .map(|(&a, &b)| (a as f64 - b).abs())
        .fold(0.0, f64::max);
    assert!(
        worst <= 1e-4,
        "largest |Kiln - PeftModel| logit difference {worst}"
    );
    let plain = floats(&json(base.join("expected.json"))["logits"]);
    let moved = plain
        .iter()
        .zip(&peft)
        .map(|(a, b)| (a - b).abs())
        .fold(0.0, f64::max);
    assert!(moved > 1e-2, "the adapter moved the logits by {moved} only");
    std::fs::remove_dir_all(&out).unwrap();
}

#[test]
fn adapter_gradients_match_finite_differences_and_the_base_gets_none() {
    let dev = CpuDevice::new();
    let (b, t) = (2, 5);
    for (name, base) in bases(t) {
        let config = lora(
            2,
            3.0,
            0.0,
            Targets::List(vec![
                "q_proj".into(),
                "c_attn".into(),
                "down_proj".into(),
                "mlp.c_proj".into(),
            ]),
        );
        // Each name matches a module of one of the two models only: refused.
        assert!(Lora::new(base.clone(), config).is_err(), "{name}");
        let targets = match name {
            "llama" => vec!["q_proj", "v_proj", "down_proj"],
            _ => vec!["c_attn", "mlp.c_proj"],
        };
        let config = lora(
            2,
            3.0,
            0.0,
            Targets::List(targets.iter().map(|s| s.to_string()).collect()),
        );
        let model = Arc::new(Lora::new(base.clone(), config).unwrap());
        let modules = model.adapted.len();
        assert_eq!(modules, targets.len() * 2, "{name}: one per layer");
        let mut net = Network::new(&dev, model, &options(b, DType::F32)).unwrap();
        // Unit-scale base weights (as tests/llama.rs: 0.02-wide ones make RMSNorm's
        // 1/rms ~50 and a finite-difference step far from small).
        let mut rng = Rng::new(3);
        let base_net = Network::new(&dev, base.clone(), &options(b, DType::F32)).unwrap();
        let unit: Vec<HostTensor> = weights(&dev, &base_net)
            .into_iter()
            .map(|w| {
                let v = (0..w.data.len()).map(|_| rng.uniform(-0.5, 0.5)).collect();
                HostTensor::new(w.name, w.shape, HostData::F32(v))
            })
            .collect();
        net.set_frozen(&dev, &unit).unwrap();
        randomize_b(&dev, &net, 4);
        let mb = tokens(2, b * t);
        net.loss_and_gradients(&dev, &mb).unwrap();
        let grads = net.gradients(&dev).unwrap();
        // Only the adapters have gradients: A and B per module.
        assert_eq!(grads.len(), 2 * modules, "{name}");
        assert!(grads.iter().all(|(n, _)| n.contains(".lora_")), "{name}");
        let params = net.parameters(&dev).unwrap();
        let h = 3e-3f32;
        let mut bad = vec![];
        for (i, ((pname, g), (_, w))) in grads.iter().zip(&params).enumerate() {
            assert!(
                g.iter().any(|&x| x != 0.0),
                "{name}: {pname} has no gradient"
            );
            for &e in &[0, w.len() / 2, w.len() - 1] {
                let mut up = w.clone();
                up[e] += h;
                net.set_parameter(&dev, i, &up).unwrap();
                let lu = net.loss(&dev, &mb).unwrap();
                up[e] -= 2.0 * h;
                net.set_parameter(&dev, i, &up).unwrap();
                let ld = net.loss(&dev, &mb).unwrap();
                net.set_parameter(&dev, i, w).unwrap();
                let fd = (lu - ld) / (2.0 * h as f64);
                // As tests/llama.rs: f64 sums of f32 losses over 2h, a few 1e-5; O(h^2)
                // curvature a few percent at most.
                if (fd - g[e] as f64).abs() > 2e-5 + 0.02 * fd.abs() {
                    bad.push(format!(
                        "{pname}[{e}]: finite difference {fd:e}, backward {:e}",
                        g[e]
                    ));
                }
            }
        }
        assert!(bad.is_empty(), "{name}:\n{}", bad.join("\n"));
    }
}

#[test]
fn gpu_adapter_gradients_with_dropout_match_the_cpu_reference() {
    let cpu = CpuDevice::new();
    let (b, t) = (2, 16);
    let mb = tokens(5, b * t);
    for (name, base) in bases(t) {
        let model = Arc::new(Lora::new(base, lora(4, 16.0, 0.1, all_linear())).unwrap());
        for dtype in [DType::F32, DType::F16] {
            let mut c = Network::new(&cpu, model.clone(), &options(b, dtype)).unwrap();
            randomize_b(&cpu, &c, 6);
            let lc = c.loss_and_gradients(&cpu, &mb).unwrap();
            let gc = c.gradients(&cpu).unwrap();
            for p in gpu_paths() {
                let dev = p.dev.as_ref();
                let mut g = Network::new(dev, model.clone(), &options(b, dtype)).unwrap();
                randomize_b(dev, &g, 6);
                let lg = g.loss_and_gradients(dev, &mb).unwrap();
                let gg = g.gradients(dev).unwrap();
                // As tests/llama.rs: f32 differs in the order of sums; f16 rounds every
                // stored activation at the same points on both.
                let (lt, gt) = match dtype {
                    DType::F32 => (1e-5, 1e-3),
                    _ => (2e-3, 0.05),
                };
                let what = format!("{name} {dtype} {}", p.name);
                assert!((lg - lc).abs() < lt * lc, "{what}: loss {lg} vs {lc}");
                for ((n, a), (_, w)) in gg.iter().zip(&gc) {
                    let scale = w.iter().fold(0f32, |m, x| m.max(x.abs())).max(1e-6);
                    let worst = a
                        .iter()
                        .zip(w)
                        .map(|(a, w)| (a - w).abs())
                        .fold(0f32, f32::max);
                    assert!(
                        worst <= gt * scale,
                        "{what}: {n} off by {worst} (max {scale})"
                    );
                }
            }
        }
    }
}

#[test]
fn training_moves_the_adapters_only_and_merging_gives_the_adapted_logits() {
    let dev = CpuDevice::new();
    let (b, t) = (2, 16);
    for (name, base) in bases(t) {
        for dtype in [DType::F32, DType::F16] {
            let config = lora(4, 8.0, 0.05, all_linear());
            let model = Arc::new(Lora::new(base.clone(), config).unwrap());
            let mut trainer =
                Trainer::new(&dev, model.clone(), ds_config(b, 2, dtype, 1), 7).unwrap();
            let before = trainer.model.frozen_values(&dev).unwrap();
            let mut losses = vec![];
            // The same two micro-batches every step: the loss on them must fall.
            for _ in 0..8 {
                let micro = [tokens(0, b * t), tokens(1, b * t)];
                let _ = trainer.step(&dev, &micro).unwrap();
                losses.push(trainer.model.loss(&dev, &tokens(0, b * t)).unwrap());
            }
            let what = format!("{name} {dtype}");
            assert!(losses[7] < losses[0], "{what}: {losses:?}");
            let after = trainer.model.frozen_values(&dev).unwrap();
            for (x, y) in before.iter().zip(&after) {
                assert_bits_eq(&format!("{what}: {}", x.name), &y.data, &x.data);
            }
            // Merged into a plain model: the adapted model's logits. fp32 storage so
            // the comparison sees the merge, not the 16-bit rounding of W + BA.
            let masters = trainer.model.parameters(&dev).unwrap();
            let shapes: Vec<Vec<usize>> = trainer.model.specs().map(|s| s.shape.clone()).collect();
            let adapters: Vec<HostTensor> = masters
                .into_iter()
                .zip(shapes)
                .map(|((n, v), s)| HostTensor::new(n, s, HostData::F32(v)))
                .collect();
            let mut f32_net = Network::new(&dev, model.clone(), &options(b, DType::F32)).unwrap();
            let base_f32: Vec<HostTensor> = before
                .iter()
                .map(|w| {
                    HostTensor::new(
                        w.name.clone(),
                        w.shape.clone(),
                        HostData::F32(w.data.to_f32()),
                    )
                })
                .collect();
            f32_net.set_frozen(&dev, &base_f32).unwrap();
            f32_net.set_weights(&dev, &adapters).unwrap();
            let merged = model.merge(&base_f32, &adapters).unwrap();
            let mut plain = Network::new(&dev, base.clone(), &options(b, DType::F32)).unwrap();
            plain.set_weights(&dev, &merged).unwrap();
            let mb = tokens(9, b * t);
            let (la, xa) = logits(&dev, &f32_net, &mb);
            let (lm, xm) = logits(&dev, &plain, &mb);
            // f32 sums in another order (x(W + sBA) against xW + s(xA)B): ~1e-6 each.
            assert!((la - lm).abs() < 1e-5 * la, "{what}: {la} vs {lm}");
            let worst = xa
                .to_f32()
                .iter()
                .zip(xm.to_f32())
                .map(|(a, m)| (a - m).abs())
                .fold(0f32, f32::max);
            assert!(worst < 1e-4, "{what}: merged logits off by {worst}");
        }
    }
}

#[test]
fn peft_files_round_trip_and_memory_is_what_the_allocator_holds() {
    let dev = CpuDevice::new();
    let (b, t) = (2, 16);
    let dir = scratch_dir("lora", "peft");
    for (name, base) in bases(t) {
        let config = lora(3, 6.0, 0.0, all_linear());
        let model = Arc::new(Lora::new(base.clone(), config.clone()).unwrap());
        for dtype in [DType::F32, DType::F16, DType::BF16] {
            let before = dev.allocated_bytes();
            let net = Network::new(&dev, model.clone(), &options(b, dtype)).unwrap();
            let m = Network::memory(model.as_ref(), &options(b, dtype)).unwrap();
            assert_eq!(
                m.total(),
                dev.allocated_bytes() - before,
                "{name} {dtype}: {m:?}"
            );
            // The base is held once in the storage dtype; the optimizer's 12 bytes per
            // element are the adapters' only (each tensor aligned to 128 elements).
            let psi = model.adapter_parameters() as u64;
            let tensors = 2 * model.adapted.len() as u64;
            assert!(m.optimizer >= 12 * psi && m.optimizer < 12 * (psi + 128 * tensors));
            let base_elems: u64 = base.parameters().iter().map(|p| p.len() as u64).sum();
            assert!(
                m.frozen >= base_elems * dtype.size() as u64,
                "{name} {dtype}"
            );
            assert!(
                m.gradients < 4 * (psi + 128 * tensors),
                "{name} {dtype}: {m:?}"
            );
            drop(net);
        }
        let net = Network::new(&dev, model.clone(), &options(b, DType::F32)).unwrap();
        randomize_b(&dev, &net, 8);
        let adapters = weights(&dev, &net);
        let out = dir.join(name);
        model.save_peft(&out, &adapters, "base").unwrap();
        let text = std::fs::read_to_string(out.join("adapter_config.json")).unwrap();
        let v: serde_json::Value = serde_json::from_str(&text).unwrap();
        assert_eq!(
            (v["peft_type"].as_str(), v["r"].as_u64()),
            (Some("LORA"), Some(3))
        );
        assert_eq!(v["lora_alpha"].as_f64(), Some(6.0));
        assert_eq!(v["fan_in_fan_out"].as_bool(), Some(name == "gpt"));
        // The targets as configured: read back (by PEFT or Kiln) they adapt the same.
        assert_eq!(v["target_modules"], "all-linear");
        let file =
            kiln::engine::device::safetensors_io::read(&out.join("adapter_model.safetensors"))
                .unwrap();
        let first = &model.adapted[0];
        let a = file
            .iter()
            .find(|x| x.name == format!("base_model.model.{}.lora_A.weight", first.module))
            .unwrap();
        assert_eq!(a.shape, vec![3, first.fan_in], "{name}: A is (r, in)");
        let back = read_peft(&out).unwrap();
        assert_eq!(back.config.r, 3);
        assert_eq!(back.config.alpha, 6.0);
        let again = Arc::new(Lora::new(base.clone(), back.config.clone()).unwrap());
        assert_eq!(again.adapted, model.adapted, "{name}: the same modules");
        let mut loaded = Network::new(&dev, again, &options(b, DType::F32)).unwrap();
        loaded.set_weights(&dev, &back.tensors).unwrap();
        for (x, y) in weights(&dev, &loaded).iter().zip(&adapters) {
            assert_eq!(x.name, y.name);
            assert_bits_eq(&x.name, &x.data, &y.data);
        }
    }
}

#[test]
fn bad_lora_settings_are_named() {
    let (_, llama) = bases(4).remove(0);
    let e = Lora::new(
        llama.clone(),
        lora(4, 8.0, 0.0, Targets::List(vec!["qproj".into()])),
    )
    .err()
    .unwrap()
    .to_string();
    assert!(
        e.contains("qproj") && e.contains("q_proj, up_proj, v_proj"),
        "{e}"
    );
    assert!(!e.contains("lm_head") || e.contains("lm_head"), "{e}");
    // A weight tied to the embedding (GPT-2's head reads wte) cannot take an adapter.
    let (_, gpt) = bases(4).remove(1);
    let e = Lora::new(gpt, lora(2, 4.0, 0.0, Targets::List(vec!["wte".into()])))
        .err()
        .unwrap()
        .to_string();
    assert!(e.contains("`transformer.wte` is tied"), "{e}");
    let e = Lora::new(llama.clone(), lora(0, 8.0, 0.0, all_linear()))
        .err()
        .unwrap()
        .to_string();
    assert!(e.contains("r = 0"), "{e}");
    // k_proj is (8, 16): r 9 is over its smaller side.
    let e = Lora::new(llama.clone(), lora(9, 8.0, 0.0, all_linear()))
        .err()
        .unwrap()
        .to_string();
    assert!(
        e.contains("r = 9") && e.contains("k_proj") && e.contains("min(in, out)"),
        "{e}"
    );
    let e = Lora::new(llama.clone(), lora(2, 8.0, 1.0, all_linear()))
        .err()
        .unwrap()
        .to_string();
    assert!(e.contains("dropout 1"), "{e}");
    let e = Lora::new(llama, lora(2, 8.0, 0.0, Targets::All("all".into())))
        .err()
        .unwrap()
        .to_string();
    assert!(e.contains("\"all-linear\""), "{e}");
    let c = LoraConfig::parse_flag("r=16,alpha=32,dropout=0.05,targets=q_proj+v_proj").unwrap();
    assert_eq!(
        c,
        lora(
            16,
            32.0,
            0.05,
            Targets::List(vec!["q_proj".into(), "v_proj".into()])
        )
    );
    assert_eq!(c.scale(), 2.0);
    for (flag, want) in [
        ("alpha=32", "r is missing"),
        ("r=x", "r `x` is not a number"),
        ("r=4,rank=2", "unknown key `rank`"),
        ("r=4,targets", "`targets` is not key=value"),
    ] {
        let e = LoraConfig::parse_flag(flag).unwrap_err().to_string();
        assert!(e.contains(want) && e.contains("--lora"), "{flag}: {e}");
    }
}

/// `kiln train --lora` from a Hugging Face Llama directory: the loss falls, the
/// checkpoints hold the adapters only and `RUN/adapter` is a PEFT adapter; a resume
/// reads the base again and keeps the run's LoRA settings (others are refused); `kiln
/// eval` of the run equals the base directory with `--adapter RUN/adapter`, and `kiln
/// export --merge` writes that model; `--adapter` starts a new run where the first left.
#[test]
fn a_lora_run_trains_resumes_evaluates_and_exports_through_the_cli() {
    use kiln::eval::{eval, EvalOptions};
    use kiln::train::{train, TrainOptions};
    let dir = scratch_dir("lora", "cli");
    let hf = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/llama/gqa_f32");
    // Every token is followed by (7 t + 3) mod 37 (as tests/init_from.rs).
    let mut ids = vec![1u32];
    while ids.len() < 4000 {
        ids.push((ids[ids.len() - 1] * 7 + 3) % 37);
    }
    let bin = dir.join("rule.bin");
    kiln::engine::data::write_token_file(&bin, &ids, "custom", 37).unwrap();
    let config = dir.join("ds.json");
    std::fs::write(
        &config,
        r#"{"train_micro_batch_size_per_gpu": 8,
            "optimizer": {"type": "AdamW", "params": {"lr": 0.01}}}"#,
    )
    .unwrap();
    let run = dir.join("run");
    let opts = |steps: u64| TrainOptions {
        config: Some(config.clone()),
        data: Some(bin.clone()),
        devices: vec!["cpu".into()],
        out: Some(run.clone()),
        eval_every: Some(0),
        seq: Some(16),
        steps: Some(steps),
        ..TrainOptions::default()
    };
    let r = train(&TrainOptions {
        init_from: Some(hf.clone()),
        lora: Some("r=4,alpha=8,targets=q_proj+v_proj+down_proj".into()),
        ..opts(30)
    })
    .unwrap();
    let losses: Vec<f32> = kiln::engine::train::runs::read_metrics(&r.dir)
        .unwrap()
        .iter()
        .map(|m| m.loss)
        .collect();
    let end = losses[losses.len() - 5..].iter().sum::<f32>() / 5.0;
    assert!(
        end < losses[0] - 0.5,
        "the adapters did not learn: {losses:?}"
    );
    let ck = kiln::engine::train::checkpoint::load_latest(&run).unwrap();
    let model = &ck.file("model.safetensors").unwrap().tensors;
    assert_eq!(model.len(), 2 * 3 * 2, "A and B of 3 modules in 2 layers");
    assert!(model.iter().all(|t| t.name.contains(".lora_")));
    let peft = read_peft(&run.join("adapter")).unwrap();
    assert_eq!((peft.config.r, peft.config.alpha), (4, 8.0));
    assert_eq!(peft.tensors.len(), 12);

    // Resumed: the run's own LoRA settings and base; other settings are refused.
    train(&TrainOptions {
        resume: true,
        seq: None,
        ..opts(35)
    })
    .unwrap();
    // ... and in two pipeline stages, the base read again onto both.
    train(&TrainOptions {
        resume: true,
        seq: None,
        devices: vec!["cpux2".into()],
        pipeline_stages: Some(2),
        ..opts(38)
    })
    .unwrap();
    let e = train(&TrainOptions {
        resume: true,
        seq: None,
        lora: Some("r=8".into()),
        ..opts(40)
    })
    .unwrap_err()
    .to_string();
    assert!(e.contains("lora.r: 4 -> 8"), "{e}");

    // The run scores as its base with its adapter merged in; the base alone does not.
    let score = |source: &std::path::Path, adapter: Option<&std::path::Path>| {
        eval(&EvalOptions {
            source: source.to_path_buf(),
            adapter: adapter.map(|a| a.to_path_buf()),
            data: Some(bin.clone()),
            devices: vec!["cpu".into()],
            seq: Some(16),
            dtype: Some(DType::F32),
            ..EvalOptions::default()
        })
        .unwrap()
        .loss
    };
    let adapter = run.join("adapter");
    let tuned = score(&run, None);
    assert_eq!(tuned.to_bits(), score(&hf, Some(&adapter)).to_bits());
    assert!(score(&hf, None) > tuned + 0.5);

    // Export: refused without --merge (naming the adapter), merged with it.
    let out = dir.join("merged");
    let e = kiln::export::export_with(&run, "hf", &out, None, false)
        .unwrap_err()
        .to_string();
    assert!(e.contains("--merge") && e.contains("adapter"), "{e}");
    kiln::export::export_with(&run, "hf", &out, None, true).unwrap();
    assert_eq!(score(&out, None).to_bits(), tuned.to_bits());

    // A new run from the base and the adapter starts where the first left off.
    let again = train(&TrainOptions {
        init_from: Some(hf.clone()),
        adapter: Some(adapter.clone()),
        out: Some(dir.join("again")),
        ..opts(2)
    })
    .unwrap();
    let first = kiln::engine::train::runs::read_metrics(&again.dir).unwrap()[0].loss;
    assert!(first < losses[0] - 0.5, "{first} vs {losses:?}");
    // A LoRA run is no --init-from: its checkpoints hold the adapters only.
    let e = train(&TrainOptions {
        init_from: Some(run.clone()),
        out: Some(dir.join("from-lora")),
        ..opts(2)
    })
    .unwrap_err()
    .to_string();
    assert!(e.contains("a LoRA run") && e.contains("--merge"), "{e}");
    // An adapter needs its base.
    let e = train(&TrainOptions {
        adapter: Some(adapter.clone()),
        out: Some(dir.join("no-base")),
        seq: None,
        ..opts(2)
    })
    .unwrap_err()
    .to_string();
    assert!(e.contains("--adapter without --init-from"), "{e}");
    // A base given by a relative path is recorded as an absolute one (a resume or a
    // source opened from elsewhere finds it), and a base whose weights are no longer
    // the ones trained on (the record's fingerprint stands in for a changed base) is
    // refused when the run is opened as a source, as a resume refuses it.
    let rel = train(&TrainOptions {
        init_from: Some("tests/fixtures/llama/gqa_f32".into()),
        lora: Some("r=4,alpha=8,targets=q_proj".into()),
        out: Some(dir.join("relative")),
        ..opts(1)
    })
    .unwrap();
    let record_file = rel.dir.join("config.json");
    let mut record: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&record_file).unwrap()).unwrap();
    assert_eq!(
        record["init_from"].as_str().unwrap(),
        hf.canonicalize().unwrap().display().to_string()
    );
    score(&rel.dir, None);
    record["base_fingerprint"] = "0".repeat(64).into();
    std::fs::write(&record_file, record.to_string()).unwrap();
    let e = eval(&EvalOptions {
        source: rel.dir.clone(),
        data: Some(bin.clone()),
        devices: vec!["cpu".into()],
        seq: Some(16),
        ..EvalOptions::default()
    })
    .unwrap_err()
    .to_string();
    assert!(
        e.contains("no longer the ones the adapters were trained on"),
        "{e}"
    );
    // A 16-bit Kiln run as the base: trained from its f32 masters, fingerprinted and
    // merged from the same run when the LoRA run is opened as a source.
    let bf16 = dir.join("ds_bf16.json");
    std::fs::write(
        &bf16,
        r#"{"train_micro_batch_size_per_gpu": 8, "bf16": {"enabled": true},
            "optimizer": {"type": "AdamW", "params": {"lr": 0.01}}}"#,
    )
    .unwrap();
    let base_run = train(&TrainOptions {
        init_from: Some(hf.clone()),
        config: Some(bf16.clone()),
        out: Some(dir.join("bf16-base")),
        ..opts(1)
    })
    .unwrap();
    let on_run = train(&TrainOptions {
        init_from: Some(base_run.dir.clone()),
        config: Some(bf16),
        lora: Some("r=4,alpha=8,targets=q_proj".into()),
        out: Some(dir.join("lora-on-bf16")),
        ..opts(1)
    })
    .unwrap();
    assert!(score(&on_run.dir, None).is_finite());
    // An adapter for other modules than --lora names is refused.
    let e = train(&TrainOptions {
        init_from: Some(hf),
        adapter: Some(adapter),
        lora: Some("r=4,alpha=8,targets=q_proj".into()),
        out: Some(dir.join("other")),
        ..opts(2)
    })
    .unwrap_err()
    .to_string();
    assert!(e.contains("--adapter") && e.contains("drop --lora"), "{e}");
    std::fs::remove_dir_all(&dir).ok();
}

/// `n` micro-batches of `b` rows of `t` tokens counting mod 11 from random starts (a
/// rule the adapters can learn).
fn counting(seed: u64, n: usize, (b, t): (usize, usize)) -> Vec<MicroBatch> {
    let mut rng = Rng::new(seed);
    (0..n)
        .map(|_| {
            let (mut tok, mut tgt) = (vec![], vec![]);
            for _ in 0..b {
                let s = rng.next_u32() % 11;
                tok.extend((0..t as u32).map(|i| (s + i) % 11));
                tgt.extend((1..=t as u32).map(|i| (s + i) % 11));
            }
            MicroBatch::tokens(&tok, &tgt)
        })
        .collect()
}

/// LoRA under data parallelism and ZeRO: a Llama with r 4 adapters on every linear
/// (dropout 0.1), in fp32, on 2 CPU devices at ZeRO stages 0, 1 and 2 trains as one
/// device accumulating the same global batch. The stages agree bit for bit (one
/// micro-batch per rank: the host averages the same f32 numbers in the same order and
/// the shards apply the same f32 update, as tests/llama.rs and tests/data_parallel.rs
/// find for full training); against one device only where the two micro-batches'
/// gradients are summed differs (the device's GEMM epilogue or the host), a few f32
/// roundings per gradient: losses and masters within tests/data_parallel.rs's fp32
/// tolerance of 2e-5 (measured: masters within 1e-7). Rank r draws the dropout masks of the
/// micro-batch r it stands for (one device given the micro-batches the other way round
/// ends 6e-2 away). The frozen base stays bit for bit what it was on every replica, and
/// each device's model states are the base once in the storage dtype plus the
/// adapters' gradients and optimizer state, that state split in two under ZeRO — as
/// the allocator and `kiln estimate` have it.
#[test]
fn lora_trains_under_data_parallelism_and_zero_as_one_device_does() {
    use kiln::engine::models::ParamState;
    use kiln::engine::parallel::zero::segments;
    const TOL: f32 = 2e-5;
    let (b, t, steps, world) = (2, 8, 4, 2);
    let (_, base) = bases(t).remove(0);
    let adapted = Arc::new(Lora::new(base.clone(), lora(4, 8.0, 0.1, all_linear())).unwrap());
    let model: Arc<dyn Model> = adapted.clone();
    let data: Vec<Vec<MicroBatch>> = (0..steps)
        .map(|s| counting(40 + s as u64, world, (b, t)))
        .collect();

    // One device accumulating both micro-batches of each step.
    let cpu = CpuDevice::new();
    let mut single =
        Trainer::new(&cpu, model.clone(), ds_config(b, world, DType::F32, 1), 7).unwrap();
    let base_before = single.model.frozen_values(&cpu).unwrap();
    let first = single.param_states(&[&cpu]).unwrap();
    let mut want = vec![];
    for step in &data {
        want.push(single.step(&cpu, step).unwrap().loss);
    }
    let want_states = single.param_states(&[&cpu]).unwrap();
    assert!(want[steps - 1] < want[0], "did not learn: {want:?}");

    // What a device holds: the base once (f32 here), the adapters' gradients, masters
    // and moments (12 bytes per element, each tensor aligned to 128 elements).
    let m = kiln::estimate::network_memory(model.as_ref(), b, DType::F32).unwrap();
    let psi = adapted.adapter_parameters();
    let tensors = 2 * adapted.adapted.len() as u64;
    let base_elems: u64 = base.parameters().iter().map(|p| p.len() as u64).sum();
    assert!(m.frozen >= 4 * base_elems, "{m:?}");
    assert!(m.optimizer >= 12 * psi as u64 && m.optimizer < 12 * (psi as u64 + 128 * tensors));
    let estimate = kiln::estimate::stages(model.as_ref(), b, DType::F32, world).unwrap();
    let f32b = |n: usize| DType::F32.padded_bytes(n);

    let mut reference: Option<(Vec<f32>, Vec<ParamState>)> = None;
    for stage in 0..=2u8 {
        let devs = [CpuDevice::new(), CpuDevice::new()];
        let refs: Vec<&dyn Device> = devs.iter().map(|d| d as &dyn Device).collect();
        let mut c = ds_config(b, 1, DType::F32, world);
        c.zero.stage = stage;
        let mut group = Trainer::new_group(&refs, model.clone(), c, 7).unwrap();
        let layout = group.model.parameter_layout();
        assert!(
            layout.iter().all(|l| l.0.contains(".lora_")),
            "stage {stage}"
        );
        let sizes: Vec<usize> = layout.iter().map(|l| l.1.iter().product()).collect();
        assert_eq!(sizes.iter().sum::<usize>(), psi);
        assert_eq!(
            group.param_states(&refs).unwrap(),
            first,
            "stage {stage}: start"
        );

        for (rank, dev) in refs.iter().enumerate() {
            let what = format!("stage {stage} rank {rank}");
            let states = group.model_state_bytes(rank);
            // Everything but the activations is model states; nothing else allocated.
            // Stage 2 recompiles the plan with one optimizer group per parameter (the
            // gradients no longer in arenas), and its chain of per-gradient norm
            // partials keeps a few f32 scalars more than the stage-0 plan that
            // `Network::memory` measures (16 bytes here; none for the full GPT of
            // tests/data_parallel.rs): model states exact, the plan within 64 bytes.
            let slack = if stage == 2 { 64 } else { 0 };
            let held = dev.allocated_bytes();
            assert!(
                held >= states.total() + m.activations
                    && held <= states.total() + m.activations + slack,
                "{what}: allocator {held}, model states {states:?} + activations {}",
                m.activations
            );
            assert_eq!(states.weights, m.weights + m.frozen, "{what}");
            let segs = segments(&sizes, world, rank);
            let slice: u64 = segs.iter().map(|s| f32b(s.range.len())).sum();
            let (gradients, optimizer) = match stage {
                0 => (m.gradients, m.optimizer),
                // The rank's slice: master, two moments and the updated model copy
                // (f32), its reduced f32 gradient, the step's gradient factor, and the
                // empty buffer left where the whole state was.
                1 => (m.gradients + slice, 4 * slice + f32b(1) + f32b(0)),
                _ => (m.shared_gradients + slice, 4 * slice + f32b(1) + f32b(0)),
            };
            assert_eq!(
                (states.gradients, states.optimizer),
                (gradients, optimizer),
                "{what}"
            );
            if stage > 0 {
                // Half of the adapters' optimizer state each.
                let mine = group.optimizer_state_elements(rank);
                assert!(mine.abs_diff(psi / world) <= 1, "{what}: {mine} of {psi}");
                assert!(3 * slice <= m.optimizer / 2 + 3 * f32b(128), "{what}");
            }
            // `kiln estimate` predicts it (to 1%: it gives every rank the largest slice).
            let e = &estimate[stage as usize];
            let predicted = e.weights + e.frozen + e.gradients + e.optimizer;
            let off = predicted.abs_diff(states.total()) as f64 / predicted as f64;
            assert!(off < 0.01, "{what}: {states:?} vs {e:?}");
        }

        let mut losses = vec![];
        for step in &data {
            let per_rank: Vec<Vec<MicroBatch>> = step.iter().map(|mb| vec![mb.clone()]).collect();
            losses.push(group.step_group(&refs, &per_rank).unwrap().loss);
        }
        let states = group.param_states(&refs).unwrap();
        // Every replica: the base as it was, and the gathered adapters.
        for (rank, (net, dev)) in group.models().zip(&refs).enumerate() {
            for (x, y) in net.frozen_values(*dev).unwrap().iter().zip(&base_before) {
                let what = format!("stage {stage} rank {rank}: {}", x.name);
                assert_eq!(x.name, y.name);
                assert_bits_eq(&what, &x.data, &y.data);
            }
            for (i, st) in states.iter().enumerate() {
                assert_eq!(net.value(*dev, i).unwrap(), st.value, "rank {rank}");
            }
        }
        for (i, (x, y)) in losses.iter().zip(&want).enumerate() {
            assert!(
                (x - y).abs() <= TOL * y,
                "stage {stage} step {i}: 2 devices {x}, one device {y}"
            );
        }
        for ((a, w), f) in states.iter().zip(&want_states).zip(&first) {
            assert_ne!(a.master, f.master, "stage {stage}: {} not trained", a.name);
            for (j, (x, y)) in a.master.iter().zip(&w.master).enumerate() {
                assert!(
                    (x - y).abs() <= TOL * (1.0 + y.abs()),
                    "stage {stage}: {}[{j}] 2 devices {x}, one device {y}",
                    a.name
                );
            }
        }
        match &reference {
            None => reference = Some((losses, states)),
            Some((l0, s0)) => {
                let bits = |l: &[f32]| l.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                assert_eq!(bits(&losses), bits(l0), "stage {stage} vs 0: losses");
                assert!(
                    states == *s0,
                    "stage {stage} vs 0: weights, masters or moments"
                );
            }
        }
    }
}

/// `kiln estimate --lora`: the model the estimate builds, under the adapters `kiln
/// train --lora` would train. Its stage-0 figures are `Network::memory` of that `Lora`
/// model (the base apart, as `frozen`, once in the storage dtype; gradients and
/// master+Adam the adapters' only, far below full training's) and ZeRO shards only the
/// adapters' optimizer state; the table printed says the same to its 0.1 MiB (within
/// 2% per device), the config's `kiln.lora` gives what the flag gives, and bad
/// settings are refused with the parse error, not a panic.
#[test]
fn kiln_estimate_with_lora_counts_the_frozen_base_once_and_the_adapters_state() {
    use kiln::engine::models::ModelConfig;
    let dir = scratch_dir("lora", "estimate");
    // Large enough that 0.1 MiB is under 2% of a device's total.
    let model_json = r#"{"architecture": "llama", "n_layer": 4, "n_head": 8, "n_kv_head": 4,
        "n_embd": 256, "block_size": 64, "vocab_size": 2000, "intermediate_size": 512}"#;
    let (micro, world, dtype) = (2, 2, DType::BF16);
    let model_path = dir.join("model.json");
    std::fs::write(&model_path, model_json).unwrap();
    let config = dir.join("ds.json");
    std::fs::write(
        &config,
        format!(r#"{{"train_micro_batch_size_per_gpu": {micro}, "bf16": {{"enabled": true}}}}"#),
    )
    .unwrap();
    let base = ModelConfig::parse(model_json).unwrap().build(64);
    let settings = LoraConfig::parse_flag("r=4").unwrap();
    let adapted = Arc::new(Lora::new(base.clone(), settings).unwrap());
    let psi = adapted.adapter_parameters() as u64;
    let base_elems: u64 = base.parameters().iter().map(|p| p.len() as u64).sum();

    // The library: stage 0 is what the Lora network allocates, field by field.
    let m = kiln::estimate::network_memory(adapted.as_ref(), micro, dtype).unwrap();
    let full = kiln::estimate::stages(base.as_ref(), micro, dtype, world).unwrap();
    let e = kiln::estimate::stages(adapted.as_ref(), micro, dtype, world).unwrap();
    assert_eq!(
        (e[0].weights, e[0].frozen, e[0].gradients, e[0].optimizer),
        (m.weights, m.frozen, m.gradients, m.optimizer)
    );
    assert_eq!(e[0].total(), m.total());
    assert!(m.frozen >= 2 * base_elems && full.iter().all(|s| s.frozen == 0));
    assert!(m.optimizer >= 12 * psi && 10 * m.optimizer < full[0].optimizer);
    // ZeRO 1 and 2 shard the adapters' state only (master, moments and the bf16 copy
    // of each rank's half); the base stays whole on every device.
    let half = psi.div_ceil(world as u64);
    for s in &e[1..3] {
        assert_eq!(s.optimizer, 14 * half, "stage {}", s.stage);
        assert_eq!(s.frozen, m.frozen, "stage {}", s.stage);
        assert!(s.optimizer < full[s.stage as usize].optimizer / 10);
    }
    // Stage 3 streams the trained blocks' weights; the frozen base stays whole.
    assert_eq!(e[3].frozen, m.frozen);

    // The CLI's table: per stage, the MiB columns (with `frozen` after `weights` where
    // there is a frozen base).
    let kiln = |extra: &[&str]| {
        let mut args = vec![
            "estimate",
            "--model",
            model_path.to_str().unwrap(),
            "--devices",
            "2",
        ];
        args.extend(extra);
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_kiln"))
            .args(&args)
            .output()
            .unwrap();
        (
            out.status.code(),
            String::from_utf8_lossy(&out.stdout).into_owned(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    };
    let table = |text: &str| -> (Vec<String>, Vec<Vec<f64>>) {
        let lines: Vec<&str> = text.lines().collect();
        let h = lines.iter().position(|l| l.starts_with("stage")).unwrap();
        let header = lines[h]
            .split_whitespace()
            .filter(|w| *w != "device")
            .map(str::to_string)
            .collect();
        let rows = lines[h + 1..h + 5]
            .iter()
            .map(|l| {
                l.split_whitespace()
                    .skip(1)
                    .filter_map(|w| w.parse::<f64>().ok())
                    .collect()
            })
            .collect();
        (header, rows)
    };
    let with_config = ["--config", config.to_str().unwrap()];
    let (code, plain, err) = kiln(&with_config);
    assert_eq!(code, Some(0), "{err}");
    let (code, lora_out, err) = kiln(&[&with_config[..], &["--lora", "r=4"]].concat());
    assert_eq!(code, Some(0), "{err}");
    assert!(
        lora_out.contains(&format!("Ψ = {psi} trained parameters"))
            && lora_out.contains(&format!("over {base_elems} frozen")),
        "{lora_out}"
    );
    let (ph, pr) = table(&plain);
    let (lh, lr) = table(&lora_out);
    assert_eq!(
        ph,
        [
            "stage",
            "weights",
            "gradients",
            "master+Adam",
            "activations",
            "per",
            "note"
        ]
    );
    assert_eq!(
        lh,
        [
            "stage",
            "weights",
            "frozen",
            "gradients",
            "master+Adam",
            "activations",
            "per",
            "note"
        ]
    );
    let mib = |b: u64| b as f64 / (1u64 << 20) as f64;
    let (opt, per) = (3, 5);
    for stage in 0..4 {
        // Fewer optimizer bytes than full training at every stage.
        assert!(
            lr[stage][opt] < pr[stage][opt - 1],
            "stage {stage}: {lora_out}\n{plain}"
        );
        // The frozen base is full training's whole model copy (stage 3 streams full
        // training's block weights, and keeps the frozen base whole).
        assert_eq!(lr[stage][1], pr[0][0], "stage {stage}");
    }
    assert!(pr[3][0] < pr[0][0], "{plain}");
    assert!(lr[1][opt] < lr[0][opt], "{lora_out}");
    let want = mib(m.total());
    assert!(
        (lr[0][per] - want).abs() <= 0.02 * want,
        "per device {} MiB, Network::memory {want:.3} MiB",
        lr[0][per]
    );
    assert!((lr[0][1] - mib(m.frozen)).abs() <= 0.05, "{lora_out}");

    // The config's kiln.lora: the same table as the flag.
    let lora_config = dir.join("lora.json");
    std::fs::write(
        &lora_config,
        format!(
            r#"{{"train_micro_batch_size_per_gpu": {micro}, "bf16": {{"enabled": true}},
                "kiln": {{"lora": {{"r": 4}}}}}}"#
        ),
    )
    .unwrap();
    let (code, from_config, err) = kiln(&["--config", lora_config.to_str().unwrap()]);
    assert_eq!(code, Some(0), "{err}");
    assert_eq!(table(&from_config), table(&lora_out));

    // Refusals: the parse error of `kiln train --lora`, a target the model lacks, and
    // a pipeline (not estimated per stage yet).
    for (extra, want) in [
        (&["--lora", "r=x"][..], "--lora r=x: r `x` is not a number"),
        (&["--lora", "r=4,rank=2"][..], "unknown key `rank`"),
        (&["--lora", "alpha=8"][..], "r is missing"),
        (
            &["--lora", "r=4,targets=qproj"][..],
            "its linear modules are",
        ),
        (
            &["--lora", "r=4", "--pipeline-stages", "2"][..],
            "LoRA with pipeline stages",
        ),
    ] {
        let (code, out, err) = kiln(extra);
        assert_eq!(code, Some(1), "{extra:?}: {out}{err}");
        assert!(
            err.contains(want) && !err.contains("panicked"),
            "{extra:?}: {err}"
        );
    }
    std::fs::remove_dir_all(&dir).ok();
}

/// `kiln estimate --fits`: for a small Llama sized so that full training does not fit
/// but LoRA with activation checkpointing does, each row is `Network::memory` of the
/// model it names (the one-device rows exactly; the ZeRO-2 rows as `kiln estimate
/// --devices N` gives stage 2), the verdicts follow the bytes, the cheapest line names
/// LoRA + checkpointing on one device (and full training where everything fits), and
/// a bad size is refused naming the value and the forms accepted.
#[test]
fn kiln_estimate_fits_names_the_cheapest_way_to_train_that_fits_each_size() {
    use kiln::engine::models::checkpointed::Checkpointed;
    use kiln::engine::models::ModelConfig;
    use kiln::estimate::{fits, fits_report, FIT_LORA};
    let dir = scratch_dir("lora", "fits");
    let model_json = r#"{"architecture": "llama", "n_layer": 4, "n_head": 4, "n_kv_head": 2,
        "n_embd": 64, "block_size": 128, "vocab_size": 512, "intermediate_size": 128,
        "tie_word_embeddings": true}"#;
    let (micro, dtype) = (2, DType::BF16);
    let model_path = dir.join("model.json");
    std::fs::write(&model_path, model_json).unwrap();
    let config = dir.join("ds.json");
    std::fs::write(
        &config,
        format!(r#"{{"train_micro_batch_size_per_gpu": {micro}, "bf16": {{"enabled": true}}}}"#),
    )
    .unwrap();
    let base = ModelConfig::parse(model_json).unwrap().build(128);
    let settings = LoraConfig::parse_flag(FIT_LORA).unwrap();
    let adapted: Arc<dyn Model> = Arc::new(Lora::new(base.clone(), settings.clone()).unwrap());
    let models: [(bool, bool, Arc<dyn Model>); 4] = [
        (false, false, base.clone()),
        (
            false,
            true,
            Arc::new(Checkpointed::new(base.clone(), 1).unwrap()),
        ),
        (true, false, adapted.clone()),
        (true, true, Arc::new(Checkpointed::new(adapted, 1).unwrap())),
    ];
    let memory: Vec<_> = models
        .iter()
        .map(|(_, _, m)| Network::memory(m.as_ref(), &options(micro, dtype)).unwrap())
        .collect();

    // The rows: cheapest first (devices, then full before LoRA, then without
    // checkpointing), each what its model allocates.
    let rows = fits(base.clone(), settings.clone(), 1, micro, dtype).unwrap();
    assert_eq!(rows.len(), 12);
    for (i, r) in rows.iter().enumerate() {
        let (lora, checkpointing, model) = &models[i % 4];
        let m = &memory[i % 4];
        assert_eq!(
            (r.lora, r.checkpointing, r.devices),
            (*lora, *checkpointing, [1, 2, 4][i / 4])
        );
        if r.devices == 1 {
            assert_eq!(r.at_start, m.total(), "{}", r.spelled());
            let s = &r.memory;
            assert_eq!(s.stage, 0);
            assert_eq!(
                (s.weights, s.frozen, s.gradients, s.optimizer, s.activations),
                (m.weights, m.frozen, m.gradients, m.optimizer, m.activations),
                "{}",
                r.spelled()
            );
            assert_eq!(r.bytes(), m.total());
        } else {
            let zero = kiln::estimate::stages(model.as_ref(), micro, dtype, r.devices).unwrap();
            assert_eq!(r.memory, zero[2], "{}", r.spelled());
            // Built with the whole gradients beside the shard: stage 1's figure.
            assert_eq!(r.at_start, zero[1].total(), "{}", r.spelled());
            assert!(r.bytes() < m.total(), "{}", r.spelled());
        }
    }
    // The size: what LoRA + checkpointing takes on one device, which the three others
    // exceed (checkpointing saves activations; full training holds master+Adam).
    let need = rows[3].bytes();
    assert!(rows[..3]
        .iter()
        .all(|r| r.bytes() > need.div_ceil(1024) * 1024));
    let small = format!("{}KiB", need.div_ceil(1024));
    let sizes = [
        (small.clone(), need.div_ceil(1024) * 1024),
        ("1G".into(), 1 << 30),
    ];

    let kiln = |extra: &[&str]| {
        let mut args = vec!["estimate", "--model", model_path.to_str().unwrap()];
        args.extend(extra);
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_kiln"))
            .args(&args)
            .output()
            .unwrap();
        (
            out.status.code(),
            String::from_utf8_lossy(&out.stdout).into_owned(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    };
    let fits_flag = format!("{small},1G");
    let (code, out, err) = kiln(&["--config", config.to_str().unwrap(), "--fits", &fits_flag]);
    assert_eq!(code, Some(0), "{err}");
    // The CLI prints the library's table, from the config's micro-batch and precision.
    assert_eq!(
        out,
        fits_report(base.clone(), (settings, 1), micro, dtype, &sizes).unwrap()
    );
    assert!(out.contains("bf16, micro-batch 2; LoRA r=16, alpha=32, targets=all-linear"));
    let lines: Vec<&str> = out.lines().collect();
    let h = lines
        .iter()
        .position(|l| l.starts_with("training"))
        .unwrap();
    let cells = |l: &str| -> Vec<String> {
        l.split("  ")
            .map(str::trim)
            .filter(|c| !c.is_empty())
            .map(str::to_string)
            .collect()
    };
    assert_eq!(
        cells(lines[h]),
        ["training", "devices", "per device", &small, "1G"]
    );
    for (r, line) in rows.iter().zip(&lines[h + 1..h + 13]) {
        let c = cells(line);
        assert_eq!((c[0].as_str(), c[1].as_str()), (&*r.training(), &*r.on()));
        for (verdict, (_, size)) in c[3..].iter().zip(&sizes) {
            let want = if r.bytes() > *size {
                format!("no (needs {})", c[2])
            } else if r.at_start > *size {
                "fits*".to_string()
            } else {
                "fits".to_string()
            };
            assert_eq!(*verdict, want, "{line}");
        }
    }
    // Full training does not fit the small size on one device; LoRA + checkpointing
    // does, and everything fits 1 GiB.
    assert!(cells(lines[h + 1])[3].starts_with("no (needs "), "{out}");
    assert_eq!(cells(lines[h + 4])[3], "fits", "{out}");
    assert!(lines[h + 1..h + 13].iter().all(|l| cells(l)[4] == "fits"));
    assert!(
        out.contains(&format!(
            "  {small}: LoRA + checkpointing on 1 device ({} per device)\n",
            cells(lines[h + 4])[2]
        )),
        "{out}"
    );
    assert!(out.contains("  1G: full on 1 device ("), "{out}");

    // --lora sets the LoRA rows' adapters.
    let (code, out, err) = kiln(&["--fits", "1G", "--lora", "r=4"]);
    assert_eq!(code, Some(0), "{err}");
    assert!(
        out.contains("f16, micro-batch 1; LoRA r=4, alpha=8"),
        "{out}"
    );

    // Refusals: bad sizes, named with the forms accepted, and devices --fits sets itself.
    for (extra, want) in [
        (&["--fits", "8GB"][..], "--fits \"8GB\": `GB` could mean"),
        (&["--fits", "1G,8"][..], "--fits \"8\": no unit"),
        (&["--fits", "lots"][..], "--fits \"lots\": not a number"),
        (
            &["--fits", "1G", "--devices", "2"][..],
            "leave out --devices 2",
        ),
    ] {
        let (code, out, err) = kiln(extra);
        assert_eq!(code, Some(1), "{extra:?}: {out}{err}");
        assert!(
            err.contains(want) && !err.contains("panicked"),
            "{extra:?}: {err}"
        );
        if want.starts_with("--fits") {
            assert!(err.contains("8GiB, 16G, 512MiB"), "{err}");
        }
    }
    std::fs::remove_dir_all(&dir).ok();
}

/// LoRA in two pipeline stages: each stage holds the frozen weights it reads (the tied
/// embedding on both ends), the losses equal one device's within the pipeline's fp32
/// tolerance, and the base set on the pipeline is the base every stage computes with.
#[test]
fn lora_trains_in_pipeline_stages_as_on_one_device() {
    use kiln::engine::parallel::pipeline_partition::PartitionMethod;
    use kiln::engine::train::pipeline_trainer::PipelineTrainer;
    let (b, t) = (2, 16);
    for (name, base) in bases(t) {
        let model: Arc<dyn Model> =
            Arc::new(Lora::new(base.clone(), lora(4, 8.0, 0.1, all_linear())).unwrap());
        // A base of unit-scale weights, set on both: the adapters train on it.
        let cpu = CpuDevice::new();
        let plain = Network::new(&cpu, base.clone(), &options(b, DType::F32)).unwrap();
        let mut rng = Rng::new(11);
        let unit: Vec<HostTensor> = weights(&cpu, &plain)
            .into_iter()
            .map(|w| {
                let v = (0..w.data.len()).map(|_| rng.uniform(-0.3, 0.3)).collect();
                HostTensor::new(w.name, w.shape, HostData::F32(v))
            })
            .collect();
        let config = || ds_config(b, 2, DType::F32, 1);
        let mut one = Trainer::new(&cpu, model.clone(), config(), 5).unwrap();
        one.set_frozen(&[&cpu], &unit).unwrap();
        let devs: Vec<Box<dyn Device>> = (0..2)
            .map(|_| Box::new(CpuDevice::new()) as Box<dyn Device>)
            .collect();
        let mut pipe = PipelineTrainer::new(
            devs,
            model.clone(),
            config(),
            5,
            &PartitionMethod::Uniform,
            2,
        )
        .unwrap();
        pipe.set_frozen(&unit).unwrap();
        for step in 0..3u64 {
            let micro = [tokens(step, b * t), tokens(50 + step, b * t)];
            let a = one.step(&cpu, &micro).unwrap().loss;
            let p = pipe.step(&micro).unwrap().loss;
            // As tests/packing.rs: the same sums split over two devices, f32 rounding.
            assert!(
                (a - p).abs() <= 1e-5 * a.abs(),
                "{name} step {step}: {p} vs {a}"
            );
        }
        let e = pipe.set_frozen(&unit[1..]).unwrap_err().to_string();
        assert!(e.contains("missing"), "{e}");
    }
}
