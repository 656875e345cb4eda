//! What the profiler collects: kernel timings from a device ([`KernelTiming`], through
//! [`crate::Device::profile_begin`] / [`crate::Device::profile_end`]) and host spans
//! ([`span`]) from any thread, engine and backends alike, on one clock ([`Instant`]).
//!
//! The span recorder is process-wide (one profiled run at a time) and costs one relaxed
//! atomic load per span when it is off, so spans can stay in hot paths.

use std::cell::Cell;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use super::cost::KernelCost;

/// One launch as the device ran it, on the host's clock.
#[derive(Clone, Debug)]
pub struct KernelTiming {
    pub cost: KernelCost,
    pub start: Instant,
    pub dur: Duration,
}

/// What a host span was doing, for the step breakdown.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum SpanKind {
    /// Waiting for or building input batches.
    Input,
    /// Recording launches into the device's stream.
    Record,
    /// Handing recorded work to the device.
    Submit,
    /// Host-staged copies to and from a device.
    Transfer,
    /// Reducing gradients on the host (data parallel).
    Reduce,
    /// The optimizer step's host side.
    Optimizer,
    /// Writing a checkpoint.
    Checkpoint,
    /// Blocked on the device: not work.
    Wait,
    /// A whole training step (the frame the breakdown divides).
    Step,
}

impl SpanKind {
    pub fn name(self) -> &'static str {
        match self {
            SpanKind::Input => "input",
            SpanKind::Record => "record",
            SpanKind::Submit => "submit",
            SpanKind::Transfer => "transfer",
            SpanKind::Reduce => "reduce",
            SpanKind::Optimizer => "optimizer",
            SpanKind::Checkpoint => "checkpoint",
            SpanKind::Wait => "wait",
            SpanKind::Step => "step",
        }
    }
}

/// A finished host span.
#[derive(Clone, Debug)]
pub struct Span {
    pub name: &'static str,
    pub kind: SpanKind,
    /// Index into the thread names [`stop_recording`] returns.
    pub thread: usize,
    pub start: Instant,
    pub end: Instant,
}

static ON: AtomicBool = AtomicBool::new(false);
static SPANS: Mutex<Vec<Span>> = Mutex::new(Vec::new());
static THREADS: Mutex<Vec<String>> = Mutex::new(Vec::new());

thread_local! {
    static THREAD: Cell<Option<usize>> = const { Cell::new(None) };
}

/// This thread's index among the names [`thread_names`] returns.
pub fn thread_index() -> usize {
    THREAD.with(|t| {
        if let Some(i) = t.get() {
            return i;
        }
        let mut names = THREADS.lock().unwrap_or_else(|e| e.into_inner());
        let current = std::thread::current();
        names.push(current.name().unwrap_or("thread").to_string());
        let i = names.len() - 1;
        t.set(Some(i));
        i
    })
}

/// Records the time until it is dropped as a span, when recording is on.
#[must_use = "a span lasts until its guard is dropped"]
pub struct SpanGuard(Option<(&'static str, SpanKind, Instant)>);

impl Drop for SpanGuard {
    fn drop(&mut self) {
        if let Some((name, kind, start)) = self.0.take() {
            let end = Instant::now();
            let thread = thread_index();
            SPANS.lock().unwrap_or_else(|e| e.into_inner()).push(Span {
                name,
                kind,
                thread,
                start,
                end,
            });
        }
    }
}

/// Starts a span named `name`; it ends when the guard is dropped.
pub fn span(name: &'static str, kind: SpanKind) -> SpanGuard {
    if !ON.load(Ordering::Relaxed) {
        return SpanGuard(None);
    }
    SpanGuard(Some((name, kind, Instant::now())))
}

/// Whether spans are being recorded.
pub fn recording() -> bool {
    ON.load(Ordering::Relaxed)
}

/// Starts recording spans (discarding any left from before). False when a recording is
/// already under way in this process: it belongs to someone else.
pub fn start_recording() -> bool {
    if ON.swap(true, Ordering::SeqCst) {
        return false;
    }
    SPANS.lock().unwrap_or_else(|e| e.into_inner()).clear();
    true
}

/// Stops recording; returns the spans and the names of the threads they index.
pub fn stop_recording() -> (Vec<Span>, Vec<String>) {
    ON.store(false, Ordering::SeqCst);
    let spans = std::mem::take(&mut *SPANS.lock().unwrap_or_else(|e| e.into_inner()));
    let threads = THREADS.lock().unwrap_or_else(|e| e.into_inner()).clone();
    (spans, threads)
}

/// The spans recorded so far, leaving recording on.
pub fn take_spans() -> Vec<Span> {
    std::mem::take(&mut *SPANS.lock().unwrap_or_else(|e| e.into_inner()))
}

/// The names of the threads spans were recorded on, by index.
pub fn thread_names() -> Vec<String> {
    THREADS.lock().unwrap_or_else(|e| e.into_inner()).clone()
}
