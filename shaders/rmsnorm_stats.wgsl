// RMS norm, pass 1: ROW_LANES invocations reduce each row of `cols` (P.u0) elements to
// rstd = 1 / sqrt(mean(x^2) + eps) (eps: P.alpha), the sum of squares in f32 (no
// cancellation: every term is positive). P.n = rows.
// Slot: x (read). rstd: f32 per row.
@group(0) @binding(2) var<storage, read_write> rstd: array<f32>;

@compute @workgroup_size(256)
fn main(
    @builtin(local_invocation_id) lid3: vec3<u32>,
    @builtin(workgroup_id) wg: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>,
) {
    let lid = lid3.x;
    let slot = row_slot(lid, wg, nwg, P.n);
    let cols = P.u0;
    let len = row_len(slot, cols);
    let base = slot.row * cols;
    var acc = 0.0;
    for (var c = slot.lane; c < len; c += ROW_LANES) {
        let v = x_at(base + c);
        acc += v * v;
    }
    let ms = row_sum(lid, acc) / f32(cols);
    if (row_writer(slot)) {
        rstd[slot.row] = inverseSqrt(ms + P.alpha);
    }
}
