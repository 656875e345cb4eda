//! Submission and retirement: the open stream, its barriers and submission, and the
//! timeline values after which what a submission used is released.

use super::*;

impl VkDevice {
    /// The timeline value after which something used by the stream so far is unused.
    pub(super) fn tag(s: &State) -> u64 {
        s.submitted + s.stream.is_some() as u64
    }

    pub(super) fn retire(s: &mut State, mem: Mem) {
        let tag = (Self::tag(s), 0);
        Self::retire_at(s, mem, tag);
    }

    /// Retires `mem` until both timelines pass `tag`.
    pub(super) fn retire_at(s: &mut State, mem: Mem, tag: Tag) {
        Self::retired_at(s, tag).mems.push(mem);
    }

    /// The entry of what is released once both timelines pass `tag`.
    pub(super) fn retired_at(s: &mut State, tag: Tag) -> &mut Retired {
        if s.retired.last().is_none_or(|(t, _)| *t != tag) {
            s.retired.push((tag, Retired::default()));
        }
        &mut s.retired.last_mut().expect("pushed above").1
    }

    /// The compute timeline's value now.
    pub(super) fn completed(&self) -> Result<u64> {
        self.counter(self.timeline)
    }

    pub(super) fn counter(&self, semaphore: vk::Semaphore) -> Result<u64> {
        // SAFETY: a timeline semaphore of this device.
        unsafe { self.device.get_semaphore_counter_value(semaphore) }
            .map_err(|e| self.vk_error("reading the timeline", e))
    }

    /// Releases what finished submissions held.
    pub(super) fn reclaim(&self, s: &mut State) -> Result<()> {
        let done = self.completed()?;
        let copied = match &s.transfer {
            Some(x) => self.counter(x.timeline)?,
            None => 0,
        };
        let (ready, waiting): (Vec<_>, Vec<_>) = std::mem::take(&mut s.retired)
            .into_iter()
            .partition(|((c, x), _)| *c <= done && *x <= copied);
        s.retired = waiting;
        for (_, r) in ready {
            for m in r.mems {
                if m.arena {
                    s.free_arenas.push(m);
                } else {
                    self.destroy(s, m);
                }
            }
            s.free_commands.extend(r.commands);
            for v in r.views {
                // SAFETY: the launches that read through the view have run.
                unsafe { self.device.destroy_buffer_view(v, None) };
            }
            if let Some(x) = s.transfer.as_mut() {
                x.free_commands.extend(r.transfer_commands);
            }
        }
        Ok(())
    }

    /// Waits until the compute timeline reaches `value`.
    pub(super) fn wait_for(&self, value: u64) -> Result<()> {
        self.wait_on(self.timeline, value)
    }

    /// Waits until `semaphore`'s timeline reaches `value`.
    pub(super) fn wait_on(&self, semaphore: vk::Semaphore, value: u64) -> Result<()> {
        if self.lost.load(std::sync::atomic::Ordering::Relaxed) {
            // What the device was to finish is gone (the timeline was signalled from
            // the host so that no wait hangs): nothing waited for is valid.
            return Err(self.vk_error("waiting for the device", vk::Result::ERROR_DEVICE_LOST));
        }
        let semaphores = [semaphore];
        let values = [value];
        let info = vk::SemaphoreWaitInfo::default()
            .semaphores(&semaphores)
            .values(&values);
        // SAFETY: a timeline semaphore of this device.
        unsafe { self.device.wait_semaphores(&info, u64::MAX) }
            .map_err(|e| self.vk_error("waiting for the device", e))?;
        self.validated()
    }

    /// The open stream, begun on first use.
    pub(super) fn stream<'s>(&self, s: &'s mut State) -> Result<&'s mut Stream> {
        if s.stream.is_none() {
            self.reclaim(s)?;
            let cmd = match s.free_commands.pop() {
                Some(c) => c,
                None => {
                    let info = vk::CommandBufferAllocateInfo::default()
                        .command_pool(self.pool)
                        .level(vk::CommandBufferLevel::PRIMARY)
                        .command_buffer_count(1);
                    // SAFETY: the pool belongs to this device; access is under the lock.
                    unsafe { self.device.allocate_command_buffers(&info) }
                        .map_err(|e| self.vk_error("allocating a command buffer", e))?[0]
                }
            };
            let arena = match s.free_arenas.pop() {
                Some(a) => a,
                None => Mem {
                    arena: true,
                    ..self.make(
                        s,
                        self.arena_stride * ARENA_SLOTS,
                        vk::BufferUsageFlags::UNIFORM_BUFFER,
                        MemoryLocation::CpuToGpu,
                    )?
                },
            };
            let begin = vk::CommandBufferBeginInfo::default()
                .flags(vk::CommandBufferUsageFlags::ONE_TIME_SUBMIT);
            // SAFETY: the command buffer is not in use (fresh, or its submission done).
            unsafe {
                self.device
                    .reset_command_buffer(cmd, vk::CommandBufferResetFlags::empty())
                    .and_then(|()| self.device.begin_command_buffer(cmd, &begin))
            }
            .map_err(|e| self.vk_error("beginning a command buffer", e))?;
            s.stream = Some(Stream {
                cmd,
                arena,
                used: 0,
                wait_transfer: 0,
            });
        }
        Ok(s.stream.as_mut().expect("opened above"))
    }

    /// Makes every earlier command's writes visible to every later command.
    pub(super) fn barrier(&self, cmd: vk::CommandBuffer) {
        let all = vk::AccessFlags::SHADER_READ
            | vk::AccessFlags::SHADER_WRITE
            | vk::AccessFlags::TRANSFER_READ
            | vk::AccessFlags::TRANSFER_WRITE
            | vk::AccessFlags::UNIFORM_READ;
        let barrier = vk::MemoryBarrier::default()
            .src_access_mask(vk::AccessFlags::SHADER_WRITE | vk::AccessFlags::TRANSFER_WRITE)
            .dst_access_mask(all);
        let stages = vk::PipelineStageFlags::COMPUTE_SHADER | vk::PipelineStageFlags::TRANSFER;
        // SAFETY: `cmd` is recording.
        unsafe {
            self.device.cmd_pipeline_barrier(
                cmd,
                stages,
                stages,
                vk::DependencyFlags::empty(),
                &[barrier],
                &[],
                &[],
            )
        };
    }

    /// Submits the open stream, if any; returns the timeline value it signals.
    pub(super) fn flush(&self, s: &mut State) -> Result<u64> {
        let Some(stream) = s.stream.take() else {
            self.validated()?;
            return Ok(s.submitted);
        };
        let _span = span("submit", SpanKind::Submit);
        let value = s.submitted + 1;
        // A stream that writes what a transfer copy still reads starts after the copy;
        // its commands wait at the stages they write in (and everything later on the
        // queue waits with them).
        let waits: Vec<(vk::Semaphore, u64)> = match &s.transfer {
            Some(x) if stream.wait_transfer > 0 => vec![(x.timeline, stream.wait_transfer)],
            _ => vec![],
        };
        // SAFETY: the command buffer is recording; ending and submitting it under the
        // lock, with a signal value above every earlier one, waiting for values that
        // were submitted to be signalled.
        let result = unsafe {
            self.device.end_command_buffer(stream.cmd).and_then(|()| {
                let cmds = [stream.cmd];
                let signals = [self.timeline];
                let values = [value];
                let wait_sems: Vec<vk::Semaphore> = waits.iter().map(|w| w.0).collect();
                let wait_values: Vec<u64> = waits.iter().map(|w| w.1).collect();
                let stages = vec![
                    vk::PipelineStageFlags::COMPUTE_SHADER
                        | vk::PipelineStageFlags::TRANSFER;
                    waits.len()
                ];
                let mut timeline = vk::TimelineSemaphoreSubmitInfo::default()
                    .wait_semaphore_values(&wait_values)
                    .signal_semaphore_values(&values);
                let submit = vk::SubmitInfo::default()
                    .command_buffers(&cmds)
                    .wait_semaphores(&wait_sems)
                    .wait_dst_stage_mask(&stages)
                    .signal_semaphores(&signals)
                    .push_next(&mut timeline);
                // Counted as submitted: tests check that the wait reaches the queue.
                if submit.wait_semaphore_count > 0 {
                    self.transfer_counts[1].fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                }
                self.queue_submit(self.queue, submit)
            })
        };
        // Whatever the stream used is retired with its value (it was tagged with it).
        s.submitted = value;
        let r = Self::retired_at(s, (value, 0));
        r.commands.push(stream.cmd);
        r.mems.push(stream.arena);
        if let Err(e) = result {
            return Err(self.failed_submit(self.timeline, value, "submitting work", e));
        }
        self.validated()?;
        Ok(value)
    }

    /// After a submission of `semaphore`'s `value` failed with `e`: nothing will signal
    /// that value, so the host does, once the queues are idle (a host signal must not
    /// pass work still pending; a lost device returns at once), lest a wait for it
    /// never end. A lost device stays lost: every later wait says so.
    pub(super) fn failed_submit(
        &self,
        semaphore: vk::Semaphore,
        value: u64,
        what: &str,
        e: vk::Result,
    ) -> Error {
        // SAFETY: the caller holds the state lock, under which every queue of this
        // device is used; then a host signal of a timeline semaphore to a value above
        // every one submitted to it, none pending any more.
        unsafe {
            let _ = self.device.device_wait_idle();
            let _ = self.device.signal_semaphore(
                &vk::SemaphoreSignalInfo::default()
                    .semaphore(semaphore)
                    .value(value),
            );
        }
        self.vk_error(what, e)
    }

    /// Submits one batch to `queue`, or fails as a lost device does where a test said
    /// the device is lost ([`VkDevice::simulate_device_lost`]).
    ///
    /// # Safety
    /// As `vkQueueSubmit`: `submit` is valid and `queue`'s use is externally
    /// synchronized (the caller holds the state lock).
    pub(super) unsafe fn queue_submit(
        &self,
        queue: vk::Queue,
        submit: vk::SubmitInfo,
    ) -> std::result::Result<(), vk::Result> {
        if self.lost.load(std::sync::atomic::Ordering::Relaxed) {
            return Err(vk::Result::ERROR_DEVICE_LOST);
        }
        self.device
            .queue_submit(queue, &[submit], vk::Fence::null())
    }
}
