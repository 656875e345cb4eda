// Launch parameters of cache_write / cached_attention (48 bytes).
//   n: pairs walked (cache_write) or (row, head) items, one workgroup each (attention);
//   heads: heads per row of the source / query rows; dim: head dim;
//   width, offset: the source / query row layout (row width, first column of the heads);
//   max_len: cache positions per sequence; rows_per_seq: new rows per sequence;
//   kv_heads: heads in the cache; group: query heads per K/V head; scale: score factor;
//   total: elements cache_write copies (rows x heads x dim).
struct Params {
    n: u32,
    heads: u32,
    dim: u32,
    width: u32,
    offset: u32,
    max_len: u32,
    rows_per_seq: u32,
    kv_heads: u32,
    group: u32,
    scale: f32,
    total: u32,
    pad1: u32,
}
@group(0) @binding(0) var<uniform> P: Params;
