use std::time::Duration;

use serde_json::json;

use super::*;

fn conv(id: &str) -> ConversationId {
    ConversationId::of(Some(id), "k", &[])
}

#[test]
fn the_header_names_the_conversation_else_the_prefix_digest() {
    let first = [
        json!({"role": "system", "content": "be brief"}),
        json!({"role": "user", "content": "weather?"}),
    ];
    let mut later = first.to_vec();
    later.push(json!({"role": "assistant", "tool_calls": []}));
    later.push(json!({"role": "tool", "tool_call_id": "a", "content": "x"}));
    later.push(json!({"role": "user", "content": "and tomorrow?"}));
    let a = ConversationId::of(None, "k1", &first);
    assert_eq!(a.source, IdSource::Digest);
    assert_eq!(a.id.len(), 32);
    assert_eq!(
        a,
        ConversationId::of(None, "k1", &later),
        "prefix is stable"
    );
    assert_ne!(a, ConversationId::of(None, "k2", &first), "scoped by key");
    let other = [json!({"role": "user", "content": "weather in Rome?"})];
    assert_ne!(a, ConversationId::of(None, "k1", &other));
    let h = ConversationId::of(Some("c-1"), "k1", &first);
    assert_eq!((h.id.as_str(), h.source), ("c-1", IdSource::Header));
    assert_ne!(h, ConversationId::of(Some("c-1"), "k2", &first));
}

#[test]
fn an_arrival_is_kept_from_the_first_request_that_carried_it() {
    let s = ConversationStore::new(4);
    let t0 = Instant::now();
    let t1 = t0 + Duration::from_secs(3);
    let c = conv("c");
    assert_eq!(s.arrive(&c, &["a"], t0).0.arrived["a"], t0);
    let t = s.arrive(&c, &["a", "b"], t1).0;
    assert_eq!((t.arrived["a"], t.arrived["b"]), (t0, t1));
    s.emitted(&c, ["x"], t1);
    assert_eq!(s.arrive(&c, &[], t1).0.emitted["x"], t1);
    assert!(s.arrive(&conv("other"), &[], t1).0.emitted.is_empty());
}

#[test]
fn only_a_call_released_and_never_accepted_is_known_undelivered() {
    let s = ConversationStore::new(4);
    let (c, now) = (conv("c"), Instant::now());
    s.emitted(&c, ["sent", "halted"], now);
    s.delivered(&c, ["sent", "never-released"], now);
    let t = s.arrive(&c, &[], now).0;
    assert!(t.dispatched("sent"), "released and accepted");
    assert!(
        !t.dispatched("halted"),
        "released, its frame never accepted"
    );
    assert!(t.dispatched("unknown"), "never seen here: fails closed");
    assert!(
        !t.delivered.contains("never-released"),
        "only released calls are kept"
    );
    assert!(s.arrive(&conv("other"), &[], now).0.dispatched("halted"));
}

#[test]
fn the_least_recently_used_conversation_is_evicted() {
    let s = ConversationStore::new(2);
    let now = Instant::now();
    s.emitted(&conv("a"), ["1"], now);
    s.emitted(&conv("b"), ["2"], now);
    // `a` used again: `b` is now the least recently used.
    s.arrive(&conv("a"), &[], now);
    s.arrive(&conv("c"), &[], now);
    assert_eq!(s.counts(), (2, 1));
    let ids: Vec<String> = s.view(None, now).into_iter().map(|v| v.id.id).collect();
    assert_eq!(ids, ["c", "a"]);
    assert!(
        s.arrive(&conv("b"), &[], now).0.emitted.is_empty(),
        "b forgotten"
    );
    assert_eq!(
        s.arrive(&conv("a"), &[], now).0.emitted.len(),
        0,
        "a evicted by b"
    );
}

/// Eviction never re-opens a refused key: an evicted conversation with an exhausted key
/// keeps that tool's failed calls; past [`MAX_RETAINED`] the oldest is forgotten, counted.
#[test]
fn an_evicted_conversation_keeps_its_refused_keys() {
    use crate::circuit::{transcript::rebuild_with, CircuitPolicy, ToolCall, Verdict};
    let s = ConversationStore::new(1);
    let now = Instant::now();
    let policy = std::sync::Arc::new(CircuitPolicy::default());
    let messages = [
        json!({"role": "user", "content": "x"}),
        json!({"role": "assistant", "tool_calls": [{"id": "p1", "type": "function",
               "function": {"name": "run_sql", "arguments": "{}"}}]}),
        json!({"role": "tool", "tool_call_id": "p1", "content": "permission denied"}),
    ];
    let (a, b) = (conv("a"), conv("b"));
    let (t, m) = s.arrive(&a, &["p1"], now);
    let (c, failed) = rebuild_with(policy.clone(), &messages, &t, &m).expect("input");
    s.remember(&a, failed, now);
    s.observe(&a, c.open_artifacts(), now);
    assert_eq!(c.exhausted().len(), 1);
    s.arrive(&b, &[], now); // evicts a
    assert_eq!(s.counts(), (1, 1));
    assert_eq!(s.counters.retained.get(), 1);
    let (t, m) = s.arrive(&a, &[], now); // a is back (evicting b), with its memory
    assert_eq!(m.len(), 1);
    assert_eq!(s.counters.retained.get(), 0);
    let (c, _) = rebuild_with(policy, &messages[..1], &t, &m).expect("input");
    let call = ToolCall {
        id: "p2",
        name: "run_sql",
        arguments: "{}",
    };
    assert!(matches!(c.judge(call, None), Verdict::Deny(_)));

    // A full retained set forgets the oldest, counted.
    let mut inner = Inner::default();
    let mut gone = Entry {
        timeline: Timeline::default(),
        memory: m,
        artifacts: VecDeque::new(),
        open: c.open_artifacts(),
        last_seen: now,
        tick: 0,
        turns: 0,
        tokens: 0,
        tokens_saved: 0,
    };
    gone.open[0].budget_exhausted = true;
    for i in 0..=MAX_RETAINED {
        s.retain_refusals(&mut inner, conv(&format!("r{i}")), &gone);
    }
    assert_eq!(inner.retained.len(), MAX_RETAINED);
    assert!(!inner.retained.contains_key(&conv("r0")));
    assert_eq!(s.counters.forgotten.get(), 1);
}

#[test]
fn tokens_saved_are_the_mean_tokens_per_turn() {
    let s = ConversationStore::new(2);
    let (c, now) = (conv("c"), Instant::now());
    assert_eq!(s.answered(&c, now), None, "no turn known yet");
    s.generated(&c, 10, now);
    s.generated(&c, 20, now);
    assert_eq!(s.answered(&c, now), Some(15));
    assert_eq!(s.answered(&c, now), Some(15));
    assert_eq!(s.view(Some("c"), now)[0].tokens_saved, 30);
}

#[test]
fn per_conversation_memory_is_bounded() {
    let s = ConversationStore::new(1);
    let c = conv("c");
    let t0 = Instant::now();
    for i in 0..MAX_CALLS + 10 {
        s.emitted(
            &c,
            [format!("call{i}").as_str()],
            t0 + Duration::from_millis(i as u64),
        );
    }
    // call10 is the oldest kept; a new call drops it, and its delivery with it.
    s.delivered(&c, ["call0", "call10", "call11"], t0);
    s.emitted(&c, ["late"], t0 + Duration::from_secs(1));
    let t = s.arrive(&c, &[], t0).0;
    assert_eq!(t.emitted.len(), MAX_CALLS);
    assert!(!t.emitted.contains_key("call0"), "the oldest dropped");
    assert!(t.delivered.len() == 1 && t.delivered.contains("call11"));
    assert!(t.dispatched("call10"), "forgotten: fails closed");
    assert!(!t.dispatched("late"), "released, not accepted");
    assert!(t.emitted.contains_key(&format!("call{}", MAX_CALLS + 9)));
}

/// What a restart gives back: the backoff clock (as wall-clock times), the delivered calls,
/// the failed calls, the counts and the retained conversations.
#[test]
fn a_restored_store_has_the_clock_the_failed_calls_and_the_retained_set() {
    use crate::state::CircuitRow;
    let t0 = Instant::now();
    let wall = std::time::SystemTime::now();
    let clock = WallClock::at(t0, wall);
    let s = ConversationStore::new(4);
    let c = conv("c");
    s.emitted(&c, ["x", "y"], t0);
    s.delivered(&c, ["x"], t0);
    s.arrive(&c, &["x"], t0 + Duration::from_secs(2));
    s.remember(&c, vec![FailedCall::new("x", "t", "{}", "HTTP 503")], t0);
    s.generated(&c, 10, t0);
    let rows: Vec<CircuitRow> = {
        let inner = s.inner.lock().expect("lock");
        let mut rows: Vec<CircuitRow> = inner
            .map
            .iter()
            .map(|(k, e)| persist::row(k, e, &clock))
            .collect();
        let mut m = Memory::default();
        m.remember(FailedCall::new("p1", "run_sql", "{}", "permission denied"));
        rows.push(persist::retained_row(&conv("gone"), &m));
        rows
    };
    // Restored later, in a process whose clocks read differently: the same wall-clock times.
    let later = WallClock::at(
        t0 + Duration::from_secs(100),
        wall + Duration::from_secs(100),
    );
    let back = ConversationStore::new(4);
    back.restore(&rows, &later).expect("rows");
    let t = back.arrive(&c, &[], t0 + Duration::from_secs(100)).0;
    let ms = |i: Instant| i.duration_since(t0).as_millis();
    assert_eq!(ms(t.emitted["x"]), 0);
    assert_eq!(ms(t.arrived["x"]), 2000);
    assert!(t.dispatched("x") && !t.dispatched("y"), "delivered kept");
    let (_, m) = back.arrive(&c, &[], t0);
    assert_eq!(
        m.calls().map(|c| c.result.as_str()).collect::<Vec<_>>(),
        ["HTTP 503"]
    );
    assert_eq!(back.answered(&c, t0), Some(10), "its turns are kept");
    assert_eq!(back.counters.retained.get(), 1);
    assert_eq!(
        back.arrive(&conv("gone"), &[], t0).1.len(),
        1,
        "retained comes back"
    );
    let bad = CircuitRow {
        source: "guess".to_owned(),
        ..rows[0].clone()
    };
    assert!(back.restore(&[bad], &later).is_err());
}

#[test]
fn a_time_long_ago_is_past_every_backoff() {
    let now = Instant::now();
    let clock = WallClock::at(now, std::time::SystemTime::now());
    let long_ago = clock.instant(0);
    assert!(now.duration_since(long_ago) >= Duration::from_secs(3_600));
    assert_eq!(
        clock.unix_ms(clock.instant(clock.unix_ms(now) + 5)),
        clock.unix_ms(now) + 5
    );
}
