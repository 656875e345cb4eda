//! The hand-written SPIR-V GEMM (`shaders/vulkan/matmul_cpu.comp`, compiled by
//! `shaders/vulkan/build.sh` into the committed `spv/` modules) run through wgpu's
//! SPIR-V passthrough on a Vulkan adapter: the same kernel under the same host API as
//! the WGSL one, so the two compare kernel against kernel (`kiln bench matmul
//! --spirv`), and its numerics are checked against a reference (tests/spirv.rs).
//!
//! A device of its own: the passthrough feature is asked for here only, and nothing
//! else in the backend depends on it.

use std::collections::HashMap;
use std::sync::Mutex;

use kiln_engine::{DType, Error, HostData, Result};

use crate::adapter::{backend_name, raw_adapters};

/// Lanes per workgroup, as the shader has them (one subgroup of a CPU-class driver).
const SG: u32 = 8;

/// The tile shapes the committed modules were compiled with (the shader's
/// specialization defaults: wgpu's passthrough cannot specialize, so each shape is a
/// module of its own).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum SpirvTile {
    /// 16 rows x 2 vec4 column groups per lane (16 x 64 outputs per workgroup).
    Small,
    /// 64 rows x 4 vec4 column groups per lane (64 x 128 per workgroup): fewer loads
    /// per product, a longer compile.
    Large,
}

impl SpirvTile {
    /// (rows, vec4 column groups per lane).
    fn shape(self) -> (u32, u32) {
        match self {
            SpirvTile::Small => (16, 2),
            SpirvTile::Large => (64, 4),
        }
    }

    /// The GEMM planner's rule for the WGSL kernel (`plan_matmul`): the large block
    /// only where the product repays its compile (about 2^30 multiply-adds).
    pub fn for_shape(batch: usize, m: usize, n: usize, k: usize) -> SpirvTile {
        let work = batch as u64 * m as u64 * n as u64 * k as u64;
        if m >= 64 && n >= 128 && work >= 1 << 30 {
            SpirvTile::Large
        } else {
            SpirvTile::Small
        }
    }

    /// The name `kiln bench matmul` shows, in the WGSL kernels' terms (rows x columns
    /// per lane).
    pub fn name(self) -> String {
        let (tm, nv) = self.shape();
        format!("spirv cpu{tm}x{}", 4 * nv)
    }
}

/// (tile, storage, A transposed, B transposed, B read as vec4s).
type ModuleKey = (SpirvTile, DType, bool, bool, bool);

/// The committed modules (`shaders/vulkan/build.sh` lists the same).
const MODULES: [(ModuleKey, &[u8]); 24] = [
    (
        (SpirvTile::Small, DType::F32, false, false, false),
        include_bytes!("../../../shaders/vulkan/spv/matmul_cpu_16x2_f32_nn.spv"),
    ),
    (
        (SpirvTile::Small, DType::F32, false, false, true),
        include_bytes!("../../../shaders/vulkan/spv/matmul_cpu_16x2_f32_nn_vec.spv"),
    ),
    (
        (SpirvTile::Small, DType::F32, false, true, false),
        include_bytes!("../../../shaders/vulkan/spv/matmul_cpu_16x2_f32_nt.spv"),
    ),
    (
        (SpirvTile::Small, DType::F32, true, false, false),
        include_bytes!("../../../shaders/vulkan/spv/matmul_cpu_16x2_f32_tn.spv"),
    ),
    (
        (SpirvTile::Small, DType::F32, true, false, true),
        include_bytes!("../../../shaders/vulkan/spv/matmul_cpu_16x2_f32_tn_vec.spv"),
    ),
    (
        (SpirvTile::Small, DType::F32, true, true, false),
        include_bytes!("../../../shaders/vulkan/spv/matmul_cpu_16x2_f32_tt.spv"),
    ),
    (
        (SpirvTile::Small, DType::F16, false, false, false),
        include_bytes!("../../../shaders/vulkan/spv/matmul_cpu_16x2_f16_nn.spv"),
    ),
    (
        (SpirvTile::Small, DType::F16, false, false, true),
        include_bytes!("../../../shaders/vulkan/spv/matmul_cpu_16x2_f16_nn_vec.spv"),
    ),
    (
        (SpirvTile::Small, DType::F16, false, true, false),
        include_bytes!("../../../shaders/vulkan/spv/matmul_cpu_16x2_f16_nt.spv"),
    ),
    (
        (SpirvTile::Small, DType::F16, true, false, false),
        include_bytes!("../../../shaders/vulkan/spv/matmul_cpu_16x2_f16_tn.spv"),
    ),
    (
        (SpirvTile::Small, DType::F16, true, false, true),
        include_bytes!("../../../shaders/vulkan/spv/matmul_cpu_16x2_f16_tn_vec.spv"),
    ),
    (
        (SpirvTile::Small, DType::F16, true, true, false),
        include_bytes!("../../../shaders/vulkan/spv/matmul_cpu_16x2_f16_tt.spv"),
    ),
    (
        (SpirvTile::Large, DType::F32, false, false, false),
        include_bytes!("../../../shaders/vulkan/spv/matmul_cpu_64x4_f32_nn.spv"),
    ),
    (
        (SpirvTile::Large, DType::F32, false, false, true),
        include_bytes!("../../../shaders/vulkan/spv/matmul_cpu_64x4_f32_nn_vec.spv"),
    ),
    (
        (SpirvTile::Large, DType::F32, false, true, false),
        include_bytes!("../../../shaders/vulkan/spv/matmul_cpu_64x4_f32_nt.spv"),
    ),
    (
        (SpirvTile::Large, DType::F32, true, false, false),
        include_bytes!("../../../shaders/vulkan/spv/matmul_cpu_64x4_f32_tn.spv"),
    ),
    (
        (SpirvTile::Large, DType::F32, true, false, true),
        include_bytes!("../../../shaders/vulkan/spv/matmul_cpu_64x4_f32_tn_vec.spv"),
    ),
    (
        (SpirvTile::Large, DType::F32, true, true, false),
        include_bytes!("../../../shaders/vulkan/spv/matmul_cpu_64x4_f32_tt.spv"),
    ),
    (
        (SpirvTile::Large, DType::F16, false, false, false),
        include_bytes!("../../../shaders/vulkan/spv/matmul_cpu_64x4_f16_nn.spv"),
    ),
    (
        (SpirvTile::Large, DType::F16, false, false, true),
        include_bytes!("../../../shaders/vulkan/spv/matmul_cpu_64x4_f16_nn_vec.spv"),
    ),
    (
        (SpirvTile::Large, DType::F16, false, true, false),
        include_bytes!("../../../shaders/vulkan/spv/matmul_cpu_64x4_f16_nt.spv"),
    ),
    (
        (SpirvTile::Large, DType::F16, true, false, false),
        include_bytes!("../../../shaders/vulkan/spv/matmul_cpu_64x4_f16_tn.spv"),
    ),
    (
        (SpirvTile::Large, DType::F16, true, false, true),
        include_bytes!("../../../shaders/vulkan/spv/matmul_cpu_64x4_f16_tn_vec.spv"),
    ),
    (
        (SpirvTile::Large, DType::F16, true, true, false),
        include_bytes!("../../../shaders/vulkan/spv/matmul_cpu_64x4_f16_tt.spv"),
    ),
];

/// A batch of products `C = alpha * op(A) op(B) + beta * C`, every matrix contiguous
/// and row-major as stored (A is M x K, or K x M when `trans_a`; B is K x N, or N x K).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct SpirvGemm {
    pub batch: usize,
    pub m: usize,
    pub n: usize,
    pub k: usize,
    pub trans_a: bool,
    pub trans_b: bool,
    pub alpha: f32,
    pub beta: f32,
    pub tile: SpirvTile,
}

impl SpirvGemm {
    fn lens(&self) -> [usize; 3] {
        [
            self.batch * self.m * self.k,
            self.batch * self.k * self.n,
            self.batch * self.m * self.n,
        ]
    }

    /// The shader's parameter block (see `Params` in the source).
    fn params(&self) -> [u32; 12] {
        let (m, n, k) = (self.m as u32, self.n as u32, self.k as u32);
        // Contiguous B: ldb = N and stride_b = K * N, so N % 4 == 0 aligns both.
        let vec_b = !self.trans_b && n.is_multiple_of(4);
        [
            m,
            n,
            k,
            if self.trans_a { m } else { k },
            if self.trans_b { k } else { n },
            n,
            m * k,
            k * n,
            m * n,
            self.alpha.to_bits(),
            self.beta.to_bits(),
            vec_b as u32,
        ]
    }

    fn groups(&self) -> Result<(u32, u32, u32)> {
        let (tm, nv) = self.tile.shape();
        let x = (self.n as u64).div_ceil((SG * 4 * nv) as u64);
        let y = (self.m as u64).div_ceil(tm as u64);
        let z = self.batch as u64;
        if x > 65535 || y > 65535 || z > 65535 {
            return Err(Error::InvalidArgument(format!(
                "SPIR-V GEMM: {}x{}x{} (batch {}) needs {x} x {y} x {z} workgroups; one \
                 dispatch allows 65535 per dimension",
                self.m, self.n, self.k, self.batch
            )));
        }
        Ok((x as u32, y as u32, z as u32))
    }

    /// 2·M·N·K per matrix.
    pub fn flops(&self) -> f64 {
        2.0 * self.batch as f64 * self.m as f64 * self.n as f64 * self.k as f64
    }
}

/// The SPIR-V GEMM's own device on a Vulkan adapter.
pub struct SpirvMatmul {
    device: wgpu::Device,
    queue: wgpu::Queue,
    name: String,
    layout: wgpu::BindGroupLayout,
    pipeline_layout: wgpu::PipelineLayout,
    f16: bool,
    /// Built on first use: a driver compiles each one, the large tiles slowly.
    pipelines: Mutex<HashMap<ModuleKey, wgpu::ComputePipeline>>,
}

impl SpirvMatmul {
    /// Opens adapter `index` (see `kiln devices`), which must be a Vulkan one whose
    /// subgroups hold the kernel's 8 lanes; the f16 modules need shaderFloat16 and
    /// 16-bit storage (without them only f32 runs, and f16 is refused by name).
    pub fn open(index: usize) -> Result<SpirvMatmul> {
        let adapter = raw_adapters().get(index).ok_or_else(|| {
            Error::InvalidArgument(format!(
                "SPIR-V GEMM: no adapter {index} ({} found; see `kiln devices`)",
                raw_adapters().len()
            ))
        })?;
        let info = adapter.get_info();
        let backend = backend_name(info.backend);
        if info.backend != wgpu::Backend::Vulkan {
            return Err(Error::InvalidArgument(format!(
                "SPIR-V GEMM: adapter {index} ({}) runs on {backend}; SPIR-V runs on a \
                 Vulkan adapter (`kiln devices` lists them)",
                info.name
            )));
        }
        let has = adapter.features();
        let missing = |what: &str| Error::Unsupported {
            device: info.name.clone(),
            what: what.into(),
        };
        if !has.contains(wgpu::Features::PASSTHROUGH_SHADERS) {
            return Err(missing(
                "SPIR-V passthrough shaders (wgpu's PASSTHROUGH_SHADERS)",
            ));
        }
        if !has.contains(wgpu::Features::SUBGROUP) || info.subgroup_max_size < SG {
            return Err(missing(&format!(
                "subgroups of at least {SG} lanes (the GEMM shares A values by shuffles)"
            )));
        }
        let mut features = wgpu::Features::PASSTHROUGH_SHADERS | wgpu::Features::SUBGROUP;
        let f16 = has.contains(wgpu::Features::SHADER_F16);
        if f16 {
            features |= wgpu::Features::SHADER_F16;
        }
        let (device, queue) = pollster::block_on(adapter.request_device(&wgpu::DeviceDescriptor {
            label: Some("kiln spirv"),
            required_features: features,
            required_limits: adapter.limits(),
            ..Default::default()
        }))
        .map_err(|e| Error::Backend {
            device: info.name.clone(),
            detail: format!("could not open a device: {e}"),
        })?;
        let storage = |binding: u32, read_only: bool| wgpu::BindGroupLayoutEntry {
            binding,
            visibility: wgpu::ShaderStages::COMPUTE,
            ty: wgpu::BindingType::Buffer {
                ty: wgpu::BufferBindingType::Storage { read_only },
                has_dynamic_offset: false,
                min_binding_size: None,
            },
            count: None,
        };
        let layout = device.create_bind_group_layout(&wgpu::BindGroupLayoutDescriptor {
            label: Some("kiln spirv gemm"),
            entries: &[
                storage(0, true),
                storage(1, true),
                storage(2, false),
                wgpu::BindGroupLayoutEntry {
                    binding: 3,
                    visibility: wgpu::ShaderStages::COMPUTE,
                    ty: wgpu::BindingType::Buffer {
                        ty: wgpu::BufferBindingType::Uniform,
                        has_dynamic_offset: false,
                        min_binding_size: None,
                    },
                    count: None,
                },
            ],
        });
        let pipeline_layout = device.create_pipeline_layout(&wgpu::PipelineLayoutDescriptor {
            label: Some("kiln spirv gemm"),
            bind_group_layouts: &[Some(&layout)],
            immediate_size: 0,
        });
        Ok(SpirvMatmul {
            device,
            queue,
            name: info.name.clone(),
            layout,
            pipeline_layout,
            f16,
            pipelines: Mutex::new(HashMap::new()),
        })
    }

    /// The adapter's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    fn pipeline(&self, dtype: DType, g: &SpirvGemm) -> Result<wgpu::ComputePipeline> {
        match dtype {
            DType::F32 => {}
            DType::F16 if self.f16 => {}
            DType::F16 => {
                return Err(Error::Unsupported {
                    device: self.name.clone(),
                    what: "shaderFloat16 with 16-bit storage, which the f16 SPIR-V GEMM needs"
                        .into(),
                })
            }
            other => {
                return Err(Error::InvalidArgument(format!(
                    "SPIR-V GEMM: stores f32 or f16, not {other:?}"
                )))
            }
        }
        // Contiguous B as stored: ldb = N and stride_b = K * N, aligned when N is.
        let vec_b = !g.trans_b && g.n.is_multiple_of(4);
        let key = (g.tile, dtype, g.trans_a, g.trans_b, vec_b);
        let mut built = self.pipelines.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(p) = built.get(&key) {
            return Ok(p.clone());
        }
        let bytes = MODULES
            .iter()
            .find(|(k, _)| *k == key)
            .map(|(_, b)| *b)
            .ok_or_else(|| Error::InvalidArgument(format!("SPIR-V GEMM: no module {key:?}")))?;
        let words: Vec<u32> = bytes
            .chunks_exact(4)
            .map(|w| u32::from_le_bytes([w[0], w[1], w[2], w[3]]))
            .collect();
        // SAFETY: the modules are the committed output of glslangValidator for
        // shaders/vulkan/matmul_cpu.comp, checked by spirv-val and kept in sync with
        // the source by tests/spirv.rs; their bindings are `self.layout`, and every
        // load index is clamped into the buffers a launch binds.
        let module = unsafe {
            self.device
                .create_shader_module_passthrough(wgpu::ShaderModuleDescriptorPassthrough {
                    label: Some("matmul_cpu.comp"),
                    entry_points: std::borrow::Cow::Owned(vec![
                        wgpu::PassthroughShaderEntryPoint {
                            name: "main".into(),
                            workgroup_size: (SG, 1, 1),
                        },
                    ]),
                    spirv: Some(std::borrow::Cow::Owned(words)),
                    ..Default::default()
                })
        };
        let pipeline = crate::device::caught(&self.device, || {
            self.device
                .create_compute_pipeline(&wgpu::ComputePipelineDescriptor {
                    label: Some("matmul_cpu.comp"),
                    layout: Some(&self.pipeline_layout),
                    module: &module,
                    entry_point: Some("main"),
                    compilation_options: Default::default(),
                    cache: None,
                })
        })
        .map_err(|e| Error::Backend {
            device: self.name.clone(),
            detail: format!("the SPIR-V GEMM {key:?} failed to build: {e}"),
        })?;
        built.insert(key, pipeline.clone());
        Ok(pipeline)
    }

    fn buffer(&self, bytes: u64, usage: wgpu::BufferUsages) -> wgpu::Buffer {
        self.device.create_buffer(&wgpu::BufferDescriptor {
            label: Some("kiln spirv gemm"),
            // Bindings of zero bytes are invalid; M, N or K of 0 still binds a word.
            size: bytes.max(4).next_multiple_of(4),
            usage,
            mapped_at_creation: false,
        })
    }

    /// Operand buffers and the bind group of one product.
    fn bind(&self, g: &SpirvGemm, dtype: DType) -> (wgpu::BindGroup, [wgpu::Buffer; 3]) {
        let storage = wgpu::BufferUsages::STORAGE
            | wgpu::BufferUsages::COPY_DST
            | wgpu::BufferUsages::COPY_SRC;
        let lens = g.lens();
        let bufs = lens.map(|n| self.buffer(dtype.padded_bytes(n), storage));
        let params = self.buffer(
            48,
            wgpu::BufferUsages::UNIFORM | wgpu::BufferUsages::COPY_DST,
        );
        let p = g.params();
        self.queue
            .write_buffer(&params, 0, bytemuck::cast_slice(&p));
        fn entry(binding: u32, b: &wgpu::Buffer) -> wgpu::BindGroupEntry<'_> {
            wgpu::BindGroupEntry {
                binding,
                resource: b.as_entire_binding(),
            }
        }
        let group = self.device.create_bind_group(&wgpu::BindGroupDescriptor {
            label: Some("kiln spirv gemm"),
            layout: &self.layout,
            entries: &[
                entry(0, &bufs[0]),
                entry(1, &bufs[1]),
                entry(2, &bufs[2]),
                entry(3, &params),
            ],
        });
        (group, bufs)
    }

    fn dispatch(
        &self,
        pipeline: &wgpu::ComputePipeline,
        group: &wgpu::BindGroup,
        groups: (u32, u32, u32),
    ) {
        let mut encoder = self
            .device
            .create_command_encoder(&wgpu::CommandEncoderDescriptor::default());
        {
            let mut pass = encoder.begin_compute_pass(&wgpu::ComputePassDescriptor::default());
            pass.set_pipeline(pipeline);
            pass.set_bind_group(0, group, &[]);
            pass.dispatch_workgroups(groups.0, groups.1, groups.2);
        }
        self.queue.submit([encoder.finish()]);
    }

    fn wait(&self) -> Result<()> {
        self.device
            .poll(wgpu::PollType::wait_indefinitely())
            .map(drop)
            .map_err(|e| Error::Backend {
                device: self.name.clone(),
                detail: format!("waiting for the device: {e}"),
            })
    }

    /// Runs one product on `a`, `b` and the old `c` (all of one storage dtype, f32 or
    /// f16) and returns the new C.
    pub fn run(&self, g: &SpirvGemm, a: &HostData, b: &HostData, c: &HostData) -> Result<HostData> {
        let dtype = a.dtype();
        for (what, h, len) in [
            ("A", a, g.lens()[0]),
            ("B", b, g.lens()[1]),
            ("C", c, g.lens()[2]),
        ] {
            if h.dtype() != dtype || h.len() != len {
                return Err(Error::InvalidArgument(format!(
                    "SPIR-V GEMM: {what} holds {} {:?} values; this product needs {len} {dtype:?}",
                    h.len(),
                    h.dtype()
                )));
            }
        }
        let pipeline = &self.pipeline(dtype, g)?;
        let groups = g.groups()?;
        let (group, bufs) = self.bind(g, dtype);
        for (buf, h) in bufs.iter().zip([a, b, c]) {
            let mut bytes = h.as_bytes().to_vec();
            bytes.resize(bytes.len().next_multiple_of(4), 0);
            self.queue.write_buffer(buf, 0, &bytes);
        }
        if g.m > 0 && g.n > 0 && g.batch > 0 {
            self.dispatch(pipeline, &group, groups);
        }
        let size = bufs[2].size();
        let staging = self.buffer(
            size,
            wgpu::BufferUsages::MAP_READ | wgpu::BufferUsages::COPY_DST,
        );
        let mut encoder = self
            .device
            .create_command_encoder(&wgpu::CommandEncoderDescriptor::default());
        encoder.copy_buffer_to_buffer(&bufs[2], 0, &staging, 0, size);
        self.queue.submit([encoder.finish()]);
        staging.slice(..).map_async(wgpu::MapMode::Read, |_| {});
        self.wait()?;
        let view = staging
            .slice(..)
            .get_mapped_range()
            .map_err(|e| Error::Backend {
                device: self.name.clone(),
                detail: format!("reading C: {e}"),
            })?;
        Ok(HostData::from_bytes(dtype, g.lens()[2], &view))
    }

    /// Seconds per product on device-resident operands (zeros: the kernel's time does
    /// not depend on the values): one warm-up run (the driver compiles there), then
    /// one product per submission, each waited for (as `kiln bench matmul` times the
    /// WGSL kernels), until `budget` has passed.
    pub fn time(&self, g: &SpirvGemm, dtype: DType, budget: std::time::Duration) -> Result<f64> {
        let pipeline = &self.pipeline(dtype, g)?;
        let groups = g.groups()?;
        let (group, _bufs) = self.bind(g, dtype);
        self.dispatch(pipeline, &group, groups);
        self.wait()?;
        let (mut runs, start) = (0usize, std::time::Instant::now());
        while runs < 2 || start.elapsed() < budget {
            self.dispatch(pipeline, &group, groups);
            self.wait()?;
            runs += 1;
        }
        Ok(start.elapsed().as_secs_f64() / runs as f64)
    }
}
