//! Issue 36 points 3 and 5: each per-scope limit holds under a burst.

use std::{
    io::{Read, Write},
    net::{Ipv4Addr, SocketAddr, TcpStream},
    time::Duration,
};

use anyhow::{ensure, Context, Result};
use haltd_tests::{connect_from, daemon, in_netns, sse, Haltd, NetPair};
use serde_json::Value;

use super::{ask, header, short, status_of, Answer};

/// Opens a long streaming turn from `src` and reads its head; the connection stays open
/// (the turn holds its place) until dropped. The status and `retry-after`.
fn open_long(src: Ipv4Addr, api: SocketAddr) -> Result<(u16, Option<String>, TcpStream)> {
    let body = sse::chat_body("hold a place", 2_000, true).to_string();
    let req = format!("POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{body}", body.len());
    let mut s = connect_from(src, api)?;
    s.write_all(req.as_bytes())?;
    s.set_read_timeout(Some(Duration::from_secs(10)))?;
    let mut head = Vec::new();
    let mut byte = [0u8; 1];
    while !head.ends_with(b"\r\n\r\n") {
        let n = s.read(&mut byte).context("reading a head")?;
        ensure!(n == 1, "closed before its head");
        head.push(byte[0]);
    }
    let head = String::from_utf8_lossy(&head).into_owned();
    Ok((status_of(&head), header(&head, "retry-after"), s))
}

/// Concurrency 3: 12 long turns opened at once from one address.
fn concurrency_burst(ns: &str, src: Ipv4Addr, api: SocketAddr) -> Result<()> {
    let opened = in_netns(ns, move || -> Result<Vec<(u16, Option<String>)>> {
        let open: Vec<(u16, Option<String>, TcpStream)> = (0..12)
            .map(|_| open_long(src, api))
            .collect::<Result<_>>()?;
        Ok(open.into_iter().map(|(s, r, _)| (s, r)).collect())
    })?;
    let ok = opened.iter().filter(|o| o.0 == 200).count();
    let limited: Vec<&(u16, Option<String>)> = opened.iter().filter(|o| o.0 == 429).collect();
    println!(
        "concurrency 3: burst of 12 open at once: {ok} admitted, {} got 429",
        limited.len()
    );
    ensure!(ok == 3 && limited.len() == 9, "{opened:?}");
    ensure!(
        limited.iter().all(|o| o.1.as_deref() == Some("1")),
        "{limited:?}"
    );
    Ok(())
}

/// Requests per minute 20: 30 short turns one after another from one address, then a
/// Messages request, answered in its own error shape.
fn requests_burst(ns: &str, src: Ipv4Addr, api: SocketAddr) -> Result<()> {
    let rpm = in_netns(ns, move || -> Result<Vec<Answer>> {
        (0..30)
            .map(|_| short(src, api, "/v1/chat/completions", &[]))
            .collect()
    })?;
    let ok = rpm.iter().filter(|a| a.status == 200).count();
    let limited: Vec<&Answer> = rpm.iter().filter(|a| a.status == 429).collect();
    println!(
        "requests per minute 20: burst of 30: {ok} admitted, {} got 429",
        limited.len()
    );
    ensure!(ok == 20 && limited.len() == 10, "{ok} admitted");
    for a in &limited {
        let secs: u64 = a.retry_after.as_deref().unwrap_or("").parse().unwrap_or(0);
        ensure!((1..=60).contains(&secs), "retry-after {:?}", a.retry_after);
        let v: Value = serde_json::from_str(&a.body).unwrap_or_default();
        ensure!(
            v["error"]["code"] == "rate_limit_exceeded" && v["error"]["type"] == "requests",
            "{}",
            a.body
        );
    }
    let body = serde_json::json!({"model": "builtin", "max_tokens": 3, "messages": [{"role": "user", "content": "hi"}]});
    let m = in_netns(ns, move || {
        ask(
            src,
            api,
            "/v1/messages",
            &[("anthropic-version", "2023-06-01")],
            &body,
        )
    })?;
    let v: Value = serde_json::from_str(&m.body).unwrap_or_default();
    ensure!(
        m.status == 429 && v["type"] == "error" && v["error"]["type"] == "rate_limit_error",
        "{} {}",
        m.status,
        m.body
    );
    Ok(())
}

/// Tokens per minute 1000: turns of 300 tokens one after another from one address.
fn tokens_burst(ns: &str, src: Ipv4Addr, api: SocketAddr) -> Result<()> {
    let tpm = in_netns(ns, move || -> Result<Vec<Answer>> {
        (0..8)
            .map(|_| {
                let mut body = sse::chat_body("count me", 300, false);
                body["ignore_eos"] = serde_json::json!(true);
                ask(src, api, "/v1/chat/completions", &[], &body)
            })
            .collect()
    })?;
    let ok: Vec<&Answer> = tpm.iter().filter(|a| a.status == 200).collect();
    let spent: u64 = ok
        .iter()
        .map(|a| {
            let v: Value = serde_json::from_str(&a.body).unwrap_or_default();
            v["usage"]["total_tokens"].as_u64().unwrap_or(0)
        })
        .sum();
    let refused = tpm.iter().filter(|a| a.status == 429).count();
    println!(
        "tokens per minute 1000: 8 turns of 300 tokens: {} admitted ({spent} tokens), {refused} got 429",
        ok.len()
    );
    ensure!(
        ok.len() == 4 && refused == 4 && spent >= 1000,
        "{} admitted, {spent} tokens, {refused} refused",
        ok.len()
    );
    Ok(())
}

/// Issue 36 points 3 and 5: each limit holds under a burst, from its own address (scope).
/// Prints the burst sizes and how many requests got 429.
#[test]
fn limits_hold_under_a_burst() -> Result<()> {
    let pair = NetPair::new()?;
    let addrs = [
        pair.add_client_addr(50)?,
        pair.add_client_addr(51)?,
        pair.add_client_addr(52)?,
    ];
    let haltd = Haltd::start(
        &pair,
        &[
            "--builtin-token-interval-us",
            "2000",
            "--limit-concurrency",
            "3",
            "--limit-requests-per-minute",
            "20",
            "--limit-tokens-per-minute",
            "1000",
            daemon::ADDR_SCOPED,
        ],
    )?;
    concurrency_burst(&pair.cli, addrs[0], haltd.api)?;
    requests_burst(&pair.cli, addrs[1], haltd.api)?;
    tokens_burst(&pair.cli, addrs[2], haltd.api)?;
    let url = format!("{}/admin/limits", haltd.admin_url());
    let shown = in_netns(&pair.cli, move || haltd_tests::get_json_here(&url))?;
    ensure!(
        shown["limits"]["concurrency"] == 3 && shown["per"] == "node",
        "{shown}"
    );
    let m = haltd.metrics()?;
    for (limit, want) in [
        ("concurrency", 9.0),
        ("requests_per_minute", 11.0),
        ("tokens_per_minute", 4.0),
    ] {
        let got = m
            .value("haltd_limit_refusals_total", &[("limit", limit)])
            .unwrap_or(-1.0);
        ensure!(got == want, "{limit}: {got}, want {want}");
    }
    Ok(())
}
