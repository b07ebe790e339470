use super::*;

fn secret() -> crate::identity::NodeSecret {
    crate::identity::NodeSecret::from_bytes([3; 32])
}

fn key(s: &str) -> KeyId {
    KeyId::of(&secret(), crate::credential::Credential::Bearer(s))
}

#[test]
fn key_ids_are_stable_and_distinct() {
    assert_eq!(key("a"), key("a"));
    assert_ne!(key("a"), key("b"));
    let none = crate::credential::Credential::None;
    assert_eq!(KeyId::of(&secret(), none), KeyId::of(&secret(), none));
    let k = key("secret");
    assert_eq!(KeyId::parse_fingerprint(&k.fingerprint()), Some(k));
    assert!(!k.fingerprint().contains("secret"));
    assert_eq!(KeyId::parse_fingerprint("xyz"), None);
}

#[test]
fn key_scope_degrades_only_that_key_until_the_operator_ends_it() {
    let m = Modes::new(DegradedScope::Key, None);
    let (a, b) = (key("a"), key("b"));
    let ch = m
        .enter(
            crate::scope::Scope::legacy(a),
            FailureCode::OperatorTrip,
            "1.1",
        )
        .expect("change");
    assert_eq!(
        (ch.from, ch.to, ch.by),
        (RuntimeMode::Full, RuntimeMode::Degraded, ChangedBy::Halt)
    );
    assert_eq!(
        serde_json::to_value(&ch).expect("json")["by"],
        serde_json::json!("halt")
    );
    assert!(m.is_degraded(crate::scope::Scope::legacy(a)));
    assert!(!m.is_degraded(crate::scope::Scope::legacy(b)));
    // A second halt on a degraded scope is no change.
    assert_eq!(
        m.enter(
            crate::scope::Scope::legacy(a),
            FailureCode::ExfilAlert,
            "1.2"
        ),
        None
    );
    // Timers never end it without --degraded-for-s.
    assert!(m.expire(monotonic_ns() + (1 << 50)).is_empty());
    let ended = m.set_full(ScopeSel::Scope(crate::scope::Scope::legacy(a)));
    assert_eq!(ended.len(), 1);
    assert_eq!(ended[0].by, ChangedBy::Operator);
    assert!(!m.is_degraded(crate::scope::Scope::legacy(a)));
    assert!(m
        .set_full(ScopeSel::Scope(crate::scope::Scope::legacy(a)))
        .is_empty());
}

#[test]
fn upstream_failures_do_not_degrade() {
    let m = Modes::new(DegradedScope::Node, None);
    assert_eq!(
        m.enter(
            crate::scope::Scope::legacy(key("a")),
            FailureCode::UpstreamFailure,
            "1.1"
        ),
        None
    );
    assert!(!m.is_degraded(crate::scope::Scope::legacy(key("a"))));
}

/// README's and the guide's statement: every halt degrades its scope except an upstream
/// failure, an open tool circuit and a client that stopped reading (a shutdown's halts
/// never reach `enter`: `halt.rs` skips it once `shutting_down` is set).
#[test]
fn every_cause_degrades_but_upstream_failures_open_circuits_and_stalled_clients() {
    let spared = [
        FailureCode::UpstreamFailure,
        FailureCode::ToolCircuitOpen,
        FailureCode::ClientStalled,
    ];
    for (i, code) in FailureCode::ALL.into_iter().enumerate() {
        let m = Modes::new(DegradedScope::Key, None);
        let change = m.enter(
            crate::scope::Scope::legacy(key("a")),
            code,
            &format!("{i}.1"),
        );
        let degrades = !spared.contains(&code);
        assert_eq!(change.is_some(), degrades, "{code}");
        assert_eq!(
            m.is_degraded(crate::scope::Scope::legacy(key("a"))),
            degrades,
            "{code}"
        );
        assert!(
            !m.is_degraded(crate::scope::Scope::legacy(key("b"))),
            "{code}: key scope is the key only"
        );
    }
}

#[test]
fn node_scope_degrades_everyone_and_the_timer_ends_it() {
    let m = Modes::new(DegradedScope::Node, Some(Duration::from_secs(10)));
    m.enter(
        crate::scope::Scope::legacy(key("a")),
        FailureCode::CoherenceBelowThreshold,
        "2.1",
    )
    .expect("change");
    assert!(m.is_degraded(crate::scope::Scope::legacy(key("zzz"))));
    assert!(m.expire(monotonic_ns()).is_empty());
    let ended = m.expire(monotonic_ns() + 11_000_000_000);
    assert_eq!(ended.len(), 1);
    assert_eq!(
        (ended[0].scope.as_str(), ended[0].by),
        ("node", ChangedBy::Timer)
    );
    assert!(!m.is_degraded(crate::scope::Scope::legacy(key("a"))));
    assert_eq!(m.degraded_count(), 0);
}

#[test]
fn the_timer_task_sleeps_until_the_first_expiry_and_is_told_of_new_timers() {
    let m = Modes::new(DegradedScope::Key, Some(Duration::from_secs(10)));
    let now = monotonic_ns();
    assert_eq!(m.next_expiry(now), None, "no timer: the task waits for one");
    m.enter(
        crate::scope::Scope::legacy(key("a")),
        FailureCode::CoherenceBelowThreshold,
        "3.1",
    )
    .expect("change");
    // The permit is kept for the task's next wait.
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .build()
        .expect("runtime");
    rt.block_on(async {
        tokio::time::timeout(Duration::from_secs(5), m.timer_set())
            .await
            .expect("told of the new timer");
    });
    let left = m.next_expiry(now).expect("a timer runs");
    assert!(left > Duration::from_secs(9) && left <= Duration::from_secs(11));
    assert_eq!(m.next_expiry(now + 20_000_000_000), Some(Duration::ZERO));
    m.set_full(ScopeSel::All);
    assert_eq!(m.next_expiry(now), None);
    // Without a hold nothing has a timer, and nobody is told.
    let forever = Modes::new(DegradedScope::Node, None);
    forever.enter(
        crate::scope::Scope::legacy(key("b")),
        FailureCode::CoherenceBelowThreshold,
        "3.2",
    );
    assert_eq!(forever.next_expiry(now), None);
}

#[test]
fn a_halt_restarts_a_timer_and_a_restore_keeps_each_end() {
    let m = Modes::new(DegradedScope::Key, Some(Duration::from_secs(60)));
    let first = m
        .enter(
            crate::scope::Scope::legacy(key("a")),
            FailureCode::ExfilAlert,
            "4.1",
        )
        .expect("change");
    let again = m
        .enter(
            crate::scope::Scope::legacy(key("a")),
            FailureCode::ExfilAlert,
            "4.2",
        )
        .expect("restart");
    assert_eq!(
        (again.from, again.to),
        (RuntimeMode::Degraded, RuntimeMode::Degraded)
    );
    assert_eq!(again.since_unix_ms, first.since_unix_ms);
    assert!(again.until_unix_ms >= first.until_unix_ms);
    // What the store keeps is what a restart restores: 60 s left stays about 60 s, on
    // the monotonic clock of the new process, however the wall clock reads.
    let row = match again.store_change() {
        crate::state::Change::Degrade(row) => row,
        other => panic!("{other:?}"),
    };
    let restored = Modes::new(DegradedScope::Node, None);
    let (now, now_ns) = (SystemTime::now(), monotonic_ns());
    restored
        .restore(std::slice::from_ref(&row), now, now_ns)
        .expect("restore");
    assert!(
        restored.is_degraded(crate::scope::Scope::legacy(key("a")))
            && !restored.is_degraded(crate::scope::Scope::legacy(key("b")))
    );
    let left = restored.next_expiry(now_ns).expect("its timer");
    assert!(
        left > Duration::from_secs(58) && left <= Duration::from_secs(60),
        "{left:?}"
    );
    assert_eq!(restored.expire(now_ns + 61_000_000_000).len(), 1);
    let bad = ScopeRow {
        scope: "key:nothex".into(),
        ..row
    };
    assert!(restored.restore(&[bad], now, now_ns).is_err());
}

#[test]
fn failed_turns_leave_committed_state_alone() {
    let m = Modes::new(DegradedScope::Key, None);
    let a = key("a");
    m.commit_turn(a, "1.1", 10, 1);
    let before = m.conversation(a).expect("state");
    m.fail_turn(a);
    let after = m.conversation(a).expect("state");
    assert_eq!(after.turns_committed, before.turns_committed);
    assert_eq!(after.tokens_committed, before.tokens_committed);
    assert_eq!(after.last_committed_turn, before.last_committed_turn);
    assert_eq!(after.turns_failed, 1);
}

#[test]
fn a_legacy_key_scope_degrades_the_new_scope_of_each_request_with_that_credential() {
    use crate::{credential::Credential, scope::Identity};
    let (m, s) = (Modes::new(DegradedScope::Key, None), secret());
    let here = Some("192.0.2.0".parse().expect("addr"));
    let victim = Identity::without_store(&s, Credential::Bearer("sk-victim"), here);
    let row = ScopeRow {
        scope: format!("key:{}", victim.conversation),
        since_unix_ms: 5,
        until_unix_ms: None,
        cause: "EXFIL_ALERT".into(),
        stream_id: "hs_1".into(),
    };
    m.restore(&[row], SystemTime::now(), monotonic_ns())
        .expect("restore");
    let (degraded, change) = m.admit(&victim);
    let change = change.expect("the migration is recorded");
    assert!(degraded);
    assert_eq!(change.scope, victim.scope.name());
    assert_eq!(change.by, ChangedBy::Migration);
    assert_eq!(
        (change.cause.as_deref(), change.since_unix_ms),
        (Some("EXFIL_ALERT"), Some(5))
    );
    // A new token from the same address is the same scope, degraded now.
    let respelled = Identity::without_store(&s, Credential::Bearer("sk-new"), here);
    assert_eq!(m.admit(&respelled), (true, None));
    // The old credential from elsewhere is still held by its legacy scope.
    let elsewhere = Some("198.51.100.0".parse().expect("addr"));
    let moved = Identity::without_store(&s, Credential::Bearer("sk-victim"), elsewhere);
    let (degraded, change) = m.admit(&moved);
    assert!(degraded && change.is_some());
    // Another client elsewhere is not.
    let other = Identity::without_store(
        &s,
        Credential::Bearer("sk-other"),
        Some("203.0.113.0".parse().expect("addr")),
    );
    assert_eq!(m.admit(&other), (false, None));
}

#[test]
fn a_halt_never_shortens_a_degraded_scope() {
    let scope = crate::scope::Scope::legacy(key("a"));
    let (now, now_ns) = (SystemTime::now(), monotonic_ns());
    let row = |until_unix_ms| ScopeRow {
        scope: scope.name(),
        since_unix_ms: unix_ms(now),
        until_unix_ms,
        cause: "EXFIL_ALERT".into(),
        stream_id: "4.1".into(),
    };
    // Degraded with no end (stored under --degraded-for-s 0), restored under a one-minute
    // hold: a halt leaves it without an end.
    let m = Modes::new(DegradedScope::Key, Some(Duration::from_secs(60)));
    m.restore(&[row(None)], now, now_ns).expect("restore");
    assert_eq!(m.enter(scope, FailureCode::ExfilAlert, "4.2"), None);
    assert_eq!(m.next_expiry(now_ns), None);
    assert_eq!(
        m.degraded_state(scope).expect("degraded")["until_unix_ms"],
        serde_json::Value::Null
    );
    // An end a day away, restored under a one-minute hold: the halt keeps the day.
    let day = unix_ms(now + Duration::from_secs(86_400));
    let m = Modes::new(DegradedScope::Key, Some(Duration::from_secs(60)));
    m.restore(&[row(Some(day))], now, now_ns).expect("restore");
    assert_eq!(m.enter(scope, FailureCode::ExfilAlert, "4.2"), None);
    let state = m.degraded_state(scope).expect("degraded");
    assert_eq!(state["until_unix_ms"], day);
    assert_eq!(state["scope"], scope.name());
    assert!(m.next_expiry(now_ns).expect("its timer") > Duration::from_secs(86_000));
    // The node's state is what applies to every scope while the node is degraded.
    let m = Modes::new(DegradedScope::Node, None);
    assert_eq!(m.degraded_state(scope), None);
    m.enter(scope, FailureCode::ExfilAlert, "4.3")
        .expect("change");
    let state = m
        .degraded_state(crate::scope::Scope::legacy(key("b")))
        .expect("node");
    assert_eq!(
        (state["scope"].as_str(), &state["until_unix_ms"]),
        (Some("node"), &serde_json::Value::Null)
    );
}

#[test]
fn ask_first_takes_the_first_turn_of_each_degraded_scope_once() {
    use crate::{credential::Credential, scope::Identity};
    let s = secret();
    let at = |a: &str| Some(a.parse().expect("addr"));
    let a = Identity::without_store(&s, Credential::Bearer("sk-a"), at("192.0.2.1"));
    let b = Identity::without_store(&s, Credential::Bearer("sk-b"), at("203.0.113.9"));
    let m = Modes::new(DegradedScope::Key, Some(Duration::from_secs(60)));
    assert!(
        !m.ask_first(&a),
        "a scope that is not degraded is never asked"
    );
    m.enter(a.scope, FailureCode::ExfilAlert, "4.1")
        .expect("change");
    assert!(m.ask_first(&a), "the first turn after the halt");
    assert!(!m.ask_first(&a), "only the first");
    assert!(!m.ask_first(&b), "another scope is not degraded");
    // A later halt restarts the timer, not the question.
    m.enter(a.scope, FailureCode::ExfilAlert, "4.2")
        .expect("restart");
    assert!(!m.ask_first(&a));
    // Ended and degraded again: asked again.
    m.set_full(ScopeSel::Scope(a.scope));
    m.enter(a.scope, FailureCode::ExfilAlert, "4.3")
        .expect("change");
    assert!(m.ask_first(&a));
    // The node degraded: its first turn, whoever's, is asked, once.
    let node = Modes::new(DegradedScope::Node, None);
    node.enter(a.scope, FailureCode::ExfilAlert, "4.4")
        .expect("change");
    assert!(node.ask_first(&b) && !node.ask_first(&a));
}

#[test]
fn a_peers_scopes_are_adopted_once_and_recorded_by_peer() {
    let m = Modes::new(DegradedScope::Key, None);
    let (a, b) = (
        crate::scope::Scope::legacy(key("a")),
        crate::scope::Scope::legacy(key("b")),
    );
    m.enter(a, FailureCode::OperatorTrip, "s1");
    let now = SystemTime::now();
    let now_ms = crate::clock::unix_ms(now);
    let row = |scope: String, until: Option<u64>| crate::state::ScopeRow {
        scope,
        since_unix_ms: now_ms,
        until_unix_ms: until,
        cause: "EXFIL_ALERT".to_owned(),
        stream_id: "hs_0000000100000002".to_owned(),
    };
    let expired = crate::scope::Scope::legacy(key("c"));
    let rows = [
        row(a.name(), None),
        row(b.name(), Some(now_ms + 60_000)),
        row(expired.name(), Some(now_ms - 1)),
    ];
    let changes = m.adopt_peer(&rows, now, crate::clock::monotonic_ns());
    assert_eq!(
        changes.len(),
        1,
        "only the scope this process did not hold: {changes:?}"
    );
    assert_eq!(
        (changes[0].by, changes[0].scope.clone()),
        (ChangedBy::Peer, b.name())
    );
    assert!(m.is_degraded(b));
    assert!(
        !m.is_degraded(expired),
        "a row whose end passed is not adopted"
    );
    assert!(
        m.adopt_peer(&rows, now, crate::clock::monotonic_ns())
            .is_empty(),
        "adopted once"
    );
}
