//! A forward pass compiled alone, for inference: the launches of the graph's ops over
//! the caller's weight and input buffers, intermediates shared by liveness as in a
//! training [`super::Plan`], replayed by [`ForwardPlan::run`]. No gradients, master
//! weights or optimizer state are bound or allocated; every op runs (a decode pass is
//! pruned before, by [`Graph::decode_pass`]).

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};

use super::plan::{bind_data, check_external, place, share, Emitter};
use super::{ops, split, Graph, PlanMemory, Source, Tensor};
use crate::{Buffer, Device, Error, Kernel, Result};

/// A compiled forward pass.
pub struct ForwardPlan {
    launches: Vec<Kernel>,
    owned: Vec<Buffer>,
    /// The graph's outputs by tensor, readable after a run.
    outputs: HashMap<Tensor, Buffer>,
    memory: PlanMemory,
    prepared: AtomicBool,
}

impl Graph {
    /// Compiles the forward pass alone over `params` (one buffer per [`Graph::params`]
    /// entry, in order, of the parameter's dtype and length) and `inputs` (a buffer for
    /// every input an op reads), allocating its intermediates on `dev` once. The graph's
    /// outputs ([`Graph::output`]) stay readable ([`ForwardPlan::buffer`]).
    pub fn compile_forward(
        &self,
        dev: &dyn Device,
        params: &[Buffer],
        inputs: &[(Tensor, Buffer)],
    ) -> Result<ForwardPlan> {
        if params.len() != self.params.len() {
            return Err(Error::InvalidArgument(format!(
                "plan: the graph declares {} parameters but {} were bound; bind one buffer \
                 per Graph::params entry, in order",
                self.params.len(),
                params.len()
            )));
        }
        let mut e = Emitter::new(self);
        for (decl, &buf) in self.params.iter().zip(params) {
            let i = self.t(decl.tensor);
            check_external(format!("`{}`", decl.name), buf, i.dtype, i.len())?;
            e.value[decl.tensor.0] = Some(buf);
        }
        let read: std::collections::HashSet<Tensor> =
            self.ops.iter().flat_map(split::reads).collect();
        bind_data(self, &mut e, inputs, |t| read.contains(&t))?;
        if let Some((t, _)) = inputs.iter().find(|(t, _)| {
            !matches!(
                self.tensors.get(t.0).map(|i| i.source),
                Some(Source::Input | Source::Frozen)
            ) || !read.contains(t)
        }) {
            return Err(Error::InvalidArgument(format!(
                "plan: tensor #{} is bound as an input but no op of this graph reads it as one",
                t.0
            )));
        }
        for (i, op) in self.ops.iter().enumerate() {
            e.op = self.op_id(i);
            ops::forward(op, &mut e)?;
        }
        let outputs: Vec<(Tensor, Buffer)> = self.outputs.iter().map(|&t| (t, e.val(t))).collect();
        let sharing = share(&e)?;
        let memory = sharing.memory;
        let placed = place(dev, e, &sharing)?;
        Ok(ForwardPlan {
            outputs: outputs
                .into_iter()
                .map(|(t, b)| (t, placed.map(b)))
                .collect(),
            launches: placed.launches,
            owned: placed.owned,
            memory,
            prepared: AtomicBool::new(false),
        })
    }
}

impl ForwardPlan {
    /// Records every launch and submits them (the device compiles the pipelines of all
    /// of them before the first run, at once).
    pub fn run(&self, dev: &dyn Device) -> Result<()> {
        if !self.prepared.swap(true, Ordering::Relaxed) {
            dev.prepare(&self.launches)?;
        }
        for k in &self.launches {
            dev.launch(k)?;
        }
        dev.submit()
    }

    /// The buffer of a graph output.
    pub fn buffer(&self, t: Tensor) -> Option<Buffer> {
        self.outputs.get(&t).copied()
    }

    /// Launches per run.
    pub fn launch_count(&self) -> usize {
        self.launches.len()
    }

    /// Device bytes the plan holds, with and without sharing.
    pub fn memory(&self) -> PlanMemory {
        self.memory
    }

    /// Releases every buffer the plan allocated (not the caller's); it must not run
    /// afterwards.
    pub fn free(&mut self, dev: &dyn Device) -> Result<()> {
        let mut first = Ok(());
        for b in self.owned.drain(..) {
            if let Err(e) = dev.free(b) {
                if first.is_ok() {
                    first = Err(e);
                }
            }
        }
        first
    }
}

impl std::fmt::Debug for ForwardPlan {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "ForwardPlan({} launches)", self.launches.len())
    }
}
