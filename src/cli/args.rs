//! `kiln`'s command line as clap reads it: the commands, their subcommands and flags.

use std::path::PathBuf;

use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(name = "kiln", version, about = "Mixed-precision training on any GPU")]
pub(crate) struct Cli {
    #[command(subcommand)]
    pub(crate) command: Command,
    /// Keep the planner's table of GEMM blocks on CPU-class adapters (lavapipe)
    /// instead of timing candidates at each shape's first use (KILN_GEMM_TUNE=0).
    #[arg(long, global = true)]
    pub(crate) no_tune: bool,
}

#[derive(Subcommand)]
pub(crate) enum Command {
    /// List compute adapters and what they can do.
    Devices {
        /// Print JSON (one object per adapter) instead of a table.
        #[arg(long)]
        json: bool,
    },
    /// Train a GPT from a DeepSpeed config (no arguments: the built-in addition demo).
    Train(Box<TrainArgs>),
    /// Continue a prompt with a trained model, streaming the text to stdout.
    Sample(SampleArgs),
    /// Loss and perplexity of a trained model on held-out data or a token file.
    Eval(EvalArgs),
    /// Write a trained or imported model as a Hugging Face directory (config.json,
    /// model.safetensors, the tokenizer files) that `transformers` loads.
    Export {
        /// A run directory (its latest checkpoint), a checkpoint directory, or a model to
        /// import (as `kiln sample` takes them).
        source: PathBuf,
        /// `hf`: a Hugging Face model directory (GPT-2, Llama, Qwen2 or Mistral).
        #[arg(long, default_value = "hf")]
        format: String,
        /// The directory to write.
        #[arg(long)]
        out: PathBuf,
        /// A LoRA adapter in PEFT's format to merge into the model (needs --merge).
        #[arg(long, value_name = "DIR")]
        adapter: Option<PathBuf>,
        /// Write the base with the LoRA adapters merged in (a LoRA run, or --adapter): a
        /// whole model `transformers` loads without PEFT. A LoRA run's adapters alone
        /// are in RUN/adapter already.
        #[arg(long)]
        merge: bool,
    },
    /// Check or explain a DeepSpeed config file.
    Config {
        #[command(subcommand)]
        what: ConfigWhat,
    },
    /// Turn a text file into a `.bin` token file (u16 tokens, u32 past 65536 ids, with a
    /// `.json` sidecar).
    Prepare(PrepareArgs),
    /// Show what fine-tuning trains on: one dataset row through a model's chat
    /// template, the assistant's text marked (or as JSON with its spans, and with the
    /// model's tokenizer the tokens and their loss mask).
    Template {
        /// The model directory (tokenizer_config.json or chat_template.jinja; with
        /// tokenizer.json, the tokens too).
        dir: PathBuf,
        /// One dataset row as JSON: {"messages": [{"role", "content"}, ...], "tools": [...]}.
        #[arg(long)]
        messages: PathBuf,
        /// End with the assistant's header, as for generation.
        #[arg(long)]
        add_generation_prompt: bool,
        /// The date `strftime_now` gives the template (`26 Jul 2026` or `2026-07-26`);
        /// default today.
        #[arg(long)]
        date: Option<String>,
        /// Print JSON: text, assistant_spans (character offsets), span_method, and with
        /// a tokenizer tokens and mask.
        #[arg(long)]
        json: bool,
        /// A Jinja chat template file to use instead of the model's.
        #[arg(long)]
        chat_template: Option<PathBuf>,
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
        /// The model's sizes as JSON (GPT-2: n_layer, n_head, n_embd, block_size,
        /// vocab_size; a Llama: "architecture": "llama" and its keys).
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
        /// The memory of LoRA training (as `kiln train --lora`): adapters
        /// `r=16,alpha=32,dropout=0.05,targets=q_proj+v_proj` (targets joined by +, or
        /// all-linear, the default) over the model, frozen: its weights shown apart, once
        /// in the storage precision, and gradients, master+Adam and ZeRO's shards the
        /// adapters' only [default: the config's kiln.lora, else full training].
        #[arg(long, value_name = "SETTINGS")]
        lora: Option<String>,
        /// The memory with activation checkpointing: every block (no value) or ranges
        /// of N blocks recomputed in backward [default: the config's]
        #[arg(long, value_name = "N", num_args = 0..=1, default_missing_value = "1")]
        activation_checkpointing: Option<usize>,
        /// Instead of the ZeRO table, which ways of training fit devices of these sizes
        /// (`8GiB,16GiB`; K/KiB, M/MiB, G/GiB, T/TiB, all binary): full training, LoRA
        /// (--lora, else the config's kiln.lora, else r=16,alpha=32,targets=all-linear)
        /// and each with activation checkpointing (--activation-checkpointing N, else the
        /// config's, else every block), on 1 device and with ZeRO-2 across 2 and 4, and
        /// the cheapest that fits each size.
        #[arg(long, value_delimiter = ',', value_name = "SIZES")]
        fits: Vec<String>,
        /// Check against this much memory per device instead of the driver's budget or
        /// heap, as `kiln train --memory-limit` would run (with --devices given as
        /// specs).
        #[arg(long, value_name = "SIZE")]
        memory_limit: Option<String>,
    },
    /// Measure kernel throughput.
    Bench {
        #[command(subcommand)]
        what: BenchWhat,
    },
}

#[derive(clap::Args)]
pub(crate) struct TrainArgs {
    /// DeepSpeed config (`ds_config.json`); default: demos/addition.ds_config.json.
    #[arg(long)]
    pub(crate) config: Option<PathBuf>,
    /// GPT sizes as JSON {n_layer, n_head, n_embd, block_size, vocab_size}; default:
    /// demos/addition.model.json (vocab_size taken from the data).
    #[arg(long)]
    pub(crate) model: Option<PathBuf>,
    /// Training data: a `.bin` token file from `kiln prepare`, or any other file as
    /// bytes (refused if a token-file sidecar says it holds tokens); default: built-in
    /// 2-digit addition problems.
    #[arg(long)]
    pub(crate) data: Option<PathBuf>,
    /// Device to train on (`kiln devices` lists them); default: the config's
    /// kiln.devices, else the best adapter.
    #[arg(long, value_delimiter = ',')]
    pub(crate) devices: Vec<String>,
    /// Run directory; default: runs/<UTC date and time>.
    #[arg(long)]
    pub(crate) out: Option<PathBuf>,
    /// Total optimizer steps, at least 1; default: a resumed run's own, else kiln.steps,
    /// else the scheduler's total_num_steps, else 1000.
    #[arg(long)]
    pub(crate) steps: Option<u64>,
    /// Evaluate on held-out data every N steps, 0: only at the end [default: a resumed
    /// run's own, else kiln.eval_every, else 50].
    #[arg(long)]
    pub(crate) eval_every: Option<u64>,
    /// An example file (from `kiln prepare` of a dataset) trains one example per row,
    /// padded, instead of packing several to a row (kiln.packing false).
    #[arg(long)]
    pub(crate) no_packing: bool,
    /// Checkpoint every N steps, 0: only at the end [default: a resumed run's own, else
    /// kiln.checkpoint_every, else 200].
    #[arg(long)]
    pub(crate) checkpoint_every: Option<u64>,
    /// Checkpoints to keep, 0: all [default: a resumed run's own, else
    /// kiln.keep_checkpoints, else 3].
    #[arg(long)]
    pub(crate) keep_checkpoints: Option<usize>,
    /// Continue the run in --out from its latest checkpoint.
    #[arg(long)]
    pub(crate) resume: bool,
    /// Start from these weights, with a fresh optimizer: a Kiln run directory (its
    /// latest checkpoint) or checkpoint directory, a Hugging Face GPT-2 or Llama-family
    /// directory or GPT-2 model.safetensors (config.json beside it), or an llm.c .bin.
    /// The model's sizes come from it (a --model must agree; only its block_size may be
    /// smaller).
    #[arg(long, value_name = "PATH")]
    pub(crate) init_from: Option<PathBuf>,
    /// Train on sequences of this many tokens instead of the model's block_size (at
    /// most it): a Hugging Face model's block_size is the longest context it reaches
    /// (8192 for SmolLM2), more than a fine-tuning step needs.
    #[arg(long)]
    pub(crate) seq: Option<usize>,
    /// Seed of the weights and the data order [default: a resumed run's own, else
    /// kiln.seed, else 1].
    #[arg(long)]
    pub(crate) seed: Option<u64>,
    /// Profile N steps after the first (which compiles the kernels): a Chrome/Perfetto
    /// trace.json and profile.txt in the run directory, and a table of where each
    /// step's time went, kernel by kernel.
    #[arg(long, value_name = "STEPS", num_args = 0..=1, default_missing_value = "3")]
    pub(crate) profile: Option<u64>,
    /// One device's peak TFLOP/s for the profile's MFU [default: `kiln bench peak`'s
    /// cached measure of the adapter].
    #[arg(long, value_name = "TFLOPS")]
    pub(crate) peak_tflops: Option<f64>,
    /// Split the model into this many pipeline stages, one device each (stage-major:
    /// `--devices vulkan:0x2 --pipeline-stages 2` puts stage 0 on the first device)
    /// [default: the config's pipeline.stages or kiln.pipeline_stages, else 1].
    #[arg(long, value_name = "N")]
    pub(crate) pipeline_stages: Option<usize>,
    /// How the blocks are cut into stages: `parameters` (balance parameter counts,
    /// DeepSpeed's default), `uniform` (blocks), or blocks per stage (`3,5`)
    /// [default: the config's pipeline.partition, else parameters].
    #[arg(long)]
    pub(crate) partition: Option<String>,
    /// Train LoRA adapters on the frozen model instead of every weight:
    /// `r=16,alpha=32,dropout=0.05,targets=q_proj+k_proj+v_proj+o_proj` (targets joined by
    /// +, or all-linear, the default) [default: the config's kiln.lora, else full
    /// training]. The base comes from --init-from; adapters are saved in PEFT's format
    /// in RUN/adapter.
    #[arg(long, value_name = "SETTINGS")]
    pub(crate) lora: Option<String>,
    /// The device memory a run may use on each device (`8GiB`, `512MiB`), in place of
    /// what the driver reports: a run over it is refused at start with the numbers.
    /// Less leaves room for other work on a shared GPU or checks a run against a
    /// smaller device; more lets a CPU driver such as lavapipe, which holds device
    /// memory in host memory, go past the heap it reports [default: the driver's
    /// budget, else its heap, as `kiln devices` shows].
    #[arg(long, value_name = "SIZE")]
    pub(crate) memory_limit: Option<String>,
    /// Start the LoRA adapters from this PEFT adapter directory (adapter_config.json +
    /// adapter_model.safetensors), for the --init-from base it was trained on.
    #[arg(long, value_name = "DIR")]
    pub(crate) adapter: Option<PathBuf>,
    /// For --data given as a dataset of rows (.jsonl, .json, .parquet, a directory,
    /// .csv, .tsv): the tokenizer to prepare it with, as `kiln prepare --tokenizer` takes
    /// it [default: the --init-from directory's tokenizer.json]. The examples go into the
    /// run directory (data/examples.bin), which a --resume reuses.
    #[arg(long)]
    pub(crate) tokenizer: Option<String>,
    #[command(flatten)]
    pub(crate) rows: RowArgs,
}

#[derive(clap::Args)]
pub(crate) struct SampleArgs {
    /// A run directory (its latest checkpoint), a checkpoint directory
    /// (runs/NAME/checkpoints/step-N), a Hugging Face GPT-2 or Llama-family directory
    /// (config.json + model.safetensors or shards; a Llama's tokenizer.json decodes) or
    /// an llm.c .bin.
    pub(crate) source: PathBuf,
    /// The text to continue.
    #[arg(long)]
    pub(crate) prompt: Option<String>,
    /// A file of prompts, one per line, each continued in turn.
    #[arg(long)]
    pub(crate) prompts: Option<PathBuf>,
    /// New tokens per prompt [default: as many as the model's context holds, at most 256].
    #[arg(long)]
    pub(crate) tokens: Option<usize>,
    /// 0: always the likeliest token; 1: the model's distribution; higher: flatter.
    #[arg(long, default_value_t = 1.0, allow_negative_numbers = true)]
    pub(crate) temperature: f32,
    /// Draw only from the K likeliest tokens.
    #[arg(long)]
    pub(crate) top_k: Option<usize>,
    /// Draw only from the likeliest tokens holding this share of the probability (0, 1].
    #[arg(long, allow_negative_numbers = true)]
    pub(crate) top_p: Option<f32>,
    /// Seed of the draws: the same seed gives the same text.
    #[arg(long, default_value_t = 1)]
    pub(crate) seed: u64,
    /// The device (`kiln devices` lists them); default: the best adapter.
    #[arg(long, value_delimiter = ',')]
    pub(crate) devices: Vec<String>,
    /// Run in f32, f16 or bf16 [default: the checkpoint's own; for imported files their
    /// 16-bit dtype, else f16].
    #[arg(long)]
    pub(crate) dtype: Option<String>,
    /// Treat each prompt as a user's message in the model's chat template (an instruct
    /// model's tokenizer_config.json has one): the model answers it.
    #[arg(long)]
    pub(crate) chat: bool,
    /// A LoRA adapter in PEFT's format (adapter_config.json + adapter_model.safetensors)
    /// to merge into the model's weights first: the model is its base.
    #[arg(long, value_name = "DIR")]
    pub(crate) adapter: Option<PathBuf>,
}

#[derive(clap::Args)]
pub(crate) struct EvalArgs {
    /// A run directory (its latest checkpoint), a checkpoint directory
    /// (runs/NAME/checkpoints/step-N), a Hugging Face GPT-2 or Llama-family directory
    /// (config.json + model.safetensors or shards) or an llm.c .bin (imported models
    /// need --data).
    pub(crate) source: PathBuf,
    /// Score every row of this token file (`kiln prepare`) or text file instead of the
    /// run's held-out data.
    #[arg(long)]
    pub(crate) data: Option<PathBuf>,
    /// The device (`kiln devices` lists them); default: the best adapter.
    #[arg(long, value_delimiter = ',')]
    pub(crate) devices: Vec<String>,
    /// Sequences per forward pass [default: the run's micro-batch].
    #[arg(long)]
    pub(crate) micro_batch: Option<usize>,
    /// Run in f32, f16 or bf16 [default: the checkpoint's own; for imported files their
    /// 16-bit dtype, else f16].
    #[arg(long)]
    pub(crate) dtype: Option<String>,
    /// Positions per scored row [default: the model's block_size; for a Hugging Face
    /// Llama directory at most 1024 and its sliding window].
    #[arg(long)]
    pub(crate) seq: Option<usize>,
    /// Score an example file (--data, from `kiln prepare` of a dataset) packed several
    /// examples to a row, as training packs them: each attends only to itself, so the
    /// loss is the one-per-row loss, in fewer rows.
    #[arg(long)]
    pub(crate) packed: bool,
    /// Print the result as JSON.
    #[arg(long)]
    pub(crate) json: bool,
    /// A LoRA adapter in PEFT's format (adapter_config.json + adapter_model.safetensors)
    /// to merge into the model's weights first: the model is its base.
    #[arg(long, value_name = "DIR")]
    pub(crate) adapter: Option<PathBuf>,
}

#[derive(Subcommand)]
pub(crate) enum ConfigWhat {
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
pub(crate) enum RunsWhat {
    /// What changed between two runs' configs, and what it did to loss and throughput.
    Diff { a: PathBuf, b: PathBuf },
}

#[derive(Subcommand)]
pub(crate) enum BenchWhat {
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
    /// Every adapter and backend found (or --devices) on the same work: GEMM at GPT
    /// shapes and 1024³/2048³ in f32/f16/bf16, fused attention forward + backward at T
    /// 512/1024/2048, training steps — each with % of the adapter's measured peak —
    /// written as report.md, report.json and report.svg, with the host, drivers and
    /// Kiln's commit.
    Report(ReportArgs),
}

#[derive(clap::Args)]
pub(crate) struct ReportArgs {
    /// Devices to measure (`kiln devices`); default: every wgpu adapter, every vk:N and
    /// the CPU reference.
    #[arg(long, value_delimiter = ',')]
    pub(crate) devices: Vec<String>,
    /// Time each measurement for about this many milliseconds.
    #[arg(long, default_value_t = 500)]
    pub(crate) budget_ms: u64,
    /// A quick check: shapes a quarter the size, attention at T 64, the demo model's
    /// step [models default: demo].
    #[arg(long)]
    pub(crate) quick: bool,
    /// Models to train a few steps on each device (`kiln bench train` names or model
    /// JSON files) [default: demo,small,smollm2-135m; with --quick, demo].
    #[arg(long, value_delimiter = ',')]
    pub(crate) models: Vec<String>,
    /// Directory for report.md, report.json and report.svg.
    #[arg(long, default_value = "bench-report")]
    pub(crate) out: std::path::PathBuf,
}

#[derive(clap::Args)]
pub(crate) struct PipelineBenchArgs {
    /// The adapter whose devices are the stages (`kiln devices`); default: vulkan.
    #[arg(long, default_value = "vulkan")]
    pub(crate) device: String,
    /// Model: `small` (5.29M GPT, T 128, micro-batch 8), `demo`, `gpt2`, or a model
    /// JSON file.
    #[arg(long, default_value = "small")]
    pub(crate) model: String,
    /// Sequences per micro-batch instead of the model's own.
    #[arg(long)]
    pub(crate) micro_batch: Option<usize>,
    /// Stage counts to measure.
    #[arg(long, value_delimiter = ',', default_value = "1,2,4")]
    pub(crate) stages: Vec<usize>,
    /// Micro-batches per step (m); default: p and 4p for each stage count p.
    #[arg(long, value_delimiter = ',')]
    pub(crate) micro_batches: Vec<usize>,
    /// Timed steps after the warm-up step (which compiles).
    #[arg(long, default_value_t = 2)]
    pub(crate) steps: usize,
    /// Write the rows as JSON to this file (`-` for stdout) as well.
    #[arg(long)]
    pub(crate) json: Option<String>,
    /// The modelled box: each GPU's link to the host, GB/s each way (PCIe 4.0 x16:
    /// 31.5 GB/s raw per direction, about 25 in host-staged copies).
    #[arg(long, default_value_t = 25.0)]
    pub(crate) link_gbps: f64,
    /// The modelled box: fixed cost of each copy over a link, microseconds.
    #[arg(long, default_value_t = 10.0)]
    pub(crate) link_latency_us: f64,
    /// The modelled box: how many times faster than this adapter a GPU computes each
    /// stage (1: the compute times as measured).
    #[arg(long, default_value_t = 1.0)]
    pub(crate) gpu_speedup: f64,
}

#[derive(clap::Args)]
pub(crate) struct TrainBenchArgs {
    /// Models: `small` (5.29M GPT, T 128, micro-batch 8), `demo` (the addition demo),
    /// `gpt2` (124M at T 1024, micro-batch 1), `smollm2-135m` (SmolLM2-135M's Llama
    /// shapes at T 128, micro-batch 1), or model JSON files.
    #[arg(long, value_delimiter = ',', default_value = "small")]
    pub(crate) model: Vec<String>,
    /// Devices to measure (`kiln devices` lists them); default: every adapter.
    #[arg(long, value_delimiter = ',')]
    pub(crate) devices: Vec<String>,
    /// Precisions: fp32, fp16, bf16 (fp16/bf16 keep fp32 master weights).
    #[arg(long, value_delimiter = ',', default_value = "fp32")]
    pub(crate) precision: Vec<String>,
    /// Sequences per step instead of the model's own micro-batch.
    #[arg(long)]
    pub(crate) micro_batch: Option<usize>,
    /// Timed steps after the warm-up step (which compiles).
    #[arg(long, default_value_t = 3)]
    pub(crate) steps: usize,
    /// Time each distinct GEMM of the step for about this many milliseconds.
    #[arg(long, default_value_t = 200)]
    pub(crate) gemm_budget_ms: u64,
    /// One device's peak TFLOP/s for the MFU [default: `kiln bench peak`'s cache].
    #[arg(long)]
    pub(crate) peak_tflops: Option<f64>,
    /// How the model trains, one row each: full (every weight), ckpt (full with
    /// activation checkpointing), lora (adapters on the frozen model), lora+ckpt.
    #[arg(long, value_delimiter = ',', default_value = "full")]
    pub(crate) variants: Vec<String>,
    /// The adapters of the lora variants, as `kiln train --lora` takes them.
    #[arg(long, default_value = "r=16,alpha=32")]
    pub(crate) lora: String,
    /// Measure each variant also with activation checkpointing, the row after it
    /// (full, then ckpt; lora, then lora+ckpt): what the recomputed forward costs and
    /// saves.
    #[arg(long)]
    pub(crate) activation_checkpointing: bool,
    /// The device memory a run may use on each device, as `kiln train --memory-limit`
    /// takes it.
    #[arg(long, value_name = "SIZE")]
    pub(crate) memory_limit: Option<String>,
    /// Write the rows as JSON to this file (`-` for stdout) instead of a table.
    #[arg(long)]
    pub(crate) json: Option<String>,
}

#[derive(clap::Args)]
pub(crate) struct PeakArgs {
    /// Devices to measure (`kiln devices` lists them); default: every adapter.
    #[arg(long, value_delimiter = ',')]
    pub(crate) devices: Vec<String>,
    /// Print JSON (one object per adapter) instead of a table.
    #[arg(long)]
    pub(crate) json: bool,
}

#[derive(clap::Args)]
pub(crate) struct BenchSampleArgs {
    /// Devices to measure (`kiln devices` lists them); default: every adapter.
    #[arg(long, value_delimiter = ',')]
    pub(crate) devices: Vec<String>,
    /// Models: `addition` (the demo's shape) and `gpt2-124m`.
    #[arg(long, value_delimiter = ',', default_value = "addition,gpt2-124m")]
    pub(crate) models: Vec<String>,
    /// Storage dtype of weights, activations and the cache.
    #[arg(long, default_value = "f16")]
    pub(crate) dtype: String,
    /// Prompt tokens (cut to fit a model's block_size with the decoded ones).
    #[arg(long, default_value_t = 64)]
    pub(crate) prompt: usize,
    /// Tokens to decode after the prompt.
    #[arg(long, default_value_t = 32)]
    pub(crate) tokens: usize,
    /// Run every model with this many layers instead of its own (a quicker measure of
    /// a large model's per-layer cost).
    #[arg(long)]
    pub(crate) layers: Option<usize>,
    /// Turn native f16 off on every device (measures the packed path).
    #[arg(long)]
    pub(crate) no_f16: bool,
    /// Write the rows as JSON to this file (`-` for stdout) as well.
    #[arg(long)]
    pub(crate) json: Option<String>,
}

#[derive(clap::Args)]
pub(crate) struct DpArgs {
    /// The adapter whose devices are grouped.
    #[arg(long, default_value = "vulkan")]
    pub(crate) device: String,
    /// Group sizes to measure.
    #[arg(long, value_delimiter = ',', default_value = "1,2,4")]
    pub(crate) counts: Vec<usize>,
    /// GPT sizes as JSON; default: 4 layers, 128 embd, 4 heads, T 64, vocab 512.
    #[arg(long)]
    pub(crate) model: Option<PathBuf>,
    /// Samples per device per step.
    #[arg(long, default_value_t = 8)]
    pub(crate) micro: usize,
    /// Timed steps per group size (after one warm-up step).
    #[arg(long, default_value_t = 5)]
    pub(crate) steps: usize,
    /// PCIe bandwidth per GPU for the model, GB/s (PCIe 4.0 x16 moves ~25 in practice).
    #[arg(long, default_value_t = 25.0)]
    pub(crate) pcie_gbps: f64,
    /// Host memory bandwidth for adding gradients, GB/s.
    #[arg(long, default_value_t = 20.0)]
    pub(crate) host_gbps: f64,
    /// Exchange after backward instead of overlapping it (`overlap_comm: false`).
    #[arg(long)]
    pub(crate) no_overlap: bool,
    /// ZeRO stage (`zero_optimization.stage`, 0 to 3).
    #[arg(long, default_value_t = 0, value_parser = clap::value_parser!(u8).range(0..=3))]
    pub(crate) zero: u8,
    /// Keep the optimizer state in host memory and step it there
    /// (`offload_optimizer.device: "cpu"`; ZeRO stage 1, 2 or 3).
    #[arg(long)]
    pub(crate) offload: bool,
    /// Stage 3: no device holds a 16-bit copy of its shard; the host rounds the
    /// downloaded master (`offload_param.device: "cpu"`).
    #[arg(long)]
    pub(crate) offload_param: bool,
    /// Stage 3: tensors of fewer elements stay whole on every device
    /// (`stage3_param_persistence_threshold`; DeepSpeed's default).
    #[arg(long, default_value_t = 100_000)]
    pub(crate) persistence_threshold: u64,
    /// Under mpirun: network bandwidth per process for the model, GB/s (100 Gb/s
    /// Ethernet or InfiniBand EDR moves ~12).
    #[arg(long, default_value_t = 12.0)]
    pub(crate) net_gbps: f64,
    /// Under mpirun: network latency per message for the model, µs.
    #[arg(long, default_value_t = 5.0)]
    pub(crate) net_latency_us: f64,
    /// Under mpirun: elements per bucket the processes sum (`reduce_bucket_size`);
    /// smaller buckets overlap more of the exchange with backward.
    #[arg(long, default_value_t = 1 << 18)]
    pub(crate) bucket: usize,
}

#[derive(clap::Args)]
pub(crate) struct AttentionArgs {
    /// Devices to measure (`kiln devices` lists them); default: every adapter.
    #[arg(long, value_delimiter = ',')]
    pub(crate) devices: Vec<String>,
    /// Sequence lengths T.
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "128,256,512,1024,2048,4096"
    )]
    pub(crate) seqs: Vec<usize>,
    /// Head dim d.
    #[arg(long, default_value_t = 64)]
    pub(crate) dim: usize,
    /// Independent heads, B * H.
    #[arg(long, default_value_t = 4)]
    pub(crate) heads: usize,
    /// Storage dtype of q, k, v and the results.
    #[arg(long, default_value = "f32")]
    pub(crate) dtype: String,
    /// Measure each version for about this many milliseconds (at least 2 runs after a
    /// warm-up run).
    #[arg(long, default_value_t = 1000)]
    pub(crate) budget_ms: u64,
    /// Turn native f16 off on every device (measures the packed path).
    #[arg(long)]
    pub(crate) no_f16: bool,
    /// Write the rows as JSON to this file (`-` for stdout) as well.
    #[arg(long)]
    pub(crate) json: Option<String>,
}

#[derive(clap::Args)]
pub(crate) struct MatmulArgs {
    /// Devices to measure (`kiln devices` lists them); default: every adapter.
    #[arg(long, value_delimiter = ',')]
    pub(crate) devices: Vec<String>,
    /// Storage dtypes.
    #[arg(long, value_delimiter = ',', default_value = "f32,f16,bf16")]
    pub(crate) dtypes: Vec<String>,
    /// Square sizes to run instead of the default set (256..2048 and GPT shapes).
    #[arg(long, value_delimiter = ',')]
    pub(crate) sizes: Vec<usize>,
    /// Measure each row for about this many milliseconds.
    #[arg(long, default_value_t = 400)]
    pub(crate) budget_ms: u64,
    /// Largest dimension the naive baseline kernel is run at (it is slow).
    #[arg(long, default_value_t = 1024)]
    pub(crate) naive_up_to: usize,
    /// Turn native f16 off on every device (measures the packed path).
    #[arg(long)]
    pub(crate) no_f16: bool,
    /// Also measure these kernel variants (e.g. `cpu24x8,tiled32x64x8,gemv128`) beside the planner's choice
    /// (on `vk:N` too, as its hand-written SPIR-V GEMMs: `cpu`, `tiled` and `gemv` blocks).
    #[arg(long, value_delimiter = ',')]
    pub(crate) variants: Vec<String>,
    /// Also measure the hand-written SPIR-V GEMM (shaders/vulkan/matmul_cpu.comp) on
    /// every Vulkan device, through wgpu's SPIR-V passthrough (f32 and f16).
    #[arg(long)]
    pub(crate) spirv: bool,
    /// Write the rows as JSON to this file (`-` for stdout) as well.
    #[arg(long)]
    pub(crate) json: Option<String>,
}

/// `kiln prepare`: a text file to a token file, or a fine-tuning dataset (`.jsonl`, or
/// `.json` holding an array of rows) to an example file with its loss mask.
#[derive(clap::Args)]
pub(crate) struct PrepareArgs {
    /// The text file (UTF-8 for the GPT-2 and Hugging Face tokenizers), or a dataset of
    /// rows: JSON Lines (`.jsonl`), a JSON array (`.json`), Parquet (`.parquet`, a quoted
    /// glob of shards, or a directory of them), the directory `datasets.save_to_disk` writes (or an
    /// `.arrow` file), CSV or TSV, with `text`, `prompt`/`completion`, `messages` or
    /// ShareGPT `conversations` columns.
    pub(crate) input: PathBuf,
    /// The token file to write; its name must end in `.bin` (`kiln train` reads any
    /// other file as text), and it must not be the input.
    pub(crate) output: PathBuf,
    /// `gpt2` (GPT-2's BPE, vocab 50257), `bytes` (vocab 256), or a Hugging Face
    /// model directory or its tokenizer.json (the model's own tokenizer: Llama 3,
    /// SmolLM2, Qwen2.5, ...).
    #[arg(long, default_value = "gpt2")]
    pub(crate) tokenizer: String,
    #[command(flatten)]
    pub(crate) rows: RowArgs,
}

/// How a dataset of rows becomes examples (`kiln prepare`, and `kiln train --data` given
/// such a dataset, which prepares it into the run directory).
#[derive(clap::Args)]
#[command(next_help_heading = "Datasets of rows")]
pub(crate) struct RowArgs {
    /// A Jinja chat template for conversations, instead of the tokenizer directory's.
    #[arg(long)]
    pub(crate) chat_template: Option<PathBuf>,
    /// The date `strftime_now` gives the template (`26 Jul 2026` or `2026-07-26`);
    /// default today.
    #[arg(long)]
    pub(crate) date: Option<String>,
    /// The column holding plain text.
    #[arg(long, default_value = "text")]
    pub(crate) text_column: String,
    /// The column holding the prompt.
    #[arg(long, default_value = "prompt")]
    pub(crate) prompt_column: String,
    /// The column holding the completion.
    #[arg(long, default_value = "completion")]
    pub(crate) completion_column: String,
    /// The column holding a conversation's messages.
    #[arg(long, default_value = "messages")]
    pub(crate) messages_column: String,
    /// Cut examples longer than this many tokens.
    #[arg(long)]
    pub(crate) max_length: Option<usize>,
    /// Which end of a long example to keep: keep_start or keep_end.
    #[arg(long, default_value = "keep_start")]
    pub(crate) truncation: String,
    /// Train on every token, prompts and user turns too.
    #[arg(long)]
    pub(crate) train_on_inputs: bool,
    /// In a directory of Parquet shards (`<split>-NNNNN-of-NNNNN.parquet`) or a saved
    /// DatasetDict, the split to read, e.g. train.
    #[arg(long)]
    pub(crate) split: Option<String>,
}
