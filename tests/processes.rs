//! Data parallelism and ZeRO across processes, with threads standing in for the
//! processes (`ThreadProcesses`: the same trainer code the MPI transport drives, one
//! trainer per "process" on its own devices). A job whose processes drive one device
//! each adds the same numbers in the same order as one process driving them all, so
//! the training is bit-identical; a process started differently is refused; a process
//! that never reaches a step is named within the timeout; a checkpoint written by a
//! multi-process ZeRO job resumes in one process with the same losses.

mod common;

use std::sync::Arc;
use std::time::Duration;

use common::*;
use kiln::engine::config::parse;
use kiln::engine::models::gpt::{Gpt, GptConfig};
use kiln::engine::models::{MicroBatch, ParamState};
use kiln::engine::parallel::collective::{Processes, ThreadProcesses};
use kiln::engine::train::checkpoint;
use kiln::engine::train::trainer::Trainer;
use kiln::engine::{Device, TrainConfig};

const STEPS: usize = 8;
const B: usize = 2;
const T: usize = 8;

fn gpt() -> Arc<Gpt> {
    Arc::new(Gpt::new(
        GptConfig {
            n_layer: 2,
            n_head: 2,
            n_embd: 32,
            block_size: T,
            vocab_size: 13,
            padded_vocab_size: None,
        },
        T,
    ))
}

fn config(precision: &str, world: usize, stage: u8, overlap: bool) -> TrainConfig {
    parse(
        &format!(
            r#"{{"train_micro_batch_size_per_gpu": {B}, "gradient_accumulation_steps": 1,
                "gradient_clipping": 0.5, {precision}
                "zero_optimization": {{"stage": {stage}, "overlap_comm": {overlap},
                                       "reduce_bucket_size": 3000}},
                "optimizer": {{"type": "AdamW", "params": {{"lr": 0.01, "weight_decay": 0.1}}}},
                "scheduler": {{"type": "WarmupLR", "params": {{"warmup_num_steps": 3, "warmup_max_lr": 0.01}}}}}}"#
        ),
        world,
    )
    .unwrap()
}

/// Per step, one micro-batch per global rank: counting mod 13 from random starts.
fn batches(world: usize, steps: usize) -> Vec<Vec<MicroBatch>> {
    let mut rng = Rng::new(11);
    (0..steps)
        .map(|_| {
            (0..world)
                .map(|_| {
                    let (mut tok, mut tgt) = (vec![], vec![]);
                    for _ in 0..B {
                        let start = rng.next_u32() % 13;
                        tok.extend((0..T as u32).map(|i| (start + i) % 13));
                        tgt.extend((1..=T as u32).map(|i| (start + i) % 13));
                    }
                    MicroBatch::tokens(&tok, &tgt)
                })
                .collect()
        })
        .collect()
}

/// Losses per step and the final training state (weights, masters, moments).
type Run = (Vec<f32>, Vec<ParamState>);

/// One process driving `world` devices.
fn one_process(c: TrainConfig, world: usize) -> Run {
    let devs: Vec<Box<dyn Device>> = (0..world).map(|_| gpu("vulkan", false)).collect();
    let refs: Vec<&dyn Device> = devs.iter().map(|d| d.as_ref()).collect();
    let mut t = Trainer::new_group(&refs, gpt(), c, 3).unwrap();
    let mut losses = vec![];
    for step in batches(world, STEPS) {
        let per_rank: Vec<Vec<MicroBatch>> = step.into_iter().map(|m| vec![m]).collect();
        losses.push(t.step_group(&refs, &per_rank).unwrap().loss);
    }
    (losses, t.param_states(&refs).unwrap())
}

/// One thread per process, process p driving `layout[p]` devices and seeded with
/// `seed(p)`; what each process saw.
fn processes(
    layout: &[usize],
    config: impl Fn(usize) -> TrainConfig + Sync,
    seed: impl Fn(usize) -> u64 + Sync,
) -> Vec<Result<Run, String>> {
    processes_and_bytes(layout, config, seed)
        .into_iter()
        .map(|r| r.map(|(run, _)| run))
        .collect()
}

/// [`processes`], with the bytes each process exchanged with the others in its last step.
fn processes_and_bytes(
    layout: &[usize],
    config: impl Fn(usize) -> TrainConfig + Sync,
    seed: impl Fn(usize) -> u64 + Sync,
) -> Vec<Result<(Run, u64), String>> {
    let world: usize = layout.iter().sum();
    let comms = ThreadProcesses::group(layout.len(), Duration::from_secs(120));
    std::thread::scope(|s| {
        let handles: Vec<_> = comms
            .into_iter()
            .enumerate()
            .map(|(p, comm)| {
                let (config, seed) = (&config, &seed);
                s.spawn(move || -> Result<(Run, u64), String> {
                    let devs: Vec<Box<dyn Device>> =
                        (0..layout[p]).map(|_| gpu("vulkan", false)).collect();
                    let refs: Vec<&dyn Device> = devs.iter().map(|d| d.as_ref()).collect();
                    let procs = Processes::new(comm, refs.len()).map_err(|e| e.to_string())?;
                    let first = procs.first_rank();
                    let mut t =
                        Trainer::new_processes(&refs, gpt(), config(world), seed(p), Some(procs))
                            .map_err(|e| e.to_string())?;
                    let mut losses = vec![];
                    for step in batches(world, STEPS) {
                        let mine: Vec<Vec<MicroBatch>> = step[first..first + layout[p]]
                            .iter()
                            .map(|m| vec![m.clone()])
                            .collect();
                        let s = t.step_group(&refs, &mine).map_err(|e| e.to_string())?;
                        losses.push(s.loss);
                    }
                    let states = t.param_states(&refs).map_err(|e| e.to_string())?;
                    Ok(((losses, states), t.last_comm.process_bytes))
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

fn assert_same(what: &str, got: &[Result<Run, String>], want: &Run) {
    for (p, r) in got.iter().enumerate() {
        let (losses, states) = r
            .as_ref()
            .unwrap_or_else(|e| panic!("{what}: process {p}: {e}"));
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(losses), bits(&want.0), "{what}: process {p} losses");
        assert!(
            states == &want.1,
            "{what}: process {p}: weights, masters or moments differ"
        );
    }
    eprintln!("{what}: losses {:?} .. {:?}", want.0[0], want.0[STEPS - 1]);
    assert!(want.0[STEPS - 1] < want.0[0], "{what}: did not learn");
}

const FP16: &str = r#""fp16": {"enabled": true, "initial_scale_power": 10},"#;

#[test]
fn processes_of_one_device_each_train_bit_identically_to_one_process() {
    // Stage 0, the exchange after backward and during it; fp32 and fp16.
    for (precision, overlap) in [("", false), ("", true), (FP16, true)] {
        let want = one_process(config(precision, 2, 0, overlap), 2);
        let got = processes(&[1, 1], |w| config(precision, w, 0, overlap), |_| 3);
        assert_same(
            &format!("2 × 1, stage 0, overlap {overlap} {precision}"),
            &got,
            &want,
        );
    }
}

#[test]
fn zero_shards_span_the_processes_and_train_like_one_process() {
    // Three ranks (uneven slices), spread 2 + 1 and 1 + 1 + 1: the first process's
    // two devices are summed before the third's, the order one process uses too.
    let psi: u64 = {
        let (_, states) = one_process(config("", 1, 0, true), 1);
        states.iter().map(|s| s.master.len() as u64).sum()
    };
    for (stage, layout) in [(1u8, &[2usize, 1][..]), (2, &[1, 1, 1][..])] {
        let want = one_process(config("", 3, stage, true), 3);
        let got = processes_and_bytes(layout, |w| config("", w, stage, true), |_| 3);
        let bytes: Vec<u64> = got.iter().map(|r| r.as_ref().map_or(0, |r| r.1)).collect();
        let runs: Vec<_> = got.into_iter().map(|r| r.map(|(run, _)| run)).collect();
        assert_same(&format!("{layout:?}, ZeRO stage {stage}"), &runs, &want);
        // The gradients only go to their owners (a reduce-scatter): each process
        // sends the 4Ψ bytes it does not own and receives its own part from every
        // other process; the updated weights come back in the all-gather instead.
        let world = 3;
        let mut rank = 0;
        for (p, &n) in layout.iter().enumerate() {
            let owned: u64 = (rank..rank + n)
                .map(|r| {
                    kiln::engine::parallel::zero::shard_range(psi as usize, world, r).len() as u64
                })
                .sum();
            rank += n;
            let others = (layout.len() - 1) as u64;
            assert_eq!(
                bytes[p],
                4 * (psi - owned) + 4 * owned * others,
                "{layout:?} stage {stage}: process {p}'s gradient bytes"
            );
        }
    }
}

#[test]
fn a_process_started_differently_is_refused_by_every_process() {
    let got = processes(&[1, 1], |w| config("", w, 0, false), |p| 3 + p as u64);
    for (p, r) in got.iter().enumerate() {
        let e = r
            .as_ref()
            .err()
            .unwrap_or_else(|| panic!("process {p} trained"));
        assert!(
            e.contains("different configs, models or seeds") && e.contains("process(es) [1]"),
            "process {p}: {e}"
        );
    }
}

#[test]
fn a_process_that_never_reaches_a_step_is_named_within_the_timeout() {
    let comms = ThreadProcesses::group(3, Duration::from_secs(2));
    let started = std::time::Instant::now();
    let errors: Vec<String> = std::thread::scope(|s| {
        let hs: Vec<_> = comms
            .iter()
            .enumerate()
            .map(|(p, comm)| {
                let comm = comm.clone();
                s.spawn(move || {
                    let dev = gpu("vulkan", false);
                    let procs = Processes::new(comm, 1).unwrap();
                    let mut t = Trainer::new_processes(
                        &[dev.as_ref()],
                        gpt(),
                        config("", 3, 0, false),
                        3,
                        Some(procs),
                    )
                    .unwrap();
                    if p == 2 {
                        // Hangs (or died) before its first step.
                        return String::new();
                    }
                    let step = batches(3, 1).remove(0);
                    t.step(dev.as_ref(), &[step[p].clone()])
                        .unwrap_err()
                        .to_string()
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    for e in &errors[..2] {
        assert!(
            e.contains("process(es) [2] did not reach step 1's gradient exchange within 2 s"),
            "{e}"
        );
    }
    assert!(started.elapsed() < Duration::from_secs(60));
}

#[test]
fn a_checkpoint_of_a_multi_process_zero_job_resumes_in_one_process() {
    let dir = std::env::temp_dir().join(format!("kiln-processes-ck-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let data = batches(2, 2 * STEPS);
    let c = |w| config("", w, 2, true);
    // Two processes: STEPS steps, a checkpoint (process 0 writes it), STEPS more.
    let comms = ThreadProcesses::group(2, Duration::from_secs(120));
    let after: Vec<Vec<f32>> = std::thread::scope(|s| {
        let hs: Vec<_> = comms
            .into_iter()
            .enumerate()
            .map(|(p, comm)| {
                let (dir, data) = (&dir, &data);
                s.spawn(move || {
                    let dev = gpu("vulkan", false);
                    let refs = [dev.as_ref()];
                    let procs = Processes::new(comm, 1).unwrap();
                    let mut t = Trainer::new_processes(&refs, gpt(), c(2), 3, Some(procs)).unwrap();
                    let mut losses = vec![];
                    for (i, step) in data.iter().enumerate() {
                        if i == STEPS {
                            t.save_checkpoint(&refs, dir, i as u64, Default::default(), 1)
                                .unwrap();
                        }
                        let s = t.step(refs[0], &[step[p].clone()]).unwrap();
                        if i >= STEPS {
                            losses.push(s.loss);
                        }
                    }
                    losses
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    assert_eq!(after[0], after[1]);
    // One process with both devices continues from the checkpoint.
    let devs: Vec<Box<dyn Device>> = (0..2).map(|_| gpu("vulkan", false)).collect();
    let refs: Vec<&dyn Device> = devs.iter().map(|d| d.as_ref()).collect();
    let mut t = Trainer::new_group(&refs, gpt(), c(2), 99).unwrap();
    let ck = checkpoint::load_latest(&dir).unwrap();
    assert_eq!(ck.step(), STEPS as u64);
    t.load_checkpoint(&refs, &ck).unwrap();
    let mut resumed = vec![];
    for step in &data[STEPS..] {
        let per_rank: Vec<Vec<MicroBatch>> = step.iter().map(|m| vec![m.clone()]).collect();
        resumed.push(t.step_group(&refs, &per_rank).unwrap().loss);
    }
    assert_eq!(resumed, after[0], "the resumed losses");
    let _ = std::fs::remove_dir_all(&dir);
}
