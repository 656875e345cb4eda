// Fused softmax + cross-entropy, forward: ROW_LANES invocations per row of `vocab` (P.u0) logits.
// max and sum of exp(l - max) in f32 (the max starts at the lowest finite f32, so a
// row of -inf gives no NaN from inf - inf), lse = max + log(sum),
// loss = lse - logits[target]. IGNORE_TARGET gives loss 0; any other target outside the
// vocabulary gives a NaN loss. Only the first P.classes columns are classes: the rest
// pad the row (a padded vocabulary) and stay out of the softmax; a target among them is
// outside the vocabulary too.
// P.n = rows. Slot: logits (read). targets (u32), losses and lse (f32) per row.
const IGNORE_TARGET: u32 = 0xffffffffu;

@group(0) @binding(2) var<storage, read> targets: array<u32>;
@group(0) @binding(3) var<storage, read_write> losses: array<f32>;
@group(0) @binding(4) var<storage, read_write> lse: array<f32>;

@compute @workgroup_size(256)
fn main(
    @builtin(local_invocation_id) lid3: vec3<u32>,
    @builtin(workgroup_id) wg: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>,
) {
    let lid = lid3.x;
    let slot = row_slot(lid, wg, nwg, P.n);
    let row = slot.row;
    let vocab = P.u0;
    let classes = P.classes;
    let len = row_len(slot, classes);
    let base = row * vocab;
    var m = -3.4028235e38;
    for (var j = slot.lane; j < len; j += ROW_LANES) {
        m = max(m, logits_at(base + j));
    }
    m = row_max(lid, m);
    var acc = 0.0;
    for (var j = slot.lane; j < len; j += ROW_LANES) {
        acc += exp(logits_at(base + j) - m);
    }
    acc = row_sum(lid, acc);
    if (row_writer(slot)) {
        let z = m + log(acc);
        lse[row] = z;
        let t = targets[row];
        let loss = select(bitcast<f32>(0x7fc00000u), z - logits_at(base + min(t, classes - 1u)), t < classes);
        losses[row] = select(loss, 0.0, t == IGNORE_TARGET);
    }
}
