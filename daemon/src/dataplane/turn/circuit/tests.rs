use super::*;
use crate::wire::{ClientRequest, Endpoint};

fn body(result: &str) -> Value {
    serde_json::json!({
        "model": "m",
        "tools": [
            {"type": "function", "function": {"name": "search"}},
            {"type": "function", "function": {"name": "other"}},
        ],
        "tool_choice": {"type": "function", "function": {"name": "search"}},
        "messages": [
            {"role": "user", "content": "find it"},
            {"role": "assistant", "tool_calls": [
                {"id": "a", "type": "function",
                 "function": {"name": "search", "arguments": "{\"q\":1}"}}]},
            {"role": "tool", "tool_call_id": "a", "content": result},
            {"role": "assistant", "tool_calls": [
                {"id": "b", "type": "function",
                 "function": {"name": "search", "arguments": "{\"q\":2}"}}]},
            {"role": "tool", "tool_call_id": "b", "content": result},
        ],
    })
}

fn arrival(store: &ConversationStore) -> Arrival<'_> {
    Arrival {
        store,
        header: None,
        key: KeyId(7),
        now: Instant::now(),
    }
}

fn apply(result: &str) -> (Result<(), HttpError>, Value) {
    let policy = Arc::new(CircuitPolicy::default());
    let store = ConversationStore::new(4);
    let at = arrival(&store);
    let b = body(result);
    let c = TurnCircuit::of_request(&policy, &b, &at).expect("replayable");
    let mut req = chat(&b);
    let r = c.apply_exhausted(&mut req, &at).map_err(|r| r.error);
    (r, req.into_json())
}

fn chat(b: &Value) -> ClientRequest {
    ClientRequest::parse(Endpoint::Chat, &serde_json::to_vec(b).expect("json")).expect("parsed")
}

#[test]
fn a_passed_through_request_gets_the_same_edit_in_its_own_fields() {
    let policy = Arc::new(CircuitPolicy::default());
    let store = ConversationStore::new(4);
    let at = arrival(&store);
    let tool = |name: &str| serde_json::json!({"type": "function", "name": name, "parameters": {"type": "object"}});
    let body = serde_json::json!({
        "model": "m",
        "instructions": "Be brief.",
        "tools": [tool("search"), tool("other")],
        "input": [
            {"role": "user", "content": "find it"},
            {"type": "function_call", "call_id": "a", "name": "search", "arguments": "{\"q\":1}"},
            {"type": "function_call_output", "call_id": "a", "output": "ValidationError: q must be a string"},
            {"type": "function_call", "call_id": "b", "name": "search", "arguments": "{\"q\":2}"},
            {"type": "function_call_output", "call_id": "b", "output": "ValidationError: q must be a string"},
        ],
    });
    let raw = serde_json::to_vec(&body).expect("json");
    let mut req = ClientRequest::parse_native(Endpoint::Responses, &raw).expect("parsed");
    let c = TurnCircuit::of_request(&policy, req.json(), &at).expect("replayable");
    assert!(c.apply_exhausted(&mut req, &at).is_ok());
    let own = req.native().expect("kept").clone();
    assert_eq!(own["tools"], serde_json::json!([tool("other")]));
    let instructions = own["instructions"].as_str().expect("instructions");
    assert!(
        instructions.starts_with("Be brief.\n\n") && instructions.contains("validation"),
        "{instructions}"
    );
    assert_eq!(
        own["input"], body["input"],
        "the transcript goes as it came"
    );
    // The translation got the chat edit, as a translated turn does.
    let chat = req.json();
    assert_eq!(
        chat["messages"]
            .as_array()
            .and_then(|m| m.last())
            .map(|m| &m["role"]),
        Some(&Value::from("system"))
    );
}

#[test]
fn a_fail_closed_budget_is_answered_without_the_model() {
    let (r, _) = apply("PermissionError: denied");
    let e = r.expect_err("answered by haltd");
    assert_eq!((e.status, e.code), (409, Some("TOOL_CIRCUIT_OPEN")));
    // The SDKs retry a 409 unless told not to: a retry would get the same answer.
    assert!(e.no_retry);
    assert!(e.message.contains("`search`"), "{}", e.message);
    let (name, artifact) = e.detail.expect("the artifact");
    assert_eq!(name, "tool_circuit");
    assert_eq!(artifact["failure_class"], "permission/auth");
}

#[test]
fn another_exhausted_budget_forwards_without_the_tool() {
    let (r, b) = apply("ValidationError: q must be a string");
    assert_eq!(r, Ok(()));
    let tools: Vec<&str> = b["tools"]
        .as_array()
        .expect("tools")
        .iter()
        .filter_map(|t| t.pointer("/function/name").and_then(Value::as_str))
        .collect();
    assert_eq!(tools, ["other"]);
    assert_eq!(b["tool_choice"], "auto");
    let last = b["messages"]
        .as_array()
        .and_then(|m| m.last())
        .expect("a note");
    assert_eq!(last["role"], "system");
    assert!(last["content"]
        .as_str()
        .is_some_and(|s| s.contains("validation")));
}

#[test]
fn open_but_not_exhausted_changes_nothing() {
    let policy = Arc::new(CircuitPolicy::default());
    let store = ConversationStore::new(4);
    let at = arrival(&store);
    let b = body("HTTP 503");
    let c = TurnCircuit::of_request(&policy, &b, &at).expect("replayable");
    let mut req = chat(&b);
    assert!(c.apply_exhausted(&mut req, &at).is_ok());
    assert_eq!(req.into_json(), b);
}

/// The conversation of `body` after `n` failed `search` calls (ids `c0`..), all `HTTP 503`.
fn transient_body(n: usize) -> Value {
    let mut messages = vec![serde_json::json!({"role": "user", "content": "find it"})];
    for i in 0..n {
        let id = format!("c{i}");
        messages.push(serde_json::json!({"role": "assistant", "tool_calls": [
            {"id": id, "type": "function",
             "function": {"name": "search", "arguments": "{}"}}]}));
        messages.push(serde_json::json!({"role": "tool", "tool_call_id": id,
                                         "content": "HTTP 503"}));
    }
    serde_json::json!({"model": "m", "messages": messages})
}

fn search(id: &str) -> Value {
    serde_json::json!({"id": id, "type": "function",
                       "function": {"name": "search", "arguments": "{}"}})
}

#[test]
fn the_backoff_clock_is_kept_between_requests() {
    // A minute of backoff: every retry below comes before it elapsed.
    let policy = Arc::new(CircuitPolicy {
        budgets: crate::circuit::Budgets {
            transient: 3,
            ..Default::default()
        },
        backoff: crate::circuit::Backoff {
            base_ms: 60_000,
            cap_ms: 60_000,
        },
        ..CircuitPolicy::default()
    });
    let ms = std::time::Duration::from_millis;
    let store = ConversationStore::new(4);
    let t0 = Instant::now();
    let at = |now| Arrival {
        store: &store,
        header: Some("conv-1"),
        key: KeyId(7),
        now,
    };
    // Request 1: c0 failed; the model retries (c1) at once: premature, 2 units.
    let mut tc = TurnCircuit::of_request(&policy, &transient_body(1), &at(t0)).expect("ok");
    assert_eq!(
        tc.judge(&[search("c1")], &store.dispatched, t0 + ms(10)),
        None
    );
    store.emitted(&tc.conversation, ["c1"], t0 + ms(10));
    // Request 2: c1 failed too. Its 2 units are rebuilt from the transcript and the
    // clock; another premature retry (2 more) would pass the budget of 3.
    let mut tc =
        TurnCircuit::of_request(&policy, &transient_body(2), &at(t0 + ms(20))).expect("ok");
    let Some(Verdict::Deny(a)) = tc.judge(&[search("c2")], &store.dispatched, t0 + ms(30)) else {
        panic!("a premature retry past the budget is denied");
    };
    assert_eq!((a.retry_count, a.budget), (2, 3));
    // Without the clock (another conversation) c1 is charged one unit, and the retry
    // (premature, 2 units) fits: the clock is what made the difference.
    let other = Arrival {
        header: Some("conv-2"),
        ..at(t0 + ms(20))
    };
    let mut tc = TurnCircuit::of_request(&policy, &transient_body(2), &other).expect("ok");
    assert_eq!(
        tc.judge(&[search("c2")], &store.dispatched, t0 + ms(30)),
        None
    );
    let views = store.view(Some("conv-1"), t0 + ms(40));
    assert_eq!(views.len(), 1);
    assert_eq!(views[0].open[0].retry_count, 2);
    assert_eq!(views[0].calls_timed, 1);
}

/// A retry of a failed turn's dispatched call is refused until it is reconciled;
/// `not_done` lets it out once.
#[test]
fn a_dispatched_call_is_not_retried_until_reconciled() {
    use crate::circuit::dispatched::{arguments_digest, DispatchedCall, Outcome};
    let policy = Arc::new(CircuitPolicy::default());
    let store = ConversationStore::new(4);
    let mut tc = TurnCircuit::of_request(&policy, &body("ok"), &arrival(&store)).expect("ok");
    let call = DispatchedCall {
        reference: "r1".to_owned(),
        key: tc.conversation.key.clone(),
        conversation: Some(tc.conversation.clone()),
        call_id: "c0".to_owned(),
        tool: "search".to_owned(),
        arguments_sha256: arguments_digest("{}"),
        delivered_unix_ms: 1,
        stream_id: "hs_1".to_owned(),
        outcome: None,
        reconciled_unix_ms: None,
        reconciled_by: None,
        retried: false,
    };
    store.dispatched.add(vec![call]);
    let now = Instant::now();
    let Some(Verdict::Deny(a)) = tc.judge(&[search("c1")], &store.dispatched, now) else {
        panic!("an unreconciled call's retry is refused");
    };
    assert_eq!(
        a.failure_class,
        crate::circuit::FailureClass::AmbiguousEffect
    );
    assert!(
        a.safety_justification.contains("haltctl reconcile r1"),
        "{a:?}"
    );
    let by = serde_json::json!("uid:0");
    store
        .dispatched
        .reconcile("r1", Outcome::NotDone, by, 2)
        .expect("held");
    assert_eq!(tc.judge(&[search("c1")], &store.dispatched, now), None);
    assert!(
        store.dispatched.list(true)[0].retried,
        "the one retry is used"
    );
}

fn part(index: u32) -> ToolCallPart {
    ToolCallPart {
        index,
        id: None,
        name: None,
        arguments: "x".to_owned(),
    }
}

#[test]
fn a_delta_for_a_judged_call_fails_closed() {
    let policy = Arc::new(CircuitPolicy::default());
    let store = ConversationStore::new(4);
    let mut tc = TurnCircuit::of_request(&policy, &body("ok"), &arrival(&store)).expect("ok");
    tc.hold(vec![part(0)], Vec::new(), Vec::new(), 0, 1);
    tc.hold(vec![part(1)], Vec::new(), Vec::new(), 0, 2);
    assert_eq!(tc.complete(&[search("c0"), search("c1")], false), 0..1);
    assert_eq!(
        tc.judge(&[search("c0")], &store.dispatched, Instant::now()),
        None
    );
    assert_eq!(tc.releasable(false).len(), 1, "call 0's delta goes out");
    tc.hold(vec![part(1)], Vec::new(), Vec::new(), 0, 3);
    assert!(!tc.out_of_order, "call 1 is still open");
    tc.hold(vec![part(0)], Vec::new(), Vec::new(), 0, 4);
    assert!(
        tc.out_of_order,
        "call 0 was judged: a late piece fails closed"
    );
}

#[test]
fn a_transcript_that_cannot_be_replayed_is_refused() {
    let policy = Arc::new(CircuitPolicy::default());
    let store = ConversationStore::new(4);
    let b = serde_json::json!({"messages": [{"role": "tool", "content": "x"}]});
    let e = TurnCircuit::of_request(&policy, &b, &arrival(&store)).expect_err("no tool_call_id");
    assert_eq!(e.status, 400);
}

/// What the OpenAI Agents SDK sends to `/v1/responses` after `search` failed `n` times with
/// `result`: each call a `function_call` item (with the item id and status the SDK keeps)
/// and its `function_call_output`, then a user message.
fn responses_body(result: &str, n: usize) -> Value {
    let mut input = vec![serde_json::json!({"role": "user", "content": "find it"})];
    for i in 0..n {
        let id = format!("call_{i}");
        input.push(
            serde_json::json!({"type": "function_call", "id": format!("fc_{i}"),
            "call_id": id, "name": "search", "arguments": format!("{{\"q\":{i}}}"),
            "status": "completed"}),
        );
        input.push(
            serde_json::json!({"type": "function_call_output", "call_id": id,
            "output": result}),
        );
    }
    input.push(serde_json::json!({"role": "user", "content": "go on"}));
    serde_json::json!({
        "model": "m",
        "instructions": "You help.",
        "tools": [{"type": "function", "name": "search", "strict": true,
                   "parameters": {"type": "object"}}],
        "input": input,
    })
}

#[test]
fn a_responses_history_feeds_the_circuit_as_chat_s_does() {
    let policy = Arc::new(CircuitPolicy::default());
    // Each case its own store: one conversation's store remembers the failed calls.
    let judged = |result: &str, n: usize| {
        let store = ConversationStore::new(4);
        let at = arrival(&store);
        let raw = serde_json::to_vec(&responses_body(result, n)).expect("json");
        let mut req = ClientRequest::parse(Endpoint::Responses, &raw).expect("translated");
        let c = TurnCircuit::of_request(&policy, req.json(), &at).expect("replayable");
        let r = c.apply_exhausted(&mut req, &at).map_err(|r| r.error);
        (r, req.into_json())
    };
    // permission/auth after one failure: answered without the model, not to be retried.
    let e = judged("PermissionError: denied", 1)
        .0
        .expect_err("answered");
    assert_eq!((e.status, e.code), (409, Some("TOOL_CIRCUIT_OPEN")));
    assert!(e.no_retry);
    let (_, artifact) = e.detail.expect("the artifact");
    assert_eq!(artifact["equivalence_key"]["tool_name"], "search");
    // validation after its repair failed too: forwarded without the tool, with the note.
    let (r, b) = judged("ValidationError: q must be a string", 2);
    assert_eq!(r, Ok(()));
    assert!(b.get("tools").is_none(), "{b}");
    let note = b["messages"]
        .as_array()
        .and_then(|m| m.last())
        .expect("note");
    assert_eq!(note["role"], "system");
    // One failure: open, not exhausted; nothing changes.
    let (r, b) = judged("ValidationError: q must be a string", 1);
    assert_eq!(r, Ok(()));
    assert!(b["tools"].is_array(), "{b}");
}
