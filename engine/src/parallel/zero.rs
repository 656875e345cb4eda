//! ZeRO partitioning: which part of the optimizer state each data-parallel rank owns.
//!
//! The parameters, concatenated in model order, form one flat vector of Ψ elements.
//! Rank r owns the contiguous range `[r·Ψ/N, (r+1)·Ψ/N)` (the first Ψ mod N ranks one
//! element more), whatever the tensor boundaries — not whole tensors dealt round-robin,
//! which leaves ranks as uneven as the largest tensor. A range crosses tensors, so it is
//! kept as segments, one per tensor it touches: each segment is updated with its own
//! tensor's settings (weight decay applies to matrices only).
//!
//! [`Shards`] holds every rank's slice of the f32 master weights and moments on its
//! device, updates them from the reduced gradients and gathers the updated weights.
//! In a multi-process job the flat partitioning spans every device of every process
//! (ranks numbered process by process); a process holds its own devices' slices,
//! receives only their gradients (`collective::Ownership`), and the updated weights
//! and checkpointed states are gathered between processes.

use super::collective::{f32_parts, Processes};
pub use super::shard::{segments, shard_range, Segment};
use crate::device::optim::ParamBuffers;
use crate::models::{ModelStateBytes, Network, ParamState};
use crate::{Buffer, DType, Device, Error, HostData, Optimizer, Result};

/// One segment of a rank's shard on its device: the f32 master, moments and reduced
/// gradient of that slice of one tensor, and the slice's updated model copy.
struct ShardSegment {
    seg: Segment,
    buffers: ParamBuffers,
}

/// ZeRO stages 1 and 2: every rank's optimizer-state segments on its device, and the
/// f32[1] gradient factor its updates read.
pub struct Shards {
    /// This process's ranks' segments, in rank order.
    ranks: Vec<Vec<ShardSegment>>,
    scale: Vec<Buffer>,
    procs: Option<Processes>,
}

impl Shards {
    /// Takes the optimizer state off every replica (they start from the same weights)
    /// and gives each rank its slice.
    /// With `procs`, the partitioning spans every process's devices and these are
    /// this process's.
    pub fn new(
        models: &mut [&mut Network],
        devs: &[&dyn Device],
        procs: Option<&Processes>,
    ) -> Result<Shards> {
        let layout = models[0].parameter_layout();
        let dtypes: Vec<DType> = layout.iter().map(|l| l.2).collect();
        let mut masters = vec![];
        for (m, &dev) in models.iter_mut().zip(devs) {
            masters.push(m.release_optimizer_state(dev)?);
        }
        Shards::from_masters(devs, &masters, &dtypes, procs)
    }

    /// Gives each of `devs` (ranks, in order) its slice of the tensors whose whole f32
    /// masters rank r holds in `masters[r]` (every rank the same values) and whose
    /// model copies are stored in `dtypes`: the layout [`Shards::new`] gives a
    /// network, for any list of tensors (a pipeline stage's parameters).
    pub fn from_masters(
        devs: &[&dyn Device],
        masters: &[Vec<Vec<f32>>],
        dtypes: &[DType],
        procs: Option<&Processes>,
    ) -> Result<Shards> {
        let world = procs.map_or(devs.len(), Processes::world);
        let first = procs.map_or(0, Processes::first_rank);
        let sizes: Vec<usize> = masters[0].iter().map(Vec::len).collect();
        let (mut ranks, mut scale) = (vec![], vec![]);
        for (rank, (masters, &dev)) in masters.iter().zip(devs).enumerate() {
            let mut segs = vec![];
            for seg in segments(&sizes, world, first + rank) {
                let init = &masters[seg.param][seg.range.clone()];
                let buffers = ParamBuffers::new(dev, init, dtypes[seg.param], DType::F32)?;
                segs.push(ShardSegment { seg, buffers });
            }
            ranks.push(segs);
            scale.push(dev.alloc(DType::F32, 1)?);
        }
        Ok(Shards {
            ranks,
            scale,
            procs: procs.cloned(),
        })
    }

    /// Each rank updates its own segments from the reduced gradients `sum` (a
    /// reduce-scatter: it receives only its slice), then the updated slices are
    /// gathered on the host and every rank receives the whole new model copy (the
    /// all-gather). `step` is 1-based. Returns the bytes moved.
    pub fn apply(
        &self,
        models: &mut [&mut Network],
        devs: &[&dyn Device],
        optimizer: &Optimizer,
        (sum, lr, grad_scale, step): (&[Vec<f32>], f32, f32, u64),
    ) -> Result<u64> {
        let layout: Vec<(usize, DType, bool)> = models[0]
            .parameter_layout()
            .into_iter()
            .map(|(_, shape, dtype, decay)| (shape.iter().product(), dtype, decay))
            .collect();
        let (wholes, mut bytes) =
            self.update(devs, optimizer, &layout, (sum, lr, grad_scale, step))?;
        for (i, whole) in wholes.iter().enumerate() {
            for (m, dev) in models.iter().zip(devs) {
                m.set_value(*dev, i, whole)?;
                bytes += whole.as_bytes().len() as u64;
            }
        }
        let step = u32::try_from(step).expect("update checked the step");
        for m in models.iter_mut() {
            m.set_steps_applied(step);
        }
        Ok(bytes)
    }

    /// [`Shards::apply`]'s update and all-gather for tensors laid out as `layout`
    /// (elements, storage dtype, weight decay applies), in the order the shards were
    /// made from: returns every tensor's whole updated model copy, for the caller to
    /// write to its replicas, and the bytes moved so far.
    pub fn update(
        &self,
        devs: &[&dyn Device],
        optimizer: &Optimizer,
        layout: &[(usize, DType, bool)],
        (sum, lr, grad_scale, step): (&[Vec<f32>], f32, f32, u64),
    ) -> Result<(Vec<HostData>, u64)> {
        let step = u32::try_from(step).map_err(|_| {
            Error::InvalidArgument("more optimizer steps than the engine counts".into())
        })?;
        let mut bytes = 0;
        for ((segs, &scale), dev) in self.ranks.iter().zip(&self.scale).zip(devs) {
            dev.upload(scale, &HostData::F32(vec![grad_scale]))?;
            for s in segs {
                let g = HostData::F32(sum[s.seg.param][s.seg.range.clone()].to_vec());
                bytes += g.as_bytes().len() as u64;
                dev.upload(s.buffers.grad, &g)?;
                let decay = if layout[s.seg.param].2 {
                    optimizer.weight_decay()
                } else {
                    0.0
                };
                dev.launch(&s.buffers.step(optimizer, scale, lr, decay, step))?;
            }
            dev.submit()?;
        }
        // All-gather: each tensor's slices, in rank order, make the whole tensor.
        let mut parts: Vec<Vec<u8>> = vec![vec![]; layout.len()];
        let mut mine = vec![];
        for (segs, dev) in self.ranks.iter().zip(devs) {
            for s in segs {
                let v = dev.download(s.buffers.value)?;
                bytes += v.as_bytes().len() as u64;
                match self.procs {
                    None => parts[s.seg.param].extend_from_slice(v.as_bytes()),
                    Some(_) => mine.extend_from_slice(v.as_bytes()),
                }
            }
        }
        if let Some(procs) = &self.procs {
            // A process's ranks own one contiguous run of the flat model: the
            // processes' runs, in process order, are the whole model.
            let flat: Vec<u8> = procs.comm.all_gather(&mine)?.concat();
            bytes += (mine.len() + flat.len()) as u64;
            let mut off = 0;
            for (i, &(n, dtype, _)) in layout.iter().enumerate() {
                let n = n * dtype.size();
                parts[i] = flat.get(off..off + n).map(<[u8]>::to_vec).ok_or_else(|| {
                    Error::InvalidArgument(
                        "the processes' updated weights do not add up to this model".into(),
                    )
                })?;
                off += n;
            }
        }
        let wholes = layout
            .iter()
            .zip(&parts)
            .map(|(&(n, dtype, _), part)| HostData::from_bytes(dtype, n, part))
            .collect();
        Ok((wholes, bytes))
    }

    /// Fills the masters and moments of whole-model `states` from the shards.
    pub fn gather(&self, devs: &[&dyn Device], states: &mut [ParamState]) -> Result<()> {
        for st in states.iter_mut() {
            let n: usize = st.shape.iter().product();
            st.master = vec![0.0; n];
            st.m = vec![0.0; n];
            st.v = vec![0.0; n];
        }
        let mut mine = vec![];
        for (segs, dev) in self.ranks.iter().zip(devs) {
            for s in segs {
                let st = &mut states[s.seg.param];
                let r = s.seg.range.clone();
                let (master, m, v) = (
                    dev.download(s.buffers.master)?.to_f32(),
                    dev.download(s.buffers.m)?.to_f32(),
                    dev.download(s.buffers.v)?.to_f32(),
                );
                if self.procs.is_some() {
                    // Placed below with every other process's slices.
                    for x in [&master, &m, &v] {
                        mine.extend_from_slice(bytemuck::cast_slice(x));
                    }
                    continue;
                }
                st.master[r.clone()].copy_from_slice(&master);
                st.m[r.clone()].copy_from_slice(&m);
                st.v[r].copy_from_slice(&v);
            }
        }
        let Some(procs) = &self.procs else {
            return Ok(());
        };
        // Every process's slices: each in its segments' order, master, then moments.
        let sizes: Vec<usize> = states.iter().map(|s| s.master.len()).collect();
        let world = procs.world();
        let gathered = procs.comm.all_gather(&mine)?;
        for (p, values) in f32_parts(&gathered, "optimizer state")?.iter().enumerate() {
            let mut off = 0;
            let first: usize = procs.devices[..p].iter().sum();
            for rank in first..first + procs.devices[p] {
                for seg in segments(&sizes, world, rank) {
                    let st = &mut states[seg.param];
                    let n = seg.range.len();
                    let part = values.get(off..off + 3 * n).ok_or_else(|| {
                        Error::InvalidArgument(format!(
                            "process {p} sent less optimizer state than its shard holds"
                        ))
                    })?;
                    st.master[seg.range.clone()].copy_from_slice(&part[..n]);
                    st.m[seg.range.clone()].copy_from_slice(&part[n..2 * n]);
                    st.v[seg.range].copy_from_slice(&part[2 * n..]);
                    off += 3 * n;
                }
            }
        }
        Ok(())
    }

    /// Uploads each rank's slices of whole-model `states` (checked by the caller).
    pub fn scatter(&self, devs: &[&dyn Device], states: &[ParamState]) -> Result<()> {
        for (segs, dev) in self.ranks.iter().zip(devs) {
            for s in segs {
                let st = &states[s.seg.param];
                let r = s.seg.range.clone();
                let f32s = |v: &[f32]| HostData::F32(v[r.clone()].to_vec());
                dev.upload(s.buffers.master, &f32s(&st.master))?;
                dev.upload(s.buffers.m, &f32s(&st.m))?;
                dev.upload(s.buffers.v, &f32s(&st.v))?;
            }
        }
        Ok(())
    }

    /// Sets parameter `param`'s f32 master on every rank that holds a slice of it
    /// (each its slice of `master`, the whole tensor) and zeroes those slices' moments:
    /// a group's weights set afresh.
    pub fn set_weights(&self, devs: &[&dyn Device], param: usize, master: &[f32]) -> Result<()> {
        for (segs, dev) in self.ranks.iter().zip(devs) {
            for s in segs.iter().filter(|s| s.seg.param == param) {
                let r = s.seg.range.clone();
                dev.upload(s.buffers.master, &HostData::F32(master[r.clone()].to_vec()))?;
                let zeros = HostData::F32(vec![0.0; r.len()]);
                dev.upload(s.buffers.m, &zeros)?;
                dev.upload(s.buffers.v, &zeros)?;
            }
        }
        Ok(())
    }

    /// Rank `rank`'s shard bytes: master, moments, reduced gradient, updated model
    /// copy and the step's gradient factor.
    pub fn add_bytes(&self, rank: usize, bytes: &mut ModelStateBytes) {
        let Some(segs) = self.ranks.get(rank) else {
            return;
        };
        for s in segs {
            let b = &s.buffers;
            bytes.gradients += b.grad.bytes();
            bytes.optimizer += b.master.bytes() + b.m.bytes() + b.v.bytes() + b.value.bytes();
        }
        bytes.optimizer += self.scale[rank].bytes();
    }

    /// Elements of the optimizer state rank `rank` holds (master + moments count once).
    pub fn elements(&self, rank: usize) -> usize {
        self.ranks
            .get(rank)
            .map_or(0, |segs| segs.iter().map(|s| s.seg.range.len()).sum())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shards_cover_every_element_once_and_differ_by_at_most_one() {
        let sizes = [5, 1, 7, 3, 11];
        let total: usize = sizes.iter().sum();
        for world in 1..=7 {
            let mut seen = vec![0u32; total];
            let lens: Vec<usize> = (0..world)
                .map(|r| shard_range(total, world, r).len())
                .collect();
            assert!(lens.iter().max().unwrap() - lens.iter().min().unwrap() <= 1);
            for rank in 0..world {
                let mut flat = shard_range(total, world, rank);
                for seg in segments(&sizes, world, rank) {
                    let off: usize = sizes[..seg.param].iter().sum();
                    for i in seg.range.clone() {
                        assert_eq!(flat.next(), Some(off + i), "contiguous, in order");
                        seen[off + i] += 1;
                    }
                }
                assert_eq!(flat.next(), None);
            }
            assert!(seen.iter().all(|&c| c == 1), "world {world}: {seen:?}");
        }
        // 27 elements over 2 ranks: 14 + 13, the first rank's range ending inside
        // the third tensor.
        assert_eq!(
            segments(&sizes, 2, 0),
            [
                Segment {
                    param: 0,
                    range: 0..5
                },
                Segment {
                    param: 1,
                    range: 0..1
                },
                Segment {
                    param: 2,
                    range: 0..7
                },
                Segment {
                    param: 3,
                    range: 0..1
                },
            ]
        );
    }
}
