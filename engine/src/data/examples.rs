//! Fine-tuning rows ([`records`](super::records)) to training examples: each row's
//! token ids and its loss mask (which tokens the loss is taken on), then a prepared
//! example file.
//!
//! What is trained, as TRL's SFT trainer has it:
//! - text: every token, and an end-of-sequence token appended;
//! - prompt + completion strings: the completion's tokens and the appended EOS; the
//!   prompt's ids must be a prefix of the whole's (else the boundary is not a token
//!   boundary, and the example is an error naming it);
//! - conversational prompt + completion: the completion's turns, after the prompt
//!   rendered with the generation prompt (which the whole must extend);
//! - messages (and ShareGPT, read as messages): the assistant's turns, found by the
//!   chat template's `{% generation %}` blocks or turn by turn
//!   ([`SpanMethod`]);
//! - `train_on_inputs`: everything.
//!
//! A token is trained when its bytes overlap the trained text. The first token of an
//! example is never a target (nothing comes before it). `max_length` cuts an example
//! (keeping its start or its end); an example left with nothing to train on is dropped.
//! Both are counted.
//!
//! The prepared file `out.bin` holds the examples' ids one after another (as a token
//! file), `out.bin.mask` one byte per token (1: trained), `out.bin.examples` each
//! example's first token as a little-endian `u64` and the total last, and the sidecar
//! `out.bin.json` says how it was made ([`ExampleSet`]).

use std::io::Write;
use std::ops::Range;
use std::path::Path;

use serde_json::Value;

use super::chat_template::{ChatTemplate, SpanMethod};
use super::hf_tokenizer::Encoded;
use super::prepare::{
    check_outputs, check_token_file_name, write_atomically, write_ids, write_sidecar,
};
use super::records::{
    detect, example, read_csv_rows, read_rows, Columns, Example, Format, RowPlace,
};
use super::token_file::{side_path, Sidecar, TokenDtype};
pub use super::token_file::{ExampleSet, Truncation};
use super::{DataError, Result, Tokenizer};

/// An example's ids and, per id, whether the loss is taken on it (1) or not (0).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Masked {
    pub ids: Vec<u32>,
    pub mask: Vec<u8>,
}

impl Masked {
    /// Ids the loss is taken on: trained ones past the first.
    pub fn trained(&self) -> usize {
        self.mask.iter().skip(1).filter(|&&m| m == 1).count()
    }
}

/// How rows become examples.
#[derive(Clone, Debug, Default)]
pub struct ExampleOptions {
    pub columns: Columns,
    /// A conversation's template (needed for conversational rows).
    pub chat: Option<ChatTemplate>,
    /// Longest example in tokens; longer ones are cut.
    pub max_length: Option<usize>,
    pub truncation: Truncation,
    /// Train on every token, not only the completion's or the assistant's.
    pub train_on_inputs: bool,
    /// A directory of Parquet shards or a saved DatasetDict: the split to read (`train`).
    pub split: Option<String>,
}

/// The ids of `text` and each id's byte range in it; `special`: with the ids the
/// tokenizer's post-processor adds (a BOS), which have empty ranges.
pub fn encode_offsets(tok: &Tokenizer, text: &str, special: bool, what: &Path) -> Result<Encoded> {
    match tok {
        Tokenizer::Hf(t) => t.encode_offsets(text, special, what),
        Tokenizer::Bytes => Ok((
            text.bytes().map(u32::from).collect(),
            (0..text.len()).map(|i| (i, i + 1)).collect(),
        )),
        Tokenizer::Gpt2 => {
            // Byte-level BPE: each id stands for whole bytes, in order.
            let ids = tok.encode(text.as_bytes(), what)?;
            let mut at = 0;
            let mut offsets = Vec::with_capacity(ids.len());
            for &id in &ids {
                let n = tok.decode_bytes(&[id])?.len();
                offsets.push((at, at + n));
                at += n;
            }
            Ok((ids, offsets))
        }
    }
}

/// The end-of-sequence id appended to text and completions: the model's first EOS, or
/// GPT-2's `<|endoftext|>`; none for bytes.
fn eos(tok: &Tokenizer) -> Option<u32> {
    match tok {
        Tokenizer::Hf(t) => t.eos.first().copied(),
        Tokenizer::Gpt2 => Some(50256),
        Tokenizer::Bytes => None,
    }
}

/// The ids that end a turn or a sequence: the model's EOS ids (its tokenizer config's
/// and generation config's), GPT-2's `<|endoftext|>`; none for bytes.
fn end_ids(tok: &Tokenizer) -> Vec<u32> {
    match tok {
        Tokenizer::Hf(t) => t.eos.clone(),
        Tokenizer::Gpt2 => vec![50256],
        Tokenizer::Bytes => vec![],
    }
}

/// The first id of `ends` that directly follows a trained stretch of `m` untrained: a
/// template that closes an assistant turn outside its trained span, so the model would
/// never learn to end its turn.
pub fn untrained_end(m: &Masked, ends: &[u32]) -> Option<u32> {
    (1..m.ids.len()).find_map(|i| {
        let after_trained = m.mask[i - 1] == 1 && m.mask[i] == 0;
        (after_trained && ends.contains(&m.ids[i])).then_some(m.ids[i])
    })
}

/// 1 for every id whose bytes overlap a span.
pub fn mask_of(offsets: &[(usize, usize)], spans: &[Range<usize>]) -> Vec<u8> {
    offsets
        .iter()
        .map(|&(s, e)| spans.iter().any(|r| s < r.end && e > r.start) as u8)
        .collect()
}

/// One row's example, not yet cut to a length; errors name `place`.
pub fn tokenize(
    ex: &Example,
    tok: &Tokenizer,
    o: &ExampleOptions,
    place: &RowPlace<'_>,
) -> Result<Masked> {
    let what = place.file;
    let mut m = match ex {
        Example::Text(text) => {
            let (ids, _) = encode_offsets(tok, text, true, what)?;
            Masked {
                mask: vec![1; ids.len()],
                ids,
            }
        }
        Example::PromptCompletion {
            prompt: Value::String(prompt),
            completion: Value::String(completion),
        } => {
            let (head, _) = encode_offsets(tok, prompt, true, what)?;
            let whole = format!("{prompt}{completion}");
            let (ids, _) = encode_offsets(tok, &whole, true, what)?;
            if !ids.starts_with(&head) {
                return Err(place.error(
                    "the prompt's tokens are not the first tokens of prompt + completion (the \
                     tokenizer joins text across the boundary: a prompt ending in a space, say), \
                     so the completion's tokens cannot be told apart; end the prompt where a \
                     token ends (move the space into the completion)",
                ));
            }
            let mut mask = vec![0; head.len()];
            mask.resize(ids.len(), 1);
            Masked { ids, mask }
        }
        Example::PromptCompletion { prompt, completion } => {
            let chat = template(o, place)?;
            let (Value::Array(p), Value::Array(c)) = (prompt, completion) else {
                return Err(place.error("a prompt and a completion of different kinds"));
            };
            let head = chat
                .render(&serde_json::json!({ "messages": p }), true)
                .map_err(|e| place.error(e))?
                .text;
            let all: Vec<Value> = p.iter().chain(c).cloned().collect();
            let whole = chat
                .render(&serde_json::json!({ "messages": all }), false)
                .map_err(|e| place.error(e))?
                .text;
            if !whole.starts_with(&head) {
                return Err(place.error(format!(
                    "{}: the conversation does not begin with its prompt rendered with the \
                     generation prompt, so the completion cannot be found",
                    chat.origin()
                )));
            }
            let (ids, offsets) = encode_offsets(tok, &whole, false, what)?;
            let mask = mask_of(&offsets, std::slice::from_ref(&(head.len()..whole.len())));
            Masked { ids, mask }
        }
        Example::Conversation(row) => {
            let chat = template(o, place)?;
            let (r, _) = chat.assistant_spans(row).map_err(|e| place.error(e))?;
            let (ids, offsets) = encode_offsets(tok, &r.text, false, what)?;
            let mask = mask_of(&offsets, &r.assistant_spans);
            Masked { ids, mask }
        }
    };
    let appends_eos = matches!(
        ex,
        Example::Text(_)
            | Example::PromptCompletion {
                prompt: Value::String(_),
                ..
            }
    );
    if let (true, Some(eos)) = (appends_eos, eos(tok)) {
        m.ids.push(eos);
        m.mask.push(1);
    }
    if o.train_on_inputs {
        m.mask.iter_mut().for_each(|x| *x = 1);
    }
    Ok(m)
}

fn template<'a>(o: &'a ExampleOptions, place: &RowPlace<'_>) -> Result<&'a ChatTemplate> {
    o.chat.as_ref().ok_or_else(|| {
        place.error(
            "a conversation needs a chat template: give a Hugging Face tokenizer directory \
             that has one (--tokenizer DIR), or a template file (--chat-template FILE)",
        )
    })
}

/// Calls `each` with every row of `input`: the Arrow files of `datasets.save_to_disk`
/// (its directory, or a `.arrow` file) or Parquet (a `.parquet` file, or a directory of
/// shards), of `split` where given, holding the columns of `c` and `tools`; CSV or TSV;
/// else JSON Lines or a JSON array.
pub fn read_dataset(
    input: &Path,
    split: Option<&str>,
    c: &Columns,
    each: impl FnMut(&RowPlace<'_>, serde_json::Map<String, Value>) -> Result<()>,
) -> Result<()> {
    let wanted = [
        c.text.as_str(),
        &c.prompt,
        &c.completion,
        &c.messages,
        "conversations",
        "tools",
    ];
    #[cfg(feature = "arrow")]
    if super::arrow_rows::is_arrow(input) {
        return super::arrow_rows::read_arrow_rows(input, split, &wanted, each);
    }
    #[cfg(not(feature = "arrow"))]
    if input.extension().is_some_and(|e| e == "arrow")
        || ["state.json", "dataset_dict.json"]
            .iter()
            .any(|f| input.join(f).is_file())
    {
        return Err(DataError::format(
            input,
            "this build of kiln-engine reads no Arrow; build it with the `arrow` feature (on \
             by default), or convert the dataset to JSON Lines",
        ));
    }
    #[cfg(feature = "parquet")]
    if super::parquet_rows::is_parquet(input) {
        return super::parquet_rows::read_parquet_rows(input, split, &wanted, each);
    }
    #[cfg(not(feature = "parquet"))]
    if input.is_dir() || input.extension().is_some_and(|e| e == "parquet") {
        let _ = (wanted, split);
        return Err(DataError::format(
            input,
            "this build of kiln-engine reads no Parquet; build it with the `parquet` feature (on by \
             default), or convert the dataset to JSON Lines",
        ));
    }
    match input.extension().and_then(|e| e.to_str()) {
        Some(e) if e.eq_ignore_ascii_case("csv") => read_csv_rows(input, b',', each),
        Some(e) if e.eq_ignore_ascii_case("tsv") => read_csv_rows(input, b'\t', each),
        _ => read_rows(input, each),
    }
}

/// `m` cut to `max` ids, keeping `which` end; whether it was cut.
pub fn truncate(m: &mut Masked, max: usize, which: Truncation) -> bool {
    if m.ids.len() <= max {
        return false;
    }
    match which {
        Truncation::KeepStart => {
            m.ids.truncate(max);
            m.mask.truncate(max);
        }
        Truncation::KeepEnd => {
            let cut = m.ids.len() - max;
            m.ids.drain(..cut);
            m.mask.drain(..cut);
        }
    }
    true
}

/// Rows of `input` ([`read_dataset`]) to the example file `output` (a `.bin` with its
/// mask, example offsets and sidecar, module docs), read and written one row at a time:
/// memory holds one example (and, from Parquet, one row group's pages of the columns
/// read). Every file is written whole or not at all. `progress` hears the counts after
/// each example written.
pub fn prepare_examples(
    input: &Path,
    output: &Path,
    tok: &Tokenizer,
    o: &ExampleOptions,
    progress: &mut dyn FnMut(&ExampleSet),
) -> Result<ExampleSet> {
    // The files read: the input, or each a glob of Parquet shards matches.
    #[cfg(feature = "parquet")]
    let files = super::parquet_rows::glob_matches(input)?.unwrap_or_else(|| vec![input.into()]);
    #[cfg(not(feature = "parquet"))]
    let files = vec![input.to_path_buf()];
    let (mask_path, offsets_path) = (side_path(output, "mask"), side_path(output, "examples"));
    for file in &files {
        let meta = std::fs::metadata(file).map_err(|e| DataError::io(file, "open", e))?;
        check_outputs(
            file,
            &meta,
            &[
                (output.to_path_buf(), "output"),
                (Sidecar::path_for(output), "sidecar"),
                (mask_path.clone(), "mask"),
                (offsets_path.clone(), "offsets file"),
            ],
        )?;
    }
    check_token_file_name(output)?;
    let dtype = TokenDtype::for_vocab(tok.vocab_size());
    let mut set = ExampleSet {
        max_length: o.max_length,
        truncation: o.truncation,
        train_on_inputs: o.train_on_inputs,
        chat_template: o.chat.as_ref().map(|c| c.origin().to_string()),
        ..ExampleSet::default()
    };
    let mut format: Option<Format> = None;
    let mut tokens = 0u64;
    let ends = end_ids(tok);
    write_atomically(&offsets_path, |offsets_out| {
        write_atomically(&mask_path, |mask_out| {
            write_atomically(output, |ids_out| {
                read_dataset(input, o.split.as_deref(), &o.columns, |place, row| {
                    let f = match format {
                        Some(f) => f,
                        None => {
                            let f = detect(&row, &o.columns, place)?;
                            format = Some(f);
                            f
                        }
                    };
                    let ex = example(row, f, &o.columns, place)?;
                    let mut m = tokenize(&ex, tok, o, place)?;
                    if let Some(id) = untrained_end(&m, &ends) {
                        set.untrained_ends += 1;
                        if set.untrained_end.is_none() {
                            let text = tok.decode(&[id]).unwrap_or_default();
                            set.untrained_end = Some(format!("{text:?} (id {id})"));
                        }
                    }
                    if let Some(max) = o.max_length {
                        set.truncated += truncate(&mut m, max, o.truncation) as u64;
                    }
                    if m.trained() == 0 {
                        set.dropped += 1;
                        return Ok(());
                    }
                    offsets_out
                        .write_all(&tokens.to_le_bytes())
                        .map_err(|e| DataError::io(&offsets_path, "write", e))?;
                    write_ids(
                        ids_out,
                        output,
                        &m.ids,
                        tokens,
                        (tok.name(), tok.vocab_size(), dtype),
                    )?;
                    mask_out
                        .write_all(&m.mask)
                        .map_err(|e| DataError::io(&mask_path, "write", e))?;
                    tokens += m.ids.len() as u64;
                    set.examples += 1;
                    set.trained_tokens += m.trained() as u64;
                    progress(&set);
                    Ok(())
                })
            })
        })?;
        offsets_out
            .write_all(&tokens.to_le_bytes())
            .map_err(|e| DataError::io(&offsets_path, "write", e))
    })?;
    let format = format.expect("read_rows refuses a file without rows");
    set.format = format.describe().to_string();
    let c = &o.columns;
    let columns: &[(&str, &str)] = match format {
        Format::Text => &[("text", &c.text)],
        Format::PromptCompletion { .. } => &[("prompt", &c.prompt), ("completion", &c.completion)],
        Format::Messages => &[("messages", &c.messages)],
        Format::ShareGpt => &[("messages", "conversations")],
    };
    set.columns = columns
        .iter()
        .map(|&(role, col)| (role.to_string(), col.to_string()))
        .collect();
    if matches!(
        format,
        Format::Messages
            | Format::ShareGpt
            | Format::PromptCompletion {
                conversational: true
            }
    ) {
        set.span_method = o.chat.as_ref().map(|c| {
            match (format, c.has_generation_tags()) {
                (Format::PromptCompletion { .. }, _) => {
                    "the prompt rendered with the generation prompt"
                }
                (_, true) => SpanMethod::GenerationTags.describe(),
                (_, false) => SpanMethod::TurnByTurn.describe(),
            }
            .to_string()
        });
        set.date = o.chat.as_ref().and_then(ChatTemplate::date);
    } else {
        set.chat_template = None;
    }
    if set.examples == 0 {
        for p in [output.to_path_buf(), mask_path, offsets_path] {
            let _ = std::fs::remove_file(p);
        }
        return Err(DataError::format(
            input,
            format!(
                "no example has anything left to train on ({} dropped){}",
                set.dropped,
                if o.max_length.is_some() {
                    "; a larger --max-length, or --truncation keep_end, keeps more"
                } else {
                    ""
                }
            ),
        ));
    }
    write_sidecar(output, tok, tokens, Some(set.clone()))?;
    Ok(set)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn place() -> RowPlace<'static> {
        RowPlace {
            file: Path::new("rows.jsonl"),
            line: Some(3),
            element: None,
            row: None,
        }
    }

    fn pc(prompt: &str, completion: &str) -> Example {
        Example::PromptCompletion {
            prompt: Value::String(prompt.into()),
            completion: Value::String(completion.into()),
        }
    }

    #[test]
    fn a_completion_is_trained_and_its_prompt_is_not() {
        let o = ExampleOptions::default();
        let m = tokenize(&pc("2+2=", "4"), &Tokenizer::Bytes, &o, &place()).unwrap();
        assert_eq!(m.ids, b"2+2=4".map(u32::from));
        assert_eq!(m.mask, [0, 0, 0, 0, 1]);
        assert_eq!(m.trained(), 1);
        // GPT-2: the EOS is appended and trained.
        let m = tokenize(&pc("Q: hi\nA:", " yes"), &Tokenizer::Gpt2, &o, &place()).unwrap();
        assert_eq!(*m.ids.last().unwrap(), 50256);
        let trained: Vec<u32> = m
            .ids
            .iter()
            .zip(&m.mask)
            .filter(|(_, &k)| k == 1)
            .map(|(&i, _)| i)
            .collect();
        assert_eq!(
            Tokenizer::Gpt2.decode(&trained).unwrap(),
            " yes<|endoftext|>"
        );
        let all = ExampleOptions {
            train_on_inputs: true,
            ..ExampleOptions::default()
        };
        let m = tokenize(&pc("2+2=", "4"), &Tokenizer::Bytes, &all, &place()).unwrap();
        assert_eq!(m.mask, [1; 5]);
    }

    #[test]
    fn a_prompt_whose_tokens_join_the_completions_is_named() {
        // GPT-2 encodes " yes" as one token: a prompt's trailing space is not a prefix.
        let o = ExampleOptions::default();
        assert!(tokenize(&pc("Q: hi\nA:", " yes"), &Tokenizer::Gpt2, &o, &place()).is_ok());
        let e = tokenize(&pc("Q: hi\nA: ", "yes"), &Tokenizer::Gpt2, &o, &place())
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("rows.jsonl") && e.contains("line 3") && e.contains("not the first tokens"),
            "{e}"
        );
    }

    #[test]
    fn a_conversation_trains_on_the_assistants_turns_and_needs_a_template() {
        let chatml = "{% for m in messages %}<|{{ m.role }}|>{% if m.role == 'assistant' %}\
                      {% generation %}{{ m.content }}<|end|>{% endgeneration %}{% else %}\
                      {{ m.content }}<|end|>{% endif %}{% endfor %}";
        let row = serde_json::json!({"messages": [
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": "yo"},
        ]});
        let ex = Example::Conversation(row);
        let e = tokenize(&ex, &Tokenizer::Bytes, &ExampleOptions::default(), &place())
            .unwrap_err()
            .to_string();
        assert!(e.contains("--chat-template"), "{e}");
        let o = ExampleOptions {
            chat: Some(ChatTemplate::new(chatml, "chatml", None).unwrap()),
            ..ExampleOptions::default()
        };
        let m = tokenize(&ex, &Tokenizer::Bytes, &o, &place()).unwrap();
        let text = "<|user|>hi<|end|><|assistant|>yo<|end|>";
        assert_eq!(m.ids, text.bytes().map(u32::from).collect::<Vec<_>>());
        let trained: String = text
            .chars()
            .zip(&m.mask)
            .filter(|(_, &k)| k == 1)
            .map(|(c, _)| c)
            .collect();
        assert_eq!(trained, "yo<|end|>");
    }

    #[test]
    fn truncation_keeps_either_end() {
        let m = Masked {
            ids: vec![1, 2, 3, 4, 5],
            mask: vec![0, 0, 0, 1, 1],
        };
        let mut start = m.clone();
        assert!(truncate(&mut start, 3, Truncation::KeepStart));
        assert_eq!((start.ids.clone(), start.trained()), (vec![1, 2, 3], 0));
        let mut end = m.clone();
        assert!(truncate(&mut end, 3, Truncation::KeepEnd));
        assert_eq!((end.ids.clone(), end.trained()), (vec![3, 4, 5], 2));
        assert!(!truncate(&mut end, 3, Truncation::KeepEnd));
    }
}
