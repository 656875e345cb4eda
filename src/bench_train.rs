//! `kiln bench train`: what a training step of a named model size costs on each
//! adapter and precision — tokens/s, step time, MFU, device memory — beside the step's
//! GEMM-bound time: the sum over the step's GEMM launches of FLOPs ÷ the GFLOP/s the
//! same GEMM reaches alone, measured in the same run. Their ratio says how much of the
//! step is spent outside the GEMMs (1.0: nothing).

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use serde::Serialize;

use kiln_engine::device::KernelTiming;
use kiln_engine::models::{MicroBatch, ModelConfig};
use kiln_engine::train::trainer::Trainer;
use kiln_engine::{
    Buffer, Capabilities, DType, Device, HostData, Kernel, PendingDownload, Result as KResult,
};

/// The model sizes `--model` names, beside a model JSON file.
pub const MODELS: [&str; 4] = ["small", "demo", "gpt2", "smollm2-135m"];

/// A model to measure: its sizes and the micro-batch it trains with.
#[derive(Clone, Debug)]
pub struct BenchModel {
    pub name: String,
    pub config: ModelConfig,
    pub micro_batch: usize,
}

/// `small`: the 5.29M GPT of issue 14 (micro-batch 8); `demo`: the addition demo
/// (micro-batch 64, its config's); `gpt2`: GPT-2 small, 124M, at T 1024 (micro-batch
/// 1); anything else is read as a model JSON file (micro-batch 8). `micro_batch`
/// overrides the model's own.
pub fn bench_model(name: &str, micro_batch: Option<usize>) -> Result<BenchModel> {
    let (json, micro) = match name {
        "small" => (
            r#"{"n_layer": 4, "n_head": 4, "n_embd": 256, "block_size": 128, "vocab_size": 4096}"#
                .to_string(),
            8,
        ),
        "demo" => (
            r#"{"n_layer": 2, "n_head": 4, "n_embd": 64, "block_size": 9, "vocab_size": 13}"#
                .to_string(),
            64,
        ),
        "gpt2" => (
            r#"{"n_layer": 12, "n_head": 12, "n_embd": 768, "block_size": 1024, "vocab_size": 50257}"#
                .to_string(),
            1,
        ),
        // SmolLM2-135M's shapes (its Hugging Face config.json) at T 128: the workload
        // public training benchmarks compare engines on.
        "smollm2-135m" => (
            r#"{"architecture": "llama", "n_layer": 30, "n_head": 9, "n_kv_head": 3,
                "n_embd": 576, "intermediate_size": 1536, "block_size": 128,
                "vocab_size": 49152, "rope_theta": 100000.0, "rms_norm_eps": 1e-5,
                "tie_word_embeddings": true}"#
                .to_string(),
            1,
        ),
        path if std::path::Path::new(path).is_file() => (
            std::fs::read_to_string(path).with_context(|| format!("reading {path}"))?,
            8,
        ),
        other => bail!(
            "unknown model `{other}`: give one of {} or the path of a model JSON file \
             (e.g. demos/addition.model.json)",
            MODELS.join(", ")
        ),
    };
    let config = ModelConfig::parse(&json).map_err(|e| anyhow::anyhow!("model `{name}`: {e}"))?;
    let micro_batch = micro_batch.unwrap_or(micro);
    if micro_batch == 0 {
        bail!("--micro-batch 0: a step needs at least one sequence");
    }
    Ok(BenchModel {
        name: name.to_string(),
        config,
        micro_batch,
    })
}

/// The precisions `--precision` takes, as DeepSpeed config fragments.
pub fn precision_config(p: &str) -> Result<&'static str> {
    Ok(match p {
        "fp32" => "",
        "fp16" => r#", "fp16": {"enabled": true}"#,
        "bf16" => r#", "bf16": {"enabled": true}"#,
        other => bail!("unknown precision `{other}`: give fp32, fp16 or bf16 (comma-separated)"),
    })
}

/// One measured (model, adapter, precision).
#[derive(Clone, Debug, Serialize)]
pub struct TrainBenchRow {
    pub model: String,
    pub parameters: usize,
    pub adapter: String,
    pub backend: String,
    pub precision: String,
    /// `full`, `ckpt`, `lora` or `lora+ckpt` ([`Variant`]).
    pub variant: String,
    /// Elements trained (the adapters' under LoRA).
    pub trained: usize,
    pub micro_batch: usize,
    pub seq: usize,
    /// The warm-up step, compiling included.
    pub first_step_s: f64,
    /// Mean over the timed steps.
    pub step_ms: f64,
    pub tokens_per_s: f64,
    /// FLOPs of one step's launches (see `engine::device::cost`).
    pub step_gflop: f64,
    pub achieved_gflops: f64,
    /// The adapter's peak (`--peak-tflops` or `kiln bench peak`'s cache), if known.
    pub peak_gflops: Option<f64>,
    pub mfu: Option<f64>,
    /// Device memory this measurement holds after a step: model states and the step's
    /// buffers.
    pub memory_bytes: u64,
    pub gemm_launches: usize,
    /// Distinct GEMMs (shape, layout, dtypes, epilogue), each timed once.
    pub gemm_shapes: usize,
    /// Σ over the step's GEMM launches of FLOPs ÷ that GEMM's measured GFLOP/s.
    pub gemm_bound_ms: f64,
    /// step_ms ÷ gemm_bound_ms: 1.0 would be a step that is all GEMM.
    pub step_over_gemm: f64,
}

/// A device that records the launches passing through it, so the bench learns a
/// step's GEMMs as the trainer issues them.
struct Recorder<'a> {
    inner: &'a dyn Device,
    launches: Mutex<Option<Vec<Kernel>>>,
}

impl Recorder<'_> {
    fn record(&self, on: bool) -> Vec<Kernel> {
        let mut l = self.launches.lock().unwrap_or_else(|e| e.into_inner());
        std::mem::replace(&mut *l, on.then(Vec::new)).unwrap_or_default()
    }
}

impl Device for Recorder<'_> {
    fn caps(&self) -> &Capabilities {
        self.inner.caps()
    }
    fn alloc(&self, dtype: DType, len: usize) -> KResult<Buffer> {
        self.inner.alloc(dtype, len)
    }
    fn free(&self, buf: Buffer) -> KResult<()> {
        self.inner.free(buf)
    }
    fn view(&self, parent: Buffer, offset: usize, len: usize) -> KResult<Buffer> {
        self.inner.view(parent, offset, len)
    }
    fn upload(&self, buf: Buffer, data: &HostData) -> KResult<()> {
        self.inner.upload(buf, data)
    }
    fn download(&self, buf: Buffer) -> KResult<HostData> {
        self.inner.download(buf)
    }
    fn begin_download(&self, buf: Buffer) -> KResult<PendingDownload> {
        self.inner.begin_download(buf)
    }
    fn finish_download(&self, pending: PendingDownload) -> KResult<HostData> {
        self.inner.finish_download(pending)
    }
    fn launch(&self, kernel: &Kernel) -> KResult<()> {
        if let Some(l) = self
            .launches
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .as_mut()
        {
            l.push(kernel.clone());
        }
        self.inner.launch(kernel)
    }
    fn submit(&self) -> KResult<()> {
        self.inner.submit()
    }
    fn wait(&self) -> KResult<()> {
        self.inner.wait()
    }
    fn allocated_bytes(&self) -> u64 {
        self.inner.allocated_bytes()
    }
    fn prepare(&self, kernels: &[Kernel]) -> KResult<()> {
        self.inner.prepare(kernels)
    }
    fn profile_begin(&self) -> KResult<()> {
        self.inner.profile_begin()
    }
    fn profile_end(&self) -> KResult<Vec<KernelTiming>> {
        self.inner.profile_end()
    }
}

/// What sets one GEMM's speed apart from another's: everything but its buffers'
/// identities and its scalars.
fn gemm_key(k: &Kernel) -> Option<String> {
    let Kernel::Matmul(mm) = k else { return None };
    Some(format!(
        "{} a{} b{} c{} beta{} bias{} gelu{} f32c{}",
        k.cost().label,
        mm.a.dtype,
        mm.b.dtype,
        mm.c.dtype,
        mm.beta != 0.0,
        mm.bias.is_some(),
        mm.gelu,
        mm.c_f32.is_some()
    ))
}

/// Seconds one launch of `kernel` takes on `dev` on its own operands (fresh buffers of
/// the same dtypes and sizes), timed as `kiln bench matmul` times a GEMM: a warm-up
/// run, then runs for about `budget`. Each run records enough launches to take ~20 ms
/// before it submits and waits, so a small GEMM is not measured as submission overhead
/// (a step submits its launches together too).
pub fn launch_seconds(dev: &dyn Device, kernel: &Kernel, budget: Duration) -> Result<f64> {
    let mut k = kernel.clone();
    let mut fresh: HashMap<u64, Buffer> = HashMap::new();
    for b in kernel.buffers() {
        if let std::collections::hash_map::Entry::Vacant(e) = fresh.entry(b.id) {
            let nb = dev.alloc(b.dtype, b.len)?;
            let v: Vec<f32> = (0..b.len).map(|i| ((i % 17) as f32 - 8.0) / 16.0).collect();
            dev.upload(nb, &HostData::from_f32(b.dtype, &v))?;
            e.insert(nb);
        }
    }
    for b in k.buffers_mut() {
        *b = fresh[&b.id];
    }
    let run = |reps: usize| -> Result<()> {
        for _ in 0..reps {
            dev.launch(&k)?;
        }
        dev.submit()?;
        dev.wait()?;
        Ok(())
    };
    let result = (|| {
        run(1)?; // compiles
        let t = Instant::now();
        run(1)?;
        let one = t.elapsed().as_secs_f64().max(1e-6);
        let reps = ((0.02 / one).ceil() as usize).clamp(1, 64);
        let secs = crate::bench::time_it(budget, 2, || run(reps))?;
        Ok(secs / reps as f64)
    })();
    for b in fresh.into_values() {
        dev.free(b)?;
    }
    result
}

/// How a model is trained in a measured row: every weight (`full`) or LoRA adapters on
/// the frozen model (`lora`), each with or without activation checkpointing (`+ckpt`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Variant {
    pub lora: bool,
    pub checkpointing: bool,
}

impl Variant {
    /// `full`, `ckpt` (full with checkpointing), `lora`, `lora+ckpt`.
    pub fn parse(text: &str) -> Result<Variant> {
        Ok(match text.trim() {
            "full" => Variant {
                lora: false,
                checkpointing: false,
            },
            "ckpt" | "full+ckpt" => Variant {
                lora: false,
                checkpointing: true,
            },
            "lora" => Variant {
                lora: true,
                checkpointing: false,
            },
            "lora+ckpt" => Variant {
                lora: true,
                checkpointing: true,
            },
            other => bail!(
                "unknown variant `{other}`: give full, ckpt (activation checkpointing), lora \
                 or lora+ckpt (comma-separated)"
            ),
        })
    }

    pub fn name(&self) -> &'static str {
        match (self.lora, self.checkpointing) {
            (false, false) => "full",
            (false, true) => "ckpt",
            (true, false) => "lora",
            (true, true) => "lora+ckpt",
        }
    }
}

/// The variants `--variants` names, in order, each followed by its checkpointed twin
/// when `checkpointing` (`--activation-checkpointing`: full, then ckpt; lora, then
/// lora+ckpt), each measured once.
pub fn variants(names: &[String], checkpointing: bool) -> Result<Vec<Variant>> {
    let mut out = vec![];
    for name in names {
        let v = Variant::parse(name)?;
        let mut these = vec![v];
        if checkpointing {
            these.push(Variant {
                checkpointing: true,
                ..v
            });
        }
        for v in these {
            if !out.contains(&v) {
                out.push(v);
            }
        }
    }
    Ok(out)
}

/// Options of one `kiln bench train` run.
pub struct TrainBenchOptions {
    /// How the model trains (`full` unless `--variants` says others).
    pub variant: Variant,
    /// The adapters of a LoRA variant (`--lora`, default r 16, alpha 32, all-linear).
    pub lora: kiln_engine::models::lora::LoraConfig,
    pub steps: usize,
    pub gemm_budget: Duration,
    /// Peak TFLOP/s per device for the MFU; else `kiln bench peak`'s cache.
    pub peak_tflops: Option<f64>,
}

/// Measures `model` at `precision` on `dev`: one warm-up step (compiling, and
/// recording the step's launches), `steps` timed steps, then each distinct GEMM of the
/// step alone.
pub fn measure(
    dev: &dyn Device,
    model: &BenchModel,
    precision: &str,
    opts: &TrainBenchOptions,
) -> Result<TrainBenchRow> {
    if opts.steps == 0 {
        bail!("--steps 0: give at least one timed step");
    }
    let caps = dev.caps().clone();
    let seq = model.config.block_size();
    let vocab = model.config.vocab_size();
    let mut ds = kiln_engine::config::parse(
        &format!(
            r#"{{"train_micro_batch_size_per_gpu": {}, "optimizer": {{"type": "AdamW",
                 "params": {{"lr": 1e-4}}}}{}}}"#,
            model.micro_batch,
            precision_config(precision)?
        ),
        1,
    )?;
    if opts.variant.checkpointing {
        ds.activation_checkpointing = Some(1);
    }
    let mut net = model.config.build(seq);
    if opts.variant.lora {
        net = Arc::new(kiln_engine::models::lora::Lora::new(
            net,
            opts.lora.clone(),
        )?);
    }
    let parameters = match &model.config {
        ModelConfig::Gpt2(c) => c.parameter_count(),
        ModelConfig::Llama(c) => c.checked_parameter_count().unwrap_or(0),
    };
    // What this measurement allocates (earlier ones on the device may hold caches).
    let before = dev.allocated_bytes();
    let rec = Recorder {
        inner: dev,
        launches: Mutex::new(None),
    };
    let devs: Vec<&dyn Device> = vec![&rec];
    let mut trainer = Trainer::new_group(&devs, Arc::clone(&net), ds, 1)
        .with_context(|| format!("{} on {} at {precision}", model.name, caps.name))?;
    // Random tokens below the vocabulary, fixed: the speed does not depend on them.
    let n = model.micro_batch * seq;
    let tokens: Vec<u32> = (0..n)
        .map(|i| ((i as u64 * 2_654_435_761) % vocab as u64) as u32)
        .collect();
    let targets: Vec<u32> = tokens.iter().map(|t| (t + 1) % vocab as u32).collect();
    let micro = vec![vec![MicroBatch::tokens(&tokens, &targets)]];

    rec.record(true);
    let t0 = Instant::now();
    trainer.step_group(&devs, &micro)?;
    let first_step_s = t0.elapsed().as_secs_f64();
    let trained = trainer.model.parameter_count();
    let launches = rec.record(false);
    let memory_bytes = dev.allocated_bytes().saturating_sub(before);

    let t1 = Instant::now();
    for _ in 0..opts.steps {
        trainer.step_group(&devs, &micro)?;
    }
    let step_s = t1.elapsed().as_secs_f64() / opts.steps as f64;
    drop(trainer);

    let step_flops: f64 = launches.iter().map(|k| k.cost().flops).sum();
    let mut seconds: HashMap<String, f64> = HashMap::new();
    let (mut gemm_s, mut gemm_launches) = (0.0, 0);
    for k in &launches {
        let Some(key) = gemm_key(k) else { continue };
        let secs = match seconds.get(&key) {
            Some(&s) => s,
            None => {
                let s = launch_seconds(dev, k, opts.gemm_budget)
                    .with_context(|| format!("timing {}", k.cost().label))?;
                seconds.insert(key, s);
                s
            }
        };
        // FLOPs ÷ (FLOPs ÷ seconds): the launch's measured time.
        let flops = k.cost().flops;
        gemm_s += flops / (flops / secs);
        gemm_launches += 1;
    }
    let peak_gflops = opts
        .peak_tflops
        .map(|t| t * 1e3)
        .or_else(|| crate::profile::cached_peak(&caps).map(|p| p.gflops));
    let achieved_gflops = step_flops / step_s / 1e9;
    Ok(TrainBenchRow {
        model: model.name.clone(),
        parameters,
        adapter: caps.name.clone(),
        backend: caps.backend.clone(),
        precision: precision.to_string(),
        variant: opts.variant.name().to_string(),
        trained,
        micro_batch: model.micro_batch,
        seq,
        first_step_s,
        step_ms: step_s * 1e3,
        tokens_per_s: n as f64 / step_s,
        step_gflop: step_flops / 1e9,
        achieved_gflops,
        peak_gflops,
        mfu: peak_gflops.map(|p| achieved_gflops / p),
        memory_bytes,
        gemm_launches,
        gemm_shapes: seconds.len(),
        gemm_bound_ms: gemm_s * 1e3,
        step_over_gemm: if gemm_s > 0.0 {
            step_s / gemm_s
        } else {
            f64::NAN
        },
    })
}

/// Formats rows as an aligned text table.
pub fn format_table(rows: &[TrainBenchRow]) -> String {
    let header = [
        "model",
        "adapter",
        "precision",
        "variant",
        "batch",
        "first s",
        "step ms",
        "tokens/s",
        "GFLOP/s",
        "MFU",
        "MiB",
        "GEMMs",
        "GEMM-bound ms",
        "step/GEMM",
    ];
    let mut table: Vec<Vec<String>> = vec![header.iter().map(|h| h.to_string()).collect()];
    for r in rows {
        table.push(vec![
            r.model.clone(),
            format!("{} ({})", r.adapter, r.backend),
            r.precision.clone(),
            r.variant.clone(),
            format!("{}x{}", r.micro_batch, r.seq),
            format!("{:.1}", r.first_step_s),
            format!("{:.1}", r.step_ms),
            format!("{:.0}", r.tokens_per_s),
            format!("{:.2}", r.achieved_gflops),
            r.mfu.map_or("-".into(), |m| format!("{:.1}%", 100.0 * m)),
            format!("{:.1}", r.memory_bytes as f64 / (1u64 << 20) as f64),
            format!("{}/{}", r.gemm_launches, r.gemm_shapes),
            format!("{:.1}", r.gemm_bound_ms),
            format!("{:.2}x", r.step_over_gemm),
        ]);
    }
    crate::bench::align(&table)
}
