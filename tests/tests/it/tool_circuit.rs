//! Root-only tests of TokenCircuit (spec 002, docs/tokencircuit.md) in the proxy: haltd with
//! `[tool_circuit] enabled` in front of the scripted upstream, which plays the model. Each
//! request carries a conversation whose last message is a tool result; the scripted model
//! then calls `get_weather` again (with `{"location": "Paris, France", "unit": "celsius"}`).
//!
//! Covered: a retry the key's rule forbids (validation, the failed arguments reordered and
//! re-spaced) halts the stream with `TOOL_CIRCUIT_OPEN` and the artifact in the error object
//! before any of the call reaches the client, and does not degrade the key; an allowed retry
//! (validation with changed arguments, a success) streams its call as usual; an exhausted
//! budget is answered by haltd without the model (permission/auth) or forwarded without the
//! tool and with a system note (validation after its repair failed); with the section
//! disabled nothing is judged; and two agent loops written with the official `openai`
//! SDK's tool calling (`tests/py/openai_agent.py`), stopped after one failed tool run.

use std::{fs, path::PathBuf};

use anyhow::{ensure, Context, Result};
use haltd_tests::{openai_agent, rig::Rig, temp_dir, StreamOutcome};
use serde_json::{json, Value};

use crate::UPSTREAM_BIN;

const CHAT: &str = "/v1/chat/completions";

fn rig_with(config: &str) -> Result<(Rig, PathBuf)> {
    let dir = temp_dir("tool-circuit")?;
    let path = dir.join("haltd.toml");
    fs::write(&path, config).with_context(|| format!("writing {}", path.display()))?;
    let arg = path.to_string_lossy().into_owned();
    Ok((Rig::start(UPSTREAM_BIN, &["--config", &arg])?, dir))
}

/// A conversation in which the model called `get_weather` with `args` and got `result`;
/// `directive` scripts the model's next answer.
fn conversation(args: &str, result: &str, directive: &str) -> Value {
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

fn tool_call_deltas(o: &StreamOutcome) -> usize {
    o.events
        .iter()
        .filter(|e| e.data.contains("\"tool_calls\":["))
        .count()
}

/// The artifact of a `TOOL_CIRCUIT_OPEN` halt; fails unless the stream ended so, with none
/// of the call sent.
fn circuit_halt(o: &StreamOutcome) -> Result<Value> {
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

const PARIS: &str = r#"{"location": "Paris, France", "unit": "celsius"}"#;

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
    let r = agent(&[
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
    let r = agent(&["--tool-error", "ValidationError: unit must be C or F"])?;
    ensure!(r["tools_executed"] == 1, "{r}");
    ensure!(r["error"]["class"] == "APIError", "{r}");
    ensure!(sdk_code(&r) == "TOOL_CIRCUIT_OPEN", "{r}");
    Ok(())
}
