//! haltd's stop (`daemon/src/lifecycle.rs`): SIGTERM drains (readiness 503, new turns 503 with
//! `retry-after`, open streams finish), and systemd's notify protocol (`READY=1`, `WATCHDOG=1`
//! only while the heartbeat is fresh, `STOPPING=1`) on a `NOTIFY_SOCKET` the test owns, since
//! systemd is not PID 1 on the test machines. `acceptance::lifecycle::sigterm_halts_open_streams`
//! covers the streams that outlast the drain (`SERVICE_SHUTDOWN`).

use std::{
    os::unix::net::UnixDatagram,
    sync::{
        atomic::{AtomicBool, Ordering::SeqCst},
        Arc,
    },
    time::{Duration, Instant},
};

use anyhow::{anyhow, ensure, Context, Result};
use haltd_tests::{
    in_netns, raw_exchange, require_root, spawn_in_netns, sse, temp_dir, verify_ledger, wait_for,
    Haltd, NetPair, RawResponse,
};

/// Sends `signal` to haltd.
fn signal(haltd: &Haltd, signal: libc::c_int) -> Result<()> {
    let pid = libc::pid_t::try_from(haltd.pid().context("haltd is not running")?)?;
    // SAFETY: kill(2) on the haltd child this test started and has not reaped.
    let signalled = unsafe { libc::kill(pid, signal) };
    ensure!(signalled == 0, "kill({pid}, {signal})");
    Ok(())
}

/// One raw request from the client namespace.
fn exchange(haltd: &Haltd, request: &'static [u8]) -> Result<RawResponse> {
    let addr = haltd.api;
    in_netns(&haltd.client_ns, move || {
        raw_exchange(addr, request, Duration::from_secs(10))
    })
}

const READYZ: &[u8] = b"GET /readyz HTTP/1.1\r\nhost: haltd\r\n\r\n";
const HEALTHZ: &[u8] = b"GET /healthz HTTP/1.1\r\nhost: haltd\r\n\r\n";
const CHAT: &[u8] = b"POST /v1/chat/completions HTTP/1.1\r\nhost: haltd\r\ncontent-type: application/json\r\ncontent-length: 77\r\n\r\n{\"model\":\"builtin\",\"messages\":[{\"role\":\"user\",\"content\":\"x\"}],\"max_tokens\":3}";

#[test]
fn sigterm_drains_open_streams_and_refuses_new_ones() -> Result<()> {
    require_root()?;
    let pair = NetPair::new()?;
    let mut haltd = Haltd::start(
        &pair,
        &[
            "--builtin-token-interval-us",
            "25000",
            "--drain-timeout-ms",
            "10000",
        ],
    )?;
    ensure!(
        exchange(&haltd, READYZ)?.status == 200,
        "not ready at start"
    );
    ensure!(
        exchange(&haltd, CHAT)?.status == 200,
        "a turn before the signal"
    );
    // One stream of 30 tokens (0.75 s) is open when SIGTERM comes.
    let url = format!("{}/v1/chat/completions", haltd.api_url());
    let going = Arc::new(AtomicBool::new(false));
    let flag = Arc::clone(&going);
    let client = spawn_in_netns(&haltd.client_ns, move || {
        sse::stream(
            &url,
            &sse::chat_body("drain", 30, true),
            Duration::from_secs(20),
            |p, _| {
                if p.tokens >= 5 {
                    flag.store(true, SeqCst);
                }
            },
        )
    });
    wait_for(Duration::from_secs(10), "the stream past 5 tokens", || {
        Ok(going.load(SeqCst).then_some(()))
    })?;
    let t = Instant::now();
    signal(&haltd, libc::SIGTERM)?;
    wait_for(Duration::from_secs(2), "readiness to fail", || {
        Ok((exchange(&haltd, READYZ)?.status == 503).then_some(()))
    })?;
    check_refused_while_draining(&haltd)?;
    let out = client.join().map_err(|_| anyhow!("client panicked"))??;
    ensure!(
        out.tokens == 30 && out.finish_reason.as_deref() == Some("length") && out.error.is_none(),
        "the open stream did not finish: {} tokens, {:?}, {:?}",
        out.tokens,
        out.finish_reason,
        out.error
    );
    let status = haltd.wait_exit(Duration::from_secs(10))?;
    println!(
        "drain: exit {status} {} ms after SIGTERM",
        t.elapsed().as_millis()
    );
    ensure!(status.success(), "haltd exited {status}");
    check_drain_records(&haltd)
}

/// While haltd drains: not ready (`draining`), still live, and a new turn gets 503
/// `shutting_down` with `retry-after: 1`.
fn check_refused_while_draining(haltd: &Haltd) -> Result<()> {
    let ready = exchange(haltd, READYZ)?;
    let body: serde_json::Value = serde_json::from_slice(&ready.body)?;
    ensure!(body["reasons"] == serde_json::json!(["draining"]), "{body}");
    ensure!(
        exchange(haltd, HEALTHZ)?.status == 200,
        "liveness fails while draining"
    );
    let refused = exchange(haltd, CHAT)?;
    let err: serde_json::Value = serde_json::from_slice(&refused.body)?;
    ensure!(
        refused.status == 503
            && refused.header("retry-after") == Some("1")
            && err["error"]["code"] == "shutting_down",
        "a new turn while draining: {} {:?} {err}",
        refused.status,
        refused.headers
    );
    Ok(())
}

/// The ledger after a complete drain: intact, no halt, a stop record that says so.
fn check_drain_records(haltd: &Haltd) -> Result<()> {
    verify_ledger(&haltd.ledger)?;
    let records = haltd.ledger_records()?;
    let last = records.last().context("empty ledger")?;
    ensure!(
        last["message"]
            .as_str()
            .is_some_and(|m| m.contains("drain complete")
                && m.contains("at the signal), 0 open streams halted")),
        "last record {last}"
    );
    ensure!(
        !records.iter().any(|r| r["kind"] == "incident"),
        "a drained stream was halted: {records:?}"
    );
    Ok(())
}

/// The notify messages haltd sent so far, each with when it arrived.
fn messages(sock: &UnixDatagram, until: Instant) -> Result<Vec<(Instant, String)>> {
    let mut out = Vec::new();
    let mut buf = [0u8; 512];
    while Instant::now() < until {
        sock.set_read_timeout(Some(
            until
                .saturating_duration_since(Instant::now())
                .max(Duration::from_millis(1)),
        ))?;
        match sock.recv(&mut buf) {
            Ok(n) => out.push((
                Instant::now(),
                String::from_utf8_lossy(&buf[..n]).trim_end().to_owned(),
            )),
            Err(e)
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                ) =>
            {
                break
            }
            Err(e) => return Err(e.into()),
        }
    }
    Ok(out)
}

#[test]
fn systemd_hears_ready_a_watchdog_that_stops_with_the_heartbeat_and_stopping() -> Result<()> {
    require_root()?;
    let dir = temp_dir("notify")?;
    let path = dir.join("notify.sock");
    let sock = UnixDatagram::bind(&path)?;
    let notify = format!("NOTIFY_SOCKET={}", path.display());
    let pair = NetPair::new()?;
    // WATCHDOG_USEC 100 ms: a ping every 50 ms while the heartbeat is fresh. The watchdog
    // thread stalls 1.5 s after start. As systemd does, WATCHDOG_PID names haltd: the shell's
    // pid, which exec keeps.
    let wrapper = [
        "env",
        notify.as_str(),
        "WATCHDOG_USEC=100000",
        "sh",
        "-c",
        "WATCHDOG_PID=$$ exec \"$0\" \"$@\"",
    ];
    let mut haltd = Haltd::start_wrapped(
        &pair,
        None,
        &wrapper,
        &["--fault", "watchdog-stall-after-ms=1500"],
    )?;
    let t0 = Instant::now();
    let early = messages(&sock, t0 + Duration::from_millis(500))?;
    ensure!(
        early.first().is_some_and(|(_, m)| m == "READY=1"),
        "the first message is not READY=1: {early:?}"
    );
    let pings = early.iter().filter(|(_, m)| m == "WATCHDOG=1").count();
    ensure!(
        pings >= 4,
        "{pings} watchdog pings in 0.5 s while the heartbeat is fresh"
    );
    // Past the stall, the heartbeat deadline and the idle period: no more pings.
    let _ = messages(&sock, Instant::now() + Duration::from_millis(3000))?;
    let late = messages(&sock, Instant::now() + Duration::from_millis(1000))?;
    ensure!(
        late.iter().all(|(_, m)| m != "WATCHDOG=1"),
        "watchdog pings with the heartbeat lost: {late:?}"
    );
    signal(&haltd, libc::SIGTERM)?;
    let status = haltd.wait_exit(Duration::from_secs(10))?;
    ensure!(status.success(), "haltd exited {status}");
    let stop = messages(&sock, Instant::now() + Duration::from_millis(200))?;
    ensure!(
        stop.iter().any(|(_, m)| m == "STOPPING=1"),
        "no STOPPING=1 at SIGTERM: {stop:?}"
    );
    drop(sock);
    let _ = std::fs::remove_dir_all(&dir);
    Ok(())
}

/// Issue 28: a connection whose stream ended while its client still had bytes to read keeps
/// its slot (it drains) while haltd drains too, and is reset, not left behind, when the drain
/// timeout runs out: after haltd exits nobody would keep the kernel's heartbeat fresh for
/// those bytes. The client never reads; at exit it sees a reset, and haltd exits 0 with
/// nothing left open.
#[test]
fn a_connection_still_draining_when_haltd_stops_is_reset() -> Result<()> {
    use std::io::{Read, Write};
    require_root()?;
    let pair = NetPair::new()?;
    let mut haltd = Haltd::start(
        &pair,
        &[
            "--builtin-token-interval-us",
            "500",
            "--drain-timeout-ms",
            "500",
            "--send-stall-timeout-ms",
            "60000",
        ],
    )?;
    let api = haltd.api;
    let mut body = sse::chat_body("a long answer nobody reads", 600, true);
    body["ignore_eos"] = serde_json::json!(true);
    let body = body.to_string();
    let req = format!(
        "POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\nconnection: close\r\ncontent-length: {}\r\n\r\n{body}",
        body.len()
    );
    let mut client = in_netns(&haltd.client_ns, move || -> Result<std::net::TcpStream> {
        let mut s = haltd_tests::slow_reader::connect_with_rcvbuf(None, api, 4096)?;
        s.write_all(req.as_bytes())?;
        Ok(s)
    })?;
    wait_for(
        Duration::from_secs(10),
        "the turn to end and its connection to drain",
        || {
            let m = haltd.metrics()?;
            Ok((m.value("haltd_connections_draining", &[])? == 1.0).then_some(()))
        },
    )?;
    let t = Instant::now();
    signal(&haltd, libc::SIGTERM)?;
    let status = haltd.wait_exit(Duration::from_secs(15))?;
    println!(
        "a draining connection at SIGTERM: haltd exited {status} {} ms later",
        t.elapsed().as_millis()
    );
    ensure!(status.success(), "haltd exited {status}");
    client.set_read_timeout(Some(Duration::from_secs(5)))?;
    let mut buf = vec![0u8; 1 << 16];
    let mut got = 0usize;
    let end = loop {
        match client.read(&mut buf) {
            Ok(0) => break "EOF",
            Ok(n) => got += n,
            Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => break "reset",
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => break "hang",
            Err(_) => break "error",
        }
    };
    println!("the client read {got} bytes, then a {end}");
    ensure!(
        end == "reset",
        "the draining client's connection ended with {end}"
    );
    let records = haltd.ledger_records()?;
    let stop = records
        .iter()
        .rev()
        .find(|r| {
            r["kind"] == "lifecycle"
                && r["message"]
                    .as_str()
                    .is_some_and(|m| m.contains("stopping on signal"))
        })
        .context("no stop record")?;
    ensure!(
        stop["message"]
            .as_str()
            .is_some_and(|m| m.contains("0 still open at exit")),
        "{stop}"
    );
    Ok(())
}
