//! One dispatch as the lowering hands it to a backend ([`Dispatch`]), the internal
//! buffers it may bind, and the launch-geometry constants every lowering shares.

use kiln_engine::DType;

use crate::shader::{KernelSource, Repr};

/// Workgroup size of the elementwise kernels, and the most workgroups in one dimension.
pub const WORKGROUP: u32 = 256;
pub const MAX_GROUPS: u32 = 65535;
/// Workgroups in the first pass of a reduction, so also the partials the second folds.
pub const REDUCE_GROUPS: u32 = 256;
/// The most bands one reduction folds; its partials live in the scratch buffer.
pub const MAX_BANDS: usize = 64;

/// Workgroups for a grid-strided walk over `words` items.
pub fn groups(words: u32) -> u32 {
    words.div_ceil(WORKGROUP).clamp(1, MAX_GROUPS)
}

/// Internal buffer ids live at the top of the id space, apart from user buffers; a
/// [`Recorder`](crate::Recorder) binds its own buffers for them.
/// Partials of a reduction's first pass (f32 x `REDUCE_GROUPS`); also bound where a
/// kernel's optional writable operand is absent.
pub const SCRATCH_ID: u64 = u64::MAX;
/// The reusable partials buffer [`Recorder::partials`](crate::Recorder::partials) sizes (split-K GEMMs, the
/// norms' backward statistics, attention's row sums).
pub const PARTIALS_ID: u64 = u64::MAX - 1;
/// Bound read-only where a kernel's optional input is absent (16 bytes).
pub const DUMMY_ID: u64 = u64::MAX - 2;
/// Partials of a reduction over a buffer bound band by band (f32 x `REDUCE_GROUPS` x
/// `MAX_BANDS`).
pub const BAND_PARTIALS_ID: u64 = u64::MAX - 3;

/// Bytes the [`SCRATCH_ID`] buffer holds.
pub fn scratch_bytes() -> u64 {
    DType::F32.padded_bytes(REDUCE_GROUPS as usize)
}

/// Bytes the [`BAND_PARTIALS_ID`] buffer holds.
pub fn band_partials_bytes() -> u64 {
    DType::F32.padded_bytes(REDUCE_GROUPS as usize * MAX_BANDS)
}

/// Bytes of the [`DUMMY_ID`] buffer.
pub const DUMMY_BYTES: u64 = 16;

/// Where a dispatch's pipeline stands (see [`Recorder::readiness`](crate::Recorder::readiness)).
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
