//! Helpers shared by the engine's integration tests.

use std::path::PathBuf;

/// A fresh, empty directory for one test, under the system temporary directory.
pub fn scratch(test: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("kiln-engine-{}-{test}", std::process::id()));
    if d.exists() {
        std::fs::remove_dir_all(&d).unwrap();
    }
    std::fs::create_dir_all(&d).unwrap();
    d
}
