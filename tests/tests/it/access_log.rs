//! The access log and the request metrics (issue 14, points 3 and 6): one line per request
//! with its ids, model, status, tokens, timings, outcome and halt code; `x-request-id` echoed
//! (a bad one replaced); upstream, a v4 UUID of haltd's as `x-request-id` (issue 29: backends
//! check its shape), the client's own id as `x-haltd-client-request-id`, the stream id and
//! `traceparent`; an upstream's empty 4xx named with those headers; the metrics that come
//! from the same summary; an access log file reopened on SIGHUP.

use std::{collections::BTreeMap, fs, net::SocketAddr, time::Duration};

use anyhow::{ensure, Context, Result};
use haltd_tests::{
    in_netns, raw_exchange, require_root,
    rig::{chat, Rig},
    sse, temp_dir, trip_here, wait_for, Haltd, NetPair, RawResponse,
};
use serde_json::{json, Value};

use crate::UPSTREAM_BIN;

const TRACEPARENT: &str = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";

/// `POST /v1/chat/completions` with `body` and extra header lines, on a connection of its
/// own, from `haltd`'s client namespace.
fn post_haltd(haltd: &Haltd, body: &Value, extra: &[&str]) -> Result<RawResponse> {
    let body = body.to_string();
    let mut request = format!(
        "POST /v1/chat/completions HTTP/1.1\r\nhost: haltd\r\ncontent-type: application/json\r\ncontent-length: {}\r\n",
        body.len()
    );
    for h in extra {
        request.push_str(h);
        request.push_str("\r\n");
    }
    request.push_str("\r\n");
    request.push_str(&body);
    let addr: SocketAddr = haltd.api;
    in_netns(&haltd.client_ns, move || {
        raw_exchange(addr, request.as_bytes(), Duration::from_secs(30))
    })
}

fn post_raw(rig: &Rig, body: &Value, extra: &[&str]) -> Result<RawResponse> {
    post_haltd(&rig.haltd, body, extra)
}

/// The access log lines haltd wrote so far (JSON log format), by request id.
fn access_lines(haltd: &Haltd) -> Result<BTreeMap<String, Value>> {
    let mut out = BTreeMap::new();
    for line in haltd.log_file("stderr.log")?.lines() {
        let Ok(v) = serde_json::from_str::<Value>(line) else {
            continue;
        };
        if v["target"] == "haltd::access" {
            let id = v["request_id"].as_str().context("request_id")?.to_owned();
            ensure!(
                out.insert(id.clone(), v).is_none(),
                "two lines for request {id}"
            );
        }
    }
    Ok(out)
}

/// Waits until the access log has a line for every id in `ids`; returns all lines.
fn wait_lines(haltd: &Haltd, ids: &[&str]) -> Result<BTreeMap<String, Value>> {
    wait_for(Duration::from_secs(10), "access log lines", || {
        let lines = access_lines(haltd)?;
        Ok(ids
            .iter()
            .all(|id| lines.contains_key(*id))
            .then_some(lines))
    })
}

/// The upstream's logged request that carried `stream_id`.
fn upstream_request(rig: &Rig, stream_id: &str) -> Result<Value> {
    wait_for(Duration::from_secs(10), "the upstream request", || {
        Ok(rig
            .up
            .requests()?
            .into_iter()
            .filter(|r| r.get("event").is_none())
            .find(|r| r["headers"]["x-haltd-stream-id"] == stream_id))
    })
}

fn is_generated_id(id: &str) -> bool {
    id.len() == 32 && id.bytes().all(|b| b.is_ascii_hexdigit())
}

/// A hyphenated v4 UUID (`xxxxxxxx-xxxx-4xxx-Vxxx-xxxxxxxxxxxx`, V one of 8, 9, a, b).
fn is_uuid_v4(id: &str) -> bool {
    let b = id.as_bytes();
    b.len() == 36
        && b.iter().enumerate().all(|(i, c)| match i {
            8 | 13 | 18 | 23 => *c == b'-',
            14 => *c == b'4',
            19 => matches!(c, b'8' | b'9' | b'a' | b'b'),
            _ => matches!(c, b'0'..=b'9' | b'a'..=b'f'),
        })
}

/// The stream id of a response.
fn stream_id(r: &RawResponse) -> Result<String> {
    Ok(r.header("x-haltd-stream-id")
        .context("stream id")?
        .to_owned())
}

/// A streamed turn with the client's id and trace context: both echoed and forwarded.
fn streamed_turn(rig: &Rig) -> Result<String> {
    let traceparent = format!("traceparent: {TRACEPARENT}");
    let r = post_raw(
        rig,
        &chat("[[script:normal tokens=4]]", true),
        &["x-request-id: client-req-1", &traceparent],
    )?;
    ensure!(r.status == 200, "{}", r.status);
    ensure!(r.header("x-request-id") == Some("client-req-1"));
    let id = stream_id(&r)?;
    let up = upstream_request(rig, &id)?;
    let sent = up["headers"]["x-request-id"].as_str().unwrap_or_default();
    ensure!(is_uuid_v4(sent), "upstream x-request-id {sent:?}: {up}");
    ensure!(
        up["headers"]["x-haltd-client-request-id"] == "client-req-1",
        "{up}"
    );
    ensure!(up["headers"]["traceparent"] == TRACEPARENT, "{up}");
    let line = wait_lines(&rig.haltd, &["client-req-1"])?;
    ensure!(
        line["client-req-1"]["upstream_request_id"] == sent,
        "the access log names the upstream's id: {}",
        line["client-req-1"]
    );
    Ok(id)
}

/// A batch turn with an id that is not visible ASCII, and a malformed traceparent: the id is
/// replaced (the same one at both ends), the traceparent is not passed on. Its 13 tokens
/// count as emitted. Returns the id haltd gave it.
fn batch_turn(rig: &Rig) -> Result<String> {
    let emitted = |m: &haltd_tests::Metrics| m.sum("haltd_tokens_emitted_total");
    let before = emitted(&rig.haltd.metrics()?);
    let r = post_raw(
        rig,
        &chat("[[script:normal tokens=13]]", false),
        &["x-request-id: has a space", "traceparent: 00-xyz"],
    )?;
    ensure!(r.status == 200, "{}", r.status);
    wait_for(Duration::from_secs(5), "the batch tokens counted", || {
        let after = emitted(&rig.haltd.metrics()?);
        ensure!(after - before <= 13.0, "+{} for 13 tokens", after - before);
        Ok((after - before == 13.0).then_some(()))
    })?;
    let id = r.header("x-request-id").context("batch id")?.to_owned();
    ensure!(is_generated_id(&id), "replaced id {id:?}");
    let up = upstream_request(rig, &stream_id(&r)?)?;
    let sent = up["headers"]["x-request-id"].as_str().unwrap_or_default();
    ensure!(is_uuid_v4(sent) && sent != id, "{up}");
    // The client sent no usable id: none of its own goes upstream.
    ensure!(
        up["headers"].get("x-haltd-client-request-id").is_none(),
        "{up}"
    );
    ensure!(up["headers"].get("traceparent").is_none(), "{up}");
    Ok(id)
}

/// An upstream that refuses a request with a 4xx and nothing in its body (llama-cpp-python
/// does so for an `x-request-id` that is not a UUID): the client's error names the status and
/// the headers haltd added.
fn empty_refusal(rig: &Rig) -> Result<()> {
    let r = post_raw(
        rig,
        &chat("[[script:status code=400 empty=1]]", false),
        &["x-request-id: empty-400"],
    )?;
    ensure!(r.status == 400, "{}", r.status);
    let v = r.json()?;
    let msg = v["error"]["message"].as_str().unwrap_or_default();
    ensure!(
        msg.contains("answered 400 with an empty body")
            && msg.contains("x-request-id")
            && msg.contains("x-haltd-client-request-id")
            && msg.contains("--upstream-request-id"),
        "{v}"
    );
    Ok(())
}

/// Refused by haltd (not a JSON object), and refused by the upstream (as for an unknown
/// model): both echo the id.
fn refused_requests(rig: &Rig) -> Result<()> {
    let bad = post_raw(rig, &json!("not an object"), &["x-request-id: bad-json-1"])?;
    ensure!(bad.status == 400, "{}", bad.status);
    ensure!(bad.header("x-request-id") == Some("bad-json-1"));
    let unknown = json!({"model": "no-such-model", "stream": false,
        "messages": [{"role": "user", "content": "[[script:status code=404]]"}]});
    let r = post_raw(rig, &unknown, &["x-request-id: unknown-model-1"])?;
    ensure!(r.status == 404, "{}", r.status);
    ensure!(r.header("x-request-id") == Some("unknown-model-1"));
    Ok(())
}

/// A streamed turn the operator trips with a detector's cause.
fn halted_turn(rig: &Rig) -> Result<()> {
    let url = rig.url("/v1/chat/completions");
    let admin = rig.haltd.admin_url();
    let halted = in_netns(&rig.haltd.client_ns, move || {
        let mut tripped = false;
        sse::stream_with(
            &url,
            &chat("[[script:normal tokens=200 pace_ms=20]]", true),
            &[("x-request-id", "halted-1")],
            Duration::from_secs(30),
            |p, _| {
                if !tripped && p.tokens >= 3 {
                    tripped = true;
                    let trip = format!("{admin}/admin/streams/{}/trip", p.stream_id);
                    if let Err(e) = trip_here(&trip, Some("EXFIL_ALERT")) {
                        eprintln!("trip failed: {e:#}");
                    }
                }
            },
        )
    })?;
    halted.halted_cleanly("EXFIL_ALERT")
}

/// The line of each request says what happened to it.
fn check_lines(lines: &BTreeMap<String, Value>, stream_id: &str, batch_id: &str) -> Result<()> {
    let s = &lines["client-req-1"];
    ensure!(
        s["stream_id"] == stream_id
            && s["model"] == "scripted"
            && s["endpoint"] == "chat"
            && s["status"] == 200
            && s["tokens"] == 4
            && s["outcome"] == "completed"
            && s["ttft_ms"].as_f64().is_some_and(|t| t > 0.0)
            && s["duration_ms"].as_f64() >= s["ttft_ms"].as_f64()
            && s["key"].as_str().is_some_and(|k| k.len() == 16)
            && s.get("halt_code").is_none(),
        "streamed: {s}"
    );
    let b = &lines[batch_id];
    ensure!(
        b["status"] == 200 && b["tokens"] == 13 && b["outcome"] == "completed",
        "batch: {b}"
    );
    let r = &lines["bad-json-1"];
    ensure!(
        r["status"] == 400 && r["outcome"] == "rejected" && r["tokens"] == 0,
        "refused: {r}"
    );
    let u = &lines["unknown-model-1"];
    ensure!(
        u["status"] == 404 && u["model"] == "no-such-model" && u["outcome"] == "upstream_failed",
        "upstream refused: {u}"
    );
    for (id, l) in lines.iter().filter(|(_, l)| l["endpoint"] == "health") {
        ensure!(
            l["outcome"] == "completed" && l["status"] == 200 && is_generated_id(id),
            "health check: {l}"
        );
    }
    let h = &lines["halted-1"];
    ensure!(
        h["outcome"] == "halted"
            && h["halt_code"] == "EXFIL_ALERT"
            && h["initiator"] == "operator"
            && h["status"] == 200
            && h["tokens"].as_u64().is_some_and(|t| t >= 3),
        "halted: {h}"
    );
    Ok(())
}

/// The metrics add up with the lines.
fn check_metrics(m: &haltd_tests::Metrics) -> Result<()> {
    let reqs = |model: &str, outcome: &str| {
        m.value_or_zero(
            "haltd_requests_total",
            &[("endpoint", "chat"), ("model", model), ("outcome", outcome)],
        )
    };
    ensure!(reqs("scripted", "completed")? == 2.0);
    ensure!(reqs("scripted", "halted")? == 1.0);
    ensure!(
        reqs("other", "upstream_failed")? == 1.0,
        "an unknown name is other"
    );
    ensure!(reqs("none", "rejected")? == 1.0);
    for (reason, want) in [("upstream_refused", 1.0), ("invalid_request", 1.0)] {
        let n = m.value("haltd_client_errors_total", &[("reason", reason)])?;
        ensure!(
            n == want,
            "haltd_client_errors_total{{reason={reason}}} {n}"
        );
    }
    let http_status =
        m.value_or_zero("haltd_upstream_failures_total", &[("kind", "http_status")])?;
    ensure!(
        http_status == 0.0,
        "a client's 404 is no upstream failure: {http_status}"
    );
    // The operator gave a detector's cause: the initiator tells them apart.
    let trips = |initiator: &str| {
        m.value_or_zero(
            "haltd_watchdog_trips_total",
            &[("cause", "EXFIL_ALERT"), ("initiator", initiator)],
        )
    };
    ensure!(trips("operator")? == 1.0 && trips("detector")? == 0.0);
    for family in [
        "haltd_time_to_first_token_seconds",
        "haltd_request_duration_seconds",
        "haltd_inter_token_latency_seconds",
    ] {
        let n = m.histogram_count(family)?;
        ensure!(n >= 3.0, "{family}_count {n}");
    }
    Ok(())
}

/// Streamed, batch, refused, upstream-refused and halted requests through a proxying haltd:
/// headers at both ends, one access log line each, and metrics that add up.
#[test]
fn every_request_leaves_one_line_and_its_ids_reach_both_ends() -> Result<()> {
    require_root()?;
    let rig = Rig::start(
        UPSTREAM_BIN,
        &["--log-format", "json", "--metric-models", "scripted"],
    )?;
    let stream_id = streamed_turn(&rig)?;
    let batch_id = batch_turn(&rig)?;
    refused_requests(&rig)?;
    halted_turn(&rig)?;
    let ids = [
        "client-req-1",
        batch_id.as_str(),
        "bad-json-1",
        "unknown-model-1",
        "halted-1",
    ];
    let lines = wait_lines(&rig.haltd, &ids)?;
    check_lines(&lines, &stream_id, &batch_id)?;
    check_metrics(&rig.haltd.metrics()?)?;
    // Last, so that the counts above stay as they were.
    empty_refusal(&rig)
}

/// `--access-log FILE`: JSON Lines, and SIGHUP reopens the file after it was moved away.
#[test]
fn an_access_log_file_is_reopened_on_sighup() -> Result<()> {
    require_root()?;
    let dir = temp_dir("access-log")?;
    let file = dir.join("access.log");
    let pair = NetPair::new()?;
    let arg = file.to_str().context("utf-8 path")?.to_owned();
    let mut haltd = Haltd::start(&pair, &["--access-log", &arg])?;
    let turn = |id: &str| -> Result<u16> {
        let body = sse::chat_body("access", 3, false);
        let header = format!("x-request-id: {id}");
        Ok(post_haltd(&haltd, &body, &[header.as_str()])?.status)
    };
    ensure!(turn("before-rotate")? == 200);
    let rotated = dir.join("access.log.1");
    wait_for(Duration::from_secs(5), "the first line", || {
        Ok(fs::read_to_string(&file)
            .is_ok_and(|t| t.contains("before-rotate"))
            .then_some(()))
    })?;
    fs::rename(&file, &rotated)?;
    let pid = libc::pid_t::try_from(haltd.pid().context("haltd is not running")?)?;
    // SAFETY: kill(2) on the haltd child this test started and has not reaped.
    let signalled = unsafe { libc::kill(pid, libc::SIGHUP) };
    ensure!(signalled == 0, "kill(SIGHUP)");
    let record = wait_for(Duration::from_secs(5), "the SIGHUP record", || {
        Ok(haltd.ledger_records()?.into_iter().find(|r| {
            r["message"]
                .as_str()
                .is_some_and(|m| m.contains("access log"))
        }))
    })?;
    ensure!(
        record["message"]
            .as_str()
            .is_some_and(|m| m.contains("reopened")),
        "{record}"
    );
    ensure!(turn("after-rotate")? == 200);
    let new = wait_for(
        Duration::from_secs(5),
        "the line after the rotation",
        || {
            Ok(fs::read_to_string(&file)
                .ok()
                .filter(|t| t.contains("after-rotate")))
        },
    )?;
    // The turns' lines (the start-up's health checks have theirs too).
    let chats = |text: &str| -> Result<Vec<Value>> {
        let mut out = Vec::new();
        for l in text.lines() {
            let v: Value = serde_json::from_str(l).with_context(|| format!("not JSON: {l}"))?;
            if v["endpoint"] == "chat" {
                out.push(v);
            }
        }
        Ok(out)
    };
    let (old, new) = (chats(&fs::read_to_string(&rotated)?)?, chats(&new)?);
    ensure!(old.len() == 1 && new.len() == 1, "{old:?}\n{new:?}");
    ensure!(old[0]["request_id"] == "before-rotate", "{}", old[0]);
    let line = &new[0];
    ensure!(
        line["request_id"] == "after-rotate"
            && line["tokens"] == 3
            && line["model"] == "builtin"
            && line["timestamp"].is_string(),
        "{line}"
    );
    // The text log has the reopen, and no access line (target `haltd::access`).
    let stderr = haltd.log_file("stderr.log")?;
    ensure!(
        stderr.contains("access log reopened on SIGHUP") && !stderr.contains("haltd::access: "),
        "{stderr}"
    );
    haltd.stop()?;
    Ok(())
}
