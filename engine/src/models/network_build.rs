//! A network decided before any device is touched: its options (`NetworkOptions`),
//! the model's parameter table checked (`check_specs`) and its forward pass recorded
//! (`record`), the parameters packed into flat buffers per optimizer group
//! (`ArenaLayout`), ZeRO stage 2's sharing of alike blocks' gradient buffers
//! (`shared_gradients`, `check_sharing`, `hand_over_groups`), the bytes all of it
//! allocates (`measure`) and the initial values (`draw_initial`). The pipeline builds
//! its stages from the same parts.

use std::collections::HashSet;

use super::network_memory::NetworkMemory;
use super::{Forward, Init, Model, ParamSpec, MAX_PARAMETERS, MAX_TENSOR_ELEMENTS};
use crate::device::optim::ParamBuffers;
use crate::graph::{Bindings, Graph, Group, Tensor};
use crate::rng::SplitMix;
use crate::{Buffer, DType, Error, Optimizer, Result};

/// How a network is built: its micro-batch, storage dtype, optimizer and seed.
#[derive(Clone, Debug)]
pub struct NetworkOptions {
    /// Examples per micro-batch (the graph's shapes are fixed at build time).
    pub batch: usize,
    /// Storage of weights, activations and most gradients: f32, f16 or bf16 (the
    /// master weights and moments are f32 whatever this is).
    pub dtype: DType,
    /// The optimizer and its base learning rate (a schedule may vary it per step);
    /// weight decay applies to the parameters declared `decay`.
    pub optimizer: Optimizer,
    /// Draws the initial weights (in parameter order).
    pub seed: u64,
    /// Rows pack several documents (training examples end to end): each micro-batch
    /// also gives every token's document start ([`MicroBatch::packed`]); attention stays
    /// within a document and positions restart at each (`graph/packing.rs`). A
    /// micro-batch without them is one document per row.
    ///
    /// [`MicroBatch::packed`]: super::MicroBatch::packed
    pub packed: bool,
}

/// Tensors in a flat buffer start on multiples of this many elements: a 256-byte
/// boundary ([`crate::device::VIEW_ALIGN`]) for 2- and 4-byte dtypes alike.
const ARENA_ALIGN: usize = 128;
/// Elements of one flat buffer at most: 128 MiB of f32, the per-binding size every
/// WebGPU adapter allows, so one launch can update a whole buffer anywhere.
const ARENA_ELEMS: usize = (128 << 20) / 4;

/// How a replica holds its model copy and gradients.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Partition {
    /// Every parameter's model copy and gradient in buffers of its own (stages 0 to
    /// 2; stage 2 shares gradients after building, see
    /// [`Network::share_block_gradients`]).
    ///
    /// [`Network::share_block_gradients`]: super::Network::share_block_gradients
    #[default]
    Whole,
    /// ZeRO stage 3: every block that looks like the model's first writes its
    /// gradients into the first block's buffers and reads its model copy from the
    /// first block's buffers, into which it is loaded from host memory before use;
    /// tensors of fewer than `persistence_threshold` elements (norms, biases) keep a
    /// model copy of their own on the device (DeepSpeed's
    /// `stage3_param_persistence_threshold`). Built without the optimizer state.
    Stage3 { persistence_threshold: usize },
}

/// Per parameter under `partition`: the first block's parameter whose buffers it
/// takes (gradient, and the model copy when streamed), and whether its model copy is
/// streamed from host memory (the first block's own included).
pub(crate) fn partition_sharing(
    specs: &[ParamSpec],
    blocks: &[Vec<usize>],
    partition: Partition,
) -> (Vec<Option<usize>>, Vec<bool>) {
    let Partition::Stage3 {
        persistence_threshold,
    } = partition
    else {
        return (vec![None; specs.len()], vec![false; specs.len()]);
    };
    let share = shared_gradients(specs, blocks);
    let mut streamed = vec![false; specs.len()];
    for (p, q) in share.iter().enumerate() {
        if let Some(q) = *q {
            if specs[p].len() >= persistence_threshold {
                streamed[p] = true;
                streamed[q] = true;
            }
        }
    }
    (share, streamed)
}

/// Where the parameters live: optimizer groups (same gradient dtype, same weight
/// decay) packed into flat buffers ("arenas"), each tensor a view at an aligned offset,
/// so one launch per arena updates, checks or measures every tensor in it.
pub(super) struct ArenaLayout {
    /// Per arena: (f32 gradients, weight decay, elements).
    pub(super) arenas: Vec<(bool, bool, usize)>,
    /// Per parameter: (arena, first element); `None` for one that takes the first
    /// block's buffers (ZeRO stage 3).
    pub(super) places: Vec<Option<(usize, usize)>>,
}

/// The arenas of `specs`, leaving out those `share` gives another's buffers.
fn arena_layout(specs: &[ParamSpec], share: &[Option<usize>]) -> ArenaLayout {
    let mut arenas: Vec<(bool, bool, usize)> = vec![];
    let mut places = vec![];
    for (spec, shared) in specs.iter().zip(share) {
        if shared.is_some() {
            places.push(None);
            continue;
        }
        let n = spec.len();
        let key = (spec.f32_grad, spec.decay);
        let open = arenas.iter().rposition(|a| (a.0, a.1) == key);
        let place = match open {
            Some(i) if arenas[i].2.next_multiple_of(ARENA_ALIGN) + n <= ARENA_ELEMS => {
                (i, arenas[i].2.next_multiple_of(ARENA_ALIGN))
            }
            // A new group, or the open arena is full (a tensor larger than a whole
            // arena gets one of its own).
            _ => {
                arenas.push((key.0, key.1, 0));
                (arenas.len() - 1, 0)
            }
        };
        arenas[place.0].2 = place.1 + n;
        places.push(Some(place));
    }
    ArenaLayout { arenas, places }
}

/// ZeRO stage 2's gradient sharing: per parameter, the parameter of the model's first
/// block whose gradient buffer it writes (`None`: a buffer of its own). Every block that
/// looks like the first (same shapes and gradient kinds in the same order) shares the
/// first block's buffers; other blocks and the parameters outside blocks keep their own.
pub(crate) fn shared_gradients(specs: &[ParamSpec], blocks: &[Vec<usize>]) -> Vec<Option<usize>> {
    let mut share = vec![None; specs.len()];
    let Some(first) = blocks.first() else {
        return share;
    };
    let look = |b: &Vec<usize>| -> Vec<(Vec<usize>, bool)> {
        b.iter()
            .map(|&i| (specs[i].shape.clone(), specs[i].f32_grad))
            .collect()
    };
    for b in &blocks[1..] {
        if look(b) == look(first) {
            for (&p, &q) in b.iter().zip(first) {
                share[p] = Some(q);
            }
        }
    }
    share
}

/// Refuses a `sharing` ([`shared_gradients`]) whose blocks write their gradients
/// interleaved in backward (`writes(p)`: the launches writing parameter `p`'s): a block
/// sharing another's buffers must be done with them before the other starts. `what`
/// names the model.
pub(crate) fn check_sharing(
    blocks: &[Vec<usize>],
    sharing: &[Option<usize>],
    writes: &dyn Fn(usize) -> std::ops::Range<usize>,
    what: &str,
) -> Result<()> {
    let span = |b: &Vec<usize>| {
        let r: Vec<_> = b.iter().map(|&p| writes(p)).collect();
        let lo = r.iter().map(|r| r.start).min().unwrap_or(0);
        let hi = r.iter().map(|r| r.end).max().unwrap_or(0);
        lo..hi
    };
    let sharers: Vec<(usize, std::ops::Range<usize>)> = blocks
        .iter()
        .enumerate()
        .filter(|(i, b)| *i == 0 || sharing[b[0]].is_some())
        .map(|(i, b)| (i, span(b)))
        .collect();
    for (k, (i, a)) in sharers.iter().enumerate() {
        for (j, b) in &sharers[k + 1..] {
            if a.start < b.end && b.start < a.end {
                return Err(Error::InvalidArgument(format!(
                    "ZeRO stage 2 and 3: blocks {i} and {j} of {what} write their \
                     gradients interleaved in backward, so they cannot share gradient \
                     buffers; use stage 1"
                )));
            }
        }
    }
    Ok(())
}

/// The groups of parameters handed over as backward finishes them: each of `blocks`
/// in two parts, then the `n` parameters' rest (outside blocks). `len(p)` is parameter
/// `p`'s elements, `writes(p)` the launches writing its gradient. See
/// [`Network::ready_groups`].
///
/// [`Network::ready_groups`]: super::Network::ready_groups
pub(crate) fn hand_over_groups(
    blocks: Vec<Vec<usize>>,
    n: usize,
    len: &dyn Fn(usize) -> usize,
    writes: &dyn Fn(usize) -> std::ops::Range<usize>,
) -> Vec<Vec<usize>> {
    // Marked in one pass: a search of every block per parameter grows with layers
    // squared, and this runs every step.
    let mut in_block = vec![false; n];
    for &p in blocks.iter().flatten() {
        if let Some(b) = in_block.get_mut(p) {
            *b = true;
        }
    }
    let mut groups = vec![];
    for mut block in blocks {
        // In the order backward finishes them; ties keep the declared order.
        block.sort_by_key(|&p| writes(p).end);
        let total: usize = block.iter().map(|&p| len(p)).sum();
        let (mut first, mut elems) = (0, 0);
        while first < block.len() && 2 * elems < total {
            elems += len(block[first]);
            first += 1;
        }
        // Parameters finished by the same launch stay together.
        let end = |k: usize| writes(block[k]).end;
        while first > 0 && first < block.len() && end(first) == end(first - 1) {
            first += 1;
        }
        let rest = block.split_off(first);
        groups.extend([block, rest].into_iter().filter(|g| !g.is_empty()));
    }
    let rest: Vec<usize> = (0..n).filter(|&p| !in_block[p]).collect();
    if !rest.is_empty() {
        groups.push(rest);
    }
    groups
}

/// The recorded graph of a model, with its parameters declared from the specs.
pub(crate) struct Recorded {
    pub(crate) graph: Graph,
    pub(crate) forward: Forward,
}

pub(crate) fn record(
    model: &dyn Model,
    specs: &[ParamSpec],
    options: &NetworkOptions,
) -> Result<Recorded> {
    let act = options.dtype;
    if !act.is_float() {
        return Err(Error::InvalidArgument(format!(
            "network: activations must be stored as f32, f16 or bf16, not {act}"
        )));
    }
    if options.batch == 0 {
        return Err(Error::InvalidArgument(
            "network: a micro-batch needs at least one example".into(),
        ));
    }
    let mut g = Graph::new();
    if options.packed {
        g.pack_documents()?;
    }
    let params = declare_params(&mut g, specs, act)?;
    let mut forward = model.forward(&mut g, &params, options.batch, act)?;
    forward.inputs.extend(
        g.packed_inputs()
            .map_err(|e| Error::InvalidArgument(format!("network: {}: {e}", model.describe())))?,
    );
    g.output(forward.prediction)?;
    let declared = g.inputs();
    let mut listed = forward.inputs.clone();
    listed.sort();
    if listed != declared {
        return Err(Error::InvalidArgument(format!(
            "network: {}'s forward pass declares {} inputs but lists {} in Forward::inputs; \
             list every Graph::input once, in the order micro-batches give them",
            model.describe(),
            declared.len(),
            forward.inputs.len()
        )));
    }
    Ok(Recorded { graph: g, forward })
}

/// Declares `specs` on `g` in order, stored in `act`, each gradient f32 where the spec
/// says so and in `act` otherwise: the tensors a model's forward receives.
pub(crate) fn declare_params(
    g: &mut Graph,
    specs: &[ParamSpec],
    act: DType,
) -> Result<Vec<Tensor>> {
    specs
        .iter()
        .map(|s| {
            let grad = if s.f32_grad { DType::F32 } else { act };
            match s.frozen {
                true => g.frozen(&s.name, &s.shape, act),
                false => g.param(&s.name, &s.shape, act, grad, s.decay),
            }
        })
        .collect()
}

/// Checks a model's parameter table before anything is recorded or allocated: every
/// shape's element count computed without overflow and within what a tensor may hold,
/// the total within [`MAX_PARAMETERS`], names unique, blocks in range.
pub(crate) fn check_specs(model: &dyn Model, specs: &[ParamSpec]) -> Result<()> {
    let mut names = HashSet::new();
    let mut total = 0usize;
    for s in specs {
        let n = s
            .checked_len()
            .filter(|&n| n <= MAX_TENSOR_ELEMENTS)
            .ok_or_else(|| {
                Error::InvalidArgument(format!(
                    "{}: parameter `{}` has shape {:?}, more than the {MAX_TENSOR_ELEMENTS} \
                     elements one tensor may hold (GPU kernels index elements with 32-bit \
                     integers); make the dimensions that give it smaller",
                    model.describe(),
                    s.name,
                    s.shape
                ))
            })?;
        if n == 0 {
            return Err(Error::InvalidArgument(format!(
                "{}: parameter `{}` has shape {:?}, no elements",
                model.describe(),
                s.name,
                s.shape
            )));
        }
        total = total
            .checked_add(n)
            .filter(|&t| t <= MAX_PARAMETERS)
            .ok_or_else(|| {
                Error::InvalidArgument(format!(
                    "{}: more than {MAX_PARAMETERS} parameter elements, past any device or \
                     host; make the model smaller",
                    model.describe()
                ))
            })?;
        for n in std::iter::once(&s.name).chain(&s.tied) {
            if !names.insert(n.clone()) {
                return Err(Error::InvalidArgument(format!(
                    "{}: two parameters are named `{n}`; names must be unique",
                    model.describe()
                )));
            }
        }
    }
    let trained = trained_count(specs);
    if let Some(s) = specs[trained..].iter().find(|s| !s.frozen) {
        return Err(Error::InvalidArgument(format!(
            "{}: parameter `{}` is trained but comes after a frozen one; list the frozen \
             parameters last",
            model.describe(),
            s.name
        )));
    }
    if trained == 0 {
        return Err(Error::InvalidArgument(format!(
            "{}: every parameter is frozen; there is nothing to train",
            model.describe()
        )));
    }
    let blocks = model.blocks();
    let mut seen = HashSet::new();
    for b in &blocks {
        for &p in b {
            if p >= trained || !seen.insert(p) {
                return Err(Error::InvalidArgument(format!(
                    "{}: block parameter {p} is out of range ({trained} trained parameters) \
                     or in two blocks",
                    model.describe(),
                )));
            }
        }
    }
    Ok(())
}

/// The trained parameters: those before the first frozen one.
pub(crate) fn trained_count(specs: &[ParamSpec]) -> usize {
    specs.iter().position(|s| s.frozen).unwrap_or(specs.len())
}

/// Everything decided about a network before a device is touched.
pub(super) struct Prepared {
    /// The trained parameters.
    pub(super) specs: Vec<ParamSpec>,
    /// The frozen ones, after them in the model's order.
    pub(super) frozen: Vec<ParamSpec>,
    pub(super) recorded: Recorded,
    pub(super) layout: ArenaLayout,
    pub(super) memory: NetworkMemory,
    /// See [`partition_sharing`].
    pub(super) share: Vec<Option<usize>>,
    pub(super) streamed: Vec<bool>,
}

/// Checks `model`'s sizes (before its per-layer tables are built), declares and checks
/// its parameters, records its graph and lays out and measures its buffers.
pub(super) fn prepare(
    model: &dyn Model,
    options: &NetworkOptions,
    partition: Partition,
) -> Result<Prepared> {
    model.check_sizes()?;
    let mut specs = model.parameters();
    check_specs(model, &specs)?;
    let recorded = record(model, &specs, options)?;
    let frozen = specs.split_off(trained_count(&specs));
    let (share, streamed) = partition_sharing(&specs, &model.blocks(), partition);
    let layout = arena_layout(&specs, &share);
    let stage3 = partition != Partition::Whole;
    let sharing = (&share[..], &streamed[..], stage3);
    let mut memory = measure(model, &specs, &recorded, &layout, options, sharing)?;
    memory.frozen = frozen
        .iter()
        .map(|s| options.dtype.padded_bytes(s.len()))
        .sum();
    let largest_frozen = frozen
        .iter()
        .map(|s| options.dtype.padded_bytes(s.len()))
        .max()
        .unwrap_or(0);
    memory.largest_buffer = memory.largest_buffer.max(largest_frozen);
    memory.largest_plan_buffer = memory.largest_plan_buffer.max(largest_frozen);
    Ok(Prepared {
        specs,
        frozen,
        recorded,
        layout,
        memory,
        share,
        streamed,
    })
}

/// What [`Network::new`] allocates, from the checked specs, the recorded graph and the
/// layout: the plan's buffers assigned as compiling would, over stand-in buffers.
///
/// [`Network::new`]: super::Network::new
fn measure(
    model: &dyn Model,
    specs: &[ParamSpec],
    recorded: &Recorded,
    layout: &ArenaLayout,
    options: &NetworkOptions,
    (share, streamed, stage3): (&[Option<usize>], &[bool], bool),
) -> Result<NetworkMemory> {
    let act = options.dtype;
    let f = |n: usize| DType::F32.padded_bytes(n);
    let a = |n: usize| act.padded_bytes(n);
    let mut m = NetworkMemory::default();
    for &(f32_grad, _, n) in &layout.arenas {
        m.weights += a(n);
        m.gradients += if f32_grad { f(n) } else { a(n) };
        m.optimizer += 3 * f(n);
    }
    let sharing = shared_gradients(specs, &model.blocks());
    for (p, shared) in specs.iter().zip(&sharing) {
        let grad = if p.f32_grad { f(p.len()) } else { a(p.len()) };
        m.gradient_tensors += grad;
        if shared.is_none() {
            m.shared_gradients += grad;
        }
    }
    // Stage 3: a sharing tensor below the persistence threshold keeps its model copy;
    // the streamed ones live in host memory, one copy for every replica.
    let mut loose = 0;
    let mut streamed_bytes = 0;
    for (i, p) in specs.iter().enumerate() {
        if share[i].is_some() && !streamed[i] {
            m.weights += a(p.len());
            loose = loose.max(a(p.len()));
        }
        if streamed[i] {
            streamed_bytes += act.size() as u64 * p.len() as u64;
        }
    }
    // Distinct ids of the right dtype and length are all planning needs.
    let mut ids = 0;
    let mut stand_in = |dtype: DType, len: usize| {
        ids += 1;
        Buffer {
            id: ids,
            dtype,
            len,
        }
    };
    let mut buffers = |grad: DType, n: usize| ParamBuffers {
        value: stand_in(act, n),
        master: stand_in(DType::F32, n),
        grad: stand_in(grad, n),
        m: stand_in(DType::F32, n),
        v: stand_in(DType::F32, n),
    };
    let grad_dtype = |f32_grad: bool| if f32_grad { DType::F32 } else { act };
    let mut params: Vec<ParamBuffers> = vec![];
    for (i, s) in specs.iter().enumerate() {
        let mut b = buffers(grad_dtype(s.f32_grad), s.len());
        if let Some(q) = share[i] {
            b.grad = params[q].grad;
            if streamed[i] {
                b.value = params[q].value;
            }
        }
        params.push(b);
    }
    let groups = layout
        .arenas
        .iter()
        .map(|&(f32_grad, decay, n)| Group {
            buffers: buffers(grad_dtype(f32_grad), n),
            decay,
        })
        .collect();
    let g = &recorded.graph;
    let mut input_bytes = 0u64;
    let mut inputs = vec![];
    for &t in &recorded.forward.inputs {
        let (name, shape, dtype) = g.describe(t);
        let n = super::tensor_elements(&format!("{}: input `{name}`", model.describe()), shape)?;
        input_bytes += dtype.padded_bytes(n);
        inputs.push((t, stand_in(dtype, n)));
    }
    // Frozen weights are bound as inputs are; their bytes count on their own.
    for t in g.frozen_weights() {
        let (_, shape, dtype) = g.describe(t);
        inputs.push((t, stand_in(dtype, shape.iter().product())));
    }
    // Stage 3 compiles as a ZeRO replica does: no update, each tensor its own group.
    let bindings = Bindings {
        params,
        inputs,
        groups: if stage3 { vec![] } else { groups },
    };
    let optimizer = (!stage3).then_some(&options.optimizer);
    let plan = g.memory(&bindings, optimizer)?;
    m.activations = plan.total() + input_bytes;
    m.largest_parameter_buffer = layout.arenas.iter().map(|a| f(a.2)).max().unwrap_or(0);
    m.largest_buffer = plan.largest.max(m.largest_parameter_buffer);
    m.largest_plan_buffer = plan.largest;
    m.largest_stateless_buffer = layout
        .arenas
        .iter()
        .map(|&(f32_grad, _, n)| a(n).max(if f32_grad { f(n) } else { a(n) }))
        .max()
        .unwrap_or(0);
    m.largest_binding = plan.largest_bound;
    m.largest_stateless_buffer = m.largest_stateless_buffer.max(loose);
    // The initial weights: every arena's f32 values at once, and while the largest is
    // uploaded its f32 copy and its rounded model copy. A checkpoint gathers every
    // trained tensor's model copy, master weights and moments (at stage 3 too, whose
    // layout holds one block's).
    let largest = layout.arenas.iter().map(|a| a.2).max().unwrap_or(0);
    let sharers: u64 = specs
        .iter()
        .zip(share)
        .filter(|(_, q)| q.is_some())
        .map(|(p, _)| f(p.len()))
        .sum();
    let drawn: u64 = layout.arenas.iter().map(|a| f(a.2)).sum::<u64>() + sharers;
    let init = drawn + f(largest) + a(largest);
    let checkpoint: u64 = specs.iter().map(|p| a(p.len()) + 3 * f(p.len())).sum();
    m.host = init.max(checkpoint) + streamed_bytes;
    m.build_host = init + streamed_bytes;
    m.streamed = streamed_bytes;
    Ok(m)
}

/// Draws one parameter's initial values into `place` (its elements), continuing
/// `rng`: parameters drawn in model order give every layout the same values.
pub(crate) fn draw_initial(spec: &ParamSpec, rng: &mut SplitMix, place: &mut [f32]) {
    match spec.init {
        Init::Const(x) => place.fill(x),
        Init::Uniform(s) => place
            .iter_mut()
            .for_each(|x| *x = rng.symmetric() * s * 3f32.sqrt()),
        // Both draws of each pair; scaled in f64 and rounded to f32 once.
        Init::Normal(s) => place.chunks_mut(2).for_each(|pair| {
            let (a, b) = rng.normal_pair();
            pair[0] = (a * s as f64) as f32;
            if let Some(x) = pair.get_mut(1) {
                *x = (b * s as f64) as f32;
            }
        }),
    }
}
