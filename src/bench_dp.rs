//! `kiln bench dp`: data-parallel step time on 1, 2, 4… devices of one adapter, the
//! time the host-staged gradient exchange takes and how much of it overlaps compute,
//! and — from those measurements — the scaling a group of real GPUs would get over
//! PCIe. Under `mpirun` (the `mpi` feature) it measures the processes' exchange and
//! models the scaling over a network.

use std::time::Instant;

use anyhow::Result;
use serde::Serialize;

use kiln_engine::config::parse;
use std::sync::Arc;

use kiln_engine::models::gpt::{Gpt, GptConfig};
use kiln_engine::models::MicroBatch;
use kiln_engine::parallel::collective::Processes;
use kiln_engine::train::trainer::Trainer;
use kiln_engine::Device;
use kiln_wgpu::{DeviceOptions, WgpuDevice};

/// One measured group size.
#[derive(Clone, Debug, Serialize)]
pub struct DpRow {
    pub adapter: String,
    pub devices: usize,
    /// Mean wall time of a step (every device's forward and backward, the exchange and
    /// the update).
    pub step_ms: f64,
    /// The gradient exchange time the step paid (download, host reduction, upload),
    /// counted from the end of the last device's backward: overlapped work is hidden.
    pub comm_ms: f64,
    /// Share of the exchanged bytes fetched while backward was still running.
    pub overlap: f64,
    pub bytes_per_step: u64,
    /// Of those, bytes sent to and received from other processes (MPI).
    pub process_bytes_per_step: u64,
    /// Samples per second over the whole group.
    pub samples_per_s: f64,
    /// Processes in the job (1 without MPI).
    pub processes: usize,
    /// The most any device's allocator held after the timed steps.
    pub device_bytes: u64,
    /// ZeRO-Offload: the host's optimizer step per step and the part of it the
    /// devices waited for (ms; 0 without offload).
    pub offload_ms: f64,
    pub offload_exposed_ms: f64,
    /// ZeRO stage 3: host time loading the blocks' weights per step (all devices, ms)
    /// and the share of it hidden behind the devices' work.
    pub gather_ms: f64,
    pub gather_hidden: f64,
}

/// The ZeRO settings a bench dp group trains with: the stage, whether the optimizer
/// state (`offload`) and stage 3's parameter copies (`offload_param`) are offloaded to
/// host memory, and stage 3's persistence threshold.
#[derive(Clone, Copy, Debug)]
pub struct Zero {
    pub stage: u8,
    pub offload: bool,
    pub offload_param: bool,
    pub persistence_threshold: u64,
}

impl Default for Zero {
    fn default() -> Zero {
        Zero {
            stage: 0,
            offload: false,
            offload_param: false,
            persistence_threshold: 100_000,
        }
    }
}

/// Times `steps` steps (after one warm-up) of a GPT on `n` devices of `adapter`, for
/// each `n` in `counts`, each device with `micro` samples per step, the exchange
/// overlapped with backward or not (`overlap_comm`), at ZeRO settings `zero`.
pub fn dp_table(
    adapter: usize,
    model: &GptConfig,
    micro: usize,
    counts: &[usize],
    (steps, overlap): (usize, bool),
    zero: Zero,
) -> Result<Vec<DpRow>> {
    if steps == 0 || counts.contains(&0) {
        anyhow::bail!("bench dp needs at least one timed step and one device per group");
    }
    if let Some(&n) = counts.iter().find(|&&n| n > crate::devices::MAX_DEVICES) {
        anyhow::bail!(
            "bench dp: a group of {n} devices; Kiln opens at most {} (each compiles every \
             kernel it runs)",
            crate::devices::MAX_DEVICES
        );
    }
    counts
        .iter()
        .map(|&n| measure(adapter, model, micro, n, (steps, overlap, zero), None, None))
        .collect()
}

/// Times `steps` steps (after one warm-up) of this process's part of a multi-process
/// job: `local` devices of `adapter` here, the other processes' in `procs`; the
/// processes sum buckets of `bucket` elements (`reduce_bucket_size`).
#[allow(clippy::too_many_arguments)]
pub fn dp_processes(
    adapter: usize,
    model: &GptConfig,
    micro: usize,
    local: usize,
    (steps, overlap, zero): (usize, bool, Zero),
    bucket: usize,
    procs: Processes,
) -> Result<DpRow> {
    if steps == 0 || bucket == 0 {
        anyhow::bail!("bench dp needs at least one timed step and a bucket of 1 element or more");
    }
    let (procs, bucket) = (Some(procs), Some(bucket));
    measure(
        adapter,
        model,
        micro,
        local,
        (steps, overlap, zero),
        bucket,
        procs,
    )
}

#[allow(clippy::too_many_arguments)]
fn measure(
    adapter: usize,
    model: &GptConfig,
    micro: usize,
    n: usize,
    (steps, overlap, zero): (usize, bool, Zero),
    bucket: Option<usize>,
    procs: Option<Processes>,
) -> Result<DpRow> {
    let t = model.block_size;
    let opened = (0..n)
        .map(|_| WgpuDevice::open(adapter, &DeviceOptions::default()))
        .collect::<Result<Vec<_>, _>>()?;
    let devs: Vec<&dyn Device> = opened.iter().map(|d| d as &dyn Device).collect();
    let world = procs.as_ref().map_or(n, Processes::world);
    let first = procs.as_ref().map_or(0, Processes::first_rank);
    let processes = procs.as_ref().map_or(1, |p| p.devices.len());
    let bucket = bucket.map_or(String::new(), |b| format!(r#", "reduce_bucket_size": {b}"#));
    let ds = parse(
        &format!(
            r#"{{"train_micro_batch_size_per_gpu": {micro}, "fp16": {{"enabled": true}},
                 "zero_optimization": {{"stage": {stage}, "overlap_comm": {overlap}{bucket},
                     "stage3_param_persistence_threshold": {threshold},
                     "offload_optimizer": {{"device": "{device}"}},
                     "offload_param": {{"device": "{param_device}"}}}}}}"#,
            stage = zero.stage,
            threshold = zero.persistence_threshold,
            device = if zero.offload { "cpu" } else { "none" },
            param_device = if zero.offload_param { "cpu" } else { "none" },
        ),
        world,
    )?;
    let gpt = Arc::new(Gpt::new(model.clone(), t));
    let mut trainer = Trainer::new_processes(&devs, gpt, ds, 1, procs)?;
    let v = model.vocab_size as u32;
    let batch: Vec<(Vec<u32>, Vec<u32>)> = (first..first + n)
        .map(|r| {
            let tok: Vec<u32> = (0..micro * t)
                .map(|i| (i as u32 * 7 + r as u32) % v)
                .collect();
            let tgt = tok.iter().map(|x| (x + 1) % v).collect();
            (tok, tgt)
        })
        .collect();
    let micro_batches: Vec<Vec<MicroBatch>> = batch
        .iter()
        .map(|(a, b)| vec![MicroBatch::tokens(a, b)])
        .collect();
    trainer.step_group(&devs, &micro_batches)?;
    let (mut comm, mut bytes, mut across, mut hidden) = (0.0, 0, 0, 0.0);
    let (mut host, mut exposed) = (0.0, 0.0);
    let (mut gather, mut gather_hidden) = (0.0, 0.0);
    let t0 = Instant::now();
    for _ in 0..steps {
        trainer.step_group(&devs, &micro_batches)?;
        let c = trainer.last_comm;
        comm += c.ms;
        bytes += c.bytes;
        across += c.process_bytes;
        hidden += c.overlap;
        host += c.offload_ms;
        exposed += c.offload_exposed_ms;
        gather += c.gather_ms;
        gather_hidden += c.gather_hidden_ms;
    }
    let step_ms = t0.elapsed().as_secs_f64() * 1e3 / steps as f64;
    Ok(DpRow {
        adapter: devs[0].caps().name.clone(),
        devices: world,
        step_ms,
        comm_ms: comm / steps as f64,
        overlap: hidden / steps as f64,
        bytes_per_step: bytes / steps as u64,
        process_bytes_per_step: across / steps as u64,
        samples_per_s: (world * micro) as f64 / (step_ms / 1e3),
        processes,
        device_bytes: devs.iter().map(|d| d.allocated_bytes()).max().unwrap_or(0),
        offload_ms: host / steps as f64,
        offload_exposed_ms: exposed / steps as f64,
        gather_ms: gather / steps as f64,
        gather_hidden: gather_hidden / gather.max(1e-9),
    })
}

/// Checks a bandwidth flag of the model: a positive, finite number of GB/s (at 0 the
/// exchange would take forever and every row would read 0%).
pub fn check_bandwidth(flag: &str, gbps: f64) -> Result<()> {
    if !(gbps.is_finite() && gbps > 0.0) {
        anyhow::bail!(
            "--{flag} {gbps}: a bandwidth must be a positive number of GB/s (PCIe 4.0 x16 \
             moves about 25, host memory 20 or more)"
        );
    }
    Ok(())
}

/// Milliseconds to move `bytes` at `gbps` GB/s (10^9 bytes per second), latency aside.
pub fn transfer_ms(bytes: f64, gbps: f64) -> f64 {
    bytes / (gbps * 1e9) * 1e3
}

/// Modelled efficiency of `n` real GPUs, each computing for `compute_ms` per step and
/// moving `grad_bytes` of gradients down and up its own PCIe link at `link_gbps`, the
/// host adding the `n` copies at `host_gbps`, with `overlap` of it hidden.
pub fn modelled_efficiency(
    n: usize,
    compute_ms: f64,
    grad_bytes: f64,
    link_gbps: f64,
    host_gbps: f64,
    overlap: f64,
) -> f64 {
    if n <= 1 {
        return 1.0;
    }
    let link_ms = 2.0 * transfer_ms(grad_bytes, link_gbps);
    let reduce_ms = transfer_ms(n as f64 * grad_bytes, host_gbps);
    let exposed = (link_ms + reduce_ms) * (1.0 - overlap);
    compute_ms / (compute_ms + exposed)
}

/// Modelled efficiency of `p` processes (one GPU each), each computing for
/// `compute_ms` per step, whose `grad_bytes` of f32 gradients are summed over a
/// network of `gbps` GB/s per process and `latency_us` per message, in buckets of
/// `bucket_bytes`, with `overlap` of it hidden behind backward. The sum is a
/// reduce-scatter and an all-gather, as Kiln's MPI exchange does it: each moves
/// (p-1)/p of the bytes and takes p-1 messages per bucket.
pub fn modelled_network_efficiency(
    p: usize,
    compute_ms: f64,
    grad_bytes: f64,
    bucket_bytes: f64,
    gbps: f64,
    latency_us: f64,
    overlap: f64,
) -> f64 {
    if p <= 1 {
        return 1.0;
    }
    let steps = 2.0 * (p - 1) as f64;
    let buckets = (grad_bytes / bucket_bytes.max(1.0)).ceil().max(1.0);
    let wire_ms = transfer_ms(steps / p as f64 * grad_bytes, gbps);
    let latency_ms = steps * buckets * latency_us / 1e3;
    let exposed = (wire_ms + latency_ms) * (1.0 - overlap);
    compute_ms / (compute_ms + exposed)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_network_model_is_hand_checkable() {
        // 4 processes, 400 MB in 4 buckets, 10 GB/s, 10 µs: each process sends 3/4
        // of 400 MB in the reduce-scatter and again in the all-gather, 600 MB, 60 ms;
        // 6 messages × 4 buckets × 10 µs = 0.24 ms; 100 ms of compute, nothing hidden:
        // 100 / 160.24.
        let e = modelled_network_efficiency(4, 100.0, 4e8, 1e8, 10.0, 10.0, 0.0);
        assert!((e - 100.0 / 160.24).abs() < 1e-12, "{e}");
        // Three quarters hidden.
        let e = modelled_network_efficiency(4, 100.0, 4e8, 1e8, 10.0, 10.0, 0.75);
        assert!((e - 100.0 / (100.0 + 60.24 / 4.0)).abs() < 1e-12, "{e}");
        assert_eq!(
            modelled_network_efficiency(1, 1.0, 1e9, 1.0, 1.0, 1.0, 0.0),
            1.0
        );
    }

    #[test]
    fn the_model_is_hand_checkable() {
        // 100 ms of compute, 500 MB of gradients, 25 GB/s links: 2 × 20 ms on the
        // link; 4 copies at 50 GB/s: 40 ms on the host; none hidden: 100 / 180.
        let e = modelled_efficiency(4, 100.0, 5e8, 25.0, 50.0, 0.0);
        assert!((e - 100.0 / 180.0).abs() < 1e-12, "{e}");
        // Half of it hidden: 100 / 140.
        let e = modelled_efficiency(4, 100.0, 5e8, 25.0, 50.0, 0.5);
        assert!((e - 100.0 / 140.0).abs() < 1e-12, "{e}");
        assert_eq!(modelled_efficiency(1, 1.0, 1e9, 1.0, 1.0, 0.0), 1.0);
    }
}
