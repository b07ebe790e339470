//! The watchdog's idle mode (`daemon/src/pulse.rs`): after a second with nothing
//! open it beats once a second; a new connection kicks it and is served only under a fresh
//! beat, and a watchdog that died while idle makes the next stream halt with HEARTBEAT_LOST.

use std::{
    thread,
    time::{Duration, Instant},
};

use anyhow::{ensure, Context, Result};
use haltd_tests::{Haltd, Metrics, NetPair};

use super::{chat, chat_url, get_json, stop_and_verify, stream_in};

/// `/admin/status`'s `heartbeat_state`.
fn heartbeat_state(haltd: &Haltd) -> Result<String> {
    let (code, status) = get_json(haltd, &format!("{}/admin/status", haltd.admin_url()))?;
    ensure!(code == 200, "/admin/status {code}: {status}");
    Ok(status["heartbeat_state"]
        .as_str()
        .with_context(|| format!("no heartbeat_state in {status}"))?
        .to_owned())
}

/// The kernel verdicts that drop or count a send as past a trip (sends and segments), with
/// their counts (the start-up self-test leaves some).
fn kernel_drops(m: &Metrics) -> Vec<(String, f64)> {
    ["haltd_kernel_frames_total", "haltd_kernel_segments_total"]
        .into_iter()
        .flat_map(|name| m.samples(name))
        .filter(|s| {
            s.labels
                .get("verdict")
                .is_some_and(|v| v.starts_with("drop") || v == "pass_post_trip")
        })
        .map(|s| (format!("{}{:?}", s.name, s.labels), s.value))
        .collect()
}

/// After 2.5 s with nothing open the watchdog is idle (and says so); the next stream is served
/// whole, with no halt and nothing dropped or counted as post-trip by the kernel gate: it was
/// never sent under a stale heartbeat.
#[test]
fn a_stream_after_an_idle_spell_is_served_whole() -> Result<()> {
    const TOKENS: u32 = 50;
    let pair = NetPair::new()?;
    let haltd = Haltd::start(&pair, &["--builtin-token-interval-us", "1000"])?;
    thread::sleep(Duration::from_millis(2500));
    let state = heartbeat_state(&haltd)?;
    ensure!(state == "idle", "heartbeat_state {state} after 2.5 s idle");
    let m = haltd.metrics()?;
    ensure!(
        m.value("haltd_watchdog_idle", &[])? == 1.0,
        "haltd_watchdog_idle is not 1 while idle"
    );
    let drops_before = kernel_drops(&m);
    let t = Instant::now();
    let body = chat("After a quiet spell", 11, TOKENS, true);
    let o = stream_in(&haltd, &chat_url(&haltd), &body, |_, _| {})?;
    println!(
        "idle watchdog: stream of {} tokens in {:.1} ms, finish {:?}",
        o.tokens,
        t.elapsed().as_secs_f64() * 1e3,
        o.finish_reason
    );
    ensure!(
        o.tokens == TOKENS as usize
            && o.finish_reason.as_deref() == Some("length")
            && o.error.is_none()
            && o.read_error.is_none(),
        "the stream after the idle spell did not complete: {} tokens, finish {:?}, error {:?}, read error {:?}\n{}",
        o.tokens,
        o.finish_reason,
        o.error,
        o.read_error,
        haltd.log_tail(30)
    );
    let m = haltd.metrics()?;
    let drops = kernel_drops(&m);
    ensure!(
        drops == drops_before,
        "the kernel gate treated a send as past a trip: {drops:?}, before the stream {drops_before:?}"
    );
    ensure!(
        m.value("haltd_watchdog_trips_total", &[("cause", "HEARTBEAT_LOST")])? == 0.0,
        "a HEARTBEAT_LOST trip"
    );
    let records = stop_and_verify(haltd)?;
    ensure!(
        !records.iter().any(|r| r["kind"] == "incident"),
        "an incident was recorded: {records:?}"
    );
    Ok(())
}

/// The watchdog stalls (fault injection) while idle: the status says lost once its idle
/// period and the deadline are over, and the next stream is halted with HEARTBEAT_LOST, no
/// token sent, within the heartbeat deadline of its kick.
#[test]
fn a_watchdog_stalled_while_idle_halts_the_next_stream() -> Result<()> {
    const STALL_MS: u64 = 3000;
    const DEADLINE_MS: u64 = 200;
    let pair = NetPair::new()?;
    let haltd = Haltd::start(
        &pair,
        &[
            "--fault",
            &format!("watchdog-stall-after-ms={STALL_MS}"),
            "--heartbeat-deadline-ms",
            &DEADLINE_MS.to_string(),
            "--builtin-token-interval-us",
            "1000",
        ],
    )?;
    // The watchdog started before haltd was ready: it is idle from at most 1 s after this,
    // stalls at its first idle wake-up after STALL_MS (at most a second later), and its last
    // beat is then lost within 1 s + the deadline.
    let ready = Instant::now();
    thread::sleep(Duration::from_millis(1500));
    let state = heartbeat_state(&haltd)?;
    ensure!(state == "idle", "heartbeat_state {state} 1.5 s after start");
    thread::sleep(Duration::from_millis(STALL_MS + 2500).saturating_sub(ready.elapsed()));
    let state = heartbeat_state(&haltd)?;
    ensure!(
        state == "lost",
        "heartbeat_state {state} after the watchdog stalled while idle\n{}",
        haltd.log_tail(20)
    );
    let t = Instant::now();
    let body = chat("Nobody is watching", 12, 1000, true);
    let o = stream_in(&haltd, &chat_url(&haltd), &body, |_, _| {})?;
    let took = t.elapsed();
    println!(
        "watchdog stalled while idle: {} tokens, ended after {:.1} ms, error {:?}",
        o.tokens,
        took.as_secs_f64() * 1e3,
        o.error
    );
    o.halted_cleanly("HEARTBEAT_LOST")
        .with_context(|| format!("read error {:?}\n{}", o.read_error, haltd.log_tail(30)))?;
    ensure!(
        o.tokens == 0,
        "{} tokens under a stalled watchdog",
        o.tokens
    );
    // The kick's wait (the deadline), then the halt; slack for a loaded machine.
    ensure!(
        took < Duration::from_millis(DEADLINE_MS + 800),
        "the halt took {took:?} (deadline {DEADLINE_MS} ms)"
    );
    haltd.wait_record("HEARTBEAT_LOST incident", |r| {
        r["kind"] == "incident"
            && r["trip_cause"] == "HEARTBEAT_LOST"
            && r["stream_id"] == o.stream_id.as_str()
    })?;
    stop_and_verify(haltd)?;
    Ok(())
}
