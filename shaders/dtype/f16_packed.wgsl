// Typed slot `$S` holding f16 on an adapter without native f16: two halves per u32 word.
//@ decl
@group(0) @binding($B) var<storage, $A> $S_buf: array<u32>;
//@ load
fn $S_load(w: u32) -> vec2<f32> {
    return unpack2x16float($S_buf[w]);
}
//@ store
fn $S_store(w: u32, v: vec2<f32>) {
    $S_buf[w] = f16_bits(v.x) | (f16_bits(v.y) << 16u);
}
