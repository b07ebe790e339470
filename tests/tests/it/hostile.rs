//! Hostile clients: the request deadline is absolute (from accept to the end of the body),
//! one address can hold only `--max-conns-per-addr` connections, and connections still
//! sending their request hold at most `--request-phase-share` of the stream table.

use std::{
    io::{Read, Write},
    net::{Ipv4Addr, SocketAddr, TcpStream},
    thread,
    time::{Duration, Instant},
};

use anyhow::{ensure, Context, Result};
use haltd_tests::{connect_from, in_netns, spawn_in_netns, sse, Haltd, NetPair};

/// What a trickling client got: the status of the answer (None: none came), and when.
#[derive(Debug)]
struct Trickled {
    status: Option<u16>,
    after: Duration,
    bytes_sent: usize,
}

/// Sends a request one byte every `gap` on `s` until haltd answers or closes, or `limit`.
fn trickle(mut s: TcpStream, gap: Duration, limit: Duration) -> Trickled {
    let req = b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: 100000\r\n\r\n";
    let start = Instant::now();
    let _ = s.set_read_timeout(Some(gap));
    let mut buf = [0u8; 512];
    let mut sent = 0;
    while start.elapsed() < limit {
        let byte = req.get(sent).copied().unwrap_or(b'x');
        if s.write_all(&[byte]).is_err() {
            break;
        }
        sent += 1;
        match s.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => {
                let head = String::from_utf8_lossy(&buf[..n]);
                let status = head.split_whitespace().nth(1).and_then(|c| c.parse().ok());
                return Trickled {
                    status,
                    after: start.elapsed(),
                    bytes_sent: sent,
                };
            }
            Err(_) => {} // the gap passed with nothing to read: send the next byte
        }
    }
    Trickled {
        status: None,
        after: start.elapsed(),
        bytes_sent: sent,
    }
}

#[test]
fn a_trickling_client_gets_408_at_its_deadline_while_a_stream_goes_on() -> Result<()> {
    let pair = NetPair::new()?;
    let haltd = Haltd::start(
        &pair,
        &[
            "--max-streams",
            "4",
            "--request-timeout-ms",
            "1000",
            "--builtin-token-interval-us",
            "20000",
        ],
    )?;
    let url = format!("{}/v1/chat/completions", haltd.api_url());
    // A well-behaved client streams for about 3 s, through the whole attack.
    let streamer = spawn_in_netns(&pair.cli, move || {
        sse::stream(
            &url,
            &sse::chat_body("hostile clients", 150, true),
            Duration::from_secs(30),
            |_, _| {},
        )
    });
    thread::sleep(Duration::from_millis(300));
    let api = haltd.api;
    let tricklers: Vec<_> = (0..2)
        .map(|_| {
            spawn_in_netns(&pair.cli, move || -> Result<Trickled> {
                let s = TcpStream::connect(api)?;
                Ok(trickle(
                    s,
                    Duration::from_millis(700),
                    Duration::from_secs(8),
                ))
            })
        })
        .collect();
    for t in tricklers {
        let t = t.join().expect("trickler thread")?;
        // With a deadline restarted by every read, a byte every 0.7 s never times out.
        ensure!(t.status == Some(408), "a trickling client got {t:?}");
        ensure!(
            t.after >= Duration::from_millis(900) && t.after < Duration::from_millis(3500),
            "408 should come at the 1 s deadline from accept, came after {:?} ({} bytes sent)",
            t.after,
            t.bytes_sent
        );
    }
    let outcome = streamer.join().expect("streamer thread")?;
    ensure!(
        outcome.status == 200 && outcome.finish_reason.is_some() && outcome.tokens >= 100,
        "the well-behaved stream was disturbed: status {} tokens {} finish {:?} error {:?}",
        outcome.status,
        outcome.tokens,
        outcome.finish_reason,
        outcome.error
    );
    let m = haltd.metrics()?;
    ensure!(
        m.value("haltd_requests_rejected_total", &[("status", "408")])? >= 2.0,
        "the 408s are counted"
    );
    Ok(())
}

/// Opens `n` connections from `src`, one after the other, and sends one byte of a request on
/// each; the statuses of those haltd refused at once, and the ones it admitted (kept open by
/// the caller, so the descriptors in use stay few whatever `n` is).
fn flood(src: Ipv4Addr, api: SocketAddr, n: usize) -> Result<(Vec<u16>, Vec<TcpStream>)> {
    let mut refused = Vec::new();
    let mut kept = Vec::new();
    for _ in 0..n {
        let mut s = connect_from(src, api)?;
        // A refused connection may be closed before this byte lands.
        let _ = s.write_all(b"P");
        // A refusal is written at accept; an admitted connection waits for more bytes.
        s.set_read_timeout(Some(Duration::from_millis(100)))?;
        let mut buf = [0u8; 64];
        match s.read(&mut buf) {
            Ok(n) => refused.push(status_of(&buf[..n])),
            Err(e) if is_timeout(&e) => kept.push(s),
            Err(_) => refused.push(0),
        }
    }
    Ok((refused, kept))
}

fn status_of(head: &[u8]) -> u16 {
    String::from_utf8_lossy(head)
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or(0)
}

fn is_timeout(e: &std::io::Error) -> bool {
    matches!(
        e.kind(),
        std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
    )
}

#[test]
fn two_thousand_trickling_connections_from_one_address_leave_another_streaming() -> Result<()> {
    let pair = NetPair::new()?;
    let attacker = pair.add_client_addr(10)?;
    let honest = pair.add_client_addr(20)?;
    let haltd = Haltd::start(
        &pair,
        &[
            "--max-streams",
            "512",
            "--max-conns-per-addr",
            "100",
            "--request-timeout-ms",
            "20000",
            "--builtin-token-interval-us",
            "2000",
        ],
    )?;
    let api = haltd.api;
    let (refused, kept) = in_netns(&pair.cli, move || flood(attacker, api, 2000))?;
    ensure!(
        kept.len() == 100 && refused.len() == 1900 && refused.iter().all(|&s| s == 429),
        "one address holds --max-conns-per-addr connections: {} open, {} refused ({} with 429)",
        kept.len(),
        refused.len(),
        refused.iter().filter(|&&s| s == 429).count()
    );
    // A second address streams while the first one's connections are all still open.
    let body = sse::chat_body("another address", 50, true).to_string();
    let answer = in_netns(&pair.cli, move || -> Result<String> {
        let mut s = connect_from(honest, api)?;
        let req = format!(
            "POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\nauthorization: Bearer honest\r\ncontent-length: {}\r\n\r\n{body}",
            body.len()
        );
        s.write_all(req.as_bytes())?;
        s.set_read_timeout(Some(Duration::from_secs(20)))?;
        let mut out = Vec::new();
        s.read_to_end(&mut out).context("reading the stream")?;
        Ok(String::from_utf8_lossy(&out).into_owned())
    })?;
    ensure!(
        answer.starts_with("HTTP/1.1 200") && answer.contains("data: [DONE]"),
        "the second address did not get a whole stream: {}",
        &answer[..answer.len().min(300)]
    );
    let m = haltd.metrics()?;
    ensure!(
        m.value("haltd_requests_rejected_total", &[("status", "429")])? >= 1900.0,
        "the 429s are counted"
    );
    drop(kept);
    Ok(())
}

#[test]
fn request_phase_connections_hold_at_most_their_share_of_the_table() -> Result<()> {
    let pair = NetPair::new()?;
    let haltd = Haltd::start(
        &pair,
        &[
            "--max-streams",
            "20",
            "--request-phase-share",
            "50",
            "--request-timeout-ms",
            "20000",
        ],
    )?;
    let api = haltd.api;
    // Thirty connections from thirty addresses (no per-address cap applies): ten get in.
    let addrs: Vec<Ipv4Addr> = (0..30u8)
        .map(|i| pair.add_client_addr(100 + i))
        .collect::<Result<_>>()?;
    let (refused, kept) = in_netns(&pair.cli, move || -> Result<(Vec<u16>, Vec<TcpStream>)> {
        let mut kept = Vec::new();
        let mut refused = Vec::new();
        for a in addrs {
            let (r, k) = flood(a, api, 1)?;
            refused.extend(r);
            kept.extend(k);
        }
        Ok((refused, kept))
    })?;
    ensure!(
        kept.len() == 10 && refused.len() == 20 && refused.iter().all(|&s| s == 503),
        "10 of 20 slots may be in the request phase: {} open, refused: {refused:?}",
        kept.len()
    );
    let m = haltd.metrics()?;
    ensure!(
        m.value("haltd_requests_rejected_total", &[("status", "503")])? >= 20.0,
        "the 503s are counted"
    );
    drop(kept);
    Ok(())
}

/// A request's `authorization` (none when empty) and extra headers, owned so that they can move
/// into a client thread in the client namespace.
struct Headers(Vec<(String, String)>);

impl Headers {
    fn new(auth: &str, extra: &[(&str, &str)]) -> Self {
        let mut h = Vec::new();
        if !auth.is_empty() {
            h.push(("authorization".to_owned(), auth.to_owned()));
        }
        h.extend(
            extra
                .iter()
                .map(|(k, v)| ((*k).to_owned(), (*v).to_owned())),
        );
        Headers(h)
    }

    fn borrowed(&self) -> Vec<(&str, &str)> {
        self.0
            .iter()
            .map(|(k, v)| (k.as_str(), v.as_str()))
            .collect()
    }
}

/// Streams one short built-in turn with `auth` (and `extra` headers); its `x-haltd-mode`.
fn mode_of(haltd: &Haltd, ns: &str, auth: &str, extra: &[(&str, &str)]) -> Result<Option<String>> {
    let o = answer_of(haltd, ns, "", auth, extra)?;
    ensure!(o.status == 200, "status {} {:?}", o.status, o.body);
    Ok(o.mode_header)
}

/// One short built-in streaming turn at `/v1/chat/completions{query}` with `auth` (none when
/// empty) and `extra` headers, however it is answered.
fn answer_of(
    haltd: &Haltd,
    ns: &str,
    query: &str,
    auth: &str,
    extra: &[(&str, &str)],
) -> Result<sse::StreamOutcome> {
    let url = format!("{}/v1/chat/completions{query}", haltd.api_url());
    let headers = Headers::new(auth, extra);
    in_netns(ns, move || {
        let h = headers.borrowed();
        sse::stream_with(
            &url,
            &sse::chat_body("who am i", 4, true),
            &h,
            Duration::from_secs(20),
            |_, _| {},
        )
    })
}

/// Trips a stream of `auth` (operator trip: the key enters degraded mode); the halt record's
/// conversation fingerprint.
fn trip_key(haltd: &Haltd, ns: &str, auth: &str, extra: &[(&str, &str)]) -> Result<String> {
    let id = haltd.trip_stream_from(ns, &Headers::new(auth, extra).borrowed())?;
    let rec = haltd.wait_record("the halt", |r| {
        r["kind"] == "incident" && r["stream_id"] == id.as_str()
    })?;
    rec["conversation"]
        .as_str()
        .map(str::to_owned)
        .with_context(|| format!("no conversation in {rec}"))
}

/// Without `--identity-header` or a key store the scope is the client's address group
/// (issue 36): spellings of the key, and any other key from the same address, stay degraded;
/// the scope's fingerprint is keyed with the node secret and survives a restart.
#[test]
fn spellings_of_one_key_share_its_degraded_mode_and_its_fingerprint_survives_restart() -> Result<()>
{
    let pair = NetPair::new()?;
    let state = haltd_tests::temp_dir("identity-state")?;
    let state_arg = state.display().to_string();
    let args = [
        "--builtin-token-interval-us",
        "20000",
        "--state-dir",
        &state_arg,
        haltd_tests::daemon::ADDR_SCOPED,
    ];
    let mut haltd = Haltd::start(&pair, &args)?;
    let fp = trip_key(&haltd, &pair.cli, "Bearer sk-victim", &[])?;
    for variant in ["bearer sk-victim", "Bearer  sk-victim", "BEARER sk-victim"] {
        let mode = mode_of(&haltd, &pair.cli, variant, &[])?;
        ensure!(
            mode.as_deref() == Some("degraded"),
            "{variant:?} dodged degraded mode: {mode:?}"
        );
    }
    ensure!(
        mode_of(&haltd, &pair.cli, "Bearer sk-other", &[])?.as_deref() == Some("degraded"),
        "another key from the same address escaped degraded mode"
    );
    let rec = haltd.wait_record("the halt's scope", |r| {
        r["kind"] == "incident" && r["conversation"] == fp.as_str()
    })?;
    let scope = rec["scope"].as_str().unwrap_or_default().to_owned();
    let scope_fp = scope.strip_prefix("addr:").unwrap_or_default().to_owned();
    ensure!(scope_fp.len() == 16 && scope_fp != fp, "{rec}");
    ensure!(
        fp.len() == 16 && !fp.contains("victim"),
        "fingerprint {fp:?}"
    );
    // Keyed with the node secret: a plain SHA-256 of the key would be checkable offline.
    let plain = hex::encode(<sha2::Sha256 as sha2::Digest>::digest(b"Bearer sk-victim"));
    ensure!(
        !plain.starts_with(&fp),
        "the fingerprint is an unkeyed hash"
    );
    haltd.stop()?;
    // The same node (same state directory, same ledger): the same key has the same
    // fingerprint, so the degraded scope the state store kept under it still catches it.
    let again = Haltd::start_with_ledger(&pair, Some(&haltd.ledger), &args)?;
    let url = format!("{}/admin/mode", again.admin_url());
    let mode = haltd_tests::in_netns(&pair.cli, move || haltd_tests::get_json_here(&url))?;
    ensure!(
        mode["keys"]
            .as_array()
            .is_some_and(|l| l.iter().any(|k| k["scope"] == scope.as_str())),
        "scope {scope} not degraded after the restart: {mode}"
    );
    let variant = mode_of(&again, &pair.cli, "bearer  sk-victim", &[])?;
    ensure!(
        variant.as_deref() == Some("degraded"),
        "fingerprint changed across a restart: {variant:?}"
    );
    drop(again);
    drop(haltd);
    Ok(())
}

/// Issue 29 point 5: one credential rule (docs/operations.md "Who a request is"). An
/// `--identity-header` value is compared exactly, in its own namespace; a bearer token's scheme
/// folds and the token does not; `x-api-key` is the bearer token; every other spelling of a
/// credential is refused with 400, and a query parameter is no credential.
#[test]
fn one_credential_rule_decides_who_a_request_is() -> Result<()> {
    let pair = NetPair::new()?;
    let haltd = Haltd::start(
        &pair,
        &[
            "--builtin-token-interval-us",
            "20000",
            "--identity-header",
            "x-user",
        ],
    )?;
    let ns = pair.cli.as_str();
    let full = |auth: &str, extra: &[(&str, &str)]| -> Result<()> {
        let mode = mode_of(&haltd, ns, auth, extra)?;
        ensure!(mode.is_none(), "{auth:?} {extra:?} is degraded");
        Ok(())
    };
    let degraded = |auth: &str, extra: &[(&str, &str)]| -> Result<()> {
        let mode = mode_of(&haltd, ns, auth, extra)?;
        ensure!(
            mode.as_deref() == Some("degraded"),
            "{auth:?} {extra:?} dodged degraded mode"
        );
        Ok(())
    };
    let refused = |auth: &str, extra: &[(&str, &str)], says: &str| -> Result<()> {
        let o = answer_of(&haltd, ns, "", auth, extra)?;
        let body = o.body.clone().unwrap_or_default();
        ensure!(
            o.status == 400 && body.contains(says),
            "{auth:?} {extra:?}: {} {body}",
            o.status
        );
        Ok(())
    };

    // The identity header: exact, its own namespace.
    trip_key(&haltd, ns, "", &[("x-user", "TenantAb9")])?;
    degraded("", &[("x-user", "TenantAb9")])?;
    // HTTP's optional whitespace around a value is not part of it (RFC 9110 §5.5).
    degraded("", &[("x-user", "  TenantAb9 ")])?;
    full("", &[("x-user", "tenantab9")])?;
    full("", &[("x-user", "TENANTAB9")])?;
    full("", &[("x-user", "Tenant Ab9")])?;
    full("Bearer TenantAb9", &[])?;
    refused("tenantab9", &[], "needs a scheme and a token")?;

    // The bearer token (no identity header sent) names the conversation: the turn records'
    // fingerprint. (Degraded mode is kept per scope, the address group here: issue 36.)
    let conversation = |auth: &str, extra: &[(&str, &str)]| -> Result<String> {
        let o = answer_of(&haltd, ns, "", auth, extra)?;
        ensure!(o.status == 200, "{auth:?} {extra:?}: {}", o.status);
        let id = o.stream_id.clone();
        let rec = haltd.wait_record("the turn", |r| {
            r["kind"] == "turn" && r["stream_id"] == id.as_str()
        })?;
        Ok(rec["conversation"].as_str().unwrap_or_default().to_owned())
    };
    let k7 = conversation("Bearer K-7", &[])?;
    for (auth, extra) in [
        ("bearer K-7", &[][..]),
        ("", &[("x-api-key", "K-7")][..]),
        ("BEARER K-7", &[("x-api-key", "K-7")][..]),
    ] {
        ensure!(
            conversation(auth, extra)? == k7,
            "{auth:?} {extra:?} is another conversation"
        );
    }
    for (auth, extra) in [("Bearer k-7", &[][..]), ("", &[("x-api-key", "k-7")][..])] {
        ensure!(
            conversation(auth, extra)? != k7,
            "{auth:?} {extra:?} is K-7's conversation"
        );
    }
    refused("K-7", &[], "needs a scheme and a token")?;
    refused("Basic K-7", &[], "Basic\\\" is not accepted")?;
    refused("Bearer \"K-7\"", &[], "not one RFC 6750 token")?;
    refused("Bearer K-7", &[("x-api-key", "K-8")], "different tokens")?;
    // A query parameter is no credential: the request is the anonymous identity's.
    let o = answer_of(&haltd, ns, "?api_key=K-7", "", &[])?;
    ensure!(
        o.status == 200 && o.mode_header.is_none(),
        "{} {:?}",
        o.status,
        o.mode_header
    );
    Ok(())
}

#[test]
fn an_identity_header_names_the_conversation() -> Result<()> {
    let pair = NetPair::new()?;
    let haltd = Haltd::start(
        &pair,
        &[
            "--builtin-token-interval-us",
            "20000",
            "--identity-header",
            "x-gateway-user",
        ],
    )?;
    trip_key(
        &haltd,
        &pair.cli,
        "Bearer gateway-key",
        &[("x-gateway-user", "alice")],
    )?;
    // The gateway's one key, another user: full mode; the same user, another key: degraded.
    let bob = mode_of(
        &haltd,
        &pair.cli,
        "Bearer gateway-key",
        &[("x-gateway-user", "bob")],
    )?;
    ensure!(bob.is_none(), "bob is degraded by alice's halt: {bob:?}");
    let alice = mode_of(
        &haltd,
        &pair.cli,
        "Bearer other-key",
        &[("x-gateway-user", "alice")],
    )?;
    ensure!(
        alice.as_deref() == Some("degraded"),
        "alice is not degraded: {alice:?}"
    );
    Ok(())
}

/// Opens a streaming request from `src` that runs long (`ignore_eos`) through a 4 KiB receive
/// buffer and never reads it: a slot holder, as an attacker would open one.
fn hog(src: Ipv4Addr, api: SocketAddr) -> Result<TcpStream> {
    let mut s = haltd_tests::slow_reader::connect_with_rcvbuf(Some(src), api, 4096)?;
    let mut body = sse::chat_body("hold a slot", 5_000, true);
    body["ignore_eos"] = serde_json::json!(true);
    let body = body.to_string();
    let req = format!(
        "POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\nauthorization: Bearer hog-{src}\r\ncontent-length: {}\r\n\r\n{body}",
        body.len()
    );
    s.write_all(req.as_bytes())?;
    Ok(s)
}

/// The status and `retry-after` of a short batch request from `src`.
fn knock(src: Ipv4Addr, api: SocketAddr) -> Result<(u16, Option<String>)> {
    let body = sse::chat_body("let me in", 3, false).to_string();
    let mut s = connect_from(src, api)?;
    let req = format!(
        "POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\nauthorization: Bearer knocker\r\nconnection: close\r\ncontent-length: {}\r\n\r\n{body}",
        body.len()
    );
    s.write_all(req.as_bytes())?;
    s.set_read_timeout(Some(Duration::from_secs(10)))?;
    let mut out = Vec::new();
    let _ = s.read_to_end(&mut out);
    let head = String::from_utf8_lossy(&out);
    let retry = head.lines().find_map(|l| {
        let (k, v) = l.split_once(':')?;
        k.eq_ignore_ascii_case("retry-after")
            .then(|| v.trim().to_owned())
    });
    Ok((status_of(&out), retry))
}

/// Knocks from `src` every second until a 200, or until `limit` after `since`; each knock's
/// time (from `since`), status and `retry-after`.
fn knock_until_let_in(
    src: Ipv4Addr,
    api: SocketAddr,
    since: Instant,
    limit: Duration,
) -> Result<Vec<(Duration, u16, Option<String>)>> {
    let mut tries = Vec::new();
    loop {
        let (status, retry) = knock(src, api)?;
        tries.push((since.elapsed(), status, retry));
        if status == 200 || since.elapsed() > limit {
            return Ok(tries);
        }
        thread::sleep(Duration::from_secs(1));
    }
}

/// How many of `held` end in a reset (after whatever bytes they had).
fn resets(held: Vec<TcpStream>) -> usize {
    held.into_iter()
        .filter(|s| {
            let mut s = s;
            let _ = s.set_read_timeout(Some(Duration::from_secs(5)));
            let mut buf = vec![0u8; 1 << 16];
            loop {
                match s.read(&mut buf) {
                    Ok(0) => return false,
                    Ok(_) => {}
                    Err(e) => return e.kind() == std::io::ErrorKind::ConnectionReset,
                }
            }
        })
        .count()
}

/// What haltd made of `n` stalled clients: counted, halted with `CLIENT_STALLED` (an incident
/// and a `client_stalled` turn record each), nobody degraded.
fn check_stalls_recorded(haltd: &Haltd, n: f64) -> Result<()> {
    let m = haltd.metrics()?;
    let stalls = m.value("haltd_client_stalls_total", &[("phase", "stream")])?;
    ensure!(
        stalls == n,
        "haltd_client_stalls_total{{phase=\"stream\"}} = {stalls}"
    );
    let trips = m.value(
        "haltd_watchdog_trips_total",
        &[("cause", "CLIENT_STALLED"), ("initiator", "client")],
    )?;
    ensure!(trips == n, "CLIENT_STALLED trips counted: {trips}");
    let outcome = m.value("haltd_streams_total", &[("outcome", "client_stalled")])?;
    ensure!(outcome == n, "outcome client_stalled: {outcome}");
    let records = haltd.ledger_records()?;
    let incidents = records
        .iter()
        .filter(|r| {
            r["kind"] == "incident"
                && r["failure_codes"]
                    .as_array()
                    .is_some_and(|c| c.iter().any(|c| c == "CLIENT_STALLED"))
        })
        .count() as f64;
    ensure!(
        incidents == n,
        "{incidents} CLIENT_STALLED incidents recorded"
    );
    let turns = records
        .iter()
        .filter(|r| r["kind"] == "turn" && r["outcome"] == "client_stalled")
        .count() as f64;
    ensure!(
        turns == n,
        "{turns} turn records with outcome client_stalled"
    );
    // Nobody is degraded: a stall is no breach.
    ensure!(
        records.iter().all(|r| r["mode_change"].is_null()),
        "a stall changed a runtime mode"
    );
    Ok(())
}

/// Issue 28's attack: 6 addresses open `--max-conns-per-addr` streams each, filling
/// `--max-streams`, and never read them. Each is cut once it took none of its queued bytes for
/// `--send-stall-timeout-ms`: halted with `CLIENT_STALLED` (recorded, counted, no degraded
/// mode), reset, its slot freed. A client of a 7th address that retries every second (after
/// the 503 with `retry-after` that the full table answers) gets a 200 within the stall
/// timeout + 2 s.
#[test]
fn clients_that_stop_reading_are_cut_and_free_their_slots() -> Result<()> {
    const STALL_MS: u64 = 3_000;
    let pair = NetPair::new()?;
    let hogs: Vec<Ipv4Addr> = (0..6)
        .map(|i| pair.add_client_addr(10 + i))
        .collect::<Result<_>>()?;
    let knocker = pair.add_client_addr(30)?;
    let stall = STALL_MS.to_string();
    let haltd = Haltd::start(
        &pair,
        &[
            "--max-streams",
            "24",
            "--max-conns-per-addr",
            "4",
            "--send-stall-timeout-ms",
            &stall,
            "--builtin-token-interval-us",
            "1000",
        ],
    )?;
    let api = haltd.api;
    let (held, full_at) = in_netns(&pair.cli, move || -> Result<(Vec<TcpStream>, Instant)> {
        let mut held = Vec::new();
        for &src in &hogs {
            for _ in 0..4 {
                held.push(hog(src, api)?);
            }
        }
        Ok((held, Instant::now()))
    })?;
    // Every slot holds a hog: the table is full.
    let deadline = Instant::now() + Duration::from_secs(5);
    while haltd.list_streams()?["streams"]
        .as_array()
        .map_or(0, Vec::len)
        < 24
    {
        ensure!(
            Instant::now() < deadline,
            "the hogs never held all 24 slots"
        );
        thread::sleep(Duration::from_millis(20));
    }
    let limit = Duration::from_millis(STALL_MS) * 4;
    let tries = in_netns(&pair.cli, move || {
        knock_until_let_in(knocker, api, full_at, limit)
    })?;
    for (at, status, retry) in &tries {
        println!(
            "  knock at {:.1} s: {status} (retry-after {retry:?})",
            at.as_secs_f64()
        );
    }
    let (first, status, retry) = tries.first().cloned().context("no knock")?;
    ensure!(
        status == 503 && retry.as_deref() == Some("1"),
        "the full table answered {status} (retry-after {retry:?}) at {first:?}"
    );
    let (got, status, _) = tries.last().cloned().context("no knock")?;
    let bound = Duration::from_millis(STALL_MS) + Duration::from_secs(2);
    ensure!(
        status == 200 && got <= bound,
        "the 7th address got {status} after {got:?} (bound {bound:?}); haltd's log:\n{}",
        haltd.log_tail(120)
    );
    println!(
        "a 7th address got 200 after {:.1} s (send-stall timeout {:.1} s + 2 s = {:.1} s)",
        got.as_secs_f64(),
        STALL_MS as f64 / 1e3,
        bound.as_secs_f64()
    );
    // Every hog was cut: reset (after the bytes it had), its stream halted, recorded, counted.
    let reset = in_netns(&pair.cli, move || resets(held));
    ensure!(reset == 24, "{reset} of 24 hogs saw a reset");
    check_stalls_recorded(&haltd, 24.0)
}
