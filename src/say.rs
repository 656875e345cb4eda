//! Lines for the terminal that never fail a run.

use std::io::Write;

/// Writes a line to stderr, ignoring failure: a closed pipe (`2>&1 | head`) or a
/// terminal gone after SIGHUP must neither panic nor stop training, and everything a
/// log line says is also in the run directory.
pub fn say(line: impl std::fmt::Display) {
    let _ = writeln!(std::io::stderr().lock(), "{line}");
}

/// [`say`] for stdout.
pub fn say_out(line: impl std::fmt::Display) {
    let _ = writeln!(std::io::stdout().lock(), "{line}");
}
