// Dropout, forward and backward alike (backward recomputes the forward's mask from the
// same seed): out = x * scale where the element is kept, else +0; one f32 product,
// rounded on store. Slots: x (read), out (write); dout and dx for the backward.
@compute @workgroup_size(256)
fn main(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let stride = nwg.x * 256u;
    for (var w = gid.x; w < P.words; w += stride) {
        let x = x_load(w);
        let e = 2u * w;
        let lo = select(0.0, x.x * P.scale, dropout_kept(e));
        let hi = select(0.0, x.y * P.scale, dropout_kept(e + 1u));
        out_store(w, vec2<f32>(lo, hi));
    }
}
