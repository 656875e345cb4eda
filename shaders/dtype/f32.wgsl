// Typed slot `$S` holding f32, walked two elements at a time.
//@ decl
@group(0) @binding($B) var<storage, $A> $S_buf: array<vec2<f32>>;
//@ load
fn $S_load(w: u32) -> vec2<f32> {
    return $S_buf[w];
}
//@ store
fn $S_store(w: u32, v: vec2<f32>) {
    $S_buf[w] = v;
}
