//! Fingerprints the WGSL sources: the pipeline cache file is keyed by it, so a build
//! with changed kernels starts a fresh cache instead of growing the old one.

use std::path::Path;

fn visit(dir: &Path, files: &mut Vec<std::path::PathBuf>) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for e in entries.flatten() {
        let p = e.path();
        if p.is_dir() {
            visit(&p, files);
        } else {
            files.push(p);
        }
    }
}

fn main() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../shaders");
    println!("cargo:rerun-if-changed={}", root.display());
    let mut files = vec![];
    visit(&root, &mut files);
    files.sort();
    // FNV-1a over every file's relative name and bytes, in a fixed order.
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    let mut eat = |bytes: &[u8]| {
        for &b in bytes {
            h ^= b as u64;
            h = h.wrapping_mul(0x100_0000_01b3);
        }
    };
    for f in &files {
        println!("cargo:rerun-if-changed={}", f.display());
        eat(f
            .strip_prefix(&root)
            .unwrap_or(f)
            .to_string_lossy()
            .as_bytes());
        eat(&std::fs::read(f).unwrap_or_default());
    }
    println!("cargo:rustc-env=KILN_SHADER_HASH={h:016x}");
}
