// y = alpha * x + y, in f32. Slots: x (read), y (read_write).
@compute @workgroup_size(256)
fn main(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let stride = nwg.x * 256u;
    for (var w = gid.x; w < P.words; w += stride) {
        y_store(w, P.alpha * x_load(w) + y_load(w));
    }
}
