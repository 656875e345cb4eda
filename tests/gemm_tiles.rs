//! Measured tiles on GPU-class adapters, tested on lavapipe planned for as a GPU
//! (`KILN_PLAN_AS_GPU=1`, set by this test binary for its own process before any device
//! opens): the tiled kernel runs as on a GPU, every tile of the GPU ladder gives the
//! table's bits, and a shape's first launch times the tiles and keeps the winner on
//! the device and on disk, apart from the CPU-class blocks of the same adapter.

mod common;

use common::*;
use kiln::engine::{DType, Device, HostData, Kernel, Matmul};
use kiln::wgpu::{DeviceOptions, MatmulVariant, WgpuDevice, GPU_LADDER};

/// The test Vulkan adapter through wgpu (lavapipe here, `KILN_TEST_VULKAN` on a machine
/// with a GPU: scripts/gpu-check.sh), planned for as a GPU. Every test opens its devices
/// here, so the variable is set once, before any device reads it.
fn lavapipe_as_gpu(options: DeviceOptions) -> WgpuDevice {
    static SET: std::sync::Once = std::sync::Once::new();
    SET.call_once(|| std::env::set_var(kiln::wgpu::PLAN_AS_GPU_ENV, "1"));
    let dev = WgpuDevice::open(adapter_index("vulkan"), &options)
        .unwrap_or_else(|e| panic!("opening the Vulkan adapter: {e}"));
    assert_ne!(
        dev.caps().device_type,
        "cpu",
        "{}: a CPU driver not planned for as a GPU (the switch was not read)",
        dev.caps().name
    );
    dev
}

fn with_cache(dir: &std::path::Path, no_tune: bool) -> WgpuDevice {
    lavapipe_as_gpu(DeviceOptions {
        pipeline_cache_dir: Some(dir.to_path_buf()),
        no_tune,
        ..Default::default()
    })
}

/// Every tile a selection may pick against the table's, bit for bit: shapes that are
/// multiples of no tile, a long K that splits (the tiles split it as the table's tile
/// does), every transpose, f32 and both f16 paths. All seven tiles on the split f32
/// case, three on the others (each tile is a pipeline to build on lavapipe).
#[test]
fn every_gpu_tile_gives_the_table_bits() {
    let native = lavapipe_as_gpu(DeviceOptions {
        no_tune: true,
        ..Default::default()
    });
    let packed = lavapipe_as_gpu(DeviceOptions {
        no_tune: true,
        disable_f16: true,
        ..Default::default()
    });
    let some = [GPU_LADDER[0], GPU_LADDER[2], GPU_LADDER[6]];
    let cases: [(_, _, _, bool, &[MatmulVariant]); 4] = [
        (
            (40, 100, 2048),
            (false, false),
            DType::F32,
            false,
            &GPU_LADDER,
        ),
        ((67, 131, 97), (true, false), DType::F16, false, &some),
        ((35, 97, 1100), (true, true), DType::F16, true, &some),
        ((3, 5, 1100), (false, true), DType::F32, false, &some),
    ];
    for (dims, trans, dtype, pack, tiles) in cases {
        let dev = if pack { &packed } else { &native };
        assert_table_tile(dev, dims, trans);
        assert_variants_give_the_plan_bits(dev, (dims, trans, dtype, pack), tiles);
    }
}

/// The planner's tile for the shape is the table's (a GPU's, not a CPU block).
fn assert_table_tile(dev: &WgpuDevice, (m, n, k): (usize, usize, usize), trans: (bool, bool)) {
    let buf = |len| dev.alloc(DType::F32, len).unwrap();
    let mm = Matmul::new(buf(m * k), buf(k * n), buf(m * n), m, n, k).transpose(trans.0, trans.1);
    let table = kiln::wgpu::plan_matmul(&mm, dev.caps(), None).unwrap();
    assert_eq!(table.variant, GPU_LADDER[3], "the table's tile on a GPU");
    for b in mm.buffers() {
        dev.free(b).unwrap();
    }
}

/// The first launch of a shape big enough to repay timing measures the tiles and
/// keeps a tile of the ladder as the shape's winner; the result is the table's, bit
/// for bit; the next device of the adapter starts with the winner from the file.
#[test]
fn a_gpu_shape_is_measured_once_and_remembered() {
    let dir = std::env::temp_dir().join(format!("kiln-gemm-tiles-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    // 2^26 multiply-adds: the least the selection times.
    let dims = (256, 256, 1024);
    let plain = with_cache(&dir.join("off"), true);
    assert_table_tile(&plain, dims, (false, false));
    let table = pinned_product(&plain, dims, (false, false), DType::F32, None);

    let launch = |dev: &WgpuDevice| {
        let (m, n, k) = dims;
        let a = put(dev, &finite(DType::F32, m * k, 1 + m as u64));
        let b = put(dev, &finite(DType::F32, k * n, 2 + n as u64));
        let c = put(dev, &HostData::from_f32(DType::F32, &vec![f32::NAN; m * n]));
        let mm = Matmul::new(a, b, c, m, n, k);
        dev.launch(&Kernel::Matmul(mm.clone())).unwrap();
        dev.submit().unwrap();
        (dev.download(c).unwrap(), dev.gemm_selected(&mm))
    };
    let first = with_cache(&dir, false);
    assert!(first.gemm_selection_on());
    let (out, chosen) = launch(&first);
    assert_bits_eq("measured tile against the table's", &out, &table);
    let chosen = chosen.expect("the first launch measured nothing");
    assert!(GPU_LADDER.contains(&chosen), "{chosen:?}");
    let winners = first.gemm_winners();
    assert_eq!(winners.len(), 1, "{winners:?}");
    assert!(
        winners[0].0.starts_with("256x256x1024 b1 t00"),
        "{winners:?}"
    );

    let second = with_cache(&dir, false);
    assert_eq!(second.gemm_winners(), winners, "the file was not read");
    let (again, remembered) = launch(&second);
    assert_eq!(remembered, Some(chosen));
    assert_bits_eq("remembered tile", &again, &table);
    let _ = std::fs::remove_dir_all(&dir);
}

/// The same on the raw Vulkan backend (`vk:N`), whose GLSL twin of the tiled kernel
/// runs the shape: the first launch times the tiles on the launch's own operands and
/// runs the winner (the table's bits, as the wgpu device gives them), and a second
/// device of the adapter starts from the winners file.
#[test]
fn a_gpu_shape_is_measured_once_and_remembered_on_vk() {
    let dir = std::env::temp_dir().join(format!("kiln-gemm-tiles-vk-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let dims = (256, 256, 1024);
    // The table's tile, on wgpu (the twin sums as the WGSL kernel does).
    let wgpu = with_cache(&dir.join("off"), true);
    let table = pinned_product(&wgpu, dims, (false, false), DType::F32, None);
    let open = || {
        let _ = lavapipe_as_gpu(DeviceOptions {
            no_tune: true,
            ..Default::default()
        });
        kiln::vulkan::VkDevice::open(
            vk_index(),
            &DeviceOptions {
                pipeline_cache_dir: Some(dir.clone()),
                ..Default::default()
            },
        )
        .unwrap()
    };
    let launch = |dev: &kiln::vulkan::VkDevice| {
        let (m, n, k) = dims;
        let a = put(dev, &finite(DType::F32, m * k, 1 + m as u64));
        let b = put(dev, &finite(DType::F32, k * n, 2 + n as u64));
        let c = put(dev, &HostData::from_f32(DType::F32, &vec![f32::NAN; m * n]));
        let mm = Matmul::new(a, b, c, m, n, k);
        let route = dev.gemm_route(&mm).unwrap();
        assert!(
            matches!(route, kiln::vulkan::GemmRoute::SpirvGpu(_)),
            "not the tiled kernel's twin: {route:?}"
        );
        let remembered = dev.gemm_selected(&mm);
        dev.launch(&Kernel::Matmul(mm.clone())).unwrap();
        dev.submit().unwrap();
        (dev.download(c).unwrap(), remembered, dev.gemm_selected(&mm))
    };
    let first = open();
    assert!(first.gemm_selection_on());
    let (out, before, chosen) = launch(&first);
    assert_eq!(before, None);
    assert_bits_eq("vk: measured tile against the table's", &out, &table);
    let chosen = chosen.expect("the first launch measured nothing");
    assert!(GPU_LADDER.contains(&chosen), "{chosen:?}");
    // One launch recorded, on the SPIR-V route: the timed runs are not launches.
    assert_eq!(first.gemm_launches(), (1, 0));

    let second = open();
    let (again, remembered, _) = launch(&second);
    assert_eq!(remembered, Some(chosen), "the winners file was not read");
    assert_bits_eq("vk: remembered tile", &again, &table);
    let _ = std::fs::remove_dir_all(&dir);
}
