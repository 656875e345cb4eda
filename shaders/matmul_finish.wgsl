// Completes a GEMM whose kernel wrote f32 partials (PARTIAL): sums the `splits` slabs,
// applies the epilogue and stores C two elements (one 16-bit word) per step, so packed
// f16/bf16 outputs of any shape are written without two invocations sharing a word.
// Slot `a` holds the partials here. Words of C's binding are walked from its start;
// elements that are not outputs of this product (before base_c, between batch strides,
// past n in a row of ldc) keep their value.
@compute @workgroup_size(256)
fn main(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let stride = nwg.x * 256u;
    for (var w = gid.x; w < P.words; w += stride) {
        var out = c_load(w);
        for (var h = 0u; h < 2u; h++) {
            let e = 2u * w + h;
            if (e < P.base_c) {
                continue;
            }
            let rel = e - P.base_c;
            let g = rel / P.stride_c;
            let r = rel % P.stride_c;
            let i = r / P.ldc;
            let j = r % P.ldc;
            if (g < P.batch && i < P.m && j < P.n) {
                var acc = 0.0;
                for (var s = 0u; s < P.splits; s++) {
                    acc += a_at(s * P.total + (g * P.m + i) * P.n + j);
                }
                let v = finish(acc, e, j);
                out[h] = v;
                if (COPY_F32) {
                    cf_put(rel + P.base_cf, v);
                }
            }
        }
        c_store(w, out);
    }
}
