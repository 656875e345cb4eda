// A values for a subgroup: lane l loads A(i, kk + l) (zero past K) ...
fn a_own(g: u32, i: u32, kl: u32) -> f32 {
    return select(0.0, a_at(a_index(g, i, min(kl, P.k - 1u))), kl < P.k);
}

// ... and every lane reads lane t's value for A(i, kk + t). A broadcast from a constant
// lane is one extract-and-splat on lavapipe, where a shuffle is a loop over the lanes;
// callers pass a literal `t`, so the switch folds away after inlining.
fn a_share(own: f32, g: u32, i: u32, kk: u32, t: u32) -> f32 {
    switch t {
        //@unroll s SG
        case {s}u: { return subgroupBroadcast(own, {s}u); }
        default: { return 0.0; }
    }
}
