//! Persistent client connections (issue 12 point 4), end to end on a running haltd with its
//! kernel gate: the official OpenAI SDK keeps one connection over many turns and gets a new
//! one after a trip; raw clients check the idle timeout, the turn cap, pipelining, that a
//! tripped connection is closed, that an idle kept connection holds no request-phase place,
//! that the kernel bound holds for a turn on a reused connection, and that proxied turns keep
//! their connection too. The SDK's turns, pipelining and the close after a trip run over
//! client TLS too (`*_over_tls`: `--tls-cert`, the same assertions on what the client opens).

use std::{
    net::SocketAddr,
    time::{Duration, Instant},
};

use anyhow::{ensure, Context, Result};
use haltd_tests::{
    in_netns, openai_sdk_keepalive,
    rig::Rig,
    sse::{classify, fresh_key, EventKind, SseParser},
    trip_here, Haltd, KeptConn, NetPair, RawResponse, Transport,
};
use serde_json::{json, Value};

const TIMEOUT: Duration = Duration::from_secs(10);

/// A streamed chat request for the built-in model that asks to keep the connection
/// (`keep_alive`) or not, generating exactly `max_tokens` tokens.
fn chat_request(addr: SocketAddr, max_tokens: u32, keep_alive: bool) -> Vec<u8> {
    let body = json!({"model": "builtin", "stream": true, "max_tokens": max_tokens,
        "ignore_eos": true, "messages": [{"role": "user", "content": "Tell me about rivers"}]})
    .to_string();
    let connection = if keep_alive { "keep-alive" } else { "close" };
    format!(
        "POST /v1/chat/completions HTTP/1.1\r\nhost: {addr}\r\n{}\r\n\
         content-type: application/json\r\ncontent-length: {}\r\nconnection: {connection}\r\n\r\n{body}",
        haltd_tests::sse::auth_lines(&fresh_key()),
        body.len()
    )
    .into_bytes()
}

/// The SSE events of a response body.
fn events(body: &[u8]) -> Vec<EventKind> {
    let mut p = SseParser::default();
    p.feed(body)
        .into_iter()
        .map(|(_, data)| classify(&data))
        .collect()
}

fn tokens(evs: &[EventKind]) -> usize {
    evs.iter()
        .filter(|e| matches!(e, EventKind::Token(_)))
        .count()
}

/// A kept turn: 200, chunked, `connection: keep-alive`, all its tokens and `[DONE]`.
fn ensure_kept_turn(r: &RawResponse, max_tokens: usize) -> Result<String> {
    let evs = events(&r.body);
    ensure!(
        r.status == 200
            && r.header("connection") == Some("keep-alive")
            && r.header("transfer-encoding") == Some("chunked")
            && tokens(&evs) == max_tokens
            && matches!(evs.last(), Some(EventKind::Done)),
        "not a complete kept turn: {} {:?} {:?}",
        r.status,
        r.headers,
        String::from_utf8_lossy(&r.body)
    );
    r.header("x-haltd-stream-id")
        .map(str::to_owned)
        .context("no stream id")
}

/// The official SDK, one client, 50 streamed turns: turns 1..=30 share one connection, the
/// admin trip of turn 30 closes it, turns 31..=50 share a new one.
#[test]
fn the_official_sdk_reuses_one_connection_and_recovers_after_a_trip() -> Result<()> {
    sdk_keeps_one_connection(Transport::Plain)
}

/// The same over client TLS: the SDK (httpx, trusting the test CA) keeps one TLS session for
/// turns 1..=30; the trip's terminal record and `close_notify` end it.
#[test]
fn the_official_sdk_reuses_one_connection_and_recovers_after_a_trip_over_tls() -> Result<()> {
    sdk_keeps_one_connection(Transport::Tls)
}

fn sdk_keeps_one_connection(transport: Transport) -> Result<()> {
    let pair = NetPair::new()?;
    let haltd = Haltd::start_over(&pair, transport, &["--builtin-token-interval-us", "1000"])?;
    let base = format!("{}/v1", haltd.api_base());
    let admin = haltd.admin_url();
    let token = haltd.admin_token_file().display().to_string();
    let mut args = vec![
        "--base-url",
        &base,
        "--turns",
        "50",
        "--trip-turn",
        "30",
        "--trip-after",
        "3",
        "--admin-url",
        &admin,
        "--admin-token-file",
        &token,
    ];
    let ca = haltd.api_ca_file().map(|p| p.display().to_string());
    if let Some(ca) = &ca {
        args.extend(["--ca-file", ca.as_str()]);
    }
    let started = Instant::now();
    let out = openai_sdk_keepalive(&haltd.client_ns, &args)?;
    let took = started.elapsed();
    let turns = out["turns"].as_array().context("turns")?;
    ensure!(turns.len() == 50, "{out}");
    let port = |t: &Value| t["local_port"].as_u64();
    let first = port(&turns[0]).context("no local port")?;
    let second = port(&turns[30]).context("no local port")?;
    println!(
        "SDK keep-alive ({}): turns 1-30 on client port {first}, turns 31-50 on client port {second}, 50 turns in {:.2} s",
        transport.name(),
        took.as_secs_f64()
    );
    for (i, t) in turns.iter().enumerate() {
        let n = i + 1;
        let want_port = if n <= 30 { first } else { second };
        ensure!(
            port(t) == Some(want_port),
            "turn {n} used another connection: {t}"
        );
        if n == 30 {
            ensure!(
                t["trip_status"] == 200
                    && t["error"]["class"] == "APIError"
                    && t["error"]["body"]["code"] == "OPERATOR_TRIP",
                "turn 30 was not halted by the trip: {t}"
            );
        } else {
            ensure!(
                t["error"].is_null() && !t["finish_reason"].is_null(),
                "turn {n} failed: {t}"
            );
        }
    }
    ensure!(first != second, "the tripped connection was reused: {out}");
    let mut ids: Vec<&str> = turns
        .iter()
        .filter_map(|t| t["stream_id"].as_str())
        .collect();
    ids.sort_unstable();
    ids.dedup();
    ensure!(ids.len() == 50, "every turn has its own stream id: {out}");
    let m = haltd.metrics()?;
    // Requests on a kept connection: 29 after the first, then 19 after the 31st.
    ensure!(
        m.value("haltd_keepalive_turns_total", &[])? == 48.0,
        "haltd_keepalive_turns_total = {}",
        m.value("haltd_keepalive_turns_total", &[])?
    );
    if transport == Transport::Tls {
        // Two connections, two handshakes: no turn paid one of its own.
        let shakes = m.value_or_zero("haltd_client_tls_handshakes_total", &[])?;
        ensure!(
            shakes == 2.0,
            "{shakes} TLS handshakes for 50 turns on 2 connections"
        );
    }
    Ok(())
}

/// `--max-turns-per-conn`: the last turn says `connection: close` and the connection closes;
/// `--client-idle-timeout-ms`: a kept connection without a next request is closed, one whose
/// next request comes in time is served; a request that says `connection: close` is answered
/// alone, unchunked, and its connection closed.
#[test]
fn the_turn_cap_and_the_idle_timeout_close_kept_connections() -> Result<()> {
    let pair = NetPair::new()?;
    let haltd = Haltd::start(
        &pair,
        &[
            "--builtin-token-interval-us",
            "500",
            "--client-idle-timeout-ms",
            "400",
            "--max-turns-per-conn",
            "3",
        ],
    )?;
    let api = haltd.api;
    in_netns(&haltd.client_ns, move || -> Result<()> {
        let mut c = KeptConn::connect(api, TIMEOUT)?;
        let mut ids = Vec::new();
        for _ in 0..2 {
            c.send(&chat_request(api, 5, true))?;
            ids.push(ensure_kept_turn(&c.response()?, 5)?);
        }
        c.send(&chat_request(api, 5, true))?;
        let last = c.response()?;
        ensure!(
            last.status == 200 && last.header("connection") == Some("close"),
            "the third turn of a 3-turn cap: {:?}",
            last.headers
        );
        ids.push(
            last.header("x-haltd-stream-id")
                .unwrap_or_default()
                .to_owned(),
        );
        ensure!(
            c.closed_within(Duration::from_secs(2))?,
            "still open after the cap"
        );
        ids.dedup();
        ensure!(ids.len() == 3, "one stream id per turn: {ids:?}");

        // Idle: the next request 100 ms later is served, none for 400 ms closes it.
        let mut c = KeptConn::connect(api, TIMEOUT)?;
        c.send(&chat_request(api, 3, true))?;
        ensure_kept_turn(&c.response()?, 3)?;
        std::thread::sleep(Duration::from_millis(100));
        c.send(&chat_request(api, 3, true))?;
        ensure_kept_turn(&c.response()?, 3)?;
        let idle_from = Instant::now();
        ensure!(
            c.closed_within(Duration::from_secs(3))?,
            "an idle kept connection stayed open"
        );
        let idle = idle_from.elapsed();
        ensure!(
            idle >= Duration::from_millis(350),
            "closed after {idle:?}, before the 400 ms idle timeout"
        );
        println!("idle kept connection closed after {idle:?} (timeout 400 ms)");

        // `connection: close`: one request, one unchunked response, then the close.
        let one = haltd_tests::raw_exchange(api, &chat_request(api, 3, false), TIMEOUT)?;
        ensure!(
            one.status == 200
                && one.header("connection") == Some("close")
                && one.header("transfer-encoding").is_none()
                && tokens(&events(&one.body)) == 3,
            "a request that says close: {:?}",
            one.headers
        );
        Ok(())
    })?;
    let m = haltd.metrics()?;
    let closes = |reason: &str| m.value("haltd_keepalive_closes_total", &[("reason", reason)]);
    ensure!(
        closes("max_turns")? == 1.0,
        "max_turns closes: {}",
        closes("max_turns")?
    );
    ensure!(
        closes("idle_timeout")? >= 1.0,
        "idle closes: {}",
        closes("idle_timeout")?
    );
    ensure!(m.value("haltd_keepalive_turns_total", &[])? == 3.0);
    Ok(())
}

/// HTTP/1.1's default: a request with no `connection` header at all (as curl and most
/// gateways send) keeps its connection; `connection: close` is answered as the only request.
#[test]
fn a_request_without_a_connection_header_keeps_its_connection() -> Result<()> {
    let pair = NetPair::new()?;
    let haltd = Haltd::start(&pair, &["--builtin-token-interval-us", "500"])?;
    let api = haltd.api;
    in_netns(&haltd.client_ns, move || -> Result<()> {
        let bare = |max_tokens: u32| -> Vec<u8> {
            let with = String::from_utf8(chat_request(api, max_tokens, true)).expect("ascii");
            with.replace("connection: keep-alive\r\n", "").into_bytes()
        };
        let mut c = KeptConn::connect(api, TIMEOUT)?;
        let mut ids = Vec::new();
        for _ in 0..3 {
            c.send(&bare(4))?;
            ids.push(ensure_kept_turn(&c.response()?, 4)?);
        }
        ids.dedup();
        ensure!(
            ids.len() == 3,
            "one stream per turn on one connection: {ids:?}"
        );
        c.send(&chat_request(api, 4, false))?;
        let last = c.response()?;
        ensure!(
            last.status == 200 && last.header("connection") == Some("close"),
            "a request that says close: {:?}",
            last.headers
        );
        ensure!(
            c.closed_within(Duration::from_secs(2))?,
            "still open after connection: close"
        );
        Ok(())
    })
}

/// Pipelined requests are answered in order on a kept connection; a request that says
/// `connection: close` and has bytes after its body is refused (400).
#[test]
fn pipelined_requests_are_answered_in_order() -> Result<()> {
    pipelined(Transport::Plain)
}

/// The same over client TLS: the three requests arrive in one record.
#[test]
fn pipelined_requests_are_answered_in_order_over_tls() -> Result<()> {
    pipelined(Transport::Tls)
}

fn pipelined(transport: Transport) -> Result<()> {
    let pair = NetPair::new()?;
    let haltd = Haltd::start_over(&pair, transport, &["--builtin-token-interval-us", "500"])?;
    let (api, client) = (haltd.api, haltd.client());
    in_netns(&haltd.client_ns, move || -> Result<()> {
        let mut c = client.kept(TIMEOUT)?;
        let mut three = chat_request(api, 4, true);
        three.extend_from_slice(&chat_request(api, 6, true));
        three.extend_from_slice(&chat_request(api, 2, true));
        c.send(&three)?;
        let ids = [
            ensure_kept_turn(&c.response()?, 4)?,
            ensure_kept_turn(&c.response()?, 6)?,
            ensure_kept_turn(&c.response()?, 2)?,
        ];
        ensure!(ids[0] != ids[1] && ids[1] != ids[2], "{ids:?}");
        // The connection is still kept after the pipelined ones.
        c.send(&chat_request(api, 1, true))?;
        ensure_kept_turn(&c.response()?, 1)?;

        let mut two = chat_request(api, 2, false);
        two.extend_from_slice(&chat_request(api, 2, false));
        let mut once = client.kept(TIMEOUT)?;
        once.send(&two)?;
        let r = once.response()?;
        ensure!(
            r.status == 400 && r.header("connection") == Some("close"),
            "pipelining without keep-alive: {} {:?}",
            r.status,
            String::from_utf8_lossy(&r.body)
        );
        Ok(())
    })
}

/// A kept connection whose turn is tripped gets the terminal event, the end of the chunked
/// body, and is closed.
#[test]
fn a_tripped_kept_connection_is_closed() -> Result<()> {
    tripped_kept_closed(Transport::Plain, 1)
}

/// Over client TLS, after 40 kept turns on one session (each whole, in order): the 41st is
/// tripped, its terminal record opens, and `close_notify` closes the connection.
#[test]
fn a_tripped_kept_connection_is_closed_over_tls() -> Result<()> {
    tripped_kept_closed(Transport::Tls, 40)
}

fn tripped_kept_closed(transport: Transport, kept_turns: usize) -> Result<()> {
    let pair = NetPair::new()?;
    let haltd = Haltd::start_over(&pair, transport, &["--builtin-token-interval-us", "2000"])?;
    let (api, admin, client) = (haltd.api, haltd.admin_url(), haltd.client());
    let took = in_netns(&haltd.client_ns, move || -> Result<Duration> {
        let mut c = client.kept(TIMEOUT)?;
        let started = Instant::now();
        let mut ids = Vec::with_capacity(kept_turns);
        for _ in 0..kept_turns {
            c.send(&chat_request(api, 3, true))?;
            ids.push(ensure_kept_turn(&c.response()?, 3)?);
        }
        let took = started.elapsed();
        ids.sort_unstable();
        ids.dedup();
        ensure!(ids.len() == kept_turns, "a stream id came twice: {ids:?}");
        c.send(&chat_request(api, 100_000, true))?;
        let (status, headers) = c.head()?;
        let id = header(&headers, "x-haltd-stream-id")?;
        ensure!(status == 200 && header(&headers, "connection")? == "keep-alive");
        let (code, trip) = trip_here(&format!("{admin}/admin/streams/{id}/trip"), None)?;
        ensure!(code == 200, "trip: {code} {trip}");
        // The terminal chunk ends the chunked body: the response is whole.
        let evs = events(&c.body(&headers)?);
        let halted = evs.iter().any(|e| {
            matches!(e, EventKind::Error(err) if err["code"] == "OPERATOR_TRIP" && err["type"] == "halted")
        });
        ensure!(
            halted && matches!(evs.last(), Some(EventKind::Done)),
            "no terminal event: {evs:?}"
        );
        ensure!(
            c.closed_within(Duration::from_secs(2))?,
            "the tripped connection stayed open"
        );
        Ok(took)
    })?;
    println!(
        "{kept_turns} kept turns ({}) of 3 tokens on one connection in {:.1} ms, then a trip closed it",
        transport.name(),
        took.as_secs_f64() * 1e3
    );
    let m = haltd.metrics()?;
    let kept = m.value("haltd_keepalive_turns_total", &[])?;
    ensure!(
        kept == kept_turns as f64,
        "haltd_keepalive_turns_total = {kept}, {kept_turns} turns after the first"
    );
    if transport == Transport::Tls {
        let shakes = m.value_or_zero("haltd_client_tls_handshakes_total", &[])?;
        ensure!(
            shakes == 1.0,
            "{shakes} TLS handshakes on one kept connection"
        );
    }
    Ok(())
}

fn header(headers: &[(String, String)], name: &str) -> Result<String> {
    headers
        .iter()
        .find(|(k, _)| k == name)
        .map(|(_, v)| v.clone())
        .with_context(|| format!("no {name} header in {headers:?}"))
}

/// An idle kept connection holds no place in the request phase: with room for one request in
/// flight (`--max-streams 4 --request-phase-share 25`), a new connection is served while a
/// kept one is idle, and the kept one's next request is served after it.
#[test]
fn an_idle_kept_connection_holds_no_request_phase_place() -> Result<()> {
    let pair = NetPair::new()?;
    let haltd = Haltd::start(
        &pair,
        &[
            "--builtin-token-interval-us",
            "500",
            "--max-streams",
            "4",
            "--request-phase-share",
            "25",
        ],
    )?;
    let api = haltd.api;
    in_netns(&haltd.client_ns, move || -> Result<()> {
        let mut kept = KeptConn::connect(api, TIMEOUT)?;
        kept.send(&chat_request(api, 2, true))?;
        ensure_kept_turn(&kept.response()?, 2)?;
        for i in 0..3 {
            let r = haltd_tests::raw_exchange(api, &chat_request(api, 2, false), TIMEOUT)?;
            ensure!(
                r.status == 200,
                "new connection {i} beside an idle kept one: {}",
                r.status
            );
        }
        kept.send(&chat_request(api, 2, true))?;
        ensure_kept_turn(&kept.response()?, 2)?;
        // A kept connection that began its next request holds the one place: a second
        // connection still sending its request is refused, as at accept.
        kept.send(b"POST /v1/chat/completions HTTP/1.1\r\n")?;
        std::thread::sleep(Duration::from_millis(100));
        let r = haltd_tests::raw_exchange(api, &chat_request(api, 2, false), TIMEOUT)?;
        ensure!(
            r.status == 503,
            "the request phase is full, yet: {}",
            r.status
        );
        Ok(())
    })
}

/// The kernel bound holds for a turn on a reused connection: with an emitter that ignores the
/// halt, the second turn of a kept connection is tripped after 20 tokens and at most B more
/// token events reach the client, while every token before the trip does (the socket's frame
/// and byte counts carried over from the first turn are exact, neither looser nor stricter).
#[test]
fn a_reused_connection_is_bounded_by_the_kernel_after_a_trip() -> Result<()> {
    const BUDGET: usize = 3;
    let pair = NetPair::new()?;
    let haltd = Haltd::start(
        &pair,
        &[
            "--budget",
            &BUDGET.to_string(),
            "--fault",
            "emitter-ignores-halt",
            "--builtin-token-interval-us",
            "1000",
        ],
    )?;
    let (api, admin) = (haltd.api, haltd.admin_url());
    let (tau, got) = in_netns(&haltd.client_ns, move || -> Result<(usize, usize)> {
        let mut c = KeptConn::connect(api, TIMEOUT)?;
        c.send(&chat_request(api, 40, true))?;
        ensure_kept_turn(&c.response()?, 40)?;
        c.send(&chat_request(api, 100_000, true))?;
        let (status, headers) = c.head()?;
        ensure!(status == 200, "{status}");
        let id = header(&headers, "x-haltd-stream-id")?;
        // Read chunk by chunk until 20 tokens arrived, then trip.
        let mut raw = Vec::new();
        let mut buf = [0u8; 4096];
        while tokens(&events(&haltd_tests::dechunk_lenient(&raw))) < 20 {
            let n = std::io::Read::read(&mut c, &mut buf)?;
            ensure!(n > 0, "closed before 20 tokens");
            raw.extend_from_slice(&buf[..n]);
        }
        let (code, trip) = trip_here(&format!("{admin}/admin/streams/{id}/trip"), None)?;
        ensure!(code == 200, "trip: {code} {trip}");
        let tau = trip["trip_token_index"]
            .as_u64()
            .context("trip_token_index")? as usize;
        raw.extend_from_slice(&c.rest(Duration::from_secs(3))?);
        let got = tokens(&events(&haltd_tests::dechunk_lenient(&raw)));
        Ok((tau, got))
    })?;
    println!(
        "reused connection, emitter ignoring the halt: trip at token {tau}, {got} tokens received (B = {BUDGET})"
    );
    ensure!(
        got >= tau,
        "tokens before the trip were lost: {got} < τ = {tau}"
    );
    ensure!(
        got <= tau + BUDGET,
        "{} tokens after the trip on a reused connection (B = {BUDGET})",
        got - tau
    );
    let m = haltd.metrics()?;
    let dropped = m.value_or_zero("haltd_kernel_frames_total", &[("verdict", "drop_budget")])?;
    ensure!(
        dropped > 0.0,
        "the emitter ignored the halt but the kernel dropped nothing"
    );
    Ok(())
}

/// A scripted-upstream chat request through haltd's proxy that asks to keep the connection.
fn proxied_request(addr: SocketAddr, script: &str) -> Vec<u8> {
    let body = json!({"model": "scripted", "stream": true,
        "messages": [{"role": "user", "content": script}]})
    .to_string();
    format!(
        "POST /v1/chat/completions HTTP/1.1\r\nhost: {addr}\r\n{}\r\n\
         content-type: application/json\r\ncontent-length: {}\r\nconnection: keep-alive\r\n\r\n{body}",
        haltd_tests::sse::auth_lines(&fresh_key()),
        body.len()
    )
    .into_bytes()
}

/// Proxied turns (`--source openai`) keep their client connection too: three turns of the
/// scripted upstream on one connection, then a fourth tripped mid-stream closes it.
#[test]
fn proxied_turns_keep_their_client_connection_until_a_trip() -> Result<()> {
    let rig = Rig::start(crate::UPSTREAM_BIN, &[])?;
    let (api, admin) = (rig.haltd.api, rig.haltd.admin_url());
    in_netns(&rig.haltd.client_ns, move || -> Result<()> {
        let mut c = KeptConn::connect(api, TIMEOUT)?;
        let mut ids = Vec::new();
        for n in [3, 5, 4] {
            c.send(&proxied_request(
                api,
                &format!("[[script:normal tokens={n}]]"),
            ))?;
            ids.push(ensure_kept_turn(&c.response()?, n)?);
        }
        ids.dedup();
        ensure!(ids.len() == 3, "one stream id per turn: {ids:?}");
        c.send(&proxied_request(
            api,
            "[[script:normal tokens=500 pace_ms=5]]",
        ))?;
        let (status, headers) = c.head()?;
        let id = header(&headers, "x-haltd-stream-id")?;
        ensure!(status == 200, "{status}");
        let (code, trip) = trip_here(&format!("{admin}/admin/streams/{id}/trip"), None)?;
        ensure!(code == 200, "trip: {code} {trip}");
        let evs = events(&c.body(&headers)?);
        ensure!(
            evs.iter()
                .any(|e| matches!(e, EventKind::Error(err) if err["code"] == "OPERATOR_TRIP")),
            "no terminal event: {evs:?}"
        );
        ensure!(
            c.closed_within(Duration::from_secs(2))?,
            "the tripped connection stayed open"
        );
        Ok(())
    })?;
    let m = rig.haltd.metrics()?;
    ensure!(m.value("haltd_keepalive_turns_total", &[])? == 3.0);
    Ok(())
}

/// The TLS client configuration that trusts `haltd`'s test certificate.
fn tls_config(haltd: &Haltd) -> Result<std::sync::Arc<rustls::ClientConfig>> {
    match haltd.client() {
        haltd_tests::ApiClient::Tls { cfg, .. } => Ok(cfg),
        haltd_tests::ApiClient::Plain { .. } => anyhow::bail!("haltd was not started over TLS"),
    }
}

/// Issue 28 point 5: every close haltd makes of a TLS connection says `close_notify` first:
/// the idle close of a kept connection, the close after the `--max-turns-per-conn`-th turn,
/// and the SIGTERM drain, which closes an idle kept connection at once instead of at its idle
/// timeout.
#[test]
fn every_close_haltd_makes_over_tls_says_close_notify() -> Result<()> {
    use haltd_tests::Ending;
    let pair = NetPair::new()?;
    let haltd = Haltd::start_over(
        &pair,
        Transport::Tls,
        &[
            "--builtin-token-interval-us",
            "500",
            "--client-idle-timeout-ms",
            "400",
            "--max-turns-per-conn",
            "2",
        ],
    )?;
    let (api, cfg) = (haltd.api, tls_config(&haltd)?);
    in_netns(&haltd.client_ns, move || -> Result<()> {
        // Idle close.
        let mut c = KeptConn::connect_tls(api, &cfg, TIMEOUT)?;
        c.send(&chat_request(api, 5, true))?;
        ensure_kept_turn(&c.response()?, 5)?;
        let idle = c.ending(Duration::from_secs(3))?;
        ensure!(idle == Ending::CloseNotify, "the idle close ended {idle:?}");
        // The turn cap: the second turn says close, and the close says close_notify.
        let mut c = KeptConn::connect_tls(api, &cfg, TIMEOUT)?;
        c.send(&chat_request(api, 5, true))?;
        ensure_kept_turn(&c.response()?, 5)?;
        c.send(&chat_request(api, 5, true))?;
        let last = c.response()?;
        ensure!(
            last.status == 200 && last.header("connection") == Some("close"),
            "the capped turn: {} {:?}",
            last.status,
            last.headers
        );
        let capped = c.ending(Duration::from_secs(3))?;
        ensure!(
            capped == Ending::CloseNotify,
            "the turn cap's close ended {capped:?}"
        );
        Ok(())
    })?;
    drop(haltd);

    // The drain: an idle kept connection closes at the signal, long before its idle timeout.
    let mut haltd = Haltd::start_over(
        &pair,
        Transport::Tls,
        &[
            "--builtin-token-interval-us",
            "500",
            "--client-idle-timeout-ms",
            "60000",
        ],
    )?;
    let (api, cfg) = (haltd.api, tls_config(&haltd)?);
    let pid = libc::pid_t::try_from(haltd.pid().context("haltd is not running")?)?;
    let (ending, after) = in_netns(&haltd.client_ns, move || -> Result<(Ending, Duration)> {
        let mut c = KeptConn::connect_tls(api, &cfg, TIMEOUT)?;
        c.send(&chat_request(api, 5, true))?;
        ensure_kept_turn(&c.response()?, 5)?;
        let t = Instant::now();
        // SAFETY: kill(2) on the haltd child this test started and has not reaped.
        ensure!(unsafe { libc::kill(pid, libc::SIGTERM) } == 0, "kill");
        let ending = c.ending(Duration::from_secs(10))?;
        Ok((ending, t.elapsed()))
    })?;
    println!("an idle kept TLS connection ended {ending:?} {after:?} after SIGTERM");
    ensure!(
        ending == Ending::CloseNotify,
        "the drain's close ended {ending:?}"
    );
    ensure!(
        after < Duration::from_secs(2),
        "the drain closed the idle connection only after {after:?}"
    );
    let status = haltd.wait_exit(Duration::from_secs(10))?;
    ensure!(status.success(), "haltd exited with {status}");
    Ok(())
}
