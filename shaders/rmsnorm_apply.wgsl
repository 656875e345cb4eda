// RMS norm, pass 2: out = x * rstd[row] * weight[col], two elements per step over the
// flat buffer (rows of any length, any storage type).
// P.n = elements, P.words = pairs, P.u0 = cols.
// Slots: x, weight (read), out (write); rstd f32 per row.
@group(0) @binding(4) var<storage, read> rstd: array<f32>;

fn one(e: u32, x: f32) -> f32 {
    return x * rstd[e / P.u0] * weight_at(e % P.u0);
}

@compute @workgroup_size(256)
fn main(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let stride = nwg.x * 256u;
    for (var w = gid.x; w < P.words; w += stride) {
        let x = x_load(w);
        let e = 2u * w;
        // The pad element of an odd-length buffer has no row: leave it be.
        let hi = select(0.0, one(min(e + 1u, P.n - 1u), x.y), e + 1u < P.n);
        out_store(w, vec2<f32>(one(e, x.x), hi));
    }
}
