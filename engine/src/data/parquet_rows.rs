//! Datasets as Parquet (the Hugging Face hub's `data/train-0000N-of-0000M.parquet`
//! shards): one file, a glob of them (`data/train-*.parquet`), or a directory whose
//! `.parquet` files (searched recursively) are read in name order. Rows are read row group by row group through the `parquet`
//! crate's record API, holding only the columns a format needs, so memory holds one row
//! group's pages of those columns at a time, whatever the file's size. Each row becomes
//! the JSON object [`records`](super::records) reads from JSON Lines: strings as
//! strings, lists as arrays, structs and maps as objects; a binary column where text
//! belongs is an error naming it.

use std::fs::File;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use parquet::file::reader::{FileReader, SerializedFileReader};
use parquet::record::Field;
use parquet::schema::types::Type;
use serde_json::{Map, Value};

use super::records::RowPlace;
use super::{DataError, Result};

/// Whether `path` is read as Parquet: a `.parquet` file, or a directory.
pub fn is_parquet(path: &Path) -> bool {
    path.is_dir()
        || path
            .extension()
            .is_some_and(|e| e.eq_ignore_ascii_case("parquet"))
}

/// The split a hub shard's name gives (`train` of `train-00000-of-00002.parquet`).
fn split_of(file: &Path) -> Option<&str> {
    let stem = file.file_stem()?.to_str()?;
    let mut parts = stem.rsplitn(4, '-');
    let (total, of, index, split) = (parts.next()?, parts.next()?, parts.next()?, parts.next()?);
    let digits = |s: &str| !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit());
    (of == "of" && digits(total) && digits(index)).then_some(split)
}

/// The files of `path`: itself, or a directory's `.parquet` files in name order — of
/// `split` only where given (hub shards are named `<split>-NNNNN-of-NNNNN.parquet`). A
/// directory holding shards of several splits needs `split`: training on a test split
/// by accident is refused.
pub fn shards(path: &Path, split: Option<&str>) -> Result<Vec<PathBuf>> {
    if let Some(files) = glob_matches(path)? {
        return pick_split(path, files, split);
    }
    if !path.is_dir() {
        return Ok(vec![path.to_path_buf()]);
    }
    fn walk(dir: &Path, out: &mut Vec<PathBuf>) -> Result<()> {
        let entries = std::fs::read_dir(dir).map_err(|e| DataError::io(dir, "list", e))?;
        for entry in entries {
            let p = entry.map_err(|e| DataError::io(dir, "list", e))?.path();
            if p.is_dir() {
                walk(&p, out)?;
            } else if p
                .extension()
                .is_some_and(|e| e.eq_ignore_ascii_case("parquet"))
            {
                out.push(p);
            }
        }
        Ok(())
    }
    let mut out = vec![];
    walk(path, &mut out)?;
    out.sort();
    if out.is_empty() {
        return Err(DataError::format(
            path,
            "is a directory without .parquet files: give a text file, a dataset file (.jsonl, \
             .json, .parquet, .csv, .tsv) or a directory of Parquet shards",
        ));
    }
    pick_split(path, out, split)
}

/// Whether `path` is a glob pattern (`*` or `?` in it, and no such file).
pub fn is_glob(path: &Path) -> bool {
    let s = path.to_string_lossy();
    s.contains(['*', '?']) && !path.exists()
}

/// The files a glob `path` matches, in name order (`None`: `path` is not a glob). A
/// pattern that matches nothing is an error naming it.
pub fn glob_matches(path: &Path) -> Result<Option<Vec<PathBuf>>> {
    if !is_glob(path) {
        return Ok(None);
    }
    if !is_parquet(path) {
        return Err(DataError::format(
            path,
            "a glob reads Parquet shards only (a pattern ending in .parquet); give another \
             dataset as its file or directory",
        ));
    }
    let pattern = path.to_string_lossy();
    let bad = |e: String| DataError::format(path, format!("not a glob pattern Kiln can read: {e}"));
    let mut files = vec![];
    for entry in glob::glob(&pattern).map_err(|e| bad(e.to_string()))? {
        let file = entry.map_err(|e| bad(e.to_string()))?;
        if file.is_file() {
            files.push(file);
        }
    }
    files.sort();
    if files.is_empty() {
        return Err(DataError::format(
            path,
            "no file matches this pattern: check the directory and the shard names (a hub \
             dataset's are data/<split>-NNNNN-of-NNNNN.parquet)",
        ));
    }
    Ok(Some(files))
}

/// The shards of `split` among `out` (named `<split>-NNNNN-of-NNNNN.parquet`); all of
/// them where no split is given, unless they are of several splits.
fn pick_split(path: &Path, mut out: Vec<PathBuf>, split: Option<&str>) -> Result<Vec<PathBuf>> {
    let mut splits: Vec<String> = out
        .iter()
        .filter_map(|f| split_of(f).map(str::to_string))
        .collect();
    splits.sort();
    splits.dedup();
    match split {
        Some(want) => {
            out.retain(|f| split_of(f) == Some(want));
            if out.is_empty() {
                return Err(DataError::format(
                    path,
                    format!(
                        "no shard of the split `{want}` (named {want}-NNNNN-of-NNNNN.parquet); \
                         its splits: {}",
                        if splits.is_empty() {
                            "none named so".to_string()
                        } else {
                            splits.join(", ")
                        }
                    ),
                ));
            }
        }
        None if splits.len() > 1 => {
            return Err(DataError::format(
                path,
                format!(
                    "holds shards of several splits ({}): say which to read with --split",
                    splits.join(", ")
                ),
            ))
        }
        None => {}
    }
    Ok(out)
}

/// Calls `each` with every row of the Parquet dataset `path` (of `split`, see
/// [`shards`]), holding the columns of
/// `wanted` that the files have (all columns when none of them is there, so that the
/// error about the row names what it has). Stops at the first error.
pub fn read_parquet_rows(
    path: &Path,
    split: Option<&str>,
    wanted: &[&str],
    mut each: impl FnMut(&RowPlace<'_>, Map<String, Value>) -> Result<()>,
) -> Result<()> {
    for shard in shards(path, split)? {
        let file = File::open(&shard).map_err(|e| DataError::io(&shard, "open", e))?;
        let reader = SerializedFileReader::new(file).map_err(|e| {
            DataError::format(
                &shard,
                format!("not a Parquet file Kiln can read ({e}); give a .parquet file of rows"),
            )
        })?;
        let schema = reader.metadata().file_metadata().schema();
        let fields: Vec<Arc<Type>> = schema
            .get_fields()
            .iter()
            .filter(|f| wanted.contains(&f.name()))
            .cloned()
            .collect();
        let projection = match fields.is_empty() {
            true => None,
            false => Some(
                Type::group_type_builder(schema.name())
                    .with_fields(fields)
                    .build()
                    .map_err(|e| DataError::format(&shard, format!("its schema: {e}")))?,
            ),
        };
        let rows = reader
            .get_row_iter(projection)
            .map_err(|e| DataError::format(&shard, format!("reading its rows: {e}")))?;
        for (n, row) in rows.enumerate() {
            let place = RowPlace {
                file: &shard,
                line: None,
                element: None,
                row: Some(n as u64 + 1),
            };
            let row = row.map_err(|e| place.error(format!("reading the row: {e}")))?;
            let mut object = Map::new();
            for (name, field) in row.get_column_iter() {
                object.insert(name.clone(), to_json(field, name, &place)?);
            }
            each(&place, object)?;
        }
    }
    Ok(())
}

/// A Parquet value as JSON; `column` names it in errors.
fn to_json(f: &Field, column: &str, place: &RowPlace<'_>) -> Result<Value> {
    let number = |x: f64| serde_json::Number::from_f64(x).map_or(Value::Null, Value::Number);
    Ok(match f {
        Field::Null => Value::Null,
        Field::Bool(b) => Value::Bool(*b),
        Field::Byte(n) => (*n).into(),
        Field::Short(n) => (*n).into(),
        Field::Int(n) => (*n).into(),
        Field::Long(n) => (*n).into(),
        Field::UByte(n) => (*n).into(),
        Field::UShort(n) => (*n).into(),
        Field::UInt(n) => (*n).into(),
        Field::ULong(n) => (*n).into(),
        Field::Float16(x) => number(f64::from(*x)),
        Field::Float(x) => number(f64::from(*x)),
        Field::Double(x) => number(*x),
        Field::Str(s) => Value::String(s.clone()),
        Field::Bytes(_) => {
            return Err(place.error(format!(
                "column `{column}` holds binary data (a BYTE_ARRAY without the UTF8/String \
                 annotation), not text: write it as a string column"
            )))
        }
        Field::Group(row) => {
            let mut object = Map::new();
            for (name, field) in row.get_column_iter() {
                let inner = to_json(field, &format!("{column}.{name}"), place)?;
                object.insert(name.clone(), inner);
            }
            Value::Object(object)
        }
        Field::ListInternal(list) => Value::Array(
            list.elements()
                .iter()
                .map(|e| to_json(e, column, place))
                .collect::<Result<_>>()?,
        ),
        Field::MapInternal(map) => {
            let mut object = Map::new();
            for (k, v) in map.entries() {
                let key = match to_json(k, column, place)? {
                    Value::String(s) => s,
                    other => other.to_string(),
                };
                object.insert(key, to_json(v, column, place)?);
            }
            Value::Object(object)
        }
        // Decimals, dates and times: as Parquet prints them.
        other => Value::String(other.to_string()),
    })
}
