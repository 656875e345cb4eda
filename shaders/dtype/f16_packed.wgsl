// Typed slot `$S` holding f16 on an adapter without native f16: two halves per u32 word.
//@ decl
@group(0) @binding($B) var<storage, $A> $S_buf: array<u32>;
//@ load
fn $S_load(w: u32) -> vec2<f32> {
    return unpack2x16float($S_buf[w]);
}
//@ at
fn $S_at(i: u32) -> f32 {
    return unpack2x16float($S_buf[i >> 1u])[i & 1u];
}
fn $S_at4(i: u32) -> vec4<f32> {
    let w = i >> 1u;
    return vec4<f32>(unpack2x16float($S_buf[w]), unpack2x16float($S_buf[w + 1u]));
}
//@ store
fn $S_store(w: u32, v: vec2<f32>) {
    $S_buf[w] = f16_bits(v.x) | (f16_bits(v.y) << 16u);
}
//@ put
// Read-modify-write of one half: only safe when no other invocation writes the other
// half of the same word at the same time; kernels that cannot promise it use put4 or
// write f32 partials instead.
fn $S_put(i: u32, v: f32) {
    let w = i >> 1u;
    let sh = (i & 1u) * 16u;
    $S_buf[w] = ($S_buf[w] & ~(0xffffu << sh)) | (f16_bits(v) << sh);
}
fn $S_put4(i: u32, v: vec4<f32>) {
    let w = i >> 1u;
    $S_buf[w] = f16_bits(v.x) | (f16_bits(v.y) << 16u);
    $S_buf[w + 1u] = f16_bits(v.z) | (f16_bits(v.w) << 16u);
}
