//! The pipeline's stages before and outside a step: the cut of a model into stages
//! (`cut`), what each stage allocates (`stage_memory`), the per-block costs the
//! partition weighs (`stage_costs`), the compile of one activation slot
//! (`compile_slot`) and a micro-batch's checked data for a stage (`stage_data`).
//! The types every part of the pipeline shares (`Stage`, `Slot`) live here, the
//! lowest of its files.

use super::pipeline_partition::{partition, PartitionMethod, StageCosts};
use crate::device::optim::ParamBuffers;
use crate::graph::{Bindings, Plan, StageGraph, Tensor};
use crate::models::{
    batch_input, check_documents, check_ids, check_specs, one_document_per_row, record,
    shared_gradients, MicroBatch, Model, NetworkMemory, NetworkOptions, ParamSpec,
};
use crate::{Buffer, DType, Device, Error, HostData, Result, IGNORE_TARGET};

/// One activation slot: a compiled plan and the buffers bound to its inputs.
pub(super) struct Slot {
    pub(super) plan: Plan,
    /// Per [`StageGraph::inputs`] entry.
    pub(super) inputs: Vec<Buffer>,
    /// Per [`StageGraph::activations_in`] entry.
    pub(super) acts_in: Vec<Buffer>,
    /// Per [`StageGraph::activations_out`] entry with a gradient.
    pub(super) seeds: Vec<Option<Buffer>>,
}

/// One stage: its part of the graph, its parameters and its slots.
pub(super) struct Stage {
    pub(super) part: StageGraph,
    /// Per `part.params` entry.
    pub(super) params: Vec<ParamBuffers>,
    /// Per `part.frozen` entry: the frozen weight's buffer (storage dtype).
    pub(super) frozen: Vec<Buffer>,
    pub(super) slots: Vec<Slot>,
    /// Per `part.inputs` entry: its place in a [`MicroBatch`].
    pub(super) input_pos: Vec<usize>,
    /// The `part.inputs` entry holding the loss's targets, if this stage has the loss.
    pub(super) targets: Option<usize>,
    /// Rows of the loss (a regression loss weighs each 1 / rows).
    pub(super) loss_rows: usize,
    /// ZeRO stage 2 over replicas, where the stage's alike blocks share one set of
    /// gradient buffers: the groups of `part.params` positions each backward hands
    /// over as their gradients are final (every micro-batch's, summed on the host).
    pub(super) hand_over: Option<Vec<Vec<usize>>>,
}

impl Stage {
    /// The buffer in `slot` holding the outgoing activation `local`: the stage's own
    /// output, or — a tensor passed on to a later stage — the input it arrived in.
    pub(super) fn outgoing(&self, slot: &Slot, local: Tensor) -> Buffer {
        slot.plan.buffer(local).unwrap_or_else(|| {
            let k = self
                .part
                .activations_in
                .iter()
                .position(|i| i.local == local)
                .expect("an outgoing tensor is made here or passed on");
            slot.acts_in[k]
        })
    }
}

/// A model cut into stages, before any device is touched.
pub(super) struct Cut {
    pub(super) specs: Vec<ParamSpec>,
    /// The model's inputs, in [`MicroBatch`] order.
    pub(super) inputs: Vec<Tensor>,
    pub(super) parts: Vec<StageGraph>,
    /// Per parameter: the stages holding it.
    pub(super) holders: Vec<Vec<usize>>,
    /// Per stage: its blocks.
    pub(super) ranges: Vec<std::ops::Range<usize>>,
    /// The model's blocks (parameter indices per block).
    pub(super) blocks: Vec<Vec<usize>>,
}

/// Checks `model`, records its forward pass and cuts it into `p` stages by `method`.
pub(super) fn cut(
    model: &dyn Model,
    options: &NetworkOptions,
    method: &PartitionMethod,
    p: usize,
) -> Result<Cut> {
    if p == 0 {
        return Err(Error::InvalidArgument(
            "pipeline: no devices; give one device per stage".into(),
        ));
    }
    model.check_sizes()?;
    let specs = model.parameters();
    check_specs(model, &specs)?;
    let blocks = model.blocks();
    if blocks.is_empty() {
        return Err(Error::InvalidArgument(format!(
            "pipeline: {} names no blocks (Model::blocks), so there is nothing to cut into \
             stages; train it data-parallel instead",
            model.describe()
        )));
    }
    let costs = stage_costs(&specs, &blocks);
    let ranges = partition(method, &costs, p)?;
    // The trained parameters (the graph's); frozen weights go where they are read.
    let trained = specs.iter().filter(|s| !s.frozen).count();
    let mut param_stage = vec![None; trained];
    for (s, r) in ranges.iter().enumerate() {
        for b in r.clone() {
            for &i in &blocks[b] {
                param_stage[i] = Some(s);
            }
        }
    }
    let recorded = record(model, &specs, options)?;
    let parts = recorded.graph.split(&param_stage, p)?;
    let mut holders = vec![vec![]; trained];
    for (s, part) in parts.iter().enumerate() {
        for &i in &part.params {
            holders[i].push(s);
        }
    }
    Ok(Cut {
        specs,
        inputs: recorded.forward.inputs,
        parts,
        holders,
        ranges,
        blocks,
    })
}

/// The blocks `range` of `blocks` as positions in `part.params` (the stage plan's
/// parameter indices).
pub(super) fn local_blocks(
    part: &StageGraph,
    blocks: &[Vec<usize>],
    range: &std::ops::Range<usize>,
) -> Vec<Vec<usize>> {
    blocks[range.clone()]
        .iter()
        .map(|b| {
            b.iter()
                .map(|i| {
                    part.params
                        .iter()
                        .position(|p| p == i)
                        .expect("a stage holds its blocks' parameters")
                })
                .collect()
        })
        .collect()
}

/// Per stage, the bytes [`Pipeline::new`] allocates: each held parameter's five
/// buffers, and per activation slot its plan (as compiling would share its buffers,
/// over stand-ins) and its input buffers; and the gradients' bytes where the stage's
/// alike blocks share one set (ZeRO stage 2 over replicas).
///
/// [`Pipeline::new`]: super::pipeline::Pipeline::new
pub(super) fn stage_memory(
    specs: &[ParamSpec],
    parts: &[StageGraph],
    blocks: &[Vec<usize>],
    ranges: &[std::ops::Range<usize>],
    options: &NetworkOptions,
) -> Result<Vec<NetworkMemory>> {
    let act = options.dtype;
    let p = parts.len();
    let f = |n: usize| DType::F32.padded_bytes(n);
    // The initial values are drawn on the host for every parameter at once.
    let drawn: u64 = specs.iter().map(|s| f(s.len())).sum();
    let mut out = vec![];
    for (s, part) in parts.iter().enumerate() {
        let mut m = NetworkMemory::default();
        let mut ids = 0;
        let mut stand_in = |dtype: DType, len: usize| {
            ids += 1;
            Buffer {
                id: ids,
                dtype,
                len,
            }
        };
        let local_specs: Vec<ParamSpec> = part.params.iter().map(|&i| specs[i].clone()).collect();
        let sharing = shared_gradients(&local_specs, &local_blocks(part, blocks, &ranges[s]));
        let mut params = vec![];
        for (&i, shared) in part.params.iter().zip(&sharing) {
            let n = specs[i].len();
            let grad = if specs[i].f32_grad { DType::F32 } else { act };
            m.weights += act.padded_bytes(n);
            m.gradients += grad.padded_bytes(n);
            if shared.is_none() {
                m.shared_gradients += grad.padded_bytes(n);
            }
            m.gradient_tensors += (grad.size() * n) as u64;
            m.optimizer += 3 * f(n);
            m.largest_parameter_buffer = m.largest_parameter_buffer.max(f(n));
            let stateless = act.padded_bytes(n).max(grad.padded_bytes(n));
            m.largest_stateless_buffer = m.largest_stateless_buffer.max(stateless);
            params.push(ParamBuffers {
                value: stand_in(act, n),
                master: stand_in(DType::F32, n),
                grad: stand_in(grad, n),
                m: stand_in(DType::F32, n),
                v: stand_in(DType::F32, n),
            });
        }
        let g = &part.graph;
        let mut inputs = vec![];
        let mut input_bytes = 0;
        for t in g.inputs() {
            let (_, shape, dtype) = g.describe(t);
            let n: usize = shape.iter().product();
            input_bytes += dtype.padded_bytes(n);
            inputs.push((t, stand_in(dtype, n)));
        }
        // The frozen weights it reads, held once per stage device.
        for &(_, t) in &part.frozen {
            let (_, shape, dtype) = g.describe(t);
            let n: usize = shape.iter().product();
            m.frozen += dtype.padded_bytes(n);
            inputs.push((t, stand_in(dtype, n)));
        }
        let bindings = Bindings {
            params,
            inputs,
            groups: vec![],
        };
        let (mut largest, mut bound) = (0, 0);
        for k in 0..p - s {
            let plan = g.memory(&bindings, (k == 0).then_some(&options.optimizer))?;
            m.activations += plan.total() + input_bytes;
            largest = plan.largest.max(largest);
            bound = plan.largest_bound.max(bound);
        }
        m.largest_buffer = largest.max(m.largest_parameter_buffer);
        m.largest_plan_buffer = largest;
        m.largest_binding = bound;
        m.host = drawn.max(m.weights + m.optimizer);
        out.push(m);
    }
    Ok(out)
}

/// Parameters per block and outside them: those declared before the first block's
/// count for the first stage, the rest (and tied ones, read at both ends) the last.
pub(super) fn stage_costs(specs: &[ParamSpec], blocks: &[Vec<usize>]) -> StageCosts {
    let in_block: std::collections::HashSet<usize> = blocks.iter().flatten().copied().collect();
    let first = blocks.iter().flatten().copied().min().unwrap_or(0);
    let (mut embedding_params, mut head_params) = (0u64, 0u64);
    for (i, s) in specs.iter().enumerate() {
        // A frozen weight (LoRA's base) is no parameter a stage trains or holds state for.
        if in_block.contains(&i) || s.frozen {
            continue;
        }
        if i < first {
            embedding_params += s.len() as u64;
        }
        if i > first || s.tied.is_some() {
            head_params += s.len() as u64;
        }
    }
    StageCosts {
        block_params: blocks
            .iter()
            .map(|b| b.iter().map(|&i| specs[i].len() as u64).sum())
            .collect(),
        embedding_params,
        head_params,
    }
}

/// Compiles one activation slot of `part`: its own input buffers and intermediates,
/// the stage's parameters; the update only in the first slot.
pub(super) fn compile_slot(
    dev: &dyn Device,
    part: &StageGraph,
    (params, frozen): (&[ParamBuffers], &[Buffer]),
    options: &NetworkOptions,
    update: bool,
) -> Result<Slot> {
    let g = &part.graph;
    let alloc = |t: Tensor| -> Result<Buffer> {
        let (_, shape, dtype) = g.describe(t);
        dev.alloc(dtype, shape.iter().product())
    };
    let mut bound = vec![];
    let mut inputs = vec![];
    for &(_, l) in &part.inputs {
        let b = alloc(l)?;
        inputs.push(b);
        bound.push((l, b));
    }
    let mut acts_in = vec![];
    for a in &part.activations_in {
        let b = alloc(a.local)?;
        acts_in.push(b);
        bound.push((a.local, b));
    }
    let mut seeds = vec![];
    for a in &part.activations_out {
        seeds.push(match a.grad {
            Some(t) => {
                let b = alloc(t)?;
                bound.push((t, b));
                Some(b)
            }
            None => None,
        });
    }
    for (&(_, t), &b) in part.frozen.iter().zip(frozen) {
        bound.push((t, b));
    }
    let bindings = Bindings {
        params: params.to_vec(),
        inputs: bound,
        groups: vec![],
    };
    let plan = g.compile(dev, &bindings, update.then_some(&options.optimizer))?;
    Ok(Slot {
        plan,
        inputs,
        acts_in,
        seeds,
    })
}

/// A micro-batch's data for `stage`'s inputs, checked (count, lengths, dtypes, ids in
/// range) and converted to the inputs' dtypes; and the rows trained on.
pub(super) fn stage_data(stage: &Stage, batch: &MicroBatch) -> Result<(Vec<HostData>, usize)> {
    let g = &stage.part.graph;
    let mut data = vec![];
    for (&(_, l), &pos) in stage.part.inputs.iter().zip(&stage.input_pos) {
        let (name, shape, _) = g.describe(l);
        let filled;
        let given = match batch.0.get(pos) {
            Some(given) => given,
            // A packed model given rows without their documents, as `Network` takes them.
            None => {
                let missing = || {
                    Error::InvalidArgument(format!(
                        "a micro-batch holds {} inputs, but `{name}` is input {}",
                        batch.0.len(),
                        pos + 1
                    ))
                };
                let whole_rows = batch.0.len() == 2;
                filled = whole_rows
                    .then(|| one_document_per_row(name, shape))
                    .flatten()
                    .ok_or_else(missing)?;
                &filled
            }
        };
        data.push(batch_input(g, l, given)?);
    }
    let inputs: Vec<Tensor> = stage.part.inputs.iter().map(|&(_, l)| l).collect();
    check_ids(g, &inputs, &data)?;
    check_documents(g, &inputs, &data)?;
    let trained = match stage.targets.map(|k| &data[k]) {
        Some(HostData::U32(t)) => t.iter().filter(|&&x| x != IGNORE_TARGET).count(),
        _ => stage.loss_rows,
    };
    Ok((data, trained))
}
