// ReLU, tanh and SiLU and their derivatives in f32; the override KIND picks one per
// pipeline (0 relu, 1 tanh, 2 silu: Activation's order). Written with exp only (some
// drivers' tanh returns NaN for large inputs, and tanh near 0 may cancel); exp
// overflowing to inf, or underflowing to 0, gives each function its correct limit.
override KIND: u32 = 0u;

// tanh x: below |x| = 0.55 its Taylor series to x^17 (the next term is under 1e-8 of
// x there), where (1 - e) / (1 + e) would lose bits to cancellation; above, with
// e = exp(-2|x|) <= 0.33, (1 - e) / (1 + e) loses under one bit.
fn act_tanh(x: f32) -> f32 {
    let a = abs(x);
    if (a < 0.55) {
        let z = x * x;
        var q = 6404582.0 / 10854718875.0;
        q = q * z - 929569.0 / 638512875.0;
        q = q * z + 21844.0 / 6081075.0;
        q = q * z - 1382.0 / 155925.0;
        q = q * z + 62.0 / 2835.0;
        q = q * z - 17.0 / 315.0;
        q = q * z + 2.0 / 15.0;
        q = q * z - 1.0 / 3.0;
        return x + x * z * q;
    }
    let e = exp(-2.0 * a);
    let t = (1.0 - e) / (1.0 + e);
    return select(t, -t, x < 0.0);
}

// tanh' = 1 - tanh^2 = 4e / (1 + e)^2 with e = exp(-2|x|): no cancellation, and not
// 0 where tanh has rounded to 1.
fn act_tanh_grad(x: f32) -> f32 {
    let e = exp(-2.0 * abs(x));
    return 4.0 * e / ((1.0 + e) * (1.0 + e));
}

fn act_sigmoid(x: f32) -> f32 {
    return 1.0 / (1.0 + exp(-x));
}

// d/dx [x s(x)] = s (1 + x (1 - s)); for x > 0, 1 - s = e s with e = exp(-x) <= 1,
// which does not cancel.
fn act_silu_grad(x: f32) -> f32 {
    let e = exp(-x);
    let s = 1.0 / (1.0 + e);
    let one_minus_s = select(1.0 - s, e * s, x > 0.0);
    return s * (1.0 + x * one_minus_s);
}

fn act(x: f32) -> f32 {
    if (KIND == 0u) {
        // +0 for x <= 0 and for NaN, as the CPU reference.
        return select(0.0, x, x > 0.0);
    }
    if (KIND == 1u) {
        return act_tanh(x);
    }
    return x / (1.0 + exp(-x));
}

// dout * f'(x); ReLU passes dout through or gives +0 (a NaN dout where x <= 0 included).
fn act_backward(x: f32, dout: f32) -> f32 {
    if (KIND == 0u) {
        return select(0.0, dout, x > 0.0);
    }
    if (KIND == 1u) {
        return dout * act_tanh_grad(x);
    }
    return dout * act_silu_grad(x);
}
