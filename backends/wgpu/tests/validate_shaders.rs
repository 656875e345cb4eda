//! Every kernel file, assembled for every dtype mix, must parse and validate with naga
//! both with and without native f16 — so a shader error names its file and line here,
//! before any device compiles it.

use kiln_wgpu::shader::{self, Repr};
use naga::valid::{Capabilities, ValidationFlags, Validator};

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

fn validate(native_f16: bool) -> usize {
    let caps = if native_f16 {
        BASE | Capabilities::SHADER_FLOAT16
    } else {
        BASE
    };
    let mut checked = 0;
    for kernel in shader::ALL {
        let n = kernel.slots.iter().filter(|s| s.typed).count();
        for reprs in combos(n, Repr::all(native_f16)) {
            let src = shader::assemble(kernel, &reprs);
            let module = naga::front::wgsl::parse_str(&src).unwrap_or_else(|e| {
                panic!(
                    "shaders/{} with {reprs:?} does not parse:\n{}",
                    kernel.file,
                    e.emit_to_string_with_path(&src, kernel.file)
                )
            });
            Validator::new(ValidationFlags::all(), caps)
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

#[test]
fn every_kernel_validates_with_native_f16() {
    // 1 (fill) + 4^2 (cast) + 4^3 (binary) + 4^2 + 4^2 + 4 (reduce) + 1 (nonfinite)
    assert_eq!(validate(true), 1 + 16 + 64 + 16 + 16 + 4 + 1);
}

#[test]
fn every_kernel_validates_without_f16() {
    assert_eq!(validate(false), 1 + 9 + 27 + 9 + 9 + 3 + 1);
}

#[test]
fn native_f16_kernels_need_the_capability() {
    // The packed path exists because these fail without SHADER_F16; prove the check is real.
    let src = shader::assemble(&shader::CAST, &[Repr::F16, Repr::F32]);
    let module = naga::front::wgsl::parse_str(&src).expect("parses");
    let result = Validator::new(ValidationFlags::all(), BASE).validate(&module);
    assert!(
        result.is_err(),
        "native-f16 cast validated without the f16 capability"
    );
}
