//! The device contract (`kiln_engine::Device`) on a wgpu device: memory, uploads and
//! downloads, launches, `prepare`, submission and profiles.

use super::*;

impl Device for WgpuDevice {
    fn caps(&self) -> &Capabilities {
        &self.caps
    }

    fn alloc(&self, dtype: DType, len: usize) -> Result<Buffer> {
        self.call(|| {
            let bytes = check_alloc(&self.caps, dtype, len)?;
            let scope = self.device.push_error_scope(wgpu::ErrorFilter::OutOfMemory);
            let buffer = self.device.create_buffer(&wgpu::BufferDescriptor {
                label: None,
                size: bytes,
                usage: wgpu::BufferUsages::STORAGE
                    | wgpu::BufferUsages::COPY_SRC
                    | wgpu::BufferUsages::COPY_DST,
                mapped_at_creation: false,
            });
            if let Some(e) = pollster::block_on(scope.pop()) {
                return Err(Error::OutOfMemory {
                    device: self.caps.name.clone(),
                    detail: format!(
                        "allocating {bytes} bytes ({} bytes already allocated): {e}. Try a \
                         smaller micro-batch (with more gradient accumulation) or sequence, \
                         fp16/bf16 storage or a smaller model; memory that runs out during \
                         training steps also shrinks with ZeRO stage 1 or 2 over more devices. \
                         `kiln estimate` shows what each needs",
                        self.lock().allocated
                    ),
                });
            }
            let mut s = self.lock();
            let meta = s.register(buffer, dtype, len, None);
            s.allocated += bytes;
            Ok(meta)
        })
    }

    fn free(&self, buf: Buffer) -> Result<()> {
        self.call(|| {
            let mut s = self.lock();
            if s.buffers
                .values()
                .any(|v| v.view_of.is_some_and(|(parent, _)| parent == buf.id))
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
            if slot.view_of.is_none() {
                s.allocated -= slot.meta.bytes();
            }
            s.bind_groups.retain(|k, _| !k.buffers.contains(&buf.id));
            // Launches already recorded keep their own reference; wgpu frees it after them.
            drop(slot);
            Ok(())
        })
    }

    fn view(&self, parent: Buffer, offset: usize, len: usize) -> Result<Buffer> {
        self.call(|| {
            check_view(parent, offset, len)?;
            let mut s = self.lock();
            let slot = s
                .buffers
                .get(&parent.id)
                .ok_or_else(|| self.unknown(parent.id))?;
            if slot.view_of.is_some() {
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
            let buffer = slot.buffer.clone();
            let base = (offset * parent.dtype.size()) as u64;
            Ok(s.register(buffer, parent.dtype, len, Some((parent.id, base))))
        })
    }

    fn upload(&self, buf: Buffer, data: &HostData) -> Result<()> {
        self.call(|| {
            check_upload(buf, data)?;
            let _span = span("upload", SpanKind::Transfer);
            let mut s = self.lock();
            let base = s.base(buf.id);
            let target = &s
                .buffers
                .get(&buf.id)
                .ok_or_else(|| self.unknown(buf.id))?
                .buffer;
            let bytes = data.as_bytes();
            if bytes.is_empty() {
                return Ok(());
            }
            // write_buffer runs before the next submit's commands, so with launches pending
            // it would jump ahead of them; then the copy goes through the stream instead.
            let padded = buf.bytes();
            if s.encoder.is_none() {
                let mut view = self
                    .queue
                    .write_buffer_with(
                        target,
                        base,
                        wgpu::BufferSize::new(padded).expect("padded > 0"),
                    )
                    .ok_or_else(|| self.backend_error("could not stage an upload"))?;
                view.slice(..bytes.len()).copy_from_slice(bytes);
                view.slice(bytes.len()..).fill(0);
            } else {
                let staging = self.device.create_buffer(&wgpu::BufferDescriptor {
                    label: Some("kiln upload"),
                    size: padded,
                    usage: wgpu::BufferUsages::COPY_SRC | wgpu::BufferUsages::MAP_WRITE,
                    mapped_at_creation: true,
                });
                staging
                    .slice(..)
                    .get_mapped_range_mut()
                    .map_err(|e| self.backend_error(format!("staging an upload: {e}")))?
                    .slice(..bytes.len())
                    .copy_from_slice(bytes);
                staging.unmap();
                let target = target.clone();
                self.encoder(&mut s)
                    .copy_buffer_to_buffer(&staging, 0, &target, base, padded);
            }
            Ok(())
        })
    }

    fn begin_download(&self, buf: Buffer) -> Result<PendingDownload> {
        self.call(|| {
            let _span = span("begin download", SpanKind::Transfer);
            let mut s = self.lock();
            let base = s.base(buf.id);
            let src = s
                .buffers
                .get(&buf.id)
                .ok_or_else(|| self.unknown(buf.id))?
                .buffer
                .clone();
            let padded = buf.bytes();
            let readback = self.device.create_buffer(&wgpu::BufferDescriptor {
                label: Some("kiln download"),
                size: padded,
                usage: wgpu::BufferUsages::COPY_DST | wgpu::BufferUsages::MAP_READ,
                mapped_at_creation: false,
            });
            self.encoder(&mut s)
                .copy_buffer_to_buffer(&src, base, &readback, 0, padded);
            let index = self.flush(&mut s)?;
            let ticket = s.next_id;
            s.next_id += 1;
            s.staged.insert(ticket, (readback, index));
            Ok(PendingDownload {
                ticket,
                buffer: buf,
            })
        })
    }

    fn finish_download(&self, pending: PendingDownload) -> Result<HostData> {
        self.call(|| {
            let _span = span("download", SpanKind::Transfer);
            let (readback, index) =
                self.lock().staged.remove(&pending.ticket).ok_or_else(|| {
                    Error::InvalidArgument(format!(
                        "download ticket {} is not pending on `{}` (already finished, or begun on \
                     another device)",
                        pending.ticket, self.caps.name
                    ))
                })?;
            let buf = pending.buffer;
            let slice = readback.slice(..);
            let (tx, rx) = std::sync::mpsc::channel();
            slice.map_async(wgpu::MapMode::Read, move |r| {
                let _ = tx.send(r);
            });
            // Wait for the copy's own submission, not for work queued after it.
            self.device
                .poll(wgpu::PollType::Wait {
                    submission_index: index,
                    timeout: None,
                })
                .map_err(|e| {
                    // A failed submission's cause (a pipeline the driver refused, a lost
                    // device) was reported to the error sink; name it first.
                    match self.check_errors() {
                        Err(Error::Backend { detail, .. }) => {
                            self.backend_error(format!("waiting for a download: {detail} ({e})"))
                        }
                        _ => self.backend_error(format!("waiting for a download: {e}")),
                    }
                })?;
            rx.recv()
                .map_err(|_| self.backend_error("download was cancelled"))?
                .map_err(|e| self.backend_error(format!("mapping a download: {e}")))?;
            let view = slice
                .get_mapped_range()
                .map_err(|e| self.backend_error(format!("reading a download: {e}")))?;
            let data = HostData::from_bytes(buf.dtype, buf.len, &view);
            drop(view);
            readback.unmap();
            self.check_errors()?;
            Ok(data)
        })
    }

    fn launch(&self, kernel: &Kernel) -> Result<()> {
        self.call(|| {
            kernel.validate()?;
            let mut s = self.lock();
            self.check_live(&s, kernel.name(), &kernel.buffers())?;
            let Some(profile) = &self.profile else {
                return self.record_profiled(&mut s, kernel);
            };
            self.flush(&mut s)?;
            self.wait()?;
            let t0 = std::time::Instant::now();
            self.record_profiled(&mut s, kernel)?;
            self.flush(&mut s)?;
            self.wait()?;
            let ms = t0.elapsed().as_secs_f64() * 1e3;
            let key = match kernel {
                Kernel::Matmul(m) => format!("matmul {}x{}x{} b{}", m.m, m.n, m.k, m.batch),
                k => k.name().to_string(),
            };
            let mut p = profile.lock().unwrap_or_else(|e| e.into_inner());
            let e = p.entry(key).or_insert((0, 0.0));
            e.0 += 1;
            e.1 += ms;
            Ok(())
        })
    }

    fn prepare(&self, kernels: &[Kernel]) -> Result<()> {
        self.call(|| {
            let mut s = self.lock();
            let wanted = self.missing_pipelines(&mut s, kernels)?;
            self.compile_all(&mut s, wanted)
        })
    }

    fn submit(&self) -> Result<()> {
        self.call(|| {
            let mut s = self.lock();
            self.flush(&mut s).map(drop)
        })
    }

    fn wait(&self) -> Result<()> {
        self.call(|| {
            let _span = span("wait", SpanKind::Wait);
            self.device
                .poll(wgpu::PollType::wait_indefinitely())
                .map_err(|e| self.backend_error(format!("waiting for the device: {e}")))?;
            self.check_errors()
        })
    }

    fn busy(&self) -> Result<bool> {
        self.call(|| {
            let status = self
                .device
                .poll(wgpu::PollType::Poll)
                .map_err(|e| self.backend_error(format!("polling the device: {e}")))?;
            Ok(!status.is_queue_empty())
        })
    }

    fn allocated_bytes(&self) -> u64 {
        self.lock().allocated
    }

    fn profile_begin(&self) -> Result<()> {
        self.call(|| self.begin_profile())
    }

    fn profile_end(&self) -> Result<Vec<KernelTiming>> {
        self.call(|| self.end_profile())
    }
}
