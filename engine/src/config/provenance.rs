//! Where each resolved value came from, as [`TrainConfig::explain`](super::TrainConfig::explain)
//! shows it.

use std::fmt;

use serde::Serialize;

/// Where a resolved value came from.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub enum Provenance {
    /// Not in the file: DeepSpeed's (or Kiln's) default.
    Default,
    /// Written in the file.
    File,
    /// Computed from other values; the string shows how.
    Inferred(String),
    /// Passed by the program (the world size).
    Caller,
}

impl fmt::Display for Provenance {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Provenance::Default => write!(f, "(default)"),
            Provenance::File => write!(f, "(file)"),
            Provenance::Inferred(how) => write!(f, "(inferred: {how})"),
            Provenance::Caller => write!(f, "(caller)"),
        }
    }
}
