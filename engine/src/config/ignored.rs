//! Top-level DeepSpeed keys that change nothing about training in Kiln: logging and
//! monitoring, and features whose effect is on speed or on machinery Kiln does not
//! have. Accepted; `config explain` notes them, and a set to ask for something Kiln will
//! not do is listed in [`TrainConfig::warnings`](super::TrainConfig::warnings).

use super::keys::Inert;

const LOGGING: &str = "it only configures logging or monitoring";

/// Each key, the values at which it asks for nothing (a note rather than a warning), and
/// why it does not matter here.
pub(super) const TOP_LEVEL: &[(&str, Inert, &str)] = &[
    ("tensorboard", Inert::Disabled, LOGGING),
    ("wandb", Inert::Disabled, LOGGING),
    ("csv_monitor", Inert::Disabled, LOGGING),
    ("comet", Inert::Disabled, LOGGING),
    ("comms_logger", Inert::Disabled, LOGGING),
    (
        "timers",
        Inert::Any,
        "DeepSpeed's throughput timers; Kiln times every step itself (metrics.jsonl)",
    ),
    (
        "zero_allow_untested_optimizer",
        Inert::Bool(false),
        "Kiln builds its optimizers itself, and ZeRO supports all of them",
    ),
    (
        "zero_force_ds_cpu_optimizer",
        Inert::Any,
        "it only matters with ZeRO-Offload, which Kiln does not implement",
    ),
    (
        "disable_allgather",
        Inert::Bool(false),
        "it chooses broadcasts over all-gathers, a communication pattern that does not \
         change the result; Kiln has its own",
    ),
    (
        "graph_harvesting",
        Inert::Bool(false),
        "it captures short kernel sequences as CUDA graphs for speed; Kiln records its own \
         command buffers",
    ),
    (
        "dataloader_drop_last",
        Inert::Any,
        "Kiln's sampler has no incomplete last batch: every step draws train_batch_size \
         samples, continuing into the next epoch",
    ),
    (
        "vocabulary_size",
        Inert::Any,
        "DeepSpeed only checks its alignment; the model file sets Kiln's vocab_size",
    ),
    (
        "checkpoint",
        Inert::Any,
        "Kiln writes and reads its own checkpoints (kiln train --out, --resume), so \
         DeepSpeed's checkpoint options do not apply",
    ),
    (
        "nebula",
        Inert::Disabled,
        "Nebula's checkpoint service; Kiln writes its own checkpoints",
    ),
    (
        "datastates_ckpt",
        Inert::Null,
        "DataStates' asynchronous checkpoints; Kiln writes its own checkpoints",
    ),
    (
        "aio",
        Inert::Any,
        "asynchronous I/O for NVMe offload, which Kiln does not implement",
    ),
    (
        "compile",
        Inert::Empty,
        "it compiles the model with torch.compile for speed; Kiln runs its own kernels",
    ),
    (
        "seq_parallel_communication_data_type",
        Inert::Any,
        "it only matters with sequence parallelism, which Kiln does not have",
    ),
    (
        "use_data_before_expert_parallelism",
        Inert::Any,
        "it only matters with mixture-of-experts layers, which Kiln does not have",
    ),
    (
        "cuda_visible_devices",
        Inert::Any,
        "DeepSpeed ignores it too; choose devices with --devices or kiln.devices",
    ),
];
