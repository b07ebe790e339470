//! The `--config` file as read once at start: its text, its values, and where each key is, so
//! that an error about a key names its line (`haltd.toml:12: budget: ...`), as `haltd
//! check-config` and a refused start print it.

use std::path::{Path, PathBuf};

use toml_edit::TableLike;

/// A config file, parsed.
#[derive(Debug)]
pub struct ConfigFile {
    pub path: PathBuf,
    /// Its values (what the loaders read).
    pub table: toml::Table,
    /// The same text with the position of every key (what error messages point at).
    spans: toml_edit::Document<String>,
}

/// Why a config file could not be read or parsed, with where.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{}{}: {reason}", path.display(), line.map(|l| format!(":{l}")).unwrap_or_default())]
pub struct FileError {
    pub path: PathBuf,
    pub line: Option<usize>,
    pub reason: String,
}

impl ConfigFile {
    /// Reads and parses `path` (TOML).
    pub fn read(path: &Path) -> Result<Self, FileError> {
        let text = std::fs::read_to_string(path).map_err(|e| FileError {
            path: path.to_owned(),
            line: None,
            reason: e.to_string(),
        })?;
        Self::parse(path, text)
    }

    /// Parses `text`, the contents of `path`.
    pub fn parse(path: &Path, text: String) -> Result<Self, FileError> {
        let spans = toml_edit::Document::parse(text.clone()).map_err(|e| FileError {
            path: path.to_owned(),
            line: e.span().map(|s| line_of(&text, s.start)),
            reason: format!("not valid TOML: {}", e.message().trim_end()),
        })?;
        let table = spans.raw().parse::<toml::Table>().map_err(|e| FileError {
            path: path.to_owned(),
            line: e.span().map(|s| line_of(spans.raw(), s.start)),
            reason: format!("not valid TOML: {}", e.message()),
        })?;
        Ok(ConfigFile {
            path: path.to_owned(),
            table,
            spans,
        })
    }

    /// The line (from 1) of the deepest key of the dotted `key` path the file has: the line
    /// of `window` for `detectors.surprise.window`, of `[detectors.surprise]` when the file
    /// leaves `window` out. `None` when not even the first key is in the file.
    pub fn line_of(&self, key: &str) -> Option<usize> {
        let mut table: &dyn TableLike = self.spans.as_table();
        let mut found = None;
        for part in key.split('.') {
            let Some((k, item)) = table.get_key_value(part) else {
                break;
            };
            found = k.span().or_else(|| item.span()).or(found);
            match item.as_table_like() {
                Some(t) => table = t,
                None => break,
            }
        }
        found.map(|s| line_of(self.spans.raw(), s.start))
    }
}

/// The line (from 1) of byte `offset` of `text`.
fn line_of(text: &str, offset: usize) -> usize {
    text.get(..offset)
        .unwrap_or(text)
        .bytes()
        .filter(|b| *b == b'\n')
        .count()
        + 1
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_have_lines() {
        let text = "listen = \"127.0.0.1:1\"\n\n[detectors.surprise]\nmode = \"observe\"\nwindow = 0\n\n[log]\nlevel = \"info\"\n";
        let f = ConfigFile::parse(Path::new("x.toml"), text.to_owned()).expect("parses");
        assert_eq!(f.line_of("listen"), Some(1));
        assert_eq!(f.line_of("detectors.surprise.window"), Some(5));
        assert_eq!(f.line_of("detectors.surprise.debounce"), Some(3));
        assert_eq!(f.line_of("log.level"), Some(8));
        assert_eq!(f.line_of("safety.mode"), None);
        let e = ConfigFile::parse(Path::new("x.toml"), "a = 1\nb = \n".to_owned())
            .expect_err("bad TOML");
        assert!(e.to_string().starts_with("x.toml:2: not valid TOML"), "{e}");
        assert!(e.reason.contains("not valid TOML"), "{e}");
    }
}
