// SiLU for SwiGLU, in f32: silu(g) = g s with s = sigmoid(g) = 1 / (1 + exp(-g)). For
// very negative g, exp overflows to inf and s to 0: the right limits (silu -> -0,
// silu' -> 0). Named apart from any plain activation so the kernels stay independent.
fn swiglu_silu(g: f32) -> f32 {
    return g / (1.0 + exp(-g));
}

// (silu(g), silu'(g)) with silu' = s (1 + g (1 - s)). For g > 0, 1 - s is computed as
// e s (e = exp(-g) <= 1), which does not cancel as s nears 1; for g <= 0, 1 - s is
// exact enough and e s could be inf * 0.
fn swiglu_silu_and_grad(g: f32) -> vec2<f32> {
    let e = exp(-g);
    let s = 1.0 / (1.0 + e);
    let one_minus_s = select(1.0 - s, e * s, g > 0.0);
    return vec2<f32>(g * s, s * (1.0 + g * one_minus_s));
}
