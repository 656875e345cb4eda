//! GPT-2 written once, as a forward pass on the graph; backward and the update are
//! derived and compiled into a plan. Token + learned position embeddings, pre-LN blocks
//! (causal self-attention, GELU MLP, residual adds), a final layer norm and an LM head
//! tied to the token embedding, cross-entropy over the vocabulary.
//!
//! Parameters have the names, shapes, order, dtypes, initialisation and weight-decay
//! flags of [`crate::gpt::Gpt`], so weights copy across one for one (tests/graph_gpt.rs
//! holds the two to the same loss and gradients).
//!
//! Shapes: B batch, T sequence, C = n_embd, V vocabulary.

use crate::gpt::{Attention, GptConfig, GptStep, GptTraining, Ready};
use crate::graph::{Bindings, Graph, Plan, PlanMemory, Tensor, Training};
use crate::loss_scaler::{DynamicScaling, LossScaler};
use crate::mlp::{Precision, SplitMix};
use crate::optim::ParamBuffers;
use crate::{Buffer, DType, Device, Error, HostData, Result, IGNORE_TARGET};

/// How a parameter starts.
#[derive(Clone, Copy)]
enum Init {
    Const(f32),
    /// Uniform with this standard deviation (GPT-2 uses a normal of 0.02).
    Std(f32),
}

/// One parameter: GPT-2 name, shape, initialisation, f32 gradient (embeddings and
/// norms: their kernels accumulate in f32), weight decay (matrices only).
struct Spec {
    name: String,
    shape: Vec<usize>,
    init: Init,
    f32_grad: bool,
    decay: bool,
}

/// Every parameter in model order: wte, wpe, 12 per block, ln_f weight and bias; the
/// same table as `gpt::param_specs` (which is private to that file; the test checks
/// the two layouts are equal).
fn specs(config: &GptConfig) -> Vec<Spec> {
    let (c, v) = (config.n_embd, config.vocab_size);
    let proj = Init::Std(0.02 / (2.0 * config.n_layer as f32).sqrt());
    let s = |name: String, shape: Vec<usize>, init, f32_grad, decay| Spec {
        name,
        shape,
        init,
        f32_grad,
        decay,
    };
    let (one, zero, std) = (Init::Const(1.0), Init::Const(0.0), Init::Std(0.02));
    let mut out = vec![
        s(
            "transformer.wte.weight".into(),
            vec![v, c],
            std,
            true,
            false,
        ),
        s(
            "transformer.wpe.weight".into(),
            vec![config.block_size, c],
            Init::Std(0.01),
            true,
            false,
        ),
    ];
    for l in 0..config.n_layer {
        let p = |x: &str| format!("transformer.h.{l}.{x}");
        out.extend([
            s(p("ln_1.weight"), vec![c], one, true, false),
            s(p("ln_1.bias"), vec![c], zero, true, false),
            s(p("attn.c_attn.weight"), vec![c, 3 * c], std, false, true),
            s(p("attn.c_attn.bias"), vec![3 * c], zero, false, false),
            s(p("attn.c_proj.weight"), vec![c, c], proj, false, true),
            s(p("attn.c_proj.bias"), vec![c], zero, false, false),
            s(p("ln_2.weight"), vec![c], one, true, false),
            s(p("ln_2.bias"), vec![c], zero, true, false),
            s(p("mlp.c_fc.weight"), vec![c, 4 * c], std, false, true),
            s(p("mlp.c_fc.bias"), vec![4 * c], zero, false, false),
            s(p("mlp.c_proj.weight"), vec![4 * c, c], proj, false, true),
            s(p("mlp.c_proj.bias"), vec![c], zero, false, false),
        ]);
    }
    out.extend([
        s("transformer.ln_f.weight".into(), vec![c], one, true, false),
        s("transformer.ln_f.bias".into(), vec![c], zero, true, false),
    ]);
    out
}

/// The forward pass, recorded once: returns the graph and its tokens, targets and
/// positions inputs (each (B, T) u32).
fn record(
    config: &GptConfig,
    training: &GptTraining,
    specs: &[Spec],
) -> Result<(Graph, [Tensor; 3])> {
    let (b, t, h) = (training.batch, training.seq, config.n_head);
    let act = training.precision.dtype();
    let mut g = Graph::new();
    let tokens = g.input("tokens", &[b, t], DType::U32);
    let targets = g.input("targets", &[b, t], DType::U32);
    let positions = g.input("positions", &[b, t], DType::U32);
    let mut p = vec![];
    for s in specs {
        let grad = if s.f32_grad { DType::F32 } else { act };
        p.push(g.param(&s.name, &s.shape, act, grad, s.decay)?);
    }
    let (wte, wpe) = (p[0], p[1]);
    // x (B, T, C) = wte[tokens] + wpe[positions]
    let tok = g.embedding(tokens, wte)?;
    let pos = g.embedding(positions, wpe)?;
    let mut x = g.add(tok, pos)?;
    for l in 0..config.n_layer {
        let w = &p[2 + 12 * l..2 + 12 * (l + 1)];
        // x = x + proj(attention(c_attn(ln_1(x))))
        let a = g.layernorm(x, w[0], w[1])?;
        let qkv = g.linear(a, w[2], Some(w[3]))?; // (B, T, 3C)
        let y = g.causal_attention(qkv, h, training.attention)?; // (B, T, C)
        let y = g.linear(y, w[4], Some(w[5]))?;
        x = g.add(x, y)?;
        // x = x + c_proj(gelu(c_fc(ln_2(x))))
        let m = g.layernorm(x, w[6], w[7])?;
        let f = g.linear(m, w[8], Some(w[9]))?; // (B, T, 4C)
        let f = g.gelu(f)?;
        let f = g.linear(f, w[10], Some(w[11]))?;
        x = g.add(x, f)?;
    }
    let n = p.len();
    let xf = g.layernorm(x, p[n - 2], p[n - 1])?;
    // Tied LM head: logits (B, T, V) = xf wte^T.
    let logits = g.linear_transposed(xf, wte, None)?;
    g.cross_entropy(logits, targets)?;
    Ok((g, [tokens, targets, positions]))
}

/// GPT-2 on a plan: one compiled step replayed for every batch.
pub struct GptGraph {
    pub config: GptConfig,
    pub training: GptTraining,
    names: Vec<(String, Vec<usize>, bool)>,
    params: Vec<ParamBuffers>,
    tokens: Buffer,
    targets: Buffer,
    plan: Plan,
    pub scaler: LossScaler,
    step: u32,
    /// Targets of the uploaded batch that are trained on (not IGNORE_TARGET).
    trained: usize,
}

impl GptGraph {
    pub fn new(dev: &dyn Device, config: GptConfig, training: GptTraining) -> Result<GptGraph> {
        GptGraph::with_clip(dev, config, training, 0.0)
    }

    /// A model whose steps clip the unscaled gradients to global L2 norm `clip` (0: no
    /// clipping), DeepSpeed's way, as [`crate::gpt::Gpt::step`] does.
    pub fn with_clip(
        dev: &dyn Device,
        config: GptConfig,
        training: GptTraining,
        clip: f32,
    ) -> Result<GptGraph> {
        let (c, h, v) = (config.n_embd, config.n_head, config.vocab_size);
        let (b, t) = (training.batch, training.seq);
        if h == 0 || c % h != 0 || c % 2 != 0 {
            return Err(Error::InvalidArgument(format!(
                "gpt graph: n_embd {c} must be even and divisible by n_head {h}"
            )));
        }
        if t == 0 || t > config.block_size || b == 0 || v == 0 || config.n_layer == 0 {
            return Err(Error::InvalidArgument(format!(
                "gpt graph: need 1 <= seq ({t}) <= block_size ({}), batch >= 1, vocab >= 1, \
                 n_layer >= 1",
                config.block_size
            )));
        }
        let act = training.precision.dtype();
        let specs = specs(&config);
        let (g, [tokens, targets, positions]) = record(&config, &training, &specs)?;
        // Initial values drawn in parameter order from one generator, as Gpt::new does.
        let mut rng = SplitMix(training.seed);
        let mut params = vec![];
        for s in &specs {
            let n: usize = s.shape.iter().product();
            let values: Vec<f32> = match s.init {
                Init::Const(x) => vec![x; n],
                Init::Std(sd) => (0..n).map(|_| rng.symmetric() * sd * 3f32.sqrt()).collect(),
            };
            let grad = if s.f32_grad { DType::F32 } else { act };
            params.push(ParamBuffers::new(dev, &values, act, grad)?);
        }
        let bt = b * t;
        let (tok_b, tgt_b, pos_b) = (
            dev.alloc(DType::U32, bt)?,
            dev.alloc(DType::U32, bt)?,
            dev.alloc(DType::U32, bt)?,
        );
        dev.upload(
            pos_b,
            &HostData::U32((0..bt).map(|i| (i % t) as u32).collect()),
        )?;
        let bindings = Bindings {
            params: params.clone(),
            inputs: vec![(tokens, tok_b), (targets, tgt_b), (positions, pos_b)],
        };
        let plan = g.compile(
            dev,
            &bindings,
            &Training {
                optimizer: training.optimizer.clone(),
                clip,
            },
        )?;
        let scaler = match training.precision {
            Precision::F16 => LossScaler::dynamic(DynamicScaling::default())?,
            _ => LossScaler::fixed(1.0)?,
        };
        Ok(GptGraph {
            names: specs
                .into_iter()
                .map(|s| (s.name, s.shape, s.decay))
                .collect(),
            params,
            tokens: tok_b,
            targets: tgt_b,
            plan,
            scaler,
            step: 0,
            trained: 0,
            config,
            training,
        })
    }

    /// Uploads a batch (B*T tokens and next-token targets, IGNORE_TARGET allowed).
    fn upload(&mut self, dev: &dyn Device, tokens: &[u32], targets: &[u32]) -> Result<()> {
        let (bt, v) = (
            self.training.batch * self.training.seq,
            self.config.vocab_size,
        );
        if tokens.len() != bt || targets.len() != bt {
            return Err(Error::InvalidArgument(format!(
                "gpt graph: a batch is {bt} tokens and as many targets, got {} and {}",
                tokens.len(),
                targets.len()
            )));
        }
        // On the device an out-of-range id would quietly give NaN losses.
        let bad_token = tokens.iter().position(|&x| x as usize >= v);
        let bad_target = targets
            .iter()
            .position(|&x| x as usize >= v && x != IGNORE_TARGET);
        if let Some(i) = bad_token.or(bad_target) {
            return Err(Error::InvalidArgument(format!(
                "gpt graph: an id at position {i} is outside the vocabulary of {v}"
            )));
        }
        self.trained = targets.iter().filter(|&&x| x != IGNORE_TARGET).count();
        dev.upload(self.tokens, &HostData::U32(tokens.to_vec()))?;
        dev.upload(self.targets, &HostData::U32(targets.to_vec()))
    }

    /// d loss / d loss_r: the loss is the mean over the trained targets.
    fn per_target(&self) -> f32 {
        1.0 / self.trained.max(1) as f32
    }

    fn mean_loss(&self, dev: &dyn Device) -> Result<f64> {
        Ok(self.plan.loss_sum(dev)? / self.trained.max(1) as f64)
    }

    /// Mean loss of a batch, no update.
    pub fn loss(&mut self, dev: &dyn Device, tokens: &[u32], targets: &[u32]) -> Result<f64> {
        self.upload(dev, tokens, targets)?;
        self.plan.forward(dev)?;
        self.mean_loss(dev)
    }

    /// Forward and backward at loss scale 1; the gradients are left in the parameters'
    /// grad buffers (see [`GptGraph::gradients`]).
    pub fn loss_and_gradients(
        &mut self,
        dev: &dyn Device,
        tokens: &[u32],
        targets: &[u32],
    ) -> Result<f64> {
        self.upload(dev, tokens, targets)?;
        let w = self.per_target();
        self.plan.accumulate(dev, 1.0, w, 0)?;
        self.mean_loss(dev)
    }

    /// One optimizer step on a batch at the optimizer's base learning rate; the
    /// overflow flag and the loss are the only readback.
    pub fn train_step(
        &mut self,
        dev: &dyn Device,
        tokens: &[u32],
        targets: &[u32],
    ) -> Result<GptStep> {
        let lr = self.training.optimizer.lr();
        self.step(dev, &[(tokens, targets)], lr)
    }

    /// One optimizer step at learning rate `lr` over several micro-batches: their
    /// gradients accumulate in the plan, each micro-batch's mean loss weighing 1/n;
    /// then the overflow check, the scaler's decision and (unless it skips) the update.
    pub fn step(
        &mut self,
        dev: &dyn Device,
        micro: &[(&[u32], &[u32])],
        lr: f32,
    ) -> Result<GptStep> {
        if micro.is_empty() {
            return Err(Error::InvalidArgument(
                "gpt graph: a step needs at least one micro-batch".into(),
            ));
        }
        let (scale, n) = (self.scaler.scale(), micro.len() as f32);
        for (i, (tokens, targets)) in micro.iter().enumerate() {
            self.upload(dev, tokens, targets)?;
            let w = self.per_target() / n;
            self.plan.accumulate(dev, scale, w, i)?;
        }
        let st = self
            .plan
            .finish_step(dev, &mut self.scaler, lr, self.step + 1, true)?;
        if !st.skipped {
            self.step += 1;
        }
        Ok(GptStep {
            loss: st.loss.unwrap_or(f64::NAN) as f32,
            skipped: st.skipped,
            scale: st.scale,
        })
    }

    /// Optimizer steps applied so far (skipped steps do not count).
    pub fn steps_applied(&self) -> u32 {
        self.step
    }

    /// A step's first phase for a data-parallel group, as
    /// [`crate::gpt::Gpt::accumulate_with`]: forward and backward over the
    /// micro-batches at the scaler's scale, calling `ready(params)` during the last
    /// micro-batch's backward as soon as those parameters' gradients are final and
    /// submitted: each block's twelve (top block first), then the embeddings and the
    /// final norm.
    pub fn accumulate_with(
        &mut self,
        dev: &dyn Device,
        micro: &[(&[u32], &[u32])],
        ready: Ready<'_>,
    ) -> Result<()> {
        if micro.is_empty() {
            return Err(Error::InvalidArgument(
                "gpt graph: a step needs at least one micro-batch".into(),
            ));
        }
        let n = self.params.len();
        let mut groups: Vec<Vec<usize>> = (0..self.config.n_layer)
            .map(|l| (2 + 12 * l..2 + 12 * (l + 1)).collect())
            .collect();
        groups.push(vec![0, 1, n - 2, n - 1]);
        let (scale, count) = (self.scaler.scale(), micro.len());
        for (i, (tokens, targets)) in micro.iter().enumerate() {
            self.upload(dev, tokens, targets)?;
            let w = self.per_target() / count as f32;
            if i + 1 == count {
                self.plan
                    .accumulate_with(dev, (scale, w, i), &groups, &mut *ready)?;
            } else {
                self.plan.accumulate(dev, scale, w, i)?;
            }
        }
        Ok(())
    }

    /// A step's last phase when the host has decided it, as [`crate::gpt::Gpt::apply`]:
    /// the update with every gradient multiplied by `grad_scale` at learning rate `lr`.
    pub fn apply(&mut self, dev: &dyn Device, lr: f32, grad_scale: f32) -> Result<()> {
        self.step += 1;
        self.plan.apply(dev, lr, self.step, grad_scale)
    }

    /// Parameter `index`'s gradient buffer.
    pub fn gradient_buffer(&self, index: usize) -> Buffer {
        self.params[index].grad
    }

    /// The factor the last step multiplied gradients by (1 / (loss scale x clip factor)).
    pub fn last_grad_scale(&self, dev: &dyn Device) -> Result<f32> {
        self.plan.grad_scale(dev)
    }

    /// (name, gradient) of every parameter, as f32.
    pub fn gradients(&self, dev: &dyn Device) -> Result<Vec<(String, Vec<f32>)>> {
        self.names
            .iter()
            .zip(&self.params)
            .map(|((n, ..), p)| Ok((n.clone(), dev.download(p.grad)?.to_f32())))
            .collect()
    }

    /// (name, f32 master values) of every parameter.
    pub fn parameters(&self, dev: &dyn Device) -> Result<Vec<(String, Vec<f32>)>> {
        self.names
            .iter()
            .zip(&self.params)
            .map(|((n, ..), p)| Ok((n.clone(), dev.download(p.master)?.to_f32())))
            .collect()
    }

    /// Parameter `index`'s model copy as stored.
    pub fn value(&self, dev: &dyn Device, index: usize) -> Result<HostData> {
        dev.download(self.params[index].value)
    }

    /// Overwrites parameter `index`: the model copy bit for bit (storage dtype) and the
    /// f32 master; how weights are copied across from a [`crate::gpt::Gpt`].
    pub fn set_parameter(
        &self,
        dev: &dyn Device,
        index: usize,
        value: &HostData,
        master: &[f32],
    ) -> Result<()> {
        let p = self.params.get(index).ok_or_else(|| {
            Error::InvalidArgument(format!(
                "gpt graph: parameter {index} does not exist; the model has {}",
                self.params.len()
            ))
        })?;
        dev.upload(p.value, value)?;
        dev.upload(p.master, &HostData::F32(master.to_vec()))
    }

    /// (name, shape, storage dtype, weight decay applies) of every parameter, in order:
    /// the same shape as [`crate::gpt::Gpt::parameter_layout`].
    pub fn parameter_layout(&self) -> Vec<(String, Vec<usize>, DType, bool)> {
        self.names
            .iter()
            .zip(&self.params)
            .map(|((n, s, d), p)| (n.clone(), s.clone(), p.value.dtype, *d))
            .collect()
    }

    /// Device bytes the plan holds (activations, their gradients, scratch) with and
    /// without liveness-based sharing.
    pub fn memory(&self) -> PlanMemory {
        self.plan.memory()
    }

    /// The compiled plan (its shared buffers, launch count).
    pub fn plan(&self) -> &Plan {
        &self.plan
    }

    /// Which attention the plan uses.
    pub fn attention(&self) -> Attention {
        self.training.attention
    }
}
