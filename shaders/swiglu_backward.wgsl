// SwiGLU backward, both gradients in one pass: dgate = dout * up * silu'(gate),
// dup = dout * silu(gate), elementwise. Slots: gate, up, dout (read), dgate, dup (write).
@compute @workgroup_size(256)
fn main(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let stride = nwg.x * 256u;
    for (var w = gid.x; w < P.words; w += stride) {
        let g = gate_load(w);
        let dy = dout_load(w);
        let lo = swiglu_silu_and_grad(g.x);
        let hi = swiglu_silu_and_grad(g.y);
        dgate_store(w, dy * up_load(w) * vec2<f32>(lo.y, hi.y));
        dup_store(w, dy * vec2<f32>(lo.x, hi.x));
    }
}
