//! The measured GEMM selection (`kiln_lowering::gemm_select`) on vk's SPIR-V GEMMs: at a
//! shape's first launch the planner's block (CPU-class kernel) or tile (the GPU-class
//! tiled kernel's twin) is timed against its rivals on the launch's own A and B, into
//! scratch outputs, and the fastest runs from then on, kept for the device's life and
//! in a winners file beside the pipeline cache. Every block, and every tile, splits K
//! as the planner's does and sums in the same order, so the bits never change.
//!
//! A block's first run compiles its machine code on a software driver (seconds for a
//! 32- or 64-row block): a slow block is timed only once it has run here or on the
//! primer (which leaves its machine code in Mesa's cache), so no launch waits for a
//! compile to measure it. Where the planner's block has only slow neighbours (the
//! 64-row block at 1024³), they are given to the primer, and the shape is measured at
//! a launch after it has run them, as the wgpu backend does with its compile workers.

use kiln_lowering::gemm_select::{
    as_candidate, awaiting, candidates, class, enabled_by_env, quick, select, time_candidate,
    to_build, Timing, Tuner, BUDGET_S, MIN_WORK,
};
use kiln_lowering::ladder_of;

use super::*;
use crate::gemm::GpuKernel;

/// The tuner of a device with `features`, planned as `planned_type`: on unless
/// `KILN_GEMM_TUNE=0` (`--no-tune`), its winners file keyed as the pipeline cache is
/// and by the class the device is planned as.
pub(super) fn open_tuner(
    features: &Features,
    options: &DeviceOptions,
    planned_type: &str,
) -> Tuner {
    let enabled = !options.no_tune && enabled_by_env();
    let file = kiln_lowering::pipeline_cache::dir(options).map(|dir| {
        let key = super::cache::cache_key(features)
            ^ kiln_lowering::pipeline_cache::fnv(planned_type.as_bytes());
        (dir.join(format!("vk-{key:016x}.gemm")), key)
    });
    Tuner::open(enabled, file)
}

/// The kernel shape a route runs, where the selection may replace it.
fn shape_of(route: &GemmRoute) -> Option<MatmulVariant> {
    match route {
        GemmRoute::Spirv(p) => Some(MatmulVariant::Cpu { tm: p.tm, nv: p.nv }),
        GemmRoute::SpirvGpu(GpuGemmPlan {
            kernel: GpuKernel::Tiled { bm, bn, bk },
            ..
        }) => Some(MatmulVariant::Tiled {
            bm: *bm,
            bn: *bn,
            bk: *bk,
        }),
        _ => None,
    }
}

impl VkDevice {
    /// The block measured for `mm`'s shape class and stored types on this device (this
    /// run, or remembered from an earlier one), `None` where none was: selection off,
    /// the product too small to repay timing, or the budget spent.
    pub fn gemm_selected(&self, mm: &kiln_engine::Matmul) -> Option<MatmulVariant> {
        let reprs = [mm.a, mm.b, mm.c].map(|b| Recorder::repr(self, b.dtype));
        self.lock().tuner.winners.get(&class(mm, reprs)).copied()
    }

    /// Whether this device selects GEMM blocks and tiles by measurement.
    pub fn gemm_selection_on(&self) -> bool {
        self.lock().tuner.enabled
    }

    /// The route `mm` runs by: the planner's `route`, or the same kernel with the
    /// block or tile measured fastest for its shape (remembered, or timed now).
    pub(super) fn selected_route(
        &self,
        s: &mut State,
        mm: &kiln_engine::Matmul,
        route: GemmRoute,
    ) -> Result<GemmRoute> {
        let Some(prior) = shape_of(&route) else {
            return Ok(route);
        };
        let pinned = self
            .gemm_variant
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .is_some();
        if !s.tuner.enabled || pinned {
            return Ok(route);
        }
        let reprs = [mm.a, mm.b, mm.c].map(|b| Recorder::repr(self, b.dtype));
        let cls = class(mm, reprs);
        let ladder = ladder_of(prior);
        // A remembered winner of another kernel family (a file of another planning) is
        // measured again.
        if let Some(&w) = s.tuner.winners.get(&cls).filter(|w| ladder.contains(w)) {
            return self.route_as(s, mm, w).map(|r| r.unwrap_or(route));
        }
        if s.collect.is_some() || s.profiling.is_some() {
            return Ok(route);
        }
        let work = mm.m as u64 * mm.n as u64 * mm.k as u64 * mm.batch as u64;
        let left = BUDGET_S - s.tuner.spent_s;
        // Where each block stands: its machine code compiled (run here or primed:
        // Ready), on the primer (Building), or neither (Absent); a tile, or a block
        // off the SPIR-V route (never a candidate: Building), by its route alone.
        let state = |s: &State, v: MatmulVariant| match self.route_as(s, mm, v) {
            Ok(Some(GemmRoute::Spirv(p))) => {
                let key = p.pipeline_key();
                if s.ran.contains(&key) {
                    return Readiness::Ready;
                }
                match self
                    .primer
                    .as_ref()
                    .and_then(|pr| pr.state(&Block::Gemm(key)))
                {
                    Some(Primed::Done) => Readiness::Ready,
                    // A block the primer could not run is not asked for again.
                    Some(Primed::Queued | Primed::Failed) => Readiness::Building,
                    None => Readiness::Absent,
                }
            }
            Ok(Some(_)) => Readiness::Ready,
            _ => Readiness::Building,
        };
        let compiled = |s: &State, v: MatmulVariant| quick(v) || state(s, v) == Readiness::Ready;
        // The prior is timed whatever it costs, so its machine code must be compiled
        // first: a slow one is measured at a later launch.
        if work < MIN_WORK || left <= 0.0 || !compiled(s, prior) {
            return Ok(route);
        }
        if let Some(primer) = &self.primer {
            let missing = to_build(prior, ladder, |v| state(s, v));
            for &v in &missing {
                if let Ok(Some(GemmRoute::Spirv(p))) = self.route_as(s, mm, v) {
                    primer.ask(Job {
                        block: Block::Gemm(p.pipeline_key()),
                        attention: None,
                    });
                }
            }
            // Asked for now or earlier: measured at a launch after the primer ran them.
            if !missing.is_empty() || awaiting(prior, ladder, |v| state(s, v)) {
                return Ok(route);
            }
        }
        let cands: Vec<MatmulVariant> = candidates(prior, ladder, |v| {
            as_candidate(v, prior, state(s, v), compiled(s, v))
        });
        if cands.len() < 2 {
            return Ok(route);
        }
        // Timed on the launch's own A and B (read only), into scratch outputs, after
        // what is recorded so far has run.
        let value = self.flush(s)?;
        self.wait_for(value)?;
        let c = self.scratch_like(s, mm.c)?;
        let cf = match mm.c_f32 {
            Some(f) => Some(self.scratch_like(s, f)?),
            None => None,
        };
        let probe = kiln_engine::Matmul {
            c,
            c_f32: cf,
            ..mm.clone()
        };
        let mut timed = vec![];
        let result = select(&cands, left, |v| {
            timed.push(v.name());
            self.time_shape(s, &probe, v)
        });
        for b in std::iter::once(c).chain(cf) {
            self.drop_scratch(s, b);
        }
        let (winner, spent) = result?;
        s.tuner
            .keep("vk ", cls, (winner, spent), &timed, cands.len());
        self.route_as(s, mm, winner).map(|r| r.unwrap_or(route))
    }

    /// The route of `mm` with the planner made to pick `v`, where that is still the
    /// SPIR-V GEMM (`None` otherwise).
    fn route_as(
        &self,
        s: &State,
        mm: &kiln_engine::Matmul,
        v: MatmulVariant,
    ) -> Result<Option<GemmRoute>> {
        let r = self.route_with(s, mm, Some(v))?;
        Ok(matches!(r, GemmRoute::Spirv(_) | GemmRoute::SpirvGpu(_)).then_some(r))
    }

    /// One candidate's measurement on `probe` (`time_candidate`'s runs).
    fn time_shape(
        &self,
        s: &mut State,
        probe: &kiln_engine::Matmul,
        v: MatmulVariant,
    ) -> Result<Timing> {
        let route = self.route_as(s, probe, v)?.ok_or_else(|| {
            self.backend_error(format!(
                "GEMM selection: {} left the SPIR-V route",
                v.name()
            ))
        })?;
        time_candidate(s, |s: &mut State, reps: u32| -> Result<f64> {
            let t = std::time::Instant::now();
            for _ in 0..reps {
                match &route {
                    GemmRoute::Spirv(p) => self.record_spirv_gemm(s, probe, p)?,
                    GemmRoute::SpirvGpu(p) => self.record_gpu_gemm(s, probe, p)?,
                    _ => unreachable!("route_as keeps the SPIR-V routes"),
                }
            }
            let value = self.flush(s)?;
            self.wait_for(value)?;
            Ok(t.elapsed().as_secs_f64() / reps as f64)
        })
    }

    /// A buffer shaped as `b` for a measurement's outputs (its contents undefined: only
    /// the time of writing it counts), dropped by [`VkDevice::drop_scratch`].
    fn scratch_like(&self, s: &mut State, b: kiln_engine::Buffer) -> Result<kiln_engine::Buffer> {
        let mem = self.make(
            s,
            b.bytes(),
            vk::BufferUsageFlags::STORAGE_BUFFER,
            MemoryLocation::GpuOnly,
        )?;
        let id = s.next_id;
        s.next_id += 1;
        let meta = kiln_engine::Buffer { id, ..b };
        s.buffers.insert(
            id,
            Slot {
                meta,
                kind: SlotKind::Own(mem),
            },
        );
        Ok(meta)
    }

    fn drop_scratch(&self, s: &mut State, b: kiln_engine::Buffer) {
        if let Some(Slot {
            kind: SlotKind::Own(mem),
            ..
        }) = s.buffers.remove(&b.id)
        {
            Self::retire(s, mem);
        }
    }
}
