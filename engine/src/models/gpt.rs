//! A GPT-2 style model trained on a device: token + learned position embeddings, pre-LN
//! blocks with causal self-attention (fused attention kernels, or batched GEMMs and a
//! causal softmax: see [`Attention`]) and a GELU MLP, a final layer norm and an LM head
//! tied to the token embedding. Parameter names follow GPT-2's
//! (`transformer.h.0.attn.c_attn.weight`, …), weights stored (in, out) as GPT-2's
//! Conv1D does.
//!
//! The forward pass is written once, on the graph (`graph/gpt.rs`); backward, the
//! overflow check, the norm and the optimizer step are derived and compiled into one
//! plan, replayed every step. This file holds the parameter table, where the
//! parameters live (flat buffers per optimizer group), and the model the trainer
//! drives.
//!
//! Shapes: B batch, T sequence, C = n_embd, H heads, D = C / H, V vocabulary, BT = B*T.

use serde::Deserialize;

use crate::device::optim::{Optimizer, ParamBuffers};
use crate::graph::{Bindings, Group, Plan};
use crate::models::gpt_graph::{record, Recorded};
use crate::models::mlp::{Precision, SplitMix};
use crate::train::loss_scaler::{DynamicScaling, LossScaler};
use crate::train::safetensors_io::NamedTensor;
use crate::{Buffer, DType, Device, Error, HostData, Result, IGNORE_TARGET};

/// Model sizes, as in a GPT-2 config file.
#[derive(Clone, Debug, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct GptConfig {
    pub n_layer: usize,
    pub n_head: usize,
    pub n_embd: usize,
    pub block_size: usize,
    pub vocab_size: usize,
}

impl GptConfig {
    /// Ψ: the number of parameter elements (the LM head is tied to the embedding).
    pub fn parameter_count(&self) -> usize {
        let c = self.n_embd;
        (self.vocab_size + self.block_size) * c + self.n_layer * (12 * c * c + 13 * c) + 2 * c
    }
}

/// One parameter as [`Gpt::new`] creates it: the single list that the model, its
/// recorded forward pass, its memory estimate and every consumer of the layout read.
pub(crate) struct ParamSpec {
    pub name: String,
    pub shape: Vec<usize>,
    init: Init,
    /// Embeddings and norms keep f32 gradients (their kernels accumulate in f32); the
    /// rest use the storage dtype.
    pub f32_grad: bool,
    /// Weight decay applies (matrices only).
    pub decay: bool,
}

/// Every parameter, in model order: wte, wpe, 12 per block, ln_f weight and bias.
pub(crate) fn param_specs(config: &GptConfig) -> Vec<ParamSpec> {
    let (c, v) = (config.n_embd, config.vocab_size);
    let proj_std = 0.02 / (2.0 * config.n_layer as f32).sqrt();
    let spec = |name: String, shape: Vec<usize>, init, f32_grad, decay| ParamSpec {
        name,
        shape,
        init,
        f32_grad,
        decay,
    };
    let mut out = vec![
        spec(
            "transformer.wte.weight".into(),
            vec![v, c],
            Init::Std(0.02),
            true,
            false,
        ),
        spec(
            "transformer.wpe.weight".into(),
            vec![config.block_size, c],
            Init::Std(0.01),
            true,
            false,
        ),
    ];
    for l in 0..config.n_layer {
        let p = |s: &str| format!("transformer.h.{l}.{s}");
        out.extend([
            spec(p("ln_1.weight"), vec![c], Init::Const(1.0), true, false),
            spec(p("ln_1.bias"), vec![c], Init::Const(0.0), true, false),
            spec(
                p("attn.c_attn.weight"),
                vec![c, 3 * c],
                Init::Std(0.02),
                false,
                true,
            ),
            spec(
                p("attn.c_attn.bias"),
                vec![3 * c],
                Init::Const(0.0),
                false,
                false,
            ),
            spec(
                p("attn.c_proj.weight"),
                vec![c, c],
                Init::Std(proj_std),
                false,
                true,
            ),
            spec(
                p("attn.c_proj.bias"),
                vec![c],
                Init::Const(0.0),
                false,
                false,
            ),
            spec(p("ln_2.weight"), vec![c], Init::Const(1.0), true, false),
            spec(p("ln_2.bias"), vec![c], Init::Const(0.0), true, false),
            spec(
                p("mlp.c_fc.weight"),
                vec![c, 4 * c],
                Init::Std(0.02),
                false,
                true,
            ),
            spec(
                p("mlp.c_fc.bias"),
                vec![4 * c],
                Init::Const(0.0),
                false,
                false,
            ),
            spec(
                p("mlp.c_proj.weight"),
                vec![4 * c, c],
                Init::Std(proj_std),
                false,
                true,
            ),
            spec(
                p("mlp.c_proj.bias"),
                vec![c],
                Init::Const(0.0),
                false,
                false,
            ),
        ]);
    }
    out.extend([
        spec(
            "transformer.ln_f.weight".into(),
            vec![c],
            Init::Const(1.0),
            true,
            false,
        ),
        spec(
            "transformer.ln_f.bias".into(),
            vec![c],
            Init::Const(0.0),
            true,
            false,
        ),
    ]);
    out
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
        let n: usize = spec.shape.iter().product();
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

/// Device bytes a [`Gpt`] allocates, by what they hold.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct GptMemory {
    /// The model copy in the storage dtype.
    pub weights: u64,
    /// Gradients (storage dtype; f32 for embeddings and norms).
    pub gradients: u64,
    /// The gradients' bytes once the blocks share one set (ZeRO stage 2, see
    /// [`Gpt::share_block_gradients`]): the embeddings', the final norm's and one
    /// block's, each in a buffer of its own.
    pub shared_gradients: u64,
    /// The gradient tensors' own bytes (without the arenas' alignment gaps): what a
    /// data-parallel exchange moves per copy.
    pub gradient_tensors: u64,
    /// f32 master weights and the optimizer's two moments.
    pub optimizer: u64,
    /// The plan's buffers (activations saved for backward, their gradients and
    /// scratch, shared by liveness; losses, logits, constants, small buffers) and the
    /// inputs.
    pub activations: u64,
}

impl GptMemory {
    pub fn total(&self) -> u64 {
        self.weights + self.gradients + self.optimizer + self.activations
    }

    /// What [`Gpt::new`] allocates for `config` at `batch` × `seq` in `precision` with
    /// `attention`, computed without a device (tested equal to a device's allocator):
    /// the forward pass is recorded and the plan's buffers assigned as compiling
    /// would, over stand-in buffers.
    pub fn of(
        config: &GptConfig,
        batch: usize,
        seq: usize,
        precision: Precision,
        attention: Attention,
    ) -> Result<GptMemory> {
        let training = GptTraining {
            batch,
            seq,
            precision,
            optimizer: Optimizer::adamw(1e-3, 0.0),
            seed: 0,
            attention,
        };
        check(config, &training)?;
        let act = precision.dtype();
        let f = |n: usize| DType::F32.padded_bytes(n);
        let a = |n: usize| act.padded_bytes(n);
        let mut m = GptMemory::default();
        let specs = param_specs(config);
        let layout = arena_layout(&specs);
        for &(f32_grad, _, n) in &layout.arenas {
            m.weights += a(n);
            m.gradients += if f32_grad { f(n) } else { a(n) };
            m.optimizer += 3 * f(n);
        }
        for p in &specs {
            let n: usize = p.shape.iter().product();
            let grad = if p.f32_grad { f(n) } else { a(n) };
            m.gradient_tensors += grad;
            if !p.name.starts_with("transformer.h.") || p.name.starts_with("transformer.h.0.") {
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
            .map(|s| buffers(grad_dtype(s.f32_grad), s.shape.iter().product()))
            .collect();
        let groups = layout
            .arenas
            .iter()
            .map(|&(f32_grad, decay, n)| Group {
                buffers: buffers(grad_dtype(f32_grad), n),
                decay,
            })
            .collect();
        let model = record(config, &training, &specs)?;
        let bt = batch * seq;
        let inputs = [model.tokens, model.targets, model.positions]
            .into_iter()
            .map(|t| (t, stand_in(DType::U32, bt)))
            .collect();
        let bindings = Bindings {
            params,
            inputs,
            groups,
        };
        let plan = model.graph.memory(&bindings, Some(&training.optimizer))?;
        m.activations = plan.total() + 3 * DType::U32.padded_bytes(bt);
        Ok(m)
    }
}

/// Checks a model's sizes before anything is recorded or allocated.
fn check(config: &GptConfig, training: &GptTraining) -> Result<()> {
    let (c, h, v) = (config.n_embd, config.n_head, config.vocab_size);
    let (b, t) = (training.batch, training.seq);
    if h == 0 || c % h != 0 || c % 2 != 0 {
        return Err(Error::InvalidArgument(format!(
            "gpt: n_embd {c} must be even and divisible by n_head {h}"
        )));
    }
    if t == 0 || t > config.block_size || b == 0 || v == 0 || config.n_layer == 0 {
        return Err(Error::InvalidArgument(format!(
            "gpt: need 1 <= seq ({t}) <= block_size ({}), batch >= 1, vocab >= 1, n_layer >= 1",
            config.block_size
        )));
    }
    if training.attention == Attention::Fused && !Attention::fused_takes(c / h, training.precision)
    {
        // The kernels' own checks, stated in the model's terms before allocating.
        return Err(Error::InvalidArgument(format!(
            "gpt: fused attention takes head dims up to {} (even in fp16/bf16), not \
             n_embd / n_head = {}; use Attention::Straightforward",
            crate::ATTENTION_MAX_DIM,
            c / h
        )));
    }
    Ok(())
}

#[derive(Clone, Debug)]
pub struct GptTraining {
    pub batch: usize,
    pub seq: usize,
    pub precision: Precision,
    /// The optimizer and its base learning rate (a schedule may vary it per step, see
    /// [`Gpt::step`]); weight decay applies to matrices only.
    pub optimizer: Optimizer,
    pub seed: u64,
    /// How self-attention is computed (default: fused kernels).
    pub attention: Attention,
}

/// Sequences shorter than this use the straightforward attention by default.
pub const SHORTEST_FUSED: usize = 32;

/// How the blocks compute causal self-attention. Both give the same results up to f32
/// rounding (tests/attention.rs).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Attention {
    /// [`Kernel::Attention`] and [`Kernel::AttentionBackward`]: tile by tile, memory
    /// linear in T (saves one f32 log-sum-exp per row).
    #[default]
    Fused,
    /// Batched GEMMs through a (B*H, T, T) score matrix and a causal softmax; memory
    /// quadratic in T. Head dims over [`crate::ATTENTION_MAX_DIM`] need it.
    Straightforward,
}

impl Attention {
    /// Whether the fused kernels take heads of `head_dim` in `precision` (at most
    /// [`crate::ATTENTION_MAX_DIM`], and even when activations are 16-bit).
    pub fn fused_takes(head_dim: usize, precision: Precision) -> bool {
        head_dim <= crate::ATTENTION_MAX_DIM
            && (precision.dtype().size() == 4 || head_dim.is_multiple_of(2))
    }

    /// Fused where the kernels take the heads and the sequence is long enough for
    /// tiles to pay, else straightforward: at T = 9 (the demo) the T×T scores are a few
    /// hundred bytes a head and the batched GEMMs beat the fused kernels (measured:
    /// the 600-step demo took 68 s fused, 59 s straightforward); from T = 128 up the
    /// fused version is 2-4x faster (`kiln bench attention`).
    pub fn best(head_dim: usize, precision: Precision, seq: usize) -> Attention {
        if seq >= SHORTEST_FUSED && Attention::fused_takes(head_dim, precision) {
            Attention::Fused
        } else {
            Attention::Straightforward
        }
    }
}

/// A named parameter: its buffers (model copy, master, gradient, moments) and whether
/// weight decay applies (matrices) or not (biases, norms, embeddings).
struct Param {
    name: String,
    shape: Vec<usize>,
    buffers: ParamBuffers,
    decay: bool,
}

impl std::ops::Deref for Param {
    type Target = ParamBuffers;
    fn deref(&self) -> &ParamBuffers {
        &self.buffers
    }
}

/// GPT-2 on a device: its parameters in flat buffers per optimizer group, and one
/// compiled plan (forward, derived backward, overflow check, norm, update) replayed
/// every step.
pub struct Gpt {
    pub config: GptConfig,
    pub training: GptTraining,
    params: Vec<Param>,
    /// The flat buffers every parameter's buffers are views of: the optimizer's groups
    /// (one launch each updates, checks or measures every tensor in it).
    arenas: Vec<Group>,
    /// The forward pass as recorded, and its compiled step.
    model: Recorded,
    plan: Plan,
    tokens: Buffer,
    targets: Buffer,
    positions: Buffer,
    pub scaler: LossScaler,
    step: u32,
    /// Every block writes its gradients into block 0's buffers (ZeRO stage 2): each
    /// micro-batch's block gradients must be handed over before the next block runs.
    shared_block_grads: bool,
    /// Targets of the uploaded batch that are trained on (not IGNORE_TARGET).
    trained: std::cell::Cell<usize>,
    /// Once the blocks share gradients: the gradient buffers that remain (the arenas'
    /// are freed).
    own_grads: Vec<Buffer>,
    /// Once the optimizer state is released: the empty buffer every master and moment
    /// names.
    released: Option<Buffer>,
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

/// One training step's numbers.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct GptStep {
    pub loss: f32,
    pub skipped: bool,
    pub scale: f32,
}

impl Gpt {
    pub fn new(dev: &dyn Device, config: GptConfig, training: GptTraining) -> Result<Gpt> {
        check(&config, &training)?;
        let act = training.precision.dtype();
        let (b, t) = (training.batch, training.seq);
        let bt = b * t;
        let mut rng = SplitMix(training.seed);
        let specs = param_specs(&config);
        let layout = arena_layout(&specs);
        let model = record(&config, &training, &specs)?;
        // Initial values in model order (the draws do not depend on the layout), each
        // written at its place in its arena; the gaps stay zero for good.
        let mut inits: Vec<Vec<f32>> = layout.arenas.iter().map(|a| vec![0.0; a.2]).collect();
        for (spec, &(arena, at)) in specs.iter().zip(&layout.places) {
            let n: usize = spec.shape.iter().product();
            let place = &mut inits[arena][at..at + n];
            match spec.init {
                Init::Const(x) => place.fill(x),
                // Uniform with the given standard deviation (GPT-2 uses normal 0.02).
                Init::Std(s) => place
                    .iter_mut()
                    .for_each(|x| *x = rng.symmetric() * s * 3f32.sqrt()),
            }
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
            let n: usize = spec.shape.iter().product();
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
                name: spec.name,
                shape: spec.shape,
                decay: spec.decay,
            });
        }
        let positions = dev.alloc(DType::U32, bt)?;
        dev.upload(
            positions,
            &HostData::U32((0..bt).map(|i| (i % t) as u32).collect()),
        )?;
        let (tokens, targets) = (dev.alloc(DType::U32, bt)?, dev.alloc(DType::U32, bt)?);
        let scaler = match training.precision {
            Precision::F16 => LossScaler::dynamic(DynamicScaling::default())?,
            _ => LossScaler::fixed(1.0)?,
        };
        let bindings = Bindings {
            params: params.iter().map(|p| p.buffers).collect(),
            inputs: vec![
                (model.tokens, tokens),
                (model.targets, targets),
                (model.positions, positions),
            ],
            groups: arenas.clone(),
        };
        let plan = model
            .graph
            .compile(dev, &bindings, Some(&training.optimizer))?;
        Ok(Gpt {
            params,
            arenas,
            model,
            plan,
            tokens,
            targets,
            positions,
            scaler,
            step: 0,
            shared_block_grads: false,
            trained: std::cell::Cell::new(0),
            own_grads: vec![],
            released: None,
            config,
            training,
        })
    }

    /// Compiles the plan again after the buffers it binds changed: the blocks share
    /// gradients (no arenas' gradients to check: each parameter is its own group) or
    /// the optimizer state went (no update). The old plan's buffers are freed first.
    fn recompile(&mut self, dev: &dyn Device) -> Result<()> {
        let bindings = Bindings {
            params: self.params.iter().map(|p| p.buffers).collect(),
            inputs: vec![
                (self.model.tokens, self.tokens),
                (self.model.targets, self.targets),
                (self.model.positions, self.positions),
            ],
            groups: if self.shared_block_grads {
                vec![]
            } else {
                self.arenas.clone()
            },
        };
        let optimizer = self.released.is_none().then_some(&self.training.optimizer);
        self.plan.free(dev)?;
        self.plan = self.model.graph.compile(dev, &bindings, optimizer)?;
        Ok(())
    }

    fn upload(&self, dev: &dyn Device, tokens: &[u32], targets: &[u32]) -> Result<()> {
        let (bt, v) = (
            self.training.batch * self.training.seq,
            self.config.vocab_size,
        );
        if tokens.len() != bt || targets.len() != bt {
            return Err(Error::InvalidArgument(format!(
                "gpt: a batch is {} x {} = {bt} tokens and as many targets, got {} and {}",
                self.training.batch,
                self.training.seq,
                tokens.len(),
                targets.len()
            )));
        }
        // Checked here: on the device an out-of-range id would quietly give NaN losses
        // or skip every step. Targets may be IGNORE_TARGET (not trained on).
        if let Some((i, &t)) = tokens
            .iter()
            .chain(targets)
            .enumerate()
            .find(|&(i, &t)| t as usize >= v && !(i >= bt && t == IGNORE_TARGET))
        {
            let which = if i < bt { "token" } else { "target" };
            return Err(Error::InvalidArgument(format!(
                "gpt: {which} {t} at position {} is outside the vocabulary of {v}",
                i % bt
            )));
        }
        self.trained
            .set(targets.iter().filter(|&&t| t != IGNORE_TARGET).count());
        dev.upload(self.tokens, &HostData::U32(tokens.to_vec()))?;
        dev.upload(self.targets, &HostData::U32(targets.to_vec()))
    }

    /// 1 / the number of trained targets of the uploaded batch: the batch's loss is the
    /// mean over them (ignored positions weigh nothing; a batch with none has loss 0).
    fn per_target(&self) -> f32 {
        1.0 / self.trained.get().max(1) as f32
    }

    /// Mean of the trained positions' losses, summed in f64 (finite differences need
    /// the digits).
    fn mean_loss(&self, dev: &dyn Device) -> Result<f64> {
        Ok(self.plan.loss_sum(dev)? / self.trained.get().max(1) as f64)
    }

    /// Mean loss of a batch (B*T tokens and next-token targets), no update.
    pub fn loss(&self, dev: &dyn Device, tokens: &[u32], targets: &[u32]) -> Result<f64> {
        self.upload(dev, tokens, targets)?;
        self.plan.forward(dev)?;
        self.mean_loss(dev)
    }

    /// Forward and backward with loss scale 1; returns the loss. Gradients are left in
    /// the parameters' grad buffers (see `gradients`).
    pub fn loss_and_gradients(
        &mut self,
        dev: &dyn Device,
        tokens: &[u32],
        targets: &[u32],
    ) -> Result<f64> {
        self.upload(dev, tokens, targets)?;
        self.plan.accumulate(dev, 1.0, self.per_target(), 0)?;
        self.mean_loss(dev)
    }

    /// (name, gradient) of every parameter, as f32.
    pub fn gradients(&self, dev: &dyn Device) -> Result<Vec<(String, Vec<f32>)>> {
        self.params
            .iter()
            .map(|p| Ok((p.name.clone(), dev.download(p.grad)?.to_f32())))
            .collect()
    }

    /// Overwrites one parameter (value and master) from f32 values.
    pub fn set_parameter(&self, dev: &dyn Device, index: usize, values: &[f32]) -> Result<()> {
        let p = self.param(index)?;
        dev.upload(p.master, &HostData::F32(values.to_vec()))?;
        dev.upload(p.value, &HostData::from_f32(p.value.dtype, values))
    }

    fn param(&self, index: usize) -> Result<&Param> {
        self.params.get(index).ok_or_else(|| {
            Error::InvalidArgument(format!(
                "gpt: parameter {index} does not exist; the model has {}",
                self.params.len()
            ))
        })
    }

    /// (name, f32 master values) of every parameter.
    pub fn parameters(&self, dev: &dyn Device) -> Result<Vec<(String, Vec<f32>)>> {
        self.params
            .iter()
            .map(|p| Ok((p.name.clone(), dev.download(p.master)?.to_f32())))
            .collect()
    }

    /// (name, Adam first moment, second moment) of every parameter.
    pub fn moments(&self, dev: &dyn Device) -> Result<Vec<Moments>> {
        self.params
            .iter()
            .map(|p| {
                Ok((
                    p.name.clone(),
                    dev.download(p.m)?.to_f32(),
                    dev.download(p.v)?.to_f32(),
                ))
            })
            .collect()
    }

    /// Optimizer steps applied so far (skipped steps do not count; the LR schedule and
    /// Adam's bias correction follow this).
    pub fn steps_applied(&self) -> u32 {
        self.step
    }

    /// The model weights under their GPT-2 names, for safetensors export/import.
    pub fn tensors(&self) -> Vec<NamedTensor> {
        self.params
            .iter()
            .map(|p| NamedTensor {
                name: p.name.clone(),
                buffer: p.value,
                shape: p.shape.clone(),
            })
            .collect()
    }

    /// One AdamW step on a batch; the overflow flag and the losses are the only readback.
    pub fn train_step(
        &mut self,
        dev: &dyn Device,
        tokens: &[u32],
        targets: &[u32],
    ) -> Result<GptStep> {
        self.train_step_accumulated(dev, &[(tokens, targets)], 0.0)
    }

    /// One optimizer step over several micro-batches at the optimizer's base learning
    /// rate; see [`Gpt::step`].
    pub fn train_step_accumulated(
        &mut self,
        dev: &dyn Device,
        micro: &[(&[u32], &[u32])],
        clip: f32,
    ) -> Result<GptStep> {
        let lr = self.training.optimizer.lr();
        self.step(dev, micro, lr, clip)
    }

    /// A step's first phase: forward and backward over the micro-batches at the
    /// scaler's current scale, each micro-batch's mean loss weighing 1/n, so the grad
    /// buffers end up holding the scaled gradient of the step's mean loss. Submitted,
    /// not waited for: several devices can compute at once.
    pub fn accumulate(&mut self, dev: &dyn Device, micro: &[(&[u32], &[u32])]) -> Result<()> {
        self.accumulate_hooked(dev, micro, None)
    }

    /// [`Gpt::accumulate`], calling `ready(params)` during the last micro-batch's
    /// backward as soon as those parameters' gradients are final and submitted: each
    /// block's twelve (top block first), then the embeddings' and the final norm's.
    /// A data-parallel group starts exchanging them while the rest of backward runs.
    /// With [`Gpt::share_block_gradients`] every micro-batch's gradients are written
    /// afresh and handed over: the caller sums them.
    pub fn accumulate_with(
        &mut self,
        dev: &dyn Device,
        micro: &[(&[u32], &[u32])],
        ready: Ready<'_>,
    ) -> Result<()> {
        self.accumulate_hooked(dev, micro, Some(ready))
    }

    fn accumulate_hooked(
        &mut self,
        dev: &dyn Device,
        micro: &[(&[u32], &[u32])],
        mut ready: Option<Ready<'_>>,
    ) -> Result<()> {
        if micro.is_empty() {
            return Err(Error::InvalidArgument(
                "gpt: a step needs at least one micro-batch".into(),
            ));
        }
        if self.shared_block_grads && ready.is_none() {
            return Err(Error::InvalidArgument(
                "gpt: the blocks share one set of gradient buffers (ZeRO stage 2), so each \
                 block's gradients must be handed over as they are made: use accumulate_with"
                    .into(),
            ));
        }
        // Ready groups: each block's parameters, then the embeddings and ln_f.
        let n = self.params.len();
        let mut groups: Vec<Vec<usize>> = (0..self.config.n_layer)
            .map(|l| (2 + 12 * l..2 + 12 * (l + 1)).collect())
            .collect();
        groups.push(vec![0, 1, n - 2, n - 1]);
        let (scale, count) = (self.scaler.scale(), micro.len());
        for (i, (tokens, targets)) in micro.iter().enumerate() {
            self.upload(dev, tokens, targets)?;
            let w = self.per_target() / count as f32;
            match &mut ready {
                Some(r) if self.shared_block_grads || i + 1 == count => {
                    self.plan
                        .accumulate_with(dev, (scale, w, i), &groups, &mut **r)?
                }
                _ => self.plan.accumulate(dev, scale, w, i)?,
            }
        }
        Ok(())
    }

    /// Parameter `index`'s gradient as f32 (waits for the work that writes it).
    pub fn gradient(&self, dev: &dyn Device, index: usize) -> Result<Vec<f32>> {
        self.check_own_gradients()?;
        Ok(dev.download(self.param(index)?.grad)?.to_f32())
    }

    /// Overwrites parameter `index`'s gradient (rounded to its dtype).
    pub fn set_gradient(&self, dev: &dyn Device, index: usize, grad: &[f32]) -> Result<()> {
        self.check_own_gradients()?;
        let g = self.param(index)?.grad;
        dev.upload(g, &HostData::from_f32(g.dtype, grad))
    }

    /// Shared block gradients hold whichever block ran last: reading them as one
    /// parameter's gradient would be wrong without saying so.
    fn check_own_gradients(&self) -> Result<()> {
        if self.shared_block_grads {
            return Err(Error::InvalidArgument(
                "gpt: the blocks share one set of gradient buffers (ZeRO stage 2); a block's \
                 gradients exist only while accumulate_with hands them over"
                    .into(),
            ));
        }
        Ok(())
    }

    /// ZeRO stage 2's gradient partitioning on this replica: every transformer block
    /// writes its gradients into block 0's buffers, and the other blocks' are freed, so
    /// a device holds one block's gradients (plus the embeddings' and final norm's)
    /// instead of all of them. [`Gpt::accumulate_with`] then hands over each block's
    /// gradients of every micro-batch before the next block overwrites them (the copy
    /// to staging memory is queued in-stream ahead of that block's backward), and the
    /// group keeps only each rank's reduced shard. The plan is compiled again over the
    /// shared buffers.
    pub fn share_block_gradients(&mut self, dev: &dyn Device) -> Result<()> {
        if self.shared_block_grads {
            return Ok(());
        }
        // Buffers of their own for the embeddings', final norm's and block 0's
        // gradients; the other blocks name block 0's; the arenas' gradients go.
        let per_block = 12;
        let layers = self.config.n_layer;
        let in_later_block = |i: usize| i >= 2 + per_block && i < 2 + per_block * layers;
        let mut grads = vec![];
        for (i, p) in self.params.iter().enumerate() {
            grads.push(if in_later_block(i) {
                None
            } else {
                Some(dev.alloc(p.grad.dtype, p.grad.len)?)
            });
        }
        for p in &self.params {
            dev.free(p.grad)?;
        }
        for a in &self.arenas {
            dev.free(a.buffers.grad)?;
        }
        for i in 0..self.params.len() {
            let g = match grads[i] {
                Some(g) => g,
                None => grads[2 + (i - 2) % per_block].expect("block 0 has its own"),
            };
            self.params[i].buffers.grad = g;
        }
        self.own_grads = grads.into_iter().flatten().collect();
        self.shared_block_grads = true;
        self.recompile(dev)
    }

    /// Parameter `index`'s gradient buffer (a data-parallel group downloads it from
    /// another thread while this model records the rest of backward).
    pub fn gradient_buffer(&self, index: usize) -> Buffer {
        self.params[index].grad
    }

    /// Elements of parameter `index`.
    pub fn parameter_len(&self, index: usize) -> usize {
        self.params[index].shape.iter().product()
    }

    /// Number of parameter tensors.
    pub fn parameter_tensors(&self) -> usize {
        self.params.len()
    }

    /// Mean loss of the micro-batches the last [`Gpt::accumulate`] ran (waits for
    /// them).
    pub fn accumulated_loss(&self, dev: &dyn Device) -> Result<f32> {
        Ok(self.plan.step_loss(dev)? as f32)
    }

    /// Device bytes of this replica's model states as allocated: model copy,
    /// gradients (shared ones once) and f32 master + moments (empty after
    /// [`Gpt::release_optimizer_state`]).
    pub fn model_state_bytes(&self) -> ModelStateBytes {
        let whole = |f: fn(&ParamBuffers) -> u64| -> u64 {
            self.arenas.iter().map(|a| f(&a.buffers)).sum()
        };
        ModelStateBytes {
            weights: whole(|b| b.value.bytes()),
            gradients: if self.own_grads.is_empty() {
                whole(|b| b.grad.bytes())
            } else {
                self.own_grads.iter().map(|g| g.bytes()).sum()
            },
            optimizer: match self.released {
                Some(empty) => empty.bytes(),
                None => whole(|b| b.master.bytes() + b.m.bytes() + b.v.bytes()),
            },
        }
    }

    /// Bytes of all gradient buffers as stored on the device (shared ones once).
    pub fn gradient_bytes(&self) -> u64 {
        let mut seen = std::collections::HashSet::new();
        self.params
            .iter()
            .filter(|p| seen.insert(p.grad.id))
            .map(|p| p.grad.bytes())
            .sum()
    }

    /// Every parameter's gradient as f32, in parameter order (waits for the device).
    pub fn gradient_values(&self, dev: &dyn Device) -> Result<Vec<Vec<f32>>> {
        self.check_own_gradients()?;
        self.params
            .iter()
            .map(|p| Ok(dev.download(p.grad)?.to_f32()))
            .collect()
    }

    /// Overwrites every gradient (rounded to the grad buffers' dtypes): how a
    /// data-parallel group hands back the gradients it reduced on the host.
    pub fn set_gradients(&self, dev: &dyn Device, grads: &[Vec<f32>]) -> Result<()> {
        if grads.len() != self.params.len() {
            return Err(Error::InvalidArgument(format!(
                "gpt: {} gradients for {} parameters",
                grads.len(),
                self.params.len()
            )));
        }
        self.check_own_gradients()?;
        for (p, g) in self.params.iter().zip(grads) {
            dev.upload(p.grad, &HostData::from_f32(p.grad.dtype, g))?;
        }
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

    /// One optimizer step at learning rate `lr` over several micro-batches (gradients
    /// accumulated, the loss their mean), with the gradients clipped to global norm
    /// `clip` (0: no clipping) after unscaling, DeepSpeed's way. Readback: the overflow
    /// flag and the summed losses. A skipped (overflowing) step changes nothing but the
    /// loss scaler.
    pub fn step(
        &mut self,
        dev: &dyn Device,
        micro: &[(&[u32], &[u32])],
        lr: f32,
        clip: f32,
    ) -> Result<GptStep> {
        self.accumulate(dev, micro)?;
        let st = self
            .plan
            .finish_step(dev, &mut self.scaler, (lr, self.step + 1, clip), true)?;
        if !st.skipped {
            self.step += 1;
        }
        Ok(GptStep {
            loss: st.loss.unwrap_or(f64::NAN) as f32,
            skipped: st.skipped,
            scale: st.scale,
        })
    }

    /// The factor the last step multiplied gradients by (1 / (loss scale * clip factor)).
    pub fn last_grad_scale(&self, dev: &dyn Device) -> Result<f32> {
        self.plan.grad_scale(dev)
    }

    /// Mean loss of a batch and the model's most likely next token at every position
    /// (B*T ids): one forward pass, for evaluation.
    pub fn predict(
        &self,
        dev: &dyn Device,
        tokens: &[u32],
        targets: &[u32],
    ) -> Result<(f64, Vec<u32>)> {
        let loss = self.loss(dev, tokens, targets)?;
        let v = self.config.vocab_size;
        let logits = self
            .plan
            .buffer(self.model.logits)
            .expect("the logits are a graph output");
        let logits = dev.download(logits)?.to_f32();
        let best = logits
            .chunks_exact(v)
            .map(|row| {
                // First maximum wins, so ties resolve the same way on every backend.
                let mut arg = 0;
                for (i, &x) in row.iter().enumerate() {
                    if x > row[arg] {
                        arg = i;
                    }
                }
                arg as u32
            })
            .collect();
        Ok((loss, best))
    }

    /// Every parameter's full training state, for checkpoints.
    pub fn param_states(&self, dev: &dyn Device) -> Result<Vec<ParamState>> {
        self.params
            .iter()
            .map(|p| {
                Ok(ParamState {
                    name: p.name.clone(),
                    shape: p.shape.clone(),
                    value: dev.download(p.value)?,
                    master: dev.download(p.master)?.to_f32(),
                    m: dev.download(p.m)?.to_f32(),
                    v: dev.download(p.v)?.to_f32(),
                })
            })
            .collect()
    }

    /// Restores what [`Gpt::param_states`] saved. Every parameter must be present with
    /// its shape and the model's storage dtype: a checkpoint of another model or another
    /// precision is an error, never a partial load.
    pub fn load_param_states(&self, dev: &dyn Device, states: &[ParamState]) -> Result<()> {
        if states.len() != self.params.len() {
            return Err(Error::InvalidArgument(format!(
                "gpt: the checkpoint holds {} parameters but this model has {}: it was saved \
                 from a different model config",
                states.len(),
                self.params.len()
            )));
        }
        for p in &self.params {
            let s = states.iter().find(|s| s.name == p.name).ok_or_else(|| {
                Error::InvalidArgument(format!(
                    "gpt: the checkpoint has no parameter `{}`: it was saved from a different \
                     model config",
                    p.name
                ))
            })?;
            let n: usize = p.shape.iter().product();
            if s.shape != p.shape {
                return Err(Error::InvalidArgument(format!(
                    "gpt: `{}` has shape {:?} in the checkpoint but {:?} in this model: the \
                     model config differs from the one the checkpoint was saved with",
                    p.name, s.shape, p.shape
                )));
            }
            if s.value.dtype() != p.value.dtype {
                return Err(Error::InvalidArgument(format!(
                    "gpt: `{}` is stored as {} in the checkpoint but this run trains in {}: \
                     resume with the precision the checkpoint was saved with",
                    p.name,
                    s.value.dtype(),
                    p.value.dtype
                )));
            }
            for (what, len) in [
                ("value", s.value.len()),
                ("master", s.master.len()),
                ("exp_avg", s.m.len()),
                ("exp_avg_sq", s.v.len()),
            ] {
                if len != n {
                    return Err(Error::LenMismatch {
                        what: format!("checkpoint {what} of `{}`", p.name),
                        expected: n,
                        found: len,
                    });
                }
            }
            dev.upload(p.value, &s.value)?;
            dev.upload(p.master, &HostData::F32(s.master.clone()))?;
            dev.upload(p.m, &HostData::F32(s.m.clone()))?;
            dev.upload(p.v, &HostData::F32(s.v.clone()))?;
        }
        Ok(())
    }

    /// Frees every parameter's f32 master and moments, for a ZeRO group whose ranks
    /// each keep only their shard of them (see `zero.rs`); one empty buffer is left in
    /// their place, so an optimizer launch on them is a length error, never a silent
    /// no-op; the plan is compiled again without its update. Returns the master
    /// weights as they were (the shards' start).
    pub fn release_optimizer_state(&mut self, dev: &dyn Device) -> Result<Vec<Vec<f32>>> {
        if self.released.is_some() {
            return Err(Error::InvalidArgument(
                "gpt: the optimizer state was already released".into(),
            ));
        }
        let mut masters = vec![];
        let empty = dev.alloc(DType::F32, 0)?;
        for p in &mut self.params {
            masters.push(dev.download(p.buffers.master)?.to_f32());
            for b in [p.buffers.master, p.buffers.m, p.buffers.v] {
                dev.free(b)?;
            }
            (p.buffers.master, p.buffers.m, p.buffers.v) = (empty, empty, empty);
        }
        for a in &mut self.arenas {
            for b in [a.buffers.master, a.buffers.m, a.buffers.v] {
                dev.free(b)?;
            }
            (a.buffers.master, a.buffers.m, a.buffers.v) = (empty, empty, empty);
        }
        self.released = Some(empty);
        self.recompile(dev)?;
        Ok(masters)
    }

    /// (name, shape, storage dtype, weight decay applies) of every parameter, in order.
    pub fn parameter_layout(&self) -> Vec<(String, Vec<usize>, DType, bool)> {
        self.params
            .iter()
            .map(|p| (p.name.clone(), p.shape.clone(), p.value.dtype, p.decay))
            .collect()
    }

    /// Overwrites parameter `index`'s model copy (storage dtype, bit-exact): how a ZeRO
    /// group hands every rank the updated weights its shards produced.
    pub fn set_value(&self, dev: &dyn Device, index: usize, data: &HostData) -> Result<()> {
        dev.upload(self.param(index)?.value, data)
    }

    /// Parameter `index`'s model copy as stored.
    pub fn value(&self, dev: &dyn Device, index: usize) -> Result<HostData> {
        dev.download(self.param(index)?.value)
    }

    /// Sets the count of applied optimizer steps (restoring a checkpoint).
    pub fn set_steps_applied(&mut self, steps: u32) {
        self.step = steps;
    }
}

enum Init {
    Const(f32),
    Std(f32),
}
