//! Big kernels' first run on a second device (lavapipe), as the wgpu backend does
//! (kiln-wgpu's `primer.rs` says why): lavapipe compiles a pipeline's machine code at
//! its first run, on the one thread that runs the device's queue, and keeps it in
//! Mesa's disk cache keyed by the shader. A 32- or 64-row block of
//! `shaders/vulkan/matmul_cpu.comp`, or a pass of `attention.comp` with 8 rows per
//! lane, takes tens of seconds there on a cold cache, and every launch queued behind
//! it waits. So a worker thread opens a device of its own on the same physical device,
//! opened alike (the driver must see the same shader), and runs each such kernel
//! there once on small operands; meanwhile the training device runs a stand-in (a
//! smaller GEMM block, `kiln_lowering::gemm_stand_in`; attention with one row per lane),
//! which sums every output in the same order (a causal stand-in also skips key blocks
//! wholly past its rows, which only add exact zeros), so not a bit changes. Once primed, the kernel's first run on the training device finds its
//! machine code in the cache.

use std::collections::HashMap;
use std::sync::{mpsc, Arc, Condvar, Mutex, MutexGuard, Weak};

use kiln_engine::DType;
use kiln_lowering::{AttentionPlan, DeviceOptions};

use crate::gemm::SpirvGemmPlan;
use kiln_engine::device::compiling::{self, log_enabled as compile_log};

/// The device the worker runs blocks on: `vk:index` opened without a primer of its
/// own (the device module implements it, so this file need not know the device).
pub(crate) trait PrimeOn: Send {
    /// Runs `job`'s block once, so that the driver's cache holds its machine code.
    fn run_once(&self, job: &Job) -> kiln_engine::Result<()>;
}

/// Opens the worker's device for `vk:index` with the options.
pub(crate) type OpenPrimeDevice =
    fn(usize, &DeviceOptions) -> kiln_engine::Result<Box<dyn PrimeOn>>;

/// Where a block's priming stands.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Primed {
    /// Waiting for the worker, or running there.
    Queued,
    /// Run once on the primer's device: its machine code is in Mesa's cache.
    Done,
    /// The primer could not run it (the reason was logged): the training device
    /// compiles it at its own first run, as without a primer.
    Failed,
}

/// What is primed: a GEMM block (its pipeline key), or the attention passes of one
/// kind of kernel (their pipelines' names).
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub(crate) enum Block {
    Gemm(SpirvGemmPlan),
    Attention(String),
}

/// An attention kernel to run once: its direction, its buffers' types (in
/// `Kernel::buffers` order), query heads per K/V head, head dim and the training
/// device's plan; the primer sizes the rest.
#[derive(Clone, Debug)]
pub(crate) struct AttentionRecipe {
    pub backward: bool,
    pub dtypes: Vec<DType>,
    pub group: usize,
    pub dim: usize,
    pub causal: bool,
    pub plan: AttentionPlan,
}

/// One block to prime.
pub(crate) struct Job {
    pub block: Block,
    /// For `Block::Attention`: the kernel that runs its passes.
    pub attention: Option<AttentionRecipe>,
}

impl Block {
    fn describe(&self) -> String {
        match self {
            Block::Gemm(p) => format!("GEMM block TM={} NV={}", p.tm, p.nv),
            Block::Attention(names) => format!("attention passes {names}"),
        }
    }
}

#[derive(Default)]
struct Blocks {
    state: HashMap<Block, Primed>,
    /// Tests hold the worker to see the stand-in run (`VkDevice::hold_primer`).
    held: bool,
    /// Its last device is gone: blocks still queued are dropped, not compiled.
    closing: bool,
}

#[derive(Default)]
struct Shared {
    blocks: Mutex<Blocks>,
    changed: Condvar,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, Blocks> {
        self.blocks.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// The worker and what it has primed. Dropping it drops the blocks still queued and
/// joins the worker, which first finishes the block it is running (up to tens of
/// seconds on a cold cache), as the wgpu backend waits for its compile workers: a
/// process must not exit while a thread is inside lavapipe's LLVM, which tears itself
/// down at exit under the running thread ("LLVM ERROR: Do not know how to split the
/// result of this operator!", an abort after every test of a binary had passed).
pub(crate) struct Primer {
    jobs: Mutex<Option<mpsc::Sender<Job>>>,
    worker: Mutex<Option<std::thread::JoinHandle<()>>>,
    shared: Arc<Shared>,
}

/// The primers alive, per physical device and f16 setting (what changes the shaders
/// the driver sees): the devices of a data-parallel group on one physical device share
/// one, so each block is compiled once, not once per device.
static PRIMERS: Mutex<Vec<(PrimerKey, Weak<Primer>)>> = Mutex::new(Vec::new());

/// A physical device's index and whether f16 is turned off on it.
type PrimerKey = (usize, bool);

impl Primer {
    /// The primer of `vk:index` opened with `options`: a live one shared, else a new
    /// one started.
    pub(crate) fn shared(
        index: usize,
        options: &DeviceOptions,
        open: OpenPrimeDevice,
    ) -> Arc<Primer> {
        let key = (index, options.disable_f16);
        let mut primers = PRIMERS.lock().unwrap_or_else(|e| e.into_inner());
        primers.retain(|(_, p)| p.strong_count() > 0);
        if let Some(p) = primers
            .iter()
            .find(|(k, _)| *k == key)
            .and_then(|(_, p)| p.upgrade())
        {
            return p;
        }
        let p = Arc::new(Primer::start(index, options, open));
        primers.push((key, Arc::downgrade(&p)));
        p
    }

    /// Starts the worker; it opens `vk:index` with `options` (without a primer of its
    /// own) at its first block, off the caller's thread.
    fn start(index: usize, options: &DeviceOptions, open: OpenPrimeDevice) -> Primer {
        let (tx, rx) = mpsc::channel::<Job>();
        let shared = Arc::new(Shared::default());
        let worker = Arc::clone(&shared);
        let options = DeviceOptions {
            // The training device keeps the pipeline cache; Mesa's cache is what
            // carries the machine code across.
            no_pipeline_cache: true,
            ..options.clone()
        };
        let spawned = std::thread::Builder::new()
            .name("kiln vk primer".into())
            .spawn(move || {
                // Opened at the first block: most devices never meet a big one.
                let mut device = None;
                for job in rx {
                    let mut blocks = worker.lock();
                    while blocks.held && !blocks.closing {
                        blocks = worker
                            .changed
                            .wait(blocks)
                            .unwrap_or_else(|e| e.into_inner());
                    }
                    if blocks.closing {
                        break;
                    }
                    drop(blocks);
                    let t0 = std::time::Instant::now();
                    let device = device.get_or_insert_with(|| open(index, &options));
                    let result = match device {
                        // A panic there must not leave the block queued for ever
                        // (launches would run its stand-in, and waits never end).
                        Ok(d) => std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                            d.run_once(&job).map_err(|e| e.to_string())
                        }))
                        .unwrap_or_else(|_| Err("the primer panicked".into())),
                        Err(e) => Err(format!("could not open the primer's device: {e}")),
                    };
                    let primed = match result {
                        Ok(()) => {
                            if compile_log() {
                                eprintln!(
                                    "kiln: vk primed {}: {:.2} s",
                                    job.block.describe(),
                                    t0.elapsed().as_secs_f64()
                                );
                            }
                            Primed::Done
                        }
                        Err(why) => {
                            // Only time is at stake: the block compiles at its first
                            // run on the training device instead.
                            eprintln!(
                                "kiln: vk could not prime {}, so its first run compiles it \
                                 on the training device: {why}",
                                job.block.describe()
                            );
                            Primed::Failed
                        }
                    };
                    // Counted before the state changes, so that whoever sees the
                    // block primed sees the count too.
                    compiling::finished();
                    let mut blocks = worker.lock();
                    blocks.state.insert(job.block, primed);
                    drop(blocks);
                    worker.changed.notify_all();
                }
            });
        let spawned = match spawned {
            Ok(handle) => Ok(Some(handle)),
            Err(e) => Err(e),
        };
        if let Err(e) = &spawned {
            eprintln!(
                "kiln: vk could not start the primer thread ({e}); big GEMM blocks and \
                 attention passes compile at their first run"
            );
            // The receiver is gone with the closure: every `ask` finds the channel
            // closed and marks its block failed.
        }
        Primer {
            jobs: Mutex::new(Some(tx)),
            worker: Mutex::new(spawned.unwrap_or(None)),
            shared,
        }
    }

    /// Where `plan`'s priming stands; `None` if nobody asked for it.
    pub(crate) fn state(&self, block: &Block) -> Option<Primed> {
        self.shared.lock().state.get(block).copied()
    }

    /// Queues `job` for priming unless its block was asked for before.
    pub(crate) fn ask(&self, job: Job) {
        let mut blocks = self.shared.lock();
        if blocks.state.contains_key(&job.block) {
            return;
        }
        let block = job.block.clone();
        let sent = match &*self.jobs.lock().unwrap_or_else(|e| e.into_inner()) {
            Some(jobs) => jobs.send(job).is_ok(),
            None => false,
        };
        // A queued block is a pipeline being compiled, as the backends count theirs:
        // `kiln bench` waits for the count before it times (else it times stand-ins)
        // and training shows it during the first step.
        if sent {
            compiling::queued(1);
        }
        let state = if sent { Primed::Queued } else { Primed::Failed };
        blocks.state.insert(block, state);
    }

    /// Blocks (GEMM blocks, attention kernels) the primer has run so far. (for the test hooks)
    #[cfg_attr(not(feature = "test-hooks"), allow(dead_code))]
    pub(crate) fn primed(&self) -> usize {
        let blocks = self.shared.lock();
        blocks
            .state
            .values()
            .filter(|&&p| p == Primed::Done)
            .count()
    }

    /// Waits until no block is queued. (for the test hooks)
    #[cfg_attr(not(feature = "test-hooks"), allow(dead_code))]
    pub(crate) fn wait_idle(&self) {
        let mut blocks = self.shared.lock();
        while blocks.state.values().any(|&p| p == Primed::Queued) {
            blocks = self
                .shared
                .changed
                .wait(blocks)
                .unwrap_or_else(|e| e.into_inner());
        }
    }

    /// Holds the worker before its next block (`true`) or lets it go on.
    pub(crate) fn hold(&self, held: bool) {
        self.shared.lock().held = held;
        self.shared.changed.notify_all();
    }
}

impl Drop for Primer {
    fn drop(&mut self) {
        let mut blocks = self.shared.lock();
        blocks.closing = true;
        blocks.held = false;
        drop(blocks);
        self.shared.changed.notify_all();
        // The channel closes: an idle worker wakes and ends, a busy one ends after its
        // block.
        drop(self.jobs.lock().unwrap_or_else(|e| e.into_inner()).take());
        let worker = self.worker.lock().unwrap_or_else(|e| e.into_inner()).take();
        if let Some(worker) = worker {
            let _ = worker.join();
        }
        // Blocks the worker never reached are no longer being compiled.
        let blocks = self.shared.lock();
        let left = blocks.state.values().filter(|&&p| p == Primed::Queued);
        let left = left.count();
        drop(blocks);
        for _ in 0..left {
            compiling::finished();
        }
    }
}
