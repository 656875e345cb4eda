// Launch parameters of the fused attention kernels (32 bytes). Tensors are
// (heads, seq, DIM) row-major: q, out, dout, dq over the query heads, k, v, dk, dv over
// the K/V heads, query head h reading K/V head h / group. A dispatch covers row blocks
// [block_base, block_base + num_workgroups.x) of every head it walks (workgroup_id.y +
// workgroup_id.z * num_workgroups.y): the query heads forward and for dq, the K/V heads
// for dk and dv.
struct Params {
    // Heads the dispatch walks.
    heads: u32,
    seq: u32,
    block_base: u32,
    // 1: query row i sees keys j <= i only (a launch parameter, not a pipeline
    // constant: the unrolled kernels take seconds to compile on lavapipe).
    causal: u32,
    // The softmax scale, and the same times log2(e): scores are kept in base 2.
    scale: f32,
    scale2: f32,
    // Query heads per K/V head (1: multi-head attention). A launch parameter too.
    group: u32,
    // Packed sequences: the query heads of each sequence, whose rows' document starts
    // the kernel's `starts` binding holds; 0: one document per sequence (the binding
    // is then some other buffer, never read).
    docs: u32,
}
@group(0) @binding(0) var<uniform> P: Params;

// The first row of row `row`'s document in query head `head`'s sequence (0 without
// documents). Within a sequence it never decreases, and it is at most `row`.
fn doc_start(head: u32, row: u32) -> u32 {
    if (P.docs == 0u) {
        return 0u;
    }
    return starts[(head / P.docs) * P.seq + min(row, P.seq - 1u)];
}

// Lower than any score, yet finite: `NEG - m` and `exp2` of it stay well defined.
fn causal() -> bool {
    return P.causal != 0u;
}

const NEG: f32 = -3.4028235e38;
const LN2: f32 = 0.6931471805599453;
const LOG2E: f32 = 1.4426950408889634;

// 1 in the lanes of column group `c` that are real columns (< DIM), 0 in the padding.
fn live(c: u32) -> vec4<bool> {
    return vec4<u32>(4u * c) + vec4<u32>(0u, 1u, 2u, 3u) < vec4<u32>(DIM);
}

// The head and the first row of a workgroup's block of WG * R rows; `ok` is false past
// the last head (a whole workgroup, so no lane of a subgroup leaves early alone).
struct Place {
    head: u32,
    first: u32,
    ok: bool,
}

fn place(wg: vec3<u32>, nwg: vec3<u32>) -> Place {
    let head = wg.y + wg.z * nwg.y;
    return Place(head, (P.block_base + wg.x) * (WG * R), head < P.heads);
}
