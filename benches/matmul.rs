//! Criterion benchmark of the GEMM kernels on the first Vulkan adapter: the planner's
//! choice and the naive baseline, f32 and f16, at sizes that fit a CI run. The full
//! table with the CPU reference is `kiln bench matmul` (see benches/RESULTS.md).

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use kiln::engine::{DType, Device, HostData, Matmul};
use kiln::wgpu::{find_adapter, DeviceOptions, MatmulVariant, WgpuDevice};

fn matmul(c: &mut Criterion) {
    let index = find_adapter("vulkan").unwrap_or_else(|e| panic!("{e}"));
    let dev = WgpuDevice::open(index, &DeviceOptions::default()).expect("open device");
    let mut group = c.benchmark_group(format!("matmul/{}", dev.caps().name));
    group.sample_size(10);
    for dtype in [DType::F32, DType::F16] {
        for n in [256usize, 512] {
            let data = HostData::from_f32(dtype, &vec![0.5; n * n]);
            let a = dev.alloc(dtype, n * n).unwrap();
            let b = dev.alloc(dtype, n * n).unwrap();
            let out = dev.alloc(dtype, n * n).unwrap();
            dev.upload(a, &data).unwrap();
            dev.upload(b, &data).unwrap();
            let mm = Matmul::new(a, b, out, n, n, n);
            group.throughput(Throughput::Elements(mm.flops() as u64));
            let variants: &[Option<MatmulVariant>] = if n <= 256 {
                &[None, Some(MatmulVariant::Naive)]
            } else {
                &[None]
            };
            for &v in variants {
                let name = v.map_or("planned".to_string(), |v| v.name());
                group.bench_with_input(
                    BenchmarkId::new(format!("{dtype}/{name}"), n),
                    &mm,
                    |bench, mm| {
                        bench.iter(|| {
                            dev.launch_matmul(mm, v).unwrap();
                            dev.submit().unwrap();
                            dev.wait().unwrap();
                        })
                    },
                );
            }
            for buf in [a, b, out] {
                dev.free(buf).unwrap();
            }
        }
    }
    group.finish();
}

criterion_group!(benches, matmul);
criterion_main!(benches);
