// Typed slot `$S` holding bf16: two per u32 word, each the upper half of an f32.
//@ decl
@group(0) @binding($B) var<storage, $A> $S_buf: array<u32>;
//@ load
fn $S_load(w: u32) -> vec2<f32> {
    let p = $S_buf[w];
    return vec2<f32>(bitcast<f32>(p << 16u), bitcast<f32>(p & 0xffff0000u));
}
//@ at
fn $S_at(i: u32) -> f32 {
    let p = $S_buf[i >> 1u];
    return bitcast<f32>(select(p << 16u, p & 0xffff0000u, (i & 1u) == 1u));
}
fn $S_at4(i: u32) -> vec4<f32> {
    let w = i >> 1u;
    let p = $S_buf[w];
    let q = $S_buf[w + 1u];
    return vec4<f32>(
        bitcast<f32>(p << 16u), bitcast<f32>(p & 0xffff0000u),
        bitcast<f32>(q << 16u), bitcast<f32>(q & 0xffff0000u),
    );
}
//@ store
fn $S_store(w: u32, v: vec2<f32>) {
    $S_buf[w] = bf16_bits(v.x) | (bf16_bits(v.y) << 16u);
}
//@ put
// Read-modify-write of one half; see f16_packed.wgsl.
fn $S_put(i: u32, v: f32) {
    let w = i >> 1u;
    let sh = (i & 1u) * 16u;
    $S_buf[w] = ($S_buf[w] & ~(0xffffu << sh)) | (bf16_bits(v) << sh);
}
fn $S_put4(i: u32, v: vec4<f32>) {
    let w = i >> 1u;
    $S_buf[w] = bf16_bits(v.x) | (bf16_bits(v.y) << 16u);
    $S_buf[w + 1u] = bf16_bits(v.z) | (bf16_bits(v.w) << 16u);
}
