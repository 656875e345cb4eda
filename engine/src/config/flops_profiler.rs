//! The `flops_profiler` section: DeepSpeed's switch for a one-off profile of a training
//! step. Kiln honours it with its own profiler (`kiln train --profile`): a trace of
//! every kernel and host span and a table of where the step's time went, with FLOP/s.

use serde::Serialize;
use serde_json::{Map, Value};

use super::keys::{Inert, Spec};
use super::reader::Reader;

/// The resolved `flops_profiler` section.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct FlopsProfiler {
    pub enabled: bool,
    /// The first step profiled (1-based). DeepSpeed's default is 1; Kiln's is 2, since
    /// step 1 also compiles every kernel it runs.
    pub profile_step: u64,
}

impl Default for FlopsProfiler {
    fn default() -> Self {
        FlopsProfiler {
            enabled: false,
            profile_step: 2,
        }
    }
}

const SPEC: Spec = Spec {
    keys: &["enabled", "profile_step"],
    ignored: &[
        (
            "module_depth",
            Inert::Any,
            "it shapes DeepSpeed's per-module printout; Kiln's table is per kernel",
        ),
        (
            "top_modules",
            Inert::Any,
            "it shapes DeepSpeed's per-module printout; Kiln's table is per kernel",
        ),
        (
            "detailed",
            Inert::Any,
            "it shapes DeepSpeed's per-module printout; Kiln's table is per kernel",
        ),
        (
            "recompute_fwd_factor",
            Inert::Num(0.0),
            "Kiln does not recompute activations, so no forward pass is counted twice",
        ),
    ],
    unsupported: &[(
        "output_file",
        Inert::Null,
        "writing the profile elsewhere: Kiln writes trace.json and profile.txt into the \
         run directory",
    )],
    hints: &[],
};

impl Reader {
    pub(super) fn flops_profiler(&mut self, root: &Map<String, Value>) -> FlopsProfiler {
        let d = FlopsProfiler::default();
        let Some(sec) = self.section(root, "", "flops_profiler").ok().flatten() else {
            return d;
        };
        let p = "flops_profiler";
        self.check_keys(sec, p, &SPEC);
        FlopsProfiler {
            enabled: self.bool_or(sec, p, "enabled", d.enabled),
            profile_step: self.uint_or(sec, p, "profile_step", (1, u64::MAX), d.profile_step),
        }
    }
}
