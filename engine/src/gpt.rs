//! A GPT-2 style model trained on a device, every layer's forward and backward written
//! out side by side in the manner of llm.c (autodiff is still to come: see the issue
//! notes). Token + learned position embeddings, pre-LN blocks with causal self-attention
//! (fused attention kernels, or batched GEMMs and a causal softmax: see [`Attention`]) and a
//! GELU MLP, a final layer norm and an LM head tied to the token embedding. Parameter
//! names follow GPT-2's (`transformer.h.0.attn.c_attn.weight`, …), weights stored
//! (in, out) as GPT-2's Conv1D does.
//!
//! Shapes: B batch, T sequence, C = n_embd, H heads, D = C / H, V vocabulary, BT = B*T.

use serde::Deserialize;

use crate::loss_scaler::{DynamicScaling, LossScaler, StepDecision};
use crate::mlp::{Precision, SplitMix};
use crate::optim::{Optimizer, ParamBuffers};
use crate::safetensors_io::NamedTensor;
use crate::{Buffer, DType, Device, Error, HostData, Kernel, Matmul, Result, IGNORE_TARGET};

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
/// memory estimate and every consumer of the layout read.
struct ParamSpec {
    name: String,
    shape: Vec<usize>,
    init: Init,
    /// Embeddings and norms keep f32 gradients (their kernels accumulate in f32); the
    /// rest use the storage dtype.
    f32_grad: bool,
    /// Weight decay applies (matrices only).
    decay: bool,
}

/// Every parameter, in model order: wte, wpe, 12 per block, ln_f weight and bias.
fn param_specs(config: &GptConfig) -> Vec<ParamSpec> {
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
    /// Activations saved for backward, backward scratch, inputs and small buffers.
    pub activations: u64,
}

impl GptMemory {
    pub fn total(&self) -> u64 {
        self.weights + self.gradients + self.optimizer + self.activations
    }

    /// What [`Gpt::new`] allocates for `config` at `batch` × `seq` in `precision` with
    /// `attention`, computed without a device (tested equal to a device's allocator).
    pub fn of(
        config: &GptConfig,
        batch: usize,
        seq: usize,
        precision: Precision,
        attention: Attention,
    ) -> GptMemory {
        let act = precision.dtype();
        let f = |n: usize| DType::F32.padded_bytes(n);
        let a = |n: usize| act.padded_bytes(n);
        let u = |n: usize| DType::U32.padded_bytes(n);
        let (c, h, v, l) = (
            config.n_embd,
            config.n_head,
            config.vocab_size,
            config.n_layer,
        );
        let (bt, bhtt) = (batch * seq, batch * h * seq * seq);
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
        let fused = attention == Attention::Fused;
        // Saved per block: probabilities (T x T) or, fused, one f32 log-sum-exp per row.
        let att = if fused { f(batch * h * seq) } else { a(bhtt) };
        let block = 9 * a(bt * c) + a(bt * 3 * c) + att + 2 * a(bt * 4 * c) + 4 * f(bt);
        m.activations = l as u64 * block
            + 3 * u(bt)
            + a(bt)
            + 2 * a(bt * c)
            + 4 * f(bt)
            + 2 * a(bt * v)
            + 9 * a(bt * c)
            + 2 * a(bt * 4 * c)
            + a(bt * 3 * c)
            + if fused {
                0
            } else {
                2 * a(bhtt) + f(2 * batch * h * seq)
            }
            + u(1)
            + 2 * f(1)
            + f(bt)
            + (layout.arenas.len() as u64 + 2) * f(1);
        m
    }
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

/// One optimizer group's flat buffers: one launch over them updates every tensor.
struct Arena {
    buffers: ParamBuffers,
    decay: bool,
}

/// Indices into `Gpt::params` and the saved activations of one block.
struct Block {
    ln1_w: usize,
    ln1_b: usize,
    qkv_w: usize,
    qkv_b: usize,
    proj_w: usize,
    proj_b: usize,
    ln2_w: usize,
    ln2_b: usize,
    fc_w: usize,
    fc_b: usize,
    fcp_w: usize,
    fcp_b: usize,
    x_in: Buffer,     // (BT, C) block input
    ln1: Buffer,      // (BT, C)
    ln1_mean: Buffer, // (BT) f32
    ln1_rstd: Buffer,
    qkv: Buffer, // (BT, 3C)
    q: Buffer,   // (B, H, T, D)
    k: Buffer,
    v: Buffer,
    att: Buffer,   // (B, H, T, T) probabilities; fused: (B, H, T) f32 log-sum-exp
    yh: Buffer,    // (B, H, T, D)
    y: Buffer,     // (BT, C)
    x_mid: Buffer, // (BT, C) after the attention residual
    ln2: Buffer,
    ln2_mean: Buffer,
    ln2_rstd: Buffer,
    fc: Buffer,  // (BT, 4C) before GELU
    fcg: Buffer, // (BT, 4C) after GELU
}

pub struct Gpt {
    pub config: GptConfig,
    pub training: GptTraining,
    params: Vec<Param>,
    blocks: Vec<Block>,
    wte: usize,
    wpe: usize,
    lnf_w: usize,
    lnf_b: usize,
    tokens: Buffer,
    targets: Buffer,
    positions: Buffer,
    x_final: Buffer,
    lnf: Buffer,
    lnf_mean: Buffer,
    lnf_rstd: Buffer,
    logits: Buffer,
    losses: Buffer,
    lse: Buffer,
    // Backward scratch.
    dlogits: Buffer,
    dres: Buffer,
    dtmp: Buffer,
    dln: Buffer,
    dbig: Buffer, // (BT, 4C): d fcg, then d fc
    dfc: Buffer,
    dqkv: Buffer,
    dy: Buffer,
    dyh: Buffer,
    dq: Buffer,
    dk: Buffer,
    dv: Buffer,
    /// Straightforward attention's (B*H, T, T) scratch; `None` when fused.
    unfused: Option<Unfused>,
    tmp: Buffer, // (BT, C) block outputs before the residual add
    ones: Buffer,
    flag: Buffer,
    zero: Buffer,
    grad_scale: Buffer,
    pub scaler: LossScaler,
    step: u32,
    /// 0 for the first micro-batch of a step (gradients are overwritten), 1 after
    /// (gradients accumulate).
    grad_beta: std::cell::Cell<f32>,
    /// Every block writes its gradients into block 0's buffers (ZeRO stage 2): each
    /// micro-batch's block gradients must be handed over before the next block runs.
    shared_block_grads: bool,
    /// Targets of the uploaded batch that are trained on (not IGNORE_TARGET).
    trained: std::cell::Cell<usize>,
    /// Per-token losses summed over a step's micro-batches.
    loss_sum: Buffer,
    /// Sum-of-squares partials for the global gradient norm (ping-pong pair + one per arena).
    norm_parts: Vec<Buffer>,
    /// The flat buffers every parameter's buffers are views of.
    arenas: Vec<Arena>,
    /// Once the blocks share gradients: the gradient buffers that remain (the arenas'
    /// are freed).
    own_grads: Vec<Buffer>,
    /// Once the optimizer state is released: the empty buffer every master and moment
    /// names.
    released: Option<Buffer>,
    norm_acc: [Buffer; 2],
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
        let act = training.precision.dtype();
        let bt = b * t;
        let fused = training.attention == Attention::Fused;
        if fused && !Attention::fused_takes(c / h, training.precision) {
            // The kernels' own checks, stated in the model's terms before allocating.
            return Err(Error::InvalidArgument(format!(
                "gpt: fused attention takes head dims up to {} (even in fp16/bf16), not \
                 n_embd / n_head = {}; use Attention::Straightforward",
                crate::ATTENTION_MAX_DIM,
                c / h
            )));
        }
        let mut rng = SplitMix(training.seed);
        let specs = param_specs(&config);
        let layout = arena_layout(&specs);
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
            arenas.push(Arena {
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
        // param_specs' order: wte, wpe, 12 per block, ln_f weight and bias.
        let (wte, wpe) = (0, 1);
        let (lnf_w, lnf_b) = (params.len() - 2, params.len() - 1);
        let layer_params = (0..config.n_layer).map(|l| {
            let first = 2 + 12 * l;
            std::array::from_fn::<usize, 12, _>(|i| first + i)
        });
        let a = |dtype: DType, n: usize| dev.alloc(dtype, n);
        let mut blocks = vec![];
        for lp in layer_params {
            blocks.push(Block {
                ln1_w: lp[0],
                ln1_b: lp[1],
                qkv_w: lp[2],
                qkv_b: lp[3],
                proj_w: lp[4],
                proj_b: lp[5],
                ln2_w: lp[6],
                ln2_b: lp[7],
                fc_w: lp[8],
                fc_b: lp[9],
                fcp_w: lp[10],
                fcp_b: lp[11],
                x_in: a(act, bt * c)?,
                ln1: a(act, bt * c)?,
                ln1_mean: a(DType::F32, bt)?,
                ln1_rstd: a(DType::F32, bt)?,
                qkv: a(act, bt * 3 * c)?,
                q: a(act, bt * c)?,
                k: a(act, bt * c)?,
                v: a(act, bt * c)?,
                att: if fused {
                    a(DType::F32, b * h * t)?
                } else {
                    a(act, b * h * t * t)?
                },
                yh: a(act, bt * c)?,
                y: a(act, bt * c)?,
                x_mid: a(act, bt * c)?,
                ln2: a(act, bt * c)?,
                ln2_mean: a(DType::F32, bt)?,
                ln2_rstd: a(DType::F32, bt)?,
                fc: a(act, bt * 4 * c)?,
                fcg: a(act, bt * 4 * c)?,
            });
        }
        let positions = a(DType::U32, bt)?;
        dev.upload(
            positions,
            &HostData::U32((0..bt).map(|i| (i % t) as u32).collect()),
        )?;
        let ones = a(act, bt)?;
        dev.upload(ones, &HostData::from_f32(act, &vec![1.0; bt]))?;
        let scaler = match training.precision {
            Precision::F16 => LossScaler::dynamic(DynamicScaling::default())?,
            _ => LossScaler::fixed(1.0)?,
        };
        Ok(Gpt {
            tokens: a(DType::U32, bt)?,
            targets: a(DType::U32, bt)?,
            positions,
            x_final: a(act, bt * c)?,
            lnf: a(act, bt * c)?,
            lnf_mean: a(DType::F32, bt)?,
            lnf_rstd: a(DType::F32, bt)?,
            logits: a(act, bt * v)?,
            losses: a(DType::F32, bt)?,
            lse: a(DType::F32, bt)?,
            dlogits: a(act, bt * v)?,
            dres: a(act, bt * c)?,
            dtmp: a(act, bt * c)?,
            dln: a(act, bt * c)?,
            dbig: a(act, bt * 4 * c)?,
            dfc: a(act, bt * 4 * c)?,
            dqkv: a(act, bt * 3 * c)?,
            dy: a(act, bt * c)?,
            dyh: a(act, bt * c)?,
            dq: a(act, bt * c)?,
            dk: a(act, bt * c)?,
            dv: a(act, bt * c)?,
            unfused: if fused {
                None
            } else {
                Some(Unfused {
                    datt: a(act, b * h * t * t)?,
                    dscores: a(act, b * h * t * t)?,
                    stats: a(DType::F32, 2 * b * h * t)?,
                })
            },
            tmp: a(act, bt * c)?,
            ones,
            flag: a(DType::U32, 1)?,
            zero: a(DType::F32, 1)?,
            grad_scale: a(DType::F32, 1)?,
            blocks,
            wte,
            wpe,
            lnf_w,
            lnf_b,
            scaler,
            step: 0,
            grad_beta: std::cell::Cell::new(0.0),
            shared_block_grads: false,
            trained: std::cell::Cell::new(0),
            loss_sum: a(DType::F32, bt)?,
            norm_parts: (0..arenas.len())
                .map(|_| a(DType::F32, 1))
                .collect::<Result<_>>()?,
            arenas,
            own_grads: vec![],
            released: None,
            norm_acc: [a(DType::F32, 1)?, a(DType::F32, 1)?],
            params,
            config,
            training,
        })
    }

    fn val(&self, i: usize) -> Buffer {
        self.params[i].value
    }

    fn grad(&self, i: usize) -> Buffer {
        self.params[i].grad
    }

    /// `out = x W + b` over BT rows.
    fn linear(
        &self,
        dev: &dyn Device,
        x: Buffer,
        (w, b): (usize, usize),
        out: Buffer,
        (k, n): (usize, usize),
    ) -> Result<()> {
        let bt = self.training.batch * self.training.seq;
        dev.launch(&Kernel::Matmul(
            Matmul::new(x, self.val(w), out, bt, n, k).with_bias(self.val(b)),
        ))
    }

    /// Backward of `linear`: dW = x^T dout, db = 1^T dout, dx = dout W^T.
    fn linear_backward(
        &self,
        dev: &dyn Device,
        x: Buffer,
        (w, b): (usize, usize),
        dout: Buffer,
        dx: Buffer,
        (k, n): (usize, usize),
    ) -> Result<()> {
        let bt = self.training.batch * self.training.seq;
        let beta = self.grad_beta.get();
        dev.launch(&Kernel::Matmul(
            Matmul::new(x, dout, self.grad(w), k, n, bt)
                .transpose(true, false)
                .scaled(1.0, beta),
        ))?;
        dev.launch(&Kernel::Matmul(
            Matmul::new(self.ones, dout, self.grad(b), 1, n, bt).scaled(1.0, beta),
        ))?;
        dev.launch(&Kernel::Matmul(
            Matmul::new(dout, self.val(w), dx, bt, k, n).transpose(false, true),
        ))
    }

    /// Records the forward pass for the tokens and targets already uploaded.
    fn forward(&self, dev: &dyn Device) -> Result<()> {
        let (b, t) = (self.training.batch, self.training.seq);
        let (c, h, v) = (
            self.config.n_embd,
            self.config.n_head,
            self.config.vocab_size,
        );
        let (bt, d) = (b * t, c / h);
        // x = wte[tokens] + wpe[positions]
        let x0 = self.blocks[0].x_in;
        dev.launch(&Kernel::Embedding {
            tokens: self.tokens,
            table: self.val(self.wte),
            out: self.tmp,
            dim: c,
        })?;
        dev.launch(&Kernel::Embedding {
            tokens: self.positions,
            table: self.val(self.wpe),
            out: self.dtmp,
            dim: c,
        })?;
        dev.launch(&Kernel::Binary {
            op: crate::BinaryOp::Add,
            a: self.tmp,
            b: self.dtmp,
            out: x0,
        })?;
        for (l, blk) in self.blocks.iter().enumerate() {
            // Attention: ln1 -> qkv -> heads -> causal softmax(q k^T / sqrt(D)) v -> proj.
            dev.launch(&Kernel::LayerNorm {
                x: blk.x_in,
                weight: self.val(blk.ln1_w),
                bias: self.val(blk.ln1_b),
                out: blk.ln1,
                mean: blk.ln1_mean,
                rstd: blk.ln1_rstd,
                cols: c,
                eps: 1e-5,
            })?;
            self.linear(dev, blk.ln1, (blk.qkv_w, blk.qkv_b), blk.qkv, (c, 3 * c))?;
            for (i, dst) in [blk.q, blk.k, blk.v].into_iter().enumerate() {
                dev.launch(&Kernel::SplitHeads {
                    src: blk.qkv,
                    dst,
                    seq: t,
                    heads: h,
                    width: 3 * c,
                    offset: i * c,
                })?;
            }
            if let Some(u) = &self.unfused {
                // scores (B*H, T, T) = q k^T / sqrt(D), scaled inside the GEMM (in f32) so
                // that a large raw dot product cannot overflow an f16 scores buffer; then
                // the causal softmax into `att`.
                dev.launch(&Kernel::Matmul(
                    Matmul::new(blk.q, blk.k, u.dscores, t, t, d)
                        .transpose(false, true)
                        .batched(b * h, t * d, t * d, t * t)
                        .scaled(1.0 / (d as f32).sqrt(), 0.0),
                ))?;
                dev.launch(&Kernel::Softmax {
                    x: u.dscores,
                    out: blk.att,
                    stats: u.stats,
                    cols: t,
                    scale: 1.0,
                    causal: true,
                })?;
                dev.launch(&Kernel::Matmul(
                    Matmul::new(blk.att, blk.v, blk.yh, t, d, t).batched(
                        b * h,
                        t * t,
                        t * d,
                        t * d,
                    ),
                ))?;
            } else {
                dev.launch(&Kernel::Attention {
                    q: blk.q,
                    k: blk.k,
                    v: blk.v,
                    out: blk.yh,
                    lse: blk.att,
                    batch_heads: b * h,
                    seq: t,
                    dim: d,
                    scale: 1.0 / (d as f32).sqrt(),
                    causal: true,
                })?;
            }
            dev.launch(&Kernel::MergeHeads {
                src: blk.yh,
                dst: blk.y,
                seq: t,
                heads: h,
                width: c,
                offset: 0,
            })?;
            self.linear(dev, blk.y, (blk.proj_w, blk.proj_b), self.tmp, (c, c))?;
            dev.launch(&Kernel::Binary {
                op: crate::BinaryOp::Add,
                a: blk.x_in,
                b: self.tmp,
                out: blk.x_mid,
            })?;
            // MLP: ln2 -> fc -> gelu -> proj.
            dev.launch(&Kernel::LayerNorm {
                x: blk.x_mid,
                weight: self.val(blk.ln2_w),
                bias: self.val(blk.ln2_b),
                out: blk.ln2,
                mean: blk.ln2_mean,
                rstd: blk.ln2_rstd,
                cols: c,
                eps: 1e-5,
            })?;
            self.linear(dev, blk.ln2, (blk.fc_w, blk.fc_b), blk.fc, (c, 4 * c))?;
            dev.launch(&Kernel::Gelu {
                x: blk.fc,
                out: blk.fcg,
            })?;
            self.linear(dev, blk.fcg, (blk.fcp_w, blk.fcp_b), self.tmp, (4 * c, c))?;
            let out = self
                .blocks
                .get(l + 1)
                .map_or(self.x_final, |next| next.x_in);
            dev.launch(&Kernel::Binary {
                op: crate::BinaryOp::Add,
                a: blk.x_mid,
                b: self.tmp,
                out,
            })?;
        }
        dev.launch(&Kernel::LayerNorm {
            x: self.x_final,
            weight: self.val(self.lnf_w),
            bias: self.val(self.lnf_b),
            out: self.lnf,
            mean: self.lnf_mean,
            rstd: self.lnf_rstd,
            cols: c,
            eps: 1e-5,
        })?;
        // Tied LM head: logits = lnf wte^T.
        dev.launch(&Kernel::Matmul(
            Matmul::new(self.lnf, self.val(self.wte), self.logits, bt, v, c).transpose(false, true),
        ))?;
        dev.launch(&Kernel::CrossEntropy {
            logits: self.logits,
            targets: self.targets,
            losses: self.losses,
            lse: self.lse,
            vocab: v,
        })
    }

    /// Records the backward pass of the mean loss times `scale`, leaving every
    /// parameter's gradient in its `grad` buffer.
    fn backward(&self, dev: &dyn Device, scale: f32) -> Result<()> {
        self.backward_with(dev, scale, None)
    }

    /// Backward, calling `ready(params)` as soon as those parameters' gradients are
    /// final and their work submitted: after each block (top block first), then for
    /// the embeddings and final norm. A data-parallel group starts exchanging them
    /// while the rest of backward runs.
    fn backward_with(
        &self,
        dev: &dyn Device,
        scale: f32,
        mut ready: Option<Ready<'_>>,
    ) -> Result<()> {
        let (b, t) = (self.training.batch, self.training.seq);
        let (c, h, v) = (
            self.config.n_embd,
            self.config.n_head,
            self.config.vocab_size,
        );
        let (bt, d) = (b * t, c / h);
        // Norm and embedding gradients accumulate (+=): start them at zero on a step's
        // first micro-batch.
        for p in &self.params {
            if p.grad.dtype == DType::F32 && self.grad_beta.get() == 0.0 {
                dev.launch(&Kernel::Fill {
                    dst: p.grad,
                    value: 0.0,
                })?;
            }
        }
        dev.launch(&Kernel::CrossEntropyBackward {
            logits: self.logits,
            targets: self.targets,
            lse: self.lse,
            dlogits: self.dlogits,
            vocab: v,
            scale: scale * self.per_target(),
        })?;
        // LM head: dwte = dlogits^T lnf (V, C); dlnf = dlogits wte (BT, C).
        dev.launch(&Kernel::Matmul(
            Matmul::new(self.dlogits, self.lnf, self.grad(self.wte), v, c, bt)
                .transpose(true, false)
                .scaled(1.0, self.grad_beta.get()),
        ))?;
        dev.launch(&Kernel::Matmul(Matmul::new(
            self.dlogits,
            self.val(self.wte),
            self.dln,
            bt,
            c,
            v,
        )))?;
        dev.launch(&Kernel::LayerNormBackward {
            x: self.x_final,
            weight: self.val(self.lnf_w),
            mean: self.lnf_mean,
            rstd: self.lnf_rstd,
            dout: self.dln,
            dx: self.dres,
            dweight: self.grad(self.lnf_w),
            dbias: self.grad(self.lnf_b),
            cols: c,
        })?;
        for blk in self.blocks.iter().rev() {
            if self.shared_block_grads {
                // The norms' gradients accumulate (+=), and the block above left its own
                // in these shared buffers.
                for p in [blk.ln1_w, blk.ln1_b, blk.ln2_w, blk.ln2_b] {
                    dev.launch(&Kernel::Fill {
                        dst: self.grad(p),
                        value: 0.0,
                    })?;
                }
            }
            // dres: gradient of the block output = x_mid + mlp(x_mid).
            self.linear_backward(
                dev,
                blk.fcg,
                (blk.fcp_w, blk.fcp_b),
                self.dres,
                self.dbig,
                (4 * c, c),
            )?;
            dev.launch(&Kernel::GeluBackward {
                x: blk.fc,
                dout: self.dbig,
                dx: self.dfc,
            })?;
            self.linear_backward(
                dev,
                blk.ln2,
                (blk.fc_w, blk.fc_b),
                self.dfc,
                self.dln,
                (c, 4 * c),
            )?;
            dev.launch(&Kernel::LayerNormBackward {
                x: blk.x_mid,
                weight: self.val(blk.ln2_w),
                mean: blk.ln2_mean,
                rstd: blk.ln2_rstd,
                dout: self.dln,
                dx: self.dtmp,
                dweight: self.grad(blk.ln2_w),
                dbias: self.grad(blk.ln2_b),
                cols: c,
            })?;
            dev.launch(&Kernel::Axpy {
                alpha: 1.0,
                x: self.dtmp,
                y: self.dres,
            })?;
            // dres: gradient of x_mid = x_in + attn(x_in).
            self.linear_backward(
                dev,
                blk.y,
                (blk.proj_w, blk.proj_b),
                self.dres,
                self.dy,
                (c, c),
            )?;
            dev.launch(&Kernel::SplitHeads {
                src: self.dy,
                dst: self.dyh,
                seq: t,
                heads: h,
                width: c,
                offset: 0,
            })?;
            let bh = b * h;
            if let Some(u) = &self.unfused {
                // datt = dyh v^T; dv = att^T dyh.
                dev.launch(&Kernel::Matmul(
                    Matmul::new(self.dyh, blk.v, u.datt, t, t, d)
                        .transpose(false, true)
                        .batched(bh, t * d, t * d, t * t),
                ))?;
                dev.launch(&Kernel::Matmul(
                    Matmul::new(blk.att, self.dyh, self.dv, t, d, t)
                        .transpose(true, false)
                        .batched(bh, t * t, t * d, t * d),
                ))?;
                dev.launch(&Kernel::SoftmaxBackward {
                    p: blk.att,
                    dout: u.datt,
                    dx: u.dscores,
                    stats: u.stats,
                    cols: t,
                    scale: 1.0 / (d as f32).sqrt(),
                })?;
                // dq = dscores k; dk = dscores^T q.
                dev.launch(&Kernel::Matmul(
                    Matmul::new(u.dscores, blk.k, self.dq, t, d, t).batched(
                        bh,
                        t * t,
                        t * d,
                        t * d,
                    ),
                ))?;
                dev.launch(&Kernel::Matmul(
                    Matmul::new(u.dscores, blk.q, self.dk, t, d, t)
                        .transpose(true, false)
                        .batched(bh, t * t, t * d, t * d),
                ))?;
            } else {
                dev.launch(&Kernel::AttentionBackward {
                    q: blk.q,
                    k: blk.k,
                    v: blk.v,
                    out: blk.yh,
                    dout: self.dyh,
                    lse: blk.att,
                    dq: self.dq,
                    dk: self.dk,
                    dv: self.dv,
                    batch_heads: bh,
                    seq: t,
                    dim: d,
                    scale: 1.0 / (d as f32).sqrt(),
                    causal: true,
                })?;
            }
            for (i, src) in [self.dq, self.dk, self.dv].into_iter().enumerate() {
                dev.launch(&Kernel::MergeHeads {
                    src,
                    dst: self.dqkv,
                    seq: t,
                    heads: h,
                    width: 3 * c,
                    offset: i * c,
                })?;
            }
            self.linear_backward(
                dev,
                blk.ln1,
                (blk.qkv_w, blk.qkv_b),
                self.dqkv,
                self.dln,
                (c, 3 * c),
            )?;
            dev.launch(&Kernel::LayerNormBackward {
                x: blk.x_in,
                weight: self.val(blk.ln1_w),
                mean: blk.ln1_mean,
                rstd: blk.ln1_rstd,
                dout: self.dln,
                dx: self.dtmp,
                dweight: self.grad(blk.ln1_w),
                dbias: self.grad(blk.ln1_b),
                cols: c,
            })?;
            dev.launch(&Kernel::Axpy {
                alpha: 1.0,
                x: self.dtmp,
                y: self.dres,
            })?;
            // Submitting here lets a waiting exchange start; alone, one submit a step
            // is cheaper (lavapipe pays per submission).
            if let Some(ready) = &mut ready {
                dev.submit()?;
                ready(&[
                    blk.ln1_w, blk.ln1_b, blk.qkv_w, blk.qkv_b, blk.proj_w, blk.proj_b, blk.ln2_w,
                    blk.ln2_b, blk.fc_w, blk.fc_b, blk.fcp_w, blk.fcp_b,
                ])?;
            }
        }
        // Embeddings: dwte (already holding the LM head's part) and dwpe += dres rows.
        dev.launch(&Kernel::EmbeddingBackward {
            tokens: self.tokens,
            dout: self.dres,
            dtable: self.grad(self.wte),
            dim: c,
        })?;
        dev.launch(&Kernel::EmbeddingBackward {
            tokens: self.positions,
            dout: self.dres,
            dtable: self.grad(self.wpe),
            dim: c,
        })?;
        match ready {
            Some(ready) => {
                dev.submit()?;
                ready(&[self.wte, self.wpe, self.lnf_w, self.lnf_b])
            }
            None => Ok(()),
        }
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
        let l = dev.download(self.losses)?.to_f32();
        Ok(l.iter().map(|&x| x as f64).sum::<f64>() / self.trained.get().max(1) as f64)
    }

    /// Mean loss of a batch (B*T tokens and next-token targets), no update.
    pub fn loss(&self, dev: &dyn Device, tokens: &[u32], targets: &[u32]) -> Result<f64> {
        self.upload(dev, tokens, targets)?;
        self.forward(dev)?;
        dev.submit()?;
        self.mean_loss(dev)
    }

    /// Forward and backward with loss scale 1; returns the loss. Gradients are left in
    /// the parameters' grad buffers (see `gradients`).
    pub fn loss_and_gradients(
        &self,
        dev: &dyn Device,
        tokens: &[u32],
        targets: &[u32],
    ) -> Result<f64> {
        self.grad_beta.set(0.0);
        self.upload(dev, tokens, targets)?;
        self.forward(dev)?;
        self.backward(dev, 1.0)?;
        dev.submit()?;
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
        let p = &self.params[index];
        dev.upload(p.master, &HostData::F32(values.to_vec()))?;
        dev.upload(p.value, &HostData::from_f32(p.value.dtype, values))
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
    /// buffers end up holding the scaled gradient of the step's mean loss. Recorded and
    /// submitted, not waited for: several devices can compute at once.
    pub fn accumulate(&self, dev: &dyn Device, micro: &[(&[u32], &[u32])]) -> Result<()> {
        self.accumulate_hooked(dev, micro, None)
    }

    /// [`Gpt::accumulate`], calling `ready(params)` during the last micro-batch's
    /// backward as soon as those parameters' gradients are final (see `backward_with`).
    /// With [`Gpt::share_block_gradients`] every micro-batch's gradients are written
    /// afresh and handed over: the caller sums them.
    pub fn accumulate_with(
        &self,
        dev: &dyn Device,
        micro: &[(&[u32], &[u32])],
        ready: Ready<'_>,
    ) -> Result<()> {
        self.accumulate_hooked(dev, micro, Some(ready))
    }

    fn accumulate_hooked(
        &self,
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
        let scale = self.scaler.scale();
        let n = micro.len() as f32;
        dev.launch(&Kernel::Fill {
            dst: self.loss_sum,
            value: 0.0,
        })?;
        for (i, (tokens, targets)) in micro.iter().enumerate() {
            self.upload(dev, tokens, targets)?;
            self.forward(dev)?;
            dev.launch(&Kernel::Axpy {
                alpha: self.per_target(),
                x: self.losses,
                y: self.loss_sum,
            })?;
            if self.shared_block_grads {
                self.grad_beta.set(0.0);
                let hook: Option<Ready<'_>> = match &mut ready {
                    Some(r) => Some(&mut **r),
                    None => None,
                };
                self.backward_with(dev, scale / n, hook)?;
                continue;
            }
            self.grad_beta.set(if i == 0 { 0.0 } else { 1.0 });
            if i + 1 == micro.len() {
                self.backward_with(dev, scale / n, ready.take())?;
            } else {
                self.backward(dev, scale / n)?;
            }
        }
        self.grad_beta.set(0.0);
        dev.submit()
    }

    /// Parameter `index`'s gradient as f32 (waits for the work that writes it).
    pub fn gradient(&self, dev: &dyn Device, index: usize) -> Result<Vec<f32>> {
        self.check_own_gradients()?;
        Ok(dev.download(self.params[index].grad)?.to_f32())
    }

    /// Overwrites parameter `index`'s gradient (rounded to its dtype).
    pub fn set_gradient(&self, dev: &dyn Device, index: usize, grad: &[f32]) -> Result<()> {
        self.check_own_gradients()?;
        let g = self.params[index].grad;
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
    /// group keeps only each rank's reduced shard.
    pub fn share_block_gradients(&mut self, dev: &dyn Device) -> Result<()> {
        if self.shared_block_grads {
            return Ok(());
        }
        // Buffers of their own for the embeddings', final norm's and block 0's
        // gradients; the other blocks name block 0's; the arenas' gradients go.
        let per_block = 12;
        let in_later_block = |i: usize| i >= 2 + per_block && i < 2 + per_block * self.blocks.len();
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
        Ok(())
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

    /// Mean loss of the `n` micro-batches [`Gpt::accumulate`] ran (waits for them).
    pub fn accumulated_loss(&self, dev: &dyn Device, n: usize) -> Result<f32> {
        let sums = dev.download(self.loss_sum)?.to_f32();
        Ok((sums.iter().map(|&x| x as f64).sum::<f64>() / n.max(1) as f64) as f32)
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
        dev.upload(self.grad_scale, &HostData::F32(vec![grad_scale]))?;
        self.update(dev, lr)
    }

    /// The optimizer step over every parameter, reading the factor in `grad_scale`.
    fn update(&mut self, dev: &dyn Device, lr: f32) -> Result<()> {
        self.step += 1;
        let optimizer = &self.training.optimizer;
        // The multi-tensor step: one launch per arena (each holds one group's tensors).
        for a in &self.arenas {
            let decay = if a.decay {
                optimizer.weight_decay()
            } else {
                0.0
            };
            dev.launch(
                &a.buffers
                    .step(optimizer, self.grad_scale, lr, decay, self.step),
            )?;
        }
        dev.submit()
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
        let scale = self.scaler.scale();
        self.accumulate(dev, micro)?;
        // Whole arenas: the gaps between tensors are zero, adding nothing.
        let grads: Vec<Buffer> = self.arenas.iter().map(|a| a.buffers.grad).collect();
        dev.launch(&Kernel::NonFinite {
            srcs: grads.clone(),
            flag: self.flag,
        })?;
        // Global norm of the (scaled) gradients: per-arena sums of squares, added up.
        let mut sum_squares = self.zero;
        if clip > 0.0 {
            for (&g, part) in grads.iter().zip(&self.norm_parts) {
                dev.launch(&Kernel::Reduce {
                    op: crate::ReduceOp::SumSquares,
                    src: g,
                    dst: *part,
                })?;
            }
            let mut acc = self.norm_parts[0];
            for (k, part) in self.norm_parts.iter().enumerate().skip(1) {
                let out = self.norm_acc[k % 2];
                dev.launch(&Kernel::Binary {
                    op: crate::BinaryOp::Add,
                    a: acc,
                    b: *part,
                    out,
                })?;
                acc = out;
            }
            sum_squares = acc;
        }
        dev.launch(&Kernel::GradScale {
            sum_squares,
            out: self.grad_scale,
            loss_scale: scale,
            clip,
        })?;
        dev.submit()?;
        let overflow = dev.download(self.flag)?.bits()[0] != 0;
        let loss = self.accumulated_loss(dev, micro.len())?;
        if self.scaler.update(overflow)? == StepDecision::Skip {
            return Ok(GptStep {
                loss,
                skipped: true,
                scale,
            });
        }
        self.update(dev, lr)?;
        Ok(GptStep {
            loss,
            skipped: false,
            scale,
        })
    }

    /// The factor the last step multiplied gradients by (1 / (loss scale * clip factor)).
    pub fn last_grad_scale(&self, dev: &dyn Device) -> Result<f32> {
        Ok(dev.download(self.grad_scale)?.to_f32()[0])
    }

    /// Mean loss of a batch and the model's most likely next token at every position
    /// (B*T ids): one forward pass, for evaluation.
    pub fn predict(
        &self,
        dev: &dyn Device,
        tokens: &[u32],
        targets: &[u32],
    ) -> Result<(f64, Vec<u32>)> {
        self.upload(dev, tokens, targets)?;
        self.forward(dev)?;
        dev.submit()?;
        let loss = self.mean_loss(dev)?;
        let v = self.config.vocab_size;
        let logits = dev.download(self.logits)?.to_f32();
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
    /// no-op. Returns the master weights as they were (the shards' start).
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
        dev.upload(self.params[index].value, data)
    }

    /// Parameter `index`'s model copy as stored.
    pub fn value(&self, dev: &dyn Device, index: usize) -> Result<HostData> {
        dev.download(self.params[index].value)
    }

    /// Sets the count of applied optimizer steps (restoring a checkpoint).
    pub fn set_steps_applied(&mut self, steps: u32) {
        self.step = steps;
    }
}

/// Straightforward attention's scratch: d att, scores then d scores, softmax stats.
struct Unfused {
    datt: Buffer,
    dscores: Buffer,
    stats: Buffer,
}

enum Init {
    Const(f32),
    Std(f32),
}
