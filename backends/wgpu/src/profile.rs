//! GPU timestamps around every launch of a profiled stretch (`Device::profile_begin` ..
//! `profile_end`). Each compute pass of a launch writes a timestamp at its start and end
//! (pass-level timestamp writes: no command of a launch is split or reordered, so
//! results do not change). The queries are resolved and read back once, at
//! `profile_end`, not per launch.
//!
//! GPU ticks are put on the host's clock by calibration passes at `profile_begin`: an
//! empty pass whose start lies between two host instants taken around its submission
//! and completion; the midpoint of the tightest of three such round trips is the tick's
//! host time (off by at most half that round trip).

use std::time::{Duration, Instant};

use kiln_engine::device::cost::KernelCost;
use kiln_engine::device::{check_profile_begin, KernelTiming};
use kiln_engine::{Error, Result};

use crate::device::{State, WgpuDevice};
use crate::timestamps::{Profiling, CALIBRATIONS, PER_SET};

impl WgpuDevice {
    /// Timestamp writes for the next compute pass, when profiling.
    pub(crate) fn pass_timestamps(&self, s: &mut State) -> Option<(wgpu::QuerySet, u32)> {
        let p = s.profiling.as_mut()?;
        Some(p.take(&self.device, 2))
    }

    /// Called before a launch is recorded: returns the query written last, if profiling.
    pub(crate) fn launch_queries_begin(&self, s: &mut State) -> Option<u32> {
        let p = s.profiling.as_mut()?;
        p.launch_first = None;
        Some(p.last)
    }

    /// Records a profiled launch's queries after it is recorded (`before`: what
    /// `launch_queries_begin` returned).
    pub(crate) fn launch_queries_end(&self, s: &mut State, before: u32, cost: KernelCost) {
        let Some(p) = s.profiling.as_mut() else {
            return;
        };
        if let Some(first) = p.launch_first {
            let last = p.last;
            p.launches.push((cost, first, last));
            return;
        }
        // No pass: a marker pass after the launch's commands bounds it.
        if let Some(marker) = self.marker_pass(s) {
            if let Some(p) = s.profiling.as_mut() {
                p.launches.push((cost, before, marker));
            }
        }
    }

    /// An empty pass writing a timestamp at its start and its end; returns the start's
    /// global index. Two queries, as every pass takes: pairs never straddle two query
    /// sets, so no query in a resolved range is left unwritten (a Vulkan driver may wait
    /// forever for one).
    fn marker_pass(&self, s: &mut State) -> Option<u32> {
        let p = s.profiling.as_mut()?;
        let (set, index) = p.take(&self.device, 2);
        let global = p.last - 1;
        let writes = wgpu::ComputePassTimestampWrites {
            query_set: &set,
            beginning_of_pass_write_index: Some(index),
            end_of_pass_write_index: Some(index + 1),
        };
        self.encoder(s)
            .begin_compute_pass(&wgpu::ComputePassDescriptor {
                label: Some("kiln profile marker"),
                timestamp_writes: Some(writes),
            });
        Some(global)
    }

    pub(crate) fn begin_profile(&self) -> Result<()> {
        let mut s = self.lock();
        check_profile_begin(&self.caps, s.profiling.is_some())?;
        // Everything before the profiled stretch runs first, so it is not counted.
        self.flush(&mut s)?;
        drop(s);
        kiln_engine::Device::wait(self)?;
        let mut s = self.lock();
        s.profiling = Some(Profiling {
            sets: vec![],
            used: 0,
            launches: vec![],
            last: 0,
            launch_first: None,
            calibration: (0, Instant::now(), Instant::now()),
        });
        drop(s);
        // The tightest of a few round trips: a thread wake-up on the way can stretch one.
        let mut best: Option<(u32, Instant, Instant)> = None;
        for _ in 0..CALIBRATIONS {
            let mut s = self.lock();
            let Some(query) = self.marker_pass(&mut s) else {
                break;
            };
            let before = Instant::now();
            self.flush(&mut s)?;
            drop(s);
            kiln_engine::Device::wait(self)?;
            let after = Instant::now();
            if best.is_none_or(|b| after - before < b.2 - b.1) {
                best = Some((query, before, after));
            }
        }
        if let (Some(p), Some(best)) = (self.lock().profiling.as_mut(), best) {
            p.calibration = best;
        }
        Ok(())
    }

    pub(crate) fn end_profile(&self) -> Result<Vec<KernelTiming>> {
        let mut s = self.lock();
        let Some(p) = s.profiling.take() else {
            return Err(Error::InvalidArgument(format!(
                "profile_end on `{}` without profile_begin",
                self.caps.name
            )));
        };
        let bytes = p.used.next_multiple_of(PER_SET) as u64 * wgpu::QUERY_SIZE as u64;
        let resolved = self.device.create_buffer(&wgpu::BufferDescriptor {
            label: Some("kiln profile resolve"),
            size: bytes,
            usage: wgpu::BufferUsages::QUERY_RESOLVE | wgpu::BufferUsages::COPY_SRC,
            mapped_at_creation: false,
        });
        let readback = self.device.create_buffer(&wgpu::BufferDescriptor {
            label: Some("kiln profile readback"),
            size: bytes,
            usage: wgpu::BufferUsages::COPY_DST | wgpu::BufferUsages::MAP_READ,
            mapped_at_creation: false,
        });
        let encoder = self.encoder(&mut s);
        for (i, set) in p.sets.iter().enumerate() {
            let first = i as u32 * PER_SET;
            let count = p.used.saturating_sub(first).min(PER_SET);
            if count > 0 {
                let offset = first as u64 * wgpu::QUERY_SIZE as u64;
                encoder.resolve_query_set(set, 0..count, &resolved, offset);
            }
        }
        encoder.copy_buffer_to_buffer(&resolved, 0, &readback, 0, bytes);
        self.flush(&mut s)?;
        drop(s);
        let slice = readback.slice(..);
        let (tx, rx) = std::sync::mpsc::channel();
        slice.map_async(wgpu::MapMode::Read, move |r| {
            let _ = tx.send(r);
        });
        kiln_engine::Device::wait(self)?;
        rx.recv()
            .map_err(|_| self.backend_error("the profile's readback was cancelled"))?
            .map_err(|e| self.backend_error(format!("mapping the profile's readback: {e}")))?;
        let ticks: Vec<u64> = {
            let view = slice
                .get_mapped_range()
                .map_err(|e| self.backend_error(format!("reading the profile: {e}")))?;
            bytemuck::cast_slice(&view).to_vec()
        };
        readback.unmap();
        let ns_per_tick = self.queue.get_timestamp_period() as f64;
        let (query, before, after) = p.calibration;
        let anchor = before + (after - before) / 2;
        let zero = ticks[query as usize];
        // Query `q`'s host instant (ticks before the anchor clamp to it: they cannot be
        // earlier than the calibration pass's submission).
        let at = |q: u32| {
            let ns = ticks[q as usize].saturating_sub(zero) as f64 * ns_per_tick;
            anchor + Duration::from_nanos(ns as u64)
        };
        let timings = p
            .launches
            .into_iter()
            .map(|(cost, first, last)| {
                let (start, stop) = (at(first), at(last));
                KernelTiming {
                    cost,
                    start,
                    dur: stop.saturating_duration_since(start),
                }
            })
            .collect();
        Ok(timings)
    }
}
