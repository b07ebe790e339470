//! Issue 37, point 3: what an operator's trip does to degraded mode. The answer says whether
//! the stream's scope is degraded now and until when; `haltctl trip --no-degrade` opts a trip
//! out, and the choice is recorded; `--degraded-for-s` defaults to an hour; a degraded turn's
//! request is shaped for fact-only literal content (`--degraded-instruction`); a scope entering
//! degraded mode is escalated to `--escalation-url`, retried until the endpoint accepts it; and
//! its first turn is answered with `--degraded-ask-first` instead of the model.

use std::{os::unix::fs::PermissionsExt as _, sync::Mutex};

use anyhow::{ensure, Context, Result};
use haltd_tests::{
    rig::{chat, Rig},
    temp_dir,
    tls::TestPki,
    upstream::PORT_UPSTREAM,
};
use serde_json::Value;

use crate::UPSTREAM_BIN;

/// Streams a long turn of `auth`, runs `haltctl [--json] trip ID EXTRA` at its second token,
/// and returns the stream id and what haltctl printed.
fn trip_with_haltctl(
    rig: &Rig,
    auth: &str,
    json: bool,
    extra: &[&str],
) -> Result<(String, String)> {
    let printed: Mutex<Option<Result<String>>> = Mutex::new(None);
    let o = rig.stream(
        "/v1/chat/completions",
        &chat("[[script:normal tokens=200 pace_ms=5]]", true),
        Some(auth),
        |p, ev| {
            if matches!(ev.kind, haltd_tests::EventKind::Token(_)) && p.tokens == 2 {
                let mut args = vec!["trip", p.stream_id];
                args.extend_from_slice(extra);
                *printed.lock().unwrap_or_else(|e| e.into_inner()) = Some(rig.haltctl(json, &args));
            }
        },
    )?;
    o.halted_cleanly("OPERATOR_TRIP")?;
    let printed = printed
        .into_inner()
        .unwrap_or_else(|e| e.into_inner())
        .context("haltctl trip never ran")??;
    Ok((o.stream_id, printed))
}

/// A short turn of `auth` (at temperature 0.9): whether it ran degraded (`x-haltd-mode:
/// degraded`). A degraded turn's request reached the backend shaped for fact-only literal
/// content: the instruction first, temperature 0; a full one as the client sent it.
fn runs_degraded(rig: &Rig, auth: &str) -> Result<bool> {
    let mut body = chat("[[script:normal tokens=3]]", true);
    body["temperature"] = 0.9.into();
    let o = rig.stream("/v1/chat/completions", &body, Some(auth), |_, _| {})?;
    ensure!(o.status == 200, "{o:?}");
    let degraded = o.mode_header.as_deref() == Some("degraded");
    let sent = &crate::passthrough::upstream_request(rig, &o.stream_id)?["body"];
    let first = &sent["messages"][0];
    if degraded {
        ensure!(
            first["role"] == "system"
                && first["content"]
                    .as_str()
                    .is_some_and(|c| c.starts_with("Answer only with facts stated literally"))
                && sent["temperature"] == 0,
            "a degraded turn's request: {sent}"
        );
    } else {
        ensure!(
            first["role"] == "user" && sent["temperature"] == 0.9,
            "{sent}"
        );
    }
    Ok(degraded)
}

#[test]
fn an_operator_trip_says_what_it_degraded_and_no_degrade_opts_out() -> Result<()> {
    // No --degraded-for-s: the default, an hour, is in force.
    let rig = Rig::start(UPSTREAM_BIN, &[])?;
    let (a, b) = ("Bearer key-A", "Bearer key-B");

    let (id, printed) = trip_with_haltctl(&rig, a, true, &[])?;
    let answer: Value = serde_json::from_str(&printed).with_context(|| printed.clone())?;
    let scope = rig.haltd.scope_of(a)?;
    let d = &answer["degraded_scope"];
    ensure!(
        answer["stream_id"] == id.as_str()
            && answer["degrade"] == "degraded"
            && d["scope"] == scope.as_str()
            && d["stream_id"] == id.as_str(),
        "{answer}"
    );
    let (since, until) = (
        d["since_unix_ms"].as_u64().context("since")?,
        d["until_unix_ms"]
            .as_u64()
            .context("until: the default has a timer")?,
    );
    ensure!(until - since == 3_600_000, "{answer}");
    ensure!(
        runs_degraded(&rig, a)?,
        "{scope} is not degraded after the trip"
    );
    let mode = rig.get_admin("/admin/mode")?;
    ensure!(mode["degraded_for_s"] == 3600.0, "{mode}");
    let change = rig.wait_record("mode change", |r| {
        r["mode_change"]["stream_id"] == id.as_str()
    })?;
    ensure!(
        change["mode_change"]["scope"] == scope.as_str()
            && change["mode_change"]["until_unix_ms"] == until,
        "{change}"
    );

    // --no-degrade: B's trip leaves B's scope as it was, and says so; the ledger says why.
    let (id_b, printed) = trip_with_haltctl(&rig, b, false, &["--no-degrade"])?;
    ensure!(
        printed
            .lines()
            .any(|l| l.starts_with("degrade ") && l.ends_with(" declined"))
            && printed
                .lines()
                .any(|l| l.starts_with("degraded_scope ") && l.ends_with(" -")),
        "{printed}"
    );
    ensure!(
        !runs_degraded(&rig, b)?,
        "a --no-degrade trip degraded its scope"
    );
    let admin = rig.wait_record("the trip's admin record", |r| {
        r["kind"] == "admin" && r["admin"]["stream_id"] == id_b.as_str()
    })?;
    ensure!(
        admin["admin"]["degrade"] == false && admin["admin"]["status"] == 200,
        "{admin}"
    );
    rig.turn_record(&id_b)?;
    let records = rig.haltd.ledger_records()?;
    ensure!(
        !records
            .iter()
            .any(|r| r["mode_change"]["stream_id"] == id_b.as_str()),
        "a mode change for the --no-degrade trip"
    );

    Ok(())
}

/// A haltd whose upstream is the scripted one over TLS, escalating to its webhook `hook` with
/// a bearer token, and `extra`.
fn escalating(hook: &str, extra: &[&str]) -> Result<Rig> {
    let pki = TestPki::new("escalation", &["127.0.0.1"])?;
    let dir = temp_dir("escalation")?;
    let token = dir.join("token");
    std::fs::write(&token, "hook-token-1\n")?;
    std::fs::set_permissions(&token, std::fs::Permissions::from_mode(0o600))?;
    let url = format!("https://127.0.0.1:{PORT_UPSTREAM}/hooks/{hook}");
    let (token, ca) = (token.display().to_string(), pki.ca.display().to_string());
    let mut args = vec![
        "--escalation-url",
        url.as_str(),
        "--escalation-token-file",
        token.as_str(),
        "--escalation-ca-file",
        ca.as_str(),
    ];
    args.extend_from_slice(extra);
    Rig::start_tls(UPSTREAM_BIN, Some(&pki), &pki, &[], &args)
}

/// The webhook's requests, as the scripted upstream logged them.
fn hook_requests(rig: &Rig, hook: &str) -> Result<Vec<Value>> {
    let path = format!("/hooks/{hook}");
    Ok(rig
        .up
        .requests()?
        .into_iter()
        .filter(|q| q.get("event").is_none() && q["path"] == path.as_str())
        .collect())
}

#[test]
fn an_escalation_is_retried_until_the_endpoint_accepts_it() -> Result<()> {
    // The endpoint refuses twice (503), then accepts.
    let rig = escalating("fail-2", &[])?;
    let auth = "Bearer key-E";
    let id = rig.trip_stream_of(auth)?;
    let scope = rig.haltd.scope_of(auth)?;
    let rec = rig.wait_record("the escalation", |r| !r["escalation"].is_null())?;
    let e = &rec["escalation"];
    let attempts = e["attempts"].as_array().context("attempts")?;
    let statuses: Vec<&Value> = attempts.iter().map(|a| &a["status"]).collect();
    ensure!(
        e["outcome"] == "delivered"
            && statuses == [503, 503, 200]
            && rec["stream_id"] == id.as_str(),
        "{rec}"
    );
    let at: Vec<u64> = attempts
        .iter()
        .filter_map(|a| a["at_ms"].as_u64())
        .collect();
    println!("escalation to /hooks/fail-2: statuses {statuses:?} at {at:?} ms");
    ensure!(
        at.len() == 3 && at[1] >= at[0] + 250 && at[2] >= at[1] + 500,
        "backoff of 250 ms, then 500 ms: {at:?}"
    );
    let incident = &e["incident"];
    ensure!(
        incident["scope"] == scope.as_str()
            && incident["cause"] == "OPERATOR_TRIP"
            && incident["stream_id"] == id.as_str()
            && incident["event"] == "degraded"
            && incident["node"].as_str().is_some_and(|n| !n.is_empty()),
        "{incident}"
    );
    ensure!(
        e["url"] == format!("https://127.0.0.1:{PORT_UPSTREAM}/hooks/fail-2").as_str()
            && !rec.to_string().contains("hook-token-1"),
        "{rec}"
    );
    // The endpoint got the incident three times, with the token, over TLS.
    let got = hook_requests(&rig, "fail-2")?;
    ensure!(got.len() == 3, "{got:?}");
    for q in &got {
        ensure!(
            q["headers"]["authorization"] == "Bearer hook-token-1"
                && q["headers"]["accept"] == "application/json"
                && &q["body"] == incident,
            "{q}"
        );
    }
    let m = rig.haltd.metrics()?;
    ensure!(m.value("haltd_escalations_total", &[("outcome", "delivered")])? == 1.0);
    Ok(())
}

#[test]
fn a_failed_escalation_is_recorded_and_holds_nothing_up() -> Result<()> {
    // Two attempts at an endpoint that is down longer: failed, recorded; the halt and the
    // degraded scope went on without it.
    let rig = escalating("fail-9", &["--escalation-attempts", "2"])?;
    let auth = "Bearer key-F";
    rig.trip_stream_of(auth)?;
    ensure!(runs_degraded(&rig, auth)?, "the scope is not degraded");
    let rec = rig.wait_record("the escalation", |r| !r["escalation"].is_null())?;
    let e = &rec["escalation"];
    ensure!(
        e["outcome"] == "failed"
            && e["attempts"].as_array().map(Vec::len) == Some(2)
            && e["attempts"][1]["status"] == 503
            && e["attempts"][1]["error"]
                .as_str()
                .is_some_and(|m| m.contains("503")),
        "{rec}"
    );
    ensure!(hook_requests(&rig, "fail-9")?.len() == 2);
    let m = rig.haltd.metrics()?;
    ensure!(m.value("haltd_escalations_total", &[("outcome", "failed")])? == 1.0);
    Ok(())
}

/// The clarification of the ask-first test.
const ASK: &str = "Before I answer: which account do you mean, and as of which date?";

#[test]
fn the_first_degraded_turn_of_a_scope_asks_first_in_its_surface() -> Result<()> {
    let rig = Rig::start(UPSTREAM_BIN, &["--degraded-ask-first", ASK])?;
    let auth = "Bearer key-Q";
    rig.trip_stream_of(auth)?;
    // The first turn after the halt: the clarification, not the model (no upstream request).
    let o = rig.stream(
        "/v1/chat/completions",
        &chat("[[script:normal tokens=3]]", true),
        Some(auth),
        |_, _| {},
    )?;
    ensure!(
        o.status == 200
            && o.mode_header.as_deref() == Some("degraded")
            && o.text == format!(" {ASK}")
            && o.finish_reason.as_deref() == Some("stop"),
        "{o:?}"
    );
    ensure!(
        crate::passthrough::upstream_request(&rig, &o.stream_id).is_err(),
        "the model was asked"
    );
    let rec = rig.turn_record(&o.stream_id)?;
    ensure!(
        rec["outcome"] == "completed"
            && rec["runtime_mode"] == "degraded"
            && rec["message"]
                .as_str()
                .is_some_and(|m| m.contains("--degraded-ask-first")),
        "{rec}"
    );
    // The next turn goes to the model, degraded.
    ensure!(runs_degraded(&rig, auth)?, "the second turn");
    // Degraded again after the operator ended it: asked again, in the Messages shape.
    rig.haltctl(false, &["mode", "full"])?;
    rig.trip_stream_of(auth)?;
    let body = serde_json::json!({"model": "scripted", "max_tokens": 50,
        "messages": [{"role": "user", "content": "[[script:normal tokens=3]]"}]});
    let (status, headers, answer) = rig.post("/v1/messages", &body, Some(auth))?;
    ensure!(
        status == 200
            && headers["x-haltd-mode"] == "degraded"
            && answer["type"] == "message"
            && answer["content"][0]["text"] == format!(" {ASK}").as_str()
            && answer["stop_reason"] == "end_turn",
        "{answer}"
    );
    Ok(())
}
