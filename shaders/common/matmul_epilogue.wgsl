// Shared by every GEMM kernel: operand indexing and the fused epilogue.
// Bindings (typed slots): a, b (read), c (read_write), bias (read), cf (read_write f32:
// the caller's f32 copy of C, or the split-K partials when PARTIAL).

override TRANS_A: bool = false;
override TRANS_B: bool = false;
// beta != 0: C is read; with beta == 0 it is not, so it may hold NaN.
override USE_BETA: bool = false;
override BIAS: bool = false;
override GELU: bool = false;
override COPY_F32: bool = false;
// Write raw f32 accumulators to cf[split * total + (g * m + i) * n + j]; matmul_finish.wgsl
// sums the splits and applies the epilogue.
override PARTIAL: bool = false;
// With PARTIAL: add to the partials instead of overwriting them. K bands of a product
// too large for one binding accumulate there, so that the epilogue (bias, GELU, the
// rounding to C's dtype) is applied once, to the complete f32 sum.
override ACCUMULATE: bool = false;

// Element index of op(A)[i][kk] in matrix g.
fn a_index(g: u32, i: u32, kk: u32) -> u32 {
    if (TRANS_A) {
        return P.base_a + g * P.stride_a + kk * P.lda + i;
    }
    return P.base_a + g * P.stride_a + i * P.lda + kk;
}

// Element index of op(B)[kk][j] in matrix g.
fn b_index(g: u32, kk: u32, j: u32) -> u32 {
    if (TRANS_B) {
        return P.base_b + g * P.stride_b + j * P.ldb + kk;
    }
    return P.base_b + g * P.stride_b + kk * P.ldb + j;
}

// gelu() comes from common/gelu.wgsl.

// Element index of C[i][j] in matrix g, within C's binding (add base_cf - base_c for
// the f32 copy's).
fn c_index(g: u32, i: u32, j: u32) -> u32 {
    return P.base_c + g * P.stride_c + i * P.ldc + j;
}

// alpha * acc + beta * C + bias, then GELU: the f32 value of output element `ci` (column j).
fn finish(acc: f32, ci: u32, j: u32) -> f32 {
    var v = P.alpha * acc;
    if (USE_BETA) {
        v += P.beta * c_at(ci);
    }
    if (BIAS) {
        v += bias_at(P.base_bias + j);
    }
    if (GELU) {
        v = gelu(v);
    }
    return v;
}

// Stores output element (g, i, j). Single-element stores are race-free only for f32 and
// native f16 C; the host uses PARTIAL for 16-bit packed C unless a kernel stores whole
// aligned groups with emit4.
fn emit(acc: f32, g: u32, i: u32, j: u32, split: u32) {
    if (PARTIAL) {
        let pi = split * P.total + (g * P.m + i) * P.n + j;
        if (ACCUMULATE) {
            cf_put(pi, cf_at(pi) + acc);
        } else {
            cf_put(pi, acc);
        }
        return;
    }
    let ci = c_index(g, i, j);
    let v = finish(acc, ci, j);
    c_put(ci, v);
    if (COPY_F32) {
        cf_put(ci - P.base_c + P.base_cf, v);
    }
}

// Stores output elements (g, i, j..j+3); the caller guarantees j + 3 < n and that the
// flat index is a multiple of 4 (so a 16-bit pair never straddles two writers).
fn emit4(acc: vec4<f32>, g: u32, i: u32, j: u32, split: u32) {
    if (PARTIAL) {
        let pi = split * P.total + (g * P.m + i) * P.n + j;
        if (ACCUMULATE) {
            cf_put4(pi, cf_at4(pi) + acc);
        } else {
            cf_put4(pi, acc);
        }
        return;
    }
    let ci = c_index(g, i, j);
    let v = vec4<f32>(
        finish(acc.x, ci, j),
        finish(acc.y, ci + 1u, j + 1u),
        finish(acc.z, ci + 2u, j + 2u),
        finish(acc.w, ci + 3u, j + 3u),
    );
    c_put4(ci, v);
    if (COPY_F32) {
        cf_put4(ci - P.base_c + P.base_cf, v);
    }
}
