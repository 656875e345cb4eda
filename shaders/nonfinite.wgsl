// Sets flag[0] |= 1 if any element of src is inf or NaN. Tested on the exponent bits,
// not with comparisons, which a driver's fast-math may fold away.
// KIND: 0 f32 (one element per word), 1 f16, 2 bf16 (two elements per word).
override KIND: u32 = 0u;

@group(0) @binding(1) var<storage, read> src: array<u32>;
@group(0) @binding(2) var<storage, read_write> flag: array<atomic<u32>>;

@compute @workgroup_size(256)
fn main(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let stride = nwg.x * 256u;
    var bad = false;
    for (var w = gid.x; w < P.words; w += stride) {
        let b = src[w];
        if (KIND == 0u) {
            bad = bad || (w < P.n && (b & 0x7f800000u) == 0x7f800000u);
        } else {
            let m = select(0x7f80u, 0x7c00u, KIND == 1u);
            bad = bad || (b & m) == m || (2u * w + 1u < P.n && ((b >> 16u) & m) == m);
        }
    }
    if (bad) {
        atomicOr(&flag[0], 1u);
    }
}
