//! Records Kiln's commit for `kiln bench report` (`KILN_COMMIT`): `git rev-parse
//! --short HEAD`, with `+dirty` where tracked files differ from it, or `unknown`
//! outside a git checkout (a crates.io build).

use std::process::Command;

fn git(args: &[&str]) -> Option<String> {
    let out = Command::new("git").args(args).output().ok()?;
    out.status
        .success()
        .then(|| String::from_utf8_lossy(&out.stdout).trim().to_string())
}

fn main() {
    let commit = git(&["rev-parse", "--short", "HEAD"]).filter(|c| !c.is_empty());
    let dirty =
        git(&["status", "--porcelain", "--untracked-files=no"]).is_some_and(|s| !s.is_empty());
    let text = match commit {
        Some(c) if dirty => format!("{c}+dirty"),
        Some(c) => c,
        None => "unknown".into(),
    };
    println!("cargo:rustc-env=KILN_COMMIT={text}");
    // A new commit or checkout moves HEAD or the branch it names; staging changes the
    // index (the dirty mark).
    // Outside a checkout nothing of git's exists, and a missing path would rerun this
    // (and rebuild the crate) on every build: then only a change to this file does.
    println!("cargo:rerun-if-changed=build.rs");
    for path in [".git/HEAD", ".git/refs/heads", ".git/index"] {
        if std::path::Path::new(path).exists() {
            println!("cargo:rerun-if-changed={path}");
        }
    }
}
