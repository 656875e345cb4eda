//! Deterministic random numbers for parameter initialisation and synthetic data: the
//! same seed gives the same bits on every machine.

/// splitmix64: a 64-bit counter through a bijective mixer.
#[derive(Clone, Debug)]
pub struct SplitMix(pub u64);

impl SplitMix {
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in [-1, 1).
    pub fn symmetric(&mut self) -> f32 {
        (self.next_u64() >> 40) as f32 / (1u64 << 23) as f32 - 1.0
    }

    /// Two independent standard normal draws, by Marsaglia's polar method: a point
    /// uniform in the square is kept when it falls inside the unit disc (π/4 of the
    /// time) and scaled by √(−2 ln s / s). Only correctly rounded IEEE operations are
    /// used (the logarithm is [`ln`], not the platform's libm, whose last bit may
    /// differ between systems), so the draws are the same bits everywhere.
    pub fn normal_pair(&mut self) -> (f64, f64) {
        loop {
            // Multiples of 2^-52 in [-1, 1): exact in f64.
            let mut u = || (self.next_u64() >> 11) as f64 * (1.0 / (1u64 << 52) as f64) - 1.0;
            let (x, y) = (u(), u());
            let s = x * x + y * y;
            if s > 0.0 && s < 1.0 {
                let f = (-2.0 * ln(s) / s).sqrt();
                return (x * f, y * f);
            }
        }
    }
}

/// The natural logarithm of a positive, finite, normal `x`, from IEEE basic operations
/// alone: x = m·2^e with m in [√½, √2], ln m = 2·atanh((m−1)/(m+1)) summed as a series
/// (|s| ≤ 0.172, so 13 terms leave an error below 1e-19), plus e·ln 2. Within 2 ulps of
/// the exact value: far below the f32 the draws end in.
pub fn ln(x: f64) -> f64 {
    let bits = x.to_bits();
    let mut e = ((bits >> 52) & 0x7ff) as i64 - 1023;
    let mut m = f64::from_bits((bits & ((1u64 << 52) - 1)) | (1023u64 << 52));
    if m > std::f64::consts::SQRT_2 {
        m *= 0.5;
        e += 1;
    }
    let s = (m - 1.0) / (m + 1.0);
    let s2 = s * s;
    let (mut term, mut sum) = (s, 0.0);
    for k in 0..13 {
        sum += term / (2 * k + 1) as f64;
        term *= s2;
    }
    2.0 * sum + e as f64 * std::f64::consts::LN_2
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn our_logarithm_agrees_with_libm() {
        let mut rng = SplitMix(3);
        let mut xs: Vec<f64> = vec![
            1.0,
            0.5,
            2.0,
            std::f64::consts::SQRT_2,
            1e-30,
            0.999_999_999,
        ];
        xs.extend((0..10_000).map(|_| (rng.next_u64() >> 11) as f64 / (1u64 << 53) as f64));
        for x in xs.into_iter().filter(|&x| x > 0.0) {
            let (ours, libm) = (ln(x), x.ln());
            assert!(
                (ours - libm).abs() <= 4.0 * f64::EPSILON * libm.abs().max(1.0),
                "ln({x}): {ours} vs {libm}"
            );
        }
        assert_eq!(ln(1.0), 0.0);
    }
}
