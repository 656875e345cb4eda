// Launch parameters of dropout (32 bytes), and the mask's hash.
//   n, words: elements / pairs walked; scale: 1 / (1 - p) as f32; threshold: p * 2^32;
//   seed_lo, seed_hi: the 64-bit seed.
struct Params {
    n: u32,
    words: u32,
    scale: f32,
    threshold: u32,
    seed_lo: u32,
    seed_hi: u32,
    pad0: u32,
    pad1: u32,
}
@group(0) @binding(0) var<uniform> P: Params;

// kiln_engine::kernel::dropout_hash, in the same u32 wrapping arithmetic (WGSL's u32
// multiply wraps), so every device keeps the same elements.
fn dropout_round(x: u32) -> u32 {
    var h = x;
    h ^= h >> 16u;
    h *= 0x6A09E667u;
    h ^= h >> 15u;
    h *= 0xBB67AE85u;
    return h ^ (h >> 16u);
}

fn dropout_kept(i: u32) -> bool {
    return dropout_round(dropout_round(i ^ P.seed_lo) ^ P.seed_hi) >= P.threshold;
}
