//! GEMM planning: which kernel, tile shape, K split and dispatch chunks a product gets,
//! by adapter class and shape — then recording it.
//!
//! The table is small on purpose and every entry was measured (benches/RESULTS.md):
//! CPU-class adapters (lavapipe, llvmpipe) are bound by load instructions and get the
//! subgroup-shared register-block kernel; GPUs get the shared-memory tiled kernel.

use std::collections::HashMap;

use kiln_engine::{Capabilities, Error, Matmul, Result};

use crate::device::{Dispatch, State, WgpuDevice, DUMMY_ID, PARTIALS_ID, SCRATCH_ID};
use crate::launch::groups;
use crate::shader::{self, KernelSource, Repr};

/// The GEMM kernels, for `kiln bench` and tests that pin one.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum MatmulVariant {
    /// One output per invocation: the baseline.
    Naive,
    /// Register blocks for CPU-class adapters; `tm` rows x `nv` vec4 column groups per lane.
    Cpu { tm: u32, nv: u32 },
    /// Shared-memory tiles for GPUs: `bm` x `bn` outputs per workgroup, `bk` steps of K
    /// per tile (pipeline-overridable constants of one module).
    Tiled { bm: u32, bn: u32, bk: u32 },
    /// Matrix-vector (N = 1): `lanes` threads per output row (an override).
    Gemv { lanes: u32 },
}

/// Tile shapes per adapter class. Every entry was measured (benches/RESULTS.md): the
/// tiled kernel's 64 x 64 x 16 and the GEMV's 64 lanes are what the kernels were tuned
/// with; the CPU-class register blocks are chosen by shape in [`plan`].
struct Tuning {
    tiled: MatmulVariant,
    gemv: MatmulVariant,
}

const GPU_TUNING: Tuning = Tuning {
    tiled: MatmulVariant::Tiled {
        bm: 64,
        bn: 64,
        bk: 16,
    },
    gemv: MatmulVariant::Gemv { lanes: 64 },
};
/// CPU-class adapters only meet the tiled kernel when a caller pins it; its GEMV is the
/// GPU's (one SIMD vector of 8 lanes walks 64 values of K per step either way).
const CPU_TUNING: Tuning = GPU_TUNING;

fn tuning(caps: &Capabilities) -> &'static Tuning {
    if cpu_class(caps) {
        &CPU_TUNING
    } else {
        &GPU_TUNING
    }
}

/// Bytes of workgroup memory every WebGPU adapter offers (the tiled kernel's two tiles
/// must fit it).
const WORKGROUP_STORAGE: u32 = 16384;

impl std::str::FromStr for MatmulVariant {
    type Err = Error;
    /// Parses a name as [`MatmulVariant::name`] writes it: `naive`, `tiledBMxBNxBK`
    /// (`tiled64` is the default 64x64x16), `gemvLANES` (`gemv`: 64 lanes),
    /// `cpuTMxCOLS` (COLS a multiple of 4, e.g. `cpu16x8`).
    fn from_str(s: &str) -> Result<Self> {
        let bad = || {
            Error::InvalidArgument(format!(
                "unknown matmul variant `{s}`: use naive, tiled64, tiledBMxBNxBK (e.g. \
                 tiled32x64x8), gemv, gemvLANES (e.g. gemv128) or cpuTMxCOLS (e.g. cpu16x8)"
            ))
        };
        let nums = |rest: &str| -> Result<Vec<u32>> {
            rest.split('x')
                .map(|v| v.parse().map_err(|_| bad()))
                .collect()
        };
        let v = match s {
            "naive" => MatmulVariant::Naive,
            "tiled64" => GPU_TUNING.tiled,
            "gemv" => GPU_TUNING.gemv,
            _ => {
                if let Some(rest) = s.strip_prefix("tiled") {
                    match nums(rest)?[..] {
                        [bm, bn, bk] => MatmulVariant::Tiled { bm, bn, bk },
                        _ => return Err(bad()),
                    }
                } else if let Some(rest) = s.strip_prefix("gemv") {
                    MatmulVariant::Gemv {
                        lanes: rest.parse().map_err(|_| bad())?,
                    }
                } else if let Some(rest) = s.strip_prefix("cpu") {
                    match nums(rest)?[..] {
                        [tm, cols] if cols.is_multiple_of(4) => {
                            MatmulVariant::Cpu { tm, nv: cols / 4 }
                        }
                        _ => return Err(bad()),
                    }
                } else {
                    return Err(bad());
                }
            }
        };
        v.check()?;
        Ok(v)
    }
}

impl MatmulVariant {
    pub fn name(&self) -> String {
        match self {
            MatmulVariant::Naive => "naive".into(),
            MatmulVariant::Cpu { tm, nv } => format!("cpu{tm}x{}", nv * 4),
            MatmulVariant::Tiled { bm, bn, bk } => format!("tiled{bm}x{bn}x{bk}"),
            MatmulVariant::Gemv { lanes } => format!("gemv{lanes}"),
        }
    }

    /// Whether the kernel can take this shape; the error names the allowed ones.
    pub fn check(&self) -> Result<()> {
        let problem = match *self {
            MatmulVariant::Naive => None,
            MatmulVariant::Cpu { tm, nv } => (tm == 0 || tm > 64 || nv == 0 || nv > 8)
                .then(|| "cpu blocks take 1..=64 rows and 4..=32 columns (a multiple of 4)".into()),
            MatmulVariant::Tiled { bm, bn, bk } => {
                let side = |d: u32| (16..=128).contains(&d) && d.is_multiple_of(16);
                let shared = 4 * bk as u64 * (bm as u64 + bn as u64 + 2);
                if !side(bm) || !side(bn) || bk == 0 || !bk.is_multiple_of(4) || bk > 64 {
                    Some("tiles take BM and BN multiples of 16 up to 128 and BK a multiple of 4 up to 64".into())
                } else if shared > WORKGROUP_STORAGE as u64 {
                    Some(format!(
                        "its two tiles need {shared} bytes of workgroup memory, over the \
                         {WORKGROUP_STORAGE} every adapter offers: use a smaller BK"
                    ))
                } else {
                    None
                }
            }
            MatmulVariant::Gemv { lanes } => (!lanes.is_power_of_two()
                || !(4..=256).contains(&lanes))
            .then(|| "gemv lanes are a power of two from 4 to 256".into()),
        };
        match problem {
            Some(p) => Err(Error::InvalidArgument(format!(
                "matmul variant {}: {p}",
                self.name()
            ))),
            None => Ok(()),
        }
    }
}

/// How one GEMM is run.
#[derive(Clone, Debug)]
pub struct MatmulPlan {
    pub variant: MatmulVariant,
    /// K is cut into this many chunks whose f32 partials `matmul_finish` sums.
    pub splits: u32,
    pub k_chunk: u32,
    /// Output rows per dispatch, so that no single dispatch runs for long.
    pub rows_per_dispatch: u32,
    /// Results go through f32 partials and `matmul_finish` (split K, or a 16-bit packed
    /// C that the kernel cannot store a whole word of at a time).
    pub partial: bool,
}

/// Lanes per subgroup on the CPU-class kernel when subgroups are off (and lavapipe's).
const CPU_LANES: u32 = 8;
/// Work per dispatch, in flops: ~0.1 s on lavapipe, well under a millisecond on a GPU.
const FLOPS_PER_DISPATCH: f64 = 4e9;

fn cpu_class(caps: &Capabilities) -> bool {
    caps.device_type == "cpu"
}

/// Subgroup size the CPU kernel can rely on: a fixed size, or none.
fn fixed_subgroup(caps: &Capabilities) -> Option<u32> {
    match caps.subgroup_sizes {
        Some((lo, hi)) if lo == hi && (4..=64).contains(&lo) => Some(lo),
        _ => None,
    }
}

/// Rows and columns of C one workgroup of `variant` covers.
fn tile(variant: MatmulVariant, caps: &Capabilities) -> (u32, u32) {
    match variant {
        MatmulVariant::Naive => (8, 8),
        MatmulVariant::Cpu { tm, nv } => (tm, fixed_subgroup(caps).unwrap_or(CPU_LANES) * 4 * nv),
        MatmulVariant::Tiled { bm, bn, .. } => (bm, bn),
        MatmulVariant::Gemv { .. } => (1, 1),
    }
}

/// Chooses the kernel and its launch shape for `mm` on `caps` (or plans `force`).
pub fn plan(mm: &Matmul, caps: &Capabilities, force: Option<MatmulVariant>) -> Result<MatmulPlan> {
    let (m, n, k) = (mm.m as u32, mm.n as u32, mm.k as u32);
    if m == 0 || n == 0 {
        // Nothing to compute (and nothing to dispatch).
        return Ok(MatmulPlan {
            variant: force.unwrap_or(MatmulVariant::Naive),
            splits: 1,
            k_chunk: k,
            rows_per_dispatch: 1,
            partial: false,
        });
    }
    if let Some(v) = force {
        v.check()?;
    }
    let variant = force.unwrap_or_else(|| {
        if n == 1 && k >= 32 {
            tuning(caps).gemv
        } else if cpu_class(caps) {
            // 16 x 8 per lane was the best block measured on lavapipe; small matrices
            // take smaller blocks so that both worker threads get tiles.
            // Measured on lavapipe (benches/RESULTS.md): taller and wider blocks keep
            // winning up to 64 x 16 per workgroup, but their unrolled code takes seconds
            // to compile (0.4 s at 16 x 8, 2 s at 32 x 12, 11 s at 64 x 16), so only
            // products big enough to repay that get them. Without subgroups every lane
            // loads every A value: tall blocks buy nothing there.
            let sg = fixed_subgroup(caps).is_some();
            let work = m as u64 * n as u64 * k as u64 * mm.batch as u64;
            let (tm, nv) = if sg && m >= 64 && n >= 128 && work >= 1 << 30 {
                (64, 4)
            } else if sg && m >= 32 && n >= 96 && work >= 1 << 27 {
                (32, 3)
            } else if sg && m >= 64 && n >= 64 {
                (16, 2)
            } else if m >= 8 {
                (8, 1)
            } else {
                (4, 1)
            };
            MatmulVariant::Cpu { tm, nv }
        } else {
            tuning(caps).tiled
        }
    });
    let (tm, tn) = tile(variant, caps);
    let gemv = matches!(variant, MatmulVariant::Gemv { .. });
    if !gemv && n.div_ceil(tn) > 65535 {
        return Err(Error::InvalidArgument(format!(
            "matmul: n = {n} needs {} column workgroups, over the 65535 one dispatch allows; \
             compute the transposed product (swap A and B) instead",
            n.div_ceil(tn)
        )));
    }
    let tiles = m.div_ceil(tm) as u64 * n.div_ceil(tn) as u64 * mm.batch as u64;
    // Split K when the output has too few tiles to fill the adapter and K is long.
    let busy = if cpu_class(caps) { 8 } else { 256 };
    let step = match variant {
        MatmulVariant::Cpu { .. } => fixed_subgroup(caps).unwrap_or(CPU_LANES),
        MatmulVariant::Tiled { bk, .. } => bk,
        MatmulVariant::Gemv { lanes } => lanes,
        MatmulVariant::Naive => 1,
    };
    let mut splits = 1u32;
    if variant != MatmulVariant::Naive && tiles < busy && k >= 1024 {
        splits = ((busy / tiles.max(1)) as u32).clamp(1, 8).min(k / 256);
    }
    let k_chunk = k.div_ceil(splits.max(1)).div_ceil(step) * step;
    let splits = if k == 0 {
        1
    } else {
        k.div_ceil(k_chunk.max(1))
    };

    let packed_c = matches!(
        Repr::of(mm.c.dtype, caps.f16_arithmetic),
        Repr::F16Packed | Repr::BF16
    );
    let whole_groups = matches!(variant, MatmulVariant::Cpu { .. })
        && n.is_multiple_of(4)
        && (mm.batch == 1 || mm.stride_c.is_multiple_of(4));
    let partial = splits > 1 || (packed_c && !whole_groups);

    let row_flops = 2.0 * n as f64 * k as f64 * mm.batch as f64;
    let mut rows = ((FLOPS_PER_DISPATCH / row_flops.max(1.0)) as u32).max(tm);
    rows = (rows / tm * tm).min(65535 * tm).min(m.div_ceil(tm) * tm);
    let z = mm.batch as u64 * splits as u64;
    if z > 65535 {
        return Err(Error::InvalidArgument(format!(
            "matmul: batch {} x {splits} K-splits exceeds 65535 workgroups in one dimension; split the batch",
            mm.batch
        )));
    }
    Ok(MatmulPlan {
        variant,
        splits,
        k_chunk,
        rows_per_dispatch: rows.max(1),
        partial,
    })
}

fn kernel_for(variant: MatmulVariant, caps: &Capabilities) -> &'static KernelSource {
    match variant {
        MatmulVariant::Naive => &shader::MATMUL_NAIVE,
        MatmulVariant::Cpu { .. } if fixed_subgroup(caps).is_some() => &shader::MATMUL_CPU,
        MatmulVariant::Cpu { .. } => &shader::MATMUL_CPU_NOSG,
        MatmulVariant::Tiled { .. } => &shader::MATMUL_TILED,
        MatmulVariant::Gemv { .. } => &shader::GEMV,
    }
}

impl WgpuDevice {
    /// Records `mm` with a pinned kernel (for benchmarks and tests of one variant).
    pub fn launch_matmul(&self, mm: &Matmul, variant: Option<MatmulVariant>) -> Result<MatmulPlan> {
        let kernel = kiln_engine::Kernel::Matmul(mm.clone());
        kernel.validate()?;
        if matches!(variant, Some(MatmulVariant::Gemv { .. })) && mm.n != 1 {
            return Err(Error::InvalidArgument(format!(
                "matmul: the gemv kernel computes one output column, but n = {}",
                mm.n
            )));
        }
        let plan = plan(mm, &self.caps, variant)?;
        let mut s = self.lock();
        let handles = self.handles(&s, "matmul", &mm.buffers())?;
        self.matmul(&mut s, mm, &plan, &handles)?;
        Ok(plan)
    }

    pub(crate) fn matmul(
        &self,
        s: &mut State,
        mm: &Matmul,
        plan: &MatmulPlan,
        handles: &HashMap<u64, wgpu::Buffer>,
    ) -> Result<()> {
        if mm.m == 0 || mm.n == 0 {
            return Ok(());
        }
        let limit = self.caps.max_storage_binding;
        let partial_bytes = |mm: &Matmul, splits: u32| {
            (mm.batch as u64 * mm.m as u64 * mm.n as u64 * splits as u64).div_ceil(2) * 8
        };
        let partials_fit = !plan.partial || partial_bytes(mm, plan.splits) <= limit;
        if partials_fit && mm.buffers().iter().all(|b| b.bytes() <= limit) {
            return self.record(s, mm, plan, handles, &Windows::default());
        }
        // An operand is larger than one binding can show a kernel: run the product in
        // bands of C's rows, each binding only its rows of A, C and the f32 copy.
        let too_big = |what: String| Error::Unsupported {
            device: self.caps.name.clone(),
            what: format!(
                "{what}; one binding holds at most {limit} bytes. Larger operands are split by \
                 rows of C (batch 1, A not transposed) or into groups of whole matrices (batches)"
            ),
        };
        if mm.batch > 1 {
            return self.matmul_in_batch_groups(
                s,
                mm,
                plan,
                handles,
                partial_bytes(mm, 8) / mm.batch as u64,
            );
        }
        if mm.trans_a {
            return Err(too_big(format!(
                "an A-transposed matmul with an operand over the binding limit (A {} bytes, C {} bytes)",
                mm.a.bytes(),
                mm.c.bytes()
            )));
        }
        for b in [Some(mm.b), mm.bias].into_iter().flatten() {
            if b.bytes() > limit {
                return Err(too_big(format!(
                    "operand buffer #{} of {} bytes, which rows of C cannot split",
                    b.id,
                    b.bytes()
                )));
            }
        }
        let align = self.storage_offset_alignment();
        // Bytes per row of each banded operand; a band must start at an aligned offset
        // in all of them.
        let mut row_bytes = vec![
            (mm.k * mm.a.dtype.size()) as u64,
            (mm.n * mm.c.dtype.size()) as u64,
        ];
        if mm.c_f32.is_some() {
            row_bytes.push(mm.n as u64 * 4);
        }
        if plan.partial {
            // f32 partials for every split (at most 8) of a band's rows.
            row_bytes.push(mm.n as u64 * 4 * 8);
        }
        let unit = row_bytes
            .iter()
            .map(|&r| align / gcd(r.max(1), align))
            .fold(1, lcm);
        let widest = *row_bytes.iter().max().expect("two entries");
        // Two elements of slack: kernels read 16-bit and f32 values in pairs.
        let band = ((limit - 16) / widest.max(1)) / unit * unit;
        if band == 0 {
            return Err(too_big(format!("{unit} rows of {widest} bytes")));
        }
        let mut r0 = 0u64;
        while r0 < mm.m as u64 {
            let rows = band.min(mm.m as u64 - r0);
            let sub = Matmul {
                m: rows as usize,
                stride_a: rows as usize * mm.k,
                stride_c: rows as usize * mm.n,
                ..mm.clone()
            };
            let window = |buf: kiln_engine::Buffer, row: u64| {
                let offset = r0 * row;
                // Round up to whole 8-byte pairs, within the buffer's padded size.
                let size = (rows * row).div_ceil(8) * 8;
                (offset, size.min(buf.bytes() - offset))
            };
            let windows = Windows {
                a: Some(window(mm.a, row_bytes[0])),
                b: None,
                c: Some(window(mm.c, row_bytes[1])),
                cf: mm.c_f32.map(|cf| window(cf, mm.n as u64 * 4)),
            };
            let sub_plan = plan_for(&sub, &self.caps, plan)?;
            self.record(s, &sub, &sub_plan, handles, &windows)?;
            r0 += rows;
        }
        Ok(())
    }

    /// A batch with an operand over the binding limit: groups of whole matrices, each
    /// group binding only its matrices of every strided operand (stride-0 operands are
    /// shared and must fit as they are). `partial_per_matrix`: f32 partial bytes one
    /// matrix needs at the most splits.
    fn matmul_in_batch_groups(
        &self,
        s: &mut State,
        mm: &Matmul,
        plan: &MatmulPlan,
        handles: &HashMap<u64, wgpu::Buffer>,
        partial_per_matrix: u64,
    ) -> Result<()> {
        let limit = self.caps.max_storage_binding;
        let align = self.storage_offset_alignment();
        let refuse = |what: String| Error::Unsupported {
            device: self.caps.name.clone(),
            what: format!("{what}; one binding holds at most {limit} bytes"),
        };
        // (buffer, bytes between matrices, bytes of one matrix's span)
        let mut operands = vec![
            (
                mm.a,
                mm.stride_a as u64 * mm.a.dtype.size() as u64,
                (mm.m * mm.k * mm.a.dtype.size()) as u64,
            ),
            (
                mm.b,
                mm.stride_b as u64 * mm.b.dtype.size() as u64,
                (mm.k * mm.n * mm.b.dtype.size()) as u64,
            ),
            (
                mm.c,
                mm.stride_c as u64 * mm.c.dtype.size() as u64,
                (mm.m * mm.n * mm.c.dtype.size()) as u64,
            ),
        ];
        if let Some(cf) = mm.c_f32 {
            operands.push((cf, mm.stride_c as u64 * 4, (mm.m * mm.n * 4) as u64));
        }
        let mut unit = 1;
        for &(buf, stride, _) in &operands {
            if stride == 0 {
                if buf.bytes() > limit {
                    return Err(refuse(format!(
                        "buffer #{} ({} bytes) is shared by every matrix of the batch (stride 0)",
                        buf.id,
                        buf.bytes()
                    )));
                }
            } else {
                unit = lcm(unit, align / gcd(stride, align));
            }
        }
        // The largest group (a multiple of `unit` matrices) whose windows all fit.
        let fits = |g: u64| {
            operands
                .iter()
                .all(|&(_, stride, span)| stride == 0 || (g - 1) * stride + span + 16 <= limit)
                && (!plan.partial || g * partial_per_matrix <= limit)
        };
        let mut group = 0;
        let mut g = unit;
        while g <= mm.batch as u64 && fits(g) {
            group = g;
            g += unit;
        }
        if group == 0 {
            return Err(refuse(format!(
                "one matrix of this batch does not fit a binding (or {unit} matrices are needed \
                 for an aligned group); split the matrices themselves"
            )));
        }
        let mut g0 = 0u64;
        while g0 < mm.batch as u64 {
            let n = group.min(mm.batch as u64 - g0);
            let sub = Matmul {
                batch: n as usize,
                ..mm.clone()
            };
            let window = |buf: kiln_engine::Buffer, stride: u64, span: u64| {
                (stride > 0).then(|| {
                    let offset = g0 * stride;
                    let size = ((n - 1) * stride + span).div_ceil(8) * 8;
                    (offset, size.min(buf.bytes() - offset))
                })
            };
            let w = |i: usize| window(operands[i].0, operands[i].1, operands[i].2);
            let windows = Windows {
                a: w(0),
                b: w(1),
                c: w(2),
                cf: if operands.len() > 3 { w(3) } else { None },
            };
            let sub_plan = plan_for(&sub, &self.caps, plan)?;
            self.record(s, &sub, &sub_plan, handles, &windows)?;
            g0 += n;
        }
        Ok(())
    }

    /// Records one GEMM whose operands each fit a binding (`windows` gives the byte
    /// ranges of A, C and the f32 copy when only part of their buffer is bound).
    fn record(
        &self,
        s: &mut State,
        mm: &Matmul,
        plan: &MatmulPlan,
        handles: &HashMap<u64, wgpu::Buffer>,
        windows: &Windows,
    ) -> Result<()> {
        let caps = &self.caps;
        let limit = caps.max_storage_binding;
        let (m, n, k) = (mm.m as u32, mm.n as u32, mm.k as u32);
        let total = mm.batch as u64 * mm.m as u64 * mm.n as u64;
        let partial_bytes = (total * plan.splits as u64).div_ceil(2) * 8;
        if plan.partial && partial_bytes > limit {
            return Err(Error::Unsupported {
                device: caps.name.clone(),
                what: format!(
                    "{partial_bytes} bytes of f32 matmul partials (over the {limit}-byte binding limit); use fewer K splits or a smaller batch"
                ),
            });
        }
        let partials = if plan.partial {
            Some(self.partials(s, partial_bytes))
        } else {
            None
        };
        let stride_c = if mm.batch == 1 {
            m * n
        } else {
            mm.stride_c as u32
        };
        let kernel = kernel_for(plan.variant, caps);
        let repr = |b: kiln_engine::Buffer| self.repr(b.dtype);
        let h = |b: kiln_engine::Buffer| (b.id, &handles[&b.id]);
        let bias = mm.bias.map_or((DUMMY_ID, &self.dummy), h);
        let cf_user = mm.c_f32.map_or((SCRATCH_ID, &self.scratch), h);
        let flag = |b: bool| b as u32;
        let overrides = |partial: bool| {
            vec![
                ("TRANS_A", flag(mm.trans_a)),
                ("TRANS_B", flag(mm.trans_b)),
                ("USE_BETA", flag(mm.beta != 0.0)),
                ("BIAS", flag(mm.bias.is_some())),
                ("GELU", flag(mm.gelu)),
                ("COPY_F32", flag(mm.c_f32.is_some())),
                ("PARTIAL", flag(partial)),
            ]
        };
        let params = |row_base: u32, rows: u32, words: u32| -> Vec<u32> {
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
                total as u32,
                words,
                rows,
                0,
            ]
        };
        let (tm, tn) = tile(plan.variant, caps);
        let mut consts = vec![];
        // The tile shape: pipeline constants of one module (see tile_overrides).
        let tiles = tile_overrides(plan.variant);
        let aligned = |dim: usize, stride: usize| {
            dim.is_multiple_of(4) && (mm.batch == 1 || stride.is_multiple_of(4))
        };
        if let MatmulVariant::Tiled { .. } = plan.variant {
            // 16-byte loads along each operand's contiguous dimension when it allows.
            let a_dim = if mm.trans_a { mm.m } else { mm.k };
            let b_dim = if mm.trans_b { mm.k } else { mm.n };
            consts = vec![
                ("VEC_A", aligned(a_dim, mm.stride_a) as u32),
                ("VEC_B", aligned(b_dim, mm.stride_b) as u32),
            ];
        }
        if let MatmulVariant::Cpu { tm, nv } = plan.variant {
            let vec_b = !mm.trans_b
                && n.is_multiple_of(4)
                && (mm.batch == 1 || mm.stride_b.is_multiple_of(4));
            let vec_c = n.is_multiple_of(4) && (mm.batch == 1 || mm.stride_c.is_multiple_of(4));
            consts = vec![
                ("SG", fixed_subgroup(caps).unwrap_or(CPU_LANES)),
                ("TM", tm),
                ("NV", nv),
                ("VEC_B", vec_b as u32),
                ("VEC_C", vec_c as u32),
            ];
        }
        let cf = match &partials {
            Some(p) => (PARTIALS_ID, p),
            None => cf_user,
        };
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
                    kernel,
                    reprs: vec![
                        repr(mm.a),
                        repr(mm.b),
                        repr(mm.c),
                        repr_of_bias(self, mm),
                        Repr::F32,
                    ],
                    consts: consts.clone(),
                    overrides: [overrides(plan.partial), tiles.clone()].concat(),
                    buffers: vec![h(mm.a), h(mm.b), h(mm.c), bias, cf],
                    ranges: windows.main(plan.partial),
                    params: params(row_base, rows, 0),
                    groups: (groups_x, groups_y, z),
                },
            )?;
            row_base += rows;
        }
        if let Some(p) = &partials {
            let span = (mm.batch as u64 - 1) * stride_c as u64 + total / mm.batch as u64;
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
                    overrides: overrides(false),
                    buffers: vec![(PARTIALS_ID, p), h(mm.b), h(mm.c), bias, cf_user],
                    ranges: windows.finish(),
                    params: params(0, m, words),
                    groups: (groups(words), 1, 1),
                },
            )?;
        }
        Ok(())
    }
}

/// Byte ranges of A, C and the f32 copy bound for one band of rows (none: whole buffer).
#[derive(Default)]
struct Windows {
    a: Option<(u64, u64)>,
    b: Option<(u64, u64)>,
    c: Option<(u64, u64)>,
    cf: Option<(u64, u64)>,
}

impl Windows {
    /// Slot ranges for the GEMM kernel (slots a, b, c, bias, cf). With partials, cf is
    /// the partials buffer, which is sized for the band already.
    fn main(&self, partial: bool) -> Vec<(usize, u64, u64)> {
        let mut v = vec![];
        v.extend(self.a.map(|(o, n)| (0, o, n)));
        v.extend(self.b.map(|(o, n)| (1, o, n)));
        v.extend(self.c.map(|(o, n)| (2, o, n)));
        if !partial {
            v.extend(self.cf.map(|(o, n)| (4, o, n)));
        }
        v
    }

    /// Slot ranges for `matmul_finish` (slot a holds the partials).
    fn finish(&self) -> Vec<(usize, u64, u64)> {
        let mut v = vec![];
        v.extend(self.b.map(|(o, n)| (1, o, n)));
        v.extend(self.c.map(|(o, n)| (2, o, n)));
        v.extend(self.cf.map(|(o, n)| (4, o, n)));
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

fn gcd(a: u64, b: u64) -> u64 {
    if b == 0 {
        a
    } else {
        gcd(b, a % b)
    }
}

fn lcm(a: u64, b: u64) -> u64 {
    a / gcd(a, b) * b
}

fn repr_of_bias(dev: &WgpuDevice, mm: &Matmul) -> Repr {
    mm.bias.map_or(Repr::F32, |b| dev.repr(b.dtype))
}
