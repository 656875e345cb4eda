// Mean squared error, forward: ROW_LANES invocations per row of `cols` (P.u0):
// losses[row] = sum (pred - target)^2 / cols, differences, squares and the sum in f32.
// P.n = rows. Slots: pred, target (read). losses: f32 per row.
@group(0) @binding(3) var<storage, read_write> losses: array<f32>;

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
    let len = row_len(slot, cols);
    let base = row * cols;
    var acc = 0.0;
    for (var j = slot.lane; j < len; j += ROW_LANES) {
        let d = pred_at(base + j) - target_at(base + j);
        acc += d * d;
    }
    acc = row_sum(lid, acc);
    if (row_writer(slot)) {
        losses[row] = acc / f32(cols);
    }
}
