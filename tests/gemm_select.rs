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

/// Every CPU block against the table's pick, bit for bit, on shapes that are multiples
/// of no block, with long K (where a block with few tiles would once have split K
/// differently from the table's), every transpose, f32 and both f16 paths.
#[test]
fn every_cpu_block_gives_the_same_bits() {
    // 32 x 12 takes seconds to build on lavapipe: two cases are enough for it.
    let small = [
        MatmulVariant::Cpu { tm: 4, nv: 1 },
        MatmulVariant::Cpu { tm: 8, nv: 1 },
        MatmulVariant::Cpu { tm: 16, nv: 2 },
    ];
    let big = MatmulVariant::Cpu { tm: 32, nv: 3 };
    let cases = [
        ((40, 100, 2048), (false, false), DType::F32, false, true),
        ((20, 70, 1024), (false, true), DType::F16, false, false),
        ((67, 131, 97), (true, false), DType::F16, false, false),
        ((35, 97, 1100), (true, true), DType::F16, true, true),
        ((3, 5, 1100), (false, false), DType::F32, false, false),
    ];
    let native = lavapipe(false);
    let packed = lavapipe(true);
    for (dims, trans, dtype, pack, with_big) in cases {
        let dev = if pack { &packed } else { &native };
        let blocks: Vec<_> = small
            .iter()
            .chain(with_big.then_some(&big))
            .copied()
            .collect();
        assert_variants_give_the_plan_bits(dev, (dims, trans, dtype, pack), &blocks);
    }
}

/// A GEMM whose planned block (32 x 12, seconds to build on lavapipe) is still building
/// on `prepare`'s workers runs a smaller block at once instead of waiting, and the big
/// block once it is built: the same bits either way.
#[test]
fn a_launch_runs_a_built_block_while_its_own_builds() {
    // Measured selection off: a block remembered from another run would stand in for
    // the table's from the start.
    let dir = std::env::temp_dir().join(format!("kiln-stand-in-{}", std::process::id()));
    let dev = lavapipe_with(&dir, true);
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
    assert_eq!(
        dev.pipeline_count(),
        3,
        "prepare builds the planned block and its stand-ins (16 x 8, itself primed, and 8 x 4)"
    );
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
    let plain = lavapipe_with(&dir, true);
    let mm2 = mm_of(&plain);
    plain.launch(&Kernel::Matmul(mm2.clone())).unwrap();
    plain.submit().unwrap();
    assert_eq!(plain.stand_in_launches(), 0);
    assert_bits_eq("unprepared device", &plain.download(mm2.c).unwrap(), &late);
    let _ = std::fs::remove_dir_all(&dir);
}

fn lavapipe_with(dir: &std::path::Path, no_tune: bool) -> WgpuDevice {
    let i = kiln::wgpu::find_adapter("vulkan").unwrap_or_else(|e| panic!("{e}"));
    WgpuDevice::open(
        i,
        &DeviceOptions {
            pipeline_cache_dir: Some(dir.to_path_buf()),
            no_tune,
            ..Default::default()
        },
    )
    .unwrap_or_else(|e| panic!("opening lavapipe: {e}"))
}

/// A product big enough to be measured whose table block (16 x 8) and smaller
/// neighbour (8 x 4) both build in well under a second.
const TUNED: (usize, usize, usize) = (256, 256, 1024);

fn tuned_product(dev: &WgpuDevice) -> HostData {
    let (m, n, k) = TUNED;
    let a = put(dev, &finite(DType::F32, m * k, 21));
    let b = put(dev, &finite(DType::F32, k * n, 22));
    let c = put(dev, &HostData::from_f32(DType::F32, &vec![0.0; m * n]));
    let mm = Matmul::new(a, b, c, m, n, k);
    dev.launch(&Kernel::Matmul(mm)).unwrap();
    dev.submit().unwrap();
    let out = dev.download(c).unwrap();
    for buf in [a, b, c] {
        dev.free(buf).unwrap();
    }
    out
}

/// The first launch of a shape times its candidates and keeps the winner, on the
/// device and on disk, where the next device of the adapter finds it; the results are
/// the table's, bit for bit. A damaged file is ignored (and replaced), and `no_tune`
/// keeps the table and writes nothing.
#[test]
fn measured_blocks_are_kept_across_devices_and_a_damaged_file_is_ignored() {
    let dir = std::env::temp_dir().join(format!("kiln-gemm-select-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let table = {
        let plain_dir = dir.join("off");
        let dev = lavapipe_with(&plain_dir, true);
        let out = tuned_product(&dev);
        assert!(dev.gemm_winners().is_empty(), "no_tune measured blocks");
        let files: Vec<_> = std::fs::read_dir(&plain_dir)
            .map(|d| d.flatten().map(|e| e.file_name()).collect())
            .unwrap_or_default();
        assert!(
            !files.iter().any(|f| f.to_string_lossy().ends_with(".gemm")),
            "no_tune wrote a selection file: {files:?}"
        );
        out
    };

    let first = lavapipe_with(&dir, false);
    assert!(first.gemm_winners().is_empty());
    assert_bits_eq(
        "measured block against the table",
        &tuned_product(&first),
        &table,
    );
    let winners = first.gemm_winners();
    assert_eq!(winners.len(), 1, "{winners:?}");
    assert!(
        winners[0].0.starts_with("256x256x1024 b1 t00"),
        "{winners:?}"
    );
    assert!(
        ["cpu16x8", "cpu8x4"].contains(&winners[0].1.as_str()),
        "{winners:?}"
    );
    let file = std::fs::read_dir(&dir)
        .unwrap()
        .flatten()
        .map(|e| e.path())
        .find(|p| p.extension().is_some_and(|e| e == "gemm"))
        .expect("a selection file");

    // The next device of the adapter starts with the winner.
    let second = lavapipe_with(&dir, false);
    assert_eq!(second.gemm_winners(), winners);
    assert_bits_eq("remembered block", &tuned_product(&second), &table);

    // A damaged file is ignored: the shape is measured again, and the file replaced.
    let mut bytes = std::fs::read(&file).unwrap();
    let last = bytes.len() - 2;
    bytes[last] ^= 0x20;
    std::fs::write(&file, &bytes).unwrap();
    let third = lavapipe_with(&dir, false);
    assert!(third.gemm_winners().is_empty(), "a damaged file was read");
    assert_bits_eq("after a damaged file", &tuned_product(&third), &table);
    assert_eq!(third.gemm_winners().len(), 1);
    assert!(kiln::wgpu::gemm_select::decode(&std::fs::read(&file).unwrap(), key_of(&file)).is_ok());
    let _ = std::fs::remove_dir_all(&dir);
}

/// The same on the raw Vulkan backend (`vk:N`, whose SPIR-V GEMM runs the blocks): the
/// first launch of the shape times its table block against the quick neighbour, on
/// the launch's own operands, runs the winner with the table's bits (the wgpu device's,
/// whose WGSL kernel the SPIR-V one sums as), and a second device starts from the
/// winners file; `no_tune` keeps the table and measures nothing.
#[test]
fn measured_blocks_are_kept_across_devices_on_vk() {
    let dir = std::env::temp_dir().join(format!("kiln-gemm-select-vk-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let table = tuned_product(&lavapipe_with(&dir.join("off"), true));
    let open = |no_tune| {
        kiln::vulkan::VkDevice::open(
            vk_index(),
            &DeviceOptions {
                pipeline_cache_dir: Some(dir.clone()),
                no_tune,
                ..Default::default()
            },
        )
        .unwrap()
    };
    let product = |dev: &kiln::vulkan::VkDevice| {
        let (m, n, k) = TUNED;
        let a = put(dev, &finite(DType::F32, m * k, 21));
        let b = put(dev, &finite(DType::F32, k * n, 22));
        let c = put(dev, &HostData::from_f32(DType::F32, &vec![0.0; m * n]));
        let mm = Matmul::new(a, b, c, m, n, k);
        assert!(matches!(
            dev.gemm_route(&mm).unwrap(),
            kiln::vulkan::GemmRoute::Spirv(_)
        ));
        let before = dev.gemm_selected(&mm);
        dev.launch(&Kernel::Matmul(mm.clone())).unwrap();
        dev.submit().unwrap();
        let out = dev.download(c).unwrap();
        (out, before, dev.gemm_selected(&mm))
    };
    let off = open(true);
    let (out, _, chosen) = product(&off);
    assert_bits_eq("vk table block", &out, &table);
    assert_eq!(chosen, None, "no_tune measured blocks");

    let first = open(false);
    let (out, before, chosen) = product(&first);
    assert_eq!(before, None);
    assert_bits_eq("vk measured block against the table", &out, &table);
    let chosen = chosen.expect("the first launch measured nothing");
    assert!(
        ["cpu16x8", "cpu8x4"].contains(&chosen.name().as_str()),
        "{chosen:?}"
    );
    assert_eq!(
        first.gemm_launches(),
        (1, 0),
        "timed runs counted as launches"
    );
    let second = open(false);
    let (out, remembered, _) = product(&second);
    assert_eq!(remembered, Some(chosen), "the winners file was not read");
    assert_bits_eq("vk remembered block", &out, &table);
    let _ = std::fs::remove_dir_all(&dir);
}

/// At 1024³-class products the table's block is the 64-row one, whose one neighbour on
/// the ladder (32 rows) is slow to build, so once nothing was measured there. Now its
/// first launch asks for the neighbour in the background (its machine code compiled on
/// the primer), the table's block runs meanwhile, and a launch after it is built times
/// both and keeps the faster: the shape is decided by measurement, with the same bits.
#[test]
fn a_shape_whose_one_neighbour_is_slow_to_build_is_measured_once_it_is_built() {
    let dir = std::env::temp_dir().join(format!("kiln-slow-neighbour-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let dev = lavapipe_with(&dir, false);
    // 2^30 multiply-adds: the table's 64 x 16 block.
    let (m, n, k) = (256, 512, 8192);
    let a = put(&dev, &finite(DType::F32, m * k, 31));
    let b = put(&dev, &finite(DType::F32, k * n, 32));
    let c = put(&dev, &HostData::from_f32(DType::F32, &vec![0.0; m * n]));
    let mm = Matmul::new(a, b, c, m, n, k).transpose(false, true);
    assert_eq!(
        kiln::wgpu::plan_matmul(&mm, dev.caps(), None)
            .unwrap()
            .variant,
        MatmulVariant::Cpu { tm: 64, nv: 4 },
        "the shape must plan the 64-row block"
    );
    let run = || {
        dev.launch(&Kernel::Matmul(mm.clone())).unwrap();
        dev.submit().unwrap();
        dev.download(c).unwrap()
    };
    let before = dev.pipeline_count();
    let first = run();
    assert_eq!(
        dev.gemm_selected(&mm),
        None,
        "measured before its neighbour was built"
    );
    dev.wait_for_builds();
    assert_eq!(
        dev.pipeline_count(),
        before + 2,
        "the 64-row block and, in the background, its 32-row neighbour"
    );
    let second = run();
    let chosen = dev.gemm_selected(&mm);
    assert!(
        matches!(chosen, Some(MatmulVariant::Cpu { tm: 32 | 64, .. })),
        "nothing measured once the neighbour was built: {chosen:?}"
    );
    assert_bits_eq("measured block against the table's", &second, &first);
    let _ = std::fs::remove_dir_all(&dir);
}

/// The key a selection file is written for, from its name.
fn key_of(file: &std::path::Path) -> u64 {
    let stem = file.file_stem().unwrap().to_string_lossy();
    u64::from_str_radix(&stem, 16).unwrap()
}
