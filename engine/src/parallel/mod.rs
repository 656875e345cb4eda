//! Training on several devices: data parallelism's gradient exchange through host
//! memory (`exchange`) and ZeRO's partitioning of the optimizer state and gradients
//! across the data-parallel ranks (`zero`).

pub mod exchange;
pub mod zero;
