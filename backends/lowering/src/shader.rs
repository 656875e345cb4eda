//! WGSL assembly: a kernel file from `shaders/` plus generated typed bindings.
//!
//! WGSL has no generics, so a kernel body is written once against accessor
//! functions (`x_load(w) -> vec2<f32>`, `y_store(w, v)`) and the host prepends, per
//! launch dtype, the binding and accessors from `shaders/dtype/*.wgsl`. One kernel
//! file thus serves f32, native f16, packed f16 and bf16 operands in any mix.

use kiln_engine::DType;

macro_rules! shader {
    ($path:literal) => {
        include_str!(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../../shaders/",
            $path
        ))
    };
}

const CONVERT: &str = shader!("common/convert.wgsl");
const ELEMENTWISE_PARAMS: &str = shader!("common/params.wgsl");
const MATMUL_PARAMS: &str = shader!("common/matmul_params.wgsl");
const MATMUL_EPILOGUE: &str = shader!("common/matmul_epilogue.wgsl");
const SHARE_SUBGROUP: &str = shader!("common/share_subgroup.wgsl");
const SHARE_NONE: &str = shader!("common/share_none.wgsl");
const OPTIM_PARAMS: &str = shader!("common/optim_params.wgsl");
const GELU: &str = shader!("common/gelu.wgsl");
const ACTIVATION_FNS: &str = shader!("common/activation.wgsl");
const DROPOUT_PARAMS: &str = shader!("common/dropout_params.wgsl");
const ROW_REDUCE: &str = shader!("common/row_reduce.wgsl");
const CROSS_ENTROPY_PARAMS: &str = shader!("common/cross_entropy_params.wgsl");
const HEADS_PARAMS: &str = shader!("common/heads_params.wgsl");
const ATTENTION_PARAMS: &str = shader!("common/attention_params.wgsl");
const ATTENTION_LOAD: &str = shader!("common/attention_load.wgsl");
const ATTENTION_SHARE_SUBGROUP: &str = shader!("common/attention_share_subgroup.wgsl");
const ATTENTION_SHARE_NONE: &str = shader!("common/attention_share_none.wgsl");
const ROPE_PARAMS: &str = shader!("common/rope_params.wgsl");
const ROPE_ANGLE: &str = shader!("common/rope_angle.wgsl");
const SWIGLU: &str = shader!("common/swiglu.wgsl");
const CACHE_PARAMS: &str = shader!("common/cache_params.wgsl");

/// How a binding is accessed.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Access {
    Read,
    ReadWrite,
}

/// A binding after the params uniform (binding 0): either typed — declared here from
/// the launch dtype — or declared by the kernel file itself.
#[derive(Clone, Copy, Debug)]
pub struct Slot {
    pub name: &'static str,
    pub access: Access,
    pub typed: bool,
}

/// A kernel file and the bindings it expects, in binding order from 1.
#[derive(Debug)]
pub struct KernelSource {
    /// Unique name (two sources may share a file with different preludes).
    pub name: &'static str,
    pub file: &'static str,
    pub body: &'static str,
    pub slots: &'static [Slot],
    /// WGSL declaring `P`, the launch parameters at binding 0, and anything shared.
    pub prelude: &'static [&'static str],
    /// Bytes of `P`.
    pub params_size: u64,
    /// Whether the kernel uses subgroup operations (needs the SUBGROUP feature).
    pub subgroups: bool,
    /// Every buffer index is clamped in range by the kernel itself, so the module may
    /// be built without the compiler's bounds checks (which cost a lot on lavapipe).
    pub trusted: bool,
}

const fn typed(name: &'static str, access: Access) -> Slot {
    Slot {
        name,
        access,
        typed: true,
    }
}

const fn own(name: &'static str, access: Access) -> Slot {
    Slot {
        name,
        access,
        typed: false,
    }
}

use Access::{Read, ReadWrite};

/// An elementwise kernel: `shaders/<name>.wgsl` with the 16-byte parameter block.
macro_rules! elementwise {
    ($name:literal, $slots:expr) => {
        KernelSource {
            name: $name,
            file: concat!($name, ".wgsl"),
            body: include_str!(concat!(
                env!("CARGO_MANIFEST_DIR"),
                "/../../shaders/",
                $name,
                ".wgsl"
            )),
            slots: $slots,
            prelude: &[ELEMENTWISE_PARAMS, GELU, ROW_REDUCE],
            params_size: 16,
            subgroups: false,
            trusted: false,
        }
    };
}

/// A GEMM kernel: five slots (a, b, c, bias, cf), the 96-byte parameter block and the
/// shared epilogue, plus `extra` prelude.
macro_rules! gemm {
    ($name:literal, $file:literal, [$($extra:expr),*], subgroups: $sg:literal, trusted: $trusted:literal) => {
        KernelSource {
            name: $name,
            file: $file,
            body: shader!($file),
            slots: MATMUL_SLOTS,
            prelude: &[MATMUL_PARAMS, GELU, MATMUL_EPILOGUE, $($extra),*],
            params_size: MATMUL_PARAMS_SIZE,
            subgroups: $sg,
            trusted: $trusted,
        }
    };
}

pub const FILL: KernelSource = elementwise!("fill", &[own("dst", ReadWrite)]);
pub const CAST: KernelSource = elementwise!("cast", &[typed("src", Read), typed("dst", ReadWrite)]);
pub const BINARY: KernelSource = elementwise!(
    "binary",
    &[typed("a", Read), typed("b", Read), typed("out", ReadWrite)]
);
pub const SCALE: KernelSource = elementwise!("scale", &[typed("x", Read), typed("out", ReadWrite)]);
pub const AXPY: KernelSource = elementwise!("axpy", &[typed("x", Read), typed("y", ReadWrite)]);
pub const REDUCE: KernelSource =
    elementwise!("reduce", &[typed("src", Read), own("dst", ReadWrite)]);
pub const GRAD_SCALE: KernelSource = elementwise!(
    "grad_scale",
    &[own("sum_squares", Read), own("out", ReadWrite)]
);
pub const GELU_FORWARD: KernelSource =
    elementwise!("gelu", &[typed("x", Read), typed("out", ReadWrite)]);
pub const GELU_BACKWARD: KernelSource = elementwise!(
    "gelu_backward",
    &[
        typed("x", Read),
        typed("dout", Read),
        typed("dx", ReadWrite)
    ]
);
/// ReLU, tanh or SiLU (the KIND override), forward and backward.
pub const ACTIVATION: KernelSource = KernelSource {
    prelude: &[ELEMENTWISE_PARAMS, ACTIVATION_FNS],
    ..elementwise!("activation", &[typed("x", Read), typed("out", ReadWrite)])
};
pub const ACTIVATION_BACKWARD: KernelSource = KernelSource {
    prelude: &[ELEMENTWISE_PARAMS, ACTIVATION_FNS],
    ..elementwise!(
        "activation_backward",
        &[
            typed("x", Read),
            typed("dout", Read),
            typed("dx", ReadWrite)
        ]
    )
};
/// Dropout's forward and backward (the same computation over x or dout).
pub const DROPOUT: KernelSource = KernelSource {
    prelude: &[DROPOUT_PARAMS],
    params_size: 32,
    ..elementwise!("dropout", &[typed("x", Read), typed("out", ReadWrite)])
};
pub const MSE_LOSS: KernelSource = elementwise!(
    "mse_loss",
    &[
        typed("pred", Read),
        typed("target", Read),
        own("losses", ReadWrite)
    ]
);
pub const MSE_BACKWARD: KernelSource = elementwise!(
    "mse_backward",
    &[
        typed("pred", Read),
        typed("target", Read),
        typed("dpred", ReadWrite)
    ]
);
pub const LAYERNORM_STATS: KernelSource = elementwise!(
    "layernorm_stats",
    &[
        typed("x", Read),
        own("mean", ReadWrite),
        own("rstd", ReadWrite)
    ]
);
pub const LAYERNORM_APPLY: KernelSource = elementwise!(
    "layernorm_apply",
    &[
        typed("x", Read),
        typed("weight", Read),
        typed("bias", Read),
        typed("out", ReadWrite),
        own("mean", Read),
        own("rstd", Read),
    ]
);
pub const LAYERNORM_BACKWARD_STATS: KernelSource = elementwise!(
    "layernorm_backward_stats",
    &[
        typed("x", Read),
        typed("weight", Read),
        typed("dout", Read),
        own("mean", Read),
        own("rstd", Read),
        own("stats", ReadWrite),
    ]
);
pub const LAYERNORM_BACKWARD_DX: KernelSource = elementwise!(
    "layernorm_backward_dx",
    &[
        typed("x", Read),
        typed("weight", Read),
        typed("dout", Read),
        typed("dx", ReadWrite),
        own("mean", Read),
        own("rstd", Read),
        own("stats", Read),
    ]
);
pub const LAYERNORM_BACKWARD_PARAMS: KernelSource = elementwise!(
    "layernorm_backward_params",
    &[
        typed("x", Read),
        typed("dout", Read),
        own("mean", Read),
        own("rstd", Read),
        own("dweight", ReadWrite),
        own("dbias", ReadWrite),
    ]
);
pub const SPLIT_HEADS: KernelSource = KernelSource {
    prelude: &[HEADS_PARAMS],
    params_size: 32,
    ..elementwise!(
        "split_heads",
        &[typed("src", Read), typed("dst", ReadWrite)]
    )
};
pub const MERGE_HEADS: KernelSource = KernelSource {
    prelude: &[HEADS_PARAMS],
    params_size: 32,
    ..elementwise!(
        "merge_heads",
        &[typed("src", Read), typed("dst", ReadWrite)]
    )
};
pub const SOFTMAX_STATS: KernelSource = elementwise!(
    "softmax_stats",
    &[typed("x", Read), own("stats", ReadWrite)]
);
pub const SOFTMAX_APPLY: KernelSource = elementwise!(
    "softmax_apply",
    &[
        typed("x", Read),
        typed("out", ReadWrite),
        own("stats", Read)
    ]
);
pub const SOFTMAX_BACKWARD_STATS: KernelSource = elementwise!(
    "softmax_backward_stats",
    &[
        typed("p", Read),
        typed("dout", Read),
        own("stats", ReadWrite)
    ]
);
pub const SOFTMAX_BACKWARD_DX: KernelSource = elementwise!(
    "softmax_backward_dx",
    &[
        typed("p", Read),
        typed("dout", Read),
        typed("dx", ReadWrite),
        own("stats", Read)
    ]
);
/// Fused softmax + cross-entropy, forward and backward: the 32-byte parameter block
/// (the padded vocabulary's class count besides the elementwise four).
pub const CROSS_ENTROPY: KernelSource = KernelSource {
    prelude: &[CROSS_ENTROPY_PARAMS, ROW_REDUCE],
    params_size: 32,
    ..elementwise!(
        "cross_entropy",
        &[
            typed("logits", Read),
            own("targets", Read),
            own("losses", ReadWrite),
            own("lse", ReadWrite),
        ]
    )
};
/// Row argmax: a row reduction with the cross-entropy's parameters (rows, the row's
/// length, the classes among it).
pub const ARGMAX: KernelSource = KernelSource {
    prelude: &[CROSS_ENTROPY_PARAMS, ROW_REDUCE],
    params_size: 32,
    ..elementwise!("argmax", &[typed("x", Read), own("out", ReadWrite)])
};
pub const CROSS_ENTROPY_BACKWARD: KernelSource = KernelSource {
    prelude: &[CROSS_ENTROPY_PARAMS],
    params_size: 32,
    ..elementwise!(
        "cross_entropy_backward",
        &[
            typed("logits", Read),
            typed("dlogits", ReadWrite),
            own("targets", Read),
            own("lse", Read),
        ]
    )
};
pub const EMBEDDING: KernelSource = elementwise!(
    "embedding",
    &[
        typed("table", Read),
        typed("out", ReadWrite),
        own("tokens", Read)
    ]
);
pub const EMBEDDING_BACKWARD: KernelSource = elementwise!(
    "embedding_backward",
    &[
        typed("dout", Read),
        own("tokens", Read),
        own("dtable", ReadWrite)
    ]
);
pub const NONFINITE: KernelSource =
    elementwise!("nonfinite", &[own("src", Read), own("flag", ReadWrite)]);
pub const RMSNORM_STATS: KernelSource =
    elementwise!("rmsnorm_stats", &[typed("x", Read), own("rstd", ReadWrite)]);
pub const RMSNORM_APPLY: KernelSource = elementwise!(
    "rmsnorm_apply",
    &[
        typed("x", Read),
        typed("weight", Read),
        typed("out", ReadWrite),
        own("rstd", Read),
    ]
);
pub const RMSNORM_BACKWARD_STATS: KernelSource = elementwise!(
    "rmsnorm_backward_stats",
    &[
        typed("x", Read),
        typed("weight", Read),
        typed("dout", Read),
        own("rstd", Read),
        own("stats", ReadWrite),
    ]
);
pub const RMSNORM_BACKWARD_DX: KernelSource = elementwise!(
    "rmsnorm_backward_dx",
    &[
        typed("x", Read),
        typed("weight", Read),
        typed("dout", Read),
        typed("dx", ReadWrite),
        own("rstd", Read),
        own("stats", Read),
    ]
);
pub const RMSNORM_BACKWARD_PARAMS: KernelSource = elementwise!(
    "rmsnorm_backward_params",
    &[
        typed("x", Read),
        typed("dout", Read),
        own("rstd", Read),
        own("dweight", ReadWrite),
    ]
);
/// Rotary embedding, forward and inverse (48-byte parameter block).
pub const ROPE: KernelSource = KernelSource {
    prelude: &[ROPE_PARAMS, ROPE_ANGLE],
    params_size: 48,
    ..elementwise!("rope", &[typed("x", Read), typed("out", ReadWrite)])
};
/// Rotary embedding at positions read from a u32 buffer (generation).
pub const ROPE_AT: KernelSource = KernelSource {
    prelude: &[ROPE_PARAMS, ROPE_ANGLE],
    params_size: 48,
    ..elementwise!(
        "rope_at",
        &[
            typed("x", Read),
            typed("out", ReadWrite),
            own("positions", Read)
        ]
    )
};
pub const SWIGLU_FORWARD: KernelSource = KernelSource {
    prelude: &[ELEMENTWISE_PARAMS, SWIGLU],
    ..elementwise!(
        "swiglu",
        &[
            typed("gate", Read),
            typed("up", Read),
            typed("out", ReadWrite)
        ]
    )
};
pub const SWIGLU_BACKWARD: KernelSource = KernelSource {
    prelude: &[ELEMENTWISE_PARAMS, SWIGLU],
    ..elementwise!(
        "swiglu_backward",
        &[
            typed("gate", Read),
            typed("up", Read),
            typed("dout", Read),
            typed("dgate", ReadWrite),
            typed("dup", ReadWrite),
        ]
    )
};

/// Bytes of `shaders/common/cache_params.wgsl`.
pub const CACHE_PARAMS_SIZE: u64 = 48;

/// Generation: new K or V rows into the cache at positions read from a u32 buffer.
pub const CACHE_WRITE: KernelSource = KernelSource {
    prelude: &[CACHE_PARAMS],
    params_size: CACHE_PARAMS_SIZE,
    ..elementwise!(
        "cache_write",
        &[
            typed("src", Read),
            typed("cache", ReadWrite),
            own("positions", Read)
        ]
    )
};
/// Generation: attention of new query rows over the cache, one workgroup per row and head.
pub const CACHED_ATTENTION: KernelSource = KernelSource {
    prelude: &[CACHE_PARAMS],
    params_size: CACHE_PARAMS_SIZE,
    ..elementwise!(
        "cached_attention",
        &[
            typed("q", Read),
            typed("k", Read),
            typed("v", Read),
            typed("out", ReadWrite),
            own("positions", Read)
        ]
    )
};

const MATMUL_SLOTS: &[Slot] = &[
    typed("a", Read),
    typed("b", Read),
    typed("c", ReadWrite),
    typed("bias", Read),
    typed("cf", ReadWrite),
];

/// One output per invocation, straight from storage: the baseline row of `kiln bench`.
pub const MATMUL_NAIVE: KernelSource =
    gemm!("matmul_naive", "matmul_naive.wgsl", [], subgroups: false, trusted: false);
/// CPU-class adapters (lavapipe, llvmpipe): register blocks, A shared by subgroup broadcasts.
pub const MATMUL_CPU: KernelSource =
    gemm!("matmul_cpu", "matmul_cpu.wgsl", [SHARE_SUBGROUP], subgroups: true, trusted: true);
/// CPU-class adapters without subgroups (llvmpipe through GL): the same body, per-lane A loads.
pub const MATMUL_CPU_NOSG: KernelSource =
    gemm!("matmul_cpu_nosg", "matmul_cpu.wgsl", [SHARE_NONE], subgroups: false, trusted: true);
/// GPUs: workgroup shared-memory tiles with per-thread register blocks.
pub const MATMUL_TILED: KernelSource =
    gemm!("matmul_tiled", "matmul_tiled.wgsl", [], subgroups: false, trusted: true);
/// Matrix-vector products (N = 1): one workgroup per output row.
pub const GEMV: KernelSource = gemm!("gemv", "gemv.wgsl", [], subgroups: false, trusted: false);
/// Sums split-K partials and applies the epilogue, two outputs per invocation.
pub const MATMUL_FINISH: KernelSource =
    gemm!("matmul_finish", "matmul_finish.wgsl", [], subgroups: false, trusted: false);

/// A fused attention kernel (32-byte parameter block); `$sg`: keys shared by subgroup
/// broadcasts, or loaded by every lane.
macro_rules! attention {
    ($name:literal, $file:literal, $slots:expr, subgroups: $sg:literal) => {
        KernelSource {
            name: $name,
            file: $file,
            body: shader!($file),
            slots: $slots,
            prelude: &[
                ATTENTION_PARAMS,
                ATTENTION_LOAD,
                if $sg {
                    ATTENTION_SHARE_SUBGROUP
                } else {
                    ATTENTION_SHARE_NONE
                },
            ],
            params_size: ATTENTION_PARAMS_SIZE,
            subgroups: $sg,
            trusted: true,
        }
    };
}

const ATTENTION_SLOTS: &[Slot] = &[
    typed("q", Read),
    typed("k", Read),
    typed("v", Read),
    typed("out", ReadWrite),
    own("lse", ReadWrite),
    own("starts", Read),
];
const ATTENTION_DQ_SLOTS: &[Slot] = &[
    typed("q", Read),
    typed("k", Read),
    typed("v", Read),
    typed("out", Read),
    typed("dout", Read),
    typed("dq", ReadWrite),
    own("lse", Read),
    own("delta", ReadWrite),
    own("starts", Read),
];
const ATTENTION_DKV_SLOTS: &[Slot] = &[
    typed("q", Read),
    typed("k", Read),
    typed("v", Read),
    typed("dout", Read),
    typed("dk", ReadWrite),
    typed("dv", ReadWrite),
    own("lse", Read),
    own("delta", Read),
    own("starts", Read),
];

/// Fused attention forward (out and lse), keys shared by subgroup broadcasts.
pub const ATTENTION: KernelSource = attention!(
    "attention",
    "attention_forward.wgsl",
    ATTENTION_SLOTS,
    subgroups: true
);
/// The same without subgroups: every lane loads every key.
pub const ATTENTION_NOSG: KernelSource = attention!(
    "attention_nosg",
    "attention_forward.wgsl",
    ATTENTION_SLOTS,
    subgroups: false
);
/// Attention backward, pass 1: dq and rowsum(dout * out).
pub const ATTENTION_DQ: KernelSource = attention!(
    "attention_dq",
    "attention_backward_dq.wgsl",
    ATTENTION_DQ_SLOTS,
    subgroups: true
);
pub const ATTENTION_DQ_NOSG: KernelSource = attention!(
    "attention_dq_nosg",
    "attention_backward_dq.wgsl",
    ATTENTION_DQ_SLOTS,
    subgroups: false
);
/// Attention backward, pass 2: dk and dv.
pub const ATTENTION_DKV: KernelSource = attention!(
    "attention_dkv",
    "attention_backward_dkv.wgsl",
    ATTENTION_DKV_SLOTS,
    subgroups: true
);
pub const ATTENTION_DKV_NOSG: KernelSource = attention!(
    "attention_dkv_nosg",
    "attention_backward_dkv.wgsl",
    ATTENTION_DKV_SLOTS,
    subgroups: false
);

/// Bytes of `shaders/common/attention_params.wgsl`.
pub const ATTENTION_PARAMS_SIZE: u64 = 32;

/// An optimizer step over flat buffers (48-byte parameter block).
macro_rules! optimizer {
    ($name:literal, $slots:expr) => {
        KernelSource {
            name: $name,
            file: concat!($name, ".wgsl"),
            body: include_str!(concat!(
                env!("CARGO_MANIFEST_DIR"),
                "/../../shaders/",
                $name,
                ".wgsl"
            )),
            slots: $slots,
            prelude: &[OPTIM_PARAMS],
            params_size: OPTIM_PARAMS_SIZE,
            subgroups: false,
            trusted: false,
        }
    };
}

pub const ADAM: KernelSource = optimizer!(
    "adam",
    &[
        typed("master", ReadWrite),
        typed("grads", Read),
        typed("m", ReadWrite),
        typed("v", ReadWrite),
        typed("params", ReadWrite),
        own("grad_scale", Read),
    ]
);
pub const SGD: KernelSource = optimizer!(
    "sgd",
    &[
        typed("master", ReadWrite),
        typed("grads", Read),
        typed("buf", ReadWrite),
        typed("params", ReadWrite),
        own("grad_scale", Read),
    ]
);

/// Bytes of `shaders/common/optim_params.wgsl`.
pub const OPTIM_PARAMS_SIZE: u64 = 48;

/// Bytes of `shaders/common/matmul_params.wgsl`.
pub const MATMUL_PARAMS_SIZE: u64 = 96;

/// Every kernel file, for validation.
pub const ALL: &[&KernelSource] = &[
    &FILL,
    &CAST,
    &BINARY,
    &SCALE,
    &AXPY,
    &REDUCE,
    &NONFINITE,
    &GRAD_SCALE,
    &GELU_FORWARD,
    &GELU_BACKWARD,
    &ACTIVATION,
    &ACTIVATION_BACKWARD,
    &DROPOUT,
    &MSE_LOSS,
    &MSE_BACKWARD,
    &SPLIT_HEADS,
    &MERGE_HEADS,
    &SOFTMAX_STATS,
    &SOFTMAX_APPLY,
    &SOFTMAX_BACKWARD_STATS,
    &SOFTMAX_BACKWARD_DX,
    &CROSS_ENTROPY,
    &CROSS_ENTROPY_BACKWARD,
    &ARGMAX,
    &EMBEDDING,
    &EMBEDDING_BACKWARD,
    &LAYERNORM_STATS,
    &LAYERNORM_APPLY,
    &LAYERNORM_BACKWARD_STATS,
    &LAYERNORM_BACKWARD_DX,
    &LAYERNORM_BACKWARD_PARAMS,
    &RMSNORM_STATS,
    &RMSNORM_APPLY,
    &RMSNORM_BACKWARD_STATS,
    &RMSNORM_BACKWARD_DX,
    &RMSNORM_BACKWARD_PARAMS,
    &ROPE,
    &SWIGLU_FORWARD,
    &SWIGLU_BACKWARD,
    &ROPE_AT,
    &CACHE_WRITE,
    &CACHED_ATTENTION,
    &ADAM,
    &SGD,
    &MATMUL_NAIVE,
    &MATMUL_CPU,
    &MATMUL_CPU_NOSG,
    &MATMUL_TILED,
    &GEMV,
    &MATMUL_FINISH,
    &ATTENTION,
    &ATTENTION_NOSG,
    &ATTENTION_DQ,
    &ATTENTION_DQ_NOSG,
    &ATTENTION_DKV,
    &ATTENTION_DKV_NOSG,
];

/// How a typed slot's elements are stored in WGSL.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Repr {
    F32,
    /// Native `f16` (needs SHADER_F16).
    F16,
    /// f16 as two halves per `u32`, computed in f32.
    F16Packed,
    BF16,
}

impl Repr {
    /// The representation of a float dtype on an adapter with or without native f16.
    pub fn of(dtype: DType, native_f16: bool) -> Repr {
        match dtype {
            DType::F32 => Repr::F32,
            DType::F16 if native_f16 => Repr::F16,
            DType::F16 => Repr::F16Packed,
            DType::BF16 => Repr::BF16,
            DType::U32 => {
                unreachable!("u32 buffers are never typed slots; Kernel::validate rejects them")
            }
        }
    }

    fn template(self) -> &'static str {
        match self {
            Repr::F32 => shader!("dtype/f32.wgsl"),
            Repr::F16 => shader!("dtype/f16.wgsl"),
            Repr::F16Packed => shader!("dtype/f16_packed.wgsl"),
            Repr::BF16 => shader!("dtype/bf16.wgsl"),
        }
    }

    pub fn all(native_f16: bool) -> &'static [Repr] {
        if native_f16 {
            &[Repr::F32, Repr::F16, Repr::F16Packed, Repr::BF16]
        } else {
            &[Repr::F32, Repr::F16Packed, Repr::BF16]
        }
    }
}

/// Section `name` (`decl`, `load`, `store`) of a dtype template.
fn section<'a>(template: &'a str, name: &str) -> &'a str {
    let marker = format!("//@ {name}\n");
    let start = template
        .find(&marker)
        .unwrap_or_else(|| panic!("dtype template lacks section `{name}`"))
        + marker.len();
    let end = template[start..]
        .find("//@ ")
        .map_or(template.len(), |e| start + e);
    &template[start..end]
}

/// The full WGSL module for `kernel` with `reprs` for its typed slots, in slot order,
/// and `consts` declared as `const NAME: u32` (they also size `//@unroll` blocks).
pub fn assemble(kernel: &KernelSource, reprs: &[Repr], consts: &[(&str, u32)]) -> String {
    let n_typed = kernel.slots.iter().filter(|s| s.typed).count();
    assert_eq!(
        n_typed,
        reprs.len(),
        "{}: one repr per typed slot",
        kernel.file
    );
    let mut out = String::new();
    if reprs.contains(&Repr::F16) {
        out.push_str("enable f16;\n\n");
    }
    for (name, value) in consts {
        out.push_str(&format!("const {name}: u32 = {value}u;\n"));
    }
    for p in kernel.prelude {
        out.push_str(&unroll(p, consts));
        out.push('\n');
    }
    out.push_str(CONVERT);
    out.push('\n');
    let mut reprs = reprs.iter();
    for (i, slot) in kernel.slots.iter().enumerate().filter(|(_, s)| s.typed) {
        let t = reprs.next().expect("checked above").template();
        let access = match slot.access {
            Access::Read => "read",
            Access::ReadWrite => "read_write",
        };
        let mut text = section(t, "decl").to_string();
        text.push_str(section(t, "load"));
        text.push_str(section(t, "at"));
        if slot.access == Access::ReadWrite {
            text.push_str(section(t, "store"));
            text.push_str(section(t, "put"));
        }
        let text = text
            .replace("$S", slot.name)
            .replace("$B", &(i + 1).to_string())
            .replace("$A", access);
        out.push_str(&text);
        out.push('\n');
    }
    out.push_str(&unroll(kernel.body, consts));
    out
}

/// Expands `//@unroll VAR COUNT` directives: the statement after the directive (one
/// line, another directive with its statement, or a block closed by `//@}` when the
/// directive ends in `{`) is repeated COUNT times with `{VAR}` replaced by 0, 1, ….
/// COUNT is a number or a name from `consts`. Fully unrolled register blocks are what
/// make register tiling work on compilers (like llvmpipe's) that will not unroll them.
///
/// A kernel built with the constant `UNROLL_MAX` gets a `for` loop instead wherever
/// COUNT is above it (`{VAR}u` read from the loop's counter): nested blocks multiply, and
/// a body repeated hundreds of times costs minutes of LLVM compile time and is refused by
/// some GPU compilers (attention at head dim 128, `attention.rs`).
pub fn unroll(text: &str, consts: &[(&str, u32)]) -> String {
    let lines: Vec<&str> = text.lines().collect();
    let mut out = String::new();
    let mut i = 0;
    while i < lines.len() {
        let (expanded, next) = statement(&lines, i, consts);
        out.push_str(&expanded);
        i = next;
    }
    out
}

/// Expands the statement starting at line `i`; returns it and the next line index.
fn statement(lines: &[&str], i: usize, consts: &[(&str, u32)]) -> (String, usize) {
    let line = lines[i];
    let Some(rest) = line.trim().strip_prefix("//@unroll ") else {
        return (format!("{line}\n"), i + 1);
    };
    let mut words = rest.split_whitespace();
    let var = words.next().expect("//@unroll needs a variable");
    let count_word = words.next().expect("//@unroll needs a count");
    let count = count_word.parse::<u32>().unwrap_or_else(|_| {
        consts
            .iter()
            .find(|(n, _)| *n == count_word)
            .unwrap_or_else(|| {
                panic!("//@unroll count `{count_word}` is not a number or a kernel constant")
            })
            .1
    });
    let (body, next) = if words.next() == Some("{") {
        // Block: up to the matching `//@}`.
        let mut depth = 1;
        let mut j = i + 1;
        while depth > 0 {
            let t = lines.get(j).expect("unterminated //@unroll block").trim();
            if t.starts_with("//@unroll ") && t.ends_with('{') {
                depth += 1;
            } else if t == "//@}" {
                depth -= 1;
            }
            j += 1;
        }
        (lines[i + 1..j - 1].join("\n"), j)
    } else {
        let (_, next) = statement(lines, i + 1, consts);
        (lines[i + 1..next].join("\n"), next)
    };
    let mut out = String::new();
    let key = format!("{{{var}}}");
    let limit = consts.iter().find(|(n, _)| *n == "UNROLL_MAX").map(|c| c.1);
    if limit.is_some_and(|max| count > max) {
        // Over the kernel's limit: one loop, `{VAR}u` read from its counter.
        let counter = format!("{var}_i");
        let body = body.replace(&format!("{key}u"), &counter);
        assert!(
            !body.contains(&key),
            "//@unroll {var} {count_word}: a block that may become a loop (the kernel sets \
             UNROLL_MAX) must use `{key}` only as `{key}u`"
        );
        out.push_str(&format!(
            "for (var {counter} = 0u; {counter} < {count}u; {counter}++) {{\n"
        ));
        out.push_str(&unroll(&body, consts));
        out.push_str("}\n");
        return (out, next);
    }
    for v in 0..count {
        out.push_str(&unroll(&body.replace(&key, &v.to_string()), consts));
    }
    (out, next)
}
