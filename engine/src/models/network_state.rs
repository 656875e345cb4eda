//! A network's weights and training state in and out of its device: setting weights
//! (checked in full before the first byte is written) and reading them, the model
//! copies for a safetensors file, every parameter's checkpoint state
//! (`ParamState`).

use std::borrow::Cow;
use std::sync::Arc;

use super::network::Network;
use super::ParamSpec;
use crate::device::host::HostTensor;
use crate::{DType, Device, Error, HostData, Result};

/// One parameter's training state on the host: model copy (storage dtype, bit-exact),
/// f32 master and the optimizer's two moments (SGD uses `m` for momentum).
#[derive(Clone, Debug, PartialEq)]
pub struct ParamState {
    pub name: String,
    pub shape: Vec<usize>,
    pub value: HostData,
    pub master: Vec<f32>,
    pub m: Vec<f32>,
    pub v: Vec<f32>,
}

/// A parameter's name and its Adam first and second moments.
pub type Moments = (String, Vec<f32>, Vec<f32>);

impl Network {
    /// Overwrites one parameter's model copy and f32 master from f32 values, as
    /// [`Network::set_weights`] writes them (the master the values, the model copy
    /// rounded once to nearest even), leaving the moments and step count alone and
    /// checking nothing else: a probe for tests (finite differences, injected faults).
    /// Setting a model's weights is [`Network::set_weights`].
    pub fn set_parameter(&self, dev: &dyn Device, index: usize, values: &[f32]) -> Result<()> {
        let n = self.param(index)?.spec.len();
        if values.len() != n {
            return Err(Error::LenMismatch {
                what: format!("values of parameter {index}"),
                expected: n,
                found: values.len(),
            });
        }
        let data = HostData::F32(values.to_vec());
        let (value, master) = weight_copies(&data, self.options.dtype);
        self.write_weights(dev, index, &value, Some(&master), false)
    }

    /// Sets every parameter from host tensors named as [`Model::parameters`] names them
    /// (a tied parameter also under its other name, e.g. GPT-2's `lm_head.weight`): the
    /// network is then as if built with these weights. Each parameter's f32 master is
    /// the given values widened exactly (an f16 file into an f16 model: the masters
    /// equal its values), its model copy the values as given when they are stored in
    /// the network's dtype, else the f32 values rounded once to nearest even; both
    /// optimizer moments are zeroed and the count of applied steps is 0 (Adam's bias
    /// correction and the schedule start again).
    ///
    /// All or nothing: every parameter must be given, once, with the model's shape, in
    /// f32, f16 or bf16, finite and within the storage dtype's range; names the model
    /// does not have are refused (a file with extra buffers is filtered by the caller,
    /// see `safetensors_io::read_where`). Everything is checked before the first byte
    /// is written, and each error names the tensor and what differs.
    ///
    /// A data-parallel group (every rank, every ZeRO stage) sets its weights with
    /// `Trainer::set_weights`; a network whose optimizer state a ZeRO group holds is
    /// refused here.
    ///
    /// [`Model::parameters`]: super::Model::parameters
    pub fn set_weights(&mut self, dev: &dyn Device, weights: &[HostTensor]) -> Result<()> {
        if self.released.is_some() {
            return Err(Error::InvalidArgument(format!(
                "the optimizer state of this replica of {} is sharded across a ZeRO group; \
                 set the weights of the whole group with Trainer::set_weights",
                self.model.describe()
            )));
        }
        let matched = self.match_weights(weights)?;
        for (i, t) in matched.iter().enumerate() {
            let (value, master) = weight_copies(&t.data, self.options.dtype);
            self.write_weights(dev, i, &value, Some(&master), true)?;
        }
        self.step = 0;
        Ok(())
    }

    /// [`Network::set_weights`] from the safetensors file at `path` (see
    /// `safetensors_io::read`): a file [`Network::tensors`] was saved to, or any file
    /// holding exactly this model's tensors under its names. Errors name the file.
    pub fn load_weights(&mut self, dev: &dyn Device, path: &std::path::Path) -> Result<()> {
        let weights = crate::device::safetensors_io::read(path)?;
        self.set_weights(dev, &weights)
            .map_err(|e| in_file(path, e))
    }

    /// The given weights in parameter order, one per parameter, after every check
    /// [`Network::set_weights`] documents; nothing is written.
    pub(crate) fn match_weights<'a>(
        &self,
        weights: &'a [HostTensor],
    ) -> Result<Vec<&'a HostTensor>> {
        let what = self.model.describe();
        let mut index = std::collections::HashMap::new();
        for (i, p) in self.params.iter().enumerate() {
            index.insert(p.spec.name.as_str(), i);
            if let Some(alias) = &p.spec.tied {
                index.insert(alias.as_str(), i);
            }
        }
        let mut found: Vec<Option<&HostTensor>> = vec![None; self.params.len()];
        for t in weights {
            let Some(&i) = index.get(t.name.as_str()) else {
                let names: Vec<&str> = self
                    .params
                    .iter()
                    .take(3)
                    .map(|p| p.spec.name.as_str())
                    .collect();
                return Err(Error::InvalidArgument(format!(
                    "weights: `{}` is not a parameter of {what} (its {} parameters are named \
                     like `{}`); weights of another model or naming cannot be set",
                    t.name,
                    self.params.len(),
                    names.join("`, `")
                )));
            };
            let spec = &self.params[i].spec;
            if t.shape != spec.shape {
                return Err(Error::InvalidArgument(format!(
                    "weights: `{}` has shape {:?} but {what} has {:?} for it: the weights \
                     were made for a different model config",
                    t.name, t.shape, spec.shape
                )));
            }
            if t.data.len() != spec.len() {
                return Err(Error::InvalidArgument(format!(
                    "weights: `{}` has shape {:?} ({} elements) but holds {} values",
                    t.name,
                    t.shape,
                    spec.len(),
                    t.data.len()
                )));
            }
            if !t.data.dtype().is_float() {
                return Err(Error::InvalidArgument(format!(
                    "weights: `{}` is {}; weights must be f32, f16 or bf16",
                    t.name,
                    t.data.dtype()
                )));
            }
            if let Some(first) = found[i] {
                if first.name == t.name {
                    return Err(Error::InvalidArgument(format!(
                        "weights: `{}` is given twice",
                        t.name
                    )));
                }
                // A file may carry a tied tensor under both names; it is one tensor here.
                if let Some(e) = widened(&first.data)
                    .zip(widened(&t.data))
                    .position(|(a, b)| a.to_bits() != b.to_bits())
                {
                    return Err(Error::InvalidArgument(format!(
                        "weights: `{}` and `{}` are both given and differ (element {e}); \
                         {what} ties them into one tensor, so it can hold only one: give one \
                         of them (weights with an untied head do not fit a tied model)",
                        first.name, t.name
                    )));
                }
                continue;
            }
            check_range(t, self.options.dtype)?;
            found[i] = Some(t);
        }
        let missing: Vec<&str> = self
            .params
            .iter()
            .zip(&found)
            .filter(|(_, f)| f.is_none())
            .map(|(p, _)| p.spec.name.as_str())
            .collect();
        if !missing.is_empty() {
            let shown: Vec<&str> = missing.iter().take(5).copied().collect();
            return Err(Error::InvalidArgument(format!(
                "weights: {} of the {} parameters of {what} are missing: `{}`{}; every \
                 parameter must be given (the weights were made for a different model \
                 config, or the file is incomplete)",
                missing.len(),
                self.params.len(),
                shown.join("`, `"),
                if missing.len() > shown.len() {
                    ", …"
                } else {
                    ""
                }
            )));
        }
        Ok(found
            .into_iter()
            .map(|f| f.expect("checked above"))
            .collect())
    }

    /// Uploads parameter `index`'s model copy and, when given, its f32 master; with
    /// `reset` also zeroes its moments. The one writer of weights: what
    /// [`Network::set_parameter`], [`Network::set_weights`] and a group's
    /// `Trainer::set_weights` use.
    pub(crate) fn write_weights(
        &self,
        dev: &dyn Device,
        index: usize,
        value: &HostData,
        master: Option<&[f32]>,
        reset: bool,
    ) -> Result<()> {
        let b = &self.param(index)?.buffers;
        if let Some(master) = master {
            dev.upload(b.master, &HostData::F32(master.to_vec()))?;
        }
        if reset {
            let zeros = HostData::F32(vec![0.0; b.m.len]);
            dev.upload(b.m, &zeros)?;
            dev.upload(b.v, &zeros)?;
        }
        self.set_value(dev, index, value)
    }

    /// Sets the frozen weights (a LoRA run's base model) from host tensors named as the
    /// model names them (a tied one also under its other name), each rounded once to
    /// the storage dtype. All or nothing: every frozen weight must be given once with
    /// its shape, finite and within the storage dtype's range, and no other tensor;
    /// the trained parameters and the optimizer state are left as they are.
    pub fn set_frozen(&self, dev: &dyn Device, weights: &[HostTensor]) -> Result<()> {
        for (i, t) in self.match_frozen(weights)?.into_iter().enumerate() {
            let (value, _) = weight_copies(&t.data, self.options.dtype);
            dev.upload(self.frozen[i].1, &value)?;
        }
        Ok(())
    }

    /// The given weights in frozen-weight order, after every check
    /// [`Network::set_frozen`] documents.
    pub(crate) fn match_frozen<'a>(
        &self,
        weights: &'a [HostTensor],
    ) -> Result<Vec<&'a HostTensor>> {
        let specs: Vec<&ParamSpec> = self.frozen.iter().map(|f| &f.0).collect();
        match_frozen(&specs, weights, self.options.dtype, &self.model.describe())
    }

    /// The frozen weights as stored (a LoRA run's base model), under their names.
    pub fn frozen_values(&self, dev: &dyn Device) -> Result<Vec<HostTensor>> {
        self.frozen
            .iter()
            .map(|(s, b)| {
                Ok(HostTensor::new(
                    s.name.clone(),
                    s.shape.clone(),
                    dev.download(*b)?,
                ))
            })
            .collect()
    }

    /// (name, f32 master values) of every parameter.
    pub fn parameters(&self, dev: &dyn Device) -> Result<Vec<(String, Vec<f32>)>> {
        self.params
            .iter()
            .map(|p| {
                Ok((
                    p.spec.name.clone(),
                    dev.download(p.buffers.master)?.to_f32(),
                ))
            })
            .collect()
    }

    /// (name, Adam first moment, second moment) of every parameter.
    pub fn moments(&self, dev: &dyn Device) -> Result<Vec<Moments>> {
        self.params
            .iter()
            .map(|p| {
                Ok((
                    p.spec.name.clone(),
                    dev.download(p.buffers.m)?.to_f32(),
                    dev.download(p.buffers.v)?.to_f32(),
                ))
            })
            .collect()
    }

    /// The model copies' buffers under their checkpoint names, for
    /// `safetensors_io::save`. Reading a file back is [`Network::load_weights`]:
    /// uploading into these buffers alone would leave the f32 masters behind. A ZeRO
    /// stage-3 replica has no buffer of its own for its blocks' weights: refused (its
    /// trainer's `param_states` holds them).
    pub fn tensors(&self) -> Result<Vec<crate::device::safetensors_io::NamedTensor>> {
        if (0..self.params.len()).any(|p| self.plan.streams(p)) {
            return Err(Error::InvalidArgument(
                "a ZeRO stage-3 replica's block weights take turns in one set of device \
                 buffers; save them from the trainer's param_states"
                    .into(),
            ));
        }
        Ok(self
            .params
            .iter()
            .map(|p| crate::device::safetensors_io::NamedTensor {
                name: p.spec.name.clone(),
                buffer: p.buffers.value,
                shape: p.spec.shape.clone(),
            })
            .collect())
    }

    /// Every parameter's full training state, for checkpoints.
    pub fn param_states(&self, dev: &dyn Device) -> Result<Vec<ParamState>> {
        self.params
            .iter()
            .enumerate()
            .map(|(i, p)| {
                let b = &p.buffers;
                Ok(ParamState {
                    name: p.spec.name.clone(),
                    shape: p.spec.shape.clone(),
                    value: self.value(dev, i)?,
                    master: dev.download(b.master)?.to_f32(),
                    m: dev.download(b.m)?.to_f32(),
                    v: dev.download(b.v)?.to_f32(),
                })
            })
            .collect()
    }

    /// Restores what [`Network::param_states`] saved. Every parameter must be present
    /// with its shape and the model's storage dtype: a checkpoint of another model or
    /// another precision is an error, never a partial load.
    pub fn load_param_states(&self, dev: &dyn Device, states: &[ParamState]) -> Result<()> {
        let what = self.model.describe();
        if states.len() != self.params.len() {
            return Err(Error::InvalidArgument(format!(
                "the checkpoint holds {} parameters but {what} has {}: it was saved from a \
                 different model config",
                states.len(),
                self.params.len()
            )));
        }
        for (i, p) in self.params.iter().enumerate() {
            let (spec, b) = (&p.spec, &p.buffers);
            let s = states
                .iter()
                .find(|s| s.name == spec.name || spec.tied.as_ref() == Some(&s.name))
                .ok_or_else(|| {
                    Error::InvalidArgument(format!(
                        "the checkpoint has no parameter `{}`: it was saved from a different \
                         model config than {what}",
                        spec.name
                    ))
                })?;
            if s.shape != spec.shape {
                return Err(Error::InvalidArgument(format!(
                    "`{}` has shape {:?} in the checkpoint but {:?} in {what}: the model \
                     config differs from the one the checkpoint was saved with",
                    spec.name, s.shape, spec.shape
                )));
            }
            if s.value.dtype() != b.value.dtype {
                return Err(Error::InvalidArgument(format!(
                    "`{}` is stored as {} in the checkpoint but this run trains in {}: resume \
                     with the precision the checkpoint was saved with",
                    spec.name,
                    s.value.dtype(),
                    b.value.dtype
                )));
            }
            let n = spec.len();
            for (what, len) in [
                ("value", s.value.len()),
                ("master", s.master.len()),
                ("exp_avg", s.m.len()),
                ("exp_avg_sq", s.v.len()),
            ] {
                if len != n {
                    return Err(Error::LenMismatch {
                        what: format!("checkpoint {what} of `{}`", spec.name),
                        expected: n,
                        found: len,
                    });
                }
            }
            self.set_value(dev, i, &s.value)?;
            dev.upload(b.master, &HostData::F32(s.master.clone()))?;
            dev.upload(b.m, &HostData::F32(s.m.clone()))?;
            dev.upload(b.v, &HostData::F32(s.v.clone()))?;
        }
        Ok(())
    }

    /// Overwrites parameter `index`'s model copy (storage dtype, bit-exact): how a ZeRO
    /// group hands every rank the updated weights its shards produced. The model copy
    /// alone: the f32 master keeps its values and the next optimizer step writes the
    /// copy from it again, so this does not set a weight (that is
    /// [`Network::set_weights`]).
    /// A stage-3 replica's streamed tensor keeps it in host memory (loaded before use).
    pub fn set_value(&self, dev: &dyn Device, index: usize, data: &HostData) -> Result<()> {
        if !self.plan.streams(index) {
            return dev.upload(self.param(index)?.buffers.value, data);
        }
        self.set_value_shared(dev, index, &Arc::new(data.clone()))
    }

    /// [`Network::set_value`] from data the replicas of a process share: a ZeRO
    /// stage-3 replica keeps its streamed tensors' copies as this one host copy.
    pub fn set_value_shared(
        &self,
        dev: &dyn Device,
        index: usize,
        data: &Arc<HostData>,
    ) -> Result<()> {
        let b = self.param(index)?.buffers.value;
        if !self.plan.streams(index) {
            return dev.upload(b, data);
        }
        // The stream checks the dtype and length against the shared buffer.
        self.plan.set_streamed(index, data.clone())
    }

    /// Parameter `index`'s model copy as stored (from host memory where stage 3
    /// streams it).
    pub fn value(&self, dev: &dyn Device, index: usize) -> Result<HostData> {
        let b = self.param(index)?.buffers.value;
        if !self.plan.streams(index) {
            return dev.download(b);
        }
        // The shared buffer holds whichever block ran last: never read in its place.
        match self.plan.streamed(index) {
            Some(h) => Ok((*h).clone()),
            None => Err(Error::InvalidArgument(format!(
                "the weights of streamed parameter {index} were never set"
            ))),
        }
    }

    /// Sets the count of applied optimizer steps (restoring a checkpoint).
    pub fn set_steps_applied(&mut self, steps: u32) {
        self.step = steps;
    }
}

/// The model copy (storage `dtype`) and f32 master one parameter's weights give: the
/// master is the values widened exactly to f32; the model copy is the values as given
/// when they are stored in `dtype` (no second rounding), else the master rounded once
/// to nearest even.
pub(crate) fn weight_copies(data: &HostData, dtype: DType) -> (Cow<'_, HostData>, Cow<'_, [f32]>) {
    let master: Cow<[f32]> = match data {
        HostData::F32(v) => Cow::Borrowed(v),
        other => Cow::Owned(other.to_f32()),
    };
    let value = if data.dtype() == dtype {
        Cow::Borrowed(data)
    } else {
        Cow::Owned(HostData::from_f32(dtype, &master))
    };
    (value, master)
}

/// `weights` in the order of the frozen `specs` (a LoRA run's base; `what` names the
/// model), each checked: named as the spec or its tied name, its shape, a float dtype,
/// finite and within `dtype`'s range; every spec given once and no other tensor (a tied
/// tensor given under both names counts once). What a network and a pipeline set their
/// frozen weights from.
pub(crate) fn match_frozen<'a>(
    specs: &[&ParamSpec],
    weights: &'a [HostTensor],
    dtype: DType,
    what: &str,
) -> Result<Vec<&'a HostTensor>> {
    let Some(first) = specs.first() else {
        return Err(Error::InvalidArgument(format!(
            "{what} has no frozen weights to set"
        )));
    };
    let mut found: Vec<Option<&HostTensor>> = vec![None; specs.len()];
    for t in weights {
        let i = specs
            .iter()
            .position(|s| s.name == t.name || s.tied.as_deref() == Some(&t.name))
            .ok_or_else(|| {
                Error::InvalidArgument(format!(
                    "weights: `{}` is not a frozen weight of {what} (the base model's weights \
                     are named like `{}`)",
                    t.name, first.name
                ))
            })?;
        let spec = specs[i];
        if t.shape != spec.shape || t.data.len() != spec.len() || !t.data.dtype().is_float() {
            return Err(Error::InvalidArgument(format!(
                "weights: `{}` is {:?} {} but {what} has {:?} for it: the weights were \
                 made for a different model config",
                t.name,
                t.shape,
                t.data.dtype(),
                spec.shape
            )));
        }
        if found[i].is_some() {
            continue;
        }
        check_range(t, dtype)?;
        found[i] = Some(t);
    }
    let missing: Vec<&str> = specs
        .iter()
        .zip(&found)
        .filter(|(_, f)| f.is_none())
        .map(|(s, _)| s.name.as_str())
        .take(5)
        .collect();
    if !missing.is_empty() {
        return Err(Error::InvalidArgument(format!(
            "weights: the base model's `{}` are missing; every frozen weight of {what} \
             must be given",
            missing.join("`, `")
        )));
    }
    Ok(found.into_iter().map(|f| f.expect("checked")).collect())
}

/// The float elements of `data` widened to f32, without a copy of the whole tensor.
fn widened(data: &HostData) -> Box<dyn Iterator<Item = f32> + '_> {
    match data {
        HostData::F32(v) => Box::new(v.iter().copied()),
        HostData::F16(v) => Box::new(v.iter().map(|x| x.to_f32())),
        HostData::BF16(v) => Box::new(v.iter().map(|x| x.to_f32())),
        HostData::U32(v) => Box::new(v.iter().map(|&x| x as f32)),
    }
}

/// Refuses weights that cannot train: a value that is not finite, or one the model
/// copy's 16-bit dtype would round to infinity.
fn check_range(t: &HostTensor, dtype: DType) -> Result<()> {
    let limit = match dtype {
        DType::F16 => half::f16::MAX.to_f32(),
        DType::BF16 => half::bf16::MAX.to_f32(),
        _ => f32::MAX,
    };
    for (i, x) in widened(&t.data).enumerate() {
        if !x.is_finite() {
            return Err(Error::InvalidArgument(format!(
                "weights: element {i} of `{}` is {x}: weights must be finite (the file is \
                 damaged, or was saved from a run that diverged)",
                t.name
            )));
        }
        // Past the largest finite value by half an ulp or more rounds to infinity.
        let overflows = match dtype {
            DType::F16 => half::f16::from_f32(x).is_infinite(),
            DType::BF16 => half::bf16::from_f32(x).is_infinite(),
            _ => false,
        };
        if overflows {
            return Err(Error::InvalidArgument(format!(
                "weights: element {i} of `{}` is {x}, beyond {dtype}'s largest value {limit}, \
                 so the {dtype} model copy would be infinite: train these weights in bf16 or \
                 fp32",
                t.name
            )));
        }
    }
    Ok(())
}

/// An error of weights read from `path`, saying which file.
pub(crate) fn in_file(path: &std::path::Path, e: Error) -> Error {
    match e {
        Error::InvalidArgument(m) => Error::InvalidArgument(format!("`{}`: {m}", path.display())),
        other => other,
    }
}
