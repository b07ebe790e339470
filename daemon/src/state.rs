//! The state that survives a restart, so that a fault never loosens governance: the degraded
//! scopes with their expiry, each conversation's committed TURN-ACID state, TokenCircuit's
//! per-conversation memory (its backoff clock and failed calls) and the dispatched tool calls
//! of failed turns with their reconciliation, the key store's keys (`keys.rs`), the
//! operators' incident labels (`labels.rs`) and the runtime policy switches (`policy.rs`),
//! kept in an
//! embedded SQLite database, `<--state-dir>/state.db` (mode 0600, WAL: a second haltd can open
//! it during an upgrade).
//!
//! - **Crash order.** A change is applied after the ledger record that states it is written
//!   and fsync'd ([`crate::ledger::Ledger::append_linked`]), and in the same transaction the
//!   store keeps that record's seq and hash, the point of the ledger it reflects. A crash
//!   between the two leaves the store behind the ledger, never ahead of it.
//! - **Start-up** ([`restore`]): the store must match the ledger (its point is a record of the
//!   current segment, under the same `node.key`); mode changes the ledger holds after that
//!   point are applied from the ledger. A store that does not match stops the start, unless
//!   `--state-mismatch degrade-node`. Nothing is reset silently.
//! - **Expiries** are stored as Unix milliseconds; while haltd runs its timers follow the
//!   monotonic clock (`modes.rs`), and at start what remains is `until_unix_ms` − now.
//! - **Schema.** `PRAGMA user_version` is the schema version ([`schema::VERSION`]). A new file
//!   gets the current schema; an older version is migrated forward in one transaction at
//!   open, one step per version; a newer one (written by a later haltd) is refused, never
//!   rewritten.
//!
//! One thread, `haltd-state`, owns the connection and applies changes in the order they were
//! queued, off the data plane and off the ledger's writer, the changes queued meanwhile in one
//! transaction (one fsync for a burst of turns). A failed write marks the store failed: the
//! watchdog then fails the daemon closed, as for a failed ledger write.

pub mod restore;
pub mod schema;

use std::{
    path::{Path, PathBuf},
    sync::{
        atomic::{AtomicBool, Ordering},
        mpsc::{self, Receiver, SyncSender, TrySendError},
        Arc, Mutex,
    },
    thread::JoinHandle,
};

use serde::Serialize;

use crate::ledger::Written;

/// The store's file in `--state-dir`.
pub const STATE_FILE: &str = "state.db";

/// Changes queued before the store's thread must have taken them (one per mode change and
/// per turn; a full queue means the disk stopped answering, and fails the store).
const QUEUE_CAPACITY: usize = 65_536;

/// The most queued changes one transaction takes.
const BATCH_MAX: usize = 1024;

/// Why the store could not be opened, read or written.
#[derive(Debug, thiserror::Error)]
pub enum StateError {
    #[error("state store {path}: {op}: {source}")]
    Sqlite {
        path: PathBuf,
        op: &'static str,
        #[source]
        source: rusqlite::Error,
    },
    #[error("state store {path}: {op}: {source}")]
    Io {
        path: PathBuf,
        op: &'static str,
        #[source]
        source: std::io::Error,
    },
    #[error("state store {path}: schema version {found} was written by a newer haltd (this one knows {known}); start that haltd, or move the file aside knowing its state is lost")]
    Newer {
        path: PathBuf,
        found: i64,
        known: i64,
    },
    #[error("state store {path}: {reason}")]
    Corrupt { path: PathBuf, reason: String },
    #[error("state store {path}: its writer thread is gone")]
    Gone { path: PathBuf },
    #[error("state store {path}: {capacity} changes are queued and none is written")]
    QueueFull { path: PathBuf, capacity: usize },
    #[error(
        "state store {path}: a write failed by the test fault --fault state-write-fails-after"
    )]
    Injected { path: PathBuf },
}

/// A degraded scope as the store keeps it: `node` or `key:<fingerprint>`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct ScopeRow {
    pub scope: String,
    pub since_unix_ms: u64,
    /// When its timer ends it; `None`: only the operator does.
    pub until_unix_ms: Option<u64>,
    pub cause: String,
    pub stream_id: String,
}

/// A conversation's committed state (TURN-ACID), by its key's fingerprint.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct ConversationRow {
    pub key: String,
    pub turns_committed: u64,
    pub tokens_committed: u64,
    pub tool_calls_committed: u64,
    pub last_committed_turn: Option<String>,
    pub turns_failed: u64,
}

/// TokenCircuit's memory of one conversation (`circuit::persist` reads and writes `body`).
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct CircuitRow {
    /// The key fingerprint, the conversation's id and where the id came from.
    pub key: String,
    pub id: String,
    pub source: String,
    /// Evicted, kept only for its refused keys.
    pub retained: bool,
    pub body: serde_json::Value,
}

/// A dispatched tool call of a failed turn and its reconciliation (`circuit::dispatched`
/// reads and writes `body`), by its reference.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct DispatchedRow {
    pub reference: String,
    pub body: serde_json::Value,
}

/// A key of the key store (`keys.rs` reads and writes `body`), or its counts
/// (`limits::StoredUsage`), by the key's id.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct ClientKeyRow {
    pub id: String,
    pub body: serde_json::Value,
}

/// An operator's label of an incident (`labels.rs` reads and writes `body`), by the
/// incident record's seq.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct IncidentLabelRow {
    pub incident_seq: u64,
    pub body: serde_json::Value,
}

/// Everything the store holds.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct Snapshot {
    /// The last ledger record the store reflects (`None`: a new store).
    pub ledger: Option<Point>,
    /// The fingerprint of the node key the store was written under.
    pub node_check: Option<String>,
    pub scopes: Vec<ScopeRow>,
    pub conversations: Vec<ConversationRow>,
    pub circuits: Vec<CircuitRow>,
    pub dispatched: Vec<DispatchedRow>,
    pub client_keys: Vec<ClientKeyRow>,
    pub key_usage: Vec<ClientKeyRow>,
    /// The runtime policy switches (`policy::Overrides` as JSON; `None`: none ever made).
    pub runtime_policy: Option<serde_json::Value>,
    pub incident_labels: Vec<IncidentLabelRow>,
}

/// A ledger record the store reflects.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Point {
    pub seq: u64,
    pub hash: String,
}

impl From<Written> for Point {
    fn from(w: Written) -> Self {
        Point {
            seq: w.seq,
            hash: w.hash,
        }
    }
}

/// One change of the held state.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Change {
    /// A scope is degraded: new, or its timer restarted (the row is replaced).
    Degrade(ScopeRow),
    /// A scope is back to full.
    End(String),
    /// A conversation's committed state after a turn (the row is replaced).
    Conversation(ConversationRow),
    /// TokenCircuit's memory of a conversation (the row is replaced).
    Circuit(CircuitRow),
    /// TokenCircuit forgot a conversation: `(key, id, source)`.
    CircuitGone(String, String, String),
    /// A dispatched call of a failed turn, new or reconciled (the row is replaced).
    Dispatched(DispatchedRow),
    /// A key of the key store, added, rotated or revoked (the row is replaced).
    ClientKey(ClientKeyRow),
    /// A key's counts after one of its turns ended (the row is replaced).
    KeyUsage(ClientKeyRow),
    /// The runtime policy switches after a switch (`policy::Overrides` as JSON, replaced).
    RuntimePolicy(serde_json::Value),
    /// An operator labelled an incident (the row is replaced: the latest label wins).
    IncidentLabel(IncidentLabelRow),
}

enum Op {
    Apply {
        point: Option<Point>,
        changes: Vec<Change>,
    },
    Replace(Snapshot),
    Read(SyncSender<Result<Snapshot, StateError>>),
    Flush(SyncSender<()>),
}

/// The handle to the store's thread. `Send + Sync`; shared through the halt core.
#[derive(Debug)]
pub struct StateStore {
    path: PathBuf,
    tx: Mutex<Option<SyncSender<Op>>>,
    failed: Arc<AtomicBool>,
    /// Set once this process handed the ledger over (`halt/handover.rs`): its changes are
    /// still written, but the point stays where the successor's segment links to.
    frozen: Arc<AtomicBool>,
    /// A read-only connection and the `data_version` last seen on it, while a peer writes too.
    peer: Mutex<Option<(rusqlite::Connection, i64)>>,
    thread: Mutex<Option<JoinHandle<()>>>,
}

impl StateStore {
    /// Opens (or creates) `<dir>/state.db`, migrating an older schema, and starts its thread.
    /// Returns the store with what it held.
    pub fn open(dir: &Path) -> Result<(StateStore, Snapshot), StateError> {
        StateStore::open_with_fault(dir, None)
    }

    /// [`Self::open`]; with `fail_after = Some(n)` (the test fault `--fault
    /// state-write-fails-after=N`) every change after the first `n` fails to be written.
    pub fn open_with_fault(
        dir: &Path,
        fail_after: Option<u64>,
    ) -> Result<(StateStore, Snapshot), StateError> {
        let path = dir.join(STATE_FILE);
        let mut conn = schema::open(&path)?;
        let held = schema::load(&conn, &path)?;
        // The store is written only by its thread from here on.
        let (tx, rx) = mpsc::sync_channel(QUEUE_CAPACITY);
        let failed = Arc::new(AtomicBool::new(false));
        let frozen = Arc::new(AtomicBool::new(false));
        let (thread_failed, thread_path) = (Arc::clone(&failed), path.clone());
        let thread_frozen = Arc::clone(&frozen);
        let thread = std::thread::Builder::new()
            .name("haltd-state".to_owned())
            .spawn(move || {
                let failed = Failed {
                    flag: &thread_failed,
                    after: fail_after,
                };
                run(&mut conn, &thread_path, &rx, &failed, &thread_frozen);
            })
            .map_err(|source| StateError::Io {
                path: path.clone(),
                op: "starting its thread",
                source,
            })?;
        let store = StateStore {
            path,
            tx: Mutex::new(Some(tx)),
            failed,
            frozen,
            peer: Mutex::new(None),
            thread: Mutex::new(Some(thread)),
        };
        Ok((store, held))
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Whether a write failed (the daemon then fails closed).
    pub fn is_failed(&self) -> bool {
        self.failed.load(Ordering::Acquire)
    }

    fn send(&self, op: Op) -> Result<(), StateError> {
        let tx = self.tx.lock().unwrap_or_else(|p| p.into_inner());
        let Some(tx) = tx.as_ref() else {
            return Err(self.gone());
        };
        let result = match tx.try_send(op) {
            Ok(()) => Ok(()),
            Err(TrySendError::Full(_)) => Err(StateError::QueueFull {
                path: self.path.clone(),
                capacity: QUEUE_CAPACITY,
            }),
            Err(TrySendError::Disconnected(_)) => Err(self.gone()),
        };
        if let Err(e) = &result {
            self.fail(e);
        }
        result
    }

    fn gone(&self) -> StateError {
        StateError::Gone {
            path: self.path.clone(),
        }
    }

    fn fail(&self, e: &StateError) {
        if !self.failed.swap(true, Ordering::AcqRel) {
            tracing::error!(error = %e, "the state store failed");
        }
    }

    /// Queues changes, with the ledger record that states them (`None`: changes no record
    /// states, such as a degraded scope's timer restarted by another halt: the point stays).
    /// Never waits for the disk.
    pub fn apply(&self, point: Option<Point>, changes: Vec<Change>) {
        let _ = self.send(Op::Apply { point, changes });
    }

    /// Moves the store's point to a record that changes nothing it holds (the start record,
    /// a rotated segment's first record).
    pub fn link(&self, point: Point) {
        self.apply(Some(point), Vec::new());
    }

    /// Replaces everything the store holds (at start, with the state restored).
    pub fn replace(&self, held: Snapshot) {
        let _ = self.send(Op::Replace(held));
    }

    /// What the store holds now, once every change queued before is written.
    pub fn read(&self) -> Result<Snapshot, StateError> {
        let (tx, rx) = mpsc::sync_channel(1);
        self.send(Op::Read(tx))?;
        rx.recv().map_err(|_| self.gone())?
    }

    /// From now on the point stays where it is (this process handed its ledger over: the
    /// successor's segment continues from the point's record); changes are still written.
    /// [`Self::thaw_point`] undoes it when the successor never took over.
    pub fn freeze_point(&self) {
        self.frozen.store(true, Ordering::SeqCst);
    }

    pub fn thaw_point(&self) {
        self.frozen.store(false, Ordering::SeqCst);
    }

    /// The degraded scopes the store holds, if anything was committed to it since the last
    /// call (by a peer, or by this process's own thread); `None` when nothing was. Opens a
    /// read-only connection at the first call.
    pub fn peer_scopes(&self) -> Result<Option<Vec<ScopeRow>>, StateError> {
        let mut peer = self.peer.lock().unwrap_or_else(|p| p.into_inner());
        if peer.is_none() {
            *peer = Some((schema::open_reader(&self.path)?, -1));
        }
        let Some((conn, seen)) = peer.as_mut() else {
            return Ok(None);
        };
        let version = schema::data_version(conn, &self.path)?;
        if version == *seen {
            return Ok(None);
        }
        let rows = schema::load_scopes(conn, &self.path)?;
        *seen = version;
        Ok(Some(rows))
    }

    /// Waits until every change queued before is written.
    pub fn flush(&self) {
        let (tx, rx) = mpsc::sync_channel(1);
        if self.send(Op::Flush(tx)).is_ok() {
            let _ = rx.recv();
        }
    }
}

impl Drop for StateStore {
    fn drop(&mut self) {
        drop(self.tx.lock().unwrap_or_else(|p| p.into_inner()).take());
        let thread = self.thread.lock().unwrap_or_else(|p| p.into_inner()).take();
        if let Some(t) = thread {
            if t.join().is_err() {
                tracing::error!(path = %self.path.display(), "the state store's thread panicked");
            }
        }
    }
}

/// Whether the store failed, and the test fault's count of writes that succeed.
struct Failed<'a> {
    flag: &'a AtomicBool,
    after: Option<u64>,
}

/// The store's thread: applies the changes in order, those queued together in one
/// transaction.
fn run(
    conn: &mut rusqlite::Connection,
    path: &Path,
    rx: &Receiver<Op>,
    failed: &Failed<'_>,
    frozen: &AtomicBool,
) {
    let mut applied = 0u64;
    let mut batch: Vec<(Option<Point>, Vec<Change>)> = Vec::new();
    let mut next = rx.recv().ok();
    while let Some(op) = next.take() {
        match op {
            Op::Apply { point, changes } => {
                let point = point.filter(|_| !frozen.load(Ordering::SeqCst));
                batch.push((point, changes));
                // Take what else is queued, up to the batch's end or another kind of op.
                match rx.try_recv() {
                    Ok(op) if batch.len() < BATCH_MAX => {
                        next = Some(op);
                        if matches!(next, Some(Op::Apply { .. })) {
                            continue;
                        }
                    }
                    Ok(op) => next = Some(op),
                    Err(_) => {}
                }
                applied += 1;
                if failed.after.is_some_and(|n| applied > n) {
                    let injected = StateError::Injected {
                        path: path.to_owned(),
                    };
                    write(failed.flag, || Err(injected));
                } else {
                    write(failed.flag, || schema::apply(conn, path, &batch));
                }
                batch.clear();
            }
            Op::Replace(held) => write(failed.flag, || schema::replace(conn, path, &held)),
            Op::Read(tx) => {
                let _ = tx.send(schema::load(conn, path));
            }
            Op::Flush(tx) => {
                let _ = tx.send(());
            }
        }
        if next.is_none() {
            next = rx.recv().ok();
        }
    }
}

/// Runs a write unless one failed before, and marks the store failed if this one fails.
fn write(failed: &AtomicBool, work: impl FnOnce() -> Result<(), StateError>) {
    if failed.load(Ordering::Acquire) {
        return;
    }
    if let Err(e) = work() {
        tracing::error!(error = %e, "the state store failed");
        failed.store(true, Ordering::Release);
    }
}

#[cfg(test)]
mod tests;
