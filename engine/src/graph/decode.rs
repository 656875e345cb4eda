//! The model's own forward, recorded for generation. A graph made by
//! [`Graph::decoding`] records the same ops a model's forward always calls, with three
//! differences the ops make themselves, so no model writes a second forward:
//!
//! - the rows are the new tokens of one sequence, (1, R), at positions held in a u32
//!   input ([`Graph::decode_positions`]) that the caller uploads per pass: RoPE turns
//!   each row by its own position, and [`Graph::positions`] (GPT-2's learned position
//!   embedding) is that input;
//! - every attention op becomes [`Op::CachedAttention`]: its keys and values are written
//!   into that layer's K and V cache, inputs (KV, max_len, D) the caller keeps between
//!   passes ([`Graph::decode_caches`], in layer order), and its queries attend over the
//!   cache up to their own position: causal attention within the pass, and over every
//!   earlier pass;
//! - the loss is recorded but not run: [`Graph::decode_pass`] keeps the ops the
//!   prediction needs (and every cache write), and runs the row-wise ones after the last
//!   attention (the final norm, the head) on the last row alone, whose logits predict the
//!   next token.
//!
//! Shapes: R new rows, KV K/V heads, D head dim, C the feature dim.

use std::collections::HashMap;

use super::{split, Graph, Op, Source, Tensor};
use crate::{DType, Error, Result};

/// What a decoding graph holds beyond a training one.
#[derive(Clone, Debug)]
pub(crate) struct Decoding {
    /// Positions each cache holds.
    max_len: usize,
    /// The rows' positions, (1, R) u32, once an op asked for them.
    positions: Option<Tensor>,
    /// (K, V) per attention op, in recording order.
    caches: Vec<(Tensor, Tensor)>,
}

impl Graph {
    /// A graph whose attention ops read and extend K/V caches of `max_len` positions:
    /// record a model's forward on it (batch 1, the pass's rows as the sequence), then
    /// [`Graph::decode_pass`] and [`Graph::compile_forward`].
    pub fn decoding(max_len: usize) -> Graph {
        Graph {
            decode: Some(Decoding {
                max_len,
                positions: None,
                caches: vec![],
            }),
            ..Graph::default()
        }
    }

    /// The positions input of a decoding graph (u32, one per row), if an op reads it.
    pub fn decode_positions(&self) -> Option<Tensor> {
        self.decode.as_ref()?.positions
    }

    /// The (K, V) cache inputs of a decoding graph, one pair per attention op in
    /// recording order (a transformer's layers), each (KV, max_len, D).
    pub fn decode_caches(&self) -> &[(Tensor, Tensor)] {
        self.decode.as_ref().map_or(&[], |d| &d.caches)
    }

    /// The positions of a (b, t) batch of tokens, for a learned position embedding:
    /// when training, the constant `t` of each row; when decoding, the positions input;
    /// over packed documents, each token's place in its document (an input too).
    pub fn positions(&mut self, b: usize, t: usize) -> Result<Tensor> {
        if self.decode.is_some() {
            let p = self.decode_positions_for("positions", &[b, t, 1])?;
            return Ok(p.expect("a decoding graph has positions"));
        }
        if let Some(p) = self.packed_positions("positions", &[b, t])? {
            return Ok(p);
        }
        let positions: Vec<u32> = (0..b * t).map(|i| (i % t) as u32).collect();
        self.constant("positions", &[b, t], crate::HostData::U32(positions))
    }

    /// When decoding: the positions input for rows of `shape` (1, R, C), made on first
    /// use; `None` when training.
    pub(super) fn decode_positions_for(
        &mut self,
        op: &str,
        shape: &[usize],
    ) -> Result<Option<Tensor>> {
        let Some(d) = &self.decode else {
            return Ok(None);
        };
        if shape.len() != 3 || shape[0] != 1 {
            return Err(Error::InvalidArgument(format!(
                "graph: {op} while decoding: rows {shape:?} must be (1, R, C); decoding runs \
                 one sequence (record the forward with batch 1)"
            )));
        }
        let rows = shape[1];
        if let Some(p) = d.positions {
            if self.t(p).shape != [1, rows] {
                return Err(Error::InvalidArgument(format!(
                    "graph: {op} while decoding: {rows} rows, but the pass has {:?} positions",
                    self.t(p).shape
                )));
            }
            return Ok(Some(p));
        }
        let p = self.input("positions", &[1, rows], DType::U32);
        self.decode.as_mut().expect("checked").positions = Some(p);
        Ok(Some(p))
    }

    /// Records [`Op::CachedAttention`] for the next layer: its caches are new inputs.
    /// `qkv` are q, k, v with their column offsets (one tensor thrice for GPT-2).
    pub(super) fn cached_attention(
        &mut self,
        [q, k, v]: [Tensor; 3],
        offsets: [usize; 3],
        heads: usize,
        kv_heads: usize,
        dim: usize,
    ) -> Result<Tensor> {
        let qi = self.t(q).clone();
        let dtype = qi.dtype;
        if dim > crate::ATTENTION_MAX_DIM || (dtype.size() == 2 && !dim.is_multiple_of(2)) {
            return Err(Error::InvalidArgument(format!(
                "graph: attention while decoding: the cached attention takes head dims up to \
                 {} (even for 16-bit activations), not {dim}",
                crate::ATTENTION_MAX_DIM
            )));
        }
        let positions = self
            .decode_positions_for("attention", &qi.shape)?
            .expect("called when decoding");
        let d = self.decode.as_ref().expect("called when decoding");
        let (layer, max_len) = (d.caches.len(), d.max_len);
        let shape = [kv_heads, max_len, dim];
        let k_cache = self.input(&format!("k_cache.{layer}"), &shape, dtype);
        let v_cache = self.input(&format!("v_cache.{layer}"), &shape, dtype);
        self.decode
            .as_mut()
            .expect("called when decoding")
            .caches
            .push((k_cache, v_cache));
        let out = self.op_out("attention", vec![1, qi.shape[1], heads * dim], dtype);
        self.ops.push(Op::CachedAttention {
            q,
            k,
            v,
            offsets,
            k_cache,
            v_cache,
            positions,
            out,
            heads,
            kv_heads,
        });
        Ok(out)
    }

    /// The graph one decode pass runs, and `prediction`'s tensor in it (1, 1, V): the
    /// ops `prediction` needs and every cache write, nothing else (the loss and its
    /// targets go); row-wise ops whose results only reach the prediction's last row run
    /// on that row alone, reading the last row of their other operands
    /// ([`Op::LastRow`]). Each such row is computed by the same kernel as in the whole
    /// pass, so the logits are the whole pass's last row.
    pub fn decode_pass(&self, prediction: Tensor) -> Result<(Graph, Tensor)> {
        self.info(prediction)?;
        if self.decode.is_none() {
            return Err(Error::InvalidArgument(
                "graph: decode_pass of a graph not recorded for decoding; record the \
                 forward on Graph::decoding"
                    .into(),
            ));
        }
        // What each tensor is needed for, from the prediction back: nothing, its last
        // row, or all of it.
        #[derive(Clone, Copy, PartialEq, PartialOrd)]
        enum Need {
            Nothing,
            LastRow,
            All,
        }
        // A one-row pass (a decoding step) is its own last row: nothing to gather.
        let whole = if self.t(prediction).rows() == 1 {
            Need::All
        } else {
            Need::LastRow
        };
        let mut need = vec![Need::Nothing; self.tensors.len()];
        need[prediction.0] = whole;
        let mut live = vec![false; self.ops.len()];
        let mut last_row_op = vec![false; self.ops.len()];
        for (i, op) in self.ops.iter().enumerate().rev() {
            let out = split::output(op);
            let writes_cache = matches!(op, Op::CachedAttention { .. });
            if need[out.0] == Need::Nothing && !writes_cache {
                continue;
            }
            live[i] = true;
            let rows = self.row_operands(op);
            last_row_op[i] = need[out.0] == Need::LastRow && rows.is_some();
            let rows = rows.unwrap_or_default();
            for r in split::reads(op) {
                let n = match last_row_op[i] && rows.contains(&r) {
                    true => Need::LastRow,
                    false => Need::All,
                };
                if need[r.0] < n {
                    need[r.0] = n;
                }
            }
        }
        let mut g = Graph {
            tensors: self.tensors.clone(),
            params: self.params.clone(),
            constants: self.constants.clone(),
            decode: self.decode.clone(),
            ..Graph::default()
        };
        // Row tensors computed in full, and their last rows once gathered.
        let mut last_of: HashMap<Tensor, Tensor> = HashMap::new();
        let mut gather = |g: &mut Graph, t: Tensor| -> Tensor {
            *last_of.entry(t).or_insert_with(|| {
                let i = g.t(t).clone();
                let out = g.push(
                    format!("{}.last_row", i.name),
                    last_row_shape(&i.shape),
                    i.dtype,
                    Source::Op,
                );
                g.ops.push(Op::LastRow { x: t, out });
                out
            })
        };
        let mut on_last_row = vec![false; self.tensors.len()];
        for (i, op) in self.ops.iter().enumerate() {
            if !live[i] {
                continue;
            }
            let mut op = op.clone();
            if last_row_op[i] {
                let rows = self
                    .row_operands(&op)
                    .expect("a last-row op has row operands");
                let mut fields = split::tensors_mut(&mut op);
                let out = fields.pop().expect("an op has an output");
                for t in fields {
                    if rows.contains(t) && !on_last_row[t.0] {
                        *t = gather(&mut g, *t);
                    }
                }
                let shape = last_row_shape(&g.t(*out).shape);
                g.tensors[out.0].shape = shape;
                on_last_row[out.0] = true;
            }
            g.ops.push(op);
        }
        let logits = match on_last_row[prediction.0] || whole == Need::All {
            true => prediction,
            false => gather(&mut g, prediction),
        };
        g.outputs.push(logits);
        Ok((g, logits))
    }
}

impl Graph {
    /// The operands of `op` whose rows it maps one to one to its output's rows, when
    /// that is all it reads besides parameters and constants (so its last output row
    /// needs only their last rows); `None` for any other op.
    fn row_operands(&self, op: &Op) -> Option<Vec<Tensor>> {
        let rows = match *op {
            Op::Linear { x, acc, .. } => std::iter::once(x).chain(acc).collect(),
            Op::LayerNorm { x, .. }
            | Op::RmsNorm { x, .. }
            | Op::Gelu { x, .. }
            | Op::Activation { x, .. }
            | Op::Softmax { x, .. } => vec![x],
            Op::Add { a, b, .. } => vec![a, b],
            Op::SwiGlu { gate, up, .. } => vec![gate, up],
            _ => return None,
        };
        let fixed = |t: &Tensor| {
            matches!(
                self.t(*t).source,
                Source::Param(_) | Source::Frozen | Source::Constant(_)
            )
        };
        split::reads(op)
            .iter()
            .all(|t| rows.contains(t) || fixed(t))
            .then_some(rows)
    }
}

/// One row of a tensor of `shape`: the leading dims 1, the feature dim kept.
fn last_row_shape(shape: &[usize]) -> Vec<usize> {
    let mut s = vec![1; shape.len().max(1)];
    *s.last_mut().expect("at least one dim") = shape.last().copied().unwrap_or(1);
    s
}

impl Graph {
    /// The token input of a decode pass: the one input its ops read besides the
    /// positions and the caches.
    pub fn decode_tokens(&self) -> Result<Tensor> {
        let state: Vec<Tensor> = self
            .decode_positions()
            .into_iter()
            .chain(self.decode_caches().iter().flat_map(|&(k, v)| [k, v]))
            .collect();
        let mut data: Vec<Tensor> = self
            .ops
            .iter()
            .flat_map(split::reads)
            .filter(|t| self.t(*t).source == Source::Input && !state.contains(t))
            .collect();
        data.sort();
        data.dedup();
        match data[..] {
            [tokens] if self.t(tokens).dtype == DType::U32 => Ok(tokens),
            _ => Err(Error::InvalidArgument(format!(
                "graph: a decode pass reads its tokens and nothing else from the caller, but \
                 this one reads {}",
                data.iter()
                    .map(|&t| format!("`{}`", self.t(t).name))
                    .collect::<Vec<_>>()
                    .join(", ")
            ))),
        }
    }
}
