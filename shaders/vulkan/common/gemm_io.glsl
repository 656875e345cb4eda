// Operands, parameters and the fused epilogue of the hand-written GPU-class GEMMs
// (matmul_tiled.comp, gemv.comp): the twin of shaders/common/matmul_epilogue.wgsl, in
// the same order (alpha * acc, + beta * C, + bias, GELU, the f32 copy, C rounded last),
// and of its split-K partials layout, which the WGSL matmul_finish sums.
//
// Bindings (kiln-vulkan's GEMM layout): 0 A, 1 B, 2 C, 3 the parameters (uniform),
// 4 the bias, 5 the f32 copy of C or the split-K partials.
//
// Storage of A, B, C and the bias is a specialization constant each (0 f32, 1 f16,
// 2 bf16): every binding is declared once per type and the driver drops the unused
// ones when it specializes. PACKED builds are for devices without 16-bit storage:
// they read an f16 or bf16 operand two to a 32-bit word, the lower half first (the
// bytes are the same, only the view differs: the WGSL kernels' packed representation),
// and store f32 only; the host sends a 16-bit C there through the split-K partials,
// whose matmul_finish stores whole words.

layout(constant_id = 3) const bool BIAS = false;
layout(constant_id = 4) const bool GELU = false;
layout(constant_id = 5) const bool COPY_F32 = false;
layout(constant_id = 6) const uint A_DT = 0u;
layout(constant_id = 7) const uint B_DT = 0u;
layout(constant_id = 8) const uint C_DT = 0u;
layout(constant_id = 9) const uint BIAS_DT = 0u;
// Write raw f32 sums to cf[split * total + (g * m + i) * n + j] for matmul_finish.
layout(constant_id = 10) const bool PARTIAL = false;
// beta != 0: C is read (with beta == 0 it may hold NaN).
layout(constant_id = 11) const bool USE_BETA = false;
layout(constant_id = 13) const bool TRANS_A = false;
layout(constant_id = 14) const bool TRANS_B = false;

layout(set = 0, binding = 0) readonly buffer BufA { float a[]; };
layout(set = 0, binding = 1) readonly buffer BufB { float b[]; };
layout(set = 0, binding = 2) buffer BufC { float c[]; };
layout(set = 0, binding = 4) readonly buffer BufBias { float bias[]; };
layout(set = 0, binding = 5) writeonly buffer BufCf { float cf[]; };

// Row strides as stored (lda, ldb, ldc), batch strides (0: one matrix for all), the
// epilogue's scalars, the K split, batch * m * n (one split's slab of partials) and the
// first output row of this dispatch (the host cuts long products into row chunks, as
// the WGSL kernels' host does, so that no dispatch runs long enough for a watchdog).
layout(set = 0, binding = 3) uniform Params {
    uint m, n, k;
    uint lda, ldb, ldc;
    uint stride_a, stride_b, stride_c;
    float alpha, beta;
    uint splits, k_chunk, total;
    uint row_base;
} P;

#ifdef PACKED
layout(set = 0, binding = 0) readonly buffer BufAw { uint a_w[]; };
layout(set = 0, binding = 1) readonly buffer BufBw { uint b_w[]; };
layout(set = 0, binding = 2) readonly buffer BufCw { uint c_w[]; };
layout(set = 0, binding = 4) readonly buffer BufBiasW { uint bias_w[]; };

// Element `i` of an operand stored as `dt` (1 f16, 2 bf16) from its word `w`.
float from_word(uint w, uint i, uint dt) {
    uint bits = (i & 1u) == 0u ? (w & 0xffffu) : (w >> 16);
    return dt == 1u ? unpackHalf2x16(bits).x : uintBitsToFloat(bits << 16);
}
float ld_a(uint i) {
    return A_DT == 0u ? a[i] : from_word(a_w[i >> 1], i, A_DT);
}
float ld_b(uint i) {
    return B_DT == 0u ? b[i] : from_word(b_w[i >> 1], i, B_DT);
}
float ld_c(uint i) {
    return C_DT == 0u ? c[i] : from_word(c_w[i >> 1], i, C_DT);
}
float ld_bias(uint i) {
    return BIAS_DT == 0u ? bias[i] : from_word(bias_w[i >> 1], i, BIAS_DT);
}
// A 16-bit C never gets here: its products go through the partials (PARTIAL).
void st_c(uint i, float v) {
    if (C_DT == 0u) {
        c[i] = v;
    }
}
#else
layout(set = 0, binding = 0) readonly buffer BufAh { float16_t a_h[]; };
layout(set = 0, binding = 0) readonly buffer BufAb { uint16_t a_b[]; };
layout(set = 0, binding = 1) readonly buffer BufBh { float16_t b_h[]; };
layout(set = 0, binding = 1) readonly buffer BufBb { uint16_t b_b[]; };
layout(set = 0, binding = 2) buffer BufCh { float16_t c_h[]; };
layout(set = 0, binding = 2) buffer BufCb { uint16_t c_b[]; };
layout(set = 0, binding = 4) readonly buffer BufBiasH { float16_t bias_h[]; };
layout(set = 0, binding = 4) readonly buffer BufBiasB { uint16_t bias_b[]; };

#include "bf16.glsl"

float from_bf16(uint v) {
    return uintBitsToFloat(v << 16);
}
float ld_a(uint i) {
    return A_DT == 1u ? float(a_h[i]) : (A_DT == 2u ? from_bf16(uint(a_b[i])) : a[i]);
}
float ld_b(uint i) {
    return B_DT == 1u ? float(b_h[i]) : (B_DT == 2u ? from_bf16(uint(b_b[i])) : b[i]);
}
float ld_c(uint i) {
    return C_DT == 1u ? float(c_h[i]) : (C_DT == 2u ? from_bf16(uint(c_b[i])) : c[i]);
}
float ld_bias(uint i) {
    return BIAS_DT == 1u ? float(bias_h[i])
        : (BIAS_DT == 2u ? from_bf16(uint(bias_b[i])) : bias[i]);
}
void st_c(uint i, float v) {
    if (C_DT == 1u) {
        c_h[i] = float16_t(v);
    } else if (C_DT == 2u) {
        c_b[i] = uint16_t(bf16_bits(v));
    } else {
        c[i] = v;
    }
}
#endif

// Element index of op(A)(i, kk) / op(B)(kk, j) of matrix g.
uint a_index(uint g, uint i, uint kk) {
    return TRANS_A ? g * P.stride_a + kk * P.lda + i : g * P.stride_a + i * P.lda + kk;
}
uint b_index(uint g, uint kk, uint j) {
    return TRANS_B ? g * P.stride_b + j * P.ldb + kk : g * P.stride_b + kk * P.ldb + j;
}

// x * sigmoid(2u), u = c (x + 0.044715 x^3): shaders/common/gelu.wgsl's form of the
// tanh GELU, without tanh and without its cancellation for negative x.
const float GELU_C = 0.7978845608;
float gelu(float x) {
    return x * (1.0 / (1.0 + exp(-2.0 * GELU_C * (x + 0.044715 * x * x * x))));
}

// Stores output (g, i, j) of split `split` from its f32 sum.
void emit(float acc, uint g, uint i, uint j, uint split) {
    if (PARTIAL) {
        cf[split * P.total + (g * P.m + i) * P.n + j] = acc;
        return;
    }
    uint at = g * P.stride_c + i * P.ldc + j;
    float v = P.alpha * acc;
    // Tested by a constant, as the WGSL's USE_BETA: straight-line code once
    // specialized, which the driver contracts as it contracts the WGSL epilogue.
    if (USE_BETA) {
        v += P.beta * ld_c(at);
    }
    if (BIAS) {
        v += ld_bias(j);
    }
    if (GELU) {
        v = gelu(v);
    }
    if (COPY_F32) {
        cf[at] = v;
    }
    st_c(at, v);
}
