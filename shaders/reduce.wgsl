// One pass of a sum or max reduction in f32. OP: 0 sum, 1 max. SQUARE squares each
// input first (the first pass of a sum of squares; the second pass sums partials).
// Each workgroup folds a grid-strided share of `src` and writes one partial to
// dst[workgroup]; the host runs it twice (data -> partials -> result) so the
// order of additions is fixed and results are reproducible run to run.
// Slot: src (read). dst is f32 words.
override OP: u32 = 0u;
override SQUARE: bool = false;

@group(0) @binding(2) var<storage, read_write> dst: array<f32>;

var<workgroup> part: array<f32, 256>;

fn combine(a: f32, b: f32) -> f32 {
    if (OP == 0u) {
        return a + b;
    }
    return max(a, b);
}

@compute @workgroup_size(256)
fn main(
    @builtin(local_invocation_id) lid: vec3<u32>,
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>,
) {
    // Identity: 0 for sum, -inf for max.
    var acc = select(0.0, bitcast<f32>(0xff800000u), OP == 1u);
    let stride = nwg.x * 256u;
    for (var w = wid.x * 256u + lid.x; w < P.words; w += stride) {
        var v = src_load(w);
        if (SQUARE) {
            v *= v;
        }
        acc = combine(acc, v.x);
        // The odd tail's second lane is padding, not data.
        if (2u * w + 1u < P.n) {
            acc = combine(acc, v.y);
        }
    }
    part[lid.x] = acc;
    workgroupBarrier();
    for (var s = 128u; s > 0u; s >>= 1u) {
        if (lid.x < s) {
            part[lid.x] = combine(part[lid.x], part[lid.x + s]);
        }
        workgroupBarrier();
    }
    if (lid.x == 0u) {
        dst[wid.x] = part[0];
    }
}
