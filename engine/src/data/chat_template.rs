//! Chat templates, rendered byte for byte as Hugging Face `transformers` renders them,
//! with the character spans of the assistant's text that `{% generation %}` blocks mark
//! (what fine-tuning trains on).
//!
//! A chat template is Jinja that comes with a downloaded model: untrusted code. It runs
//! in minijinja, which has no file, network or process access (nothing here registers
//! any), and bounded: [`FUEL`] instructions, minijinja's recursion limit and
//! [`MAX_OUTPUT`] bytes of output, past which rendering stops with an error naming the
//! template.
//!
//! What is set up to match `transformers` (Python's jinja2, a sandboxed environment):
//! blocks trimmed and left-stripped, loop controls, Python's string and dict methods
//! (`minijinja-contrib`'s pycompat), maps in insertion order, `tojson` as Python's
//! `json.dumps(ensure_ascii=False)` (no HTML escaping, `", "` and `": "` separators),
//! `raise_exception`, `strftime_now` (at a fixed date if one is given), `none`, `True`
//! and `False` printed as Python prints them, the `iterable` test as jinja2 answers it
//! (`none` is not iterable, an undefined value is), CRLF line ends in the source read as
//! LF, and the `generation` tag, which minijinja does not know: it is rewritten, before
//! parsing, into blocks that print private-use markers (keeping the tag's whitespace
//! control), and the markers become spans after rendering.

use std::ops::Range;
use std::sync::Arc;
use std::time::SystemTime;

use std::path::Path;

use minijinja::value::{Kwargs, Value, ValueKind};
use minijinja::{Environment, Error, ErrorKind};
use serde_json::Value as Json;

use super::{DataError, Result};

/// Instructions one render may run (minijinja's fuel): real templates take thousands
/// per turn; a runaway loop stops here.
pub const FUEL: u64 = 10_000_000;

/// The most bytes one render may produce: a conversation is far smaller; a template
/// that renders gigabytes stops here.
pub const MAX_OUTPUT: usize = 16 << 20;

/// Where an assistant span starts and ends in the rendered text, before they become
/// offsets. Private-use characters: a conversation that holds them is refused.
const SPAN_START: char = '\u{E000}';
const SPAN_END: char = '\u{E001}';

/// A chat template ready to render conversations.
#[derive(Clone)]
pub struct ChatTemplate {
    env: Arc<Environment<'static>>,
    /// Where the template came from (a file, `tokenizer_config.json`), for errors.
    origin: String,
    /// Special tokens the template sees by name (`bos_token`, `eos_token`, ...).
    specials: Vec<(String, String)>,
    generation_tags: bool,
    /// What `strftime_now` gives, if fixed.
    date: Option<SystemTime>,
}

impl std::fmt::Debug for ChatTemplate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ChatTemplate")
            .field("origin", &self.origin)
            .field("specials", &self.specials)
            .field("generation_tags", &self.generation_tags)
            .finish()
    }
}

/// A rendered conversation.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Rendered {
    pub text: String,
    /// Byte ranges of `text` inside `{% generation %}` blocks, in order.
    pub assistant_spans: Vec<Range<usize>>,
}

impl Rendered {
    /// The spans as character offsets, as `transformers` reports them (Python string
    /// indices: code points).
    pub fn char_spans(&self) -> Vec<(usize, usize)> {
        let chars = |b: usize| self.text[..b].chars().count();
        self.assistant_spans
            .iter()
            .map(|r| (chars(r.start), chars(r.end)))
            .collect()
    }
}

impl ChatTemplate {
    /// Compiles `source` (from `origin`, named in errors). `date`: what `strftime_now`
    /// formats (else the time of each render). A template that does not compile is an
    /// error with its line.
    pub fn new(source: &str, origin: &str, date: Option<SystemTime>) -> Result<ChatTemplate> {
        // jinja2 reads CRLF (and lone CR) line ends as LF; minijinja keeps them.
        let source = source.replace("\r\n", "\n").replace('\r', "\n");
        let (source, generation_tags) = rewrite_generation_tags(&source);
        let mut env = Environment::new();
        env.set_trim_blocks(true);
        env.set_lstrip_blocks(true);
        env.set_fuel(Some(FUEL));
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.set_formatter(python_formatter);
        env.add_filter("tojson", tojson);
        env.add_test("iterable", iterable);
        env.add_function(
            "raise_exception",
            |msg: String| -> std::result::Result<String, Error> {
                Err(Error::new(ErrorKind::InvalidOperation, msg))
            },
        );
        env.add_function("strftime_now", move |format: String| {
            strftime(&format, date.unwrap_or_else(SystemTime::now))
        });
        env.add_template_owned("chat", source).map_err(|e| {
            DataError::InvalidArgument(format!(
                "{origin}: the chat template does not compile: {}",
                describe(&e)
            ))
        })?;
        Ok(ChatTemplate {
            env: Arc::new(env),
            origin: origin.to_string(),
            specials: vec![],
            generation_tags,
            date,
        })
    }

    /// The day `strftime_now` gives, `YYYY-MM-DD` (UTC), if fixed (else each render's).
    pub fn date(&self) -> Option<String> {
        self.date.and_then(|d| strftime("%Y-%m-%d", d).ok())
    }

    /// Adds a special token the template sees by `name` (`bos_token`, `eos_token`, ...).
    pub fn with_special(mut self, name: &str, text: &str) -> ChatTemplate {
        self.specials.push((name.to_string(), text.to_string()));
        self
    }

    /// Whether the template marks the assistant's text with `{% generation %}`.
    pub fn has_generation_tags(&self) -> bool {
        self.generation_tags
    }

    /// Where the template came from.
    pub fn origin(&self) -> &str {
        &self.origin
    }

    /// Renders one conversation: `row` holds `messages` (a list of objects with `role`
    /// and `content`, and whatever else the template reads, e.g. `tool_calls`) and may
    /// hold `tools`. `add_generation_prompt`: end with the assistant's header, as for
    /// generation. The template's own errors (`raise_exception`) come back with their
    /// message.
    pub fn render(&self, row: &serde_json::Value, add_generation_prompt: bool) -> Result<Rendered> {
        let messages = row.get("messages").ok_or_else(|| {
            DataError::InvalidArgument(format!(
                "{}: the conversation has no `messages` (a list of {{\"role\", \"content\"}} \
                 objects)",
                self.origin
            ))
        })?;
        if self.generation_tags && holds_marker(row) {
            return Err(DataError::InvalidArgument(format!(
                "the conversation holds U+E000 or U+E001, private-use characters Kiln uses \
                 to mark {}'s generation spans: remove them from the data",
                self.origin
            )));
        }
        let mut ctx: Vec<(String, Value)> = vec![
            ("messages".into(), Value::from_serialize(messages)),
            (
                "tools".into(),
                row.get("tools")
                    .map_or(Value::from(()), Value::from_serialize),
            ),
            ("documents".into(), Value::from(())),
            (
                "add_generation_prompt".into(),
                Value::from(add_generation_prompt),
            ),
        ];
        for (name, text) in &self.specials {
            ctx.push((name.clone(), Value::from(text.as_str())));
        }
        let ctx: Value = ctx.into_iter().collect();
        let template = self.env.get_template("chat").expect("compiled in new");
        let mut out = Capped::default();
        if let Err(e) = template.render_captured_to(ctx, &mut out) {
            return Err(DataError::InvalidArgument(if out.over {
                format!(
                    "{}: the chat template rendered more than {} MiB for one conversation; \
                     it is not a chat template Kiln will run",
                    self.origin,
                    MAX_OUTPUT >> 20
                )
            } else {
                format!(
                    "{}: the chat template failed: {}",
                    self.origin,
                    describe(&e)
                )
            }));
        }
        let marked = String::from_utf8(out.buf).expect("minijinja writes UTF-8");
        spans(&marked, &self.origin)
    }
}

/// How [`ChatTemplate::assistant_spans`] found the assistant's text.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SpanMethod {
    /// The template's `{% generation %}` blocks.
    GenerationTags,
    /// Rendering the conversation turn by turn: an assistant turn is what rendering up
    /// to and including it adds to rendering the turns before it with the generation
    /// prompt (its header), so its end-of-turn token is in it.
    TurnByTurn,
}

impl SpanMethod {
    pub fn describe(self) -> &'static str {
        match self {
            SpanMethod::GenerationTags => "the template's {% generation %} blocks",
            SpanMethod::TurnByTurn => "rendering the conversation turn by turn",
        }
    }
}

impl ChatTemplate {
    /// The conversation rendered whole, with the assistant's text marked: by the
    /// template's `{% generation %}` blocks where it has them, else turn by turn
    /// ([`SpanMethod`]). Turn by turn needs each render to extend the one before: a
    /// template that rewrites earlier turns (one that drops past reasoning, say) is an
    /// error naming the turn, and needs a template with generation blocks.
    pub fn assistant_spans(&self, row: &serde_json::Value) -> Result<(Rendered, SpanMethod)> {
        if self.generation_tags {
            return Ok((self.render(row, false)?, SpanMethod::GenerationTags));
        }
        Ok((self.spans_by_turns(row)?, SpanMethod::TurnByTurn))
    }

    /// The assistant's text found turn by turn ([`SpanMethod::TurnByTurn`]), whatever
    /// the template's tags (a template with both is checked against itself so).
    pub fn spans_by_turns(&self, row: &serde_json::Value) -> Result<Rendered> {
        let whole = self.render(row, false)?;
        let messages = row["messages"].as_array().ok_or_else(|| {
            DataError::InvalidArgument(format!(
                "{}: the conversation's `messages` is not a list",
                self.origin
            ))
        })?;
        let upto = |n: usize, prompt: bool| -> Result<String> {
            let mut r = row.clone();
            r["messages"] = serde_json::Value::Array(messages[..n].to_vec());
            Ok(self.render(&r, prompt)?.text)
        };
        let mut spans = vec![];
        for (i, m) in messages.iter().enumerate() {
            if m.get("role").and_then(|r| r.as_str()) != Some("assistant") {
                continue;
            }
            let before = upto(i, true)?;
            let through = upto(i + 1, false)?;
            if !through.starts_with(&before) || !whole.text.starts_with(&through) {
                return Err(DataError::InvalidArgument(format!(
                    "{}: rendering the conversation through message {i} (an assistant turn) \
                     does not extend rendering the turns before it, so the turn's text cannot \
                     be found: give a template that marks it with {{% generation %}} blocks \
                     (--chat-template)",
                    self.origin
                )));
            }
            if through.len() > before.len() {
                spans.push(before.len()..through.len());
            }
        }
        Ok(Rendered {
            text: whole.text,
            assistant_spans: spans,
        })
    }
}

/// A special token as `tokenizer_config.json` gives it: a string, or an added-token
/// object with its `content`.
pub(super) fn token_text(v: &Json) -> Option<&str> {
    v.as_str()
        .or_else(|| v.get("content").and_then(Json::as_str))
}

/// A JSON file beside the tokenizer, if there is one; an unreadable one is an error.
pub(super) fn side_json(dir: &Path, name: &str) -> Result<Option<serde_json::Map<String, Json>>> {
    let path = dir.join(name);
    let text = match std::fs::read_to_string(&path) {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(DataError::io(&path, "read", e)),
    };
    match serde_json::from_str(text.strip_prefix('\u{feff}').unwrap_or(&text)) {
        Ok(Json::Object(m)) => Ok(Some(m)),
        Ok(_) => Err(DataError::format(&path, "not a JSON object")),
        Err(e) => Err(DataError::format(&path, format!("not valid JSON: {e}"))),
    }
}

/// A model directory's chat template and the special tokens it sees.
#[derive(Clone, Debug, Default)]
pub struct ModelChat {
    /// The template: `chat_template.jinja` where the directory has one (transformers
    /// saves it so since 2025 and reads it first), else `tokenizer_config.json`'s
    /// `chat_template` (a string, or a list of named ones: the `default`).
    pub source: Option<String>,
    /// The file it came from.
    pub origin: String,
    /// `bos_token`, `eos_token`, `unk_token`, ... as `tokenizer_config.json` names them.
    pub specials: Vec<(String, String)>,
}

impl ModelChat {
    /// The template compiled, with its special tokens; an error naming the directory if
    /// there is none.
    pub fn template(&self, dir: &Path, date: Option<SystemTime>) -> Result<ChatTemplate> {
        let source = self.source.as_deref().ok_or_else(|| {
            DataError::InvalidArgument(format!(
                "{}: no chat template (neither {CHAT_TEMPLATE_FILE} nor a chat_template in \
                 tokenizer_config.json): the model is not a chat model; give it text to \
                 continue instead, or a template of your own (kiln template --chat-template FILE)",
                dir.display()
            ))
        })?;
        let mut t = ChatTemplate::new(source, &self.origin, date)?;
        for (name, text) in &self.specials {
            t = t.with_special(name, text);
        }
        Ok(t)
    }
}

/// The chat template file name of a model directory.
pub const CHAT_TEMPLATE_FILE: &str = "chat_template.jinja";

/// Reads a model directory's chat template and special tokens ([`ModelChat`]).
pub fn model_chat(dir: &Path) -> Result<ModelChat> {
    let mut chat = ModelChat::default();
    if let Some(cfg) = side_json(dir, "tokenizer_config.json")? {
        chat.origin = format!(
            "{} (chat_template)",
            dir.join("tokenizer_config.json").display()
        );
        for name in [
            "bos_token",
            "eos_token",
            "unk_token",
            "pad_token",
            "sep_token",
            "cls_token",
            "mask_token",
        ] {
            if let Some(text) = cfg.get(name).and_then(token_text) {
                chat.specials.push((name.to_string(), text.to_string()));
            }
        }
        chat.source = match cfg.get("chat_template") {
            Some(Json::String(s)) => Some(s.clone()),
            // A list of named templates: the default one.
            Some(Json::Array(list)) => list
                .iter()
                .find(|t| t.get("name").and_then(Json::as_str) == Some("default"))
                .and_then(|t| t.get("template"))
                .and_then(Json::as_str)
                .map(str::to_string),
            _ => None,
        };
    }
    let jinja = dir.join(CHAT_TEMPLATE_FILE);
    match std::fs::read_to_string(&jinja) {
        Ok(t) => {
            chat.source = Some(t);
            chat.origin = jinja.display().to_string();
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(DataError::io(&jinja, "read", e)),
    }
    Ok(chat)
}

/// An error as one line: the template's own message (`raise_exception`) or minijinja's
/// description, with the line.
fn describe(e: &Error) -> String {
    let mut s = match (e.kind(), e.detail()) {
        (ErrorKind::InvalidOperation, Some(d)) => d.to_string(),
        _ => e.to_string(),
    };
    if let Some(line) = e.line() {
        if !s.contains("line") {
            s = format!("{s} (line {line})");
        }
    }
    s
}

/// `{% generation %}` and `{% endgeneration %}` (with any `-`/`+` whitespace control)
/// as `{% if true %}MARK{% endif %}`: a block, so trim_blocks and lstrip_blocks treat
/// it as they treat the tag, whose leading control goes on the `if` and trailing on the
/// `endif`.
fn rewrite_generation_tags(source: &str) -> (String, bool) {
    let mut out = String::with_capacity(source.len());
    let mut rest = source;
    let mut found = false;
    while let Some(at) = rest.find("{%") {
        out.push_str(&rest[..at]);
        let tag = &rest[at..];
        let Some(end) = tag.find("%}") else {
            out.push_str(tag);
            return (out, found);
        };
        let inner = &tag[2..end];
        let lead = inner.chars().next().filter(|c| *c == '-' || *c == '+');
        let trail = inner.chars().last().filter(|c| *c == '-' || *c == '+');
        let word = inner
            .trim_start_matches(['-', '+'])
            .trim_end_matches(['-', '+'])
            .trim();
        let mark = match word {
            "generation" => Some(SPAN_START),
            "endgeneration" => Some(SPAN_END),
            _ => None,
        };
        match mark {
            Some(m) => {
                found = true;
                let (l, t) = (
                    lead.map_or(String::new(), String::from),
                    trail.map_or(String::new(), String::from),
                );
                out.push_str(&format!("{{%{l} if true %}}{m}{{% endif {t}%}}"));
            }
            None => out.push_str(&tag[..end + 2]),
        }
        rest = &tag[end + 2..];
    }
    out.push_str(rest);
    (out, found)
}

/// Whether any string in `v` holds a span marker.
fn holds_marker(v: &serde_json::Value) -> bool {
    match v {
        serde_json::Value::String(s) => s.contains([SPAN_START, SPAN_END]),
        serde_json::Value::Array(a) => a.iter().any(holds_marker),
        serde_json::Value::Object(m) => m
            .iter()
            .any(|(k, v)| k.contains([SPAN_START, SPAN_END]) || holds_marker(v)),
        _ => false,
    }
}

/// The text without markers and the byte ranges between them.
fn spans(marked: &str, origin: &str) -> Result<Rendered> {
    let mut text = String::with_capacity(marked.len());
    let (mut spans, mut open) = (vec![], None);
    for c in marked.chars() {
        match c {
            SPAN_START if open.is_none() => open = Some(text.len()),
            SPAN_END if open.is_some() => spans.push(open.take().unwrap()..text.len()),
            SPAN_START | SPAN_END => {
                return Err(DataError::InvalidArgument(format!(
                    "{origin}: the chat template's generation blocks are nested or unbalanced"
                )))
            }
            c => text.push(c),
        }
    }
    Ok(Rendered {
        text,
        assistant_spans: spans,
    })
}

/// The output, refused past [`MAX_OUTPUT`] bytes.
#[derive(Default)]
struct Capped {
    buf: Vec<u8>,
    over: bool,
}

impl std::io::Write for Capped {
    fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
        if self.buf.len() + b.len() > MAX_OUTPUT {
            self.over = true;
            return Err(std::io::Error::other("chat template output too large"));
        }
        self.buf.extend_from_slice(b);
        Ok(b.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// Prints values as Python's `str()` does where minijinja's differ: `None`, `True`,
/// `False`.
fn python_formatter(
    out: &mut minijinja::Output<'_>,
    state: &minijinja::State<'_, '_>,
    value: &Value,
) -> std::result::Result<(), Error> {
    match value.kind() {
        ValueKind::None => out.write_str("None").map_err(Error::from),
        ValueKind::Bool => out
            .write_str(if value.is_true() { "True" } else { "False" })
            .map_err(Error::from),
        _ => minijinja::escape_formatter(out, state, value),
    }
}

/// jinja2's `iterable` test: whatever Python can iterate, an undefined value included
/// (jinja2's Undefined iterates as empty); `none`, numbers and booleans are not.
fn iterable(v: Value) -> bool {
    match v.kind() {
        ValueKind::Undefined
        | ValueKind::String
        | ValueKind::Bytes
        | ValueKind::Seq
        | ValueKind::Map
        | ValueKind::Iterable => true,
        ValueKind::Plain => v.try_iter().is_ok(),
        _ => false,
    }
}

/// `tojson` as `transformers` defines it: Python's `json.dumps(x, ensure_ascii=False,
/// indent=None, sort_keys=False)`.
fn tojson(v: Value, kwargs: Kwargs) -> std::result::Result<String, Error> {
    let indent: Option<usize> = kwargs.get("indent")?;
    let ensure_ascii: Option<bool> = kwargs.get("ensure_ascii")?;
    let sort_keys: Option<bool> = kwargs.get("sort_keys")?;
    kwargs.assert_all_used()?;
    let mut out = String::new();
    let opts = JsonOpts {
        indent,
        ensure_ascii: ensure_ascii.unwrap_or(false),
        sort_keys: sort_keys.unwrap_or(false),
    };
    py_json(&v, &opts, 0, &mut out)?;
    Ok(out)
}

struct JsonOpts {
    indent: Option<usize>,
    ensure_ascii: bool,
    sort_keys: bool,
}

/// Python's `json.dumps` of one value: items separated by `", "` (`","` and a new line
/// when indenting), keys by `": "`.
fn py_json(
    v: &Value,
    o: &JsonOpts,
    level: usize,
    out: &mut String,
) -> std::result::Result<(), Error> {
    let newline = |out: &mut String, level: usize| {
        if let Some(n) = o.indent {
            out.push('\n');
            out.push_str(&" ".repeat(n * level));
        }
    };
    let sep = if o.indent.is_some() { "," } else { ", " };
    match v.kind() {
        ValueKind::Undefined | ValueKind::None => out.push_str("null"),
        ValueKind::Bool => out.push_str(if v.is_true() { "true" } else { "false" }),
        ValueKind::Number => {
            if let Ok(i) = i128::try_from(v.clone()) {
                out.push_str(&i.to_string());
            } else {
                out.push_str(&py_float(f64::try_from(v.clone())?));
            }
        }
        ValueKind::String => py_string(v.as_str().unwrap_or_default(), o.ensure_ascii, out),
        ValueKind::Seq | ValueKind::Iterable => {
            let items: Vec<Value> = v.try_iter()?.collect();
            if items.is_empty() {
                out.push_str("[]");
                return Ok(());
            }
            out.push('[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push_str(sep);
                }
                newline(out, level + 1);
                py_json(item, o, level + 1, out)?;
            }
            newline(out, level);
            out.push(']');
        }
        ValueKind::Map | ValueKind::Plain => {
            let mut keys: Vec<Value> = v.try_iter()?.collect();
            if o.sort_keys {
                keys.sort();
            }
            if keys.is_empty() {
                out.push_str("{}");
                return Ok(());
            }
            out.push('{');
            for (i, key) in keys.iter().enumerate() {
                if i > 0 {
                    out.push_str(sep);
                }
                newline(out, level + 1);
                match key.as_str() {
                    Some(k) => py_string(k, o.ensure_ascii, out),
                    // Python turns other keys into strings.
                    None => py_string(&key.to_string(), o.ensure_ascii, out),
                }
                out.push_str(": ");
                py_json(&v.get_item(key)?, o, level + 1, out)?;
            }
            newline(out, level);
            out.push('}');
        }
        ValueKind::Bytes | ValueKind::Invalid | _ => {
            return Err(Error::new(
                ErrorKind::InvalidOperation,
                format!("tojson: a {} is not JSON serializable", v.kind()),
            ))
        }
    }
    Ok(())
}

/// A JSON string as Python writes it: `"`, `\` and control characters escaped
/// (`\n`, `\r`, `\t`, `\b`, `\f`, else `\u00XX`); other characters as they are, or as
/// `\uXXXX` (surrogate pairs past U+FFFF) with `ensure_ascii`.
fn py_string(s: &str, ensure_ascii: bool, out: &mut String) {
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            '\u{8}' => out.push_str("\\b"),
            '\u{c}' => out.push_str("\\f"),
            c if (c as u32) < 0x20 => out.push_str(&format!("\\u{:04x}", c as u32)),
            c if ensure_ascii && !c.is_ascii() => {
                let mut units = [0u16; 2];
                for u in c.encode_utf16(&mut units) {
                    out.push_str(&format!("\\u{u:04x}"));
                }
            }
            c => out.push(c),
        }
    }
    out.push('"');
}

/// A float as Python's `repr`: the shortest digits that read back, positional for
/// exponents -4..16 (with a `.0` when whole), else `d.ddde+XX`; `NaN`, `Infinity`.
fn py_float(x: f64) -> String {
    if x.is_nan() {
        return "NaN".into();
    }
    if x.is_infinite() {
        return if x > 0.0 { "Infinity" } else { "-Infinity" }.into();
    }
    if x == 0.0 {
        return if x.is_sign_negative() { "-0.0" } else { "0.0" }.into();
    }
    // `{:e}` gives the shortest round-trip digits: d[.ddd]e[-]X.
    let sci = format!("{x:e}");
    let (mantissa, exp) = sci.split_once('e').expect("{:e} has an exponent");
    let exp: i32 = exp.parse().expect("a decimal exponent");
    let (sign, mantissa) = match mantissa.strip_prefix('-') {
        Some(m) => ("-", m),
        None => ("", mantissa),
    };
    let digits: String = mantissa.chars().filter(|c| *c != '.').collect();
    if (-4..16).contains(&exp) {
        let point = exp + 1;
        let s = if point <= 0 {
            format!("0.{}{digits}", "0".repeat((-point) as usize))
        } else if point as usize >= digits.len() {
            format!("{digits}{}.0", "0".repeat(point as usize - digits.len()))
        } else {
            format!(
                "{}.{}",
                &digits[..point as usize],
                &digits[point as usize..]
            )
        };
        format!("{sign}{s}")
    } else {
        let m = if digits.len() > 1 {
            format!("{}.{}", &digits[..1], &digits[1..])
        } else {
            digits
        };
        format!(
            "{sign}{m}e{}{:02}",
            if exp < 0 { '-' } else { '+' },
            exp.abs()
        )
    }
}

/// `strftime_now` of chat templates (Llama 3.1's puts today's date in the system turn):
/// `format` with `%d %m %Y %y %b %B %H %M %S %%` filled from `now` in UTC.
pub(crate) fn strftime(format: &str, now: SystemTime) -> std::result::Result<String, Error> {
    const MONTHS: [&str; 12] = [
        "January",
        "February",
        "March",
        "April",
        "May",
        "June",
        "July",
        "August",
        "September",
        "October",
        "November",
        "December",
    ];
    let secs = now
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs()) as i64;
    let (days, rem) = (secs.div_euclid(86_400), secs.rem_euclid(86_400));
    let (year, month, day) = civil_from_days(days);
    let mut out = String::new();
    let mut chars = format.chars();
    while let Some(c) = chars.next() {
        if c != '%' {
            out.push(c);
            continue;
        }
        let name = MONTHS[(month - 1) as usize];
        match chars.next() {
            Some('d') => out += &format!("{day:02}"),
            Some('m') => out += &format!("{month:02}"),
            Some('Y') => out += &year.to_string(),
            Some('y') => out += &format!("{:02}", year % 100),
            Some('b') => out += &name[..3],
            Some('B') => out += name,
            Some('H') => out += &format!("{:02}", rem / 3600),
            Some('M') => out += &format!("{:02}", rem / 60 % 60),
            Some('S') => out += &format!("{:02}", rem % 60),
            Some('%') => out.push('%'),
            other => {
                return Err(Error::new(
                    ErrorKind::InvalidOperation,
                    format!(
                        "strftime_now: %{} is not supported (use %d %m %Y %y %b %B %H %M %S)",
                        other.map_or(String::new(), String::from)
                    ),
                ))
            }
        }
    }
    Ok(out)
}

/// The proleptic Gregorian (year, month, day) of a day count since 1970-01-01, by
/// 400-year eras.
fn civil_from_days(days: i64) -> (i64, i64, i64) {
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    (yoe + era * 400 + i64::from(month <= 2), month, day)
}

/// A date for `strftime_now`: `26 Jul 2026` (or `26 July 2026`) or `2026-07-26`, at
/// midnight UTC.
pub fn parse_date(s: &str) -> Result<SystemTime> {
    let bad = || {
        DataError::InvalidArgument(format!(
            "date `{s}`: write it as `26 Jul 2026` or `2026-07-26`"
        ))
    };
    let (y, m, d) = if let Some((y, rest)) = s.trim().split_once('-') {
        let (m, d) = rest.split_once('-').ok_or_else(bad)?;
        (
            y.parse::<i64>().map_err(|_| bad())?,
            m.parse::<i64>().map_err(|_| bad())?,
            d.parse::<i64>().map_err(|_| bad())?,
        )
    } else {
        let parts: Vec<&str> = s.split_whitespace().collect();
        let [d, m, y] = parts[..] else {
            return Err(bad());
        };
        let m = m.to_ascii_lowercase();
        let month = [
            "jan", "feb", "mar", "apr", "may", "jun", "jul", "aug", "sep", "oct", "nov", "dec",
        ]
        .iter()
        .position(|p| m.starts_with(p))
        .ok_or_else(bad)? as i64
            + 1;
        (
            y.parse().map_err(|_| bad())?,
            month,
            d.parse().map_err(|_| bad())?,
        )
    };
    if !(1..=12).contains(&m) || !(1..=31).contains(&d) || !(1970..=9999).contains(&y) {
        return Err(bad());
    }
    // Days since the epoch of (y, m, d), the inverse of civil_from_days.
    let (yy, mm) = if m <= 2 { (y - 1, m + 9) } else { (y, m - 3) };
    let era = yy.div_euclid(400);
    let yoe = yy - era * 400;
    let doy = (153 * mm + 2) / 5 + d - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    let days = era * 146_097 + doe - 719_468;
    if civil_from_days(days) != (y, m, d) {
        return Err(bad());
    }
    Ok(std::time::UNIX_EPOCH + std::time::Duration::from_secs(days as u64 * 86_400))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::{Duration, UNIX_EPOCH};

    /// Dates worked out by hand: the epoch, a leap day, and 2026-12-05 12:34:56 UTC
    /// (1,796,474,096 s: 20,792 days and 45,296 s).
    #[test]
    fn strftime_now_formats_dates() {
        let at = |s: u64| UNIX_EPOCH + Duration::from_secs(s);
        assert_eq!(strftime("%d %b %Y", at(0)).unwrap(), "01 Jan 1970");
        // 2024-02-29: 19,782 days after the epoch.
        assert_eq!(
            strftime("%Y-%m-%d", at(19_782 * 86_400)).unwrap(),
            "2024-02-29"
        );
        assert_eq!(
            strftime("%d %B %y %H:%M:%S %%", at(1_796_474_096)).unwrap(),
            "05 December 26 12:34:56 %"
        );
        assert!(strftime("%A", at(0)).is_err());
    }

    #[test]
    fn dates_parse_both_ways_and_refuse_impossible_ones() {
        let leap = UNIX_EPOCH + Duration::from_secs(19_782 * 86_400);
        assert_eq!(parse_date("29 Feb 2024").unwrap(), leap);
        assert_eq!(parse_date("2024-02-29").unwrap(), leap);
        assert_eq!(parse_date("29 february 2024").unwrap(), leap);
        for bad in [
            "30 Feb 2024",
            "2023-02-29",
            "26 Jux 2026",
            "yesterday",
            "2026-13-01",
        ] {
            assert!(parse_date(bad).is_err(), "{bad}");
        }
    }

    /// Python's repr, written out by hand for each case.
    #[test]
    fn floats_print_as_python_repr() {
        for (x, want) in [
            (21.5, "21.5"),
            (1.0, "1.0"),
            (-0.0, "-0.0"),
            (1e-5, "1e-05"),
            (0.0001, "0.0001"),
            (1e16, "1e+16"),
            (1e15, "1000000000000000.0"),
            (1.5e-7, "1.5e-07"),
            (123456789.125, "123456789.125"),
            (0.1 + 0.2, "0.30000000000000004"),
            (-2.5e300, "-2.5e+300"),
        ] {
            assert_eq!(py_float(x), want, "{x}");
        }
    }

    #[test]
    fn generation_tags_become_marker_blocks_keeping_whitespace_control() {
        let (s, found) =
            rewrite_generation_tags("a{%- generation %}b{% endgeneration -%}c{% if x %}");
        assert!(found);
        assert_eq!(
            s,
            "a{%- if true %}\u{E000}{% endif %}b{% if true %}\u{E001}{% endif -%}c{% if x %}"
        );
        assert!(!rewrite_generation_tags("{{ x }}").1);
    }
}
