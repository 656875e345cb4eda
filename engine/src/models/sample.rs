//! Choosing the next token from a language model's logits: greedy (temperature 0),
//! or a seeded draw from the softmax at a temperature, cut to the `top_k` likeliest
//! tokens and then to the smallest set holding `top_p` of the mass (nucleus sampling).
//! Pure host code: the same logits, settings and seed give the same tokens everywhere.
//!
//! Only the first `valid_vocab` logits are candidates: a vocabulary padded to a
//! multiple of 64 or 128 for speed has rows that stand for no token, and their (trained
//! or random) logits must never be sampled.

use crate::rng::SplitMix;
use crate::{Error, Result};

/// How the next token is chosen.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct SamplingOptions {
    /// Divides the logits before the softmax: 0 picks the likeliest token (greedy),
    /// 1 samples the model's own distribution, above 1 flattens it.
    pub temperature: f32,
    /// Only the `k` likeliest tokens are candidates; `None`: all.
    pub top_k: Option<usize>,
    /// Only the smallest set of likeliest tokens whose probabilities (after `top_k`)
    /// add up to at least `p`; `None` (or 1): all.
    pub top_p: Option<f32>,
}

impl Default for SamplingOptions {
    /// Greedy.
    fn default() -> Self {
        SamplingOptions {
            temperature: 0.0,
            top_k: None,
            top_p: None,
        }
    }
}

impl SamplingOptions {
    /// Refuses settings with no meaning, naming the setting and what it takes.
    pub fn check(&self) -> Result<()> {
        let t = self.temperature;
        if !t.is_finite() || t < 0.0 {
            return Err(Error::InvalidArgument(format!(
                "temperature {t}: it must be a finite number >= 0 (0: always the likeliest \
                 token, 1: the model's own distribution)"
            )));
        }
        if self.top_k == Some(0) {
            return Err(Error::InvalidArgument(
                "top-k 0 leaves no token to choose from: pass 1 or more (1 is greedy), or \
                 leave it out to keep every token"
                    .into(),
            ));
        }
        if let Some(p) = self.top_p {
            // NaN fails the range test too.
            if !(p > 0.0 && p <= 1.0) {
                return Err(Error::InvalidArgument(format!(
                    "top-p {p}: it must be in (0, 1], the share of probability mass kept \
                     (1 keeps every token)"
                )));
            }
        }
        Ok(())
    }

    /// Whether the choice is the argmax whatever the draw.
    pub fn is_greedy(&self) -> bool {
        // A temperature so small that 1 / t overflows is greedy in effect, and dividing
        // by it would turn a zero logit gap into NaN.
        !(1.0 / self.temperature).is_finite() || self.top_k == Some(1)
    }
}

/// Draws tokens from logits with a fixed seed: a sequence of calls on the same logits
/// gives the same tokens for the same seed, on every machine.
#[derive(Clone, Debug)]
pub struct TokenSampler {
    options: SamplingOptions,
    valid_vocab: usize,
    rng: SplitMix,
}

impl TokenSampler {
    /// A sampler of ids `0..valid_vocab` (the tokenizer's vocabulary: padded rows of a
    /// larger model vocabulary are never chosen).
    pub fn new(options: SamplingOptions, valid_vocab: usize, seed: u64) -> Result<TokenSampler> {
        options.check()?;
        if valid_vocab == 0 {
            return Err(Error::InvalidArgument(
                "sampling needs a vocabulary of at least one token".into(),
            ));
        }
        Ok(TokenSampler {
            options,
            valid_vocab,
            rng: SplitMix(seed),
        })
    }

    pub fn options(&self) -> &SamplingOptions {
        &self.options
    }

    /// The ids that may be drawn from `logits` and their probabilities (adding up to 1),
    /// likeliest first (ties: lower id first). Greedy settings give the argmax alone.
    pub fn distribution(&self, logits: &[f32]) -> Result<Vec<(u32, f32)>> {
        let logits = self.valid(logits)?;
        if self.options.is_greedy() {
            return Ok(vec![(argmax(logits), 1.0)]);
        }
        let mut order: Vec<u32> = (0..logits.len() as u32).collect();
        // Stable, so equal logits keep id order: the same cut on every machine.
        order.sort_by(|&a, &b| logits[b as usize].total_cmp(&logits[a as usize]));
        if let Some(k) = self.options.top_k {
            order.truncate(k);
        }
        // Softmax of logit / temperature in f32, shifted by the largest so that no
        // exponential overflows (the largest becomes exp(0) = 1).
        let inv_t = 1.0 / self.options.temperature;
        let top = logits[order[0] as usize];
        if top == f32::NEG_INFINITY {
            return Err(Error::InvalidArgument(
                "every logit is -infinity: the model gives no token any probability".into(),
            ));
        }
        let mut probs: Vec<f32> = order
            .iter()
            .map(|&i| ((logits[i as usize] - top) * inv_t).exp())
            .collect();
        let sum: f32 = probs.iter().sum();
        probs.iter_mut().for_each(|p| *p /= sum);
        if let Some(p) = self.options.top_p {
            // The smallest prefix (likeliest first) whose mass reaches p.
            let mut mass = 0.0f64;
            let mut keep = probs.len();
            for (i, &q) in probs.iter().enumerate() {
                mass += q as f64;
                if mass >= p as f64 {
                    keep = i + 1;
                    break;
                }
            }
            probs.truncate(keep);
            let kept: f32 = probs.iter().sum();
            probs.iter_mut().for_each(|q| *q /= kept);
        }
        Ok(order.into_iter().zip(probs).collect())
    }

    /// The next token.
    pub fn sample(&mut self, logits: &[f32]) -> Result<u32> {
        if self.options.is_greedy() {
            return Ok(argmax(self.valid(logits)?));
        }
        let dist = self.distribution(logits)?;
        // 53 random bits: uniform in [0, 1) at f64 resolution.
        let u = (self.rng.next_u64() >> 11) as f64 / (1u64 << 53) as f64;
        let mut mass = 0.0f64;
        for &(id, p) in &dist {
            mass += p as f64;
            if u < mass {
                return Ok(id);
            }
        }
        // Rounding left the sum of the probabilities just below u.
        Ok(dist.last().expect("at least one candidate").0)
    }

    /// The candidates' logits, checked: enough of them, and none NaN or +infinite (a
    /// diverged model, which no setting can sample from).
    fn valid<'a>(&self, logits: &'a [f32]) -> Result<&'a [f32]> {
        let Some(logits) = logits.get(..self.valid_vocab) else {
            return Err(Error::InvalidArgument(format!(
                "{} logits for a vocabulary of {} tokens: the model's vocabulary is smaller \
                 than the tokenizer's",
                logits.len(),
                self.valid_vocab
            )));
        };
        if let Some(i) = logits
            .iter()
            .position(|x| x.is_nan() || *x == f32::INFINITY)
        {
            return Err(Error::InvalidArgument(format!(
                "the logit of token {i} is {}: the model's weights are not finite (a diverged \
                 run); sample from an earlier checkpoint",
                logits[i]
            )));
        }
        Ok(logits)
    }
}

/// The index of the largest value; the first of equal ones, as [`super::Network::predict`]
/// takes it, so greedy decoding and evaluation agree.
pub fn argmax(values: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &x) in values.iter().enumerate() {
        if x > values[best] {
            best = i;
        }
    }
    best as u32
}
