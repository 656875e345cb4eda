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
    let slot = row_slot(lid, wg, nwg, P.n);
    let row = slot.row;
    let len = row_len(slot, P.u0);
    let base = row * P.u0;
    var acc = 0.0;
    for (var j = slot.lane; j < len; j += ROW_LANES) {
        acc += p_at(base + j) * dout_at(base + j);
    }
    acc = row_sum(lid, acc);
    if (row_writer(slot)) {
        stats[2u * row] = acc;
    }
}
