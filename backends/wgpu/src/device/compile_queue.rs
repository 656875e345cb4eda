//! A plan's pipelines built ahead on worker threads (`Device::prepare`): finding the
//! missing ones, the compile queue and its workers, slow GEMM and attention blocks
//! behind stand-ins with their first run on the primer's device, and taking what the
//! workers built.

use super::open::device_descriptor;
use super::pipelines::{build, layout_entries, log_compile};
use super::*;

/// A pipeline that takes seconds to build and to first run on a software driver, and
/// has a stand-in meanwhile: a CPU-class GEMM block of 16 rows and up
/// (`matmul::stand_in`), or a fused attention pass with several rows per lane (one row
/// per lane stands in, `attention::stand_in`).
fn slow_block(key: &PipelineKey) -> bool {
    let has =
        |name: &str, at_least: u32| key.consts.iter().any(|&(c, v)| c == name && v >= at_least);
    (key.name.starts_with("matmul_cpu") && has("TM", kiln_lowering::SLOW_ROWS))
        || (key.name.starts_with("attention") && has("R", 2))
}

/// Where a pipeline goes in the compile queue: 0 for the step's own, then the slow
/// ones (see [`slow_block`]) from the quickest to build and first run: 16-row GEMM
/// blocks, attention passes, 32-row and 64-row blocks.
fn slow_rank(key: &PipelineKey) -> u32 {
    if !slow_block(key) {
        return 0;
    }
    let tm = key
        .consts
        .iter()
        .find(|&&(c, _)| c == "TM")
        .map(|&(_, v)| v);
    match tm {
        Some(16) => 1,
        None => 2,
        Some(tm) => 2 + tm / 32,
    }
}

/// Worker threads that compile a plan's pipelines: one per core unless
/// `KILN_COMPILE_THREADS` says otherwise (1: one after another, as before).
fn compile_threads() -> usize {
    std::env::var("KILN_COMPILE_THREADS")
        .ok()
        .and_then(|v| v.parse().ok())
        .filter(|&n: &usize| n > 0)
        .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get()))
}

impl WgpuDevice {
    /// The pipelines `kernels` need that are not built yet, found by recording them
    /// into a scratch encoder that is dropped unsubmitted (copies included), with the
    /// parameter arena restored: nothing runs and the open stream is untouched.
    pub(super) fn missing_pipelines(
        &self,
        s: &mut State,
        kernels: &[Kernel],
    ) -> Result<Vec<Wanted>> {
        let stream = s.encoder.take();
        let params = s.params.len();
        s.collect = Some(vec![]);
        let mut result = Ok(());
        for k in kernels {
            result = k
                .validate()
                .and_then(|()| self.check_live(s, k.name(), &k.buffers()))
                .and_then(|()| kiln_lowering::record_kernel(self, s, k));
            if result.is_err() {
                break;
            }
        }
        let wanted = s.collect.take().unwrap_or_default();
        s.encoder = stream;
        s.params.truncate(params);
        result.map(|()| wanted)
    }

    /// Starts building `wanted` on worker threads (one per core, `KILN_COMPILE_THREADS`
    /// to override) in launch order, and returns: a dispatch that needs one of them
    /// waits for it alone, so the first launches run — and a software driver compiles
    /// their machine code on its queue thread — while later pipelines still build.
    pub(super) fn compile_all(&self, s: &mut State, wanted: Vec<Wanted>) -> Result<()> {
        if wanted.is_empty() {
            return Ok(());
        }
        for w in &wanted {
            self.check_kernel(w.kernel)?;
        }
        if self.context.is_some() {
            // GL: one thread at a time in the context (`context.rs`), so the pipelines
            // build here, in launch order, before the step that needs them.
            compiling::queued(wanted.len());
            for w in wanted {
                let t = std::time::Instant::now();
                let built = self.pipeline(s, &w.key, w.kernel);
                compiling::finished();
                log_compile("built", &w.key, t);
                built?;
            }
            return Ok(());
        }
        // A software driver compiles in two halves, each counted: the pipeline's
        // creation (its IR passes; on the workers) and its first run (machine code).
        let compiles_on_first_run = self.caps.device_type == "cpu";
        compiling::queued(wanted.len() * if compiles_on_first_run { 2 } else { 1 });
        // Modules and layouts need the state; they are cheap next to the driver's
        // compile, which happens in the workers.
        // GEMM blocks that take seconds to build (32 rows and up) and attention passes
        // with several rows per lane get a stand-in while they build
        // (`matmul::stand_in`, `attention::stand_in`, built ahead here), so they are off the
        // critical path: they build last, and every worker takes launch order, so the
        // step's own pipelines are ready first and the big blocks build while it runs.
        // Their first run, which compiles their machine code, happens on the primer's
        // device as part of their build, not on this device's queue.
        // Without stand-ins (no subgroups: no big blocks either), worker 0 takes the
        // costliest pipeline left, as those are the critical path then.
        let stand_ins = self.caps.subgroup_sizes.is_some() && compiles_on_first_run;
        let jobs: Vec<Job> = wanted
            .into_iter()
            .map(|w| {
                s.building.insert(w.key.clone());
                if compiles_on_first_run {
                    s.first_runs.insert(w.key.clone());
                }
                let source = shader::assemble(w.kernel, &w.key.reprs, &w.key.consts);
                let prime = (stand_ins && slow_block(&w.key))
                    .then(|| self.primer())
                    .flatten()
                    .map(|primer| {
                        let accesses: Vec<Access> =
                            w.kernel.slots.iter().map(|slot| slot.access).collect();
                        let prime = Prime {
                            entries: layout_entries(&accesses, w.kernel.params_size),
                            params_size: w.kernel.params_size,
                            trusted: w.kernel.trusted,
                            constants: w.key.constants(),
                            source: source.clone(),
                        };
                        (primer, prime)
                    });
                Job {
                    cost: source.len(),
                    module: self.module(s, &w.key, w.kernel),
                    layout: self.layout(s, w.kernel).1.clone(),
                    key: w.key,
                    prime,
                }
            })
            .collect();
        let mut jobs = jobs;
        let threads = compile_threads().min(jobs.len()).max(1);
        if stand_ins {
            // The slow ones last, cheapest first: a 16-row block is the stand-in of the
            // bigger ones and takes a second or two, a 64-row one half a minute.
            jobs.sort_by_key(|j| slow_rank(&j.key));
        }
        let queue = Arc::new(Mutex::new(jobs));
        {
            let mut queues = self
                .compile_queues
                .lock()
                .unwrap_or_else(|e| e.into_inner());
            queues.retain(|q| q.strong_count() > 0);
            queues.push(Arc::downgrade(&queue));
        }
        for worker in 0..threads {
            let (mine, built) = (queue.clone(), self.built.clone());
            let busy = self.busy.clone();
            let (primed_keys, slow_lane) = (self.primed_keys.clone(), self.slow_lane.clone());
            let device = self.device.clone();
            let cache = self.disk_cache.clone();
            let spawned = std::thread::Builder::new()
                .name("kiln-compile".into())
                .spawn(move || loop {
                    let job = {
                        let mut q = mine.lock().unwrap_or_else(|e| e.into_inner());
                        let pick = if worker == 0 && threads > 1 && !stand_ins {
                            (0..q.len()).max_by_key(|&i| (q[i].cost, std::cmp::Reverse(i)))
                        } else if stand_ins
                            && worker > 0
                            && q.first().is_some_and(|j| slow_block(&j.key))
                        {
                            // The big blocks (last in the queue) build one at a time on
                            // worker 0, so the step running their stand-ins keeps a core.
                            None
                        } else {
                            (!q.is_empty()).then_some(0)
                        };
                        match pick {
                            Some(i) => {
                                // Counted while the queue is locked, so that a drop that
                                // empties the queue then waits for this job.
                                *busy.0.lock().unwrap_or_else(|e| e.into_inner()) += 1;
                                q.remove(i)
                            }
                            None => return,
                        }
                    };
                    let _done = Finished(&busy);
                    // One big block at a time on the device, whichever `compile_all`
                    // asked for it (a measurement may ask for one during the step).
                    let _lane = (stand_ins && slow_block(&job.key))
                        .then(|| slow_lane.lock().unwrap_or_else(|e| e.into_inner()));
                    if let Some((primer, prime)) = &job.prime {
                        let t = std::time::Instant::now();
                        // Only time is at stake: where it fails, this device's first
                        // run compiles the block, as without a primer.
                        match std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                            primer.run_once(prime)
                        })) {
                            Ok(Ok(())) => {
                                primed_keys
                                    .lock()
                                    .unwrap_or_else(|e| e.into_inner())
                                    .insert(job.key.clone());
                                log_compile("first run (primer) of", &job.key, t)
                            }
                            Ok(Err(e)) => {
                                log_compile(&format!("priming failed ({e})"), &job.key, t)
                            }
                            Err(_) => log_compile("priming panicked", &job.key, t),
                        }
                    }
                    let t = std::time::Instant::now();
                    // A dispatch waits for this result: a panic must become an error,
                    // not a wait that never ends.
                    let p = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                        build(
                            &device,
                            cache.as_deref(),
                            &job.key,
                            &job.module,
                            &job.layout,
                        )
                    }))
                    .unwrap_or_else(|_| Err("the driver panicked while building it".into()));
                    log_compile("built", &job.key, t);
                    compiling::finished();
                    let (ready, cv) = &*built;
                    ready
                        .lock()
                        .unwrap_or_else(|e| e.into_inner())
                        .insert(job.key.clone(), p);
                    cv.notify_all();
                });
            if let Err(e) = spawned {
                if worker == 0 {
                    // Nobody builds them: they compile on first use, as without
                    // `prepare`.
                    let q = queue.lock().unwrap_or_else(|e| e.into_inner());
                    for job in q.iter() {
                        s.building.remove(&job.key);
                        s.first_runs.remove(&job.key);
                    }
                }
                return Err(self.backend_error(format!("could not start a compile thread: {e}")));
            }
        }
        Ok(())
    }

    /// The second device big GEMM blocks first run on (software drivers with Mesa's
    /// shader cache on), opened at first need.
    fn primer(&self) -> Option<Arc<Primer>> {
        self.primer
            .get_or_init(|| {
                if !mesa_cache_on() {
                    return None;
                }
                let desc = device_descriptor(self.features, &self.limits);
                Primer::open(&self.adapter, &desc).map(Arc::new)
            })
            .clone()
    }

    /// Takes a pipeline the workers build, waiting for it if it is not ready yet.
    pub(super) fn take_built(&self, s: &mut State, key: &PipelineKey) -> Result<()> {
        let (ready, cv) = &**self.built;
        let mut done = ready.lock().unwrap_or_else(|e| e.into_inner());
        let result = loop {
            if let Some(r) = done.remove(key) {
                break r;
            }
            done = cv.wait(done).unwrap_or_else(|e| e.into_inner());
        };
        drop(done);
        s.building.remove(key);
        let pipeline = result.map_err(|e| {
            s.first_runs.remove(key);
            self.backend_error(format!("kernel {} failed to build: {e}", key.name))
        })?;
        s.pipelines.insert(key.clone(), pipeline);
        if s.building.is_empty() {
            if let Some(c) = &self.disk_cache {
                c.save();
            }
        }
        Ok(())
    }

    /// GEMM and attention launches so far that ran a stand-in (a smaller CPU block, one
    /// attention row per lane: same results) because their own was still building on
    /// a compile worker.
    pub fn stand_in_launches(&self) -> u64 {
        self.lock().stand_ins
    }

    /// Whether big GEMM blocks first run on a primer (see `primer.rs`): a software
    /// driver whose big blocks build behind stand-ins, with Mesa's cache on.
    pub(crate) fn primes_big_blocks(&self) -> bool {
        self.caps.subgroup_sizes.is_some()
            && self.caps.device_type == "cpu"
            && self.primer().is_some()
    }

    /// Starts building `d`'s pipeline on a compile worker, unless it is built or
    /// building: for a block the GEMM selection will time once it is built.
    pub(crate) fn build_in_background(&self, s: &mut State, d: Dispatch) -> Result<()> {
        let key = PipelineKey {
            name: d.kernel.name,
            reprs: d.reprs,
            consts: d.consts,
            overrides: d.overrides,
        };
        if s.pipelines.contains_key(&key) || s.building.contains(&key) {
            return Ok(());
        }
        if compile_log() {
            eprintln!(
                "kiln: building {} {:?} in the background to measure it",
                key.name, key.consts
            );
        }
        self.compile_all(
            s,
            vec![Wanted {
                key,
                kernel: d.kernel,
            }],
        )
    }

    /// Holds the primer before its next first run (`true`), or lets it go on: tests see
    /// launches run stand-ins meanwhile. The primer opens if it has not yet.
    #[doc(hidden)]
    pub fn hold_primer(&self, held: bool) {
        if let Some(p) = self.primer() {
            p.hold(held);
        }
    }

    /// Pipelines whose first run (a software driver's machine code) happened on the
    /// primer's device rather than this one's queue (see `primer.rs`).
    pub fn primed_pipelines(&self) -> u64 {
        self.primer
            .get()
            .and_then(Option::as_ref)
            .map_or(0, |p| p.primed.load(std::sync::atomic::Ordering::Relaxed))
    }

    /// Waits until the compile workers have built every pipeline they were given.
    pub fn wait_for_builds(&self) {
        let (ready, cv) = &**self.built;
        loop {
            // The state's lock before the workers' results, as `take_built` takes them;
            // a launch on another thread may take a result meanwhile, so look again.
            let s = self.lock();
            let done = ready.lock().unwrap_or_else(|e| e.into_inner());
            if s.building.iter().all(|k| done.contains_key(k)) {
                return;
            }
            drop(s);
            let wait = std::time::Duration::from_millis(100);
            drop(cv.wait_timeout(done, wait));
        }
    }
}

/// Counts a compile job finished when the worker leaves it, also by a panic.
struct Finished<'a>(&'a (Mutex<usize>, std::sync::Condvar));

impl Drop for Finished<'_> {
    fn drop(&mut self) {
        *self.0 .0.lock().unwrap_or_else(|e| e.into_inner()) -= 1;
        self.0 .1.notify_all();
    }
}
