// Softmax, pass 2: out = exp(s x - max) / sum for visible columns, 0 for masked ones,
// two elements per step over the flat buffer. P.n = elements, P.words = pairs,
// P.alpha = s, P.u0 = cols. Slots: x (read), out (write). stats from pass 1.
override CAUSAL: bool = false;

@group(0) @binding(3) var<storage, read> stats: array<f32>;

fn one(e: u32, x: f32) -> f32 {
    let row = e / P.u0;
    let j = e % P.u0;
    let visible = !CAUSAL || j <= row % P.u0;
    return select(0.0, exp(P.alpha * x - stats[2u * row]) / stats[2u * row + 1u], visible);
}

@compute @workgroup_size(256)
fn main(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let stride = nwg.x * 256u;
    for (var w = gid.x; w < P.words; w += stride) {
        let x = x_load(w);
        let e = 2u * w;
        let hi = select(0.0, one(min(e + 1u, P.n - 1u), x.y), e + 1u < P.n);
        out_store(w, vec2<f32>(one(e, x.x), hi));
    }
}
