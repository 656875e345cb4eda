// Fused attention forward: out = softmax(scale q k^T [causal]) v, tile by tile, with
// the online-softmax recurrence, and lse per row. No score matrix is ever stored.
//
// Tuned for CPU-class adapters (lavapipe), where loads, not arithmetic, set the speed:
// - a workgroup is WG lanes, lane l owns R query rows (first + l*R + r): their scaled q
//   rows and output accumulators live in registers (unrolled private arrays);
// - keys come in blocks of SG: lane t loads key row j0 + t (its k and v) once and the
//   subgroup shares it by broadcasts (common/attention_share_subgroup.wgsl), or every
//   lane loads every key without subgroups (attention_share_none.wgsl);
// - per block, each row takes SG scores, one max/rescale and SG fused v updates; the
//   running max m and sum l are f32, scores in base 2 (scale2 = scale * log2 e).
// Causal: a workgroup walks keys only up to its last row. Masked keys (score NEG) weigh
// exactly 0 (`seen`), also in a block where all of a row's keys are masked.
// Packed sequences (P.docs > 0): row i sees keys from its document's first row
// (doc_start); the walk begins at the block holding its first row's start.
// Grouped-query attention: a query head's keys and values are those of K/V head
// head / group (`kbase`); nothing else changes.
// Assembly constants: SG, WG, R, DIM, D4 = ceil(DIM / 4), VEC = (DIM % 4 == 0).
// Slots: q, k, v (read), out (typed); lse (f32, one per row); starts (u32, documents).
@group(0) @binding(5) var<storage, read_write> lse: array<f32>;
@group(0) @binding(6) var<storage, read> starts: array<u32>;

var<private> qr: array<vec4<f32>, R * D4>;
var<private> acc: array<vec4<f32>, R * D4>;
var<private> kown: array<vec4<f32>, D4>;
var<private> vown: array<vec4<f32>, D4>;
var<private> s: array<f32, R * SG>;
var<private> mrow: array<f32, R>;
var<private> lrow: array<f32, R>;
var<private> alf: array<f32, R>;
var<private> srow: array<u32, R>;

// ld_q, ld_k, ld_v: common/attention_load.wgsl.
fn st_out(row: u32, c: u32, v: vec4<f32>) {
    let e = row * DIM + 4u * c;
    if (VEC == 1u) {
        out_put4(e, v);
        return;
    }
    for (var u = 0u; u < 4u; u++) {
        if (4u * c + u < DIM) {
            out_put(e + u, v[u]);
        }
    }
}

// One block of SG keys from j0 (rows of k and v from `base`) for the lane's rows from
// `mine`.
fn block(base: u32, j0: u32, mine: u32, lane: u32) {
    let T = P.seq;
    if (SHARED) {
        let jl = base + min(j0 + lane, T - 1u);
        //@unroll c D4
        kown[{c}u] = ld_k(jl, {c}u);
        //@unroll c D4
        vown[{c}u] = ld_v(jl, {c}u);
    }
    // Scores s[r][t] = q_r . k_t (base 2), NEG where masked.
    //@unroll t SG {
    {
        let kt = base + min(j0 + {t}u, T - 1u);
        //@unroll r R
        var d{r} = vec4<f32>(0.0);
        //@unroll c D4 {
        {
            var kb: vec4<f32>;
            if (SHARED) {
                kb = bcast4(kown[{c}u], {t}u);
            } else {
                kb = ld_k(kt, {c}u);
            }
            //@unroll r R
            d{r} = fma(qr[{r}u * D4 + {c}u], kb, d{r});
        }
        //@}
        let j = j0 + {t}u;
        //@unroll r R
        s[{r}u * SG + {t}u] = select(NEG, d{r}.x + d{r}.y + d{r}.z + d{r}.w, j < T && (!causal() || j <= mine + {r}u) && j >= srow[{r}u]);
    }
    //@}
    // Online softmax: new max, rescale factor, probabilities, running sum.
    //@unroll r R {
    {
        let old = mrow[{r}u];
        var mb = old;
        //@unroll t SG
        mb = max(mb, s[{r}u * SG + {t}u]);
        var sum = 0.0;
        //@unroll t SG {
        {
            let x = s[{r}u * SG + {t}u];
            let p = select(0.0, exp2(x - mb), x > NEG);
            s[{r}u * SG + {t}u] = p;
            sum += p;
        }
        //@}
        let alpha = exp2(old - mb);
        lrow[{r}u] = lrow[{r}u] * alpha + sum;
        mrow[{r}u] = mb;
        alf[{r}u] = alpha;
    }
    //@}
    // acc = acc * alpha + p v, a column group at a time with all SG keys in registers.
    //@unroll c D4 {
    {
        //@unroll r R
        var a{r} = acc[{r}u * D4 + {c}u] * alf[{r}u];
        //@unroll t SG {
        {
            var vb: vec4<f32>;
            if (SHARED) {
                vb = bcast4(vown[{c}u], {t}u);
            } else {
                vb = ld_v(base + min(j0 + {t}u, T - 1u), {c}u);
            }
            //@unroll r R
            a{r} = fma(vec4<f32>(s[{r}u * SG + {t}u]), vb, a{r});
        }
        //@}
        //@unroll r R
        acc[{r}u * D4 + {c}u] = a{r};
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
        //@unroll c D4
        qr[{r}u * D4 + {c}u] = ld_q(row, {c}u) * P.scale2;
        //@unroll c D4
        acc[{r}u * D4 + {c}u] = vec4<f32>(0.0);
        mrow[{r}u] = NEG;
        lrow[{r}u] = 0.0;
        srow[{r}u] = doc_start(at.head, mine + {r}u);
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
            let l = lrow[{r}u];
            let inv = select(0.0, 1.0 / l, l > 0.0);
            //@unroll c D4
            st_out(base + i, {c}u, acc[{r}u * D4 + {c}u] * inv);
            lse[base + i] = (mrow[{r}u] + log2(l)) * LN2;
        }
    }
    //@}
}
