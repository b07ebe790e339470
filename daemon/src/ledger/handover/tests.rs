//! The hand-over's unit tests: a fresh segment linked to another process's hand-over record,
//! the series that verifies across the fork, and an earlier file moved aside with its head.

use std::path::{Path, PathBuf};

use serde_json::Value;

use super::super::testing::{key, open, open_linked, state_dir, verify};
use super::super::{
    head, verify_series, HandoverLink, HeadMatch, Ledger, LedgerError, Record, RecordKind,
    SegmentLink, VerifyReport, Written, GENESIS_HASH, INCIDENTS_FILE,
};

/// A directory of its own under the system temp dir, removed on drop.
struct Dir(PathBuf);

impl Dir {
    fn new(name: &str) -> Self {
        let dir =
            std::env::temp_dir().join(format!("haltd-handover-{}-{name}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("dir");
        Dir(dir)
    }

    fn blue(&self) -> PathBuf {
        self.0.join("ledger-blue.jsonl")
    }

    fn green(&self) -> PathBuf {
        self.0.join("ledger-green.jsonl")
    }
}

impl Drop for Dir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn rec(n: u64) -> Record {
    Record {
        kind: RecordKind::Turn,
        kernel_gate: "enforcing".to_owned(),
        message: Some(format!("record {n}")),
        ..Record::default()
    }
}

fn lines(path: &Path) -> Vec<Value> {
    std::fs::read_to_string(path)
        .expect("read")
        .lines()
        .map(|l| serde_json::from_str(l).expect("json"))
        .collect()
}

/// The old process: `before` records, its hand-over record (seq `before`), then `drain` more.
/// Returns the ledger, still open, and the hand-over record.
fn old_process(path: &Path, before: u64) -> (Ledger, Written) {
    let l = open(path, true).expect("open the old segment");
    for i in 0..before {
        l.append_sync(rec(i)).expect("append");
    }
    let handover = Record {
        kind: RecordKind::Lifecycle,
        handover: Some(serde_json::json!({"to_pid": 4242, "to_segment": "ledger-green.jsonl"})),
        ..rec(before)
    };
    let w = l
        .append_sync_written(handover)
        .expect("the hand-over record");
    assert_eq!(w.seq, before);
    (l, w)
}

fn link_to(path: &Path, w: &Written) -> SegmentLink {
    SegmentLink {
        segment: path.to_owned(),
        seq: w.seq,
        hash: w.hash.clone(),
        from_pid: 4141,
    }
}

/// The series `paths` against the head of the last one.
fn series(paths: &[PathBuf]) -> VerifyReport {
    let last = paths.last().expect("a segment");
    let k = key(last);
    let h = head::read_head(&state_dir(last), last, &k).expect("head");
    verify_series(paths, &k, h.as_ref()).expect("verify")
}

/// Blue hands over to green at seq 3 and drains 2 records; green starts at seq 4 from the
/// hand-over record's hash and writes on. The pair verifies and says where the fork is; each
/// file verifies alone against its own head; green restarts as a plain ledger.
#[test]
fn a_fork_at_the_hand_over_record_verifies() {
    let dir = Dir::new("fork");
    let (blue, green) = (dir.blue(), dir.green());
    let (a, w) = old_process(&blue, 3);
    let (b, first) = open_linked(&green, &link_to(&blue, &w)).expect("open linked");
    assert_eq!(first.seq, 4);
    for i in 0..2 {
        a.append_sync(rec(10 + i)).expect("the drain");
        b.append_sync(rec(20 + i)).expect("the new process");
    }
    drop((a, b));
    let g = lines(&green);
    assert_eq!(g[0]["seq"], 4);
    assert_eq!(g[0]["prev_hash"], w.hash.as_str());
    assert_eq!(g[0]["hash"], first.hash.as_str());
    assert_eq!(g[0]["kind"], "lifecycle");
    assert_eq!(g[0]["ledger_key_id"], key(&green).id().as_str());
    assert_eq!(g[0]["handover"]["from_seq"], 3);
    assert_eq!(g[0]["handover"]["from_pid"], 4141);
    assert_eq!(g[0]["handover"]["from_segment"], blue.display().to_string());
    let message = g[0]["message"].as_str().expect("message");
    assert!(
        message.starts_with(&format!(
            "hand-over: this segment continues {} from its record 3 (pid 4141's hand-over)",
            blue.display()
        )),
        "{message}"
    );

    let report = series(&[blue.clone(), green.clone()]);
    assert!(report.is_intact(), "{report}");
    assert_eq!(report.records, 6 + 3);
    assert_eq!(report.head, Some(HeadMatch::Equal));
    assert_eq!(
        report.handovers,
        vec![HandoverLink {
            segment: 1,
            from_seq: 3,
            old_segment_last_seq: 5,
        }]
    );
    for alone in [&blue, &green] {
        let r = verify(alone);
        assert!(r.is_intact() && r.head == Some(HeadMatch::Equal), "{r}");
    }
    let b = open(&green, true).expect("green restarts on its segment");
    assert_eq!(b.append_sync(rec(30)).expect("append"), 7);
}

/// The successor's first record names a record of the old segment that is not a hand-over
/// record, one whose hash is not its `prev_hash`, or one the old segment does not hold: the
/// series breaks there, saying which.
#[test]
fn a_fork_anywhere_else_is_a_break() {
    let dir = Dir::new("refused");
    let (blue, green) = (dir.blue(), dir.green());
    let (a, w) = old_process(&blue, 3);
    a.append_sync(rec(9)).expect("the drain");
    drop(a);
    let plain: Value = lines(&blue)[2].clone();
    let cases = [
        (
            2,
            plain["hash"].as_str().expect("hash").to_owned(),
            "segment 2 names record 2 of segment 1 as its hand-over record, but that record \
             carries no `handover` field",
        ),
        (
            3,
            plain["hash"].as_str().expect("hash").to_owned(),
            "segment 2 names hand-over record 3 of segment 1, whose hash differs",
        ),
        (
            7,
            w.hash.clone(),
            "segment 2 names hand-over record 7 of segment 1, which does not hold it (its \
             records are seq 0 to 4)",
        ),
    ];
    for (seq, hash, reason) in cases {
        // The earlier green, if any, moves aside under a name of its own (a millisecond apart).
        std::thread::sleep(std::time::Duration::from_millis(2));
        let link = SegmentLink {
            seq,
            hash,
            ..link_to(&blue, &w)
        };
        let (b, first) = open_linked(&green, &link).expect("open linked");
        assert_eq!(first.seq, seq + 1);
        drop(b);
        assert!(verify(&green).is_intact(), "green alone");
        let report = series(&[blue.clone(), green.clone()]);
        let b = report.broken.clone().expect("a break");
        assert_eq!((b.line, b.seq), (1, Some(seq + 1)), "{report}");
        assert_eq!(b.path.as_deref(), Some(green.as_path()));
        assert!(b.reason.starts_with(reason), "{}", b.reason);
        assert!(report.handovers.is_empty());
    }
    // Each earlier life of green was moved aside, its head with it.
    for moved in moved_aside(&green) {
        assert!(verify(&moved).is_intact());
    }
}

/// The files `<path>.<digits>` beside `path`.
fn moved_aside(path: &Path) -> Vec<PathBuf> {
    let name = path.file_name().and_then(|n| n.to_str()).expect("name");
    let mut found: Vec<PathBuf> = std::fs::read_dir(path.parent().expect("dir"))
        .expect("list")
        .flatten()
        .map(|e| e.path())
        .filter(|p| {
            let n = p.file_name().and_then(|n| n.to_str()).unwrap_or_default();
            n.strip_prefix(name)
                .and_then(|d| d.strip_prefix('.'))
                .is_some_and(|d| !d.is_empty() && d.bytes().all(|b| b.is_ascii_digit()))
        })
        .collect();
    found.sort();
    found
}

/// An earlier life of green (its own chain, with a head) is moved aside when green opens as a
/// hand-over segment: the moved file still verifies against its head, re-keyed to its new
/// path, and the new segment's first record says where it went.
#[test]
fn an_earlier_file_moves_aside_with_its_head() {
    let dir = Dir::new("moved");
    let (blue, green) = (dir.blue(), dir.green());
    let earlier = open(&green, true).expect("an earlier green");
    for i in 0..4 {
        earlier.append_sync(rec(i)).expect("append");
    }
    let (a, w) = old_process(&blue, 2);
    let link = link_to(&blue, &w);
    let held = open_linked(&green, &link).expect_err("the earlier green still runs");
    assert!(matches!(held, LedgerError::Locked { .. }), "{held}");
    drop(earlier);
    let (b, _) = open_linked(&green, &link).expect("open linked");
    drop((a, b));
    let moved = moved_aside(&green);
    assert_eq!(moved.len(), 1, "{moved:?}");
    let r = verify(&moved[0]);
    assert!(r.is_intact() && r.head == Some(HeadMatch::Equal), "{r}");
    assert_eq!(r.records, 4);
    let first = &lines(&green)[0];
    assert_eq!(
        first["handover"]["moved_aside"],
        moved[0].display().to_string()
    );
    let report = series(&[blue, green]);
    assert!(report.is_intact(), "{report}");
    assert_eq!(report.handovers.len(), 1);
}

/// A move aside that stopped after the file moved but before its old head was removed is
/// finished by the next hand-over; a head whose file is simply gone is tampering.
#[test]
fn an_interrupted_move_is_finished_and_a_deleted_file_refused() {
    let dir = Dir::new("interrupted");
    let (blue, green) = (dir.blue(), dir.green());
    let earlier = open(&green, true).expect("an earlier green");
    earlier.append_sync(rec(0)).expect("append");
    drop(earlier);
    let (a, w) = old_process(&blue, 1);
    drop(a);
    // The first steps of a move aside, by hand: the head re-keyed, the file moved.
    let aside = PathBuf::from(format!("{}.1700000000000", green.display()));
    let (k, state) = (key(&green), state_dir(&green));
    head::rekey(&state, &green, &aside, &k, true).expect("rekey");
    std::fs::rename(&green, &aside).expect("move");
    let (b, first) = open_linked(&green, &link_to(&blue, &w)).expect("finished and opened");
    assert_eq!(first.seq, 2);
    drop(b);
    assert!(verify(&aside).head == Some(HeadMatch::Equal));
    assert!(series(&[blue.clone(), green.clone()]).is_intact());

    // Green's own records deleted: its head says they were written.
    let b = open(&green, true).expect("reopen");
    b.append_sync(rec(5)).expect("append");
    drop(b);
    std::fs::remove_file(&green).expect("delete");
    let err = open_linked(&green, &link_to(&blue, &w)).expect_err("a deleted file");
    assert!(matches!(err, LedgerError::Tampered { .. }), "{err}");
    assert!(
        err.to_string().contains("the file holds no record"),
        "{err}"
    );
    let incidents = std::fs::read_to_string(state.join(INCIDENTS_FILE)).expect("incidents");
    assert!(incidents.contains("LEDGER_TAMPERED"), "{incidents}");
}

/// A link that is not a record's (the genesis hash, not hex) or that names the segment itself
/// is refused before anything is touched.
#[test]
fn a_bad_link_is_refused() {
    let dir = Dir::new("bad-link");
    let (blue, green) = (dir.blue(), dir.green());
    let (a, w) = old_process(&blue, 1);
    drop(a);
    for link in [
        SegmentLink {
            hash: GENESIS_HASH.to_owned(),
            ..link_to(&blue, &w)
        },
        SegmentLink {
            hash: "XY".repeat(32),
            ..link_to(&blue, &w)
        },
        link_to(&green, &w),
    ] {
        let err = open_linked(&green, &link).expect_err("refused");
        assert!(matches!(err, LedgerError::Handover { .. }), "{err}");
    }
    assert!(!green.exists());
}
