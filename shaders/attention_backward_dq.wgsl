// Fused attention backward, pass 1: dq, and rowsum(dout * out) per query row for pass 2.
// Lane l owns R query rows (first + l*R + r), with their scaled q, dout and the dq
// accumulators in registers, and walks key blocks of SG as attention_forward.wgsl does:
//   p = exp2(s2 - lse2) (the forward's probabilities, recomputed from the saved lse),
//   ds = p (dout . v_j - delta),  dq = scale * sum_j ds k_j,
// where delta = rowsum(dout * out) is computed here first and also written to `delta`
// (f32 per row, the device's scratch) for attention_backward_dkv.wgsl. Keys and values
// are those of K/V head head / group (`kbase`), as forward.
// Packed sequences: row i sees keys from its document's first row, as forward.
// Assembly constants: SG, WG, R, DIM, D4, VEC. Slots: q, k, v, out, dout (read), dq
// (typed); lse (f32, read), delta (f32, written), starts (u32, documents).
@group(0) @binding(7) var<storage, read> lse: array<f32>;
@group(0) @binding(8) var<storage, read_write> delta: array<f32>;
@group(0) @binding(9) var<storage, read> starts: array<u32>;

var<private> qr: array<vec4<f32>, R * D4>;
var<private> dor: array<vec4<f32>, R * D4>;
var<private> dqa: array<vec4<f32>, R * D4>;
var<private> kown: array<vec4<f32>, D4>;
var<private> vown: array<vec4<f32>, D4>;
var<private> s: array<f32, R * SG>;
var<private> dp: array<f32, R * SG>;
var<private> lrow: array<f32, R>;
var<private> drow: array<f32, R>;
var<private> srow: array<u32, R>;

// ld_q, ld_k, ld_v: common/attention_load.wgsl.
fn ld_out(row: u32, c: u32) -> vec4<f32> {
    let e = row * DIM + 4u * c;
    if (VEC == 1u) {
        return out_at4(e);
    }
    let n = row * DIM + DIM - 1u;
    let v = vec4<f32>(out_at(min(e, n)), out_at(min(e + 1u, n)), out_at(min(e + 2u, n)), out_at(min(e + 3u, n)));
    return select(vec4<f32>(0.0), v, live(c));
}
fn ld_dout(row: u32, c: u32) -> vec4<f32> {
    let e = row * DIM + 4u * c;
    if (VEC == 1u) {
        return dout_at4(e);
    }
    let n = row * DIM + DIM - 1u;
    let v = vec4<f32>(dout_at(min(e, n)), dout_at(min(e + 1u, n)), dout_at(min(e + 2u, n)), dout_at(min(e + 3u, n)));
    return select(vec4<f32>(0.0), v, live(c));
}
fn st_dq(row: u32, c: u32, v: vec4<f32>) {
    let e = row * DIM + 4u * c;
    if (VEC == 1u) {
        dq_put4(e, v);
        return;
    }
    for (var u = 0u; u < 4u; u++) {
        if (4u * c + u < DIM) {
            dq_put(e + u, v[u]);
        }
    }
}

// One block of SG keys from j0 (rows of k and v from `base`).
fn block(base: u32, j0: u32, mine: u32, lane: u32) {
    let T = P.seq;
    if (SHARED) {
        let jl = base + min(j0 + lane, T - 1u);
        //@unroll c D4
        kown[{c}u] = ld_k(jl, {c}u);
        //@unroll c D4
        vown[{c}u] = ld_v(jl, {c}u);
    }
    // s[r][t] = q_r . k_t (base 2, NEG where masked), dp[r][t] = dout_r . v_t.
    //@unroll t SG {
    {
        let kt = base + min(j0 + {t}u, T - 1u);
        //@unroll r R
        var d{r} = vec4<f32>(0.0);
        //@unroll r R
        var e{r} = vec4<f32>(0.0);
        //@unroll c D4 {
        {
            var kb: vec4<f32>;
            var vb: vec4<f32>;
            if (SHARED) {
                kb = bcast4(kown[{c}u], {t}u);
                vb = bcast4(vown[{c}u], {t}u);
            } else {
                kb = ld_k(kt, {c}u);
                vb = ld_v(kt, {c}u);
            }
            //@unroll r R
            d{r} = fma(qr[{r}u * D4 + {c}u], kb, d{r});
            //@unroll r R
            e{r} = fma(dor[{r}u * D4 + {c}u], vb, e{r});
        }
        //@}
        let j = j0 + {t}u;
        //@unroll r R {
        {
            let sc = select(NEG, d{r}.x + d{r}.y + d{r}.z + d{r}.w, j < T && (!causal() || j <= mine + {r}u) && j >= srow[{r}u]);
            let p = exp2(sc - lrow[{r}u]);
            s[{r}u * SG + {t}u] = p * (e{r}.x + e{r}.y + e{r}.z + e{r}.w - drow[{r}u]);
        }
        //@}
    }
    //@}
    // dq += ds k, a column group at a time.
    //@unroll c D4 {
    {
        //@unroll r R
        var a{r} = dqa[{r}u * D4 + {c}u];
        //@unroll t SG {
        {
            var kb: vec4<f32>;
            if (SHARED) {
                kb = bcast4(kown[{c}u], {t}u);
            } else {
                kb = ld_k(base + min(j0 + {t}u, T - 1u), {c}u);
            }
            //@unroll r R
            a{r} = fma(vec4<f32>(s[{r}u * SG + {t}u]), kb, a{r});
        }
        //@}
        //@unroll r R
        dqa[{r}u * D4 + {c}u] = a{r};
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
    let kbase = (at.head / P.group) * T;
    let mine = at.first + lid.x * R;
    //@unroll r R {
    {
        let row = base + min(mine + {r}u, T - 1u);
        var dd = vec4<f32>(0.0);
        //@unroll c D4 {
        {
            let g = ld_dout(row, {c}u);
            dor[{r}u * D4 + {c}u] = g;
            dd = fma(g, ld_out(row, {c}u), dd);
            qr[{r}u * D4 + {c}u] = ld_q(row, {c}u) * P.scale2;
            dqa[{r}u * D4 + {c}u] = vec4<f32>(0.0);
        }
        //@}
        let dsum = dd.x + dd.y + dd.z + dd.w;
        drow[{r}u] = dsum;
        lrow[{r}u] = lse[row] * LOG2E;
        srow[{r}u] = doc_start(at.head, mine + {r}u);
        if (mine + {r}u < T) {
            delta[row] = dsum;
        }
    }
    //@}
    let kend = select(T, min(T, at.first + WG * R), causal());
    let kbegin = doc_start(at.head, at.first) / SG * SG;
    for (var j0 = kbegin; j0 < kend; j0 += SG) {
        block(kbase, j0, mine, lid.x);
    }
    //@unroll r R {
    {
        let i = mine + {r}u;
        if (i < T) {
            //@unroll c D4
            st_dq(base + i, {c}u, dqa[{r}u * D4 + {c}u] * P.scale);
        }
    }
    //@}
}
