//! The hand-over (issue 38, docs/operations.md "Upgrading"): a successor started with
//! `--take-over` serves beside the running haltd, which then stops accepting, drains and
//! exits. No stream is lost, no connection is refused or reset, a trip in either process
//! degrades its key in the other, the two ledger segments verify as a pair, and a successor
//! that fails its start leaves the old one serving.

mod gap;
mod load;
mod notify;
mod trip;

use std::{path::Path, process::Command, time::Duration};

use anyhow::{ensure, Context, Result};
use haltd_tests::{daemon::haltctl_bin, read_ledger, Haltd};
use serde_json::Value;

/// `haltctl ledger verify` over the old segment then the new one, with the shared state
/// directory; returns its output.
fn verify_pair(old: &Haltd, new: &Haltd) -> Result<String> {
    let out = Command::new(haltctl_bin()?)
        .args(["ledger", "verify"])
        .env("HALTD_STATE_DIR", &old.state_dir)
        .arg(&old.ledger)
        .arg(&new.ledger)
        .output()
        .context("running haltctl ledger verify")?;
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    ensure!(out.status.success(), "haltctl ledger verify failed: {text}");
    Ok(text)
}

/// The old segment's hand-over record, and the new segment's first record, which must link to
/// it.
fn linked_records(old: &Path, new: &Path) -> Result<(Value, Value)> {
    let old_records = read_ledger(old)?;
    let handover = old_records
        .iter()
        .find(|r| r.get("handover").is_some_and(|h| h.get("to_pid").is_some()))
        .cloned()
        .context("the old segment has no hand-over record")?;
    let first = read_ledger(new)?
        .into_iter()
        .next()
        .context("the new segment is empty")?;
    ensure!(
        first["prev_hash"] == handover["hash"]
            && first["seq"] == handover["seq"].as_u64().unwrap_or(0) + 1,
        "the new segment's first record {first} does not link to the hand-over record {handover}"
    );
    Ok((handover, first))
}

/// The last record of a ledger whose message starts with `prefix`.
fn last_message(ledger: &Path, prefix: &str) -> Result<String> {
    read_ledger(ledger)?
        .iter()
        .rev()
        .filter_map(|r| r["message"].as_str())
        .find(|m| m.starts_with(prefix))
        .map(str::to_owned)
        .with_context(|| format!("no record saying {prefix:?} in {}", ledger.display()))
}

/// Waits for `haltd` to exit by itself and checks it exited 0.
fn exits_cleanly(haltd: &mut Haltd, within: Duration) -> Result<()> {
    let status = haltd.wait_exit(within)?;
    ensure!(
        status.success(),
        "the old haltd exited with {status}; log tail:\n{}",
        haltd.log_tail(30)
    );
    Ok(())
}
