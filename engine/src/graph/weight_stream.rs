//! Weights that take turns in one device buffer (ZeRO stage 3): parameters bound to
//! the same model-copy buffer are each loaded into it from host memory just before
//! the first launch that reads them, in stream order, and stay there until another
//! one is loaded. A plan over such bindings ([`Bindings`]) carries one of these.
//!
//! Alike blocks of a model read their weights one block after another in forward and
//! again, in reverse, in backward, so one block's buffers serve every block: a device
//! holds the weights of one block (plus those outside blocks) instead of all of them.
//! What a load costs is the upload of one block's weights; the device runs the work
//! submitted before it while the host copies (the load submits first).
//!
//! [`Bindings`]: super::Bindings

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Instant;

use crate::{Buffer, Device, Error, HostData, Kernel, Result};

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
}

impl StreamStats {
    /// Adds `other`'s loads to these.
    pub fn add(&mut self, other: StreamStats) {
        self.loads += other.loads;
        self.bytes += other.bytes;
        self.ms += other.ms;
        self.hidden_ms += other.hidden_ms;
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
        Ok(WeightStream {
            reads,
            slot,
            host: Mutex::new(vec![None; n]),
            resident: Mutex::new(HashMap::new()),
            stats: Mutex::new(StreamStats::default()),
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
            let t = Instant::now();
            // Not resident while the upload may have failed half-way.
            resident.remove(&slot.id);
            dev.upload(slot, &data)?;
            resident.insert(slot.id, p);
            let ms = t.elapsed().as_secs_f64() * 1e3;
            let hidden = dev.busy()?;
            let mut s = lock(&self.stats);
            s.loads += 1;
            s.bytes += data.as_bytes().len() as u64;
            s.ms += ms;
            if hidden {
                s.hidden_ms += ms;
            }
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
