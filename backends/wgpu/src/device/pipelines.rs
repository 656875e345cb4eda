//! Building one pipeline: its bind-group and pipeline layouts, its shader module and
//! the driver's compile, on this thread or (`build`) on a compile worker.

use super::*;

/// Builds one pipeline; needs no state, so workers build several at once (wgpu
/// devices are `Sync` and error scopes are per thread). Marks the disk cache for
/// saving.
pub(super) fn build(
    device: &wgpu::Device,
    cache: Option<&crate::pipeline_cache::DiskCache>,
    key: &PipelineKey,
    module: &wgpu::ShaderModule,
    layout: &wgpu::PipelineLayout,
) -> std::result::Result<wgpu::ComputePipeline, String> {
    let constants = key.constants();
    let pipeline = caught(device, || {
        device.create_compute_pipeline(&wgpu::ComputePipelineDescriptor {
            label: Some(key.name),
            layout: Some(layout),
            module,
            entry_point: Some("main"),
            compilation_options: wgpu::PipelineCompilationOptions {
                constants: &constants,
                zero_initialize_workgroup_memory: false,
            },
            cache: cache.map(|c| &c.cache),
        })
    })?;
    if let Some(c) = cache {
        c.dirty.store(true, std::sync::atomic::Ordering::Relaxed);
    }
    Ok(pipeline)
}

/// A kernel's bindings: its launch parameters (binding 0, a uniform at a dynamic
/// offset in the arena), then one storage buffer per slot.
pub(super) fn layout_entries(
    accesses: &[Access],
    params_size: u64,
) -> Vec<wgpu::BindGroupLayoutEntry> {
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
    entries
}

/// `KILN_COMPILE_LOG=1`: each pipeline's build and (software drivers) first-run time
/// on stderr, to see where a first step's compile time goes.
pub(super) fn log_compile(what: &str, key: &PipelineKey, since: std::time::Instant) {
    if compile_log() {
        eprintln!(
            "kiln: {what} {} {:?} {:?} {:?}: {:.2} s",
            key.name,
            key.reprs,
            key.consts,
            key.overrides,
            since.elapsed().as_secs_f64()
        );
    }
}

impl WgpuDevice {
    pub(super) fn layout<'s>(
        &self,
        s: &'s mut State,
        kernel: &KernelSource,
    ) -> &'s (wgpu::BindGroupLayout, wgpu::PipelineLayout) {
        let accesses: Vec<Access> = kernel.slots.iter().map(|slot| slot.access).collect();
        let params_size = kernel.params_size;
        s.layouts
            .entry((accesses.clone(), params_size))
            .or_insert_with(|| {
                let entries = layout_entries(&accesses, params_size);
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

    pub(super) fn pipeline(
        &self,
        s: &mut State,
        key: &PipelineKey,
        kernel: &KernelSource,
    ) -> Result<()> {
        if s.pipelines.contains_key(key) {
            return Ok(());
        }
        if s.building.contains(key) {
            return self.take_built(s, key);
        }
        self.check_kernel(kernel)?;
        let module = self.module(s, key, kernel);
        let layout = self.layout(s, kernel).1.clone();
        let pipeline = self.build_pipeline(key, kernel, &module, &layout)?;
        s.pipelines.insert(key.clone(), pipeline);
        Ok(())
    }

    pub(super) fn check_kernel(&self, kernel: &KernelSource) -> Result<()> {
        if kernel.subgroups && self.caps.subgroup_sizes.is_none() {
            return Err(Error::Unsupported {
                device: self.caps.name.clone(),
                what: format!("subgroup operations, which kernel {} needs", kernel.name),
            });
        }
        Ok(())
    }

    /// The module of a pipeline key (created on first use: naga parses and validates
    /// the WGSL, which is quick; the driver compiles at pipeline creation).
    pub(super) fn module(
        &self,
        s: &mut State,
        key: &PipelineKey,
        kernel: &KernelSource,
    ) -> wgpu::ShaderModule {
        let module_key = (kernel.name, key.reprs.clone(), key.consts.clone());
        if let Some(m) = s.modules.get(&module_key) {
            return m.clone();
        }
        let source = shader::assemble(kernel, &key.reprs, &key.consts);
        let desc = wgpu::ShaderModuleDescriptor {
            label: Some(kernel.name),
            source: wgpu::ShaderSource::Wgsl(source.into()),
        };
        let module = if kernel.trusted {
            // SAFETY: `trusted` kernels clamp every buffer index into range
            // themselves (see their sources) and their loops are bounded by launch
            // parameters, so the checks the compiler would add can never fire.
            unsafe {
                self.device
                    .create_shader_module_trusted(desc, wgpu::ShaderRuntimeChecks::unchecked())
            }
        } else {
            self.device.create_shader_module(desc)
        };
        s.modules.insert(module_key, module.clone());
        module
    }

    fn build_pipeline(
        &self,
        key: &PipelineKey,
        kernel: &KernelSource,
        module: &wgpu::ShaderModule,
        layout: &wgpu::PipelineLayout,
    ) -> Result<wgpu::ComputePipeline> {
        build(
            &self.device,
            self.disk_cache.as_deref(),
            key,
            module,
            layout,
        )
        .map_err(|e| self.backend_error(format!("kernel {} failed to build: {e}", kernel.name)))
    }

    /// Pipelines built or being built (tests check that a prepared plan's launches add
    /// none).
    pub fn pipeline_count(&self) -> usize {
        let s = self.lock();
        s.pipelines.len() + s.building.len()
    }
}
