// Matrix-vector product (N = 1; M = 1 is handled by the host as the transposed
// product). One workgroup per output row: LANES threads stride over K, then fold their
// partial sums in shared memory in a fixed order. LANES (a power of two, 4..=256) is
// pipeline-overridable so the host's tuning table can match it to the adapter.
override LANES: u32 = 64u;

var<workgroup> part: array<f32, LANES>;

@compute @workgroup_size(LANES)
fn main(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_id) lid: vec3<u32>) {
    let g = wg.z / P.splits;
    let split = wg.z % P.splits;
    let i = P.row_base + wg.y;
    let k_begin = split * P.k_chunk;
    let k_end = min(P.k, k_begin + P.k_chunk);
    var acc = 0.0;
    if (i < P.m) {
        for (var kk = k_begin + lid.x; kk < k_end; kk += LANES) {
            acc = fma(a_at(a_index(g, i, kk)), b_at(b_index(g, kk, 0u)), acc);
        }
    }
    part[lid.x] = acc;
    workgroupBarrier();
    for (var s = LANES / 2u; s > 0u; s >>= 1u) {
        if (lid.x < s) {
            part[lid.x] += part[lid.x + s];
        }
        workgroupBarrier();
    }
    if (lid.x == 0u && i < P.m && wg.y < P.rows) {
        emit(part[0], g, i, 0u, split);
    }
}
