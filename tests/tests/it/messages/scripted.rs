//! The scripted upstream behind `POST /v1/messages`: what the SDK makes of a chat backend's
//! text, length limit, tool call and reasoning, in `messages.create` and `messages.stream`
//! (and the raw `create(stream=True)`, whose `input_json_delta`s the driver joins itself), and
//! the access log line of each request.

use anyhow::{ensure, Context, Result};
use haltd_tests::rig::Rig;
use serde_json::{json, Value};

use super::{
    access_lines_of, answered_framed, frames_seen, lines_say_messages, paris, sdk, stream_id, turn,
    WEATHER_TOOL,
};
use crate::UPSTREAM_BIN;

/// Each of `args` as a turn in both SDK modes (create, then stream).
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

/// Text, a tool call and thinking, as the SDK assembled them; `per_token`: one frame per
/// token, as a backend with logprobs gives ([`answered_framed`]).
pub(crate) fn check_contents(r: &[Value], per_token: bool) -> Result<()> {
    let answered = |t: &Value, stop: &str| answered_framed(t, stop, per_token);
    for t in &r[0..2] {
        answered(t, "end_turn")?;
        ensure!(
            t["text"] == "The quick brown fox jumps"
                && t["usage"]["output_tokens"] == 5
                && t["usage"]["input_tokens"].as_u64() > Some(0),
            "{t}"
        );
    }
    for t in &r[2..4] {
        answered(t, "max_tokens")?;
    }
    for t in &r[4..7] {
        answered(t, "tool_use")?;
        ensure!(t["content_types"] == json!(["text", "tool_use"]), "{t}");
        let call = &t["tool_uses"][0];
        ensure!(
            call["name"] == "get_weather" && call["input"] == paris(),
            "the SDK's tool_use block: {t}"
        );
        ensure!(
            call["id"].as_str().is_some_and(|i| i.starts_with("call_")),
            "{t}"
        );
        ensure!(t["text"] == "The quick", "{t}");
        if t["mode"] != "create" && per_token {
            // Two text frames, the call's header (the block's start), three pieces of input.
            ensure!(
                frames_seen(t) == 6 && t["usage"]["output_tokens"] == 6,
                "{t}"
            );
        }
    }
    for t in &r[7..9] {
        answered(t, "end_turn")?;
        ensure!(t["content_types"] == json!(["thinking", "text"]), "{t}");
        ensure!(
            t["thinking"] == "Let me think" && t["text"] == " The answer .",
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
/// modes, the tool call in the raw mode, thinking in both modes.
pub(crate) fn sdk_turns() -> Vec<Vec<String>> {
    let tools: &[&str] = &[
        "--tools",
        WEATHER_TOOL,
        "--prompt",
        "[[script:tool_call tokens=2]]",
    ];
    let thinking: &[&str] = &[
        "--thinking-budget",
        "1024",
        "--prompt",
        "[[script:normal tokens=6 reasoning=3 words=\"Let, me, think, The, answer, .\"]]",
    ];
    let mut turns = both_modes(&[
        &["--prompt", "[[script:normal tokens=5]]"],
        &["--prompt", "[[script:normal tokens=3 finish=length]]"],
        tools,
    ]);
    let mut raw = turn(&["--mode", "create-stream-raw"]);
    raw.extend(turn(tools));
    turns.push(raw);
    turns.extend(both_modes(&[thinking]));
    turns
}

#[test]
fn scripted_upstream_create_and_stream_with_tools_and_thinking_reach_the_sdk() -> Result<()> {
    let rig = Rig::start(UPSTREAM_BIN, &["--log-format", "json"])?;
    let r = sdk(&rig.haltd, &[], &sdk_turns())?;
    check_contents(&r, true)?;

    tool_went_upstream_as_a_function(&rig, &r[5])?;

    let m = rig.haltd.metrics()?;
    let counted = m.sum_where(
        "haltd_requests_total",
        &[
            ("surface", "anthropic"),
            ("endpoint", "messages"),
            ("outcome", "completed"),
        ],
    );
    ensure!(
        counted == r.len() as f64,
        "haltd_requests_total counts {counted} Messages turns"
    );

    // Each request's access log line: the Messages endpoint of Anthropic's surface, its
    // tokens and outcome.
    let ids = r.iter().map(stream_id).collect::<Result<Vec<_>>>()?;
    let lines = access_lines_of(&rig.haltd, &ids)?;
    lines_say_messages(&lines)?;
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
