// Attention of one new query row and head over the cache rows 0..=positions[row], one
// workgroup per (row, head): keys are scored a tile of LANES at a time (one key per
// lane, the query in workgroup memory), then every lane folds the tile into the
// online-softmax recurrence (running max and sum, f32) for its two output dims
// (2 lane, 2 lane + 1: with a 16-bit out and an even dim one lane owns each 32-bit word).
// A position at or past max_len gives a NaN row.
// Slots: q, k, v (read), out (write); positions (u32).
@group(0) @binding(5) var<storage, read> positions: array<u32>;

const LANES: u32 = 64u;
var<workgroup> query: array<f32, 128>;
var<workgroup> scores: array<f32, 64>;
var<workgroup> position: u32;

@compute @workgroup_size(64)
fn main(@builtin(workgroup_id) wg: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
        @builtin(local_invocation_index) lane: u32) {
    let item = wg.x + wg.y * nwg.x;
    if (item >= P.n) {
        return;
    }
    let r = item / P.heads;
    let h = item % P.heads;
    let b = r / P.rows_per_seq;
    let base = ((b * P.kv_heads + h / P.group) * P.max_len) * P.dim;
    let obase = item * P.dim;
    let i0 = 2u * lane;
    let i1 = i0 + 1u;
    if (lane == 0u) {
        position = positions[r];
    }
    let t = workgroupUniformLoad(&position);
    if (t >= P.max_len) {
        let nan = bitcast<f32>(0x7fc00000u);
        if (i0 < P.dim) {
            out_put(obase + i0, nan);
        }
        if (i1 < P.dim) {
            out_put(obase + i1, nan);
        }
        return;
    }
    let qbase = r * P.width + P.offset + h * P.dim;
    if (i0 < P.dim) {
        query[i0] = q_at(qbase + i0);
    }
    if (i1 < P.dim) {
        query[i1] = q_at(qbase + i1);
    }
    workgroupBarrier();
    let keys = t + 1u;
    // A finite start, so that the first rescale is exp(-huge) = 0, never inf - inf.
    var m = -3.0e38;
    var l = 0.0;
    var acc0 = 0.0;
    var acc1 = 0.0;
    for (var j0 = 0u; j0 < keys; j0 += LANES) {
        let j = j0 + lane;
        var s = -3.0e38;
        if (j < keys) {
            var dot = 0.0;
            let kb = base + j * P.dim;
            for (var i = 0u; i < P.dim; i++) {
                dot += query[i] * k_at(kb + i);
            }
            s = dot * P.scale;
        }
        scores[lane] = s;
        workgroupBarrier();
        let count = min(LANES, keys - j0);
        var top = m;
        for (var u = 0u; u < count; u++) {
            top = max(top, scores[u]);
        }
        let rescale = exp(m - top);
        l *= rescale;
        acc0 *= rescale;
        acc1 *= rescale;
        for (var u = 0u; u < count; u++) {
            let p = exp(scores[u] - top);
            l += p;
            let vb = base + (j0 + u) * P.dim;
            if (i0 < P.dim) {
                acc0 += p * v_at(vb + i0);
            }
            if (i1 < P.dim) {
                acc1 += p * v_at(vb + i1);
            }
        }
        m = top;
        workgroupBarrier();
    }
    if (i0 < P.dim) {
        out_put(obase + i0, acc0 / l);
    }
    if (i1 < P.dim) {
        out_put(obase + i1, acc1 / l);
    }
}
