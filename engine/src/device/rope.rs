//! The rotary embedding's frequencies, as [`Kernel::Rope`](crate::Kernel::Rope) and
//! [`Kernel::RopeAt`](crate::Kernel::RopeAt) take them: a base `theta` (Llama's
//! `rope_theta`) and, for Llama 3.1 and later, a rescaling by wavelength band.
//!
//! Head dim D, pair index i < D/2: the plain inverse frequency is
//! `f_i = theta^(-2i / D)`, and position t turns pair i by `t * f_i * s(f_i)`, where
//! `s = 1` without scaling. With [`RopeScaling`] (Hugging Face's `rope_scaling` of
//! `"rope_type": "llama3"`), `r = f * original_max_position_embeddings / (2 pi)` counts
//! how many of the pair's wavelengths the original context holds, and
//! `s = mix(1 / factor, 1, clamp((r - low_freq_factor) / (high_freq_factor -
//! low_freq_factor), 0, 1))`: short wavelengths (r above the high factor) are kept,
//! long ones (r below the low factor) slowed by `factor`, and the band between blended
//! linearly — the piecewise rule of `modeling_rope_utils.py`, written as one clamp.

use serde::{Deserialize, Serialize};

/// Llama 3's per-band rescaling of rotary frequencies (see the module doc).
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RopeScaling {
    /// How much slower the longest wavelengths turn (8 in Llama 3.1, 32 in 3.2).
    pub factor: f32,
    /// Wavelength counts below this are slowed by `factor` (1 in Llama 3.x).
    pub low_freq_factor: f32,
    /// Wavelength counts above this are kept (4 in Llama 3.x).
    pub high_freq_factor: f32,
    /// The context the base model was trained on (8192 in Llama 3.x).
    pub original_max_position_embeddings: usize,
}

impl RopeScaling {
    /// Why these numbers cannot scale frequencies, if they cannot.
    pub fn problem(&self) -> Option<String> {
        let (f, lo, hi) = (self.factor, self.low_freq_factor, self.high_freq_factor);
        if !(f.is_finite() && f >= 1.0) {
            return Some(format!(
                "rope scaling factor is {f}; it must be a finite number >= 1 (8 in Llama 3.1)"
            ));
        }
        if !(lo.is_finite() && hi.is_finite() && lo > 0.0 && hi > lo) {
            return Some(format!(
                "rope scaling needs 0 < low_freq_factor < high_freq_factor, not {lo} and {hi} \
                 (Llama 3.x: 1 and 4)"
            ));
        }
        if self.original_max_position_embeddings == 0 {
            return Some(
                "rope scaling's original_max_position_embeddings is 0; it must be the base \
                 model's context (8192 in Llama 3.x)"
                    .into(),
            );
        }
        None
    }

    /// `s(f)`: the factor that multiplies inverse frequency `f`, in f64.
    pub fn scale(&self, inv_freq: f64) -> f64 {
        let r = inv_freq * self.original_max_position_embeddings as f64 / std::f64::consts::TAU;
        let (lo, hi) = (self.low_freq_factor as f64, self.high_freq_factor as f64);
        let blend = ((r - lo) / (hi - lo)).clamp(0.0, 1.0);
        let slow = 1.0 / self.factor as f64;
        slow + (1.0 - slow) * blend
    }
}

/// The frequencies of one rotary embedding.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct RopeFreqs {
    /// The base (Llama's `rope_theta`, e.g. 10000).
    pub theta: f32,
    pub scaling: Option<RopeScaling>,
}

impl From<f32> for RopeFreqs {
    /// Plain frequencies of base `theta`.
    fn from(theta: f32) -> RopeFreqs {
        RopeFreqs {
            theta,
            scaling: None,
        }
    }
}

impl RopeFreqs {
    /// Why these frequencies cannot be computed, if they cannot.
    pub fn problem(&self) -> Option<String> {
        let theta = self.theta;
        if !(theta > 0.0 && theta.is_finite()) {
            return Some(format!(
                "theta (the frequency base, 10000 in Llama) must be positive, not {theta}"
            ));
        }
        self.scaling.as_ref().and_then(RopeScaling::problem)
    }

    /// Pair `i`'s inverse frequency for head dim `dim`, in f64 (the CPU reference's).
    pub fn inv_freq(&self, i: usize, dim: usize) -> f64 {
        let f = (self.theta as f64).powf(-2.0 * i as f64 / dim as f64);
        self.scaling.map_or(f, |s| f * s.scale(f))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Llama 3.1's numbers, checked against the piecewise rule evaluated by hand.
    #[test]
    fn scaling_keeps_short_slows_long_and_blends_between() {
        let s = RopeScaling {
            factor: 8.0,
            low_freq_factor: 1.0,
            high_freq_factor: 4.0,
            original_max_position_embeddings: 8192,
        };
        let tau = std::f64::consts::TAU;
        // wavelength 100 (< 8192 / 4): kept.
        assert_eq!(s.scale(tau / 100.0), 1.0);
        // wavelength 10000 (> 8192 / 1): slowed by 8.
        assert_eq!(s.scale(tau / 10000.0), 0.125);
        // wavelength 4096: r = 2, blend (2 - 1) / 3, s = (1 - 1/3) / 8 + 1/3 = 0.41666...
        let mid = s.scale(tau / 4096.0);
        assert!((mid - (2.0 / 3.0 / 8.0 + 1.0 / 3.0)).abs() < 1e-12, "{mid}");
        assert!(s.problem().is_none());
        let bad = RopeScaling {
            high_freq_factor: 1.0,
            ..s
        };
        assert!(bad
            .problem()
            .unwrap()
            .contains("low_freq_factor < high_freq_factor"));
    }
}
