//! `kiln template`: one dataset row through a model's chat template, showing what
//! fine-tuning would train on — the rendered text with the assistant's part marked,
//! or as JSON with the spans, and with the model's tokenizer the tokens and their mask.

use std::io::IsTerminal;
use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use kiln_engine::data::chat_template::{
    model_chat, parse_date, ChatTemplate, ModelChat, SpanMethod,
};
use kiln_engine::data::examples::mask_of;
use kiln_engine::data::hf_tokenizer::TOKENIZER_FILE;
use kiln_engine::data::HfTokenizer;

pub struct TemplateOptions {
    /// The model directory: `tokenizer_config.json` (or `chat_template.jinja`), and
    /// `tokenizer.json` for tokens.
    pub dir: PathBuf,
    /// One dataset row: `{"messages": [...], "tools": [...]}`.
    pub row: PathBuf,
    pub add_generation_prompt: bool,
    /// What `strftime_now` gives (`26 Jul 2026`); else today.
    pub date: Option<String>,
    pub json: bool,
    /// A template file instead of the model's.
    pub chat_template: Option<PathBuf>,
}

/// What `kiln template` prints: the output, and lines for stderr (the summary and
/// warnings).
pub struct TemplateReport {
    pub output: String,
    pub notes: Vec<String>,
}

/// The chat template a command uses: `file` where given (with the model's special
/// tokens), else the model directory `dir`'s.
pub fn chosen_template(
    chat: &ModelChat,
    dir: &Path,
    file: Option<&Path>,
    date: Option<std::time::SystemTime>,
) -> Result<ChatTemplate> {
    Ok(match file {
        Some(file) => {
            let source = std::fs::read_to_string(file)
                .with_context(|| format!("reading the chat template {}", file.display()))?;
            let mut t = ChatTemplate::new(&source, &file.display().to_string(), date)?;
            for (name, text) in &chat.specials {
                t = t.with_special(name, text);
            }
            t
        }
        None => chat.template(dir, date)?,
    })
}

pub fn template(o: &TemplateOptions) -> Result<TemplateReport> {
    let date = o.date.as_deref().map(parse_date).transpose()?;
    if !o.dir.is_dir() {
        bail!(
            "{}: not a directory; give the model directory (it holds tokenizer_config.json)",
            o.dir.display()
        );
    }
    let tokenizer = if o.dir.join(TOKENIZER_FILE).is_file() {
        Some(HfTokenizer::open(&o.dir)?)
    } else {
        None
    };
    // The model's template and special tokens: the tokenizer's reading of them where
    // there is one (it knows a BOS or EOS given only by id), else the directory's.
    let chat = match &tokenizer {
        Some(tok) => tok.chat.clone(),
        None => model_chat(&o.dir)?,
    };
    let template = chosen_template(&chat, &o.dir, o.chat_template.as_deref(), date)?;
    let row = read_row(&o.row)?;
    let (conversation, method) = template.assistant_spans(&row)?;
    let (text, spans) = if o.add_generation_prompt {
        let prompt = template.render(&row, true)?;
        match method {
            SpanMethod::GenerationTags => (prompt.text, prompt.assistant_spans),
            // The prompt only appends the assistant's header to the conversation.
            SpanMethod::TurnByTurn if prompt.text.starts_with(&conversation.text) => {
                (prompt.text, conversation.assistant_spans)
            }
            SpanMethod::TurnByTurn => bail!(
                "{}: with the generation prompt the conversation renders differently, so its \
                 trained turns cannot be placed; run without --add-generation-prompt",
                template.origin()
            ),
        }
    } else {
        (conversation.text, conversation.assistant_spans)
    };
    let rendered = kiln_engine::data::chat_template::Rendered {
        text,
        assistant_spans: spans,
    };
    let mut notes = vec![];
    let tokens = match &tokenizer {
        Some(tok) => {
            let enc = tok
                .inner()
                .encode(rendered.text.as_str(), false)
                .map_err(|e| {
                    anyhow::anyhow!("{}: the tokenizer failed: {e}", tok.file.display())
                })?;
            let mask = mask_of(enc.get_offsets(), &rendered.assistant_spans);
            for (k, r) in rendered.assistant_spans.iter().enumerate() {
                let ends = enc
                    .get_ids()
                    .iter()
                    .zip(enc.get_offsets())
                    .any(|(id, &(s, e))| s >= r.start && e <= r.end && tok.eos.contains(id));
                if !ends {
                    notes.push(format!(
                        "warning: assistant turn {} has no end-of-turn token in its trained \
                         text, so the model will not learn to stop there; use a template whose \
                         generation blocks include it",
                        k + 1
                    ));
                }
            }
            Some((enc.get_ids().to_vec(), enc.get_offsets().to_vec(), mask))
        }
        None => None,
    };
    let method_note = format!("trained text found by {}", method.describe());
    let output = if o.json {
        let mut j = serde_json::json!({
            "text": rendered.text,
            "assistant_spans": rendered.char_spans(),
            "span_method": match method {
                SpanMethod::GenerationTags => "generation_tags",
                SpanMethod::TurnByTurn => "turn_by_turn",
            },
        });
        if let Some((ids, _, mask)) = &tokens {
            j["tokens"] = serde_json::json!(ids);
            j["mask"] = serde_json::json!(mask);
        }
        serde_json::to_string_pretty(&j)? + "\n"
    } else {
        // The trained stretches: by token where there is a tokenizer (what the loss
        // sees), else by character span.
        let stretches: Vec<(usize, usize)> = match &tokens {
            Some((_, offsets, mask)) => offsets
                .iter()
                .zip(mask)
                .filter(|(_, &m)| m == 1)
                .map(|(&(s, e), _)| (s, e))
                .collect(),
            None => rendered
                .assistant_spans
                .iter()
                .map(|r| (r.start, r.end))
                .collect(),
        };
        let (on, off) = if std::io::stdout().is_terminal() {
            ("\x1b[1;32m", "\x1b[0m")
        } else {
            ("⟦", "⟧")
        };
        let mut out = String::new();
        let mut at = 0;
        for (s, e) in merge(stretches) {
            out.push_str(&rendered.text[at..s]);
            out.push_str(on);
            out.push_str(&rendered.text[s..e]);
            out.push_str(off);
            at = e;
        }
        out.push_str(&rendered.text[at..]);
        if !out.ends_with('\n') {
            out.push('\n');
        }
        out
    };
    match &tokens {
        Some((ids, _, mask)) => {
            let n = mask.iter().filter(|&&m| m == 1).count();
            notes.insert(
                0,
                format!(
                    "{n} of {} tokens trained ({:.1} %); {method_note}",
                    ids.len(),
                    100.0 * n as f64 / ids.len().max(1) as f64
                ),
            );
        }
        None => notes.insert(
            0,
            format!(
                "{} trained span(s); {method_note} (no {TOKENIZER_FILE} in {}: no tokens)",
                rendered.assistant_spans.len(),
                o.dir.display()
            ),
        ),
    }
    Ok(TemplateReport { output, notes })
}

/// One dataset row from a JSON file: an object with `messages`.
fn read_row(path: &Path) -> Result<serde_json::Value> {
    let text =
        std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    let row: serde_json::Value = serde_json::from_str(&text).with_context(|| {
        format!(
            "{}: not JSON (one dataset row: {{\"messages\": [{{\"role\", \"content\"}}, ...]}})",
            path.display()
        )
    })?;
    if !row.get("messages").is_some_and(|m| m.is_array()) {
        bail!(
            "{}: the row has no `messages` list (one dataset row: {{\"messages\": [{{\"role\", \
             \"content\"}}, ...], \"tools\": [...]}})",
            path.display()
        );
    }
    Ok(row)
}

/// Adjacent or overlapping byte ranges as one.
fn merge(mut v: Vec<(usize, usize)>) -> Vec<(usize, usize)> {
    v.sort();
    let mut out: Vec<(usize, usize)> = vec![];
    for (s, e) in v {
        match out.last_mut() {
            Some(last) if s <= last.1 => last.1 = last.1.max(e),
            _ => out.push((s, e)),
        }
    }
    out
}
