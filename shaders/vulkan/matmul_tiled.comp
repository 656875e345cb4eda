#version 450
// GEMM for GPUs, the SPIR-V twin of shaders/matmul_tiled.wgsl, for Kiln's raw Vulkan
// backend: a 16 x 16 workgroup computes a BM x BN tile of C, each invocation a
// (BM / 16) x (BN / 16) register block (rows ty + 16 r, columns tx + 16 c), K in steps
// of BK through shared-memory tiles stored k-major with one padding column. Every
// output sums its K chunk in the WGSL kernel's order (one fma per k, k in order, zeros
// past the chunk), so the two give the same bits where the drivers contract alike.
//
//   C[g](i, j) = epilogue(alpha * sum_k op(A)[g](i, k) * op(B)[g](k, j))
//
// Everything is a specialization constant: the tile shape (1 BM, 2 BN, 12 BK; the host
// checks the shared memory against the device's), the transposes (13, 14), 16-byte
// loads along each operand's contiguous dimension (15 VEC_A, 16 VEC_B: it is a multiple
// of 4 and 4-aligned), the storage of each operand and the epilogue (common/gemm_io.glsl).
//
// What WGSL cannot: an f16 operand stays f16 in shared memory (half the bytes: an
// f16 x f16 product is exact in f32, so widening at the fma gives the same sums as
// widening on the way in). bf16 and f32 operands are held as f32.

#extension GL_EXT_control_flow_attributes : require
#extension GL_GOOGLE_include_directive : require
#ifndef PACKED
#extension GL_EXT_shader_16bit_storage : require
#extension GL_EXT_shader_explicit_arithmetic_types_float16 : require
#endif

layout(local_size_x = 16, local_size_y = 16) in;
layout(constant_id = 1) const uint BM = 64u;
layout(constant_id = 2) const uint BN = 64u;
layout(constant_id = 12) const uint BK = 16u;
layout(constant_id = 15) const bool VEC_A = false;
layout(constant_id = 16) const bool VEC_B = false;

#include "common/gemm_io.glsl"

layout(set = 0, binding = 0) readonly buffer BufA4 { vec4 a4[]; };
layout(set = 0, binding = 1) readonly buffer BufB4 { vec4 b4[]; };
#ifdef PACKED
// Four 16-bit values in two words.
layout(set = 0, binding = 0) readonly buffer BufA4w { uvec2 a4_w[]; };
layout(set = 0, binding = 1) readonly buffer BufB4w { uvec2 b4_w[]; };
vec4 from_words(uvec2 w, uint dt) {
    return vec4(from_word(w.x, 0u, dt), from_word(w.x, 1u, dt), from_word(w.y, 0u, dt),
                from_word(w.y, 1u, dt));
}
#else
layout(set = 0, binding = 0) readonly buffer BufA4h { f16vec4 a4_h[]; };
layout(set = 0, binding = 0) readonly buffer BufA4b { u16vec4 a4_b[]; };
layout(set = 0, binding = 1) readonly buffer BufB4h { f16vec4 b4_h[]; };
layout(set = 0, binding = 1) readonly buffer BufB4b { u16vec4 b4_b[]; };
#endif

// Register block steps, and the tiles' row lengths (one padding column).
const uint RM = BM / 16u;
const uint RN = BN / 16u;
const uint AS = BM + 1u;
const uint BS = BN + 1u;
// Largest register block side the unrolled code covers; steps past RM / RN fold away.
#define RB 8u

// 1 where the operand is f16 and its tile is kept f16; the other tile shrinks to one
// element (array sizes are specialization constant expressions: arithmetic only).
#ifdef PACKED
const uint A_H = 0u;
const uint B_H = 0u;
#else
const uint A_H = A_DT & 1u;
const uint B_H = B_DT & 1u;
#endif
const uint A_LEN = BK * AS;
const uint B_LEN = BK * BS;
shared float tile_a[A_LEN - (A_LEN - 1u) * A_H];
shared float tile_b[B_LEN - (B_LEN - 1u) * B_H];
#ifndef PACKED
shared float16_t tile_ah[1u + (A_LEN - 1u) * A_H];
shared float16_t tile_bh[1u + (B_LEN - 1u) * B_H];
#endif

// Tile writes: element x of the tile from operand element `at` (0 where not `ok`;
// indices are clamped into the operand by the callers, so the load is always valid).
void put_a(uint x, uint at, bool ok) {
#ifndef PACKED
    if (A_H == 1u) {
        float16_t v = a_h[at];
        tile_ah[x] = ok ? v : float16_t(0.0);
        return;
    }
#endif
    float v = ld_a(at);
    tile_a[x] = ok ? v : 0.0;
}
void put_b(uint x, uint at, bool ok) {
#ifndef PACKED
    if (B_H == 1u) {
        float16_t v = b_h[at];
        tile_bh[x] = ok ? v : float16_t(0.0);
        return;
    }
#endif
    float v = ld_b(at);
    tile_b[x] = ok ? v : 0.0;
}
// Four consecutive operand elements from element `at` (a multiple of 4), written to
// tile elements x + step * e. Loaded whether or not `ok`, then selected (as WGSL's
// select): a load in a conditional's arm is a branch, and lanes that disagree on it
// run both sides on a SIMD driver.
void put_a4(uint x, uint step, uint at, bool ok) {
#ifndef PACKED
    if (A_H == 1u) {
        f16vec4 v = a4_h[at / 4u];
        v = ok ? v : f16vec4(0.0);
        [[unroll]] for (uint e = 0u; e < 4u; e++) {
            tile_ah[x + step * e] = v[e];
        }
        return;
    }
    if (A_DT == 2u) {
        vec4 v = uintBitsToFloat(uvec4(a4_b[at / 4u]) << 16);
        v = ok ? v : vec4(0.0);
        [[unroll]] for (uint e = 0u; e < 4u; e++) {
            tile_a[x + step * e] = v[e];
        }
        return;
    }
#else
    if (A_DT != 0u) {
        vec4 v = from_words(a4_w[at / 4u], A_DT);
        v = ok ? v : vec4(0.0);
        [[unroll]] for (uint e = 0u; e < 4u; e++) {
            tile_a[x + step * e] = v[e];
        }
        return;
    }
#endif
    vec4 v = a4[at / 4u];
    v = ok ? v : vec4(0.0);
    [[unroll]] for (uint e = 0u; e < 4u; e++) {
        tile_a[x + step * e] = v[e];
    }
}
void put_b4(uint x, uint step, uint at, bool ok) {
#ifndef PACKED
    if (B_H == 1u) {
        f16vec4 v = b4_h[at / 4u];
        v = ok ? v : f16vec4(0.0);
        [[unroll]] for (uint e = 0u; e < 4u; e++) {
            tile_bh[x + step * e] = v[e];
        }
        return;
    }
    if (B_DT == 2u) {
        vec4 v = uintBitsToFloat(uvec4(b4_b[at / 4u]) << 16);
        v = ok ? v : vec4(0.0);
        [[unroll]] for (uint e = 0u; e < 4u; e++) {
            tile_b[x + step * e] = v[e];
        }
        return;
    }
#else
    if (B_DT != 0u) {
        vec4 v = from_words(b4_w[at / 4u], B_DT);
        v = ok ? v : vec4(0.0);
        [[unroll]] for (uint e = 0u; e < 4u; e++) {
            tile_b[x + step * e] = v[e];
        }
        return;
    }
#endif
    vec4 v = b4[at / 4u];
    v = ok ? v : vec4(0.0);
    [[unroll]] for (uint e = 0u; e < 4u; e++) {
        tile_b[x + step * e] = v[e];
    }
}

float tile_a_at(uint x) {
#ifndef PACKED
    if (A_H == 1u) {
        return float(tile_ah[x]);
    }
#endif
    return tile_a[x];
}
float tile_b_at(uint x) {
#ifndef PACKED
    if (B_H == 1u) {
        return float(tile_bh[x]);
    }
#endif
    return tile_b[x];
}

// BM x BK of op(A) and BK x BN of op(B) into the tiles, walked along each operand's
// contiguous dimension so that neighbouring invocations load neighbouring addresses.
void load_a(uint g, uint i0, uint k0, uint k_end, uint tid) {
    if (VEC_A) {
        for (uint e = tid; e < BM * BK / 4u; e += 256u) {
            if (TRANS_A) {
                // A is k x m: 4 consecutive rows at one k.
                uint i = (e % (BM / 4u)) * 4u;
                uint kk = e / (BM / 4u);
                uint gi = i0 + i;
                uint gk = k0 + kk;
                uint at = a_index(g, min(gi, P.m - 4u), min(gk, P.k - 1u));
                put_a4(kk * AS + i, 1u, at, gi < P.m && gk < k_end);
            } else {
                // A is m x k: 4 consecutive k of one row.
                uint i = e / (BK / 4u);
                uint kk = (e % (BK / 4u)) * 4u;
                uint gi = i0 + i;
                uint gk = k0 + kk;
                uint at = a_index(g, min(gi, P.m - 1u), min(gk, P.k - 4u));
                put_a4(kk * AS + i, AS, at, gi < P.m && gk < k_end);
            }
        }
        return;
    }
    for (uint e = tid; e < BM * BK; e += 256u) {
        uint i = TRANS_A ? e % BM : e / BK;
        uint kk = TRANS_A ? e / BM : e % BK;
        uint gi = i0 + i;
        uint gk = k0 + kk;
        put_a(kk * AS + i, a_index(g, min(gi, P.m - 1u), min(gk, P.k - 1u)),
              gi < P.m && gk < k_end);
    }
}

void load_b(uint g, uint j0, uint k0, uint k_end, uint tid) {
    if (VEC_B) {
        for (uint e = tid; e < BN * BK / 4u; e += 256u) {
            if (TRANS_B) {
                // B is n x k: 4 consecutive k of one column.
                uint j = e / (BK / 4u);
                uint kb = (e % (BK / 4u)) * 4u;
                uint gj = j0 + j;
                uint gk = k0 + kb;
                uint at = b_index(g, min(gk, P.k - 4u), min(gj, P.n - 1u));
                put_b4(kb * BS + j, BS, at, gj < P.n && gk < k_end);
            } else {
                // B is k x n: 4 consecutive columns at one k.
                uint j = (e % (BN / 4u)) * 4u;
                uint kb = e / (BN / 4u);
                uint gj = j0 + j;
                uint gk = k0 + kb;
                uint at = b_index(g, min(gk, P.k - 1u), min(gj, P.n - 4u));
                put_b4(kb * BS + j, 1u, at, gj < P.n && gk < k_end);
            }
        }
        return;
    }
    for (uint e = tid; e < BN * BK; e += 256u) {
        uint j = TRANS_B ? e / BK : e % BN;
        uint kb = TRANS_B ? e % BK : e / BN;
        uint gj = j0 + j;
        uint gk = k0 + kb;
        put_b(kb * BS + j, b_index(g, min(gk, P.k - 1u), min(gj, P.n - 1u)),
              gj < P.n && gk < k_end);
    }
}

void main() {
    uvec2 lid = gl_LocalInvocationID.xy;
    uint tid = gl_LocalInvocationIndex;
    uint g = gl_WorkGroupID.z / P.splits;
    uint split = gl_WorkGroupID.z % P.splits;
    uint i0 = P.row_base + gl_WorkGroupID.y * BM;
    uint j0 = gl_WorkGroupID.x * BN;
    uint k_begin = split * P.k_chunk;
    uint k_end = min(P.k, k_begin + P.k_chunk);
    float acc[RB * RB];
    [[unroll]] for (uint x = 0u; x < RB * RB; x++) {
        acc[x] = 0.0;
    }
    for (uint k0 = k_begin; k0 < k_end; k0 += BK) {
        load_a(g, i0, k0, k_end, tid);
        load_b(g, j0, k0, k_end, tid);
        barrier();
        for (uint kk = 0u; kk < BK; kk++) {
            float av[RB];
            float bv[RB];
            [[unroll]] for (uint r = 0u; r < RB; r++) {
                av[r] = tile_a_at(kk * AS + lid.y + min(r, RM - 1u) * 16u);
            }
            [[unroll]] for (uint c = 0u; c < RB; c++) {
                bv[c] = tile_b_at(kk * BS + lid.x + min(c, RN - 1u) * 16u);
            }
            [[unroll]] for (uint r = 0u; r < RB; r++) {
                if (r < RM) {
                    [[unroll]] for (uint c = 0u; c < RB; c++) {
                        if (c < RN) {
                            acc[r * RB + c] = fma(av[r], bv[c], acc[r * RB + c]);
                        }
                    }
                }
            }
        }
        barrier();
    }
    [[unroll]] for (uint r = 0u; r < RB; r++) {
        if (r < RM) {
            [[unroll]] for (uint c = 0u; c < RB; c++) {
                if (c < RN) {
                    uint i = i0 + lid.y + r * 16u;
                    uint j = j0 + lid.x + c * 16u;
                    if (i < P.m && j < P.n) {
                        emit(acc[r * RB + c], g, i, j, split);
                    }
                }
            }
        }
    }
}
