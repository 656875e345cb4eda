// GELU, tanh form, written as x * sigmoid(2u) with u = c (x + 0.044715 x^3), which equals
// 0.5 x (1 + tanh u) but has no cancellation in 1 + tanh u for negative x and needs no
// tanh (some drivers' tanh returns NaN for large inputs). exp overflowing to inf gives
// the correct limit, 0.
const GELU_C: f32 = 0.7978845608;

fn gelu_sigmoid(x: f32) -> f32 {
    return 1.0 / (1.0 + exp(-2.0 * GELU_C * (x + 0.044715 * x * x * x)));
}

fn gelu(x: f32) -> f32 {
    return x * gelu_sigmoid(x);
}

// d/dx [x s(x)] = s + 2 x s (1 - s) u'.
fn gelu_grad(x: f32) -> f32 {
    let s = gelu_sigmoid(x);
    return s + 2.0 * x * s * (1.0 - s) * GELU_C * (1.0 + 3.0 * 0.044715 * x * x);
}
