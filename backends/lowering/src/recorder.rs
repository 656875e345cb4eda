//! What a backend provides to record the lowered kernels ([`Recorder`]): the one
//! interface between the shared lowering and a device's command stream.

use kiln_engine::{Buffer, Capabilities, DType, Result};

use crate::dispatch::{Dispatch, Readiness};
use crate::shader::Repr;

/// What a backend provides to record the lowered kernels into its stream.
pub trait Recorder {
    /// The backend's recording state (its open stream), locked by the caller.
    type State;
    fn caps(&self) -> &Capabilities;
    /// Records one dispatch, in order after everything recorded before it.
    fn dispatch(&self, s: &mut Self::State, d: Dispatch) -> Result<()>;
    /// Copies `src` into `dst` (same size; they may be views of one buffer).
    fn copy(&self, s: &mut Self::State, src: &Buffer, dst: &Buffer) -> Result<()>;
    /// Zeroes `buf`.
    fn clear(&self, s: &mut Self::State, buf: &Buffer) -> Result<()>;
    /// Makes the [`PARTIALS_ID`](crate::PARTIALS_ID) buffer at least `bytes` long for the dispatches
    /// recorded next (earlier dispatches keep the buffer they were recorded with).
    fn partials(&self, s: &mut Self::State, bytes: u64) -> Result<()>;
    /// Byte alignment a partial binding's offset needs.
    fn storage_offset_alignment(&self) -> u64;
    /// Whether the pipeline `d` runs is built, still building on a compile worker, or
    /// not asked for yet. Backends that build pipelines only when first recorded say
    /// `Ready`: nothing is ever waited for there but the build a dispatch starts itself.
    fn readiness(&self, _s: &Self::State, _d: &Dispatch) -> Readiness {
        Readiness::Ready
    }
    /// Whether the pipeline `d` runs has run on this device, so that its machine code
    /// is compiled: a software driver (lavapipe) compiles it at the first run, seconds
    /// for a large GEMM block on a cold cache. Backends without that cost say `true`.
    fn has_run(&self, _s: &Self::State, _d: &Dispatch) -> bool {
        true
    }
    /// While `prepare` lists the pipelines a plan needs: also build `d`'s (a stand-in
    /// a launch may run while its own pipeline builds). Elsewhere nothing.
    fn want_ahead(&self, _s: &mut Self::State, _d: Dispatch) {}
    /// Counts a GEMM launch that ran another block than its plan's while that one built.
    fn note_stand_in(&self, _s: &mut Self::State, _planned: &str, _ran: &str) {}
    /// The measured block for `mm` where the backend selects blocks by timing them
    /// (`best`: the table's plan; `state`: where a block's pipeline stands; `ran`:
    /// whether it has run, see [`Recorder::has_run`]); `None` keeps the table's. Both
    /// plan the block they are asked about, so a launch whose winner is known asks
    /// about none but the winner.
    fn tuned_block(
        &self,
        _s: &mut Self::State,
        _mm: &kiln_engine::Matmul,
        _best: &crate::gemm_plan::MatmulPlan,
        _state: &dyn Fn(&Self::State, crate::gemm_plan::MatmulVariant) -> Readiness,
        _ran: &dyn Fn(&Self::State, crate::gemm_plan::MatmulVariant) -> bool,
    ) -> Result<Option<crate::gemm_plan::MatmulVariant>> {
        Ok(None)
    }
    /// How a float dtype is stored in the kernels on this device.
    fn repr(&self, dtype: DType) -> Repr {
        Repr::of(dtype, self.caps().f16_arithmetic)
    }
}
