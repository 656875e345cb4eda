//! The device layer: the contract every backend implements ([`Device`], here), the
//! kernels a device launches described as data (`kernels`: one struct per kernel with
//! its checks and cost; `optim`: the optimizer's launches), element types (`dtype`),
//! host copies of buffers (`host`) and named buffers saved to and loaded from
//! safetensors files (`safetensors_io`). It imports nothing above it.
//!
//! The trait is deliberately narrow — memory, kernel launches, submission — and
//! object-safe, so a device group can hold `Box<dyn Device>`s of different backends side
//! by side.

mod buffer;
pub mod compiling;
pub mod cost;
pub mod dtype;
pub mod host;
pub mod kernels;
pub mod optim;
pub mod profile;
pub mod rope;
pub mod safetensors_io;

use serde::Serialize;

use crate::{DType, HostData, Kernel, Result};
pub use buffer::{check_view, Buffer, VIEW_ALIGN};
pub use profile::KernelTiming;
pub use rope::{RopeFreqs, RopeScaling};

/// What a device is and what it can do.
#[derive(Clone, Debug, Serialize)]
pub struct Capabilities {
    /// Adapter name as the driver reports it.
    pub name: String,
    /// `vulkan`, `gl`, `metal`, `dx12` or `cpu`.
    pub backend: String,
    /// `discrete`, `integrated`, `virtual`, `cpu` or `other`.
    pub device_type: String,
    /// PCI vendor id (0 when unknown).
    pub vendor: u32,
    /// Driver name and version, when reported.
    pub driver: String,
    /// Kernels compute natively in f16. When false, f16 tensors are still stored in
    /// 16 bits and the kernels widen them to f32.
    pub f16_arithmetic: bool,
    /// Smallest and largest subgroup size, when subgroup operations are available.
    pub subgroup_sizes: Option<(u32, u32)>,
    /// GPU timestamps can be written from inside compute passes.
    pub timestamp_queries: bool,
    /// Largest storage buffer one kernel binding can see, in bytes.
    pub max_storage_binding: u64,
    /// Largest buffer that can be allocated, in bytes.
    pub max_buffer: u64,
    /// Device memory the driver lets this process use now, in bytes, when it says
    /// (Vulkan's `VK_EXT_memory_budget`).
    pub memory_budget: Option<u64>,
    /// Size of the device-local memory heaps, in bytes, when known (Vulkan reports it,
    /// through vk and through wgpu's Vulkan adapters; wgpu's other backends and the CPU
    /// reference do not): the most the device can hold. A CPU driver's (lavapipe's 2
    /// GiB) is nominal: it keeps device memory in host memory and allocates past it.
    pub memory_heap: Option<u64>,
    /// The user's size for this device's memory (`--memory-limit`), in place of the
    /// driver's budget and heap.
    pub memory_limit: Option<u64>,
}

/// The summed size of the device-local heaps among `heaps` (size, device-local), or
/// `None` when there are none: `memory_heap` as both Vulkan backends read it.
pub fn device_local_total(heaps: impl IntoIterator<Item = (u64, bool)>) -> Option<u64> {
    let total: u64 = heaps
        .into_iter()
        .filter(|&(_, local)| local)
        .map(|(size, _)| size)
        .sum();
    (total > 0).then_some(total)
}

impl Capabilities {
    /// These capabilities with the user's memory limit, where given: what a device
    /// opened with one reports (the user's word over the driver's).
    pub fn with_memory_limit(mut self, limit: Option<u64>) -> Capabilities {
        if limit.is_some() {
            self.memory_limit = limit;
        }
        self
    }

    /// The device memory a run may use, and what says so: the user's limit, else the
    /// driver's budget, else a GPU's device-local heap (a CPU driver's heap is nominal
    /// and not a limit: its memory is the host's, checked as such).
    pub fn memory_cap(&self) -> Option<(u64, &'static str)> {
        match (self.memory_limit, self.memory_budget, self.memory_heap) {
            (Some(l), _, _) => Some((l, "--memory-limit")),
            (None, Some(b), _) => Some((b, "memory budget")),
            (None, None, Some(h)) if self.device_type != "cpu" => {
                Some((h, "device-local memory heap"))
            }
            _ => None,
        }
    }
}

/// A download whose copy is queued on a device; redeem it with
/// [`Device::finish_download`] on that device.
#[derive(Debug)]
pub struct PendingDownload {
    /// The device's ticket for the staged copy.
    pub ticket: u64,
    pub buffer: Buffer,
}

/// One compute device. Launches are recorded into the device's stream in program
/// order and run when submitted; uploads and downloads keep that order too.
pub trait Device: Send + Sync {
    /// What this device is and can do.
    fn caps(&self) -> &Capabilities;

    /// Allocates a zero-filled buffer of `len` elements.
    fn alloc(&self, dtype: DType, len: usize) -> Result<Buffer>;

    /// Releases a buffer. Launches already recorded that use it still complete.
    /// Freeing a view releases the view only; freeing a buffer that still has live
    /// views is an error.
    fn free(&self, buf: Buffer) -> Result<()>;

    /// A buffer naming elements `offset .. offset + len` of `parent` (same dtype):
    /// kernels, uploads and downloads on it touch only that range. How a model keeps
    /// its tensors in a few flat buffers that one launch can update together. The
    /// offset must fall on [`VIEW_ALIGN`] bytes and the range inside the parent, whose
    /// padded size covers the view's; a view of a view is an error.
    fn view(&self, parent: Buffer, offset: usize, len: usize) -> Result<Buffer>;

    /// Copies host data into a buffer; dtype and length must match exactly.
    fn upload(&self, buf: Buffer, data: &HostData) -> Result<()>;

    /// Copies a buffer to the host, after everything recorded before it has run.
    fn download(&self, buf: Buffer) -> Result<HostData> {
        let pending = self.begin_download(buf)?;
        self.finish_download(pending)
    }

    /// Queues a copy of `buf` to host-visible staging memory behind everything
    /// recorded so far and submits it, without waiting: work recorded afterwards runs
    /// while the host fetches the copy with [`Device::finish_download`] (a data-parallel
    /// group overlaps its gradient exchange with backward this way).
    fn begin_download(&self, buf: Buffer) -> Result<PendingDownload>;

    /// Waits for the copy [`Device::begin_download`] queued (not for later work) and
    /// returns the data.
    fn finish_download(&self, pending: PendingDownload) -> Result<HostData>;

    /// Records a kernel launch into the stream. Nothing runs until [`Device::submit`].
    fn launch(&self, kernel: &Kernel) -> Result<()>;

    /// Sends everything recorded so far to the device, as few submissions as possible.
    fn submit(&self) -> Result<()>;

    /// Blocks until every submitted launch has finished.
    fn wait(&self) -> Result<()>;

    /// Whether submitted work is still running, as a snapshot (never waits): host work
    /// done while it is counts as hidden behind the device's. A device that runs each
    /// launch as it is recorded (the CPU backend) is never busy.
    fn busy(&self) -> Result<bool> {
        Ok(false)
    }

    /// Bytes of device memory held by live buffers allocated through this trait.
    fn allocated_bytes(&self) -> u64;

    /// Compiles ahead of time what launching `kernels` will need (a backend's
    /// pipelines), without recording or running any of them, so that their first launch
    /// does not stop to compile. A plan calls it with all its launches before its first
    /// run; a backend that can compiles them concurrently and reports each finished one
    /// to [`compiling`]. Devices with nothing to compile do nothing.
    fn prepare(&self, kernels: &[Kernel]) -> Result<()> {
        let _ = kernels;
        Ok(())
    }

    /// Starts timing every launch recorded from now on, each on its own (GPU
    /// timestamps around it where the adapter has them), until
    /// [`Device::profile_end`]. Waits for the device first. Changes no results. An
    /// error where the device cannot time its launches, saying so.
    fn profile_begin(&self) -> Result<()> {
        Err(crate::Error::Unsupported {
            device: self.caps().name.clone(),
            what: "timing kernel launches (the profile has host spans only)".to_string(),
        })
    }

    /// Waits for the launches recorded since [`Device::profile_begin`] and returns their
    /// timings, in launch order, on the host's clock; timing stops.
    fn profile_end(&self) -> Result<Vec<KernelTiming>> {
        Err(crate::Error::Unsupported {
            device: self.caps().name.clone(),
            what: "timing kernel launches (the profile has host spans only)".to_string(),
        })
    }
}

/// Checks an allocation of `len` elements of `dtype` against what a GPU backend can
/// hold: element counts within the kernels' 32-bit indices, and bytes within the
/// device's largest buffer (`caps.max_buffer`). Returns the bytes to allocate.
pub fn check_alloc(caps: &Capabilities, dtype: DType, len: usize) -> Result<u64> {
    // The kernels take element counts as 32-bit integers: a longer buffer would be
    // processed only up to the wrapped count, silently.
    if len > u32::MAX as usize {
        return Err(crate::Error::InvalidArgument(format!(
            "a buffer of {len} {dtype} elements on `{}`: the kernels index at most {} \
             elements; use smaller tensors (a smaller micro-batch, sequence or model \
             dimension)",
            caps.name,
            u32::MAX
        )));
    }
    let bytes = dtype.padded_bytes(len);
    let max = caps.max_buffer;
    if bytes > max {
        return Err(crate::Error::OutOfMemory {
            device: caps.name.clone(),
            detail: format!(
                "{len} {dtype} elements need {bytes} bytes, over the device's largest \
                 buffer of {max} bytes. For a model: a smaller micro-batch or sequence \
                 (activations), or smaller model dimensions (parameters: the f32 master \
                 weights of the largest tensor are one buffer); `kiln estimate` shows which"
            ),
        });
    }
    Ok(bytes)
}

/// Checks that a GPU backend can open a profile: the device has timestamp queries and
/// no profile is open (`open`).
pub fn check_profile_begin(caps: &Capabilities, open: bool) -> Result<()> {
    if !caps.timestamp_queries {
        return Err(crate::Error::Unsupported {
            device: caps.name.clone(),
            what: "GPU timestamp queries, so its kernels cannot be timed: a profile has host \
                   spans only"
                .to_string(),
        });
    }
    if open {
        return Err(crate::Error::InvalidArgument(format!(
            "profile_begin on `{}` while a profile is already open: call profile_end first",
            caps.name
        )));
    }
    Ok(())
}

/// Checks that host data fits a buffer exactly.
pub fn check_upload(buf: Buffer, data: &HostData) -> Result<()> {
    if data.dtype() != buf.dtype {
        return Err(crate::Error::DTypeMismatch {
            what: format!("upload into buffer #{}", buf.id),
            expected: buf.dtype,
            found: data.dtype(),
        });
    }
    if data.len() != buf.len {
        return Err(crate::Error::LenMismatch {
            what: format!("upload into buffer #{}", buf.id),
            expected: buf.len,
            found: data.len(),
        });
    }
    Ok(())
}
