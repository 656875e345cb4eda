//! Priming a software driver's machine code away from its queue (lavapipe).
//!
//! Lavapipe turns a pipeline into machine code when it first runs it, on the one
//! thread that runs the device's queue, and keeps that code in Mesa's shader cache on
//! disk, keyed by the shader, not by the device. A big GEMM block takes tens of
//! seconds there on a cold cache (a fused attention pass with 4 rows per lane, 3–7 s),
//! and every launch queued behind its first run waits.
//! So a compile worker first runs such a block once on a device of its own on the same
//! adapter, opened exactly like the training device (so the driver sees the same
//! shader), with one-element operands: the machine code lands in the cache, and the
//! training device's first run finds it there instead of stopping its queue. Until
//! then the block counts as building, so launches run a stand-in.
//!
//! Without Mesa's disk cache (`MESA_SHADER_CACHE_DISABLE`) nothing would be kept, so
//! nothing is primed.

/// A second device on the training device's adapter, for first runs only.
pub(crate) struct Primer {
    device: wgpu::Device,
    queue: wgpu::Queue,
    /// Pipelines run once here so far.
    pub(crate) primed: std::sync::atomic::AtomicU64,
    /// Tests hold runs back to see launches run stand-ins ([`crate::WgpuDevice::hold_primer`]).
    held: (std::sync::Mutex<bool>, std::sync::Condvar),
}

/// One pipeline to run once: what the training device builds, in its parts.
pub(crate) struct Prime {
    pub source: String,
    /// The module skips the compiler's bounds checks (as the training device's does:
    /// the driver must see the same shader).
    pub trusted: bool,
    pub entries: Vec<wgpu::BindGroupLayoutEntry>,
    pub params_size: u64,
    pub constants: Vec<(&'static str, f64)>,
}

impl Primer {
    /// Opens the second device with the training device's descriptor; `None` when the
    /// adapter refuses (priming only saves time, so training goes on without it).
    pub(crate) fn open(adapter: &wgpu::Adapter, desc: &wgpu::DeviceDescriptor) -> Option<Primer> {
        let (device, queue) = pollster::block_on(adapter.request_device(desc)).ok()?;
        Some(Primer {
            device,
            queue,
            primed: Default::default(),
            held: Default::default(),
        })
    }

    /// Builds `p` and runs it once over one workgroup, waiting for the driver.
    pub(crate) fn run_once(&self, p: &Prime) -> Result<(), String> {
        let (held, changed) = &self.held;
        let mut h = held.lock().unwrap_or_else(|e| e.into_inner());
        while *h {
            h = changed.wait(h).unwrap_or_else(|e| e.into_inner());
        }
        drop(h);
        let d = &self.device;
        let scope = d.push_error_scope(wgpu::ErrorFilter::Validation);
        let desc = wgpu::ShaderModuleDescriptor {
            label: Some("kiln primer"),
            source: wgpu::ShaderSource::Wgsl(p.source.as_str().into()),
        };
        let module = if p.trusted {
            // SAFETY: as for the training device's module of this source: trusted
            // kernels clamp every index into their buffers and bound their loops by
            // the launch parameters, here all ones (one-element operands).
            unsafe { d.create_shader_module_trusted(desc, wgpu::ShaderRuntimeChecks::unchecked()) }
        } else {
            d.create_shader_module(desc)
        };
        let bgl = d.create_bind_group_layout(&wgpu::BindGroupLayoutDescriptor {
            label: Some("kiln primer bindings"),
            entries: &p.entries,
        });
        let layout = d.create_pipeline_layout(&wgpu::PipelineLayoutDescriptor {
            label: Some("kiln primer layout"),
            bind_group_layouts: &[Some(&bgl)],
            immediate_size: 0,
        });
        let pipeline = d.create_compute_pipeline(&wgpu::ComputePipelineDescriptor {
            label: Some("kiln primer"),
            layout: Some(&layout),
            module: &module,
            entry_point: Some("main"),
            compilation_options: wgpu::PipelineCompilationOptions {
                constants: &p.constants,
                zero_initialize_workgroup_memory: false,
            },
            cache: None,
        });
        // Parameters all ones: every size and count 1, so every loop is short and every
        // index lands in the one-element operands.
        let params = d.create_buffer(&wgpu::BufferDescriptor {
            label: Some("kiln primer params"),
            size: p.params_size.next_multiple_of(16),
            usage: wgpu::BufferUsages::UNIFORM | wgpu::BufferUsages::COPY_DST,
            mapped_at_creation: false,
        });
        let ones: Vec<u8> = (0..params.size() / 4)
            .flat_map(|_| 1u32.to_le_bytes())
            .collect();
        self.queue.write_buffer(&params, 0, &ones);
        let operands: Vec<wgpu::Buffer> = p.entries[1..]
            .iter()
            .map(|_| {
                d.create_buffer(&wgpu::BufferDescriptor {
                    label: Some("kiln primer operand"),
                    size: 256,
                    usage: wgpu::BufferUsages::STORAGE,
                    mapped_at_creation: false,
                })
            })
            .collect();
        let mut entries = vec![wgpu::BindGroupEntry {
            binding: 0,
            resource: params.as_entire_binding(),
        }];
        for (i, b) in operands.iter().enumerate() {
            entries.push(wgpu::BindGroupEntry {
                binding: i as u32 + 1,
                resource: b.as_entire_binding(),
            });
        }
        let bind_group = d.create_bind_group(&wgpu::BindGroupDescriptor {
            label: Some("kiln primer"),
            layout: &bgl,
            entries: &entries,
        });
        let mut encoder = d.create_command_encoder(&wgpu::CommandEncoderDescriptor {
            label: Some("kiln primer"),
        });
        {
            let mut pass = encoder.begin_compute_pass(&wgpu::ComputePassDescriptor {
                label: Some("kiln primer"),
                timestamp_writes: None,
            });
            pass.set_pipeline(&pipeline);
            pass.set_bind_group(0, &bind_group, &[0]);
            pass.dispatch_workgroups(1, 1, 1);
        }
        let index = self.queue.submit([encoder.finish()]);
        if let Some(e) = pollster::block_on(scope.pop()) {
            return Err(e.to_string());
        }
        d.poll(wgpu::PollType::Wait {
            submission_index: Some(index),
            timeout: None,
        })
        .map_err(|e| e.to_string())?;
        self.primed
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        Ok(())
    }

    /// Holds runs that have not started (`true`), or lets them go on.
    pub(crate) fn hold(&self, held: bool) {
        *self.held.0.lock().unwrap_or_else(|e| e.into_inner()) = held;
        self.held.1.notify_all();
    }
}
