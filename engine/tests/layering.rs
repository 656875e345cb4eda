//! The engine's folders are layers: each may import only the layers below it, so there
//! are no import cycles between folders and the graph knows nothing of any model. This
//! test reads every `crate::…` path in `engine/src` and checks it against the order.

use std::collections::BTreeSet;
use std::path::Path;

/// The layers, lowest first, and what each may import (besides itself and the leaf
/// files `error.rs`, `rng.rs`, `fsutil.rs`, which import only the device layer's
/// types).
const LAYERS: &[(&str, &[&str])] = &[
    ("device", &[]),
    ("graph", &["device"]),
    ("config", &["device"]),
    ("data", &["device"]),
    ("models", &["device", "graph", "data"]),
    ("parallel", &["device", "graph", "models"]),
    (
        "train",
        &["device", "graph", "config", "data", "models", "parallel"],
    ),
];

const LEAVES: &[&str] = &["error", "rng", "fsutil", "partition"];

/// Names `lib.rs` re-exports at the crate root, by the layer that defines them.
fn owner(name: &str) -> Option<&'static str> {
    Some(match name {
        "Buffer" | "Capabilities" | "Device" | "PendingDownload" | "DType" | "HostData"
        | "Kernel" | "BinaryOp" | "HeadsLayout" | "ReduceOp" | "ATTENTION_MAX_DIM"
        | "IGNORE_TARGET" | "Matmul" | "AdamStep" | "Optimizer" | "SgdStep" | "ActivationKind"
        | "RopeFreqs" | "RopeScaling" | "kernels" => "device",
        "Error" | "Result" => "error",
        "ConfigError" | "TrainConfig" | "DynamicScaling" => "config",
        "LossScaler" | "StepDecision" => "train",
        _ => return None,
    })
}

/// The first segment of every `crate::` path in the code of `text` (each name of a
/// `crate::{…}` group); comments, doc links included, are not imports.
fn crate_paths(text: &str) -> Vec<String> {
    let code: String = text
        .lines()
        .map(|l| l.split("//").next().unwrap_or(""))
        .collect::<Vec<_>>()
        .join("\n");
    let mut out = vec![];
    let mut rest = code.as_str();
    while let Some(i) = rest.find("crate::") {
        rest = &rest[i + "crate::".len()..];
        if let Some(group) = rest.strip_prefix('{') {
            let end = group.find('}').unwrap_or(group.len());
            for item in group[..end].split(',') {
                let first = item.trim().split("::").next().unwrap_or("").trim();
                if !first.is_empty() {
                    out.push(first.to_string());
                }
            }
        } else {
            let name: String = rest
                .chars()
                .take_while(|c| c.is_alphanumeric() || *c == '_')
                .collect();
            out.push(name);
        }
    }
    out
}

#[test]
fn folders_import_only_the_layers_below_them() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut violations = BTreeSet::new();
    let mut checked = 0;
    for &(layer, allowed) in LAYERS {
        let mut stack = vec![src.join(layer)];
        assert!(stack[0].is_dir(), "engine/src/{layer}/ is missing");
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
                let text = std::fs::read_to_string(&path).unwrap();
                for first in crate_paths(&text) {
                    let dep = if LAYERS.iter().any(|l| l.0 == first)
                        || LEAVES.contains(&first.as_str())
                    {
                        first.clone()
                    } else {
                        match owner(&first) {
                            Some(o) => o.to_string(),
                            None => panic!(
                                "{}: `crate::{first}` is neither a layer nor a known root \
                                 re-export; add it to this test's table",
                                path.display()
                            ),
                        }
                    };
                    checked += 1;
                    let ok = dep == layer
                        || allowed.contains(&dep.as_str())
                        || (LEAVES.contains(&dep.as_str()));
                    if !ok {
                        let file = path.strip_prefix(&src).unwrap().display().to_string();
                        violations
                            .insert(format!("{file} ({layer}) imports {dep} via crate::{first}"));
                    }
                }
            }
        }
    }
    assert!(
        checked > 50,
        "only {checked} crate paths found: is the scan broken?"
    );
    assert!(
        violations.is_empty(),
        "imports against the layering:\n{}",
        violations.into_iter().collect::<Vec<_>>().join("\n")
    );
}

#[test]
fn the_scan_sees_grouped_and_plain_paths() {
    let paths =
        crate_paths("use crate::{DType, models::gpt::Gpt};\nlet x = crate::graph::Graph::new();");
    assert_eq!(paths, ["DType", "models", "graph"]);
    // And the check would catch a graph file importing a model.
    assert!(!LAYERS
        .iter()
        .find(|l| l.0 == "graph")
        .unwrap()
        .1
        .contains(&"models"));
}
