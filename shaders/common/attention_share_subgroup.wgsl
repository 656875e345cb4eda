// Key (or query) rows of a block are loaded one per lane and shared across the
// subgroup by broadcasts from constant lanes: one extract-and-splat each on lavapipe,
// where every per-lane load is a loop over the lanes. Workgroup = one subgroup of SG.
const SHARED: bool = true;

fn bcast4(v: vec4<f32>, t: u32) -> vec4<f32> {
    switch t {
        //@unroll s SG
        case {s}u: { return subgroupBroadcast(v, {s}u); }
        default: { return v; }
    }
}

fn bcast1(v: f32, t: u32) -> f32 {
    switch t {
        //@unroll s SG
        case {s}u: { return subgroupBroadcast(v, {s}u); }
        default: { return v; }
    }
}

fn bcast1u(v: u32, t: u32) -> u32 {
    switch t {
        //@unroll s SG
        case {s}u: { return subgroupBroadcast(v, {s}u); }
        default: { return v; }
    }
}
