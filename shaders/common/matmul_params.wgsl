// Launch parameters of the GEMM kernels (64 bytes). Shapes follow engine/src/matmul.rs:
// op(A) is m x k, op(B) is k x n, C is m x n, all row-major, `batch` matrices apart by
// their strides. A dispatch covers output rows [row_base, row_base + rows) and, when K
// is split, K chunks of `k_chunk` (workgroup_id.z = batch index * splits + split).
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
    pad: u32,
}
@group(0) @binding(0) var<uniform> P: Params;
