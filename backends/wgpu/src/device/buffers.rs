//! The wgpu buffers behind buffer handles: checking that handles are live, resolving
//! a dispatch's ids (the device's own buffers included), and measurement scratch.

use super::*;

impl WgpuDevice {
    /// Checks that each handle is live on this device and describes the buffer it
    /// names (a handle from another device can carry a valid id with the wrong size,
    /// and kernels trust the size).
    pub(crate) fn check_live(&self, s: &State, kernel: &str, buffers: &[Buffer]) -> Result<()> {
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

    /// The wgpu buffer a dispatch binds for `id`: a user buffer (a view's parent) or
    /// one of the device's own.
    pub(super) fn resolve(&self, s: &State, id: u64) -> Result<wgpu::Buffer> {
        Ok(match id {
            SCRATCH_ID => self.scratch.clone(),
            DUMMY_ID => self.dummy.clone(),
            BAND_PARTIALS_ID => self.band_partials.clone(),
            PARTIALS_ID => s
                .partials
                .clone()
                .ok_or_else(|| self.backend_error("a dispatch binds partials never sized"))?,
            _ => s
                .buffers
                .get(&id)
                .ok_or_else(|| self.unknown(id))?
                .buffer
                .clone(),
        })
    }

    /// A zeroed buffer of `like`'s type and length, for measurements that must not
    /// touch `like` (recorded work keeps it alive; free it with [`Self::drop_scratch`]).
    pub(crate) fn scratch_like(&self, s: &mut State, like: Buffer) -> Buffer {
        let buffer = self.device.create_buffer(&wgpu::BufferDescriptor {
            label: Some("kiln measurement scratch"),
            size: like.dtype.padded_bytes(like.len),
            usage: wgpu::BufferUsages::STORAGE,
            mapped_at_creation: false,
        });
        s.register(buffer, like.dtype, like.len, None)
    }

    pub(crate) fn drop_scratch(&self, s: &mut State, buf: Buffer) {
        s.buffers.remove(&buf.id);
        s.bind_groups.retain(|k, _| !k.buffers.contains(&buf.id));
    }
}
