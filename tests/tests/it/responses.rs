//! The OpenAI Responses API (`POST /v1/responses`) by translation, end to end, with the
//! official `openai` Python SDK as the client (`tests/py/openai_responses.py`, several turns
//! to a process with `--turns`): haltd translates the request into a chat turn
//! (docs/wire-format.md, "Responses API requests"; `daemon/src/wire/responses`) and writes the
//! client's side in the Responses schema. The kernel gate is on, as in every test of the
//! harness (no `--no-kernel-gate`).
//!
//! By sub-topic:
//! - `builtin`: the built-in source answers `responses.create`, streamed and not, and the
//!   SDK's `responses.stream` helper: `completed`, and `incomplete` for `max_output_tokens`,
//!   usage, events in order with their sequence numbers;
//! - `scripted`: the scripted upstream behind haltd: text, the length limit, a tool call the
//!   SDK parses into a `function_call` item, `reasoning_content` as a reasoning item, in both
//!   modes; each request's access log line says `surface` openai, `endpoint` responses;
//! - `trips`: operator trips mid-text, mid-arguments, mid-reasoning and of a batch turn, at
//!   B = 5 and B = 0: the SDK's stream ends cleanly with `response.incomplete`, reason
//!   `content_filter` and haltd's halt object, exactly τ plus the post-trip tokens (at most B)
//!   token frames at the SDK, and the flight recorder and the kernel's verdicts agree;
//! - `errors`: errors in OpenAI's schema and the SDK exceptions they raise (400 naming the
//!   field, `previous_response_not_supported`, the upstream's 429, a failure mid-stream);
//! - `fields`: the table of request fields names every field of the pinned SDK's
//!   `ResponseCreateParams`, and no other;
//! - `llama`: llama.cpp's real server behind haltd (by translation), streamed and not, with
//!   and without a tool, and a trip;
//! - `table`: "governed or refused": every cell of surface × {stream, batch} × {text, tool
//!   call, reasoning} × {normal, tripped} × {translated, passed through}, chat and Messages
//!   beside Responses;
//! - `agents`: TokenCircuit on the surface, spec 002's five cases as agent loops of the
//!   OpenAI Agents SDK (`tests/py/openai_agents_loop.py`, its default Responses model):
//!   `function_call` and `function_call_output` items judged as chat's tool calls and
//!   results, a forbidden call halted before any of it reaches the SDK, an exhausted budget
//!   answered without the model or forwarded without the tool.
//!
//! Trips by native pass-through (`--upstream-surfaces`) are in `trips` too; the rest of
//! pass-through in the `passthrough` topic.

use anyhow::{bail, ensure, Context, Result};
use haltd_tests::{openai_responses_turns, Haltd};
use serde_json::{json, Value};

mod agents;
mod builtin;
mod errors;
mod fields;
mod llama;
pub(crate) mod scripted;
mod table;
mod trips;

pub(crate) use crate::messages::turn;

/// What the scripted model's `get_weather` call carries.
pub(crate) fn paris() -> Value {
    json!({"location": "Paris, France", "unit": "celsius"})
}

/// The SDK's turns against `haltd` (from its client namespace): `common` arguments for every
/// turn after `--base-url`, then each turn's own; one result per turn.
pub(crate) fn sdk(haltd: &Haltd, common: &[&str], turns: &[Vec<String>]) -> Result<Vec<Value>> {
    let base = format!("{}/v1", haltd.api_url());
    let mut args = vec!["--base-url", base.as_str()];
    args.extend_from_slice(common);
    openai_responses_turns(&haltd.client_ns, &args, turns)
}

/// The arguments that let the driver trip its own turn after `k` token frames
/// (`--trip-after`, through haltd's admin API with its token).
pub(crate) fn trip_args(haltd: &Haltd, k: u64) -> Vec<String> {
    turn(&[
        "--trip-after",
        &k.to_string(),
        "--admin-url",
        &haltd.admin_url(),
        "--admin-token-file",
        &haltd.admin_token_file().to_string_lossy(),
    ])
}

/// The stream id of an SDK result (its `x-haltd-stream-id`), which its response id names too.
pub(crate) fn stream_id(r: &Value) -> Result<String> {
    let id = r["headers"]["x-haltd-stream-id"]
        .as_str()
        .with_context(|| format!("no x-haltd-stream-id: {r}"))?;
    if let Some(resp) = r["response_id"].as_str() {
        ensure!(
            resp == format!("resp_{id}"),
            "response id {resp} for stream {id}"
        );
    }
    Ok(id.to_owned())
}

/// The event types of an SDK result (stream modes).
pub(crate) fn events(r: &Value) -> Vec<&str> {
    r["events"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(Value::as_str)
        .collect()
}

/// Whether a stream's events came in the Responses order: `response.created`,
/// `response.in_progress`, items (each its `output_item.added` before its deltas, no delta
/// after the first `.done`), one end event last (`response.completed`, or
/// `response.incomplete` / `response.failed`); sequence numbers 0, 1, 2, ... The end of a
/// halted stream (`halted`) was prepared at the trip: its number is above every other, with
/// room for what went out after the trip, so it may skip some.
pub(crate) fn in_responses_order(r: &Value, halted: bool) -> Result<()> {
    let ev = events(r);
    ensure!(
        ev.starts_with(&["response.created", "response.in_progress"]),
        "first events: {ev:?}"
    );
    let last = ev.last().copied().unwrap_or_default();
    ensure!(
        matches!(
            last,
            "response.completed" | "response.incomplete" | "response.failed"
        ),
        "last event: {ev:?}"
    );
    ensure!(
        ev[..ev.len() - 1].iter().all(|e| !matches!(
            *e,
            "response.completed" | "response.incomplete" | "response.failed"
        )),
        "an end event before the last: {ev:?}"
    );
    let (mut added, mut done, mut closing) = (0, 0, false);
    for e in &ev[2..ev.len() - 1] {
        match *e {
            "response.output_item.added" if !closing => added += 1,
            "response.output_item.done" => {
                closing = true;
                done += 1;
            }
            e if e.ends_with(".delta") => {
                ensure!(added > 0 && !closing, "{e} out of its item: {ev:?}");
            }
            e if e.ends_with(".done") => closing = true,
            "response.content_part.added" if added > 0 && !closing => {}
            e => bail!("{e} out of place: {ev:?}"),
        }
    }
    ensure!(
        done == added || halted,
        "{added} items opened, {done} done: {ev:?}"
    );
    let seq: Vec<u64> = r["sequence_numbers"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(Value::as_u64)
        .collect();
    ensure!(seq.len() == ev.len(), "sequence numbers: {r}");
    let n = seq.len() - 1;
    ensure!(
        seq[..n].iter().enumerate().all(|(i, s)| *s == i as u64),
        "sequence numbers not 0, 1, 2, ...: {seq:?}"
    );
    ensure!(
        if halted {
            seq[n] >= n as u64
        } else {
            seq[n] == n as u64
        },
        "the end's sequence number: {seq:?}"
    );
    Ok(())
}

/// An SDK turn that ended normally with `status` (`completed`, or `incomplete` for the
/// length limit): no exception, a response id naming the stream, `store: false`, usage with
/// the output tokens, and (stream modes) the events in order, one token frame per output
/// token.
pub(crate) fn answered(r: &Value, status: &str) -> Result<()> {
    answered_framed(r, status, true)
}

/// [`answered`]; `per_token` false: some of the output came without logprobs (a
/// passed-through function call's arguments), framed per character, so the frames are not
/// the tokens that usage counts.
pub(crate) fn answered_framed(r: &Value, status: &str, per_token: bool) -> Result<()> {
    ensure!(r["ok"] == true && r["exception"].is_null(), "{r}");
    ensure!(
        r["status"] == 200 && r["response_status"] == status,
        "status: {r}"
    );
    if status == "incomplete" {
        ensure!(
            r["incomplete_details"]["reason"] == "max_output_tokens",
            "an incomplete answer for another reason: {r}"
        );
    } else {
        ensure!(r["incomplete_details"].is_null(), "{r}");
    }
    ensure!(r["halt"].is_null() && r["response_error"].is_null(), "{r}");
    ensure!(r["store"] == false, "store: {r}");
    stream_id(r)?;
    let usage = &r["usage"];
    ensure!(
        usage["input_tokens"].is_u64() && usage["output_tokens"].as_u64().is_some_and(|n| n > 0),
        "usage: {r}"
    );
    if r["mode"] != "create" {
        in_responses_order(r, false)?;
        ensure!(
            !per_token || usage["output_tokens"] == r["frames"],
            "{} frames, usage {usage}: {r}",
            r["frames"]
        );
        if r["text"] != "" {
            ensure!(r["done_text"] == r["text"], "the .done text: {r}");
        }
    }
    Ok(())
}

/// The halt object of an SDK turn that haltd halted with `code`: the turn ended cleanly (no
/// exception) with a Response `incomplete` for `content_filter`, the halt naming the stream.
pub(crate) fn refused(r: &Value, code: &str) -> Result<Value> {
    ensure!(r["ok"] == true && r["exception"].is_null(), "{r}");
    ensure!(
        r["response_status"] == "incomplete"
            && r["incomplete_details"]["reason"] == "content_filter",
        "not incomplete for content_filter: {r}"
    );
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
        in_responses_order(r, true)?;
        ensure!(events(r).last() == Some(&"response.incomplete"), "{r}");
    }
    Ok(halt.clone())
}

/// Every access log line says the request spoke OpenAI's Responses API.
pub(crate) fn lines_say_responses(lines: &[Value]) -> Result<()> {
    for l in lines {
        ensure!(
            l["endpoint"] == "responses" && l["surface"] == "openai",
            "access log line: {l}"
        );
    }
    Ok(())
}
