// dst[b][h][t][i] = src[(b, t)][offset + h dim + i], two destination elements per step.
// Slots: src (read, rows), dst (write, heads).
@compute @workgroup_size(256)
fn main(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let stride = nwg.x * 256u;
    for (var w = gid.x; w < P.words; w += stride) {
        let e = 2u * w;
        let lo = src_at(row_index(e));
        let hi = select(0.0, src_at(row_index(min(e + 1u, P.n - 1u))), e + 1u < P.n);
        dst_store(w, vec2<f32>(lo, hi));
    }
}
