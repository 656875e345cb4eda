// RMS-norm backward, pass 3: one invocation per column sums over the rows
// dweight[col] += sum dy * x * rstd (accumulating, f32). P.n = rows, P.u0 = cols.
// Slots: x, dout (read); rstd (f32 per row); dweight (f32 per column).
@group(0) @binding(3) var<storage, read> rstd: array<f32>;
@group(0) @binding(4) var<storage, read_write> dweight: array<f32>;

@compute @workgroup_size(256)
fn main(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let stride = nwg.x * 256u;
    let cols = P.u0;
    for (var col = gid.x; col < cols; col += stride) {
        var dw = 0.0;
        for (var row = 0u; row < P.n; row++) {
            let e = row * cols + col;
            dw += dout_at(e) * x_at(e) * rstd[row];
        }
        dweight[col] += dw;
    }
}
