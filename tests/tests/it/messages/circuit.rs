//! TokenCircuit (spec 002, docs/tokencircuit.md) through `POST /v1/messages`: the history is
//! Anthropic's (`tool_use` blocks in assistant messages, `tool_result` blocks in user
//! messages, `--messages-json`), which haltd translates into the chat transcript the circuit
//! replays; the scripted model then calls the tool again. The spec's five cases, as
//! `tool_circuit.rs` runs them on chat: permission/auth (answered without the model: the SDK's
//! `ConflictError`), validation (the same arguments halted in the stream before any of the
//! call reaches the SDK, changed ones let out, a failed repair forwarded without the tool),
//! transient (retries after the backoff, then a success; a third failure forwarded without
//! the tool), ambiguous/empty and side-effect uncertainty (the verifier's results decide).
//! And the hold: a call's `input_json_delta`s reach the client only once the call is whole
//! and judged, and then at once, before the turn ends.

use std::{
    slice,
    time::{Duration, Instant},
};

use anyhow::{ensure, Context, Result};
use haltd_tests::rig::Rig;
use serde_json::{json, Value};

use super::{answered, paris, raw_events, refused, sdk, stream_id, turn, MESSAGES};
use crate::UPSTREAM_BIN;

const CONFIG: &str = "[tool_circuit]\nenabled = true\nbackoff = { base_ms = 1, cap_ms = 1 }\n\
    [tool_circuit.tools.lookup]\nverifier = \"list_stations\"\n\
    [tool_circuit.tools.create_order]\nmethod = \"POST\"\nverifier = \"get_order\"\n";

const RETRY: &str = "[[script:tool_call tokens=2]]";

/// One earlier call: (id, tool name, input, the tool's result).
type Call<'a> = (&'a str, &'a str, Value, &'a str);

/// A Messages history: the user's request, then each call (an assistant `tool_use`, a user
/// `tool_result`); `directive` (the scripted model's next answer) as a text block after the
/// last result, which haltd sends as a user message after the tool message.
fn history(calls: &[Call<'_>], directive: &str) -> Value {
    let mut messages = vec![json!({"role": "user", "content": "What is the weather in Paris?"})];
    for (i, (id, name, input, result)) in calls.iter().enumerate() {
        messages.push(json!({"role": "assistant", "content": [
            {"type": "tool_use", "id": id, "name": name, "input": input}]}));
        let mut content =
            vec![json!({"type": "tool_result", "tool_use_id": id, "content": result})];
        if i + 1 == calls.len() && !directive.is_empty() {
            content.push(json!({"type": "text", "text": directive}));
        }
        messages.push(json!({"role": "user", "content": content}));
    }
    json!(messages)
}

/// The tools offered: `name`, any input.
fn tools(name: &str) -> String {
    json!([{"name": name, "input_schema": {"type": "object"}}]).to_string()
}

/// An SDK turn: `mode`, its own key (a conversation is named per key), `history`, `tool`.
fn case(mode: &str, key: &str, history: &Value, tool: &str) -> Vec<String> {
    turn(&[
        "--mode",
        mode,
        "--api-key",
        key,
        "--messages-json",
        &history.to_string(),
        "--tools",
        &tools(tool),
    ])
}

/// The artifact of a `TOOL_CIRCUIT_OPEN` halt the SDK saw, with none of the call.
fn circuit_halt(r: &Value) -> Result<Value> {
    let halt = refused(r, "TOOL_CIRCUIT_OPEN")?;
    ensure!(
        r["tool_uses"] == json!([]) && !r["content_types"].to_string().contains("tool_use"),
        "a held call reached the SDK: {r}"
    );
    ensure!(r["headers"].get("x-haltd-mode").is_none(), "{r}");
    Ok(halt["tool_circuit"].clone())
}

/// The SDK saw the model's call of `name` go out.
fn call_went_out(r: &Value, name: &str) -> Result<()> {
    answered(r, "tool_use")?;
    ensure!(
        r["tool_uses"][0]["name"] == name && r["tool_uses"][0]["input"] == paris(),
        "{r}"
    );
    Ok(())
}

/// The chat requests the upstream finished that carried `auth`.
fn upstream_chats_of(rig: &Rig, auth: &str) -> Result<Vec<Value>> {
    Ok(rig
        .up
        .requests()?
        .into_iter()
        .filter(|r| r.get("event").is_none() && r["headers"]["authorization"] == auth)
        .collect())
}

/// The model's earlier call `toolu_prev` of `name` with `input`, and its `result`.
fn prev<'a>(name: &'a str, input: Value, result: &'a str) -> Call<'a> {
    ("toolu_prev", name, input, result)
}

/// A verifier's call of `name`, and what it found.
fn verify<'a>(name: &'a str, found: &'a str) -> Call<'a> {
    ("toolu_verify", name, json!({}), found)
}

/// A case run with the SDK: (mode, its key's suffix, the history, the tool offered).
type Case = (&'static str, &'static str, Value, &'static str);

/// permission/auth (create, stream), validation (the same arguments, changed ones, a failed
/// repair).
fn weather_cases() -> Vec<Case> {
    let paris_only = || json!({"location": "Paris"});
    let denied = prev(
        "get_weather",
        paris_only(),
        "PermissionError: principal analyst may not read weather",
    );
    let spaced = json!({"unit": "celsius", "location": "Paris,  France"});
    let same = prev(
        "get_weather",
        spaced,
        "ValidationError: unit must be C or F",
    );
    let changed = prev(
        "get_weather",
        paris_only(),
        "ValidationError: location must name a country",
    );
    let repair = (
        "toolu_repair",
        "get_weather",
        paris(),
        "ValidationError: unit must be C or F",
    );
    let tool = "get_weather";
    vec![
        (
            "create",
            "perm",
            history(slice::from_ref(&denied), RETRY),
            tool,
        ),
        ("stream", "perm", history(&[denied], RETRY), tool),
        ("stream", "same", history(&[same], RETRY), tool),
        (
            "stream",
            "changed",
            history(slice::from_ref(&changed), RETRY),
            tool,
        ),
        ("stream", "repair", history(&[changed, repair], ""), tool),
    ]
}

/// ambiguous/empty (no verifier result, data found, nothing found), side-effect uncertainty
/// (no verifier result, the order found, none).
fn verifier_cases() -> Vec<Case> {
    let empty = prev("lookup", paris(), r#"{"rows": []}"#);
    let stations = verify("list_stations", r#"{"stations": ["Paris-Montsouris"]}"#);
    let timeout = prev(
        "create_order",
        paris(),
        "urllib3.exceptions.ReadTimeoutError: read timed out",
    );
    let order_found = verify("get_order", r#"{"order_id": "o-9"}"#);
    let mut cases = uncertain(
        ["amb-1", "amb-2", "amb-3"],
        &empty,
        stations,
        "list_stations",
        "lookup",
    );
    cases.extend(uncertain(
        ["se-1", "se-2", "se-3"],
        &timeout,
        order_found,
        "get_order",
        "create_order",
    ));
    cases
}

/// The three streamed cases of one uncertain call `first` of `tool` (keys `keys`): with no
/// verifier result, with the verifier's `found`, and with the verifier `verifier` finding
/// nothing.
fn uncertain(
    keys: [&'static str; 3],
    first: &Call<'static>,
    found: Call<'static>,
    verifier: &'static str,
    tool: &'static str,
) -> Vec<Case> {
    let script = format!("[[script:tool_call tokens=2 name={tool}]]");
    let none = verify(verifier, "[]");
    [
        vec![first.clone()],
        vec![first.clone(), found],
        vec![first.clone(), none],
    ]
    .into_iter()
    .zip(keys)
    .map(|(calls, key)| ("stream", key, history(&calls, &script), tool))
    .collect()
}

/// The SDK turns of [`weather_cases`] then [`verifier_cases`], each with its own key (a
/// conversation is named per key).
fn sdk_cases() -> Vec<Vec<String>> {
    weather_cases()
        .into_iter()
        .chain(verifier_cases())
        .map(|(mode, key, h, tool)| case(mode, &format!("sk-ant-{key}"), &h, tool))
        .collect()
}

/// permission/auth: the budget is 0 after one classified failure; haltd answers, the model
/// is not called: 409, the SDK's `ConflictError`, in Anthropic's error schema.
fn permission(rig: &Rig, r: &[Value]) -> Result<()> {
    for t in r {
        ensure!(
            t["exception"] == "ConflictError" && t["status"] == 409,
            "{t}"
        );
        let err = &t["body"]["error"];
        ensure!(
            t["body"]["type"] == "error" && err["code"] == "TOOL_CIRCUIT_OPEN",
            "{t}"
        );
        let a = &err["tool_circuit"];
        ensure!(
            a["failure_class"] == "permission/auth" && a["budget"] == 0,
            "{t}"
        );
        let msg = err["message"].as_str().unwrap_or_default();
        ensure!(msg.contains("get_weather"), "{t}");
    }
    ensure!(
        upstream_chats_of(rig, "Bearer sk-ant-perm")?.is_empty(),
        "the model was called for a refused tool"
    );
    Ok(())
}

/// validation: the failed arguments again (re-spaced) are the same call: halted in the
/// stream, none of the call sent; other arguments are the one repair, let out; a repair that
/// failed too is forwarded without the tool, with a note, and answered in text.
fn validation(rig: &Rig, r: &[Value]) -> Result<()> {
    let a = circuit_halt(&r[0])?;
    ensure!(
        a["failure_class"] == "validation" && a["next_action"] == "correct_arguments",
        "{a}"
    );
    ensure!(
        r[0]["text"] == "The quick",
        "the text before the call: {}",
        r[0]
    );
    call_went_out(&r[1], "get_weather")?;
    answered(&r[2], "end_turn")?;
    let id = stream_id(&r[2])?;
    let up = upstream_chats_of(rig, "Bearer sk-ant-repair")?;
    let sent = up
        .iter()
        .find(|q| q["headers"]["x-haltd-stream-id"] == id.as_str())
        .context("the repaired turn upstream")?;
    ensure!(sent["body"].get("tools").is_none(), "{sent}");
    let last = sent["body"]["messages"]
        .as_array()
        .and_then(|m| m.last())
        .context("messages")?;
    let note = last["content"].as_str().unwrap_or_default();
    ensure!(
        last["role"] == "system" && note.contains("get_weather") && note.contains("validation"),
        "{last}"
    );
    Ok(())
}

/// Whether an artifact's justification says `what`.
fn justifies(a: &Value, what: &str) -> bool {
    a["safety_justification"]
        .as_str()
        .is_some_and(|s| s.contains(what))
}

/// Ambiguous/empty (`lookup`, verifier `list_stations`) and side-effect uncertainty
/// (`create_order`, a POST, verifier `get_order`): what the verifier found decides.
fn verified(r: &[Value]) -> Result<()> {
    // An empty answer, no verifier result: halted. Data found: one retry. Nothing found: the
    // empty answer was valid; halted.
    let a = circuit_halt(&r[0])?;
    ensure!(
        a["failure_class"] == "ambiguous_effect"
            && a["equivalence_key"]["side_effect_boundary"] == false
            && a["next_action"] == "verify_effect",
        "{a}"
    );
    call_went_out(&r[1], "lookup")?;
    ensure!(justifies(&circuit_halt(&r[2])?, "valid"), "{}", r[2]);
    // A write that timed out may have happened: halted; the verifier finds the order: a
    // retry would duplicate it, halted; no order: one retry.
    let a = circuit_halt(&r[3])?;
    ensure!(
        a["failure_class"] == "ambiguous_effect"
            && a["equivalence_key"]["side_effect_boundary"] == true
            && justifies(&a, "may have happened"),
        "{a}"
    );
    ensure!(justifies(&circuit_halt(&r[4])?, "duplicate"), "{}", r[4]);
    call_went_out(&r[5], "create_order")
}

#[test]
fn token_circuit_cases_through_messages_with_the_sdk() -> Result<()> {
    let rig = Rig::with_config(UPSTREAM_BIN, CONFIG, &[])?;
    let r = sdk(&rig.haltd, &[], &sdk_cases())?;
    permission(&rig, &r[0..2])?;
    validation(&rig, &r[2..5])?;
    verified(&r[5..11])?;
    transient_retries_then_success_or_summary(&rig)?;
    judged_calls_are_held_whole_and_let_out_before_the_turn_ends(&rig)
}

/// A raw Messages stream of conversation `conv` (`x-haltd-conversation-id`): its events, each
/// with its arrival time.
fn raw_stream(rig: &Rig, conv: &str, messages: &Value) -> Result<Vec<(Instant, Value)>> {
    let tool = json!({"name": "get_weather", "input_schema": {"type": "object"}});
    let body = json!({"model": "scripted", "max_tokens": 64, "stream": true,
        "messages": messages, "tools": [tool]});
    let headers = [
        ("x-haltd-conversation-id", conv),
        ("x-api-key", "sk-ant-transient"),
    ];
    let o = rig.stream_headers(MESSAGES, &body, &headers, |_, _| {})?;
    ensure!(o.status == 200, "{o:?}");
    Ok(o.events.iter().map(|e| e.at).zip(raw_events(&o)).collect())
}

/// The id of the `tool_use` block a raw stream opened, after it ended with `tool_use`.
fn tool_use_id(events: &[(Instant, Value)]) -> Result<String> {
    let stop = events
        .iter()
        .find_map(|(_, e)| e["delta"]["stop_reason"].as_str());
    ensure!(stop == Some("tool_use"), "{events:?}");
    events
        .iter()
        .find_map(|(_, e)| {
            (e["content_block"]["type"] == "tool_use")
                .then(|| e["content_block"]["id"].as_str().map(str::to_owned))
                .flatten()
        })
        .with_context(|| format!("no tool_use block: {events:?}"))
}

/// Transient (budget 2, a 1 ms backoff): two retries after a 503 and a 504 go out, a unit
/// each; a success closes the circuit; a third failure instead is forwarded without the tool.
fn transient_retries_then_success_or_summary(rig: &Rig) -> Result<()> {
    let conv = "messages-transient";
    let first = (
        "toolu_prev",
        "get_weather",
        paris(),
        "HTTP 503 Service Unavailable",
    );
    let r1 = tool_use_id(&raw_stream(
        rig,
        conv,
        &history(slice::from_ref(&first), RETRY),
    )?)?;
    let second = (r1.as_str(), "get_weather", paris(), "504 Gateway Timeout");
    let two = history(&[first.clone(), second.clone()], RETRY);
    let r2 = tool_use_id(&raw_stream(rig, conv, &two)?)?;
    let v = rig.get_admin(&format!("/admin/circuit/{conv}"))?;
    let open = &v["conversations"][0]["open"][0];
    ensure!(
        open["failure_class"] == "transient" && open["retry_count"] == 2,
        "two retries, one unit each: {v}"
    );
    let ok = (r2.as_str(), "get_weather", paris(), r#"{"temp_c": 14}"#);
    let done = history(&[first.clone(), second.clone(), ok], RETRY);
    tool_use_id(&raw_stream(rig, conv, &done)?)?;
    let v = rig.get_admin(&format!("/admin/circuit/{conv}"))?;
    ensure!(
        v["conversations"][0]["open"]
            .as_array()
            .is_some_and(Vec::is_empty),
        "closed after the success: {v}"
    );
    // Had it failed a third time: the budget of 2 is used up; no tool for the model.
    let failed = (
        r2.as_str(),
        "get_weather",
        paris(),
        "HTTP 503 Service Unavailable",
    );
    let events = raw_stream(rig, conv, &history(&[first, second, failed], ""))?;
    let stop = events
        .iter()
        .find_map(|(_, e)| e["delta"]["stop_reason"].as_str());
    ensure!(stop == Some("end_turn"), "{events:?}");
    let sent = upstream_chats_of(rig, "Bearer sk-ant-transient")?;
    let last = sent.last().context("forwarded")?;
    ensure!(last["body"].get("tools").is_none(), "{last}");
    Ok(())
}

/// Two calls, 150 ms between the upstream's deltas: each call's block (its start and its
/// `input_json_delta`s) reaches the client at once, when the call is whole and judged (call
/// 0 when call 1 begins), not piece by piece (450 ms) and not at the end of the turn.
fn judged_calls_are_held_whole_and_let_out_before_the_turn_ends(rig: &Rig) -> Result<()> {
    let calls = [("toolu_prev", "get_weather", paris(), r#"{"temp_c": 14}"#)];
    let events = raw_stream(
        rig,
        "messages-hold",
        &history(&calls, "[[script:tool_call tokens=2 calls=2 pace_ms=150]]"),
    )?;
    let mut blocks: Vec<(Instant, Instant, usize)> = Vec::new();
    let mut tool = None;
    for (at, e) in &events {
        match e["event"].as_str() {
            Some("content_block_start") if e["content_block"]["type"] == "tool_use" => {
                blocks.push((*at, *at, 0));
                tool = e["index"].as_u64();
            }
            Some("content_block_delta") if e["index"].as_u64() == tool && tool.is_some() => {
                ensure!(e["delta"]["type"] == "input_json_delta", "{e}");
                let b = blocks.last_mut().context("a delta before its block")?;
                (b.1, b.2) = (*at, b.2 + 1);
            }
            _ => {}
        }
    }
    ensure!(blocks.len() == 2, "two tool_use blocks: {events:?}");
    // Not held, a block's start and its three pieces would span 450 ms.
    for (start, last, pieces) in &blocks {
        let spread = last.duration_since(*start);
        ensure!(
            *pieces >= 3 && spread < Duration::from_millis(250),
            "a call's {pieces} pieces reached the client over {spread:?}: not held until whole"
        );
    }
    let gap = blocks[1].0.duration_since(blocks[0].1);
    ensure!(
        gap >= Duration::from_millis(300),
        "call 0 went out {gap:?} before call 1: held to the end of the turn?"
    );
    Ok(())
}
