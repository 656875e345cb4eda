//! `kiln bench peak`: what an adapter can do at best, as the denominator of a profile's
//! MFU. An FMA-bound kernel gives arithmetic throughput and a copy kernel memory
//! bandwidth; each run is sized from a first short one to last a few tenths of a second
//! (so the whole measure stays within seconds even on a CPU adapter), best of three.

use std::time::{Duration, Instant};

use kiln_engine::{Error, Result};
use serde::{Deserialize, Serialize};

use crate::device::WgpuDevice;

const FMA: &str = include_str!(concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/../../shaders/bench/peak_fma.wgsl"
));
const COPY: &str = include_str!(concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/../../shaders/bench/peak_copy.wgsl"
));

/// An adapter's measured peak.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Peak {
    /// f32 fused multiply-adds, counted as 2 FLOPs each.
    pub gflops: f64,
    /// Bytes read plus bytes written per second, by a copy.
    pub gbps: f64,
}

/// Workgroups per dispatch row (the WebGPU per-dimension limit is 65535).
const ROW: u32 = 1024;
/// How long one timed run should last.
const TARGET: Duration = Duration::from_millis(300);

impl WgpuDevice {
    /// Measures this adapter's f32 FMA throughput and copy bandwidth.
    pub fn measure_peak(&self) -> Result<Peak> {
        self.call(|| {
            let gflops = self.peak_fma()?;
            let gbps = self.peak_copy()?;
            Ok(Peak { gflops, gbps })
        })
    }

    fn peak_pipeline(&self, source: &str, label: &str) -> Result<wgpu::ComputePipeline> {
        let scope = self.device.push_error_scope(wgpu::ErrorFilter::Validation);
        let module = self
            .device
            .create_shader_module(wgpu::ShaderModuleDescriptor {
                label: Some(label),
                source: wgpu::ShaderSource::Wgsl(source.into()),
            });
        let pipeline = self
            .device
            .create_compute_pipeline(&wgpu::ComputePipelineDescriptor {
                label: Some(label),
                layout: None,
                module: &module,
                entry_point: Some("main"),
                compilation_options: Default::default(),
                cache: None,
            });
        if let Some(e) = pollster::block_on(scope.pop()) {
            return Err(self.backend_error(format!("{label} failed to build: {e}")));
        }
        Ok(pipeline)
    }

    /// Runs `record` in one submission and returns the wall time until it finished.
    fn timed(&self, record: impl FnOnce(&mut wgpu::CommandEncoder)) -> Result<Duration> {
        let mut encoder = self
            .device
            .create_command_encoder(&wgpu::CommandEncoderDescriptor { label: None });
        record(&mut encoder);
        let start = Instant::now();
        self.queue.submit([encoder.finish()]);
        self.device
            .poll(wgpu::PollType::wait_indefinitely())
            .map_err(|e| self.backend_error(format!("waiting for the peak kernels: {e}")))?;
        Ok(start.elapsed())
    }

    /// Best time of three runs after a sizing run: returns (work units, seconds) for a
    /// run function taking a work size.
    fn best_of_three(
        &self,
        first: u32,
        max: u32,
        run: impl Fn(u32) -> Result<Duration>,
    ) -> Result<(u32, f64)> {
        // The first run also compiles the pipeline on some drivers: size from a second.
        run(first)?;
        let probe = run(first)?.as_secs_f64().max(1e-6);
        let scale = TARGET.as_secs_f64() / probe;
        let size = ((first as f64 * scale) as u32).clamp(first, max);
        let mut best = f64::INFINITY;
        for _ in 0..3 {
            best = best.min(run(size)?.as_secs_f64());
        }
        Ok((size, best))
    }

    fn peak_fma(&self) -> Result<f64> {
        let pipeline = self.peak_pipeline(FMA, "kiln peak fma")?;
        let groups = 1024u32;
        let invocations = groups as u64 * 64;
        let out = self.device.create_buffer(&wgpu::BufferDescriptor {
            label: Some("kiln peak fma out"),
            size: invocations * 16,
            usage: wgpu::BufferUsages::STORAGE,
            mapped_at_creation: false,
        });
        let params = self.device.create_buffer(&wgpu::BufferDescriptor {
            label: Some("kiln peak fma params"),
            size: 16,
            usage: wgpu::BufferUsages::UNIFORM | wgpu::BufferUsages::COPY_DST,
            mapped_at_creation: false,
        });
        let bind = self.device.create_bind_group(&wgpu::BindGroupDescriptor {
            label: None,
            layout: &pipeline.get_bind_group_layout(0),
            entries: &[
                wgpu::BindGroupEntry {
                    binding: 0,
                    resource: params.as_entire_binding(),
                },
                wgpu::BindGroupEntry {
                    binding: 1,
                    resource: out.as_entire_binding(),
                },
            ],
        });
        let run = |iterations: u32| {
            let words = [iterations, 0.5f32.to_bits(), 0, 0];
            self.queue
                .write_buffer(&params, 0, bytemuck::cast_slice(&words));
            self.timed(|e| {
                let mut pass = e.begin_compute_pass(&Default::default());
                pass.set_pipeline(&pipeline);
                pass.set_bind_group(0, &bind, &[]);
                pass.dispatch_workgroups(groups.min(ROW), groups.div_ceil(ROW), 1);
            })
        };
        let (iterations, secs) = self.best_of_three(64, 1 << 24, run)?;
        // 8 vec4 FMAs per round: 32 multiply-adds, 64 FLOPs.
        let flops = invocations as f64 * iterations as f64 * 64.0;
        positive(self, "FMA", flops / secs / 1e9)
    }

    fn peak_copy(&self) -> Result<f64> {
        let pipeline = self.peak_pipeline(COPY, "kiln peak copy")?;
        // 32 MiB each way: past any cache, well under every adapter's binding limit.
        let bytes: u64 = (32 << 20).min(self.caps.max_storage_binding / 16 * 16);
        let buffer = |label| {
            self.device.create_buffer(&wgpu::BufferDescriptor {
                label: Some(label),
                size: bytes,
                usage: wgpu::BufferUsages::STORAGE,
                mapped_at_creation: false,
            })
        };
        let (src, dst) = (buffer("kiln peak copy src"), buffer("kiln peak copy dst"));
        let bind = self.device.create_bind_group(&wgpu::BindGroupDescriptor {
            label: None,
            layout: &pipeline.get_bind_group_layout(0),
            entries: &[
                wgpu::BindGroupEntry {
                    binding: 0,
                    resource: src.as_entire_binding(),
                },
                wgpu::BindGroupEntry {
                    binding: 1,
                    resource: dst.as_entire_binding(),
                },
            ],
        });
        let groups = (bytes / 16).div_ceil(64) as u32;
        let run = |copies: u32| {
            self.timed(|e| {
                for _ in 0..copies {
                    let mut pass = e.begin_compute_pass(&Default::default());
                    pass.set_pipeline(&pipeline);
                    pass.set_bind_group(0, &bind, &[]);
                    pass.dispatch_workgroups(groups.min(ROW), groups.div_ceil(ROW), 1);
                }
            })
        };
        let (copies, secs) = self.best_of_three(1, 256, run)?;
        positive(
            self,
            "copy",
            2.0 * bytes as f64 * copies as f64 / secs / 1e9,
        )
    }
}

fn positive(dev: &WgpuDevice, what: &str, rate: f64) -> Result<f64> {
    if rate.is_finite() && rate > 0.0 {
        Ok(rate)
    } else {
        Err(Error::Backend {
            device: dev.caps.name.clone(),
            detail: format!("the {what} peak measured {rate}: the adapter's timing is unusable"),
        })
    }
}
