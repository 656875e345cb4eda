//! `kiln train --profile` and `kiln bench peak`: a profile of a few training steps
//! (kernel timings from every device, host spans, a trace and a table) and the
//! adapter peaks its MFU is measured against, cached per adapter and host.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::{Context, Result};
use serde::{Deserialize, Serialize};

use kiln_engine::config::TrainConfig;
use kiln_engine::device::profile::{self as spans};
use kiln_engine::train::profile::{DeviceTrack, Profile};
use kiln_engine::{Capabilities, Device, Error};

use crate::say::say;

/// Steps `--profile` covers when no count is given.
pub const DEFAULT_PROFILE_STEPS: u64 = 3;

pub use kiln_engine::fsutil::{cache_dir, host_cpu};

/// One adapter's measured peak, as `kiln bench peak` reports and caches it.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct PeakRecord {
    pub adapter: String,
    pub backend: String,
    pub driver: String,
    pub host_cpu: String,
    pub gflops: f64,
    pub gbps: f64,
}

impl PeakRecord {
    fn key(&self) -> String {
        peak_key(&self.adapter, &self.backend, &self.driver, &self.host_cpu)
    }
}

fn peak_key(adapter: &str, backend: &str, driver: &str, host: &str) -> String {
    format!("{adapter} | {backend} | {driver} | {host}")
}

/// The cache file of measured peaks.
pub fn peak_cache_file() -> Option<PathBuf> {
    cache_dir().map(|d| d.join("peak.json"))
}

#[derive(Default, Serialize, Deserialize)]
struct PeakCache {
    peaks: BTreeMap<String, PeakRecord>,
}

/// Reads the peak cache; a missing file is empty, and so is an unreadable or corrupt
/// one, with a message (it is rewritten by the next `kiln bench peak`).
fn read_peak_cache(path: &Path) -> PeakCache {
    let text = match std::fs::read_to_string(path) {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return PeakCache::default(),
        Err(e) => {
            say(format!(
                "note: ignoring the peak cache {}: {e}; `kiln bench peak` writes a new one",
                path.display()
            ));
            return PeakCache::default();
        }
    };
    match serde_json::from_str(&text) {
        Ok(c) => c,
        Err(e) => {
            say(format!(
                "note: ignoring the peak cache {}, which is not a valid cache ({e}); \
                 `kiln bench peak` writes a new one",
                path.display()
            ));
            PeakCache::default()
        }
    }
}

/// The cached peak of the adapter `caps` describes, on this host.
pub fn cached_peak(caps: &Capabilities) -> Option<PeakRecord> {
    let path = peak_cache_file()?;
    let key = peak_key(&caps.name, &caps.backend, &caps.driver, &host_cpu());
    read_peak_cache(&path).peaks.remove(&key)
}

/// Adds `records` to the peak cache (atomically: a crash leaves the old file).
pub fn store_peaks(records: &[PeakRecord]) -> Result<PathBuf> {
    let path = peak_cache_file().context(
        "no user cache directory (neither KILN_CACHE_DIR nor HOME is set): set KILN_CACHE_DIR",
    )?;
    let mut cache = read_peak_cache(&path);
    for r in records {
        cache.peaks.insert(r.key(), r.clone());
    }
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir)
            .with_context(|| format!("creating the cache directory {}", dir.display()))?;
    }
    let tmp = path.with_extension("json.tmp");
    std::fs::write(&tmp, serde_json::to_string_pretty(&cache)?)
        .with_context(|| format!("writing {}", tmp.display()))?;
    std::fs::rename(&tmp, &path).with_context(|| format!("writing {}", path.display()))?;
    Ok(path)
}

/// Measures one wgpu adapter's peak.
pub fn measure_peak(dev: &kiln_wgpu::WgpuDevice) -> Result<PeakRecord> {
    let p = dev.measure_peak()?;
    let caps = dev.caps();
    Ok(PeakRecord {
        adapter: caps.name.clone(),
        backend: caps.backend.clone(),
        driver: caps.driver.clone(),
        host_cpu: host_cpu(),
        gflops: p.gflops,
        gbps: p.gbps,
    })
}

/// `kiln bench peak`'s table.
pub fn format_peaks(rows: &[PeakRecord]) -> String {
    let mut out = String::new();
    for r in rows {
        out.push_str(&format!(
            "{:<40} {:<7} {:>10.1} GFLOP/s f32 FMA {:>8.1} GB/s copy   host: {}\n",
            r.adapter, r.backend, r.gflops, r.gbps, r.host_cpu
        ));
    }
    out
}

/// Which steps to profile, from `--profile [N]` and the config's `wall_clock_breakdown`
/// and `flops_profiler`; `None` when nothing asks for a profile.
pub fn profiled_steps(
    profile: Option<u64>,
    ds: &TrainConfig,
    done: u64,
    total: u64,
) -> Result<Option<(u64, u64)>> {
    if profile == Some(0) {
        anyhow::bail!(
            "--profile 0: profile at least 1 step (--profile alone profiles {DEFAULT_PROFILE_STEPS})"
        );
    }
    let asked = profile.is_some() || ds.wall_clock_breakdown || ds.flops_profiler.enabled;
    if !asked || done >= total {
        return Ok(None);
    }
    let count = profile.unwrap_or(DEFAULT_PROFILE_STEPS);
    // The first step of a process compiles every kernel it runs: skip it when there is
    // another to measure.
    let mut first = if done + 2 <= total {
        done + 2
    } else {
        done + 1
    };
    if ds.flops_profiler.enabled && profile.is_none() {
        first = first.max(ds.flops_profiler.profile_step).min(total);
    }
    Ok(Some((first, (first + count - 1).min(total))))
}

/// A profile being taken during `kiln train`.
pub struct Profiler {
    first: u64,
    last: u64,
    epoch: Instant,
    /// Per device: its name and whether it times its launches.
    timed: Vec<bool>,
    tracks: Vec<DeviceTrack>,
    steps: Vec<(u64, Instant, Instant)>,
    recording: bool,
    spans: Vec<spans::Span>,
    peak_tflops: Option<f64>,
}

impl Profiler {
    pub fn new(
        (first, last): (u64, u64),
        devs: &[&dyn Device],
        peak_tflops: Option<f64>,
    ) -> Result<Profiler> {
        if let Some(p) = peak_tflops {
            if !(p.is_finite() && p > 0.0) {
                anyhow::bail!(
                    "--peak-tflops {p}: the peak must be a positive number of TFLOP/s (per device)"
                );
            }
        }
        say(format!(
            "profiling step{} {first}{}: trace.json and profile.txt go into the run directory",
            if last > first { "s" } else { "" },
            if last > first {
                format!("-{last}")
            } else {
                String::new()
            }
        ));
        Ok(Profiler {
            first,
            last,
            epoch: Instant::now(),
            timed: vec![true; devs.len()],
            // Devices of a group are often one adapter opened several times: their
            // tracks are told apart by rank.
            tracks: devs
                .iter()
                .enumerate()
                .map(|(rank, d)| DeviceTrack {
                    name: if devs.len() > 1 {
                        format!("rank {rank}: {}", d.caps().name)
                    } else {
                        d.caps().name.clone()
                    },
                    timings: vec![],
                })
                .collect(),
            steps: vec![],
            recording: false,
            spans: vec![],
            peak_tflops,
        })
    }

    fn covers(&self, step: u64) -> bool {
        (self.first..=self.last).contains(&step)
    }

    /// Before step `step` (1-based) starts.
    pub fn before_step(&mut self, step: u64, devs: &[&dyn Device]) -> Result<()> {
        if !self.covers(step) {
            if self.recording {
                self.stop_spans();
            }
            return Ok(());
        }
        if !self.recording {
            if !spans::start_recording() {
                anyhow::bail!(
                    "another profile is being recorded in this process: profile one run at a time"
                );
            }
            self.recording = true;
        }
        for (i, d) in devs.iter().enumerate() {
            if !self.timed[i] {
                continue;
            }
            match d.profile_begin() {
                Ok(()) => {}
                Err(e @ Error::Unsupported { .. }) => {
                    say(format!("note: {e}; its kernel times show as idle"));
                    self.timed[i] = false;
                }
                Err(e) => return Err(e.into()),
            }
        }
        Ok(())
    }

    /// Waits, in a profiled step, for the devices to finish the step's work (its
    /// optimizer launches run after the loss is read), so that the step's frame holds
    /// all of it: a profiled step is timed from its start to its devices' last kernel.
    pub fn drain(&mut self, step: u64, devs: &[&dyn Device]) -> Result<()> {
        if self.covers(step) {
            for d in devs {
                d.submit()?;
                d.wait()?;
            }
        }
        Ok(())
    }

    /// After step `step` ran from `start` to `end` (what its `step_ms` measures).
    pub fn after_step(
        &mut self,
        step: u64,
        start: Instant,
        end: Instant,
        devs: &[&dyn Device],
    ) -> Result<()> {
        if !self.covers(step) {
            return Ok(());
        }
        self.steps.push((step, start, end));
        for (i, d) in devs.iter().enumerate() {
            if self.timed[i] {
                self.tracks[i].timings.extend(d.profile_end()?);
            }
        }
        Ok(())
    }

    fn stop_spans(&mut self) {
        self.recording = false;
        self.spans.extend(spans::stop_recording().0);
    }

    /// Ends the profile: writes `trace.json` and `profile.txt` into `dir` and returns
    /// the table.
    pub fn finish(mut self, dir: &Path, devs: &[&dyn Device]) -> Result<Option<String>> {
        if self.recording {
            self.stop_spans();
        }
        if self.steps.is_empty() {
            return Ok(None);
        }
        let profile = Profile {
            epoch: self.epoch,
            steps: self.steps,
            step_thread: spans::thread_index(),
            devices: self.tracks,
            spans: self.spans,
            threads: spans::thread_names(),
        };
        let trace = dir.join("trace.json");
        std::fs::write(&trace, serde_json::to_vec(&profile.trace())?)
            .with_context(|| format!("writing {}", trace.display()))?;
        let peak = match self.peak_tflops {
            Some(t) => Some(t * 1e12 * devs.len() as f64),
            None => devs
                .iter()
                .map(|d| cached_peak(d.caps()).map(|p| p.gflops * 1e9))
                .sum::<Option<f64>>(),
        };
        let mut table = profile.table(peak);
        if self.timed.iter().any(|t| !t) {
            table.push_str("(a device without GPU timestamps counts its kernels' time as idle)\n");
        }
        let text = dir.join("profile.txt");
        std::fs::write(&text, &table).with_context(|| format!("writing {}", text.display()))?;
        Ok(Some(table))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(edit: impl FnOnce(&mut TrainConfig)) -> TrainConfig {
        let mut c = TrainConfig::default_for(1);
        edit(&mut c);
        c
    }

    #[test]
    fn the_profiled_steps_skip_the_compiling_step_and_follow_the_config() {
        let plain = config(|_| {});
        assert_eq!(profiled_steps(None, &plain, 0, 100).unwrap(), None);
        assert_eq!(
            profiled_steps(Some(3), &plain, 0, 100).unwrap(),
            Some((2, 4))
        );
        // A run too short to skip its first step profiles what there is.
        assert_eq!(profiled_steps(Some(3), &plain, 0, 1).unwrap(), Some((1, 1)));
        assert_eq!(profiled_steps(Some(5), &plain, 0, 3).unwrap(), Some((2, 3)));
        // A resumed run compiles again: its first step is skipped too.
        assert_eq!(
            profiled_steps(Some(2), &plain, 10, 20).unwrap(),
            Some((12, 13))
        );
        assert_eq!(profiled_steps(Some(2), &plain, 20, 20).unwrap(), None);
        let e = profiled_steps(Some(0), &plain, 0, 10)
            .unwrap_err()
            .to_string();
        assert!(e.contains("at least 1 step"), "{e}");

        let wall = config(|c| c.wall_clock_breakdown = true);
        assert_eq!(profiled_steps(None, &wall, 0, 100).unwrap(), Some((2, 4)));
        let flops = config(|c| {
            c.flops_profiler.enabled = true;
            c.flops_profiler.profile_step = 7;
        });
        assert_eq!(profiled_steps(None, &flops, 0, 100).unwrap(), Some((7, 9)));
        assert_eq!(profiled_steps(None, &flops, 0, 5).unwrap(), Some((5, 5)));
    }

    #[test]
    fn a_corrupt_peak_cache_reads_as_empty() {
        let dir = std::env::temp_dir().join(format!("kiln-peak-cache-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("peak.json");
        std::fs::write(&path, [0xff, 0xfe, b'{']).unwrap();
        assert!(read_peak_cache(&path).peaks.is_empty());
        std::fs::write(&path, r#"{"peaks": {"a": {"adapter": 3}}}"#).unwrap();
        assert!(read_peak_cache(&path).peaks.is_empty());
        assert!(read_peak_cache(&dir.join("absent.json")).peaks.is_empty());
    }
}
