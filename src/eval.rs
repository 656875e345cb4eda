//! `kiln eval`: the loss and perplexity of a trained model on token data, by the same
//! code `kiln train` evaluates with. By default the run's own held-out data (the
//! addition task's held-out problems, with exact match; a data file's held-out tail);
//! `--data FILE` scores the whole of another file.

use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use serde::Serialize;

use kiln_engine::data::{self, Addition, TokenSource};
use kiln_engine::Device;

use crate::sample::{open_one_device, Source, TextCodec};
use crate::train::{addition_eval, evaluate, held_out, Dataset};

/// What `kiln eval` is told.
#[derive(Clone, Debug, Default)]
pub struct EvalOptions {
    /// A run directory or a checkpoint directory.
    pub source: PathBuf,
    /// A LoRA adapter (PEFT's format) merged into the source's weights first.
    pub adapter: Option<PathBuf>,
    /// Score the whole of this file instead of the run's held-out data.
    pub data: Option<PathBuf>,
    /// The device (`kiln devices`); empty: the best adapter.
    pub devices: Vec<String>,
    /// Sequences per forward pass; `None`: the run's micro-batch.
    pub micro_batch: Option<usize>,
    /// Run in this dtype; `None`: the checkpoint's own (16-bit for imported files).
    pub dtype: Option<kiln_engine::DType>,
    /// Positions per scored row; `None`: the model's block_size (at most
    /// [`IMPORT_CONTEXT`](crate::sample::IMPORT_CONTEXT) for an imported Llama).
    pub seq: Option<usize>,
    /// Score an example file's examples packed several to a row, as training packs
    /// them (each attending only to itself: the same loss, fewer rows), instead of
    /// one per row.
    pub packed: bool,
    /// Draw a progress bar on stderr.
    pub progress: bool,
}

/// What `kiln eval` measured (`--json` prints it).
#[derive(Clone, Debug, Serialize)]
pub struct EvalReport {
    /// The checkpoint directory or imported file scored.
    pub checkpoint: PathBuf,
    /// The checkpoint's step (`None` for an imported file).
    pub step: Option<u64>,
    /// What was scored: the run's held-out data, or the file given.
    pub data: String,
    /// Sequences of `seq` positions scored.
    pub rows: usize,
    pub seq: usize,
    /// Positions whose next token was scored.
    pub tokens: usize,
    /// Mean cross-entropy per scored token (nats).
    pub loss: f32,
    pub perplexity: f64,
    /// The addition task's held-out exact match (0..1).
    pub accuracy: Option<f32>,
    pub device: String,
}

/// Sequences per forward pass for an imported model (it has no run to say).
const IMPORT_MICRO_BATCH: usize = 4;

/// Loads the checkpoint, builds its data and scores it.
pub fn eval(opts: &EvalOptions) -> Result<EvalReport> {
    let mut source = Source::open(&opts.source, opts.dtype)?;
    if let Some(dir) = &opts.adapter {
        source = source.with_adapter(dir)?;
    }
    match opts.seq {
        Some(seq) => source = source.with_context(seq)?,
        None => source.notes.extend(source.context_note()),
    }
    for note in &source.notes {
        crate::say::say(format!("note: {note}"));
    }
    let t = source.block_size();
    let b = match opts.micro_batch {
        Some(0) => bail!("--micro-batch 0: pass 1 or more sequences per forward pass"),
        Some(b) => b,
        None => source.record["deepspeed"]["batch"]["micro_batch"]
            .as_u64()
            .map_or(IMPORT_MICRO_BATCH, |b| b as usize),
    };
    // The data first: a missing file is reported before any device compiles kernels.
    let plan = plan(&source, opts.data.as_deref(), t, opts.packed)?;
    let dev = open_one_device(&opts.devices)?;
    let dev: &dyn Device = dev.as_ref();
    let network = source.network(dev, b, opts.packed)?;
    let bar = if opts.progress {
        let bar =
            ProgressBar::with_draw_target(Some(plan.rows as u64), ProgressDrawTarget::stderr());
        bar.set_style(
            ProgressStyle::with_template(
                "{bar:28.cyan/blue} {pos}/{len} rows [{elapsed_precise} < {eta_precise}]",
            )
            .expect("a fixed template")
            .progress_chars("=> "),
        );
        bar
    } else {
        ProgressBar::hidden()
    };
    let (loss, accuracy, tokens) = match &plan.what {
        Scored::Held(dataset) => {
            let (loss, acc) = evaluate(&network, dev, dataset, b, t, &mut |done, _| {
                bar.set_position(done as u64)
            })?;
            let tokens = match dataset {
                Dataset::Addition { eval } => eval
                    .targets
                    .iter()
                    .filter(|&&x| x != kiln_engine::IGNORE_TARGET)
                    .count(),
                Dataset::File { eval } => eval.as_ref().map_or(0, |e| e.scored()),
            };
            (loss, acc, tokens)
        }
        Scored::Whole(src) => {
            // Every row, as kiln train scores its held-out rows (an example file's
            // prompts and padding unscored; packed rows with their documents).
            let predict = kiln_engine::train::evaluate::predict_with(&network, dev);
            let s = kiln_engine::train::evaluate::score_source(
                &predict,
                src.as_ref(),
                b,
                t,
                &mut |done, _| bar.set_position(done as u64),
            )?;
            (s.loss, None, s.scored)
        }
    };
    bar.finish_and_clear();
    Ok(EvalReport {
        checkpoint: source.origin.clone(),
        step: source.step,
        data: plan.name,
        rows: plan.rows,
        seq: t,
        tokens,
        loss,
        perplexity: (loss as f64).exp(),
        accuracy,
        device: format!("{} ({})", dev.caps().name, dev.caps().backend),
    })
}

enum Scored {
    /// The run's held-out rows, as kiln train evaluates them.
    Held(Dataset),
    /// Every row of T + 1 tokens of a file.
    Whole(Box<dyn TokenSource>),
}

struct Plan {
    what: Scored,
    name: String,
    rows: usize,
}

/// The data to score: the run's held-out data, or all of `file` (an example file's
/// examples packed into rows where `packed`).
fn plan(source: &Source, file: Option<&Path>, t: usize, packed: bool) -> Result<Plan> {
    let v = source.model.vocab_size();
    if let Some(path) = file {
        let examples = data::Sidecar::read_for(path)
            .ok()
            .flatten()
            .is_some_and(|s| s.examples.is_some());
        let src: Box<dyn TokenSource> = match (packed, examples) {
            (false, _) => data::open_path(path, t)?,
            // Every example of the file, packed.
            (true, true) => Box::new(data::ExampleRows::packed(path, t, u64::MAX)?),
            (true, false) => {
                // A file that cannot be read says why first.
                data::open_path(path, t)?;
                bail!(
                    "--packed: {} is not an example file (from `kiln prepare` of a dataset of \
                     rows), whose examples could be packed; drop --packed",
                    path.display()
                );
            }
        };
        data::check_source(src.as_ref(), t, v)?;
        data::check_ids(src.as_ref(), v)?;
        let rows = (src.len() / (t as u64 + 1)) as usize;
        return Ok(Plan {
            name: format!(
                "{} (all {} rows of T + 1 = {} tokens)",
                src.name(),
                rows,
                t + 1
            ),
            what: Scored::Whole(src),
            rows,
        });
    }
    if packed {
        bail!(
            "--packed scores the example file given with --data; the run's held-out examples \
             are scored one per row, as training scores them"
        );
    }
    let Some(run_dir) = &source.run_dir else {
        bail!(
            "{}: an imported model has no run whose held-out data could be scored; pass \
             --data FILE (a `kiln prepare`d .bin)",
            source.origin.display()
        );
    };
    let recorded = source.record["data"]
        .as_str()
        .unwrap_or_default()
        .to_string();
    if source.codec == Ok(TextCodec::Addition) {
        let digits = recorded
            .strip_prefix("addition (")
            .and_then(|r| r.split_whitespace().next())
            .and_then(|d| d.parse().ok())
            .unwrap_or(data::DEFAULT_DIGITS);
        let seed = source.record["seed"].as_u64().unwrap_or(1);
        let eval = addition_eval(&Addition::new(digits, seed)?, t)?;
        return Ok(Plan {
            name: format!("{recorded}: held-out problems"),
            rows: eval.rows,
            what: Scored::Held(Dataset::Addition { eval }),
        });
    }
    let path = Path::new(&recorded);
    let src = data::open_path(path, t).with_context(|| {
        format!(
            "the run's data {recorded:?} (from its {}): run kiln eval from the directory the \
             run was started in, or pass --data FILE",
            run_dir
                .join(kiln_engine::train::runs::CONFIG_FILE)
                .display()
        )
    })?;
    let held = held_out(src.as_ref(), t)?;
    let Some(rows) = held.rows else {
        bail!(
            "the run has no held-out data ({}); pass --data FILE to score a whole file",
            held.none_because.unwrap_or_default()
        );
    };
    let n = rows.tokens.len() / t;
    Ok(Plan {
        name: format!("{recorded}: held-out tail"),
        rows: n,
        what: Scored::Held(Dataset::File { eval: Some(rows) }),
    })
}
