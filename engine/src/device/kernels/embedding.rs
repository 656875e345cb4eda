//! Token embedding lookup and its accumulating backward.

use super::check::{float, rows_of, same_dtype, same_len};
use super::{KernelSpec, Operand};
use crate::{Buffer, DType, Result};

/// `out[i] = table[tokens[i]]`, rows of `dim` elements. A token outside the table
/// gives NaN rows (so an overflow check catches it).
#[derive(Clone, Debug, PartialEq)]
pub struct Embedding {
    pub tokens: Buffer,
    pub table: Buffer,
    pub out: Buffer,
    pub dim: usize,
}

impl KernelSpec for Embedding {
    fn name(&self) -> &'static str {
        "embedding"
    }

    fn operands_mut(&mut self) -> Vec<Operand<'_>> {
        vec![
            Operand::read(&mut self.tokens),
            Operand::read(&mut self.table),
            Operand::write(&mut self.out),
        ]
    }

    fn check(&self) -> Result<()> {
        let k = self.name();
        let Embedding {
            tokens,
            table,
            out,
            dim,
        } = self;
        rows_of(k, table, *dim)?;
        same_dtype(k, "tokens", tokens, DType::U32)?;
        float(k, "out", out)?;
        same_len(k, "out", out, tokens.len * dim)
    }

    fn flops_per_element(&self) -> f64 {
        0.0
    }
}

/// `dtable[tokens[i]] += dout[i]` (f32 `dtable`, accumulated), deterministic: each
/// column is summed over the tokens in order.
#[derive(Clone, Debug, PartialEq)]
pub struct EmbeddingBackward {
    pub tokens: Buffer,
    pub dout: Buffer,
    pub dtable: Buffer,
    pub dim: usize,
}

impl KernelSpec for EmbeddingBackward {
    fn name(&self) -> &'static str {
        "embedding_backward"
    }

    fn operands_mut(&mut self) -> Vec<Operand<'_>> {
        vec![
            Operand::read(&mut self.tokens),
            Operand::read(&mut self.dout),
            Operand::write_split(&mut self.dtable),
        ]
    }

    fn check(&self) -> Result<()> {
        let k = self.name();
        let EmbeddingBackward {
            tokens,
            dout,
            dtable,
            dim,
        } = self;
        same_dtype(k, "tokens", tokens, DType::U32)?;
        float(k, "dout", dout)?;
        same_len(k, "dout", dout, tokens.len * dim)?;
        same_dtype(k, "dtable", dtable, DType::F32)?;
        rows_of(k, dtable, *dim).map(|_| ())
    }

    fn flops_per_element(&self) -> f64 {
        1.0
    }
}
