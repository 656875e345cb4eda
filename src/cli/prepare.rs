//! `kiln prepare`: a text file to a token file, or a fine-tuning dataset of rows to an
//! example file with its loss mask (`kiln_engine::data::examples`).

use std::path::Path;

use anyhow::{bail, Result};
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use kiln::engine::data::chat_template::{parse_date, ModelChat};
use kiln::engine::data::examples::{prepare_examples, ExampleOptions};
use kiln::engine::data::records::Columns;
use kiln::engine::data::{TokenDtype, Tokenizer};

use super::args::{PrepareArgs, RowArgs};

/// Whether `path` is a dataset of rows (JSON Lines, a JSON array, Parquet or a
/// directory of Parquet shards, CSV, TSV) rather than text.
pub(crate) fn is_rows(path: &Path) -> bool {
    path.is_dir()
        || matches!(
            path.extension().and_then(|e| e.to_str()),
            Some("jsonl" | "json" | "parquet" | "arrow" | "csv" | "tsv")
        )
}

impl RowArgs {
    /// The first flag given that only a dataset of rows takes.
    pub(crate) fn first_given(&self) -> Option<&'static str> {
        let given = [
            ("--chat-template", self.chat_template.is_some()),
            ("--date", self.date.is_some()),
            ("--max-length", self.max_length.is_some()),
            ("--train-on-inputs", self.train_on_inputs),
            ("--split", self.split.is_some()),
            ("--truncation", self.truncation != "keep_start"),
            ("--text-column", self.text_column != "text"),
            ("--prompt-column", self.prompt_column != "prompt"),
            (
                "--completion-column",
                self.completion_column != "completion",
            ),
            ("--messages-column", self.messages_column != "messages"),
        ];
        given.iter().find(|f| f.1).map(|f| f.0)
    }
}

pub(crate) fn prepare(a: PrepareArgs) -> Result<()> {
    let tok = Tokenizer::open(&a.tokenizer)?;
    let (name, vocab) = (tok.name(), tok.vocab_size());
    if !is_rows(&a.input) {
        if let Some(flag) = a.rows.first_given() {
            bail!(
                "{flag} is for datasets of rows (.jsonl, .json holding an array, .parquet, a \
                 directory or glob of Parquet shards, a save_to_disk directory or .arrow file, \
                 .csv or .tsv), and {} is read as text",
                a.input.display()
            );
        }
        let n = kiln::engine::data::prepare(&a.input, &a.output, tok)?;
        let width = TokenDtype::for_vocab(vocab);
        outln!(
            "{}: {n} tokens ({name}, vocab {vocab}, {width}) from {}",
            a.output.display(),
            a.input.display()
        );
        return Ok(());
    }
    let summary = prepare_rows(&a.input, &a.output, &tok, a.rows)?;
    outln!("{summary}");
    Ok(())
}

/// Prepares the dataset of rows `input` into the example file `output`, showing
/// progress and the detected format on stderr; returns the line that sums it up.
pub(crate) fn prepare_rows(
    input: &Path,
    output: &Path,
    tok: &Tokenizer,
    a: RowArgs,
) -> Result<String> {
    let (name, vocab) = (tok.name(), tok.vocab_size());
    // One date for every row, recorded in the sidecar.
    let date = Some(match a.date.as_deref() {
        Some(d) => parse_date(d)?,
        None => std::time::SystemTime::now(),
    });
    let (chat, dir) = match tok {
        Tokenizer::Hf(t) => (
            t.chat.clone(),
            t.file.parent().unwrap_or(Path::new(".")).to_path_buf(),
        ),
        _ => (ModelChat::default(), Path::new(".").to_path_buf()),
    };
    // The model's template where it has one (a dataset of text needs none), or the
    // file given.
    let chat = if a.chat_template.is_some() || chat.source.is_some() {
        Some(kiln::template::chosen_template(
            &chat,
            &dir,
            a.chat_template.as_deref(),
            date,
        )?)
    } else {
        None
    };
    let o = ExampleOptions {
        columns: Columns {
            text: a.text_column,
            prompt: a.prompt_column,
            completion: a.completion_column,
            messages: a.messages_column,
        },
        chat,
        max_length: a.max_length,
        truncation: a.truncation.parse()?,
        train_on_inputs: a.train_on_inputs,
        split: a.split,
    };
    if o.max_length == Some(0) {
        bail!("--max-length 0 leaves nothing to train on; give a length of 2 tokens or more");
    }
    let bar = ProgressBar::with_draw_target(None, ProgressDrawTarget::stderr());
    bar.set_style(
        ProgressStyle::with_template("{spinner} {msg} [{elapsed_precise}]")
            .expect("a fixed template"),
    );
    let mut shown = std::time::Instant::now();
    let set = prepare_examples(input, output, tok, &o, &mut |s| {
        if shown.elapsed().as_millis() >= 100 {
            shown = std::time::Instant::now();
            bar.set_message(format!(
                "{} examples, {} tokens trained",
                s.examples, s.trained_tokens
            ));
            bar.tick();
        }
    });
    bar.finish_and_clear();
    let set = set?;
    let columns: Vec<String> = set
        .columns
        .iter()
        .map(|(role, col)| format!("{role} = `{col}`"))
        .collect();
    errln!(
        "{}: {} ({}){}",
        input.display(),
        set.format,
        columns.join(", "),
        set.span_method
            .as_deref()
            .map(|m| format!("; the assistant's text found by {m}"))
            .unwrap_or_default()
    );
    if let Some(end) = &set.untrained_end {
        errln!(
            "warning: in {} of the {} examples the end of an assistant turn, {end}, comes \
             right after the trained text and is not trained, so the model will not learn to \
             end its turn: the chat template closes the turn outside its trained span (its \
             {{% generation %}} block, or the turn-by-turn difference). Use a template whose \
             trained span takes in the end-of-turn token (--chat-template FILE)",
            set.untrained_ends,
            set.examples + set.dropped
        );
    }
    Ok(format!(
        "{}: {} examples ({name}, vocab {vocab}), {} tokens trained{}{}",
        output.display(),
        set.examples,
        set.trained_tokens,
        if set.truncated > 0 {
            format!(
                ", {} cut to {} tokens",
                set.truncated,
                o.max_length.unwrap_or(0)
            )
        } else {
            String::new()
        },
        if set.dropped > 0 {
            format!(", {} dropped (nothing left to train on)", set.dropped)
        } else {
            String::new()
        }
    ))
}
