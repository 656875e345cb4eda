//! Weights that take turns in one device buffer (ZeRO stage 3): parameters bound to
//! the same model-copy buffer are each loaded into it from host memory just before
//! the first launch that reads them, in stream order, and stay there until another
//! one is loaded. A plan over such bindings ([`Bindings`]) carries one of these.
//!
//! Alike blocks of a model read their weights one block after another in forward and
//! again, in reverse, in backward, so one block's buffers serve every block: a device
//! holds the weights of one block (plus those outside blocks) instead of all of them.
//! What a load costs is the upload of one block's weights; the device runs the work
//! submitted before it while the host copies (the load submits first). An upload
//! takes staging memory from the backend until the device has copied it, so the host
//! may run at most two blocks' loads ahead of the device: each load queues a fence
//! (a readback of a one-element buffer of the stream's) and a load past that waits for
//! the oldest.
//!
//! [`Bindings`]: super::Bindings

use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Instant;

use crate::{Buffer, Device, Error, HostData, Kernel, PendingDownload, Result};

/// What the loads of a plan moved since the last [`WeightStream::take_stats`].
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct StreamStats {
    /// Parameters loaded, and their bytes.
    pub loads: u64,
    pub bytes: u64,
    /// Host time inside the uploads (ms), and the part of it spent while the device
    /// was still running earlier work: an upload after which the device is still busy
    /// counts as hidden; one after which it is idle counts as exposed, whole (the
    /// device may have waited for part of it only).
    pub ms: f64,
    pub hidden_ms: f64,
    /// The most bytes of loads the device had not yet copied when one was issued
    /// (this one included): the staging the backend held for them.
    pub max_in_flight: u64,
}

impl StreamStats {
    /// Adds `other`'s loads to these.
    pub fn add(&mut self, other: StreamStats) {
        self.loads += other.loads;
        self.bytes += other.bytes;
        self.ms += other.ms;
        self.hidden_ms += other.hidden_ms;
        self.max_in_flight = self.max_in_flight.max(other.max_in_flight);
    }
}

pub(super) struct WeightStream {
    /// Per launch: the streamed parameters it reads (empty for most).
    reads: Vec<Vec<usize>>,
    /// Per parameter: the shared buffer it is loaded into (`None`: not streamed).
    slot: Vec<Option<Buffer>>,
    /// Per parameter: its model copy in host memory, once given.
    host: Mutex<Vec<Option<Arc<HostData>>>>,
    /// Which parameter each shared buffer holds now, by buffer id.
    resident: Mutex<HashMap<u64, usize>>,
    stats: Mutex<StreamStats>,
    /// Loads the device may not have copied yet, oldest first: bytes and the fence
    /// queued behind the load.
    in_flight: Mutex<VecDeque<(u64, PendingDownload)>>,
    /// The one-element buffer the fences read, allocated on the first load (256 bytes
    /// of device memory; freed with the device).
    fence: Mutex<Option<Buffer>>,
    /// Bytes of loads allowed in flight: two blocks' (every shared buffer's, twice).
    budget: u64,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // The guarded maps are written whole or not at all.
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl WeightStream {
    /// The stream of a plan whose launch `i` reads streamed parameters `reads[i]`
    /// ([`placeholder_reads`]), parameter `p` taking turns in buffer `slot[p]`
    /// (`None`: not streamed); `names(p)` names one for errors. A launch that reads
    /// two parameters taking turns in one buffer cannot run and is refused.
    pub(super) fn new(
        reads: Vec<Vec<usize>>,
        slot: Vec<Option<Buffer>>,
        names: &dyn Fn(usize) -> String,
    ) -> Result<WeightStream> {
        for (i, ps) in reads.iter().enumerate() {
            for (k, &p) in ps.iter().enumerate() {
                if let Some(&q) = ps[k + 1..].iter().find(|&&q| slot[q] == slot[p]) {
                    return Err(Error::InvalidArgument(format!(
                        "plan: launch {i} reads `{}` and `{}`, which are bound to one \
                         model-copy buffer (ZeRO stage 3 loads them in turn), so it cannot \
                         run; parameters one launch reads together must not share",
                        names(p),
                        names(q)
                    )));
                }
            }
        }
        let n = slot.len();
        let mut seen = HashSet::new();
        let block: u64 = slot
            .iter()
            .flatten()
            .filter(|b| seen.insert(b.id))
            .map(|b| b.bytes())
            .sum();
        Ok(WeightStream {
            reads,
            slot,
            host: Mutex::new(vec![None; n]),
            resident: Mutex::new(HashMap::new()),
            stats: Mutex::new(StreamStats::default()),
            in_flight: Mutex::new(VecDeque::new()),
            fence: Mutex::new(None),
            budget: 2 * block,
        })
    }

    /// Whether parameter `p` is loaded from host memory.
    pub(super) fn streams(&self, p: usize) -> bool {
        self.slot.get(p).is_some_and(Option::is_some)
    }

    /// Sets parameter `p`'s model copy (the next launch that reads it loads it).
    pub(super) fn set(&self, p: usize, data: Arc<HostData>) -> Result<()> {
        let Some(Some(slot)) = self.slot.get(p) else {
            return Err(Error::InvalidArgument(format!(
                "plan: parameter {p} is not streamed; its weights live on the device"
            )));
        };
        if data.dtype() != slot.dtype || data.len() != slot.len {
            return Err(Error::LenMismatch {
                what: format!("streamed weights of parameter {p} ({})", slot.dtype),
                expected: slot.len,
                found: data.len(),
            });
        }
        let mut resident = lock(&self.resident);
        if resident.get(&slot.id) == Some(&p) {
            resident.remove(&slot.id);
        }
        lock(&self.host)[p] = Some(data);
        Ok(())
    }

    /// Parameter `p`'s model copy in host memory.
    pub(super) fn get(&self, p: usize) -> Option<Arc<HostData>> {
        lock(&self.host).get(p).cloned().flatten()
    }

    /// Loads what launch `i` reads and its buffer does not hold. Submits first, so
    /// the device runs the launches recorded before while the host copies.
    pub(super) fn before(&self, dev: &dyn Device, i: usize) -> Result<()> {
        let Some(ps) = self.reads.get(i).filter(|ps| !ps.is_empty()) else {
            return Ok(());
        };
        let mut resident = lock(&self.resident);
        let mut submitted = false;
        for &p in ps {
            let slot = self.slot[p].expect("a read parameter is streamed");
            if resident.get(&slot.id) == Some(&p) {
                continue;
            }
            let data = self.get(p).ok_or_else(|| {
                Error::InvalidArgument(format!(
                    "plan: the weights of streamed parameter {p} were never set"
                ))
            })?;
            if !submitted {
                dev.submit()?;
                submitted = true;
            }
            let bytes = data.as_bytes().len() as u64;
            let pending = self.make_room(dev, bytes)?;
            let t = Instant::now();
            // Not resident while the upload may have failed half-way.
            resident.remove(&slot.id);
            dev.upload(slot, &data)?;
            resident.insert(slot.id, p);
            let ms = t.elapsed().as_secs_f64() * 1e3;
            let hidden = dev.busy()?;
            let fence = {
                let mut fence = lock(&self.fence);
                match *fence {
                    Some(b) => b,
                    None => *fence.insert(dev.alloc(crate::DType::F32, 1)?),
                }
            };
            let ticket = dev.begin_download(fence)?;
            lock(&self.in_flight).push_back((bytes, ticket));
            let mut s = lock(&self.stats);
            s.loads += 1;
            s.bytes += bytes;
            s.ms += ms;
            s.max_in_flight = s.max_in_flight.max(pending + bytes);
            if hidden {
                s.hidden_ms += ms;
            }
        }
        Ok(())
    }

    /// Waits, oldest first, for loads the device has not copied yet until `bytes` more
    /// fit the budget (one load always goes); returns the bytes still in flight.
    fn make_room(&self, dev: &dyn Device, bytes: u64) -> Result<u64> {
        let mut queue = lock(&self.in_flight);
        let mut pending: u64 = queue.iter().map(|q| q.0).sum();
        // A device with nothing running has copied every load: retire them all.
        let idle = !dev.busy()?;
        while let Some(&(b, _)) = queue.front() {
            if !idle && pending + bytes <= self.budget {
                break;
            }
            pending -= b;
            let (_, ticket) = queue.pop_front().expect("a front entry");
            dev.finish_download(ticket)?;
        }
        Ok(pending)
    }

    /// Redeems the fences still queued and frees their buffer: the loads are done
    /// once the device has run them, and a plan being freed loads nothing more.
    pub(super) fn release(&self, dev: &dyn Device) -> Result<()> {
        for (_, ticket) in lock(&self.in_flight).drain(..) {
            dev.finish_download(ticket)?;
        }
        if let Some(fence) = lock(&self.fence).take() {
            dev.free(fence)?;
        }
        Ok(())
    }

    /// The loads' totals since the last call, reset.
    pub(super) fn take_stats(&self) -> StreamStats {
        std::mem::take(&mut *lock(&self.stats))
    }

    /// Every host copy, to carry into a plan compiled again over the same bindings.
    pub(super) fn take_host(&self) -> Vec<Option<Arc<HostData>>> {
        lock(&self.resident).clear();
        std::mem::take(&mut *lock(&self.host))
    }

    pub(super) fn put_host(&self, host: Vec<Option<Arc<HostData>>>) -> Result<()> {
        let mut mine = lock(&self.host);
        if host.len() != mine.len() {
            return Err(Error::InvalidArgument(format!(
                "plan: {} streamed weights carried into a plan of {} parameters",
                host.len(),
                mine.len()
            )));
        }
        *mine = host;
        Ok(())
    }
}

/// Per launch, the streamed parameters it reads: `proxies` maps each streamed
/// parameter's placeholder id to its index.
pub(super) fn placeholder_reads(
    launches: &[Kernel],
    proxies: &HashMap<u64, usize>,
) -> Vec<Vec<usize>> {
    launches
        .iter()
        .map(|k| {
            let mut ps: Vec<usize> = k
                .buffers()
                .into_iter()
                .filter_map(|b| proxies.get(&b.id).copied())
                .collect();
            ps.sort_unstable();
            ps.dedup();
            ps
        })
        .collect()
}
