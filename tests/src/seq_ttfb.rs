//! The unloaded time to first byte of an OpenAI-compatible route: one request at a time, a
//! new client connection per request (a plain client, as issue 11 measured it), the time from
//! the request's write to the first response byte. Sequential requests show what a proxy adds
//! before a response begins (its connect to the upstream, its parse and forward) without the
//! queueing of a loaded run.
//!
//! [`keepalive_probe`] compares, on one route in one run, a request on a new client connection
//! with one on a kept connection (HTTP keep-alive, `connection: keep-alive` on both);
//! [`keepalive_probe_over`] does the same in TLS (haltd with `--tls-cert`), where a new
//! connection also pays the handshake.
//!
//! [`probe_apis`] takes each route's API: chat, or the Anthropic Messages API or the OpenAI
//! Responses API that haltd serves by translation, so that one probe measures the surfaces of
//! one haltd in turn.

use std::{
    io::{Read, Write},
    net::TcpStream,
    sync::Arc,
    time::{Duration, Instant},
};

use anyhow::{ensure, Context, Result};
use serde_json::json;

/// Reads a socket until EOF; a route that misbehaves fails the probe instead of hanging it.
const READ_TIMEOUT: Duration = Duration::from_secs(10);

/// The API a probe's request speaks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Api {
    /// `POST /v1/chat/completions`.
    Chat,
    /// `POST /v1/messages` (the same body: Messages takes `model`, `stream`, `max_tokens` and
    /// string `messages` alike).
    Messages,
    /// `POST /v1/responses` (`model`, `stream`, `max_output_tokens` and the prompt as a string
    /// `input`).
    Responses,
}

/// A streamed completion request of `tokens` tokens of the scripted upstream.
fn request(addr: &str, tokens: usize, connection: &str) -> String {
    request_on(Api::Chat, addr, tokens, connection)
}

/// [`request`] in `api`.
fn request_on(api: Api, addr: &str, tokens: usize, connection: &str) -> String {
    let prompt = format!("[[script:normal tokens={tokens}]]");
    let chat = || {
        json!({"model": "scripted", "stream": true, "max_tokens": tokens,
               "messages": [{"role": "user", "content": prompt}]})
    };
    let (path, body) = match api {
        Api::Chat => ("/v1/chat/completions", chat()),
        Api::Messages => ("/v1/messages", chat()),
        Api::Responses => (
            "/v1/responses",
            json!({"model": "scripted", "stream": true, "max_output_tokens": tokens,
                   "input": prompt}),
        ),
    };
    let body = body.to_string();
    format!(
        "POST {path} HTTP/1.1\r\nhost: {addr}\r\ncontent-type: application/json\r\n\
         accept: text/event-stream\r\ncontent-length: {}\r\nconnection: {connection}\r\n\r\n{body}",
        body.len()
    )
}

/// One streamed completion over a new connection to `addr` (`host:port`); returns the time
/// from the request's write to the first response byte. The body is read to its end, and the
/// response must be a `200`.
pub fn one(addr: &str, tokens: usize) -> Result<Duration> {
    one_on(Api::Chat, addr, tokens)
}

/// [`one`] in `api`.
pub fn one_on(api: Api, addr: &str, tokens: usize) -> Result<Duration> {
    let req = request_on(api, addr, tokens, "close");
    let mut s = TcpStream::connect(addr).with_context(|| format!("connecting to {addr}"))?;
    s.set_nodelay(true).context("TCP_NODELAY")?;
    s.set_read_timeout(Some(READ_TIMEOUT))
        .context("SO_RCVTIMEO")?;
    let mut buf = [0u8; 16 * 1024];
    let t0 = Instant::now();
    s.write_all(req.as_bytes()).context("sending the request")?;
    let n = s.read(&mut buf).context("reading the response")?;
    let ttfb = t0.elapsed();
    ensure!(n > 0, "{addr} closed without a response");
    let head = String::from_utf8_lossy(&buf[..n.min(16)]).into_owned();
    ensure!(head.starts_with("HTTP/1.1 200"), "{addr} answered {head:?}");
    while s.read(&mut buf).context("reading the response body")? > 0 {}
    Ok(ttfb)
}

/// Percentile `p` (0..=100) of `sorted` in microseconds, nearest rank.
pub fn percentile_us(sorted: &[Duration], p: f64) -> Option<f64> {
    if sorted.is_empty() {
        return None;
    }
    let rank = ((p / 100.0) * sorted.len() as f64).ceil() as usize;
    let i = rank.clamp(1, sorted.len()) - 1;
    Some(sorted[i].as_secs_f64() * 1e6)
}

/// `requests` sequential requests to each of `addrs`, taking turns (route 1, route 2, …, route
/// 1, …) so that a slow moment of the machine falls on every route alike, after `warmup`
/// unmeasured requests per route (they fill connection pools). Returns each route's times,
/// sorted.
pub fn probe(
    addrs: &[&str],
    requests: usize,
    warmup: usize,
    tokens: usize,
) -> Result<Vec<Vec<Duration>>> {
    let routes: Vec<(&str, Api)> = addrs.iter().map(|&a| (a, Api::Chat)).collect();
    probe_apis(&routes, requests, warmup, tokens)
}

/// [`probe`] over routes that each speak their own API: (`host:port`, API), in an order
/// that alternates ([`route_order`]): the first route leads every request, and the others
/// follow it forwards, then backwards. A proxy still finishing its previous request (the
/// record, the upstream connection going back to its pool) slows whichever request comes
/// next; in a fixed order that always fell on the same route (measured: Messages after chat
/// on one haltd took 3 to 17 µs longer at p50 than chat after the upstream, and 1 to 11 µs
/// less in the other order).
pub fn probe_apis(
    routes: &[(&str, Api)],
    requests: usize,
    warmup: usize,
    tokens: usize,
) -> Result<Vec<Vec<Duration>>> {
    let mut times = vec![Vec::with_capacity(requests); routes.len()];
    for i in 0..warmup + requests {
        for route in route_order(i, routes.len()) {
            let (addr, api) = routes[route];
            let t = one_on(api, addr, tokens)
                .with_context(|| format!("request {i} to {addr} ({api:?})"))?;
            if i >= warmup {
                times[route].push(t);
            }
        }
    }
    for t in &mut times {
        t.sort_unstable();
    }
    Ok(times)
}

/// The order of `n` routes in round `i` of [`probe_apis`]: route 0 first, then 1, 2, … in
/// even rounds and …, 2, 1 in odd ones.
fn route_order(i: usize, n: usize) -> Vec<usize> {
    let rest = 1..n;
    std::iter::once(0)
        .take(n)
        .chain(if i.is_multiple_of(2) {
            rest.collect::<Vec<_>>()
        } else {
            rest.rev().collect()
        })
        .collect()
}

/// What [`keepalive_probe`] measured, each sorted.
#[derive(Debug, Default)]
pub struct KeepAliveTimes {
    /// New connection: from the start of the connect to the first response byte (in TLS the
    /// handshake included).
    pub new_from_connect: Vec<Duration>,
    /// New connection: from the request's write (after the connect and any handshake) to the
    /// first byte.
    pub new_from_write: Vec<Duration>,
    /// Kept connection (its earlier request answered in full): from the write to the first byte.
    pub reused: Vec<Duration>,
}

/// `requests` pairs of sequential requests to `addr`: one on a new connection, then one on a
/// connection kept from the previous pair, both asking for keep-alive, after `warmup`
/// unmeasured pairs. The kept connection answers every response in full before the next
/// request; a response on it that is not kept fails the probe.
pub fn keepalive_probe(
    addr: &str,
    requests: usize,
    warmup: usize,
    tokens: usize,
) -> Result<KeepAliveTimes> {
    keepalive_probe_over(addr, None, requests, warmup, tokens)
}

/// [`keepalive_probe`], in TLS trusting `tls`'s roots when given (SNI `localhost`).
pub fn keepalive_probe_over(
    addr: &str,
    tls: Option<&Arc<rustls::ClientConfig>>,
    requests: usize,
    warmup: usize,
    tokens: usize,
) -> Result<KeepAliveTimes> {
    use crate::raw_http::KeptConn;
    let sa: std::net::SocketAddr = addr.parse().with_context(|| format!("address {addr}"))?;
    let req = request(addr, tokens, "keep-alive");
    let s = TcpStream::connect(sa).with_context(|| format!("connecting to {addr}"))?;
    let mut kept = KeptConn::over(s, tls, READ_TIMEOUT)?;
    let (_, first) = kept.exchange_timed(req.as_bytes())?;
    ensure!(
        first.status == 200 && first.header("connection") == Some("keep-alive"),
        "{addr} did not keep the connection: {} {:?}",
        first.status,
        first.headers
    );
    let mut out = KeepAliveTimes::default();
    for i in 0..warmup + requests {
        let t0 = Instant::now();
        let s = TcpStream::connect(sa).with_context(|| format!("connecting to {addr}"))?;
        let mut fresh = KeptConn::over(s, tls, READ_TIMEOUT)?;
        let connect = t0.elapsed();
        let (new, r) = fresh.exchange_timed(req.as_bytes())?;
        ensure!(r.status == 200, "new connection {i}: {}", r.status);
        drop(fresh);
        let (reused, r) = kept.exchange_timed(req.as_bytes())?;
        ensure!(
            r.status == 200 && r.header("connection") == Some("keep-alive"),
            "kept connection, request {i}: {} {:?}",
            r.status,
            r.headers
        );
        if i >= warmup {
            out.new_from_connect.push(connect + new);
            out.new_from_write.push(new);
            out.reused.push(reused);
        }
    }
    for t in [
        &mut out.new_from_connect,
        &mut out.new_from_write,
        &mut out.reused,
    ] {
        t.sort_unstable();
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn route_order_alternates_behind_the_first() {
        assert_eq!(route_order(0, 3), [0, 1, 2]);
        assert_eq!(route_order(1, 3), [0, 2, 1]);
        assert_eq!(route_order(2, 3), [0, 1, 2]);
        assert_eq!(route_order(5, 1), [0]);
        assert!(route_order(0, 0).is_empty());
    }

    #[test]
    fn each_api_posts_its_path_and_body() {
        let body = |req: &str| -> serde_json::Value {
            serde_json::from_str(req.split("\r\n\r\n").nth(1).unwrap_or_default())
                .unwrap_or_default()
        };
        let chat = request_on(Api::Chat, "h:1", 5, "close");
        assert!(chat.starts_with("POST /v1/chat/completions "));
        assert_eq!(body(&chat)["max_tokens"], 5);
        let messages = request_on(Api::Messages, "h:1", 5, "close");
        assert!(messages.starts_with("POST /v1/messages "));
        assert_eq!(body(&messages)["messages"], body(&chat)["messages"]);
        let responses = request_on(Api::Responses, "h:1", 5, "close");
        assert!(responses.starts_with("POST /v1/responses "));
        let b = body(&responses);
        assert_eq!(
            (&b["max_output_tokens"], &b["stream"]),
            (&json!(5), &json!(true))
        );
        assert_eq!(b["input"], "[[script:normal tokens=5]]");
        assert!(b.get("messages").is_none() && b.get("max_tokens").is_none());
    }

    #[test]
    fn nearest_rank_percentiles() {
        let v: Vec<Duration> = (1..=100).map(Duration::from_micros).collect();
        assert_eq!(percentile_us(&v, 50.0), Some(50.0));
        assert_eq!(percentile_us(&v, 99.0), Some(99.0));
        assert_eq!(percentile_us(&v[..1], 99.0), Some(1.0));
        assert_eq!(percentile_us(&[], 50.0), None);
    }
}
