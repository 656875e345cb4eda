//! `kiln train`: a GPT trained from a DeepSpeed config on one device, with prefetched
//! data, periodic evaluation, atomic checkpoints, `--resume`, and a run directory
//! holding the resolved config, per-step metrics, a summary and a chart.
//!
//! With no arguments it trains the built-in demo: a small GPT learning 2-digit addition
//! (`demos/addition.*.json`), scored by exact match on held-out problems.
//!
//! A run goes through four phases, each in its own file: [`resolve`] (the flags, the
//! config, the devices and stages, the run's settings and model), [`data`] (the training
//! stream and what is evaluated), [`engine`] (the devices opened and the engine built
//! or restored) and [`step_loop`] (the steps, evaluation, checkpoints and summary). The
//! run directory ([`run_dir`]), the run's own settings ([`settings`]) and its
//! checkpoints ([`checkpoints`]) are the phases' common ground.

mod checkpoints;
mod data;
mod engine;
mod lora;
mod options;
mod resolve;
mod run_dir;
mod settings;
mod step_loop;

pub(crate) use data::{addition_eval, evaluate, held_out, Dataset};
pub use options::{RunReport, TrainOptions, DEMO_DS_CONFIG, DEMO_MODEL};
pub use resolve::{configured_stages, default_run_dir, read_json_input};
pub use run_dir::{check_input_survives, check_run_dir};
pub use step_loop::bubble_warning;

use anyhow::Result;

/// Resolves the config, opens the device, builds or restores the engine and trains.
///
/// Nothing is written until every setting is valid (config, model, data, devices, the
/// checkpoint to resume), so a run that fails to start leaves no run directory behind.
pub fn train(opts: &TrainOptions) -> Result<RunReport> {
    let mut run = resolve::resolve(opts)?;
    let packing = opts.packing.unwrap_or(run.ds.kiln.packing);
    let data = data::load(
        opts.data.as_deref(),
        &mut run.model,
        run.model_from_file,
        &run.init,
        (run.run.seed, packing),
        run.progress,
    )?;
    // The networks pack exactly when the data does.
    run.ds.packed_rows = data.packed;
    let built = engine::build(opts, &mut run, &data)?;
    let loaders = data::loaders(
        &data,
        &run.ds,
        &run.model,
        run.world,
        built.ranks.clone(),
        built.next_sample,
    )?;
    step_loop::run(opts, run, data, built, loaders)
}
