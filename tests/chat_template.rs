//! Chat templates against Python's jinja2 set up as `transformers` renders them
//! (`tests/fixtures/chat_templates/render_expected.py` wrote `expected.json`): real
//! templates of several families and training variants with `{% generation %}` tags,
//! over conversations with a system turn, HTML and non-ASCII text, no system turn, and
//! tool calls with a tool schema; Kiln's text must be the same bytes, its assistant
//! spans the same offsets and its errors the template's own messages. Then the bounds
//! an untrusted template runs in.

use std::path::{Path, PathBuf};
use std::time::SystemTime;

use kiln::engine::data::chat_template::{parse_date, ChatTemplate, MAX_OUTPUT};
use serde_json::Value;

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/chat_templates")
}

fn read_json(path: &Path) -> Value {
    serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

/// The date render_expected.py gives `strftime_now`.
fn date() -> Option<SystemTime> {
    Some(parse_date("26 Jul 2026").unwrap())
}

fn template(name: &str, source: &str) -> ChatTemplate {
    let manifest = read_json(&fixtures().join("templates.json"));
    let mut t = ChatTemplate::new(source, name, date()).unwrap();
    for (k, v) in manifest[name].as_object().unwrap() {
        if k.ends_with("_token") {
            t = t.with_special(k, v.as_str().unwrap());
        }
    }
    t
}

fn source(name: &str) -> String {
    let manifest = read_json(&fixtures().join("templates.json"));
    let file = manifest[name]["file"].as_str().unwrap();
    std::fs::read_to_string(fixtures().join(file)).unwrap()
}

#[test]
fn templates_render_byte_for_byte_as_transformers_does() {
    let cases = read_json(&fixtures().join("expected.json"));
    let cases = cases.as_array().unwrap();
    assert!(
        cases.len() >= 50,
        "expected.json holds {} cases",
        cases.len()
    );
    let (mut spans_seen, mut errors_seen) = (0, 0);
    for case in cases {
        let name = case["template"].as_str().unwrap();
        let row_name = case["row"].as_str().unwrap();
        let prompt = case["add_generation_prompt"].as_bool().unwrap();
        let row = read_json(&fixtures().join(format!("rows/{row_name}.json")));
        let what = format!("{name} over {row_name} (add_generation_prompt {prompt})");
        let got = template(name, &source(name)).render(&row, prompt);
        match case.get("error") {
            Some(want) => {
                let e = got.expect_err(&what).to_string();
                assert!(e.contains(want.as_str().unwrap()), "{what}: {e}");
                assert!(
                    e.contains(name),
                    "{what}: the error names the template: {e}"
                );
                errors_seen += 1;
            }
            None => {
                let got = got.unwrap_or_else(|e| panic!("{what}: {e}"));
                assert_eq!(got.text, case["text"].as_str().unwrap(), "{what}");
                let want: Vec<(usize, usize)> =
                    serde_json::from_value(case["assistant_spans"].clone()).unwrap();
                assert_eq!(got.char_spans(), want, "{what}");
                spans_seen += want.len();
            }
        }
    }
    // The fixtures exercise both: spans from the training variants, errors from
    // templates that refuse a system turn or tool messages.
    assert!(
        spans_seen >= 10 && errors_seen >= 4,
        "{spans_seen} spans, {errors_seen} errors"
    );
}

#[test]
fn a_template_with_crlf_line_ends_renders_as_with_lf() {
    let row = read_json(&fixtures().join("rows/tool_calls.json"));
    for name in ["qwen2.5", "llama3.2_generation"] {
        let lf = template(name, &source(name)).render(&row, true).unwrap();
        let crlf = template(name, &source(name).replace('\n', "\r\n"))
            .render(&row, true)
            .unwrap();
        assert_eq!(crlf, lf, "{name}");
    }
}

/// jinja2's answers, checked by hand in Python: `none is iterable` is False, an
/// undefined value is iterable; `tojson` keeps insertion order, non-ASCII and `<`
/// unescaped, with ", " and ": "; `none`, `True` print as Python prints them.
#[test]
fn jinja_traps_render_as_jinja2_does() {
    let t = |src: &str| ChatTemplate::new(src, "inline", None).unwrap();
    let row = serde_json::json!({
        "messages": [{"role": "user", "content": "x", "meta": {"z": 1, "a": [1.5, "<é>", null, true]}}]
    });
    let render = |src: &str| t(src).render(&row, false).unwrap().text;
    assert_eq!(
        render("{{ none is iterable }} {{ nothing is iterable }} {{ 'ab' is iterable }}"),
        "False True True"
    );
    assert_eq!(
        render("{{ messages[0].meta | tojson }}"),
        r#"{"z": 1, "a": [1.5, "<é>", null, true]}"#
    );
    assert_eq!(
        render("{{ messages[0].meta | tojson(indent=2) }}"),
        "{\n  \"z\": 1,\n  \"a\": [\n    1.5,\n    \"<é>\",\n    null,\n    true\n  ]\n}"
    );
    assert_eq!(
        render("{{ none }} {{ true }} {{ false }}"),
        "None True False"
    );
    assert_eq!(
        render("{{ '  a b  '.strip() }}|{{ 'x,y'.split(',') | length }}"),
        "a b|2"
    );
}

#[test]
fn untrusted_templates_are_bounded_and_errors_name_the_problem() {
    let row = serde_json::json!({"messages": [{"role": "user", "content": "hi"}]});
    let fails = |src: &str| -> String {
        match ChatTemplate::new(src, "evil.jinja", None) {
            Err(e) => e.to_string(),
            Ok(t) => t.render(&row, false).unwrap_err().to_string(),
        }
    };
    // A loop that does not end (nested ranges: minijinja caps one range's length).
    let e =
        fails("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}");
    assert!(e.contains("evil.jinja") && e.contains("fuel"), "{e}");
    // Recursion without end.
    let e = fails("{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}");
    assert!(e.contains("evil.jinja") && e.contains("recursion"), "{e}");
    // Gigabytes of output: stopped at the cap.
    let e = fails("{% for i in range(100000) %}{{ 'x' * 100000 }}{% endfor %}");
    assert!(
        e.contains("evil.jinja") && e.contains(&format!("{} MiB", MAX_OUTPUT >> 20)),
        "{e}"
    );
    // A syntax error: its line.
    let e = fails("{% for m in messages %}\n{{ m.content }\n{% endfor %}");
    assert!(
        e.contains("does not compile") && e.contains("line 2"),
        "{e}"
    );
    // The template's own refusal, in its words.
    let e = fails("{{ raise_exception('Only user and assistant roles are supported!') }}");
    assert!(
        e.contains(
            "evil.jinja: the chat template failed: Only user and assistant roles are supported!"
        ),
        "{e}"
    );
    // No file or environment access: such functions do not exist.
    let e = fails("{% include '/etc/passwd' %}");
    assert!(e.contains("evil.jinja"), "{e}");
    // A conversation holding the span markers, under a template with generation tags.
    let t = ChatTemplate::new(
        "{% generation %}{{ messages[0].content }}{% endgeneration %}",
        "g",
        None,
    )
    .unwrap();
    let marked = serde_json::json!({"messages": [{"role": "user", "content": "a\u{E000}b"}]});
    let e = t.render(&marked, false).unwrap_err().to_string();
    assert!(e.contains("U+E000"), "{e}");
    let e = t
        .render(&serde_json::json!({"rows": []}), false)
        .unwrap_err()
        .to_string();
    assert!(e.contains("no `messages`"), "{e}");
}

/// On the training variants, which mark the assistant's text with generation blocks,
/// finding it turn by turn (what Kiln does for templates without them) finds the same
/// turns: Llama's the same text up to the whitespace its blocks take in; the ChatML
/// variant's blocks also take the role header, which turn by turn leaves in the
/// generation prompt.
#[test]
fn turn_by_turn_spans_agree_with_generation_blocks() {
    let mut compared = 0;
    for (name, header) in [
        ("llama3.2_generation", ""),
        ("chatml_generation", "<|im_start|>assistant\n"),
    ] {
        let t = template(name, &source(name));
        for row_name in ["multi_turn_system", "no_system"] {
            let row = read_json(&fixtures().join(format!("rows/{row_name}.json")));
            let tags = t.render(&row, false).unwrap();
            let turns = t.spans_by_turns(&row).unwrap();
            assert_eq!(tags.text, turns.text);
            let texts = |r: &kiln::engine::data::chat_template::Rendered| -> Vec<String> {
                r.assistant_spans
                    .iter()
                    .map(|s| r.text[s.clone()].trim().to_string())
                    .collect()
            };
            let turns: Vec<String> = texts(&turns)
                .into_iter()
                .map(|t| format!("{header}{t}"))
                .collect();
            assert_eq!(turns, texts(&tags), "{name} over {row_name}");
            compared += tags.assistant_spans.len();
        }
    }
    assert!(compared >= 6, "{compared}");
}

/// GPT-2's byte-to-character table: printable bytes as themselves, the rest from U+0100.
fn byte_chars() -> Vec<char> {
    let printable =
        |b: u32| (33..=126).contains(&b) || (161..=172).contains(&b) || (174..=255).contains(&b);
    let mut extra = 0;
    (0..256u32)
        .map(|b| {
            if printable(b) {
                char::from_u32(b).unwrap()
            } else {
                extra += 1;
                char::from_u32(255 + extra).unwrap()
            }
        })
        .collect()
}

/// A model directory with a byte-level tokenizer (one token per byte, no merges, ChatML's
/// two special tokens as 256 and 257) and `template` as its chat template.
fn chatml_model(tag: &str, template: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("kiln-template-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let vocab: serde_json::Map<String, Value> = byte_chars()
        .iter()
        .enumerate()
        .map(|(i, c)| (c.to_string(), i.into()))
        .collect();
    let special = |id: u32, content: &str| {
        serde_json::json!({"id": id, "content": content, "single_word": false, "lstrip": false,
            "rstrip": false, "normalized": false, "special": true})
    };
    let byte_level = serde_json::json!({"type": "ByteLevel", "add_prefix_space": false,
        "trim_offsets": false, "use_regex": true});
    let tok = serde_json::json!({
        "version": "1.0", "truncation": null, "padding": null,
        "added_tokens": [special(256, "<|im_start|>"), special(257, "<|im_end|>")],
        "normalizer": null, "pre_tokenizer": byte_level, "post_processor": byte_level,
        "decoder": byte_level,
        "model": {"type": "BPE", "dropout": null, "unk_token": null,
            "continuing_subword_prefix": null, "end_of_word_suffix": null, "fuse_unk": false,
            "byte_fallback": false, "vocab": vocab, "merges": []}
    });
    std::fs::write(dir.join("tokenizer.json"), tok.to_string()).unwrap();
    let cfg = serde_json::json!({"bos_token": null, "eos_token": "<|im_end|>", "chat_template": template});
    std::fs::write(dir.join("tokenizer_config.json"), cfg.to_string()).unwrap();
    dir
}

fn kiln(args: &[&str]) -> (bool, String, String) {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_kiln"))
        .args(args)
        .output()
        .unwrap();
    (
        out.status.success(),
        String::from_utf8(out.stdout).unwrap(),
        String::from_utf8(out.stderr).unwrap(),
    )
}

fn expected_case(template: &str, row: &str, prompt: bool) -> Value {
    read_json(&fixtures().join("expected.json"))
        .as_array()
        .unwrap()
        .iter()
        .find(|c| {
            c["template"] == template && c["row"] == row && c["add_generation_prompt"] == prompt
        })
        .unwrap()
        .clone()
}

/// `kiln template` on a model directory: the text is the template's (as jinja2 renders
/// it), the trained tokens are exactly the assistant spans' bytes (each token is one
/// byte here, so the mask can be checked against the text), by turns for SmolLM2's
/// template and by generation blocks for a training variant; the text view marks them.
#[test]
fn kiln_template_shows_the_trained_tokens() {
    let dir = chatml_model("cli", &source("smollm2"));
    let row = fixtures().join("rows/no_system.json");
    let (d, r) = (dir.to_str().unwrap(), row.to_str().unwrap());
    let chars = byte_chars();
    let text_of = |ids: &[u64]| -> String {
        let mut bytes = vec![];
        for &id in ids {
            match id {
                256 => bytes.extend_from_slice(b"<|im_start|>"),
                257 => bytes.extend_from_slice(b"<|im_end|>"),
                id => {
                    bytes.push(chars.iter().position(|&c| c == chars[id as usize]).unwrap() as u8)
                }
            }
        }
        String::from_utf8(bytes).unwrap()
    };
    let gen = fixtures().join("chatml_generation.jinja");
    for (extra, template, method) in [
        (None, "smollm2", "turn_by_turn"),
        (
            Some(gen.to_str().unwrap()),
            "chatml_generation",
            "generation_tags",
        ),
    ] {
        let mut args = vec!["template", d, "--messages", r, "--json"];
        if let Some(t) = extra {
            args.extend(["--chat-template", t]);
        }
        let (ok, out, err) = kiln(&args);
        assert!(ok, "{err}");
        let j: Value = serde_json::from_str(&out).unwrap();
        let want = expected_case(template, "no_system", false);
        let text = j["text"].as_str().unwrap();
        assert_eq!(text, want["text"].as_str().unwrap(), "{template}");
        assert_eq!(j["span_method"], method);
        let spans: Vec<(usize, usize)> =
            serde_json::from_value(j["assistant_spans"].clone()).unwrap();
        if method == "generation_tags" {
            assert_eq!(j["assistant_spans"], want["assistant_spans"]);
        }
        assert_eq!(spans.len(), 2, "{template}: two assistant turns");
        let ids: Vec<u64> = serde_json::from_value(j["tokens"].clone()).unwrap();
        let mask: Vec<u64> = serde_json::from_value(j["mask"].clone()).unwrap();
        assert_eq!(ids.len(), mask.len());
        assert_eq!(text_of(&ids), text, "the tokens spell the text");
        let trained: Vec<u64> = ids
            .iter()
            .zip(&mask)
            .filter(|(_, &m)| m == 1)
            .map(|(&i, _)| i)
            .collect();
        let chars_of: Vec<char> = text.chars().collect();
        let span_text: String = spans
            .iter()
            .map(|&(s, e)| chars_of[s..e].iter().collect::<String>())
            .collect();
        assert_eq!(
            text_of(&trained),
            span_text,
            "{template}: the mask is the spans"
        );
        // Each turn's end (<|im_end|>, the EOS) is trained: no warning.
        assert!(
            span_text.matches("<|im_end|>").count() == 2 && !err.contains("warning"),
            "{err}"
        );
        assert!(err.contains("tokens trained"), "{err}");
    }
    // The text view marks the trained text (no terminal: with brackets).
    let (ok, out, _) = kiln(&["template", d, "--messages", r]);
    assert!(ok);
    assert!(
        out.contains("assistant\n⟦Seven.<|im_end|>\n⟧<|im_start|>user"),
        "{out}"
    );
    // Bad input: a row without messages, a directory without a template.
    let bad = dir.join("bad.json");
    std::fs::write(&bad, r#"{"conversation": []}"#).unwrap();
    let (ok, _, err) = kiln(&["template", d, "--messages", bad.to_str().unwrap()]);
    assert!(!ok && err.contains("no `messages` list"), "{err}");
    std::fs::write(
        dir.join("tokenizer_config.json"),
        r#"{"eos_token": "<|im_end|>"}"#,
    )
    .unwrap();
    let (ok, _, err) = kiln(&["template", d, "--messages", r]);
    assert!(!ok && err.contains("--chat-template"), "{err}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// `kiln prepare` of a dataset of rows: each conversation's tokens and loss mask are
/// what `kiln template` shows for it (the same row as ShareGPT gives the same
/// example), the sidecar counts them and records the date, `--max-length` cuts either
/// end and drops what has nothing left to train on, a bad row is named with its line
/// and leaves no output, and training refuses the example file rather than read it as
/// a stream.
#[test]
fn kiln_prepare_writes_each_rows_tokens_and_loss_mask() {
    let dir = chatml_model("prepare", &source("smollm2"));
    let d = dir.to_str().unwrap();
    let row = read_json(&fixtures().join("rows/no_system.json"));
    let sharegpt: Vec<Value> = row["messages"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| {
            let from = if m["role"] == "user" { "human" } else { "gpt" };
            serde_json::json!({"from": from, "value": m["content"]})
        })
        .collect();
    let rows = dir.join("rows.jsonl");
    std::fs::write(
        &rows,
        format!(
            "{row}\n\n{}\n",
            serde_json::json!({"messages": row["messages"]})
        ),
    )
    .unwrap();
    let share = dir.join("share.jsonl");
    std::fs::write(
        &share,
        format!("{}\n", serde_json::json!({"conversations": sharegpt})),
    )
    .unwrap();
    let out = dir.join("out.bin");
    let o = out.to_str().unwrap();
    let prepare = |input: &Path, extra: &[&str]| {
        let mut args = vec!["prepare", input.to_str().unwrap(), o, "--tokenizer", d];
        args.extend(["--date", "26 Jul 2026"]);
        args.extend(extra);
        kiln(&args)
    };
    let read = || -> (Vec<u16>, Vec<u8>, Vec<u64>, Value) {
        let ids = std::fs::read(&out).unwrap();
        let offsets = std::fs::read(dir.join("out.bin.examples")).unwrap();
        (
            ids.chunks(2)
                .map(|c| u16::from_le_bytes([c[0], c[1]]))
                .collect(),
            std::fs::read(dir.join("out.bin.mask")).unwrap(),
            offsets
                .chunks(8)
                .map(|c| u64::from_le_bytes(c.try_into().unwrap()))
                .collect(),
            read_json(&dir.join("out.bin.json")),
        )
    };

    let (ok, stdout, err) = prepare(&rows, &[]);
    assert!(ok, "{err}");
    assert!(
        err.contains("messages (trained on the assistant's turns)") && err.contains("turn by turn"),
        "{err}"
    );
    assert!(stdout.contains("2 examples"), "{stdout}");
    let (ids, mask, offsets, side) = read();
    // What `kiln template` shows for the row.
    let row_file = fixtures().join("rows/no_system.json");
    let (ok, shown, err) = kiln(&[
        "template",
        d,
        "--messages",
        row_file.to_str().unwrap(),
        "--json",
        "--date",
        "26 Jul 2026",
    ]);
    assert!(ok, "{err}");
    let shown: Value = serde_json::from_str(&shown).unwrap();
    let want_ids: Vec<u16> = serde_json::from_value(shown["tokens"].clone()).unwrap();
    let want_mask: Vec<u8> = serde_json::from_value(shown["mask"].clone()).unwrap();
    let n = want_ids.len();
    assert_eq!(offsets, [0, n as u64, 2 * n as u64]);
    assert_eq!((&ids[..n], &mask[..n]), (&want_ids[..], &want_mask[..]));
    assert_eq!((&ids[n..], &mask[n..]), (&want_ids[..], &want_mask[..]));
    let trained = want_mask[1..].iter().filter(|&&m| m == 1).count() as u64;
    assert!(trained > 10);
    let set = &side["examples"];
    assert_eq!(side["tokens"], 2 * n as u64);
    assert_eq!(
        (set["examples"].as_u64(), set["trained_tokens"].as_u64()),
        (Some(2), Some(2 * trained))
    );
    assert_eq!(
        (set["date"].as_str(), set["dropped"].as_u64()),
        (Some("2026-07-26"), Some(0))
    );
    assert_eq!(set["columns"]["messages"], "messages");

    // ShareGPT's form of the same conversation: the same example.
    let (ok, _, err) = prepare(&share, &[]);
    assert!(ok && err.contains("ShareGPT"), "{err}");
    let (ids, mask, offsets, _) = read();
    assert_eq!(
        (ids, mask, offsets),
        (want_ids.clone(), want_mask.clone(), vec![0, n as u64])
    );

    // Cut to 20 tokens: the end keeps the last turn's; the start holds no trained token,
    // so every example is dropped, which is an error that leaves no files.
    let (ok, stdout, err) = prepare(&rows, &["--max-length", "20", "--truncation", "keep_end"]);
    assert!(ok, "{err}");
    assert!(stdout.contains("2 cut to 20 tokens"), "{stdout}");
    let (ids, mask, _, side) = read();
    assert_eq!(
        (&ids[..20], &mask[..20]),
        (&want_ids[n - 20..], &want_mask[n - 20..])
    );
    assert_eq!(side["examples"]["truncated"], 2);
    std::fs::remove_file(&out).unwrap();
    let (ok, _, err) = prepare(&rows, &["--max-length", "20"]);
    assert!(
        !ok && err.contains("2 dropped") && err.contains("keep_end"),
        "{err}"
    );
    assert!(!out.exists() && !dir.join("out.bin.mask").exists());

    // A bad second row is named; nothing is left behind.
    std::fs::write(&rows, format!("{row}\n{{\"text\": \"plain\"}}\n")).unwrap();
    let (ok, _, err) = prepare(&rows, &[]);
    assert!(
        !ok && err.contains("line 2") && err.contains("mixed formats"),
        "{err}"
    );
    assert!(!out.exists() && !dir.join("out.bin.examples").exists());

    // Training and evaluation refuse an example file.
    let (ok, _, err) = prepare(&share, &[]);
    assert!(ok, "{err}");
    let e = kiln::engine::data::TokenFile::open(&out)
        .err()
        .unwrap()
        .to_string();
    assert!(
        e.contains("an example file") && e.contains("loss mask"),
        "{e}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// A template that closes the assistant's turn (`<|im_end|>`, the EOS here) after its
/// `{% generation %}` block leaves the end untrained: prepare warns, naming the token and
/// how many examples; with the end inside the block, no warning, and the end trained.
#[test]
fn an_untrained_end_of_turn_is_warned_about() {
    let outside = "{% for m in messages %}{% if m['role'] == 'assistant' %}<|im_start|>assistant\n\
                   {% generation %}{{ m['content'] }}{% endgeneration %}<|im_end|>\n{% else %}\
                   <|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endif %}{% endfor %}";
    let inside = outside.replace(
        "{% endgeneration %}<|im_end|>",
        "<|im_end|>{% endgeneration %}",
    );
    for (tag, template, warned) in [("outside", outside, true), ("inside", &inside[..], false)] {
        let dir = chatml_model(&format!("end-{tag}"), template);
        let rows = dir.join("rows.jsonl");
        let row = serde_json::json!({"messages": [
            {"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"},
            {"role": "user", "content": "ok?"}, {"role": "assistant", "content": "ok"}]});
        let plain = serde_json::json!({"messages": [{"role": "user", "content": "2"},
            {"role": "assistant", "content": "3"}]});
        std::fs::write(&rows, format!("{row}\n{plain}\n{row}\n")).unwrap();
        let out = dir.join("out.bin");
        let (ok, _, err) = kiln(&[
            "prepare",
            rows.to_str().unwrap(),
            out.to_str().unwrap(),
            "--tokenizer",
            dir.to_str().unwrap(),
        ]);
        assert!(ok, "{err}");
        assert_eq!(err.contains("warning"), warned, "{tag}: {err}");
        if warned {
            assert!(
                err.contains("in 3 of the 3 examples") && err.contains("<|im_end|>"),
                "{err}"
            );
        }
        // The mask: 257 (<|im_end|>) trained exactly when inside the block.
        let ids: Vec<u16> = std::fs::read(&out)
            .unwrap()
            .chunks(2)
            .map(|c| u16::from_le_bytes([c[0], c[1]]))
            .collect();
        let mask = std::fs::read(dir.join("out.bin.mask")).unwrap();
        let ends: Vec<u8> = (1..ids.len())
            .filter(|&i| ids[i] == 257 && mask[i - 1] == 1)
            .map(|i| mask[i])
            .collect();
        assert_eq!(ends.len(), 5, "{tag}");
        assert!(
            ends.iter().all(|&m| m == u8::from(!warned)),
            "{tag}: {ends:?}"
        );
        std::fs::remove_dir_all(&dir).ok();
    }
}
