//! Named device tensors to safetensors files, and safetensors files to host tensors.
//! Reading never writes a device: a model's weights are set from host tensors by
//! `Network::set_weights`, which keeps the model copy, the f32 master weights and the
//! optimizer state consistent (uploading a file into the model-copy buffers alone would
//! leave the masters behind, and the first optimizer step would undo the load).
//!
//! Writes are atomic: the file is written beside the target under a temporary name,
//! flushed to disk and renamed over it, so a crash mid-write never leaves a truncated
//! file where a good one was. Reads check every name, dtype and shape and say which.

use std::path::Path;

use safetensors::tensor::{Dtype as StDtype, TensorView};
use safetensors::SafeTensors;

use crate::device::host::HostTensor;
use crate::{Buffer, DType, Device, Error, HostData, Result};

/// A device buffer with the name and shape it has in a file.
#[derive(Clone, Debug)]
pub struct NamedTensor {
    pub name: String,
    pub buffer: Buffer,
    pub shape: Vec<usize>,
}

pub(crate) fn st_dtype(d: DType) -> StDtype {
    match d {
        DType::F32 => StDtype::F32,
        DType::F16 => StDtype::F16,
        DType::BF16 => StDtype::BF16,
        DType::U32 => StDtype::U32,
    }
}

fn io(path: &Path, what: &str, e: impl std::fmt::Display) -> Error {
    Error::InvalidArgument(format!("{what} `{}`: {e}", path.display()))
}

/// Downloads `tensors` and writes them to `path` atomically.
pub fn save(dev: &dyn Device, tensors: &[NamedTensor], path: &Path) -> Result<()> {
    let mut data = Vec::with_capacity(tensors.len());
    for t in tensors {
        let n: usize = t.shape.iter().product();
        if n != t.buffer.len {
            return Err(Error::InvalidArgument(format!(
                "tensor `{}`: shape {:?} has {n} elements but its buffer has {}",
                t.name, t.shape, t.buffer.len
            )));
        }
        data.push((t, dev.download(t.buffer)?));
    }
    let named: Vec<_> = data
        .iter()
        .map(|(t, host)| (t.name.as_str(), t.shape.as_slice(), host))
        .collect();
    let bytes = encode(&named).map_err(|e| io(path, "serializing", e))?;
    crate::fsutil::write_atomic(path, &bytes).map_err(|f| io(&f.path, f.action, f.err))
}

/// Writes host tensors to `path` atomically (f32, f16, bf16 or u32, as they are).
pub fn write(path: &Path, tensors: &[HostTensor]) -> Result<()> {
    for t in tensors {
        let n: usize = t.shape.iter().product();
        if n != t.data.len() {
            return Err(Error::InvalidArgument(format!(
                "tensor `{}`: shape {:?} has {n} elements but its data has {}",
                t.name,
                t.shape,
                t.data.len()
            )));
        }
    }
    let named: Vec<_> = tensors
        .iter()
        .map(|t| (t.name.as_str(), t.shape.as_slice(), &t.data))
        .collect();
    let bytes = encode(&named).map_err(|e| io(path, "serializing", e))?;
    crate::fsutil::write_atomic(path, &bytes).map_err(|f| io(&f.path, f.action, f.err))
}

/// Writes named host tensors to a safetensors file at `path`, a tensor at a time
/// (no copy of the whole file in memory, unlike [`encode`]). A tensor that cannot be
/// written as given is an `InvalidInput` error; the file system's errors are its own.
pub(crate) fn encode_to_file(
    tensors: &[(&str, &[usize], &HostData)],
    path: &Path,
) -> std::io::Result<()> {
    let invalid = |msg: String| std::io::Error::new(std::io::ErrorKind::InvalidInput, msg);
    let views = tensors
        .iter()
        .map(|&(name, shape, host)| {
            TensorView::new(st_dtype(host.dtype()), shape.to_vec(), host.as_bytes())
                .map(|v| (name.to_string(), v))
                .map_err(|e| invalid(format!("tensor `{name}`: {e}")))
        })
        .collect::<std::io::Result<Vec<_>>>()?;
    safetensors::serialize_to_file(views, None, path).map_err(|e| match e {
        safetensors::SafeTensorError::IoError(e) => e,
        other => invalid(other.to_string()),
    })
}

/// Serializes named host tensors to safetensors bytes.
pub(crate) fn encode(
    tensors: &[(&str, &[usize], &HostData)],
) -> std::result::Result<Vec<u8>, String> {
    let views = tensors
        .iter()
        .map(|&(name, shape, host)| {
            TensorView::new(st_dtype(host.dtype()), shape.to_vec(), host.as_bytes())
                .map(|v| (name.to_string(), v))
                .map_err(|e| format!("tensor `{name}`: {e}"))
        })
        .collect::<std::result::Result<Vec<_>, String>>()?;
    safetensors::serialize(views, None).map_err(|e| e.to_string())
}

/// Reads every tensor of the safetensors file at `path` into host memory, in the
/// file's order. f32, f16 and bf16 tensors are read as they are stored (bit-exact); any
/// other dtype is an error naming the tensor. The whole file is checked (header length,
/// offsets within the file) before a tensor is copied, so a truncated or hostile file
/// is an error, never a huge allocation. Setting a model's weights from the result is
/// `Network::set_weights` / `Trainer::set_weights` (or their `load_weights`), which
/// write the model copy, the f32 master and the optimizer state together.
pub fn read(path: &Path) -> Result<Vec<HostTensor>> {
    read_where(path, &|_| true)
}

/// [`read`], keeping only the tensors whose name `keep` accepts (the others are not
/// copied, whatever their dtype): a file with buffers besides the weights.
pub fn read_where(path: &Path, keep: &dyn Fn(&str) -> bool) -> Result<Vec<HostTensor>> {
    let bytes = std::fs::read(path).map_err(|e| io(path, "reading", e))?;
    let file = SafeTensors::deserialize(&bytes).map_err(|e| {
        io(
            path,
            "reading",
            format!("not a valid safetensors file (truncated or corrupted?): {e}"),
        )
    })?;
    // The file's order (by data offset), not the header's hash order: callers and
    // error messages see tensors as the file lays them out.
    let mut views = file.tensors();
    views.sort_by_key(|(_, v)| v.data().as_ptr() as usize);
    let mut out = Vec::with_capacity(views.len());
    for (name, view) in views {
        if !keep(&name) {
            continue;
        }
        let dtype = match view.dtype() {
            StDtype::F32 => DType::F32,
            StDtype::F16 => DType::F16,
            StDtype::BF16 => DType::BF16,
            other => {
                return Err(io(
                    path,
                    "reading",
                    format!(
                        "tensor `{name}` is {other:?}; weights must be stored as F32, F16 or                          BF16"
                    ),
                ))
            }
        };
        let n: usize = view.shape().iter().product();
        let data = HostData::from_bytes(dtype, n, view.data());
        out.push(HostTensor::new(name, view.shape().to_vec(), data));
    }
    Ok(out)
}
