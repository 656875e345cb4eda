//! Top-level DeepSpeed keys that change nothing about training in Kiln, logging and
//! monitoring mostly: accepted, and listed in
//! [`TrainConfig::warnings`](super::TrainConfig::warnings) as ignored unless switched off.

const LOGGING: &str = "it only configures logging or monitoring";

/// Each key with the reason it does not matter.
pub(super) const TOP_LEVEL: &[(&str, &str)] = &[
    ("tensorboard", LOGGING),
    ("wandb", LOGGING),
    ("csv_monitor", LOGGING),
    ("comms_logger", LOGGING),
    ("flops_profiler", LOGGING),
    (
        "zero_allow_untested_optimizer",
        "Kiln builds its optimizers itself, and ZeRO supports all of them",
    ),
];
