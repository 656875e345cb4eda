//! `kiln train`'s engine phase: the devices opened, the run's record checked against a
//! resumed run's, and the engine built (a [`DataParallel`] [`Trainer`] or a
//! [`PipelineTrainer`]), restored from the checkpoint or given `--init-from`'s weights.

use std::ops::Range;
use std::sync::Arc;

use anyhow::{bail, Context, Result};
use serde_json::{json, Value};

use kiln_engine::models::{Model, ModelStateBytes};
use kiln_engine::parallel::collective::Processes;
use kiln_engine::train::engine::{DataParallel, TrainingEngine};
use kiln_engine::train::pipeline_trainer::PipelineTrainer;
use kiln_engine::train::trainer::Trainer;
use kiln_engine::Device;
use kiln_wgpu::DeviceOptions;

use super::checkpoints::restore;
use super::data::Data;
use super::lora;
use super::options::TrainOptions;
use super::resolve::Resolved;
use super::run_dir::{check_inputs_survive, check_same_run, run_record};
use crate::devices::open_device;
use crate::init_from::InitWeights;
use crate::say::say;

/// What the engine phase gives the run.
pub(super) struct Built {
    pub engine: Box<dyn TrainingEngine>,
    /// A LoRA run: its adapted model, written as a PEFT adapter at each checkpoint.
    pub lora: Option<super::lora::LoraRun>,
    pub network: Arc<dyn Model>,
    pub parameters: usize,
    /// Each device as `name (backend)`.
    pub device_names: Vec<String>,
    /// The devices (and processes, stages, replicas) as the log and the record say.
    pub device_name: String,
    /// Per device, the model states it holds.
    pub model_states: Vec<ModelStateBytes>,
    /// What the run is (its config.json).
    pub record: Value,
    /// The data-parallel ranks this process reads batches for (a pipeline is one).
    pub ranks: Range<usize>,
    /// The data position to start reading from (a resumed run's).
    pub next_sample: u64,
}

/// Opens the devices and builds the engine; takes the processes and the
/// `--init-from` weights out of `run`.
pub(super) fn build(opts: &TrainOptions, run: &mut Resolved, data: &Data) -> Result<Built> {
    let procs = run.procs.take();
    let init = run.init.take();
    let (stages, world, seed, progress) = (run.stages, run.world, run.run.seed, run.progress);
    let Resolved {
        specs,
        ds,
        method,
        dir,
        resumed,
        model,
        ..
    } = &*run;
    let t = model.block_size();
    let data_name = &data.name;

    // LoRA: the settings resolved and the base frozen under them before a device opens
    // (a target that matches nothing is named now, not after minutes of loading).
    let base_model = model.build(t);
    if opts.adapter.is_some() && init.is_none() && resumed.is_none() {
        bail!(
            "--adapter without --init-from: an adapter is trained for a base model; give the \
             base it was trained on with --init-from (its adapter_config.json names it)"
        );
    }
    let recorded_lora = resumed.as_ref().and_then(|(r, _)| r.get("lora"));
    let lora = match lora::settings(opts, ds.kiln.lora.as_ref(), recorded_lora)? {
        Some(settings) => {
            let recorded_base = resumed
                .as_ref()
                .and_then(|(r, _)| r.get("init_from").and_then(|v| v.as_str()))
                .map(str::to_string);
            let base_name = init
                .as_ref()
                .map(|i| i.source.clone())
                .or(recorded_base)
                .unwrap_or_else(|| "random weights".into());
            Some(lora::adapt(base_model.clone(), settings, base_name)?)
        }
        None => None,
    };
    // A resumed LoRA run's base is not in its checkpoints: it is read again from where
    // the run started, and must be what it was.
    let resumed_base = match (&lora, &resumed, &init) {
        (Some(_), Some((recorded, _)), None) => match recorded.get("init_from") {
            Some(Value::String(from)) => Some(
                InitWeights::load(std::path::Path::new(from)).with_context(|| {
                    format!(
                        "--resume of a LoRA run: its base model is read again from {from}, \
                         where the run started"
                    )
                })?,
            ),
            _ => None,
        },
        _ => None,
    };
    let base_weights = match init.as_ref().or(resumed_base.as_ref()) {
        Some(i) if lora.is_some() => Some(i.weights_for(model)?),
        _ => None,
    };

    // Devices: each spec opens its own device, so `vulkan:0x2` gives two.
    let opened = specs
        .iter()
        .map(|s| {
            let options = DeviceOptions {
                memory_limit: opts.memory_limit,
                ..DeviceOptions::default()
            };
            open_device(s, &options)
        })
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
    let mut record = run_record(ds, model, data_name, seed, &device_name);
    if let Some(init) = &init {
        // As an absolute path where it is one here, so a resume (which reads a LoRA
        // run's base again) or a source opened from another directory finds it.
        let from = std::fs::canonicalize(&init.source)
            .map_or_else(|_| init.source.clone(), |p| p.display().to_string());
        record["init_from"] = json!(from);
    }
    if let Some(l) = &lora {
        record["lora"] = json!(l.model.config);
        if let Some(w) = &base_weights {
            record["base_fingerprint"] = json!(lora::fingerprint(w));
        }
    }
    check_inputs_survive(dir, opts)?;
    if let Some((recorded, _)) = &resumed {
        // Where the run's weights started is part of how it began, not of how it goes on:
        // its checkpoints hold them now.
        if let Some(from) = recorded.get("init_from") {
            record["init_from"] = from.clone();
        }
        check_same_run(dir, recorded, &record)?;
    }

    let network: Arc<dyn Model> = match &lora {
        Some(l) => l.model.clone(),
        None => base_model,
    };
    let mut next_sample = 0;
    let first_rank = procs.as_ref().map_or(0, Processes::first_rank);
    // Data-parallel ranks this process reads batches for (a pipeline is one).
    let local_ranks = opened.len() / stages;
    let (engine, parameters): (Box<dyn TrainingEngine>, usize) = if stages > 1 {
        if init.is_some() {
            // refuse_with_pipeline says so before any device opens; kept here so the
            // weights are never dropped silently.
            bail!(
                "--init-from with pipeline stages is not supported yet: start from those \
                 weights without --pipeline-stages, then continue the run with --resume \
                 --pipeline-stages N"
            );
        }
        let mut trainer =
            PipelineTrainer::new(opened, network.clone(), ds.clone(), seed, method, stages)?;
        if let Some((_, ck)) = &resumed {
            next_sample = restore(&mut trainer, ck, ds.batch.train_batch_size as u64)?;
        }
        // A LoRA run's base: read again from where the run started (a pipeline starts
        // from --init-from's weights only through a resume, as any run does).
        if let (Some(l), Some(w)) = (&lora, &base_weights) {
            trainer
                .set_frozen(w)
                .with_context(|| format!("the base model from {}", l.base_name))?;
        }
        let parameters = network
            .parameters()
            .iter()
            .filter(|p| !p.frozen)
            .map(|p| p.len())
            .sum::<usize>();
        (Box::new(trainer), parameters)
    } else {
        let devs: Vec<&dyn Device> = opened.iter().map(|d| d.as_ref()).collect();
        let trainer = Trainer::new_processes(&devs, network.clone(), ds.clone(), seed, procs)?;
        drop(devs);
        let mut engine = DataParallel::new(trainer, opened);
        if let Some((_, ck)) = &resumed {
            next_sample = restore(&mut engine, ck, ds.batch.train_batch_size as u64)?;
        }
        match (&lora, init) {
            (Some(l), init) => {
                if let Some(start) = l.start.as_ref().filter(|_| resumed.is_none()) {
                    engine
                        .set_weights(&start.tensors)
                        .context("--adapter: setting the adapters")?;
                }
                if let Some(w) = &base_weights {
                    engine
                        .set_frozen(w)
                        .with_context(|| format!("the base model from {}", l.base_name))?;
                }
                if progress {
                    say(format!(
                        "LoRA: {} adapter parameters on {} modules of the frozen base ({}{})",
                        engine.trainer.model.parameter_count(),
                        l.model.adapted.len(),
                        init.map_or(l.base_name.clone(), |i| i.describe),
                        if l.start.is_some() {
                            "; adapters from --adapter"
                        } else {
                            ""
                        }
                    ));
                }
            }
            (None, Some(init)) => {
                let weights = init.weights_for(model)?;
                engine
                    .set_weights(&weights)
                    .with_context(|| format!("--init-from {}", init.source))?;
                if progress {
                    say(format!("weights from {}; a fresh optimizer", init.describe));
                }
            }
            (None, None) => {}
        }
        let parameters = engine.trainer.model.parameter_count();
        (Box::new(engine), parameters)
    };
    let model_states = engine.model_state_bytes();
    Ok(Built {
        engine,
        lora,
        network,
        parameters,
        device_names,
        device_name,
        model_states,
        record,
        ranks: first_rank..first_rank + local_ranks,
        next_sample,
    })
}
