//! Datasets saved by Hugging Face `datasets`' `save_to_disk`: a directory holding
//! `state.json` (its `_data_files`, in order), `dataset_info.json` and the
//! `data-NNNNN-of-NNNNN.arrow` files, which are Arrow IPC streams; or a `DatasetDict`'s
//! directory (`dataset_dict.json` naming its splits, one such directory each). A single
//! `.arrow` file (stream or file format) reads too. Rows are read record batch by record
//! batch (`save_to_disk` writes 1,000 rows to a batch), so memory holds one batch at a
//! time, whatever the dataset's size. Each row becomes the JSON object
//! [`records`](super::records) reads from JSON Lines, as Parquet's rows do.

use std::fs::File;
use std::io::{BufReader, Read, Seek, SeekFrom};
use std::path::{Path, PathBuf};

use arrow_array::cast::AsArray;
use arrow_array::types::{
    Float16Type, Float32Type, Float64Type, Int16Type, Int32Type, Int64Type, Int8Type, UInt16Type,
    UInt32Type, UInt64Type, UInt8Type,
};
use arrow_array::{Array, RecordBatch};
use arrow_schema::{ArrowError, DataType};
use serde_json::{Map, Value};

use super::records::RowPlace;
use super::{DataError, Result};

/// Whether `path` is read as Arrow: a `.arrow` file, or a directory `save_to_disk` wrote
/// (a dataset's, with `state.json`, or a `DatasetDict`'s, with `dataset_dict.json`).
pub fn is_arrow(path: &Path) -> bool {
    if path.is_dir() {
        return path.join("state.json").is_file() || path.join("dataset_dict.json").is_file();
    }
    path.extension()
        .is_some_and(|e| e.eq_ignore_ascii_case("arrow"))
}

/// Reads a JSON file of `save_to_disk`'s.
fn read_json(path: &Path) -> Result<Value> {
    let text = std::fs::read_to_string(path).map_err(|e| DataError::io(path, "read", e))?;
    serde_json::from_str(&text).map_err(|e| DataError::format(path, format!("not JSON: {e}")))
}

/// The `.arrow` files of `path` in order: itself, the `_data_files` of a dataset
/// directory's `state.json`, or those of the split `split` of a `DatasetDict` (needed
/// when it has several: training on a test split by accident is refused).
pub fn arrow_files(path: &Path, split: Option<&str>) -> Result<Vec<PathBuf>> {
    if !path.is_dir() {
        if let Some(want) = split {
            return Err(DataError::format(
                path,
                format!(
                    "--split {want}: one .arrow file holds one split; give the directory \
                     `save_to_disk` wrote, or drop --split"
                ),
            ));
        }
        return Ok(vec![path.to_path_buf()]);
    }
    let dict = path.join("dataset_dict.json");
    if dict.is_file() {
        let splits: Vec<String> = read_json(&dict)?["splits"]
            .as_array()
            .map(|a| {
                a.iter()
                    .filter_map(|s| s.as_str().map(str::to_string))
                    .collect()
            })
            .unwrap_or_default();
        let chosen = match (split, splits.as_slice()) {
            (Some(want), _) if splits.iter().any(|s| s == want) => want.to_string(),
            (Some(want), _) => {
                return Err(DataError::format(
                    &dict,
                    format!(
                        "no split `{want}`; the dataset's splits: {}",
                        splits.join(", ")
                    ),
                ))
            }
            (None, [one]) => one.clone(),
            (None, _) => {
                return Err(DataError::format(
                    path,
                    format!(
                        "holds the splits {}: say which to read with --split",
                        splits.join(", ")
                    ),
                ))
            }
        };
        return arrow_files(&path.join(chosen), None);
    }
    let state = path.join("state.json");
    let state_json = read_json(&state)?;
    // A dataset of one split says which; another asked for is refused, not ignored.
    if let (Some(want), Some(have)) = (split, state_json["_split"].as_str()) {
        if want != have {
            return Err(DataError::format(
                path,
                format!("--split {want}: this dataset is the split `{have}`"),
            ));
        }
    }
    let files: Vec<PathBuf> = state_json["_data_files"]
        .as_array()
        .map(|a| {
            a.iter()
                .filter_map(|f| f["filename"].as_str())
                .map(|f| path.join(f))
                .collect()
        })
        .unwrap_or_default();
    if files.is_empty() {
        return Err(DataError::format(
            &state,
            "names no data files (`_data_files`): is this a directory `datasets.save_to_disk` \
             wrote?",
        ));
    }
    if let Some(missing) = files.iter().find(|f| !f.is_file()) {
        return Err(DataError::format(
            &state,
            format!(
                "names {}, which is not there: the dataset was copied in part",
                missing.display()
            ),
        ));
    }
    Ok(files)
}

/// Calls `each` with every row of the Arrow dataset `path` (of `split`, see
/// [`arrow_files`]), holding the columns of `wanted` that the files have (all columns
/// when none of them is there, so that the error about the row names what it has).
/// Stops at the first error.
pub fn read_arrow_rows(
    path: &Path,
    split: Option<&str>,
    wanted: &[&str],
    mut each: impl FnMut(&RowPlace<'_>, Map<String, Value>) -> Result<()>,
) -> Result<()> {
    for file in arrow_files(path, split)? {
        let not_arrow = |e: ArrowError| {
            DataError::format(
                &file,
                format!(
                    "not an Arrow IPC file Kiln can read ({e}); give the directory \
                     `datasets.save_to_disk` wrote, or a .arrow file of rows"
                ),
            )
        };
        let mut f = File::open(&file).map_err(|e| DataError::io(&file, "open", e))?;
        // The file format starts with ARROW1; `save_to_disk` writes the stream format.
        let mut magic = [0u8; 6];
        let is_file_format = f.read_exact(&mut magic).is_ok() && &magic == b"ARROW1";
        f.seek(SeekFrom::Start(0))
            .map_err(|e| DataError::io(&file, "read", e))?;
        let batches: Box<dyn Iterator<Item = std::result::Result<RecordBatch, ArrowError>>> =
            if is_file_format {
                Box::new(
                    arrow_ipc::reader::FileReader::try_new(BufReader::new(f), None)
                        .map_err(not_arrow)?,
                )
            } else {
                Box::new(
                    arrow_ipc::reader::StreamReader::try_new(BufReader::new(f), None)
                        .map_err(not_arrow)?,
                )
            };
        let mut row = 0u64;
        for batch in batches {
            let batch = batch.map_err(|e| {
                DataError::format(
                    &file,
                    format!("reading a batch of rows after row {row}: {e}"),
                )
            })?;
            let schema = batch.schema();
            let names: Vec<&str> = schema.fields().iter().map(|f| f.name().as_str()).collect();
            // None of the columns asked for: every column is named (without its value,
            // which may be of a type Kiln does not read), for the error to list them.
            let any = names.iter().any(|n| wanted.contains(n));
            let kept: Vec<usize> = (0..names.len())
                .filter(|&c| !any || wanted.contains(&names[c]))
                .collect();
            for i in 0..batch.num_rows() {
                row += 1;
                let place = RowPlace {
                    file: &file,
                    line: None,
                    element: None,
                    row: Some(row),
                };
                let mut object = Map::new();
                for &c in &kept {
                    let value = match any {
                        true => to_json(batch.column(c).as_ref(), i, names[c], &place)?,
                        false => Value::Null,
                    };
                    object.insert(names[c].to_string(), value);
                }
                each(&place, object)?;
            }
        }
    }
    Ok(())
}

/// Element `i` of the Arrow array `a` as JSON; `column` names it in errors.
fn to_json(a: &dyn Array, i: usize, column: &str, place: &RowPlace<'_>) -> Result<Value> {
    if a.is_null(i) {
        return Ok(Value::Null);
    }
    let number = |x: f64| serde_json::Number::from_f64(x).map_or(Value::Null, Value::Number);
    let list = |items: std::sync::Arc<dyn Array>| -> Result<Value> {
        (0..items.len())
            .map(|j| to_json(items.as_ref(), j, column, place))
            .collect::<Result<Vec<_>>>()
            .map(Value::Array)
    };
    Ok(match a.data_type() {
        DataType::Null => Value::Null,
        DataType::Boolean => Value::Bool(a.as_boolean().value(i)),
        DataType::Int8 => a.as_primitive::<Int8Type>().value(i).into(),
        DataType::Int16 => a.as_primitive::<Int16Type>().value(i).into(),
        DataType::Int32 => a.as_primitive::<Int32Type>().value(i).into(),
        DataType::Int64 => a.as_primitive::<Int64Type>().value(i).into(),
        DataType::UInt8 => a.as_primitive::<UInt8Type>().value(i).into(),
        DataType::UInt16 => a.as_primitive::<UInt16Type>().value(i).into(),
        DataType::UInt32 => a.as_primitive::<UInt32Type>().value(i).into(),
        DataType::UInt64 => a.as_primitive::<UInt64Type>().value(i).into(),
        DataType::Float16 => number(f64::from(a.as_primitive::<Float16Type>().value(i))),
        DataType::Float32 => number(f64::from(a.as_primitive::<Float32Type>().value(i))),
        DataType::Float64 => number(a.as_primitive::<Float64Type>().value(i)),
        DataType::Utf8 => Value::String(a.as_string::<i32>().value(i).to_string()),
        DataType::LargeUtf8 => Value::String(a.as_string::<i64>().value(i).to_string()),
        DataType::Utf8View => Value::String(a.as_string_view().value(i).to_string()),
        DataType::List(_) => list(a.as_list::<i32>().value(i))?,
        DataType::LargeList(_) => list(a.as_list::<i64>().value(i))?,
        DataType::FixedSizeList(..) => list(a.as_fixed_size_list().value(i))?,
        DataType::Struct(fields) => {
            let s = a.as_struct();
            let mut object = Map::new();
            for (f, child) in fields.iter().zip(s.columns()) {
                let name = format!("{column}.{}", f.name());
                let value = to_json(child.as_ref(), i, &name, place)?;
                object.insert(f.name().clone(), value);
            }
            Value::Object(object)
        }
        DataType::Binary
        | DataType::LargeBinary
        | DataType::BinaryView
        | DataType::FixedSizeBinary(_) => {
            return Err(place.error(format!(
                "column `{column}` holds binary data ({}), not text: save it as a string column",
                a.data_type()
            )))
        }
        other => {
            return Err(place.error(format!(
                "column `{column}` has the type {other}, which Kiln does not read as part of an \
                 example: strings, lists, structs, numbers and booleans are read"
            )))
        }
    })
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use arrow_array::builder::{LargeStringBuilder, ListBuilder, StructBuilder};
    use arrow_array::{ArrayRef, BinaryArray, StringArray, StringViewArray};
    use arrow_ipc::writer::{FileWriter, StreamWriter};
    use arrow_schema::{Field, Fields, Schema};

    use super::*;

    fn scratch(name: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("kiln-arrow-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        dir
    }

    /// A batch of `rows` conversations: `messages` a list of {role, content} structs
    /// (large strings, as `datasets` writes them), `id` a string view, `n` an int.
    fn conversations(rows: &[(&str, &str)], first: i64) -> RecordBatch {
        let entry = Fields::from(vec![
            Field::new("role", DataType::LargeUtf8, true),
            Field::new("content", DataType::LargeUtf8, true),
        ]);
        let mut messages = ListBuilder::new(StructBuilder::new(
            entry.clone(),
            vec![
                Box::new(LargeStringBuilder::new()),
                Box::new(LargeStringBuilder::new()),
            ],
        ));
        for (user, assistant) in rows {
            let turns = messages.values();
            for (role, content) in [("user", user), ("assistant", assistant)] {
                turns
                    .field_builder::<LargeStringBuilder>(0)
                    .unwrap()
                    .append_value(role);
                turns
                    .field_builder::<LargeStringBuilder>(1)
                    .unwrap()
                    .append_value(content);
                turns.append(true);
            }
            messages.append(true);
        }
        let ids: Vec<String> = (0..rows.len())
            .map(|r| format!("row {}", first + r as i64))
            .collect();
        let n: Vec<i64> = (0..rows.len() as i64).map(|r| first + r).collect();
        let columns: Vec<ArrayRef> = vec![
            Arc::new(messages.finish()),
            Arc::new(StringViewArray::from_iter_values(ids)),
            Arc::new(arrow_array::Int64Array::from(n)),
        ];
        RecordBatch::try_new(Arc::new(schema(entry)), columns).unwrap()
    }

    fn schema(entry: Fields) -> Schema {
        let item = Field::new("item", DataType::Struct(entry), true);
        Schema::new(vec![
            Field::new("messages", DataType::List(Arc::new(item)), true),
            Field::new("id", DataType::Utf8View, true),
            Field::new("n", DataType::Int64, true),
        ])
    }

    /// A directory laid out as `save_to_disk` lays it out: two stream files of two
    /// batches each, named in state.json.
    fn saved(dir: &Path) {
        let rows: Vec<(String, String)> = (0..7)
            .map(|r| (format!("question {r} é"), format!("answer {r} <b>")))
            .collect();
        let refs: Vec<(&str, &str)> = rows.iter().map(|(a, b)| (a.as_str(), b.as_str())).collect();
        let mut names = vec![];
        for (f, part) in [&refs[..4], &refs[4..]].iter().enumerate() {
            let name = format!("data-{f:05}-of-00002.arrow");
            let out = File::create(dir.join(&name)).unwrap();
            let first = if f == 0 { 0 } else { 4 };
            let b0 = conversations(&part[..2], first);
            let b1 = conversations(&part[2..], first + 2);
            let mut w = StreamWriter::try_new(out, &b0.schema()).unwrap();
            w.write(&b0).unwrap();
            w.write(&b1).unwrap();
            w.finish().unwrap();
            names.push(serde_json::json!({"filename": name}));
        }
        let state = serde_json::json!({"_data_files": names, "_split": "train"});
        std::fs::write(dir.join("state.json"), state.to_string()).unwrap();
        std::fs::write(dir.join("dataset_info.json"), "{}").unwrap();
    }

    fn read_all(path: &Path, split: Option<&str>, wanted: &[&str]) -> Result<Vec<Value>> {
        let mut out = vec![];
        read_arrow_rows(path, split, wanted, |_, row| {
            out.push(Value::Object(row));
            Ok(())
        })?;
        Ok(out)
    }

    /// Every row of every batch of every file, in order, as the JSON the same row of a
    /// JSON Lines file gives; only the columns asked for.
    #[test]
    fn a_saved_dataset_reads_as_its_rows_in_order() {
        let dir = scratch("saved");
        saved(&dir);
        assert!(is_arrow(&dir));
        let rows = read_all(&dir, None, &["messages", "n"]).unwrap();
        assert_eq!(rows.len(), 7);
        for (r, row) in rows.iter().enumerate() {
            let want = serde_json::json!({
                "messages": [
                    {"role": "user", "content": format!("question {r} é")},
                    {"role": "assistant", "content": format!("answer {r} <b>")},
                ],
                "n": r,
            });
            assert_eq!(row, &want);
        }
        // None of the columns asked for: all of them named, for the error to list.
        let rows = read_all(&dir, None, &["text"]).unwrap();
        let names: Vec<&String> = rows[6].as_object().unwrap().keys().collect();
        assert_eq!(names, ["messages", "id", "n"]);
        // A split other than the dataset's (state.json says `train`) is refused.
        let e = read_all(&dir, Some("test"), &["n"])
            .unwrap_err()
            .to_string();
        assert!(e.contains("the split `train`"), "{e}");
        assert_eq!(read_all(&dir, Some("train"), &["n"]).unwrap().len(), 7);
        // A DatasetDict: the split named, or the only one; several need --split.
        let dict = scratch("dict");
        std::fs::create_dir_all(dict.join("train")).unwrap();
        saved(&dict.join("train"));
        std::fs::write(dict.join("dataset_dict.json"), r#"{"splits": ["train"]}"#).unwrap();
        assert_eq!(read_all(&dict, None, &["n"]).unwrap().len(), 7);
        std::fs::create_dir_all(dict.join("test")).unwrap();
        saved(&dict.join("test"));
        std::fs::write(
            dict.join("dataset_dict.json"),
            r#"{"splits": ["train", "test"]}"#,
        )
        .unwrap();
        let e = read_all(&dict, None, &["n"]).unwrap_err().to_string();
        assert!(e.contains("train, test") && e.contains("--split"), "{e}");
        assert_eq!(read_all(&dict, Some("test"), &["n"]).unwrap().len(), 7);
        let e = read_all(&dict, Some("valid"), &["n"])
            .unwrap_err()
            .to_string();
        assert!(e.contains("no split `valid`"), "{e}");
        std::fs::remove_dir_all(&dir).ok();
        std::fs::remove_dir_all(&dict).ok();
    }

    /// `prepare_examples` of a saved prompt/completion dataset (string and large-string
    /// columns, two files) writes the same example files as of the same rows in JSON
    /// Lines: the Arrow directory is told from a directory of Parquet shards.
    #[test]
    fn a_saved_dataset_prepares_as_its_json_lines() {
        use crate::data::examples::{prepare_examples, ExampleOptions, Truncation};
        let dir = scratch("prepare");
        let saved_dir = dir.join("saved");
        std::fs::create_dir_all(&saved_dir).unwrap();
        let rows: Vec<(String, String)> = (0..9)
            .map(|r| (format!("{r}+{r}="), format!("{}", 2 * r)))
            .collect();
        let mut names = vec![];
        let mut jsonl = String::new();
        for (f, part) in rows.chunks(5).enumerate() {
            let prompt = StringArray::from_iter_values(part.iter().map(|r| r.0.as_str()));
            let completion =
                arrow_array::LargeStringArray::from_iter_values(part.iter().map(|r| r.1.as_str()));
            let batch = RecordBatch::try_from_iter([
                ("prompt", Arc::new(prompt) as ArrayRef),
                ("completion", Arc::new(completion) as ArrayRef),
            ])
            .unwrap();
            let name = format!("data-{f:05}-of-00002.arrow");
            let out = File::create(saved_dir.join(&name)).unwrap();
            let mut w = StreamWriter::try_new(out, &batch.schema()).unwrap();
            w.write(&batch).unwrap();
            w.finish().unwrap();
            names.push(serde_json::json!({"filename": name}));
            for (p, c) in part {
                jsonl += &format!("{}\n", serde_json::json!({"prompt": p, "completion": c}));
            }
        }
        let state = serde_json::json!({"_data_files": names});
        std::fs::write(saved_dir.join("state.json"), state.to_string()).unwrap();
        std::fs::write(dir.join("rows.jsonl"), jsonl).unwrap();
        let o = ExampleOptions {
            columns: Default::default(),
            chat: None,
            max_length: None,
            truncation: Truncation::KeepStart,
            train_on_inputs: false,
            split: None,
        };
        let tok = crate::data::Tokenizer::Bytes;
        for (input, output) in [("saved", "a.bin"), ("rows.jsonl", "b.bin")] {
            let set = prepare_examples(&dir.join(input), &dir.join(output), &tok, &o, &mut |_| {})
                .unwrap();
            assert_eq!(set.examples, 9);
        }
        for ext in ["bin", "bin.mask", "bin.examples"] {
            let a = std::fs::read(dir.join(format!("a.{ext}"))).unwrap();
            let b = std::fs::read(dir.join(format!("b.{ext}"))).unwrap();
            assert!(!a.is_empty() && a == b, "{ext}");
        }
        std::fs::remove_dir_all(&dir).ok();
    }

    /// The file format (ARROW1) reads as the stream format does; binary where text
    /// belongs, a file that is not Arrow and a state.json naming a missing file are
    /// errors naming the problem.
    #[test]
    fn file_format_and_bad_input() {
        let dir = scratch("bad");
        let b = conversations(&[("a", "b"), ("c", "d")], 0);
        let path = dir.join("one.arrow");
        let mut w = FileWriter::try_new(File::create(&path).unwrap(), &b.schema()).unwrap();
        w.write(&b).unwrap();
        w.finish().unwrap();
        let rows = read_all(&path, None, &["messages"]).unwrap();
        assert_eq!(rows[1]["messages"][1]["content"], "d");

        let text = Arc::new(StringArray::from(vec!["x"])) as ArrayRef;
        let bytes = Arc::new(BinaryArray::from(vec![&b"\xff"[..]])) as ArrayRef;
        let bin = RecordBatch::try_from_iter([("prompt", text), ("completion", bytes)]).unwrap();
        let path = dir.join("binary.arrow");
        let mut w = StreamWriter::try_new(File::create(&path).unwrap(), &bin.schema()).unwrap();
        w.write(&bin).unwrap();
        w.finish().unwrap();
        let e = read_all(&path, None, &["prompt", "completion"])
            .unwrap_err()
            .to_string();
        assert!(e.contains("`completion`") && e.contains("binary"), "{e}");

        let path = dir.join("text.arrow");
        std::fs::write(&path, "not arrow at all").unwrap();
        let e = read_all(&path, None, &["text"]).unwrap_err().to_string();
        assert!(e.contains("not an Arrow IPC file"), "{e}");

        let missing = dir.join("partial");
        std::fs::create_dir_all(&missing).unwrap();
        std::fs::write(
            missing.join("state.json"),
            r#"{"_data_files": [{"filename": "data-00000-of-00001.arrow"}]}"#,
        )
        .unwrap();
        let e = read_all(&missing, None, &["text"]).unwrap_err().to_string();
        assert!(e.contains("copied in part"), "{e}");
        std::fs::remove_dir_all(&dir).ok();
    }
}
