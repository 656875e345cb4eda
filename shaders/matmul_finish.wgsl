// Completes a GEMM whose kernel wrote f32 partials (PARTIAL): sums the `splits` slabs,
// applies the epilogue and stores C two elements (one 16-bit word) per step, so packed
// f16/bf16 outputs of any shape are written without two invocations sharing a word.
// Slot `a` holds the partials here. Elements of C between batch strides keep their value.
@compute @workgroup_size(256)
fn main(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let stride = nwg.x * 256u;
    let mn = P.m * P.n;
    for (var w = gid.x; w < P.words; w += stride) {
        var out = c_load(w);
        for (var h = 0u; h < 2u; h++) {
            let e = 2u * w + h;
            let g = e / P.stride_c;
            let r = e % P.stride_c;
            if (g < P.batch && r < mn) {
                var acc = 0.0;
                for (var s = 0u; s < P.splits; s++) {
                    acc += a_at(s * P.total + g * mn + r);
                }
                let v = finish(acc, e, r % P.n);
                out[h] = v;
                if (COPY_F32) {
                    cf_put(e, v);
                }
            }
        }
        c_store(w, out);
    }
}
