//! A wgpu device behind Kiln's device contract.
//!
//! Resource lifetimes, explicitly:
//! - buffers live in `State::buffers` from `alloc` to `free`;
//! - pipelines and bind-group layouts are created on first use and kept for the
//!   device's life; bind groups are cached per (pipeline, buffers) and dropped when
//!   one of their buffers is freed;
//! - launches are recorded into one open command encoder (the stream); their
//!   parameters go into a uniform arena, bound with dynamic offsets and written once
//!   per submit, so a step of N launches is one `queue.submit`, not N.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard};

use kiln_engine::device::check_upload;
use kiln_engine::{
    BinaryOp, Buffer, Capabilities, DType, Device, Error, HostData, Kernel, ReduceOp, Result,
};

use crate::adapter::{capabilities, raw_adapters, DeviceOptions};
use crate::shader::{self, Access, KernelSource, Repr};

const WORKGROUP: u32 = 256;
const MAX_GROUPS: u32 = 65535;
/// Workgroups in the first pass of a reduction, so also the partials the second folds.
const REDUCE_GROUPS: u32 = 256;
/// Bytes of the largest launch parameters (`shaders/common/matmul_params.wgsl`).
const PARAMS_MAX: u64 = shader::MATMUL_PARAMS_SIZE;
/// Launches whose parameters fit one arena; past that the stream is submitted early.
const ARENA_SLOTS: u64 = 4096;
/// Internal buffer ids live at the top of the id space, apart from user buffers.
pub(crate) const SCRATCH_ID: u64 = u64::MAX;
pub(crate) const PARTIALS_ID: u64 = u64::MAX - 1;
pub(crate) const DUMMY_ID: u64 = u64::MAX - 2;

pub struct WgpuDevice {
    pub(crate) caps: Capabilities,
    device: wgpu::Device,
    queue: wgpu::Queue,
    /// Alignment of dynamic uniform offsets.
    arena_stride: u64,
    arena: wgpu::Buffer,
    /// Partials of a reduction's first pass; also bound where a kernel's optional
    /// operand is absent.
    pub(crate) scratch: wgpu::Buffer,
    /// Bound read-only where a kernel's optional input is absent (a buffer may not be
    /// bound both read-only and writable in one dispatch, so it cannot be `scratch`).
    pub(crate) dummy: wgpu::Buffer,
    /// Validation errors wgpu reports out of band; checked at submit.
    errors: Arc<Mutex<Vec<String>>>,
    state: Mutex<State>,
}

struct Slot {
    buffer: wgpu::Buffer,
    meta: Buffer,
}

#[derive(Clone, PartialEq, Eq, Hash)]
struct PipelineKey {
    name: &'static str,
    reprs: Vec<Repr>,
    consts: Vec<(&'static str, u32)>,
    overrides: Vec<(&'static str, u32)>,
}

#[derive(Clone, PartialEq, Eq, Hash)]
struct BindKey {
    pipeline: PipelineKey,
    buffers: Vec<u64>,
    ranges: Vec<(usize, u64, u64)>,
}

#[derive(Default)]
pub(crate) struct State {
    next_id: u64,
    buffers: HashMap<u64, Slot>,
    allocated: u64,
    layouts: HashMap<(Vec<Access>, u64), (wgpu::BindGroupLayout, wgpu::PipelineLayout)>,
    pipelines: HashMap<PipelineKey, wgpu::ComputePipeline>,
    bind_groups: HashMap<BindKey, wgpu::BindGroup>,
    encoder: Option<wgpu::CommandEncoder>,
    /// Parameters of the launches recorded since the last submit.
    params: Vec<u8>,
    /// f32 split-K partials of GEMMs (grown on demand, kept for reuse).
    pub(crate) partials: Option<wgpu::Buffer>,
}

/// One dispatch, before it is recorded.
pub(crate) struct Dispatch<'a> {
    pub kernel: &'static KernelSource,
    pub reprs: Vec<Repr>,
    /// Assembly-time constants (tile shapes); each set is its own module.
    pub consts: Vec<(&'static str, u32)>,
    /// Pipeline-overridable constants (`override` in WGSL), as u32 (bools: 0 or 1).
    pub overrides: Vec<(&'static str, u32)>,
    /// (id, buffer) per slot, in slot order.
    pub buffers: Vec<(u64, &'a wgpu::Buffer)>,
    /// (slot, byte offset, byte size) for slots bound to part of their buffer.
    pub ranges: Vec<(usize, u64, u64)>,
    pub params: Vec<u32>,
    pub groups: (u32, u32, u32),
}

impl<'a> Dispatch<'a> {
    /// A dispatch with no assembly constants, overrides or partial bindings.
    pub fn new(
        kernel: &'static KernelSource,
        reprs: Vec<Repr>,
        buffers: Vec<(u64, &'a wgpu::Buffer)>,
        params: Vec<u32>,
        groups: (u32, u32, u32),
    ) -> Dispatch<'a> {
        Dispatch {
            kernel,
            reprs,
            consts: vec![],
            overrides: vec![],
            buffers,
            ranges: vec![],
            params,
            groups,
        }
    }

    pub fn with_overrides(mut self, overrides: Vec<(&'static str, u32)>) -> Dispatch<'a> {
        self.overrides = overrides;
        self
    }
}

impl WgpuDevice {
    /// Opens a new, independent device on adapter `index` (see `kiln devices`).
    /// Opening the same adapter again gives another device with its own memory and queue.
    pub fn open(index: usize, options: &DeviceOptions) -> Result<WgpuDevice> {
        let adapters = raw_adapters();
        let adapter = adapters.get(index).ok_or(Error::NoSuchAdapter {
            index,
            available: adapters.len(),
        })?;
        let caps = capabilities(adapter, options.disable_f16);
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
        let (device, queue) = pollster::block_on(adapter.request_device(&wgpu::DeviceDescriptor {
            label: Some("kiln"),
            required_features: features,
            // Ask for everything the adapter offers: large buffers are the norm here.
            required_limits: adapter.limits(),
            ..Default::default()
        }))
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

        let arena_stride =
            (device.limits().min_uniform_buffer_offset_alignment as u64).max(PARAMS_MAX);
        let arena = device.create_buffer(&wgpu::BufferDescriptor {
            label: Some("kiln params arena"),
            size: arena_stride * ARENA_SLOTS,
            usage: wgpu::BufferUsages::UNIFORM | wgpu::BufferUsages::COPY_DST,
            mapped_at_creation: false,
        });
        let scratch = device.create_buffer(&wgpu::BufferDescriptor {
            label: Some("kiln reduce partials"),
            size: DType::F32.padded_bytes(REDUCE_GROUPS as usize),
            usage: wgpu::BufferUsages::STORAGE,
            mapped_at_creation: false,
        });
        let dummy = device.create_buffer(&wgpu::BufferDescriptor {
            label: Some("kiln absent operand"),
            size: 16,
            usage: wgpu::BufferUsages::STORAGE,
            mapped_at_creation: false,
        });
        Ok(WgpuDevice {
            dummy,
            caps,
            device,
            queue,
            arena_stride,
            arena,
            scratch,
            errors,
            state: Mutex::new(State {
                next_id: 1,
                ..State::default()
            }),
        })
    }

    pub(crate) fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub(crate) fn backend_error(&self, detail: impl Into<String>) -> Error {
        Error::Backend {
            device: self.caps.name.clone(),
            detail: detail.into(),
        }
    }

    /// Reports errors wgpu raised since the last check.
    fn check_errors(&self) -> Result<()> {
        let mut errs = self.errors.lock().unwrap_or_else(|e| e.into_inner());
        if errs.is_empty() {
            return Ok(());
        }
        let all = std::mem::take(&mut *errs).join("; ");
        Err(self.backend_error(all))
    }

    pub(crate) fn unknown(&self, id: u64) -> Error {
        Error::UnknownBuffer {
            id,
            device: self.caps.name.clone(),
        }
    }

    pub(crate) fn encoder<'s>(&self, s: &'s mut State) -> &'s mut wgpu::CommandEncoder {
        s.encoder.get_or_insert_with(|| {
            self.device
                .create_command_encoder(&wgpu::CommandEncoderDescriptor {
                    label: Some("kiln stream"),
                })
        })
    }

    /// Submits the open stream, if any, with its parameters.
    fn flush(&self, s: &mut State) -> Result<()> {
        let Some(encoder) = s.encoder.take() else {
            return Ok(());
        };
        if !s.params.is_empty() {
            self.queue.write_buffer(&self.arena, 0, &s.params);
            s.params.clear();
        }
        self.queue.submit([encoder.finish()]);
        self.check_errors()
    }

    fn layout<'s>(
        &self,
        s: &'s mut State,
        kernel: &KernelSource,
    ) -> &'s (wgpu::BindGroupLayout, wgpu::PipelineLayout) {
        let accesses: Vec<Access> = kernel.slots.iter().map(|slot| slot.access).collect();
        let params_size = kernel.params_size;
        s.layouts
            .entry((accesses.clone(), params_size))
            .or_insert_with(|| {
                let mut entries = vec![wgpu::BindGroupLayoutEntry {
                    binding: 0,
                    visibility: wgpu::ShaderStages::COMPUTE,
                    ty: wgpu::BindingType::Buffer {
                        ty: wgpu::BufferBindingType::Uniform,
                        has_dynamic_offset: true,
                        min_binding_size: wgpu::BufferSize::new(params_size),
                    },
                    count: None,
                }];
                for (i, a) in accesses.iter().enumerate() {
                    entries.push(wgpu::BindGroupLayoutEntry {
                        binding: i as u32 + 1,
                        visibility: wgpu::ShaderStages::COMPUTE,
                        ty: wgpu::BindingType::Buffer {
                            ty: wgpu::BufferBindingType::Storage {
                                read_only: *a == Access::Read,
                            },
                            has_dynamic_offset: false,
                            min_binding_size: None,
                        },
                        count: None,
                    });
                }
                let bgl = self
                    .device
                    .create_bind_group_layout(&wgpu::BindGroupLayoutDescriptor {
                        label: Some("kiln kernel bindings"),
                        entries: &entries,
                    });
                let pl = self
                    .device
                    .create_pipeline_layout(&wgpu::PipelineLayoutDescriptor {
                        label: Some("kiln kernel layout"),
                        bind_group_layouts: &[Some(&bgl)],
                        immediate_size: 0,
                    });
                (bgl, pl)
            })
    }

    fn pipeline(&self, s: &mut State, key: &PipelineKey, kernel: &KernelSource) -> Result<()> {
        if s.pipelines.contains_key(key) {
            return Ok(());
        }
        if kernel.subgroups && self.caps.subgroup_sizes.is_none() {
            return Err(Error::Unsupported {
                device: self.caps.name.clone(),
                what: format!("subgroup operations, which kernel {} needs", kernel.name),
            });
        }
        let source = shader::assemble(kernel, &key.reprs, &key.consts);
        let scope = self.device.push_error_scope(wgpu::ErrorFilter::Validation);
        let desc = wgpu::ShaderModuleDescriptor {
            label: Some(kernel.name),
            source: wgpu::ShaderSource::Wgsl(source.into()),
        };
        let module = if kernel.trusted {
            // SAFETY: `trusted` kernels clamp every buffer index into range themselves
            // (see their sources) and their loops are bounded by launch parameters, so
            // the checks the compiler would add can never fire.
            unsafe {
                self.device
                    .create_shader_module_trusted(desc, wgpu::ShaderRuntimeChecks::unchecked())
            }
        } else {
            self.device.create_shader_module(desc)
        };
        let constants: Vec<(&str, f64)> = key
            .overrides
            .iter()
            .map(|&(name, v)| (name, v as f64))
            .collect();
        let layout = &self.layout(s, kernel).1;
        let pipeline = self
            .device
            .create_compute_pipeline(&wgpu::ComputePipelineDescriptor {
                label: Some(kernel.name),
                layout: Some(layout),
                module: &module,
                entry_point: Some("main"),
                compilation_options: wgpu::PipelineCompilationOptions {
                    constants: &constants,
                    zero_initialize_workgroup_memory: false,
                },
                cache: None,
            });
        if let Some(e) = pollster::block_on(scope.pop()) {
            return Err(self.backend_error(format!("kernel {} failed to build: {e}", kernel.name)));
        }
        s.pipelines.insert(key.clone(), pipeline);
        Ok(())
    }

    /// Records one compute dispatch into the stream.
    pub(crate) fn dispatch(&self, s: &mut State, d: Dispatch<'_>) -> Result<()> {
        let key = PipelineKey {
            name: d.kernel.name,
            reprs: d.reprs,
            consts: d.consts,
            overrides: d.overrides,
        };
        self.pipeline(s, &key, d.kernel)?;
        if s.params.len() as u64 + self.arena_stride > self.arena.size() {
            self.flush(s)?;
        }
        let offset = s.params.len() as u32;
        debug_assert_eq!(d.params.len() as u64 * 4, d.kernel.params_size);
        s.params.extend_from_slice(bytemuck::cast_slice(&d.params));
        s.params
            .resize(offset as usize + self.arena_stride as usize, 0);

        let bind_key = BindKey {
            pipeline: key.clone(),
            buffers: d.buffers.iter().map(|(id, _)| *id).collect(),
            ranges: d.ranges.clone(),
        };
        if !s.bind_groups.contains_key(&bind_key) {
            let mut entries = vec![wgpu::BindGroupEntry {
                binding: 0,
                resource: wgpu::BindingResource::Buffer(wgpu::BufferBinding {
                    buffer: &self.arena,
                    offset: 0,
                    size: wgpu::BufferSize::new(d.kernel.params_size),
                }),
            }];
            for (i, (_, b)) in d.buffers.iter().enumerate() {
                let resource = match d.ranges.iter().find(|r| r.0 == i) {
                    Some(&(_, offset, size)) => {
                        wgpu::BindingResource::Buffer(wgpu::BufferBinding {
                            buffer: b,
                            offset,
                            size: wgpu::BufferSize::new(size),
                        })
                    }
                    None => b.as_entire_binding(),
                };
                entries.push(wgpu::BindGroupEntry {
                    binding: i as u32 + 1,
                    resource,
                });
            }
            let layout = &self.layout(s, d.kernel).0;
            let bg = self.device.create_bind_group(&wgpu::BindGroupDescriptor {
                label: Some(d.kernel.file),
                layout,
                entries: &entries,
            });
            s.bind_groups.insert(bind_key.clone(), bg);
        }
        // Take what the pass needs out of `s` before borrowing the encoder mutably.
        let pipeline = s.pipelines[&key].clone();
        let bind_group = s.bind_groups[&bind_key].clone();
        let encoder = self.encoder(s);
        let mut pass = encoder.begin_compute_pass(&wgpu::ComputePassDescriptor {
            label: Some(d.kernel.file),
            timestamp_writes: None,
        });
        pass.set_pipeline(&pipeline);
        pass.set_bind_group(0, &bind_group, &[offset]);
        pass.dispatch_workgroups(d.groups.0, d.groups.1, d.groups.2);
        Ok(())
    }

    pub(crate) fn repr(&self, dtype: DType) -> Repr {
        Repr::of(dtype, self.caps.f16_arithmetic)
    }
}

impl WgpuDevice {
    /// The wgpu buffers behind `buffers`, after checking that each handle is live on
    /// this device and describes the buffer it names (a handle from another device can
    /// carry a valid id with the wrong size, and kernels trust the size).
    pub(crate) fn handles(
        &self,
        s: &State,
        kernel: &str,
        buffers: &[Buffer],
    ) -> Result<HashMap<u64, wgpu::Buffer>> {
        let mut handles = HashMap::new();
        for b in buffers {
            let slot = s.buffers.get(&b.id).ok_or_else(|| self.unknown(b.id))?;
            if slot.meta != *b {
                return Err(Error::InvalidArgument(format!(
                    "{kernel}: handle for buffer #{} says {} x {} but it holds {} x {} (a handle from another device?)",
                    b.id, b.len, b.dtype, slot.meta.len, slot.meta.dtype
                )));
            }
            handles.insert(b.id, slot.buffer.clone());
        }
        Ok(handles)
    }

    /// Byte alignment a partial binding's offset needs.
    pub(crate) fn storage_offset_alignment(&self) -> u64 {
        self.device.limits().min_storage_buffer_offset_alignment as u64
    }

    /// The GEMM partials buffer, at least `bytes` long.
    pub(crate) fn partials(&self, s: &mut State, bytes: u64) -> wgpu::Buffer {
        if let Some(p) = &s.partials {
            if p.size() >= bytes {
                return p.clone();
            }
        }
        // Bind groups of the old buffer would keep it alive and bind the wrong size.
        s.bind_groups
            .retain(|k, _| !k.buffers.contains(&PARTIALS_ID));
        let p = self.device.create_buffer(&wgpu::BufferDescriptor {
            label: Some("kiln matmul partials"),
            size: bytes.max(8),
            usage: wgpu::BufferUsages::STORAGE,
            mapped_at_creation: false,
        });
        s.partials = Some(p.clone());
        p
    }
}

/// Workgroups for a grid-strided walk over `words` items.
pub(crate) fn groups(words: u32) -> u32 {
    words.div_ceil(WORKGROUP).clamp(1, MAX_GROUPS)
}

/// A 2-D grid of at least `rows` workgroups (one per row; 65535 per dimension).
fn row_groups(rows: u32) -> (u32, u32, u32) {
    let x = rows.clamp(1, MAX_GROUPS);
    (x, rows.div_ceil(x).max(1), 1)
}

/// Pairs of elements an elementwise kernel walks.
fn pairs(len: usize) -> u32 {
    len.div_ceil(2) as u32
}

/// The 32-bit word `fill` writes for `value` in `dtype`.
fn fill_pattern(dtype: DType, value: f64) -> u32 {
    match dtype {
        DType::F32 => (value as f32).to_bits(),
        DType::F16 => {
            let h = half::f16::from_f64(value).to_bits() as u32;
            h | (h << 16)
        }
        DType::BF16 => {
            let h = half::bf16::from_f64(value).to_bits() as u32;
            h | (h << 16)
        }
        DType::U32 => value as u32,
    }
}

impl Device for WgpuDevice {
    fn caps(&self) -> &Capabilities {
        &self.caps
    }

    fn alloc(&self, dtype: DType, len: usize) -> Result<Buffer> {
        let bytes = dtype.padded_bytes(len);
        let max = self.caps.max_buffer;
        if bytes > max {
            return Err(Error::OutOfMemory {
                device: self.caps.name.clone(),
                detail: format!(
                    "{len} {dtype} elements need {bytes} bytes, over the adapter's largest buffer of {max} bytes; split the tensor"
                ),
            });
        }
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
                detail: format!("allocating {bytes} bytes: {e}"),
            });
        }
        let mut s = self.lock();
        let id = s.next_id;
        s.next_id += 1;
        let meta = Buffer { id, dtype, len };
        s.buffers.insert(id, Slot { buffer, meta });
        s.allocated += bytes;
        Ok(meta)
    }

    fn free(&self, buf: Buffer) -> Result<()> {
        let mut s = self.lock();
        let slot = s
            .buffers
            .remove(&buf.id)
            .ok_or_else(|| self.unknown(buf.id))?;
        s.allocated -= slot.meta.bytes();
        s.bind_groups.retain(|k, _| !k.buffers.contains(&buf.id));
        // Launches already recorded keep their own reference; wgpu frees it after them.
        drop(slot);
        Ok(())
    }

    fn upload(&self, buf: Buffer, data: &HostData) -> Result<()> {
        check_upload(buf, data)?;
        let mut s = self.lock();
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
                    0,
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
                .copy_buffer_to_buffer(&staging, 0, &target, 0, padded);
        }
        Ok(())
    }

    fn download(&self, buf: Buffer) -> Result<HostData> {
        let mut s = self.lock();
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
            .copy_buffer_to_buffer(&src, 0, &readback, 0, padded);
        self.flush(&mut s)?;
        drop(s);
        let slice = readback.slice(..);
        let (tx, rx) = std::sync::mpsc::channel();
        slice.map_async(wgpu::MapMode::Read, move |r| {
            let _ = tx.send(r);
        });
        self.device
            .poll(wgpu::PollType::wait_indefinitely())
            .map_err(|e| self.backend_error(format!("waiting for a download: {e}")))?;
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
    }

    fn launch(&self, kernel: &Kernel) -> Result<()> {
        kernel.validate()?;
        let mut s = self.lock();
        // Clone the handles (cheap, reference-counted) so `s` stays free to mutate.
        let handles = self.handles(&s, kernel.name(), &kernel.buffers())?;
        let h = |b: &Buffer| (b.id, &handles[&b.id]);
        match kernel {
            Kernel::Fill { dst, value } => {
                let words = (dst.bytes() / 4) as u32;
                self.dispatch(
                    &mut s,
                    Dispatch::new(
                        &shader::FILL,
                        vec![],
                        vec![h(dst)],
                        vec![dst.len as u32, words, 0, fill_pattern(dst.dtype, *value)],
                        (groups(words), 1, 1),
                    ),
                )?;
            }
            Kernel::Copy { src, dst } => {
                let (a, b) = (handles[&src.id].clone(), handles[&dst.id].clone());
                self.encoder(&mut s)
                    .copy_buffer_to_buffer(&a, 0, &b, 0, src.bytes());
            }
            Kernel::Cast { src, dst } => self.elementwise(
                &mut s,
                &shader::CAST,
                None,
                &[(src, &handles), (dst, &handles)],
                0.0,
            )?,
            Kernel::Binary { op, a, b, out } => {
                let code = match op {
                    BinaryOp::Add => 0,
                    BinaryOp::Mul => 1,
                };
                self.elementwise(
                    &mut s,
                    &shader::BINARY,
                    Some(("OP", code)),
                    &[(a, &handles), (b, &handles), (out, &handles)],
                    0.0,
                )?
            }
            Kernel::Scale { alpha, x, out } => self.elementwise(
                &mut s,
                &shader::SCALE,
                None,
                &[(x, &handles), (out, &handles)],
                *alpha,
            )?,
            Kernel::Axpy { alpha, x, y } => self.elementwise(
                &mut s,
                &shader::AXPY,
                None,
                &[(x, &handles), (y, &handles)],
                *alpha,
            )?,
            Kernel::Reduce { op, src, dst } => {
                let code = match op {
                    ReduceOp::Sum | ReduceOp::SumSquares => 0,
                    ReduceOp::Max => 1,
                };
                let square = (*op == ReduceOp::SumSquares) as u32;
                // Pass 1: data -> one partial per workgroup; pass 2: partials -> dst.
                let words = pairs(src.len);
                let g = groups(words).min(REDUCE_GROUPS);
                self.dispatch(
                    &mut s,
                    Dispatch::new(
                        &shader::REDUCE,
                        vec![self.repr(src.dtype)],
                        vec![h(src), (SCRATCH_ID, &self.scratch)],
                        vec![src.len as u32, words, 0, 0],
                        (g, 1, 1),
                    )
                    .with_overrides(vec![("OP", code), ("SQUARE", square)]),
                )?;
                self.dispatch(
                    &mut s,
                    Dispatch::new(
                        &shader::REDUCE,
                        vec![Repr::F32],
                        vec![(SCRATCH_ID, &self.scratch), h(dst)],
                        vec![g, pairs(g as usize), 0, 0],
                        (1, 1, 1),
                    )
                    .with_overrides(vec![("OP", code)]),
                )?;
            }
            Kernel::Matmul(mm) => {
                let plan = crate::matmul::plan(mm, &self.caps, None)?;
                self.matmul(&mut s, mm, &plan, &handles)?;
            }
            Kernel::Gelu { x, out } => self.elementwise(
                &mut s,
                &shader::GELU_FORWARD,
                None,
                &[(x, &handles), (out, &handles)],
                0.0,
            )?,
            Kernel::GeluBackward { x, dout, dx } => self.elementwise(
                &mut s,
                &shader::GELU_BACKWARD,
                None,
                &[(x, &handles), (dout, &handles), (dx, &handles)],
                0.0,
            )?,
            Kernel::LayerNorm {
                x,
                weight,
                bias,
                out,
                mean,
                rstd,
                cols,
                eps,
            } => {
                let (n, cols) = (x.len as u32, *cols as u32);
                let rows = n / cols;
                // Pass 1: one workgroup per row -> mean, rstd. Pass 2: pairs of elements.
                self.dispatch(
                    &mut s,
                    Dispatch::new(
                        &shader::LAYERNORM_STATS,
                        vec![self.repr(x.dtype)],
                        vec![h(x), h(mean), h(rstd)],
                        vec![rows, 0, eps.to_bits(), cols],
                        row_groups(rows),
                    ),
                )?;
                let words = pairs(x.len);
                self.dispatch(
                    &mut s,
                    Dispatch::new(
                        &shader::LAYERNORM_APPLY,
                        [x, weight, bias, out]
                            .iter()
                            .map(|b| self.repr(b.dtype))
                            .collect(),
                        vec![h(x), h(weight), h(bias), h(out), h(mean), h(rstd)],
                        vec![n, words, 0, cols],
                        (groups(words), 1, 1),
                    ),
                )?;
            }
            Kernel::LayerNormBackward {
                x,
                weight,
                mean,
                rstd,
                dout,
                dx,
                dweight,
                dbias,
                cols,
            } => {
                let (n, cols) = (x.len as u32, *cols as u32);
                let rows = n / cols;
                let stats = self.partials(&mut s, rows as u64 * 8);
                let st = (PARTIALS_ID, &stats);
                self.dispatch(
                    &mut s,
                    Dispatch::new(
                        &shader::LAYERNORM_BACKWARD_STATS,
                        [x, weight, dout]
                            .iter()
                            .map(|b| self.repr(b.dtype))
                            .collect(),
                        vec![h(x), h(weight), h(dout), h(mean), h(rstd), st],
                        vec![rows, 0, 0, cols],
                        row_groups(rows),
                    ),
                )?;
                let words = pairs(x.len);
                self.dispatch(
                    &mut s,
                    Dispatch::new(
                        &shader::LAYERNORM_BACKWARD_DX,
                        [x, weight, dout, dx]
                            .iter()
                            .map(|b| self.repr(b.dtype))
                            .collect(),
                        vec![h(x), h(weight), h(dout), h(dx), h(mean), h(rstd), st],
                        vec![n, words, 0, cols],
                        (groups(words), 1, 1),
                    ),
                )?;
                self.dispatch(
                    &mut s,
                    Dispatch::new(
                        &shader::LAYERNORM_BACKWARD_PARAMS,
                        [x, dout].iter().map(|b| self.repr(b.dtype)).collect(),
                        vec![h(x), h(dout), h(mean), h(rstd), h(dweight), h(dbias)],
                        vec![rows, 0, 0, cols],
                        (groups(cols), 1, 1),
                    ),
                )?;
            }
            Kernel::SplitHeads {
                src,
                dst,
                seq,
                heads,
                width,
                offset,
            }
            | Kernel::MergeHeads {
                src,
                dst,
                seq,
                heads,
                width,
                offset,
            } => {
                let split = matches!(kernel, Kernel::SplitHeads { .. });
                let (rows_buf, heads_buf) = if split { (src, dst) } else { (dst, src) };
                let rows = rows_buf.len / width;
                if rows > 0 && heads_buf.len > 0 {
                    let dim = heads_buf.len / (rows * heads);
                    let words = if split {
                        pairs(dst.len)
                    } else {
                        (rows * heads * dim / 2) as u32
                    };
                    self.dispatch(
                        &mut s,
                        Dispatch::new(
                            if split {
                                &shader::SPLIT_HEADS
                            } else {
                                &shader::MERGE_HEADS
                            },
                            vec![self.repr(src.dtype), self.repr(dst.dtype)],
                            vec![h(src), h(dst)],
                            [
                                heads_buf.len,
                                words as usize,
                                *seq,
                                *heads,
                                *width,
                                *offset,
                                dim,
                                0,
                            ]
                            .map(|v| v as u32)
                            .to_vec(),
                            (groups(words), 1, 1),
                        ),
                    )?;
                }
            }
            Kernel::Softmax {
                x,
                out,
                stats,
                cols,
                scale,
                causal,
            } => {
                let (n, cols) = (x.len as u32, *cols as u32);
                let mask = vec![("CAUSAL", *causal as u32)];
                self.dispatch(
                    &mut s,
                    Dispatch::new(
                        &shader::SOFTMAX_STATS,
                        vec![self.repr(x.dtype)],
                        vec![h(x), h(stats)],
                        vec![n / cols, 0, scale.to_bits(), cols],
                        row_groups(n / cols),
                    )
                    .with_overrides(mask.clone()),
                )?;
                let words = pairs(x.len);
                self.dispatch(
                    &mut s,
                    Dispatch::new(
                        &shader::SOFTMAX_APPLY,
                        vec![self.repr(x.dtype), self.repr(out.dtype)],
                        vec![h(x), h(out), h(stats)],
                        vec![n, words, scale.to_bits(), cols],
                        (groups(words), 1, 1),
                    )
                    .with_overrides(mask),
                )?;
            }
            Kernel::SoftmaxBackward {
                p,
                dout,
                dx,
                stats,
                cols,
                scale,
            } => {
                let (n, cols) = (p.len as u32, *cols as u32);
                self.dispatch(
                    &mut s,
                    Dispatch::new(
                        &shader::SOFTMAX_BACKWARD_STATS,
                        vec![self.repr(p.dtype), self.repr(dout.dtype)],
                        vec![h(p), h(dout), h(stats)],
                        vec![n / cols, 0, 0, cols],
                        row_groups(n / cols),
                    ),
                )?;
                let words = pairs(p.len);
                self.dispatch(
                    &mut s,
                    Dispatch::new(
                        &shader::SOFTMAX_BACKWARD_DX,
                        [p, dout, dx].iter().map(|b| self.repr(b.dtype)).collect(),
                        vec![h(p), h(dout), h(dx), h(stats)],
                        vec![n, words, scale.to_bits(), cols],
                        (groups(words), 1, 1),
                    ),
                )?;
            }
            Kernel::CrossEntropy {
                logits,
                targets,
                losses,
                lse,
                vocab,
            } => {
                let rows = (logits.len / vocab) as u32;
                self.dispatch(
                    &mut s,
                    Dispatch::new(
                        &shader::CROSS_ENTROPY,
                        vec![self.repr(logits.dtype)],
                        vec![h(logits), h(targets), h(losses), h(lse)],
                        vec![rows, 0, 0, *vocab as u32],
                        row_groups(rows),
                    ),
                )?;
            }
            Kernel::CrossEntropyBackward {
                logits,
                targets,
                lse,
                dlogits,
                vocab,
                scale,
            } => {
                let words = pairs(logits.len);
                self.dispatch(
                    &mut s,
                    Dispatch::new(
                        &shader::CROSS_ENTROPY_BACKWARD,
                        vec![self.repr(logits.dtype), self.repr(dlogits.dtype)],
                        vec![h(logits), h(dlogits), h(targets), h(lse)],
                        vec![logits.len as u32, words, scale.to_bits(), *vocab as u32],
                        (groups(words), 1, 1),
                    ),
                )?;
            }
            Kernel::Embedding {
                tokens,
                table,
                out,
                dim,
            } => {
                if out.len > 0 {
                    let words = pairs(out.len);
                    let rows = (table.len / dim) as u32;
                    self.dispatch(
                        &mut s,
                        Dispatch::new(
                            &shader::EMBEDDING,
                            vec![self.repr(table.dtype), self.repr(out.dtype)],
                            vec![h(table), h(out), h(tokens)],
                            vec![out.len as u32, words, rows, *dim as u32],
                            (groups(words), 1, 1),
                        ),
                    )?;
                }
            }
            Kernel::EmbeddingBackward {
                tokens,
                dout,
                dtable,
                dim,
            } => {
                let rows = (dtable.len / dim) as u32;
                self.dispatch(
                    &mut s,
                    Dispatch::new(
                        &shader::EMBEDDING_BACKWARD,
                        vec![self.repr(dout.dtype)],
                        vec![h(dout), h(tokens), h(dtable)],
                        vec![tokens.len as u32, 0, rows, *dim as u32],
                        (groups(*dim as u32), 1, 1),
                    ),
                )?;
            }
            Kernel::GradScale {
                sum_squares,
                out,
                loss_scale,
                clip,
            } => {
                self.dispatch(
                    &mut s,
                    Dispatch::new(
                        &shader::GRAD_SCALE,
                        vec![],
                        vec![h(sum_squares), h(out)],
                        vec![1, 1, loss_scale.to_bits(), clip.to_bits()],
                        (1, 1, 1),
                    ),
                )?;
            }
            Kernel::Adam(a) => {
                let (bias1, bias2) = a.bias_corrections();
                let optional = a.params.map_or((SCRATCH_ID, &self.scratch), |p| h(&p));
                self.optimizer(
                    &mut s,
                    &shader::ADAM,
                    vec![
                        h(&a.master),
                        h(&a.grads),
                        h(&a.m),
                        h(&a.v),
                        optional,
                        h(&a.grad_scale),
                    ],
                    vec![a.master, a.grads, a.m, a.v, a.params.unwrap_or(a.master)],
                    vec![
                        ("DECOUPLED", a.decoupled as u32),
                        ("WRITE_PARAMS", a.params.is_some() as u32),
                    ],
                    [
                        a.lr,
                        a.beta1,
                        a.beta2,
                        a.eps,
                        a.weight_decay,
                        bias1,
                        bias2,
                        0.0,
                    ],
                )?;
            }
            Kernel::Sgd(step) => {
                let optional = step.params.map_or((SCRATCH_ID, &self.scratch), |p| h(&p));
                self.optimizer(
                    &mut s,
                    &shader::SGD,
                    vec![
                        h(&step.master),
                        h(&step.grads),
                        h(&step.momentum_buf),
                        optional,
                        h(&step.grad_scale),
                    ],
                    vec![
                        step.master,
                        step.grads,
                        step.momentum_buf,
                        step.params.unwrap_or(step.master),
                    ],
                    vec![("WRITE_PARAMS", step.params.is_some() as u32)],
                    [
                        step.lr,
                        0.0,
                        0.0,
                        0.0,
                        step.weight_decay,
                        1.0,
                        1.0,
                        step.momentum,
                    ],
                )?;
            }
            Kernel::NonFinite { srcs, flag } => {
                let f = handles[&flag.id].clone();
                self.encoder(&mut s).clear_buffer(&f, 0, None);
                for src in srcs {
                    let (kind, words) = match src.dtype {
                        DType::F32 => (0, (src.bytes() / 4) as u32),
                        DType::F16 => (1, pairs(src.len)),
                        _ => (2, pairs(src.len)),
                    };
                    if src.len == 0 {
                        continue;
                    }
                    self.dispatch(
                        &mut s,
                        Dispatch::new(
                            &shader::NONFINITE,
                            vec![],
                            vec![h(src), h(flag)],
                            vec![src.len as u32, words, 0, 0],
                            (groups(words), 1, 1),
                        )
                        .with_overrides(vec![("KIND", kind)]),
                    )?;
                }
            }
        }
        Ok(())
    }

    fn submit(&self) -> Result<()> {
        let mut s = self.lock();
        self.flush(&mut s)
    }

    fn wait(&self) -> Result<()> {
        self.device
            .poll(wgpu::PollType::wait_indefinitely())
            .map_err(|e| self.backend_error(format!("waiting for the device: {e}")))?;
        self.check_errors()
    }

    fn allocated_bytes(&self) -> u64 {
        self.lock().allocated
    }
}

impl WgpuDevice {
    /// An optimizer step: `typed` gives the dtypes of the typed slots (an absent
    /// optional slot repeats the master, f32, and is never written); `values` are
    /// lr, beta1, beta2, eps, weight_decay, bias1, bias2, momentum.
    fn optimizer(
        &self,
        s: &mut State,
        kernel: &'static KernelSource,
        buffers: Vec<(u64, &wgpu::Buffer)>,
        typed: Vec<Buffer>,
        overrides: Vec<(&'static str, u32)>,
        values: [f32; 8],
    ) -> Result<()> {
        let n = typed[0].len;
        if n == 0 {
            return Ok(());
        }
        let words = pairs(n);
        let mut params = vec![n as u32, words];
        params.extend(values.iter().map(|v| v.to_bits()));
        params.extend([0, 0]);
        self.dispatch(
            s,
            Dispatch {
                kernel,
                reprs: typed.iter().map(|b| self.repr(b.dtype)).collect(),
                consts: vec![],
                overrides,
                buffers,
                ranges: vec![],
                params,
                groups: (groups(words), 1, 1),
            },
        )
    }

    /// An elementwise kernel over typed slots that all have the first slot's length.
    fn elementwise(
        &self,
        s: &mut State,
        kernel: &'static KernelSource,
        constant: Option<(&'static str, u32)>,
        slots: &[(&Buffer, &HashMap<u64, wgpu::Buffer>)],
        alpha: f32,
    ) -> Result<()> {
        let len = slots[0].0.len;
        if len == 0 {
            return Ok(());
        }
        let words = pairs(len);
        self.dispatch(
            s,
            Dispatch {
                kernel,
                reprs: slots.iter().map(|(b, _)| self.repr(b.dtype)).collect(),
                consts: vec![],
                overrides: constant.into_iter().collect(),
                buffers: slots.iter().map(|(b, h)| (b.id, &h[&b.id])).collect(),
                ranges: vec![],
                params: vec![len as u32, words, alpha.to_bits(), 0],
                groups: (groups(words), 1, 1),
            },
        )
    }
}
