//! GEMM selection on CPU-class adapters (lavapipe): every register block the planner
//! may run for a shape gives bit-identical results, so a launch may run a block other
//! than the table's (a cheaper one while the best still compiles, or a measured
//! faster one) without changing a bit of training.

mod common;

use common::*;
use kiln::engine::{DType, Device, HostData, Kernel, Matmul};
use kiln::wgpu::{DeviceOptions, MatmulVariant, WgpuDevice};

fn lavapipe(disable_f16: bool) -> WgpuDevice {
    let i = kiln::wgpu::find_adapter("vulkan").unwrap_or_else(|e| panic!("{e}"));
    WgpuDevice::open(
        i,
        &DeviceOptions {
            disable_f16,
            ..Default::default()
        },
    )
    .unwrap_or_else(|e| panic!("opening lavapipe: {e}"))
}

/// C of `m x n x k` (transposes `trans`, all operands `dtype`) on `dev`, with the
/// planner's choice (`None`) or a pinned block.
fn product(
    dev: &WgpuDevice,
    (m, n, k): (usize, usize, usize),
    trans: (bool, bool),
    dtype: DType,
    variant: Option<MatmulVariant>,
) -> HostData {
    let a = put(dev, &finite(dtype, m * k, 1 + m as u64));
    let b = put(dev, &finite(dtype, k * n, 2 + n as u64));
    let c = put(dev, &HostData::from_f32(dtype, &vec![f32::NAN; m * n]));
    let mm = Matmul::new(a, b, c, m, n, k).transpose(trans.0, trans.1);
    dev.launch_matmul(&mm, variant)
        .unwrap_or_else(|e| panic!("{m}x{n}x{k} {variant:?}: {e}"));
    dev.submit().unwrap();
    let out = dev.download(c).unwrap();
    for buf in [a, b, c] {
        dev.free(buf).unwrap();
    }
    out
}

/// Every CPU block against the table's pick, bit for bit, on shapes that are multiples
/// of no block, with long K (where a block with few tiles would once have split K
/// differently from the table's), every transpose, f32 and both f16 paths.
#[test]
fn every_cpu_block_gives_the_same_bits() {
    let blocks = [
        MatmulVariant::Cpu { tm: 4, nv: 1 },
        MatmulVariant::Cpu { tm: 8, nv: 1 },
        MatmulVariant::Cpu { tm: 16, nv: 2 },
        MatmulVariant::Cpu { tm: 32, nv: 3 },
    ];
    let cases = [
        ((40, 100, 2048), (false, false), DType::F32, false),
        ((33, 65, 1024), (true, false), DType::F32, false),
        ((67, 131, 97), (false, true), DType::F16, false),
        ((35, 97, 1100), (true, true), DType::F16, true),
        ((3, 5, 1100), (false, false), DType::F32, false),
    ];
    let native = lavapipe(false);
    let packed = lavapipe(true);
    for (dims, trans, dtype, pack) in cases {
        let dev = if pack { &packed } else { &native };
        let want = product(dev, dims, trans, dtype, None);
        for v in blocks {
            let got = product(dev, dims, trans, dtype, Some(v));
            assert_bits_eq(
                &format!(
                    "{} on {dims:?} {trans:?} {dtype:?} (packed f16: {pack})",
                    v.name()
                ),
                &got,
                &want,
            );
        }
    }
}

/// A GEMM whose planned block (32 x 12, seconds to build on lavapipe) is still building
/// on `prepare`'s workers runs a smaller block at once instead of waiting, and the big
/// block once it is built: the same bits either way.
#[test]
fn a_launch_runs_a_built_block_while_its_own_builds() {
    let dev = lavapipe(false);
    let (m, n, k) = (256, 512, 1024);
    let mm_of = |dev: &WgpuDevice| {
        let a = put(dev, &finite(DType::F32, m * k, 11));
        let b = put(dev, &finite(DType::F32, k * n, 12));
        let c = put(dev, &HostData::from_f32(DType::F32, &vec![0.0; m * n]));
        Matmul::new(a, b, c, m, n, k).transpose(false, true)
    };
    let mm = mm_of(&dev);
    assert_eq!(
        kiln::wgpu::plan_matmul(&mm, dev.caps(), None)
            .unwrap()
            .variant,
        MatmulVariant::Cpu { tm: 32, nv: 3 },
        "the shape must plan the slow-to-build block"
    );
    let run = |dev: &WgpuDevice| {
        dev.launch(&Kernel::Matmul(mm.clone())).unwrap();
        dev.submit().unwrap();
        dev.download(mm.c).unwrap()
    };
    dev.prepare(&[Kernel::Matmul(mm.clone())]).unwrap();
    let early = run(&dev);
    assert_eq!(
        dev.stand_in_launches(),
        1,
        "the launch did not run a stand-in"
    );
    dev.wait_for_builds();
    let late = run(&dev);
    assert_eq!(dev.stand_in_launches(), 1, "the built block was not used");
    assert_bits_eq("stand-in against the planned block", &early, &late);
    // And a device that never prepared runs the planned block at once.
    let plain = lavapipe(false);
    let mm2 = mm_of(&plain);
    plain.launch(&Kernel::Matmul(mm2.clone())).unwrap();
    plain.submit().unwrap();
    assert_eq!(plain.stand_in_launches(), 0);
    assert_bits_eq("unprepared device", &plain.download(mm2.c).unwrap(), &late);
}
