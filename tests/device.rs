//! The device contract itself: independent devices, exact round trips, and clear
//! errors (never panics) on bad input.

mod common;

use common::*;
use kiln::engine::kernels::{self, Axpy, Binary, Cast, Fill, NonFinite, Reduce, Softmax};
use kiln::engine::{DType, Device, Error, HostData, Kernel};
use kiln::wgpu::{DeviceOptions, WgpuDevice};
use kiln::{open_device, DeviceSpec};

fn all_devices() -> Vec<(String, Box<dyn Device>)> {
    let mut v: Vec<(String, Box<dyn Device>)> = gpu_paths()
        .into_iter()
        .map(|p| (p.name.to_string(), p.dev))
        .collect();
    v.push(("cpu".into(), Box::new(kiln::cpu::CpuDevice::new())));
    v
}

#[test]
fn two_devices_on_one_adapter_round_trip_exactly() {
    let index = kiln::wgpu::find_adapter("vulkan").unwrap_or_else(|e| panic!("{e}"));
    let d0 = WgpuDevice::open(index, &DeviceOptions::default()).unwrap();
    let d1 = WgpuDevice::open(index, &DeviceOptions::default()).unwrap();
    for dtype in DType::ALL {
        let original = data(dtype, 1001, 42, true);
        let b0 = put(&d0, &original);
        let back = d0.download(b0).unwrap();
        let b1 = put(&d1, &back);
        // Work on device 1 must not touch device 0's memory.
        d1.launch(&Kernel::Fill(Fill {
            dst: b1,
            value: 3.0,
        }))
        .unwrap();
        d1.upload(b1, &back).unwrap();
        let again = d1.download(b1).unwrap();
        assert_eq!(original.bits(), again.bits(), "{dtype} via device 1");
        assert_eq!(
            original.bits(),
            d0.download(b0).unwrap().bits(),
            "{dtype} on device 0"
        );
    }
    // Ids are per device: device 1's handle is not valid on device 0 once freed there.
    let b = d1.alloc(DType::F32, 4).unwrap();
    d1.free(b).unwrap();
    assert!(matches!(d1.download(b), Err(Error::UnknownBuffer { .. })));
}

#[test]
fn uploads_of_the_wrong_dtype_or_length_are_errors() {
    for (name, dev) in all_devices() {
        let b = dev.alloc(DType::F16, 10).unwrap();
        let e = dev.upload(b, &HostData::F32(vec![0.0; 10])).unwrap_err();
        assert!(matches!(e, Error::DTypeMismatch { .. }), "{name}: {e}");
        assert!(
            e.to_string().contains("f16") && e.to_string().contains("f32"),
            "{name}: {e}"
        );
        let e = dev
            .upload(b, &HostData::from_f32(DType::F16, &[0.0; 9]))
            .unwrap_err();
        assert!(
            matches!(
                e,
                Error::LenMismatch {
                    expected: 10,
                    found: 9,
                    ..
                }
            ),
            "{name}: {e}"
        );
    }
}

#[test]
fn freed_buffers_are_errors_everywhere() {
    for (name, dev) in all_devices() {
        let b = dev.alloc(DType::F32, 3).unwrap();
        let before = dev.allocated_bytes();
        dev.free(b).unwrap();
        assert_eq!(
            dev.allocated_bytes(),
            before - b.bytes(),
            "{name}: allocator count"
        );
        let e = dev.download(b).unwrap_err();
        assert!(
            matches!(e, Error::UnknownBuffer { id, .. } if id == b.id),
            "{name}: {e}"
        );
        assert!(e.to_string().contains("freed"), "{name}: {e}");
        assert!(
            dev.upload(b, &HostData::F32(vec![1.0; 3])).is_err(),
            "{name}"
        );
        assert!(dev.free(b).is_err(), "{name}: double free");
        let e = dev
            .launch(&Kernel::Fill(Fill { dst: b, value: 1.0 }))
            .unwrap_err();
        assert!(matches!(e, Error::UnknownBuffer { .. }), "{name}: {e}");
    }
}

#[test]
fn bad_launches_are_errors() {
    for (name, dev) in all_devices() {
        let a = dev.alloc(DType::F32, 5).unwrap();
        let short = dev.alloc(DType::F32, 4).unwrap();
        let ints = dev.alloc(DType::U32, 5).unwrap();
        let scalar = dev.alloc(DType::F32, 1).unwrap();
        let bad = [
            Kernel::Copy(kernels::Copy { src: a, dst: short }),
            Kernel::Cast(Cast { src: ints, dst: a }),
            Kernel::Binary(Binary {
                op: kiln::engine::BinaryOp::Add,
                a,
                b: short,
                out: a,
            }),
            Kernel::Reduce(Reduce {
                op: kiln::engine::ReduceOp::Sum,
                src: a,
                dst: short,
            }),
            Kernel::Reduce(Reduce {
                op: kiln::engine::ReduceOp::Sum,
                src: ints,
                dst: scalar,
            }),
            Kernel::NonFinite(NonFinite {
                srcs: vec![],
                flag: ints,
            }),
            Kernel::NonFinite(NonFinite {
                srcs: vec![a],
                flag: scalar,
            }),
            Kernel::Fill(Fill {
                dst: ints,
                value: -1.0,
            }),
            Kernel::Fill(Fill {
                dst: ints,
                value: 0.5,
            }),
        ];
        for k in bad {
            let e = dev
                .launch(&k)
                .expect_err(&format!("{name}: {k:?} should fail"));
            assert!(!e.to_string().is_empty());
        }
        // A forged handle with the right id but the wrong shape is caught too.
        let forged = kiln::engine::Buffer { len: 99, ..a };
        if dev.caps().backend != "cpu" {
            assert!(
                dev.launch(&Kernel::Fill(Fill {
                    dst: forged,
                    value: 0.0
                }))
                .is_err(),
                "{name}"
            );
        }
        // Nothing bad was recorded: the device still works.
        dev.launch(&Kernel::Fill(Fill { dst: a, value: 2.0 }))
            .unwrap();
        dev.submit().unwrap();
        assert_eq!(
            dev.download(a).unwrap(),
            HostData::F32(vec![2.0; 5]),
            "{name}"
        );
    }
}

#[test]
fn a_missing_adapter_is_a_clear_error() {
    let n = kiln::wgpu::adapters().len();
    let e = WgpuDevice::open(n + 3, &DeviceOptions::default())
        .err()
        .unwrap();
    assert!(matches!(e, Error::NoSuchAdapter { .. }), "{e}");
    assert!(e.to_string().contains("kiln devices"), "{e}");

    let e = open_device(&"vulkan:57".parse().unwrap(), &DeviceOptions::default())
        .err()
        .unwrap();
    assert!(e.to_string().contains("only"), "{e}");

    // A backend with no adapter here says how to get one.
    let absent = if cfg!(target_os = "macos") {
        "dx12"
    } else {
        "metal"
    };
    let e = kiln::wgpu::find_adapter(absent).unwrap_err();
    assert!(e.to_string().contains("mesa-vulkan-drivers"), "{e}");

    let e = "vulkna:0".parse::<DeviceSpec>().unwrap_err();
    assert!(e.to_string().contains("unknown device"), "{e}");
    let e = "vulkan:x".parse::<DeviceSpec>().unwrap_err();
    assert!(e.to_string().contains("vulkan:0"), "{e}");
}

#[test]
fn oversized_allocations_are_errors() {
    let dev = gpu("vulkan", false);
    let too_big = (dev.caps().max_buffer / 4 + 1) as usize;
    let e = dev.alloc(DType::F32, too_big).unwrap_err();
    assert!(matches!(e, Error::OutOfMemory { .. }), "{e}");
    assert!(e.to_string().contains("largest buffer"), "{e}");
}

#[test]
fn device_specs_parse() {
    assert_eq!("cpu".parse::<DeviceSpec>().unwrap(), DeviceSpec::Cpu);
    assert_eq!("2".parse::<DeviceSpec>().unwrap(), DeviceSpec::Index(2));
    assert_eq!(
        "Vulkan:1".parse::<DeviceSpec>().unwrap(),
        DeviceSpec::Backend {
            backend: "vulkan".into(),
            nth: 1
        }
    );
    assert_eq!(
        "gl".parse::<DeviceSpec>().unwrap(),
        DeviceSpec::Backend {
            backend: "gl".into(),
            nth: 0
        }
    );
    let gl = open_device(&"gl".parse().unwrap(), &DeviceOptions::default()).unwrap();
    assert_eq!(gl.caps().backend, "gl");
}

/// Uploads never wait for the device: each is staged in host-visible memory and its copy
/// queued behind the work already recorded, so the next batch goes up while the current
/// step computes (the training loop relies on this), and program order still holds.
#[test]
fn uploads_are_staged_behind_running_work_without_waiting_for_it() {
    let dev = gpu("vulkan", false);
    let n = 512;
    let ones = HostData::F32(vec![1.0; n * n]);
    let (a, b, c) = (
        put(dev.as_ref(), &ones),
        put(dev.as_ref(), &ones),
        dev.alloc(DType::F32, n * n).unwrap(),
    );
    let small = dev.alloc(DType::F32, 256).unwrap();
    let gemm = Kernel::Matmul(kiln::engine::Matmul::new(a, b, c, n, n, n));
    let one = put(dev.as_ref(), &HostData::F32(vec![1.0; 256]));
    let axpy = Kernel::Axpy(Axpy {
        alpha: 1.0,
        x: one,
        y: small,
    });
    // Warm-up: compiles the pipelines, so the timed part is staging alone.
    dev.launch(&axpy).unwrap();
    dev.launch(&gemm).unwrap();
    dev.submit().unwrap();
    dev.wait().unwrap();

    let t0 = std::time::Instant::now();
    for _ in 0..4 {
        dev.launch(&gemm).unwrap();
    }
    dev.submit().unwrap();
    let t1 = std::time::Instant::now();
    dev.upload(small, &HostData::F32(vec![2.5; 256])).unwrap();
    // And one recorded behind a pending launch: it must land after that launch ran
    // (small = 2.5 + 1, then overwritten by 7; landing early would leave 8).
    dev.launch(&axpy).unwrap();
    dev.upload(small, &HostData::F32(vec![7.0; 256])).unwrap();
    let upload = t1.elapsed();
    dev.submit().unwrap();
    dev.wait().unwrap();
    let gemm_time = t0.elapsed();
    assert!(
        upload * 4 < gemm_time,
        "uploads took {upload:?} while a {gemm_time:?} GEMM ran: they waited for it"
    );
    assert_eq!(dev.download(small).unwrap().to_f32(), vec![7.0; 256]);
    assert_eq!(dev.download(c).unwrap().to_f32()[n * n - 1], n as f32);
}

/// A kernel that would bind a whole buffer past the adapter's per-binding limit is a
/// clear error at launch (GEMMs split such operands; row kernels cannot).
#[test]
fn a_buffer_over_the_binding_limit_is_a_clear_error() {
    let dev = gpu("vulkan", false);
    let limit = dev.caps().max_storage_binding;
    let cols = 1024;
    let rows = (limit / 4) as usize / cols + 1;
    let x = dev.alloc(DType::F32, rows * cols).unwrap();
    let out = dev.alloc(DType::F32, rows * cols).unwrap();
    let stats = dev.alloc(DType::F32, 2 * rows).unwrap();
    let e = dev
        .launch(&Kernel::Softmax(Softmax {
            x,
            out,
            stats,
            cols,
            scale: 1.0,
            causal: true,
        }))
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("per-binding limit") && e.contains("softmax"),
        "{e}"
    );
    // The device is still usable.
    let small = put(dev.as_ref(), &HostData::F32(vec![1.0; 8]));
    assert_eq!(dev.download(small).unwrap().to_f32(), vec![1.0; 8]);
}

/// Views: a model keeps its tensors in a few flat buffers and binds each tensor as a
/// view. Uploads, downloads, copies and kernels on a view touch exactly its range, at
/// any 256-byte-aligned offset, in f32 and f16, on every path; the allocator counts the
/// buffer once; bad views are errors naming the fix.
#[test]
fn views_touch_exactly_their_range() {
    for (name, dev) in all_devices() {
        for dtype in [DType::F32, DType::F16] {
            let per = 256 / dtype.size();
            let n = 3 * per + 10;
            let parent = dev.alloc(dtype, n).unwrap();
            let before = dev.allocated_bytes();
            let base: Vec<f32> = (0..n).map(|i| i as f32).collect();
            dev.upload(parent, &HostData::from_f32(dtype, &base))
                .unwrap();
            // Two views, the second ending at the parent's end with an odd length.
            let a = dev.view(parent, per, 6).unwrap();
            let b = dev.view(parent, 2 * per, per + 10).unwrap();
            assert_eq!(
                dev.allocated_bytes(),
                before,
                "{name}: views allocate nothing"
            );
            assert_eq!(
                dev.download(a).unwrap().to_f32(),
                base[per..per + 6].to_vec(),
                "{name} {dtype}"
            );
            // Upload into a view, a kernel writing a view, a copy between views.
            dev.upload(a, &HostData::from_f32(dtype, &[-1.0; 6]))
                .unwrap();
            let other = dev.alloc(dtype, per + 10).unwrap();
            dev.upload(other, &HostData::from_f32(dtype, &vec![0.5; per + 10]))
                .unwrap();
            dev.launch(&Kernel::Axpy(Axpy {
                alpha: 2.0,
                x: other,
                y: b,
            }))
            .unwrap();
            let c = dev.view(parent, 0, 6).unwrap();
            dev.launch(&Kernel::Copy(kernels::Copy { src: a, dst: c }))
                .unwrap();
            dev.submit().unwrap();
            let mut want = base.clone();
            want[per..per + 6].fill(-1.0);
            want[..6].fill(-1.0);
            for w in &mut want[2 * per..] {
                *w += 1.0;
            }
            // Integers up to 3·128+10 and their halves are exact in f16.
            assert_eq!(
                dev.download(parent).unwrap().to_f32(),
                want,
                "{name} {dtype}"
            );
            // Bad views.
            let e = dev.view(parent, 1, 2).unwrap_err().to_string();
            assert!(e.contains("256-byte boundary"), "{name}: {e}");
            assert!(dev.view(parent, 2 * per, per + 11).is_err(), "{name}");
            assert!(dev.view(parent, 0, 0).is_err(), "{name}");
            let e = dev.view(a, 0, 2).unwrap_err().to_string();
            assert!(e.contains("itself a view"), "{name}: {e}");
            let e = dev.free(parent).unwrap_err().to_string();
            assert!(e.contains("still has views"), "{name}: {e}");
            for v in [a, b, c] {
                dev.free(v).unwrap();
            }
            assert_eq!(dev.allocated_bytes(), before + other.bytes(), "{name}");
            dev.free(parent).unwrap();
            dev.free(other).unwrap();
        }
    }
}

/// WebGPU forbids one buffer bound writable and read-only in one dispatch, even as
/// disjoint views: an error naming the kernel, not a failed submit. Vulkan allows it,
/// so the raw Vulkan backend runs the launch, with the right result.
#[test]
fn a_view_read_and_its_buffer_written_in_one_launch_is_an_error() {
    for p in gpu_paths() {
        let dev = p.dev;
        let parent = dev.alloc(DType::F32, 128).unwrap();
        let (x, y) = (
            dev.view(parent, 0, 64).unwrap(),
            dev.view(parent, 64, 64).unwrap(),
        );
        if dev.caps().backend == "vk" {
            dev.upload(x, &HostData::F32(vec![1.5; 64])).unwrap();
            dev.upload(y, &HostData::F32(vec![2.0; 64])).unwrap();
            dev.launch(&Kernel::Axpy(Axpy { alpha: 2.0, x, y }))
                .unwrap();
            dev.submit().unwrap();
            assert_eq!(
                dev.download(y).unwrap(),
                HostData::F32(vec![5.0; 64]),
                "{}",
                p.name
            );
            continue;
        }
        let e = dev
            .launch(&Kernel::Axpy(Axpy { alpha: 1.0, x, y }))
            .unwrap_err()
            .to_string();
        assert!(e.contains("views of one buffer"), "{}: {e}", p.name);
        dev.submit().unwrap();
        dev.wait().unwrap();
    }
}
