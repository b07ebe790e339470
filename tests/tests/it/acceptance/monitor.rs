//! The HaltMonitor (spec 001, G6) on real streams.

use std::{fs, time::Duration};

use anyhow::{anyhow, ensure, Context, Result};
use haltd_tests::{spawn_in_netns, sse, temp_dir, EventKind, Haltd, NetPair, StreamOutcome};
use serde_json::{json, Value};

use super::{chat, chat_url, stop_and_verify, wait_idle};

// ---------------------------------------------------------------------------------------------
// 3. HaltMonitor (spec 001, G6) on real streams.

const MONITOR_PROMPTS: usize = 60;
const MONITOR_MAX_TOKENS: u32 = 120;
const MONITOR_LIMIT: f64 = 0.05;

/// The logprobs of a chat stream's token events, as f32 (what haltd scores).
fn chat_logprobs(o: &StreamOutcome) -> Result<Vec<f32>> {
    o.events
        .iter()
        .filter(|e| matches!(e.kind, EventKind::Token(_)))
        .map(|e| {
            let v: Value = serde_json::from_str(&e.data)?;
            let lp = v["choices"][0]["logprobs"]["content"][0]["logprob"]
                .as_f64()
                .with_context(|| format!("token event without logprob: {}", e.data))?;
            // Written as the shortest decimal that round-trips the f32.
            #[expect(
                clippy::cast_possible_truncation,
                reason = "the value is an f32 written as decimal"
            )]
            Ok(lp as f32)
        })
        .collect()
}

fn monitor_body(i: usize) -> Value {
    let mut b = chat(
        &format!("Tell me about coherence {i}"),
        1000 + i as u64,
        MONITOR_MAX_TOKENS,
        true,
    );
    b["logprobs"] = json!(true);
    b
}

/// Runs every monitor request against `haltd`, 8 at a time.
fn monitor_runs(haltd: &Haltd) -> Result<Vec<StreamOutcome>> {
    let url = chat_url(haltd);
    let mut out = Vec::new();
    for chunk in (0..MONITOR_PROMPTS).collect::<Vec<_>>().chunks(8) {
        let handles: Vec<_> = chunk
            .iter()
            .map(|&i| {
                let url = url.clone();
                spawn_in_netns(&haltd.client_ns, move || {
                    sse::stream(&url, &monitor_body(i), Duration::from_secs(30), |_, _| {})
                })
            })
            .collect();
        for h in handles {
            out.push(h.join().map_err(|_| anyhow!("client thread panicked"))??);
        }
    }
    Ok(out)
}

/// The runs with P = 0 (the default), which never trips: every request yields max_tokens
/// tokens and no incident is written.
fn reference_runs() -> Result<Vec<StreamOutcome>> {
    let pair = NetPair::new()?;
    let haltd = Haltd::start(&pair, &["--builtin-token-interval-us", "0"])?;
    let runs = monitor_runs(&haltd)?;
    for (i, o) in runs.iter().enumerate() {
        ensure!(
            o.tokens == MONITOR_MAX_TOKENS as usize
                && o.finish_reason.as_deref() == Some("length")
                && o.error.is_none()
                && o.done_at.is_some(),
            "P = 0, request {i}: {} tokens, finish {:?}, error {:?}",
            o.tokens,
            o.finish_reason,
            o.error
        );
    }
    let records = stop_and_verify(haltd)?;
    ensure!(
        !records.iter().any(|r| r["kind"] == "incident"),
        "P = 0 wrote incidents"
    );
    Ok(runs)
}

/// haltd with the monitor at MONITOR_LIMIT and, so that the monitor's cut is exact, without
/// the exfiltration scanner (it may hold a token back when the monitor trips, and held text
/// is never emitted).
fn start_monitored(pair: &NetPair) -> Result<Haltd> {
    let limit = MONITOR_LIMIT.to_string();
    let dir = temp_dir("monitor-config")?;
    let config = dir.join("haltd.toml");
    fs::write(&config, "[detectors.exfil]\nmode = \"off\"\n")?;
    let config = config.display().to_string();
    Haltd::start(
        pair,
        &[
            "--builtin-token-interval-us",
            "0",
            "--hard-limit",
            &limit,
            "--config",
            &config,
        ],
    )
}

/// One monitored run against its reference: the index of the first token under the limit in
/// the reference (where the run must have halted), and what is wrong with the run.
fn judge_run(
    o: &StreamOutcome,
    r: &StreamOutcome,
    ln_limit: f64,
) -> Result<(Option<usize>, Vec<String>)> {
    let mut failures = Vec::new();
    let mut fail = |what: String| failures.push(what);
    let ref_lps = chat_logprobs(r)?;
    let lps = chat_logprobs(o)?;
    // Same (prompt, seed): the monitored stream is the reference up to the first failing
    // token, which haltd scores exactly as exp(f64(logprob)) < P.
    let tau = ref_lps
        .iter()
        .position(|&lp| f64::from(lp).exp() < MONITOR_LIMIT);
    if let Some(bad) = lps.iter().position(|&lp| f64::from(lp) < ln_limit) {
        fail(format!(
            "token {bad} has logprob {} < ln(P) = {ln_limit}",
            lps[bad]
        ));
    }
    let ref_prefix: String = r
        .events
        .iter()
        .filter_map(|e| match &e.kind {
            EventKind::Token(t) => Some(t.as_str()),
            _ => None,
        })
        .take(o.tokens)
        .collect();
    if o.text != ref_prefix {
        fail("received text differs from the reference prefix".into());
    }
    match tau {
        None => {
            if o.tokens != MONITOR_MAX_TOKENS as usize || o.error.is_some() {
                fail(format!(
                    "no failing token, yet {} tokens, error {:?}",
                    o.tokens, o.error
                ));
            }
        }
        Some(tau) => {
            if let Err(e) = o.halted_cleanly("COHERENCE_BELOW_THRESHOLD") {
                fail(format!("{e:#}"));
                return Ok((Some(tau), failures));
            }
            let err = o.error.clone().unwrap_or_default();
            if o.tokens != tau
                || err["trip_token_index"].as_u64() != Some(o.tokens as u64)
                || err["post_trip_tokens"].as_u64() != Some(0)
            {
                fail(format!(
                    "received {} tokens, first failing token {tau}; error {err}",
                    o.tokens
                ));
            }
        }
    }
    Ok((tau, failures))
}

#[test]
fn halt_monitor_on_real_streams() -> Result<()> {
    let ln_limit = MONITOR_LIMIT.ln();
    // Reference: P = 0 (the default) never trips; every request yields max_tokens tokens.
    let reference = reference_runs()?;
    let pair = NetPair::new()?;
    let haltd = start_monitored(&pair)?;
    let runs = monitor_runs(&haltd)?;
    let mut taus = Vec::new();
    let mut failures = Vec::new();
    for (i, (o, r)) in runs.iter().zip(&reference).enumerate() {
        let (tau, fails) = judge_run(o, r, ln_limit)?;
        taus.extend(tau);
        failures.extend(
            fails
                .into_iter()
                .map(|what| format!("request {i} ({}): {what}", o.stream_id)),
        );
    }
    ensure!(
        failures.is_empty(),
        "{}\n{}",
        failures.join("\n"),
        haltd.log_tail(20)
    );
    let tripped_ids: Vec<&str> = runs
        .iter()
        .filter(|o| o.error.is_some())
        .map(|o| o.stream_id.as_str())
        .collect();
    taus.sort_unstable();
    println!(
        "halt monitor P = {MONITOR_LIMIT}: {} of {MONITOR_PROMPTS} streams tripped, at token indices {taus:?}",
        taus.len()
    );
    ensure!(
        taus.len() >= MONITOR_PROMPTS / 4 && taus.iter().any(|&t| t >= 3),
        "too few streams trip late enough to test anything: {taus:?} (pick another --hard-limit)"
    );
    wait_idle(&haltd)?;
    let m = haltd.metrics()?;
    // Both initiators: a detector's cause may also come from an operator's trip.
    let counted = m.sum_where(
        "haltd_watchdog_trips_total",
        &[("cause", "COHERENCE_BELOW_THRESHOLD")],
    );
    ensure!(
        counted == taus.len() as f64,
        "haltd_watchdog_trips_total{{cause=\"COHERENCE_BELOW_THRESHOLD\"}} {counted}, {} trips",
        taus.len()
    );
    let records = stop_and_verify(haltd)?;
    for id in tripped_ids {
        let incident = records
            .iter()
            .find(|r| r["kind"] == "incident" && r["stream_id"] == id)
            .with_context(|| format!("no incident record for {id}"))?;
        ensure!(
            incident["failure_codes"] == json!(["WATCHDOG_TRIP", "COHERENCE_BELOW_THRESHOLD"])
                && incident["halt_tokens_post_trip"].as_u64() == Some(0),
            "incident for {id}: {incident}"
        );
    }
    Ok(())
}
