//! The cooperative-matrix GEMM (VK_KHR_cooperative_matrix): C = alpha * op(A) op(B)
//! (+ beta * C) with A and B in f16 and f32 accumulation through the device's matrix
//! units (`OpCooperativeMatrixMulAddKHR`), C stored as f32 or f16.
//!
//! glslang 12 (Debian's) refuses `GL_KHR_cooperative_matrix`, so these modules are not
//! GLSL: [`module`] emits each one as SPIR-V with the `rspirv` crate when a pipeline is
//! first built. Emitting at load time, not committing `.spv` files, because the tile
//! shape is whatever the device reports (`vkGetPhysicalDeviceCooperativeMatrixPropertiesKHR`),
//! unknown until then, and the shape, transposes and C's type are all baked in as
//! constants (the layout operand of a cooperative-matrix load must be a constant);
//! emitting one takes microseconds and can never be stale. tests/spirv.rs emits every
//! variant for several shapes and runs `spirv-val --target-env vulkan1.3` on each.
//!
//! Scope: one subgroup per workgroup computes one tile of C with no bounds checks, so
//! [`route`] takes a product only where M, N and K are multiples of the tile and every
//! operand's rows and batch strides are 16-byte aligned (what cooperative-matrix loads
//! and stores require); anything else runs on the other GEMMs, with the reason logged
//! under KILN_GEMM_LOG=1.

use ash::vk;
use kiln_engine::{Capabilities, DType, Matmul};
use rspirv::binary::Assemble;
use rspirv::dr::{Builder, Operand};
use rspirv::spirv::{self, Word};

/// One entry of the device's cooperative-matrix property list (the fields of
/// `VkCooperativeMatrixPropertiesKHR` that choose a shape).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CoopMatProps {
    pub m: u32,
    pub n: u32,
    pub k: u32,
    pub a: vk::ComponentTypeKHR,
    pub b: vk::ComponentTypeKHR,
    pub c: vk::ComponentTypeKHR,
    pub result: vk::ComponentTypeKHR,
    pub scope: vk::ScopeKHR,
}

impl From<&vk::CooperativeMatrixPropertiesKHR<'_>> for CoopMatProps {
    fn from(p: &vk::CooperativeMatrixPropertiesKHR<'_>) -> CoopMatProps {
        CoopMatProps {
            m: p.m_size,
            n: p.n_size,
            k: p.k_size,
            a: p.a_type,
            b: p.b_type,
            c: p.c_type,
            result: p.result_type,
            scope: p.scope,
        }
    }
}

/// A tile of the product: `m x k` of A times `k x n` of B into `m x n` of C.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct CoopMatShape {
    pub m: u32,
    pub n: u32,
    pub k: u32,
}

impl std::fmt::Display for CoopMatShape {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}x{}x{}", self.m, self.n, self.k)
    }
}

/// The largest dimension the module takes: sizes past it are no shape a driver
/// reports today, and would hold a whole tile in each lane's registers.
const MAX_DIM: u32 = 64;

/// The shape the cooperative-matrix GEMM runs with, from the device's property list:
/// f16 x f16 -> f32 (C and result f32) at subgroup scope, every side a multiple of 8
/// (an f16 row of the tile is then a whole number of 16-byte units, which keeps the
/// loads' alignment a property of the operands alone) and at most 64; among those the
/// most work per instruction (m·n·k), then the deepest K. None: the device has no
/// shape this module can run.
pub fn select(props: &[CoopMatProps]) -> Option<CoopMatShape> {
    use vk::ComponentTypeKHR as T;
    props
        .iter()
        .filter(|p| {
            p.a == T::FLOAT16
                && p.b == T::FLOAT16
                && p.c == T::FLOAT32
                && p.result == T::FLOAT32
                && p.scope == vk::ScopeKHR::SUBGROUP
                && [p.m, p.n, p.k]
                    .iter()
                    .all(|&d| d > 0 && d.is_multiple_of(8) && d <= MAX_DIM)
        })
        .map(|p| CoopMatShape {
            m: p.m,
            n: p.n,
            k: p.k,
        })
        .max_by_key(|s| (s.m * s.n * s.k, s.k, s.m))
}

/// A property list as a reason names it: `16x16x16 f16*f16->f32 subgroup, ...`.
pub fn describe(props: &[CoopMatProps]) -> String {
    let ty = |t: vk::ComponentTypeKHR| match t {
        vk::ComponentTypeKHR::FLOAT16 => "f16".to_string(),
        vk::ComponentTypeKHR::FLOAT32 => "f32".to_string(),
        vk::ComponentTypeKHR::FLOAT64 => "f64".to_string(),
        vk::ComponentTypeKHR::SINT8 => "i8".to_string(),
        vk::ComponentTypeKHR::UINT8 => "u8".to_string(),
        vk::ComponentTypeKHR::SINT32 => "i32".to_string(),
        vk::ComponentTypeKHR::UINT32 => "u32".to_string(),
        other => format!("{other:?}"),
    };
    let scope = |s: vk::ScopeKHR| match s {
        vk::ScopeKHR::SUBGROUP => "subgroup".to_string(),
        vk::ScopeKHR::WORKGROUP => "workgroup".to_string(),
        other => format!("{other:?}"),
    };
    props
        .iter()
        .map(|p| {
            format!(
                "{}x{}x{} {}*{}+{}->{} {}",
                p.m,
                p.n,
                p.k,
                ty(p.a),
                ty(p.b),
                ty(p.c),
                ty(p.result),
                scope(p.scope)
            )
        })
        .collect::<Vec<_>>()
        .join(", ")
}

/// What a device selected for the cooperative-matrix GEMM.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CoopMat {
    pub shape: CoopMatShape,
    /// The device's subgroup size: the workgroup is exactly one subgroup (a module
    /// below SPIR-V 1.6 runs with this size), as the cooperative-matrix operations need
    /// every invocation of the subgroup.
    pub lanes: u32,
}

/// How the cooperative-matrix GEMM runs one product: everything its module bakes in.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct CoopMatPlan {
    pub shape: CoopMatShape,
    pub lanes: u32,
    pub trans_a: bool,
    pub trans_b: bool,
    /// C's storage: f32 or f16.
    pub c: DType,
    /// beta is not 0: C is read and added (beta 0 never reads C, which may hold NaN).
    pub read_c: bool,
}

/// Bytes of the launch's push constants: lda, ldb, ldc, the three batch strides and K
/// (u32), alpha and beta (f32).
pub const PUSH_BYTES: u32 = 36;

impl CoopMatPlan {
    /// Workgroups of the dispatch: column tiles, row tiles, matrices.
    pub fn groups(&self, mm: &Matmul) -> (u64, u64, u64) {
        (
            (mm.n / self.shape.n as usize) as u64,
            (mm.m / self.shape.m as usize) as u64,
            mm.batch as u64,
        )
    }

    /// The push constants of `mm` (see [`PUSH_BYTES`]).
    pub fn push(&self, mm: &Matmul) -> Vec<u8> {
        let (lda, ldb, ldc) = leads(mm);
        [
            lda as u32,
            ldb as u32,
            ldc as u32,
            mm.stride_a as u32,
            mm.stride_b as u32,
            mm.stride_c as u32,
            mm.k as u32,
            mm.alpha.to_bits(),
            mm.beta.to_bits(),
        ]
        .iter()
        .flat_map(|v| v.to_le_bytes())
        .collect()
    }

    /// A name for logs and dumps: `coopmat_16x16x16_nt_f16` (`_c` when C is read).
    pub fn name(&self) -> String {
        let t = |x: bool| if x { 't' } else { 'n' };
        format!(
            "coopmat_{}_{}{}_{}{}",
            self.shape,
            t(self.trans_a),
            t(self.trans_b),
            self.c,
            if self.read_c { "_c" } else { "" }
        )
    }
}

/// Elements between consecutive rows of A, B and C as stored.
fn leads(mm: &Matmul) -> (usize, usize, usize) {
    (
        if mm.trans_a { mm.m } else { mm.k },
        if mm.trans_b { mm.k } else { mm.n },
        mm.n,
    )
}

/// Where a launch's operands start, in bytes past their binding's offset alignment
/// (a view can start anywhere).
#[derive(Clone, Copy, Debug, Default)]
pub struct Offsets {
    pub a: u64,
    pub b: u64,
    pub c: u64,
}

/// The cooperative-matrix plan of `mm` (validated) on a device that selected `coop`
/// (or did not, for the reason given), or why it does not run there.
pub fn route(
    mm: &Matmul,
    caps: &Capabilities,
    coop: Result<CoopMat, &str>,
    offsets: Offsets,
) -> Result<CoopMatPlan, String> {
    let coop = coop.map_err(|why| format!("no cooperative matrix: {why}"))?;
    let s = coop.shape;
    if mm.a.dtype != DType::F16 || mm.b.dtype != DType::F16 {
        return Err(format!(
            "A and B are {} x {}; the cooperative-matrix GEMM multiplies f16 by f16",
            mm.a.dtype, mm.b.dtype
        ));
    }
    if !matches!(mm.c.dtype, DType::F16 | DType::F32) {
        return Err(format!(
            "C is {}; the cooperative-matrix GEMM stores f32 or f16",
            mm.c.dtype
        ));
    }
    if mm.bias.is_some() || mm.gelu || mm.c_f32.is_some() {
        return Err(
            "a fused epilogue (bias, GELU or an f32 copy of C), which the cooperative-matrix \
             GEMM does not have"
                .into(),
        );
    }
    if mm.m == 0 || mm.n == 0 || mm.k == 0 {
        return Err("an empty product (M, N or K is 0)".into());
    }
    let whole = |side: usize, tile: u32| side.is_multiple_of(tile as usize);
    if !(whole(mm.m, s.m) && whole(mm.n, s.n) && whole(mm.k, s.k)) {
        return Err(format!(
            "{}x{}x{} is not a multiple of the {s} cooperative-matrix tile (M x N x K): \
             it has no bounds checks, so pad the product to multiples of {s} to use it",
            mm.m, mm.n, mm.k
        ));
    }
    // Cooperative-matrix loads and stores need their pointer and row stride aligned
    // to 16 bytes; with the sides above multiples of the tile (itself multiples of 8),
    // each tile's first element is aligned when these are.
    let (lda, ldb, ldc) = leads(mm);
    let c_size = mm.c.dtype.size() as u64;
    let checks = [
        ("A's rows", lda as u64 * 2),
        ("B's rows", ldb as u64 * 2),
        ("C's rows", ldc as u64 * c_size),
        ("A's batch stride", mm.stride_a as u64 * 2),
        ("B's batch stride", mm.stride_b as u64 * 2),
        ("C's batch stride", mm.stride_c as u64 * c_size),
        ("A's first element", offsets.a),
        ("B's first element", offsets.b),
        ("C's first element", offsets.c),
    ];
    if let Some((what, bytes)) = checks.iter().find(|(_, b)| !b.is_multiple_of(16)) {
        return Err(format!(
            "{what} is at {bytes} bytes, not a multiple of the 16 bytes cooperative-matrix \
             loads and stores need"
        ));
    }
    let limit = caps.max_storage_binding;
    if let Some(big) = mm.buffers().iter().find(|b| b.bytes() > limit) {
        return Err(format!(
            "a {}-byte operand over the {limit}-byte binding limit",
            big.bytes()
        ));
    }
    if [
        mm.m,
        mm.n,
        mm.k,
        lda,
        ldb,
        ldc,
        mm.stride_a,
        mm.stride_b,
        mm.stride_c,
    ]
    .iter()
    .any(|&v| v > u32::MAX as usize)
    {
        return Err("a side or stride over 2^32 elements".into());
    }
    let plan = CoopMatPlan {
        shape: s,
        lanes: coop.lanes,
        trans_a: mm.trans_a,
        trans_b: mm.trans_b,
        c: mm.c.dtype,
        read_c: mm.beta != 0.0,
    };
    let (x, y, z) = plan.groups(mm);
    if x.max(y).max(z) > 65535 {
        return Err(format!(
            "{x} x {y} x {z} workgroups, over the 65535 per dimension of one dispatch"
        ));
    }
    Ok(plan)
}

/// The SPIR-V module of `p` (SPIR-V 1.3, entry point `main`): bindings 0-2 A, B, C
/// (storage buffers of f16, f16, C's type), the [`PUSH_BYTES`] push constants, one
/// subgroup of `p.lanes` per workgroup, workgroup (x, y, z) computing the tile at
/// column tile x, row tile y of matrix z.
pub fn module(p: &CoopMatPlan) -> Vec<u32> {
    Emitter::new().emit(p)
}

/// Cooperative matrix uses (`CooperativeMatrixUse`) and layouts
/// (`CooperativeMatrixLayout`), as the module's constants carry them.
const USE_A: u32 = 0;
const USE_B: u32 = 1;
const USE_ACC: u32 = 2;
const ROW_MAJOR: u32 = 0;
const COLUMN_MAJOR: u32 = 1;

struct Emitter {
    b: Builder,
    u32_t: Word,
    consts: Vec<(u32, Word)>,
}

impl Emitter {
    fn new() -> Emitter {
        let mut b = Builder::new();
        let u32_t = b.type_int(32, 0);
        Emitter {
            b,
            u32_t,
            consts: vec![],
        }
    }

    fn uint(&mut self, v: u32) -> Word {
        if let Some(&(_, id)) = self.consts.iter().find(|(x, _)| *x == v) {
            return id;
        }
        let id = self.b.constant_bit32(self.u32_t, v);
        self.consts.push((v, id));
        id
    }

    /// A storage buffer of `elem` values (a Block struct of one runtime array) at
    /// `binding`, and the pointer type of one element.
    fn buffer(&mut self, elem: Word, stride: u32, binding: u32, read_only: bool) -> (Word, Word) {
        let arr = self.b.type_runtime_array(elem);
        let st = self.b.type_struct([arr]);
        let decorated =
            self.b.module_ref().annotations.iter().any(|i| {
                i.class.opcode == spirv::Op::Decorate && i.operands[0] == Operand::IdRef(st)
            });
        if !decorated {
            self.b.decorate(
                arr,
                spirv::Decoration::ArrayStride,
                [Operand::LiteralBit32(stride)],
            );
            self.b.decorate(st, spirv::Decoration::Block, []);
            self.b
                .member_decorate(st, 0, spirv::Decoration::Offset, [Operand::LiteralBit32(0)]);
        }
        let ptr = self
            .b
            .type_pointer(None, spirv::StorageClass::StorageBuffer, st);
        let var = self
            .b
            .variable(ptr, None, spirv::StorageClass::StorageBuffer, None);
        self.b.decorate(
            var,
            spirv::Decoration::DescriptorSet,
            [Operand::LiteralBit32(0)],
        );
        self.b.decorate(
            var,
            spirv::Decoration::Binding,
            [Operand::LiteralBit32(binding)],
        );
        if read_only {
            self.b.decorate(var, spirv::Decoration::NonWritable, []);
        }
        let elem_ptr = self
            .b
            .type_pointer(None, spirv::StorageClass::StorageBuffer, elem);
        (var, elem_ptr)
    }

    fn emit(mut self, p: &CoopMatPlan) -> Vec<u32> {
        self.b.set_version(1, 3);
        for cap in [
            spirv::Capability::Shader,
            spirv::Capability::Float16,
            spirv::Capability::StorageBuffer16BitAccess,
            spirv::Capability::CooperativeMatrixKHR,
            // Required beside CooperativeMatrixKHR in shaders (the device's
            // `vulkanMemoryModel` feature, enabled with the extension).
            spirv::Capability::VulkanMemoryModel,
        ] {
            self.b.capability(cap);
        }
        self.b.extension("SPV_KHR_cooperative_matrix");
        self.b.extension("SPV_KHR_vulkan_memory_model");
        self.b
            .memory_model(spirv::AddressingModel::Logical, spirv::MemoryModel::Vulkan);

        let void = self.b.type_void();
        let fn_t = self.b.type_function(void, []);
        let bool_t = self.b.type_bool();
        let u32_t = self.u32_t;
        let f16_t = self.b.type_float(16, None);
        let f32_t = self.b.type_float(32, None);
        let c_elem = if p.c == DType::F16 { f16_t } else { f32_t };
        let c_stride = if p.c == DType::F16 { 2 } else { 4 };

        let s = p.shape;
        let scope = self.uint(spirv::Scope::Subgroup as u32);
        let (tm, tn, tk) = (self.uint(s.m), self.uint(s.n), self.uint(s.k));
        let (use_a, use_b, use_acc) = (self.uint(USE_A), self.uint(USE_B), self.uint(USE_ACC));
        let a_t = self
            .b
            .type_cooperative_matrix_khr(f16_t, scope, tm, tk, use_a);
        let b_t = self
            .b
            .type_cooperative_matrix_khr(f16_t, scope, tk, tn, use_b);
        let acc_t = self
            .b
            .type_cooperative_matrix_khr(f32_t, scope, tm, tn, use_acc);
        let c_t = if p.c == DType::F16 {
            self.b
                .type_cooperative_matrix_khr(f16_t, scope, tm, tn, use_acc)
        } else {
            acc_t
        };

        let (a_var, a_ptr) = self.buffer(f16_t, 2, 0, true);
        let (b_var, b_ptr) = self.buffer(f16_t, 2, 1, true);
        let (c_var, c_ptr) = self.buffer(c_elem, c_stride, 2, false);

        // Push constants: lda, ldb, ldc, stride_a, stride_b, stride_c, k (u32), alpha,
        // beta (f32).
        let members = [
            u32_t, u32_t, u32_t, u32_t, u32_t, u32_t, u32_t, f32_t, f32_t,
        ];
        let pc_t = self.b.type_struct(members);
        self.b.decorate(pc_t, spirv::Decoration::Block, []);
        for i in 0..members.len() as u32 {
            self.b.member_decorate(
                pc_t,
                i,
                spirv::Decoration::Offset,
                [Operand::LiteralBit32(4 * i)],
            );
        }
        let pc_ptr = self
            .b
            .type_pointer(None, spirv::StorageClass::PushConstant, pc_t);
        let pc = self
            .b
            .variable(pc_ptr, None, spirv::StorageClass::PushConstant, None);
        let pc_u32 = self
            .b
            .type_pointer(None, spirv::StorageClass::PushConstant, u32_t);
        let pc_f32 = self
            .b
            .type_pointer(None, spirv::StorageClass::PushConstant, f32_t);

        let uvec3 = self.b.type_vector(u32_t, 3);
        let in_ptr = self.b.type_pointer(None, spirv::StorageClass::Input, uvec3);
        let wg_var = self
            .b
            .variable(in_ptr, None, spirv::StorageClass::Input, None);
        self.b.decorate(
            wg_var,
            spirv::Decoration::BuiltIn,
            [Operand::BuiltIn(spirv::BuiltIn::WorkgroupId)],
        );

        let zero_f = self.b.constant_bit32(f32_t, 0f32.to_bits());
        let acc_zero = self.b.constant_composite(acc_t, [zero_f]);
        let fn_u32 = self
            .b
            .type_pointer(None, spirv::StorageClass::Function, u32_t);
        let fn_acc = self
            .b
            .type_pointer(None, spirv::StorageClass::Function, acc_t);
        let zero = self.uint(0);
        let layout_a = self.uint(if p.trans_a { COLUMN_MAJOR } else { ROW_MAJOR });
        let layout_b = self.uint(if p.trans_b { COLUMN_MAJOR } else { ROW_MAJOR });
        let row_major = self.uint(ROW_MAJOR);
        let idx: Vec<Word> = (0..9).map(|i| self.uint(i)).collect();

        let b = &mut self.b;
        let main = b
            .begin_function(void, None, spirv::FunctionControl::NONE, fn_t)
            .unwrap();
        b.begin_block(None).unwrap();
        // Function variables belong in the first block.
        let acc_v = b.variable(fn_acc, None, spirv::StorageClass::Function, Some(acc_zero));
        let kk_v = b.variable(fn_u32, None, spirv::StorageClass::Function, Some(zero));
        let ao_v = b.variable(fn_u32, None, spirv::StorageClass::Function, None);
        let bo_v = b.variable(fn_u32, None, spirv::StorageClass::Function, None);
        let push = |b: &mut Builder, i: usize, f: bool| {
            let ptr = b
                .access_chain(if f { pc_f32 } else { pc_u32 }, None, pc, [idx[i]])
                .unwrap();
            b.load(if f { f32_t } else { u32_t }, None, ptr, None, [])
                .unwrap()
        };
        let lda = push(b, 0, false);
        let ldb = push(b, 1, false);
        let ldc = push(b, 2, false);
        let sa = push(b, 3, false);
        let sb = push(b, 4, false);
        let sc = push(b, 5, false);
        let k = push(b, 6, false);
        let alpha = push(b, 7, true);
        let beta = push(b, 8, true);
        let wg = b.load(uvec3, None, wg_var, None, []).unwrap();
        let tx = b.composite_extract(u32_t, None, wg, [0]).unwrap();
        let ty = b.composite_extract(u32_t, None, wg, [1]).unwrap();
        let z = b.composite_extract(u32_t, None, wg, [2]).unwrap();
        let row0 = b.i_mul(u32_t, None, ty, tm).unwrap();
        let col0 = b.i_mul(u32_t, None, tx, tn).unwrap();
        // Element offsets of the first tiles and how far one K step moves them: op(A)'s
        // tile at (row0, kk) is row-major at row0*lda + kk, or, A stored transposed,
        // column-major at kk*lda + row0 (and B alike).
        let za = b.i_mul(u32_t, None, z, sa).unwrap();
        let a_first = if p.trans_a {
            row0
        } else {
            b.i_mul(u32_t, None, row0, lda).unwrap()
        };
        let a0 = b.i_add(u32_t, None, za, a_first).unwrap();
        let a_step = if p.trans_a {
            b.i_mul(u32_t, None, tk, lda).unwrap()
        } else {
            tk
        };
        let zb = b.i_mul(u32_t, None, z, sb).unwrap();
        let b_first = if p.trans_b {
            b.i_mul(u32_t, None, col0, ldb).unwrap()
        } else {
            col0
        };
        let b0 = b.i_add(u32_t, None, zb, b_first).unwrap();
        let b_step = if p.trans_b {
            tk
        } else {
            b.i_mul(u32_t, None, tk, ldb).unwrap()
        };
        b.store(ao_v, a0, None, []).unwrap();
        b.store(bo_v, b0, None, []).unwrap();

        let header = b.id();
        let body = b.id();
        let cont = b.id();
        let merge = b.id();
        b.branch(header).unwrap();

        b.begin_block(Some(header)).unwrap();
        let kk = b.load(u32_t, None, kk_v, None, []).unwrap();
        let more = b.u_less_than(bool_t, None, kk, k).unwrap();
        b.loop_merge(merge, cont, spirv::LoopControl::NONE, [])
            .unwrap();
        b.branch_conditional(more, body, merge, []).unwrap();

        b.begin_block(Some(body)).unwrap();
        let ao = b.load(u32_t, None, ao_v, None, []).unwrap();
        let bo = b.load(u32_t, None, bo_v, None, []).unwrap();
        let pa = b.access_chain(a_ptr, None, a_var, [zero, ao]).unwrap();
        let ma = b
            .cooperative_matrix_load_khr(a_t, None, pa, layout_a, Some(lda), None, [])
            .unwrap();
        let pb = b.access_chain(b_ptr, None, b_var, [zero, bo]).unwrap();
        let mb = b
            .cooperative_matrix_load_khr(b_t, None, pb, layout_b, Some(ldb), None, [])
            .unwrap();
        let acc = b.load(acc_t, None, acc_v, None, []).unwrap();
        let acc = b
            .cooperative_matrix_mul_add_khr(acc_t, None, ma, mb, acc, None)
            .unwrap();
        b.store(acc_v, acc, None, []).unwrap();
        b.branch(cont).unwrap();

        b.begin_block(Some(cont)).unwrap();
        let kk = b.load(u32_t, None, kk_v, None, []).unwrap();
        let kk = b.i_add(u32_t, None, kk, tk).unwrap();
        b.store(kk_v, kk, None, []).unwrap();
        let ao = b.load(u32_t, None, ao_v, None, []).unwrap();
        let ao = b.i_add(u32_t, None, ao, a_step).unwrap();
        b.store(ao_v, ao, None, []).unwrap();
        let bo = b.load(u32_t, None, bo_v, None, []).unwrap();
        let bo = b.i_add(u32_t, None, bo, b_step).unwrap();
        b.store(bo_v, bo, None, []).unwrap();
        b.branch(header).unwrap();

        b.begin_block(Some(merge)).unwrap();
        let acc = b.load(acc_t, None, acc_v, None, []).unwrap();
        let mut out = b.matrix_times_scalar(acc_t, None, acc, alpha).unwrap();
        let zc = b.i_mul(u32_t, None, z, sc).unwrap();
        let rc = b.i_mul(u32_t, None, row0, ldc).unwrap();
        let c_off = b.i_add(u32_t, None, zc, rc).unwrap();
        let c_off = b.i_add(u32_t, None, c_off, col0).unwrap();
        let pc_el = b.access_chain(c_ptr, None, c_var, [zero, c_off]).unwrap();
        if p.read_c {
            let old = b
                .cooperative_matrix_load_khr(c_t, None, pc_el, row_major, Some(ldc), None, [])
                .unwrap();
            let old = if c_t == acc_t {
                old
            } else {
                b.f_convert(acc_t, None, old).unwrap()
            };
            let scaled = b.matrix_times_scalar(acc_t, None, old, beta).unwrap();
            out = b.f_add(acc_t, None, out, scaled).unwrap();
        }
        let out = if c_t == acc_t {
            out
        } else {
            b.f_convert(c_t, None, out).unwrap()
        };
        b.cooperative_matrix_store_khr(pc_el, out, row_major, Some(ldc), None, [])
            .unwrap();
        b.ret().unwrap();
        b.end_function().unwrap();

        b.entry_point(spirv::ExecutionModel::GLCompute, main, "main", [wg_var]);
        b.execution_mode(main, spirv::ExecutionMode::LocalSize, [p.lanes, 1, 1]);
        self.b.module().assemble()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use vk::ComponentTypeKHR as T;

    fn prop(m: u32, n: u32, k: u32, ab: T, cr: T, scope: vk::ScopeKHR) -> CoopMatProps {
        CoopMatProps {
            m,
            n,
            k,
            a: ab,
            b: ab,
            c: cr,
            result: cr,
            scope,
        }
    }

    const SG: vk::ScopeKHR = vk::ScopeKHR::SUBGROUP;

    #[test]
    fn select_takes_an_f16_to_f32_subgroup_shape_only() {
        // No cooperative matrix at all.
        assert_eq!(select(&[]), None);
        // Only f32 and integer shapes.
        assert_eq!(
            select(&[
                prop(16, 16, 8, T::FLOAT32, T::FLOAT32, SG),
                prop(16, 16, 32, T::SINT8, T::SINT32, SG),
            ]),
            None
        );
        // f16 accumulating into f16 is not the f32 accumulation the module does.
        assert_eq!(
            select(&[prop(16, 16, 16, T::FLOAT16, T::FLOAT16, SG)]),
            None
        );
        // The usual one.
        assert_eq!(
            select(&[prop(16, 16, 16, T::FLOAT16, T::FLOAT32, SG)]),
            Some(CoopMatShape {
                m: 16,
                n: 16,
                k: 16
            })
        );
        // Workgroup scope only: the module is written for subgroup scope.
        assert_eq!(
            select(&[prop(
                16,
                16,
                16,
                T::FLOAT16,
                T::FLOAT32,
                vk::ScopeKHR::WORKGROUP
            )]),
            None
        );
        // Sides the module cannot take (not multiples of 8, or past 64).
        assert_eq!(
            select(&[
                prop(4, 16, 16, T::FLOAT16, T::FLOAT32, SG),
                prop(128, 16, 16, T::FLOAT16, T::FLOAT32, SG),
            ]),
            None
        );
    }

    #[test]
    fn select_picks_the_most_work_per_instruction_among_several() {
        // A list like an NVIDIA driver's: f16->f16, f16->f32 in three shapes, int8.
        let list = [
            prop(16, 8, 8, T::FLOAT16, T::FLOAT32, SG),
            prop(16, 16, 16, T::FLOAT16, T::FLOAT16, SG),
            prop(16, 8, 16, T::FLOAT16, T::FLOAT32, SG),
            prop(16, 16, 16, T::FLOAT16, T::FLOAT32, SG),
            prop(16, 16, 32, T::SINT8, T::SINT32, SG),
            prop(32, 32, 32, T::FLOAT16, T::FLOAT32, vk::ScopeKHR::WORKGROUP),
        ];
        assert_eq!(
            select(&list),
            Some(CoopMatShape {
                m: 16,
                n: 16,
                k: 16
            })
        );
        // Equal work: the deeper K (fewer loop steps over K).
        let even = [
            prop(16, 16, 8, T::FLOAT16, T::FLOAT32, SG),
            prop(16, 8, 16, T::FLOAT16, T::FLOAT32, SG),
        ];
        assert_eq!(select(&even).unwrap().k, 16);
        // Whatever the order the driver lists them in.
        let mut rev = list;
        rev.reverse();
        assert_eq!(select(&rev), select(&list));
        assert!(describe(&list[..2]).contains("16x8x8 f16*f16+f32->f32 subgroup"));
    }

    fn caps() -> Capabilities {
        Capabilities {
            name: "gpu".into(),
            backend: "vk".into(),
            device_type: "discrete".into(),
            vendor: 0x10de,
            driver: String::new(),
            f16_arithmetic: true,
            subgroup_sizes: Some((32, 32)),
            timestamp_queries: true,
            max_storage_binding: 1 << 31,
            max_buffer: 1 << 34,
            memory_budget: None,
            memory_heap: None,
            memory_limit: None,
        }
    }

    const COOP: CoopMat = CoopMat {
        shape: CoopMatShape {
            m: 16,
            n: 16,
            k: 16,
        },
        lanes: 32,
    };

    fn mm(a: DType, c: DType, m: usize, n: usize, k: usize) -> Matmul {
        let buf = |id, dtype, len| kiln_engine::Buffer { id, dtype, len };
        Matmul::new(
            buf(1, a, m * k),
            buf(2, a, k * n),
            buf(3, c, m * n),
            m,
            n,
            k,
        )
    }

    #[test]
    fn the_route_takes_aligned_f16_products_and_names_why_not_the_rest() {
        let at = Offsets::default();
        let ok = route(
            &mm(DType::F16, DType::F32, 64, 32, 48),
            &caps(),
            Ok(COOP),
            at,
        )
        .unwrap();
        assert_eq!((ok.c, ok.read_c, ok.lanes), (DType::F32, false, 32));
        assert_eq!(
            ok.groups(&mm(DType::F16, DType::F32, 64, 32, 48)),
            (2, 4, 1)
        );
        let mut t = mm(DType::F16, DType::F16, 32, 32, 32);
        (t.trans_a, t.trans_b, t.beta) = (true, true, 1.0);
        let p = route(&t, &caps(), Ok(COOP), at).unwrap();
        assert!(p.trans_a && p.trans_b && p.read_c && p.c == DType::F16);
        assert_eq!(p.name(), "coopmat_16x16x16_tt_f16_c");

        let why = |m: &Matmul, off: Offsets| route(m, &caps(), Ok(COOP), off).unwrap_err();
        let w = route(
            &mm(DType::F16, DType::F32, 64, 64, 64),
            &caps(),
            Err("llvmpipe lacks VK_KHR_cooperative_matrix"),
            at,
        )
        .unwrap_err();
        assert!(
            w.starts_with("no cooperative matrix: llvmpipe lacks"),
            "{w}"
        );
        assert!(why(&mm(DType::F32, DType::F32, 64, 64, 64), at).contains("f16 by f16"));
        assert!(why(&mm(DType::F16, DType::BF16, 64, 64, 64), at).contains("C is bf16"));
        let w = why(&mm(DType::F16, DType::F16, 64, 60, 64), at);
        assert!(w.contains("64x60x64 is not a multiple of the 16x16x16") && w.contains("pad"));
        let mut g = mm(DType::F16, DType::F16, 64, 64, 64);
        g.gelu = true;
        assert!(why(&g, at).contains("epilogue"));
        let mut s = mm(DType::F16, DType::F16, 16, 16, 16);
        (s.batch, s.stride_a) = (2, 260);
        assert!(why(&s, at).contains("A's batch stride is at 520 bytes"));
        let off = Offsets { a: 0, b: 8, c: 0 };
        assert!(why(&mm(DType::F16, DType::F16, 16, 16, 16), off).contains("B's first element"));
        assert!(why(&mm(DType::F16, DType::F16, 16, 16, 0), at).contains("empty"));
        let huge = mm(DType::F16, DType::F16, 16 * 70000, 16, 16);
        assert!(why(&huge, at).contains("65535"));
    }

    #[test]
    fn modules_are_valid_spirv_words_with_their_shape_baked_in() {
        let p = CoopMatPlan {
            shape: CoopMatShape { m: 16, n: 8, k: 16 },
            lanes: 32,
            trans_a: false,
            trans_b: true,
            c: DType::F16,
            read_c: true,
        };
        let words = module(&p);
        assert_eq!(words[0], 0x0723_0203);
        let m = rspirv::dr::load_words(&words).unwrap();
        let coop: Vec<_> = m
            .types_global_values
            .iter()
            .filter(|i| i.class.opcode == spirv::Op::TypeCooperativeMatrixKHR)
            .collect();
        // A (16x16), B (16x8), the f32 accumulator and C's f16 one.
        assert_eq!(coop.len(), 4);
        let local = m
            .execution_modes
            .iter()
            .find(|i| i.operands[1] == Operand::ExecutionMode(spirv::ExecutionMode::LocalSize))
            .unwrap();
        assert_eq!(local.operands[2], Operand::LiteralBit32(32));
    }
}
