//! The flight recorder (FHR, docs/fhr-schema.md): an append-only, hash-linked JSON Lines ledger.
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

use std::fs::{File, OpenOptions, TryLockError};
use std::io::{BufReader, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc::{self, Receiver, SyncSender, TrySendError};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;

use crate::clock::rfc3339_now;

mod error;
mod record;
mod verify;

pub use error::LedgerError;
pub use record::{Record, RecordKind, GENESIS_HASH};
use verify::scan;
pub use verify::{verify, ChainBreak, VerifyReport};

/// Records [`Ledger::append`] may queue ahead of the writer before it reports
/// [`LedgerError::QueueFull`] (bounded so that a stalled disk shows up as an error, not as
/// unbounded memory growth).
pub const QUEUE_CAPACITY: usize = 16_384;

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
