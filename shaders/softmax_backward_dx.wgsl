// Softmax backward, pass 2: dx = s * p * (dout - dot[row]), two elements per step.
// P.n = elements, P.words = pairs, P.alpha = s, P.u0 = cols.
// Slots: p, dout (read), dx (write). stats from pass 1.
@group(0) @binding(4) var<storage, read> stats: array<f32>;

fn one(e: u32, p: f32, d: f32) -> f32 {
    return P.alpha * p * (d - stats[2u * (e / P.u0)]);
}

@compute @workgroup_size(256)
fn main(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let stride = nwg.x * 256u;
    for (var w = gid.x; w < P.words; w += stride) {
        let p = p_load(w);
        let d = dout_load(w);
        let e = 2u * w;
        let hi = select(0.0, one(min(e + 1u, P.n - 1u), p.y, d.y), e + 1u < P.n);
        dx_store(w, vec2<f32>(one(e, p.x, d.x), hi));
    }
}
