//! GEMM kernels against the CPU reference: hundreds of random shapes (1x1x1, primes,
//! K = 1, long K, non-multiples of every tile), all transposes, every dtype, batches,
//! split K and the fused epilogue, on both f16 paths.
//!
//! Tolerance, per output element, with S = sum_k |a_ik * b_kj|:
//!   |gpu - ref| <= |alpha| * K * 2^-23 * S      (f32 accumulation, any order: the
//!                                                 standard gamma_K bound, doubled)
//!              + |ref| * u_out + tiny_out       (one rounding to C's dtype may land on
//!                                                 the neighbouring value: u_out = 2^-10
//!                                                 for f16, 2^-7 bf16, 2^-23 f32)
//! The reference sums in f64, so the bound is against the exact product of the stored
//! (already rounded) inputs.

mod common;

use common::*;
use kiln::engine::{DType, Device, HostData, Kernel, Matmul};
use kiln::wgpu::{DeviceOptions, MatmulVariant, WgpuDevice};

fn wgpu_paths() -> Vec<(&'static str, WgpuDevice)> {
    let open = |backend: &str, disable_f16| {
        let i = adapter_index(backend);
        WgpuDevice::open(
            i,
            &DeviceOptions {
                disable_f16,
                ..Default::default()
            },
        )
        .unwrap()
    };
    vec![
        ("vulkan (native f16)", open("vulkan", false)),
        ("vulkan (packed f16)", open("vulkan", true)),
        ("gl (packed f16)", open("gl", false)),
    ]
}

fn unit(dtype: DType) -> (f64, f64) {
    match dtype {
        DType::F16 => (2f64.powi(-10), 2f64.powi(-24)),
        DType::BF16 => (2f64.powi(-7), 1e-38),
        _ => (2f64.powi(-23), 1e-38),
    }
}

struct Case {
    mm: Matmul,
    a: HostData,
    b: HostData,
    c: HostData,
    bias: Option<HostData>,
}

/// Runs `case` on `dev` (optionally pinning a kernel) and on the CPU, and checks every
/// element of C (and of the f32 copy) against the bound above.
fn check(what: &str, dev: &WgpuDevice, case: &Case, variant: Option<MatmulVariant>) {
    check_on(what, dev, case, &|mm| {
        dev.launch_matmul(mm, variant).map(drop)
    })
}

/// [`check`] on any device, `launch` recording the GEMM there.
fn check_on(
    what: &str,
    dev: &dyn Device,
    case: &Case,
    launch: &dyn Fn(&Matmul) -> kiln::engine::Result<()>,
) {
    let cpu = kiln::cpu::CpuDevice::new();
    let run = |d: &dyn Device, gpu: bool| -> (HostData, Option<HostData>) {
        let a = put(d, &case.a);
        let b = put(d, &case.b);
        let c = put(d, &case.c);
        let mut mm = Matmul {
            a,
            b,
            c,
            ..case.mm.clone()
        };
        mm.bias = case.bias.as_ref().map(|h| put(d, h));
        mm.c_f32 = case
            .mm
            .c_f32
            .map(|cf| put(d, &HostData::F32(vec![0.0; cf.len])));
        if gpu {
            launch(&mm).unwrap_or_else(|e| panic!("{what}: {e}"));
        } else {
            d.launch(&Kernel::Matmul(mm.clone())).unwrap();
        }
        d.submit().unwrap();
        let out = d.download(c).unwrap();
        let copy = mm.c_f32.map(|cf| d.download(cf).unwrap());
        for buf in mm.buffers() {
            d.free(buf).unwrap();
        }
        (out, copy)
    };
    let (got, got_f32) = run(dev, true);
    let (want, want_f32) = run(&cpu, false);
    let mm = &case.mm;
    let (a, b) = (case.a.to_f32(), case.b.to_f32());
    let (g, w) = (got.to_f32(), want.to_f32());
    let copies = got_f32.zip(want_f32).map(|(g, w)| (g.to_f32(), w.to_f32()));
    let (u, tiny) = unit(mm.c.dtype);
    let mut checked = 0;
    for gi in 0..mm.batch {
        for i in 0..mm.m {
            for j in 0..mm.n {
                let s: f64 = (0..mm.k)
                    .map(|kk| {
                        (a[mm.a_index(gi, i, kk)] as f64 * b[mm.b_index(gi, kk, j)] as f64).abs()
                    })
                    .sum();
                let at = gi * mm.stride_c + i * mm.n + j;
                // GELU's slope is at most ~1.13, and the bias adds no error.
                let acc_err = 1.2 * mm.alpha.abs() as f64 * mm.k as f64 * 2f64.powi(-23) * s
                    + 1e-6 * mm.gelu as u8 as f64;
                let tol = acc_err + (w[at] as f64).abs() * u + tiny;
                let d = (g[at] as f64 - w[at] as f64).abs();
                assert!(
                    d <= tol,
                    "{what}: C[{gi}][{i}][{j}] = {} but the CPU gives {} (|diff| {d:e} > tol {tol:e})",
                    g[at],
                    w[at]
                );
                if let Some((gf, wf)) = &copies {
                    let (gf, wf) = (gf[at] as f64, wf[at] as f64);
                    let tol = acc_err + wf.abs() * 2f64.powi(-23) + 1e-38;
                    assert!(
                        (gf - wf).abs() <= tol,
                        "{what}: f32 copy [{gi}][{i}][{j}] = {gf}, CPU {wf}"
                    );
                }
                checked += 1;
            }
        }
    }
    // Elements between batch strides are not outputs and must keep their value.
    let before = case.c.to_f32();
    let stride = mm.stride_c.max(mm.m * mm.n).max(1);
    for (at, (&now, &was)) in g.iter().zip(&before).enumerate() {
        let output = at / stride < mm.batch && at % stride < mm.m * mm.n;
        if !output {
            assert!(
                now.to_bits() == was.to_bits() || (now.is_nan() && was.is_nan()),
                "{what}: C[{at}] is not an output but changed from {was} to {now}"
            );
        }
    }
    assert!(checked > 0 || mm.m * mm.n == 0);
}

/// C (and its f32 copy) after one launch of `case` on `d`.
fn outputs(d: &dyn Device, case: &Case) -> (Vec<u32>, Option<Vec<u32>>) {
    outputs_with(d, case, &|mm| d.launch(&Kernel::Matmul(mm.clone())))
}

/// [`outputs`], `launch` recording the GEMM on `d`.
fn outputs_with(
    d: &dyn Device,
    case: &Case,
    launch: &dyn Fn(&Matmul) -> kiln::engine::Result<()>,
) -> (Vec<u32>, Option<Vec<u32>>) {
    let put_all = |h: &HostData| put(d, h);
    let mut mm = Matmul {
        a: put_all(&case.a),
        b: put_all(&case.b),
        c: put_all(&case.c),
        ..case.mm.clone()
    };
    mm.bias = case.bias.as_ref().map(put_all);
    mm.c_f32 = case
        .mm
        .c_f32
        .map(|cf| put(d, &HostData::F32(vec![0.0; cf.len])));
    launch(&mm).unwrap();
    d.submit().unwrap();
    let bits = |b| -> Vec<u32> {
        let v = d.download(b).unwrap().to_f32();
        v.iter().map(|x| x.to_bits()).collect()
    };
    let out = (bits(mm.c), mm.c_f32.map(bits));
    for buf in mm.buffers() {
        d.free(buf).unwrap();
    }
    out
}

/// `case` on `vk:0` gives the bits it gives on wgpu's Vulkan device (the WGSL GEMMs):
/// the SPIR-V kernel sums each output's K in the WGSL kernel's order, and its epilogue
/// is the same straight-line code once specialized (beta tested by `USE_BETA`, as in
/// WGSL: lavapipe contracted `alpha * acc + beta * C + bias` differently around a
/// run-time test of beta).
/// Launches `mm` on `dev` once it is sure the product routes to the hand-written
/// SPIR-V GEMM and `check` accepts the plan.
fn launch_as_spirv(
    what: &str,
    dev: &kiln::vulkan::VkDevice,
    mm: &Matmul,
    check: impl Fn(&kiln::vulkan::SpirvGemmPlan),
) -> kiln::engine::Result<()> {
    let route = dev.gemm_route(mm)?;
    assert!(hand_written(dev, &route), "{what}: {route:?}");
    if let kiln::vulkan::GemmRoute::Spirv(p) = route {
        check(&p);
    }
    dev.launch(&Kernel::Matmul(mm.clone()))
}

/// Whether `route` is the hand-written kernel a product is meant to run in on `dev`:
/// the CPU-class SPIR-V GEMM on a CPU driver (lavapipe), whose tests these are; on a
/// GPU (or with `KILN_PLAN_AS_GPU=1`) the planner picks the tiled GEMM, whose twin
/// then runs the product (its own tests, below, cover its plan), so the CPU-class
/// plan's checks do not apply there while the numbers and bits still do.
fn hand_written(dev: &kiln::vulkan::VkDevice, route: &kiln::vulkan::GemmRoute) -> bool {
    match route {
        kiln::vulkan::GemmRoute::Spirv(_) => true,
        kiln::vulkan::GemmRoute::SpirvGpu(_) => dev.caps().device_type != "cpu",
        _ => false,
    }
}

fn same_bits_as_wgpu(what: &str, vk: &dyn Device, wgpu: &dyn Device, case: &Case) {
    let (v, w) = (outputs(vk, case), outputs(wgpu, case));
    assert!(v == w, "{what}: vk and wgpu give different bits");
}

/// A random case: values in [-1, 1) so that sums stay far from f16 overflow.
fn case(
    rng: &mut Rng,
    dims: (usize, usize, usize),
    trans: (bool, bool),
    dtypes: [DType; 3],
) -> Case {
    let (m, n, k) = dims;
    let [da, db, dc] = dtypes;
    let vals = |rng: &mut Rng, dt: DType, len: usize| {
        HostData::from_f32(
            dt,
            &(0..len).map(|_| rng.uniform(-1.0, 1.0)).collect::<Vec<_>>(),
        )
    };
    let a = vals(rng, da, m * k);
    let b = vals(rng, db, k * n);
    // C starts as NaN: with beta = 0 it must never be read.
    let c = HostData::from_f32(dc, &vec![f32::NAN; m * n]);
    let dummy = |dtype, len| kiln::engine::Buffer { id: 0, dtype, len };
    let mm = Matmul::new(
        dummy(da, m * k),
        dummy(db, k * n),
        dummy(dc, m * n),
        m,
        n,
        k,
    )
    .transpose(trans.0, trans.1);
    Case {
        mm,
        a,
        b,
        c,
        bias: None,
    }
}

const AWKWARD: [usize; 16] = [1, 2, 3, 4, 5, 7, 8, 13, 16, 17, 31, 32, 33, 63, 65, 100];

fn pick(rng: &mut Rng, from: &[usize]) -> usize {
    from[(rng.next_u32() as usize) % from.len()]
}

#[test]
fn random_shapes_match_cpu_on_every_path() {
    let mut rng = Rng::new(2024);
    let mut shapes = 0;
    for (name, dev) in wgpu_paths() {
        shapes += random_shapes(
            &mut rng,
            name,
            &dev,
            &|mm| dev.launch_matmul(mm, None).map(drop),
            5,
        );
    }
    assert!(shapes >= 200, "only {shapes} shapes");
}

/// The raw Vulkan backend (`vk:0`), on the same dtype mixes and transposes, one random
/// shape of each (lavapipe compiles each kernel anew for this device): every product
/// runs in a hand-written SPIR-V GEMM (the CPU-class kernel, or for N = 1 the GEMV's
/// twin), as the route says and its launch counter confirms.
#[test]
fn random_shapes_match_cpu_on_vk() {
    let mut rng = Rng::new(2025);
    let dev = vk_device(false);
    let routed = std::cell::Cell::new((0u64, 0u64));
    let launch = |mm: &Matmul| {
        let (s, n) = routed.get();
        routed.set(match dev.gemm_route(mm)? {
            kiln::vulkan::GemmRoute::Spirv(_) | kiln::vulkan::GemmRoute::SpirvGpu(_) => (s + 1, n),
            kiln::vulkan::GemmRoute::Naga(_) => (s, n + 1),
            // Counted apart (`coopmat_launches`); lavapipe has no cooperative matrix.
            kiln::vulkan::GemmRoute::CoopMat(_) => (s, n),
        });
        dev.launch(&Kernel::Matmul(mm.clone()))
    };
    let shapes = random_shapes(&mut rng, "vk (raw Vulkan)", &dev, &launch, 1);
    assert!(shapes >= 20, "only {shapes} shapes");
    let (spirv, naga) = dev.gemm_launches();
    assert_eq!((spirv, naga), routed.get());
    // Every shape, the GEMV ones (N = 1) too, runs in a hand-written kernel.
    assert_eq!(
        (spirv, naga),
        (shapes as u64, 0),
        "{spirv} SPIR-V and {naga} naga GEMMs of {shapes}"
    );
}

/// The SPIR-V GEMM on `vk:0` over what it covers beyond plain products: alpha and beta
/// (C read), batches with strides that are multiples of nothing and a B shared by every
/// matrix (stride 0), every transpose, f32 and f16, awkward sizes and a large product
/// (the planner's biggest tile, specialized from the same module); each runs there
/// (checked by route and counter) and matches the CPU.
#[test]
fn strided_batches_and_alpha_beta_run_as_spirv_on_vk() {
    let mut rng = Rng::new(2026);
    let dev = vk_device(false);
    let mut cases = 0;
    for dtype in [DType::F32, DType::F16] {
        for trans in [(false, false), (false, true), (true, false), (true, true)] {
            for (dims, batch, pad_b) in [
                ((13, 17, 29), 3, Some(5)),
                ((33, 65, 7), 2, None),
                ((8, 36, 100), 4, Some(4)),
            ] {
                let mut c = strided_batch(&mut rng, dims, trans, [dtype; 3], batch, 3, pad_b, 7);
                c.c = random(&mut rng, dtype, c.c.len());
                c.mm = c.mm.clone().scaled(0.75, -0.5);
                let what = format!("vk SPIR-V: {dims:?} x{batch} trans {trans:?} {dtype}");
                let launch = |mm: &Matmul| {
                    let route = dev.gemm_route(mm)?;
                    assert!(hand_written(&dev, &route), "{what}: {route:?}");
                    // A and B through texel views (lavapipe has them).
                    if let kiln::vulkan::GemmRoute::Spirv(p) = &route {
                        assert!(p.texel, "{what}: {p:?}");
                    }
                    dev.launch(&Kernel::Matmul(mm.clone()))
                };
                check_on(&what, &dev, &c, &launch);
                cases += 1;
            }
        }
    }
    // The planner's 32 x 12 block: a tile shape no committed module has compiled in.
    let big = case(&mut rng, (256, 192, 2731), (false, false), [DType::F16; 3]);
    check_on("vk SPIR-V: 256x192x2731", &dev, &big, &|mm| {
        launch_as_spirv("256x192x2731", &dev, mm, |p| {
            assert_eq!((p.tm, p.nv), (32, 3))
        })
    });
    cases += 1;
    assert_eq!(dev.gemm_launches(), (cases, 0));
}

/// The fused epilogue on `vk:0` runs in the SPIR-V GEMM (its `_epi` modules, each part a
/// specialization constant): every combination of bias, GELU and the f32 copy, with
/// alpha and beta, on f32 and f16, transposed and strided batches, against the CPU and
/// bit for bit against wgpu's WGSL epilogue. With storage loads (A and B not through
/// texel views), the modules a device without texel views runs.
#[test]
fn epilogues_run_as_spirv_on_vk() {
    let mut rng = Rng::new(2027);
    let dev = vk_device(false);
    dev.use_texel_gemm(false);
    let wgpu = gpu("vulkan", false);
    let mut cases = 0;
    for dtype in [DType::F32, DType::F16] {
        for parts in 1..8u32 {
            let (bias, gelu, copy) = (parts & 1 != 0, parts & 2 != 0, parts & 4 != 0);
            let trans = (parts & 1 != 0, parts & 2 == 0);
            let dims = (11 + parts as usize, 36 - parts as usize, 23);
            let mut c = strided_batch(&mut rng, dims, trans, [dtype; 3], 2, 1, Some(3), 5);
            let (n, len) = (c.mm.n, c.c.len());
            c.c = random(&mut rng, dtype, len);
            let mut mm = c.mm.clone().scaled(1.5, 0.25);
            if bias {
                c.bias = Some(random(&mut rng, dtype, n));
                mm.bias = Some(handle(dtype, n));
            }
            mm.gelu = gelu;
            if copy {
                mm.c_f32 = Some(handle(DType::F32, len));
            }
            c.mm = mm;
            let what = format!("vk SPIR-V epilogue: bias {bias} gelu {gelu} copy {copy} {dtype}");
            check_on(&what, &dev, &c, &|mm| {
                launch_as_spirv(&what, &dev, mm, |p| {
                    assert_eq!((p.bias, p.gelu, p.copy_f32), (bias, gelu, copy))
                })
            });
            same_bits_as_wgpu(&what, &dev, wgpu.as_ref(), &c);
            cases += 2;
        }
    }
    assert_eq!(dev.gemm_launches(), (cases, 0));
}

/// Storage the SPIR-V GEMM's compiled-in f32 and f16 modules lack runs in its `_mixed`
/// modules on `vk:0` (A, B, C and the bias each f32, f16 or bf16): bf16 throughout, f16
/// or bf16 operands with an f32 C (the tied embedding's gradient in a GPT step), an f32
/// bias on f16, one f32 operand; every transpose, strided batches with a broadcast B,
/// alpha and beta, sizes of 1, primes and ones past a tile; each checked by route and
/// counter against the CPU, and bit for bit against wgpu's WGSL GEMMs. With storage
/// loads, as [`epilogues_run_as_spirv_on_vk`].
#[test]
fn mixed_and_bf16_storage_run_as_spirv_on_vk() {
    let mut rng = Rng::new(2028);
    let dev = vk_device(false);
    dev.use_texel_gemm(false);
    let wgpu = gpu("vulkan", false);
    let (f32_, f16_, bf16) = (DType::F32, DType::F16, DType::BF16);
    let mixes = [
        ([bf16; 3], bf16),
        ([f16_, f16_, f32_], f32_),
        ([bf16, bf16, f32_], f32_),
        ([f16_; 3], f32_),
        ([bf16; 3], f32_),
        ([f32_, f16_, bf16], f16_),
    ];
    let shapes = [
        ((1, 1, 1), 1, None),
        ((61, 32, 32), 1, None),
        ((13, 17, 29), 3, Some(5)),
        ((37, 68, 9), 2, None),
        ((8, 36, 100), 4, Some(4)),
    ];
    let mut cases = 0;
    for (i, (dtypes, bias_dtype)) in mixes.into_iter().enumerate() {
        for (s, &(dims, batch, pad_b)) in shapes.iter().enumerate() {
            let trans = ((i + s) % 2 == 1, (i + s) % 4 >= 2);
            let mut c = strided_batch(&mut rng, dims, trans, dtypes, batch, 3, pad_b, 7);
            let (n, len) = (c.mm.n, c.c.len());
            c.c = random(&mut rng, dtypes[2], len);
            let mut mm = c.mm.clone();
            if s % 2 == 0 {
                mm = mm.scaled(0.75, -0.5);
            }
            if s != 1 {
                c.bias = Some(random(&mut rng, bias_dtype, n));
                mm.bias = Some(handle(bias_dtype, n));
            }
            mm.gelu = s == 2;
            if s == 3 {
                mm.c_f32 = Some(handle(DType::F32, len));
            }
            c.mm = mm;
            let what = format!(
                "vk SPIR-V mixed: {dims:?} x{batch} {trans:?} {dtypes:?} bias {bias_dtype}"
            );
            check_on(&what, &dev, &c, &|mm| {
                let bias = mm.bias.map_or(dtypes[2], |b| b.dtype);
                let want = [dtypes[0], dtypes[1], dtypes[2], bias];
                // f16 throughout (an f16 bias, or none) is the f16 modules' own case.
                let mixed = (want != [DType::F16; 4]).then_some(want);
                launch_as_spirv(&what, &dev, mm, |p| assert_eq!(p.mixed, mixed, "{what}"))
            });
            same_bits_as_wgpu(&what, &dev, wgpu.as_ref(), &c);
            cases += 2;
        }
    }
    assert_eq!(dev.gemm_launches(), (cases, 0));
}

/// On `vk:0` the CPU-class SPIR-V GEMM reads A and B through texel views of their
/// storage (the `_mixed_texel` modules) where lavapipe loops over the lanes of a storage
/// load: the same bits as with storage loads, over f32, f16, bf16 and mixed storage,
/// every transpose, B four values to a fetch and one, sizes of 1 and primes, strided
/// and broadcast batches, alpha, beta, bias, GELU and the f32 copy, and operands that
/// are views into a larger buffer; against the CPU as well.
#[test]
fn texel_views_give_the_storage_loads_bits_on_vk() {
    let mut rng = Rng::new(2030);
    let dev = vk_device(false);
    let (f32_, f16_, bf16) = (DType::F32, DType::F16, DType::BF16);
    let shapes = [
        ((1, 1, 1), 1, None),
        ((13, 17, 29), 3, Some(5)),
        ((37, 68, 9), 2, None),
        ((8, 36, 100), 4, Some(4)),
    ];
    let mixes = [[f32_; 3], [f16_; 3], [bf16; 3], [f16_, bf16, f32_]];
    let mut texel = 0;
    for (i, dtypes) in mixes.into_iter().enumerate() {
        for (s, &(dims, batch, pad_b)) in shapes.iter().enumerate() {
            let trans = ((i + s) % 2 == 1, (i + s) % 4 >= 2);
            let mut c = strided_batch(&mut rng, dims, trans, dtypes, batch, 3, pad_b, 7);
            let (n, len) = (c.mm.n, c.c.len());
            c.c = random(&mut rng, dtypes[2], len);
            let mut mm = c.mm.clone().scaled(0.75, -0.5);
            if s >= 2 {
                c.bias = Some(random(&mut rng, dtypes[2], n));
                mm.bias = Some(handle(dtypes[2], n));
                mm.gelu = s == 3;
                mm.c_f32 = Some(handle(f32_, len));
            }
            c.mm = mm;
            let what = format!("vk texel: {dims:?} x{batch} {trans:?} {dtypes:?}");
            let (d, w) = (&dev, what.as_str());
            let route = |on: bool| {
                d.use_texel_gemm(on);
                move |mm: &Matmul| {
                    launch_as_spirv(w, d, mm, |p| assert_eq!(p.texel, on, "{w}: {p:?}"))
                }
            };
            check_on(&what, &dev, &c, &route(true));
            let with_texels = outputs_with(&dev, &c, &route(true));
            let with_loads = outputs_with(&dev, &c, &route(false));
            assert!(
                with_texels == with_loads,
                "{what}: texel views change the bits"
            );
            texel += 1;
        }
    }
    // A and B as views 128 elements into buffers of their own (a model's flat
    // parameters): the views start there, on the device's alignment.
    dev.use_texel_gemm(true);
    let (m, n, k) = (19, 24, 33);
    let mut c = case(&mut rng, (m, n, k), (false, false), [f16_; 3]);
    let skip = 128;
    let a_all = random(&mut rng, f16_, skip + m * k);
    let b_all = random(&mut rng, f16_, skip + k * n);
    let tail = |h: &HostData, len| HostData::from_f32(f16_, &h.to_f32()[skip..skip + len]);
    c.a = tail(&a_all, m * k);
    c.b = tail(&b_all, k * n);
    let (pa, pb) = (put(&dev, &a_all), put(&dev, &b_all));
    let (va, vb) = (
        dev.view(pa, skip, m * k).unwrap(),
        dev.view(pb, skip, k * n).unwrap(),
    );
    let out = put(&dev, &c.c);
    let mm = Matmul {
        a: va,
        b: vb,
        c: out,
        ..c.mm.clone()
    };
    launch_as_spirv("views", &dev, &mm, |p| assert!(p.texel && p.vec_b, "{p:?}")).unwrap();
    dev.submit().unwrap();
    let got: Vec<u32> = dev
        .download(out)
        .unwrap()
        .to_f32()
        .iter()
        .map(|x| x.to_bits())
        .collect();
    let want = outputs(&dev, &c).0;
    assert!(
        got == want,
        "texel views of views: other bits than whole buffers"
    );
    for b in [va, vb, pa, pb, out] {
        dev.free(b).unwrap();
    }
    // Every case ran twice with texels and once with loads; the views twice more.
    assert_eq!(dev.gemm_launches(), (3 * texel + 2, 0));
}

/// Split K on `vk:0`: the SPIR-V GEMM sums each of the planner's K chunks into f32
/// partials and the WGSL `matmul_finish` (through naga) sums them with the epilogue;
/// every storage mix, transposes, strided and broadcast batches, alpha, beta, bias,
/// GELU and the f32 copy, against the CPU and bit for bit against wgpu's WGSL split
/// K; each split there (by route and counter).
#[test]
fn split_k_runs_as_spirv_on_vk() {
    let mut rng = Rng::new(2029);
    let dev = vk_device(false);
    let wgpu = gpu("vulkan", false);
    let (f32_, f16_, bf16) = (DType::F32, DType::F16, DType::BF16);
    let shapes = [
        ((2, 3, 1031), 1, None),
        ((13, 17, 2053), 2, Some(5)),
        ((3, 9, 1500), 2, None),
        ((4, 8, 1031), 2, Some(4)),
    ];
    let mut cases = 0;
    for (i, dtypes) in [[f32_; 3], [f16_; 3], [bf16; 3], [f16_, f16_, f32_]]
        .into_iter()
        .enumerate()
    {
        for (s, &(dims, batch, pad_b)) in shapes.iter().enumerate() {
            let trans = ((i + s) % 2 == 1, (i + s) % 4 >= 2);
            let mut c = strided_batch(&mut rng, dims, trans, dtypes, batch, 3, pad_b, 7);
            let (n, len) = (c.mm.n, c.c.len());
            c.c = random(&mut rng, dtypes[2], len);
            let mut mm = c.mm.clone();
            if s != 1 {
                mm = mm.scaled(0.75, -0.5);
                c.bias = Some(random(&mut rng, f32_, n));
                mm.bias = Some(handle(f32_, n));
                mm.gelu = true;
                mm.c_f32 = Some(handle(f32_, len));
            }
            c.mm = mm;
            let what = format!("vk SPIR-V split K: {dims:?} x{batch} {trans:?} {dtypes:?}");
            check_on(&what, &dev, &c, &|mm| {
                launch_as_spirv(&what, &dev, mm, |p| assert!(p.splits > 1, "{what}: {p:?}"))
            });
            same_bits_as_wgpu(&what, &dev, wgpu.as_ref(), &c);
            cases += 2;
        }
    }
    assert_eq!(dev.gemm_launches(), (cases, 0));
}

/// Launches `mm` on `dev` once it is sure the product routes to the SPIR-V twin of the
/// tiled GEMM or the GEMV and `check` accepts the plan.
fn launch_as_spirv_gpu(
    what: &str,
    dev: &kiln::vulkan::VkDevice,
    mm: &Matmul,
    check: impl Fn(&kiln::vulkan::GpuGemmPlan),
) -> kiln::engine::Result<()> {
    let route = dev.gemm_route(mm)?;
    let kiln::vulkan::GemmRoute::SpirvGpu(p) = route else {
        panic!("{what}: {route:?}")
    };
    check(&p);
    dev.launch(&Kernel::Matmul(mm.clone()))
}

/// wgpu's Vulkan device (lavapipe, as `vk:0`), to pin the WGSL kernel a twin mirrors.
fn wgpu_vulkan() -> WgpuDevice {
    WgpuDevice::open(adapter_index("vulkan"), &DeviceOptions::default()).unwrap()
}

/// One case of the GPU-class twins: `dims` x `batch` (`pad_b` None: B broadcast),
/// operands `dtypes`, and with `epilogue` alpha, beta, a bias of `bias_dtype`, GELU and
/// the f32 copy.
#[allow(clippy::too_many_arguments)]
fn twin_case(
    rng: &mut Rng,
    dims: (usize, usize, usize),
    batch: usize,
    pad_a: usize,
    pad_b: Option<usize>,
    trans: (bool, bool),
    dtypes: [DType; 3],
    epilogue: Option<DType>,
) -> Case {
    let mut c = strided_batch(rng, dims, trans, dtypes, batch, pad_a, pad_b, 7);
    if let Some(bias_dtype) = epilogue {
        let (n, len) = (c.mm.n, c.c.len());
        c.c = random(rng, dtypes[2], len);
        c.bias = Some(random(rng, bias_dtype, n));
        let mut mm = c.mm.clone().scaled(0.75, -0.5).with_gelu();
        mm.bias = Some(handle(bias_dtype, n));
        mm.c_f32 = Some(handle(DType::F32, len));
        c.mm = mm;
    }
    c
}

const TWIN_MIXES: [[DType; 3]; 5] = [
    [DType::F32; 3],
    [DType::F16; 3],
    [DType::BF16; 3],
    [DType::F16, DType::F16, DType::F32],
    [DType::F32, DType::F16, DType::BF16],
];
const TRANSPOSES: [(bool, bool); 4] = [(false, false), (false, true), (true, false), (true, true)];

/// The SPIR-V twin of the GPU-class tiled GEMM (`shaders/vulkan/matmul_tiled.comp`),
/// forced on `vk:0` (lavapipe's planner picks the CPU-class kernel): three tile shapes,
/// sizes of 1, primes and non-multiples of every tile, every transpose, strided batches
/// and a broadcast B, alpha, beta, a bias, GELU and the f32 copy, f32, f16, bf16 and
/// mixed storage, 16-byte loads and not, and split K; each routed there (by route and
/// counter) and checked against the CPU, and bit for bit against wgpu's WGSL tiled
/// kernel pinned to the same tile (same order of every sum, same epilogue).
#[test]
fn tiled_gemm_runs_as_spirv_on_vk() {
    let mut rng = Rng::new(2030);
    let dev = vk_device(false);
    let wgpu = wgpu_vulkan();
    let tiles = [(64, 64, 16), (32, 48, 8), (16, 16, 4)].map(|(bm, bn, bk)| MatmulVariant::Tiled {
        bm,
        bn,
        bk,
    });
    // (dims, batch, pad_a, pad_b, 16-byte loads of A and B in NN)
    let shapes = [
        ((1, 1, 1), 1, 0, Some(0), false),
        ((37, 29, 53), 1, 0, Some(0), false),
        ((65, 70, 17), 3, 3, Some(5), false),
        ((8, 36, 100), 2, 3, None, false),
        ((12, 20, 64), 2, 4, Some(4), true),
    ];
    let mut cases = 0;
    for (i, dtypes) in TWIN_MIXES.into_iter().enumerate() {
        for (s, &(dims, batch, pad_a, pad_b, vec)) in shapes.iter().enumerate() {
            let trans = TRANSPOSES[(i + s) % 4];
            let tile = tiles[(i + 2 * s) % 3];
            let bias_dtype = [None, Some(DType::F32), Some(dtypes[2])][(i + s) % 3];
            let c = twin_case(
                &mut rng, dims, batch, pad_a, pad_b, trans, dtypes, bias_dtype,
            );
            let what = format!(
                "vk tiled {tile:?}: {dims:?} x{batch} {trans:?} {dtypes:?} epilogue {bias_dtype:?}"
            );
            dev.force_gemm_variant(Some(tile));
            check_on(&what, &dev, &c, &|mm| {
                launch_as_spirv_gpu(&what, &dev, mm, |p| {
                    let kiln::vulkan::GpuKernel::Tiled { bm, bn, bk } = p.kernel else {
                        panic!("{what}: {p:?}")
                    };
                    assert_eq!(MatmulVariant::Tiled { bm, bn, bk }, tile, "{what}");
                    // 16-byte loads where the contiguous dimension and the batch
                    // stride are multiples of 4 (all of them in the last shape).
                    let fours = |dim: usize, stride: usize| {
                        dim.is_multiple_of(4) && (mm.batch == 1 || stride.is_multiple_of(4))
                    };
                    let a_dim = if mm.trans_a { mm.m } else { mm.k };
                    let b_dim = if mm.trans_b { mm.k } else { mm.n };
                    let want = (fours(a_dim, mm.stride_a), fours(b_dim, mm.stride_b));
                    assert_eq!((p.vec_a, p.vec_b), want, "{what}");
                    assert!(want == (true, true) || !vec, "{what}");
                    assert_eq!(p.splits, 1, "{what}");
                })
            });
            let vk = outputs(&dev, &c);
            let w = outputs_with(&wgpu, &c, &|mm| {
                wgpu.launch_matmul(mm, Some(tile)).map(drop)
            });
            assert!(vk == w, "{what}: vk and wgpu give different bits");
            cases += 2;
        }
    }
    // Long K over few tiles: the planner splits K, the twin writes the partials and
    // the WGSL matmul_finish sums them with the epilogue.
    for (i, (dims, batch, pad_b)) in [
        ((3, 9, 1500), 1, Some(0)),
        ((13, 17, 1031), 2, Some(5)),
        ((4, 8, 2053), 2, None),
    ]
    .into_iter()
    .enumerate()
    {
        let dtypes = TWIN_MIXES[(2 * i + 1) % 5];
        let trans = TRANSPOSES[i + 1];
        let tile = tiles[i];
        let c = twin_case(
            &mut rng,
            dims,
            batch,
            3,
            pad_b,
            trans,
            dtypes,
            Some(DType::F32),
        );
        let what = format!("vk tiled split K {tile:?}: {dims:?} x{batch} {trans:?} {dtypes:?}");
        dev.force_gemm_variant(Some(tile));
        check_on(&what, &dev, &c, &|mm| {
            launch_as_spirv_gpu(&what, &dev, mm, |p| assert!(p.splits > 1, "{what}: {p:?}"))
        });
        let vk = outputs(&dev, &c);
        let w = outputs_with(&wgpu, &c, &|mm| {
            wgpu.launch_matmul(mm, Some(tile)).map(drop)
        });
        assert!(vk == w, "{what}: vk and wgpu give different bits");
        cases += 2;
    }
    dev.force_gemm_variant(None);
    assert_eq!(dev.gemm_launches(), (cases, 0));
}

/// The SPIR-V twin of the GEMV (`shaders/vulkan/gemv.comp`), which the planner picks on
/// `vk:0` for N = 1: sizes of 1 and primes, every transpose, strided batches and a
/// broadcast B, the epilogue, every storage mix, and split K; each routed there (by
/// route and counter) and checked against the CPU, and bit for bit against wgpu's WGSL
/// GEMV (the same fixed reduction order).
#[test]
fn gemv_runs_as_spirv_on_vk() {
    let mut rng = Rng::new(2031);
    let dev = vk_device(false);
    let wgpu = wgpu_vulkan();
    let gemv = MatmulVariant::Gemv { lanes: 64 };
    // (dims, batch, pad_b, split K)
    let shapes = [
        ((1, 1, 32), 1, Some(0), false),
        ((37, 1, 53), 1, Some(0), false),
        ((65, 1, 300), 3, Some(5), false),
        ((8, 1, 100), 2, None, false),
        ((1, 1, 2048), 1, Some(0), true),
        ((2, 1, 3001), 2, Some(3), true),
    ];
    let mut cases = 0;
    for (i, dtypes) in TWIN_MIXES.into_iter().enumerate() {
        for (s, &(dims, batch, pad_b, split)) in shapes.iter().enumerate() {
            let trans = TRANSPOSES[(i + s) % 4];
            let bias_dtype = [None, Some(DType::F32), Some(dtypes[2])][(i + s) % 3];
            let c = twin_case(&mut rng, dims, batch, 3, pad_b, trans, dtypes, bias_dtype);
            let what =
                format!("vk gemv: {dims:?} x{batch} {trans:?} {dtypes:?} epilogue {bias_dtype:?}");
            check_on(&what, &dev, &c, &|mm| {
                launch_as_spirv_gpu(&what, &dev, mm, |p| {
                    assert_eq!(
                        p.kernel,
                        kiln::vulkan::GpuKernel::Gemv { lanes: 64 },
                        "{what}"
                    );
                    assert_eq!(p.splits > 1, split, "{what}: {p:?}");
                })
            });
            let vk = outputs(&dev, &c);
            let w = outputs_with(&wgpu, &c, &|mm| {
                wgpu.launch_matmul(mm, Some(gemv)).map(drop)
            });
            assert!(vk == w, "{what}: vk and wgpu give different bits");
            cases += 2;
        }
    }
    assert_eq!(dev.gemm_launches(), (cases, 0));
}

/// A GEMV of 70000 rows on `vk:0`: more workgroups than one dispatch allows, so the
/// twin runs the planner's row chunks, each from its first row; against the CPU and
/// bit for bit against wgpu's WGSL GEMV (chunked alike).
#[test]
fn a_tall_gemv_runs_in_row_chunks_on_vk() {
    let mut rng = Rng::new(2034);
    let dev = vk_device(false);
    let wgpu = wgpu_vulkan();
    let c = twin_case(
        &mut rng,
        (70000, 1, 40),
        1,
        0,
        Some(0),
        (true, false),
        [DType::F16; 3],
        Some(DType::F32),
    );
    let what = "vk gemv 70000x1x40";
    check_on(what, &dev, &c, &|mm| {
        launch_as_spirv_gpu(what, &dev, mm, |p| {
            assert_eq!(p.dispatches(mm).len(), 2, "{p:?}")
        })
    });
    let vk = outputs(&dev, &c);
    let w = outputs_with(&wgpu, &c, &|mm| {
        wgpu.launch_matmul(mm, Some(MatmulVariant::Gemv { lanes: 64 }))
            .map(drop)
    });
    assert!(vk == w, "{what}: vk and wgpu give different bits");
    assert_eq!(dev.gemm_launches(), (2, 0));
}

/// On `vk:0` with 16-bit storage off, the twins run every storage mix from their
/// `_packed` modules (the others declare 16-bit storage, which such a device lacks: the
/// validation layer would fail the launch): f16 and bf16 read two to a word, a 16-bit C
/// written by matmul_finish through the partials. Checked against the CPU and bit for
/// bit against wgpu's WGSL kernels on a device with f16 off (its packed path), the
/// tiled kernel forced and the GEMV the planner's own.
#[test]
fn the_twins_run_without_16bit_storage_on_vk() {
    let mut rng = Rng::new(2032);
    let dev = vk_device(true);
    let wgpu = WgpuDevice::open(
        adapter_index("vulkan"),
        &DeviceOptions {
            disable_f16: true,
            ..Default::default()
        },
    )
    .unwrap();
    let tile = MatmulVariant::Tiled {
        bm: 32,
        bn: 32,
        bk: 8,
    };
    let gemv = MatmulVariant::Gemv { lanes: 64 };
    // (kernel, dims, batch, pad_b)
    let shapes = [
        (Some(tile), (37, 29, 53), 2, Some(5)),
        (Some(tile), (12, 20, 64), 2, Some(4)),
        (Some(tile), (3, 9, 1500), 1, Some(0)),
        (None, (12, 1, 300), 2, None),
        (None, (37, 1, 53), 1, Some(0)),
    ];
    let mut cases = 0;
    for (i, dtypes) in TWIN_MIXES.into_iter().enumerate() {
        for (s, &(force, dims, batch, pad_b)) in shapes.iter().enumerate() {
            let trans = TRANSPOSES[(i + s) % 4];
            let bias_dtype = [None, Some(DType::F32), Some(dtypes[2])][(i + s) % 3];
            let c = twin_case(&mut rng, dims, batch, 4, pad_b, trans, dtypes, bias_dtype);
            let what = format!(
                "vk without 16-bit storage {force:?}: {dims:?} x{batch} {trans:?} {dtypes:?} \
                 epilogue {bias_dtype:?}"
            );
            dev.force_gemm_variant(force);
            check_on(&what, &dev, &c, &|mm| {
                launch_as_spirv_gpu(&what, &dev, mm, |p| {
                    assert!(p.packed && p.no_16bit_storage(), "{what}: {p:?}");
                    assert_eq!(p.partial_c, dtypes[2] != DType::F32, "{what}: {p:?}");
                })
            });
            let vk = outputs(&dev, &c);
            let pin = force.unwrap_or(gemv);
            let w = outputs_with(&wgpu, &c, &|mm| wgpu.launch_matmul(mm, Some(pin)).map(drop));
            assert!(vk == w, "{what}: vk and wgpu give different bits");
            cases += 2;
        }
    }
    // The CPU-class kernel has no packed build: such products name why they take naga
    // on a CPU driver; a GPU's planner picks the tiled GEMM, whose twin reads them packed.
    dev.force_gemm_variant(None);
    let c = case(&mut rng, (37, 29, 53), (false, false), [DType::F16; 3]);
    let f16 = Matmul {
        a: put(&dev, &c.a),
        b: put(&dev, &c.b),
        c: put(&dev, &c.c),
        ..c.mm.clone()
    };
    match dev.gemm_route(&f16).unwrap() {
        kiln::vulkan::GemmRoute::Naga(why) if dev.caps().device_type == "cpu" => {
            assert!(why.contains("native f16"), "{why}")
        }
        kiln::vulkan::GemmRoute::SpirvGpu(p) if dev.caps().device_type != "cpu" => {
            assert!(p.packed, "{p:?}")
        }
        other => panic!("f16 without 16-bit storage: {other:?}"),
    }
    assert_eq!(dev.gemm_launches(), (cases, 0));
}

/// `prepare` on `vk:0` builds the twins' pipelines (a split GEMV's with its
/// matmul_finish, a forced tiled one's) without running them: the launches after it
/// build nothing more, and they run in the twins.
#[test]
fn prepare_builds_the_twins_pipelines_on_vk() {
    let mut rng = Rng::new(2033);
    let dev = vk_device(false);
    dev.force_gemm_variant(Some(MatmulVariant::Tiled {
        bm: 48,
        bn: 16,
        bk: 12,
    }));
    let cases = [
        twin_case(
            &mut rng,
            (2, 1, 3001),
            2,
            3,
            Some(3),
            (false, false),
            [DType::BF16; 3],
            Some(DType::F32),
        ),
        twin_case(
            &mut rng,
            (50, 19, 29),
            1,
            0,
            Some(0),
            (true, true),
            [DType::F16; 3],
            None,
        ),
    ];
    let kernels: Vec<Kernel> = cases
        .iter()
        .map(|c| {
            let mut mm = Matmul {
                a: put(&dev, &c.a),
                b: put(&dev, &c.b),
                c: put(&dev, &c.c),
                ..c.mm.clone()
            };
            mm.bias = c.bias.as_ref().map(|h| put(&dev, h));
            mm.c_f32 =
                c.mm.c_f32
                    .map(|cf| put(&dev, &HostData::F32(vec![0.0; cf.len])));
            let route = dev.gemm_route(&mm).unwrap();
            assert!(
                matches!(route, kiln::vulkan::GemmRoute::SpirvGpu(_)),
                "{route:?}"
            );
            Kernel::Matmul(mm)
        })
        .collect();
    let before = dev.pipeline_count();
    dev.prepare(&kernels).unwrap();
    let built = dev.pipeline_count();
    // The two twins and the split's matmul_finish.
    assert_eq!(built - before, 3);
    assert_eq!(dev.gemm_launches(), (0, 0), "prepare ran nothing");
    for k in &kernels {
        dev.launch(k).unwrap();
    }
    dev.submit().unwrap();
    dev.wait().unwrap();
    assert_eq!(
        dev.pipeline_count(),
        built,
        "the launches built something more"
    );
    assert_eq!(dev.gemm_launches(), (2, 0));
    dev.force_gemm_variant(None);
}

/// `per` random shapes of every dtype mix and transpose, then the edge shapes every
/// kernel must get right, each checked against the CPU; how many were checked.
fn random_shapes(
    rng: &mut Rng,
    name: &str,
    dev: &dyn Device,
    launch: &dyn Fn(&Matmul) -> kiln::engine::Result<()>,
    per: usize,
) -> usize {
    let mut shapes = 0;
    let dtype_sets = [
        [DType::F32, DType::F32, DType::F32],
        [DType::F16, DType::F16, DType::F16],
        [DType::BF16, DType::BF16, DType::BF16],
        [DType::F16, DType::F16, DType::F32],
    ];
    for dtypes in dtype_sets {
        for trans in [(false, false), (false, true), (true, false), (true, true)] {
            for _ in 0..per {
                let dims = (
                    pick(rng, &AWKWARD),
                    pick(rng, &AWKWARD),
                    pick(rng, &AWKWARD),
                );
                let c = case(rng, dims, trans, dtypes);
                let what = format!("{name}: {dims:?} trans {trans:?} {dtypes:?}");
                check_on(&what, dev, &c, launch);
                shapes += 1;
            }
        }
    }
    for dims in [
        (1, 1, 1),
        (1, 1, 2000),
        (97, 89, 1),
        (2, 3, 1031),
        (65, 1, 300),
        (1, 67, 129),
    ] {
        let c = case(rng, dims, (false, false), [DType::F16; 3]);
        check_on(&format!("{name}: edge {dims:?}"), dev, &c, launch);
        shapes += 1;
    }
    shapes
}

#[test]
fn every_variant_matches_cpu() {
    let mut rng = Rng::new(7);
    let dev = &wgpu_paths()[0].1;
    let variants = [
        MatmulVariant::Naive,
        MatmulVariant::Tiled {
            bm: 64,
            bn: 64,
            bk: 16,
        },
        MatmulVariant::Cpu { tm: 16, nv: 2 },
        MatmulVariant::Cpu { tm: 4, nv: 1 },
    ];
    for v in variants {
        for dtypes in [[DType::F32; 3], [DType::F16; 3], [DType::BF16; 3]] {
            for trans in [(false, false), (false, true), (true, false)] {
                for dims in [(1, 1, 1), (67, 131, 97), (3, 5, 1100), (64, 64, 16)] {
                    let c = case(&mut rng, dims, trans, dtypes);
                    check(
                        &format!("{v:?} {dims:?} {trans:?} {dtypes:?}"),
                        dev,
                        &c,
                        Some(v),
                    );
                }
            }
        }
    }
    for dims in [(5, 1, 300), (64, 1, 33), (1, 1, 1)] {
        let c = case(&mut rng, dims, (true, false), [DType::F16; 3]);
        check(
            &format!("gemv {dims:?}"),
            dev,
            &c,
            Some(MatmulVariant::Gemv { lanes: 64 }),
        );
    }
}

/// Tile shapes are pipeline constants of one module: shapes other than the tuned
/// defaults (smaller, non-square, other K steps, other GEMV widths) must give the same
/// results on both f16 paths, over shapes that are multiples of no tile, with 16-byte
/// loads (dims multiples of 4) and without, and with K split.
#[test]
fn non_default_tile_shapes_match_cpu() {
    let mut rng = Rng::new(31);
    let tiles = [
        MatmulVariant::Tiled {
            bm: 32,
            bn: 32,
            bk: 8,
        },
        MatmulVariant::Tiled {
            bm: 16,
            bn: 48,
            bk: 4,
        },
        MatmulVariant::Tiled {
            bm: 128,
            bn: 32,
            bk: 12,
        },
    ];
    for (name, dev) in &wgpu_paths() {
        for v in tiles {
            for dtypes in [[DType::F32; 3], [DType::F16; 3]] {
                for trans in [(false, false), (true, true)] {
                    for dims in [(1, 1, 1), (37, 53, 29), (68, 100, 44), (3, 5, 2051)] {
                        let c = case(&mut rng, dims, trans, dtypes);
                        check(
                            &format!("{name}: {} {dims:?} {trans:?} {dtypes:?}", v.name()),
                            dev,
                            &c,
                            Some(v),
                        );
                    }
                }
            }
        }
        for lanes in [16, 128] {
            for dims in [(37, 1, 300), (5, 1, 2053)] {
                let c = case(&mut rng, dims, (true, false), [DType::F16; 3]);
                check(
                    &format!("{name}: gemv{lanes} {dims:?}"),
                    dev,
                    &c,
                    Some(MatmulVariant::Gemv { lanes }),
                );
            }
        }
    }
}

#[test]
fn bad_tile_shapes_are_errors() {
    for bad in [
        "tiled24x64x16",
        "tiled64x64x6",
        "tiled128x128x16",
        "gemv48",
        "cpu0x8",
    ] {
        let e = bad.parse::<MatmulVariant>().unwrap_err().to_string();
        assert!(e.contains(bad), "{bad}: {e}");
    }
    let e = "tiled128x128x16".parse::<MatmulVariant>().unwrap_err();
    assert!(e.to_string().contains("workgroup memory"), "{e}");
    assert_eq!(
        "tiled32x48x8".parse::<MatmulVariant>().unwrap(),
        MatmulVariant::Tiled {
            bm: 32,
            bn: 48,
            bk: 8
        }
    );
    assert_eq!(
        "tiled64".parse::<MatmulVariant>().unwrap().name(),
        "tiled64x64x16"
    );
    // A pinned shape is checked at launch too, not handed to the compiler.
    let dev = &wgpu_paths()[0].1;
    let (a, b, c) = (
        dev.alloc(DType::F32, 4).unwrap(),
        dev.alloc(DType::F32, 4).unwrap(),
        dev.alloc(DType::F32, 4).unwrap(),
    );
    let mm = Matmul::new(a, b, c, 2, 2, 2);
    let e = dev
        .launch_matmul(
            &mm,
            Some(MatmulVariant::Tiled {
                bm: 20,
                bn: 16,
                bk: 4,
            }),
        )
        .unwrap_err();
    assert!(e.to_string().contains("multiples of 16"), "{e}");
}

#[test]
fn epilogue_batches_and_split_k_match_cpu() {
    let mut rng = Rng::new(99);
    for (name, dev) in &wgpu_paths() {
        for dtypes in [
            [DType::F32; 3],
            [DType::F16; 3],
            [DType::BF16, DType::BF16, DType::F16],
        ] {
            // alpha, beta (C read), bias, GELU and the f32 copy, in one launch.
            let dims = (19, 24, 37);
            let mut c = case(&mut rng, dims, (false, true), dtypes);
            c.c = HostData::from_f32(
                dtypes[2],
                &(0..19 * 24)
                    .map(|_| rng.uniform(-1.0, 1.0))
                    .collect::<Vec<_>>(),
            );
            c.bias = Some(HostData::from_f32(
                DType::BF16,
                &(0..24).map(|_| rng.uniform(-1.0, 1.0)).collect::<Vec<_>>(),
            ));
            let mut mm = c.mm.clone().scaled(0.5, -1.25).with_gelu();
            mm.bias = Some(kiln::engine::Buffer {
                id: 0,
                dtype: DType::BF16,
                len: 24,
            });
            mm.c_f32 = Some(kiln::engine::Buffer {
                id: 0,
                dtype: DType::F32,
                len: 19 * 24,
            });
            c.mm = mm;
            check(&format!("{name}: epilogue {dtypes:?}"), dev, &c, None);

            // A batch of 3 with gaps between outputs and B shared by every matrix.
            let (m, n, k) = (5, 7, 9);
            let mut c = case(&mut rng, (m, n, k), (false, false), dtypes);
            c.a = HostData::from_f32(
                dtypes[0],
                &(0..3 * m * k)
                    .map(|_| rng.uniform(-1.0, 1.0))
                    .collect::<Vec<_>>(),
            );
            c.c = HostData::from_f32(dtypes[2], &vec![3.5; 2 * 40 + m * n]);
            c.mm = Matmul::new(
                kiln::engine::Buffer {
                    id: 0,
                    dtype: dtypes[0],
                    len: 3 * m * k,
                },
                c.mm.b,
                kiln::engine::Buffer {
                    id: 0,
                    dtype: dtypes[2],
                    len: 2 * 40 + m * n,
                },
                m,
                n,
                k,
            )
            .batched(3, m * k, 0, 40);
            check(&format!("{name}: batch {dtypes:?}"), dev, &c, None);

            // Tall-skinny with long K: the planner splits K.
            let c = case(&mut rng, (3, 5, 3000), (true, false), dtypes);
            let plan =
                kiln::wgpu::plan_matmul(&c.mm, kiln::engine::Device::caps(dev), None).unwrap();
            assert!(plan.splits > 1, "{name}: 3x5x3000 was not split: {plan:?}");
            check(&format!("{name}: split-K {dtypes:?}"), dev, &c, None);
        }
    }
}

#[test]
fn bad_matmuls_are_errors() {
    let dev = gpu("vulkan", false);
    let a = dev.alloc(DType::F16, 6).unwrap();
    let b = dev.alloc(DType::F16, 6).unwrap();
    let c = dev.alloc(DType::F16, 4).unwrap();
    let ints = dev.alloc(DType::U32, 6).unwrap();
    let bad = [
        Matmul::new(a, b, c, 2, 2, 4),
        Matmul::new(ints, b, c, 2, 2, 3),
        Matmul::new(a, b, c, 2, 2, 3).batched(0, 6, 6, 4),
        Matmul::new(a, b, c, 2, 2, 3).with_bias(a),
        Matmul::new(a, b, c, 2, 2, 3).scaled(f32::NAN, 0.0),
        Matmul::new(a, b, c, 2, 2, 3).with_f32_copy(c),
    ];
    for mm in bad {
        let e = dev
            .launch(&Kernel::Matmul(mm.clone()))
            .expect_err(&format!("{mm:?}"));
        assert!(
            e.to_string().starts_with("invalid argument: matmul:"),
            "{e}"
        );
    }
    // Sizes that wrap around usize are caught, not passed to unchecked kernels.
    let huge = Matmul::new(a, b, c, 1, 1, 1).batched(4, 1, 1, 0x5555_5555_5555_5556);
    let e = dev.launch(&Kernel::Matmul(huge)).unwrap_err();
    assert!(e.to_string().contains("overflows"), "{e}");
    // Writing C over an input is refused (the GPU cannot bind it both ways).
    let sq = dev.alloc(DType::F16, 4).unwrap();
    let e = dev
        .launch(&Kernel::Matmul(Matmul::new(sq, b, sq, 2, 2, 2)))
        .unwrap_err();
    assert!(e.to_string().contains("both written"), "{e}");
    // An empty product is a no-op, whatever its batch.
    let empty = Matmul::new(a, b, c, 0, 2, 3).batched(10_000, 0, 0, 0);
    dev.launch(&Kernel::Matmul(empty)).unwrap();
}

#[test]
fn handles_from_another_device_are_refused() {
    let paths = wgpu_paths();
    let (d0, d1) = (&paths[0].1, &paths[1].1);
    // Same ids on both devices, different sizes.
    let big: Vec<_> = (0..3)
        .map(|_| d0.alloc(DType::F32, 1 << 16).unwrap())
        .collect();
    let small: Vec<_> = (0..3).map(|_| d1.alloc(DType::F32, 4).unwrap()).collect();
    assert_eq!(big[0].id, small[0].id);
    let mm = Matmul::new(big[0], big[1], big[2], 256, 256, 256);
    let e = d1.launch_matmul(&mm, None).unwrap_err();
    assert!(e.to_string().contains("another device"), "{e}");
    let e = d1.launch(&Kernel::Matmul(mm)).unwrap_err();
    assert!(e.to_string().contains("another device"), "{e}");
}

/// Per-binding limit of the devices the splitting tests open: far below any adapter's,
/// so that operands over it are kilobytes, and a multiple of no tile or row length.
const SMALL_BINDING: u64 = 20_000;

/// `wgpu_paths`, opened with the per-binding limit lowered to `SMALL_BINDING`.
fn limited_paths() -> Vec<(&'static str, WgpuDevice)> {
    let open = |backend: &str, disable_f16| {
        let i = adapter_index(backend);
        let dev = WgpuDevice::open(
            i,
            &DeviceOptions {
                disable_f16,
                max_storage_binding: Some(SMALL_BINDING),
                ..Default::default()
            },
        )
        .unwrap();
        assert_eq!(
            kiln::engine::Device::caps(&dev).max_storage_binding,
            SMALL_BINDING
        );
        dev
    };
    vec![
        ("vulkan (native f16)", open("vulkan", false)),
        ("vulkan (packed f16)", open("vulkan", true)),
        ("gl (packed f16)", open("gl", false)),
    ]
}

fn random(rng: &mut Rng, dtype: DType, len: usize) -> HostData {
    HostData::from_f32(
        dtype,
        &(0..len).map(|_| rng.uniform(-1.0, 1.0)).collect::<Vec<_>>(),
    )
}

fn handle(dtype: DType, len: usize) -> kiln::engine::Buffer {
    kiln::engine::Buffer { id: 0, dtype, len }
}

/// Gives `c` alpha, beta (C read, so it starts finite), a bias, GELU and the f32 copy.
fn with_epilogue(rng: &mut Rng, mut c: Case) -> Case {
    let (n, len) = (c.mm.n, c.c.len());
    c.c = random(rng, c.mm.c.dtype, len);
    c.bias = Some(random(rng, DType::F32, n));
    let mut mm = c.mm.clone().scaled(0.75, -0.5).with_gelu();
    mm.bias = Some(handle(DType::F32, n));
    mm.c_f32 = Some(handle(DType::F32, len));
    c.mm = mm;
    c
}

/// A batch of `batch` matrices whose operands lie `pad_*` elements further apart than
/// their size: strides a multiple of nothing, so no group of matrices starts aligned.
#[allow(clippy::too_many_arguments)]
fn strided_batch(
    rng: &mut Rng,
    dims: (usize, usize, usize),
    trans: (bool, bool),
    dtypes: [DType; 3],
    batch: usize,
    pad_a: usize,
    pad_b: Option<usize>,
    pad_c: usize,
) -> Case {
    let (m, n, k) = dims;
    let [da, db, dc] = dtypes;
    let (sa, sc) = (m * k + pad_a, m * n + pad_c);
    // pad_b None: one B shared by every matrix (stride 0).
    let sb = pad_b.map_or(0, |p| k * n + p);
    let (la, lb, lc) = (
        (batch - 1) * sa + m * k,
        (batch - 1) * sb + k * n,
        (batch - 1) * sc + m * n,
    );
    let mm = Matmul::new(handle(da, la), handle(db, lb), handle(dc, lc), m, n, k)
        .transpose(trans.0, trans.1)
        .batched(batch, sa, sb, sc);
    Case {
        mm,
        a: random(rng, da, la),
        b: random(rng, db, lb),
        // Not outputs between the strides: check() asserts they keep these values.
        c: HostData::from_f32(dc, &vec![2.5; lc]),
        bias: None,
    }
}

/// Operands over the per-binding limit are split across dispatches and bindings, never
/// refused: every case the old row bands could not take (B or the bias over the limit,
/// A transposed, batch strides that allow no aligned group, one matrix over the limit,
/// a single row over the limit so that K is split with the epilogue applied once),
/// f32, f16 and f16 in / f32 out, on both f16 paths, against the CPU reference.
#[test]
fn operands_over_the_binding_limit_are_split() {
    let mut rng = Rng::new(77);
    let limit = SMALL_BINDING as usize;
    for (name, dev) in &limited_paths() {
        let mixed = [DType::F16, DType::F16, DType::F32];
        for dtypes in [[DType::F32; 3], [DType::F16; 3], mixed] {
            let what = |case: &str| format!("{name} {dtypes:?}: {case}");
            let over = |b: kiln::engine::Buffer| b.bytes() as usize > limit;
            // (a) batch 1, B over the limit: NN (columns of B split) and NT (rows of
            // the stored B); the bias (10007 elements) over it too, C's rows as well.
            for trans in [(false, false), (false, true)] {
                let c = case(&mut rng, (9, 211, 97), trans, dtypes);
                assert!(over(c.mm.b) && !over(c.mm.a));
                check(&what(&format!("B over, {trans:?}")), dev, &c, None);
            }
            let c = case(&mut rng, (3, 10007, 5), (false, true), dtypes);
            let c = with_epilogue(&mut rng, c);
            assert!(over(c.mm.bias.unwrap()) && over(c.mm.c));
            check(&what("bias and C rows over"), dev, &c, None);
            // (b) A transposed: A, B (f32) and C over the limit, TN and TT.
            for trans in [(true, false), (true, true)] {
                let c = case(&mut rng, (151, 73, 89), trans, dtypes);
                assert!(over(c.mm.a) && over(c.mm.c));
                check(&what(&format!("A^T and C over, {trans:?}")), dev, &c, None);
            }
            // One row of A (and B's K extent) over the limit: K is split into bands
            // that accumulate in f32; alpha, beta, bias, GELU and the copy apply once.
            let c = case(&mut rng, (5, 7, 10007), (false, false), dtypes);
            let c = with_epilogue(&mut rng, c);
            assert!(c.mm.k * c.mm.a.dtype.size() > limit);
            check(&what("K split, epilogue"), dev, &c, None);
            // The same through the GEMV kernel (n = 1), and a pinned non-default tile.
            let c = case(&mut rng, (37, 1, 10007), (false, false), dtypes);
            check(&what("K split, gemv"), dev, &c, None);
            let c = case(&mut rng, (61, 83, 10007), (true, false), dtypes);
            let tiled = MatmulVariant::Tiled {
                bm: 32,
                bn: 48,
                bk: 8,
            };
            check(&what("A^T, K split, tiled32x48x8"), dev, &c, Some(tiled));
            // (c) batches: strides that allow no aligned group of matrices ...
            let c = strided_batch(
                &mut rng,
                (29, 31, 37),
                (false, false),
                dtypes,
                13,
                4,
                Some(2),
                3,
            );
            assert!(over(c.mm.a) && over(c.mm.b) && over(c.mm.c));
            check(&what("batch, unaligned strides"), dev, &c, None);
            // ... and matrices that alone exceed the limit, B shared (stride 0), A^T.
            let c = strided_batch(
                &mut rng,
                (101, 103, 107),
                (true, false),
                dtypes,
                3,
                1,
                None,
                3,
            );
            assert!(over(c.mm.b) && (c.mm.m * c.mm.k * c.mm.a.dtype.size()) > limit);
            check(&what("batch, one matrix over"), dev, &c, None);
        }
    }
}

/// On the adapter's real limit: A and C bigger than one binding (hundreds of MiB on
/// lavapipe), split with no error, the result spot-checked against the CPU.
#[test]
fn operands_over_the_adapter_binding_limit_are_split() {
    let dev = &wgpu_paths()[0].1;
    let limit = kiln::engine::Device::caps(dev).max_storage_binding as usize;
    let mut rng = Rng::new(5);
    // C (f32) and its f32 copy are larger than one binding; K = 1 keeps it cheap.
    let n = 4100;
    let m = limit / (4 * n) + 5;
    let mut c = case(
        &mut rng,
        (m, n, 1),
        (false, false),
        [DType::F16, DType::F16, DType::F32],
    );
    c.mm.c_f32 = Some(handle(DType::F32, m * n));
    assert!(c.mm.c.bytes() as usize > limit);
    check("C over the binding limit", dev, &c, None);
}
