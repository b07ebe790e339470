//! Hand-over (issue 38): a new haltd process takes over from a running one, each writing its
//! own segment (its own `--ledger` file) under one state directory, so one ledger key.
//!
//! The old process (A) writes its hand-over record with [`Ledger::append_sync_written`], the
//! record's `handover` field naming its successor (`{"to_pid", "to_segment"}`, set by the
//! caller), and learns its `seq` N and `hash` H; it goes on writing its own file while it drains
//! (records N+1..M). The successor (B) opens its own file with [`Ledger::open_linked`] on that
//! [`SegmentLink`]: a fresh segment whose chain starts at N+1 from H, a fork of A's chain at its
//! hand-over record. Its first record, which the ledger writes itself, is a `lifecycle` record
//! with `handover: {"from_pid", "from_segment", "from_seq": N}` (and the segment's usual
//! `ledger_key_id`). [`super::verify_series`] takes A's file then B's, accepts the fork at a
//! record that carries `handover`, and reports it (docs/fhr-schema.md §3, "Hand-over").
//!
//! B's path may hold an earlier life of its own (green handed over to blue, which now hands
//! back). That file is moved aside to `<path>.<unix ms>`, its head re-keyed to the moved path so
//! that `haltctl ledger verify` still checks its end, each step durable before the next: the
//! head is written for the new path, the file linked to the new path and unlinked from the old,
//! then the old head removed. A crash before the last step leaves the old path with a head but
//! no file, which looks like a deleted ledger; the next hand-over finds the moved file beside it
//! holding the same head, and finishes the move. A file with records but no head is not moved:
//! that would bury the missing head.
//!
//! B's head is written at the start of its chain (N+1, H) before the first record: a crash
//! between the two leaves an empty file with that head, which the next `open_linked` on the
//! same link takes up; a crash after the record leaves the file one record past its head, which
//! any open catches up.

use std::{
    fs::{self, File},
    io,
    path::{Path, PathBuf},
    time::{SystemTime, UNIX_EPOCH},
};

use serde_json::json;

use super::{
    head::{self, Head, HeadFile},
    incident, lock, open_segment, sync_dir,
    writer::Writer,
    Ledger, LedgerConfig, LedgerError, LedgerKey, Record, RecordKind, Written, GENESIS_HASH,
};

/// The record of another segment that a fresh segment continues: the old process's hand-over
/// record, as [`Ledger::append_sync_written`] answered it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SegmentLink {
    /// The old process's ledger file.
    pub segment: PathBuf,
    /// Its hand-over record's `seq`.
    pub seq: u64,
    /// Its hand-over record's `hash`.
    pub hash: String,
    /// The old process's pid.
    pub from_pid: u32,
}

impl SegmentLink {
    /// Where the fresh segment's chain starts: the next `seq` after the link, and its hash.
    fn start(&self, path: &Path) -> Result<Head, LedgerError> {
        let refuse = |reason: String| LedgerError::Handover {
            path: path.to_owned(),
            reason,
        };
        let hex =
            |h: &str| h.len() == 64 && h.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'));
        if !hex(&self.hash) || self.hash == GENESIS_HASH {
            return Err(refuse(format!(
                "the link's hash {:?} is not a record's (64 lowercase hex digits, not the genesis hash)",
                self.hash
            )));
        }
        let same = |p: &Path| head::head_path(Path::new("."), p).ok().map(|(_, id)| id);
        if same(path).is_some() && same(path) == same(&self.segment) {
            return Err(refuse(format!(
                "it is the segment it would continue ({}): a hand-over segment is another file",
                self.segment.display()
            )));
        }
        let next_seq = self
            .seq
            .checked_add(1)
            .ok_or_else(|| refuse(format!("the link's seq {} has no successor", self.seq)))?;
        Ok(Head {
            next_seq,
            hash: self.hash.clone(),
        })
    }
}

impl Ledger {
    /// Opens `cfg.path` as a fresh segment continuing `link` (the module doc): an earlier file
    /// there is moved aside with its head, the new head starts after the link, and the first
    /// record, a `lifecycle` record with `handover`, is written (and fsync'd, when the ledger
    /// fsyncs) before this returns its seq and hash. The ledger key must already be in the state
    /// directory: the old process's.
    ///
    /// Refuses an invalid link ([`LedgerError::Handover`]), an earlier file there that another
    /// process holds ([`LedgerError::Locked`]) or whose head is missing, and an empty path whose
    /// head says it held records ([`LedgerError::Tampered`], recorded as an incident).
    pub fn open_linked(
        cfg: &LedgerConfig<'_>,
        link: &SegmentLink,
    ) -> Result<(Ledger, Written), LedgerError> {
        let path = cfg.path;
        let start = link.start(path)?;
        let key = LedgerKey::read(cfg.state_dir).map_err(|e| LedgerError::Key {
            reason: format!(
                "{e} (a hand-over segment continues the old process's chain, under the key in \
                 --state-dir)"
            ),
        })?;
        let moved = move_aside(cfg, &key)?;
        finish_interrupted_move(cfg, &key)?;
        let open_err = |source| LedgerError::Open {
            path: path.to_owned(),
            source,
        };
        let file = open_segment(path)?;
        lock(&file, path)?;
        if file.metadata().map_err(open_err)?.len() != 0 {
            return Err(LedgerError::Handover {
                path: path.to_owned(),
                reason: "another process wrote to the file while the segment was set up".to_owned(),
            });
        }
        let head_err = |source| LedgerError::Head {
            path: cfg.state_dir.to_owned(),
            source,
        };
        let (mut head_file, head) = HeadFile::open(cfg.state_dir, path, &key).map_err(head_err)?;
        check_fresh_head(cfg, &start, head, &head_file)?;
        head_file.write(&start, cfg.fsync).map_err(head_err)?;
        if cfg.fsync {
            sync_dir(path).map_err(open_err)?;
        }
        let writer = Writer::new(file, cfg.fsync, start, 0, head_file, key)
            .with_slow_write(cfg.slow_write)
            .with_failing_writes(cfg.fail_writes_from);
        let ledger = Self::start(path, writer)?;
        let first = ledger.append_sync_written(first_record(cfg, link, moved.as_deref()))?;
        tracing::info!(path = %path.display(), from = %link.segment.display(), from_seq = link.seq, seq = first.seq, "ledger opened as a hand-over segment");
        Ok((ledger, first))
    }
}

/// Moves a non-empty file at `cfg.path` (an earlier life of this instance) aside to
/// `<path>.<unix ms>`, its head re-keyed along (the module doc); returns where it went.
fn move_aside(cfg: &LedgerConfig<'_>, key: &LedgerKey) -> Result<Option<PathBuf>, LedgerError> {
    let path = cfg.path;
    let io_err = |source| LedgerError::Open {
        path: path.to_owned(),
        source,
    };
    let old = match File::open(path) {
        Ok(f) => f,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(io_err(e)),
    };
    if old.metadata().map_err(io_err)?.len() == 0 {
        return Ok(None);
    }
    // Held until the move is done: no haltd writes the file meanwhile.
    lock(&old, path)?;
    let ms = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis());
    let mut aside = path.as_os_str().to_owned();
    aside.push(format!(".{ms}"));
    let aside = PathBuf::from(aside);
    let refuse = |reason: String| LedgerError::Handover {
        path: path.to_owned(),
        reason,
    };
    let (old_head, _) = head::head_path(cfg.state_dir, path).map_err(io_err)?;
    let (aside_head, _) = head::head_path(cfg.state_dir, &aside).map_err(io_err)?;
    if let Some(taken) = [&aside, &aside_head]
        .into_iter()
        .find(|p| p.symlink_metadata().is_ok())
    {
        return Err(refuse(format!(
            "the earlier file at this path cannot be moved aside to {}: {} exists",
            aside.display(),
            taken.display()
        )));
    }
    let head_err = |source| LedgerError::Head {
        path: old_head.clone(),
        source,
    };
    if head::rekey(cfg.state_dir, path, &aside, key, cfg.fsync)
        .map_err(head_err)?
        .is_none()
    {
        let err = LedgerError::Tampered {
            path: path.to_owned(),
            reason: format!(
                "the earlier file at this path holds records, but its head {} is missing or \
                 holds no valid slot: moving the file aside would bury that (check it with \
                 `haltctl ledger verify`, re-anchor it if you know why, then hand over again)",
                old_head.display()
            ),
        };
        return Err(incident(cfg.state_dir, err));
    }
    let sync = |p: &Path| if cfg.fsync { sync_dir(p) } else { Ok(()) };
    sync(&old_head).map_err(head_err)?;
    // A link, not a rename: it never replaces a file that appeared meanwhile.
    fs::hard_link(path, &aside)
        .and_then(|()| fs::remove_file(path))
        .and_then(|()| sync(path))
        .map_err(|e| refuse(format!("moving it aside to {}: {e}", aside.display())))?;
    fs::remove_file(&old_head)
        .and_then(|()| sync(&old_head))
        .map_err(head_err)?;
    tracing::warn!(path = %path.display(), to = %aside.display(), "hand-over: the earlier ledger file at this path was moved aside, with its head");
    Ok(Some(aside))
}

/// An empty path whose head says it held records, beside a moved-aside file (`<path>.<digits>`)
/// holding the same head: a move that stopped before the old head was removed. Removes it.
fn finish_interrupted_move(cfg: &LedgerConfig<'_>, key: &LedgerKey) -> Result<(), LedgerError> {
    let path = cfg.path;
    let head_err = |source| LedgerError::Head {
        path: cfg.state_dir.to_owned(),
        source,
    };
    let Some(stale) = head::read_head(cfg.state_dir, path, key).map_err(head_err)? else {
        return Ok(());
    };
    let (Some(name), Some(dir)) = (path.file_name().and_then(|n| n.to_str()), path.parent()) else {
        return Ok(());
    };
    let dir = if dir.as_os_str().is_empty() {
        Path::new(".")
    } else {
        dir
    };
    let listed = fs::read_dir(dir).map_err(|source| LedgerError::Open {
        path: dir.to_owned(),
        source,
    })?;
    let moved = listed.flatten().find(|e| {
        let n = e.file_name();
        let digits = n
            .to_str()
            .and_then(|n| n.strip_prefix(name))
            .and_then(|n| n.strip_prefix('.'));
        digits.is_some_and(|d| !d.is_empty() && d.bytes().all(|b| b.is_ascii_digit()))
            && head::read_head(cfg.state_dir, &e.path(), key)
                .ok()
                .flatten()
                == Some(stale.clone())
    });
    let Some(moved) = moved else {
        return Ok(());
    };
    let (old_head, _) = head::head_path(cfg.state_dir, path).map_err(head_err)?;
    fs::remove_file(&old_head)
        .and_then(|()| {
            if cfg.fsync {
                sync_dir(&old_head)
            } else {
                Ok(())
            }
        })
        .map_err(head_err)?;
    tracing::warn!(path = %path.display(), moved = %moved.path().display(), "hand-over: finished moving the earlier ledger file aside (an earlier hand-over stopped before removing its old head)");
    Ok(())
}

/// The head of the path the fresh segment goes to: none, the genesis head (an empty ledger), or
/// the start of this very chain (an earlier `open_linked` stopped before its first record).
/// Anything else is a head whose file is gone: tampering.
fn check_fresh_head(
    cfg: &LedgerConfig<'_>,
    start: &Head,
    head: Option<Head>,
    head_file: &HeadFile,
) -> Result<(), LedgerError> {
    let reason = match head {
        None if head_file.is_new() => return Ok(()),
        Some(h) if h == Head::genesis() || h == *start => return Ok(()),
        None => format!(
            "its head {} holds no valid slot",
            head_file.path().display()
        ),
        Some(h) => format!(
            "the file holds no record, but its head {} says its chain ended before seq {} \
             (records cut off or the file deleted; a file moved aside by a hand-over takes its \
             head along)",
            head_file.path().display(),
            h.next_seq
        ),
    };
    let err = LedgerError::Tampered {
        path: cfg.path.to_owned(),
        reason,
    };
    Err(incident(cfg.state_dir, err))
}

/// The fresh segment's first record (docs/fhr-schema.md §3, "Hand-over").
fn first_record(cfg: &LedgerConfig<'_>, link: &SegmentLink, moved: Option<&Path>) -> Record {
    let mut handover = json!({
        "from_pid": link.from_pid,
        "from_segment": link.segment.display().to_string(),
        "from_seq": link.seq,
    });
    let mut message = format!(
        "hand-over: this segment continues {} from its record {} (pid {}'s hand-over)",
        link.segment.display(),
        link.seq,
        link.from_pid
    );
    if let Some(m) = moved {
        handover["moved_aside"] = json!(m.display().to_string());
        message.push_str(&format!(
            "; the earlier file at this path was moved aside to {}, with its head",
            m.display()
        ));
    }
    Record {
        kind: RecordKind::Lifecycle,
        kernel_gate: cfg.kernel_gate.to_owned(),
        handover: Some(handover),
        message: Some(message),
        ..Record::default()
    }
}

#[cfg(test)]
mod tests;
