//! The raw Vulkan backend's hand-written GLSL GEMM (`shaders/vulkan/gemm_f32.comp`)
//! computes what the CPU reference does (tests/spirv.rs checks that every committed
//! module is what its source compiles to and passes `spirv-val`).

mod common;

use common::*;
use kiln::engine::{DType, Device, HostData, Kernel, Matmul};

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
