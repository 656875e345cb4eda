//! Recording one compute dispatch into the stream: view ranges, binding checks, its
//! parameters in the arena, its bind group and pass, and a software driver's first run.

use super::pipelines::log_compile;
use super::*;

impl WgpuDevice {
    /// Records one compute dispatch into the stream.
    pub(super) fn record_dispatch(&self, s: &mut State, mut d: Dispatch) -> Result<()> {
        // A view binds its range of the buffer it views; a range asked of a view is
        // relative to the view's start.
        for (i, id) in d.buffers.iter().enumerate() {
            let Some(slot) = s.buffers.get(id) else {
                continue;
            };
            if let Some((_, base)) = slot.view_of {
                match d.ranges.iter_mut().find(|r| r.0 == i) {
                    Some(r) => r.1 += base,
                    None => d.ranges.push((i, base, slot.meta.bytes())),
                }
            }
        }
        // WebGPU forbids one buffer bound both writable and read-only in a dispatch,
        // even through disjoint views: name the kernel rather than fail at submit.
        let under = |id: &u64| {
            s.buffers
                .get(id)
                .and_then(|slot| slot.view_of)
                .map_or(*id, |(parent, _)| parent)
        };
        for (i, a) in d.buffers.iter().enumerate() {
            for (j, b) in d.buffers.iter().enumerate().skip(i + 1) {
                let access = |k: usize| d.kernel.slots.get(k).map(|slot| slot.access);
                if under(a) == under(b) && access(i) != access(j) {
                    return Err(Error::InvalidArgument(format!(
                        "`{}` binds buffer #{a} and buffer #{b}, views of one buffer, once \
                         writable and once read-only: WebGPU forbids that; use separate buffers",
                        d.kernel.name
                    )));
                }
            }
        }
        // A whole buffer bound past the adapter's per-binding limit would be a wgpu
        // validation error at submit; say which kernel and what to do instead.
        let limit = self.caps.max_storage_binding;
        let buffers: Vec<wgpu::Buffer> = d
            .buffers
            .iter()
            .map(|&id| self.resolve(s, id))
            .collect::<Result<_>>()?;
        for (slot, buffer) in buffers.iter().enumerate() {
            let size = match d.ranges.iter().find(|r| r.0 == slot) {
                Some(r) => r.2,
                None => buffer.size(),
            };
            if size > limit {
                return Err(Error::Unsupported {
                    device: self.caps.name.clone(),
                    what: format!(
                        "`{}` on a {}-byte buffer: over the adapter's per-binding limit of \
                         {limit} bytes (GEMMs, elementwise kernels, reductions, the \
                         optimizers and the embedding's backward split such operands; \
                         this kernel cannot). Use smaller tensors, e.g. a smaller batch or sequence, or \
                         fused attention instead of a T x T score matrix",
                        d.kernel.name, size
                    ),
                });
            }
        }
        let key = PipelineKey {
            name: d.kernel.name,
            reprs: d.reprs,
            consts: d.consts,
            overrides: d.overrides,
        };
        if let Some(wanted) = &mut s.collect {
            if !s.pipelines.contains_key(&key)
                && !s.building.contains(&key)
                && !wanted.iter().any(|w| w.key == key)
            {
                wanted.push(Wanted {
                    key,
                    kernel: d.kernel,
                });
            }
            return Ok(());
        }
        self.pipeline(s, &key, d.kernel)?;
        if s.params.len() as u64 + self.arena_stride > self.arena.size() {
            self.flush(s)?;
        }
        let offset = s.params.len() as u32;
        debug_assert_eq!(d.params.len() as u64 * 4, d.kernel.params_size);
        s.params.extend_from_slice(bytemuck::cast_slice(&d.params));
        s.params
            .resize(offset as usize + self.arena_stride as usize, 0);

        let bind_key = BindKey {
            pipeline: key.clone(),
            buffers: d.buffers.clone(),
            ranges: d.ranges.clone(),
        };
        if !s.bind_groups.contains_key(&bind_key) {
            let mut entries = vec![wgpu::BindGroupEntry {
                binding: 0,
                resource: wgpu::BindingResource::Buffer(wgpu::BufferBinding {
                    buffer: &self.arena,
                    offset: 0,
                    size: wgpu::BufferSize::new(d.kernel.params_size),
                }),
            }];
            for (i, b) in buffers.iter().enumerate() {
                let resource = match d.ranges.iter().find(|r| r.0 == i) {
                    Some(&(_, offset, size)) => {
                        wgpu::BindingResource::Buffer(wgpu::BufferBinding {
                            buffer: b,
                            offset,
                            size: wgpu::BufferSize::new(size),
                        })
                    }
                    None => b.as_entire_binding(),
                };
                entries.push(wgpu::BindGroupEntry {
                    binding: i as u32 + 1,
                    resource,
                });
            }
            let layout = &self.layout(s, d.kernel).0;
            let bg = self.device.create_bind_group(&wgpu::BindGroupDescriptor {
                label: Some(d.kernel.file),
                layout,
                entries: &entries,
            });
            s.bind_groups.insert(bind_key.clone(), bg);
        }
        // Take what the pass needs out of `s` before borrowing the encoder mutably.
        let pipeline = s.pipelines[&key].clone();
        let bind_group = s.bind_groups[&bind_key].clone();
        let stamps = self.pass_timestamps(s);
        let timestamp_writes = stamps
            .as_ref()
            .map(|(set, i)| wgpu::ComputePassTimestampWrites {
                query_set: set,
                beginning_of_pass_write_index: Some(*i),
                end_of_pass_write_index: Some(*i + 1),
            });
        {
            let encoder = self.encoder(s);
            let mut pass = encoder.begin_compute_pass(&wgpu::ComputePassDescriptor {
                label: Some(d.kernel.file),
                timestamp_writes,
            });
            pass.set_pipeline(&pipeline);
            pass.set_bind_group(0, &bind_group, &[offset]);
            pass.dispatch_workgroups(d.groups.0, d.groups.1, d.groups.2);
        }
        // A software driver compiles a pipeline when it first runs it: run that launch
        // now, so the first step can count its kernels as they become ready. (Off
        // while a profile is open: its timestamps resolve per submit of a whole step.)
        if s.profiling.is_none() && s.first_runs.remove(&key) {
            let t = std::time::Instant::now();
            self.flush(s)?;
            self.device
                .poll(wgpu::PollType::wait_indefinitely())
                .map_err(|e| self.backend_error(format!("waiting for the device: {e}")))?;
            compiling::finished();
            log_compile("first run of", &key, t);
        }
        Ok(())
    }

    /// Records a launch, with timestamps around it when a profile is open.
    pub(super) fn record_profiled(&self, s: &mut State, kernel: &Kernel) -> Result<()> {
        let Some(before) = self.launch_queries_begin(s) else {
            return kiln_lowering::record_kernel(self, s, kernel);
        };
        let _span = span("record", SpanKind::Record);
        kiln_lowering::record_kernel(self, s, kernel)?;
        self.launch_queries_end(s, before, kernel.cost());
        Ok(())
    }
}
