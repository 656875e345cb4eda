//! Datasets of rows in every format `kiln prepare` reads give the same examples: the
//! Parquet fixtures (written by pyarrow, `tests/fixtures/datasets/make_parquet.py`, as
//! the hub's shards are: zstd and snappy pages, several row groups, a directory of two
//! shards, string and large_string, list and large_list columns), and CSV and TSV
//! written by Python's csv module (quotes, commas and newlines inside values), prepare
//! to the same token, mask and offset files, byte for byte, as their JSON Lines twins;
//! a binary column, a file that is not Parquet and a ragged CSV row are named.

use std::path::{Path, PathBuf};

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/datasets")
}

fn scratch() -> PathBuf {
    let d = std::env::temp_dir().join(format!("kiln-datasets-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// `kiln prepare input out --tokenizer bytes extra...`: (success, stderr).
fn prepare(input: &Path, out: &Path, extra: &[&str]) -> (bool, String) {
    let o = std::process::Command::new(env!("CARGO_BIN_EXE_kiln"))
        .arg("prepare")
        .args([input, out])
        .args(["--tokenizer", "bytes"])
        .args(extra)
        .output()
        .unwrap();
    (
        o.status.success(),
        String::from_utf8_lossy(&o.stderr).into_owned(),
    )
}

/// The example file's ids, mask and offsets.
fn files(bin: &Path) -> [Vec<u8>; 3] {
    ["", ".mask", ".examples"].map(|ext| {
        let mut p = bin.as_os_str().to_owned();
        p.push(ext);
        std::fs::read(PathBuf::from(p)).unwrap()
    })
}

#[test]
fn parquet_shards_prepare_to_the_same_examples_as_json_lines() {
    let dir = scratch();
    let template = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/chat_templates/chatml_generation.jinja");
    let chat = [
        "--chat-template",
        template.to_str().unwrap(),
        "--date",
        "2026-07-26",
    ];
    for (jsonl, parquet, extra, examples) in [
        ("pc.jsonl", "pc.parquet", &[][..], 8),
        ("pc.jsonl", "pc.csv", &[][..], 8),
        ("pc.jsonl", "pc.tsv", &[][..], 8),
        ("messages.jsonl", "messages", &chat[..], 4),
    ] {
        let (a, b) = (dir.join("a.bin"), dir.join("b.bin"));
        let (ok, err) = prepare(&fixtures().join(jsonl), &a, extra);
        assert!(ok, "{err}");
        let (ok, err) = prepare(&fixtures().join(parquet), &b, extra);
        assert!(ok, "{err}");
        assert!(err.contains(&format!("{parquet}: ")), "{err}");
        let (want, got) = (files(&a), files(&b));
        assert_eq!(got, want, "{parquet} against {jsonl}");
        let offsets = &got[2];
        assert_eq!(offsets.len(), 8 * (examples + 1), "{parquet}");
        assert!(
            got[1].contains(&1) && got[1].contains(&0),
            "{parquet}: a real mask"
        );
    }

    // A directory of two splits: which one is read must be said.
    let splits = dir.join("splits");
    std::fs::create_dir_all(&splits).unwrap();
    let shards = fixtures().join("messages/data");
    for name in [
        "train-00000-of-00002.parquet",
        "train-00001-of-00002.parquet",
    ] {
        std::fs::copy(shards.join(name), splits.join(name)).unwrap();
    }
    std::fs::copy(
        shards.join("train-00000-of-00002.parquet"),
        splits.join("test-00000-of-00001.parquet"),
    )
    .unwrap();
    let (ok, err) = prepare(&splits, &dir.join("s.bin"), &chat);
    assert!(
        !ok && err.contains("several splits (test, train)") && err.contains("--split"),
        "{err}"
    );
    let mut train = chat.to_vec();
    train.extend(["--split", "train"]);
    let (ok, err) = prepare(&splits, &dir.join("s.bin"), &train);
    assert!(ok, "{err}");
    let (ok, err) = prepare(
        &fixtures().join("messages.jsonl"),
        &dir.join("m.bin"),
        &chat,
    );
    assert!(ok, "{err}");
    assert_eq!(files(&dir.join("s.bin")), files(&dir.join("m.bin")));
    // A glob of the train shards (quoted: kiln expands it) reads the same rows; one
    // that matches nothing says so.
    let (ok, err) = prepare(&splits.join("train-*.parquet"), &dir.join("g.bin"), &chat);
    assert!(ok, "{err}");
    assert_eq!(files(&dir.join("g.bin")), files(&dir.join("m.bin")));
    let (ok, err) = prepare(&splits.join("valid-*.parquet"), &dir.join("g.bin"), &chat);
    assert!(!ok && err.contains("no file matches"), "{err}");
    train[5] = "validation";
    let (ok, err) = prepare(&splits, &dir.join("v.bin"), &train);
    assert!(
        !ok && err.contains("no shard of the split `validation`"),
        "{err}"
    );

    let (ok, err) = prepare(&fixtures().join("binary.parquet"), &dir.join("c.bin"), &[]);
    assert!(
        !ok && err.contains("row 1") && err.contains("`text` holds binary data"),
        "{err}"
    );
    let fake = dir.join("rows.parquet");
    std::fs::copy(fixtures().join("pc.jsonl"), &fake).unwrap();
    let (ok, err) = prepare(&fake, &dir.join("d.bin"), &[]);
    assert!(!ok && err.contains("not a Parquet file"), "{err}");
    let empty = dir.join("empty");
    std::fs::create_dir_all(&empty).unwrap();
    let (ok, err) = prepare(&empty, &dir.join("e.bin"), &[]);
    assert!(!ok && err.contains("without .parquet files"), "{err}");
    let ragged = dir.join("ragged.csv");
    std::fs::write(&ragged, "prompt,completion\n1+1=,2\n2+2=,4,extra\n").unwrap();
    let (ok, err) = prepare(&ragged, &dir.join("f.bin"), &[]);
    assert!(
        !ok && err.contains("line 3") && err.contains("not valid CSV"),
        "{err}"
    );
    assert!(!dir.join("c.bin").exists() && !dir.join("d.bin").exists());
    assert!(!dir.join("f.bin").exists());
    let _ = std::fs::remove_dir_all(&dir);
}
