// Mean squared error, backward: dpred = (pred - target) * factor, factor = 2 scale / cols
// rounded to f32 on the host (P.alpha), elementwise. Slots: pred, target (read), dpred
// (write).
@compute @workgroup_size(256)
fn main(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let stride = nwg.x * 256u;
    for (var w = gid.x; w < P.words; w += stride) {
        dpred_store(w, (pred_load(w) - target_load(w)) * P.alpha);
    }
}
