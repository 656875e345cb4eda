// dst = src converted between float dtypes (widen to f32, round to nearest-even on store).
// Slots: src (read), dst (write).
@compute @workgroup_size(256)
fn main(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let stride = nwg.x * 256u;
    for (var w = gid.x; w < P.words; w += stride) {
        dst_store(w, src_load(w));
    }
}
