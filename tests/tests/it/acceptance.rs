//! Root-only acceptance tests for the points the scenario tests (`namespaces`) leave open:
//! refusing to start without the gate, `--no-kernel-gate` stated everywhere, the HaltMonitor on
//! real streams, the watchdog closing a blocked emitter, client disconnects, admin trip races,
//! the completions endpoint, ledger tampering, curl as a client, the whole daemon stopped, and
//! a crash (SIGKILL) keeping the ledger, slow clients (408), a full stream table (503) and a
//! shutdown that halts open streams cleanly.
//!
//! Each test runs haltd in its own [`NetPair`] and measures at the client namespace. They run
//! serially (`cargo xtask test` passes `--test-threads=1`): they share kernel state.
//!
//! By sub-topic (the numbers are the sections' in the files): `startup` (1, 2), `monitor` (3),
//! `watchdog` (4), `api` (5, 6, 7, 9), `ledger` (8, 11), `lifecycle` (10, 12, 13). The helpers
//! two of them use are here; the others are in their file.

use std::{
    fs,
    io::{BufRead, ErrorKind, Read, Write},
    net::{SocketAddr, TcpStream},
    path::Path,
    process::{Command, Stdio},
    thread,
    time::{Duration, Instant},
};

use anyhow::{anyhow, bail, ensure, Context, Result};
use haltd_tests::{
    agent, haltd_bin, in_netns,
    sse::{self, classify, SseParser},
    trip_here, verify_ledger, wait_for, EventKind, Haltd, NetPair, StreamOutcome, PORT_API,
    PORT_METRICS,
};
use serde_json::{json, Value};

mod api;
mod idle;
mod ledger;
mod lifecycle;
mod monitor;
mod startup;
mod watchdog;

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

/// `unix:<the ledger's directory>/admin.sock`: an admin socket of the test's own.
fn admin_socket_beside(ledger: &Path) -> String {
    let dir = ledger.parent().unwrap_or_else(|| Path::new("/tmp"));
    format!("unix:{}", dir.join("admin.sock").display())
}

/// A `haltd serve` that must refuse to start: (exit code, stdout + stderr, time to exit).
fn serve_refused(pair: &NetPair, ledger: &Path, extra: &[&str]) -> Result<(i32, String, Duration)> {
    let t = Instant::now();
    let mut child = Command::new("ip")
        .args(["netns", "exec", &pair.srv])
        .arg(haltd_bin()?)
        .arg("serve")
        .args(["--listen", &pair.srv_addr(PORT_API).to_string()])
        .arg("--admin")
        .arg(admin_socket_beside(ledger))
        .args(["--metrics", &pair.srv_addr(PORT_METRICS).to_string()])
        .arg("--ledger")
        .arg(ledger)
        .arg("--state-dir")
        .arg(haltd_tests::state_dir_for(ledger))
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
