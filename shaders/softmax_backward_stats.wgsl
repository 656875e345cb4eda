// Softmax backward, pass 1: per row, dot = sum_j p_j dout_j (f32) into stats[2 row].
// P.n = rows, P.u0 = cols. Slots: p, dout (read). stats: f32, 2 per row.
@group(0) @binding(3) var<storage, read_write> stats: array<f32>;

@compute @workgroup_size(256)
fn main(
    @builtin(local_invocation_id) lid3: vec3<u32>,
    @builtin(workgroup_id) wg: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>,
) {
    let lid = lid3.x;
    let row = wg.x + wg.y * nwg.x;
    if (row >= P.n) {
        return;
    }
    let base = row * P.u0;
    var acc = 0.0;
    for (var j = lid; j < P.u0; j += 256u) {
        acc += p_at(base + j) * dout_at(base + j);
    }
    acc = row_sum(lid, acc);
    if (lid == 0u) {
        stats[2u * row] = acc;
    }
}
