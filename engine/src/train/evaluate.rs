//! Evaluation: a model scored on rows of tokens. The loss is the mean over every scored
//! target of the rows — one sum over all of them, as training takes its loss, not a
//! mean of per-batch means — and each position's predicted token is kept for task
//! metrics (the addition demo's exact match). `kiln train`'s held-out evaluation and
//! `kiln eval` both score through here, as can an app or the web build.

use crate::data::{mask_targets, DataError, TokenSource};
use crate::models::{MicroBatch, Network};
use crate::{Device, IGNORE_TARGET};

/// What scoring can fail on: reading the rows, or running the model.
#[derive(Debug, thiserror::Error)]
pub enum EvalError {
    #[error(transparent)]
    Data(#[from] DataError),
    #[error(transparent)]
    Model(#[from] crate::Error),
}

pub type Result<T, E = EvalError> = std::result::Result<T, E>;

/// Rows of `t` positions to score: `tokens` in, next-token `targets` out
/// ([`IGNORE_TARGET`] where nothing is scored), and for rows that pack several
/// documents where each token's document starts in its row.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct ScoredRows {
    pub tokens: Vec<u32>,
    pub targets: Vec<u32>,
    pub starts: Option<Vec<u32>>,
}

impl ScoredRows {
    /// `n` rows of `src` from token `first` on, each `t + 1` tokens: the first `t` in,
    /// the last `t` as targets, masked as training masks them (a prompt, padding, a
    /// packed document's first token), with document starts where `src` packs.
    pub fn read(src: &dyn TokenSource, first: u64, n: usize, t: usize) -> Result<ScoredRows> {
        let mut rows = ScoredRows {
            tokens: Vec::with_capacity(n * t),
            targets: Vec::with_capacity(n * t),
            starts: None,
        };
        let mut row = vec![0u32; t + 1];
        let mut starts = Vec::new();
        for r in 0..n {
            let start = first + (r * (t + 1)) as u64;
            src.read(start, &mut row)?;
            rows.tokens.extend_from_slice(&row[..t]);
            rows.targets.extend_from_slice(&row[1..]);
            let at = rows.targets.len() - t;
            mask_targets(src, start, &mut rows.targets[at..])?;
            if src.read_documents(start, &mut row[..t])? {
                starts.extend_from_slice(&row[..t]);
            }
        }
        rows.starts = (starts.len() == rows.tokens.len() && n > 0).then_some(starts);
        Ok(rows)
    }

    /// Targets scored.
    pub fn scored(&self) -> usize {
        self.targets.iter().filter(|&&x| x != IGNORE_TARGET).count()
    }
}

/// A model's forward pass for scoring: a micro-batch's mean loss over its scored
/// targets and every position's predicted token.
pub type Predict<'a> = dyn Fn(&MicroBatch) -> crate::Result<(f64, Vec<u32>)> + 'a;

/// [`Predict`] of a network on a device.
pub fn predict_with<'a>(
    network: &'a Network,
    dev: &'a dyn Device,
) -> impl Fn(&MicroBatch) -> crate::Result<(f64, Vec<u32>)> + 'a {
    move |m| network.predict(dev, m)
}

/// What scoring found.
#[derive(Clone, Debug, PartialEq)]
pub struct Score {
    /// Mean cross-entropy per scored target (nats); 0 when nothing was scored.
    pub loss: f32,
    /// Targets scored.
    pub scored: usize,
    /// Every position's predicted token, row by row (empty from [`score_source`]).
    pub predictions: Vec<u32>,
}

/// Scores `rows` of `t` positions in micro-batches of `b` rows (the model's shapes are
/// fixed when it is built): a last, partial micro-batch is filled with copies of its
/// first row that score nothing, and each micro-batch's mean is weighed by its scored
/// targets. `progress(rows done, rows)` after each micro-batch.
pub fn score(
    predict: &Predict,
    rows: &ScoredRows,
    b: usize,
    t: usize,
    progress: &mut dyn FnMut(usize, usize),
) -> Result<Score> {
    let whole =
        t > 0 && rows.tokens.len().is_multiple_of(t) && rows.targets.len() == rows.tokens.len();
    let starts_fit = rows
        .starts
        .as_ref()
        .is_none_or(|s| s.len() == rows.tokens.len());
    if b == 0 || !whole || !starts_fit {
        return Err(crate::Error::InvalidArgument(format!(
            "evaluate: {} tokens, {} targets{} in rows of {t}, {b} rows per micro-batch: \
             give whole rows (tokens, targets and starts alike) and at least one row per \
             micro-batch",
            rows.tokens.len(),
            rows.targets.len(),
            rows.starts
                .as_ref()
                .map_or(String::new(), |s| format!(", {} document starts", s.len()))
        ))
        .into());
    }
    let (mut loss, mut scored) = (0.0f64, 0usize);
    let mut predictions = Vec::with_capacity(rows.tokens.len());
    let all = rows.tokens.len() / t.max(1);
    let chunks = rows.tokens.chunks(b * t).zip(rows.targets.chunks(b * t));
    for (c, (tok, tgt)) in chunks.enumerate() {
        let n = tok.len() / t;
        let (mut tok, mut tgt) = (tok.to_vec(), tgt.to_vec());
        let at = c * b * t;
        let mut docs = rows.starts.as_ref().map(|s| s[at..at + n * t].to_vec());
        for _ in n..b {
            tok.extend_from_within(..t);
            tgt.extend(std::iter::repeat_n(IGNORE_TARGET, t));
            if let Some(d) = &mut docs {
                d.extend_from_within(..t);
            }
        }
        let count = tgt.iter().filter(|&&x| x != IGNORE_TARGET).count();
        let batch = match &docs {
            Some(d) => MicroBatch::packed(&tok, &tgt, d, t),
            None => MicroBatch::tokens(&tok, &tgt),
        };
        let (l, p) = predict(&batch)?;
        loss += l * count as f64;
        scored += count;
        predictions.extend_from_slice(&p[..n * t]);
        progress(predictions.len() / t.max(1), all);
    }
    Ok(Score {
        loss: (loss / scored.max(1) as f64) as f32,
        scored,
        predictions,
    })
}

/// Rows of a source read and scored at a time: bounded memory, whatever its size.
const ROWS_PER_PIECE: usize = 1024;

/// Scores every row of `t + 1` tokens of `src` (see [`ScoredRows::read`]), reading
/// [`ROWS_PER_PIECE`] rows at a time; `progress(rows done, rows)`.
pub fn score_source(
    predict: &Predict,
    src: &dyn TokenSource,
    b: usize,
    t: usize,
    progress: &mut dyn FnMut(usize, usize),
) -> Result<Score> {
    let all = (src.len() / (t as u64 + 1)) as usize;
    let (mut sum, mut scored, mut done) = (0.0f64, 0usize, 0usize);
    while done < all {
        let n = ROWS_PER_PIECE.min(all - done);
        let rows = ScoredRows::read(src, (done * (t + 1)) as u64, n, t)?;
        let s = score(predict, &rows, b, t, &mut |d, _| progress(done + d, all))?;
        sum += s.loss as f64 * s.scored as f64;
        scored += s.scored;
        done += n;
    }
    Ok(Score {
        loss: (sum / scored.max(1) as f64) as f32,
        scored,
        predictions: vec![],
    })
}
