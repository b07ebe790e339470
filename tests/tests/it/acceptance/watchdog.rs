//! The watchdog closes a stream whose emitter cannot send, and a slow disk does not stall it.

use std::{
    fs,
    io::{BufReader, Read},
    process::Command,
    thread,
    time::{Duration, Instant},
};

use anyhow::{anyhow, ensure, Context, Result};
use haltd_tests::{
    checked, in_netns, spawn_in_netns, sse, wait_for, EventKind, Haltd, NetPair, PORT_API,
};

use super::{
    chat, chat_url, read_head, send_request, sse_events, stop_and_verify, stream_in, wait_idle,
};

const TCP_ESTABLISHED: u8 = 1;

/// TCP states (hex `st` of /proc/net/tcp) of the connections between local port `local` and
/// remote port `remote`, in the calling thread's network namespace.
fn tcp_states_here(local: u16, remote: u16) -> Result<Vec<u8>> {
    let text = fs::read_to_string("/proc/thread-self/net/tcp")?;
    let port = |addr: &str| {
        addr.split(':')
            .nth(1)
            .and_then(|p| u16::from_str_radix(p, 16).ok())
    };
    Ok(text
        .lines()
        .skip(1)
        .filter_map(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            (f.len() > 3 && port(f[1]) == Some(local) && port(f[2]) == Some(remote))
                .then(|| u8::from_str_radix(f[3], 16).ok())
                .flatten()
        })
        .collect())
}

// ---------------------------------------------------------------------------------------------
// 4. The watchdog closes a stream whose emitter cannot send.

#[test]
fn watchdog_halts_a_blocked_emitter() -> Result<()> {
    const GRACE_MS: u64 = 50;
    const BUDGET: u64 = 5;
    const CONCURRENT_TOKENS: u32 = 400;
    const SLOW_WRITE_MS: u64 = 300;
    let pair = NetPair::new()?;
    small_socket_buffers(&pair)?;
    let haltd = Haltd::start(
        &pair,
        &[
            "--budget",
            &BUDGET.to_string(),
            "--halt-grace-ms",
            &GRACE_MS.to_string(),
            "--builtin-token-interval-us",
            "1000",
            // A disk slower than the heartbeat deadline (200 ms): the watchdog must not wait
            // for the incident's write on its own thread, or its heartbeat goes stale and the
            // concurrent stream halts with HEARTBEAT_LOST.
            "--fault",
            &format!("ledger-slow-write-ms={SLOW_WRITE_MS}"),
        ],
    )?;
    let url = chat_url(&haltd);
    // Reference for the concurrent stream (the built-in source is deterministic).
    let normal_body = chat("A steady stream", 3, CONCURRENT_TOKENS, true);
    let reference = stream_in(&haltd, &url, &normal_body, |_, _| {})?;
    ensure!(
        reference.tokens == CONCURRENT_TOKENS as usize,
        "reference: {} tokens",
        reference.tokens
    );

    // The silent client: sends its request, never reads.
    let api = haltd.api;
    let silent = in_netns(&pair.cli, move || {
        send_request(
            api,
            "/v1/chat/completions",
            &chat("Never read", 9, 1_000_000, true),
        )
    })?;
    let cli_port = silent.local_addr()?.port();
    let id = wait_blocked_emitter(&haltd)?;
    println!("blocked emitter {}: stuck after {} tokens", id.0, id.1);

    let (u, b) = (url.clone(), normal_body.clone());
    let concurrent = spawn_in_netns(&pair.cli, move || {
        sse::stream(&u, &b, Duration::from_secs(30), |_, _| {})
    });
    thread::sleep(Duration::from_millis(20));
    let tripped_at = Instant::now();
    let (status, trip) = haltd.trip(&id.0, None)?;
    ensure!(status == 200, "trip answered {status}: {trip}");
    let closed_after = time_to_close(&pair, cli_port, tripped_at)?;
    check_closed_in_time(&haltd, &id.0, closed_after, GRACE_MS)?;

    // Now the client reads: whatever was queued, then the end of the connection.
    check_drained(&pair, silent, &trip, BUDGET)?;

    let c = concurrent
        .join()
        .map_err(|_| anyhow!("concurrent client panicked"))??;
    check_intact(&c, &reference)?;
    check_recorded_as_watchdog(&haltd, &id.0)?;
    stop_and_verify(haltd)?;
    Ok(())
}

/// Small socket buffers on both ends: a client that does not read blocks the emitter fast.
fn small_socket_buffers(pair: &NetPair) -> Result<()> {
    for (ns, key) in [
        (&pair.cli, "net.ipv4.tcp_rmem"),
        (&pair.srv, "net.ipv4.tcp_wmem"),
    ] {
        checked(Command::new("ip").args([
            "netns",
            "exec",
            ns,
            "sysctl",
            "-q",
            "-w",
            &format!("{key}=4096 4096 4096"),
        ]))?;
    }
    Ok(())
}

/// Waits until the one open stream's emitter is stuck (its token count stops moving for
/// 150 ms); returns its id and that count.
fn wait_blocked_emitter(haltd: &Haltd) -> Result<(String, u64)> {
    let mut last = (u64::MAX, Instant::now());
    wait_for(
        Duration::from_secs(10),
        "the silent stream's emitter blocks",
        || {
            let list = haltd.list_streams()?;
            let Some(s) = list["streams"].as_array().and_then(|l| l.first()).cloned() else {
                return Ok(None);
            };
            let tokens = s["tokens"].as_u64().unwrap_or_default();
            if tokens != last.0 {
                last = (tokens, Instant::now());
                return Ok(None);
            }
            Ok((last.1.elapsed() > Duration::from_millis(150)).then(|| {
                (
                    s["stream_id"].as_str().unwrap_or_default().to_owned(),
                    tokens,
                )
            }))
        },
    )
}

/// How long after `tripped_at` haltd's end of the connection to the client port `cli_port`
/// stopped being ESTABLISHED, measured on the server's socket.
fn time_to_close(pair: &NetPair, cli_port: u16, tripped_at: Instant) -> Result<Duration> {
    in_netns(&pair.srv, move || -> Result<Duration> {
        loop {
            let states = tcp_states_here(PORT_API, cli_port)?;
            if !states.contains(&TCP_ESTABLISHED) {
                return Ok(tripped_at.elapsed());
            }
            ensure!(
                tripped_at.elapsed() < Duration::from_secs(5),
                "the connection is still ESTABLISHED 5 s after the trip"
            );
            thread::sleep(Duration::from_millis(2));
        }
    })
}

/// Reads what the silent client was sent: the head, then the body up to EOF, and how long
/// that took.
fn drain(pair: &NetPair, silent: std::net::TcpStream) -> Result<(Vec<u8>, Duration)> {
    in_netns(&pair.cli, move || -> Result<(Vec<u8>, Duration)> {
        let t = Instant::now();
        let s = silent;
        s.set_read_timeout(Some(Duration::from_secs(5)))?;
        let mut r = BufReader::new(s);
        read_head(&mut r)?;
        let mut body = Vec::new();
        r.read_to_end(&mut body).context("reading to EOF")?;
        Ok((body, t.elapsed()))
    })
}

/// The watchdog stopped the blocked stream once its client had taken nothing for the client
/// window since the trip (4 × the grace, at least 1 s: `watchdog/waits.rs`; a client that still
/// takes bytes keeps its send, so a slow reader gets its terminal) plus a scheduling margin, by
/// its own clock (`halt_latency_ms` of the incident: trip → halt claimed),
/// and shut the connection down one durable write of that incident later (the record is on
/// disk before the client can see the halt; docs/fhr-schema.md). The write is the disk's time,
/// not haltd's (a busy CI disk took 430 ms; this test's fault adds 300 ms to every record), so
/// it gets its own allowance.
fn check_closed_in_time(
    haltd: &Haltd,
    id: &str,
    closed_after: Duration,
    grace_ms: u64,
) -> Result<()> {
    const FSYNC_ALLOWANCE: Duration = Duration::from_secs(2);
    let incident = haltd.wait_record("incident of the blocked stream", |r| {
        r["kind"] == "incident" && r["stream_id"] == id
    })?;
    let halted_ms = incident["halt_latency_ms"]
        .as_f64()
        .with_context(|| format!("halt_latency_ms of {incident}"))?;
    let halted = Duration::from_secs_f64(halted_ms / 1e3);
    let window = (4 * Duration::from_millis(grace_ms)).max(Duration::from_secs(1));
    let bound = window + Duration::from_millis(250);
    println!(
        "blocked emitter: the watchdog halted it {halted_ms:.0} ms after the trip (bound \
         {bound:?}); the connection closed {:.0} ms after the trip",
        closed_after.as_secs_f64() * 1e3
    );
    ensure!(
        halted <= bound,
        "halted {halted:?} after the trip, bound {bound:?}\n{}",
        haltd.log_tail(30)
    );
    ensure!(
        closed_after <= bound + FSYNC_ALLOWANCE,
        "closed {closed_after:?} after the trip: more than {FSYNC_ALLOWANCE:?} after the halt \
         ({halted:?})\n{}",
        haltd.log_tail(30)
    );
    Ok(())
}

/// The concurrent stream was served whole, as the reference run.
fn check_intact(
    c: &haltd_tests::StreamOutcome,
    reference: &haltd_tests::StreamOutcome,
) -> Result<()> {
    ensure!(
        c.text == reference.text
            && c.tokens == reference.tokens
            && c.done_at.is_some()
            && c.error.is_none(),
        "the concurrent stream was not intact: {} tokens, finish {:?}, error {:?}",
        c.tokens,
        c.finish_reason,
        c.error
    );
    Ok(())
}

/// The watchdog halted the stream: its incident record says so and the metric counts it.
fn check_recorded_as_watchdog(haltd: &Haltd, id: &str) -> Result<()> {
    let incident = haltd.wait_record("incident of the blocked stream", |r| {
        r["kind"] == "incident" && r["stream_id"] == id
    })?;
    ensure!(incident["halted_by"] == "watchdog", "incident: {incident}");
    wait_idle(haltd)?;
    let halts = haltd
        .metrics()?
        .value("haltd_halts_total", &[("halted_by", "watchdog")])?;
    ensure!(
        halts >= 1.0,
        "haltd_halts_total{{halted_by=\"watchdog\"}} = {halts}"
    );
    Ok(())
}

/// The silent client, reading at last, gets at most `budget` tokens past the trip index, then
/// the end of the connection.
fn check_drained(
    pair: &NetPair,
    silent: std::net::TcpStream,
    trip: &serde_json::Value,
    budget: u64,
) -> Result<()> {
    let idx = trip["trip_token_index"]
        .as_u64()
        .context("trip_token_index")?;
    let received = drain(pair, silent)?;
    let events = sse_events(&received.0);
    let tokens = events
        .iter()
        .filter(|e| matches!(e, EventKind::Token(_)))
        .count() as u64;
    println!(
        "blocked emitter: client drained {tokens} tokens (trip index {idx}) and EOF in {:.0} ms; last events {:?}",
        received.1.as_secs_f64() * 1e3,
        events.iter().rev().take(2).collect::<Vec<_>>()
    );
    ensure!(
        tokens <= idx + budget,
        "{tokens} tokens reached the client, trip index {idx}, budget {budget}"
    );
    Ok(())
}
