// Without subgroup operations every lane loads each shared row itself (`SHARED` is
// false, so the kernels never call these).
const SHARED: bool = false;

fn bcast4(v: vec4<f32>, t: u32) -> vec4<f32> {
    return v;
}

fn bcast1(v: f32, t: u32) -> f32 {
    return v;
}

fn bcast1u(v: u32, t: u32) -> u32 {
    return v;
}
