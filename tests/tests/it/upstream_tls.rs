//! Root-only tests of TLS to the upstream (`--upstream https://...`): haltd in front of the
//! scripted upstream speaking TLS with a certificate made for the test, trusted through
//! `--upstream-ca-file`. Covered: streamed and batch turns over TLS; one handshake for several
//! turns on a pooled connection (the upstream's connection numbers and
//! `haltd_upstream_tls_handshakes_total`); an operator halt stays within the budget and
//! cancels the generation; and every verification failure (unknown CA, another name, an
//! upstream that speaks plain HTTP) is a 502 `UPSTREAM_FAILURE` of kind `tls` with rustls's
//! words in the message and the record, while no request ever reaches the upstream in clear.

use std::time::Duration;

use anyhow::{ensure, Context, Result};
use haltd_tests::{
    rig::{chat, Rig},
    tls::TestPki,
    trip_here, EventKind, StreamOutcome,
};

use crate::UPSTREAM_BIN;

fn stream(rig: &Rig, directive: &str) -> Result<StreamOutcome> {
    rig.stream(
        "/v1/chat/completions",
        &chat(directive, true),
        None,
        |_, _| {},
    )
}

fn completed(o: &StreamOutcome, tokens: usize) -> Result<()> {
    ensure!(o.status == 200, "status {} body {:?}", o.status, o.body);
    ensure!(
        o.finish_reason.as_deref() == Some("stop") && o.error.is_none() && o.done_at.is_some(),
        "not a normal end: {:?} {:?}",
        o.finish_reason,
        o.events
    );
    ensure!(o.tokens == tokens, "{} tokens, expected {tokens}", o.tokens);
    Ok(())
}

fn counter(rig: &Rig, name: &str) -> Result<f64> {
    rig.haltd.metrics()?.value_or_zero(name, &[])
}

/// Streamed and batch turns over TLS, all on the one pooled connection: one handshake.
fn turns_share_one_session(rig: &Rig) -> Result<()> {
    for _ in 0..3 {
        completed(&stream(rig, "[[script:normal tokens=4]]")?, 4)?;
    }
    let (status, _, v) = rig.post(
        "/v1/chat/completions",
        &chat("[[script:normal tokens=5]]", false),
        None,
    )?;
    ensure!(status == 200, "batch over TLS: {status} {v}");
    let text = v["choices"][0]["message"]["content"]
        .as_str()
        .context("batch content")?;
    ensure!(text.split_whitespace().count() == 5, "batch text {text:?}");
    let first = rig.up.wait_ended(0, Duration::from_secs(10))?;
    for nth in 0..4 {
        let r = rig.up.wait_ended(nth, Duration::from_secs(10))?;
        ensure!(
            r["conn"] == first["conn"] && r["conn_request"] == nth as u64 + 1,
            "request {nth} not on the one kept TLS connection: {r}"
        );
    }
    ensure!(counter(rig, "haltd_upstream_tls_handshakes_total")? == 1.0);
    ensure!(counter(rig, "haltd_upstream_pool_reused_total")? == 3.0);
    Ok(())
}

/// An operator trip mid-stream: at most B (5) frames after the trip point, the generation
/// cancelled, and the next turn on a new connection with a new handshake.
fn a_halt_is_bounded(rig: &Rig) -> Result<()> {
    let admin = rig.haltd.admin_url();
    let mut tripped = None;
    let o = rig.stream(
        "/v1/chat/completions",
        &chat("[[script:normal tokens=500 pace_ms=10]]", true),
        Some("Bearer tls-trip"),
        |p, ev| {
            if tripped.is_none() && matches!(ev.kind, EventKind::Token(_)) && p.tokens == 5 {
                let url = format!("{admin}/admin/streams/{}/trip", p.stream_id);
                tripped = Some(trip_here(&url, None));
            }
        },
    )?;
    o.halted_cleanly("OPERATOR_TRIP")?;
    let (code, info) = tripped.context("tripped")??;
    ensure!(code == 200, "{code} {info}");
    let tau = info["trip_token_index"].as_u64().context("τ")? as usize;
    ensure!(
        o.tokens <= tau + 5,
        "post-trip tokens {} > B",
        o.tokens - tau
    );
    let up = rig.up.wait_ended(4, Duration::from_secs(3))?;
    ensure!(up["outcome"] == "cancelled", "{up}");
    ensure!(up["tokens_sent"].as_u64().unwrap_or(500) < 100, "{up}");
    let rec = rig.turn_record(&o.stream_id)?;
    ensure!(rec["upstream"]["cancel_reason"] == "trip", "{rec}");
    completed(&stream(rig, "[[script:normal tokens=2]]")?, 2)?;
    let after = rig.up.wait_ended(5, Duration::from_secs(10))?;
    ensure!(
        after["conn"] != up["conn"],
        "a tripped TLS connection was reused"
    );
    ensure!(counter(rig, "haltd_upstream_tls_handshakes_total")? == 2.0);
    Ok(())
}

#[test]
fn tls_upstream_turns_reuse_one_session_and_halts_stay_bounded() -> Result<()> {
    let pki = TestPki::new("good", &["127.0.0.1"])?;
    let rig = Rig::start_tls(
        UPSTREAM_BIN,
        Some(&pki),
        &pki,
        &["--keep-alive"],
        // One worker: one pool, so that consecutive turns meet the same connection.
        &["--workers", "1", "--upstream-pool-idle-timeout-ms", "60000"],
    )?;
    turns_share_one_session(&rig)?;
    a_halt_is_bounded(&rig)
}

/// One misconfigured TLS upstream: the client's documented error, the record, the metric, and
/// nothing sent to the upstream in clear.
fn fails_typed(rig: &Rig, words: &str) -> Result<()> {
    for stream in [true, false] {
        let (status, h, v) = rig.post(
            "/v1/chat/completions",
            &chat("[[script:normal tokens=3]]", stream),
            None,
        )?;
        ensure!(status == 502, "stream={stream}: {status} {v}");
        let err = &v["error"];
        ensure!(err["code"] == "UPSTREAM_FAILURE", "{v}");
        ensure!(err["type"] == "upstream_error", "{v}");
        ensure!(err["upstream"]["kind"] == "tls", "{v}");
        let msg = err["message"].as_str().unwrap_or_default();
        ensure!(
            msg.starts_with("TLS handshake with the upstream failed") && msg.contains(words),
            "message {msg:?} lacks {words:?}"
        );
        let id = h["x-haltd-stream-id"].as_str().context("stream id")?;
        let rec = rig.turn_record(id)?;
        ensure!(rec["outcome"] == "upstream_failed", "{rec}");
        ensure!(rec["upstream"]["failure"]["kind"] == "tls", "{rec}");
        let detail = rec["upstream"]["failure"]["message"].as_str().unwrap_or("");
        ensure!(detail.contains(words), "record {rec}");
    }
    let m = rig.haltd.metrics()?;
    let n = m.value("haltd_upstream_failures_total", &[("kind", "tls")])?;
    ensure!(n == 2.0, "haltd_upstream_failures_total{{kind=tls}} = {n}");
    ensure!(
        rig.up.requests()?.is_empty(),
        "a request reached the upstream: {:?}",
        rig.up.requests()?
    );
    ensure!(
        rig.haltd.log_tail(200).contains(words),
        "the log does not name the TLS error"
    );
    Ok(())
}

#[test]
fn tls_verification_failures_are_typed_and_never_downgraded() -> Result<()> {
    let served = TestPki::new("served", &["127.0.0.1"])?;
    let other = TestPki::new("other", &["127.0.0.1"])?;
    let wrong_name = TestPki::new("wrong-name", &["upstream.example"])?;
    // (what the upstream serves, what haltd trusts, rustls's words)
    for (serve, trust, words) in [
        (Some(&served), &other, "UnknownIssuer"),
        (Some(&wrong_name), &wrong_name, "not valid for name"),
        // An upstream that answers in plain HTTP: TLS fails, nothing is sent in clear.
        (None, &served, "corrupt message"),
    ] {
        let rig = Rig::start_tls(UPSTREAM_BIN, serve, trust, &[], &[])?;
        fails_typed(&rig, words).with_context(|| format!("case {words}"))?;
    }
    Ok(())
}
