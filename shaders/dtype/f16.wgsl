// Typed slot `$S` holding f16 on an adapter with native f16 (SHADER_F16).
// Stores use the native f32 -> f16 conversion, whose rounding WGSL leaves to the
// implementation; tests/kernels.rs checks it against round-to-nearest-even (overflow to
// infinity included) on every adapter the suite runs on. (Storing f16_bits through a
// bitcast would pin it everywhere, but naga cannot yet bitcast u32 to vec2<f16>.)
//@ decl
@group(0) @binding($B) var<storage, $A> $S_buf: array<vec2<f16>>;
//@ load
fn $S_load(w: u32) -> vec2<f32> {
    return vec2<f32>($S_buf[w]);
}
//@ at
fn $S_at(i: u32) -> f32 {
    return f32($S_buf[i >> 1u][i & 1u]);
}
fn $S_at4(i: u32) -> vec4<f32> {
    let w = i >> 1u;
    return vec4<f32>(vec2<f32>($S_buf[w]), vec2<f32>($S_buf[w + 1u]));
}
//@ store
fn $S_store(w: u32, v: vec2<f32>) {
    $S_buf[w] = vec2<f16>(v);
}
//@ put
fn $S_put(i: u32, v: f32) {
    $S_buf[i >> 1u][i & 1u] = f16(v);
}
fn $S_put4(i: u32, v: vec4<f32>) {
    let w = i >> 1u;
    $S_buf[w] = vec2<f16>(v.xy);
    $S_buf[w + 1u] = vec2<f16>(v.zw);
}
