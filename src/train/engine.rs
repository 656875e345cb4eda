//! `kiln train`'s engine phase: the devices opened, the run's record checked against a
//! resumed run's, and the [`Engine`] built (a data-parallel [`Trainer`] or a
//! [`PipelineTrainer`]), restored from the checkpoint or given `--init-from`'s weights.

use std::ops::Range;
use std::sync::Arc;

use anyhow::{Context, Result};
use serde_json::{json, Value};

use kiln_engine::models::{Model, ModelStateBytes, NetworkOptions};
use kiln_engine::parallel::collective::Processes;
use kiln_engine::parallel::pipeline::Pipeline;
use kiln_engine::train::pipeline_trainer::PipelineTrainer;
use kiln_engine::train::trainer::{self as engine_trainer, Trainer};
use kiln_engine::Device;
use kiln_wgpu::DeviceOptions;

use super::checkpoints::restore;
use super::data::Data;
use super::options::TrainOptions;
use super::resolve::Resolved;
use super::run_dir::{check_inputs_survive, check_same_run, run_record};
use crate::devices::open_device;
use crate::say::say;
use crate::train_engine::Engine;

/// What the engine phase gives the run.
pub(super) struct Built {
    pub engine: Engine,
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
    let b = ds.batch.micro_batch;
    let data_name = &data.name;

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
    let mut record = run_record(ds, model, data_name, seed, &device_name);
    if let Some(init) = &init {
        record["init_from"] = json!(init.source);
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

    let network = model.build(t);
    let first_rank = procs.as_ref().map_or(0, Processes::first_rank);
    // Data-parallel ranks this process reads batches for (a pipeline is one).
    let local_ranks = opened.len() / stages;
    let (mut engine, parameters) = if stages > 1 {
        let options = NetworkOptions {
            batch: b,
            dtype: engine_trainer::precision(ds)?.0,
            optimizer: ds.optimizer.clone(),
            seed,
        };
        // Per device, stage-major (device s * dp + r runs stage s of replica r).
        let dp = opened.len() / stages;
        let memory = Pipeline::memory(network.as_ref(), &options, method, stages)?
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
            PipelineTrainer::new(opened, network.clone(), ds.clone(), seed, method, stages)?;
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
        let weights = init.weights_for(model)?;
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
    Ok(Built {
        engine,
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
