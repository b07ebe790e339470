//! Root-only tests of `--source openai`: haltd in front of a scripted OpenAI-compatible
//! upstream (`scripted-upstream`, this crate's binary, standing in for vLLM and llama.cpp
//! server), each in its own network namespaces. The upstream runs on the server namespace's
//! loopback next to haltd; clients run in the client namespace: our SSE client, curl and the
//! official OpenAI Python SDK.
//!
//! Covered: forwarding of both endpoints in stream and batch mode and of `/v1/models`,
//! logprobs asked upstream but returned only when the client asked, vLLM's -9999.0 sentinel,
//! tool-call deltas, finish reasons, `n > 1`, Authorization pass-through (and never logged),
//! every upstream failure mapped to a typed end and a record, upstream cancellation on a trip
//! and on a client disconnect, degraded safe mode (scope, behaviour, operator and timer exits),
//! turn atomicity, and framing: one token per SSE event (per token, long tokens in pieces of
//! at most 64 bytes, per character when the tokens are not known), tokens delivered together
//! sharing a send.

use std::{
    io::{Read, Write},
    net::{SocketAddr, TcpStream},
    thread,
    time::{Duration, Instant},
};

use anyhow::{ensure, Context, Result};
use haltd_tests::{
    curl, in_netns, openai_sdk,
    rig::{chat, Rig},
    sse, trip_here, EventKind, Haltd, NetPair, StreamOutcome,
};
use serde_json::{json, Value};

use crate::UPSTREAM_BIN;

const SECRET: &str = "Bearer sk-haltd-test-SECRET-4711";

fn rig(haltd_extra: &[&str]) -> Result<Rig> {
    Rig::start(UPSTREAM_BIN, haltd_extra)
}

fn completion(directive: &str, stream: bool) -> Value {
    json!({"model": "scripted", "stream": stream, "prompt": directive})
}

/// The JSON of a token event's data.
fn token_chunks(o: &StreamOutcome) -> Vec<Value> {
    o.events
        .iter()
        .filter(|e| matches!(e.kind, EventKind::Token(_)))
        .map(|e| serde_json::from_str(&e.data).expect("token chunks are JSON"))
        .collect()
}

fn other_chunks(o: &StreamOutcome) -> Vec<Value> {
    o.events
        .iter()
        .filter_map(|e| match &e.kind {
            EventKind::Other(v) => Some(v.clone()),
            _ => None,
        })
        .collect()
}

fn ended_normally(o: &StreamOutcome, reason: &str) -> Result<()> {
    ensure!(o.status == 200, "status {} body {:?}", o.status, o.body);
    ensure!(
        o.finish_reason.as_deref() == Some(reason),
        "finish_reason {:?} (expected {reason}); events {:?}",
        o.finish_reason,
        o.events
    );
    ensure!(o.error.is_none(), "error {:?}", o.error);
    ensure!(o.done_at.is_some(), "no [DONE]");
    ensure!(o.malformed == 0 && o.events_after_done == 0);
    Ok(())
}

/// A chat stream with logprobs asked (one alternative, the -inf sentinel, usage), then
/// several tokens per upstream chunk.
fn chat_stream_with_logprobs(rig: &Rig) -> Result<()> {
    // Chat stream with logprobs: one alternative, as asked (the upstream may send more).
    let mut b = chat("[[script:normal tokens=5 neginf_at=2]]", true);
    b["logprobs"] = json!(true);
    b["top_logprobs"] = json!(1);
    b["stream_options"] = json!({"include_usage": true});
    let o = rig.stream("/v1/chat/completions", &b, None, |_, _| {})?;
    ended_normally(&o, "stop")?;
    let chunks = token_chunks(&o);
    ensure!(chunks.len() == 5);
    for (i, c) in chunks.iter().enumerate() {
        let entry = &c["choices"][0]["logprobs"]["content"][0];
        ensure!(
            entry["top_logprobs"].as_array().map(Vec::len) == Some(1),
            "{c}"
        );
        let lp = entry["logprob"].as_f64().context("logprob")?;
        if i == 2 {
            ensure!(lp <= -9999.0, "the -inf sentinel passes as -9999.0: {lp}");
        } else {
            ensure!(lp < 0.0 && lp > -10.0, "{lp}");
        }
    }
    ensure!(
        other_chunks(&o)
            .iter()
            .any(|c| c["usage"]["completion_tokens"] == 5),
        "usage chunk asked for: {:?}",
        o.events
    );

    // Several tokens per upstream chunk: one frame per token when they spell the text.
    let o = rig.stream(
        "/v1/chat/completions",
        &chat("[[script:normal tokens=9 per_chunk=3]]", true),
        None,
        |_, _| {},
    )?;
    ended_normally(&o, "stop")?;
    ensure!(
        o.tokens == 9,
        "9 tokens in 3 chunks give 9 frames, got {}",
        o.tokens
    );
    Ok(())
}

/// A chat batch, then a completions stream with logprobs and a completions batch.
fn batches_and_completions(rig: &Rig) -> Result<()> {
    // Chat batch.
    let (status, _, v) = rig.post(
        "/v1/chat/completions",
        &chat("[[script:normal tokens=6]]", false),
        None,
    )?;
    ensure!(status == 200, "{status} {v}");
    let content = v["choices"][0]["message"]["content"].as_str().unwrap_or("");
    ensure!(
        content.split_whitespace().count() == 6,
        "batch content {content:?}"
    );
    ensure!(v["choices"][0]["logprobs"].is_null() && v["choices"][0]["finish_reason"] == "stop");

    // Completions, stream with logprobs and batch.
    let mut c = completion("[[script:normal tokens=4]]", true);
    c["logprobs"] = json!(1);
    let o = rig.stream("/v1/completions", &c, None, |_, _| {})?;
    ended_normally(&o, "stop")?;
    ensure!(o.tokens == 4);
    for ch in token_chunks(&o) {
        ensure!(
            ch["choices"][0]["logprobs"]["token_logprobs"]
                .as_array()
                .map(Vec::len)
                == Some(1),
            "{ch}"
        );
    }
    let (status, _, v) = rig.post(
        "/v1/completions",
        &completion("[[script:normal tokens=3]]", false),
        None,
    )?;
    ensure!(
        status == 200 && v["object"] == "text_completion",
        "{status} {v}"
    );
    ensure!(
        v["choices"][0]["text"]
            .as_str()
            .is_some_and(|t| !t.is_empty()),
        "{v}"
    );
    Ok(())
}

#[test]
fn forwards_both_endpoints_stream_batch_and_models_with_logprobs_only_when_asked() -> Result<()> {
    let rig = rig(&[])?;

    // Chat stream, no logprobs asked: haltd asks the upstream for them anyway.
    let o = rig.stream(
        "/v1/chat/completions",
        &chat("[[script:normal tokens=8]]", true),
        Some(SECRET),
        |_, _| {},
    )?;
    ended_normally(&o, "stop")?;
    ensure!(o.tokens == 8, "tokens {}", o.tokens);
    for c in token_chunks(&o) {
        ensure!(
            c["choices"][0]["logprobs"].is_null(),
            "logprobs not asked: {c}"
        );
        ensure!(c["model"] == "scripted", "model {}", c["model"]);
    }
    let req = rig.up.wait_ended(0, Duration::from_secs(5))?;
    let body = &req["body"];
    ensure!(
        body["stream"] == true && body["logprobs"] == true,
        "upstream body {body}"
    );
    ensure!(body["stream_options"]["include_usage"] == true, "{body}");
    ensure!(
        req["headers"]["authorization"] == SECRET,
        "authorization not passed: {req}"
    );
    let rec = rig.turn_record(&o.stream_id)?;
    ensure!(rec["turn_status"] == "committed", "{rec}");
    ensure!(rec["upstream"]["status"] == 200, "{rec}");
    ensure!(rec["outcome"] == "completed", "{rec}");

    chat_stream_with_logprobs(&rig)?;

    batches_and_completions(&rig)?;

    // /v1/models is the upstream's.
    let url = rig.url("/v1/models");
    let models = in_netns(&rig.haltd.client_ns, move || {
        haltd_tests::get_json_here(&url)
    })?;
    ensure!(models["data"][0]["id"] == "scripted", "{models}");

    // The key is never written down.
    let ledger = std::fs::read_to_string(&rig.haltd.ledger)?;
    ensure!(
        !ledger.contains("SECRET-4711"),
        "the ledger holds the API key"
    );
    ensure!(
        !rig.haltd.log_tail(100_000).contains("SECRET-4711"),
        "the log holds the API key"
    );
    Ok(())
}

/// The parts of a batch answer that must not change on the way through haltd: each tool call's
/// name and arguments, and the finish reason (ids may differ).
pub(crate) fn batch_tool_calls(v: &Value) -> Value {
    let calls: Vec<Value> = v["choices"][0]["message"]["tool_calls"]
        .as_array()
        .into_iter()
        .flatten()
        .map(|c| json!([c["function"]["name"], c["function"]["arguments"]]))
        .collect();
    json!({"tool_calls": calls, "finish_reason": v["choices"][0]["finish_reason"]})
}

/// Issue 29 point 1: a batch reply's tool calls equal the backend's own batch answer, in both
/// shapes backends stream them: the name in the first delta only (OpenAI, vLLM) and the name
/// repeated in every delta (llama.cpp's server, whose batch replies came back named
/// `get_weatherget_weather…`). `real_backend::llama_cpp_batch_tool_calls_equal_its_own` is
/// the same against llama.cpp's server.
#[test]
fn batch_tool_calls_equal_the_backends_own_answer_in_both_delta_shapes() -> Result<()> {
    let rig = rig(&[])?;
    for shape in ["", " name_every=1"] {
        let mut b = chat(
            &format!("[[script:tool_call calls=2 args_chunks=4{shape}]]"),
            false,
        );
        b["tools"] = json!([{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]);
        let (status, _, through) = rig.post("/v1/chat/completions", &b, None)?;
        ensure!(status == 200, "{shape}: {status} {through}");
        let (status, own) = rig.post_upstream("/v1/chat/completions", &b)?;
        ensure!(status == 200, "{shape}: the upstream's own: {status} {own}");
        ensure!(
            batch_tool_calls(&own)["tool_calls"]
                .as_array()
                .is_some_and(|c| c.len() == 2),
            "{own}"
        );
        ensure!(
            batch_tool_calls(&through) == batch_tool_calls(&own),
            "shape{shape}: haltd's batch {} but the backend's own {}",
            batch_tool_calls(&through),
            batch_tool_calls(&own)
        );
    }
    Ok(())
}

#[test]
fn tool_calls_finish_reasons_and_refusals() -> Result<()> {
    let rig = rig(&[])?;
    let mut b = chat("[[script:tool_call tokens=2 calls=2]]", true);
    b["logprobs"] = json!(true);
    b["tools"] = json!([{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]);
    let o = rig.stream("/v1/chat/completions", &b, None, |_, _| {})?;
    ended_normally(&o, "tool_calls")?;
    let deltas: Vec<Value> = other_chunks(&o)
        .into_iter()
        .filter(|c| c["choices"][0]["delta"]["tool_calls"].is_array())
        .collect();
    ensure!(
        deltas.len() >= 4,
        "tool-call deltas reach the client: {deltas:?}"
    );
    let ids: Vec<&str> = deltas
        .iter()
        .filter_map(|c| c["choices"][0]["delta"]["tool_calls"][0]["id"].as_str())
        .collect();
    ensure!(ids.len() == 2, "two calls started: {ids:?}");
    ensure!(
        !o.events.iter().any(|e| e.data.contains("\"content\":\"\"")),
        "empty content events next to tool-call deltas"
    );
    let rec = rig.turn_record(&o.stream_id)?;
    let calls = rec["tool_calls"]
        .as_array()
        .context("tool_calls recorded")?;
    ensure!(
        calls.len() == 2 && calls.iter().all(|c| c["status"] == "committed"),
        "{rec}"
    );
    ensure!(rig.up.wait_ended(0, Duration::from_secs(5))?["body"]["tools"].is_array());

    // Batch: the calls assembled from their deltas.
    b["stream"] = json!(false);
    let (status, _, v) = rig.post("/v1/chat/completions", &b, None)?;
    ensure!(status == 200, "{status} {v}");
    let calls = v["choices"][0]["message"]["tool_calls"]
        .as_array()
        .context("message.tool_calls")?;
    ensure!(calls.len() == 2, "{v}");
    for c in calls {
        let args: Value = serde_json::from_str(c["function"]["arguments"].as_str().unwrap_or(""))
            .with_context(|| format!("arguments are whole JSON: {c}"))?;
        ensure!(args.is_object(), "{args}");
    }
    ensure!(v["choices"][0]["finish_reason"] == "tool_calls");

    // finish_reason passes through.
    let o = rig.stream(
        "/v1/chat/completions",
        &chat("[[script:normal tokens=3 finish=length]]", true),
        None,
        |_, _| {},
    )?;
    ended_normally(&o, "length")?;

    // n > 1: a clear 400, nothing forwarded.
    let before = rig.up.requests()?.len();
    let mut n2 = chat("hi", true);
    n2["n"] = json!(2);
    let (status, _, v) = rig.post("/v1/chat/completions", &n2, None)?;
    ensure!(
        status == 400 && v["error"]["code"] == "n_not_supported",
        "{status} {v}"
    );
    ensure!(rig.up.requests()?.len() == before, "n > 1 was forwarded");
    // Malformed bodies stay 400s.
    let (status, _, v) = rig.post("/v1/chat/completions", &json!({"model": "x"}), None)?;
    ensure!(status == 400, "{status} {v}");
    Ok(())
}

/// Tokens the upstream delivered together (written back to back, read in one receive) go out
/// together: several SSE events, one per token as always, in one send of at most 16, as a
/// relay sends what it read. By the gate's own count of the sends it passed, 400 tokens take
/// fewer sends than tokens, and no fewer than 16 tokens to a send allows. A detector trip
/// among them sends the tokens judged before it (accounted before the trip) and nothing after:
/// the client has exactly the 300 tokens before the failing one.
#[test]
fn tokens_delivered_together_share_a_send_and_a_trip_among_them_is_exact() -> Result<()> {
    let rig = rig(&["--hard-limit", "0.05"])?;
    let sends = || -> Result<f64> {
        let m = rig.haltd.metrics()?;
        m.value_or_zero("haltd_kernel_frames_total", &[("verdict", "pass")])
    };
    let before = sends()?;
    let o = rig.stream(
        "/v1/chat/completions",
        &chat("[[script:normal tokens=400]]", true),
        None,
        |_, _| {},
    )?;
    ended_normally(&o, "stop")?;
    let sent = sends()? - before;
    ensure!(
        token_chunks(&o).len() == 400,
        "{} token events",
        token_chunks(&o).len()
    );
    let rec = rig.turn_record(&o.stream_id)?;
    ensure!(rec["tokens_emitted"] == 400, "{rec}");
    println!("400 tokens written back to back: {sent} sends (head and final included)");
    // The head, 400 tokens in sends of at most 16, the final frame(s).
    ensure!(
        sent >= 2.0 + 25.0,
        "{sent} sends: more than 16 tokens to a send"
    );
    ensure!(
        sent < 300.0,
        "{sent} sends for 400 tokens delivered back to back: not shared"
    );

    let o = rig.stream(
        "/v1/chat/completions",
        &chat("[[script:normal tokens=400 neginf_at=300]]", true),
        None,
        |_, _| {},
    )?;
    o.halted_cleanly("COHERENCE_BELOW_THRESHOLD")?;
    ensure!(
        o.tokens == 300,
        "the 300 tokens before the failing one: got {}",
        o.tokens
    );
    let rec = rig.turn_record(&o.stream_id)?;
    ensure!(rec["trip_token_index"] == 300, "{rec}");
    ensure!(rec["halt_tokens_post_trip"] == 0, "{rec}");
    Ok(())
}

#[test]
fn halt_monitor_sees_upstream_logprobs_and_the_generation_is_cancelled() -> Result<()> {
    let rig = rig(&["--hard-limit", "0.05"])?;
    let o = rig.stream(
        "/v1/chat/completions",
        &chat("[[script:normal tokens=40 pace_ms=10 neginf_at=3]]", true),
        None,
        |_, _| {},
    )?;
    o.halted_cleanly("COHERENCE_BELOW_THRESHOLD")?;
    ensure!(
        o.tokens == 3,
        "the failing 4th token is never emitted: got {}",
        o.tokens
    );
    let up = rig.up.wait_ended(0, Duration::from_secs(5))?;
    ensure!(
        up["outcome"] == "cancelled",
        "upstream generation not cancelled: {up}"
    );
    ensure!(up["tokens_sent"].as_u64().unwrap_or(99) < 40, "{up}");
    let rec = rig.turn_record(&o.stream_id)?;
    ensure!(rec["upstream"]["cancel_reason"] == "trip", "{rec}");
    ensure!(rec["turn_status"] == "failed", "{rec}");
    ensure!(rec["trip_token_index"] == 3, "{rec}");

    // A backend without logprobs cannot be scored: with the monitor on, that halts before
    // the first token (fail closed), and says why.
    let o = rig.stream(
        "/v1/chat/completions",
        &chat("[[script:normal tokens=5 no_logprobs=1]]", true),
        None,
        |_, _| {},
    )?;
    o.halted_cleanly("COHERENCE_BELOW_THRESHOLD")?;
    ensure!(o.tokens == 0, "unscored tokens emitted: {}", o.tokens);
    let err = o.error.clone().unwrap_or_default();
    ensure!(err["upstream"]["kind"] == "missing_logprobs", "{err}");
    let rec = rig.turn_record(&o.stream_id)?;
    ensure!(
        rec["upstream"]["failure"]["kind"] == "missing_logprobs",
        "{rec}"
    );
    Ok(())
}

/// Mid-stream failures: a typed terminal event, an incident and a failed turn record.
fn mid_stream_failures_end_typed(rig: &Rig) -> Result<()> {
    // Mid-stream failures: typed terminal event with the upstream detail.
    // (script, kind, tokens the client gets before the end: what the upstream sent first)
    for (script, kind, tokens) in [
        ("[[script:stall tokens=3]]", "stalled", 3..=3),
        ("[[script:garbage tokens=2]]", "malformed", 2..=2),
        (
            "[[script:error_event tokens=2 msg=boom-from-vllm]]",
            "error_event",
            2..=2,
        ),
        ("[[script:llama_error tokens=2]]", "error_event", 2..=2),
        ("[[script:die tokens=2]]", "early_eof", 2..=2),
        (
            "[[script:normal tokens=2 finish=error]]",
            "error_event",
            2..=2,
        ),
    ] {
        let o = rig.stream("/v1/chat/completions", &chat(script, true), None, |_, _| {})?;
        o.halted_cleanly("UPSTREAM_FAILURE")
            .with_context(|| format!("{script}: {:?}", o.events))?;
        let err = o.error.clone().unwrap_or_default();
        ensure!(err["upstream"]["kind"] == kind, "{script}: {err}");
        ensure!(tokens.contains(&o.tokens), "{script}: {} tokens", o.tokens);
        if script.contains("boom") {
            ensure!(err["upstream"]["message"]
                .as_str()
                .unwrap_or("")
                .contains("boom-from-vllm"));
        }
        let inc = rig.wait_record("incident", |r| {
            r["kind"] == "incident" && r["stream_id"] == o.stream_id.as_str()
        })?;
        ensure!(inc["trip_cause"] == "UPSTREAM_FAILURE", "{inc}");
        let rec = rig.turn_record(&o.stream_id)?;
        ensure!(rec["upstream"]["failure"]["kind"] == kind, "{rec}");
        ensure!(rec["turn_status"] == "failed");
        if script.contains("boom") {
            // The client got the upstream's words; the record keeps only their length and
            // hash (no --record-token-text).
            let msg = rec["upstream"]["failure"]["message"].as_str().unwrap_or("");
            let digest = haltd::sampling::withheld("boom-from-vllm");
            ensure!(
                msg == format!("the upstream sent an error event: {digest}"),
                "{rec}"
            );
            ensure!(rec["sampling"]["reason"] == "incident", "{rec}");
        }
    }
    // A reset connection is a transport failure (or an early end), never a silent one.
    let o = rig.stream(
        "/v1/chat/completions",
        &chat("[[script:die tokens=2 rst=1]]", true),
        None,
        |_, _| {},
    )?;
    o.halted_cleanly("UPSTREAM_FAILURE")?;
    let k = o.error.clone().unwrap_or_default()["upstream"]["kind"].clone();
    ensure!(k == "io_error" || k == "early_eof", "{k}");
    Ok(())
}

/// Failures before the response began: an HTTP status that says whose fault it was.
fn failures_before_the_response_get_a_status(rig: &Rig) -> Result<()> {
    // Failures before the response began: an HTTP status that says whose fault it was.
    for (script, want, kind) in [
        (
            "[[script:slow_head head_ms=3000]]",
            504,
            "first_token_timeout",
        ),
        ("[[script:status code=400]]", 400, "http_status"),
        ("[[script:status code=404]]", 404, "http_status"),
        ("[[script:status code=500]]", 502, "http_status"),
        (
            "[[script:status code=429 retry_after=7]]",
            429,
            "http_status",
        ),
        (
            "[[script:status code=503 retry_after=7]]",
            503,
            "http_status",
        ),
    ] {
        for stream in [true, false] {
            let (status, h, v) = rig.post("/v1/chat/completions", &chat(script, stream), None)?;
            ensure!(status == want, "{script} stream={stream}: {status} {v}");
            ensure!(v["error"]["code"] == "UPSTREAM_FAILURE", "{script}: {v}");
            ensure!(v["error"]["upstream"]["kind"] == kind, "{script}: {v}");
            if want == 429 || want == 503 {
                ensure!(h["retry-after"] == "7", "retry-after passes through: {h}");
            }
            let id = h["x-haltd-stream-id"]
                .as_str()
                .context("stream id")?
                .to_owned();
            let rec = rig.turn_record(&id)?;
            ensure!(rec["outcome"] == "upstream_failed", "{rec}");
            ensure!(rec["failure_codes"][0] == "UPSTREAM_FAILURE", "{rec}");
        }
    }
    // Batch: an upstream error is never a 200 without the error object.
    let (status, _, v) = rig.post(
        "/v1/chat/completions",
        &chat("[[script:error_event tokens=2]]", false),
        None,
    )?;
    ensure!(status == 502 || status == 400, "{status} {v}");
    ensure!(v["error"]["code"] == "UPSTREAM_FAILURE", "{v}");
    Ok(())
}

/// Upstream failures do not put anyone into degraded mode, and the metrics count them.
fn failures_leave_no_degraded_mode_and_are_counted(rig: &Rig) -> Result<()> {
    // Upstream failures do not put anyone into degraded mode.
    let o = rig.stream(
        "/v1/chat/completions",
        &chat("[[script:normal tokens=2]]", true),
        None,
        |_, _| {},
    )?;
    ended_normally(&o, "stop")?;
    ensure!(o.mode_header.is_none(), "degraded after upstream failures");
    let m = rig.haltd.metrics()?;
    // Proxied token frames are timed from the upstream receive that carried them.
    let overhead = m.histogram_count("haltd_token_overhead_seconds")?;
    ensure!(
        overhead >= 2.0,
        "haltd_token_overhead_seconds_count {overhead}"
    );
    for kind in [
        "stalled",
        "malformed",
        "error_event",
        "early_eof",
        "first_token_timeout",
        "http_status",
    ] {
        let n = m
            .value("haltd_upstream_failures_total", &[("kind", kind)])
            .unwrap_or(0.0);
        ensure!(
            n >= 1.0,
            "haltd_upstream_failures_total{{kind={kind}}} = {n}"
        );
    }
    Ok(())
}

/// Nobody listening at the upstream: connection refused.
fn connection_refused_is_typed() -> Result<()> {
    // Nobody listening: connection refused.
    let pair = NetPair::new()?;
    let haltd = Haltd::start(
        &pair,
        &["--source", "openai", "--upstream", "http://127.0.0.1:9"],
    )?;
    let url = format!("{}/v1/chat/completions", haltd.api_url());
    let (status, v) = in_netns(&pair.cli, move || -> Result<(u16, Value)> {
        let (s, _, body) = sse::post(&url, &chat("hi", true), Duration::from_secs(10))?;
        Ok((s, serde_json::from_str(&body)?))
    })?;
    ensure!(
        status == 502 && v["error"]["upstream"]["kind"] == "connect_refused",
        "{status} {v}"
    );
    Ok(())
}

#[test]
fn every_upstream_failure_ends_typed_and_recorded_and_other_streams_carry_on() -> Result<()> {
    let rig = rig(&[
        "--upstream-first-token-timeout-ms",
        "600",
        "--upstream-stall-timeout-ms",
        "400",
    ])?;
    // A long healthy stream runs through all of it.
    let url = rig.url("/v1/chat/completions");
    let bystander = haltd_tests::spawn_in_netns(&rig.haltd.client_ns, move || {
        sse::stream(
            &url,
            &chat("[[script:normal tokens=60 pace_ms=40]]", true),
            Duration::from_secs(30),
            |_, _| {},
        )
    });
    thread::sleep(Duration::from_millis(100));

    mid_stream_failures_end_typed(&rig)?;

    failures_before_the_response_get_a_status(&rig)?;

    let o = bystander.join().expect("bystander thread")?;
    ended_normally(&o, "stop")?;
    ensure!(
        o.tokens == 60,
        "the healthy stream lost tokens: {}",
        o.tokens
    );

    failures_leave_no_degraded_mode_and_are_counted(&rig)?;
    drop(rig);

    connection_refused_is_typed()
}

/// A client (key `gone-NTH`) that sends `script`'s request and goes away: after some of the
/// stream with `read_first`, else while the upstream is still thinking.
fn send_and_go_away(
    addr: SocketAddr,
    ns: &str,
    nth: usize,
    script: &str,
    read_first: bool,
) -> Result<()> {
    let body = chat(script, true).to_string();
    in_netns(ns, move || -> Result<()> {
        let mut s = TcpStream::connect(addr)?;
        write!(
            s,
            "POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\nauthorization: Bearer gone-{nth}\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{body}",
            body.len()
        )?;
        if read_first {
            let mut buf = [0u8; 2048];
            let mut got = 0;
            while got < 1500 {
                let n = s.read(&mut buf)?;
                ensure!(n > 0, "stream ended early");
                got += n;
            }
        } else {
            thread::sleep(Duration::from_millis(300));
        }
        Ok(())
    }) // the socket closes here
}

#[test]
fn trips_and_client_disconnects_cancel_the_upstream_generation() -> Result<()> {
    let rig = rig(&[])?;
    // Operator trip after 5 tokens.
    let admin = rig.haltd.admin_url();
    let mut tripped = None;
    // (Each part uses its own API key: the trip puts its key into degraded mode.)
    let o = rig.stream(
        "/v1/chat/completions",
        &chat("[[script:normal tokens=500 pace_ms=10]]", true),
        Some("Bearer trip"),
        |p, ev| {
            if tripped.is_none() && matches!(ev.kind, EventKind::Token(_)) && p.tokens == 5 {
                let url = format!("{admin}/admin/streams/{}/trip", p.stream_id);
                tripped = Some(trip_here(&url, None));
            }
        },
    )?;
    o.halted_cleanly("OPERATOR_TRIP")?;
    let (code, info) = tripped.context("tripped")??;
    ensure!(code == 200, "{code} {info}");
    let tau = info["trip_token_index"].as_u64().context("τ")? as usize;
    ensure!(
        o.tokens <= tau + 5,
        "post-trip tokens {} > B",
        o.tokens - tau
    );
    let up = rig.up.wait_ended(0, Duration::from_secs(3))?;
    ensure!(up["outcome"] == "cancelled", "{up}");
    ensure!(up["tokens_sent"].as_u64().unwrap_or(500) < 100, "{up}");
    let rec = rig.turn_record(&o.stream_id)?;
    ensure!(rec["upstream"]["cancelled"] == true && rec["upstream"]["cancel_reason"] == "trip");

    // The client goes away mid-stream, and while the upstream is still thinking.
    for (nth, script, read_first) in [
        (1, "[[script:normal tokens=500 pace_ms=10]]", true),
        (2, "[[script:slow_head head_ms=20000]]", false),
    ] {
        let t0 = Instant::now();
        send_and_go_away(rig.haltd.api, &rig.haltd.client_ns, nth, script, read_first)?;
        let up = rig.up.wait_ended(nth, Duration::from_secs(3))?;
        ensure!(
            up["outcome"] == "cancelled" || up["outcome"] == "stalled_then_cancelled",
            "{script}: {up}"
        );
        ensure!(
            t0.elapsed() < Duration::from_secs(3),
            "{script}: cancelled late"
        );
        let rec = rig.wait_record("client_gone turn", |r| {
            r["kind"] == "turn"
                && r["upstream"]["cancel_reason"] == "client_gone"
                && r["seq"].as_u64().unwrap_or(0) > 0
                && r["outcome"] == "client_gone"
        })?;
        ensure!(rec["turn_status"] == "failed", "{rec}");
    }
    let m = rig.haltd.metrics()?;
    ensure!(
        m.value("haltd_upstream_cancels_total", &[("reason", "client_gone")])
            .unwrap_or(0.0)
            >= 2.0
    );
    ensure!(
        m.value("haltd_upstream_cancels_total", &[("reason", "trip")])
            .unwrap_or(0.0)
            >= 1.0
    );
    Ok(())
}

fn fingerprint(rig: &Rig, auth: &str) -> String {
    rig.haltd
        .key_fingerprint(auth)
        .expect("the node secret of the rig's haltd")
}

fn haltctl(rig: &Rig, args: &[&str]) -> Result<Value> {
    Ok(serde_json::from_str(&rig.haltctl(true, args)?)?)
}

/// Trips a stream of `auth` (operator).
fn trip_one(rig: &Rig, auth: &str) -> Result<String> {
    rig.trip_stream_of(auth)
}

/// Key A is degraded: its stream requests with tools are served as batch, without the tools;
/// its batch requests are marked too.
fn degraded_key_is_served_as_batch_without_tools(rig: &Rig, a: &str) -> Result<()> {
    // Key A is degraded: a stream request with tools is served as batch (one content event),
    // tools are not forwarded and tool-call deltas not emitted.
    let mut with_tools = chat("[[script:tool_call tokens=4 calls=1]]", true);
    with_tools["tools"] = json!([{"type": "function", "function": {"name": "get_weather"}}]);
    let o = rig.stream("/v1/chat/completions", &with_tools, Some(a), |_, _| {})?;
    ensure!(
        o.mode_header.as_deref() == Some("degraded"),
        "x-haltd-mode: {:?}",
        o.mode_header
    );
    ensure!(
        o.status == 200 && o.tokens <= 1,
        "served as batch: {} token events",
        o.tokens
    );
    ensure!(
        !o.events.iter().any(|e| e.data.contains("tool_calls\":[")),
        "tool-call deltas emitted in degraded mode"
    );
    let fwd = rig
        .up
        .requests()?
        .into_iter()
        .rev()
        .find(|r| r.get("event").is_none())
        .context("forwarded")?;
    ensure!(
        fwd["body"].get("tools").is_none(),
        "tools forwarded in degraded mode: {fwd}"
    );
    let rec = rig.turn_record(&o.stream_id)?;
    ensure!(
        rec["runtime_mode"] == "degraded" && rec["budget"] == 0,
        "{rec}"
    );
    // A batch request of A: marked too.
    let (status, h, _) = rig.post(
        "/v1/chat/completions",
        &chat("[[script:normal tokens=2]]", false),
        Some(a),
    )?;
    ensure!(
        status == 200 && h["x-haltd-mode"] == "degraded",
        "{status} {h}"
    );
    Ok(())
}

/// A trip during a degraded turn (B = 0) of key A releases none of the turn's content.
fn degraded_trip_releases_nothing(rig: &Rig) -> Result<()> {
    // A trip during a degraded turn (B = 0): nothing of the turn's content reaches the client.
    let admin = rig.haltd.admin_url();
    let url = rig.url("/v1/chat/completions");
    let ns = rig.haltd.client_ns.clone();
    let client = haltd_tests::spawn_in_netns(&ns, move || {
        sse::stream_with(
            &url,
            &chat("[[script:normal tokens=100 pace_ms=10]]", true),
            &[("authorization", "Bearer key-A")],
            Duration::from_secs(30),
            |_, _| {},
        )
    });
    let deadline = Instant::now() + Duration::from_secs(5);
    let sid = loop {
        let streams = rig.get_admin("/admin/streams")?;
        if let Some(s) = streams["streams"]
            .as_array()
            .and_then(|l| l.iter().find(|s| s["tokens"].as_u64().unwrap_or(0) >= 3))
        {
            break s["stream_id"].as_str().unwrap_or_default().to_owned();
        }
        ensure!(
            Instant::now() < deadline,
            "degraded turn never produced tokens"
        );
        thread::sleep(Duration::from_millis(10));
    };
    let (code, _) = in_netns(&ns, || {
        trip_here(&format!("{admin}/admin/streams/{sid}/trip"), None)
    })?;
    ensure!(code == 200);
    let o = client.join().expect("client")?;
    o.halted_cleanly("OPERATOR_TRIP")?;
    ensure!(
        o.tokens == 0 && o.text.is_empty(),
        "B = 0 in degraded mode: {} tokens",
        o.tokens
    );
    Ok(())
}

/// The operator lists key A's degraded scope and ends it; A is served in full again.
fn operator_ends_degraded_mode(rig: &Rig, a: &str, scope: &str) -> Result<()> {
    // The operator ends it for key A's scope (the harness's tenant header names it).
    let shown = haltctl(rig, &["mode"])?;
    ensure!(shown["keys"][0]["scope"] == scope, "{shown}");
    let ended = haltctl(rig, &["mode", "full", "--scope", scope])?;
    ensure!(
        ended["changed"].as_array().map(Vec::len) == Some(1),
        "{ended}"
    );
    rig.wait_record("operator mode change", |r| {
        r["mode_change"]["to"] == "full" && r["mode_change"]["by"] == "operator"
    })?;
    let o = rig.stream(
        "/v1/chat/completions",
        &chat("[[script:normal tokens=3]]", true),
        Some(a),
        |_, _| {},
    )?;
    ensure!(
        o.mode_header.is_none() && o.tokens == 3,
        "still degraded after mode full"
    );
    let m = rig.haltd.metrics()?;
    ensure!(
        m.value(
            "haltd_runtime_mode_changes_total",
            &[("to", "degraded"), ("by", "halt")]
        )
        .unwrap_or(0.0)
            >= 1.0
    );
    Ok(())
}

/// Node scope with a timer: one halt degrades every key, and the timer ends it.
fn node_scope_degrades_every_key_until_the_timer(a: &str, b: &str) -> Result<()> {
    // Node scope with a timer: one halt degrades every key, and the timer ends it.
    let rig = rig_node()?;
    trip_one(&rig, a)?;
    let o = rig.stream(
        "/v1/chat/completions",
        &chat("[[script:normal tokens=3]]", true),
        Some(b),
        |_, _| {},
    )?;
    ensure!(
        o.mode_header.as_deref() == Some("degraded"),
        "node scope degrades key B too"
    );
    thread::sleep(Duration::from_millis(1600));
    let o = rig.stream(
        "/v1/chat/completions",
        &chat("[[script:normal tokens=3]]", true),
        Some(b),
        |_, _| {},
    )?;
    ensure!(
        o.mode_header.is_none(),
        "the timer did not end degraded mode"
    );
    let r = rig.wait_record("timer mode change", |r| r["mode_change"]["by"] == "timer")?;
    ensure!(r["mode_change"]["scope"] == "node", "{r}");
    Ok(())
}

#[test]
fn degraded_mode_follows_a_halt_for_its_key_until_the_operator_ends_it() -> Result<()> {
    let rig = rig(&[])?;
    let (a, b) = ("Bearer key-A", "Bearer key-B");
    let id = trip_one(&rig, a)?;
    let ch = rig.wait_record("mode change", |r| r["mode_change"]["to"] == "degraded")?;
    let scope = ch["mode_change"]["scope"]
        .as_str()
        .unwrap_or_default()
        .to_owned();
    ensure!(scope.starts_with("header:"), "{ch}");
    ensure!(ch["mode_change"]["stream_id"] == id.as_str(), "{ch}");

    degraded_key_is_served_as_batch_without_tools(&rig, a)?;

    degraded_trip_releases_nothing(&rig)?;

    // Key B is not affected.
    let o = rig.stream(
        "/v1/chat/completions",
        &chat("[[script:normal tokens=3]]", true),
        Some(b),
        |_, _| {},
    )?;
    ended_normally(&o, "stop")?;
    ensure!(o.mode_header.is_none() && o.tokens == 3);

    operator_ends_degraded_mode(&rig, a, &scope)?;
    drop(rig);

    node_scope_degrades_every_key_until_the_timer(a, b)
}

fn rig_node() -> Result<Rig> {
    rig(&["--degraded-scope", "node", "--degraded-for-s", "1"])
}

#[test]
fn a_tripped_turn_commits_nothing_and_its_dispatched_tool_calls_need_reconciliation() -> Result<()>
{
    let rig = rig(&[])?;
    let k = "Bearer conv-K";
    let o = rig.stream(
        "/v1/chat/completions",
        &chat("[[script:normal tokens=5]]", true),
        Some(k),
        |_, _| {},
    )?;
    ended_normally(&o, "stop")?;
    let find = |v: &Value| -> Value {
        v["conversations"]
            .as_array()
            .and_then(|l| l.iter().find(|c| c["key"] == fingerprint(&rig, k)).cloned())
            .unwrap_or_default()
    };
    let before = find(&rig.get_admin("/admin/conversations")?);
    ensure!(
        before["turns_committed"] == 1 && before["tokens_committed"] == 5,
        "{before}"
    );

    // A turn that emits a tool call, then trips.
    let admin = rig.haltd.admin_url();
    let mut tripped = false;
    let o = rig.stream(
        "/v1/chat/completions",
        &chat(
            "[[script:tool_call tokens=1 calls=1 args_chunks=6 pace_ms=60]]",
            true,
        ),
        Some(k),
        |p, ev| {
            let has_call = ev.data.contains("\"id\":\"call_");
            if !tripped && has_call {
                tripped = true;
                let _ = trip_here(&format!("{admin}/admin/streams/{}/trip", p.stream_id), None);
            }
        },
    )?;
    o.halted_cleanly("OPERATOR_TRIP")?;
    let rec = rig.turn_record(&o.stream_id)?;
    ensure!(rec["turn_status"] == "failed", "{rec}");
    let calls = rec["tool_calls"].as_array().context("tool_calls")?;
    ensure!(
        calls.len() == 1
            && calls[0]["status"] == "dispatched"
            && calls[0]["reconciliation"] == "required",
        "{rec}"
    );
    let after = find(&rig.get_admin("/admin/conversations")?);
    for f in [
        "turns_committed",
        "tokens_committed",
        "tool_calls_committed",
        "last_committed_turn",
    ] {
        ensure!(
            after[f] == before[f],
            "{f} changed by a failed turn: {before} -> {after}"
        );
    }
    ensure!(after["turns_failed"] == 1, "{after}");
    Ok(())
}

#[test]
fn the_official_openai_sdk_and_curl_see_normal_streams_and_halts() -> Result<()> {
    let rig = rig(&["--upstream-stall-timeout-ms", "400"])?;
    let base = format!("{}/v1", rig.haltd.api_url());
    let ns = rig.pair.cli.clone();
    let sdk = |args: &[&str]| -> Result<Value> {
        let mut all = vec!["--base-url", base.as_str()];
        all.extend_from_slice(args);
        openai_sdk(&ns, &all)
    };
    let r = sdk(&["--api-key", "k1", "--prompt", "[[script:normal tokens=6]]"])?;
    ensure!(
        r["ok"] == true && r["finish_reason"] == "stop" && r["chunks"] == 6,
        "{r}"
    );
    let r = sdk(&[
        "--api-key",
        "k1",
        "--no-stream",
        "--prompt",
        "[[script:normal tokens=4]]",
    ])?;
    ensure!(
        r["ok"] == true && r["content"].as_str().is_some_and(|c| !c.is_empty()),
        "{r}"
    );
    let r = sdk(&[
        "--api-key",
        "k1",
        "--endpoint",
        "completions",
        "--logprobs",
        "--prompt",
        "[[script:normal tokens=3]]",
    ])?;
    ensure!(r["ok"] == true && r["logprobs_tokens"] == 3, "{r}");
    let r = sdk(&[
        "--api-key",
        "k1",
        "--tools",
        "--prompt",
        "[[script:tool_call tokens=1 calls=1]]",
    ])?;
    ensure!(r["ok"] == true && r["finish_reason"] == "tool_calls", "{r}");
    ensure!(
        r["tool_calls"][0]["function"]["name"] == "get_weather",
        "{r}"
    );

    // A halt: content_filter plus the error object.
    let admin = rig.haltd.admin_url();
    let token = rig.haltd.admin_token_file();
    let r = sdk(&[
        "--api-key",
        "k2",
        "--prompt",
        "[[script:normal tokens=300 pace_ms=10]]",
        "--trip-after",
        "3",
        "--admin-url",
        admin.as_str(),
        "--admin-token-file",
        &token.to_string_lossy(),
    ])?;
    ensure!(r["finish_reason"] == "content_filter", "{r}");
    ensure!(r["error"]["body"]["code"] == "OPERATOR_TRIP", "{r}");
    // An upstream failure mid-stream: the same shape, with the cause.
    let r = sdk(&["--api-key", "k3", "--prompt", "[[script:stall tokens=2]]"])?;
    ensure!(r["finish_reason"] == "content_filter", "{r}");
    ensure!(r["error"]["body"]["code"] == "UPSTREAM_FAILURE", "{r}");
    ensure!(r["error"]["body"]["upstream"]["kind"] == "stalled", "{r}");
    // An upstream 4xx: the SDK's own status error.
    let r = sdk(&["--api-key", "k3", "--prompt", "[[script:status code=404]]"])?;
    ensure!(r["error"]["status_code"] == 404, "{r}");

    curl_sees_a_normal_and_a_halted_stream(&rig, &ns)
}

/// curl: a normal stream, and a halted one.
fn curl_sees_a_normal_and_a_halted_stream(rig: &Rig, ns: &str) -> Result<()> {
    // curl: a normal stream, and a halted one.
    let url = rig.url("/v1/chat/completions");
    let body = chat("[[script:normal tokens=4]]", true).to_string();
    let (ok, out) = curl(
        ns,
        &[
            "-N",
            "-H",
            "content-type: application/json",
            "-d",
            &body,
            &url,
        ],
    )?;
    ensure!(
        ok && out.contains("data: [DONE]") && out.contains("\"finish_reason\":\"stop\""),
        "{out}"
    );
    let body = chat("[[script:stall tokens=2]]", true).to_string();
    let (ok, out) = curl(
        ns,
        &[
            "-N",
            "-H",
            "content-type: application/json",
            "-d",
            &body,
            &url,
        ],
    )?;
    ensure!(
        ok && out.contains("\"finish_reason\":\"content_filter\""),
        "{out}"
    );
    ensure!(
        out.contains("\"code\":\"UPSTREAM_FAILURE\"") && out.ends_with("data: [DONE]\n\n"),
        "{out}"
    );
    Ok(())
}

/// The token events' texts, in order.
fn token_texts(o: &StreamOutcome) -> Vec<String> {
    o.events
        .iter()
        .filter_map(|e| match &e.kind {
            EventKind::Token(t) => Some(t.clone()),
            _ => None,
        })
        .collect()
}

/// Tokens that do not spell their chunk's text: one frame per character on both endpoints,
/// logprobs null.
fn mismatched_tokens_go_out_per_character(rig: &Rig, mismatch: &str) -> Result<()> {
    let mut b = chat(mismatch, true);
    b["logprobs"] = json!(true);
    b["top_logprobs"] = json!(2);
    let mut c = completion(mismatch, true);
    c["logprobs"] = json!(1);
    for (path, body) in [("/v1/chat/completions", &b), ("/v1/completions", &c)] {
        let o = rig.stream(path, body, None, |_, _| {})?;
        ended_normally(&o, "stop")?;
        ensure!(
            token_texts(&o) == ["a", "b", "c", "d", "e", "f"],
            "{path}: {:?}",
            o.events
        );
        for ch in token_chunks(&o) {
            ensure!(ch["choices"][0]["logprobs"].is_null(), "{path}: {ch}");
        }
        let rec = rig.turn_record(&o.stream_id)?;
        ensure!(rec["tokens_emitted"] == 6, "{path}: {rec}");
    }
    Ok(())
}

/// `directive`'s tokens (each `long`, 151 bytes) go out in pieces of at most 64 bytes on both
/// endpoints, the first piece with the token's logprobs, the others with logprob 0.
fn long_tokens_go_out_in_pieces(rig: &Rig, directive: &str, long: &str) -> Result<()> {
    let mut b = chat(directive, true);
    b["logprobs"] = json!(true);
    b["top_logprobs"] = json!(1);
    let o = rig.stream("/v1/chat/completions", &b, None, |_, _| {})?;
    ended_normally(&o, "stop")?;
    let lens: Vec<usize> = token_texts(&o).iter().map(String::len).collect();
    ensure!(lens == [63, 64, 24, 63, 64, 24], "{lens:?}");
    ensure!(o.text == long.repeat(2), "{:?}", o.text);
    for (i, c) in token_chunks(&o).iter().enumerate() {
        let entry = &c["choices"][0]["logprobs"]["content"][0];
        let text = c["choices"][0]["delta"]["content"].as_str().unwrap_or("");
        ensure!(entry["token"] == text, "the entry names its piece: {c}");
        ensure!(
            entry["bytes"].as_array().map(Vec::len) == Some(text.len()),
            "{c}"
        );
        let lp = entry["logprob"].as_f64().context("logprob")?;
        let alts = entry["top_logprobs"].as_array().map_or(0, Vec::len);
        if i % 3 == 0 {
            ensure!(lp < 0.0 && alts == 1, "the first piece is the token's: {c}");
        } else {
            ensure!(lp == 0.0 && alts == 0, "a continuation piece: {c}");
        }
    }
    let mut c = completion(directive, true);
    c["logprobs"] = json!(1);
    let o = rig.stream("/v1/completions", &c, None, |_, _| {})?;
    ended_normally(&o, "stop")?;
    let offsets: Vec<u64> = token_chunks(&o)
        .iter()
        .filter_map(|c| c["choices"][0]["logprobs"]["text_offset"][0].as_u64())
        .collect();
    ensure!(offsets == [0, 63, 127, 151, 214, 278], "{offsets:?}");
    Ok(())
}

/// A secret split across chunks without logprobs never reaches the client.
fn hold_back_holds_per_character_frames(rig: &Rig) -> Result<()> {
    // The exfiltration hold-back holds per-character frames too: a secret split across
    // chunks without logprobs never reaches the client.
    let o = rig.stream(
        "/v1/chat/completions",
        &chat(
            "[[script:normal tokens=12 per_chunk=2 no_logprobs=1 words=\"The, access, key, is, AKIA,IOSF,ODNN,7EXA,MPLE, and, more, text\"]]",
            true,
        ),
        None,
        |_, _| {},
    )?;
    o.halted_cleanly("EXFIL_ALERT")
        .with_context(|| format!("{:?}", o.events))?;
    ensure!(
        !o.text.contains("AKIA") && "The access key is".starts_with(o.text.trim_end()),
        "{:?}",
        o.text
    );
    Ok(())
}

/// Framing (issue 10): every frame carries one token by the stated rules. Tokens that spell
/// their chunk's text go out one frame each, a token longer than 64 bytes in pieces of at most
/// 64 (the first with its logprobs, later ones logprob 0 and no alternatives); text without
/// logprobs, or whose tokens do not spell it, one frame per character with `logprobs: null`;
/// the exfiltration hold-back still holds; and the official SDK reassembles the same text and
/// tool-call arguments.
#[test]
fn every_frame_carries_one_token_by_the_stated_rules() -> Result<()> {
    let rig = rig(&[])?;

    // Three tokens in one chunk without logprobs: three frames, three tokens, even though
    // the client asked for logprobs (the frames say null: the tokens are not known).
    let xyz = "[[script:normal tokens=3 per_chunk=3 no_logprobs=1 words=x,y,z]]";
    let mut b = chat(xyz, true);
    b["logprobs"] = json!(true);
    let o = rig.stream("/v1/chat/completions", &b, None, |_, _| {})?;
    ended_normally(&o, "stop")?;
    ensure!(token_texts(&o) == ["x", "y", "z"], "{:?}", o.events);
    for c in token_chunks(&o) {
        ensure!(c["choices"][0]["logprobs"].is_null(), "{c}");
    }
    let rec = rig.turn_record(&o.stream_id)?;
    ensure!(rec["tokens_emitted"] == 3, "three token frames: {rec}");

    // One frame per character, not per byte.
    let o = rig.stream(
        "/v1/chat/completions",
        &chat(
            "[[script:normal tokens=2 per_chunk=2 no_logprobs=1 words=\"é x,𝄞\"]]",
            true,
        ),
        None,
        |_, _| {},
    )?;
    ended_normally(&o, "stop")?;
    ensure!(token_texts(&o) == ["é", " ", "x", "𝄞"], "{:?}", o.events);

    // Tokens that do not spell the text (vLLM's `token_id:` form): per character, on both
    // endpoints, logprobs null.
    let mismatch = "[[script:normal tokens=3 per_chunk=3 token_ids=1 words=ab,cd,ef]]";
    mismatched_tokens_go_out_per_character(&rig, mismatch)?;

    // A token longer than the cap: pieces of at most 64 bytes cut at character boundaries
    // (151 bytes = 63 + 64 + 24: the 64th byte would split an é).
    let long = format!("a{}", "é".repeat(75));
    let directive = format!("[[script:normal tokens=2 words={long}]]");
    long_tokens_go_out_in_pieces(&rig, &directive, &long)?;

    // Batch: the same text, held whole.
    let (status, _, v) = rig.post("/v1/chat/completions", &chat(xyz, false), None)?;
    ensure!(status == 200, "{status} {v}");
    ensure!(v["choices"][0]["message"]["content"] == "xyz", "{v}");

    hold_back_holds_per_character_frames(&rig)?;

    // The official SDK reassembles the same text and tool-call arguments.
    let base = format!("{}/v1", rig.haltd.api_url());
    let ns = rig.pair.cli.clone();
    let sdk = |args: &[&str]| -> Result<Value> {
        let mut all = vec!["--base-url", base.as_str()];
        all.extend_from_slice(args);
        openai_sdk(&ns, &all)
    };
    let r = sdk(&["--prompt", xyz])?;
    ensure!(
        r["ok"] == true && r["content"] == "xyz" && r["chunks"] == 3,
        "{r}"
    );
    let r = sdk(&["--logprobs", "--prompt", &directive])?;
    ensure!(
        r["ok"] == true && r["content"] == long.repeat(2).as_str() && r["logprobs_tokens"] == 6,
        "{r}"
    );
    let r = sdk(&["--endpoint", "completions", "--prompt", mismatch])?;
    ensure!(r["ok"] == true && r["content"] == "abcdef", "{r}");
    let r = sdk(&[
        "--tools",
        "--prompt",
        "[[script:tool_call tokens=1 calls=1 no_logprobs=1]]",
    ])?;
    ensure!(r["ok"] == true && r["finish_reason"] == "tool_calls", "{r}");
    let call = &r["tool_calls"][0];
    ensure!(call["function"]["name"] == "get_weather", "{r}");
    ensure!(
        call["function"]["arguments"] == r#"{"location": "Paris, France", "unit": "celsius"}"#,
        "the arguments, one character per frame, reassemble: {r}"
    );
    ensure!(
        call["id"].as_str().is_some_and(|i| i.starts_with("call_")),
        "{r}"
    );
    Ok(())
}
