//! Cutting a recorded graph into pipeline stages, knowing nothing of the model.
//!
//! The caller says which stage each parameter belongs to (a block's parameters go to
//! the block's stage; the others, `None`, follow their use). Every op then runs on the
//! latest stage among its operands: the stage of each parameter it reads and of each
//! op output it reads; inputs and constants are available everywhere. So the
//! embeddings land on the first stage and the final norm, head and loss on the last.
//! A parameter read on several stages (a tied embedding: the lookup on the first
//! stage, the LM head on the last) is declared on each; keeping the copies equal is
//! the caller's (sum their gradients before the update).
//!
//! An op output read on a later stage crosses every boundary in between: it is an
//! output of its own stage, an input of the next (and passed on, if needed further).
//! Its gradient travels back the same way: the later stage's graph produces the
//! gradient of the input ([`Graph::grad_inputs`]) and the earlier stage's backward
//! starts from it ([`Graph::grad_seeds`]). Tensors no parameter affects carry no
//! gradient.

use std::collections::HashMap;

use super::{autodiff, Graph, Op, Source, Tensor, TensorInfo};
use crate::{Error, Result};

/// A tensor crossing a stage boundary.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Boundary {
    /// The tensor in the whole graph.
    pub tensor: Tensor,
    /// Its tensor in the stage's graph: an input for an incoming activation, the
    /// stage's tensor (pinned as an output, or an input passed on) for an outgoing one.
    pub local: Tensor,
    /// Incoming: the input itself when backward produces its gradient
    /// ([`super::Plan::input_gradient`]). Outgoing: the input the gradient from the next
    /// stage is uploaded into. `None`: no gradient flows through it.
    pub grad: Option<Tensor>,
}

/// One stage's part of a graph.
#[derive(Clone, Debug)]
pub struct StageGraph {
    pub graph: Graph,
    /// The whole graph's parameter indices this stage declares, in its own order.
    pub params: Vec<usize>,
    /// The whole graph's inputs this stage reads (model data), with its tensors.
    pub inputs: Vec<(Tensor, Tensor)>,
    /// What comes from the stage before and goes to the stage after, both in the whole
    /// graph's tensor order (one stage's outgoing list is the next one's incoming).
    pub activations_in: Vec<Boundary>,
    pub activations_out: Vec<Boundary>,
    /// The frozen weights this stage reads: each one's place among the whole graph's
    /// ([`Graph::frozen_weights`]) and its tensor here. A weight read on several stages
    /// (a tied embedding and head) is declared on each.
    pub frozen: Vec<(usize, Tensor)>,
}

/// Every tensor field of an op, its output last.
pub(super) fn tensors_mut(op: &mut Op) -> Vec<&mut Tensor> {
    match op {
        Op::Embedding { tokens, table, out } => vec![tokens, table, out],
        Op::Linear {
            x, w, b, out, acc, ..
        } => {
            let mut v = vec![x, w];
            v.extend(b.as_mut());
            v.extend(acc.as_mut());
            v.push(out);
            v
        }
        Op::LayerNorm {
            x,
            weight,
            bias,
            out,
            ..
        } => vec![x, weight, bias, out],
        Op::Gelu { x, out }
        | Op::Activation { x, out, .. }
        | Op::Softmax { x, out }
        | Op::Dropout { x, out, .. }
        | Op::LastRow { x, out } => vec![x, out],
        Op::Rope {
            x, out, positions, ..
        } => {
            let mut v = vec![x];
            v.extend(positions.as_mut());
            v.push(out);
            v
        }
        Op::CachedAttention {
            q,
            k,
            v,
            k_cache,
            v_cache,
            positions,
            out,
            ..
        } => vec![q, k, v, k_cache, v_cache, positions, out],
        Op::Add { a, b, out } => vec![a, b, out],
        Op::CausalAttention {
            qkv,
            out,
            documents,
            ..
        } => {
            let mut v = vec![qkv];
            v.extend(documents.as_mut());
            v.push(out);
            v
        }
        Op::RmsNorm { x, weight, out, .. } => vec![x, weight, out],
        Op::SwiGlu { gate, up, out } => vec![gate, up, out],
        Op::GroupedAttention {
            q,
            k,
            v,
            out,
            documents,
            ..
        } => {
            let mut all = vec![q, k, v];
            all.extend(documents.as_mut());
            all.push(out);
            all
        }
        Op::CrossEntropy {
            logits,
            targets,
            losses,
            ..
        } => vec![logits, targets, losses],
        Op::Mse {
            pred,
            target,
            losses,
        } => vec![pred, target, losses],
    }
}

/// What an op reads (every operand, float or not).
pub(super) fn reads(op: &Op) -> Vec<Tensor> {
    let mut op = op.clone();
    let mut all: Vec<Tensor> = tensors_mut(&mut op).into_iter().map(|t| *t).collect();
    all.pop();
    all
}

/// What an op writes.
pub(super) fn output(op: &Op) -> Tensor {
    let mut op = op.clone();
    let out = *tensors_mut(&mut op).pop().expect("an op has an output");
    out
}

impl Graph {
    /// Per tensor: whether a parameter affects it (a gradient flows to it).
    fn needs_gradient(&self) -> Vec<bool> {
        let mut needs: Vec<bool> = self
            .tensors
            .iter()
            .map(|i| matches!(i.source, Source::Param(_)))
            .collect();
        for op in &self.ops {
            let (ins, out) = autodiff::operands(op);
            needs[out.0] = ins.iter().any(|i| needs[i.0]);
        }
        needs
    }

    /// Cuts the graph into `stages` stages; `param_stage[p]` is parameter `p`'s stage,
    /// or `None` to follow its use (see the module's doc). Every stage must train some
    /// parameters and the loss must land on the last stage.
    pub fn split(&self, param_stage: &[Option<usize>], stages: usize) -> Result<Vec<StageGraph>> {
        let frozen_all = self.frozen_weights();
        if param_stage.len() != self.params.len() {
            return Err(Error::InvalidArgument(format!(
                "graph split: {} parameter stages given for {} parameters",
                param_stage.len(),
                self.params.len()
            )));
        }
        if let Some(s) = param_stage.iter().flatten().find(|&&s| s >= stages) {
            return Err(Error::InvalidArgument(format!(
                "graph split: a parameter is placed on stage {s} of {stages}"
            )));
        }
        let n = self.tensors.len();
        // The stage each op output is made on; where each tensor is read last.
        let mut home: Vec<Option<usize>> = vec![None; n];
        let mut last_use: Vec<usize> = vec![0; n];
        let mut op_stage = vec![];
        let mut param_used = vec![vec![false; stages]; self.params.len()];
        for op in &self.ops {
            let ins = reads(op);
            let stage = ins
                .iter()
                .map(|&t| match self.tensors[t.0].source {
                    Source::Param(p) => param_stage[p].unwrap_or(0),
                    Source::Op => home[t.0].expect("ops read what earlier ops made"),
                    Source::Input | Source::Frozen | Source::Constant(_) => 0,
                })
                .max()
                .unwrap_or(0);
            for &t in &ins {
                last_use[t.0] = last_use[t.0].max(stage);
                if let Source::Param(p) = self.tensors[t.0].source {
                    param_used[p][stage] = true;
                }
            }
            let (_, out) = autodiff::operands(op);
            home[out.0] = Some(stage);
            op_stage.push(stage);
        }
        if let Some(l) = self.loss {
            let s = home[l.0].unwrap_or(0);
            if s + 1 != stages {
                return Err(Error::InvalidArgument(format!(
                    "graph split: the loss lands on stage {s}, but a pipeline's loss must be \
                     on its last stage ({}); give the later stages blocks the loss depends on",
                    stages - 1
                )));
            }
        }
        let needs = self.needs_gradient();
        // Per boundary s -> s + 1, the op outputs crossing it, in tensor order.
        let crossing: Vec<Vec<Tensor>> = (0..stages.saturating_sub(1))
            .map(|s| {
                (0..n)
                    .filter(|&t| home[t].is_some_and(|h| h <= s) && last_use[t] > s)
                    .map(Tensor)
                    .collect()
            })
            .collect();
        let mut out = vec![];
        for s in 0..stages {
            let mut g = Graph::new();
            let mut local: HashMap<Tensor, Tensor> = HashMap::new();
            let mut params = vec![];
            for (p, decl) in self.params.iter().enumerate() {
                if param_used[p][s] || param_stage[p] == Some(s) {
                    let dtype = self.tensors[decl.tensor.0].dtype;
                    let t = g.param(&decl.name, &decl.shape, dtype, decl.grad, decl.decay)?;
                    local.insert(decl.tensor, t);
                    params.push(p);
                }
            }
            if params.is_empty() || !op_stage.contains(&s) {
                return Err(Error::InvalidArgument(format!(
                    "graph split: stage {s} of {stages} runs no part of the forward pass (no \
                     op reads its parameters before a later stage's do); every stage needs \
                     part of the model: use fewer stages or another partition"
                )));
            }
            let mut activations_in = vec![];
            if s > 0 {
                for &t in &crossing[s - 1] {
                    let i = &self.tensors[t.0];
                    let l = g.input(&i.name, &i.shape, i.dtype);
                    let grad = needs[t.0].then_some(l);
                    if grad.is_some() {
                        g.grad_inputs.push(l);
                    }
                    local.insert(t, l);
                    activations_in.push(Boundary {
                        tensor: t,
                        local: l,
                        grad,
                    });
                }
            }
            let mut inputs = vec![];
            let mut frozen = vec![];
            // Per op of the stage, its index here: checkpointed ranges follow them.
            let mut kept = vec![];
            for (i, op) in self.ops.iter().enumerate() {
                if op_stage[i] != s {
                    continue;
                }
                kept.push(i);
                for t in reads(op) {
                    if local.contains_key(&t) {
                        continue;
                    }
                    let info = &self.tensors[t.0];
                    let l = match info.source {
                        Source::Input => {
                            let l = g.input(&info.name, &info.shape, info.dtype);
                            inputs.push((t, l));
                            l
                        }
                        Source::Constant(k) => {
                            g.constant(&info.name, &info.shape, self.constants[k].clone())?
                        }
                        Source::Frozen => {
                            let l = g.frozen(&info.name, &info.shape, info.dtype)?;
                            let k = frozen_all.iter().position(|&f| f == t);
                            frozen.push((k.expect("a frozen tensor is listed"), l));
                            l
                        }
                        Source::Param(_) | Source::Op => {
                            unreachable!("parameters and earlier outputs are declared")
                        }
                    };
                    local.insert(t, l);
                }
                let (_, o) = autodiff::operands(op);
                let info: TensorInfo = self.tensors[o.0].clone();
                g.tensors.push(info);
                local.insert(o, Tensor(g.tensors.len() - 1));
                let mut op = op.clone();
                for t in tensors_mut(&mut op) {
                    *t = local[&*t];
                }
                g.ops.push(op);
                g.op_ids.push(self.op_id(i));
            }
            // A checkpointed range's ops on this stage are consecutive here too (the
            // stage keeps the graph's order), so they are one range of the stage's.
            for r in &self.checkpoints {
                let here: Vec<usize> = (0..kept.len()).filter(|&k| r.contains(&kept[k])).collect();
                if let (Some(&a), Some(&b)) = (here.first(), here.last()) {
                    g.checkpoint(a..b + 1)?;
                }
            }
            if let Some(l) = self.loss.filter(|l| home[l.0] == Some(s)) {
                g.loss = Some(local[&l]);
            }
            for &o in &self.outputs {
                if home[o.0] == Some(s) {
                    g.outputs.push(local[&o]);
                }
            }
            let mut activations_out = vec![];
            if s + 1 < stages {
                for &t in &crossing[s] {
                    let l = local[&t];
                    if g.tensors[l.0].source == Source::Op {
                        g.output(l)?;
                    }
                    let grad = if needs[t.0] {
                        let i = &self.tensors[t.0];
                        let seed = g.input(&format!("{} (gradient)", i.name), &i.shape, i.dtype);
                        g.grad_seeds.push((l, seed));
                        Some(seed)
                    } else {
                        None
                    };
                    activations_out.push(Boundary {
                        tensor: t,
                        local: l,
                        grad,
                    });
                }
            }
            out.push(StageGraph {
                graph: g,
                params,
                inputs,
                activations_in,
                activations_out,
                frozen,
            });
        }
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::super::{Graph, Tensor};
    use crate::DType;

    /// x -> w0 (stage 0) -> h0 -> w1 (stage 1) -> h1; the head reads h1 and h0 with
    /// w2, w3 (stage 2): h0 crosses two boundaries, passed on by stage 1.
    fn graph() -> (Graph, Vec<Tensor>) {
        let mut g = Graph::new();
        let f = DType::F32;
        let w: Vec<Tensor> = [[4, 8], [8, 8], [8, 3], [8, 3]]
            .iter()
            .enumerate()
            .map(|(i, s)| g.param(&format!("w{i}"), s, f, f, true).unwrap())
            .collect();
        let x = g.input("x", &[2, 4], f);
        let y = g.input("y", &[2], DType::U32);
        let h0 = g.linear(x, w[0], None).unwrap();
        let h0 = g.gelu(h0).unwrap();
        let h1 = g.linear(h0, w[1], None).unwrap();
        let a = g.linear(h1, w[2], None).unwrap();
        let b = g.linear(h0, w[3], None).unwrap();
        let logits = g.add(a, b).unwrap();
        g.cross_entropy(logits, y).unwrap();
        (g, vec![x, y, h0])
    }

    #[test]
    fn ops_follow_their_latest_operand_and_crossing_tensors_are_passed_on() {
        let (g, t) = graph();
        let (x, y, h0) = (t[0], t[1], t[2]);
        let parts = g.split(&[Some(0), Some(1), Some(2), Some(2)], 3).unwrap();
        let ops: Vec<usize> = parts.iter().map(|p| p.graph.ops.len()).collect();
        // linear + gelu | linear | two linears, the add, the loss.
        assert_eq!(ops, vec![2, 1, 4]);
        assert_eq!(parts[0].params, vec![0]);
        assert_eq!(parts[2].params, vec![2, 3]);
        assert_eq!(
            parts[0].inputs.iter().map(|i| i.0).collect::<Vec<_>>(),
            vec![x]
        );
        assert_eq!(
            parts[2].inputs.iter().map(|i| i.0).collect::<Vec<_>>(),
            vec![y]
        );
        // h0 leaves stage 0, passes through stage 1 (an input it sends on), reaches 2.
        assert_eq!(parts[0].activations_out.len(), 1);
        assert_eq!(parts[0].activations_out[0].tensor, h0);
        let middle = &parts[1];
        let through = middle
            .activations_in
            .iter()
            .find(|b| b.tensor == h0)
            .unwrap();
        let on = middle
            .activations_out
            .iter()
            .find(|b| b.tensor == h0)
            .unwrap();
        assert_eq!(through.local, on.local);
        assert_eq!(middle.activations_out.len(), 2);
        assert_eq!(
            middle
                .activations_out
                .iter()
                .map(|b| b.tensor)
                .collect::<Vec<_>>(),
            parts[2]
                .activations_in
                .iter()
                .map(|b| b.tensor)
                .collect::<Vec<_>>()
        );
        // Gradients flow back through every crossing, seeded on the way out.
        for p in &parts {
            assert!(p.activations_in.iter().all(|b| b.grad == Some(b.local)));
            assert!(p.activations_out.iter().all(|b| b.grad.is_some()));
            assert_eq!(p.graph.grad_seeds.len(), p.activations_out.len());
            assert_eq!(p.graph.grad_inputs.len(), p.activations_in.len());
        }
        assert!(parts[0].graph.loss.is_none() && parts[2].graph.loss.is_some());
        // Ops keep their index in the whole graph (dropout masks derive from it).
        assert_eq!(parts[2].graph.op_ids, vec![3, 4, 5, 6]);
    }

    #[test]
    fn a_stage_without_work_or_a_loss_before_the_end_is_refused() {
        let (g, _) = graph();
        let e = g
            .split(&[Some(0), Some(0), Some(0), Some(0)], 2)
            .unwrap_err()
            .to_string();
        assert!(e.contains("the loss lands on stage 0"), "{e}");
        // w2 is placed on stage 1, but it reads w1's output, made on stage 2.
        let e = g
            .split(&[Some(0), Some(2), Some(1), Some(2)], 3)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("stage 1 of 3 runs no part of the forward pass"),
            "{e}"
        );
        let e = g
            .split(&[Some(0), Some(1), Some(3), Some(2)], 3)
            .unwrap_err();
        assert!(e.to_string().contains("placed on stage 3 of 3"), "{e}");
        let e = g.split(&[Some(0)], 2).unwrap_err().to_string();
        assert!(
            e.contains("1 parameter stages given for 4 parameters"),
            "{e}"
        );
    }
}
