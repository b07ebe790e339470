//! `--client-tls`: what TLS for clients (`--tls-cert`) costs haltd, measured in one run
//! against the same load over plain HTTP (issue 12, point 5).
//!
//! Two haltd processes with the same flags proxy the bench's plain upstream: `haltd-plain`
//! and `haltd-client-tls` (`--tls-cert`/`--tls-key`, a certificate from a CA made for the run,
//! `haltd_tests::tls::TestPki`). For each of `--tls-streams` and each round, `bench-proxy` runs
//! N streams through each, the order alternating from round to round, the TLS side with
//! `--tls-ca` (a new TLS connection and handshake per stream, as the SDKs make per request
//! without keep-alive). A run gives that haltd's CPU time per token (its process CPU clock over
//! the run, less its idle rate measured before the first run: the handshakes are included,
//! one per stream of T tokens), the per-token latency (upstream write → client read: what
//! sealing each token's record and opening it at the client add), and each request's time to
//! first byte inside the burst (from the TCP connect: the handshake included for TLS).
//!
//! The report's `client_tls` has the medians over the rounds per N; a run with stream errors
//! is listed in `problems`, which fails the bench.

use std::ffi::OsStr;

use haltd_tests::tls::TestPki;

use super::{
    children_cpu_us, default_tokens, json, machine_busy_us, median, round1, run_client_with, show,
    start_haltd, thread, Args, Bins, ClientReport, CpuClock, Haltd, Instant, Path, Result,
    Upstream, Value, IDLE_WINDOW, SETTLE,
};

/// What the scenario needs from the bench.
pub(super) struct Context<'a> {
    pub(super) args: &'a Args,
    pub(super) bins: &'a Bins,
    pub(super) dir: &'a Path,
    pub(super) cpu_clock: CpuClock,
    pub(super) nproc: usize,
}

/// One haltd of the comparison.
struct Side {
    haltd: Haltd,
    /// Its CPU rate with nothing open, µs/s.
    idle_us_per_s: f64,
}

/// One client run through one side.
struct Run {
    streams: usize,
    tls: bool,
    client: ClientReport,
    /// That haltd's CPU time over the run less its idle rate over the window, µs.
    net_cpu_us: f64,
    others_pct: f64,
}

/// Runs the scenario: two haltds in front of `upstream`, one of them serving TLS.
pub(super) fn run(ctx: &Context<'_>, upstream: &Upstream) -> Result<Value> {
    let pki = TestPki::new("bench-client", &["localhost", "127.0.0.1"])?;
    let url = format!("http://{}", upstream.addr);
    let tls_flags = [
        "--tls-cert".as_ref(),
        pki.cert.as_os_str(),
        "--tls-key".as_ref(),
        pki.key.as_os_str(),
    ];
    let start =
        |name, extra: &[&OsStr]| start_haltd(&ctx.bins.haltd, ctx.dir, name, &url, ctx.args, extra);
    let sides = [
        side(ctx, start("haltd-plain-clients", &[])?)?,
        side(ctx, start("haltd-client-tls", &tls_flags)?)?,
    ];
    let ca = pki.ca.display().to_string();
    let mut runs = Vec::new();
    for &n in &ctx.args.tls_streams {
        for round in 0..ctx.args.rounds {
            for k in 0..2 {
                let tls = (k + round) % 2 == 1;
                let ca = tls.then_some(ca.as_str());
                runs.push(run_once(ctx, &sides[usize::from(tls)], n, round, ca)?);
            }
        }
    }
    let report = summarize(ctx, &runs);
    print(&report);
    Ok(report)
}

/// A started haltd and its idle CPU rate.
fn side(ctx: &Context<'_>, haltd: Haltd) -> Result<Side> {
    let pid = haltd.proc.pid();
    let (c0, t0) = (ctx.cpu_clock.read_us(pid)?, Instant::now());
    thread::sleep(IDLE_WINDOW);
    let idle_us_per_s = (ctx.cpu_clock.read_us(pid)? - c0) / t0.elapsed().as_secs_f64();
    Ok(Side {
        haltd,
        idle_us_per_s,
    })
}

fn run_once(
    ctx: &Context<'_>,
    side: &Side,
    n: usize,
    round: usize,
    ca: Option<&str>,
) -> Result<Run> {
    let args = ctx.args;
    let tls = ca.is_some();
    let tokens = args.tokens.unwrap_or_else(|| default_tokens(n));
    let name = if tls { "tls" } else { "plain" };
    let tag = format!(
        "[client TLS: N={n} round {}/{} {name}]",
        round + 1,
        args.rounds
    );
    let scheme = if tls { "https" } else { "http" };
    let url = format!("{scheme}://{}", side.haltd.listen);
    let extra: Vec<&str> = ca.map(|c| vec!["--tls-ca", c]).unwrap_or_default();
    let pid = side.haltd.proc.pid();
    let (all0, kids0) = (machine_busy_us(), children_cpu_us());
    let (cpu0, t0) = (ctx.cpu_clock.read_us(pid)?, Instant::now());
    let client = run_client_with(&ctx.bins.client, &url, n, tokens, args.pace_ms, &extra)?;
    thread::sleep(SETTLE);
    let window_s = t0.elapsed().as_secs_f64();
    let cpu_us = ctx.cpu_clock.read_us(pid)? - cpu0;
    let capacity_us = window_s * 1e6 * ctx.nproc.max(1) as f64;
    let ours = cpu_us + children_cpu_us() - kids0;
    let others_pct = ((machine_busy_us() - all0 - ours) / capacity_us * 100.0).max(0.0);
    let net_cpu_us = cpu_us - side.idle_us_per_s * window_s;
    eprintln!(
        "{tag} {} tokens, {} errors; haltd CPU {:.1} µs/token net; latency µs p50 {} p99 {}; \
         first byte µs p50 {}; others {others_pct:.0}% of the CPUs",
        client.tokens,
        client.errors,
        net_cpu_us / client.tokens.max(1) as f64,
        show(client.p50_us),
        show(client.p99_us),
        show(client.ttfb_p50_us),
    );
    Ok(Run {
        streams: n,
        tls,
        client,
        net_cpu_us,
        others_pct,
    })
}

/// Medians over the rounds of one side at one stream count.
fn medians(runs: &[Run], n: usize, tls: bool) -> Value {
    let mine: Vec<&Run> = runs
        .iter()
        .filter(|r| r.streams == n && r.tls == tls)
        .collect();
    let med = |f: &dyn Fn(&Run) -> Option<f64>| {
        median(mine.iter().filter_map(|r| f(r)).collect()).map(round1)
    };
    json!({
        "cpu_us_per_token": med(&|r| Some(r.net_cpu_us / r.client.tokens.max(1) as f64)),
        "latency_p50_us": med(&|r| r.client.p50_us),
        "latency_p99_us": med(&|r| r.client.p99_us),
        "ttfb_p50_us": med(&|r| r.client.ttfb_p50_us),
        "others_pct": med(&|r| Some(r.others_pct)),
        "runs": mine.len(),
    })
}

fn summarize(ctx: &Context<'_>, runs: &[Run]) -> Value {
    let ratio = |a: &Value, b: &Value| match (a.as_f64(), b.as_f64()) {
        (Some(a), Some(b)) if b > 0.0 => Some((a / b * 100.0).round() / 100.0),
        _ => None,
    };
    let diff = |a: &Value, b: &Value| match (a.as_f64(), b.as_f64()) {
        (Some(a), Some(b)) => Some(round1(a - b)),
        _ => None,
    };
    let results: Vec<Value> = ctx
        .args
        .tls_streams
        .iter()
        .map(|&n| {
            let (p, t) = (medians(runs, n, false), medians(runs, n, true));
            json!({
                "streams": n,
                "plain": p,
                "tls": t,
                "tls_over_plain_cpu": ratio(&t["cpu_us_per_token"], &p["cpu_us_per_token"]),
                "tls_added_latency_p50_us": diff(&t["latency_p50_us"], &p["latency_p50_us"]),
                "tls_added_latency_p99_us": diff(&t["latency_p99_us"], &p["latency_p99_us"]),
            })
        })
        .collect();
    let problems: Vec<String> = runs
        .iter()
        .filter(|r| r.client.errors > 0 || r.client.tokens == 0)
        .map(|r| {
            let side = if r.tls { "tls" } else { "plain" };
            format!(
                "N={} {side}: {} errors, {} tokens",
                r.streams, r.client.errors, r.client.tokens
            )
        })
        .collect();
    json!({"results": results, "problems": problems})
}

fn print(report: &Value) {
    let s = |v: &Value| show(v.as_f64());
    println!(
        "\nTLS for clients: haltd serving plain HTTP and TLS to the same load, medians over the \
         rounds (CPU µs/token net of idle; latency and first byte µs)"
    );
    println!(
        "{:>7} | {:>9} {:>9} {:>6} | {:>9} {:>9} | {:>9} {:>9} | {:>9} {:>9}",
        "streams",
        "cpu plain",
        "cpu tls",
        "ratio",
        "p50 plain",
        "p50 tls",
        "p99 plain",
        "p99 tls",
        "ttfb pl",
        "ttfb tls"
    );
    for r in report["results"].as_array().into_iter().flatten() {
        let (p, t) = (&r["plain"], &r["tls"]);
        println!(
            "{:>7} | {:>9} {:>9} {:>6} | {:>9} {:>9} | {:>9} {:>9} | {:>9} {:>9}",
            r["streams"],
            s(&p["cpu_us_per_token"]),
            s(&t["cpu_us_per_token"]),
            s(&r["tls_over_plain_cpu"]),
            s(&p["latency_p50_us"]),
            s(&t["latency_p50_us"]),
            s(&p["latency_p99_us"]),
            s(&t["latency_p99_us"]),
            s(&p["ttfb_p50_us"]),
            s(&t["ttfb_p50_us"]),
        );
    }
}
