// Launch parameters of the GEMM kernels (96 bytes). Shapes follow engine/src/matmul.rs:
// op(A) is m x k, op(B) is k x n, C is m x n, all row-major, `batch` matrices apart by
// their strides. A dispatch covers output rows [row_base, row_base + rows) and, when K
// is split, K chunks of `k_chunk` (workgroup_id.z = batch index * splits + split).
// The product may be a block of larger matrices (the host splits operands that exceed
// one binding): rows of A, B and C as stored are lda, ldb, ldc elements apart, and each
// operand's first element sits `base_*` elements into its binding (which starts at an
// aligned offset at or before it).
struct Params {
    m: u32,
    n: u32,
    k: u32,
    batch: u32,
    stride_a: u32,
    stride_b: u32,
    stride_c: u32,
    row_base: u32,
    alpha: f32,
    beta: f32,
    splits: u32,
    k_chunk: u32,
    // batch * m * n: the size of one split's slab of partials.
    total: u32,
    // matmul_finish.wgsl: C words to walk.
    words: u32,
    rows: u32,
    lda: u32,
    ldb: u32,
    ldc: u32,
    base_a: u32,
    base_b: u32,
    base_c: u32,
    base_cf: u32,
    base_bias: u32,
    pad: u32,
}
@group(0) @binding(0) var<uniform> P: Params;
