//! Fused attention on the hand-written GLSL passes (`shaders/vulkan/attention.comp`),
//! over the WGSL kernels' launches, with one row per lane standing in while the
//! primer compiles a larger block.

use super::dispatch::buffer_writes;
use super::gemm_launch::spirv_words;
use super::*;
use kiln_engine::kernels::{self, AttentionBackward};

impl VkDevice {
    /// Records a validated attention kernel with the hand-written GLSL passes, over the
    /// WGSL kernels' launches (bands, parameters and the delta scratch are theirs).
    pub(super) fn record_attention(&self, s: &mut State, kernel: &Kernel) -> Result<()> {
        let dim = attention_geometry(kernel).3;
        let forced = *self
            .attention_plan
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        let plan = forced.unwrap_or_else(|| attention::plan(&self.caps, dim));
        let (Some(primer), None, true) = (&self.primer, forced, plan.rows > 1) else {
            return self.record_attention_with(s, kernel, &plan);
        };
        // A pass with several rows per lane takes tens of seconds to compile at its
        // first run on a software driver: until the primer has run it, one row per
        // lane stands in (each row's sums are the same, in the same order).
        let key = self.attention_names(kernel, &plan)?;
        let block = Block::Attention(key.clone());
        let ready = s.ran_attention.contains(&key)
            || matches!(primer.state(&block), Some(Primed::Done | Primed::Failed));
        if ready {
            self.record_attention_with(s, kernel, &plan)?;
            if s.collect.is_none() {
                s.ran_attention.insert(key);
            }
            return Ok(());
        }
        primer.ask(Job {
            block,
            attention: Some(attention_recipe(kernel, plan)),
        });
        if s.collect.is_some() {
            // `prepare` builds the planned passes' pipelines too, so the switch once
            // they are primed builds nothing.
            self.record_attention_with(s, kernel, &plan)?;
        } else {
            self.stand_ins
                .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        }
        self.record_attention_with(s, kernel, &AttentionPlan { rows: 1, ..plan })
    }

    /// The names of the pipelines `kernel`'s passes run with `plan`.
    fn attention_names(&self, kernel: &Kernel, plan: &AttentionPlan) -> Result<String> {
        let dim = attention_geometry(kernel).3;
        let (launches, _) = attention_launches(&self.caps, kernel, plan)?;
        let mut names: Vec<String> = launches
            .iter()
            .map(|l| {
                let module = attention::module(l.pass, !self.caps.f16_arithmetic).0;
                attention::pipeline_name(module, &attention::spec(plan, dim, &l.typed))
            })
            .collect();
        names.dedup();
        Ok(names.join("; "))
    }

    /// Records `kernel` with the GLSL passes shaped by `plan`.
    pub(super) fn record_attention_with(
        &self,
        s: &mut State,
        kernel: &Kernel,
        plan: &AttentionPlan,
    ) -> Result<()> {
        let dim = attention_geometry(kernel).3;
        let plan = *plan;
        let (launches, scratch) = attention_launches(&self.caps, kernel, &plan)?;
        if scratch > 0 {
            Recorder::partials(self, s, scratch)?;
        }
        let subgroup =
            attention::required_subgroup(&plan, self.features.subgroup_control.map(|c| c.sizes));
        for l in &launches {
            let spec = attention::spec(&plan, dim, &l.typed);
            // Without f16 the device has no 16-bit storage either (see `open`).
            let (module, bytes) = attention::module(l.pass, !self.caps.f16_arithmetic);
            let (pipeline, layout) = self.glsl_pipeline_with(
                s,
                &attention::pipeline_name(module, &spec),
                || spirv_words(module, bytes),
                (attention::bindings(l.pass), attention::PUSH_BYTES),
                &spec,
                subgroup,
            )?;
            if s.collect.is_some() {
                // `prepare` wanted the pipeline, now built.
                continue;
            }
            let mut infos = vec![];
            let ids = l.typed.iter().map(|b| b.id).chain(l.f32s.iter().copied());
            for id in ids.chain([l.starts]) {
                infos.push(self.buffer_info(s, id)?);
            }
            let writes = buffer_writes(&infos, None);
            let push: Vec<u8> = l.params.iter().flat_map(|w| w.to_le_bytes()).collect();
            let cmd = self.stream(s)?.cmd;
            self.record_compute(cmd, (pipeline, layout), &writes, &push, l.groups);
            self.attention_count
                .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        }
        Ok(())
    }
}

/// What the primer needs to run an attention kernel like `kernel` (see `primer.rs`).
fn attention_recipe(kernel: &Kernel, plan: AttentionPlan) -> AttentionRecipe {
    let (backward, group, dim, causal, documents) = match *kernel {
        Kernel::Attention(kernels::Attention {
            group,
            dim,
            causal,
            documents,
            ..
        }) => (false, group, dim, causal, documents),
        Kernel::AttentionBackward(AttentionBackward {
            group,
            dim,
            causal,
            documents,
            ..
        }) => (true, group, dim, causal, documents),
        _ => (false, 1, 1, false, None),
    };
    // The passes are the same pipelines with documents or without (their starts are
    // a launch parameter and one more binding): the primer runs them without.
    let mut dtypes: Vec<DType> = kernel.buffers().iter().map(|b| b.dtype).collect();
    if documents.is_some() {
        dtypes.pop();
    }
    AttentionRecipe {
        backward,
        dtypes,
        group: group.max(1),
        dim,
        causal,
        plan,
    }
}
