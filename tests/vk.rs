//! The raw Vulkan backend (`vk:N`, kiln-vulkan) against the wgpu backend on the same
//! Vulkan device, and its errors. (The kernel tests run on it through
//! `common::gpu_paths`.)

mod common;

use common::*;
use kiln::engine::kernels::{Axpy, Reduce};
use kiln::engine::models::gpt::GptConfig;
use kiln::engine::models::MicroBatch;
use kiln::engine::{DType, Device, Error, Matmul};
use kiln::{open_device, DeviceSpec};

/// Steps each backend trains the GPT (the issue's 20).
const STEPS: usize = 20;

/// Trains a small GPT `steps` steps on `dev`; the losses and the final weights.
fn train(dev: &dyn Device, dtype: DType, steps: usize) -> (Vec<f32>, Vec<(String, Vec<f32>)>) {
    let cfg = GptConfig {
        n_layer: 2,
        n_head: 2,
        n_embd: 32,
        block_size: 16,
        vocab_size: 61,
        padded_vocab_size: None,
    };
    let (b, t) = (2, 16);
    let mut trainer = gpt_trainer(dev, &cfg, (b, t), dtype, 1);
    let mut rng = Rng::new(11);
    let mut losses = vec![];
    for _ in 0..steps {
        let tokens: Vec<u32> = (0..b * t + 1).map(|_| rng.next_u32() % 61).collect();
        let mb = MicroBatch::tokens(&tokens[..b * t], &tokens[1..]);
        losses.push(trainer.step(dev, &[mb]).unwrap().loss);
    }
    (losses, trainer.model.parameters(dev).unwrap())
}

/// Trains on `vk:0` and on wgpu's `vulkan` device and compares; returns the vk run's
/// GEMM launches (by the SPIR-V GEMM, by the naga path).
fn compare(dtype: DType, disable_f16: bool, loss_tol: f32, weight_tol: f32) -> (u64, u64) {
    let vk = vk_device(disable_f16);
    let wgpu = gpu("vulkan", disable_f16);
    assert_eq!(vk.caps().f16_arithmetic, !disable_f16);
    let (lv, pv) = train(&vk, dtype, STEPS);
    let (lw, pw) = train(wgpu.as_ref(), dtype, STEPS);
    for (i, (a, b)) in lv.iter().zip(&lw).enumerate() {
        assert!(
            (a - b).abs() <= loss_tol * b.abs(),
            "{dtype} step {i}: loss vk {a}, wgpu {b}"
        );
    }
    for ((name, a), (_, b)) in pv.iter().zip(&pw) {
        let worst = a
            .iter()
            .zip(b)
            .map(|(x, y)| (x - y).abs())
            .fold(0f32, f32::max);
        assert!(
            worst <= weight_tol,
            "{dtype}: {name}: weights differ by up to {worst} after {STEPS} steps"
        );
    }
    // The GPT's fused attention ran on vk's GLSL passes.
    assert!(vk.attention_launches() >= 3 * STEPS as u64);
    vk.gemm_launches()
}

#[test]
fn a_gpt_trained_on_vk_matches_the_wgpu_run_in_fp32() {
    // The same arithmetic in the same order: only the compilers' floating-point
    // contraction may differ, far inside the GPU-vs-CPU tolerances. Most GEMMs run as
    // the hand-written SPIR-V kernel there (the planner's CPU-class tiles on lavapipe),
    // whose sums are the WGSL twin's: per output, fused multiply-adds over k in order,
    // f32 throughout, one rounding to C's dtype; so the tolerances stay the same.
    let (spirv, naga) = compare(DType::F32, false, 1e-4, 1e-3);
    // Every one: the linear layers' bias is the SPIR-V GEMM's epilogue.
    assert!(
        spirv > 0 && naga == 0,
        "{spirv} SPIR-V GEMMs, {naga} naga ones"
    );
}

#[test]
fn a_gpt_trained_on_vk_matches_the_wgpu_run_in_fp16() {
    let (spirv, naga) = compare(DType::F16, false, 2e-3, 1e-2);
    // Every one: the f16 x f16 -> f32 products (the tied embedding's gradient) too, in
    // the `_mixed` modules.
    assert!(
        spirv > 0 && naga == 0,
        "{spirv} SPIR-V GEMMs, {naga} naga ones"
    );
}

#[test]
fn a_gpt_trained_on_vk_matches_the_wgpu_run_in_bf16() {
    // bf16 storage is the `_mixed` modules' (each operand's type specialized), rounded
    // to bf16 as the WGSL kernels round it; the fp16 run's tolerances hold.
    let (spirv, naga) = compare(DType::BF16, false, 2e-3, 1e-2);
    assert!(
        spirv > 0 && naga == 0,
        "{spirv} SPIR-V GEMMs, {naga} naga ones"
    );
}

/// f16 stored as packed halves and computed in f32 (a device without shaderFloat16, or
/// opened with f16 off): the SPIR-V then needs no Float16 capability.
#[test]
fn a_gpt_trained_on_vk_matches_the_wgpu_run_in_fp16_packed() {
    // The CPU-class SPIR-V GEMM has no packed path (a CPU driver's products go through
    // naga); the GPU-class twins read 16-bit operands two to a word, so on a GPU (or
    // with KILN_PLAN_AS_GPU=1) they run them.
    let (spirv, naga) = compare(DType::F16, true, 2e-3, 1e-2);
    let cpu_class = vk_device(true).caps().device_type == "cpu";
    let expected = if cpu_class {
        spirv == 0 && naga > 0
    } else {
        spirv > 0
    };
    assert!(expected, "{spirv} SPIR-V GEMMs, {naga} naga ones");
}

#[test]
fn vk_devices_are_named_and_listed() {
    assert_eq!("vk:0".parse::<DeviceSpec>().unwrap(), DeviceSpec::Vk(0));
    assert_eq!("vk".parse::<DeviceSpec>().unwrap(), DeviceSpec::Vk(0));
    assert_eq!(DeviceSpec::Vk(3).to_string(), "vk:3");
    let list = kiln::vulkan::physical_devices();
    assert!(
        !list.is_empty(),
        "no Vulkan device for kiln-vulkan: {}",
        kiln::vulkan::NO_VULKAN_HINT
    );
    let dev = open_device(&DeviceSpec::Vk(0), &Default::default()).unwrap();
    assert_eq!(dev.caps().name, list[0].caps.name);
    assert_eq!(dev.caps().backend, "vk");
}

#[test]
fn a_missing_vk_device_is_a_clear_error() {
    let n = kiln::vulkan::physical_devices().len();
    let err = open_device(&DeviceSpec::Vk(n + 7), &Default::default())
        .err()
        .expect("no such device");
    let msg = err.to_string();
    assert!(
        msg.contains(&format!("vk:{}", n + 7)) && msg.contains("kiln devices"),
        "{msg}"
    );
}

#[test]
fn an_allocation_over_the_largest_buffer_is_out_of_memory() {
    let dev = vk(false);
    let max = dev.caps().max_buffer;
    let len = (max / 4 + 1) as usize;
    match dev.alloc(DType::F32, len.min(u32::MAX as usize)) {
        Err(Error::OutOfMemory { detail, .. }) => {
            assert!(detail.contains("bytes"), "{detail}")
        }
        other => panic!("expected out of memory, got {other:?}"),
    }
    // The device still works.
    let b = put(dev.as_ref(), &data(DType::F32, 64, 1, false));
    assert_eq!(dev.download(b).unwrap().len(), 64);
}

/// A lost device (the driver reset it, or a kernel ran past its watchdog) fails the
/// call that meets it with an error that says so and what to do, and nothing after it
/// hangs or panics: every later call errs or returns, and the device drops. Lavapipe
/// never loses a device, so a test hook makes every submission fail from then on as a
/// lost device's does (`VK_ERROR_DEVICE_LOST`); downloads through the transfer path
/// (a second timeline) as well as the compute stream's.
#[test]
fn a_lost_vk_device_is_a_clear_error_and_nothing_after_it_hangs() {
    use kiln::engine::{HostData, Kernel};
    for transfer_path in [false, true] {
        let dev = vk_device(false);
        if transfer_path {
            dev.use_transfer_path_on_compute_queue().unwrap();
        }
        let x = put(&dev, &HostData::F32(vec![1.5; 100]));
        let y = put(&dev, &HostData::F32(vec![2.0; 100]));
        let axpy = Kernel::Axpy(Axpy { alpha: 2.0, x, y });
        dev.launch(&axpy).unwrap();
        assert_eq!(dev.download(y).unwrap(), HostData::F32(vec![5.0; 100]));
        // A download begun before the loss and finished after it: its data is gone.
        dev.launch(&axpy).unwrap();
        let pending = dev.begin_download(y).unwrap();
        dev.simulate_device_lost();
        dev.launch(&axpy).unwrap();
        let lost = |what: &str, e: Error| {
            let msg = e.to_string();
            assert!(
                msg.contains("device was lost")
                    && msg.contains("resume from a checkpoint")
                    && msg.contains("llvmpipe"),
                "transfer path {transfer_path}, {what}: {msg}"
            );
        };
        lost("download", dev.download(y).unwrap_err());
        lost(
            "a download begun before",
            dev.finish_download(pending).unwrap_err(),
        );
        dev.launch(&axpy).unwrap();
        lost("submit", dev.submit().unwrap_err());
        lost("wait", dev.wait().unwrap_err());
        lost("begin_download", dev.begin_download(x).unwrap_err());
        let z = dev.alloc(DType::F32, 8).unwrap();
        lost(
            "upload",
            dev.upload(z, &HostData::F32(vec![0.0; 8]))
                .and_then(|()| dev.download(z).map(drop))
                .unwrap_err(),
        );
        dev.free(z).unwrap();
    }
}

/// Runs one kernel on a `vk:0` opened with its pipeline cache in `dir`; checks the result.
fn axpy_with_cache_in(dir: &std::path::Path) {
    let dev = kiln::vulkan::VkDevice::open(
        0,
        &kiln::wgpu::DeviceOptions {
            pipeline_cache_dir: Some(dir.to_path_buf()),
            ..Default::default()
        },
    )
    .unwrap();
    let x = put(&dev, &kiln::engine::HostData::F32(vec![1.5; 100]));
    let y = put(&dev, &kiln::engine::HostData::F32(vec![2.0; 100]));
    dev.launch(&kiln::engine::Kernel::Axpy(Axpy { alpha: 2.0, x, y }))
        .unwrap();
    assert_eq!(
        dev.download(y).unwrap(),
        kiln::engine::HostData::F32(vec![5.0; 100])
    );
}

/// The one cache file in `dir`, and its bytes.
fn cache_file(dir: &std::path::Path) -> (std::path::PathBuf, Vec<u8>) {
    let files: Vec<_> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect();
    assert_eq!(files.len(), 1, "{files:?}");
    let bytes = std::fs::read(&files[0]).unwrap();
    (files[0].clone(), bytes)
}

#[test]
fn the_pipeline_cache_is_kept_on_disk_and_a_damaged_one_is_ignored() {
    let dir = std::env::temp_dir().join(format!("kiln-vk-cache-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    axpy_with_cache_in(&dir);
    let (path, good) = cache_file(&dir);
    assert!(
        good.starts_with(b"KILNPC1\n") && good.len() > 32,
        "{path:?}"
    );
    // A truncated file (a crash mid-write elsewhere, a full disk) never reaches the
    // driver: the run compiles from source and writes a whole file again.
    std::fs::write(&path, &good[..good.len() / 2]).unwrap();
    axpy_with_cache_in(&dir);
    let (_, again) = cache_file(&dir);
    assert!(again.starts_with(b"KILNPC1\n") && again.len() > 32);
    std::fs::write(&path, b"garbage").unwrap();
    axpy_with_cache_in(&dir);
    std::fs::remove_dir_all(&dir).unwrap();
}

/// One stream of more launches than a parameter arena holds (4096) is submitted in
/// parts, in order; a second round reuses the arenas the first one released.
#[test]
fn launches_past_one_parameter_arena_keep_their_order() {
    let dev = vk(false);
    let x = put(dev.as_ref(), &kiln::engine::HostData::F32(vec![1.0; 9]));
    let y = put(dev.as_ref(), &kiln::engine::HostData::F32(vec![0.0; 9]));
    for round in 1..=2 {
        for _ in 0..9000 {
            dev.launch(&kiln::engine::Kernel::Axpy(Axpy { alpha: 1.0, x, y }))
                .unwrap();
        }
        dev.submit().unwrap();
        dev.wait().unwrap();
        assert_eq!(
            dev.download(y).unwrap(),
            kiln::engine::HostData::F32(vec![9000.0 * round as f32; 9]),
            "round {round}"
        );
    }
}

/// Every SPIR-V module a GPT step builds on `vk:0` (GEMMs, fused attention, layer norm,
/// softmax and cross-entropy, embedding, AdamW, casts, reductions; fp16 training, so
/// f16 and f32 operands) passes
/// `spirv-val` for Vulkan 1.3: naga's output is valid SPIR-V, not merely accepted by
/// lavapipe.
#[test]
fn every_spirv_module_of_a_gpt_step_passes_spirv_val() {
    let dir = std::env::temp_dir().join(format!("kiln-vk-spirv-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let dev = kiln::vulkan::VkDevice::open(0, &Default::default()).unwrap();
    dev.dump_spirv_to(&dir).unwrap();
    train(&dev, DType::F16, 1);
    let files: Vec<_> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect();
    assert!(files.len() >= 20, "only {} modules", files.len());
    for f in &files {
        let out = std::process::Command::new("spirv-val")
            .args(["--target-env", "vulkan1.3"])
            .arg(f)
            .output()
            .unwrap_or_else(|e| {
                panic!("running spirv-val ({e}): install spirv-tools (scripts/setup.sh)")
            });
        assert!(
            out.status.success(),
            "{}: {}",
            f.display(),
            String::from_utf8_lossy(&out.stderr)
        );
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

/// `kiln train --devices vk:0,vulkan:0`: both host APIs in one data-parallel group,
/// through the CLI's device parsing and opening.
#[test]
fn kiln_train_runs_a_group_of_vk_and_vulkan() {
    let dir = std::env::temp_dir().join(format!("kiln-vk-train-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let model = dir.join("model.json");
    std::fs::write(
        &model,
        r#"{"n_layer": 1, "n_head": 2, "n_embd": 32, "block_size": 16, "vocab_size": 13}"#,
    )
    .unwrap();
    let config = dir.join("ds_config.json");
    std::fs::write(
        &config,
        r#"{"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1,
            "optimizer": {"type": "AdamW", "params": {"lr": 0.003}}}"#,
    )
    .unwrap();
    let report = kiln::train::train(&kiln::train::TrainOptions {
        config: Some(config),
        model: Some(model),
        devices: vec!["vk:0".into(), "vulkan:0".into()],
        out: Some(dir.join("run")),
        steps: Some(3),
        eval_every: Some(0),
        checkpoint_every: Some(0),
        ..Default::default()
    })
    .unwrap();
    assert_eq!(report.steps, 3);
    std::fs::remove_dir_all(&dir).unwrap();
}

/// `prepare` builds every pipeline a list of launches needs, so launching them builds
/// none; the results are those of unprepared launches.
#[test]
fn prepared_launches_build_no_more_pipelines() {
    let dev = kiln::vulkan::VkDevice::open(0, &Default::default()).unwrap();
    let mut rng = Rng::new(3);
    let mut small = |n: usize| {
        let v: Vec<f32> = (0..n).map(|_| rng.uniform(-1.0, 1.0)).collect();
        kiln::engine::HostData::from_f32(DType::F16, &v)
    };
    let a = put(&dev, &small(24 * 40));
    let b = put(&dev, &small(40 * 16));
    let c = dev.alloc(DType::F16, 24 * 16).unwrap();
    let sum = dev.alloc(DType::F32, 1).unwrap();
    let kernels = [
        kiln::engine::Kernel::Matmul(kiln::engine::Matmul::new(a, b, c, 24, 16, 40)),
        kiln::engine::Kernel::Reduce(Reduce {
            op: kiln::engine::ReduceOp::SumSquares,
            src: c,
            dst: sum,
        }),
    ];
    assert_eq!(dev.pipeline_count(), 0);
    dev.prepare(&kernels).unwrap();
    let prepared = dev.pipeline_count();
    assert!(prepared >= 3, "{prepared} pipelines");
    for k in &kernels {
        dev.launch(k).unwrap();
    }
    dev.submit().unwrap();
    assert_eq!(dev.pipeline_count(), prepared);
    // The same launches on the CPU reference.
    let cpu = kiln::cpu::CpuDevice::new();
    let (ca, cb) = (
        put(&cpu, &dev.download(a).unwrap()),
        put(&cpu, &dev.download(b).unwrap()),
    );
    let cc = cpu.alloc(DType::F16, 24 * 16).unwrap();
    cpu.launch(&kiln::engine::Kernel::Matmul(kiln::engine::Matmul::new(
        ca, cb, cc, 24, 16, 40,
    )))
    .unwrap();
    let (got, want) = (
        dev.download(c).unwrap().to_f32(),
        cpu.download(cc).unwrap().to_f32(),
    );
    for (g, w) in got.iter().zip(&want) {
        assert!((g - w).abs() <= 2e-2 * w.abs().max(1.0), "{g} vs {w}");
    }
}

/// The cooperative-matrix GEMM against the CPU reference, on `vk:0` (or the device
/// `KILN_TEST_VK` names). Where the device selected it, every aligned f16 product below
/// runs there (route and counter say so) and matches the CPU, and a product off its
/// tile takes another GEMM, saying why. Where it did not (lavapipe: no
/// VK_KHR_cooperative_matrix), the route says "no cooperative matrix", nothing runs
/// there, and the same products still match the CPU through the other GEMMs; with
/// `KILN_TEST_COOPMAT=1` (scripts/gpu-check.sh on a GPU that should have it) that is a
/// failure instead.
#[test]
fn the_cooperative_matrix_gemm_matches_the_cpu_where_the_device_has_it() {
    use kiln::engine::{HostData, Kernel, Matmul};
    let dev = vk_device(false);
    let cpu = kiln::cpu::CpuDevice::new();
    let coop = dev.cooperative_matrix();
    let demanded = std::env::var("KILN_TEST_COOPMAT").is_ok_and(|v| v == "1");
    if let Err(why) = &coop {
        assert!(
            !demanded,
            "KILN_TEST_COOPMAT=1, but {} has no cooperative-matrix GEMM: {why}",
            dev.caps().name
        );
    }
    // Products in whole tiles of the selected shape (16x16x16 where there is none).
    let (tm, tn, tk) = coop.as_ref().map_or((16, 16, 16), |c| {
        (c.shape.m as usize, c.shape.n as usize, c.shape.k as usize)
    });
    let mut rng = Rng::new(13);
    let mut cases = 0;
    for c_dtype in [DType::F32, DType::F16] {
        for (ta, tb) in [(false, false), (false, true), (true, false), (true, true)] {
            for (mult, batch, scale) in [((1, 1, 1), 1, (1.0, 0.0)), ((3, 2, 4), 2, (0.5, -0.75))] {
                let (m, n, k) = (tm * mult.0, tn * mult.1, tk * mult.2);
                let mm = Matmul::new(
                    kiln::engine::Buffer {
                        id: 0,
                        dtype: DType::F16,
                        len: 0,
                    },
                    kiln::engine::Buffer {
                        id: 0,
                        dtype: DType::F16,
                        len: 0,
                    },
                    kiln::engine::Buffer {
                        id: 0,
                        dtype: c_dtype,
                        len: 0,
                    },
                    m,
                    n,
                    k,
                )
                .transpose(ta, tb)
                .batched(batch, m * k, k * n, m * n)
                .scaled(scale.0, scale.1);
                let data = |rng: &mut Rng, dtype, len| {
                    let v: Vec<f32> = (0..len).map(|_| rng.uniform(-1.0, 1.0)).collect();
                    HostData::from_f32(dtype, &v)
                };
                let a = data(&mut rng, DType::F16, batch * m * k);
                let b = data(&mut rng, DType::F16, batch * k * n);
                let c = data(&mut rng, c_dtype, batch * m * n);
                let run = |d: &dyn Device, on_vk: bool| {
                    let mut mm = mm.clone();
                    (mm.a, mm.b, mm.c) = (put(d, &a), put(d, &b), put(d, &c));
                    if on_vk {
                        let route = dev.coopmat_route(&mm).unwrap();
                        match (&coop, &route) {
                            (Ok(_), Ok(p)) => {
                                assert_eq!((p.trans_a, p.trans_b, p.c), (ta, tb, c_dtype))
                            }
                            (Ok(_), Err(why)) => panic!("{m}x{n}x{k}: not routed: {why}"),
                            (Err(_), Ok(p)) => panic!("routed without a shape: {p:?}"),
                            (Err(_), Err(why)) => {
                                assert!(why.starts_with("no cooperative matrix: "), "{why}")
                            }
                        }
                    }
                    d.launch(&Kernel::Matmul(mm.clone())).unwrap();
                    d.submit().unwrap();
                    (d.download(mm.c).unwrap().to_f32(), a.to_f32(), b.to_f32())
                };
                let (got, av, bv) = run(&dev, true);
                let (want, _, _) = run(&cpu, false);
                // f32 sums of K products of stored f16 values (exact in f32), in
                // another order and on matrix units: K·2^-20 of the sum of |a·b| (8x
                // the f32 rounding bound), plus one rounding of C to its dtype.
                let unit = if c_dtype == DType::F16 {
                    2f32.powi(-10)
                } else {
                    2f32.powi(-23)
                };
                for (i, (g, w)) in got.iter().zip(&want).enumerate() {
                    let (z, r, col) = (i / (m * n), i / n % m, i % n);
                    let s: f32 = (0..k)
                        .map(|kk| {
                            let x = if ta {
                                av[z * m * k + kk * m + r]
                            } else {
                                av[z * m * k + r * k + kk]
                            };
                            let y = if tb {
                                bv[z * k * n + col * k + kk]
                            } else {
                                bv[z * k * n + kk * n + col]
                            };
                            (x * y).abs()
                        })
                        .sum();
                    let tol =
                        scale.0.abs() * k as f32 * 2f32.powi(-20) * s + w.abs() * 2.0 * unit + 1e-6;
                    assert!(
                        (g - w).abs() <= tol,
                        "{m}x{n}x{k} x{batch} trans ({ta}, {tb}) -> {c_dtype}: C[{i}] = {g}, \
                         CPU {w} (tolerance {tol})"
                    );
                }
                cases += 1;
            }
        }
    }
    // A product off the tile never takes it, and says why.
    let off = Matmul::new(
        dev.alloc(DType::F16, (tm + 1) * tk).unwrap(),
        dev.alloc(DType::F16, tk * tn).unwrap(),
        dev.alloc(DType::F32, (tm + 1) * tn).unwrap(),
        tm + 1,
        tn,
        tk,
    );
    let why = dev.coopmat_route(&off).unwrap().unwrap_err();
    match &coop {
        Ok(c) => {
            assert!(
                why.contains(&format!("not a multiple of the {}", c.shape)),
                "{why}"
            );
            assert_eq!(dev.coopmat_launches(), cases);
        }
        Err(_) => {
            assert!(why.starts_with("no cooperative matrix: "), "{why}");
            assert_eq!(dev.coopmat_launches(), 0);
        }
    }
    assert!(!matches!(
        dev.gemm_route(&off).unwrap(),
        kiln::vulkan::GemmRoute::CoopMat(_)
    ));
}

/// lavapipe lists no VK_KHR_cooperative_matrix: the device says so, and its route
/// names it for every product, so the cooperative-matrix GEMM is never taken there.
#[test]
fn lavapipe_has_no_cooperative_matrix_and_never_routes_there() {
    let lavapipe = kiln::vulkan::physical_devices()
        .into_iter()
        .find(|d| d.caps.name.contains("llvmpipe"))
        .expect(
            "no lavapipe among the Vulkan devices: install mesa-vulkan-drivers (scripts/setup.sh)",
        );
    let dev = kiln::vulkan::VkDevice::open(lavapipe.index, &Default::default()).unwrap();
    let why = dev.cooperative_matrix().unwrap_err();
    assert_eq!(why, "the driver does not offer VK_KHR_cooperative_matrix");
    let mm = kiln::engine::Matmul::new(
        dev.alloc(DType::F16, 64 * 64).unwrap(),
        dev.alloc(DType::F16, 64 * 64).unwrap(),
        dev.alloc(DType::F32, 64 * 64).unwrap(),
        64,
        64,
        64,
    );
    let route = dev.coopmat_route(&mm).unwrap().unwrap_err();
    assert_eq!(
        route,
        "no cooperative matrix: the driver does not offer VK_KHR_cooperative_matrix"
    );
    assert!(!matches!(
        dev.gemm_route(&mm).unwrap(),
        kiln::vulkan::GemmRoute::CoopMat(_)
    ));
}

/// Set in the child processes of
/// [`validation_errors_fail_the_next_sync_point_and_kiln_vk_validation_0_turns_it_off`]:
/// which case the child checks (see [`VALIDATION_CASES`]).
const VALIDATION_PROBE: &str = "KILN_TEST_VK_VALIDATION_PROBE";

/// What a child's device does with a validation error it provokes.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Expect {
    /// The next sync point fails naming it.
    Reported,
    /// Nothing: the layer is off.
    Unreported,
    /// The device does not open: the layer was asked for and is missing.
    NoDevice,
}

/// Each case: its name, KILN_VK_VALIDATION (None: unset, a debug build's default),
/// whether the loader hides the layer (VK_LOADER_LAYERS_DISABLE, as on a machine
/// without it), and what the child's device does.
const VALIDATION_CASES: &[(&str, Option<&str>, bool, Expect)] = &[
    ("default", None, false, Expect::Reported),
    ("on", Some("1"), false, Expect::Reported),
    ("off", Some("0"), false, Expect::Unreported),
    ("absent", None, true, Expect::Unreported),
    ("absent-but-asked", Some("1"), true, Expect::NoDevice),
];

/// In a child: provokes a validation error before each sync point (through the
/// device's test hook) and checks what the sync point says.
fn validation_probe(expect: Expect) {
    let opened = kiln::vulkan::VkDevice::open(vk_index(), &Default::default());
    if expect == Expect::NoDevice {
        let e = opened
            .err()
            .expect("no device without the layer")
            .to_string();
        assert!(
            e.contains("VK_LAYER_KHRONOS_validation")
                && e.contains("apt-get install vulkan-validationlayers"),
            "{e}"
        );
        return;
    }
    let dev = opened.unwrap_or_else(|e| panic!("{e}"));
    let check = |what: &str, r: kiln::engine::Result<()>| match (expect, r) {
        (Expect::Reported, Err(Error::Backend { detail, .. })) => assert!(
            detail.contains("Vulkan validation error")
                && detail.contains("VUID-vkCmdPipelineBarrier-srcAccessMask-02815")
                && detail.contains("SYNC-HAZARD-WRITE-AFTER-WRITE")
                && detail.contains("KILN_VK_VALIDATION=0"),
            "{what}: {detail}"
        ),
        (Expect::Reported, other) => {
            panic!("{what}: expected the validation error, got {other:?}")
        }
        (_, r) => r.unwrap_or_else(|e| panic!("{what} without the layer: {e}")),
    };
    dev.provoke_validation_error().unwrap();
    check("submit", dev.submit());
    dev.provoke_validation_error().unwrap();
    check("wait", dev.wait());
    let b = put(&dev, &data(DType::F32, 64, 1, false));
    dev.provoke_validation_error().unwrap();
    check("download", dev.download(b).map(drop));
    // Reported once, the error is gone: the device works on.
    dev.wait().unwrap();
    assert_eq!(dev.download(b).unwrap().len(), 64);
}

/// Runs this test alone in a child process for `case` of [`VALIDATION_CASES`].
fn in_child(&(case, setting, hide_layer, _): &(&str, Option<&str>, bool, Expect)) {
    let name = "validation_errors_fail_the_next_sync_point_and_kiln_vk_validation_0_turns_it_off";
    let mut child = std::process::Command::new(std::env::current_exe().unwrap());
    child
        .args(["--exact", name, "--nocapture", "--test-threads=1"])
        .env(VALIDATION_PROBE, case)
        .env_remove("KILN_VK_VALIDATION")
        .env_remove("VK_LOADER_LAYERS_DISABLE");
    if let Some(v) = setting {
        child.env("KILN_VK_VALIDATION", v);
    }
    if hide_layer {
        child.env("VK_LOADER_LAYERS_DISABLE", "VK_LAYER_KHRONOS_validation");
    }
    let out = child.output().unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success() && stdout.contains("1 passed"),
        "case {case}: {stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// The validation layer (on in debug builds where installed, as here: scripts/setup.sh
/// installs it) fails the next sync point of a device whose commands it rejects, so
/// every vk test fails on a validation error without checking for one;
/// KILN_VK_VALIDATION=0, or a machine without the layer, runs without it; and
/// KILN_VK_VALIDATION=1 without the layer is an error naming the package. Each case runs
/// in a child process, since the variables are read as the device opens.
#[test]
fn validation_errors_fail_the_next_sync_point_and_kiln_vk_validation_0_turns_it_off() {
    match std::env::var(VALIDATION_PROBE) {
        Ok(case) => {
            let &(_, _, _, expect) = VALIDATION_CASES
                .iter()
                .find(|c| c.0 == case)
                .unwrap_or_else(|| panic!("{VALIDATION_PROBE}={case}: no such case"));
            validation_probe(expect)
        }
        Err(_) => VALIDATION_CASES.iter().for_each(in_child),
    }
}

/// `KILN_PLAN_AS_GPU=1` (CI runs this file under it as well as without): a CPU driver
/// then opens as a `cpu planned as a gpu` device on both backends, and its GEMMs route
/// to the tiled GEMM's twin; without it, lavapipe's go to the CPU-class kernel. (A real
/// GPU named by KILN_TEST_VK is planned for as one either way.)
#[test]
fn a_cpu_driver_is_planned_for_as_a_gpu_when_asked() {
    let asked = std::env::var(kiln::wgpu::PLAN_AS_GPU_ENV).is_ok_and(|v| v.trim() == "1");
    let n = vk_index();
    let listed = &kiln::vulkan::physical_devices()[n].caps;
    let dev = vk_device(false);
    let wgpu = gpu("vulkan", false);
    let as_gpu = asked && listed.device_type == "cpu";
    for (what, caps) in [("vk", dev.caps()), ("wgpu", wgpu.caps())] {
        assert_eq!(
            caps.device_type == kiln::wgpu::PLANNED_AS_GPU,
            as_gpu,
            "{what}: {} (asked: {asked})",
            caps.device_type
        );
    }
    let mm = Matmul::new(
        dev.alloc(DType::F32, 128 * 128).unwrap(),
        dev.alloc(DType::F32, 128 * 128).unwrap(),
        dev.alloc(DType::F32, 128 * 128).unwrap(),
        128,
        128,
        128,
    );
    let route = dev.gemm_route(&mm).unwrap();
    let cpu_class = dev.caps().device_type == "cpu";
    assert!(
        match route {
            kiln::vulkan::GemmRoute::Spirv(_) => cpu_class,
            kiln::vulkan::GemmRoute::SpirvGpu(_) | kiln::vulkan::GemmRoute::CoopMat(_) => {
                !cpu_class
            }
            kiln::vulkan::GemmRoute::Naga(_) => false,
        },
        "{route:?} on a {} device",
        dev.caps().device_type
    );
}
