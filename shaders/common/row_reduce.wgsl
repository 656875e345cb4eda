// Row reductions for kernels that give each row ROW_LANES invocations of a 256-wide
// workgroup, so a workgroup covers 256 / ROW_LANES rows. ROW_LANES = 1: one invocation
// walks a whole row and nothing is shared, no barriers (CPU adapters such as lavapipe,
// where a barrier switches between all the workgroup's invocations); 32 or 256: the
// row's lanes add up through workgroup memory (GPUs, long rows). A power of two <= 256.
override ROW_LANES: u32 = 256u;
var<workgroup> row_part: array<f32, 256>;

struct RowSlot {
    row: u32,
    lane: u32,
    // Rows past the end still run (every invocation must reach the barriers) but
    // read and write nothing.
    valid: bool,
}

fn row_slot(lid: u32, wg: vec3<u32>, nwg: vec3<u32>, rows: u32) -> RowSlot {
    let row = (wg.x + wg.y * nwg.x) * (256u / ROW_LANES) + lid / ROW_LANES;
    return RowSlot(row, lid % ROW_LANES, row < rows);
}

// Elements of a row this slot walks: `len` for a real row, none past the end.
fn row_len(slot: RowSlot, len: u32) -> u32 {
    return select(0u, len, slot.valid);
}

// The first lane of each row stores the row's results.
fn row_writer(slot: RowSlot) -> bool {
    return slot.valid && slot.lane == 0u;
}

fn row_sum(lid: u32, v: f32) -> f32 {
    if (ROW_LANES == 1u) {
        return v;
    }
    let lane = lid % ROW_LANES;
    row_part[lid] = v;
    workgroupBarrier();
    for (var s = ROW_LANES / 2u; s > 0u; s >>= 1u) {
        if (lane < s) {
            row_part[lid] += row_part[lid + s];
        }
        workgroupBarrier();
    }
    let total = row_part[lid - lane];
    workgroupBarrier();
    return total;
}

fn row_max(lid: u32, v: f32) -> f32 {
    if (ROW_LANES == 1u) {
        return v;
    }
    let lane = lid % ROW_LANES;
    row_part[lid] = v;
    workgroupBarrier();
    for (var s = ROW_LANES / 2u; s > 0u; s >>= 1u) {
        if (lane < s) {
            row_part[lid] = max(row_part[lid], row_part[lid + s]);
        }
        workgroupBarrier();
    }
    let total = row_part[lid - lane];
    workgroupBarrier();
    return total;
}
