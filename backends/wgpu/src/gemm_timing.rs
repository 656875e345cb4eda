//! The GEMM block selection (`tune.rs`) on a wgpu device: what it selected, and
//! timing candidate blocks on a launch's own operands.

use kiln_engine::{Matmul, Result};
use kiln_lowering::{
    ladder_of, plan_matmul, record_whole, whole_dispatch, MatmulPlan, MatmulVariant, Readiness,
    Recorder,
};

use crate::device::{State, WgpuDevice};
use kiln_lowering::gemm_select::{
    as_candidate, awaiting, candidates, class, quick, select, time_candidate, to_build, Timing,
    BUDGET_S, MIN_WORK,
};

impl WgpuDevice {
    /// The block measured for `mm`'s shape class and stored types on this device (this
    /// run, or remembered from an earlier one), `None` where none was: selection off,
    /// the product too small to repay timing, or the budget spent. `kiln bench matmul`
    /// names its selected row by it.
    pub fn gemm_selected(&self, mm: &Matmul) -> Option<MatmulVariant> {
        let reprs = [mm.a, mm.b, mm.c].map(|b| self.repr(b.dtype));
        self.lock().tuner.winners.get(&class(mm, reprs)).copied()
    }

    /// Whether this device selects GEMM blocks and tiles by measurement (unless
    /// `KILN_GEMM_TUNE=0` / `--no-tune`).
    pub fn gemm_selection_on(&self) -> bool {
        self.lock().tuner.enabled
    }
}

impl WgpuDevice {
    /// The block `mm` runs by measurement: remembered, or timed now (see the module
    /// docs); `None` keeps the table's `best`.
    pub(crate) fn tune(
        &self,
        s: &mut State,
        mm: &Matmul,
        best: &MatmulPlan,
        state: &dyn Fn(&State, MatmulVariant) -> Readiness,
        ran: &dyn Fn(&State, MatmulVariant) -> bool,
    ) -> Result<Option<MatmulVariant>> {
        if !s.tuner.enabled {
            return Ok(None);
        }
        let reprs = [mm.a, mm.b, mm.c].map(|b| self.repr(b.dtype));
        let cls = class(mm, reprs);
        let ladder = ladder_of(best.variant);
        // A remembered winner of another kernel family (a file of another planning)
        // is measured again.
        if let Some(&w) = s.tuner.winners.get(&cls).filter(|w| ladder.contains(w)) {
            // A winner of an earlier run is used (and, in `prepare`, built ahead)
            // unless it would wait for a slow build: then the table's block runs until
            // it is built.
            let usable = w == best.variant
                || match state(s, w) {
                    Readiness::Ready => true,
                    Readiness::Absent => quick(w),
                    Readiness::Building => false,
                };
            return Ok(usable.then_some(w));
        }
        if WgpuDevice::collecting(s) || s.profiling.is_some() {
            return Ok(None);
        }
        let work = mm.m as u64 * mm.n as u64 * mm.k as u64 * mm.batch as u64;
        let limit = self.caps.max_storage_binding;
        let fits = mm.buffers().iter().all(|b| b.bytes() <= limit);
        let left = BUDGET_S - s.tuner.spent_s;
        if work < MIN_WORK || !fits || left <= 0.0 || state(s, best.variant) == Readiness::Building
        {
            // Measured later, once the block is built (or never: too small to matter,
            // too large for one binding, or the budget is spent).
            return Ok(None);
        }
        if self.primes_big_blocks() {
            let missing = to_build(best.variant, ladder, |v| state(s, v));
            for &v in &missing {
                let p = plan_matmul(mm, &self.caps, Some(v))?;
                let d = whole_dispatch(self, mm, &p);
                self.build_in_background(s, d)?;
            }
            // Asked for now or earlier: measured at a launch after they are built.
            if !missing.is_empty() || awaiting(best.variant, ladder, |v| state(s, v)) {
                return Ok(None);
            }
        }
        let cands = candidates(best.variant, ladder, |v| {
            as_candidate(v, best.variant, state(s, v), ran(s, v))
        });
        if cands.len() < 2 {
            return Ok(None);
        }
        // Time on the launch's own A and B (read only), into scratch outputs: the
        // stream recorded so far runs first, so that it is not timed.
        self.finish(s)?;
        let c = self.scratch_like(s, mm.c);
        let cf = mm.c_f32.map(|f| self.scratch_like(s, f));
        let probe = Matmul {
            c,
            c_f32: cf,
            ..mm.clone()
        };
        let mut timed = vec![];
        let result = select(&cands, left, |v| {
            timed.push(v.name());
            self.time_block(s, &probe, v)
        });
        self.drop_scratch(s, c);
        if let Some(f) = cf {
            self.drop_scratch(s, f);
        }
        let (winner, spent) = result?;
        s.tuner.keep("", cls, (winner, spent), &timed, cands.len());
        Ok(Some(winner))
    }

    /// One block's measurement on `probe` (`time_candidate`'s runs).
    fn time_block(&self, s: &mut State, probe: &Matmul, v: MatmulVariant) -> Result<Timing> {
        let p = plan_matmul(probe, &self.caps, Some(v))?;
        time_candidate(s, |s: &mut State, reps: u32| -> Result<f64> {
            let t = std::time::Instant::now();
            for _ in 0..reps {
                record_whole(self, s, probe, &p)?;
            }
            self.finish(s)?;
            Ok(t.elapsed().as_secs_f64() / reps as f64)
        })
    }
}
