//! The keys one JSON object may hold, and the check of an object against them: unknown
//! keys are errors with a suggestion, keys that change nothing here are accepted (with a
//! note, or a warning when set to ask for something Kiln then does not do), and features
//! Kiln does not implement are errors unless set to a value that asks for nothing.

use serde_json::{Map, Value};

use super::reader::{describe, join, shorten, Reader};
use super::suggest::suggest;

/// The values of a key that ask for nothing (`null`, "not set", always does).
#[derive(Clone, Copy)]
pub(super) enum Inert {
    /// Every value: the key has no effect in Kiln whatever it holds.
    Any,
    /// Only `null`.
    Null,
    Bool(bool),
    Num(f64),
    /// `false` or an object with `"enabled": false`.
    Disabled,
    /// An object whose values are all `null`, `false` or 0 (`{}` included): sections
    /// without an `enabled` key, whose options are off at those values.
    Empty,
}

impl Inert {
    fn accepts(self, v: &Value) -> bool {
        if v.is_null() {
            return true;
        }
        match self {
            Inert::Any => true,
            Inert::Null => false,
            Inert::Bool(b) => v.as_bool() == Some(b),
            Inert::Num(x) => v.as_f64() == Some(x),
            Inert::Disabled => is_off(v),
            Inert::Empty => v.as_object().is_some_and(|m| {
                m.values()
                    .all(|x| x.is_null() || x == &Value::Bool(false) || x.as_f64() == Some(0.0))
            }),
        }
    }

    fn fix(self) -> String {
        match self {
            Inert::Any | Inert::Null => "remove the key".to_string(),
            Inert::Bool(b) => format!("remove the key or set it to {b}"),
            Inert::Num(x) => format!("remove the key or set it to {x}"),
            Inert::Disabled => "remove the key or set \"enabled\": false".to_string(),
            Inert::Empty => "remove the key, or set its options to null or false".to_string(),
        }
    }
}

/// Off in the way DeepSpeed sections are switched off.
fn is_off(v: &Value) -> bool {
    match v {
        Value::Null | Value::Bool(false) => true,
        Value::Object(m) => m.get("enabled") == Some(&Value::Bool(false)),
        _ => false,
    }
}

/// The keys one JSON object may hold.
pub(super) struct Spec<'s> {
    /// Implemented by Kiln.
    pub(super) keys: &'s [&'s str],
    /// Known to DeepSpeed, no effect on training here: accepted, with a note when it
    /// holds a value that asks for nothing (its default, or any value for [`Inert::Any`])
    /// and a warning otherwise, since the user then expects something Kiln does not do.
    /// The string says why it does not matter.
    pub(super) ignored: &'s [(&'s str, Inert, &'s str)],
    /// Known to DeepSpeed, would change training, not implemented: rejected unless inert.
    pub(super) unsupported: &'s [(&'s str, Inert, &'s str)],
    /// Fix texts for keys that are wrong here but a common mistake.
    pub(super) hints: &'s [(&'s str, &'s str)],
}

impl Spec<'_> {
    pub(super) const fn keys<'s>(keys: &'s [&'s str]) -> Spec<'s> {
        Spec {
            keys,
            ignored: &[],
            unsupported: &[],
            hints: &[],
        }
    }
}

impl Reader {
    /// Checks every key of `obj` against `spec`: records unknown and unsupported keys as
    /// problems, ignored ones as warnings, and keys accepted as they are as notes.
    pub(super) fn check_keys(&mut self, obj: &Map<String, Value>, prefix: &str, spec: &Spec) {
        for (key, v) in obj {
            if spec.keys.contains(&key.as_str()) {
                continue;
            }
            if let Some((_, inert, why)) = spec.ignored.iter().find(|(k, ..)| k == key) {
                let path = join(prefix, key);
                if v.is_null() {
                    // Not set: nothing to say.
                } else if inert.accepts(v) {
                    self.note(format!(
                        "{path} is accepted and changes nothing in Kiln: {why}"
                    ));
                } else {
                    self.warnings
                        .push(format!("ignored by Kiln: {path} ({why})"));
                }
                continue;
            }
            if let Some((_, inert, what)) = spec.unsupported.iter().find(|(k, ..)| k == key) {
                let path = join(prefix, key);
                if v.is_null() {
                    // Not set: nothing to say.
                } else if inert.accepts(v) {
                    self.note(format!(
                        "{path} is accepted: as set, it leaves off {what}, which Kiln does not \
                         implement"
                    ));
                } else {
                    self.problem(
                        &path,
                        format!("not supported by Kiln: {what} (found {})", describe(v)),
                        inert.fix(),
                    );
                }
                continue;
            }
            if self.full() {
                // Not listed anyway: spare the message and the suggestion search.
                self.omitted += 1;
                continue;
            }
            let shown = shorten(key);
            let path = join(prefix, &shown);
            let place = if prefix.is_empty() {
                "at the top level".to_string()
            } else {
                format!("in \"{prefix}\"")
            };
            let known = spec
                .keys
                .iter()
                .copied()
                .chain(spec.ignored.iter().map(|(k, ..)| *k))
                .chain(spec.unsupported.iter().map(|(k, ..)| *k));
            let fix = if let Some((_, hint)) = spec.hints.iter().find(|(k, _)| k == key) {
                hint.to_string()
            } else if let Some(s) = suggest(key, known) {
                format!("did you mean \"{s}\"?")
            } else {
                format!(
                    "remove it; the keys Kiln accepts {place} are: {}",
                    spec.keys.join(", ")
                )
            };
            self.problem(&path, format!("unknown key \"{shown}\" {place}"), fix);
        }
    }
}
