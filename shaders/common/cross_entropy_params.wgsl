// Launch parameters of the fused cross-entropy (32 bytes): the elementwise four, then
// `classes`, the columns of a row that are classes; the rest of the row (up to u0, the
// padded vocabulary) is padding, out of the softmax and without gradient.
struct Params {
    n: u32,
    words: u32,
    alpha: f32,
    u0: u32,
    classes: u32,
    pad0: u32,
    pad1: u32,
    pad2: u32,
}
@group(0) @binding(0) var<uniform> P: Params;
