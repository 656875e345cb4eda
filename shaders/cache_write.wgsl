// cache[b][h][positions[r]][i] = src[r][offset + h dim + i]: element pairs (e, e + 1) of
// the new rows' (rows, heads, dim) layout per invocation. With a 16-bit cache dim is
// even, so both elements land in one 32-bit word that only this invocation writes.
// A position at or past max_len writes nothing.
// Slots: src (read), cache (write); positions (u32).
@group(0) @binding(3) var<storage, read> positions: array<u32>;

fn one(e: u32) {
    let span = P.heads * P.dim;
    let r = e / span;
    let h = (e % span) / P.dim;
    let i = e % P.dim;
    let t = positions[r];
    if (t < P.max_len) {
        let b = r / P.rows_per_seq;
        let dst = ((b * P.kv_heads + h) * P.max_len + t) * P.dim + i;
        cache_put(dst, src_at(r * P.width + P.offset + h * P.dim + i));
    }
}

@compute @workgroup_size(256)
fn main(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let stride = nwg.x * 256u;
    for (var w = gid.x; w < P.n; w += stride) {
        one(2u * w);
        if (2u * w + 1u < P.total) {
            one(2u * w + 1u);
        }
    }
}
