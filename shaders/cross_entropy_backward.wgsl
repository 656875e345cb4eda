// Fused softmax + cross-entropy, backward: dlogits = (exp(l - lse[row]) - [j == target])
// * scale (P.alpha), 0 for rows whose target is IGNORE_TARGET (0xffffffff), two elements per step over the flat buffer (any vocabulary size,
// any storage type), and 0 for the padding columns from P.classes on (no part of the
// softmax). P.n = elements, P.words = pairs, P.u0 = vocab (the padded row length).
// Slots: logits (read), dlogits (write). targets (u32), lse (f32) per row.
@group(0) @binding(3) var<storage, read> targets: array<u32>;
@group(0) @binding(4) var<storage, read> lse: array<f32>;

fn one(e: u32, l: f32) -> f32 {
    let row = e / P.u0;
    let j = e % P.u0;
    let t = targets[row];
    let hot = select(0.0, 1.0, t == j);
    return select((exp(l - lse[row]) - hot) * P.alpha, 0.0, t == 0xffffffffu || j >= P.classes);
}

@compute @workgroup_size(256)
fn main(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let stride = nwg.x * 256u;
    for (var w = gid.x; w < P.words; w += stride) {
        let l = logits_load(w);
        let e = 2u * w;
        let hi = select(0.0, one(min(e + 1u, P.n - 1u), l.y), e + 1u < P.n);
        dlogits_store(w, vec2<f32>(one(e, l.x), hi));
    }
}
