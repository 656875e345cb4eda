//! Recording launches into the stream: descriptor layouts, pipelines, parameters and
//! dispatches, and the lowering's `Recorder` interface.

use super::*;

impl VkDevice {
    /// The Vulkan buffer, byte offset and size bound for `id`.
    /// The descriptor info binding buffer `id` (a view: its range of the parent).
    pub(super) fn buffer_info(&self, s: &State, id: u64) -> Result<vk::DescriptorBufferInfo> {
        let (buffer, offset, range) = self.resolve(s, id)?;
        Ok(vk::DescriptorBufferInfo {
            buffer,
            offset,
            range,
        })
    }

    pub(super) fn resolve(&self, s: &State, id: u64) -> Result<(vk::Buffer, u64, u64)> {
        let own = |m: &Option<Mem>| {
            m.as_ref()
                .map(|m| (m.buffer, 0, m.size))
                .ok_or_else(|| self.backend_error("an internal buffer is missing"))
        };
        match id {
            SCRATCH_ID => own(&s.scratch),
            DUMMY_ID => own(&s.dummy),
            BAND_PARTIALS_ID => own(&s.band_partials),
            PARTIALS_ID => own(&s.partials),
            _ => {
                let slot = s.buffers.get(&id).ok_or_else(|| self.unknown(id))?;
                match &slot.kind {
                    SlotKind::Own(m) => Ok((m.buffer, 0, slot.meta.bytes())),
                    SlotKind::View { parent, base } => {
                        let p = s.buffers.get(parent).ok_or_else(|| self.unknown(*parent))?;
                        match &p.kind {
                            SlotKind::Own(m) => Ok((m.buffer, *base, slot.meta.bytes())),
                            SlotKind::View { .. } => Err(self.backend_error("a view of a view")),
                        }
                    }
                }
            }
        }
    }

    pub(super) fn check_live(&self, s: &State, kernel: &str, buffers: &[Buffer]) -> Result<()> {
        for b in buffers {
            let slot = s.buffers.get(&b.id).ok_or_else(|| self.unknown(b.id))?;
            if slot.meta != *b {
                return Err(Error::InvalidArgument(format!(
                    "{kernel}: handle for buffer #{} says {} x {} but it holds {} x {} (a handle from another device?)",
                    b.id, b.len, b.dtype, slot.meta.len, slot.meta.dtype
                )));
            }
        }
        Ok(())
    }

    pub(super) fn layout(
        &self,
        s: &mut State,
        kernel: &KernelSource,
    ) -> Result<(vk::DescriptorSetLayout, vk::PipelineLayout)> {
        let accesses: Vec<Access> = kernel.slots.iter().map(|slot| slot.access).collect();
        let key = (accesses, kernel.params_size);
        if let Some(l) = s.layouts.get(&key) {
            return Ok(*l);
        }
        let mut bindings = vec![vk::DescriptorSetLayoutBinding::default()
            .binding(0)
            .descriptor_type(vk::DescriptorType::UNIFORM_BUFFER)
            .descriptor_count(1)
            .stage_flags(vk::ShaderStageFlags::COMPUTE)];
        for i in 0..kernel.slots.len() {
            bindings.push(
                vk::DescriptorSetLayoutBinding::default()
                    .binding(i as u32 + 1)
                    .descriptor_type(vk::DescriptorType::STORAGE_BUFFER)
                    .descriptor_count(1)
                    .stage_flags(vk::ShaderStageFlags::COMPUTE),
            );
        }
        let info = vk::DescriptorSetLayoutCreateInfo::default()
            .flags(vk::DescriptorSetLayoutCreateFlags::PUSH_DESCRIPTOR_KHR)
            .bindings(&bindings);
        // SAFETY: valid create infos on a live device.
        let set = unsafe { self.device.create_descriptor_set_layout(&info, None) }
            .map_err(|e| self.vk_error("creating a descriptor set layout", e))?;
        let sets = [set];
        let pl_info = vk::PipelineLayoutCreateInfo::default().set_layouts(&sets);
        // SAFETY: as above.
        let pl = unsafe { self.device.create_pipeline_layout(&pl_info, None) }
            .map_err(|e| self.vk_error("creating a pipeline layout", e))?;
        s.layouts.insert(key, (set, pl));
        Ok((set, pl))
    }

    pub(super) fn pipeline(
        &self,
        s: &mut State,
        key: &PipelineKey,
        kernel: &KernelSource,
    ) -> Result<vk::Pipeline> {
        if let Some(p) = s.pipelines.get(key) {
            return Ok(*p);
        }
        if kernel.subgroups && self.caps.subgroup_sizes.is_none() {
            return Err(Error::Unsupported {
                device: self.caps.name.clone(),
                what: format!(
                    "subgroup operations in compute shaders, which kernel {} needs",
                    kernel.name
                ),
            });
        }
        let t0 = std::time::Instant::now();
        let words = crate::spirv::translate(
            kernel,
            &key.reprs,
            &key.consts,
            &key.overrides,
            &self.allowed,
        )
        .map_err(|e| Error::Unsupported {
            device: self.caps.name.clone(),
            what: format!("kernel {} ({:?}): {e}", kernel.name, key.reprs),
        })?;
        self.dump_spirv(key, &words)?;
        let (_, layout) = self.layout(s, kernel)?;
        // SAFETY: naga's validated SPIR-V for the capabilities the device has, on the
        // layout made for its bindings.
        let pipeline = unsafe { self.compute_pipeline(&words, layout, &[], None) }
            .map_err(|e| self.vk_error(&format!("building kernel {}", kernel.name), e))?;
        s.pipelines.insert(key.clone(), pipeline);
        self.built.store(true, std::sync::atomic::Ordering::Relaxed);
        if compile_log() {
            eprintln!(
                "kiln: vk built {} {:?} {:?} {:?}: {:.2} s",
                key.name,
                key.reprs,
                key.consts,
                key.overrides,
                t0.elapsed().as_secs_f64()
            );
        }
        Ok(pipeline)
    }

    pub(super) fn record_dispatch(&self, s: &mut State, d: Dispatch) -> Result<()> {
        if let Some(wanted) = &mut s.collect {
            let key = PipelineKey {
                name: d.kernel.name,
                reprs: d.reprs,
                consts: d.consts,
                overrides: d.overrides,
            };
            if !s.pipelines.contains_key(&key) && !wanted.iter().any(|w| w.0 == key) {
                wanted.push((key, d.kernel));
            }
            return Ok(());
        }
        // Each slot's buffer, offset and size: a view's range of its parent, a range
        // asked of a view relative to the view's start.
        let mut bound = vec![];
        for (i, &id) in d.buffers.iter().enumerate() {
            let (buffer, base, size) = self.resolve(s, id)?;
            let (offset, size) = match d.ranges.iter().find(|r| r.0 == i) {
                Some(&(_, off, size)) => (base + off, size),
                None => (base, size),
            };
            let limit = self.caps.max_storage_binding;
            if size > limit {
                return Err(Error::Unsupported {
                    device: self.caps.name.clone(),
                    what: format!(
                        "`{}` on a {size}-byte buffer: over the device's per-binding limit of \
                         {limit} bytes (GEMMs, elementwise kernels, reductions, the optimizers \
                         and the embedding's backward split such operands; this kernel cannot). \
                         Use smaller tensors, e.g. a smaller batch or sequence",
                        d.kernel.name
                    ),
                });
            }
            bound.push(vk::DescriptorBufferInfo {
                buffer,
                offset,
                range: size,
            });
        }
        let key = PipelineKey {
            name: d.kernel.name,
            reprs: d.reprs,
            consts: d.consts,
            overrides: d.overrides,
        };
        let pipeline = self.pipeline(s, &key, d.kernel)?;
        let (_, layout) = self.layout(s, d.kernel)?;
        let (cmd, arena, offset) = self.put_params(s, &d.params)?;
        // The parameters at binding 0, the kernel's buffers after them.
        bound.insert(
            0,
            vk::DescriptorBufferInfo {
                buffer: arena,
                offset,
                range: d.kernel.params_size,
            },
        );
        let writes = buffer_writes(&bound, Some(0));
        self.record_compute(cmd, (pipeline, layout), &writes, &[], d.groups);
        Ok(())
    }

    /// Writes a launch's parameters into the open stream's arena (submitting the
    /// stream first when the arena is full): the stream's command buffer, the arena and
    /// the parameters' offset in it.
    pub(super) fn put_params(
        &self,
        s: &mut State,
        params: &[u32],
    ) -> Result<(vk::CommandBuffer, vk::Buffer, u64)> {
        if s.stream
            .as_ref()
            .is_some_and(|st| st.used + self.arena_stride > st.arena.size)
        {
            self.flush(s)?;
        }
        let stride = self.arena_stride;
        let stream = self.stream(s)?;
        let offset = stream.used;
        let bytes: Vec<u8> = params.iter().flat_map(|w| w.to_le_bytes()).collect();
        let mapped = stream
            .arena
            .alloc
            .mapped_slice_mut()
            .ok_or_else(|| Error::Backend {
                device: String::new(),
                detail: "the parameter arena is not host-visible".into(),
            })?;
        mapped[offset as usize..offset as usize + bytes.len()].copy_from_slice(&bytes);
        stream.used += stride;
        Ok((stream.cmd, stream.arena.buffer, offset))
    }

    /// Records one compute dispatch into `cmd`: binds `pipeline`, pushes the
    /// descriptor `writes` (and `push` constants, when any), dispatches `groups`, and
    /// puts a barrier behind it so the next launch sees its writes.
    pub(super) fn record_compute(
        &self,
        cmd: vk::CommandBuffer,
        (pipeline, layout): (vk::Pipeline, vk::PipelineLayout),
        writes: &[vk::WriteDescriptorSet],
        push: &[u8],
        groups: (u32, u32, u32),
    ) {
        // SAFETY: `cmd` is recording; the pipeline, layout and buffers are live and
        // stay so until the submission is done (freed buffers are retired).
        unsafe {
            self.device
                .cmd_bind_pipeline(cmd, vk::PipelineBindPoint::COMPUTE, pipeline);
            self.push.cmd_push_descriptor_set(
                cmd,
                vk::PipelineBindPoint::COMPUTE,
                layout,
                0,
                writes,
            );
            if !push.is_empty() {
                self.device
                    .cmd_push_constants(cmd, layout, vk::ShaderStageFlags::COMPUTE, 0, push);
            }
            self.device.cmd_dispatch(cmd, groups.0, groups.1, groups.2);
        }
        self.barrier(cmd);
    }

    /// When a profile is open, writes a timestamp after everything recorded so far and
    /// returns its index.
    pub(super) fn stamp(&self, s: &mut State) -> Result<Option<u32>> {
        let Some(used) = s.profiling.as_ref().map(|p| p.used) else {
            return Ok(None);
        };
        let cmd = self.stream(s)?.cmd;
        let p = s.profiling.as_mut().expect("checked above");
        if used / PER_POOL == p.pools.len() as u32 {
            let info = vk::QueryPoolCreateInfo::default()
                .query_type(vk::QueryType::TIMESTAMP)
                .query_count(PER_POOL);
            // SAFETY: a valid create info on a live device.
            let pool = unsafe { self.device.create_query_pool(&info, None) }
                .map_err(|e| self.vk_error("creating a timestamp query pool", e))?;
            // SAFETY: `cmd` is recording; a new pool's queries start unavailable.
            unsafe { self.device.cmd_reset_query_pool(cmd, pool, 0, PER_POOL) };
            p.pools.push(pool);
        }
        let pool = p.pools[(used / PER_POOL) as usize];
        p.used += 1;
        // SAFETY: `cmd` is recording; the query was reset and is written once.
        unsafe {
            self.device.cmd_write_timestamp(
                cmd,
                vk::PipelineStageFlags::BOTTOM_OF_PIPE,
                pool,
                used % PER_POOL,
            )
        };
        Ok(Some(used))
    }

    /// Records a copy between two ranges of buffers (`(buffer, offset)`), then a barrier.
    pub(super) fn record_copy(
        &self,
        s: &mut State,
        (from, src_off): (vk::Buffer, u64),
        (to, dst_off): (vk::Buffer, u64),
        size: u64,
    ) -> Result<()> {
        let cmd = self.stream(s)?.cmd;
        let region = vk::BufferCopy {
            src_offset: src_off,
            dst_offset: dst_off,
            size,
        };
        // SAFETY: `cmd` is recording; both buffers are live and hold the ranges.
        unsafe { self.device.cmd_copy_buffer(cmd, from, to, &[region]) };
        self.barrier(cmd);
        Ok(())
    }
}

/// One descriptor write per buffer, `infos[i]` at binding `i`: storage buffers, but
/// for the uniform at binding `uniform`.
pub(super) fn buffer_writes(
    infos: &[vk::DescriptorBufferInfo],
    uniform: Option<usize>,
) -> Vec<vk::WriteDescriptorSet<'_>> {
    infos
        .iter()
        .enumerate()
        .map(|(i, info)| {
            let ty = if Some(i) == uniform {
                vk::DescriptorType::UNIFORM_BUFFER
            } else {
                vk::DescriptorType::STORAGE_BUFFER
            };
            vk::WriteDescriptorSet::default()
                .dst_binding(i as u32)
                .descriptor_type(ty)
                .buffer_info(std::slice::from_ref(info))
        })
        .collect()
}

impl Recorder for VkDevice {
    type State = State;

    fn caps(&self) -> &Capabilities {
        &self.caps
    }

    fn dispatch(&self, s: &mut State, d: Dispatch) -> Result<()> {
        self.record_dispatch(s, d)
    }

    fn copy(&self, s: &mut State, src: &Buffer, dst: &Buffer) -> Result<()> {
        if s.collect.is_some() {
            return Ok(());
        }
        let (a, a_off, _) = self.resolve(s, src.id)?;
        let (b, b_off, _) = self.resolve(s, dst.id)?;
        let size = src.bytes();
        if size == 0 {
            return Ok(());
        }
        if a == b {
            // Views of one buffer: a copy's regions must not overlap, so go through a
            // temporary buffer.
            let tmp = self.make(
                s,
                size,
                vk::BufferUsageFlags::TRANSFER_SRC | vk::BufferUsageFlags::TRANSFER_DST,
                MemoryLocation::GpuOnly,
            )?;
            let t = tmp.buffer;
            self.stream(s)?;
            Self::retire(s, tmp);
            self.record_copy(s, (a, a_off), (t, 0), size)?;
            self.record_copy(s, (t, 0), (b, b_off), size)
        } else {
            self.record_copy(s, (a, a_off), (b, b_off), size)
        }
    }

    fn clear(&self, s: &mut State, buf: &Buffer) -> Result<()> {
        if s.collect.is_some() {
            return Ok(());
        }
        let (b, off, size) = self.resolve(s, buf.id)?;
        let cmd = self.stream(s)?.cmd;
        // SAFETY: `cmd` is recording; the range lies in the buffer, in whole words.
        unsafe { self.device.cmd_fill_buffer(cmd, b, off, size, 0) };
        self.barrier(cmd);
        Ok(())
    }

    fn partials(&self, s: &mut State, bytes: u64) -> Result<()> {
        if s.collect.is_some() || s.partials.as_ref().is_some_and(|p| p.size >= bytes) {
            return Ok(());
        }
        let new = self.make(
            s,
            bytes.max(8),
            vk::BufferUsageFlags::STORAGE_BUFFER | vk::BufferUsageFlags::TRANSFER_DST,
            MemoryLocation::GpuOnly,
        )?;
        // Dispatches recorded earlier keep the old buffer until they have run.
        if let Some(old) = s.partials.replace(new) {
            Self::retire(s, old);
        }
        Ok(())
    }

    fn storage_offset_alignment(&self) -> u64 {
        self.features.min_storage_align.max(4)
    }
}
