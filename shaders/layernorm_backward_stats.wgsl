// Layer-norm backward, pass 1: per row, a = mean(dy * w) and b = mean(dy * w * xhat)
// into stats[2 row], stats[2 row + 1]. P.n = rows, P.u0 = cols.
// Slots: x, weight, dout (read); mean, rstd (f32 per row); stats (f32, 2 per row).
@group(0) @binding(4) var<storage, read> mean: array<f32>;
@group(0) @binding(5) var<storage, read> rstd: array<f32>;
@group(0) @binding(6) var<storage, read_write> stats: array<f32>;

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
    let m = mean[min(row, P.n - 1u)];
    let r = rstd[min(row, P.n - 1u)];
    var a = 0.0;
    var b = 0.0;
    for (var c = slot.lane; c < len; c += ROW_LANES) {
        let dyw = dout_at(base + c) * weight_at(c);
        a += dyw;
        b += dyw * (x_at(base + c) - m) * r;
    }
    a = row_sum(lid, a);
    b = row_sum(lid, b);
    if (row_writer(slot)) {
        stats[2u * row] = a / f32(cols);
        stats[2u * row + 1u] = b / f32(cols);
    }
}
