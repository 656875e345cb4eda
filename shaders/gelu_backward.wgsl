// dx = dout * gelu'(x), elementwise. Slots: x, dout (read), dx (write).
@compute @workgroup_size(256)
fn main(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let stride = nwg.x * 256u;
    for (var w = gid.x; w < P.words; w += stride) {
        let x = x_load(w);
        dx_store(w, dout_load(w) * vec2<f32>(gelu_grad(x.x), gelu_grad(x.y)));
    }
}
