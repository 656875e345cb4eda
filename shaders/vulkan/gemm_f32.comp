// C = A * B for row-major f32 matrices (M x K times K x N), one 16 x 16 tile of C per
// workgroup, A and B staged through shared memory in 16-wide steps of K.
// The first hand-written GLSL kernel of Kiln's raw Vulkan backend (issue 13); compiled
// by scripts/compile-vulkan-shaders.sh to gemm_f32.spv, which is committed.
#version 450

layout(local_size_x = 16, local_size_y = 16) in;

layout(set = 0, binding = 0) readonly buffer A { float a[]; };
layout(set = 0, binding = 1) readonly buffer B { float b[]; };
layout(set = 0, binding = 2) writeonly buffer C { float c[]; };

layout(push_constant) uniform Params {
    uint m;
    uint n;
    uint k;
} p;

shared float tile_a[16][16];
shared float tile_b[16][16];

void main() {
    uint row = gl_GlobalInvocationID.y;
    uint col = gl_GlobalInvocationID.x;
    uint ly = gl_LocalInvocationID.y;
    uint lx = gl_LocalInvocationID.x;
    float acc = 0.0;
    for (uint t = 0u; t < p.k; t += 16u) {
        // Out-of-range elements load as zero, so edge tiles need no other care.
        tile_a[ly][lx] = (row < p.m && t + lx < p.k) ? a[row * p.k + t + lx] : 0.0;
        tile_b[ly][lx] = (t + ly < p.k && col < p.n) ? b[(t + ly) * p.n + col] : 0.0;
        barrier();
        for (uint i = 0u; i < 16u; i++) {
            acc += tile_a[ly][i] * tile_b[i][lx];
        }
        barrier();
    }
    if (row < p.m && col < p.n) {
        c[row * p.n + col] = acc;
    }
}
