//! The shared lowering's `Recorder` on a wgpu device: pipeline readiness for the
//! planners, dispatches, copies, clears and the GEMM partials buffer.

use super::*;

impl Recorder for WgpuDevice {
    type State = State;

    fn caps(&self) -> &Capabilities {
        &self.caps
    }

    fn readiness(&self, s: &State, d: &Dispatch) -> Readiness {
        let key = PipelineKey {
            name: d.kernel.name,
            reprs: d.reprs.clone(),
            consts: d.consts.clone(),
            overrides: d.overrides.clone(),
        };
        // `prepare` lists the planner's own pipelines: report them ready so that it does.
        if s.collect.is_some() || s.pipelines.contains_key(&key) {
            return Readiness::Ready;
        }
        if !s.building.contains(&key) {
            return Readiness::Absent;
        }
        let (ready, _) = &**self.built;
        if ready
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .contains_key(&key)
        {
            Readiness::Ready
        } else {
            Readiness::Building
        }
    }

    fn want_ahead(&self, s: &mut State, d: Dispatch) {
        let key = PipelineKey {
            name: d.kernel.name,
            reprs: d.reprs,
            consts: d.consts,
            overrides: d.overrides,
        };
        let known = s.pipelines.contains_key(&key) || s.building.contains(&key);
        if let Some(wanted) = &mut s.collect {
            if !known && !wanted.iter().any(|w| w.key == key) {
                wanted.push(Wanted {
                    key,
                    kernel: d.kernel,
                });
            }
        }
    }

    fn note_stand_in(&self, s: &mut State, planned: &str, ran: &str) {
        s.stand_ins += 1;
        if compile_log() {
            eprintln!("kiln: {ran} stands in for {planned}, still building");
        }
    }

    fn tuned_block(
        &self,
        s: &mut State,
        mm: &kiln_engine::Matmul,
        best: &kiln_lowering::MatmulPlan,
        state: &dyn Fn(&State, kiln_lowering::MatmulVariant) -> Readiness,
        ran: &dyn Fn(&State, kiln_lowering::MatmulVariant) -> bool,
    ) -> Result<Option<kiln_lowering::MatmulVariant>> {
        self.tune(s, mm, best, state, ran)
    }

    fn has_run(&self, s: &State, d: &Dispatch) -> bool {
        let key = PipelineKey {
            name: d.kernel.name,
            reprs: d.reprs.clone(),
            consts: d.consts.clone(),
            overrides: d.overrides.clone(),
        };
        // Built ahead and not run yet: its first run compiles the machine code, unless
        // it ran on the primer's device.
        !s.first_runs.contains(&key)
            || self
                .primed_keys
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .contains(&key)
    }

    fn dispatch(&self, s: &mut State, d: Dispatch) -> Result<()> {
        self.record_dispatch(s, d)
    }

    fn copy(&self, s: &mut State, src: &Buffer, dst: &Buffer) -> Result<()> {
        let (a, b) = (self.resolve(s, src.id)?, self.resolve(s, dst.id)?);
        let (from, to) = (s.base(src.id), s.base(dst.id));
        if a == b {
            // Views of one buffer: WebGPU copies only between distinct buffers.
            let tmp = self.device.create_buffer(&wgpu::BufferDescriptor {
                label: Some("kiln copy"),
                size: src.bytes(),
                usage: wgpu::BufferUsages::COPY_SRC | wgpu::BufferUsages::COPY_DST,
                mapped_at_creation: false,
            });
            let e = self.encoder(s);
            e.copy_buffer_to_buffer(&a, from, &tmp, 0, src.bytes());
            e.copy_buffer_to_buffer(&tmp, 0, &b, to, src.bytes());
        } else {
            self.encoder(s)
                .copy_buffer_to_buffer(&a, from, &b, to, src.bytes());
        }
        Ok(())
    }

    fn clear(&self, s: &mut State, buf: &Buffer) -> Result<()> {
        let f = self.resolve(s, buf.id)?;
        let base = s.base(buf.id);
        self.encoder(s).clear_buffer(&f, base, Some(buf.bytes()));
        Ok(())
    }

    fn storage_offset_alignment(&self) -> u64 {
        self.device.limits().min_storage_buffer_offset_alignment as u64
    }

    /// The GEMM partials buffer, at least `bytes` long.
    fn partials(&self, s: &mut State, bytes: u64) -> Result<()> {
        if s.partials.as_ref().is_some_and(|p| p.size() >= bytes) {
            return Ok(());
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
        s.partials = Some(p);
        Ok(())
    }
}
