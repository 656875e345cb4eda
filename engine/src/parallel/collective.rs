//! Training across processes: the few collective operations the data-parallel exchange
//! and ZeRO need between processes ([`Collective`]), and [`Processes`], which says how
//! the global data-parallel world is spread over them.
//!
//! Every process drives its own local devices and reduces their gradients on the host
//! first, as a single-process group does; only then do the processes combine their
//! partial sums. Sums are formed in process order, so every process gets the same bits
//! and a topology gives the same result every run. Transports: [`ThreadProcesses`]
//! (threads of one program standing in for processes: tests and embedding) and, with
//! the `mpi` feature, MPI (`parallel::mpi`).

use std::ops::Range;
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use crate::{Error, Result};

/// The collective operations between the processes of one training job. Every
/// process calls the same operations in the same order; each one returns only when
/// every process has taken part (or fails naming the processes that did not).
pub trait Collective: Send + Sync {
    /// This process's index, 0-based.
    fn rank(&self) -> usize;
    /// Processes in the job.
    fn size(&self) -> usize;
    /// Replaces `data` by its element-wise sum over the processes, added in process
    /// order (`(p0 + p1) + p2 …`): the same bits on every process.
    fn sum_f32(&self, data: &mut [f32]) -> Result<()>;
    /// [`Collective::sum_f32`] in f64 (losses, norms, counters).
    fn sum_f64(&self, data: &mut [f64]) -> Result<()>;
    /// Every process's `data`, in process order (lengths may differ).
    fn all_gather(&self, data: &[u8]) -> Result<Vec<Vec<u8>>>;
    /// Sends `parts[j]` to process `j`; returns what every process sent this one, in
    /// process order (lengths may differ).
    fn all_to_all(&self, parts: &[Vec<u8>]) -> Result<Vec<Vec<u8>>>;
    /// Waits until every process has reached the point `what` names; a process that
    /// has not within the transport's timeout (it died or hangs) is named in the error.
    fn arrive(&self, what: &str) -> Result<()>;
    /// Stops every process of the job after a fatal error on this one, so none waits
    /// for it in a collective.
    fn abort(&self, code: i32);
    /// How long an operation waits for the other processes before it gives up (the
    /// transport's default until set).
    fn set_timeout(&self, timeout: Duration);
}

impl std::fmt::Debug for dyn Collective {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "process {} of {}", self.rank(), self.size())
    }
}

/// Whether this process was started by an MPI launcher (Open MPI, MPICH, PMIx).
pub fn launched_by_mpirun() -> bool {
    ["OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK"]
        .iter()
        .any(|v| std::env::var_os(v).is_some())
}

/// How the global data-parallel world is spread over the processes of a job.
#[derive(Clone)]
pub struct Processes {
    pub comm: Arc<dyn Collective>,
    /// Devices each process drives, in process order.
    pub devices: Vec<usize>,
    /// ZeRO: which process owns which part of each tensor. Gradients are then only
    /// reduce-scattered to their owners, not summed everywhere.
    pub owners: Option<Arc<Ownership>>,
}

/// ZeRO's partitioning seen by process: per tensor, the (process, element range)
/// pieces, in element order.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Ownership {
    pub by_param: Vec<Vec<(usize, Range<usize>)>>,
}

impl Ownership {
    /// The owners of tensors of `sizes` elements when the flat partitioning of
    /// `shard::segments` spans the devices of `devices[p]` per process.
    pub fn new(sizes: &[usize], devices: &[usize]) -> Ownership {
        let world = devices.iter().sum();
        let mut by_param = vec![vec![]; sizes.len()];
        let mut rank = 0;
        for (p, &n) in devices.iter().enumerate() {
            for r in rank..rank + n {
                for seg in super::shard::segments(sizes, world, r) {
                    let pieces: &mut Vec<(usize, Range<usize>)> = &mut by_param[seg.param];
                    match pieces.last_mut() {
                        // A process's ranks own adjacent ranges: one piece.
                        Some((q, range)) if *q == p && range.end == seg.range.start => {
                            range.end = seg.range.end
                        }
                        _ => pieces.push((p, seg.range)),
                    }
                }
            }
            rank += n;
        }
        Ownership { by_param }
    }
}

impl std::fmt::Debug for Processes {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Processes")
            .field("comm", &self.comm)
            .field("devices", &self.devices)
            .finish()
    }
}

impl Processes {
    /// Learns every process's device count (a collective: every process calls it).
    pub fn new(comm: Arc<dyn Collective>, local_devices: usize) -> Result<Processes> {
        if local_devices == 0 {
            return Err(Error::InvalidArgument(format!(
                "process {} drives no device; give every process at least one (--devices)",
                comm.rank()
            )));
        }
        let all = comm.all_gather(&(local_devices as u64).to_le_bytes())?;
        let devices = all
            .iter()
            .map(|b| {
                b.as_slice()
                    .try_into()
                    .map(|a: [u8; 8]| u64::from_le_bytes(a) as usize)
                    .map_err(|_| Error::InvalidArgument("a malformed device count".into()))
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(Processes {
            comm,
            devices,
            owners: None,
        })
    }

    /// The element ranges of tensor `param` this process owns (all of it without ZeRO).
    pub fn owned(&self, param: usize, len: usize) -> Vec<Range<usize>> {
        match &self.owners {
            None => std::iter::once(0..len).collect(),
            Some(o) => o.by_param[param]
                .iter()
                .filter(|(p, _)| *p == self.rank())
                .map(|(_, r)| r.clone())
                .collect(),
        }
    }

    /// ZeRO: replaces the parts of tensors `ids` this process owns by their sum over the
    /// processes (in process order); the rest is left as it was. Returns the bytes sent
    /// and received.
    fn sum_owned(
        &self,
        owners: &Ownership,
        ids: &[usize],
        tensors: &mut [Vec<f32>],
    ) -> Result<u64> {
        let me = self.rank();
        let procs = self.devices.len();
        let mut send = vec![vec![]; procs];
        for (&p, t) in ids.iter().zip(tensors.iter()) {
            for (q, r) in &owners.by_param[p] {
                send[*q].extend_from_slice(bytemuck::cast_slice(&t[r.clone()]));
            }
        }
        let got = self.comm.all_to_all(&send)?;
        let mut bytes = 0u64;
        for (q, (s, g)) in send.iter().zip(&got).enumerate() {
            if q != me {
                bytes += (s.len() + g.len()) as u64;
            }
        }
        let parts = f32_parts(&got, "gradient part")?;
        let mut off = 0;
        for (&p, t) in ids.iter().zip(tensors.iter_mut()) {
            for (q, r) in &owners.by_param[p] {
                if *q != me {
                    continue;
                }
                let n = r.len();
                for (j, part) in parts.iter().enumerate() {
                    let piece = part.get(off..off + n).ok_or_else(|| {
                        Error::InvalidArgument(format!(
                            "process {j} sent less gradient than this process owns"
                        ))
                    })?;
                    let out = &mut t[r.clone()];
                    if j == 0 {
                        out.copy_from_slice(piece);
                    } else {
                        for (a, b) in out.iter_mut().zip(piece) {
                            *a += *b;
                        }
                    }
                }
                off += n;
            }
        }
        Ok(bytes)
    }

    /// This process's index.
    pub fn rank(&self) -> usize {
        self.comm.rank()
    }

    /// Data-parallel ranks in the whole job: every process's devices.
    pub fn world(&self) -> usize {
        self.devices.iter().sum()
    }

    /// The global rank of this process's first device: ranks are numbered process by
    /// process, each process's devices in its own order.
    pub fn first_rank(&self) -> usize {
        self.devices[..self.rank()].iter().sum()
    }

    /// Checks that every process describes the job the same way (`what` lists what
    /// must agree: config, model, seed), refusing a job whose processes were started
    /// differently, with the processes that differ from process 0.
    pub fn check_same(&self, what: &str, description: &str) -> Result<()> {
        use sha2::Digest;
        let digest = sha2::Sha256::digest(description.as_bytes());
        let all = self.comm.all_gather(&digest)?;
        let differ: Vec<usize> = (1..all.len()).filter(|&p| all[p] != all[0]).collect();
        if !differ.is_empty() {
            return Err(Error::InvalidArgument(format!(
                "the processes of this job were started with different {what}: process(es) \
                 {differ:?} differ from process 0. Start every process with the same config, \
                 model and seed (one mpirun command line for all of them)"
            )));
        }
        Ok(())
    }

    /// Bytes this process sends and receives to sum `elems` f32 over the processes
    /// (a reduce-scatter and an all-gather each move (p-1)/p of them each way).
    pub fn sum_bytes(&self, elems: usize) -> u64 {
        let p = self.devices.len() as u64;
        4 * (p - 1) * elems as u64 * 4 / p
    }

    /// Sums host tensors (model tensors `ids`) over the processes, several tensors per
    /// collective (up to `bucket` elements, `reduce_bucket_size`), each in place —
    /// under ZeRO only the parts this process owns. Returns the bytes sent and received.
    pub fn sum_tensors(
        &self,
        ids: &[usize],
        tensors: &mut [Vec<f32>],
        bucket: usize,
    ) -> Result<u64> {
        if let Some(owners) = &self.owners {
            return self.sum_owned(owners, ids, tensors);
        }
        let elems: usize = tensors.iter().map(Vec::len).sum();
        let mut start = 0;
        while start < tensors.len() {
            let mut end = start;
            let mut elems = 0;
            while end < tensors.len() && (end == start || elems + tensors[end].len() <= bucket) {
                elems += tensors[end].len();
                end += 1;
            }
            if end - start == 1 {
                self.comm.sum_f32(&mut tensors[start])?;
            } else {
                let mut flat = Vec::with_capacity(elems);
                for t in &tensors[start..end] {
                    flat.extend_from_slice(t);
                }
                self.comm.sum_f32(&mut flat)?;
                let mut off = 0;
                for t in &mut tensors[start..end] {
                    let n = t.len();
                    t.copy_from_slice(&flat[off..off + n]);
                    off += n;
                }
            }
            start = end;
        }
        Ok(self.sum_bytes(elems))
    }

    /// The step's overflow flag and squared norm from this process's: under ZeRO each
    /// process inspected only what it owns, and the parts are added in process order.
    pub fn combine(&self, local: (bool, f64)) -> Result<(bool, f64)> {
        if self.owners.is_none() {
            return Ok(local);
        }
        let mut v = [local.1, f64::from(u8::from(local.0))];
        self.comm.sum_f64(&mut v)?;
        Ok((v[1] > 0.0, v[0]))
    }
}

/// Every process's bytes as f32 values (copied: received bytes need not be aligned
/// for f32); a length that is not whole values is an error naming the process.
pub fn f32_parts(parts: &[Vec<u8>], what: &str) -> Result<Vec<Vec<f32>>> {
    parts
        .iter()
        .enumerate()
        .map(|(q, b)| {
            if b.len() % 4 != 0 {
                return Err(Error::InvalidArgument(format!(
                    "process {q} sent a malformed {what} ({} bytes)",
                    b.len()
                )));
            }
            Ok(b.chunks_exact(4)
                .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                .collect())
        })
        .collect()
}

/// Threads of one program standing in for processes: each thread builds its own
/// trainer on its own devices and is given one of these. The operations meet at a
/// shared rendezvous; a thread that does not arrive within `timeout` is named.
pub struct ThreadProcesses {
    rank: usize,
    shared: Arc<Rendezvous>,
}

struct Rendezvous {
    size: usize,
    timeout_ms: std::sync::atomic::AtomicU64,
    state: Mutex<RoundState>,
    changed: Condvar,
}

#[derive(Default)]
struct RoundState {
    /// Operations completed so far; a round's contributions belong to `round`.
    round: u64,
    parts: Vec<Option<Vec<u8>>>,
    /// The last completed round's contributions, kept until every process read them.
    done: Vec<Vec<u8>>,
    readers: usize,
    aborted: Option<usize>,
}

impl ThreadProcesses {
    /// `size` handles, one per thread-process.
    pub fn group(size: usize, timeout: Duration) -> Vec<Arc<dyn Collective>> {
        let shared = Arc::new(Rendezvous {
            size,
            timeout_ms: (timeout.as_millis() as u64).into(),
            state: Mutex::new(RoundState {
                parts: vec![None; size],
                ..Default::default()
            }),
            changed: Condvar::new(),
        });
        (0..size)
            .map(|rank| {
                Arc::new(ThreadProcesses {
                    rank,
                    shared: shared.clone(),
                }) as Arc<dyn Collective>
            })
            .collect()
    }

    /// Contributes `data` to the next round and returns every process's contribution.
    fn exchange(&self, what: &str, data: Vec<u8>) -> Result<Vec<Vec<u8>>> {
        let r = &self.shared;
        let mut st = r.state.lock().unwrap_or_else(|e| e.into_inner());
        let timeout = r.timeout();
        let deadline = Instant::now() + timeout;
        // The previous round's results must be read by everyone before a new one starts.
        while st.readers > 0 {
            st = wait(&r.changed, st, deadline, r, what)?;
        }
        let round = st.round;
        st.parts[self.rank] = Some(data);
        if st.parts.iter().all(Option::is_some) {
            st.done = st.parts.iter_mut().map(|p| p.take().unwrap()).collect();
            st.readers = r.size;
            st.round += 1;
            r.changed.notify_all();
        }
        while st.round == round {
            if let Some(p) = st.aborted {
                return Err(Error::InvalidArgument(format!(
                    "process {p} aborted the job"
                )));
            }
            if Instant::now() >= deadline {
                let missing: Vec<usize> = (0..r.size).filter(|&p| st.parts[p].is_none()).collect();
                return Err(Error::InvalidArgument(format!(
                    "process(es) {missing:?} did not reach {what} within {:.0} s: they died or \
                     hang",
                    timeout.as_secs_f64()
                )));
            }
            st = wait(&r.changed, st, deadline, r, what)?;
        }
        let out = st.done.clone();
        st.readers -= 1;
        if st.readers == 0 {
            r.changed.notify_all();
        }
        Ok(out)
    }
}

impl Rendezvous {
    fn timeout(&self) -> Duration {
        Duration::from_millis(self.timeout_ms.load(std::sync::atomic::Ordering::SeqCst))
    }
}

fn wait<'a>(
    cv: &Condvar,
    st: std::sync::MutexGuard<'a, RoundState>,
    deadline: Instant,
    r: &Rendezvous,
    what: &str,
) -> Result<std::sync::MutexGuard<'a, RoundState>> {
    let left = deadline.saturating_duration_since(Instant::now());
    if left.is_zero() && st.readers > 0 {
        return Err(Error::InvalidArgument(format!(
            "the processes did not all finish the operation before {what} within {:.0} s",
            r.timeout().as_secs_f64()
        )));
    }
    let (st, _) = cv
        .wait_timeout(st, left.max(Duration::from_millis(1)))
        .unwrap_or_else(|e| e.into_inner());
    Ok(st)
}

/// Adds every process's copy of `T`-typed elements in process order.
fn fold_parts<T: Copy + std::ops::AddAssign + bytemuck::Pod>(data: &mut [T], parts: &[Vec<u8>]) {
    for (p, part) in parts.iter().enumerate() {
        let v: &[T] = bytemuck::cast_slice(part);
        if p == 0 {
            data.copy_from_slice(v);
        } else {
            for (a, b) in data.iter_mut().zip(v) {
                *a += *b;
            }
        }
    }
}

impl Collective for ThreadProcesses {
    fn rank(&self) -> usize {
        self.rank
    }

    fn size(&self) -> usize {
        self.shared.size
    }

    fn sum_f32(&self, data: &mut [f32]) -> Result<()> {
        let parts = self.exchange("a gradient sum", bytemuck::cast_slice(data).to_vec())?;
        fold_parts(data, &parts);
        Ok(())
    }

    fn sum_f64(&self, data: &mut [f64]) -> Result<()> {
        let parts = self.exchange("a sum", bytemuck::cast_slice(data).to_vec())?;
        fold_parts(data, &parts);
        Ok(())
    }

    fn all_gather(&self, data: &[u8]) -> Result<Vec<Vec<u8>>> {
        self.exchange("an all-gather", data.to_vec())
    }

    fn all_to_all(&self, parts: &[Vec<u8>]) -> Result<Vec<Vec<u8>>> {
        let mut packed = vec![];
        for p in parts {
            packed.extend_from_slice(&(p.len() as u64).to_le_bytes());
            packed.extend_from_slice(p);
        }
        let all = self.exchange("an all-to-all", packed)?;
        Ok(all
            .iter()
            .map(|packed| {
                // Process q's part for this process: the rank-th of its parts.
                let mut at = 0;
                let mut part = vec![];
                for q in 0..=self.rank {
                    let n = u64::from_le_bytes(packed[at..at + 8].try_into().unwrap()) as usize;
                    at += 8;
                    if q == self.rank {
                        part = packed[at..at + n].to_vec();
                    }
                    at += n;
                }
                part
            })
            .collect())
    }

    fn arrive(&self, what: &str) -> Result<()> {
        self.exchange(what, vec![]).map(|_| ())
    }

    fn abort(&self, _code: i32) {
        let r = &self.shared;
        let mut st = r.state.lock().unwrap_or_else(|e| e.into_inner());
        st.aborted = Some(self.rank);
        r.changed.notify_all();
    }

    fn set_timeout(&self, timeout: Duration) {
        let ms = timeout.as_millis().max(1) as u64;
        (self.shared.timeout_ms).store(ms, std::sync::atomic::Ordering::SeqCst);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn thread_processes_sum_in_process_order_and_name_the_missing_one() {
        let comms = ThreadProcesses::group(3, Duration::from_secs(10));
        let out: Vec<Vec<f32>> = std::thread::scope(|s| {
            let hs: Vec<_> = comms
                .iter()
                .enumerate()
                .map(|(p, c)| {
                    s.spawn(move || {
                        // (1e8 + 1) + -1e8 is 0 in f32 (1e8 + 1 rounds to 1e8);
                        // adding the first and last first would give 1.
                        let mut v = vec![[1e8f32, 1.0, -1e8][p], p as f32];
                        c.sum_f32(&mut v).unwrap();
                        let mut again = vec![p as f32 * 2.0];
                        c.sum_f32(&mut again).unwrap();
                        v.push(again[0]);
                        v
                    })
                })
                .collect();
            hs.into_iter().map(|h| h.join().unwrap()).collect()
        });
        for v in &out {
            assert_eq!(v, &[0.0, 3.0, 6.0]);
        }
        // 300 f32 over 3 processes: 200 of them leave and 200 arrive in each of the
        // two phases, 4 bytes each.
        let procs = Processes {
            comm: comms[0].clone(),
            devices: vec![1, 2, 1],
            owners: None,
        };
        assert_eq!(procs.sum_bytes(300), 4 * 200 * 4);
        assert_eq!((procs.world(), procs.first_rank()), (4, 0));
        // ZeRO's owners: 27 elements over 3 ranks (9 each), ranks 0-1 on process 0.
        let o = Ownership::new(&[5, 1, 7, 3, 11], &[2, 1]);
        let want: Vec<Vec<(usize, Range<usize>)>> = vec![
            vec![(0, 0..5)],
            vec![(0, 0..1)],
            vec![(0, 0..7)],
            vec![(0, 0..3)],
            vec![(0, 0..2), (1, 2..11)],
        ];
        assert_eq!(o.by_param, want);
        let comms = ThreadProcesses::group(2, Duration::from_millis(300));
        let err = comms[0]
            .arrive("step 5's exchange")
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("[1]") && err.contains("step 5's exchange"),
            "{err}"
        );
    }
}
