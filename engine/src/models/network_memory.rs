//! What a network needs before it is built: device bytes by what they hold
//! (`NetworkMemory`), the check that they fit the devices and the host
//! (`NetworkMemory::check_fit`), the host memory available (`host_memory_available`),
//! and ZeRO's accounting of the model states a device holds (`ModelStateBytes`).

use std::collections::HashSet;

use crate::{Capabilities, DType, Error, Result};

/// Device bytes a [`Network`] allocates, by what they hold.
///
/// [`Network`]: super::Network
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct NetworkMemory {
    /// The model copy in the storage dtype.
    pub weights: u64,
    /// Weights that are not trained (a LoRA run's base model), held once in the
    /// storage dtype.
    pub frozen: u64,
    /// Gradients (storage dtype; f32 for embeddings and norms).
    pub gradients: u64,
    /// The gradients' bytes once alike blocks share one set (ZeRO stage 2, see
    /// [`Network::share_block_gradients`]): the first block's and those of the
    /// parameters outside blocks, each in a buffer of its own.
    ///
    /// [`Network::share_block_gradients`]: super::Network::share_block_gradients
    pub shared_gradients: u64,
    /// The gradient tensors' own bytes (without the arenas' alignment gaps): what a
    /// data-parallel exchange moves per copy.
    pub gradient_tensors: u64,
    /// f32 master weights and the optimizer's two moments.
    pub optimizer: u64,
    /// The plan's buffers (activations saved for backward, their gradients and
    /// scratch, shared by liveness; losses, outputs, constants, small buffers) and the
    /// inputs.
    pub activations: u64,
    /// The largest single buffer: what must fit the adapter's largest buffer.
    pub largest_buffer: u64,
    /// The largest flat buffer of parameters (its f32 master weights or moments).
    pub largest_parameter_buffer: u64,
    /// The largest buffer a kernel binds whole ([`crate::Kernel::bound_whole`]; e.g. the
    /// embedding lookup binds its table): what must fit one kernel binding (GEMM
    /// operands, flat optimizer buffers and elementwise work over the limit are split).
    pub largest_binding: u64,
    /// Host bytes at the host's peak outside the devices: the model states' copy a
    /// checkpoint downloads, or the initial weights while they are drawn and uploaded,
    /// whichever is larger.
    pub host: u64,
    /// Host bytes of the model copies ZeRO stage 3 streams to the devices (one copy
    /// for every replica of a process; included in `host`).
    pub streamed: u64,
    /// The plan's largest buffer, and the largest flat buffer of parameters without
    /// the optimizer state (a model copy or gradient): what
    /// [`NetworkMemory::without_optimizer`] keeps.
    #[serde(skip)]
    pub largest_plan_buffer: u64,
    /// Host bytes building one replica takes (its initial weights while drawn and
    /// uploaded, and its streamed weights' copies): what a ZeRO replica, built after its
    /// group's check, checks on its own.
    #[serde(skip)]
    pub build_host: u64,
    #[serde(skip)]
    pub largest_stateless_buffer: u64,
}

impl NetworkMemory {
    /// A ZeRO group's network ([`NetworkMemory::without_optimizer`]) beside its shards
    /// (see `parallel::zero::shard_bytes`).
    pub fn with_shards(&self, shards: ShardBytes) -> NetworkMemory {
        let mut m = self.without_optimizer();
        m.optimizer += shards.device;
        m.host += shards.host;
        m.largest_parameter_buffer = m.largest_parameter_buffer.max(shards.largest);
        m.largest_buffer = m.largest_buffer.max(shards.largest);
        m
    }

    /// The network without its optimizer state (`Network::new_without_optimizer`: one
    /// empty f32 buffer stands for every master and moment).
    pub fn without_optimizer(&self) -> NetworkMemory {
        let largest_parameter_buffer = self.largest_stateless_buffer;
        NetworkMemory {
            optimizer: DType::F32.padded_bytes(0),
            largest_parameter_buffer,
            largest_buffer: self.largest_plan_buffer.max(largest_parameter_buffer),
            ..*self
        }
    }

    /// Host bytes at the peak for a group on `devices`: [`NetworkMemory::host`] and the
    /// memory of every device on a CPU adapter (lavapipe, llvmpipe, the CPU backend),
    /// which is the host's. Not counted: the drivers' own memory (a CPU adapter's
    /// compiled kernels among it) and the allocator's unreturned pages.
    pub fn host_bytes(&self, devices: &[&Capabilities]) -> u64 {
        let on_host = devices.iter().filter(|c| c.device_type == "cpu").count() as u64;
        self.host
            .saturating_add(self.total().saturating_mul(on_host))
    }

    pub fn total(&self) -> u64 {
        self.weights
            .saturating_add(self.frozen)
            .saturating_add(self.gradients)
            .saturating_add(self.optimizer)
            .saturating_add(self.activations)
    }

    /// Refuses, before anything is allocated, a network that cannot fit: on each device
    /// (its largest buffer, per-binding limit, and [`Capabilities::memory_cap`]: the
    /// user's --memory-limit, else the driver's budget, else a GPU's heap) and on the
    /// host (`host_available` bytes: the initial weights and checkpoints live there, and
    /// so does the memory of a CPU adapter such as lavapipe, llvmpipe or the CPU
    /// backend). `what` names the model; `dtype` is the storage precision, for the
    /// advice. The error says what does not fit, by how
    /// much, and what would.
    pub fn check_fit(
        &self,
        what: &str,
        dtype: DType,
        devices: &[&Capabilities],
        host_available: Option<u64>,
    ) -> Result<()> {
        let params_kind = "a flat buffer of parameters: f32 master weights or moments";
        let kind = |bytes: u64| {
            if bytes <= self.largest_parameter_buffer {
                params_kind
            } else {
                "activations"
            }
        };
        let (mut over, mut params, mut activations, mut total) = (vec![], false, false, false);
        let mut seen = HashSet::new();
        for caps in devices {
            if !seen.insert((&caps.name, &caps.backend)) {
                continue;
            }
            let at = format!("`{}` ({})", caps.name, caps.backend);
            let big = if self.largest_buffer > caps.max_buffer {
                over.push(format!(
                    "its largest buffer, {} ({}), is over {at}'s largest buffer of {}",
                    human(self.largest_buffer),
                    kind(self.largest_buffer),
                    human(caps.max_buffer)
                ));
                Some(self.largest_buffer)
            } else if self.largest_binding > caps.max_storage_binding {
                over.push(format!(
                    "a kernel binds {} at once ({}), over {at}'s per-binding limit of {} \
                     (GEMMs, elementwise kernels and the optimizer split theirs; this \
                     one cannot)",
                    human(self.largest_binding),
                    if self.largest_binding <= self.largest_parameter_buffer {
                        "a parameter tensor"
                    } else {
                        "activations"
                    },
                    human(caps.max_storage_binding)
                ));
                Some(self.largest_binding)
            } else {
                None
            };
            match big {
                Some(b) if b <= self.largest_parameter_buffer => params = true,
                Some(_) => activations = true,
                None => {}
            }
            if let Some((limit, what)) = caps.memory_cap().filter(|&(l, _)| self.total() > l) {
                over.push(format!(
                    "{} per device is over {at}'s {what} of {}",
                    human(self.total()),
                    human(limit),
                ));
                total = true;
            }
        }
        let on_host = devices.iter().filter(|c| c.device_type == "cpu").count() as u64;
        let need = self.host_bytes(devices);
        if let Some(avail) = host_available.filter(|&a| need > a) {
            let devices = if on_host == 0 {
                String::new()
            } else {
                format!(
                    " + {on_host} × {} for the device(s) on a CPU adapter (lavapipe, \
                     llvmpipe and the CPU backend keep device memory in host memory)",
                    human(self.total())
                )
            };
            over.push(format!(
                "the host needs {}: {} for the model states a checkpoint gathers (or the \
                 initial weights) beside any offloaded optimizer state and stage 3's \
                 streamed weights{devices}, over the {} available",
                human(need),
                human(self.host),
                human(avail)
            ));
            total = true;
        }
        if over.is_empty() {
            return Ok(());
        }
        let mut fixes = vec![];
        if params {
            fixes.push(
                "a smaller largest parameter tensor (in a language model usually the \
                 embedding, vocab_size × n_embd, which the lookup binds whole in the \
                 storage precision: fp16 or bf16 halves it)",
            );
        }
        if total && self.frozen == 0 {
            fixes.push(
                "LoRA (`--lora` or kiln.lora: the frozen base has no gradients, master \
                 weights or moments)",
            );
        }
        if total {
            fixes.push("a smaller model (n_layer, n_embd, vocab_size)");
        }
        if total && self.optimizer > 0 {
            fixes.push(
                "ZeRO stage 1 or 2 over more devices (each holds a slice of the f32 master + \
                 optimizer bytes) or zero_optimization.offload_optimizer (none of them on the \
                 devices)",
            );
        }
        if total && self.streamed == 0 {
            fixes.push(
                "ZeRO stage 3 (each device holds one block's weights and gradients; the \
                 blocks' weights wait in host memory)",
            );
        }
        let act_heavy = self.activations >= self.total() / 4;
        if total && act_heavy {
            fixes.push(
                "activation checkpointing (kiln.activation_checkpointing: blocks recompute \
                 their forward in backward)",
            );
        }
        if activations || (total && act_heavy) {
            fixes.push(
                "a smaller micro-batch (train_micro_batch_size_per_gpu, with more \
                 gradient_accumulation_steps to keep the global batch) or a shorter sequence",
            );
        }
        if (activations || total) && dtype == DType::F32 {
            fixes.push(
                "fp16 or bf16 storage (halves weights, gradients and activations; the master \
                 weights and Adam moments stay f32)",
            );
        }
        if total && on_host > 1 {
            fixes
                .push("fewer devices on a CPU adapter (each keeps a whole replica in host memory)");
        }
        Err(Error::InvalidArgument(format!(
            "{what} does not fit, so nothing was allocated: it needs {} per device (weights \
             {}{}, gradients {}, f32 master + optimizer {}, activations {}; `kiln estimate` \
             shows them); {}. Try {}.",
            human(self.total()),
            human(self.weights),
            match self.frozen {
                0 => String::new(),
                f => format!(", frozen base {}", human(f)),
            },
            human(self.gradients),
            human(self.optimizer),
            human(self.activations),
            over.join("; "),
            fixes.join(", or ")
        )))
    }
}

/// Bytes as a person reads them (binary units).
pub fn human(bytes: u64) -> String {
    let units = ["bytes", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB"];
    let mut x = bytes as f64;
    let mut u = 0;
    while x >= 1024.0 && u + 1 < units.len() {
        x /= 1024.0;
        u += 1;
    }
    if u == 0 {
        format!("{bytes} bytes")
    } else {
        format!("{x:.1} {}", units[u])
    }
}

/// This process's peak resident memory so far (Linux's VmHWM); `None` elsewhere.
pub fn host_peak_resident() -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let v = status.lines().find_map(|l| l.strip_prefix("VmHWM:"))?;
    let kib: u64 = v.trim().strip_suffix("kB")?.trim().parse().ok()?;
    Some(kib.saturating_mul(1024))
}

/// Memory the host can still give this process, when it says: Linux's MemAvailable,
/// lowered to the headroom under a cgroup v2 memory limit and under the process's
/// address-space limit (`ulimit -v`) where those are set. `None` elsewhere.
pub fn host_memory_available() -> Option<u64> {
    let read = |path: &str| std::fs::read_to_string(path).ok();
    // "Key:   123 kB" lines of /proc files, in bytes.
    let kib = |text: &str, key: &str| -> Option<u64> {
        let v = text.lines().find_map(|l| l.strip_prefix(key))?;
        let n: u64 = v.trim().strip_suffix("kB")?.trim().parse().ok()?;
        Some(n.saturating_mul(1024))
    };
    let mut avail = kib(&read("/proc/meminfo")?, "MemAvailable:")?;
    let number = |path: &str| read(path)?.trim().parse::<u64>().ok();
    if let (Some(max), Some(current)) = (
        number("/sys/fs/cgroup/memory.max"),
        number("/sys/fs/cgroup/memory.current"),
    ) {
        avail = avail.min(max.saturating_sub(current));
    }
    let limit = read("/proc/self/limits").and_then(|t| {
        let line = t.lines().find(|l| l.starts_with("Max address space"))?;
        line.split_whitespace().nth(3)?.parse::<u64>().ok()
    });
    let used = read("/proc/self/status").and_then(|t| kib(&t, "VmSize:"));
    if let (Some(limit), Some(used)) = (limit, used) {
        avail = avail.min(limit.saturating_sub(used));
    }
    Some(avail)
}

/// The optimizer state of a ZeRO group's shards: the most bytes any one device holds
/// (none when offloaded), the bytes in this process's host memory (offloaded), and the
/// largest single buffer a device allocates for them (an f32 slice).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ShardBytes {
    pub device: u64,
    pub host: u64,
    pub largest: u64,
}

/// A device's bytes of model states, by what they hold (ZeRO's accounting).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct ModelStateBytes {
    pub weights: u64,
    pub gradients: u64,
    /// f32 master weights, optimizer moments and what updates them.
    pub optimizer: u64,
    /// Host memory holding this device's optimizer state instead (ZeRO-Offload: its
    /// shard's f32 master weights and moments); not device bytes, so not in `total`.
    #[serde(default)]
    pub offloaded: u64,
}

impl ModelStateBytes {
    /// Device bytes.
    pub fn total(&self) -> u64 {
        self.weights + self.gradients + self.optimizer
    }
}
