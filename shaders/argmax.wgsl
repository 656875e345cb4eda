// Row argmax: out[row] = the index of the largest of the first P.classes values of each
// row of P.u0 (the rest pad the row, as a padded vocabulary's columns do), the first of
// equal ones; NaN is never chosen and a row without a number gives 0. ROW_LANES
// invocations per row (common/row_reduce.wgsl) find the row's largest value, then the
// smallest index holding it. Indices travel through the f32 row reductions: exact,
// since the kernel's checks keep P.classes <= 2^24.
// P.n = rows. Slot: x (read). out: u32, one per row.
@group(0) @binding(2) var<storage, read_write> out: array<u32>;

const NO_INDEX: f32 = 16777216.0;

fn is_nan(v: f32) -> bool {
    return (bitcast<u32>(v) & 0x7fffffffu) > 0x7f800000u;
}

@compute @workgroup_size(256)
fn main(
    @builtin(local_invocation_id) lid3: vec3<u32>,
    @builtin(workgroup_id) wg: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>,
) {
    let lid = lid3.x;
    let slot = row_slot(lid, wg, nwg, P.n);
    let row = slot.row;
    let len = row_len(slot, P.classes);
    let base = row * P.u0;
    // The largest number, from the lowest finite f32: a row whose numbers are all
    // -inf finds none equal below and falls back to its first number, which is the
    // first of its (equal) maxima.
    var m = -3.4028235e38;
    for (var j = slot.lane; j < len; j += ROW_LANES) {
        let v = x_at(base + j);
        if (!is_nan(v) && v > m) {
            m = v;
        }
    }
    m = row_max(lid, m);
    // Each lane walks its columns in increasing order: its first hit is its smallest.
    var first = NO_INDEX;
    var first_number = NO_INDEX;
    for (var j = slot.lane; j < len; j += ROW_LANES) {
        let v = x_at(base + j);
        if (v == m && first == NO_INDEX) {
            first = f32(j);
        }
        if (!is_nan(v) && first_number == NO_INDEX) {
            first_number = f32(j);
        }
    }
    first = -row_max(lid, -first);
    first_number = -row_max(lid, -first_number);
    if (row_writer(slot)) {
        let pick = select(first, first_number, first == NO_INDEX);
        out[row] = select(u32(pick), 0u, pick == NO_INDEX);
    }
}
