// dx = dout * f'(x), elementwise, f picked by KIND (common/activation.wgsl). Slots: x,
// dout (read), dx (write).
@compute @workgroup_size(256)
fn main(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let stride = nwg.x * 256u;
    for (var w = gid.x; w < P.words; w += stride) {
        let x = x_load(w);
        let d = dout_load(w);
        dx_store(w, vec2<f32>(act_backward(x.x, d.x), act_backward(x.y, d.y)));
    }
}
