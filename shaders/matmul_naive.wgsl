// Baseline GEMM: one output per invocation, every operand read straight from storage.
// Kept as the reference row in `kiln bench matmul`, not used for training.
@compute @workgroup_size(8, 8)
fn main(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(workgroup_id) wg: vec3<u32>) {
    let i = P.row_base + gid.y;
    let j = gid.x;
    let g = wg.z;
    if (i >= P.m || j >= P.n || gid.y >= P.rows) {
        return;
    }
    var acc = 0.0;
    for (var kk = 0u; kk < P.k; kk++) {
        acc = fma(a_at(a_index(g, i, kk)), b_at(b_index(g, kk, j)), acc);
    }
    emit(acc, g, i, j, 0u);
}
