//! A handle to device memory, and the rules a view of one follows.

use crate::{DType, Result};

/// A handle to a device buffer. Cheap to copy; only meaningful on the device that
/// allocated it. Using it after [`Device::free`] is an error, never undefined behaviour.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Buffer {
    pub id: u64,
    pub dtype: DType,
    pub len: usize,
}

/// Byte alignment of a view's start in its parent: WebGPU guarantees storage bindings
/// at multiples of 256 bytes on every adapter.
pub const VIEW_ALIGN: u64 = 256;

/// Checks a view request against its parent (shared by the backends).
pub fn check_view(parent: Buffer, offset: usize, len: usize) -> Result<()> {
    let size = parent.dtype.size() as u64;
    let start = offset as u64 * size;
    if !start.is_multiple_of(VIEW_ALIGN) {
        return Err(crate::Error::InvalidArgument(format!(
            "a view of buffer #{} starts at element {offset} ({start} bytes), not on a \
             {VIEW_ALIGN}-byte boundary: place views at multiples of {} elements",
            parent.id,
            VIEW_ALIGN / size
        )));
    }
    let end = start + parent.dtype.padded_bytes(len);
    if len == 0 || end > parent.bytes() {
        return Err(crate::Error::InvalidArgument(format!(
            "a view of {len} elements at element {offset} of buffer #{} ({} elements): \
             views must be non-empty and lie inside their buffer",
            parent.id, parent.len
        )));
    }
    Ok(())
}

impl Buffer {
    /// Bytes the device holds for this buffer (see [`DType::padded_bytes`]).
    pub fn bytes(&self) -> u64 {
        self.dtype.padded_bytes(self.len)
    }
}
