//! At start, before any turn is served: the store checked against the ledger, which haltd
//! has just opened and verified.
//!
//! - The store must have been written under this node's key (its `node_check`).
//! - Its point must be a record of the ledger's current segment, with the same hash (the
//!   store links to each new segment's first record when the ledger rotates, and to every
//!   start's record).
//! - Mode changes that the ledger holds after the point (a crash between a record's fsync and
//!   the store's commit) are applied from the ledger, whose records are authenticated: the
//!   store catches up, it is never reset. A new store (none before, or a new state
//!   directory) is rebuilt from the ledger when the current segment is the whole chain (it
//!   starts at seq 0): every mode change is there. If the segment continues a rotated one and
//!   holds a mode change, earlier changes are missing: a mismatch.
//!
//! - The records after the point that state dispatched calls (a failed turn's
//!   `reconciliation: required` calls, an operator's `reconcile`) are handed to the start
//!   ([`Restored::dispatched_records`]): a crash between such a record and the store's write
//!   loses neither (`circuit::dispatched` replays them, idempotently). So are the records of
//!   operators' incident labels ([`Restored::label_records`]; `labels.rs` replays them).
//!
//! Anything else is a mismatch: the start stops with [`MISMATCH_EXIT_CODE`] unless
//! `--state-mismatch degrade-node`.

use std::{collections::BTreeMap, io::BufRead, path::Path};

use serde_json::Value;

use super::{ScopeRow, Snapshot, StateError};

/// haltd's exit status when the state store does not match the ledger (in the unit's
/// `RestartPreventExitStatus`: restarting would not help).
pub const MISMATCH_EXIT_CODE: u8 = 4;

/// `--state-mismatch`: what a start does with a state store that does not match the ledger.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum OnMismatch {
    /// Stop the start, with exit status 4 and the reason.
    Refuse,
    /// Start with the whole node degraded until the operator ends it, recorded with the
    /// reason; the stored scopes are kept as well.
    DegradeNode,
}

/// What the start found.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Verdict {
    /// No store before, and nothing in the ledger that one would have held.
    New,
    /// No store before, and a ledger whose current segment is the whole chain (it starts at
    /// seq 0, never rotated): the scopes were rebuilt from its `replayed` mode changes.
    Rebuilt { replayed: usize },
    /// The store matched; `replayed` mode changes were applied from the ledger.
    Matched { replayed: usize },
    /// The store does not match: why.
    Mismatch(String),
}

/// The state to run with, and how it was found.
#[derive(Clone, Debug)]
pub struct Restored {
    pub verdict: Verdict,
    /// The degraded scopes (empty on a mismatch: the caller decides).
    pub scopes: Vec<ScopeRow>,
    /// The records after the point that state dispatched calls or their reconciliation, in
    /// order (empty on a mismatch).
    pub dispatched_records: Vec<Value>,
    /// The records after the point that state an incident label, in order (empty on a
    /// mismatch).
    pub label_records: Vec<Value>,
    /// The records after the point that state an applied runtime policy switch (`haltctl
    /// detector mode`, `haltctl profile set`), in order (empty on a mismatch).
    pub policy_records: Vec<Value>,
}

/// Whether `rec` states a dispatched call (a turn record with a call that needs
/// reconciliation) or its outcome (an `admin` record of a `reconcile`).
fn states_dispatched(rec: &Value) -> bool {
    let needs = |c: &Value| c.get("reconciliation").is_some_and(|r| r == "required");
    rec.get("tool_calls")
        .and_then(Value::as_array)
        .is_some_and(|l| l.iter().any(needs))
        || rec
            .pointer("/admin/action")
            .is_some_and(|a| a == "reconcile")
}

/// Whether `rec` is the `admin` record of an incident label that was given (status 200).
pub fn states_label(rec: &Value) -> bool {
    rec.pointer("/admin/action").is_some_and(|a| a == "label")
        && rec.pointer("/admin/status").is_some_and(|s| s == 200)
}

/// Whether `rec` is the `admin` record of an applied policy switch.
pub fn states_policy(rec: &Value) -> bool {
    rec.pointer("/admin/action")
        .is_some_and(|a| a == "detector_mode" || a == "profile")
        && rec.pointer("/admin/status").is_some_and(|s| s == 200)
}

fn mismatch(why: String) -> Result<Restored, StateError> {
    Ok(Restored {
        verdict: Verdict::Mismatch(why),
        scopes: Vec::new(),
        dispatched_records: Vec::new(),
        label_records: Vec::new(),
        policy_records: Vec::new(),
    })
}

/// A store that a running haltd handed over with (`--take-over`): it committed everything up
/// to its hand-over record before it answered, and keeps writing it, so there is nothing to
/// replay; only the node key is checked.
pub fn taken_over(held: &Snapshot, node_check: &str) -> Result<Restored, StateError> {
    if let Some(c) = held.node_check.as_deref().filter(|c| *c != node_check) {
        return mismatch(format!(
            "it was written under another node.key (fingerprint {c}, this node's is {node_check}): its key fingerprints name other identities here"
        ));
    }
    Ok(Restored {
        verdict: Verdict::Matched { replayed: 0 },
        scopes: held.scopes.clone(),
        dispatched_records: Vec::new(),
        label_records: Vec::new(),
        policy_records: Vec::new(),
    })
}

/// Checks `held` against the ledger segment at `ledger` and this node's `node_check`.
pub fn check(held: &Snapshot, ledger: &Path, node_check: &str) -> Result<Restored, StateError> {
    if let Some(c) = held.node_check.as_deref().filter(|c| *c != node_check) {
        return mismatch(format!(
            "it was written under another node.key (fingerprint {c}, this node's is {node_check}): its key fingerprints name other identities here"
        ));
    }
    let mut scopes: BTreeMap<String, ScopeRow> = held
        .scopes
        .iter()
        .map(|r| (r.scope.clone(), r.clone()))
        .collect();
    // Before the point: whether any mode change is there (for a new store); after it: the
    // changes to apply. Streamed: a segment may hold millions of records.
    // Without a point, every mode change of the segment applies (a rebuild, accepted only
    // when the segment is the whole chain); with one, those after it. Streamed: a segment
    // may hold millions of records.
    let (mut found, mut first_change, mut replayed) = (held.ledger.is_none(), None, 0);
    let mut whole_chain = None;
    let (mut dispatched_records, mut label_records) = (Vec::new(), Vec::new());
    let mut policy_records = Vec::new();
    for_each_record(ledger, |seq, rec| {
        whole_chain.get_or_insert(seq == 0 && rec.get("segment").is_none_or(Value::is_null));
        let change = rec.get("mode_change");
        if found && states_dispatched(rec) {
            dispatched_records.push(rec.clone());
        }
        if found && states_label(rec) {
            label_records.push(rec.clone());
        }
        if found && states_policy(rec) {
            policy_records.push(rec.clone());
        }
        if found {
            if let Some(ch) = change {
                first_change.get_or_insert(seq);
                replay(&mut scopes, ch);
                replayed += 1;
            }
        } else if let Some(p) = &held.ledger {
            found = seq == p.seq && rec.get("hash").and_then(Value::as_str) == Some(&p.hash);
        }
    })?;
    let Some(point) = &held.ledger else {
        if !held.scopes.is_empty() {
            return mismatch("it holds degraded scopes but no ledger record".to_owned());
        }
        let Some(seq) = first_change else {
            return Ok(Restored {
                verdict: Verdict::New,
                scopes: Vec::new(),
                dispatched_records,
                label_records,
                policy_records,
            });
        };
        if whole_chain != Some(true) {
            return mismatch(format!(
                "it is new, but the ledger {} records runtime-mode changes (seq {seq}) in a segment that continues a rotated one, whose earlier changes are not here: the store was removed, or this is the first start of a haltd that keeps one",
                ledger.display()
            ));
        }
        return Ok(Restored {
            verdict: Verdict::Rebuilt { replayed },
            scopes: scopes.into_values().collect(),
            dispatched_records,
            label_records,
            policy_records,
        });
    };
    if !found {
        return mismatch(format!(
            "the ledger record it reflects (seq {}, hash {}…) is not in {} (another ledger, a restored backup, or a segment rotated away without the store)",
            point.seq,
            point.hash.get(..16).unwrap_or(&point.hash),
            ledger.display()
        ));
    }
    Ok(Restored {
        verdict: Verdict::Matched { replayed },
        scopes: scopes.into_values().collect(),
        dispatched_records,
        label_records,
        policy_records,
    })
}

/// Applies one recorded mode change to the scopes.
fn replay(scopes: &mut BTreeMap<String, ScopeRow>, ch: &Value) {
    let text = |k: &str| ch.get(k).and_then(Value::as_str).unwrap_or_default();
    let scope = text("scope").to_owned();
    if text("to") == "degraded" {
        let row = ScopeRow {
            scope: scope.clone(),
            since_unix_ms: ch.get("since_unix_ms").and_then(Value::as_u64).unwrap_or(0),
            until_unix_ms: ch.get("until_unix_ms").and_then(Value::as_u64),
            cause: text("cause").to_owned(),
            stream_id: text("stream_id").to_owned(),
        };
        scopes.insert(scope, row);
    } else {
        scopes.remove(&scope);
    }
}

/// Calls `f` with each record of the segment and its seq, in order (the ledger was verified
/// when it was opened; a line that is not a record is skipped).
fn for_each_record(ledger: &Path, mut f: impl FnMut(u64, &Value)) -> Result<(), StateError> {
    let io = |source| StateError::Io {
        path: ledger.to_owned(),
        op: "reading the ledger to check the store",
        source,
    };
    let file = std::fs::File::open(ledger).map_err(io)?;
    for line in std::io::BufReader::new(file).lines() {
        let line = line.map_err(io)?;
        let Ok(rec) = serde_json::from_str::<Value>(&line) else {
            continue;
        };
        if let Some(seq) = rec.get("seq").and_then(Value::as_u64) {
            f(seq, &rec);
        }
    }
    Ok(())
}
