// Fused attention backward, pass 2: dk and dv. Lane l owns R key rows (first + l*R + r),
// with their scaled k, v and the dk, dv accumulators in registers, and walks query
// blocks of SG (from its first key row when causal), each query row loaded once per
// block and shared as in attention_forward.wgsl:
//   p = exp2(s2 - lse2),  ds = p (dout_i . v - delta_i),
//   dv = sum_i p dout_i,  dk = scale * sum_i ds q_i.
// Every output row has one owner: no atomics, and the sums run in a fixed order.
// Grouped-query attention: the dispatch walks the K/V heads, and K/V head j sums over
// its query heads j * group + g, g = 0 .. group - 1 in turn (a loop around the block
// walk, not unrolled: one copy of the block body whatever the group).
// Packed sequences: key j is seen by the query rows of its document (doc_start(i) <=
// j), and the walk stops at the first block whose first row starts after the
// workgroup's last key row (starts never decrease).
// Assembly constants: SG, WG, R, DIM, D4, VEC. Slots: q, k, v, dout (read), dk, dv
// (typed); lse, delta (f32, read; delta from attention_backward_dq.wgsl), starts (u32,
// documents).
@group(0) @binding(7) var<storage, read> lse: array<f32>;
@group(0) @binding(8) var<storage, read> delta: array<f32>;
@group(0) @binding(9) var<storage, read> starts: array<u32>;

var<private> kr: array<vec4<f32>, R * D4>;
var<private> vr: array<vec4<f32>, R * D4>;
var<private> dka: array<vec4<f32>, R * D4>;
var<private> dva: array<vec4<f32>, R * D4>;
var<private> qown: array<vec4<f32>, D4>;
var<private> down: array<vec4<f32>, D4>;
var<private> p: array<f32, R * SG>;
var<private> ds: array<f32, R * SG>;

// ld_q, ld_k, ld_v: common/attention_load.wgsl.
fn ld_dout(row: u32, c: u32) -> vec4<f32> {
    let e = row * DIM + 4u * c;
    if (VEC == 1u) {
        return dout_at4(e);
    }
    let n = row * DIM + DIM - 1u;
    let v = vec4<f32>(dout_at(min(e, n)), dout_at(min(e + 1u, n)), dout_at(min(e + 2u, n)), dout_at(min(e + 3u, n)));
    return select(vec4<f32>(0.0), v, live(c));
}
fn st_dk(row: u32, c: u32, v: vec4<f32>) {
    let e = row * DIM + 4u * c;
    if (VEC == 1u) {
        dk_put4(e, v);
        return;
    }
    for (var u = 0u; u < 4u; u++) {
        if (4u * c + u < DIM) {
            dk_put(e + u, v[u]);
        }
    }
}
fn st_dv(row: u32, c: u32, v: vec4<f32>) {
    let e = row * DIM + 4u * c;
    if (VEC == 1u) {
        dv_put4(e, v);
        return;
    }
    for (var u = 0u; u < 4u; u++) {
        if (4u * c + u < DIM) {
            dv_put(e + u, v[u]);
        }
    }
}

// One block of SG query rows from i0 (rows of q, dout, lse and delta from `base`, of
// query head `qhead`).
fn block(base: u32, qhead: u32, i0: u32, mine: u32, lane: u32) {
    let T = P.seq;
    var lown = 0.0;
    var dlown = 0.0;
    var sown = 0u;
    if (SHARED) {
        let il = base + min(i0 + lane, T - 1u);
        //@unroll c D4
        qown[{c}u] = ld_q(il, {c}u);
        //@unroll c D4
        down[{c}u] = ld_dout(il, {c}u);
        lown = lse[il] * LOG2E;
        dlown = delta[il];
        sown = doc_start(qhead, i0 + lane);
    }
    //@unroll t SG {
    {
        let it = base + min(i0 + {t}u, T - 1u);
        //@unroll r R
        var d{r} = vec4<f32>(0.0);
        //@unroll r R
        var e{r} = vec4<f32>(0.0);
        //@unroll c D4 {
        {
            var qb: vec4<f32>;
            var gb: vec4<f32>;
            if (SHARED) {
                qb = bcast4(qown[{c}u], {t}u);
                gb = bcast4(down[{c}u], {t}u);
            } else {
                qb = ld_q(it, {c}u);
                gb = ld_dout(it, {c}u);
            }
            //@unroll r R
            d{r} = fma(kr[{r}u * D4 + {c}u], qb, d{r});
            //@unroll r R
            e{r} = fma(vr[{r}u * D4 + {c}u], gb, e{r});
        }
        //@}
        var lt: f32;
        var dt: f32;
        var st: u32;
        if (SHARED) {
            lt = bcast1(lown, {t}u);
            dt = bcast1(dlown, {t}u);
            st = bcast1u(sown, {t}u);
        } else {
            lt = lse[it] * LOG2E;
            dt = delta[it];
            st = doc_start(qhead, i0 + {t}u);
        }
        let i = i0 + {t}u;
        //@unroll r R {
        {
            let sc = select(NEG, d{r}.x + d{r}.y + d{r}.z + d{r}.w, i < T && (!causal() || mine + {r}u <= i) && st <= mine + {r}u);
            let pr = exp2(sc - lt);
            p[{r}u * SG + {t}u] = pr;
            ds[{r}u * SG + {t}u] = pr * (e{r}.x + e{r}.y + e{r}.z + e{r}.w - dt);
        }
        //@}
    }
    //@}
    // dv += p dout_i, dk += ds q_i, a column group at a time.
    //@unroll c D4 {
    {
        //@unroll r R
        var a{r} = dva[{r}u * D4 + {c}u];
        //@unroll r R
        var b{r} = dka[{r}u * D4 + {c}u];
        //@unroll t SG {
        {
            var qb: vec4<f32>;
            var gb: vec4<f32>;
            if (SHARED) {
                qb = bcast4(qown[{c}u], {t}u);
                gb = bcast4(down[{c}u], {t}u);
            } else {
                let it = base + min(i0 + {t}u, T - 1u);
                qb = ld_q(it, {c}u);
                gb = ld_dout(it, {c}u);
            }
            //@unroll r R
            a{r} = fma(vec4<f32>(p[{r}u * SG + {t}u]), gb, a{r});
            //@unroll r R
            b{r} = fma(vec4<f32>(ds[{r}u * SG + {t}u]), qb, b{r});
        }
        //@}
        //@unroll r R
        dva[{r}u * D4 + {c}u] = a{r};
        //@unroll r R
        dka[{r}u * D4 + {c}u] = b{r};
    }
    //@}
}

@compute @workgroup_size(WG)
fn main(
    @builtin(workgroup_id) wg: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>,
    @builtin(local_invocation_id) lid: vec3<u32>,
) {
    let at = place(wg, nwg);
    if (!at.ok) {
        return;
    }
    let T = P.seq;
    let base = at.head * T;
    let mine = at.first + lid.x * R;
    //@unroll r R {
    {
        let row = base + min(mine + {r}u, T - 1u);
        //@unroll c D4
        kr[{r}u * D4 + {c}u] = ld_k(row, {c}u) * P.scale2;
        //@unroll c D4
        vr[{r}u * D4 + {c}u] = ld_v(row, {c}u);
        //@unroll c D4
        dka[{r}u * D4 + {c}u] = vec4<f32>(0.0);
        //@unroll c D4
        dva[{r}u * D4 + {c}u] = vec4<f32>(0.0);
    }
    //@}
    // Causal: query rows before the block's first key see none of its keys.
    let qstart = select(0u, at.first, causal());
    let last = at.first + WG * R - 1u;
    for (var g = 0u; g < P.group; g++) {
        let qhead = at.head * P.group + g;
        let qbase = qhead * T;
        for (var i0 = qstart; i0 < T; i0 += SG) {
            // Packed: this block's rows and all after it start past the last key row.
            if (doc_start(qhead, i0) > last) {
                break;
            }
            block(qbase, qhead, i0, mine, lid.x);
        }
    }
    //@unroll r R {
    {
        let j = mine + {r}u;
        if (j < T) {
            //@unroll c D4
            st_dk(base + j, {c}u, dka[{r}u * D4 + {c}u] * P.scale);
            //@unroll c D4
            st_dv(base + j, {c}u, dva[{r}u * D4 + {c}u]);
        }
    }
    //@}
}
