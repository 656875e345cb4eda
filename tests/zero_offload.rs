//! ZeRO-Offload (`zero_optimization.offload_optimizer.device: "cpu"`): each rank's shard
//! of the f32 master weights and Adam moments lives in host memory and the host steps
//! it. The host step is the kernels' f32 arithmetic in their order, element by element
//! (`device::optim::host_step`), so an offloaded group trains bit for bit as the same
//! group with the state on its devices: same losses, same masters, moments and model
//! copies, through clipping, fp16 loss scaling and a skipped overflow step.

mod common;

use common::*;
use kiln::cpu::CpuDevice;
use kiln::engine::config::parse;
use kiln::engine::models::gpt::{Gpt, GptConfig};
use kiln::engine::models::MicroBatch;
use kiln::engine::train::trainer::Trainer;
use kiln::engine::{DType, Device, HostData};

const B: usize = 2;
const T: usize = 8;
const STEPS: usize = 6;

fn gpt() -> std::sync::Arc<Gpt> {
    let cfg = GptConfig {
        n_layer: 2,
        n_head: 2,
        n_embd: 32,
        block_size: T,
        vocab_size: 13,
        padded_vocab_size: None,
    };
    std::sync::Arc::new(Gpt::new(cfg, T))
}

/// AdamW with weight decay, a warm-up and clipping at 0.5 (active: the first steps'
/// norms are above it), at ZeRO `stage`, the state offloaded or not.
fn config(precision: &str, world: usize, stage: u8, offload: bool) -> kiln::engine::TrainConfig {
    let device = if offload { "cpu" } else { "none" };
    parse(
        &format!(
            r#"{{"train_micro_batch_size_per_gpu": {B}, "gradient_accumulation_steps": 1,
                "gradient_clipping": 0.5, {precision}
                "zero_optimization": {{"stage": {stage}, "overlap_comm": {overlap},
                    "reduce_bucket_size": 3000,
                    "offload_optimizer": {{"device": "{device}", "pin_memory": true}}}},
                "optimizer": {{"type": "AdamW", "params": {{"lr": 0.01, "weight_decay": 0.1}}}},
                "scheduler": {{"type": "WarmupLR", "params": {{"warmup_num_steps": 3, "warmup_max_lr": 0.01}}}}}}"#,
            overlap = stage == 2,
        ),
        world,
    )
    .unwrap()
}

/// Rank r's micro-batch of each step: counting mod 13 from random starts.
fn batches(world: usize) -> Vec<Vec<MicroBatch>> {
    let mut rng = Rng::new(5);
    (0..STEPS)
        .map(|_| {
            (0..world)
                .map(|_| {
                    let (mut tok, mut tgt) = (vec![], vec![]);
                    for _ in 0..B {
                        let start = rng.next_u32() % 13;
                        tok.extend((0..T as u32).map(|i| (start + i) % 13));
                        tgt.extend((1..=T as u32).map(|i| (start + i) % 13));
                    }
                    MicroBatch::tokens(&tok, &tgt)
                })
                .collect()
        })
        .collect()
}

const FP16: &str = r#""fp16": {"enabled": true, "initial_scale_power": 10, "hysteresis": 1},"#;

/// Trains the device-state group and the offloaded one side by side on `devs` (two
/// groups' devices), asserting every step's loss and decision equal; in fp16 step 2
/// overflows on the last rank (its token embedding set to 1e6) and must be skipped by
/// both, leaving the state untouched. Ends with the whole states equal.
fn trains_alike(devs: [&[&dyn Device]; 2], precision: &str, stage: u8) {
    trains_within(devs, precision, stage, 0.0)
}

/// [`trains_alike`] with the final masters and moments allowed to differ by `tol`
/// relative to the largest magnitude of their tensor (0: bit for bit).
fn trains_within(devs: [&[&dyn Device]; 2], precision: &str, stage: u8, tol: f32) {
    let world = devs[0].len();
    let what = format!("world {world}, stage {stage}, {precision}");
    let mut groups: Vec<Trainer> = [false, true]
        .iter()
        .zip(devs)
        .map(|(&offload, d)| {
            Trainer::new_group(d, gpt(), config(precision, world, stage, offload), 3).unwrap()
        })
        .collect();
    let data = batches(world);
    let fp16 = precision.contains("fp16");
    for (i, step) in data.iter().enumerate() {
        let per_rank: Vec<Vec<MicroBatch>> = step.iter().map(|m| vec![m.clone()]).collect();
        let overflow = fp16 && i == 2;
        let mut kept = vec![];
        let mut stats = vec![];
        for (g, d) in groups.iter_mut().zip(devs) {
            let last = d.len() - 1;
            let net = g.models().nth(last).unwrap();
            let wte = net.value(d[last], 0).unwrap();
            if overflow {
                let huge = HostData::from_f32(DType::F16, &vec![1e6; wte.len()]);
                net.set_value(d[last], 0, &huge).unwrap();
            }
            let before = g.param_states(d).unwrap();
            let s = g.step_group(d, &per_rank).unwrap();
            if overflow {
                assert!(s.skipped, "{what}: {s:?}");
                assert_eq!(
                    g.param_states(d).unwrap(),
                    before,
                    "{what}: a skip changed state"
                );
                g.models()
                    .nth(last)
                    .unwrap()
                    .set_value(d[last], 0, &wte)
                    .unwrap();
            }
            kept.push(g.last_comm.offload_ms);
            stats.push(s);
        }
        // The loss by its bits: an overflowing step's is NaN on both.
        let key = |s: &kiln::engine::train::trainer::StepStats| {
            (s.loss.to_bits(), s.lr, s.loss_scale, s.skipped, s.applied)
        };
        assert_eq!(key(&stats[0]), key(&stats[1]), "{what}: step {i}");
        assert_eq!(kept[0], 0.0, "{what}: nothing offloaded, no host step");
        if !stats[1].skipped {
            assert!(kept[1] > 0.0, "{what}: the host step is timed");
        }
    }
    let states: Vec<_> = groups
        .iter()
        .zip(devs)
        .map(|(g, d)| g.param_states(d).unwrap())
        .collect();
    if tol == 0.0 {
        assert_eq!(
            states[0], states[1],
            "{what}: weights, masters or moments differ"
        );
    }
    for (a, b) in states[0].iter().zip(&states[1]) {
        if tol > 0.0 && a.name.ends_with("attn.c_attn.bias") {
            // Holds the attention key bias, whose true gradient is zero (softmax
            // ignores a shift shared by a row of scores): Adam divides rounding noise
            // by rounding noise there, so it is left out of a comparison to tolerance.
            continue;
        }
        for (part, x, y) in [
            ("master", &a.master, &b.master),
            ("m", &a.m, &b.m),
            ("v", &a.v, &b.v),
        ] {
            let scale = x.iter().fold(0f32, |s, v| s.max(v.abs()));
            let worst = x.iter().zip(y).fold(0f32, |s, (p, q)| s.max((p - q).abs()));
            assert!(
                worst <= tol * scale,
                "{what}: {} {part}: {worst} of {scale}",
                a.name
            );
        }
    }
    // Every rank's model copy is the one the host's step wrote.
    for (m, d) in groups[1].models().zip(devs[1]) {
        for (i, st) in states[1].iter().enumerate() {
            assert_eq!(m.value(*d, i).unwrap(), st.value, "{what}");
        }
    }
}

fn refs(devs: &[Box<dyn Device>]) -> Vec<&dyn Device> {
    devs.iter().map(|d| d.as_ref()).collect()
}

/// On the CPU backend the device step is the same host function: bit-identical by
/// construction of the code, checked here through the whole ZeRO machinery.
#[test]
fn an_offloaded_state_trains_bit_for_bit_as_on_cpu_backend_devices() {
    let cpus = || -> Vec<Box<dyn Device>> {
        (0..2)
            .map(|_| Box::new(CpuDevice::new()) as Box<dyn Device>)
            .collect()
    };
    let (a, b) = (cpus(), cpus());
    trains_alike([&refs(&a), &refs(&b)], "", 1);
    trains_alike([&refs(&a), &refs(&b)], FP16, 2);
}

/// On lavapipe the Adam kernel is compiled by Mesa: its f32 operations round one by
/// one as the host's do (no contraction into fused multiply-adds), so the offloaded
/// group's bits are the device group's, in fp32 and fp16, at stages 1 and 2, on one
/// device and on two.
#[test]
fn an_offloaded_state_trains_bit_for_bit_as_on_the_gpu() {
    let gpus =
        |n: usize| -> Vec<Box<dyn Device>> { (0..n).map(|_| gpu("vulkan", false)).collect() };
    let (a, b) = (gpus(2), gpus(2));
    trains_alike([&refs(&a), &refs(&b)], "", 1);
    trains_alike([&refs(&a), &refs(&b)], FP16, 2);
    // One device: stage 1 with the state on the host. Without offload one device's
    // ZeRO is stage 0, whose gradient norm (for clipping) is reduced on the device in
    // f32, not on the host in f64: the clip factor may differ in its last bits, so the
    // states agree to 1e-3 of each tensor's largest value (seen: 1.1e-4), not bit for bit.
    let (a, b) = (gpus(1), gpus(1));
    trains_within([&refs(&a), &refs(&b)], FP16, 1, 1e-3);
}

/// The devices give up exactly the shard buffers the host takes over (the allocator's
/// bytes): per rank its slices' f32 master, moments and reduced gradient, the model
/// copy of the slice and the f32 gradient factor; the host holds 12 bytes per element.
/// A checkpoint's state moves between the two homes both ways and training continues
/// as if it had not moved.
#[test]
fn offloading_frees_the_shard_buffers_and_checkpoints_move_both_ways() {
    let world = 2;
    let devs: Vec<Vec<Box<dyn Device>>> = (0..4)
        .map(|_| (0..world).map(|_| gpu("vulkan", false)).collect())
        .collect();
    let r: Vec<Vec<&dyn Device>> = devs.iter().map(|d| refs(d)).collect();
    let build = |i: usize, offload: bool| {
        Trainer::new_group(&r[i], gpt(), config("", world, 1, offload), 3).unwrap()
    };
    let mut on_dev = build(0, false);
    let bytes_dev: Vec<u64> = r[0].iter().map(|d| d.allocated_bytes()).collect();
    let mut on_host = build(1, true);
    let bytes_host: Vec<u64> = r[1].iter().map(|d| d.allocated_bytes()).collect();
    let sizes: Vec<usize> = on_dev
        .model
        .parameter_layout()
        .iter()
        .map(|l| l.1.iter().product())
        .collect();
    let f32b = |n: usize| DType::F32.padded_bytes(n);
    let estimate = kiln::estimate::stages(gpt().as_ref(), B, DType::F32, world).unwrap();
    for rank in 0..world {
        let segs = kiln::engine::parallel::zero::segments(&sizes, world, rank);
        let shard: u64 = segs.iter().map(|s| 5 * f32b(s.range.len())).sum::<u64>() + f32b(1);
        assert_eq!(
            bytes_dev[rank] - bytes_host[rank],
            shard,
            "rank {rank}: allocator bytes {} on device, {} offloaded",
            bytes_dev[rank],
            bytes_host[rank]
        );
        let elements = on_host.optimizer_state_elements(rank);
        assert_eq!(elements, on_dev.optimizer_state_elements(rank));
        let (a, b) = (
            on_dev.model_state_bytes(rank),
            on_host.model_state_bytes(rank),
        );
        assert_eq!(b.offloaded, 12 * elements as u64, "rank {rank}");
        assert_eq!(
            (a.offloaded, a.total() - b.total()),
            (0, shard),
            "rank {rank}"
        );
        // `kiln estimate`'s row for stage 1 with offload predicts both (to 1%: it gives
        // every rank the largest slice).
        let e = &estimate[4];
        assert!(e.offload && e.stage == 1, "{e:?}");
        let near = |x: u64, y: u64| x.abs_diff(y) as f64 <= 0.01 * y as f64;
        assert!(
            near(e.weights + e.gradients + e.optimizer, b.total()),
            "{b:?} vs {e:?}"
        );
        assert!(near(e.host, b.offloaded), "{b:?} vs {e:?}");
    }

    let data = batches(world);
    let step = |t: &mut Trainer, d: &[&dyn Device], i: usize| {
        let per_rank: Vec<Vec<MicroBatch>> = data[i].iter().map(|m| vec![m.clone()]).collect();
        t.step_group(d, &per_rank).unwrap()
    };
    for i in 0..3 {
        assert_eq!(step(&mut on_dev, &r[0], i), step(&mut on_host, &r[1], i));
    }
    // Device state into an offloaded group, offloaded state onto devices.
    let mut to_host = build(2, true);
    to_host
        .load_param_states(&r[2], &on_dev.param_states(&r[0]).unwrap())
        .unwrap();
    to_host.restore(&on_dev.state()).unwrap();
    let mut to_dev = build(3, false);
    to_dev
        .load_param_states(&r[3], &on_host.param_states(&r[1]).unwrap())
        .unwrap();
    to_dev.restore(&on_host.state()).unwrap();
    for i in 3..STEPS {
        let want = step(&mut on_dev, &r[0], i);
        assert_eq!(step(&mut to_host, &r[2], i), want, "step {i}");
        assert_eq!(step(&mut to_dev, &r[3], i), want, "step {i}");
    }
    let want = on_dev.param_states(&r[0]).unwrap();
    assert_eq!(to_host.param_states(&r[2]).unwrap(), want);
    assert_eq!(to_dev.param_states(&r[3]).unwrap(), want);
}

/// The host step against the optimizer kernels on lavapipe, for every optimizer Kiln
/// has (AdamW, Adam with the decay in the gradient, SGD with momentum), three steps
/// over awkward lengths with a gradient factor that is not a power of two: the same
/// bits in the masters, moments and f16 model copies. Mesa rounds each f32 operation on
/// its own, as the host does; a driver that fuses multiply-adds would differ in last
/// bits, which is why the offload tests compare against lavapipe and the CPU backend.
#[test]
fn the_host_step_gives_the_kernels_bits_on_the_gpu() {
    use kiln::engine::device::optim::{host_step, HostState, ParamBuffers};
    use kiln::engine::Optimizer;
    let dev = gpu("vulkan", false);
    let dev = dev.as_ref();
    let optimizers = [
        Optimizer::adamw(3e-3, 0.1),
        Optimizer::Adam {
            lr: 3e-3,
            betas: [0.9, 0.999],
            eps: 1e-8,
            weight_decay: 0.05,
            decoupled: false,
        },
        Optimizer::Sgd {
            lr: 0.05,
            momentum: 0.9,
            weight_decay: 0.01,
        },
    ];
    for n in [1, 7, 1000, 40_001] {
        for opt in &optimizers {
            let mut rng = Rng::new(n as u64);
            let mut w: Vec<f32> = (0..n).map(|_| rng.uniform(-1.0, 1.0)).collect();
            let (mut m, mut v) = (vec![0.0f32; n], vec![0.0f32; n]);
            let b = ParamBuffers::new(dev, &w, DType::F16, DType::F32).unwrap();
            dev.upload(b.m, &HostData::F32(m.clone())).unwrap();
            dev.upload(b.v, &HostData::F32(v.clone())).unwrap();
            let scale = dev.alloc(DType::F32, 1).unwrap();
            let factor = 0.37f32;
            dev.upload(scale, &HostData::F32(vec![factor])).unwrap();
            let (lr, decay) = (opt.lr(), opt.weight_decay());
            for step in 1..=3 {
                let g: Vec<f32> = (0..n).map(|_| rng.uniform(-3.0, 3.0)).collect();
                dev.upload(b.grad, &HostData::F32(g.clone())).unwrap();
                dev.launch(&b.step(opt, scale, lr, decay, step)).unwrap();
                let state = HostState {
                    master: &mut w,
                    m: &mut m,
                    v: &mut v,
                };
                host_step(opt, (lr, decay, step), factor, &g, state).unwrap();
            }
            let what = format!("{opt:?}, {n} elements");
            let bits = |d: HostData| d.bits();
            assert_eq!(
                bits(dev.download(b.master).unwrap()),
                bits(HostData::F32(w.clone())),
                "{what}: master"
            );
            assert_eq!(
                bits(dev.download(b.m).unwrap()),
                bits(HostData::F32(m.clone())),
                "{what}: m"
            );
            if !matches!(opt, Optimizer::Sgd { .. }) {
                assert_eq!(
                    bits(dev.download(b.v).unwrap()),
                    bits(HostData::F32(v.clone())),
                    "{what}: v"
                );
            }
            let copy = HostData::from_f32(DType::F16, &w);
            assert_eq!(
                bits(dev.download(b.value).unwrap()),
                bits(copy),
                "{what}: f16 copy"
            );
        }
    }
}

/// Resident set size of this process, in bytes (Linux).
fn rss() -> u64 {
    let statm = std::fs::read_to_string("/proc/self/statm").unwrap();
    let pages: u64 = statm.split_whitespace().nth(1).unwrap().parse().unwrap();
    pages * 4096
}

const CHILD: &str = "offloaded_shards_are_resident_host_memory_child";

/// The host memory an offloaded shard takes is resident from the start (written, not
/// only reserved), so a host too small for it fails when the run starts, not steps
/// later. Measured in a process of its own: other tests' allocations would move the
/// resident size.
#[test]
fn offloaded_shards_are_resident_host_memory() {
    let out = std::process::Command::new(std::env::current_exe().unwrap())
        .args([
            CHILD,
            "--exact",
            "--ignored",
            "--nocapture",
            "--test-threads=1",
        ])
        .output()
        .unwrap();
    let text =
        String::from_utf8_lossy(&out.stdout).to_string() + &String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{text}");
    assert!(text.contains("1 passed"), "the child test ran: {text}");
}

#[test]
#[ignore = "run in a process of its own by offloaded_shards_are_resident_host_memory"]
fn offloaded_shards_are_resident_host_memory_child() {
    use kiln::engine::parallel::zero::Shards;
    // Two ranks' shards of three tensors of 6 Mi elements in all: 72 MiB of host
    // state (f32 master and two moments), 36 MiB per rank.
    let sizes = [1 << 20, 3 << 20, 2 << 20];
    let total: usize = sizes.iter().sum();
    let masters: Vec<Vec<f32>> = sizes.iter().map(|&n| vec![0.5; n]).collect();
    let cpus = [CpuDevice::new(), CpuDevice::new()];
    let devs: Vec<&dyn Device> = cpus.iter().map(|d| d as &dyn Device).collect();
    let masters: Vec<&[f32]> = masters.iter().map(Vec::as_slice).collect();
    let dtypes = [DType::F16; 3];
    let before = rss();
    let offload = kiln::engine::parallel::zero::Offload {
        optimizer: true,
        params: false,
    };
    let shards = Shards::from_masters(&devs, &masters, &dtypes, None, offload).unwrap();
    let grown = rss() as i64 - before as i64;
    let want = 12 * total as i64;
    // 4 MiB of slack for the allocator's own pages and the bookkeeping.
    assert!(
        (grown - want).abs() <= 4 << 20,
        "resident size grew by {grown} bytes for {want} bytes of offloaded state"
    );
    assert!(shards.offloaded());
    assert_eq!(devs.iter().map(|d| d.allocated_bytes()).sum::<u64>(), 0);
    println!("grew {grown} bytes for {want}");
}
