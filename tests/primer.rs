//! Lavapipe compiles a pipeline's machine code when it first runs it, on the device's
//! one queue thread, and keeps it in Mesa's shader cache on disk, writing an entry only
//! for what it compiled. A big GEMM block's first run happens on a second device of the
//! same adapter instead (the compile workers' primer), so the training device's own
//! first run must compile nothing: no new cache entry. A GEMM nobody primed still adds
//! one, which shows the count tells the two apart. The fused attention passes with
//! several rows per lane are primed alike, one row per lane standing in (same bits).
//! Its own binary: the cache directory
//! is set for the whole process before any device opens.

mod common;

use std::path::PathBuf;

use common::*;
use kiln::engine::{Device, Kernel};
use kiln::wgpu::{find_adapter, plan_matmul, DeviceOptions, MatmulVariant, WgpuDevice};

fn scratch(name: &str) -> PathBuf {
    scratch_dir("primer", name)
}

#[test]
fn big_gemm_blocks_and_attention_passes_first_run_on_the_primer_and_the_device_compiles_them_no_more(
) {
    let mesa = scratch("mesa");
    // Set before any device opens in this process (Mesa reads them per device).
    std::env::set_var("MESA_SHADER_CACHE_DIR", &mesa);
    std::env::remove_var("MESA_SHADER_CACHE_DISABLE");
    let adapter = find_adapter("vulkan").unwrap();
    let opts = DeviceOptions {
        pipeline_cache_dir: Some(scratch("pipelines")),
        // Timing candidates would first-run other blocks on the device.
        no_tune: true,
        ..DeviceOptions::default()
    };
    let dev = WgpuDevice::open(adapter, &opts).unwrap();
    // 2^27 multiply-adds: the planner's 32-row block, one of those that get a primer.
    let shape = (512, 512, 512);
    let (big, c) = f32_gemm(&dev, shape);
    let Kernel::Matmul(mm) = &big else {
        unreachable!()
    };
    let planned = plan_matmul(mm, dev.caps(), None).unwrap().variant;
    assert!(
        matches!(planned, MatmulVariant::Cpu { tm, .. } if tm >= 32),
        "the test needs a big block, the planner chose {planned:?}"
    );
    dev.prepare(std::slice::from_ref(&big)).unwrap();
    dev.wait_for_builds();
    assert_eq!(
        dev.primed_pipelines(),
        2,
        "the big block and its 16 x 8 stand-in ran on the primer"
    );
    let primed = settled_mesa_entries(&mesa);
    assert!(primed >= 1, "the primer's run left nothing in Mesa's cache");

    dev.launch(&big).unwrap();
    let got = dev.download(c).unwrap();
    assert_eq!(
        settled_mesa_entries(&mesa),
        primed,
        "the device's first run of the primed block compiled it again"
    );

    // The same product on a device that builds it at first use, without a primer:
    // the same block, so the same bits.
    let plain = WgpuDevice::open(
        adapter,
        &DeviceOptions {
            no_pipeline_cache: true,
            no_tune: true,
            ..DeviceOptions::default()
        },
    )
    .unwrap();
    let (big2, c2) = f32_gemm(&plain, shape);
    plain.launch(&big2).unwrap();
    assert_bits_eq("primed block", &got, &plain.download(c2).unwrap());
    assert!(got.to_f32().iter().any(|&x| x != 0.0));

    // A block nobody primed compiles at its first run: a new entry.
    let (small, c_small) = f32_gemm(&dev, (8, 16, 32));
    dev.launch(&small).unwrap();
    dev.download(c_small).unwrap();
    assert!(
        settled_mesa_entries(&mesa) > primed,
        "a first run that compiled left no entry: the count cannot tell"
    );

    // Fused attention with several rows per lane (4 at d = 64 on lavapipe): while the
    // primer is held, launches run one row per lane, with the same bits as the planned
    // passes once these have first run on the primer.
    let fetch = |dev: &WgpuDevice, outs: &[kiln::engine::Buffer]| -> Vec<kiln::engine::HostData> {
        outs.iter().map(|&b| dev.download(b).unwrap()).collect()
    };
    let (fwd, bwd, outs) = causal_attention(&dev, (3, 37, 64));
    let kernels = [fwd, bwd];
    let primed_before = dev.primed_pipelines();
    let stand_ins_before = dev.stand_in_launches();
    dev.hold_primer(true);
    dev.prepare(&kernels).unwrap();
    for k in &kernels {
        dev.launch(k).unwrap();
    }
    let stood_in = fetch(&dev, &outs);
    assert_eq!(
        dev.stand_in_launches() - stand_ins_before,
        2,
        "the forward and the backward ran one row per lane while the primer was held"
    );
    dev.hold_primer(false);
    dev.wait_for_builds();
    assert_eq!(
        dev.primed_pipelines() - primed_before,
        3,
        "the forward, dq and dk/dv passes with 4 rows per lane first ran on the primer"
    );
    let before_planned = settled_mesa_entries(&mesa);
    let stand_ins_after = dev.stand_in_launches();
    for k in &kernels {
        dev.launch(k).unwrap();
    }
    let planned = fetch(&dev, &outs);
    assert_eq!(
        dev.stand_in_launches(),
        stand_ins_after,
        "the planned passes ran"
    );
    assert_eq!(
        settled_mesa_entries(&mesa),
        before_planned,
        "the planned passes' first run compiled them again"
    );
    let (plain_fwd, plain_bwd, plain_outs) = causal_attention(&plain, (3, 37, 64));
    for k in [&plain_fwd, &plain_bwd] {
        plain.launch(k).unwrap();
    }
    let unprimed = fetch(&plain, &plain_outs);
    for (i, name) in ["out", "lse", "dq", "dk", "dv"].iter().enumerate() {
        assert_bits_eq(
            &format!("attention {name}, stand-in"),
            &stood_in[i],
            &planned[i],
        );
        assert_bits_eq(
            &format!("attention {name}, unprimed"),
            &unprimed[i],
            &planned[i],
        );
    }
    assert!(planned[2].to_f32().iter().any(|&x| x != 0.0));
    std::fs::remove_dir_all(&mesa).ok();
}
