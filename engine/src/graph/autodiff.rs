//! The reverse sweep, and where each gradient contribution goes.
//!
//! Ops are visited last to first; an op whose output received a gradient emits its
//! backward (ops.rs). A tensor used by several ops receives one contribution from
//! each, and they must add up. The first contribution writes the gradient buffer
//! (GEMM with beta 0, a kernel that overwrites, or a zero fill before a kernel that
//! only accumulates); later ones add to it (GEMM with beta 1, the accumulating
//! kernels as they are, scratch plus an axpy for kernels that overwrite). Parameter
//! gradients are the caller's buffers; every other gradient is a placeholder made on
//! its first contribution, in the tensor's dtype. An add hands its output's gradient
//! to an operand without a copy, and to both where that is safe (see
//! [`Grads::alias`]): a residual stream's gradient is then one buffer, as in a
//! hand-written backward.
//!
//! Micro-batches: a step may run backward several times and sum the gradients. The
//! first write of each parameter gradient is therefore one of two patchable forms,
//! which the plan flips after the first micro-batch: a GEMM whose beta becomes 1, or
//! a zero fill that is skipped (kernels that can only overwrite write a parameter's
//! gradient through scratch and an axpy after such a fill).

use crate::kernels::{self, Axpy, Cast, Fill};
use std::collections::HashMap;

use super::ops::{self, Saved};
use super::plan::Emitter;
use super::{Graph, Op, Tensor};
use crate::{Buffer, DType, Error, Kernel, Result};

/// Gradient buffers and which of them hold a contribution yet.
pub(super) struct Grads {
    buf: Vec<Option<Buffer>>,
    written: Vec<bool>,
    /// The tensor depends on a parameter (else no gradient is computed for it).
    needs: Vec<bool>,
    /// The gradient buffer is the caller's (a parameter's), never taken over by `add`.
    external: Vec<bool>,
    /// The gradient is another tensor's buffer, read-only (see [`Grads::alias`]).
    aliased: Vec<bool>,
    /// Per tensor: the op that makes it, and the ops that read it.
    producer: Vec<Option<usize>>,
    consumers: Vec<Vec<usize>>,
    /// The op whose backward is being emitted.
    op: usize,
}

/// Where an overwriting kernel writes a contribution; [`Grads::finish`] adds it in
/// when it went to scratch.
pub(super) struct Dst {
    pub buf: Buffer,
    add_to: Option<Buffer>,
}

impl Grads {
    fn new(g: &Graph, param_grads: &HashMap<Tensor, Buffer>) -> Grads {
        let n = g.tensors.len();
        let mut gr = Grads {
            buf: vec![None; n],
            written: vec![false; n],
            needs: vec![false; n],
            external: vec![false; n],
            aliased: vec![false; n],
            producer: vec![None; n],
            consumers: vec![vec![]; n],
            op: 0,
        };
        for (&t, &b) in param_grads {
            gr.buf[t.0] = Some(b);
            gr.needs[t.0] = true;
            gr.external[t.0] = true;
        }
        for &t in &g.grad_inputs {
            gr.needs[t.0] = true;
        }
        for (i, op) in g.ops.iter().enumerate() {
            let (ins, out) = operands(op);
            gr.needs[out.0] = ins.iter().any(|t| gr.needs[t.0]);
            gr.producer[out.0] = Some(i);
            for t in ins {
                gr.consumers[t.0].push(i);
            }
        }
        gr
    }

    pub fn needs(&self, t: Tensor) -> bool {
        self.needs[t.0]
    }

    /// The gradient buffer of `t`, made on first use.
    fn buffer(&mut self, e: &mut Emitter, t: Tensor) -> Buffer {
        if let Some(b) = self.buf[t.0] {
            return b;
        }
        let i = e.g.t(t);
        let b = e.scratch(i.dtype, i.len());
        self.buf[t.0] = Some(b);
        b
    }

    /// For a GEMM, which must be the caller's next launch: the destination and its
    /// beta (0 writes, 1 adds).
    pub fn gemm(&mut self, e: &mut Emitter, t: Tensor) -> (Buffer, f32) {
        let b = self.buffer(e, t);
        let first = !self.written[t.0];
        if first && self.external[t.0] {
            e.first_betas.push(e.launches.len());
        }
        self.written[t.0] = true;
        (b, if first { 0.0 } else { 1.0 })
    }

    /// A zero fill as the first write of `t`'s gradient (skipped after a step's first
    /// micro-batch when `t` is a parameter).
    fn zero(&mut self, e: &mut Emitter, t: Tensor, b: Buffer) -> Result<()> {
        if self.external[t.0] {
            e.grad_fills.push(e.launches.len());
        }
        self.written[t.0] = true;
        e.launch(Kernel::Fill(Fill { dst: b, value: 0.0 }))
    }

    /// For a kernel that only adds into its destination (f32): zeroed first if this
    /// is the first contribution. A tensor that needs no gradient (a frozen norm
    /// weight) gets f32 scratch nobody reads (the kernel adds into it anyway).
    pub fn accumulating(&mut self, e: &mut Emitter, t: Tensor) -> Result<Buffer> {
        if !self.needs[t.0] {
            let b = e.scratch(DType::F32, e.g.t(t).len());
            e.launch(Kernel::Fill(Fill { dst: b, value: 0.0 }))?;
            return Ok(b);
        }
        let b = self.buffer(e, t);
        if b.dtype != DType::F32 {
            return Err(Error::InvalidArgument(format!(
                "graph: the gradient of `{}` is {}, but its kernel accumulates into f32",
                e.g.t(t).name,
                b.dtype
            )));
        }
        if !self.written[t.0] {
            self.zero(e, t, b)?;
        }
        Ok(b)
    }

    /// For a kernel that overwrites its destination: the gradient itself on the first
    /// contribution to an intermediate, else scratch to be added by [`Grads::finish`]
    /// (a parameter's gradient is zeroed first). A tensor that needs no gradient gets
    /// scratch nobody reads (the kernel writes it anyway).
    pub fn overwriting(&mut self, e: &mut Emitter, t: Tensor) -> Result<Dst> {
        let i = e.g.t(t);
        let scratch = e.scratch(i.dtype, i.len());
        if !self.needs[t.0] {
            return Ok(Dst {
                buf: scratch,
                add_to: None,
            });
        }
        let g = self.buffer(e, t);
        if !self.written[t.0] {
            if !self.external[t.0] {
                self.written[t.0] = true;
                return Ok(Dst {
                    buf: g,
                    add_to: None,
                });
            }
            self.zero(e, t, g)?;
        }
        Ok(Dst {
            buf: scratch,
            add_to: Some(g),
        })
    }

    pub fn finish(&mut self, e: &mut Emitter, d: Dst) -> Result<()> {
        match d.add_to {
            Some(y) => e.launch(Kernel::Axpy(Axpy {
                alpha: 1.0,
                x: d.buf,
                y,
            })),
            None => Ok(()),
        }
    }

    /// Adds `src` (same length) to the gradient of `t`. With `donate`, `src` is read by
    /// nothing afterwards, so a first contribution to an intermediate of its dtype
    /// takes the buffer over instead of copying it; returns whether it did.
    pub fn add_from(
        &mut self,
        e: &mut Emitter,
        t: Tensor,
        src: Buffer,
        donate: bool,
    ) -> Result<bool> {
        let g = self.buffer(e, t);
        if self.written[t.0] || self.external[t.0] {
            if !self.written[t.0] {
                self.zero(e, t, g)?;
            }
            e.launch(Kernel::Axpy(Axpy {
                alpha: 1.0,
                x: src,
                y: g,
            }))?;
            return Ok(false);
        }
        self.written[t.0] = true;
        if donate && src.dtype == g.dtype {
            self.buf[t.0] = Some(src);
            return Ok(true);
        }
        e.launch(if g.dtype == src.dtype {
            Kernel::Copy(kernels::Copy { src, dst: g })
        } else {
            Kernel::Cast(Cast { src, dst: g })
        })?;
        Ok(false)
    }

    /// Whether the gradient of `t` is its own to hand over ([`Grads::add_from`] with
    /// `donate`): not a read-only alias of another tensor's.
    pub fn donatable(&self, t: Tensor) -> bool {
        !self.aliased[t.0]
    }

    /// Makes `src`, which `owner` has just taken over as its gradient, the gradient of
    /// `t` too, read-only, instead of a copy (the two operands of an add both receive
    /// its output's gradient). Safe, and done, only when nothing writes `src` before
    /// `t`'s gradient has been read: `t` is read by this op alone, so its gradient is
    /// complete here and read once, by the backward of the op that made `t`; every
    /// later write to `src` comes from the other readers of `owner` or from the op
    /// that made `owner` (and through it, further back), which must all come before
    /// `t`'s maker in the forward order, so after it in the reverse sweep. Returns
    /// whether it did.
    pub fn alias(&mut self, t: Tensor, src: Buffer, owner: Tensor) -> bool {
        let Some(made) = self.producer[t.0] else {
            return false;
        };
        let op = self.op;
        let others_first = self.consumers[owner.0]
            .iter()
            .chain(&self.producer[owner.0])
            .all(|&i| i == op || i < made);
        let ok = !self.written[t.0]
            && !self.external[t.0]
            && self.consumers[t.0] == [op]
            && self.buf[owner.0] == Some(src)
            && others_first;
        if ok {
            self.buf[t.0] = Some(src);
            self.written[t.0] = true;
            self.aliased[t.0] = true;
        }
        ok
    }

    /// The gradient of `t` if it has received any contribution.
    fn get(&self, t: Tensor) -> Option<Buffer> {
        if self.written[t.0] {
            self.buf[t.0]
        } else {
            None
        }
    }
}

/// An op's float operands (those a gradient can flow to) and its output.
pub(super) fn operands(op: &Op) -> (Vec<Tensor>, Tensor) {
    match *op {
        Op::Embedding { table, out, .. } => (vec![table], out),
        Op::Linear {
            x, w, b, out, acc, ..
        } => {
            let mut v = vec![x, w];
            v.extend(b);
            v.extend(acc);
            (v, out)
        }
        Op::LayerNorm {
            x,
            weight,
            bias,
            out,
            ..
        } => (vec![x, weight, bias], out),
        Op::Gelu { x, out } => (vec![x], out),
        Op::Add { a, b, out } => (vec![a, b], out),
        Op::Activation { x, out, .. } | Op::Softmax { x, out } | Op::Dropout { x, out, .. } => {
            (vec![x], out)
        }
        Op::CausalAttention { qkv, out, .. } => (vec![qkv], out),
        Op::RmsNorm { x, weight, out, .. } => (vec![x, weight], out),
        Op::Rope { x, out, .. } | Op::LastRow { x, out } => (vec![x], out),
        Op::CachedAttention { q, k, v, out, .. } => (vec![q, k, v], out),
        Op::SwiGlu { gate, up, out } => (vec![gate, up], out),
        Op::GroupedAttention { q, k, v, out, .. } => (vec![q, k, v], out),
        Op::CrossEntropy { logits, losses, .. } => (vec![logits], losses),
        // The target gets no gradient (Graph::mse checks it needs none).
        Op::Mse { pred, losses, .. } => (vec![pred], losses),
    }
}

/// Emits the backward of every op that leads to the loss or to a seeded tensor
/// ([`Graph::grad_seeds`]), last op first, then zeroes the gradients of parameters
/// nothing depends on. Returns, per [`Graph::grad_inputs`] entry, the pinned buffer
/// its gradient is copied to (zeros where nothing depends on it).
pub(super) fn backward(
    g: &Graph,
    e: &mut Emitter,
    saved: &mut [Saved],
    param_grads: &HashMap<Tensor, Buffer>,
) -> Result<Vec<(Tensor, Buffer)>> {
    let mut gr = Grads::new(g, param_grads);
    // A seed is the first contribution, copied: later ones (the tensor may also be
    // read within this graph) add to the copy, never to the caller's upload.
    for &(t, seed) in &g.grad_seeds {
        if gr.needs(t) {
            gr.add_from(e, t, e.val(seed), false)?;
        }
    }
    for i in (0..g.ops.len()).rev() {
        // A checkpointed range ending here: its forward again, into fresh buffers that
        // its backward reads (the forward's were released after their last use there).
        if let Some(r) = g.checkpoints.iter().find(|r| r.end == i + 1) {
            if r.clone().any(|j| gr.needs(operands(&g.ops[j]).1)) {
                for j in r.clone() {
                    e.op = g.op_id(j);
                    saved[j] = ops::forward(&g.ops[j], e)?;
                }
            }
        }
        let (op, s) = (&g.ops[i], &saved[i]);
        gr.op = i;
        e.op = g.op_id(i);
        let (_, out) = operands(op);
        if let Op::CrossEntropy { .. } | Op::Mse { .. } = op {
            // The loss: its gradient is the seed, not a buffer.
            ops::backward(op, s, None, e, &mut gr)?;
        } else if let Some(dout) = gr.get(out) {
            ops::backward(op, s, Some(dout), e, &mut gr)?;
        }
    }
    for p in &g.params {
        if !gr.written[p.tensor.0] {
            gr.zero(e, p.tensor, param_grads[&p.tensor])?;
        }
    }
    // Copied out of the shared buffers, so the caller can read them after the step.
    let mut out = vec![];
    for &t in &g.grad_inputs {
        let i = g.t(t);
        let dst = e.pinned(i.dtype, i.len());
        match gr.get(t) {
            Some(src) if src.dtype == dst.dtype => {
                e.launch(Kernel::Copy(kernels::Copy { src, dst }))?
            }
            Some(src) => e.launch(Kernel::Cast(Cast { src, dst }))?,
            None => e.launch(Kernel::Fill(Fill { dst, value: 0.0 }))?,
        }
        out.push((t, dst));
    }
    Ok(out)
}
