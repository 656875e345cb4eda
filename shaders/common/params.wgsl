// Per-launch parameters, one slot of the stream's uniform arena (bound with a dynamic offset).
//   n:     logical element count
//   words: pairs of elements the kernel walks (ceil(n / 2)), or 32-bit words for raw kernels
struct Params {
    n: u32,
    words: u32,
    alpha: f32,
    u0: u32,
}
@group(0) @binding(0) var<uniform> P: Params;
