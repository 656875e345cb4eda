// dtable[tokens[i]] += dout[i]: one invocation per column walks the tokens in order, so
// repeated tokens accumulate without atomics and the result is deterministic.
// P.n = tokens, P.u0 = dim, P.words = the first row bound, P.alpha's bits = rows bound
// (a table over the binding limit is bound band by band; tokens outside the band are
// skipped, so are tokens past the table). Slots: dout (read); tokens (u32); dtable (f32,
// read_write).
@group(0) @binding(2) var<storage, read> tokens: array<u32>;
@group(0) @binding(3) var<storage, read_write> dtable: array<f32>;

@compute @workgroup_size(256)
fn main(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let stride = nwg.x * 256u;
    let dim = P.u0;
    let rows = bitcast<u32>(P.alpha);
    for (var c = gid.x; c < dim; c += stride) {
        for (var i = 0u; i < P.n; i++) {
            // Below the band the difference wraps past `rows`.
            let tok = tokens[i] - P.words;
            if (tok < rows) {
                dtable[tok * dim + c] += dout_at(i * dim + c);
            }
        }
    }
}
