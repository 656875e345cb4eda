//! `kiln estimate`: per-device memory of a model for each ZeRO stage, before training.
//!
//! Model states come from the same layout `Network::new` allocates (`Network::memory`,
//! tested equal to a device's allocator); stages 1–3 divide the parts each partitions by the
//! device count, as ZeRO's formulas do: stage 0 (2+2+12)Ψ, stage 1 2Ψ+2Ψ+12Ψ/N,
//! stage 2 2Ψ+(2+12)Ψ/N, stage 3 (2+2+12)Ψ/N for fp16 with Adam. Stages 1 and 2 are
//! what Kiln allocates: a rank's slice also has an f32 reduced gradient and a model
//! copy, and stage 2's full-size gradients are one block's (shared by all blocks) plus
//! the embeddings' and final norm's, not 2Ψ/N.
//!
//! With the optimizer state offloaded (`offload_optimizer`, stages 1 to 3; the rows
//! `N+host`) a rank's f32 master and moments (12 bytes per element of its slice) are in
//! host memory and its device holds no optimizer state and no f32 reduced gradient.
//! With stage 3's parameters offloaded (`offload_param` alone; the row `3+param`) a
//! device holds no 16-bit copy of its slice.
//!
//! With LoRA (`--lora`) the model is the base under its adapters (`Lora`): Ψ is the
//! adapters' elements, the only ones with gradients, masters and moments (and so the
//! only ones ZeRO shards), and the base is held once in the storage dtype on every
//! device (the `frozen` column; stage 3 would partition it too).
//!
//! With `--fits 8GiB,16GiB` ([`fits_report`]) it sets full training, LoRA and each with
//! activation checkpointing, on one device and with ZeRO-2 across 2 and 4, against
//! device sizes, and names the cheapest that fits each.

use std::fmt::Write as _;
use std::sync::Arc;

use anyhow::Result;
use kiln_engine::config::{LoraSection, ZeroConfig};
use kiln_engine::models::lora::{Lora, LoraConfig, Targets};
use kiln_engine::models::{
    host_memory_available, Model, Network, NetworkMemory, NetworkOptions, Partition,
};
use kiln_engine::parallel::pipeline::Pipeline;
use kiln_engine::parallel::pipeline_partition::PartitionMethod;
use kiln_engine::parallel::zero::{check_host_fits, shard_bytes, Offload};
use kiln_engine::{Capabilities, DType, Optimizer};

/// One ZeRO stage's per-device bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StageMemory {
    pub stage: u8,
    /// The trained parameters' model copy.
    pub weights: u64,
    /// Weights that are not trained (a LoRA run's base model), held once in the storage
    /// dtype: whole on every device up to stage 2.
    pub frozen: u64,
    pub gradients: u64,
    pub optimizer: u64,
    pub activations: u64,
    /// Kiln trains with this stage today.
    pub implemented: bool,
    /// The optimizer state offloaded (`offload_optimizer`): `host` bytes of it per
    /// device in host memory, none on the device.
    pub offload: bool,
    pub host: u64,
    /// Stage 3's `offload_param` without `offload_optimizer`: no 16-bit copy of the
    /// shard on the device.
    pub offload_param: bool,
}

impl StageMemory {
    pub fn total(&self) -> u64 {
        self.weights + self.frozen + self.gradients + self.optimizer + self.activations
    }
}

/// The LoRA settings of an estimate: `--lora` (`flag`, as `kiln train --lora` reads
/// it), else the config's `kiln.lora` (`section`); `None`: full training.
pub fn lora_settings(
    flag: Option<&str>,
    section: Option<&LoraSection>,
) -> Result<Option<LoraConfig>> {
    Ok(match (flag, section) {
        (Some(flag), _) => Some(LoraConfig::parse_flag(flag)?),
        (None, Some(s)) => Some(LoraConfig {
            r: s.r,
            alpha: s.alpha,
            dropout: s.dropout,
            target_modules: match &s.target_modules {
                Some(l) => Targets::List(l.clone()),
                None => Targets::All("all-linear".into()),
            },
            use_rslora: s.use_rslora,
        }),
        (None, None) => None,
    })
}

/// `base` under LoRA adapters of `config` (what `kiln train --lora` trains), or
/// `base` itself without: targets that match nothing and ranks over a module's size
/// are refused as training refuses them.
pub fn adapt(base: Arc<dyn Model>, config: Option<LoraConfig>) -> Result<Arc<dyn Model>> {
    Ok(match config {
        Some(c) => Arc::new(Lora::new(base, c)?),
        None => base,
    })
}

/// Elements of `model`'s trained parameters (Ψ) and of its frozen ones.
fn counts(model: &dyn Model) -> (u64, u64) {
    let (mut trained, mut frozen) = (0, 0);
    for p in model.parameters() {
        if p.frozen {
            frozen += p.len() as u64;
        } else {
            trained += p.len() as u64;
        }
    }
    (trained, frozen)
}

/// What a network of `model` allocates on one device at `micro_batch` in `dtype`.
pub fn network_memory(
    model: &dyn Model,
    micro_batch: usize,
    dtype: DType,
) -> Result<NetworkMemory> {
    Ok(Network::memory(model, &options(micro_batch, dtype))?)
}

fn options(micro_batch: usize, dtype: DType) -> NetworkOptions {
    NetworkOptions {
        batch: micro_batch,
        dtype,
        optimizer: Optimizer::adamw(1e-3, 0.0),
        seed: 0,
        packed: false,
    }
}

/// Per-device memory for stages 0..=3 on `world` devices, stage 3 at DeepSpeed's
/// default `stage3_param_persistence_threshold`.
pub fn stages(
    model: &dyn Model,
    micro_batch: usize,
    dtype: DType,
    world: usize,
) -> Result<Vec<StageMemory>> {
    let threshold = ZeroConfig::default().param_persistence_threshold;
    stages_with(model, micro_batch, dtype, world, threshold)
}

/// [`stages`] with stage 3 keeping tensors of fewer than `persistence_threshold`
/// elements whole on every device.
pub fn stages_with(
    model: &dyn Model,
    micro_batch: usize,
    dtype: DType,
    world: usize,
    persistence_threshold: u64,
) -> Result<Vec<StageMemory>> {
    let m = network_memory(model, micro_batch, dtype)?;
    let m3 = stage3_memory(model, micro_batch, dtype, persistence_threshold)?;
    // The trained parameters: a LoRA model's frozen base has no gradient or optimizer
    // state to shard.
    let (psi, _) = counts(model);
    Ok(stages_of([&m, &m3], psi, dtype, world))
}

/// What a ZeRO stage-3 replica of `model` allocates besides its shard
/// (`Network::new_stage3`).
pub fn stage3_memory(
    model: &dyn Model,
    micro_batch: usize,
    dtype: DType,
    persistence_threshold: u64,
) -> Result<NetworkMemory> {
    let partition = Partition::Stage3 {
        persistence_threshold: persistence_threshold as usize,
    };
    Ok(Network::memory_partitioned(
        model,
        &options(micro_batch, dtype),
        partition,
    )?)
}

/// [`stages`] from a network's memory `m`, a stage-3 replica's `m3` and `psi` trained
/// elements.
fn stages_of(
    [m, m3]: [&NetworkMemory; 2],
    psi: u64,
    dtype: DType,
    world: usize,
) -> Vec<StageMemory> {
    let n = world.max(1) as u64;
    // A ZeRO rank's slice: f32 master and moments, the f32 reduced gradient, and the
    // slice's updated model copy (zero.rs); whole tensors keep their arenas' gaps.
    let slice = psi.div_ceil(n);
    let sharded = (12 + dtype.size() as u64) * slice;
    let one = |stage, weights, gradients, optimizer, implemented| StageMemory {
        stage,
        activations: if stage == 3 {
            m3.activations
        } else {
            m.activations
        },
        weights,
        frozen: m.frozen,
        gradients,
        optimizer,
        implemented,
        offload: false,
        host: 0,
        offload_param: false,
    };
    // Offloaded: the device keeps the model copy and the full-size gradients only.
    let offloaded = |stage, gradients| StageMemory {
        optimizer: 0,
        offload: true,
        host: 12 * slice,
        ..one(stage, m.weights, gradients, 0, true)
    };
    let shared = if n > 1 {
        m.shared_gradients
    } else {
        m.gradients
    };
    let stage3 = StageMemory {
        host: m3.streamed,
        ..one(3, m3.weights, m3.gradients + 4 * slice, sharded, true)
    };
    vec![
        one(0, m.weights, m.gradients, m.optimizer, true),
        // One device: the single shard is the whole state, stage 0's layout.
        if n > 1 {
            one(1, m.weights, m.gradients + 4 * slice, sharded, true)
        } else {
            one(1, m.weights, m.gradients, m.optimizer, true)
        },
        // Stage 2 holds one block's gradients at a time (alike blocks share them) next
        // to those outside blocks (a GPT's embeddings and final norm).
        if n > 1 {
            one(2, m.weights, m.shared_gradients + 4 * slice, sharded, true)
        } else {
            one(2, m.weights, m.gradients, m.optimizer, true)
        },
        // Stage 3 is sharded on one device too, and its blocks share one set of
        // weights and gradients; the streamed weights are in host memory.
        stage3,
        offloaded(1, m.gradients),
        offloaded(2, shared),
        StageMemory {
            weights: m3.weights,
            host: 12 * slice + m3.streamed,
            activations: m3.activations,
            ..offloaded(3, m3.gradients)
        },
        // offload_param alone: the shard's master, moments and reduced gradient stay,
        // its 16-bit copy does not.
        StageMemory {
            optimizer: 12 * slice,
            offload_param: true,
            ..stage3
        },
    ]
}

fn mib(b: u64) -> String {
    format!("{:.1} MiB", b as f64 / (1u64 << 20) as f64)
}

/// The table `kiln estimate` prints, and whether `kiln train` would build the model on
/// `devices` (the adapters named, one entry per device; none for a bare device count)
/// and this host at ZeRO stage `zero.0`, offloading as `zero.1` says: the same check,
/// with the same message, as training runs first.
pub fn report(
    model: &dyn Model,
    micro_batch: usize,
    dtype: DType,
    world: usize,
    devices: &[Capabilities],
    (stage, offload, threshold): (u8, Offload, u64),
) -> Result<String> {
    let mut out = String::new();
    // First: it checks the model's sizes before anything is built from them.
    let rows = stages_with(model, micro_batch, dtype, world, threshold)?;
    let (psi, frozen) = counts(model);
    if frozen == 0 {
        writeln!(
            out,
            "{}: Ψ = {psi} parameters; {dtype}, micro-batch {micro_batch}, {world} device(s)",
            model.describe()
        )?;
    } else {
        writeln!(
            out,
            "{}: Ψ = {psi} trained parameters (the adapters: gradients, master+Adam and ZeRO's \
             shards are theirs only) over {frozen} frozen (the base model, held once in \
             {dtype} on every device); {dtype}, micro-batch {micro_batch}, {world} device(s)",
            model.describe()
        )?;
    }
    // The frozen column only where there are frozen weights: a full training's table is
    // as it was.
    let frozen_col = |v: String| {
        if frozen == 0 {
            String::new()
        } else {
            format!(" {v:>12}")
        }
    };
    writeln!(
        out,
        "{:<7} {:>12}{} {:>12} {:>14} {:>13} {:>12}  note",
        "stage",
        "weights",
        frozen_col("frozen".into()),
        "gradients",
        "master+Adam",
        "activations",
        "per device"
    )?;
    for s in &rows {
        writeln!(
            out,
            "{:<7} {:>12}{} {:>12} {:>14} {:>13} {:>12}  {}",
            if s.offload {
                format!("{}+host", s.stage)
            } else if s.offload_param {
                format!("{}+param", s.stage)
            } else {
                s.stage.to_string()
            },
            mib(s.weights),
            frozen_col(mib(s.frozen)),
            mib(s.gradients),
            mib(s.optimizer),
            mib(s.activations),
            mib(s.total()),
            if s.offload && s.stage == 3 {
                format!(
                    "offload_optimizer: master+Adam in host memory, {} per device; the \
                     blocks' weights too, {} for all devices",
                    mib(s.host - rows[3].host),
                    mib(rows[3].host)
                )
            } else if s.offload {
                format!(
                    "offload_optimizer: master+Adam in host memory, {} per device",
                    mib(s.host)
                )
            } else if s.offload_param {
                "offload_param: no 16-bit copy of the shard on a device (the host rounds the \
                 downloaded master); the blocks' weights in host memory as at stage 3"
                    .to_string()
            } else if s.stage == 3 {
                format!(
                    "one block's weights and gradients on a device (alike blocks take turns); \
                     the blocks' weights in host memory, {} for all devices",
                    mib(s.host)
                )
            } else if s.implemented {
                String::new()
            } else {
                "what it would give (not implemented yet)".into()
            }
        )?;
    }
    let whole = network_memory(model, micro_batch, dtype)?;
    // What kiln train checks and builds first: under ZeRO each device's network without
    // the optimizer state, beside its shard, with its whole gradients (stage 2's blocks
    // share one set once built).
    let sharded = stage >= 1 && (world > 1 || offload.optimizer || stage == 3);
    let shards = shard_bytes(model, world, 0..world, dtype, offload);
    let m = match (sharded, stage) {
        (true, 3) => stage3_memory(model, micro_batch, dtype, threshold)?.with_shards(shards),
        (true, _) => whole.with_shards(shards),
        (false, _) => whole,
    };
    writeln!(
        out,
        "kiln train at ZeRO stage {stage}{} needs {} per device at the start: each device's \
         network {}{}; \
         largest buffer {}, largest kernel binding {} (what one kernel binds whole, such as \
         an embedding table; GEMMs, elementwise kernels and the optimizer split larger \
         buffers)",
        match (offload.optimizer, offload.params) {
            (true, true) => " with offload_optimizer and offload_param",
            (true, false) => " with offload_optimizer",
            (false, true) => " with offload_param",
            (false, false) => "",
        },
        mib(m.total()),
        match stage {
            3 => "with one block's weights and gradients (alike blocks take turns in them)",
            _ => "with its whole gradients (stage 2's blocks share one set once built)",
        },
        match (sharded, offload.optimizer, offload.params) {
            (false, ..) => " and the whole optimizer state",
            (true, false, false) => " beside its shard of the optimizer state",
            (true, false, true) => {
                " beside its shard of the optimizer state (without its 16-bit copy)"
            }
            (true, true, _) => ", the optimizer state in host memory",
        },
        mib(m.largest_buffer),
        mib(m.largest_binding)
    )?;
    let host = host_memory_available();
    for caps in unique(devices) {
        let heap = caps.memory_heap.map(|h| {
            let over = match m.total() > h {
                true => format!(", which this run's {} per device is over", mib(m.total())),
                false => String::new(),
            };
            format!("device-local heap {}{over}", mib(h))
        });
        let and_heap = heap.as_ref().map_or(String::new(), |h| format!("; {h}"));
        let memory = match (caps.memory_limit, caps.memory_budget, heap) {
            (Some(l), _, _) => format!("--memory-limit {}{and_heap}", mib(l)),
            (None, Some(b), _) => format!("memory budget {}{and_heap}", mib(b)),
            (None, None, _) if caps.device_type == "cpu" => format!(
                "its memory is the host's{and_heap} (nominal on a CPU driver, not a limit: \
                 --memory-limit holds a run to a size)"
            ),
            (None, None, Some(heap)) => heap,
            (None, None, None) => "its memory size is not reported (wgpu asks only Vulkan \
                                   drivers), so compare the per-device figure with the adapter's"
                .into(),
        };
        if caps.backend == "cpu" {
            writeln!(out, "{} (cpu): no buffer limits; {memory}", caps.name)?;
        } else {
            writeln!(
                out,
                "{} ({}): largest buffer {}, per-binding limit {}; {memory}",
                caps.name,
                caps.backend,
                mib(caps.max_buffer),
                mib(caps.max_storage_binding)
            )?;
        }
    }
    let caps: Vec<&Capabilities> = devices.iter().collect();
    let checked = match offload.optimizer {
        true => check_host_fits(shards.host, host),
        false => Ok(()),
    };
    let checked = checked.and_then(|()| m.check_fit(&model.describe(), dtype, &caps, host));
    let verdict = match checked {
        Ok(()) => format!(
            "fits (the host needs {}{})",
            mib(m.host_bytes(&caps)),
            host.map_or(String::new(), |h| format!(", {} available", mib(h)))
        ),
        Err(e) => format!("refused: {e}"),
    };
    let on = if devices.is_empty() {
        "this host".to_string()
    } else {
        format!("these {} device(s) and this host", devices.len())
    };
    writeln!(out, "kiln train on {on}: {verdict}")?;
    Ok(out)
}

/// Each adapter once, in order.
fn unique(devices: &[Capabilities]) -> Vec<&Capabilities> {
    let mut seen = std::collections::HashSet::new();
    devices
        .iter()
        .filter(|c| seen.insert((c.name.clone(), c.backend.clone())))
        .collect()
}

/// Each stage's device bytes in a pipeline of `stages` stages × `dp` replicas under
/// ZeRO stage `zero_stage`: [`Pipeline::memory`] (what `Pipeline::new` allocates), then
/// with ZeRO 1/2 over the replicas a rank's slice of the stage's parameters in place of
/// its masters and moments — f32 master and moments, the f32 reduced gradient (counted
/// with the gradients) and the slice's updated model copy, as `zero.rs` allocates them —
/// and under 2 a stage's blocks alike to its first sharing that block's gradients.
pub fn pipeline_memory(
    model: &dyn Model,
    options: &NetworkOptions,
    method: &PartitionMethod,
    (stages, dp): (usize, usize),
    (zero_stage, offload): (u8, bool),
) -> Result<Vec<NetworkMemory>> {
    let mut memory = Pipeline::memory(model, options, method, stages)?;
    let sharded = zero_stage >= 1 && dp > 1;
    let partitioned = zero_stage == 2 && dp > 1;
    for m in &mut memory {
        if partitioned {
            m.gradients = m.shared_gradients;
        }
        if sharded {
            // The stage's f32 master and two moments: 12 bytes per element.
            let slice = (m.optimizer / 12).div_ceil(dp as u64);
            if offload {
                // In host memory: the device keeps one empty buffer in their place.
                m.optimizer = DType::F32.padded_bytes(0);
                m.host += 12 * slice;
            } else {
                m.optimizer = (12 + options.dtype.size() as u64) * slice;
                m.gradients += 4 * slice;
            }
        }
    }
    Ok(memory)
}

/// The per-stage table of a pipeline of `stages` stages on `world` devices (`world /
/// stages` data-parallel replicas) taking `m` micro-batches per step: each stage's
/// blocks and device bytes as [`Pipeline::new`] allocates them (its weights,
/// gradients, master weights and moments, and the activations of the micro-batches it
/// keeps in flight: `p - s` for stage `s`, whatever `m` is), and the bubble `m` gives.
pub fn pipeline_report(
    model: &dyn Model,
    micro_batch: usize,
    dtype: DType,
    (stages, world, m): (usize, usize, usize),
    method: &PartitionMethod,
    (zero_stage, offload): (u8, bool),
) -> Result<String> {
    if stages == 0 || world % stages != 0 {
        anyhow::bail!(
            "--pipeline-stages {stages} does not divide the {world} device(s): a pipeline of \
             p stages takes p devices per data-parallel replica (e.g. --devices vulkan:0x4 \
             --pipeline-stages 2 is 2 stages x 2 replicas)"
        );
    }
    let options = NetworkOptions {
        batch: micro_batch,
        dtype,
        optimizer: Optimizer::adamw(1e-3, 0.0),
        seed: 0,
        packed: false,
    };
    let dp = world / stages;
    let memory = pipeline_memory(model, &options, method, (stages, dp), (zero_stage, offload))?;
    let blocks = Pipeline::stage_blocks_of(model, method, stages)?;
    let sharded = zero_stage >= 1 && dp > 1;
    let partitioned = zero_stage == 2 && dp > 1;
    let cut = match method {
        PartitionMethod::Blocks(counts) => format!("blocks {counts:?}"),
        other => other.spelled(),
    };
    let mut out = String::new();
    writeln!(
        out,
        "{}: {stages} pipeline stage(s) x {dp} data-parallel replica(s), {dtype}, micro-batch \
         {micro_batch}, m = {m} micro-batches per step, partition {cut}{}",
        model.describe(),
        if partitioned {
            format!(
                ", ZeRO stage 2: master+Adam sharded over the {dp} replicas, each stage's alike \
                 blocks share one block's gradients"
            )
        } else if sharded {
            format!(", ZeRO stage {zero_stage}: master+Adam sharded over the {dp} replicas")
        } else {
            String::new()
        }
    )?;
    if sharded && offload {
        writeln!(
            out,
            "offload_optimizer: each device's shard of master+Adam (12 bytes per element of \
             its slice) is in host memory; the master+Adam column is what stays on the device"
        )?;
    }
    writeln!(
        out,
        "{:<7} {:>8} {:>12} {:>12} {:>14} {:>13} {:>12}  in flight",
        "stage", "blocks", "weights", "gradients", "master+Adam", "activations", "per device"
    )?;
    for (s, (m, b)) in memory.iter().zip(&blocks).enumerate() {
        writeln!(
            out,
            "{s:<7} {:>8} {:>12} {:>12} {:>14} {:>13} {:>12}  {} micro-batch(es)",
            format!("{}..{}", b.start, b.end),
            mib(m.weights),
            mib(m.gradients),
            mib(m.optimizer),
            mib(m.activations),
            mib(m.total()),
            stages - s
        )?;
    }
    writeln!(
        out,
        "Stage s of p keeps p - s micro-batches' activations whatever \
         gradient_accumulation_steps is (1F1B); parameters read on several stages (a tied \
         embedding) are held on each."
    )?;
    let bubble =
        |m: usize| 100.0 * kiln_engine::parallel::pipeline_schedule::theoretical_bubble(stages, m);
    write!(
        out,
        "Bubble: the stages idle for (p-1)/(m+p-1) = {:.0}% of each step at m = {m} \
         (gradient_accumulation_steps)",
        bubble(m)
    )?;
    if m < 4 * stages {
        write!(
            out,
            "; m = {} (4 x stages) brings it to {:.0}%",
            4 * stages,
            bubble(4 * stages)
        )?;
    }
    writeln!(out, ".")?;
    if dp > 1 {
        writeln!(
            out,
            "Each of the {dp} replicas holds these figures on its {stages} devices (device \
             s x {dp} + r is stage s of replica r); `kiln train --pipeline-stages {stages}` \
             trains it on {world} devices."
        )?;
    } else {
        writeln!(
            out,
            "`kiln train --pipeline-stages {stages}` trains it on {stages} devices."
        )?;
    }
    Ok(out)
}

/// The device counts of `kiln estimate --fits`: one device (ZeRO stage 0), then ZeRO
/// stage 2 across 2 and 4.
pub const FIT_DEVICES: [usize; 3] = [1, 2, 4];

/// The LoRA settings of `--fits`' LoRA rows when neither `--lora` nor the config's
/// `kiln.lora` gives them.
pub const FIT_LORA: &str = "r=16,alpha=32,targets=all-linear";

/// The units a memory size takes, binary all: `G` is `GiB`.
const SIZE_UNITS: [(&str, u64); 8] = [
    ("KiB", 1 << 10),
    ("MiB", 1 << 20),
    ("GiB", 1 << 30),
    ("TiB", 1 << 40),
    ("K", 1 << 10),
    ("M", 1 << 20),
    ("G", 1 << 30),
    ("T", 1 << 40),
];

/// A device's memory as `--fits` takes it: a number and a binary unit, `8GiB`, `16G`,
/// `512MiB`, `1.5GiB` (`K`/`KiB`, `M`/`MiB`, `G`/`GiB`, `T`/`TiB`; `G` = `GiB` =
/// 2^30 bytes). Anything else (no unit, `GB`, a sign, zero) is refused, naming the
/// value and the forms accepted.
pub fn parse_size(flag: &str, text: &str) -> Result<u64> {
    let several = match flag {
        "--fits" => ", several joined by commas",
        _ => "",
    };
    let bad = |why: &str| {
        anyhow::anyhow!(
            "{flag} {text:?}: {why}; write a device's memory as a number and a binary unit: \
             8GiB, 16G, 512MiB, 1.5GiB (K/KiB, M/MiB, G/GiB or T/TiB; G = GiB = 2^30 bytes)\
             {several}"
        )
    };
    let t = text.trim();
    if t.is_empty() {
        return Err(bad("empty"));
    }
    let digits = t
        .find(|c: char| !c.is_ascii_digit() && c != '.')
        .ok_or_else(|| bad("no unit"))?;
    let (number, unit) = (&t[..digits], t[digits..].trim_start());
    // Digits with at most one point, digits on both of its sides.
    let well_formed = number
        .split('.')
        .all(|part| !part.is_empty() && part.bytes().all(|b| b.is_ascii_digit()))
        && number.matches('.').count() <= 1;
    if !well_formed {
        return Err(bad("not a number"));
    }
    let scale = SIZE_UNITS
        .iter()
        .find(|(u, _)| *u == unit)
        .map(|&(_, s)| s)
        .ok_or_else(|| {
            bad(&match unit.to_ascii_lowercase().as_str() {
                "kb" | "mb" | "gb" | "tb" => format!(
                    "`{unit}` could mean powers of 10 or of 2: write {number}{}iB for 2^n bytes",
                    unit[..1].to_ascii_uppercase()
                ),
                _ => format!("`{unit}` is not a unit"),
            })
        })?;
    let value: f64 = number.parse().map_err(|_| bad("not a number"))?;
    let bytes = (value * scale as f64).round();
    if bytes < 1.0 {
        return Err(bad("no memory at all"));
    }
    // 2^63: far beyond any device, and still exact in f64 and u64.
    if bytes >= (1u64 << 63) as f64 {
        return Err(bad("too large"));
    }
    Ok(bytes as u64)
}

/// One row of `kiln estimate --fits`: a way to train the model and what it takes on
/// each device.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Fit {
    /// The base frozen under LoRA adapters (else full training).
    pub lora: bool,
    pub checkpointing: bool,
    /// 1: ZeRO stage 0 on one device; more: ZeRO stage 2 across that many.
    pub devices: usize,
    /// Each device's bytes, as [`stages`] gives them (stage 0, or 2 across `devices`).
    pub memory: StageMemory,
    /// Each device's bytes while `kiln train` builds the network: its whole gradients
    /// beside its shard of the optimizer state (stage 1's figure), before stage 2's
    /// blocks share one set of gradients.
    pub at_start: u64,
    /// The largest buffer one kernel binds whole ([`NetworkMemory::largest_binding`]).
    pub largest_binding: u64,
}

impl Fit {
    /// Per-device bytes.
    pub fn bytes(&self) -> u64 {
        self.memory.total()
    }

    /// `full`, `full + checkpointing`, `LoRA`, `LoRA + checkpointing`.
    pub fn training(&self) -> String {
        format!(
            "{}{}",
            if self.lora { "LoRA" } else { "full" },
            if self.checkpointing {
                " + checkpointing"
            } else {
                ""
            }
        )
    }

    /// The devices column: `1`, `ZeRO-2 x 2`, ...
    pub fn on(&self) -> String {
        match self.devices {
            1 => "1".into(),
            n => format!("ZeRO-2 x {n}"),
        }
    }

    /// `full on 1 device`, `LoRA on ZeRO-2 across 4 devices`, ...
    pub fn spelled(&self) -> String {
        match self.devices {
            1 => format!("{} on 1 device", self.training()),
            n => format!("{} with ZeRO-2 across {n} devices", self.training()),
        }
    }

    /// `fits` where each device's bytes are at most `size`, `fits*` where they are but
    /// kiln train today needs more while it builds the network (see [`Fit::at_start`]),
    /// else `no (needs X)`.
    pub fn verdict(&self, size: u64) -> String {
        if self.bytes() > size {
            format!("no (needs {})", human(self.bytes()))
        } else if self.at_start > size {
            "fits*".into()
        } else {
            "fits".into()
        }
    }
}

/// Bytes in GiB from 1 GiB, else in MiB.
fn human(b: u64) -> String {
    if b >= 1 << 30 {
        format!("{:.2} GiB", b as f64 / (1u64 << 30) as f64)
    } else {
        mib(b)
    }
}

/// The rows of `kiln estimate --fits`, cheapest first: for each of [`FIT_DEVICES`],
/// full training, full with activation checkpointing (ranges of `every` blocks), LoRA
/// (`lora`) and LoRA with checkpointing, of `base` at `micro_batch` in `dtype`. Each
/// of the four models is recorded once (`Network::memory`: no device, milliseconds for
/// Llama-3.2-3B), the ZeRO-2 rows computed from it as [`stages`] computes them.
pub fn fits(
    base: Arc<dyn Model>,
    lora: LoraConfig,
    every: usize,
    micro_batch: usize,
    dtype: DType,
) -> Result<Vec<Fit>> {
    use kiln_engine::models::checkpointed::Checkpointed;
    // Sizes first: a bad shape is refused before anything is built from it.
    base.check_sizes()?;
    let adapted = adapt(base.clone(), Some(lora))?;
    let models: Vec<(bool, bool, Arc<dyn Model>)> = vec![
        (false, false, base.clone()),
        (false, true, Arc::new(Checkpointed::new(base, every)?)),
        (true, false, adapted.clone()),
        (true, true, Arc::new(Checkpointed::new(adapted, every)?)),
    ];
    let memory = models
        .iter()
        .map(|(_, _, m)| network_memory(m.as_ref(), micro_batch, dtype))
        .collect::<Result<Vec<_>>>()?;
    let mut rows = vec![];
    for devices in FIT_DEVICES {
        for ((lora, checkpointing, model), m) in models.iter().zip(&memory) {
            let (psi, _) = counts(model.as_ref());
            // Stage 3's row is not read here: the network's memory stands in for it.
            let all = stages_of([m, m], psi, dtype, devices);
            rows.push(Fit {
                lora: *lora,
                checkpointing: *checkpointing,
                devices,
                memory: all[if devices == 1 { 0 } else { 2 }],
                // Built with the whole gradients: stage 1's figure, shared after.
                at_start: all[if devices == 1 { 0 } else { 1 }].total(),
                largest_binding: m.largest_binding,
            });
        }
    }
    Ok(rows)
}

/// The first of `rows` (cheapest first, as [`fits`] orders them: fewest devices, then
/// full training before LoRA, then without checkpointing) whose per-device bytes are at
/// most `size`.
pub fn cheapest(rows: &[Fit], size: u64) -> Option<&Fit> {
    rows.iter().find(|r| r.bytes() <= size)
}

/// The table `kiln estimate --fits` prints: [`fits`]' rows, each with its per-device
/// bytes and, for each of `sizes` (as written, in bytes), whether it fits, then the
/// cheapest row that fits each size.
pub fn fits_report(
    base: Arc<dyn Model>,
    (lora, every): (LoraConfig, usize),
    micro_batch: usize,
    dtype: DType,
    sizes: &[(String, u64)],
) -> Result<String> {
    let adapters = Lora::new(base.clone(), lora.clone())?;
    let (psi, frozen) = counts(&adapters);
    let targets = match &lora.target_modules {
        Targets::All(all) => all.clone(),
        Targets::List(list) => list.join("+"),
    };
    let rows = fits(base.clone(), lora.clone(), every, micro_batch, dtype)?;
    let mut out = String::new();
    writeln!(
        out,
        "{}: {dtype}, micro-batch {micro_batch}; LoRA r={}, alpha={}, targets={targets}{} \
         ({psi} adapter parameters over {frozen} frozen); checkpointing: {}",
        base.describe(),
        lora.r,
        lora.alpha,
        if lora.use_rslora { ", rslora" } else { "" },
        match every {
            1 => "every block recomputed in backward".to_string(),
            n => format!("ranges of {n} blocks recomputed in backward"),
        }
    )?;
    let names: Vec<&str> = sizes.iter().map(|(n, _)| n.as_str()).collect();
    writeln!(
        out,
        "per device: weights + frozen base + gradients + master+Adam + activations on each \
         device (1: ZeRO stage 0; ZeRO-2 x N: gradients and master+Adam sharded over N, as \
         `kiln estimate --devices N` gives stage 2); {}: fits when per device <= that size \
         (per-binding limits not checked), else no (needs per device)",
        names.join(", ")
    )?;
    let mut table = vec![["training", "devices", "per device"]
        .iter()
        .map(|s| s.to_string())
        .chain(names.iter().map(|s| s.to_string()))
        .collect::<Vec<_>>()];
    for r in &rows {
        table.push(
            [r.training(), r.on(), human(r.bytes())]
                .into_iter()
                .chain(sizes.iter().map(|&(_, size)| r.verdict(size)))
                .collect(),
        );
    }
    writeln!(out, "{}", crate::bench::align(&table))?;
    if rows
        .iter()
        .any(|r| sizes.iter().any(|&(_, size)| r.verdict(size) == "fits*"))
    {
        writeln!(
            out,
            "* fits once its blocks share gradients: kiln train builds each device's network \
             with its whole gradients (ZeRO stage 1's figure) before stage 2's blocks share \
             one set, so today it needs that much at start"
        )?;
    }
    let widest = rows
        .iter()
        .max_by_key(|r| r.largest_binding)
        .expect("fits gives rows");
    let which = if rows
        .iter()
        .all(|r| r.largest_binding == widest.largest_binding)
    {
        "every row".to_string()
    } else {
        widest.training()
    };
    writeln!(
        out,
        "largest buffer one kernel binds whole: {} ({which}), {} a typical GPU's 2 GiB \
         per-binding limit; `kiln estimate --devices SPEC` checks an adapter's",
        human(widest.largest_binding),
        if widest.largest_binding <= 2 << 30 {
            "within"
        } else {
            "over"
        }
    )?;
    writeln!(
        out,
        "cheapest that fits (fewest devices, then full before LoRA, then without \
         checkpointing):"
    )?;
    for (name, size) in sizes {
        match cheapest(&rows, *size) {
            Some(r) => {
                write!(
                    out,
                    "  {name}: {} ({} per device)",
                    r.spelled(),
                    human(r.bytes())
                )?;
                if r.at_start > *size {
                    write!(
                        out,
                        " once its blocks share gradients; kiln train today needs {} per \
                         device at start (the gradients whole), so nothing here starts on \
                         {name} devices yet",
                        human(r.at_start)
                    )?;
                }
                writeln!(out)?;
            }
            None => {
                let least = rows
                    .iter()
                    .min_by_key(|r| r.bytes())
                    .expect("fits gives rows");
                let states = least.bytes() - least.memory.activations;
                writeln!(
                    out,
                    "  {name}: none (the least is {}: {} per device; {})",
                    least.spelled(),
                    human(least.bytes()),
                    if states <= *size {
                        format!(
                            "its activations take {}: a smaller micro-batch or --seq shrinks \
                             them",
                            human(least.memory.activations)
                        )
                    } else {
                        format!(
                            "without activations it still needs {}: ZeRO-3, not implemented \
                             yet, would shard the weights",
                            human(states)
                        )
                    }
                )?;
            }
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    use kiln_engine::models::gpt::{Gpt, GptConfig};

    #[test]
    fn stages_follow_the_zero_formulas() {
        let cfg = GptConfig {
            n_layer: 12,
            n_head: 12,
            n_embd: 768,
            block_size: 1024,
            vocab_size: 50304,
            padded_vocab_size: None,
        };
        let psi = cfg.parameter_count() as u64;
        let gpt = Gpt::new(cfg.clone(), 1024);
        let r = stages(&gpt, 1, DType::F16, 4).unwrap();
        let state = |s: &StageMemory| s.weights + s.gradients + s.optimizer;
        // fp16 weights (2Ψ) and Adam in f32 (12Ψ); gradients are 2Ψ but for the f32
        // ones of embeddings and norms (the embeddings are most of a small GPT's Ψ).
        assert_eq!(r[0].weights, 2 * psi);
        assert_eq!(r[0].optimizer, 12 * psi);
        assert!(r[0].gradients >= 2 * psi && r[0].gradients <= 4 * psi);
        assert_eq!(r[1].optimizer, 14 * psi.div_ceil(4));
        assert_eq!(r[1].gradients, r[0].gradients + 4 * psi.div_ceil(4));
        // Stage 2 keeps one of the 12 blocks' gradients and an f32 slice of all.
        let m = network_memory(&gpt, 1, DType::F16).unwrap();
        assert_eq!(r[2].gradients, m.shared_gradients + 4 * psi.div_ceil(4));
        // Stage 3 is what a stage-3 replica allocates: one block's streamed matrices
        // beside the embeddings and the tensors under the persistence threshold.
        let m3 = stage3_memory(&gpt, 1, DType::F16, 100_000).unwrap();
        assert_eq!(r[3].weights, m3.weights);
        assert_eq!(r[3].gradients, m3.gradients + 4 * psi.div_ceil(4));
        assert_eq!(r[3].activations, m3.activations);
        assert!(r[3].weights < r[0].weights && m3.streamed > 0);
        assert!(r.iter().all(|s| s.implemented));
        assert!(state(&r[0]) > state(&r[1]) && state(&r[1]) > state(&r[2]));
        assert!(state(&r[2]) > state(&r[3]));
        assert!(r.iter().take(3).all(|s| s.activations == r[0].activations));
    }

    #[test]
    fn sizes_take_a_number_and_a_binary_unit_and_nothing_else() {
        for (text, want) in [
            ("8GiB", 8u64 << 30),
            ("16GiB", 16 << 30),
            ("8G", 8 << 30),
            ("512MiB", 512 << 20),
            ("1.5GiB", 3 << 29),
            ("64K", 64 << 10),
            (" 2 TiB ", 2 << 40),
            ("3M", 3 << 20),
        ] {
            assert_eq!(parse_size("--fits", text).unwrap(), want, "{text}");
        }
        for (text, why) in [
            ("8", "no unit"),
            ("", "empty"),
            ("8GB", "`GB` could mean powers of 10 or of 2: write 8GiB"),
            ("512mb", "write 512MiB"),
            ("8gib", "`gib` is not a unit"),
            ("8GiBs", "`GiBs` is not a unit"),
            ("-8GiB", "not a number"),
            ("GiB", "not a number"),
            ("1.2.3G", "not a number"),
            (".5G", "not a number"),
            ("0G", "no memory at all"),
            ("99999999999T", "too large"),
        ] {
            let e = parse_size("--fits", text).unwrap_err().to_string();
            assert!(
                e.contains(why) && e.contains(&format!("{text:?}")) && e.contains("8GiB, 16G"),
                "{text}: {e}"
            );
        }
    }
}
