//! First runs of slow pipelines on the primer's device (see `primer.rs`).

use super::*;
use kiln_engine::kernels::{self, AttentionBackward};

impl PrimeOn for VkDevice {
    fn run_once(&self, job: &Job) -> Result<()> {
        self.prime(job)
    }
}

impl VkDevice {
    /// Runs `job`'s kernel once (here, on the primer's device), so that the driver
    /// compiles its machine code and keeps it in Mesa's cache.
    pub(crate) fn prime(&self, job: &Job) -> Result<()> {
        match (&job.block, &job.attention) {
            (Block::Gemm(p), _) => self.prime_gemm(p),
            (Block::Attention(_), Some(r)) => self.prime_attention(r),
            (Block::Attention(names), None) => Err(self.backend_error(format!(
                "priming attention passes {names} without their kernel"
            ))),
        }
    }

    /// Runs the attention kernel `r` describes once, over one K/V head of 16 rows.
    pub(super) fn prime_attention(&self, r: &AttentionRecipe) -> Result<()> {
        let seq = 16;
        let (heads, dim) = (r.group, r.dim);
        let q_len = heads * seq * dim;
        let kv_len = seq * dim;
        // Lengths in `Kernel::buffers` order: q, k, v, out, lse forward; q, k, v,
        // out, dout, lse, dq, dk, dv backward.
        let lens: Vec<usize> = if r.backward {
            vec![
                q_len,
                kv_len,
                kv_len,
                q_len,
                q_len,
                heads * seq,
                q_len,
                kv_len,
                kv_len,
            ]
        } else {
            vec![q_len, kv_len, kv_len, q_len, heads * seq]
        };
        if lens.len() != r.dtypes.len() {
            return Err(self.backend_error("an attention recipe with the wrong buffer count"));
        }
        let specs: Vec<(DType, usize)> = r.dtypes.iter().copied().zip(lens).collect();
        self.with_buffers(&specs, |bufs| {
            let (scale, causal, group) = (1.0, r.causal, r.group);
            let kernel = if r.backward {
                Kernel::AttentionBackward(AttentionBackward {
                    q: bufs[0],
                    k: bufs[1],
                    v: bufs[2],
                    out: bufs[3],
                    dout: bufs[4],
                    lse: bufs[5],
                    dq: bufs[6],
                    dk: bufs[7],
                    dv: bufs[8],
                    batch_heads: heads,
                    group,
                    seq,
                    dim,
                    scale,
                    causal,
                    documents: None,
                })
            } else {
                Kernel::Attention(kernels::Attention {
                    q: bufs[0],
                    k: bufs[1],
                    v: bufs[2],
                    out: bufs[3],
                    lse: bufs[4],
                    batch_heads: heads,
                    group,
                    seq,
                    dim,
                    scale,
                    causal,
                    documents: None,
                })
            };
            // With the training device's plan, so that the driver sees its pipelines.
            kernel.validate()?;
            let mut s = self.lock();
            self.record_attention_with(&mut s, &kernel, &r.plan)?;
            let value = self.flush(&mut s)?;
            drop(s);
            self.wait_for(value)
        })
    }

    /// Runs `p`'s pipeline once over one tile (on the primer's device).
    pub(super) fn prime_gemm(&self, p: &SpirvGemmPlan) -> Result<()> {
        let storage = p.mixed.unwrap_or([p.dtype; 4]);
        // One tile: TM rows, the lanes' columns, and two subgroup steps of K (one per
        // K chunk when split) — enough for every load the block makes to land inside.
        let (m, n, k) = (p.tm as usize, (gemm::LANES * 4 * p.nv) as usize, 16);
        let mut specs = vec![
            (storage[0], m * k),
            (storage[1], k * n),
            (storage[2], m * n),
        ];
        if p.bias {
            specs.push((storage[3], n));
        }
        if p.copy_f32 {
            specs.push((DType::F32, m * n));
        }
        self.with_buffers(&specs, |bufs| {
            let mut mm = kiln_engine::Matmul::new(bufs[0], bufs[1], bufs[2], m, n, k);
            mm.trans_a = p.trans_a;
            mm.trans_b = p.trans_b;
            mm.bias = p.bias.then(|| bufs[3]);
            mm.gelu = p.gelu;
            mm.c_f32 = p.copy_f32.then(|| bufs[bufs.len() - 1]);
            let q = SpirvGemmPlan {
                splits: if p.partial() { 2 } else { 1 },
                k_chunk: if p.partial() { 8 } else { 16 },
                ..*p
            };
            let mut s = self.lock();
            let cf = if q.partial() {
                Recorder::partials(self, &mut s, 2 * (m * n) as u64 * 4)?;
                PARTIALS_ID
            } else {
                mm.c_f32.map_or(DUMMY_ID, |b| b.id)
            };
            let pipeline = self.gemm_pipeline(&mut s, &q)?;
            let (params, groups) = (q.params(&mm), q.groups(&mm));
            let texel = q.texel.then_some(q.vec_b);
            self.dispatch_gemm(&mut s, &mm, pipeline, &params, groups, cf, texel)?;
            let value = self.flush(&mut s)?;
            drop(s);
            self.wait_for(value)
        })
    }

    /// Runs `f` over new buffers of `specs` (type, length each) and frees them all
    /// after, whatever happened (the primer's device lives on).
    pub(super) fn with_buffers<T>(
        &self,
        specs: &[(DType, usize)],
        f: impl FnOnce(&[Buffer]) -> Result<T>,
    ) -> Result<T> {
        let mut bufs = vec![];
        let mut made = Ok(());
        for &(dtype, len) in specs {
            match self.alloc(dtype, len) {
                Ok(b) => bufs.push(b),
                Err(e) => {
                    made = Err(e);
                    break;
                }
            }
        }
        let result = made.and_then(|()| f(&bufs));
        for b in bufs {
            // Only an unknown buffer fails to free: these are all this device's.
            let _ = self.free(b);
        }
        result
    }

    /// Holds the primer before its next block (tests see the stand-ins run), or lets
    /// it go on.
    #[doc(hidden)]
    pub fn hold_primer(&self, held: bool) {
        if let Some(p) = &self.primer {
            p.hold(held);
        }
    }
}
