//! A profile of training steps: kernel timings from each device and host spans (see
//! [`crate::device::profile`]) turned into a Chrome/Perfetto trace and a table of where
//! each step's time went.
//!
//! The step breakdown divides each step's wall time, moment by moment, into the first
//! of these that holds: some device runs a kernel (**compute**); the host moves data
//! to or from a device or reduces gradients (**transfer/communication**, exposed: not
//! hidden behind compute); the host waits for input batches (**input stall**); the host
//! records or submits work, runs the optimizer's host side or writes a checkpoint
//! (**host work**); else nothing measured is happening (**idle**: a device waits for
//! the host, or the host for a device between kernels). So the parts add up to the
//! step's time by construction.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::time::Instant;

use serde_json::{json, Value};

use crate::device::profile::{Span, SpanKind};
use crate::device::KernelTiming;

/// One device's kernel timings over the profiled steps.
#[derive(Clone, Debug)]
pub struct DeviceTrack {
    pub name: String,
    pub timings: Vec<KernelTiming>,
}

/// Everything a profile recorded.
#[derive(Clone, Debug)]
pub struct Profile {
    /// Time zero of the trace.
    pub epoch: Instant,
    /// Each profiled step: its number and wall-time frame.
    pub steps: Vec<(u64, Instant, Instant)>,
    /// The host thread that ran the steps (their frames go on its track).
    pub step_thread: usize,
    pub devices: Vec<DeviceTrack>,
    pub spans: Vec<Span>,
    /// Host thread names, indexed by [`Span::thread`].
    pub threads: Vec<String>,
}

/// Where one step's time went, in milliseconds; the five parts add up to `total_ms`.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct StepBreakdown {
    pub step: u64,
    pub total_ms: f64,
    pub compute_ms: f64,
    pub comm_ms: f64,
    pub input_ms: f64,
    pub host_ms: f64,
    pub idle_ms: f64,
    /// FLOPs of the kernels launched in the step (all devices).
    pub flops: f64,
}

impl StepBreakdown {
    pub fn parts_ms(&self) -> f64 {
        self.compute_ms + self.comm_ms + self.input_ms + self.host_ms + self.idle_ms
    }
}

/// One kernel label's totals over the profiled steps.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct KernelRow {
    pub label: String,
    pub kind: &'static str,
    pub ms: f64,
    pub launches: usize,
    pub flops: f64,
    pub bytes: f64,
}

fn ms(d: std::time::Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

/// Sorted, disjoint intervals (ms from a common zero) covering `spans`.
fn merged(mut spans: Vec<(f64, f64)>) -> Vec<(f64, f64)> {
    spans.retain(|s| s.1 > s.0);
    spans.sort_by(|a, b| a.0.total_cmp(&b.0));
    let mut out: Vec<(f64, f64)> = vec![];
    for (a, b) in spans {
        match out.last_mut() {
            Some(last) if a <= last.1 => last.1 = last.1.max(b),
            _ => out.push((a, b)),
        }
    }
    out
}

fn covers(intervals: &[(f64, f64)], t: f64) -> bool {
    let i = intervals.partition_point(|iv| iv.1 <= t);
    intervals.get(i).is_some_and(|iv| iv.0 <= t)
}

impl Profile {
    fn at(&self, t: Instant) -> f64 {
        ms(t.saturating_duration_since(self.epoch))
    }

    /// Each step's breakdown (see the module's notes).
    pub fn breakdown(&self) -> Vec<StepBreakdown> {
        self.steps
            .iter()
            .map(|&(step, start, end)| {
                let (lo, hi) = (self.at(start), self.at(end));
                let clip = |a: f64, b: f64| (a.max(lo), b.min(hi));
                let mut flops = 0.0;
                let mut kernels = vec![];
                for d in &self.devices {
                    for k in &d.timings {
                        let a = self.at(k.start);
                        let b = a + ms(k.dur);
                        if a >= lo && a < hi {
                            flops += k.cost.flops;
                        }
                        kernels.push(clip(a, b));
                    }
                }
                let of = |kinds: &[SpanKind]| {
                    merged(
                        self.spans
                            .iter()
                            .filter(|s| kinds.contains(&s.kind))
                            .map(|s| clip(self.at(s.start), self.at(s.end)))
                            .collect(),
                    )
                };
                // In order of precedence: a moment counts for the first that covers it.
                let layers = [
                    merged(kernels),
                    of(&[SpanKind::Transfer, SpanKind::Reduce]),
                    of(&[SpanKind::Input]),
                    of(&[
                        SpanKind::Record,
                        SpanKind::Submit,
                        SpanKind::Optimizer,
                        SpanKind::Checkpoint,
                    ]),
                ];
                let mut cuts: Vec<f64> = vec![lo, hi];
                for l in &layers {
                    for &(a, b) in l {
                        cuts.push(a);
                        cuts.push(b);
                    }
                }
                cuts.sort_by(f64::total_cmp);
                cuts.dedup();
                let mut parts = [0.0f64; 5];
                for w in cuts.windows(2) {
                    let (a, b) = (w[0], w[1]);
                    if b <= a {
                        continue;
                    }
                    let mid = (a + b) / 2.0;
                    let which = layers.iter().position(|l| covers(l, mid)).unwrap_or(4);
                    parts[which] += b - a;
                }
                StepBreakdown {
                    step,
                    total_ms: hi - lo,
                    compute_ms: parts[0],
                    comm_ms: parts[1],
                    input_ms: parts[2],
                    host_ms: parts[3],
                    idle_ms: parts[4],
                    flops,
                }
            })
            .collect()
    }

    /// Kernel totals by label over every profiled launch, the most time first.
    pub fn kernels(&self) -> Vec<KernelRow> {
        let mut rows: BTreeMap<&str, KernelRow> = BTreeMap::new();
        for d in &self.devices {
            for k in &d.timings {
                let row = rows.entry(&k.cost.label).or_insert_with(|| KernelRow {
                    label: k.cost.label.clone(),
                    kind: k.cost.kind,
                    ..KernelRow::default()
                });
                row.ms += ms(k.dur);
                row.launches += 1;
                row.flops += k.cost.flops;
                row.bytes += k.cost.bytes;
            }
        }
        let mut rows: Vec<KernelRow> = rows.into_values().collect();
        rows.sort_by(|a, b| b.ms.total_cmp(&a.ms));
        rows
    }

    /// The trace in Chrome's trace-event format (Perfetto and chrome://tracing read it):
    /// process 1 holds one track per device, process 2 one per host thread; every
    /// kernel and span is a complete ("X") event with `ts` and `dur` in microseconds.
    pub fn trace(&self) -> Value {
        let us = |t: Instant| self.at(t) * 1e3;
        let mut events = vec![
            json!({"ph": "M", "pid": 1, "name": "process_name", "args": {"name": "devices"}}),
            json!({"ph": "M", "pid": 2, "name": "process_name", "args": {"name": "host"}}),
        ];
        for (i, d) in self.devices.iter().enumerate() {
            events.push(json!({"ph": "M", "pid": 1, "tid": i, "name": "thread_name",
                               "args": {"name": d.name}}));
            for k in &d.timings {
                events.push(json!({
                    "ph": "X", "pid": 1, "tid": i, "cat": "kernel",
                    "name": k.cost.label,
                    "ts": us(k.start), "dur": k.dur.as_secs_f64() * 1e6,
                    "args": {"kind": k.cost.kind, "flops": k.cost.flops, "bytes": k.cost.bytes},
                }));
            }
        }
        let mut used: Vec<usize> = self.spans.iter().map(|s| s.thread).collect();
        used.sort_unstable();
        used.dedup();
        for t in used {
            let name = self.threads.get(t).map_or("thread", String::as_str);
            events.push(json!({"ph": "M", "pid": 2, "tid": t, "name": "thread_name",
                               "args": {"name": name}}));
        }
        if !self.steps.is_empty() && !self.spans.iter().any(|s| s.thread == self.step_thread) {
            let name = self
                .threads
                .get(self.step_thread)
                .map_or("thread", String::as_str);
            events.push(json!({"ph": "M", "pid": 2, "tid": self.step_thread,
                               "name": "thread_name", "args": {"name": name}}));
        }
        for &(step, start, end) in &self.steps {
            events.push(json!({
                "ph": "X", "pid": 2, "tid": self.step_thread, "cat": "step",
                "name": format!("step {step}"),
                "ts": us(start), "dur": end.saturating_duration_since(start).as_secs_f64() * 1e6,
            }));
        }
        for s in &self.spans {
            events.push(json!({
                "ph": "X", "pid": 2, "tid": s.thread, "cat": s.kind.name(), "name": s.name,
                "ts": us(s.start), "dur": s.end.saturating_duration_since(s.start).as_secs_f64() * 1e6,
            }));
        }
        json!({"traceEvents": events, "displayTimeUnit": "ms"})
    }

    /// The table `kiln train --profile` prints. `peak_flops`: the devices' peak FLOP/s
    /// together, for the MFU.
    pub fn table(&self, peak_flops: Option<f64>) -> String {
        let steps = self.breakdown();
        let n = steps.len().max(1) as f64;
        let step_ms = steps.iter().map(|s| s.total_ms).sum::<f64>() / n;
        let mut out = String::new();
        let _ = writeln!(
            out,
            "per kernel, per step (mean of {} profiled step(s), {:.1} ms each):",
            steps.len(),
            step_ms
        );
        let _ = writeln!(
            out,
            "{:>10} {:>6} {:>8} {:>14}  kernel",
            "ms", "share", "launches", "achieved"
        );
        for r in self.kernels() {
            let secs = r.ms / 1e3;
            // Below ~4 FLOPs per byte a kernel is bound by memory: its GB/s is the
            // figure to compare with `kiln bench peak`.
            let achieved = if secs <= 0.0 {
                "-".to_string()
            } else if r.flops >= 4.0 * r.bytes {
                format!("{:.1} GFLOP/s", r.flops / secs / 1e9)
            } else {
                format!("{:.1} GB/s", r.bytes / secs / 1e9)
            };
            let _ = writeln!(
                out,
                "{:>10.2} {:>5.1}% {:>8.0} {:>14}  {}",
                r.ms / n,
                100.0 * r.ms / n / step_ms.max(1e-9),
                r.launches as f64 / n,
                achieved,
                r.label
            );
        }
        let _ = writeln!(
            out,
            "\nper step (ms): total = compute + transfer/communication + input stall + host work + idle"
        );
        for s in &steps {
            let _ = writeln!(
                out,
                "step {:>5}: {:9.2} = {:9.2} + {:9.2} + {:9.2} + {:9.2} + {:9.2}",
                s.step, s.total_ms, s.compute_ms, s.comm_ms, s.input_ms, s.host_ms, s.idle_ms
            );
        }
        let flops = steps.iter().map(|s| s.flops).sum::<f64>();
        let secs = steps.iter().map(|s| s.total_ms).sum::<f64>() / 1e3;
        if secs > 0.0 && flops > 0.0 {
            let achieved = flops / secs;
            let _ = write!(
                out,
                "\n{:.2} GFLOP per step, {:.2} GFLOP/s achieved",
                flops / n / 1e9,
                achieved / 1e9
            );
            match peak_flops {
                Some(p) if p > 0.0 => {
                    let _ = writeln!(
                        out,
                        ", MFU {:.1}% of {:.1} GFLOP/s peak",
                        100.0 * achieved / p,
                        p / 1e9
                    );
                }
                _ => {
                    let _ = writeln!(
                        out,
                        " (MFU: run `kiln bench peak` once or pass --peak-tflops)"
                    );
                }
            }
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::device::cost::KernelCost;
    use std::time::Duration;

    #[test]
    fn the_parts_of_a_step_add_up_and_compute_wins_over_overlapping_host_work() {
        let epoch = Instant::now();
        let t = |ms: u64| epoch + Duration::from_millis(ms);
        let kernel = |a: u64, b: u64| KernelTiming {
            cost: KernelCost {
                kind: "matmul",
                label: "matmul 2x2x2 NN f32".into(),
                flops: 16.0,
                bytes: 48.0,
            },
            start: t(a),
            dur: Duration::from_millis(b - a),
        };
        let span = |kind, a: u64, b: u64| Span {
            name: "s",
            kind,
            thread: 0,
            start: t(a),
            end: t(b),
        };
        let p = Profile {
            epoch,
            steps: vec![(1, t(0), t(100))],
            step_thread: 0,
            devices: vec![DeviceTrack {
                name: "gpu".into(),
                timings: vec![kernel(20, 50), kernel(45, 60)],
            }],
            // Input 0..10, recording 10..30 (its last 10 ms under compute), a transfer
            // 55..70 (5 ms under compute), nothing 70..100.
            spans: vec![
                span(SpanKind::Input, 0, 10),
                span(SpanKind::Record, 10, 30),
                span(SpanKind::Transfer, 55, 70),
                span(SpanKind::Wait, 60, 100),
            ],
            threads: vec!["main".into()],
        };
        let b = &p.breakdown()[0];
        assert_eq!(b.total_ms, 100.0);
        assert!((b.compute_ms - 40.0).abs() < 1e-9, "{b:?}");
        assert!((b.comm_ms - 10.0).abs() < 1e-9, "{b:?}");
        assert!((b.input_ms - 10.0).abs() < 1e-9, "{b:?}");
        assert!((b.host_ms - 10.0).abs() < 1e-9, "{b:?}");
        assert!((b.idle_ms - 30.0).abs() < 1e-9, "{b:?}");
        assert_eq!(b.flops, 32.0);
        let rows = p.kernels();
        assert_eq!(rows.len(), 1);
        assert_eq!((rows[0].launches, rows[0].ms), (2, 45.0));
    }
}
