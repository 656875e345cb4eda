// Typed slot `$S` holding bf16: two per u32 word, each the upper half of an f32.
//@ decl
@group(0) @binding($B) var<storage, $A> $S_buf: array<u32>;
//@ load
fn $S_load(w: u32) -> vec2<f32> {
    let p = $S_buf[w];
    return vec2<f32>(bitcast<f32>(p << 16u), bitcast<f32>(p & 0xffff0000u));
}
//@ store
fn $S_store(w: u32, v: vec2<f32>) {
    $S_buf[w] = bf16_bits(v.x) | (bf16_bits(v.y) << 16u);
}
