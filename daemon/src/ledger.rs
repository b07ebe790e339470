//! The flight recorder (FHR, DESIGN §6): an append-only, hash-linked JSON Lines ledger.
//!
//! One record per line: one per incident, one per turn (every turn that is not normal, a
//! sample of the normal ones: [`crate::sampling`]), plus lifecycle records. Each record
//! carries its position (`seq`, 0-based and contiguous), the previous record's hash
//! (`prev_hash`, 64 zeros for the first) and its own `hash`: hex SHA-256 over the record
//! serialised by `serde_json` *without* the `hash` field, fields in struct order. Changing,
//! inserting or deleting a line therefore breaks the chain at that line, which [`verify`]
//! reports. (Cutting records off the end at a line boundary leaves a valid shorter chain; the
//! `records_written` metric and lifecycle records are what catch that.)
//!
//! Durability (G7): a single writer thread owns the file. [`Ledger::append`] only queues (the
//! data plane never waits on the disk); [`Ledger::append_sync`] and [`Ledger::flush`] wait
//! until the record is written and fsync'd. With `fsync: true` (the default knob) every record
//! is fsync'd as it is written, so a queued record is durable as soon as the writer reaches it.
//!
//! Fail closed (G3): opening a file whose chain is broken is refused with the line and the
//! reason, because appending to it would hide the break behind a fresh valid-looking tail;
//! the operator runs [`verify`] and decides. A failed write (disk full, I/O error) poisons
//! the ledger: the partial line is cut off if possible, and every later call returns an error
//! so the daemon can stop serving instead of streaming unrecorded turns. The file is locked
//! (`flock`) so that two daemons cannot interleave chains.

use std::fmt;
use std::fs::{File, OpenOptions, TryLockError};
use std::io::{self, BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc::{self, Receiver, SyncSender, TrySendError};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;

use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use crate::clock::rfc3339_now;

/// `prev_hash` of the first record.
pub const GENESIS_HASH: &str = "0000000000000000000000000000000000000000000000000000000000000000";

/// Records [`Ledger::append`] may queue ahead of the writer before it reports
/// [`LedgerError::QueueFull`] (bounded so that a stalled disk shows up as an error, not as
/// unbounded memory growth).
pub const QUEUE_CAPACITY: usize = 16_384;

/// What a record describes.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
#[serde(rename_all = "lowercase")]
pub enum RecordKind {
    /// One completed (or halted) turn.
    #[default]
    Turn,
    /// A trip or other incident (G5: one per trip).
    Incident,
    /// Daemon start, stop, config and mode changes.
    Lifecycle,
    /// An earlier haltd ended on an uncontained panic, recorded at the next start from its
    /// crash file ([`crate::crash`]).
    Crash,
}

/// One flight-recorder record. `seq`, `prev_hash` and `hash` are filled by the ledger; `ts`
/// too when left empty.
///
/// `Default` gives `rts_mode = "normal"`, `runtime_mode = "full"` and an *empty*
/// `kernel_gate`, which [`Ledger::append`] rejects: every record must state whether the kernel
/// gate was enforcing.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq)]
pub struct Record {
    pub seq: u64,
    pub prev_hash: String,
    /// Omitted from the serialisation the hash is computed over (it is empty there).
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub hash: String,
    pub kind: RecordKind,
    /// RFC 3339 UTC with milliseconds, when the record was written.
    pub ts: String,
    pub turn_id: Option<String>,
    pub stream_id: Option<String>,
    /// `"stream"` or `"batch"`.
    pub mode: Option<String>,
    pub rts_mode: String,
    /// `"full"` or `"degraded"`.
    pub runtime_mode: String,
    pub latency_bucket: Option<String>,
    pub tig_breach: bool,
    pub watchdog_trip: bool,
    pub timing_incidents: Vec<String>,
    pub failure_codes: Vec<String>,
    pub trip_cause: Option<String>,
    pub trip_token_index: Option<u64>,
    pub halt_tokens_post_trip: Option<u64>,
    pub halt_latency_ms: Option<f64>,
    pub tokens_emitted: u64,
    pub detector_refs: Vec<String>,
    pub safety_verdict: Option<serde_json::Value>,
    /// `"enforcing"` or `"disabled"`.
    pub kernel_gate: String,
    pub budget: Option<u32>,
    pub outcome: Option<String>,
    pub halted_by: Option<String>,
    pub started_at: Option<String>,
    pub ended_at: Option<String>,
    /// Gate counters for the socket, free-form.
    pub kernel: Option<serde_json::Value>,
    pub message: Option<String>,
    // Fields added after the first release are left out when empty, so that records written
    // before them still hash (and verify) the same.
    /// The conversation's key fingerprint (never the key itself).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub conversation: Option<String>,
    /// TURN-ACID: `"committed"` (ended cleanly; its state was committed) or `"failed"`
    /// (left no state behind).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub turn_status: Option<String>,
    /// The upstream exchange of a proxied turn: status, failure, cancellation.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub upstream: Option<serde_json::Value>,
    /// Tool calls emitted to the client: `dispatched` ones of a failed turn need
    /// reconciliation.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub tool_calls: Vec<serde_json::Value>,
    /// A change of `runtime_mode` (degraded safe mode): scope, from, to, by, cause.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mode_change: Option<serde_json::Value>,
    /// Per-detector summary of the turn: mode, breaches, failures, what each measured.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub detectors: Option<serde_json::Value>,
    /// Turn records: why the record exists under the sampling policy (spec 000 §6.2):
    /// `{"rate": r}` for a normal turn drawn at rate r, `{"rate": 1.0, "reason": ...}` for
    /// one that is always recorded ([`crate::sampling`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sampling: Option<serde_json::Value>,
    /// Turn records with `--record-token-text`: the turn's output text (bounded).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub text: Option<String>,
    /// With `text`: whether the turn produced more than it holds.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub text_truncated: Option<bool>,
    /// Crash records: what the panic hook wrote (pid, thread, location, message, time).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub crash: Option<serde_json::Value>,
}

impl Default for Record {
    fn default() -> Self {
        Self {
            seq: 0,
            prev_hash: String::new(),
            hash: String::new(),
            kind: RecordKind::default(),
            ts: String::new(),
            turn_id: None,
            stream_id: None,
            mode: None,
            rts_mode: "normal".to_owned(),
            runtime_mode: "full".to_owned(),
            latency_bucket: None,
            tig_breach: false,
            watchdog_trip: false,
            timing_incidents: Vec::new(),
            failure_codes: Vec::new(),
            trip_cause: None,
            trip_token_index: None,
            halt_tokens_post_trip: None,
            halt_latency_ms: None,
            tokens_emitted: 0,
            detector_refs: Vec::new(),
            safety_verdict: None,
            kernel_gate: String::new(),
            budget: None,
            outcome: None,
            halted_by: None,
            started_at: None,
            ended_at: None,
            kernel: None,
            message: None,
            conversation: None,
            turn_status: None,
            upstream: None,
            tool_calls: Vec::new(),
            mode_change: None,
            detectors: None,
            sampling: None,
            text: None,
            text_truncated: None,
            crash: None,
        }
    }
}

impl Record {
    /// The record's hash as defined for the chain: hex SHA-256 of the serialisation without
    /// `hash` (whatever `self.hash` currently holds is ignored).
    pub fn compute_hash(&self) -> Result<String, LedgerError> {
        let canonical = if self.hash.is_empty() {
            serde_json::to_vec(self)
        } else {
            let mut unhashed = self.clone();
            unhashed.hash.clear();
            serde_json::to_vec(&unhashed)
        }
        .map_err(|source| LedgerError::Serialize { source })?;
        Ok(hex::encode(Sha256::digest(&canonical)))
    }

    /// Rejects records whose enumerated string fields hold something else.
    fn validate(&self) -> Result<(), LedgerError> {
        fn one_of(
            field: &'static str,
            value: &str,
            allowed: &'static [&'static str],
        ) -> Result<(), LedgerError> {
            if allowed.contains(&value) {
                Ok(())
            } else {
                Err(LedgerError::InvalidRecord {
                    field,
                    value: value.to_owned(),
                    allowed,
                })
            }
        }
        one_of("kernel_gate", &self.kernel_gate, &["enforcing", "disabled"])?;
        one_of("runtime_mode", &self.runtime_mode, &["full", "degraded"])?;
        if let Some(mode) = &self.mode {
            one_of("mode", mode, &["stream", "batch"])?;
        }
        Ok(())
    }
}

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
    #[error(
        "ledger {}: chain broken at line {line}{}: {reason}; refusing to append (verify the file and move it aside)",
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

fn fmt_seq(seq: Option<u64>) -> String {
    seq.map(|s| format!(" (seq {s})")).unwrap_or_default()
}

/// Where and why a chain breaks.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ChainBreak {
    /// 1-based line number in the file.
    pub line: u64,
    /// The record's `seq`, when the line parsed.
    pub seq: Option<u64>,
    pub reason: String,
}

/// Result of [`verify`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VerifyReport {
    /// Records with an intact chain (before the break, if any).
    pub records: u64,
    pub broken: Option<ChainBreak>,
}

impl VerifyReport {
    pub fn is_intact(&self) -> bool {
        self.broken.is_none()
    }
}

impl fmt::Display for VerifyReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.broken {
            None => write!(f, "ok: {} records, chain intact", self.records),
            Some(b) => write!(
                f,
                "BROKEN at line {}{}: {} ({} records intact before it)",
                b.line,
                fmt_seq(b.seq),
                b.reason,
                self.records
            ),
        }
    }
}

/// Checks the whole chain of the ledger at `path`. I/O errors are errors; a broken chain is a
/// report with `broken` set.
pub fn verify(path: &Path) -> Result<VerifyReport, LedgerError> {
    let file = File::open(path).map_err(|source| LedgerError::Open {
        path: path.to_owned(),
        source,
    })?;
    let scan = scan(path, BufReader::new(file))?;
    Ok(VerifyReport {
        records: scan.next_seq,
        broken: scan.broken,
    })
}

/// Chain state after reading a file.
struct Scan {
    next_seq: u64,
    last_hash: String,
    len: u64,
    broken: Option<ChainBreak>,
}

fn scan(path: &Path, mut reader: impl BufRead) -> Result<Scan, LedgerError> {
    let mut s = Scan {
        next_seq: 0,
        last_hash: GENESIS_HASH.to_owned(),
        len: 0,
        broken: None,
    };
    let mut buf = Vec::new();
    let mut line_no = 0u64;
    loop {
        buf.clear();
        line_no += 1;
        let n = reader
            .read_until(b'\n', &mut buf)
            .map_err(|source| LedgerError::Read {
                path: path.to_owned(),
                line: line_no,
                source,
            })?;
        if n == 0 {
            return Ok(s);
        }
        let brk = |seq: Option<u64>, reason: String| ChainBreak {
            line: line_no,
            seq,
            reason,
        };
        let Some(line) = buf.strip_suffix(b"\n") else {
            s.broken = Some(brk(
                None,
                "truncated line (no trailing newline; torn write?)".to_owned(),
            ));
            return Ok(s);
        };
        let rec: Record = match serde_json::from_slice(line) {
            Ok(r) => r,
            Err(e) if e.is_data() => {
                s.broken = Some(brk(None, format!("not a record: {e}")));
                return Ok(s);
            }
            Err(e) => {
                s.broken = Some(brk(None, format!("not JSON: {e}")));
                return Ok(s);
            }
        };
        let seq = Some(rec.seq);
        if rec.seq != s.next_seq {
            s.broken = Some(brk(
                seq,
                format!("seq gap (expected {}, found {})", s.next_seq, rec.seq),
            ));
            return Ok(s);
        }
        if rec.prev_hash != s.last_hash {
            s.broken = Some(brk(seq, "prev_hash mismatch".to_owned()));
            return Ok(s);
        }
        // The hash is checked over the line's own bytes with the `hash` field cut out, not
        // over a re-serialisation of the parsed record: serde_json's default float parsing
        // does not always round-trip the last bit, and any byte the writer did not hash
        // (an extra field, reformatting) must count as tampering.
        let Some(unhashed) = strip_hash_field(line, rec.seq, &rec.prev_hash, &rec.hash) else {
            s.broken = Some(brk(
                seq,
                "non-canonical encoding (fields reordered, added or reformatted)".to_owned(),
            ));
            return Ok(s);
        };
        if hex::encode(Sha256::digest(&unhashed)) != rec.hash {
            s.broken = Some(brk(seq, "hash mismatch".to_owned()));
            return Ok(s);
        }
        s.next_seq += 1;
        s.last_hash = rec.hash;
        s.len += n as u64;
    }
}

/// The bytes the writer hashed for `line`: the line without its `"hash":"…",` field, which
/// the writer's serialisation always places right after `seq` and `prev_hash`. `None` when the
/// line does not start that way.
fn strip_hash_field(line: &[u8], seq: u64, prev_hash: &str, hash: &str) -> Option<Vec<u8>> {
    let quote = |v: &str| serde_json::to_string(v).ok();
    let head = format!("{{\"seq\":{seq},\"prev_hash\":{},", quote(prev_hash)?);
    let field = format!("\"hash\":{},", quote(hash)?);
    let rest = line
        .strip_prefix(head.as_bytes())?
        .strip_prefix(field.as_bytes())?;
    let mut unhashed = Vec::with_capacity(head.len() + rest.len());
    unhashed.extend_from_slice(head.as_bytes());
    unhashed.extend_from_slice(rest);
    Some(unhashed)
}

/// Work for the writer thread.
enum Cmd {
    Append {
        rec: Box<Record>,
        ack: Option<SyncSender<Result<u64, LedgerError>>>,
    },
    Flush {
        ack: SyncSender<Result<(), LedgerError>>,
    },
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

impl Ledger {
    /// Opens (or creates) the ledger at `path`, checks the existing chain and resumes it.
    ///
    /// Refuses a file whose chain is broken ([`LedgerError::ChainBroken`]) and a file another
    /// process holds ([`LedgerError::Locked`]). `fsync: true` fsyncs every record.
    pub fn open(path: &Path, fsync: bool) -> Result<Ledger, LedgerError> {
        let open_err = |source| LedgerError::Open {
            path: path.to_owned(),
            source,
        };
        let file = OpenOptions::new()
            .read(true)
            .append(true)
            .create(true)
            .open(path)
            .map_err(open_err)?;
        file.try_lock().map_err(|e| match e {
            TryLockError::WouldBlock => LedgerError::Locked {
                path: path.to_owned(),
            },
            TryLockError::Error(source) => LedgerError::Lock {
                path: path.to_owned(),
                source,
            },
        })?;
        let scan = scan(path, BufReader::new(&file))?;
        if let Some(b) = scan.broken {
            return Err(LedgerError::ChainBroken {
                path: path.to_owned(),
                line: b.line,
                seq: b.seq,
                reason: b.reason,
            });
        }
        if scan.len == 0 && fsync {
            // A new file: make its directory entry durable too, or a crash could lose the
            // whole file along with the records acknowledged in it.
            let dir = match path.parent() {
                Some(p) if !p.as_os_str().is_empty() => p,
                _ => Path::new("."),
            };
            File::open(dir)
                .and_then(|d| d.sync_all())
                .map_err(open_err)?;
        }
        tracing::info!(path = %path.display(), records = scan.next_seq, "ledger opened");
        Self::start(path, file, fsync, scan.next_seq, scan.last_hash, scan.len)
    }

    /// Starts the writer over an already-checked file positioned at its end.
    fn start(
        path: &Path,
        file: File,
        fsync: bool,
        next_seq: u64,
        prev_hash: String,
        len: u64,
    ) -> Result<Ledger, LedgerError> {
        let shared = Arc::new(Shared {
            path: path.to_owned(),
            written: AtomicU64::new(0),
            failed: AtomicBool::new(false),
            failure: Mutex::new(None),
        });
        let (tx, rx) = mpsc::sync_channel(QUEUE_CAPACITY);
        let writer = Writer {
            file,
            fsync,
            next_seq,
            prev_hash,
            len,
            shared: Arc::clone(&shared),
        };
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

    fn gone(&self) -> LedgerError {
        LedgerError::WriterGone {
            path: self.inner.shared.path.clone(),
        }
    }

    /// Queues a record and returns at once; never waits for the disk.
    ///
    /// Errors: the record is invalid, an earlier write failed, or the queue is full.
    pub fn append(&self, rec: Record) -> Result<(), LedgerError> {
        self.inner.shared.check_failed()?;
        rec.validate()?;
        let cmd = Cmd::Append {
            rec: Box::new(rec),
            ack: None,
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

    /// Appends a record and waits until it is written (and fsync'd when the ledger fsyncs);
    /// returns its `seq`.
    pub fn append_sync(&self, rec: Record) -> Result<u64, LedgerError> {
        self.inner.shared.check_failed()?;
        rec.validate()?;
        let (ack, done) = mpsc::sync_channel(1);
        let cmd = Cmd::Append {
            rec: Box::new(rec),
            ack: Some(ack),
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

    /// Whether a write failed: from then on the ledger accepts nothing and the daemon must
    /// stop serving (it cannot record turns).
    pub fn is_failed(&self) -> bool {
        self.inner.shared.failed.load(Ordering::Acquire)
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

/// The writer thread's state: the only owner of the file.
struct Writer {
    file: File,
    fsync: bool,
    next_seq: u64,
    prev_hash: String,
    /// File length after the last complete record: where a torn write is cut back to.
    len: u64,
    shared: Arc<Shared>,
}

impl Writer {
    fn run(mut self, rx: Receiver<Cmd>) {
        for cmd in rx {
            match cmd {
                Cmd::Append { rec, ack } => {
                    let result = self.shared.check_failed().and_then(|()| self.write(*rec));
                    if let Err(e) = &result {
                        if !self.shared.failed.load(Ordering::Acquire) {
                            tracing::error!(error = %e, "ledger write failed; ledger is now failed closed");
                            self.shared.set_failed(e.to_string());
                        }
                    }
                    if let Some(ack) = ack {
                        // The caller may have given up waiting; nothing to do then.
                        let _ = ack.send(result);
                    }
                }
                Cmd::Flush { ack } => {
                    let result = self.shared.check_failed().and_then(|()| {
                        self.file.sync_data().map_err(|source| LedgerError::Flush {
                            path: self.shared.path.clone(),
                            source,
                        })
                    });
                    if let Err(e) = &result {
                        if !self.shared.failed.load(Ordering::Acquire) {
                            self.shared.set_failed(e.to_string());
                        }
                    }
                    let _ = ack.send(result);
                }
            }
        }
    }

    fn write(&mut self, mut rec: Record) -> Result<u64, LedgerError> {
        let seq = self.next_seq;
        rec.seq = seq;
        rec.prev_hash.clone_from(&self.prev_hash);
        rec.hash.clear();
        if rec.ts.is_empty() {
            rec.ts = rfc3339_now();
        }
        rec.hash = rec.compute_hash()?;
        let mut line =
            serde_json::to_vec(&rec).map_err(|source| LedgerError::Serialize { source })?;
        line.push(b'\n');

        let path = &self.shared.path;
        if let Err(source) = self.file.write_all(&line) {
            // Best effort: cut a partial line off so the file stays a valid chain. The ledger
            // stays failed either way.
            let _ = self.file.set_len(self.len);
            return Err(LedgerError::Write {
                path: path.clone(),
                seq,
                source,
            });
        }
        if self.fsync {
            self.file.sync_data().map_err(|source| LedgerError::Sync {
                path: path.clone(),
                seq,
                source,
            })?;
        }
        self.len += line.len() as u64;
        self.next_seq += 1;
        self.prev_hash = rec.hash;
        self.shared.written.fetch_add(1, Ordering::AcqRel);
        Ok(seq)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    /// A fresh directory under the system temp dir, removed on drop.
    struct TempDir(PathBuf);

    impl TempDir {
        fn new(name: &str) -> Self {
            static N: AtomicU64 = AtomicU64::new(0);
            let dir = std::env::temp_dir().join(format!(
                "haltd-ledger-{}-{}-{name}",
                std::process::id(),
                N.fetch_add(1, Ordering::Relaxed)
            ));
            std::fs::create_dir_all(&dir).expect("create temp dir");
            Self(dir)
        }

        fn file(&self) -> PathBuf {
            self.0.join("fhr.jsonl")
        }
    }

    impl Drop for TempDir {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }

    fn rec(i: u64) -> Record {
        Record {
            kind: if i.is_multiple_of(3) {
                RecordKind::Incident
            } else {
                RecordKind::Turn
            },
            turn_id: Some(format!("turn-{i}")),
            stream_id: Some(format!("s-{i}")),
            mode: Some("stream".to_owned()),
            kernel_gate: "enforcing".to_owned(),
            tokens_emitted: i * 7,
            failure_codes: if i.is_multiple_of(3) {
                vec!["WATCHDOG_TRIP".to_owned()]
            } else {
                vec![]
            },
            halt_latency_ms: Some(i as f64 / 3.0),
            safety_verdict: Some(serde_json::json!({"z": 1, "a": [true, null, 2.5], "m": "é\"\n"})),
            message: Some("line\nbreak \u{2028} and unicode ✓".to_owned()),
            ..Record::default()
        }
    }

    /// Fields added later are left out when unset, so that a record written before them
    /// serialises (and hashes) exactly as it did.
    #[test]
    fn late_fields_are_absent_when_unset() {
        let line = serde_json::to_string(&rec(1)).expect("serialises");
        for key in [
            "conversation",
            "turn_status",
            "upstream",
            "tool_calls",
            "mode_change",
            "detectors",
            "sampling",
            "text",
            "text_truncated",
            "crash",
        ] {
            assert!(!line.contains(&format!("\"{key}\":")), "{key} in {line}");
        }
        // `message` is the last field of every record.
        assert!(line.ends_with("and unicode ✓\"}"), "{line}");
        let mut sampled = rec(1);
        sampled.sampling = Some(serde_json::json!({"rate": 0.05}));
        let line = serde_json::to_string(&sampled).expect("serialises");
        assert!(line.ends_with(r#","sampling":{"rate":0.05}}"#), "{line}");
        let back: Record = serde_json::from_str(&line).expect("parses");
        assert_eq!(back, sampled);
    }

    fn write_n(path: &Path, fsync: bool, n: u64) -> Ledger {
        let l = Ledger::open(path, fsync).expect("open");
        for i in 0..n {
            if i.is_multiple_of(2) {
                l.append(rec(i)).expect("append");
            } else {
                l.append_sync(rec(i)).expect("append_sync");
            }
        }
        l.flush().expect("flush");
        l
    }

    fn lines(path: &Path) -> Vec<String> {
        std::fs::read_to_string(path)
            .expect("read")
            .lines()
            .map(str::to_owned)
            .collect()
    }

    fn write_lines(path: &Path, lines: &[String]) {
        let mut s = lines.join("\n");
        s.push('\n');
        std::fs::write(path, s).expect("write");
    }

    #[test]
    fn write_and_verify() {
        let dir = TempDir::new("write");
        let path = dir.file();
        let l = write_n(&path, false, 50);
        assert_eq!(l.records_written(), 50);
        let report = verify(&path).expect("verify");
        assert!(report.is_intact(), "{report}");
        assert_eq!(report.records, 50);
        assert_eq!(report.to_string(), "ok: 50 records, chain intact");

        let ls = lines(&path);
        assert_eq!(ls.len(), 50);
        let mut prev = GENESIS_HASH.to_owned();
        for (i, line) in ls.iter().enumerate() {
            let r: Record = serde_json::from_str(line).expect("record");
            assert_eq!(r.seq, i as u64);
            assert_eq!(r.prev_hash, prev);
            assert_eq!(r.hash.len(), 64);
            assert_eq!(r.ts.len(), "2026-01-01T00:00:00.000Z".len());
            assert_eq!(r.turn_id.as_deref(), Some(format!("turn-{i}").as_str()));
            assert!(line.starts_with(r#"{"seq":"#), "struct order: {line}");
            prev = r.hash;
        }
    }

    #[test]
    fn fsync_path_and_append_sync_seq() {
        let dir = TempDir::new("fsync");
        let path = dir.file();
        let l = Ledger::open(&path, true).expect("open");
        assert_eq!(l.append_sync(rec(0)).expect("sync"), 0);
        l.append(rec(1)).expect("append");
        assert_eq!(l.append_sync(rec(2)).expect("sync"), 2);
        l.flush().expect("flush");
        assert_eq!(l.records_written(), 3);
        assert!(verify(&path).expect("verify").is_intact());
    }

    #[test]
    fn tampered_field_is_reported() {
        let dir = TempDir::new("tamper");
        let path = dir.file();
        drop(write_n(&path, false, 10));
        let mut ls = lines(&path);
        ls[4] = ls[4].replace("\"tokens_emitted\":28", "\"tokens_emitted\":27");
        write_lines(&path, &ls);
        let report = verify(&path).expect("verify");
        let b = report.broken.clone().expect("broken");
        assert_eq!(
            (b.line, b.seq, b.reason.as_str()),
            (5, Some(4), "hash mismatch")
        );
        assert_eq!(report.records, 4);
        assert_eq!(
            report.to_string(),
            "BROKEN at line 5 (seq 4): hash mismatch (4 records intact before it)"
        );
    }

    #[test]
    fn rehashed_tamper_breaks_the_next_link() {
        let dir = TempDir::new("rehash");
        let path = dir.file();
        drop(write_n(&path, false, 6));
        let mut ls = lines(&path);
        let mut r: Record = serde_json::from_str(&ls[2]).expect("record");
        r.tokens_emitted = 0;
        r.hash = r.compute_hash().expect("hash");
        ls[2] = serde_json::to_string(&r).expect("json");
        write_lines(&path, &ls);
        let b = verify(&path).expect("verify").broken.expect("broken");
        assert_eq!((b.line, b.reason.as_str()), (4, "prev_hash mismatch"));
    }

    #[test]
    fn deleted_line_is_reported() {
        let dir = TempDir::new("delete");
        let path = dir.file();
        drop(write_n(&path, false, 8));
        let mut ls = lines(&path);
        ls.remove(3);
        write_lines(&path, &ls);
        let b = verify(&path).expect("verify").broken.expect("broken");
        assert_eq!(b.line, 4);
        assert_eq!(b.seq, Some(4));
        assert!(b.reason.starts_with("seq gap"), "{}", b.reason);
    }

    #[test]
    fn truncated_last_line_is_reported_and_refused() {
        let dir = TempDir::new("truncate");
        let path = dir.file();
        drop(write_n(&path, false, 5));
        let len = std::fs::metadata(&path).expect("meta").len();
        let f = OpenOptions::new().write(true).open(&path).expect("open");
        f.set_len(len - 40).expect("truncate");
        drop(f);
        let report = verify(&path).expect("verify");
        let b = report.broken.clone().expect("broken");
        assert_eq!(b.line, 5);
        assert!(b.reason.starts_with("truncated line"), "{}", b.reason);
        assert_eq!(report.records, 4);
        match Ledger::open(&path, false) {
            Err(LedgerError::ChainBroken { line: 5, .. }) => {}
            other => panic!("expected ChainBroken at line 5, got {other:?}"),
        }
    }

    #[test]
    fn garbage_and_foreign_lines_are_reported() {
        let dir = TempDir::new("garbage");
        let path = dir.file();
        drop(write_n(&path, false, 3));
        let mut ls = lines(&path);
        ls.push("this is not json".to_owned());
        write_lines(&path, &ls);
        let b = verify(&path).expect("verify").broken.expect("broken");
        assert_eq!(b.line, 4);
        assert!(b.reason.starts_with("not JSON"), "{}", b.reason);

        // Fields smuggled in: at the front the layout check catches it, elsewhere the hash.
        let mut ls = lines(&path);
        ls.pop();
        let orig = ls[2].clone();
        ls[2] = orig.replacen("{\"seq\"", "{\"extra\":1,\"seq\"", 1);
        write_lines(&path, &ls);
        let b = verify(&path).expect("verify").broken.expect("broken");
        assert_eq!(b.line, 3);
        assert!(b.reason.starts_with("non-canonical"), "{}", b.reason);
        ls[2] = format!("{},\"extra\":1}}", orig.trim_end_matches('}'));
        write_lines(&path, &ls);
        let b = verify(&path).expect("verify").broken.expect("broken");
        assert_eq!((b.line, b.reason.as_str()), (3, "hash mismatch"));
    }

    /// Floats that serde_json's default parser does not read back bit-exactly must still
    /// verify: the hash is over the written bytes.
    #[test]
    fn arbitrary_floats_verify() {
        let dir = TempDir::new("floats");
        let path = dir.file();
        let l = Ledger::open(&path, false).expect("open");
        let mut x: u64 = 0x1234_5678_9abc_def0;
        for i in 0..500 {
            x = x
                .wrapping_mul(6_364_136_223_846_793_005)
                .wrapping_add(1_442_695_040_888_963_407);
            let f = f64::from_bits(x);
            let f = if f.is_finite() { f } else { i as f64 };
            l.append(Record {
                halt_latency_ms: Some(f),
                kernel: Some(serde_json::json!({ "v": f, "n": x })),
                ..rec(i)
            })
            .expect("append");
        }
        l.flush().expect("flush");
        let report = verify(&path).expect("verify");
        assert!(report.is_intact(), "{report}");
        assert_eq!(report.records, 500);
    }

    #[test]
    fn reopen_continues_the_chain() {
        let dir = TempDir::new("reopen");
        let path = dir.file();
        drop(write_n(&path, true, 3));
        let l = Ledger::open(&path, true).expect("reopen");
        assert_eq!(l.append_sync(rec(3)).expect("append"), 3);
        l.append(rec(4)).expect("append");
        drop(l); // drains the queue
        let report = verify(&path).expect("verify");
        assert!(report.is_intact(), "{report}");
        assert_eq!(report.records, 5);
    }

    #[test]
    fn second_open_is_locked_out() {
        let dir = TempDir::new("lock");
        let path = dir.file();
        let l = Ledger::open(&path, false).expect("open");
        assert!(matches!(
            Ledger::open(&path, false),
            Err(LedgerError::Locked { .. })
        ));
        drop(l);
        Ledger::open(&path, false).expect("reopen after close");
    }

    #[test]
    fn invalid_records_are_rejected() {
        let dir = TempDir::new("invalid");
        let l = Ledger::open(&dir.file(), false).expect("open");
        let no_gate = Record::default();
        assert!(matches!(
            l.append(no_gate),
            Err(LedgerError::InvalidRecord {
                field: "kernel_gate",
                ..
            })
        ));
        let bad_mode = Record {
            mode: Some("bulk".to_owned()),
            ..rec(1)
        };
        assert!(matches!(
            l.append_sync(bad_mode),
            Err(LedgerError::InvalidRecord { field: "mode", .. })
        ));
        assert_eq!(l.append_sync(rec(0)).expect("valid"), 0);
    }

    #[test]
    fn concurrent_appends_keep_one_chain() {
        let dir = TempDir::new("concurrent");
        let path = dir.file();
        let l = Ledger::open(&path, false).expect("open");
        let threads: Vec<_> = (0..4)
            .map(|t| {
                let l = l.clone();
                std::thread::spawn(move || {
                    for i in 0..25 {
                        l.append(rec(t * 100 + i)).expect("append");
                    }
                })
            })
            .collect();
        for t in threads {
            t.join().expect("join");
        }
        l.flush().expect("flush");
        assert_eq!(l.records_written(), 100);
        let report = verify(&path).expect("verify");
        assert!(report.is_intact(), "{report}");
        assert_eq!(report.records, 100);
    }

    #[test]
    fn write_failure_surfaces_and_sticks() {
        // /dev/full fails every write with ENOSPC: the disk-full case.
        let Ok(file) = OpenOptions::new().write(true).open("/dev/full") else {
            return;
        };
        let l = Ledger::start(
            Path::new("/dev/full"),
            file,
            true,
            0,
            GENESIS_HASH.to_owned(),
            0,
        )
        .expect("start");
        match l.append_sync(rec(0)) {
            Err(LedgerError::Write { seq: 0, .. }) => {}
            other => panic!("expected Write error, got {other:?}"),
        }
        assert!(matches!(
            l.append(rec(1)),
            Err(LedgerError::WriterFailed { .. })
        ));
        assert!(matches!(l.flush(), Err(LedgerError::WriterFailed { .. })));
        assert_eq!(l.records_written(), 0);

        // A queued (fire-and-forget) append that fails also poisons the ledger.
        let file = OpenOptions::new()
            .write(true)
            .open("/dev/full")
            .expect("reopen");
        let l = Ledger::start(
            Path::new("/dev/full"),
            file,
            false,
            0,
            GENESIS_HASH.to_owned(),
            0,
        )
        .expect("start");
        l.append(rec(0)).expect("queued");
        let mut failed = false;
        for _ in 0..200 {
            if l.append(rec(1)).is_err() {
                failed = true;
                break;
            }
            std::thread::sleep(Duration::from_millis(5));
        }
        assert!(
            failed,
            "a failed background write must surface on a later append"
        );
    }

    #[test]
    fn open_error_names_the_path() {
        let e = Ledger::open(Path::new("/nonexistent-dir/x/fhr.jsonl"), true).expect_err("fails");
        let msg = e.to_string();
        assert!(
            msg.contains("/nonexistent-dir/x/fhr.jsonl") && msg.contains("cannot open"),
            "{msg}"
        );
    }

    #[test]
    fn ledger_is_send_sync_clone() {
        fn check<T: Send + Sync + Clone>() {}
        check::<Ledger>();
    }
}
