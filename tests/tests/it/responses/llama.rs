//! llama.cpp's real server (`tests/src/llama.rs`, as `real_backend.rs` runs it) behind
//! `POST /v1/responses`, by translation (it serves no Responses API of its own): the SDK's
//! `responses.create`, streamed and not, with and without a tool, and an operator trip
//! mid-stream. The model is tiny and random: the checks are on the shape of the answers (a
//! status, text or a `function_call` item, usage), not their words.

use anyhow::{ensure, Context, Result};
use haltd_tests::{
    llama::{LlamaServer, LLAMA_MODEL_ALIAS},
    rig::Rig,
};
use serde_json::{json, Value};

use super::{answered_framed, refused, sdk, stream_id, trip_args, turn};

/// Frames the long stream has when its driver trips it.
const TRIP_AT: u64 = 300;

/// The tool: its arguments ASCII by their schema (a free string gets characters whose bytes
/// span tokens, which llama-cpp-python streams as empty text).
fn tool() -> String {
    json!([{"type": "function", "name": "get_weather", "description": "The weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"enum": ["Oslo", "Bergen"]},
            "days": {"type": "integer"}}, "required": ["city", "days"]}}])
    .to_string()
}

/// The answers without a tool: cut at their 16 tokens (haltd's count: a frame per token, or
/// per character where llama.cpp's tokens do not spell the text).
fn plain(r: &[Value]) -> Result<()> {
    for t in r {
        answered_framed(t, "incomplete", false)?;
        let out = t["usage"]["output_tokens"].as_u64().unwrap_or(0);
        ensure!(out >= 16, "16 tokens asked: {t}");
        ensure!(t["output_types"] == json!(["message"]), "{t}");
    }
    Ok(())
}

/// The answers with the tool forced: a `function_call` item the SDK parsed.
fn with_tool(r: &[Value]) -> Result<()> {
    for t in r {
        answered_framed(t, "completed", false)?;
        let call = t["function_calls"]
            .as_array()
            .and_then(|c| c.last())
            .with_context(|| format!("no function_call item: {t}"))?;
        let args: Value = serde_json::from_str(call["arguments"].as_str().unwrap_or("?"))
            .with_context(|| format!("arguments: {t}"))?;
        ensure!(
            call["name"] == "get_weather"
                && ["Oslo", "Bergen"].contains(&args["city"].as_str().unwrap_or("?")),
            "the SDK's function_call item: {t}"
        );
    }
    Ok(())
}

#[test]
fn llama_cpp_behind_responses_answers_the_sdk_with_and_without_tools() -> Result<()> {
    let rig: Rig<LlamaServer> = Rig::start_llama(&[], &[])?;
    let tools = tool();
    let forced = [
        "--tools",
        tools.as_str(),
        "--tool-choice",
        "function:get_weather",
        "--max-output-tokens",
        "64",
    ];
    let trip = trip_args(&rig.haltd, TRIP_AT);
    let trip: Vec<&str> = trip.iter().map(String::as_str).collect();
    let long = [&["--max-output-tokens", "3000"][..], &trip].concat();
    // Each turn its own key: the trip degrades its key.
    let mut turns = Vec::new();
    for (i, (mode, own)) in [
        ("create", &["--max-output-tokens", "16"][..]),
        ("stream", &["--max-output-tokens", "16"]),
        ("create", &forced),
        ("stream", &forced),
        ("stream", &long),
    ]
    .into_iter()
    .enumerate()
    {
        let key = format!("sk-llama-responses-{i}");
        let mut t = turn(&["--mode", mode, "--api-key", &key]);
        t.extend(turn(own));
        turns.push(t);
    }
    let common = [
        "--model",
        LLAMA_MODEL_ALIAS,
        "--prompt",
        "Weather in Oslo?",
        "--timeout",
        "60",
    ];
    let r = sdk(&rig.haltd, &common, &turns)?;
    plain(&r[0..2])?;
    with_tool(&r[2..4])?;

    // The long stream, tripped by its driver: `response.incomplete` within B = 5.
    let t = &r[4];
    let halt = refused(t, "OPERATOR_TRIP")?;
    let tau = t["trip"]["body"]["trip_token_index"]
        .as_u64()
        .with_context(|| format!("the long stream was not tripped: {t}"))?;
    ensure!(halt["trip_token_index"] == tau && tau >= TRIP_AT, "{t}");
    let post = halt["post_trip_tokens"].as_u64().context("post")?;
    ensure!(
        post <= 5 && t["frames"] == tau + post,
        "{} frames, τ {tau}, {post} after: {t}",
        t["frames"]
    );
    let rec = rig.turn_record(&stream_id(t)?)?;
    ensure!(rec["upstream"]["cancel_reason"] == "trip", "{rec}");
    Ok(())
}
