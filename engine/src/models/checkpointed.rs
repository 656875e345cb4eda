//! Activation checkpointing on any model of the contract: the model as it is, with
//! its blocks' forward passes recomputed right before their backward
//! ([`Graph::checkpoint`]), so the activations of only one block at a time are alive in
//! backward, besides each checkpointed range's inputs (the residual stream between
//! blocks and what a block's first ops read).
//!
//! A range runs from the first op reading one of its first block's parameters to the
//! first op reading the next range's; the last block is never recomputed: its backward
//! comes first, while its forward activations are still alive, so recomputing it would
//! cost time and save nothing at the peak.

use std::sync::Arc;

use super::{Forward, Model, ParamSpec};
use crate::graph::{Graph, Tensor};
use crate::{DType, Error, Result};

/// `model` with activation checkpointing every `every` blocks (1: every block is a
/// range of its own; 2: pairs of blocks, half the boundaries kept and twice the
/// activations alive while one range's backward runs).
pub struct Checkpointed {
    pub model: Arc<dyn Model>,
    pub every: usize,
}

impl Checkpointed {
    pub fn new(model: Arc<dyn Model>, every: usize) -> Result<Checkpointed> {
        if every == 0 {
            return Err(Error::InvalidArgument(
                "activation checkpointing every 0 blocks: give 1 (every block) or more".into(),
            ));
        }
        if model.blocks().len() < 2 {
            return Err(Error::InvalidArgument(format!(
                "activation checkpointing: {} has {} block(s); the last block is never \
                 recomputed, so it needs at least 2",
                model.describe(),
                model.blocks().len()
            )));
        }
        Ok(Checkpointed { model, every })
    }
}

impl Model for Checkpointed {
    fn describe(&self) -> String {
        match self.every {
            1 => format!("{}, activation checkpointing", self.model.describe()),
            n => format!(
                "{}, activation checkpointing every {n} blocks",
                self.model.describe()
            ),
        }
    }

    fn check_sizes(&self) -> Result<()> {
        self.model.check_sizes()
    }

    fn parameters(&self) -> Vec<ParamSpec> {
        self.model.parameters()
    }

    fn forward(&self, g: &mut Graph, p: &[Tensor], batch: usize, dtype: DType) -> Result<Forward> {
        let forward = self.model.forward(g, p, batch, dtype)?;
        let blocks = self.model.blocks();
        // Where each range starts: the first op reading its first block's parameters
        // (moved back to the base linear where that is a LoRA adapter's, which adds into
        // the linear's output in place: the two are recomputed together).
        let start_of = |g: &Graph, b: &Vec<usize>| {
            g.first_op_reading(&b.iter().map(|&i| p[i]).collect::<Vec<_>>())
                .map(|i| g.range_start(i))
        };
        let starts: Vec<Option<usize>> = blocks
            .iter()
            .step_by(self.every)
            .map(|b| start_of(g, b))
            .collect();
        let last_block_start = blocks.last().and_then(|b| start_of(g, b));
        for (k, start) in starts.iter().enumerate() {
            let (Some(start), Some(last)) = (*start, last_block_start) else {
                continue;
            };
            // The range ends where the next one starts, and never takes in the last block.
            let end = starts[k + 1..]
                .iter()
                .flatten()
                .next()
                .copied()
                .unwrap_or(last)
                .min(last);
            if start < end {
                g.checkpoint(start..end)?;
            }
        }
        Ok(forward)
    }

    fn blocks(&self) -> Vec<Vec<usize>> {
        self.model.blocks()
    }
}
