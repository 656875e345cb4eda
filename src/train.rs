//! `kiln train`: a GPT trained from a DeepSpeed config on one device, with prefetched
//! data, periodic evaluation, atomic checkpoints, `--resume`, and a run directory
//! holding the resolved config, per-step metrics, a summary and a chart.
//!
//! With no arguments it trains the built-in demo: a small GPT learning 2-digit addition
//! (`demos/addition.*.json`), scored by exact match on held-out problems.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{mpsc, Arc};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use kiln_engine::device::compiling;
use serde_json::{json, Value};

use kiln_engine::config::{self, PipelinePartition, Schedule, TrainConfig};
use kiln_engine::data::{
    self, Addition, BatchLayout, EvalRows, Loader, LoaderConfig, Sampler, TokenSource,
};
use kiln_engine::device::profile::{span, SpanKind};
use kiln_engine::models::{MicroBatch, ModelConfig, ModelStateBytes, Network, NetworkOptions};
use kiln_engine::parallel::collective::{Collective, Processes};
use kiln_engine::parallel::pipeline::Pipeline;
use kiln_engine::parallel::pipeline_partition::PartitionMethod;
use kiln_engine::train::checkpoint;
use kiln_engine::train::loss_scaler::LossScaler;
use kiln_engine::train::pipeline_trainer::PipelineTrainer;
use kiln_engine::train::runs::{self, MetricsWriter, StepRecord, Summary};
use kiln_engine::train::trainer::{self as engine_trainer, Trainer, TrainerState};
use kiln_engine::{Device, IGNORE_TARGET};
use kiln_wgpu::DeviceOptions;

use crate::devices::{default_device, open_device, parse_devices};
use crate::init_from::InitWeights;
use crate::say::say;
use crate::train_engine::Engine;

/// The demo's DeepSpeed config and model, used when `--config` / `--model` are absent.
pub const DEMO_DS_CONFIG: &str = include_str!("../demos/addition.ds_config.json");
pub const DEMO_MODEL: &str = include_str!("../demos/addition.model.json");

/// Training steps when neither `--steps` nor the scheduler's `total_num_steps` says.
const DEFAULT_STEPS: u64 = 1000;
/// Lines of the built-in addition stream (10 tokens each at 2 digits): 200k lines are
/// ~20 epochs' worth of the default run, so batches rarely repeat.
const ADDITION_LINES: u64 = 200_000;
/// At least this many rows are evaluated (rounded up to whole micro-batches).
const EVAL_ROWS: usize = 256;
/// Share of a data file kept for evaluation (its tail).
const HOLDOUT_FRACTION: f64 = 0.05;

/// Everything `kiln train` can be told. The `Option`s override the config's `kiln`
/// section when set (command-line flags); unset, the config (or its default) decides.
#[derive(Clone, Debug, Default)]
pub struct TrainOptions {
    /// DeepSpeed config file; `None`: the demo config.
    pub config: Option<PathBuf>,
    /// Model sizes (GPT-2 style JSON); `None`: the demo model (its vocab_size is
    /// replaced by the data's when the data is not the built-in addition task).
    pub model: Option<PathBuf>,
    /// Training data: a `.bin` token file or a text file (bytes); `None`: addition.
    pub data: Option<PathBuf>,
    /// Devices (`kiln devices` lists them); empty: `kiln.devices`, else the best adapter.
    pub devices: Vec<String>,
    /// Run directory; `None`: `runs/<UTC time>`.
    pub out: Option<PathBuf>,
    /// Optimizer steps to run in total, at least 1 (a resumed run counts the steps
    /// already done). On `resume`, this and the intervals, retention and seed below
    /// default to the run's own.
    pub steps: Option<u64>,
    /// Evaluate every this many steps (and at the end); 0: only at the end.
    pub eval_every: Option<u64>,
    /// Checkpoint every this many steps (and at the end); 0: only at the end.
    pub checkpoint_every: Option<u64>,
    /// Checkpoints kept (older ones are deleted once a newer one is complete).
    pub keep_checkpoints: Option<usize>,
    /// Seeds the weights and the data order.
    pub seed: Option<u64>,
    /// Continue the run in `out` from its latest checkpoint.
    pub resume: bool,
    /// Start from these weights (a fresh optimizer): a Kiln run directory (its latest
    /// checkpoint) or checkpoint directory, a Hugging Face GPT-2 directory or
    /// `model.safetensors`, or an llm.c `.bin`. The model's sizes come from it.
    pub init_from: Option<PathBuf>,
    /// Draw a progress bar and print log lines.
    pub progress: bool,
    /// Set (by Ctrl-C, SIGTERM or SIGHUP) to stop after the current step, checkpointing
    /// and writing the summary first.
    pub interrupt: Option<Arc<AtomicBool>>,
    /// This process's part in a multi-process job (`mpirun`): its devices are the
    /// ranks after the earlier processes' devices; the job trains one model. Process 0
    /// writes the run directory, logs and evaluates; every process reads its own shard
    /// of each global batch. Every process must be given the same settings.
    pub processes: Option<Arc<dyn Collective>>,
    /// Profile this many steps (after the first, which compiles): `trace.json` and
    /// `profile.txt` in the run directory, and the table printed.
    pub profile: Option<u64>,
    /// One device's peak in TFLOP/s, for the profile's MFU; default: `kiln bench peak`'s
    /// cached measure.
    pub peak_tflops: Option<f64>,
    /// Pipeline stages the devices are split into (stage-major: device `s * dp + r` is
    /// stage s of replica r); `None`: the config's `pipeline.stages`, else 1.
    pub pipeline_stages: Option<usize>,
    /// How the blocks are cut into stages (`parameters`, `uniform`, or blocks per
    /// stage such as `3,5`); `None`: the config's `pipeline.partition`.
    pub partition: Option<String>,
}

/// What a finished (or interrupted) run reports.
#[derive(Clone, Debug)]
pub struct RunReport {
    pub dir: PathBuf,
    /// Steps done in total (including those before a resume).
    pub steps: u64,
    pub interrupted: bool,
    pub summary: Summary,
}

/// The training data and how it is evaluated.
pub(crate) enum Dataset {
    /// The built-in task: exact-match accuracy on held-out problems.
    Addition { eval: EvalRows },
    /// A file: loss on windows from its held-out tail (none if it is too short).
    File { eval: Option<(Vec<u32>, Vec<u32>)> },
}

/// Resolves the config, opens the device, builds or restores the engine and trains.
///
/// Nothing is written until every setting is valid (config, model, data, devices, the
/// checkpoint to resume), so a run that fails to start leaves no run directory behind.
pub fn train(opts: &TrainOptions) -> Result<RunReport> {
    let started = Instant::now();
    // In a multi-process job, process 0 writes the run and speaks for the job.
    let writer = opts.processes.as_ref().is_none_or(|c| c.rank() == 0);
    let progress = opts.progress && writer;
    if opts.steps == Some(0) {
        bail!(
            "--steps 0: a run needs at least one optimizer step; pass --steps N with N >= 1 \
             (the total, counting the steps a resumed run has already done)"
        );
    }
    if opts.resume && opts.init_from.is_some() {
        bail!(
            "--init-from with --resume: a resumed run continues from its own checkpoint; drop \
             --init-from to resume, or drop --resume (and give a new --out) to start a new run \
             from those weights"
        );
    }
    let text = match &opts.config {
        Some(path) => Some(read_json_input(path, "the config")?),
        None => None,
    };
    // The devices decide the world size the config's batch sizes are resolved for, so
    // they are read first: from the command line, else the config's kiln.devices.
    let device_items = if opts.devices.is_empty() {
        configured_devices(text.as_deref().unwrap_or(DEMO_DS_CONFIG))
    } else {
        opts.devices.clone()
    };
    let specs = if device_items.is_empty() {
        vec![default_device()?]
    } else {
        parse_devices(&device_items)?
    };
    let procs = match &opts.processes {
        Some(comm) => Some(Processes::new(comm.clone(), specs.len())?),
        None => None,
    };
    // The stages decide how the devices split into pipeline replicas, and so the
    // data-parallel world the batch sizes are resolved for: the flag, else the config's.
    let stages = match opts.pipeline_stages {
        Some(n) => n,
        None => configured_stages(text.as_deref().unwrap_or(DEMO_DS_CONFIG)),
    };
    let devices_in_all = procs.as_ref().map_or(specs.len(), Processes::world);
    let world = pipeline_world(stages, devices_in_all)?;
    let mut ds = match (&opts.config, &text) {
        (Some(path), Some(text)) => config::parse(text, world).map_err(|mut e| {
            e.file = Some(path.clone());
            e
        })?,
        _ => config::parse(DEMO_DS_CONFIG, world).context("the built-in demo config")?,
    };
    let method = pipeline_settings(opts, &mut ds)?;
    if stages > 1 {
        refuse_with_pipeline(opts)?;
    }
    let k = &ds.kiln;
    if let Some(p) = &procs {
        p.comm
            .set_timeout(Duration::from_secs(k.collective_timeout_s));
    }

    // The run directory: checked here, written only once everything below is valid.
    let mut dir = match &opts.out {
        Some(d) => d.clone(),
        None => {
            let stamp = runs::format_utc(std::time::SystemTime::now())
                .replace([':', ' '], "-")
                .replace("-UTC", "");
            PathBuf::from("runs").join(stamp)
        }
    };
    if let Some(p) = &procs {
        // Process 0's (their clocks may name different seconds).
        let named = p.comm.all_gather(dir.to_string_lossy().as_bytes())?;
        dir = PathBuf::from(String::from_utf8_lossy(&named[0]).into_owned());
    }
    if writer || opts.resume {
        check_run_dir(&dir, opts.resume)?;
    }
    // A run still going in that directory (two started at once, or a --resume of a
    // live run) is refused here; a new run's directory is locked as it is created.
    let mut _run_lock = if writer && opts.resume {
        Some(runs::RunLock::acquire(&dir)?)
    } else {
        None
    };
    // A resumed run continues with its own settings: its checkpoint holds them, and its
    // config.json the seed. Loaded before any device opens, so a damaged checkpoint is
    // reported at once.
    let resumed = if opts.resume {
        let recorded = runs::read_config(&dir)?;
        let ck = checkpoint::load_latest(&dir)?;
        for note in ck.notes.iter().filter(|_| writer) {
            say(format!("note: {note}"));
        }
        // Checked now, before anything is opened: the manifest's step, the training
        // state and the data position must agree.
        TrainerState::from_checkpoint(&ck)?;
        // The run's own global batch: one that differs now is reported with the other
        // changed settings once the run's record is compared.
        let global = recorded["deepspeed"]["batch"]["train_batch_size"].as_u64();
        data_position(&ck, global.unwrap_or(ds.batch.train_batch_size as u64))?;
        Some((recorded, ck))
    } else {
        None
    };
    let settings = resolve_settings(
        opts,
        &ds,
        resumed.as_ref().map(|(rec, ck)| (rec, ck.state())),
    );
    for note in settings.notes.iter().filter(|_| writer) {
        say(format!("note: {note}"));
    }
    let RunSettings {
        seed,
        steps: total,
        eval_every,
        checkpoint_every,
        ..
    } = settings.run;
    // The data position counts samples in 64 bits: the config checks its own step
    // count against that, a --steps flag is checked here.
    if total > ds.batch.max_steps() {
        bail!(
            "{total} steps of {} samples would overflow the 64-bit count of samples drawn; \
             at most {} steps at this batch size",
            ds.batch.train_batch_size,
            ds.batch.max_steps()
        );
    }
    if let Some((_, ck)) = &resumed {
        if ck.step() >= total {
            bail!(
                "the run in {} has already done {} steps, and {total} were asked for; pass a \
                 larger --steps to continue it",
                dir.display(),
                ck.step()
            );
        }
    }
    // Weights to start from, read (and checked) before any device opens.
    let init = match &opts.init_from {
        Some(path) => Some(InitWeights::load(path)?),
        None => None,
    };
    let (mut model, model_from_file) = match (&opts.model, &init) {
        (Some(path), _) => {
            let text = read_json_input(path, "the model config")?;
            let m = ModelConfig::parse(&text)
                .map_err(|e| anyhow::anyhow!("{}: {e}", path.display()))?;
            // Its sizes before anything is derived from them (the data's rows of
            // block_size + 1 tokens, say), so that an error names the file's field.
            m.check()
                .map_err(|e| anyhow::anyhow!("{}: {e}", path.display()))?;
            if let Some(init) = &init {
                init.check_model(&m, path)?;
            }
            (m, true)
        }
        (None, Some(init)) => (init.model.clone(), true),
        (None, None) => (
            ModelConfig::parse(DEMO_MODEL).map_err(|e| anyhow::anyhow!("the demo model: {e}"))?,
            false,
        ),
    };
    let t = model.block_size();
    let b = ds.batch.micro_batch;

    // Data: the training stream, its sampler, and what evaluation runs on.
    let mut no_held_out = None;
    let (source, train_len, dataset, data_name): (Arc<dyn TokenSource>, u64, Dataset, String) =
        match &opts.data {
            None => {
                let add = Addition::new(data::DEFAULT_DIGITS, seed)?;
                if !model_from_file {
                    model.set_vocab_size(Addition::vocab_size());
                }
                if let Some(init) = &init {
                    init.check_vocabulary(
                        &model,
                        Some(Addition::vocab_size()),
                        "the built-in addition task",
                    )?;
                }
                let eval = addition_eval(&add, t)?;
                let src = add.train_source(ADDITION_LINES);
                let len = src.len();
                let name = format!("addition ({} digits)", add.digits());
                (Arc::new(src), len, Dataset::Addition { eval }, name)
            }
            Some(path) => {
                let src: Arc<dyn TokenSource> = Arc::from(data::open_path(path)?);
                if !model_from_file {
                    model.set_vocab_size(src.vocab_hint().ok_or_else(|| {
                        anyhow::anyhow!(
                            "{}: its vocabulary size is unknown (no .json sidecar); pass --model \
                             with a vocab_size, or make the file with `kiln prepare`",
                            path.display()
                        )
                    })?);
                }
                if let Some(init) = &init {
                    init.check_vocabulary(&model, src.vocab_hint(), &src.name())?;
                }
                data::check_source(src.as_ref(), t, model.vocab_size())?;
                let len = src.len();
                // Every id, once: a bad one anywhere is found now, with its position,
                // rather than when (or if) a batch happens to sample it.
                let scan = data::check_ids(src.as_ref(), model.vocab_size())?;
                if progress {
                    say(format!(
                        "checked all {len} token ids of {} against the vocabulary of {} in \
                         {:.1} ms",
                        src.name(),
                        model.vocab_size(),
                        scan.as_secs_f64() * 1e3
                    ));
                }
                let held = held_out(src.as_ref(), t)?;
                let train_len = held.train_len;
                if let Some(why) = &held.none_because {
                    if progress {
                        say(format!("no held-out data: {why}"));
                    }
                    no_held_out = Some(why.clone());
                }
                let eval = held.rows;
                let name = src.name();
                let head: Arc<dyn TokenSource> = Arc::new(data::Prefix::new(src, train_len)?);
                (head, train_len, Dataset::File { eval }, name)
            }
        };
    let sampler = Sampler::new(train_len, t, seed)?;

    // Devices: each spec opens its own device, so `vulkan:0x2` gives two.
    let opened = specs
        .iter()
        .map(|s| open_device(s, &DeviceOptions::default()))
        .collect::<Result<Vec<_>, _>>()?;
    let device_names: Vec<String> = opened
        .iter()
        .map(|d| format!("{} ({})", d.caps().name, d.caps().backend))
        .collect();
    let device_name = match &procs {
        Some(p) => format!(
            "{} processes, {world} devices (process 0: {})",
            p.devices.len(),
            device_names.join(", ")
        ),
        None if device_names.len() == 1 => device_names[0].clone(),
        None if stages > 1 && world > 1 => format!(
            "{stages} pipeline stages x {world} replicas (stage-major): {}",
            device_names.join(", ")
        ),
        None if stages > 1 => format!("{stages} pipeline stages: {}", device_names.join(", ")),
        None => format!("{world} devices: {}", device_names.join(", ")),
    };

    // What this run is; a resumed run must be the same one.
    let mut record = run_record(&ds, &model, &data_name, seed, &device_name);
    if let Some(init) = &init {
        record["init_from"] = json!(init.source);
    }
    check_inputs_survive(&dir, opts)?;
    if let Some((recorded, _)) = &resumed {
        // Where the run's weights started is part of how it began, not of how it goes on:
        // its checkpoints hold them now.
        if let Some(from) = recorded.get("init_from") {
            record["init_from"] = from.clone();
        }
        check_same_run(&dir, recorded, &record)?;
    }

    let network = model.build(t);
    let first_rank = procs.as_ref().map_or(0, Processes::first_rank);
    // Data-parallel ranks this process reads batches for (a pipeline is one).
    let local_ranks = opened.len() / stages;
    let (mut engine, parameters) = if stages > 1 {
        let options = NetworkOptions {
            batch: b,
            dtype: engine_trainer::precision(&ds)?.0,
            optimizer: ds.optimizer.clone(),
            seed,
        };
        // Per device, stage-major (device s * dp + r runs stage s of replica r).
        let dp = opened.len() / stages;
        let memory = Pipeline::memory(network.as_ref(), &options, &method, stages)?
            .iter()
            .flat_map(|m| {
                // ZeRO 1/2 leave each replica a 1/dp shard of its stage's optimizer
                // state (to within one element's rounding); under 2 the stage's alike
                // blocks share one set of gradient buffers.
                let sharded = ds.zero.stage >= 1 && dp > 1;
                let bytes = ModelStateBytes {
                    weights: m.weights,
                    gradients: if ds.zero.stage == 2 && dp > 1 {
                        m.shared_gradients
                    } else {
                        m.gradients
                    },
                    optimizer: if sharded {
                        m.optimizer.div_ceil(dp as u64)
                    } else {
                        m.optimizer
                    },
                };
                std::iter::repeat_n(bytes, dp)
            })
            .collect();
        let trainer =
            PipelineTrainer::new(opened, network.clone(), ds.clone(), seed, &method, stages)?;
        let parameters = network.parameters().iter().map(|p| p.len()).sum::<usize>();
        let trainer = Box::new(trainer);
        (Engine::Pipeline { trainer, memory }, parameters)
    } else {
        let devs: Vec<&dyn Device> = opened.iter().map(|d| d.as_ref()).collect();
        let trainer = Trainer::new_processes(&devs, network.clone(), ds.clone(), seed, procs)?;
        let parameters = trainer.model.parameter_count();
        drop(devs);
        let trainer = Box::new(trainer);
        (
            Engine::Data {
                trainer,
                devs: opened,
            },
            parameters,
        )
    };
    let model_states = engine.model_state_bytes();
    let mut next_sample = 0;
    if let Some((_, ck)) = &resumed {
        next_sample = restore(&mut engine, ck, ds.batch.train_batch_size as u64)?;
    }
    if let Some(init) = init {
        let weights = init.weights_for(&model)?;
        let Engine::Data { trainer, devs } = &mut engine else {
            unreachable!("--init-from with pipeline stages is refused before any device opens")
        };
        let devs: Vec<&dyn Device> = devs.iter().map(|d| d.as_ref()).collect();
        trainer
            .set_weights(&devs, &weights)
            .with_context(|| format!("--init-from {}", init.source))?;
        if progress {
            say(format!("weights from {}; a fresh optimizer", init.describe));
        }
    }
    let mut step = engine.steps();

    // One loader per rank, each reading its disjoint share of every global batch.
    let layout = BatchLayout::new(b, ds.batch.grad_accum, world)?;
    let mut loaders = (first_rank..first_rank + local_ranks)
        .map(|rank| {
            let mut cfg = LoaderConfig::new(layout, rank, model.vocab_size());
            cfg.start_sample = next_sample;
            cfg.workers = k.data_workers;
            cfg.depth = k.prefetch_depth;
            Loader::new(source.clone(), sampler, cfg)
        })
        .collect::<Result<Vec<_>, _>>()?;

    // Everything is valid: only now does the run directory get written.
    let mut metrics = match &resumed {
        _ if !writer => None,
        Some((_, ck)) => Some({
            say(format!(
                "resuming {} from step {} ({})",
                dir.display(),
                ck.step(),
                ck.dir.display()
            ));
            let w = MetricsWriter::resume(&dir, ck.step())?;
            if w.dropped() > 0 {
                say(format!(
                    "note: dropped {} metrics records written after step {} (they belong to \
                     the interrupted continuation)",
                    w.dropped(),
                    ck.step()
                ));
            }
            w
        }),
        None => {
            _run_lock = Some(create_run_dir(&dir, &record)?);
            Some(MetricsWriter::create(&dir)?)
        }
    };
    drop(resumed);
    if progress {
        for (r, m) in model_states.iter().enumerate() {
            let mib = |b: u64| b as f64 / (1u64 << 20) as f64;
            say(format!(
                "{} {r}: model states {:.2} MiB (weights {:.2}, gradients {:.2}, \
                 master+optimizer {:.2}; ZeRO stage {})",
                if stages > 1 { "stage" } else { "device" },
                mib(m.total()),
                mib(m.weights),
                mib(m.gradients),
                mib(m.optimizer),
                ds.zero.stage
            ));
        }
    }

    // The bar is drawn only on a terminal; elsewhere (CI, pipes) log lines go to stderr.
    let log = |bar: &ProgressBar, line: String| {
        if !progress {
        } else if bar.is_hidden() {
            say(line);
        } else {
            bar.println(line);
        }
    };
    let bar = if progress {
        let bar = ProgressBar::with_draw_target(Some(total), ProgressDrawTarget::stderr());
        bar.set_style(
            ProgressStyle::with_template(
                "{bar:28.cyan/blue} {pos}/{len} [{elapsed_precise} < {eta_precise}] {msg}",
            )
            .expect("a fixed template")
            .progress_chars("=> "),
        );
        bar.set_position(step);
        bar
    } else {
        ProgressBar::hidden()
    };
    log(
        &bar,
        format!(
            "training {}, {} parameters, on {data_name}, on {} for {total} steps, micro-batch \
             {b} × {} accumulation × {world} {}, {}; run dir {}",
            network.describe(),
            parameters,
            device_name,
            ds.batch.grad_accum,
            if stages > 1 {
                "pipeline replica(s)"
            } else {
                "device(s)"
            },
            precision_name(&ds),
            dir.display()
        ),
    );
    for w in &ds.warnings {
        log(&bar, format!("config warning: {w}"));
    }
    if let Some(w) = bubble_warning(stages, ds.batch.grad_accum) {
        log(&bar, format!("warning: {w}"));
    }

    let tokens_per_step = (b * t * ds.batch.grad_accum * world) as f64;
    let stopping = |interrupted: bool| -> Result<bool> {
        // Every process stops after the same step (a signal may reach them apart).
        let mut any = [f64::from(u8::from(interrupted))];
        if let Some(p) = opts.processes.as_deref() {
            p.sum_f64(&mut any)?;
        }
        Ok(any[0] > 0.0)
    };
    let profiled = crate::profile::profiled_steps(opts.profile, &ds, step, total)?;
    // One process speaks for a multi-process job: process 0 profiles.
    let mut profiler = match profiled.filter(|_| writer) {
        Some(steps) => Some(crate::profile::Profiler::new(
            steps,
            &engine.devices(),
            opts.peak_tflops,
        )?),
        None => None,
    };
    let mut interrupted = false;
    let mut since_print = (0.0f64, 0u32);
    let mut first_step = true;
    // Set when the data could not be read (a file cut short mid-run): the steps done so
    // far are then checkpointed before the error is returned.
    let mut data_failed = false;
    // The data position after the last completed step (a failed read may have moved
    // `next_sample` past it).
    let mut at_step_end = next_sample;
    // The loop's error (a failed or diverged step, unreadable data, a full disk) still
    // leaves a summary of the steps done before it is returned.
    let outcome = (|| -> Result<()> {
        while step < total {
            if let Some(p) = &mut profiler {
                p.before_step(step + 1, &engine.devices())?;
            }
            let t0 = Instant::now();
            let mut batches = vec![];
            let mut stall = 0.0;
            for (rank, loader) in loaders.iter_mut().enumerate() {
                let mut mine = Vec::with_capacity(ds.batch.grad_accum);
                for _ in 0..ds.batch.grad_accum {
                    let input = span("next batch", SpanKind::Input);
                    let mut f = loader.next().inspect_err(|_| data_failed = true)?;
                    drop(input);
                    stall += f.stall.as_secs_f64() * 1e3;
                    if rank == 0 {
                        next_sample = f.next_sample;
                    }
                    if let Dataset::Addition { .. } = dataset {
                        Addition::mask_prompts(&f.batch.tokens, &mut f.batch.targets, t);
                    }
                    mine.push(f.batch);
                }
                batches.push(mine);
            }
            let micro: Vec<Vec<MicroBatch>> = batches
                .iter()
                .map(|mine| mine.iter().map(MicroBatch::from).collect())
                .collect();
            let result = if first_step && progress {
                // The first step compiles every kernel it runs: minutes on a software
                // renderer, with nothing else to show meanwhile.
                let (done, finished) = mpsc::channel::<()>();
                let r = std::thread::scope(|scope| {
                    scope.spawn(|| show_compiling(&bar, finished, t0));
                    let r = engine.step(&micro);
                    drop(done);
                    r
                });
                bar.set_message("");
                log(
                    &bar,
                    format!(
                        "first step took {:.1} s (most of it compiling kernels)",
                        t0.elapsed().as_secs_f64()
                    ),
                );
                r
            } else {
                engine.step(&micro)
            };
            first_step = false;
            let s = result.map_err(|e| step_failure(e, step + 1, &dir, opts))?;
            step += 1;
            at_step_end = next_sample;
            if let Some(p) = &mut profiler {
                p.drain(step, &engine.devices())?;
            }
            let t1 = Instant::now();
            let step_ms = (t1 - t0).as_secs_f64() * 1e3;
            if let Some(p) = &mut profiler {
                p.after_step(step, t0, t1, &engine.devices())?;
            }
            let comm = engine.comm();
            let mut rec = StepRecord {
                step,
                loss: s.loss,
                lr: s.lr,
                loss_scale: s.loss_scale,
                skipped: s.skipped,
                tokens_per_s: tokens_per_step / (step_ms / 1e3),
                step_ms,
                input_stall_ms: stall,
                // Per device (the largest): what has to fit on each adapter.
                device_memory_bytes: engine
                    .devices()
                    .iter()
                    .map(|d| d.allocated_bytes())
                    .max()
                    .unwrap_or(0),
                comm_ms: comm.ms,
                comm_overlap: comm.overlap,
                comm_bytes: comm.bytes,
                ..Default::default()
            };
            let piped = engine.pipeline_report().map(|r| {
                // Each stage's share of the step spent waiting for a neighbour, averaged.
                let devices = r.waited.len().max(1) as f64;
                let waited = r.waited.iter().sum::<f64>() / devices;
                let exposed = r.exposed.iter().sum::<f64>() / devices;
                (waited / r.seconds.max(1e-12), r.bytes_moved, exposed * 1e3)
            });
            if let Some((bubble, bytes, exposed_ms)) = piped {
                rec.pipeline_exposed_ms = Some(exposed_ms);
                rec.pipeline_bubble = Some(bubble);
                rec.pipeline_bubble_theory = Some(
                    kiln_engine::parallel::pipeline_schedule::theoretical_bubble(
                        stages,
                        ds.batch.grad_accum,
                    ),
                );
                rec.pipeline_bytes = Some(bytes);
            }
            if stopping(
                opts.interrupt
                    .as_ref()
                    .is_some_and(|f| f.load(Ordering::SeqCst)),
            )? {
                interrupted = true;
            }
            let last = step == total || interrupted;
            let evaluates = writer && !matches!(dataset, Dataset::File { eval: None });
            if evaluates && (last || (eval_every > 0 && step.is_multiple_of(eval_every))) {
                let predict = |m: &MicroBatch| engine.predict(m);
                let (loss, acc) = evaluate_with(&predict, &dataset, b, t, &mut |_, _| {})?;
                rec.eval_loss = Some(loss);
                rec.eval_accuracy = acc;
                let acc = acc.map_or(String::new(), |a| {
                    format!(", held-out exact match {:.1}%", a * 100.0)
                });
                log(&bar, format!("step {step}: eval loss {loss:.4}{acc}"));
            }
            if let Some(metrics) = &mut metrics {
                metrics.append(&rec)?;
            }
            since_print.0 += s.loss as f64;
            since_print.1 += 1;
            if step.is_multiple_of(ds.steps_per_print.max(1)) || last {
                log(
                    &bar,
                    format!(
                        "step {step}: loss {:.4} (mean of last {}), lr {:.3e}, scale {}, {:.0} \
                         tokens/s, stall {:.1} ms{}",
                        since_print.0 / since_print.1 as f64,
                        since_print.1,
                        s.lr,
                        s.loss_scale,
                        rec.tokens_per_s,
                        stall,
                        if let Some((bubble, bytes, exposed_ms)) = piped {
                            format!(
                                ", pipeline bubble {:.0}% (theory {:.0}%), {:.1} MB between \
                                 stages, {exposed_ms:.1} ms transfer exposed",
                                bubble * 100.0,
                                rec.pipeline_bubble_theory.unwrap_or(0.0) * 100.0,
                                bytes as f64 / 1e6
                            )
                        } else if world > 1 {
                            format!(
                                ", gradient exchange {:.1} ms ({:.1} MB, {:.0}% overlapped with \
                                 backward)",
                                comm.ms,
                                comm.bytes as f64 / 1e6,
                                comm.overlap * 100.0
                            )
                        } else {
                            String::new()
                        }
                    ),
                );
                since_print = (0.0, 0);
            }
            if s.skipped {
                log(&bar, skipped_line(&ds, &engine, step, s.loss_scale));
            }
            bar.set_position(step);
            bar.set_message(format!(
                "loss {:.3} | {:.0} tok/s | scale {}",
                s.loss, rec.tokens_per_s, s.loss_scale
            ));
            if last || (checkpoint_every > 0 && step.is_multiple_of(checkpoint_every)) {
                let _span = span("checkpoint", SpanKind::Checkpoint);
                let saved = save(&engine, &dir, step, next_sample, &settings.run)?;
                for note in saved.notes {
                    log(&bar, format!("note: {note}"));
                }
            }
            if interrupted {
                break;
            }
        }
        Ok(())
    })();
    bar.finish_and_clear();
    // Unreadable data stops the run, but loses none of its steps: the last completed one
    // is checkpointed (one process: a multi-process save takes every process, and the
    // others may be mid-step) and the error says how to continue.
    let outcome = match outcome {
        Err(e) if data_failed && writer && opts.processes.is_none() && step > 0 => {
            let saved_already = checkpoint::list(&dir)
                .ok()
                .and_then(|l| l.last().map(|(at, _)| *at))
                == Some(step);
            let saved = if saved_already {
                Ok(())
            } else {
                save(&engine, &dir, step, at_step_end, &settings.run).map(drop)
            };
            Err(match saved {
                Ok(()) => anyhow::anyhow!(
                    "{e:#}\nstopped after step {step}, which is checkpointed; once the data is \
                     whole again, continue with: {}",
                    resume_command(opts, &dir)
                ),
                Err(s) => anyhow::anyhow!(
                    "{e:#}\nstopped after step {step}; saving its checkpoint failed too ({s:#})"
                ),
            })
        }
        o => o,
    };
    if let Some(p) = profiler {
        if let Some(table) = p.finish(&dir, &engine.devices())? {
            say(format!(
                "profile (trace: {}):\n{table}",
                dir.join("trace.json").display()
            ));
        }
    }
    let Some(metrics) = metrics else {
        outcome?;
        return Ok(RunReport {
            dir,
            steps: step,
            interrupted,
            summary: Summary::default(),
        });
    };
    let synced = metrics.sync();
    let summary = (|| -> Result<Summary> {
        let records = runs::read_metrics(&dir)?;
        let mut summary = Summary::from_records(&records, runs::DEFAULT_WARMUP_STEPS);
        summary.total_time_s = started.elapsed().as_secs_f64();
        summary.devices = device_names;
        summary.model_states = model_states;
        summary.no_held_out_data = no_held_out;
        summary.write(&dir)?;
        runs::write_chart(&dir)?;
        Ok(summary)
    })();
    // The loop's error is the one to report; a summary that could not be written after
    // it is secondary.
    outcome?;
    synced?;
    let summary = summary?;
    if interrupted {
        say(format!(
            "interrupted after step {step}; checkpoint saved. Continue with: {}",
            resume_command(opts, &dir)
        ));
    }
    Ok(RunReport {
        dir,
        steps: step,
        interrupted,
        summary,
    })
}

/// Draws "compiling kernels (n/N)" with the elapsed time until `finished` closes: on
/// the bar's message on a terminal, else as a log line now and then. n/N counts the
/// pipelines the devices compile ahead of the step (see `Device::prepare`).
fn show_compiling(bar: &ProgressBar, finished: mpsc::Receiver<()>, since: Instant) {
    const WHAT: &str = "compiling kernels for the first step";
    // Pipelines already listed (a software driver compiles them as they first run, in
    // this step) count, as do those the step lists.
    let (done_before, _) = compiling::snapshot();
    let counts = || {
        let (done, queued) = compiling::snapshot();
        let total = queued - done_before;
        if total == 0 {
            String::new()
        } else {
            format!(" ({}/{total})", (done - done_before).min(total))
        }
    };
    let every = if bar.is_hidden() {
        say(format!(
            "{WHAT} (it can take minutes on a software renderer such as lavapipe)…"
        ));
        Duration::from_secs(10)
    } else {
        bar.set_message(format!("{WHAT}…"));
        Duration::from_secs(1)
    };
    while let Err(mpsc::RecvTimeoutError::Timeout) = finished.recv_timeout(every) {
        let s = since.elapsed().as_secs();
        if bar.is_hidden() {
            say(format!("still {WHAT}{} ({s} s)…", counts()));
        } else {
            bar.set_message(format!("{WHAT}{}… {s} s", counts()));
        }
    }
}

/// The log line of a skipped step: an fp16 overflow the scaler handles, or (without
/// fp16 loss scaling) non-finite gradients that stop the run if they persist.
fn skipped_line(ds: &TrainConfig, trainer: &Engine, step: u64, scale: f32) -> String {
    let now = trainer.scaler().scale();
    match (&ds.precision, trainer.scaler()) {
        (config::Precision::Fp16 { .. }, LossScaler::Dynamic { .. }) => format!(
            "step {step}: fp16 gradients overflowed at loss scale {scale}; step skipped, scale \
             now {now}"
        ),
        (config::Precision::Fp16 { .. }, LossScaler::Static { .. }) => format!(
            "step {step}: fp16 gradients overflowed at the static loss scale {scale}; step \
             skipped ({} in a row; training stops at {})",
            trainer.consecutive_skips(),
            ds.kiln.max_consecutive_skips
        ),
        _ => format!(
            "step {step}: gradients are not finite (NaN or infinite); step skipped ({} in a \
             row; training stops at {}, kiln.max_consecutive_skips)",
            trainer.consecutive_skips(),
            ds.kiln.max_consecutive_skips
        ),
    }
}

/// A failed step as the user should read it: what to try, and the checkpoint that
/// holds the work done so far.
fn step_failure(
    e: kiln_engine::Error,
    step: u64,
    dir: &Path,
    opts: &TrainOptions,
) -> anyhow::Error {
    let checkpoints = checkpoint::list(dir).unwrap_or_default();
    if let kiln_engine::Error::Diverged { .. } = e {
        // Resuming repeats the same steps bit for bit, so a checkpoint taken while
        // steps were already being skipped would diverge again even sooner.
        let good = checkpoints.iter().rev().find(|(_, p)| {
            std::fs::read(p.join(checkpoint::MANIFEST_FILE))
                .ok()
                .and_then(|b| serde_json::from_slice::<Value>(&b).ok())
                .is_some_and(|m| m["state"]["trainer"]["consecutive_skips"].as_u64() == Some(0))
        });
        let last = match good {
            Some((at, p)) => format!(
                "the last good checkpoint is step {at} ({}), from before the gradients stopped \
                 being finite; a resume repeats the same steps and would diverge again, so \
                 start a new run (another --out) with the changes above",
                p.display()
            ),
            None => "no checkpoint was written before it; start a new run (another --out) with \
                     the changes above"
                .to_string(),
        };
        return anyhow::anyhow!("{e}\n{last}");
    }
    let resume = match checkpoints.last() {
        Some((at, _)) => format!(
            "the checkpoint of step {at} is intact: once the device works again, continue \
             with `{}` (on other devices too, with the same global batch)",
            resume_command(opts, dir)
        ),
        None => "no checkpoint was written yet".to_string(),
    };
    anyhow::Error::new(e).context(format!("step {step} failed; {resume}"))
}

/// The command that continues the run in `dir` with the same inputs.
fn resume_command(opts: &TrainOptions, dir: &Path) -> String {
    // A multi-process job continues as one again (or on any other topology).
    let launcher = opts
        .processes
        .as_ref()
        .map_or(String::new(), |c| format!("mpirun -np {} ", c.size()));
    let mut cmd = format!("{launcher}kiln train --resume --out {}", shell_word(dir));
    for (flag, path) in [
        ("--config", &opts.config),
        ("--model", &opts.model),
        ("--data", &opts.data),
    ] {
        if let Some(p) = path {
            cmd += &format!(" {flag} {}", shell_word(p));
        }
    }
    if !opts.devices.is_empty() {
        cmd += &format!(" --devices {}", opts.devices.join(","));
    }
    if let Some(n) = opts.pipeline_stages {
        cmd += &format!(" --pipeline-stages {n}");
    }
    if let Some(p) = &opts.partition {
        cmd += &format!(" --partition {p}");
    }
    cmd
}

/// A path as one shell word, quoted only when it needs it.
fn shell_word(p: &Path) -> String {
    let s = p.display().to_string();
    let plain = |c: char| c.is_ascii_alphanumeric() || "/._-+=:,@%".contains(c);
    if !s.is_empty() && s.chars().all(plain) {
        s
    } else {
        format!("'{}'", s.replace('\'', r"'\''"))
    }
}

/// A run's own settings: restored by `--resume` unless a flag overrides them.
#[derive(Clone, Copy, Debug, PartialEq)]
struct RunSettings {
    seed: u64,
    steps: u64,
    eval_every: u64,
    checkpoint_every: u64,
    keep_checkpoints: usize,
}

/// The key of a checkpoint's state that holds [`RunSettings`] (the seed is in the run's
/// config.json).
const RUN_STATE_KEY: &str = "run";

struct ResolvedSettings {
    run: RunSettings,
    /// What the user should know: settings restored, overridden, or differing from the
    /// config.
    notes: Vec<String>,
}

/// Flags first; on `--resume`, then the run's own settings (so a run started with
/// `--steps 30` resumes to 30, not to the config's count); then the config.
fn resolve_settings(
    opts: &TrainOptions,
    ds: &TrainConfig,
    resumed: Option<(&Value, &Value)>,
) -> ResolvedSettings {
    let k = &ds.kiln;
    let config_steps = k.steps.unwrap_or(match ds.schedule {
        Schedule::WarmupDecayLr { total_steps, .. }
        | Schedule::WarmupCosineLr { total_steps, .. } => total_steps,
        _ => DEFAULT_STEPS,
    });
    let mut notes = vec![];
    let Some((recorded, state)) = resumed else {
        let run = RunSettings {
            seed: opts.seed.unwrap_or(k.seed),
            steps: opts.steps.unwrap_or(config_steps),
            eval_every: opts.eval_every.unwrap_or(k.eval_every),
            checkpoint_every: opts.checkpoint_every.unwrap_or(k.checkpoint_every),
            keep_checkpoints: opts.keep_checkpoints.unwrap_or(k.keep_checkpoints),
        };
        return ResolvedSettings { run, notes };
    };
    let stored = &state[RUN_STATE_KEY];
    if stored.is_null() {
        notes.push(
            "the checkpoint predates saved run settings: the step count, evaluation and \
             checkpoint intervals and retention come from the flags and the config"
                .to_string(),
        );
    }
    let from_file = |key: &str| ds.provenance.get(key) == Some(&config::Provenance::File);
    let mut restored = vec![];
    let mut pick = |name: &str, flag: Option<u64>, run: Option<u64>, config: u64| -> u64 {
        let flag_name = format!("--{}", name.replace('_', "-"));
        match (flag, run) {
            (Some(f), Some(r)) if f != r => {
                notes.push(format!("{flag_name} {f} replaces the run's {name} {r}"));
                f
            }
            (Some(f), _) => f,
            (None, Some(r)) => {
                if from_file(&format!("kiln.{name}")) && config != r {
                    notes.push(format!(
                        "kiln.{name} {config} in the config differs from the run's {r}; the \
                         run's is kept (pass {flag_name} {config} to change it)"
                    ));
                }
                restored.push(format!("{name} {r}"));
                r
            }
            (None, None) => config,
        }
    };
    let run = RunSettings {
        seed: pick("seed", opts.seed, recorded["seed"].as_u64(), k.seed),
        steps: pick(
            "steps",
            opts.steps,
            stored["steps"].as_u64().filter(|&n| n > 0),
            config_steps,
        ),
        eval_every: pick(
            "eval_every",
            opts.eval_every,
            stored["eval_every"].as_u64(),
            k.eval_every,
        ),
        checkpoint_every: pick(
            "checkpoint_every",
            opts.checkpoint_every,
            stored["checkpoint_every"].as_u64(),
            k.checkpoint_every,
        ),
        keep_checkpoints: pick(
            "keep_checkpoints",
            opts.keep_checkpoints.map(|n| n as u64),
            stored["keep_checkpoints"].as_u64(),
            k.keep_checkpoints as u64,
        ) as usize,
    };
    if !restored.is_empty() {
        notes.push(format!(
            "resuming with the run's own {} (the flags of the same names change them)",
            restored.join(", ")
        ));
    }
    ResolvedSettings { run, notes }
}

/// Reads a JSON input file (`what`: "the config", say). Only a regular file: a device
/// such as `/dev/zero` would be read until memory ran out, a directory fails cryptically.
pub fn read_json_input(path: &Path, what: &str) -> Result<String> {
    let context = || format!("reading {what} {}", path.display());
    let meta = std::fs::metadata(path).map_err(|e| match e.kind() {
        std::io::ErrorKind::NotFound => anyhow::anyhow!("{}: it does not exist", context()),
        _ => anyhow::Error::new(e).context(context()),
    })?;
    if meta.is_dir() {
        bail!("{}: it is a directory, expected a JSON file", context());
    }
    if !meta.is_file() {
        bail!(
            "{}: it is not a regular file (a device, a pipe or a socket), expected a JSON file",
            context()
        );
    }
    std::fs::read_to_string(path).with_context(context)
}

/// Refuses a run directory whose files would overwrite an input: `--data` saved as
/// `runs/x/metrics.jsonl`, say (truncated while it is memory-mapped), or a file under
/// `checkpoints/`, which old checkpoints are pruned from.
fn check_inputs_survive(dir: &Path, opts: &TrainOptions) -> Result<()> {
    let written = [
        runs::CONFIG_FILE,
        runs::METRICS_FILE,
        runs::SUMMARY_FILE,
        runs::CHART_FILE,
    ]
    .map(|f| dir.join(f));
    let checkpoints = dir.join(checkpoint::CHECKPOINTS_DIR).canonicalize().ok();
    let inputs = [
        ("--data", &opts.data),
        ("--config", &opts.config),
        ("--model", &opts.model),
    ];
    for (flag, path) in inputs {
        let Some(path) = path else { continue };
        let Ok(meta) = std::fs::metadata(path) else {
            continue;
        };
        let clash = written
            .iter()
            .find(|w| same_file(&meta, w))
            .map(|w| format!("it is the run's own {}, which training writes", w.display()))
            .or_else(|| {
                let inside = path
                    .canonicalize()
                    .ok()
                    .zip(checkpoints.as_ref())
                    .is_some_and(|(p, c)| p.starts_with(c));
                inside.then(|| "it lies in the run's checkpoints, which are pruned".to_string())
            });
        if let Some(why) = clash {
            bail!(
                "{flag} {}: {why}. The run directory {} holds the run's config, metrics, \
                 summary, chart and checkpoints: move the input out of it, or pick another --out",
                path.display(),
                dir.display()
            );
        }
    }
    Ok(())
}

/// Whether `other` is the file `meta` describes (same device and inode on Unix, so hard
/// links and other spellings of the path count).
fn same_file(meta: &std::fs::Metadata, other: &Path) -> bool {
    let Ok(m) = std::fs::metadata(other) else {
        return false;
    };
    #[cfg(unix)]
    {
        use std::os::unix::fs::MetadataExt;
        m.dev() == meta.dev() && m.ino() == meta.ino()
    }
    #[cfg(not(unix))]
    {
        let _ = (meta, m);
        false
    }
}

/// Settings a resumed run may change: where it runs and how the global batch is split.
const RESHARDABLE: [&str; 5] = [
    "device",
    "deepspeed.zero.stage",
    "deepspeed.batch.world",
    "deepspeed.batch.micro_batch",
    "deepspeed.batch.grad_accum",
];

/// `kiln.devices` of a config, read leniently: the full, strict reading comes after,
/// once the device count (the world size its batch sizes depend on) is known.
fn configured_devices(text: &str) -> Vec<String> {
    // As config::parse does: a byte-order mark must not hide kiln.devices.
    let text = text.strip_prefix('\u{feff}').unwrap_or(text);
    let v: Value = serde_json::from_str(text).unwrap_or(Value::Null);
    match &v["kiln"]["devices"] {
        Value::String(s) => s.split(',').map(|d| d.trim().to_string()).collect(),
        Value::Array(a) => a
            .iter()
            .filter_map(|d| d.as_str().map(str::to_string))
            .collect(),
        _ => vec![],
    }
}

/// The pipeline stages a config asks for (`pipeline.stages`, else
/// `kiln.pipeline_stages`, else 1), read leniently as [`configured_devices`] is: the
/// strict reading comes once the data-parallel world they imply is known.
pub fn configured_stages(text: &str) -> usize {
    let text = text.strip_prefix('\u{feff}').unwrap_or(text);
    let v: Value = serde_json::from_str(text).unwrap_or(Value::Null);
    v["pipeline"]["stages"]
        .as_u64()
        .or_else(|| v["kiln"]["pipeline_stages"].as_u64())
        .filter(|&n| n >= 1)
        .map_or(1, |n| n as usize)
}

/// The data-parallel world of `devices` split into pipelines of `stages` stages.
fn pipeline_world(stages: usize, devices: usize) -> Result<usize> {
    if stages == 0 {
        bail!("--pipeline-stages 0: a pipeline has at least 1 stage (1: no pipeline)");
    }
    if !devices.is_multiple_of(stages) {
        bail!(
            "{stages} pipeline stages do not divide the {devices} device(s): a pipeline of p \
             stages takes p devices per data-parallel replica (e.g. --devices vulkan:0x4 \
             --pipeline-stages 2 is 2 stages x 2 replicas); give a multiple of {stages} devices"
        );
    }
    Ok(devices / stages)
}

/// Applies `--pipeline-stages` and `--partition` over the config's `pipeline` section
/// (flags win, as for every other setting) and returns how the blocks are cut.
fn pipeline_settings(opts: &TrainOptions, ds: &mut TrainConfig) -> Result<PartitionMethod> {
    if let Some(n) = opts.pipeline_stages {
        ds.pipeline.stages = n;
        ds.provenance
            .insert("pipeline.stages".into(), config::Provenance::Caller);
    }
    let stages = ds.pipeline.stages;
    if let Some(text) = &opts.partition {
        if stages <= 1 {
            bail!(
                "--partition cuts a model into pipeline stages: give --pipeline-stages 2 or \
                 more (or pipeline.stages in the config)"
            );
        }
        ds.pipeline.partition = match crate::estimate::parse_partition(text)? {
            PartitionMethod::Uniform => PipelinePartition::Uniform,
            PartitionMethod::Blocks(counts) => PipelinePartition::Blocks(counts),
            _ => PipelinePartition::Parameters,
        };
        ds.provenance
            .insert("pipeline.partition".into(), config::Provenance::Caller);
    }
    Ok(match &ds.pipeline.partition {
        PipelinePartition::Parameters => PartitionMethod::Parameters,
        PipelinePartition::Uniform => PartitionMethod::Uniform,
        PipelinePartition::Blocks(counts) => {
            if stages > 1 && counts.len() != stages {
                bail!(
                    "the partition lists {} block counts ({}) but the run has {stages} pipeline \
                     stages: give one count per stage, or another --partition",
                    counts.len(),
                    ds.pipeline.partition.spelled()
                );
            }
            PartitionMethod::Blocks(counts.clone())
        }
    })
}

/// Refuses what `kiln train` does not combine with pipeline stages yet, before
/// anything opens.
fn refuse_with_pipeline(opts: &TrainOptions) -> Result<()> {
    let refused = [
        (
            opts.processes.is_some(),
            "a multi-process job (mpirun)",
            "run the pipeline in one process",
        ),
        (
            opts.init_from.is_some(),
            "--init-from",
            "start from those weights without --pipeline-stages, then continue the run \
             with --resume --pipeline-stages N (checkpoints resume on any number of stages)",
        ),
        (
            opts.profile.is_some(),
            "--profile",
            "profile the same model without --pipeline-stages",
        ),
    ];
    for (given, what, instead) in refused {
        if given {
            bail!("{what} with pipeline stages is not supported yet: {instead}");
        }
    }
    Ok(())
}

/// The warning a pipeline of `p` stages gets when `m` micro-batches per step leave
/// its stages idle for much of the step (DeepSpeed's maintainers advise m >= 8p).
pub fn bubble_warning(p: usize, m: usize) -> Option<String> {
    (p > 1 && m < 4 * p).then(|| {
        format!(
            "gradient_accumulation_steps {m} with {p} pipeline stages: the stages idle for \
             {:.0}% of each step, (p-1)/(m+p-1), waiting for each other. Raise \
             gradient_accumulation_steps to at least {} (4 x stages; the global batch grows, \
             or lower train_micro_batch_size_per_gpu to keep it) to bring that to {:.0}% or less",
            100.0 * kiln_engine::parallel::pipeline_schedule::theoretical_bubble(p, m),
            4 * p,
            100.0 * kiln_engine::parallel::pipeline_schedule::theoretical_bubble(p, 4 * p)
        )
    })
}

/// What identifies a run: every setting that changes its numbers, and nothing per-run
/// (name, paths), so `kiln runs diff` compares like with like.
fn run_record(ds: &TrainConfig, model: &ModelConfig, data: &str, seed: u64, device: &str) -> Value {
    let mut config = serde_json::to_value(ds).expect("the resolved config serializes");
    if let Some(obj) = config.as_object_mut() {
        // Not settings of the run's numbers: where values came from, notes, and the
        // `kiln` section (devices, workers, intervals; the seed is recorded below).
        obj.remove("provenance");
        obj.remove("warnings");
        obj.remove("kiln");
    }
    tidy_floats(&mut config);
    json!({
        "deepspeed": config,
        "model": model.record(),
        "data": data,
        "seed": seed,
        "device": device,
    })
}

/// Writes each number that is an f32 widened to f64 (every float of the config) as the
/// f32's shortest decimal: `0.003`, not `0.003000000026077032`.
fn tidy_floats(v: &mut Value) {
    match v {
        Value::Number(n) if n.is_f64() => {
            let x = n.as_f64().unwrap_or(0.0);
            let short: f64 = (x as f32).to_string().parse().unwrap_or(x);
            if (x as f32) as f64 == x {
                if let Some(m) = serde_json::Number::from_f64(short) {
                    *n = m;
                }
            }
        }
        Value::Array(a) => a.iter_mut().for_each(tidy_floats),
        Value::Object(o) => o.values_mut().for_each(tidy_floats),
        _ => {}
    }
}

/// Checks, before anything is opened or written, that `dir` can take a new run or
/// holds one to resume.
fn check_run_dir(dir: &Path, resume: bool) -> Result<()> {
    let has_run = dir.join(runs::CONFIG_FILE).exists();
    if !resume && has_run {
        if checkpoint::list(dir).map(|l| l.is_empty()).unwrap_or(false) {
            bail!(
                "{} already holds a run, which saved no checkpoint and so cannot be resumed; \
                 delete that directory to start over there, or pick another --out",
                dir.display()
            );
        }
        bail!(
            "{} already holds a run; continue it with --resume, or pick another --out",
            dir.display()
        );
    }
    if resume && !has_run {
        bail!(
            "--resume: {} holds no run (no {}); pass the --out of an earlier run",
            dir.display(),
            runs::CONFIG_FILE
        );
    }
    Ok(())
}

/// Creates the directory of a new run, locks it for this process and records what the
/// run is. Another run that got there first since [`check_run_dir`] holds the lock, or
/// has written its config.json: either way this one stops, touching nothing of it.
fn create_run_dir(dir: &Path, record: &Value) -> Result<runs::RunLock> {
    std::fs::create_dir_all(dir).map_err(|e| {
        let why = kiln_engine::fsutil::cannot_create(dir, &e).unwrap_or_else(|| e.to_string());
        anyhow::anyhow!("creating the run directory {}: {why}", dir.display())
    })?;
    let lock = runs::RunLock::acquire(dir)?;
    check_run_dir(dir, false)?;
    runs::write_config(dir, record)?;
    Ok(lock)
}

/// Checks that a resumed run has the settings it was started with (`recorded`, its
/// config.json), but for where it runs and how its global batch is split.
fn check_same_run(dir: &Path, recorded: &Value, record: &Value) -> Result<()> {
    let old = runs::flatten_json(recorded);
    let new = runs::flatten_json(record);
    let mut diffs = vec![];
    let show = |v: Option<&Value>| v.map_or("(absent)".to_string(), |v| v.to_string());
    for key in old
        .keys()
        .chain(new.keys().filter(|k| !old.contains_key(*k)))
    {
        let (a, b) = (old.get(key), new.get(key));
        if a == b {
            continue;
        }
        // Checkpoints hold whole tensors, so a run may continue on other devices or
        // another number of them, or of pipeline stages, with the same global batch.
        if RESHARDABLE.contains(&key.as_str()) || key.starts_with("deepspeed.pipeline.") {
            say(format!(
                "note: resuming with {key} {} (was {})",
                show(b),
                show(a)
            ));
            continue;
        }
        diffs.push(format!("  {key}: {} -> {}", show(a), show(b)));
    }
    if !diffs.is_empty() {
        bail!(
            "--resume: these settings differ from the ones {} was started with, so it would not \
             continue the same run:\n{}\nResume with the original --config/--model/--data/--seed \
             (and device), or start a new run with another --out",
            dir.display(),
            diffs.join("\n")
        );
    }
    Ok(())
}

/// Writes a checkpoint of everything `--resume` needs, the run's own settings included.
fn save(
    engine: &Engine,
    dir: &Path,
    step: u64,
    next_sample: u64,
    run: &RunSettings,
) -> Result<checkpoint::Saved> {
    let mut state = serde_json::Map::new();
    state.insert("next_sample".into(), json!(next_sample));
    state.insert(
        RUN_STATE_KEY.into(),
        json!({
            "steps": run.steps,
            "eval_every": run.eval_every,
            "checkpoint_every": run.checkpoint_every,
            "keep_checkpoints": run.keep_checkpoints,
        }),
    );
    Ok(engine.save_checkpoint(dir, step, state, run.keep_checkpoints)?)
}

/// Restores a checkpoint into the engine; returns the data position to continue from.
fn restore(engine: &mut Engine, ck: &checkpoint::Checkpoint, global: u64) -> Result<u64> {
    engine.load_checkpoint(ck)?;
    data_position(ck, global)
}

/// The data position a checkpoint continues from, checked against its step and the
/// run's global batch.
fn data_position(ck: &checkpoint::Checkpoint, global: u64) -> Result<u64> {
    let next = ck
        .state()
        .get("next_sample")
        .and_then(Value::as_u64)
        .ok_or_else(|| {
            anyhow::anyhow!(
                "{}: the manifest's state has no valid `next_sample`; the checkpoint was not \
                 written by this version of kiln train",
                ck.dir.display()
            )
        })?;
    // Every step reads one global batch, and a resumed run keeps its global batch, so
    // the data position follows from the step; anything else is an edited manifest that
    // would silently train on other data.
    if Some(next) != ck.step().checked_mul(global) {
        bail!(
            "{}: the manifest's data position (next_sample {next}) disagrees with its step {} \
             × the global batch {global}: the manifest was edited or damaged; resume from an \
             earlier checkpoint or delete this directory",
            ck.dir.display(),
            ck.step()
        );
    }
    Ok(next)
}

/// A data file's held-out tail: the rows `kiln train` evaluates on and `kiln eval`
/// scores by default.
pub(crate) struct HeldOut {
    /// Tokens before the tail (what is trained on).
    pub train_len: u64,
    /// `(tokens, targets)` of whole rows of `t` positions, `None` when the file is too
    /// short to spare one.
    pub rows: Option<(Vec<u32>, Vec<u32>)>,
    /// Why there are no rows, for the user.
    pub none_because: Option<String>,
}

/// Splits off the held-out tail of `src` in rows of `t + 1` tokens: independent of the
/// micro-batch, so a resume with another split of the global batch keeps the same
/// training windows and held-out rows.
pub(crate) fn held_out(src: &dyn TokenSource, t: usize) -> Result<HeldOut> {
    let len = src.len();
    let hold =
        ((len as f64 * HOLDOUT_FRACTION) as u64 / (t as u64 + 1)).min(EVAL_ROWS as u64) as usize;
    let train_len = len - (hold * (t + 1)) as u64;
    if hold == 0 {
        let row = t as u64 + 1;
        let mut need = 20 * row;
        while ((need as f64 * HOLDOUT_FRACTION) as u64) < row {
            need += 1;
        }
        let why = format!(
            "{} holds {len} tokens, and its last {}% is less than one row of T + 1 = {row} \
             tokens (that takes at least {need} tokens). Training on all of it, without an \
             eval loss",
            src.name(),
            HOLDOUT_FRACTION * 100.0
        );
        return Ok(HeldOut {
            train_len,
            rows: None,
            none_because: Some(why),
        });
    }
    let mut toks = Vec::with_capacity(hold * t);
    let mut tgts = Vec::with_capacity(hold * t);
    let mut row = vec![0u32; t + 1];
    for r in 0..hold {
        src.read(train_len + (r * (t + 1)) as u64, &mut row)?;
        toks.extend_from_slice(&row[..t]);
        tgts.extend_from_slice(&row[1..]);
    }
    Ok(HeldOut {
        train_len,
        rows: Some((toks, tgts)),
        none_because: None,
    })
}

/// The held-out addition problems `kiln train` scores: a fixed number of rows, whatever
/// the micro-batch, so a run resumed with another split of its global batch evaluates
/// on the same problems; the loss is on the answers only.
pub(crate) fn addition_eval(add: &Addition, t: usize) -> Result<EvalRows> {
    let mut eval = add.eval_rows(t, EVAL_ROWS)?;
    Addition::mask_prompts(&eval.tokens, &mut eval.targets, t);
    Ok(eval)
}

/// Held-out loss, and exact-match accuracy for the addition task; `progress` hears
/// (rows done, rows) after each micro-batch.
pub(crate) fn evaluate(
    network: &Network,
    dev: &dyn Device,
    dataset: &Dataset,
    b: usize,
    t: usize,
    progress: &mut dyn FnMut(usize, usize),
) -> Result<(f32, Option<f32>)> {
    evaluate_with(&|m| network.predict(dev, m), dataset, b, t, progress)
}

/// An engine's forward pass for evaluation: a micro-batch's mean loss and every row's
/// predicted class.
pub(crate) type Predict<'a> = dyn Fn(&MicroBatch) -> kiln_engine::Result<(f64, Vec<u32>)> + 'a;

/// [`evaluate`] with any engine's forward pass.
pub(crate) fn evaluate_with(
    predict: &Predict,
    dataset: &Dataset,
    b: usize,
    t: usize,
    progress: &mut dyn FnMut(usize, usize),
) -> Result<(f32, Option<f32>)> {
    let (tokens, targets) = match dataset {
        Dataset::Addition { eval } => (&eval.tokens, &eval.targets),
        Dataset::File { eval: Some((a, b)) } => (a, b),
        // The training loop does not evaluate then; an error, should it ever ask.
        Dataset::File { eval: None } => bail!("no held-out data to evaluate on"),
    };
    // The model runs whole micro-batches (its shapes are fixed at build time): a last,
    // partial one is padded with copies of its first row that are not scored
    // (IGNORE_TARGET), and each chunk's mean loss is weighted by its scored positions.
    let (mut loss, mut scored) = (0.0, 0usize);
    let mut predictions = Vec::with_capacity(tokens.len());
    let all_rows = tokens.len() / t.max(1);
    for (tok, tgt) in tokens.chunks(b * t).zip(targets.chunks(b * t)) {
        let rows = tok.len() / t;
        let (mut tok, mut tgt) = (tok.to_vec(), tgt.to_vec());
        for _ in rows..b {
            tok.extend_from_within(..t);
            tgt.extend(std::iter::repeat_n(IGNORE_TARGET, t));
        }
        let n = tgt.iter().filter(|&&x| x != IGNORE_TARGET).count();
        let (l, p) = predict(&MicroBatch::tokens(&tok, &tgt))?;
        loss += l * n as f64;
        scored += n;
        predictions.extend_from_slice(&p[..rows * t]);
        progress(predictions.len() / t.max(1), all_rows);
    }
    let loss = (loss / scored.max(1) as f64) as f32;
    Ok(match dataset {
        Dataset::Addition { eval } => {
            let (right, all) = data::accuracy(&predictions, eval);
            (loss, Some(right as f32 / all.max(1) as f32))
        }
        Dataset::File { .. } => (loss, None),
    })
}

fn precision_name(ds: &TrainConfig) -> &'static str {
    match ds.precision {
        config::Precision::Fp32 => "fp32",
        config::Precision::Fp16 { .. } => "fp16 (fp32 master weights, loss scaling)",
        config::Precision::Bf16 => "bf16 (fp32 master weights)",
    }
}
