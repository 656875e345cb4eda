//! Training on several devices: data parallelism's gradient exchange through host
//! memory (`exchange`), ZeRO's partitioning of the optimizer state and gradients
//! across the data-parallel ranks, on their devices or offloaded to host memory
//! (`zero`; which rank owns what in `shard`; stage 3's updated weights go to host
//! memory, from which the replicas load each block), and the collective operations between the
//! processes of a multi-process job (`collective`; over MPI in `mpi`, with the `mpi`
//! feature), and for pipeline parallelism the 1F1B schedule (`pipeline_schedule`),
//! the cut of a model's blocks into stages (`pipeline_partition`) and the executor
//! that trains a model over several devices with them (`pipeline`; its stages' cut,
//! memory and compile in `pipeline_stages`, a step's threads and decision in
//! `pipeline_run`).

pub mod collective;
pub mod exchange;
#[cfg(feature = "mpi")]
pub mod mpi;
pub mod pipeline;
pub mod pipeline_partition;
mod pipeline_run;
pub mod pipeline_schedule;
mod pipeline_stages;
pub mod shard;
pub mod zero;
