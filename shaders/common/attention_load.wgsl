// Column group c (4 columns) of a row; VEC: DIM % 4 == 0, so groups are whole and
// 4-aligned; otherwise scalar loads, clamped into the row, zero past DIM.
fn ld_q(row: u32, c: u32) -> vec4<f32> {
    let e = row * DIM + 4u * c;
    if (VEC == 1u) {
        return q_at4(e);
    }
    let n = row * DIM + DIM - 1u;
    let v = vec4<f32>(q_at(min(e, n)), q_at(min(e + 1u, n)), q_at(min(e + 2u, n)), q_at(min(e + 3u, n)));
    return select(vec4<f32>(0.0), v, live(c));
}
fn ld_k(row: u32, c: u32) -> vec4<f32> {
    let e = row * DIM + 4u * c;
    if (VEC == 1u) {
        return k_at4(e);
    }
    let n = row * DIM + DIM - 1u;
    let v = vec4<f32>(k_at(min(e, n)), k_at(min(e + 1u, n)), k_at(min(e + 2u, n)), k_at(min(e + 3u, n)));
    return select(vec4<f32>(0.0), v, live(c));
}
fn ld_v(row: u32, c: u32) -> vec4<f32> {
    let e = row * DIM + 4u * c;
    if (VEC == 1u) {
        return v_at4(e);
    }
    let n = row * DIM + DIM - 1u;
    let v = vec4<f32>(v_at(min(e, n)), v_at(min(e + 1u, n)), v_at(min(e + 2u, n)), v_at(min(e + 3u, n)));
    return select(vec4<f32>(0.0), v, live(c));
}
