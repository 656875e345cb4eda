//! Hugging Face tokenizers (issue 29): `kiln prepare --tokenizer DIR` gives the ids the
//! `tokenizers` crate gives for a real byte-level BPE (trained here by that crate's own
//! trainer, as Llama 3's, Qwen2's and SmolLM2's are built), records the tokenizer in the
//! sidecar by file and SHA-256, writes u32 token files past 65536 ids, and `kiln sample`
//! on a Hugging Face Llama directory decodes with its tokenizer and stops at its EOS.

mod common;

use std::path::{Path, PathBuf};
use std::process::Command;

use common::scratch_dir;
use kiln::engine::data::hf_tokenizer::tokenizers;
use kiln::engine::data::{
    prepare, HfTokenizer, Sidecar, TokenDtype, TokenFile, TokenSource, Tokenizer,
};
use kiln::sample::{TextCodec, TextStream};

const CORPUS: &str = "The kiln fires the clay. The clay hardens in the kiln.\n\
    Héllo wörld: naïve café, smörgåsbord, 東京, emoji 😀🔥 and tabs\tand  double spaces.\n\
    Numbers 12345 and 3.14159, code `fn main() { println!(\"hi\"); }`.\n";

/// A byte-level BPE of 300 ids (256 bytes, merges, `<|endoftext|>`) trained on
/// CORPUS by the tokenizers crate, saved in `dir` with a tokenizer_config.json naming
/// its EOS.
fn trained_bpe(dir: &Path) -> PathBuf {
    use tokenizers::models::bpe::{BpeTrainerBuilder, BPE};
    use tokenizers::normalizers::NormalizerWrapper;
    use tokenizers::pre_tokenizers::byte_level::ByteLevel;
    use tokenizers::{AddedToken, TokenizerBuilder};
    let corpus = dir.join("corpus.txt");
    std::fs::write(&corpus, CORPUS.repeat(4)).unwrap();
    let mut trainer = BpeTrainerBuilder::new()
        .show_progress(false)
        .vocab_size(300)
        .min_frequency(1)
        .special_tokens(vec![AddedToken::from("<|endoftext|>", true)])
        .initial_alphabet(ByteLevel::alphabet().into_iter().collect())
        .build();
    let mut tok =
        TokenizerBuilder::<BPE, NormalizerWrapper, ByteLevel, ByteLevel, ByteLevel>::new()
            .with_model(BPE::default())
            .with_normalizer(None)
            // As Llama 3's and Qwen2's: no space added before the text.
            .with_pre_tokenizer(Some(ByteLevel::default().add_prefix_space(false)))
            .with_post_processor(Some(ByteLevel::default()))
            .with_decoder(Some(ByteLevel::default()))
            .build()
            .unwrap();
    tok.train_from_files(&mut trainer, vec![corpus.display().to_string()])
        .unwrap();
    let file = dir.join("tokenizer.json");
    tok.save(&file, false).unwrap();
    std::fs::write(
        dir.join("tokenizer_config.json"),
        r#"{"eos_token": "<|endoftext|>", "bos_token": null}"#,
    )
    .unwrap();
    file
}

/// A word-level tokenizer.json: whitespace-separated words, the given ids.
fn word_level(words: &[(String, u32)]) -> String {
    let vocab: serde_json::Map<String, serde_json::Value> = words
        .iter()
        .map(|(w, id)| (w.clone(), (*id).into()))
        .collect();
    serde_json::json!({
        "version": "1.0", "truncation": null, "padding": null, "added_tokens": [],
        "normalizer": null, "pre_tokenizer": {"type": "WhitespaceSplit"},
        "post_processor": null, "decoder": null,
        "model": {"type": "WordLevel", "vocab": vocab, "unk_token": "w0"}
    })
    .to_string()
}

fn read_all(f: &TokenFile) -> Vec<u32> {
    let mut out = vec![0; f.len() as usize];
    f.read(0, &mut out).unwrap();
    out
}

#[test]
fn prepare_with_a_hugging_face_tokenizer_gives_its_ids_and_names_it() {
    let dir = scratch_dir("hf-tokenizer", "bpe");
    let file = trained_bpe(&dir);
    let reference = tokenizers::Tokenizer::from_file(&file).unwrap();
    assert_eq!(reference.get_vocab_size(true), 300);
    let text = dir.join("text.txt");
    std::fs::write(&text, CORPUS).unwrap();
    let out = dir.join("text.bin");
    // The model directory, as `--tokenizer DIR` gives it.
    let tok = Tokenizer::open(dir.to_str().unwrap()).unwrap();
    let n = prepare(&text, &out, tok.clone()).unwrap();
    let want: Vec<u32> = reference.encode(CORPUS, true).unwrap().get_ids().to_vec();
    let f = TokenFile::open(&out).unwrap();
    assert_eq!(n as usize, want.len());
    assert_eq!(read_all(&f), want);
    // Byte-level BPE is lossless: the ids decode to the text, emoji and all.
    assert_eq!(tok.decode(&want).unwrap(), CORPUS);
    let side = f.sidecar().unwrap();
    let Tokenizer::Hf(t) = &tok else {
        panic!("not a Hugging Face tokenizer")
    };
    assert_eq!(
        (side.tokenizer.as_str(), side.vocab_size, side.dtype),
        ("huggingface", 300, TokenDtype::U16)
    );
    assert!(side.tokenizer_file.as_ref().unwrap().is_absolute());
    assert_eq!(side.tokenizer_sha256.as_deref(), Some(t.sha256.as_str()));
    assert_eq!(t.sha256.len(), 64);
    // Byte-level BPE: long texts are encoded in pieces (checked below).
    assert!(t.cuts_at_lines());
    assert_eq!(t.eos, [reference.token_to_id("<|endoftext|>").unwrap()]);
    // The sidecar finds the tokenizer again, and notices when its file changed.
    let again = Tokenizer::of_sidecar(side, &Sidecar::path_for(&out)).unwrap();
    assert_eq!(again, tok);
    let mut json: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&file).unwrap()).unwrap();
    json["added_tokens"][0]["content"] = "<|end|>".into();
    std::fs::write(&file, json.to_string()).unwrap();
    let e = Tokenizer::of_sidecar(side, &Sidecar::path_for(&out)).unwrap_err();
    assert!(e.to_string().contains("the file changed since"), "{e}");
    // A text past the 1 MiB that prepare reads at a time is encoded in pieces cut after
    // newlines: the same ids as the whole text encoded at once.
    let long: String = CORPUS.repeat((1 << 20) / CORPUS.len() + 500);
    std::fs::write(&text, &long).unwrap();
    let big = dir.join("long.bin");
    prepare(&text, &big, tok.clone()).unwrap();
    let whole: Vec<u32> = reference
        .encode(long.as_str(), true)
        .unwrap()
        .get_ids()
        .to_vec();
    assert_eq!(read_all(&TokenFile::open(&big).unwrap()), whole);
    // Streamed a token at a time, the text comes out whole: a character split across
    // tokens waits for its last byte.
    let mut stream = TextStream::new(TextCodec::Tokens(tok));
    let mut shown = String::new();
    for &id in &want {
        let piece = stream.push(id).unwrap();
        assert!(!piece.contains('\u{FFFD}'), "{piece:?}");
        shown += &piece;
    }
    shown += &stream.finish();
    assert_eq!(shown, CORPUS);
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn a_vocabulary_past_65536_ids_makes_a_u32_token_file() {
    let dir = scratch_dir("hf-tokenizer", "u32");
    let words: Vec<(String, u32)> = [("w0", 0), ("hello", 5), ("big", 70_000), ("top", 131_071)]
        .iter()
        .map(|(w, i)| (w.to_string(), *i))
        .collect();
    std::fs::write(dir.join("tokenizer.json"), word_level(&words)).unwrap();
    let text = dir.join("text.txt");
    std::fs::write(&text, "hello big top hello\nbig").unwrap();
    let out = dir.join("text.bin");
    let tok = Tokenizer::open(dir.join("tokenizer.json").to_str().unwrap()).unwrap();
    assert_eq!(tok.vocab_size(), 131_072);
    prepare(&text, &out, tok).unwrap();
    let want = [5, 70_000, 131_071, 5, 70_000];
    assert_eq!(
        std::fs::metadata(&out).unwrap().len(),
        4 * want.len() as u64
    );
    let f = TokenFile::open(&out).unwrap();
    assert_eq!(f.sidecar().unwrap().dtype, TokenDtype::U32);
    assert_eq!(read_all(&f), want);
    assert_eq!(f.max_token(), 131_071);
    // Read without its sidecar, the file would be u16: 10 ids of nonsense, so the
    // sidecar says u32 and training reads it so.
    assert_eq!(f.len(), 5);
    std::fs::remove_dir_all(&dir).ok();
}

/// A copy of the Llama fixture `gqa_f32` (vocabulary 37) with a word-level tokenizer
/// of its 37 ids (`w0` … `w36`) and `eos` as its EOS, where given.
fn llama_with_tokenizer(tag: &str, eos: Option<&str>) -> PathBuf {
    let dir = scratch_dir("hf-tokenizer", tag);
    let fixture = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/llama/gqa_f32");
    for f in std::fs::read_dir(fixture).unwrap() {
        let f = f.unwrap().path();
        std::fs::copy(&f, dir.join(f.file_name().unwrap())).unwrap();
    }
    let words: Vec<(String, u32)> = (0..37).map(|i| (format!("w{i}"), i)).collect();
    std::fs::write(dir.join("tokenizer.json"), word_level(&words)).unwrap();
    if let Some(e) = eos {
        std::fs::write(
            dir.join("tokenizer_config.json"),
            format!(r#"{{"eos_token": "{e}"}}"#),
        )
        .unwrap();
    }
    dir
}

fn sample(dir: &Path) -> Vec<String> {
    let o = Command::new(env!("CARGO_BIN_EXE_kiln"))
        .args(["sample", dir.to_str().unwrap(), "--prompt", "w1 w2 w3"])
        .args([
            "--temperature",
            "0",
            "--tokens",
            "12",
            "--devices",
            "cpu",
            "--dtype",
            "f32",
        ])
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let text = String::from_utf8(o.stdout).unwrap();
    let words: Vec<String> = text.split_whitespace().map(str::to_string).collect();
    assert_eq!(words[..3], ["w1", "w2", "w3"], "{text:?}");
    words[3..].to_vec()
}

#[test]
fn kiln_sample_decodes_with_the_model_tokenizer_and_stops_at_its_eos() {
    let dir = llama_with_tokenizer("sample", None);
    let free = sample(&dir);
    assert_eq!(free.len(), 12, "{free:?}");
    assert!(free.iter().all(|w| w.starts_with('w')), "{free:?}");
    // The fifth greedy word made the EOS: generation stops before it, the same four
    // words first.
    let eos = free[4].clone();
    let first = free.iter().position(|w| *w == eos).unwrap();
    std::fs::write(
        dir.join("tokenizer_config.json"),
        format!(r#"{{"eos_token": "{eos}"}}"#),
    )
    .unwrap();
    let stopped = sample(&dir);
    assert_eq!(stopped, free[..first], "EOS {eos}");
    // A tokenizer with more ids than the embedding has rows is another model's.
    let words: Vec<(String, u32)> = (0..40).map(|i| (format!("w{i}"), i)).collect();
    std::fs::write(dir.join("tokenizer.json"), word_level(&words)).unwrap();
    let e = HfTokenizer::open(&dir).unwrap();
    assert_eq!(e.vocab_size(), 40);
    let o = Command::new(env!("CARGO_BIN_EXE_kiln"))
        .args([
            "sample",
            dir.to_str().unwrap(),
            "--prompt",
            "w1",
            "--devices",
            "cpu",
        ])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        !o.status.success() && err.contains("40 ids") && err.contains("37 rows"),
        "{err}"
    );
    std::fs::remove_dir_all(&dir).ok();
}

/// Chat templates render as Jinja with Python's string methods: a ChatML-style template
/// that adds a system turn when none is given, and a Llama-3-style one with the BOS
/// token and `.strip()`; block tags trimmed as transformers sets Jinja up; a runaway
/// template stopped; `raise_exception` fails with the template's message. The expected
/// strings are written out by hand from the templates (and agree with Python's jinja2
/// set up as transformers sets it up: sandboxed, trim_blocks, lstrip_blocks).
#[test]
fn chat_templates_render_conversations() {
    let dir = scratch_dir("hf-tokenizer", "chat");
    trained_bpe(&dir);
    let set_template = |template: &str| {
        let cfg = serde_json::json!({
            "eos_token": "<|endoftext|>",
            "bos_token": "<|endoftext|>",
            "chat_template": template,
        });
        std::fs::write(dir.join("tokenizer_config.json"), cfg.to_string()).unwrap();
        HfTokenizer::open(&dir).unwrap()
    };
    let chatml = "{% for m in messages %}{% if loop.first and m['role'] != 'system' %}\
        <|im_start|>system\nBe brief.<|im_end|>\n{% endif %}<|im_start|>{{ m['role'] }}\n\
        {{ m['content'] }}<|im_end|>\n{% endfor %}\
        {% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}";
    let t = set_template(chatml);
    assert_eq!(
        t.chat(&[("user", "Hi there")], true).unwrap(),
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi there<|im_end|>\n\
         <|im_start|>assistant\n"
    );
    assert_eq!(
        t.chat(&[("system", "S"), ("user", "U")], false).unwrap(),
        "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nU<|im_end|>\n"
    );
    let llama3 = "{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}\
        <|end_header_id|>\n\n{{ m['content'].strip() }}<|eot_id|>{% endfor %}\
        {% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}";
    let t = set_template(llama3);
    assert_eq!(
        t.chat(&[("user", "  What is a kiln?\n")], true).unwrap(),
        "<|endoftext|><|start_header_id|>user<|end_header_id|>\n\nWhat is a kiln?<|eot_id|>\
         <|start_header_id|>assistant<|end_header_id|>\n\n"
    );
    // As transformers sets Jinja up: a block tag's newline is dropped (trim_blocks) and
    // the indentation from a line's start to a block tag too (lstrip_blocks), not
    // before a variable.
    let t = set_template("{% for m in messages %}\n    {{ m['content'] }}\n{% endfor %}\n  {% if true %}x{% endif %}\n");
    assert_eq!(
        t.chat(&[("user", "a"), ("assistant", "b")], false).unwrap(),
        "    a\n    b\nx"
    );
    // An untrusted template that would run for ever is stopped.
    let t = set_template(
        "{% for i in range(100000) %}{% for j in range(100000) %}x{% endfor %}{% endfor %}",
    );
    let e = t.chat(&[("user", "x")], false).unwrap_err().to_string();
    assert!(
        e.contains("chat template failed") && e.contains("fuel"),
        "{e}"
    );
    // A template of its own file (as transformers saves them since 2025) comes before
    // tokenizer_config.json's.
    std::fs::write(
        dir.join("chat_template.jinja"),
        "{{ messages[0]['content'] }}!",
    )
    .unwrap();
    let t = HfTokenizer::open(&dir).unwrap();
    assert_eq!(t.chat(&[("user", "own file")], true).unwrap(), "own file!");
    std::fs::remove_file(dir.join("chat_template.jinja")).unwrap();
    let strict = "{% if messages[0]['role'] != 'system' %}\
        {{ raise_exception('Conversations must start with a system turn') }}{% endif %}";
    let e = set_template(strict)
        .chat(&[("user", "x")], true)
        .unwrap_err();
    assert!(
        e.to_string()
            .contains("Conversations must start with a system turn"),
        "{e}"
    );
    std::fs::remove_dir_all(&dir).ok();
}

/// `kiln sample --chat` puts the prompt in the template and continues the template's
/// tokens: the same words as continuing the rendered text itself.
#[test]
fn kiln_sample_chat_answers_inside_the_template() {
    let dir = llama_with_tokenizer("sample-chat", None);
    let template = "{% for m in messages %}w30 {{ m['content'].strip() }} w31 {% endfor %}\
        {% if add_generation_prompt %}w32{% endif %}";
    std::fs::write(
        dir.join("tokenizer_config.json"),
        serde_json::json!({ "chat_template": template }).to_string(),
    )
    .unwrap();
    let run = |args: &[&str]| {
        let o = Command::new(env!("CARGO_BIN_EXE_kiln"))
            .args(["sample", dir.to_str().unwrap()])
            .args(args)
            .args([
                "--temperature",
                "0",
                "--tokens",
                "6",
                "--devices",
                "cpu",
                "--dtype",
                "f32",
            ])
            .output()
            .unwrap();
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        String::from_utf8(o.stdout).unwrap()
    };
    let chat = run(&["--chat", "--prompt", " w1 w2 "]);
    let plain = run(&["--prompt", "w30 w1 w2 w31 w32"]);
    let answer: Vec<&str> = chat.lines().nth(1).unwrap().split_whitespace().collect();
    let words: Vec<&str> = plain.split_whitespace().collect();
    assert_eq!(answer, words[5..], "chat {chat:?}, plain {plain:?}");
    assert_eq!(answer.len(), 6);
    std::fs::remove_dir_all(&dir).ok();
}
