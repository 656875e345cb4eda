// out = f(x), elementwise, f picked by KIND (common/activation.wgsl). Slots: x (read),
// out (write).
@compute @workgroup_size(256)
fn main(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let stride = nwg.x * 256u;
    for (var w = gid.x; w < P.words; w += stride) {
        let x = x_load(w);
        out_store(w, vec2<f32>(act(x.x), act(x.y)));
    }
}
