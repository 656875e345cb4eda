// RMS-norm backward, pass 1: per row m = mean(dy * w * xhat) (xhat = x * rstd) into
// stats[row], summed in f32. P.n = rows, P.u0 = cols.
// Slots: x, weight, dout (read); rstd (f32 per row); stats (f32 per row).
@group(0) @binding(4) var<storage, read> rstd: array<f32>;
@group(0) @binding(5) var<storage, read_write> stats: array<f32>;

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
    for (var c = slot.lane; c < len; c += ROW_LANES) {
        acc += dout_at(base + c) * weight_at(c) * x_at(base + c);
    }
    // rstd is a common factor of the row: applied once, after the sum.
    acc = row_sum(lid, acc);
    if (row_writer(slot)) {
        stats[row] = acc * rstd[row] / f32(cols);
    }
}
