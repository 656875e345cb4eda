//! A model on a device: its parameters in flat buffers per optimizer group, and one
//! compiled plan (forward, derived backward, overflow check, norm, update) replayed
//! every step. Everything here is the same for every [`Model`]; what a model is comes
//! only through the contract.
//!
//! A step is three phases, so a data-parallel group can put its exchange between them:
//! [`Network::accumulate`] (forward and backward over the micro-batches, gradients
//! summed), [`Network::check`] (overflow flag, norm, the step's loss) and
//! [`Network::update`] (the optimizer) or [`Network::apply`] (the optimizer with a
//! gradient factor the host decided). The loss scaler lives with the trainer, which
//! decides between the last two.

use std::borrow::Cow;
use std::cell::Cell;
use std::collections::HashSet;
use std::sync::Arc;

use super::{Forward, Init, Model, ParamSpec, MAX_PARAMETERS, MAX_TENSOR_ELEMENTS};
use crate::data;
use crate::device::host::HostTensor;
use crate::device::optim::ParamBuffers;
use crate::graph::{Bindings, Graph, Group, Loss, Plan, Tensor};
use crate::rng::SplitMix;
use crate::{
    Buffer, Capabilities, DType, Device, Error, HostData, Optimizer, Result, IGNORE_TARGET,
};

/// The data of one micro-batch: one host vector per input of the model's forward pass,
/// in [`Forward::inputs`] order. Float inputs may be given as f32 (rounded to the
/// input's dtype on upload).
#[derive(Clone, Debug, PartialEq)]
pub struct MicroBatch(pub Vec<HostData>);

impl MicroBatch {
    /// A language model's micro-batch: token ids and next-token targets.
    pub fn tokens(tokens: &[u32], targets: &[u32]) -> MicroBatch {
        MicroBatch(vec![
            HostData::U32(tokens.to_vec()),
            HostData::U32(targets.to_vec()),
        ])
    }

    /// A classifier's micro-batch: f32 features (row-major) and class ids.
    pub fn features(x: &[f32], classes: &[u32]) -> MicroBatch {
        MicroBatch(vec![
            HostData::F32(x.to_vec()),
            HostData::U32(classes.to_vec()),
        ])
    }
}

impl From<&data::Batch> for MicroBatch {
    fn from(b: &data::Batch) -> MicroBatch {
        MicroBatch::tokens(&b.tokens, &b.targets)
    }
}

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
}

/// Tensors in a flat buffer start on multiples of this many elements: a 256-byte
/// boundary ([`crate::device::VIEW_ALIGN`]) for 2- and 4-byte dtypes alike.
const ARENA_ALIGN: usize = 128;
/// Elements of one flat buffer at most: 128 MiB of f32, the per-binding size every
/// WebGPU adapter allows, so one launch can update a whole buffer anywhere.
const ARENA_ELEMS: usize = (128 << 20) / 4;

/// Where the parameters live: optimizer groups (same gradient dtype, same weight
/// decay) packed into flat buffers ("arenas"), each tensor a view at an aligned offset,
/// so one launch per arena updates, checks or measures every tensor in it.
struct ArenaLayout {
    /// Per arena: (f32 gradients, weight decay, elements).
    arenas: Vec<(bool, bool, usize)>,
    /// Per parameter: (arena, first element).
    places: Vec<(usize, usize)>,
}

fn arena_layout(specs: &[ParamSpec]) -> ArenaLayout {
    let mut arenas: Vec<(bool, bool, usize)> = vec![];
    let mut places = vec![];
    for spec in specs {
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
        places.push(place);
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
                    "ZeRO stage 2: blocks {i} and {j} of {what} write their gradients \
                     interleaved in backward, so they cannot share gradient buffers; use \
                     stage 1"
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

/// Device bytes a [`Network`] allocates, by what they hold.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct NetworkMemory {
    /// The model copy in the storage dtype.
    pub weights: u64,
    /// Gradients (storage dtype; f32 for embeddings and norms).
    pub gradients: u64,
    /// The gradients' bytes once alike blocks share one set (ZeRO stage 2, see
    /// [`Network::share_block_gradients`]): the first block's and those of the
    /// parameters outside blocks, each in a buffer of its own.
    pub shared_gradients: u64,
    /// The gradient tensors' own bytes (without the arenas' alignment gaps): what a
    /// data-parallel exchange moves per copy.
    pub gradient_tensors: u64,
    /// f32 master weights and the optimizer's two moments.
    pub optimizer: u64,
    /// The plan's buffers (activations saved for backward, their gradients and
    /// scratch, shared by liveness; losses, outputs, constants, small buffers) and the
    /// inputs.
    pub activations: u64,
    /// The largest single buffer: what must fit the adapter's largest buffer.
    pub largest_buffer: u64,
    /// The largest flat buffer of parameters (its f32 master weights or moments).
    pub largest_parameter_buffer: u64,
    /// The largest buffer a kernel binds whole ([`crate::Kernel::bound_whole`]; e.g. the
    /// embedding lookup binds its table): what must fit one kernel binding (GEMM
    /// operands, flat optimizer buffers and elementwise work over the limit are split).
    pub largest_binding: u64,
    /// Host bytes at the host's peak outside the devices: the model states' copy a
    /// checkpoint downloads, or the initial weights while they are drawn and uploaded,
    /// whichever is larger.
    pub host: u64,
}

impl NetworkMemory {
    pub fn total(&self) -> u64 {
        self.weights
            .saturating_add(self.gradients)
            .saturating_add(self.optimizer)
            .saturating_add(self.activations)
    }

    /// Refuses, before anything is allocated, a network that cannot fit: on each device
    /// (its largest buffer, per-binding limit and memory budget where the driver
    /// reports one) and on the host (`host_available` bytes: the initial weights and
    /// checkpoints live there, and so does the memory of a CPU adapter such as
    /// lavapipe, llvmpipe or the CPU backend). `what` names the model; `dtype` is the
    /// storage precision, for the advice. The error says what does not fit, by how
    /// much, and what would.
    pub fn check_fit(
        &self,
        what: &str,
        dtype: DType,
        devices: &[&Capabilities],
        host_available: Option<u64>,
    ) -> Result<()> {
        let params_kind = "a flat buffer of parameters: f32 master weights or moments";
        let kind = |bytes: u64| {
            if bytes <= self.largest_parameter_buffer {
                params_kind
            } else {
                "activations"
            }
        };
        let (mut over, mut params, mut activations, mut total) = (vec![], false, false, false);
        let mut seen = HashSet::new();
        for caps in devices {
            if !seen.insert((&caps.name, &caps.backend)) {
                continue;
            }
            let at = format!("`{}` ({})", caps.name, caps.backend);
            let big = if self.largest_buffer > caps.max_buffer {
                over.push(format!(
                    "its largest buffer, {} ({}), is over {at}'s largest buffer of {}",
                    human(self.largest_buffer),
                    kind(self.largest_buffer),
                    human(caps.max_buffer)
                ));
                Some(self.largest_buffer)
            } else if self.largest_binding > caps.max_storage_binding {
                over.push(format!(
                    "a kernel binds {} at once ({}), over {at}'s per-binding limit of {} \
                     (GEMMs, elementwise kernels and the optimizer split theirs; this \
                     one cannot)",
                    human(self.largest_binding),
                    if self.largest_binding <= self.largest_parameter_buffer {
                        "a parameter tensor"
                    } else {
                        "activations"
                    },
                    human(caps.max_storage_binding)
                ));
                Some(self.largest_binding)
            } else {
                None
            };
            match big {
                Some(b) if b <= self.largest_parameter_buffer => params = true,
                Some(_) => activations = true,
                None => {}
            }
            if let Some(budget) = caps.memory_budget.filter(|&b| self.total() > b) {
                over.push(format!(
                    "{} per device is over {at}'s memory budget of {}",
                    human(self.total()),
                    human(budget)
                ));
                total = true;
            }
        }
        let on_host = devices.iter().filter(|c| c.device_type == "cpu").count() as u64;
        let need = self
            .host
            .saturating_add(self.total().saturating_mul(on_host));
        if let Some(avail) = host_available.filter(|&a| need > a) {
            let devices = if on_host == 0 {
                String::new()
            } else {
                format!(
                    " + {on_host} × {} for the device(s) on a CPU adapter (lavapipe, \
                     llvmpipe and the CPU backend keep device memory in host memory)",
                    human(self.total())
                )
            };
            over.push(format!(
                "the host needs {}: {} for a checkpoint's copy of the model states{devices}, \
                 over the {} available",
                human(need),
                human(self.host),
                human(avail)
            ));
            total = true;
        }
        if over.is_empty() {
            return Ok(());
        }
        let mut fixes = vec![];
        if params {
            fixes.push(
                "a smaller largest parameter tensor (in a language model usually the \
                 embedding, vocab_size × n_embd, which the lookup binds whole in the \
                 storage precision: fp16 or bf16 halves it)",
            );
        }
        if total {
            fixes.push("a smaller model (n_layer, n_embd, vocab_size)");
        }
        let act_heavy = self.activations >= self.total() / 4;
        if activations || (total && act_heavy) {
            fixes.push(
                "a smaller micro-batch (train_micro_batch_size_per_gpu, with more \
                 gradient_accumulation_steps to keep the global batch) or a shorter sequence",
            );
        }
        if (activations || total) && dtype == DType::F32 {
            fixes.push(
                "fp16 or bf16 storage (halves weights, gradients and activations; the master \
                 weights and Adam moments stay f32)",
            );
        }
        if total && on_host > 1 {
            fixes
                .push("fewer devices on a CPU adapter (each keeps a whole replica in host memory)");
        }
        let zero = if total {
            " ZeRO stages 1 and 2 do not lower this peak: every device builds the whole \
             model state before its optimizer state is sharded."
        } else {
            ""
        };
        Err(Error::InvalidArgument(format!(
            "{what} does not fit, so nothing was allocated: it needs {} per device (weights \
             {}, gradients {}, f32 master + optimizer {}, activations {}; `kiln estimate` \
             shows them); {}. Try {}.{zero}",
            human(self.total()),
            human(self.weights),
            human(self.gradients),
            human(self.optimizer),
            human(self.activations),
            over.join("; "),
            fixes.join(", or ")
        )))
    }
}

/// Bytes as a person reads them (binary units).
fn human(bytes: u64) -> String {
    let units = ["bytes", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB"];
    let mut x = bytes as f64;
    let mut u = 0;
    while x >= 1024.0 && u + 1 < units.len() {
        x /= 1024.0;
        u += 1;
    }
    if u == 0 {
        format!("{bytes} bytes")
    } else {
        format!("{x:.1} {}", units[u])
    }
}

/// Memory the host can still give this process, when it says: Linux's MemAvailable,
/// lowered to the headroom under a cgroup v2 memory limit and under the process's
/// address-space limit (`ulimit -v`) where those are set. `None` elsewhere.
pub fn host_memory_available() -> Option<u64> {
    let read = |path: &str| std::fs::read_to_string(path).ok();
    // "Key:   123 kB" lines of /proc files, in bytes.
    let kib = |text: &str, key: &str| -> Option<u64> {
        let v = text.lines().find_map(|l| l.strip_prefix(key))?;
        let n: u64 = v.trim().strip_suffix("kB")?.trim().parse().ok()?;
        Some(n.saturating_mul(1024))
    };
    let mut avail = kib(&read("/proc/meminfo")?, "MemAvailable:")?;
    let number = |path: &str| read(path)?.trim().parse::<u64>().ok();
    if let (Some(max), Some(current)) = (
        number("/sys/fs/cgroup/memory.max"),
        number("/sys/fs/cgroup/memory.current"),
    ) {
        avail = avail.min(max.saturating_sub(current));
    }
    let limit = read("/proc/self/limits").and_then(|t| {
        let line = t.lines().find(|l| l.starts_with("Max address space"))?;
        line.split_whitespace().nth(3)?.parse::<u64>().ok()
    });
    let used = read("/proc/self/status").and_then(|t| kib(&t, "VmSize:"));
    if let (Some(limit), Some(used)) = (limit, used) {
        avail = avail.min(limit.saturating_sub(used));
    }
    Some(avail)
}

/// A device's bytes of model states, by what they hold (ZeRO's accounting).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct ModelStateBytes {
    pub weights: u64,
    pub gradients: u64,
    /// f32 master weights, optimizer moments and what updates them.
    pub optimizer: u64,
}

impl ModelStateBytes {
    pub fn total(&self) -> u64 {
        self.weights + self.gradients + self.optimizer
    }
}

/// One parameter's training state on the host: model copy (storage dtype, bit-exact),
/// f32 master and the optimizer's two moments (SGD uses `m` for momentum).
#[derive(Clone, Debug, PartialEq)]
pub struct ParamState {
    pub name: String,
    pub shape: Vec<usize>,
    pub value: HostData,
    pub master: Vec<f32>,
    pub m: Vec<f32>,
    pub v: Vec<f32>,
}

/// A parameter's name and its Adam first and second moments.
pub type Moments = (String, Vec<f32>, Vec<f32>);

/// Called with parameter indices whose gradients just became final.
pub type Ready<'a> = &'a mut dyn FnMut(&[usize]) -> Result<()>;

/// A named parameter: its buffers (model copy, master, gradient, moments).
struct Param {
    spec: ParamSpec,
    buffers: ParamBuffers,
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
    let mut params = vec![];
    for s in specs {
        let grad = if s.f32_grad { DType::F32 } else { act };
        params.push(g.param(&s.name, &s.shape, act, grad, s.decay)?);
    }
    let forward = model.forward(&mut g, &params, options.batch, act)?;
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
    let blocks = model.blocks();
    let mut seen = HashSet::new();
    for b in &blocks {
        for &p in b {
            if p >= specs.len() || !seen.insert(p) {
                return Err(Error::InvalidArgument(format!(
                    "{}: block parameter {p} is out of range ({} parameters) or in two blocks",
                    model.describe(),
                    specs.len()
                )));
            }
        }
    }
    Ok(())
}

/// Everything decided about a network before a device is touched.
struct Prepared {
    specs: Vec<ParamSpec>,
    recorded: Recorded,
    layout: ArenaLayout,
    memory: NetworkMemory,
}

/// Checks `model`'s sizes (before its per-layer tables are built), declares and checks
/// its parameters, records its graph and lays out and measures its buffers.
fn prepare(model: &dyn Model, options: &NetworkOptions) -> Result<Prepared> {
    model.check_sizes()?;
    let specs = model.parameters();
    check_specs(model, &specs)?;
    let recorded = record(model, &specs, options)?;
    let layout = arena_layout(&specs);
    let memory = measure(model, &specs, &recorded, &layout, options)?;
    Ok(Prepared {
        specs,
        recorded,
        layout,
        memory,
    })
}

/// What [`Network::new`] allocates, from the checked specs, the recorded graph and the
/// layout: the plan's buffers assigned as compiling would, over stand-in buffers.
fn measure(
    model: &dyn Model,
    specs: &[ParamSpec],
    recorded: &Recorded,
    layout: &ArenaLayout,
    options: &NetworkOptions,
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
    let params = specs
        .iter()
        .map(|s| buffers(grad_dtype(s.f32_grad), s.len()))
        .collect();
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
    let bindings = Bindings {
        params,
        inputs,
        groups,
    };
    let plan = g.memory(&bindings, Some(&options.optimizer))?;
    m.activations = plan.total() + input_bytes;
    m.largest_parameter_buffer = layout.arenas.iter().map(|a| f(a.2)).max().unwrap_or(0);
    m.largest_buffer = plan.largest.max(m.largest_parameter_buffer);
    m.largest_binding = plan.largest_bound;
    // The initial weights: every arena's f32 values at once, and while the largest is
    // uploaded its f32 copy and its rounded model copy. A checkpoint downloads the
    // model copy, master weights and moments.
    let largest = layout.arenas.iter().map(|a| a.2).max().unwrap_or(0);
    let drawn: u64 = layout.arenas.iter().map(|a| f(a.2)).sum();
    let init = drawn + f(largest) + a(largest);
    m.host = init.max(m.weights + m.optimizer);
    Ok(m)
}

/// A [`Model`] on a device, ready to train.
pub struct Network {
    model: Arc<dyn Model>,
    options: NetworkOptions,
    params: Vec<Param>,
    /// The flat buffers every parameter's buffers are views of: the optimizer's groups
    /// (one launch each updates, checks or measures every tensor in it).
    arenas: Vec<Group>,
    /// The forward pass as recorded, and its compiled step.
    recorded: Recorded,
    plan: Plan,
    /// One device buffer per input, in [`Forward::inputs`] order.
    inputs: Vec<Buffer>,
    /// Which input holds the cross-entropy targets (its trained rows weigh the loss).
    targets: Option<usize>,
    /// Rows of the loss (a regression loss weighs each 1 / rows).
    loss_rows: usize,
    step: u32,
    /// This network's first micro-batch in the global batch of a step (rank × micro-
    /// batches per rank): dropout masks follow the global index, so a data-parallel
    /// group draws what one device accumulating the same batch would.
    micro_offset: usize,
    /// Alike blocks write their gradients into the first block's buffers (ZeRO stage
    /// 2): each micro-batch's block gradients must be handed over before the next
    /// block runs.
    shared_block_grads: bool,
    /// Rows of the uploaded micro-batch that are trained on (targets that are not
    /// IGNORE_TARGET; every row for a regression loss).
    trained: Cell<usize>,
    /// Once the blocks share gradients: the gradient buffers that remain (the arenas'
    /// are freed).
    own_grads: Vec<Buffer>,
    /// Once the optimizer state is released: the empty buffer every master and moment
    /// names.
    released: Option<Buffer>,
}

impl Network {
    /// Builds `model` on `dev`: parameters initialised from `options.seed` in declared
    /// order, packed into flat buffers per optimizer group; the forward pass recorded
    /// for `options.batch` examples, its backward derived and the whole step compiled.
    pub fn new(
        dev: &dyn Device,
        model: Arc<dyn Model>,
        options: &NetworkOptions,
    ) -> Result<Network> {
        let Prepared {
            specs,
            recorded,
            layout,
            memory,
        } = prepare(model.as_ref(), options)?;
        // Before the first host vector or device buffer: a model that cannot fit is
        // refused with what it needs, not found out by an allocation that aborts.
        memory.check_fit(
            &model.describe(),
            options.dtype,
            &[dev.caps()],
            host_memory_available(),
        )?;
        let act = options.dtype;
        let mut rng = SplitMix(options.seed);
        // Initial values in model order (the draws do not depend on the layout), each
        // written at its place in its arena; the gaps stay zero for good.
        let mut inits: Vec<Vec<f32>> = layout.arenas.iter().map(|a| vec![0.0; a.2]).collect();
        for (spec, &(arena, at)) in specs.iter().zip(&layout.places) {
            draw_initial(spec, &mut rng, &mut inits[arena][at..at + spec.len()]);
        }
        let mut arenas = vec![];
        for (&(f32_grad, decay, _), init) in layout.arenas.iter().zip(&inits) {
            let grad = if f32_grad { DType::F32 } else { act };
            arenas.push(Group {
                buffers: ParamBuffers::new(dev, init, act, grad)?,
                decay,
            });
        }
        let mut params: Vec<Param> = vec![];
        for (spec, &(arena, at)) in specs.into_iter().zip(&layout.places) {
            let n = spec.len();
            let whole = &arenas[arena].buffers;
            let view = |b: Buffer| dev.view(b, at, n);
            params.push(Param {
                buffers: ParamBuffers {
                    value: view(whole.value)?,
                    master: view(whole.master)?,
                    grad: view(whole.grad)?,
                    m: view(whole.m)?,
                    v: view(whole.v)?,
                },
                spec,
            });
        }
        let g = &recorded.graph;
        let mut inputs = vec![];
        for &t in &recorded.forward.inputs {
            let (_, shape, dtype) = g.describe(t);
            inputs.push(dev.alloc(dtype, shape.iter().product())?);
        }
        let targets = match g.loss() {
            Some(Loss::CrossEntropy { targets }) => {
                recorded.forward.inputs.iter().position(|&i| i == targets)
            }
            _ => None,
        };
        let loss_rows = g.losses().map_or(0, |l| g.shape(l).iter().product());
        let bindings = Bindings {
            params: params.iter().map(|p| p.buffers).collect(),
            inputs: recorded
                .forward
                .inputs
                .iter()
                .copied()
                .zip(inputs.iter().copied())
                .collect(),
            groups: arenas.clone(),
        };
        let plan = g.compile(dev, &bindings, Some(&options.optimizer))?;
        Ok(Network {
            model,
            options: options.clone(),
            params,
            arenas,
            recorded,
            plan,
            inputs,
            targets,
            loss_rows,
            step: 0,
            micro_offset: 0,
            shared_block_grads: false,
            trained: Cell::new(0),
            own_grads: vec![],
            released: None,
        })
    }

    /// What [`Network::new`] allocates for `model` with `options`, computed without a
    /// device (tested equal to a device's allocator): the forward pass is recorded and
    /// the plan's buffers assigned as compiling would, over stand-in buffers.
    pub fn memory(model: &dyn Model, options: &NetworkOptions) -> Result<NetworkMemory> {
        Ok(prepare(model, options)?.memory)
    }

    /// [`Network::memory`] for a data-parallel group of one replica per device in
    /// `devs`, refused where it cannot fit (see [`NetworkMemory::check_fit`]): the
    /// replicas of devices that share the host's memory add up. [`Network::new`] checks
    /// one device; a group checks all of them before building the first.
    pub fn check_memory(
        model: &dyn Model,
        options: &NetworkOptions,
        devs: &[&dyn Device],
    ) -> Result<NetworkMemory> {
        let m = Network::memory(model, options)?;
        let caps: Vec<&Capabilities> = devs.iter().map(|d| d.caps()).collect();
        m.check_fit(
            &model.describe(),
            options.dtype,
            &caps,
            host_memory_available(),
        )?;
        Ok(m)
    }

    /// The model this network runs.
    pub fn model(&self) -> &Arc<dyn Model> {
        &self.model
    }

    pub fn options(&self) -> &NetworkOptions {
        &self.options
    }

    /// The recorded graph (forward pass and loss).
    pub fn graph(&self) -> &Graph {
        &self.recorded.graph
    }

    /// The device buffer of a graph output kept readable after a step (the prediction
    /// and the per-row losses always are; see [`Graph::output`]).
    pub fn output(&self, t: Tensor) -> Option<Buffer> {
        self.plan.buffer(t)
    }

    /// The prediction tensor (the logits) of the recorded forward pass.
    pub fn prediction(&self) -> Tensor {
        self.recorded.forward.prediction
    }

    /// Compiles the plan again after the buffers it binds changed: the blocks share
    /// gradients (no arenas' gradients to check: each parameter is its own group) or
    /// the optimizer state went (no update). The old plan's buffers are freed first.
    fn recompile(&mut self, dev: &dyn Device) -> Result<()> {
        let r = &self.recorded;
        let bindings = Bindings {
            params: self.params.iter().map(|p| p.buffers).collect(),
            inputs: r
                .forward
                .inputs
                .iter()
                .copied()
                .zip(self.inputs.iter().copied())
                .collect(),
            groups: if self.shared_block_grads {
                vec![]
            } else {
                self.arenas.clone()
            },
        };
        let optimizer = self.released.is_none().then_some(&self.options.optimizer);
        self.plan.free(dev)?;
        self.plan = r.graph.compile(dev, &bindings, optimizer)?;
        Ok(())
    }

    /// Checks a micro-batch against the inputs (count, dtypes, lengths, ids in range)
    /// and uploads it.
    fn upload(&self, dev: &dyn Device, batch: &MicroBatch) -> Result<()> {
        let g = &self.recorded.graph;
        let names = &self.recorded.forward.inputs;
        if batch.0.len() != names.len() {
            let list: Vec<&str> = names.iter().map(|&t| g.describe(t).0).collect();
            return Err(Error::InvalidArgument(format!(
                "a micro-batch of {} holds {} inputs ({}), got {}",
                self.model.describe(),
                names.len(),
                list.join(", "),
                batch.0.len()
            )));
        }
        let mut data = vec![];
        for (&t, given) in names.iter().zip(&batch.0) {
            data.push(batch_input(g, t, given)?);
        }
        check_ids(g, names, &data)?;
        let trained = match self.targets.map(|k| &data[k]) {
            Some(HostData::U32(t)) => t.iter().filter(|&&x| x != IGNORE_TARGET).count(),
            _ => self.loss_rows,
        };
        self.trained.set(trained);
        for (&buf, d) in self.inputs.iter().zip(&data) {
            dev.upload(buf, d)?;
        }
        Ok(())
    }

    /// 1 / the rows of the uploaded micro-batch that are trained on: the loss is their
    /// mean (ignored positions weigh nothing; a batch with none has loss 0).
    fn per_row(&self) -> f32 {
        1.0 / self.trained.get().max(1) as f32
    }

    /// Mean of the trained rows' losses, summed in f64 (finite differences need the
    /// digits).
    fn mean_loss(&self, dev: &dyn Device) -> Result<f64> {
        Ok(self.plan.loss_sum(dev)? / self.trained.get().max(1) as f64)
    }

    /// Mean loss of a micro-batch, no update (evaluation: dropout off).
    pub fn loss(&self, dev: &dyn Device, batch: &MicroBatch) -> Result<f64> {
        self.upload(dev, batch)?;
        self.plan.evaluate(dev)?;
        self.mean_loss(dev)
    }

    /// Forward and backward with loss scale 1; returns the loss. Gradients are left in
    /// the parameters' grad buffers (see [`Network::gradients`]).
    pub fn loss_and_gradients(&mut self, dev: &dyn Device, batch: &MicroBatch) -> Result<f64> {
        self.upload(dev, batch)?;
        self.plan.set_random_state(self.random_key(0));
        self.plan.accumulate(dev, 1.0, self.per_row(), 0)?;
        self.mean_loss(dev)
    }

    /// Mean loss of a micro-batch and the index of the largest prediction in every row
    /// of the prediction (a language model's next token at every position, a
    /// classifier's class): one forward pass, for evaluation.
    pub fn predict(&self, dev: &dyn Device, batch: &MicroBatch) -> Result<(f64, Vec<u32>)> {
        let loss = self.loss(dev, batch)?;
        let t = self.recorded.forward.prediction;
        let cols = *self.recorded.graph.shape(t).last().unwrap_or(&1);
        // A padded vocabulary's padding columns are no token: never predicted.
        let classes = self.recorded.graph.classes_of(t).clamp(1, cols.max(1));
        let buf = self
            .plan
            .buffer(t)
            .expect("the prediction is a graph output");
        let values = dev.download(buf)?.to_f32();
        Ok((loss, best_per_row(&values, cols, classes)))
    }

    /// (name, gradient) of every parameter, as f32.
    pub fn gradients(&self, dev: &dyn Device) -> Result<Vec<(String, Vec<f32>)>> {
        self.check_own_gradients()?;
        self.params
            .iter()
            .map(|p| Ok((p.spec.name.clone(), dev.download(p.buffers.grad)?.to_f32())))
            .collect()
    }

    /// Overwrites one parameter's model copy and f32 master from f32 values, as
    /// [`Network::set_weights`] writes them (the master the values, the model copy
    /// rounded once to nearest even), leaving the moments and step count alone and
    /// checking nothing else: a probe for tests (finite differences, injected faults).
    /// Setting a model's weights is [`Network::set_weights`].
    pub fn set_parameter(&self, dev: &dyn Device, index: usize, values: &[f32]) -> Result<()> {
        let n = self.param(index)?.spec.len();
        if values.len() != n {
            return Err(Error::LenMismatch {
                what: format!("values of parameter {index}"),
                expected: n,
                found: values.len(),
            });
        }
        let data = HostData::F32(values.to_vec());
        let (value, master) = weight_copies(&data, self.options.dtype);
        self.write_weights(dev, index, &value, Some(&master), false)
    }

    /// Sets every parameter from host tensors named as [`Model::parameters`] names them
    /// (a tied parameter also under its other name, e.g. GPT-2's `lm_head.weight`): the
    /// network is then as if built with these weights. Each parameter's f32 master is
    /// the given values widened exactly (an f16 file into an f16 model: the masters
    /// equal its values), its model copy the values as given when they are stored in
    /// the network's dtype, else the f32 values rounded once to nearest even; both
    /// optimizer moments are zeroed and the count of applied steps is 0 (Adam's bias
    /// correction and the schedule start again).
    ///
    /// All or nothing: every parameter must be given, once, with the model's shape, in
    /// f32, f16 or bf16, finite and within the storage dtype's range; names the model
    /// does not have are refused (a file with extra buffers is filtered by the caller,
    /// see `safetensors_io::read_where`). Everything is checked before the first byte
    /// is written, and each error names the tensor and what differs.
    ///
    /// A data-parallel group (every rank, every ZeRO stage) sets its weights with
    /// `Trainer::set_weights`; a network whose optimizer state a ZeRO group holds is
    /// refused here.
    pub fn set_weights(&mut self, dev: &dyn Device, weights: &[HostTensor]) -> Result<()> {
        if self.released.is_some() {
            return Err(Error::InvalidArgument(format!(
                "the optimizer state of this replica of {} is sharded across a ZeRO group; \
                 set the weights of the whole group with Trainer::set_weights",
                self.model.describe()
            )));
        }
        let matched = self.match_weights(weights)?;
        for (i, t) in matched.iter().enumerate() {
            let (value, master) = weight_copies(&t.data, self.options.dtype);
            self.write_weights(dev, i, &value, Some(&master), true)?;
        }
        self.step = 0;
        Ok(())
    }

    /// [`Network::set_weights`] from the safetensors file at `path` (see
    /// `safetensors_io::read`): a file [`Network::tensors`] was saved to, or any file
    /// holding exactly this model's tensors under its names. Errors name the file.
    pub fn load_weights(&mut self, dev: &dyn Device, path: &std::path::Path) -> Result<()> {
        let weights = crate::device::safetensors_io::read(path)?;
        self.set_weights(dev, &weights)
            .map_err(|e| in_file(path, e))
    }

    /// The given weights in parameter order, one per parameter, after every check
    /// [`Network::set_weights`] documents; nothing is written.
    pub(crate) fn match_weights<'a>(
        &self,
        weights: &'a [HostTensor],
    ) -> Result<Vec<&'a HostTensor>> {
        let what = self.model.describe();
        let mut index = std::collections::HashMap::new();
        for (i, p) in self.params.iter().enumerate() {
            index.insert(p.spec.name.as_str(), i);
            if let Some(alias) = &p.spec.tied {
                index.insert(alias.as_str(), i);
            }
        }
        let mut found: Vec<Option<&HostTensor>> = vec![None; self.params.len()];
        for t in weights {
            let Some(&i) = index.get(t.name.as_str()) else {
                let names: Vec<&str> = self
                    .params
                    .iter()
                    .take(3)
                    .map(|p| p.spec.name.as_str())
                    .collect();
                return Err(Error::InvalidArgument(format!(
                    "weights: `{}` is not a parameter of {what} (its {} parameters are named \
                     like `{}`); weights of another model or naming cannot be set",
                    t.name,
                    self.params.len(),
                    names.join("`, `")
                )));
            };
            let spec = &self.params[i].spec;
            if t.shape != spec.shape {
                return Err(Error::InvalidArgument(format!(
                    "weights: `{}` has shape {:?} but {what} has {:?} for it: the weights \
                     were made for a different model config",
                    t.name, t.shape, spec.shape
                )));
            }
            if t.data.len() != spec.len() {
                return Err(Error::InvalidArgument(format!(
                    "weights: `{}` has shape {:?} ({} elements) but holds {} values",
                    t.name,
                    t.shape,
                    spec.len(),
                    t.data.len()
                )));
            }
            if !t.data.dtype().is_float() {
                return Err(Error::InvalidArgument(format!(
                    "weights: `{}` is {}; weights must be f32, f16 or bf16",
                    t.name,
                    t.data.dtype()
                )));
            }
            if let Some(first) = found[i] {
                if first.name == t.name {
                    return Err(Error::InvalidArgument(format!(
                        "weights: `{}` is given twice",
                        t.name
                    )));
                }
                // A file may carry a tied tensor under both names; it is one tensor here.
                if let Some(e) = widened(&first.data)
                    .zip(widened(&t.data))
                    .position(|(a, b)| a.to_bits() != b.to_bits())
                {
                    return Err(Error::InvalidArgument(format!(
                        "weights: `{}` and `{}` are both given and differ (element {e}); \
                         {what} ties them into one tensor, so it can hold only one: give one \
                         of them (weights with an untied head do not fit a tied model)",
                        first.name, t.name
                    )));
                }
                continue;
            }
            check_range(t, self.options.dtype)?;
            found[i] = Some(t);
        }
        let missing: Vec<&str> = self
            .params
            .iter()
            .zip(&found)
            .filter(|(_, f)| f.is_none())
            .map(|(p, _)| p.spec.name.as_str())
            .collect();
        if !missing.is_empty() {
            let shown: Vec<&str> = missing.iter().take(5).copied().collect();
            return Err(Error::InvalidArgument(format!(
                "weights: {} of the {} parameters of {what} are missing: `{}`{}; every \
                 parameter must be given (the weights were made for a different model \
                 config, or the file is incomplete)",
                missing.len(),
                self.params.len(),
                shown.join("`, `"),
                if missing.len() > shown.len() {
                    ", …"
                } else {
                    ""
                }
            )));
        }
        Ok(found
            .into_iter()
            .map(|f| f.expect("checked above"))
            .collect())
    }

    /// Uploads parameter `index`'s model copy and, when given, its f32 master; with
    /// `reset` also zeroes its moments. The one writer of weights: what
    /// [`Network::set_parameter`], [`Network::set_weights`] and a group's
    /// `Trainer::set_weights` use.
    pub(crate) fn write_weights(
        &self,
        dev: &dyn Device,
        index: usize,
        value: &HostData,
        master: Option<&[f32]>,
        reset: bool,
    ) -> Result<()> {
        let b = &self.param(index)?.buffers;
        if let Some(master) = master {
            dev.upload(b.master, &HostData::F32(master.to_vec()))?;
        }
        if reset {
            let zeros = HostData::F32(vec![0.0; b.m.len]);
            dev.upload(b.m, &zeros)?;
            dev.upload(b.v, &zeros)?;
        }
        dev.upload(b.value, value)
    }

    fn param(&self, index: usize) -> Result<&Param> {
        self.params.get(index).ok_or_else(|| {
            Error::InvalidArgument(format!(
                "network: parameter {index} does not exist; {} has {}",
                self.model.describe(),
                self.params.len()
            ))
        })
    }

    /// (name, f32 master values) of every parameter.
    pub fn parameters(&self, dev: &dyn Device) -> Result<Vec<(String, Vec<f32>)>> {
        self.params
            .iter()
            .map(|p| {
                Ok((
                    p.spec.name.clone(),
                    dev.download(p.buffers.master)?.to_f32(),
                ))
            })
            .collect()
    }

    /// (name, Adam first moment, second moment) of every parameter.
    pub fn moments(&self, dev: &dyn Device) -> Result<Vec<Moments>> {
        self.params
            .iter()
            .map(|p| {
                Ok((
                    p.spec.name.clone(),
                    dev.download(p.buffers.m)?.to_f32(),
                    dev.download(p.buffers.v)?.to_f32(),
                ))
            })
            .collect()
    }

    /// Optimizer steps applied so far (skipped steps do not count; the LR schedule and
    /// Adam's bias correction follow this).
    pub fn steps_applied(&self) -> u32 {
        self.step
    }

    /// The model copies' buffers under their checkpoint names, for
    /// `safetensors_io::save`. Reading a file back is [`Network::load_weights`]:
    /// uploading into these buffers alone would leave the f32 masters behind.
    pub fn tensors(&self) -> Vec<crate::device::safetensors_io::NamedTensor> {
        self.params
            .iter()
            .map(|p| crate::device::safetensors_io::NamedTensor {
                name: p.spec.name.clone(),
                buffer: p.buffers.value,
                shape: p.spec.shape.clone(),
            })
            .collect()
    }

    /// Every parameter as declared.
    pub fn specs(&self) -> impl Iterator<Item = &ParamSpec> {
        self.params.iter().map(|p| &p.spec)
    }

    /// A step's first phase: forward and backward over the micro-batches at
    /// `loss_scale`, each micro-batch's mean loss weighing 1/n, so the grad buffers end
    /// up holding the scaled gradient of the step's mean loss. Submitted, not waited
    /// for: several devices can compute at once.
    pub fn accumulate(
        &mut self,
        dev: &dyn Device,
        micro: &[MicroBatch],
        loss_scale: f32,
    ) -> Result<()> {
        self.accumulate_hooked(dev, micro, loss_scale, None)
    }

    /// [`Network::accumulate`], calling `ready(params)` during the last micro-batch's
    /// backward as soon as those parameters' gradients are final and submitted: each
    /// block's (the model's [`Model::blocks`], in the order backward finishes them),
    /// then the parameters outside blocks. A data-parallel group starts exchanging them
    /// while the rest of backward runs. With [`Network::share_block_gradients`] every
    /// micro-batch's gradients are written afresh and handed over: the caller sums them.
    pub fn accumulate_with(
        &mut self,
        dev: &dyn Device,
        micro: &[MicroBatch],
        loss_scale: f32,
        ready: Ready<'_>,
    ) -> Result<()> {
        self.accumulate_hooked(dev, micro, loss_scale, Some(ready))
    }

    /// The groups [`Network::accumulate_with`] hands over: each block in two parts,
    /// then the parameters outside blocks. A block's first part is what its backward
    /// finishes first, up to at least half the block's elements (a GPT block's MLP);
    /// handing it over at once lets the exchange of that part overlap the rest of the
    /// block's backward, which matters most for the last block backward reaches: as a
    /// whole, its gradients could only be exchanged after backward (an eighth of an
    /// 8-layer GPT's). Two parts, not one per kernel: each part costs a submission.
    pub fn ready_groups(&self) -> Vec<Vec<usize>> {
        let len = |p: usize| self.params.get(p).map_or(0, |x| x.spec.len());
        let writes = |p: usize| self.plan.gradient_writes(p);
        hand_over_groups(self.model.blocks(), self.params.len(), &len, &writes)
    }

    fn accumulate_hooked(
        &mut self,
        dev: &dyn Device,
        micro: &[MicroBatch],
        loss_scale: f32,
        mut ready: Option<Ready<'_>>,
    ) -> Result<()> {
        if micro.is_empty() {
            return Err(Error::InvalidArgument(
                "network: a step needs at least one micro-batch".into(),
            ));
        }
        if self.shared_block_grads && ready.is_none() {
            return Err(Error::InvalidArgument(
                "network: the blocks share one set of gradient buffers (ZeRO stage 2), so \
                 each block's gradients must be handed over as they are made: use \
                 accumulate_with"
                    .into(),
            ));
        }
        let groups = self.ready_groups();
        let count = micro.len();
        for (i, batch) in micro.iter().enumerate() {
            self.upload(dev, batch)?;
            self.plan.set_random_state(self.random_key(i));
            let w = self.per_row() / count as f32;
            match &mut ready {
                Some(r) if self.shared_block_grads || i + 1 == count => {
                    self.plan
                        .accumulate_with(dev, (loss_scale, w, i), &groups, &mut **r)?
                }
                _ => self.plan.accumulate(dev, loss_scale, w, i)?,
            }
        }
        Ok(())
    }

    /// Places this network's micro-batches at `offset` in a step's global batch (a
    /// data-parallel rank's first); see [`Network::random_key`].
    pub fn set_micro_offset(&mut self, offset: usize) {
        self.micro_offset = offset;
    }

    /// The key dropout masks derive from for micro-batch `micro` of the step being
    /// taken: a function of the seed, the steps applied and the micro-batch's place in
    /// the global batch, so a resumed run draws the masks it would have drawn.
    pub fn random_key(&self, micro: usize) -> u64 {
        random_key(self.options.seed, self.step, self.micro_offset + micro)
    }

    /// After [`Network::accumulate`]: the overflow check over every gradient and the
    /// factor the update will multiply them by (unscaling, and clipping to global L2
    /// norm `clip` when above 0). Returns whether the gradients overflowed and the
    /// step's loss (waits for the device).
    pub fn check(&mut self, dev: &dyn Device, clip: f32) -> Result<(bool, f32)> {
        self.plan.check(dev, clip)?;
        let overflow = self.plan.overflowed(dev)?;
        Ok((overflow, self.plan.step_loss(dev)? as f32))
    }

    /// The optimizer step at learning rate `lr`, with the factor [`Network::check`]
    /// computed on the device.
    pub fn update(&mut self, dev: &dyn Device, lr: f32) -> Result<()> {
        self.plan.update(dev, lr, self.step + 1)?;
        self.step += 1;
        Ok(())
    }

    /// A step's last phase when the host has decided it (a data-parallel group: the
    /// overflow check, norm and scaler ran on the reduced gradients): applies the
    /// optimizer with every gradient multiplied by `grad_scale` (1 / (loss scale × clip
    /// factor)) at learning rate `lr`.
    pub fn apply(&mut self, dev: &dyn Device, lr: f32, grad_scale: f32) -> Result<()> {
        self.plan.apply(dev, lr, self.step + 1, grad_scale)?;
        self.step += 1;
        Ok(())
    }

    /// The factor the last step multiplied gradients by (1 / (loss scale * clip factor)).
    pub fn last_grad_scale(&self, dev: &dyn Device) -> Result<f32> {
        self.plan.grad_scale(dev)
    }

    /// Parameter `index`'s gradient as f32 (waits for the work that writes it).
    pub fn gradient(&self, dev: &dyn Device, index: usize) -> Result<Vec<f32>> {
        self.check_own_gradients()?;
        Ok(dev.download(self.param(index)?.buffers.grad)?.to_f32())
    }

    /// Overwrites parameter `index`'s gradient (rounded to its dtype).
    pub fn set_gradient(&self, dev: &dyn Device, index: usize, grad: &[f32]) -> Result<()> {
        self.check_own_gradients()?;
        let g = self.param(index)?.buffers.grad;
        dev.upload(g, &HostData::from_f32(g.dtype, grad))
    }

    /// Shared block gradients hold whichever block ran last: reading them as one
    /// parameter's gradient would be wrong without saying so.
    fn check_own_gradients(&self) -> Result<()> {
        if self.shared_block_grads {
            return Err(Error::InvalidArgument(
                "network: the blocks share one set of gradient buffers (ZeRO stage 2); a \
                 block's gradients exist only while accumulate_with hands them over"
                    .into(),
            ));
        }
        Ok(())
    }

    /// ZeRO stage 2's gradient partitioning on this replica: every block that looks
    /// like the model's first writes its gradients into the first block's buffers, and
    /// the arenas' gradients are freed, so a device holds one block's gradients (plus
    /// those outside blocks) instead of all of them. [`Network::accumulate_with`] then
    /// hands over each block's gradients of every micro-batch before the next block
    /// overwrites them (the copy to staging memory is queued in-stream ahead of that
    /// block's backward), and the group keeps only each rank's reduced shard. The plan
    /// is compiled again over the shared buffers; a model whose blocks' backward
    /// passes interleave cannot share and is refused.
    pub fn share_block_gradients(&mut self, dev: &dyn Device) -> Result<()> {
        if self.shared_block_grads {
            return Ok(());
        }
        let specs: Vec<ParamSpec> = self.params.iter().map(|p| p.spec.clone()).collect();
        let blocks = self.model.blocks();
        let sharing = shared_gradients(&specs, &blocks);
        // The blocks that share must write their gradients one after another.
        let writes = |p: usize| self.plan.gradient_writes(p);
        check_sharing(&blocks, &sharing, &writes, &self.model.describe())?;
        let mut grads = vec![];
        for (p, shared) in self.params.iter().zip(&sharing) {
            grads.push(match shared {
                Some(_) => None,
                None => Some(dev.alloc(p.buffers.grad.dtype, p.buffers.grad.len)?),
            });
        }
        for p in &self.params {
            dev.free(p.buffers.grad)?;
        }
        for a in &self.arenas {
            dev.free(a.buffers.grad)?;
        }
        for i in 0..self.params.len() {
            let g = match (grads[i], sharing[i]) {
                (Some(g), _) => g,
                (None, Some(q)) => grads[q].expect("the first block has its own"),
                (None, None) => unreachable!("a parameter either shares or owns"),
            };
            self.params[i].buffers.grad = g;
        }
        self.own_grads = grads.into_iter().flatten().collect();
        self.shared_block_grads = true;
        self.recompile(dev)
    }

    /// Parameter `index`'s gradient buffer (a data-parallel group downloads it from
    /// another thread while this network records the rest of backward).
    pub fn gradient_buffer(&self, index: usize) -> Buffer {
        self.params[index].buffers.grad
    }

    /// Elements of parameter `index`.
    pub fn parameter_len(&self, index: usize) -> usize {
        self.params[index].spec.len()
    }

    /// Ψ: parameter elements in all (a tied tensor once).
    pub fn parameter_count(&self) -> usize {
        self.params.iter().map(|p| p.spec.len()).sum()
    }

    /// Number of parameter tensors.
    pub fn parameter_tensors(&self) -> usize {
        self.params.len()
    }

    /// Mean loss of the micro-batches the last [`Network::accumulate`] ran (waits for
    /// them).
    pub fn accumulated_loss(&self, dev: &dyn Device) -> Result<f32> {
        Ok(self.plan.step_loss(dev)? as f32)
    }

    /// Device bytes of this replica's model states as allocated: model copy,
    /// gradients (shared ones once) and f32 master + moments (empty after
    /// [`Network::release_optimizer_state`]).
    pub fn model_state_bytes(&self) -> ModelStateBytes {
        let whole = |f: fn(&ParamBuffers) -> u64| -> u64 {
            self.arenas.iter().map(|a| f(&a.buffers)).sum()
        };
        ModelStateBytes {
            weights: whole(|b| b.value.bytes()),
            gradients: if self.shared_block_grads {
                self.own_grads.iter().map(|g| g.bytes()).sum()
            } else {
                whole(|b| b.grad.bytes())
            },
            optimizer: match self.released {
                Some(empty) => empty.bytes(),
                None => whole(|b| b.master.bytes() + b.m.bytes() + b.v.bytes()),
            },
        }
    }

    /// Bytes of all gradient buffers as stored on the device (shared ones once).
    pub fn gradient_bytes(&self) -> u64 {
        let mut seen = HashSet::new();
        self.params
            .iter()
            .filter(|p| seen.insert(p.buffers.grad.id))
            .map(|p| p.buffers.grad.bytes())
            .sum()
    }

    /// Every parameter's gradient as f32, in parameter order (waits for the device).
    pub fn gradient_values(&self, dev: &dyn Device) -> Result<Vec<Vec<f32>>> {
        self.check_own_gradients()?;
        self.params
            .iter()
            .map(|p| Ok(dev.download(p.buffers.grad)?.to_f32()))
            .collect()
    }

    /// Overwrites every gradient (rounded to the grad buffers' dtypes): how a
    /// data-parallel group hands back the gradients it reduced on the host.
    pub fn set_gradients(&self, dev: &dyn Device, grads: &[Vec<f32>]) -> Result<()> {
        if grads.len() != self.params.len() {
            return Err(Error::InvalidArgument(format!(
                "network: {} gradients for {} parameters",
                grads.len(),
                self.params.len()
            )));
        }
        self.check_own_gradients()?;
        for (p, g) in self.params.iter().zip(grads) {
            dev.upload(p.buffers.grad, &HostData::from_f32(p.buffers.grad.dtype, g))?;
        }
        Ok(())
    }

    /// Every parameter's full training state, for checkpoints.
    pub fn param_states(&self, dev: &dyn Device) -> Result<Vec<ParamState>> {
        self.params
            .iter()
            .map(|p| {
                let b = &p.buffers;
                Ok(ParamState {
                    name: p.spec.name.clone(),
                    shape: p.spec.shape.clone(),
                    value: dev.download(b.value)?,
                    master: dev.download(b.master)?.to_f32(),
                    m: dev.download(b.m)?.to_f32(),
                    v: dev.download(b.v)?.to_f32(),
                })
            })
            .collect()
    }

    /// Restores what [`Network::param_states`] saved. Every parameter must be present
    /// with its shape and the model's storage dtype: a checkpoint of another model or
    /// another precision is an error, never a partial load.
    pub fn load_param_states(&self, dev: &dyn Device, states: &[ParamState]) -> Result<()> {
        let what = self.model.describe();
        if states.len() != self.params.len() {
            return Err(Error::InvalidArgument(format!(
                "the checkpoint holds {} parameters but {what} has {}: it was saved from a \
                 different model config",
                states.len(),
                self.params.len()
            )));
        }
        for p in &self.params {
            let (spec, b) = (&p.spec, &p.buffers);
            let s = states
                .iter()
                .find(|s| s.name == spec.name || spec.tied.as_ref() == Some(&s.name))
                .ok_or_else(|| {
                    Error::InvalidArgument(format!(
                        "the checkpoint has no parameter `{}`: it was saved from a different \
                         model config than {what}",
                        spec.name
                    ))
                })?;
            if s.shape != spec.shape {
                return Err(Error::InvalidArgument(format!(
                    "`{}` has shape {:?} in the checkpoint but {:?} in {what}: the model \
                     config differs from the one the checkpoint was saved with",
                    spec.name, s.shape, spec.shape
                )));
            }
            if s.value.dtype() != b.value.dtype {
                return Err(Error::InvalidArgument(format!(
                    "`{}` is stored as {} in the checkpoint but this run trains in {}: resume \
                     with the precision the checkpoint was saved with",
                    spec.name,
                    s.value.dtype(),
                    b.value.dtype
                )));
            }
            let n = spec.len();
            for (what, len) in [
                ("value", s.value.len()),
                ("master", s.master.len()),
                ("exp_avg", s.m.len()),
                ("exp_avg_sq", s.v.len()),
            ] {
                if len != n {
                    return Err(Error::LenMismatch {
                        what: format!("checkpoint {what} of `{}`", spec.name),
                        expected: n,
                        found: len,
                    });
                }
            }
            dev.upload(b.value, &s.value)?;
            dev.upload(b.master, &HostData::F32(s.master.clone()))?;
            dev.upload(b.m, &HostData::F32(s.m.clone()))?;
            dev.upload(b.v, &HostData::F32(s.v.clone()))?;
        }
        Ok(())
    }

    /// Frees every parameter's f32 master and moments, for a ZeRO group whose ranks
    /// each keep only their shard of them (see `parallel::zero`); one empty buffer is
    /// left in their place, so an optimizer launch on them is a length error, never a
    /// silent no-op; the plan is compiled again without its update. Returns the master
    /// weights as they were (the shards' start).
    pub fn release_optimizer_state(&mut self, dev: &dyn Device) -> Result<Vec<Vec<f32>>> {
        if self.released.is_some() {
            return Err(Error::InvalidArgument(
                "network: the optimizer state was already released".into(),
            ));
        }
        let mut masters = vec![];
        let empty = dev.alloc(DType::F32, 0)?;
        for p in &mut self.params {
            let b = &mut p.buffers;
            masters.push(dev.download(b.master)?.to_f32());
            for x in [b.master, b.m, b.v] {
                dev.free(x)?;
            }
            (b.master, b.m, b.v) = (empty, empty, empty);
        }
        for a in &mut self.arenas {
            let b = &mut a.buffers;
            for x in [b.master, b.m, b.v] {
                dev.free(x)?;
            }
            (b.master, b.m, b.v) = (empty, empty, empty);
        }
        self.released = Some(empty);
        self.recompile(dev)?;
        Ok(masters)
    }

    /// (name, shape, storage dtype, weight decay applies) of every parameter, in order.
    pub fn parameter_layout(&self) -> Vec<(String, Vec<usize>, DType, bool)> {
        self.params
            .iter()
            .map(|p| {
                let s = &p.spec;
                (
                    s.name.clone(),
                    s.shape.clone(),
                    p.buffers.value.dtype,
                    s.decay,
                )
            })
            .collect()
    }

    /// Overwrites parameter `index`'s model copy (storage dtype, bit-exact): how a ZeRO
    /// group hands every rank the updated weights its shards produced. The model copy
    /// alone: the f32 master keeps its values and the next optimizer step writes the
    /// copy from it again, so this does not set a weight (that is
    /// [`Network::set_weights`]).
    pub fn set_value(&self, dev: &dyn Device, index: usize, data: &HostData) -> Result<()> {
        dev.upload(self.param(index)?.buffers.value, data)
    }

    /// Parameter `index`'s model copy as stored.
    pub fn value(&self, dev: &dyn Device, index: usize) -> Result<HostData> {
        dev.download(self.param(index)?.buffers.value)
    }

    /// Sets the count of applied optimizer steps (restoring a checkpoint).
    pub fn set_steps_applied(&mut self, steps: u32) {
        self.step = steps;
    }
}

/// A micro-batch's value for graph input `t`, checked against its shape and converted
/// to its dtype (f32 given for a 16-bit input is rounded once).
pub(crate) fn batch_input(g: &Graph, t: Tensor, given: &HostData) -> Result<HostData> {
    let (name, shape, dtype) = g.describe(t);
    let len: usize = shape.iter().product();
    if given.len() != len {
        return Err(Error::InvalidArgument(format!(
            "`{name}` of a micro-batch holds {len} values ({shape:?} {dtype}), got {}",
            given.len()
        )));
    }
    match (given, dtype.is_float()) {
        (HostData::F32(x), true) if dtype != DType::F32 => Ok(HostData::from_f32(dtype, x)),
        _ if given.dtype() == dtype => Ok(given.clone()),
        _ => Err(Error::DTypeMismatch {
            what: format!("`{name}` of a micro-batch"),
            expected: dtype,
            found: given.dtype(),
        }),
    }
}

/// Checks the token ids among `data` (the values of graph inputs `inputs`, in order)
/// against the graph's vocabulary limits. Checked on the host: on the device an
/// out-of-range id would quietly give NaN losses or skip every step. Targets may be
/// IGNORE_TARGET (not trained on). Limits of tensors not among `inputs` are skipped.
pub(crate) fn check_ids(g: &Graph, inputs: &[Tensor], data: &[HostData]) -> Result<()> {
    for (t, bound, what, ignore) in g.id_limits() {
        let Some(k) = inputs.iter().position(|&i| i == t) else {
            continue;
        };
        let HostData::U32(ids) = &data[k] else {
            continue;
        };
        let bad = ids
            .iter()
            .enumerate()
            .find(|&(_, &id)| id as usize >= bound && !(ignore && id == IGNORE_TARGET));
        if let Some((i, &id)) = bad {
            return Err(Error::InvalidArgument(format!(
                "{what} {id} at position {i} of `{}` is outside the vocabulary of {bound}",
                g.describe(t).0
            )));
        }
    }
    Ok(())
}

/// The key dropout masks derive from for micro-batch `micro` (its place in the global
/// batch) of the step after `steps` applied ones, for a network seeded `seed`.
pub(crate) fn random_key(seed: u64, steps: u32, micro: usize) -> u64 {
    let step = u64::from(steps).wrapping_mul(0xD1B5_4A32_D192_ED03);
    let at = (micro as u64).wrapping_mul(0x8CB9_2BA7_2F3D_8DD7);
    SplitMix(seed ^ step ^ at).next_u64()
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

/// The model copy (storage `dtype`) and f32 master one parameter's weights give: the
/// master is the values widened exactly to f32; the model copy is the values as given
/// when they are stored in `dtype` (no second rounding), else the master rounded once
/// to nearest even.
pub(crate) fn weight_copies(data: &HostData, dtype: DType) -> (Cow<'_, HostData>, Cow<'_, [f32]>) {
    let master: Cow<[f32]> = match data {
        HostData::F32(v) => Cow::Borrowed(v),
        other => Cow::Owned(other.to_f32()),
    };
    let value = if data.dtype() == dtype {
        Cow::Borrowed(data)
    } else {
        Cow::Owned(HostData::from_f32(dtype, &master))
    };
    (value, master)
}

/// The float elements of `data` widened to f32, without a copy of the whole tensor.
fn widened(data: &HostData) -> Box<dyn Iterator<Item = f32> + '_> {
    match data {
        HostData::F32(v) => Box::new(v.iter().copied()),
        HostData::F16(v) => Box::new(v.iter().map(|x| x.to_f32())),
        HostData::BF16(v) => Box::new(v.iter().map(|x| x.to_f32())),
        HostData::U32(v) => Box::new(v.iter().map(|&x| x as f32)),
    }
}

/// Refuses weights that cannot train: a value that is not finite, or one the model
/// copy's 16-bit dtype would round to infinity.
fn check_range(t: &HostTensor, dtype: DType) -> Result<()> {
    let limit = match dtype {
        DType::F16 => half::f16::MAX.to_f32(),
        DType::BF16 => half::bf16::MAX.to_f32(),
        _ => f32::MAX,
    };
    for (i, x) in widened(&t.data).enumerate() {
        if !x.is_finite() {
            return Err(Error::InvalidArgument(format!(
                "weights: element {i} of `{}` is {x}: weights must be finite (the file is \
                 damaged, or was saved from a run that diverged)",
                t.name
            )));
        }
        // Past the largest finite value by half an ulp or more rounds to infinity.
        let overflows = match dtype {
            DType::F16 => half::f16::from_f32(x).is_infinite(),
            DType::BF16 => half::bf16::from_f32(x).is_infinite(),
            _ => false,
        };
        if overflows {
            return Err(Error::InvalidArgument(format!(
                "weights: element {i} of `{}` is {x}, beyond {dtype}'s largest value {limit}, \
                 so the {dtype} model copy would be infinite: train these weights in bf16 or \
                 fp32",
                t.name
            )));
        }
    }
    Ok(())
}

/// An error of weights read from `path`, saying which file.
pub(crate) fn in_file(path: &std::path::Path, e: Error) -> Error {
    match e {
        Error::InvalidArgument(m) => Error::InvalidArgument(format!("`{}`: {m}", path.display())),
        other => other,
    }
}

/// The index of the largest of the first `classes` values in every row of `cols`
/// (a padded vocabulary's padding columns are never predicted).
pub(crate) fn best_per_row(values: &[f32], cols: usize, classes: usize) -> Vec<u32> {
    values
        .chunks_exact(cols.max(1))
        .map(|row| {
            let row = &row[..classes];
            // First maximum wins, so ties resolve the same way on every backend.
            let mut arg = 0;
            for (i, &x) in row.iter().enumerate() {
                if x > row[arg] {
                    arg = i;
                }
            }
            arg as u32
        })
        .collect()
}
