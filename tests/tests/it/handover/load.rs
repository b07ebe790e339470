//! No stream lost: 200 streams open on the old haltd and a client opening 50 connections a
//! second throughout; the successor takes over, the old one drains and exits 0. Every stream
//! and every connection ends normally (`[DONE]`), and the ledger pair verifies.

use std::{
    sync::{
        atomic::{AtomicBool, Ordering::SeqCst},
        Arc,
    },
    thread,
    time::{Duration, Instant},
};

use anyhow::{anyhow, ensure, Result};
use haltd_tests::{require_root, spawn_in_netns, sse, wait_for, Haltd, NetPair, StreamOutcome};

/// Open streams during the hand-over, and how long each lasts (tokens × interval).
const STREAMS: usize = 200;
const STREAM_TOKENS: u32 = 150;
const TOKEN_INTERVAL_US: &str = "20000";

/// New connections a second while the hand-over runs.
const CONNECTIONS_PER_S: u64 = 50;

/// One streaming turn from the client namespace; an error for anything but a clean `[DONE]`.
fn one_turn(url: &str, tokens: u32) -> Result<StreamOutcome> {
    let out = sse::stream(
        url,
        &sse::chat_body("hand-over", tokens, true),
        Duration::from_secs(60),
        |_, _| {},
    )?;
    ensure!(
        out.status == 200
            && out.done_at.is_some()
            && out.read_error.is_none()
            && out.error.is_none(),
        "status {}, done {:?}, read error {:?}, error {:?}, body {:?}",
        out.status,
        out.done_at.is_some(),
        out.read_error,
        out.error,
        out.body
    );
    Ok(out)
}

/// Opens a new connection every 1/`CONNECTIONS_PER_S` s (each a short streaming turn) until
/// `stop`; returns every outcome.
fn hammer(ns: &str, url: String, stop: Arc<AtomicBool>) -> thread::JoinHandle<Vec<Result<()>>> {
    let ns = ns.to_owned();
    thread::spawn(move || {
        let mut turns = Vec::new();
        let every = Duration::from_micros(1_000_000 / CONNECTIONS_PER_S);
        let mut next = Instant::now();
        while !stop.load(SeqCst) {
            let url = url.clone();
            turns.push(spawn_in_netns(&ns, move || one_turn(&url, 3).map(drop)));
            next += every;
            thread::sleep(next.saturating_duration_since(Instant::now()));
        }
        turns
            .into_iter()
            .map(|t| t.join().map_err(|_| anyhow!("a client thread panicked"))?)
            .collect()
    })
}

#[test]
fn no_stream_or_connection_is_lost_during_a_hand_over() -> Result<()> {
    require_root()?;
    let pair = NetPair::new()?;
    let flags = [
        "--builtin-token-interval-us",
        TOKEN_INTERVAL_US,
        "--drain-timeout-ms",
        "30000",
    ];
    let mut old = Haltd::start(&pair, &flags)?;
    let url = format!("{}/v1/chat/completions", old.api_url());
    let streams: Vec<_> = (0..STREAMS)
        .map(|_| {
            let url = url.clone();
            spawn_in_netns(&pair.cli, move || one_turn(&url, STREAM_TOKENS))
        })
        .collect();
    wait_for(Duration::from_secs(20), "200 open streams", || {
        Ok((old.metrics()?.value("haltd_streams_active", &[])? >= STREAMS as f64).then_some(()))
    })?;
    let stop = Arc::new(AtomicBool::new(false));
    let clients = hammer(&pair.cli, url, Arc::clone(&stop));
    thread::sleep(Duration::from_millis(500));
    let t0 = Instant::now();
    let new = Haltd::start_successor(&pair, &old, &flags)?;
    let ready = t0.elapsed();
    super::exits_cleanly(&mut old, Duration::from_secs(40))?;
    let old_gone = t0.elapsed();
    thread::sleep(Duration::from_secs(1));
    stop.store(true, SeqCst);
    let outcomes: Vec<Result<()>> = clients.join().map_err(|_| anyhow!("the client panicked"))?;
    let lost: Vec<String> = outcomes
        .iter()
        .filter_map(|r| r.as_ref().err().map(ToString::to_string))
        .collect();
    ensure!(
        lost.is_empty(),
        "{} of {} connections failed: {:?}",
        lost.len(),
        outcomes.len(),
        &lost[..lost.len().min(5)]
    );
    for s in streams {
        let out = s
            .join()
            .map_err(|_| anyhow!("a stream thread panicked"))??;
        ensure!(out.tokens > 0, "a stream ended without tokens");
    }
    report(&old, &new, (ready, old_gone), outcomes.len())
}

/// Checks the ledger pair and prints the hand-over's timings and counts (the closing note's).
fn report(
    old: &Haltd,
    new: &Haltd,
    (ready, old_gone): (Duration, Duration),
    connections: usize,
) -> Result<()> {
    super::verify_pair(old, new)?;
    super::linked_records(&old.ledger, &new.ledger)?;
    let stopped = super::last_message(&old.ledger, "haltd handed over")?;
    let accepted_new = new
        .metrics()?
        .value("haltd_connections_accepted_total", &[])?;
    wait_for(
        Duration::from_secs(5),
        "the successor's hand-over record",
        || Ok(super::last_message(&new.ledger, "hand-over from pid").ok()),
    )?;
    eprintln!(
        "hand-over: successor ready {ready:?} after its start, old haltd gone {old_gone:?} after it; {connections} client connections, {STREAMS} streams, none lost\n  old: {stopped}\n  new: {}\n  new accepted {accepted_new} connections",
        super::last_message(&new.ledger, "hand-over from pid")?
    );
    Ok(())
}
