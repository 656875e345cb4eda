//! Generic ops an application's model needs: ReLU, tanh and SiLU; softmax as a graph op;
//! mean-squared error as a graph loss; dropout with a seeded, resumable mask.
//! - Every kernel on every GPU path against the CPU reference, f32/f16/bf16 storage,
//!   awkward sizes (1, odd, primes, past a workgroup).
//! - Every graph op's derived backward against central finite differences of the loss
//!   (CPU backend, f32 storage, differences taken in f64), as tests/graph.rs does.
//! - Dropout's mask: the same bits on the CPU and every GPU path for one key, another
//!   mask for another key or another op, the kept fraction within a binomial bound,
//!   backward on the forward's mask, and `Plan::evaluate` as the identity.
//! - MSE end to end: a linear regression whose loss is checked against a host
//!   computation and falls under a few Adam steps.

mod common;

use common::*;
use kiln::cpu::CpuDevice;
use kiln::engine::device::optim::ParamBuffers;
use kiln::engine::graph::{Bindings, Graph, Loss, Plan, Tensor};
use kiln::engine::kernels::{dropout_hash, dropout_scale, dropout_threshold};
use kiln::engine::kernels::{
    Activation, ActivationBackward, Dropout, DropoutBackward, MseBackward, MseLoss,
};
use kiln::engine::{ActivationKind, Buffer, DType, Device, HostData, Kernel, Optimizer};

/// Odd and prime lengths, one past a workgroup of pairs (2 x 256 + 1), and a prime
/// that needs several workgroups and has an odd tail.
const LENS: [usize; 4] = [1, 7, 513, 4099];

fn f32s(dev: &dyn Device, b: Buffer) -> Vec<f32> {
    dev.download(b).unwrap().to_f32()
}

/// Relative spacing of `dtype` (one ulp is at most this times the value).
fn ulp_rel(dtype: DType) -> f32 {
    match dtype {
        DType::F16 => 2f32.powi(-10),
        DType::BF16 => 2f32.powi(-7),
        _ => 0.0,
    }
}

/// Each element within `rel[i] * mag[i] + one ulp of the dtype at |cpu| + floor`, where
/// `mag` is the size of the terms the result is computed from (|cpu| when nothing
/// cancels).
fn close(what: &str, got: &HostData, want: &HostData, (rel, mag): (&[f32], &[f32]), floor: f32) {
    let (g, w) = (got.to_f32(), want.to_f32());
    assert_eq!(g.len(), w.len(), "{what}: length");
    let dtype = got.dtype();
    // Below 2^-14 f16 is subnormal: its spacing stops shrinking at 2^-24.
    let floor = floor
        + if dtype == DType::F16 {
            2f32.powi(-24)
        } else {
            0.0
        };
    for i in 0..g.len() {
        let t = rel[i] * mag[i] + ulp_rel(dtype) * w[i].abs() + floor;
        assert!(
            (g[i] - w[i]).abs() <= t,
            "{what}: element {i} of {}: gpu {}, cpu {} (tol {t})",
            g.len(),
            g[i],
            w[i]
        );
    }
}

/// Inputs for the activations: zeros of both signs, values near 0 (tanh's series),
/// either side of tanh's switch at 0.55, and arguments where exp under- or overflows
/// in f32 (|x| > 44 for tanh's exp(-2|x|), x < -88.7 for SiLU), then uniform in [-6, 6).
fn activation_inputs(rng: &mut Rng, n: usize) -> Vec<f32> {
    let mut v = vec![
        0.0, -0.0, 1e-3, -1e-3, 0.549, -0.551, 0.55, 3.0, -3.0, 9.5, -9.5, 50.0, -50.0, 100.0,
        -100.0,
    ];
    v.truncate(n);
    while v.len() < n {
        v.push(rng.uniform(-6.0, 6.0));
    }
    v
}

#[test]
fn activations_match_cpu_on_every_gpu_path() {
    let mut rng = Rng::new(11);
    for p in gpu_paths() {
        let dev = p.dev.as_ref();
        for dtype in DType::FLOATS {
            for kind in ActivationKind::ALL {
                for n in LENS {
                    let x = HostData::from_f32(dtype, &activation_inputs(&mut rng, n));
                    let dout: Vec<f32> = (0..n).map(|_| rng.uniform(-1.0, 1.0)).collect();
                    let dout = HostData::from_f32(dtype, &dout);
                    let what = format!("{}: {} {dtype} x{n}", p.name, kind.name());
                    let fwd = run_both(dev, &[x.clone(), HostData::zeros(dtype, n)], |b| {
                        (
                            Kernel::Activation(Activation {
                                kind,
                                x: b[0],
                                out: b[1],
                            }),
                            vec![1],
                        )
                    });
                    let inputs = [x.clone(), dout.clone(), HostData::zeros(dtype, n)];
                    let bwd = run_both(dev, &inputs, |b| {
                        (
                            Kernel::ActivationBackward(ActivationBackward {
                                kind,
                                x: b[0],
                                dout: b[1],
                                dx: b[2],
                            }),
                            vec![2],
                        )
                    });
                    if kind == ActivationKind::Relu {
                        // A select: no arithmetic, so bit for bit.
                        assert_bits_eq(&what, &fwd[0].0, &fwd[0].1);
                        assert_bits_eq(&format!("{what} backward"), &bwd[0].0, &bwd[0].1);
                        continue;
                    }
                    // The CPU rounds the f64 value once; the kernel computes in f32 with
                    // exp, which WGSL allows 3 + 2|y| ulps for exp(y) (y = -2|x| for
                    // tanh, -x for SiLU), plus a few roundings of its own arithmetic:
                    // (16 + 6|x|) ulps of f32, relative to the terms. Nothing cancels but
                    // in SiLU's derivative s (1 + x (1 - s)), which crosses 0 near
                    // x = -1.28: there the terms are s (1 + 2|x|) (s's error enters
                    // through both of its uses). The floor 1e-35 takes the limits where
                    // exp under- or overflows f32 or a device flushes a subnormal, giving
                    // 0 where the f64 value is below 1e-36.
                    let (xs, ds) = (x.to_f32(), dout.to_f32());
                    let rel: Vec<f32> = xs
                        .iter()
                        .map(|v| (16.0 + 6.0 * v.abs()) * 2f32.powi(-24))
                        .collect();
                    let out_mag: Vec<f32> = fwd[0].1.to_f32().iter().map(|v| v.abs()).collect();
                    let grad_mag: Vec<f32> = match kind {
                        ActivationKind::Silu => xs
                            .iter()
                            .zip(&ds)
                            .map(|(&v, &d)| {
                                let s = 1.0 / (1.0 + (-v as f64).exp());
                                (d.abs() as f64 * s * (1.0 + 2.0 * v.abs() as f64)) as f32
                            })
                            .collect(),
                        _ => bwd[0].1.to_f32().iter().map(|v| v.abs()).collect(),
                    };
                    close(&what, &fwd[0].0, &fwd[0].1, (&rel, &out_mag), 1e-35);
                    close(
                        &format!("{what} backward"),
                        &bwd[0].0,
                        &bwd[0].1,
                        (&rel, &grad_mag),
                        1e-35,
                    );
                }
            }
        }
    }
}

/// A function of one real variable (an activation or its derivative, in f64).
type Real = fn(f64) -> f64;

#[test]
fn activation_kernels_match_their_definitions_on_cpu() {
    // The CPU reference against hand-derived values (f64 math rounded once to f32).
    let cpu = CpuDevice::new();
    let xs = [-2.0f32, -0.5, 0.0, 0.25, 3.0];
    for kind in ActivationKind::ALL {
        let (f, df): (Real, Real) = match kind {
            ActivationKind::Relu => (|x| x.max(0.0), |x| if x > 0.0 { 1.0 } else { 0.0 }),
            ActivationKind::Tanh => (|x| x.tanh(), |x| 1.0 - x.tanh() * x.tanh()),
            ActivationKind::Silu => (
                |x| x / (1.0 + (-x).exp()),
                |x| {
                    let s = 1.0 / (1.0 + (-x).exp());
                    s + x * s * (1.0 - s)
                },
            ),
        };
        let out = run_both(
            &cpu,
            &[HostData::F32(xs.to_vec()), HostData::zeros(DType::F32, 5)],
            |b| {
                (
                    Kernel::Activation(Activation {
                        kind,
                        x: b[0],
                        out: b[1],
                    }),
                    vec![1],
                )
            },
        );
        let back = run_both(
            &cpu,
            &[
                HostData::F32(xs.to_vec()),
                HostData::F32(vec![0.5; 5]),
                HostData::zeros(DType::F32, 5),
            ],
            |b| {
                (
                    Kernel::ActivationBackward(ActivationBackward {
                        kind,
                        x: b[0],
                        dout: b[1],
                        dx: b[2],
                    }),
                    vec![2],
                )
            },
        );
        for (i, &x) in xs.iter().enumerate() {
            let (o, d) = (out[0].1.to_f32()[i], back[0].1.to_f32()[i]);
            let (wo, wd) = (f(x as f64) as f32, (0.5 * df(x as f64)) as f32);
            // Rounded once from f64 on both sides: within one f32 ulp.
            assert!(
                (o - wo).abs() <= 2e-7 * wo.abs(),
                "{kind:?}({x}) = {o}, not {wo}"
            );
            assert!(
                (d - wd).abs() <= 2e-7 * wd.abs(),
                "{kind:?}'({x}) * 0.5 = {d}, not {wd}"
            );
        }
    }
}

#[test]
fn mse_kernels_match_cpu_on_every_gpu_path() {
    use DType::*;
    let mut rng = Rng::new(12);
    // (pred, target, dpred): each dtype alone, and the mixes a trainer makes (16-bit
    // predictions against f32 targets, f32 gradients).
    let sets = [
        [F32, F32, F32],
        [F16, F16, F16],
        [BF16, BF16, BF16],
        [F16, F32, F32],
        [BF16, F32, BF16],
        [F32, F16, F16],
    ];
    for p in gpu_paths() {
        let dev = p.dev.as_ref();
        for [dp, dt, dd] in sets {
            // One element; odd rows and columns; rows longer than a workgroup; rows
            // enough (>= 128) that CPU adapters walk one per invocation; a prime count.
            for (rows, cols) in [(1, 1), (3, 7), (2, 1001), (300, 5), (13, 64)] {
                let n = rows * cols;
                let pred: Vec<f32> = (0..n).map(|_| rng.uniform(-2.0, 2.0)).collect();
                let target: Vec<f32> = (0..n).map(|_| rng.uniform(-2.0, 2.0)).collect();
                let inputs = [
                    HostData::from_f32(dp, &pred),
                    HostData::from_f32(dt, &target),
                    HostData::zeros(F32, rows),
                    HostData::zeros(dd, n),
                ];
                let what = format!("{}: mse {dp}/{dt} -> {dd} {rows}x{cols}", p.name);
                let fwd = run_both(dev, &inputs, |b| {
                    (
                        Kernel::MseLoss(MseLoss {
                            pred: b[0],
                            target: b[1],
                            losses: b[2],
                            cols,
                        }),
                        vec![2],
                    )
                });
                // Non-negative terms, each (pred - target)^2 with three f32 roundings,
                // summed along at most `cols` additions and divided once: the f32 result
                // is within (cols + 4) ulps of f32, relative, of the f64 one.
                let rel = vec![(cols as f32 + 4.0) * 2f32.powi(-24); rows];
                let mag: Vec<f32> = fwd[0].1.to_f32().iter().map(|v| v.abs()).collect();
                close(
                    &format!("{what}: losses"),
                    &fwd[0].0,
                    &fwd[0].1,
                    (&rel, &mag),
                    0.0,
                );
                let scale = 0.37;
                let bwd = run_both(dev, &inputs, |b| {
                    (
                        Kernel::MseBackward(MseBackward {
                            pred: b[0],
                            target: b[1],
                            dpred: b[3],
                            cols,
                            scale,
                        }),
                        vec![3],
                    )
                });
                // One f32 subtraction and one product, both correctly rounded in WGSL
                // and on the CPU, then one rounding to the dtype (the inputs are
                // multiples of 2^-22 in [-2, 2): no subnormal to flush): bit for bit.
                assert_ulps(&format!("{what}: dpred"), &bwd[0].0, &bwd[0].1, 0);
            }
        }
    }
}

#[test]
fn mse_kernels_match_a_hand_computation() {
    let cpu = CpuDevice::new();
    // Rows (1, 2, 3) vs (1, 0, 0) and (0.5, -0.5, 1) vs (0, 0, 0).
    let out = run_both(
        &cpu,
        &[
            HostData::F32(vec![1.0, 2.0, 3.0, 0.5, -0.5, 1.0]),
            HostData::F32(vec![1.0, 0.0, 0.0, 0.0, 0.0, 0.0]),
            HostData::zeros(DType::F32, 2),
            HostData::zeros(DType::F32, 6),
        ],
        |b| {
            (
                Kernel::MseLoss(MseLoss {
                    pred: b[0],
                    target: b[1],
                    losses: b[2],
                    cols: 3,
                }),
                vec![2],
            )
        },
    );
    // (0 + 4 + 9) / 3 and (0.25 + 0.25 + 1) / 3.
    let l = out[0].1.to_f32();
    assert_eq!(l, vec![13.0f32 / 3.0, 0.5]);
    let out = run_both(
        &cpu,
        &[
            HostData::F32(vec![1.0, 2.0, 3.0, 0.5, -0.5, 1.0]),
            HostData::F32(vec![1.0, 0.0, 0.0, 0.0, 0.0, 0.0]),
            HostData::zeros(DType::F32, 6),
        ],
        |b| {
            (
                Kernel::MseBackward(MseBackward {
                    pred: b[0],
                    target: b[1],
                    dpred: b[2],
                    cols: 3,
                    scale: 1.5,
                }),
                vec![2],
            )
        },
    );
    // 2 (pred - target) / 3 * 1.5 = pred - target.
    assert_eq!(out[0].1.to_f32(), vec![0.0, 2.0, 3.0, 0.5, -0.5, 1.0]);
}

/// The seeds the dropout tests use: small, with only one word set, and all bits.
const SEEDS: [u64; 3] = [0, 1 << 32, 0x0123_4567_89AB_CDEF];

#[test]
fn dropout_matches_cpu_bit_exactly_on_every_gpu_path() {
    use DType::*;
    for p in gpu_paths() {
        let dev = p.dev.as_ref();
        for [din, dout] in [
            [F32, F32],
            [F16, F16],
            [BF16, BF16],
            [F16, F32],
            [F32, BF16],
        ] {
            for n in LENS.into_iter().chain([65_537]) {
                for (k, prob) in [0.0f32, 0.1, 0.5, 0.9].into_iter().enumerate() {
                    let seed = SEEDS[k % SEEDS.len()];
                    let x = finite(din, n, 40 + n as u64);
                    let what = format!("{}: dropout {din} -> {dout} x{n} p {prob}", p.name);
                    let inputs = [x, HostData::zeros(dout, n)];
                    // Every value is a single f32 product or +0, stored with one
                    // rounding, and the mask is integer arithmetic: bit for bit.
                    let fwd = run_both(dev, &inputs, |b| {
                        let k = Kernel::Dropout(Dropout {
                            x: b[0],
                            out: b[1],
                            p: prob,
                            seed,
                        });
                        (k, vec![1])
                    });
                    assert_bits_eq(&what, &fwd[0].0, &fwd[0].1);
                    let bwd = run_both(dev, &inputs, |b| {
                        let k = Kernel::DropoutBackward(DropoutBackward {
                            dout: b[0],
                            dx: b[1],
                            p: prob,
                            seed,
                        });
                        (k, vec![1])
                    });
                    assert_bits_eq(&format!("{what} backward"), &bwd[0].0, &bwd[0].1);
                    // Backward is the forward's computation over dout: the same mask.
                    assert_bits_eq(&format!("{what} backward mask"), &bwd[0].1, &fwd[0].1);
                }
            }
        }
    }
}

/// The CPU dropout of `n` ones: which elements were kept.
fn mask(dev: &dyn Device, n: usize, p: f32, seed: u64) -> Vec<bool> {
    let out = run_both(
        dev,
        &[HostData::F32(vec![1.0; n]), HostData::zeros(DType::F32, n)],
        |b| {
            (
                Kernel::Dropout(Dropout {
                    x: b[0],
                    out: b[1],
                    p,
                    seed,
                }),
                vec![1],
            )
        },
    );
    let v = out[0].1.to_f32();
    // A kept 1 is exactly the f32 scale; a dropped one exactly +0.
    let scale = dropout_scale(p);
    assert!(
        v.iter()
            .all(|&e| e.to_bits() == scale.to_bits() || e.to_bits() == 0),
        "dropout of ones gave values other than {scale} and +0"
    );
    v.iter().map(|&e| e != 0.0).collect()
}

/// `|count - n q| <= 5 sqrt(n q (1 - q))`: five standard deviations of a binomial count
/// (a fair hash fails it with probability under 1e-6; the seeds are fixed, so the test
/// is deterministic either way).
fn binomial(what: &str, count: usize, n: usize, q: f64) {
    let (mean, sd) = (n as f64 * q, (n as f64 * q * (1.0 - q)).sqrt());
    assert!(
        (count as f64 - mean).abs() <= 5.0 * sd,
        "{what}: {count} of {n}, expected {mean:.0} +- {:.0} (5 sd)",
        5.0 * sd
    );
}

#[test]
fn dropout_masks_keep_one_minus_p_independently_per_element_and_seed() {
    let cpu = CpuDevice::new();
    let n = 100_000;
    for p in [0.1f32, 0.5, 0.9] {
        let q = 1.0 - p as f64;
        for seed in SEEDS {
            let m = mask(&cpu, n, p, seed);
            let what = format!("p {p} seed {seed:#x}");
            binomial(
                &format!("{what}: kept"),
                m.iter().filter(|&&k| k).count(),
                n,
                q,
            );
            // Neighbours share a 32-bit word of 16-bit data and an invocation: they must
            // still be independent (both kept with probability q^2).
            let both = m.windows(2).filter(|w| w[0] && w[1]).count();
            binomial(&format!("{what}: neighbours kept"), both, n - 1, q * q);
            // The tail of the buffer is no different from its head.
            let tail = m[n - 1000..].iter().filter(|&&k| k).count();
            binomial(&format!("{what}: last 1000 kept"), tail, 1000, q);
        }
        // Another seed, even one differing in a single bit of either word: agreement at
        // the rate of independent masks, q^2 + p^2.
        let base = mask(&cpu, n, p, SEEDS[2]);
        for other in [
            SEEDS[2] ^ 1,
            SEEDS[2] ^ (1 << 40),
            SEEDS[2].wrapping_add(12345),
        ] {
            let m = mask(&cpu, n, p, other);
            let same = m.iter().zip(&base).filter(|(a, b)| a == b).count();
            let agree = q * q + (p as f64).powi(2);
            binomial(&format!("p {p} seeds agreeing"), same, n, agree);
        }
    }
    // The mask is the documented hash against the documented threshold.
    let m = mask(&cpu, 1000, 0.3, SEEDS[2]);
    for (i, &k) in m.iter().enumerate() {
        assert_eq!(
            k,
            dropout_hash(SEEDS[2], i as u32) >= dropout_threshold(0.3),
            "{i}"
        );
    }
    // p = 0 keeps everything, as the identity.
    assert!(mask(&cpu, 1000, 0.0, 5).iter().all(|&k| k));
    assert_eq!(dropout_threshold(0.0), 0);
    assert_eq!(dropout_threshold(0.5), 1 << 31);
}

// ---------------------------------------------------------------------------------------
// Graph ops: finite differences (in the style of tests/graph.rs) and plans.

/// A graph with its parameters and inputs on a device, ready to compile.
struct Model {
    g: Graph,
    params: Vec<ParamBuffers>,
    inputs: Vec<(Tensor, Buffer)>,
    /// d loss / d losses_r: 1 / the rows trained on.
    weight: f32,
    /// The plan's random state (dropout masks).
    key: u64,
}

impl Model {
    fn new() -> Model {
        Model {
            g: Graph::new(),
            params: vec![],
            inputs: vec![],
            weight: 0.0,
            key: 0,
        }
    }

    fn bindings(&self) -> Bindings {
        Bindings {
            params: self.params.clone(),
            inputs: self.inputs.clone(),
            groups: vec![],
        }
    }

    fn compile(&self, dev: &dyn Device) -> Plan {
        let adam = Optimizer::adamw(5e-2, 0.0);
        let mut plan = self.g.compile(dev, &self.bindings(), Some(&adam)).unwrap();
        plan.set_random_state(self.key);
        plan
    }

    /// A parameter uniform in [lo, hi), f32.
    fn param(
        &mut self,
        dev: &dyn Device,
        rng: &mut Rng,
        name: &str,
        shape: &[usize],
        (lo, hi): (f32, f32),
    ) -> Tensor {
        let n: usize = shape.iter().product();
        let init: Vec<f32> = (0..n).map(|_| rng.uniform(lo, hi)).collect();
        self.params
            .push(ParamBuffers::new(dev, &init, DType::F32, DType::F32).unwrap());
        self.g
            .param(name, shape, DType::F32, DType::F32, true)
            .unwrap()
    }

    /// An input bound to a fresh buffer holding `data`.
    fn input(&mut self, dev: &dyn Device, name: &str, shape: &[usize], data: HostData) -> Tensor {
        let t = self.g.input(name, shape, data.dtype());
        self.inputs.push((t, put(dev, &data)));
        t
    }
}

/// Every gradient element of every parameter against central differences of the loss
/// (forward as in training, dropout included: ReLU and dropout are piecewise linear,
/// exact wherever no pre-activation crosses 0 within h; the ReLU model asserts that).
fn check_gradients(dev: &CpuDevice, m: &Model) {
    let mut plan = m.compile(dev);
    plan.accumulate(dev, 1.0, m.weight, 0).unwrap();
    check_finite_differences(dev, &m.g, &m.params, &plan, m.weight);
    plan.free(dev).unwrap();
}

/// Uniform f32 data in [lo, hi).
fn uniform(rng: &mut Rng, n: usize, (lo, hi): (f32, f32)) -> HostData {
    HostData::F32((0..n).map(|_| rng.uniform(lo, hi)).collect())
}

/// x (5, 3) -> linear (w1, b1) -> `act` -> linear (w2, b2) -> mse against a target
/// (5, 2). Returns the model and the pre-activation tensor (kept readable).
fn activation_model(dev: &dyn Device, act: ActivationKind, seed: u64) -> (Model, Tensor) {
    let mut rng = Rng::new(seed);
    let (rows, i, h, o) = (5, 3, 6, 2);
    let mut m = Model::new();
    let x = m.input(
        dev,
        "x",
        &[rows, i],
        uniform(&mut rng, rows * i, (-1.0, 1.0)),
    );
    let target = m.input(
        dev,
        "y",
        &[rows, o],
        uniform(&mut rng, rows * o, (-1.0, 1.0)),
    );
    let w1 = m.param(dev, &mut rng, "w1", &[i, h], (-1.0, 1.0));
    let b1 = m.param(dev, &mut rng, "b1", &[h], (-0.5, 0.5));
    let w2 = m.param(dev, &mut rng, "w2", &[h, o], (-1.0, 1.0));
    let b2 = m.param(dev, &mut rng, "b2", &[o], (-0.5, 0.5));
    let g = &mut m.g;
    let a = g.linear(x, w1, Some(b1)).unwrap();
    g.output(a).unwrap();
    let z = match act {
        ActivationKind::Relu => g.relu(a),
        ActivationKind::Tanh => g.tanh(a),
        ActivationKind::Silu => g.silu(a),
    }
    .unwrap();
    let pred = g.linear(z, w2, Some(b2)).unwrap();
    g.mse(pred, target).unwrap();
    m.weight = 1.0 / rows as f32;
    (m, a)
}

#[test]
fn relu_tanh_and_silu_match_finite_differences() {
    let dev = CpuDevice::new();
    for act in ActivationKind::ALL {
        let (m, a) = activation_model(&dev, act, 24);
        if act == ActivationKind::Relu {
            // ReLU's kink: a weight moved by h = 1e-2 moves a pre-activation by at most
            // h (|x| < 1, one weight or the bias); none may lie within 0.02 of 0, or the
            // difference would straddle it.
            let plan = m.compile(&dev);
            plan.forward(&dev).unwrap();
            let pre = f32s(&dev, plan.buffer(a).unwrap());
            assert!(pre.iter().any(|&v| v < 0.0) && pre.iter().any(|&v| v > 0.0));
            assert!(
                pre.iter().all(|v| v.abs() > 0.02),
                "a pre-activation is within 0.02 of ReLU's kink: pick another seed: {pre:?}"
            );
        }
        check_gradients(&dev, &m);
    }
}

#[test]
fn softmax_matches_finite_differences() {
    let dev = CpuDevice::new();
    let mut rng = Rng::new(22);
    let (rows, i, h, c) = (4, 3, 5, 4);
    let mut m = Model::new();
    let x = m.input(
        &dev,
        "x",
        &[2, 2, i],
        uniform(&mut rng, rows * i, (-1.0, 1.0)),
    );
    let y = m.input(&dev, "y", &[2, 2], HostData::U32(vec![0, 3, 1, 2]));
    let w1 = m.param(&dev, &mut rng, "w1", &[i, h], (-1.5, 1.5));
    let b1 = m.param(&dev, &mut rng, "b1", &[h], (-0.5, 0.5));
    let w2 = m.param(&dev, &mut rng, "w2", &[h, c], (-2.0, 2.0));
    let g = &mut m.g;
    // x (2, 2, 3) -> linear -> softmax over 5 -> linear -> cross-entropy over 4.
    let a = g.linear(x, w1, Some(b1)).unwrap();
    let s = g.softmax(a).unwrap();
    g.output(s).unwrap();
    let logits = g.linear(s, w2, None).unwrap();
    g.cross_entropy(logits, y).unwrap();
    m.weight = 1.0 / rows as f32;
    check_gradients(&dev, &m);
    // The forward is a softmax: rows of positive values summing to one.
    let plan = m.compile(&dev);
    plan.forward(&dev).unwrap();
    for row in f32s(&dev, plan.buffer(s).unwrap()).chunks(h) {
        let sum: f32 = row.iter().sum();
        assert!(
            row.iter().all(|&p| p > 0.0) && (sum - 1.0).abs() < 1e-6,
            "{row:?}"
        );
    }
}

/// x (6, 4) -> linear (w1, b1) -> dropout 0.4 -> tanh -> linear (w2, b2) -> dropout 0.3
/// -> mse against (6, 3): gradients flow through both masks to w1 and b1.
fn dropout_model(dev: &dyn Device, key: u64) -> (Model, [Tensor; 2]) {
    let mut rng = Rng::new(23);
    let (rows, i, h, o) = (6, 4, 7, 3);
    let mut m = Model::new();
    let x = m.input(
        dev,
        "x",
        &[rows, i],
        uniform(&mut rng, rows * i, (-1.0, 1.0)),
    );
    let target = m.input(
        dev,
        "y",
        &[rows, o],
        uniform(&mut rng, rows * o, (-1.0, 1.0)),
    );
    let w1 = m.param(dev, &mut rng, "w1", &[i, h], (-1.0, 1.0));
    let b1 = m.param(dev, &mut rng, "b1", &[h], (-0.5, 0.5));
    let w2 = m.param(dev, &mut rng, "w2", &[h, o], (-1.0, 1.0));
    let b2 = m.param(dev, &mut rng, "b2", &[o], (-0.5, 0.5));
    let g = &mut m.g;
    let a = g.linear(x, w1, Some(b1)).unwrap();
    let d1 = g.dropout(a, 0.4).unwrap();
    let t = g.tanh(d1).unwrap();
    let pred = g.linear(t, w2, Some(b2)).unwrap();
    let d2 = g.dropout(pred, 0.3).unwrap();
    g.output(d1).unwrap();
    g.output(d2).unwrap();
    g.mse(d2, target).unwrap();
    m.weight = 1.0 / rows as f32;
    m.key = key;
    (m, [d1, d2])
}

#[test]
fn dropout_matches_finite_differences_under_a_fixed_key() {
    // Under one key the mask is fixed, so the loss is a smooth function of the weights
    // and backward must use the forward's mask: with another mask its gradients
    // would disagree.
    let dev = CpuDevice::new();
    let (m, [d1, d2]) = dropout_model(&dev, 0xfeed);
    let plan = m.compile(&dev);
    plan.forward(&dev).unwrap();
    for d in [d1, d2] {
        let v = f32s(&dev, plan.buffer(d).unwrap());
        let dropped = v.iter().filter(|&&x| x == 0.0).count();
        assert!(
            dropped > 0 && dropped < v.len(),
            "{dropped} of {} dropped",
            v.len()
        );
    }
    check_gradients(&dev, &m);
}

/// The kept positions of each dropout output of a plan's last forward.
fn kept(dev: &dyn Device, plan: &Plan, outs: &[Tensor]) -> Vec<Vec<bool>> {
    outs.iter()
        .map(|&t| {
            f32s(dev, plan.buffer(t).unwrap())
                .iter()
                .map(|&v| v != 0.0)
                .collect()
        })
        .collect()
}

/// x (rows, cols) input -> dropout p -> linear -> dropout p (same shape) -> mse; the
/// first dropout reads an input, so its output is bit-comparable across devices.
fn dropout_plan_model(dev: &dyn Device) -> (Model, [Tensor; 3]) {
    let mut rng = Rng::new(24);
    let (rows, c) = (37, 9);
    let mut m = Model::new();
    // Inputs away from 0, so that a zero output means a dropped element.
    let xs: Vec<f32> = (0..rows * c)
        .map(|_| {
            rng.uniform(0.1, 1.0)
                * if rng.next_u32().is_multiple_of(2) {
                    1.0
                } else {
                    -1.0
                }
        })
        .collect();
    let x = m.input(dev, "x", &[rows, c], HostData::F32(xs));
    let target = m.input(
        dev,
        "y",
        &[rows, c],
        uniform(&mut rng, rows * c, (-1.0, 1.0)),
    );
    let w = m.param(dev, &mut rng, "w", &[c, c], (-1.0, 1.0));
    let g = &mut m.g;
    let d1 = g.dropout(x, 0.5).unwrap();
    let a = g.linear(d1, w, None).unwrap();
    let d2 = g.dropout(a, 0.5).unwrap();
    for t in [d1, a, d2] {
        g.output(t).unwrap();
    }
    g.mse(d2, target).unwrap();
    m.weight = 1.0 / rows as f32;
    (m, [d1, a, d2])
}

#[test]
fn dropout_plans_give_one_mask_per_key_on_every_device_and_evaluate_is_identity() {
    let cpu = CpuDevice::new();
    let (keys, n) = ([7u64, 8, 1 << 63], 37 * 9);
    // Reference: the CPU plan's masks and first-dropout output per key.
    let (m, [d1, a, d2]) = dropout_plan_model(&cpu);
    let mut plan = m.compile(&cpu);
    let xs = f32s(&cpu, m.inputs[0].1);
    let mut reference = vec![];
    for key in keys {
        plan.set_random_state(key);
        plan.forward(&cpu).unwrap();
        let masks = kept(&cpu, &plan, &[d1, d2]);
        // Kept elements are the inputs times 1/(1-p) = 2 (exact), dropped ones 0.
        let out = f32s(&cpu, plan.buffer(d1).unwrap());
        for i in 0..n {
            let want = if masks[0][i] { xs[i] * 2.0 } else { 0.0 };
            assert_eq!(out[i].to_bits(), want.to_bits(), "element {i}");
        }
        for mk in &masks {
            binomial(
                &format!("key {key}: kept"),
                mk.iter().filter(|&&k| k).count(),
                n,
                0.5,
            );
        }
        // Two dropout ops of one shape and p under one key: different masks, agreeing
        // at the rate of independent ones (1/2).
        let same = masks[0]
            .iter()
            .zip(&masks[1])
            .filter(|(p, q)| p == q)
            .count();
        binomial(&format!("key {key}: ops agreeing"), same, n, 0.5);
        reference.push((masks, dropout_bits(&cpu, &plan, d1)));
    }
    // Another key gives another mask.
    for w in reference.windows(2) {
        let same = w[0].0[0]
            .iter()
            .zip(&w[1].0[0])
            .filter(|(p, q)| p == q)
            .count();
        binomial("keys agreeing", same, n, 0.5);
    }
    // Evaluation: dropout is the identity; training's forward is unchanged after it.
    plan.evaluate(&cpu).unwrap();
    assert_eq!(dropout_bits(&cpu, &plan, d1), bits(&xs));
    let av = f32s(&cpu, plan.buffer(a).unwrap());
    assert_eq!(dropout_bits(&cpu, &plan, d2), bits(&av));
    plan.forward(&cpu).unwrap();
    assert_eq!(kept(&cpu, &plan, &[d1, d2]), reference[2].0);
    plan.free(&cpu).unwrap();
    // Every GPU path, its own plan: the same masks for the same keys, whatever the
    // order the keys come in (a resumed run sets a key it has not set before).
    for p in gpu_paths() {
        let dev = p.dev.as_ref();
        let (m, [d1, _, d2]) = dropout_plan_model(dev);
        let mut plan = m.compile(dev);
        for (k, key) in keys.iter().enumerate().rev() {
            plan.set_random_state(*key);
            plan.forward(dev).unwrap();
            let what = format!("{}: key {key}", p.name);
            assert_eq!(kept(dev, &plan, &[d1, d2]), reference[k].0, "{what}: masks");
            assert_eq!(
                dropout_bits(dev, &plan, d1),
                reference[k].1,
                "{what}: output"
            );
        }
        plan.evaluate(dev).unwrap();
        assert_eq!(
            dropout_bits(dev, &plan, d1),
            bits(&f32s(dev, m.inputs[0].1))
        );
        plan.free(dev).unwrap();
    }
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

fn dropout_bits(dev: &dyn Device, plan: &Plan, t: Tensor) -> Vec<u32> {
    bits(&f32s(dev, plan.buffer(t).unwrap()))
}

// ---------------------------------------------------------------------------------------
// MSE as the graph's loss.

/// x (8, 4) -> linear (w, b) -> mse against targets from a fixed linear map plus noise.
fn regression(dev: &dyn Device) -> (Model, Tensor) {
    let mut rng = Rng::new(25);
    let (rows, i, o) = (8, 4, 3);
    let mut m = Model::new();
    let xs: Vec<f32> = (0..rows * i).map(|_| rng.uniform(-1.0, 1.0)).collect();
    let truth: Vec<f32> = (0..i * o).map(|_| rng.uniform(-1.0, 1.0)).collect();
    let ys: Vec<f32> = (0..rows * o)
        .map(|e| {
            let (r, c) = (e / o, e % o);
            let dot: f32 = (0..i).map(|k| xs[r * i + k] * truth[k * o + c]).sum();
            dot + 0.3 + rng.uniform(-0.05, 0.05)
        })
        .collect();
    let x = m.input(dev, "x", &[rows, i], HostData::F32(xs));
    // The target in f16: MSE takes any float dtype for it.
    let y = m.input(dev, "y", &[rows, o], HostData::from_f32(DType::F16, &ys));
    let w = m.param(dev, &mut rng, "w", &[i, o], (-0.5, 0.5));
    let b = m.param(dev, &mut rng, "b", &[o], (-0.1, 0.1));
    let pred = m.g.linear(x, w, Some(b)).unwrap();
    m.g.mse(pred, y).unwrap();
    m.weight = 1.0 / rows as f32;
    (m, y)
}

#[test]
fn mse_is_a_graph_loss_that_matches_finite_differences_and_trains() {
    let dev = CpuDevice::new();
    let (m, y) = regression(&dev);
    assert_eq!(m.g.loss(), Some(Loss::Mse { target: y }));
    check_gradients(&dev, &m);
    // Adam steps; each step's loss against the mean squared error computed here in f64
    // from the parameters before the step.
    let mut plan = m.compile(&dev);
    let (xs, ys) = (f32s(&dev, m.inputs[0].1), f32s(&dev, m.inputs[1].1));
    let (rows, i, o) = (8, 4, 3);
    let mut losses = vec![];
    for step in 1..=25 {
        let (w, b) = (f32s(&dev, m.params[0].value), f32s(&dev, m.params[1].value));
        let mut want = 0f64;
        for r in 0..rows {
            for c in 0..o {
                let p: f64 = (0..i)
                    .map(|k| xs[r * i + k] as f64 * w[k * o + c] as f64)
                    .sum::<f64>()
                    + b[c] as f64;
                want += (p - ys[r * o + c] as f64).powi(2);
            }
        }
        want /= (rows * o) as f64;
        plan.accumulate(&dev, 1.0, m.weight, 0).unwrap();
        plan.check(&dev, 0.0).unwrap();
        assert!(!plan.overflowed(&dev).unwrap(), "step {step} overflowed");
        let got = plan.step_loss(&dev).unwrap();
        // f32 GEMM outputs (unit scale, ~1e-7 each) squared and averaged: 1e-5 relative.
        assert!(
            (got - want).abs() <= 1e-5 * want + 1e-7,
            "step {step}: plan loss {got}, host {want}"
        );
        losses.push(got);
        plan.update(&dev, 5e-2, step).unwrap();
    }
    // Adam at lr 0.05 on a well-conditioned least-squares problem: the loss falls
    // steadily, to well under a fifth of where it began (the noise floor is ~1e-3).
    assert!(
        losses.windows(2).all(|w| w[1] < w[0]),
        "loss did not fall every step: {losses:?}"
    );
    assert!(
        losses[losses.len() - 1] < 0.2 * losses[0],
        "loss fell only from {} to {}",
        losses[0],
        losses[losses.len() - 1]
    );
}

#[test]
fn the_graph_reports_its_loss() {
    let mut g = Graph::new();
    assert_eq!(g.loss(), None);
    let x = g.input("x", &[3, 4], DType::F32);
    let t = g.input("t", &[3], DType::U32);
    let w = g.param("w", &[4, 5], DType::F32, DType::F32, true).unwrap();
    let l = g.linear(x, w, None).unwrap();
    let losses = g.cross_entropy(l, t).unwrap();
    assert_eq!(g.loss(), Some(Loss::CrossEntropy { targets: t }));
    assert_eq!(g.losses(), Some(losses));
    assert_eq!(g.shape(losses), &[3]);
    let mut g = Graph::new();
    let x = g.input("x", &[2, 3, 4], DType::F32);
    let y = g.input("y", &[2, 3, 5], DType::BF16);
    let w = g.param("w", &[4, 5], DType::F32, DType::F32, true).unwrap();
    let p = g.linear(x, w, None).unwrap();
    let losses = g.mse(p, y).unwrap();
    assert_eq!(g.loss(), Some(Loss::Mse { target: y }));
    // One loss per row: (2, 3).
    assert_eq!(g.shape(losses), &[2, 3]);
}

#[test]
fn bad_generic_ops_are_errors_that_name_the_problem() {
    let mut g = Graph::new();
    let x = g.input("x", &[4, 3], DType::F32);
    let ids = g.input("ids", &[4, 3], DType::U32);
    let w = g.param("w", &[3, 2], DType::F32, DType::F32, true).unwrap();
    for p in [1.0f32, -0.1, f32::NAN, 2.0] {
        let e = g.dropout(x, p).unwrap_err().to_string();
        assert!(
            e.contains("dropout") && e.contains("[0, 1)") && e.contains("`x`"),
            "{e}"
        );
    }
    for e in [
        g.relu(ids),
        g.tanh(ids),
        g.silu(ids),
        g.softmax(ids),
        g.dropout(ids, 0.1),
    ] {
        let e = e.unwrap_err().to_string();
        assert!(e.contains("`ids`") && e.contains("u32"), "{e}");
    }
    let p = g.linear(x, w, None).unwrap();
    // Shapes differ.
    let e = g.mse(p, x).unwrap_err().to_string();
    assert!(
        e.contains("mse") && e.contains("[4, 2]") && e.contains("[4, 3]"),
        "{e}"
    );
    // A target that depends on a parameter would silently get no gradient.
    let q = g.linear(x, w, None).unwrap();
    let e = g.mse(p, q).unwrap_err().to_string();
    assert!(e.contains("depends on a parameter"), "{e}");
    let y = g.input("y", &[4, 2], DType::F16);
    g.mse(p, y).unwrap();
    let e = g.mse(p, y).unwrap_err().to_string();
    assert!(e.contains("already has a loss"), "{e}");
    // Kernels check their own arguments, for every backend alike.
    let cpu = CpuDevice::new();
    let (a, b) = (
        cpu.alloc(DType::F32, 6).unwrap(),
        cpu.alloc(DType::F32, 6).unwrap(),
    );
    let e = cpu
        .launch(&Kernel::Dropout(Dropout {
            x: a,
            out: b,
            p: 1.0,
            seed: 0,
        }))
        .unwrap_err()
        .to_string();
    assert!(e.contains("dropout") && e.contains("[0, 1)"), "{e}");
    let losses = cpu.alloc(DType::F16, 2).unwrap();
    let e = cpu
        .launch(&Kernel::MseLoss(MseLoss {
            pred: a,
            target: b,
            losses,
            cols: 3,
        }))
        .unwrap_err()
        .to_string();
    assert!(e.contains("mse_loss") && e.contains("losses"), "{e}");
    let e = cpu
        .launch(&Kernel::MseBackward(MseBackward {
            pred: a,
            target: b,
            dpred: cpu.alloc(DType::F32, 5).unwrap(),
            cols: 3,
            scale: 1.0,
        }))
        .unwrap_err()
        .to_string();
    assert!(e.contains("mse_backward") && e.contains("dpred"), "{e}");
}
