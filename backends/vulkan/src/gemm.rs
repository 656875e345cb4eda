//! Which GEMM a `Kernel::Matmul` on `vk:N` runs: the hand-written SPIR-V one
//! (`shaders/vulkan/matmul_cpu.comp`, its committed modules) where it covers the
//! product on a device it suits, else the WGSL GEMMs translated by naga — decided here
//! only, with the reason.
//!
//! The SPIR-V kernel is the twin of the WGSL CPU-class register-block kernel, so it
//! runs exactly where kiln-wgpu's GEMM planner (`plan_matmul`) picks that kernel, with
//! the planner's tile shape. On vk the shape is passed as specialization constants
//! (`constant_id` 1 and 2), so one module per storage type and transpose serves every
//! shape the planner picks, where wgpu's passthrough needs a module per shape.

use kiln_engine::{Capabilities, DType, Matmul};
use kiln_wgpu::{plan_matmul, MatmulVariant};

/// Lanes of one workgroup of matmul_cpu.comp (its `SG`): the subgroup its shuffles
/// share values across, so the device's subgroups must hold exactly this many.
pub const LANES: u32 = 8;

/// How the SPIR-V GEMM runs one product.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct SpirvGemmPlan {
    /// Storage of C; of A, B and the bias too unless `mixed` says otherwise: f32, or
    /// f16 with native 16-bit storage (bf16 only in `mixed`).
    pub dtype: DType,
    pub trans_a: bool,
    pub trans_b: bool,
    /// B read as 4-value groups (B as stored, its rows and batch stride multiples of 4).
    pub vec_b: bool,
    /// The planner's tile: rows x vec4 column groups per lane.
    pub tm: u32,
    pub nv: u32,
    /// Subgroups of [`LANES`] are asked for (`requiredSubgroupSize`); otherwise the
    /// device's subgroups are that size without asking.
    pub require_subgroup: bool,
    /// The fused epilogue (a bias on every row, GELU, an f32 copy of C): the `_epi`
    /// modules, each part a specialization constant.
    pub bias: bool,
    pub gelu: bool,
    pub copy_f32: bool,
    /// Storage of A, B, C and the bias where they are not all f32 or all f16 (a bf16
    /// operand, f16 operands with an f32 C, an f32 bias on f16): the `_mixed` modules,
    /// each type a specialization constant. `dtype` is then C's.
    pub mixed: Option<[DType; 4]>,
    /// The planner's K split: `splits` chunks of `k_chunk` values (1 and K: none). A
    /// split product runs in the `_mixed` modules, which write f32 partials for the
    /// WGSL `matmul_finish` to sum with the epilogue.
    pub splits: u32,
    pub k_chunk: u32,
    /// beta is not 0, so C is read: `USE_BETA` of the `_epi` and `_mixed` modules
    /// (the others test beta as they run).
    pub use_beta: bool,
}

impl SpirvGemmPlan {
    /// Workgroups of one dispatch: column tiles, row tiles, matrices.
    pub fn groups(&self, mm: &Matmul) -> (u64, u64, u64) {
        (
            (mm.n as u64).div_ceil((LANES * 4 * self.nv) as u64),
            (mm.m as u64).div_ceil(self.tm as u64),
            mm.batch as u64 * self.splits as u64,
        )
    }

    /// The shader's `Params` block (strides of contiguous operands; the `_mixed`
    /// modules' K split and output count after them).
    pub fn params(&self, mm: &Matmul) -> [u32; 16] {
        let (m, n, k) = (mm.m as u32, mm.n as u32, mm.k as u32);
        [
            m,
            n,
            k,
            if mm.trans_a { m } else { k },
            if mm.trans_b { k } else { n },
            n,
            mm.stride_a as u32,
            mm.stride_b as u32,
            mm.stride_c as u32,
            mm.alpha.to_bits(),
            mm.beta.to_bits(),
            self.splits,
            self.k_chunk,
            (mm.batch * mm.m * mm.n) as u32,
            0,
            0,
        ]
    }
}

/// Which GEMM runs a product, and why.
#[derive(Clone, Debug, PartialEq)]
pub enum GemmRoute {
    /// The cooperative-matrix GEMM (`crate::coopmat`), where the device selected it
    /// and the product fits its tiles; checked before the others.
    CoopMat(crate::coopmat::CoopMatPlan),
    /// The hand-written SPIR-V GEMM.
    Spirv(SpirvGemmPlan),
    /// The WGSL GEMMs through naga, for the reason given.
    Naga(String),
}

/// What the route needs of a device beyond its [`Capabilities`].
#[derive(Clone, Copy, Debug, Default)]
pub struct GemmDevice {
    /// Subgroup sizes a pipeline may require (`subgroupSizeControl` for compute);
    /// none where it cannot.
    pub subgroup_control: Option<(u32, u32)>,
    /// Bytes past a binding's offset alignment that B's binding starts at (a view):
    /// 4-value loads need B to start on a 16-byte boundary.
    pub b_offset: u64,
}

/// The route of `mm` (validated) on a device with `caps` and `dev`.
pub fn route(mm: &Matmul, caps: &Capabilities, dev: GemmDevice) -> GemmRoute {
    let naga = |why: String| GemmRoute::Naga(why);
    let plan = match plan_matmul(mm, caps, None) {
        Ok(p) => p,
        // The naga path reports the planner's error at launch.
        Err(e) => return naga(format!("the GEMM planner refuses it ({e})")),
    };
    let MatmulVariant::Cpu { tm, nv } = plan.variant else {
        return naga(format!(
            "the GEMM planner chose its {} kernel; the SPIR-V GEMM is the twin of the \
             CPU-class register-block kernel only",
            plan.variant.name()
        ));
    };
    let partials = kiln_wgpu::split_partial_bytes(mm, &plan);
    if plan.splits > 1 && partials > caps.max_storage_binding {
        return naga(format!(
            "{partials} bytes of f32 partials for {} K splits, over the {}-byte binding \
             limit (the naga path splits the product in blocks)",
            plan.splits, caps.max_storage_binding
        ));
    }
    if mm.m == 0 || mm.n == 0 || mm.k == 0 {
        return naga("an empty product (M, N or K is 0)".into());
    }
    let dtype = mm.c.dtype;
    let bias_dtype = mm.bias.map_or(dtype, |b| b.dtype);
    let storage = [mm.a.dtype, mm.b.dtype, dtype, bias_dtype];
    if let Some(t) = storage
        .iter()
        .find(|t| !matches!(t, DType::F32 | DType::F16 | DType::BF16))
    {
        return naga(format!(
            "{t} storage; the SPIR-V GEMM stores f32, f16 or bf16"
        ));
    }
    // One type throughout, f32 or f16: the modules with that storage compiled in.
    // Anything else (bf16, or types that differ) reads and writes each operand as its
    // own type: the `_mixed` modules.
    let alike = storage.iter().all(|&t| t == dtype) && dtype != DType::BF16;
    let f32_only = dtype == DType::F32 && alike;
    if !f32_only && !caps.f16_arithmetic {
        return naga(format!(
            "{} x {} -> {dtype} storage without the device's native f16 (shaderFloat16, \
             16-bit storage)",
            mm.a.dtype, mm.b.dtype
        ));
    }
    let mixed = (!alike || plan.splits > 1).then_some(storage);
    let limit = caps.max_storage_binding;
    if let Some(big) = mm.buffers().iter().find(|b| b.bytes() > limit) {
        return naga(format!(
            "a {}-byte operand over the {limit}-byte binding limit (the naga path binds it \
             in blocks)",
            big.bytes()
        ));
    }
    let Some((lo, hi)) = caps.subgroup_sizes else {
        return naga("no subgroup operations in compute shaders".into());
    };
    let require_subgroup = match dev.subgroup_control {
        Some((min, max)) if (min..=max).contains(&LANES) => true,
        _ if (lo, hi) == (LANES, LANES) => false,
        Some((min, max)) => {
            return naga(format!(
                "subgroups of {min} to {max} lanes can be required here, not the {LANES} the \
                 SPIR-V GEMM's shuffles assume"
            ))
        }
        None => {
            return naga(format!(
                "subgroups of {lo} to {hi} lanes and no way to require {LANES} \
                 (`subgroupSizeControl` for compute: Vulkan 1.3 or \
                 VK_EXT_subgroup_size_control)"
            ))
        }
    };
    let p = SpirvGemmPlan {
        dtype,
        trans_a: mm.trans_a,
        trans_b: mm.trans_b,
        vec_b: !mm.trans_b
            && mm.n.is_multiple_of(4)
            && (mm.batch == 1 || mm.stride_b.is_multiple_of(4))
            && dev.b_offset.is_multiple_of(4 * mm.b.dtype.size() as u64),
        tm,
        nv,
        require_subgroup,
        bias: mm.bias.is_some(),
        gelu: mm.gelu,
        copy_f32: mm.c_f32.is_some(),
        mixed,
        splits: plan.splits,
        use_beta: mm.beta != 0.0,
        k_chunk: if plan.splits > 1 {
            plan.k_chunk
        } else {
            mm.k as u32
        },
    };
    let (x, y, z) = p.groups(mm);
    if x.max(y).max(z) > 65535 {
        return naga(format!(
            "{x} x {y} x {z} workgroups, over the 65535 per dimension of one dispatch"
        ));
    }
    GemmRoute::Spirv(p)
}

/// A committed module (`shaders/vulkan/spv/NAME.spv`): its name and bytes.
macro_rules! spv {
    ($name:literal) => {
        (
            $name,
            &include_bytes!(concat!("../../../shaders/vulkan/spv/", $name, ".spv"))[..],
        )
    };
}

impl SpirvGemmPlan {
    /// Runs the fused epilogue (an `_epi` module).
    pub fn epilogue(&self) -> bool {
        self.bias || self.gelu || self.copy_f32
    }

    /// Splits K (writes partials; `PARTIAL`).
    pub fn partial(&self) -> bool {
        self.splits > 1
    }

    /// What its pipeline depends on: not how K is split, only whether.
    pub fn pipeline_key(&self) -> SpirvGemmPlan {
        SpirvGemmPlan {
            splits: self.splits.min(2),
            k_chunk: 0,
            ..*self
        }
    }
}

/// The specialization code of a storage type in the `_mixed` modules.
pub fn storage_code(t: DType) -> u32 {
    match t {
        DType::F16 => 1,
        DType::BF16 => 2,
        _ => 0,
    }
}

/// The committed module of `p`: the 16x2 build of its storage type and transposes
/// (`shaders/vulkan/build.sh`), with the epilogue where it has one; the tile shape is
/// specialized at pipeline creation, so the other builds' compiled-in defaults are not
/// needed here.
pub fn module(p: &SpirvGemmPlan) -> (&'static str, &'static [u8]) {
    if p.mixed.is_some() {
        return match (p.trans_a, p.trans_b, p.vec_b) {
            (false, false, false) => spv!("matmul_cpu_16x2_nn_mixed"),
            (false, false, true) => spv!("matmul_cpu_16x2_nn_vec_mixed"),
            (false, true, _) => spv!("matmul_cpu_16x2_nt_mixed"),
            (true, false, false) => spv!("matmul_cpu_16x2_tn_mixed"),
            (true, false, true) => spv!("matmul_cpu_16x2_tn_vec_mixed"),
            (true, true, _) => spv!("matmul_cpu_16x2_tt_mixed"),
        };
    }
    if p.epilogue() {
        return epilogue_module(p);
    }
    let f16 = p.dtype == DType::F16;
    match (f16, p.trans_a, p.trans_b, p.vec_b) {
        (false, false, false, false) => spv!("matmul_cpu_16x2_f32_nn"),
        (false, false, false, true) => spv!("matmul_cpu_16x2_f32_nn_vec"),
        (false, false, true, _) => spv!("matmul_cpu_16x2_f32_nt"),
        (false, true, false, false) => spv!("matmul_cpu_16x2_f32_tn"),
        (false, true, false, true) => spv!("matmul_cpu_16x2_f32_tn_vec"),
        (false, true, true, _) => spv!("matmul_cpu_16x2_f32_tt"),
        (true, false, false, false) => spv!("matmul_cpu_16x2_f16_nn"),
        (true, false, false, true) => spv!("matmul_cpu_16x2_f16_nn_vec"),
        (true, false, true, _) => spv!("matmul_cpu_16x2_f16_nt"),
        (true, true, false, false) => spv!("matmul_cpu_16x2_f16_tn"),
        (true, true, false, true) => spv!("matmul_cpu_16x2_f16_tn_vec"),
        (true, true, true, _) => spv!("matmul_cpu_16x2_f16_tt"),
    }
}

fn epilogue_module(p: &SpirvGemmPlan) -> (&'static str, &'static [u8]) {
    let f16 = p.dtype == DType::F16;
    match (f16, p.trans_a, p.trans_b, p.vec_b) {
        (false, false, false, false) => spv!("matmul_cpu_16x2_f32_nn_epi"),
        (false, false, false, true) => spv!("matmul_cpu_16x2_f32_nn_vec_epi"),
        (false, false, true, _) => spv!("matmul_cpu_16x2_f32_nt_epi"),
        (false, true, false, false) => spv!("matmul_cpu_16x2_f32_tn_epi"),
        (false, true, false, true) => spv!("matmul_cpu_16x2_f32_tn_vec_epi"),
        (false, true, true, _) => spv!("matmul_cpu_16x2_f32_tt_epi"),
        (true, false, false, false) => spv!("matmul_cpu_16x2_f16_nn_epi"),
        (true, false, false, true) => spv!("matmul_cpu_16x2_f16_nn_vec_epi"),
        (true, false, true, _) => spv!("matmul_cpu_16x2_f16_nt_epi"),
        (true, true, false, false) => spv!("matmul_cpu_16x2_f16_tn_epi"),
        (true, true, false, true) => spv!("matmul_cpu_16x2_f16_tn_vec_epi"),
        (true, true, true, _) => spv!("matmul_cpu_16x2_f16_tt_epi"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kiln_engine::Buffer;

    fn lavapipe() -> Capabilities {
        Capabilities {
            name: "llvmpipe".into(),
            backend: "vk".into(),
            device_type: "cpu".into(),
            vendor: 0x10005,
            driver: String::new(),
            f16_arithmetic: true,
            subgroup_sizes: Some((8, 8)),
            timestamp_queries: true,
            max_storage_binding: 128 << 20,
            max_buffer: 2 << 30,
            memory_budget: None,
        }
    }

    fn mm(dtype: DType, m: usize, n: usize, k: usize) -> Matmul {
        let buf = |id, len| Buffer { id, dtype, len };
        Matmul::new(buf(1, m * k), buf(2, k * n), buf(3, m * n), m, n, k)
    }

    fn why(r: GemmRoute) -> String {
        match r {
            GemmRoute::Naga(w) => w,
            other => panic!("expected the naga path, got {other:?}"),
        }
    }

    #[test]
    fn the_planners_cpu_tile_runs_as_spirv_with_its_shape() {
        let control = GemmDevice {
            subgroup_control: Some((8, 8)),
            b_offset: 0,
        };
        let GemmRoute::Spirv(p) = route(&mm(DType::F16, 256, 256, 256), &lavapipe(), control)
        else {
            panic!("not routed to SPIR-V")
        };
        let MatmulVariant::Cpu { tm, nv } =
            plan_matmul(&mm(DType::F16, 256, 256, 256), &lavapipe(), None)
                .unwrap()
                .variant
        else {
            panic!()
        };
        assert_eq!(
            (p.tm, p.nv, p.require_subgroup, p.vec_b),
            (tm, nv, true, true)
        );
        // A fixed size of 8 needs no control; a B view off a 16-byte boundary is read
        // value by value.
        let fixed = GemmDevice {
            subgroup_control: None,
            b_offset: 8,
        };
        let GemmRoute::Spirv(p) = route(&mm(DType::F32, 40, 24, 9), &lavapipe(), fixed) else {
            panic!()
        };
        assert!(!p.require_subgroup && !p.vec_b);
    }

    #[test]
    fn bf16_and_mixed_storage_run_as_spirv_with_each_type_specialized() {
        let d = GemmDevice {
            subgroup_control: Some((8, 8)),
            b_offset: 0,
        };
        let caps = lavapipe();
        let mixed = |mm: &Matmul| match route(mm, &caps, d) {
            GemmRoute::Spirv(p) => p.mixed,
            other => panic!("not routed to SPIR-V: {other:?}"),
        };
        let (f32_, f16_, bf16) = (DType::F32, DType::F16, DType::BF16);
        // One type throughout: the compiled-in modules.
        assert_eq!(mixed(&mm(f32_, 64, 64, 64)), None);
        assert_eq!(mixed(&mm(f16_, 64, 64, 64)), None);
        assert_eq!(mixed(&mm(bf16, 64, 64, 64)), Some([bf16; 4]));
        let mut grad = mm(f16_, 61, 32, 32);
        grad.c.dtype = f32_;
        assert_eq!(mixed(&grad), Some([f16_, f16_, f32_, f32_]));
        let mut bias = mm(f16_, 64, 64, 64);
        bias.bias = Some(Buffer {
            id: 4,
            dtype: f32_,
            len: 64,
        });
        assert_eq!(mixed(&bias), Some([f16_, f16_, f16_, f32_]));
        // B's 4-value loads need its view on a 4-value boundary of its own type.
        let mut b16 = mm(f32_, 64, 64, 64);
        b16.b.dtype = bf16;
        let view = GemmDevice { b_offset: 4, ..d };
        let (GemmRoute::Spirv(p), GemmRoute::Spirv(q)) =
            (route(&b16, &caps, d), route(&b16, &caps, view))
        else {
            panic!()
        };
        assert!(p.vec_b && !q.vec_b);
        assert_eq!(p.mixed, Some([f32_, bf16, f32_, f32_]));
        assert_eq!(module(&p).0, "matmul_cpu_16x2_nn_vec_mixed");
        assert_eq!(module(&q).0, "matmul_cpu_16x2_nn_mixed");
        let GemmRoute::Spirv(r) = route(&bias, &caps, d) else {
            panic!()
        };
        assert_eq!(module(&r).0, "matmul_cpu_16x2_nn_vec_mixed");
    }

    #[test]
    fn split_k_runs_as_spirv_with_the_planners_chunks() {
        let d = GemmDevice::default();
        let product = mm(DType::F32, 2, 3, 2000);
        let plan = plan_matmul(&product, &lavapipe(), None).unwrap();
        assert!(plan.splits > 1, "{plan:?}");
        let GemmRoute::Spirv(p) = route(&product, &lavapipe(), d) else {
            panic!("not routed to SPIR-V")
        };
        assert_eq!((p.splits, p.k_chunk), (plan.splits, plan.k_chunk));
        assert_eq!(p.mixed, Some([DType::F32; 4]));
        assert_eq!(module(&p).0, "matmul_cpu_16x2_nn_mixed");
        // Matrices x splits workgroups deep; the split count, chunk and output count
        // follow alpha and beta in the parameters.
        assert_eq!(p.groups(&product).2, plan.splits as u64);
        assert_eq!(
            p.params(&product)[11..15],
            [plan.splits, plan.k_chunk, 6, 0]
        );
        // One pipeline for every chunk length.
        let other = SpirvGemmPlan {
            splits: 7,
            k_chunk: 64,
            ..p
        };
        assert_eq!(other.pipeline_key(), p.pipeline_key());
        // Unsplit: K in one chunk.
        let GemmRoute::Spirv(q) = route(&mm(DType::BF16, 2, 3, 40), &lavapipe(), d) else {
            panic!()
        };
        assert_eq!((q.splits, q.k_chunk, q.partial()), (1, 40, false));
    }

    #[test]
    fn every_other_case_names_why_it_takes_the_naga_path() {
        let d = GemmDevice::default();
        let caps = lavapipe();
        let gpu = Capabilities {
            device_type: "discrete".into(),
            subgroup_sizes: Some((32, 32)),
            ..lavapipe()
        };
        assert!(why(route(&mm(DType::F32, 256, 256, 256), &gpu, d)).contains("tiled"));
        let packed = Capabilities {
            f16_arithmetic: false,
            ..lavapipe()
        };
        assert!(why(route(&mm(DType::F16, 64, 64, 64), &packed, d)).contains("native f16"));
        let mut mixed = mm(DType::F16, 64, 64, 64);
        mixed.c.dtype = DType::F32;
        assert!(why(route(&mixed, &packed, d)).contains("f16 x f16 -> f32 storage without"));
        assert!(why(route(&mm(DType::BF16, 64, 64, 64), &packed, d)).contains("native f16"));
        assert!(why(route(&mm(DType::F32, 64, 64, 0), &caps, d)).contains("empty"));
        let wide = Capabilities {
            subgroup_sizes: Some((4, 16)),
            ..lavapipe()
        };
        assert!(why(route(&mm(DType::F32, 64, 64, 64), &wide, d)).contains("no way to require 8"));
        let other = GemmDevice {
            subgroup_control: Some((16, 64)),
            b_offset: 0,
        };
        assert!(why(route(&mm(DType::F32, 64, 64, 64), &wide, other)).contains("16 to 64"));
        let small = Capabilities {
            max_storage_binding: 1024,
            ..lavapipe()
        };
        assert!(why(route(&mm(DType::F32, 64, 64, 64), &small, d)).contains("binding limit"));
    }
}
