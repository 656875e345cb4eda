// Launch parameters of the optimizer kernels (48 bytes); see engine/src/optim.rs.
//   n, words: elements and pairs of elements walked.
//   bias1, bias2: Adam's 1 - beta1^t and 1 - beta2^t (computed on the host in f64).
struct Params {
    n: u32,
    words: u32,
    lr: f32,
    beta1: f32,
    beta2: f32,
    eps: f32,
    weight_decay: f32,
    bias1: f32,
    bias2: f32,
    momentum: f32,
    pad0: u32,
    pad1: u32,
}
@group(0) @binding(0) var<uniform> P: Params;
