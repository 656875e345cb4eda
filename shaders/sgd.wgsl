// One SGD-with-momentum step over flat buffers (PyTorch's form, no dampening).
// Slots: master (f32, rw), grads (read), buf (f32 momentum, rw), params (rw; written
// when WRITE_PARAMS), then grad_scale.
override WRITE_PARAMS: bool = false;

@group(0) @binding(5) var<storage, read> grad_scale: array<f32>;

@compute @workgroup_size(256)
fn main(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let s = grad_scale[0];
    let stride = nwg.x * 256u;
    for (var w = gid.x; w < P.words; w += stride) {
        var p = master_load(w);
        let g = grads_load(w) * s + P.weight_decay * p;
        let b = P.momentum * buf_load(w) + g;
        p -= P.lr * b;
        buf_store(w, b);
        master_store(w, p);
        if (WRITE_PARAMS) {
            params_store(w, p);
        }
    }
}
