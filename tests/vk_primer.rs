//! `vk:N` on lavapipe runs a big GEMM block's or attention pass's first run, which
//! compiles its machine code, on a primer device of its own
//! (backends/vulkan/src/primer.rs), and a stand-in meanwhile. Mesa's shader cache on
//! disk gets an entry per compiled shader, so the training device's first run of a
//! primed kernel must add none; a GEMM nobody primed still adds one, which shows the
//! count tells the two apart. Its own binary:
//! the cache directory is set for the whole process before any device opens.

mod common;

use std::path::PathBuf;

use common::*;
use kiln::engine::{Device, Kernel};
use kiln::vulkan::{GemmRoute, VkDevice};
use kiln::wgpu::DeviceOptions;

fn scratch(name: &str) -> PathBuf {
    scratch_dir("vk-primer", name)
}

#[test]
fn big_gemm_blocks_and_attention_passes_first_run_on_the_primer_and_stand_ins_match_bits() {
    let mesa = scratch("mesa");
    // Set before any device opens in this process (Mesa reads them per device).
    std::env::set_var("MESA_SHADER_CACHE_DIR", &mesa);
    std::env::remove_var("MESA_SHADER_CACHE_DISABLE");
    let index = kiln::vulkan::physical_devices()
        .into_iter()
        .find(|d| d.caps.device_type == "cpu")
        .expect("lavapipe (mesa-vulkan-drivers) must be installed: bash scripts/setup.sh")
        .index;
    let opts = DeviceOptions {
        pipeline_cache_dir: Some(scratch("pipelines")),
        ..DeviceOptions::default()
    };
    let dev = VkDevice::open(index, &opts).unwrap();
    // 2^27 multiply-adds: the planner's 32-row block, one of those that get a primer.
    let shape = (512, 512, 512);
    let (big, c) = f32_gemm(&dev, shape);
    let Kernel::Matmul(mm) = &big else {
        unreachable!()
    };
    let GemmRoute::Spirv(planned) = dev.gemm_route(mm).unwrap() else {
        panic!("the test needs the SPIR-V GEMM")
    };
    assert!(
        planned.tm >= 32,
        "the test needs a big block, the planner chose {planned:?}"
    );

    // Held, the primer has not run the block: the launch runs a stand-in.
    dev.hold_primer(true);
    dev.prepare(std::slice::from_ref(&big)).unwrap();
    dev.launch(&big).unwrap();
    let stood_in = dev.download(c).unwrap();
    assert_eq!(dev.gemm_stand_ins(), 1, "the launch ran a stand-in block");
    assert_eq!(dev.primed_blocks(), 0);
    // The block being primed counts as a pipeline being compiled, which is what
    // `kiln bench` waits for before it times (else it times the stand-in).
    let (done, queued) = kiln::engine::device::compiling::snapshot();
    assert_eq!(
        queued - done,
        1,
        "the queued block is not counted as compiling"
    );

    dev.hold_primer(false);
    dev.wait_for_primer();
    assert_eq!(dev.primed_blocks(), 1, "the big block ran on the primer");
    let (done, queued) = kiln::engine::device::compiling::snapshot();
    assert_eq!(
        done, queued,
        "the primed block is still counted as compiling"
    );
    let primed = settled_mesa_entries(&mesa);
    assert!(primed >= 1, "the primer's run left nothing in Mesa's cache");

    dev.launch(&big).unwrap();
    let got = dev.download(c).unwrap();
    assert_eq!(dev.gemm_stand_ins(), 1, "the primed block itself ran");
    assert_eq!(
        settled_mesa_entries(&mesa),
        primed,
        "the device's first run of the primed block compiled it again"
    );
    // The stand-in sums every output as the big block does.
    assert_bits_eq("stand-in vs primed block", &stood_in, &got);
    assert!(got.to_f32().iter().any(|&x| x != 0.0));

    // The same block on operands of other sizes reads A and B through texel views
    // whose sizes differ from those above in everything lavapipe's shader key could
    // hold (the views of 512 x 512 operands are a power of two with bits 8-15 clear,
    // these are neither): the block built once serves them, nothing new is compiled.
    let (other, c_other) = f32_gemm(&dev, (520, 512, 520));
    let Kernel::Matmul(other_mm) = &other else {
        unreachable!()
    };
    let GemmRoute::Spirv(same) = dev.gemm_route(other_mm).unwrap() else {
        panic!("the test needs the SPIR-V GEMM")
    };
    assert!(
        planned.texel,
        "lavapipe reads A and B as texels: {planned:?}"
    );
    assert_eq!(same.pipeline_key(), planned.pipeline_key());
    dev.launch(&other).unwrap();
    dev.download(c_other).unwrap();
    assert_eq!(dev.gemm_stand_ins(), 1, "the primed block ran");
    assert_eq!(
        settled_mesa_entries(&mesa),
        primed,
        "texel views of other sizes compiled the block again"
    );

    // The same product on a device without a primer, which runs the planned block at
    // once: the same bits.
    let plain = VkDevice::open_unprimed(
        index,
        &DeviceOptions {
            no_pipeline_cache: true,
            ..DeviceOptions::default()
        },
    )
    .unwrap();
    let (big2, c2) = f32_gemm(&plain, shape);
    plain.launch(&big2).unwrap();
    assert_eq!(plain.gemm_stand_ins(), 0);
    assert_bits_eq("primed block", &got, &plain.download(c2).unwrap());

    // A block nobody primed compiles at its first run: a new entry.
    let (small, c_small) = f32_gemm(&dev, (8, 16, 32));
    dev.launch(&small).unwrap();
    dev.download(c_small).unwrap();
    assert!(
        settled_mesa_entries(&mesa) > primed,
        "a first run that compiled left no entry: the count cannot tell"
    );

    // The fused attention's passes with 8 rows per lane, forward and backward: one
    // row per lane stands in until the primer has run them.
    dev.hold_primer(true);
    // 2 heads of 40 rows at d 32: the shape lavapipe's plan gives 8 rows per lane.
    let (fwd, bwd, outs) = causal_attention(&dev, (2, 40, 32));
    dev.launch(&fwd).unwrap();
    dev.launch(&bwd).unwrap();
    let stood_in: Vec<_> = outs.iter().map(|&b| dev.download(b).unwrap()).collect();
    assert_eq!(
        dev.gemm_stand_ins(),
        3,
        "forward and backward ran stand-ins"
    );
    dev.hold_primer(false);
    dev.wait_for_primer();
    assert_eq!(
        dev.primed_blocks(),
        3,
        "both attention kernels ran on the primer"
    );
    let primed = settled_mesa_entries(&mesa);
    dev.launch(&fwd).unwrap();
    dev.launch(&bwd).unwrap();
    let got: Vec<_> = outs.iter().map(|&b| dev.download(b).unwrap()).collect();
    assert_eq!(dev.gemm_stand_ins(), 3, "the primed passes themselves ran");
    assert_eq!(
        settled_mesa_entries(&mesa),
        primed,
        "the device's first run of the primed attention passes compiled them again"
    );
    for (i, (a, b)) in stood_in.iter().zip(&got).enumerate() {
        assert_bits_eq(&format!("attention output {i}: stand-in vs primed"), a, b);
    }

    // Dropping the device while its primer runs a block (B transposed: a pipeline not
    // primed yet) waits for the block: a thread left inside lavapipe's LLVM when the
    // process exits can abort it after every test has passed ("LLVM ERROR: Do not know
    // how to split the result of this operator!").
    drop(plain);
    let (mut nt, c_nt) = f32_gemm(&dev, shape);
    let Kernel::Matmul(mm) = &mut nt else {
        unreachable!()
    };
    mm.trans_b = true;
    dev.launch(&nt).unwrap();
    dev.download(c_nt).unwrap();
    assert_eq!(
        dev.gemm_stand_ins(),
        4,
        "the transposed block was being primed"
    );
    assert!(primer_threads() >= 1);
    drop(dev);
    assert_eq!(
        primer_threads(),
        0,
        "the primer's threads outlived its device"
    );
    std::fs::remove_dir_all(&mesa).ok();
}

/// Threads of this process named as the primer's worker (Linux's /proc): the worker and
/// the driver's threads for its device, which inherit its name.
fn primer_threads() -> usize {
    std::fs::read_dir("/proc/self/task")
        .unwrap()
        .filter(|t| {
            let comm = std::fs::read_to_string(t.as_ref().unwrap().path().join("comm"));
            comm.unwrap().trim() == "kiln vk primer"
        })
        .count()
}
