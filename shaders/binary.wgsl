// out = a (OP) b elementwise, in f32. OP: 0 add, 1 mul.
// Slots: a (read), b (read), out (write).
override OP: u32 = 0u;

@compute @workgroup_size(256)
fn main(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let stride = nwg.x * 256u;
    for (var w = gid.x; w < P.words; w += stride) {
        let x = a_load(w);
        let y = b_load(w);
        if (OP == 0u) {
            out_store(w, x + y);
        } else {
            out_store(w, x * y);
        }
    }
}
