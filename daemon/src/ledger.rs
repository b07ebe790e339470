//! The flight recorder (FHR, docs/fhr-schema.md): an append-only, keyed hash chain of JSON
//! Lines records, with its head kept outside the file.
//!
//! One record per line: one per incident, one per turn (every turn that is not normal, a
//! sample of the normal ones: [`crate::sampling`]), plus lifecycle and admin records. Each
//! record carries its position (`seq`, contiguous), the previous record's hash (`prev_hash`,
//! 64 zeros for the first) and its own `hash`: hex HMAC-SHA-256, under the ledger key
//! ([`LedgerKey`], root-only in the state directory), of the record serialised by
//! `serde_json` *without* the `hash` field, fields in struct order. Without the key nobody
//! can write a record that verifies, so changing, inserting, deleting, reordering or
//! re-linking lines breaks the chain; cutting records off the end is caught by the head
//! ([`head`]): the next `seq` and the last hash, in the state directory.
//!
//! The lifecycle (docs/fhr-schema.md, "Lifecycle"), which every writer of the file follows:
//!
//! 1. a record is written and fsync'd, then whoever waits for it is answered, then the head is
//!    written and fsync'd; so the file is never behind its head, and at most one record ahead;
//! 2. at start, a file one record ahead of its head is a crash between the two fsyncs: the head
//!    catches up. A torn last line (a crash mid-write) is cut off, and a `recovery` record
//!    names what was cut. A file behind its head, or not ending at it, or broken anywhere
//!    before its last line is tampering: [`Ledger::open`] refuses it ([`LedgerError::Tampered`],
//!    [`LedgerError::ChainBroken`]) and appends an incident to `ledger-incidents.jsonl` in the
//!    state directory, which the attacker cannot write. So is a file with records but no head
//!    ([`LedgerError::HeadMissing`]): records cut off its end could not be ruled out, until
//!    the operator re-anchors the chain on purpose, recorded in it ([`Ledger::reanchor`]);
//! 3. rotation ([`Ledger::reopen`]) starts a new segment whose first record links to the
//!    previous head; [`verify_series`] checks a series of segments;
//! 4. hand-over (`ledger/handover.rs`, issue 38): a new process takes over from a running one,
//!    each with its own file. The old one writes a hand-over record
//!    ([`Ledger::append_sync_written`]) and drains into its own file; the new one opens a fresh
//!    segment linked to that record ([`Ledger::open_linked`]): a fork of the chain, which
//!    [`verify_series`] accepts at a hand-over record only;
//! 5. `--ledger-no-fsync` skips both fsyncs: the guarantees above hold only while the
//!    kernel's page cache survives, which haltd says at start and in every record (`no_fsync`).
//!
//! Durability (G7): a single writer thread owns the file. [`Ledger::append`] only queues (for
//! records nobody waits on); [`Ledger::append_sync`] and [`Ledger::append_then`] are answered
//! once the record is written and fsync'd, which is what an answer that depends on a record
//! (a halt's terminal event, an admin acknowledgement) waits for.
//!
//! Fail closed (G3): a failed write (disk full, I/O error) poisons the ledger: the partial
//! line is cut off if possible, and every later call returns an error so the daemon can stop
//! serving instead of streaming unrecorded turns. The file is locked (`flock`) so that two
//! daemons cannot interleave chains.

use std::fs::{File, OpenOptions, TryLockError};
use std::io::{BufReader, Write};
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc::{self, SyncSender, TrySendError};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;

use crate::clock::rfc3339_now;

mod error;
mod handover;
pub mod head;
mod key;
pub mod metrics;
mod reanchor;
mod record;
pub mod show;
mod verify;
mod writer;

pub use error::{LedgerError, TAMPERED_EXIT_CODE};
pub use handover::SegmentLink;
pub use head::Head;
pub use reanchor::{Anchor, Reanchored};

/// A record as written: its position and its hash.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Written {
    pub seq: u64,
    pub hash: String,
}
pub use key::{LedgerKey, KEY_FILE};
pub use record::{Record, RecordKind, GENESIS_HASH};
use verify::scan;
pub use verify::{
    first_key_ids, parse_line, verify, verify_series, ChainBreak, HandoverLink, HeadMatch,
    LineFault, VerifyReport,
};
use writer::{Ack, Cmd, Writer};

/// Records [`Ledger::append`] may queue ahead of the writer before it reports
/// [`LedgerError::QueueFull`] (bounded so that a stalled disk shows up as an error, not as
/// unbounded memory growth).
pub const QUEUE_CAPACITY: usize = 16_384;

/// The file in the state directory where a refused start records what it found.
pub const INCIDENTS_FILE: &str = "ledger-incidents.jsonl";

/// What [`Ledger::open`] needs.
#[derive(Debug, Clone)]
pub struct LedgerConfig<'a> {
    /// The ledger file (the current segment).
    pub path: &'a Path,
    /// The state directory: the key, the head, the incidents of refused starts.
    pub state_dir: &'a Path,
    /// fsync every record and the head (off: `--ledger-no-fsync`).
    pub fsync: bool,
    /// `kernel_gate` of the records the ledger writes itself (a recovery).
    pub kernel_gate: &'static str,
    /// Test-only fault (`--fault ledger-slow-write-ms=N`): every record takes this much
    /// longer to write, as on a busy disk.
    pub slow_write: Option<std::time::Duration>,
    /// Test-only fault (`--fault ledger-write-fails-after=N`): the Nth record written by this
    /// process, and every one after it, fails with EIO, as on a disk that stopped writing.
    pub fail_writes_from: Option<u64>,
}

/// State shared between the handles and the writer.
#[derive(Debug)]
struct Shared {
    path: PathBuf,
    written: AtomicU64,
    failed: AtomicBool,
    failure: Mutex<Option<String>>,
}

impl Shared {
    fn check_failed(&self) -> Result<(), LedgerError> {
        if !self.failed.load(Ordering::Acquire) {
            return Ok(());
        }
        let reason = match self.failure.lock() {
            Ok(g) => g.clone().unwrap_or_default(),
            Err(p) => p.into_inner().clone().unwrap_or_default(),
        };
        Err(LedgerError::WriterFailed {
            path: self.path.clone(),
            reason,
        })
    }

    fn set_failed(&self, reason: String) {
        match self.failure.lock() {
            Ok(mut g) => *g = Some(reason),
            Err(p) => *p.into_inner() = Some(reason),
        }
        self.failed.store(true, Ordering::Release);
    }
}

#[derive(Debug)]
struct Inner {
    /// `Option` so that `Drop` can close the channel before joining the writer.
    tx: Option<SyncSender<Cmd>>,
    shared: Arc<Shared>,
    thread: Option<JoinHandle<()>>,
}

impl Drop for Inner {
    /// The last handle going away closes the queue and waits for the writer to drain it, so
    /// queued records reach the file and the lock is released before a reopen.
    fn drop(&mut self) {
        drop(self.tx.take());
        if let Some(t) = self.thread.take() {
            if t.join().is_err() {
                tracing::error!(path = %self.shared.path.display(), "ledger writer thread panicked");
            }
        }
    }
}

/// Handle to the ledger's writer thread. Cheap to clone; `Send + Sync`.
#[derive(Debug, Clone)]
pub struct Ledger {
    inner: Arc<Inner>,
}

/// A torn last line that [`Ledger::open`] cut off.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TornTail {
    /// Where it began (the length of the file after the cut).
    pub offset: u64,
    pub bytes: u64,
    /// Its first bytes (at most 64).
    pub prefix: Vec<u8>,
}

impl Ledger {
    /// Opens (or creates) the ledger, checks it against its key and head, recovers a crash
    /// and resumes the chain (the lifecycle in the module doc).
    ///
    /// Refuses a file whose chain is broken before its last line ([`LedgerError::ChainBroken`]),
    /// one that does not end at its head ([`LedgerError::Tampered`]), one with records but no
    /// head ([`LedgerError::HeadMissing`]: only [`Ledger::reanchor`] takes it), and a file
    /// another process holds ([`LedgerError::Locked`]).
    pub fn open(cfg: &LedgerConfig<'_>) -> Result<Ledger, LedgerError> {
        let opened = Self::open_with(cfg, MissingHead::Refuse)?;
        if let Some(t) = opened.torn {
            opened
                .ledger
                .append_sync(recovery_record(cfg.path, &t, cfg.kernel_gate))?;
        }
        Ok(opened.ledger)
    }

    /// [`Ledger::open`], with `missing` deciding what a ledger with records but no head
    /// becomes. A re-anchored ledger's head is written only after its first record (the
    /// caller's re-anchor record): a crash before it leaves the head missing still.
    fn open_with(cfg: &LedgerConfig<'_>, missing: MissingHead) -> Result<Opened, LedgerError> {
        let path = cfg.path;
        let file = open_segment(path)?;
        lock(&file, path)?;
        let key = LedgerKey::load_or_create(cfg.state_dir).map_err(|e| LedgerError::Key {
            reason: e.to_string(),
        })?;
        let (mut head_file, head) =
            head::HeadFile::open(cfg.state_dir, path, &key).map_err(|source| {
                LedgerError::Head {
                    path: cfg.state_dir.to_owned(),
                    source,
                }
            })?;
        let scan = scan(path, BufReader::new(&file), &key, None)?;
        if let Some(b) = scan.broken {
            let err = LedgerError::ChainBroken {
                path: path.to_owned(),
                line: b.line,
                seq: b.seq,
                reason: b.reason,
            };
            return Err(incident(cfg.state_dir, err));
        }
        let anchor = check_head(cfg, &scan, head, &head_file, missing).inspect_err(|_| {
            // A refused start leaves the state directory as it found it.
            if head_file.is_new() {
                let _ = std::fs::remove_file(head_file.path());
            }
        })?;
        let torn = cut_torn_tail(path, &file, &scan, cfg.fsync)?;
        let end = scan.end();
        if anchor.is_none() {
            head_file
                .write(&end, cfg.fsync)
                .map_err(|source| LedgerError::Head {
                    path: head_file.path().to_owned(),
                    source,
                })?;
        }
        if scan.records == 0 && cfg.fsync {
            // A new file: make its directory entry durable too, or a crash could lose the
            // whole file along with the records acknowledged in it.
            sync_dir(path).map_err(|source| LedgerError::Open {
                path: path.to_owned(),
                source,
            })?;
        }
        tracing::info!(path = %path.display(), records = scan.next_seq, "ledger opened");
        let writer = Writer::new(file, cfg.fsync, end, scan.len, head_file, key)
            .with_slow_write(cfg.slow_write)
            .with_failing_writes(cfg.fail_writes_from);
        Ok(Opened {
            ledger: Self::start(path, writer)?,
            anchor,
            torn,
        })
    }

    /// Starts the writer over an already-checked file positioned at its end.
    fn start(path: &Path, writer: Writer) -> Result<Ledger, LedgerError> {
        let shared = Arc::new(Shared {
            path: path.to_owned(),
            written: AtomicU64::new(0),
            failed: AtomicBool::new(false),
            failure: Mutex::new(None),
        });
        let (tx, rx) = mpsc::sync_channel(QUEUE_CAPACITY);
        let writer = writer.with_shared(Arc::clone(&shared));
        let thread = std::thread::Builder::new()
            .name("haltd-ledger".to_owned())
            .spawn(move || writer.run(rx))
            .map_err(|source| LedgerError::Spawn {
                path: path.to_owned(),
                source,
            })?;
        Ok(Ledger {
            inner: Arc::new(Inner {
                tx: Some(tx),
                shared,
                thread: Some(thread),
            }),
        })
    }

    fn sender(&self) -> Result<&SyncSender<Cmd>, LedgerError> {
        self.inner.tx.as_ref().ok_or_else(|| self.gone())
    }

    /// The error of a writer thread that is gone.
    pub(crate) fn writer_gone(&self) -> LedgerError {
        self.gone()
    }

    fn gone(&self) -> LedgerError {
        LedgerError::WriterGone {
            path: self.inner.shared.path.clone(),
        }
    }

    fn enqueue(&self, rec: Record, ack: Ack) -> Result<(), LedgerError> {
        self.inner.shared.check_failed()?;
        rec.validate()?;
        let cmd = Cmd::Append {
            rec: Box::new(rec),
            ack,
        };
        match self.sender()?.try_send(cmd) {
            Ok(()) => Ok(()),
            Err(TrySendError::Full(_)) => Err(LedgerError::QueueFull {
                path: self.inner.shared.path.clone(),
                capacity: QUEUE_CAPACITY,
            }),
            Err(TrySendError::Disconnected(_)) => Err(self.gone()),
        }
    }

    /// Queues a record and returns at once; never waits for the disk. For records nobody is
    /// answered on.
    ///
    /// Errors: the record is invalid, an earlier write failed, or the queue is full.
    pub fn append(&self, rec: Record) -> Result<(), LedgerError> {
        self.enqueue(rec, Ack::None)
    }

    /// Queues a record; `done` runs on the writer thread once it is written and fsync'd (or
    /// failed), with its `seq`. When this returns an error, `done` never runs. `done` must not
    /// block: it runs before the next record is written.
    pub fn append_then(
        &self,
        rec: Record,
        done: impl FnOnce(Result<u64, LedgerError>) + Send + 'static,
    ) -> Result<(), LedgerError> {
        self.enqueue(rec, Ack::Then(Box::new(done)))
    }

    /// Queues a record; `done` runs on the writer thread once it is written and fsync'd (or
    /// failed), with its seq and hash: for state kept elsewhere that follows the ledger (the
    /// state store), written only after the record it reflects. Otherwise as
    /// [`Ledger::append_then`].
    pub fn append_linked(
        &self,
        rec: Record,
        done: impl FnOnce(Result<Written, LedgerError>) + Send + 'static,
    ) -> Result<(), LedgerError> {
        self.enqueue(rec, Ack::Linked(Box::new(done)))
    }

    /// Appends a record and waits until it is written (and fsync'd when the ledger fsyncs);
    /// returns its `seq`. Everything queued before it is then on disk too.
    pub fn append_sync(&self, rec: Record) -> Result<u64, LedgerError> {
        self.append_waiting(rec, Ack::Sync)
    }

    /// [`Ledger::append_sync`], answered with the record's seq and hash: for a record another
    /// segment links to, such as the old process's hand-over record (issue 38: its `handover`
    /// field, set by the caller, names the successor; the successor opens its segment with
    /// [`Ledger::open_linked`] on this `Written`).
    pub fn append_sync_written(&self, rec: Record) -> Result<Written, LedgerError> {
        self.append_waiting(rec, Ack::SyncWritten)
    }

    /// Queues `rec` and waits for the writer's answer on the channel `ack` wraps.
    fn append_waiting<T>(
        &self,
        rec: Record,
        ack: impl FnOnce(SyncSender<Result<T, LedgerError>>) -> Ack,
    ) -> Result<T, LedgerError> {
        self.inner.shared.check_failed()?;
        rec.validate()?;
        let (tx, done) = mpsc::sync_channel(1);
        let cmd = Cmd::Append {
            rec: Box::new(rec),
            ack: ack(tx),
        };
        self.sender()?.send(cmd).map_err(|_| self.gone())?;
        done.recv().map_err(|_| self.gone())?
    }

    /// Waits until everything queued before this call is written and fsync'd (also when the
    /// ledger does not fsync per record).
    pub fn flush(&self) -> Result<(), LedgerError> {
        self.inner.shared.check_failed()?;
        let (ack, done) = mpsc::sync_channel(1);
        self.sender()?
            .send(Cmd::Flush { ack })
            .map_err(|_| self.gone())?;
        done.recv().map_err(|_| self.gone())?
    }

    /// Rotation: reopens the ledger's path (which an operator or logrotate has moved aside)
    /// and starts a new segment there, its first record `rec` (a lifecycle record; the
    /// writer adds the `segment` link to the previous head). Returns that record's seq and hash.
    /// The path must hold a new, empty file; if it is still the current one, nothing happens
    /// and `Ok(None)` is returned.
    pub fn reopen(&self, rec: Record) -> Result<Option<Written>, LedgerError> {
        self.inner.shared.check_failed()?;
        rec.validate()?;
        let (ack, done) = mpsc::sync_channel(1);
        self.sender()?
            .send(Cmd::Reopen {
                rec: Box::new(rec),
                ack,
            })
            .map_err(|_| self.gone())?;
        done.recv().map_err(|_| self.gone())?
    }

    /// Whether a write failed: from then on the ledger accepts nothing and the daemon must
    /// stop serving (it cannot record turns).
    pub fn is_failed(&self) -> bool {
        self.inner.shared.failed.load(Ordering::Acquire)
    }

    /// Why the ledger failed (see [`Ledger::is_failed`]); `None` while it writes.
    pub fn failure(&self) -> Option<String> {
        self.inner
            .shared
            .check_failed()
            .err()
            .map(|e| e.to_string())
    }

    /// Records written by this handle's writer since open.
    pub fn records_written(&self) -> u64 {
        self.inner.shared.written.load(Ordering::Acquire)
    }

    /// The ledger file.
    pub fn path(&self) -> &Path {
        &self.inner.shared.path
    }
}

/// Opens (or creates, mode 0600) the segment file at `path` for reading and appending: the
/// ledger at start ([`Ledger::open`]) and the new segment of a rotation ([`Ledger::reopen`]).
/// It is not locked yet: a rotation first checks it is a new file.
fn open_segment(path: &Path) -> Result<File, LedgerError> {
    OpenOptions::new()
        .read(true)
        .append(true)
        .create(true)
        .mode(0o600)
        .open(path)
        .map_err(|source| LedgerError::Open {
            path: path.to_owned(),
            source,
        })
}

/// What [`Ledger::open_with`] does with a ledger that has records but no head.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum MissingHead {
    /// Refuse it: a start ([`LedgerError::HeadMissing`]).
    Refuse,
    /// Take its chain as it stands, and only such a ledger: `haltctl ledger reanchor`.
    Reanchor,
}

/// An opened ledger, and what the open found.
struct Opened {
    ledger: Ledger,
    /// Where a re-anchored chain stood ([`MissingHead::Reanchor`] only).
    anchor: Option<Anchor>,
    torn: Option<TornTail>,
}

/// Step 2 of the lifecycle: the end of the chain against its head. `Err`: tampering (a
/// missing head included), recorded as an incident in the state directory, or a ledger
/// [`MissingHead::Reanchor`] does not take. `Ok(Some)`: the chain is re-anchored there.
fn check_head(
    cfg: &LedgerConfig<'_>,
    scan: &verify::Scan,
    head: Option<Head>,
    head_file: &head::HeadFile,
    missing: MissingHead,
) -> Result<Option<Anchor>, LedgerError> {
    let path = cfg.path;
    if missing == MissingHead::Reanchor {
        return reanchor::check(cfg, scan, head.as_ref(), head_file).map(Some);
    }
    let head = match head {
        Some(h) => h,
        None if head_file.is_new() && scan.records > 0 => {
            // A chain that verifies under the key but has no head here: the head file was
            // deleted (and records may have been cut off with it), the ledger moved, or the
            // state directory is another. Only the operator can tell which.
            let err = LedgerError::HeadMissing {
                path: path.to_owned(),
                head: head_file.path().to_owned(),
                state_dir: cfg.state_dir.to_owned(),
                records: scan.records,
            };
            return Err(incident(cfg.state_dir, err));
        }
        None if head_file.is_new() => return Ok(None),
        None => {
            let err = LedgerError::Tampered {
                path: path.to_owned(),
                reason: format!(
                    "its head {} holds no valid slot",
                    head_file.path().display()
                ),
            };
            return Err(incident(cfg.state_dir, err));
        }
    };
    match scan.against(&head) {
        Ok(HeadMatch::Equal) => Ok(None),
        Ok(HeadMatch::AheadByOne) => {
            tracing::warn!(path = %path.display(), seq = head.next_seq, "ledger one record past its head: haltd stopped between a record's fsync and the head's; the head catches up");
            Ok(None)
        }
        Err(reason) => {
            let err = LedgerError::Tampered {
                path: path.to_owned(),
                reason,
            };
            Err(incident(cfg.state_dir, err))
        }
    }
}

/// Takes the file's `flock`, or says who holds it.
fn lock(file: &File, path: &Path) -> Result<(), LedgerError> {
    file.try_lock().map_err(|e| match e {
        TryLockError::WouldBlock => LedgerError::Locked {
            path: path.to_owned(),
        },
        TryLockError::Error(source) => LedgerError::Lock {
            path: path.to_owned(),
            source,
        },
    })
}

/// fsyncs the directory that holds `path` (a new entry in it).
fn sync_dir(path: &Path) -> std::io::Result<()> {
    let dir = match path.parent() {
        Some(p) if !p.as_os_str().is_empty() => p,
        _ => Path::new("."),
    };
    File::open(dir).and_then(|d| d.sync_all())
}

/// Cuts a torn last line (a crash mid-write) off the file, durably, and says what it was.
fn cut_torn_tail(
    path: &Path,
    file: &File,
    scan: &verify::Scan,
    fsync: bool,
) -> Result<Option<TornTail>, LedgerError> {
    if scan.torn == 0 {
        return Ok(None);
    }
    let t = TornTail {
        offset: scan.len,
        bytes: scan.torn,
        prefix: scan.torn_prefix.clone(),
    };
    tracing::warn!(path = %path.display(), offset = t.offset, bytes = t.bytes, "ledger ends in a torn line (a crash mid-write): cutting it off and recording so");
    let cut = file
        .set_len(t.offset)
        .and_then(|()| if fsync { file.sync_data() } else { Ok(()) });
    cut.map_err(|source| LedgerError::Write {
        path: path.to_owned(),
        seq: scan.next_seq,
        source,
    })?;
    Ok(Some(t))
}

/// The lifecycle record of a cut torn tail.
fn recovery_record(path: &Path, t: &TornTail, kernel_gate: &'static str) -> Record {
    Record {
        kind: RecordKind::Lifecycle,
        kernel_gate: kernel_gate.to_owned(),
        recovery: Some(serde_json::json!({
            "cut_offset": t.offset,
            "cut_bytes": t.bytes,
            "cut_prefix": String::from_utf8_lossy(&t.prefix),
        })),
        message: Some(format!(
            "recovered from a crash: cut a torn last line of {} bytes at offset {} of {} (a record that was never fsync'd, so never answered for)",
            t.bytes,
            t.offset,
            path.display()
        )),
        ..Record::default()
    }
}

/// Appends the refusal to the state directory's incident file (fsync'd), logs it, and
/// returns it; the file is out of reach of whoever rewrote the ledger.
fn incident(state_dir: &Path, err: LedgerError) -> LedgerError {
    let line = serde_json::json!({
        "ts": rfc3339_now(),
        "pid": std::process::id(),
        "incident": err.incident_name(),
        "error": err.to_string(),
    });
    let path = state_dir.join(INCIDENTS_FILE);
    let written = OpenOptions::new()
        .append(true)
        .create(true)
        .mode(0o600)
        .open(&path)
        .and_then(|mut f| {
            f.write_all(format!("{line}\n").as_bytes())?;
            f.sync_data()
        });
    if let Err(e) = written {
        tracing::error!(path = %path.display(), error = %e, "cannot record the ledger incident in the state directory");
    }
    tracing::error!(incident = %line, "ledger refused: possible tampering; haltd does not start");
    err
}

/// Opening and verifying a ledger with its state in `<dir of the ledger>/state`, for the
/// unit tests of the ledger's users.
#[cfg(test)]
pub(crate) mod testing {
    use super::*;

    pub(crate) fn state_dir(path: &Path) -> PathBuf {
        path.parent().expect("ledger in a directory").join("state")
    }

    pub(crate) fn open(path: &Path, fsync: bool) -> Result<Ledger, LedgerError> {
        Ledger::open(&cfg(path, &state_dir(path), fsync))
    }

    /// Opens `path` as a hand-over segment continuing `link`.
    pub(crate) fn open_linked(
        path: &Path,
        link: &SegmentLink,
    ) -> Result<(Ledger, Written), LedgerError> {
        Ledger::open_linked(&cfg(path, &state_dir(path), true), link)
    }

    fn cfg<'a>(path: &'a Path, state_dir: &'a Path, fsync: bool) -> LedgerConfig<'a> {
        LedgerConfig {
            path,
            state_dir,
            fsync,
            kernel_gate: "enforcing",
            slow_write: None,
            fail_writes_from: None,
        }
    }

    pub(crate) fn key(path: &Path) -> LedgerKey {
        LedgerKey::read(&state_dir(path)).expect("ledger key")
    }

    /// Verifies `path` against its key and head.
    pub(crate) fn verify(path: &Path) -> VerifyReport {
        let key = key(path);
        let head = head::read_head(&state_dir(path), path, &key).expect("head");
        super::verify(path, &key, head.as_ref()).expect("verify")
    }
}

#[cfg(test)]
mod tests;
