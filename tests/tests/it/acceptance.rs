//! Root-only acceptance tests for the points the scenario tests (`namespaces`) leave open:
//! refusing to start without the gate, `--no-kernel-gate` stated everywhere, the HaltMonitor on
//! real streams, the watchdog closing a blocked emitter, client disconnects, admin trip races,
//! the completions endpoint, ledger tampering, curl as a client, the whole daemon stopped, and
//! a crash (SIGKILL) keeping the ledger, slow clients (408), a full stream table (503) and a
//! shutdown that halts open streams cleanly.
//!
//! Each test runs haltd in its own [`NetPair`] and measures at the client namespace. They run
//! serially (`cargo xtask test` passes `--test-threads=1`): they share kernel state.

use std::{
    fs,
    io::{BufRead, BufReader, ErrorKind, Read, Write},
    net::{SocketAddr, TcpStream},
    path::Path,
    process::{Command, Stdio},
    sync::{Arc, Barrier},
    thread,
    time::{Duration, Instant},
};

use anyhow::{anyhow, bail, ensure, Context, Result};
use haltd_tests::{
    agent, checked, haltctl_bin, haltd_bin, in_netns, raw_exchange_on, spawn_in_netns,
    sse::{self, classify, SseParser},
    temp_dir, trip_here, verify_ledger, wait_for, EventKind, Haltd, NetPair, StreamOutcome,
    PORT_ADMIN, PORT_API, PORT_METRICS,
};
use serde_json::{json, Value};

// ---------------------------------------------------------------------------------------------
// Helpers

/// A chat request that generates exactly `max_tokens` tokens (vLLM's `ignore_eos`).
fn chat(prompt: &str, seed: u64, max_tokens: u32, stream: bool) -> Value {
    json!({
        "model": "builtin",
        "stream": stream,
        "max_tokens": max_tokens,
        "seed": seed,
        "ignore_eos": true,
        "messages": [{ "role": "user", "content": prompt }],
    })
}

fn chat_url(haltd: &Haltd) -> String {
    format!("{}/v1/chat/completions", haltd.api_url())
}

fn trip_url(haltd: &Haltd, id: &str) -> String {
    format!("{}/admin/streams/{id}/trip", haltd.admin_url())
}

/// Streams `body` to `url` from the instance's client namespace.
fn stream_in(
    haltd: &Haltd,
    url: &str,
    body: &Value,
    on_event: impl FnMut(&sse::Progress<'_>, &sse::SseEvent) + Send,
) -> Result<StreamOutcome> {
    let (url, body) = (url.to_owned(), body.clone());
    in_netns(&haltd.client_ns, move || {
        sse::stream(&url, &body, Duration::from_secs(60), on_event)
    })
}

/// Streams and trips the stream (operator trip) right after its `k`-th token; returns the
/// outcome and the admin API's answer.
fn stream_tripped_at(
    haltd: &Haltd,
    url: &str,
    body: &Value,
    k: usize,
) -> Result<(StreamOutcome, Option<(u16, Value)>)> {
    let admin = haltd.admin_url();
    let mut trip = None;
    let o = stream_in(haltd, url, body, |p, ev| {
        if trip.is_none() && matches!(ev.kind, EventKind::Token(_)) && p.tokens == k {
            let url = format!("{admin}/admin/streams/{}/trip", p.stream_id);
            trip = Some(
                trip_here(&url, None).unwrap_or_else(|e| (0, Value::String(format!("{e:#}")))),
            );
        }
    })?;
    Ok((o, trip))
}

/// Checks a stream tripped by the operator: 200 from the admin API, a clean halted end, and at
/// most `budget` tokens after the trip point, all measured by the client.
fn check_operator_trip(
    o: &StreamOutcome,
    trip: Option<&(u16, Value)>,
    budget: u64,
    log: &dyn Fn() -> String,
) -> Result<u64> {
    let (status, answer) = trip.with_context(|| {
        format!(
            "never tripped: the stream ended after {} tokens ({:?})",
            o.tokens, o.finish_reason
        )
    })?;
    ensure!(*status == 200, "trip answered {status}: {answer}");
    let idx = answer["trip_token_index"]
        .as_u64()
        .with_context(|| format!("trip answer without trip_token_index: {answer}"))?;
    let post = (o.tokens as u64)
        .checked_sub(idx)
        .with_context(|| format!("client got {} tokens < trip index {idx}", o.tokens))?;
    ensure!(
        post <= budget,
        "{post} tokens after the trip point (budget {budget}); received {}, trip index {idx}\n{}",
        o.tokens,
        log()
    );
    o.halted_cleanly("OPERATOR_TRIP")
        .with_context(|| format!("read error {:?}\n{}", o.read_error, log()))?;
    let err = o.error.as_ref().context("no error event")?;
    ensure!(
        err["trip_token_index"].as_u64() == Some(idx)
            && err["post_trip_tokens"].as_u64() == Some(post),
        "error event {err} disagrees with the client: trip index {idx}, {post} post-trip tokens"
    );
    Ok(post)
}

/// GET a JSON document from the client namespace: (status, body).
fn get_json(haltd: &Haltd, url: &str) -> Result<(u16, Value)> {
    let url = url.to_owned();
    in_netns(&haltd.client_ns, move || -> Result<(u16, Value)> {
        let mut r = agent(Duration::from_secs(10))
            .get(&url)
            .call()
            .with_context(|| format!("GET {url}"))?;
        let status = r.status().as_u16();
        let v = r.body_mut().read_json().context("body is not JSON")?;
        Ok((status, v))
    })
}

/// Waits until `haltd_streams_active` is 0 (and no stream is listed).
fn wait_idle(haltd: &Haltd) -> Result<()> {
    wait_for(Duration::from_secs(5), "streams_active back to 0", || {
        let active = haltd.metrics()?.sum("haltd_streams_active");
        let listed = haltd.list_streams()?["streams"]
            .as_array()
            .map_or(0, Vec::len);
        Ok((active == 0.0 && listed == 0).then_some(()))
    })
}

/// Every ledger line says `"kernel_gate":"<want>"`, both as raw text and parsed.
fn check_every_record_states_gate(text: &str, want: &str) -> Result<usize> {
    let needle = format!("\"kernel_gate\":\"{want}\"");
    let mut n = 0;
    for (i, line) in text.lines().enumerate() {
        let v: Value = serde_json::from_str(line).with_context(|| format!("line {}", i + 1))?;
        ensure!(
            v["kernel_gate"] == want && line.contains(&needle),
            "ledger line {} does not state kernel_gate {want}: {line}",
            i + 1
        );
        n += 1;
    }
    ensure!(n > 0, "the ledger is empty");
    Ok(n)
}

/// The gate's state as haltd states it on /healthz and in `haltd_kernel_gate_enabled`.
fn check_gate_stated(haltd: &Haltd, enforcing: bool) -> Result<()> {
    let (label, gauge) = if enforcing {
        ("enforcing", 1.0)
    } else {
        ("disabled", 0.0)
    };
    let (status, health) = get_json(haltd, &format!("{}/healthz", haltd.api_url()))?;
    ensure!(
        status == 200 && health["kernel_gate"] == label,
        "/healthz {status}: {health} (want kernel_gate {label})"
    );
    let m = haltd.metrics()?;
    let v = m.value("haltd_kernel_gate_enabled", &[])?;
    ensure!(v == gauge, "haltd_kernel_gate_enabled {v}, want {gauge}");
    Ok(())
}

/// Stops haltd, checks the ledger chain and returns the records.
fn stop_and_verify(haltd: Haltd) -> Result<Vec<Value>> {
    Ok(stop_and_verify_text(haltd)?.0)
}

/// Like [`stop_and_verify`], also returning the ledger's text (its directory goes with `haltd`).
fn stop_and_verify_text(mut haltd: Haltd) -> Result<(Vec<Value>, String)> {
    haltd.stop()?;
    let records = haltd.ledger_records()?;
    let text = fs::read_to_string(&haltd.ledger)?;
    verify_ledger(&haltd.ledger).map_err(|e| anyhow!("{e:#}\n{}", haltd.log_tail(30)))?;
    Ok((records, text))
}

/// A `haltd serve` that must refuse to start: (exit code, stdout + stderr, time to exit).
fn serve_refused(pair: &NetPair, ledger: &Path, extra: &[&str]) -> Result<(i32, String, Duration)> {
    let t = Instant::now();
    let mut child = Command::new("ip")
        .args(["netns", "exec", &pair.srv])
        .arg(haltd_bin()?)
        .arg("serve")
        .args(["--listen", &pair.srv_addr(PORT_API).to_string()])
        .args(["--admin", &pair.srv_addr(PORT_ADMIN).to_string()])
        .args(["--metrics", &pair.srv_addr(PORT_METRICS).to_string()])
        .arg("--ledger")
        .arg(ledger)
        .args(extra)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .context("starting haltd serve")?;
    let deadline = t + Duration::from_secs(10);
    let status = loop {
        if let Some(s) = child.try_wait()? {
            break s;
        }
        if Instant::now() > deadline {
            // Nothing may listen while it runs: check, then stop it.
            let listening = connect_refused(pair, PORT_API).is_err();
            let _ = child.kill();
            let _ = child.wait();
            bail!("haltd serve {extra:?} still runs after 10 s (API port answering: {listening})");
        }
        thread::sleep(Duration::from_millis(10));
    };
    let took = t.elapsed();
    let mut out = String::new();
    if let Some(mut s) = child.stdout.take() {
        s.read_to_string(&mut out)?;
    }
    if let Some(mut s) = child.stderr.take() {
        s.read_to_string(&mut out)?;
    }
    Ok((status.code().unwrap_or(-1), out, took))
}

/// Ok when a connection to `port` on the server address is refused (nothing listens).
fn connect_refused(pair: &NetPair, port: u16) -> Result<()> {
    let addr = pair.srv_addr(port);
    in_netns(&pair.cli, move || {
        match TcpStream::connect_timeout(&addr, Duration::from_secs(2)) {
            Err(e) if e.kind() == ErrorKind::ConnectionRefused => Ok(()),
            Err(e) => bail!("connecting to {addr}: {e} (expected connection refused)"),
            Ok(_) => bail!("something listens on {addr}"),
        }
    })
}

/// Writes an HTTP request with a JSON body on a fresh connection (current namespace).
fn send_request(addr: SocketAddr, path: &str, body: &Value) -> Result<TcpStream> {
    let json = serde_json::to_string(body)?;
    let mut s = TcpStream::connect_timeout(&addr, Duration::from_secs(5))?;
    write!(
        s,
        "POST {path} HTTP/1.1\r\nhost: {addr}\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{json}",
        json.len()
    )?;
    Ok(s)
}

/// Reads a response head; returns the `x-haltd-stream-id` header.
fn read_head(r: &mut impl BufRead) -> Result<String> {
    let mut id = String::new();
    let mut first = true;
    loop {
        let mut line = String::new();
        ensure!(
            r.read_line(&mut line)? > 0,
            "closed inside the response head"
        );
        let line = line.trim_end();
        if first {
            ensure!(line.contains(" 200 "), "status line {line:?}");
            first = false;
        }
        if line.is_empty() {
            return Ok(id);
        }
        if let Some((k, v)) = line.split_once(':') {
            if k.trim().eq_ignore_ascii_case("x-haltd-stream-id") {
                v.trim().clone_into(&mut id);
            }
        }
    }
}

/// The classified events of an SSE body.
fn sse_events(body: &[u8]) -> Vec<EventKind> {
    SseParser::default()
        .feed(body)
        .into_iter()
        .map(|(_, data)| classify(&data))
        .collect()
}

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

const TCP_ESTABLISHED: u8 = 1;

// ---------------------------------------------------------------------------------------------
// 1. No gate, no service.

/// `haltd serve` with a missing or non-BPF gate object exits non-zero at once, says why (the
/// gate) and how to run without it (`--no-kernel-gate`), and never listens.
#[test]
fn refuses_to_start_without_the_gate() -> Result<()> {
    let pair = NetPair::new()?;
    let dir = temp_dir("nogate")?;
    let garbage = dir.join("garbage.bpf.o");
    fs::write(&garbage, b"this is not an ELF BPF object\n\x00\x01\x02")?;
    let elf_no_bpf = dir.join("elf-not-bpf.o");
    fs::copy(haltctl_bin()?, &elf_no_bpf).context("copying haltctl as a non-BPF ELF")?;
    for object in [Path::new("/nonexistent"), &garbage, &elf_no_bpf] {
        let obj = object.to_string_lossy().into_owned();
        let (code, out, took) =
            serve_refused(&pair, &dir.join("ledger.jsonl"), &["--bpf-object", &obj])?;
        println!(
            "no gate ({obj}): exit {code} after {:.0} ms: {}",
            took.as_secs_f64() * 1e3,
            out.lines().last().unwrap_or_default()
        );
        ensure!(code != 0, "haltd exited 0 with --bpf-object {obj}: {out}");
        ensure!(
            took < Duration::from_secs(5),
            "refusing took {took:?} with --bpf-object {obj}"
        );
        ensure!(
            out.contains("kernel halt gate") && out.contains("--no-kernel-gate"),
            "the message does not name the gate and --no-kernel-gate: {out}"
        );
        for port in [PORT_API, PORT_ADMIN, PORT_METRICS] {
            connect_refused(&pair, port)?;
        }
    }
    let _ = fs::remove_dir_all(&dir);
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// 2. --no-kernel-gate is stated everywhere; the userspace watchdog still holds B.

#[test]
fn no_kernel_gate_is_stated_everywhere() -> Result<()> {
    const BUDGET: u64 = 5;
    const TRIPPED: usize = 12;
    let pair = NetPair::new()?;
    let haltd = Haltd::start(
        &pair,
        &[
            "--no-kernel-gate",
            "--budget",
            &BUDGET.to_string(),
            "--builtin-token-interval-us",
            "1000",
        ],
    )?;
    check_gate_stated(&haltd, false)?;
    let url = chat_url(&haltd);
    let normal = stream_in(&haltd, &url, &chat("Rivers", 1, 30, true), |_, _| {})?;
    ensure!(
        normal.tokens == 30
            && normal.finish_reason.as_deref() == Some("length")
            && normal.done_at.is_some(),
        "normal stream: {} tokens, finish {:?}",
        normal.tokens,
        normal.finish_reason
    );
    // Tripped streams, concurrently, at k = 1..=TRIPPED tokens.
    let admin = haltd.admin_url();
    let handles: Vec<_> = (0..TRIPPED)
        .map(|i| {
            let (url, admin) = (url.clone(), admin.clone());
            spawn_in_netns(
                &pair.cli,
                move || -> Result<(StreamOutcome, Option<(u16, Value)>)> {
                    let mut trip = None;
                    let body = chat(&format!("Lakes {i}"), i as u64, 400, true);
                    let o = sse::stream(&url, &body, Duration::from_secs(30), |p, ev| {
                        if trip.is_none()
                            && matches!(ev.kind, EventKind::Token(_))
                            && p.tokens == i + 1
                        {
                            let u = format!("{admin}/admin/streams/{}/trip", p.stream_id);
                            trip = Some(trip_here(&u, None).unwrap_or((0, Value::Null)));
                        }
                    })?;
                    Ok((o, trip))
                },
            )
        })
        .collect();
    let mut posts = Vec::new();
    for h in handles {
        let (o, trip) = h.join().map_err(|_| anyhow!("client thread panicked"))??;
        posts.push(check_operator_trip(&o, trip.as_ref(), BUDGET, &|| {
            haltd.log_tail(30)
        })?);
    }
    println!("no kernel gate: post-trip tokens {posts:?} (budget {BUDGET})");
    wait_idle(&haltd)?;
    check_gate_stated(&haltd, false)?;
    let m = haltd.metrics()?;
    ensure!(
        m.value_or_zero("haltd_watchdog_trips_total", &[("cause", "OPERATOR_TRIP")])?
            == TRIPPED as f64,
        "trips not counted"
    );
    let (records, text) = stop_and_verify_text(haltd)?;
    let n = check_every_record_states_gate(&text, "disabled")?;
    let incidents = records.iter().filter(|r| r["kind"] == "incident").count();
    ensure!(
        incidents == TRIPPED,
        "{incidents} incident records for {TRIPPED} trips"
    );
    println!("no kernel gate: {n} ledger records, all say kernel_gate disabled");
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// 3. HaltMonitor (spec 001, G6) on real streams.

const MONITOR_PROMPTS: usize = 60;
const MONITOR_MAX_TOKENS: u32 = 120;
const MONITOR_LIMIT: f64 = 0.05;

/// The logprobs of a chat stream's token events, as f32 (what haltd scores).
fn chat_logprobs(o: &StreamOutcome) -> Result<Vec<f32>> {
    o.events
        .iter()
        .filter(|e| matches!(e.kind, EventKind::Token(_)))
        .map(|e| {
            let v: Value = serde_json::from_str(&e.data)?;
            let lp = v["choices"][0]["logprobs"]["content"][0]["logprob"]
                .as_f64()
                .with_context(|| format!("token event without logprob: {}", e.data))?;
            // Written as the shortest decimal that round-trips the f32.
            #[expect(
                clippy::cast_possible_truncation,
                reason = "the value is an f32 written as decimal"
            )]
            Ok(lp as f32)
        })
        .collect()
}

fn monitor_body(i: usize) -> Value {
    let mut b = chat(
        &format!("Tell me about coherence {i}"),
        1000 + i as u64,
        MONITOR_MAX_TOKENS,
        true,
    );
    b["logprobs"] = json!(true);
    b
}

/// Runs every monitor request against `haltd`, 8 at a time.
fn monitor_runs(haltd: &Haltd) -> Result<Vec<StreamOutcome>> {
    let url = chat_url(haltd);
    let mut out = Vec::new();
    for chunk in (0..MONITOR_PROMPTS).collect::<Vec<_>>().chunks(8) {
        let handles: Vec<_> = chunk
            .iter()
            .map(|&i| {
                let url = url.clone();
                spawn_in_netns(&haltd.client_ns, move || {
                    sse::stream(&url, &monitor_body(i), Duration::from_secs(30), |_, _| {})
                })
            })
            .collect();
        for h in handles {
            out.push(h.join().map_err(|_| anyhow!("client thread panicked"))??);
        }
    }
    Ok(out)
}

#[test]
fn halt_monitor_on_real_streams() -> Result<()> {
    let ln_limit = MONITOR_LIMIT.ln();
    // Reference: P = 0 (the default) never trips; every request yields max_tokens tokens.
    let reference = {
        let pair = NetPair::new()?;
        let haltd = Haltd::start(&pair, &["--builtin-token-interval-us", "0"])?;
        let runs = monitor_runs(&haltd)?;
        for (i, o) in runs.iter().enumerate() {
            ensure!(
                o.tokens == MONITOR_MAX_TOKENS as usize
                    && o.finish_reason.as_deref() == Some("length")
                    && o.error.is_none()
                    && o.done_at.is_some(),
                "P = 0, request {i}: {} tokens, finish {:?}, error {:?}",
                o.tokens,
                o.finish_reason,
                o.error
            );
        }
        let records = stop_and_verify(haltd)?;
        ensure!(
            !records.iter().any(|r| r["kind"] == "incident"),
            "P = 0 wrote incidents"
        );
        runs
    };
    let pair = NetPair::new()?;
    let limit = MONITOR_LIMIT.to_string();
    // The exfiltration scanner may hold a token back when the monitor trips, and held text is
    // never emitted; this test checks the monitor's exact cut, so it runs without the scanner.
    let dir = temp_dir("monitor-config")?;
    let config = dir.join("haltd.toml");
    fs::write(&config, "[detectors.exfil]\nmode = \"off\"\n")?;
    let config = config.display().to_string();
    let haltd = Haltd::start(
        &pair,
        &[
            "--builtin-token-interval-us",
            "0",
            "--hard-limit",
            &limit,
            "--config",
            &config,
        ],
    )?;
    let runs = monitor_runs(&haltd)?;
    let mut taus = Vec::new();
    let mut failures = Vec::new();
    for (i, (o, r)) in runs.iter().zip(&reference).enumerate() {
        let mut fail =
            |what: String| failures.push(format!("request {i} ({}): {what}", o.stream_id));
        let ref_lps = chat_logprobs(r)?;
        let lps = chat_logprobs(o)?;
        // Same (prompt, seed): the monitored stream is the reference up to the first failing
        // token, which haltd scores exactly as exp(f64(logprob)) < P.
        let tau = ref_lps
            .iter()
            .position(|&lp| f64::from(lp).exp() < MONITOR_LIMIT);
        if let Some(bad) = lps.iter().position(|&lp| f64::from(lp) < ln_limit) {
            fail(format!(
                "token {bad} has logprob {} < ln(P) = {ln_limit}",
                lps[bad]
            ));
        }
        let ref_prefix: String = r
            .events
            .iter()
            .filter_map(|e| match &e.kind {
                EventKind::Token(t) => Some(t.as_str()),
                _ => None,
            })
            .take(o.tokens)
            .collect();
        if o.text != ref_prefix {
            fail("received text differs from the reference prefix".into());
        }
        match tau {
            None => {
                if o.tokens != MONITOR_MAX_TOKENS as usize || o.error.is_some() {
                    fail(format!(
                        "no failing token, yet {} tokens, error {:?}",
                        o.tokens, o.error
                    ));
                }
            }
            Some(tau) => {
                taus.push(tau);
                if let Err(e) = o.halted_cleanly("COHERENCE_BELOW_THRESHOLD") {
                    fail(format!("{e:#}"));
                    continue;
                }
                let err = o.error.clone().unwrap_or_default();
                if o.tokens != tau
                    || err["trip_token_index"].as_u64() != Some(o.tokens as u64)
                    || err["post_trip_tokens"].as_u64() != Some(0)
                {
                    fail(format!(
                        "received {} tokens, first failing token {tau}; error {err}",
                        o.tokens
                    ));
                }
            }
        }
    }
    ensure!(
        failures.is_empty(),
        "{}\n{}",
        failures.join("\n"),
        haltd.log_tail(20)
    );
    let tripped_ids: Vec<&str> = runs
        .iter()
        .filter(|o| o.error.is_some())
        .map(|o| o.stream_id.as_str())
        .collect();
    taus.sort_unstable();
    println!(
        "halt monitor P = {MONITOR_LIMIT}: {} of {MONITOR_PROMPTS} streams tripped, at token indices {taus:?}",
        taus.len()
    );
    ensure!(
        taus.len() >= MONITOR_PROMPTS / 4 && taus.iter().any(|&t| t >= 3),
        "too few streams trip late enough to test anything: {taus:?} (pick another --hard-limit)"
    );
    wait_idle(&haltd)?;
    let m = haltd.metrics()?;
    let counted = m.value_or_zero(
        "haltd_watchdog_trips_total",
        &[("cause", "COHERENCE_BELOW_THRESHOLD")],
    )?;
    ensure!(
        counted == taus.len() as f64,
        "haltd_watchdog_trips_total{{cause=\"COHERENCE_BELOW_THRESHOLD\"}} {counted}, {} trips",
        taus.len()
    );
    let records = stop_and_verify(haltd)?;
    for id in tripped_ids {
        let incident = records
            .iter()
            .find(|r| r["kind"] == "incident" && r["stream_id"] == id)
            .with_context(|| format!("no incident record for {id}"))?;
        ensure!(
            incident["failure_codes"] == json!(["WATCHDOG_TRIP", "COHERENCE_BELOW_THRESHOLD"])
                && incident["halt_tokens_post_trip"].as_u64() == Some(0),
            "incident for {id}: {incident}"
        );
    }
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// 4. The watchdog closes a stream whose emitter cannot send.

#[test]
fn watchdog_halts_a_blocked_emitter() -> Result<()> {
    const GRACE_MS: u64 = 50;
    const BUDGET: u64 = 5;
    const CONCURRENT_TOKENS: u32 = 400;
    let pair = NetPair::new()?;
    // Small socket buffers on both ends: a client that does not read blocks the emitter fast.
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
    let haltd = Haltd::start(
        &pair,
        &[
            "--budget",
            &BUDGET.to_string(),
            "--halt-grace-ms",
            &GRACE_MS.to_string(),
            "--builtin-token-interval-us",
            "1000",
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
    // Wait until its emitter is stuck: the submitted count stops moving.
    let mut last = (u64::MAX, Instant::now());
    let id = wait_for(
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
    )?;
    println!("blocked emitter {}: stuck after {} tokens", id.0, id.1);

    let (u, b) = (url.clone(), normal_body.clone());
    let concurrent = spawn_in_netns(&pair.cli, move || {
        sse::stream(&u, &b, Duration::from_secs(30), |_, _| {})
    });
    thread::sleep(Duration::from_millis(20));
    let tripped_at = Instant::now();
    let (status, trip) = haltd.trip(&id.0, None)?;
    ensure!(status == 200, "trip answered {status}: {trip}");
    // Measured on the server's socket: how long until haltd's end is no longer ESTABLISHED.
    let closed_after = in_netns(&pair.srv, move || -> Result<Duration> {
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
    })?;
    let bound = Duration::from_millis(4 * GRACE_MS + 250);
    println!(
        "blocked emitter: haltd closed the connection {:.0} ms after the trip (bound {bound:?})",
        closed_after.as_secs_f64() * 1e3
    );
    ensure!(
        closed_after <= bound,
        "closed {closed_after:?} after the trip, bound {bound:?}\n{}",
        haltd.log_tail(30)
    );

    // Now the client reads: whatever was queued, then the end of the connection.
    let idx = trip["trip_token_index"]
        .as_u64()
        .context("trip_token_index")?;
    let received = in_netns(&pair.cli, move || -> Result<(Vec<u8>, Duration)> {
        let t = Instant::now();
        let s = silent;
        s.set_read_timeout(Some(Duration::from_secs(5)))?;
        let mut r = BufReader::new(s);
        read_head(&mut r)?;
        let mut body = Vec::new();
        r.read_to_end(&mut body).context("reading to EOF")?;
        Ok((body, t.elapsed()))
    })?;
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
        tokens <= idx + BUDGET,
        "{tokens} tokens reached the client, trip index {idx}, budget {BUDGET}"
    );

    let c = concurrent
        .join()
        .map_err(|_| anyhow!("concurrent client panicked"))??;
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
    let incident = haltd.wait_record("incident of the blocked stream", |r| {
        r["kind"] == "incident" && r["stream_id"] == id.0.as_str()
    })?;
    ensure!(incident["halted_by"] == "watchdog", "incident: {incident}");
    wait_idle(&haltd)?;
    let halts = haltd
        .metrics()?
        .value("haltd_halts_total", &[("halted_by", "watchdog")])?;
    ensure!(
        halts >= 1.0,
        "haltd_halts_total{{halted_by=\"watchdog\"}} = {halts}"
    );
    stop_and_verify(haltd)?;
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// 5. A client that goes away mid-stream; trips on ended, unknown and malformed ids.

#[test]
fn client_disconnect_mid_stream() -> Result<()> {
    const K: usize = 5;
    let pair = NetPair::new()?;
    let haltd = Haltd::start(&pair, &["--builtin-token-interval-us", "2000"])?;
    let api = haltd.api;
    let (id, got) = in_netns(&pair.cli, move || -> Result<(String, usize)> {
        let s = send_request(
            api,
            "/v1/chat/completions",
            &chat("Leaving early", 5, 5000, true),
        )?;
        s.set_read_timeout(Some(Duration::from_secs(5)))?;
        let mut r = BufReader::new(s);
        let id = read_head(&mut r)?;
        let mut parser = SseParser::default();
        let mut tokens = 0;
        let mut buf = [0_u8; 4096];
        while tokens < K {
            let n = r.read(&mut buf)?;
            ensure!(n > 0, "EOF after {tokens} tokens");
            tokens += parser
                .feed(&buf[..n])
                .iter()
                .filter(|(_, d)| matches!(classify(d), EventKind::Token(_)))
                .count();
        }
        Ok((id, tokens))
        // The connection closes here.
    })?;
    println!("client gone: closed {id} after {got} tokens");
    ensure!(!id.is_empty(), "no x-haltd-stream-id");
    wait_idle(&haltd).with_context(|| haltd.log_tail(20))?;
    let turn = haltd.wait_record("turn record of the gone client", |r| {
        r["kind"] == "turn" && r["stream_id"] == id.as_str()
    })?;
    ensure!(turn["outcome"] == "client_gone", "turn record: {turn}");
    let gone = haltd.trip(&id, None)?;
    ensure!(gone.0 == 409, "trip on the ended stream: {gone:?}");
    let never = haltd.trip("hs_ffffffff00000000", None)?;
    ensure!(never.0 == 404, "trip on a never-issued id: {never:?}");
    for bad in ["hs_nothex0000000000", "hs_0123", "nope"] {
        let r = haltd.trip(bad, None)?;
        ensure!(
            r.0 == 400 && r.1["error"]["type"] == "invalid_request_error",
            "trip on malformed id {bad}: {r:?}"
        );
    }
    println!("client gone: trips answered 409 (ended), 404 (never issued), 400 (malformed)");
    let records = stop_and_verify(haltd)?;
    ensure!(
        !records.iter().any(|r| r["kind"] == "incident"),
        "the refused trips left incidents"
    );
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// 6. Admin trip races (and the gate stated as enforcing).

/// Two trips of one stream sent at the same instant, on connections opened beforehand: one
/// wins (200), the other gets 409 with the winner's trip_token_index.
fn race_trips(admin: SocketAddr, cli: &str, id: &str) -> Vec<(u16, Value)> {
    let request = format!(
        "POST /admin/streams/{id}/trip HTTP/1.1\r\nhost: {admin}\r\ncontent-length: 0\r\n\r\n"
    );
    let barrier = Arc::new(Barrier::new(2));
    let racers: Vec<_> = (0..2)
        .map(|_| {
            let (b, req) = (Arc::clone(&barrier), request.clone());
            spawn_in_netns(cli, move || -> Result<(u16, Value)> {
                let s = TcpStream::connect_timeout(&admin, Duration::from_secs(5))?;
                s.set_nodelay(true)?;
                b.wait();
                let r = raw_exchange_on(s, req.as_bytes(), Duration::from_secs(10))?;
                Ok((r.status, r.json().unwrap_or(Value::Null)))
            })
        })
        .collect();
    racers
        .into_iter()
        .map(|h| match h.join() {
            Ok(Ok(answer)) => answer,
            Ok(Err(e)) => (0, Value::String(format!("{e:#}"))),
            Err(_) => (0, Value::String("racer panicked".into())),
        })
        .collect()
}

#[test]
fn admin_trip_races() -> Result<()> {
    const STREAMS: usize = 10;
    let pair = NetPair::new()?;
    let haltd = Haltd::start(&pair, &["--builtin-token-interval-us", "3000"])?;
    let url = chat_url(&haltd);
    let admin = haltd.admin;
    let handles: Vec<_> = (0..STREAMS)
        .map(|i| {
            let (url, cli) = (url.clone(), pair.cli.clone());
            spawn_in_netns(
                &pair.cli,
                move || -> Result<(StreamOutcome, Vec<(u16, Value)>)> {
                    let mut answers = Vec::new();
                    let body = chat("Races", i as u64, 300, true);
                    let o = sse::stream(&url, &body, Duration::from_secs(30), |p, ev| {
                        if answers.is_empty()
                            && matches!(ev.kind, EventKind::Token(_))
                            && p.tokens == 3 + i % 4
                        {
                            answers = race_trips(admin, &cli, p.stream_id);
                        }
                    })?;
                    Ok((o, answers))
                },
            )
        })
        .collect();
    let mut failures = Vec::new();
    let mut halted = Vec::new();
    for h in handles {
        let (o, mut answers) = h.join().map_err(|_| anyhow!("client thread panicked"))??;
        answers.sort_by_key(|a| a.0);
        let [(200, won), (409, lost)] = answers.as_slice() else {
            failures.push(format!(
                "two concurrent trips of {} answered {answers:?}",
                o.stream_id
            ));
            continue;
        };
        check_operator_trip(&o, Some(&(200, won.clone())), 5, &|| haltd.log_tail(20))?;
        halted.push((o.stream_id.clone(), won["trip_token_index"].clone()));
        if lost["error"]["type"] != "already_tripped"
            || lost["trip_token_index"] != won["trip_token_index"]
            || !won["trip_token_index"].is_u64()
        {
            failures.push(format!(
                "race on {}: winner {won}, loser {lost}",
                o.stream_id
            ));
        }
    }
    // The same question asked later, deterministically: a stream that ended because it was
    // tripped is still the tripped stream (409, its cause and trip_token_index).
    for (id, index) in &halted {
        let again = in_netns(&pair.cli, {
            let u = trip_url(&haltd, id);
            move || trip_here(&u, None)
        })?;
        if again.0 != 409
            || again.1["error"]["type"] != "already_tripped"
            || again.1["trip_token_index"] != *index
        {
            failures.push(format!(
                "re-trip of the halted {id} (trip_token_index {index}): {again:?}"
            ));
        }
    }
    // A trip after the stream completed normally.
    let done = stream_in(&haltd, &url, &chat("Short", 1, 4, true), |_, _| {})?;
    ensure!(
        done.tokens == 4 && done.done_at.is_some(),
        "short stream: {done:?}"
    );
    let late = in_netns(&pair.cli, {
        let u = trip_url(&haltd, &done.stream_id);
        move || trip_here(&u, None)
    })?;
    ensure!(
        late.0 == 409 && late.1["error"]["type"] == "finished",
        "trip after completion: {late:?}"
    );
    wait_idle(&haltd)?;
    check_gate_stated(&haltd, true)?;
    let m = haltd.metrics()?;
    let trips = m.value_or_zero("haltd_watchdog_trips_total", &[("cause", "OPERATOR_TRIP")])?;
    ensure!(
        trips == STREAMS as f64,
        "{trips} trips counted for {STREAMS} races"
    );
    let (records, text) = stop_and_verify_text(haltd)?;
    let incidents = records.iter().filter(|r| r["kind"] == "incident").count();
    ensure!(
        incidents == STREAMS,
        "{incidents} incidents for {STREAMS} streams tripped twice"
    );
    check_every_record_states_gate(&text, "enforcing")?;
    println!(
        "trip races: {STREAMS} races; late trip on a completed stream 409; {} failures",
        failures.len()
    );
    ensure!(
        failures.is_empty(),
        "trip races:\n  {}",
        failures.join("\n  ")
    );
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// 7. /v1/completions: streaming, batch, legacy logprobs, trips.

/// Checks one legacy `logprobs` object for `toks` starting at byte offset `start`; returns the
/// token logprobs.
fn check_legacy_logprobs(
    lp: &Value,
    toks: &[String],
    start: usize,
    n_top: usize,
) -> Result<Vec<f64>> {
    let tokens: Vec<&str> = lp["tokens"]
        .as_array()
        .context("tokens")?
        .iter()
        .filter_map(Value::as_str)
        .collect();
    ensure!(tokens == toks, "logprobs.tokens {tokens:?} != {toks:?}");
    let lps: Vec<f64> = lp["token_logprobs"]
        .as_array()
        .context("token_logprobs")?
        .iter()
        .filter_map(Value::as_f64)
        .collect();
    ensure!(
        lps.len() == toks.len() && lps.iter().all(|&l| l <= 0.0),
        "token_logprobs {lps:?}"
    );
    let top = lp["top_logprobs"].as_array().context("top_logprobs")?;
    ensure!(top.len() == toks.len(), "top_logprobs {top:?}");
    for (t, &l) in top.iter().zip(&lps) {
        let alts = t.as_object().context("top_logprobs entry is an object")?;
        ensure!(
            (1..=n_top).contains(&alts.len())
                && alts.values().all(|v| v.as_f64().is_some_and(|a| a <= 0.0)),
            "top_logprobs entry {t}"
        );
        let best = alts
            .values()
            .filter_map(Value::as_f64)
            .fold(f64::MIN, f64::max);
        ensure!(
            l <= best + 1e-6,
            "sampled logprob {l} above the best alternative {best}"
        );
    }
    let mut offset = start;
    let want: Vec<usize> = toks
        .iter()
        .map(|t| {
            let o = offset;
            offset += t.len();
            o
        })
        .collect();
    let offsets: Vec<usize> = lp["text_offset"]
        .as_array()
        .context("text_offset")?
        .iter()
        .filter_map(|v| v.as_u64().map(|v| v as usize))
        .collect();
    ensure!(offsets == want, "text_offset {offsets:?}, want {want:?}");
    Ok(lps)
}

#[test]
fn completions_endpoint() -> Result<()> {
    const N: u32 = 24;
    let pair = NetPair::new()?;
    let haltd = Haltd::start(&pair, &["--builtin-token-interval-us", "2000"])?;
    let url = format!("{}/v1/completions", haltd.api_url());
    let body = |stream: bool, max: u32| {
        json!({"model": "builtin", "prompt": "Rivers run to", "seed": 11, "max_tokens": max,
               "stream": stream, "logprobs": 2, "ignore_eos": true})
    };
    let o = stream_in(&haltd, &url, &body(true, N), |_, _| {})?;
    ensure!(
        o.tokens == N as usize
            && o.finish_reason.as_deref() == Some("length")
            && o.done_at.is_some()
            && o.malformed == 0,
        "completions stream: {} tokens, finish {:?}, error {:?}",
        o.tokens,
        o.finish_reason,
        o.error
    );
    let mut streamed = Vec::new();
    let mut text = String::new();
    let mut streamed_lps = Vec::new();
    for e in &o.events {
        let EventKind::Token(t) = &e.kind else {
            continue;
        };
        let v: Value = serde_json::from_str(&e.data)?;
        let choice = &v["choices"][0];
        ensure!(
            choice["text"] == t.as_str() && v["object"] == "text_completion",
            "token event {}",
            e.data
        );
        streamed_lps.extend(
            check_legacy_logprobs(&choice["logprobs"], std::slice::from_ref(t), text.len(), 2)
                .with_context(|| format!("token event {}", e.data))?,
        );
        text.push_str(t);
        streamed.push(t.clone());
    }
    // Batch: the same request in one body.
    let (u, b) = (url.clone(), body(false, N));
    let (status, _, batch) = in_netns(&pair.cli, move || {
        sse::post(&u, &b, Duration::from_secs(30))
    })?;
    ensure!(status == 200, "batch status {status}: {batch}");
    let v: Value = serde_json::from_str(&batch)?;
    let choice = &v["choices"][0];
    ensure!(
        choice["text"] == text.as_str() && choice["finish_reason"] == "length",
        "batch choice {choice} (streamed text {text:?})"
    );
    let batch_lps = check_legacy_logprobs(&choice["logprobs"], &streamed, 0, 2)?;
    ensure!(
        batch_lps == streamed_lps,
        "batch token_logprobs differ from the streamed ones"
    );
    // A tripped completions stream.
    let (t, trip) = stream_tripped_at(&haltd, &url, &body(true, 400), 3)?;
    let post = check_operator_trip(&t, trip.as_ref(), 5, &|| haltd.log_tail(20))?;
    println!("completions: {N} streamed tokens = batch, legacy logprobs ok; tripped stream: {post} post-trip tokens");
    wait_idle(&haltd)?;
    check_gate_stated(&haltd, true)?;
    let (_, text) = stop_and_verify_text(haltd)?;
    check_every_record_states_gate(&text, "enforcing")?;
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// 8. Ledger: verify, tamper, fail closed.

#[test]
fn ledger_tamper_is_detected_and_refused() -> Result<()> {
    let pair = NetPair::new()?;
    let haltd = Haltd::start(&pair, &["--builtin-token-interval-us", "2000"])?;
    let url = chat_url(&haltd);
    stream_in(&haltd, &url, &chat("One", 1, 5, true), |_, _| {})?;
    let (t, trip) = stream_tripped_at(&haltd, &url, &chat("Two", 2, 300, true), 2)?;
    check_operator_trip(&t, trip.as_ref(), 5, &|| haltd.log_tail(20))?;
    wait_idle(&haltd)?;
    let path = haltd.ledger.clone();
    let dir = temp_dir("tamper")?;
    let intact = dir.join("intact.jsonl");
    {
        let mut haltd = haltd;
        haltd.stop()?;
        let out = verify_ledger(&path)?;
        println!("ledger: {}", out.trim());
        fs::copy(&path, &intact)?;
    }
    let text = fs::read_to_string(&intact)?;
    let lines: Vec<&str> = text.lines().collect();
    ensure!(lines.len() >= 3, "only {} ledger lines", lines.len());
    // Flip one digit of the year in the `ts` field of a middle record: still valid JSON.
    let line_no = lines.len() / 2 + 1;
    let line = lines[line_no - 1];
    let at = line.find("\"ts\":\"").context("record without ts")? + "\"ts\":\"".len() + 2;
    let mut bytes = text.clone().into_bytes();
    let start: usize = lines[..line_no - 1].iter().map(|l| l.len() + 1).sum();
    let b = &mut bytes[start + at];
    ensure!(b.is_ascii_digit(), "ts digit {:?}", *b as char);
    *b = if *b == b'9' { b'8' } else { *b + 1 };
    let tampered = dir.join("tampered.jsonl");
    fs::write(&tampered, &bytes)?;
    let out = Command::new(haltctl_bin()?)
        .args(["ledger", "verify"])
        .arg(&tampered)
        .output()?;
    let shown = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    println!(
        "tampered line {line_no}: haltctl ledger verify exit {:?}: {}",
        out.status.code(),
        shown.trim()
    );
    ensure!(
        out.status.code() == Some(1),
        "verify of the tampered file exited {:?}: {shown}",
        out.status.code()
    );
    ensure!(
        shown.contains(&format!("line {line_no}")),
        "verify does not name line {line_no}: {shown}"
    );
    // haltd refuses to append to it.
    let (code, msg, took) = serve_refused(&pair, &tampered, &[])?;
    println!(
        "tampered ledger: haltd serve exit {code} after {:.0} ms: {}",
        took.as_secs_f64() * 1e3,
        msg.lines().last().unwrap_or_default()
    );
    ensure!(code != 0, "haltd served on a tampered ledger: {msg}");
    ensure!(
        msg.contains(&format!("line {line_no}")),
        "haltd's refusal does not name line {line_no}: {msg}"
    );
    ensure!(
        fs::read(&tampered)? == bytes,
        "haltd changed the tampered ledger"
    );
    connect_refused(&pair, PORT_API)?;
    // The intact copy still verifies (the tamper, not the copy, broke it).
    verify_ledger(&intact)?;
    let _ = fs::remove_dir_all(&dir);
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// 9. curl as a real client.

#[test]
fn curl_sees_a_clean_halt() -> Result<()> {
    if Command::new("curl").arg("--version").output().is_err() {
        println!("curl not installed: skipped");
        return Ok(());
    }
    let pair = NetPair::new()?;
    let haltd = Haltd::start(&pair, &["--builtin-token-interval-us", "5000"])?;
    let body = serde_json::to_string(&chat("Curl me", 4, 400, true))?;
    let child = Command::new("ip")
        .args([
            "netns",
            "exec",
            &pair.cli,
            "curl",
            "-sN",
            "--max-time",
            "30",
        ])
        .args(["-H", "content-type: application/json", "-d", &body])
        .arg(chat_url(&haltd))
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .context("starting curl")?;
    let id = wait_for(
        Duration::from_secs(10),
        "curl's stream has 3 tokens",
        || {
            let list = haltd.list_streams()?;
            Ok(list["streams"]
                .as_array()
                .and_then(|l| l.first())
                .filter(|s| s["tokens"].as_u64().is_some_and(|t| t >= 3))
                .and_then(|s| s["stream_id"].as_str().map(str::to_owned)))
        },
    )?;
    let (status, trip) = haltd.trip(&id, None)?;
    ensure!(status == 200, "trip: {status} {trip}");
    let out = child.wait_with_output()?;
    let text = String::from_utf8_lossy(&out.stdout);
    ensure!(
        out.status.success(),
        "curl failed ({}): {}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    let events = sse_events(text.as_bytes());
    let n = events.len();
    ensure!(n >= 3, "curl got {n} events: {text}");
    let tail = &events[n - 3..];
    let ok = matches!(&tail[0], EventKind::Final { finish_reason, .. } if finish_reason == "content_filter")
        && matches!(&tail[1], EventKind::Error(e) if e["type"] == "halted" && e["code"] == "OPERATOR_TRIP" && e["stream_id"] == id.as_str())
        && tail[2] == EventKind::Done;
    ensure!(
        ok,
        "curl's output does not end with content_filter, error, [DONE]: {tail:?}"
    );
    ensure!(
        text.trim_end().ends_with("data: [DONE]"),
        "curl's output does not end with data: [DONE]: {:?}",
        &text[text.len().saturating_sub(200)..]
    );
    let tokens = events
        .iter()
        .filter(|e| matches!(e, EventKind::Token(_)))
        .count() as u64;
    let idx = trip["trip_token_index"]
        .as_u64()
        .context("trip_token_index")?;
    ensure!(
        tokens <= idx + 5,
        "curl got {tokens} tokens, trip index {idx}"
    );
    println!("curl: {tokens} tokens (trip index {idx}), then content_filter, error, [DONE]");
    stop_and_verify(haltd)?;
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// 10. The whole daemon stopped mid-stream (DESIGN §7)

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
    let stopper = {
        let received = Arc::clone(&received);
        thread::spawn(move || -> Result<()> {
            let t0 = Instant::now();
            while received.load(std::sync::atomic::Ordering::SeqCst) < STOP_AFTER {
                ensure!(
                    t0.elapsed() < Duration::from_secs(10),
                    "stream never reached {STOP_AFTER} tokens"
                );
                thread::sleep(Duration::from_millis(1));
            }
            // SAFETY: plain signals to the haltd child this test started.
            ensure!(
                unsafe { libc::kill(pid, libc::SIGSTOP) } == 0,
                "SIGSTOP failed"
            );
            let stopped = Instant::now();
            thread::sleep(Duration::from_millis(400));
            let resumed = Instant::now();
            // SAFETY: as above.
            ensure!(
                unsafe { libc::kill(pid, libc::SIGCONT) } == 0,
                "SIGCONT failed"
            );
            let _ = tx.send((stopped, resumed));
            Ok(())
        })
    };
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

// ---------------------------------------------------------------------------------------------
// 11. A crash keeps the record (G7)

/// SIGKILL haltd while streams are open: every record written before the crash survives, the
/// chain verifies, and a new haltd resumes the same ledger (its chain goes on).
#[test]
fn crash_keeps_the_ledger() -> Result<()> {
    let pair = NetPair::new()?;
    let mut first = Haltd::start(&pair, &["--builtin-token-interval-us", "2000"])?;
    let kept = temp_dir("crash")?.join("ledger.jsonl");
    // Three complete turns and one tripped one, all recorded before the crash.
    for i in 0..3 {
        let o = stream_in(
            &first,
            &chat_url(&first),
            &chat("before the crash", i, 10, true),
            |_, _| {},
        )?;
        ensure!(
            o.finish_reason.as_deref() == Some("length"),
            "turn {i}: {:?}",
            o.finish_reason
        );
    }
    let (o, trip) = stream_tripped_at(
        &first,
        &chat_url(&first),
        &chat("tripped before the crash", 9, 500, true),
        3,
    )?;
    check_operator_trip(&o, trip.as_ref(), 5, &|| first.log_tail(20))?;
    let before = wait_for(
        Duration::from_secs(5),
        "4 turn records and 1 incident",
        || {
            let r = first.ledger_records()?;
            let turns = r.iter().filter(|r| r["kind"] == "turn").count();
            let incidents = r.iter().filter(|r| r["kind"] == "incident").count();
            Ok((turns == 4 && incidents == 1).then_some(r))
        },
    )?;
    // A stream still open when the process dies.
    let api = chat_url(&first);
    let client = spawn_in_netns(&first.client_ns, move || {
        sse::stream(
            &api,
            &chat("open at the crash", 11, 100_000, true),
            Duration::from_secs(20),
            |_, _| {},
        )
    });
    thread::sleep(Duration::from_millis(200));
    first.crash()?;
    let open = client
        .join()
        .map_err(|_| anyhow!("client thread panicked"))??;
    ensure!(
        open.done_at.is_none(),
        "a stream open at the crash cannot end with [DONE]"
    );
    fs::copy(&first.ledger, &kept)?;
    let report = verify_ledger(&kept)?;
    let after_crash = haltd_tests::read_ledger(&kept)?;
    ensure!(
        after_crash.len() >= before.len(),
        "records lost: {} before, {} after",
        before.len(),
        after_crash.len()
    );
    for (a, b) in before.iter().zip(&after_crash) {
        ensure!(a == b, "record changed by the crash:\n{a}\n{b}");
    }
    println!(
        "crash: {} records survived SIGKILL ({report})",
        after_crash.len()
    );
    drop(first);
    // A new instance resumes the chain.
    let second =
        Haltd::start_with_ledger(&pair, Some(&kept), &["--builtin-token-interval-us", "2000"])?;
    let o = stream_in(
        &second,
        &chat_url(&second),
        &chat("after the restart", 1, 5, true),
        |_, _| {},
    )?;
    ensure!(
        o.finish_reason.as_deref() == Some("length"),
        "{:?}",
        o.finish_reason
    );
    let records = stop_and_verify(second)?;
    ensure!(
        records.len() > after_crash.len() + 1,
        "the restarted haltd appended nothing"
    );
    ensure!(
        records[after_crash.len()]["prev_hash"] == after_crash[after_crash.len() - 1]["hash"],
        "the restarted haltd did not continue the chain"
    );
    Ok(())
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
    let pair = NetPair::new()?;
    let haltd = Haltd::start(
        &pair,
        &[
            "--request-timeout-ms",
            "300",
            "--max-streams",
            "4",
            "--builtin-token-interval-us",
            "2000",
        ],
    )?;
    let api = haltd.api;
    let normal_url = chat_url(&haltd);
    let normal = spawn_in_netns(&haltd.client_ns, move || {
        sse::stream(
            &normal_url,
            &chat("alongside slow clients", 3, 300, true),
            Duration::from_secs(20),
            |_, _| {},
        )
    });
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
    // Fill the table: the normal stream holds one slot, three idle connections the rest.
    let holders = in_netns(&haltd.client_ns, || -> Result<Vec<TcpStream>> {
        (0..3).map(|_| Ok(TcpStream::connect(api)?)).collect()
    })?;
    wait_for(Duration::from_secs(5), "4 streams open", || {
        let (_, status) = get_json(&haltd, &format!("{}/admin/status", haltd.admin_url()))?;
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
    drop(holders);
    let o = normal
        .join()
        .map_err(|_| anyhow!("normal stream thread panicked"))??;
    ensure!(
        o.tokens == 300 && o.finish_reason.as_deref() == Some("length"),
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

// ---------------------------------------------------------------------------------------------
// 13. Shutdown halts open streams cleanly

/// SIGTERM with streams open: each client gets the typed terminal event (OPERATOR_TRIP) within
/// the budget instead of a cut connection, haltd exits 0, and the ledger ends with a lifecycle
/// record saying how many streams it halted.
#[test]
fn sigterm_halts_open_streams() -> Result<()> {
    const STREAMS: usize = 3;
    let pair = NetPair::new()?;
    let mut haltd = Haltd::start(&pair, &["--builtin-token-interval-us", "2000"])?;
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
        o.halted_cleanly("OPERATOR_TRIP").with_context(|| {
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
    let records = haltd.ledger_records()?;
    verify_ledger(&haltd.ledger)?;
    let last = records.last().context("empty ledger")?;
    ensure!(
        last["kind"] == "lifecycle"
            && last["message"].as_str().is_some_and(
                |m| m.contains(&format!("{STREAMS} open streams halted, 0 still open"))
            ),
        "last record {last}"
    );
    ensure!(
        records
            .iter()
            .filter(|r| r["kind"] == "incident" && r["trip_cause"] == "OPERATOR_TRIP")
            .count()
            == STREAMS,
        "incidents: {records:?}"
    );
    Ok(())
}
