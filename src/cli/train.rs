//! `kiln train` (one process, or each of an `mpirun` job's, with Ctrl-C, SIGTERM and
//! SIGHUP stopping the run after a checkpoint) and `kiln eval`: a model trained, and a
//! trained model scored.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use anyhow::{Context, Result};

use super::args::{EvalArgs, TrainArgs};

pub(crate) fn train(a: TrainArgs) -> Result<()> {
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
        anyhow::bail!(
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
        packing: a.no_packing.then_some(false),
        checkpoint_every: a.checkpoint_every,
        keep_checkpoints: a.keep_checkpoints,
        resume: a.resume,
        init_from: a.init_from,
        seq: a.seq,
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

pub(crate) fn eval(a: EvalArgs) -> Result<()> {
    let r = kiln::eval::eval(&kiln::eval::EvalOptions {
        source: a.source,
        data: a.data,
        devices: a.devices,
        micro_batch: a.micro_batch,
        dtype: a.dtype.map(|d| d.parse()).transpose()?,
        seq: a.seq,
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
