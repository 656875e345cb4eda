//! Batch geometry: `train_batch_size`, `train_micro_batch_size_per_gpu` and
//! `gradient_accumulation_steps`, related through the world size, and DeepSpeed's rules
//! for inferring the ones a config leaves out.

use serde::Serialize;
use serde_json::{Map, Value};

use super::provenance::Provenance;
use super::reader::Reader;

/// Batch geometry. Invariant: `train_batch_size == micro_batch * grad_accum * world`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct BatchConfig {
    /// Samples per optimizer step over all data-parallel ranks (`train_batch_size`).
    pub train_batch_size: usize,
    /// Samples per forward/backward on one rank (`train_micro_batch_size_per_gpu`).
    pub micro_batch: usize,
    /// Micro-batches accumulated per optimizer step (`gradient_accumulation_steps`).
    pub grad_accum: usize,
    /// Data-parallel ranks; given by the caller, never read from the file.
    pub world: usize,
}

impl Reader {
    pub(super) fn batch(&mut self, root: &Map<String, Value>, world: usize) -> BatchConfig {
        const B: &str = "train_batch_size";
        const M: &str = "train_micro_batch_size_per_gpu";
        const G: &str = "gradient_accumulation_steps";
        let max = usize::MAX as u64;
        let b = self.uint(root, "", B, 1, max, None);
        let m = self.uint(root, "", M, 1, max, None);
        let g = self.uint(root, "", G, 1, max, None);
        self.mark("world_size", Provenance::Caller);
        let failed = BatchConfig {
            train_batch_size: 0,
            micro_batch: 0,
            grad_accum: 0,
            world,
        };
        if world == 0 {
            self.problem(
                "world_size",
                "the data-parallel world size passed by the program is 0",
                "pass the number of data-parallel ranks (1 for a single GPU)",
            );
            return failed;
        }
        let (Ok(b), Ok(m), Ok(g)) = (b, m, g) else {
            return failed;
        };
        let w = world as u64;
        for (key, v) in [(B, b), (M, m), (G, g)] {
            if v.is_some() {
                self.mark(key, Provenance::File);
            }
        }
        // Products in u128: three usizes cannot overflow it.
        let prod = |xs: &[u64]| xs.iter().map(|&x| x as u128).product::<u128>();
        let (b, m, g): (u128, u128, u128) = match (b, m, g) {
            (Some(b), Some(m), Some(g)) => {
                let want = prod(&[m, g, w]);
                if b as u128 != want {
                    let mut fixes = vec![format!("set {B} to {want}")];
                    if (b as u128).is_multiple_of(prod(&[m, w])) {
                        fixes.push(format!("set {G} to {}", b as u128 / prod(&[m, w])));
                    }
                    if (b as u128).is_multiple_of(prod(&[g, w])) {
                        fixes.push(format!("set {M} to {}", b as u128 / prod(&[g, w])));
                    }
                    fixes.push("remove one of the three keys and let Kiln infer it".to_string());
                    self.problem(
                        B,
                        format!(
                            "{B} {b} != {M} {m} × {G} {g} × world size {w} = {want} \
                             ({B} must be the product of the other three)"
                        ),
                        fixes.join(", or "),
                    );
                    return failed;
                }
                (b as u128, m as u128, g as u128)
            }
            (Some(b), Some(m), None) => {
                let Some(g) = self.divide(b, &[(M, m), ("world size", w)], G) else {
                    return failed;
                };
                self.mark(
                    G,
                    Provenance::Inferred(format!("{B} / ({M} × world size) = {b} / ({m} × {w})")),
                );
                (b as u128, m as u128, g)
            }
            (Some(b), None, Some(g)) => {
                let Some(m) = self.divide(b, &[("world size", w), (G, g)], M) else {
                    return failed;
                };
                self.mark(
                    M,
                    Provenance::Inferred(format!("{B} / (world size × {G}) = {b} / ({w} × {g})")),
                );
                (b as u128, m, g as u128)
            }
            (None, Some(m), Some(g)) => {
                self.mark(
                    B,
                    Provenance::Inferred(format!("{M} × {G} × world size = {m} × {g} × {w}")),
                );
                (prod(&[m, g, w]), m as u128, g as u128)
            }
            (Some(b), None, None) => {
                let Some(m) = self.divide(b, &[("world size", w)], M) else {
                    return failed;
                };
                self.mark(G, Provenance::Inferred(format!("1 when only {B} is set")));
                self.mark(
                    M,
                    Provenance::Inferred(format!("{B} / world size = {b} / {w}")),
                );
                (b as u128, m, 1)
            }
            (None, Some(m), None) => {
                self.mark(G, Provenance::Inferred(format!("1 when only {M} is set")));
                self.mark(
                    B,
                    Provenance::Inferred(format!("{M} × world size = {m} × {w}")),
                );
                (prod(&[m, w]), m as u128, 1)
            }
            (None, None, _) => {
                self.problem(
                    B,
                    format!("neither {B} nor {M} is set, so the batch size is unknown"),
                    format!(
                        "set {M} (samples per forward/backward on one GPU); Kiln then infers \
                         {B} = {M} × {G} × world size"
                    ),
                );
                return failed;
            }
        };
        let fits = |x: u128| usize::try_from(x).ok();
        match (fits(b), fits(m), fits(g)) {
            (Some(b), Some(m), Some(g)) => BatchConfig {
                train_batch_size: b,
                micro_batch: m,
                grad_accum: g,
                world,
            },
            _ => {
                self.problem(
                    B,
                    format!("{B} {b} does not fit in this machine's integers"),
                    "use smaller batch sizes",
                );
                failed
            }
        }
    }

    /// `total / product(factors)`, or a problem when it does not divide exactly: rounding
    /// down would silently drop samples from every step, rounding up would add some.
    fn divide(&mut self, total: u64, factors: &[(&str, u64)], inferred: &str) -> Option<u128> {
        const B: &str = "train_batch_size";
        let d: u128 = factors.iter().map(|&(_, x)| x as u128).product();
        let t = total as u128;
        let shown = factors
            .iter()
            .map(|(name, x)| format!("{name} {x}"))
            .collect::<Vec<_>>()
            .join(" × ");
        if t.is_multiple_of(d) {
            return Some(t / d);
        }
        let lower = t / d * d;
        let upper = lower + d;
        let q = t / d;
        let consequence = if q == 0 {
            format!("{inferred} would be 0")
        } else {
            format!(
                "{inferred} would be {t} / {d} = {q} rounded down, silently dropping {} sample(s) \
                 from every step",
                t - lower
            )
        };
        let choices = if lower > 0 {
            format!("{lower} or {upper}")
        } else {
            upper.to_string()
        };
        self.problem(
            B,
            format!("{B} {t} is not a multiple of {shown} = {d}: {consequence}"),
            format!("set {B} to a multiple of {d} such as {choices}, or set {inferred} explicitly"),
        );
        None
    }
}
