//! The `pipeline` section: DeepSpeed's pipeline-engine settings where they apply to
//! Kiln's pipelines (`stages`, `partition`), and `kiln.pipeline_stages`, which says the
//! same as `pipeline.stages` in Kiln's own section.
//!
//! DeepSpeed reads `stages`, `partition`, `seed_layers`, `activation_checkpoint_interval`,
//! `pipe_partitioned` and `grad_partitioned` here (its `PipelineModule` takes the
//! partition method as `partition_method`; both spellings are read).
//! `activation_checkpoint_interval` N > 0 recomputes ranges of N blocks in backward
//! (see `activation_checkpointing.rs`); those that change nothing here are accepted
//! with a note.

use serde::Serialize;
use serde_json::{Map, Value};

use super::keys::{Inert, Spec};
use super::provenance::Provenance;
use super::reader::{describe, is_auto, Reader};
pub use crate::partition::PartitionMethod;

/// Stages a pipeline may have: a stage is a device, and Kiln opens at most this many.
pub const MAX_PIPELINE_STAGES: u64 = 64;

/// The resolved pipeline settings: 1 stage is no pipeline.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct PipelineConfig {
    pub stages: usize,
    pub partition: PartitionMethod,
}

impl Default for PipelineConfig {
    fn default() -> Self {
        PipelineConfig {
            stages: 1,
            partition: PartitionMethod::Parameters,
        }
    }
}

const SPEC: Spec = Spec {
    keys: &[
        "stages",
        "partition",
        "partition_method",
        "activation_checkpoint_interval",
    ],
    ignored: &[
        (
            "seed_layers",
            Inert::Any,
            "Kiln draws every weight in model order from kiln.seed, so a pipeline starts \
             from the same weights as one device whatever the stages",
        ),
        (
            "pipe_partitioned",
            Inert::Any,
            "it splits the activations sent between stages over tensor-parallel ranks, and \
             Kiln has no tensor parallelism",
        ),
        (
            "grad_partitioned",
            Inert::Any,
            "it splits the activation gradients sent between stages over tensor-parallel \
             ranks, and Kiln has no tensor parallelism",
        ),
    ],
    unsupported: &[],
    hints: &[],
};

const PARTITION_EXPECTED: &str = "\"parameters\", \"uniform\" or a list of blocks per stage \
                                  such as [3, 5]";

impl Reader {
    /// The `pipeline` section and `kiln.pipeline_stages` (read by `kiln`, passed here).
    pub(super) fn pipeline(
        &mut self,
        root: &Map<String, Value>,
        kiln_stages: Option<u64>,
    ) -> PipelineConfig {
        let d = PipelineConfig::default();
        let empty = Map::new();
        let sec = self.section(root, "", "pipeline").ok().flatten();
        let p = "pipeline";
        if let Some(s) = sec {
            self.check_keys(s, p, &SPEC);
        }
        let s = sec.unwrap_or(&empty);
        // "auto" is DeepSpeed's default: the PipelineModule in the user's script decides.
        let stages = if s.get("stages").is_some_and(is_auto) {
            self.note(
                "pipeline.stages \"auto\" leaves the stage count to kiln.pipeline_stages or \
                 --pipeline-stages (default 1: no pipeline)",
            );
            None
        } else {
            self.uint(s, p, "stages", 1, MAX_PIPELINE_STAGES, Some(1))
                .ok()
                .flatten()
        };
        let stages = match (stages, kiln_stages) {
            (Some(a), Some(b)) if a != b => {
                self.problem(
                    "pipeline.stages",
                    format!("{a} stages, but kiln.pipeline_stages says {b}"),
                    "set one of them (they mean the same), or make them equal",
                );
                a
            }
            (Some(a), _) => {
                self.mark("pipeline.stages", Provenance::File);
                a
            }
            (None, Some(b)) => {
                self.mark(
                    "pipeline.stages",
                    Provenance::Inferred("kiln.pipeline_stages".to_string()),
                );
                b
            }
            (None, None) => {
                self.mark("pipeline.stages", Provenance::Default);
                d.stages as u64
            }
        } as usize;
        let partition = self.partition(s, stages);
        // Read (and its type checked) here; what it turns on is activation_checkpointing.rs's.
        let _ = self.uint(s, p, "activation_checkpoint_interval", 0, u64::MAX, Some(0));
        PipelineConfig { stages, partition }
    }

    fn partition(&mut self, s: &Map<String, Value>, stages: usize) -> PartitionMethod {
        let d = PartitionMethod::Parameters;
        // DeepSpeed's section says "partition"; its PipelineModule "partition_method".
        let key = match (s.get("partition"), s.get("partition_method")) {
            (Some(a), Some(b)) if !a.is_null() && !b.is_null() => {
                self.problem(
                    "pipeline.partition_method",
                    "both pipeline.partition and pipeline.partition_method are set",
                    "keep one of them (they mean the same)",
                );
                return d;
            }
            (Some(v), _) if !v.is_null() => "partition",
            (_, Some(v)) if !v.is_null() => "partition_method",
            _ => {
                self.mark("pipeline.partition", Provenance::Default);
                return d;
            }
        };
        let path = format!("pipeline.{key}");
        let Ok(Some(v)) = self.raw(s, &path, key, PARTITION_EXPECTED) else {
            return d;
        };
        let got = match v {
            Value::String(text) => match text.to_ascii_lowercase().as_str() {
                "parameters" => Some(PartitionMethod::Parameters),
                // DeepSpeed's section default: its engine leaves the method to the
                // PipelineModule, whose default is "parameters".
                "best" => {
                    self.note(format!(
                        "{path} \"best\" (DeepSpeed's default) is read as \"parameters\", the \
                         PipelineModule's default"
                    ));
                    Some(PartitionMethod::Parameters)
                }
                "uniform" => Some(PartitionMethod::Uniform),
                t if t.starts_with("type:") => {
                    self.problem(
                        &path,
                        format!(
                            "{text:?} balances layers whose class name matches a pattern; \
                             Kiln's GPT blocks are all alike, so it would cut them like \
                             \"uniform\""
                        ),
                        "use \"uniform\", \"parameters\", or a list of blocks per stage such \
                         as [3, 5]",
                    );
                    None
                }
                _ => {
                    self.problem(
                        &path,
                        format!("unknown partition method {text:?}"),
                        format!("use {PARTITION_EXPECTED}"),
                    );
                    None
                }
            },
            Value::Array(list) => {
                let counts: Option<Vec<usize>> = list
                    .iter()
                    .map(|c| c.as_u64().filter(|&n| n >= 1).map(|n| n as usize))
                    .collect();
                match counts {
                    Some(c) if !c.is_empty() && (stages <= 1 || c.len() == stages) => {
                        Some(PartitionMethod::Blocks(c))
                    }
                    Some(c) if !c.is_empty() => {
                        self.problem(
                            &path,
                            format!("{} block counts for {stages} pipeline stages", c.len()),
                            "give one block count per stage, first stage first",
                        );
                        None
                    }
                    _ => {
                        self.problem(
                            &path,
                            format!("expected {PARTITION_EXPECTED}, found {}", describe(v)),
                            "give each stage's block count as an integer of at least 1",
                        );
                        None
                    }
                }
            }
            other => {
                self.wrong_value(&path, PARTITION_EXPECTED, other, Some("\"parameters\""));
                None
            }
        };
        match got {
            Some(method) => {
                self.mark("pipeline.partition", Provenance::File);
                if stages <= 1 && method != PartitionMethod::Parameters {
                    self.warnings.push(format!(
                        "{path} is set but the run has 1 pipeline stage, so nothing is cut; \
                         set pipeline.stages (or pass --pipeline-stages) to use it"
                    ));
                }
                method
            }
            None => d,
        }
    }
}
