//! The `kiln` section: Kiln's own settings (devices, data workers, step count, evaluation
//! and checkpoint intervals, seed, skipped steps tolerated), checked as strictly as
//! DeepSpeed's keys.

use serde::Serialize;
use serde_json::{Map, Value};

use super::keys::Spec;
use super::provenance::Provenance;
use super::reader::{describe, Reader};

/// Kiln's own settings, from the config's `kiln` section: what DeepSpeed leaves to its
/// launcher or to the user's script. Command-line flags of `kiln train` override them.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct KilnSettings {
    /// Devices to train on, as `kiln devices` names them; empty: the best adapter.
    pub devices: Vec<String>,
    /// Threads building batches ahead of the step.
    pub data_workers: usize,
    /// Batches built ahead (the prefetch queue's bound).
    pub prefetch_depth: usize,
    /// Optimizer steps in all; `None`: the scheduler's `total_num_steps`, else 1000.
    pub steps: Option<u64>,
    /// Evaluate every this many steps (and at the end); 0: only at the end.
    pub eval_every: u64,
    /// Checkpoint every this many steps (and at the end); 0: only at the end.
    pub checkpoint_every: u64,
    /// Checkpoints kept; older ones are deleted once a newer one is complete. 0: all.
    pub keep_checkpoints: usize,
    /// Seeds the weights and the data order.
    pub seed: u64,
    /// Without dynamic fp16 loss scaling (fp32, bf16, a static fp16 scale) nothing
    /// adapts after non-finite gradients, so this many skipped steps in a row stop
    /// training with an error instead of skipping forever.
    pub max_consecutive_skips: u64,
    /// A multi-process job (`mpirun`) stops, naming the process, when another has not
    /// reached a step's exchange or completed a collective within this many seconds
    /// (a process that died or hangs). The first step compiles kernels: allow for it.
    pub collective_timeout_s: u64,
    /// Pipeline stages, as `pipeline.stages` says it (where the resolved count lives:
    /// `TrainConfig::pipeline`); `None`: not set here.
    pub pipeline_stages: Option<u64>,
    /// Examples of an example file (`kiln prepare` of a dataset) are packed several to a
    /// row, attention kept within each; `false` gives each a row of its own, padded.
    /// Windows of text or token files are one document each either way. Training
    /// builds its networks packed when this is set and the data packs.
    pub packing: bool,
    /// LoRA adapters on the base model (`kiln.lora`); `None`: full fine-tuning.
    pub lora: Option<super::lora::LoraSection>,
}

impl Default for KilnSettings {
    fn default() -> Self {
        KilnSettings {
            devices: vec![],
            data_workers: 2,
            prefetch_depth: 4,
            steps: None,
            eval_every: 50,
            checkpoint_every: 200,
            keep_checkpoints: 3,
            seed: 1,
            max_consecutive_skips: 3,
            collective_timeout_s: 900,
            pipeline_stages: None,
            packing: true,
            lora: None,
        }
    }
}

const KILN: Spec = Spec::keys(&[
    "devices",
    "data_workers",
    "prefetch_depth",
    "steps",
    "eval_every",
    "checkpoint_every",
    "keep_checkpoints",
    "seed",
    "max_consecutive_skips",
    "collective_timeout_s",
    "pipeline_stages",
    "packing",
    "lora",
    "activation_checkpointing",
]);

impl Reader {
    pub(super) fn kiln(&mut self, root: &Map<String, Value>) -> KilnSettings {
        let empty = Map::new();
        let sec = self.section(root, "", "kiln").ok().flatten();
        let kp = "kiln";
        if let Some(s) = sec {
            self.check_keys(s, kp, &KILN);
        }
        let k = sec.unwrap_or(&empty);
        let d = KilnSettings::default();
        let path = "kiln.devices";
        let expected = "a list of device names such as [\"vulkan:0\"] (see `kiln devices`)";
        let devices = match self.raw(k, path, "devices", expected) {
            Ok(Some(Value::String(s))) => {
                self.mark(path, Provenance::File);
                s.split(',').map(|d| d.trim().to_string()).collect()
            }
            Ok(Some(Value::Array(list))) => {
                match list.iter().enumerate().find(|(_, v)| !v.is_string()) {
                    None => {
                        self.mark(path, Provenance::File);
                        list.iter()
                            .filter_map(|v| v.as_str().map(str::to_string))
                            .collect()
                    }
                    Some((i, v)) => {
                        self.problem(
                            path,
                            format!(
                                "devices[{i}] is {}, not a device name: expected {expected}",
                                describe(v)
                            ),
                            "write each device as a string, like \"vulkan:0\" or \"gl\"",
                        );
                        vec![]
                    }
                }
            }
            Ok(Some(v)) => {
                self.wrong_value(path, expected, v, None);
                vec![]
            }
            _ => {
                self.mark(path, Provenance::Default);
                vec![]
            }
        };
        let steps = self.uint(k, kp, "steps", 1, u64::MAX, None);
        let steps = match steps {
            Ok(Some(n)) => {
                self.mark("kiln.steps", Provenance::File);
                Some(n)
            }
            _ => None,
        };
        let pipeline_stages = match self.uint(
            k,
            kp,
            "pipeline_stages",
            1,
            super::pipeline::MAX_PIPELINE_STAGES,
            Some(1),
        ) {
            Ok(Some(n)) => {
                self.mark("kiln.pipeline_stages", Provenance::File);
                Some(n)
            }
            _ => None,
        };
        let count = (1, 1024);
        KilnSettings {
            devices,
            data_workers: self.uint_or(k, kp, "data_workers", count, d.data_workers as u64)
                as usize,
            prefetch_depth: self.uint_or(k, kp, "prefetch_depth", count, d.prefetch_depth as u64)
                as usize,
            steps,
            eval_every: self.uint_or(k, kp, "eval_every", (0, u64::MAX), d.eval_every),
            checkpoint_every: self.uint_or(
                k,
                kp,
                "checkpoint_every",
                (0, u64::MAX),
                d.checkpoint_every,
            ),
            keep_checkpoints: self.uint_or(
                k,
                kp,
                "keep_checkpoints",
                (0, 1_000_000),
                d.keep_checkpoints as u64,
            ) as usize,
            seed: self.uint_or(k, kp, "seed", (0, u64::MAX), d.seed),
            max_consecutive_skips: self.uint_or(
                k,
                kp,
                "max_consecutive_skips",
                (1, 1_000_000),
                d.max_consecutive_skips,
            ),
            collective_timeout_s: self.uint_or(
                k,
                kp,
                "collective_timeout_s",
                (1, 7 * 24 * 3600),
                d.collective_timeout_s,
            ),
            pipeline_stages,
            packing: self.bool_or(k, kp, "packing", d.packing),
            lora: self.lora(k),
        }
    }
}
