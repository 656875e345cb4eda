// Rotary position embedding ("rotate half"): in each head of `dim` values, pair (i,
// i + dim/2) of the row at position t turns by a = t * theta^(-2i / dim), rescaled per
// band for Llama 3 (rope_angle.wgsl), or by -a when P.sign is -1 (the backward pass).
// Two elements per step; dim is even, so a 32-bit word of 16-bit values never straddles
// a head. Slots: x (read), out (write).

// Output element e, whose input value is v.
fn one(e: u32, v: f32) -> f32 {
    let t = f32((e / P.cols) % P.seq);
    // cols is whole heads, so e's place in its head is e % dim.
    let c = e % P.dim;
    let half = P.dim / 2u;
    let lower = c < half;
    let cs = rope_cos_sin(t, select(c - half, c, lower));
    // Lower half: v cos - x[e + half] sin; upper half: v cos + x[e - half] sin.
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
