//! What a launch costs, from its shapes alone: floating-point operations and bytes of
//! device memory moved. The profiler divides these by measured kernel times to give
//! achieved GFLOP/s and GB/s, and sums the FLOPs of a step for its MFU.
//!
//! The counts are the work the mathematics needs, not what a particular kernel does: a
//! GEMM is `2·M·N·K` whatever its tiling, and bytes count each operand read once and
//! each result written once (an ideal cache). Elementwise and normalisation kernels
//! count a small fixed number of operations per element, stated below; they are
//! bandwidth-bound, so their GB/s is the figure that matters.

use crate::{Buffer, Kernel};

/// A launch's description for a profile: its kind, a label that separates launches
/// worth telling apart (GEMMs by shape, operand layout and dtype) and its cost.
#[derive(Clone, Debug, PartialEq)]
pub struct KernelCost {
    /// The kernel's short name ([`Kernel::name`]): `matmul`, `attention`, `adam`, ...
    pub kind: &'static str,
    /// `kind`, plus for GEMMs `M×N×K`, layouts, batch and dtype.
    pub label: String,
    /// Floating-point operations (a fused multiply-add counts 2).
    pub flops: f64,
    /// Bytes of device memory read and written.
    pub bytes: f64,
}

fn bytes_of(b: &Buffer) -> f64 {
    (b.len * b.dtype.size()) as f64
}

/// Operations per output element of the non-GEMM kernels: what their formulas need in
/// f32 (a transcendental counts as one), rounded to whole numbers.
fn per_element(kernel: &Kernel) -> f64 {
    match kernel {
        Kernel::Fill { .. }
        | Kernel::Copy { .. }
        | Kernel::Cast { .. }
        | Kernel::SplitHeads { .. }
        | Kernel::MergeHeads { .. }
        | Kernel::Embedding { .. }
        | Kernel::CacheWrite { .. } => 0.0,
        Kernel::Binary { .. } | Kernel::Scale { .. } | Kernel::Reduce { .. } => 1.0,
        Kernel::NonFinite { .. } | Kernel::EmbeddingBackward { .. } => 1.0,
        Kernel::Axpy { .. } | Kernel::Dropout { .. } | Kernel::DropoutBackward { .. } => 2.0,
        Kernel::Activation { .. } | Kernel::ActivationBackward { .. } => 4.0,
        Kernel::Gelu { .. } | Kernel::GeluBackward { .. } => 8.0,
        Kernel::MseLoss { .. } | Kernel::MseBackward { .. } => 3.0,
        Kernel::Softmax { .. } | Kernel::CrossEntropy { .. } => 5.0,
        Kernel::SoftmaxBackward { .. } | Kernel::CrossEntropyBackward { .. } => 4.0,
        Kernel::LayerNorm { .. } | Kernel::RmsNorm { .. } => 8.0,
        Kernel::LayerNormBackward { .. } | Kernel::RmsNormBackward { .. } => 12.0,
        Kernel::Rope { .. } | Kernel::RopeAt { .. } | Kernel::SwiGlu { .. } => 6.0,
        Kernel::SwiGluBackward { .. } => 10.0,
        Kernel::Sgd(_) => 6.0,
        Kernel::Adam(_) => 14.0,
        Kernel::GradScale { .. } => 4.0,
        // Counted from their shapes in `cost`.
        Kernel::Matmul(_)
        | Kernel::Attention { .. }
        | Kernel::AttentionBackward { .. }
        | Kernel::CachedAttention { .. } => 0.0,
    }
}

/// Scores a causal attention computes out of `seq²`: row `i` sees `i + 1` keys.
fn causal_share(seq: usize, causal: bool) -> f64 {
    if causal && seq > 0 {
        (seq + 1) as f64 / (2 * seq) as f64
    } else {
        1.0
    }
}

impl Kernel {
    /// The launch's kind, label, FLOPs and bytes (see the module's notes).
    pub fn cost(&self) -> KernelCost {
        let kind = self.name();
        let (label, flops, bytes) = match self {
            Kernel::Matmul(mm) => {
                let (m, n, k, b) = (mm.m as f64, mm.n as f64, mm.k as f64, mm.batch as f64);
                let a_size = mm.a.dtype.size() as f64;
                let b_size = mm.b.dtype.size() as f64;
                let c_size = mm.c.dtype.size() as f64;
                let reads_c = mm.beta != 0.0;
                let mut flops = 2.0 * m * n * k;
                let mut bytes = m * k * a_size + k * n * b_size + m * n * c_size;
                if reads_c {
                    flops += 2.0 * m * n;
                    bytes += m * n * c_size;
                }
                if mm.bias.is_some() {
                    flops += m * n;
                }
                if mm.gelu {
                    flops += 8.0 * m * n;
                }
                if mm.c_f32.is_some() {
                    bytes += m * n * 4.0;
                }
                bytes *= b;
                // The bias is one row shared by the batch.
                bytes += mm.bias.as_ref().map_or(0.0, bytes_of);
                let layout = format!(
                    "{}{}",
                    if mm.trans_a { 'T' } else { 'N' },
                    if mm.trans_b { 'T' } else { 'N' }
                );
                let batch = if mm.batch > 1 {
                    format!(" x{}", mm.batch)
                } else {
                    String::new()
                };
                let label = format!(
                    "matmul {}x{}x{} {layout}{batch} {}",
                    mm.m, mm.n, mm.k, mm.c.dtype
                );
                (label, flops * b, bytes)
            }
            Kernel::Attention {
                q,
                k,
                v,
                out,
                lse,
                batch_heads,
                seq,
                dim,
                causal,
                ..
            } => {
                // q·kᵀ and p·v: two GEMMs of seq × seq × dim per head.
                let pairs = (*batch_heads * seq * seq) as f64 * causal_share(*seq, *causal);
                let flops = 4.0 * pairs * *dim as f64;
                let bytes = [q, k, v, out, lse].into_iter().map(bytes_of).sum();
                (kind.to_string(), flops, bytes)
            }
            Kernel::AttentionBackward {
                batch_heads,
                seq,
                dim,
                causal,
                ..
            } => {
                // Recomputed q·kᵀ, then dv = pᵀ·dout, dp = dout·vᵀ, dq = ds·k, dk = dsᵀ·q.
                let pairs = (*batch_heads * seq * seq) as f64 * causal_share(*seq, *causal);
                let flops = 10.0 * pairs * *dim as f64;
                let bytes = self.buffers().iter().map(bytes_of).sum();
                (kind.to_string(), flops, bytes)
            }
            Kernel::CachedAttention {
                q,
                heads,
                dim,
                width,
                max_len,
                ..
            } => {
                // At most `max_len` keys per query row and head (positions are on the
                // device, so the bound is what the shapes give).
                let rows = (q.len / (*width).max(1)) as f64;
                let flops = 4.0 * rows * (*heads * *max_len * *dim) as f64;
                let bytes = self.buffers().iter().map(bytes_of).sum();
                (kind.to_string(), flops, bytes)
            }
            Kernel::Adam(a) => {
                // Master weights and both moments are read and written; gradients read;
                // the low-precision copy, if any, written.
                let n = a.master.len as f64;
                let bytes = 2.0 * (bytes_of(&a.master) + bytes_of(&a.m) + bytes_of(&a.v))
                    + bytes_of(&a.grads)
                    + a.params.as_ref().map_or(0.0, bytes_of);
                (kind.to_string(), per_element(self) * n, bytes)
            }
            Kernel::Sgd(s) => {
                let n = s.master.len as f64;
                let bytes = 2.0 * (bytes_of(&s.master) + bytes_of(&s.momentum_buf))
                    + bytes_of(&s.grads)
                    + s.params.as_ref().map_or(0.0, bytes_of);
                (kind.to_string(), per_element(self) * n, bytes)
            }
            k => {
                // Every operand read or written once; work counted per element of the
                // largest operand (the one the kernel iterates over).
                let buffers = k.buffers();
                let n = buffers.iter().map(|b| b.len).max().unwrap_or(0) as f64;
                let bytes = buffers.iter().map(bytes_of).sum();
                (kind.to_string(), per_element(k) * n, bytes)
            }
        };
        KernelCost {
            kind,
            label,
            flops,
            bytes,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{BinaryOp, DType, Matmul};

    fn buf(id: u64, dtype: DType, len: usize) -> Buffer {
        Buffer { id, dtype, len }
    }

    #[test]
    fn a_batched_gemm_counts_two_flops_per_multiply_add_and_each_operand_once() {
        // Two 64x16 by 16x32 products in f32: 2·64·32·16 = 65536 FLOPs each; A 64·16,
        // B 16·32 and C 64·32 elements of 4 bytes each per product.
        let mut mm = Matmul::new(
            buf(0, DType::F32, 2 * 64 * 16),
            buf(1, DType::F32, 2 * 16 * 32),
            buf(2, DType::F32, 2 * 64 * 32),
            64,
            32,
            16,
        );
        mm.batch = 2;
        mm.stride_a = 64 * 16;
        mm.stride_b = 16 * 32;
        mm.stride_c = 64 * 32;
        let c = Kernel::Matmul(mm.clone()).cost();
        assert_eq!(c.kind, "matmul");
        assert_eq!(c.label, "matmul 64x32x16 NN x2 f32");
        assert_eq!(c.flops, 131072.0);
        assert_eq!(c.bytes, 2.0 * (1024.0 + 512.0 + 2048.0) * 4.0);

        // Accumulating into C (beta 1) reads C too and adds 2 FLOPs per element of C; a
        // bias adds one FLOP per element and its 32 elements once.
        mm.beta = 1.0;
        mm.bias = Some(buf(3, DType::F16, 32));
        mm.trans_b = true;
        let c = Kernel::Matmul(mm).cost();
        assert_eq!(c.label, "matmul 64x32x16 NT x2 f32");
        assert_eq!(c.flops, 2.0 * (65536.0 + 2.0 * 2048.0 + 2048.0));
        assert_eq!(c.bytes, 2.0 * (1024.0 + 512.0 + 2.0 * 2048.0) * 4.0 + 64.0);
    }

    #[test]
    fn an_elementwise_add_is_one_flop_and_three_accesses_per_element() {
        let k = Kernel::Binary {
            op: BinaryOp::Add,
            a: buf(0, DType::F16, 1000),
            b: buf(1, DType::F16, 1000),
            out: buf(2, DType::F16, 1000),
        };
        let c = k.cost();
        assert_eq!((c.kind, c.label.as_str()), ("add", "add"));
        assert_eq!(c.flops, 1000.0);
        assert_eq!(c.bytes, 3.0 * 1000.0 * 2.0);
    }

    #[test]
    fn causal_attention_counts_the_scores_it_computes() {
        // 2 heads, seq 4, dim 8: causal rows see 1+2+3+4 = 10 of 16 keys.
        let b = |id, len| buf(id, DType::F32, len);
        let k = Kernel::Attention {
            q: b(0, 64),
            k: b(1, 64),
            v: b(2, 64),
            out: b(3, 64),
            lse: b(4, 8),
            batch_heads: 2,
            group: 1,
            seq: 4,
            dim: 8,
            scale: 1.0,
            causal: true,
        };
        assert_eq!(k.cost().flops, 4.0 * 2.0 * 10.0 * 8.0);
        assert_eq!(k.cost().bytes, (4.0 * 64.0 + 8.0) * 4.0);
    }
}
