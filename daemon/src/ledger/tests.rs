//! The ledger's unit tests.

use super::testing::{key, open, state_dir, verify};
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
        "handover",
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
    let l = open(path, fsync).expect("open");
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
    let report = verify(&path);
    assert!(report.is_intact(), "{report}");
    assert_eq!(report.records, 50);
    assert_eq!(
        report.to_string(),
        "ok: 50 records, chain intact, matches its head"
    );

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
    let l = open(&path, true).expect("open");
    assert_eq!(l.append_sync(rec(0)).expect("sync"), 0);
    l.append(rec(1)).expect("append");
    assert_eq!(l.append_sync(rec(2)).expect("sync"), 2);
    let w = l.append_sync_written(rec(3)).expect("sync, with the hash");
    let on_disk: Record = serde_json::from_str(&lines(&path)[3]).expect("record");
    assert_eq!((w.seq, w.hash), (3, on_disk.hash));
    l.flush().expect("flush");
    assert_eq!(l.records_written(), 4);
    assert!(verify(&path).is_intact());
}

#[test]
fn tampered_field_is_reported() {
    let dir = TempDir::new("tamper");
    let path = dir.file();
    drop(write_n(&path, false, 10));
    let mut ls = lines(&path);
    ls[4] = ls[4].replace("\"tokens_emitted\":28", "\"tokens_emitted\":27");
    write_lines(&path, &ls);
    let report = verify(&path);
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
    r.hash = r.compute_hash(&key(&path)).expect("hash");
    ls[2] = serde_json::to_string(&r).expect("json");
    write_lines(&path, &ls);
    let b = verify(&path).broken.expect("broken");
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
    let b = verify(&path).broken.expect("broken");
    assert_eq!(b.line, 4);
    assert_eq!(b.seq, Some(4));
    assert!(b.reason.starts_with("seq gap"), "{}", b.reason);
}

/// Re-links `lines` into a fresh chain from seq 0 under `key`: what an attacker who edited
/// the file does to hide the edit.
fn relink(lines: &[String], key: &LedgerKey) -> Vec<String> {
    let mut prev = GENESIS_HASH.to_owned();
    lines
        .iter()
        .enumerate()
        .map(|(i, l)| {
            let mut r: Record = serde_json::from_str(l).expect("record");
            r.seq = i as u64;
            r.prev_hash = prev.clone();
            r.hash.clear();
            r.hash = r.compute_hash(key).expect("hash");
            prev.clone_from(&r.hash);
            serde_json::to_string(&r).expect("json")
        })
        .collect()
}

fn assert_tampered(path: &Path, what: &str) {
    match open(path, false) {
        Err(e @ LedgerError::Tampered { .. }) | Err(e @ LedgerError::ChainBroken { .. }) => {
            assert!(e.is_tampering(), "{what}: {e}");
        }
        other => panic!("{what}: expected a refusal, got {other:?}"),
    }
    let incidents = std::fs::read_to_string(state_dir(path).join(INCIDENTS_FILE))
        .expect("the refusal is recorded in the state directory");
    assert!(incidents.contains("LEDGER_TAMPERED"), "{incidents}");
}

/// Attack 1, truncation: `head -n3` of the ledger is a valid chain, but not its head's.
#[test]
fn truncation_is_caught_by_the_head() {
    let dir = TempDir::new("truncate");
    let path = dir.file();
    drop(write_n(&path, true, 5));
    let ls = lines(&path);
    write_lines(&path, &ls[..3]);
    let report = verify(&path);
    let b = report.broken.clone().expect("broken");
    assert!(b.reason.starts_with("file behind its head"), "{report}");
    assert_eq!(report.records, 3);
    // Truncate then restart: haltd refuses to start on it.
    assert_tampered(&path, "truncated at a line boundary");
    // Cut inside the last record: still behind the head, not a crash.
    write_lines(&path, &ls);
    let len = std::fs::metadata(&path).expect("meta").len();
    let f = OpenOptions::new().write(true).open(&path).expect("open");
    f.set_len(len - 40).expect("truncate");
    drop(f);
    assert!(verify(&path).broken.is_some());
    assert_tampered(&path, "truncated inside the last record");
    // The whole file gone (or emptied): behind its head as well.
    std::fs::remove_file(&path).expect("rm");
    assert_tampered(&path, "deleted ledger");
}

/// Attack 2, deletion: a record deleted and the rest re-linked without the key.
#[test]
fn deletion_and_relinking_are_caught() {
    let dir = TempDir::new("delete-relink");
    let path = dir.file();
    drop(write_n(&path, true, 6));
    let mut ls = lines(&path);
    ls.remove(2);
    let forged = relink(&ls, &LedgerKey::from_bytes([0xee; 32]));
    write_lines(&path, &forged);
    let b = verify(&path).broken.expect("broken");
    assert_eq!(b.line, 1, "the first re-linked line fails its MAC: {b:?}");
    assert!(b.reason.starts_with("hash mismatch"), "{}", b.reason);
    assert_tampered(&path, "deleted and re-linked");
    // Re-linked only from the deleted record on (the records before it keep their MACs).
    let mut tail = relink(&ls, &LedgerKey::from_bytes([0xee; 32]));
    tail[..2].clone_from_slice(&ls[..2]);
    write_lines(&path, &tail);
    let b = verify(&path).broken.expect("broken");
    assert_eq!(b.line, 3, "{b:?}");
}

/// Attack 3, reordering: two records swapped, with and without re-linking.
#[test]
fn reordering_is_caught() {
    let dir = TempDir::new("reorder");
    let path = dir.file();
    drop(write_n(&path, true, 6));
    let mut ls = lines(&path);
    ls.swap(2, 3);
    write_lines(&path, &ls);
    let b = verify(&path).broken.expect("broken");
    assert_eq!((b.line, b.seq), (3, Some(3)), "{b:?}");
    assert_tampered(&path, "reordered");
    write_lines(&path, &relink(&ls, &LedgerKey::from_bytes([1; 32])));
    assert!(verify(&path).broken.is_some());
    assert_tampered(&path, "reordered and re-linked");
}

/// Attack 4, re-linking: the whole file rewritten as a fresh chain (a record changed, every
/// hash recomputed) under any key but the ledger's.
#[test]
fn relinked_chain_is_caught() {
    let dir = TempDir::new("relink");
    let path = dir.file();
    drop(write_n(&path, true, 4));
    let mut ls = lines(&path);
    ls[1] = ls[1].replace("\"tokens_emitted\":7", "\"tokens_emitted\":0");
    // An attacker's best guess at a key: none, i.e. the old unkeyed SHA-256 chain, is not a
    // valid MAC either; any other key neither.
    write_lines(&path, &relink(&ls, &LedgerKey::from_bytes([0; 32])));
    let b = verify(&path).broken.expect("broken");
    assert_eq!(b.line, 1);
    assert_tampered(&path, "re-linked");
    // Even with the real key (which only root can read) the chain no longer ends at its head.
    write_lines(&path, &relink(&ls, &key(&path)));
    let b = verify(&path).broken.expect("broken");
    assert!(
        b.reason.starts_with("file does not end at its head"),
        "{b:?}"
    );
}

/// A crash between a record's fsync and the head's leaves the file one record ahead: the
/// next start catches the head up. Two ahead is not a crash.
#[test]
fn one_record_past_the_head_is_a_crash() {
    let dir = TempDir::new("ahead");
    let path = dir.file();
    drop(write_n(&path, true, 5));
    let ls = lines(&path);
    let rec3: Record = serde_json::from_str(&ls[3]).expect("record");
    let (mut hf, _) = head::HeadFile::open(&state_dir(&path), &path, &key(&path)).expect("head");
    hf.write(
        &Head {
            next_seq: 4,
            hash: rec3.hash.clone(),
        },
        true,
    )
    .expect("rewind head");
    let report = verify(&path);
    assert_eq!(report.head, Some(HeadMatch::AheadByOne), "{report}");
    let l = open(&path, true).expect("a crash is recovered");
    assert_eq!(l.append_sync(rec(5)).expect("append"), 5);
    drop(l);
    assert_eq!(verify(&path).head, Some(HeadMatch::Equal));

    let rec2: Record = serde_json::from_str(&ls[2]).expect("record");
    let (mut hf, _) = head::HeadFile::open(&state_dir(&path), &path, &key(&path)).expect("head");
    hf.write(
        &Head {
            next_seq: 3,
            hash: rec2.hash,
        },
        true,
    )
    .expect("rewind head");
    assert!(verify(&path).broken.is_some());
    assert_tampered(&path, "three records past the head");
}

/// A crash mid-write leaves a torn last line: the next start cuts it, records what it cut,
/// and carries on; every record before it is kept.
#[test]
fn torn_tail_is_cut_and_recorded() {
    let dir = TempDir::new("torn");
    let path = dir.file();
    drop(write_n(&path, true, 5));
    let mut f = OpenOptions::new().append(true).open(&path).expect("open");
    f.write_all(b"{\"seq\":5,\"prev_hash\":\"ab")
        .expect("torn write");
    drop(f);
    let report = verify(&path);
    assert!(report.is_intact(), "{report}");
    assert_eq!((report.records, report.torn_tail), (5, 24));
    let l = open(&path, true).expect("recovered");
    assert_eq!(l.records_written(), 1, "the recovery record");
    drop(l);
    let report = verify(&path);
    assert!(report.is_intact() && report.torn_tail == 0, "{report}");
    assert_eq!(report.records, 6);
    let last: serde_json::Value =
        serde_json::from_str(lines(&path).last().expect("line")).expect("json");
    assert_eq!(last["kind"], "lifecycle");
    assert_eq!(last["recovery"]["cut_bytes"], 24);
    assert_eq!(
        last["recovery"]["cut_prefix"],
        "{\"seq\":5,\"prev_hash\":\"ab"
    );
    assert!(!state_dir(&path).join(INCIDENTS_FILE).exists());
}

/// Rotation: a new segment links to the previous head; the series verifies, and so does the
/// new segment alone; a record cut from the old segment breaks the series.
#[test]
fn rotation_opens_a_linked_segment() {
    let dir = TempDir::new("rotate");
    let path = dir.file();
    let l = write_n(&path, true, 3);
    let old = dir.0.join("fhr.jsonl.1");
    std::fs::rename(&path, &old).expect("rotate");
    let start = Record {
        kind: RecordKind::Lifecycle,
        ..rec(1)
    };
    assert_eq!(
        l.reopen(start.clone()).expect("reopen").map(|w| w.seq),
        Some(3)
    );
    assert_eq!(l.reopen(start).expect("same file"), None);
    l.append_sync(rec(4)).expect("append");
    drop(l);
    let k = key(&path);
    let head = head::read_head(&state_dir(&path), &path, &k).expect("head");
    let series = verify_series(&[old.clone(), path.clone()], &k, head.as_ref()).expect("verify");
    assert!(series.is_intact(), "{series}");
    assert_eq!(series.records, 5);
    assert_eq!(series.head, Some(HeadMatch::Equal));
    assert!(verify(&path).is_intact());
    open(&path, true).expect("restart on the new segment");

    let mut ls = lines(&old);
    ls.pop();
    write_lines(&old, &ls);
    let series = verify_series(&[old, path.clone()], &k, head.as_ref()).expect("verify");
    let b = series.broken.expect("broken");
    assert_eq!((b.line, b.path), (1, Some(path)));
}

/// `--ledger-no-fsync` says so in every record.
#[test]
fn no_fsync_is_stated_in_every_record() {
    let dir = TempDir::new("nofsync");
    let path = dir.file();
    drop(write_n(&path, false, 3));
    for l in lines(&path) {
        assert!(l.contains(",\"no_fsync\":true"), "{l}");
    }
    let dir = TempDir::new("fsync-marks");
    let path = dir.file();
    drop(write_n(&path, true, 2));
    assert!(lines(&path).iter().all(|l| !l.contains("no_fsync")));
}

/// The first record of a segment, and only it, names the ledger key (`haltctl ledger verify`
/// tells a wrong key from tampering by it).
#[test]
fn the_first_record_of_a_segment_names_its_key() {
    let dir = TempDir::new("key-id");
    let path = dir.file();
    drop(write_n(&path, true, 3));
    let ls = lines(&path);
    let id = key(&path).id();
    assert!(
        ls[0].contains(&format!("\"ledger_key_id\":\"{id}\"")),
        "{}",
        ls[0]
    );
    assert!(ls[1..].iter().all(|l| !l.contains("ledger_key_id")));
    assert_ne!(id, LedgerKey::from_bytes([9; 32]).id());
}

/// The answer of [`Ledger::append_then`] comes once the record is on disk.
#[test]
fn append_then_answers_after_the_write() {
    let dir = TempDir::new("then");
    let path = dir.file();
    let l = open(&path, true).expect("open");
    let (tx, rx) = mpsc::channel();
    let p = path.clone();
    l.append_then(rec(0), move |r| {
        let on_disk = std::fs::read_to_string(&p).expect("read").lines().count();
        tx.send((r.expect("written"), on_disk)).expect("send");
    })
    .expect("queued");
    assert_eq!(rx.recv().expect("answer"), (0, 1));
}

#[test]
fn garbage_and_foreign_lines_are_reported() {
    let dir = TempDir::new("garbage");
    let path = dir.file();
    drop(write_n(&path, false, 3));
    let mut ls = lines(&path);
    ls.push("this is not json".to_owned());
    write_lines(&path, &ls);
    let b = verify(&path).broken.expect("broken");
    assert_eq!(b.line, 4);
    assert!(b.reason.starts_with("not JSON"), "{}", b.reason);

    // Fields smuggled in: at the front the layout check catches it, elsewhere the hash.
    let mut ls = lines(&path);
    ls.pop();
    let orig = ls[2].clone();
    ls[2] = orig.replacen("{\"seq\"", "{\"extra\":1,\"seq\"", 1);
    write_lines(&path, &ls);
    let b = verify(&path).broken.expect("broken");
    assert_eq!(b.line, 3);
    assert!(b.reason.starts_with("non-canonical"), "{}", b.reason);
    ls[2] = format!("{},\"extra\":1}}", orig.trim_end_matches('}'));
    write_lines(&path, &ls);
    let b = verify(&path).broken.expect("broken");
    assert_eq!((b.line, b.reason.as_str()), (3, "hash mismatch"));
}

/// Floats that serde_json's default parser does not read back bit-exactly must still
/// verify: the hash is over the written bytes.
#[test]
fn arbitrary_floats_verify() {
    let dir = TempDir::new("floats");
    let path = dir.file();
    let l = open(&path, false).expect("open");
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
    let report = verify(&path);
    assert!(report.is_intact(), "{report}");
    assert_eq!(report.records, 500);
}

#[test]
fn reopen_continues_the_chain() {
    let dir = TempDir::new("reopen");
    let path = dir.file();
    drop(write_n(&path, true, 3));
    let l = open(&path, true).expect("reopen");
    assert_eq!(l.append_sync(rec(3)).expect("append"), 3);
    l.append(rec(4)).expect("append");
    drop(l); // drains the queue
    let report = verify(&path);
    assert!(report.is_intact(), "{report}");
    assert_eq!(report.records, 5);
}

#[test]
fn second_open_is_locked_out() {
    let dir = TempDir::new("lock");
    let path = dir.file();
    let l = open(&path, false).expect("open");
    assert!(matches!(
        open(&path, false),
        Err(LedgerError::Locked { .. })
    ));
    drop(l);
    open(&path, false).expect("reopen after close");
}

#[test]
fn invalid_records_are_rejected() {
    let dir = TempDir::new("invalid");
    let l = open(&dir.file(), false).expect("open");
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
    let l = open(&path, false).expect("open");
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
    let report = verify(&path);
    assert!(report.is_intact(), "{report}");
    assert_eq!(report.records, 100);
}

/// A ledger writing to /dev/full, with its head in `dir`.
fn dev_full(dir: &TempDir, fsync: bool) -> Option<Ledger> {
    let file = OpenOptions::new().write(true).open("/dev/full").ok()?;
    let key = LedgerKey::from_bytes([9; 32]);
    let (hf, _) = head::HeadFile::open(&dir.0, &dir.file(), &key).expect("head");
    let w = Writer::new(file, fsync, Head::genesis(), 0, hf, key);
    Some(Ledger::start(Path::new("/dev/full"), w).expect("start"))
}

#[test]
fn write_failure_surfaces_and_sticks() {
    // /dev/full fails every write with ENOSPC: the disk-full case.
    let dir = TempDir::new("full");
    let Some(l) = dev_full(&dir, true) else {
        return;
    };
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
    let l = dev_full(&dir, false).expect("reopen");
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
    let e = open(Path::new("/nonexistent-dir/x/fhr.jsonl"), true).expect_err("fails");
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
