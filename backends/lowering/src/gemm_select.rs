//! Measured GEMM selection, shared by the backends: at a shape's first launch on a
//! device, the table's kernel shape (the prior) and its rivals are timed on the launch's
//! own operands (into a scratch C), and the fastest is kept for the device's life and on
//! disk for later runs. A backend times the candidates ([`select`]) and keeps a
//! [`Tuner`]; what is measured, and how long may be spent, is decided here.
//!
//! On CPU-class adapters the rivals are the prior's neighbours on the register-block
//! ladder (`CPU_LADDER`): lavapipe's speed per block depends on the host CPU (its
//! vector width and registers), which the adapter's name does not tell, so a table tuned
//! on one host is wrong on another. On GPUs they are the tiles of `GPU_LADDER`: the
//! table's 64 x 64 x 16 tile was never measured on the GPU at hand, and the best tile
//! differs by GPU and shape. Measuring never changes results: every CPU block, and
//! every tile, splits K alike and sums in the same order (`kiln_lowering::plan_matmul`),
//! so the bits are the same whichever wins.
//!
//! Bounded: only the prior and rivals that are built already or build in under a
//! second are candidates (a launch never waits for a 15-second compile to time it), a
//! device spends at most [`BUDGET_S`] seconds measuring in all, and products too small
//! for the shape to matter keep the table. `KILN_GEMM_TUNE=0` keeps the table.
//!
//! The winners file sits beside the pipeline cache, keyed by the backend as its cache is
//! (adapter, driver, host CPU features, kernel sources) and by the class the device is
//! planned as, with the same header and checksum: a damaged or foreign file is ignored
//! with a note, saves replace it atomically.

use std::collections::HashMap;
use std::path::PathBuf;

use kiln_engine::{Matmul, Result};

use crate::dispatch::Readiness;
use crate::gemm_plan::{ladder_of, MatmulVariant};
use crate::pipeline_cache;
use crate::shader::Repr;

/// Seconds one device may spend timing candidates, compiles for them included.
pub const BUDGET_S: f64 = 5.0;
/// Products below this many multiply-adds keep the table's block: they take a
/// millisecond or two, so no block can win back what timing it costs.
pub const MIN_WORK: u64 = 1 << 26;
/// A challenger must beat the prior by this fraction: closer timings are noise.
const MARGIN: f64 = 0.03;

/// `KILN_GEMM_TUNE=0` (or `kiln train --no-tune`) keeps the table's blocks.
pub fn enabled_by_env() -> bool {
    switch(std::env::var("KILN_GEMM_TUNE").ok().as_deref())
}

/// Whether a `KILN_GEMM_TUNE` value (`None`: unset) lets blocks be measured.
pub fn switch(value: Option<&str>) -> bool {
    value.is_none_or(|v| !matches!(v.trim(), "0" | "false" | "off" | "no"))
}

/// The device's measured winners and what measuring has cost so far.
#[derive(Default)]
pub struct Tuner {
    pub enabled: bool,
    pub winners: HashMap<String, MatmulVariant>,
    pub spent_s: f64,
    /// Where winners are saved, and the key the file carries.
    pub file: Option<(PathBuf, u64)>,
}

/// What a GEMM's winner is kept under: its shape, transposes and stored types.
pub fn class(mm: &Matmul, reprs: [Repr; 3]) -> String {
    format!(
        "{}x{}x{} b{} t{}{} {:?}/{:?}/{:?}",
        mm.m,
        mm.n,
        mm.k,
        mm.batch,
        mm.trans_a as u8,
        mm.trans_b as u8,
        reprs[0],
        reprs[1],
        reprs[2]
    )
}

/// The blocks worth timing against `prior` (first in the list): its neighbours on the
/// ladder (`ladder`, largest first; every other tile for a GPU tile) that are built,
/// or missing and quick to build (16 rows or fewer: well under a second on lavapipe;
/// any tile). A block still building, or slow to build, is never timed: that would
/// wait for its compile.
pub fn candidates(
    prior: MatmulVariant,
    ladder: &[MatmulVariant],
    state: impl Fn(MatmulVariant) -> Readiness,
) -> Vec<MatmulVariant> {
    let mut out = vec![prior];
    for v in neighbours(prior, ladder) {
        match state(v) {
            Readiness::Ready => out.push(v),
            Readiness::Absent if quick(v) => out.push(v),
            _ => {}
        }
    }
    out
}

/// For a `prior` whose neighbours on the ladder are all slow to build (the 64-row
/// block, whose one neighbour is the 32-row block: the table's pick at 1024³), those
/// not asked for yet. Where the device compiles such a block's machine code away from
/// its queue (lavapipe's primer), they are built in the background and the selection
/// waits for them, so that such shapes are decided by measurement too, not by the
/// table. A prior with a quick neighbour is measured against that one at once, as
/// before: building every slow neighbour would cost a minute of compiling per shape.
pub fn to_build(
    prior: MatmulVariant,
    ladder: &[MatmulVariant],
    state: impl Fn(MatmulVariant) -> Readiness,
) -> Vec<MatmulVariant> {
    if neighbours(prior, ladder).any(quick) {
        return vec![];
    }
    neighbours(prior, ladder)
        .filter(|&v| state(v) == Readiness::Absent)
        .collect()
}

/// Whether a slow neighbour of `prior` is still building (for the selection to wait).
pub fn awaiting(
    prior: MatmulVariant,
    ladder: &[MatmulVariant],
    state: impl Fn(MatmulVariant) -> Readiness,
) -> bool {
    !neighbours(prior, ladder).any(quick)
        && neighbours(prior, ladder).any(|v| state(v) == Readiness::Building)
}

/// `prior`'s rivals on the ladder: for a CPU block the next larger and the next
/// smaller block (each compile costs seconds on lavapipe), for a GPU tile every other
/// tile (each builds in milliseconds on a GPU).
fn neighbours(
    prior: MatmulVariant,
    ladder: &[MatmulVariant],
) -> impl Iterator<Item = MatmulVariant> + '_ {
    let every = matches!(prior, MatmulVariant::Tiled { .. });
    let at = ladder.iter().position(|&v| v == prior);
    let near = at.map_or([None, None], |at| [at.checked_sub(1), Some(at + 1)]);
    ladder.iter().enumerate().filter_map(move |(i, &v)| {
        let rival = if every {
            v != prior
        } else {
            near.contains(&Some(i))
        };
        rival.then_some(v)
    })
}

/// One candidate's measurement: the time of one run, and the wall time measuring it
/// took (its build, a warm-up run and the timed runs).
#[derive(Clone, Copy, Debug)]
pub struct Timing {
    pub run_s: f64,
    pub cost_s: f64,
}

/// The fastest of `candidates` (the prior first) as `time` measures them, spending at
/// most `budget_s`: a candidate is only timed while the time spent so far plus what
/// the prior's measurement cost still fits. A challenger replaces the prior only when
/// [`MARGIN`] faster. Returns the winner and the time spent.
pub fn select(
    candidates: &[MatmulVariant],
    budget_s: f64,
    mut time: impl FnMut(MatmulVariant) -> Result<Timing>,
) -> Result<(MatmulVariant, f64)> {
    let Some((&prior, rest)) = candidates.split_first() else {
        return Err(kiln_engine::Error::InvalidArgument(
            "GEMM selection needs at least one candidate".into(),
        ));
    };
    let first = time(prior)?;
    let mut spent = first.cost_s;
    let (mut best, mut best_s) = (prior, first.run_s);
    for &v in rest {
        if spent + first.cost_s > budget_s {
            break;
        }
        let t = time(v)?;
        spent += t.cost_s;
        if t.run_s < best_s * (1.0 - MARGIN) {
            (best, best_s) = (v, t.run_s);
        }
    }
    Ok((best, spent))
}

/// The least wall time one timed run of a candidate takes (repeated launches), so that
/// a GPU's submission cost does not decide between tiles.
pub const TIMED_S: f64 = 0.002;

/// One candidate's measurement, `run(s, reps)` recording `reps` launches and returning
/// the seconds per launch once they have run: a warm-up run (which builds the pipeline
/// where missing and, on a software driver, compiles its machine code), then the
/// faster of two timed runs, each repeating the launch until it takes [`TIMED_S`].
pub fn time_candidate<S>(
    s: &mut S,
    mut run: impl FnMut(&mut S, u32) -> Result<f64>,
) -> Result<Timing> {
    let t0 = std::time::Instant::now();
    run(s, 1)?;
    let once = run(s, 1)?;
    let reps = (TIMED_S / once.max(1e-7)).ceil().clamp(1.0, 64.0) as u32;
    let run_s = if reps == 1 {
        once.min(run(s, 1)?)
    } else {
        run(s, reps)?.min(run(s, reps)?)
    };
    Ok(Timing {
        run_s,
        cost_s: t0.elapsed().as_secs_f64(),
    })
}

fn note(what: String) {
    eprintln!("kiln: note: {what}");
}

/// The winners in `file` (one `class=variant` line each), or why the file is not used.
pub fn decode(file: &[u8], key: u64) -> Result<HashMap<String, MatmulVariant>, String> {
    let data = pipeline_cache::payload(file, key).map_err(str::to_string)?;
    let text = std::str::from_utf8(data).map_err(|_| "not text (damaged?)".to_string())?;
    let mut winners = HashMap::new();
    for line in text.lines().filter(|l| !l.is_empty()) {
        let (class, name) = line
            .rsplit_once('=')
            .ok_or_else(|| format!("a line without `=`: {line:?}"))?;
        let v: MatmulVariant = name.parse().map_err(|e| format!("line {line:?}: {e}"))?;
        if ladder_of(v).is_empty() {
            return Err(format!("line {line:?}: not a CPU block or a GPU tile"));
        }
        winners.insert(class.to_string(), v);
    }
    Ok(winners)
}

/// The file's bytes for `winners` (sorted, so that equal tables give equal files).
pub fn encode(key: u64, winners: &HashMap<String, MatmulVariant>) -> Vec<u8> {
    let mut lines: Vec<String> = winners
        .iter()
        .map(|(c, v)| format!("{c}={}\n", v.name()))
        .collect();
    lines.sort();
    pipeline_cache::encode(key, lines.concat().as_bytes())
}

impl Tuner {
    /// A tuner that measures where `enabled` (see [`enabled_by_env`]), with the winners
    /// of earlier runs where `file` (its path and key) is whole and written for the key.
    pub fn open(enabled: bool, file: Option<(PathBuf, u64)>) -> Tuner {
        let file = if enabled { file } else { None };
        let mut winners = HashMap::new();
        if let Some((path, key)) = &file {
            match std::fs::read(path) {
                Ok(bytes) => match decode(&bytes, *key) {
                    Ok(w) => winners = w,
                    Err(why) => note(format!(
                        "ignoring the GEMM selection file {}: {why}; shapes are timed again",
                        path.display()
                    )),
                },
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                Err(e) => note(format!(
                    "could not read the GEMM selection file {} ({e}); shapes are timed again",
                    path.display()
                )),
            }
        }
        Tuner {
            enabled,
            winners,
            spent_s: 0.0,
            file,
        }
    }

    /// Keeps `winner` for shape class `cls`, measured in `spent` seconds after `timed`
    /// of `candidates` candidates were timed (`KILN_COMPILE_LOG=1` prints them, as
    /// `backend`'s), and saves the file.
    pub fn keep(
        &mut self,
        backend: &str,
        cls: String,
        (winner, spent): (MatmulVariant, f64),
        timed: &[String],
        candidates: usize,
    ) {
        if kiln_engine::device::compiling::log_enabled() {
            let left_out = candidates - timed.len();
            let budget = if left_out > 0 {
                format!("; {left_out} more not timed: the budget")
            } else {
                String::new()
            };
            eprintln!(
                "kiln: {backend}GEMM {cls}: {} of {} ({spent:.2} s measuring{budget})",
                winner.name(),
                timed.join(", ")
            );
        }
        self.spent_s += spent;
        self.winners.insert(cls, winner);
        self.save();
    }

    /// Saves the winners (a failure is a note: the next run measures again).
    pub fn save(&self) {
        let Some((path, key)) = &self.file else {
            return;
        };
        if let Err(e) = pipeline_cache::write(path, &encode(*key, &self.winners)) {
            note(format!(
                "could not save the GEMM selection to {} ({e}); the next run measures again",
                path.display()
            ));
        }
    }
}

/// Where `v` stands as a candidate against `prior`: a slow-to-build neighbour that is
/// built but has not run would compile its machine code inside the measurement (25 s
/// for a 32-row block on a cold lavapipe cache, seen), so it counts as still building.
/// The prior is timed whatever it costs: the launch runs it anyway.
pub fn as_candidate(
    v: MatmulVariant,
    prior: MatmulVariant,
    state: Readiness,
    ran: bool,
) -> Readiness {
    match state {
        Readiness::Ready if v != prior && !quick(v) && !ran => Readiness::Building,
        r => r,
    }
}

pub fn quick(v: MatmulVariant) -> bool {
    match v {
        MatmulVariant::Cpu { tm, .. } => tm <= 16,
        // A GPU compiles a tile in milliseconds; a CPU driver planned as a GPU
        // (`KILN_PLAN_AS_GPU`) in about a second, which the budget bounds.
        MatmulVariant::Tiled { .. } => true,
        _ => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gemm_plan::CPU_LADDER;

    const B64: MatmulVariant = MatmulVariant::Cpu { tm: 64, nv: 4 };
    const B32: MatmulVariant = MatmulVariant::Cpu { tm: 32, nv: 3 };
    const B16: MatmulVariant = MatmulVariant::Cpu { tm: 16, nv: 2 };
    const B8: MatmulVariant = MatmulVariant::Cpu { tm: 8, nv: 1 };
    const LADDER: [MatmulVariant; 4] = [B64, B32, B16, B8];

    fn timed(
        list: &'static [(MatmulVariant, f64)],
    ) -> impl FnMut(MatmulVariant) -> kiln_engine::Result<Timing> {
        move |v| {
            let run_s = list.iter().find(|(k, _)| *k == v).expect("timed").1;
            Ok(Timing {
                run_s,
                cost_s: 3.0 * run_s,
            })
        }
    }

    #[test]
    fn selection_keeps_a_faster_block_and_the_prior_on_a_near_tie() {
        let (v, spent) = select(&[B32, B16], 5.0, timed(&[(B32, 0.10), (B16, 0.08)])).unwrap();
        assert_eq!(v, B16);
        assert!((spent - 0.54).abs() < 1e-9, "{spent}");
        // 2 % faster is noise: the prior stays.
        let (v, _) = select(&[B32, B16], 5.0, timed(&[(B32, 0.10), (B16, 0.098)])).unwrap();
        assert_eq!(v, B32);
        let (v, _) = select(
            &[B16, B32, B8],
            5.0,
            timed(&[(B16, 0.2), (B32, 0.3), (B8, 0.1)]),
        )
        .unwrap();
        assert_eq!(v, B8);
    }

    #[test]
    fn selection_stops_at_the_budget() {
        // The prior's measurement costs 3 s: no second one fits 5 s.
        let mut asked = vec![];
        let (v, spent) = select(&[B32, B16], 5.0, |v| {
            asked.push(v);
            timed(&[(B32, 1.0), (B16, 0.1)])(v)
        })
        .unwrap();
        assert_eq!((v, asked), (B32, vec![B32]));
        assert_eq!(spent, 3.0);
    }

    #[test]
    fn a_slow_neighbour_is_timed_only_once_it_has_run() {
        // Built ahead but never run: its first run would compile inside the timing.
        let cands = candidates(B16, &CPU_LADDER, |v| {
            as_candidate(v, B16, Readiness::Ready, v != B32)
        });
        assert_eq!(cands, vec![B16, B8]);
        let cands = candidates(B16, &CPU_LADDER, |v| {
            as_candidate(v, B16, Readiness::Ready, true)
        });
        assert_eq!(cands, vec![B16, B32, B8]);
        // The prior itself is timed, run or not; a quick neighbour too.
        assert_eq!(
            as_candidate(B32, B32, Readiness::Ready, false),
            Readiness::Ready
        );
        assert_eq!(
            as_candidate(B8, B16, Readiness::Ready, false),
            Readiness::Ready
        );
    }

    #[test]
    fn only_built_or_quick_neighbours_are_candidates() {
        use Readiness::*;
        let state = |list: &'static [(MatmulVariant, Readiness)]| {
            move |v| {
                list.iter()
                    .find(|(k, _)| *k == v)
                    .map_or(Absent, |&(_, r)| r)
            }
        };
        // 64 x 16 takes seconds to build: only timed once built.
        assert_eq!(candidates(B32, &LADDER, state(&[])), vec![B32, B16]);
        assert_eq!(
            candidates(B32, &LADDER, state(&[(B64, Ready)])),
            vec![B32, B64, B16]
        );
        assert_eq!(
            candidates(B32, &LADDER, state(&[(B16, Building)])),
            vec![B32]
        );
        assert_eq!(candidates(B16, &LADDER, state(&[])), vec![B16, B8]);
        let gemv = MatmulVariant::Gemv { lanes: 64 };
        assert_eq!(candidates(gemv, &LADDER, state(&[])), vec![gemv]);
    }

    #[test]
    fn slow_neighbours_are_built_and_waited_for_quick_ones_never() {
        use Readiness::*;
        let state = |list: &'static [(MatmulVariant, Readiness)]| {
            move |v| {
                list.iter()
                    .find(|(k, _)| *k == v)
                    .map_or(Absent, |&(_, r)| r)
            }
        };
        // 64 x 16's only neighbour is 32 x 12, slow to build: asked for, then awaited.
        assert_eq!(to_build(B64, &LADDER, state(&[])), vec![B32]);
        assert!(!awaiting(B64, &LADDER, state(&[])));
        assert_eq!(to_build(B64, &LADDER, state(&[(B32, Building)])), vec![]);
        assert!(awaiting(B64, &LADDER, state(&[(B32, Building)])));
        assert!(!awaiting(B64, &LADDER, state(&[(B32, Ready)])));
        // 32 x 12 has a quick neighbour (16 x 8) to be measured against at once: its
        // slow one (64 x 16) is not built for that, only timed if built already.
        assert_eq!(to_build(B32, &LADDER, state(&[])), vec![]);
        assert!(!awaiting(B32, &LADDER, state(&[(B64, Building)])));
        // Smaller blocks have a quick neighbour; other kernels have none.
        assert_eq!(to_build(B16, &LADDER, state(&[])), vec![]);
        assert_eq!(to_build(B8, &LADDER, state(&[])), vec![]);
        let gemv = MatmulVariant::Gemv { lanes: 64 };
        assert_eq!(to_build(gemv, &LADDER, state(&[])), vec![]);
        assert!(!awaiting(gemv, &LADDER, state(&[(B64, Building)])));
    }

    #[test]
    fn a_gpu_tile_is_timed_against_every_other_tile() {
        use crate::gemm_plan::GPU_LADDER;
        let prior = GPU_LADDER[3];
        let cands = candidates(prior, &GPU_LADDER, |_| Readiness::Absent);
        assert_eq!(cands.len(), GPU_LADDER.len());
        assert_eq!(cands[0], prior);
        assert!(GPU_LADDER.iter().all(|v| cands.contains(v)));
        // One still building (another launch's) is left out; none is built ahead.
        let cands = candidates(prior, &GPU_LADDER, |v| {
            if v == GPU_LADDER[0] {
                Readiness::Building
            } else {
                Readiness::Ready
            }
        });
        assert_eq!(cands.len(), GPU_LADDER.len() - 1);
        assert!(to_build(prior, &GPU_LADDER, |_| Readiness::Absent).is_empty());
        assert!(!awaiting(prior, &GPU_LADDER, |_| Readiness::Building));
    }

    #[test]
    fn the_switch_reads_off_values() {
        assert!(switch(None));
        assert!(switch(Some("1")));
        for off in ["0", " 0 ", "off", "false", "no"] {
            assert!(!switch(Some(off)), "{off:?}");
        }
    }

    #[test]
    fn the_file_round_trips_and_a_damaged_one_is_refused() {
        let mut w = HashMap::new();
        w.insert("1024x4096x256 b1 t00 F32/F32/F32".to_string(), B16);
        w.insert("1024x768x256 b1 t01 F32/F32/F32".to_string(), B32);
        let file = encode(9, &w);
        assert_eq!(decode(&file, 9).unwrap(), w);
        assert!(decode(&file, 10).unwrap_err().contains("another adapter"));
        let mut bad = file.clone();
        *bad.last_mut().unwrap() ^= 0x55;
        assert!(decode(&bad, 9).unwrap_err().contains("checksum"));
        // Whole and keyed right, but not a table of CPU blocks.
        let gemv = pipeline_cache::encode(9, b"x=gemv64\n");
        assert!(decode(&gemv, 9).unwrap_err().contains("not a CPU block"));
        let tiles = pipeline_cache::encode(9, b"x=tiled128x64x16\n");
        assert_eq!(
            decode(&tiles, 9).unwrap()["x"],
            MatmulVariant::Tiled {
                bm: 128,
                bn: 64,
                bk: 16
            }
        );
        let junk = pipeline_cache::encode(9, b"no equals sign\n");
        assert!(decode(&junk, 9).unwrap_err().contains("without `=`"));
    }
}
