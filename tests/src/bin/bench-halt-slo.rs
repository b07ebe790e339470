//! `bench-halt-slo`: the halt SLO bench of spec 000 §5 and §10 (issue 5, point 1). How many
//! tokens reach a client after a trip, and how long the halt takes, when trips land at random
//! points of live streams, when the emitter ignores the halt (the kernel gate alone holds), and
//! when the watchdog stalls; at B = 5 and B = 0; at 1, 100, 1,000 and 10,000 concurrent
//! streams. In the same run it measures what the gate costs per send (`bench-gate-send`), what
//! haltd adds per token against a plain relay of the same upstream (`bench-proxy-overhead`),
//! and haltd's memory per open stream.
//!
//! ```text
//! HALTD_BIN=target/release/haltd bench-halt-slo [--streams 1,100,1000,10000]
//!     [--scenarios late-trip,adversarial,watchdog-stall] [--budgets 5,0]
//!     [--min-trips 200] [--k-max 40] [--out-dir DIR] [--quick]
//!     [--no-gate-send] [--no-overhead] [--overhead-streams 1,100,1000]
//! ```
//!
//! Needs root (network namespaces, the BPF gate) and a haltd built with the `fault-injection`
//! feature in `HALTD_BIN`; `cargo xtask bench` builds one and runs this. The sibling binaries
//! `bench-gate-send`, `bench-proxy-overhead`, `bench-proxy` and `scripted-upstream` are taken
//! from this executable's directory.
//!
//! ## One run
//!
//! Every (scenario, B, N) gets a fresh pair of network namespaces and a fresh haltd (built-in
//! source, `--ledger-no-fsync`, a stream table of at least N + 1024 slots). A fresh namespace
//! pair also means fresh TCP port and TIME_WAIT tables, so 10,000-stream runs do not starve
//! each other of ports. The client is one tokio runtime in the client namespace: N streams at
//! a time, `max(N, --min-trips)` in all, each asking for `ignore_eos` and a huge `max_tokens`
//! so that only a halt ends it. A stream counts token events (one per send, see
//! docs/wire-format.md) and reads the terminal `error` event.
//!
//! - **late-trip**: tokens paced at `max(2 ms, N × 50 µs)` (about 20,000 tokens/s in all at
//!   1,000 streams and above, what two CPUs sustain beside the client). Once all of the first
//!   N streams have a token (so that N are really open at once), each stream asks the admin
//!   API to trip it after a random 1..=k-max further tokens. The admin answer carries the trip
//!   index τ; post-trip tokens are the token events the client got beyond τ, halt latency is
//!   the time from sending the trip request to the stream's end (`[DONE]` or close).
//! - **adversarial**: the same trips with `--fault emitter-ignores-halt` and no pacing: the
//!   emitter keeps writing as fast as the socket takes tokens, so only the kernel gate (B
//!   frames after the trip) and the watchdog's close stop the stream.
//! - **watchdog-stall**: `--fault watchdog-stall-after-ms=T`, T long enough for all N streams
//!   to be open; no client trips. The emitters find the heartbeat stale and halt every stream
//!   with `HEARTBEAT_LOST` (the kernel drops too). τ comes from the terminal error event;
//!   there is no client-side start for the latency, so it is the ledger's `halt_latency_ms`
//!   (trip to close, measured by haltd).
//!
//! For every run the ledger's incident records give haltd's own view (`halt_tokens_post_trip`
//! and `halt_latency_ms`), reported beside the client's. A client that saw more than B tokens
//! after τ is a budget breach: the run is marked, and the bench exits non-zero after writing
//! its report.
//!
//! Memory per open stream: haltd's resident set (`VmRSS`) once the first N streams are open,
//! minus its resident set before any stream, over N (late-trip, B = 5 runs).
//!
//! ## Output
//!
//! `DIR/halt-slo.json` (everything, including the sub-benches' reports), `DIR/halt-slo.md`
//! (the summary tables, as pasted into docs/bench.md), `DIR/post-trip-tokens.svg` and
//! `DIR/halt-latency.svg`. `DIR` defaults to `target/bench/halt-slo`. Progress goes to stderr:
//! a bar per run on a terminal, a line every few seconds otherwise.

use std::{
    collections::BTreeMap,
    fmt::Write as _,
    fs,
    io::IsTerminal,
    net::SocketAddr,
    path::{Path, PathBuf},
    process::Command,
    sync::{
        atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering},
        Arc,
    },
    time::{Duration, Instant},
};

use anyhow::{bail, ensure, Context, Result};
use clap::{Parser, ValueEnum};
use haltd_tests::{quantile, spawn_in_netns, Haltd, NetPair};
use indicatif::{ProgressBar, ProgressStyle};
use rand::Rng;
use serde_json::{json, Value};
use tokio::{
    io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt},
    net::TcpStream,
    sync::{oneshot, Notify, Semaphore},
};

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, ValueEnum)]
enum Scenario {
    /// Operator trips at random points of paced streams.
    LateTrip,
    /// The same trips, with an emitter that ignores the halt: the kernel gate alone holds.
    Adversarial,
    /// The watchdog thread stops beating; every open stream halts with HEARTBEAT_LOST.
    WatchdogStall,
}

impl Scenario {
    fn name(self) -> &'static str {
        match self {
            Self::LateTrip => "late-trip",
            Self::Adversarial => "adversarial",
            Self::WatchdogStall => "watchdog-stall",
        }
    }

    fn cause(self) -> &'static str {
        match self {
            Self::LateTrip | Self::Adversarial => "OPERATOR_TRIP",
            Self::WatchdogStall => "HEARTBEAT_LOST",
        }
    }
}

/// The halt SLO bench (see the crate docs).
#[derive(Debug, Parser)]
#[command(name = "bench-halt-slo")]
struct Args {
    /// Concurrent stream counts, comma-separated.
    #[arg(long, value_delimiter = ',', default_values_t = [1usize, 100, 1000, 10000])]
    streams: Vec<usize>,
    /// Scenarios, comma-separated.
    #[arg(long, value_delimiter = ',', value_enum,
          default_values_t = [Scenario::LateTrip, Scenario::Adversarial, Scenario::WatchdogStall])]
    scenarios: Vec<Scenario>,
    /// Halt budgets B, comma-separated.
    #[arg(long, value_delimiter = ',', default_values_t = [5u32, 0])]
    budgets: Vec<u32>,
    /// Streams per run at least (N at a time): below this, a run repeats N-stream waves.
    #[arg(long, default_value_t = 200)]
    min_trips: usize,
    /// A trip lands after a random 1..=K_MAX tokens (counted once all of the first N streams
    /// are open).
    #[arg(long, default_value_t = 40)]
    k_max: u64,
    /// haltd's heartbeat deadline in the watchdog-stall runs (ms).
    #[arg(long, default_value_t = 200)]
    heartbeat_deadline_ms: u64,
    /// Where the report, summary and plots go (default: `bench/halt-slo` in the target
    /// directory this binary was built into).
    #[arg(long)]
    out_dir: Option<PathBuf>,
    /// Small and fast: 1 and 100 streams, 40 trips, k-max at most 20, no sub-benches (a smoke
    /// run; `--streams` and `--min-trips` given explicitly are kept).
    #[arg(long)]
    quick: bool,
    /// Run haltd with the ledger's fsync (the default of a deployment): a halt's terminal event
    /// then waits for its incident record's fsync. Without it the bench runs
    /// `--ledger-no-fsync`, as its published figures do.
    #[arg(long)]
    ledger_fsync: bool,
    /// Clients speak TLS to haltd (`--tls-cert`/`--tls-key` with a certificate made for the
    /// run): the gate then judges records, and the terminal allowance matches ciphertext.
    #[arg(long)]
    tls: bool,
    /// Skip the gate cost per send (`bench-gate-send`).
    #[arg(long)]
    no_gate_send: bool,
    /// Skip the streaming overhead against a plain relay (`bench-proxy-overhead`).
    #[arg(long)]
    no_overhead: bool,
    /// Stream counts for the streaming overhead: up to 1,000 at 20 ms per token, above that at
    /// N × 50 µs (20,000 tokens/s); a count above what the open-file limit allows (two sockets
    /// per proxied stream in haltd) is lowered, with a note in the report.
    #[arg(long, value_delimiter = ',', default_values_t = [1usize, 100, 1000, 10000])]
    overhead_streams: Vec<usize>,
}

/// What one run asks for.
#[derive(Debug, Clone, Copy)]
struct RunSpec {
    scenario: Scenario,
    /// haltd fsyncs its ledger (`--ledger-fsync`).
    ledger_fsync: bool,
    /// Clients speak TLS (`--tls`).
    tls: bool,
    budget: u32,
    /// Streams open at once.
    concurrency: usize,
    /// Streams in all.
    total: usize,
    /// `--builtin-token-interval-us`.
    pace_us: u64,
    k_max: u64,
    /// watchdog-stall: the watchdog stops beating this long after haltd starts.
    stall_after_ms: Option<u64>,
    heartbeat_deadline_ms: u64,
}

impl RunSpec {
    fn label(&self) -> String {
        format!(
            "{}{} B={} N={}",
            self.scenario.name(),
            if self.tls { " tls" } else { "" },
            self.budget,
            self.concurrency
        )
    }
}

/// The pace of a late-trip or watchdog-stall run: 2 ms per token per stream, slower above
/// 40 streams so that the whole node streams about 20,000 tokens/s.
fn pace_us(streams: usize) -> u64 {
    (streams as u64 * 50).max(2_000)
}

/// The adversarial emitter floods (no pacing) up to 1,000 streams. Above, a flood from the
/// streams already open starves the connects of the rest (10,000 never get a token each on
/// two CPUs), so it is paced to offer about 80,000 tokens/s in all, more than the node
/// relays; [`adversarial_grace_ms`] keeps the stream open long enough to reach its budget.
fn adversarial_pace_us(streams: usize) -> u64 {
    if streams <= 1000 {
        0
    } else {
        streams as u64 * 25 / 2
    }
}

/// `--halt-grace-ms` of an adversarial run: the default 50 ms while the emitter floods. With a
/// paced emitter (125 ms per token at 10,000 streams) the default grace would have the
/// watchdog close the socket before a single post-trip frame was tried, so the budget would
/// never be tested; with 2 s the watchdog closes only after a quarter of the grace and once B
/// post-trip frames went out, so the stream reaches its budget and the kernel gate counts it
/// and drops any frame beyond.
fn adversarial_grace_ms(streams: usize) -> Option<u64> {
    (adversarial_pace_us(streams) > 0).then_some(2_000)
}

/// How long the watchdog beats in a watchdog-stall run: enough for N connections to open
/// and get tokens (this machine opens about 5,000 a second), then a few tokens more.
fn stall_after_ms(streams: usize) -> u64 {
    1_500 + streams as u64 * 3 / 5 + pace_us(streams) * 6 / 1000
}

/// One client stream, as the client saw it.
#[derive(Debug, Default)]
struct StreamResult {
    status: u16,
    stream_id: String,
    /// Token events received.
    tokens: u64,
    /// The trip request: sent this long after the run began; the admin answer's status and
    /// trip index.
    trip_sent: Option<Instant>,
    trip_status: Option<u16>,
    trip_index: Option<u64>,
    trip_error: Option<String>,
    /// From the terminal error event.
    error_code: Option<String>,
    error_trip_index: Option<u64>,
    error_post_trip: Option<i64>,
    /// From haltd's incident record for this stream (the trip index and cause): the only
    /// source when no terminal event could reach the client (the kernel gate saw the
    /// heartbeat lost before the emitter did, and drops for good).
    ledger_trip_index: Option<u64>,
    ledger_cause: Option<String>,
    done: bool,
    end: Option<Instant>,
    /// `--tls`: the read error that ended the TLS stream, if it did not end cleanly.
    tls_end: Option<String>,
    /// Anything that should not happen: connect or read errors, a bad head.
    failure: Option<String>,
}

impl StreamResult {
    /// τ: the admin answer's, else the terminal event's, else haltd's record's.
    fn tau(&self) -> Option<u64> {
        self.trip_index
            .or(self.error_trip_index)
            .or(self.ledger_trip_index)
    }

    /// Halted as the scenario says: tripped by the client, or ended by a halt with the
    /// scenario's cause (in the terminal event or, failing that, in haltd's record).
    fn halted_by(&self, cause: &str) -> bool {
        self.trip_index.is_some()
            || self.error_code.as_deref() == Some(cause)
            || (self.error_code.is_none() && self.ledger_cause.as_deref() == Some(cause))
    }

    /// Token events beyond τ. The gate may cut the frame in flight at the trip, so a client
    /// can end below τ: that counts as 0.
    fn post_trip(&self) -> Option<u64> {
        Some(self.tokens.saturating_sub(self.tau()?))
    }

    fn halt_latency_ms(&self) -> Option<f64> {
        Some(
            self.end?
                .saturating_duration_since(self.trip_sent?)
                .as_secs_f64()
                * 1e3,
        )
    }
}

/// Shared state of one run's clients.
#[derive(Debug)]
struct Campaign {
    spec: RunSpec,
    /// `--tls`: the clients' TLS configuration (trusting the run's test CA).
    tls: Option<Arc<rustls::ClientConfig>>,
    api: SocketAddr,
    admin: SocketAddr,
    /// Streams that got a permit so far (the first N are the first wave).
    started: AtomicUsize,
    /// Streams of the first wave with a token; trips wait until all have one.
    opened: AtomicUsize,
    gate_open: AtomicBool,
    gate: Notify,
    /// When the gate opened: haltd's resident set then (KiB).
    rss_at_gate_kib: AtomicU64,
    haltd_pid: u32,
    finished: AtomicUsize,
    tokens: AtomicU64,
}

impl Campaign {
    fn first_wave(&self) -> usize {
        self.spec.concurrency.min(self.spec.total)
    }

    fn note_opened(&self) {
        if self.opened.fetch_add(1, Ordering::AcqRel) + 1 == self.first_wave() {
            self.rss_at_gate_kib
                .store(rss_kib(self.haltd_pid).unwrap_or(0), Ordering::Release);
            self.gate_open.store(true, Ordering::Release);
            self.gate.notify_waiters();
        }
    }
}

/// haltd's resident set in KiB.
fn rss_kib(pid: u32) -> Option<u64> {
    let status = fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let line = status.lines().find(|l| l.starts_with("VmRSS:"))?;
    line.split_whitespace().nth(1)?.parse().ok()
}

const HEAD_MAX: usize = 16 * 1024;

async fn one_stream(c: Arc<Campaign>, i: usize, first_wave: bool) -> StreamResult {
    let mut r = StreamResult::default();
    if let Err(e) = drive_stream(&c, i, first_wave, &mut r).await {
        r.failure = Some(format!("{e:#}"));
    }
    if first_wave && r.tokens == 0 {
        // It ended without a token: the others must not wait for it to open.
        c.note_opened();
    }
    if r.end.is_none() {
        r.end = Some(Instant::now());
    }
    c.finished.fetch_add(1, Ordering::Relaxed);
    r
}

async fn drive_stream(
    c: &Arc<Campaign>,
    i: usize,
    first_wave: bool,
    r: &mut StreamResult,
) -> Result<()> {
    let (mut s, mut buf) = open_stream(c, i, r).await?;
    let mut chunk = [0u8; 4096];
    let trips = c.spec.scenario != Scenario::WatchdogStall;
    let k = rand::rng().random_range(1..=c.spec.k_max.max(1));
    // Tokens at which the trip is sent: k after the gate opened (set on the first token seen
    // with the gate open).
    let mut trip_at: Option<u64> = None;
    let mut trip_rx: Option<oneshot::Receiver<TripAnswer>> = None;
    let mut counted_open = false;
    loop {
        while let Some(end) = find(&buf, b"\n\n") {
            let ev = &buf[..end];
            let data = ev.strip_prefix(b"data: ").unwrap_or(ev);
            if data == b"[DONE]" {
                r.done = true;
                r.end = Some(Instant::now());
            } else if data.starts_with(b"{\"error\"") {
                let v: Value = serde_json::from_slice(data).context("error event")?;
                r.error_code = v["error"]["code"].as_str().map(str::to_owned);
                r.error_trip_index = v["error"]["trip_token_index"].as_u64();
                r.error_post_trip = v["error"]["post_trip_tokens"].as_i64();
            } else if find(data, b"\"finish_reason\":null").is_some() {
                r.tokens += 1;
                c.tokens.fetch_add(1, Ordering::Relaxed);
                if !counted_open {
                    counted_open = true;
                    if first_wave {
                        c.note_opened();
                    }
                }
                if trips && trip_rx.is_none() {
                    if trip_at.is_none() && c.gate_open.load(Ordering::Acquire) {
                        trip_at = Some(r.tokens + k - 1);
                    }
                    if trip_at.is_some_and(|t| r.tokens >= t) {
                        let (tx, rx) = oneshot::channel();
                        let (admin, id) = (c.admin, r.stream_id.clone());
                        tokio::spawn(async move {
                            let sent = Instant::now();
                            let _ = tx.send((sent, trip(admin, &id).await));
                        });
                        trip_rx = Some(rx);
                    }
                }
            }
            buf.drain(..end + 2);
        }
        let n = match s.read(&mut chunk).await {
            Ok(n) => n,
            // The gate or the watchdog may reset the connection after the budget.
            Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => 0,
            // TLS: a close without close_notify, or records an emitter that ignored the halt
            // sealed after the terminal (they do not open): the stream ended for the client.
            Err(e) if c.spec.tls => {
                r.tls_end = Some(e.to_string());
                0
            }
            Err(e) => return Err(e).context("reading the stream"),
        };
        if n == 0 {
            break;
        }
        buf.extend_from_slice(&chunk[..n]);
    }
    if r.end.is_none() {
        r.end = Some(Instant::now());
    }
    if let Some(rx) = trip_rx {
        record_trip_answer(rx, r).await?;
    }
    Ok(())
}

/// Opens stream `i`: sends its request, reads the response head into `r` (status, stream id)
/// and fails unless it is 200; returns the connection and what was read past the head.
/// A client connection: TCP, or TLS over it (`--tls`).
trait Io: AsyncRead + AsyncWrite + Unpin + Send {}
impl<T: AsyncRead + AsyncWrite + Unpin + Send> Io for T {}

async fn open_stream(
    c: &Campaign,
    i: usize,
    r: &mut StreamResult,
) -> Result<(Box<dyn Io>, Vec<u8>)> {
    let body = json!({
        "model": "builtin",
        "messages": [{"role": "user", "content": format!("halt slo bench, stream {i}")}],
        "stream": true,
        "seed": i,
        "ignore_eos": true,
        "max_tokens": 1_000_000,
    })
    .to_string();
    let tcp = TcpStream::connect(c.api)
        .await
        .with_context(|| format!("connecting to {}", c.api))?;
    tcp.set_nodelay(true)?;
    let mut s: Box<dyn Io> = match &c.tls {
        Some(cfg) => {
            let name = rustls::pki_types::ServerName::try_from("localhost")?;
            let tls = tokio_rustls::TlsConnector::from(Arc::clone(cfg))
                .connect(name, tcp)
                .await
                .context("TLS handshake")?;
            Box::new(tls)
        }
        None => Box::new(tcp),
    };
    // A key of its own per stream: a halt puts its key in degraded safe mode, whose streams
    // are held to the end, and the next stream must not inherit that. One request per
    // connection (`close`): the body is read as plain SSE to the end of the connection.
    let req = format!(
        "POST /v1/chat/completions HTTP/1.1\r\nhost: haltd\r\nauthorization: Bearer halt-slo-bench-{i}\r\nx-haltd-test-tenant: Bearer halt-slo-bench-{i}\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
        body.len()
    );
    s.write_all(req.as_bytes()).await.context("sending")?;

    let mut buf: Vec<u8> = Vec::with_capacity(4096);
    let mut chunk = [0u8; 4096];
    // The head.
    let body_start = loop {
        if let Some(p) = find(&buf, b"\r\n\r\n") {
            break p + 4;
        }
        ensure!(buf.len() < HEAD_MAX, "response head over {HEAD_MAX} bytes");
        let n = s.read(&mut chunk).await.context("reading the head")?;
        ensure!(n > 0, "closed before the response head");
        buf.extend_from_slice(&chunk[..n]);
    };
    {
        let mut headers = [httparse::EMPTY_HEADER; 32];
        let mut resp = httparse::Response::new(&mut headers);
        resp.parse(&buf[..body_start]).context("parsing the head")?;
        r.status = resp.code.unwrap_or(0);
        r.stream_id = resp
            .headers
            .iter()
            .find(|h| h.name.eq_ignore_ascii_case("x-haltd-stream-id"))
            .map(|h| String::from_utf8_lossy(h.value).into_owned())
            .unwrap_or_default();
    }
    ensure!(
        r.status == 200,
        "status {}: {}",
        r.status,
        String::from_utf8_lossy(&buf[body_start..])
    );
    buf.drain(..body_start);
    Ok((s, buf))
}

/// Waits for the trip request's answer and records it in `r`.
async fn record_trip_answer(rx: oneshot::Receiver<TripAnswer>, r: &mut StreamResult) -> Result<()> {
    let (sent, answer) = rx.await.context("trip task")?;
    r.trip_sent = Some(sent);
    match answer {
        Ok((status, v)) => {
            r.trip_status = Some(status);
            r.trip_index = if status == 200 {
                v["trip_token_index"].as_u64()
            } else {
                None
            };
            if status != 200 {
                r.trip_error = Some(format!("{status} {v}"));
            }
        }
        Err(e) => r.trip_error = Some(format!("{e:#}")),
    }
    Ok(())
}

/// When a trip request was sent, and the admin API's status and body.
type TripAnswer = (Instant, Result<(u16, Value)>);

/// `POST /admin/streams/ID/trip`, one connection per trip.
async fn trip(admin: SocketAddr, id: &str) -> Result<(u16, Value)> {
    let body = r#"{"cause":"OPERATOR_TRIP"}"#;
    let mut s = TcpStream::connect(admin)
        .await
        .context("connecting to admin")?;
    s.set_nodelay(true)?;
    let req = format!(
        "POST /admin/streams/{id}/trip HTTP/1.1\r\nhost: haltd\r\nauthorization: Bearer {}\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
        haltd_tests::TEST_ADMIN_TOKEN,
        body.len()
    );
    s.write_all(req.as_bytes()).await?;
    let mut out = Vec::new();
    tokio::time::timeout(Duration::from_secs(30), s.read_to_end(&mut out))
        .await
        .context("admin answer timed out")??;
    let start = find(&out, b"\r\n\r\n").context("admin answer has no head")? + 4;
    let mut headers = [httparse::EMPTY_HEADER; 32];
    let mut resp = httparse::Response::new(&mut headers);
    resp.parse(&out[..start])?;
    let status = resp.code.unwrap_or(0);
    Ok((
        status,
        serde_json::from_slice(&out[start..]).unwrap_or(Value::Null),
    ))
}

fn find(hay: &[u8], needle: &[u8]) -> Option<usize> {
    hay.windows(needle.len()).position(|w| w == needle)
}

/// What a run measured.
#[derive(Debug)]
struct RunResult {
    spec: RunSpec,
    streams: Vec<StreamResult>,
    ledger: Vec<Value>,
    rss_idle_kib: u64,
    rss_open_kib: u64,
    wall_s: f64,
    haltd_log_tail: String,
}

/// haltd's command line for a run: the run's budget, stream limit and pace, and its
/// scenario's faults.
fn haltd_args(spec: &RunSpec) -> Vec<String> {
    let b = spec.budget.to_string();
    let max_streams = (spec.concurrency + 1024).to_string();
    let pace = spec.pace_us.to_string();
    let mut extra: Vec<String> = [
        "--budget",
        &b,
        "--max-streams",
        &max_streams,
        "--builtin-token-interval-us",
        &pace,
        // Every client of the bench is one address, and N connect at once: the admission
        // caps (a defence against hostile clients) would refuse most of them.
        "--max-conns-per-addr",
        "0",
        "--request-phase-share",
        "100",
    ]
    .iter()
    .map(|s| (*s).to_owned())
    .collect();
    if !spec.ledger_fsync {
        extra.push("--ledger-no-fsync".into());
    }
    match spec.scenario {
        Scenario::LateTrip => {}
        Scenario::Adversarial => {
            extra.extend(["--fault".into(), "emitter-ignores-halt".into()]);
            if let Some(ms) = adversarial_grace_ms(spec.concurrency) {
                extra.extend(["--halt-grace-ms".into(), ms.to_string()]);
            }
        }
        Scenario::WatchdogStall => extra.extend([
            "--heartbeat-deadline-ms".into(),
            spec.heartbeat_deadline_ms.to_string(),
            "--fault".into(),
            format!(
                "watchdog-stall-after-ms={}",
                spec.stall_after_ms.unwrap_or(1000)
            ),
        ]),
    }
    extra
}

/// The clients of a run, in the client namespace: `total` streams, `concurrency` at a time.
fn run_clients(c: &Arc<Campaign>) -> Result<Vec<StreamResult>> {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .context("building the client runtime")?;
    rt.block_on(async move {
        let permits = Arc::new(Semaphore::new(c.spec.concurrency));
        let mut tasks = Vec::with_capacity(c.spec.total);
        for i in 0..c.spec.total {
            let (c, permits) = (Arc::clone(c), Arc::clone(&permits));
            tasks.push(tokio::spawn(async move {
                let _permit = permits.acquire_owned().await;
                // The first wave is the first N streams to get a permit, whatever their
                // index: the runtime may start stream 150 before stream 50.
                let first_wave = c.started.fetch_add(1, Ordering::AcqRel) < c.first_wave();
                // A stream that ends before its run's stream limit (a refusal, a stall) is
                // reported, never waited on forever.
                match tokio::time::timeout(Duration::from_secs(300), one_stream(c, i, first_wave))
                    .await
                {
                    Ok(r) => r,
                    Err(_) => StreamResult {
                        failure: Some("no end within 300 s".into()),
                        ..StreamResult::default()
                    },
                }
            }));
        }
        let mut out = Vec::with_capacity(tasks.len());
        for t in tasks {
            out.push(t.await.context("client task panicked")?);
        }
        Ok(out)
    })
}

/// Adds the ledger's incident (trip index and cause) to each stream that has one.
fn note_incidents(ledger: &[Value], streams: &mut [StreamResult]) {
    let incidents: std::collections::HashMap<&str, &Value> = ledger
        .iter()
        .filter(|v| v["kind"] == "incident")
        .filter_map(|v| Some((v["stream_id"].as_str()?, v)))
        .collect();
    for s in streams {
        if let Some(v) = incidents.get(s.stream_id.as_str()) {
            s.ledger_trip_index = v["trip_token_index"].as_u64();
            s.ledger_cause = v["trip_cause"].as_str().map(str::to_owned);
        }
    }
}

fn run_one(spec: RunSpec, progress: &Progress) -> Result<RunResult> {
    let pair = NetPair::new()?;
    let pki = haltd_tests::tls::TestPki::new("halt-slo", &["localhost"])?;
    let mut extra = haltd_args(&spec);
    let tls = if spec.tls {
        extra.extend([
            "--tls-cert".into(),
            pki.cert.display().to_string(),
            "--tls-key".into(),
            pki.key.display().to_string(),
        ]);
        Some(haltd_tests::tls_client::client_config(&pki.ca)?)
    } else {
        None
    };
    let extra_ref: Vec<&str> = extra.iter().map(String::as_str).collect();
    let mut haltd = Haltd::start(&pair, &extra_ref).with_context(|| spec.label())?;
    let pid = haltd.pid().context("haltd has no pid")?;
    let rss_idle_kib = rss_kib(pid).unwrap_or(0);
    let campaign = Arc::new(Campaign {
        spec,
        tls,
        api: haltd.api,
        admin: haltd.admin,
        started: AtomicUsize::new(0),
        opened: AtomicUsize::new(0),
        gate_open: AtomicBool::new(false),
        gate: Notify::new(),
        rss_at_gate_kib: AtomicU64::new(0),
        haltd_pid: pid,
        finished: AtomicUsize::new(0),
        tokens: AtomicU64::new(0),
    });
    let t0 = Instant::now();
    let bar = progress.run_bar(&spec);
    let c = Arc::clone(&campaign);
    let client = spawn_in_netns(&haltd.client_ns, move || -> Result<Vec<StreamResult>> {
        run_clients(&c)
    });
    // Progress while the clients run.
    while !client.is_finished() {
        std::thread::sleep(Duration::from_millis(200));
        progress.tick(
            &bar,
            &spec,
            campaign.finished.load(Ordering::Relaxed),
            campaign.opened.load(Ordering::Relaxed),
            campaign.tokens.load(Ordering::Relaxed),
        );
    }
    let mut streams = client
        .join()
        .map_err(|_| anyhow::anyhow!("client thread panicked"))??;
    let wall_s = t0.elapsed().as_secs_f64();
    bar.finish_and_clear();
    let haltd_log_tail = haltd.log_tail(20);
    // SIGTERM halts nothing here (every stream has ended); the ledger is complete after it.
    haltd.stop().context("stopping haltd")?;
    let ledger = haltd.ledger_records().unwrap_or_default();
    note_incidents(&ledger, &mut streams);
    Ok(RunResult {
        spec,
        streams,
        ledger,
        rss_idle_kib,
        rss_open_kib: campaign.rss_at_gate_kib.load(Ordering::Acquire),
        wall_s,
        haltd_log_tail,
    })
}

/// The progress display: a bar per run on a terminal, a line every 5 s otherwise.
#[derive(Debug)]
struct Progress {
    tty: bool,
    runs: usize,
    done: AtomicUsize,
    last_line: std::sync::Mutex<Instant>,
}

impl Progress {
    fn run_bar(&self, spec: &RunSpec) -> ProgressBar {
        let n = self.done.fetch_add(1, Ordering::Relaxed) + 1;
        let prefix = format!("[{n}/{}] {}", self.runs, spec.label());
        if !self.tty {
            eprintln!("[halt-slo] {prefix}: {} streams", spec.total);
            return ProgressBar::hidden();
        }
        let bar = ProgressBar::new(spec.total as u64);
        bar.set_style(
            ProgressStyle::with_template(
                "{prefix:32} [{elapsed_precise}] {bar:30} {pos}/{len} streams ended {msg}",
            )
            .unwrap_or_else(|_| ProgressStyle::default_bar()),
        );
        bar.set_prefix(prefix);
        bar
    }

    fn tick(&self, bar: &ProgressBar, spec: &RunSpec, finished: usize, opened: usize, tokens: u64) {
        let msg = format!(
            "({opened}/{} of the first wave open, {tokens} tokens)",
            spec.concurrency.min(spec.total)
        );
        if self.tty {
            bar.set_position(finished as u64);
            bar.set_message(msg);
            return;
        }
        let mut last = self
            .last_line
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if last.elapsed() >= Duration::from_secs(5) {
            *last = Instant::now();
            eprintln!(
                "[halt-slo]   {}: {finished}/{} streams ended {msg}",
                spec.label(),
                spec.total
            );
        }
    }
}

fn pct<T: Copy + PartialOrd + Into<f64>>(v: &[T]) -> Value {
    let q = |p: f64| quantile(v, p).map(Into::into);
    json!({
        "n": v.len(),
        "p50": q(0.5), "p95": q(0.95), "p99": q(0.99), "max": q(1.0),
    })
}

fn round2(v: Option<f64>) -> Value {
    v.map_or(Value::Null, |v| json!((v * 100.0).round() / 100.0))
}

/// Up to three streams that did not halt as the scenario says, with their ledger records.
fn not_halted_examples(r: &RunResult) -> Vec<Value> {
    let spec = &r.spec;
    r.streams
        .iter()
        .filter(|s| !s.halted_by(spec.scenario.cause()))
        .take(3)
        .map(|s| {
            json!({
                "stream_id": s.stream_id, "status": s.status, "tokens": s.tokens,
                "done": s.done, "error_code": s.error_code, "trip_error": s.trip_error,
                "failure": s.failure,
                "records": r.ledger.iter()
                    .filter(|v| v["stream_id"] == s.stream_id.as_str())
                    .map(|v| json!({
                        "kind": v["kind"], "outcome": v["outcome"], "trip_cause": v["trip_cause"],
                        "halted_by": v["halted_by"], "kernel": v["kernel"],
                        "trip_token_index": v["trip_token_index"],
                        "tokens_emitted": v["tokens_emitted"], "message": v["message"],
                    }))
                    .collect::<Vec<_>>(),
            })
        })
        .collect()
}

/// What went wrong in a run: a breach of B (seen by the clients or recorded by haltd), failed
/// streams, no halt at all.
fn problems_of(
    spec: &RunSpec,
    breaches: &[&StreamResult],
    srv_post: &[u32],
    failures: &[&StreamResult],
    none_halted: bool,
) -> Vec<String> {
    let b = u64::from(spec.budget);
    let mut problems = Vec::new();
    if !breaches.is_empty() {
        let s = breaches[0];
        problems.push(format!(
            "{}: {} streams got more than B = {b} tokens after the trip (e.g. {}: {} tokens, τ {:?})",
            spec.label(),
            breaches.len(),
            s.stream_id,
            s.tokens,
            s.tau()
        ));
    }
    if srv_post.iter().any(|&p| u64::from(p) > b) {
        problems.push(format!(
            "{}: haltd recorded more than B = {b} post-trip tokens",
            spec.label()
        ));
    }
    if let Some(s) = failures.first() {
        problems.push(format!(
            "{}: {} streams failed, e.g. {}: {}",
            spec.label(),
            failures.len(),
            s.stream_id,
            s.failure.as_deref().unwrap_or_default()
        ));
    }
    if none_halted {
        problems.push(format!("{}: no stream halted", spec.label()));
    }
    problems
}

/// haltd's own view of a run's halts: its incident records for the scenario's cause, with the
/// post-trip tokens and halt latencies they state.
fn ledger_figures(r: &RunResult) -> (Vec<&Value>, Vec<u32>, Vec<f64>) {
    let incidents: Vec<&Value> = r
        .ledger
        .iter()
        .filter(|v| v["kind"] == "incident" && v["trip_cause"] == r.spec.scenario.cause())
        .collect();
    let srv_post: Vec<u32> = incidents
        .iter()
        .filter_map(|v| v["halt_tokens_post_trip"].as_u64())
        .map(|p| u32::try_from(p).unwrap_or(u32::MAX))
        .collect();
    let srv_lat: Vec<f64> = incidents
        .iter()
        .filter_map(|v| v["halt_latency_ms"].as_f64())
        .collect();
    (incidents, srv_post, srv_lat)
}

/// How many streams got each number of post-trip tokens.
fn histogram(post: &[u32]) -> serde_json::Map<String, Value> {
    let mut hist = BTreeMap::new();
    for p in post {
        *hist.entry(*p).or_insert(0_usize) += 1;
    }
    hist.iter()
        .map(|(k, v)| (k.to_string(), json!(v)))
        .collect()
}

/// Summarises a run; also returns the problems found (a breach of B, streams that did not
/// halt as they should).
fn summarise(r: &RunResult) -> (Value, Vec<String>) {
    let spec = &r.spec;
    let b = u64::from(spec.budget);
    let mut problems = Vec::new();
    let halted: Vec<&StreamResult> = r
        .streams
        .iter()
        .filter(|s| s.halted_by(spec.scenario.cause()))
        .collect();
    // Halts whose terminal event never reached the client (the stream just closed).
    let without_terminal = halted.iter().filter(|s| s.error_code.is_none()).count();
    let post: Vec<u32> = halted
        .iter()
        .filter_map(|s| s.post_trip())
        .map(|p| u32::try_from(p).unwrap_or(u32::MAX))
        .collect();
    let lat: Vec<f64> = halted.iter().filter_map(|s| s.halt_latency_ms()).collect();
    let failures: Vec<&StreamResult> = r.streams.iter().filter(|s| s.failure.is_some()).collect();
    let trip_errors: Vec<&StreamResult> = r
        .streams
        .iter()
        .filter(|s| s.trip_error.is_some())
        .collect();
    let not_halted = r.streams.len() - halted.len();
    // What the streams that did not halt as the scenario says looked like (a few).
    let not_halted_examples = not_halted_examples(r);
    let breaches: Vec<&StreamResult> = halted
        .iter()
        .copied()
        .filter(|s| s.post_trip().is_some_and(|p| p > b))
        .collect();
    let (incidents, srv_post, srv_lat) = ledger_figures(r);
    problems.extend(problems_of(
        spec,
        &breaches,
        &srv_post,
        &failures,
        halted.is_empty(),
    ));
    let open_streams = spec.concurrency.min(spec.total);
    let per_stream_kib = (r.rss_open_kib > 0)
        .then(|| (r.rss_open_kib.saturating_sub(r.rss_idle_kib)) as f64 / open_streams as f64);
    let latency_source = if spec.scenario == Scenario::WatchdogStall {
        "ledger"
    } else {
        "client"
    };
    let summary = json!({
        "scenario": spec.scenario.name(),
        "tls": spec.tls,
        "budget": spec.budget,
        "concurrency": spec.concurrency,
        "streams": r.streams.len(),
        "pace_us": spec.pace_us,
        "k_max": spec.k_max,
        "stall_after_ms": spec.stall_after_ms,
        "halt_grace_ms": if spec.scenario == Scenario::Adversarial {
            adversarial_grace_ms(spec.concurrency).unwrap_or(50)
        } else {
            50
        },
        "halted": halted.len(),
        "not_halted": not_halted,
        "halted_without_terminal_event": without_terminal,
        "not_halted_examples": not_halted_examples,
        "failed": failures.len(),
        "trip_errors": trip_errors.len(),
        "breaches": breaches.len(),
        "post_trip_tokens": pct(&post),
        "post_trip_histogram": histogram(&post),
        "halt_latency_ms": pct(&lat),
        "ledger_incidents": incidents.len(),
        "ledger_post_trip_tokens": pct(&srv_post),
        "ledger_halt_latency_ms": pct(&srv_lat),
        "latency_source": latency_source,
        "rss_idle_kib": r.rss_idle_kib,
        "rss_open_kib": r.rss_open_kib,
        "rss_per_open_stream_kib": round2(per_stream_kib),
        "wall_s": (r.wall_s * 10.0).round() / 10.0,
        "tokens": r.streams.iter().map(|s| s.tokens).sum::<u64>(),
    });
    (summary, problems)
}

fn fmt_num(v: &Value) -> String {
    match v {
        Value::Null => "–".into(),
        Value::Number(n) => match n.as_f64() {
            Some(f) if f.fract() != 0.0 && f < 10.0 => format!("{f:.2}"),
            Some(f) if f.fract() != 0.0 => format!("{f:.1}"),
            Some(f) => format!("{f:.0}"),
            None => n.to_string(),
        },
        other => other.to_string(),
    }
}

fn quad(v: &Value) -> String {
    format!(
        "{} / {} / {} / {}",
        fmt_num(&v["p50"]),
        fmt_num(&v["p95"]),
        fmt_num(&v["p99"]),
        fmt_num(&v["max"])
    )
}

fn markdown(report: &Value) -> String {
    let mut md = String::new();
    md_runs(&mut md, report);
    md_memory(&mut md, report);
    md_sub_benches(&mut md, report);
    md
}

/// The summary line and the table of runs, and the halts whose terminal event was lost.
fn md_runs(md: &mut String, report: &Value) {
    let m = &report["machine"];
    let _ = writeln!(
        md,
        "Halt SLO bench, {} ({} CPUs, kernel {}), {} s in all.\n",
        report["date"].as_str().unwrap_or_default(),
        m["nproc"],
        m["kernel"].as_str().unwrap_or_default(),
        report["wall_s"]
    );
    let runs = report["runs"].as_array().map_or(&[][..], Vec::as_slice);
    let halts: u64 = runs.iter().filter_map(|r| r["halted"].as_u64()).sum();
    let breaches: u64 = runs.iter().filter_map(|r| r["breaches"].as_u64()).sum();
    let worst_p95 = runs
        .iter()
        .filter_map(|r| r["post_trip_tokens"]["p95"].as_f64())
        .fold(0.0_f64, f64::max);
    let _ = writeln!(
        md,
        "**{halts} halts in {} runs; {breaches} streams got more than B tokens after the trip; worst post-trip p95 {worst_p95} tokens** (spec 000 §10: p95 ≤ 5 under synthetic breaches).\n",
        runs.len()
    );
    let _ = writeln!(
        md,
        "| scenario | B | N | streams halted | post-trip tokens p50 / p95 / p99 / max | halt latency ms p50 / p95 / p99 / max | haltd's record: post-trip max, latency p99 ms | breaches |"
    );
    md.push_str("|---|---|---|---|---|---|---|---|\n");
    for s in report["runs"].as_array().into_iter().flatten() {
        // The watchdog-stall client has no moment to start a latency from: haltd's own
        // (trip to close) stands in.
        let (lat, lat_note) = if s["latency_source"] == "ledger" {
            (&s["ledger_halt_latency_ms"], " (haltd's)")
        } else {
            (&s["halt_latency_ms"], "")
        };
        let _ = writeln!(
            md,
            "| {} | {} | {} | {} of {} | {} | {}{} | {}, {} | {} |",
            s["scenario"].as_str().unwrap_or_default(),
            s["budget"],
            s["concurrency"],
            s["halted"],
            s["streams"],
            quad(&s["post_trip_tokens"]),
            quad(lat),
            lat_note,
            fmt_num(&s["ledger_post_trip_tokens"]["max"]),
            fmt_num(&s["ledger_halt_latency_ms"]["p99"]),
            s["breaches"]
        );
    }
    let silent: Vec<String> = runs
        .iter()
        .filter(|r| r["halted_without_terminal_event"].as_u64().unwrap_or(0) > 0)
        .map(|r| {
            format!(
                "{} B={} N={}: {}",
                r["scenario"].as_str().unwrap_or_default(),
                r["budget"],
                r["concurrency"],
                r["halted_without_terminal_event"]
            )
        })
        .collect();
    if !silent.is_empty() {
        let _ = writeln!(
            md,
            "\nHalts whose terminal event did not reach the client (the stream closed; τ and the cause from haltd's record; with a stalled watchdog, the kernel gate can see the heartbeat lost before the emitter does, and then drops for good): {}.",
            silent.join("; ")
        );
    }
}

/// Memory per open stream, from the late-trip runs at B = 5.
fn md_memory(md: &mut String, report: &Value) {
    let mem: Vec<&Value> = report["runs"]
        .as_array()
        .into_iter()
        .flatten()
        .filter(|s| s["scenario"] == "late-trip" && s["budget"] == 5)
        .collect();
    if !mem.is_empty() {
        md.push_str("\nMemory per open stream (haltd's resident set with N streams open, minus before any, over N; late-trip, B = 5):\n\n| N | RSS idle MiB | RSS with N open MiB | KiB per open stream |\n|---|---|---|---|\n");
        for s in mem {
            let mib = |k: &Value| {
                k.as_f64()
                    .map_or("–".into(), |k| format!("{:.1}", k / 1024.0))
            };
            let _ = writeln!(
                md,
                "| {} | {} | {} | {} |",
                s["concurrency"],
                mib(&s["rss_idle_kib"]),
                mib(&s["rss_open_kib"]),
                fmt_num(&s["rss_per_open_stream_kib"])
            );
        }
    }
}

/// The folded-in sub-benches (gate cost per send, streaming overhead), notes and problems.
fn md_sub_benches(md: &mut String, report: &Value) {
    let g = &report["gate_send"];
    if g.is_object() {
        let _ = writeln!(
            md,
            "\nGate cost per send (`bench-gate-send`, median of {} rounds of {} 64-byte sends): no gate {} ns, gate {} ns, extra {} ns ({:.2}×); the BPF program itself {} ns per run.",
            g["rounds"], g["sends"], fmt_num(&g["no_gate_ns"]), fmt_num(&g["gate_ns"]),
            fmt_num(&g["extra_ns"]),
            g["gate_ns"].as_f64().unwrap_or(0.0) / g["no_gate_ns"].as_f64().unwrap_or(1.0),
            fmt_num(&g["prog_ns"])
        );
    }
    let o = &report["overhead"];
    if let Some(rows) = o["results"].as_array() {
        let _ = writeln!(
            md,
            "\nStreaming overhead against a plain relay (`bench-proxy-overhead`, one round; \"direct\" is the same upstream without haltd; latency is upstream write to client read):\n\n| N | pace ms | direct p50 / p99 µs | via haltd p50 / p99 µs | added p50 / p99 µs | haltd CPU per token (net) µs |\n|---|---|---|---|---|---|"
        );
        for r in rows {
            let _ = writeln!(
                md,
                "| {} | {} | {} / {} | {} / {} | {} / {} | {} |",
                r["streams"],
                r["pace_ms"],
                fmt_num(&r["direct_p50_us"]),
                fmt_num(&r["direct_p99_us"]),
                fmt_num(&r["via_p50_us"]),
                fmt_num(&r["via_p99_us"]),
                fmt_num(&r["added_p50_us"]),
                fmt_num(&r["added_p99_us"]),
                fmt_num(&r["haltd_cpu_net_us_per_token"])
            );
        }
    }
    for n in o["notes"].as_array().into_iter().flatten() {
        let _ = writeln!(md, "\nNote: {}.", n.as_str().unwrap_or_default());
    }
    if let Some(p) = report["problems"].as_array().filter(|p| !p.is_empty()) {
        md.push_str("\nProblems:\n\n");
        for x in p {
            let _ = writeln!(md, "- {}", x.as_str().unwrap_or_default());
        }
    }
}

mod plot {
    //! The two plots, as SVG (plotters' SVG backend needs no system fonts).

    use std::path::Path;

    use anyhow::{anyhow, Result};
    use plotters::prelude::*;
    use serde_json::Value;

    fn err(e: impl std::fmt::Display) -> anyhow::Error {
        anyhow!("plotting: {e}")
    }

    /// One cell per (scenario, B) row and N column: the share of halted streams with each
    /// post-trip token count.
    pub fn post_trip_tokens(runs: &[Value], path: &Path) -> Result<()> {
        let rows = row_keys(runs);
        let cols = col_keys(runs);
        if rows.is_empty() || cols.is_empty() {
            return Ok(());
        }
        let (w, h) = (260 * cols.len() as u32 + 40, 190 * rows.len() as u32 + 60);
        let root = SVGBackend::new(path, (w, h)).into_drawing_area();
        root.fill(&WHITE).map_err(err)?;
        let root = root
            .titled(
                "Tokens the client received after the trip (share of halted streams)",
                ("sans-serif", 20),
            )
            .map_err(err)?;
        let cells = root.split_evenly((rows.len(), cols.len()));
        for (ri, (scenario, budget)) in rows.iter().enumerate() {
            for (ci, n) in cols.iter().enumerate() {
                let area = &cells[ri * cols.len() + ci];
                let Some(run) = runs.iter().find(|r| {
                    r["scenario"] == scenario.as_str()
                        && r["budget"].as_u64() == Some(*budget)
                        && r["concurrency"].as_u64() == Some(*n)
                }) else {
                    continue;
                };
                let hist: Vec<(u32, f64)> = run["post_trip_histogram"]
                    .as_object()
                    .map(|m| {
                        let total: u64 = m.values().filter_map(Value::as_u64).sum();
                        m.iter()
                            .filter_map(|(k, v)| {
                                Some((k.parse().ok()?, v.as_u64()? as f64 / total.max(1) as f64))
                            })
                            .collect()
                    })
                    .unwrap_or_default();
                let x_max = hist
                    .iter()
                    .map(|(k, _)| *k)
                    .max()
                    .unwrap_or(0)
                    .max(*budget as u32)
                    + 1;
                let mut chart = ChartBuilder::on(area)
                    .caption(format!("{scenario} B={budget} N={n}"), ("sans-serif", 13))
                    .margin(6)
                    .x_label_area_size(22)
                    .y_label_area_size(34)
                    .build_cartesian_2d((0u32..x_max).into_segmented(), 0f64..1.05)
                    .map_err(err)?;
                chart
                    .configure_mesh()
                    .disable_x_mesh()
                    .y_labels(3)
                    .label_style(("sans-serif", 10))
                    .draw()
                    .map_err(err)?;
                chart
                    .draw_series(
                        Histogram::vertical(&chart)
                            .style(BLUE.mix(0.7).filled())
                            .margin(3)
                            .data(hist.iter().copied()),
                    )
                    .map_err(err)?;
                // The budget: bars right of this line would be breaches.
                let b = *budget as u32;
                chart
                    .draw_series(std::iter::once(PathElement::new(
                        vec![
                            (SegmentValue::Exact(b + 1), 0.0),
                            (SegmentValue::Exact(b + 1), 1.05),
                        ],
                        RED.stroke_width(1),
                    )))
                    .map_err(err)?;
            }
        }
        root.present().map_err(err)?;
        Ok(())
    }

    /// One cell per (scenario, B): halt latency p50/p95/p99/max against N, both log scales.
    pub fn halt_latency(runs: &[Value], path: &Path) -> Result<()> {
        let rows = row_keys(runs);
        if rows.is_empty() {
            return Ok(());
        }
        let ncols = 2usize;
        let nrows = rows.len().div_ceil(ncols);
        let root = SVGBackend::new(path, (900, 260 * nrows as u32 + 50)).into_drawing_area();
        root.fill(&WHITE).map_err(err)?;
        let root = root
            .titled(
                "Halt latency (ms) against concurrent streams",
                ("sans-serif", 20),
            )
            .map_err(err)?;
        let cells = root.split_evenly((nrows, ncols));
        for (i, (scenario, budget)) in rows.iter().enumerate() {
            let mine: Vec<&Value> = runs
                .iter()
                .filter(|r| {
                    r["scenario"] == scenario.as_str() && r["budget"].as_u64() == Some(*budget)
                })
                .collect();
            let series = |q: &str| latency_series(&mine, q);
            let (y_min, y_max) = latency_range(&mine);
            let source = if *scenario == "watchdog-stall" {
                " (haltd's record)"
            } else {
                " (client)"
            };
            let mut chart = ChartBuilder::on(&cells[i])
                .caption(format!("{scenario} B={budget}{source}"), ("sans-serif", 14))
                .margin(8)
                .x_label_area_size(28)
                .y_label_area_size(44)
                .build_cartesian_2d((0.7f64..15000.0).log_scale(), (y_min..y_max).log_scale())
                .map_err(err)?;
            chart
                .configure_mesh()
                .x_desc("concurrent streams")
                .y_desc("ms")
                .x_label_formatter(&|v| format!("{v:.0}"))
                .y_label_formatter(&|v| {
                    if *v >= 1.0 {
                        format!("{v:.0}")
                    } else {
                        format!("{v:.2}")
                    }
                })
                .label_style(("sans-serif", 10))
                .draw()
                .map_err(err)?;
            for (q, color) in [
                ("p50", &GREEN),
                ("p95", &BLUE),
                ("p99", &MAGENTA),
                ("max", &RED),
            ] {
                let pts = series(q);
                chart
                    .draw_series(LineSeries::new(pts.clone(), color.stroke_width(2)))
                    .map_err(err)?
                    .label(q)
                    .legend(move |(x, y)| {
                        PathElement::new(vec![(x, y), (x + 14, y)], color.stroke_width(2))
                    });
                chart
                    .draw_series(pts.into_iter().map(|p| Circle::new(p, 3, color.filled())))
                    .map_err(err)?;
            }
            chart
                .configure_series_labels()
                .background_style(WHITE.mix(0.8))
                .border_style(BLACK)
                .label_font(("sans-serif", 10))
                .position(SeriesLabelPosition::UpperLeft)
                .draw()
                .map_err(err)?;
        }
        root.present().map_err(err)?;
        Ok(())
    }

    /// Halt latency quantile `q` against the stream count, the client's figure or, without
    /// one, haltd's.
    fn latency_series(runs: &[&Value], q: &str) -> Vec<(f64, f64)> {
        runs.iter()
            .filter_map(|r| {
                Some((
                    r["concurrency"].as_f64()?,
                    r["halt_latency_ms"][q]
                        .as_f64()
                        .or_else(|| r["ledger_halt_latency_ms"][q].as_f64())?
                        .max(0.01),
                ))
            })
            .collect()
    }

    /// The latency axis: from half the smallest figure (at most 0.5 ms) to twice the largest
    /// (at least 2 ms).
    fn latency_range(runs: &[&Value]) -> (f64, f64) {
        let all: Vec<f64> = ["p50", "p95", "p99", "max"]
            .iter()
            .flat_map(|q| latency_series(runs, q).into_iter().map(|p| p.1))
            .collect();
        let y_max = all.iter().copied().fold(1.0_f64, f64::max) * 2.0;
        let y_min = all.iter().copied().fold(f64::INFINITY, f64::min).min(1.0) / 2.0;
        (y_min, y_max)
    }

    fn row_keys(runs: &[Value]) -> Vec<(String, u64)> {
        let mut rows: Vec<(String, u64)> = Vec::new();
        for r in runs {
            let key = (
                r["scenario"].as_str().unwrap_or_default().to_owned(),
                r["budget"].as_u64().unwrap_or_default(),
            );
            if !rows.contains(&key) {
                rows.push(key);
            }
        }
        rows
    }

    fn col_keys(runs: &[Value]) -> Vec<u64> {
        let mut cols: Vec<u64> = runs
            .iter()
            .filter_map(|r| r["concurrency"].as_u64())
            .collect();
        cols.sort_unstable();
        cols.dedup();
        cols
    }
}

/// The sibling binary `name` next to this executable.
fn sibling(name: &str) -> Result<PathBuf> {
    let exe = std::env::current_exe().context("locating this executable")?;
    let p = exe.with_file_name(name);
    ensure!(
        p.is_file(),
        "{} is missing (build the package's binaries: `cargo build --release -p haltd-tests --bins`)",
        p.display()
    );
    Ok(p)
}

fn gate_send() -> Result<Value> {
    let bin = sibling("bench-gate-send")?;
    eprintln!("[halt-slo] gate cost per send: {}", bin.display());
    let out = Command::new(&bin)
        .args(["200000", "5"])
        .output()
        .with_context(|| format!("running {}", bin.display()))?;
    let stdout = String::from_utf8_lossy(&out.stdout);
    ensure!(
        out.status.success(),
        "bench-gate-send failed: {}{}",
        stdout,
        String::from_utf8_lossy(&out.stderr)
    );
    let line = stdout
        .lines()
        .rev()
        .find(|l| l.starts_with('{'))
        .context("bench-gate-send printed no JSON line")?;
    Ok(serde_json::from_str(line)?)
}

/// One `bench-proxy-overhead` invocation; its report.
fn overhead_run(streams: &[usize], extra: &[String], out: &Path) -> Result<Value> {
    let bin = sibling("bench-proxy-overhead")?;
    let list = streams
        .iter()
        .map(ToString::to_string)
        .collect::<Vec<_>>()
        .join(",");
    // The nginx route and the scorer-stall scenario are issue 11's figures, the Messages
    // comparison issue 34's, measured by running bench-proxy-overhead itself; here it stays
    // the direct-versus-haltd overhead.
    let fixed = [
        "--rounds",
        "1",
        "--no-nginx",
        "--no-scorer-stall",
        "--no-messages",
    ];
    eprintln!(
        "[halt-slo] streaming overhead against a plain relay: {} --streams {list} {} {}",
        bin.display(),
        fixed.join(" "),
        extra.join(" ")
    );
    let status = Command::new(&bin)
        .args(["--streams", &list])
        .args(fixed)
        .args(extra)
        .arg("--out")
        .arg(out)
        .status()
        .with_context(|| format!("running {}", bin.display()))?;
    ensure!(status.success(), "bench-proxy-overhead failed ({status})");
    let text = fs::read_to_string(out).with_context(|| format!("reading {}", out.display()))?;
    Ok(serde_json::from_str(&text)?)
}

/// The streaming overhead at each count: up to 1,000 streams in one invocation at the proxy
/// bench's own 20 ms pace; above, one invocation per count at N × 50 µs (about 20,000 tokens/s
/// through each path, as in the halt runs) with 20 tokens per stream. A proxied stream holds
/// two sockets in haltd, so a count is lowered to what the open-file limit allows, and the
/// report says so. Returns `{"results": [...], "reports": [...], "notes": [...]}`; every
/// result row carries its pace.
fn overhead(streams: &[usize], dir: &Path) -> Result<Value> {
    let mut results = Vec::new();
    let mut reports = Vec::new();
    let mut notes = Vec::new();
    let small: Vec<usize> = streams.iter().copied().filter(|&n| n <= 1000).collect();
    if !small.is_empty() {
        let r = overhead_run(&small, &[], &dir.join("proxy-overhead.json"))?;
        for row in r["results"].as_array().into_iter().flatten() {
            let mut row = row.clone();
            row["pace_ms"] = r["pace_ms"].clone();
            results.push(row);
        }
        reports.push(r);
    }
    let fd_cap = (nofile_limit().saturating_sub(2_000) / 2) as usize;
    for &asked in streams.iter().filter(|&&n| n > 1000) {
        let n = asked.min(fd_cap);
        if n < asked {
            notes.push(format!(
                "{asked} proxied streams need {} sockets in haltd (client and upstream side), over this machine's open-file limit of {}: measured at {n}",
                asked * 2,
                nofile_limit()
            ));
        }
        let pace_ms = (n as u64 * 50).div_ceil(1000);
        let extra = [
            "--pace-ms".to_owned(),
            pace_ms.to_string(),
            "--tokens".to_owned(),
            "20".to_owned(),
            "--max-streams".to_owned(),
            (n + 1024).to_string(),
        ];
        let r = overhead_run(&[n], &extra, &dir.join(format!("proxy-overhead-{n}.json")))?;
        for row in r["results"].as_array().into_iter().flatten() {
            let mut row = row.clone();
            row["pace_ms"] = r["pace_ms"].clone();
            row["streams_asked"] = json!(asked);
            results.push(row);
        }
        reports.push(r);
    }
    Ok(json!({"results": results, "reports": reports, "notes": notes}))
}

/// The open-file limit, soft and hard (`None` if it cannot be read).
fn nofile() -> Option<libc::rlimit> {
    let mut l = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit with a valid pointer to a local.
    (unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut l) } == 0).then_some(l)
}

/// The soft open-file limit (after [`raise_nofile`]), which haltd inherits.
fn nofile_limit() -> u64 {
    nofile().map_or(1024, |l| l.rlim_cur)
}

fn machine() -> Value {
    let nproc = std::thread::available_parallelism().map_or(0, usize::from);
    let kernel = fs::read_to_string("/proc/sys/kernel/osrelease")
        .unwrap_or_default()
        .trim()
        .to_owned();
    let cpu = fs::read_to_string("/proc/cpuinfo")
        .unwrap_or_default()
        .lines()
        .find(|l| l.starts_with("model name"))
        .and_then(|l| l.split(':').nth(1))
        .unwrap_or_default()
        .trim()
        .to_owned();
    json!({"nproc": nproc, "kernel": kernel, "cpu": cpu})
}

fn default_out_dir() -> Result<PathBuf> {
    // target/<profile>/bench-halt-slo → target/bench/halt-slo
    let exe = std::env::current_exe()?;
    let target = exe
        .parent()
        .and_then(Path::parent)
        .context("this executable is not in a target directory")?;
    Ok(target.join("bench").join("halt-slo"))
}

/// Raises the open-file limit to its hard limit (10,000 streams are 10,000 sockets on each
/// side; haltd inherits the limit).
fn raise_nofile() {
    if let Some(mut l) = nofile().filter(|l| l.rlim_cur < l.rlim_max) {
        l.rlim_cur = l.rlim_max;
        // SAFETY: setrlimit with a valid pointer to a local.
        unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &l) };
    }
}

impl Args {
    /// `--quick`: smaller defaults; counts given on the command line stay.
    fn apply_quick(&mut self) {
        if self.streams == [1, 100, 1000, 10000] {
            self.streams = vec![1, 100];
        }
        if self.min_trips == 200 {
            self.min_trips = 40;
        }
        self.k_max = self.k_max.min(20);
        self.no_gate_send = true;
        self.no_overhead = true;
    }
}

/// One run per scenario, budget and stream count.
fn run_specs(args: &Args) -> Vec<RunSpec> {
    let mut specs = Vec::new();
    for &scenario in &args.scenarios {
        for &budget in &args.budgets {
            for &n in &args.streams {
                specs.push(RunSpec {
                    scenario,
                    ledger_fsync: args.ledger_fsync,
                    tls: args.tls,
                    budget,
                    concurrency: n,
                    total: n.max(args.min_trips),
                    pace_us: if scenario == Scenario::Adversarial {
                        adversarial_pace_us(n)
                    } else {
                        pace_us(n)
                    },
                    k_max: args.k_max,
                    stall_after_ms: (scenario == Scenario::WatchdogStall)
                        .then(|| stall_after_ms(n)),
                    heartbeat_deadline_ms: args.heartbeat_deadline_ms,
                });
            }
        }
    }
    // A watchdog-stall run halts every open stream at once, and a stalled haltd serves no
    // more: one wave of N streams per run.
    for s in &mut specs {
        if s.scenario == Scenario::WatchdogStall {
            s.total = s.concurrency;
        }
    }
    specs
}

/// Runs every spec in turn; returns each run's summary and the problems seen.
fn run_all(specs: &[RunSpec], progress: &Progress) -> Result<(Vec<Value>, Vec<String>)> {
    let mut summaries = Vec::new();
    let mut problems = Vec::new();
    for spec in specs {
        let r = run_one(*spec, progress)?;
        let (s, p) = summarise(&r);
        eprintln!(
            "[halt-slo] {}: {} of {} halted; post-trip tokens p50/p95/p99/max {}; halt latency ms {}; {} s",
            spec.label(),
            s["halted"],
            s["streams"],
            quad(&s["post_trip_tokens"]),
            quad(if spec.scenario == Scenario::WatchdogStall {
                &s["ledger_halt_latency_ms"]
            } else {
                &s["halt_latency_ms"]
            }),
            s["wall_s"]
        );
        if !p.is_empty() {
            for x in &p {
                eprintln!("[halt-slo]   PROBLEM {x}");
            }
            eprintln!("[halt-slo]   haltd's log ends:\n{}", r.haltd_log_tail);
        }
        problems.extend(p);
        summaries.push(s);
    }
    Ok((summaries, problems))
}

/// Writes the JSON report, its Markdown summary (also printed) and the plots into `out_dir`.
fn write_outputs(out_dir: &Path, report: &Value) -> Result<()> {
    let json_path = out_dir.join("halt-slo.json");
    fs::write(&json_path, format!("{report:#}\n"))
        .with_context(|| format!("writing {}", json_path.display()))?;
    let md = markdown(report);
    let md_path = out_dir.join("halt-slo.md");
    fs::write(&md_path, &md).with_context(|| format!("writing {}", md_path.display()))?;
    let runs = report["runs"].as_array().cloned().unwrap_or_default();
    let post_svg = out_dir.join("post-trip-tokens.svg");
    let lat_svg = out_dir.join("halt-latency.svg");
    plot::post_trip_tokens(&runs, &post_svg)?;
    plot::halt_latency(&runs, &lat_svg)?;
    println!("{md}");
    println!(
        "report: {}\nsummary: {}\nplots: {}, {}",
        json_path.display(),
        md_path.display(),
        post_svg.display(),
        lat_svg.display()
    );
    Ok(())
}

fn main() -> Result<()> {
    let mut args = Args::parse();
    if args.quick {
        args.apply_quick();
    }
    ensure!(
        args.streams.iter().all(|&n| n > 0),
        "--streams: every count must be at least 1"
    );
    ensure!(args.k_max >= 1, "--k-max must be at least 1");
    haltd_tests::require_root()?;
    haltd_tests::haltd_bin().context("HALTD_BIN must name a haltd built with the `fault-injection` feature (`cargo xtask bench` builds one)")?;
    raise_nofile();
    let out_dir = match &args.out_dir {
        Some(d) => d.clone(),
        None => default_out_dir()?,
    };
    fs::create_dir_all(&out_dir).with_context(|| format!("creating {}", out_dir.display()))?;

    let specs = run_specs(&args);
    let progress = Progress {
        tty: std::io::stderr().is_terminal(),
        runs: specs.len(),
        done: AtomicUsize::new(0),
        last_line: std::sync::Mutex::new(Instant::now()),
    };
    let started = Instant::now();
    let (summaries, mut problems) = run_all(&specs, &progress)?;
    let gate = if args.no_gate_send {
        Value::Null
    } else {
        gate_send().unwrap_or_else(|e| {
            problems.push(format!("gate cost per send: {e:#}"));
            Value::Null
        })
    };
    let over = if args.no_overhead {
        Value::Null
    } else {
        overhead(&args.overhead_streams, &out_dir).unwrap_or_else(|e| {
            problems.push(format!("streaming overhead: {e:#}"));
            Value::Null
        })
    };
    let report = json!({
        "bench": "halt_slo",
        "date": haltd::clock::rfc3339_now(),
        "machine": machine(),
        "haltd": haltd_tests::haltd_bin().map(|p| p.display().to_string()).unwrap_or_default(),
        "args": {
            "streams": args.streams, "budgets": args.budgets, "min_trips": args.min_trips,
            "k_max": args.k_max, "heartbeat_deadline_ms": args.heartbeat_deadline_ms,
            "scenarios": args.scenarios.iter().map(|s| s.name()).collect::<Vec<_>>(),
        },
        "runs": summaries,
        "gate_send": gate,
        "overhead": over,
        "problems": problems,
        "wall_s": started.elapsed().as_secs(),
    });
    write_outputs(&out_dir, &report)?;
    if !problems.is_empty() {
        bail!(
            "{} problem(s), listed above and in the report",
            problems.len()
        );
    }
    Ok(())
}
