//! Degraded safe mode is kept per identity, and `Authorization: Bearer K` (chat, and the
//! Anthropic SDK) and `x-api-key: K` (Anthropic's own header) are one identity
//! (`daemon/src/credential.rs`): a key halted on one surface is degraded on the other, and the
//! `x-api-key` of a Messages request goes upstream as `Authorization: Bearer K`.

use anyhow::{ensure, Context, Result};
use haltd_tests::{
    rig::{chat, Rig},
    trip_here,
};
use serde_json::{json, Value};

use super::{body, post, raw_events, sdk, turn, MESSAGES, WEATHER_TOOL};
use crate::UPSTREAM_BIN;

/// A raw Messages stream with tools, sent with `x-api-key: key`: its events, its
/// `x-haltd-mode`.
fn messages_with_tools(rig: &Rig, key: &str) -> Result<(Vec<Value>, Option<String>, String)> {
    let mut b = body("[[script:tool_call tokens=4 calls=1]]", true);
    b["tools"] = json!([serde_json::from_str::<Value>(WEATHER_TOOL)?]);
    let o = rig.stream_headers(MESSAGES, &b, &[("x-api-key", key)], |_, _| {})?;
    ensure!(o.status == 200, "{o:?}");
    Ok((raw_events(&o), o.mode_header.clone(), o.stream_id.clone()))
}

/// Key `k` (halted on chat) on Messages: degraded, served as one batch answer without the
/// tools; the upstream gets its key as a bearer token.
fn degraded_on_messages(rig: &Rig, k: &str) -> Result<()> {
    let (events, mode, id) = messages_with_tools(rig, k)?;
    ensure!(
        mode.as_deref() == Some("degraded"),
        "x-haltd-mode {mode:?}: {events:?}"
    );
    ensure!(
        !events
            .iter()
            .any(|e| e["content_block"]["type"] == "tool_use"),
        "a tool_use block in degraded mode: {events:?}"
    );
    let deltas = events
        .iter()
        .filter(|e| e["event"] == "content_block_delta")
        .count();
    ensure!(deltas <= 1, "served as batch: {deltas} deltas: {events:?}");
    let fwd = rig
        .up
        .requests()?
        .into_iter()
        .find(|r| r.get("event").is_none() && r["headers"]["x-haltd-stream-id"] == id.as_str())
        .context("forwarded")?;
    ensure!(
        fwd["body"].get("tools").is_none(),
        "tools forwarded in degraded mode: {fwd}"
    );
    ensure!(
        fwd["headers"]["authorization"] == format!("Bearer {k}"),
        "x-api-key did not go upstream as the bearer token: {fwd}"
    );
    let rec = rig.turn_record(&id)?;
    ensure!(
        rec["runtime_mode"] == "degraded" && rec["budget"] == 0,
        "{rec}"
    );
    let (status, h, v) = post(
        &rig.haltd,
        MESSAGES,
        &body("[[script:normal tokens=2]]", false),
        &[("x-api-key", k)],
    )?;
    ensure!(
        status == 200 && h["x-haltd-mode"] == "degraded" && v["type"] == "message",
        "{status} {h} {v}"
    );
    Ok(())
}

/// Streams a long Messages turn with `x-api-key: key` and trips it at its third delta;
/// returns its stream id once the SDK-visible end said refusal.
fn trip_messages_stream(rig: &Rig, key: &str) -> Result<String> {
    let admin = rig.haltd.admin_url();
    let mut seen = 0;
    let o = rig.stream_headers(
        MESSAGES,
        &body("[[script:normal tokens=300 pace_ms=10]]", true),
        &[("x-api-key", key)],
        |p, ev| {
            if ev.event.as_deref() == Some("content_block_delta") {
                seen += 1;
                if seen == 3 {
                    let _ = trip_here(&format!("{admin}/admin/streams/{}/trip", p.stream_id), None);
                }
            }
        },
    )?;
    let events = raw_events(&o);
    let n = events.len();
    ensure!(
        n >= 2 && events[n - 1]["type"] == "message_stop",
        "{events:?}"
    );
    let end = &events[n - 2];
    ensure!(
        end["delta"]["stop_reason"] == "refusal" && end["haltd"]["code"] == "OPERATOR_TRIP",
        "{events:?}"
    );
    Ok(o.stream_id)
}

/// Degraded mode is one per scope across chat and Messages: without `--identity-header` the
/// client's address group (issue 36), whichever credential header a request carries.
#[test]
fn degraded_mode_is_one_per_scope_across_chat_and_messages() -> Result<()> {
    let rig = Rig::start(UPSTREAM_BIN, &[haltd_tests::daemon::ADDR_SCOPED])?;
    // Halted on chat with `Authorization: Bearer K`: degraded on Messages with `x-api-key: K`.
    let k = "sk-ant-chat-first";
    let first = rig.trip_stream_of(&format!("Bearer {k}"))?;
    degraded_on_messages(&rig, k)?;
    // Another key from the same address is the same scope: degraded too.
    let (_, mode, _) = messages_with_tools(&rig, "sk-ant-bystander")?;
    ensure!(
        mode.as_deref() == Some("degraded"),
        "another key from the same address escaped: {mode:?}"
    );
    let change = rig.wait_record("the first mode change", |r| {
        r["mode_change"]["stream_id"] == first.as_str()
    })?;
    let scope = change["mode_change"]["scope"]
        .as_str()
        .unwrap_or_default()
        .to_owned();
    ensure!(scope.starts_with("addr:"), "{change}");
    rig.haltctl(true, &["mode", "full", "--scope", &scope])?;

    // Halted on Messages with `x-api-key: K`: degraded on chat with `Authorization: Bearer K`,
    // and for the SDK (which sends the key as a bearer token).
    let k = "sk-ant-messages-first";
    let id = trip_messages_stream(&rig, k)?;
    let change = rig.wait_record("the mode change", |r| {
        r["mode_change"]["stream_id"] == id.as_str()
    })?;
    ensure!(
        change["mode_change"]["to"] == "degraded"
            && change["mode_change"]["scope"] == scope.as_str(),
        "{change}"
    );
    let o = rig.stream(
        "/v1/chat/completions",
        &chat("[[script:normal tokens=3]]", true),
        Some(&format!("Bearer {k}")),
        |_, _| {},
    )?;
    ensure!(
        o.mode_header.as_deref() == Some("degraded"),
        "chat: {:?}",
        o.mode_header
    );
    let r = sdk(
        &rig.haltd,
        &["--api-key", k, "--prompt", "[[script:normal tokens=3]]"],
        &[turn(&["--mode", "stream"]), turn(&["--mode", "create"])],
    )?;
    for t in &r {
        ensure!(
            t["ok"] == true && t["headers"]["x-haltd-mode"] == "degraded",
            "the SDK's turn is not degraded: {t}"
        );
    }
    // The operator ends it for the one key: both surfaces are served in full again.
    rig.haltctl(true, &["mode", "full", "--scope", &scope])?;
    let (_, mode, _) = messages_with_tools(&rig, k)?;
    ensure!(mode.is_none(), "still degraded after mode full: {mode:?}");
    Ok(())
}
