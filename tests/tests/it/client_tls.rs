//! Root-only tests of TLS for clients (`--tls-cert`/`--tls-key`): haltd serving HTTPS with a
//! certificate made for the test, the kernel gate enforcing on ciphertext. Covered: a turn
//! over TLS completes, one record per frame and `close_notify` at the end; an operator trip
//! halts within the budget, and the terminal record passes the gate's terminal allowance by
//! its ciphertext prefix (`pass_terminal`); with an emitter that ignores the halt
//! (`--fault emitter-ignores-halt`) the kernel alone stops the stream at F + B frames and the
//! terminal; a broken handshake is counted and harms no other stream; SIGHUP reloads the
//! certificate, and a broken pair changes nothing.

use std::{sync::mpsc, time::Duration};

use anyhow::{ensure, Context, Result};
use haltd_tests::{
    spawn_in_netns,
    sse::chat_body,
    tls::TestPki,
    tls_client::{bad_handshake, client_config, tls_stream, TlsTurn},
    Haltd, NetPair,
};

const BUDGET: u32 = 3;

fn start(pair: &NetPair, pki: &TestPki, extra: &[&str]) -> Result<Haltd> {
    let cert = pki.cert.display().to_string();
    let key = pki.key.display().to_string();
    let mut args = vec![
        "--tls-cert",
        cert.as_str(),
        "--tls-key",
        key.as_str(),
        "--budget",
        "3",
    ];
    args.extend_from_slice(extra);
    Haltd::start(pair, &args)
}

/// A streamed turn of `max_tokens` over TLS, in the client namespace; with `trip_after`, the
/// stream id is sent on `tx` once that many tokens arrived.
fn spawn_turn(
    haltd: &Haltd,
    pki: &TestPki,
    max_tokens: u32,
    trip_after: Option<(usize, mpsc::Sender<String>)>,
) -> Result<std::thread::JoinHandle<Result<TlsTurn>>> {
    let cfg = client_config(&pki.ca)?;
    let addr = haltd.api;
    let key = haltd_tests::sse::fresh_key();
    Ok(spawn_in_netns(&haltd.client_ns, move || {
        let body = chat_body("Tell me about rivers", max_tokens, true);
        let mut sent = false;
        tls_stream(
            &cfg,
            addr,
            "/v1/chat/completions",
            &body,
            &[("authorization", &key)],
            Duration::from_secs(30),
            |p, _| {
                if let Some((n, tx)) = &trip_after {
                    if !sent && p.tokens >= *n {
                        sent = true;
                        let _ = tx.send(p.stream_id.to_owned());
                    }
                }
            },
        )
    }))
}

fn join(h: std::thread::JoinHandle<Result<TlsTurn>>) -> Result<TlsTurn> {
    h.join().unwrap_or_else(|p| std::panic::resume_unwind(p))
}

/// Trips the stream whose id arrives on `rx`; returns the trip's `trip_token_index`.
fn trip_from(haltd: &Haltd, rx: &mpsc::Receiver<String>) -> Result<u64> {
    let id = rx
        .recv_timeout(Duration::from_secs(20))
        .context("the stream never reached its trip point")?;
    let (status, trip) = haltd.trip(&id, None)?;
    ensure!(status == 200, "trip answered {status}: {trip}");
    trip["trip_token_index"]
        .as_u64()
        .with_context(|| format!("no trip_token_index in {trip}"))
}

#[test]
fn tls_turn_completes_and_an_operator_trip_halts_on_ciphertext() -> Result<()> {
    let pair = NetPair::new()?;
    let pki = TestPki::new("client", &["localhost"])?;
    let haltd = start(&pair, &pki, &["--builtin-token-interval-us", "20000"])?;

    let done = join(spawn_turn(&haltd, &pki, 5, None)?)?;
    let o = &done.outcome;
    ensure!(o.status == 200, "status {}", o.status);
    ensure!(
        o.tokens == 5 && o.finish_reason.as_deref() == Some("length") && o.done_at.is_some(),
        "not a normal end: {} tokens, {:?}",
        o.tokens,
        o.events
    );
    ensure!(done.close_notify, "no close_notify after a completed turn");
    // The head, each token, the final frame: one record each; then close_notify (an
    // application-data record to the eye under TLS 1.3).
    ensure!(
        done.records.app_after_handshake == 8,
        "{} records for 1 head + 5 tokens + 1 final + close_notify",
        done.records.app_after_handshake
    );

    // A broken handshake while a stream runs: that connection only.
    let (tx, rx) = mpsc::channel();
    let turn = spawn_turn(&haltd, &pki, 1000, Some((5, tx)))?;
    let api = haltd.api;
    spawn_in_netns(&haltd.client_ns, move || {
        bad_handshake(
            api,
            b"GET / HTTP/1.1\r\nhost: x\r\n\r\n",
            Duration::from_secs(5),
        )
    })
    .join()
    .unwrap_or_else(|p| std::panic::resume_unwind(p))?;
    let tau = trip_from(&haltd, &rx)?;
    let halted = join(turn)?;
    let o = &halted.outcome;
    println!(
        "TLS operator trip: tau {tau}, {} tokens, {} records after the handshake, tls error {:?}",
        o.tokens, halted.records.app_after_handshake, halted.tls_error
    );
    o.halted_cleanly("OPERATOR_TRIP")?;
    ensure!(
        o.tokens as u64 <= tau + u64::from(BUDGET),
        "{} tokens, trip at {tau}, B {BUDGET}",
        o.tokens
    );
    ensure!(
        halted.close_notify,
        "the terminal frame carries close_notify"
    );
    ensure!(
        halted.records.app_after_handshake <= 1 + tau + u64::from(BUDGET) + 2,
        "{} records: more than head + tau + B + terminal and close_notify",
        halted.records.app_after_handshake
    );
    let m = haltd.metrics()?;
    let terminal = m.value_or_zero("haltd_kernel_frames_total", &[("verdict", "pass_terminal")])?;
    ensure!(
        terminal >= 1.0,
        "the terminal record did not pass by the allowance: pass_terminal {terminal}"
    );
    let failures = m.value_or_zero("haltd_client_tls_handshake_failures_total", &[])?;
    ensure!(failures >= 1.0, "handshake failures {failures}");
    let shakes = m.value_or_zero("haltd_client_tls_handshakes_total", &[])?;
    ensure!(shakes >= 2.0, "handshakes {shakes}");
    Ok(())
}

#[test]
fn tls_kernel_alone_stops_an_emitter_that_ignores_the_halt() -> Result<()> {
    let pair = NetPair::new()?;
    let pki = TestPki::new("client", &["localhost"])?;
    let haltd = start(
        &pair,
        &pki,
        &[
            "--fault",
            "emitter-ignores-halt",
            "--builtin-token-interval-us",
            "5000",
        ],
    )?;
    let (tx, rx) = mpsc::channel();
    let turn = spawn_turn(&haltd, &pki, 1_000_000, Some((5, tx)))?;
    let tau = trip_from(&haltd, &rx)?;
    let t = join(turn)?;
    println!(
        "TLS, emitter ignores the halt: tau {tau}, {} tokens opened, {} records after the handshake, {} bytes, tls error {:?}",
        t.outcome.tokens, t.records.app_after_handshake, t.records.bytes, t.tls_error
    );
    // Frames the gate passes: F (the handshake flight, the head, tau tokens) + B, then the
    // terminal (its record and close_notify): counted as records on the wire, whatever the
    // client could open.
    ensure!(
        t.records.app_after_handshake <= 1 + tau + u64::from(BUDGET) + 2,
        "{} records: more than head + tau {tau} + B {BUDGET} + terminal and close_notify",
        t.records.app_after_handshake
    );
    ensure!(
        t.outcome.tokens as u64 <= tau + u64::from(BUDGET),
        "{} tokens opened",
        t.outcome.tokens
    );
    let m = haltd.metrics()?;
    let dropped = m.value_or_zero("haltd_kernel_frames_total", &[("verdict", "drop_budget")])?;
    ensure!(
        dropped > 0.0,
        "the emitter ignored the halt but the kernel dropped nothing"
    );
    Ok(())
}

/// Sends SIGHUP and waits for the `n`-th reload record; returns its message.
fn hangup(haltd: &mut Haltd, n: usize) -> Result<String> {
    let pid = libc::pid_t::try_from(haltd.pid().context("haltd is not running")?)?;
    // SAFETY: kill(2) on the haltd child this test started and has not reaped.
    let signalled = unsafe { libc::kill(pid, libc::SIGHUP) };
    ensure!(signalled == 0, "kill(SIGHUP)");
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    loop {
        let reloads: Vec<String> = haltd
            .ledger_records()?
            .iter()
            .filter_map(|r| r["message"].as_str())
            .filter(|m| m.contains("on SIGHUP"))
            .map(str::to_owned)
            .collect();
        if let Some(m) = reloads.get(n - 1) {
            return Ok(m.clone());
        }
        ensure!(std::time::Instant::now() < deadline, "no reload record");
        std::thread::sleep(Duration::from_millis(50));
    }
}

#[test]
fn sighup_reloads_the_certificate_and_a_broken_pair_changes_nothing() -> Result<()> {
    let pair = NetPair::new()?;
    let pki = TestPki::new("first", &["localhost"])?;
    let mut haltd = start(&pair, &pki, &["--builtin-token-interval-us", "1000"])?;
    let ok = |haltd: &Haltd, pki: &TestPki| -> Result<bool> {
        let t = join(spawn_turn(haltd, pki, 2, None)?);
        Ok(t.is_ok_and(|t| t.outcome.tokens == 2))
    };
    ensure!(ok(&haltd, &pki)?, "the first certificate does not serve");
    let second = TestPki::new("second", &["localhost"])?;
    std::fs::copy(&second.cert, &pki.cert)?;
    std::fs::copy(&second.key, &pki.key)?;
    let msg = hangup(&mut haltd, 1)?;
    ensure!(
        msg.starts_with("reloaded on SIGHUP") && msg.contains("TLS certificate"),
        "{msg}"
    );
    ensure!(
        ok(&haltd, &second)?,
        "the reloaded certificate does not serve"
    );
    ensure!(
        !ok(&haltd, &pki)?,
        "the old CA is still trusted for new connections"
    );
    std::fs::write(&pki.key, "not a key")?;
    let msg = hangup(&mut haltd, 2)?;
    ensure!(msg.starts_with("reload on SIGHUP failed"), "{msg}");
    ensure!(
        ok(&haltd, &second)?,
        "a broken pair changed the running certificate"
    );
    Ok(())
}
