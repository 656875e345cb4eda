//! Batch geometry: `train_batch_size`, `train_micro_batch_size_per_gpu` and
//! `gradient_accumulation_steps`, related through the world size, and DeepSpeed's rules
//! for inferring the ones a config leaves out.

use serde::Serialize;
use serde_json::{Map, Value};

use super::provenance::Provenance;
use super::reader::{auto_at, Reader};

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

/// The most samples a batch-size key may hold (each of the three, and their product).
///
/// The GPU kernels index a tensor with 32-bit integers, so a micro-batch can never have
/// more rows than this; bounding the per-step batch the same way keeps every count built
/// from it (samples × sequence length, samples × steps) inside 64 bits.
pub const MAX_BATCH: u64 = u32::MAX as u64;

impl BatchConfig {
    /// The most optimizer steps a run at this batch size can take: the data position is
    /// a 64-bit count of the samples drawn, `steps × train_batch_size`.
    pub fn max_steps(&self) -> u64 {
        u64::MAX / (self.train_batch_size.max(1) as u64)
    }
}

impl Reader {
    pub(super) fn batch(&mut self, root: &Map<String, Value>, world: usize) -> BatchConfig {
        const B: &str = "train_batch_size";
        const M: &str = "train_micro_batch_size_per_gpu";
        const G: &str = "gradient_accumulation_steps";
        // "auto" (Hugging Face) counts as unset: DeepSpeed's inference below fills it in
        // from the others and the world size, as the Trainer's integration would.
        let autos = [B, M, G].map(|k| auto_at(root, k));
        let mut read = |key: &str, auto: bool| {
            if auto {
                Ok(None)
            } else {
                self.uint(root, "", key, 1, MAX_BATCH, None)
            }
        };
        let b = read(B, autos[0]);
        let m = read(M, autos[1]);
        let g = read(G, autos[2]);
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
        // Checked: the factors are bounded, the world size is the caller's.
        let prod = |xs: &[u64]| {
            xs.iter()
                .try_fold(1u64, |acc, &x| acc.checked_mul(x))
                .filter(|&p| p <= MAX_BATCH)
        };
        let (b, m, g): (u64, u64, u64) = match (b, m, g) {
            (Some(b), Some(m), Some(g)) => {
                // Fits: two factors below 2^32 and one below 2^64.
                let want = m as u128 * g as u128 * w as u128;
                if b as u128 != want {
                    let mut fixes = Vec::new();
                    if want <= MAX_BATCH as u128 {
                        fixes.push(format!("set {B} to {want}"));
                    }
                    let (b, mw, gw) = (b as u128, m as u128 * w as u128, g as u128 * w as u128);
                    if b.is_multiple_of(mw) {
                        fixes.push(format!("set {G} to {}", b / mw));
                    }
                    if b.is_multiple_of(gw) {
                        fixes.push(format!("set {M} to {}", b / gw));
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
                (b, m, g)
            }
            (Some(b), Some(m), None) => {
                let Some(g) = self.divide(b, &[(M, m), ("world size", w)], G) else {
                    return failed;
                };
                self.mark(
                    G,
                    Provenance::Inferred(format!("{B} / ({M} × world size) = {b} / ({m} × {w})")),
                );
                (b, m, g)
            }
            (Some(b), None, Some(g)) => {
                let Some(m) = self.divide(b, &[("world size", w), (G, g)], M) else {
                    return failed;
                };
                self.mark(
                    M,
                    Provenance::Inferred(format!("{B} / (world size × {G}) = {b} / ({w} × {g})")),
                );
                (b, m, g)
            }
            (None, Some(m), Some(g)) => {
                let Some(b) = prod(&[m, g, w]) else {
                    self.too_big(&format!("{M} {m} × {G} {g} × world size {w}"), &[m, g, w]);
                    return failed;
                };
                self.mark(
                    B,
                    Provenance::Inferred(format!("{M} × {G} × world size = {m} × {g} × {w}")),
                );
                (b, m, g)
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
                (b, m, 1)
            }
            (None, Some(m), None) => {
                let Some(b) = prod(&[m, w]) else {
                    self.too_big(&format!("{M} {m} × world size {w}"), &[m, w]);
                    return failed;
                };
                self.mark(G, Provenance::Inferred(format!("1 when only {M} is set")));
                self.mark(
                    B,
                    Provenance::Inferred(format!("{M} × world size = {m} × {w}")),
                );
                (b, m, 1)
            }
            (None, None, _) if autos[0] || autos[1] => {
                // Only the Trainer's command line knew the micro-batch: asked for with
                // the file's other "auto" values, in one problem.
                let key = if autos[1] { M } else { B };
                self.autos
                    .push((key.to_string(), format!("an integer from 1 to {MAX_BATCH}")));
                return failed;
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
        for (key, auto) in [B, M, G].into_iter().zip(autos) {
            if auto {
                let how = match self.provenance.get(key) {
                    Some(Provenance::Inferred(how)) => how.clone(),
                    _ => "inferred".to_string(),
                };
                self.resolved_auto(key, how);
            }
        }
        // Each is at most MAX_BATCH, which fits a usize on every platform Rust supports
        // with 32 bits or more.
        let size = |x: u64| usize::try_from(x).unwrap_or(usize::MAX);
        BatchConfig {
            train_batch_size: size(b),
            micro_batch: size(m),
            grad_accum: size(g),
            world,
        }
    }

    /// The problem for an inferred `train_batch_size` above [`MAX_BATCH`].
    fn too_big(&mut self, shown: &str, factors: &[u64]) {
        let exact = factors.iter().map(|&x| x as u128).product::<u128>();
        self.problem(
            "train_batch_size",
            format!(
                "train_batch_size would be {shown} = {exact}, above {MAX_BATCH}, the most \
                 samples per step Kiln can count"
            ),
            "use a smaller train_micro_batch_size_per_gpu or gradient_accumulation_steps",
        );
    }

    /// `total / product(factors)`, or a problem when it does not divide exactly: rounding
    /// down would silently drop samples from every step, rounding up would add some.
    fn divide(&mut self, total: u64, factors: &[(&str, u64)], inferred: &str) -> Option<u64> {
        const B: &str = "train_batch_size";
        let d: u128 = factors.iter().map(|&(_, x)| x as u128).product();
        let t = total as u128;
        let shown = factors
            .iter()
            .map(|(name, x)| format!("{name} {x}"))
            .collect::<Vec<_>>()
            .join(" × ");
        if t.is_multiple_of(d) {
            // At most `total`, so it fits.
            return Some((t / d) as u64);
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
