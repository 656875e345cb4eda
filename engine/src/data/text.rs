//! A text (or any) file read as bytes: each byte is one token, vocabulary 256.

use std::path::{Path, PathBuf};

use memmap2::Mmap;

use super::{check_range, not_a_regular_file, DataError, Result, TokenSource};

/// A file whose bytes are the tokens (ids 0..=255), memory-mapped.
pub struct ByteTextSource {
    path: PathBuf,
    map: MappedFile,
}

impl ByteTextSource {
    pub fn open(path: &Path) -> Result<ByteTextSource> {
        let map = map_file(path)?;
        if map.is_empty() {
            return Err(DataError::format(
                path,
                "the file is empty: a byte-level text source needs at least one row of text",
            ));
        }
        Ok(ByteTextSource {
            path: path.to_path_buf(),
            map,
        })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }
}

/// A whole file mapped read-only, kept open so that a read can see it shrink first:
/// reading a page past the end of a file another program truncated would fault the
/// process (SIGBUS: no message, nothing saved), so [`MappedFile::range`] checks the
/// file's length before it touches the map. A file replaced by a rename (`kiln prepare`
/// writes that way) or deleted keeps its mapped contents and reads on unharmed.
pub(crate) struct MappedFile {
    map: Mmap,
    file: std::fs::File,
    path: PathBuf,
}

impl std::ops::Deref for MappedFile {
    type Target = [u8];
    /// The whole map, for the scans made as the file is opened.
    fn deref(&self) -> &[u8] {
        &self.map
    }
}

impl MappedFile {
    /// Bytes `start .. start + len` (inside the map), once the file is seen to still
    /// hold them. Between the look and the read another program could still cut the
    /// file: a window of microseconds per read, instead of the whole run.
    pub(crate) fn range(&self, start: usize, len: usize) -> Result<&[u8]> {
        let now = self
            .file
            .metadata()
            .map_err(|e| DataError::io(&self.path, "stat", e))?
            .len();
        if now < (start + len) as u64 {
            return Err(DataError::format(
                &self.path,
                format!(
                    "the file shrank to {now} bytes while training read it ({} when it was \
                     opened): another program truncated or rewrote it in place. Restore it (or \
                     write new data under another name) and resume",
                    self.map.len()
                ),
            ));
        }
        Ok(&self.map[start..start + len])
    }
}

/// Maps a whole file read-only. An empty file gives an empty map (not an error here:
/// callers say what they need).
pub(crate) fn map_file(path: &Path) -> Result<MappedFile> {
    let file = std::fs::File::open(path).map_err(|e| DataError::io(path, "open", e))?;
    let meta = file
        .metadata()
        .map_err(|e| DataError::io(path, "stat", e))?;
    if let Some(e) = not_a_regular_file(
        path,
        &meta,
        "training data must be a file: a .bin token file made by `kiln prepare`, or a text \
         file (read as bytes)",
    ) {
        return Err(e);
    }
    let len = meta.len();
    if len == 0 {
        // Mapping zero bytes fails on some platforms; an empty anonymous map stands in.
        let map = memmap2::MmapOptions::new()
            .len(0)
            .map_anon()
            .and_then(|m| m.make_read_only())
            .map_err(|e| DataError::io(path, "map", e))?;
        return Ok(MappedFile {
            map,
            file,
            path: path.to_path_buf(),
        });
    }
    // SAFETY: the map is read-only and private to this process. Data files are not
    // expected to change while training reads them; a file that another process
    // truncates anyway is noticed by `MappedFile::range` before a read would fault.
    let map = unsafe { Mmap::map(&file) }.map_err(|e| DataError::io(path, "memory-map", e))?;
    Ok(MappedFile {
        map,
        file,
        path: path.to_path_buf(),
    })
}

impl TokenSource for ByteTextSource {
    fn len(&self) -> u64 {
        self.map.len() as u64
    }

    fn read(&self, start: u64, out: &mut [u32]) -> Result<()> {
        check_range(
            &self.path.display().to_string(),
            self.len(),
            start,
            out.len(),
        )?;
        let bytes = self.map.range(start as usize, out.len())?;
        for (o, &b) in out.iter_mut().zip(bytes) {
            *o = b as u32;
        }
        Ok(())
    }

    fn vocab_hint(&self) -> Option<usize> {
        Some(256)
    }

    fn find_id_at_least(&self, limit: u32) -> Result<Option<(u64, u32)>> {
        // Every byte is below 256: nothing to read for any vocabulary that holds them.
        if limit >= 256 {
            return Ok(None);
        }
        Ok(self
            .map
            .iter()
            .position(|&b| b as u32 >= limit)
            .map(|k| (k as u64, self.map[k] as u32)))
    }

    fn name(&self) -> String {
        self.path.display().to_string()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::data::test_util::TempDir;

    #[test]
    fn bytes_are_tokens() {
        let dir = TempDir::new();
        let p = dir.path("a.txt");
        std::fs::write(&p, "hé\n").unwrap();
        let s = ByteTextSource::open(&p).unwrap();
        assert_eq!(s.len(), 4);
        assert_eq!(s.vocab_hint(), Some(256));
        let mut out = [0u32; 4];
        s.read(0, &mut out).unwrap();
        assert_eq!(out, [b'h' as u32, 0xC3, 0xA9, b'\n' as u32]);
        assert!(s.read(1, &mut out).is_err());
        assert_eq!(s.find_id_at_least(256).unwrap(), None);
        assert_eq!(s.find_id_at_least(0xC0).unwrap(), Some((1, 0xC3)));
    }

    #[test]
    fn missing_and_empty_files_are_named() {
        let dir = TempDir::new();
        let p = dir.path("nope.txt");
        let e = ByteTextSource::open(&p).err().unwrap().to_string();
        assert!(e.contains("nope.txt") && e.contains("no such file"), "{e}");
        std::fs::write(&p, "").unwrap();
        let e = ByteTextSource::open(&p).err().unwrap().to_string();
        assert!(e.contains("nope.txt") && e.contains("empty"), "{e}");
    }
}
