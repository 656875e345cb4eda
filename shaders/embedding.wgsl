// out[i] = table[tokens[i]], rows of `dim` (P.u0), two elements per step over the flat
// output. A token past the table's `rows` (P.alpha's bits) gives NaN.
// P.n = output elements, P.words = pairs. Slots: table (read), out (write); tokens (u32).
@group(0) @binding(3) var<storage, read> tokens: array<u32>;

fn one(e: u32) -> f32 {
    let tok = tokens[e / P.u0];
    let rows = bitcast<u32>(P.alpha);
    let v = table_at(min(tok, rows - 1u) * P.u0 + e % P.u0);
    return select(bitcast<f32>(0x7fc00000u), v, tok < rows);
}

@compute @workgroup_size(256)
fn main(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let stride = nwg.x * 256u;
    for (var w = gid.x; w < P.words; w += stride) {
        let e = 2u * w;
        let hi = select(0.0, one(min(e + 1u, P.n - 1u)), e + 1u < P.n);
        out_store(w, vec2<f32>(one(e), hi));
    }
}
