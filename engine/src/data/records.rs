//! Fine-tuning datasets as rows: JSON Lines (`.jsonl`), JSON arrays (`.json`) and CSV/TSV
//! (a header row of column names), read one row at a time (a file larger than memory is
//! never held whole; Parquet is `parquet_rows`'s), and the dataset
//! formats recognised from their columns as TRL recognises them:
//!
//! - `text`: plain text, trained on whole;
//! - `prompt` + `completion` (strings, or lists of messages): trained on the completion;
//! - `messages` (a list of `{"role", "content"}`, with an optional `tools` column): a
//!   conversation, trained on the assistant's turns;
//! - ShareGPT's `conversations` (a list of `{"from", "value"}`): converted to messages
//!   (`human` → `user`, `gpt` → `assistant`, `system`, `tool`/`function_call`/`observation`
//!   kept by name).
//!
//! Other column names map to these with [`Columns`]. Every error names the file, the
//! line (or the array element) and what to change.

use std::fs::File;
use std::io::{BufRead, BufReader, Read};
use std::path::Path;

use serde_json::{Map, Value};

use super::{DataError, Result};

/// Which columns hold what; the defaults are TRL's names.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Columns {
    pub text: String,
    pub prompt: String,
    pub completion: String,
    pub messages: String,
}

impl Default for Columns {
    fn default() -> Columns {
        Columns {
            text: "text".into(),
            prompt: "prompt".into(),
            completion: "completion".into(),
            messages: "messages".into(),
        }
    }
}

/// A dataset's format, from its first row's columns.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Format {
    Text,
    /// `prompt` and `completion`; `conversational` when they are lists of messages.
    PromptCompletion {
        conversational: bool,
    },
    Messages,
    ShareGpt,
}

impl Format {
    pub fn describe(self) -> &'static str {
        match self {
            Format::Text => "text (trained on whole)",
            Format::PromptCompletion {
                conversational: false,
            } => "prompt/completion (trained on the completion)",
            Format::PromptCompletion {
                conversational: true,
            } => "conversational prompt/completion (trained on the completion's turns)",
            Format::Messages => "messages (trained on the assistant's turns)",
            Format::ShareGpt => {
                "ShareGPT conversations, read as messages (trained on the assistant's turns)"
            }
        }
    }
}

/// One row in a format's terms.
#[derive(Clone, Debug, PartialEq)]
pub enum Example {
    Text(String),
    /// Strings, or (conversational) message lists.
    PromptCompletion {
        prompt: Value,
        completion: Value,
    },
    /// `{"messages": [...], "tools": [...]}`, as a chat template takes it.
    Conversation(Value),
}

/// Where a row came from, for errors: the file and the line (JSON Lines) or the element
/// (a JSON array), both from 1.
#[derive(Clone, Debug)]
pub struct RowPlace<'a> {
    pub file: &'a Path,
    pub line: Option<u64>,
    pub element: Option<u64>,
    /// A Parquet file's row, from 1.
    pub row: Option<u64>,
}

impl RowPlace<'_> {
    /// An error about this row: the file, then `line N: ` or `element N of the array: `.
    pub fn error(&self, detail: impl std::fmt::Display) -> DataError {
        let at = match (self.line, self.element, self.row) {
            (Some(l), _, _) => format!("line {l}: "),
            (None, Some(e), _) => format!("element {e} of the array: "),
            (None, None, Some(r)) => format!("row {r}: "),
            (None, None, None) => String::new(),
        };
        DataError::format(self.file, format!("{at}{detail}"))
    }
}

impl std::fmt::Display for RowPlace<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}", self.file.display())?;
        if let Some(l) = self.line {
            write!(f, ":{l}")?;
        }
        if let Some(e) = self.element {
            write!(f, " (element {e} of the array)")?;
        }
        if let Some(r) = self.row {
            write!(f, " (row {r})")?;
        }
        Ok(())
    }
}

/// Calls `each` with every row of `path` in order: a JSON Lines file (one object per
/// line; blank lines skipped) or a JSON array of objects, read incrementally either way.
/// Stops at the first error, `each`'s included.
pub fn read_rows(
    path: &Path,
    mut each: impl FnMut(&RowPlace<'_>, Map<String, Value>) -> Result<()>,
) -> Result<()> {
    let file = File::open(path).map_err(|e| DataError::io(path, "open", e))?;
    let mut reader = BufReader::with_capacity(1 << 20, file);
    // A JSON array starts with `[` (after a BOM and whitespace); JSON Lines with `{`.
    // Blank lines skipped here still count for the line numbers of errors.
    let mut skipped_lines = 0u64;
    let first = loop {
        let buf = reader
            .fill_buf()
            .map_err(|e| DataError::io(path, "read", e))?;
        if buf.is_empty() {
            return Err(DataError::format(path, "empty: no rows"));
        }
        let skip = if buf.starts_with("\u{feff}".as_bytes()) {
            3
        } else {
            buf.iter().take_while(|b| b.is_ascii_whitespace()).count()
        };
        if skip == 0 {
            break buf[0];
        }
        skipped_lines += buf[..skip].iter().filter(|&&b| b == b'\n').count() as u64;
        reader.consume(skip);
    };
    if first == b'[' {
        return read_array(path, reader, each);
    }
    let mut line = String::new();
    let mut n = skipped_lines;
    loop {
        line.clear();
        let read = reader.read_line(&mut line).map_err(|e| match e.kind() {
            std::io::ErrorKind::InvalidData => DataError::format(
                path,
                format!("line {}: not UTF-8 text; JSON Lines must be UTF-8", n + 1),
            ),
            _ => DataError::io(path, "read", e),
        })?;
        if read == 0 {
            return Ok(());
        }
        n += 1;
        if line.trim().is_empty() {
            continue;
        }
        let place = RowPlace {
            file: path,
            line: Some(n),
            element: None,
            row: None,
        };
        let row: Value = serde_json::from_str(&line).map_err(|e| {
            DataError::format(
                path,
                format!(
                    "line {n}: not valid JSON ({e}); a JSON Lines file holds one JSON object per \
                     line"
                ),
            )
        })?;
        match row {
            Value::Object(m) => each(&place, m)?,
            other => {
                return Err(DataError::format(
                    path,
                    format!(
                        "line {n}: a JSON {} where a row (a JSON object of columns) belongs",
                        kind(&other)
                    ),
                ))
            }
        }
    }
}

/// The elements of a top-level JSON array, one at a time (serde's sequence visitor), so
/// the array is never in memory whole.
/// Calls `each` with every row of the CSV (`delimiter` `,`) or TSV (`\t`) file `path`:
/// the first record names the columns, each later one is a row of strings, read one at
/// a time. A value of a message-list column that starts with `[` is read as the JSON
/// it holds (`messages`, `conversations`, conversational prompts and completions).
pub fn read_csv_rows(
    path: &Path,
    delimiter: u8,
    mut each: impl FnMut(&RowPlace<'_>, Map<String, Value>) -> Result<()>,
) -> Result<()> {
    let file = File::open(path).map_err(|e| DataError::io(path, "open", e))?;
    let mut reader = csv::ReaderBuilder::new()
        .delimiter(delimiter)
        .from_reader(BufReader::with_capacity(1 << 20, file));
    let bad = |e: csv::Error| {
        let line = e.position().map(|p| p.line());
        let at = line.map(|l| format!("line {l}: ")).unwrap_or_default();
        DataError::format(path, format!("{at}not valid CSV ({e})"))
    };
    let header: Vec<String> = reader
        .headers()
        .map_err(bad)?
        .iter()
        .map(|h| h.trim_start_matches('\u{feff}').to_string())
        .collect();
    if header.iter().all(String::is_empty) {
        return Err(DataError::format(
            path,
            "empty: no header row naming the columns",
        ));
    }
    let mut record = csv::StringRecord::new();
    while reader.read_record(&mut record).map_err(bad)? {
        let line = record.position().map(|p| p.line());
        let place = RowPlace {
            file: path,
            line,
            element: None,
            row: None,
        };
        let mut row = Map::new();
        for (name, value) in header.iter().zip(record.iter()) {
            let v = match value.trim_start().starts_with('[') {
                true => serde_json::from_str(value).map_err(|e| {
                    place.error(format!(
                        "column `{name}` starts like a JSON list but is not one ({e})"
                    ))
                })?,
                false => Value::String(value.to_string()),
            };
            row.insert(name.clone(), v);
        }
        each(&place, row)?;
    }
    Ok(())
}

fn read_array(
    path: &Path,
    reader: impl Read,
    each: impl FnMut(&RowPlace<'_>, Map<String, Value>) -> Result<()>,
) -> Result<()> {
    use serde::de::{Deserializer, SeqAccess, Visitor};
    struct Rows<'p, F> {
        path: &'p Path,
        each: F,
        failed: Option<DataError>,
    }
    impl<'de, F: FnMut(&RowPlace<'_>, Map<String, Value>) -> Result<()>> Visitor<'de>
        for &mut Rows<'_, F>
    {
        type Value = ();
        fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
            f.write_str("an array of row objects")
        }
        fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> std::result::Result<(), A::Error> {
            let mut n = 0u64;
            while let Some(v) = seq.next_element::<Value>()? {
                n += 1;
                let place = RowPlace {
                    file: self.path,
                    line: None,
                    element: Some(n),
                    row: None,
                };
                let r = match v {
                    Value::Object(m) => (self.each)(&place, m),
                    other => Err(DataError::format(
                        self.path,
                        format!(
                            "element {n} of the array is a JSON {} where a row (a JSON object of \
                             columns) belongs",
                            kind(&other)
                        ),
                    )),
                };
                if let Err(e) = r {
                    self.failed = Some(e);
                    return Err(serde::de::Error::custom("stopped"));
                }
            }
            Ok(())
        }
    }
    let mut rows = Rows {
        path,
        each,
        failed: None,
    };
    let mut de = serde_json::Deserializer::from_reader(reader);
    let r = de.deserialize_seq(&mut rows);
    if let Some(e) = rows.failed {
        return Err(e);
    }
    r.and_then(|()| de.end()).map_err(|e| {
        DataError::format(
            path,
            format!("not a valid JSON array of rows ({e}); or write one JSON object per line (JSON Lines)"),
        )
    })
}

fn kind(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "boolean",
        Value::Number(_) => "number",
        Value::String(_) => "string",
        Value::Array(_) => "array",
        Value::Object(_) => "object",
    }
}

/// The dataset's format from a row's columns, as TRL tells them apart: messages first,
/// then ShareGPT conversations, prompt + completion, text. Not one of them: an error
/// listing the columns there are and the formats known.
pub fn detect(row: &Map<String, Value>, c: &Columns, place: &RowPlace<'_>) -> Result<Format> {
    if row.contains_key(&c.messages) {
        return Ok(Format::Messages);
    }
    if c.messages == "messages" && row.contains_key("conversations") {
        return Ok(Format::ShareGpt);
    }
    if row.contains_key(&c.prompt) && row.contains_key(&c.completion) {
        let conversational = row[&c.prompt].is_array();
        return Ok(Format::PromptCompletion { conversational });
    }
    if row.contains_key(&c.text) {
        return Ok(Format::Text);
    }
    let present: Vec<&str> = row.keys().map(String::as_str).collect();
    Err(place.error(format!(
        "no column Kiln knows: the row has {}; the formats are `{}` (text), `{}` + `{}` \
         (prompt and completion), `{}` (a conversation) and ShareGPT's `conversations`; name \
         other columns with --text-column, --prompt-column, --completion-column or \
         --messages-column",
        if present.is_empty() {
            "no columns".to_string()
        } else {
            present.join(", ")
        },
        c.text,
        c.prompt,
        c.completion,
        c.messages
    )))
}

/// A row in `format`'s terms. A row of another format than the first's (a missing or
/// mistyped column), an empty completion or a malformed message is an error naming it.
pub fn example(
    mut row: Map<String, Value>,
    format: Format,
    c: &Columns,
    place: &RowPlace<'_>,
) -> Result<Example> {
    let fail = |what: String| place.error(what);
    let mut take = |name: &str| {
        row.remove(name).ok_or_else(|| {
            fail(format!(
                "no `{name}` column, which the dataset's format ({}) needs: rows of mixed \
                 formats cannot be read together",
                format.describe()
            ))
        })
    };
    match format {
        Format::Text => match take(&c.text)? {
            Value::String(s) => Ok(Example::Text(s)),
            other => Err(fail(format!(
                "`{}` is a JSON {}, not text",
                c.text,
                kind(&other)
            ))),
        },
        Format::PromptCompletion { conversational } => {
            let prompt = take(&c.prompt)?;
            let completion = take(&c.completion)?;
            for (name, v) in [(&c.prompt, &prompt), (&c.completion, &completion)] {
                match (conversational, v) {
                    (false, Value::String(_)) => {}
                    (true, Value::Array(m)) => check_messages(m, name, &fail)?,
                    _ => {
                        return Err(fail(format!(
                            "`{name}` is a JSON {} but the dataset's first row made it {}",
                            kind(v),
                            if conversational {
                                "a list of messages"
                            } else {
                                "a string"
                            }
                        )))
                    }
                }
            }
            let empty = match &completion {
                Value::String(s) => s.is_empty(),
                Value::Array(m) => m.is_empty(),
                _ => false,
            };
            if empty {
                return Err(fail(format!(
                    "the `{}` is empty: there is nothing to train on",
                    c.completion
                )));
            }
            Ok(Example::PromptCompletion { prompt, completion })
        }
        Format::Messages => {
            let messages = take(&c.messages)?;
            let Value::Array(m) = &messages else {
                return Err(fail(format!(
                    "`{}` is a JSON {}, not a list of messages",
                    c.messages,
                    kind(&messages)
                )));
            };
            check_messages(m, &c.messages, &fail)?;
            let mut conv = Map::new();
            conv.insert("messages".into(), messages);
            if let Some(tools) = row.remove("tools").filter(|t| !t.is_null()) {
                conv.insert("tools".into(), tools);
            }
            Ok(Example::Conversation(Value::Object(conv)))
        }
        Format::ShareGpt => {
            let turns = take("conversations")?;
            let Value::Array(turns) = turns else {
                return Err(fail("`conversations` is not a list of turns".into()));
            };
            let mut messages = Vec::with_capacity(turns.len());
            for (i, t) in turns.iter().enumerate() {
                let (Some(from), Some(value)) = (
                    t.get("from").and_then(Value::as_str),
                    t.get("value").and_then(Value::as_str),
                ) else {
                    return Err(fail(format!(
                        "turn {i} of `conversations` has no string `from` and `value` (ShareGPT \
                         turns are {{\"from\": \"human\", \"value\": \"...\"}})"
                    )));
                };
                let role = match from {
                    "human" | "user" => "user",
                    "gpt" | "assistant" | "model" => "assistant",
                    other => other,
                };
                messages.push(serde_json::json!({"role": role, "content": value}));
            }
            check_messages(&messages, "conversations", &fail)?;
            Ok(Example::Conversation(
                serde_json::json!({ "messages": messages }),
            ))
        }
    }
}

/// Messages are objects with a string `role`; `content` a string (or a list of parts,
/// or absent beside `tool_calls`, as templates take them).
fn check_messages(
    messages: &[Value],
    column: &str,
    fail: &dyn Fn(String) -> DataError,
) -> Result<()> {
    if messages.is_empty() {
        return Err(fail(format!(
            "`{column}` is an empty list: there is no conversation"
        )));
    }
    for (i, m) in messages.iter().enumerate() {
        if m.get("role").and_then(Value::as_str).is_none() {
            return Err(fail(format!(
                "message {i} of `{column}` has no string `role` (messages are {{\"role\": \
                 \"user\", \"content\": \"...\"}})"
            )));
        }
        match m.get("content") {
            Some(Value::String(_) | Value::Array(_) | Value::Null) | None => {}
            Some(other) => {
                return Err(fail(format!(
                    "message {i} of `{column}` has a JSON {} as its content",
                    kind(other)
                )))
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn file(name: &str, text: &str) -> std::path::PathBuf {
        let dir = std::env::temp_dir().join(format!("kiln-records-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let p = dir.join(name);
        std::fs::write(&p, text).unwrap();
        p
    }

    fn rows(path: &Path) -> Result<Vec<(String, Map<String, Value>)>> {
        let mut out = vec![];
        read_rows(path, |place, row| {
            out.push((place.to_string(), row));
            Ok(())
        })?;
        Ok(out)
    }

    #[test]
    fn jsonl_and_json_arrays_give_the_same_rows_with_their_places() {
        let jsonl = file("a.jsonl", "{\"text\": \"one\"}\n\n{\"text\": \"two\"}\r\n");
        let array = file(
            "a.json",
            "\u{feff}  [ {\"text\": \"one\"}, {\"text\": \"two\"} ]\n",
        );
        let (a, b) = (rows(&jsonl).unwrap(), rows(&array).unwrap());
        assert_eq!(a.len(), 2);
        assert_eq!(
            a.iter().map(|r| &r.1).collect::<Vec<_>>(),
            b.iter().map(|r| &r.1).collect::<Vec<_>>()
        );
        assert!(a[1].0.ends_with("a.jsonl:3"), "{}", a[1].0);
        assert!(
            b[1].0.ends_with("a.json (element 2 of the array)"),
            "{}",
            b[1].0
        );
    }

    #[test]
    fn malformed_files_name_the_line_and_the_fix() {
        let bad = file("bad.jsonl", "{\"text\": \"ok\"}\n{\"text\": \"cut\n");
        let e = rows(&bad).unwrap_err().to_string();
        assert!(
            e.contains("bad.jsonl") && e.contains("line 2") && e.contains("not valid JSON"),
            "{e}"
        );
        let scalar = file("scalar.jsonl", "[1, 2]\n");
        let e = rows(&scalar).unwrap_err().to_string();
        assert!(e.contains("element 1") && e.contains("number"), "{e}");
        let e = rows(&file("empty.jsonl", "\n \n")).unwrap_err().to_string();
        assert!(e.contains("no rows"), "{e}");
        let late = file("late.jsonl", "\n\n{\"text\": 1}\n");
        let e = rows(&late).map(|r| r[0].0.clone()).unwrap();
        assert!(
            e.ends_with("late.jsonl:3"),
            "blank lines before the first row count: {e}"
        );
        std::fs::write(bad.with_file_name("bin.jsonl"), b"{\"text\": \"\xff\"}\n").unwrap();
        let e = rows(&bad.with_file_name("bin.jsonl"))
            .unwrap_err()
            .to_string();
        assert!(e.contains("not UTF-8"), "{e}");
        let e = rows(&file("truncated.json", "[{\"text\": \"a\"},"))
            .unwrap_err()
            .to_string();
        assert!(e.contains("not a valid JSON array"), "{e}");
    }

    fn one(json: &str) -> Map<String, Value> {
        serde_json::from_str(json).unwrap()
    }

    #[test]
    fn formats_are_told_apart_by_their_columns() {
        let c = Columns::default();
        let p = Path::new("d.jsonl");
        let place = RowPlace {
            file: p,
            line: Some(1),
            element: None,
            row: None,
        };
        let f = |j: &str| detect(&one(j), &c, &place);
        assert_eq!(f(r#"{"text": "t"}"#).unwrap(), Format::Text);
        assert_eq!(
            f(r#"{"prompt": "p", "completion": "c", "text": "x"}"#).unwrap(),
            Format::PromptCompletion {
                conversational: false
            }
        );
        assert_eq!(
            f(r#"{"prompt": [{"role": "user", "content": "p"}], "completion": []}"#).unwrap(),
            Format::PromptCompletion {
                conversational: true
            }
        );
        assert_eq!(
            f(r#"{"messages": [], "text": "x"}"#).unwrap(),
            Format::Messages
        );
        assert_eq!(f(r#"{"conversations": []}"#).unwrap(), Format::ShareGpt);
        let e = f(r#"{"question": "q", "answer": "a"}"#)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("d.jsonl: line 1:")
                && e.contains("question, answer")
                && e.contains("--prompt-column"),
            "{e}"
        );
        // Other names, mapped.
        let mapped = Columns {
            prompt: "question".into(),
            completion: "answer".into(),
            ..Columns::default()
        };
        assert_eq!(
            detect(&one(r#"{"question": "q", "answer": "a"}"#), &mapped, &place).unwrap(),
            Format::PromptCompletion {
                conversational: false
            }
        );
    }

    #[test]
    fn rows_become_examples_and_bad_rows_are_named() {
        let c = Columns::default();
        let place = RowPlace {
            file: Path::new("d.jsonl"),
            line: Some(7),
            element: None,
            row: None,
        };
        let ex = |j: &str, f: Format| example(one(j), f, &c, &place);
        let share = ex(
            r#"{"conversations": [{"from": "system", "value": "s"}, {"from": "human", "value": "h"}, {"from": "gpt", "value": "g"}]}"#,
            Format::ShareGpt,
        )
        .unwrap();
        assert_eq!(
            share,
            Example::Conversation(serde_json::json!({"messages": [
                {"role": "system", "content": "s"}, {"role": "user", "content": "h"},
                {"role": "assistant", "content": "g"}]}))
        );
        let conv = ex(
            r#"{"messages": [{"role": "user", "content": "u"}], "tools": [{"name": "f"}], "id": 3}"#,
            Format::Messages,
        )
        .unwrap();
        assert_eq!(
            conv,
            Example::Conversation(
                serde_json::json!({"messages": [{"role": "user", "content": "u"}],
                "tools": [{"name": "f"}]})
            )
        );
        let pc = Format::PromptCompletion {
            conversational: false,
        };
        for (row, want) in [
            (r#"{"text": "t"}"#, "no `prompt` column"),
            (r#"{"prompt": "p", "completion": ""}"#, "empty"),
            (
                r#"{"prompt": ["p"], "completion": "c"}"#,
                "made it a string",
            ),
        ] {
            let e = ex(row, pc).unwrap_err().to_string();
            assert!(
                e.contains("d.jsonl: line 7:") && e.contains(want),
                "{row}: {e}"
            );
        }
        let e = ex(r#"{"messages": [{"content": "c"}]}"#, Format::Messages)
            .unwrap_err()
            .to_string();
        assert!(e.contains("message 0") && e.contains("role"), "{e}");
        let e = ex(
            r#"{"conversations": [{"from": "human"}]}"#,
            Format::ShareGpt,
        )
        .unwrap_err()
        .to_string();
        assert!(e.contains("turn 0"), "{e}");
    }
}
