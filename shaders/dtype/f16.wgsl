// Typed slot `$S` holding f16 on an adapter with native f16 (SHADER_F16).
//@ decl
@group(0) @binding($B) var<storage, $A> $S_buf: array<vec2<f16>>;
//@ load
fn $S_load(w: u32) -> vec2<f32> {
    return vec2<f32>($S_buf[w]);
}
//@ store
fn $S_store(w: u32, v: vec2<f32>) {
    $S_buf[w] = vec2<f16>(v);
}
