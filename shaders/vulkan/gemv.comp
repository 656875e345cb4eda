#version 450
// Matrix-vector product (N = 1), the SPIR-V twin of shaders/gemv.wgsl, for Kiln's raw
// Vulkan backend: one workgroup of LANES invocations per output row (LANES a power of
// two, the workgroup size by specialization constant 1); invocation l sums
// k = l, l + LANES, ... of its K chunk with one fma per k, then the partial sums fold in
// shared memory in the WGSL kernel's fixed order, so the two give the same bits.
// Transposes, storage and the epilogue are specialization constants
// (common/gemm_io.glsl); split K writes the f32 partials matmul_finish sums.

#extension GL_GOOGLE_include_directive : require
#ifndef PACKED
#extension GL_EXT_shader_16bit_storage : require
#extension GL_EXT_shader_explicit_arithmetic_types_float16 : require
#endif

layout(local_size_x_id = 1) in;

#include "common/gemm_io.glsl"

const uint LANES = gl_WorkGroupSize.x;
shared float part[LANES];

void main() {
    uint lane = gl_LocalInvocationID.x;
    uint g = gl_WorkGroupID.z / P.splits;
    uint split = gl_WorkGroupID.z % P.splits;
    uint i = P.row_base + gl_WorkGroupID.y;
    uint k_begin = split * P.k_chunk;
    uint k_end = min(P.k, k_begin + P.k_chunk);
    float acc = 0.0;
    for (uint kk = k_begin + lane; kk < k_end; kk += LANES) {
        acc = fma(ld_a(a_index(g, i, kk)), ld_b(b_index(g, kk, 0u)), acc);
    }
    part[lane] = acc;
    barrier();
    for (uint s = LANES / 2u; s > 0u; s >>= 1u) {
        if (lane < s) {
            part[lane] += part[lane + s];
        }
        barrier();
    }
    if (lane == 0u) {
        emit(part[0], g, i, 0u, split);
    }
}
