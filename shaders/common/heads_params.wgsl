// Launch parameters of split_heads / merge_heads (32 bytes).
//   n, words: elements / pairs walked; seq, heads, dim: the head layout;
//   width, offset: the row layout (row width, first column of the heads).
struct Params {
    n: u32,
    words: u32,
    seq: u32,
    heads: u32,
    width: u32,
    offset: u32,
    dim: u32,
    pad: u32,
}
@group(0) @binding(0) var<uniform> P: Params;

// Row-layout index of element (b, h, t, i) of the head layout, from its flat index.
fn row_index(e: u32) -> u32 {
    let i = e % P.dim;
    let t = (e / P.dim) % P.seq;
    let h = (e / (P.dim * P.seq)) % P.heads;
    let b = e / (P.dim * P.seq * P.heads);
    return (b * P.seq + t) * P.width + P.offset + h * P.dim + i;
}
