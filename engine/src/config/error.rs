//! What is wrong with a config: each [`Problem`] with its key path, what was expected,
//! what was found and the fix, and all of them together in a [`ConfigError`].

use std::fmt;
use std::path::PathBuf;

/// One thing wrong with a config.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Problem {
    /// Key path, e.g. `fp16.loss_scale_window`; empty for the document as a whole;
    /// several, comma-separated, for one problem they share (`"auto"` values).
    pub path: String,
    /// What is wrong: the expected type or range and the value found.
    pub message: String,
    /// What to change.
    pub fix: String,
}

/// Everything wrong with a config, so the user can fix it in one round.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ConfigError {
    /// The file, when the config came from [`load`](super::load).
    pub file: Option<PathBuf>,
    /// At least one; at most the first 50 found.
    pub problems: Vec<Problem>,
    /// Problems found beyond those listed, only counted: a generated file with a
    /// million unknown keys should cost a million comparisons, not a million messages.
    pub omitted: usize,
}

impl fmt::Display for ConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let n = self.problems.len() + self.omitted;
        let plural = if n == 1 { "" } else { "s" };
        match &self.file {
            Some(file) => write!(f, "{}: ", file.display())?,
            None => write!(f, "training config: ")?,
        }
        write!(f, "{n} problem{plural}")?;
        for (i, p) in self.problems.iter().enumerate() {
            let path = if p.path.is_empty() {
                "(whole file)"
            } else {
                &p.path
            };
            write!(
                f,
                "\n  {}. {path}: {}\n     fix: {}",
                i + 1,
                p.message,
                p.fix
            )?;
        }
        if self.omitted > 0 {
            let plural = if self.omitted == 1 { "" } else { "s" };
            write!(
                f,
                "\n  … and {} more problem{plural} not listed",
                self.omitted
            )?;
        }
        Ok(())
    }
}

impl std::error::Error for ConfigError {}
