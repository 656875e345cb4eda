// RMS-norm backward, pass 2: dx = rstd * (dy * w - xhat * m), xhat = x * rstd, m from
// pass 1; two elements per step. P.n = elements, P.words = pairs, P.u0 = cols.
// Slots: x, weight, dout (read), dx (write); rstd, stats (f32 per row).
@group(0) @binding(5) var<storage, read> rstd: array<f32>;
@group(0) @binding(6) var<storage, read> stats: array<f32>;

fn one(e: u32, x: f32, dy: f32) -> f32 {
    let row = e / P.u0;
    let r = rstd[row];
    return r * (dy * weight_at(e % P.u0) - x * r * stats[row]);
}

@compute @workgroup_size(256)
fn main(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let stride = nwg.x * 256u;
    for (var w = gid.x; w < P.words; w += stride) {
        let x = x_load(w);
        let dy = dout_load(w);
        let e = 2u * w;
        let hi = select(0.0, one(min(e + 1u, P.n - 1u), x.y, dy.y), e + 1u < P.n);
        dx_store(w, vec2<f32>(one(e, x.x, dy.x), hi));
    }
}
