//! The device contract (`kiln_engine::Device`) on a raw Vulkan device.

use super::*;

impl Device for VkDevice {
    fn caps(&self) -> &Capabilities {
        &self.caps
    }

    fn alloc(&self, dtype: DType, len: usize) -> Result<Buffer> {
        let bytes = check_alloc(&self.caps, dtype, len)?;
        let mut s = self.lock();
        // Downloads may copy it on the transfer queue; the CPU-class GEMM may read it
        // through texel views.
        let mut usage = vk::BufferUsageFlags::STORAGE_BUFFER
            | vk::BufferUsageFlags::TRANSFER_SRC
            | vk::BufferUsageFlags::TRANSFER_DST;
        let mut size = bytes;
        if let Some(padded) = self
            .features
            .texel
            .and_then(|_| texel_buffer_size(bytes, self.caps.max_buffer))
        {
            usage |= vk::BufferUsageFlags::UNIFORM_TEXEL_BUFFER;
            size = padded;
        }
        let mem = self.make_shared(&mut s, size, usage, MemoryLocation::GpuOnly, true)?;
        // Zero-filled, in stream order (memory may be recycled).
        let (buffer, size) = (mem.buffer, mem.size);
        let cmd = match self.stream(&mut s) {
            Ok(st) => st.cmd,
            Err(e) => {
                self.destroy(&mut s, mem);
                return Err(e);
            }
        };
        // SAFETY: `cmd` is recording; the buffer is live, its size a multiple of 4.
        unsafe { self.device.cmd_fill_buffer(cmd, buffer, 0, size, 0) };
        self.barrier(cmd);
        let id = s.next_id;
        s.next_id += 1;
        let meta = Buffer { id, dtype, len };
        s.buffers.insert(
            id,
            Slot {
                meta,
                kind: SlotKind::Own(mem),
            },
        );
        s.allocated += bytes;
        Ok(meta)
    }

    fn free(&self, buf: Buffer) -> Result<()> {
        let mut s = self.lock();
        if s.buffers
            .values()
            .any(|v| matches!(v.kind, SlotKind::View { parent, .. } if parent == buf.id))
        {
            return Err(Error::InvalidArgument(format!(
                "buffer #{} still has views on `{}`: free them first",
                buf.id, self.caps.name
            )));
        }
        let slot = s
            .buffers
            .remove(&buf.id)
            .ok_or_else(|| self.unknown(buf.id))?;
        if let SlotKind::Own(mem) = slot.kind {
            s.allocated -= slot.meta.bytes();
            // Launches already recorded that use it, and a transfer copy still reading
            // it, still complete.
            let copy = s.transfer_reads.remove(&mem.buffer).unwrap_or(0);
            let tag = (Self::tag(&s), copy);
            Self::retire_at(&mut s, mem, tag);
        }
        Ok(())
    }

    fn view(&self, parent: Buffer, offset: usize, len: usize) -> Result<Buffer> {
        check_view(parent, offset, len)?;
        let mut s = self.lock();
        let slot = s
            .buffers
            .get(&parent.id)
            .ok_or_else(|| self.unknown(parent.id))?;
        if matches!(slot.kind, SlotKind::View { .. }) {
            return Err(Error::InvalidArgument(format!(
                "buffer #{} is itself a view: take views of the buffer it views",
                parent.id
            )));
        }
        if slot.meta != parent {
            return Err(Error::InvalidArgument(format!(
                "handle for buffer #{} says {} x {} but it holds {} x {} (a handle from \
                 another device?)",
                parent.id, parent.len, parent.dtype, slot.meta.len, slot.meta.dtype
            )));
        }
        let id = s.next_id;
        s.next_id += 1;
        let meta = Buffer {
            id,
            dtype: parent.dtype,
            len,
        };
        let base = (offset * parent.dtype.size()) as u64;
        s.buffers.insert(
            id,
            Slot {
                meta,
                kind: SlotKind::View {
                    parent: parent.id,
                    base,
                },
            },
        );
        Ok(meta)
    }

    fn upload(&self, buf: Buffer, data: &HostData) -> Result<()> {
        check_upload(buf, data)?;
        let _span = span("upload", SpanKind::Transfer);
        let mut s = self.lock();
        let (target, base, _) = self.resolve(&s, buf.id)?;
        let bytes = data.as_bytes();
        if bytes.is_empty() {
            return Ok(());
        }
        let padded = buf.bytes();
        let mut staging = self.make(
            &mut s,
            padded,
            vk::BufferUsageFlags::TRANSFER_SRC,
            MemoryLocation::CpuToGpu,
        )?;
        let Some(mapped) = staging.alloc.mapped_slice_mut() else {
            self.destroy(&mut s, staging);
            return Err(self.backend_error("upload staging memory is not host-visible"));
        };
        mapped[..bytes.len()].copy_from_slice(bytes);
        mapped[bytes.len()..padded as usize].fill(0);
        let src = staging.buffer;
        if let Err(e) = self
            .after_transfer_reads(&mut s, &[buf])
            .and_then(|()| self.stream(&mut s).map(drop))
        {
            self.destroy(&mut s, staging);
            return Err(e);
        }
        Self::retire(&mut s, staging);
        self.record_copy(&mut s, (src, 0), (target, base), padded)
    }

    fn begin_download(&self, buf: Buffer) -> Result<PendingDownload> {
        let _span = span("begin download", SpanKind::Transfer);
        let mut s = self.lock();
        let (src, base, _) = self.resolve(&s, buf.id)?;
        let padded = buf.bytes();
        let staging = self.make(
            &mut s,
            padded,
            vk::BufferUsageFlags::TRANSFER_DST,
            MemoryLocation::GpuToCpu,
        )?;
        let dst = staging.buffer;
        if padded > 0 && s.transfer.is_some() {
            // The copy runs on the transfer queue once the compute work submitted so
            // far (which wrote the source) is done, beside whatever compute comes next.
            let copied = self.flush(&mut s).and_then(|after| {
                self.submit_transfer_copy(&mut s, (src, base), dst, padded, after)
            });
            return match copied {
                Ok(value) => {
                    let ticket = s.next_id;
                    s.next_id += 1;
                    s.staged.insert(ticket, (staging, (0, value)));
                    self.validated()?;
                    Ok(PendingDownload {
                        ticket,
                        buffer: buf,
                    })
                }
                Err(e) => {
                    let tag = (
                        Self::tag(&s),
                        s.transfer.as_ref().map_or(0, |x| x.submitted),
                    );
                    Self::retire_at(&mut s, staging, tag);
                    Err(e)
                }
            };
        }
        if padded > 0 {
            if let Err(e) = self.record_copy(&mut s, (src, base), (dst, 0), padded) {
                self.destroy(&mut s, staging);
                return Err(e);
            }
            let cmd = self.stream(&mut s)?.cmd;
            let to_host = vk::MemoryBarrier::default()
                .src_access_mask(vk::AccessFlags::TRANSFER_WRITE)
                .dst_access_mask(vk::AccessFlags::HOST_READ);
            // SAFETY: `cmd` is recording.
            unsafe {
                self.device.cmd_pipeline_barrier(
                    cmd,
                    vk::PipelineStageFlags::TRANSFER,
                    vk::PipelineStageFlags::HOST,
                    vk::DependencyFlags::empty(),
                    &[to_host],
                    &[],
                    &[],
                )
            };
        }
        let value = match self.flush(&mut s) {
            Ok(v) => v,
            Err(e) => {
                Self::retire(&mut s, staging);
                return Err(e);
            }
        };
        let ticket = s.next_id;
        s.next_id += 1;
        s.staged.insert(ticket, (staging, (value, 0)));
        Ok(PendingDownload {
            ticket,
            buffer: buf,
        })
    }

    fn finish_download(&self, pending: PendingDownload) -> Result<HostData> {
        let _span = span("download", SpanKind::Transfer);
        let (staging, tag, copies) = {
            let mut s = self.lock();
            let (staging, tag) = s.staged.remove(&pending.ticket).ok_or_else(|| {
                Error::InvalidArgument(format!(
                    "download ticket {} is not pending on `{}` (already finished, or begun \
                     on another device)",
                    pending.ticket, self.caps.name
                ))
            })?;
            (staging, tag, s.transfer.as_ref().map(|x| x.timeline))
        };
        let waited = match (tag, copies) {
            ((0, value), Some(timeline)) if value > 0 => self.wait_on(timeline, value),
            ((value, _), _) => self.wait_for(value),
        };
        let mut s = self.lock();
        if let Err(e) = waited {
            Self::retire_at(&mut s, staging, tag);
            return Err(e);
        }
        // The copies up to this one are done: what they read needs no wait any more.
        if tag.0 == 0 {
            s.transfer_reads.retain(|_, x| *x > tag.1);
        }
        let buf = pending.buffer;
        // SAFETY: the handle is only used to invalidate the mapping below, while the
        // allocation is alive.
        let memory = unsafe { staging.alloc.memory() };
        if !staging
            .alloc
            .memory_properties()
            .contains(vk::MemoryPropertyFlags::HOST_COHERENT)
        {
            let range = vk::MappedMemoryRange::default()
                .memory(memory)
                .offset(0)
                .size(vk::WHOLE_SIZE);
            // SAFETY: the memory is mapped (gpu-allocator maps host-visible blocks).
            if let Err(e) = unsafe { self.device.invalidate_mapped_memory_ranges(&[range]) } {
                self.destroy(&mut s, staging);
                return Err(self.vk_error("reading a download", e));
            }
        }
        let data = match staging.alloc.mapped_slice() {
            Some(bytes) => Ok(HostData::from_bytes(buf.dtype, buf.len, bytes)),
            None => Err(self.backend_error("download staging memory is not host-visible")),
        };
        self.destroy(&mut s, staging);
        data
    }

    fn launch(&self, kernel: &Kernel) -> Result<()> {
        kernel.validate()?;
        let mut s = self.lock();
        self.check_live(&s, kernel.name(), &kernel.buffers())?;
        self.after_transfer_reads(&mut s, &kernel.written())?;
        let Some(first) = self.stamp(&mut s)? else {
            return self.record(&mut s, kernel);
        };
        let _span = span("record", SpanKind::Record);
        self.record(&mut s, kernel)?;
        if let Some(last) = self.stamp(&mut s)? {
            if let Some(p) = s.profiling.as_mut() {
                p.launches.push((kernel.cost(), first, last));
            }
        }
        Ok(())
    }

    fn submit(&self) -> Result<()> {
        let mut s = self.lock();
        self.flush(&mut s).map(drop)
    }

    fn wait(&self) -> Result<()> {
        let _span = span("wait", SpanKind::Wait);
        let (value, copies) = {
            let s = self.lock();
            (
                s.submitted,
                s.transfer.as_ref().map(|x| (x.timeline, x.submitted)),
            )
        };
        self.wait_for(value)?;
        if let Some((timeline, copied)) = copies {
            self.wait_on(timeline, copied)?;
        }
        let mut s = self.lock();
        s.transfer_reads
            .retain(|_, x| *x > copies.map_or(0, |c| c.1));
        self.reclaim(&mut s)
    }

    fn busy(&self) -> Result<bool> {
        let submitted = self.lock().submitted;
        Ok(self.completed()? < submitted)
    }

    fn allocated_bytes(&self) -> u64 {
        self.lock().allocated
    }

    /// Builds the pipelines `kernels` need that are not built yet, found by lowering
    /// them with recording off, reporting each to `compiling`. (A software driver such
    /// as lavapipe still compiles machine code on a pipeline's first run.)
    fn prepare(&self, kernels: &[Kernel]) -> Result<()> {
        let mut s = self.lock();
        s.collect = Some(vec![]);
        let mut result = Ok(());
        for k in kernels {
            result = k
                .validate()
                .and_then(|()| self.check_live(&s, k.name(), &k.buffers()))
                .and_then(|()| self.record(&mut s, k));
            if result.is_err() {
                break;
            }
        }
        let wanted = s.collect.take().unwrap_or_default();
        result?;
        compiling::queued(wanted.len());
        let mut result = Ok(());
        for (key, kernel) in wanted {
            // After a failure the rest are counted off unbuilt: nobody waits for them.
            if result.is_ok() {
                result = self.pipeline(&mut s, &key, kernel).map(drop);
            }
            compiling::finished();
        }
        result
    }

    fn profile_begin(&self) -> Result<()> {
        let mut s = self.lock();
        check_profile_begin(&self.caps, s.profiling.is_some())?;
        // Everything before the profiled stretch runs first, so it is not counted.
        self.flush(&mut s)?;
        drop(s);
        self.wait()?;
        let now = std::time::Instant::now();
        self.lock().profiling = Some(Profiling {
            pools: vec![],
            used: 0,
            launches: vec![],
            calibration: (0, now, now),
        });
        // The tightest of a few round trips: a thread wake-up on the way can stretch one.
        let mut best: Option<(u32, std::time::Instant, std::time::Instant)> = None;
        for _ in 0..CALIBRATIONS {
            let mut s = self.lock();
            let Some(query) = self.stamp(&mut s)? else {
                break;
            };
            let before = std::time::Instant::now();
            let value = self.flush(&mut s)?;
            drop(s);
            self.wait_for(value)?;
            let after = std::time::Instant::now();
            if best.is_none_or(|b| after - before < b.2 - b.1) {
                best = Some((query, before, after));
            }
        }
        if let (Some(p), Some(best)) = (self.lock().profiling.as_mut(), best) {
            p.calibration = best;
        }
        Ok(())
    }

    fn profile_end(&self) -> Result<Vec<KernelTiming>> {
        let mut s = self.lock();
        let Some(p) = s.profiling.take() else {
            return Err(Error::InvalidArgument(format!(
                "profile_end on `{}` without profile_begin",
                self.caps.name
            )));
        };
        let value = self.flush(&mut s);
        drop(s);
        let waited = value.and_then(|v| self.wait_for(v));
        let mut ticks = vec![0u64; p.used as usize];
        let mut read = Ok(());
        for (i, pool) in p.pools.iter().enumerate() {
            let first = i * PER_POOL as usize;
            let count = (p.used as usize)
                .saturating_sub(first)
                .min(PER_POOL as usize);
            if read.is_ok() && waited.is_ok() && count > 0 {
                // SAFETY: queries 0..count of the pool were reset and written by work
                // that has completed.
                read = unsafe {
                    self.device.get_query_pool_results(
                        *pool,
                        0,
                        &mut ticks[first..first + count],
                        vk::QueryResultFlags::TYPE_64 | vk::QueryResultFlags::WAIT,
                    )
                }
                .map_err(|e| self.vk_error("reading the profile's timestamps", e));
            }
            // SAFETY: the device is done with the pool (waited above, or lost).
            unsafe { self.device.destroy_query_pool(*pool, None) };
        }
        waited?;
        read?;
        let bits = self.features.timestamp_bits;
        let mask = if bits >= 64 {
            u64::MAX
        } else {
            (1u64 << bits) - 1
        };
        let ns_per_tick = self.features.timestamp_period as f64;
        let (query, before, after) = p.calibration;
        let anchor = before + (after - before) / 2;
        let zero = ticks.get(query as usize).map_or(0, |t| t & mask);
        let at = |q: u32| {
            let ns = (ticks[q as usize] & mask).saturating_sub(zero) as f64 * ns_per_tick;
            anchor + std::time::Duration::from_nanos(ns as u64)
        };
        Ok(p.launches
            .into_iter()
            .map(|(cost, first, last)| {
                let (start, stop) = (at(first), at(last));
                KernelTiming {
                    cost,
                    start,
                    dur: stop.saturating_duration_since(start),
                }
            })
            .collect())
    }
}

/// The size of a buffer the CPU-class GEMM may view as texels
/// (`VkDevice::texel_view`): lavapipe compiles a kernel anew for each shader key, and
/// the key holds whether each texel buffer's size is a power of two and whether bits
/// 8-15 of each view's size are zero (a mip level count it reads from the view's
/// buffer range). So no such buffer's size is a power of two, and 256 bytes past its
/// data let every view be sized with those bits set: one build of a block (the
/// primer's, on its own buffers) serves every launch. None where that would pass the
/// device's largest buffer (such a buffer's GEMMs use storage loads:
/// `VkDevice::texel_room`).
pub(super) fn texel_buffer_size(bytes: u64, max_buffer: u64) -> Option<u64> {
    let mut size = bytes + 256;
    while size.is_power_of_two() {
        size += 16;
    }
    (size <= max_buffer).then_some(size)
}
