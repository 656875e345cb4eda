// `kiln bench peak`: arithmetic throughput. Each invocation runs `iterations` rounds of
// 8 independent fused multiply-adds on vec4s (64 FLOPs a round), so the adapter's FMA
// units, not memory or dependency chains, bound the time. The result is stored so that
// no compiler can drop the work.

struct Params {
    iterations: u32,
    seed: f32,
}

@group(0) @binding(0) var<uniform> params: Params;
@group(0) @binding(1) var<storage, read_write> out: array<vec4<f32>>;

@compute @workgroup_size(64)
fn main(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) groups: vec3<u32>) {
    let i = gid.x + gid.y * groups.x * 64u;
    let x = params.seed * f32(i & 255u);
    // Multipliers just under 1 keep the values finite however many rounds run.
    let m = vec4<f32>(0.9999, 0.99991, 0.99992, 0.99993);
    let c = vec4<f32>(1e-4, 2e-4, 3e-4, 4e-4);
    var a0 = vec4<f32>(x);
    var a1 = a0 + 1.0;
    var a2 = a0 + 2.0;
    var a3 = a0 + 3.0;
    var a4 = a0 + 4.0;
    var a5 = a0 + 5.0;
    var a6 = a0 + 6.0;
    var a7 = a0 + 7.0;
    for (var r = 0u; r < params.iterations; r++) {
        a0 = fma(a0, m, c);
        a1 = fma(a1, m, c);
        a2 = fma(a2, m, c);
        a3 = fma(a3, m, c);
        a4 = fma(a4, m, c);
        a5 = fma(a5, m, c);
        a6 = fma(a6, m, c);
        a7 = fma(a7, m, c);
    }
    out[i] = ((a0 + a1) + (a2 + a3)) + ((a4 + a5) + (a6 + a7));
}
