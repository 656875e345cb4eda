//! The MPI transport (`mpi` feature): processes started by `mpirun` (Open MPI or
//! MPICH) combine their host-side gradients with MPI collectives.
//!
//! Sums are a reduce-scatter and an all-gather built from `MPI_Alltoallv` and
//! `MPI_Allgatherv`: each process adds one slice of the vector from every process in
//! process order, so the result does not depend on the MPI library's reduction order,
//! and every process receives the same bits. A watchdog stops the whole job
//! (`MPI_Abort`) when a collective has not completed within the timeout, and
//! [`Collective::arrive`] names the processes that did not reach a step: no process
//! waits forever for one that died or hangs.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use mpi::datatype::{Partition, PartitionMut};
use mpi::topology::SimpleCommunicator;
use mpi::traits::*;
use mpi::Count;

use super::collective::Collective;
use super::zero::shard_range;
use crate::{Error, Result};

/// MPI, initialised for this process; finalised when dropped (every process must drop
/// it, after its last collective).
pub struct MpiSession {
    _universe: mpi::environment::Universe,
    comm: Arc<MpiComm>,
}

impl MpiSession {
    /// Initialises MPI with thread support (the exchange runs collectives on its own
    /// thread, and the watchdog may abort from another).
    pub fn init() -> Result<MpiSession> {
        let (universe, provided) = mpi::initialize_with_threading(mpi::Threading::Multiple)
            .ok_or_else(|| {
                Error::InvalidArgument("MPI was already initialised in this process".into())
            })?;
        if provided < mpi::Threading::Serialized {
            return Err(Error::InvalidArgument(format!(
                "this MPI library gives thread support {provided:?}; Kiln needs at least \
                 MPI_THREAD_SERIALIZED (Open MPI and MPICH as packaged by Debian provide it)"
            )));
        }
        let world = universe.world();
        let comm = Arc::new(MpiComm {
            rank: world.rank() as usize,
            size: world.size() as usize,
            timeout_ms: Arc::new(AtomicU64::new(600_000)),
            busy: Arc::new(Mutex::new(None)),
            arrivals: AtomicU64::new(0),
        });
        comm.start_watchdog();
        Ok(MpiSession {
            _universe: universe,
            comm,
        })
    }

    pub fn collective(&self) -> Arc<dyn Collective> {
        self.comm.clone()
    }
}

struct MpiComm {
    rank: usize,
    size: usize,
    timeout_ms: Arc<AtomicU64>,
    /// The collective in progress and when it began: what the watchdog watches.
    busy: Arc<Mutex<Option<(Instant, String)>>>,
    /// Arrival checks made so far (each process makes the same ones in order).
    arrivals: AtomicU64,
}

/// Elements per MPI call: counts are C ints.
const MAX_COUNT: usize = 1 << 30;
const ARRIVE_TAG: i32 = 7001;

fn world() -> SimpleCommunicator {
    SimpleCommunicator::world()
}

/// Waits for a non-blocking collective while leaving the cores to the devices: a
/// blocking MPI call spins on shared memory, and on a machine whose cores also run
/// the devices (lavapipe, an integrated GPU's driver threads) that spinning slows the
/// very backward the exchange overlaps.
fn patient<'a, D: ?Sized, S: mpi::request::Scope<'a>>(mut req: mpi::request::Request<'a, D, S>) {
    loop {
        match req.test() {
            Ok(_) => return,
            Err(pending) => req = pending,
        }
        std::thread::sleep(Duration::from_micros(50));
    }
}

impl MpiComm {
    fn timeout(&self) -> Duration {
        Duration::from_millis(self.timeout_ms.load(Ordering::SeqCst))
    }

    fn start_watchdog(&self) {
        let (busy, timeout_ms, rank) = (self.busy.clone(), self.timeout_ms.clone(), self.rank);
        std::thread::Builder::new()
            .name("kiln-mpi-watchdog".into())
            .spawn(move || loop {
                std::thread::sleep(Duration::from_millis(200));
                let timeout = Duration::from_millis(timeout_ms.load(Ordering::SeqCst));
                let stuck = busy
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .as_ref()
                    .filter(|(since, _)| since.elapsed() > timeout)
                    .map(|(_, what)| what.clone());
                if let Some(what) = stuck {
                    eprintln!(
                        "kiln (process {rank}): {what} among the processes has not completed \
                         within {:.0} s (kiln.collective_timeout_s): another process died or \
                         hangs; stopping the whole job",
                        timeout.as_secs_f64()
                    );
                    world().abort(3);
                }
            })
            .expect("a watchdog thread");
    }

    /// Runs one blocking collective under the watchdog.
    fn watched<R>(&self, what: &str, f: impl FnOnce() -> R) -> R {
        *self.busy.lock().unwrap_or_else(|e| e.into_inner()) = Some((Instant::now(), what.into()));
        let r = f();
        *self.busy.lock().unwrap_or_else(|e| e.into_inner()) = None;
        r
    }

    /// The process-order sum of `data` over the processes: a reduce-scatter (each
    /// process folds its slice of every process's copy) and an all-gather.
    fn sum<T>(&self, data: &mut [T]) -> Result<()>
    where
        T: Equivalence + Copy + Default + std::ops::AddAssign,
    {
        if self.size == 1 {
            return Ok(());
        }
        let p = self.size;
        for piece in data.chunks_mut(MAX_COUNT) {
            let n = piece.len();
            let ranges: Vec<_> = (0..p).map(|j| shard_range(n, p, j)).collect();
            let counts: Vec<Count> = ranges.iter().map(|r| r.len() as Count).collect();
            let displs: Vec<Count> = ranges.iter().map(|r| r.start as Count).collect();
            let mine = ranges[self.rank].len();
            let mut slices = vec![T::default(); mine * p];
            let recv_counts = vec![mine as Count; p];
            let recv_displs: Vec<Count> = (0..p).map(|j| (j * mine) as Count).collect();
            self.watched("a gradient sum (reduce-scatter)", || {
                let send = Partition::new(&piece[..], &counts[..], &displs[..]);
                let mut recv =
                    PartitionMut::new(&mut slices[..], &recv_counts[..], &recv_displs[..]);
                let world = world();
                mpi::request::scope(|scope| {
                    patient(world.immediate_all_to_all_varcount_into(scope, &send, &mut recv))
                });
            });
            let mut acc: Vec<T> = slices[..mine].to_vec();
            for j in 1..p {
                for (a, b) in acc.iter_mut().zip(&slices[j * mine..(j + 1) * mine]) {
                    *a += *b;
                }
            }
            self.watched("a gradient sum (all-gather)", || {
                let mut recv = PartitionMut::new(&mut piece[..], &counts[..], &displs[..]);
                let world = world();
                mpi::request::scope(|scope| {
                    patient(world.immediate_all_gather_varcount_into(scope, &acc[..], &mut recv))
                });
            });
        }
        Ok(())
    }
}

impl Collective for MpiComm {
    fn rank(&self) -> usize {
        self.rank
    }

    fn size(&self) -> usize {
        self.size
    }

    fn sum_f32(&self, data: &mut [f32]) -> Result<()> {
        self.sum(data)
    }

    fn sum_f64(&self, data: &mut [f64]) -> Result<()> {
        self.sum(data)
    }

    fn all_gather(&self, data: &[u8]) -> Result<Vec<Vec<u8>>> {
        // The same part for every process: an all-to-all moves exactly the bytes an
        // all-gather does, and keeps one place that splits large transfers.
        self.all_to_all(&vec![data.to_vec(); self.size])
    }

    fn all_to_all(&self, parts: &[Vec<u8>]) -> Result<Vec<Vec<u8>>> {
        let p = self.size;
        let sizes: Vec<u64> = parts.iter().map(|v| v.len() as u64).collect();
        let mut lens = vec![0u64; p];
        self.watched("an all-to-all of sizes", || {
            world().all_to_all_into(&sizes[..], &mut lens[..])
        });
        let mut out: Vec<Vec<u8>> = lens
            .iter()
            .map(|&l| Vec::with_capacity(l as usize))
            .collect();
        // Rounds of at most MAX_COUNT bytes each way, so counts and displacements fit
        // C ints.
        let cap = (MAX_COUNT / p).max(1);
        let mut done = 0usize;
        while (0..p).any(|j| sizes[j] as usize > done || lens[j] as usize > done) {
            let left = |len: u64| (len as usize).saturating_sub(done).min(cap);
            let send_counts: Vec<Count> = sizes.iter().map(|&l| left(l) as Count).collect();
            let recv_counts: Vec<Count> = lens.iter().map(|&l| left(l) as Count).collect();
            let displs = |counts: &[Count]| -> Vec<Count> {
                counts
                    .iter()
                    .scan(0, |acc, &c| {
                        let d = *acc;
                        *acc += c;
                        Some(d)
                    })
                    .collect()
            };
            let (send_displs, recv_displs) = (displs(&send_counts), displs(&recv_counts));
            let mut send: Vec<u8> = parts
                .iter()
                .flat_map(|v| {
                    v[done.min(v.len())..(done + cap).min(v.len())]
                        .iter()
                        .copied()
                })
                .collect();
            let mut buf = vec![
                0u8;
                recv_counts
                    .iter()
                    .map(|&c| c as usize)
                    .sum::<usize>()
                    .max(1)
            ];
            if send.is_empty() {
                // An empty buffer's address is 1, which Open MPI reads as
                // `MPI_IN_PLACE`; the counts still say 0.
                send.push(0);
            }
            self.watched("a gradient reduce-scatter", || {
                let send = Partition::new(&send[..], &send_counts[..], &send_displs[..]);
                let mut recv = PartitionMut::new(&mut buf[..], &recv_counts[..], &recv_displs[..]);
                let world = world();
                mpi::request::scope(|scope| {
                    patient(world.immediate_all_to_all_varcount_into(scope, &send, &mut recv))
                });
            });
            for j in 0..p {
                let d = recv_displs[j] as usize;
                out[j].extend_from_slice(&buf[d..d + recv_counts[j] as usize]);
            }
            done += cap;
        }
        Ok(out)
    }

    fn arrive(&self, what: &str) -> Result<()> {
        if self.size == 1 {
            return Ok(());
        }
        let seq = self.arrivals.fetch_add(1, Ordering::SeqCst);
        let world = world();
        let peers: Vec<usize> = (0..self.size).filter(|&j| j != self.rank).collect();
        let mut got = vec![0u64; peers.len()];
        let timeout = self.timeout();
        let started = Instant::now();
        mpi::request::scope(|scope| {
            let sends: Vec<_> = peers
                .iter()
                .map(|&j| {
                    world
                        .process_at_rank(j as i32)
                        .immediate_send_with_tag(scope, &seq, ARRIVE_TAG)
                })
                .collect();
            let mut recvs: Vec<Option<_>> = got
                .iter_mut()
                .zip(&peers)
                .map(|(slot, &j)| {
                    Some(
                        world
                            .process_at_rank(j as i32)
                            .immediate_receive_into_with_tag(scope, slot, ARRIVE_TAG),
                    )
                })
                .collect();
            loop {
                for r in recvs.iter_mut() {
                    if let Some(req) = r.take() {
                        if let Err(req) = req.test() {
                            *r = Some(req);
                        }
                    }
                }
                if recvs.iter().all(Option::is_none) {
                    break;
                }
                if started.elapsed() > timeout {
                    let missing: Vec<usize> = recvs
                        .iter()
                        .zip(&peers)
                        .filter(|(r, _)| r.is_some())
                        .map(|(_, &j)| j)
                        .collect();
                    eprintln!(
                        "kiln (process {}): process(es) {missing:?} did not reach {what} within \
                         {:.0} s (kiln.collective_timeout_s): they died or hang; stopping the \
                         whole job",
                        self.rank,
                        timeout.as_secs_f64()
                    );
                    world.abort(3);
                }
                std::thread::sleep(Duration::from_millis(2));
            }
            for s in sends {
                s.wait();
            }
        });
        if let Some((j, s)) = peers.iter().zip(&got).find(|(_, &s)| s != seq) {
            return Err(Error::InvalidArgument(format!(
                "process {j} is at arrival {s} where this process is at {seq} ({what}): the \
                 processes have fallen out of step"
            )));
        }
        Ok(())
    }

    fn abort(&self, code: i32) {
        world().abort(code)
    }

    /// The timeout after which a collective that has not completed stops the job.
    fn set_timeout(&self, timeout: Duration) {
        let ms = timeout.as_millis().max(1) as u64;
        self.timeout_ms.store(ms, Ordering::SeqCst);
    }
}
