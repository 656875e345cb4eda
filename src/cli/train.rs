//! `kiln train` (one process, or each of an `mpirun` job's, with Ctrl-C, SIGTERM and
//! SIGHUP stopping the run after a checkpoint) and `kiln eval`: a model trained, and a
//! trained model scored.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use anyhow::{Context, Result};

use super::args::{EvalArgs, RowArgs, TrainArgs};
use super::prepare::{is_rows, prepare_rows};

/// Where `kiln train --data ROWS` puts the examples it prepares, in the run directory.
const PREPARED: &str = "data/examples.bin";

/// Whether `--data path` is a dataset of rows to prepare: a file `kiln prepare` reads as
/// rows, a directory `datasets.save_to_disk` wrote, or one holding Parquet shards (any
/// other directory is refused as data, saying so).
fn is_dataset(path: &Path) -> bool {
    // A few levels deep (hub datasets nest `data/<config>/`): a symbolic link back up
    // the tree must not send the search round for ever.
    fn holds_parquet(dir: &Path, depth: usize) -> bool {
        std::fs::read_dir(dir)
            .into_iter()
            .flatten()
            .flatten()
            .any(|e| {
                let p = e.path();
                if p.is_dir() {
                    depth > 0 && holds_parquet(&p, depth - 1)
                } else {
                    p.extension()
                        .is_some_and(|x| x.eq_ignore_ascii_case("parquet"))
                }
            })
    }
    if path.is_dir() {
        // `datasets.save_to_disk`'s directory (a dataset's or a DatasetDict's).
        let saved = ["state.json", "dataset_dict.json"];
        saved.iter().any(|f| path.join(f).is_file()) || holds_parquet(path, 4)
    } else {
        is_rows(path)
    }
}

/// Whether `dir` holds a run (its config.json).
fn has_run(dir: &Path) -> bool {
    dir.join(kiln::engine::train::runs::CONFIG_FILE).exists()
}

/// Prepares the dataset of rows `data` into the run directory `dir` (as `kiln prepare`
/// would), or finds the examples a resumed run was started with there. Returns the
/// example file and whether this call created `dir`.
fn prepare_into_run(
    data: &Path,
    dir: &Path,
    tokenizer: Option<&str>,
    init_from: Option<&Path>,
    rows: RowArgs,
    resume: bool,
) -> Result<(PathBuf, bool)> {
    let file = dir.join(PREPARED);
    if kiln::engine::parallel::collective::launched_by_mpirun() {
        anyhow::bail!(
            "--data {}: every process of an mpirun job would prepare the dataset into the \
             same run directory. Prepare it once with `kiln prepare {} examples.bin \
             --tokenizer ...` and pass --data examples.bin",
            data.display(),
            data.display()
        );
    }
    kiln::train::check_input_survives(dir, "--data", data)?;
    kiln::train::check_run_dir(dir, resume)?;
    if resume {
        if !file.exists() {
            anyhow::bail!(
                "--resume --data {}: the run in {} was not started from a dataset of rows (it \
                 has no {PREPARED}); resume it with the --data it was started with",
                data.display(),
                dir.display()
            );
        }
        errln!(
            "{}: the examples prepared from {} when the run started",
            file.display(),
            data.display()
        );
        let flag = tokenizer.map(|_| "--tokenizer").or(rows.first_given());
        if let Some(flag) = flag {
            errln!("note: {flag} is not used: a resume trains on the examples already prepared");
        }
        return Ok((file, false));
    }
    let tokenizer = match (tokenizer, init_from) {
        (Some(t), _) => t.to_string(),
        (None, Some(m)) if m.join("tokenizer.json").is_file() => m.display().to_string(),
        _ => anyhow::bail!(
            "--data {} is a dataset of rows, which is tokenized before training: pass \
             --tokenizer (a Hugging Face model directory or its tokenizer.json, gpt2 or bytes; \
             the model's own for --init-from), or prepare it first with `kiln prepare`",
            data.display()
        ),
    };
    let tok = kiln::engine::data::Tokenizer::open(&tokenizer)?;
    let created = !dir.exists();
    let parent = file.parent().expect("a file in the run directory");
    let result = std::fs::create_dir_all(parent)
        .with_context(|| format!("creating {}", parent.display()))
        .and_then(|()| prepare_rows(data, &file, &tok, rows));
    match result {
        Ok(summary) => {
            errln!("{summary}");
            Ok((file, created))
        }
        Err(e) => {
            if created {
                let _ = std::fs::remove_dir_all(dir);
            }
            Err(e)
        }
    }
}

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
    let mut out = a.out;
    let prepared = match a.data {
        Some(d) if is_dataset(&d) => {
            let tokenizer = a.tokenizer.as_deref();
            let dir = out.get_or_insert_with(kiln::train::default_run_dir);
            Some(prepare_into_run(
                &d,
                dir,
                tokenizer,
                a.init_from.as_deref(),
                a.rows,
                a.resume,
            )?)
        }
        d => {
            let what = d
                .as_ref()
                .map_or("the built-in addition task".to_string(), |d| {
                    format!("{}, which is not a dataset of rows", d.display())
                });
            if a.tokenizer.is_some() {
                anyhow::bail!(
                    "--tokenizer is for a --data dataset of rows (.jsonl, .json, .parquet, a \
                     directory or glob of Parquet shards, a save_to_disk directory or .arrow \
                     file, .csv, .tsv), and the data is {what}: a file \
                     from `kiln prepare` names its tokenizer in its sidecar"
                );
            }
            if let Some(flag) = a.rows.first_given() {
                anyhow::bail!(
                    "{flag} is for a --data dataset of rows (.jsonl, .json, .parquet, a \
                     directory or glob of Parquet shards, a save_to_disk directory or .arrow \
                     file, .csv, .tsv), and the data is {what}"
                );
            }
            d.map(|d| (d, false))
        }
    };
    let created = prepared.as_ref().is_some_and(|p| p.1);
    // Installed once the dataset is prepared: until then Ctrl-C stops kiln at once (a
    // half-prepared dataset is of no use, and its files are written whole or not at all).
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
        data: prepared.map(|p| p.0),
        devices: a.devices,
        out,
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
        memory_limit: a
            .memory_limit
            .as_deref()
            .map(|s| kiln::estimate::parse_size("--memory-limit", s))
            .transpose()?,
        lora: a.lora,
        adapter: a.adapter,
    };
    let r = match kiln::train::train(&opts) {
        Ok(r) => r,
        Err(e) => {
            // A run that did not start keeps the examples prepared for it (preparing a
            // large dataset takes long), and says how to use them.
            if let Some(dir) = opts.out.as_deref().filter(|d| created && !has_run(d)) {
                let file = dir.join(PREPARED);
                errln!(
                    "note: the run did not start; the examples prepared for it are kept in \
                     {}: pass --data {} to train on them (the same --out is fine), or delete {}",
                    file.display(),
                    file.display(),
                    dir.display()
                );
            }
            return Err(e);
        }
    };
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
        packed: a.packed,
        progress: !a.json,
        adapter: a.adapter,
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
