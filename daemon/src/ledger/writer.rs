//! The ledger's writer thread: the only owner of the file and the head. It follows the
//! lifecycle of the module doc for every record: write, fsync, answer whoever waits, then
//! write and fsync the head.

use std::{
    fs::File,
    io::Write,
    os::unix::fs::MetadataExt,
    sync::{
        atomic::Ordering,
        mpsc::{Receiver, SyncSender},
        Arc,
    },
};

use super::{
    head::{Head, HeadFile},
    key::LedgerKey,
    lock, open_segment, sync_dir, LedgerError, Record, Shared, Written,
};
use crate::clock::rfc3339_now;

/// Who waits for a record.
pub(super) enum Ack {
    None,
    Sync(SyncSender<Result<u64, LedgerError>>),
    /// Waits, as `Sync`, for the record's seq and hash.
    SyncWritten(SyncSender<Result<Written, LedgerError>>),
    Then(Box<dyn FnOnce(Result<u64, LedgerError>) + Send>),
    /// Told the record's seq and hash (what a store that follows the ledger links to).
    Linked(Box<dyn FnOnce(Result<Written, LedgerError>) + Send>),
}

impl Ack {
    /// `hash`: the record's own, when `result` is its seq.
    fn answer(self, result: Result<u64, LedgerError>, hash: &str) {
        match self {
            Ack::None => {}
            // The caller may have given up waiting; nothing to do then.
            Ack::Sync(tx) => {
                let _ = tx.send(result);
            }
            Ack::SyncWritten(tx) => {
                let _ = tx.send(result.map(|seq| Written {
                    seq,
                    hash: hash.to_owned(),
                }));
            }
            Ack::Then(f) => f(result),
            Ack::Linked(f) => f(result.map(|seq| Written {
                seq,
                hash: hash.to_owned(),
            })),
        }
    }
}

/// Work for the writer thread.
pub(super) enum Cmd {
    Append {
        rec: Box<Record>,
        ack: Ack,
    },
    Flush {
        ack: SyncSender<Result<(), LedgerError>>,
    },
    Reopen {
        rec: Box<Record>,
        ack: SyncSender<Result<Option<Written>, LedgerError>>,
    },
}

/// The writer thread's state.
pub(super) struct Writer {
    file: File,
    fsync: bool,
    end: Head,
    /// File length after the last complete record: where a torn write is cut back to.
    len: u64,
    head: HeadFile,
    key: LedgerKey,
    shared: Option<Arc<Shared>>,
    /// Test-only fault: a pause after every record's write ([`super::LedgerConfig`]).
    slow_write: Option<std::time::Duration>,
    /// Test-only fault: records written so far by this process, and from which one on every
    /// write fails ([`super::LedgerConfig`]).
    writes: u64,
    fail_writes_from: Option<u64>,
}

impl Writer {
    pub(super) fn new(
        file: File,
        fsync: bool,
        end: Head,
        len: u64,
        head: HeadFile,
        key: LedgerKey,
    ) -> Self {
        Writer {
            file,
            fsync,
            end,
            len,
            head,
            key,
            shared: None,
            slow_write: None,
            writes: 0,
            fail_writes_from: None,
        }
    }

    pub(super) fn with_slow_write(mut self, slow_write: Option<std::time::Duration>) -> Self {
        self.slow_write = slow_write;
        self
    }

    pub(super) fn with_failing_writes(mut self, from: Option<u64>) -> Self {
        self.fail_writes_from = from;
        self
    }

    pub(super) fn with_shared(mut self, shared: Arc<Shared>) -> Self {
        self.shared = Some(shared);
        self
    }

    fn shared(&self) -> &Shared {
        self.shared
            .as_deref()
            .expect("the writer runs with its shared state")
    }

    /// Marks the ledger failed on the first error.
    fn fail_on<T>(&self, result: &Result<T, LedgerError>) {
        if let Err(e) = result {
            if !self.shared().failed.load(Ordering::Acquire) {
                tracing::error!(error = %e, "ledger write failed; ledger is now failed closed");
                self.shared().set_failed(e.to_string());
            }
        }
    }

    /// Runs one command's work unless the ledger already failed, and fails it on an error.
    fn guarded<T>(
        &mut self,
        work: impl FnOnce(&mut Self) -> Result<T, LedgerError>,
    ) -> Result<T, LedgerError> {
        let result = self.shared().check_failed().and_then(|()| work(self));
        self.fail_on(&result);
        result
    }

    pub(super) fn run(mut self, rx: Receiver<Cmd>) {
        for cmd in rx {
            match cmd {
                Cmd::Append { rec, ack } => {
                    let result = self.guarded(|w| w.write(*rec));
                    let ok = result.is_ok();
                    ack.answer(result, &self.end.hash);
                    if ok {
                        let head = self.write_head();
                        self.fail_on(&head);
                    }
                }
                Cmd::Flush { ack } => {
                    let result = self.guarded(|w| {
                        w.file.sync_data().map_err(|source| LedgerError::Flush {
                            path: w.shared().path.clone(),
                            source,
                        })
                    });
                    let _ = ack.send(result);
                }
                Cmd::Reopen { rec, ack } => {
                    let result = self.guarded(|w| w.reopen(*rec));
                    let _ = ack.send(result);
                }
            }
        }
    }

    /// Step 1 of the lifecycle: the record, written and fsync'd.
    fn write(&mut self, mut rec: Record) -> Result<u64, LedgerError> {
        let seq = self.end.next_seq;
        rec.seq = seq;
        rec.prev_hash.clone_from(&self.end.hash);
        rec.hash.clear();
        if rec.ts.is_empty() {
            rec.ts = rfc3339_now();
        }
        if !self.fsync {
            rec.no_fsync = Some(true);
        }
        if self.len == 0 {
            // The segment's first line: it names the key its chain is under.
            rec.ledger_key_id = Some(self.key.id());
        }
        rec.hash = rec.compute_hash(&self.key)?;
        let mut line =
            serde_json::to_vec(&rec).map_err(|source| LedgerError::Serialize { source })?;
        line.push(b'\n');

        let path = &self.shared.as_ref().expect("shared").path;
        self.writes += 1;
        let written = if self.fail_writes_from.is_some_and(|n| self.writes >= n) {
            Err(std::io::Error::from_raw_os_error(libc::EIO))
        } else {
            self.file.write_all(&line)
        };
        if let Err(source) = written {
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
        if let Some(pause) = self.slow_write {
            std::thread::sleep(pause);
        }
        self.len += line.len() as u64;
        self.end = Head {
            next_seq: seq + 1,
            hash: rec.hash,
        };
        self.shared().written.fetch_add(1, Ordering::AcqRel);
        Ok(seq)
    }

    /// Step 2: the head, after the record is on disk and answered for.
    fn write_head(&mut self) -> Result<(), LedgerError> {
        self.head
            .write(&self.end, self.fsync)
            .map_err(|source| LedgerError::Head {
                path: self.head.path().to_owned(),
                source,
            })
    }

    /// Rotation: a new, empty file at the ledger's path becomes the current segment, its
    /// first record linked to the head.
    fn reopen(&mut self, mut rec: Record) -> Result<Option<Written>, LedgerError> {
        let path = self.shared().path.clone();
        let open_err = |source| LedgerError::Open {
            path: path.clone(),
            source,
        };
        let file = open_segment(&path)?;
        let (old, new) = (
            self.file.metadata().map_err(open_err)?,
            file.metadata().map_err(open_err)?,
        );
        if (old.dev(), old.ino()) == (new.dev(), new.ino()) {
            return Ok(None);
        }
        if new.len() != 0 {
            return Err(LedgerError::Tampered {
                path,
                reason: "the new segment is not empty: haltd continues only its own chain"
                    .to_owned(),
            });
        }
        lock(&file, &path)?;
        if self.fsync {
            sync_dir(&path).map_err(open_err)?;
        }
        self.file = file;
        self.len = 0;
        rec.segment = Some(serde_json::json!({
            "continues_seq": self.end.next_seq.checked_sub(1),
            "continues_hash": self.end.hash,
        }));
        let seq = self.write(rec)?;
        self.write_head()?;
        Ok(Some(Written {
            seq,
            hash: self.end.hash.clone(),
        }))
    }
}
