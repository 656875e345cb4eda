//! Data parallelism's gradient exchange through host memory: every rank runs forward
//! and backward on its share of the global batch; the gradients come down to the host,
//! are summed in f32 in a fixed order (so any schedule gives the same bits) and
//! averaged, and one overflow flag and one squared norm are computed on the result.
//! [`after_backward`] exchanges once every device is done; [`during_backward`]
//! overlaps the exchange with backward, block by block (`overlap_comm`), and also
//! serves ZeRO stage 2, whose blocks share gradient buffers.
//!
//! In a multi-process job ([`Processes`]) each process sums its own devices' copies
//! first, then the processes add their partial sums in process order (bucketed by
//! `reduce_bucket_size`, on a thread of its own during backward) and every process
//! divides by the global world size.

use super::collective::Processes;
use crate::device::profile::{span, SpanKind};
use crate::models::{MicroBatch, Network};
use crate::{Buffer, Device, Error, HostData, PendingDownload, Result};

/// How [`during_backward`] runs.
#[derive(Clone, Copy, Debug)]
pub struct During {
    /// Elements per host bucket (`reduce_bucket_size`).
    pub bucket: usize,
    /// Upload the average back into every rank's gradient buffers (stage 0); ZeRO ranks
    /// receive their slices later.
    pub upload: bool,
    /// ZeRO stage 2: the blocks share gradient buffers, so every micro-batch's
    /// gradients come over (and are summed on the host).
    pub partitioned: bool,
    /// Downloads overlap backward (`overlap_comm`); otherwise each block's copies are
    /// fetched before the next block is recorded.
    pub overlap: bool,
    /// The loss scale the step runs at.
    pub loss_scale: f32,
}

/// The gradients a step's exchange produced.
pub struct Exchanged {
    /// Mean loss over ranks.
    pub loss: f32,
    /// The average gradient per tensor.
    pub avg: Vec<Vec<f32>>,
    pub overflow: bool,
    pub sum_squares: f64,
    pub bytes: u64,
    /// When the exchange began (comm time is measured from here).
    pub started: std::time::Instant,
    /// Exchange time spent inside backward before `started` (stage 2 without overlap).
    pub blocked_ms: f64,
    /// The share of the gradient bytes summed while backward ran (across processes:
    /// the processes' sums, while any process was still in backward).
    pub overlap: f64,
    /// The average is already in every rank's gradient buffers.
    pub uploaded: bool,
    /// Bytes this process sent to and received from the other processes.
    pub process_bytes: u64,
}

/// Adds the ranks' copies of one tensor into `acc` in rank order (an empty `acc` starts
/// as the first copy), then multiplies by `scale` when given (the last round): so any
/// schedule gives the same bits. Split across threads when large.
pub fn fold(acc: &mut Vec<f32>, parts: &[Vec<f32>], scale: Option<f32>) {
    let _span = span("reduce", SpanKind::Reduce);
    let (first, rest) = if acc.is_empty() {
        *acc = vec![0f32; parts[0].len()];
        (Some(&parts[0]), &parts[1..])
    } else {
        (None, parts)
    };
    let n = acc.len();
    let fold = |range: std::ops::Range<usize>, out: &mut [f32]| {
        if let Some(first) = first {
            out.copy_from_slice(&first[range.clone()]);
        }
        for p in rest {
            for (a, b) in out.iter_mut().zip(&p[range.clone()]) {
                *a += b;
            }
        }
        if let Some(scale) = scale {
            for a in out.iter_mut() {
                *a *= scale;
            }
        }
    };
    const CHUNK: usize = 1 << 18;
    if n <= CHUNK {
        fold(0..n, acc);
    } else {
        std::thread::scope(|s| {
            for (i, chunk) in acc.chunks_mut(CHUNK).enumerate() {
                let lo = i * CHUNK;
                let fold = &fold;
                s.spawn(move || fold(lo..lo + chunk.len(), chunk));
            }
        });
    }
}

/// Multiplies by the averaging factor: the last operation of a [`fold`] when the
/// processes' sums came in between.
pub fn scale_in_place(a: &mut [f32], scale: f32) {
    for x in a {
        *x *= scale;
    }
}

/// A tensor's overflow flag and squared norm. Both exchange paths add the tensors'
/// squares in index order afterwards, so the norm has the same bits whatever order the
/// tensors arrived in.
pub fn inspect(avg: &[f32]) -> (bool, f64) {
    avg.iter().fold((false, 0.0), |(o, s), &a| {
        (o | !a.is_finite(), s + (a as f64) * (a as f64))
    })
}

/// [`inspect`] of the parts of a tensor this process owns (all of it without ZeRO
/// across processes).
fn inspect_owned(avg: &[f32], p: usize, procs: Option<&Processes>) -> (bool, f64) {
    match procs {
        Some(procs) if procs.owners.is_some() => {
            let parts: Vec<(bool, f64)> = procs
                .owned(p, avg.len())
                .into_iter()
                .map(|r| inspect(&avg[r]))
                .collect();
            combine(&parts)
        }
        _ => inspect(avg),
    }
}

/// The step's overflow flag and squared norm from the tensors', in index order.
pub fn combine(parts: &[(bool, f64)]) -> (bool, f64) {
    parts
        .iter()
        .fold((false, 0.0), |(o, s), &(a, b)| (o | a, s + b))
}

/// The mean loss over the global world from this process's ranks' summed losses.
fn mean_loss(local_sum: f64, world: usize, procs: Option<&Processes>) -> Result<f32> {
    let mut sum = [local_sum];
    if let Some(procs) = procs {
        procs.comm.sum_f64(&mut sum)?;
    }
    Ok((sum[0] / world as f64) as f32)
}

/// What each trained row's loss weighs in every rank's backward: the step's loss is the
/// mean over the trained rows of the global batch (every micro-batch of every rank, on
/// every process), and the exchange averages over the `world` ranks, so `world / rows`.
fn per_row(
    models: &[&mut Network],
    micro: &[Vec<MicroBatch>],
    world: usize,
    procs: Option<&Processes>,
) -> Result<f32> {
    let local: usize = models
        .iter()
        .zip(micro)
        .map(|(m, micro)| m.trained_rows(micro))
        .sum();
    let mut rows = [local as f64];
    if let Some(procs) = procs {
        procs.comm.sum_f64(&mut rows)?;
    }
    Ok(world as f32 / rows[0].max(1.0) as f32)
}

/// The exchange after backward (`overlap_comm` off): every device finishes, then
/// each one's gradients come down and the average is formed (with the other
/// processes' in `procs`, in buckets of `bucket` elements).
pub fn after_backward(
    mut models: Vec<&mut Network>,
    devs: &[&dyn Device],
    micro: &[Vec<MicroBatch>],
    loss_scale: f32,
    procs: Option<&Processes>,
    bucket: usize,
) -> Result<Exchanged> {
    let world = procs.map_or(models.len(), Processes::world);
    let per_row = per_row(&models, micro, world, procs)?;
    // Every device computes at once: accumulate submits without waiting.
    for (r, (m, dev)) in models.iter_mut().zip(devs).enumerate() {
        m.accumulate_with(*dev, &micro[r], loss_scale, per_row, None)?;
    }
    // The exchange is timed from when every device has finished its backward.
    for dev in devs {
        dev.wait()?;
    }
    let started = std::time::Instant::now();
    let mut loss = 0.0;
    let mut per_rank = vec![];
    let mut bytes = 0u64;
    for (m, dev) in models.iter().zip(devs) {
        loss += m.accumulated_loss(*dev)? as f64;
        per_rank.push(m.gradient_values(*dev)?);
        bytes += m.gradient_bytes();
    }
    let scale = 1.0 / world as f32;
    let mut avg: Vec<Vec<f32>> = (0..per_rank[0].len())
        .map(|p| {
            let parts: Vec<Vec<f32>> = per_rank
                .iter_mut()
                .map(|g| std::mem::take(&mut g[p]))
                .collect();
            let mut acc = vec![];
            fold(&mut acc, &parts, procs.is_none().then_some(scale));
            acc
        })
        .collect();
    let mut process_bytes = 0;
    if let Some(procs) = procs {
        let ids: Vec<usize> = (0..avg.len()).collect();
        process_bytes = procs.sum_tensors(&ids, &mut avg, bucket.max(1))?;
        for a in &mut avg {
            scale_in_place(a, scale);
        }
        bytes += process_bytes;
    }
    let inspected: Vec<(bool, f64)> = avg
        .iter()
        .enumerate()
        .map(|(p, a)| inspect_owned(a, p, procs))
        .collect();
    let mut local = combine(&inspected);
    if let Some(procs) = procs {
        local = procs.combine(local)?;
    }
    let (overflow, sum_squares) = local;
    Ok(Exchanged {
        loss: mean_loss(loss, world, procs)?,
        avg,
        overflow,
        sum_squares,
        bytes,
        started,
        blocked_ms: 0.0,
        overlap: 0.0,
        uploaded: false,
        process_bytes,
    })
}

/// The exchange during backward: each device records its backward on its own
/// thread, handing over parameters as their gradients become final; a downloader
/// thread per device copies them to the host in buckets of up to
/// `reduce_bucket_size` elements; this thread sums each tensor once every device's
/// copy is in and (stage 0) uploads the average back at once, while later layers
/// are still in backward (`overlap_comm` on).
///
/// ZeRO stage 2 (`partitioned`) hands over every micro-batch's gradients, block by
/// block, since the blocks share one set of gradient buffers; the host sums the
/// micro-batches too and each rank later receives only its shard. Without
/// `overlap_comm` its recorder fetches each block's copies itself before recording
/// the next block: nothing overlaps, and that time is exchange time.
///
/// With other processes (`procs`), each tensor's local sum goes to a communication
/// thread, which adds the processes' sums in buckets as the tensors become final —
/// while backward goes on — and hands back the average.
pub fn during_backward(
    mut models: Vec<&mut Network>,
    devs: &[&dyn Device],
    micro: &[Vec<MicroBatch>],
    how: &During,
    procs: Option<&Processes>,
) -> Result<Exchanged> {
    use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
    use std::sync::mpsc;
    let local = models.len();
    let world = procs.map_or(local, Processes::world);
    let scale = 1.0 / world as f32;
    let per_row = per_row(&models, micro, world, procs)?;
    let bucket = how.bucket.max(1);
    let n_params = models[0].parameter_tensors();
    // Where backward's hand-over groups end: a bucket that has not filled is summed
    // there rather than held until the next group's compute is done (the same groups,
    // so the same buckets, on every process).
    let mut group_ends = vec![false; n_params];
    for g in models[0].ready_groups() {
        if let Some(&p) = g.last() {
            group_ends[p] = true;
        }
    }
    let upload = how.upload;
    // How many times each tensor comes over from each rank.
    let rounds = if how.partitioned { micro[0].len() } else { 1 };
    let blocking = !how.overlap;
    let loss_scale = how.loss_scale;
    let started = std::time::Instant::now();
    let grads: Vec<Vec<Buffer>> = models
        .iter()
        .map(|m| (0..n_params).map(|i| m.gradient_buffer(i)).collect())
        .collect();
    let lens: Vec<usize> = (0..n_params).map(|i| models[0].parameter_len(i)).collect();
    let in_backward = AtomicUsize::new(local);
    // When the last device finished backward: exchange time after it is exposed.
    let backward_done = std::sync::Mutex::new(None::<std::time::Instant>);
    // Per rank, nanoseconds its recorder spent fetching (blocking only).
    let blocked: Vec<AtomicU64> = (0..local).map(|_| AtomicU64::new(0)).collect();
    type Bucket = Vec<(usize, Vec<f32>)>;
    // From a rank's downloader or recorder: (rank, tensors, during backward); from the
    // communication thread: (ACROSS, averaged tensors, during backward).
    let (to_reducer, from_ranks) = mpsc::channel::<Result<(usize, Bucket, bool)>>();
    const ACROSS: usize = usize::MAX;
    // slots[p][round · local + rank]: a copy waits there only until every copy before
    // it (rounds in order, ranks in order within a round) is in; next[p] is the next
    // copy to add into sums[p].
    let copies = rounds * local;
    let mut slots: Vec<Vec<Option<Vec<f32>>>> = vec![vec![None; copies]; n_params];
    let mut arrived = vec![vec![0usize; local]; n_params];
    let mut next = vec![0usize; n_params];
    let mut sums: Vec<Vec<f32>> = vec![vec![]; n_params];
    let mut inspected = vec![(false, 0f64); n_params];
    let (mut bytes, mut overlapped_bytes, mut total_bytes) = (0u64, 0u64, 0u64);
    let (cross_during, cross_total) = (AtomicU64::new(0), AtomicU64::new(0));
    let mut uploaded_bytes = 0u64;
    let (to_comm, for_comm) = mpsc::channel::<(usize, Vec<f32>)>();
    std::thread::scope(|s| -> Result<()> {
        if let Some(procs) = procs {
            // The communication thread: the processes' sums, in the order the tensors
            // become final (the same on every process: backward's order), bucketed.
            let (to_reducer, in_backward) = (to_reducer.clone(), &in_backward);
            let (cross_total, cross_during) = (&cross_total, &cross_during);
            let group_ends = &group_ends;
            s.spawn(move || {
                let (mut pending, mut elems, mut received) = (vec![], 0, 0);
                for (p, v) in for_comm {
                    received += 1;
                    elems += v.len();
                    pending.push((p, v));
                    if elems < bucket && received < n_params && !group_ends[p] {
                        continue;
                    }
                    let mut tensors: Vec<Vec<f32>> =
                        pending.iter_mut().map(|(_, v)| std::mem::take(v)).collect();
                    let ids: Vec<usize> = pending.iter().map(|(p, _)| *p).collect();
                    let summed = procs.sum_tensors(&ids, &mut tensors, bucket);
                    let during = in_backward.load(Ordering::SeqCst) > 0;
                    let msg = summed.map(|b| {
                        cross_total.fetch_add(b, Ordering::SeqCst);
                        if during {
                            cross_during.fetch_add(b, Ordering::SeqCst);
                        }
                        let out: Bucket = pending
                            .drain(..)
                            .zip(tensors)
                            .map(|((p, _), mut t)| {
                                scale_in_place(&mut t, scale);
                                (p, t)
                            })
                            .collect();
                        (ACROSS, out, during)
                    });
                    let failed = msg.is_err();
                    elems = 0;
                    if to_reducer.send(msg).is_err() || failed || received == n_params {
                        break;
                    }
                }
            });
        }
        for (r, m) in models.iter_mut().enumerate() {
            let dev = devs[r];
            let (to_downloader, ready) = mpsc::channel::<Vec<(usize, PendingDownload)>>();
            let to_reducer_dl = to_reducer.clone();
            let grads = &grads[r];
            let lens = &lens;
            let in_backward = &in_backward;
            let backward_done = &backward_done;
            // The downloader: fetches each ready set's staged copies, in buckets.
            s.spawn(move || {
                let mut failed = false;
                for staged in ready {
                    let mut out = vec![];
                    let mut elems = 0;
                    let n = staged.len();
                    for (k, (p, pending)) in staged.into_iter().enumerate() {
                        // After a failure every staged copy is still finished (and
                        // dropped), so none stays held on the device.
                        let fetched = dev.finish_download(pending);
                        if failed {
                            continue;
                        }
                        let g = match fetched {
                            Ok(g) => g.to_f32(),
                            Err(e) => {
                                failed = true;
                                let _ = to_reducer_dl.send(Err(e));
                                continue;
                            }
                        };
                        elems += lens[p];
                        out.push((p, g));
                        if elems >= bucket || k + 1 == n {
                            let during = in_backward.load(Ordering::SeqCst) > 0;
                            let _ = to_reducer_dl.send(Ok((r, std::mem::take(&mut out), during)));
                            elems = 0;
                        }
                    }
                }
            });
            // The recorder: this rank's forward and backward; as each set of
            // gradients is final, their copies to staging memory are queued right
            // behind it, ahead of the rest of backward.
            let micro = &micro[r];
            let model: &mut Network = m;
            let errors = to_reducer.clone();
            let to_reducer_direct = to_reducer.clone();
            let blocked = &blocked[r];
            s.spawn(move || {
                let result = model
                    .accumulate_with(
                        dev,
                        micro,
                        loss_scale,
                        per_row,
                        Some(&mut |params| {
                            if blocking {
                                // Compute first, so only the copies count as exchange.
                                dev.wait()?;
                                let t = std::time::Instant::now();
                                let mut out = vec![];
                                for &p in params {
                                    out.push((p, dev.download(grads[p])?.to_f32()));
                                }
                                blocked.fetch_add(t.elapsed().as_nanos() as u64, Ordering::SeqCst);
                                return to_reducer_direct.send(Ok((r, out, false))).map_err(|_| {
                                    Error::InvalidArgument("gradient reducer stopped".into())
                                });
                            }
                            let mut staged = vec![];
                            for &p in params {
                                match dev.begin_download(grads[p]) {
                                    Ok(pending) => staged.push((p, pending)),
                                    Err(e) => {
                                        // Release the copies already staged.
                                        for (_, pending) in staged {
                                            let _ = dev.finish_download(pending);
                                        }
                                        return Err(e);
                                    }
                                }
                            }
                            to_downloader.send(staged).map_err(|_| {
                                Error::InvalidArgument("gradient downloader stopped".into())
                            })
                        }),
                    )
                    .and_then(|()| dev.wait());
                if in_backward.fetch_sub(1, Ordering::SeqCst) == 1 {
                    *backward_done.lock().unwrap_or_else(|e| e.into_inner()) =
                        Some(std::time::Instant::now());
                }
                if let Err(e) = result {
                    let _ = errors.send(Err(e));
                }
            });
        }
        drop(to_reducer);
        // A tensor's average is final: its overflow flag and squared norm, and (stage 0)
        // its upload into every rank's gradient buffers.
        let mut finish = |p: usize, a: &[f32], inspected: &mut [(bool, f64)]| -> Result<()> {
            inspected[p] = inspect_owned(a, p, procs);
            if upload {
                for (rank, dev) in devs.iter().enumerate() {
                    let buf = grads[rank][p];
                    dev.upload(buf, &HostData::from_f32(buf.dtype, a))?;
                    uploaded_bytes += buf.bytes();
                }
            }
            Ok(())
        };
        let mut done = 0;
        while done < n_params {
            let (r, bucket, during) = match from_ranks.recv() {
                Ok(msg) => msg?,
                Err(_) => {
                    return Err(Error::InvalidArgument(
                        "a device stopped before handing over all its gradients".into(),
                    ))
                }
            };
            if r == ACROSS {
                for (p, avg) in bucket {
                    sums[p] = avg;
                    finish(p, &sums[p], &mut inspected)?;
                    done += 1;
                }
                continue;
            }
            for (p, g) in bucket {
                let b = grads[r][p].bytes();
                bytes += b;
                total_bytes += b;
                if during {
                    overlapped_bytes += b;
                }
                // A rank hands tensor p over once per round, in order.
                let round = arrived[p][r];
                if round >= rounds {
                    return Err(Error::InvalidArgument(format!(
                        "rank {r} handed over gradient {p} more than {rounds} times in a step"
                    )));
                }
                arrived[p][r] += 1;
                slots[p][round * local + r] = Some(g);
                // Each copy is added as soon as the copies before it are: the order of
                // `fold` over a round's copies, so the same bits, with no rank's copy
                // held while the others arrive unless an earlier rank lags.
                let before = next[p];
                while let Some(g) = slots[p].get_mut(next[p]).and_then(Option::take) {
                    next[p] += 1;
                    let last = next[p] == copies;
                    let average_here = (last && procs.is_none()).then_some(scale);
                    if sums[p].is_empty() {
                        sums[p] = g;
                        if let Some(scale) = average_here {
                            scale_in_place(&mut sums[p], scale);
                        }
                    } else {
                        fold(&mut sums[p], std::slice::from_ref(&g), average_here);
                    }
                }
                if before < copies && next[p] == copies {
                    if procs.is_some() {
                        to_comm
                            .send((p, std::mem::take(&mut sums[p])))
                            .map_err(|_| {
                                Error::InvalidArgument(
                                    "the communication thread stopped before every gradient \
                                 was summed across processes"
                                        .into(),
                                )
                            })?;
                        continue;
                    }
                    finish(p, &sums[p], &mut inspected)?;
                    done += 1;
                }
            }
        }
        drop(to_comm);
        Ok(())
    })?;
    bytes += uploaded_bytes;
    let (cross_during, cross_total) = (cross_during.into_inner(), cross_total.into_inner());
    bytes += cross_total;
    // Across processes, the overlap that matters is the processes' exchange.
    if procs.is_some() {
        (overlapped_bytes, total_bytes) = (cross_during, cross_total);
    }
    let mut local = combine(&inspected);
    if let Some(procs) = procs {
        local = procs.combine(local)?;
    }
    let (overflow, sum_squares) = local;
    let mut loss = 0.0;
    for (m, dev) in models.iter().zip(devs) {
        loss += m.accumulated_loss(*dev)? as f64;
    }
    // Comm time counts from the end of backward: what the overlap did not hide,
    // plus what a blocking recorder spent fetching (the slowest rank's).
    let started = backward_done
        .into_inner()
        .unwrap_or_else(|e| e.into_inner())
        .unwrap_or(started);
    let blocked_ms = blocked
        .iter()
        .map(|b| b.load(Ordering::SeqCst))
        .max()
        .unwrap_or(0) as f64
        / 1e6;
    let mut overlap = if total_bytes == 0 {
        0.0
    } else {
        overlapped_bytes as f64 / total_bytes as f64
    };
    let loss = match procs {
        None => (loss / world as f64) as f32,
        Some(procs) => {
            // One collective for the loss and every process's overlap. The job's
            // backward lasts until its slowest process is done, and a bucket is summed
            // at about the same moment everywhere, so the process that finished last
            // counted every bucket summed during the job's backward, and the others
            // fewer: the job's overlap is the largest. (A process that finished early
            // waits for the slow one's buckets: load imbalance, not exchange.)
            let mut v = vec![0.0; 1 + procs.devices.len()];
            v[0] = loss;
            v[1 + procs.rank()] = overlap;
            procs.comm.sum_f64(&mut v)?;
            overlap = v[1..].iter().copied().fold(0.0, f64::max);
            (v[0] / world as f64) as f32
        }
    };
    Ok(Exchanged {
        loss,
        avg: sums,
        overflow,
        sum_squares,
        bytes,
        started,
        blocked_ms,
        overlap,
        uploaded: upload,
        process_bytes: cross_total,
    })
}
