//! Pipeline parallelism (`engine::parallel::pipeline`): a GPT split over 2 and 3
//! devices, trained with the 1F1B schedule, against the same model on one device; an
//! overflow on one stage; a stage failing mid-step.

mod common;

use common::Shared;
use kiln::engine::kernels::NonFinite;

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use kiln::cpu::CpuDevice;
use kiln::engine::graph::Attention;
use kiln::engine::graph::{Graph, Tensor};
use kiln::engine::models::gpt::{Gpt, GptConfig};
use kiln::engine::models::llama::{Llama, LlamaConfig};
use kiln::engine::models::{Forward, Init, MicroBatch, Model, Network, NetworkOptions, ParamSpec};
use kiln::engine::parallel::pipeline::{Pipeline, StepOptions};
use kiln::engine::parallel::pipeline_partition::PartitionMethod;
use kiln::engine::train::pipeline_trainer::PipelineTrainer;
use kiln::engine::train::trainer::Trainer;
use kiln::engine::{
    Buffer, Capabilities, DType, Device, Error, HostData, Kernel, PendingDownload, Result,
};

const VOCAB: usize = 13;
const T: usize = 8;
const B: usize = 2;
const LR: f32 = 1e-2;

fn config() -> GptConfig {
    GptConfig {
        n_layer: 4,
        n_head: 2,
        n_embd: 32,
        block_size: T,
        vocab_size: VOCAB,
        padded_vocab_size: None,
    }
}

fn model() -> Arc<dyn Model> {
    Arc::new(Gpt::new(config(), T).with_attention(Attention::Straightforward))
}

/// A Llama with grouped-query attention and untied embeddings: no parameter on two
/// stages, so a pipeline is the same arithmetic as one device, step after step.
fn llama() -> Arc<dyn Model> {
    let c: LlamaConfig = serde_json::from_str(
        r#"{"n_layer": 3, "n_head": 4, "n_kv_head": 2, "n_embd": 16, "block_size": 8,
            "vocab_size": 13}"#,
    )
    .unwrap();
    Arc::new(Llama::new(c, T).with_attention(Attention::Straightforward))
}

/// The same Llama with its LM head tied to the embedding (on the first and last stage).
fn llama_tied() -> Arc<dyn Model> {
    let c: LlamaConfig = serde_json::from_str(
        r#"{"n_layer": 3, "n_head": 4, "n_kv_head": 2, "n_embd": 16, "block_size": 8,
            "vocab_size": 13, "tie_word_embeddings": true}"#,
    )
    .unwrap();
    Arc::new(Llama::new(c, T).with_attention(Attention::Straightforward))
}

fn options() -> NetworkOptions {
    options_in(DType::F32)
}

fn options_in(dtype: DType) -> NetworkOptions {
    NetworkOptions {
        batch: B,
        dtype,
        optimizer: common::adamw(),
        seed: 5,
        packed: false,
    }
}

/// `m` micro-batches of step `step`: token sequences counting up from varying starts.
fn batches(step: usize, m: usize) -> Vec<MicroBatch> {
    (0..m)
        .map(|i| {
            let start = (step * 7 + i * 3) as u32;
            let tokens: Vec<u32> = (0..B * T)
                .map(|k| (start + k as u32 * (1 + (k / T) as u32)) % VOCAB as u32)
                .collect();
            let targets: Vec<u32> = tokens.iter().map(|&t| (t + 1) % VOCAB as u32).collect();
            MicroBatch::tokens(&tokens, &targets)
        })
        .collect()
}

/// One device taking `steps` steps of `m` micro-batches: per step, the loss and the
/// masters after it.
fn one_device(dev: &dyn Device, case: &Case, m: usize) -> Vec<Stepped> {
    let mut net = Network::new(dev, (case.model)(), &options_in(case.dtype)).unwrap();
    let mut out = vec![];
    for step in 0..case.steps {
        net.accumulate(dev, &(case.data)(step, m), case.loss_scale)
            .unwrap();
        let (overflow, loss) = net.check(dev, case.clip).unwrap();
        assert!(!overflow);
        net.update(dev, LR).unwrap();
        let grad_scale = net.last_grad_scale(dev).unwrap();
        let masters = net.parameters(dev).unwrap().into_iter().map(|(_, v)| v);
        out.push((loss, grad_scale, masters.collect()));
    }
    out
}

/// A step's loss, gradient factor and masters after it.
type Stepped = (f32, f32, Vec<Vec<f32>>);

/// What an equivalence run trains.
struct Case {
    model: fn() -> Arc<dyn Model>,
    /// Step `step`'s `m` micro-batches.
    data: fn(usize, usize) -> Vec<MicroBatch>,
    steps: usize,
    /// Gradient clipping (0: none).
    clip: f32,
    /// No parameter on two stages: without clipping every step is bit-identical to
    /// one device (with it, the norm is summed per stage first: rounding apart).
    exact: bool,
    /// Storage precision, its (static) loss scale, and how close later steps must be.
    dtype: DType,
    loss_scale: f32,
    tol: f32,
}

fn step_options() -> StepOptions {
    StepOptions {
        loss_scale: 1.0,
        clip: 0.0,
        lr: LR,
    }
}

const GPT: Case = Case {
    model,
    data: batches,
    steps: 3,
    clip: 0.0,
    exact: false,
    dtype: DType::F32,
    loss_scale: 1.0,
    tol: 1e-5,
};

/// Within `tol` of `want`'s scale, as the data-parallel tests compare weights.
fn close(got: f32, want: f32, tol: f32) -> bool {
    (got - want).abs() <= tol * (1.0 + want.abs())
}

/// The attention key bias is left out of the weight comparison after the first step:
/// its true gradient is zero (softmax ignores a shift shared by a whole row of scores),
/// so Adam, dividing by the root of the second moment, takes full-size steps on
/// rounding noise alone, and two valid summation orders walk it apart (as in
/// tests/data_parallel.rs).
fn key_bias(name: &str, i: usize) -> bool {
    let c = config().n_embd;
    name.ends_with("attn.c_attn.bias") && (c..2 * c).contains(&i)
}

/// Every copy of every parameter the stages hold more than once is bit-identical.
fn assert_copies_identical(pipe: &Pipeline, what: &str) {
    for (i, h) in pipe.holders().iter().enumerate() {
        if h.len() < 2 {
            continue;
        }
        let copies = pipe.copies(i).unwrap();
        for c in &copies[1..] {
            assert_eq!(
                c.1, copies[0].1,
                "{what}: parameter {i}'s model copy differs between stage {} and {}",
                copies[0].0, c.0
            );
            let same =
                c.2.iter()
                    .zip(&copies[0].2)
                    .all(|(a, b)| a.to_bits() == b.to_bits());
            assert!(
                same,
                "{what}: parameter {i}'s master differs between stage {} and {}",
                copies[0].0, c.0
            );
        }
    }
}

/// `p` stages on `devs` against one device on `reference`, for each `m`, `steps`
/// steps: losses and weights within 1e-5 relative, tied copies bit-identical.
fn check_equivalence(
    open: &dyn Fn() -> Box<dyn Device>,
    reference: &dyn Device,
    case: &Case,
    p: usize,
    ms: &[usize],
) {
    for &m in ms {
        let want = one_device(reference, case, m);
        let devs: Vec<Box<dyn Device>> = (0..p).map(|_| open()).collect();
        let options = options_in(case.dtype);
        let mut pipe =
            Pipeline::new(devs, (case.model)(), &options, &PartitionMethod::Uniform).unwrap();
        assert_eq!(pipe.stages(), p);
        let tied = pipe.holders().iter().any(|h| h.len() > 1);
        assert_eq!(tied, !case.exact);
        if tied {
            // GPT's tied embedding: on the first and the last stage.
            assert_eq!(pipe.holders()[0], vec![0, p - 1]);
        }
        let what = format!("{p} stages, {m} micro-batches, clip {}", case.clip);
        let o = StepOptions {
            clip: case.clip,
            loss_scale: case.loss_scale,
            ..step_options()
        };
        for (step, (want_loss, want_scale, want)) in want.iter().enumerate() {
            let r = pipe.step(&(case.data)(step, m), o).unwrap();
            assert!(!r.overflow, "{what}: step {step} overflowed");
            // The first step's forward is the same arithmetic as one device's.
            let all_exact = case.exact && case.clip == 0.0;
            let exact = step == 0 || all_exact;
            assert!(
                close(r.loss, *want_loss, case.tol) && (!exact || r.loss == *want_loss),
                "{what}: step {step} loss {} vs one device {want_loss}",
                r.loss
            );
            // One factor for the whole pipeline, from a norm counting the tied
            // embedding once (counted twice, clipping would scale differently).
            assert!(
                (r.grad_scale - want_scale).abs() <= case.tol * want_scale,
                "{what}: step {step} gradient factor {} vs one device {want_scale}",
                r.grad_scale
            );
            assert_copies_identical(&pipe, &format!("{what}, step {step}"));
            let got = pipe.parameters().unwrap();
            assert_eq!(got.len(), want.len());
            for (k, ((name, g), w)) in got.iter().zip(want).enumerate() {
                // After the first step only the tied embedding may differ: its two
                // gradients are summed in another order (every lookup's rows on the
                // first stage, then the head's from the last, instead of the head's
                // first and each micro-batch's in turn). Later steps inherit that
                // rounding.
                let exact =
                    (step == 0 && pipe.holders()[k].len() == 1 && case.clip == 0.0) || all_exact;
                for (i, (&a, &b)) in g.iter().zip(w).enumerate() {
                    let ok = if exact {
                        a.to_bits() == b.to_bits()
                    } else {
                        close(a, b, case.tol) || (step > 0 && key_bias(name, i))
                    };
                    assert!(
                        ok,
                        "{what}, step {step}: `{name}`[{i}] is {a}, one device {b} \
                         (bit-identical expected: {exact})"
                    );
                }
            }
        }
        assert_eq!(pipe.steps_applied(), case.steps as u32);
    }
}

#[test]
fn two_and_three_cpu_stages_train_like_one_device() {
    let cpu = CpuDevice::new();
    let open = || -> Box<dyn Device> { Box::new(CpuDevice::new()) };
    check_equivalence(&open, &cpu, &GPT, 2, &[1, 2, 5]);
    check_equivalence(&open, &cpu, &GPT, 3, &[1, 3, 7]);
    // One stage is one device: no copies, the same arithmetic every step.
    check_equivalence(&open, &cpu, &Case { exact: true, ..GPT }, 1, &[2]);
}

#[test]
fn clipping_uses_one_norm_over_every_stage() {
    let cpu = CpuDevice::new();
    let open = || -> Box<dyn Device> { Box::new(CpuDevice::new()) };
    let clipped = Case { clip: 0.05, ..GPT };
    check_equivalence(&open, &cpu, &clipped, 3, &[3]);
    // The clip was active: the factor was below 1 at loss scale 1.
    let want = one_device(&cpu, &clipped, 3);
    assert!(
        want.iter().all(|s| s.1 < 0.9),
        "{:?}",
        want.iter().map(|s| s.1).collect::<Vec<_>>()
    );
}

#[test]
fn a_llama_pipeline_is_bit_identical_to_one_device() {
    let cpu = CpuDevice::new();
    let open = || -> Box<dyn Device> { Box::new(CpuDevice::new()) };
    let case = Case {
        model: llama,
        data: batches,
        steps: 3,
        clip: 0.0,
        exact: true,
        ..GPT
    };
    check_equivalence(&open, &cpu, &case, 3, &[4]);
    check_equivalence(&open, &cpu, &Case { clip: 0.5, ..case }, 2, &[2]);
    // Tied: as GPT, the embedding's two gradients are summed in another order.
    let tied = Case {
        model: llama_tied,
        exact: false,
        ..case
    };
    check_equivalence(&open, &cpu, &tied, 3, &[3]);
}

#[test]
fn two_and_three_vulkan_stages_train_like_one_device() {
    let reference = common::gpu("vulkan", false);
    let open = || common::gpu("vulkan", false);
    check_equivalence(&open, reference.as_ref(), &GPT, 2, &[5]);
    check_equivalence(
        &open,
        reference.as_ref(),
        &Case { steps: 2, ..GPT },
        3,
        &[3],
    );
}

/// fp16 storage (f16 activations cross the stages, f32 embedding gradients) with a
/// static loss scale: the first step as one device's but for the tied embedding, later
/// steps within the data-parallel tests' fp16 tolerance (an f16 ulp of a gradient
/// becomes ~1e-3 in the weights through Adam's normalised steps).
#[test]
fn fp16_vulkan_stages_train_like_one_device() {
    let reference = common::gpu("vulkan", false);
    let open = || common::gpu("vulkan", false);
    let fp16 = Case {
        dtype: DType::F16,
        loss_scale: 1024.0,
        tol: 2e-2,
        ..GPT
    };
    check_equivalence(&open, reference.as_ref(), &fp16, 2, &[4]);
}

#[test]
fn a_stage_holds_at_most_p_minus_s_micro_batches_whatever_m() {
    let devs: Vec<Box<dyn Device>> = (0..3)
        .map(|_| Box::new(CpuDevice::new()) as Box<dyn Device>)
        .collect();
    let mut pipe = Pipeline::new(devs, model(), &options(), &PartitionMethod::Uniform).unwrap();
    assert_eq!(pipe.slots(), vec![3, 2, 1]);
    assert_eq!(pipe.stage_blocks(), &[0..2, 2..3, 3..4]);
    // Every buffer is allocated up front: m from p to 4p allocates nothing more.
    let bytes = |pipe: &Pipeline| -> Vec<u64> {
        pipe.devices().iter().map(|d| d.allocated_bytes()).collect()
    };
    let built = bytes(&pipe);
    // As estimated without a device, stage by stage.
    let m = Pipeline::memory(model().as_ref(), &options(), &PartitionMethod::Uniform, 3).unwrap();
    let want: Vec<u64> = m.iter().map(|m| m.total()).collect();
    assert_eq!(built, want);
    assert!(m[0].activations > m[2].activations, "{m:?}");
    for (step, m) in [3, 12, 1].into_iter().enumerate() {
        let r = pipe.step(&batches(step, m), step_options()).unwrap();
        assert_eq!(bytes(&pipe), built, "after a step of {m} micro-batches");
        // Per micro-batch and boundary: the residual stream (B, T, C) f32 forward and
        // its gradient back, nothing else.
        let per = (B * T * config().n_embd * 4) as u64;
        assert_eq!(r.bytes_moved, 2 * 2 * m as u64 * per);
        assert_eq!(r.waited.len(), 3);
        assert!(
            r.waited.iter().all(|&w| (0.0..=r.seconds).contains(&w)),
            "{r:?}"
        );
    }
}

/// A device that can be told to fail every launch from its `n`-th on (as if the adapter
/// went away), or to make its next overflow check find an infinity in the first
/// gradient it checks (as if backward had overflowed).
struct Faulty {
    inner: CpuDevice,
    /// The inner device's, or a smaller memory budget.
    caps: Capabilities,
    /// Launches left before it fails; 0: it never does.
    fail_in: AtomicUsize,
    lost: AtomicBool,
    armed: AtomicBool,
}

impl Faulty {
    fn new() -> Faulty {
        let inner = CpuDevice::new();
        Faulty {
            caps: inner.caps().clone(),
            inner,
            fail_in: AtomicUsize::new(0),
            lost: AtomicBool::new(false),
            armed: AtomicBool::new(false),
        }
    }
}

impl Device for Faulty {
    fn caps(&self) -> &Capabilities {
        &self.caps
    }
    fn alloc(&self, dtype: DType, len: usize) -> Result<Buffer> {
        self.inner.alloc(dtype, len)
    }
    fn free(&self, buf: Buffer) -> Result<()> {
        self.inner.free(buf)
    }
    fn view(&self, parent: Buffer, offset: usize, len: usize) -> Result<Buffer> {
        self.inner.view(parent, offset, len)
    }
    fn upload(&self, buf: Buffer, data: &HostData) -> Result<()> {
        self.inner.upload(buf, data)
    }
    fn begin_download(&self, buf: Buffer) -> Result<PendingDownload> {
        self.inner.begin_download(buf)
    }
    fn finish_download(&self, pending: PendingDownload) -> Result<HostData> {
        self.inner.finish_download(pending)
    }
    fn launch(&self, kernel: &Kernel) -> Result<()> {
        let left = self.fail_in.load(Ordering::SeqCst);
        if left == 1 {
            self.lost.store(true, Ordering::SeqCst);
        }
        if left > 0 {
            self.fail_in.store(left - 1, Ordering::SeqCst);
        }
        if self.lost.load(Ordering::SeqCst) {
            return Err(Error::InvalidArgument(
                "simulated device loss (the adapter went away)".into(),
            ));
        }
        if let Kernel::NonFinite(NonFinite { srcs, .. }) = kernel {
            if self.armed.swap(false, Ordering::SeqCst) {
                let grad = srcs[0];
                let mut values = self.inner.download(grad)?.to_f32();
                values[0] = f32::INFINITY;
                self.inner
                    .upload(grad, &HostData::from_f32(grad.dtype, &values))?;
            }
        }
        self.inner.launch(kernel)
    }
    fn submit(&self) -> Result<()> {
        self.inner.submit()
    }
    fn wait(&self) -> Result<()> {
        self.inner.wait()
    }
    fn allocated_bytes(&self) -> u64 {
        self.inner.allocated_bytes()
    }
}

#[test]
fn an_overflow_on_one_stage_makes_every_stage_skip() {
    // The middle stage holds no tied parameter: its overflow reaches the others only
    // through the pipeline's one decision.
    let middle = Arc::new(Faulty::new());
    let devs: Vec<Box<dyn Device>> = vec![
        Box::new(CpuDevice::new()),
        Box::new(Shared(middle.clone())),
        Box::new(CpuDevice::new()),
    ];
    let mut pipe = Pipeline::new(devs, model(), &options(), &PartitionMethod::Uniform).unwrap();
    let r = pipe.step(&batches(0, 3), step_options()).unwrap();
    assert!(!r.overflow && r.sum_squares.is_finite() && r.grad_scale == 1.0);
    let before = pipe.param_states().unwrap();
    middle.armed.store(true, Ordering::SeqCst);
    let r = pipe.step(&batches(1, 3), step_options()).unwrap();
    assert!(
        !middle.armed.load(Ordering::SeqCst),
        "the poison was not used"
    );
    assert!(
        r.overflow,
        "an infinite gradient on stage 1 was not seen: {r:?}"
    );
    assert_eq!(r.grad_scale, 0.0);
    assert_eq!(pipe.steps_applied(), 1);
    // No stage updated: weights, masters and moments as they were, on every copy.
    assert_eq!(pipe.param_states().unwrap(), before);
    assert_copies_identical(&pipe, "after the skipped step");
    // The next step trains again.
    let r = pipe.step(&batches(2, 3), step_options()).unwrap();
    assert!(!r.overflow);
    assert_eq!(pipe.steps_applied(), 2);
    assert_ne!(pipe.param_states().unwrap(), before);
}

#[test]
fn a_stage_failing_mid_step_stops_every_stage_with_an_error() {
    let middle = Arc::new(Faulty::new());
    let devs: Vec<Box<dyn Device>> = vec![
        Box::new(CpuDevice::new()),
        Box::new(Shared(middle.clone())),
        Box::new(CpuDevice::new()),
    ];
    let mut pipe = Pipeline::new(devs, model(), &options(), &PartitionMethod::Uniform).unwrap();
    pipe.step(&batches(0, 5), step_options()).unwrap();
    let before = pipe.param_states().unwrap();
    // Fails once the step is under way (a micro-batch's forward and backward on the
    // middle stage take about 40 launches, a step of 5 about 200): the other stages
    // are waiting on it or have sent it work.
    middle.fail_in.store(100, Ordering::SeqCst);
    let started = Instant::now();
    let e = pipe
        .step(&batches(1, 5), step_options())
        .unwrap_err()
        .to_string();
    let took = started.elapsed();
    assert!(middle.lost.load(Ordering::SeqCst));
    assert!(
        took < Duration::from_secs(5),
        "the step took {took:?} to fail"
    );
    assert!(
        e.contains("failed on 3 of 3 stages") && e.contains("simulated device loss"),
        "{e}"
    );
    // The failing stage is named first, with its cause; the others say why they stopped.
    let first = e
        .split("stages, so no stage updated: ")
        .nth(1)
        .unwrap_or("");
    assert!(
        first.starts_with("stage 1: invalid argument: simulated device loss"),
        "{e}"
    );
    for s in [0, 2] {
        assert!(
            e.contains(&format!(
                "stage {s}: invalid argument: stopped: stage 1 stopped during the step"
            )),
            "{e}"
        );
    }
    // Nothing was updated, so a checkpoint of the last good state is what remains.
    middle.lost.store(false, Ordering::SeqCst);
    assert_eq!(pipe.param_states().unwrap(), before);
    assert_eq!(pipe.steps_applied(), 1);
}

/// An MLP whose head also reads the first hidden layer: over 3 stages that tensor
/// leaves stage 0 and reaches stage 2 through stage 1, which passes it on (and its
/// gradient back). Blocks: [w0, w1], [w2], [w3, w4]. Dropout on two stages: each
/// stage must draw the masks one device draws.
struct Skip;

impl Model for Skip {
    fn describe(&self) -> String {
        "skip MLP".into()
    }

    fn parameters(&self) -> Vec<ParamSpec> {
        let init = Init::Uniform(0.3);
        [[4, 8], [8, 8], [8, 8], [8, 3], [8, 3]]
            .iter()
            .enumerate()
            .map(|(i, s)| ParamSpec::new(format!("w{i}"), s, init).decayed())
            .collect()
    }

    fn forward(&self, g: &mut Graph, p: &[Tensor], batch: usize, dtype: DType) -> Result<Forward> {
        let x = g.input("x", &[batch, 4], dtype);
        let y = g.input("y", &[batch], DType::U32);
        let h0 = g.linear(x, p[0], None)?;
        let h0 = g.gelu(h0)?;
        let h1 = g.linear(h0, p[1], None)?;
        let h1 = g.gelu(h1)?;
        let h1 = g.dropout(h1, 0.25)?;
        let h2 = g.linear(h1, p[2], None)?;
        let h2 = g.gelu(h2)?;
        let h2 = g.dropout(h2, 0.25)?;
        let a = g.linear(h2, p[3], None)?;
        let b = g.linear(h0, p[4], None)?;
        let logits = g.add(a, b)?;
        g.cross_entropy(logits, y)?;
        Ok(Forward {
            inputs: vec![x, y],
            prediction: logits,
        })
    }

    fn blocks(&self) -> Vec<Vec<usize>> {
        vec![vec![0, 1], vec![2], vec![3, 4]]
    }
}

fn skip() -> Arc<dyn Model> {
    Arc::new(Skip)
}

/// `m` micro-batches of `B` feature rows for [`Skip`].
fn features(step: usize, m: usize) -> Vec<MicroBatch> {
    (0..m)
        .map(|i| {
            let k = (step * 5 + i) as f32;
            let x: Vec<f32> = (0..B * 4).map(|j| ((j as f32 + k) * 0.37).sin()).collect();
            let y: Vec<u32> = (0..B).map(|j| ((j + step + i) % 3) as u32).collect();
            MicroBatch::features(&x, &y)
        })
        .collect()
}

#[test]
fn a_tensor_read_two_stages_later_is_passed_on_by_the_stage_between() {
    let cpu = CpuDevice::new();
    let open = || -> Box<dyn Device> { Box::new(CpuDevice::new()) };
    let case = Case {
        model: skip,
        data: features,
        steps: 3,
        clip: 0.0,
        exact: true,
        ..GPT
    };
    check_equivalence(&open, &cpu, &case, 3, &[1, 4]);
}

#[test]
fn a_pipelined_checkpoint_resumes_on_one_device_and_on_another_cut() {
    let cpu = CpuDevice::new();
    let stages = |p: usize| -> Vec<Box<dyn Device>> {
        (0..p)
            .map(|_| Box::new(CpuDevice::new()) as Box<dyn Device>)
            .collect()
    };
    let uniform = &PartitionMethod::Uniform;
    let mut pp3 = Pipeline::new(stages(3), model(), &options(), uniform).unwrap();
    for step in 0..2 {
        pp3.step(&batches(step, 3), step_options()).unwrap();
    }
    // Whole tensors, whatever the cut: one device and a 2-stage pipeline resume them.
    let states = pp3.param_states().unwrap();
    let mut one = Network::new(&cpu, model(), &options()).unwrap();
    one.load_param_states(&cpu, &states).unwrap();
    one.set_steps_applied(2);
    let mut pp2 = Pipeline::new(stages(2), model(), &options(), uniform).unwrap();
    pp2.load_param_states(&states, 2).unwrap();
    assert_copies_identical(&pp2, "after loading");
    for step in 2..4 {
        let a = pp3.step(&batches(step, 3), step_options()).unwrap().loss;
        let c = pp2.step(&batches(step, 3), step_options()).unwrap().loss;
        one.accumulate(&cpu, &batches(step, 3), 1.0).unwrap();
        let (_, b) = one.check(&cpu, 0.0).unwrap();
        one.update(&cpu, LR).unwrap();
        // The first step after the resume starts from the same weights everywhere.
        if step == 2 {
            assert!(
                a == b && c == b,
                "step {step}: losses {a} (3 stages), {c} (2), {b} (1)"
            );
        }
        assert!(
            close(a, b, 1e-5) && close(c, b, 1e-5),
            "step {step}: {a} {c} {b}"
        );
    }
    assert_eq!(pp2.steps_applied(), 4);
    // A checkpoint of another shape is refused before anything is written.
    let mut other = states.clone();
    other[2].shape = vec![7];
    let e = pp2.load_param_states(&other, 0).unwrap_err().to_string();
    assert!(
        e.contains("`transformer.h.0.ln_1.weight` has shape [7]"),
        "{e}"
    );
    assert_eq!(pp2.steps_applied(), 4);
}

#[test]
fn a_stage_that_cannot_fit_its_device_is_refused_before_anything_is_allocated() {
    let need =
        Pipeline::memory(model().as_ref(), &options(), &PartitionMethod::Uniform, 3).unwrap();
    let mut small = Faulty::new();
    small.caps.memory_budget = Some(need[2].total() - 1);
    let small = Arc::new(small);
    let devs: Vec<Box<dyn Device>> = vec![
        Box::new(CpuDevice::new()),
        Box::new(CpuDevice::new()),
        Box::new(Shared(small.clone())),
    ];
    let e = Pipeline::new(devs, model(), &options(), &PartitionMethod::Uniform)
        .err()
        .expect("a stage over its device's budget")
        .to_string();
    assert!(
        e.contains("pipeline stage 2 of GPT-2") && e.contains("does not fit"),
        "{e}"
    );
    assert_eq!(small.allocated_bytes(), 0);
    // More stages than blocks: named, with the fix.
    let devs: Vec<Box<dyn Device>> = (0..5)
        .map(|_| Box::new(CpuDevice::new()) as Box<dyn Device>)
        .collect();
    let e = Pipeline::new(devs, model(), &options(), &PartitionMethod::Uniform)
        .err()
        .expect("5 stages for 4 blocks")
        .to_string();
    assert!(
        e.contains("5 pipeline stages for a model of 4 blocks"),
        "{e}"
    );
}

/// The trainer's config drives a pipeline as it drives one device: fp16 with DeepSpeed's
/// dynamic loss scaling (skipped steps and scale changes on the same steps), the
/// schedule's learning rate, the losses within the fp16 tolerance.
#[test]
fn a_training_config_drives_a_pipeline_like_one_device() {
    let cpu = CpuDevice::new();
    let m = 3;
    // A high first scale (2^20), so the first steps overflow and the scale comes down.
    let config = || {
        kiln::engine::config::parse(
            &format!(
                r#"{{"train_micro_batch_size_per_gpu": {B}, "gradient_accumulation_steps": {m},
                    "fp16": {{"enabled": true, "initial_scale_power": 20}},
                    "optimizer": {{"type": "AdamW", "params": {{"lr": 0.01}}}}}}"#
            ),
            1,
        )
        .unwrap()
    };
    let mut one = Trainer::new(&cpu, model(), config(), 5).unwrap();
    let devs: Vec<Box<dyn Device>> = (0..3)
        .map(|_| Box::new(CpuDevice::new()) as Box<dyn Device>)
        .collect();
    let mut pipe =
        PipelineTrainer::new(devs, model(), config(), 5, &PartitionMethod::Parameters, 3).unwrap();
    let mut skipped = 0;
    for step in 0..6 {
        let a = one.step(&cpu, &batches(step, m)).unwrap();
        let b = pipe.step(&batches(step, m)).unwrap();
        assert_eq!(
            (a.skipped, a.loss_scale, a.lr, a.applied),
            (b.skipped, b.loss_scale, b.lr, b.applied),
            "step {step}"
        );
        assert!(
            close(b.loss, a.loss, 2e-2),
            "step {step}: {} vs {}",
            b.loss,
            a.loss
        );
        skipped += usize::from(a.skipped);
    }
    // DeepSpeed's initial scale of 2^16 overflows fp16 gradients at first.
    assert!(
        skipped > 0,
        "no step was skipped: the scaler was not exercised"
    );
    let e = pipe.step(&batches(9, m + 1)).unwrap_err().to_string();
    assert!(e.contains("gradient_accumulation_steps = 3"), "{e}");
}

#[test]
fn a_bad_micro_batch_is_refused_before_any_stage_runs() {
    let devs: Vec<Box<dyn Device>> = (0..2)
        .map(|_| Box::new(CpuDevice::new()) as Box<dyn Device>)
        .collect();
    let mut pipe = Pipeline::new(devs, model(), &options(), &PartitionMethod::Uniform).unwrap();
    let before = pipe.param_states().unwrap();
    let mut bad = batches(0, 3);
    let mut tokens = vec![1u32; B * T];
    tokens[5] = VOCAB as u32;
    bad[1] = MicroBatch::tokens(&tokens, &tokens.iter().map(|_| 0).collect::<Vec<_>>());
    let e = pipe.step(&bad, step_options()).unwrap_err().to_string();
    assert!(
        e.contains("pipeline stage 0, micro-batch 1")
            && e.contains("token 13 at position 5 of `tokens` is outside the vocabulary of 13"),
        "{e}"
    );
    let short = vec![MicroBatch::tokens(&[1, 2], &[2, 3])];
    let e = pipe.step(&short, step_options()).unwrap_err().to_string();
    assert!(
        e.contains("`tokens` of a micro-batch holds 16 values"),
        "{e}"
    );
    let e = pipe.step(&[], step_options()).unwrap_err().to_string();
    assert!(e.contains("at least one stage and one micro-batch"), "{e}");
    assert_eq!(pipe.param_states().unwrap(), before);
    assert_eq!(pipe.steps_applied(), 0);
    // The pipeline still trains after refusing them.
    pipe.step(&batches(0, 3), step_options()).unwrap();
    assert_eq!(pipe.steps_applied(), 1);
}

/// `kiln estimate --pipeline-stages` prints each stage's blocks and device bytes as
/// `Pipeline::new` allocates them (`Pipeline::memory`, itself equal to the allocator),
/// and refuses a stage count that does not divide the devices or a stray partition.
#[test]
fn kiln_estimate_prints_the_memory_of_each_stage() {
    let dir = std::env::temp_dir().join(format!("kiln-pipe-estimate-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("model.json");
    std::fs::write(
        &path,
        r#"{"n_layer": 5, "n_head": 4, "n_embd": 128, "block_size": 32, "vocab_size": 4096}"#,
    )
    .unwrap();
    let model_arg = path.to_str().unwrap();
    let run = |args: &[&str]| {
        std::process::Command::new(env!("CARGO_BIN_EXE_kiln"))
            .args(["estimate", "--model", model_arg])
            .args(args)
            .output()
            .expect("run kiln")
    };
    let out = run(&[
        "--devices",
        "4",
        "--pipeline-stages",
        "2",
        "--partition",
        "uniform",
    ]);
    let text = String::from_utf8_lossy(&out.stdout).to_string();
    assert!(
        out.status.success(),
        "{text}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        text.contains("2 pipeline stage(s) x 2 data-parallel replica(s)"),
        "{text}"
    );
    // The defaults of `kiln estimate` without a config: micro-batch 1, fp16.
    let gpt = Gpt::new(
        GptConfig {
            n_layer: 5,
            n_head: 4,
            n_embd: 128,
            block_size: 32,
            vocab_size: 4096,
            padded_vocab_size: None,
        },
        32,
    );
    let options = NetworkOptions {
        batch: 1,
        dtype: DType::F16,
        optimizer: kiln::engine::Optimizer::adamw(1e-3, 0.0),
        seed: 0,
        packed: false,
    };
    let want = Pipeline::memory(&gpt, &options, &PartitionMethod::Uniform, 2).unwrap();
    let mib = |b: u64| format!("{:.1} MiB", b as f64 / (1u64 << 20) as f64);
    // Uniform: 3 blocks then 2; the first stage keeps 2 micro-batches, the last 1.
    for (s, (blocks, flight)) in [("0..3", 2), ("3..5", 1)].into_iter().enumerate() {
        let row = text
            .lines()
            .find(|l| l.starts_with(&format!("{s} ")))
            .unwrap_or_else(|| panic!("no row for stage {s}: {text}"));
        let m = &want[s];
        for cell in [
            blocks.to_string(),
            mib(m.weights),
            mib(m.gradients),
            mib(m.optimizer),
            mib(m.activations),
            mib(m.total()),
            format!("{flight} micro-batch(es)"),
        ] {
            assert!(
                row.contains(&cell),
                "stage {s}: {cell:?} missing from {row:?}"
            );
        }
    }
    // The tied embedding (4096 x 128) is on both ends: the last stage holds more than
    // its two blocks' weights.
    assert!(want[1].weights > want[0].weights / 2, "{want:?}");
    let out = run(&["--devices", "3", "--pipeline-stages", "2"]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && err.contains("do not divide the 3 device(s)"),
        "{err}"
    );
    let out = run(&["--partition", "uniform"]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && err.contains("--pipeline-stages 2 or more"),
        "{err}"
    );
    let out = run(&[
        "--devices",
        "2",
        "--pipeline-stages",
        "2",
        "--partition",
        "4,4",
    ]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && err.contains("adding up to the model's 5 blocks"),
        "{err}"
    );
    let out = run(&[
        "--devices",
        "2",
        "--pipeline-stages",
        "2",
        "--partition",
        "half",
    ]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && err.contains("`uniform`, `parameters`"),
        "{err}"
    );
    std::fs::remove_dir_all(&dir).ok();
}

/// `kiln bench pipeline` on lavapipe: one row per (stages, m) with the schedule's
/// bubble, a measured bubble that is a share of the step, bytes moved only between
/// stages, and each stage's memory; bad arguments refused before anything runs.
#[test]
fn kiln_bench_pipeline_measures_stages_and_micro_batch_counts() {
    let dir = std::env::temp_dir().join(format!("kiln-pipe-bench-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let model = dir.join("model.json");
    std::fs::write(
        &model,
        r#"{"n_layer": 4, "n_head": 2, "n_embd": 32, "block_size": 8, "vocab_size": 13}"#,
    )
    .unwrap();
    let json = dir.join("rows.json");
    let run = |args: &[&str]| {
        std::process::Command::new(env!("CARGO_BIN_EXE_kiln"))
            .args(["bench", "pipeline", "--model", model.to_str().unwrap()])
            .args(["--micro-batch", "2", "--steps", "1"])
            .args(args)
            .output()
            .expect("run kiln")
    };
    let out = run(&["--stages", "1,2", "--json", json.to_str().unwrap()]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{err}");
    assert!(err.contains("m = 2 < 4p = 8"), "the m < 4p warning: {err}");
    let rows: Vec<serde_json::Value> =
        serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    // Default m: p and 4p for each p.
    let pm: Vec<(u64, u64)> = rows
        .iter()
        .map(|r| {
            (
                r["stages"].as_u64().unwrap(),
                r["micro_batches"].as_u64().unwrap(),
            )
        })
        .collect();
    assert_eq!(pm, [(1, 1), (1, 4), (2, 2), (2, 8)]);
    for r in &rows {
        let (p, m) = (
            r["stages"].as_f64().unwrap(),
            r["micro_batches"].as_f64().unwrap(),
        );
        assert_eq!(
            r["bubble_theory"].as_f64().unwrap(),
            (p - 1.0) / (m + p - 1.0)
        );
        let measured = r["bubble_measured"].as_f64().unwrap();
        assert!((0.0..1.0).contains(&measured), "{r}");
        assert_eq!(r["stage_mib"].as_array().unwrap().len(), p as usize);
        // One stage sends nothing; two send each micro-batch's activations (2 x 8 x 32
        // f32) forward and their gradients back.
        let want = if p == 1.0 {
            0.0
        } else {
            m * 2.0 * 2048.0 / 1e6
        };
        assert!(
            (r["mb_moved"].as_f64().unwrap() - want).abs() < 1e-12,
            "{r}"
        );
        assert!(r["tokens_per_s"].as_f64().unwrap() > 0.0);
        // The modelled box: the boundary's bytes from the shapes are what the run
        // moved; the model's step covers each stage's measured compute.
        assert_eq!(r["boundary_bytes"].as_f64().unwrap(), 2048.0, "{r}");
        let compute: Vec<f64> = r["compute_ms"]
            .as_array()
            .unwrap()
            .iter()
            .map(|c| c.as_f64().unwrap())
            .collect();
        assert_eq!(compute.len(), p as usize, "{r}");
        assert!(compute.iter().all(|&c| c > 0.0), "{r}");
        let step = r["model_step_ms"].as_f64().unwrap();
        let slowest = compute.iter().copied().fold(0.0, f64::max);
        assert!(step >= m * slowest * (1.0 - 1e-9), "{r}");
        let (bubble, exposed) = (
            r["model_bubble"].as_f64().unwrap(),
            r["model_exposed_transfer"].as_f64().unwrap(),
        );
        if p == 1.0 {
            assert_eq!((bubble, exposed), (0.0, 0.0), "{r}");
        } else {
            // Copies of 2 KB over 25 GB/s links cost microseconds, compute milliseconds.
            assert!((0.0..0.2).contains(&exposed) && exposed > 0.0, "{r}");
            assert!(bubble >= exposed, "{r}");
        }
    }
    let out = String::from_utf8_lossy(&out.stdout).to_string();
    assert!(
        out.contains("model step ms") && out.contains("25 GB/s links"),
        "{out}"
    );
    let out = run(&["--stages", "1", "--link-gbps", "0"]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && err.contains("--link-gbps 0"),
        "{err}"
    );
    let out = run(&["--stages", "1", "--gpu-speedup", "0"]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && err.contains("--gpu-speedup 0"),
        "{err}"
    );
    let out = run(&["--stages", "8"]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && err.contains("has 4 blocks"),
        "{err}"
    );
    let out = run(&["--stages", "0"]);
    assert!(String::from_utf8_lossy(&out.stderr).contains("stage counts of 1 or more"));
    std::fs::remove_dir_all(&dir).ok();
}
