//! The one error type every backend returns. Each message names the problem and the fix.

use crate::DType;

pub type Result<T, E = Error> = std::result::Result<T, E>;

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("dtype mismatch: {what} is {found} but {expected} was expected")]
    DTypeMismatch {
        what: String,
        expected: DType,
        found: DType,
    },

    #[error("length mismatch: {what} has {found} elements but {expected} were expected")]
    LenMismatch {
        what: String,
        expected: usize,
        found: usize,
    },

    #[error(
        "buffer #{id} is not allocated on device `{device}` (it was freed, or belongs to another device)"
    )]
    UnknownBuffer { id: u64, device: String },

    #[error("out of device memory on `{device}`: {detail}")]
    OutOfMemory { device: String, detail: String },

    #[error("no adapter with index {index}: {available} adapter(s) found. Run `kiln devices` to list them")]
    NoSuchAdapter { index: usize, available: usize },

    #[error("no GPU adapter found. {hint}")]
    NoAdapter { hint: String },

    #[error("`{device}` does not support {what}")]
    Unsupported { device: String, what: String },

    #[error("invalid argument: {0}")]
    InvalidArgument(String),

    #[error("device error on `{device}`: {detail}")]
    Backend { device: String, detail: String },

    /// The gradients stayed non-finite: the run cannot make progress, and continuing
    /// it unchanged (a resume included) repeats the failure.
    #[error("training diverged at step {step}: {detail}")]
    Diverged { step: u64, detail: String },
}

impl From<crate::device::dtype::UnknownDType> for Error {
    fn from(e: crate::device::dtype::UnknownDType) -> Error {
        Error::InvalidArgument(e.to_string())
    }
}
