//! Element types a device buffer can hold.

use std::fmt;

/// Storage type of a device buffer.
///
/// `F16` and `BF16` are always stored as 16 bits, whatever the adapter can compute in;
/// arithmetic on them happens in f32 unless a kernel says otherwise.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum DType {
    F32,
    F16,
    BF16,
    U32,
}

impl DType {
    pub const ALL: [DType; 4] = [DType::F32, DType::F16, DType::BF16, DType::U32];
    pub const FLOATS: [DType; 3] = [DType::F32, DType::F16, DType::BF16];

    /// Bytes per element.
    pub fn size(self) -> usize {
        match self {
            DType::F32 | DType::U32 => 4,
            DType::F16 | DType::BF16 => 2,
        }
    }

    pub fn is_float(self) -> bool {
        !matches!(self, DType::U32)
    }

    pub fn name(self) -> &'static str {
        match self {
            DType::F32 => "f32",
            DType::F16 => "f16",
            DType::BF16 => "bf16",
            DType::U32 => "u32",
        }
    }

    /// Bytes a device allocates for `len` elements.
    ///
    /// Kernels work on pairs of elements (one 32-bit word of 16-bit values, or a
    /// `vec2<f32>`), so every buffer is padded to an even element count. The pad
    /// element is never visible to the host and never counted by reductions.
    pub fn padded_bytes(self, len: usize) -> u64 {
        let even = len.div_ceil(2) * 2;
        (even.max(2) * self.size()) as u64
    }
}

impl fmt::Display for DType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// A name that is no dtype (`Error::InvalidArgument` through `?`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct UnknownDType(pub String);

impl fmt::Display for UnknownDType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "unknown dtype `{}`: expected one of f32, f16, bf16, u32",
            self.0
        )
    }
}

impl std::error::Error for UnknownDType {}

impl std::str::FromStr for DType {
    type Err = UnknownDType;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.to_ascii_lowercase().as_str() {
            "f32" | "fp32" | "float32" => Ok(DType::F32),
            "f16" | "fp16" | "float16" | "half" => Ok(DType::F16),
            "bf16" | "bfloat16" => Ok(DType::BF16),
            "u32" | "uint32" => Ok(DType::U32),
            _ => Err(UnknownDType(s.to_string())),
        }
    }
}
