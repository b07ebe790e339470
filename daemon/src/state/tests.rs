//! The state store's unit tests: the file, the schema, the crash order against a real ledger,
//! and the start-up check.

use std::{
    os::unix::fs::PermissionsExt,
    sync::atomic::{AtomicU64, Ordering},
    time::{Duration, SystemTime},
};

use super::restore::{check, Verdict};
use super::*;
use crate::{
    codes::FailureCode,
    ledger::{testing, Ledger, Record, RecordKind},
    modes::{DegradedScope, KeyId, ModeChange, Modes},
};

/// A fresh directory under the system temp dir, removed on drop.
struct TempDir(PathBuf);

impl TempDir {
    fn new(name: &str) -> Self {
        static N: AtomicU64 = AtomicU64::new(0);
        let dir = std::env::temp_dir().join(format!(
            "haltd-state-{}-{}-{name}",
            std::process::id(),
            N.fetch_add(1, Ordering::Relaxed)
        ));
        std::fs::create_dir_all(dir.join("state")).expect("test setup");
        Self(dir)
    }

    fn ledger(&self) -> PathBuf {
        self.0.join("fhr.jsonl")
    }

    fn state(&self) -> PathBuf {
        self.0.join("state")
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn row(scope: &str, until: Option<u64>) -> ScopeRow {
    ScopeRow {
        scope: scope.to_owned(),
        since_unix_ms: 1_000,
        until_unix_ms: until,
        cause: "EXFIL_ALERT".to_owned(),
        stream_id: "1.1".to_owned(),
    }
}

/// Records `ch` as the daemon does (`HaltCore::record_mode_change`): the store is written
/// once the record is on disk, with its point.
fn record(ledger: &Ledger, store: &Arc<StateStore>, ch: &ModeChange) {
    let (store, change) = (Arc::clone(store), ch.store_change());
    ledger
        .append_linked(mode_record(ch), move |w| {
            store.apply(Some(w.expect("written").into()), vec![change]);
        })
        .expect("queued");
}

/// The record that states `ch`, as `HaltCore::record_mode_change` writes it.
fn mode_record(ch: &ModeChange) -> Record {
    Record {
        kind: RecordKind::Lifecycle,
        runtime_mode: ch.to.as_str().to_owned(),
        kernel_gate: "enforcing".to_owned(),
        mode_change: serde_json::to_value(ch).ok(),
        ..Record::default()
    }
}

fn lifecycle(msg: &str) -> Record {
    Record {
        kind: RecordKind::Lifecycle,
        runtime_mode: "full".to_owned(),
        kernel_gate: "enforcing".to_owned(),
        message: Some(msg.to_owned()),
        ..Record::default()
    }
}

fn key(s: &str) -> KeyId {
    KeyId::of(
        &crate::identity::NodeSecret::from_bytes([7; 32]),
        crate::credential::Credential::Bearer(s),
    )
}

#[test]
fn the_file_is_private_and_a_newer_schema_is_refused() {
    let dir = TempDir::new("schema");
    let (store, held) = StateStore::open(&dir.state()).expect("open");
    assert_eq!(held, Snapshot::default());
    let mode = std::fs::metadata(dir.state().join(STATE_FILE))
        .expect("test setup")
        .permissions()
        .mode();
    assert_eq!(mode & 0o777, 0o600);
    store.apply(
        Some(Point {
            seq: 3,
            hash: "ab".into(),
        }),
        vec![Change::Degrade(row("node", None))],
    );
    drop(store);
    let (store, held) = StateStore::open(&dir.state()).expect("reopen");
    assert_eq!(held.scopes, [row("node", None)]);
    assert_eq!(held.ledger.map(|p| p.seq), Some(3));
    drop(store);
    let conn = rusqlite::Connection::open(dir.state().join(STATE_FILE)).expect("test setup");
    conn.pragma_update(None, "user_version", schema::VERSION + 1)
        .expect("test setup");
    drop(conn);
    let err = StateStore::open(&dir.state()).expect_err("refused");
    assert!(matches!(err, StateError::Newer { .. }), "{err}");
    assert!(err.to_string().contains("newer haltd"), "{err}");
}

#[test]
fn a_version_1_store_is_migrated_and_keeps_its_scopes_and_every_later_table() {
    let dir = TempDir::new("migrate");
    let path = dir.state().join(STATE_FILE);
    let conn = rusqlite::Connection::open(&path).expect("test setup");
    conn.execute_batch(
        "CREATE TABLE meta (name TEXT PRIMARY KEY, value TEXT NOT NULL);
         CREATE TABLE degraded (scope TEXT PRIMARY KEY, since_unix_ms INTEGER NOT NULL,
             until_unix_ms INTEGER, cause TEXT NOT NULL, stream_id TEXT NOT NULL);
         INSERT INTO degraded VALUES ('node', 5, NULL, 'EXFIL_ALERT', '1.1');
         PRAGMA user_version = 1;",
    )
    .expect("test setup");
    drop(conn);
    let (store, held) = StateStore::open(&dir.state()).expect("migrated");
    assert_eq!(held.scopes.len(), 1);
    let c = ConversationRow {
        key: format!("{}", key("e")),
        turns_committed: 2,
        tokens_committed: 40,
        tool_calls_committed: 1,
        last_committed_turn: Some("5.1".into()),
        turns_failed: 1,
    };
    // Version 3's tables: TokenCircuit's memory and the dispatched calls.
    let circuit = CircuitRow {
        key: "aa".into(),
        id: "c-1".into(),
        source: "header".into(),
        retained: false,
        body: serde_json::json!({"turns": 2}),
    };
    let gone = CircuitRow {
        id: "c-2".into(),
        ..circuit.clone()
    };
    let dispatched = DispatchedRow {
        reference: "0123456789ab".into(),
        body: serde_json::json!({"tool": "send_email"}),
    };
    // Version 4's tables: the key store's keys and their counts.
    let client_key = ClientKeyRow {
        id: "0123456789abcdef".into(),
        body: serde_json::json!({"name": "ci", "revoked_unix_ms": null}),
    };
    let revoked = ClientKeyRow {
        body: serde_json::json!({"name": "ci", "revoked_unix_ms": 7}),
        ..client_key.clone()
    };
    let usage = ClientKeyRow {
        body: serde_json::json!({"requests_total": 3}),
        ..client_key.clone()
    };
    store.apply(
        None,
        vec![
            Change::Conversation(c.clone()),
            Change::Circuit(circuit.clone()),
            Change::Circuit(gone),
            Change::CircuitGone("aa".into(), "c-2".into(), "header".into()),
            Change::Dispatched(dispatched.clone()),
            Change::ClientKey(client_key),
            Change::ClientKey(revoked.clone()),
            Change::KeyUsage(usage.clone()),
        ],
    );
    drop(store);
    let (store, held) = StateStore::open(&dir.state()).expect("reopen");
    assert_eq!(held.conversations, [c]);
    assert_eq!(held.circuits, [circuit]);
    assert_eq!(held.dispatched, [dispatched]);
    assert_eq!(held.client_keys, [revoked], "the row is replaced");
    assert_eq!(held.key_usage, [usage]);
    // A start's replace keeps them.
    store.replace(held.clone());
    drop(store);
    let (_store, again) = StateStore::open(&dir.state()).expect("reopen");
    assert_eq!(again.client_keys, held.client_keys);
    assert_eq!(again.key_usage, held.key_usage);
    let conn = rusqlite::Connection::open(&path).expect("test setup");
    let v: i64 = conn
        .pragma_query_value(None, "user_version", |r| r.get(0))
        .expect("test setup");
    assert_eq!(v, schema::VERSION);
}

#[test]
fn changes_are_stored_after_their_records_and_a_restart_finds_them() {
    let dir = TempDir::new("order");
    let ledger = testing::open(&dir.ledger(), true).expect("ledger");
    let (store, held) = StateStore::open(&dir.state()).expect("open");
    let restored = check(&held, &dir.ledger(), "n1").expect("check");
    assert_eq!(restored.verdict, Verdict::New);
    let store = Arc::new(store);
    let modes = Modes::new(DegradedScope::Key, Some(Duration::from_secs(600)));
    let ch = modes
        .enter(
            crate::scope::Scope::legacy(key("a")),
            FailureCode::ExfilAlert,
            "2.1",
        )
        .expect("change");
    record(&ledger, &store, &ch);
    let ch = modes
        .enter(
            crate::scope::Scope::legacy(key("b")),
            FailureCode::ExfilAlert,
            "2.2",
        )
        .expect("change");
    record(&ledger, &store, &ch);
    for ch in modes.set_full(crate::modes::ScopeSel::Scope(crate::scope::Scope::legacy(
        key("b"),
    ))) {
        record(&ledger, &store, &ch);
    }
    ledger.flush().expect("flush");
    let held = store.read().expect("read");
    assert_eq!(held.scopes.len(), 1, "{held:?}");
    assert_eq!(held.scopes[0].scope, format!("key:{}", key("a")));
    assert_eq!(held.ledger.as_ref().map(|p| p.seq), Some(2));
    // The point is a record of this ledger: the store matches, nothing to replay.
    let restored = check(&held, &dir.ledger(), "n1").expect("check");
    assert_eq!(restored.verdict, Verdict::Matched { replayed: 0 });
    assert_eq!(restored.scopes, held.scopes);
}

#[test]
fn a_store_behind_its_ledger_catches_up_and_never_loses_a_degrade() {
    let dir = TempDir::new("behind");
    let ledger = testing::open(&dir.ledger(), true).expect("ledger");
    let (store, held) = StateStore::open(&dir.state()).expect("open");
    let store = Arc::new(store);
    let w = ledger.reopen(lifecycle("x")).expect("same file");
    assert!(w.is_none());
    let (tx, rx) = std::sync::mpsc::sync_channel(1);
    ledger
        .append_linked(lifecycle("start"), move |w| {
            let _ = tx.send(w);
        })
        .expect("queued");
    store.link(rx.recv().expect("answered").expect("written").into());
    // A crash between the record's fsync and the store's write: the record is in the
    // ledger, the store never saw it.
    let modes = Modes::new(DegradedScope::Key, Some(Duration::from_secs(600)));
    let ch = modes
        .enter(
            crate::scope::Scope::legacy(key("c")),
            FailureCode::CoherenceBelowThreshold,
            "3.1",
        )
        .expect("change");
    ledger.append_sync(mode_record(&ch)).expect("written");
    // So for a failed turn's dispatched call: handed to the start to replay.
    let mut turn = Record {
        kind: RecordKind::Turn,
        ..lifecycle("turn")
    };
    turn.tool_calls = vec![serde_json::json!({"id": "c0", "status": "dispatched",
        "reconciliation": "required", "ref": "abc"})];
    ledger.append_sync(turn).expect("written");
    let behind = store.read().expect("read");
    assert!(behind.scopes.is_empty() && held.scopes.is_empty());
    let restored = check(&behind, &dir.ledger(), "n1").expect("check");
    assert_eq!(restored.verdict, Verdict::Matched { replayed: 1 });
    assert_eq!(restored.dispatched_records.len(), 1);
    assert_eq!(
        restored.dispatched_records[0]["tool_calls"][0]["ref"],
        "abc"
    );
    assert_eq!(restored.scopes.len(), 1);
    assert_eq!(restored.scopes[0].until_unix_ms, ch.until_unix_ms);
    // And what is restored is degraded, with the same end.
    let again = Modes::new(DegradedScope::Key, None);
    again
        .restore(
            &restored.scopes,
            SystemTime::now(),
            crate::clock::monotonic_ns(),
        )
        .expect("restore");
    assert!(again.is_degraded(crate::scope::Scope::legacy(key("c"))));
}

#[test]
fn a_store_that_does_not_match_is_named_never_reset() {
    let dir = TempDir::new("mismatch");
    let ledger = testing::open(&dir.ledger(), true).expect("ledger");
    let modes = Modes::new(DegradedScope::Node, None);
    let ch = modes
        .enter(
            crate::scope::Scope::legacy(key("d")),
            FailureCode::ExfilAlert,
            "4.1",
        )
        .expect("change");
    ledger.append_sync(mode_record(&ch)).expect("written");
    // A removed store, or a new state directory: the segment is the whole chain, so every
    // mode change is here, and the scopes are rebuilt from it.
    let new = Snapshot::default();
    let rebuilt = check(&new, &dir.ledger(), "n1").expect("check");
    assert_eq!(rebuilt.verdict, Verdict::Rebuilt { replayed: 1 });
    assert_eq!(rebuilt.scopes.len(), 1);
    assert_eq!(rebuilt.scopes[0].scope, "node");
    // After a rotation the segment misses what came before: a new store does not match.
    std::fs::rename(dir.ledger(), dir.0.join("fhr.jsonl.1")).expect("rotate");
    ledger.reopen(lifecycle("rotated")).expect("reopen");
    ledger.append_sync(mode_record(&ch)).expect("written");
    let Verdict::Mismatch(why) = check(&new, &dir.ledger(), "n1").expect("check").verdict else {
        panic!("a removed store must not pass as new after a rotation");
    };
    assert!(why.contains("continues a rotated one"), "{why}");
    // A store from another ledger: its point is not here.
    let other = Snapshot {
        ledger: Some(Point {
            seq: 0,
            hash: "00".repeat(32),
        }),
        node_check: Some("n1".into()),
        scopes: vec![row("node", None)],
        ..Snapshot::default()
    };
    let Verdict::Mismatch(why) = check(&other, &dir.ledger(), "n1").expect("check").verdict else {
        panic!("a foreign store must not match");
    };
    assert!(why.contains("is not in"), "{why}");
    // A store written under another node key.
    let Verdict::Mismatch(why) = check(&other, &dir.ledger(), "n2").expect("check").verdict else {
        panic!("another node key must not match");
    };
    assert!(why.contains("another node.key"), "{why}");
}

/// Restoring 10,000 degraded scopes: the store's write and read, the check against the
/// ledger and the restore into degraded mode (the time is printed, for the bench; the test
/// checks what is restored).
#[test]
fn ten_thousand_scopes_are_restored() {
    let dir = TempDir::new("many");
    let ledger = testing::open(&dir.ledger(), true).expect("ledger");
    let (tx, rx) = std::sync::mpsc::sync_channel(1);
    ledger
        .append_linked(lifecycle("start"), move |w| {
            let _ = tx.send(w);
        })
        .expect("queued");
    let point: Point = rx.recv().expect("answered").expect("written").into();
    let (store, _) = StateStore::open(&dir.state()).expect("open");
    let rows: Vec<ScopeRow> = (0..10_000u64)
        .map(|i| row(&format!("key:{}", KeyId(i)), Some(u64::MAX / 2)))
        .collect();
    store.replace(Snapshot {
        ledger: Some(point),
        node_check: Some("n1".into()),
        scopes: rows.clone(),
        ..Snapshot::default()
    });
    drop(store);
    let t = std::time::Instant::now();
    let (store, held) = StateStore::open(&dir.state()).expect("reopen");
    let restored = check(&held, &dir.ledger(), "n1").expect("check");
    let modes = Modes::new(DegradedScope::Key, None);
    modes
        .restore(
            &restored.scopes,
            SystemTime::now(),
            crate::clock::monotonic_ns(),
        )
        .expect("restore");
    let took = t.elapsed();
    eprintln!("restored 10,000 scopes in {took:?}");
    assert_eq!(restored.verdict, Verdict::Matched { replayed: 0 });
    assert_eq!(modes.degraded_count(), 10_000);
    assert!(modes.is_degraded(crate::scope::Scope::legacy(KeyId(9_999))));
    drop(store);
}

/// A rotated ledger: the store links to the new segment's first record (as `lifecycle.rs`
/// does on SIGHUP), so a start on the new segment finds it, with the scopes degraded before
/// the rotation; without the link the start would refuse the store.
#[test]
fn a_store_linked_at_rotation_matches_the_new_segment() {
    let dir = TempDir::new("rotate");
    let ledger = testing::open(&dir.ledger(), true).expect("ledger");
    let (store, _) = StateStore::open(&dir.state()).expect("open");
    let store = Arc::new(store);
    let modes = Modes::new(DegradedScope::Key, None);
    let ch = modes
        .enter(
            crate::scope::Scope::legacy(key("r")),
            FailureCode::ExfilAlert,
            "6.1",
        )
        .expect("change");
    record(&ledger, &store, &ch);
    ledger.flush().expect("flush");
    std::fs::rename(dir.ledger(), dir.0.join("fhr.jsonl.1")).expect("rotate");
    let unlinked = store.read().expect("read");
    let first = ledger
        .reopen(lifecycle("rotated"))
        .expect("reopen")
        .expect("a new segment");
    // Before the link, the store's point is in the old segment only.
    let Verdict::Mismatch(why) = check(&unlinked, &dir.ledger(), "n1")
        .expect("check")
        .verdict
    else {
        panic!("a point in a rotated-away segment must not match");
    };
    assert!(why.contains("rotated away"), "{why}");
    store.link(first.into());
    let held = store.read().expect("read");
    let restored = check(&held, &dir.ledger(), "n1").expect("check");
    assert_eq!(restored.verdict, Verdict::Matched { replayed: 0 });
    assert_eq!(restored.scopes.len(), 1);
    assert_eq!(restored.scopes[0].scope, format!("key:{}", key("r")));
}

/// A write that fails marks the store failed (the watchdog then fails haltd closed), and
/// nothing is written after it.
#[test]
fn a_failed_write_fails_the_store() {
    let dir = TempDir::new("fail");
    let (store, _) = StateStore::open(&dir.state()).expect("open");
    assert!(!store.is_failed());
    // The table gone under the store (a broken file): the next write fails.
    let conn = rusqlite::Connection::open(dir.state().join(STATE_FILE)).expect("test setup");
    conn.execute_batch("DROP TABLE degraded;")
        .expect("test setup");
    drop(conn);
    store.apply(None, vec![Change::Degrade(row("node", None))]);
    store.flush();
    assert!(store.is_failed());
    store.apply(None, vec![Change::End("node".into())]);
    store.flush();
    assert!(store.is_failed());
}

#[test]
fn the_test_fault_fails_every_write_after_the_first_n() {
    let dir = TempDir::new("fault");
    let (store, _) = StateStore::open_with_fault(&dir.state(), Some(1)).expect("open");
    store.apply(None, vec![Change::Degrade(row("node", None))]);
    store.flush();
    assert!(!store.is_failed(), "the first write is kept");
    store.apply(None, vec![Change::End("node".into())]);
    store.flush();
    assert!(store.is_failed(), "the second fails");
    drop(store);
    let (_store, held) = StateStore::open(&dir.state()).expect("reopen");
    assert_eq!(
        held.scopes,
        [row("node", None)],
        "nothing after the fault is written"
    );
}

/// Two processes on one store during a hand-over: each sees what the other commits
/// (`peer_scopes`), and a frozen point stays put while changes are still written.
#[test]
fn a_peer_sees_the_others_scopes_and_a_frozen_point_stays() {
    let dir = TempDir::new("peers");
    let (old, _) = StateStore::open(&dir.state()).expect("open");
    let point = |seq| Point {
        seq,
        hash: "ab".into(),
    };
    old.apply(Some(point(7)), vec![Change::Degrade(row("node", None))]);
    old.flush();
    let (new, held) = StateStore::open(&dir.state()).expect("a second process opens it");
    assert_eq!(held.scopes, [row("node", None)]);
    assert_eq!(
        new.peer_scopes().expect("read").map(|r| r.len()),
        Some(1),
        "the first look reads"
    );
    assert_eq!(
        new.peer_scopes().expect("read"),
        None,
        "nothing committed since"
    );
    old.freeze_point();
    let key = "key:00000000000000aa";
    old.apply(
        Some(point(9)),
        vec![Change::Degrade(row(key, Some(4_000_000_000_000)))],
    );
    old.flush();
    let seen = new
        .peer_scopes()
        .expect("read")
        .expect("the peer's commit is seen");
    assert!(seen.iter().any(|r| r.scope == key), "{seen:?}");
    assert_eq!(
        old.read().expect("read").ledger.map(|p| p.seq),
        Some(7),
        "the point moved while frozen"
    );
    old.thaw_point();
    old.apply(Some(point(10)), Vec::new());
    assert_eq!(old.read().expect("read").ledger.map(|p| p.seq), Some(10));
}
