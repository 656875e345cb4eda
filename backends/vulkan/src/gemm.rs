//! Which GEMM a `Kernel::Matmul` on `vk:N` runs: the hand-written SPIR-V ones
//! (`shaders/vulkan/matmul_cpu.comp`, `matmul_tiled.comp` and `gemv.comp`, their
//! committed modules) where they cover the product on the device, else the WGSL GEMMs
//! translated by naga — decided here only, with the reason.
//!
//! The SPIR-V kernel is the twin of the WGSL CPU-class register-block kernel, so it
//! runs exactly where the shared GEMM planner (`kiln_lowering::plan_matmul`) picks that
//! kernel, with the planner's tile shape. On vk the shape is passed as specialization constants
//! (`constant_id` 1 and 2), so one module per storage type and transpose serves every
//! shape the planner picks, where wgpu's passthrough needs a module per shape.
//!
//! Where the device has uniform texel buffers, the SPIR-V kernel reads A and B through
//! views of their storage ([`TexelViews`]: a CPU driver gathers those, where it loops
//! over the lanes of a storage load); the sums are the same either way.
//!
//! The GPU-class tiled kernel and the GEMV have twins too ([`GemmRoute::SpirvGpu`]),
//! run wherever the planner picks them, within the device's shared-memory and
//! workgroup limits; one module each serves every shape, transpose and storage type.

use ash::vk;
use kiln_engine::{Capabilities, DType, Matmul};
use kiln_lowering::{plan_matmul, MatmulVariant};

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
    /// A and B read through uniform texel buffers (the `_mixed_texel` modules, so
    /// `mixed` is set): views of their storage, [`texel_format`]'s.
    pub texel: bool,
}

/// What a device allows of the uniform texel buffers the CPU-class GEMM reads A and B
/// through: a CPU driver such as lavapipe (Mesa 22.3) turns a storage-buffer load whose
/// address differs across lanes into a loop over the lanes with a branch per lane, and
/// a texel fetch into a vector gather — about 3x the GEMM where the CPU has no AVX-512,
/// 1.2-1.35x where it has (benches/RESULTS.md). The views are made per launch from the operands' storage, so
/// nothing is copied.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TexelViews {
    /// `maxTexelBufferElements`: texels one view may hold.
    pub max_elements: u64,
    /// `minTexelBufferOffsetAlignment`: where a view may start in its buffer.
    pub offset_align: u64,
}

/// The formats A and B are viewed as, each of which must be a uniform texel buffer
/// format on the device: f32, f16 and bf16's bits, one and four to a texel.
pub const TEXEL_FORMATS: [vk::Format; 6] = [
    vk::Format::R32_SFLOAT,
    vk::Format::R32G32B32A32_SFLOAT,
    vk::Format::R16_SFLOAT,
    vk::Format::R16G16B16A16_SFLOAT,
    vk::Format::R16_UINT,
    vk::Format::R16G16B16A16_UINT,
];

/// The view format of an operand stored as `dtype` (f32, f16 or bf16), read `four`
/// values to a fetch or one: the fetch returns the stored value exactly (a bf16's bits,
/// which the shader shifts into an f32).
pub fn texel_format(dtype: DType, four: bool) -> vk::Format {
    let [one, quad] = match dtype {
        DType::F16 => [TEXEL_FORMATS[2], TEXEL_FORMATS[3]],
        DType::BF16 => [TEXEL_FORMATS[4], TEXEL_FORMATS[5]],
        _ => [TEXEL_FORMATS[0], TEXEL_FORMATS[1]],
    };
    if four {
        quad
    } else {
        one
    }
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
        params(mm, self.splits, self.k_chunk, 0)
    }
}

/// The GPU-class kernels' SPIR-V twins, with the planner's shape.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum GpuKernel {
    /// `shaders/vulkan/matmul_tiled.comp`: `bm` x `bn` outputs per 16 x 16 workgroup,
    /// K in steps of `bk` through shared memory.
    Tiled { bm: u32, bn: u32, bk: u32 },
    /// `shaders/vulkan/gemv.comp` (N = 1): `lanes` invocations per output row.
    Gemv { lanes: u32 },
}

/// How the SPIR-V twins of the WGSL tiled GEMM and GEMV run one product: everything
/// but the module (16-bit storage or not) is a specialization constant.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct GpuGemmPlan {
    pub kernel: GpuKernel,
    /// Storage of A, B, C and the bias (C's where there is none).
    pub storage: [DType; 4],
    pub trans_a: bool,
    pub trans_b: bool,
    /// 16-byte loads along A's / B's contiguous dimension (the tiled kernel only): it
    /// is a multiple of 4, and so are the batch stride and the view's start.
    pub vec_a: bool,
    pub vec_b: bool,
    pub bias: bool,
    pub gelu: bool,
    pub copy_f32: bool,
    /// beta is not 0, so C is read.
    pub use_beta: bool,
    /// The planner's K split: `splits` chunks of `k_chunk` values (1 and K: none); a
    /// split writes f32 partials for the WGSL `matmul_finish`.
    pub splits: u32,
    pub k_chunk: u32,
    /// The planner's output rows per dispatch (a multiple of the kernel's rows per
    /// workgroup), so that no dispatch runs long enough for a GPU's watchdog.
    pub rows_per_dispatch: u32,
    /// The device has no 16-bit storage: f16 and bf16 operands are read two to a word
    /// (the `_packed` module), and a 16-bit C is written through the partials
    /// (`partial_c`), whose WGSL `matmul_finish` stores whole words.
    pub packed: bool,
    pub partial_c: bool,
}

impl GpuGemmPlan {
    /// Workgroups of one dispatch: column tiles, row tiles, matrices x splits.
    pub fn groups(&self, mm: &Matmul) -> (u64, u64, u64) {
        let (bm, bn) = match self.kernel {
            GpuKernel::Tiled { bm, bn, .. } => (bm, bn),
            GpuKernel::Gemv { .. } => (1, 1),
        };
        (
            (mm.n as u64).div_ceil(bn as u64),
            (mm.m as u64).div_ceil(bm as u64),
            mm.batch as u64 * self.splits as u64,
        )
    }

    /// The dispatches of one product: each one's first output row and workgroups
    /// (column tiles, row tiles, matrices x splits), rows in the planner's chunks.
    pub fn dispatches(&self, mm: &Matmul) -> Vec<(u32, (u64, u64, u64))> {
        let (x, _, z) = self.groups(mm);
        let bm = match self.kernel {
            GpuKernel::Tiled { bm, .. } => bm,
            GpuKernel::Gemv { .. } => 1,
        };
        let m = mm.m as u32;
        (0..m)
            .step_by(self.rows_per_dispatch.max(1) as usize)
            .map(|row| {
                let rows = self.rows_per_dispatch.min(m - row);
                (row, (x, rows.div_ceil(bm) as u64, z))
            })
            .collect()
    }

    /// The shaders' `Params` block (shaders/vulkan/common/gemm_io.glsl) of the
    /// dispatch from output row `row_base`: the CPU-class kernel's layout, the first
    /// row after it.
    pub fn params(&self, mm: &Matmul, row_base: u32) -> [u32; 16] {
        params(mm, self.splits, self.k_chunk, row_base)
    }

    /// Writes partials for `matmul_finish` (`PARTIAL`): K is split, or C is 16-bit
    /// on a device without 16-bit storage.
    pub fn partial(&self) -> bool {
        self.splits > 1 || self.partial_c
    }

    /// Runs the `_packed` module, which needs no 16-bit storage: the device has none,
    /// or every operand is f32.
    pub fn no_16bit_storage(&self) -> bool {
        self.packed || self.storage == [DType::F32; 4]
    }

    /// What its pipeline depends on: not how K or the rows are split, only whether
    /// K is.
    pub fn pipeline_key(&self) -> GpuGemmPlan {
        GpuGemmPlan {
            splits: self.splits.min(2),
            k_chunk: 0,
            rows_per_dispatch: 0,
            ..*self
        }
    }

    /// Specialization constants 1-16 of matmul_tiled.comp and gemv.comp (constant 1
    /// is the GEMV's workgroup size; each module ignores the ones it lacks).
    pub fn spec(&self) -> [u32; 16] {
        let (one, two, bk) = match self.kernel {
            GpuKernel::Tiled { bm, bn, bk } => (bm, bn, bk),
            GpuKernel::Gemv { lanes } => (lanes, 0, 0),
        };
        let st = self.storage.map(storage_code);
        let f = |b: bool| b as u32;
        [
            one,
            two,
            f(self.bias),
            f(self.gelu),
            f(self.copy_f32),
            st[0],
            st[1],
            st[2],
            st[3],
            f(self.partial()),
            f(self.use_beta),
            bk,
            f(self.trans_a),
            f(self.trans_b),
            f(self.vec_a),
            f(self.vec_b),
        ]
    }

    /// Bytes of shared memory its workgroup uses: the tiled kernel's two tiles (an
    /// f16 operand's kept f16; the other type's array shrinks to one element), the
    /// GEMV's partial sums.
    pub fn shared_bytes(&self) -> u64 {
        match self.kernel {
            GpuKernel::Tiled { bm, bn, bk } => {
                let tile = |side: u32, t: DType| {
                    let len = bk as u64 * (side as u64 + 1);
                    // The `_packed` build keeps every tile f32.
                    if t == DType::F16 && !self.packed {
                        2 * len + 4
                    } else {
                        4 * len + 2
                    }
                };
                tile(bm, self.storage[0]) + tile(bn, self.storage[1])
            }
            GpuKernel::Gemv { lanes } => 4 * lanes as u64,
        }
    }

    /// Invocations per workgroup.
    pub fn invocations(&self) -> u32 {
        match self.kernel {
            GpuKernel::Tiled { .. } => 256,
            GpuKernel::Gemv { lanes } => lanes,
        }
    }
}

/// The hand-written GEMMs' `Params` block: sizes, row strides of contiguous operands,
/// batch strides, alpha and beta, the K split (`splits` chunks of `k_chunk`), the
/// output count of one split's partials and the dispatch's first row.
fn params(mm: &Matmul, splits: u32, k_chunk: u32, row_base: u32) -> [u32; 16] {
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
        splits,
        k_chunk,
        (mm.batch * mm.m * mm.n) as u32,
        row_base,
        0,
    ]
}

/// Which GEMM runs a product, and why.
#[derive(Clone, Debug, PartialEq)]
pub enum GemmRoute {
    /// The cooperative-matrix GEMM (`crate::coopmat`), where the device selected it
    /// and the product fits its tiles; checked before the others.
    CoopMat(crate::coopmat::CoopMatPlan),
    /// The hand-written SPIR-V GEMM.
    Spirv(SpirvGemmPlan),
    /// The hand-written SPIR-V twins of the GPU-class tiled GEMM and the GEMV.
    SpirvGpu(GpuGemmPlan),
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
    /// The same of A's binding (the tiled kernel loads A 4 values at a time too).
    pub a_offset: u64,
    /// `maxComputeSharedMemorySize`: the tiled kernel's tiles must fit it.
    pub max_shared: u32,
    /// The largest workgroup (`maxComputeWorkGroupInvocations`) and its largest side
    /// along x (`maxComputeWorkGroupSize[0]`: the GEMV's lanes lie along x, the tiled
    /// kernel's 16 x 16 within every device's).
    pub max_invocations: u32,
    pub max_group_x: u32,
    /// The kernel the planner is made to pick ([`crate::VkDevice::force_gemm_variant`]).
    pub force: Option<MatmulVariant>,
    /// Texel buffers for the CPU-class kernel's A and B, where the device has them.
    pub texel: Option<TexelViews>,
}

/// The route of `mm` (validated) on a device with `caps` and `dev`.
pub fn route(mm: &Matmul, caps: &Capabilities, dev: GemmDevice) -> GemmRoute {
    let naga = |why: String| GemmRoute::Naga(why);
    let plan = match plan_matmul(mm, caps, dev.force) {
        Ok(p) => p,
        // The naga path reports the planner's error at launch.
        Err(e) => return naga(format!("the GEMM planner refuses it ({e})")),
    };
    // The CPU-class kernel's tile, or the GPU-class kernel whose twin runs it (which
    // leaves `route` below, before the tile is read).
    let (tm, nv, gpu) = match plan.variant {
        MatmulVariant::Cpu { tm, nv } => (tm, nv, None),
        MatmulVariant::Tiled { bm, bn, bk } => (0, 0, Some(GpuKernel::Tiled { bm, bn, bk })),
        // The twin computes one column (a forced GEMV may be asked for more).
        MatmulVariant::Gemv { .. } if mm.n != 1 => {
            return naga(format!(
                "a GEMV of {} columns; the GEMV's SPIR-V twin computes N = 1",
                mm.n
            ))
        }
        MatmulVariant::Gemv { lanes } => (0, 0, Some(GpuKernel::Gemv { lanes })),
        MatmulVariant::Naive => {
            return naga(format!(
                "the GEMM planner chose its {} kernel, which has no SPIR-V twin",
                plan.variant.name()
            ))
        }
    };
    // A 16-bit C without 16-bit storage goes through the partials too (`route_gpu`).
    let partial_c = gpu.is_some() && !caps.f16_arithmetic && mm.c.dtype != DType::F32;
    let partials = kiln_lowering::split_partial_bytes(mm, &plan);
    if (plan.splits > 1 || partial_c) && partials > caps.max_storage_binding {
        return naga(format!(
            "{partials} bytes of f32 partials for {} K split(s), over the {}-byte binding \
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
    // The GPU-class twins read 16-bit operands two to a word where the device has no
    // 16-bit storage; the CPU-class kernel does not.
    if !f32_only && !caps.f16_arithmetic && gpu.is_none() {
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
    if let Some(kernel) = gpu {
        return route_gpu(mm, dev, kernel, storage, &plan, !caps.f16_arithmetic);
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
    let vec_b = !mm.trans_b
        && mm.n.is_multiple_of(4)
        && (mm.batch == 1 || mm.stride_b.is_multiple_of(4))
        && dev.b_offset.is_multiple_of(4 * mm.b.dtype.size() as u64);
    // A and B through texel views where each view can start at its operand and hold
    // it (else storage loads: the same sums, slower on a CPU driver).
    let texel = dev.texel.is_some_and(|t| {
        let fits = |b: &kiln_engine::Buffer, offset: u64, per_texel: u64| {
            offset.is_multiple_of(t.offset_align) && b.len as u64 / per_texel <= t.max_elements
        };
        fits(&mm.a, dev.a_offset, 1) && fits(&mm.b, dev.b_offset, if vec_b { 4 } else { 1 })
    });
    let p = SpirvGemmPlan {
        dtype,
        trans_a: mm.trans_a,
        trans_b: mm.trans_b,
        vec_b,
        tm,
        nv,
        require_subgroup,
        bias: mm.bias.is_some(),
        gelu: mm.gelu,
        copy_f32: mm.c_f32.is_some(),
        // The texel modules are `_mixed` builds (the views' formats give the types).
        mixed: if texel { Some(storage) } else { mixed },
        texel,
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

/// The route of `mm` on the tiled GEMM's or the GEMV's twin, once the checks every
/// SPIR-V kernel shares have passed (storage the device stores, operands and partials
/// within one binding): what is left is this device's workgroup limits.
fn route_gpu(
    mm: &Matmul,
    dev: GemmDevice,
    kernel: GpuKernel,
    storage: [DType; 4],
    plan: &kiln_lowering::MatmulPlan,
    packed: bool,
) -> GemmRoute {
    // 16-byte loads need every 4-group of the contiguous dimension to start 4 values
    // into the binding, which starts 4 values past an aligned offset.
    let aligned = |dim: usize, stride: usize, offset: u64, t: DType| {
        dim.is_multiple_of(4)
            && (mm.batch == 1 || stride.is_multiple_of(4))
            && offset.is_multiple_of(4 * t.size() as u64)
    };
    let tiled = matches!(kernel, GpuKernel::Tiled { .. });
    let partial_c = packed && storage[2] != DType::F32;
    let p = GpuGemmPlan {
        kernel,
        storage,
        trans_a: mm.trans_a,
        trans_b: mm.trans_b,
        vec_a: tiled
            && aligned(
                if mm.trans_a { mm.m } else { mm.k },
                mm.stride_a,
                dev.a_offset,
                mm.a.dtype,
            ),
        vec_b: tiled
            && aligned(
                if mm.trans_b { mm.k } else { mm.n },
                mm.stride_b,
                dev.b_offset,
                mm.b.dtype,
            ),
        bias: mm.bias.is_some(),
        gelu: mm.gelu,
        copy_f32: mm.c_f32.is_some(),
        use_beta: mm.beta != 0.0,
        splits: plan.splits,
        // Through the partials, the planner's chunk, which they are laid out by (one
        // chunk of at least K where K is not split).
        k_chunk: if plan.splits > 1 || partial_c {
            plan.k_chunk
        } else {
            mm.k as u32
        },
        rows_per_dispatch: plan.rows_per_dispatch,
        packed,
        partial_c,
    };
    let name = plan.variant.name();
    let shared = p.shared_bytes();
    if shared > dev.max_shared as u64 {
        return GemmRoute::Naga(format!(
            "the {name} kernel needs {shared} bytes of shared memory, over this device's \
             {}-byte maxComputeSharedMemorySize",
            dev.max_shared
        ));
    }
    let along_x = match p.kernel {
        GpuKernel::Tiled { .. } => 16,
        GpuKernel::Gemv { lanes } => lanes,
    };
    if p.invocations() > dev.max_invocations || along_x > dev.max_group_x {
        return GemmRoute::Naga(format!(
            "the {name} kernel's workgroup of {} invocations ({along_x} along x) is over \
             this device's {} (maxComputeWorkGroupInvocations; {} along x, \
             maxComputeWorkGroupSize[0])",
            p.invocations(),
            dev.max_invocations,
            dev.max_group_x
        ));
    }
    // The planner keeps each dimension within a dispatch's 65535 (it refuses wider
    // products and deeper batches, and chunks the rows); checked here all the same.
    if let Some((_, (x, y, z))) = p
        .dispatches(mm)
        .into_iter()
        .find(|(_, (x, y, z))| *x.max(y).max(z) > 65535)
    {
        return GemmRoute::Naga(format!(
            "{x} x {y} x {z} workgroups of the {name} kernel, over the 65535 per dimension \
             of one dispatch"
        ));
    }
    GemmRoute::SpirvGpu(p)
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
    if p.texel {
        return match (p.trans_a, p.trans_b, p.vec_b) {
            (false, false, false) => spv!("matmul_cpu_16x2_nn_mixed_texel"),
            (false, false, true) => spv!("matmul_cpu_16x2_nn_vec_mixed_texel"),
            (false, true, _) => spv!("matmul_cpu_16x2_nt_mixed_texel"),
            (true, false, false) => spv!("matmul_cpu_16x2_tn_mixed_texel"),
            (true, false, true) => spv!("matmul_cpu_16x2_tn_vec_mixed_texel"),
            (true, true, _) => spv!("matmul_cpu_16x2_tt_mixed_texel"),
        };
    }
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

/// The committed module of a [`GpuGemmPlan`]: its kernel's, the `_packed` build
/// where it needs no 16-bit storage.
pub fn gpu_module(p: &GpuGemmPlan) -> (&'static str, &'static [u8]) {
    match (p.kernel, p.no_16bit_storage()) {
        (GpuKernel::Tiled { .. }, false) => spv!("matmul_tiled"),
        (GpuKernel::Tiled { .. }, true) => spv!("matmul_tiled_packed"),
        (GpuKernel::Gemv { .. }, false) => spv!("gemv"),
        (GpuKernel::Gemv { .. }, true) => spv!("gemv_packed"),
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
            memory_heap: None,
            memory_limit: None,
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
            ..GemmDevice::default()
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
            ..GemmDevice::default()
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
            ..GemmDevice::default()
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
    fn texel_views_read_a_and_b_where_each_view_can_start_and_hold_its_operand() {
        let texel = TexelViews {
            max_elements: 1 << 20,
            offset_align: 16,
        };
        let d = GemmDevice {
            texel: Some(texel),
            ..GemmDevice::default()
        };
        let plan = |product: &Matmul, dev: GemmDevice| match route(product, &lavapipe(), dev) {
            GemmRoute::Spirv(p) => p,
            other => panic!("not routed to SPIR-V: {other:?}"),
        };
        // Every storage runs the `_mixed` build's texel twin, with its types.
        for dtype in [DType::F32, DType::F16, DType::BF16] {
            let p = plan(&mm(dtype, 40, 24, 9), d);
            assert!(p.texel && p.vec_b, "{p:?}");
            assert_eq!(p.mixed, Some([dtype; 4]));
            assert_eq!(module(&p).0, "matmul_cpu_16x2_nn_vec_mixed_texel");
        }
        let mut tn = mm(DType::F32, 40, 23, 9);
        tn.trans_a = true;
        assert_eq!(module(&plan(&tn, d)).0, "matmul_cpu_16x2_tn_mixed_texel");
        // A view must start on the device's alignment...
        let product = mm(DType::F32, 40, 24, 9);
        for misaligned in [
            GemmDevice { a_offset: 8, ..d },
            GemmDevice { b_offset: 4, ..d },
        ] {
            let p = plan(&product, misaligned);
            assert!(!p.texel && p.mixed.is_none(), "{p:?}");
        }
        // ... and hold at most its texels: B four values to one, A one.
        let mut wide = mm(DType::F32, 4, 2048, 2048);
        assert!(plan(&wide, d).texel);
        wide.trans_b = true;
        assert!(!plan(&wide, d).texel);
        let tall = mm(DType::F32, 2048, 4, 1024);
        assert!(!plan(&tall, d).texel);
        // No texel buffers: the storage modules, as before.
        assert!(!plan(&product, GemmDevice::default()).texel);
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
        // The tiled GEMM's and the GEMV's twins: over this device's shared memory or
        // workgroup limits; a kernel without a twin.
        let product = mm(DType::F32, 256, 256, 256);
        let tight = GemmDevice {
            max_shared: 8 << 10,
            max_invocations: 1024,
            max_group_x: 1024,
            ..d
        };
        let w = why(route(&product, &gpu, tight));
        assert!(
            w.contains("tiled64x64x16 kernel needs 8324 bytes of shared memory")
                && w.contains("8192-byte maxComputeSharedMemorySize"),
            "{w}"
        );
        let narrow = GemmDevice {
            max_shared: 48 << 10,
            max_invocations: 128,
            max_group_x: 1024,
            ..d
        };
        let w = why(route(&product, &gpu, narrow));
        assert!(
            w.contains("workgroup of 256 invocations (16 along x) is over this device's 128"),
            "{w}"
        );
        // 256 invocations but 128 along x: the tiled kernel's 16 x 16 fits.
        let short_x = GemmDevice {
            max_shared: 48 << 10,
            max_invocations: 256,
            max_group_x: 128,
            ..d
        };
        assert!(matches!(
            route(&product, &gpu, short_x),
            GemmRoute::SpirvGpu(_)
        ));
        let forced = |v| GemmDevice {
            force: Some(v),
            ..gpu_device()
        };
        let gemv = MatmulVariant::Gemv { lanes: 256 };
        assert!(why(route(
            &mm(DType::F32, 64, 1, 64),
            &caps,
            GemmDevice {
                max_invocations: 1024,
                max_group_x: 128,
                ..forced(gemv)
            }
        ))
        .contains("gemv256 kernel's workgroup of 256 invocations (256 along x)"));
        let w = why(route(&product, &caps, forced(MatmulVariant::Naive)));
        assert!(w.contains("naive kernel, which has no SPIR-V twin"), "{w}");
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
            ..GemmDevice::default()
        };
        assert!(why(route(&mm(DType::F32, 64, 64, 64), &wide, other)).contains("16 to 64"));
        let small = Capabilities {
            max_storage_binding: 1024,
            ..lavapipe()
        };
        assert!(why(route(&mm(DType::F32, 64, 64, 64), &small, d)).contains("binding limit"));
    }

    /// A GPU's workgroup limits: Vulkan's minimum shared memory (16 KiB) is more than
    /// the tiled kernel's default tiles need.
    fn gpu_device() -> GemmDevice {
        GemmDevice {
            max_shared: 16 << 10,
            max_invocations: 1024,
            max_group_x: 1024,
            ..GemmDevice::default()
        }
    }

    fn gpu_plan(r: GemmRoute) -> GpuGemmPlan {
        match r {
            GemmRoute::SpirvGpu(p) => p,
            other => panic!("not routed to the GPU-class SPIR-V GEMM: {other:?}"),
        }
    }

    #[test]
    fn the_planners_tiled_gemm_runs_as_spirv_with_its_shape() {
        let gpu = Capabilities {
            device_type: "discrete".into(),
            subgroup_sizes: Some((32, 32)),
            ..lavapipe()
        };
        let product = mm(DType::F32, 256, 200, 96);
        let MatmulVariant::Tiled { bm, bn, bk } =
            plan_matmul(&product, &gpu, None).unwrap().variant
        else {
            panic!()
        };
        let p = gpu_plan(route(&product, &gpu, gpu_device()));
        assert_eq!(p.kernel, GpuKernel::Tiled { bm, bn, bk });
        assert_eq!((p.splits, p.k_chunk, p.vec_a, p.vec_b), (1, 96, true, true));
        assert_eq!(p.groups(&product), (4, 4, 1));
        assert_eq!(gpu_module(&p).0, "matmul_tiled_packed");
        // Constants 1, 2 and 12: the tile; 15 and 16 the 16-byte loads.
        let spec = p.spec();
        assert_eq!((spec[0], spec[1], spec[11]), (bm, bn, bk));
        assert_eq!((spec[14], spec[15]), (1, 1));
        // f16 operands keep f16 tiles: half the bytes (each tile's f32 array is one
        // element then).
        let half = gpu_plan(route(&mm(DType::F16, 256, 200, 96), &gpu, gpu_device()));
        assert_eq!(gpu_module(&half).0, "matmul_tiled");
        assert_eq!(half.shared_bytes(), 2 * 16 * 65 * 2 + 2 * 4);
        assert_eq!(p.shared_bytes(), 2 * 16 * 65 * 4 + 2 * 2);
        // A view of A off a 4-value boundary, an odd contiguous dimension of B: value
        // by value.
        let view = GemmDevice {
            a_offset: 4,
            ..gpu_device()
        };
        let q = gpu_plan(route(&mm(DType::F32, 256, 201, 96), &gpu, view));
        assert!(!q.vec_a && !q.vec_b);
        // Transposed, B's contiguous dimension is K.
        let t = gpu_plan(route(
            &mm(DType::F32, 256, 201, 96).transpose(false, true),
            &gpu,
            gpu_device(),
        ));
        assert!(t.vec_b && t.trans_b && !t.trans_a);
    }

    #[test]
    fn without_16bit_storage_the_twins_read_words_and_a_16bit_c_goes_through_partials() {
        let packed = Capabilities {
            device_type: "discrete".into(),
            subgroup_sizes: Some((32, 32)),
            f16_arithmetic: false,
            ..lavapipe()
        };
        // f16 throughout: the `_packed` module, C written by matmul_finish.
        let half = mm(DType::F16, 256, 200, 96);
        let p = gpu_plan(route(&half, &packed, gpu_device()));
        assert!(matches!(p.kernel, GpuKernel::Tiled { .. }));
        assert!(
            p.packed && p.partial_c && p.partial() && p.splits == 1,
            "{p:?}"
        );
        assert_eq!(gpu_module(&p).0, "matmul_tiled_packed");
        assert_eq!(p.spec()[9], 1, "PARTIAL");
        // The planner sends such a C through the partials too (its finish packs it).
        assert!(plan_matmul(&half, &packed, None).unwrap().partial);
        // bf16 operands into an f32 C: read as words, C stored directly.
        let mut grad = mm(DType::BF16, 40, 1, 64);
        grad.c.dtype = DType::F32;
        let q = gpu_plan(route(&grad, &packed, gpu_device()));
        assert_eq!(q.kernel, GpuKernel::Gemv { lanes: 64 });
        assert!(q.packed && !q.partial_c && !q.partial(), "{q:?}");
        assert_eq!(gpu_module(&q).0, "gemv_packed");
        // With 16-bit storage, a 16-bit C is stored by the kernel itself.
        let native = Capabilities {
            f16_arithmetic: true,
            ..packed.clone()
        };
        let r = gpu_plan(route(&half, &native, gpu_device()));
        assert!(!r.packed && !r.partial(), "{r:?}");
        assert_eq!(gpu_module(&r).0, "matmul_tiled");
        // Partials twice C's bytes: over the binding limit while C is within it.
        let small = Capabilities {
            max_storage_binding: (256 * 200 * 3) as u64,
            ..packed.clone()
        };
        assert!(why(route(&half, &small, gpu_device())).contains("bytes of f32 partials"));
        assert!(matches!(
            route(
                &half,
                &Capabilities {
                    f16_arithmetic: true,
                    ..small
                },
                gpu_device()
            ),
            GemmRoute::SpirvGpu(_)
        ));
        // The GEMV twin computes one column: a GEMV forced on more takes naga.
        let forced = GemmDevice {
            force: Some(MatmulVariant::Gemv { lanes: 64 }),
            ..gpu_device()
        };
        assert!(why(route(&mm(DType::F32, 8, 3, 64), &lavapipe(), forced)).contains("N = 1"));
    }

    #[test]
    fn gemv_runs_as_spirv_on_every_device_and_tiled_where_forced() {
        let caps = lavapipe();
        // N = 1: the planner's GEMV, on lavapipe too; bf16 storage specialized.
        let product = mm(DType::BF16, 40, 1, 64);
        let p = gpu_plan(route(&product, &caps, gpu_device()));
        assert_eq!(p.kernel, GpuKernel::Gemv { lanes: 64 });
        assert_eq!(
            (p.storage, p.groups(&product)),
            ([DType::BF16; 4], (1, 40, 1))
        );
        assert_eq!(gpu_module(&p).0, "gemv");
        assert_eq!(p.spec()[..9], [64, 0, 0, 0, 0, 2, 2, 2, 2]);
        // Long K over few rows: split, the partials for matmul_finish.
        let long = mm(DType::F32, 2, 1, 4000);
        let plan = plan_matmul(&long, &caps, None).unwrap();
        let q = gpu_plan(route(&long, &caps, gpu_device()));
        assert!(q.splits > 1 && q.partial());
        assert_eq!((q.splits, q.k_chunk), (plan.splits, plan.k_chunk));
        assert_eq!(q.groups(&long).2, plan.splits as u64);
        assert_eq!(q.spec()[9], 1);
        assert_eq!(gpu_module(&q).0, "gemv_packed");
        // One pipeline for every chunk length.
        let other = GpuGemmPlan {
            splits: 3,
            k_chunk: 128,
            rows_per_dispatch: 7,
            ..q
        };
        assert_eq!(other.pipeline_key(), q.pipeline_key());
        // The tiled kernel where a test forces it on a CPU driver (no subgroup needs).
        let tiled = MatmulVariant::Tiled {
            bm: 32,
            bn: 48,
            bk: 8,
        };
        let dev = GemmDevice {
            force: Some(tiled),
            ..gpu_device()
        };
        let r = gpu_plan(route(&mm(DType::F16, 37, 29, 53), &caps, dev));
        assert_eq!(
            r.kernel,
            GpuKernel::Tiled {
                bm: 32,
                bn: 48,
                bk: 8
            }
        );
        assert_eq!(r.groups(&mm(DType::F16, 37, 29, 53)), (1, 2, 1));
    }

    #[test]
    fn the_twins_dispatch_rows_in_the_planners_chunks() {
        let caps = lavapipe();
        // 70000 rows of a GEMV: more workgroups than a dispatch's 65535, in two.
        let tall = mm(DType::F32, 70000, 1, 64);
        let plan = plan_matmul(&tall, &caps, None).unwrap();
        let p = gpu_plan(route(&tall, &caps, gpu_device()));
        assert_eq!(p.rows_per_dispatch, plan.rows_per_dispatch);
        assert_eq!(
            p.dispatches(&tall),
            vec![(0, (1, 65535, 1)), (65535, (1, 4465, 1))]
        );
        // Each dispatch's parameters start at its row.
        assert_eq!(p.params(&tall, 65535)[14], 65535);
        // The tiled kernel's chunks are whole tiles of rows: a long product (4e9
        // flops per dispatch) over three dispatches, the last one short.
        let tiled = MatmulVariant::Tiled {
            bm: 64,
            bn: 64,
            bk: 16,
        };
        let dev = GemmDevice {
            force: Some(tiled),
            ..gpu_device()
        };
        let long = mm(DType::F16, 1000, 1024, 4096);
        let q = gpu_plan(route(&long, &caps, dev));
        assert_eq!(q.rows_per_dispatch, 448);
        assert_eq!(
            q.dispatches(&long),
            vec![(0, (16, 7, 1)), (448, (16, 7, 1)), (896, (16, 2, 1))]
        );
        // A short product: one dispatch over every row.
        let short = mm(DType::F16, 37, 29, 53);
        let r = gpu_plan(route(&short, &caps, dev));
        assert_eq!(r.dispatches(&short), vec![(0, r.groups(&short))]);
    }
}
