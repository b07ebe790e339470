//! Writing the operating point into haltd's TOML config file, section
//! `[detectors.surprise]`, with `toml_edit`, so every other key, comment and the layout stay as
//! they were.

use std::fmt;
use std::io;
use std::path::{Path, PathBuf};

use toml_edit::{Decor, DocumentMut, Item, Table, TableLike, Value};

use super::{CalibrationReport, OperatingPoint, COMMENT_MARK};

/// Writing the threshold into the config file failed.
#[derive(Debug, thiserror::Error)]
pub enum ConfigWriteError {
    #[error("{op} {path}: {source}")]
    Io {
        op: &'static str,
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("{path} is not valid TOML: {source}")]
    Parse {
        path: PathBuf,
        #[source]
        source: Box<toml_edit::TomlError>,
    },
    #[error("{path}: `{key}` is not a table")]
    NotATable { path: PathBuf, key: &'static str },
    #[error("the calibration has no operating point: nothing to write")]
    NoOperatingPoint,
}

/// Sets `detectors.surprise.threshold_bits`, `window`, `statistic` and `min_tokens` in the
/// TOML config file at `path` (created when missing) to the report's operating point, with a
/// comment line above `threshold_bits` saying when and how well it was calibrated. Every other
/// key and comment stays as it was; `mode` is not touched (the operator turns the gate on).
/// The file is replaced atomically (written beside it, then renamed).
pub fn write_threshold(path: &Path, report: &CalibrationReport) -> Result<(), ConfigWriteError> {
    let existing = match std::fs::read_to_string(path) {
        Ok(s) => s,
        Err(e) if e.kind() == io::ErrorKind::NotFound => String::new(),
        Err(source) => {
            return Err(ConfigWriteError::Io {
                op: "reading",
                path: path.to_owned(),
                source,
            })
        }
    };
    let updated = update_config_text(&existing, report, &today_utc()).map_err(|e| match e {
        UpdateError::Parse(source) => ConfigWriteError::Parse {
            path: path.to_owned(),
            source: Box::new(source),
        },
        UpdateError::NotATable(key) => ConfigWriteError::NotATable {
            path: path.to_owned(),
            key,
        },
        UpdateError::NoOperatingPoint => ConfigWriteError::NoOperatingPoint,
    })?;
    let mut tmp = path.as_os_str().to_owned();
    tmp.push(".haltctl-tmp");
    let tmp = PathBuf::from(tmp);
    let io_err = |op, p: &Path| {
        let p = p.to_owned();
        move |source| ConfigWriteError::Io {
            op,
            path: p,
            source,
        }
    };
    std::fs::write(&tmp, updated).map_err(io_err("writing", &tmp))?;
    std::fs::rename(&tmp, path).map_err(io_err("renaming into place", path))
}

/// Why [`update_config_text`] failed.
#[derive(Debug)]
pub enum UpdateError {
    Parse(toml_edit::TomlError),
    NotATable(&'static str),
    NoOperatingPoint,
}

impl fmt::Display for UpdateError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            UpdateError::Parse(e) => write!(f, "not valid TOML: {e}"),
            UpdateError::NotATable(k) => write!(f, "`{k}` is not a table"),
            UpdateError::NoOperatingPoint => f.write_str("no operating point"),
        }
    }
}

impl std::error::Error for UpdateError {}

/// [`write_threshold`] on text: returns the updated TOML; `date` goes into the comment.
pub fn update_config_text(
    existing: &str,
    report: &CalibrationReport,
    date: &str,
) -> Result<String, UpdateError> {
    let op = report
        .operating_point
        .as_ref()
        .ok_or(UpdateError::NoOperatingPoint)?;
    let mut doc: DocumentMut = existing.parse().map_err(UpdateError::Parse)?;
    let surprise_item = surprise_table(&mut doc)?;
    let inline = surprise_item.is_inline_table();
    let surprise = surprise_item
        .as_table_like_mut()
        .ok_or(UpdateError::NotATable("detectors.surprise"))?;
    set(surprise, "window", Value::from(report.window as i64));
    set(
        surprise,
        "statistic",
        Value::from(report.statistic.as_str()),
    );
    set(
        surprise,
        "min_tokens",
        Value::from(report.min_tokens as i64),
    );
    set(surprise, "threshold_bits", Value::from(op.threshold_bits));
    if !inline {
        if let Some(mut key) = surprise.key_mut("threshold_bits") {
            put_comment(key.leaf_decor_mut(), &calibration_comment(report, op, date));
        }
    }
    Ok(doc.to_string())
}

/// The `[detectors.surprise]` item of `doc`, created (with an implicit `[detectors]`) when
/// missing.
fn surprise_table(doc: &mut DocumentMut) -> Result<&mut Item, UpdateError> {
    let root = doc.as_table_mut();
    if !root.contains_key("detectors") {
        let mut t = Table::new();
        t.set_implicit(true);
        root.insert("detectors", Item::Table(t));
    }
    let detectors = root
        .get_mut("detectors")
        .and_then(Item::as_table_like_mut)
        .ok_or(UpdateError::NotATable("detectors"))?;
    if !detectors.contains_key("surprise") {
        detectors.insert("surprise", Item::Table(Table::new()));
    }
    detectors
        .get_mut("surprise")
        .ok_or(UpdateError::NotATable("detectors.surprise"))
}

/// Replaces a value keeping its key's comments and its own decor (a trailing comment).
fn set(t: &mut dyn TableLike, key: &str, mut v: Value) {
    if let Some((_, item)) = t.get_key_value_mut(key) {
        if let Some(old) = item.as_value() {
            *v.decor_mut() = old.decor().clone();
        }
        *item = Item::Value(v);
    } else {
        t.insert(key, Item::Value(v));
    }
}

/// The comment line above `threshold_bits`: when and how well it was calibrated.
fn calibration_comment(report: &CalibrationReport, op: &OperatingPoint, date: &str) -> String {
    let ci = report
        .auroc_ci
        .as_ref()
        .map(|ci| {
            format!(
                " ({:.0}% CI {:.3}-{:.3})",
                ci.level * 100.0,
                ci.low,
                ci.high
            )
        })
        .unwrap_or_default();
    format!(
        "{COMMENT_MARK} {date}: AUROC {:.3}{ci}; at this threshold precision {:.3}, recall \
         {:.3}, FPR {:.3}; {} streams ({} positive), {} of {} tokens, min_tokens {}\n",
        report.auroc,
        op.precision,
        op.recall,
        op.fpr,
        report.scored(),
        report.positives,
        report.statistic,
        report.window,
        report.min_tokens,
    )
}

/// Puts `comment` last in a key's prefix, keeping every other line of it (comments, blank
/// lines) and dropping an earlier calibration comment.
fn put_comment(decor: &mut Decor, comment: &str) {
    let old = decor
        .prefix()
        .and_then(|p| p.as_str())
        .unwrap_or("")
        .to_owned();
    let mut prefix: String = old
        .split_inclusive('\n')
        .filter(|l| !l.trim_start().starts_with(COMMENT_MARK))
        .collect();
    if !prefix.is_empty() && !prefix.ends_with('\n') {
        // Indentation after the last newline belongs to the key line itself.
        let cut = prefix.rfind('\n').map_or(0, |i| i + 1);
        let indent = prefix.split_off(cut);
        prefix.push_str(comment);
        prefix.push_str(&indent);
    } else {
        prefix.push_str(comment);
    }
    decor.set_prefix(prefix);
}

/// Today's date (UTC) as `YYYY-MM-DD`.
pub(super) fn today_utc() -> String {
    let secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    civil_date(secs / 86_400)
}

/// `YYYY-MM-DD` of a day count since 1970-01-01 (`clock::civil_from_days`).
pub(super) fn civil_date(days: u64) -> String {
    let (y, m, d) = crate::clock::civil_from_days(days);
    format!("{y:04}-{m:02}-{d:02}")
}
