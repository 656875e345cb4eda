//! The workspace's files import in one direction: no circle of imports between the
//! files of a crate (the engine's `graph/`, whose autodiff, ops and plan are one idea
//! in three files, excepted), and the raw Vulkan backend does not depend on the wgpu
//! one, nor the shared lowering on either GPU API. This test reads every file's paths
//! (`crate::…`, `super::…`, a child module's name, a name the crate root re-exports),
//! resolves each to the file that defines it, and looks for circles.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

const CRATES: &[&str] = &[
    "src",
    "engine/src",
    "backends/cpu/src",
    "backends/lowering/src",
    "backends/wgpu/src",
    "backends/vulkan/src",
];

/// Folders whose files may import one another in a circle.
const CIRCLES_ALLOWED: &[&str] = &["engine/src::graph"];

/// A module path inside a crate: `["device", "open"]` for `device/open.rs`.
type Module = Vec<String>;

/// Every `.rs` file under `src` by its module path.
fn modules(src: &Path) -> BTreeMap<Module, PathBuf> {
    let mut out = BTreeMap::new();
    let mut stack = vec![src.to_path_buf()];
    while let Some(dir) = stack.pop() {
        for entry in std::fs::read_dir(&dir).unwrap() {
            let path = entry.unwrap().path();
            if path.is_dir() {
                stack.push(path);
                continue;
            }
            if path.extension().is_none_or(|e| e != "rs") {
                continue;
            }
            let rel = path.strip_prefix(src).unwrap().with_extension("");
            let mut m: Module = rel.iter().map(|s| s.to_string_lossy().into()).collect();
            if matches!(m.last().map(String::as_str), Some("mod" | "lib" | "main")) {
                m.pop();
            }
            out.insert(m, path);
        }
    }
    out
}

/// The code of a file without comments and string literals' contents.
fn code(text: &str) -> String {
    let mut out = String::new();
    for line in text.lines() {
        let line = line.split("//").next().unwrap_or("");
        let mut in_str = false;
        for c in line.chars() {
            if c == '"' {
                in_str = !in_str;
                out.push(c);
            } else if !in_str {
                out.push(c);
            }
        }
        out.push('\n');
    }
    // Everything from the first `#[cfg(test)]` module on is the file's own tests.
    match out.find("#[cfg(test)]\nmod tests") {
        Some(i) => out[..i].to_string(),
        None => out,
    }
}

fn ident(c: char) -> bool {
    c.is_alphanumeric() || c == '_'
}

/// Every path in `code` that starts with `head` (`crate`, `super`, `self` or a child
/// module's name) as whole segments, `{…}` groups expanded (one level deep).
fn paths(code: &str, head: &str) -> Vec<Vec<String>> {
    let pat = format!("{head}::");
    let mut out = vec![];
    let mut from = 0;
    while let Some(i) = code[from..].find(&pat) {
        let at = from + i;
        from = at + pat.len();
        let before = code[..at].chars().next_back();
        if before.is_some_and(|c| ident(c) || c == ':') {
            continue;
        }
        let rest = &code[from..];
        let mut segs = vec![];
        let mut r = rest;
        loop {
            let name: String = r.chars().take_while(|&c| ident(c)).collect();
            if name.is_empty() {
                break;
            }
            r = &r[name.len()..];
            segs.push(name);
            match r.strip_prefix("::") {
                Some(t) => r = t,
                None => break,
            }
        }
        if let Some(group) = r.strip_prefix('{') {
            let end = group.find('}').unwrap_or(group.len());
            for item in group[..end].split(',') {
                let mut p = segs.clone();
                p.extend(
                    item.split(" as ")
                        .next()
                        .unwrap_or("")
                        .split("::")
                        .map(|s| s.trim().to_string())
                        .filter(|s| !s.is_empty() && s != "self" && s.chars().all(ident)),
                );
                out.push(p);
            }
        } else {
            out.push(segs);
        }
    }
    out
}

/// Names the module `m` re-exports (`pub use a::b::{C, D as E}`), by the absolute
/// path they point to.
fn reexports(code: &str, m: &[String]) -> BTreeMap<String, Vec<String>> {
    let mut out = BTreeMap::new();
    for stmt in code.split(';') {
        let s = stmt.trim();
        let Some(rest) = s
            .strip_prefix("pub use ")
            .or_else(|| s.strip_prefix("pub(crate) use "))
        else {
            continue;
        };
        // Where the path starts: the crate root, the parent, or this module.
        let (base, rest): (Vec<String>, &str) = if let Some(r) = rest.strip_prefix("crate::") {
            (vec![], r)
        } else if let Some(r) = rest.strip_prefix("super::") {
            (m[..m.len().saturating_sub(1)].to_vec(), r)
        } else {
            (m.to_vec(), rest.strip_prefix("self::").unwrap_or(rest))
        };
        let (prefix, items) = match rest.find('{') {
            Some(i) => (&rest[..i], rest[i + 1..].trim_end_matches('}')),
            None => match rest.rfind("::") {
                Some(i) => (&rest[..i + 2], &rest[i + 2..]),
                None => continue,
            },
        };
        let mut full = base;
        full.extend(
            prefix
                .split("::")
                .map(str::trim)
                .filter(|s| !s.is_empty())
                .map(String::from),
        );
        for item in items.split(',') {
            let mut parts = item.split(" as ");
            let path = parts.next().unwrap_or("").trim();
            let name = parts
                .next()
                .unwrap_or(path.rsplit("::").next().unwrap_or(""))
                .trim();
            if name.is_empty() || name == "self" {
                continue;
            }
            let mut p = full.clone();
            p.extend(path.split("::").map(|s| s.trim().to_string()));
            out.insert(name.to_string(), p);
        }
    }
    out
}

/// `code` without its re-export statements (`pub use`): they name what a module
/// offers, not what its code uses.
fn without_reexports(code: &str) -> String {
    code.split_inclusive(';')
        .filter(|s| {
            let t = s.trim_start();
            !(t.starts_with("pub use ") || t.starts_with("pub(crate) use "))
        })
        .collect()
}

/// The file a path (absolute in the crate, without `crate`) lands in: its longest
/// prefix that is a module, or where that module's re-export of the next name points.
fn resolve(
    path: &[String],
    mods: &BTreeMap<Module, PathBuf>,
    reexported: &BTreeMap<Module, BTreeMap<String, Vec<String>>>,
    depth: usize,
) -> Option<Module> {
    let n = (0..=path.len())
        .rev()
        .find(|&n| mods.contains_key(&path[..n].to_vec()))?;
    let at = path[..n].to_vec();
    if let Some(target) = path.get(n).and_then(|name| reexported.get(&at)?.get(name)) {
        if depth < 8 {
            let mut t = target.clone();
            t.extend_from_slice(&path[n + 1..]);
            return resolve(&t, mods, reexported, depth + 1);
        }
    }
    Some(at)
}

/// The import edges of one crate: file -> the files it names.
fn edges(src: &Path) -> BTreeMap<Module, BTreeSet<Module>> {
    let mods = modules(src);
    let texts: BTreeMap<Module, String> = mods
        .iter()
        .map(|(m, p)| (m.clone(), code(&std::fs::read_to_string(p).unwrap())))
        .collect();
    let reexported: BTreeMap<Module, BTreeMap<String, Vec<String>>> = texts
        .iter()
        .map(|(m, t)| (m.clone(), reexports(t, m)))
        .collect();
    let mut out: BTreeMap<Module, BTreeSet<Module>> = BTreeMap::new();
    for (m, text) in &texts {
        let text = without_reexports(text);
        let mut targets = paths(&text, "crate");
        for p in paths(&text, "super") {
            let mut abs = m[..m.len().saturating_sub(1)].to_vec();
            abs.extend(p);
            targets.push(abs);
        }
        // A child module's items, named from its parent (`use dispatch::Recorder`).
        for c in mods
            .keys()
            .filter(|c| c.len() == m.len() + 1 && c[..m.len()] == m[..])
        {
            let name = c.last().unwrap();
            for head in [format!("self::{name}"), name.clone()] {
                for p in paths(&text, &head) {
                    let mut abs = c.clone();
                    abs.extend(p);
                    targets.push(abs);
                }
            }
        }
        for t in targets {
            if let Some(to) = resolve(&t, &mods, &reexported, 0) {
                if &to != m && !to.is_empty() {
                    out.entry(m.clone()).or_default().insert(to);
                }
            }
        }
    }
    out
}

/// A circle through `start` in `g`, as the files on it, if there is one.
fn circle(g: &BTreeMap<Module, BTreeSet<Module>>, start: &Module) -> Option<Vec<Module>> {
    let mut stack = vec![(start.clone(), vec![start.clone()])];
    let mut seen = BTreeSet::new();
    while let Some((at, trail)) = stack.pop() {
        for next in g.get(&at).into_iter().flatten() {
            if next == start {
                return Some(trail);
            }
            if seen.insert(next.clone()) {
                let mut t = trail.clone();
                t.push(next.clone());
                stack.push((next.clone(), t));
            }
        }
    }
    None
}

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

#[test]
fn no_file_imports_itself_through_others() {
    let mut found = vec![];
    let mut edges_seen = 0;
    for krate in CRATES {
        let g = edges(&root().join(krate));
        edges_seen += g.values().map(BTreeSet::len).sum::<usize>();
        // One circle per file is enough to report; files already on a reported
        // circle are not reported again.
        let mut reported = BTreeSet::new();
        for m in g.keys() {
            if reported.contains(m) {
                continue;
            }
            let allowed = |c: &[Module]| {
                CIRCLES_ALLOWED.iter().any(|a| {
                    let (k, folder) = a.split_once("::").unwrap();
                    k == *krate && c.iter().all(|f| f.first().is_some_and(|x| x == folder))
                })
            };
            if let Some(c) = circle(&g, m) {
                if allowed(&c) {
                    continue;
                }
                reported.extend(c.iter().cloned());
                let names: Vec<String> = c.iter().map(|f| f.join("/")).collect();
                found.push(format!("{krate}: {} -> {}", names.join(" -> "), names[0]));
            }
        }
    }
    assert!(
        edges_seen > 200,
        "only {edges_seen} imports found: is the scan broken?"
    );
    assert!(found.is_empty(), "import circles:\n{}", found.join("\n"));
}

#[test]
fn the_scan_resolves_groups_parents_children_and_reexports() {
    let text = code(
        "use crate::{a::X, b};\nuse super::c::Y;\nuse d::Z; // crate::e\nlet s = \"crate::f\";",
    );
    assert_eq!(
        paths(&text, "crate"),
        [vec!["a".to_string(), "X".into()], vec!["b".into()]]
    );
    assert_eq!(paths(&text, "super"), [vec!["c".to_string(), "Y".into()]]);
    assert_eq!(paths(&text, "d"), [vec!["Z".to_string()]]);
    let here = ["dev".to_string()];
    let r = reexports(
        "pub use gemm_plan::{plan as plan_matmul, MatmulPlan};",
        &here,
    );
    assert_eq!(r["plan_matmul"], ["dev", "gemm_plan", "plan"]);
    assert_eq!(r["MatmulPlan"], ["dev", "gemm_plan", "MatmulPlan"]);
    assert_eq!(reexports("pub use crate::x::Y;", &here)["Y"], ["x", "Y"]);
    // A circle is found, and a line is not one.
    let m = |s: &str| vec![s.to_string()];
    let mut g = BTreeMap::new();
    g.insert(m("a"), BTreeSet::from([m("b")]));
    g.insert(m("b"), BTreeSet::from([m("a")]));
    assert_eq!(circle(&g, &m("a")), Some(vec![m("a"), m("b")]));
    g.insert(m("b"), BTreeSet::new());
    assert_eq!(circle(&g, &m("a")), None);
}

/// Which workspace crates a crate's manifest depends on.
fn depends(manifest: &str, on: &str) -> bool {
    let text = std::fs::read_to_string(root().join(manifest)).unwrap();
    let deps = text
        .split("\n[")
        .filter(|s| s.starts_with("dependencies]"))
        .collect::<String>();
    deps.lines().any(|l| l.trim_start().starts_with(on))
}

#[test]
fn the_backends_depend_on_the_shared_lowering_not_on_each_other() {
    assert!(!depends("backends/vulkan/Cargo.toml", "kiln-wgpu"));
    assert!(depends("backends/vulkan/Cargo.toml", "kiln-lowering"));
    assert!(depends("backends/wgpu/Cargo.toml", "kiln-lowering"));
    for api in ["wgpu", "ash", "naga"] {
        assert!(
            !depends("backends/lowering/Cargo.toml", api),
            "kiln-lowering depends on {api}"
        );
    }
    assert!(
        !depends("engine/Cargo.toml", "kiln-"),
        "the engine depends on a backend"
    );
}
