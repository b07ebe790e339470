//! Errors of `POST /v1/responses` in OpenAI's schema (`{"error": {message, type, param,
//! code}}`) and the exceptions the SDK raises for them: a field haltd cannot honour (400,
//! `BadRequestError`, the message naming the field), `previous_response_id` (400 with code
//! `previous_response_not_supported`, telling the client to send the whole input), the
//! upstream's 429 (`RateLimitError`), an upstream failure mid-stream (an `error` event, which
//! the SDK raises as `APIError`), and the access log line of each.

use anyhow::{ensure, Result};
use haltd_tests::rig::Rig;
use serde_json::Value;

use super::{lines_say_responses, sdk, stream_id, turn};
use crate::{messages::access_lines_of, UPSTREAM_BIN};

/// The SDK's error: its class and status; the error object (the SDK's `body`: the `error`
/// member of the answer).
fn sdk_error(r: &Value, class: &str, status: u16) -> Result<Value> {
    ensure!(r["ok"] == false && r["exception"] == class, "{class}: {r}");
    ensure!(r["status"] == status, "{class}: {r}");
    let chain = r["exception_chain"].as_array().cloned().unwrap_or_default();
    ensure!(
        chain.contains(&Value::from("APIError")) && chain.contains(&Value::from("OpenAIError")),
        "{class}: not an APIError: {r}"
    );
    Ok(r["body"].clone())
}

/// Fields haltd cannot honour: 400 `invalid_request_error`, the message starting with the
/// field's path; `previous_response_id` with its own code.
fn bad_fields_name_the_field(r: &[Value]) -> Result<()> {
    for (t, path) in r[..4]
        .iter()
        .zip(["bogus", "tools[0].type", "truncation", "input[0].type"])
    {
        let err = sdk_error(t, "BadRequestError", 400)?;
        let msg = err["message"].as_str().unwrap_or_default();
        ensure!(
            err["type"] == "invalid_request_error" && msg.starts_with(path),
            "the message does not name {path}: {t}"
        );
    }
    for t in &r[4..6] {
        let err = sdk_error(t, "BadRequestError", 400)?;
        let msg = err["message"].as_str().unwrap_or_default();
        ensure!(
            err["code"] == "previous_response_not_supported"
                && msg.starts_with("previous_response_id")
                && msg.contains("input"),
            "previous_response_id: {t}"
        );
        ensure!(t["events"] == serde_json::json!([]), "{t}");
    }
    Ok(())
}

/// The upstream's 429 before the answer began, and its failure mid-stream.
fn upstream_failures(r: &[Value]) -> Result<()> {
    for t in &r[0..2] {
        let err = sdk_error(t, "RateLimitError", 429)?;
        ensure!(
            err["code"] == "UPSTREAM_FAILURE" && err["upstream"]["status"] == 429,
            "{t}"
        );
    }
    // Mid-stream: an `error` event after what went out, which the SDK raises with haltd's
    // halt object as its body.
    for (t, kind) in r[2..4].iter().zip(["stalled", "error_event"]) {
        let err = sdk_error(t, "APIError", 200)?;
        ensure!(
            err["code"] == "UPSTREAM_FAILURE" && err["upstream"]["kind"] == kind,
            "{t}"
        );
        ensure!(
            t["text"] == "The quick",
            "what came before the failure: {t}"
        );
        ensure!(
            t["events"][0] == "response.created" && t["halt"].is_null(),
            "{t}"
        );
    }
    Ok(())
}

#[test]
fn errors_reach_the_sdk_in_openai_s_schema() -> Result<()> {
    let rig = Rig::start(
        UPSTREAM_BIN,
        &["--log-format", "json", "--upstream-stall-timeout-ms", "300"],
    )?;
    let web_search = r#"{"type": "web_search"}"#;
    let reference = r#"[{"type": "item_reference", "id": "msg_1"}]"#;
    let limited = "[[script:status code=429 retry_after=7]]";
    let r = sdk(
        &rig.haltd,
        &[],
        &[
            turn(&["--mode", "create", "--extra-body", r#"{"bogus": 1}"#]),
            turn(&["--mode", "stream", "--tools", web_search]),
            turn(&[
                "--mode",
                "create",
                "--extra-body",
                r#"{"truncation": "auto"}"#,
            ]),
            turn(&["--mode", "stream", "--input-json", reference]),
            turn(&["--mode", "create", "--previous-response-id", "resp_1"]),
            turn(&["--mode", "stream", "--previous-response-id", "resp_1"]),
            turn(&["--mode", "create", "--prompt", limited]),
            turn(&["--mode", "stream", "--prompt", limited]),
            turn(&["--mode", "stream", "--prompt", "[[script:stall tokens=2]]"]),
            turn(&[
                "--mode",
                "stream",
                "--prompt",
                "[[script:error_event tokens=2 msg=boom]]",
            ]),
        ],
    )?;
    bad_fields_name_the_field(&r[0..6])?;
    upstream_failures(&r[6..10])?;

    // The access log: each a line of the Responses endpoint, with its status.
    let ids = r.iter().map(stream_id).collect::<Result<Vec<_>>>()?;
    let lines = access_lines_of(&rig.haltd, &ids)?;
    lines_say_responses(&lines)?;
    let statuses: Vec<&Value> = lines.iter().map(|l| &l["status"]).collect();
    ensure!(
        statuses
            == [400, 400, 400, 400, 400, 400, 429, 429, 200, 200]
                .map(Value::from)
                .iter()
                .collect::<Vec<_>>(),
        "{lines:?}"
    );
    ensure!(
        lines[8]["outcome"] == "halted" && lines[8]["halt_code"] == "UPSTREAM_FAILURE",
        "{}",
        lines[8]
    );
    Ok(())
}
