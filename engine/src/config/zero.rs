//! The `zero_optimization` section: ZeRO stages 0 to 2 and their communication settings;
//! stage 3 and offloading are rejected, stage-3-only tuning keys ignored with a warning.

use serde::Serialize;
use serde_json::{Map, Value};

use super::keys::{Inert, Spec};
use super::reader::Reader;

/// ZeRO data-parallel sharding (DeepSpeed's `zero_optimization`), stages 0 to 2.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct ZeroConfig {
    /// 0: plain data parallel; 1: optimizer states sharded; 2: gradients too.
    pub stage: u8,
    /// Copy gradients into one contiguous buffer as they are produced.
    pub contiguous_gradients: bool,
    /// Reduce gradients with reduce-scatter rather than all-reduce.
    pub reduce_scatter: bool,
    /// Elements reduced per bucket.
    pub reduce_bucket_size: u64,
    /// Gather updated parameter shards with all-gather.
    pub allgather_partitions: bool,
    /// Elements gathered per bucket.
    pub allgather_bucket_size: u64,
    /// Overlap gradient communication with backward.
    pub overlap_comm: bool,
    /// Spread gradient copies over ranks round-robin.
    pub round_robin_gradients: bool,
}

impl Default for ZeroConfig {
    /// DeepSpeed's defaults for stages 0 to 2.
    fn default() -> Self {
        ZeroConfig {
            stage: 0,
            contiguous_gradients: true,
            reduce_scatter: true,
            reduce_bucket_size: 500_000_000,
            allgather_partitions: true,
            allgather_bucket_size: 500_000_000,
            overlap_comm: false,
            round_robin_gradients: false,
        }
    }
}

const STAGE3_ONLY: &str = "it is only used by ZeRO stage 3";

const ZERO: Spec = Spec {
    keys: &[
        "stage",
        "contiguous_gradients",
        "reduce_scatter",
        "reduce_bucket_size",
        "allgather_partitions",
        "allgather_bucket_size",
        "overlap_comm",
        "round_robin_gradients",
    ],
    ignored: &[
        ("stage3_prefetch_bucket_size", STAGE3_ONLY),
        ("stage3_param_persistence_threshold", STAGE3_ONLY),
        ("stage3_model_persistence_threshold", STAGE3_ONLY),
        ("stage3_max_live_parameters", STAGE3_ONLY),
        ("stage3_max_reuse_distance", STAGE3_ONLY),
        ("stage3_gather_16bit_weights_on_model_save", STAGE3_ONLY),
        ("stage3_gather_fp16_weights_on_model_save", STAGE3_ONLY),
        ("stage3_use_all_reduce_for_fetch_params", STAGE3_ONLY),
        ("stage3_module_granularity_threshold", STAGE3_ONLY),
        ("sub_group_size", STAGE3_ONLY),
    ],
    unsupported: &[
        (
            "offload_optimizer",
            Inert::NoOffload,
            "offloading optimizer state to CPU or NVMe (not yet)",
        ),
        (
            "offload_param",
            Inert::NoOffload,
            "offloading parameters to CPU or NVMe (not yet)",
        ),
        (
            "cpu_offload",
            Inert::Bool(false),
            "offloading optimizer state to CPU (not yet)",
        ),
        (
            "cpu_offload_params",
            Inert::Bool(false),
            "offloading parameters to CPU (not yet)",
        ),
        (
            "elastic_checkpoint",
            Inert::Bool(false),
            "elastic ZeRO checkpoints",
        ),
        (
            "load_from_fp32_weights",
            Inert::Bool(true),
            "resuming from 16-bit weights instead of the fp32 master copy",
        ),
        (
            "ignore_unused_parameters",
            Inert::Bool(true),
            "failing on parameters that receive no gradient",
        ),
        (
            "zero_quantized_weights",
            Inert::Bool(false),
            "quantized weight communication (ZeRO++)",
        ),
        (
            "zero_quantized_nontrainable_weights",
            Inert::Bool(false),
            "quantized weight communication (ZeRO++)",
        ),
        (
            "zero_quantized_gradients",
            Inert::Bool(false),
            "quantized gradient communication (ZeRO++)",
        ),
        (
            "zero_hpz_partition_size",
            Inert::Num(1.0),
            "hierarchical partitioning (ZeRO++)",
        ),
        ("mics_shard_size", Inert::Num(-1.0), "MiCS sharding"),
        ("legacy_stage1", Inert::Bool(false), "legacy ZeRO stage 1"),
    ],
    hints: &[],
};

impl Reader {
    pub(super) fn zero(&mut self, root: &Map<String, Value>) -> ZeroConfig {
        let empty = Map::new();
        let sec = self.section(root, "", "zero_optimization").ok().flatten();
        let zp = "zero_optimization";
        if let Some(s) = sec {
            self.check_keys(s, zp, &ZERO);
        }
        let z = sec.unwrap_or(&empty);
        let d = ZeroConfig::default();
        let stage = self.uint_or(z, zp, "stage", (0, 3), 0) as u8;
        if stage == 3 {
            self.problem(
                "zero_optimization.stage",
                "ZeRO stage 3 (partitioned parameters) is not supported by Kiln yet",
                "use stage 2 (shards gradients and optimizer states) or stage 1",
            );
        }
        let size = (1, u64::MAX);
        ZeroConfig {
            stage,
            contiguous_gradients: self.bool_or(
                z,
                zp,
                "contiguous_gradients",
                d.contiguous_gradients,
            ),
            reduce_scatter: self.bool_or(z, zp, "reduce_scatter", d.reduce_scatter),
            reduce_bucket_size: self.uint_or(
                z,
                zp,
                "reduce_bucket_size",
                size,
                d.reduce_bucket_size,
            ),
            allgather_partitions: self.bool_or(
                z,
                zp,
                "allgather_partitions",
                d.allgather_partitions,
            ),
            allgather_bucket_size: self.uint_or(
                z,
                zp,
                "allgather_bucket_size",
                size,
                d.allgather_bucket_size,
            ),
            overlap_comm: self.bool_or(z, zp, "overlap_comm", d.overlap_comm),
            round_robin_gradients: self.bool_or(
                z,
                zp,
                "round_robin_gradients",
                d.round_robin_gradients,
            ),
        }
    }
}
