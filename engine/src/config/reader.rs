//! The reader: walks the JSON, checks each value's type and range, and collects problems,
//! warnings and provenance. Each section's file adds the method that reads that section.

use std::borrow::Cow;
use std::collections::BTreeMap;

use serde_json::{Map, Value};

use super::error::Problem;
use super::provenance::Provenance;

/// A value was present but unusable; the problem is already recorded.
pub(super) struct Bad;

/// `Ok(None)`: absent or null. `Ok(Some)`: present and valid.
pub(super) type Got<T> = Result<Option<T>, Bad>;

/// The Hugging Face Trainer's placeholder for a value it fills in.
pub(super) fn is_auto(v: &Value) -> bool {
    v.as_str() == Some("auto")
}

/// Whether `obj[key]` is `"auto"`.
pub(super) fn auto_at(obj: &Map<String, Value>, key: &str) -> bool {
    obj.get(key).is_some_and(is_auto)
}

pub(super) fn join(prefix: &str, key: &str) -> String {
    if prefix.is_empty() {
        key.to_string()
    } else {
        format!("{prefix}.{key}")
    }
}

pub(super) fn describe(v: &Value) -> String {
    match v {
        Value::Null => "null".to_string(),
        Value::Bool(b) => format!("the boolean {b}"),
        Value::Number(n) => format!("the number {n}"),
        Value::String(s) => format!("the string \"{}\"", shorten(s)),
        Value::Array(a) if a.len() == 1 => "an array of 1 element".to_string(),
        Value::Array(a) => format!("an array of {} elements", a.len()),
        Value::Object(_) => "an object".to_string(),
    }
}

/// Characters of a key or string shown in a message before it is cut short.
const SHOWN_CHARS: usize = 48;

/// `s`, or its start and its length when it is too long to repeat in a message: a
/// config may hold keys or strings of megabytes.
pub(super) fn shorten(s: &str) -> Cow<'_, str> {
    match s.char_indices().nth(SHOWN_CHARS) {
        None => Cow::Borrowed(s),
        Some((cut, _)) => Cow::Owned(format!("{}… ({} characters)", &s[..cut], s.chars().count())),
    }
}

/// Problems listed in a [`ConfigError`](super::ConfigError); the rest are only counted,
/// so a file of a million unknown keys costs a million comparisons, not a million
/// messages.
pub(super) const MAX_LISTED: usize = 50;

/// Allowed range of a float.
#[derive(Clone, Copy)]
pub(super) enum Range {
    AtLeast(f64),
    Above(f64),
    Closed(f64, f64),
    HalfOpen(f64, f64),
}

impl Range {
    fn contains(self, x: f64) -> bool {
        match self {
            Range::AtLeast(lo) => x >= lo,
            Range::Above(lo) => x > lo,
            Range::Closed(lo, hi) => (lo..=hi).contains(&x),
            Range::HalfOpen(lo, hi) => (lo..hi).contains(&x),
        }
    }

    fn describe(self) -> String {
        match self {
            Range::AtLeast(lo) => format!("a number >= {lo}"),
            Range::Above(lo) => format!("a number > {lo}"),
            Range::Closed(lo, hi) => format!("a number from {lo} to {hi}"),
            Range::HalfOpen(lo, hi) => format!("a number in [{lo}, {hi})"),
        }
    }
}

fn fix_text(expected: &str, default: Option<&str>) -> String {
    match default {
        Some(d) => format!("write {expected}, or remove the key to use the default {d}"),
        None => format!("write {expected}"),
    }
}

#[derive(Default)]
pub(super) struct Reader {
    /// The first [`MAX_LISTED`] problems.
    pub(super) problems: Vec<Problem>,
    /// Problems found after the first [`MAX_LISTED`].
    pub(super) omitted: usize,
    pub(super) warnings: Vec<String>,
    /// Things `config explain` shows that need no action (keys accepted because they
    /// change nothing here, defaults that differ from other tools').
    pub(super) notes: Vec<String>,
    pub(super) provenance: BTreeMap<String, Provenance>,
    /// `"auto"` values nothing in the file determines: path and what the value must be.
    /// Reported together as one problem at the end (see `auto.rs`).
    pub(super) autos: Vec<(String, String)>,
    /// `"auto"` values filled in with the Hugging Face Trainer's defaults, said once in a
    /// warning: they are right only if the user left those defaults alone.
    pub(super) auto_guesses: Vec<String>,
}

impl Reader {
    pub(super) fn problem(
        &mut self,
        path: &str,
        message: impl Into<String>,
        fix: impl Into<String>,
    ) {
        if self.full() {
            self.omitted += 1;
            return;
        }
        self.problems.push(Problem {
            path: path.to_string(),
            message: message.into(),
            fix: fix.into(),
        });
    }

    /// No more problems will be listed: callers can skip composing one.
    pub(super) fn full(&self) -> bool {
        self.problems.len() >= MAX_LISTED
    }

    pub(super) fn note(&mut self, text: impl Into<String>) {
        self.notes.push(text.into());
    }

    pub(super) fn mark(&mut self, path: &str, p: Provenance) {
        self.provenance.insert(path.to_string(), p);
    }

    /// The value at `key`: `None` when absent or null. `"auto"` is recorded as a value
    /// the file leaves open (all of them become one problem at the end); a section that
    /// can work such a value out checks [`is_auto`] before reading it.
    pub(super) fn raw<'a>(
        &mut self,
        obj: &'a Map<String, Value>,
        path: &str,
        key: &str,
        expected: &str,
    ) -> Got<&'a Value> {
        match obj.get(key) {
            None | Some(Value::Null) => Ok(None),
            Some(v) if is_auto(v) => {
                self.autos.push((path.to_string(), expected.to_string()));
                Err(Bad)
            }
            Some(v) => Ok(Some(v)),
        }
    }

    /// Records a value resolved from `"auto"`: `how` says from what.
    pub(super) fn resolved_auto(&mut self, path: &str, how: impl std::fmt::Display) {
        self.mark(path, Provenance::Inferred(format!("\"auto\": {how}")));
    }

    pub(super) fn wrong_value(
        &mut self,
        path: &str,
        expected: &str,
        found: &Value,
        default: Option<&str>,
    ) {
        let mut message = format!("expected {expected}, found {}", describe(found));
        let mut fix = fix_text(expected, default);
        let fractional = found.as_f64().is_some_and(|f| f.fract() != 0.0);
        if fractional && expected.contains("integer") {
            message.push_str(" (not a whole number)");
        }
        if let Value::String(s) = found {
            if s.trim().parse::<f64>().is_ok() || s == "true" || s == "false" {
                let s = shorten(s.trim());
                fix = format!("remove the quotes: write {s} rather than \"{s}\"");
            }
        }
        self.problem(path, message, fix);
    }

    pub(super) fn uint(
        &mut self,
        obj: &Map<String, Value>,
        prefix: &str,
        key: &str,
        min: u64,
        max: u64,
        default: Option<u64>,
    ) -> Got<u64> {
        let path = join(prefix, key);
        let expected = if max == u64::MAX {
            format!("an integer >= {min}")
        } else {
            format!("an integer from {min} to {max}")
        };
        let dflt = default.map(|d| d.to_string());
        let Some(v) = self.raw(obj, &path, key, &expected)? else {
            return Ok(None);
        };
        let n = match v {
            Value::Number(n) => n.as_u64().or_else(|| {
                // DeepSpeed configs write sizes as floats (5e8): accept whole ones.
                n.as_f64()
                    .filter(|f| f.fract() == 0.0 && *f >= 0.0 && *f < u64::MAX as f64)
                    .map(|f| f as u64)
            }),
            _ => None,
        };
        match n {
            Some(n) if (min..=max).contains(&n) => Ok(Some(n)),
            _ => {
                self.wrong_value(&path, &expected, v, dflt.as_deref());
                Err(Bad)
            }
        }
    }

    fn float(
        &mut self,
        obj: &Map<String, Value>,
        prefix: &str,
        key: &str,
        range: Range,
        default: Option<f64>,
    ) -> Got<f64> {
        let path = join(prefix, key);
        let expected = range.describe();
        let dflt = default.map(|d| format!("{d:?}"));
        let Some(v) = self.raw(obj, &path, key, &expected)? else {
            return Ok(None);
        };
        match v.as_f64() {
            // Stored as f32: the value kept is the f32 nearest, which must be in range too
            // (1e-50 rounds to 0, 0.999999999 to 1) and finite.
            Some(x) if range.contains(x) && range.contains(x as f32 as f64) => {
                if x.abs() <= f32::MAX as f64 {
                    return Ok(Some(x));
                }
                self.problem(
                    &path,
                    format!(
                        "{x:e} is above {:e}, the largest 32-bit float, which Kiln stores it as",
                        f32::MAX
                    ),
                    fix_text(&expected, dflt.as_deref()),
                );
                Err(Bad)
            }
            Some(x) if range.contains(x) => {
                self.problem(
                    &path,
                    format!(
                        "expected {expected}, found {x:e}, which becomes {:e} as the 32-bit float \
                         Kiln stores it as",
                        x as f32
                    ),
                    fix_text(&expected, dflt.as_deref()),
                );
                Err(Bad)
            }
            _ => {
                self.wrong_value(&path, &expected, v, dflt.as_deref());
                Err(Bad)
            }
        }
    }

    pub(super) fn boolean(
        &mut self,
        obj: &Map<String, Value>,
        prefix: &str,
        key: &str,
        default: Option<bool>,
    ) -> Got<bool> {
        let path = join(prefix, key);
        let expected = "true or false";
        let dflt = default.map(|d| d.to_string());
        let Some(v) = self.raw(obj, &path, key, expected)? else {
            return Ok(None);
        };
        match v {
            Value::Bool(b) => Ok(Some(*b)),
            _ => {
                self.wrong_value(&path, expected, v, dflt.as_deref());
                Err(Bad)
            }
        }
    }

    pub(super) fn string<'a>(
        &mut self,
        obj: &'a Map<String, Value>,
        prefix: &str,
        key: &str,
        expected: &str,
    ) -> Got<&'a str> {
        let path = join(prefix, key);
        let Some(v) = self.raw(obj, &path, key, expected)? else {
            return Ok(None);
        };
        match v {
            Value::String(s) => Ok(Some(s)),
            _ => {
                self.wrong_value(&path, expected, v, None);
                Err(Bad)
            }
        }
    }

    pub(super) fn section<'a>(
        &mut self,
        obj: &'a Map<String, Value>,
        prefix: &str,
        key: &str,
    ) -> Got<&'a Map<String, Value>> {
        let path = join(prefix, key);
        let expected = "an object { ... }";
        let Some(v) = self.raw(obj, &path, key, expected)? else {
            return Ok(None);
        };
        match v {
            Value::Object(m) => Ok(Some(m)),
            _ => {
                self.wrong_value(&path, expected, v, None);
                Err(Bad)
            }
        }
    }

    /// Reads an integer with a default, recording where the value came from.
    pub(super) fn uint_or(
        &mut self,
        obj: &Map<String, Value>,
        prefix: &str,
        key: &str,
        (min, max): (u64, u64),
        default: u64,
    ) -> u64 {
        let got = self.uint(obj, prefix, key, min, max, Some(default));
        self.resolved(prefix, key, got, default)
    }

    pub(super) fn float_or(
        &mut self,
        obj: &Map<String, Value>,
        prefix: &str,
        key: &str,
        range: Range,
        default: f64,
    ) -> f64 {
        let got = self.float(obj, prefix, key, range, Some(default));
        self.resolved(prefix, key, got, default)
    }

    pub(super) fn bool_or(
        &mut self,
        obj: &Map<String, Value>,
        prefix: &str,
        key: &str,
        default: bool,
    ) -> bool {
        let got = self.boolean(obj, prefix, key, Some(default));
        self.resolved(prefix, key, got, default)
    }

    fn resolved<T>(&mut self, prefix: &str, key: &str, got: Got<T>, default: T) -> T {
        let path = join(prefix, key);
        match got {
            Ok(Some(v)) => {
                self.mark(&path, Provenance::File);
                v
            }
            _ => {
                self.mark(&path, Provenance::Default);
                default
            }
        }
    }
}
