// Workgroup-wide reductions for one-workgroup-per-row kernels (256 invocations).
var<workgroup> row_part: array<f32, 256>;

fn row_sum(lid: u32, v: f32) -> f32 {
    row_part[lid] = v;
    workgroupBarrier();
    for (var s = 128u; s > 0u; s >>= 1u) {
        if (lid < s) {
            row_part[lid] += row_part[lid + s];
        }
        workgroupBarrier();
    }
    let total = row_part[0];
    workgroupBarrier();
    return total;
}

fn row_max(lid: u32, v: f32) -> f32 {
    row_part[lid] = v;
    workgroupBarrier();
    for (var s = 128u; s > 0u; s >>= 1u) {
        if (lid < s) {
            row_part[lid] = max(row_part[lid], row_part[lid + s]);
        }
        workgroupBarrier();
    }
    let total = row_part[0];
    workgroupBarrier();
    return total;
}
