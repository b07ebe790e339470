//! The halt holds whatever the process does (issue 10), end to end on a running haltd:
//!
//! * **One clock**: haltd in a time namespace whose `CLOCK_MONOTONIC` is far ahead of, or
//!   behind, the kernel's (`unshare -T --monotonic N`). Ahead, a daemon stopped past the
//!   heartbeat deadline is still cut by the kernel within B tokens, with an emitter that
//!   ignores the halt; behind, healthy streams run to their end and `/healthz` reports the
//!   heartbeat age the kernel sees.
//! * **Half-closed clients**: requests whose client shuts its write side right after sending
//!   are governed and served in full, and halt within B when tripped; a proxied turn that
//!   waits on its upstream still serves a client that half-closed.
use std::{
    io::{Read, Write},
    net::{Shutdown, SocketAddr, TcpStream},
    thread,
    time::{Duration, Instant},
};

use anyhow::{bail, ensure, Context, Result};
use haltd_tests::{
    get_json_here, in_netns, spawn_in_netns,
    sse::{self, chat_body, EventKind, SseParser},
    trip_here, Haltd, NetPair, ScriptedUpstream,
};
use serde_json::Value;

const BUDGET: usize = 5;

/// A streaming chat request for the built-in source that generates exactly `max_tokens`.
fn long_chat(max_tokens: u32) -> Value {
    let mut body = chat_body("Tell me about rivers", max_tokens, true);
    body["ignore_eos"] = true.into();
    body
}

fn signal(pid: u32, sig: i32) -> Result<()> {
    // SAFETY: kill(2) with a pid we started and a valid signal number.
    let rc = unsafe { libc::kill(pid as i32, sig) };
    ensure!(
        rc == 0,
        "kill({pid}, {sig}): {}",
        std::io::Error::last_os_error()
    );
    Ok(())
}

fn healthz(haltd: &Haltd) -> Result<Value> {
    let url = format!("{}/healthz", haltd.api_url());
    in_netns(&haltd.client_ns, move || get_json_here(&url))
}

/// Seconds since boot: a negative monotonic offset may not take the namespace's clock below 0.
fn uptime_s() -> Result<f64> {
    let text = std::fs::read_to_string("/proc/uptime")?;
    text.split_whitespace()
        .next()
        .context("empty /proc/uptime")?
        .parse()
        .context("parsing /proc/uptime")
}

/// Ahead by 10^5 s: the heartbeat userspace would have written sat in the kernel's future.
/// haltd is stopped for 600 ms mid-stream (deadline 200 ms) with an emitter that ignores the
/// halt, so only the kernel can stop it after the resume.
#[test]
fn time_namespace_ahead_still_fails_closed() -> Result<()> {
    let pair = NetPair::new()?;
    let haltd = Haltd::start_wrapped(
        &pair,
        None,
        &["unshare", "-T", "--monotonic", "100000"],
        &[
            "--budget",
            &BUDGET.to_string(),
            "--fault",
            "emitter-ignores-halt",
            "--builtin-token-interval-us",
            "1000",
            "--heartbeat-deadline-ms",
            "200",
        ],
    )?;
    let h = healthz(&haltd)?;
    ensure!(
        h["status"] == "ok" && h["heartbeat_clock"] == "kernel",
        "{h}"
    );
    ensure!(
        h["heartbeat_age_ms"].as_f64().is_some_and(|a| a < 200.0),
        "{h}"
    );
    let pid = haltd.pid().context("haltd pid")?;
    let url = format!("{}/v1/chat/completions", haltd.api_url());
    // Stopped and resumed from another thread, so the client keeps reading during the stop
    // and everything sent before it has arrived by the resume.
    let resumed_at = std::sync::Arc::new(std::sync::Mutex::new(None::<Instant>));
    let resumed = std::sync::Arc::clone(&resumed_at);
    let client = spawn_in_netns(&haltd.client_ns, move || {
        let mut stopper = None;
        sse::stream(
            &url,
            &long_chat(100_000),
            Duration::from_secs(30),
            |p, _| {
                if p.tokens == 50 && stopper.is_none() {
                    let resumed = std::sync::Arc::clone(&resumed);
                    stopper = Some(thread::spawn(move || {
                        let _ = signal(pid, libc::SIGSTOP);
                        thread::sleep(Duration::from_millis(600));
                        let _ = signal(pid, libc::SIGCONT);
                        *resumed.lock().expect("not poisoned") = Some(Instant::now());
                    }));
                }
            },
        )
    });
    let outcome = client
        .join()
        .map_err(|_| anyhow::anyhow!("client panicked"))??;
    let resumed_at = resumed_at
        .lock()
        .map_err(|_| anyhow::anyhow!("poisoned"))?
        .context("the stream never reached 50 tokens")?;
    let after = outcome
        .events
        .iter()
        .filter(|e| matches!(e.kind, EventKind::Token(_)) && e.at > resumed_at)
        .count();
    println!(
        "time namespace +100000 s: {} tokens, {after} after haltd resumed from a 600 ms SIGSTOP (deadline 200 ms, B = {BUDGET}, emitter ignores the halt), error {:?}",
        outcome.tokens, outcome.error
    );
    ensure!(
        after <= BUDGET,
        "{after} tokens reached the client after haltd resumed past the deadline (B = {BUDGET})\n{}",
        haltd.log_tail(30)
    );
    ensure!(outcome.tokens < 100_000, "the stream was never halted");
    Ok(())
}

/// Behind by up to 600 s: a heartbeat in the kernel's past made every stream look stale.
#[test]
fn time_namespace_behind_serves_healthy_streams() -> Result<()> {
    let offset = (uptime_s()? - 60.0).clamp(30.0, 600.0) as i64;
    let pair = NetPair::new()?;
    let haltd = Haltd::start_wrapped(
        &pair,
        None,
        &["unshare", "-T", "--monotonic", &format!("-{offset}")],
        &["--builtin-token-interval-us", "1000"],
    )?;
    let url = format!("{}/v1/chat/completions", haltd.api_url());
    for i in 0..3 {
        let url = url.clone();
        let out = in_netns(&haltd.client_ns, move || {
            sse::stream(&url, &long_chat(200), Duration::from_secs(30), |_, _| {})
        })?;
        ensure!(
            out.error.is_none() && out.done_at.is_some() && out.tokens == 200,
            "stream {i} under a clock {offset} s behind: {} tokens, error {:?}\n{}",
            out.tokens,
            out.error,
            haltd.log_tail(20)
        );
    }
    let h = healthz(&haltd)?;
    println!("time namespace -{offset} s: 3 streams of 200 tokens completed; /healthz {h}");
    ensure!(
        h["status"] == "ok" && h["heartbeat_clock"] == "kernel",
        "{h}"
    );
    ensure!(
        h["heartbeat_age_ms"].as_f64().is_some_and(|a| a < 200.0),
        "{h}"
    );
    let records = haltd.ledger_records()?;
    ensure!(
        !records.iter().any(|r| r["trip_cause"] == "HEARTBEAT_LOST"),
        "a stream was halted for a lost heartbeat"
    );
    Ok(())
}

/// What a half-closing client read.
#[derive(Debug, Default)]
struct HalfClosed {
    status: u16,
    stream_id: String,
    interim: usize,
    tokens: usize,
    done: bool,
    error: Option<Value>,
}

/// Sends `body`, shuts the write side, reads the whole response. `on_token` sees each token
/// count as it arrives (to trip a stream mid-way).
fn half_closed_request(
    addr: SocketAddr,
    path: &str,
    body: &Value,
    mut on_token: impl FnMut(&str, usize),
) -> Result<HalfClosed> {
    let body = body.to_string();
    let mut s = TcpStream::connect(addr)?;
    s.set_read_timeout(Some(Duration::from_secs(20)))?;
    write!(
        s,
        "POST {path} HTTP/1.1\r\nhost: x\r\n{}\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{body}",
        sse::auth_lines(&sse::fresh_key()),
        body.len()
    )?;
    s.shutdown(Shutdown::Write)?;
    let mut raw = Vec::new();
    let mut out = HalfClosed::default();
    let mut parser = SseParser::default();
    let mut head_done = false;
    let mut buf = [0u8; 8192];
    loop {
        let n = s.read(&mut buf).context("reading the response")?;
        if n == 0 {
            break;
        }
        if head_done {
            feed(&mut parser, &buf[..n], &mut out, &mut on_token);
            continue;
        }
        raw.extend_from_slice(&buf[..n]);
        // Interim responses first, then the final head.
        while let Some(end) = find(&raw, b"\r\n\r\n") {
            let head = String::from_utf8_lossy(&raw[..end]).into_owned();
            let rest = raw[end + 4..].to_vec();
            let status: u16 = head
                .split_whitespace()
                .nth(1)
                .and_then(|s| s.parse().ok())
                .context("status line")?;
            if (100..200).contains(&status) {
                out.interim += 1;
                raw = rest;
                continue;
            }
            out.status = status;
            out.stream_id = head
                .lines()
                .find_map(|l| l.strip_prefix("x-haltd-stream-id: "))
                .unwrap_or_default()
                .to_owned();
            head_done = true;
            feed(&mut parser, &rest, &mut out, &mut on_token);
            raw.clear();
            break;
        }
    }
    Ok(out)
}

fn find(hay: &[u8], needle: &[u8]) -> Option<usize> {
    hay.windows(needle.len()).position(|w| w == needle)
}

fn feed(
    parser: &mut SseParser,
    bytes: &[u8],
    out: &mut HalfClosed,
    on_token: &mut impl FnMut(&str, usize),
) {
    for (_, data) in parser.feed(bytes) {
        match sse::classify(&data) {
            EventKind::Token(_) => {
                out.tokens += 1;
                on_token(&out.stream_id, out.tokens);
            }
            EventKind::Done => out.done = true,
            EventKind::Error(e) => out.error = Some(e),
            _ => {}
        }
    }
}

/// Half-closed requests served in full by `half_closed_clients_are_served_and_halted`.
const HALF_CLOSED_SERVED: usize = 200;
/// Half-closed requests it trips mid-stream.
const HALF_CLOSED_TRIPPED: usize = 20;
/// Tokens each served request asks for.
const HALF_CLOSED_TOKENS: usize = 20;

/// 200 requests that half-close right after sending are answered in full; 20 more are tripped
/// mid-stream and halt within B. None is refused for its TCP state.
#[test]
fn half_closed_clients_are_served_and_halted() -> Result<()> {
    let pair = NetPair::new()?;
    serve_half_closed(&pair)?;
    // Tripped: paced streams, tripped by the operator after 3 tokens.
    let haltd = Haltd::start(
        &pair,
        &[
            "--builtin-token-interval-us",
            "20000",
            "--budget",
            &BUDGET.to_string(),
        ],
    )?;
    let post_trip = trip_half_closed(&haltd)?;
    let m = haltd.metrics()?;
    let refused = m.value_or_zero("haltd_ungovernable_connections_total", &[])?;
    println!(
        "half-closed clients: {HALF_CLOSED_SERVED} served in full, {HALF_CLOSED_TRIPPED} tripped with post-trip tokens {post_trip:?} (B = {BUDGET}); refused as ungovernable: {refused}"
    );
    ensure!(
        refused == 0.0,
        "{refused} connections refused as ungovernable"
    );
    Ok(())
}

/// HALF_CLOSED_SERVED requests that half-close right after sending, on 8 client threads,
/// each answered in full.
fn serve_half_closed(pair: &NetPair) -> Result<()> {
    let haltd = Haltd::start(pair, &["--builtin-token-interval-us", "0"])?;
    let addr = haltd.api;
    let body = long_chat(HALF_CLOSED_TOKENS as u32);
    let served: Vec<Result<HalfClosed>> = thread::scope(|s| {
        let workers: Vec<_> = (0..8)
            .map(|w| {
                let (body, ns) = (&body, &haltd.client_ns);
                s.spawn(move || {
                    in_netns(ns, || {
                        (w..HALF_CLOSED_SERVED)
                            .step_by(8)
                            .map(|_| {
                                half_closed_request(addr, "/v1/chat/completions", body, |_, _| {})
                            })
                            .collect::<Vec<_>>()
                    })
                })
            })
            .collect();
        workers
            .into_iter()
            .flat_map(|w| w.join().unwrap_or_default())
            .collect()
    });
    ensure!(
        served.len() == HALF_CLOSED_SERVED,
        "{} of {HALF_CLOSED_SERVED} clients finished",
        served.len()
    );
    for (i, r) in served.iter().enumerate() {
        let r = r
            .as_ref()
            .map_err(|e| anyhow::anyhow!("{e:#}"))
            .with_context(|| format!("request {i}"))?;
        ensure!(
            r.status == 200 && r.tokens == HALF_CLOSED_TOKENS && r.done && r.error.is_none(),
            "half-closed request {i} not served in full: {r:?}"
        );
    }

    Ok(())
}

/// HALF_CLOSED_TRIPPED half-closed requests, each tripped by the operator after 3 tokens:
/// each ends in its halt event with at most B tokens past the trip. Returns those counts.
fn trip_half_closed(haltd: &Haltd) -> Result<Vec<usize>> {
    let admin = haltd.admin_url();
    let addr = haltd.api;
    let body = long_chat(1000);
    let ns = haltd.client_ns.clone();
    let tripped: Vec<Result<HalfClosed>> = (0..HALF_CLOSED_TRIPPED)
        .map(|_| {
            let (admin, body) = (admin.clone(), body.clone());
            spawn_in_netns(&ns, move || {
                half_closed_request(addr, "/v1/chat/completions", &body, |id, n| {
                    if n == 3 {
                        let _ = trip_here(&format!("{admin}/admin/streams/{id}/trip"), None);
                    }
                })
            })
        })
        .collect::<Vec<_>>()
        .into_iter()
        .map(|h| {
            h.join()
                .unwrap_or_else(|_| Err(anyhow::anyhow!("client panicked")))
        })
        .collect();
    let mut post_trip = Vec::new();
    for (i, r) in tripped.iter().enumerate() {
        let r = r
            .as_ref()
            .map_err(|e| anyhow::anyhow!("{e:#}"))
            .with_context(|| format!("tripped request {i}"))?;
        let err = r
            .error
            .as_ref()
            .with_context(|| format!("tripped request {i} has no halt event: {r:?}"))?;
        ensure!(
            err["type"] == "halted" && err["code"] == "OPERATOR_TRIP",
            "{err}"
        );
        let tau = err["trip_token_index"]
            .as_u64()
            .context("trip_token_index")? as usize;
        let after = r.tokens.saturating_sub(tau);
        ensure!(
            after <= BUDGET,
            "tripped request {i}: {after} tokens after the trip (B = {BUDGET}): {r:?}"
        );
        post_trip.push(after);
    }
    Ok(post_trip)
}

/// A proxied turn whose client half-closed while haltd waits on the upstream: haltd probes with
/// an interim `100 Continue` (a client that closed for good would answer it with a reset) and
/// serves the half-closed client in full.
#[test]
fn proxied_half_closed_client_is_served() -> Result<()> {
    let pair = NetPair::new()?;
    let up = ScriptedUpstream::start(&pair, crate::UPSTREAM_BIN, &[])?;
    let haltd = Haltd::start(
        &pair,
        &["--source", "openai", "--upstream", up.url.as_str()],
    )?;
    let addr = haltd.api;
    let body = serde_json::json!({
        "model": "scripted",
        "stream": true,
        "messages": [{"role": "user", "content": "[[script:slow_head head_ms=300]]"}],
    });
    for i in 0..5 {
        let body = body.clone();
        let r = in_netns(&haltd.client_ns, move || {
            half_closed_request(addr, "/v1/chat/completions", &body, |_, _| {})
        })?;
        if !(r.status == 200 && r.done && r.tokens > 0 && r.error.is_none()) {
            bail!(
                "proxied half-closed request {i}: {r:?}\n{}",
                haltd.log_tail(20)
            );
        }
        ensure!(
            r.interim == 1,
            "request {i}: expected one interim 100 Continue, got {}",
            r.interim
        );
    }
    println!("proxied half-closed clients: 5 served in full after a 300 ms upstream head, each with one interim 100 Continue");
    Ok(())
}

/// The gate loads, verifies, attaches and passes its self-test with the privileges the systemd
/// unit gives haltd: an unprivileged user (65534) with CAP_BPF and CAP_NET_ADMIN alone, in a
/// cgroup it owns (the unit's `Delegate=yes`). This is what catches a program the verifier
/// accepts only with CAP_PERFMON or root (e.g. pointer arithmetic at a variable offset).
#[test]
fn the_gate_loads_with_the_units_privileges() -> Result<()> {
    haltd_tests::require_root()?;
    let dir = haltd_tests::temp_dir("unprivileged")?;
    let bin = dir.join("haltd");
    std::fs::copy(haltd_tests::haltd_bin()?, &bin)?;
    let object = dir.join("gate.o");
    let src = std::env::var_os("HALTD_BPF_OBJECT").context("HALTD_BPF_OBJECT is not set")?;
    std::fs::copy(src, &object)?;
    use std::os::unix::fs::PermissionsExt;
    for (p, mode) in [(&dir, 0o755), (&bin, 0o755), (&object, 0o644)] {
        std::fs::set_permissions(p, std::fs::Permissions::from_mode(mode))?;
    }
    // A cgroup owned by the unprivileged user, as systemd delegates the unit's.
    let mount = haltd_tests::gate::cgroup2_mount()?;
    let cg = mount.join(format!("haltd-test-deleg-{}", std::process::id()));
    std::fs::create_dir_all(&cg)?;
    let chown = std::process::Command::new("chown")
        .args(["-R", "65534:65534"])
        .arg(&cg)
        .status()?;
    ensure!(chown.success(), "chown of {} failed", cg.display());
    let script = format!(
        "echo $$ > {}/cgroup.procs && exec setpriv --reuid 65534 --regid 65534 --clear-groups \
         --inh-caps -all,+bpf,+net_admin --ambient-caps -all,+bpf,+net_admin --bounding-set -all,+bpf,+net_admin \
         {} check-gate --bpf-object {}",
        cg.display(),
        bin.display(),
        object.display()
    );
    let out = std::process::Command::new("sh")
        .args(["-c", &script])
        .output()?;
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    // The leaf haltd made is empty once it exited; remove it, then our cgroup.
    if let Ok(entries) = std::fs::read_dir(&cg) {
        for e in entries.flatten() {
            if e.file_name().to_string_lossy().starts_with("haltd.") {
                let _ = std::fs::remove_dir(e.path());
            }
        }
    }
    let _ = std::fs::remove_dir(&cg);
    let _ = std::fs::remove_dir_all(&dir);
    let last: Vec<&str> = text.lines().rev().take(6).collect();
    println!(
        "unprivileged check-gate: {}",
        last.first().copied().unwrap_or("")
    );
    ensure!(
        out.status.success() && text.contains("self-tested"),
        "the gate did not load as uid 65534 with CAP_BPF + CAP_NET_ADMIN ({}):\n{}",
        out.status,
        last.into_iter().rev().collect::<Vec<_>>().join("\n")
    );
    Ok(())
}
