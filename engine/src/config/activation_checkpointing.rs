//! The `activation_checkpointing` section and `kiln.activation_checkpointing`: each
//! block's forward recomputed right before its backward, so only the blocks'
//! boundaries stay alive through the step (`models::checkpointed`). DeepSpeed's section
//! configures its checkpointing API, which a model's code calls; Kiln's models are on
//! the graph, so the section being there turns checkpointing on for every block, and
//! `kiln.activation_checkpointing` says `"blocks"` (every block) or N (ranges of N
//! blocks), as DeepSpeed's `pipeline.activation_checkpoint_interval` N does. Of
//! DeepSpeed's keys, those that would change training and are not
//! implemented are refused with the reason; the others are accepted with what they mean
//! here.

use serde_json::{Map, Value};

use super::keys::{Inert, Spec};
use super::provenance::Provenance;
use super::reader::{describe, Reader};

const SPEC: Spec = Spec {
    keys: &[],
    ignored: &[
        (
            "contiguous_memory_optimization",
            Inert::Any,
            "Kiln's plan already places every buffer, checkpoints included, by liveness in \
             shared slots",
        ),
        (
            "number_checkpoints",
            Inert::Any,
            "it sizes DeepSpeed's contiguous buffer; Kiln checkpoints every block (or the \
             ranges kiln.activation_checkpointing gives)",
        ),
        (
            "synchronize_checkpoint_boundary",
            Inert::Any,
            "a device queue runs its launches in order: nothing to synchronize",
        ),
        (
            "profile",
            Inert::Any,
            "the recomputed forward shows in kiln train --profile's table and kiln bench \
             train --activation-checkpointing",
        ),
    ],
    unsupported: &[
        (
            "partition_activations",
            Inert::Bool(false),
            "splitting checkpoints across model-parallel ranks: Kiln has no tensor \
             parallelism, so there are no ranks to split them across",
        ),
        (
            "cpu_checkpointing",
            Inert::Bool(false),
            "keeping checkpoints in host memory (the boundaries stay on the device; they \
             are one activation per block)",
        ),
    ],
    hints: &[],
};

impl Reader {
    /// Blocks per recomputed range, or `None`: no activation checkpointing.
    pub(super) fn activation_checkpointing(&mut self, root: &Map<String, Value>) -> Option<usize> {
        let p = "activation_checkpointing";
        let section = match root.get(p) {
            Some(Value::Object(sec)) => {
                self.check_keys(sec, p, &SPEC);
                true
            }
            Some(Value::Null) | None => false,
            Some(v) => {
                self.wrong_value(p, "an object { ... }", v, None);
                false
            }
        };
        let kiln = root.get("kiln").and_then(Value::as_object);
        let path = "kiln.activation_checkpointing";
        let expected = "\"blocks\" (every block) or a number of blocks per recomputed range";
        let own = match kiln.and_then(|k| k.get("activation_checkpointing")) {
            None | Some(Value::Null) | Some(Value::Bool(false)) => None,
            Some(Value::String(s)) if s == "blocks" => Some(1),
            Some(Value::Bool(true)) => Some(1),
            Some(Value::Number(n)) if n.as_u64().is_some_and(|n| (1..=4096).contains(&n)) => {
                n.as_u64().map(|n| n as usize)
            }
            Some(v) => {
                self.problem(
                    path,
                    format!("expected {expected}, found {}", describe(v)),
                    "write \"blocks\", or 2 for ranges of two blocks (fewer boundaries kept, \
                     twice the activations alive while one range's backward runs)",
                );
                None
            }
        };
        // DeepSpeed's pipeline key: layers per checkpointed range (0: none).
        let interval = root
            .get("pipeline")
            .and_then(|p| p.get("activation_checkpoint_interval"))
            .and_then(Value::as_u64)
            .filter(|&n| n > 0)
            .map(|n| n.min(4096) as usize);
        let every = own.or(interval).or(section.then_some(1));
        self.mark(
            path,
            match (own, interval, section) {
                (Some(_), _, _) => Provenance::File,
                (None, Some(_), _) => {
                    Provenance::Inferred("pipeline.activation_checkpoint_interval".into())
                }
                (None, None, true) => {
                    Provenance::Inferred("the activation_checkpointing section".into())
                }
                (None, None, false) => Provenance::Default,
            },
        );
        every
    }
}
