#version 450
// Fused attention for Kiln's raw Vulkan backend: the GLSL twin of
// shaders/attention_forward.wgsl (FWD), attention_backward_dq.wgsl (DQ) and
// attention_backward_dkv.wgsl (DKV), one module per pass, the same algorithm and the
// same order of every sum, so the passes agree with the WGSL ones to rounding:
//   forward:  out = softmax(scale q k^T [causal]) v, lse per row (online softmax);
//   dq pass:  delta = rowsum(dout * out), dq = scale sum_j p (dout . v_j - delta) k_j;
//   dkv pass: dv = sum_i p dout_i, dk = scale sum_i p (dout_i . v - delta_i) q_i,
// with p = exp2(s2 - lse2) recomputed from the forward's lse. Scores are kept in base 2
// (scale2 = scale log2 e); the running max, sum and every dot product are f32.
//
// A lane owns R rows (query rows forward and for dq, key rows for dk/dv) whose operands
// and accumulators live in registers (private arrays indexed only by unrolled loop
// counters), and walks the other side in blocks of SG rows. With SHARED (CPU-class
// drivers, where each per-lane load is a loop over the lanes) a workgroup is one
// subgroup: lane t loads block row t once and the subgroup shares it by broadcasts;
// without it (GPUs) every lane loads each block row itself, the same address across
// the workgroup, which caches serve.
//
// What the WGSL kernels cannot have: the tile shape, head dim, sharing and each
// tensor's storage are specialization constants (one module per pass instead of one
// WGSL assembly per shape and type), the broadcasts take a loop counter as the lane
// (SPIR-V 1.5), storage is 16-bit where a tensor is f16 or bf16 (read through f16vec4 /
// u16vec4 views, no packing arithmetic), and a host may require the subgroup size.
// Built with PACKED for devices without 16-bit storage: f16 and bf16 two to a 32-bit
// word, as the WGSL kernels' packed representation.
//
// Grouped-query attention: query head h reads K/V head h / group; dk/dv walk the K/V
// heads, each summing its `group` query heads in turn.

#extension GL_KHR_shader_subgroup_basic : require
#extension GL_KHR_shader_subgroup_shuffle : require
#extension GL_EXT_control_flow_attributes : require
#extension GL_GOOGLE_include_directive : require
#ifndef PACKED
#extension GL_EXT_shader_16bit_storage : require
#extension GL_EXT_shader_explicit_arithmetic_types_float16 : require
#endif

// Lanes per workgroup (the subgroup size when SHARED), block rows, rows per lane.
layout(local_size_x_id = 1) in;
layout(constant_id = 2) const uint SG = 8u;
layout(constant_id = 3) const uint R = 4u;
layout(constant_id = 4) const uint DIM = 64u;
layout(constant_id = 5) const bool SHARED = true;
// Storage of typed slots 0-5 (the pass's tensors in binding order): 0 f32, 1 f16,
// 2 bf16.
layout(constant_id = 10) const uint DT0 = 0u;
layout(constant_id = 11) const uint DT1 = 0u;
layout(constant_id = 12) const uint DT2 = 0u;
layout(constant_id = 13) const uint DT3 = 0u;
layout(constant_id = 14) const uint DT4 = 0u;
layout(constant_id = 15) const uint DT5 = 0u;
// Column groups of 4 per row; VEC: DIM % 4 == 0, so groups are whole and 4-aligned.
const uint D4 = (DIM + 3u) / 4u;
const bool VEC = (DIM % 4u) == 0u;

// shaders/common/attention_params.wgsl's Params, as push constants (32 bytes).
layout(push_constant) uniform Params {
    uint heads;
    uint seq;
    uint block_base;
    uint causal;
    float scale;
    float scale2;
    uint group;
    // Packed sequences: the query heads of each sequence (0: one document each).
    uint docs;
} P;

// Lower than any score, yet finite: `NEG - m` and exp2 of it stay well defined.
const float NEG = -3.4028235e38;
const float LN2 = 0.6931471805599453;
const float LOG2E = 1.4426950408889634;

#ifndef PACKED
// Typed slot n: one binding seen as f32, f16 or bf16 (the high half of an f32),
// scalars and groups of 4; specialization keeps the one view DTn names.
#define SLOT(n, ACC) \
    layout(set = 0, binding = n) ACC buffer S##n##F { float s##n##_f[]; }; \
    layout(set = 0, binding = n) ACC buffer S##n##F4 { vec4 s##n##_f4[]; }; \
    layout(set = 0, binding = n) ACC buffer S##n##H { float16_t s##n##_h[]; }; \
    layout(set = 0, binding = n) ACC buffer S##n##H4 { f16vec4 s##n##_h4[]; }; \
    layout(set = 0, binding = n) ACC buffer S##n##B { uint16_t s##n##_b[]; }; \
    layout(set = 0, binding = n) ACC buffer S##n##B4 { u16vec4 s##n##_b4[]; };
#define AT(n) \
    float at_##n(uint i) { \
        if (DT##n == 1u) { return float(s##n##_h[i]); } \
        if (DT##n == 2u) { return uintBitsToFloat(uint(s##n##_b[i]) << 16); } \
        return s##n##_f[i]; \
    } \
    vec4 at4_##n(uint i) { \
        if (DT##n == 1u) { return vec4(s##n##_h4[i >> 2]); } \
        if (DT##n == 2u) { return uintBitsToFloat(uvec4(s##n##_b4[i >> 2]) << 16); } \
        return s##n##_f4[i >> 2]; \
    }
// f16 rounded as OpFConvert does, bf16 as bf16_bits; only columns < DIM written.
#define STORES(n) \
    void put_##n(uint i, float v) { \
        if (DT##n == 1u) { s##n##_h[i] = float16_t(v); } \
        else if (DT##n == 2u) { s##n##_b[i] = uint16_t(bf16_bits(v)); } \
        else { s##n##_f[i] = v; } \
    } \
    void st_##n(uint row, uint c, vec4 v) { \
        uint e = row * DIM + 4u * c; \
        if (VEC) { \
            if (DT##n == 1u) { s##n##_h4[e >> 2] = f16vec4(v); } \
            else if (DT##n == 2u) { \
                s##n##_b4[e >> 2] = u16vec4(uvec4(bf16_bits(v.x), bf16_bits(v.y), \
                                                  bf16_bits(v.z), bf16_bits(v.w))); \
            } else { s##n##_f4[e >> 2] = v; } \
            return; \
        } \
        [[unroll]] for (uint u = 0u; u < 4u; u++) { \
            if (4u * c + u < DIM) { put_##n(e + u, v[u]); } \
        } \
    }
#else
// PACKED (devices without 16-bit storage): f16 and bf16 two to a 32-bit word, low
// half first, as the WGSL packed representation stores them.
#define SLOT(n, ACC) \
    layout(set = 0, binding = n) ACC buffer S##n##F { float s##n##_f[]; }; \
    layout(set = 0, binding = n) ACC buffer S##n##F4 { vec4 s##n##_f4[]; }; \
    layout(set = 0, binding = n) ACC buffer S##n##W { uint s##n##_w[]; }; \
    layout(set = 0, binding = n) ACC buffer S##n##W2 { uvec2 s##n##_w2[]; };
#define AT(n) \
    float at_##n(uint i) { \
        if (DT##n == 0u) { return s##n##_f[i]; } \
        uint w = s##n##_w[i >> 1]; \
        uint h = (i & 1u) == 1u ? w >> 16 : w & 0xffffu; \
        return DT##n == 1u ? unpackHalf2x16(h).x : uintBitsToFloat(h << 16); \
    } \
    vec4 at4_##n(uint i) { \
        if (DT##n == 0u) { return s##n##_f4[i >> 2]; } \
        uvec2 w = s##n##_w2[i >> 2]; \
        if (DT##n == 1u) { return vec4(unpackHalf2x16(w.x), unpackHalf2x16(w.y)); } \
        return uintBitsToFloat(uvec4(w.x << 16, w.x & 0xffff0000u, w.y << 16, w.y & 0xffff0000u)); \
    }
// 16-bit outputs have an even DIM (the kernel contract), so every written word is
// whole: pairs of columns, no read-modify-write.
#define STORES(n) \
    uint pack2_##n(float a, float b) { \
        return DT##n == 1u ? packHalf2x16(vec2(a, b)) : bf16_bits(a) | (bf16_bits(b) << 16); \
    } \
    void st_##n(uint row, uint c, vec4 v) { \
        uint e = row * DIM + 4u * c; \
        if (DT##n == 0u) { \
            if (VEC) { s##n##_f4[e >> 2] = v; return; } \
            [[unroll]] for (uint u = 0u; u < 4u; u++) { \
                if (4u * c + u < DIM) { s##n##_f[e + u] = v[u]; } \
            } \
            return; \
        } \
        if (VEC) { \
            s##n##_w2[e >> 2] = uvec2(pack2_##n(v.x, v.y), pack2_##n(v.z, v.w)); \
            return; \
        } \
        [[unroll]] for (uint u = 0u; u < 4u; u += 2u) { \
            if (4u * c + u < DIM) { s##n##_w[(e + u) >> 1] = pack2_##n(v[u], v[u + 1u]); } \
        } \
    }
#endif

// Column group c (4 columns) of a row: whole groups in one load; otherwise scalar
// loads, clamped into the row, zero past DIM.
#define LOADS(n) \
    AT(n) \
    vec4 ld_##n(uint row, uint c) { \
        uint e = row * DIM + 4u * c; \
        if (VEC) { return at4_##n(e); } \
        uint last = row * DIM + DIM - 1u; \
        vec4 v = vec4(at_##n(min(e, last)), at_##n(min(e + 1u, last)), \
                      at_##n(min(e + 2u, last)), at_##n(min(e + 3u, last))); \
        return live(c, v); \
    }

vec4 live(uint c, vec4 v) {
    bvec4 ok = lessThan(uvec4(4u * c) + uvec4(0u, 1u, 2u, 3u), uvec4(DIM));
    return mix(vec4(0.0), v, ok);
}

#include "common/bf16.glsl"

bool causal() {
    return P.causal != 0u;
}

// Row t's value from lane t; `t` is an unrolled loop counter, so a constant lane once
// the driver specializes (one extract and splat on a CPU-class driver).
vec4 bcast4(vec4 v, uint t) {
    return subgroupShuffle(v, t);
}
float bcast1(float v, uint t) {
    return subgroupShuffle(v, t);
}
uint bcast1u(uint v, uint t) {
    return subgroupShuffle(v, t);
}

// The first row of row `row`'s document in query head `head`'s sequence (0 without
// documents; `starts` is each pass's last binding). Within a sequence it never
// decreases, and it is at most `row`.
#define DOC_START \
    uint doc_start(uint head, uint row) { \
        if (P.docs == 0u) { return 0u; } \
        return starts[(head / P.docs) * P.seq + min(row, P.seq - 1u)]; \
    }

// The head and the first row of this workgroup's block of WG * R rows; false past the
// last head (a whole workgroup, so no lane of a subgroup leaves early alone).
bool place(out uint head, out uint first) {
    head = gl_WorkGroupID.y + gl_WorkGroupID.z * gl_NumWorkGroups.y;
    first = (P.block_base + gl_WorkGroupID.x) * (gl_WorkGroupSize.x * R);
    return head < P.heads;
}

#if defined(FWD)
// Slots: q, k, v (read), out; lse (f32, one per row); starts (u32, documents).
SLOT(0, readonly)
SLOT(1, readonly)
SLOT(2, readonly)
SLOT(3, writeonly)
LOADS(0)
LOADS(1)
LOADS(2)
STORES(3)
layout(set = 0, binding = 4) writeonly buffer Lse { float lse[]; };
layout(set = 0, binding = 5) readonly buffer Starts { uint starts[]; };
DOC_START

vec4 qr[R * D4];
vec4 acc[R * D4];
vec4 kown[D4];
vec4 vown[D4];
float s[R * SG];
float mrow[R];
float lrow[R];
float alf[R];
uint srow[R];

// One block of SG keys from j0 (rows of k and v from `base`) for the lane's rows from
// `mine`.
void block(uint base, uint j0, uint mine, uint lane) {
    uint T = P.seq;
    if (SHARED) {
        uint jl = base + min(j0 + lane, T - 1u);
        [[unroll]] for (uint c = 0u; c < D4; c++) {
            kown[c] = ld_1(jl, c);
            vown[c] = ld_2(jl, c);
        }
    }
    // Scores s[r][t] = q_r . k_t (base 2), NEG where masked.
    [[unroll]] for (uint t = 0u; t < SG; t++) {
        uint kt = base + min(j0 + t, T - 1u);
        vec4 d[R];
        [[unroll]] for (uint r = 0u; r < R; r++) {
            d[r] = vec4(0.0);
        }
        [[unroll]] for (uint c = 0u; c < D4; c++) {
            vec4 kb = SHARED ? bcast4(kown[c], t) : ld_1(kt, c);
            [[unroll]] for (uint r = 0u; r < R; r++) {
                d[r] = fma(qr[r * D4 + c], kb, d[r]);
            }
        }
        uint j = j0 + t;
        [[unroll]] for (uint r = 0u; r < R; r++) {
            bool seen = j < T && (!causal() || j <= mine + r) && j >= srow[r];
            s[r * SG + t] = seen ? d[r].x + d[r].y + d[r].z + d[r].w : NEG;
        }
    }
    // Online softmax: new max, rescale factor, probabilities, running sum.
    [[unroll]] for (uint r = 0u; r < R; r++) {
        float old = mrow[r];
        float mb = old;
        [[unroll]] for (uint t = 0u; t < SG; t++) {
            mb = max(mb, s[r * SG + t]);
        }
        float sum = 0.0;
        [[unroll]] for (uint t = 0u; t < SG; t++) {
            // Masked keys weigh exactly 0, also where all of a row's keys so far
            // are masked (mb is NEG then; packed rows start past a block's keys).
            float x = s[r * SG + t];
            float p = x > NEG ? exp2(x - mb) : 0.0;
            s[r * SG + t] = p;
            sum += p;
        }
        float alpha = exp2(old - mb);
        lrow[r] = lrow[r] * alpha + sum;
        mrow[r] = mb;
        alf[r] = alpha;
    }
    // acc = acc * alpha + p v, a column group at a time with all SG keys in registers.
    [[unroll]] for (uint c = 0u; c < D4; c++) {
        vec4 a[R];
        [[unroll]] for (uint r = 0u; r < R; r++) {
            a[r] = acc[r * D4 + c] * alf[r];
        }
        [[unroll]] for (uint t = 0u; t < SG; t++) {
            vec4 vb = SHARED ? bcast4(vown[c], t) : ld_2(base + min(j0 + t, T - 1u), c);
            [[unroll]] for (uint r = 0u; r < R; r++) {
                a[r] = fma(vec4(s[r * SG + t]), vb, a[r]);
            }
        }
        [[unroll]] for (uint r = 0u; r < R; r++) {
            acc[r * D4 + c] = a[r];
        }
    }
}

void main() {
    uint head, first;
    if (!place(head, first)) {
        return;
    }
    uint lane = gl_LocalInvocationID.x;
    uint T = P.seq;
    uint base = head * T;
    uint kbase = (head / P.group) * T;
    uint mine = first + lane * R;
    [[unroll]] for (uint r = 0u; r < R; r++) {
        uint row = base + min(mine + r, T - 1u);
        [[unroll]] for (uint c = 0u; c < D4; c++) {
            qr[r * D4 + c] = ld_0(row, c) * P.scale2;
            acc[r * D4 + c] = vec4(0.0);
        }
        mrow[r] = NEG;
        lrow[r] = 0.0;
        srow[r] = doc_start(head, mine + r);
    }
    uint kend = causal() ? min(T, first + gl_WorkGroupSize.x * R) : T;
    uint kbegin = doc_start(head, first) / SG * SG;
    for (uint j0 = kbegin; j0 < kend; j0 += SG) {
        block(kbase, j0, mine, lane);
    }
    [[unroll]] for (uint r = 0u; r < R; r++) {
        uint i = mine + r;
        if (i < T) {
            float l = lrow[r];
            float inv = l > 0.0 ? 1.0 / l : 0.0;
            [[unroll]] for (uint c = 0u; c < D4; c++) {
                st_3(base + i, c, acc[r * D4 + c] * inv);
            }
            lse[base + i] = (mrow[r] + log2(l)) * LN2;
        }
    }
}

#elif defined(DQ)
// Slots: q, k, v, out, dout (read), dq; lse (f32, read), delta (f32, written), starts
// (u32, documents).
SLOT(0, readonly)
SLOT(1, readonly)
SLOT(2, readonly)
SLOT(3, readonly)
SLOT(4, readonly)
SLOT(5, writeonly)
LOADS(0)
LOADS(1)
LOADS(2)
LOADS(3)
LOADS(4)
STORES(5)
layout(set = 0, binding = 6) readonly buffer Lse { float lse[]; };
layout(set = 0, binding = 7) writeonly buffer Delta { float delta[]; };
layout(set = 0, binding = 8) readonly buffer Starts { uint starts[]; };
DOC_START

vec4 qr[R * D4];
vec4 dor[R * D4];
vec4 dqa[R * D4];
vec4 kown[D4];
vec4 vown[D4];
float s[R * SG];
float lrow[R];
float drow[R];
uint srow[R];

// One block of SG keys from j0 (rows of k and v from `base`).
void block(uint base, uint j0, uint mine, uint lane) {
    uint T = P.seq;
    if (SHARED) {
        uint jl = base + min(j0 + lane, T - 1u);
        [[unroll]] for (uint c = 0u; c < D4; c++) {
            kown[c] = ld_1(jl, c);
            vown[c] = ld_2(jl, c);
        }
    }
    // s[r][t] = q_r . k_t (base 2, NEG where masked), then ds = p (dout_r . v_t - delta_r).
    [[unroll]] for (uint t = 0u; t < SG; t++) {
        uint kt = base + min(j0 + t, T - 1u);
        vec4 d[R];
        vec4 e[R];
        [[unroll]] for (uint r = 0u; r < R; r++) {
            d[r] = vec4(0.0);
            e[r] = vec4(0.0);
        }
        [[unroll]] for (uint c = 0u; c < D4; c++) {
            vec4 kb = SHARED ? bcast4(kown[c], t) : ld_1(kt, c);
            vec4 vb = SHARED ? bcast4(vown[c], t) : ld_2(kt, c);
            [[unroll]] for (uint r = 0u; r < R; r++) {
                d[r] = fma(qr[r * D4 + c], kb, d[r]);
            }
            [[unroll]] for (uint r = 0u; r < R; r++) {
                e[r] = fma(dor[r * D4 + c], vb, e[r]);
            }
        }
        uint j = j0 + t;
        [[unroll]] for (uint r = 0u; r < R; r++) {
            bool seen = j < T && (!causal() || j <= mine + r) && j >= srow[r];
            float sc = seen ? d[r].x + d[r].y + d[r].z + d[r].w : NEG;
            float p = exp2(sc - lrow[r]);
            s[r * SG + t] = p * (e[r].x + e[r].y + e[r].z + e[r].w - drow[r]);
        }
    }
    // dq += ds k, a column group at a time.
    [[unroll]] for (uint c = 0u; c < D4; c++) {
        vec4 a[R];
        [[unroll]] for (uint r = 0u; r < R; r++) {
            a[r] = dqa[r * D4 + c];
        }
        [[unroll]] for (uint t = 0u; t < SG; t++) {
            vec4 kb = SHARED ? bcast4(kown[c], t) : ld_1(base + min(j0 + t, T - 1u), c);
            [[unroll]] for (uint r = 0u; r < R; r++) {
                a[r] = fma(vec4(s[r * SG + t]), kb, a[r]);
            }
        }
        [[unroll]] for (uint r = 0u; r < R; r++) {
            dqa[r * D4 + c] = a[r];
        }
    }
}

void main() {
    uint head, first;
    if (!place(head, first)) {
        return;
    }
    uint lane = gl_LocalInvocationID.x;
    uint T = P.seq;
    uint base = head * T;
    uint kbase = (head / P.group) * T;
    uint mine = first + lane * R;
    [[unroll]] for (uint r = 0u; r < R; r++) {
        uint row = base + min(mine + r, T - 1u);
        vec4 dd = vec4(0.0);
        [[unroll]] for (uint c = 0u; c < D4; c++) {
            vec4 g = ld_4(row, c);
            dor[r * D4 + c] = g;
            dd = fma(g, ld_3(row, c), dd);
            qr[r * D4 + c] = ld_0(row, c) * P.scale2;
            dqa[r * D4 + c] = vec4(0.0);
        }
        float dsum = dd.x + dd.y + dd.z + dd.w;
        drow[r] = dsum;
        lrow[r] = lse[row] * LOG2E;
        srow[r] = doc_start(head, mine + r);
        if (mine + r < T) {
            delta[row] = dsum;
        }
    }
    uint kend = causal() ? min(T, first + gl_WorkGroupSize.x * R) : T;
    uint kbegin = doc_start(head, first) / SG * SG;
    for (uint j0 = kbegin; j0 < kend; j0 += SG) {
        block(kbase, j0, mine, lane);
    }
    [[unroll]] for (uint r = 0u; r < R; r++) {
        uint i = mine + r;
        if (i < T) {
            [[unroll]] for (uint c = 0u; c < D4; c++) {
                st_5(base + i, c, dqa[r * D4 + c] * P.scale);
            }
        }
    }
}

#elif defined(DKV)
// Slots: q, k, v, dout (read), dk, dv; lse, delta (f32, read; delta from the DQ pass),
// starts (u32, documents: key j is seen by the query rows i of its document, those
// with doc_start(i) <= j).
SLOT(0, readonly)
SLOT(1, readonly)
SLOT(2, readonly)
SLOT(3, readonly)
SLOT(4, writeonly)
SLOT(5, writeonly)
LOADS(0)
LOADS(1)
LOADS(2)
LOADS(3)
STORES(4)
STORES(5)
layout(set = 0, binding = 6) readonly buffer Lse { float lse[]; };
layout(set = 0, binding = 7) readonly buffer Delta { float delta[]; };
layout(set = 0, binding = 8) readonly buffer Starts { uint starts[]; };
DOC_START

vec4 kr[R * D4];
vec4 vr[R * D4];
vec4 dka[R * D4];
vec4 dva[R * D4];
vec4 qown[D4];
vec4 down[D4];
float p[R * SG];
float ds[R * SG];

// One block of SG query rows from i0 (rows of q, dout, lse and delta from `base`, of
// query head `qhead`).
void block(uint base, uint qhead, uint i0, uint mine, uint lane) {
    uint T = P.seq;
    float lown = 0.0;
    float dlown = 0.0;
    uint sown = 0u;
    if (SHARED) {
        uint il = base + min(i0 + lane, T - 1u);
        [[unroll]] for (uint c = 0u; c < D4; c++) {
            qown[c] = ld_0(il, c);
            down[c] = ld_3(il, c);
        }
        lown = lse[il] * LOG2E;
        dlown = delta[il];
        sown = doc_start(qhead, i0 + lane);
    }
    [[unroll]] for (uint t = 0u; t < SG; t++) {
        uint it = base + min(i0 + t, T - 1u);
        vec4 d[R];
        vec4 e[R];
        [[unroll]] for (uint r = 0u; r < R; r++) {
            d[r] = vec4(0.0);
            e[r] = vec4(0.0);
        }
        [[unroll]] for (uint c = 0u; c < D4; c++) {
            vec4 qb = SHARED ? bcast4(qown[c], t) : ld_0(it, c);
            vec4 gb = SHARED ? bcast4(down[c], t) : ld_3(it, c);
            [[unroll]] for (uint r = 0u; r < R; r++) {
                d[r] = fma(kr[r * D4 + c], qb, d[r]);
            }
            [[unroll]] for (uint r = 0u; r < R; r++) {
                e[r] = fma(vr[r * D4 + c], gb, e[r]);
            }
        }
        float lt = SHARED ? bcast1(lown, t) : lse[it] * LOG2E;
        float dt = SHARED ? bcast1(dlown, t) : delta[it];
        uint st = SHARED ? bcast1u(sown, t) : doc_start(qhead, i0 + t);
        uint i = i0 + t;
        [[unroll]] for (uint r = 0u; r < R; r++) {
            bool seen = i < T && (!causal() || mine + r <= i) && st <= mine + r;
            float sc = seen ? d[r].x + d[r].y + d[r].z + d[r].w : NEG;
            float pr = exp2(sc - lt);
            p[r * SG + t] = pr;
            ds[r * SG + t] = pr * (e[r].x + e[r].y + e[r].z + e[r].w - dt);
        }
    }
    // dv += p dout_i, dk += ds q_i, a column group at a time.
    [[unroll]] for (uint c = 0u; c < D4; c++) {
        vec4 a[R];
        vec4 b[R];
        [[unroll]] for (uint r = 0u; r < R; r++) {
            a[r] = dva[r * D4 + c];
            b[r] = dka[r * D4 + c];
        }
        [[unroll]] for (uint t = 0u; t < SG; t++) {
            uint it = base + min(i0 + t, T - 1u);
            vec4 qb = SHARED ? bcast4(qown[c], t) : ld_0(it, c);
            vec4 gb = SHARED ? bcast4(down[c], t) : ld_3(it, c);
            [[unroll]] for (uint r = 0u; r < R; r++) {
                a[r] = fma(vec4(p[r * SG + t]), gb, a[r]);
            }
            [[unroll]] for (uint r = 0u; r < R; r++) {
                b[r] = fma(vec4(ds[r * SG + t]), qb, b[r]);
            }
        }
        [[unroll]] for (uint r = 0u; r < R; r++) {
            dva[r * D4 + c] = a[r];
            dka[r * D4 + c] = b[r];
        }
    }
}

void main() {
    uint head, first;
    if (!place(head, first)) {
        return;
    }
    uint lane = gl_LocalInvocationID.x;
    uint T = P.seq;
    uint base = head * T;
    uint mine = first + lane * R;
    [[unroll]] for (uint r = 0u; r < R; r++) {
        uint row = base + min(mine + r, T - 1u);
        [[unroll]] for (uint c = 0u; c < D4; c++) {
            kr[r * D4 + c] = ld_1(row, c) * P.scale2;
            vr[r * D4 + c] = ld_2(row, c);
            dka[r * D4 + c] = vec4(0.0);
            dva[r * D4 + c] = vec4(0.0);
        }
    }
    // Causal: query rows before the block's first key see none of its keys.
    uint qstart = causal() ? first : 0u;
    uint last = first + gl_WorkGroupSize.x * R - 1u;
    for (uint g = 0u; g < P.group; g++) {
        uint qhead = head * P.group + g;
        uint qbase = qhead * T;
        for (uint i0 = qstart; i0 < T; i0 += SG) {
            // Packed: this block's rows and all after it start past the last key row.
            if (doc_start(qhead, i0) > last) {
                break;
            }
            block(qbase, qhead, i0, mine, lane);
        }
    }
    [[unroll]] for (uint r = 0u; r < R; r++) {
        uint j = mine + r;
        if (j < T) {
            [[unroll]] for (uint c = 0u; c < D4; c++) {
                st_4(base + j, c, dka[r * D4 + c] * P.scale);
                st_5(base + j, c, dva[r * D4 + c]);
            }
        }
    }
}
#endif
