// Softmax, pass 1: per row of `cols` (P.u0), the max and the sum of exp(s x - max) over
// the visible columns (all, or j <= row % cols when CAUSAL), in f32; s = P.alpha. The
// max starts at the lowest finite f32 so that no inf - inf appears. P.n = rows.
// Slot: x (read). stats: f32, (max, sum) per row.
override CAUSAL: bool = false;

@group(0) @binding(2) var<storage, read_write> stats: array<f32>;

@compute @workgroup_size(256)
fn main(
    @builtin(local_invocation_id) lid3: vec3<u32>,
    @builtin(workgroup_id) wg: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>,
) {
    let lid = lid3.x;
    let slot = row_slot(lid, wg, nwg, P.n);
    let row = slot.row;
    let cols = P.u0;
    let seen = row_len(slot, select(cols, row % cols + 1u, CAUSAL));
    let base = row * cols;
    var m = -3.4028235e38;
    for (var j = slot.lane; j < seen; j += ROW_LANES) {
        m = max(m, P.alpha * x_at(base + j));
    }
    m = row_max(lid, m);
    var z = 0.0;
    for (var j = slot.lane; j < seen; j += ROW_LANES) {
        z += exp(P.alpha * x_at(base + j) - m);
    }
    z = row_sum(lid, z);
    if (row_writer(slot)) {
        stats[2u * row] = m;
        stats[2u * row + 1u] = z;
    }
}
