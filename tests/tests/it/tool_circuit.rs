//! Root-only tests of TokenCircuit (spec 002, docs/tokencircuit.md) in the proxy: haltd with
//! `[tool_circuit] enabled` in front of the scripted upstream, which plays the model. Each
//! request carries a conversation whose last message is a tool result; the scripted model
//! then calls `get_weather` again (with `{"location": "Paris, France", "unit": "celsius"}`).
//!
//! Covered: a retry the key's rule forbids (validation, the failed arguments reordered and
//! re-spaced) halts the stream with `TOOL_CIRCUIT_OPEN` and the artifact in the error
//! object before any of the call reaches the client, and does not degrade the key; an
//! allowed retry (validation with changed arguments, a success) streams its call as usual;
//! an exhausted budget is answered by haltd without the model (permission/auth) or
//! forwarded without the tool and with a system note (validation after its repair failed);
//! with the section disabled nothing is judged; the spec's transient (retries with backoff,
//! then success, or the small budget used up), ambiguous/empty (the verifier tells a valid
//! empty answer from a wrong query) and side-effect uncertainty (no retry of a write until
//! the verifier says it did not happen) cases; the tokens saved by an answer without the
//! model; every intervention has a `tool_circuit` ledger record, an invariant_violation's
//! at severity page; a call is let out as soon as it is whole and judged, not at the end of
//! the turn; a transient retry emitted before its backoff elapsed is charged two units in
//! the next request too (the conversation's clock, named by its opening messages or by
//! `x-haltd-conversation-id`); two agent loops written with the official `openai` SDK's
//! tool calling (`tests/py/openai_agent.py`), stopped after one failed tool run; and a write
//! let out but halted (by the exfiltration scanner) before its frames reached the client,
//! whose timeout is then transient, not ambiguous (in a conversation haltd does not know,
//! the same transcript fails closed).

use std::{fs, path::PathBuf};

use anyhow::{ensure, Context, Result};
use haltd_tests::{agent, in_netns, openai_agent, rig::Rig, temp_dir, StreamOutcome};
use serde_json::{json, Value};

use crate::UPSTREAM_BIN;

pub(crate) const CHAT: &str = "/v1/chat/completions";

fn rig_with(config: &str) -> Result<(Rig, PathBuf)> {
    let dir = temp_dir("tool-circuit")?;
    let path = dir.join("haltd.toml");
    fs::write(&path, config).with_context(|| format!("writing {}", path.display()))?;
    let arg = path.to_string_lossy().into_owned();
    Ok((Rig::start(UPSTREAM_BIN, &["--config", &arg])?, dir))
}

/// A conversation in which the model called `get_weather` with `args` and got `result`;
/// `directive` scripts the model's next answer.
pub(crate) fn conversation(args: &str, result: &str, directive: &str) -> Value {
    json!({
        "model": "scripted",
        "stream": true,
        "tools": [{"type": "function", "function": {"name": "get_weather",
                   "parameters": {"type": "object"}}}],
        "messages": [
            {"role": "user", "content": "What is the weather in Paris?"},
            {"role": "assistant", "content": null, "tool_calls": [{
                "id": "call_prev", "type": "function",
                "function": {"name": "get_weather", "arguments": args}}]},
            {"role": "tool", "tool_call_id": "call_prev",
             "content": format!("{result} {directive}")},
        ],
    })
}

pub(crate) fn tool_call_deltas(o: &StreamOutcome) -> usize {
    o.events
        .iter()
        .filter(|e| e.data.contains("\"tool_calls\":["))
        .count()
}

/// The artifact of a `TOOL_CIRCUIT_OPEN` halt; fails unless the stream ended so, with none
/// of the call sent.
pub(crate) fn circuit_halt(o: &StreamOutcome) -> Result<Value> {
    let err = o.error.as_ref().context("the stream ends with an error")?;
    ensure!(err["code"] == "TOOL_CIRCUIT_OPEN", "{err}");
    ensure!(
        tool_call_deltas(o) == 0,
        "a held call leaked: {:?}",
        o.events
    );
    ensure!(o.mode_header.is_none(), "{:?}", o.mode_header);
    Ok(err["tool_circuit"].clone())
}

/// `haltctl ARGS` against the rig's haltd, over the TCP admin listener with its token (the
/// admin plane's auth), from the client namespace; its standard output.
fn haltctl(rig: &Rig, args: &[&str]) -> Result<String> {
    let out = std::process::Command::new("ip")
        .args(["netns", "exec", &rig.pair.cli])
        .arg(haltd_tests::haltctl_bin()?)
        .arg("--admin")
        .arg(rig.haltd.admin.to_string())
        .arg("--admin-token-file")
        .arg(rig.haltd.admin_token_file())
        .args(args)
        .output()?;
    ensure!(
        out.status.success(),
        "haltctl {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// The id of the first tool call the stream sent.
pub(crate) fn first_call_id(o: &StreamOutcome) -> Result<String> {
    o.first_tool_call_id()
        .with_context(|| format!("no tool call id in {:?}", o.events))
}

/// `conversation`, then the model's call `id` (the Paris arguments) and its `result`.
pub(crate) fn then_call(mut b: Value, id: &str, result: &str) -> Result<Value> {
    let messages = b["messages"].as_array_mut().context("messages")?;
    messages.push(
        json!({"role": "assistant", "content": null, "tool_calls": [{
        "id": id, "type": "function",
        "function": {"name": "get_weather", "arguments": PARIS}}]}),
    );
    messages.push(json!({"role": "tool", "tool_call_id": id, "content": result}));
    Ok(b)
}

pub(crate) const PARIS: &str = r#"{"location": "Paris, France", "unit": "celsius"}"#;

/// The chat requests the upstream has finished, oldest first.
fn upstream_chats(rig: &Rig) -> Result<Vec<Value>> {
    Ok(rig
        .up
        .requests()?
        .into_iter()
        .filter(|r| r.get("event").is_none() && r["path"] == CHAT)
        .collect())
}

#[test]
fn forbidden_retries_halt_before_the_call_reaches_the_client() -> Result<()> {
    let (rig, _dir) = rig_with("[tool_circuit]\nenabled = true\n")?;
    let directive = "[[script:tool_call tokens=2]]";

    // validation: the failed arguments again, reordered and re-spaced, are the same call:
    // halted in the stream, none of the call sent, the key not degraded.
    let failed = r#"{ "unit":"celsius",   "location":"Paris,  France" }"#;
    let b = conversation(failed, "ValidationError: unit must be C or F", directive);
    let o = rig.stream(CHAT, &b, None, |_, _| {})?;
    let a = circuit_halt(&o)?;
    ensure!(a["failure_class"] == "validation", "{a}");
    ensure!(a["budget"] == 1 && a["retry_count"] == 0, "{a}");
    ensure!(a["equivalence_key"]["tool_name"] == "get_weather", "{a}");
    ensure!(a["next_action"] == "correct_arguments", "{a}");
    ensure!(a["policy"]["budgets"]["transient"] == 2, "{a}");
    let receipt = a["sample_receipts"][0].as_str().unwrap_or("");
    ensure!(receipt.starts_with("ValidationError"), "{a}");
    ensure!(
        a["safety_justification"]
            .as_str()
            .is_some_and(|s| s.contains("repeats")),
        "{a}"
    );
    let incident = rig.record("incident", &o.stream_id)?;
    ensure!(
        incident.to_string().contains("TOOL_CIRCUIT_OPEN"),
        "{incident}"
    );
    let m = rig.haltd.metrics()?;
    let trips = |class| m.value("haltd_tool_circuit_trips_total", &[("class", class)]);
    ensure!(trips("validation")? == 1.0 && trips("permission/auth")? == 0.0);

    // validation with other arguments: the one repair goes out, and the halt above did not
    // degrade the key.
    let b = conversation(
        r#"{"location": "Paris"}"#,
        "ValidationError: location must name a country",
        directive,
    );
    let o = rig.stream(CHAT, &b, None, |_, _| {})?;
    ensure!(o.error.is_none(), "{:?}", o.error);
    ensure!(o.finish_reason.as_deref() == Some("tool_calls"), "{o:?}");
    ensure!(tool_call_deltas(&o) >= 2, "{:?}", o.events);
    ensure!(o.mode_header.is_none());

    // A success: the next call goes out.
    let b = conversation(PARIS, r#"{"temp_c": 14, "sky": "clear"}"#, directive);
    let o = rig.stream(CHAT, &b, None, |_, _| {})?;
    ensure!(o.error.is_none() && tool_call_deltas(&o) >= 2, "{o:?}");
    Ok(())
}

#[test]
fn exhausted_budgets_are_answered_or_forwarded_without_the_tool() -> Result<()> {
    let (rig, _dir) = rig_with("[tool_circuit]\nenabled = true\n")?;

    // permission/auth: budget 0 after the first classified failure; haltd answers without
    // calling the model.
    let before = upstream_chats(&rig)?.len();
    let b = conversation(
        r#"{"location": "Paris"}"#,
        "PermissionError: principal analyst may not read weather",
        "[[script:tool_call tokens=2]]",
    );
    let (status, _, v) = rig.post(CHAT, &b, None)?;
    ensure!(status == 409, "{status} {v}");
    ensure!(v["error"]["code"] == "TOOL_CIRCUIT_OPEN", "{v}");
    ensure!(v["error"]["type"] == "tool_circuit_open", "{v}");
    let a = &v["error"]["tool_circuit"];
    ensure!(
        a["failure_class"] == "permission/auth" && a["budget"] == 0,
        "{v}"
    );
    ensure!(
        v["error"]["message"]
            .as_str()
            .is_some_and(|m| m.contains("get_weather")),
        "{v}"
    );
    std::thread::sleep(std::time::Duration::from_millis(200));
    ensure!(
        upstream_chats(&rig)?.len() == before,
        "the model was called"
    );
    let m = rig.haltd.metrics()?;
    let answered = m.value(
        "haltd_tool_circuit_trips_total",
        &[("class", "permission/auth")],
    )?;
    ensure!(answered == 1.0, "{answered}");

    // validation, its one repair failed too: forwarded without the tool, with a system note,
    // and the model answers in text (the forced summary).
    let mut b = conversation(
        r#"{"location": "Paris"}"#,
        "ValidationError: location must name a country",
        "",
    );
    let messages = b["messages"].as_array_mut().context("messages")?;
    messages.push(
        json!({"role": "assistant", "content": null, "tool_calls": [{
        "id": "call_repair", "type": "function",
        "function": {"name": "get_weather", "arguments": PARIS}}]}),
    );
    messages.push(json!({"role": "tool", "tool_call_id": "call_repair",
                         "content": "ValidationError: unit must be C or F"}));
    let o = rig.stream(CHAT, &b, None, |_, _| {})?;
    ensure!(
        o.error.is_none() && o.finish_reason.as_deref() == Some("stop"),
        "{o:?}"
    );
    let sent = upstream_chats(&rig)?.last().cloned().context("forwarded")?;
    let body = &sent["body"];
    ensure!(body.get("tools").is_none(), "{body}");
    let last = body["messages"]
        .as_array()
        .and_then(|m| m.last())
        .context("messages")?;
    ensure!(last["role"] == "system", "{last}");
    ensure!(
        last["content"]
            .as_str()
            .is_some_and(|s| s.contains("get_weather") && s.contains("validation")),
        "{last}"
    );
    Ok(())
}

#[test]
fn without_the_section_nothing_is_judged() -> Result<()> {
    let (rig, _dir) = rig_with("[tool_circuit]\nenabled = false\n")?;
    let b = conversation(
        PARIS,
        "PermissionError: denied",
        "[[script:tool_call tokens=2]]",
    );
    let o = rig.stream(CHAT, &b, None, |_, _| {})?;
    ensure!(o.error.is_none() && tool_call_deltas(&o) >= 2, "{o:?}");
    Ok(())
}

/// haltd's error `code` in what the SDK kept as the error's body (the error object, or the
/// whole body with it under `error`).
fn sdk_code(r: &Value) -> &Value {
    let body = &r["error"]["body"];
    match body.get("code") {
        Some(code) => code,
        None => &body["error"]["code"],
    }
}

#[test]
fn agent_loops_of_the_official_openai_sdk_are_stopped() -> Result<()> {
    let (rig, _dir) = rig_with("[tool_circuit]\nenabled = true\n")?;
    let base = format!("{}/v1", rig.haltd.api_url());
    let ns = rig.pair.cli.clone();
    let agent = |args: &[&str]| -> Result<Value> {
        let mut all = vec!["--base-url", base.as_str()];
        all.extend_from_slice(args);
        openai_agent(&ns, &all)
    };

    // permission/auth: the tool fails once; the agent's next request is answered by haltd
    // without the model (409, ConflictError in the SDK).
    let before = upstream_chats(&rig)?.len();
    // Two conversations (the same opening message under the same key would be one, and it
    // would remember the first one's refused tool).
    let r = agent(&[
        "--conversation-id",
        "sdk-permission",
        "--tool-error",
        "PermissionError: principal analyst may not read weather",
    ])?;
    ensure!(r["turns"].as_array().map(Vec::len) == Some(1), "{r}");
    ensure!(r["tools_executed"] == 1, "{r}");
    ensure!(r["error"]["status_code"] == 409, "{r}");
    ensure!(sdk_code(&r) == "TOOL_CIRCUIT_OPEN", "{r}");
    ensure!(
        upstream_chats(&rig)?.len() == before + 1,
        "the model was called again"
    );

    // validation: the model retries with the arguments that failed: the stream halts before
    // the call reaches the agent (APIError), so the tool runs once.
    let r = agent(&[
        "--conversation-id",
        "sdk-validation",
        "--tool-error",
        "ValidationError: unit must be C or F",
    ])?;
    ensure!(r["tools_executed"] == 1, "{r}");
    ensure!(r["error"]["class"] == "APIError", "{r}");
    ensure!(sdk_code(&r) == "TOOL_CIRCUIT_OPEN", "{r}");
    Ok(())
}

#[test]
fn a_premature_transient_retry_is_charged_across_requests() -> Result<()> {
    // A minute of backoff: every retry the scripted model emits comes before it elapsed.
    let (rig, _dir) = rig_with(
        "[tool_circuit]\nenabled = true\nbudgets = { transient = 3 }\n\
         backoff = { base_ms = 60000, cap_ms = 60000 }\n",
    )?;
    let directive = "[[script:tool_call tokens=2]]";
    let failed = "HTTP 503 Service Unavailable";

    // Turn 1: call_prev came back 503 and the model retries at once: premature, two units
    // of three, allowed.
    let b = conversation(PARIS, failed, directive);
    let o = rig.stream(CHAT, &b, None, |_, _| {})?;
    ensure!(o.error.is_none() && tool_call_deltas(&o) >= 2, "{o:?}");
    let retry = first_call_id(&o)?;

    // Turn 2, no header: the same opening messages name the same conversation, whose clock
    // says the retry came early. Its two units are rebuilt; another premature retry (two
    // more) would pass the budget: halted.
    let b = then_call(
        conversation(PARIS, failed, ""),
        &retry,
        &format!("{failed} {directive}"),
    )?;
    let o = rig.stream(CHAT, &b, None, |_, _| {})?;
    let a = circuit_halt(&o)?;
    ensure!(a["failure_class"] == "transient", "{a}");
    ensure!(a["retry_count"] == 2 && a["budget"] == 3, "{a}");
    ensure!(
        a["safety_justification"]
            .as_str()
            .is_some_and(|s| s.contains("backoff")),
        "{a}"
    );

    // The same transcript named as another conversation has no clock for the retry: one
    // unit charged, and the next premature retry (two) fits the budget.
    let other = [("x-haltd-conversation-id", "another-conversation")];
    let o = rig.stream_headers(CHAT, &b, &other, |_, _| {})?;
    ensure!(o.error.is_none() && tool_call_deltas(&o) >= 2, "{o:?}");

    // The operator's view (`haltctl circuit show`): both conversations, the named one by its
    // header, the other by its digest, with the halt among its interventions.
    let v = rig.get_admin("/admin/circuit")?;
    ensure!(v["enabled"] == true && v["kept"] == 2, "{v}");
    let named = rig.get_admin("/admin/circuit/another-conversation")?;
    let c = &named["conversations"][0];
    ensure!(
        c["source"] == "header" && c["open"][0]["retry_count"] == 3,
        "{named}"
    );
    let digest = v["conversations"]
        .as_array()
        .and_then(|l| l.iter().find(|c| c["source"] == "digest"))
        .context("the digest-named conversation")?;
    ensure!(digest["artifacts"][0]["retry_count"] == 2, "{digest}");
    ensure!(digest["calls_timed"] == 1, "{digest}");
    let text = haltctl(&rig, &["circuit", "show"])?;
    ensure!(
        text.contains("conversation another-conversation (header)")
            && text.contains("class=transient"),
        "{text}"
    );
    // `--json` for one conversation is the admin endpoint's answer for it.
    let json: Value = serde_json::from_str(&haltctl(
        &rig,
        &["circuit", "show", "another-conversation", "--json"],
    )?)
    .context("haltctl circuit show --json is JSON")?;
    let c = &json["conversations"][0];
    ensure!(
        json["conversations"].as_array().map(Vec::len) == Some(1)
            && c["source"] == "header"
            && c["open"][0]["retry_count"] == 3
            && c["open"] == named["conversations"][0]["open"],
        "{json}"
    );
    Ok(())
}

#[test]
fn a_judged_call_streams_before_the_turn_ends() -> Result<()> {
    let (rig, _dir) = rig_with("[tool_circuit]\nenabled = true\n")?;
    // Two calls, 150 ms between deltas: call 0 is whole once call 1 starts, ~600 ms before
    // call 1 is whole (its header and three argument pieces).
    let b = conversation(
        PARIS,
        r#"{"temp_c": 14}"#,
        "[[script:tool_call tokens=2 calls=2 pace_ms=150]]",
    );
    let mut seen: Vec<(std::time::Instant, u64)> = Vec::new();
    let o = rig.stream(CHAT, &b, None, |_, e| {
        let index = serde_json::from_str::<Value>(&e.data)
            .ok()
            .and_then(|v| v.pointer("/choices/0/delta/tool_calls/0/index")?.as_u64());
        if let Some(i) = index {
            seen.push((std::time::Instant::now(), i));
        }
    })?;
    ensure!(o.error.is_none(), "{:?}", o.error);
    ensure!(o.finish_reason.as_deref() == Some("tool_calls"), "{o:?}");
    let first = |call| seen.iter().find(|(_, i)| *i == call).map(|(t, _)| *t);
    let (Some(t0), Some(t1)) = (first(0), first(1)) else {
        anyhow::bail!("both calls streamed: {seen:?}");
    };
    // Held per turn, both would come out together at its end.
    let gap = t1.saturating_duration_since(t0);
    ensure!(
        gap >= std::time::Duration::from_millis(300),
        "call 0 went out {gap:?} before call 1: held to the end of the turn?"
    );
    Ok(())
}

#[test]
fn interventions_are_recorded_and_an_invariant_violation_pages() -> Result<()> {
    let (rig, _dir) = rig_with("[tool_circuit]\nenabled = true\n")?;
    let directive = "[[script:tool_call tokens=2]]";

    // invariant_violation: answered without the model, recorded at severity page.
    let b = conversation(
        PARIS,
        "IntegrityError: duplicate key value violates unique constraint",
        directive,
    );
    let (status, headers, v) = rig.post(CHAT, &b, None)?;
    ensure!(status == 409, "{status} {v}");
    ensure!(
        v["error"]["tool_circuit"]["failure_class"] == "invariant_violation",
        "{v}"
    );
    let page = rig.wait_record("a page-level tool_circuit record", |r| {
        r["kind"] == "tool_circuit" && r["tool_circuit"]["severity"] == "page"
    })?;
    let tc = &page["tool_circuit"];
    ensure!(tc["action"] == "answered", "{page}");
    ensure!(
        tc["artifact"]["failure_class"] == "invariant_violation",
        "{page}"
    );
    ensure!(tc["conversation"]["source"] == "digest", "{page}");
    ensure!(page["stream_id"] == headers["x-haltd-stream-id"], "{page}");
    let receipt = tc["artifact"]["sample_receipts"][0].as_str().unwrap_or("");
    ensure!(
        receipt.starts_with("[withheld: "),
        "tool output is withheld: {page}"
    );
    ensure!(
        page["message"]
            .as_str()
            .is_some_and(|m| m.starts_with("PAGE: ")),
        "{page}"
    );
    let m = rig.haltd.metrics()?;
    let pages = m.value(
        "haltd_tool_circuit_trips_total",
        &[("class", "invariant_violation")],
    )?;
    ensure!(pages == 1.0, "{pages}");

    // A halt in the stream: recorded next to its incident, at severity info.
    let failed = r#"{"unit": "celsius", "location": "Paris, France"}"#;
    let b = conversation(failed, "ValidationError: unit must be C or F", directive);
    let o = rig.stream(CHAT, &b, None, |_, _| {})?;
    circuit_halt(&o)?;
    let rec = rig.record("tool_circuit", &o.stream_id)?;
    ensure!(rec["tool_circuit"]["action"] == "halted", "{rec}");
    ensure!(rec["tool_circuit"]["severity"] == "info", "{rec}");
    ensure!(
        rec["tool_circuit"]["artifact"]["failure_class"] == "validation",
        "{rec}"
    );
    Ok(())
}

/// A conversation in which the model called `name` with `args` and got `result`; then
/// `more` (assistant calls and results); a last user message holds the scripted model's
/// `directive`, so that the tool results stay as a tool would write them.
fn calls(
    name: &str,
    args: &str,
    result: &str,
    more: &[(&str, &str, &str)],
    directive: &str,
) -> Value {
    let mut messages = vec![
        json!({"role": "user", "content": "Do the thing."}),
        json!({"role": "assistant", "content": null, "tool_calls": [{
            "id": "call_prev", "type": "function",
            "function": {"name": name, "arguments": args}}]}),
        json!({"role": "tool", "tool_call_id": "call_prev", "content": result}),
    ];
    for (i, (name, args, result)) in more.iter().enumerate() {
        let id = format!("call_more_{i}");
        messages.push(
            json!({"role": "assistant", "content": null, "tool_calls": [{
            "id": id, "type": "function",
            "function": {"name": name, "arguments": args}}]}),
        );
        messages.push(json!({"role": "tool", "tool_call_id": id, "content": result}));
    }
    messages.push(json!({"role": "user", "content": directive}));
    json!({"model": "scripted", "stream": true, "messages": messages,
           "tools": [{"type": "function", "function": {"name": name,
                      "parameters": {"type": "object"}}}]})
}

#[test]
fn transient_failures_retry_with_backoff_then_succeed_within_a_small_budget() -> Result<()> {
    // A 1 ms backoff: the scripted model's retries come after it (not premature: 1 unit).
    let (rig, _dir) = rig_with(
        "[tool_circuit]\nenabled = true\nbudgets = { transient = 2 }\n\
         backoff = { base_ms = 1, cap_ms = 1 }\n",
    )?;
    let directive = "[[script:tool_call tokens=2]]";
    let conv = [("x-haltd-conversation-id", "transient-ok")];
    let b = conversation(PARIS, "HTTP 503 Service Unavailable", directive);
    let o = rig.stream_headers(CHAT, &b, &conv, |_, _| {})?;
    ensure!(
        o.error.is_none() && tool_call_deltas(&o) >= 2,
        "retry 1: {o:?}"
    );
    let r1 = first_call_id(&o)?;
    let b = then_call(
        conversation(PARIS, "HTTP 503 Service Unavailable", ""),
        &r1,
        &format!("504 Gateway Timeout {directive}"),
    )?;
    let o = rig.stream_headers(CHAT, &b, &conv, |_, _| {})?;
    ensure!(
        o.error.is_none() && tool_call_deltas(&o) >= 2,
        "retry 2: {o:?}"
    );
    let r2 = first_call_id(&o)?;
    let v = rig.get_admin("/admin/circuit/transient-ok")?;
    let open = &v["conversations"][0]["open"][0];
    ensure!(
        open["failure_class"] == "transient" && open["retry_count"] == 2,
        "two retries charged one unit each: {v}"
    );

    // The second retry succeeds: the circuit closes and the next call goes out.
    // (The directive in a user message after it: the result stays valid JSON.)
    let mut ok = then_call(b.clone(), &r2, r#"{"temp_c": 14}"#)?;
    ok["messages"]
        .as_array_mut()
        .context("messages")?
        .push(json!({"role": "user", "content": directive}));
    let o = rig.stream_headers(CHAT, &ok, &conv, |_, _| {})?;
    ensure!(
        o.error.is_none() && tool_call_deltas(&o) >= 2,
        "after success: {o:?}"
    );
    let v = rig.get_admin("/admin/circuit/transient-ok")?;
    ensure!(
        v["conversations"][0]["open"]
            .as_array()
            .is_some_and(Vec::is_empty),
        "closed after the success: {v}"
    );

    // Had it failed a third time, the budget of 2 is used up: the turn goes to the model
    // without the tool, for a summary.
    let failed = then_call(b, &r2, "HTTP 503 Service Unavailable")?;
    let o = rig.stream_headers(CHAT, &failed, &conv, |_, _| {})?;
    ensure!(o.error.is_none(), "{o:?}");
    let sent = upstream_chats(&rig)?.last().cloned().context("forwarded")?;
    ensure!(sent["body"].get("tools").is_none(), "{sent}");
    Ok(())
}

#[test]
fn an_empty_result_is_told_apart_by_the_verifier() -> Result<()> {
    let (rig, _dir) = rig_with(
        "[tool_circuit]\nenabled = true\n\
         [tool_circuit.tools.get_weather]\nverifier = \"list_stations\"\n",
    )?;
    let directive = "[[script:tool_call tokens=2]]";
    let empty = r#"{"rows": []}"#;

    // An empty answer and no verifier result yet: a retry could be right or wrong; halted.
    let b = calls("get_weather", PARIS, empty, &[], directive);
    let a = circuit_halt(&rig.stream(CHAT, &b, None, |_, _| {})?)?;
    ensure!(a["failure_class"] == "ambiguous_effect", "{a}");
    ensure!(a["equivalence_key"]["side_effect_boundary"] == false, "{a}");
    ensure!(a["next_action"] == "verify_effect", "{a}");

    // The verifier finds data: the query was probably wrong; one retry goes out.
    let found = [(
        "list_stations",
        "{}",
        r#"{"stations": ["Paris-Montsouris"]}"#,
    )];
    let b = calls("get_weather", PARIS, empty, &found, directive);
    let o = rig.stream(CHAT, &b, None, |_, _| {})?;
    ensure!(o.error.is_none() && tool_call_deltas(&o) >= 2, "{o:?}");

    // The verifier finds nothing either: the empty answer is valid; no retry.
    let none = [("list_stations", "{}", "[]")];
    let b = calls("get_weather", PARIS, empty, &none, directive);
    let a = circuit_halt(&rig.stream(CHAT, &b, None, |_, _| {})?)?;
    ensure!(
        a["safety_justification"]
            .as_str()
            .is_some_and(|s| s.contains("valid")),
        "{a}"
    );
    Ok(())
}

#[test]
fn an_uncertain_write_waits_for_the_verifier_and_is_never_duplicated() -> Result<()> {
    let (rig, _dir) = rig_with(
        "[tool_circuit]\nenabled = true\n\
         [tool_circuit.tools.create_order]\nmethod = \"POST\"\nverifier = \"get_order\"\n",
    )?;
    let directive = "[[script:tool_call tokens=2 name=create_order]]";
    let timeout = "urllib3.exceptions.ReadTimeoutError: read timed out";

    // The write timed out after it was dispatched: it may have happened. Its retry is
    // halted before it reaches the agent.
    let b = calls("create_order", PARIS, timeout, &[], directive);
    let a = circuit_halt(&rig.stream(CHAT, &b, None, |_, _| {})?)?;
    ensure!(a["failure_class"] == "ambiguous_effect", "{a}");
    ensure!(a["equivalence_key"]["side_effect_boundary"] == true, "{a}");
    ensure!(
        a["safety_justification"]
            .as_str()
            .is_some_and(|s| s.contains("may have happened")),
        "{a}"
    );

    // The verifier finds the order: a retry would duplicate it; halted again.
    let found = [("get_order", "{}", r#"{"order_id": "o-9"}"#)];
    let b = calls("create_order", PARIS, timeout, &found, directive);
    let a = circuit_halt(&rig.stream(CHAT, &b, None, |_, _| {})?)?;
    ensure!(
        a["safety_justification"]
            .as_str()
            .is_some_and(|s| s.contains("duplicate")),
        "{a}"
    );

    // The verifier finds no order: the write did not happen; one retry goes out.
    let absent = [("get_order", "{}", "[]")];
    let b = calls("create_order", PARIS, timeout, &absent, directive);
    let o = rig.stream(CHAT, &b, None, |_, _| {})?;
    ensure!(o.error.is_none() && tool_call_deltas(&o) >= 2, "{o:?}");
    Ok(())
}

#[test]
fn an_answer_without_the_model_counts_the_tokens_saved() -> Result<()> {
    let (rig, _dir) = rig_with("[tool_circuit]\nenabled = true\n")?;
    let conv = [("x-haltd-conversation-id", "saved")];
    // Turn 1 streams: 5 text tokens and a call (its deltas count as generated tokens too).
    let b = conversation(
        PARIS,
        "HTTP 503 Service Unavailable",
        "[[script:tool_call tokens=5]]",
    );
    let o = rig.stream_headers(CHAT, &b, &conv, |_, _| {})?;
    ensure!(o.error.is_none() && tool_call_deltas(&o) >= 2, "{o:?}");
    let retry = first_call_id(&o)?;

    // Its retry fails on permission: haltd answers turn 2 itself; the model would have
    // generated about a turn's worth, the mean of the one turn known.
    let b = then_call(
        conversation(PARIS, "HTTP 503 Service Unavailable", ""),
        &retry,
        "PermissionError: principal analyst may not read weather",
    )?;
    let url = rig.url(CHAT);
    let (status, v) = in_netns(&rig.pair.cli, move || -> Result<(u16, Value)> {
        let mut resp = agent(std::time::Duration::from_secs(30))
            .post(&url)
            .header("x-haltd-conversation-id", "saved")
            .send_json(&b)?;
        let body: Value = serde_json::from_str(&resp.body_mut().read_to_string()?)?;
        Ok((resp.status().as_u16(), body))
    })?;
    ensure!(status == 409, "{status} {v}");
    let saved = v["error"]["tool_circuit"]["tokens_saved"]
        .as_u64()
        .context("tokens_saved in the artifact")?;
    ensure!(
        saved >= 5 + 2,
        "5 text tokens and the call's deltas: {saved}"
    );
    let m = rig.haltd.metrics()?;
    let total = m.value("haltd_tool_circuit_tokens_saved_total", &[])?;
    ensure!(total == saved as f64, "{total} != {saved}");
    let view = rig.get_admin("/admin/circuit/saved")?;
    ensure!(view["conversations"][0]["tokens_saved"] == saved, "{view}");
    Ok(())
}

/// A chat request for `QQorder` whose model answers with `directive`, after `history`.
fn order_chat(history: &[Value], directive: &str) -> Value {
    let mut messages = vec![json!({"role": "user", "content": "Order it."})];
    messages.extend_from_slice(history);
    messages.push(json!({"role": "user", "content": directive}));
    json!({"model": "scripted", "stream": true, "messages": messages,
           "tools": [{"type": "function", "function": {"name": "QQorder",
                      "parameters": {"type": "object"}}}]})
}

#[test]
fn a_write_halted_before_it_reached_the_client_is_not_ambiguous() -> Result<()> {
    // The exfiltration scanner holds back everything from `QQ` on while `Japan` may still
    // follow, and trips when it does: in the second call's arguments (Tokyo). By then the
    // first call was whole (the second had started), judged and let out, but its frames are
    // still held behind the scanner: the halt keeps them from the client.
    // The breach degrades the key for a second only: the retry below is on the same key.
    let dir = temp_dir("tool-circuit")?;
    let path = dir.join("haltd.toml");
    fs::write(
        &path,
        "[tool_circuit]\nenabled = true\n\
         [tool_circuit.tools.QQorder]\nmethod = \"POST\"\n\
         [detectors.exfil]\nmode = \"hard\"\n\
         extra_patterns = ['QQ[a-z]{1,16}[ -~]{0,200}Japan']\n",
    )?;
    let config = path.to_string_lossy().into_owned();
    let rig = Rig::start(
        UPSTREAM_BIN,
        &["--config", &config, "--degraded-for-s", "1"],
    )?;
    let conv = [("x-haltd-conversation-id", "halted-write")];
    let b = order_chat(&[], "[[script:tool_call name=QQorder calls=2 tokens=1]]");
    let o = rig.stream_headers(CHAT, &b, &conv, |_, _| {})?;
    let err = o.error.as_ref().context("the scanner halts the stream")?;
    ensure!(err["code"] != "TOOL_CIRCUIT_OPEN", "{err}");
    ensure!(tool_call_deltas(&o) == 0, "a call leaked: {:?}", o.events);
    let rec = rig.turn_record(&o.stream_id)?;
    ensure!(
        rec["trip_cause"] == "EXFIL_ALERT"
            && rec["tool_calls"].as_array().is_none_or(Vec::is_empty),
        "no call dispatched: {rec}"
    );
    let v = rig.get_admin("/admin/circuit/halted-write")?;
    ensure!(
        v["conversations"][0]["calls_timed"] == 1,
        "call 0 was let out: {v}"
    );
    let seq = upstream_chats(&rig)?
        .last()
        .and_then(|r| r["seq"].as_u64())
        .context("the model's request")?;

    std::thread::sleep(std::time::Duration::from_millis(1200));

    // The client sends a result for call 0 anyway (it could only have guessed it): the
    // write's timeout is transient, since haltd knows the call never reached the client,
    // and the retry goes out.
    let id = format!("call_{seq}_0");
    let history = [
        json!({"role": "assistant", "content": null, "tool_calls": [{
            "id": id, "type": "function",
            "function": {"name": "QQorder", "arguments": PARIS}}]}),
        json!({"role": "tool", "tool_call_id": id,
               "content": "urllib3.exceptions.ReadTimeoutError: read timed out"}),
    ];
    let b = order_chat(&history, "[[script:tool_call name=QQorder tokens=1]]");
    let o = rig.stream_headers(CHAT, &b, &conv, |_, _| {})?;
    ensure!(o.error.is_none() && tool_call_deltas(&o) >= 2, "{o:?}");
    let v = rig.get_admin("/admin/circuit/halted-write")?;
    let open = &v["conversations"][0]["open"][0];
    ensure!(open["failure_class"] == "transient", "{v}");
    ensure!(
        open["equivalence_key"]["side_effect_boundary"] == false,
        "{v}"
    );

    // The same transcript in a conversation haltd knows nothing of: the call may have been
    // dispatched (fail closed), so the timeout is ambiguous and the retry is halted.
    let other = [("x-haltd-conversation-id", "unknown-write")];
    let o = rig.stream_headers(CHAT, &b, &other, |_, _| {})?;
    let a = circuit_halt(&o)?;
    ensure!(a["failure_class"] == "ambiguous_effect", "{a}");
    ensure!(a["equivalence_key"]["side_effect_boundary"] == true, "{a}");
    Ok(())
}
