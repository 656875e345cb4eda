//! Records Kiln's commit for `kiln bench report` (`KILN_COMMIT`): `git rev-parse
//! --short HEAD`, with `+dirty` where tracked files differ from it, or `unknown`
//! outside a git checkout of this repository (a crates.io build, a copy).

use std::path::{Path, PathBuf};
use std::process::Command;

fn git(dir: &Path, args: &[&str]) -> Option<String> {
    let out = Command::new("git")
        .arg("--no-optional-locks")
        .arg("-C")
        .arg(dir)
        .args(args)
        .output()
        .ok()?;
    out.status
        .success()
        .then(|| String::from_utf8_lossy(&out.stdout).trim().to_string())
}

fn main() {
    let here = PathBuf::from(std::env::var("CARGO_MANIFEST_DIR").expect("set by cargo"));
    println!("cargo:rerun-if-changed=build.rs");
    // This repository's own checkout only, not one it happens to sit inside.
    let top = git(&here, &["rev-parse", "--show-toplevel"]).map(PathBuf::from);
    let ours = top.is_some_and(|t| t.canonicalize().ok() == here.canonicalize().ok());
    let commit = ours
        .then(|| git(&here, &["rev-parse", "--short", "HEAD"]))
        .flatten()
        .filter(|c| !c.is_empty());
    let text = match commit {
        Some(c) => {
            let dirty = git(&here, &["status", "--porcelain", "--untracked-files=no"])
                .is_some_and(|s| !s.is_empty());
            // A commit, a checkout or staging moves these; an edit to a tracked file
            // changes the sources below (the dirty mark).
            for p in ["HEAD", "index", "refs/heads", "packed-refs"] {
                if let Some(path) = git(&here, &["rev-parse", "--git-path", p]) {
                    let path = here.join(path);
                    if path.exists() {
                        println!("cargo:rerun-if-changed={}", path.display());
                    }
                }
            }
            for dir in ["src", "engine", "backends", "shaders", "Cargo.toml"] {
                println!("cargo:rerun-if-changed={dir}");
            }
            match dirty {
                true => format!("{c}+dirty"),
                false => c,
            }
        }
        None => "unknown".into(),
    };
    println!("cargo:rustc-env=KILN_COMMIT={text}");
}
