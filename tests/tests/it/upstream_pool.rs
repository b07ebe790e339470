//! Root-only tests of the upstream connection pool (`--source openai`): haltd in front of the
//! scripted upstream with `--keep-alive`, whose request log says which connection (in accept
//! order) carried each request. Covered: sequential turns share one connection; a tripped
//! turn's connection and one the upstream answered `connection: close` on are never reused; a
//! pooled connection the upstream drops as the request arrives is retried once on a new
//! connection and the client sees a normal answer; one the upstream closed while idle is
//! noticed and replaced.

use std::{thread, time::Duration};

use anyhow::{ensure, Context, Result};
use haltd_tests::{
    rig::{chat, Rig},
    StreamOutcome,
};
use serde_json::Value;

use crate::UPSTREAM_BIN;

/// How long the upstream keeps an idle connection (uvicorn's keep-alive timeout).
const UPSTREAM_IDLE_MS: u64 = 3_000;

fn stream(rig: &Rig, directive: &str) -> Result<StreamOutcome> {
    rig.stream(
        "/v1/chat/completions",
        &chat(directive, true),
        None,
        |_, _| {},
    )
}

fn completed(o: &StreamOutcome) -> Result<()> {
    ensure!(o.status == 200, "status {} body {:?}", o.status, o.body);
    ensure!(
        o.finish_reason.as_deref() == Some("stop") && o.error.is_none() && o.done_at.is_some(),
        "not a normal end: {:?} {:?}",
        o.finish_reason,
        o.events
    );
    Ok(())
}

/// The upstream's end-of-request log line of request `nth` (0-based), once written.
fn ended(rig: &Rig, nth: usize) -> Result<Value> {
    rig.up.wait_ended(nth, Duration::from_secs(10))
}

/// The connection number that carried request `nth`.
fn conn_of(rig: &Rig, nth: usize) -> Result<u64> {
    let r = ended(rig, nth)?;
    r["conn"]
        .as_u64()
        .with_context(|| format!("no conn in {r}"))
}

fn pool_counter(rig: &Rig, name: &str) -> Result<f64> {
    rig.haltd
        .metrics()?
        .value_or_zero(&format!("haltd_upstream_pool_{name}_total"), &[])
}

fn discarded(rig: &Rig, reason: &str) -> Result<f64> {
    rig.haltd
        .metrics()?
        .value_or_zero("haltd_upstream_pool_discarded_total", &[("reason", reason)])
}

/// Sequential turns reuse one connection; a tripped turn's connection and one answered with
/// `connection: close` are closed, not reused.
fn reuse_and_what_is_never_reused(rig: &Rig) -> Result<()> {
    for _ in 0..5 {
        completed(&stream(rig, "[[script:normal tokens=3]]")?)?;
    }
    let first = conn_of(rig, 0)?;
    for nth in 0..5 {
        let r = ended(rig, nth)?;
        ensure!(
            r["conn"] == first && r["conn_request"] == nth as u64 + 1,
            "request {nth} not on the one kept connection: {r}"
        );
    }
    ensure!(pool_counter(rig, "opened")? == 1.0, "opened more than one");
    ensure!(pool_counter(rig, "reused")? == 4.0, "reused count");

    // A trip: the generation is cancelled, its connection closed; the next turn connects anew.
    let o = stream(rig, "[[script:normal tokens=40 pace_ms=10 neginf_at=3]]")?;
    o.halted_cleanly("COHERENCE_BELOW_THRESHOLD")?;
    let tripped = ended(rig, 5)?;
    ensure!(tripped["outcome"] == "cancelled", "{tripped}");
    completed(&stream(rig, "[[script:normal tokens=2]]")?)?;
    let after_trip = conn_of(rig, 6)?;
    ensure!(
        after_trip != conn_of(rig, 5)?,
        "a tripped turn's connection was reused"
    );
    ensure!(discarded(rig, "not_reusable")? >= 1.0);

    // The upstream says `connection: close` (close-delimited body): not pooled.
    completed(&stream(rig, "[[script:normal tokens=2 framing=close]]")?)?;
    ensure!(
        conn_of(rig, 7)? == after_trip,
        "a pooled connection was not reused"
    );
    completed(&stream(rig, "[[script:normal tokens=2]]")?)?;
    ensure!(
        conn_of(rig, 8)? != after_trip,
        "a connection answered with connection: close was reused"
    );
    Ok(())
}

/// The upstream drops a pooled connection as the request arrives (the race a keep-alive
/// timeout makes): one retry on a new connection, and the client sees a normal answer. Then
/// the upstream closes an idle pooled connection: haltd notices and connects anew.
fn broken_pooled_connections(rig: &Rig, first: usize) -> Result<()> {
    completed(&stream(rig, "[[script:normal tokens=2]]")?)?;
    let pooled = conn_of(rig, first)?;
    let retried = pool_counter(rig, "retried")?;
    completed(&stream(rig, "[[script:normal tokens=3 drop_reused=1]]")?)?;
    let dropped = ended(rig, first + 1)?;
    ensure!(
        dropped["outcome"] == "dropped" && dropped["conn"] == pooled,
        "the request did not go out on the pooled connection first: {dropped}"
    );
    let again = ended(rig, first + 2)?;
    ensure!(
        again["outcome"] == "completed" && again["conn"] != pooled && again["conn_request"] == 1,
        "not retried on a new connection: {again}"
    );
    ensure!(
        pool_counter(rig, "retried")? == retried + 1.0,
        "retried count"
    );
    ensure!(discarded(rig, "broken")? >= 1.0);

    // Idle past the upstream's keep-alive timeout: the upstream closes it.
    let idle = conn_of(rig, first + 2)?;
    thread::sleep(Duration::from_millis(UPSTREAM_IDLE_MS + 1_000));
    let closed_before = discarded(rig, "upstream_closed")?;
    completed(&stream(rig, "[[script:normal tokens=2]]")?)?;
    let r = ended(rig, first + 3)?;
    ensure!(r["conn"] != idle && r["conn_request"] == 1, "{r}");
    ensure!(discarded(rig, "upstream_closed")? == closed_before + 1.0);
    Ok(())
}

#[test]
fn upstream_connections_are_pooled_retried_once_and_never_reused_after_a_trip() -> Result<()> {
    let idle = UPSTREAM_IDLE_MS.to_string();
    let rig = Rig::start_with(
        UPSTREAM_BIN,
        &["--keep-alive", "--keep-alive-idle-ms", &idle],
        // One worker: one pool, so that consecutive turns meet the same connections.
        &[
            "--workers",
            "1",
            "--hard-limit",
            "0.05",
            "--upstream-pool-idle-timeout-ms",
            "60000",
        ],
    )?;
    reuse_and_what_is_never_reused(&rig)?;
    broken_pooled_connections(&rig, 9)
}
