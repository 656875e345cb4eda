//! One thread at a time in a GL context, and no wgpu panic past a device call.
//!
//! wgpu's GL backend drives every device of an adapter through that adapter's one GL
//! context, behind a lock it gives up on after a few seconds: a thread that waits
//! longer panics ("Could not lock adapter context"), and a panic that unwinds through
//! a device's drop locks it again and aborts the process. A pipeline build, a long
//! submission or a fence wait on a slow driver (llvmpipe on a loaded host, a phone)
//! holds the context for longer than that. So on GL, Kiln takes a lock of its own
//! per adapter first, one that waits as long as it must, around every call that can
//! reach the context: every [`Device`](kiln_engine::Device) method, the public
//! measurements, and the drop of everything wgpu owns. It is reentrant, as device
//! methods call each other. Pipelines build on the calling thread there, never on the
//! compile workers (`device.rs`). Vulkan, Metal and DX12 devices are thread-safe
//! without it and keep their background compiles.
//!
//! A panic inside wgpu on any backend becomes an error naming the device; the device
//! refuses every later call, and its wgpu objects are leaked rather than dropped (a
//! drop would reach the driver that failed).

use std::mem::ManuallyDrop;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, OnceLock};

use parking_lot::{ReentrantMutex, ReentrantMutexGuard};

/// Kiln's lock of one adapter's GL context; `None` off GL.
pub(crate) type ContextLock = Option<&'static ReentrantMutex<()>>;

/// The lock of adapter `index` (of `adapter::raw_adapters`) when its backend is GL.
pub(crate) fn for_adapter(index: usize, backend: wgpu::Backend) -> ContextLock {
    static LOCKS: OnceLock<Vec<ReentrantMutex<()>>> = OnceLock::new();
    if backend != wgpu::Backend::Gl {
        return None;
    }
    let locks = LOCKS.get_or_init(|| {
        (0..crate::adapter::raw_adapters().len())
            .map(|_| ReentrantMutex::new(()))
            .collect()
    });
    locks.get(index)
}

/// Holds the context (if any) for the life of the guard.
pub(crate) fn enter(lock: ContextLock) -> Option<ReentrantMutexGuard<'static, ()>> {
    lock.map(ReentrantMutex::lock)
}

/// Set once wgpu panicked on a device: its calls fail, its objects are leaked.
pub(crate) type Broken = Arc<AtomicBool>;

/// A wgpu object whose drop runs inside its adapter's context lock, and not at all
/// once its device is broken or while the thread unwinds from a panic (a second panic
/// there would abort).
pub(crate) struct Guarded<T> {
    value: ManuallyDrop<T>,
    lock: ContextLock,
    broken: Broken,
}

impl<T> Guarded<T> {
    pub(crate) fn new(value: T, lock: ContextLock, broken: &Broken) -> Guarded<T> {
        Guarded {
            value: ManuallyDrop::new(value),
            lock,
            broken: broken.clone(),
        }
    }
}

impl<T> std::ops::Deref for Guarded<T> {
    type Target = T;
    fn deref(&self) -> &T {
        &self.value
    }
}

impl<T> Drop for Guarded<T> {
    fn drop(&mut self) {
        if self.broken.load(Ordering::Acquire) || std::thread::panicking() {
            return;
        }
        let _held = enter(self.lock);
        // SAFETY: dropped once, here; `value` is not used after.
        unsafe { ManuallyDrop::drop(&mut self.value) }
    }
}

/// The message of a caught panic.
pub(crate) fn panic_message(payload: &(dyn std::any::Any + Send)) -> String {
    payload
        .downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| payload.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "a panic without a message".into())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{DeviceOptions, WgpuDevice};
    use kiln_engine::{DType, Device};

    /// A panic inside a device call (as wgpu's on a context it could not lock) is an
    /// error naming the device; the device refuses later calls with the same reason and
    /// drops without touching the driver; the adapter's context lock is free after it,
    /// so another device on the adapter works (GL, where the lock exists).
    #[test]
    fn a_panic_in_a_device_call_is_an_error_and_the_device_refuses_later_calls() {
        let gl = crate::find_adapter("gl").unwrap_or_else(|e| panic!("{e}"));
        let dev = WgpuDevice::open(gl, &DeviceOptions::default()).unwrap();
        let name = dev.caps().name.clone();
        let e = dev
            .call(|| -> kiln_engine::Result<()> { panic!("simulated driver panic") })
            .unwrap_err()
            .to_string();
        assert!(
            e.contains(&name) && e.contains("simulated driver panic"),
            "{e}"
        );
        assert!(e.contains("open a new device"), "{e}");
        let later = dev.alloc(DType::F32, 4).unwrap_err().to_string();
        assert!(later.contains("simulated driver panic"), "{later}");
        drop(dev);
        let other = std::thread::spawn(move || {
            let dev = WgpuDevice::open(gl, &DeviceOptions::default()).unwrap();
            let b = dev.alloc(DType::F32, 3).unwrap();
            dev.upload(b, &kiln_engine::HostData::F32(vec![1.0, 2.0, 3.0]))
                .unwrap();
            dev.download(b).unwrap().to_f32()
        });
        assert_eq!(other.join().unwrap(), [1.0, 2.0, 3.0]);
    }

    /// A broken device's objects are never dropped; a sound one's are.
    #[test]
    fn a_broken_devices_objects_are_leaked() {
        struct Counted(Arc<std::sync::atomic::AtomicUsize>);
        impl Drop for Counted {
            fn drop(&mut self) {
                self.0.fetch_add(1, Ordering::SeqCst);
            }
        }
        let drops = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let broken: Broken = Arc::default();
        drop(Guarded::new(Counted(drops.clone()), None, &broken));
        assert_eq!(drops.load(Ordering::SeqCst), 1);
        broken.store(true, Ordering::Release);
        drop(Guarded::new(Counted(drops.clone()), None, &broken));
        assert_eq!(drops.load(Ordering::SeqCst), 1);
    }
}
