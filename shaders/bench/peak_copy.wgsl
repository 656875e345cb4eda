// `kiln bench peak`: memory bandwidth. A plain copy of vec4s, one per invocation: each
// element is read once and written once.

@group(0) @binding(0) var<storage, read> src: array<vec4<f32>>;
@group(0) @binding(1) var<storage, read_write> dst: array<vec4<f32>>;

@compute @workgroup_size(64)
fn main(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) groups: vec3<u32>) {
    let i = gid.x + gid.y * groups.x * 64u;
    if i < arrayLength(&dst) {
        dst[i] = src[i];
    }
}
