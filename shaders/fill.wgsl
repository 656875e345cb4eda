// dst[w] = pattern, over every 32-bit word of the buffer (padding included).
// The host builds the pattern: an f32's bits, a 16-bit value twice, or a u32.
@group(0) @binding(1) var<storage, read_write> dst: array<u32>;

@compute @workgroup_size(256)
fn main(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let stride = nwg.x * 256u;
    for (var w = gid.x; w < P.words; w += stride) {
        dst[w] = P.u0;
    }
}
