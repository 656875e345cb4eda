//! Recording a planned GEMM (`gemm_plan.rs`) as dispatches, for any backend: operands
//! larger than one binding run in groups of whole matrices, or in blocks of rows,
//! columns and K, each dispatch binding only its block of every large buffer.

use kiln_engine::{Capabilities, Error, Matmul, Result};

use crate::dispatch::{groups, Dispatch, Readiness, DUMMY_ID, PARTIALS_ID, SCRATCH_ID};
use crate::gemm_plan::{
    fixed_subgroup, kernel_for, plan, split_k, stand_in, tile, MatmulPlan, MatmulVariant,
    CPU_LANES, QUICK, STAND_IN,
};
use crate::recorder::Recorder;
use crate::shader::{self, Repr};

/// How a GEMM becomes dispatches, for any backend that records them.
pub(crate) trait LowerMatmul: Recorder {
    fn matmul(&self, s: &mut Self::State, mm: &Matmul, plan: &MatmulPlan) -> Result<()> {
        if mm.m == 0 || mm.n == 0 {
            return Ok(());
        }
        let limit = self.caps().max_storage_binding;
        let partials_fit = !plan.partial || partial_bytes(mm, plan.splits) <= limit;
        if partials_fit && mm.buffers().iter().all(|b| b.bytes() <= limit) {
            return self.record(s, mm, plan, &View::whole(mm));
        }
        // Some operand is larger than one binding can show a kernel: run the product in
        // blocks, each binding only the part of every large buffer it reads or writes.
        let whole = Block {
            g0: 0,
            gb: mm.batch,
            i0: 0,
            mb: mm.m,
            j0: 0,
            nb: mm.n,
            k0: 0,
            kb: mm.k,
        };
        if mm.batch > 1 {
            // Groups of whole matrices, as many as fit (fitting is monotone in the size).
            let (mut lo, mut hi) = (0, mm.batch);
            while lo < hi {
                let mid = (lo + hi).div_ceil(2);
                if self
                    .first_over(mm, &Block { gb: mid, ..whole }, plan)
                    .is_none()
                {
                    lo = mid;
                } else {
                    hi = mid - 1;
                }
            }
            if lo > 0 {
                for g0 in (0..mm.batch).step_by(lo) {
                    let b = Block {
                        g0,
                        gb: lo.min(mm.batch - g0),
                        ..whole
                    };
                    let (sub, view) = self.block(mm, &b);
                    let sub_plan = plan_for(&sub, self.caps(), plan)?;
                    self.record(s, &sub, &sub_plan, &view)?;
                }
                return Ok(());
            }
        }
        // One matrix alone does not fit: split each one by rows, columns and K.
        for g0 in 0..mm.batch {
            self.matmul_in_blocks(s, mm, plan, Block { g0, gb: 1, ..whole })?;
        }
        Ok(())
    }

    /// Runs matrix `whole.g0` of `mm` in blocks of C's rows and columns and, when even
    /// one row of an operand is over the binding limit, bands of K. K bands accumulate
    /// raw f32 sums in the partials, and `matmul_finish` applies the epilogue (alpha,
    /// beta, bias, GELU, rounding) once, to the complete sum.
    fn matmul_in_blocks(
        &self,
        s: &mut Self::State,
        mm: &Matmul,
        plan: &MatmulPlan,
        whole: Block,
    ) -> Result<()> {
        let mut b = whole;
        // Halve the dimension that shrinks the first operand over the limit; each step
        // makes every window smaller or keeps it, so this ends (1 x 1 x 1 fits).
        while let Some(over) = self.first_over(mm, &b, plan) {
            let halve = |x: &mut usize| *x = x.div_ceil(2);
            let dim = match over {
                Over::A if mm.trans_a => [&mut b.kb, &mut b.mb],
                Over::A => [&mut b.mb, &mut b.kb],
                Over::B if mm.trans_b => [&mut b.nb, &mut b.kb],
                Over::B => [&mut b.kb, &mut b.nb],
                Over::C | Over::Partials => [&mut b.mb, &mut b.nb],
                Over::Bias => [&mut b.nb, &mut b.mb],
            };
            let [first, second] = dim;
            if *first > 1 {
                halve(first);
            } else if *second > 1 {
                halve(second);
            } else {
                return Err(Error::Unsupported {
                    device: self.caps().name.clone(),
                    what: format!(
                        "a matmul whose 1 x 1 x 1 block still binds more than the \
                         {}-byte binding limit (offsets aligned to {} bytes); open the \
                         device with a larger `max_storage_binding`",
                        self.caps().max_storage_binding,
                        self.storage_offset_alignment()
                    ),
                });
            }
        }
        // Halving can leave up to half of each binding unused: grow each dimension back
        // to the largest size that still fits (fitting is monotone in each).
        for dim in 0..3 {
            let get = |b: &Block| [b.mb, b.nb, b.kb][dim];
            let set = |b: &mut Block, v: usize| *[&mut b.mb, &mut b.nb, &mut b.kb][dim] = v;
            let most = [mm.m, mm.n, mm.k][dim];
            let (mut lo, mut hi) = (get(&b), (2 * get(&b)).min(most));
            while lo < hi {
                let mid = (lo + hi).div_ceil(2);
                let mut t = b;
                set(&mut t, mid);
                if self.first_over(mm, &t, plan).is_none() {
                    lo = mid;
                } else {
                    hi = mid - 1;
                }
            }
            set(&mut b, lo);
        }
        for i0 in (0..mm.m).step_by(b.mb) {
            for j0 in (0..mm.n).step_by(b.nb) {
                let cell = Block {
                    i0,
                    mb: b.mb.min(mm.m - i0),
                    j0,
                    nb: b.nb.min(mm.n - j0),
                    ..b
                };
                if b.kb == mm.k {
                    let (sub, view) = self.block(mm, &cell);
                    let sub_plan = plan_for(&sub, self.caps(), plan)?;
                    self.record(s, &sub, &sub_plan, &view)?;
                    continue;
                }
                let (sub, view) = self.block(
                    mm,
                    &Block {
                        k0: 0,
                        kb: mm.k,
                        ..cell
                    },
                );
                self.partials(s, partial_bytes(&sub, 1))?;
                let partials = PARTIALS_ID;
                for k0 in (0..mm.k).step_by(b.kb) {
                    let band = Block {
                        k0,
                        kb: b.kb.min(mm.k - k0),
                        ..cell
                    };
                    let (sub_k, view_k) = self.block(mm, &band);
                    let band_plan = MatmulPlan {
                        splits: 1,
                        k_chunk: sub_k.k as u32,
                        partial: true,
                        ..plan_for(&sub_k, self.caps(), plan)?
                    };
                    self.record_main(s, &sub_k, &band_plan, &view_k, partials, k0 > 0)?;
                }
                let finish_plan = MatmulPlan {
                    splits: 1,
                    partial: true,
                    ..plan_for(&sub, self.caps(), plan)?
                };
                self.record_finish(s, &sub, &finish_plan, &view, partials)?;
            }
        }
        Ok(())
    }

    /// The sub-product `b` of `mm` and where its operands lie in their buffers.
    fn block(&self, mm: &Matmul, b: &Block) -> (Matmul, View) {
        let (m, n, k) = (mm.m as u64, mm.n as u64, mm.k as u64);
        let (i0, j0, k0) = (b.i0 as u64, b.j0 as u64, b.k0 as u64);
        let (mb, nb, kb, gb) = (b.mb as u64, b.nb as u64, b.kb as u64, b.gb as u64);
        let g0 = b.g0 as u64;
        let stride = |s: usize| s as u64;
        let (a_first, a_span) = if mm.trans_a {
            (k0 * m + i0, (kb - 1) * m + mb)
        } else {
            (i0 * k + k0, (mb - 1) * k + kb)
        };
        let (b_first, b_span) = if mm.trans_b {
            (j0 * k + k0, (nb - 1) * k + kb)
        } else {
            (k0 * n + j0, (kb - 1) * n + nb)
        };
        let (c_first, c_span) = (i0 * n + j0, (mb - 1) * n + nb);
        let batched = |first: u64, span: u64, st: usize| {
            (g0 * stride(st) + first, (gb - 1) * stride(st) + span)
        };
        let (af, asp) = batched(a_first, a_span, mm.stride_a);
        let (bf, bsp) = batched(b_first, b_span, mm.stride_b);
        let (cf, csp) = batched(c_first, c_span, mm.stride_c);
        let view = View {
            lda: if mm.trans_a { m } else { k } as u32,
            ldb: if mm.trans_b { k } else { n } as u32,
            ldc: n as u32,
            a: self.bind(mm.a, af, asp),
            b: self.bind(mm.b, bf, bsp),
            c: self.bind(mm.c, cf, csp),
            cf: mm.c_f32.map_or(Bind::default(), |f| self.bind(f, cf, csp)),
            bias: mm.bias.map_or(Bind::default(), |f| self.bind(f, j0, nb)),
        };
        let sub = Matmul {
            m: b.mb,
            n: b.nb,
            k: b.kb,
            batch: b.gb,
            ..mm.clone()
        };
        (sub, view)
    }

    /// Binds `span` elements of `buf` from element `first`: the whole buffer when it fits
    /// one binding, else a window from the aligned offset at or before the first element.
    fn bind(&self, buf: kiln_engine::Buffer, first: u64, span: u64) -> Bind {
        let size = buf.dtype.size() as u64;
        if buf.bytes() <= self.caps().max_storage_binding {
            return Bind {
                window: None,
                base: first as u32,
            };
        }
        let align = self.storage_offset_alignment();
        let start = first * size;
        let offset = start / align * align;
        // Whole 8-byte words: kernels read 16-bit and f32 values in pairs.
        let end = ((start + span * size).div_ceil(8) * 8).min(buf.bytes());
        Bind {
            window: Some((offset, end - offset)),
            base: ((start - offset) / size) as u32,
        }
    }

    /// The first operand of block `b` whose binding would exceed the limit (or whose
    /// plan fails: a block too large for one dispatch's grid).
    fn first_over(&self, mm: &Matmul, b: &Block, whole: &MatmulPlan) -> Option<Over> {
        let limit = self.caps().max_storage_binding;
        let (sub, view) = self.block(mm, b);
        // Blocks at other offsets start up to one alignment unit further past their
        // binding's aligned start than this one.
        let align = self.storage_offset_alignment();
        let over = |bind: &Bind| bind.window.is_some_and(|(_, size)| size + align > limit);
        // Partials: the block's own plan, or one slab when K is banded.
        let slabs = if b.kb < mm.k {
            Some(1)
        } else {
            match plan_for(&sub, self.caps(), whole) {
                Ok(p) if p.partial || self.needs_partials(&sub, &p, &view) => Some(p.splits),
                Ok(_) => None,
                Err(_) => return Some(Over::Partials),
            }
        };
        if over(&view.a) {
            Some(Over::A)
        } else if over(&view.b) {
            Some(Over::B)
        } else if over(&view.c) || over(&view.cf) {
            Some(Over::C)
        } else if over(&view.bias) {
            Some(Over::Bias)
        } else if slabs.is_some_and(|n| partial_bytes(&sub, n) > limit) {
            Some(Over::Partials)
        } else {
            None
        }
    }

    /// Records one GEMM whose bindings each fit (`view`: where its operands lie), with
    /// its `matmul_finish` when it goes through partials.
    fn record(
        &self,
        s: &mut Self::State,
        mm: &Matmul,
        plan: &MatmulPlan,
        view: &View,
    ) -> Result<()> {
        let limit = self.caps().max_storage_binding;
        let mut plan = plan.clone();
        if plan.partial && partial_bytes(mm, plan.splits) > limit {
            // A small block of a split product may plan more K splits than the block
            // the split was sized with: take as many as the binding holds.
            let most = (limit / partial_bytes(mm, 1)).max(1) as u32;
            (plan.splits, plan.k_chunk) = split_k(
                mm.k as u32,
                most.min(plan.splits),
                plan.variant,
                self.caps(),
            );
            plan.partial = plan.splits > 1;
        }
        plan.partial |= self.needs_partials(mm, &plan, view);
        let plan = &plan;
        if !plan.partial {
            return self.record_main(s, mm, plan, view, DUMMY_ID, false);
        }
        let bytes = partial_bytes(mm, plan.splits);
        if bytes > limit {
            return Err(Error::Unsupported {
                device: self.caps().name.clone(),
                what: format!(
                    "{bytes} bytes of f32 matmul partials (over the {limit}-byte binding limit); use fewer K splits or a smaller batch"
                ),
            });
        }
        self.partials(s, bytes)?;
        let partials = PARTIALS_ID;
        self.record_main(s, mm, plan, view, partials, false)?;
        self.record_finish(s, mm, plan, view, partials)
    }

    /// Whether a packed 16-bit C must go through partials here: the CPU-class kernel
    /// stores whole 4-element groups only where no two workgroups share a word.
    fn needs_partials(&self, mm: &Matmul, plan: &MatmulPlan, view: &View) -> bool {
        let packed_c = matches!(
            Repr::of(mm.c.dtype, self.caps().f16_arithmetic),
            Repr::F16Packed | Repr::BF16
        );
        packed_c && !(matches!(plan.variant, MatmulVariant::Cpu { .. }) && vec_c(mm, view))
    }

    fn params(
        &self,
        mm: &Matmul,
        plan: &MatmulPlan,
        view: &View,
        row_base: u32,
        rows: u32,
        words: u32,
    ) -> Vec<u32> {
        let (m, n, k) = (mm.m as u32, mm.n as u32, mm.k as u32);
        // One matrix: its stride is its whole span, so that matmul_finish maps every
        // element of the binding to matrix 0.
        let stride_c = if mm.batch == 1 {
            m * view.ldc
        } else {
            mm.stride_c as u32
        };
        vec![
            m,
            n,
            k,
            mm.batch as u32,
            mm.stride_a as u32,
            mm.stride_b as u32,
            stride_c,
            row_base,
            mm.alpha.to_bits(),
            mm.beta.to_bits(),
            plan.splits,
            plan.k_chunk,
            (mm.batch * mm.m * mm.n) as u32,
            words,
            rows,
            view.lda,
            view.ldb,
            view.ldc,
            view.a.base,
            view.b.base,
            view.c.base,
            view.cf.base,
            view.bias.base,
            0,
        ]
    }

    /// The GEMM kernel's dispatches; with `plan.partial` they write (or, `accumulate`,
    /// add to) the f32 `partials` instead of C.
    #[allow(clippy::too_many_arguments)]
    fn record_main(
        &self,
        s: &mut Self::State,
        mm: &Matmul,
        plan: &MatmulPlan,
        view: &View,
        partials: u64,
        accumulate: bool,
    ) -> Result<()> {
        let (m, n) = (mm.m as u32, mm.n as u32);
        let (tm, tn) = tile(plan.variant, self.caps());
        let template = self.main_dispatch(mm, plan, view, partials, accumulate);
        let z = mm.batch as u32 * plan.splits;
        let mut row_base = 0;
        while row_base < m {
            let rows = plan.rows_per_dispatch.min(m - row_base);
            let groups_y = match plan.variant {
                MatmulVariant::Naive => rows.div_ceil(8),
                _ => rows.div_ceil(tm),
            };
            let groups_x = match plan.variant {
                MatmulVariant::Gemv { .. } => 1,
                _ => n.div_ceil(tn),
            };
            self.dispatch(
                s,
                Dispatch {
                    params: self.params(mm, plan, view, row_base, rows, 0),
                    groups: (groups_x, groups_y, z),
                    ..template.clone()
                },
            )?;
            row_base += rows;
        }
        Ok(())
    }

    /// The GEMM kernel's dispatch for `plan` without its rows (parameters and grid):
    /// what its pipeline is and what it binds.
    fn main_dispatch(
        &self,
        mm: &Matmul,
        plan: &MatmulPlan,
        view: &View,
        partials: u64,
        accumulate: bool,
    ) -> Dispatch {
        let caps = self.caps();
        let kernel = kernel_for(plan.variant, caps);
        let repr = |b: kiln_engine::Buffer| self.repr(b.dtype);
        let h = |b: kiln_engine::Buffer| b.id;
        let bias = mm.bias.map_or(DUMMY_ID, h);
        let cf = if plan.partial {
            partials
        } else {
            mm.c_f32.map_or(SCRATCH_ID, h)
        };
        let mut consts = vec![];
        // 16-byte loads and stores need every start of a 4-group to be a multiple of 4
        // elements into its binding.
        let aligned = |dim: usize, ld: u32, base: u32, stride: usize| {
            dim.is_multiple_of(4)
                && ld.is_multiple_of(4)
                && base.is_multiple_of(4)
                && (mm.batch == 1 || stride.is_multiple_of(4))
        };
        if let MatmulVariant::Tiled { .. } = plan.variant {
            // 16-byte loads along each operand's contiguous dimension when it allows.
            let a_dim = if mm.trans_a { mm.m } else { mm.k };
            let b_dim = if mm.trans_b { mm.k } else { mm.n };
            consts = vec![
                (
                    "VEC_A",
                    aligned(a_dim, view.lda, view.a.base, mm.stride_a) as u32,
                ),
                (
                    "VEC_B",
                    aligned(b_dim, view.ldb, view.b.base, mm.stride_b) as u32,
                ),
            ];
        }
        if let MatmulVariant::Cpu { tm, nv } = plan.variant {
            let vec_b = !mm.trans_b && aligned(mm.n, view.ldb, view.b.base, mm.stride_b);
            consts = vec![
                ("SG", fixed_subgroup(caps).unwrap_or(CPU_LANES)),
                ("TM", tm),
                ("NV", nv),
                ("VEC_B", vec_b as u32),
                ("VEC_C", vec_c(mm, view) as u32),
            ];
        }
        let flag = |b: bool| b as u32;
        let overrides = [
            epilogue_overrides(mm, plan.partial),
            vec![("ACCUMULATE", flag(accumulate))],
            tile_overrides(plan.variant),
        ]
        .concat();
        Dispatch {
            kernel,
            reprs: vec![
                repr(mm.a),
                repr(mm.b),
                repr(mm.c),
                repr_of_bias(self, mm),
                Repr::F32,
            ],
            consts,
            overrides,
            buffers: vec![h(mm.a), h(mm.b), h(mm.c), bias, cf],
            ranges: view.main(plan.partial),
            params: vec![],
            groups: (0, 0, 0),
        }
    }

    /// The plan a launch of `mm` runs: the planner's, or — while the planner's big CPU
    /// block is still building on a compile worker — a cheaper block that is ready (or
    /// quick to build), which gives the same bits (see [`plan`]'s K split).
    fn launch_plan(&self, s: &mut Self::State, mm: &Matmul) -> Result<MatmulPlan> {
        let best = plan(mm, self.caps(), None)?;
        if matches!(best.variant, MatmulVariant::Tiled { .. }) {
            return self.tiled_launch_plan(s, mm, best);
        }
        if !matches!(best.variant, MatmulVariant::Cpu { .. }) {
            return Ok(best);
        }
        let view = View::whole(mm);
        if let MatmulVariant::Cpu { tm, .. } = best.variant {
            // The stand-ins these blocks get while they build are built ahead too: 8 rows
            // at once, 16 rows (primed itself) for the bigger blocks.
            let mut ahead = vec![];
            if tm >= 16 {
                ahead.push(QUICK);
            }
            if tm >= 32 {
                ahead.push(STAND_IN);
            }
            for v in ahead {
                let mut p = plan(mm, self.caps(), Some(v))?;
                p.partial |= self.needs_partials(mm, &p, &view);
                let d = self.main_dispatch(mm, &p, &view, PARTIALS_ID, false);
                self.want_ahead(s, d);
            }
        }
        let table = best.clone();
        let (state, ran) = self.block_state(mm, &table);
        // A measured block (or one remembered from an earlier run) takes the table's
        // place where the backend selects by timing; the same bits either way.
        let preferred = self.tuned_block(s, mm, &best, &state, &ran)?;
        let chosen = match preferred {
            Some(v) if v != best.variant => plan(mm, self.caps(), Some(v))?,
            _ => best,
        };
        let run = stand_in(chosen.variant, |v| state(s, v));
        if run == chosen.variant {
            return Ok(chosen);
        }
        self.note_stand_in(s, &chosen.variant.name(), &run.name());
        plan(mm, self.caps(), Some(run))
    }

    /// The plan a launch of `mm` runs where the planner's is a GPU tile: the tile the
    /// backend measured fastest for the shape (`tuned_block`), else the table's. Tiles
    /// build in milliseconds on a GPU, so none stands in for another.
    fn tiled_launch_plan(
        &self,
        s: &mut Self::State,
        mm: &Matmul,
        best: MatmulPlan,
    ) -> Result<MatmulPlan> {
        let table = best.clone();
        let (state, ran) = self.block_state(mm, &table);
        match self.tuned_block(s, mm, &best, &state, &ran)? {
            Some(v) if v != best.variant => plan(mm, self.caps(), Some(v)),
            _ => Ok(best),
        }
    }

    /// Where a block or tile `v` of `mm` stands (its pipeline built, building or not
    /// asked for; `best` is the table's plan), and whether it has run: each planned
    /// only when asked, so a launch asks about no more blocks than its decision needs.
    /// A block the planner refuses counts as building (never run, never a candidate).
    #[allow(clippy::type_complexity)]
    fn block_state<'a>(
        &'a self,
        mm: &'a Matmul,
        best: &'a MatmulPlan,
    ) -> (
        impl Fn(&Self::State, MatmulVariant) -> Readiness + 'a,
        impl Fn(&Self::State, MatmulVariant) -> bool + 'a,
    ) {
        let dispatch = move |v: MatmulVariant| -> Option<Dispatch> {
            let view = View::whole(mm);
            let mut p = if v == best.variant {
                best.clone()
            } else {
                plan(mm, self.caps(), Some(v)).ok()?
            };
            p.partial |= self.needs_partials(mm, &p, &view);
            Some(self.main_dispatch(mm, &p, &view, PARTIALS_ID, false))
        };
        (
            move |s: &Self::State, v| {
                dispatch(v).map_or(Readiness::Building, |d| self.readiness(s, &d))
            },
            move |s: &Self::State, v| dispatch(v).is_some_and(|d| self.has_run(s, &d)),
        )
    }

    /// `matmul_finish`: sums the partials' slabs into C with the epilogue.
    fn record_finish(
        &self,
        s: &mut Self::State,
        mm: &Matmul,
        plan: &MatmulPlan,
        view: &View,
        partials: u64,
    ) -> Result<()> {
        let repr = |b: kiln_engine::Buffer| self.repr(b.dtype);
        let h = |b: kiln_engine::Buffer| b.id;
        let bias = mm.bias.map_or(DUMMY_ID, h);
        let cf_user = mm.c_f32.map_or(SCRATCH_ID, h);
        // C's words from the start of its binding to the last output.
        let span = view.c.base as u64
            + (mm.batch as u64 - 1) * mm.stride_c as u64
            + (mm.m as u64 - 1) * view.ldc as u64
            + mm.n as u64;
        let words = span.div_ceil(2) as u32;
        self.dispatch(
            s,
            Dispatch {
                kernel: &shader::MATMUL_FINISH,
                reprs: vec![
                    Repr::F32,
                    repr(mm.b),
                    repr(mm.c),
                    repr_of_bias(self, mm),
                    Repr::F32,
                ],
                consts: vec![],
                overrides: epilogue_overrides(mm, false),
                // Slot b is not read here: a stand-in keeps a large B out of the binding.
                buffers: vec![partials, DUMMY_ID, h(mm.c), bias, cf_user],
                ranges: view.finish(),
                params: self.params(mm, plan, view, 0, mm.m as u32, words),
                groups: (groups(words), 1, 1),
            },
        )
    }
}

impl<R: Recorder + ?Sized> LowerMatmul for R {}

/// Records `mm` under `plan` as is (no tuned block, no stand-in): a launch that pins
/// its kernel (benchmarks, tests of one variant).
pub fn record_matmul<R: Recorder + ?Sized>(
    r: &R,
    s: &mut R::State,
    mm: &Matmul,
    plan: &MatmulPlan,
) -> Result<()> {
    LowerMatmul::matmul(r, s, mm, plan)
}

/// The main dispatch of `mm` run whole under `plan` (partials as the launch would
/// need them): what a backend builds ahead to time a block (`kiln-wgpu`'s tuner).
pub fn whole_dispatch<R: Recorder + ?Sized>(r: &R, mm: &Matmul, plan: &MatmulPlan) -> Dispatch {
    let view = View::whole(mm);
    let mut plan = plan.clone();
    plan.partial |= r.needs_partials(mm, &plan, &view);
    r.main_dispatch(mm, &plan, &view, PARTIALS_ID, false)
}

/// Records `mm` run whole under `plan` (one launch of one block, as a tuner times it).
pub fn record_whole<R: Recorder + ?Sized>(
    r: &R,
    s: &mut R::State,
    mm: &Matmul,
    plan: &MatmulPlan,
) -> Result<()> {
    r.record(s, mm, plan, &View::whole(mm))
}

/// For a backend that runs a split-K plan's GEMM proper with its own kernel (kiln-vulkan's
/// hand-written SPIR-V): makes the [`PARTIALS_ID`] buffer hold `plan.splits` f32 slabs of
/// `mm`'s outputs, slab `s` at `s * batch * m * n + (g * m + i) * n + j` as the WGSL
/// kernels write them, for the dispatches recorded next.
pub fn split_partials<R: Recorder + ?Sized>(
    dev: &R,
    s: &mut R::State,
    mm: &Matmul,
    plan: &MatmulPlan,
) -> Result<()> {
    dev.partials(s, partial_bytes(mm, plan.splits))
}

/// ... and then, once that kernel has written them, sums the slabs into C with the
/// epilogue (`matmul_finish`), as the WGSL path does: `mm` whole, each operand within
/// one binding.
pub fn split_finish<R: Recorder + ?Sized>(
    dev: &R,
    s: &mut R::State,
    mm: &Matmul,
    plan: &MatmulPlan,
) -> Result<()> {
    dev.record_finish(s, mm, plan, &View::whole(mm), PARTIALS_ID)
}

/// Bytes of the f32 partials `plan` writes for `mm` (see [`split_partials`]).
pub fn split_partial_bytes(mm: &Matmul, plan: &MatmulPlan) -> u64 {
    partial_bytes(mm, plan.splits)
}

/// The epilogue's overrides, shared by the GEMM kernels and `matmul_finish`.
fn epilogue_overrides(mm: &Matmul, partial: bool) -> Vec<(&'static str, u32)> {
    let flag = |b: bool| b as u32;
    vec![
        ("TRANS_A", flag(mm.trans_a)),
        ("TRANS_B", flag(mm.trans_b)),
        ("USE_BETA", flag(mm.beta != 0.0)),
        ("BIAS", flag(mm.bias.is_some())),
        ("GELU", flag(mm.gelu)),
        ("COPY_F32", flag(mm.c_f32.is_some())),
        ("PARTIAL", flag(partial)),
    ]
}

/// Whether the CPU-class kernel may store C (and its f32 copy) in whole 4-groups: every
/// group starts a multiple of 4 elements into its binding, and no group of one row
/// runs into the next row's (n and the row length multiples of 4).
fn vec_c(mm: &Matmul, view: &View) -> bool {
    mm.n.is_multiple_of(4)
        && view.ldc.is_multiple_of(4)
        && view.c.base.is_multiple_of(4)
        && view.cf.base.is_multiple_of(4)
        && (mm.batch == 1 || mm.stride_c.is_multiple_of(4))
}

/// Bytes of f32 partials for `splits` slabs of `mm`'s outputs.
fn partial_bytes(mm: &Matmul, splits: u32) -> u64 {
    (mm.batch as u64 * mm.m as u64 * mm.n as u64 * splits as u64).div_ceil(2) * 8
}

/// Part of a product: matrices g0.., rows i0.., columns j0.. and K k0.. of it.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Block {
    g0: usize,
    gb: usize,
    i0: usize,
    mb: usize,
    j0: usize,
    nb: usize,
    k0: usize,
    kb: usize,
}

/// Which binding of a block is over the limit.
#[derive(Clone, Copy, Debug)]
pub(crate) enum Over {
    A,
    B,
    C,
    Bias,
    Partials,
}

/// How one slot is bound: a byte window of its buffer (none: the whole buffer) and the
/// element offset, within the binding, of the operand's first element.
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct Bind {
    window: Option<(u64, u64)>,
    base: u32,
}

/// Where one recorded product's operands lie, and their stored row lengths.
#[derive(Clone, Copy, Debug)]
pub(crate) struct View {
    lda: u32,
    ldb: u32,
    ldc: u32,
    a: Bind,
    b: Bind,
    c: Bind,
    cf: Bind,
    bias: Bind,
}

impl View {
    /// Whole matrices, every buffer bound whole.
    pub(crate) fn whole(mm: &Matmul) -> View {
        View {
            lda: if mm.trans_a { mm.m } else { mm.k } as u32,
            ldb: if mm.trans_b { mm.k } else { mm.n } as u32,
            ldc: mm.n as u32,
            a: Bind::default(),
            b: Bind::default(),
            c: Bind::default(),
            cf: Bind::default(),
            bias: Bind::default(),
        }
    }

    /// Slot ranges for the GEMM kernel (slots a, b, c, bias, cf). With partials, cf is
    /// the partials buffer, which is sized for the block already.
    fn main(&self, partial: bool) -> Vec<(usize, u64, u64)> {
        let mut v = vec![];
        v.extend(self.a.window.map(|(o, n)| (0, o, n)));
        v.extend(self.b.window.map(|(o, n)| (1, o, n)));
        v.extend(self.c.window.map(|(o, n)| (2, o, n)));
        v.extend(self.bias.window.map(|(o, n)| (3, o, n)));
        if !partial {
            v.extend(self.cf.window.map(|(o, n)| (4, o, n)));
        }
        v
    }

    /// Slot ranges for `matmul_finish` (slot a holds the partials, slot b a stand-in).
    fn finish(&self) -> Vec<(usize, u64, u64)> {
        let mut v = vec![];
        v.extend(self.c.window.map(|(o, n)| (2, o, n)));
        v.extend(self.bias.window.map(|(o, n)| (3, o, n)));
        v.extend(self.cf.window.map(|(o, n)| (4, o, n)));
        v
    }
}

/// Pipeline-overridable tile constants of `variant`'s kernel. The CPU-class kernel's
/// block is not among them: it is unrolled at assembly (`//@unroll TM`), because
/// llvmpipe does not unroll loops itself and its speed comes from that unrolling.
fn tile_overrides(variant: MatmulVariant) -> Vec<(&'static str, u32)> {
    match variant {
        MatmulVariant::Tiled { bm, bn, bk } => vec![("BM", bm), ("BN", bn), ("BK", bk)],
        MatmulVariant::Gemv { lanes } => vec![("LANES", lanes)],
        _ => vec![],
    }
}

/// The plan for one band of a banded product: the caller's pinned variant, if any.
fn plan_for(sub: &Matmul, caps: &Capabilities, whole: &MatmulPlan) -> Result<MatmulPlan> {
    plan(sub, caps, Some(whole.variant))
}

fn repr_of_bias<R: Recorder + ?Sized>(dev: &R, mm: &Matmul) -> Repr {
    mm.bias.map_or(Repr::F32, |b| dev.repr(b.dtype))
}
