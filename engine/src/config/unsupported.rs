//! Top-level DeepSpeed features that Kiln does not implement: a config that asks for one
//! is rejected, unless it sets the key to the value that asks for nothing (then a note
//! says it was accepted).

use super::keys::Inert;

/// Each key with the value that leaves it off and a description of the feature.
pub(super) const TOP_LEVEL: &[(&str, Inert, &str)] = &[
    ("sparse_attention", Inert::Null, "sparse attention kernels"),
    ("amp", Inert::Disabled, "NVIDIA Apex AMP"),
    (
        "torch_autocast",
        Inert::Disabled,
        "PyTorch autocast (per-operation precision)",
    ),
    (
        "communication_data_type",
        Inert::Null,
        "choosing the data type of gradient communication",
    ),
    (
        "prescale_gradients",
        Inert::Bool(false),
        "dividing gradients before the all-reduce",
    ),
    (
        "gradient_predivide_factor",
        Inert::Num(1.0),
        "gradient pre-division before the all-reduce",
    ),
    (
        "data_types",
        Inert::Empty,
        "choosing the gradient accumulation data type (Kiln accumulates in the training \
         precision)",
    ),
    (
        "tensor_parallel",
        Inert::Empty,
        "tensor parallelism (AutoTP)",
    ),
    (
        "hybrid_engine",
        Inert::Disabled,
        "the hybrid training and inference engine",
    ),
    (
        "data_efficiency",
        Inert::Disabled,
        "data efficiency (data sampling and routing)",
    ),
    (
        "curriculum_learning",
        Inert::Disabled,
        "curriculum learning",
    ),
    ("elasticity", Inert::Disabled, "elastic training"),
    ("autotuning", Inert::Disabled, "autotuning"),
    ("compression_training", Inert::Null, "compression training"),
    (
        "weight_quantization",
        Inert::Null,
        "quantized weights after initialisation",
    ),
    ("sparse_gradients", Inert::Bool(false), "sparse gradients"),
    (
        "progressive_layer_drop",
        Inert::Disabled,
        "progressive layer drop",
    ),
    ("eigenvalue", Inert::Disabled, "eigenvalue computation"),
    ("quantize_training", Inert::Disabled, "quantized training"),
];
