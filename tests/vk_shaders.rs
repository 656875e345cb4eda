//! The hand-written GLSL kernels of the raw Vulkan backend (`shaders/vulkan/*.comp`):
//! the committed SPIR-V is what the sources compile to, valid for Vulkan, and computes
//! what the CPU reference does.

mod common;

use std::path::{Path, PathBuf};
use std::process::Command;

use common::*;
use kiln::engine::{DType, Device, HostData, Kernel, Matmul};

fn shader_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("shaders/vulkan")
}

fn sources() -> Vec<PathBuf> {
    let mut v: Vec<PathBuf> = std::fs::read_dir(shader_dir())
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "comp"))
        .collect();
    v.sort();
    assert!(
        !v.is_empty(),
        "no GLSL kernels in {}",
        shader_dir().display()
    );
    v
}

#[test]
fn every_committed_spv_is_what_its_source_compiles_to() {
    let tmp = std::env::temp_dir().join(format!("kiln-glsl-{}", std::process::id()));
    std::fs::create_dir_all(&tmp).unwrap();
    for src in sources() {
        let spv = src.with_extension("spv");
        let fresh = tmp.join(spv.file_name().unwrap());
        let out = Command::new("glslangValidator")
            .args(["-V", "--target-env", "vulkan1.2", "-o"])
            .arg(&fresh)
            .arg(&src)
            .output()
            .unwrap_or_else(|e| {
                panic!("running glslangValidator ({e}): install glslang-tools (scripts/setup.sh)")
            });
        assert!(
            out.status.success(),
            "{}: {}",
            src.display(),
            String::from_utf8_lossy(&out.stdout)
        );
        let committed = std::fs::read(&spv).unwrap_or_else(|e| {
            panic!(
                "{} ({e}): run scripts/compile-vulkan-shaders.sh and commit it",
                spv.display()
            )
        });
        assert!(
            committed == std::fs::read(&fresh).unwrap(),
            "{} is stale: run scripts/compile-vulkan-shaders.sh and commit it",
            spv.display()
        );
    }
    std::fs::remove_dir_all(&tmp).unwrap();
}

#[test]
fn every_committed_spv_passes_spirv_val() {
    for src in sources() {
        let spv = src.with_extension("spv");
        let out = Command::new("spirv-val")
            .args(["--target-env", "vulkan1.2"])
            .arg(&spv)
            .output()
            .unwrap_or_else(|e| panic!("running spirv-val ({e}): install spirv-tools"));
        assert!(
            out.status.success(),
            "{}: {}",
            spv.display(),
            String::from_utf8_lossy(&out.stderr)
        );
    }
}

#[test]
fn the_glsl_gemm_matches_the_cpu() {
    let dev = kiln::vulkan::VkDevice::open(0, &Default::default()).unwrap();
    let cpu = kiln::cpu::CpuDevice::new();
    let mut rng = Rng::new(5);
    // Tile-sized, ragged on every side, and degenerate shapes.
    for (m, n, k) in [
        (1, 1, 1),
        (16, 16, 16),
        (17, 33, 19),
        (64, 48, 80),
        (5, 100, 3),
    ] {
        let a: Vec<f32> = (0..m * k).map(|_| rng.uniform(-1.0, 1.0)).collect();
        let b: Vec<f32> = (0..k * n).map(|_| rng.uniform(-1.0, 1.0)).collect();
        let run = |d: &dyn Device, glsl: bool| {
            let (ba, bb) = (
                put(d, &HostData::F32(a.clone())),
                put(d, &HostData::F32(b.clone())),
            );
            let c = d.alloc(DType::F32, m * n).unwrap();
            let mm = Matmul::new(ba, bb, c, m, n, k);
            if glsl {
                dev.launch_glsl_gemm(&mm).unwrap();
            } else {
                d.launch(&Kernel::Matmul(mm)).unwrap();
            }
            d.submit().unwrap();
            d.download(c).unwrap().to_f32()
        };
        let (got, want) = (run(&dev, true), run(&cpu, false));
        for (i, (g, w)) in got.iter().zip(&want).enumerate() {
            // f32 sums of k products of values below 1, in another order.
            assert!(
                (g - w).abs() <= k as f32 * 2e-7 * 4.0,
                "{m}x{n}x{k}: C[{i}] = {g}, CPU {w}"
            );
        }
    }
}

#[test]
fn the_glsl_gemm_refuses_what_it_does_not_compute() {
    let dev = kiln::vulkan::VkDevice::open(0, &Default::default()).unwrap();
    let a = dev.alloc(DType::F32, 4).unwrap();
    let b = dev.alloc(DType::F32, 4).unwrap();
    let c = dev.alloc(DType::F32, 4).unwrap();
    let mut mm = Matmul::new(a, b, c, 2, 2, 2);
    mm.trans_b = true;
    let e = dev.launch_glsl_gemm(&mm).unwrap_err().to_string();
    assert!(
        e.contains("without transposes") && e.contains("Kernel::Matmul"),
        "{e}"
    );
}
