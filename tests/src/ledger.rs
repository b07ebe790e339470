//! The ledger (JSON Lines) as the tests read it, and its chain checked by `haltctl`.

use std::{fs, path::Path, process::Command};

use anyhow::{Context, Result};
use serde_json::Value;

use crate::{checked, daemon::haltctl_bin};

/// Reads a JSON Lines ledger.
pub fn read_ledger(path: &Path) -> Result<Vec<Value>> {
    let mut text =
        fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    // A record being appended right now has no newline yet: not a record until it has.
    if let Some(end) = text.rfind('\n') {
        text.truncate(end + 1);
    } else {
        text.clear();
    }
    text.lines()
        .enumerate()
        .filter(|(_, l)| !l.trim().is_empty())
        .map(|(i, l)| {
            serde_json::from_str(l)
                .with_context(|| format!("{}:{}: not JSON", path.display(), i + 1))
        })
        .collect()
}

/// Runs `haltctl ledger verify PATH`; Ok if it exits 0.
pub fn verify_ledger(path: &Path) -> Result<String> {
    checked(
        Command::new(haltctl_bin()?)
            .args(["ledger", "verify"])
            .arg(path),
    )
}
