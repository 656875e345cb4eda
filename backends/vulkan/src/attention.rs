//! The hand-written fused attention (`shaders/vulkan/attention.comp`, committed as
//! SPIR-V): one module per pass, specialized per launch shape.
//!
//! The launches themselves (bands of row blocks, parameters, the delta scratch) are
//! the WGSL kernels' ([`kiln_lowering::attention_launches`]), and so is the register-block
//! shape ([`kiln_lowering::plan_attention`]), so both backends walk the same blocks in the
//! same order; only the kernel that runs each dispatch differs.

use kiln_engine::{Buffer, Capabilities};
use kiln_lowering::{plan_attention, AttentionPass, AttentionPlan};

use crate::gemm::storage_code;

/// The register-block shape of the GLSL passes on `caps` at head dim `dim`: the WGSL
/// kernels' plan, but 8 rows per lane wherever block rows are shared. Measured on
/// lavapipe (T = 1024, causal, 4 heads, forward and backward timed in turn against the
/// WGSL kernels on wgpu in one process): 8 rows beat 4 at d = 64 (f32 forward 36.8 vs
/// 42.2 ms, backward 102 vs 118; f16 29.8 vs 32.4, 88 vs 97) and at d = 128 (44.5 vs
/// 47.1, 137 vs 151), and tie 16 at d = 32; the WGSL kernels keep 4 at d > 32, where
/// their measurement preferred it.
pub fn plan(caps: &Capabilities, dim: usize) -> AttentionPlan {
    let mut plan = plan_attention(caps, dim);
    if plan.shared {
        plan.rows = 8;
    }
    plan
}

/// Push-constant bytes: `shaders/common/attention_params.wgsl`'s Params.
pub const PUSH_BYTES: u32 = 32;

const FWD_SPV: &[u8] = include_bytes!("../../../shaders/vulkan/spv/attention_fwd.spv");
const DQ_SPV: &[u8] = include_bytes!("../../../shaders/vulkan/spv/attention_dq.spv");
const DKV_SPV: &[u8] = include_bytes!("../../../shaders/vulkan/spv/attention_dkv.spv");
const FWD_PACKED_SPV: &[u8] =
    include_bytes!("../../../shaders/vulkan/spv/attention_fwd_packed.spv");
const DQ_PACKED_SPV: &[u8] = include_bytes!("../../../shaders/vulkan/spv/attention_dq_packed.spv");
const DKV_PACKED_SPV: &[u8] =
    include_bytes!("../../../shaders/vulkan/spv/attention_dkv_packed.spv");

/// The committed module of `pass`: its name (`shaders/vulkan/spv/NAME.spv`) and bytes.
/// `packed`: the build for devices without 16-bit storage (f16 and bf16 two to a
/// 32-bit word, as the WGSL kernels' packed representation keeps them).
pub fn module(pass: AttentionPass, packed: bool) -> (&'static str, &'static [u8]) {
    match (pass, packed) {
        (AttentionPass::Forward, false) => ("attention_fwd", FWD_SPV),
        (AttentionPass::Dq, false) => ("attention_dq", DQ_SPV),
        (AttentionPass::Dkv, false) => ("attention_dkv", DKV_SPV),
        (AttentionPass::Forward, true) => ("attention_fwd_packed", FWD_PACKED_SPV),
        (AttentionPass::Dq, true) => ("attention_dq_packed", DQ_PACKED_SPV),
        (AttentionPass::Dkv, true) => ("attention_dkv_packed", DKV_PACKED_SPV),
    }
}

/// Storage bindings of `pass`: its typed tensors, then lse (and delta backward), then
/// the documents' starts.
pub fn bindings(pass: AttentionPass) -> u32 {
    match pass {
        AttentionPass::Forward => 6,
        AttentionPass::Dq | AttentionPass::Dkv => 9,
    }
}

/// attention.comp's specialization constants for `plan` at head dim `dim` over the
/// launch's typed tensors: (constant_id, value).
pub fn spec(plan: &AttentionPlan, dim: usize, typed: &[Buffer]) -> Vec<(u32, u32)> {
    let mut out = vec![
        (1, plan.wg),
        (2, plan.sg),
        (3, plan.rows),
        (4, dim as u32),
        (5, plan.shared as u32),
    ];
    for (i, b) in typed.iter().enumerate() {
        out.push((10 + i as u32, storage_code(b.dtype)));
    }
    out
}

/// The pipeline's key: the module and every specialization.
pub fn pipeline_name(module: &str, spec: &[(u32, u32)]) -> String {
    let values: Vec<String> = spec.iter().map(|(_, v)| v.to_string()).collect();
    format!("{module} [{}]", values.join(","))
}

/// The subgroup size to require of a pipeline: the block rows shared by broadcasts,
/// where the device can require sizes (elsewhere the plan shares only on a device
/// whose one subgroup size is `plan.sg`).
pub fn required_subgroup(plan: &AttentionPlan, control: Option<(u32, u32)>) -> Option<u32> {
    match control {
        Some((lo, hi)) if plan.shared && (lo..=hi).contains(&plan.sg) => Some(plan.sg),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kiln_engine::DType;

    fn plan(shared: bool) -> AttentionPlan {
        AttentionPlan {
            sg: 8,
            wg: 8,
            rows: 4,
            shared,
        }
    }

    #[test]
    fn every_specialization_names_its_own_pipeline() {
        let buf = |dtype| Buffer {
            id: 1,
            len: 64,
            dtype,
        };
        let f32s = [buf(DType::F32); 4];
        let mut mixed = f32s;
        mixed[3] = buf(DType::BF16);
        let a = spec(&plan(true), 64, &f32s);
        assert_eq!(
            a,
            vec![
                (1, 8),
                (2, 8),
                (3, 4),
                (4, 64),
                (5, 1),
                (10, 0),
                (11, 0),
                (12, 0),
                (13, 0)
            ]
        );
        let fwd = module(AttentionPass::Forward, false).0;
        let names = [
            pipeline_name(fwd, &a),
            pipeline_name(module(AttentionPass::Dq, false).0, &a),
            pipeline_name(module(AttentionPass::Forward, true).0, &a),
            pipeline_name(fwd, &spec(&plan(false), 64, &f32s)),
            pipeline_name(fwd, &spec(&plan(true), 63, &f32s)),
            pipeline_name(fwd, &spec(&plan(true), 64, &mixed)),
        ];
        for (i, x) in names.iter().enumerate() {
            for y in &names[i + 1..] {
                assert_ne!(x, y);
            }
        }
    }

    fn caps(device_type: &str, subgroup_sizes: Option<(u32, u32)>) -> Capabilities {
        Capabilities {
            name: "test".into(),
            backend: "vk".into(),
            device_type: device_type.into(),
            vendor: 0,
            driver: String::new(),
            f16_arithmetic: true,
            subgroup_sizes,
            timestamp_queries: true,
            max_storage_binding: 128 << 20,
            max_buffer: 2 << 30,
            memory_budget: None,
            memory_heap: None,
            memory_limit: None,
        }
    }

    #[test]
    fn shared_blocks_take_eight_rows_per_lane_and_gpus_keep_the_wgsl_shape() {
        let lavapipe = caps("cpu", Some((8, 8)));
        for dim in [5, 32, 64, 128] {
            let p = super::plan(&lavapipe, dim);
            assert_eq!((p.sg, p.wg, p.rows, p.shared), (8, 8, 8, true), "d = {dim}");
        }
        let gpu = caps("discrete", Some((32, 32)));
        assert_eq!(super::plan(&gpu, 64), plan_attention(&gpu, 64));
        assert!(!super::plan(&gpu, 64).shared);
    }

    #[test]
    fn the_subgroup_size_is_required_only_where_blocks_are_shared_and_it_can_be() {
        assert_eq!(required_subgroup(&plan(true), Some((8, 8))), Some(8));
        assert_eq!(required_subgroup(&plan(true), Some((4, 64))), Some(8));
        assert_eq!(required_subgroup(&plan(true), Some((16, 64))), None);
        assert_eq!(required_subgroup(&plan(true), None), None);
        assert_eq!(required_subgroup(&plan(false), Some((8, 8))), None);
    }
}
