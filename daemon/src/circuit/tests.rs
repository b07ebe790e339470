//! The spec's five cases at the state-machine level, transcripts, and property tests.

use std::sync::Arc;
use std::time::{Duration, Instant};

use proptest::prelude::*;
use serde_json::{json, Value};

use super::artifact::DiagnosticArtifact;
use super::class::FailureClass;
use super::machine::{Circuit, ToolCall, Verdict};
use super::policy::{Backoff, Budgets, CircuitPolicy};
use super::registry::ToolRegistry;
use super::transcript::{rebuild, Timeline};

fn policy(registry: &str) -> Arc<CircuitPolicy> {
    Arc::new(CircuitPolicy {
        registry: toml::from_str::<ToolRegistry>(registry).expect("test input"),
        ..CircuitPolicy::default()
    })
}

fn call<'a>(id: &'a str, name: &'a str, arguments: &'a str) -> ToolCall<'a> {
    ToolCall {
        id,
        name,
        arguments,
    }
}

fn denied(v: &Verdict) -> &DiagnosticArtifact {
    match v {
        Verdict::Deny(a) => a,
        Verdict::Allow { cost } => panic!("allowed at cost {cost}"),
    }
}

const SQL: &str = r#"
[run_sql]
resource_class = "sql_namespace"
resource = "/schema"
auth_scope = { fixed = "analyst" }
verifier = "count_rows"

[create_order]
method = "POST"
verifier = "get_order"
"#;

/// Case 1: same principal, same restricted resource, paraphrased queries: stopped after
/// the first classified failure.
#[test]
fn permission_is_stopped_after_the_first_failure() {
    let mut c = Circuit::new(policy(SQL));
    c.record_call(
        call("1", "run_sql", r#"{"schema":"hr","q":"select salary"}"#),
        None,
    );
    let class = c.record_result(
        "1",
        r#"{"status":403,"error":"permission denied"}"#,
        None,
        true,
    );
    assert_eq!(class, Some(FailureClass::PermissionAuth));
    for q in [
        "select pay from salaries",
        "SELECT * FROM hr.salaries LIMIT 1",
    ] {
        let args = json!({"schema": "hr", "q": q}).to_string();
        let a = denied(&c.judge(call("2", "run_sql", &args), None)).clone();
        assert_eq!(a.failure_class, FailureClass::PermissionAuth);
        assert_eq!((a.budget, a.retry_count, a.budget_exhausted), (0, 0, true));
        assert_eq!(a.equivalence_key.auth_scope.as_deref(), Some("analyst"));
        assert_eq!(
            a.equivalence_key.resource_class.as_deref(),
            Some("sql_namespace:hr")
        );
        assert_eq!(a.sample_receipts.len(), 1);
    }
    // Another resource is another key.
    let other = c.judge(call("3", "run_sql", r#"{"schema":"sales","q":"x"}"#), None);
    assert_eq!(other, Verdict::Allow { cost: 0 });
    assert_eq!(c.exhausted().len(), 1);
}

/// Case 2: one repair with changed arguments, then no more.
#[test]
fn validation_allows_one_structurally_changed_repair() {
    let mut c = Circuit::new(policy(""));
    c.record_call(call("1", "search", r#"{"limit":"ten"}"#), None);
    c.record_result("1", "ValidationError: limit must be an integer", None, true);
    // The same arguments, reordered and re-spaced, are the same call.
    let same = c.judge(call("2", "search", "{ \"limit\" :  \"ten\" }"), None);
    assert!(denied(&same).safety_justification.contains("repeats"));
    assert_eq!(
        c.record_call(call("2", "search", r#"{"limit":10}"#), None),
        Verdict::Allow { cost: 1 }
    );
    c.record_result("2", "ValidationError: limit must be <= 5", None, true);
    let a = denied(&c.judge(call("3", "search", r#"{"limit":5}"#), None)).clone();
    assert_eq!((a.retry_count, a.budget), (1, 1));
    assert_eq!(a.sample_receipts.len(), 2);
    assert_eq!(c.exhausted()[0].failure_class, FailureClass::Validation);
}

/// missing_resource: the same call is refused until a discovery step (another tool's
/// successful result since the failure) may have resolved the identifier; then one retry,
/// and no more.
#[test]
fn missing_resource_allows_one_retry_after_discovery() {
    let mut c = Circuit::new(policy(""));
    let read = r#"{"path":"/srv/report.txt"}"#;
    c.record_call(call("1", "read_file", read), None);
    c.record_result("1", r#"{"status":404,"error":"no such file"}"#, None, true);
    let blind = denied(&c.judge(call("2", "read_file", read), None)).clone();
    assert_eq!(blind.failure_class, FailureClass::MissingResource);
    assert!(
        blind.safety_justification.contains("discovery"),
        "{}",
        blind.safety_justification
    );
    // A failed discovery resolves nothing.
    c.record_call(call("2", "list_files", r#"{"dir":"/srv"}"#), None);
    c.record_result("2", "PermissionError: /srv", None, true);
    assert!(matches!(
        c.judge(call("3", "read_file", read), None),
        Verdict::Deny(_)
    ));
    c.record_call(call("3", "list_files", r#"{"dir":"/srv/reports"}"#), None);
    c.record_result("3", r#"["report.txt"]"#, None, true);
    assert_eq!(
        c.record_call(call("4", "read_file", read), None),
        Verdict::Allow { cost: 1 }
    );
    c.record_result("4", r#"{"status":404}"#, None, true);
    let a = denied(&c.judge(call("5", "read_file", read), None)).clone();
    assert_eq!((a.retry_count, a.budget), (1, 1));
    assert!(a.budget_exhausted);
}

/// Case 3: 5xx and timeouts with backoff and a small budget; a premature retry costs 2.
#[test]
fn transient_retries_follow_the_backoff_and_the_budget() {
    let mut c = Circuit::new(policy(""));
    let t0 = Instant::now();
    c.record_call(call("1", "weather", r#"{"city":"Oslo"}"#), Some(t0));
    c.record_result("1", r#"{"status":503,"retry_after":2}"#, Some(t0), true);
    let early = t0 + Duration::from_millis(500);
    assert_eq!(
        c.judge(call("2", "weather", r#"{"city":"Oslo"}"#), Some(early)),
        Verdict::Allow { cost: 2 }
    );
    let late = t0 + Duration::from_secs(3);
    assert_eq!(
        c.record_call(call("2", "weather", r#"{"city":"Oslo"}"#), Some(late)),
        Verdict::Allow { cost: 1 }
    );
    c.record_result("2", "ReadTimeout: timed out", Some(late), true);
    // One unit left: a premature retry (2 units) is refused, a patient one allowed.
    let backoff_cap = Duration::from_millis(Backoff::default().cap_ms);
    let a = c.judge(call("3", "weather", r#"{"city":"Oslo"}"#), Some(late));
    let patient = c.judge(
        call("3", "weather", r#"{"city":"Oslo"}"#),
        Some(late + backoff_cap),
    );
    assert_eq!(patient, Verdict::Allow { cost: 1 });
    // Another target is closed.
    assert_eq!(
        c.judge(call("3", "news", "{}"), Some(late)),
        Verdict::Allow { cost: 0 }
    );
    match a {
        Verdict::Deny(a) => assert!(a.safety_justification.contains("backoff")),
        Verdict::Allow { cost } => assert_eq!(cost, 1, "the jitter drew 0 ms"),
    }
    c.record_call(
        call("3", "weather", r#"{"city":"Oslo"}"#),
        Some(late + backoff_cap),
    );
    c.record_result("3", "HTTP 502 Bad Gateway", None, true);
    let a = denied(&c.judge(call("4", "weather", r#"{"city":"Oslo"}"#), None)).clone();
    assert_eq!(
        (a.failure_class, a.retry_count, a.budget),
        (FailureClass::Transient, 2, 2)
    );
    // A success closes the circuit.
    let mut c = Circuit::new(policy(""));
    c.record_call(call("1", "weather", "{}"), None);
    c.record_result("1", "HTTP 503", None, true);
    c.record_call(call("2", "weather", "{}"), None);
    c.record_result("2", r#"{"temp": 3}"#, None, true);
    assert_eq!(
        c.judge(call("3", "weather", "{}"), None),
        Verdict::Allow { cost: 0 }
    );
}

/// Case 4: an empty result: the verifier tells a valid empty from a wrong query.
#[test]
fn an_empty_result_waits_for_the_verifier() {
    let q = r#"{"schema":"hr","q":"select * from staff where name='Zed'"}"#;
    for (verifier_says, retry_allowed) in [(r#"{"count": 12}"#, true), ("[]", false)] {
        let mut c = Circuit::new(policy(SQL));
        c.record_call(call("1", "run_sql", q), None);
        assert_eq!(
            c.record_result("1", r#"{"rows": []}"#, None, true),
            Some(FailureClass::AmbiguousEffect)
        );
        let a = denied(&c.judge(call("2", "run_sql", q), None)).clone();
        assert!(a.safety_justification.contains("verifier"), "{a:?}");
        c.record_call(call("v", "count_rows", r#"{"schema":"hr"}"#), None);
        assert_eq!(c.record_result("v", verifier_says, None, true), None);
        let v = c.judge(call("2", "run_sql", q), None);
        assert_eq!(
            matches!(v, Verdict::Allow { cost: 1 }),
            retry_allowed,
            "{verifier_says}: {v:?}"
        );
    }
}

/// Case 5: a write whose outcome is unknown is never repeated until the verifier says it
/// did not happen.
#[test]
fn an_uncertain_write_is_not_duplicated() {
    let order = r#"{"sku":"A1","qty":1}"#;
    for (verifier_says, retry_allowed) in [(r#"{"order_id":"o-9"}"#, false), ("[]", true)] {
        let mut c = Circuit::new(policy(SQL));
        c.record_call(call("1", "create_order", order), None);
        let class = c.record_result("1", "urllib3 ReadTimeoutError: timed out", None, true);
        assert_eq!(class, Some(FailureClass::AmbiguousEffect));
        let a = denied(&c.judge(call("2", "create_order", order), None)).clone();
        assert!(a.equivalence_key.side_effect_boundary);
        c.record_call(call("v", "get_order", r#"{"sku":"A1"}"#), None);
        c.record_result("v", verifier_says, None, true);
        let v = c.judge(call("2", "create_order", order), None);
        assert_eq!(
            matches!(v, Verdict::Allow { cost: 1 }),
            retry_allowed,
            "{verifier_says}: {v:?}"
        );
    }
}

fn assistant(calls: &[(&str, &str, Value)]) -> Value {
    let calls: Vec<Value> = calls
        .iter()
        .map(|(id, name, args)| {
            json!({"id": id, "type": "function",
                   "function": {"name": name, "arguments": args.to_string()}})
        })
        .collect();
    json!({"role": "assistant", "content": null, "tool_calls": calls})
}

fn tool(id: &str, content: &str) -> Value {
    json!({"role": "tool", "tool_call_id": id, "content": content})
}

#[test]
fn the_circuit_is_rebuilt_from_the_transcript() {
    let messages = vec![
        json!({"role": "user", "content": "book it"}),
        assistant(&[("c1", "book", json!({"slot": "9:00"}))]),
        tool("c1", "ValueError: slot must be HH:MM"),
        assistant(&[("c2", "book", json!({"slot": "09:00"}))]),
        tool(
            "c2",
            r#"{"error": {"type": "ValidationError", "message": "slot taken"}}"#,
        ),
    ];
    let c = rebuild(policy(""), &messages, &Timeline::default()).expect("test input");
    let exhausted = c.exhausted();
    assert_eq!(exhausted.len(), 1);
    let a = &exhausted[0];
    assert_eq!(
        (a.failure_class, a.retry_count, a.budget_exhausted),
        (FailureClass::Validation, 1, true)
    );
    let json = serde_json::to_value(a).expect("test input");
    assert_eq!(json["equivalence_key"]["tool_name"], "book");
    assert_eq!(json["failure_class"], "validation");
    assert_eq!(json["policy"]["budgets"]["validation"], 1);
    let back: DiagnosticArtifact = serde_json::from_value(json).expect("test input");
    assert_eq!(&back, a);
    let bad = vec![json!({"role": "tool", "content": "x"})];
    assert!(rebuild(policy(""), &bad, &Timeline::default()).is_err());
}

/// Issue 29 point 6: a transcript that trimmed (system + user) or flattened (tool messages as
/// text) the failures away does not restore the budget: the store's memory replays them.
#[test]
fn a_trimmed_or_flattened_transcript_does_not_restore_a_budget() {
    use super::memory::Memory;
    use super::transcript::rebuild_with;
    let user = json!({"role": "user", "content": "book it"});
    let full = vec![
        user.clone(),
        assistant(&[("c1", "book", json!({"slot": "9am"}))]),
        tool("c1", "ValueError: slot must be HH:MM"),
        assistant(&[("c2", "book", json!({"slot": "9:00 am"}))]),
        tool("c2", "ValueError: slot must be HH:MM"),
    ];
    let t = Timeline::default();
    let (c, failed) = rebuild_with(policy(""), &full, &t, &Memory::default()).expect("input");
    assert_eq!(c.exhausted().len(), 1, "one repair, used up");
    assert_eq!(failed.len(), 2);
    let mut memory = Memory::default();
    for f in failed {
        memory.remember(f);
    }
    let trimmed = vec![
        user.clone(),
        json!({"role": "user", "content": "try again"}),
    ];
    let flattened = vec![
        user.clone(),
        json!({"role": "assistant", "content": "I called book({\"slot\": \"9am\"})"}),
        json!({"role": "user", "content": "book returned: ValueError: slot must be HH:MM"}),
    ];
    // The newest exchange still structured, the older one gone.
    let newest_only = vec![user, full[3].clone(), full[4].clone()];
    for (name, messages) in [
        ("trimmed", &trimmed),
        ("flattened", &flattened),
        ("newest only", &newest_only),
    ] {
        let alone = rebuild(policy(""), messages, &t).expect("input");
        let v = alone.judge(call("c3", "book", r#"{"slot":"nine"}"#), None);
        assert!(
            matches!(v, Verdict::Allow { .. }),
            "{name}: without memory the budget is back: {v:?}"
        );
        let (c, _) = rebuild_with(policy(""), messages, &t, &memory).expect("input");
        let v = c.judge(call("c3", "book", r#"{"slot":"nine"}"#), None);
        assert!(matches!(v, Verdict::Deny(_)), "{name}: {v:?}");
        assert_eq!(c.exhausted().len(), 1, "{name}");
    }
}

/// A write's timeout is ambiguous only if the call reached the client: one released but
/// halted before the kernel accepted its frame is known undelivered (transient); one haltd
/// never saw (a restart, another instance) fails closed, as dispatched.
#[test]
fn a_write_halted_before_delivery_is_not_ambiguous() {
    let messages = vec![
        json!({"role": "user", "content": "order it"}),
        assistant(&[("w1", "create_order", json!({"sku": "a"}))]),
        tool("w1", "urllib3.exceptions.ReadTimeoutError: read timed out"),
    ];
    let class_with = |timeline: &Timeline| {
        let c = rebuild(policy(SQL), &messages, timeline).expect("test input");
        let open = c.open_artifacts();
        assert_eq!(open.len(), 1);
        (
            open[0].failure_class,
            open[0].equivalence_key.side_effect_boundary,
        )
    };
    let mut timeline = Timeline::default();
    assert_eq!(
        class_with(&timeline),
        (FailureClass::AmbiguousEffect, true),
        "unknown to haltd: dispatched"
    );
    timeline.emitted.insert("w1".into(), Instant::now());
    assert_eq!(
        class_with(&timeline),
        (FailureClass::Transient, false),
        "released, its frame never accepted"
    );
    timeline.delivered.insert("w1".into());
    assert_eq!(
        class_with(&timeline),
        (FailureClass::AmbiguousEffect, true),
        "delivered and answered"
    );
}

#[test]
fn configured_budgets_are_in_force_and_recorded() {
    let p = Arc::new(CircuitPolicy {
        budgets: Budgets {
            transient: 0,
            ..Budgets::default()
        },
        ..CircuitPolicy::default()
    });
    let mut c = Circuit::new(p);
    c.record_call(call("1", "t", "{}"), None);
    c.record_result("1", "HTTP 503", None, true);
    let a = denied(&c.judge(call("2", "t", "{}"), None)).clone();
    assert_eq!((a.budget, a.policy.budgets.transient), (0, 0));
}

/// A tool result drawn for the property tests: one per failure class, plus successes.
fn result_strategy() -> impl Strategy<Value = &'static str> {
    prop::sample::select(vec![
        "HTTP 503",
        "ReadTimeout: timed out",
        "ValidationError: bad",
        "HTTP 404 not found",
        "PermissionError",
        "AssertionError: invariant",
        "[]",
        r#"{"ok": true, "rows": [1]}"#,
        r#"{"id": "#,
    ])
}

proptest! {
    /// Driving the circuit live (a call goes out only when judged allowed), no key is ever
    /// charged more than its class's budget, whatever the results and budgets.
    #[test]
    fn budgets_are_never_exceeded(
        steps in prop::collection::vec(
            (0usize..3, 0usize..3, result_strategy(), 0u64..3_000), 1..60),
        transient in 0u32..4, validation in 0u32..3,
    ) {
        let mut p = (*policy(SQL)).clone();
        p.budgets = Budgets { transient, validation, ..Budgets::default() };
        p.backoff = Backoff { base_ms: 100, cap_ms: 1_000 };
        let budgets = p.budgets;
        let mut c = Circuit::new(Arc::new(p));
        let tools = ["run_sql", "create_order", "get_order"];
        let args = [r#"{"schema":"hr","q":"a"}"#, r#"{"schema":"hr","q":"b"}"#, "{}"];
        let t0 = Instant::now();
        for (i, (t, a, result, ms)) in steps.into_iter().enumerate() {
            let id = format!("c{i}");
            let now = t0 + Duration::from_millis(ms * i as u64);
            let call = call(&id, tools[t], args[a]);
            if let Verdict::Allow { .. } = c.judge(call, Some(now)) {
                c.record_call(call, Some(now));
                c.record_result(&id, result, Some(now), true);
            }
            for (target, class, charged) in c.charged() {
                prop_assert!(charged <= budgets.of(class), "{target:?} {class}: {charged}");
            }
        }
    }

    /// Keys and verdicts do not change when the arguments are reordered or re-spaced.
    #[test]
    fn keys_are_stable_under_reordering_and_whitespace(
        fields in prop::collection::btree_map("[a-z]{1,6}", "[a-zA-Z0-9 ]{0,8}", 1..6),
        pad in "[ \n\t]{0,3}",
        inner in " {0,3}",
    ) {
        let forward = serde_json::to_string(&fields).expect("test input");
        let mut pairs: Vec<String> = fields
            .iter()
            .rev()
            .map(|(k, v)| format!("{pad}\"{k}\"{pad}:{pad}\"{inner}{v}{inner}\"{pad}"))
            .collect();
        pairs.rotate_left(1);
        let shuffled = format!("{pad}{{{}}}{pad}", pairs.join(","));
        let canon = super::canonical::CanonicalArgs::of;
        prop_assert_eq!(canon(&forward), canon(&shuffled));
        let mut c = Circuit::new(policy(SQL));
        c.record_call(call("1", "search", &forward), None);
        c.record_result("1", "ValidationError", None, true);
        // A repeat of the failed arguments in another spelling is refused.
        prop_assert!(matches!(c.judge(call("2", "search", &shuffled), None), Verdict::Deny(_)));
    }
}

/// Issue 29 point 6: a zero-width space, a decomposed accent or an added `null` member does
/// not make a retry a structurally changed call: it is denied as the arguments that failed
/// validation, not let out as the one repair.
#[test]
fn an_invisible_change_is_no_validation_repair() {
    let mut c = Circuit::new(policy(""));
    c.record_call(
        call("v1", "book", r#"{"city": "Montréal", "slot": "9am"}"#),
        None,
    );
    let class = c.record_result("v1", "ValidationError: slot must be HH:MM", None, true);
    assert_eq!(class, Some(FailureClass::Validation));
    for (what, args) in [
        (
            "zero-width space",
            "{\"city\": \"Montréal\", \"slot\": \"9\u{200B}am\"}",
        ),
        (
            "decomposed é",
            "{\"city\": \"Montre\u{301}al\", \"slot\": \"9am\"}",
        ),
        (
            "null member",
            r#"{"city": "Montréal", "slot": "9am", "tz": null}"#,
        ),
    ] {
        let v = c.judge(call("v2", "book", args), None);
        assert!(
            matches!(&v, Verdict::Deny(a) if a.safety_justification.contains("repeats the arguments")),
            "{what}: {v:?}"
        );
    }
    let repaired = c.judge(
        call("v3", "book", r#"{"city": "Montréal", "slot": "09:00"}"#),
        None,
    );
    assert_eq!(repaired, Verdict::Allow { cost: 1 });
}
