// Layer norm, pass 1: ROW_LANES invocations reduce each row of `cols` (P.u0) elements to its
// mean and rstd = 1 / sqrt(var + eps) (P.alpha), in f32 with the two-pass variance
// (mean first, then squared deviations: no cancellation). P.n = rows.
// Slot: x (read). mean, rstd: f32 per row.
@group(0) @binding(2) var<storage, read_write> mean: array<f32>;
@group(0) @binding(3) var<storage, read_write> rstd: array<f32>;

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
        acc += x_at(base + c);
    }
    let m = row_sum(lid, acc) / f32(cols);
    acc = 0.0;
    for (var c = slot.lane; c < len; c += ROW_LANES) {
        let d = x_at(base + c) - m;
        acc += d * d;
    }
    let var_ = row_sum(lid, acc) / f32(cols);
    if (row_writer(slot)) {
        mean[row] = m;
        rstd[row] = inverseSqrt(var_ + P.alpha);
    }
}
