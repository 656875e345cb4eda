// The rotary embedding's angle, shared by rope and rope_at.

// 2 pi as A + B + C: A and B have at most 12 significant bits, C is the rest. The
// angle's multiple k of 2 pi (k < 2^22 for angles below 2^24 rad) is split as
// k = k_hi + k_lo, k_lo = k mod 2^12, so that every product with A or B is exact; taken
// off largest first, each difference is exact too (Sterbenz, then results that fit 24
// bits), and only the last, small steps round: sin and cos see |r| <= pi (where GPUs
// promise accuracy) within 3e-7 rad of a mod 2 pi, at any position.
const TWO_PI_A: f32 = 6.28125;
const TWO_PI_B: f32 = 0.00193500518798828125;
const TWO_PI_C: f32 = 3.019916050561733e-7;
const INV_TWO_PI: f32 = 0.15915493667125702;

// (cos a, sign * sin a) for position t and frequency index i.
fn rope_cos_sin(t: f32, i: u32) -> vec2<f32> {
    // theta^(-2i / dim) = 2^-(i step): i step_hi is exact; its whole part goes to the
    // exponent exactly (ldexp), so exp2 only sees a fraction in [0, 1) plus i step_lo.
    let fi = f32(i);
    let e_hi = fi * P.step_hi;
    let whole = floor(e_hi);
    var inv_freq = ldexp(exp2(-((e_hi - whole) + fi * P.step_lo)), -i32(whole));
    if (P.slow != 1.0) {
        // Llama 3: r wavelengths in the original context; keep r > high, slow r < low
        // by the factor, blend linearly between.
        let r = inv_freq * P.ctx_over_2pi;
        inv_freq = inv_freq * mix(P.slow, 1.0, clamp((r - P.low) / (P.high - P.low), 0.0, 1.0));
    }
    let a = t * inv_freq;
    let k = u32(round(a * INV_TWO_PI));
    let k_hi = f32(k & 0xfffff000u);
    let k_lo = f32(k & 0xfffu);
    let r = ((((a - k_hi * TWO_PI_A) - k_lo * TWO_PI_A) - k_hi * TWO_PI_B) - k_lo * TWO_PI_B)
        - f32(k) * TWO_PI_C;
    return vec2<f32>(cos(r), P.sign * sin(r));
}
