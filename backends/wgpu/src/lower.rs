//! The backend-neutral half of a launch: how each engine `Kernel` becomes dispatches of
//! the WGSL kernels in `shaders/` (`launch.rs`, GEMMs in `matmul.rs`, attention in
//! `attention.rs`), written once against [`Recorder`]. The wgpu device records them
//! through wgpu; `kiln-vulkan` records the same dispatches (the same WGSL, translated
//! to SPIR-V by naga) through raw Vulkan, so both backends run one op set.

use kiln_engine::{Buffer, Capabilities, DType, Kernel, Result};

use crate::shader::{KernelSource, Repr};

/// Internal buffer ids live at the top of the id space, apart from user buffers; a
/// [`Recorder`] binds its own buffers for them.
/// Partials of a reduction's first pass (f32 x `REDUCE_GROUPS`); also bound where a
/// kernel's optional writable operand is absent.
pub const SCRATCH_ID: u64 = u64::MAX;
/// The reusable partials buffer [`Recorder::partials`] sizes (split-K GEMMs, the
/// norms' backward statistics, attention's row sums).
pub const PARTIALS_ID: u64 = u64::MAX - 1;
/// Bound read-only where a kernel's optional input is absent (16 bytes).
pub const DUMMY_ID: u64 = u64::MAX - 2;
/// Partials of a reduction over a buffer bound band by band (f32 x `REDUCE_GROUPS` x
/// `MAX_BANDS`).
pub const BAND_PARTIALS_ID: u64 = u64::MAX - 3;

/// Bytes the [`SCRATCH_ID`] buffer holds.
pub fn scratch_bytes() -> u64 {
    DType::F32.padded_bytes(crate::launch::REDUCE_GROUPS as usize)
}

/// Bytes the [`BAND_PARTIALS_ID`] buffer holds.
pub fn band_partials_bytes() -> u64 {
    DType::F32.padded_bytes(crate::launch::REDUCE_GROUPS as usize * crate::launch::MAX_BANDS)
}

/// Bytes of the [`DUMMY_ID`] buffer.
pub const DUMMY_BYTES: u64 = 16;

/// Where a dispatch's pipeline stands (see [`Recorder::readiness`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Readiness {
    /// Built: a dispatch records at once.
    Ready,
    /// A compile worker is building it: a dispatch would wait for that build.
    Building,
    /// Nobody asked for it: a dispatch builds it on the spot.
    Absent,
}

/// One dispatch, before a backend records it.
#[derive(Clone, Debug)]
pub struct Dispatch {
    pub kernel: &'static KernelSource,
    pub reprs: Vec<Repr>,
    /// Assembly-time constants (tile shapes); each set is its own module.
    pub consts: Vec<(&'static str, u32)>,
    /// Pipeline-overridable constants (`override` in WGSL), as u32 (bools: 0 or 1).
    pub overrides: Vec<(&'static str, u32)>,
    /// The buffer id bound at each slot (binding 1, 2, …), in slot order: a user
    /// buffer or view, or one of the internal ids above.
    pub buffers: Vec<u64>,
    /// (slot, byte offset, byte size) for slots bound to part of their buffer; offsets
    /// are relative to a view's start.
    pub ranges: Vec<(usize, u64, u64)>,
    /// The launch parameters (the uniform at binding 0), as 32-bit words.
    pub params: Vec<u32>,
    pub groups: (u32, u32, u32),
}

impl Dispatch {
    /// A dispatch with no assembly constants, overrides or partial bindings.
    pub fn new(
        kernel: &'static KernelSource,
        reprs: Vec<Repr>,
        buffers: Vec<u64>,
        params: Vec<u32>,
        groups: (u32, u32, u32),
    ) -> Dispatch {
        Dispatch {
            kernel,
            reprs,
            consts: vec![],
            overrides: vec![],
            buffers,
            ranges: vec![],
            params,
            groups,
        }
    }

    pub fn with_overrides(mut self, overrides: Vec<(&'static str, u32)>) -> Dispatch {
        self.overrides = overrides;
        self
    }
}

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
    /// Makes the [`PARTIALS_ID`] buffer at least `bytes` long for the dispatches
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
    /// (`best`: the table's plan; `state`: where each block's pipeline stands; `ran`:
    /// whether it has run, see [`Recorder::has_run`]); `None` keeps the table's.
    fn tuned_block(
        &self,
        _s: &mut Self::State,
        _mm: &kiln_engine::Matmul,
        _best: &crate::matmul::MatmulPlan,
        _state: &dyn Fn(crate::matmul::MatmulVariant) -> Readiness,
        _ran: &dyn Fn(crate::matmul::MatmulVariant) -> bool,
    ) -> Result<Option<crate::matmul::MatmulVariant>> {
        Ok(None)
    }
    /// How a float dtype is stored in the kernels on this device.
    fn repr(&self, dtype: DType) -> Repr {
        Repr::of(dtype, self.caps().f16_arithmetic)
    }
}

/// Records `kernel` (validated, its buffers live on the device) through `r`.
pub fn record_kernel<R: Recorder + ?Sized>(r: &R, s: &mut R::State, kernel: &Kernel) -> Result<()> {
    crate::launch::Lower::record_kernel(r, s, kernel)
}
