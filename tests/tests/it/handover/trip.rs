//! A trip during the hand-over: both processes serve (`--take-over-overlap-ms`); a stream
//! halted in the old process degrades its key for the new one's next turn, and one halted in
//! the new process degrades its key for the old one's. Each halt ends within its budget
//! (`halted_cleanly`), and the process that did not halt records the degradation it adopted
//! (`by: peer`).

use std::time::Duration;

use anyhow::{bail, ensure, Context, Result};
use haltd_tests::{in_netns, read_ledger, require_root, sse, Haltd, KeptConn, NetPair};

/// Which process a kept connection is served by.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Side {
    Old,
    New,
}

/// A streaming chat request for the built-in source, with `key` as credential and tenant.
fn request(key: &str, max_tokens: u32) -> Vec<u8> {
    let body = sse::chat_body("hand-over trip", max_tokens, true).to_string();
    format!(
        "POST /v1/chat/completions HTTP/1.1\r\nhost: haltd\r\ncontent-type: application/json\r\n{}\r\ncontent-length: {}\r\n\r\n{body}",
        sse::auth_lines(key),
        body.len()
    )
    .into_bytes()
}

/// Connections a process has accepted on the client port.
fn accepted(h: &Haltd) -> Result<f64> {
    h.metrics()?.value("haltd_connections_accepted_total", &[])
}

/// Opens a kept connection and finds its process: the one whose count of accepted connections
/// it raised (the test opens one connection at a time, and nothing else connects), once a
/// short turn on it was answered.
fn open_on(old: &Haltd, new: &Haltd) -> Result<(Side, KeptConn)> {
    let before = (accepted(old)?, accepted(new)?);
    let addr = old.api;
    let mut conn = in_netns(&old.client_ns, move || {
        KeptConn::connect(addr, Duration::from_secs(30))
    })?;
    conn.send(&request(&sse::fresh_key(), 3))?;
    let (status, headers) = conn.head()?;
    ensure!(status == 200, "probe answered {status}");
    conn.body(&headers)?;
    let after = (accepted(old)?, accepted(new)?);
    let side = match (after.0 - before.0, after.1 - before.1) {
        (1.0, 0.0) => Side::Old,
        (0.0, 1.0) => Side::New,
        other => bail!("the connection raised the (old, new) accept counts by {other:?}"),
    };
    Ok((side, conn))
}

/// Two kept connections on each process.
fn connections(old: &Haltd, new: &Haltd) -> Result<(Vec<KeptConn>, Vec<KeptConn>)> {
    let (mut on_old, mut on_new) = (Vec::new(), Vec::new());
    for _ in 0..40 {
        if on_old.len() >= 2 && on_new.len() >= 2 {
            return Ok((on_old, on_new));
        }
        match open_on(old, new)? {
            (Side::Old, c) => on_old.push(c),
            (Side::New, c) => on_new.push(c),
        }
    }
    bail!(
        "40 connections did not give two on each process: {} old, {} new",
        on_old.len(),
        on_new.len()
    )
}

/// Trips a stream of `key` on `conn` through `at`'s admin API; checks that it halted cleanly.
fn trip_on(at: &Haltd, conn: &mut KeptConn, key: &str) -> Result<()> {
    conn.send(&request(key, 400))?;
    let (status, headers) = conn.head()?;
    ensure!(status == 200, "the stream to trip answered {status}");
    let id = headers
        .iter()
        .find(|(k, _)| k == "x-haltd-stream-id")
        .map(|(_, v)| v.clone())
        .context("no stream id")?;
    let (tripped, body) = at.trip(&id, None)?;
    ensure!(tripped == 200, "trip answered {tripped}: {body}");
    let text = String::from_utf8_lossy(&conn.body(&headers)?).into_owned();
    ensure!(
        text.contains("OPERATOR_TRIP") && text.ends_with("data: [DONE]\n\n"),
        "not a clean halt: {text}"
    );
    Ok(())
}

/// The next turn of `key` on `conn`, served by the other process: degraded.
fn next_is_degraded(conn: &mut KeptConn, key: &str) -> Result<()> {
    conn.send(&request(key, 3))?;
    let (status, headers) = conn.head()?;
    let mode = headers
        .iter()
        .find(|(k, _)| k == "x-haltd-mode")
        .map(|(_, v)| v.as_str());
    conn.body(&headers)?;
    ensure!(
        status == 200 && mode == Some("degraded"),
        "the next turn of the tripped key: status {status}, x-haltd-mode {mode:?}"
    );
    Ok(())
}

/// The operator-trip incident a ledger holds: one, its halt within the budget (5 tokens).
fn halted_within_budget(ledger: &std::path::Path) -> Result<()> {
    let incidents: Vec<_> = read_ledger(ledger)?
        .into_iter()
        .filter(|r| r["kind"] == "incident" && r["trip_cause"] == "OPERATOR_TRIP")
        .collect();
    ensure!(
        incidents.len() == 1,
        "{} operator-trip incidents",
        incidents.len()
    );
    let post = incidents[0]["halt_tokens_post_trip"].as_u64();
    ensure!(
        post.is_some_and(|n| n <= 5),
        "tokens after the trip: {post:?}"
    );
    Ok(())
}

/// The mode changes `by: peer` a ledger holds.
fn adopted(ledger: &std::path::Path) -> Result<usize> {
    Ok(read_ledger(ledger)?
        .iter()
        .filter(|r| r.pointer("/mode_change/by").is_some_and(|b| b == "peer"))
        .count())
}

#[test]
fn a_trip_in_either_process_degrades_its_key_in_the_other() -> Result<()> {
    require_root()?;
    let pair = NetPair::new()?;
    let flags = [
        "--builtin-token-interval-us",
        "20000",
        "--client-idle-timeout-ms",
        "60000",
    ];
    let mut old = Haltd::start(&pair, &flags)?;
    let mut successor: Vec<&str> = flags.to_vec();
    successor.extend(["--take-over-overlap-ms", "60000"]);
    let mut new = Haltd::start_successor(&pair, &old, &successor)?;
    let (mut on_old, mut on_new) = connections(&old, &new)?;
    let (k1, k2) = (sse::fresh_key(), sse::fresh_key());
    trip_on(&old, &mut on_old[0], &k1)?;
    next_is_degraded(&mut on_new[0], &k1)?;
    trip_on(&new, &mut on_new[1], &k2)?;
    next_is_degraded(&mut on_old[1], &k2)?;
    halted_within_budget(&old.ledger)?;
    halted_within_budget(&new.ledger)?;
    ensure!(
        adopted(&new.ledger)? >= 1,
        "the new process recorded no degradation it adopted from the old"
    );
    ensure!(
        adopted(&old.ledger)? >= 1,
        "the old process recorded no degradation it adopted from the new"
    );
    new.stop()?;
    old.stop()?;
    Ok(())
}
