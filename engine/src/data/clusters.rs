//! A synthetic classification task: Gaussian-like clusters around random centres.

use crate::rng::SplitMix;

/// `n` points in `inputs` dimensions, each a random one of `classes` centres (drawn from
/// `seed`) plus uniform noise of amplitude `noise`; returns (features row-major, class
/// per point). Deterministic for a seed; the same seed gives the same centres whatever
/// `n`, so a held-out set drawn with it is the same task.
pub fn clusters(
    inputs: usize,
    classes: usize,
    n: usize,
    noise: f32,
    seed: u64,
) -> (Vec<f32>, Vec<u32>) {
    let mut centres = SplitMix(seed);
    let c: Vec<f32> = (0..classes * inputs)
        .map(|_| centres.symmetric() * 2.0)
        .collect();
    let mut rng = SplitMix(seed ^ 0xDA7A);
    let mut x = Vec::with_capacity(n * inputs);
    let mut y = Vec::with_capacity(n);
    for _ in 0..n {
        let k = (rng.next_u64() % classes as u64) as usize;
        y.push(k as u32);
        for d in 0..inputs {
            x.push(c[k * inputs + d] + noise * rng.symmetric());
        }
    }
    (x, y)
}
