//! What `kiln train` is told ([`TrainOptions`]) and what it reports ([`RunReport`]),
//! and the built-in demo it trains when told nothing.

use std::path::PathBuf;
use std::sync::atomic::AtomicBool;
use std::sync::Arc;

use kiln_engine::parallel::collective::Collective;
use kiln_engine::train::runs::Summary;

/// The demo's DeepSpeed config and model, used when `--config` / `--model` are absent.
pub const DEMO_DS_CONFIG: &str = include_str!("../../demos/addition.ds_config.json");
pub const DEMO_MODEL: &str = include_str!("../../demos/addition.model.json");

/// Everything `kiln train` can be told. The `Option`s override the config's `kiln`
/// section when set (command-line flags); unset, the config (or its default) decides.
#[derive(Clone, Debug, Default)]
pub struct TrainOptions {
    /// DeepSpeed config file; `None`: the demo config.
    pub config: Option<PathBuf>,
    /// Model sizes (GPT-2 style JSON); `None`: the demo model (its vocab_size is
    /// replaced by the data's when the data is not the built-in addition task).
    pub model: Option<PathBuf>,
    /// Training data: a `.bin` token file or a text file (bytes); `None`: addition.
    pub data: Option<PathBuf>,
    /// Devices (`kiln devices` lists them); empty: `kiln.devices`, else the best adapter.
    pub devices: Vec<String>,
    /// Run directory; `None`: `runs/<UTC time>`.
    pub out: Option<PathBuf>,
    /// Optimizer steps to run in total, at least 1 (a resumed run counts the steps
    /// already done). On `resume`, this and the intervals, retention and seed below
    /// default to the run's own.
    pub steps: Option<u64>,
    /// Evaluate every this many steps (and at the end); 0: only at the end.
    pub eval_every: Option<u64>,
    /// Pack an example file's examples several to a row (`kiln.packing`); `None`: the
    /// config's, else yes.
    pub packing: Option<bool>,
    /// Checkpoint every this many steps (and at the end); 0: only at the end.
    pub checkpoint_every: Option<u64>,
    /// Checkpoints kept (older ones are deleted once a newer one is complete).
    pub keep_checkpoints: Option<usize>,
    /// Seeds the weights and the data order.
    pub seed: Option<u64>,
    /// Continue the run in `out` from its latest checkpoint.
    pub resume: bool,
    /// Start from these weights (a fresh optimizer): a Kiln run directory (its latest
    /// checkpoint) or checkpoint directory, a Hugging Face GPT-2 directory or
    /// `model.safetensors`, or an llm.c `.bin`. The model's sizes come from it.
    pub init_from: Option<PathBuf>,
    /// Train on sequences of this many tokens, at most the model's block_size (which
    /// becomes it); `None`: the block_size.
    pub seq: Option<usize>,
    /// Draw a progress bar and print log lines.
    pub progress: bool,
    /// Set (by Ctrl-C, SIGTERM or SIGHUP) to stop after the current step, checkpointing
    /// and writing the summary first.
    pub interrupt: Option<Arc<AtomicBool>>,
    /// This process's part in a multi-process job (`mpirun`): its devices are the
    /// ranks after the earlier processes' devices; the job trains one model. Process 0
    /// writes the run directory, logs and evaluates; every process reads its own shard
    /// of each global batch. Every process must be given the same settings.
    pub processes: Option<Arc<dyn Collective>>,
    /// Profile this many steps (after the first, which compiles): `trace.json` and
    /// `profile.txt` in the run directory, and the table printed.
    pub profile: Option<u64>,
    /// One device's peak in TFLOP/s, for the profile's MFU; default: `kiln bench peak`'s
    /// cached measure.
    pub peak_tflops: Option<f64>,
    /// Pipeline stages the devices are split into (stage-major: device `s * dp + r` is
    /// stage s of replica r); `None`: the config's `pipeline.stages`, else 1.
    pub pipeline_stages: Option<usize>,
    /// How the blocks are cut into stages (`parameters`, `uniform`, or blocks per
    /// stage such as `3,5`); `None`: the config's `pipeline.partition`.
    pub partition: Option<String>,
    /// The device memory a run may use on each device, in place of the driver's budget
    /// or heap (`--memory-limit`): a run over it is refused at start, naming what does
    /// not fit.
    pub memory_limit: Option<u64>,
    /// Train LoRA adapters on the frozen model (`--lora r=16,alpha=32,...`, see
    /// `LoraConfig::parse_flag`); `None`: the config's `kiln.lora`, else full training.
    pub lora: Option<String>,
    /// Start the LoRA adapters from this PEFT adapter directory (its settings are the
    /// run's LoRA settings unless `lora` or `kiln.lora` say them, which must agree).
    pub adapter: Option<PathBuf>,
}

/// What a finished (or interrupted) run reports.
#[derive(Clone, Debug)]
pub struct RunReport {
    pub dir: PathBuf,
    /// Steps done in total (including those before a resume).
    pub steps: u64,
    pub interrupted: bool,
    pub summary: Summary,
}
