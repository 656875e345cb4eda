//! A two-layer MLP classifier: the smallest model that exercises every training kernel
//! — GEMM with bias, GELU, fused softmax-cross-entropy, mixed precision with a dynamic
//! loss scaler, the overflow check and AdamW.
//!
//! Shapes (B = batch, I = inputs, H = hidden, C = classes):
//!   x  (B, I)  --W1 (I, H), b1 (H)-->  a1 (B, H)  --gelu-->  h (B, H)
//!   h  (B, H)  --W2 (H, C), b2 (C)-->  logits (B, C)  --cross-entropy(y)-->  loss (B)

use super::{tensor_elements, Forward, Init, Model, ParamSpec};
use crate::graph::{Graph, Tensor};
use crate::{DType, Result};

#[derive(Clone, Debug, PartialEq)]
pub struct Mlp {
    pub inputs: usize,
    pub hidden: usize,
    pub classes: usize,
}

impl Model for Mlp {
    fn describe(&self) -> String {
        format!(
            "MLP ({} inputs, {} hidden, {} classes)",
            self.inputs, self.hidden, self.classes
        )
    }

    /// Uniform(-1/sqrt(fan_in), 1/sqrt(fan_in)), PyTorch's Linear default bound; every
    /// tensor decayed (this classifier's choice).
    fn parameters(&self) -> Vec<ParamSpec> {
        let (i, h, c) = (self.inputs, self.hidden, self.classes);
        let init = |fan_in: usize| Init::Uniform(1.0 / (3.0 * fan_in as f32).sqrt());
        vec![
            ParamSpec::new("fc1.weight", &[i, h], init(i)).decayed(),
            ParamSpec::new("fc1.bias", &[h], init(i)).decayed(),
            ParamSpec::new("fc2.weight", &[h, c], init(h)).decayed(),
            ParamSpec::new("fc2.bias", &[c], init(h)).decayed(),
        ]
    }

    fn forward(&self, g: &mut Graph, p: &[Tensor], batch: usize, dtype: DType) -> Result<Forward> {
        let widest = self.inputs.max(self.hidden).max(self.classes);
        tensor_elements("mlp: a micro-batch's widest activation", &[batch, widest])?;
        let x = g.input("x", &[batch, self.inputs], dtype);
        let y = g.input("y", &[batch], DType::U32);
        let a1 = g.linear(x, p[0], Some(p[1]))?;
        let h = g.gelu(a1)?;
        let logits = g.linear(h, p[2], Some(p[3]))?;
        g.cross_entropy(logits, y)?;
        Ok(Forward {
            inputs: vec![x, y],
            prediction: logits,
        })
    }
}
