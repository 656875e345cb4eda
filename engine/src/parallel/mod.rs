//! Training on several devices: ZeRO's partitioning of the optimizer state and
//! gradients across data-parallel ranks.

pub mod zero;
