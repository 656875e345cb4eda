//! GEMMs on the hand-written SPIR-V: the GLSL tiled and GEMV twins, the CPU-class
//! blocks, the GPU-class tile and cooperative matrices; their layouts and pipelines.

use super::dispatch::buffer_writes;
use super::*;

/// The committed SPIR-V of a hand-written kernel (`shaders/vulkan/NAME.spv`), as words;
/// an error names a damaged file and how to rebuild it.
pub(super) fn spirv_words(name: &str, bytes: &[u8]) -> std::result::Result<Vec<u32>, String> {
    if !bytes.len().is_multiple_of(4)
        || bytes.len() < 20
        || bytes[..4] != 0x0723_0203u32.to_le_bytes()
    {
        return Err(format!(
            "shaders/vulkan/spv/{name}.spv is not a SPIR-V module ({} bytes): rebuild it \
             with `bash shaders/vulkan/build.sh`",
            bytes.len()
        ));
    }
    Ok(bytes
        .chunks_exact(4)
        .map(|w| u32::from_le_bytes([w[0], w[1], w[2], w[3]]))
        .collect())
}

pub(super) const GEMM_F32_SPV: &[u8] =
    include_bytes!("../../../../shaders/vulkan/spv/gemm_f32.spv");

impl VkDevice {
    /// The pipeline of a hand-written kernel with `buffers` storage bindings and
    /// `push` bytes of push constants, built on first use.
    pub(super) fn glsl_pipeline(
        &self,
        s: &mut State,
        name: &str,
        words: impl FnOnce() -> std::result::Result<Vec<u32>, String>,
        buffers: u32,
        push: u32,
    ) -> Result<(vk::Pipeline, vk::PipelineLayout)> {
        self.glsl_pipeline_with(s, name, words, (buffers, push), &[], None)
    }

    /// A compute pipeline of SPIR-V `words` (entry point `main`) on `layout`, with
    /// `spec` as its specialization constants (id, 32-bit value) and, where given, its
    /// subgroup size required; the shader module is destroyed once it is built.
    ///
    /// # Safety
    /// `words` is a valid compute module whose bindings and push constants `layout`
    /// declares, and `subgroup` is a size the device lets a pipeline require.
    pub(super) unsafe fn compute_pipeline(
        &self,
        words: &[u32],
        layout: vk::PipelineLayout,
        spec: &[(u32, u32)],
        subgroup: Option<u32>,
    ) -> std::result::Result<vk::Pipeline, vk::Result> {
        let module = self
            .device
            .create_shader_module(&vk::ShaderModuleCreateInfo::default().code(words), None)?;
        let entries: Vec<_> = (0..)
            .zip(spec)
            .map(|(i, &(id, _))| vk::SpecializationMapEntry {
                constant_id: id,
                offset: 4 * i,
                size: 4,
            })
            .collect();
        let data: Vec<u8> = spec.iter().flat_map(|(_, v)| v.to_le_bytes()).collect();
        let spec_info = vk::SpecializationInfo::default()
            .map_entries(&entries)
            .data(&data);
        let mut required = vk::PipelineShaderStageRequiredSubgroupSizeCreateInfo::default()
            .required_subgroup_size(subgroup.unwrap_or(0));
        let mut stage = vk::PipelineShaderStageCreateInfo::default()
            .stage(vk::ShaderStageFlags::COMPUTE)
            .module(module)
            .name(c"main")
            .specialization_info(&spec_info);
        if subgroup.is_some() {
            stage = stage.push_next(&mut required);
        }
        let made = self.device.create_compute_pipelines(
            self.cache,
            &[vk::ComputePipelineCreateInfo::default()
                .stage(stage)
                .layout(layout)],
            None,
        );
        self.device.destroy_shader_module(module, None);
        made.map(|p| p[0]).map_err(|(_, e)| e)
    }

    /// [`VkDevice::glsl_pipeline`] with specialization constants (`(constant_id,
    /// value)`, 32-bit each) and, where given, a required subgroup size. `name` must
    /// tell every specialization apart: it keys the pipeline.
    pub(super) fn glsl_pipeline_with(
        &self,
        s: &mut State,
        name: &str,
        words: impl FnOnce() -> std::result::Result<Vec<u32>, String>,
        (buffers, push): (u32, u32),
        spec: &[(u32, u32)],
        subgroup: Option<u32>,
    ) -> Result<(vk::Pipeline, vk::PipelineLayout)> {
        if let Some(&(p, _, l)) = s.glsl.get(name) {
            return Ok((p, l));
        }
        let words = words().map_err(|e| self.backend_error(e))?;
        let bindings: Vec<_> = (0..buffers)
            .map(|i| {
                vk::DescriptorSetLayoutBinding::default()
                    .binding(i)
                    .descriptor_type(vk::DescriptorType::STORAGE_BUFFER)
                    .descriptor_count(1)
                    .stage_flags(vk::ShaderStageFlags::COMPUTE)
            })
            .collect();
        let info = vk::DescriptorSetLayoutCreateInfo::default()
            .flags(vk::DescriptorSetLayoutCreateFlags::PUSH_DESCRIPTOR_KHR)
            .bindings(&bindings);
        // SAFETY: valid create infos on a live device; every object made is kept in
        // `s.glsl` or destroyed on the error paths below.
        unsafe {
            let set = self
                .device
                .create_descriptor_set_layout(&info, None)
                .map_err(|e| self.vk_error("creating a descriptor set layout", e))?;
            let sets = [set];
            let ranges = [vk::PushConstantRange::default()
                .stage_flags(vk::ShaderStageFlags::COMPUTE)
                .size(push)];
            let pl_info = vk::PipelineLayoutCreateInfo::default()
                .set_layouts(&sets)
                .push_constant_ranges(&ranges);
            let layout = match self.device.create_pipeline_layout(&pl_info, None) {
                Ok(l) => l,
                Err(e) => {
                    self.device.destroy_descriptor_set_layout(set, None);
                    return Err(self.vk_error("creating a pipeline layout", e));
                }
            };
            let fail = |e: vk::Result| {
                self.device.destroy_pipeline_layout(layout, None);
                self.device.destroy_descriptor_set_layout(set, None);
                self.vk_error(&format!("building kernel {name}"), e)
            };
            let pipeline = self
                .compute_pipeline(&words, layout, spec, subgroup)
                .map_err(fail)?;
            s.glsl.insert(name.to_string(), (pipeline, set, layout));
            self.built.store(true, std::sync::atomic::Ordering::Relaxed);
            Ok((pipeline, layout))
        }
    }

    /// Records `mm` with the hand-written GLSL GEMM (`shaders/vulkan/gemm_f32.comp`): f32
    /// operands, no transposes, one matrix, `alpha` 1 and `beta` 0, no epilogue — the
    /// start of the SPIR-V kernel family of issue 13, pinned by tests. Other products
    /// are an error naming what the kernel lacks.
    pub fn launch_glsl_gemm(&self, mm: &kiln_engine::Matmul) -> Result<()> {
        let kernel = Kernel::Matmul(mm.clone());
        kernel.validate()?;
        let plain = [mm.a, mm.b, mm.c].iter().all(|b| b.dtype == DType::F32)
            && !mm.trans_a
            && !mm.trans_b
            && mm.batch == 1
            && mm.alpha == 1.0
            && mm.beta == 0.0
            && mm.bias.is_none()
            && !mm.gelu
            && mm.c_f32.is_none();
        if !plain {
            return Err(Error::InvalidArgument(format!(
                "the GLSL GEMM computes C = A B for one f32 matrix without transposes, \
                 alpha, beta or epilogue; launch this product as Kernel::Matmul on `{}`",
                self.caps.name
            )));
        }
        if mm.m == 0 || mm.n == 0 {
            return Ok(());
        }
        let (m, n, k) = (mm.m as u32, mm.n as u32, mm.k as u32);
        if n.div_ceil(16) > 65535 || m.div_ceil(16) > 65535 {
            return Err(Error::InvalidArgument(format!(
                "the GLSL GEMM: {m} x {n} needs more than 65535 workgroups in a dimension"
            )));
        }
        let mut s = self.lock();
        self.check_live(&s, "matmul", &mm.buffers())?;
        // C may be what a transfer copy still reads.
        self.after_transfer_reads(&mut s, &[mm.c])?;
        let (pipeline, layout) = self.glsl_pipeline(
            &mut s,
            "gemm_f32",
            || spirv_words("gemm_f32", GEMM_F32_SPV),
            3,
            12,
        )?;
        let mut infos = vec![];
        for b in [mm.a, mm.b, mm.c] {
            let info = self.buffer_info(&s, b.id)?;
            if info.range > self.caps.max_storage_binding {
                return Err(Error::Unsupported {
                    device: self.caps.name.clone(),
                    what: format!(
                        "the GLSL GEMM on a {}-byte operand, over the per-binding limit \
                         (Kernel::Matmul splits such products)",
                        info.range
                    ),
                });
            }
            infos.push(info);
        }
        let writes = buffer_writes(&infos, None);
        let push: Vec<u8> = [m, n, k].iter().flat_map(|v| v.to_le_bytes()).collect();
        let cmd = self.stream(&mut s)?.cmd;
        let groups = (n.div_ceil(16), m.div_ceil(16), 1);
        self.record_compute(cmd, (pipeline, layout), &writes, &push, groups);
        Ok(())
    }
}

impl VkDevice {
    /// The set and pipeline layouts of the SPIR-V GEMM: A, B and C as storage buffers
    /// (bindings 0-2; with `texel`, A and B as uniform texel buffers), its parameters
    /// as a uniform (binding 3), and the epilogue modules' bias and f32 copy of C
    /// (storage, 4 and 5), pushed per launch.
    pub(super) fn gemm_layout(
        &self,
        s: &mut State,
        texel: bool,
    ) -> Result<(vk::DescriptorSetLayout, vk::PipelineLayout)> {
        if let Some(l) = s.gemm_layout[texel as usize] {
            return Ok(l);
        }
        let binding = |i: u32, ty: vk::DescriptorType| {
            vk::DescriptorSetLayoutBinding::default()
                .binding(i)
                .descriptor_type(ty)
                .descriptor_count(1)
                .stage_flags(vk::ShaderStageFlags::COMPUTE)
        };
        let storage = vk::DescriptorType::STORAGE_BUFFER;
        let input = if texel {
            vk::DescriptorType::UNIFORM_TEXEL_BUFFER
        } else {
            storage
        };
        let bindings = [
            binding(0, input),
            binding(1, input),
            binding(2, storage),
            binding(3, vk::DescriptorType::UNIFORM_BUFFER),
            binding(4, storage),
            binding(5, storage),
        ];
        let info = vk::DescriptorSetLayoutCreateInfo::default()
            .flags(vk::DescriptorSetLayoutCreateFlags::PUSH_DESCRIPTOR_KHR)
            .bindings(&bindings);
        // SAFETY: valid create infos on a live device; both objects are kept in
        // `s.gemm_layout` (destroyed on drop) or destroyed on the error path.
        unsafe {
            let set = self
                .device
                .create_descriptor_set_layout(&info, None)
                .map_err(|e| self.vk_error("creating a descriptor set layout", e))?;
            let sets = [set];
            let pl_info = vk::PipelineLayoutCreateInfo::default().set_layouts(&sets);
            let layout = self
                .device
                .create_pipeline_layout(&pl_info, None)
                .map_err(|e| {
                    self.device.destroy_descriptor_set_layout(set, None);
                    self.vk_error("creating a pipeline layout", e)
                })?;
            s.gemm_layout[texel as usize] = Some((set, layout));
            Ok((set, layout))
        }
    }

    /// The SPIR-V GEMM's pipeline for `p`: its committed module with the tile shape as
    /// specialization constants and, where the device allows, its subgroup size
    /// required; built on first use.
    pub(super) fn gemm_pipeline(
        &self,
        s: &mut State,
        p: &SpirvGemmPlan,
    ) -> Result<(vk::Pipeline, vk::PipelineLayout)> {
        let (_, layout) = self.gemm_layout(s, p.texel)?;
        let p = &p.pipeline_key();
        if let Some(&pipeline) = s.gemm.get(p) {
            return Ok((pipeline, layout));
        }
        // constant_id 1-11 of matmul_cpu.comp: TM, NV, the epilogue's BIAS, GELU and
        // COPY_F32 (32-bit booleans), and the `_mixed` modules' storage of A, B, C and
        // the bias, PARTIAL and USE_BETA; a module without some ignores their entries.
        let storage = p.mixed.unwrap_or([p.dtype; 4]).map(gemm::storage_code);
        let values = [
            p.tm,
            p.nv,
            p.bias as u32,
            p.gelu as u32,
            p.copy_f32 as u32,
            storage[0],
            storage[1],
            storage[2],
            storage[3],
            p.partial() as u32,
            p.use_beta as u32,
        ];
        let spec: Vec<(u32, u32)> = (1..).zip(values).collect();
        // `gemm::route` asks for the subgroup size only where the device can require it.
        let subgroup = p.require_subgroup.then_some(gemm::LANES);
        let shape = format!(
            "TM={} NV={} (subgroup size {}{})",
            p.tm,
            p.nv,
            if p.require_subgroup {
                "required"
            } else {
                "fixed"
            },
            if p.texel { "; A and B as texels" } else { "" }
        );
        let pipeline =
            self.build_gemm_pipeline(layout, gemm::module(p), &spec, subgroup, &shape)?;
        s.gemm.insert(*p, pipeline);
        Ok((pipeline, layout))
    }

    /// A hand-written GEMM's pipeline from its committed module `(name, bytes)` on the
    /// GEMM layout, specialized by `spec` (constant 1 up), `subgroup` required where
    /// given; `shape` names it in `KILN_COMPILE_LOG`'s line.
    pub(super) fn build_gemm_pipeline(
        &self,
        layout: vk::PipelineLayout,
        (name, bytes): (&str, &[u8]),
        spec: &[(u32, u32)],
        subgroup: Option<u32>,
        shape: &str,
    ) -> Result<vk::Pipeline> {
        let t0 = std::time::Instant::now();
        let words = spirv_words(name, bytes).map_err(|e| self.backend_error(e))?;
        // SAFETY: a module checked as SPIR-V (the committed output of glslangValidator,
        // validated by tests/spirv.rs), on a live device; its bindings are the
        // layout's, every load index it makes is clamped into the buffers a launch
        // binds, `gemm::route` checked its shared memory and workgroup against the
        // device's limits and asks for a subgroup size only where the device can
        // require it.
        let pipeline = unsafe { self.compute_pipeline(&words, layout, spec, subgroup) }
            .map_err(|e| self.vk_error(&format!("building kernel {name}"), e))?;
        self.built.store(true, std::sync::atomic::Ordering::Relaxed);
        if compile_log() {
            eprintln!(
                "kiln: vk built {name} {shape}: {:.2} s",
                t0.elapsed().as_secs_f64()
            );
        }
        Ok(pipeline)
    }

    /// Records `mm` with the SPIR-V GEMM as `p` plans it: one dispatch over every
    /// tile and matrix. (The planner's row chunks keep a GPU's dispatches short for
    /// its watchdog; this kernel runs on CPU-class devices only, as one dispatch.)
    pub(super) fn record_spirv_gemm(
        &self,
        s: &mut State,
        mm: &kiln_engine::Matmul,
        p: &SpirvGemmPlan,
    ) -> Result<()> {
        // Built now, also where `prepare` only collects.
        self.gemm_pipeline(s, p)?;
        self.record_gemm_with(s, mm, p.partial(), (p.splits, p.k_chunk), |dev, s, cf| {
            let pipeline = dev.gemm_pipeline(s, p)?;
            let texel = p.texel.then_some(p.vec_b);
            dev.dispatch_gemm(s, mm, pipeline, &p.params(mm), p.groups(mm), cf, texel)?;
            s.ran.insert(p.pipeline_key());
            if p.texel {
                dev.texel_count
                    .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            }
            Ok(())
        })
    }

    /// Records a hand-written GEMM of `mm` (its pipelines built): `dispatch` binds and
    /// dispatches it given where the f32 copy of C goes; with `partial`, that is the
    /// planner's f32 partials (`split`: its K split), which the WGSL `matmul_finish`
    /// (through naga) then sums with the epilogue. While `prepare` collects, only the
    /// finish's pipeline is collected.
    pub(super) fn record_gemm_with(
        &self,
        s: &mut State,
        mm: &kiln_engine::Matmul,
        partial: bool,
        split: (u32, u32),
        dispatch: impl FnOnce(&Self, &mut State, u64) -> Result<()>,
    ) -> Result<()> {
        let plan = if partial {
            let force = *self.gemm_variant.lock().unwrap_or_else(|e| e.into_inner());
            let plan = plan_matmul(mm, &self.caps, force)?;
            debug_assert_eq!((plan.splits, plan.k_chunk), split);
            Some(plan)
        } else {
            None
        };
        if s.collect.is_some() {
            if let Some(plan) = &plan {
                split_finish(self, s, mm, plan)?;
            }
            return Ok(());
        }
        if let Some(plan) = &plan {
            split_partials(self, s, mm, plan)?;
        }
        let cf = if plan.is_some() {
            PARTIALS_ID
        } else {
            mm.c_f32.map_or(DUMMY_ID, |b| b.id)
        };
        dispatch(self, s, cf)?;
        if let Some(plan) = &plan {
            split_finish(self, s, mm, plan)?;
        }
        Ok(())
    }

    /// Records one dispatch of a hand-written GEMM's `pipeline` over `groups`: A, B
    /// and C at bindings 0-2, `params` as the uniform at 3, the bias (a stand-in where
    /// the launch has none: the modules that read it declare it) at 4 and `cf` (the f32
    /// copy of C or the partials) at 5; see `gemm_layout`. With `texel` (whether B is
    /// read four values to a fetch), A and B are bound as texel views of their storage,
    /// made here and retired with the stream.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn dispatch_gemm(
        &self,
        s: &mut State,
        mm: &kiln_engine::Matmul,
        pipeline: (vk::Pipeline, vk::PipelineLayout),
        params: &[u32; 16],
        groups: (u64, u64, u64),
        cf: u64,
        texel: Option<bool>,
    ) -> Result<()> {
        let mut infos = vec![];
        for id in [mm.a.id, mm.b.id, mm.c.id] {
            infos.push(self.buffer_info(s, id)?);
        }

        let (cmd, arena, offset) = self.put_params(s, params)?;
        infos.push(vk::DescriptorBufferInfo {
            buffer: arena,
            offset,
            range: 4 * params.len() as u64,
        });
        // Made once the stream is open, so that they are retired with it.
        let views = match texel {
            Some(vec_b) => Some([
                self.texel_view(s, infos[0], gemm::texel_format(mm.a.dtype, false))?,
                self.texel_view(s, infos[1], gemm::texel_format(mm.b.dtype, vec_b))?,
            ]),
            None => None,
        };
        infos.push(self.buffer_info(s, mm.bias.map_or(DUMMY_ID, |b| b.id))?);
        infos.push(self.buffer_info(s, cf)?);
        let mut writes = buffer_writes(&infos, Some(3));
        if let Some(views) = &views {
            for (w, view) in writes.iter_mut().zip(views) {
                *w = vk::WriteDescriptorSet::default()
                    .dst_binding(w.dst_binding)
                    .descriptor_type(vk::DescriptorType::UNIFORM_TEXEL_BUFFER)
                    .texel_buffer_view(std::slice::from_ref(view));
            }
        }
        let (x, y, z) = groups;
        self.record_compute(cmd, pipeline, &writes, &[], (x as u32, y as u32, z as u32));
        Ok(())
    }

    /// A view of `info`'s range (whole texels of `format`) for the open stream's
    /// launches, destroyed once the stream has run.
    fn texel_view(
        &self,
        s: &mut State,
        info: vk::DescriptorBufferInfo,
        format: vk::Format,
    ) -> Result<vk::BufferView> {
        let texel = match format {
            vk::Format::R32G32B32A32_SFLOAT => 16,
            vk::Format::R16G16B16A16_SFLOAT | vk::Format::R16G16B16A16_UINT => 8,
            vk::Format::R32_SFLOAT => 4,
            _ => 2,
        };
        // Whole texels, and bits 8-15 of the size never all zero, so that lavapipe's
        // shader key is the same for every view (`contract::texel_buffer_size` left
        // the 256 bytes past the data this may add).
        let mut range = info.range / texel * texel;
        if (range >> 8) & 0xff == 0 {
            range += 256;
        }
        let create = vk::BufferViewCreateInfo::default()
            .buffer(info.buffer)
            .format(format)
            .offset(info.offset)
            .range(range);
        // SAFETY: a live buffer made with UNIFORM_TEXEL_BUFFER usage (`alloc`, where
        // the device has texel views); `gemm::route` checked the offset's alignment and
        // the texel count against the device's limits, and the format's support.
        let view = unsafe { self.device.create_buffer_view(&create, None) }
            .map_err(|e| self.vk_error("creating a texel view", e))?;
        Self::retired_at(s, (Self::tag(s), 0)).views.push(view);
        Ok(view)
    }

    /// The block a launch planned as `p` runs: `p`, unless it is a big block whose
    /// first run the primer still has to make (then it is asked for, and a stand-in of
    /// the same K split runs: the same sums in the same order).
    pub(super) fn gemm_block(
        &self,
        s: &State,
        mm: &kiln_engine::Matmul,
        p: &SpirvGemmPlan,
    ) -> SpirvGemmPlan {
        let Some(primer) = &self.primer else {
            return *p;
        };
        if self
            .gemm_variant
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .is_some()
        {
            // A pinned block (a benchmark's row, a test) runs as pinned.
            return *p;
        }
        let best = MatmulVariant::Cpu { tm: p.tm, nv: p.nv };
        let with = |v: MatmulVariant| match v {
            MatmulVariant::Cpu { tm, nv } => Some(SpirvGemmPlan { tm, nv, ..*p }),
            _ => None,
        };
        let readiness = |v: MatmulVariant| {
            let Some(q) = with(v) else {
                return Readiness::Absent;
            };
            let key = q.pipeline_key();
            if s.ran.contains(&key) {
                return Readiness::Ready;
            }
            match primer.state(&Block::Gemm(key)) {
                Some(Primed::Done) => Readiness::Ready,
                // The planned block then compiles at its first run here, as without a
                // primer; a smaller one that failed is no stand-in (it would too).
                Some(Primed::Failed) if v == best => Readiness::Ready,
                Some(Primed::Queued) => Readiness::Building,
                _ => Readiness::Absent,
            }
        };
        // The ladder's rule: blocks of 32 rows and more take seconds to compile.
        if p.tm >= 32 && readiness(best) == Readiness::Absent {
            primer.ask(Job {
                block: Block::Gemm(p.pipeline_key()),
                attention: None,
            });
        }
        let ran = gemm_stand_in(best, readiness);
        match with(ran) {
            Some(q) if q != *p && s.collect.is_none() => {
                let (x, y, z) = q.groups(mm);
                if x.max(y).max(z) > 65535 {
                    // Its grid does not fit one dispatch: the planned block compiles
                    // here instead.
                    return *p;
                }
                self.stand_ins
                    .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                q
            }
            Some(q) => q,
            None => *p,
        }
    }
}

impl VkDevice {
    /// The pipeline of the tiled GEMM's or the GEMV's SPIR-V twin for `p`: its
    /// committed module with everything specialized, on the SPIR-V GEMM's layout;
    /// built on first use.
    pub(super) fn gpu_gemm_pipeline(
        &self,
        s: &mut State,
        p: &GpuGemmPlan,
    ) -> Result<(vk::Pipeline, vk::PipelineLayout)> {
        let (_, layout) = self.gemm_layout(s, false)?;
        let p = &p.pipeline_key();
        if let Some(&pipeline) = s.gemm_gpu.get(p) {
            return Ok((pipeline, layout));
        }
        let spec: Vec<(u32, u32)> = (1..).zip(p.spec()).collect();
        let shape = format!("{:?}", p.kernel);
        let pipeline =
            self.build_gemm_pipeline(layout, gemm::gpu_module(p), &spec, None, &shape)?;
        s.gemm_gpu.insert(*p, pipeline);
        Ok((pipeline, layout))
    }

    /// Records `mm` with the tiled GEMM's or the GEMV's SPIR-V twin as `p` plans it:
    /// a dispatch per chunk of the planner's rows over every column tile, matrix and K
    /// split, then (split) the WGSL `matmul_finish` over the partials, as
    /// [`VkDevice::record_spirv_gemm`] does.
    pub(super) fn record_gpu_gemm(
        &self,
        s: &mut State,
        mm: &kiln_engine::Matmul,
        p: &GpuGemmPlan,
    ) -> Result<()> {
        let pipeline = self.gpu_gemm_pipeline(s, p)?;
        self.record_gemm_with(s, mm, p.partial(), (p.splits, p.k_chunk), |dev, s, cf| {
            for (row_base, groups) in p.dispatches(mm) {
                let params = p.params(mm, row_base);
                dev.dispatch_gemm(s, mm, pipeline, &params, groups, cf, None)?;
            }
            Ok(())
        })
    }

    /// Records `mm` with the cooperative-matrix GEMM as `p` plans it: one dispatch, a
    /// workgroup (one subgroup) per tile of C and matrix. Its module is emitted for
    /// `p` when the pipeline is first built.
    pub(super) fn record_coopmat_gemm(
        &self,
        s: &mut State,
        mm: &kiln_engine::Matmul,
        p: &CoopMatPlan,
    ) -> Result<()> {
        let name = p.name();
        let (pipeline, layout) =
            self.glsl_pipeline(s, &name, || Ok(coopmat::module(p)), 3, coopmat::PUSH_BYTES)?;
        if s.collect.is_some() {
            // `prepare` wanted the pipeline, now built.
            return Ok(());
        }
        let mut infos = vec![];
        for b in [mm.a, mm.b, mm.c] {
            infos.push(self.buffer_info(s, b.id)?);
        }
        let writes = buffer_writes(&infos, None);
        let cmd = self.stream(s)?.cmd;
        let (x, y, z) = p.groups(mm);
        self.record_compute(
            cmd,
            (pipeline, layout),
            &writes,
            &p.push(mm),
            (x as u32, y as u32, z as u32),
        );
        Ok(())
    }
}
