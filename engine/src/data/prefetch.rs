//! Prefetching loader: worker threads build one rank's micro-batches ahead of the
//! training step into a bounded window; the consumer receives them in the exact
//! deterministic order, whatever the worker count.
//!
//! Micro-batches are numbered `k = 0, 1, 2, ...` from the loader's start. Batch `k` is
//! micro-batch `k % grad_accum` of step `k / grad_accum`, whose samples start at
//! `start_sample + (k / grad_accum) * global_batch` (see [`BatchLayout`]). Workers take
//! the next number, build the batch, and file it under its number; [`Loader::next`]
//! waits for number `consumed` and hands it out. At most `depth` batches are built or
//! being built ahead of the consumer, which bounds memory. The loop never ends: after
//! the last window of an epoch the sampler goes on with the next epoch.

use std::collections::BTreeMap;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use super::{check_source, Batch, BatchLayout, DataError, Result, Sampler, TokenSource};

/// What to load and how far ahead.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LoaderConfig {
    pub layout: BatchLayout,
    /// This process's rank, `< layout.world`.
    pub rank: usize,
    /// The model's vocabulary size: every id read must be below it.
    pub model_vocab: usize,
    /// Global sample counter at the start of the first step: 0 for a new run, the saved
    /// counter ([`Fetched::next_sample`] of the last step done) on resume.
    pub start_sample: u64,
    /// Worker threads (default 2).
    pub workers: usize,
    /// Batches built ahead of the consumer at most (default 4; at least `workers` keeps
    /// every worker busy).
    pub depth: usize,
}

impl LoaderConfig {
    /// Starts at sample 0 with 2 workers and a depth of 4.
    pub fn new(layout: BatchLayout, rank: usize, model_vocab: usize) -> LoaderConfig {
        LoaderConfig {
            layout,
            rank,
            model_vocab,
            start_sample: 0,
            workers: 2,
            depth: 4,
        }
    }
}

/// A micro-batch handed out by [`Loader::next`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Fetched {
    pub batch: Batch,
    /// Time `next` waited for this batch ("input stall").
    pub stall: Duration,
    /// Steps since the loader's start (0-based).
    pub step: u64,
    /// Micro-batch index in its step, `< grad_accum`.
    pub micro: usize,
    /// Global sample counter once this batch's step is done: the value to checkpoint
    /// after that optimizer step (and to pass as `start_sample` to resume).
    pub next_sample: u64,
}

struct State {
    /// Next batch number a worker will build.
    next_job: u64,
    /// Next batch number the consumer will take.
    consumed: u64,
    ready: BTreeMap<u64, Result<Batch>>,
    shutdown: bool,
}

struct Shared {
    state: Mutex<State>,
    changed: Condvar,
}

impl Shared {
    /// Locks the state. A poisoned lock is taken over: the state is only a counter pair
    /// and a map, each update of which is complete before any code that could panic.
    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn wait<'a>(&self, guard: MutexGuard<'a, State>) -> MutexGuard<'a, State> {
        self.changed.wait(guard).unwrap_or_else(|e| e.into_inner())
    }
}

/// What a worker needs to build batch `k`.
struct Job {
    source: Arc<dyn TokenSource>,
    sampler: Sampler,
    config: LoaderConfig,
}

impl Job {
    fn position(&self, k: u64) -> (u64, usize, u64) {
        let accum = self.config.layout.grad_accum as u64;
        let step = k / accum;
        let micro = (k % accum) as usize;
        let step_start = self.config.start_sample + step * self.config.layout.global_batch();
        (step, micro, step_start)
    }

    fn build(&self, k: u64) -> Result<Batch> {
        let (_, micro, step_start) = self.position(k);
        let layout = &self.config.layout;
        let first = layout.first_sample(step_start, micro, self.config.rank)?;
        self.sampler.read_rows(
            self.source.as_ref(),
            first,
            layout.micro_batch,
            self.config.model_vocab,
        )
    }
}

/// Builds batches on worker threads; see the module docs. Dropping it stops and joins
/// the workers (each finishes the batch it is building, if any).
pub struct Loader {
    shared: Arc<Shared>,
    job: Arc<Job>,
    workers: Vec<JoinHandle<()>>,
    /// Set once `next` has returned an error: the loader hands out nothing after it.
    failed: Option<String>,
    total_stall: Duration,
    handed_out: u64,
}

impl Loader {
    /// Starts the workers. Checks the configuration, that `sampler` was made for this
    /// source, that the source holds a row and that its known vocabulary fits the model.
    pub fn new(
        source: Arc<dyn TokenSource>,
        sampler: Sampler,
        config: LoaderConfig,
    ) -> Result<Loader> {
        if config.workers == 0 || config.depth == 0 {
            return Err(DataError::InvalidArgument(format!(
                "data loader: workers ({}) and depth ({}) must be at least 1",
                config.workers, config.depth
            )));
        }
        if config.rank >= config.layout.world {
            return Err(DataError::InvalidArgument(format!(
                "data loader: rank {} is not below the world size {}",
                config.rank, config.layout.world
            )));
        }
        check_source(source.as_ref(), sampler.t(), config.model_vocab)?;
        let windows = source.len() / (sampler.t() as u64 + 1);
        if sampler.windows() != windows {
            return Err(DataError::InvalidArgument(format!(
                "data loader: the sampler was made for a stream of {} windows of T + 1 = {} \
                 tokens, but {} holds {windows}. Make the sampler from this source's length",
                sampler.windows(),
                sampler.t() + 1,
                source.name()
            )));
        }
        let shared = Arc::new(Shared {
            state: Mutex::new(State {
                next_job: 0,
                consumed: 0,
                ready: BTreeMap::new(),
                shutdown: false,
            }),
            changed: Condvar::new(),
        });
        let job = Arc::new(Job {
            source,
            sampler,
            config,
        });
        let mut loader = Loader {
            shared,
            job,
            workers: Vec::with_capacity(config.workers),
            failed: None,
            total_stall: Duration::ZERO,
            handed_out: 0,
        };
        for i in 0..config.workers {
            let (shared, job) = (loader.shared.clone(), loader.job.clone());
            let handle = std::thread::Builder::new()
                .name(format!("kiln-data-{i}"))
                .spawn(move || worker(&shared, &job, config.depth as u64))
                .map_err(|e| {
                    DataError::Loader(format!("could not start worker thread {i}: {e}"))
                })?; // `loader` drops here on error, joining the workers already started
            loader.workers.push(handle);
        }
        Ok(loader)
    }

    /// The next micro-batch in order, with the time spent waiting for it. After an error
    /// (a bad token id, an unreadable file, a worker panic), this and every later call
    /// return an error.
    #[allow(clippy::should_implement_trait)] // not an Iterator: it never ends, it can fail
    pub fn next(&mut self) -> Result<Fetched> {
        if let Some(msg) = &self.failed {
            return Err(DataError::Loader(format!(
                "stopped after an earlier error: {msg}"
            )));
        }
        let start = Instant::now();
        let (k, result) = {
            let mut st = self.shared.lock();
            loop {
                let k = st.consumed;
                if let Some(r) = st.ready.remove(&k) {
                    st.consumed += 1;
                    break (k, r);
                }
                st = self.shared.wait(st);
            }
        };
        self.shared.changed.notify_all(); // a slot in the window is free
        let stall = start.elapsed();
        self.total_stall += stall;
        let batch = result.inspect_err(|e| self.failed = Some(e.to_string()))?;
        self.handed_out += 1;
        let (step, micro, step_start) = self.job.position(k);
        Ok(Fetched {
            batch,
            stall,
            step,
            micro,
            next_sample: step_start + self.job.config.layout.global_batch(),
        })
    }

    /// Sum of the stalls of every batch handed out so far.
    pub fn total_stall(&self) -> Duration {
        self.total_stall
    }

    /// Number of batches handed out so far.
    pub fn handed_out(&self) -> u64 {
        self.handed_out
    }
}

fn worker(shared: &Shared, job: &Job, depth: u64) {
    loop {
        let k = {
            let mut st = shared.lock();
            while !st.shutdown && st.next_job >= st.consumed + depth {
                st = shared.wait(st);
            }
            if st.shutdown {
                return;
            }
            st.next_job += 1;
            st.next_job - 1
        };
        let result = catch_unwind(AssertUnwindSafe(|| job.build(k))).unwrap_or_else(|panic| {
            let msg = panic
                .downcast_ref::<&str>()
                .map(|s| s.to_string())
                .or_else(|| panic.downcast_ref::<String>().cloned())
                .unwrap_or_else(|| "unknown panic".into());
            Err(DataError::Loader(format!(
                "a worker panicked building batch {k}: {msg}"
            )))
        });
        shared.lock().ready.insert(k, result);
        shared.changed.notify_all();
    }
}

impl Drop for Loader {
    fn drop(&mut self) {
        self.shared.lock().shutdown = true;
        self.shared.changed.notify_all();
        for w in self.workers.drain(..) {
            let _ = w.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::data::MemorySource;

    /// A source that sleeps on every read (a fixed delay, or 0, 5 or 10 ms picked by the read
    /// position when `jitter`, so that concurrent workers finish out of order), or panics.
    struct Slow {
        inner: MemorySource,
        delay: Duration,
        jitter: bool,
        panic: bool,
    }

    impl TokenSource for Slow {
        fn len(&self) -> u64 {
            self.inner.len()
        }
        fn read(&self, start: u64, out: &mut [u32]) -> Result<()> {
            assert!(!self.panic, "the test source panics");
            let delay = if self.jitter {
                Duration::from_millis(5 * (crate::data::hash(&[start]) % 3))
            } else {
                self.delay
            };
            std::thread::sleep(delay);
            self.inner.read(start, out)
        }
        fn vocab_hint(&self) -> Option<usize> {
            None
        }
        fn name(&self) -> String {
            "slow".into()
        }
    }

    fn counting(n: u32) -> Arc<dyn TokenSource> {
        Arc::new(MemorySource::new("count", (0..n).collect(), None))
    }

    fn slow(n: u32, delay_ms: u64, panic: bool) -> Arc<dyn TokenSource> {
        Arc::new(Slow {
            inner: MemorySource::new("count", (0..n).collect(), None),
            delay: Duration::from_millis(delay_ms),
            jitter: false,
            panic,
        })
    }

    fn config(workers: usize, depth: usize, start: u64) -> LoaderConfig {
        LoaderConfig {
            workers,
            depth,
            start_sample: start,
            ..LoaderConfig::new(BatchLayout::new(3, 2, 2).unwrap(), 1, 4000)
        }
    }

    fn collect(loader: &mut Loader, n: usize) -> Vec<Fetched> {
        (0..n).map(|_| loader.next().unwrap()).collect()
    }

    #[test]
    fn order_is_the_same_for_any_worker_count_and_matches_the_sampler() {
        let src = counting(4000);
        let jittery: Arc<dyn TokenSource> = Arc::new(Slow {
            inner: MemorySource::new("count", (0..4000).collect(), None),
            delay: Duration::ZERO,
            jitter: true,
            panic: false,
        });
        let sampler = Sampler::new(src.len(), 15, 3).unwrap(); // 250 windows
        let one = collect(
            &mut Loader::new(src.clone(), sampler, config(1, 1, 0)).unwrap(),
            30,
        );
        // Three workers whose batches take 0-30 ms each finish out of order; the loader
        // must still hand them out in order.
        let three = collect(
            &mut Loader::new(jittery, sampler, config(3, 5, 0)).unwrap(),
            30,
        );
        let layout = config(1, 1, 0).layout;
        for (k, (a, b)) in one.iter().zip(&three).enumerate() {
            assert_eq!(a.batch, b.batch, "batch {k}");
            assert_eq!((a.step, a.micro), ((k / 2) as u64, k % 2));
            let want = sampler
                .batch(src.as_ref(), &layout, a.step, a.micro, 1, 4000)
                .unwrap();
            assert_eq!(a.batch, want);
            assert_eq!(a.next_sample, (a.step + 1) * 12);
        }
    }

    #[test]
    fn resumes_from_a_saved_counter() {
        let src = counting(4000);
        let sampler = Sampler::new(src.len(), 15, 3).unwrap();
        let full = collect(
            &mut Loader::new(src.clone(), sampler, config(2, 4, 0)).unwrap(),
            20,
        );
        // Checkpoint after step 4 (batches 0..10): the counter is batch 9's next_sample.
        let counter = full[9].next_sample;
        let mut resumed = Loader::new(src, sampler, config(2, 4, counter)).unwrap();
        for want in &full[10..] {
            assert_eq!(resumed.next().unwrap().batch, want.batch);
        }
    }

    #[test]
    fn fast_workers_hide_a_slow_step() {
        let src = counting(4000);
        let sampler = Sampler::new(src.len(), 15, 3).unwrap();
        let mut loader = Loader::new(src, sampler, config(2, 4, 0)).unwrap();
        let first = loader.next().unwrap().stall;
        let steps = 10;
        let mut stall = Duration::ZERO;
        for _ in 0..steps {
            std::thread::sleep(Duration::from_millis(20)); // the "training step"
            stall += loader.next().unwrap().stall;
        }
        let avg = stall / steps;
        assert!(avg < Duration::from_millis(5), "average stall {avg:?}");
        assert_eq!(loader.total_stall(), first + stall);
        assert_eq!(loader.handed_out(), 11);
    }

    #[test]
    fn slow_workers_show_as_stall() {
        // 3 rows of 10 ms each: ~30 ms per batch on one worker, the consumer takes none.
        let src = slow(4000, 10, false);
        let sampler = Sampler::new(src.len(), 15, 3).unwrap();
        let mut loader = Loader::new(src, sampler, config(1, 2, 0)).unwrap();
        for _ in 0..5 {
            loader.next().unwrap();
        }
        assert!(
            loader.total_stall() >= Duration::from_millis(100),
            "{:?}",
            loader.total_stall()
        );
    }

    #[test]
    fn a_bad_token_is_an_error_in_order_then_the_loader_stays_failed() {
        let mut tokens: Vec<u32> = (0..4000).map(|i| i % 100).collect();
        tokens[2345] = 5000; // >= the model's vocab of 4000
        let src: Arc<dyn TokenSource> = Arc::new(MemorySource::new("bad", tokens, None));
        let sampler = Sampler::new(src.len(), 15, 3).unwrap();
        let layout = config(1, 1, 0).layout;
        // The first batch (in this rank's order) that reads the bad window.
        let bad = (0u64..)
            .find(|&k| {
                sampler
                    .batch(src.as_ref(), &layout, k / 2, (k % 2) as usize, 1, 4000)
                    .is_err()
            })
            .unwrap();
        let mut loader = Loader::new(src, sampler, config(3, 4, 0)).unwrap();
        for _ in 0..bad {
            loader.next().unwrap();
        }
        let e = loader.next().unwrap_err().to_string();
        assert!(e.contains("bad") && e.contains("token id 5000"), "{e}");
        let e = loader.next().unwrap_err().to_string();
        assert!(e.contains("earlier error") && e.contains("5000"), "{e}");
    }

    #[test]
    fn a_worker_panic_is_an_error_not_a_hang() {
        let src = slow(4000, 0, true);
        let sampler = Sampler::new(src.len(), 15, 3).unwrap();
        let mut loader = Loader::new(src, sampler, config(2, 2, 0)).unwrap();
        let e = loader.next().unwrap_err().to_string();
        assert!(
            e.contains("panicked") && e.contains("test source panics"),
            "{e}"
        );
    }

    #[test]
    fn drop_joins_the_workers_promptly() {
        let src = slow(4000, 20, false);
        let sampler = Sampler::new(src.len(), 15, 3).unwrap();
        // Dropped at once, and dropped with full queues and workers blocked on the window.
        let t0 = Instant::now();
        drop(Loader::new(src.clone(), sampler, config(3, 3, 0)).unwrap());
        let mut loader = Loader::new(src, sampler, config(3, 3, 0)).unwrap();
        loader.next().unwrap();
        std::thread::sleep(Duration::from_millis(300));
        drop(loader);
        // Each worker finishes at most one batch (3 reads of 20 ms) after shutdown.
        assert!(t0.elapsed() < Duration::from_secs(3), "{:?}", t0.elapsed());
    }

    #[test]
    fn bad_configurations_are_refused() {
        let src = counting(100);
        let sampler = Sampler::new(100, 15, 0).unwrap();
        assert!(Loader::new(src.clone(), sampler, config(0, 1, 0)).is_err());
        assert!(Loader::new(src.clone(), sampler, config(1, 0, 0)).is_err());
        let mut c = config(1, 1, 0);
        c.rank = 2;
        assert!(Loader::new(src.clone(), sampler, c).is_err());
        let other = Sampler::new(50, 15, 0).unwrap();
        let e = Loader::new(src.clone(), other, config(1, 1, 0))
            .err()
            .unwrap()
            .to_string();
        assert!(e.contains("sampler was made"), "{e}");
        // A memory source without a vocabulary hint passes the up-front check with a
        // model vocabulary of 10; its ids up to 99 are caught by the first batch.
        let small_vocab = LoaderConfig::new(config(1, 1, 0).layout, 0, 10);
        let mut loader = Loader::new(src, sampler, small_vocab).unwrap();
        let e = loader.next().unwrap_err().to_string();
        assert!(
            e.contains("count") && e.contains("vocabulary size 10"),
            "{e}"
        );
    }
}
