// Layer-norm backward, pass 3: one invocation per column sums over the rows
// dweight[col] += sum dy * xhat and dbias[col] += sum dy (accumulating, f32).
// P.n = rows, P.u0 = cols.
// Slots: x, dout (read); mean, rstd (f32 per row); dweight, dbias (f32 per column).
@group(0) @binding(3) var<storage, read> mean: array<f32>;
@group(0) @binding(4) var<storage, read> rstd: array<f32>;
@group(0) @binding(5) var<storage, read_write> dweight: array<f32>;
@group(0) @binding(6) var<storage, read_write> dbias: array<f32>;

@compute @workgroup_size(256)
fn main(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let stride = nwg.x * 256u;
    let cols = P.u0;
    for (var col = gid.x; col < cols; col += stride) {
        var dw = 0.0;
        var db = 0.0;
        for (var row = 0u; row < P.n; row++) {
            let e = row * cols + col;
            let dy = dout_at(e);
            dw += dy * (x_at(e) - mean[row]) * rstd[row];
            db += dy;
        }
        dweight[col] += dw;
        dbias[col] += db;
    }
}
