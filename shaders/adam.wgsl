// One Adam / AdamW step over flat buffers, two elements per iteration, all in f32.
// Slots: master (f32, rw), grads (read), m, v (f32, rw), params (rw; written when
// WRITE_PARAMS), then grad_scale: the factor that unscales and clips the gradients.
override DECOUPLED: bool = true;
override WRITE_PARAMS: bool = false;

@group(0) @binding(6) var<storage, read> grad_scale: array<f32>;

@compute @workgroup_size(256)
fn main(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let s = grad_scale[0];
    let stride = nwg.x * 256u;
    for (var w = gid.x; w < P.words; w += stride) {
        var p = master_load(w);
        var g = grads_load(w) * s;
        if (!DECOUPLED) {
            g += P.weight_decay * p;
        }
        let m = P.beta1 * m_load(w) + (1.0 - P.beta1) * g;
        let v = P.beta2 * v_load(w) + (1.0 - P.beta2) * g * g;
        if (DECOUPLED) {
            p -= P.lr * P.weight_decay * p;
        }
        p -= P.lr * (m / P.bias1) / (sqrt(v / P.bias2) + P.eps);
        m_store(w, m);
        v_store(w, v);
        master_store(w, p);
        if (WRITE_PARAMS) {
            params_store(w, p);
        }
    }
}
