// GEMM for GPUs: a 16 x 16 workgroup computes a BM x BN = 64 x 64 tile of C, each thread
// a 4 x 4 register block (rows ty + 16 r, columns tx + 16 c: neighbouring threads touch
// neighbouring addresses, so loads and stores coalesce and shared reads do not conflict).
// K advances in steps of BK = 16 through shared-memory tiles stored k-major with one
// padding column. Operands are widened to f32 on the way into shared memory, so all
// arithmetic and accumulation is f32 whatever the storage type.

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
        // 1024 elements of each tile, 4 per thread, walked along the operand's
        // contiguous dimension so that a warp's loads hit consecutive addresses.
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
            let gkb = k0 + kb;
            let okb = gj < P.n && gkb < k_end;
            tile_b[kb * BS + j] = select(0.0, b_at(b_index(g, min(gkb, P.k - 1u), min(gj, P.n - 1u))), okb);
        }
        //@}
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
