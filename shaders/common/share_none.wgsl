// Without subgroup operations every lane loads each A(i, kk + t) itself.
fn a_own(g: u32, i: u32, kl: u32) -> f32 {
    return 0.0;
}

fn a_share(own: f32, g: u32, i: u32, kk: u32, t: u32) -> f32 {
    let kt = kk + t;
    return select(0.0, a_at(a_index(g, i, min(kt, P.k - 1u))), kt < P.k);
}
