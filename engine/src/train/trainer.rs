//! The training engine: a GPT built from a resolved [`TrainConfig`], stepped one
//! optimizer step at a time. It owns what DeepSpeed's engine owns — precision, loss
//! scaling, the learning-rate schedule, clipping, gradient accumulation — so that a
//! training loop is "get micro-batches, call `step`, log the stats".
//!
//! ```text
//! let mut engine = Trainer::new(dev, model_config, train_config, seq, seed)?;
//! let stats = engine.step(dev, &micro_batches)?;   // one optimizer step
//! ```

use serde::{Deserialize, Serialize};

use crate::config::{LossScaling, Precision as ConfigPrecision, TrainConfig};
use crate::device::optim::ParamBuffers;
use crate::models::gpt::{Attention, Gpt, GptConfig, GptTraining, ModelStateBytes, ParamState};
use crate::models::mlp::Precision;
use crate::parallel::zero::{segments, Segment};
use crate::train::loss_scaler::LossScaler;
use crate::{Buffer, DType, Device, Error, HostData, PendingDownload, Result};

/// What one optimizer step did.
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct StepStats {
    /// Mean loss over the step's micro-batches.
    pub loss: f32,
    /// The learning rate the step used (applied or not).
    pub lr: f32,
    /// The fp16 loss scale the step ran with (1 without fp16).
    pub loss_scale: f32,
    /// The gradients overflowed: nothing but the loss scaler changed.
    pub skipped: bool,
    /// Optimizer steps applied so far, this one included.
    pub applied: u64,
}

/// The engine's counters and scaler: with the parameters, everything a checkpoint must
/// hold to continue bit-identically.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct TrainerState {
    /// Steps attempted (applied + skipped): the data position follows this.
    pub steps: u64,
    /// Steps applied: the LR schedule and Adam's bias correction follow this.
    pub applied: u64,
    pub scaler: LossScaler,
}

/// What a data-parallel step spent exchanging gradients through the host.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize)]
pub struct CommStats {
    /// Exchange time the step paid: downloading, reducing and uploading gradients,
    /// counted from the end of the last device's backward (earlier work overlapped it).
    pub ms: f64,
    /// Bytes copied between devices and host (both directions, all devices).
    pub bytes: u64,
    /// Share of the exchanged bytes reduced while some device was still in backward.
    pub overlap: f64,
}

/// The gradients a step's exchange produced.
struct Exchanged {
    /// Mean loss over ranks.
    loss: f32,
    /// The average gradient per tensor.
    avg: Vec<Vec<f32>>,
    overflow: bool,
    sum_squares: f64,
    bytes: u64,
    /// When the exchange began (comm time is measured from here).
    started: std::time::Instant,
    /// Exchange time spent inside backward before `started` (stage 2 without overlap).
    blocked_ms: f64,
    overlap: f64,
    /// The average is already in every rank's gradient buffers.
    uploaded: bool,
}

/// Adds the ranks' copies of one tensor into `acc` in rank order (an empty `acc` starts
/// as the first copy), then multiplies by `scale` when given (the last round): so any
/// schedule gives the same bits. Split across threads when large.
fn fold(acc: &mut Vec<f32>, parts: &[Vec<f32>], scale: Option<f32>) {
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

/// The mean of the ranks' copies of one tensor.
fn average(parts: &[Vec<f32>]) -> Vec<f32> {
    let mut acc = vec![];
    fold(&mut acc, parts, Some(1.0 / parts.len() as f32));
    acc
}

/// A tensor's overflow flag and squared norm. Both exchange paths add the tensors'
/// squares in index order afterwards, so the norm has the same bits whatever order the
/// tensors arrived in.
fn inspect(avg: &[f32]) -> (bool, f64) {
    avg.iter().fold((false, 0.0), |(o, s), &a| {
        (o | !a.is_finite(), s + (a as f64) * (a as f64))
    })
}

/// The step's overflow flag and squared norm from the tensors', in index order.
fn combine(parts: &[(bool, f64)]) -> (bool, f64) {
    parts
        .iter()
        .fold((false, 0.0), |(o, s), &(a, b)| (o | a, s + b))
}

pub struct Trainer {
    /// Rank 0's model: the one checkpoints and evaluation read.
    pub model: Gpt,
    /// Ranks 1.. of a data-parallel group: identical replicas on their own devices.
    pub replicas: Vec<Gpt>,
    pub config: TrainConfig,
    steps: u64,
    /// The last data-parallel step's exchange.
    pub last_comm: CommStats,
    /// ZeRO stages 1 and 2: per rank, the optimizer-state segments it owns (empty at
    /// stage 0).
    shards: Vec<Vec<ShardSegment>>,
    /// ZeRO: per rank, the f32[1] gradient factor its shard's update reads.
    shard_scale: Vec<Buffer>,
    /// ZeRO stage 2: the replicas' blocks share one set of gradient buffers, each
    /// micro-batch's gradients are reduced during backward, and a rank keeps only its
    /// shard of the result (in its segments' gradient buffers).
    partitioned: bool,
}

/// One segment of a rank's ZeRO shard on its device: the f32 master, moments and
/// reduced gradient of that slice of one tensor, and the slice's updated model copy.
struct ShardSegment {
    seg: Segment,
    buffers: ParamBuffers,
}

impl Trainer {
    /// Builds the model for `config`'s micro-batch and precision; `seq` is the trained
    /// sequence length (at most the model's `block_size`), `seed` fixes the weights.
    pub fn new(
        dev: &dyn Device,
        model: GptConfig,
        config: TrainConfig,
        seq: usize,
        seed: u64,
    ) -> Result<Trainer> {
        Trainer::new_group(&[dev], model, config, seq, seed)
    }

    /// A data-parallel group: one identical replica per device (the same seed gives the
    /// same weights), `config` resolved for `devs.len()` ranks.
    pub fn new_group(
        devs: &[&dyn Device],
        model: GptConfig,
        config: TrainConfig,
        seq: usize,
        seed: u64,
    ) -> Result<Trainer> {
        if devs.is_empty() || config.batch.world != devs.len() {
            return Err(Error::InvalidArgument(format!(
                "the config was resolved for {} data-parallel ranks but {} devices were given; \
                 resolve it with the number of devices",
                config.batch.world,
                devs.len()
            )));
        }
        if config.zero.stage > 2 {
            return Err(Error::Unsupported {
                device: devs[0].caps().name.clone(),
                what: format!(
                    "zero_optimization.stage {}: parameter partitioning (stage 3) is not \
                     implemented; stage 2 shards gradients and optimizer state",
                    config.zero.stage
                ),
            });
        }
        let (precision, scaler) = match &config.precision {
            ConfigPrecision::Fp32 => (Precision::F32, LossScaler::fixed(1.0)?),
            ConfigPrecision::Bf16 => (Precision::BF16, LossScaler::fixed(1.0)?),
            ConfigPrecision::Fp16 { loss_scaling, .. } => (
                Precision::F16,
                match loss_scaling {
                    LossScaling::Dynamic(d) => LossScaler::dynamic(d.clone())?,
                    LossScaling::Static(s) => LossScaler::fixed(*s)?,
                },
            ),
        };
        let training = GptTraining {
            batch: config.batch.micro_batch,
            seq,
            precision,
            optimizer: config.optimizer.clone(),
            seed,
            attention: Attention::best(model.n_embd / model.n_head.max(1), precision, seq),
        };
        let mut models = devs
            .iter()
            .map(|&dev| {
                let mut m = Gpt::new(dev, model.clone(), training.clone())?;
                m.scaler = scaler.clone();
                Ok(m)
            })
            .collect::<Result<Vec<_>>>()?;
        let (mut shards, mut shard_scale) = (vec![], vec![]);
        // On one device the single shard is the whole state: stage 0's layout.
        let partitioned = config.zero.stage == 2 && devs.len() > 1;
        if config.zero.stage >= 1 && devs.len() > 1 {
            let layout = models[0].parameter_layout();
            let sizes: Vec<usize> = layout.iter().map(|l| l.1.iter().product()).collect();
            for (rank, (m, &dev)) in models.iter_mut().zip(devs).enumerate() {
                // Every replica starts from the same weights: each keeps its slice.
                let masters = m.release_optimizer_state(dev)?;
                let mut segs = vec![];
                for seg in segments(&sizes, devs.len(), rank) {
                    let init = &masters[seg.param][seg.range.clone()];
                    let buffers = ParamBuffers::new(dev, init, layout[seg.param].2, DType::F32)?;
                    segs.push(ShardSegment { seg, buffers });
                }
                shards.push(segs);
                shard_scale.push(dev.alloc(DType::F32, 1)?);
                if partitioned {
                    m.share_block_gradients(dev)?;
                }
            }
        }
        let model = models.remove(0);
        Ok(Trainer {
            model,
            replicas: models,
            config,
            steps: 0,
            last_comm: CommStats::default(),
            shards,
            shard_scale,
            partitioned,
        })
    }

    /// Devices in the group.
    pub fn world(&self) -> usize {
        1 + self.replicas.len()
    }

    /// One optimizer step over `gradient_accumulation_steps` micro-batches, each
    /// (tokens, next-token targets) of micro_batch × seq ids.
    pub fn step(&mut self, dev: &dyn Device, micro: &[(&[u32], &[u32])]) -> Result<StepStats> {
        if self.world() > 1 {
            return Err(Error::InvalidArgument(format!(
                "this engine drives {} devices: step it with step_group",
                self.world()
            )));
        }
        let want = self.config.batch.grad_accum;
        if micro.len() != want {
            return Err(Error::InvalidArgument(format!(
                "a step takes gradient_accumulation_steps = {want} micro-batches, got {}",
                micro.len()
            )));
        }
        let applied = self.model.steps_applied() as u64;
        let lr = self.config.schedule.lr_at(applied);
        let s = self
            .model
            .step(dev, micro, lr, self.config.gradient_clipping)?;
        self.steps += 1;
        Ok(StepStats {
            loss: s.loss,
            lr,
            loss_scale: s.scale,
            skipped: s.skipped,
            applied: self.model.steps_applied() as u64,
        })
    }

    /// One data-parallel optimizer step: `micro[r]` are rank r's micro-batches. Each
    /// device runs forward and backward on its shard; the gradients are averaged on the
    /// host in f32 (rank order, so the sum is deterministic) and the overflow check, the
    /// global norm and the loss scaler run once on the result, so every rank takes the
    /// same decision and applies the same update. One device: [`Trainer::step`].
    pub fn step_group(
        &mut self,
        devs: &[&dyn Device],
        micro: &[Vec<(&[u32], &[u32])>],
    ) -> Result<StepStats> {
        let world = self.world();
        if devs.len() != world || micro.len() != world {
            return Err(Error::InvalidArgument(format!(
                "a step of this {world}-device group takes {world} devices and {world} \
                 micro-batch lists, got {} and {}",
                devs.len(),
                micro.len()
            )));
        }
        if world == 1 {
            return self.step(devs[0], &micro[0]);
        }
        let want = self.config.batch.grad_accum;
        if let Some(m) = micro.iter().find(|m| m.len() != want) {
            return Err(Error::InvalidArgument(format!(
                "a step takes gradient_accumulation_steps = {want} micro-batches per rank, got {}",
                m.len()
            )));
        }
        let applied = self.model.steps_applied() as u64;
        let lr = self.config.schedule.lr_at(applied);
        let loss_scale = self.model.scaler.scale();
        let clip = self.config.gradient_clipping;
        let overlapped = self.config.zero.overlap_comm;
        let ex = if overlapped || self.partitioned {
            self.exchange_during_backward(devs, micro)?
        } else {
            self.exchange(devs, micro)?
        };
        let (loss, sum, overflow, sum_squares) = (ex.loss, ex.avg, ex.overflow, ex.sum_squares);
        let (t0, mut bytes) = (ex.started, ex.bytes);
        let decision = self.model.scaler.update(overflow)?;
        let scaler = self.model.scaler.clone();
        for r in &mut self.replicas {
            r.scaler = scaler.clone();
        }
        self.steps += 1;
        if decision == crate::StepDecision::Skip {
            self.last_comm = CommStats {
                ms: t0.elapsed().as_secs_f64() * 1e3 + ex.blocked_ms,
                bytes,
                overlap: ex.overlap,
            };
            return Ok(StepStats {
                loss,
                lr,
                loss_scale,
                skipped: true,
                applied,
            });
        }
        let grad_scale = crate::device::optim::grad_scale_reference(
            if clip > 0.0 { sum_squares } else { 0.0 },
            loss_scale,
            clip,
        );
        if self.shards.is_empty() {
            for (m, dev) in std::iter::once(&mut self.model)
                .chain(self.replicas.iter_mut())
                .zip(devs)
            {
                if !ex.uploaded {
                    m.set_gradients(*dev, &sum)?;
                    bytes += m.gradient_bytes();
                }
                m.apply(*dev, lr, grad_scale)?;
            }
        } else {
            bytes += self.apply_shards(devs, &sum, lr, grad_scale, applied + 1)?;
        }
        self.last_comm = CommStats {
            ms: t0.elapsed().as_secs_f64() * 1e3 + ex.blocked_ms,
            bytes,
            overlap: ex.overlap,
        };
        Ok(StepStats {
            loss,
            lr,
            loss_scale,
            skipped: false,
            applied: applied + 1,
        })
    }

    /// The exchange after backward (`overlap_comm` off): every device finishes, then
    /// each one's gradients come down and the average is formed.
    fn exchange(
        &mut self,
        devs: &[&dyn Device],
        micro: &[Vec<(&[u32], &[u32])>],
    ) -> Result<Exchanged> {
        let world = self.world();
        // Every device computes at once: accumulate submits without waiting.
        for (r, (m, dev)) in std::iter::once(&mut self.model)
            .chain(self.replicas.iter_mut())
            .zip(devs)
            .enumerate()
        {
            m.accumulate(*dev, &micro[r])?;
        }
        // The exchange is timed from when every device has finished its backward.
        for dev in devs {
            dev.wait()?;
        }
        let started = std::time::Instant::now();
        let mut loss = 0.0;
        let mut per_rank = vec![];
        let mut bytes = 0u64;
        for (m, dev) in self.models().zip(devs) {
            loss += m.accumulated_loss(*dev)? as f64;
            per_rank.push(m.gradient_values(*dev)?);
            bytes += m.gradient_bytes();
        }
        let avg: Vec<Vec<f32>> = (0..per_rank[0].len())
            .map(|p| {
                let parts: Vec<Vec<f32>> = per_rank
                    .iter_mut()
                    .map(|g| std::mem::take(&mut g[p]))
                    .collect();
                average(&parts)
            })
            .collect();
        let (overflow, sum_squares) = combine(&avg.iter().map(|a| inspect(a)).collect::<Vec<_>>());
        Ok(Exchanged {
            loss: (loss / world as f64) as f32,
            avg,
            overflow,
            sum_squares,
            bytes,
            started,
            blocked_ms: 0.0,
            overlap: 0.0,
            uploaded: false,
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
    fn exchange_during_backward(
        &mut self,
        devs: &[&dyn Device],
        micro: &[Vec<(&[u32], &[u32])>],
    ) -> Result<Exchanged> {
        use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
        use std::sync::mpsc;
        let world = self.world();
        let want = self.config.batch.grad_accum;
        let bucket = self.config.zero.reduce_bucket_size.max(1) as usize;
        let n_params = self.model.parameter_tensors();
        let upload = self.shards.is_empty();
        // How many times each tensor comes over from each rank.
        let rounds = if self.partitioned { want } else { 1 };
        let blocking = !self.config.zero.overlap_comm;
        let started = std::time::Instant::now();
        let grads: Vec<Vec<Buffer>> = self
            .models()
            .map(|m| (0..n_params).map(|i| m.gradient_buffer(i)).collect())
            .collect();
        let lens: Vec<usize> = (0..n_params).map(|i| self.model.parameter_len(i)).collect();
        let in_backward = AtomicUsize::new(world);
        // When the last device finished backward: exchange time after it is exposed.
        let backward_done = std::sync::Mutex::new(None::<std::time::Instant>);
        // Per rank, nanoseconds its recorder spent fetching (blocking only).
        let blocked: Vec<AtomicU64> = (0..world).map(|_| AtomicU64::new(0)).collect();
        type Bucket = Vec<(usize, Vec<f32>)>;
        let (to_reducer, from_ranks) = mpsc::channel::<Result<(usize, Bucket, bool)>>();
        let mut models: Vec<&mut Gpt> = std::iter::once(&mut self.model)
            .chain(self.replicas.iter_mut())
            .collect();
        // slots[p][round][rank]; a round is folded into sums[p] once complete.
        let mut slots: Vec<Vec<Vec<Option<Vec<f32>>>>> =
            vec![vec![vec![None; world]; rounds]; n_params];
        let mut arrived = vec![vec![0usize; world]; n_params];
        let mut folded = vec![0usize; n_params];
        let mut sums: Vec<Vec<f32>> = vec![vec![]; n_params];
        let mut inspected = vec![(false, 0f64); n_params];
        let (mut bytes, mut overlapped_bytes, mut total_bytes) = (0u64, 0u64, 0u64);
        std::thread::scope(|s| -> Result<()> {
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
                                let _ =
                                    to_reducer_dl.send(Ok((r, std::mem::take(&mut out), during)));
                                elems = 0;
                            }
                        }
                    }
                });
                // The recorder: this rank's forward and backward; as each set of
                // gradients is final, their copies to staging memory are queued right
                // behind it, ahead of the rest of backward.
                let micro = &micro[r];
                let model: &mut Gpt = m;
                let errors = to_reducer.clone();
                let to_reducer_direct = to_reducer.clone();
                let blocked = &blocked[r];
                s.spawn(move || {
                    let result = model
                        .accumulate_with(dev, micro, &mut |params| {
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
                        })
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
                    slots[p][round][r] = Some(g);
                    while folded[p] < rounds && slots[p][folded[p]].iter().all(Option::is_some) {
                        let parts: Vec<Vec<f32>> = slots[p][folded[p]]
                            .iter_mut()
                            .map(|x| x.take().unwrap_or_default())
                            .collect();
                        folded[p] += 1;
                        let last = folded[p] == rounds;
                        fold(&mut sums[p], &parts, last.then_some(1.0 / world as f32));
                        if !last {
                            continue;
                        }
                        let a = &sums[p];
                        inspected[p] = inspect(a);
                        if upload {
                            for (rank, dev) in devs.iter().enumerate() {
                                let buf = grads[rank][p];
                                dev.upload(buf, &HostData::from_f32(buf.dtype, a))?;
                                bytes += buf.bytes();
                            }
                        }
                        done += 1;
                    }
                }
            }
            Ok(())
        })?;
        let (overflow, sum_squares) = combine(&inspected);
        let mut loss = 0.0;
        for (m, dev) in self.models().zip(devs) {
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
        Ok(Exchanged {
            loss: (loss / world as f64) as f32,
            avg: sums,
            overflow,
            sum_squares,
            bytes,
            started,
            blocked_ms,
            overlap: if total_bytes == 0 {
                0.0
            } else {
                overlapped_bytes as f64 / total_bytes as f64
            },
            uploaded: upload,
        })
    }

    /// ZeRO stage 1: each rank updates its own segments from the reduced gradients
    /// (a reduce-scatter: it receives only its slice), then the updated slices are
    /// gathered on the host and every rank receives the whole new model copy (the
    /// all-gather). Returns the bytes moved.
    fn apply_shards(
        &mut self,
        devs: &[&dyn Device],
        sum: &[Vec<f32>],
        lr: f32,
        grad_scale: f32,
        step: u64,
    ) -> Result<u64> {
        let step = u32::try_from(step).map_err(|_| {
            Error::InvalidArgument("more optimizer steps than the engine counts".into())
        })?;
        let layout = self.model.parameter_layout();
        let optimizer = self.config.optimizer.clone();
        let mut bytes = 0;
        for ((segs, &scale), dev) in self.shards.iter().zip(&self.shard_scale).zip(devs) {
            dev.upload(scale, &HostData::F32(vec![grad_scale]))?;
            for s in segs {
                let g = HostData::F32(sum[s.seg.param][s.seg.range.clone()].to_vec());
                bytes += g.as_bytes().len() as u64;
                dev.upload(s.buffers.grad, &g)?;
                let decay = if layout[s.seg.param].3 {
                    optimizer.weight_decay()
                } else {
                    0.0
                };
                dev.launch(&s.buffers.step(&optimizer, scale, lr, decay, step))?;
            }
            dev.submit()?;
        }
        // All-gather: each tensor's slices, in rank order, make the whole tensor.
        let mut parts: Vec<Vec<u8>> = vec![vec![]; layout.len()];
        for (segs, dev) in self.shards.iter().zip(devs) {
            for s in segs {
                let v = dev.download(s.buffers.value)?;
                bytes += v.as_bytes().len() as u64;
                parts[s.seg.param].extend_from_slice(v.as_bytes());
            }
        }
        for (i, (_, shape, dtype, _)) in layout.iter().enumerate() {
            let n: usize = shape.iter().product();
            let whole = HostData::from_bytes(*dtype, n, &parts[i]);
            for (m, dev) in self.models().zip(devs) {
                m.set_value(*dev, i, &whole)?;
                bytes += whole.as_bytes().len() as u64;
            }
        }
        for m in std::iter::once(&mut self.model).chain(self.replicas.iter_mut()) {
            m.set_steps_applied(step);
        }
        Ok(bytes)
    }

    /// Every parameter's full training state (gathered from the ZeRO shards when the
    /// optimizer state is partitioned): what a checkpoint holds, whatever the group.
    pub fn param_states(&self, devs: &[&dyn Device]) -> Result<Vec<ParamState>> {
        self.check_devices(devs)?;
        let mut states = self.model.param_states(devs[0])?;
        if self.shards.is_empty() {
            return Ok(states);
        }
        for st in &mut states {
            let n: usize = st.shape.iter().product();
            st.master = vec![0.0; n];
            st.m = vec![0.0; n];
            st.v = vec![0.0; n];
        }
        for (segs, dev) in self.shards.iter().zip(devs) {
            for s in segs {
                let st = &mut states[s.seg.param];
                let r = s.seg.range.clone();
                st.master[r.clone()].copy_from_slice(&dev.download(s.buffers.master)?.to_f32());
                st.m[r.clone()].copy_from_slice(&dev.download(s.buffers.m)?.to_f32());
                st.v[r].copy_from_slice(&dev.download(s.buffers.v)?.to_f32());
            }
        }
        Ok(states)
    }

    /// Restores what [`Trainer::param_states`] gave, into every rank (each ZeRO rank
    /// taking its slices): a checkpoint resumes on any number of devices.
    pub fn load_param_states(&self, devs: &[&dyn Device], states: &[ParamState]) -> Result<()> {
        if self.shards.is_empty() {
            for (m, dev) in self.models().zip(devs) {
                m.load_param_states(*dev, states)?;
            }
            return Ok(());
        }
        let layout = self.model.parameter_layout();
        if states.len() != layout.len() {
            return Err(Error::InvalidArgument(format!(
                "the checkpoint holds {} parameters but this model has {}",
                states.len(),
                layout.len()
            )));
        }
        // Whole-model checks (names, shapes, dtypes) are the unsharded loader's; the
        // states must be listed in model order here.
        self.check_devices(devs)?;
        for (st, (name, shape, dtype, _)) in states.iter().zip(&layout) {
            let n: usize = shape.iter().product();
            for (what, len) in [
                ("value", st.value.len()),
                ("master", st.master.len()),
                ("exp_avg", st.m.len()),
                ("exp_avg_sq", st.v.len()),
            ] {
                if len != n {
                    return Err(Error::LenMismatch {
                        what: format!("checkpoint {what} of `{name}`"),
                        expected: n,
                        found: len,
                    });
                }
            }
            if &st.name != name || &st.shape != shape || st.value.dtype() != *dtype {
                return Err(Error::InvalidArgument(format!(
                    "checkpoint parameter `{}` {:?} {} does not match this model's `{name}` \
                     {shape:?} {dtype}: resume with the model and precision it was saved with",
                    st.name,
                    st.shape,
                    st.value.dtype()
                )));
            }
        }
        for (m, dev) in self.models().zip(devs) {
            for (i, st) in states.iter().enumerate() {
                m.set_value(*dev, i, &st.value)?;
            }
        }
        for (segs, dev) in self.shards.iter().zip(devs) {
            for s in segs {
                let st = &states[s.seg.param];
                let r = s.seg.range.clone();
                dev.upload(
                    s.buffers.master,
                    &HostData::F32(st.master[r.clone()].to_vec()),
                )?;
                dev.upload(s.buffers.m, &HostData::F32(st.m[r.clone()].to_vec()))?;
                dev.upload(s.buffers.v, &HostData::F32(st.v[r].to_vec()))?;
            }
        }
        Ok(())
    }

    /// Rank `rank`'s model states on its device as allocated: its replica's model
    /// copy and gradients, and its optimizer state (whole, or its ZeRO slices: master,
    /// moments, reduced gradient, updated model copy and the step's gradient factor).
    pub fn model_state_bytes(&self, rank: usize) -> ModelStateBytes {
        let Some(m) = self.models().nth(rank) else {
            return ModelStateBytes::default();
        };
        let mut bytes = m.model_state_bytes();
        if let Some(segs) = self.shards.get(rank) {
            for s in segs {
                let b = &s.buffers;
                bytes.gradients += b.grad.bytes();
                bytes.optimizer += b.master.bytes() + b.m.bytes() + b.v.bytes() + b.value.bytes();
            }
            bytes.optimizer += self.shard_scale[rank].bytes();
        }
        bytes
    }

    /// Elements of the optimizer state rank `rank` holds (master + moments count once).
    pub fn optimizer_state_elements(&self, rank: usize) -> usize {
        match self.shards.get(rank) {
            Some(segs) => segs.iter().map(|s| s.seg.range.len()).sum(),
            None => self
                .model
                .parameter_layout()
                .iter()
                .map(|l| l.1.iter().product::<usize>())
                .sum(),
        }
    }

    fn check_devices(&self, devs: &[&dyn Device]) -> Result<()> {
        if devs.len() != self.world() {
            return Err(Error::InvalidArgument(format!(
                "this group has {} devices but {} were given",
                self.world(),
                devs.len()
            )));
        }
        Ok(())
    }

    /// Every rank's model, rank 0 first.
    pub fn models(&self) -> impl Iterator<Item = &Gpt> {
        std::iter::once(&self.model).chain(&self.replicas)
    }

    pub fn state(&self) -> TrainerState {
        TrainerState {
            steps: self.steps,
            applied: self.model.steps_applied() as u64,
            scaler: self.model.scaler.clone(),
        }
    }

    /// Restores counters and scaler saved by [`Trainer::state`] (the parameters are
    /// restored separately, see [`Gpt::load_param_states`]).
    pub fn restore(&mut self, state: &TrainerState) -> Result<()> {
        let applied = u32::try_from(state.applied).map_err(|_| {
            Error::InvalidArgument(format!(
                "checkpoint: {} applied steps is more than this engine counts",
                state.applied
            ))
        })?;
        if state.applied > state.steps {
            return Err(Error::InvalidArgument(format!(
                "checkpoint: {} applied steps out of {} attempted is impossible: the checkpoint \
                 state is corrupt",
                state.applied, state.steps
            )));
        }
        if std::mem::discriminant(&state.scaler) != std::mem::discriminant(&self.model.scaler) {
            return Err(Error::InvalidArgument(
                "checkpoint: its loss scaler (static vs dynamic) differs from this config's \
                 fp16 settings; resume with the config the run was started with"
                    .into(),
            ));
        }
        self.steps = state.steps;
        for m in std::iter::once(&mut self.model).chain(self.replicas.iter_mut()) {
            m.set_steps_applied(applied);
            m.scaler = state.scaler.clone();
        }
        Ok(())
    }
}
