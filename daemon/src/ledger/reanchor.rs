//! Re-anchoring: an operator's explicit acceptance of a ledger whose head is gone
//! (`haltctl ledger reanchor`).
//!
//! Without its head a chain cannot show records cut off its end ([`super::head`]), so a start
//! refuses a ledger that has records but no head ([`LedgerError::HeadMissing`], exit 3). Only
//! the operator can know why the head is gone (the ledger moved to another path, the state
//! directory was restored without it, or someone deleted it to hide a truncation). Re-anchoring
//! takes the chain as it stands, and says so in the chain itself: its first record is an
//! `admin` record (`action: "ledger_reanchor"`) naming the operator and where the chain stood
//! (the last record's `seq` and `hash`, the head that was missing); only then is a new head
//! written, so a crash before that record leaves the head missing still.
//!
//! It takes only that case: a ledger whose head is present (valid or not) or that holds no
//! record is refused ([`LedgerError::NotReanchored`]), and so is a chain that does not verify
//! under the key ([`LedgerError::ChainBroken`]) or a ledger another process holds
//! ([`LedgerError::Locked`]: stop haltd first).

use std::path::PathBuf;

use serde_json::json;

use super::{
    head::{Head, HeadFile},
    recovery_record, verify, Ledger, LedgerConfig, LedgerError, LedgerKey, MissingHead, Record,
    RecordKind, TornTail,
};

/// Where a re-anchored chain stood.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Anchor {
    /// The head file that was missing (written anew after the re-anchor record).
    pub head: PathBuf,
    /// The records in the file.
    pub records: u64,
    /// The end of the chain: the next `seq` and the last record's hash.
    pub end: Head,
}

/// What [`Ledger::reanchor`] did.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Reanchored {
    pub anchor: Anchor,
    /// The re-anchor record's `seq`.
    pub seq: u64,
    /// A torn last line cut off on the way (recorded after the re-anchor record).
    pub torn: Option<TornTail>,
}

/// Whether the ledger is one to re-anchor: records, and no head file (or an empty one).
pub(super) fn check(
    cfg: &LedgerConfig<'_>,
    scan: &verify::Scan,
    head: Option<&Head>,
    head_file: &HeadFile,
) -> Result<Anchor, LedgerError> {
    let refuse = |reason: String| {
        Err(LedgerError::NotReanchored {
            path: cfg.path.to_owned(),
            reason,
        })
    };
    let shown = head_file.path().display();
    match head {
        Some(h) => refuse(format!(
            "its head {shown} is present (next seq {}): there is nothing to re-anchor \
             (`haltctl ledger verify` checks the chain against it)",
            h.next_seq
        )),
        None if !head_file.is_new() => refuse(format!(
            "its head {shown} exists but holds no valid slot under this ledger key: that is \
             evidence, not a missing head. Keep a copy and move it aside first if you mean to \
             re-anchor the chain"
        )),
        None if scan.records == 0 => refuse(
            "it holds no record: there is nothing to re-anchor, haltd starts on it as it is"
                .to_owned(),
        ),
        None => Ok(Anchor {
            head: head_file.path().to_owned(),
            records: scan.records,
            end: scan.end(),
        }),
    }
}

impl Ledger {
    /// Re-anchors the ledger `cfg` names (the module doc), its record naming `operator` and
    /// `actor` (who ran it, as the caller knows them). The ledger key must already be in the
    /// state directory: under a new one the chain could not verify.
    pub fn reanchor(
        cfg: &LedgerConfig<'_>,
        operator: &str,
        actor: serde_json::Value,
    ) -> Result<Reanchored, LedgerError> {
        LedgerKey::read(cfg.state_dir).map_err(|e| LedgerError::Key {
            reason: format!(
                "{e} (re-anchoring needs the key the ledger was written under, in --state-dir)"
            ),
        })?;
        let opened = Ledger::open_with(cfg, MissingHead::Reanchor)?;
        let Some(anchor) = opened.anchor else {
            return Err(LedgerError::NotReanchored {
                path: cfg.path.to_owned(),
                reason: "the ledger opened without an anchor".to_owned(),
            });
        };
        let seq = opened
            .ledger
            .append_sync(record(cfg, &anchor, operator, actor))?;
        if let Some(t) = &opened.torn {
            opened
                .ledger
                .append_sync(recovery_record(cfg.path, t, cfg.kernel_gate))?;
        }
        opened.ledger.flush()?;
        tracing::warn!(path = %cfg.path.display(), operator, seq, from_seq = anchor.end.next_seq.saturating_sub(1), "ledger re-anchored by the operator: its chain is taken as it stands");
        Ok(Reanchored {
            anchor,
            seq,
            torn: opened.torn,
        })
    }
}

/// The re-anchor record (docs/fhr-schema.md §1, `admin`).
fn record(
    cfg: &LedgerConfig<'_>,
    anchor: &Anchor,
    operator: &str,
    actor: serde_json::Value,
) -> Record {
    let last_seq = anchor.end.next_seq.checked_sub(1);
    Record {
        kind: RecordKind::Admin,
        kernel_gate: cfg.kernel_gate.to_owned(),
        admin: Some(json!({
            "action": "ledger_reanchor",
            "actor": actor,
            "reanchor": {
                "head": anchor.head.display().to_string(),
                "records": anchor.records,
                "from_seq": last_seq,
                "from_hash": anchor.end.hash,
            },
        })),
        message: Some(format!(
            "ledger re-anchored by the operator {operator}: its head {} was missing; the chain \
             is taken as it stands, {} records ending at seq {} (hash {}); records cut off its \
             end before this record cannot be detected",
            anchor.head.display(),
            anchor.records,
            last_seq.map_or_else(|| "-".to_owned(), |s| s.to_string()),
            anchor.end.hash,
        )),
        ..Record::default()
    }
}

#[cfg(test)]
mod tests {
    use std::path::Path;

    use super::super::{
        head::head_path,
        testing::{open, state_dir, verify},
        INCIDENTS_FILE,
    };
    use super::*;

    /// A directory of its own under the system temp dir, removed on drop.
    struct Dir(PathBuf);

    impl Dir {
        fn new(name: &str) -> Self {
            let dir =
                std::env::temp_dir().join(format!("haltd-reanchor-{}-{name}", std::process::id()));
            let _ = std::fs::remove_dir_all(&dir);
            std::fs::create_dir_all(&dir).expect("dir");
            Dir(dir)
        }
    }

    impl Drop for Dir {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }

    /// Re-anchors `path` (its state directory beside it) on `operator`'s word.
    fn reanchor(path: &Path, operator: &str) -> Result<Reanchored, LedgerError> {
        let state = state_dir(path);
        let actor = serde_json::json!({"transport": "local", "operator": operator});
        Ledger::reanchor(&cfg(path, &state), operator, actor)
    }

    fn cfg<'a>(path: &'a Path, state: &'a Path) -> LedgerConfig<'a> {
        LedgerConfig {
            path,
            state_dir: state,
            fsync: false,
            kernel_gate: "disabled",
            slow_write: None,
            fail_writes_from: None,
        }
    }

    fn lifecycle(n: u64) -> Record {
        Record {
            kind: RecordKind::Lifecycle,
            kernel_gate: "enforcing".to_owned(),
            message: Some(format!("record {n}")),
            ..Record::default()
        }
    }

    /// A ledger of `n` records, its head then deleted; returns the head's path.
    fn headless(path: &Path, n: u64) -> PathBuf {
        let ledger = open(path, false).expect("open");
        for i in 0..n {
            ledger.append_sync(lifecycle(i)).expect("append");
        }
        drop(ledger);
        let (head, _) = head_path(&state_dir(path), path).expect("head path");
        std::fs::remove_file(&head).expect("delete the head");
        head
    }

    #[test]
    fn a_missing_head_refuses_the_start_and_creates_nothing() {
        let dir = Dir::new("refused");
        let path = dir.0.join("fhr.jsonl");
        let head = headless(&path, 3);
        let err = open(&path, false).expect_err("a ledger without its head opened");
        assert!(
            matches!(err, LedgerError::HeadMissing { records: 3, .. }),
            "{err}"
        );
        assert!(err.is_tampering(), "exit 3");
        let text = err.to_string();
        assert!(
            text.contains("haltctl ledger reanchor --operator NAME"),
            "{text}"
        );
        assert!(!head.exists(), "the refused start left a head file");
        let incidents =
            std::fs::read_to_string(state_dir(&path).join(INCIDENTS_FILE)).expect("incidents");
        assert!(incidents.contains("LEDGER_HEAD_MISSING"), "{incidents}");
    }

    #[test]
    fn reanchoring_records_the_operator_then_the_head() {
        let dir = Dir::new("done");
        let path = dir.0.join("fhr.jsonl");
        let head = headless(&path, 3);
        let done = reanchor(&path, "alice").expect("reanchor");
        assert_eq!((done.seq, done.anchor.records), (3, 3));
        assert_eq!(done.anchor.head, head);
        assert!(head.exists(), "no new head");
        let report = verify(&path);
        assert!(report.is_intact(), "{report}");
        let last = std::fs::read_to_string(&path).expect("read");
        let rec: serde_json::Value =
            serde_json::from_str(last.lines().last().expect("a record")).expect("json");
        assert_eq!(rec["admin"]["action"], "ledger_reanchor");
        assert_eq!(rec["admin"]["actor"]["operator"], "alice");
        assert_eq!(rec["admin"]["reanchor"]["from_seq"], 2);
        assert_eq!(rec["admin"]["reanchor"]["from_hash"], rec["prev_hash"]);
        // Now it opens, and a second re-anchor finds nothing to do.
        drop(open(&path, false).expect("opens once re-anchored"));
        let again = reanchor(&path, "alice");
        assert!(
            matches!(again, Err(LedgerError::NotReanchored { .. })),
            "{again:?}"
        );
    }

    #[test]
    fn only_a_missing_head_is_reanchored() {
        let dir = Dir::new("refusals");
        // No record: nothing to re-anchor.
        let empty = dir.0.join("empty.jsonl");
        drop(open(&empty, false).expect("open"));
        let (head, _) = head_path(&state_dir(&empty), &empty).expect("head path");
        std::fs::remove_file(&head).expect("delete the head");
        let r = reanchor(&empty, "bob");
        assert!(matches!(r, Err(LedgerError::NotReanchored { .. })), "{r:?}");
        // A head holding no valid slot is evidence, not a missing head.
        let path = dir.0.join("fhr.jsonl");
        let head = headless(&path, 2);
        std::fs::write(&head, b"garbage").expect("write");
        let r = reanchor(&path, "bob");
        let Err(LedgerError::NotReanchored { reason, .. }) = r else {
            panic!("{r:?}");
        };
        assert!(reason.contains("no valid slot"), "{reason}");
        // A ledger haltd holds: locked.
        std::fs::remove_file(&head).expect("delete");
        let held = reanchor(&path, "bob").expect("re");
        assert_eq!(held.seq, 2);
        let running = open(&path, false).expect("open");
        let r = reanchor(&path, "bob");
        assert!(matches!(r, Err(LedgerError::Locked { .. })), "{r:?}");
        drop(running);
    }

    #[test]
    fn a_torn_tail_is_cut_and_recorded_after_the_reanchor() {
        let dir = Dir::new("torn");
        let path = dir.0.join("fhr.jsonl");
        headless(&path, 2);
        let mut f = std::fs::OpenOptions::new()
            .append(true)
            .open(&path)
            .expect("open");
        std::io::Write::write_all(&mut f, b"{\"seq\":2,\"prev").expect("tear");
        let done = reanchor(&path, "carol").expect("re");
        assert!(done.torn.is_some());
        let text = std::fs::read_to_string(&path).expect("read");
        let kinds: Vec<serde_json::Value> = text
            .lines()
            .map(|l| serde_json::from_str::<serde_json::Value>(l).expect("json"))
            .collect();
        assert_eq!(kinds.len(), 4);
        assert_eq!(kinds[2]["admin"]["action"], "ledger_reanchor");
        assert!(kinds[3]["recovery"].is_object(), "{}", kinds[3]);
        assert!(verify(&path).is_intact());
    }
}
