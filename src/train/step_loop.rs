//! `kiln train`'s last phase: the step loop (batches in, one optimizer step, the step's
//! record), with evaluation, checkpoints, the log and progress bar, the profiler, an
//! interrupt or unreadable data handled, and the summary written at the end.

use std::path::Path;
use std::sync::atomic::Ordering;
use std::sync::mpsc;
use std::time::{Duration, Instant};

use anyhow::Result;
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use serde_json::Value;

use kiln_engine::config::{self, TrainConfig};
use kiln_engine::data::{Addition, Loader};
use kiln_engine::device::compiling;
use kiln_engine::device::profile::{span, SpanKind};
use kiln_engine::models::MicroBatch;
use kiln_engine::train::checkpoint;
use kiln_engine::train::loss_scaler::LossScaler;
use kiln_engine::train::runs::{self, StepRecord, Summary};

use super::checkpoints::save;
use super::data::{evaluate_with, Data, Dataset};
use super::engine::Built;
use super::options::{RunReport, TrainOptions};
use super::resolve::Resolved;
use super::run_dir::open_metrics;
use super::settings::RunSettings;
use crate::say::say;
use kiln_engine::train::engine::TrainingEngine;

/// Writes the run directory (now that everything is valid), then trains from the
/// engine's step to the run's last, evaluating, logging and checkpointing as it goes;
/// the summary is written even when a step fails.
pub(super) fn run(
    opts: &TrainOptions,
    run: Resolved,
    data: Data,
    built: Built,
    loaders: Vec<Loader>,
) -> Result<RunReport> {
    // Bound in the order the run acquired them, so they are let go in reverse: the
    // loaders and the engine before the run directory's lock.
    let Resolved {
        started,
        writer,
        progress,
        stages,
        world,
        ds,
        dir,
        mut run_lock,
        resumed,
        run: settings,
        model,
        ..
    } = run;
    let RunSettings {
        steps: total,
        eval_every,
        checkpoint_every,
        ..
    } = settings;
    let Data {
        dataset,
        name: data_name,
        no_held_out,
        ..
    } = data;
    let Built {
        mut engine,
        network,
        parameters,
        device_names,
        device_name,
        model_states,
        record,
        next_sample,
        lora,
        ..
    } = built;
    let mut next_sample = next_sample;
    let mut loaders = loaders;
    let t = model.block_size();
    let b = ds.batch.micro_batch;
    let mut step = engine.steps();

    let mut metrics = open_metrics(
        &dir,
        writer,
        resumed.as_ref().map(|(_, ck)| ck),
        &record,
        &mut run_lock,
    )?;
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
            "training {}{}, {} parameters, on {data_name}, on {} for {total} steps, \
             micro-batch {b} × {} accumulation × {world} {}, {}; run dir {}",
            network.describe(),
            match ds.activation_checkpointing {
                Some(1) => ", activation checkpointing".to_string(),
                Some(n) => format!(", activation checkpointing every {n} blocks"),
                None => String::new(),
            },
            parameters,
            device_name,
            ds.batch.grad_accum,
            if stages > 1 {
                "pipeline replica(s)"
            } else {
                "device(s)"
            },
            ds.precision.describe(),
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
                host_peak_bytes: kiln_engine::models::host_peak_resident(),
                comm_ms: comm.ms,
                comm_overlap: comm.overlap,
                comm_bytes: comm.bytes,
                offload_ms: ds.zero.offload_optimizer.then_some(comm.offload_ms),
                offload_exposed_ms: ds.zero.offload_optimizer.then_some(comm.offload_exposed_ms),
                gather_ms: (ds.zero.stage == 3).then_some(comm.gather_ms),
                gather_hidden: (ds.zero.stage == 3)
                    .then_some(comm.gather_hidden_ms / comm.gather_ms.max(1e-9)),
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
            let evaluates = writer && !matches!(dataset, Dataset::File { eval: None, .. });
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
                         tokens/s, stall {:.1} ms{}{}{}",
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
                        },
                        rec.offload_ms
                            .zip(rec.offload_exposed_ms)
                            .map(|(ms, exposed)| format!(
                                ", host optimizer step {ms:.1} ms ({exposed:.1} ms exposed)"
                            ))
                            .unwrap_or_default(),
                        rec.gather_ms
                            .zip(rec.gather_hidden)
                            .map(|(ms, hidden)| format!(
                                ", stage-3 weight loads {ms:.1} ms ({:.0}% hidden)",
                                hidden * 100.0
                            ))
                            .unwrap_or_default()
                    ),
                );
                since_print = (0.0, 0);
            }
            if s.skipped {
                log(&bar, skipped_line(&ds, engine.as_ref(), step, s.loss_scale));
            }
            bar.set_position(step);
            bar.set_message(format!(
                "loss {:.3} | {:.0} tok/s | scale {}",
                s.loss, rec.tokens_per_s, s.loss_scale
            ));
            if last || (checkpoint_every > 0 && step.is_multiple_of(checkpoint_every)) {
                let _span = span("checkpoint", SpanKind::Checkpoint);
                let saved = save(engine.as_ref(), &dir, step, next_sample, &settings)?;
                for note in saved.notes {
                    log(&bar, format!("note: {note}"));
                }
                if let Some(l) = lora.as_ref().filter(|_| writer) {
                    super::lora::write_adapter(l, &dir, &saved.dir)?;
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
                save(engine.as_ref(), &dir, step, at_step_end, &settings).map(drop)
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
        kiln_engine::train::runs_chart::write_chart(&dir)?;
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
fn skipped_line(ds: &TrainConfig, trainer: &dyn TrainingEngine, step: u64, scale: f32) -> String {
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
