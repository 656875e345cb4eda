// GEMM for GPUs: a 16 x 16 workgroup computes a BM x BN tile of C, each thread a
// (BM / 16) x (BN / 16) register block (rows ty + 16 r, columns tx + 16 c: neighbouring
// threads touch neighbouring addresses, so loads and stores coalesce and shared reads do
// not conflict). K advances in steps of BK through shared-memory tiles stored k-major
// with one padding column. Operands are widened to f32 on the way into shared memory, so
// all arithmetic and accumulation is f32 whatever the storage type.
//
// The tile shape is pipeline-overridable, so one compiled module serves every shape the
// host's tuning table picks: BM and BN multiples of 16 up to 16 * RB, BK a multiple of 4
// (the host checks the shared-memory total). The register block is unrolled to its
// largest size with each step guarded by a comparison with the override (steps past the
// block re-read a valid element and are dead): the comparisons fold to constants when
// the pipeline is created, so the block stays in registers (constant indices) without
// relying on the driver to unroll a loop.
// Assembly constants VEC_A / VEC_B = 1 when the operand's contiguous dimension is a
// multiple of 4: each thread then fetches 4 elements with one 16-byte load.

override BM: u32 = 64u;
override BN: u32 = 64u;
override BK: u32 = 16u;
// Row and column steps of a thread's register block.
override RM: u32 = BM / 16u;
override RN: u32 = BN / 16u;
override AS: u32 = BM + 1u;
override BS: u32 = BN + 1u;
override A_LEN: u32 = BK * AS;
override B_LEN: u32 = BK * BS;
// Largest register block side the unrolled code covers.
const RB: u32 = 8u;

var<workgroup> tile_a: array<f32, A_LEN>;
var<workgroup> tile_b: array<f32, B_LEN>;

@compute @workgroup_size(16, 16)
fn main(
    @builtin(workgroup_id) wg: vec3<u32>,
    @builtin(local_invocation_id) lid: vec3<u32>,
    @builtin(local_invocation_index) tid: u32,
) {
    let g = wg.z / P.splits;
    let split = wg.z % P.splits;
    let i0 = P.row_base + wg.y * BM;
    let j0 = wg.x * BN;
    let k_begin = split * P.k_chunk;
    let k_end = min(P.k, k_begin + P.k_chunk);
    var acc: array<f32, 64>;
    for (var k0 = k_begin; k0 < k_end; k0 += BK) {
        if (VEC_A == 1u) {
            load_a4(g, i0, k0, k_end, tid);
        } else {
            load_a(g, i0, k0, k_end, tid);
        }
        if (VEC_B == 1u) {
            load_b4(g, j0, k0, k_end, tid);
        } else {
            load_b(g, j0, k0, k_end, tid);
        }
        workgroupBarrier();
        for (var kk = 0u; kk < BK; kk++) {
            //@unroll r 8
            let a{r} = tile_a[kk * AS + lid.y + min({r}u, RM - 1u) * 16u];
            //@unroll c 8
            let b{c} = tile_b[kk * BS + lid.x + min({c}u, RN - 1u) * 16u];
            //@unroll r 8 {
            if ({r}u < RM) {
                //@unroll c 8
                if ({c}u < RN) { acc[{r}u * RB + {c}u] = fma(a{r}, b{c}, acc[{r}u * RB + {c}u]); }
            }
            //@}
        }
        workgroupBarrier();
    }
    //@unroll r 8 {
    if ({r}u < RM) {
        //@unroll c 8
        if ({c}u < RN) { store(acc[{r}u * RB + {c}u], g, i0 + lid.y + {r}u * 16u, j0 + lid.x + {c}u * 16u, split); }
    }
    //@}
}

fn store(v: f32, g: u32, i: u32, j: u32, split: u32) {
    if (i < P.m && i < P.row_base + P.rows && j < P.n) {
        emit(v, g, i, j, split);
    }
}

// BM * BK elements of the A tile, walked along the operand's contiguous dimension so
// that neighbouring threads load neighbouring addresses.
fn load_a(g: u32, i0: u32, k0: u32, k_end: u32, tid: u32) {
    for (var e = tid; e < BM * BK; e += 256u) {
        var i: u32;
        var kk: u32;
        if (TRANS_A) {
            i = e % BM;
            kk = e / BM;
        } else {
            i = e / BK;
            kk = e % BK;
        }
        let gi = i0 + i;
        let gk = k0 + kk;
        let ok = gi < P.m && gk < k_end;
        tile_a[kk * AS + i] = select(0.0, a_at(a_index(g, min(gi, P.m - 1u), min(gk, P.k - 1u))), ok);
    }
}

fn load_b(g: u32, j0: u32, k0: u32, k_end: u32, tid: u32) {
    for (var e = tid; e < BN * BK; e += 256u) {
        var j: u32;
        var kb: u32;
        if (TRANS_B) {
            j = e / BK;
            kb = e % BK;
        } else {
            j = e % BN;
            kb = e / BN;
        }
        let gj = j0 + j;
        let gk = k0 + kb;
        let ok = gj < P.n && gk < k_end;
        tile_b[kb * BS + j] = select(0.0, b_at(b_index(g, min(gk, P.k - 1u), min(gj, P.n - 1u))), ok);
    }
}

// 16-byte loads, one group of 4 per step. The contiguous dimension is a multiple of 4,
// so a group of 4 is wholly inside or wholly outside the matrix.
fn load_a4(g: u32, i0: u32, k0: u32, k_end: u32, tid: u32) {
    for (var e = tid; e < BM * BK / 4u; e += 256u) {
        if (TRANS_A) {
            // A is k x m: 4 consecutive rows i at one k.
            let i = (e % (BM / 4u)) * 4u;
            let kk = e / (BM / 4u);
            let gi = i0 + i;
            let gk = k0 + kk;
            let v = select(vec4<f32>(0.0), a_at4(a_index(g, min(gi, P.m - 4u), min(gk, P.k - 1u))), gi < P.m && gk < k_end);
            //@unroll c 4
            tile_a[kk * AS + i + {c}u] = v[{c}u];
        } else {
            // A is m x k: 4 consecutive k of one row.
            let i = e / (BK / 4u);
            let kk = (e % (BK / 4u)) * 4u;
            let gi = i0 + i;
            let gk = k0 + kk;
            let v = select(vec4<f32>(0.0), a_at4(a_index(g, min(gi, P.m - 1u), min(gk, P.k - 4u))), gi < P.m && gk < k_end);
            //@unroll c 4
            tile_a[(kk + {c}u) * AS + i] = v[{c}u];
        }
    }
}

fn load_b4(g: u32, j0: u32, k0: u32, k_end: u32, tid: u32) {
    for (var e = tid; e < BN * BK / 4u; e += 256u) {
        if (TRANS_B) {
            // B is n x k: 4 consecutive k of one column j.
            let j = e / (BK / 4u);
            let kb = (e % (BK / 4u)) * 4u;
            let gj = j0 + j;
            let gk = k0 + kb;
            let v = select(vec4<f32>(0.0), b_at4(b_index(g, min(gk, P.k - 4u), min(gj, P.n - 1u))), gj < P.n && gk < k_end);
            //@unroll c 4
            tile_b[(kb + {c}u) * BS + j] = v[{c}u];
        } else {
            // B is k x n: 4 consecutive columns at one k.
            let j = (e % (BN / 4u)) * 4u;
            let kb = e / (BN / 4u);
            let gj = j0 + j;
            let gk = k0 + kb;
            let v = select(vec4<f32>(0.0), b_at4(b_index(g, min(gk, P.k - 1u), min(gj, P.n - 4u))), gj < P.n && gk < k_end);
            //@unroll c 4
            tile_b[kb * BS + j + {c}u] = v[{c}u];
        }
    }
}
