//! The `kiln` command line.

use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use anyhow::{bail, Context, Result};
use clap::{Parser, Subcommand};

use kiln::engine::Device;

// println! and print! for a command's output: a reader that went away (`kiln runs |
// head -1`) only means nobody wants the rest, not a panic (exit 101); any other failed
// write (a full disk behind `> file`) is the command's error.
macro_rules! outln {
    ($($arg:tt)*) => {{
        use std::io::Write as _;
        written(writeln!(std::io::stdout().lock(), $($arg)*))?
    }};
}
macro_rules! out {
    ($($arg:tt)*) => {{
        use std::io::Write as _;
        written(write!(std::io::stdout().lock(), $($arg)*))?
    }};
}
// eprintln! for progress and diagnostics, which must never panic or stop the work.
macro_rules! errln {
    ($($arg:tt)*) => {{
        use std::io::Write as _;
        let _ = writeln!(std::io::stderr().lock(), $($arg)*);
    }};
}

/// The result of writing a command's output; see `outln!`.
fn written(r: std::io::Result<()>) -> Result<()> {
    match r {
        Err(e) if e.kind() != std::io::ErrorKind::BrokenPipe => {
            Err(anyhow::Error::new(e).context("writing the output"))
        }
        _ => Ok(()),
    }
}

#[derive(Parser)]
#[command(name = "kiln", version, about = "Mixed-precision training on any GPU")]
struct Cli {
    #[command(subcommand)]
    command: Command,
    /// Keep the planner's table of GEMM blocks on CPU-class adapters (lavapipe)
    /// instead of timing candidates at each shape's first use (KILN_GEMM_TUNE=0).
    #[arg(long, global = true)]
    no_tune: bool,
}

#[derive(Subcommand)]
enum Command {
    /// List compute adapters and what they can do.
    Devices {
        /// Print JSON (one object per adapter) instead of a table.
        #[arg(long)]
        json: bool,
    },
    /// Train a GPT from a DeepSpeed config (no arguments: the built-in addition demo).
    Train(TrainArgs),
    /// Continue a prompt with a trained model, streaming the text to stdout.
    Sample(SampleArgs),
    /// Loss and perplexity of a trained model on held-out data or a token file.
    Eval(EvalArgs),
    /// Check or explain a DeepSpeed config file.
    Config {
        #[command(subcommand)]
        what: ConfigWhat,
    },
    /// Turn a text file into a `.bin` token file (u16 tokens, with a `.json` sidecar).
    Prepare {
        /// The text file (UTF-8 for the GPT-2 tokenizer).
        input: PathBuf,
        /// The token file to write; its name must end in `.bin` (`kiln train` reads any
        /// other file as text), and it must not be the input.
        output: PathBuf,
        /// `gpt2` (GPT-2's BPE, vocab 50257) or `bytes` (vocab 256).
        #[arg(long, default_value = "gpt2")]
        tokenizer: String,
    },
    /// List training runs, or compare two.
    Runs {
        #[command(subcommand)]
        what: Option<RunsWhat>,
        /// Directory holding the runs.
        #[arg(long, default_value = "runs")]
        root: PathBuf,
    },
    /// Per-device memory of a GPT for ZeRO stages 0-3, before training.
    Estimate {
        /// GPT sizes as JSON {n_layer, n_head, n_embd, block_size, vocab_size}.
        #[arg(long)]
        model: PathBuf,
        /// A device count, or device specs (`vulkan:0x2`, `all`) to check against.
        #[arg(long, value_delimiter = ',', default_value = "1")]
        devices: Vec<String>,
        /// DeepSpeed config for the micro-batch and precision; default: micro-batch 1, fp16.
        #[arg(long)]
        config: Option<PathBuf>,
        /// Sequence length; default: the model's block_size.
        #[arg(long)]
        seq: Option<usize>,
        /// Per-stage memory of a pipeline of this many stages (the devices split into
        /// stages x data-parallel replicas) instead of the ZeRO table [default: the
        /// config's pipeline.stages or kiln.pipeline_stages, else 1].
        #[arg(long)]
        pipeline_stages: Option<usize>,
        /// How the blocks are cut into stages: `parameters` (balance parameter counts,
        /// DeepSpeed's default), `uniform` (blocks), or blocks per stage (`3,5`)
        /// [default: the config's pipeline.partition, else parameters].
        #[arg(long)]
        partition: Option<String>,
    },
    /// Measure kernel throughput.
    Bench {
        #[command(subcommand)]
        what: BenchWhat,
    },
}

#[derive(clap::Args)]
struct TrainArgs {
    /// DeepSpeed config (`ds_config.json`); default: demos/addition.ds_config.json.
    #[arg(long)]
    config: Option<PathBuf>,
    /// GPT sizes as JSON {n_layer, n_head, n_embd, block_size, vocab_size}; default:
    /// demos/addition.model.json (vocab_size taken from the data).
    #[arg(long)]
    model: Option<PathBuf>,
    /// Training data: a `.bin` token file from `kiln prepare`, or any other file as
    /// bytes (refused if a token-file sidecar says it holds tokens); default: built-in
    /// 2-digit addition problems.
    #[arg(long)]
    data: Option<PathBuf>,
    /// Device to train on (`kiln devices` lists them); default: the config's
    /// kiln.devices, else the best adapter.
    #[arg(long, value_delimiter = ',')]
    devices: Vec<String>,
    /// Run directory; default: runs/<UTC date and time>.
    #[arg(long)]
    out: Option<PathBuf>,
    /// Total optimizer steps, at least 1; default: a resumed run's own, else kiln.steps,
    /// else the scheduler's total_num_steps, else 1000.
    #[arg(long)]
    steps: Option<u64>,
    /// Evaluate on held-out data every N steps, 0: only at the end [default: a resumed
    /// run's own, else kiln.eval_every, else 50].
    #[arg(long)]
    eval_every: Option<u64>,
    /// Checkpoint every N steps, 0: only at the end [default: a resumed run's own, else
    /// kiln.checkpoint_every, else 200].
    #[arg(long)]
    checkpoint_every: Option<u64>,
    /// Checkpoints to keep, 0: all [default: a resumed run's own, else
    /// kiln.keep_checkpoints, else 3].
    #[arg(long)]
    keep_checkpoints: Option<usize>,
    /// Continue the run in --out from its latest checkpoint.
    #[arg(long)]
    resume: bool,
    /// Start from these weights, with a fresh optimizer: a Kiln run directory (its
    /// latest checkpoint) or checkpoint directory, a Hugging Face GPT-2 directory or
    /// model.safetensors (config.json beside it), or an llm.c .bin. The model's sizes
    /// come from it (a --model must agree; only its block_size may be smaller).
    #[arg(long, value_name = "PATH")]
    init_from: Option<PathBuf>,
    /// Seed of the weights and the data order [default: a resumed run's own, else
    /// kiln.seed, else 1].
    #[arg(long)]
    seed: Option<u64>,
    /// Profile N steps after the first (which compiles the kernels): a Chrome/Perfetto
    /// trace.json and profile.txt in the run directory, and a table of where each
    /// step's time went, kernel by kernel.
    #[arg(long, value_name = "STEPS", num_args = 0..=1, default_missing_value = "3")]
    profile: Option<u64>,
    /// One device's peak TFLOP/s for the profile's MFU [default: `kiln bench peak`'s
    /// cached measure of the adapter].
    #[arg(long, value_name = "TFLOPS")]
    peak_tflops: Option<f64>,
    /// Split the model into this many pipeline stages, one device each (stage-major:
    /// `--devices vulkan:0x2 --pipeline-stages 2` puts stage 0 on the first device)
    /// [default: the config's pipeline.stages or kiln.pipeline_stages, else 1].
    #[arg(long, value_name = "N")]
    pipeline_stages: Option<usize>,
    /// How the blocks are cut into stages: `parameters` (balance parameter counts,
    /// DeepSpeed's default), `uniform` (blocks), or blocks per stage (`3,5`)
    /// [default: the config's pipeline.partition, else parameters].
    #[arg(long)]
    partition: Option<String>,
}

#[derive(clap::Args)]
struct SampleArgs {
    /// A run directory (its latest checkpoint), a checkpoint directory
    /// (runs/NAME/checkpoints/step-N), a Hugging Face GPT-2 directory (model.safetensors
    /// + config.json) or an llm.c .bin.
    source: PathBuf,
    /// The text to continue.
    #[arg(long)]
    prompt: Option<String>,
    /// A file of prompts, one per line, each continued in turn.
    #[arg(long)]
    prompts: Option<PathBuf>,
    /// New tokens per prompt [default: as many as the model's context holds, at most 256].
    #[arg(long)]
    tokens: Option<usize>,
    /// 0: always the likeliest token; 1: the model's distribution; higher: flatter.
    #[arg(long, default_value_t = 1.0, allow_negative_numbers = true)]
    temperature: f32,
    /// Draw only from the K likeliest tokens.
    #[arg(long)]
    top_k: Option<usize>,
    /// Draw only from the likeliest tokens holding this share of the probability (0, 1].
    #[arg(long, allow_negative_numbers = true)]
    top_p: Option<f32>,
    /// Seed of the draws: the same seed gives the same text.
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// The device (`kiln devices` lists them); default: the best adapter.
    #[arg(long, value_delimiter = ',')]
    devices: Vec<String>,
    /// Run in f32, f16 or bf16 [default: the checkpoint's own; f16 for imported files].
    #[arg(long)]
    dtype: Option<String>,
}

#[derive(clap::Args)]
struct EvalArgs {
    /// A run directory (its latest checkpoint), a checkpoint directory
    /// (runs/NAME/checkpoints/step-N), a Hugging Face GPT-2 directory (model.safetensors
    /// + config.json) or an llm.c .bin (imported models need --data).
    source: PathBuf,
    /// Score every row of this token file (`kiln prepare`) or text file instead of the
    /// run's held-out data.
    #[arg(long)]
    data: Option<PathBuf>,
    /// The device (`kiln devices` lists them); default: the best adapter.
    #[arg(long, value_delimiter = ',')]
    devices: Vec<String>,
    /// Sequences per forward pass [default: the run's micro-batch].
    #[arg(long)]
    micro_batch: Option<usize>,
    /// Run in f32, f16 or bf16 [default: the checkpoint's own; f16 for imported files].
    #[arg(long)]
    dtype: Option<String>,
    /// Print the result as JSON.
    #[arg(long)]
    json: bool,
}

#[derive(Subcommand)]
enum ConfigWhat {
    /// Validate a config: every problem, with its key path and fix.
    Check {
        file: PathBuf,
        /// Data-parallel world size the batch sizes are checked against.
        #[arg(long, default_value_t = 1)]
        world: usize,
    },
    /// Print every resolved setting and where it came from (file, default, inferred).
    Explain {
        file: PathBuf,
        #[arg(long, default_value_t = 1)]
        world: usize,
    },
}

#[derive(Subcommand)]
enum RunsWhat {
    /// What changed between two runs' configs, and what it did to loss and throughput.
    Diff { a: PathBuf, b: PathBuf },
}

#[derive(Subcommand)]
enum BenchWhat {
    /// GEMM GFLOP/s per adapter, dtype and shape, against CPU sgemm in the same run.
    Matmul(MatmulArgs),
    /// Data-parallel step time and gradient exchange on 1, 2, 4… devices of one
    /// adapter, and the scaling that gives N real GPUs over PCIe.
    Dp(DpArgs),
    /// Causal attention forward + backward: fused kernels against the straightforward
    /// version (GEMMs through a T x T score matrix), time and device memory.
    Attention(AttentionArgs),
    /// Generation with the K/V cache: prompt and decode tokens per second, apart, on a
    /// GPT-2-shaped model with random weights.
    Sample(BenchSampleArgs),
    /// An adapter's peak: f32 FMA GFLOP/s and copy GB/s, cached per adapter and host as
    /// the denominator of `kiln train --profile`'s MFU.
    Peak(PeakArgs),
    /// A training step of a named model size per adapter and precision: tokens/s, step
    /// time, MFU, device memory, and step time ÷ the step's GEMM-bound time.
    Train(TrainBenchArgs),
    /// A GPT split into 1, 2, 4… pipeline stages (devices of one adapter) at several
    /// micro-batch counts: step time, tokens/s, bubble measured against the 1F1B
    /// schedule's, bytes between stages and each stage's memory.
    Pipeline(PipelineBenchArgs),
}

#[derive(clap::Args)]
struct PipelineBenchArgs {
    /// The adapter whose devices are the stages (`kiln devices`); default: vulkan.
    #[arg(long, default_value = "vulkan")]
    device: String,
    /// Model: `small` (5.29M GPT, T 128, micro-batch 8), `demo`, `gpt2`, or a model
    /// JSON file.
    #[arg(long, default_value = "small")]
    model: String,
    /// Sequences per micro-batch instead of the model's own.
    #[arg(long)]
    micro_batch: Option<usize>,
    /// Stage counts to measure.
    #[arg(long, value_delimiter = ',', default_value = "1,2,4")]
    stages: Vec<usize>,
    /// Micro-batches per step (m); default: p and 4p for each stage count p.
    #[arg(long, value_delimiter = ',')]
    micro_batches: Vec<usize>,
    /// Timed steps after the warm-up step (which compiles).
    #[arg(long, default_value_t = 2)]
    steps: usize,
    /// Write the rows as JSON to this file (`-` for stdout) as well.
    #[arg(long)]
    json: Option<String>,
    /// The modelled box: each GPU's link to the host, GB/s each way (PCIe 4.0 x16:
    /// 31.5 GB/s raw per direction, about 25 in host-staged copies).
    #[arg(long, default_value_t = 25.0)]
    link_gbps: f64,
    /// The modelled box: fixed cost of each copy over a link, microseconds.
    #[arg(long, default_value_t = 10.0)]
    link_latency_us: f64,
    /// The modelled box: how many times faster than this adapter a GPU computes each
    /// stage (1: the compute times as measured).
    #[arg(long, default_value_t = 1.0)]
    gpu_speedup: f64,
}

#[derive(clap::Args)]
struct TrainBenchArgs {
    /// Models: `small` (5.29M GPT, T 128, micro-batch 8), `demo` (the addition demo),
    /// `gpt2` (124M at T 1024, micro-batch 1), or model JSON files.
    #[arg(long, value_delimiter = ',', default_value = "small")]
    model: Vec<String>,
    /// Devices to measure (`kiln devices` lists them); default: every adapter.
    #[arg(long, value_delimiter = ',')]
    devices: Vec<String>,
    /// Precisions: fp32, fp16, bf16 (fp16/bf16 keep fp32 master weights).
    #[arg(long, value_delimiter = ',', default_value = "fp32")]
    precision: Vec<String>,
    /// Sequences per step instead of the model's own micro-batch.
    #[arg(long)]
    micro_batch: Option<usize>,
    /// Timed steps after the warm-up step (which compiles).
    #[arg(long, default_value_t = 3)]
    steps: usize,
    /// Time each distinct GEMM of the step for about this many milliseconds.
    #[arg(long, default_value_t = 200)]
    gemm_budget_ms: u64,
    /// One device's peak TFLOP/s for the MFU [default: `kiln bench peak`'s cache].
    #[arg(long)]
    peak_tflops: Option<f64>,
    /// Write the rows as JSON to this file (`-` for stdout) instead of a table.
    #[arg(long)]
    json: Option<String>,
}

#[derive(clap::Args)]
struct PeakArgs {
    /// Devices to measure (`kiln devices` lists them); default: every adapter.
    #[arg(long, value_delimiter = ',')]
    devices: Vec<String>,
    /// Print JSON (one object per adapter) instead of a table.
    #[arg(long)]
    json: bool,
}

#[derive(clap::Args)]
struct BenchSampleArgs {
    /// Devices to measure (`kiln devices` lists them); default: every adapter.
    #[arg(long, value_delimiter = ',')]
    devices: Vec<String>,
    /// Models: `addition` (the demo's shape) and `gpt2-124m`.
    #[arg(long, value_delimiter = ',', default_value = "addition,gpt2-124m")]
    models: Vec<String>,
    /// Storage dtype of weights, activations and the cache.
    #[arg(long, default_value = "f16")]
    dtype: String,
    /// Prompt tokens (cut to fit a model's block_size with the decoded ones).
    #[arg(long, default_value_t = 64)]
    prompt: usize,
    /// Tokens to decode after the prompt.
    #[arg(long, default_value_t = 32)]
    tokens: usize,
    /// Run every model with this many layers instead of its own (a quicker measure of
    /// a large model's per-layer cost).
    #[arg(long)]
    layers: Option<usize>,
    /// Turn native f16 off on every device (measures the packed path).
    #[arg(long)]
    no_f16: bool,
    /// Write the rows as JSON to this file (`-` for stdout) as well.
    #[arg(long)]
    json: Option<String>,
}

#[derive(clap::Args)]
struct DpArgs {
    /// The adapter whose devices are grouped.
    #[arg(long, default_value = "vulkan")]
    device: String,
    /// Group sizes to measure.
    #[arg(long, value_delimiter = ',', default_value = "1,2,4")]
    counts: Vec<usize>,
    /// GPT sizes as JSON; default: 4 layers, 128 embd, 4 heads, T 64, vocab 512.
    #[arg(long)]
    model: Option<PathBuf>,
    /// Samples per device per step.
    #[arg(long, default_value_t = 8)]
    micro: usize,
    /// Timed steps per group size (after one warm-up step).
    #[arg(long, default_value_t = 5)]
    steps: usize,
    /// PCIe bandwidth per GPU for the model, GB/s (PCIe 4.0 x16 moves ~25 in practice).
    #[arg(long, default_value_t = 25.0)]
    pcie_gbps: f64,
    /// Host memory bandwidth for adding gradients, GB/s.
    #[arg(long, default_value_t = 20.0)]
    host_gbps: f64,
    /// Exchange after backward instead of overlapping it (`overlap_comm: false`).
    #[arg(long)]
    no_overlap: bool,
    /// Under mpirun: network bandwidth per process for the model, GB/s (100 Gb/s
    /// Ethernet or InfiniBand EDR moves ~12).
    #[arg(long, default_value_t = 12.0)]
    net_gbps: f64,
    /// Under mpirun: network latency per message for the model, µs.
    #[arg(long, default_value_t = 5.0)]
    net_latency_us: f64,
    /// Under mpirun: elements per bucket the processes sum (`reduce_bucket_size`);
    /// smaller buckets overlap more of the exchange with backward.
    #[arg(long, default_value_t = 1 << 18)]
    bucket: usize,
}

#[derive(clap::Args)]
struct AttentionArgs {
    /// Devices to measure (`kiln devices` lists them); default: every adapter.
    #[arg(long, value_delimiter = ',')]
    devices: Vec<String>,
    /// Sequence lengths T.
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "128,256,512,1024,2048,4096"
    )]
    seqs: Vec<usize>,
    /// Head dim d.
    #[arg(long, default_value_t = 64)]
    dim: usize,
    /// Independent heads, B * H.
    #[arg(long, default_value_t = 4)]
    heads: usize,
    /// Storage dtype of q, k, v and the results.
    #[arg(long, default_value = "f32")]
    dtype: String,
    /// Measure each version for about this many milliseconds (at least 2 runs after a
    /// warm-up run).
    #[arg(long, default_value_t = 1000)]
    budget_ms: u64,
    /// Turn native f16 off on every device (measures the packed path).
    #[arg(long)]
    no_f16: bool,
    /// Write the rows as JSON to this file (`-` for stdout) as well.
    #[arg(long)]
    json: Option<String>,
}

#[derive(clap::Args)]
struct MatmulArgs {
    /// Devices to measure (`kiln devices` lists them); default: every adapter.
    #[arg(long, value_delimiter = ',')]
    devices: Vec<String>,
    /// Storage dtypes.
    #[arg(long, value_delimiter = ',', default_value = "f32,f16,bf16")]
    dtypes: Vec<String>,
    /// Square sizes to run instead of the default set (256..2048 and GPT shapes).
    #[arg(long, value_delimiter = ',')]
    sizes: Vec<usize>,
    /// Measure each row for about this many milliseconds.
    #[arg(long, default_value_t = 400)]
    budget_ms: u64,
    /// Largest dimension the naive baseline kernel is run at (it is slow).
    #[arg(long, default_value_t = 1024)]
    naive_up_to: usize,
    /// Turn native f16 off on every device (measures the packed path).
    #[arg(long)]
    no_f16: bool,
    /// Also measure these kernel variants (e.g. `cpu24x8,tiled32x64x8,gemv128`) beside the planner's choice
    /// (on `vk:N` too, as its hand-written SPIR-V GEMMs: `cpu`, `tiled` and `gemv` blocks).
    #[arg(long, value_delimiter = ',')]
    variants: Vec<String>,
    /// Also measure the hand-written SPIR-V GEMM (shaders/vulkan/matmul_cpu.comp) on
    /// every Vulkan device, through wgpu's SPIR-V passthrough (f32 and f16).
    #[arg(long)]
    spirv: bool,
    /// Write the rows as JSON to this file (`-` for stdout) as well.
    #[arg(long)]
    json: Option<String>,
}

fn main() {
    kiln::devices::quiet_device_select();
    let cli = Cli::parse();
    if let Err(e) = run(cli) {
        errln!("error: {e:#}");
        std::process::exit(1);
    }
}

fn run(cli: Cli) -> Result<()> {
    if cli.no_tune {
        // Every device this process opens reads it, whichever command opens them.
        std::env::set_var("KILN_GEMM_TUNE", "0");
    }
    match cli.command {
        Command::Devices { json } => devices(json),
        Command::Train(args) => train(args),
        Command::Sample(a) => {
            kiln::sample::sample(&kiln::sample::SampleOptions {
                source: a.source,
                prompt: a.prompt,
                prompts: a.prompts,
                tokens: a.tokens,
                sampling: kiln::engine::models::sample::SamplingOptions {
                    temperature: a.temperature,
                    top_k: a.top_k,
                    top_p: a.top_p,
                },
                seed: a.seed,
                devices: a.devices,
                dtype: a.dtype.map(|d| d.parse()).transpose()?,
            })?;
            Ok(())
        }
        Command::Eval(a) => eval(a),
        Command::Config { what } => config(what),
        Command::Prepare {
            input,
            output,
            tokenizer,
        } => {
            let tok: kiln::engine::data::Tokenizer = tokenizer.parse()?;
            let n = kiln::engine::data::prepare(&input, &output, tok)?;
            outln!(
                "{}: {n} tokens ({}, vocab {}) from {}",
                output.display(),
                tok.name(),
                tok.vocab_size(),
                input.display()
            );
            Ok(())
        }
        Command::Runs { what, root } => runs(what, &root),
        Command::Estimate {
            model,
            devices,
            config,
            seq,
            pipeline_stages,
            partition,
        } => estimate(
            &model,
            &devices,
            config.as_deref(),
            seq,
            (pipeline_stages, partition.as_deref()),
        ),
        Command::Bench {
            what: BenchWhat::Matmul(args),
        } => bench_matmul(args),
        Command::Bench {
            what: BenchWhat::Dp(args),
        } => bench_dp(args),
        Command::Bench {
            what: BenchWhat::Attention(args),
        } => bench_attention(args),
        Command::Bench {
            what: BenchWhat::Sample(args),
        } => bench_sample(args),
        Command::Bench {
            what: BenchWhat::Peak(args),
        } => bench_peak(args),
        Command::Bench {
            what: BenchWhat::Train(args),
        } => bench_train(args),
        Command::Bench {
            what: BenchWhat::Pipeline(args),
        } => bench_pipeline(args),
    }
}

fn bench_pipeline(a: PipelineBenchArgs) -> Result<()> {
    use kiln::bench_pipeline::{format_rows, measure, GpuBox};
    // Every argument is checked before anything compiles or runs.
    let model = kiln::bench_train::bench_model(&a.model, a.micro_batch)?;
    let gpus = GpuBox {
        gpu_speedup: a.gpu_speedup,
        link_gbps: a.link_gbps,
        latency_us: a.link_latency_us,
    };
    gpus.check()?;
    let spec: kiln::DeviceSpec = a.device.parse()?;
    let Some(adapter) = spec.adapter_index()? else {
        anyhow::bail!(
            "--device {}: the stages run on a GPU adapter (`kiln devices`), not the CPU reference",
            a.device
        );
    };
    if a.stages.is_empty() || a.stages.contains(&0) {
        anyhow::bail!("--stages: give stage counts of 1 or more, e.g. 1,2,4");
    }
    if a.micro_batches.contains(&0) {
        anyhow::bail!("--micro-batches: a step needs at least one micro-batch");
    }
    let mut runs = vec![];
    for &p in &a.stages {
        let ms = if a.micro_batches.is_empty() {
            let mut v = vec![p, 4 * p];
            v.dedup();
            v
        } else {
            a.micro_batches.clone()
        };
        runs.extend(ms.into_iter().map(|m| (p, m)));
    }
    let mut rows = vec![];
    for (p, m) in runs {
        errln!(
            "kiln bench pipeline: {} in {p} stage(s), {m} micro-batch(es) per step",
            model.name
        );
        if p > 1 && m < 4 * p {
            errln!(
                "  m = {m} < 4p = {}: the schedule idles {:.0}% of each stage's step",
                4 * p,
                100.0 * kiln::engine::parallel::pipeline_schedule::theoretical_bubble(p, m)
            );
        }
        rows.push(measure(adapter, &model, p, m, a.steps, &gpus)?);
    }
    if let Some(r) = rows.first() {
        outln!(
            "{} on {} (each stage its own device on this adapter), fp32, micro-batch {}",
            r.model,
            r.adapter,
            model.micro_batch
        );
    }
    outln!("{}", format_rows(&rows));
    outln!(
        "model: one GPU per stage computing the measured forward + backward (split 1 : 2) \
         {} times faster, 1F1B, copies staged through the host over {} GB/s links \
         ({} µs each), overlapping compute; the optimizer step not included",
        gpus.gpu_speedup,
        gpus.link_gbps,
        gpus.latency_us
    );
    if let Some(path) = a.json {
        kiln::bench::write_json(&rows, &path)?;
    }
    Ok(())
}

fn train(a: TrainArgs) -> Result<()> {
    #[cfg(feature = "mpi")]
    if kiln::engine::parallel::collective::launched_by_mpirun() {
        let session = kiln::engine::parallel::mpi::MpiSession::init()?;
        let comm = session.collective();
        let result = train_with(a, Some(comm.clone()));
        return match result {
            // Every process has finished its last collective: MPI can end.
            Ok(code) => {
                drop(session);
                if code != 0 {
                    std::process::exit(code);
                }
                Ok(())
            }
            Err(e) => {
                // The other processes would wait for this one in the next collective:
                // stop the whole job, after saying why.
                errln!("error (process {} of {}): {e:#}", comm.rank(), comm.size());
                comm.abort(1);
                Err(e)
            }
        };
    }
    #[cfg(not(feature = "mpi"))]
    if kiln::engine::parallel::collective::launched_by_mpirun() {
        bail!(
            "this kiln was started by mpirun but built without MPI: every process would train \
             alone. Build it with `cargo build --release --features mpi` (it needs \
             libopenmpi-dev, openmpi-bin and libclang-dev: `bash scripts/setup.sh` installs \
             them)"
        );
    }
    match train_with(a, None)? {
        0 => Ok(()),
        code => std::process::exit(code),
    }
}

/// `kiln train`; returns the exit status (130 after an interrupt).
fn train_with(
    a: TrainArgs,
    processes: Option<Arc<dyn kiln::engine::parallel::collective::Collective>>,
) -> Result<i32> {
    let writer = processes.as_ref().is_none_or(|c| c.rank() == 0);
    let interrupt = Arc::new(AtomicBool::new(false));
    let flag = interrupt.clone();
    // Ctrl-C, SIGTERM (a scheduler or `kill`) and SIGHUP (the terminal went away) all
    // stop the run the same way: after the step in flight, with a checkpoint and a
    // summary, so no work is lost.
    ctrlc::set_handler(move || {
        if flag.swap(true, Ordering::SeqCst) {
            // A second signal: the user does not want to wait for the checkpoint.
            std::process::exit(130);
        }
        errln!(
            "\ninterrupted (Ctrl-C, SIGTERM or SIGHUP): stopping after this step and writing a \
             checkpoint; interrupt again to quit at once"
        );
    })
    .context("installing the Ctrl-C/SIGTERM/SIGHUP handler")?;
    let opts = kiln::train::TrainOptions {
        config: a.config,
        model: a.model,
        data: a.data,
        devices: a.devices,
        out: a.out,
        steps: a.steps,
        eval_every: a.eval_every,
        checkpoint_every: a.checkpoint_every,
        keep_checkpoints: a.keep_checkpoints,
        resume: a.resume,
        init_from: a.init_from,
        seed: a.seed,
        progress: true,
        interrupt: Some(interrupt),
        processes,
        profile: a.profile,
        peak_tflops: a.peak_tflops,
        pipeline_stages: a.pipeline_stages,
        partition: a.partition,
    };
    let r = kiln::train::train(&opts)?;
    if !writer {
        return Ok(if r.interrupted { 130 } else { 0 });
    }
    let s = &r.summary;
    let acc = s.final_eval_accuracy.map_or(String::new(), |a| {
        format!(", held-out exact match {:.1}%", a * 100.0)
    });
    let eval = match (s.final_eval_loss, &s.no_held_out_data) {
        (Some(l), _) => format!("{l:.4}"),
        (None, Some(_)) => "- (no held-out data)".to_string(),
        (None, None) => "-".to_string(),
    };
    // The run's results are in its directory: a stdout that cannot take this summary
    // must not turn a finished run into a failure.
    kiln::say::say_out(format_args!(
        "{} steps ({} skipped), final loss {:.4}, eval loss {eval}{acc}, {:.0} tokens/s, {:.1} s",
        r.steps,
        s.skipped_steps,
        s.final_loss.unwrap_or(f32::NAN),
        s.mean_tokens_per_s.unwrap_or(f64::NAN),
        s.total_time_s
    ));
    kiln::say::say_out(format_args!(
        "run: {} (metrics.jsonl, summary.json, chart.svg, checkpoints/)",
        r.dir.display()
    ));
    for note in &s.non_finite {
        kiln::say::say(format_args!("warning: {note}"));
    }
    Ok(if r.interrupted { 130 } else { 0 })
}

fn eval(a: EvalArgs) -> Result<()> {
    let r = kiln::eval::eval(&kiln::eval::EvalOptions {
        source: a.source,
        data: a.data,
        devices: a.devices,
        micro_batch: a.micro_batch,
        dtype: a.dtype.map(|d| d.parse()).transpose()?,
        progress: !a.json,
    })?;
    if a.json {
        outln!("{}", serde_json::to_string_pretty(&r)?);
        return Ok(());
    }
    let acc = r.accuracy.map_or(String::new(), |a| {
        format!(", held-out exact match {:.1}%", a * 100.0)
    });
    outln!(
        "loss {:.4}, perplexity {:.3}{acc}: {} tokens scored in {} rows of {}, {}",
        r.loss,
        r.perplexity,
        r.tokens,
        r.rows,
        r.seq,
        r.data
    );
    let step = r.step.map_or(String::new(), |s| format!(" (step {s})"));
    outln!("{}{step} on {}", r.checkpoint.display(), r.device);
    Ok(())
}

fn estimate(
    model: &std::path::Path,
    devices: &[String],
    config: Option<&std::path::Path>,
    seq: Option<usize>,
    (stages, partition): (Option<usize>, Option<&str>),
) -> Result<()> {
    use kiln::engine::DType;
    // The flag, else the config's (as `kiln train` reads them); an unreadable config
    // is reported when it is loaded below.
    let stages = stages.unwrap_or_else(|| {
        config
            .and_then(|p| std::fs::read_to_string(p).ok())
            .map_or(1, |text| kiln::train::configured_stages(&text))
    });
    if stages <= 1 && partition.is_some() {
        bail!(
            "--partition cuts a model into pipeline stages: give --pipeline-stages 2 or more \
             (or pipeline.stages in the config)"
        );
    }
    let mut method = kiln::estimate::parse_partition(partition.unwrap_or("parameters"))?;
    let text = kiln::train::read_json_input(model, "the model config")?;
    let m = kiln::engine::models::ModelConfig::parse(&text)
        .map_err(|e| anyhow::anyhow!("{}: {e}", model.display()))?;
    m.check()
        .map_err(|e| anyhow::anyhow!("{}: {e}", model.display()))?;
    let (world, adapters) = match devices {
        [n] if n.parse::<usize>().is_ok() => (n.parse::<usize>()?.max(1), vec![]),
        specs => {
            let specs = kiln::devices::parse_devices(specs)?;
            let all = kiln::wgpu::adapters();
            let cpu = kiln::cpu::CpuDevice::new();
            // One entry per device, as training would open them.
            let mut caps = vec![];
            for s in &specs {
                if let kiln::DeviceSpec::Vk(n) = s {
                    let vk = kiln::vulkan::physical_devices();
                    let d = vk.get(*n).ok_or_else(|| {
                        anyhow::anyhow!("no Vulkan device vk:{n}: see `kiln devices`")
                    })?;
                    caps.push(d.caps.clone());
                    continue;
                }
                match s.adapter_index()? {
                    None => caps.push(cpu.caps().clone()),
                    Some(i) => caps.push(
                        all.iter()
                            .find(|a| a.index == i)
                            .map(|a| a.caps.clone())
                            .ok_or_else(|| anyhow::anyhow!("no adapter {i}: see `kiln devices`"))?,
                    ),
                }
            }
            (specs.len(), caps)
        }
    };
    // A pipeline's data-parallel world is its replicas: the config's batch sizes are
    // per replica's step. Checked before the config is read, whose batch sizes would
    // otherwise be resolved for a world that does not exist.
    if stages > 1 && !world.is_multiple_of(stages) {
        bail!(
            "{stages} pipeline stages (--pipeline-stages, else the config's pipeline.stages) \
             do not divide the {world} device(s): a pipeline of p stages takes p devices per \
             data-parallel replica; give a multiple of {stages} devices or another stage count"
        );
    }
    let dp = if stages > 1 { world / stages } else { world };
    let (micro, dtype, accum, zero) = match config {
        Some(path) => {
            let c = kiln::engine::config::load(path, dp)?;
            if partition.is_none() && stages > 1 {
                method = kiln::estimate::parse_partition(&c.pipeline.partition.spelled())?;
            }
            let zero = c.zero.stage;
            (
                c.batch.micro_batch,
                c.precision.dtype(),
                c.batch.grad_accum,
                zero,
            )
        }
        None => (1, DType::F16, 1, 0),
    };
    let model = m.build(seq.unwrap_or(m.block_size()));
    if stages > 1 {
        out!(
            "{}",
            kiln::estimate::pipeline_report(
                model.as_ref(),
                micro,
                dtype,
                (stages, world, accum),
                &method,
                zero
            )?
        );
        return Ok(());
    }
    out!(
        "{}",
        kiln::estimate::report(model.as_ref(), micro, dtype, world, &adapters)?
    );
    Ok(())
}

fn config(what: ConfigWhat) -> Result<()> {
    let (ConfigWhat::Check { world, .. } | ConfigWhat::Explain { world, .. }) = &what;
    // The world is a device count: as many as `kiln train` can open.
    if *world > kiln::devices::MAX_DEVICES {
        bail!(
            "--world {world}: Kiln trains on at most {} devices; pass the number of devices \
             the run will use",
            kiln::devices::MAX_DEVICES
        );
    }
    match what {
        ConfigWhat::Check { file, world } => {
            let c = kiln::engine::config::load(&file, world)?;
            // Keys accepted but doing nothing here are worth a line too: a user who set
            // one expects it to act.
            for n in &c.notes {
                outln!("note: {n}");
            }
            for w in &c.warnings {
                outln!("warning: {w}");
            }
            // A pipeline's world is its replicas, each taking one device per stage.
            let p = c.pipeline.stages;
            let stages = if p > 1 {
                format!(
                    "; {p} pipeline stages, partition {}: {} devices",
                    c.pipeline.partition.spelled(),
                    p * c.batch.world
                )
            } else {
                String::new()
            };
            outln!(
                "{}: ok (train_batch_size {} = micro-batch {} × accumulation {} × world {}{stages})",
                file.display(),
                c.batch.train_batch_size,
                c.batch.micro_batch,
                c.batch.grad_accum,
                c.batch.world
            );
        }
        ConfigWhat::Explain { file, world } => {
            out!("{}", kiln::engine::config::load(&file, world)?.explain());
        }
    }
    Ok(())
}

fn runs(what: Option<RunsWhat>, root: &std::path::Path) -> Result<()> {
    use kiln::engine::train::runs;
    match what {
        None => {
            let list = runs::list_runs(root)?;
            if list.is_empty() {
                outln!(
                    "no runs under {} (kiln train writes them there)",
                    root.display()
                );
            } else {
                out!("{}", runs::RunsTable(&list));
            }
        }
        Some(RunsWhat::Diff { a, b }) => out!("{}", runs::diff_runs(&a, &b)?),
    }
    Ok(())
}

fn devices(json: bool) -> Result<()> {
    let mut rows = kiln::wgpu::adapters();
    let cpu = kiln::cpu::CpuDevice::new();
    // The raw Vulkan backend's devices, `vk:N`, listed after wgpu's adapters.
    let vk = kiln::vulkan::physical_devices();
    if json {
        let mut list: Vec<serde_json::Value> = rows
            .iter()
            .map(|a| {
                let mut v = serde_json::to_value(a).expect("plain data serializes");
                v["spec"] = a.index.to_string().into();
                v
            })
            .collect();
        for d in &vk {
            let mut v = serde_json::to_value(&d.caps)?;
            v["spec"] = format!("vk:{}", d.index).into();
            list.push(v);
        }
        let mut c = serde_json::to_value(cpu.caps())?;
        c["spec"] = "cpu".into();
        list.push(c);
        outln!("{}", serde_json::to_string_pretty(&list)?);
        return Ok(());
    }
    if rows.is_empty() {
        errln!("No GPU adapter found. {}", kiln::wgpu::NO_ADAPTER_HINT);
    }
    rows.sort_by_key(|a| a.index);
    let mib = |b: u64| format!("{} MiB", b >> 20);
    let header = [
        "spec",
        "backend",
        "type",
        "name",
        "f16",
        "subgroups",
        "timestamps",
        "max binding",
        "max buffer",
    ];
    let mut table: Vec<Vec<String>> = vec![header.iter().map(|s| s.to_string()).collect()];
    let caps = rows
        .iter()
        .map(|a| (a.index.to_string(), &a.caps))
        .chain(vk.iter().map(|d| (format!("vk:{}", d.index), &d.caps)))
        .chain(std::iter::once(("cpu".to_string(), cpu.caps())));
    for (spec, c) in caps {
        table.push(vec![
            spec,
            c.backend.clone(),
            c.device_type.clone(),
            c.name.clone(),
            if c.f16_arithmetic { "native" } else { "packed" }.into(),
            c.subgroup_sizes.map_or("-".into(), |(a, b)| {
                if a == b {
                    a.to_string()
                } else {
                    format!("{a}-{b}")
                }
            }),
            if c.timestamp_queries { "yes" } else { "no" }.into(),
            if c.backend == "cpu" {
                "-".into()
            } else {
                mib(c.max_storage_binding)
            },
            if c.backend == "cpu" {
                "-".into()
            } else {
                mib(c.max_buffer)
            },
        ]);
    }
    outln!("{}", kiln::bench::align(&table));
    Ok(())
}

fn bench_dp(a: DpArgs) -> Result<()> {
    use kiln::bench_dp::{check_bandwidth, dp_table, modelled_efficiency};
    use kiln::engine::models::gpt::{Gpt, GptConfig};
    // Before minutes of measuring: the model's inputs.
    check_bandwidth("pcie-gbps", a.pcie_gbps)?;
    check_bandwidth("host-gbps", a.host_gbps)?;
    let model: GptConfig = match &a.model {
        Some(p) => {
            let text = kiln::train::read_json_input(p, "the model config")?;
            match kiln::engine::models::ModelConfig::parse(&text) {
                Ok(kiln::engine::models::ModelConfig::Gpt2(c)) => c,
                Ok(_) => bail!("{}: bench dp measures GPT-2 models", p.display()),
                Err(e) => bail!("{}: {e}", p.display()),
            }
        }
        None => GptConfig {
            n_layer: 4,
            n_head: 4,
            n_embd: 128,
            block_size: 64,
            vocab_size: 512,
            padded_vocab_size: None,
        },
    };
    let spec: kiln::DeviceSpec = a.device.parse()?;
    let adapter = spec
        .adapter_index()?
        .ok_or_else(|| anyhow::anyhow!("bench dp groups devices of a GPU adapter, not `cpu`"))?;
    #[cfg(feature = "mpi")]
    if kiln::engine::parallel::collective::launched_by_mpirun() {
        return bench_dp_mpi(&a, adapter, &model);
    }
    let rows = dp_table(adapter, &model, a.micro, &a.counts, a.steps, !a.no_overlap)?;
    outln!(
        "kiln bench dp: GPT {} layers {} embd T {} vocab {}, Ψ = {}, fp16, micro-batch {} per device",
        model.n_layer,
        model.n_embd,
        model.block_size,
        model.vocab_size,
        model.parameter_count(),
        a.micro
    );
    outln!(
        "{:<34} {:>7} {:>9} {:>9} {:>8} {:>10} {:>10} {:>10}",
        "adapter",
        "devices",
        "step ms",
        "comm ms",
        "overlap",
        "MB/step",
        "samples/s",
        "vs 1 dev"
    );
    let base = rows.first().map_or(1.0, |r| r.samples_per_s);
    for r in &rows {
        outln!(
            "{:<34} {:>7} {:>9.1} {:>9.1} {:>7.0}% {:>10.2} {:>10.1} {:>9.2}x",
            r.adapter,
            r.devices,
            r.step_ms,
            r.comm_ms,
            r.overlap * 100.0,
            r.bytes_per_step as f64 / 1e6,
            r.samples_per_s,
            r.samples_per_s / base
        );
    }
    // All devices here share one adapter (and on lavapipe its CPU cores), so these rows
    // measure overhead, not scaling; the model below is what separate GPUs would see.
    let compute_ms = rows
        .iter()
        .find(|r| r.devices == 1)
        .map_or(rows[0].step_ms - rows[0].comm_ms, |r| r.step_ms);
    let overlap = rows
        .iter()
        .filter(|r| r.devices > 1)
        .map(|r| r.overlap)
        .fold(0.0, f64::max);
    let gpt = Gpt::new(model.clone(), model.block_size);
    let grads =
        kiln::estimate::network_memory(&gpt, a.micro, kiln::engine::DType::F16)?.gradients as f64;
    outln!(
        "modelled for separate GPUs: compute {compute_ms:.1} ms/step (measured, 1 device), \
         {:.2} MB of gradients per GPU, PCIe {} GB/s each way, host adds at {} GB/s, \
         overlap {:.0}% (measured)",
        grads / 1e6,
        a.pcie_gbps,
        a.host_gbps,
        overlap * 100.0
    );
    for n in [2, 4, 8] {
        outln!(
            "  {n} GPUs: scaling efficiency {:.1}%",
            100.0 * modelled_efficiency(n, compute_ms, grads, a.pcie_gbps, a.host_gbps, overlap)
        );
    }
    Ok(())
}

/// `kiln bench dp` under mpirun: every process drives `--counts` devices (one number)
/// of the adapter; process 0 prints the job's step, its exchange between processes,
/// and the scaling modelled for a network from the measured compute time.
#[cfg(feature = "mpi")]
fn bench_dp_mpi(
    a: &DpArgs,
    adapter: usize,
    model: &kiln::engine::models::gpt::GptConfig,
) -> Result<()> {
    use kiln::bench_dp::{check_bandwidth, dp_processes, modelled_network_efficiency};
    use kiln::engine::parallel::collective::Processes;
    check_bandwidth("net-gbps", a.net_gbps)?;
    if !(a.net_latency_us.is_finite() && a.net_latency_us >= 0.0) {
        bail!(
            "--net-latency-us {}: a latency is a number of µs, 0 or more",
            a.net_latency_us
        );
    }
    let [local] = a.counts[..] else {
        bail!(
            "under mpirun --counts is the number of devices each process drives (one number, \
             e.g. --counts 1); the job's size is mpirun's -np"
        );
    };
    let session = kiln::engine::parallel::mpi::MpiSession::init()?;
    let comm = session.collective();
    let rank = comm.rank();
    let run = || -> Result<()> {
        let procs = Processes::new(comm.clone(), local)?;
        let p = procs.devices.len();
        let overlap = !a.no_overlap;
        let r = dp_processes(
            adapter, model, a.micro, local, a.steps, overlap, a.bucket, procs,
        )?;
        if rank != 0 {
            return Ok(());
        }
        outln!(
            "kiln bench dp (MPI): GPT {} layers {} embd T {} vocab {}, Ψ = {}, fp16, micro-batch \
             {} per device, {p} processes × {local} device(s) of {}",
            model.n_layer,
            model.n_embd,
            model.block_size,
            model.vocab_size,
            model.parameter_count(),
            a.micro,
            r.adapter
        );
        outln!(
            "step {:.1} ms, exchange {:.1} ms exposed, {:.0}% of the processes' exchange \
             overlapped with backward, {:.2} MB/step between processes (process 0), {:.1} \
             samples/s",
            r.step_ms,
            r.comm_ms,
            r.overlap * 100.0,
            r.process_bytes_per_step as f64 / 1e6,
            r.samples_per_s
        );
        // The f32 gradients the processes sum, and the compute one GPU per process
        // would do: the measured step less its exposed exchange.
        let grads = 4.0 * model.parameter_count() as f64;
        let compute_ms = (r.step_ms - r.comm_ms).max(0.0);
        let bucket = a.bucket as f64 * 4.0;
        outln!(
            "modelled for one GPU per process on a network of {} GB/s and {} µs per message: \
             compute {compute_ms:.1} ms/step (measured), {:.2} MB of f32 gradients in buckets \
             of {} elements, overlap {:.0}% (measured)",
            a.net_gbps,
            a.net_latency_us,
            grads / 1e6,
            a.bucket,
            r.overlap * 100.0
        );
        for n in [2, 4, 8, 16, 64] {
            outln!(
                "  {n} processes: scaling efficiency {:.1}%",
                100.0
                    * modelled_network_efficiency(
                        n,
                        compute_ms,
                        grads,
                        bucket,
                        a.net_gbps,
                        a.net_latency_us,
                        r.overlap
                    )
            );
        }
        Ok(())
    };
    match run() {
        Ok(()) => {
            drop(session);
            Ok(())
        }
        Err(e) => {
            errln!("error (process {rank}): {e:#}");
            comm.abort(1);
            Err(e)
        }
    }
}

/// The adapters `--devices` names (default: all), opened.
fn bench_devices(
    devices: &[String],
    options: &kiln::wgpu::DeviceOptions,
) -> Result<Vec<kiln::wgpu::WgpuDevice>> {
    let indices: Vec<usize> = if devices.is_empty() {
        kiln::wgpu::adapters().iter().map(|a| a.index).collect()
    } else {
        devices
            .iter()
            .map(|d| {
                let spec: kiln::DeviceSpec = d.parse()?;
                spec.adapter_index()?.ok_or_else(|| {
                    anyhow::anyhow!("`cpu` is the reference backend, not a benchmarked device")
                })
            })
            .collect::<Result<_>>()?
    };
    if indices.is_empty() {
        anyhow::bail!("no GPU adapter found. {}", kiln::wgpu::NO_ADAPTER_HINT);
    }
    Ok(indices
        .iter()
        .map(|&i| kiln::wgpu::WgpuDevice::open(i, options))
        .collect::<Result<Vec<_>, _>>()?)
}

/// The devices `--devices` names (default: every wgpu adapter), opened: wgpu adapters
/// and the raw Vulkan backend's `vk:N`, in the order given, for the benches that run
/// through the `Device` trait alone and so compare both backends side by side.
fn bench_any_devices(
    devices: &[String],
    options: &kiln::wgpu::DeviceOptions,
) -> Result<Vec<Box<dyn kiln::engine::Device>>> {
    if devices.is_empty() {
        return Ok(bench_devices(devices, options)?
            .into_iter()
            .map(|d| Box::new(d) as Box<dyn kiln::engine::Device>)
            .collect());
    }
    devices
        .iter()
        .map(|d| match d.parse::<kiln::DeviceSpec>()? {
            kiln::DeviceSpec::Vk(n) => Ok(Box::new(kiln::vulkan::VkDevice::open(n, options)?)
                as Box<dyn kiln::engine::Device>),
            _ => Ok(
                Box::new(bench_devices(std::slice::from_ref(d), options)?.remove(0))
                    as Box<dyn kiln::engine::Device>,
            ),
        })
        .collect()
}

fn bench_peak(args: PeakArgs) -> Result<()> {
    use kiln::profile::{format_peaks, measure_peak, store_peaks};
    let devs = bench_devices(&args.devices, &Default::default())?;
    let mut rows = vec![];
    for dev in &devs {
        errln!("kiln bench peak: {}", dev.caps().name);
        rows.push(measure_peak(dev)?);
    }
    if args.json {
        outln!("{}", serde_json::to_string_pretty(&rows)?);
    } else {
        out!("{}", format_peaks(&rows));
    }
    let path = store_peaks(&rows)?;
    errln!("cached in {}", path.display());
    Ok(())
}

fn bench_train(a: TrainBenchArgs) -> Result<()> {
    use kiln::bench_train::{bench_model, format_table, measure, precision_config};
    // Every argument is checked before anything compiles or runs.
    let models = a
        .model
        .iter()
        .map(|m| bench_model(m, a.micro_batch))
        .collect::<Result<Vec<_>>>()?;
    for p in &a.precision {
        precision_config(p)?;
    }
    if let Some(t) = a.peak_tflops.filter(|t| !(t.is_finite() && *t > 0.0)) {
        anyhow::bail!("--peak-tflops {t}: give the device's peak as a positive number");
    }
    let devs = bench_any_devices(&a.devices, &Default::default())?;
    let opts = kiln::bench_train::TrainBenchOptions {
        steps: a.steps,
        gemm_budget: std::time::Duration::from_millis(a.gemm_budget_ms),
        peak_tflops: a.peak_tflops,
    };
    let mut rows = vec![];
    for model in &models {
        for dev in &devs {
            for p in &a.precision {
                errln!(
                    "kiln bench train: {} on {} ({}) at {p}",
                    model.name,
                    dev.caps().name,
                    dev.caps().backend
                );
                rows.push(measure(dev.as_ref(), model, p, &opts)?);
            }
        }
    }
    if rows.iter().any(|r| r.mfu.is_none()) {
        errln!("MFU needs the adapter's peak: run `kiln bench peak` once, or pass --peak-tflops");
    }
    match &a.json {
        Some(path) => kiln::bench::write_json(&rows, path)?,
        None => outln!("{}", format_table(&rows)),
    }
    Ok(())
}

fn bench_sample(args: BenchSampleArgs) -> Result<()> {
    use kiln::bench_sample::{format_sample, measure, model_by_name};
    let dtype: kiln::engine::DType = args.dtype.parse()?;
    if !dtype.is_float() {
        anyhow::bail!("generation takes f32, f16 or bf16, not {dtype}");
    }
    if args.prompt == 0 || args.tokens == 0 {
        anyhow::bail!(
            "--prompt {} --tokens {}: both must be at least 1 (there is no rate of nothing)",
            args.prompt,
            args.tokens
        );
    }
    let models = args
        .models
        .iter()
        .map(|m| {
            let mut cfg = model_by_name(m)?;
            cfg.n_layer = args.layers.unwrap_or(cfg.n_layer);
            Ok((m.as_str(), cfg))
        })
        .collect::<Result<Vec<_>>>()?;
    let options = kiln::wgpu::DeviceOptions {
        disable_f16: args.no_f16,
        ..Default::default()
    };
    let devs = bench_any_devices(&args.devices, &options)?;
    let mut rows = vec![];
    for dev in &devs {
        for (name, cfg) in &models {
            // A short block (the addition demo's 9: a 6-token problem `47+85=` and its
            // 3-token answer) gives a third to decoding and the rest to the prompt.
            let decode = args.tokens.min(cfg.block_size / 3).max(1);
            let prompt = args.prompt.min(cfg.block_size - decode).max(1);
            errln!(
                "kiln bench sample: {} on {}, {dtype}, {prompt} prompt + {decode} decoded tokens",
                name,
                dev.caps().name
            );
            match measure(dev.as_ref(), name, cfg, dtype, prompt, decode) {
                Ok(r) => {
                    errln!(
                        "  prompt {:.1} tok/s, decode {:.1} tok/s (setup {:.1} s)",
                        r.prompt_tok_s,
                        r.decode_tok_s,
                        r.setup_s
                    );
                    rows.push(r);
                }
                Err(e) => errln!("  cannot run: {e}"),
            }
        }
    }
    outln!("{}", format_sample(&rows));
    if let Some(path) = args.json {
        kiln::bench::write_json(&rows, &path)?;
    }
    Ok(())
}

fn bench_attention(args: AttentionArgs) -> Result<()> {
    use kiln::bench::{attention_table, format_attention};
    let dtype: kiln::engine::DType = args.dtype.parse()?;
    if !dtype.is_float() {
        anyhow::bail!("attention takes f32, f16 or bf16, not {dtype}");
    }
    let options = kiln::wgpu::DeviceOptions {
        disable_f16: args.no_f16,
        ..Default::default()
    };
    let devs = bench_any_devices(&args.devices, &options)?;
    errln!(
        "kiln bench attention: {} device(s), causal, B*H = {}, d = {}, {dtype}, T = {:?}",
        devs.len(),
        args.heads,
        args.dim,
        args.seqs
    );
    let mut rows = vec![];
    for dev in &devs {
        rows.extend(attention_table(
            dev.as_ref(),
            dtype,
            args.heads,
            args.dim,
            &args.seqs,
            std::time::Duration::from_millis(args.budget_ms),
            |r| {
                let straight = match (r.straight_ms, r.speedup, r.straight_bytes) {
                    (Some(ms), Some(x), Some(b)) => format!("{ms:.2} ms ({x:.2}x), {b} bytes"),
                    _ => "cannot run: its T x T scores exceed the binding limit".into(),
                };
                errln!(
                    "  {} ({}) T={}: fused {:.2} ms, {} bytes; straightforward {straight}",
                    r.adapter,
                    r.backend,
                    r.seq,
                    r.fused_ms,
                    r.fused_bytes
                )
            },
        )?);
    }
    outln!("{}", format_attention(&rows));
    if let Some(path) = args.json {
        kiln::bench::write_json(&rows, &path)?;
    }
    Ok(())
}

fn bench_matmul(args: MatmulArgs) -> Result<()> {
    let MatmulArgs {
        devices,
        dtypes,
        sizes,
        budget_ms,
        naive_up_to,
        no_f16,
        variants,
        spirv,
        json,
    } = args;
    use kiln::bench::{default_shapes, format_table, matmul_table, Shape};
    use kiln::engine::DType;
    use kiln::wgpu::{DeviceOptions, WgpuDevice};

    let options = DeviceOptions {
        disable_f16: no_f16,
        ..Default::default()
    };
    // wgpu adapters, and raw Vulkan devices (`vk:N`: the planner's WGSL GEMM as naga
    // SPIR-V, timed through the Device trait).
    let (mut indices, mut vk_indices) = (vec![], vec![]);
    if devices.is_empty() {
        indices = kiln::wgpu::adapters().iter().map(|a| a.index).collect();
    }
    for d in &devices {
        match d.parse::<kiln::DeviceSpec>()? {
            kiln::DeviceSpec::Vk(n) => vk_indices.push(n),
            spec => indices.push(spec.adapter_index()?.ok_or_else(|| {
                anyhow::anyhow!("`cpu` is the reference, not a benchmarked device; it is measured as `cpu GFLOP/s` in every row")
            })?),
        }
    }
    if indices.is_empty() && vk_indices.is_empty() {
        anyhow::bail!("no GPU adapter found. {}", kiln::wgpu::NO_ADAPTER_HINT);
    }
    let vk_devs = vk_indices
        .iter()
        .map(|&n| Ok(kiln::vulkan::VkDevice::open(n, &options)?))
        .collect::<Result<Vec<_>>>()?;
    let devs = indices
        .iter()
        .map(|&i| WgpuDevice::open(i, &options))
        .collect::<Result<Vec<_>, _>>()?;
    let dtypes = dtypes
        .iter()
        .map(|d| d.parse::<DType>())
        .collect::<Result<Vec<_>, _>>()?;
    if let Some(bad) = dtypes.iter().find(|d| !d.is_float()) {
        anyhow::bail!("matmul takes f32, f16 or bf16, not {bad}");
    }
    let spirv_devs = if spirv {
        let vulkan: Vec<(usize, &WgpuDevice)> = indices
            .iter()
            .copied()
            .zip(&devs)
            .filter(|(_, d)| d.caps().backend == "vulkan")
            .collect();
        if vulkan.is_empty() {
            anyhow::bail!("--spirv runs the SPIR-V GEMM on Vulkan devices, and none is benchmarked (add --devices vulkan)");
        }
        vulkan
            .into_iter()
            .map(|(i, d)| Ok((d.caps().name.clone(), kiln::wgpu::SpirvMatmul::open(i)?)))
            .collect::<Result<Vec<_>>>()?
    } else {
        vec![]
    };
    let extra = variants
        .iter()
        .map(|v| v.parse::<kiln::wgpu::MatmulVariant>())
        .collect::<Result<Vec<_>, _>>()?;
    let shapes = if sizes.is_empty() {
        default_shapes()
    } else {
        sizes.into_iter().map(Shape::square).collect()
    };
    errln!(
        "kiln bench matmul: {} device(s), {} dtype(s), {} shape(s); CPU reference: matrixmultiply sgemm, {} threads",
        devs.len(),
        dtypes.len(),
        shapes.len(),
        std::thread::available_parallelism().map_or(1, |n| n.get())
    );
    let rows = matmul_table(
        &devs,
        &dtypes,
        &shapes,
        std::time::Duration::from_millis(budget_ms),
        &kiln::bench::Runs {
            naive_up_to,
            extra: &extra,
            spirv: &spirv_devs,
            vk: &vk_devs,
        },
        |r| {
            errln!(
                "  {} {} {}x{}x{} {} {}: {:.2} GFLOP/s (cpu {:.1}, ratio {:.3})",
                r.backend,
                r.dtype,
                r.m,
                r.n,
                r.k,
                r.op,
                r.variant,
                r.gflops,
                r.cpu_gflops,
                r.ratio
            )
        },
    )?;
    outln!("{}", format_table(&rows));
    if let Some(path) = json {
        kiln::bench::write_json(&rows, &path)?;
    }
    Ok(())
}
