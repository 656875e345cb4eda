// dst[(b, t)][offset + h dim + i] = src[b][h][t][i], walking the 32-bit words of the
// destination's column span (even, as are width and offset), so that no word is shared
// with a column outside it. P.words = rows * span / 2.
// Slots: src (read, heads), dst (write, rows).
@compute @workgroup_size(256)
fn main(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let stride = nwg.x * 256u;
    let span = P.heads * P.dim;
    for (var w = gid.x; w < P.words; w += stride) {
        let row = w / (span / 2u);
        let j = 2u * (w % (span / 2u));
        let b = row / P.seq;
        let t = row % P.seq;
        var v: vec2<f32>;
        for (var q = 0u; q < 2u; q++) {
            let h = (j + q) / P.dim;
            let i = (j + q) % P.dim;
            v[q] = src_at(((b * P.heads + h) * P.seq + t) * P.dim + i);
        }
        dst_store((row * P.width + P.offset + j) / 2u, v);
    }
}
