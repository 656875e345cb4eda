//! The dedicated transfer queue downloads are copied on (see the crate's device docs).

use super::*;

impl VkDevice {
    /// Makes the open stream wait for the transfer copies still reading any of
    /// `buffers` (ids; views count as the buffer they view), which the stream is about
    /// to write: a copy reads its source while later compute runs, so only a command
    /// that overwrites it must wait for the copy.
    pub(super) fn after_transfer_reads(&self, s: &mut State, buffers: &[Buffer]) -> Result<()> {
        if s.transfer_reads.is_empty() {
            return Ok(());
        }
        let mut wait = 0;
        for b in buffers {
            let (buffer, _, _) = self.resolve(s, b.id)?;
            // Once the stream waits, so does everything after it on the queue.
            if let Some(x) = s.transfer_reads.remove(&buffer) {
                wait = wait.max(x);
            }
        }
        if wait > 0 {
            let stream = self.stream(s)?;
            stream.wait_transfer = stream.wait_transfer.max(wait);
        }
        Ok(())
    }

    /// Submits a copy of `src` (buffer, offset) into `staging` on the transfer queue,
    /// after the compute timeline reaches `after`: the transfer timeline value it
    /// signals.
    pub(super) fn submit_transfer_copy(
        &self,
        s: &mut State,
        (src, base): (vk::Buffer, u64),
        staging: vk::Buffer,
        size: u64,
        after: u64,
    ) -> Result<u64> {
        let x = s.transfer.as_mut().expect("called with a transfer queue");
        let cmd = match x.free_commands.pop() {
            Some(c) => c,
            None => {
                let info = vk::CommandBufferAllocateInfo::default()
                    .command_pool(x.pool)
                    .level(vk::CommandBufferLevel::PRIMARY)
                    .command_buffer_count(1);
                // SAFETY: the pool belongs to this device; access is under the lock.
                unsafe { self.device.allocate_command_buffers(&info) }
                    .map_err(|e| self.vk_error("allocating a command buffer", e))?[0]
            }
        };
        let value = x.submitted + 1;
        let (queue, timeline) = (x.queue, x.timeline);
        let gate = x.gate.filter(|g| g.1).map(|g| g.0);
        let begin = vk::CommandBufferBeginInfo::default()
            .flags(vk::CommandBufferUsageFlags::ONE_TIME_SUBMIT);
        let region = vk::BufferCopy {
            src_offset: base,
            dst_offset: 0,
            size,
        };
        let to_host = vk::MemoryBarrier::default()
            .src_access_mask(vk::AccessFlags::TRANSFER_WRITE)
            .dst_access_mask(vk::AccessFlags::HOST_READ);
        // SAFETY: the command buffer is not in use (fresh, or its submission done);
        // both buffers are live and hold the ranges; it is submitted under the lock with
        // a signal value above every earlier one, waiting for a compute value already
        // submitted.
        let result = unsafe {
            self.device
                .reset_command_buffer(cmd, vk::CommandBufferResetFlags::empty())
                .and_then(|()| self.device.begin_command_buffer(cmd, &begin))
                .and_then(|()| {
                    self.device.cmd_copy_buffer(cmd, src, staging, &[region]);
                    self.device.cmd_pipeline_barrier(
                        cmd,
                        vk::PipelineStageFlags::TRANSFER,
                        vk::PipelineStageFlags::HOST,
                        vk::DependencyFlags::empty(),
                        &[to_host],
                        &[],
                        &[],
                    );
                    self.device.end_command_buffer(cmd)
                })
                .and_then(|()| {
                    let cmds = [cmd];
                    let signals = [timeline];
                    let values = [value];
                    let mut waits = vec![];
                    let mut wait_values = vec![];
                    if after > 0 {
                        waits.push(self.timeline);
                        wait_values.push(after);
                    }
                    if let Some(g) = gate {
                        waits.push(g);
                        wait_values.push(1);
                    }
                    let stages = vec![vk::PipelineStageFlags::TRANSFER; waits.len()];
                    let mut sems = vk::TimelineSemaphoreSubmitInfo::default()
                        .wait_semaphore_values(&wait_values)
                        .signal_semaphore_values(&values);
                    let submit = vk::SubmitInfo::default()
                        .command_buffers(&cmds)
                        .wait_semaphores(&waits)
                        .wait_dst_stage_mask(&stages)
                        .signal_semaphores(&signals)
                        .push_next(&mut sems);
                    self.queue_submit(queue, submit)
                })
        };
        s.transfer.as_mut().expect("checked above").submitted = value;
        Self::retired_at(s, (0, value)).transfer_commands.push(cmd);
        if let Err(e) = result {
            return Err(self.failed_submit(timeline, value, "submitting a download", e));
        }
        self.transfer_counts[0].fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let read = s.transfer_reads.entry(src).or_default();
        *read = (*read).max(value);
        Ok(value)
    }

    /// The queue family downloads are copied on, where they take the transfer path
    /// (a dedicated transfer family, or the compute family under
    /// KILN_VK_TRANSFER=same-queue); None where they are copied in the compute stream.
    pub fn transfer_family(&self) -> Option<u32> {
        self.lock().transfer.as_ref().map(|x| x.family)
    }

    /// Copies submitted to the transfer queue so far, and compute submissions that
    /// waited for one (they overwrote a buffer a copy was still reading).
    #[doc(hidden)]
    pub fn transfer_counts(&self) -> (u64, u64) {
        use std::sync::atomic::Ordering::Relaxed;
        (
            self.transfer_counts[0].load(Relaxed),
            self.transfer_counts[1].load(Relaxed),
        )
    }
}

/// The transfer queue's command pool and timeline semaphore on `family`'s `queue`.
pub(super) fn make_transfer(
    device: &ash::Device,
    family: u32,
    queue: vk::Queue,
) -> std::result::Result<Transfer, vk::Result> {
    let pool_info = vk::CommandPoolCreateInfo::default()
        .queue_family_index(family)
        .flags(vk::CommandPoolCreateFlags::RESET_COMMAND_BUFFER);
    let mut sem_type = vk::SemaphoreTypeCreateInfo::default()
        .semaphore_type(vk::SemaphoreType::TIMELINE)
        .initial_value(0);
    let sem_info = vk::SemaphoreCreateInfo::default().push_next(&mut sem_type);
    // SAFETY: valid create infos on a live device.
    let pool = unsafe { device.create_command_pool(&pool_info, None) }?;
    // SAFETY: as above.
    let timeline = match unsafe { device.create_semaphore(&sem_info, None) } {
        Ok(t) => t,
        Err(e) => {
            // SAFETY: the pool was just made and holds nothing.
            unsafe { device.destroy_command_pool(pool, None) };
            return Err(e);
        }
    };
    Ok(Transfer {
        queue,
        family,
        pool,
        timeline,
        submitted: 0,
        free_commands: vec![],
        gate: None,
    })
}
