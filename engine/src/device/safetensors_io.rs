//! Named device tensors to and from safetensors files.
//!
//! Writes are atomic: the file is written beside the target under a temporary name,
//! flushed to disk and renamed over it, so a crash mid-write never leaves a truncated
//! file where a good one was. Reads check every name, dtype and shape and say which.

use std::path::Path;

use safetensors::tensor::{Dtype as StDtype, TensorView};
use safetensors::SafeTensors;

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

/// Reads `path` and uploads each of `tensors` from the tensor of the same name, which
/// must have the same dtype and shape.
pub fn load(dev: &dyn Device, tensors: &[NamedTensor], path: &Path) -> Result<()> {
    let bytes = std::fs::read(path).map_err(|e| io(path, "reading", e))?;
    let file = SafeTensors::deserialize(&bytes).map_err(|e| {
        io(
            path,
            "reading",
            format!("not a valid safetensors file (truncated or corrupted?): {e}"),
        )
    })?;
    for t in tensors {
        let view = file.tensor(&t.name).map_err(|_| {
            io(
                path,
                "reading",
                format!(
                    "it has no tensor `{}` (it has {} others)",
                    t.name,
                    file.len()
                ),
            )
        })?;
        if view.dtype() != st_dtype(t.buffer.dtype) || view.shape() != t.shape.as_slice() {
            return Err(io(
                path,
                "reading",
                format!(
                    "tensor `{}` is {:?} {:?} in the file but {} {:?} in the model",
                    t.name,
                    view.dtype(),
                    view.shape(),
                    t.buffer.dtype,
                    t.shape
                ),
            ));
        }
        let host = HostData::from_bytes(t.buffer.dtype, t.buffer.len, view.data());
        dev.upload(t.buffer, &host)?;
    }
    Ok(())
}
