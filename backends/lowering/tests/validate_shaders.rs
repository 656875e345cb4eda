//! Every kernel file, assembled for every dtype mix, must parse and validate with naga
//! both with and without native f16 — so a shader error names its file and line here,
//! before any device compiles it.

use kiln_lowering::shader::{self, Repr};
use naga::valid::{Capabilities, ShaderStages, SubgroupOperationSet, ValidationFlags, Validator};

/// Dtype mixes of the attention kernels (five or six typed slots, too many to try every
/// mix of): each repr for all slots, then each repr for the inputs with each other for
/// the outputs (the slots after the first three written ones are outputs).
fn attention_mixes(kernel: &shader::KernelSource, reprs: &[Repr]) -> Vec<Vec<Repr>> {
    let slots: Vec<_> = kernel.slots.iter().filter(|s| s.typed).collect();
    let mut out = vec![];
    for &a in reprs {
        for &b in reprs {
            out.push(
                slots
                    .iter()
                    .map(|s| match s.access {
                        shader::Access::Read => a,
                        shader::Access::ReadWrite => b,
                    })
                    .collect(),
            );
        }
    }
    out
}

/// Kernels validated in the mixes of [`attention_mixes`]: the attention kernels, and
/// SwiGLU's backward (five typed slots, but not a GEMM's: three inputs, two outputs).
fn by_access(kernel: &shader::KernelSource) -> bool {
    kernel.name.starts_with("attention") || kernel.name == "swiglu_backward"
}

/// All ways to give `n` typed slots a representation from `reprs`.
fn combos(n: usize, reprs: &[Repr]) -> Vec<Vec<Repr>> {
    let mut out = vec![vec![]];
    for _ in 0..n {
        out = out
            .into_iter()
            .flat_map(|c| {
                reprs.iter().map(move |r| {
                    let mut c = c.clone();
                    c.push(*r);
                    c
                })
            })
            .collect();
    }
    out
}

/// What every adapter we run on offers: `unpack2x16float` (wgpu's SHADER_F16_IN_F32
/// downlevel flag, set by its Vulkan, GL and Metal backends and core in WebGPU).
const BASE: Capabilities = Capabilities::SHADER_FLOAT16_IN_FLOAT32;

/// Assembly constants each kernel is built with: the tile shapes the planner uses,
/// aligned and unaligned.
fn const_sets(kernel: &shader::KernelSource) -> Vec<Vec<(&'static str, u32)>> {
    if kernel.name.starts_with("attention") {
        // Head dims 64 (whole vec4 groups), 6 (scalar loads, a partial group) and 128,
        // with the register blocks the planner uses.
        vec![
            vec![
                ("SG", 8),
                ("WG", 8),
                ("R", 4),
                ("DIM", 64),
                ("D4", 16),
                ("VEC", 1),
            ],
            vec![
                ("SG", 8),
                ("WG", 64),
                ("R", 1),
                ("DIM", 6),
                ("D4", 2),
                ("VEC", 0),
            ],
            // Without sharing at d = 128: the column groups as a loop.
            vec![
                ("SG", 8),
                ("WG", 64),
                ("R", 2),
                ("DIM", 128),
                ("D4", 32),
                ("VEC", 1),
                ("UNROLL_MAX", 8),
            ],
        ]
    } else if kernel.body.contains("//@unroll r TM") {
        vec![
            vec![("SG", 8), ("TM", 16), ("NV", 2), ("VEC_B", 1), ("VEC_C", 1)],
            vec![("SG", 8), ("TM", 4), ("NV", 1), ("VEC_B", 0), ("VEC_C", 0)],
        ]
    } else if kernel.body.contains("VEC_A") {
        vec![
            vec![("VEC_A", 1), ("VEC_B", 1)],
            vec![("VEC_A", 0), ("VEC_B", 0)],
        ]
    } else {
        vec![vec![]]
    }
}

fn validator(caps: Capabilities) -> Validator {
    let mut v = Validator::new(ValidationFlags::all(), caps);
    v.subgroup_stages(ShaderStages::COMPUTE);
    v.subgroup_operations(SubgroupOperationSet::all());
    v
}

fn validate(native_f16: bool) -> usize {
    let caps = if native_f16 {
        BASE | Capabilities::SHADER_FLOAT16
    } else {
        BASE
    };
    let with_subgroups = caps | Capabilities::SUBGROUP;
    let mut checked = 0;
    for kernel in shader::ALL {
        let n = kernel.slots.iter().filter(|s| s.typed).count();
        // Five typed slots (GEMM, Adam): every mix of the first three; the fourth as f32
        // or bf16; the fifth f32.
        let mixes = if by_access(kernel) {
            attention_mixes(kernel, Repr::all(native_f16))
        } else if n == 5 {
            combos(3, Repr::all(native_f16))
                .into_iter()
                .flat_map(|abc| {
                    [Repr::F32, Repr::BF16]
                        .map(|bias| [abc.clone(), vec![bias, Repr::F32]].concat())
                })
                .collect()
        } else {
            combos(n, Repr::all(native_f16))
        };
        for (reprs, consts) in mixes
            .into_iter()
            .flat_map(|r| const_sets(kernel).into_iter().map(move |c| (r.clone(), c)))
        {
            let src = shader::assemble(kernel, &reprs, &consts);
            let module = naga::front::wgsl::parse_str(&src).unwrap_or_else(|e| {
                panic!(
                    "shaders/{} with {reprs:?} does not parse:\n{}",
                    kernel.file,
                    e.emit_to_string_with_path(&src, kernel.file)
                )
            });
            validator(if kernel.subgroups {
                with_subgroups
            } else {
                caps
            })
            .validate(&module)
            .unwrap_or_else(|e| {
                panic!(
                    "shaders/{} with {reprs:?} fails validation (native f16: {native_f16}):\n{}",
                    kernel.file,
                    e.emit_to_string_with_path(&src, kernel.file)
                )
            });
            checked += 1;
        }
    }
    checked
}

/// Modules per kernel: one per dtype mix and constant set.
fn expected(kernel: &shader::KernelSource, reprs: usize) -> usize {
    let n = kernel.slots.iter().filter(|s| s.typed).count();
    let mixes = if by_access(kernel) {
        reprs * reprs
    } else if n == 5 {
        reprs.pow(3) * 2
    } else {
        reprs.pow(n as u32)
    };
    mixes * const_sets(kernel).len()
}

#[test]
fn every_kernel_validates_with_native_f16() {
    let want: usize = shader::ALL.iter().map(|k| expected(k, 4)).sum();
    assert_eq!(validate(true), want);
}

#[test]
fn every_kernel_validates_without_f16() {
    let want: usize = shader::ALL.iter().map(|k| expected(k, 3)).sum();
    assert_eq!(validate(false), want);
}

#[test]
fn native_f16_kernels_need_the_capability() {
    // The packed path exists because these fail without SHADER_F16; prove the check is real.
    let src = shader::assemble(&shader::CAST, &[Repr::F16, Repr::F32], &[]);
    let module = naga::front::wgsl::parse_str(&src).expect("parses");
    let result = validator(BASE).validate(&module);
    assert!(
        result.is_err(),
        "native-f16 cast validated without the f16 capability"
    );
}
