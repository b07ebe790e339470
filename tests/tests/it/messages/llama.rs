//! llama.cpp's real server (`tests/src/llama.rs`, as `real_backend.rs` runs it) behind
//! `POST /v1/messages`: the SDK's `messages.create` and `messages.stream`, with and without a
//! tool, and an operator trip mid-stream. The model is tiny and random: the checks are on the
//! shape of the answers (a stop reason, text or a `tool_use` block, usage), not their words.

use anyhow::{ensure, Context, Result};
use haltd_tests::{
    llama::{LlamaServer, LLAMA_MODEL_ALIAS},
    rig::Rig,
};
use serde_json::{json, Value};

use super::{answered, deltas, refused, sdk, stream_id, tripping, turn};

/// Frames the long stream has when it is tripped.
const TRIP_AT: u64 = 300;

/// The tool: its arguments ASCII by their schema (a free string gets characters whose bytes
/// span tokens, which llama-cpp-python streams as empty text).
fn tool() -> String {
    json!([{"name": "get_weather", "description": "The weather in a city",
        "input_schema": {"type": "object", "properties": {"city": {"enum": ["Oslo", "Bergen"]},
            "days": {"type": "integer"}}, "required": ["city", "days"]}}])
    .to_string()
}

/// The answers without a tool.
fn plain(r: &[Value]) -> Result<()> {
    for t in r {
        answered(t, "max_tokens")?;
        // A frame per token, or per character where the tokens do not spell the text.
        let out = t["usage"]["output_tokens"].as_u64().unwrap_or(0);
        ensure!(out >= 16, "16 tokens asked: {t}");
        ensure!(t["content_types"] == json!(["text"]), "{t}");
    }
    Ok(())
}

/// The answers with the tool forced: a `tool_use` block the SDK parsed.
fn with_tool(r: &[Value]) -> Result<()> {
    for t in r {
        answered(t, "tool_use")?;
        let call = t["tool_uses"]
            .as_array()
            .and_then(|c| c.last())
            .with_context(|| format!("no tool_use block: {t}"))?;
        ensure!(
            call["name"] == "get_weather"
                && ["Oslo", "Bergen"].contains(&call["input"]["city"].as_str().unwrap_or("?")),
            "the SDK's tool_use block: {t}"
        );
    }
    Ok(())
}

#[test]
fn llama_cpp_behind_messages_answers_the_sdk_with_and_without_tools() -> Result<()> {
    let rig: Rig<LlamaServer> = Rig::start_llama(&[], &[])?;
    let forced = [
        "--tools",
        &tool(),
        "--tool-choice",
        "tool:get_weather",
        "--max-tokens",
        "64",
    ];
    // Each turn its own key: the trip degrades its key.
    let mut turns = Vec::new();
    for (i, (mode, own)) in [
        ("create", &["--max-tokens", "16"][..]),
        ("stream", &["--max-tokens", "16"]),
        ("create", &forced),
        ("stream", &forced),
        ("stream", &["--max-tokens", "3000"]),
    ]
    .into_iter()
    .enumerate()
    {
        let key = format!("sk-ant-llama-{i}");
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
    // Only the long stream reaches TRIP_AT frames (the others are short: a frame per token,
    // or per character when the tokens do not spell their text).
    let (r, trips) = tripping(&rig.haltd, TRIP_AT, || sdk(&rig.haltd, &common, &turns))?;
    plain(&r[0..2])?;
    with_tool(&r[2..4])?;

    // The long stream, tripped: a refusal within B = 5.
    let t = &r[4];
    let (code, trip) = trips
        .get(&stream_id(t)?)
        .with_context(|| format!("the long stream was not tripped: {t}"))?;
    ensure!(*code == 200 && trips.len() == 1, "{trips:?}");
    let halt = refused(t, "OPERATOR_TRIP")?;
    let tau = trip["trip_token_index"].as_u64().context("τ")?;
    ensure!(halt["trip_token_index"] == tau, "{halt} / {trip}");
    let post = halt["post_trip_tokens"].as_u64().context("post")?;
    ensure!(
        post <= 5 && deltas(t) as u64 == tau + post,
        "{} deltas, τ {tau}, {post} after: {t}",
        deltas(t)
    );
    let rec = rig.turn_record(&stream_id(t)?)?;
    ensure!(rec["upstream"]["cancel_reason"] == "trip", "{rec}");
    Ok(())
}
