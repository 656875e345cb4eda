//! WGSL -> SPIR-V: the kernel assembled as for wgpu, its overrides fixed, translated by
//! naga for the capabilities this device has.

use ash::vk;
use kiln_lowering::shader::{self, KernelSource, Repr};
use naga::back::spv::{self, Capability};

use crate::instance::Features;

/// The SPIR-V capabilities a device allows the translated kernels.
pub(crate) fn capabilities(f: &Features, f16: bool) -> naga::FastHashSet<Capability> {
    let mut caps: naga::FastHashSet<Capability> = [Capability::Shader].into_iter().collect();
    if f16 {
        caps.extend([
            Capability::Float16,
            Capability::StorageBuffer16BitAccess,
            Capability::UniformAndStorageBuffer16BitAccess,
        ]);
    }
    use vk::SubgroupFeatureFlags as S;
    let ops = f.subgroup_ops;
    for (flag, cap) in [
        (S::BASIC, Capability::GroupNonUniform),
        (S::VOTE, Capability::GroupNonUniformVote),
        (S::ARITHMETIC, Capability::GroupNonUniformArithmetic),
        (S::BALLOT, Capability::GroupNonUniformBallot),
        (S::SHUFFLE, Capability::GroupNonUniformShuffle),
        (
            S::SHUFFLE_RELATIVE,
            Capability::GroupNonUniformShuffleRelative,
        ),
        (S::CLUSTERED, Capability::GroupNonUniformClustered),
        (S::QUAD, Capability::GroupNonUniformQuad),
    ] {
        if ops.contains(flag) {
            caps.insert(cap);
        }
    }
    caps
}

/// The SPIR-V words of `kernel` with `reprs`, assembly `consts` and `overrides`
/// fixed; an error names what failed (a capability the device lacks, by name).
pub(crate) fn translate(
    kernel: &KernelSource,
    reprs: &[Repr],
    consts: &[(&'static str, u32)],
    overrides: &[(&'static str, u32)],
    allowed: &naga::FastHashSet<Capability>,
) -> std::result::Result<Vec<u32>, String> {
    let source = shader::assemble(kernel, reprs, consts);
    let module = naga::front::wgsl::parse_str(&source)
        .map_err(|e| format!("WGSL did not parse: {}", e.emit_to_string(&source)))?;
    let info = naga::valid::Validator::new(
        naga::valid::ValidationFlags::all(),
        naga::valid::Capabilities::all(),
    )
    .validate(&module)
    .map_err(|e| format!("WGSL did not validate: {}", e.emit_to_string(&source)))?;
    let mut constants = naga::back::PipelineConstants::default();
    for &(name, value) in overrides {
        constants.insert(name.to_string(), value as f64);
    }
    let (module, info) = naga::back::pipeline_constants::process_overrides(
        &module,
        &info,
        Some((naga::ShaderStage::Compute, "main")),
        &constants,
    )
    .map_err(|e| format!("fixing its overrides: {e}"))?;
    let mut options = spv::Options {
        // Subgroup operations need SPIR-V 1.3 (Vulkan 1.1).
        lang_version: (1, 3),
        flags: spv::WriterFlags::empty(),
        capabilities: Some(allowed.clone()),
        // As wgpu does: the kernels' workgroup memory is written before it is read.
        zero_initialize_workgroup_memory: spv::ZeroInitializeWorkgroupMemoryMode::None,
        // Compute kernels have no f16 stage inputs or outputs, yet naga declares
        // StorageInputOutput16 beside Float16 unless told not to, and a module declaring
        // it needs the `storageInputOutput16` feature, which Kiln neither asks for nor
        // needs (the validation layer's VUID-VkShaderModuleCreateInfo-pCode-01091).
        use_storage_input_output_16: false,
        ..spv::Options::default()
    };
    if kernel.trusted {
        // `trusted` kernels clamp every index themselves and bound their loops by
        // launch parameters (see shader.rs), as the wgpu backend relies on.
        options.bounds_check_policies = naga::proc::BoundsCheckPolicies::default();
        options.force_loop_bounding = false;
    } else {
        let restrict = naga::proc::BoundsCheckPolicy::Restrict;
        options.bounds_check_policies = naga::proc::BoundsCheckPolicies {
            index: restrict,
            buffer: restrict,
            image_load: restrict,
            binding_array: restrict,
        };
    }
    let pipeline = spv::PipelineOptions {
        shader_stage: naga::ShaderStage::Compute,
        entry_point: "main".into(),
    };
    spv::write_vec(&module, &info, &options, Some(&pipeline)).map_err(|e| match e {
        spv::Error::MissingCapabilities(what, caps) => format!(
            "its SPIR-V ({what}) needs the capabilities {caps:?}, which this device does not \
             offer (shaderFloat16 and 16-bit storage for f16 kernels, subgroup operations in \
             compute shaders for the subgroup kernels); use another device, or f16 off \
             (DeviceOptions::disable_f16) for the f16 ones"
        ),
        e => format!("naga could not translate it to SPIR-V: {e}"),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_f16_kernel_without_float16_names_the_missing_capability() {
        let only_shader: naga::FastHashSet<Capability> = [Capability::Shader].into_iter().collect();
        let err = translate(
            &shader::CAST,
            &[Repr::F16, Repr::F32],
            &[],
            &[],
            &only_shader,
        )
        .expect_err("f16 arithmetic needs Float16");
        assert!(err.contains("Float16"), "{err}");
        assert!(err.contains("shaderFloat16"), "{err}");
        // The same kernel on packed f16 needs nothing beyond Shader.
        translate(
            &shader::CAST,
            &[Repr::F16Packed, Repr::F32],
            &[],
            &[],
            &only_shader,
        )
        .unwrap();
    }

    /// Its SPIR-V declares only capabilities the device was opened with: no
    /// StorageInputOutput16 (f16 stage I/O, which compute kernels have none of).
    #[test]
    fn an_f16_kernel_declares_no_f16_stage_io() {
        let f16: naga::FastHashSet<Capability> = [
            Capability::Shader,
            Capability::Float16,
            Capability::StorageBuffer16BitAccess,
            Capability::UniformAndStorageBuffer16BitAccess,
        ]
        .into_iter()
        .collect();
        let words = translate(&shader::CAST, &[Repr::F16, Repr::F32], &[], &[], &f16).unwrap();
        let declared = |cap: Capability| {
            // OpCapability: opcode 17, two words.
            words
                .windows(2)
                .any(|w| w[0] == (2 << 16 | 17) && w[1] == cap as u32)
        };
        assert!(declared(Capability::Float16));
        assert!(!declared(Capability::StorageInputOutput16));
    }
}
