//! Helpers shared by the engine's integration tests.

use std::path::PathBuf;

/// A fresh, empty directory for one test, under the system temporary directory;
/// removed again when the test is done with it (pass or fail).
pub struct Scratch(PathBuf);

impl std::ops::Deref for Scratch {
    type Target = PathBuf;
    fn deref(&self) -> &PathBuf {
        &self.0
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        std::fs::remove_dir_all(&self.0).ok();
    }
}

pub fn scratch(test: &str) -> Scratch {
    let d = std::env::temp_dir().join(format!("kiln-engine-{}-{test}", std::process::id()));
    if d.exists() {
        std::fs::remove_dir_all(&d).unwrap();
    }
    std::fs::create_dir_all(&d).unwrap();
    Scratch(d)
}
