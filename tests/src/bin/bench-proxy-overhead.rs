//! `bench-proxy-overhead`: what haltd adds per token when it proxies an OpenAI-compatible
//! upstream, in latency and in CPU time, measured in one run against the same upstream reached
//! directly (issue 3, point 7; target: under 50 µs added at p99 at 1, 100 and 1000 concurrent
//! streams) and through nginx, a plain relay that nobody here wrote (issue 11: haltd's CPU per
//! token at most 1.5 × nginx's, at most 0.2 ms added to the time to first byte at p50, and a
//! stalled external scorer leaving the other streams' p99 within 10 %).
//!
//! ```text
//! HALTD_BIN=target/release/haltd bench-proxy-overhead [--streams 1,100,1000] [--rounds 3]
//!     [--tokens T] [--pace-ms 20] [--workers W] [--max-streams 8192] [--out FILE]
//!     [--nginx /usr/sbin/nginx | --no-nginx]
//!     [--stall-streams 100] [--scorer-deadline-us 2000] [--stall-us US] [--no-scorer-stall]
//!     [--ttfb-requests 200] [--upstream-tls] [--client-tls] [--tls-streams 1,100]
//!     [--no-messages] [--messages-streams 1,100] [--messages-rounds 5]
//! ```
//!
//! Needs root (haltd loads its kernel halt gate) and a release haltd in `HALTD_BIN`;
//! `cargo xtask bench` builds one with the gate embedded and runs this with it. The sibling
//! binaries `scripted-upstream` and `bench-proxy` are taken from this executable's directory.
//! nginx comes from the Debian package `nginx`; without it the nginx route is skipped, and
//! the report says so.
//!
//! It starts one `scripted-upstream` (with `--keep-alive`, so that nginx can pool its upstream
//! connections), one `haltd serve --source openai` in front of it and one nginx reverse proxy
//! in front of it (`proxy_buffering off`, an upstream `keepalive` pool, as many worker
//! processes as haltd has workers), all on 127.0.0.1, and keeps them for the whole run. Then,
//! for each stream count N and each of R rounds, it runs `bench-proxy` (N concurrent streams
//! of the upstream's `bench` script, whose tokens carry the CLOCK_MONOTONIC time they were
//! written) once per route: against the upstream (`direct`), through haltd (`via`) and through
//! nginx (`nginx`), rotating the order of the routes from round to round. Token latency is the
//! time from the upstream's write to the client's read, so `added = via - direct` is what the
//! extra hop costs: haltd's parse, govern, re-encode and send, plus one more loopback TCP hop
//! and the scheduling around it (all processes share the machine's CPUs). The client also
//! reports each request's time to first byte (request written → first response byte), so the
//! time haltd and nginx add before a response begins is `route - direct` too. Inside an
//! N-stream burst that figure includes the queueing of N simultaneous requests, so before the
//! bursts an unloaded probe measures it alone: `--ttfb-requests` (default 200) sequential
//! requests per route, one at a time, each on a new client connection, routes taking turns
//! (after 10 unmeasured ones per route that fill the proxies' upstream pools); see
//! `haltd_tests::seq_ttfb`. Its p50 added by haltd is the figure of issue 11's target. In the
//! same probe, requests through haltd alternate between a new client connection and one kept
//! alive from request to request (both say `connection: keep-alive`): the time to first byte
//! of a reused connection against a new one (from the connect, and from the write), issue 12.
//!
//! CPU time per token is a proxy's CPU time (user + system, all threads; for nginx the sum
//! over its master and worker processes; read from the kernel's per-process CPU clock,
//! `clock_getcpuclockid`, with nanosecond resolution, as `/proc/PID/stat` ticks are too coarse
//! for a 200-token run) over the run divided by the tokens the client received. haltd also
//! burns CPU with no stream open (the watchdog's heartbeat, timers): the `net` figure
//! subtracts the proxy's CPU rate during the same round's direct run (the proxy idle while the
//! same load runs beside it; quieter still, its rate before the first run is reported as
//! `idle`); nginx's is netted the same way. The upstream's and the client's CPU per token are
//! shown for scale, and so is how busy the machine's CPUs were (haltd + nginx + upstream +
//! client CPU over wall time and CPUs): near 100 % a run measures queueing on a saturated
//! machine, not the proxy. The kernel's accept-queue overflow and SYN retransmit counters are
//! read around each run: a stream whose connect was dropped starts a second or more late.
//!
//! Then (unless `--no-scorer-stall`) the scorer-stall scenario: a second haltd whose
//! HaltMonitor asks an external scorer for every token's score (`[detectors.halt_monitor]
//! scorer = { unix = ..., deadline_us = D }`, mode `observe`), the scorer being served by this
//! process. Each round runs `--stall-streams` measured streams through it beside one more
//! stream, the victim, twice: once with the scorer answering every token at once, and once
//! with it sleeping `--stall-us` (default 90 % of D) before each answer for the victim's
//! tokens only. The measured streams' per-token latency p99 with the stall over without it is
//! the isolation figure (target ≤ 1.10). See [`stall`] and docs/bench.md.
//!
//! Then (unless `--no-messages`), on the same upstream and haltd with nginx stopped, the
//! Anthropic Messages API and the OpenAI Responses API beside chat (issue 34, point 7; issue
//! 35, point 6): the time to first byte haltd adds unloaded and the latency it adds per
//! token, on each surface, medians of `--messages-rounds` rotating rounds; see [`messages`]
//! and docs/bench.md.
//!
//! With `--upstream-tls`, last, the cost of TLS to the upstream: haltd in front of a TLS twin
//! of the upstream against haltd in front of the plain one, in the same run (CPU per token,
//! latency, time to first byte with a warm pool and with a new connection per turn); see
//! [`upstream_tls`] and docs/bench.md. With `--client-tls`, the cost of TLS for clients:
//! haltd serving TLS (`--tls-cert`) against haltd serving plain HTTP, to the same load in the
//! same run (CPU per token, per-token latency, time to first byte); see [`client_tls`].
//!
//! Per N, the report takes the median over the rounds of each figure and prints tables with
//! PASS or MISS against the targets, and writes the same as JSON to
//! `target/bench/proxy-overhead.json` (`--out` to change; its keys are the `json!` at the end
//! of `main`, below). A benchmark reports: missing a target does not fail the run, but any
//! stream error, a run with no tokens, or haltd, nginx or the upstream exiting does (after the
//! report is written, where possible).

use std::{
    fs,
    io::{BufRead, BufReader},
    net::TcpListener,
    path::{Path, PathBuf},
    process::{Child, Command, Stdio},
    thread,
    time::{Duration, Instant},
};

use anyhow::{bail, ensure, Context, Result};
use clap::Parser;
use haltd_tests::{
    proc_cpu::{proc_stat_ticks, process_cpu_ns},
    seq_ttfb,
};
use serde::Deserialize;
use serde_json::{json, Value};

/// The target of issue 3, point 7: p99 latency haltd adds per token, in microseconds.
const TARGET_ADDED_P99_US: f64 = 50.0;
/// Issue 11: haltd's net CPU per proxied token over nginx's, at most.
const TARGET_CPU_RATIO: f64 = 1.5;
/// Issue 11: time to first byte haltd adds at p50, in microseconds, at most.
const TARGET_ADDED_TTFB_P50_US: f64 = 200.0;
/// Issue 11: the other streams' per-token p99 with one stream's scorer stalled over without,
/// at most.
const TARGET_STALL_P99_RATIO: f64 = 1.10;
/// Idle time before the first run over which haltd's idle CPU rate is measured.
const IDLE_WINDOW: Duration = Duration::from_secs(1);
/// Pause after each client run before the CPU clocks are read again, so that work haltd does
/// after the last byte (closing sockets, ledger records) is counted with its run.
const SETTLE: Duration = Duration::from_millis(200);
/// Share of the CPUs (percent) other processes may use during a run before it is flagged.
const OTHERS_WARN_PCT: f64 = 5.0;
/// How long haltd and the upstream get to come up.
const READY_TIMEOUT: Duration = Duration::from_secs(20);

/// haltd's added per-token latency and CPU time versus the upstream reached directly.
#[derive(Debug, Parser)]
#[command(name = "bench-proxy-overhead")]
struct Args {
    /// Concurrent stream counts to measure, comma-separated.
    #[arg(long, value_delimiter = ',', default_values_t = [1usize, 100, 1000])]
    streams: Vec<usize>,
    /// Rounds per stream count (direct and via haltd each run once per round).
    #[arg(long, default_value_t = 3)]
    rounds: usize,
    /// Tokens per stream (default: 200 for 1 stream, 100 up to 100 streams, 150 above).
    #[arg(long)]
    tokens: Option<usize>,
    /// The upstream's delay before each token, in milliseconds.
    #[arg(long, default_value_t = 20)]
    pace_ms: u64,
    /// haltd's data-plane worker threads (`haltd serve --workers`; default: haltd's own).
    #[arg(long)]
    workers: Option<usize>,
    /// `haltd serve --max-streams` (the watchdog scans this many slots every heartbeat, so it
    /// sets haltd's background CPU).
    #[arg(long, default_value_t = 8192)]
    max_streams: u32,
    /// JSON report (default: `bench/proxy-overhead.json` in the target directory this binary
    /// was built into, i.e. `target/bench/proxy-overhead.json`).
    #[arg(long)]
    out: Option<PathBuf>,
    /// The nginx binary of the third route (Debian package `nginx`); the route is skipped,
    /// with a note, when it is not there.
    #[arg(long, default_value = "/usr/sbin/nginx")]
    nginx: PathBuf,
    /// Leave out the nginx route.
    #[arg(long)]
    no_nginx: bool,
    /// Leave out the scorer-stall scenario.
    #[arg(long)]
    no_scorer_stall: bool,
    /// Measured streams of the scorer-stall scenario (the stalled stream comes on top).
    #[arg(long, default_value_t = 100)]
    stall_streams: usize,
    /// The external scorer's per-token deadline in the scorer-stall scenario (`deadline_us`).
    #[arg(long, default_value_t = 2000)]
    scorer_deadline_us: u64,
    /// How long the scorer sleeps before it answers each of the stalled stream's tokens
    /// (default: 90 % of `--scorer-deadline-us`, so that the answer still comes in time).
    #[arg(long)]
    stall_us: Option<u64>,
    /// Sequential requests per route of the unloaded time-to-first-byte probe (0 skips it).
    #[arg(long, default_value_t = 200)]
    ttfb_requests: usize,
    /// Also measure TLS to the upstream against plain HTTP (see `upstream_tls`).
    #[arg(long)]
    upstream_tls: bool,
    /// Also measure TLS for clients (`--tls-cert`) against plain HTTP (see `client_tls`).
    #[arg(long)]
    client_tls: bool,
    /// Concurrent stream counts of the `--upstream-tls` and `--client-tls` comparisons,
    /// comma-separated.
    #[arg(long, value_delimiter = ',', default_values_t = [1usize, 100])]
    tls_streams: Vec<usize>,
    /// Idle upstream connections each haltd worker keeps (`haltd serve --upstream-pool-idle`):
    /// by default as many as each nginx worker keeps (`keepalive`), the same configuration
    /// for both relays. haltd's own default is 32.
    #[arg(long, default_value_t = NGINX_KEEPALIVE)]
    haltd_pool_idle: usize,
    /// How long haltd keeps an idle upstream connection (`--upstream-pool-idle-timeout-ms`):
    /// by default nginx's `keepalive_timeout` here (600 s). haltd's own default is 4 s.
    #[arg(long, default_value_t = NGINX_KEEPALIVE_TIMEOUT_S * 1000)]
    haltd_pool_idle_timeout_ms: u64,
    /// Leave out the comparison of the Messages and Responses surfaces with chat (see
    /// `messages`).
    #[arg(long)]
    no_messages: bool,
    /// Concurrent stream counts of the surfaces' comparison, comma-separated.
    #[arg(long, value_delimiter = ',', default_values_t = [1usize, 100])]
    messages_streams: Vec<usize>,
    /// Rounds of the surfaces' comparison (each: direct, then chat, Messages and Responses in
    /// rotating order), for the bursts and for the unloaded time to first byte.
    #[arg(long, default_value_t = 5)]
    messages_rounds: usize,
}

/// Tokens per stream for N streams: each run takes a few seconds at 20 ms pace. Above 100
/// streams the runs are long enough for connections whose SYN was dropped by a full accept
/// queue (retried after 1 s) to overlap the first ones, so the N streams really run together.
fn default_tokens(streams: usize) -> usize {
    match streams {
        0..=1 => 200,
        2..=100 => 100,
        _ => 150,
    }
}

/// `bench-proxy --json`'s last line.
#[derive(Debug, Clone, Deserialize)]
struct ClientReport {
    requests: u64,
    tokens: u64,
    errors: u64,
    p50_us: Option<f64>,
    p90_us: Option<f64>,
    p99_us: Option<f64>,
    max_us: Option<f64>,
    mean_us: Option<f64>,
    wall_s: f64,
    /// Time to first byte and to first token, per request.
    #[serde(default)]
    ttfb_p50_us: Option<f64>,
    #[serde(default)]
    ttfb_p99_us: Option<f64>,
    #[serde(default)]
    ttft_p50_us: Option<f64>,
    #[serde(default)]
    ttft_p99_us: Option<f64>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Route {
    Direct,
    Via,
    Nginx,
}

impl Route {
    fn name(self) -> &'static str {
        match self {
            Self::Direct => "direct",
            Self::Via => "via",
            Self::Nginx => "nginx",
        }
    }
}

/// A process whose CPU time a run accounts for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Who {
    Haltd,
    Nginx,
}

/// One client run and the CPU the servers spent during it.
#[derive(Debug)]
struct Run {
    streams: usize,
    round: usize,
    path: Route,
    tokens_per_stream: usize,
    client: ClientReport,
    /// Wall time between the two CPU readings.
    window_s: f64,
    haltd_cpu_us: f64,
    /// nginx's master and workers together; 0 without nginx.
    nginx_cpu_us: f64,
    upstream_cpu_us: f64,
    /// The client's (`bench-proxy`'s) CPU time.
    client_cpu_us: f64,
    /// haltd + nginx + upstream + client CPU over the window, in percent of all the machine's
    /// CPUs: near 100 the run measures a saturated machine.
    busy_pct: f64,
    /// CPU time of everything else on the machine over the window (all CPUs' non-idle time
    /// from `/proc/stat` less the bench's processes), in percent of all CPUs: other work that
    /// competed with the run, e.g. a compile; above a few percent the run is disturbed.
    others_pct: f64,
    /// TcpExt counters over the run (this network namespace): accept-queue overflows and SYN
    /// retransmissions, i.e. connections that started a second or more late.
    listen_overflows: u64,
    syn_retrans: u64,
}

fn main() -> Result<()> {
    let args = Args::parse();
    check_args(&args)?;
    let bins = Bins::locate()?;
    let out = match &args.out {
        Some(p) => p.clone(),
        None => default_out(&bins.dir),
    };

    // Two sockets per stream in haltd (client and upstream), one in the upstream and the client.
    raise_nofile_limit();
    let cpu_clock = CpuClock::probe();
    let machine = machine();
    let haltd_bin = bins.haltd.display();
    let (nproc, kernel, cpu) = (machine.nproc, &machine.kernel, &machine.cpu);
    eprintln!("bench-proxy-overhead: {nproc} CPUs, Linux {kernel}, {cpu}; haltd {haltd_bin}");

    let dir = TempDir::new()?;
    // haltd's own default (`haltd serve --workers`): the CPUs, at most 8.
    let workers = args.workers.unwrap_or_else(|| machine.nproc.clamp(1, 8));
    let (mut rig, nginx_skipped) = Rig::start(&args, &bins, &dir.0, workers, cpu_clock, &machine)?;
    let idle = rig.measure_idle()?;
    let seq_ttfb = sequential_ttfb(&args, &rig)?;
    let t_start = Instant::now();
    let runs = run_routes(&args, &mut rig, &bins.client)?;
    let elapsed = t_start.elapsed();

    let summaries: Vec<Summary> = args.streams.iter().map(|&n| summarize(n, &runs)).collect();
    print_table(&args, &machine, &summaries, idle.haltd, elapsed);
    print_nginx_table(
        &args,
        rig.nginx.as_ref(),
        nginx_skipped.as_deref(),
        cpu_clock,
        &summaries,
    );
    print_ttfb_table(&args, &summaries, seq_ttfb.as_ref());

    let nginx_json = nginx_json(&args, rig.nginx.as_ref(), nginx_skipped.as_deref(), &idle);
    // The proxies of the overhead runs go before the scorer-stall scenario starts its own
    // haltd, so that their background does not load the machine; nginx before the Messages
    // comparison, which runs on this haltd.
    rig.nginx = None;
    let messages_report = run_messages(&args, &mut rig, &bins.client);
    drop(rig.haltd);

    let stall_report = if args.no_scorer_stall {
        json!({"skipped": "--no-scorer-stall"})
    } else {
        let ctx = stall::Context {
            args: &args,
            haltd_bin: &bins.haltd,
            client_bin: &bins.client,
            dir: &dir.0,
            workers,
            cpu_clock,
            nproc: machine.nproc,
        };
        run_stall(&ctx, &mut rig.upstream)
    };
    let tls_ctx = (&args, &bins, dir.0.as_path(), cpu_clock, machine.nproc);
    let tls_report = run_upstream_tls(tls_ctx, &rig.upstream);
    let client_tls_report = run_client_tls(tls_ctx, &rig.upstream);

    let report = json!({
        "bench": "proxy_overhead",
        "target_added_p99_us": TARGET_ADDED_P99_US,
        "target_cpu_ratio": TARGET_CPU_RATIO,
        "target_added_ttfb_p50_us": TARGET_ADDED_TTFB_P50_US,
        "target_stall_p99_ratio": TARGET_STALL_P99_RATIO,
        "pace_ms": args.pace_ms,
        "rounds": args.rounds,
        "machine": {"nproc": machine.nproc, "kernel": machine.kernel, "cpu": machine.cpu},
        "haltd": haltd_json(&args, &bins.haltd, workers, &idle),
        "nginx": nginx_json,
        "upstream_idle_cpu_us_per_s": round1(idle.upstream),
        "cpu_clock": cpu_clock.name(),
        "results": summaries.iter().map(Summary::to_json).collect::<Vec<_>>(),
        "runs": runs.iter().map(|r| run_json(&runs, r)).collect::<Vec<_>>(),
        "scorer_stall": stall_report,
        "upstream_tls": tls_report,
        "client_tls": client_tls_report,
        "surfaces": messages_report,
        "sequential_ttfb": SeqTtfb::report(seq_ttfb.as_ref(), args.ttfb_requests),
        "wall_s": (elapsed.as_secs_f64() * 10.0).round() / 10.0,
    });
    write_report(&out, &report)?;
    check_runs(&runs, &report)
}

/// The report's `haltd` part: its build and the settings the bench gave it.
fn haltd_json(args: &Args, bin: &Path, workers: usize, idle: &Idle) -> Value {
    json!({
        "bin": fs::canonicalize(bin).unwrap_or_else(|_| bin.to_path_buf()).display().to_string(),
        "workers": args.workers,
        "workers_effective": workers,
        "max_streams": args.max_streams,
        "upstream_pool_idle": args.haltd_pool_idle,
        "upstream_pool_idle_timeout_ms": args.haltd_pool_idle_timeout_ms,
        "idle_cpu_us_per_s": round1(idle.haltd),
    })
}

/// The report's `nginx` part: the relay's build and settings, or why it did not run.
fn nginx_json(args: &Args, nginx: Option<&Nginx>, skipped: Option<&str>, idle: &Idle) -> Value {
    match nginx {
        Some(x) => json!({
            "bin": fs::canonicalize(&args.nginx).unwrap_or_else(|_| args.nginx.clone()).display().to_string(),
            "version": x.version,
            "worker_processes": x.workers.len(),
            "worker_connections": x.worker_connections,
            "upstream_keepalive": NGINX_KEEPALIVE,
            "idle_cpu_us_per_s": round1(idle.nginx),
        }),
        None => json!({"skipped": skipped}),
    }
}

fn write_report(out: &Path, report: &Value) -> Result<()> {
    if let Some(parent) = out.parent() {
        fs::create_dir_all(parent).with_context(|| format!("creating {}", parent.display()))?;
    }
    fs::write(out, format!("{report:#}\n"))
        .with_context(|| format!("writing {}", out.display()))?;
    println!("report: {}", out.display());
    Ok(())
}

/// The command line's counts, and root (haltd loads its kernel halt gate).
fn check_args(args: &Args) -> Result<()> {
    ensure!(
        !args.streams.is_empty(),
        "--streams needs at least one count"
    );
    ensure!(
        args.streams.iter().all(|&n| n > 0),
        "--streams counts must be positive"
    );
    ensure!(args.rounds > 0, "--rounds must be at least 1");
    ensure!(
        args.no_messages
            || (args.messages_rounds > 0
                && !args.messages_streams.is_empty()
                && args.messages_streams.iter().all(|&n| n > 0)),
        "--messages-rounds and every --messages-streams count must be at least 1"
    );
    ensure!(args.tokens != Some(0), "--tokens must be at least 1");
    // SAFETY: geteuid has no preconditions and cannot fail.
    let euid = unsafe { libc::geteuid() };
    ensure!(
        euid == 0,
        "bench-proxy-overhead needs root: haltd loads its kernel halt gate (run `cargo xtask bench` as root)"
    );
    Ok(())
}

/// The binaries the bench runs: haltd (`HALTD_BIN`), and the upstream and the client next to
/// this executable.
struct Bins {
    haltd: PathBuf,
    upstream: PathBuf,
    client: PathBuf,
    /// This executable's directory.
    dir: PathBuf,
}

impl Bins {
    fn locate() -> Result<Self> {
        let haltd = match std::env::var_os("HALTD_BIN") {
            Some(p) => PathBuf::from(p),
            None => bail!(
                "HALTD_BIN is not set: point it at a release haltd built with the BPF gate, or \
                 run `cargo xtask bench`, which builds one and runs this bench with it"
            ),
        };
        ensure!(
            haltd.is_file(),
            "HALTD_BIN={} is not a file (run `cargo xtask bench`)",
            haltd.display()
        );
        let exe = std::env::current_exe().context("locating this executable")?;
        let dir = exe
            .parent()
            .context("this executable has no parent directory")?
            .to_path_buf();
        let sibling = |name: &str| -> Result<PathBuf> {
            let p = dir.join(name);
            ensure!(
                p.is_file(),
                "{} not found next to this binary; build it with `cargo build --release -p \
                 haltd-tests --bins` (or run `cargo xtask bench`)",
                p.display()
            );
            Ok(p)
        };
        Ok(Bins {
            upstream: sibling("scripted-upstream")?,
            client: sibling("bench-proxy")?,
            haltd,
            dir,
        })
    }
}

/// The processes of the overhead runs (the upstream, haltd, nginx when it runs) and how their
/// CPU time is read.
struct Rig {
    upstream: Upstream,
    haltd: Haltd,
    nginx: Option<Nginx>,
    cpu_clock: CpuClock,
    nproc: usize,
}

impl Rig {
    /// Starts the upstream, haltd and nginx (unless skipped: then why, as the second value).
    fn start(
        args: &Args,
        bins: &Bins,
        dir: &Path,
        workers: usize,
        cpu_clock: CpuClock,
        machine: &Machine,
    ) -> Result<(Self, Option<String>)> {
        let upstream = start_upstream(&bins.upstream, dir, "upstream", &[])?;
        let url = format!("http://{}", upstream.addr);
        let haltd = start_haltd(&bins.haltd, dir, "haltd", &url, args, &[])?;
        let (nginx, nginx_skipped) = if args.no_nginx {
            (None, Some("--no-nginx".to_owned()))
        } else if !args.nginx.is_file() {
            (
                None,
                Some(format!(
                    "{} not found (install the Debian package nginx)",
                    args.nginx.display()
                )),
            )
        } else {
            let n = start_nginx(
                &args.nginx,
                dir,
                upstream.addr.as_str(),
                workers,
                args.max_streams,
            )?;
            (Some(n), None)
        };
        eprintln!(
            "bench-proxy-overhead: upstream {} (pid {}), haltd {} (pid {})",
            upstream.addr,
            upstream.proc.pid(),
            haltd.listen,
            haltd.proc.pid()
        );
        match (&nginx, &nginx_skipped) {
            (Some(x), _) => eprintln!(
                "bench-proxy-overhead: {} at {} (master {}, workers {:?})",
                x.version,
                x.url,
                x.proc.pid(),
                x.workers
            ),
            (None, Some(why)) => eprintln!("bench-proxy-overhead: nginx route skipped: {why}"),
            (None, None) => {}
        }
        let rig = Rig {
            upstream,
            haltd,
            nginx,
            cpu_clock,
            nproc: machine.nproc,
        };
        Ok((rig, nginx_skipped))
    }

    /// CPU time so far of haltd, nginx and the upstream, µs.
    fn cpu_us(&self) -> Result<(f64, f64, f64)> {
        Ok((
            self.cpu_clock.read_us(self.haltd.proc.pid())?,
            nginx_cpu_us(self.nginx.as_ref(), self.cpu_clock)?,
            self.cpu_clock.read_us(self.upstream.proc.pid())?,
        ))
    }

    /// The proxies' CPU rates with no stream open and nothing else running (heartbeats,
    /// timers), for context: the net CPU figures use their rates during the direct runs.
    fn measure_idle(&self) -> Result<Idle> {
        let ((h0, g0, u0), t0) = (self.cpu_us()?, Instant::now());
        thread::sleep(IDLE_WINDOW);
        let s = t0.elapsed().as_secs_f64();
        let (h1, g1, u1) = self.cpu_us()?;
        let idle = Idle {
            haltd: (h1 - h0) / s,
            nginx: (g1 - g0) / s,
            upstream: (u1 - u0) / s,
        };
        let nginx_idle = if self.nginx.is_some() {
            format!(", nginx {:.0} µs/s", idle.nginx)
        } else {
            String::new()
        };
        eprintln!(
            "bench-proxy-overhead: idle CPU: haltd {:.0} µs/s{nginx_idle}, upstream {:.0} µs/s",
            idle.haltd, idle.upstream
        );
        Ok(idle)
    }

    /// The URL a client of `route` connects to.
    fn url(&self, route: Route) -> Result<String> {
        Ok(match route {
            Route::Direct => format!("http://{}", self.upstream.addr),
            Route::Via => format!("http://{}", self.haltd.listen),
            Route::Nginx => self
                .nginx
                .as_ref()
                .map(|x| x.url.clone())
                .context("the nginx route without nginx")?,
        })
    }

    fn check_alive(&mut self) -> Result<()> {
        self.haltd.proc.check_alive()?;
        self.upstream.proc.check_alive()?;
        if let Some(x) = self.nginx.as_mut() {
            x.check_alive()?;
        }
        Ok(())
    }
}

/// Every stream count, every round, every route (each route taking each place in the order
/// in turn).
fn run_routes(args: &Args, rig: &mut Rig, client_bin: &Path) -> Result<Vec<Run>> {
    let mut routes = vec![Route::Direct, Route::Via];
    if rig.nginx.is_some() {
        routes.push(Route::Nginx);
    }
    let mut runs = Vec::new();
    for &n in &args.streams {
        for round in 0..args.rounds {
            // Each route takes each place in the order in turn.
            let mut order = routes.clone();
            order.rotate_left(round % routes.len());
            for path in order {
                runs.push(run_once(args, rig, client_bin, n, round, path)?);
                rig.check_alive()?;
            }
        }
    }
    Ok(runs)
}

/// One client run of `n` streams over `path`, with the CPU every process used meanwhile.
fn run_once(
    args: &Args,
    rig: &Rig,
    client_bin: &Path,
    n: usize,
    round: usize,
    path: Route,
) -> Result<Run> {
    let tokens = args.tokens.unwrap_or_else(|| default_tokens(n));
    let url = rig.url(path)?;
    let tag = format!(
        "[N={n} round {}/{} {}]",
        round + 1,
        args.rounds,
        path.name()
    );
    eprintln!("{tag} {tokens} tokens/stream, pace {} ms", args.pace_ms);
    let tcp0 = tcp_ext();
    let all0 = machine_busy_us();
    let ((h0, g0, u0), c0, t0) = (rig.cpu_us()?, children_cpu_us(), Instant::now());
    let client = run_client(client_bin, &url, n, tokens, args.pace_ms, false)
        .with_context(|| format!("bench-proxy, {n} streams, {}", path.name()))?;
    thread::sleep(SETTLE);
    let tcp1 = tcp_ext();
    let window_s = t0.elapsed().as_secs_f64();
    let (h1, g1, u1) = rig.cpu_us()?;
    let (haltd_cpu_us, nginx_cpu_us, upstream_cpu_us) = (h1 - h0, g1 - g0, u1 - u0);
    let client_cpu_us = children_cpu_us() - c0;
    let all_us = machine_busy_us() - all0;
    let capacity_us = window_s * 1e6 * rig.nproc.max(1) as f64;
    let ours = haltd_cpu_us + nginx_cpu_us + upstream_cpu_us + client_cpu_us;
    let run = Run {
        streams: n,
        round,
        path,
        tokens_per_stream: tokens,
        window_s,
        haltd_cpu_us,
        nginx_cpu_us,
        upstream_cpu_us,
        client_cpu_us,
        busy_pct: ours / capacity_us * 100.0,
        others_pct: ((all_us - ours) / capacity_us * 100.0).max(0.0),
        client,
        listen_overflows: tcp1.0.saturating_sub(tcp0.0),
        syn_retrans: tcp1.1.saturating_sub(tcp0.1),
    };
    log_run(&tag, &run);
    Ok(run)
}

/// One run's line, and warnings when streams started late or other work disturbed it.
fn log_run(tag: &str, run: &Run) {
    if run.listen_overflows > 0 {
        eprintln!(
            "{tag} {} accept-queue overflows, {} SYN retransmits: some streams \
             started late",
            run.listen_overflows, run.syn_retrans
        );
    }
    if run.others_pct > OTHERS_WARN_PCT {
        eprintln!(
            "{tag} other processes used {:.0}% of the CPUs during this run: its \
             numbers are disturbed",
            run.others_pct
        );
    }
    let per_tok = |us: f64| us / run.client.tokens.max(1) as f64;
    eprintln!(
        "{tag} {} tokens, {} errors; latency µs p50 {} p99 {}; first byte µs p50 {} \
         p99 {}; CPU µs/token haltd {:.1} nginx {:.1} upstream {:.1} client {:.1}; \
         CPUs {:.0}% busy; {:.2} s",
        run.client.tokens,
        run.client.errors,
        show(run.client.p50_us),
        show(run.client.p99_us),
        show(run.client.ttfb_p50_us),
        show(run.client.ttfb_p99_us),
        per_tok(run.haltd_cpu_us),
        per_tok(run.nginx_cpu_us),
        per_tok(run.upstream_cpu_us),
        per_tok(run.client_cpu_us),
        run.busy_pct,
        run.client.wall_s
    );
}

/// The scorer-stall scenario's report, or its error as JSON (the overhead runs still count).
fn run_stall(ctx: &stall::Context<'_>, upstream: &mut Upstream) -> Value {
    match stall::run(ctx, upstream) {
        Ok(s) => {
            s.print();
            s.to_json()
        }
        Err(e) => {
            eprintln!("bench-proxy-overhead: scorer-stall scenario failed: {e:#}");
            json!({"error": format!("{e:#}")})
        }
    }
}

/// The surfaces' comparison's report, its error as a problem, or why it was skipped.
fn run_messages(args: &Args, rig: &mut Rig, client_bin: &Path) -> Value {
    if args.no_messages {
        return json!({"skipped": "--no-messages"});
    }
    messages::run(args, rig, client_bin).unwrap_or_else(|e| {
        eprintln!("bench-proxy-overhead: surfaces' comparison failed: {e:#}");
        json!({"problems": [format!("{e:#}")]})
    })
}

/// The upstream TLS scenario's report (`--upstream-tls`), its error as a problem, or why it
/// was skipped.
fn run_upstream_tls(
    (args, bins, dir, cpu_clock, nproc): (&Args, &Bins, &Path, CpuClock, usize),
    upstream: &Upstream,
) -> Value {
    if !args.upstream_tls {
        return json!({"skipped": "no --upstream-tls"});
    }
    let ctx = tls_compare::Context {
        args,
        bins,
        dir,
        cpu_clock,
        nproc,
    };
    upstream_tls::run(&ctx, upstream).unwrap_or_else(|e| {
        eprintln!("bench-proxy-overhead: upstream TLS scenario failed: {e:#}");
        json!({"problems": [format!("{e:#}")]})
    })
}

/// The client TLS scenario's report (`--client-tls`), its error as a problem, or why it was
/// skipped.
fn run_client_tls(
    (args, bins, dir, cpu_clock, nproc): (&Args, &Bins, &Path, CpuClock, usize),
    upstream: &Upstream,
) -> Value {
    if !args.client_tls {
        return json!({"skipped": "no --client-tls"});
    }
    let ctx = tls_compare::Context {
        args,
        bins,
        dir,
        cpu_clock,
        nproc,
    };
    client_tls::run(&ctx, upstream).unwrap_or_else(|e| {
        eprintln!("bench-proxy-overhead: client TLS scenario failed: {e:#}");
        json!({"problems": [format!("{e:#}")]})
    })
}

/// Fails when a run went wrong: stream errors, no tokens, a scorer-stall run that did not
/// hold, or a problem of the upstream TLS scenario.
/// A run's problem, which fails the bench: stream errors, or no tokens at all.
fn run_problem(streams: usize, round: usize, name: &str, client: &ClientReport) -> Option<String> {
    (client.errors > 0 || client.tokens == 0).then(|| {
        format!(
            "N={streams} round {} {name}: {} errors, {} tokens",
            round + 1,
            client.errors,
            client.tokens
        )
    })
}

fn check_runs(runs: &[Run], report: &Value) -> Result<()> {
    let stall_report = &report["scorer_stall"];
    let mut bad: Vec<String> = runs
        .iter()
        .filter_map(|r| run_problem(r.streams, r.round, r.path.name(), &r.client))
        .collect();
    if let Some(e) = stall_report["error"].as_str() {
        bad.push(format!("scorer stall: {e}"));
    }
    for p in stall_report["problems"].as_array().into_iter().flatten() {
        bad.push(format!("scorer stall: {}", p.as_str().unwrap_or_default()));
    }
    let tls_problems = report["upstream_tls"]["problems"].as_array();
    for p in tls_problems.into_iter().flatten() {
        bad.push(format!("upstream TLS: {}", p.as_str().unwrap_or_default()));
    }
    let client_tls_problems = report["client_tls"]["problems"].as_array();
    for p in client_tls_problems.into_iter().flatten() {
        bad.push(format!("client TLS: {}", p.as_str().unwrap_or_default()));
    }
    for p in report["surfaces"]["problems"]
        .as_array()
        .into_iter()
        .flatten()
    {
        bad.push(format!("surfaces: {}", p.as_str().unwrap_or_default()));
    }
    ensure!(
        bad.is_empty(),
        "{} runs went wrong: stream errors, no tokens, a scorer-stall run that did not hold, or a failed upstream TLS run \
         (the numbers above are not trustworthy): {}",
        bad.len(),
        bad.join("; ")
    );
    Ok(())
}

/// `target/bench/proxy-overhead.json` when this binary lies in `target/<profile>/`.
fn default_out(bin_dir: &Path) -> PathBuf {
    let target = match bin_dir.parent() {
        Some(t)
            if bin_dir
                .file_name()
                .is_some_and(|n| n == "release" || n == "debug") =>
        {
            t.to_path_buf()
        }
        _ => PathBuf::from("target"),
    };
    target.join("bench").join("proxy-overhead.json")
}

fn show(v: Option<f64>) -> String {
    v.map_or_else(|| "-".to_owned(), |v| format!("{v:.1}"))
}

fn round1(v: f64) -> f64 {
    (v * 10.0).round() / 10.0
}

use haltd_tests::stats::median;

/// p50 and p99 of something, µs.
#[derive(Debug, Default, Clone, Copy)]
struct Pct {
    p50: Option<f64>,
    p99: Option<f64>,
}

impl Pct {
    /// `self − base`, each percentile where both are known.
    fn minus(self, base: Self) -> Self {
        Self {
            p50: self.p50.zip(base.p50).map(|(a, b)| a - b),
            p99: self.p99.zip(base.p99).map(|(a, b)| a - b),
        }
    }
}

/// One route's medians over the rounds of one stream count.
#[derive(Debug, Default)]
struct RouteSummary {
    /// Per-token latency.
    lat: Pct,
    /// Time to first byte and to first token (per request).
    ttfb: Pct,
    ttft: Pct,
    /// The route's proxy (haltd or nginx): CPU per token, raw and net of its background,
    /// and that background rate (µs/s); `None` on the direct route.
    cpu: Option<f64>,
    cpu_net: Option<f64>,
    background: Option<f64>,
    busy: Option<f64>,
    tokens: u64,
    listen_overflows: u64,
}

/// Medians over the rounds of one stream count.
#[derive(Debug)]
struct Summary {
    streams: usize,
    tokens_per_stream: usize,
    direct: RouteSummary,
    via: RouteSummary,
    /// `None` when nginx was not run.
    nginx: Option<RouteSummary>,
    upstream_cpu: Option<f64>,
    client_cpu: Option<f64>,
    others_max: Option<f64>,
    errors: u64,
}

impl Summary {
    fn added(&self) -> Pct {
        self.via.lat.minus(self.direct.lat)
    }

    fn pass(&self) -> Option<bool> {
        self.added().p99.map(|a| a < TARGET_ADDED_P99_US)
    }

    fn nginx_added(&self) -> Pct {
        self.nginx
            .as_ref()
            .map_or_else(Pct::default, |g| g.lat.minus(self.direct.lat))
    }

    /// haltd's net CPU per token over nginx's; `None` unless both are known and nginx's is
    /// positive.
    fn cpu_ratio(&self) -> Option<f64> {
        let g = self.nginx.as_ref()?.cpu_net.filter(|&g| g > 0.0)?;
        Some(self.via.cpu_net? / g)
    }

    fn cpu_pass(&self) -> Option<bool> {
        self.cpu_ratio().map(|r| r <= TARGET_CPU_RATIO)
    }

    fn ttfb_added(&self) -> Pct {
        self.via.ttfb.minus(self.direct.ttfb)
    }

    fn nginx_ttfb_added(&self) -> Pct {
        self.nginx
            .as_ref()
            .map_or_else(Pct::default, |g| g.ttfb.minus(self.direct.ttfb))
    }

    fn ttfb_pass(&self) -> Option<bool> {
        self.ttfb_added().p50.map(|a| a <= TARGET_ADDED_TTFB_P50_US)
    }

    fn to_json(&self) -> Value {
        let r = |v: Option<f64>| v.map(round1);
        let g = self.nginx.as_ref();
        let gf = |f: &dyn Fn(&RouteSummary) -> Option<f64>| r(g.and_then(f));
        let mut v = json!({
            "streams": self.streams,
            "tokens_per_stream": self.tokens_per_stream,
            "direct_p50_us": r(self.direct.lat.p50),
            "direct_p99_us": r(self.direct.lat.p99),
            "via_p50_us": r(self.via.lat.p50),
            "via_p99_us": r(self.via.lat.p99),
            "added_p50_us": r(self.added().p50),
            "added_p99_us": r(self.added().p99),
            "haltd_cpu_us_per_token": r(self.via.cpu),
            "haltd_cpu_net_us_per_token": r(self.via.cpu_net),
            "haltd_background_cpu_us_per_s": r(self.via.background),
            "upstream_cpu_us_per_token": r(self.upstream_cpu),
            "client_cpu_us_per_token": r(self.client_cpu),
            "busy_pct_direct": r(self.direct.busy),
            "busy_pct_via": r(self.via.busy),
            "others_pct_max": r(self.others_max),
            "tokens_direct": self.direct.tokens,
            "tokens_via": self.via.tokens,
            "errors": self.errors,
            "listen_overflows_direct": self.direct.listen_overflows,
            "listen_overflows_via": self.via.listen_overflows,
            "pass": self.pass(),
        });
        // Issue 11: nginx beside haltd, and the time to first byte and to first token.
        let more = json!({
            "nginx_p50_us": gf(&|g| g.lat.p50),
            "nginx_p99_us": gf(&|g| g.lat.p99),
            "nginx_added_p50_us": r(self.nginx_added().p50),
            "nginx_added_p99_us": r(self.nginx_added().p99),
            "nginx_cpu_us_per_token": gf(&|g| g.cpu),
            "nginx_cpu_net_us_per_token": gf(&|g| g.cpu_net),
            "nginx_background_cpu_us_per_s": gf(&|g| g.background),
            "busy_pct_nginx": gf(&|g| g.busy),
            "tokens_nginx": g.map(|g| g.tokens),
            "listen_overflows_nginx": g.map(|g| g.listen_overflows),
            "cpu_ratio_haltd_nginx": self.cpu_ratio().map(|v| (v * 100.0).round() / 100.0),
            "cpu_ratio_pass": self.cpu_pass(),
            "ttfb_direct_p50_us": r(self.direct.ttfb.p50),
            "ttfb_direct_p99_us": r(self.direct.ttfb.p99),
            "ttfb_via_p50_us": r(self.via.ttfb.p50),
            "ttfb_via_p99_us": r(self.via.ttfb.p99),
            "ttfb_nginx_p50_us": gf(&|g| g.ttfb.p50),
            "ttfb_nginx_p99_us": gf(&|g| g.ttfb.p99),
            "ttfb_added_p50_us": r(self.ttfb_added().p50),
            "ttfb_added_p99_us": r(self.ttfb_added().p99),
            "ttfb_nginx_added_p50_us": r(self.nginx_ttfb_added().p50),
            "ttfb_nginx_added_p99_us": r(self.nginx_ttfb_added().p99),
            "ttfb_pass": self.ttfb_pass(),
            "ttft_direct_p50_us": r(self.direct.ttft.p50),
            "ttft_direct_p99_us": r(self.direct.ttft.p99),
            "ttft_via_p50_us": r(self.via.ttft.p50),
            "ttft_via_p99_us": r(self.via.ttft.p99),
            "ttft_nginx_p50_us": gf(&|g| g.ttft.p50),
            "ttft_nginx_p99_us": gf(&|g| g.ttft.p99),
        });
        if let (Some(v), Value::Object(more)) = (v.as_object_mut(), more) {
            v.extend(more);
        }
        v
    }
}

impl Run {
    fn cpu_us(&self, who: Who) -> f64 {
        match who {
            Who::Haltd => self.haltd_cpu_us,
            Who::Nginx => self.nginx_cpu_us,
        }
    }
}

impl Route {
    /// The proxy a route goes through.
    fn proxy(self) -> Option<Who> {
        match self {
            Self::Direct => None,
            Self::Via => Some(Who::Haltd),
            Self::Nginx => Some(Who::Nginx),
        }
    }
}

/// `who`'s CPU rate (µs/s) during the direct run paired with `r` (same N, same round): its
/// background with no stream of its own while the machine carries the same load.
fn background_rate(runs: &[Run], r: &Run, who: Who) -> Option<f64> {
    runs.iter()
        .find(|d| d.path == Route::Direct && d.streams == r.streams && d.round == r.round)
        .filter(|d| d.window_s > 0.0)
        .map(|d| d.cpu_us(who) / d.window_s)
}

/// CPU per delivered token of the proxy that carried run `r` (none on the direct route): raw,
/// and net of its background rate over the run's window.
fn proxy_cpu_per_token(runs: &[Run], r: &Run) -> Option<(f64, Option<f64>)> {
    let who = r.path.proxy()?;
    let t = r.client.tokens.max(1) as f64;
    let cpu = r.cpu_us(who);
    Some((
        cpu / t,
        background_rate(runs, r, who).map(|bg| (cpu - bg * r.window_s) / t),
    ))
}

fn summarize_route(n: usize, runs: &[Run], route: Route) -> RouteSummary {
    let of = || {
        runs.iter()
            .filter(move |r| r.streams == n && r.path == route)
    };
    let med = |f: &dyn Fn(&Run) -> Option<f64>| median(of().filter_map(f).collect());
    let with_tokens = |r: &Run| r.client.tokens > 0;
    RouteSummary {
        lat: Pct {
            p50: med(&|r| r.client.p50_us),
            p99: med(&|r| r.client.p99_us),
        },
        ttfb: Pct {
            p50: med(&|r| r.client.ttfb_p50_us),
            p99: med(&|r| r.client.ttfb_p99_us),
        },
        ttft: Pct {
            p50: med(&|r| r.client.ttft_p50_us),
            p99: med(&|r| r.client.ttft_p99_us),
        },
        cpu: med(&|r| {
            proxy_cpu_per_token(runs, r)
                .filter(|_| with_tokens(r))
                .map(|c| c.0)
        }),
        cpu_net: med(&|r| {
            proxy_cpu_per_token(runs, r)
                .filter(|_| with_tokens(r))
                .and_then(|c| c.1)
        }),
        background: med(&|r| background_rate(runs, r, r.path.proxy()?)),
        busy: med(&|r| Some(r.busy_pct)),
        tokens: of().map(|r| r.client.tokens).sum(),
        listen_overflows: of().map(|r| r.listen_overflows).sum(),
    }
}

fn summarize(n: usize, runs: &[Run]) -> Summary {
    let tokens_per_stream = runs
        .iter()
        .find(|r| r.streams == n)
        .map_or(0, |r| r.tokens_per_stream);
    let per_token = |f: &dyn Fn(&Run) -> f64| {
        median(
            runs.iter()
                .filter(|r| r.streams == n && r.client.tokens > 0)
                .map(|r| f(r) / r.client.tokens as f64)
                .collect(),
        )
    };
    let has_nginx = runs
        .iter()
        .any(|r| r.streams == n && r.path == Route::Nginx);
    Summary {
        streams: n,
        tokens_per_stream,
        direct: summarize_route(n, runs, Route::Direct),
        via: summarize_route(n, runs, Route::Via),
        nginx: has_nginx.then(|| summarize_route(n, runs, Route::Nginx)),
        // The upstream does the same work on every route (a little more through haltd, which
        // asks for logprobs).
        upstream_cpu: per_token(&|r| r.upstream_cpu_us),
        client_cpu: per_token(&|r| r.client_cpu_us),
        others_max: runs
            .iter()
            .filter(|r| r.streams == n)
            .map(|r| r.others_pct)
            .max_by(f64::total_cmp),
        errors: runs
            .iter()
            .filter(|r| r.streams == n)
            .map(|r| r.client.errors)
            .sum(),
    }
}

fn run_json(runs: &[Run], r: &Run) -> Value {
    let t = r.client.tokens.max(1) as f64;
    // Per token only for the proxy that carried the tokens.
    let (cpu, net) = proxy_cpu_per_token(runs, r)
        .map_or((None, None), |(c, n)| (Some(round1(c)), n.map(round1)));
    let (haltd, nginx) = match r.path {
        Route::Via => ((cpu, net), (None, None)),
        Route::Nginx => ((None, None), (cpu, net)),
        Route::Direct => ((None, None), (None, None)),
    };
    json!({
        "streams": r.streams,
        "round": r.round + 1,
        "path": r.path.name(),
        "tokens_per_stream": r.tokens_per_stream,
        "requests": r.client.requests,
        "tokens": r.client.tokens,
        "errors": r.client.errors,
        "p50_us": r.client.p50_us,
        "p90_us": r.client.p90_us,
        "p99_us": r.client.p99_us,
        "max_us": r.client.max_us,
        "mean_us": r.client.mean_us,
        "wall_s": r.client.wall_s,
        "ttfb_p50_us": r.client.ttfb_p50_us,
        "ttfb_p99_us": r.client.ttfb_p99_us,
        "ttft_p50_us": r.client.ttft_p50_us,
        "ttft_p99_us": r.client.ttft_p99_us,
        "cpu_window_s": (r.window_s * 1000.0).round() / 1000.0,
        "haltd_cpu_us": r.haltd_cpu_us.round(),
        "nginx_cpu_us": r.nginx_cpu_us.round(),
        "upstream_cpu_us": r.upstream_cpu_us.round(),
        "haltd_cpu_us_per_token": haltd.0,
        "haltd_cpu_net_us_per_token": haltd.1,
        "nginx_cpu_us_per_token": nginx.0,
        "nginx_cpu_net_us_per_token": nginx.1,
        "upstream_cpu_us_per_token": round1(r.upstream_cpu_us / t),
        "client_cpu_us": r.client_cpu_us.round(),
        "client_cpu_us_per_token": round1(r.client_cpu_us / t),
        "busy_pct": round1(r.busy_pct),
        "others_pct": round1(r.others_pct),
        "listen_overflows": r.listen_overflows,
        "syn_retrans": r.syn_retrans,
    })
}

fn print_table(
    args: &Args,
    machine: &Machine,
    summaries: &[Summary],
    idle_us_per_s: f64,
    elapsed: Duration,
) {
    println!(
        "proxy overhead: haltd --source openai vs scripted-upstream directly; pace {} ms, median \
         of {} rounds; target: added p99 < {TARGET_ADDED_P99_US:.0} µs",
        args.pace_ms, args.rounds
    );
    println!(
        "machine: {} CPUs, Linux {}, {}; haltd idle CPU {:.0} µs/s; {:.0} s of runs",
        machine.nproc,
        machine.kernel,
        machine.cpu,
        idle_us_per_s,
        elapsed.as_secs_f64()
    );
    println!(
        "{:>7} {:>6} | {:>9} {:>9} | {:>9} {:>9} | {:>9} {:>9} | {:>10} {:>8} | {:>8} | {:>9} | \
         {:>6} | target",
        "streams",
        "tok/st",
        "dir p50",
        "dir p99",
        "via p50",
        "via p99",
        "add p50",
        "add p99",
        "haltd CPU",
        "(net)",
        "upstr.",
        "CPUs busy",
        "errors"
    );
    println!(
        "{:>7} {:>6} | {:>9} {:>9} | {:>9} {:>9} | {:>9} {:>9} | {:>10} {:>8} | {:>8} | {:>9} | \
         {:>6} |",
        "",
        "",
        "µs",
        "µs",
        "µs",
        "µs",
        "µs",
        "µs",
        "µs/token",
        "µs/token",
        "µs/tok",
        "dir/via %",
        ""
    );
    for s in summaries {
        let verdict = match s.pass() {
            Some(true) => "PASS",
            Some(false) => "MISS",
            None => "-",
        };
        println!(
            "{:>7} {:>6} | {:>9} {:>9} | {:>9} {:>9} | {:>9} {:>9} | {:>10} {:>8} | {:>8} | {:>9} | \
             {:>6} | {verdict}",
            s.streams,
            s.tokens_per_stream,
            show(s.direct.lat.p50),
            show(s.direct.lat.p99),
            show(s.via.lat.p50),
            show(s.via.lat.p99),
            show(s.added().p50),
            show(s.added().p99),
            show(s.via.cpu),
            show(s.via.cpu_net),
            show(s.upstream_cpu),
            format!(
                "{}/{}",
                s.direct.busy.map_or_else(|| "-".to_owned(), |v| format!("{v:.0}")),
                s.via.busy.map_or_else(|| "-".to_owned(), |v| format!("{v:.0}"))
            ),
            s.errors
        );
    }
    print_run_notes(summaries);
}

/// Notes under the table: runs that other work disturbed, and connections that started late.
fn print_run_notes(summaries: &[Summary]) {
    for s in summaries {
        if let Some(o) = s.others_max.filter(|&o| o > OTHERS_WARN_PCT) {
            println!(
                "note: {} streams: other processes used up to {o:.0}% of the CPUs during a run; \
                 rerun on a quiet machine",
                s.streams
            );
        }
        for (overflows, path) in [
            (s.direct.listen_overflows, "directly"),
            (s.via.listen_overflows, "through haltd"),
            (
                s.nginx.as_ref().map_or(0, |g| g.listen_overflows),
                "through nginx",
            ),
        ] {
            if overflows > 0 {
                println!(
                    "note: {} streams {path}: {overflows} accept-queue overflows over the rounds; \
                     those connections were retried after 1 s or more, so fewer streams overlapped",
                    s.streams
                );
            }
        }
    }
}

fn verdict(pass: Option<bool>) -> &'static str {
    match pass {
        Some(true) => "PASS",
        Some(false) => "MISS",
        None => "-",
    }
}

/// haltd against nginx on the same load: latency, and CPU per token (issue 11).
fn print_nginx_table(
    args: &Args,
    nginx: Option<&Nginx>,
    skipped: Option<&str>,
    clock: CpuClock,
    summaries: &[Summary],
) {
    let Some(x) = nginx else {
        if let Some(why) = skipped {
            println!("\nnginx route skipped: {why}");
        }
        return;
    };
    println!(
        "\nhaltd beside nginx on the same load: {} reverse proxy, {} worker processes (as many \
         as haltd's workers), proxy_buffering off, upstream keepalive {NGINX_KEEPALIVE}; CPU is \
         user+sys of all the proxy's threads and processes ({}), net of its rate during the \
         direct run; median of {} rounds; target: haltd's CPU per token ≤ {TARGET_CPU_RATIO} × \
         nginx's",
        x.version,
        x.workers.len(),
        clock.name(),
        args.rounds
    );
    println!(
        "{:>7} | {:>9} {:>9} | {:>9} {:>9} | {:>9} {:>9} | {:>11} {:>11} | {:>7} | target",
        "streams",
        "ngx p50",
        "ngx p99",
        "ngx +p50",
        "ngx +p99",
        "via +p50",
        "via +p99",
        "haltd CPU",
        "nginx CPU",
        "ratio"
    );
    println!(
        "{:>7} | {:>9} {:>9} | {:>9} {:>9} | {:>9} {:>9} | {:>11} {:>11} | {:>7} |",
        "", "µs", "µs", "µs", "µs", "µs", "µs", "net µs/tok", "net µs/tok", "h/n"
    );
    for s in summaries {
        let g = s.nginx.as_ref();
        println!(
            "{:>7} | {:>9} {:>9} | {:>9} {:>9} | {:>9} {:>9} | {:>11} {:>11} | {:>7} | {}",
            s.streams,
            show(g.and_then(|g| g.lat.p50)),
            show(g.and_then(|g| g.lat.p99)),
            show(s.nginx_added().p50),
            show(s.nginx_added().p99),
            show(s.added().p50),
            show(s.added().p99),
            show(s.via.cpu_net),
            show(g.and_then(|g| g.cpu_net)),
            s.cpu_ratio()
                .map_or_else(|| "-".to_owned(), |r| format!("{r:.2}")),
            verdict(s.cpu_pass())
        );
    }
}

/// Time to first byte per route, and what each proxy adds to it (issue 11).
fn print_ttfb_table(args: &Args, summaries: &[Summary], seq: Option<&SeqTtfb>) {
    if let Some(t) = seq {
        t.print(args.ttfb_requests);
    }
    println!(
        "\ntime to first byte (request written → first response byte, per request), median of \
         {} rounds of each run's p50 and p99; \"+\" is the route minus direct; target: haltd \
         adds ≤ {TARGET_ADDED_TTFB_P50_US:.0} µs at p50",
        args.rounds
    );
    println!(
        "{:>7} | {:>9} {:>9} | {:>9} {:>9} | {:>9} {:>9} | {:>9} {:>9} | {:>9} {:>9} | target",
        "streams",
        "dir p50",
        "dir p99",
        "via p50",
        "via p99",
        "ngx p50",
        "ngx p99",
        "via +p50",
        "via +p99",
        "ngx +p50",
        "ngx +p99"
    );
    for s in summaries {
        let g = s.nginx.as_ref();
        println!(
            "{:>7} | {:>9} {:>9} | {:>9} {:>9} | {:>9} {:>9} | {:>9} {:>9} | {:>9} {:>9} | {}",
            s.streams,
            show(s.direct.ttfb.p50),
            show(s.direct.ttfb.p99),
            show(s.via.ttfb.p50),
            show(s.via.ttfb.p99),
            show(g.and_then(|g| g.ttfb.p50)),
            show(g.and_then(|g| g.ttfb.p99)),
            show(s.ttfb_added().p50),
            show(s.ttfb_added().p99),
            show(s.nginx_ttfb_added().p50),
            show(s.nginx_ttfb_added().p99),
            verdict(s.ttfb_pass())
        );
    }
}

/// Unmeasured requests per route before the sequential time-to-first-byte probe.
const TTFB_WARMUP: usize = 10;

/// The unloaded, sequential time to first byte of each route (µs).
#[derive(Debug)]
struct SeqTtfb {
    direct: Pct,
    via: Pct,
    nginx: Option<Pct>,
    /// Through haltd, in the same run: a request on a new client connection (from the
    /// connect, and from the write) and one on a kept connection (from the write).
    via_new_connect: Pct,
    via_new_write: Pct,
    via_reused: Pct,
}

/// Runs the sequential time-to-first-byte probe over every route; `None` when skipped.
fn sequential_ttfb(args: &Args, rig: &Rig) -> Result<Option<SeqTtfb>> {
    if args.ttfb_requests == 0 {
        return Ok(None);
    }
    let mut routes = vec![Route::Direct, Route::Via];
    if rig.nginx.is_some() {
        routes.push(Route::Nginx);
    }
    let urls = routes
        .iter()
        .map(|&r| rig.url(r))
        .collect::<Result<Vec<String>>>()?;
    let addrs: Vec<&str> = urls
        .iter()
        .map(|u| u.trim_start_matches("http://").trim_end_matches('/'))
        .collect();
    eprintln!(
        "bench-proxy-overhead: sequential time to first byte, {} requests per route",
        args.ttfb_requests
    );
    let times = seq_ttfb::probe(&addrs, args.ttfb_requests, TTFB_WARMUP, 1)?;
    eprintln!(
        "bench-proxy-overhead: time to first byte through haltd, new against kept client connections, {} pairs",
        args.ttfb_requests
    );
    let kept = seq_ttfb::keepalive_probe(addrs[1], args.ttfb_requests, TTFB_WARMUP, 1)?;
    let pct = |t: &Vec<Duration>| Pct {
        p50: seq_ttfb::percentile_us(t, 50.0),
        p99: seq_ttfb::percentile_us(t, 99.0),
    };
    Ok(Some(SeqTtfb {
        direct: pct(&times[0]),
        via: pct(&times[1]),
        nginx: times.get(2).map(pct),
        via_new_connect: pct(&kept.new_from_connect),
        via_new_write: pct(&kept.new_from_write),
        via_reused: pct(&kept.reused),
    }))
}

impl SeqTtfb {
    fn added(&self) -> Pct {
        self.via.minus(self.direct)
    }

    fn nginx_added(&self) -> Option<Pct> {
        self.nginx.map(|g| g.minus(self.direct))
    }

    fn pass(&self) -> Option<bool> {
        self.added().p50.map(|a| a <= TARGET_ADDED_TTFB_P50_US)
    }

    fn print(&self, requests: usize) {
        println!(
            "\nunloaded time to first byte: {requests} sequential requests per route, each on a new \
             client connection (µs); \"+\" is the route minus direct; target: haltd adds ≤ \
             {TARGET_ADDED_TTFB_P50_US:.0} µs at p50"
        );
        println!(
            "{:>9} {:>9} | {:>9} {:>9} | {:>9} {:>9} | {:>9} {:>9} | {:>9} {:>9} | target",
            "dir p50",
            "dir p99",
            "via p50",
            "via p99",
            "ngx p50",
            "ngx p99",
            "via +p50",
            "via +p99",
            "ngx +p50",
            "ngx +p99"
        );
        let g = self.nginx;
        let ga = self.nginx_added();
        println!(
            "{:>9} {:>9} | {:>9} {:>9} | {:>9} {:>9} | {:>9} {:>9} | {:>9} {:>9} | {}",
            show(self.direct.p50),
            show(self.direct.p99),
            show(self.via.p50),
            show(self.via.p99),
            show(g.and_then(|g| g.p50)),
            show(g.and_then(|g| g.p99)),
            show(self.added().p50),
            show(self.added().p99),
            show(ga.and_then(|g| g.p50)),
            show(ga.and_then(|g| g.p99)),
            verdict(self.pass())
        );
        println!(
            "through haltd, {requests} pairs in one run (µs): new client connection p50 {} p99 {} \
             from the connect ({} / {} from the write); kept connection p50 {} p99 {}",
            show(self.via_new_connect.p50),
            show(self.via_new_connect.p99),
            show(self.via_new_write.p50),
            show(self.via_new_write.p99),
            show(self.via_reused.p50),
            show(self.via_reused.p99),
        );
    }

    /// The report's `sequential_ttfb`.
    fn report(seq: Option<&Self>, requests: usize) -> Value {
        seq.map_or_else(
            || json!({"skipped": "--ttfb-requests 0"}),
            |t| t.to_json(requests),
        )
    }

    fn to_json(&self, requests: usize) -> Value {
        let r = |v: Option<f64>| v.map(round1);
        let pct = |p: Pct| json!({"p50_us": r(p.p50), "p99_us": r(p.p99)});
        let ga = self.nginx_added();
        json!({
            "requests_per_route": requests,
            "warmup_per_route": TTFB_WARMUP,
            "direct": pct(self.direct),
            "via": pct(self.via),
            "nginx": self.nginx.map(pct),
            "added_p50_us": r(self.added().p50),
            "added_p99_us": r(self.added().p99),
            "nginx_added_p50_us": r(ga.and_then(|g| g.p50)),
            "nginx_added_p99_us": r(ga.and_then(|g| g.p99)),
            "pass": self.pass(),
            "via_keepalive": {
                "new_connection_from_connect": pct(self.via_new_connect),
                "new_connection_from_write": pct(self.via_new_write),
                "kept_connection": pct(self.via_reused),
            },
        })
    }
}

/// Runs `bench-proxy` to completion and parses its JSON line. With `align`, the upstream sends
/// every stream's tokens at the same multiples of the pace.
fn run_client(
    bin: &Path,
    url: &str,
    streams: usize,
    tokens: usize,
    pace_ms: u64,
    align: bool,
) -> Result<ClientReport> {
    run_client_with(
        bin,
        url,
        streams,
        tokens,
        pace_ms,
        if align { &["--align"] } else { &[] },
    )
}

/// [`run_client`] with extra `bench-proxy` arguments (`--align`, `--tls-ca FILE`).
fn run_client_with(
    bin: &Path,
    url: &str,
    streams: usize,
    tokens: usize,
    pace_ms: u64,
    extra: &[&str],
) -> Result<ClientReport> {
    let out = Command::new(bin)
        .args(["--url", url, "--json"])
        .args(extra)
        .args(["--streams", &streams.to_string()])
        .args(["--tokens", &tokens.to_string()])
        .args(["--pace-ms", &pace_ms.to_string()])
        .stdin(Stdio::null())
        .stderr(Stdio::inherit())
        .output()
        .with_context(|| format!("starting {}", bin.display()))?;
    let stdout = String::from_utf8_lossy(&out.stdout);
    ensure!(
        out.status.success(),
        "{} exited with {}; stdout: {}",
        bin.display(),
        out.status,
        stdout.trim()
    );
    let line = stdout
        .lines()
        .rev()
        .find(|l| l.trim_start().starts_with('{'))
        .with_context(|| format!("no JSON line in bench-proxy's output: {}", stdout.trim()))?;
    serde_json::from_str(line).with_context(|| format!("parsing bench-proxy's JSON: {line}"))
}

/// Where a process's CPU time is read from.
#[derive(Debug, Clone, Copy)]
enum CpuClock {
    /// The kernel's per-process CPU clock (`clock_getcpuclockid`): all threads, user + system,
    /// nanoseconds.
    Process,
    /// utime + stime from `/proc/PID/stat`, in clock ticks (usually 10 ms).
    ProcStat { tick_us: f64 },
}

impl CpuClock {
    /// The process clock when the kernel gives one for our own pid, else `/proc` ticks.
    fn probe() -> Self {
        if process_cpu_ns(std::process::id()).is_ok() {
            return Self::Process;
        }
        // SAFETY: sysconf has no preconditions.
        let ticks = unsafe { libc::sysconf(libc::_SC_CLK_TCK) };
        let tick_us = if ticks > 0 { 1e6 / ticks as f64 } else { 1e4 };
        eprintln!(
            "bench-proxy-overhead: no per-process CPU clock; CPU times come from /proc/PID/stat \
             in {tick_us:.0} µs ticks"
        );
        Self::ProcStat { tick_us }
    }

    fn name(self) -> &'static str {
        match self {
            Self::Process => "clock_getcpuclockid",
            Self::ProcStat { .. } => "proc_stat_ticks",
        }
    }

    /// CPU time of `pid` so far, in microseconds.
    fn read_us(self, pid: u32) -> Result<f64> {
        match self {
            Self::Process => Ok(process_cpu_ns(pid)? as f64 / 1000.0),
            Self::ProcStat { tick_us } => Ok(proc_stat_ticks(pid)? as f64 * tick_us),
        }
    }
}

/// Non-idle time of all CPUs so far (`/proc/stat`: user, nice, system, irq, softirq, steal),
/// in microseconds; 0 if unreadable.
fn machine_busy_us() -> f64 {
    let Ok(text) = fs::read_to_string("/proc/stat") else {
        return 0.0;
    };
    let Some(line) = text.lines().find(|l| l.starts_with("cpu ")) else {
        return 0.0;
    };
    let f: Vec<u64> = line
        .split_whitespace()
        .skip(1)
        .map(|v| v.parse().unwrap_or(0))
        .collect();
    // user nice system idle iowait irq softirq steal ...
    let busy: u64 = [0, 1, 2, 5, 6, 7].iter().filter_map(|&i| f.get(i)).sum();
    // SAFETY: sysconf has no preconditions.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) }.max(1);
    busy as f64 * 1e6 / hz as f64
}

/// CPU time (user + system) of this process's waited-for children, in microseconds.
fn children_cpu_us() -> f64 {
    // SAFETY: an all-zero rusage is a valid value (integers and timevals).
    let mut ru: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: getrusage only writes into `ru`, which outlives the call.
    if unsafe { libc::getrusage(libc::RUSAGE_CHILDREN, &mut ru) } != 0 {
        return 0.0;
    }
    let us = |t: libc::timeval| t.tv_sec as f64 * 1e6 + t.tv_usec as f64;
    us(ru.ru_utime) + us(ru.ru_stime)
}

/// (ListenOverflows, TCPSynRetrans) from `/proc/net/netstat`; zeros if unreadable.
fn tcp_ext() -> (u64, u64) {
    let Ok(text) = fs::read_to_string("/proc/net/netstat") else {
        return (0, 0);
    };
    // Pairs of lines: `TcpExt: Name ...` then `TcpExt: value ...`.
    let mut lines = text.lines().filter(|l| l.starts_with("TcpExt:"));
    let (Some(names), Some(values)) = (lines.next(), lines.next()) else {
        return (0, 0);
    };
    let get = |want: &str| {
        names
            .split_whitespace()
            .zip(values.split_whitespace())
            .find(|(n, _)| *n == want)
            .and_then(|(_, v)| v.parse().ok())
            .unwrap_or(0)
    };
    (get("ListenOverflows"), get("TCPSynRetrans"))
}

#[derive(Debug)]
struct Machine {
    nproc: usize,
    kernel: String,
    cpu: String,
}

fn machine() -> Machine {
    let nproc = thread::available_parallelism().map_or(0, std::num::NonZero::get);
    let kernel = fs::read_to_string("/proc/sys/kernel/osrelease")
        .map_or_else(|_| "unknown".to_owned(), |s| s.trim().to_owned());
    let cpu = fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("model name"))
                .and_then(|l| l.split_once(':'))
                .map(|(_, v)| v.trim().to_owned())
        })
        .unwrap_or_else(|| "unknown CPU".to_owned());
    Machine { nproc, kernel, cpu }
}

/// Soft RLIMIT_NOFILE up to the hard limit (children inherit it): at 1000 streams haltd holds
/// 2000 sockets.
fn raise_nofile_limit() {
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit only writes into `lim`, which outlives the call.
    if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) } != 0 {
        return;
    }
    // Root may also raise the hard limit; 65536 is plenty and under every default nr_open.
    let want = lim.rlim_max.max(65_536);
    if lim.rlim_cur >= want {
        return;
    }
    for (cur, max) in [(want, want), (lim.rlim_max, lim.rlim_max)] {
        let new = libc::rlimit {
            rlim_cur: cur,
            rlim_max: max,
        };
        // SAFETY: setrlimit only reads `new`.
        if unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &new) } == 0 {
            return;
        }
    }
    eprintln!(
        "bench-proxy-overhead: raising RLIMIT_NOFILE: {}",
        std::io::Error::last_os_error()
    );
}

/// A scratch directory (logs, the ledger, the ready file), removed at the end.
#[derive(Debug)]
struct TempDir(PathBuf);

impl TempDir {
    fn new() -> Result<Self> {
        let p = std::env::temp_dir().join(format!("haltd-bench-overhead-{}", std::process::id()));
        let _ = fs::remove_dir_all(&p);
        fs::create_dir_all(&p).with_context(|| format!("creating {}", p.display()))?;
        Ok(Self(p))
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = fs::remove_dir_all(&self.0);
    }
}

/// A child process, stopped (SIGTERM, then SIGKILL after 10 s) when dropped, also on error.
#[derive(Debug)]
struct Proc {
    name: &'static str,
    child: Child,
    /// Its stderr log, quoted when it dies.
    log: PathBuf,
}

impl Proc {
    fn pid(&self) -> u32 {
        self.child.id()
    }

    fn check_alive(&mut self) -> Result<()> {
        if let Some(status) = self.child.try_wait()? {
            bail!(
                "{} exited ({status}); its log ends:\n{}",
                self.name,
                log_tail(&self.log)
            );
        }
        Ok(())
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        if matches!(self.child.try_wait(), Ok(Some(_))) {
            return;
        }
        if let Ok(pid) = libc::pid_t::try_from(self.child.id()) {
            // SAFETY: kill(2) on our own child, which has not been reaped yet.
            unsafe { libc::kill(pid, libc::SIGTERM) };
        }
        // haltd may take a few seconds to close thousands of streams and detach its gate.
        let deadline = Instant::now() + Duration::from_secs(10);
        while Instant::now() < deadline {
            if matches!(self.child.try_wait(), Ok(Some(_))) {
                return;
            }
            thread::sleep(Duration::from_millis(20));
        }
        eprintln!(
            "bench-proxy-overhead: {} (pid {}) ignored SIGTERM; SIGKILL",
            self.name,
            self.child.id()
        );
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The last lines of a log file, for error messages.
fn log_tail(path: &Path) -> String {
    let Ok(f) = fs::File::open(path) else {
        return format!("({} unreadable)", path.display());
    };
    let lines: Vec<String> = BufReader::new(f).lines().map_while(Result::ok).collect();
    lines[lines.len().saturating_sub(20)..].join("\n")
}

struct Upstream {
    proc: Proc,
    addr: String,
}

/// A `scripted-upstream` with `extra` arguments (`--tls-cert ...`); `name` names its files.
fn start_upstream(
    bin: &Path,
    dir: &Path,
    name: &str,
    extra: &[&std::ffi::OsStr],
) -> Result<Upstream> {
    let ready = dir.join(format!("{name}.addr"));
    let log = dir.join(format!("{name}.log"));
    let child = Command::new(bin)
        // nginx keeps a pool of upstream connections; haltd and the direct client ask to close.
        .args(["--listen", "127.0.0.1:0", "--keep-alive", "--ready-file"])
        .arg(&ready)
        .args(extra)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(fs::File::create(&log).context("creating upstream.log")?)
        .spawn()
        .with_context(|| format!("starting {}", bin.display()))?;
    let mut proc = Proc {
        name: "scripted-upstream",
        child,
        log,
    };
    let deadline = Instant::now() + READY_TIMEOUT;
    loop {
        if let Ok(addr) = fs::read_to_string(&ready) {
            if !addr.is_empty() {
                return Ok(Upstream { proc, addr });
            }
        }
        proc.check_alive()?;
        ensure!(
            Instant::now() < deadline,
            "scripted-upstream wrote no ready file in {READY_TIMEOUT:?}; its log:\n{}",
            log_tail(&proc.log)
        );
        thread::sleep(Duration::from_millis(10));
    }
}

struct Haltd {
    proc: Proc,
    listen: String,
}

/// A free loopback port (bound, read and released: haltd binds it a moment later).
fn free_port() -> Result<u16> {
    Ok(TcpListener::bind("127.0.0.1:0")
        .context("binding 127.0.0.1:0")?
        .local_addr()?
        .port())
}

/// A haltd in front of the upstream at URL `upstream`, with `name` for its files in `dir` and
/// its messages, and `extra` arguments for `haltd serve`.
fn start_haltd(
    bin: &Path,
    dir: &Path,
    name: &'static str,
    upstream: &str,
    args: &Args,
    extra: &[&std::ffi::OsStr],
) -> Result<Haltd> {
    let listen = format!("127.0.0.1:{}", free_port()?);
    // The bench never uses the admin API: a socket of its own, in its scratch directory.
    let admin = format!("unix:{}", dir.join(format!("{name}.admin.sock")).display());
    let metrics = format!("127.0.0.1:{}", free_port()?);
    let stdout_path = dir.join(format!("{name}.stdout"));
    let log = dir.join(format!("{name}.log"));
    let mut cmd = Command::new(bin);
    cmd.arg("serve")
        .args([
            "--listen",
            &listen,
            "--admin",
            &admin,
            "--metrics",
            &metrics,
        ])
        .arg("--ledger")
        .arg(dir.join(format!("{name}.ledger.jsonl")))
        .arg("--state-dir")
        .arg(dir.join(format!("{name}.state")))
        .arg("--ledger-no-fsync")
        // Every turn recorded (production samples 5 % of normal turns): the overhead measured
        // includes a ledger record per turn, as in the runs docs/bench.md reports.
        .args(haltd_tests::TEST_SAMPLING)
        .args(["--source", "openai", "--upstream", upstream])
        .args(["--max-streams", &args.max_streams.to_string()])
        // Every client of the bench is one address, and N connect at once: the admission
        // caps (a defence against hostile clients) would refuse most of them.
        .args(["--max-conns-per-addr", "0", "--request-phase-share", "100"])
        .args(extra);
    // The pool as nginx's (see `Args::haltd_pool_idle`), unless the run sets its own (the
    // TLS comparison's `--upstream-pool-idle 0`).
    if !extra.iter().any(|a| *a == "--upstream-pool-idle") {
        cmd.args(["--upstream-pool-idle", &args.haltd_pool_idle.to_string()])
            .args([
                "--upstream-pool-idle-timeout-ms",
                &args.haltd_pool_idle_timeout_ms.to_string(),
            ]);
    }
    if let Some(w) = args.workers {
        cmd.args(["--workers", &w.to_string()]);
    }
    // `cargo xtask bench` names the object it built; without it, the embedded one.
    if let Some(obj) = std::env::var_os("HALTD_BPF_OBJECT") {
        cmd.arg("--bpf-object").arg(obj);
    }
    let child = cmd
        .stdin(Stdio::null())
        .stdout(
            fs::File::create(&stdout_path)
                .with_context(|| format!("creating {}", stdout_path.display()))?,
        )
        .stderr(fs::File::create(&log).with_context(|| format!("creating {}", log.display()))?)
        .spawn()
        .with_context(|| format!("starting {}", bin.display()))?;
    let mut proc = Proc { name, child, log };
    let deadline = Instant::now() + READY_TIMEOUT;
    loop {
        let printed = fs::read_to_string(&stdout_path)
            .is_ok_and(|s| s.lines().any(|l| l.starts_with("haltd ready")));
        if printed {
            return Ok(Haltd { proc, listen });
        }
        proc.check_alive()?;
        ensure!(
            Instant::now() < deadline,
            "{name} did not print `haltd ready` in {READY_TIMEOUT:?}; its log:\n{}",
            log_tail(&proc.log)
        );
        thread::sleep(Duration::from_millis(10));
    }
}

/// The proxies' and the upstream's CPU rates before the first run, µs/s.
#[derive(Debug)]
struct Idle {
    haltd: f64,
    nginx: f64,
    upstream: f64,
}

/// Idle upstream connections each nginx worker keeps (`keepalive` of the `upstream` block):
/// more than a thousand streams' worth, so that every stream of a later run can reuse one.
const NGINX_KEEPALIVE: usize = 1024;
/// How long nginx keeps an idle upstream connection (`keepalive_timeout`), in seconds.
const NGINX_KEEPALIVE_TIMEOUT_S: u64 = 600;

/// nginx as a plain streaming reverse proxy to the upstream: the third route.
#[derive(Debug)]
struct Nginx {
    /// The master process (`daemon off`: our child).
    proc: Proc,
    url: String,
    /// The worker processes (the master's children), sorted.
    workers: Vec<u32>,
    /// `nginx -v`'s answer, e.g. `nginx/1.22.1`.
    version: String,
    worker_connections: u64,
}

impl Nginx {
    /// CPU time of the master and all workers together, µs.
    fn cpu_us(&self, clock: CpuClock) -> Result<f64> {
        let mut sum = clock.read_us(self.proc.pid())?;
        for &w in &self.workers {
            sum += clock
                .read_us(w)
                .with_context(|| format!("CPU time of nginx worker {w}"))?;
        }
        Ok(sum)
    }

    /// The master is running and its workers are the ones whose CPU time is being summed (a
    /// worker that died would take its CPU time with it, and its replacement's would be
    /// missed).
    fn check_alive(&mut self) -> Result<()> {
        self.proc.check_alive()?;
        let now = children_of(self.proc.pid());
        ensure!(
            now == self.workers,
            "nginx's worker processes changed from {:?} to {:?}; its log ends:\n{}",
            self.workers,
            now,
            log_tail(&self.proc.log)
        );
        Ok(())
    }
}

/// nginx's CPU time so far (0 without nginx), µs.
fn nginx_cpu_us(nginx: Option<&Nginx>, clock: CpuClock) -> Result<f64> {
    nginx.map_or(Ok(0.0), |x| x.cpu_us(clock))
}

/// The processes whose parent is `pid` (from `/proc/*/stat`), sorted.
fn children_of(pid: u32) -> Vec<u32> {
    let mut out = Vec::new();
    let Ok(dir) = fs::read_dir("/proc") else {
        return out;
    };
    for entry in dir.flatten() {
        let Some(child) = entry
            .file_name()
            .to_str()
            .and_then(|n| n.parse::<u32>().ok())
        else {
            continue;
        };
        let Ok(stat) = fs::read_to_string(format!("/proc/{child}/stat")) else {
            continue;
        };
        // After the parenthesised command name: state, then the parent's pid.
        let ppid = stat
            .rsplit_once(')')
            .and_then(|(_, rest)| rest.split_whitespace().nth(1))
            .and_then(|v| v.parse::<u32>().ok());
        if ppid == Some(pid) {
            out.push(child);
        }
    }
    out.sort_unstable();
    out
}

/// The soft open-file limit (after [`raise_nofile_limit`]), which children inherit.
fn nofile_soft() -> u64 {
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit only writes into `lim`, which outlives the call.
    if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) } != 0 {
        return 1024;
    }
    lim.rlim_cur
}

/// The configuration of the nginx route (see `docs/bench.md`): a reverse proxy to `upstream`
/// that relays the stream as it comes (`proxy_buffering off`), over HTTP/1.1 with pooled
/// upstream connections, no access log, and room for `max_streams` concurrent streams per
/// worker (two connections each). Every path nginx would write is inside `dir`.
fn nginx_conf(
    dir: &Path,
    listen: &str,
    upstream: &str,
    workers: usize,
    max_streams: u32,
) -> (String, u64) {
    let nofile = nofile_soft();
    let connections = (2 * u64::from(max_streams) + 64).min(nofile.saturating_sub(64).max(1024));
    let d = dir.display();
    let conf = format!(
        "# bench-proxy-overhead: nginx as a plain streaming relay beside haltd (issue 11)
worker_processes {workers};
worker_rlimit_nofile {nofile};
pid {d}/nginx.pid;
error_log stderr warn;

events {{
    worker_connections {connections};
}}

http {{
    access_log off;
    client_body_temp_path {d}/nginx-client-body;
    proxy_temp_path {d}/nginx-proxy;
    fastcgi_temp_path {d}/nginx-fastcgi;
    uwsgi_temp_path {d}/nginx-uwsgi;
    scgi_temp_path {d}/nginx-scgi;

    upstream backend {{
        server {upstream};
        keepalive {NGINX_KEEPALIVE};
        keepalive_requests 1000000;
        keepalive_timeout {NGINX_KEEPALIVE_TIMEOUT_S}s;
    }}

    server {{
        # As deep an accept queue as haltd's (--max-streams; the kernel caps it at somaxconn).
        listen {listen} backlog={max_streams};
        location / {{
            proxy_pass http://backend;
            proxy_http_version 1.1;
            proxy_set_header Connection \"\";
            proxy_buffering off;
            proxy_request_buffering off;
            proxy_read_timeout 600s;
        }}
    }}
}}
"
    );
    (conf, connections)
}

/// Starts nginx (`-p DIR -c DIR/nginx.conf -g 'daemon off;'`, master process on) and waits
/// until it accepts connections and all its workers are up.
fn start_nginx(
    bin: &Path,
    dir: &Path,
    upstream: &str,
    workers: usize,
    max_streams: u32,
) -> Result<Nginx> {
    let version = Command::new(bin)
        .arg("-v")
        .output()
        .with_context(|| format!("running {} -v", bin.display()))?;
    // `nginx version: nginx/1.22.1`, on stderr.
    let version = String::from_utf8_lossy(&version.stderr)
        .trim()
        .trim_start_matches("nginx version: ")
        .to_owned();
    let listen = format!("127.0.0.1:{}", free_port()?);
    let (conf, worker_connections) = nginx_conf(dir, &listen, upstream, workers, max_streams);
    let conf_path = dir.join("nginx.conf");
    fs::write(&conf_path, conf).with_context(|| format!("writing {}", conf_path.display()))?;
    let log = dir.join("nginx.log");
    let child = Command::new(bin)
        .arg("-p")
        .arg(dir)
        .arg("-c")
        .arg(&conf_path)
        .args(["-g", "daemon off;"])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(fs::File::create(&log).context("creating nginx.log")?)
        .spawn()
        .with_context(|| format!("starting {}", bin.display()))?;
    let mut proc = Proc {
        name: "nginx",
        child,
        log,
    };
    let deadline = Instant::now() + READY_TIMEOUT;
    loop {
        proc.check_alive()?;
        let kids = children_of(proc.pid());
        if kids.len() >= workers && std::net::TcpStream::connect(&listen).is_ok() {
            // A moment for a worker that is still starting to show up, then the final list.
            thread::sleep(Duration::from_millis(100));
            let kids = children_of(proc.pid());
            ensure!(
                kids.len() == workers,
                "nginx runs {} worker processes, expected {workers}: {kids:?}",
                kids.len()
            );
            return Ok(Nginx {
                proc,
                url: format!("http://{listen}"),
                workers: kids,
                version,
                worker_connections,
            });
        }
        ensure!(
            Instant::now() < deadline,
            "nginx was not ready in {READY_TIMEOUT:?}; its log:\n{}",
            log_tail(&proc.log)
        );
        thread::sleep(Duration::from_millis(20));
    }
}

/// The scorer-stall scenario (issue 11): does an external scorer that stalls on one stream
/// slow the others down?
///
/// A haltd of its own, whose HaltMonitor asks an external scorer for every token's score
/// (`[detectors.halt_monitor] mode = "observe"`, `scorer = { unix = ..., deadline_us = D }`),
/// and the scorer itself, served by this process: a thread per connection (haltd opens one
/// per turn) that answers `{"score":1.0}` at once, except that while the stall is on it sleeps
/// `stall_us` before answering each token of one stream, the victim. The victim is the first
/// turn that sends the scorer a token once the scorer is armed: this process opens it alone,
/// waits for that token, and only then starts the measured streams. Each round runs the same
/// load twice, with the stall and without it (in alternating order): N measured streams
/// (`bench-proxy`) beside the victim, which is closed when they are done. The figure is the
/// measured streams' per-token latency p99 with the stall over without it.
///
/// All these streams ask the upstream for `align=1`: their tokens leave at the same multiples
/// of the pace, as one decode step of a batching server yields a token for every sequence, so
/// the victim's token arrives together with the others' whenever the victim began. Without it
/// the stall would hit the others or miss them depending on the victim's phase, which is
/// chance.
///
/// `observe` keeps the victim's stream going when an answer comes in after the deadline (in
/// `hard` mode the first late answer would trip it and end the stall after one token); the
/// other streams' HaltMonitor does the same work in either mode. With the default stall of 90 %
/// of the deadline the answers come in time, and haltd waits that long per victim token.
#[path = "bench-proxy-overhead/upstream_tls.rs"]
mod upstream_tls;

#[path = "bench-proxy-overhead/client_tls.rs"]
mod client_tls;

#[path = "bench-proxy-overhead/tls_compare.rs"]
mod tls_compare;

#[path = "bench-proxy-overhead/messages.rs"]
mod messages;

mod stall {
    use std::{
        io::{ErrorKind, Read, Write},
        net::TcpStream,
        os::unix::net::{UnixListener, UnixStream},
        sync::{
            atomic::{AtomicBool, AtomicU64, Ordering},
            Arc, Mutex, PoisonError,
        },
        thread::JoinHandle,
    };

    use anyhow::Context as _;

    use super::{
        children_cpu_us, fs, json, machine_busy_us, median, round1, run_client, show, start_haltd,
        thread, verdict, Args, BufRead, BufReader, ClientReport, CpuClock, Deserialize, Duration,
        Instant, Path, Result, Upstream, Value, OTHERS_WARN_PCT, SETTLE, TARGET_STALL_P99_RATIO,
    };

    /// What the scenario needs from the bench.
    pub(super) struct Context<'a> {
        pub(super) args: &'a Args,
        pub(super) haltd_bin: &'a Path,
        pub(super) client_bin: &'a Path,
        /// The scratch directory (the scorer's socket, haltd's config and files).
        pub(super) dir: &'a Path,
        /// haltd's data-plane workers, for the report.
        pub(super) workers: usize,
        pub(super) cpu_clock: CpuClock,
        pub(super) nproc: usize,
    }

    /// How long the victim may take to send its first token to the scorer.
    const VICTIM_TIMEOUT: Duration = Duration::from_secs(10);
    /// Most of the victim's response kept, to look for an error event.
    const VICTIM_KEEP: usize = 1 << 20;

    /// The scorer's state, shared by its connection threads.
    #[derive(Debug, Default)]
    struct Scorer {
        /// The next turn to send a token becomes the victim.
        armed: AtomicBool,
        victim: Mutex<Option<String>>,
        /// Sleep before each answer to the victim, µs; 0 answers it at once too.
        stall_us: AtomicU64,
        /// Tokens scored, all turns.
        scored: AtomicU64,
        victim_scored: AtomicU64,
        /// Connections on which the victim's tokens came: more than one means haltd gave up
        /// on a late answer and reconnected.
        victim_connections: AtomicU64,
        /// Request lines that were not the protocol's.
        bad_lines: AtomicU64,
    }

    /// A request line; the rest of its keys are not needed.
    #[derive(Deserialize)]
    struct ScoreRequest {
        turn_id: String,
    }

    impl Scorer {
        fn reset(&self, stall_us: u64) {
            *self.victim.lock().unwrap_or_else(PoisonError::into_inner) = None;
            self.stall_us.store(stall_us, Ordering::SeqCst);
            for c in [
                &self.scored,
                &self.victim_scored,
                &self.victim_connections,
                &self.bad_lines,
            ] {
                c.store(0, Ordering::SeqCst);
            }
            self.armed.store(true, Ordering::SeqCst);
        }

        fn victim_known(&self) -> bool {
            self.victim
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .is_some()
        }

        /// Whether `turn` is the victim; the first turn seen once armed becomes it.
        fn is_victim(&self, turn: &str) -> bool {
            let mut v = self.victim.lock().unwrap_or_else(PoisonError::into_inner);
            if v.is_none() && self.armed.swap(false, Ordering::SeqCst) {
                *v = Some(turn.to_owned());
            }
            v.as_deref() == Some(turn)
        }

        /// One connection (one turn, or one attempt of it) until haltd closes it.
        fn serve(&self, conn: UnixStream) {
            let Ok(read_half) = conn.try_clone() else {
                return;
            };
            let mut reader = BufReader::new(read_half);
            let mut conn = conn;
            let mut line = String::new();
            let mut counted = false;
            loop {
                line.clear();
                match reader.read_line(&mut line) {
                    Ok(0) | Err(_) => return,
                    Ok(_) => {}
                }
                let Ok(req) = serde_json::from_str::<ScoreRequest>(&line) else {
                    self.bad_lines.fetch_add(1, Ordering::Relaxed);
                    return;
                };
                self.scored.fetch_add(1, Ordering::Relaxed);
                if self.is_victim(&req.turn_id) {
                    self.victim_scored.fetch_add(1, Ordering::Relaxed);
                    if !counted {
                        counted = true;
                        self.victim_connections.fetch_add(1, Ordering::Relaxed);
                    }
                    let us = self.stall_us.load(Ordering::Relaxed);
                    if us > 0 {
                        thread::sleep(Duration::from_micros(us));
                    }
                }
                if conn.write_all(b"{\"score\":1.0}\n").is_err() {
                    return;
                }
            }
        }
    }

    /// Binds the scorer's socket and serves it from a thread for the rest of the process.
    fn start_scorer(path: &Path) -> Result<Arc<Scorer>> {
        let listener =
            UnixListener::bind(path).with_context(|| format!("binding {}", path.display()))?;
        let scorer = Arc::new(Scorer::default());
        let s = Arc::clone(&scorer);
        thread::Builder::new()
            .name("scorer".into())
            .spawn(move || {
                for conn in listener.incoming() {
                    match conn {
                        Ok(conn) => {
                            let s = Arc::clone(&s);
                            let spawned = thread::Builder::new()
                                .name("scorer-conn".into())
                                .spawn(move || s.serve(conn));
                            if let Err(e) = spawned {
                                eprintln!("bench-proxy-overhead: scorer thread: {e}");
                            }
                        }
                        Err(e) => eprintln!("bench-proxy-overhead: scorer accept: {e}"),
                    }
                }
            })
            .context("starting the scorer thread")?;
        Ok(scorer)
    }

    /// The victim stream: a client of our own that reads and keeps what haltd sends until it
    /// is told to stop.
    struct Victim {
        stop: Arc<AtomicBool>,
        handle: JoinHandle<VictimEnd>,
    }

    #[derive(Debug, Default)]
    struct VictimEnd {
        bytes: usize,
        /// Why the stream is not to be trusted: it ended before it was stopped, an error
        /// event, a socket error.
        problem: Option<String>,
    }

    fn start_victim(addr: &str, tokens: usize, pace_ms: u64) -> Result<Victim> {
        let mut s = TcpStream::connect(addr).with_context(|| format!("connecting to {addr}"))?;
        s.set_nodelay(true).context("TCP_NODELAY")?;
        s.set_read_timeout(Some(Duration::from_millis(50)))
            .context("SO_RCVTIMEO")?;
        let body = json!({"model": "scripted", "stream": true, "max_tokens": tokens,
            "messages": [{"role": "user",
                          "content": format!("[[script:bench tokens={tokens} pace_ms={pace_ms} align=1]]")}]})
        .to_string();
        let req = format!(
            "POST /v1/chat/completions HTTP/1.1\r\nhost: {addr}\r\ncontent-type: \
             application/json\r\naccept: text/event-stream\r\ncontent-length: {}\r\n\
             connection: close\r\n\r\n{body}",
            body.len()
        );
        s.write_all(req.as_bytes())
            .context("sending the victim's request")?;
        let stop = Arc::new(AtomicBool::new(false));
        let stopped = Arc::clone(&stop);
        let handle = thread::spawn(move || {
            let mut end = VictimEnd::default();
            let mut kept = Vec::new();
            let mut buf = [0u8; 16 * 1024];
            loop {
                match s.read(&mut buf) {
                    Ok(0) => {
                        if !stopped.load(Ordering::SeqCst) {
                            end.problem = Some(format!(
                                "the victim's stream ended before the run did, after {} bytes",
                                end.bytes
                            ));
                        }
                        break;
                    }
                    Ok(n) => {
                        end.bytes += n;
                        let room = VICTIM_KEEP.saturating_sub(kept.len());
                        kept.extend_from_slice(&buf[..n.min(room)]);
                    }
                    Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => {}
                    Err(e) => {
                        end.problem = Some(format!("reading the victim's stream: {e}"));
                        break;
                    }
                }
                if stopped.load(Ordering::SeqCst) {
                    break;
                }
            }
            let text = String::from_utf8_lossy(&kept);
            if !text.starts_with("HTTP/1.1 200") {
                end.problem = Some(format!(
                    "the victim's response: {}",
                    text.lines().next().unwrap_or("(nothing)")
                ));
            } else if let Some(i) = text.find("data: {\"error\"") {
                let line = text[i..].lines().next().unwrap_or_default();
                end.problem = Some(format!(
                    "the victim's stream ended in an error event: {}",
                    line.chars().take(300).collect::<String>()
                ));
            }
            end
        });
        Ok(Victim { stop, handle })
    }

    impl Victim {
        fn finish(self) -> VictimEnd {
            self.stop.store(true, Ordering::SeqCst);
            self.handle.join().unwrap_or_else(|_| VictimEnd {
                bytes: 0,
                problem: Some("the victim's thread panicked".into()),
            })
        }
    }

    /// One measured run.
    #[derive(Debug)]
    struct StallRun {
        round: usize,
        stalled: bool,
        client: ClientReport,
        /// haltd's CPU time over the run (the measured streams' and the victim's), µs.
        haltd_cpu_us: f64,
        /// The bench's processes (haltd, upstream, client, this one with the scorer and the
        /// victim) and everyone else, in percent of all CPUs over the run.
        busy_pct: f64,
        others_pct: f64,
        scored: u64,
        victim_scored: u64,
        victim_connections: u64,
        bad_lines: u64,
        victim: VictimEnd,
    }

    /// The scenario's outcome.
    #[derive(Debug)]
    pub(super) struct Stall {
        streams: usize,
        tokens: usize,
        pace_ms: u64,
        deadline_us: u64,
        stall_us: u64,
        workers: usize,
        runs: Vec<StallRun>,
    }

    impl Stall {
        fn of(&self, stalled: bool) -> impl Iterator<Item = &StallRun> {
            self.runs.iter().filter(move |r| r.stalled == stalled)
        }

        fn med(&self, stalled: bool, f: impl Fn(&StallRun) -> Option<f64>) -> Option<f64> {
            median(self.of(stalled).filter_map(f).collect())
        }

        fn ratio(&self) -> Option<f64> {
            let without = self.med(false, |r| r.client.p99_us)?;
            let with = self.med(true, |r| r.client.p99_us)?;
            (without > 0.0).then(|| with / without)
        }

        fn pass(&self) -> Option<bool> {
            self.ratio().map(|r| r <= TARGET_STALL_P99_RATIO)
        }

        /// The worst share of the CPUs other processes took during a run, percent.
        fn others_max(&self) -> Option<f64> {
            self.runs
                .iter()
                .map(|r| r.others_pct)
                .max_by(f64::total_cmp)
        }

        /// What makes a run untrustworthy: stream errors, no tokens, a victim that did not
        /// last or was not stalled, bad scorer requests.
        fn problems(&self) -> Vec<String> {
            let mut out = Vec::new();
            for r in &self.runs {
                let tag = format!(
                    "round {} {}",
                    r.round + 1,
                    if r.stalled { "with stall" } else { "without" }
                );
                if r.client.errors > 0 || r.client.tokens == 0 {
                    out.push(format!(
                        "{tag}: {} errors, {} tokens",
                        r.client.errors, r.client.tokens
                    ));
                }
                if let Some(p) = &r.victim.problem {
                    out.push(format!("{tag}: {p}"));
                }
                if r.victim_scored == 0 {
                    out.push(format!("{tag}: the scorer saw none of the victim's tokens"));
                }
                if r.bad_lines > 0 {
                    out.push(format!("{tag}: {} bad scorer request lines", r.bad_lines));
                }
            }
            out
        }

        pub(super) fn print(&self) {
            println!(
                "\nscorer stall: {} streams through haltd ({} workers) whose HaltMonitor asks an \
                 external scorer (deadline {} µs, mode observe), beside one more stream whose \
                 every token the scorer answers after {} µs in the stalled runs; the {} \
                 streams' per-token latency, median of {} rounds; target: p99 with / without \
                 ≤ {TARGET_STALL_P99_RATIO:.2}",
                self.streams,
                self.workers,
                self.deadline_us,
                self.stall_us,
                self.streams,
                self.runs.len() / 2
            );
            println!(
                "{:>12} | {:>9} {:>9} {:>9} | {:>13} {:>11} | {:>6}",
                "", "p50 µs", "p99 µs", "max µs", "victim tokens", "connections", "errors"
            );
            for (stalled, label) in [(false, "without"), (true, "with stall")] {
                let sum = |f: &dyn Fn(&StallRun) -> u64| self.of(stalled).map(f).sum::<u64>();
                println!(
                    "{label:>12} | {:>9} {:>9} {:>9} | {:>13} {:>11} | {:>6}",
                    show(self.med(stalled, |r| r.client.p50_us)),
                    show(self.med(stalled, |r| r.client.p99_us)),
                    show(self.med(stalled, |r| r.client.max_us)),
                    sum(&|r| r.victim_scored),
                    sum(&|r| r.victim_connections),
                    sum(&|r| r.client.errors)
                );
            }
            println!(
                "{:>12} | p99 ratio {} | {}{}",
                "",
                self.ratio()
                    .map_or_else(|| "-".to_owned(), |r| format!("{r:.2}")),
                verdict(self.pass()),
                if self.others_max().is_some_and(|o| o > OTHERS_WARN_PCT) {
                    " (disturbed: see the note)"
                } else {
                    ""
                }
            );
            if let Some(o) = self.others_max().filter(|&o| o > OTHERS_WARN_PCT) {
                println!(
                    "note: scorer stall: other processes used up to {o:.0}% of the CPUs during a \
                     run; the ratio is not to be trusted, rerun on a quiet machine"
                );
            }
            for p in self.problems() {
                println!("problem: scorer stall, {p}");
            }
        }

        pub(super) fn to_json(&self) -> Value {
            let r = |v: Option<f64>| v.map(round1);
            json!({
                "streams": self.streams,
                "tokens_per_stream": self.tokens,
                "pace_ms": self.pace_ms,
                "deadline_us": self.deadline_us,
                "stall_us": self.stall_us,
                "halt_monitor_mode": "observe",
                "haltd_workers": self.workers,
                "rounds": self.runs.len() / 2,
                "without_p50_us": r(self.med(false, |x| x.client.p50_us)),
                "without_p99_us": r(self.med(false, |x| x.client.p99_us)),
                "with_p50_us": r(self.med(true, |x| x.client.p50_us)),
                "with_p99_us": r(self.med(true, |x| x.client.p99_us)),
                "p99_ratio": self.ratio().map(|v| (v * 100.0).round() / 100.0),
                "pass": self.pass(),
                "problems": self.problems(),
                "others_pct_max": self.others_max().map(round1),
                "runs": self.runs.iter().map(|x| json!({
                    "round": x.round + 1,
                    "stalled": x.stalled,
                    "requests": x.client.requests,
                    "tokens": x.client.tokens,
                    "errors": x.client.errors,
                    "p50_us": x.client.p50_us,
                    "p90_us": x.client.p90_us,
                    "p99_us": x.client.p99_us,
                    "max_us": x.client.max_us,
                    "wall_s": x.client.wall_s,
                    "haltd_cpu_us_per_token": round1(x.haltd_cpu_us / x.client.tokens.max(1) as f64),
                    "busy_pct": round1(x.busy_pct),
                    "others_pct": round1(x.others_pct),
                    "scored_tokens": x.scored,
                    "victim_tokens_scored": x.victim_scored,
                    "victim_connections": x.victim_connections,
                    "victim_bytes": x.victim.bytes,
                    "victim_problem": x.victim.problem,
                })).collect::<Vec<_>>(),
            })
        }
    }

    /// Runs the scenario against `upstream` with a haltd of its own (stopped at the end).
    pub(super) fn run(ctx: &Context<'_>, upstream: &mut Upstream) -> Result<Stall> {
        let Context {
            args,
            haltd_bin: _,
            client_bin,
            dir,
            workers,
            cpu_clock,
            nproc,
        } = *ctx;
        let n = args.stall_streams;
        let tokens = args.tokens.unwrap_or_else(|| super::default_tokens(n));
        let deadline_us = args.scorer_deadline_us;
        let stall_us = args.stall_us.unwrap_or(deadline_us * 9 / 10);
        let socket = dir.join("scorer.sock");
        let scorer = start_scorer(&socket)?;
        let mut haltd = start_scored_haltd(ctx, upstream, &socket, deadline_us)?;
        let url = format!("http://{}", haltd.listen);
        eprintln!(
            "bench-proxy-overhead: scorer stall: haltd {} (pid {}), scorer {}, deadline {} µs, \
             stall {} µs",
            haltd.listen,
            haltd.proc.pid(),
            socket.display(),
            deadline_us,
            stall_us
        );
        // The victim outlasts the measured run by far; it is closed when the run ends.
        let victim_tokens = tokens * 10 + 100;
        let mut runs = Vec::new();
        for round in 0..args.rounds {
            let order = if round % 2 == 0 {
                [false, true]
            } else {
                [true, false]
            };
            for stalled in order {
                let tag = stall_tag(n, round, args.rounds, stalled);
                eprintln!("{tag} {tokens} tokens/stream, pace {} ms", args.pace_ms);
                scorer.reset(if stalled { stall_us } else { 0 });
                let victim = start_victim(&haltd.listen, victim_tokens, args.pace_ms)?;
                let victim = wait_for_victim(&scorer, victim, &tag, &haltd.proc.log)?;
                let pids = (haltd.proc.pid(), upstream.proc.pid());
                let cpu0 = CpuMark::take(cpu_clock, pids)?;
                let client = run_client(client_bin, &url, n, tokens, args.pace_ms, true);
                let (haltd_cpu_us, ours, all_us, capacity_us) =
                    cpu0.since(cpu_clock, pids, nproc)?;
                let victim = victim.finish();
                let client = client.with_context(|| format!("{tag} bench-proxy"))?;
                let run = StallRun {
                    round,
                    stalled,
                    client,
                    haltd_cpu_us,
                    busy_pct: ours / capacity_us * 100.0,
                    others_pct: ((all_us - ours) / capacity_us * 100.0).max(0.0),
                    scored: scorer.scored.load(Ordering::SeqCst),
                    victim_scored: scorer.victim_scored.load(Ordering::SeqCst),
                    victim_connections: scorer.victim_connections.load(Ordering::SeqCst),
                    bad_lines: scorer.bad_lines.load(Ordering::SeqCst),
                    victim,
                };
                log_stall_run(&tag, &run);
                runs.push(run);
                thread::sleep(SETTLE);
                haltd.proc.check_alive()?;
                upstream.proc.check_alive()?;
            }
        }
        Ok(Stall {
            streams: n,
            tokens,
            pace_ms: args.pace_ms,
            deadline_us,
            stall_us,
            workers,
            runs,
        })
    }

    fn stall_tag(n: usize, round: usize, rounds: usize, stalled: bool) -> String {
        format!(
            "[scorer stall, N={n} round {}/{} {}]",
            round + 1,
            rounds,
            if stalled { "with stall" } else { "without" }
        )
    }

    /// CPU counters at the start of a stall run: haltd, the upstream, this process (the
    /// scorer's threads and the victim), the client, the whole machine.
    struct CpuMark {
        haltd: f64,
        upstream: f64,
        me: f64,
        children: f64,
        all: f64,
        at: Instant,
    }

    impl CpuMark {
        /// `pids`: haltd's and the upstream's.
        fn take(clock: CpuClock, pids: (u32, u32)) -> Result<Self> {
            let all = machine_busy_us();
            Ok(CpuMark {
                haltd: clock.read_us(pids.0)?,
                upstream: clock.read_us(pids.1)?,
                me: clock.read_us(std::process::id())?,
                children: children_cpu_us(),
                all,
                at: Instant::now(),
            })
        }

        /// Since the mark: haltd's CPU, all of the bench's processes' CPU, the machine's busy
        /// time and its capacity, µs.
        fn since(
            &self,
            clock: CpuClock,
            pids: (u32, u32),
            nproc: usize,
        ) -> Result<(f64, f64, f64, f64)> {
            let haltd_cpu_us = clock.read_us(pids.0)? - self.haltd;
            let ours = haltd_cpu_us + clock.read_us(pids.1)? - self.upstream
                + clock.read_us(std::process::id())?
                - self.me
                + children_cpu_us()
                - self.children;
            let all_us = machine_busy_us() - self.all;
            let capacity_us = self.at.elapsed().as_secs_f64() * 1e6 * nproc.max(1) as f64;
            Ok((haltd_cpu_us, ours, all_us, capacity_us))
        }
    }

    /// Starts the scenario's haltd, its HaltMonitor asking the scorer at `socket` (observe).
    fn start_scored_haltd(
        ctx: &Context<'_>,
        upstream: &Upstream,
        socket: &Path,
        deadline_us: u64,
    ) -> Result<super::Haltd> {
        let conf = ctx.dir.join("scorer.toml");
        fs::write(
            &conf,
            format!(
                "# bench-proxy-overhead, scorer-stall scenario\n\
                 [detectors.halt_monitor]\n\
                 mode = \"observe\"\n\
                 scorer = {{ unix = \"{}\", deadline_us = {deadline_us} }}\n",
                socket.display()
            ),
        )
        .with_context(|| format!("writing {}", conf.display()))?;
        start_haltd(
            ctx.haltd_bin,
            ctx.dir,
            "haltd-scorer",
            &format!("http://{}", upstream.addr),
            ctx.args,
            &["--config".as_ref(), conf.as_os_str()],
        )
    }

    /// Waits until the victim's first token has reached the scorer (which then knows which
    /// connection to stall); fails after `VICTIM_TIMEOUT` with the end of haltd's log.
    fn wait_for_victim(scorer: &Scorer, victim: Victim, tag: &str, log: &Path) -> Result<Victim> {
        let t_victim = Instant::now();
        while !scorer.victim_known() {
            if t_victim.elapsed() > VICTIM_TIMEOUT {
                let end = victim.finish();
                anyhow::bail!(
                    "{tag}: the victim's first token did not reach the scorer in \
                     {VICTIM_TIMEOUT:?} ({}); haltd's log ends:\n{}",
                    end.problem.unwrap_or_else(|| "no error seen".into()),
                    super::log_tail(log)
                );
            }
            thread::sleep(Duration::from_millis(5));
        }
        Ok(victim)
    }

    /// One stall run's line, and a warning when other work disturbed it.
    fn log_stall_run(tag: &str, run: &StallRun) {
        if run.others_pct > OTHERS_WARN_PCT {
            eprintln!(
                "{tag} other processes used {:.0}% of the CPUs during this run: its \
                 numbers are disturbed",
                run.others_pct
            );
        }
        eprintln!(
            "{tag} {} tokens, {} errors; latency µs p50 {} p99 {} max {}; scorer: {} \
             tokens, {} of the victim's on {} connections; haltd CPU {:.1} µs/token; \
             CPUs {:.0}% busy",
            run.client.tokens,
            run.client.errors,
            show(run.client.p50_us),
            show(run.client.p99_us),
            show(run.client.max_us),
            run.scored,
            run.victim_scored,
            run.victim_connections,
            run.haltd_cpu_us / run.client.tokens.max(1) as f64,
            run.busy_pct
        );
    }
}
