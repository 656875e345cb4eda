//! Hooks for the tests (the `test-hooks` feature, which the root package's tests
//! enable): force a plan or a route, hold or release queues, make a submission fail or
//! the validation layer object, and read counters the contract does not expose.

use super::transfer::make_transfer;
use super::*;

impl VkDevice {
    /// Test hook: records two fills of one internal buffer with no barrier between
    /// them (a write-after-write hazard for synchronization validation,
    /// SYNC-HAZARD-WRITE-AFTER-WRITE) and a pipeline barrier the layer rejects (a
    /// source access, shader writes, that its source stage, transfers, cannot make;
    /// VUID-vkCmdPipelineBarrier-srcAccessMask-02815), all of which drivers run safely,
    /// to show that the next sync point reports them.
    pub fn provoke_validation_error(&self) -> Result<()> {
        let mut s = self.lock();
        let (dummy, _, size) = self.resolve(&s, DUMMY_ID)?;
        let cmd = self.stream(&mut s)?.cmd;
        // SAFETY: `cmd` is recording; the placeholder buffer holds `size` bytes and is
        // never read for its contents.
        unsafe {
            self.device.cmd_fill_buffer(cmd, dummy, 0, size, 0);
            self.device.cmd_fill_buffer(cmd, dummy, 0, size, 0);
        }
        let bad = vk::MemoryBarrier::default()
            .src_access_mask(vk::AccessFlags::SHADER_WRITE)
            .dst_access_mask(vk::AccessFlags::TRANSFER_READ);
        // SAFETY: `cmd` is recording; the masks are invalid only as the layer checks
        // them, and drivers execute a barrier with extra access bits as a wider one.
        unsafe {
            self.device.cmd_pipeline_barrier(
                cmd,
                vk::PipelineStageFlags::TRANSFER,
                vk::PipelineStageFlags::TRANSFER,
                vk::DependencyFlags::empty(),
                &[bad],
                &[],
                &[],
            )
        };
        // What follows sees the fills, as after any command.
        self.barrier(cmd);
        Ok(())
    }

    /// Runs the fused attention with `plan` instead of the device's own (`None`: its
    /// own again), so that tests reach the GPU-shaped kernel (`shared: false`, a
    /// 64-lane workgroup) on a CPU driver.
    pub fn force_attention_plan(&self, plan: Option<AttentionPlan>) {
        *self
            .attention_plan
            .lock()
            .unwrap_or_else(|e| e.into_inner()) = plan;
    }

    /// Big GEMM blocks and attention kernels run first on the primer's device so far
    /// (0 without a primer; devices on one physical device share it).
    pub fn primed_blocks(&self) -> usize {
        self.primer.as_ref().map_or(0, |p| p.primed())
    }

    /// GEMM and attention launches that ran a stand-in (a smaller GEMM block, one
    /// attention row per lane) while theirs was being primed.
    pub fn gemm_stand_ins(&self) -> u64 {
        self.stand_ins.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Waits until the primer has run every block asked of it.
    pub fn wait_for_primer(&self) {
        if let Some(p) = &self.primer {
            p.wait_idle();
        }
    }

    /// Test hook: from now on every queue submission fails with
    /// `VK_ERROR_DEVICE_LOST`, as on a device the driver lost (lavapipe never loses
    /// one), so that tests see what a lost device does to each call.
    pub fn simulate_device_lost(&self) {
        self.lost.store(true, std::sync::atomic::Ordering::Relaxed);
    }

    /// Test hook: from now on, downloads take the transfer path (their own command
    /// pool, timeline semaphore and waits) on the compute queue, as on a device with a
    /// dedicated transfer family, which lavapipe lacks. (KILN_VK_TRANSFER=same-queue
    /// does the same from the open.)
    pub fn use_transfer_path_on_compute_queue(&self) -> Result<()> {
        let mut s = self.lock();
        if s.transfer.is_some() {
            return Ok(());
        }
        let x = make_transfer(&self.device, self.family, self.queue)
            .map_err(|e| self.vk_error("setting up the transfer path", e))?;
        s.transfer = Some(x);
        Ok(())
    }

    /// Test hook: transfer copies submitted from now on wait (on the device) until
    /// [`VkDevice::release_transfers`], so that a test can act while a copy is still
    /// pending, as on a GPU whose copy engine is busy. With the transfer path on the
    /// compute queue, later compute submissions wait behind them too: nothing may wait
    /// for the device before the release.
    pub fn hold_transfers(&self) -> Result<()> {
        let mut s = self.lock();
        let x = s.transfer.as_mut().ok_or_else(|| {
            Error::InvalidArgument("hold_transfers without a transfer path".into())
        })?;
        if x.gate.is_some() {
            return Err(Error::InvalidArgument(
                "hold_transfers holds a device's transfers once".into(),
            ));
        }
        let mut sem_type = vk::SemaphoreTypeCreateInfo::default()
            .semaphore_type(vk::SemaphoreType::TIMELINE)
            .initial_value(0);
        let info = vk::SemaphoreCreateInfo::default().push_next(&mut sem_type);
        // SAFETY: a valid create info on a live device.
        let gate = unsafe { self.device.create_semaphore(&info, None) }
            .map_err(|e| self.vk_error("creating a semaphore", e))?;
        x.gate = Some((gate, true));
        Ok(())
    }

    /// Test hook: bytes of buffers freed (or otherwise retired) that submissions
    /// still pending may use, after releasing what the device has finished with.
    pub fn retired_bytes(&self) -> Result<u64> {
        let mut s = self.lock();
        self.reclaim(&mut s)?;
        Ok(s.retired
            .iter()
            .flat_map(|(_, r)| &r.mems)
            .filter(|m| !m.arena)
            .map(|m| m.size)
            .sum())
    }

    /// Lets the copies held by [`VkDevice::hold_transfers`] run.
    pub fn release_transfers(&self) -> Result<()> {
        let mut s = self.lock();
        if let Some((gate, held)) = s.transfer.as_mut().and_then(|x| x.gate.as_mut()) {
            if *held {
                *held = false;
                // SAFETY: a host signal of a timeline semaphore of this device, once.
                unsafe {
                    self.device.signal_semaphore(
                        &vk::SemaphoreSignalInfo::default().semaphore(*gate).value(1),
                    )
                }
                .map_err(|e| self.vk_error("releasing the transfers", e))?;
            }
        }
        Ok(())
    }
}
