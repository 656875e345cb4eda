//! Opening a device on an adapter: its features and limits, error sinks, the
//! parameter arena and the device's own buffers, the pipeline cache and the GEMM tuner.

use super::*;

impl WgpuDevice {
    /// Opens a new, independent device on adapter `index` (see `kiln devices`).
    /// Opening the same adapter again gives another device with its own memory and queue.
    pub fn open(index: usize, options: &DeviceOptions) -> Result<WgpuDevice> {
        let adapters = raw_adapters();
        let adapter = adapters.get(index).ok_or(Error::NoSuchAdapter {
            index,
            available: adapters.len(),
        })?;
        let caps = kiln_lowering::planned(capabilities(adapter, options));
        let mut features = wgpu::Features::empty();
        if caps.f16_arithmetic {
            features |= wgpu::Features::SHADER_F16;
        }
        if caps.timestamp_queries {
            features |=
                wgpu::Features::TIMESTAMP_QUERY | wgpu::Features::TIMESTAMP_QUERY_INSIDE_PASSES;
        }
        if caps.subgroup_sizes.is_some() {
            features |= wgpu::Features::SUBGROUP;
        }
        let keep_pipelines = adapter.features().contains(wgpu::Features::PIPELINE_CACHE)
            && !options.no_pipeline_cache;
        if keep_pipelines {
            features |= wgpu::Features::PIPELINE_CACHE;
        }
        // Ask for everything the adapter offers: large buffers are the norm here.
        let limits = wgpu::Limits {
            max_storage_buffer_binding_size: caps.max_storage_binding,
            ..adapter.limits()
        };
        // Every device of a GL adapter shares its one context: opening one takes it.
        let lock = context::for_adapter(index, adapter.get_info().backend);
        let _held = context::enter(lock);
        let (device, queue) =
            pollster::block_on(adapter.request_device(&device_descriptor(features, &limits)))
                .map_err(|e| Error::Backend {
                    device: caps.name.clone(),
                    detail: format!("could not open a device: {e}"),
                })?;

        let errors = Arc::new(Mutex::new(Vec::new()));
        let sink = errors.clone();
        device.on_uncaptured_error(Arc::new(move |e: wgpu::Error| {
            sink.lock()
                .unwrap_or_else(|p| p.into_inner())
                .push(e.to_string());
        }));
        // A lost device fails every later submission with a message about submission
        // indices; the loss itself, with the driver's reason, is what the user needs.
        let lost = errors.clone();
        device.set_device_lost_callback(move |reason, message| {
            if reason != wgpu::DeviceLostReason::Destroyed {
                lost.lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .push(format!("the device was lost ({reason:?}): {message}"));
            }
        });

        let arena_stride =
            PARAMS_MAX.next_multiple_of(device.limits().min_uniform_buffer_offset_alignment as u64);
        let arena = device.create_buffer(&wgpu::BufferDescriptor {
            label: Some("kiln params arena"),
            size: arena_stride * ARENA_SLOTS,
            usage: wgpu::BufferUsages::UNIFORM | wgpu::BufferUsages::COPY_DST,
            mapped_at_creation: false,
        });
        let scratch = device.create_buffer(&wgpu::BufferDescriptor {
            label: Some("kiln reduce partials"),
            size: scratch_bytes(),
            usage: wgpu::BufferUsages::STORAGE,
            mapped_at_creation: false,
        });
        let band_partials = device.create_buffer(&wgpu::BufferDescriptor {
            label: Some("kiln banded reduce partials"),
            size: band_partials_bytes(),
            usage: wgpu::BufferUsages::STORAGE,
            mapped_at_creation: false,
        });
        let dummy = device.create_buffer(&wgpu::BufferDescriptor {
            label: Some("kiln absent operand"),
            size: DUMMY_BYTES,
            usage: wgpu::BufferUsages::STORAGE,
            mapped_at_creation: false,
        });
        let disk_cache = keep_pipelines
            .then(|| crate::pipeline_cache::open(&device, adapter, options))
            .flatten()
            .map(Arc::new);
        let tuner = crate::tune::open(&adapter.get_info(), options, &caps.device_type);
        let broken = Broken::default();
        let held_buffer = |v| Guarded::new(v, lock, &broken);
        Ok(WgpuDevice {
            disk_cache,
            built: Guarded::new(Arc::default(), lock, &broken),
            adapter: adapter.clone(),
            features,
            limits,
            primer: std::sync::OnceLock::new(),
            primed_keys: Arc::default(),
            slow_lane: Arc::default(),
            compile_queues: Mutex::default(),
            busy: Arc::default(),
            dummy: held_buffer(dummy),
            band_partials: held_buffer(band_partials),
            arena: held_buffer(arena),
            scratch: held_buffer(scratch),
            caps,
            device: Guarded::new(device, lock, &broken),
            queue: Guarded::new(queue, lock, &broken),
            arena_stride,
            errors,
            state: Guarded::new(
                Mutex::new(State {
                    next_id: 1,
                    tuner,
                    ..State::default()
                }),
                lock,
                &broken,
            ),
            profile: std::env::var_os("KILN_PROFILE").map(|_| Mutex::new(HashMap::new())),
            context: lock,
            failure: std::sync::OnceLock::new(),
            broken,
        })
    }
}

/// How a device is opened; the primer's device is opened alike, so the driver sees
/// the same shaders.
pub(super) fn device_descriptor(
    features: wgpu::Features,
    limits: &wgpu::Limits,
) -> wgpu::DeviceDescriptor<'static> {
    wgpu::DeviceDescriptor {
        label: Some("kiln"),
        required_features: features,
        required_limits: limits.clone(),
        ..Default::default()
    }
}
