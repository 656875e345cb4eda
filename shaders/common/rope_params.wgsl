// Launch parameters of rope (48 bytes).
//   n, words: elements / pairs walked; cols: row width (heads x dim); dim: head dim (even);
//   seq: positions per sequence (row r is at r % seq); sign: +1 forward, -1 inverse;
//   step_hi + step_lo = 2 log2(theta) / dim, split on the host so that i * step_hi is
//   exact (step_hi has 11 significant bits);
//   ctx_over_2pi, low, high, slow: Llama 3's band rescaling (original context / 2 pi,
//   low_freq_factor, high_freq_factor, 1 / factor); slow = 1 means none.
struct Params {
    n: u32,
    words: u32,
    cols: u32,
    dim: u32,
    seq: u32,
    sign: f32,
    step_hi: f32,
    step_lo: f32,
    ctx_over_2pi: f32,
    low: f32,
    high: f32,
    slow: f32,
}
@group(0) @binding(0) var<uniform> P: Params;
