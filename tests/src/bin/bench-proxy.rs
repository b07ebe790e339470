//! `bench-proxy`: per-token latency under load, for an OpenAI-compatible server that streams
//! `scripted-upstream`'s `bench` script: the upstream itself (the baseline) or haltd in front of
//! it (the same numbers plus what the proxy adds), on chat, completions or, through haltd, the
//! Anthropic Messages API (`--endpoint messages`: `POST /v1/messages`, tokens read from the
//! `text_delta` events, the stream ended by `message_stop`) or the OpenAI Responses API
//! (`--endpoint responses`: `POST /v1/responses`, tokens read from the
//! `response.output_text.delta` events, the stream ended by `response.completed`).
//!
//! ```text
//! bench-proxy --url http://HOST:PORT --streams N --tokens T --pace-ms P
//!             [--endpoint chat|completions|messages|responses] [--duration-s S]
//!             [--timeout-s S] [--align] [--json]
//! ```
//!
//! Opens N concurrent streaming requests whose prompt is `[[script:bench tokens=T pace_ms=P]]`
//! (with `--align`, also `align=1`: the upstream sends every stream's tokens at the same
//! multiples of P, like one decode batch, whenever each stream began).
//! The upstream makes each token's text ` t<NS>`, NS being CLOCK_MONOTONIC read just before it
//! wrote the chunk; this client reads the same clock when the event arrives, so
//! `now - NS` is the token's latency through everything in between (same machine, or network
//! namespaces of one machine, which share the clock). With `--duration-s`, each of the N
//! streams is restarted when it ends until that time has passed; otherwise each runs once.
//!
//! Each request also gives two start-up times, both from just before the request is written
//! (after the connect) to: the first byte of the response read (`ttfb`, time to first byte),
//! and the first token event read (`ttft`, time to first token, which includes the upstream's
//! pause before its first token).
//!
//! Prints one human line and, with `--json`, then one JSON object:
//! `{"streams","requests","tokens","errors","p50_us","p90_us","p99_us","max_us","mean_us","wall_s",
//! "ttfb_n","ttfb_p50_us","ttfb_p99_us","ttfb_max_us","ttft_n","ttft_p50_us","ttft_p99_us","ttft_max_us"}`
//! (latencies in microseconds, one decimal; null when no token arrived; `ttfb_n` and `ttft_n`
//! count the requests that got a first byte and a first token). A stream that fails
//! (connect or read error, non-200, an `error` event, no `[DONE]` (Messages: no
//! `message_stop`, or a halted end, `"stop_reason":"refusal"`; Responses: no
//! `response.completed`, or an end in `response.incomplete` or `response.failed`), fewer or
//! more than T tokens)
//! counts as an error, and the first few are described on stderr; the run goes on.
//!
//! The client is deliberately thin and identical for both targets: hand-written HTTP/1.1 with
//! chunked, content-length or close framing, a byte-level SSE parser that reuses its buffers,
//! and a scan for the token text instead of a JSON parse, so no allocation per token.

use std::{
    net::{SocketAddr, ToSocketAddrs},
    sync::{
        atomic::{AtomicUsize, Ordering},
        Arc,
    },
    time::{Duration, Instant},
};

use anyhow::{bail, ensure, Context, Result};
use clap::{Parser, ValueEnum};
use serde_json::json;
use tokio::{
    io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt},
    net::TcpStream,
};

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum Endpoint {
    Chat,
    Completions,
    /// The Anthropic Messages API (haltd translates it to chat for the upstream).
    Messages,
    /// The OpenAI Responses API (haltd translates it to chat for the upstream).
    Responses,
}

/// Per-token latency load client (see the crate docs).
#[derive(Debug, Parser)]
#[command(name = "bench-proxy")]
struct Args {
    /// Server to load: `http://HOST:PORT`.
    #[arg(long)]
    url: String,
    /// Concurrent streams.
    #[arg(long)]
    streams: usize,
    /// Tokens per stream.
    #[arg(long)]
    tokens: usize,
    /// Upstream delay before each token, in milliseconds.
    #[arg(long)]
    pace_ms: u64,
    /// Which endpoint to call.
    #[arg(long, value_enum, default_value_t = Endpoint::Chat)]
    endpoint: Endpoint,
    /// Keep restarting streams until this many seconds have passed (default: each runs once).
    #[arg(long)]
    duration_s: Option<f64>,
    /// Give up on a single stream after this many seconds (it counts as an error).
    #[arg(long, default_value_t = 60.0)]
    timeout_s: f64,
    /// Ask the upstream to send the tokens at multiples of the pace (`align=1`).
    #[arg(long)]
    align: bool,
    /// Also print the result as one JSON object.
    #[arg(long)]
    json: bool,
    /// Speak TLS to the server (its `--tls-cert`), trusting the CA certificates of this PEM
    /// file; SNI `localhost`. The time to first byte then counts from the TCP connect, so it
    /// includes the handshake.
    #[arg(long, value_name = "FILE")]
    tls_ca: Option<std::path::PathBuf>,
}

/// `--tls-ca`: the client configuration (ALPN `http/1.1`, the `ring` provider).
fn tls_config(ca: &std::path::Path) -> Result<Arc<rustls::ClientConfig>> {
    use rustls::pki_types::pem::PemObject as _;
    let mut roots = rustls::RootCertStore::empty();
    for cert in rustls::pki_types::CertificateDer::pem_file_iter(ca)? {
        roots.add(cert?)?;
    }
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let mut cfg = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()?
        .with_root_certificates(roots)
        .with_no_client_auth();
    cfg.alpn_protocols = vec![b"http/1.1".to_vec()];
    Ok(Arc::new(cfg))
}

/// Errors described on stderr, at most.
const SHOWN_ERRORS: usize = 5;

fn main() -> Result<()> {
    let args = Args::parse();
    ensure!(args.streams > 0, "--streams must be at least 1");
    ensure!(
        args.timeout_s > 0.0 && args.timeout_s.is_finite(),
        "--timeout-s must be positive"
    );
    // One socket per stream: a thousand streams pass the usual soft limit of 1024.
    raise_nofile_limit();
    let (host, addr) = parse_url(&args.url)?;
    let tls = args.tls_ca.as_deref().map(tls_config).transpose()?;
    let request: Arc<[u8]> = build_request(&args, &host).into();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("building the tokio runtime")?;
    let start = Instant::now();
    let deadline = match args.duration_s {
        Some(s) => {
            ensure!(s >= 0.0 && s.is_finite(), "--duration-s must be >= 0");
            Some(start + Duration::from_secs_f64(s))
        }
        None => None,
    };
    let shown = Arc::new(AtomicUsize::new(0));
    let timeout = Duration::from_secs_f64(args.timeout_s);
    let results = rt.block_on(async {
        let tasks: Vec<_> = (0..args.streams)
            .map(|_| {
                tokio::spawn(worker(
                    addr,
                    tls.clone(),
                    Arc::clone(&request),
                    args.tokens,
                    deadline,
                    timeout,
                    Arc::clone(&shown),
                ))
            })
            .collect();
        let mut results = Vec::with_capacity(tasks.len());
        for t in tasks {
            results.push(t.await.context("a stream task panicked")?);
        }
        anyhow::Ok(results)
    })?;
    report(&args, results, start.elapsed());
    Ok(())
}

/// Prints the latency figures over all streams, and with `--json` the same as one JSON line.
fn report(args: &Args, results: Vec<WorkerResult>, wall: Duration) {
    let mut lat: Vec<u64> = Vec::with_capacity(results.iter().map(|r| r.lat.len()).sum());
    let (mut ttfb, mut ttft) = (Vec::new(), Vec::new());
    let (mut errors, mut requests) = (0, 0);
    for r in results {
        lat.extend_from_slice(&r.lat);
        ttfb.extend_from_slice(&r.ttfb);
        ttft.extend_from_slice(&r.ttft);
        errors += r.errors;
        requests += r.requests;
    }
    lat.sort_unstable();
    ttfb.sort_unstable();
    ttft.sort_unstable();
    let mean = (!lat.is_empty()).then(|| {
        (lat.iter().map(|&v| v as f64).sum::<f64>() / lat.len() as f64 / 100.0).round() / 10.0
    });
    let (p50, p90, p99) = (pct(&lat, 0.50), pct(&lat, 0.90), pct(&lat, 0.99));
    let max = lat.last().map(|&v| us(v));
    let show = |v: Option<f64>| v.map_or_else(|| "-".to_owned(), |v| format!("{v:.1}"));
    println!(
        "bench-proxy: {} streams, {requests} requests, {} tokens, {errors} errors; latency us: \
         p50 {} p90 {} p99 {} max {} mean {}; first byte us: p50 {} p99 {}; first token us: \
         p50 {} p99 {}; {:.2} s",
        args.streams,
        lat.len(),
        show(p50),
        show(p90),
        show(p99),
        show(max),
        show(mean),
        show(pct(&ttfb, 0.50)),
        show(pct(&ttfb, 0.99)),
        show(pct(&ttft, 0.50)),
        show(pct(&ttft, 0.99)),
        wall.as_secs_f64()
    );
    if args.json {
        let v = json!({
            "streams": args.streams,
            "requests": requests,
            "tokens": lat.len(),
            "errors": errors,
            "p50_us": p50,
            "p90_us": p90,
            "p99_us": p99,
            "max_us": max,
            "mean_us": mean,
            "wall_s": (wall.as_secs_f64() * 1000.0).round() / 1000.0,
            "ttfb_n": ttfb.len(),
            "ttfb_p50_us": pct(&ttfb, 0.50),
            "ttfb_p99_us": pct(&ttfb, 0.99),
            "ttfb_max_us": ttfb.last().map(|&v| us(v)),
            "ttft_n": ttft.len(),
            "ttft_p50_us": pct(&ttft, 0.50),
            "ttft_p99_us": pct(&ttft, 0.99),
            "ttft_max_us": ttft.last().map(|&v| us(v)),
        });
        println!("{v}");
    }
}

/// Nanoseconds to microseconds, one decimal.
fn us(ns: u64) -> f64 {
    (ns as f64 / 100.0).round() / 10.0
}

/// Nearest-rank percentile of sorted nanoseconds, in µs: the smallest value with at least `q`
/// of the samples at or below it; `None` without samples.
fn pct(sorted: &[u64], q: f64) -> Option<f64> {
    let rank = ((q * sorted.len() as f64).ceil() as usize).max(1);
    sorted
        .get(rank.min(sorted.len()).saturating_sub(1))
        .map(|&v| us(v))
}

fn raise_nofile_limit() {
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit only writes into `lim`, which outlives the call.
    if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) } != 0 {
        return;
    }
    if lim.rlim_cur < lim.rlim_max {
        lim.rlim_cur = lim.rlim_max;
        // SAFETY: setrlimit only reads `lim`.
        if unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &lim) } != 0 {
            eprintln!(
                "bench-proxy: raising RLIMIT_NOFILE: {}",
                std::io::Error::last_os_error()
            );
        }
    }
}

/// CLOCK_MONOTONIC in nanoseconds, as `scripted-upstream` writes it into the tokens.
fn monotonic_ns() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: clock_gettime only writes into `ts`; CLOCK_MONOTONIC always exists on Linux, so
    // the call cannot fail.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    // Both fields are non-negative for CLOCK_MONOTONIC.
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

/// `http://HOST:PORT[/]` → (the `host` header value, the address to connect to).
fn parse_url(url: &str) -> Result<(String, SocketAddr)> {
    let rest = url
        .strip_prefix("http://")
        .or_else(|| url.strip_prefix("https://"))
        .with_context(|| format!("--url {url:?} must start with http:// or https://"))?;
    let host = rest.trim_end_matches('/');
    ensure!(
        !host.is_empty() && !host.contains('/'),
        "--url {url:?}: expected http://HOST:PORT with no path"
    );
    let addr = host
        .to_socket_addrs()
        .with_context(|| format!("resolving {host:?} (HOST:PORT)"))?
        .next()
        .with_context(|| format!("{host:?} resolves to no address"))?;
    Ok((host.to_owned(), addr))
}

fn build_request(args: &Args, host: &str) -> Vec<u8> {
    let directive = format!(
        "[[script:bench tokens={} pace_ms={}{}]]",
        args.tokens,
        args.pace_ms,
        if args.align { " align=1" } else { "" }
    );
    let (path, body) = match args.endpoint {
        Endpoint::Chat => (
            "/v1/chat/completions",
            json!({"model": "scripted", "stream": true, "max_tokens": args.tokens,
                   "messages": [{"role": "user", "content": directive}]}),
        ),
        Endpoint::Completions => (
            "/v1/completions",
            json!({"model": "scripted", "stream": true, "max_tokens": args.tokens,
                   "prompt": directive}),
        ),
        Endpoint::Messages => (
            "/v1/messages",
            json!({"model": "scripted", "stream": true, "max_tokens": args.tokens,
                   "messages": [{"role": "user", "content": directive}]}),
        ),
        Endpoint::Responses => (
            "/v1/responses",
            json!({"model": "scripted", "stream": true, "max_output_tokens": args.tokens,
                   "input": directive}),
        ),
    };
    let body = body.to_string();
    let mut req = format!(
        "POST {path} HTTP/1.1\r\nhost: {host}\r\ncontent-type: application/json\r\n\
         accept: text/event-stream\r\ncontent-length: {}\r\nconnection: close\r\n\r\n",
        body.len()
    )
    .into_bytes();
    req.extend_from_slice(body.as_bytes());
    req
}

#[derive(Debug, Default)]
struct WorkerResult {
    /// Per-token latencies, ns.
    lat: Vec<u64>,
    /// Per request: request written → first response byte, ns.
    ttfb: Vec<u64>,
    /// Per request: request written → first token event, ns.
    ttft: Vec<u64>,
    requests: usize,
    errors: usize,
}

/// One of the N concurrent streams: runs it once, or again and again until `deadline`.
async fn worker(
    addr: SocketAddr,
    tls: Option<Arc<rustls::ClientConfig>>,
    request: Arc<[u8]>,
    tokens: usize,
    deadline: Option<Instant>,
    timeout: Duration,
    shown: Arc<AtomicUsize>,
) -> WorkerResult {
    let mut res = WorkerResult {
        lat: Vec::with_capacity(tokens),
        ..WorkerResult::default()
    };
    let mut conn = Conn::default();
    loop {
        res.requests += 1;
        let outcome = tokio::time::timeout(
            timeout,
            conn.stream(addr, tls.as_ref(), &request, tokens, &mut res.lat),
        )
        .await
        .unwrap_or_else(|_| Err(anyhow::anyhow!("no end within {timeout:?}")));
        // Also for a stream that failed later: its start was measured all the same.
        if let Some(sent) = conn.sent {
            if let Some(b) = conn.first_byte {
                res.ttfb.push(b.saturating_sub(sent));
            }
            if let Some(t) = conn.seen.first_token {
                res.ttft.push(t.saturating_sub(sent));
            }
        }
        if let Err(e) = outcome {
            res.errors += 1;
            if shown.fetch_add(1, Ordering::Relaxed) < SHOWN_ERRORS {
                eprintln!("bench-proxy: stream failed: {e:#}");
            }
        }
        match deadline {
            Some(d) if Instant::now() < d => {}
            _ => return res,
        }
    }
}

/// Buffers reused from stream to stream of one worker, and what the current stream saw.
#[derive(Debug, Default)]
struct Conn {
    head: Vec<u8>,
    read: Vec<u8>,
    sse: Sse,
    seen: Seen,
    /// CLOCK_MONOTONIC ns just before the request was written, and when the first byte of
    /// the response was read.
    sent: Option<u64>,
    first_byte: Option<u64>,
}

/// What a stream's events said.
#[derive(Debug, Default)]
struct Seen {
    tokens: usize,
    done: bool,
    error: Option<String>,
    /// CLOCK_MONOTONIC ns when the first token event was read.
    first_token: Option<u64>,
}

impl Conn {
    /// Reads the response head into `self.head` (noting when its first byte came); returns
    /// the status, how the body is framed and the head's length.
    async fn read_head<S: AsyncRead + Unpin>(&mut self, s: &mut S) -> Result<(u16, Body, usize)> {
        self.head.clear();
        loop {
            self.head.reserve(4096);
            let n = s
                .read_buf(&mut self.head)
                .await
                .context("reading the head")?;
            if n > 0 && self.first_byte.is_none() {
                self.first_byte = Some(monotonic_ns());
            }
            ensure!(n > 0, "connection closed before the response head");
            let mut hs = [httparse::EMPTY_HEADER; 32];
            let mut r = httparse::Response::new(&mut hs);
            if let httparse::Status::Complete(len) =
                r.parse(&self.head).context("parsing the head")?
            {
                let header = |name: &str| {
                    r.headers
                        .iter()
                        .find(|h| h.name.eq_ignore_ascii_case(name))
                        .map(|h| String::from_utf8_lossy(h.value).to_ascii_lowercase())
                };
                let body = if header("transfer-encoding").is_some_and(|v| v.contains("chunked")) {
                    Body::Chunked(Chunk::Size { val: 0, ext: false })
                } else if let Some(cl) = header("content-length") {
                    Body::Length(cl.trim().parse().context("bad content-length")?)
                } else {
                    Body::Close
                };
                return Ok((r.code.unwrap_or(0), body, len));
            }
            ensure!(self.head.len() < 64 * 1024, "response head over 64 KiB");
        }
    }

    async fn stream(
        &mut self,
        addr: SocketAddr,
        tls: Option<&Arc<rustls::ClientConfig>>,
        request: &[u8],
        tokens: usize,
        lat: &mut Vec<u64>,
    ) -> Result<()> {
        self.seen = Seen::default();
        self.sent = None;
        self.first_byte = None;
        let s = TcpStream::connect(addr)
            .await
            .with_context(|| format!("connecting to {addr}"))?;
        // Small requests and no pipelining, but keep the kernel from holding anything back.
        s.set_nodelay(true).context("TCP_NODELAY")?;
        self.sent = Some(monotonic_ns());
        match tls {
            None => self.exchange(s, request, tokens, lat).await,
            Some(cfg) => {
                let name = rustls::pki_types::ServerName::try_from("localhost")?;
                let s = tokio_rustls::TlsConnector::from(Arc::clone(cfg))
                    .connect(name, s)
                    .await
                    .context("TLS handshake")?;
                self.exchange(s, request, tokens, lat).await
            }
        }
    }

    /// The request and its response on a connected stream (TCP, or TLS over it).
    async fn exchange<S: AsyncRead + AsyncWrite + Unpin>(
        &mut self,
        mut s: S,
        request: &[u8],
        tokens: usize,
        lat: &mut Vec<u64>,
    ) -> Result<()> {
        s.write_all(request).await.context("sending the request")?;

        let (status, mut body, head_len) = self.read_head(&mut s).await?;
        if status != 200 {
            let mut rest = self.head[head_len..].to_vec();
            // The error body says why; a bounded read, since the server may keep it open.
            let _ =
                tokio::time::timeout(Duration::from_secs(1), s.take(4096).read_to_end(&mut rest))
                    .await;
            bail!(
                "HTTP {status}: {}",
                String::from_utf8_lossy(&rest)
                    .chars()
                    .take(300)
                    .collect::<String>()
            );
        }

        self.sse.reset();
        let mut on_event = |data: &[u8]| handle_event(data, &mut self.seen, lat);
        let mut ended = {
            let sse = &mut self.sse;
            body.feed(&self.head[head_len..], &mut |p| sse.feed(p, &mut on_event))?
        };
        if self.read.len() < 16 * 1024 {
            self.read.resize(16 * 1024, 0);
        }
        while !ended {
            let n = match s.read(&mut self.read).await {
                Ok(n) => n,
                // TLS: a close without close_notify reads as an error; the framing judges it.
                Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => 0,
                Err(e) => return Err(e).context("reading the body"),
            };
            if n == 0 {
                ensure!(
                    matches!(body, Body::Close),
                    "connection closed inside the body (after {} tokens)",
                    self.seen.tokens
                );
                self.sse.finish(&mut on_event);
                break;
            }
            let sse = &mut self.sse;
            ended = body.feed(&self.read[..n], &mut |p| sse.feed(p, &mut on_event))?;
        }
        let seen = &self.seen;
        if let Some(e) = &seen.error {
            bail!("error event after {} tokens: {e}", seen.tokens);
        }
        ensure!(seen.done, "no [DONE] (after {} tokens)", seen.tokens);
        ensure!(
            seen.tokens == tokens,
            "{} tokens, expected {tokens}",
            seen.tokens
        );
        Ok(())
    }
}

/// One SSE event's data: the end (`[DONE]`, Messages' `message_stop`, Responses'
/// `response.completed`), an error (Messages: an `error` event or a halted end; Responses: the
/// same), or a chunk whose text holds ` t<NS>` tokens.
fn handle_event(data: &[u8], seen: &mut Seen, lat: &mut Vec<u64>) {
    if data == b"[DONE]" || data.starts_with(b"{\"type\":\"message_stop\"") {
        seen.done = true;
        return;
    }
    if let Some(event) = data.strip_prefix(b"{\"type\":\"response.") {
        responses_event(event, data, seen, lat);
        return;
    }
    let trimmed = data.trim_ascii_start();
    // A halted Messages stream: a `message_delta` with `stop_reason` "refusal" (its keys in
    // serde_json's order: `{"delta":...`), then `message_stop`.
    const REFUSAL: &[u8] = b"\"stop_reason\":\"refusal\"";
    let halted = || {
        (trimmed.starts_with(b"{\"delta\"") || trimmed.starts_with(b"{\"type\":\"message_delta\""))
            && trimmed.windows(REFUSAL.len()).any(|w| w == REFUSAL)
    };
    if trimmed.starts_with(b"{\"error\"") || trimmed.starts_with(b"{\"type\":\"error\"") || halted()
    {
        if seen.error.is_none() {
            seen.error = Some(String::from_utf8_lossy(&trimmed[..trimmed.len().min(300)]).into());
        }
        return;
    }
    let Some(text) = token_text(data) else { return };
    tokens_in(text, seen, lat);
}

/// A Responses event (haltd writes `type` first): `event` is its data past
/// `{"type":"response.`. Only `output_text.delta` carries tokens, in `delta` (the `.done`
/// events and the final response repeat the whole text); `completed` ends the stream, and
/// `incomplete` (a halt, or `max_output_tokens`) or `failed` ends it short.
fn responses_event(event: &[u8], data: &[u8], seen: &mut Seen, lat: &mut Vec<u64>) {
    const DELTA: &[u8] = b"\"delta\":\"";
    if event.starts_with(b"completed\"") {
        seen.done = true;
    } else if event.starts_with(b"incomplete\"") || event.starts_with(b"failed\"") {
        if seen.error.is_none() {
            seen.error = Some(String::from_utf8_lossy(&data[..data.len().min(300)]).into());
        }
    } else if event.starts_with(b"output_text.delta\"") {
        let Some(at) = event.windows(DELTA.len()).position(|w| w == DELTA) else {
            return;
        };
        let v = &event[at + DELTA.len()..];
        // Bench tokens contain no escapes; the first quote ends the value.
        let Some(end) = v.iter().position(|&b| b == b'"') else {
            return;
        };
        tokens_in(&v[..end], seen, lat);
    }
}

/// Counts the ` t<NS>` tokens of `text` (several if the server packed them into one event),
/// each with its latency.
fn tokens_in(text: &[u8], seen: &mut Seen, lat: &mut Vec<u64>) {
    let now = monotonic_ns();
    // ` t<digits>` repeated (several tokens if the server packed them into one chunk).
    let mut rest = text;
    while let Some(tail) = rest.strip_prefix(b" t") {
        let digits = tail.iter().take_while(|b| b.is_ascii_digit()).count();
        if digits == 0 {
            return;
        }
        let ns = tail[..digits].iter().fold(0u64, |acc, b| {
            acc.wrapping_mul(10).wrapping_add(u64::from(b - b'0'))
        });
        lat.push(now.saturating_sub(ns));
        seen.first_token.get_or_insert(now);
        seen.tokens += 1;
        rest = &tail[digits..];
    }
}

/// The raw (unescaped-free) value of the first `"content"` or `"text"` key whose value is a
/// string: the chat delta's content, the completion's text or a Messages `text_delta`'s text.
/// `"content":[` (chat logprobs, Messages' `message_start`) and `"content":null` are skipped,
/// and a Messages block's empty start text holds no token.
fn token_text(data: &[u8]) -> Option<&[u8]> {
    let mut i = 0;
    while i < data.len() {
        let rest = &data[i..];
        let key_len = if rest.starts_with(b"\"content\"") {
            9
        } else if rest.starts_with(b"\"text\"") {
            6
        } else {
            i += 1;
            continue;
        };
        let after = rest[key_len..].trim_ascii_start();
        if let Some(v) = after.strip_prefix(b":") {
            if let Some(v) = v.trim_ascii_start().strip_prefix(b"\"") {
                // Bench tokens contain no escapes; the first quote ends the value.
                let end = v.iter().position(|&b| b == b'"')?;
                return Some(&v[..end]);
            }
        }
        i += key_len;
    }
    None
}

/// How the response body is delimited.
#[derive(Debug)]
enum Body {
    Chunked(Chunk),
    Length(u64),
    Close,
}

/// Where the chunked decoder is.
#[derive(Debug)]
enum Chunk {
    /// In the size line (`ext`: past the size, in an extension).
    Size {
        val: u64,
        ext: bool,
    },
    SizeLf {
        val: u64,
    },
    Data(u64),
    DataCr,
    DataLf,
    /// In the trailer section; `line_start`: nothing yet on this line.
    Trailer {
        line_start: bool,
    },
    Done,
}

impl Body {
    /// Feeds raw body bytes, passing payload to `sink`; true once the body is complete.
    fn feed(&mut self, mut input: &[u8], sink: &mut impl FnMut(&[u8])) -> Result<bool> {
        match self {
            Self::Close => {
                sink(input);
                Ok(false)
            }
            Self::Length(rem) => {
                let take = input.len().min(usize::try_from(*rem).unwrap_or(usize::MAX));
                sink(&input[..take]);
                *rem -= take as u64;
                Ok(*rem == 0)
            }
            Self::Chunked(st) => {
                while !input.is_empty() {
                    if let Chunk::Data(rem) = st {
                        let take = input.len().min(usize::try_from(*rem).unwrap_or(usize::MAX));
                        sink(&input[..take]);
                        *rem -= take as u64;
                        input = &input[take..];
                        if *rem == 0 {
                            *st = Chunk::DataCr;
                        }
                        continue;
                    }
                    let b = input[0];
                    input = &input[1..];
                    *st = match *st {
                        Chunk::Size { val, ext } => match b {
                            b'\r' => Chunk::SizeLf { val },
                            b'\n' => Self::after_size(val),
                            _ if ext => Chunk::Size { val, ext },
                            b';' | b' ' | b'\t' => Chunk::Size { val, ext: true },
                            _ => {
                                let d = (b as char)
                                    .to_digit(16)
                                    .with_context(|| format!("bad chunk size byte {b:#04x}"))?;
                                let val = val
                                    .checked_mul(16)
                                    .and_then(|v| v.checked_add(u64::from(d)))
                                    .context("chunk size overflows")?;
                                Chunk::Size { val, ext }
                            }
                        },
                        Chunk::SizeLf { val } => {
                            ensure!(b == b'\n', "chunk size line not ended by CRLF");
                            Self::after_size(val)
                        }
                        Chunk::DataCr => match b {
                            b'\r' => Chunk::DataLf,
                            b'\n' => Chunk::Size { val: 0, ext: false },
                            _ => bail!("chunk data not followed by CRLF"),
                        },
                        Chunk::DataLf => {
                            ensure!(b == b'\n', "chunk data not followed by CRLF");
                            Chunk::Size { val: 0, ext: false }
                        }
                        Chunk::Trailer { line_start } => match b {
                            b'\r' => Chunk::Trailer { line_start },
                            b'\n' if line_start => Chunk::Done,
                            b'\n' => Chunk::Trailer { line_start: true },
                            _ => Chunk::Trailer { line_start: false },
                        },
                        Chunk::Done => return Ok(true),
                        Chunk::Data(_) => unreachable!("handled above"),
                    };
                }
                Ok(matches!(st, Chunk::Done))
            }
        }
    }

    fn after_size(val: u64) -> Chunk {
        if val == 0 {
            Chunk::Trailer { line_start: true }
        } else {
            Chunk::Data(val)
        }
    }
}

/// A byte-level SSE parser (HTML Living Standard, "event stream interpretation"): lines end
/// in CRLF, LF or CR; `data:` lines accumulate (joined by LF); a blank line dispatches;
/// other fields and `:` comments are ignored. Buffers are reused across events and streams.
#[derive(Debug, Default)]
struct Sse {
    line: Vec<u8>,
    data: Vec<u8>,
    has_data: bool,
    /// The previous line ended with CR: a LF right after it belongs to the same line end.
    after_cr: bool,
}

impl Sse {
    fn reset(&mut self) {
        self.line.clear();
        self.data.clear();
        self.has_data = false;
        self.after_cr = false;
    }

    fn feed(&mut self, mut input: &[u8], on_event: &mut impl FnMut(&[u8])) {
        if self.after_cr && !input.is_empty() {
            self.after_cr = false;
            if input[0] == b'\n' {
                input = &input[1..];
            }
        }
        while let Some(pos) = input.iter().position(|&b| b == b'\n' || b == b'\r') {
            self.line.extend_from_slice(&input[..pos]);
            self.line_done(on_event);
            let cr = input[pos] == b'\r';
            input = &input[pos + 1..];
            if cr {
                match input.first() {
                    Some(b'\n') => input = &input[1..],
                    Some(_) => {}
                    None => self.after_cr = true,
                }
            }
        }
        self.line.extend_from_slice(input);
    }

    fn line_done(&mut self, on_event: &mut impl FnMut(&[u8])) {
        let line = &self.line[..];
        if line.is_empty() {
            if self.has_data {
                on_event(&self.data);
            }
            self.data.clear();
            self.has_data = false;
        } else if line[0] != b':' {
            let (field, value) = match line.iter().position(|&b| b == b':') {
                Some(c) => {
                    let v = &line[c + 1..];
                    (&line[..c], v.strip_prefix(b" ").unwrap_or(v))
                }
                None => (line, &[][..]),
            };
            if field == b"data" {
                if self.has_data {
                    self.data.push(b'\n');
                }
                self.data.extend_from_slice(value);
                self.has_data = true;
            }
        }
        self.line.clear();
    }

    /// At the end of the body: an event not terminated by a blank line is dropped, as the
    /// standard says; only a last unterminated line is completed.
    fn finish(&mut self, on_event: &mut impl FnMut(&[u8])) {
        if !self.line.is_empty() {
            self.line_done(on_event);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Decodes `wire` fed in pieces of `step` bytes; returns (tokens, done, body complete).
    fn decode(wire: &[u8], mut body: Body, step: usize) -> (Vec<u64>, Seen, bool) {
        let mut sse = Sse::default();
        let mut seen = Seen::default();
        let mut lat = Vec::new();
        let mut ended = false;
        for piece in wire.chunks(step) {
            let mut on_event = |d: &[u8]| handle_event(d, &mut seen, &mut lat);
            ended = body
                .feed(piece, &mut |p| sse.feed(p, &mut on_event))
                .expect("well-formed body");
        }
        (lat, seen, ended)
    }

    const EVENTS: &str = "data: {\"choices\":[{\"delta\":{\"content\":\" t1\"},\"logprobs\":\
        {\"content\":[{\"token\":\" t1\"}]}}]}\r\n\r\n: comment\n\
        data: {\"choices\":[{\"text\": \" t2 t3\"}]}\r\rdata: [DONE]\n\n";

    #[test]
    fn chunked_and_close_framing_in_any_split() {
        let mut chunked = Vec::new();
        for part in EVENTS.as_bytes().chunks(7) {
            chunked.extend_from_slice(format!("{:x};ext=1\r\n", part.len()).as_bytes());
            chunked.extend_from_slice(part);
            chunked.extend_from_slice(b"\r\n");
        }
        chunked.extend_from_slice(b"0\r\nx-trailer: 1\r\n\r\n");
        for step in [1, 2, 3, 5, 64, 4096] {
            let (lat, seen, ended) = decode(
                &chunked,
                Body::Chunked(Chunk::Size { val: 0, ext: false }),
                step,
            );
            assert!(ended && seen.done && seen.error.is_none(), "step {step}");
            assert_eq!((lat.len(), seen.tokens), (3, 3), "step {step}");
            let (lat, seen, ended) = decode(EVENTS.as_bytes(), Body::Close, step);
            assert!(!ended && seen.done);
            assert_eq!(lat.len(), 3);
            let len = EVENTS.len() as u64;
            let (_, seen, ended) = decode(EVENTS.as_bytes(), Body::Length(len), step);
            assert!(ended && seen.done && seen.tokens == 3);
        }
    }

    const MESSAGES: &str = "event: message_start\n\
        data: {\"type\":\"message_start\",\"message\":{\"id\":\"msg_1\",\"content\":[],\"usage\":{}}}\n\n\
        event: content_block_start\n\
        data: {\"type\":\"content_block_start\",\"index\":0,\"content_block\":{\"type\":\"text\",\"text\":\"\"}}\n\n\
        event: content_block_delta\n\
        data: {\"type\":\"content_block_delta\",\"index\":0,\"delta\":{\"type\":\"text_delta\",\"text\":\" t1\"}}\n\n\
        event: content_block_delta\n\
        data: {\"type\":\"content_block_delta\",\"index\":0,\"delta\":{\"type\":\"text_delta\",\"text\":\" t2\"}}\n\n";

    #[test]
    fn messages_events_give_tokens_and_end_at_message_stop() {
        let stop = "event: content_block_stop\ndata: {\"type\":\"content_block_stop\",\"index\":0}\n\n\
            event: message_delta\ndata: {\"type\":\"message_delta\",\"delta\":{\"stop_reason\":\"end_turn\"}}\n\n\
            event: message_stop\ndata: {\"type\":\"message_stop\"}\n\n";
        for step in [1, 7, 4096] {
            let wire = format!("{MESSAGES}{stop}");
            let (lat, seen, _) = decode(wire.as_bytes(), Body::Close, step);
            assert!(seen.done && seen.error.is_none(), "step {step}");
            assert_eq!((lat.len(), seen.tokens), (2, 2), "step {step}");
        }
        let halted = ": haltd-halt 0123\nevent: message_delta\ndata: {\"delta\":{\"stop_reason\":\
            \"refusal\",\"stop_sequence\":null},\"type\":\"message_delta\"}\n\n\
            event: message_stop\ndata: {\"type\":\"message_stop\"}\n\n";
        let (_, seen, _) = decode(format!("{MESSAGES}{halted}").as_bytes(), Body::Close, 64);
        assert!(seen.error.is_some_and(|e| e.contains("refusal")));
        let error =
            "event: error\ndata: {\"type\":\"error\",\"error\":{\"type\":\"api_error\"}}\n\n";
        let (_, seen, _) = decode(format!("{MESSAGES}{error}").as_bytes(), Body::Close, 64);
        assert!(seen.error.is_some_and(|e| e.contains("api_error")) && !seen.done);
    }

    /// A Responses stream as haltd writes it, up to its end: the text appears again in the
    /// `.done` events, which hold no tokens.
    const RESPONSES: &str = "event: response.created\n\
        data: {\"type\":\"response.created\",\"sequence_number\":0,\"response\":{\"id\":\"resp_1\",\
        \"status\":\"in_progress\",\"output\":[],\"text\":{\"format\":{\"type\":\"text\"}}}}\n\n\
        event: response.content_part.added\n\
        data: {\"type\":\"response.content_part.added\",\"sequence_number\":3,\"item_id\":\"msg_1\",\
        \"output_index\":0,\"content_index\":0,\"part\":{\"type\":\"output_text\",\"text\":\"\"}}\n\n\
        event: response.output_text.delta\n\
        data: {\"type\":\"response.output_text.delta\",\"sequence_number\":4,\"item_id\":\"msg_1\",\
        \"output_index\":0,\"content_index\":0,\"delta\":\" t1\",\"logprobs\":[]}\n\n\
        event: response.output_text.delta\n\
        data: {\"type\":\"response.output_text.delta\",\"sequence_number\":5,\"item_id\":\"msg_1\",\
        \"output_index\":0,\"content_index\":0,\"delta\":\" t2\",\"logprobs\":[]}\n\n\
        event: response.output_text.done\n\
        data: {\"type\":\"response.output_text.done\",\"sequence_number\":6,\"item_id\":\"msg_1\",\
        \"output_index\":0,\"content_index\":0,\"text\":\" t1 t2\",\"logprobs\":[]}\n\n";

    #[test]
    fn responses_events_give_tokens_and_end_at_completed() {
        let completed = "event: response.completed\n\
            data: {\"type\":\"response.completed\",\"sequence_number\":7,\"response\":{\"status\":\
            \"completed\",\"output\":[{\"content\":[{\"type\":\"output_text\",\"text\":\" t1 t2\"}]}]}}\n\n";
        for step in [1, 7, 4096] {
            let wire = format!("{RESPONSES}{completed}");
            let (lat, seen, _) = decode(wire.as_bytes(), Body::Close, step);
            assert!(seen.done && seen.error.is_none(), "step {step}");
            assert_eq!((lat.len(), seen.tokens), (2, 2), "step {step}");
        }
        let halted = ": haltd-halt 0123\nevent: response.incomplete\n\
            data: {\"type\":\"response.incomplete\",\"sequence_number\":7,\"response\":{\"status\":\
            \"incomplete\",\"incomplete_details\":{\"reason\":\"content_filter\"}}}\n\n";
        let (lat, seen, _) = decode(format!("{RESPONSES}{halted}").as_bytes(), Body::Close, 64);
        assert!(seen.error.is_some_and(|e| e.contains("content_filter")) && !seen.done);
        assert_eq!(lat.len(), 2);
        let error =
            "event: error\ndata: {\"type\":\"error\",\"error\":{\"code\":\"UPSTREAM\"}}\n\n";
        let (_, seen, _) = decode(format!("{RESPONSES}{error}").as_bytes(), Body::Close, 64);
        assert!(seen.error.is_some_and(|e| e.contains("UPSTREAM")) && !seen.done);
    }

    #[test]
    fn error_events_and_other_text_are_not_tokens() {
        let (lat, seen, _) = decode(
            b"data: {\"choices\":[{\"delta\":{\"role\":\"assistant\",\"content\":\"hello\"}}]}\n\n\
              data: {\"choices\":[{\"delta\":{\"content\":null}}]}\n\n\
              data: {\"error\":{\"message\":\"halted\"}}\n\n",
            Body::Close,
            4096,
        );
        assert!(lat.is_empty());
        assert!(seen.error.is_some_and(|e| e.contains("halted")));
    }
}
