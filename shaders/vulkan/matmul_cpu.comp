#version 450
// GEMM for CPU-class Vulkan drivers (Mesa lavapipe), the SPIR-V twin of
// shaders/matmul_cpu.wgsl: such a driver runs a subgroup as one SIMD vector and turns
// each buffer load into a loop over the lanes, so loads set the speed. One workgroup is
// one subgroup and owns TM rows x SG*4*NV columns of C; lane l owns the column groups
// j0 + 4*(l + SG*v), v < NV. Each lane loads one A value per row and SG values of k,
// and the subgroup shares them by shuffles.
//
//   C[g](i, j) = alpha * sum_k A[g](i, k) * B[g](k, j) + beta * C[g](i, j)
//
// With EPILOGUE (modules `_epi`, run by Kiln's raw Vulkan backend), the WGSL GEMMs'
// fused epilogue follows (shaders/common/matmul_epilogue.wgsl, in the same order): a bias
// added to every row, then GELU (tanh form), and the f32 value stored to `cf` as well as
// rounded into C; each switched by a specialization constant.
//
// Storage is f32 or (STORE_F16) f16; products and sums are f32. The transposes are
// compiled in (TRANS_A, TRANS_B: one module each); tile shapes are specialization
// constants with the defaults below, so a driver that specializes may pick others.
//
// With MIXED (modules `_mixed`, always with the epilogue) A, B, C and the bias each have
// their own storage, f32, f16 or bf16, chosen by specialization constants 6-9: every
// binding is declared once per type, and the driver drops the unused ones when it
// specializes. bf16 is the upper half of an f32, read by shifting and stored rounded to
// nearest even (NaN kept quiet), as shaders/common/convert.wgsl's bf16_bits rounds.
// These modules also run split K (PARTIAL, constant 10): workgroup z is matrix x split,
// each split sums its chunk of K in order and writes the raw f32 sums to `cf` in
// shaders/common/matmul_epilogue.wgsl's partials layout, and the WGSL matmul_finish
// sums the splits and applies the epilogue, as the WGSL GEMMs' split K does.
//
// With TEXEL (modules `_mixed_texel`, always MIXED) A and B are read through uniform
// texel buffers instead of storage buffers: lavapipe (Mesa 22.3) turns a storage load
// whose address differs across lanes into a loop over the lanes with a branch per lane,
// which is most of this kernel's time where the CPU has no AVX-512, while a texel fetch
// is a vector gather. The host binds each operand as a buffer view of its storage
// (R32_SFLOAT or R16_SFLOAT, the 4-value loads RGBA; bf16 as R16_UINT, RGBA16_UINT), so
// the fetch returns the stored value exactly, and every sum is the storage path's.

#extension GL_KHR_shader_subgroup_basic : require
#extension GL_KHR_shader_subgroup_shuffle : require
#extension GL_EXT_control_flow_attributes : require
#extension GL_GOOGLE_include_directive : require
#ifdef MIXED
#define EPILOGUE
#define STORE float
#endif
#if defined(STORE_F16) || defined(MIXED)
#extension GL_EXT_shader_16bit_storage : require
#extension GL_EXT_shader_explicit_arithmetic_types_float16 : require
#endif
#ifdef STORE_F16
#define STORE float16_t
#elif !defined(MIXED)
#define STORE float
#endif

// Lanes per workgroup: one subgroup of a CPU-class driver (lavapipe's is 8). A literal
// size, not a specialization constant: a `local_size_x_id` workgroup left at its
// default ran as one invocation here (lavapipe, through wgpu's passthrough, which
// cannot specialize).
#define SG 8u
layout(local_size_x = 8) in;
#ifndef TILE_M
#define TILE_M 16
#define TILE_NV 2
#endif
layout(constant_id = 1) const uint TM = TILE_M;
layout(constant_id = 2) const uint NV = TILE_NV;

#ifdef TEXEL
// A and B as texel buffers: f32 and f16 views fetch as floats, bf16 views as their bits.
layout(set = 0, binding = 0) uniform samplerBuffer ta;
layout(set = 0, binding = 0) uniform usamplerBuffer ta_bits;
layout(set = 0, binding = 1) uniform samplerBuffer tb;
layout(set = 0, binding = 1) uniform usamplerBuffer tb_bits;
#else
layout(set = 0, binding = 0) readonly buffer BufA { STORE a[]; };
layout(set = 0, binding = 1) readonly buffer BufB { STORE b[]; };
#ifdef VEC_B
// The same B as 4-value groups: with VEC_B (B as stored, N a multiple of 4) each
// lane's four columns are one load, where four scalars cost four on a CPU driver.
#ifdef STORE_F16
layout(set = 0, binding = 1) readonly buffer BufB4 { f16vec4 b4[]; };
#else
layout(set = 0, binding = 1) readonly buffer BufB4 { vec4 b4[]; };
#endif
#endif
#endif
layout(set = 0, binding = 2) buffer BufC { STORE c[]; };
#ifdef MIXED
// Storage of A, B, C and the bias: 0 f32, 1 f16, 2 bf16.
layout(constant_id = 6) const uint A_DT = 0u;
layout(constant_id = 7) const uint B_DT = 0u;
layout(constant_id = 8) const uint C_DT = 0u;
layout(constant_id = 9) const uint BIAS_DT = 0u;
layout(constant_id = 10) const bool PARTIAL = false;
#ifndef TEXEL
layout(set = 0, binding = 0) readonly buffer BufAh { float16_t a_h[]; };
layout(set = 0, binding = 0) readonly buffer BufAb { uint16_t a_b[]; };
layout(set = 0, binding = 1) readonly buffer BufBh { float16_t b_h[]; };
layout(set = 0, binding = 1) readonly buffer BufBb { uint16_t b_b[]; };
#ifdef VEC_B
layout(set = 0, binding = 1) readonly buffer BufB4h { f16vec4 b4_h[]; };
layout(set = 0, binding = 1) readonly buffer BufB4b { u16vec4 b4_b[]; };
#endif
#endif
layout(set = 0, binding = 2) buffer BufCh { float16_t c_h[]; };
layout(set = 0, binding = 2) buffer BufCb { uint16_t c_b[]; };

float from_bf16(uint v) {
    return uintBitsToFloat(v << 16);
}

#include "common/bf16.glsl"

#ifdef TEXEL
float ld_a(uint i) {
    return A_DT == 2u ? from_bf16(texelFetch(ta_bits, int(i)).x) : texelFetch(ta, int(i)).x;
}
float ld_b(uint i) {
    return B_DT == 2u ? from_bf16(texelFetch(tb_bits, int(i)).x) : texelFetch(tb, int(i)).x;
}
vec4 ld_b4(uint i) {
    return B_DT == 2u ? uintBitsToFloat(texelFetch(tb_bits, int(i)) << 16)
        : texelFetch(tb, int(i));
}
#else
float ld_a(uint i) {
    return A_DT == 1u ? float(a_h[i]) : (A_DT == 2u ? from_bf16(uint(a_b[i])) : a[i]);
}
float ld_b(uint i) {
    return B_DT == 1u ? float(b_h[i]) : (B_DT == 2u ? from_bf16(uint(b_b[i])) : b[i]);
}
#ifdef VEC_B
vec4 ld_b4(uint i) {
    if (B_DT == 1u) {
        return vec4(b4_h[i]);
    }
    if (B_DT == 2u) {
        return uintBitsToFloat(uvec4(b4_b[i]) << 16);
    }
    return b4[i];
}
#endif
#endif
float ld_c(uint i) {
    return C_DT == 1u ? float(c_h[i]) : (C_DT == 2u ? from_bf16(uint(c_b[i])) : c[i]);
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
#else
#define ld_a(i) float(a[i])
#define ld_b(i) float(b[i])
#define ld_b4(i) vec4(b4[i])
#define ld_c(i) float(c[i])
#define st_c(i, v) c[i] = STORE(v)
#endif
#ifdef EPILOGUE
layout(constant_id = 3) const bool BIAS = false;
layout(constant_id = 4) const bool GELU = false;
layout(constant_id = 5) const bool COPY_F32 = false;
layout(constant_id = 11) const bool USE_BETA = false;
// The bias (N values, stored as C is) and the f32 copy of C (laid out as C is). A host
// binds stand-ins where a launch has none: both are in the module either way.
layout(set = 0, binding = 4) readonly buffer BufBias { STORE bias[]; };
layout(set = 0, binding = 5) writeonly buffer BufCf { float cf[]; };
#ifdef MIXED
layout(set = 0, binding = 4) readonly buffer BufBiasH { float16_t bias_h[]; };
layout(set = 0, binding = 4) readonly buffer BufBiasB { uint16_t bias_b[]; };
float ld_bias(uint i) {
    return BIAS_DT == 1u ? float(bias_h[i])
        : (BIAS_DT == 2u ? from_bf16(uint(bias_b[i])) : bias[i]);
}
#else
#define ld_bias(i) float(bias[i])
#endif

// x * sigmoid(2u), u = c (x + 0.044715 x^3): common/gelu.wgsl's form, which equals
// 0.5 x (1 + tanh u) without its cancellation for negative x, and without tanh.
const float GELU_C = 0.7978845608;
float gelu(float x) {
    return x * (1.0 / (1.0 + exp(-2.0 * GELU_C * (x + 0.044715 * x * x * x))));
}
#endif
// Row strides (elements between rows as stored), batch strides, and the epilogue.
layout(set = 0, binding = 3) uniform Params {
    uint m, n, k;
    uint lda, ldb, ldc;
    uint stride_a, stride_b, stride_c;
    float alpha, beta;
#ifdef MIXED
    // K splits, the K values each takes (a multiple of SG) and batch * m * n.
    uint splits, k_chunk, total;
#endif
} P;

// A(i, kk) of matrix g; A is stored M x K, or K x M when transposed.
float a_at(uint g, uint i, uint kk) {
#ifdef TRANS_A
    return ld_a(g * P.stride_a + kk * P.lda + i);
#else
    return ld_a(g * P.stride_a + i * P.lda + kk);
#endif
}

// B(kk, j) of matrix g; B is stored K x N, or N x K when transposed.
float b_at(uint g, uint kk, uint j) {
#ifdef TRANS_B
    return ld_b(g * P.stride_b + j * P.ldb + kk);
#else
    return ld_b(g * P.stride_b + kk * P.ldb + j);
#endif
}

// B(kk, j..j+3), zero past K (an inf in B's last row must not meet a zero A and make
// NaN); indices are clamped so that every load stays inside the buffer.
// With VEC_B, j is clamped to the last whole group (columns past N that it then reads
// are never stored).
vec4 load_b4(uint g, uint kk, uint j) {
    uint kc = min(kk, P.k - 1u);
#ifdef VEC_B
    vec4 v = ld_b4((g * P.stride_b + kc * P.ldb) / 4u + min(j, P.n - 4u) / 4u);
#else
    uint jm = P.n - 1u;
    vec4 v = vec4(b_at(g, kc, min(j, jm)), b_at(g, kc, min(j + 1u, jm)),
                  b_at(g, kc, min(j + 2u, jm)), b_at(g, kc, min(j + 3u, jm)));
#endif
    return kk < P.k ? v : vec4(0.0);
}

void main() {
    uint lane = gl_SubgroupInvocationID;
    uint g = gl_WorkGroupID.z;
#ifdef MIXED
    uint split = g % P.splits;
    g /= P.splits;
    // Only the last split's last step can run past K, and the loads zero it there.
    uint k_begin = split * P.k_chunk;
    uint k_end = min(P.k, k_begin + P.k_chunk);
#endif
    uint i0 = gl_WorkGroupID.y * TM;
    uint j0 = gl_WorkGroupID.x * (SG * 4u * NV) + 4u * lane;
    uint im = P.m - 1u;
    vec4 acc[TM * NV];
    [[unroll]] for (uint x = 0u; x < TM * NV; x++) {
        acc[x] = vec4(0.0);
    }
#ifdef MIXED
    for (uint kk = k_begin; kk < k_end; kk += SG) {
#else
    for (uint kk = 0u; kk < P.k; kk += SG) {
#endif
        // This lane's A value of every row (zero past K), shared below by shuffles.
        uint kl = kk + lane;
        float al[TM];
        [[unroll]] for (uint r = 0u; r < TM; r++) {
            float v = a_at(g, min(i0 + r, im), min(kl, P.k - 1u));
            al[r] = kl < P.k ? v : 0.0;
        }
        vec4 bv[SG * NV];
        [[unroll]] for (uint t = 0u; t < SG; t++) {
            [[unroll]] for (uint v = 0u; v < NV; v++) {
                bv[t * NV + v] = load_b4(g, kk + t, j0 + v * SG * 4u);
            }
        }
        // Row by row, each accumulator takes all SG steps of k while in a register.
        [[unroll]] for (uint r = 0u; r < TM; r++) {
            [[unroll]] for (uint v = 0u; v < NV; v++) {
                vec4 s = acc[r * NV + v];
                [[unroll]] for (uint t = 0u; t < SG; t++) {
                    s = fma(vec4(subgroupShuffle(al[r], t)), bv[t * NV + v], s);
                }
                acc[r * NV + v] = s;
            }
        }
    }
    [[unroll]] for (uint r = 0u; r < TM; r++) {
        [[unroll]] for (uint v = 0u; v < NV; v++) {
            uint i = i0 + r;
            uint j = j0 + v * SG * 4u;
            if (i < P.m) {
                [[unroll]] for (uint e = 0u; e < 4u; e++) {
                    if (j + e < P.n) {
#ifdef MIXED
                        if (PARTIAL) {
                            cf[split * P.total + (g * P.m + i) * P.n + j + e] =
                                acc[r * NV + v][e];
                            continue;
                        }
#endif
                        uint at = g * P.stride_c + i * P.ldc + j + e;
                        float out_v = P.alpha * acc[r * NV + v][e];
#ifdef EPILOGUE
                        // C read where the host says beta is not 0, as the WGSL
                        // epilogue's USE_BETA: straight-line code after specialization,
                        // so the driver contracts it as it contracts the WGSL one.
                        if (USE_BETA) {
#else
                        if (P.beta != 0.0) {
#endif
                            out_v += P.beta * ld_c(at);
                        }
#ifdef EPILOGUE
                        if (BIAS) {
                            out_v += ld_bias(j + e);
                        }
                        if (GELU) {
                            out_v = gelu(out_v);
                        }
                        if (COPY_F32) {
                            cf[at] = out_v;
                        }
#endif
                        st_c(at, out_v);
                    }
                }
            }
        }
    }
}
