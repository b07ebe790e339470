//! `/readyz` follows the upstream (`daemon/src/upstream_watch.rs`, `dataplane/conn/readiness.rs`):
//! its probe makes haltd not ready after `--upstream-probe-failures` failures in a row and
//! ready again after `--upstream-probe-successes` successes, and a host name that does not
//! resolve at start is retried (haltd starts, not ready, and turns get a precise 503) until it
//! resolves.

use std::{
    fs,
    time::{Duration, Instant},
};

use anyhow::{ensure, Context, Result};
use haltd_tests::{
    in_netns, raw_exchange, require_root,
    rig::{chat, Rig},
    wait_for, Haltd, NetPair, RawResponse, ScriptedUpstream, PORT_UPSTREAM,
};
use serde_json::Value;

use crate::UPSTREAM_BIN;

/// `/readyz`: its status and JSON body.
/// One raw request to haltd's API from the client namespace.
fn exchange(haltd: &Haltd, request: &'static [u8], timeout: Duration) -> Result<RawResponse> {
    let addr = haltd.api;
    in_netns(&haltd.client_ns, move || {
        raw_exchange(addr, request, timeout)
    })
}

fn readyz(haltd: &Haltd) -> Result<(u16, Value)> {
    let r = exchange(
        haltd,
        b"GET /readyz HTTP/1.1\r\nhost: haltd\r\n\r\n",
        Duration::from_secs(5),
    )?;
    let body = serde_json::from_slice(&r.body).context("the /readyz body is JSON")?;
    Ok((r.status, body))
}

/// Polls `/readyz` (every 20 ms, at most `timeout`) until it answers `status`; every answer on
/// the way goes through `check`. Returns the body with `status`.
fn wait_readyz(
    haltd: &Haltd,
    status: u16,
    timeout: Duration,
    mut check: impl FnMut(u16, &Value) -> Result<()>,
) -> Result<Value> {
    let deadline = Instant::now() + timeout;
    loop {
        let (s, body) = readyz(haltd)?;
        check(s, &body)?;
        if s == status {
            return Ok(body);
        }
        ensure!(
            Instant::now() < deadline,
            "/readyz did not turn {status} within {timeout:?}; last {s}: {body}"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Probe every 100 ms; the defaults' thresholds (down after 2 failures, up after 1 success).
const PROBE: [&str; 2] = ["--upstream-probe-interval-ms", "100"];

#[test]
fn readyz_turns_503_after_two_failed_probes_and_200_after_one_success() -> Result<()> {
    require_root()?;
    let rig = Rig::start(UPSTREAM_BIN, &PROBE)?;
    let ready = wait_readyz(&rig.haltd, 200, Duration::from_secs(5), |_, _| Ok(()))?;
    let up = &ready["checks"]["upstream"];
    ensure!(
        up["ok"] == true && up["probing"] == true && up["models"] == 1,
        "{ready}"
    );
    let m = rig.haltd.metrics()?;
    ensure!(
        m.value("haltd_upstream_up", &[])? == 1.0,
        "haltd_upstream_up"
    );

    let Rig {
        haltd, up, pair, ..
    } = rig;
    drop(up);
    // Not ready only once two probes in a row failed; each 503 names the upstream and why.
    let down = wait_readyz(&haltd, 503, Duration::from_secs(5), |s, body| {
        let fails = body["checks"]["upstream"]["consecutive_failures"]
            .as_u64()
            .unwrap_or(0);
        ensure!(
            (s == 503) == (fails >= 2),
            "/readyz {s} after {fails} failed probes: {body}"
        );
        Ok(())
    })?;
    let upstream = &down["checks"]["upstream"];
    ensure!(
        down["reasons"] == serde_json::json!(["upstream_down"])
            && upstream["ok"] == false
            && upstream["upstream"] == format!("127.0.0.1:{PORT_UPSTREAM}")
            && upstream["last_error"]
                .as_str()
                .is_some_and(|e| e.contains("refused")),
        "{down}"
    );
    println!("/readyz with the upstream killed: 503 {down}");
    let m = haltd.metrics()?;
    ensure!(
        m.value("haltd_upstream_up", &[])? == 0.0
            && m.value("haltd_upstream_probe_failures_total", &[])? >= 2.0,
        "metrics after the upstream died"
    );

    let up = ScriptedUpstream::start(&pair, UPSTREAM_BIN, &[])?;
    let back = wait_readyz(&haltd, 200, Duration::from_secs(5), |_, _| Ok(()))?;
    ensure!(
        back["status"] == "ready" && back["checks"]["upstream"]["consecutive_successes"] == 1,
        "{back}"
    );
    println!("/readyz with the upstream back: 200 {back}");
    let rig = Rig {
        haltd,
        up,
        pair,
        config_dir: None,
    };
    let (status, _, body) = rig.post("/v1/chat/completions", &chat("hello", false), None)?;
    ensure!(status == 200, "a turn once ready again: {status} {body}");
    // The probe's model list names the metrics' model labels: the upstream's own model is
    // counted under its name, not as `other`.
    let labels = [("endpoint", "chat"), ("model", "scripted")];
    let deadline = Instant::now() + Duration::from_secs(5);
    while rig
        .haltd
        .metrics()?
        .value_or_zero("haltd_requests_total", &labels)?
        < 1.0
    {
        ensure!(
            Instant::now() < deadline,
            "no haltd_requests_total{{model=\"scripted\"}} after the turn: the probe's model list \
             did not reach the metric labels"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    Ok(())
}

/// A line in /etc/hosts that this test adds, removed on drop.
struct HostsLine {
    line: String,
}

const HOSTS: &str = "/etc/hosts";

impl HostsLine {
    fn add(line: String) -> Result<Self> {
        let mut text = fs::read_to_string(HOSTS)?;
        if !text.is_empty() && !text.ends_with('\n') {
            text.push('\n');
        }
        text.push_str(&line);
        text.push('\n');
        fs::write(HOSTS, text)?;
        Ok(HostsLine { line })
    }
}

impl Drop for HostsLine {
    fn drop(&mut self) {
        if let Ok(text) = fs::read_to_string(HOSTS) {
            let kept: String = text
                .lines()
                .filter(|l| *l != self.line)
                .map(|l| format!("{l}\n"))
                .collect();
            let _ = fs::write(HOSTS, kept);
        }
    }
}

#[test]
fn a_name_that_does_not_resolve_at_start_is_retried_until_it_does() -> Result<()> {
    require_root()?;
    let pair = NetPair::new()?;
    let up = ScriptedUpstream::start(&pair, UPSTREAM_BIN, &[])?;
    // A name nobody else uses, in no DNS: only the line this test adds makes it resolve.
    let name = format!("haltd-t-{}-upstream.test", std::process::id());
    let url = format!("http://{name}:{PORT_UPSTREAM}");
    let haltd = Haltd::start(
        &pair,
        &["--source", "openai", "--upstream", &url, PROBE[0], PROBE[1]],
    )?;
    let (status, body) = readyz(&haltd)?;
    ensure!(
        status == 503
            && body["reasons"] == serde_json::json!(["upstream_unresolved"])
            && body["checks"]["upstream"]["resolve_error"]
                .as_str()
                .is_some_and(|e| e.contains(&name)),
        "{status} {body}"
    );
    println!("/readyz before the name resolves: {status} {body}");
    let turn = exchange(
        &haltd,
        b"POST /v1/chat/completions HTTP/1.1\r\nhost: haltd\r\ncontent-type: application/json\r\ncontent-length: 63\r\n\r\n{\"model\":\"scripted\",\"messages\":[{\"role\":\"user\",\"content\":\"x\"}]}",
        Duration::from_secs(10),
    )?;
    let text = String::from_utf8_lossy(&turn.body);
    ensure!(
        turn.status == 503 && text.contains("upstream_unresolved") && text.contains(&name),
        "a turn before the name resolves: {} {text}",
        turn.status
    );
    ensure!(
        haltd
            .log_tail(200)
            .contains("cannot resolve the upstream's host name; retrying"),
        "no retry logged:\n{}",
        haltd.log_tail(40)
    );

    let hosts = HostsLine::add(format!("127.0.0.1 {name}"))?;
    // The backoff grows to 5 s between attempts.
    let ready = wait_readyz(&haltd, 200, Duration::from_secs(15), |_, _| Ok(()))?;
    ensure!(
        ready["checks"]["upstream"]["addresses"]
            == serde_json::json!([format!("127.0.0.1:{PORT_UPSTREAM}")]),
        "{ready}"
    );
    println!("/readyz once the name resolves: 200 {ready}");
    let rig = Rig {
        haltd,
        up,
        pair,
        config_dir: None,
    };
    let (status, _, body) = rig.post("/v1/chat/completions", &chat("hello", false), None)?;
    ensure!(
        status == 200,
        "a turn once the name resolves: {status} {body}"
    );
    drop(hosts);
    wait_for(Duration::from_secs(1), "the hosts line removed", || {
        Ok((!fs::read_to_string(HOSTS)?.contains(&name)).then_some(()))
    })?;
    Ok(())
}
