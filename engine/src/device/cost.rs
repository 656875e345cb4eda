//! What a launch costs, from its shapes alone: floating-point operations and bytes of
//! device memory moved. The profiler divides these by measured kernel times to give
//! achieved GFLOP/s and GB/s, and sums the FLOPs of a step for its MFU.
//!
//! The counts are the work the mathematics needs, not what a particular kernel does: a
//! GEMM is `2·M·N·K` whatever its tiling, and bytes count each operand read once and
//! each result written once (an ideal cache). Elementwise and normalisation kernels
//! count a small fixed number of operations per element, stated below; they are
//! bandwidth-bound, so their GB/s is the figure that matters.

use crate::Buffer;

/// A launch's description for a profile: its kind, a label that separates launches
/// worth telling apart (GEMMs by shape, operand layout and dtype) and its cost.
#[derive(Clone, Debug, PartialEq)]
pub struct KernelCost {
    /// The kernel's short name ([`Kernel::name`](crate::Kernel::name)): `matmul`, `attention`, `adam`, ...
    pub kind: &'static str,
    /// `kind`, plus for GEMMs `M×N×K`, layouts, batch and dtype.
    pub label: String,
    /// Floating-point operations (a fused multiply-add counts 2).
    pub flops: f64,
    /// Bytes of device memory read and written.
    pub bytes: f64,
}

impl KernelCost {
    /// A cost labelled by its kind alone.
    pub fn of(kind: &'static str, flops: f64, bytes: f64) -> KernelCost {
        KernelCost {
            kind,
            label: kind.to_string(),
            flops,
            bytes,
        }
    }
}

pub(crate) fn bytes_of(b: &Buffer) -> f64 {
    (b.len * b.dtype.size()) as f64
}

/// Scores a causal attention computes out of `seq²`: row `i` sees `i + 1` keys.
pub(crate) fn causal_share(seq: usize, causal: bool) -> f64 {
    if causal && seq > 0 {
        (seq + 1) as f64 / (2 * seq) as f64
    } else {
        1.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::{self, Binary};
    use crate::{BinaryOp, DType, Kernel, Matmul};

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
        let k = Kernel::Binary(Binary {
            op: BinaryOp::Add,
            a: buf(0, DType::F16, 1000),
            b: buf(1, DType::F16, 1000),
            out: buf(2, DType::F16, 1000),
        });
        let c = k.cost();
        assert_eq!((c.kind, c.label.as_str()), ("add", "add"));
        assert_eq!(c.flops, 1000.0);
        assert_eq!(c.bytes, 3.0 * 1000.0 * 2.0);
    }

    #[test]
    fn causal_attention_counts_the_scores_it_computes() {
        // 2 heads, seq 4, dim 8: causal rows see 1+2+3+4 = 10 of 16 keys.
        let b = |id, len| buf(id, DType::F32, len);
        let k = Kernel::Attention(kernels::Attention {
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
            documents: None,
        });
        assert_eq!(k.cost().flops, 4.0 * 2.0 * 10.0 * 8.0);
        assert_eq!(k.cost().bytes, (4.0 * 64.0 + 8.0) * 4.0);
    }
}
