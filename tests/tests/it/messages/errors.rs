//! Errors of `POST /v1/messages` in Anthropic's schema (`{"type": "error", "error": {type,
//! message, code}}`) and the exceptions the SDK raises for them: a field haltd cannot honour
//! (400, `BadRequestError`, the message naming the field), the paths it does not serve (404
//! `unsupported_endpoint`), the upstream's 429 (`RateLimitError`), a recorder that failed
//! (503, `ServiceUnavailableError`), an upstream failure mid-stream (`event: error`, which the
//! SDK raises as `APIStatusError`), and the access log line of each.

use std::time::Duration;

use anyhow::{ensure, Context, Result};
use haltd_tests::{agent, in_netns, rig::Rig, wait_for, Haltd, NetPair};
use serde_json::{json, Value};

use super::{
    access_lines, access_lines_of, body, lines_say_messages, post, sdk, stream_id, turn, MESSAGES,
    WEATHER_TOOL,
};
use crate::UPSTREAM_BIN;

/// The SDK's error: its class, its status, the body in Anthropic's schema; the error object.
fn sdk_error(r: &Value, class: &str, status: u16, kind: &str) -> Result<Value> {
    ensure!(r["ok"] == false && r["exception"] == class, "{class}: {r}");
    ensure!(r["status"] == status, "{class}: {r}");
    let body = &r["body"];
    ensure!(
        body["type"] == "error" && body["error"]["type"] == kind,
        "{class}: not Anthropic's error schema: {r}"
    );
    Ok(body["error"].clone())
}

/// Fields haltd cannot honour: 400, the message starting with the field's path.
fn bad_fields_name_the_field(r: &[Value]) -> Result<()> {
    for (t, path) in r.iter().zip([
        "messages[0].content[0].type",
        "tools[0].type",
        "tool_choice.bogus",
    ]) {
        let err = sdk_error(t, "BadRequestError", 400, "invalid_request_error")?;
        let msg = err["message"].as_str().unwrap_or_default();
        ensure!(
            msg.starts_with(path),
            "the message does not name {path}: {t}"
        );
    }
    Ok(())
}

/// The upstream's 429 before the answer began, and its failure mid-stream.
fn upstream_failures(r: &[Value]) -> Result<()> {
    for t in &r[0..2] {
        let err = sdk_error(t, "RateLimitError", 429, "rate_limit_error")?;
        ensure!(
            err["code"] == "UPSTREAM_FAILURE" && err["upstream"]["status"] == 429,
            "{t}"
        );
    }
    // Mid-stream: an `error` event after what went out, which the SDK raises.
    for (t, kind) in r[2..4].iter().zip(["stalled", "error_event"]) {
        let err = sdk_error(t, "APIStatusError", 200, "api_error")?;
        ensure!(
            err["haltd"]["code"] == "UPSTREAM_FAILURE" && err["haltd"]["upstream"]["kind"] == kind,
            "{t}"
        );
        ensure!(
            t["text"] == "The quick",
            "what came before the failure: {t}"
        );
        ensure!(
            t["events"][0] == "message_start" && t["halt"].is_null(),
            "{t}"
        );
    }
    Ok(())
}

/// `GET path` with `headers` from haltd's client namespace: (status, body as JSON).
fn get(haltd: &Haltd, path: &str, headers: &[(&str, &str)]) -> Result<(u16, Value)> {
    let url = format!("{}{path}", haltd.api_url());
    let headers: Vec<(String, String)> = headers
        .iter()
        .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
        .collect();
    in_netns(&haltd.client_ns, move || -> Result<(u16, Value)> {
        let mut req = agent(Duration::from_secs(10)).get(&url);
        for (k, v) in &headers {
            req = req.header(k.as_str(), v.as_str());
        }
        let mut resp = req.call().with_context(|| format!("GET {url}"))?;
        let text = resp.body_mut().read_to_string().unwrap_or_default();
        Ok((
            resp.status().as_u16(),
            serde_json::from_str(&text).unwrap_or(Value::Null),
        ))
    })
}

/// Paths haltd does not serve: 404 `unsupported_endpoint`, in Anthropic's schema on the
/// Messages surface; and two credentials that disagree: 400.
fn refused_paths_and_credentials(rig: &Rig) -> Result<String> {
    let counted = json!({"model": "scripted", "messages": [{"role": "user", "content": "hi"}]});
    let (status, h, v) = post(&rig.haltd, "/v1/messages/count_tokens", &counted, &[])?;
    ensure!(
        status == 404
            && v["type"] == "error"
            && v["error"]["type"] == "not_found_error"
            && v["error"]["code"] == "unsupported_endpoint",
        "count_tokens: {status} {v}"
    );
    let count_id = h["x-haltd-stream-id"]
        .as_str()
        .context("stream id")?
        .to_owned();
    let (status, _, v) = post(&rig.haltd, "/v1/responses/resp_1", &counted, &[])?;
    ensure!(
        status == 404 && v["error"]["code"] == "unsupported_endpoint",
        "{status} {v}"
    );
    let (status, v) = get(
        &rig.haltd,
        "/v1/models",
        &[("anthropic-version", "2023-06-01")],
    )?;
    ensure!(
        status == 404 && v["error"]["code"] == "unsupported_endpoint",
        "an Anthropic client's model list: {status} {v}"
    );
    let (status, _, v) = post(
        &rig.haltd,
        MESSAGES,
        &body("[[script:normal tokens=2]]", false),
        &[
            ("x-api-key", "sk-ant-one"),
            ("authorization", "Bearer sk-ant-two"),
        ],
    )?;
    ensure!(
        status == 400 && v["type"] == "error" && v["error"]["type"] == "invalid_request_error",
        "two credentials: {status} {v}"
    );
    Ok(count_id)
}

#[test]
fn errors_reach_the_sdk_in_anthropic_s_schema() -> Result<()> {
    let rig = Rig::start(
        UPSTREAM_BIN,
        &["--log-format", "json", "--upstream-stall-timeout-ms", "300"],
    )?;
    let document = json!([{"role": "user", "content": [{"type": "document",
        "source": {"type": "text", "media_type": "text/plain", "data": "x"}}]}]);
    let server_tool = r#"{"type": "web_search_20250305", "name": "web_search"}"#;
    let limited = "[[script:status code=429 retry_after=7]]";
    let r = sdk(
        &rig.haltd,
        &[],
        &[
            turn(&["--mode", "create", "--messages-json", &document.to_string()]),
            turn(&["--mode", "stream", "--tools", server_tool]),
            turn(&[
                "--mode",
                "create",
                "--tools",
                WEATHER_TOOL,
                "--tool-choice",
                r#"{"type": "auto", "bogus": 1}"#,
            ]),
            turn(&["--mode", "create", "--prompt", limited]),
            turn(&["--mode", "stream", "--prompt", limited]),
            turn(&["--mode", "stream", "--prompt", "[[script:stall tokens=2]]"]),
            turn(&[
                "--mode",
                "create-stream-raw",
                "--prompt",
                "[[script:error_event tokens=2 msg=boom]]",
            ]),
        ],
    )?;
    bad_fields_name_the_field(&r[0..3])?;
    upstream_failures(&r[3..7])?;
    let (status, h, _) = post(&rig.haltd, MESSAGES, &body(limited, false), &[])?;
    ensure!(
        status == 429 && h["retry-after"] == "7",
        "the upstream's retry-after: {status} {h}"
    );
    let count_id = refused_paths_and_credentials(&rig)?;

    // The access log: each a line of the Messages endpoint, with its status.
    let mut ids = r.iter().map(stream_id).collect::<Result<Vec<_>>>()?;
    ids.push(count_id);
    let lines = access_lines_of(&rig.haltd, &ids)?;
    lines_say_messages(&lines)?;
    let statuses: Vec<&Value> = lines.iter().map(|l| &l["status"]).collect();
    ensure!(
        statuses
            == [400, 400, 400, 429, 429, 200, 200, 404]
                .map(Value::from)
                .iter()
                .collect::<Vec<_>>(),
        "{lines:?}"
    );
    ensure!(
        lines[5]["outcome"] == "halted" && lines[5]["halt_code"] == "UPSTREAM_FAILURE",
        "{}",
        lines[5]
    );
    let other = access_lines(&rig.haltd)?
        .into_values()
        .filter(|l| l["status"] == 404 && l["endpoint"] == "other")
        .count();
    ensure!(
        other >= 1,
        "no access log line of /v1/responses/resp_1 as endpoint other"
    );
    drop(rig);
    a_failed_recorder_is_a_503(&NetPair::new()?)
}

/// The flight recorder cannot write (`--fault ledger-write-fails-after=N`, the first record
/// after the start): new turns get 503, which the SDK raises as `ServiceUnavailableError` (an
/// `InternalServerError`).
fn a_failed_recorder_is_a_503(pair: &NetPair) -> Result<()> {
    let at_start = Haltd::start(pair, &[])?.ledger_records()?.len();
    let fault = format!("ledger-write-fails-after={}", at_start + 1);
    let haltd = Haltd::start(pair, &["--fault", &fault])?;
    let short = json!({"model": "builtin", "max_tokens": 2,
        "messages": [{"role": "user", "content": "a record"}]});
    // Its record is the one that fails (its answer may be cut).
    let _ = post(&haltd, "/v1/chat/completions", &short, &[]);
    let mut probe = body("x", false);
    probe["model"] = json!("builtin");
    wait_for(Duration::from_secs(5), "turns refused with 503", || {
        let (status, _, _) = post(&haltd, MESSAGES, &probe, &[])?;
        Ok((status == 503).then_some(()))
    })?;
    let r = sdk(
        &haltd,
        &["--model", "builtin"],
        &[turn(&["--mode", "create"]), turn(&["--mode", "stream"])],
    )?;
    for t in &r {
        let err = sdk_error(t, "ServiceUnavailableError", 503, "overloaded_error")?;
        ensure!(
            t["exception_chain"]
                .as_array()
                .is_some_and(|c| c.contains(&json!("InternalServerError"))),
            "{t}"
        );
        ensure!(err.to_string().contains("recorder"), "{t}");
    }
    Ok(())
}
