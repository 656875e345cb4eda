//! Host-side copies of device buffers.

use half::{bf16, f16};

use crate::DType;

/// A typed host vector, the unit of upload and download.
#[derive(Clone, Debug, PartialEq)]
pub enum HostData {
    F32(Vec<f32>),
    F16(Vec<f16>),
    BF16(Vec<bf16>),
    U32(Vec<u32>),
}

impl HostData {
    pub fn dtype(&self) -> DType {
        match self {
            HostData::F32(_) => DType::F32,
            HostData::F16(_) => DType::F16,
            HostData::BF16(_) => DType::BF16,
            HostData::U32(_) => DType::U32,
        }
    }

    pub fn len(&self) -> usize {
        match self {
            HostData::F32(v) => v.len(),
            HostData::F16(v) => v.len(),
            HostData::BF16(v) => v.len(),
            HostData::U32(v) => v.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The raw little-endian bytes, as a device stores them.
    pub fn as_bytes(&self) -> &[u8] {
        match self {
            HostData::F32(v) => bytemuck::cast_slice(v),
            HostData::F16(v) => bytemuck::cast_slice(v),
            HostData::BF16(v) => bytemuck::cast_slice(v),
            HostData::U32(v) => bytemuck::cast_slice(v),
        }
    }

    /// Rebuilds host data from device bytes; `bytes` may carry trailing padding.
    pub fn from_bytes(dtype: DType, len: usize, bytes: &[u8]) -> HostData {
        let bytes = &bytes[..len * dtype.size()];
        // Device bytes need not be aligned for the element type: copy element-wise.
        match dtype {
            DType::F32 => HostData::F32(
                bytes
                    .chunks_exact(4)
                    .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                    .collect(),
            ),
            DType::U32 => HostData::U32(
                bytes
                    .chunks_exact(4)
                    .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                    .collect(),
            ),
            DType::F16 => HostData::F16(
                bytes
                    .chunks_exact(2)
                    .map(|c| f16::from_bits(u16::from_le_bytes([c[0], c[1]])))
                    .collect(),
            ),
            DType::BF16 => HostData::BF16(
                bytes
                    .chunks_exact(2)
                    .map(|c| bf16::from_bits(u16::from_le_bytes([c[0], c[1]])))
                    .collect(),
            ),
        }
    }

    /// Zero-filled data of a dtype.
    pub fn zeros(dtype: DType, len: usize) -> HostData {
        match dtype {
            DType::F32 => HostData::F32(vec![0.0; len]),
            DType::F16 => HostData::F16(vec![f16::ZERO; len]),
            DType::BF16 => HostData::BF16(vec![bf16::ZERO; len]),
            DType::U32 => HostData::U32(vec![0; len]),
        }
    }

    /// Converts f32 values to a float dtype with round-to-nearest-even, as the kernels do.
    pub fn from_f32(dtype: DType, values: &[f32]) -> HostData {
        match dtype {
            DType::F32 => HostData::F32(values.to_vec()),
            DType::F16 => HostData::F16(values.iter().map(|&x| f16::from_f32(x)).collect()),
            DType::BF16 => HostData::BF16(values.iter().map(|&x| bf16::from_f32(x)).collect()),
            DType::U32 => HostData::U32(values.iter().map(|&x| x as u32).collect()),
        }
    }

    /// Widens every element to f32 (exact for all float dtypes).
    pub fn to_f32(&self) -> Vec<f32> {
        match self {
            HostData::F32(v) => v.clone(),
            HostData::F16(v) => v.iter().map(|x| x.to_f32()).collect(),
            HostData::BF16(v) => v.iter().map(|x| x.to_f32()).collect(),
            HostData::U32(v) => v.iter().map(|&x| x as f32).collect(),
        }
    }

    /// Element bit patterns widened to u32, for bit-exact comparisons.
    pub fn bits(&self) -> Vec<u32> {
        match self {
            HostData::F32(v) => v.iter().map(|x| x.to_bits()).collect(),
            HostData::F16(v) => v.iter().map(|x| x.to_bits() as u32).collect(),
            HostData::BF16(v) => v.iter().map(|x| x.to_bits() as u32).collect(),
            HostData::U32(v) => v.clone(),
        }
    }
}

/// A named host tensor with its shape (row-major; the product is `data.len()`): a
/// tensor of a checkpoint or weights file, and what `Network::set_weights` takes.
#[derive(Clone, Debug, PartialEq)]
pub struct HostTensor {
    pub name: String,
    pub shape: Vec<usize>,
    pub data: HostData,
}

impl HostTensor {
    pub fn new(name: impl Into<String>, shape: Vec<usize>, data: HostData) -> HostTensor {
        HostTensor {
            name: name.into(),
            shape,
            data,
        }
    }
}
