// GEMM for CPU-class adapters (Mesa lavapipe/llvmpipe, and the like), which run a
// subgroup of SG invocations as one SIMD vector and turn every load from a buffer into a
// loop over the lanes. Loads therefore set the speed, arithmetic and register spills do
// not (see benches/RESULTS.md). So:
// - one workgroup is one subgroup; it owns TM rows and SG * 4 * NV columns of C, lane l
//   the column groups j0 + 4 * (l + SG * v), v < NV;
// - each lane loads A(i, kk + lane) once per SG values of k and the subgroup shares them
//   by shuffles, instead of every lane loading every A value (common/share_subgroup.wgsl;
//   adapters without subgroups load them per lane: common/share_none.wgsl);
// - B rows come in as vec4 loads (VEC_B = 1: rows 4-aligned) or four scalars;
// - the TM x NV block of vec4 accumulators is unrolled by `//@unroll` at assembly.
// Assembly constants: SG, TM, NV, VEC_B, VEC_C (C rows 4-aligned: whole-group stores).

var<private> acc: array<vec4<f32>, TM * NV>;

// B(kk, j..j+3), zero past K (so that an inf in B's last row cannot meet a zero A and
// make NaN); j is clamped so that every load stays inside the buffer.
fn load_b4(g: u32, kk: u32, j: u32) -> vec4<f32> {
    let kc = min(kk, P.k - 1u);
    var v: vec4<f32>;
    if (VEC_B == 1u) {
        v = b_at4(b_index(g, kc, min(j, P.n - 4u)));
    } else {
        let jm = P.n - 1u;
        v = vec4<f32>(
            b_at(b_index(g, kc, min(j, jm))),
            b_at(b_index(g, kc, min(j + 1u, jm))),
            b_at(b_index(g, kc, min(j + 2u, jm))),
            b_at(b_index(g, kc, min(j + 3u, jm))),
        );
    }
    return select(vec4<f32>(0.0), v, kk < P.k);
}

// SG consecutive values of k starting at kk, folded into the accumulators.
fn chunk(g: u32, i0: u32, j0: u32, lane: u32, kk: u32) {
    let im = P.m - 1u;
    //@unroll r TM
    let al{r} = a_own(g, min(i0 + {r}u, im), kk + lane);
    //@unroll t SG
    //@unroll v NV
    let b{t}_{v} = load_b4(g, kk + {t}u, j0 + {v}u * SG * 4u);
    // Row by row, each accumulator takes all SG steps of k while it is in a register:
    // the block is far larger than the register file, and this order touches each
    // spilled accumulator once per chunk instead of once per k.
    //@unroll r TM {
    {
        //@unroll t SG
        let a{t} = vec4<f32>(a_share(al{r}, g, min(i0 + {r}u, im), kk, {t}u));
        //@unroll v NV {
        {
            var s = acc[{r}u * NV + {v}u];
            //@unroll t SG
            s = fma(a{t}, b{t}_{v}, s);
            acc[{r}u * NV + {v}u] = s;
        }
        //@}
    }
    //@}
}

@compute @workgroup_size(SG)
fn main(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_id) lid: vec3<u32>) {
    let lane = lid.x;
    let g = wg.z / P.splits;
    let split = wg.z % P.splits;
    let i0 = P.row_base + wg.y * TM;
    let j0 = wg.x * (SG * 4u * NV) + 4u * lane;
    let k_begin = split * P.k_chunk;
    let k_end = min(P.k, k_begin + P.k_chunk);
    //@unroll r TM
    //@unroll v NV
    acc[{r}u * NV + {v}u] = vec4<f32>(0.0);
    // Only the last split's last chunk can run past K, and the loads zero it there.
    // (One call site: the chunk is large once unrolled, and compile time matters.)
    for (var kk = k_begin; kk < k_end; kk += SG) {
        chunk(g, i0, j0, lane, kk);
    }
    //@unroll r TM {
    //@unroll v NV {
    {
        let i = i0 + {r}u;
        let j = j0 + {v}u * SG * 4u;
        let c = acc[{r}u * NV + {v}u];
        if (i < P.m && i < P.row_base + P.rows) {
            if (VEC_C == 1u && j + 3u < P.n) {
                emit4(c, g, i, j, split);
            } else {
                for (var e = 0u; e < 4u; e++) {
                    if (j + e < P.n) {
                        emit(c[e], g, i, j + e, split);
                    }
                }
            }
        }
    }
    //@}
    //@}
}
