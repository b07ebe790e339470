//! The ledger (JSON Lines) as the tests read it, and its chain checked by `haltctl`.

use std::{
    fs,
    os::unix::fs::PermissionsExt,
    path::{Path, PathBuf},
    process::Command,
};

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

/// The state directory the tests give the haltd of a ledger: `state/` next to it (the ledger
/// key and its head, `haltd::ledger`).
pub fn state_dir_for(ledger: &Path) -> PathBuf {
    ledger
        .parent()
        .unwrap_or_else(|| Path::new("."))
        .join("state")
}

/// Runs `HALTD_STATE_DIR=<state_dir_for(PATH)> haltctl ledger verify PATH`; Ok if it exits 0.
pub fn verify_ledger(path: &Path) -> Result<String> {
    // The state directory by haltd's own variable, so that every verify also checks that
    // haltctl reads it (without it, haltctl would look in /var/lib/haltd and fail).
    checked(
        Command::new(haltctl_bin()?)
            .args(["ledger", "verify"])
            .env("HALTD_STATE_DIR", state_dir_for(path))
            .arg(path),
    )
}

/// [`verify_ledger`] for a copy made by [`copy_ledger`]: a copy has no head, so its end
/// cannot be checked (`--no-end-check`; without it, haltctl exits 4).
pub fn verify_ledger_copy(path: &Path) -> Result<String> {
    checked(
        Command::new(haltctl_bin()?)
            .args(["ledger", "verify", "--no-end-check"])
            .env("HALTD_STATE_DIR", state_dir_for(path))
            .arg(path),
    )
}

/// Copies a ledger to `to` with its key (into [`state_dir_for`] `to`), so that it verifies
/// there and a haltd can resume it. The head stays behind: a copy has none of its own.
pub fn copy_ledger(from: &Path, to: &Path) -> Result<()> {
    fs::copy(from, to).with_context(|| format!("copying {}", from.display()))?;
    let state = state_dir_for(to);
    fs::create_dir_all(&state)?;
    fs::set_permissions(&state, fs::Permissions::from_mode(0o700))?;
    let key = state.join(haltd::ledger::KEY_FILE);
    if !key.exists() {
        fs::copy(state_dir_for(from).join(haltd::ledger::KEY_FILE), &key)
            .context("copying the ledger key")?;
    }
    Ok(())
}
