//! One pipeline step's run: a thread per stage running its 1F1B instructions
//! (`Run`), each with a courier thread that sends its transfers and, under ZeRO
//! stage 2, a downloader that sums the handed-over gradients; and the coordinator's
//! decision at the step's end (`decide`). What a step is told (`StepOptions`) and
//! what it reports (`StepReport`) are defined here and re-exported by `pipeline`.

use std::sync::mpsc::{channel, Receiver, Sender};
use std::sync::Arc;

use std::time::Instant;

use super::exchange::{combine, fold, inspect};
use super::pipeline_schedule::Instr;
use super::pipeline_stages::Stage;
use crate::device::optim::grad_scale_reference;
use crate::graph::Tensor;
use crate::models::random_key;
use crate::{Buffer, Device, Error, HostData, PendingDownload, Result};

/// How one step is taken: the caller's loss scaler and clipping decide these.
#[derive(Clone, Copy, Debug)]
pub struct StepOptions {
    /// The scale the loss is multiplied by before backward (1 in fp32).
    pub loss_scale: f32,
    /// Clip the unscaled gradients to this global L2 norm; 0: no clipping.
    pub clip: f32,
    /// The learning rate of this step.
    pub lr: f32,
}

/// What a step did.
#[derive(Clone, Debug, PartialEq)]
pub struct StepReport {
    /// Mean loss over the step's micro-batches (the last stage's).
    pub loss: f32,
    /// Some stage's gradients held an inf or NaN: no stage updated.
    pub overflow: bool,
    /// Squared L2 norm of the whole model's (scaled) gradients, each parameter once.
    pub sum_squares: f64,
    /// The factor the optimizer multiplied the gradients by (1 / (loss scale × clip
    /// factor)); 0 when the step was skipped.
    pub grad_scale: f32,
    /// Wall time of the step.
    pub seconds: f64,
    /// Per device (stage-major: stage `s` of replica `r` at `s * dp + r`): seconds it
    /// waited for a neighbour's activations or gradients (the measured bubble; the
    /// schedule's is `(p - 1) / (m + p - 1)` of the step).
    pub waited: Vec<f64>,
    /// Per device, as `waited`: the exposed transfer time, the part of its waits after
    /// the peer had posted the awaited message until it arrived (see the module doc).
    pub exposed: Vec<f64>,
    /// Bytes of activations and activation gradients sent between stages.
    pub bytes_moved: u64,
}

/// What one stage measured during a step.
#[derive(Clone, Copy, Debug, Default)]
pub(super) struct StageStats {
    pub(super) waited: f64,
    pub(super) exposed: f64,
    pub(super) sent: u64,
}

/// A message between neighbouring stages: micro-batch, (shape, data) per tensor, and
/// when the sender posted it (queued its copies behind the producing launch).
pub(super) type Transfer = (usize, Vec<(Vec<usize>, HostData)>, Instant);

/// What a stage reports at the end of its ticks.
pub(super) struct Report {
    pub(super) overflow: bool,
    pub(super) sum_squares: f64,
    /// (parameter index in the model, gradient) of every parameter other stages hold
    /// too; with replicas (dp > 1), of every parameter the stage holds, and the
    /// overflow flag and norm are the coordinator's.
    pub(super) grads: Vec<(usize, Vec<f32>)>,
    pub(super) loss: Option<f64>,
}

/// The pipeline's decision, sent to every stage.
pub(super) struct Decision {
    /// The gradient to write back of every parameter the stage reported.
    pub(super) grads: Vec<(usize, Arc<Vec<f32>>)>,
    /// The gradient factor, or `None`: no update on this stage's thread (skipped, or
    /// ZeRO's shards update after the threads).
    pub(super) grad_scale: Option<f32>,
}

/// The coordinator's decision: the gradient factor (`None`: skip), per model
/// parameter the gradient every copy takes (`None`: keep its own), and the report.
pub(super) type Decided = (Option<f32>, Vec<Option<Arc<Vec<f32>>>>, StepReport);

/// A stage's channels for one step.
pub(super) struct Links {
    pub(super) act_in: Option<Receiver<Transfer>>,
    pub(super) act_out: Option<Sender<Transfer>>,
    pub(super) grad_in: Option<Receiver<Transfer>>,
    pub(super) grad_out: Option<Sender<Transfer>>,
    pub(super) report: Sender<Report>,
    pub(super) decision: Receiver<Decision>,
}

/// What every stage thread of a step shares.
#[derive(Clone, Copy)]
pub(super) struct Run<'a> {
    pub(super) s: usize,
    /// The replica, and how many there are.
    pub(super) r: usize,
    pub(super) dp: usize,
    /// Micro-batches in the step.
    pub(super) m: usize,
    /// Per micro-batch: this stage's inputs and the rows trained on.
    pub(super) data: &'a [(Vec<HostData>, usize)],
    /// What each trained row's loss weighs (the last stage): `dp` / the trained rows of
    /// the whole global batch, as `exchange::per_row` has it.
    pub(super) per_row: f32,
    pub(super) o: StepOptions,
    pub(super) seed: u64,
    pub(super) steps: u32,
    pub(super) holders: &'a [Vec<usize>],
}

/// How errors name stage `s` of replica `r` (of `dp`).
pub(super) fn stage_name(s: usize, r: usize, dp: usize) -> String {
    if dp == 1 {
        format!("stage {s}")
    } else {
        format!("stage {s} of replica {r}")
    }
}

/// The error of a stage whose neighbour (or the coordinator) stopped.
fn peer_stopped(me: &str, peer: &str) -> Error {
    Error::InvalidArgument(format!(
        "stopped: {peer} stopped during the step (its own error says why), so {me} cannot \
         go on"
    ))
}

/// Checks a received message against what `s` expects: the micro-batch and each
/// tensor's shape.
fn check_transfer(
    s: usize,
    what: &str,
    (micro, tensors, _): &Transfer,
    want_micro: usize,
    want: &[(String, Vec<usize>)],
) -> Result<()> {
    let shapes: Vec<&Vec<usize>> = tensors.iter().map(|(shape, _)| shape).collect();
    let wanted: Vec<&Vec<usize>> = want.iter().map(|(_, shape)| shape).collect();
    if *micro != want_micro || shapes != wanted {
        let names: Vec<&str> = want.iter().map(|(n, _)| n.as_str()).collect();
        return Err(Error::InvalidArgument(format!(
            "stage {s} received {what} of micro-batch {micro} shaped {shapes:?}, but expected \
             micro-batch {want_micro}'s {names:?} shaped {wanted:?}: the stages were built for \
             different micro-batch shapes"
        )));
    }
    for ((shape, data), (name, _)) in tensors.iter().zip(want) {
        let len: usize = shape.iter().product();
        if data.len() != len {
            return Err(Error::InvalidArgument(format!(
                "stage {s} received `{name}` shaped {shape:?} holding {} values",
                data.len()
            )));
        }
    }
    Ok(())
}

/// Downloads queued on a stage's device for one neighbour: towards the next stage
/// (activations) or the one before (their gradients), of a micro-batch.
type Parcel = (bool, usize, Vec<(Vec<usize>, PendingDownload)>, Instant);

/// Gradient copies a stage queued during one backward (ZeRO stage 2's hand-over):
/// (`part.params` position, download) per parameter of a ready group.
type Staged = Vec<(usize, PendingDownload)>;

/// Per `part.params` entry: the host sum of its handed-over gradients, and how many
/// micro-batches it holds.
type Handed = Vec<(Vec<f32>, usize)>;

/// A ZeRO-2 stage's line to its downloader: the staged copies out, the sums back.
type Handing = (Sender<Staged>, Receiver<Result<Handed>>);

/// A ZeRO-2 stage's gradient downloader: waits for each staged copy in the order the
/// backwards queued them (micro-batches in order) and adds it to the parameter's sum
/// on the host, `old + new` in f32, as the stage's own buffers would have accumulated
/// it; the sums go to `done` once the stage stops handing over.
fn downloader(dev: &dyn Device, staged: Receiver<Staged>, n: usize, done: Sender<Result<Handed>>) {
    let mut sums: Handed = vec![(vec![], 0); n];
    let mut failed = None;
    for group in staged {
        for (k, pending) in group {
            // After a failure every staged copy is still finished, so none stays held.
            let got = dev.finish_download(pending);
            if failed.is_some() {
                continue;
            }
            match got {
                Ok(g) => {
                    let (sum, count) = &mut sums[k];
                    if *count == 0 {
                        *sum = g.to_f32();
                    } else {
                        sum.iter_mut().zip(g.to_f32()).for_each(|(a, b)| *a += b);
                    }
                    *count += 1;
                }
                Err(e) => failed = Some(e),
            }
        }
    }
    // The stage may have stopped meanwhile: it has its own error then.
    let _ = done.send(match failed {
        Some(e) => Err(e),
        None => Ok(sums),
    });
}

/// A stage's courier: waits for each queued download and sends it on, while the stage
/// thread records its next work (the transfer overlaps the next compute).
fn courier(
    (s, r, dp): (usize, usize, usize),
    dev: &dyn Device,
    parcels: Receiver<Parcel>,
    act_out: Option<Sender<Transfer>>,
    grad_out: Option<Sender<Transfer>>,
) -> Result<()> {
    for (forward, micro, pending, posted) in parcels {
        let tensors = pending
            .into_iter()
            .map(|(shape, p)| Ok((shape, dev.finish_download(p)?)))
            .collect::<Result<Vec<_>>>()?;
        let (tx, peer) = if forward {
            (act_out.as_ref(), s + 1)
        } else {
            (grad_out.as_ref(), s.wrapping_sub(1))
        };
        tx.expect("a stage sends only to the neighbours it has")
            .send((micro, tensors, posted))
            .map_err(|_| peer_stopped(&stage_name(s, r, dp), &stage_name(peer, r, dp)))?;
    }
    Ok(())
}

impl Run<'_> {
    /// Runs stage `s`: its instructions and its part of the step's end on this thread,
    /// the outgoing transfers on a courier thread.
    pub(super) fn stage(
        self,
        stage: &mut Stage,
        dev: &dyn Device,
        ticks: &[Vec<Instr>],
        end: &[Instr],
        mut links: Links,
    ) -> Result<StageStats> {
        let (act_out, grad_out) = (links.act_out.take(), links.grad_out.take());
        let (parcels, inbox) = channel::<Parcel>();
        std::thread::scope(|scope| {
            let (s, r, dp) = (self.s, self.r, self.dp);
            let sent = scope.spawn(move || courier((s, r, dp), dev, inbox, act_out, grad_out));
            let handing = stage.hand_over.is_some().then(|| {
                let (to_downloader, staged) = channel::<Staged>();
                let (done, sums) = channel::<Result<Handed>>();
                let n = stage.params.len();
                scope.spawn(move || downloader(dev, staged, n, done));
                (to_downloader, sums)
            });
            // Ends the courier's (and downloader's) loop when this returns, whichever way.
            let ran = self.run(stage, dev, (ticks, end), &links, (parcels, handing));
            let sent = sent.join().unwrap_or_else(|_| {
                Err(Error::InvalidArgument(format!(
                    "{}'s transfer thread panicked",
                    stage_name(s, r, dp)
                )))
            });
            match (ran, sent) {
                // A courier that failed is why the stage stopped: its error says why.
                (Err(e), Err(c)) if e.to_string().contains("stopped: ") => Err(c),
                (Err(e), _) => Err(e),
                (Ok(stats), sent) => sent.map(|()| stats),
            }
        })
    }

    fn run(
        self,
        stage: &mut Stage,
        dev: &dyn Device,
        (ticks, end): (&[Vec<Instr>], &[Instr]),
        links: &Links,
        (parcels, mut handing): (Sender<Parcel>, Option<Handing>),
    ) -> Result<StageStats> {
        let s = self.s;
        let me = stage_name(s, self.r, self.dp);
        let peer_name = |peer: usize| stage_name(peer, self.r, self.dp);
        let sent = std::cell::Cell::new(0u64);
        let (mut waited, mut exposed) = (0f64, 0f64);
        // Waits for a neighbour's message: all of the wait counts as waiting, the part
        // after the peer posted the message as exposed transfer.
        let mut receive = |rx: &Receiver<Transfer>, peer: usize| -> Result<Transfer> {
            let wait = Instant::now();
            let msg = rx.recv().map_err(|_| peer_stopped(&me, &peer_name(peer)))?;
            let got = Instant::now();
            waited += (got - wait).as_secs_f64();
            exposed += got.saturating_duration_since(wait.max(msg.2)).as_secs_f64();
            Ok(msg)
        };
        let post = |forward: bool, micro: usize, bufs: Vec<(Vec<usize>, Buffer)>| {
            let mut pending = vec![];
            for (shape, b) in bufs {
                sent.set(sent.get() + (b.len * b.dtype.size()) as u64);
                pending.push((shape, dev.begin_download(b)?));
            }
            parcels
                .send((forward, micro, pending, Instant::now()))
                .map_err(|_| peer_stopped(&me, &format!("{me}'s transfer thread")))
        };
        let slots = stage.slots.len().min(self.m);
        let g = &stage.part.graph;
        let described = |t: Tensor| (g.describe(t).0.to_string(), g.shape(t).to_vec());
        let ins: Vec<(String, Vec<usize>)> = stage
            .part
            .activations_in
            .iter()
            .map(|a| described(a.local))
            .collect();
        let grads_in: Vec<(String, Vec<usize>)> = stage
            .part
            .activations_out
            .iter()
            .filter_map(|a| a.grad.map(described))
            .collect();
        let has_loss = g.losses().is_some();
        for instr in ticks.iter().flatten() {
            match *instr {
                Instr::Load { micro } => {
                    let (data, _) = &self.data[micro];
                    let slot = &mut stage.slots[micro % slots];
                    for (&b, d) in slot.inputs.iter().zip(data) {
                        dev.upload(b, d)?;
                    }
                }
                Instr::RecvActivation { micro } => {
                    let rx = links.act_in.as_ref().expect("a later stage receives");
                    let msg = receive(rx, s - 1)?;
                    check_transfer(s, "activations", &msg, micro, &ins)?;
                    let slot = &stage.slots[micro % slots];
                    for (&b, (_, d)) in slot.acts_in.iter().zip(&msg.1) {
                        dev.upload(b, d)?;
                    }
                }
                Instr::Forward { micro, buffer } => {
                    let slot = &mut stage.slots[buffer % slots];
                    // Replica r's micro-batches are the data-parallel rank r's: keyed
                    // as a network at micro offset r · m keys them.
                    let key = random_key(self.seed, self.steps, self.r * self.m + micro);
                    slot.plan.set_random_state(key);
                    slot.plan.forward_only(dev)?;
                }
                Instr::SendActivation { micro } => {
                    let slot = &stage.slots[micro % slots];
                    let mut bufs = vec![];
                    for a in &stage.part.activations_out {
                        bufs.push((g.shape(a.local).to_vec(), stage.outgoing(slot, a.local)));
                    }
                    post(true, micro, bufs)?;
                }
                Instr::RecvGrad { micro } => {
                    let rx = links.grad_in.as_ref().expect("an earlier stage receives");
                    let msg = receive(rx, s + 1)?;
                    check_transfer(s, "activation gradients", &msg, micro, &grads_in)?;
                    let slot = &stage.slots[micro % slots];
                    for (&b, (_, d)) in slot.seeds.iter().flatten().zip(&msg.1) {
                        dev.upload(b, d)?;
                    }
                }
                Instr::Backward { micro, buffer } => {
                    let slot = &mut stage.slots[buffer % slots];
                    // The step's loss is the mean over the global batch's trained rows.
                    // Other stages start from the seeds.
                    let weight = if has_loss { self.per_row } else { 1.0 };
                    let scalars = (self.o.loss_scale, weight, micro);
                    match (&stage.hand_over, &handing) {
                        (Some(groups), Some((to_downloader, _))) => {
                            // Each group's copies are queued in-stream right behind its
                            // last gradient write, before the next block overwrites the
                            // shared buffers.
                            let params = &stage.params;
                            let mut ready = |group: &[usize]| -> Result<()> {
                                let mut staged = vec![];
                                for &k in group {
                                    match dev.begin_download(params[k].grad) {
                                        Ok(pending) => staged.push((k, pending)),
                                        Err(e) => {
                                            for (_, pending) in staged {
                                                let _ = dev.finish_download(pending);
                                            }
                                            return Err(e);
                                        }
                                    }
                                }
                                to_downloader.send(staged).map_err(|_| {
                                    peer_stopped(&me, &format!("{me}'s gradient downloader"))
                                })
                            };
                            slot.plan.backward_with(dev, scalars, groups, &mut ready)?;
                        }
                        _ => slot.plan.backward(dev, scalars)?,
                    }
                }
                Instr::SendGrad { micro } => {
                    let slot = &stage.slots[micro % slots];
                    let mut bufs = vec![];
                    for a in &stage.part.activations_in {
                        if a.grad.is_some() {
                            let b = slot
                                .plan
                                .input_gradient(a.local)
                                .expect("the plan copies out every input gradient");
                            bufs.push((g.shape(a.local).to_vec(), b));
                        }
                    }
                    post(false, micro, bufs)?;
                }
                Instr::ReduceTiedGrads | Instr::ReduceGrads | Instr::OptimizerStep => {
                    unreachable!("end instructions come after the ticks")
                }
            }
        }
        for instr in end {
            // The tied gradients are summed in the same round as the step's decision
            // (one exchange with the coordinator); a data-parallel exchange within a
            // stage has nothing to do with one replica.
            if *instr == Instr::OptimizerStep {
                let handed = match handing.take() {
                    Some((to_downloader, sums)) => {
                        drop(to_downloader);
                        let gone = || peer_stopped(&me, &format!("{me}'s gradient downloader"));
                        Some(sums.recv().map_err(|_| gone())??)
                    }
                    None => None,
                };
                self.finish(stage, dev, links, handed)?;
            }
        }
        Ok(StageStats {
            waited,
            exposed,
            sent: sent.get(),
        })
    }

    /// The step's end on this stage: report overflow, squared norm, replicated
    /// gradients (with replicas: every gradient; `handed`: those the backwards handed
    /// over, summed on the host) and loss; take the decision; write the summed
    /// gradients back; update.
    fn finish(
        &self,
        stage: &mut Stage,
        dev: &dyn Device,
        links: &Links,
        handed: Option<Handed>,
    ) -> Result<()> {
        let s = self.s;
        let has_loss = stage.part.graph.losses().is_some();
        let all = self.dp > 1;
        let plan = &mut stage.slots[0].plan;
        // With replicas the coordinator checks the averaged gradients instead.
        let (overflow, sum_squares) = if all {
            (false, 0.0)
        } else {
            plan.measure(dev)?;
            (plan.overflowed(dev)?, plan.sum_squares(dev)? as f64)
        };
        let loss = if has_loss {
            Some(plan.step_loss(dev)?)
        } else {
            None
        };
        let mut grads = vec![];
        match handed {
            Some(handed) => {
                for ((sum, count), &i) in handed.into_iter().zip(&stage.part.params) {
                    if count != self.m {
                        return Err(Error::InvalidArgument(format!(
                            "{}: parameter {i}'s gradients were handed over {count} times in \
                             a step of {} micro-batches",
                            stage_name(s, self.r, self.dp),
                            self.m
                        )));
                    }
                    grads.push((i, sum));
                }
            }
            None => {
                for (k, &i) in stage.part.params.iter().enumerate() {
                    if all || self.holders[i].len() > 1 {
                        grads.push((i, dev.download(stage.params[k].grad)?.to_f32()));
                    }
                }
            }
        }
        links
            .report
            .send(Report {
                overflow,
                sum_squares,
                grads,
                loss,
            })
            .map_err(|_| peer_stopped(&stage_name(s, self.r, self.dp), "the coordinator"))?;
        let decision = links
            .decision
            .recv()
            .map_err(|_| peer_stopped(&stage_name(s, self.r, self.dp), "another stage"))?;
        for (i, grad) in &decision.grads {
            let k = stage
                .part
                .params
                .iter()
                .position(|p| p == i)
                .expect("decisions carry the stage's own parameters");
            let b = stage.params[k].grad;
            dev.upload(b, &HostData::from_f32(b.dtype, grad))?;
        }
        if let Some(grad_scale) = decision.grad_scale {
            let plan = &mut stage.slots[0].plan;
            plan.apply(dev, self.o.lr, self.steps + 1, grad_scale)?;
        }
        dev.wait()
    }
}

/// The coordinator's part: every stage's report (in device order), one overflow flag,
/// one squared norm counting each parameter once, one gradient factor (`None`: skip),
/// and per parameter the gradient every copy takes.
///
/// One replica: the replicated parameters' gradients summed in stage order, the norm
/// the stages' (each copy's share replaced by the sum's). Several: within each
/// replica the copies summed in stage order, then every tensor folded over the
/// replicas in replica order and averaged (a stage's own tensors as soon as its
/// replicas have reported, while earlier stages are still in backward), and flag and
/// norm taken from the averages in model order, as a data-parallel group takes them.
pub(super) fn decide(
    reports: &[Receiver<Report>],
    holders: &[Vec<usize>],
    stage_params: &[Vec<usize>],
    dp: usize,
    o: StepOptions,
) -> Result<Decided> {
    let p = stage_params.len();
    let mut grads: Vec<Option<Arc<Vec<f32>>>> = vec![None; holders.len()];
    let mut inspected = vec![(false, 0f64); holders.len()];
    let average = |parts: &[Vec<f32>]| {
        let mut avg = vec![];
        fold(&mut avg, parts, Some(1.0 / dp as f32));
        (inspect(&avg), Some(Arc::new(avg)))
    };
    // 1F1B ends the last stage's backwards first and the first stage's last: with
    // replicas, a stage's own gradients are averaged as soon as all its replicas have
    // reported, while earlier stages still compute. Copies on several stages wait for
    // every holder (below).
    let mut got: Vec<Option<Report>> = (0..reports.len()).map(|_| None).collect();
    for s in (0..p).rev() {
        for r in 0..dp {
            let f = s * dp + r;
            got[f] = Some(reports[f].recv().map_err(|_| {
                Error::InvalidArgument(format!(
                    "{} stopped before the step's end",
                    stage_name(s, r, dp)
                ))
            })?);
        }
        if dp == 1 {
            continue;
        }
        for &i in stage_params[s].iter().filter(|&&i| holders[i].len() == 1) {
            let parts: Vec<Vec<f32>> = got[s * dp..(s + 1) * dp]
                .iter_mut()
                .map(|report| {
                    let report = report.as_mut().expect("received above");
                    let k = report.grads.iter().position(|(j, _)| *j == i);
                    report
                        .grads
                        .swap_remove(k.expect("every replica reports every gradient"))
                        .1
                })
                .collect();
            (inspected[i], grads[i]) = average(&parts);
        }
    }
    let mut got: Vec<Report> = got.into_iter().flatten().collect();
    // Per replica, per parameter: its copies' sum, in stage order.
    let mut summed: Vec<Vec<Option<Vec<f32>>>> = vec![vec![None; holders.len()]; dp];
    let mut sum_squares = 0f64;
    let mut overflow = false;
    for s in 0..p {
        for (r, acc) in summed.iter_mut().enumerate() {
            let report = &mut got[s * dp + r];
            overflow |= report.overflow;
            sum_squares += report.sum_squares;
            for (i, g) in std::mem::take(&mut report.grads) {
                if dp == 1 {
                    // Each copy's own share leaves the norm; the sum enters it once below.
                    sum_squares -= g.iter().map(|&x| (x as f64) * (x as f64)).sum::<f64>();
                }
                match &mut acc[i] {
                    Some(acc) => acc.iter_mut().zip(&g).for_each(|(a, b)| *a += b),
                    None => acc[i] = Some(g),
                }
            }
        }
    }
    if dp == 1 {
        for (i, acc) in summed.remove(0).into_iter().enumerate() {
            if let Some(acc) = acc {
                debug_assert!(holders[i].len() > 1);
                sum_squares += acc.iter().map(|&x| (x as f64) * (x as f64)).sum::<f64>();
                overflow |= acc.iter().any(|x| !x.is_finite());
                grads[i] = Some(Arc::new(acc));
            }
        }
    } else {
        // The copies on several stages, each replica's summed in stage order above.
        for i in (0..holders.len()).filter(|&i| holders[i].len() > 1) {
            let parts: Vec<Vec<f32>> = summed
                .iter_mut()
                .map(|r| r[i].take().expect("every replica reports every gradient"))
                .collect();
            (inspected[i], grads[i]) = average(&parts);
        }
        // In model order, whatever order the stages reported in: the same bits.
        (overflow, sum_squares) = combine(&inspected);
    }
    // Subtracting the copies' shares can leave rounding below zero.
    let sum_squares = if overflow {
        f64::NAN
    } else {
        sum_squares.max(0.0)
    };
    let grad_scale = (!overflow).then(|| grad_scale_reference(sum_squares, o.loss_scale, o.clip));
    // Each replica's loss as a data-parallel rank reports it (f32), averaged in f64.
    let losses: f64 = got
        .iter()
        .filter_map(|r| r.loss)
        .map(|l| l as f32 as f64)
        .sum();
    let loss = (losses / dp as f64) as f32;
    Ok((
        grad_scale,
        grads,
        StepReport {
            loss,
            overflow,
            sum_squares,
            grad_scale: grad_scale.unwrap_or(0.0),
            seconds: 0.0,
            waited: vec![],
            exposed: vec![],
            bytes_moved: 0,
        },
    ))
}
