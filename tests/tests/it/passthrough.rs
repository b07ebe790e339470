//! Native pass-through (`--upstream-surfaces responses,messages`; `daemon/src/upstream/native.rs`):
//! the scripted upstream speaks vLLM's shapes of both surfaces (`POST /v1/responses`,
//! `POST /v1/messages`; `tests/src/bin/scripted-upstream/native.rs`), and haltd forwards the
//! client's request as it came and governs and re-encodes the backend's own events.
//!
//! Covered, with the official SDKs: the same text, length limit, tool call and reasoning
//! turns as by translation (`responses::scripted`, `messages::scripted`) reach the SDK with
//! the same contents, frames and usage; every request reached the backend on the surface's
//! own path with the client's body (its `input` or `messages`, its tools in the surface's
//! shape) and only haltd's fields set (`stream: true`; on Responses the output text's
//! logprobs); a Messages request carried the client's credential as it came (the pinned
//! SDK's `Authorization: Bearer`, a raw client's `x-api-key`), `anthropic-version` and
//! `anthropic-beta` (two headers joined as one list), and with `--upstream-api-key-file`
//! haltd's own key instead of the client's (no `x-api-key` then); each turn's flight-recorder
//! record is written. Trips by pass-through
//! are in `responses::trips` and the "governed or refused" table (`responses::table`).

use std::{fs, os::unix::fs::PermissionsExt};

use anyhow::{ensure, Context, Result};
use haltd_tests::{rig::Rig, temp_dir};
use serde_json::Value;

use crate::{messages, responses, UPSTREAM_BIN};

/// haltd's flag that passes both surfaces through.
pub(crate) const PASS_THROUGH: [&str; 2] = ["--upstream-surfaces", "responses,messages"];

/// The request the backend got for haltd's stream `id` (its `x-haltd-stream-id`).
pub(crate) fn upstream_request(rig: &Rig, id: &str) -> Result<Value> {
    rig.up
        .requests()?
        .into_iter()
        .find(|q| q.get("event").is_none() && q["headers"]["x-haltd-stream-id"] == id)
        .with_context(|| format!("no upstream request of stream {id}"))
}

/// Each turn's record: completed, with the token frames the client got (a batch: none).
fn recorded(rig: &Rig, id: &str, t: &Value, frames: u64) -> Result<()> {
    let rec = rig.turn_record(id)?;
    let emitted = if t["mode"] == "create" { 0 } else { frames };
    ensure!(
        rec["outcome"] == "completed" && rec["tokens_emitted"] == emitted,
        "the record {rec} of {t}"
    );
    Ok(())
}

#[test]
fn responses_go_upstream_as_they_came_and_come_back_governed() -> Result<()> {
    let rig = Rig::start(UPSTREAM_BIN, &PASS_THROUGH)?;
    let r = responses::sdk(&rig.haltd, &[], &responses::scripted::sdk_turns())?;
    // What the SDK made of the backend's own events: as by translation.
    // Function call arguments come without logprobs: framed per character.
    responses::scripted::check_contents(&r, false)?;
    for t in &r {
        let id = responses::stream_id(t)?;
        let q = upstream_request(&rig, &id)?;
        let body = &q["body"];
        ensure!(q["path"] == "/v1/responses", "{q}");
        ensure!(
            body["stream"] == true
                && body["input"].is_string()
                && body.get("messages").is_none()
                && body["include"]
                    .as_array()
                    .is_some_and(|i| i.iter().any(|v| v == "message.output_text.logprobs"))
                && body["top_logprobs"].as_u64() >= Some(1),
            "not the client's request with haltd's fields: {body}"
        );
        recorded(&rig, &id, t, t["frames"].as_u64().unwrap_or(0))?;
    }
    // The tool went as the SDK wrote it: a Responses function tool, not a chat one.
    let tool = &upstream_request(&rig, &responses::stream_id(&r[5])?)?["body"]["tools"][0];
    ensure!(
        tool["type"] == "function"
            && tool["name"] == "get_weather"
            && tool.get("function").is_none(),
        "{tool}"
    );
    Ok(())
}

#[test]
fn messages_go_upstream_with_their_headers_and_come_back_governed() -> Result<()> {
    let rig = Rig::start(UPSTREAM_BIN, &PASS_THROUGH)?;
    let common = ["--api-key", "sk-ant-pass-1", "--beta", "tools-2024-04-04"];
    let r = messages::sdk(&rig.haltd, &common, &messages::scripted::sdk_turns())?;
    // The Messages API has no logprobs: framed per character.
    messages::scripted::check_contents(&r, false)?;
    let text = &r[1];
    ensure!(
        text["mode"] == "stream"
            && messages::frames_seen(text) == "The quick brown fox jumps".len(),
        "not a frame per character: {text}"
    );
    for t in &r {
        let id = messages::stream_id(t)?;
        let q = upstream_request(&rig, &id)?;
        let (h, body) = (&q["headers"], &q["body"]);
        ensure!(q["path"] == "/v1/messages", "{q}");
        // The pinned SDK sends its key as `Authorization: Bearer`.
        ensure!(
            h["authorization"] == "Bearer sk-ant-pass-1"
                && h["anthropic-version"].is_string()
                && h["anthropic-beta"] == "tools-2024-04-04"
                && h.get("x-api-key").is_none(),
            "the client's headers did not go upstream as they came: {h}"
        );
        ensure!(
            body["stream"] == true
                && body["max_tokens"].is_u64()
                && body["messages"][0]["role"] == "user"
                && body.get("stream_options").is_none(),
            "not the client's request with haltd's fields: {body}"
        );
        recorded(&rig, &id, t, messages::frames_seen(t) as u64)?;
    }
    let tool = &upstream_request(&rig, &messages::stream_id(&r[5])?)?["body"]["tools"][0];
    ensure!(
        tool["name"] == "get_weather" && tool["input_schema"].is_object(),
        "an Anthropic tool: {tool}"
    );

    // A client that sends its key as `x-api-key` (the Anthropic API's own header): it goes
    // upstream as `x-api-key`, with the versions, and no `Authorization` is made up.
    let headers = [
        ("x-api-key", "sk-ant-pass-2"),
        ("anthropic-version", "2023-06-01"),
        ("anthropic-beta", "a-1"),
        ("anthropic-beta", "b-2"),
    ];
    let body = messages::body("[[script:normal tokens=3]]", false);
    let (status, seen, answer) = messages::post(&rig.haltd, messages::MESSAGES, &body, &headers)?;
    ensure!(
        status == 200 && answer["content"][0]["text"] == "The quick brown",
        "{answer}"
    );
    let id = seen["x-haltd-stream-id"].as_str().context("stream id")?;
    let h = &upstream_request(&rig, id)?["headers"];
    ensure!(
        h["x-api-key"] == "sk-ant-pass-2"
            && h["anthropic-version"] == "2023-06-01"
            && h["anthropic-beta"] == "a-1,b-2"
            && h.get("authorization").is_none(),
        "{h}"
    );
    Ok(())
}

#[test]
fn haltd_s_own_key_replaces_the_client_s_x_api_key() -> Result<()> {
    let dir = temp_dir("native-key")?;
    let key_file = dir.join("upstream.key");
    fs::write(&key_file, "sk-node-native-1\n")?;
    fs::set_permissions(&key_file, fs::Permissions::from_mode(0o600))?;
    let key_arg = key_file.display().to_string();
    let mut args = PASS_THROUGH.to_vec();
    args.extend(["--upstream-api-key-file", key_arg.as_str()]);
    let rig = Rig::start(UPSTREAM_BIN, &args)?;
    let headers = [
        ("x-api-key", "sk-ant-client-1"),
        ("anthropic-version", "2023-06-01"),
    ];
    let body = messages::body("[[script:normal tokens=2]]", false);
    let (status, seen, answer) = messages::post(&rig.haltd, messages::MESSAGES, &body, &headers)?;
    ensure!(status == 200, "{answer}");
    let id = seen["x-haltd-stream-id"].as_str().context("stream id")?;
    let h = &upstream_request(&rig, id)?["headers"];
    ensure!(
        h["authorization"] == "Bearer sk-node-native-1"
            && h.get("x-api-key").is_none()
            && h["anthropic-version"] == "2023-06-01",
        "the client's key left haltd: {h}"
    );
    Ok(())
}
