// Rotary position embedding ("rotate half", forward) with each row's position read
// from `positions`: generation records the launch once and uploads the positions.
// Two elements per step; dim is even, so a 32-bit word never straddles a head.
// Slots: x (read), out (write); positions (u32).
@group(0) @binding(3) var<storage, read> positions: array<u32>;

// Output element e, whose input value is v.
fn one(e: u32, v: f32) -> f32 {
    let t = f32(positions[e / P.cols]);
    let c = e % P.dim;
    let half = P.dim / 2u;
    let lower = c < half;
    let cs = rope_cos_sin(t, select(c - half, c, lower));
    let p = x_at(select(e - half, e + half, lower));
    return v * cs.x + select(p, -p, lower) * cs.y;
}

@compute @workgroup_size(256)
fn main(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let stride = nwg.x * 256u;
    for (var w = gid.x; w < P.words; w += stride) {
        let v = x_load(w);
        let e = 2u * w;
        out_store(w, vec2<f32>(one(e, v.x), one(e + 1u, v.y)));
    }
}
