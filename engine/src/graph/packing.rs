//! Packed sequences: one row of a micro-batch holds several documents (training
//! examples laid end to end). A graph recorded after [`Graph::pack_documents`] takes two
//! more inputs, each (B, T) u32: every row's document start and every token's position
//! in its document. Attention then sees only the keys of a row's own document (the
//! fused kernels read the starts: no T x T mask exists), and positions restart at each
//! document, for learned position embeddings ([`Graph::positions`]) and RoPE alike. So
//! a packed row computes what each of its documents would alone.

use super::{Attention, Graph, Tensor};
use crate::{DType, Error, Result};

/// The two inputs of a packed graph, made on first use.
#[derive(Clone, Debug, Default)]
pub(crate) struct Packing {
    starts: Option<Tensor>,
    positions: Option<Tensor>,
}

/// Input names, as errors and the plan's bindings show them.
/// The names of a packed graph's inputs: each token's document start and position.
pub const STARTS: &str = "document_starts";
pub const POSITIONS: &str = "document_positions";

impl Graph {
    /// Records what follows over packed sequences (see the module docs). Call before
    /// the model's forward; a decoding graph cannot pack.
    pub fn pack_documents(&mut self) -> Result<()> {
        if self.decode.is_some() {
            return Err(Error::InvalidArgument(
                "graph: a decoding graph runs one sequence; it cannot pack documents".into(),
            ));
        }
        self.packing.get_or_insert_with(Packing::default);
        Ok(())
    }

    /// Whether the graph packs documents.
    pub fn packs_documents(&self) -> bool {
        self.packing.is_some()
    }

    /// The packing inputs a micro-batch gives after the model's own, in order: the
    /// document starts, then the positions. An error when the model's forward read
    /// neither or only one of them (a model without attention, or without positions,
    /// cannot keep packed documents apart).
    pub fn packed_inputs(&self) -> Result<Vec<Tensor>> {
        let Some(p) = &self.packing else {
            return Ok(vec![]);
        };
        match (p.starts, p.positions) {
            (Some(s), Some(q)) => Ok(vec![s, q]),
            (starts, _) => Err(Error::InvalidArgument(format!(
                "graph: packed documents, but the model's forward {} (a model needs causal \
                 attention and positions, learned or rotary, to train on packed sequences); \
                 train it with one example per row instead",
                if starts.is_none() {
                    "has no attention"
                } else {
                    "reads no positions"
                }
            ))),
        }
    }

    /// When packing: the positions input for rows of `shape` (B, T, ..), made on first
    /// use; `None` otherwise.
    pub(super) fn packed_positions(&mut self, op: &str, shape: &[usize]) -> Result<Option<Tensor>> {
        self.packed_input(op, shape, false)
    }

    /// When packing: the document-starts input for rows of `shape` (B, T, ..).
    pub(super) fn packed_starts(&mut self, op: &str, shape: &[usize]) -> Result<Option<Tensor>> {
        self.packed_input(op, shape, true)
    }

    fn packed_input(&mut self, op: &str, shape: &[usize], starts: bool) -> Result<Option<Tensor>> {
        let Some(p) = &self.packing else {
            return Ok(None);
        };
        if shape.len() < 2 {
            return Err(Error::InvalidArgument(format!(
                "graph: {op} over packed documents: rows {shape:?} must be (B, T, ..)"
            )));
        }
        let bt = [shape[0], shape[1]];
        let (have, name) = if starts {
            (p.starts, STARTS)
        } else {
            (p.positions, POSITIONS)
        };
        if let Some(t) = have {
            if self.t(t).shape != bt {
                return Err(Error::InvalidArgument(format!(
                    "graph: {op} over packed documents: rows {bt:?}, but the batch's {name} \
                     are {:?}",
                    self.t(t).shape
                )));
            }
            return Ok(Some(t));
        }
        let t = self.input(name, &bt, DType::U32);
        let p = self.packing.as_mut().expect("checked");
        if starts {
            p.starts = Some(t);
        } else {
            p.positions = Some(t);
        }
        Ok(Some(t))
    }

    /// The attention mode a packed graph runs: the fused kernels, the ones that read
    /// document starts (the straightforward path's T x T scores have no such mask).
    /// Unchanged when not packing.
    pub(super) fn packed_mode(
        &self,
        op: &str,
        mode: Attention,
        dim: usize,
        dtype: DType,
    ) -> Result<Attention> {
        if self.packing.is_none() || mode == Attention::Fused {
            return Ok(mode);
        }
        if Attention::fused_takes(dim, dtype) {
            return Ok(Attention::Fused);
        }
        Err(Error::InvalidArgument(format!(
            "graph: {op}: packed documents need the fused attention, which takes head dims \
             up to {} (even for 16-bit activations), not {dim}; train with one example per \
             row instead",
            crate::ATTENTION_MAX_DIM
        )))
    }
}
