//! The Anthropic Messages API (`POST /v1/messages`) end to end, with the official `anthropic`
//! Python SDK as the client (`tests/py/anthropic_client.py`, several turns to a process with
//! `--turns`: importing the SDK costs a second or two of CPU): haltd translates the request
//! into a chat turn and writes the client's side in the Messages schema (docs/wire-format.md,
//! "Messages API requests"; `daemon/src/wire/messages`). The kernel gate is on, as in every
//! test of the harness (no `--no-kernel-gate`).
//!
//! By sub-topic:
//! - `builtin`: the built-in source answers `messages.create`, `messages.stream` and the raw
//!   `create(stream=True)`, with `end_turn` and `max_tokens`, usage, events in order;
//! - `scripted`: the scripted upstream behind haltd: text, `max_tokens`, a tool call the SDK
//!   parses into a `tool_use` block, `reasoning_content` as a thinking block, in both modes;
//!   each request's access log line says `surface` anthropic, `endpoint` messages;
//! - `trips`: operator trips mid-text, mid-tool-input, mid-thinking and of a batch turn, at
//!   B = 5 and B = 0: the SDK's stream ends cleanly with `stop_reason: "refusal"` and
//!   haltd's halt object, exactly τ plus the post-trip tokens (at most B) frames at the
//!   SDK, and the flight recorder and the kernel's verdicts agree; an emitter that ignores
//!   the halt is held to B (by the kernel, or by the watchdog's halt);
//! - `circuit`: spec 002's five TokenCircuit cases with `tool_use` / `tool_result` history,
//!   and the hold (a judged call's `input_json_delta`s reach the client only once it is
//!   whole and judged);
//! - `identity`: degraded safe mode is one per credential across surfaces (`Authorization:
//!   Bearer K` on chat, `x-api-key: K` on Messages);
//! - `errors`: errors in Anthropic's schema and the SDK exceptions they raise (400, 404
//!   `unsupported_endpoint`, 429, 503, an upstream failure mid-stream);
//! - `llama`: llama.cpp's real server behind haltd, with and without tools, and a trip.

use std::{
    collections::BTreeMap,
    sync::atomic::{AtomicBool, Ordering::SeqCst},
    thread,
    time::Duration,
};

use anyhow::{anyhow, bail, ensure, Context, Result};
use haltd_tests::{anthropic_turns, get_json_here, in_netns, raw_exchange, trip_here, Haltd};
use serde_json::{json, Value};

mod builtin;
mod circuit;
mod errors;
mod identity;
mod llama;
pub(crate) mod scripted;
mod trips;

pub(crate) const MESSAGES: &str = "/v1/messages";

/// An Anthropic tool definition: `get_weather`, the scripted model's default tool.
pub(crate) const WEATHER_TOOL: &str = concat!(
    r#"{"name": "get_weather", "description": "The weather at a place", "input_schema": "#,
    r#"{"type": "object", "properties": {"location": {"type": "string"}, "#,
    r#""unit": {"type": "string"}}}}"#
);

/// What the scripted model's `get_weather` call carries.
pub(crate) fn paris() -> Value {
    json!({"location": "Paris, France", "unit": "celsius"})
}

/// The SDK's turns against `haltd` (from its client namespace): `common` arguments for every
/// turn after `--base-url`, then each turn's own; one result per turn.
pub(crate) fn sdk(haltd: &Haltd, common: &[&str], turns: &[Vec<String>]) -> Result<Vec<Value>> {
    let base = haltd.api_url();
    let mut args = vec!["--base-url", base.as_str()];
    args.extend_from_slice(common);
    anthropic_turns(&haltd.client_ns, &args, turns)
}

/// One turn's own arguments.
pub(crate) fn turn(args: &[&str]) -> Vec<String> {
    args.iter().map(|a| (*a).to_owned()).collect()
}

/// The stream id of an SDK result (its `x-haltd-stream-id`), which its message id names too.
pub(crate) fn stream_id(r: &Value) -> Result<String> {
    let id = r["headers"]["x-haltd-stream-id"]
        .as_str()
        .with_context(|| format!("no x-haltd-stream-id: {r}"))?;
    if let Some(msg) = r["message_id"].as_str() {
        ensure!(
            msg == format!("msg_{id}"),
            "message id {msg} for stream {id}"
        );
    }
    Ok(id.to_owned())
}

/// The event types of an SDK result (stream modes).
fn events(r: &Value) -> Vec<&str> {
    r["events"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(Value::as_str)
        .collect()
}

/// `content_block_delta` events the SDK saw.
pub(crate) fn deltas(r: &Value) -> usize {
    events(r)
        .iter()
        .filter(|e| **e == "content_block_delta")
        .count()
}

/// Frames of the stream the SDK saw: every token frame is a delta, or a tool call's header
/// (a `tool_use` block's start, with no delta).
pub(crate) fn frames_seen(r: &Value) -> usize {
    let tool_starts = r["content_types"]
        .as_array()
        .into_iter()
        .flatten()
        .filter(|t| *t == "tool_use")
        .count();
    deltas(r) + tool_starts
}

/// Whether a stream's events came in the Messages order: `message_start`, blocks (each its
/// `content_block_start`, deltas, `content_block_stop`), `message_delta`, `message_stop`.
/// A halted stream (`halted`) may end its last block without its stop.
pub(crate) fn in_messages_order(r: &Value, halted: bool) -> Result<()> {
    let ev = events(r);
    ensure!(ev.first() == Some(&"message_start"), "first event: {ev:?}");
    ensure!(
        ev.ends_with(&["message_delta", "message_stop"]),
        "last events: {ev:?}"
    );
    let mut open = false;
    for e in &ev[1..ev.len() - 2] {
        match (*e, open) {
            ("content_block_start", false) => open = true,
            ("content_block_delta", true) => {}
            ("content_block_stop", true) => open = false,
            _ => bail!(
                "{e} with a block {}: {ev:?}",
                if open { "open" } else { "closed" }
            ),
        }
    }
    ensure!(!open || halted, "a block left open: {ev:?}");
    Ok(())
}

/// An SDK turn that ended normally with `stop_reason`: no exception, a message id naming the
/// stream, usage with the output tokens, and (stream modes) the events in order.
pub(crate) fn answered(r: &Value, stop_reason: &str) -> Result<()> {
    answered_framed(r, stop_reason, true)
}

/// [`answered`]; `per_token` false: the text came without logprobs (a passed-through
/// Messages stream), so it was framed per character and the frames are not the tokens that
/// usage counts.
pub(crate) fn answered_framed(r: &Value, stop_reason: &str, per_token: bool) -> Result<()> {
    ensure!(r["ok"] == true && r["exception"].is_null(), "{r}");
    ensure!(r["stop_reason"] == stop_reason, "stop_reason: {r}");
    ensure!(r["halt"].is_null(), "a halt object: {r}");
    stream_id(r)?;
    // (A backend that reports no usage, as llama.cpp's server, has input_tokens 0.)
    let usage = &r["usage"];
    ensure!(
        usage["input_tokens"].is_u64() && usage["output_tokens"].as_u64().is_some_and(|n| n > 0),
        "usage: {r}"
    );
    if r["mode"] != "create" {
        in_messages_order(r, false)?;
        // Every frame the SDK saw is a token; a repeated tool call header (llama.cpp's
        // server names the call in every delta) is a frame too, a `ping` the SDK drops.
        let frames = frames_seen(r) as u64;
        ensure!(
            !per_token || usage["output_tokens"].as_u64() >= Some(frames),
            "{frames} frames, usage {usage}: {r}"
        );
    }
    Ok(())
}

/// The halt object of an SDK turn that haltd halted with `code`: the stream ended cleanly
/// (no exception) with `stop_reason: "refusal"`, the halt naming the stream.
pub(crate) fn refused(r: &Value, code: &str) -> Result<Value> {
    ensure!(r["ok"] == true && r["exception"].is_null(), "{r}");
    ensure!(r["stop_reason"] == "refusal", "stop_reason: {r}");
    let halt = &r["halt"];
    ensure!(
        halt["type"] == "halted" && halt["code"] == code,
        "halt: {r}"
    );
    ensure!(
        halt["stream_id"] == stream_id(r)?.as_str(),
        "the halt names another stream: {r}"
    );
    if r["mode"] != "create" {
        in_messages_order(r, true)?;
    }
    Ok(halt.clone())
}

/// A Messages request body for raw clients: `prompt` as the one user message.
pub(crate) fn body(prompt: &str, stream: bool) -> Value {
    json!({
        "model": "scripted",
        "max_tokens": 64,
        "stream": stream,
        "messages": [{"role": "user", "content": prompt}],
    })
}

/// `POST` `body` to `path` of haltd's API with `headers`, from its client namespace, in one
/// write on a connection of its own (a refusal that comes before haltd read the body cannot
/// cut it short): (status, the `x-haltd-*`, `retry-after` and `content-type` headers, body as
/// JSON or a string).
pub(crate) fn post(
    haltd: &Haltd,
    path: &str,
    body: &Value,
    headers: &[(&str, &str)],
) -> Result<(u16, Value, Value)> {
    let body = body.to_string();
    let mut request = format!(
        "POST {path} HTTP/1.1\r\nhost: haltd\r\nconnection: close\r\ncontent-type: application/json\r\ncontent-length: {}\r\n",
        body.len()
    );
    for (k, v) in headers {
        request.push_str(&format!("{k}: {v}\r\n"));
    }
    request.push_str("\r\n");
    request.push_str(&body);
    let addr = haltd.api;
    let r = in_netns(&haltd.client_ns, move || {
        raw_exchange(addr, request.as_bytes(), Duration::from_secs(30))
    })
    .with_context(|| format!("POST {path}"))?;
    let seen = json!({
        "x-haltd-mode": r.header("x-haltd-mode"),
        "x-haltd-stream-id": r.header("x-haltd-stream-id"),
        "retry-after": r.header("retry-after"),
        "content-type": r.header("content-type"),
    });
    let json = r
        .json()
        .unwrap_or_else(|_| Value::String(String::from_utf8_lossy(&r.body).into_owned()));
    Ok((r.status, seen, json))
}

/// The events of a raw Messages stream (a `StreamOutcome`'s), each its data as JSON with the
/// SSE `event:` name as `"event"`.
pub(crate) fn raw_events(o: &haltd_tests::StreamOutcome) -> Vec<Value> {
    o.events
        .iter()
        .map(|e| {
            let mut v: Value = serde_json::from_str(&e.data).unwrap_or(Value::Null);
            v["event"] = e.event.clone().into();
            v
        })
        .collect()
}

/// The trips [`tripping`] made: each answer (status, body) by stream id.
pub(crate) type Trips = BTreeMap<String, (u16, Value)>;

/// Runs `client` while tripping, through the admin API, every Messages stream that reaches
/// `at` token frames; returns `client`'s result and each trip's (status, answer) by stream
/// id.
pub(crate) fn tripping<T: Send>(
    haltd: &Haltd,
    at: u64,
    client: impl FnOnce() -> Result<T> + Send,
) -> Result<(T, Trips)> {
    tripping_on(haltd, &["messages"], at, client)
}

/// [`tripping`] for the streams of any of `endpoints` (the admin API's `endpoint`: `chat`,
/// `messages`, `responses`, ...).
pub(crate) fn tripping_on<T: Send>(
    haltd: &Haltd,
    endpoints: &[&str],
    at: u64,
    client: impl FnOnce() -> Result<T> + Send,
) -> Result<(T, Trips)> {
    let done = AtomicBool::new(false);
    let admin = haltd.admin_url();
    thread::scope(|s| {
        let runner = s.spawn(|| {
            let r = client();
            done.store(true, SeqCst);
            r
        });
        let trips = in_netns(&haltd.client_ns, || {
            trip_streams(&admin, endpoints, at, &done)
        });
        let out = runner
            .join()
            .map_err(|_| anyhow!("the client thread panicked"))??;
        Ok((out, trips?))
    })
}

/// [`tripping`]'s loop, in the client namespace, until `done`.
fn trip_streams(admin: &str, endpoints: &[&str], at: u64, done: &AtomicBool) -> Result<Trips> {
    let mut trips = BTreeMap::new();
    while !done.load(SeqCst) {
        let streams = get_json_here(&format!("{admin}/admin/streams"))?;
        for s in streams["streams"].as_array().into_iter().flatten() {
            let id = s["stream_id"].as_str().unwrap_or_default();
            let endpoint = s["endpoint"].as_str().unwrap_or_default();
            let due = endpoints.contains(&endpoint) && s["tokens"].as_u64().unwrap_or(0) >= at;
            if due && !trips.contains_key(id) {
                let answer = trip_here(&format!("{admin}/admin/streams/{id}/trip"), None)?;
                trips.insert(id.to_owned(), answer);
            }
        }
        thread::sleep(Duration::from_millis(5));
    }
    Ok(trips)
}

/// The kernel gate's send verdicts so far (`haltd_kernel_frames_total` by `verdict`).
pub(crate) fn verdicts(haltd: &Haltd) -> Result<BTreeMap<String, f64>> {
    let m = haltd.metrics()?;
    Ok(m.samples("haltd_kernel_frames_total")
        .map(|s| {
            (
                s.labels.get("verdict").cloned().unwrap_or_default(),
                s.value,
            )
        })
        .collect())
}

/// The verdicts the gate gave since `before` (the start's self-test gives one `drop_budget`
/// and one `pass_post_trip` of its own).
pub(crate) fn verdicts_since(
    haltd: &Haltd,
    before: &BTreeMap<String, f64>,
) -> Result<BTreeMap<String, f64>> {
    let mut now = verdicts(haltd)?;
    for (v, n) in now.iter_mut() {
        *n -= before.get(v).copied().unwrap_or(0.0);
    }
    Ok(now)
}

/// The access log lines (`--log-format json`) of haltd so far, by stream id.
pub(crate) fn access_lines(haltd: &Haltd) -> Result<BTreeMap<String, Value>> {
    let mut out = BTreeMap::new();
    for line in haltd.log_file("stderr.log")?.lines() {
        let Ok(v) = serde_json::from_str::<Value>(line) else {
            continue;
        };
        if v["target"] == "haltd::access" {
            let id = v["stream_id"].as_str().unwrap_or_default().to_owned();
            out.insert(id, v);
        }
    }
    Ok(out)
}

/// The access log line of each of `ids`, once all are written (a line lands as the request
/// ends, just after the client saw its end).
pub(crate) fn access_lines_of(haltd: &Haltd, ids: &[String]) -> Result<Vec<Value>> {
    let lines = haltd_tests::wait_for(Duration::from_secs(10), "access log lines", || {
        let lines = access_lines(haltd)?;
        Ok(ids.iter().all(|id| lines.contains_key(id)).then_some(lines))
    })?;
    Ok(ids.iter().map(|id| lines[id].clone()).collect())
}

/// Every line says the request spoke Anthropic's Messages API.
pub(crate) fn lines_say_messages(lines: &[Value]) -> Result<()> {
    for l in lines {
        ensure!(
            l["endpoint"] == "messages" && l["surface"] == "anthropic",
            "access log line: {l}"
        );
    }
    Ok(())
}
