//! What can go wrong with the flight recorder.

use std::{io, path::PathBuf};

/// Ledger failures. Each names the file and what was being done.
#[derive(Debug, thiserror::Error)]
pub enum LedgerError {
    #[error("ledger {}: cannot open: {source}", path.display())]
    Open {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("ledger {}: locked by another process (is another haltd running?)", path.display())]
    Locked { path: PathBuf },
    #[error("ledger {}: cannot lock: {source}", path.display())]
    Lock {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("ledger {}: read failed at line {line}: {source}", path.display())]
    Read {
        path: PathBuf,
        line: u64,
        #[source]
        source: io::Error,
    },
    #[error("ledger key: {reason}")]
    Key { reason: String },
    #[error("ledger head {}: {source}", path.display())]
    Head {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error(
        "ledger {}: {reason}; refusing to start (possible tampering: see docs/operations.md, \"The ledger refused\")",
        path.display()
    )]
    Tampered { path: PathBuf, reason: String },
    #[error(
        "ledger {}: it holds {records} records, but its head {} is missing, so records cut off \
         its end cannot be ruled out (the head file was deleted, the ledger moved, or the state \
         directory is another one); refusing to start. If you know why the head is gone, \
         re-anchor the chain on purpose, recorded with your name: `haltctl ledger reanchor \
         --operator NAME --state-dir {} {}` with haltd stopped, then start haltd again (see \
         docs/operations.md, \"The ledger refused\")",
        path.display(),
        head.display(),
        state_dir.display(),
        path.display()
    )]
    HeadMissing {
        path: PathBuf,
        head: PathBuf,
        state_dir: PathBuf,
        records: u64,
    },
    #[error("ledger {}: cannot open it as a hand-over segment: {reason}", path.display())]
    Handover { path: PathBuf, reason: String },
    #[error("ledger {}: not re-anchored: {reason}", path.display())]
    NotReanchored { path: PathBuf, reason: String },
    #[error(
        "ledger {}: chain broken at line {line}{}: {reason}; refusing to append (possible tampering: see docs/operations.md, \"The ledger refused\")",
        path.display(),
        fmt_seq(*seq)
    )]
    ChainBroken {
        path: PathBuf,
        line: u64,
        seq: Option<u64>,
        reason: String,
    },
    #[error("ledger {}: writing record seq {seq} failed: {source}", path.display())]
    Write {
        path: PathBuf,
        seq: u64,
        #[source]
        source: io::Error,
    },
    #[error("ledger {}: fsync of record seq {seq} failed: {source}", path.display())]
    Sync {
        path: PathBuf,
        seq: u64,
        #[source]
        source: io::Error,
    },
    #[error("ledger {}: flush (fsync) failed: {source}", path.display())]
    Flush {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("ledger: cannot serialise record: {source}")]
    Serialize {
        #[source]
        source: serde_json::Error,
    },
    #[error("ledger record: {field} = {value:?} is not one of {allowed:?}")]
    InvalidRecord {
        field: &'static str,
        value: String,
        allowed: &'static [&'static str],
    },
    #[error("ledger {}: an earlier write failed ({reason}); no further records are accepted", path.display())]
    WriterFailed { path: PathBuf, reason: String },
    #[error("ledger {}: queue full ({capacity} records waiting for the writer)", path.display())]
    QueueFull { path: PathBuf, capacity: usize },
    #[error("ledger {}: writer thread is gone", path.display())]
    WriterGone { path: PathBuf },
    #[error("ledger {}: cannot start the writer thread: {source}", path.display())]
    Spawn {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
}

/// ` (seq N)` when the record's `seq` is known, for messages.
pub(super) fn fmt_seq(seq: Option<u64>) -> String {
    seq.map(|s| format!(" (seq {s})")).unwrap_or_default()
}

impl LedgerError {
    /// Whether haltd refuses the ledger as tampered with (exit [`TAMPERED_EXIT_CODE`]).
    pub fn is_tampering(&self) -> bool {
        matches!(
            self,
            LedgerError::Tampered { .. }
                | LedgerError::ChainBroken { .. }
                | LedgerError::HeadMissing { .. }
        )
    }

    /// The `incident` of the line a refused start appends to the state directory's
    /// incident file.
    pub(super) fn incident_name(&self) -> &'static str {
        match self {
            LedgerError::HeadMissing { .. } => "LEDGER_HEAD_MISSING",
            _ => "LEDGER_TAMPERED",
        }
    }
}

/// haltd's exit status when it refuses to start on a ledger that does not verify against its
/// key and head (a missing head included).
pub const TAMPERED_EXIT_CODE: u8 = 3;
