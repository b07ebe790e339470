//! The scripted upstream behind `POST /v1/responses`: what the SDK makes of a chat backend's
//! text, length limit, tool call and reasoning, in `responses.create`, streamed and not (and
//! the SDK's `responses.stream` helper for the tool call), and the access log line of each
//! request.

use anyhow::{ensure, Context, Result};
use haltd_tests::rig::Rig;
use serde_json::{json, Value};

use super::{answered_framed, lines_say_responses, paris, sdk, stream_id, turn};
use crate::{
    messages::{access_lines_of, WEATHER_TOOL},
    UPSTREAM_BIN,
};

/// Each of `args` as a turn in both modes (create, then stream).
fn both_modes(args: &[&[&str]]) -> Vec<Vec<String>> {
    args.iter()
        .flat_map(|a| {
            ["create", "stream"].map(|mode| {
                let mut t = turn(&["--mode", mode]);
                t.extend(turn(a));
                t
            })
        })
        .collect()
}

/// The arguments of a function call as the SDK got them, parsed.
fn arguments(call: &Value) -> Result<Value> {
    let args = call["arguments"].as_str().context("arguments")?;
    serde_json::from_str(args).with_context(|| format!("arguments {args:?}"))
}

/// Text, the length limit, a tool call and reasoning, as the SDK assembled them; `per_token`:
/// one frame per token, as a backend with logprobs on every delta gives
/// ([`answered_framed`]).
pub(crate) fn check_contents(r: &[Value], per_token: bool) -> Result<()> {
    let answered = |t: &Value, status: &str| answered_framed(t, status, per_token);
    for t in &r[0..2] {
        answered(t, "completed")?;
        ensure!(
            t["text"] == "The quick brown fox jumps"
                && t["output_types"] == json!(["message"])
                && t["usage"]["output_tokens"] == 5
                && t["usage"]["input_tokens"].as_u64() > Some(0),
            "{t}"
        );
    }
    for t in &r[2..4] {
        answered(t, "incomplete")?;
        ensure!(t["usage"]["output_tokens"] == 3, "{t}");
    }
    for t in &r[4..7] {
        answered(t, "completed")?;
        ensure!(
            t["output_types"] == json!(["message", "function_call"]),
            "{t}"
        );
        let call = &t["function_calls"][0];
        ensure!(
            call["name"] == "get_weather" && arguments(call)? == paris(),
            "the SDK's function_call item: {t}"
        );
        ensure!(
            call["call_id"]
                .as_str()
                .is_some_and(|i| i.starts_with("call_")),
            "{t}"
        );
        ensure!(t["text"] == "The quick", "{t}");
        if t["mode"] != "create" && per_token {
            // Two text frames, the call's header (its item's start), three pieces of it.
            ensure!(t["frames"] == 6 && t["usage"]["output_tokens"] == 6, "{t}");
        }
    }
    for t in &r[7..9] {
        answered(t, "completed")?;
        ensure!(t["output_types"] == json!(["reasoning", "message"]), "{t}");
        ensure!(
            t["reasoning"] == "Let me think" && t["text"] == " The answer .",
            "{t}"
        );
        // A stream counts its reasoning deltas; a batch Response says 0 (haltd does not
        // count reasoning apart in a batch turn: wire/responses/encode.rs, batch_body).
        let reasoning_tokens = if t["mode"] == "create" { 0 } else { 3 };
        ensure!(
            !per_token
                || t["usage"]["output_tokens_details"]["reasoning_tokens"] == reasoning_tokens,
            "{t}"
        );
    }
    Ok(())
}

/// The tool of a streamed turn went upstream as a chat function, and the stream asked for
/// usage.
fn tool_went_upstream_as_a_function(rig: &Rig, streamed: &Value) -> Result<()> {
    let tool_turn = stream_id(streamed)?;
    let up = rig
        .up
        .requests()?
        .into_iter()
        .find(|q| {
            q.get("event").is_none() && q["headers"]["x-haltd-stream-id"] == tool_turn.as_str()
        })
        .context("the tool turn upstream")?;
    let body = &up["body"];
    let schema: Value = serde_json::from_str(WEATHER_TOOL)?;
    ensure!(
        body["tools"][0]["type"] == "function"
            && body["tools"][0]["function"]["name"] == "get_weather"
            && body["tools"][0]["function"]["parameters"] == schema["input_schema"],
        "{body}"
    );
    ensure!(
        body["stream"] == true && body["stream_options"]["include_usage"] == true,
        "{body}"
    );
    Ok(())
}

/// The SDK turns [`check_contents`] judges: text, the length limit and a tool call in both
/// modes, the tool call in the SDK's stream helper, reasoning in both modes.
pub(crate) fn sdk_turns() -> Vec<Vec<String>> {
    let tools: &[&str] = &[
        "--tools",
        "weather",
        "--prompt",
        "[[script:tool_call tokens=2]]",
    ];
    let reasoning: &[&str] = &[
        "--reasoning-effort",
        "low",
        "--prompt",
        "[[script:normal tokens=6 reasoning=3 words=\"Let, me, think, The, answer, .\"]]",
    ];
    let mut turns = both_modes(&[
        &["--prompt", "[[script:normal tokens=5]]"],
        &["--prompt", "[[script:normal tokens=3 finish=length]]"],
        tools,
    ]);
    let mut helper = turn(&["--mode", "helper"]);
    helper.extend(turn(tools));
    turns.push(helper);
    turns.extend(both_modes(&[reasoning]));
    turns
}

#[test]
fn scripted_upstream_text_tools_and_reasoning_reach_the_sdk_as_responses() -> Result<()> {
    let rig = Rig::start(UPSTREAM_BIN, &["--log-format", "json"])?;
    let r = sdk(&rig.haltd, &[], &sdk_turns())?;
    check_contents(&r, true)?;

    tool_went_upstream_as_a_function(&rig, &r[5])?;

    let m = rig.haltd.metrics()?;
    let counted = m.sum_where(
        "haltd_requests_total",
        &[
            ("surface", "openai"),
            ("endpoint", "responses"),
            ("outcome", "completed"),
        ],
    );
    ensure!(
        counted == r.len() as f64,
        "haltd_requests_total counts {counted} Responses turns"
    );

    // Each request's access log line: the Responses endpoint of OpenAI's surface, its tokens
    // and outcome.
    let ids = r.iter().map(stream_id).collect::<Result<Vec<_>>>()?;
    let lines = access_lines_of(&rig.haltd, &ids)?;
    lines_say_responses(&lines)?;
    for (l, t) in lines.iter().zip(&r) {
        ensure!(
            l["status"] == 200
                && l["outcome"] == "completed"
                && l["model"] == "scripted"
                && l["tokens"] == t["usage"]["output_tokens"],
            "access log line {l} for {t}"
        );
    }
    Ok(())
}
