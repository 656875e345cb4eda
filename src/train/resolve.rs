//! `kiln train`'s first phase: the flags, the config, the devices and pipeline stages,
//! the run directory to write or resume, the run's settings and the model, resolved
//! and checked before any device opens or anything is written.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use serde_json::Value;

use kiln_engine::config::{self, TrainConfig};
use kiln_engine::models::ModelConfig;
use kiln_engine::parallel::collective::Processes;
use kiln_engine::parallel::pipeline_partition::PartitionMethod;
use kiln_engine::train::checkpoint;
use kiln_engine::train::runs;
use kiln_engine::train::trainer::TrainerState;

use super::checkpoints::data_position;
use super::options::{TrainOptions, DEMO_DS_CONFIG, DEMO_MODEL};
use super::run_dir::check_run_dir;
use super::settings::{resolve_settings, RunSettings};
use crate::devices::{default_device, parse_devices, DeviceSpec};
use crate::init_from::InitWeights;
use crate::say::say;

/// What the run is, once every flag and the config are read: all the later phases
/// work from this.
pub(super) struct Resolved {
    /// When the run began (the summary's total time counts from here).
    pub started: Instant,
    /// This process writes the run directory and speaks for the job (process 0).
    pub writer: bool,
    /// Log lines and a progress bar (`opts.progress`, in the writing process).
    pub progress: bool,
    /// This process's devices, one spec per device.
    pub specs: Vec<DeviceSpec>,
    /// This process's part in a multi-process job.
    pub procs: Option<Processes>,
    /// Pipeline stages (1: none).
    pub stages: usize,
    /// The data-parallel world (pipeline replicas, or devices) the batch sizes are for.
    pub world: usize,
    pub ds: TrainConfig,
    /// How the blocks are cut into pipeline stages.
    pub method: PartitionMethod,
    /// The run directory.
    pub dir: PathBuf,
    /// The run directory's lock, held until the run ends (a resumed run's is taken
    /// here, a new run's once its directory is created).
    pub run_lock: Option<runs::RunLock>,
    /// A resumed run's recorded config.json and its latest checkpoint.
    pub resumed: Option<(Value, checkpoint::Checkpoint)>,
    /// The seed, step count, intervals and retention.
    pub run: RunSettings,
    /// The weights to start from (`--init-from`).
    pub init: Option<InitWeights>,
    pub model: ModelConfig,
    /// Whether the model's sizes came from a file (`--model` or `--init-from`), so its
    /// vocabulary is not replaced by the data's.
    pub model_from_file: bool,
}

/// Where a run goes without `--out`: `runs/<UTC date and time>`.
pub fn default_run_dir() -> PathBuf {
    let stamp = runs::format_utc(std::time::SystemTime::now())
        .replace([':', ' '], "-")
        .replace("-UTC", "");
    PathBuf::from("runs").join(stamp)
}

/// Reads and checks every setting, in the order a mistake is best reported in; opens
/// no device and writes nothing (a resumed run's directory is locked).
pub(super) fn resolve(opts: &TrainOptions) -> Result<Resolved> {
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
    let mut dir = opts.out.clone().unwrap_or_else(default_run_dir);
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
    let run_lock = if writer && opts.resume {
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
    let total = settings.run.steps;
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
    let (model, model_from_file) = match (&opts.model, &init) {
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
                // The same model (checked), cut to the file's block_size: the weights'
                // own config keeps what the file may not say (a Llama's reach).
                let mut same = init.model.clone();
                same.set_block_size(m.block_size());
                (same, true)
            } else {
                (m, true)
            }
        }
        (None, Some(init)) => (init.model.clone(), true),
        // A resumed run is the model it recorded (one started --init-from a directory
        // has no model file to pass again).
        (None, None) if resumed.is_some() => {
            let recorded = &resumed.as_ref().expect("checked").0["model"];
            let m = ModelConfig::parse(&recorded.to_string()).map_err(|e| {
                anyhow::anyhow!(
                    "--resume: the run's recorded model does not read ({e}); pass --model"
                )
            })?;
            (m, true)
        }
        (None, None) => (
            ModelConfig::parse(DEMO_MODEL).map_err(|e| anyhow::anyhow!("the demo model: {e}"))?,
            false,
        ),
    };
    let mut model = model;
    if let Some(seq) = opts.seq {
        if opts.resume {
            bail!("--seq with --resume: a resumed run keeps its sequence length; drop --seq");
        }
        model.set_seq(seq)?;
    }
    Ok(Resolved {
        started,
        writer,
        progress,
        specs,
        procs,
        stages,
        world,
        ds,
        method,
        dir,
        run_lock,
        resumed,
        run: settings.run,
        init,
        model,
        model_from_file,
    })
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
        ds.pipeline.partition = PartitionMethod::parse(text).map_err(anyhow::Error::msg)?;
        ds.provenance
            .insert("pipeline.partition".into(), config::Provenance::Caller);
    }
    let method = ds.pipeline.partition.clone();
    if let PartitionMethod::Blocks(counts) = &method {
        if stages > 1 && counts.len() != stages {
            bail!(
                "the partition lists {} block counts ({}) but the run has {stages} pipeline \
                 stages: give one count per stage, or another --partition",
                counts.len(),
                method.spelled()
            );
        }
    }
    Ok(method)
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
