//! Progress of kernel compilation, process-wide: a backend adds the pipelines it is
//! about to compile and counts each one done, so that a front end can show
//! "compiling kernels (n/N)" while a first step waits for them (minutes on a software
//! renderer) instead of a silent wait. Counters only grow; a reader compares two
//! snapshots, so concurrent devices simply add up.

use std::sync::atomic::{AtomicUsize, Ordering};

/// `KILN_COMPILE_LOG=1`: backends say what each pipeline build (and each priming or
/// GEMM block measurement) took. Read once per process.
pub fn log_enabled() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| std::env::var_os("KILN_COMPILE_LOG").is_some_and(|v| v != "0"))
}

static QUEUED: AtomicUsize = AtomicUsize::new(0);
static DONE: AtomicUsize = AtomicUsize::new(0);

/// `n` more pipelines are about to be compiled.
pub fn queued(n: usize) {
    QUEUED.fetch_add(n, Ordering::Relaxed);
}

/// One queued pipeline is compiled (or failed: it is no longer waited for).
pub fn finished() {
    DONE.fetch_add(1, Ordering::Relaxed);
}

/// (compiled, queued) since the process started.
pub fn snapshot() -> (usize, usize) {
    // Done first: a reader never sees more done than queued.
    let done = DONE.load(Ordering::Relaxed);
    (done, QUEUED.load(Ordering::Relaxed).max(done))
}
