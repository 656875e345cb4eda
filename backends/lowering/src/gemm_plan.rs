//! GEMM planning: which kernel, tile shape, K split and dispatch chunks a product gets,
//! by adapter class and shape (recording it is `gemm.rs`).
//!
//! The table is small on purpose and every entry was measured (benches/RESULTS.md):
//! CPU-class adapters (lavapipe, llvmpipe) are bound by load instructions and get the
//! subgroup-shared register-block kernel; GPUs get the shared-memory tiled kernel.
//!
//! Operands larger than one binding are never refused: a batch runs in groups of whole
//! matrices, a larger matrix in blocks of rows, columns and K, each dispatch binding
//! only its block of every large buffer (`gemm.rs`).

use kiln_engine::{Capabilities, Error, Matmul, Result};

use crate::dispatch::Readiness;
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
pub(crate) const CPU_LANES: u32 = 8;
/// Work per dispatch, in flops: ~0.1 s on lavapipe, well under a millisecond on a GPU.
const FLOPS_PER_DISPATCH: f64 = 4e9;

fn cpu_class(caps: &Capabilities) -> bool {
    caps.device_type == "cpu"
}

/// Subgroup size the CPU kernel can rely on: a fixed size, or none.
pub(crate) fn fixed_subgroup(caps: &Capabilities) -> Option<u32> {
    match caps.subgroup_sizes {
        Some((lo, hi)) if lo == hi && (4..=64).contains(&lo) => Some(lo),
        _ => None,
    }
}

/// Rows and columns of C one workgroup of `variant` covers.
pub(crate) fn tile(variant: MatmulVariant, caps: &Capabilities) -> (u32, u32) {
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
            cpu_block(mm, caps)
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
    // Every CPU block sums each output's K in the same order (one fma per k, in k
    // order, per K chunk), so blocks give bit-identical results exactly when they split
    // K alike: the split is sized with the table's block for the shape, whichever
    // block runs, so that a launch may run a cheaper-to-compile block while the best
    // one still builds, or a measured one, without changing a bit.
    // The tiled kernel sums alike in every tile shape too (one fma per k, in k order,
    // zeros past its chunk), so its tiles split K as the table's tile does: a measured
    // tile gives the table's bits.
    let (split_m, split_n) = match variant {
        MatmulVariant::Cpu { .. } => tile(cpu_block(mm, caps), caps),
        MatmulVariant::Tiled { .. } => tile(tuning(caps).tiled, caps),
        v => tile(v, caps),
    };
    let tiles = m.div_ceil(split_m) as u64 * n.div_ceil(split_n) as u64 * mm.batch as u64;
    // Split K when the output has too few tiles to fill the adapter and K is long.
    let busy = if cpu_class(caps) { 8 } else { 256 };
    let mut splits = 1u32;
    if variant != MatmulVariant::Naive && tiles < busy && k >= 1024 {
        splits = ((busy / tiles.max(1)) as u32).clamp(1, 8).min(k / 256);
    }
    let step_of = match variant {
        MatmulVariant::Tiled { .. } => tuning(caps).tiled,
        v => v,
    };
    let (splits, k_chunk) = split_k(k, splits, step_of, caps);

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

/// The CPU blocks from the largest (slowest to compile, fastest to run on big
/// products) down.
pub const CPU_LADDER: [MatmulVariant; 5] = [
    MatmulVariant::Cpu { tm: 64, nv: 4 },
    MatmulVariant::Cpu { tm: 32, nv: 3 },
    MatmulVariant::Cpu { tm: 16, nv: 2 },
    MatmulVariant::Cpu { tm: 8, nv: 1 },
    MatmulVariant::Cpu { tm: 4, nv: 1 },
];

/// The tiles a GPU-class adapter's GEMM selection times against the table's 64 x 64 x
/// 16 (`kiln-wgpu`'s `tune.rs`): larger tiles for large products on big GPUs, smaller
/// ones where the table's leaves compute units idle. Each fits the 16 KiB of workgroup
/// memory every adapter offers; all split K as the table's tile does ([`plan`]), so
/// whichever wins gives the same bits.
pub const GPU_LADDER: [MatmulVariant; 7] = [
    MatmulVariant::Tiled {
        bm: 128,
        bn: 128,
        bk: 8,
    },
    MatmulVariant::Tiled {
        bm: 128,
        bn: 64,
        bk: 16,
    },
    MatmulVariant::Tiled {
        bm: 64,
        bn: 128,
        bk: 16,
    },
    GPU_TUNING.tiled,
    MatmulVariant::Tiled {
        bm: 64,
        bn: 32,
        bk: 16,
    },
    MatmulVariant::Tiled {
        bm: 32,
        bn: 64,
        bk: 16,
    },
    MatmulVariant::Tiled {
        bm: 32,
        bn: 32,
        bk: 16,
    },
];

/// The blocks a selection times against `prior`: the CPU ladder for a CPU block, the
/// GPU ladder for a tile, none for other kernels.
pub fn ladder_of(prior: MatmulVariant) -> &'static [MatmulVariant] {
    match prior {
        MatmulVariant::Cpu { .. } => &CPU_LADDER,
        MatmulVariant::Tiled { .. } => &GPU_LADDER,
        _ => &[],
    }
}

/// The ladder's blocks below `v`, largest first (none for other kernels).
fn smaller_blocks(v: MatmulVariant) -> impl Iterator<Item = MatmulVariant> {
    let tm_of = |v: MatmulVariant| match v {
        MatmulVariant::Cpu { tm, .. } => Some(tm),
        _ => None,
    };
    let top = tm_of(v);
    CPU_LADDER
        .into_iter()
        .filter(move |&b| matches!((top, tm_of(b)), (Some(t), Some(bt)) if bt < t))
}

/// The block a launch runs when `best` is the plan's: `best` unless it is a block that
/// takes seconds to build and first run (16 rows and up: its machine code, compiled at
/// the first run on lavapipe's queue thread, is primed on another device meanwhile,
/// `primer.rs`) and a compile worker is still on it; then the largest smaller block of
/// 16 rows or more that is ready; else 16 x 8 where the backend does not build it in
/// the background (vk primes only blocks of 32 rows and up, so 16 x 8 builds at once
/// there); else 8 x 4 (`QUICK`), which `prepare` builds ahead and which compiles in
/// a fraction of a second. Launches switch to `best` once it is built. Every block
/// gives the same bits ([`plan`]'s K split).
pub fn stand_in(best: MatmulVariant, state: impl Fn(MatmulVariant) -> Readiness) -> MatmulVariant {
    if !slow(best) || state(best) != Readiness::Building {
        return best;
    }
    // Blocks under 16 rows run the big products several times slower: a 16 x 8 or
    // larger is better where there is one to run now.
    if let Some(v) = smaller_blocks(best)
        .filter(|&v| matches!(v, MatmulVariant::Cpu { tm, .. } if tm >= 16))
        .find(|&v| state(v) == Readiness::Ready)
    {
        return v;
    }
    if best != STAND_IN && state(STAND_IN) != Readiness::Building {
        return STAND_IN;
    }
    QUICK
}

/// Whether `v` takes seconds to build and first run on lavapipe (0.4 s of IR and 1-2 s
/// of machine code at 16 x 8 on a cold cache, 2 s and 7 s at 32 x 12, 11 s and 25 s at
/// 64 x 16), so that a launch runs a stand-in while it is built and primed.
fn slow(v: MatmulVariant) -> bool {
    matches!(v, MatmulVariant::Cpu { tm, .. } if tm >= SLOW_ROWS)
}

/// The rows from which a CPU block is `slow` (the compile queue reads it too).
pub const SLOW_ROWS: u32 = 16;

/// The block that stands in when no block of 16 rows or more is ready: 8 rows, whose
/// code compiles in a fraction of a second.
pub(crate) const QUICK: MatmulVariant = MatmulVariant::Cpu { tm: 8, nv: 1 };

/// The stand-in a 32- or 64-row block gets once it is primed itself.
pub(crate) const STAND_IN: MatmulVariant = MatmulVariant::Cpu { tm: 16, nv: 2 };

/// The table's register block for `mm` on a CPU-class adapter.
fn cpu_block(mm: &Matmul, caps: &Capabilities) -> MatmulVariant {
    let (m, n, k) = (mm.m as u32, mm.n as u32, mm.k as u32);
    // 16 x 8 per lane was the best block measured on lavapipe; small matrices take
    // smaller blocks so that both worker threads get tiles. Measured on lavapipe
    // (benches/RESULTS.md): taller and wider blocks keep winning up to 64 x 16 per
    // workgroup, but their unrolled code takes seconds to compile (0.4 s at 16 x 8, 2 s
    // at 32 x 12, 11 s at 64 x 16), so only products big enough to repay that get them.
    // Without subgroups every lane loads every A value: tall blocks buy nothing there.
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
}

/// At most `splits` chunks of K, each a whole number of the kernel's K steps (the CPU
/// kernel's loads are zeroed past K, not past a chunk's end): (splits, chunk).
pub(crate) fn split_k(
    k: u32,
    splits: u32,
    variant: MatmulVariant,
    caps: &Capabilities,
) -> (u32, u32) {
    let step = match variant {
        MatmulVariant::Cpu { .. } => fixed_subgroup(caps).unwrap_or(CPU_LANES),
        MatmulVariant::Tiled { bk, .. } => bk,
        MatmulVariant::Gemv { lanes } => lanes,
        MatmulVariant::Naive => 1,
    };
    let k_chunk = k.div_ceil(splits.max(1)).div_ceil(step) * step;
    let splits = if k == 0 {
        1
    } else {
        k.div_ceil(k_chunk.max(1))
    };
    (splits, k_chunk)
}

pub(crate) fn kernel_for(variant: MatmulVariant, caps: &Capabilities) -> &'static KernelSource {
    match variant {
        MatmulVariant::Naive => &shader::MATMUL_NAIVE,
        MatmulVariant::Cpu { .. } if fixed_subgroup(caps).is_some() => &shader::MATMUL_CPU,
        MatmulVariant::Cpu { .. } => &shader::MATMUL_CPU_NOSG,
        MatmulVariant::Tiled { .. } => &shader::MATMUL_TILED,
        MatmulVariant::Gemv { .. } => &shader::GEMV,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const B64: MatmulVariant = MatmulVariant::Cpu { tm: 64, nv: 4 };
    const B32: MatmulVariant = MatmulVariant::Cpu { tm: 32, nv: 3 };
    const B16: MatmulVariant = MatmulVariant::Cpu { tm: 16, nv: 2 };
    const B8: MatmulVariant = MatmulVariant::Cpu { tm: 8, nv: 1 };

    /// Readiness from a list; anything unlisted was never asked for.
    fn states(list: &[(MatmulVariant, Readiness)]) -> impl Fn(MatmulVariant) -> Readiness + '_ {
        move |v| {
            list.iter()
                .find(|(k, _)| *k == v)
                .map_or(Readiness::Absent, |&(_, r)| r)
        }
    }

    #[test]
    fn a_built_or_unprepared_block_runs_itself() {
        use Readiness::*;
        assert_eq!(stand_in(B64, states(&[(B64, Ready)])), B64);
        // Not prepared: it builds on the spot, as without `prepare`.
        assert_eq!(stand_in(B64, states(&[])), B64);
        // Quick to build: waiting for it costs less than building another.
        assert_eq!(stand_in(B8, states(&[(B8, Building)])), B8);
        let gemv = MatmulVariant::Gemv { lanes: 64 };
        assert_eq!(stand_in(gemv, states(&[(gemv, Building)])), gemv);
    }

    #[test]
    fn a_building_block_gives_way_to_the_largest_ready_one() {
        use Readiness::*;
        let s = [(B64, Building), (B32, Ready), (B16, Ready)];
        assert_eq!(stand_in(B64, states(&s)), B32);
        let s = [(B64, Building), (B32, Building), (B16, Ready), (B8, Ready)];
        assert_eq!(stand_in(B64, states(&s)), B16);
        // 16 x 8 itself building in the background (wgpu primes it): 8 x 4, quick to
        // build and first run.
        let s = [
            (B64, Building),
            (B32, Building),
            (B16, Building),
            (B8, Ready),
        ];
        assert_eq!(stand_in(B64, states(&s)), B8);
        assert_eq!(stand_in(B16, states(&[(B16, Building)])), B8);
        // 16 x 8 not asked for in the background (vk primes only 32 rows and up): it
        // builds on the spot.
        assert_eq!(stand_in(B64, states(&[(B64, Building)])), B16);
        assert_eq!(stand_in(B32, states(&[(B32, Building), (B64, Ready)])), B16);
        // Once built, the launch switches back.
        assert_eq!(stand_in(B64, states(&[(B64, Ready), (B32, Ready)])), B64);
    }

    fn caps_lavapipe() -> Capabilities {
        Capabilities {
            name: "llvmpipe".into(),
            backend: "vulkan".into(),
            device_type: "cpu".into(),
            vendor: 0x10005,
            driver: "llvmpipe".into(),
            f16_arithmetic: true,
            subgroup_sizes: Some((8, 8)),
            timestamp_queries: true,
            max_storage_binding: 1 << 30,
            max_buffer: 1 << 31,
            memory_budget: None,
            memory_heap: None,
            memory_limit: None,
        }
    }

    /// An f32 buffer of `len` values (planning reads only the type and length).
    fn buf(len: usize) -> kiln_engine::Buffer {
        kiln_engine::Buffer {
            id: 0,
            dtype: kiln_engine::DType::F32,
            len,
        }
    }

    /// Each of `ladder` planned against the table's pick (which is `table_tile` where
    /// given) on shapes with and without a K split: the same split, chunk and partials.
    fn assert_ladder_splits_like_the_table(
        caps: &Capabilities,
        ladder: &[MatmulVariant],
        table_tile: Option<MatmulVariant>,
    ) {
        for (m, n, k) in [
            (40, 100, 2048),
            (33, 65, 1024),
            (3, 5, 1100),
            (1024, 4096, 256),
        ] {
            let mm = Matmul::new(buf(m * k), buf(k * n), buf(m * n), m, n, k);
            let table = plan(&mm, caps, None).unwrap();
            if let Some(t) = table_tile {
                assert_eq!(table.variant, t);
                assert_eq!(ladder_of(table.variant), ladder);
            }
            for &v in ladder {
                let p = plan(&mm, caps, Some(v)).unwrap();
                assert_eq!(
                    (p.splits, p.k_chunk, p.partial),
                    (table.splits, table.k_chunk, table.partial),
                    "{} on {m}x{n}x{k}",
                    v.name()
                );
            }
        }
    }

    /// Every tile of the GPU ladder is a valid tile and splits K as the table's does.
    #[test]
    fn every_gpu_tile_splits_k_as_the_table_does() {
        let caps = Capabilities {
            device_type: "discrete".into(),
            subgroup_sizes: Some((32, 32)),
            ..caps_lavapipe()
        };
        assert_ladder_splits_like_the_table(&caps, &GPU_LADDER, Some(GPU_TUNING.tiled));
        // The long-K shapes with few tiles split at all (else the test proves little).
        let mm = Matmul::new(buf(40 * 2048), buf(2048 * 100), buf(4000), 40, 100, 2048);
        assert!(plan(&mm, &caps, None).unwrap().splits > 1);
    }

    /// Every CPU block splits K as the table's block for the shape does, so that they
    /// sum each output in the same order (tests/gemm_select.rs checks the bits).
    #[test]
    fn every_cpu_block_splits_k_as_the_table_does() {
        assert_ladder_splits_like_the_table(&caps_lavapipe(), &CPU_LADDER, None);
    }
}
