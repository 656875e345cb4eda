//! The `zero_optimization` section: ZeRO stages 0 to 2 and their communication settings;
//! stage 3 and offloading are rejected, stage-3-only tuning keys ignored with a warning.

use serde::Serialize;
use serde_json::{Map, Value};

use super::keys::{Inert, Spec};
use super::reader::{auto_at, Reader};

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
const OFFLOAD_ONLY: &str = "it only matters with offloading, which Kiln does not implement";

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
        ("stage3_prefetch_bucket_size", Inert::Any, STAGE3_ONLY),
        (
            "stage3_param_persistence_threshold",
            Inert::Any,
            STAGE3_ONLY,
        ),
        (
            "stage3_model_persistence_threshold",
            Inert::Any,
            STAGE3_ONLY,
        ),
        ("stage3_max_live_parameters", Inert::Any, STAGE3_ONLY),
        ("stage3_max_reuse_distance", Inert::Any, STAGE3_ONLY),
        (
            "stage3_gather_16bit_weights_on_model_save",
            Inert::Any,
            STAGE3_ONLY,
        ),
        (
            "stage3_gather_fp16_weights_on_model_save",
            Inert::Any,
            STAGE3_ONLY,
        ),
        (
            "stage3_use_all_reduce_for_fetch_params",
            Inert::Any,
            STAGE3_ONLY,
        ),
        (
            "stage3_module_granularity_threshold",
            Inert::Any,
            STAGE3_ONLY,
        ),
        // The same settings under the names DeepSpeed's schema gives them.
        ("prefetch_bucket_size", Inert::Any, STAGE3_ONLY),
        ("param_persistence_threshold", Inert::Any, STAGE3_ONLY),
        ("model_persistence_threshold", Inert::Any, STAGE3_ONLY),
        ("max_live_parameters", Inert::Any, STAGE3_ONLY),
        ("max_reuse_distance", Inert::Any, STAGE3_ONLY),
        (
            "gather_16bit_weights_on_model_save",
            Inert::Any,
            STAGE3_ONLY,
        ),
        ("sub_group_size", Inert::Any, STAGE3_ONLY),
        ("memory_efficient_linear", Inert::Any, STAGE3_ONLY),
        ("override_module_apply", Inert::Any, STAGE3_ONLY),
        ("pipeline_loading_checkpoint", Inert::Any, STAGE3_ONLY),
        ("log_trace_cache_warnings", Inert::Any, STAGE3_ONLY),
        ("cpu_offload_use_pin_memory", Inert::Any, OFFLOAD_ONLY),
        (
            "use_multi_rank_bucket_allreduce",
            Inert::Any,
            "it chooses how buckets are reduced, a communication pattern that does not \
             change the result; Kiln has its own",
        ),
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
        (
            "mics_hierarchical_params_gather",
            Inert::Bool(false),
            "MiCS hierarchical parameter gathering",
        ),
        (
            "zeropp_loco_param",
            Inert::Null,
            "ZeRO++ LoCo gradient compression",
        ),
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
        // Kept as a usize by the engine (elements per bucket).
        let size = (1, usize::MAX as u64);
        let reduce_bucket_size =
            self.bucket_size(z, "reduce_bucket_size", size, d.reduce_bucket_size);
        let allgather_bucket_size =
            self.bucket_size(z, "allgather_bucket_size", size, d.allgather_bucket_size);
        ZeroConfig {
            stage,
            contiguous_gradients: self.bool_or(
                z,
                zp,
                "contiguous_gradients",
                d.contiguous_gradients,
            ),
            reduce_scatter: self.bool_or(z, zp, "reduce_scatter", d.reduce_scatter),
            reduce_bucket_size,
            allgather_partitions: self.bool_or(
                z,
                zp,
                "allgather_partitions",
                d.allgather_partitions,
            ),
            allgather_bucket_size,
            overlap_comm: self.bool_or(z, zp, "overlap_comm", d.overlap_comm),
            round_robin_gradients: self.bool_or(
                z,
                zp,
                "round_robin_gradients",
                d.round_robin_gradients,
            ),
        }
    }

    /// A bucket size; `"auto"` (the Hugging Face Trainer's hidden_size², which needs the
    /// model) keeps DeepSpeed's default: buckets only group gradients for communication,
    /// so their size does not change the result.
    fn bucket_size(
        &mut self,
        z: &Map<String, Value>,
        key: &str,
        range: (u64, u64),
        default: u64,
    ) -> u64 {
        if auto_at(z, key) {
            self.resolved_auto(
                &format!("zero_optimization.{key}"),
                format!(
                    "DeepSpeed's default {default}; Hugging Face would use the model's \
                     hidden_size², and the size only groups gradients for communication"
                ),
            );
            return default;
        }
        self.uint_or(z, "zero_optimization", key, range, default)
    }
}
