//! The `zero_optimization` section: ZeRO stages 0 to 3, their communication settings,
//! stage 3's persistence threshold and the optimizer state's offload to host memory
//! (`offload_optimizer`) and, at stage 3, of the parameters' updated 16-bit copies
//! (`offload_param`); NVMe is rejected, DeepSpeed's stage-3 fetch tuning keys accepted
//! with a note saying why they change nothing.

use serde::Serialize;
use serde_json::{Map, Value};

use super::keys::{Inert, Spec};
use super::provenance::Provenance;
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
    /// ZeRO-Offload (`offload_optimizer.device: "cpu"`, or the old `cpu_offload: true`):
    /// each rank's shard of the f32 master weights and moments lives in host memory
    /// and the host runs its optimizer step. Stages 1, 2 and 3.
    pub offload_optimizer: bool,
    /// Stage 3's `offload_param.device: "cpu"` (or the old `cpu_offload_params: true`):
    /// no device holds a 16-bit copy of its shard; the host makes the updated copy from
    /// the downloaded f32 master (with `offload_optimizer` it is made there already).
    pub offload_param: bool,
    /// Stage 3: tensors of fewer elements keep a model copy on every device instead of
    /// taking turns in the first block's buffers (`stage3_param_persistence_threshold`).
    pub param_persistence_threshold: u64,
}

impl Default for ZeroConfig {
    /// DeepSpeed's defaults.
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
            offload_optimizer: false,
            offload_param: false,
            param_persistence_threshold: 100_000,
        }
    }
}

const STAGE3_ONLY: &str = "it tunes a part of DeepSpeed's ZeRO stage 3 that Kiln's stage 3 \
    does not have";
const STAGE3_FETCH: &str = "it tunes how DeepSpeed's stage 3 fetches parameters; Kiln's \
    stage 3 keeps one block's weights live on a device and loads each block's from host \
    memory just before its first kernel (a block still live at the turn from forward to \
    backward is not loaded again)";
const WHOLE_SAVES: &str = "Kiln's checkpoints and saved models always hold whole tensors";
const PINNED: &str = "pinned (page-locked) host memory speeds up a CUDA device's copies; \
    Kiln's copies go through the driver's own staging buffers either way";
const NVME_ONLY: &str = "it only matters when offloading to NVMe, which Kiln does not do";

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
        "offload_optimizer",
        "cpu_offload",
        "offload_param",
        "cpu_offload_params",
        "stage3_param_persistence_threshold",
        "param_persistence_threshold",
    ],
    ignored: &[
        ("stage3_prefetch_bucket_size", Inert::Any, STAGE3_FETCH),
        (
            "stage3_model_persistence_threshold",
            Inert::Any,
            STAGE3_ONLY,
        ),
        ("stage3_max_live_parameters", Inert::Any, STAGE3_FETCH),
        ("stage3_max_reuse_distance", Inert::Any, STAGE3_FETCH),
        (
            "stage3_gather_16bit_weights_on_model_save",
            Inert::Any,
            WHOLE_SAVES,
        ),
        (
            "stage3_gather_fp16_weights_on_model_save",
            Inert::Any,
            WHOLE_SAVES,
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
        ("prefetch_bucket_size", Inert::Any, STAGE3_FETCH),
        ("model_persistence_threshold", Inert::Any, STAGE3_ONLY),
        ("max_live_parameters", Inert::Any, STAGE3_FETCH),
        ("max_reuse_distance", Inert::Any, STAGE3_FETCH),
        (
            "gather_16bit_weights_on_model_save",
            Inert::Any,
            WHOLE_SAVES,
        ),
        ("sub_group_size", Inert::Any, STAGE3_ONLY),
        ("memory_efficient_linear", Inert::Any, STAGE3_ONLY),
        ("override_module_apply", Inert::Any, STAGE3_ONLY),
        ("pipeline_loading_checkpoint", Inert::Any, STAGE3_ONLY),
        ("log_trace_cache_warnings", Inert::Any, STAGE3_ONLY),
        ("cpu_offload_use_pin_memory", Inert::Any, PINNED),
        (
            "use_multi_rank_bucket_allreduce",
            Inert::Any,
            "it chooses how buckets are reduced, a communication pattern that does not \
             change the result; Kiln has its own",
        ),
    ],
    unsupported: &[
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

/// `zero_optimization.offload_optimizer`'s keys.
const OFFLOAD_OPTIMIZER: Spec = Spec {
    keys: &["device"],
    ignored: &[
        ("pin_memory", Inert::Any, PINNED),
        ("nvme_path", Inert::Any, NVME_ONLY),
        ("buffer_count", Inert::Any, NVME_ONLY),
        ("pipeline_read", Inert::Any, NVME_ONLY),
        ("pipeline_write", Inert::Any, NVME_ONLY),
        ("pipeline", Inert::Any, NVME_ONLY),
        ("fast_init", Inert::Any, NVME_ONLY),
    ],
    unsupported: &[(
        "ratio",
        Inert::Num(1.0),
        "offloading part of the optimizer state (a ratio below 1 keeps the rest on the \
         device)",
    )],
    hints: &[],
};

/// `zero_optimization.offload_param`'s keys.
const OFFLOAD_PARAM: Spec = Spec {
    keys: &["device"],
    ignored: &[
        ("pin_memory", Inert::Any, PINNED),
        ("nvme_path", Inert::Any, NVME_ONLY),
        ("buffer_count", Inert::Any, NVME_ONLY),
        ("buffer_size", Inert::Any, NVME_ONLY),
        ("max_in_cpu", Inert::Any, NVME_ONLY),
    ],
    unsupported: &[],
    hints: &[],
};

impl Reader {
    /// `offload_optimizer` or `offload_param` (`name`, with keys `spec`, offloading
    /// `what`; `None` when absent or unreadable): true for `"cpu"`, false for `"none"`;
    /// NVMe is refused with the reason.
    fn offload_section(
        &mut self,
        z: &Map<String, Value>,
        (name, spec, what): (&str, &Spec, &str),
    ) -> Option<bool> {
        let prefix = format!("zero_optimization.{name}");
        let sec = self.section(z, "zero_optimization", name).ok()??;
        self.check_keys(sec, &prefix, spec);
        let expected = "\"cpu\" or \"none\"";
        match self.string(sec, &prefix, "device", expected) {
            Ok(Some("cpu")) => Some(true),
            Ok(Some("none")) => Some(false),
            Ok(Some("nvme")) => {
                self.problem(
                    &format!("{prefix}.device"),
                    format!(
                        "offloading {what} to NVMe is not supported by Kiln: it keeps \
                         offloaded state in host memory"
                    ),
                    "set \"device\": \"cpu\" (host memory)",
                );
                None
            }
            Ok(Some(other)) => {
                self.wrong_value(
                    &format!("{prefix}.device"),
                    expected,
                    &Value::String(other.to_string()),
                    Some("\"none\""),
                );
                None
            }
            // DeepSpeed's default device is "none".
            Ok(None) => Some(false),
            Err(_) => None,
        }
    }

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
        // DeepSpeed's schema spells it without the prefix too.
        let default = d.param_persistence_threshold;
        let long = "stage3_param_persistence_threshold";
        let threshold = self.persistence_threshold(z, long, default);
        let short = self.persistence_threshold(z, "param_persistence_threshold", default);
        if z.contains_key(long)
            && z.contains_key("param_persistence_threshold")
            && threshold != short
        {
            self.problem(
                "zero_optimization.param_persistence_threshold",
                format!("it says {short} but {long} says {threshold}: the same setting"),
                "keep one of the two",
            );
        }
        let param_persistence_threshold = if z.contains_key(long) {
            threshold
        } else {
            short
        };
        // Kept as a usize by the engine (elements per bucket).
        let size = (1, usize::MAX as u64);
        let reduce_bucket_size =
            self.bucket_size(z, "reduce_bucket_size", size, d.reduce_bucket_size);
        let allgather_bucket_size =
            self.bucket_size(z, "allgather_bucket_size", size, d.allgather_bucket_size);
        let offload_optimizer = self.offload(
            z,
            ("cpu_offload", "offload_optimizer", &OFFLOAD_OPTIMIZER),
            "the optimizer state",
        );
        if offload_optimizer && stage == 0 {
            self.problem(
                "zero_optimization.offload_optimizer",
                "offloading the optimizer state needs ZeRO stage 1, 2 or 3: the host steps \
                 each data-parallel rank's shard of it",
                "set zero_optimization.stage to 1, 2 or 3 (on one device too), or remove \
                 the offload",
            );
        }
        let offload_param = self.offload(
            z,
            ("cpu_offload_params", "offload_param", &OFFLOAD_PARAM),
            "the 16-bit parameters",
        );
        // Stage 3 only, as DeepSpeed has it.
        if offload_param && stage != 3 {
            self.problem(
                "zero_optimization.offload_param",
                "offloading the 16-bit parameters needs ZeRO stage 3 (below it every device \
                 holds every weight it computes with)",
                "set zero_optimization.stage to 3, or set offload_param's \"device\": \
                 \"none\"",
            );
        }
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
            offload_optimizer,
            offload_param,
            param_persistence_threshold,
        }
    }

    /// Whether `section` (keys `spec`) or its old boolean spelling `legacy` offloads
    /// `what` to host memory; the two disagreeing is a problem, and where the setting
    /// came from is marked on `section.device`.
    fn offload(
        &mut self,
        z: &Map<String, Value>,
        (legacy, section, spec): (&str, &str, &Spec),
        what: &str,
    ) -> bool {
        let zp = "zero_optimization";
        let old = self.bool_or(z, zp, legacy, false);
        let set = self.offload_section(z, (section, spec, what));
        if old && set == Some(false) && z.contains_key(section) {
            self.problem(
                &format!("{zp}.{legacy}"),
                format!(
                    "{legacy}: true asks for the offload that {section}.device \"none\" turns off"
                ),
                format!(
                    "remove {legacy} (its old name) and set {section}.device to \"cpu\" or \
                     \"none\""
                ),
            );
        }
        let device = format!("{zp}.{section}.device");
        if set == Some(true) {
            self.mark(&device, Provenance::File);
        } else if old {
            self.mark(
                &device,
                Provenance::Inferred(format!("{zp}.{legacy}: true")),
            );
        }
        set.unwrap_or(false) || old
    }

    /// A bucket size; `"auto"` (the Hugging Face Trainer's hidden_size², which needs the
    /// model) keeps DeepSpeed's default: buckets only group gradients for communication,
    /// so their size does not change the result.
    /// Stage 3's persistence threshold under `key`; `"auto"` (Hugging Face's 10 ×
    /// hidden_size, which needs the model) keeps DeepSpeed's default: it changes which
    /// tensors stay on the devices, not the result.
    fn persistence_threshold(&mut self, z: &Map<String, Value>, key: &str, default: u64) -> u64 {
        if auto_at(z, key) {
            self.resolved_auto(
                &format!("zero_optimization.{key}"),
                format!(
                    "DeepSpeed's default {default} elements; Hugging Face would use 10 × the \
                     model's hidden_size, and the threshold changes only which tensors stay \
                     whole on the devices"
                ),
            );
            return default;
        }
        self.uint_or(z, "zero_optimization", key, (0, u32::MAX as u64), default)
    }

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
