//! Fused attention launches: kernel choice, register-block shape and dispatch bands.
//!
//! Every kernel gives a lane R rows (query rows forward and for dq, key rows for dk/dv)
//! and walks the other side in blocks of SG rows; see `shaders/attention_*.wgsl`.
//! Grouped-query attention (`group` query heads per K/V head) is a launch parameter:
//! forward and dq walk the query heads, dk/dv the K/V heads, each summing its group.

use kiln_engine::kernels::{self, AttentionBackward};
use kiln_engine::{Buffer, Capabilities, Error, Kernel, Result};

use crate::dispatch::{Dispatch, Readiness, PARTIALS_ID};
use crate::recorder::Recorder;
use crate::shader::{self, KernelSource};

/// Work per dispatch, in multiply-adds: ~0.1 s on lavapipe, so that no dispatch runs
/// long enough for a watchdog, and a GPU's are far shorter.
const FMAS_PER_DISPATCH: f64 = 2e9;

/// The launch shape of the attention kernels on one adapter and head dim.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AttentionPlan {
    /// Rows of the other side per block (the subgroup size when shared).
    pub sg: u32,
    /// Invocations per workgroup.
    pub wg: u32,
    /// Rows each invocation owns.
    pub rows: u32,
    /// Block rows are shared by subgroup broadcasts.
    pub shared: bool,
}

impl AttentionPlan {
    /// Rows one workgroup owns.
    pub fn rows_per_group(&self) -> u32 {
        self.wg * self.rows
    }
}

/// Measured on lavapipe (`kiln bench attention`): see benches/RESULTS.md.
pub fn plan(caps: &Capabilities, dim: usize) -> AttentionPlan {
    let cpu = caps.device_type == "cpu";
    let fixed = match caps.subgroup_sizes {
        Some((lo, hi)) if lo == hi && (4..=64).contains(&lo) => Some(lo),
        _ => None,
    };
    match (cpu, fixed) {
        // One subgroup per workgroup, block rows broadcast. Rows per lane measured with
        // `kiln bench attention` (T = 512, 1024): d = 32 fastest at 8 (13 vs 16 ms at 4),
        // d = 64 at 4 (24 ms; 34 at 2, 24-75 at 8), d = 128 at 4 (79 vs 97 ms at 2).
        (true, Some(sg)) => AttentionPlan {
            sg,
            wg: sg,
            rows: if dim <= 32 { 8 } else { 4 },
            shared: true,
        },
        // CPU adapters without subgroups (llvmpipe through GL): a SIMD vector of lanes.
        (true, None) => AttentionPlan {
            sg: 8,
            wg: 8,
            rows: 2,
            shared: false,
        },
        // GPUs: a warp-sized group; every lane reads each block row itself (the same
        // address across the group, which caches serve).
        (false, _) => AttentionPlan {
            sg: 8,
            wg: 64,
            rows: 1,
            shared: false,
        },
    }
}

fn kernels(shared: bool) -> [&'static KernelSource; 3] {
    if shared {
        [
            &shader::ATTENTION,
            &shader::ATTENTION_DQ,
            &shader::ATTENTION_DKV,
        ]
    } else {
        [
            &shader::ATTENTION_NOSG,
            &shader::ATTENTION_DQ_NOSG,
            &shader::ATTENTION_DKV_NOSG,
        ]
    }
}

/// Which fused attention kernel a launch runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum AttentionPass {
    /// out and lse (`shaders/attention_forward.wgsl`).
    Forward,
    /// dq, and delta = rowsum(dout * out) for the next pass.
    Dq,
    /// dk and dv.
    Dkv,
}

/// One dispatch of a fused attention kernel, whichever backend records it.
#[derive(Clone, Debug)]
pub struct AttentionLaunch {
    pub pass: AttentionPass,
    /// The typed tensors in the kernel's binding order (forward: q, k, v, out; dq: q,
    /// k, v, out, dout, dq; dkv: q, k, v, dout, dk, dv).
    pub typed: Vec<Buffer>,
    /// Then the f32 buffers: lse, and in the backward passes delta, which lives in the
    /// device's reusable scratch (`PARTIALS_ID`).
    pub f32s: Vec<u64>,
    /// Last, the documents' starts (u32), or without documents q: a binding the
    /// kernel never reads then (params[7] is 0), so that one pipeline serves both.
    pub starts: u64,
    /// `shaders/common/attention_params.wgsl`'s Params.
    pub params: [u32; 8],
    pub groups: (u32, u32, u32),
}

/// The documents of an attention kernel: (starts, query heads per sequence).
fn documents(kernel: &Kernel) -> Option<(u64, usize)> {
    match kernel {
        Kernel::Attention(kernels::Attention { documents, .. })
        | Kernel::AttentionBackward(AttentionBackward { documents, .. }) => {
            documents.map(|d| (d.starts.id, d.heads))
        }
        _ => None,
    }
}

/// (batch_heads, group, seq, dim, scale, causal) of an attention kernel.
pub fn geometry(kernel: &Kernel) -> (usize, usize, usize, usize, f32, bool) {
    match *kernel {
        Kernel::Attention(kernels::Attention {
            batch_heads,
            group,
            seq,
            dim,
            scale,
            causal,
            ..
        })
        | Kernel::AttentionBackward(AttentionBackward {
            batch_heads,
            group,
            seq,
            dim,
            scale,
            causal,
            ..
        }) => (batch_heads, group, seq, dim, scale, causal),
        _ => unreachable!("not an attention kernel"),
    }
}

/// The dispatches of a validated `Kernel::Attention` or `Kernel::AttentionBackward`
/// under `plan`, and the f32 scratch bytes (delta) the device must hold for them first
/// (0 forward). Dispatches are cut into bands of row blocks that each do about
/// `FMAS_PER_DISPATCH` multiply-adds.
pub fn launches(
    caps: &Capabilities,
    kernel: &Kernel,
    plan: &AttentionPlan,
) -> Result<(Vec<AttentionLaunch>, u64)> {
    let (heads, group, seq, dim, scale, causal) = geometry(kernel);
    if heads == 0 || seq == 0 {
        return Ok((vec![], 0));
    }
    let limit = caps.max_storage_binding;
    if let Some(b) = kernel.buffers().iter().find(|b| b.bytes() > limit) {
        return Err(Error::Unsupported {
            device: caps.name.clone(),
            what: format!(
                "{}: buffer #{} of {} bytes, over the {limit}-byte binding limit; split the heads",
                kernel.name(),
                b.id,
                b.bytes()
            ),
        });
    }
    let rows = heads * seq;
    let docs = documents(kernel);
    let docs_heads = docs.map_or(0, |(_, h)| h as u32);
    // Causal rows see half the keys on average; the band size is a bound, not exact.
    let fmas_per_block =
        plan.rows_per_group() as f64 * seq as f64 * dim as f64 * heads as f64 * 2.0;
    let band = |passes: f64| -> u32 {
        ((FMAS_PER_DISPATCH / (fmas_per_block * passes)) as u32).clamp(1, 65535)
    };
    let blocks = (seq as u32).div_ceil(plan.rows_per_group());
    // `walked`: the heads a kernel's workgroups cover (query heads, or K/V heads for
    // dk/dv, whose workgroups each do `group` query heads' work: the band, which counts
    // all of it, stays the same).
    let run = |pass, typed: Vec<Buffer>, f32s: Vec<u64>, walked: usize, per: u32| {
        let starts = docs.map_or(typed[0].id, |(id, _)| id);
        let heads_y = (walked as u32).min(65535);
        let heads_z = (walked as u32).div_ceil(heads_y);
        let mut bands = vec![];
        let mut base = 0;
        while base < blocks {
            let n = per.min(blocks - base);
            bands.push(AttentionLaunch {
                pass,
                typed: typed.clone(),
                f32s: f32s.clone(),
                starts,
                params: [
                    walked as u32,
                    seq as u32,
                    base,
                    causal as u32,
                    scale.to_bits(),
                    (scale * std::f32::consts::LOG2_E).to_bits(),
                    group as u32,
                    docs_heads,
                ],
                groups: (n, heads_y, heads_z),
            });
            base += n;
        }
        bands
    };
    Ok(match *kernel {
        Kernel::Attention(kernels::Attention {
            q, k, v, out, lse, ..
        }) => (
            run(
                AttentionPass::Forward,
                vec![q, k, v, out],
                vec![lse.id],
                heads,
                band(2.0),
            ),
            0,
        ),
        Kernel::AttentionBackward(AttentionBackward {
            q,
            k,
            v,
            out,
            dout,
            lse,
            dq,
            dk,
            dv,
            ..
        }) => {
            // rowsum(dout * out), one f32 per row, lives in the device's reusable
            // scratch between the two passes.
            let mut all = run(
                AttentionPass::Dq,
                vec![q, k, v, out, dout, dq],
                vec![lse.id, PARTIALS_ID],
                heads,
                band(3.0),
            );
            all.extend(run(
                AttentionPass::Dkv,
                vec![q, k, v, dout, dk, dv],
                vec![lse.id, PARTIALS_ID],
                heads / group,
                band(4.0),
            ));
            (all, rows as u64 * 4)
        }
        _ => unreachable!("not an attention kernel"),
    })
}

/// The plan a launch runs while `planned`'s passes are still building (and first
/// running on the primer's device, on a software driver): one row per lane, whose
/// passes compile in a fraction of the time. Each row's sums are the same, in the same
/// order (a lane's rows are independent, and the masked blocks a larger row group
/// walks past a row's causal end add exact zeros), so the results are bit-identical
/// (tests/primer.rs). `None`
/// where no pass takes several rows per lane.
pub fn stand_in(planned: &AttentionPlan) -> Option<AttentionPlan> {
    (planned.shared && planned.rows > 1).then_some(AttentionPlan {
        rows: 1,
        ..*planned
    })
}

/// How fused attention becomes dispatches of the WGSL kernels, for any backend that
/// records them.
pub(crate) trait LowerAttention: Recorder {
    /// Records a validated `Kernel::Attention` or `Kernel::AttentionBackward`.
    fn attention(&self, s: &mut Self::State, kernel: &Kernel) -> Result<()> {
        let dim = geometry(kernel).3;
        let planned = plan(self.caps(), dim);
        let (mut launched, scratch) = launches(self.caps(), kernel, &planned)?;
        let mut plan = planned;
        if let Some(stand) = stand_in(&planned) {
            // Built ahead by `prepare` too, so that a launch never waits for the
            // planned passes' build.
            let (stand_launches, _) = launches(self.caps(), kernel, &stand)?;
            for l in &stand_launches {
                let d = self.attention_dispatch(&stand, dim, l);
                self.want_ahead(s, d);
            }
            let building = launched.iter().any(|l| {
                self.readiness(s, &self.attention_dispatch(&planned, dim, l)) == Readiness::Building
            });
            if building {
                self.note_stand_in(
                    s,
                    &format!("attention {} rows per lane", planned.rows),
                    "attention 1 row per lane",
                );
                (plan, launched) = (stand, stand_launches);
            }
        }
        if scratch > 0 {
            self.partials(s, scratch)?;
        }
        for l in launched {
            let d = self.attention_dispatch(&plan, dim, &l);
            self.dispatch(s, d)?;
        }
        Ok(())
    }

    /// The dispatch of one attention launch `l` under `plan` at head dim `dim`.
    fn attention_dispatch(
        &self,
        plan: &AttentionPlan,
        dim: usize,
        l: &AttentionLaunch,
    ) -> Dispatch {
        let mut consts = vec![
            ("SG", plan.sg),
            ("WG", plan.wg),
            ("R", plan.rows),
            ("DIM", dim as u32),
            ("D4", dim.div_ceil(4) as u32),
            ("VEC", dim.is_multiple_of(4) as u32),
        ];
        if !plan.shared {
            // Column groups as a loop past head dim 32 (`shader::unroll`). Without
            // sharing, every lane loads each block row from memory anyway, so the loop
            // costs little: llvmpipe through GL at d = 64, f16, T = 129 / 512, 8.5 / 86.9
            // ms against 10.8 / 79.1 unrolled, while its compile went from 88 to 6 s
            // (d = 128 bf16: 292 to 29 s). Unrolled, d = 128 is SG x D4 x R = 256+ copies
            // of the block body, which NVIDIA's compiler refused (benches/RESULTS.md).
            consts.push(("UNROLL_MAX", 8));
        }
        let [fwd, dq, dkv] = kernels(plan.shared);
        let kernel = match l.pass {
            AttentionPass::Forward => fwd,
            AttentionPass::Dq => dq,
            AttentionPass::Dkv => dkv,
        };
        let mut buffers: Vec<u64> = l.typed.iter().map(|b| b.id).collect();
        buffers.extend(&l.f32s);
        buffers.push(l.starts);
        Dispatch {
            kernel,
            reprs: l.typed.iter().map(|b| self.repr(b.dtype)).collect(),
            consts,
            overrides: vec![],
            buffers,
            ranges: vec![],
            params: l.params.to_vec(),
            groups: l.groups,
        }
    }
}

impl<R: Recorder + ?Sized> LowerAttention for R {}
