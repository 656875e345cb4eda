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
//!
//! ZeRO-Offload keeps a rank's slice in host memory instead (f32 master and moments):
//! the reduced gradients are on the host already (the exchange sums them there), the
//! step runs on the host's cores ([`host_step`], the kernels' arithmetic) and the
//! updated model copy goes to the devices with the all-gather's upload. Parameter
//! offload (stage 3's `offload_param`) keeps the master and moments on the device but
//! not the slice's 16-bit copy: the host rounds the downloaded f32 master into it.

use std::sync::Mutex;
use std::time::Instant;

use super::collective::{f32_parts, Processes};
pub use super::shard::{segments, shard_range, Segment};
use crate::device::optim::{host_step, HostState, ParamBuffers};
use crate::models::{human, Model, ModelStateBytes, Network, ParamState, ShardBytes};
use crate::{Buffer, DType, Device, Error, HostData, Kernel, Optimizer, Result};

/// One segment of a rank's shard: its slice of one tensor's optimizer state.
struct ShardSegment {
    seg: Segment,
    home: Home,
}

/// Where ZeRO keeps each rank's shard (DeepSpeed's `offload_optimizer` and
/// `offload_param`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Offload {
    /// The f32 master and moments in host memory, stepped there.
    pub optimizer: bool,
    /// No 16-bit copy of the slice on the device: the host makes the updated copy from
    /// the downloaded f32 master (the same rounding as the kernels'). Implied by
    /// `optimizer`, whose copies are made on the host anyway.
    pub params: bool,
}

/// Where a segment's optimizer state lives.
enum Home {
    /// On the rank's device: f32 master, moments and reduced gradient, and the slice's
    /// updated model copy (with parameter offload, `value` is the master: no copy).
    Device(ParamBuffers),
    /// In host memory (ZeRO-Offload): the f32 master and moments (SGD's momentum in
    /// `m`, `v` unused, as on a device). Locked only while one step or copy runs.
    Host(Mutex<HostSlice>),
}

struct HostSlice {
    master: Vec<f32>,
    m: Vec<f32>,
    v: Vec<f32>,
}

impl HostSlice {
    fn new(init: &[f32]) -> HostSlice {
        HostSlice {
            master: init.to_vec(),
            m: committed_zeros(init.len()),
            v: committed_zeros(init.len()),
        }
    }

    fn bytes(&self) -> u64 {
        4 * (self.master.len() + self.m.len() + self.v.len()) as u64
    }
}

/// `n` zeros written, not only reserved: the host memory an offloaded shard needs is
/// taken when the run starts (and a host too small for it fails then), not on the
/// first step.
fn committed_zeros(n: usize) -> Vec<f32> {
    let mut v = vec![0.0f32; n];
    // Zeroed pages from the allocator are not resident until written; the black box
    // keeps the writes from being folded away as already done.
    std::hint::black_box(&mut v[..]);
    v.fill(0.0);
    v
}

/// The weight decay tensor `param` of `layout` takes (0 where decay does not apply).
fn weight_decay(optimizer: &Optimizer, layout: &[(usize, DType, bool)], param: usize) -> f32 {
    if layout[param].2 {
        optimizer.weight_decay()
    } else {
        0.0
    }
}

impl ShardSegment {
    /// Steps this segment on the host, if it is offloaded, from the reduced gradients
    /// `sum` of tensors laid out as `layout`, and returns its updated model copy;
    /// `None` for a segment on its device.
    fn step_on_host(
        &self,
        optimizer: &Optimizer,
        layout: &[(usize, DType, bool)],
        (sum, lr, grad_scale, step): (&[Vec<f32>], f32, f32, u32),
    ) -> Result<Option<HostData>> {
        let Home::Host(slice) = &self.home else {
            return Ok(None);
        };
        let param = self.seg.param;
        let mut slice = lock(slice);
        let HostSlice { master, m, v } = &mut *slice;
        let grads = &sum[param][self.seg.range.clone()];
        let hyper = (lr, weight_decay(optimizer, layout, param), step);
        host_step(
            optimizer,
            hyper,
            grad_scale,
            grads,
            HostState { master, m, v },
        )?;
        Ok(Some(HostData::from_f32(layout[param].1, &slice.master)))
    }
}

/// `step` (an optimizer kernel) without its write of the 16-bit model copy.
fn without_copy(mut step: Kernel) -> Kernel {
    match &mut step {
        Kernel::Adam(a) => a.params = None,
        Kernel::Sgd(s) => s.params = None,
        _ => {}
    }
    step
}

/// Gives every replica tensor `i`'s updated model copy `whole`: uploaded, or kept as
/// one host copy the replicas share where ZeRO stage 3 streams the tensor (its loads
/// move it later). Returns the bytes uploaded.
fn hand_out(
    models: &[&mut Network],
    devs: &[&dyn Device],
    i: usize,
    whole: HostData,
) -> Result<u64> {
    let whole = std::sync::Arc::new(whole);
    let mut bytes = 0;
    for (m, dev) in models.iter().zip(devs) {
        m.set_value_shared(*dev, i, &whole)?;
        if !m.streams(i) {
            bytes += whole.as_bytes().len() as u64;
        }
    }
    Ok(bytes)
}

fn lock(slice: &Mutex<HostSlice>) -> std::sync::MutexGuard<'_, HostSlice> {
    // A panic elsewhere while holding it cannot leave a half-written step: the step
    // writes every element or returns an error before writing.
    slice.lock().unwrap_or_else(|e| e.into_inner())
}

/// Device bytes of rank `rank`'s shard of tensors of `sizes` elements over `world`
/// ranks, the model copies in `dtype`, as [`Shards::from_masters`] allocates it on the
/// device: per segment f32 master, moments and reduced gradient and the slice's copy,
/// and the f32 gradient factor. Offloaded, none.
pub fn device_bytes(sizes: &[usize], world: usize, rank: usize, dtype: DType) -> u64 {
    let f32b = |n: usize| DType::F32.padded_bytes(n);
    segments(sizes, world, rank)
        .iter()
        .map(|s| 4 * f32b(s.range.len()))
        .sum::<u64>()
        + copy_bytes(sizes, world, rank, dtype)
        + f32b(1)
}

/// The bytes of the 16-bit copies of rank `rank`'s slices (in [`device_bytes`]; what
/// parameter offload leaves off the device).
pub fn copy_bytes(sizes: &[usize], world: usize, rank: usize, dtype: DType) -> u64 {
    segments(sizes, world, rank)
        .iter()
        .map(|s| dtype.padded_bytes(s.range.len()))
        .sum()
}

/// The optimizer state a group's `ranks` (this process's, of `world`) hold for
/// `model`'s trained parameters with model copies in `dtype`: the most any one device
/// holds ([`device_bytes`]) and its largest buffer (a segment's f32 slice), or, when
/// with the optimizer state offloaded, nothing on the devices and 12 bytes per element
/// of those ranks' slices in host memory; with the parameters offloaded, no copies.
pub fn shard_bytes(
    model: &dyn Model,
    world: usize,
    ranks: std::ops::Range<usize>,
    dtype: DType,
    offload: Offload,
) -> ShardBytes {
    // The trained parameters come first in a model's list, the frozen after.
    let sizes: Vec<usize> = model
        .parameters()
        .iter()
        .take_while(|p| !p.frozen)
        .map(|p| p.len())
        .collect();
    shard_bytes_of(&sizes, world, ranks, dtype, offload)
}

/// [`shard_bytes`] for tensors of `sizes` elements (a pipeline stage's).
pub fn shard_bytes_of(
    sizes: &[usize],
    world: usize,
    ranks: std::ops::Range<usize>,
    dtype: DType,
    offload: Offload,
) -> ShardBytes {
    if offload.optimizer {
        let total = sizes.iter().sum();
        let elements: usize = ranks.map(|r| shard_range(total, world, r).len()).sum();
        return ShardBytes {
            host: 12 * elements as u64,
            ..ShardBytes::default()
        };
    }
    let largest = ranks
        .clone()
        .flat_map(|r| segments(sizes, world, r))
        .map(|s| DType::F32.padded_bytes(s.range.len()))
        .max()
        .unwrap_or(0);
    let copies = |r| match offload.params {
        true => copy_bytes(sizes, world, r, dtype),
        false => 0,
    };
    let device = ranks
        .map(|r| device_bytes(sizes, world, r, dtype) - copies(r))
        .max()
        .unwrap_or(0);
    ShardBytes {
        device,
        largest,
        host: 0,
    }
}

/// Refuses, before anything is allocated, an offloaded optimizer state that the host
/// cannot hold: `need` bytes of this process's shards (12 per element: f32 master and
/// two moments) against `available` host bytes (`None`: the host does not say).
pub fn check_host_fits(need: u64, available: Option<u64>) -> Result<()> {
    let elements = need / 12;
    match available {
        Some(avail) if need > avail => Err(Error::InvalidArgument(format!(
            "zero_optimization.offload_optimizer: the host needs {} for this process's \
             shards of the optimizer state ({elements} parameters × 12 bytes: f32 master \
             weights and two moments) but has {} available (each process of a job checks \
             its own shards); spread the data-parallel ranks over more hosts (each holds \
             only its ranks' shards), free host memory, or keep the state on the devices \
             (remove offload_optimizer)",
            human(need),
            human(avail)
        ))),
        _ => Ok(()),
    }
}

/// An offloaded step's host time (ms): the host step over the slices, and the part
/// of it the devices waited for beyond the updated weights' uploads (not hidden
/// behind them). Zero without offload.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct OffloadTime {
    pub host_ms: f64,
    pub exposed_ms: f64,
}

/// What one update of the shards gave: every tensor's whole updated model copy (for
/// the caller to write to its replicas), the bytes moved so far, and the time the
/// host spent stepping offloaded shards (ms; 0 without offload).
pub struct Updated {
    pub wholes: Vec<HostData>,
    pub bytes: u64,
    pub host_ms: f64,
}

/// ZeRO stages 1 and 2: every rank's optimizer-state segments, on its device (with
/// the f32[1] gradient factor its updates read) or, offloaded, in host memory.
pub struct Shards {
    /// This process's ranks' segments, in rank order.
    ranks: Vec<Vec<ShardSegment>>,
    /// Per rank, on its device; empty when offloaded.
    scale: Vec<Buffer>,
    procs: Option<Processes>,
    /// Every slice is in host memory.
    offloaded: bool,
    /// The slices on the devices have no 16-bit copy (parameter offload).
    copies_on_host: bool,
}

impl Shards {
    /// Gives each of `devs` (ranks, in order) its slice of the tensors whose initial
    /// f32 masters are `masters` (the same on every rank: replicas start from the same
    /// weights) and whose model copies are stored in `dtypes`: a network's trained
    /// parameters (`Network::new_without_optimizer`) or a pipeline stage's. `offload`
    /// says where the slices live ([`Offload`]). With `procs`, the
    /// partitioning spans every process's devices and these are this process's.
    pub fn from_masters(
        devs: &[&dyn Device],
        masters: &[&[f32]],
        dtypes: &[DType],
        procs: Option<&Processes>,
        offload: Offload,
    ) -> Result<Shards> {
        let copies_on_host = offload.params && !offload.optimizer;
        let world = procs.map_or(devs.len(), Processes::world);
        let first = procs.map_or(0, Processes::first_rank);
        let sizes: Vec<usize> = masters.iter().map(|m| m.len()).collect();
        let (mut ranks, mut scale) = (vec![], vec![]);
        for (rank, &dev) in devs.iter().enumerate() {
            let mut segs = vec![];
            for seg in segments(&sizes, world, first + rank) {
                let init = &masters[seg.param][seg.range.clone()];
                let home = if offload.optimizer {
                    Home::Host(Mutex::new(HostSlice::new(init)))
                } else if copies_on_host {
                    Home::Device(ParamBuffers::without_copy(dev, init, DType::F32)?)
                } else {
                    Home::Device(ParamBuffers::new(dev, init, dtypes[seg.param], DType::F32)?)
                };
                segs.push(ShardSegment { seg, home });
            }
            ranks.push(segs);
            if !offload.optimizer {
                scale.push(dev.alloc(DType::F32, 1)?);
            }
        }
        Ok(Shards {
            ranks,
            scale,
            procs: procs.cloned(),
            offloaded: offload.optimizer,
            copies_on_host,
        })
    }

    /// The optimizer state is in host memory (ZeRO-Offload).
    pub fn offloaded(&self) -> bool {
        self.offloaded
    }

    /// Each rank updates its own segments from the reduced gradients `sum` (a
    /// reduce-scatter: it receives only its slice), then the updated slices are
    /// gathered on the host and every rank receives the whole new model copy (the
    /// all-gather). `step` is 1-based. Returns the bytes moved and, offloaded, the
    /// host step's time.
    pub fn apply(
        &self,
        models: &mut [&mut Network],
        devs: &[&dyn Device],
        optimizer: &Optimizer,
        (sum, lr, grad_scale, step): (&[Vec<f32>], f32, f32, u64),
    ) -> Result<(u64, OffloadTime)> {
        let layout: Vec<(usize, DType, bool)> = models[0]
            .parameter_layout()
            .into_iter()
            .map(|(_, shape, dtype, decay)| (shape.iter().product(), dtype, decay))
            .collect();
        let step32 = u32::try_from(step).map_err(|_| {
            Error::InvalidArgument("more optimizer steps than the engine counts".into())
        })?;
        let hyper = (sum, lr, grad_scale, step);
        let (bytes, time) = if self.offloaded && self.procs.is_none() {
            self.apply_overlapped(models, devs, optimizer, &layout, hyper)?
        } else {
            let Updated {
                wholes,
                mut bytes,
                host_ms,
            } = self.update(devs, optimizer, &layout, hyper)?;
            for (i, whole) in wholes.into_iter().enumerate() {
                bytes += hand_out(models, devs, i, whole)?;
            }
            // Every update is stepped before the first upload: none of it hidden.
            let time = OffloadTime {
                host_ms,
                exposed_ms: host_ms,
            };
            (bytes, time)
        };
        for m in models.iter_mut() {
            m.set_steps_applied(step32);
        }
        Ok((bytes, time))
    }

    /// [`Shards::apply`] with every slice in this process's host memory: tensor by
    /// tensor, a host thread steps the slices of a tensor (on every core) while this
    /// thread hands the tensors stepped before it to every replica (uploads, or the
    /// host copy stage 3 loads from), so the host step and the uploads overlap. The same arithmetic on the same numbers as
    /// [`Shards::update`], so the same bits. An error leaves some tensors stepped on
    /// the host and not on the devices: the step has failed as a whole, and the run
    /// resumes from its last checkpoint (as after any failed update).
    fn apply_overlapped(
        &self,
        models: &[&mut Network],
        devs: &[&dyn Device],
        optimizer: &Optimizer,
        layout: &[(usize, DType, bool)],
        (sum, lr, grad_scale, step): (&[Vec<f32>], f32, f32, u64),
    ) -> Result<(u64, OffloadTime)> {
        let step = u32::try_from(step).expect("apply checked the step");
        let mut by_param: Vec<Vec<&ShardSegment>> = vec![vec![]; layout.len()];
        for s in self.ranks.iter().flatten() {
            by_param[s.seg.param].push(s);
        }
        let t0 = Instant::now();
        let (mut bytes, mut upload_ms) = (0, 0.0);
        // Two tensors ahead at most: the host memory in flight stays small.
        let (tx, rx) = std::sync::mpsc::sync_channel::<Result<HostData>>(2);
        let host_ms = std::thread::scope(|scope| -> Result<f64> {
            // Owned here: an upload's error drops it on return, which stops the
            // stepper at its next send instead of leaving it blocked on a full channel.
            let rx = rx;
            let stepper = scope.spawn(move || {
                let mut busy = 0.0;
                for (i, segs) in by_param.iter().enumerate() {
                    let t = Instant::now();
                    let (n, dtype, _) = layout[i];
                    let whole = (|| {
                        let mut part = Vec::with_capacity(n * dtype.size());
                        for s in segs {
                            let value = s
                                .step_on_host(optimizer, layout, (sum, lr, grad_scale, step))?
                                .expect("an offloaded shard holds host slices only");
                            part.extend_from_slice(value.as_bytes());
                        }
                        Ok(HostData::from_bytes(dtype, n, &part))
                    })();
                    busy += t.elapsed().as_secs_f64() * 1e3;
                    let failed = whole.is_err();
                    if tx.send(whole).is_err() || failed {
                        break;
                    }
                }
                busy
            });
            for (i, whole) in rx.iter().enumerate() {
                let t = Instant::now();
                bytes += hand_out(models, devs, i, whole?)?;
                upload_ms += t.elapsed().as_secs_f64() * 1e3;
            }
            Ok(stepper.join().expect("the host step does not panic"))
        })?;
        // The devices wait for the last upload: what the step added beyond the
        // uploads' own time is the host step's exposed part.
        let wall = t0.elapsed().as_secs_f64() * 1e3;
        let exposed_ms = (wall - upload_ms).clamp(0.0, host_ms);
        Ok((
            bytes,
            OffloadTime {
                host_ms,
                exposed_ms,
            },
        ))
    }

    /// [`Shards::apply`]'s update and all-gather for tensors laid out as `layout`
    /// (elements, storage dtype, weight decay applies), in the order the shards were
    /// made from (see [`Updated`]).
    pub fn update(
        &self,
        devs: &[&dyn Device],
        optimizer: &Optimizer,
        layout: &[(usize, DType, bool)],
        (sum, lr, grad_scale, step): (&[Vec<f32>], f32, f32, u64),
    ) -> Result<Updated> {
        let step = u32::try_from(step).map_err(|_| {
            Error::InvalidArgument("more optimizer steps than the engine counts".into())
        })?;
        let mut bytes = 0;
        for ((segs, &scale), dev) in self.ranks.iter().zip(&self.scale).zip(devs) {
            dev.upload(scale, &HostData::F32(vec![grad_scale]))?;
            for s in segs {
                let Home::Device(buffers) = &s.home else {
                    continue;
                };
                let g = HostData::F32(sum[s.seg.param][s.seg.range.clone()].to_vec());
                bytes += g.as_bytes().len() as u64;
                dev.upload(buffers.grad, &g)?;
                let decay = weight_decay(optimizer, layout, s.seg.param);
                let mut kernel = buffers.step(optimizer, scale, lr, decay, step);
                if self.copies_on_host {
                    kernel = without_copy(kernel);
                }
                dev.launch(&kernel)?;
            }
            dev.submit()?;
        }
        // Offloaded slices step on the host, each over every core, while the devices
        // (above) run theirs.
        let t0 = Instant::now();
        let mut host_values = vec![];
        for s in self.ranks.iter().flatten() {
            let hyper = (sum, lr, grad_scale, step);
            if let Some(value) = s.step_on_host(optimizer, layout, hyper)? {
                host_values.push(value);
            }
        }
        let host_ms = if self.offloaded {
            t0.elapsed().as_secs_f64() * 1e3
        } else {
            0.0
        };
        let mut host_values = host_values.into_iter();
        // All-gather: each tensor's slices, in rank order, make the whole tensor.
        let mut parts: Vec<Vec<u8>> = vec![vec![]; layout.len()];
        let mut mine = vec![];
        for (segs, dev) in self.ranks.iter().zip(devs) {
            for s in segs {
                let v = match &s.home {
                    Home::Device(buffers) if self.copies_on_host => {
                        // The host rounds the master as the kernel would have.
                        let master = dev.download(buffers.master)?;
                        bytes += master.as_bytes().len() as u64;
                        HostData::from_f32(layout[s.seg.param].1, &master.to_f32())
                    }
                    Home::Device(buffers) => {
                        let v = dev.download(buffers.value)?;
                        bytes += v.as_bytes().len() as u64;
                        v
                    }
                    Home::Host(_) => host_values.next().expect("one value per host slice"),
                };
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
        Ok(Updated {
            wholes,
            bytes,
            host_ms,
        })
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
                let (master, m, v) = match &s.home {
                    Home::Device(b) => (
                        dev.download(b.master)?.to_f32(),
                        dev.download(b.m)?.to_f32(),
                        dev.download(b.v)?.to_f32(),
                    ),
                    Home::Host(slice) => {
                        let h = lock(slice);
                        (h.master.clone(), h.m.clone(), h.v.clone())
                    }
                };
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
                match &s.home {
                    Home::Device(b) => {
                        let f32s = |v: &[f32]| HostData::F32(v[r.clone()].to_vec());
                        dev.upload(b.master, &f32s(&st.master))?;
                        dev.upload(b.m, &f32s(&st.m))?;
                        dev.upload(b.v, &f32s(&st.v))?;
                    }
                    Home::Host(slice) => {
                        let mut h = lock(slice);
                        h.master.copy_from_slice(&st.master[r.clone()]);
                        h.m.copy_from_slice(&st.m[r.clone()]);
                        h.v.copy_from_slice(&st.v[r]);
                    }
                }
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
                match &s.home {
                    Home::Device(b) => {
                        dev.upload(b.master, &HostData::F32(master[r.clone()].to_vec()))?;
                        let zeros = HostData::F32(vec![0.0; r.len()]);
                        dev.upload(b.m, &zeros)?;
                        dev.upload(b.v, &zeros)?;
                    }
                    Home::Host(slice) => {
                        let mut h = lock(slice);
                        h.master.copy_from_slice(&master[r]);
                        h.m.fill(0.0);
                        h.v.fill(0.0);
                    }
                }
            }
        }
        Ok(())
    }

    /// Rank `rank`'s shard bytes: on its device master, moments, reduced gradient,
    /// updated model copy and the step's gradient factor; offloaded, the host's master
    /// and moments.
    pub fn add_bytes(&self, rank: usize, bytes: &mut ModelStateBytes) {
        let Some(segs) = self.ranks.get(rank) else {
            return;
        };
        for s in segs {
            match &s.home {
                Home::Device(b) => {
                    bytes.gradients += b.grad.bytes();
                    bytes.optimizer += b.master.bytes() + b.m.bytes() + b.v.bytes();
                    if !self.copies_on_host {
                        bytes.optimizer += b.value.bytes();
                    }
                }
                Home::Host(slice) => bytes.offloaded += lock(slice).bytes(),
            }
        }
        if let Some(scale) = self.scale.get(rank) {
            bytes.optimizer += scale.bytes();
        }
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
    fn an_offload_the_host_cannot_hold_is_refused_with_the_numbers() {
        // 100 Mi parameters: 1.2 GiB of f32 master and moments.
        let n = 100 << 20;
        assert!(check_host_fits(12 * n, None).is_ok());
        assert!(check_host_fits(12 * n, Some(12 * n)).is_ok());
        let e = check_host_fits(12 * n, Some(1 << 30))
            .unwrap_err()
            .to_string();
        for part in [
            "offload_optimizer",
            "1.2 GiB",
            "1.0 GiB",
            "104857600 parameters",
        ] {
            assert!(e.contains(part), "{part}: {e}");
        }
    }

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
