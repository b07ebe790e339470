//! The whole process: stopped mid-stream (SIGSTOP past the heartbeat deadline), slow clients
//! and a full stream table, and a shutdown (SIGTERM) that halts open streams cleanly.

use std::{
    net::TcpStream,
    sync::Arc,
    thread,
    time::{Duration, Instant},
};

use anyhow::{anyhow, ensure, Context, Result};
use haltd_tests::{
    in_netns, raw_exchange_on, spawn_in_netns, sse, verify_ledger, wait_for, EventKind, Haltd,
    NetPair,
};

use super::{chat, chat_url, get_json, stop_and_verify, stream_in};

// ---------------------------------------------------------------------------------------------
// 10. The whole daemon stopped mid-stream (docs/spec.md, the test plan)

/// SIGSTOP the whole daemon mid-stream for longer than the heartbeat deadline, then SIGCONT.
/// Nothing watched the stream during the gap, so it must halt with HEARTBEAT_LOST as soon as
/// haltd runs again: at most B tokens reach the client after the resume, then the typed
/// terminal event, and the ledger records the incident.
#[test]
fn whole_daemon_stopped_mid_stream() -> Result<()> {
    const BUDGET: u64 = 5;
    const STOP_AFTER: usize = 20;
    let pair = NetPair::new()?;
    let haltd = Haltd::start(
        &pair,
        &[
            "--builtin-token-interval-us",
            "5000",
            "--heartbeat-deadline-ms",
            "100",
            "--budget",
            "5",
        ],
    )?;
    let pid = haltd.pid().context("haltd pid")? as libc::pid_t;
    let received = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let (tx, rx) = std::sync::mpsc::channel::<(Instant, Instant)>();
    let stopper = spawn_stopper(pid, Arc::clone(&received), tx, STOP_AFTER);
    let mut arrivals = Vec::new();
    let body = chat("whole daemon stop", 7, 2000, true);
    let o = stream_in(&haltd, &chat_url(&haltd), &body, |p, ev| {
        if matches!(ev.kind, EventKind::Token(_)) {
            arrivals.push(Instant::now());
            received.store(p.tokens, std::sync::atomic::Ordering::SeqCst);
        }
    })?;
    stopper
        .join()
        .map_err(|_| anyhow!("stopper thread panicked"))??;
    let (stopped, resumed) = rx.recv().context("stop times")?;
    let during = arrivals
        .iter()
        .filter(|t| **t > stopped + Duration::from_millis(20) && **t < resumed)
        .count();
    let after = arrivals.iter().filter(|t| **t >= resumed).count() as u64;
    println!(
        "whole daemon stopped after {STOP_AFTER} tokens for 400 ms (deadline 100 ms): {} tokens in all, {during} during the stop, {after} after the resume",
        o.tokens
    );
    ensure!(
        during == 0,
        "{during} tokens arrived while haltd was stopped"
    );
    ensure!(
        after <= BUDGET,
        "{after} tokens after the resume (budget {BUDGET})\n{}",
        haltd.log_tail(30)
    );
    o.halted_cleanly("HEARTBEAT_LOST")
        .with_context(|| format!("read error {:?}\n{}", o.read_error, haltd.log_tail(30)))?;
    let rec = haltd.wait_record("HEARTBEAT_LOST incident", |r| {
        r["kind"] == "incident"
            && r["trip_cause"] == "HEARTBEAT_LOST"
            && r["stream_id"] == o.stream_id.as_str()
    })?;
    ensure!(rec["watchdog_trip"] == true, "incident {rec}");
    stop_and_verify(haltd)?;
    Ok(())
}

/// A thread that waits until `received` reaches `stop_after` tokens, then stops haltd
/// (`pid`) with SIGSTOP for 400 ms and sends when it stopped and resumed it.
fn spawn_stopper(
    pid: libc::pid_t,
    received: Arc<std::sync::atomic::AtomicUsize>,
    tx: std::sync::mpsc::Sender<(Instant, Instant)>,
    stop_after: usize,
) -> thread::JoinHandle<Result<()>> {
    thread::spawn(move || -> Result<()> {
        let t0 = Instant::now();
        while received.load(std::sync::atomic::Ordering::SeqCst) < stop_after {
            ensure!(
                t0.elapsed() < Duration::from_secs(10),
                "stream never reached {stop_after} tokens"
            );
            thread::sleep(Duration::from_millis(1));
        }
        // SAFETY: plain signals to the haltd child this test started.
        let signalled = unsafe { libc::kill(pid, libc::SIGSTOP) };
        ensure!(signalled == 0, "SIGSTOP failed");
        let stopped = Instant::now();
        thread::sleep(Duration::from_millis(400));
        let resumed = Instant::now();
        // SAFETY: as above.
        let signalled = unsafe { libc::kill(pid, libc::SIGCONT) };
        ensure!(signalled == 0, "SIGCONT failed");
        let _ = tx.send((stopped, resumed));
        Ok(())
    })
}

// ---------------------------------------------------------------------------------------------
// 12. Slow clients and a full stream table (bad input, G3)

/// A client that sends part of a request and then nothing gets 408 once
/// `--request-timeout-ms` passes; one that stops in the middle of its body likewise. When the
/// stream table is full (`--max-streams`), a further connection gets 503 with a JSON error
/// and is never served unpoliced; once streams end, new ones are served again. A normal
/// stream runs alongside all of it and completes intact.
#[test]
fn slow_clients_and_a_full_table() -> Result<()> {
    const NORMAL_TOKENS: u32 = 1000;
    let pair = NetPair::new()?;
    let haltd = Haltd::start(
        &pair,
        &[
            "--request-timeout-ms",
            "300",
            "--max-streams",
            "4",
            // The idle holders fill the whole table (this test is about --max-streams);
            // `hostile::` covers the request-phase cap.
            "--request-phase-share",
            "100",
            "--builtin-token-interval-us",
            "2000",
        ],
    )?;
    let api = haltd.api;
    let normal_url = chat_url(&haltd);
    // 1,000 tokens at 2 ms: the stream must outlive the slow clients' checks (two 300 ms
    // timeouts, more on a loaded machine) to hold its slot while the table is filled; 300
    // tokens ended with them on a loaded machine, and the table was never full.
    let normal = spawn_in_netns(&haltd.client_ns, move || {
        sse::stream(
            &normal_url,
            &chat("alongside slow clients", 3, NORMAL_TOKENS, true),
            Duration::from_secs(20),
            |_, _| {},
        )
    });
    check_slow_clients(&haltd)?;
    let holders = fill_the_table(&haltd)?;
    drop(holders);
    let o = normal
        .join()
        .map_err(|_| anyhow!("normal stream thread panicked"))??;
    ensure!(
        o.tokens == NORMAL_TOKENS as usize && o.finish_reason.as_deref() == Some("length"),
        "the stream alongside got {} tokens, finish {:?}",
        o.tokens,
        o.finish_reason
    );
    // Slots come back: the idle holders time out (408) and the table serves again.
    wait_for(Duration::from_secs(5), "a slot free again", || {
        let r = in_netns(&haltd.client_ns, || {
            raw_exchange_on(
                TcpStream::connect(api)?,
                b"GET /healthz HTTP/1.1\r\nhost: x\r\n\r\n",
                Duration::from_secs(5),
            )
        })?;
        Ok((r.status == 200).then_some(()))
    })?;
    let m = haltd.metrics()?;
    let rejected_503 = m.value_or_zero("haltd_requests_rejected_total", &[("status", "503")])?;
    let rejected_408 = m.value_or_zero("haltd_requests_rejected_total", &[("status", "408")])?;
    println!("full table: rejected 503 x{rejected_503}, 408 x{rejected_408}");
    ensure!(
        rejected_503 >= 1.0 && rejected_408 >= 2.0,
        "rejections not counted: 503 x{rejected_503}, 408 x{rejected_408}"
    );
    stop_and_verify(haltd)?;
    Ok(())
}

/// A client that sends half a request head, and one that sends half a body, each get 408
/// once `--request-timeout-ms` (300 ms) passes.
fn check_slow_clients(haltd: &Haltd) -> Result<()> {
    let api = haltd.api;
    let body = serde_json::to_vec(&chat("slow", 1, 5, true))?;
    let partial_body = [
        format!("POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n", body.len()).as_bytes(),
        &body[..body.len() / 2],
    ]
    .concat();
    let cases: Vec<(&str, Vec<u8>)> = vec![
        (
            "half a request head",
            b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\n".to_vec(),
        ),
        ("half a body", partial_body),
    ];
    for (what, bytes) in cases {
        let (status, took) = in_netns(&haltd.client_ns, || -> Result<(u16, Duration)> {
            let t = Instant::now();
            let s = TcpStream::connect(api)?;
            let r = raw_exchange_on(s, &bytes, Duration::from_secs(5))?;
            Ok((r.status, t.elapsed()))
        })?;
        println!(
            "slow client ({what}): {status} after {} ms",
            took.as_millis()
        );
        ensure!(status == 408, "{what}: status {status}");
        ensure!(
            took >= Duration::from_millis(250) && took < Duration::from_secs(3),
            "{what}: 408 after {took:?} (timeout 300 ms)"
        );
    }
    Ok(())
}

/// Fills the 4-slot table (the normal stream and three idle connections, returned) and
/// checks that one more connection is answered 503 with a JSON error naming the limit.
fn fill_the_table(haltd: &Haltd) -> Result<Vec<TcpStream>> {
    let api = haltd.api;
    // Fill the table: the normal stream holds one slot, three idle connections the rest.
    let holders = in_netns(&haltd.client_ns, || -> Result<Vec<TcpStream>> {
        (0..3).map(|_| Ok(TcpStream::connect(api)?)).collect()
    })?;
    wait_for(Duration::from_secs(5), "4 streams open", || {
        let (_, status) = get_json(haltd, &format!("{}/admin/status", haltd.admin_url()))?;
        Ok((status["streams_active"] == 4).then_some(()))
    })?;
    let full = in_netns(&haltd.client_ns, || {
        raw_exchange_on(
            TcpStream::connect(api)?,
            b"GET /healthz HTTP/1.1\r\nhost: x\r\n\r\n",
            Duration::from_secs(5),
        )
    })?;
    ensure!(full.status == 503, "full table answered {}", full.status);
    let err = full.json()?;
    ensure!(
        err["error"]["message"]
            .as_str()
            .is_some_and(|m| m.contains("max-streams")),
        "503 body {err}"
    );
    Ok(holders)
}

// ---------------------------------------------------------------------------------------------
// 13. Shutdown halts open streams cleanly

/// The ledger after a shutdown that halted `streams` streams: intact, one SERVICE_SHUTDOWN
/// incident each, a stop record that counts them, and no mode change.
fn check_shutdown_records(haltd: &Haltd, streams: usize) -> Result<()> {
    let records = haltd.ledger_records()?;
    verify_ledger(&haltd.ledger)?;
    let last = records.last().context("empty ledger")?;
    ensure!(
        last["kind"] == "lifecycle"
            && last["message"]
                .as_str()
                .is_some_and(|m| m.contains("drain timed out")
                    && m.contains(&format!(
                        "{streams} open streams halted with SERVICE_SHUTDOWN, 0 still open"
                    ))),
        "last record {last}"
    );
    ensure!(
        records
            .iter()
            .filter(|r| r["kind"] == "incident" && r["trip_cause"] == "SERVICE_SHUTDOWN")
            .count()
            == streams,
        "incidents: {records:?}"
    );
    // A shutdown halt degrades nobody.
    ensure!(
        !records.iter().any(|r| !r["mode_change"].is_null()),
        "a mode change at shutdown: {records:?}"
    );
    Ok(())
}

/// SIGTERM with streams open that outlast the drain: each client gets the typed terminal event
/// (SERVICE_SHUTDOWN) within the budget instead of a cut connection, haltd exits 0, the ledger
/// ends with a lifecycle record saying how many streams it halted, and nobody is degraded.
/// The disk is slow (every ledger write takes 300 ms more): the three incident records take
/// longer than the 400 ms the emitters have to claim the halts, and haltd still waits for
/// them before it exits (a busy CI disk once cut these clients).
#[test]
fn sigterm_halts_open_streams() -> Result<()> {
    const STREAMS: usize = 3;
    let pair = NetPair::new()?;
    let mut haltd = Haltd::start(
        &pair,
        &[
            "--builtin-token-interval-us",
            "2000",
            "--drain-timeout-ms",
            "300",
            "--fault",
            "ledger-slow-write-ms=300",
        ],
    )?;
    let started = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let clients: Vec<_> = (0..STREAMS)
        .map(|i| {
            let url = chat_url(&haltd);
            let started = Arc::clone(&started);
            spawn_in_netns(&haltd.client_ns, move || {
                let mut counted = false;
                sse::stream(
                    &url,
                    &chat("shutdown", i as u64, 100_000, true),
                    Duration::from_secs(20),
                    |p, _| {
                        if p.tokens >= 5 && !counted {
                            counted = true;
                            started.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                        }
                    },
                )
            })
        })
        .collect();
    wait_for(
        Duration::from_secs(10),
        "every stream past 5 tokens",
        || Ok((started.load(std::sync::atomic::Ordering::SeqCst) == STREAMS).then_some(())),
    )?;
    let t = Instant::now();
    let status = haltd.stop()?;
    println!(
        "SIGTERM with {STREAMS} open streams: exit {status} after {} ms",
        t.elapsed().as_millis()
    );
    ensure!(status.success(), "haltd exited {status}");
    for c in clients {
        let o = c.join().map_err(|_| anyhow!("client thread panicked"))??;
        o.halted_cleanly("SERVICE_SHUTDOWN").with_context(|| {
            format!(
                "stream {} at shutdown; read error {:?}",
                o.stream_id, o.read_error
            )
        })?;
        let err = o.error.as_ref().context("error event")?;
        let idx = err["trip_token_index"]
            .as_u64()
            .context("trip_token_index")?;
        ensure!(
            (o.tokens as u64) <= idx + 5,
            "{} tokens after the trip point {idx}",
            o.tokens as u64 - idx
        );
    }
    check_shutdown_records(&haltd, STREAMS)
}
