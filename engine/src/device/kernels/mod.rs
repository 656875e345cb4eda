//! The kernels a device can launch, described as plain data: one struct per kernel
//! ([`Gelu`], [`Attention`], [`Matmul`], ...) holding its operands and parameters, and
//! beside it, in its family's file, all the engine knows about it ([`KernelSpec`]): its
//! name, its buffers (which it writes, which a backend must bind whole), its argument
//! checks and its cost. [`Kernel`] is the list a backend matches on.
//!
//! Describing launches as data keeps the device trait small and object-safe. A new
//! kernel is a struct and its `KernelSpec` in a family file here, one line in
//! `kernels!` below, and one lowering per backend (docs/extending.md).

mod attention;
mod cache;
mod check;
mod dropout;
mod elementwise;
mod embedding;
mod heads;
mod loss;
pub mod matmul;
mod memory;
mod norm;
pub mod optim_step;
mod reduce;
mod rotary;
mod softmax;

pub use attention::{Attention, AttentionBackward, Documents, ATTENTION_MAX_DIM};
pub use cache::{CacheLayout, CacheWrite, CachedAttention};
pub use dropout::{
    dropout_hash, dropout_scale, dropout_seed, dropout_threshold, Dropout, DropoutBackward,
};
pub use elementwise::{
    Activation, ActivationBackward, ActivationKind, Axpy, Binary, BinaryOp, Gelu, GeluBackward,
    Scale, SwiGlu, SwiGluBackward,
};
pub use embedding::{Embedding, EmbeddingBackward};
pub use heads::{HeadsLayout, MergeHeads, SplitHeads};
pub use loss::{
    mse_grad_factor, CrossEntropy, CrossEntropyBackward, MseBackward, MseLoss, IGNORE_TARGET,
};
pub use matmul::Matmul;
pub use memory::{Cast, Copy, Fill};
pub use norm::{LayerNorm, LayerNormBackward, RmsNorm, RmsNormBackward};
pub use optim_step::{AdamStep, SgdStep};
pub use reduce::{ArgMax, GradScale, NonFinite, Reduce, ReduceOp, ARGMAX_MAX_CLASSES};
pub use rotary::{Rope, RopeAt, ROPE_MAX_SEQ};
pub use softmax::{Softmax, SoftmaxBackward};

use crate::device::cost::{bytes_of, KernelCost};
use crate::{Buffer, Error, Result};

/// What the engine knows of a kernel, kept with its struct: every backend, the plan's
/// liveness, the memory check and the profiler read it through [`Kernel`].
pub trait KernelSpec: Clone {
    /// Short name for logs, errors and profiles (`"gelu"`, `"attention_backward"`).
    fn name(&self) -> &'static str;

    /// Every buffer field, in a fixed order, with whether the launch writes it and
    /// whether a backend binds it whole (else it may split it at the binding limit).
    fn operands_mut(&mut self) -> Vec<Operand<'_>>;

    /// Argument checks (dtypes, lengths, shapes, parameters), each error naming the
    /// kernel, the operand and the fix. Aliasing is checked for every kernel by
    /// [`Kernel::validate`](crate::Kernel::validate).
    fn check(&self) -> Result<()>;

    /// Floating-point operations per element of the largest operand, what the formula
    /// needs in f32 (a transcendental counts as one), for [`KernelSpec::cost`]'s default.
    fn flops_per_element(&self) -> f64;

    /// FLOPs and bytes moved (see `device/cost.rs`). The default suits kernels that
    /// iterate over their largest operand: every operand read or written once.
    fn cost(&self) -> KernelCost {
        let buffers = self.buffers();
        let n = buffers.iter().map(|b| b.len).max().unwrap_or(0) as f64;
        KernelCost::of(
            self.name(),
            self.flops_per_element() * n,
            buffers.iter().map(bytes_of).sum(),
        )
    }

    /// Every buffer the launch touches, in the order of `operands_mut`.
    fn buffers(&self) -> Vec<Buffer> {
        self.clone()
            .operands_mut()
            .into_iter()
            .map(|o| *o.buf)
            .collect()
    }
}

macro_rules! kernels {
    ($($variant:ident($ty:ty)),* $(,)?) => {
        /// One kernel launch. Float operands may each have their own dtype (f32, f16,
        /// bf16): values are widened to f32, computed in f32 and rounded to nearest-even
        /// on store. Each variant's struct documents its contract.
        #[derive(Clone, Debug, PartialEq)]
        pub enum Kernel {
            $($variant($ty)),*
        }

        impl Kernel {
            /// Short name for logs and errors.
            pub fn name(&self) -> &'static str {
                match self { $(Kernel::$variant(k) => k.name()),* }
            }

            /// Each kernel's buffers in one table (see [`KernelSpec::operands_mut`]):
            /// [`Kernel::buffers`](crate::Kernel::buffers), [`Kernel::buffers_mut`](crate::Kernel::buffers_mut), [`Kernel::written`](crate::Kernel::written) and
            /// [`Kernel::bound_whole`](crate::Kernel::bound_whole) all read it.
            pub fn operands_mut(&mut self) -> Vec<Operand<'_>> {
                match self { $(Kernel::$variant(k) => k.operands_mut()),* }
            }

            fn check(&self) -> Result<()> {
                match self { $(Kernel::$variant(k) => k.check()),* }
            }

            /// The launch's kind, label, FLOPs and bytes (see `device/cost.rs`).
            pub fn cost(&self) -> KernelCost {
                match self { $(Kernel::$variant(k) => k.cost()),* }
            }
        }

        $(impl From<$ty> for Kernel {
            fn from(k: $ty) -> Kernel {
                Kernel::$variant(k)
            }
        })*
    };
}

kernels! {
    Fill(Fill),
    Copy(Copy),
    Cast(Cast),
    Binary(Binary),
    Scale(Scale),
    Axpy(Axpy),
    Reduce(Reduce),
    NonFinite(NonFinite),
    Matmul(Matmul),
    GradScale(GradScale),
    Adam(AdamStep),
    Sgd(SgdStep),
    Gelu(Gelu),
    GeluBackward(GeluBackward),
    Activation(Activation),
    ActivationBackward(ActivationBackward),
    Dropout(Dropout),
    DropoutBackward(DropoutBackward),
    MseLoss(MseLoss),
    MseBackward(MseBackward),
    LayerNorm(LayerNorm),
    Softmax(Softmax),
    SoftmaxBackward(SoftmaxBackward),
    Attention(Attention),
    AttentionBackward(AttentionBackward),
    SplitHeads(SplitHeads),
    MergeHeads(MergeHeads),
    CrossEntropy(CrossEntropy),
    CrossEntropyBackward(CrossEntropyBackward),
    Embedding(Embedding),
    EmbeddingBackward(EmbeddingBackward),
    LayerNormBackward(LayerNormBackward),
    RmsNorm(RmsNorm),
    RmsNormBackward(RmsNormBackward),
    Rope(Rope),
    SwiGlu(SwiGlu),
    SwiGluBackward(SwiGluBackward),
    RopeAt(RopeAt),
    CacheWrite(CacheWrite),
    CachedAttention(CachedAttention),
    ArgMax(ArgMax),
}

impl Kernel {
    /// Checks dtypes, lengths and aliasing; backends call this before recording anything.
    pub fn validate(&self) -> Result<()> {
        self.check()?;
        // A buffer a launch writes may not be any of its other operands: GPUs cannot
        // bind one buffer both read-only and writable in a dispatch, and in-place
        // variants of these kernels would race.
        let all = self.buffers();
        for w in self.written() {
            if all.iter().filter(|b| b.id == w.id).count() > 1 {
                return Err(Error::InvalidArgument(format!(
                    "{}: buffer #{} is both written and used as another operand; write to a separate buffer",
                    self.name(),
                    w.id
                )));
            }
        }
        Ok(())
    }

    /// Every buffer the launch touches.
    pub fn buffers(&self) -> Vec<Buffer> {
        self.clone()
            .operands_mut()
            .into_iter()
            .map(|o| *o.buf)
            .collect()
    }

    /// The buffers a backend must bind whole, so each must fit one storage binding
    /// ([`crate::Capabilities::max_storage_binding`]). Backends split the rest at that
    /// limit: a GEMM's operands, elementwise kernels, reductions, the overflow check,
    /// the optimizer steps over flat buffers, the embedding backward's table. The
    /// model's memory check refuses, before anything is allocated, a buffer here over
    /// the limit.
    pub fn bound_whole(&self) -> Vec<Buffer> {
        let mut k = self.clone();
        let ops = k.operands_mut();
        ops.into_iter()
            .filter(|o| o.whole)
            .map(|o| *o.buf)
            .collect()
    }

    /// Every buffer field of the launch, mutably, in the order of [`Kernel::buffers`](crate::Kernel::buffers): a
    /// plan records launches over placeholders and rewrites them to device buffers.
    pub fn buffers_mut(&mut self) -> Vec<&mut Buffer> {
        self.operands_mut().into_iter().map(|o| o.buf).collect()
    }

    /// Buffers the launch writes (an accumulating kernel's destination included).
    pub fn written(&self) -> Vec<Buffer> {
        let mut k = self.clone();
        let ops = k.operands_mut();
        ops.into_iter()
            .filter(|o| o.written)
            .map(|o| *o.buf)
            .collect()
    }
}

/// One buffer of a launch, as [`Kernel::operands_mut`](crate::Kernel::operands_mut) lists it.
#[derive(Debug)]
pub struct Operand<'a> {
    pub buf: &'a mut Buffer,
    /// The launch writes it (wholly, or adds into it).
    pub written: bool,
    /// A backend binds it whole: it must fit one storage binding.
    pub whole: bool,
}

impl<'a> Operand<'a> {
    pub(crate) fn read(buf: &'a mut Buffer) -> Operand<'a> {
        Operand {
            buf,
            written: false,
            whole: true,
        }
    }

    pub(crate) fn write(buf: &'a mut Buffer) -> Operand<'a> {
        Operand {
            buf,
            written: true,
            whole: true,
        }
    }

    pub(crate) fn read_split(buf: &'a mut Buffer) -> Operand<'a> {
        Operand {
            buf,
            written: false,
            whole: false,
        }
    }

    pub(crate) fn write_split(buf: &'a mut Buffer) -> Operand<'a> {
        Operand {
            buf,
            written: true,
            whole: false,
        }
    }
}
