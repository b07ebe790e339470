//! Records that tell the truth (issue 33, item 4): one record of each kind a scripted run
//! makes (lifecycle, turn, incident, admin), every field checked against what the test did.
//! The compute budget runs in observe mode with `max_tokens = 5`, so a long stream breaches
//! it without a halt; the test then trips the stream itself. The crash and tool_circuit
//! kinds are checked field by field by `crash::` and `restart_circuit::`.

use std::{collections::BTreeSet, fs, sync::mpsc, time::Duration};

use anyhow::{ensure, Context, Result};
use haltd_tests::{spawn_in_netns, sse, temp_dir, Haltd, NetPair, StreamOutcome};
use serde_json::{json, Value};

use super::{incident_of, BUDGET};

const CONFIG: &str = "[detectors.compute_budget]\nmode = \"observe\"\nmax_tokens = 5\n";
/// The stream is tripped once the client has this many tokens.
const TRIP_AFTER: usize = 12;

/// The keys of `rec`: each must be checked by the caller, so a new field fails this test
/// until someone says what it must hold.
fn keys(rec: &Value) -> BTreeSet<String> {
    rec.as_object()
        .map(|m| m.keys().cloned().collect())
        .unwrap_or_default()
}

/// Every key of `rec` is in `checked`.
fn all_checked(what: &str, rec: &Value, checked: &[&str]) -> Result<()> {
    let checked: BTreeSet<String> = checked.iter().map(|s| (*s).to_owned()).collect();
    let unchecked: Vec<_> = keys(rec).difference(&checked).cloned().collect();
    ensure!(
        unchecked.is_empty(),
        "{what}: fields no check covers: {unchecked:?}\n{rec}"
    );
    Ok(())
}

/// The fields every record has: the chain, the time, the kind and the gate.
const CHAIN: [&str; 6] = ["seq", "prev_hash", "hash", "kind", "ts", "kernel_gate"];

fn chain_ok(rec: &Value, kind: &str) -> Result<()> {
    ensure!(
        rec["kind"] == kind && rec["kernel_gate"] == "enforcing",
        "{rec}"
    );
    ensure!(rec["hash"].as_str().is_some_and(|h| h.len() == 64), "{rec}");
    ensure!(
        rec["prev_hash"].as_str().is_some_and(|h| h.len() == 64),
        "{rec}"
    );
    ensure!(
        rec["ts"].as_str().is_some_and(|t| t.ends_with('Z')),
        "{rec}"
    );
    Ok(())
}

/// A long stream, tripped by the test through the admin API after [`TRIP_AFTER`] tokens.
fn tripped_stream(haltd: &Haltd, key: &str) -> Result<StreamOutcome> {
    let (tx, rx) = mpsc::channel();
    let url = format!("{}/v1/chat/completions", haltd.api_url());
    let auth = key.to_owned();
    let client = spawn_in_netns(&haltd.client_ns, move || {
        let body = json!({"model": "builtin", "stream": true, "max_tokens": 400,
            "ignore_eos": true, "messages": [{"role": "user", "content": "records"}]});
        let mut sent = false;
        sse::stream_with(
            &url,
            &body,
            &[("authorization", &auth)],
            Duration::from_secs(20),
            |p, _| {
                if !sent && p.tokens >= TRIP_AFTER {
                    sent = tx.send(p.stream_id.to_owned()).is_ok();
                }
            },
        )
    });
    let id = rx
        .recv_timeout(Duration::from_secs(10))
        .context("stream id")?;
    let (status, body) = haltd.trip(&id, None)?;
    ensure!(status == 200, "trip: {status} {body}");
    client
        .join()
        .map_err(|_| anyhow::anyhow!("client panicked"))?
}

#[test]
fn each_record_kind_says_what_the_test_did() -> Result<()> {
    let pair = NetPair::new()?;
    let dir = temp_dir("records")?;
    let config = dir.join("haltd.toml");
    fs::write(&config, CONFIG)?;
    let cfg = config.display().to_string();
    let haltd = Haltd::start(
        &pair,
        &[
            "--config",
            &cfg,
            "--budget",
            "5",
            "--builtin-token-interval-us",
            "5000",
        ],
    )?;
    let key = sse::fresh_key();
    let o = tripped_stream(&haltd, &key)?;
    let cause = o
        .error
        .as_ref()
        .map(|e| e["code"].clone())
        .context("terminal")?;
    let conversation = haltd.key_fingerprint(&key)?;
    let records = haltd.ledger_records()?;
    let incident = incident_of(&records, &o.stream_id)?;
    check_incident(incident, &o, &cause, &conversation)?;
    let turn = haltd.wait_record("the tripped turn's record", |r| {
        r["kind"] == "turn" && r["stream_id"] == o.stream_id.as_str()
    })?;
    check_turn(&turn, &o, &conversation)?;
    check_lifecycle(&records[0])?;
    let admin = haltd.wait_record("the trip's admin record", |r| r["kind"] == "admin")?;
    check_admin(&admin, &o.stream_id)?;
    println!(
        "records: incident {} / turn {} checked field by field",
        incident["timing_incidents"], turn["safety_verdict"]["results"]
    );
    drop(haltd);
    let _ = fs::remove_dir_all(&dir);
    Ok(())
}

/// The fields [`scope_named`] checks.
const SCOPE: [&str; 3] = ["scope", "route", "profile"];

/// The degraded scope of the turn: the harness's tenant header names it (`tests/src/daemon.rs`);
/// and the policy it started under: no `[[routes]]`, so the default route of profile `full`.
fn scope_named(rec: &Value) -> Result<()> {
    let scope = rec["scope"].as_str().unwrap_or_default();
    ensure!(scope.starts_with("header:") && scope.len() == 23, "{rec}");
    ensure!(
        rec["route"] == "default" && rec["profile"] == "full",
        "{rec}"
    );
    Ok(())
}

/// What the trip and the observe-mode budget breach put in the incident record.
fn check_incident(rec: &Value, o: &StreamOutcome, cause: &Value, conv: &str) -> Result<()> {
    chain_ok(rec, "incident")?;
    ensure!(rec["stream_id"] == o.stream_id.as_str(), "{rec}");
    ensure!(rec["turn_id"] == rec["stream_id"], "{rec}");
    ensure!(
        rec["mode"] == "stream" && rec["runtime_mode"] == "full",
        "{rec}"
    );
    ensure!(
        rec["budget"] == BUDGET && rec["conversation"] == conv,
        "{rec}"
    );
    scope_named(rec)?;
    // The timing fields in force: the budget breached in observe mode.
    ensure!(
        rec["rts_mode"] == "breach" && rec["tig_breach"] == true,
        "{rec}"
    );
    let timing = json!(["COMPUTE_BUDGET_EXCEEDED", "WATCHDOG_TRIP"]);
    ensure!(rec["timing_incidents"] == timing, "{rec}");
    check_incident_halt(rec, o, cause)?;
    ensure!(refs_name(rec, "compute_budget:observe"), "{rec}");
    let msg = rec["message"].as_str().unwrap_or_default();
    ensure!(msg.contains("halted"), "{rec}");
    for absent in ["latency_bucket", "safety_verdict", "outcome"] {
        ensure!(rec[absent].is_null(), "{absent} in an incident: {rec}");
    }
    let mut checked = CHAIN.to_vec();
    checked.extend(SCOPE);
    checked.extend([
        "stream_id",
        "turn_id",
        "mode",
        "runtime_mode",
        "budget",
        "conversation",
        "rts_mode",
        "tig_breach",
        "timing_incidents",
        "watchdog_trip",
        "trip_cause",
        "failure_codes",
        "trip_token_index",
        "halt_tokens_post_trip",
        "tokens_emitted",
        "halt_latency_ms",
        "halted_by",
        "kernel",
        "started_at",
        "ended_at",
        "detector_refs",
        "message",
        "latency_bucket",
        "safety_verdict",
        "outcome",
    ]);
    all_checked("incident", rec, &checked)
}

/// The halt's fields of the incident record, as the client saw the halt.
fn check_incident_halt(rec: &Value, o: &StreamOutcome, cause: &Value) -> Result<()> {
    let err = o.error.as_ref().context("terminal")?;
    let tau = err["trip_token_index"].as_u64().context("τ")?;
    let post = err["post_trip_tokens"].as_u64().context("post")?;
    ensure!(
        rec["watchdog_trip"] == true && rec["trip_cause"] == *cause,
        "{rec}"
    );
    ensure!(
        rec["failure_codes"] == json!(["WATCHDOG_TRIP", cause]),
        "{rec}"
    );
    ensure!(rec["trip_token_index"] == tau, "{rec}");
    ensure!(rec["halt_tokens_post_trip"] == post, "{rec}");
    let client = o.tokens as u64;
    ensure!(
        client == tau + post && post <= BUDGET,
        "client {client} τ {tau} post {post}"
    );
    ensure!(rec["tokens_emitted"].as_u64() == Some(client), "{rec}");
    ensure!(
        rec["halt_latency_ms"].as_f64().is_some_and(|l| l >= 0.0),
        "{rec}"
    );
    let by = rec["halted_by"].as_str();
    ensure!(matches!(by, Some("emitter" | "watchdog")), "{rec}");
    let kernel = rec["kernel"]["post_trip_frames"].as_u64();
    ensure!(kernel.is_some_and(|k| k <= BUDGET), "{rec}");
    ensure!(
        rec["started_at"].as_str() < rec["ended_at"].as_str(),
        "{rec}"
    );
    Ok(())
}

fn refs_name(rec: &Value, what: &str) -> bool {
    rec["detector_refs"]
        .as_array()
        .is_some_and(|r| r.iter().any(|x| x == what))
}

/// The turn record of the same stream: the same timing fields, the detectors' summaries,
/// and `no_silent_correction` judged from the text the client got.
fn check_turn(rec: &Value, o: &StreamOutcome, conv: &str) -> Result<()> {
    chain_ok(rec, "turn")?;
    ensure!(
        rec["outcome"] == "halted" && rec["turn_status"] == "failed",
        "{rec}"
    );
    ensure!(
        rec["conversation"] == conv && rec["stream_id"] == o.stream_id.as_str(),
        "{rec}"
    );
    scope_named(rec)?;
    ensure!(
        rec["rts_mode"] == "breach" && rec["tig_breach"] == true,
        "{rec}"
    );
    ensure!(
        rec["timing_incidents"] == json!(["COMPUTE_BUDGET_EXCEEDED", "WATCHDOG_TRIP"]),
        "{rec}"
    );
    let budget = &rec["detectors"]["compute_budget"];
    ensure!(
        budget["mode"] == "observe" && budget["breaches"].as_u64() > Some(0),
        "{rec}"
    );
    let silent = rec["safety_verdict"]["results"]
        .as_array()
        .and_then(|r| {
            r.iter()
                .find(|x| x["boundary_id"] == "no_silent_correction")
        })
        .context("no_silent_correction")?;
    ensure!(
        silent["status"] == "upheld" && silent["runtime_checkable"] == true,
        "{silent}"
    );
    let evidence = |k: &str| {
        silent["evidence"]
            .as_array()
            .and_then(|e| e.iter().find(|p| p[0] == k))
            .and_then(|p| p[1].as_str().map(str::to_owned))
    };
    // What haltd says it sent is what the client got.
    ensure!(
        evidence("sent_bytes") == Some(o.text.len().to_string()),
        "{silent} vs {:?}",
        o.text
    );
    ensure!(evidence("completed").as_deref() == Some("false"), "{rec}");
    check_turn_halt(rec, o)?;
    let mut checked = CHAIN.to_vec();
    checked.extend(SCOPE);
    checked.extend([
        "outcome",
        "turn_status",
        "conversation",
        "stream_id",
        "turn_id",
        "rts_mode",
        "tig_breach",
        "timing_incidents",
        "detectors",
        "safety_verdict",
        "watchdog_trip",
        "trip_cause",
        "failure_codes",
        "trip_token_index",
        "halt_tokens_post_trip",
        "tokens_emitted",
        "halted_by",
        "halt_latency_ms",
        "mode",
        "runtime_mode",
        "budget",
        "latency_bucket",
        "sampling",
        "message",
        "kernel",
        "started_at",
        "ended_at",
        "detector_refs",
    ]);
    all_checked("turn", rec, &checked)
}

/// The halt's fields of the turn record, as the client saw the halt.
fn check_turn_halt(rec: &Value, o: &StreamOutcome) -> Result<()> {
    let err = o.error.as_ref().context("terminal")?;
    ensure!(
        rec["turn_id"] == rec["stream_id"] && rec["watchdog_trip"] == true,
        "{rec}"
    );
    ensure!(rec["trip_cause"] == err["code"], "{rec}");
    ensure!(
        rec["failure_codes"] == json!(["WATCHDOG_TRIP", err["code"]]),
        "{rec}"
    );
    ensure!(rec["trip_token_index"] == err["trip_token_index"], "{rec}");
    ensure!(
        rec["halt_tokens_post_trip"] == err["post_trip_tokens"],
        "{rec}"
    );
    ensure!(
        rec["tokens_emitted"].as_u64() == Some(o.tokens as u64),
        "{rec}"
    );
    ensure!(
        matches!(rec["halted_by"].as_str(), Some("emitter" | "watchdog")),
        "{rec}"
    );
    ensure!(
        rec["halt_latency_ms"].as_f64().is_some_and(|l| l >= 0.0),
        "{rec}"
    );
    ensure!(
        rec["mode"] == "stream" && rec["runtime_mode"] == "full" && rec["budget"] == BUDGET,
        "{rec}"
    );
    ensure!(
        rec["latency_bucket"]
            .as_str()
            .is_some_and(|b| b.starts_with("le_")),
        "{rec}"
    );
    ensure!(rec["sampling"]["reason"] == "incident", "{rec}");
    ensure!(
        rec["message"]
            .as_str()
            .is_some_and(|m| m.starts_with("turn of")),
        "{rec}"
    );
    ensure!(rec["kernel"].is_null(), "{rec}");
    ensure!(
        rec["started_at"].as_str() < rec["ended_at"].as_str(),
        "{rec}"
    );
    ensure!(refs_name(rec, "compute_budget:observe"), "{rec}");
    Ok(())
}

fn check_lifecycle(rec: &Value) -> Result<()> {
    ensure!(
        rec["seq"] == 0 && rec["kind"] == "lifecycle" && rec["kernel_gate"] == "enforcing",
        "{rec}"
    );
    let msg = rec["message"].as_str().unwrap_or_default();
    ensure!(msg.contains("started") && msg.contains("budget=5"), "{rec}");
    ensure!(
        rec["rts_mode"] == "normal" && rec["timing_incidents"] == json!([]),
        "{rec}"
    );
    ensure!(
        rec["watchdog_trip"] == false && rec["stream_id"].is_null(),
        "{rec}"
    );
    Ok(())
}

fn check_admin(rec: &Value, stream_id: &str) -> Result<()> {
    chain_ok(rec, "admin")?;
    let a = &rec["admin"];
    ensure!(a["action"] == "trip" && a["status"] == 200, "{rec}");
    ensure!(
        rec.to_string().contains(stream_id),
        "the admin record names the stream: {rec}"
    );
    ensure!(a["actor"].is_object(), "{rec}");
    Ok(())
}
