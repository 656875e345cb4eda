// GEMM for GPUs: a 16 x 16 workgroup computes a BM x BN = 64 x 64 tile of C, each thread
// a 4 x 4 register block (rows ty + 16 r, columns tx + 16 c: neighbouring threads touch
// neighbouring addresses, so loads and stores coalesce and shared reads do not conflict).
// K advances in steps of BK = 16 through shared-memory tiles stored k-major with one
// padding column. Operands are widened to f32 on the way into shared memory, so all
// arithmetic and accumulation is f32 whatever the storage type.
// Assembly constants VEC_A / VEC_B = 1 when the operand's contiguous dimension is a
// multiple of 4: each thread then fetches its 4 elements with one 16-byte load.

const BM: u32 = 64u;
const BN: u32 = 64u;
const BK: u32 = 16u;
const AS: u32 = BM + 1u;
const BS: u32 = BN + 1u;

var<workgroup> tile_a: array<f32, BK * AS>;
var<workgroup> tile_b: array<f32, BK * BS>;

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
    var acc: array<f32, 16>;
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
            //@unroll r 4
            let a{r} = tile_a[kk * AS + lid.y + {r}u * 16u];
            //@unroll c 4
            let b{c} = tile_b[kk * BS + lid.x + {c}u * 16u];
            //@unroll r 4
            //@unroll c 4
            acc[{r}u * 4u + {c}u] = fma(a{r}, b{c}, acc[{r}u * 4u + {c}u]);
        }
        workgroupBarrier();
    }
    //@unroll r 4
    //@unroll c 4
    store(acc[{r}u * 4u + {c}u], g, i0 + lid.y + {r}u * 16u, j0 + lid.x + {c}u * 16u, split);
}

fn store(v: f32, g: u32, i: u32, j: u32, split: u32) {
    if (i < P.m && i < P.row_base + P.rows && j < P.n) {
        emit(v, g, i, j, split);
    }
}

// 1024 elements of each tile, 4 per thread, walked along the operand's contiguous
// dimension so that neighbouring threads load neighbouring addresses.
fn load_a(g: u32, i0: u32, k0: u32, k_end: u32, tid: u32) {
    //@unroll q 4 {
    {
        let e = tid + {q}u * 256u;
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
    //@}
}

fn load_b(g: u32, j0: u32, k0: u32, k_end: u32, tid: u32) {
    //@unroll q 4 {
    {
        let e = tid + {q}u * 256u;
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
    //@}
}

// One 16-byte load per thread. The contiguous dimension is a multiple of 4, so a
// group of 4 is wholly inside or wholly outside the matrix.
fn load_a4(g: u32, i0: u32, k0: u32, k_end: u32, tid: u32) {
    if (TRANS_A) {
        // A is k x m: 4 consecutive rows i at one k.
        let i = (tid % 16u) * 4u;
        let kk = tid / 16u;
        let gi = i0 + i;
        let gk = k0 + kk;
        let v = select(vec4<f32>(0.0), a_at4(a_index(g, min(gi, P.m - 4u), min(gk, P.k - 1u))), gi < P.m && gk < k_end);
        //@unroll c 4
        tile_a[kk * AS + i + {c}u] = v[{c}u];
    } else {
        // A is m x k: 4 consecutive k of one row.
        let i = tid / 4u;
        let kk = (tid % 4u) * 4u;
        let gi = i0 + i;
        let gk = k0 + kk;
        let v = select(vec4<f32>(0.0), a_at4(a_index(g, min(gi, P.m - 1u), min(gk, P.k - 4u))), gi < P.m && gk < k_end);
        //@unroll c 4
        tile_a[(kk + {c}u) * AS + i] = v[{c}u];
    }
}

fn load_b4(g: u32, j0: u32, k0: u32, k_end: u32, tid: u32) {
    if (TRANS_B) {
        // B is n x k: 4 consecutive k of one column j.
        let j = tid / 4u;
        let kb = (tid % 4u) * 4u;
        let gj = j0 + j;
        let gk = k0 + kb;
        let v = select(vec4<f32>(0.0), b_at4(b_index(g, min(gk, P.k - 4u), min(gj, P.n - 1u))), gj < P.n && gk < k_end);
        //@unroll c 4
        tile_b[(kb + {c}u) * BS + j] = v[{c}u];
    } else {
        // B is k x n: 4 consecutive columns at one k.
        let j = (tid % 16u) * 4u;
        let kb = tid / 16u;
        let gj = j0 + j;
        let gk = k0 + kb;
        let v = select(vec4<f32>(0.0), b_at4(b_index(g, min(gk, P.k - 1u), min(gj, P.n - 4u))), gj < P.n && gk < k_end);
        //@unroll c 4
        tile_b[kb * BS + j + {c}u] = v[{c}u];
    }
}
