//! `kiln train`'s data: the training stream and its sampler, what evaluation runs on
//! (the addition task's held-out problems or a file's held-out tail), the loaders that
//! read each rank's share of every batch, and the evaluation itself (`kiln eval`'s too).

use std::ops::Range;
use std::path::Path;
use std::sync::Arc;

use anyhow::{bail, Result};

use kiln_engine::config::TrainConfig;
use kiln_engine::data::{
    self, Addition, BatchLayout, EvalRows, Loader, LoaderConfig, Sampler, TokenSource,
};
use kiln_engine::models::{ModelConfig, Network};
use kiln_engine::train::evaluate::{self, Predict, ScoredRows};
use kiln_engine::Device;

use crate::init_from::InitWeights;
use crate::say::say;

/// Lines of the built-in addition stream (10 tokens each at 2 digits): 200k lines are
/// ~20 epochs' worth of the default run, so batches rarely repeat.
const ADDITION_LINES: u64 = 200_000;
/// At least this many rows are evaluated (rounded up to whole micro-batches).
const EVAL_ROWS: usize = 256;
/// Share of a data file kept for evaluation (its tail).
const HOLDOUT_FRACTION: f64 = 0.05;

/// The training data and how it is evaluated.
pub(crate) enum Dataset {
    /// The built-in task: exact-match accuracy on held-out problems.
    Addition { eval: EvalRows },
    /// A file: loss on rows of its held-out tail (none if it is too short).
    File { eval: Option<ScoredRows> },
}

/// What the data phase gives the run.
pub(super) struct Data {
    /// The training stream (a file's head, without its held-out tail).
    pub source: Arc<dyn TokenSource>,
    pub sampler: Sampler,
    pub dataset: Dataset,
    /// The data as the run's record and log name it.
    pub name: String,
    /// Why a data file has no held-out rows, for the summary.
    pub no_held_out: Option<String>,
    /// Rows pack several examples (each batch carries their document starts).
    pub packed: bool,
}

/// Opens the training data (`path`, else the built-in addition task) and splits off
/// what is evaluated; a model whose sizes did not come from a file (`model_from_file`)
/// takes the data's vocabulary.
pub(super) fn load(
    path: Option<&Path>,
    model: &mut ModelConfig,
    model_from_file: bool,
    init: &Option<InitWeights>,
    (seed, packing): (u64, bool),
    progress: bool,
) -> Result<Data> {
    let t = model.block_size();
    let mut no_held_out = None;
    let mut packed = false;
    let (source, train_len, dataset, data_name): (Arc<dyn TokenSource>, u64, Dataset, String) =
        match path {
            None => {
                let add = Addition::new(data::DEFAULT_DIGITS, seed)?;
                if !model_from_file {
                    model.set_vocab_size(Addition::vocab_size());
                }
                if let Some(init) = init {
                    init.check_vocabulary(
                        model,
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
                let examples = path.extension().is_some_and(|e| e == "bin")
                    && data::Sidecar::read_for(path)
                        .ok()
                        .flatten()
                        .is_some_and(|s| s.examples.is_some());
                let src: Arc<dyn TokenSource> = if examples {
                    let rows = data::ExampleRows::open(path, t)?;
                    if progress && !packing {
                        say(rows.describe()?);
                    }
                    packed = packing;
                    Arc::new(rows)
                } else {
                    Arc::from(data::open_path(path, t)?)
                };
                if !model_from_file {
                    model.set_vocab_size(src.vocab_hint().ok_or_else(|| {
                        anyhow::anyhow!(
                            "{}: its vocabulary size is unknown (no .json sidecar); pass --model \
                             with a vocab_size, or make the file with `kiln prepare`",
                            path.display()
                        )
                    })?);
                }
                if let Some(init) = init {
                    let is_bin = path
                        .extension()
                        .is_some_and(|e| e.eq_ignore_ascii_case("bin"));
                    let sidecar = match is_bin {
                        true => data::Sidecar::read_for(path)?,
                        false => None,
                    };
                    // The model's own tokenizer: its ids are rows of the embedding,
                    // which may have more (padding).
                    if !init.check_tokenizer(sidecar.as_ref(), &src.name())? {
                        init.check_vocabulary(model, src.vocab_hint(), &src.name())?;
                    }
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
                let head: Arc<dyn TokenSource> = if packed {
                    // The held-out tail is the last examples, one per row (what `kiln
                    // eval` scores); the examples before it are packed.
                    let rows = data::ExampleRows::packed(path, t, train_len / (t as u64 + 1))?;
                    if progress {
                        say(rows.describe()?);
                    }
                    Arc::new(rows)
                } else {
                    Arc::new(data::Prefix::new(src, train_len)?)
                };
                let train_len = head.len();
                (head, train_len, Dataset::File { eval }, name)
            }
        };
    let sampler = Sampler::new(train_len, t, seed)?;
    Ok(Data {
        source,
        sampler,
        dataset,
        name: data_name,
        no_held_out,
        packed,
    })
}

/// One loader per data-parallel rank in `ranks` (this process's), each reading its
/// disjoint share of every global batch from sample `next_sample` on.
pub(super) fn loaders(
    data: &Data,
    ds: &TrainConfig,
    model: &ModelConfig,
    world: usize,
    ranks: Range<usize>,
    next_sample: u64,
) -> Result<Vec<Loader>> {
    let k = &ds.kiln;
    let layout = BatchLayout::new(ds.batch.micro_batch, ds.batch.grad_accum, world)?;
    let loaders = ranks
        .map(|rank| {
            let mut cfg = LoaderConfig::new(layout, rank, model.vocab_size());
            cfg.start_sample = next_sample;
            cfg.workers = k.data_workers;
            cfg.depth = k.prefetch_depth;
            Loader::new(data.source.clone(), data.sampler, cfg)
        })
        .collect::<Result<Vec<_>, _>>()?;
    Ok(loaders)
}

/// A data file's held-out tail: the rows `kiln train` evaluates on and `kiln eval`
/// scores by default.
pub(crate) struct HeldOut {
    /// Tokens before the tail (what is trained on).
    pub train_len: u64,
    /// Whole rows of `t` positions, `None` when the file is too short to spare one.
    pub rows: Option<ScoredRows>,
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
    let rows = ScoredRows::read(src, train_len, hold, t)?;
    Ok(HeldOut {
        train_len,
        rows: Some(rows),
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
    evaluate_with(
        &evaluate::predict_with(network, dev),
        dataset,
        b,
        t,
        progress,
    )
}

/// [`evaluate`] with any engine's forward pass: the loss over the scored targets
/// (`kiln_engine::train::evaluate`), and the addition task's exact match.
pub(crate) fn evaluate_with(
    predict: &Predict,
    dataset: &Dataset,
    b: usize,
    t: usize,
    progress: &mut dyn FnMut(usize, usize),
) -> Result<(f32, Option<f32>)> {
    match dataset {
        Dataset::Addition { eval } => {
            let rows = ScoredRows {
                tokens: eval.tokens.clone(),
                targets: eval.targets.clone(),
                starts: None,
            };
            let s = evaluate::score(predict, &rows, b, t, progress)?;
            let (right, all) = data::accuracy(&s.predictions, eval);
            Ok((s.loss, Some(right as f32 / all.max(1) as f32)))
        }
        Dataset::File { eval: Some(rows) } => {
            Ok((evaluate::score(predict, rows, b, t, progress)?.loss, None))
        }
        // The training loop does not evaluate then; an error, should it ever ask.
        Dataset::File { eval: None } => bail!("no held-out data to evaluate on"),
    }
}
