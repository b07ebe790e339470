//! `--upstream-tls`: what TLS to the upstream costs haltd, measured in one run against the same
//! load over plain HTTP.
//!
//! A second `scripted-upstream` serves the same scripts in TLS (its TLS front, with a
//! certificate from a CA made for the run, `haltd_tests::tls::TestPki`), beside the bench's
//! plain one. Two haltd processes with the same flags proxy them: `haltd-plain`
//! (`--upstream http://...`) and `haltd-tls` (`--upstream https://... --upstream-ca-file`).
//! For each of `--tls-streams` and each round, `bench-proxy` runs N streams through each (the
//! order alternating from round to round); a run gives that haltd's CPU time per token (its own
//! process CPU clock over the run, less its idle rate measured before the first run), the
//! per-token latency (upstream write → client read, which also includes the upstream's own
//! TLS front for the TLS side) and each request's time to first byte inside the burst.
//!
//! Then the sequential time to first byte (`haltd_tests::seq_ttfb`: one request at a time, a
//! new client connection each): through both haltds with their upstream pools warm (a turn
//! reuses a pooled connection and its TLS session: no handshake), and through two more haltds
//! with `--upstream-pool-idle 0`, whose every turn opens a new upstream connection (TCP, and
//! for TLS the handshake: the cost a cold pool pays).
//!
//! The report's `upstream_tls` has the medians over the rounds per N and both probes; a run
//! with stream errors is listed in `problems`, which fails the bench.

use std::ffi::OsStr;

use haltd_tests::{seq_ttfb, tls::TestPki};

use super::{
    children_cpu_us, default_tokens, json, machine_busy_us, median, round1, run_client, show,
    start_haltd, start_upstream, thread, Args, Bins, ClientReport, CpuClock, Haltd, Instant, Path,
    Pct, Result, Upstream, Value, IDLE_WINDOW, SETTLE, TTFB_WARMUP,
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

/// Runs the scenario against `plain` (the bench's upstream) and a TLS twin of it.
pub(super) fn run(ctx: &Context<'_>, plain: &Upstream) -> Result<Value> {
    let pki = TestPki::new("bench", &["127.0.0.1"])?;
    let tls_args: Vec<String> = pki.upstream_args();
    let tls_args: Vec<&OsStr> = tls_args.iter().map(OsStr::new).collect();
    let tls_up = start_upstream(&ctx.bins.upstream, ctx.dir, "upstream-tls", &tls_args)?;
    let plain_url = format!("http://{}", plain.addr);
    let tls_url = format!("https://{}", tls_up.addr);
    let ca = ["--upstream-ca-file".as_ref(), pki.ca.as_os_str()];
    let start = |name, url: &str, extra: &[&OsStr]| {
        start_haltd(&ctx.bins.haltd, ctx.dir, name, url, ctx.args, extra)
    };
    let sides = [
        side(ctx, start("haltd-plain", &plain_url, &[])?)?,
        side(ctx, start("haltd-tls", &tls_url, &ca)?)?,
    ];
    let mut runs = Vec::new();
    for &n in &ctx.args.tls_streams {
        for round in 0..ctx.args.rounds {
            for k in 0..2 {
                let tls = (k + round) % 2 == 1;
                runs.push(run_once(ctx, &sides[usize::from(tls)], n, round, tls)?);
            }
        }
    }
    let pooled = seq_probe(ctx, &sides[0].haltd, &sides[1].haltd, "pool warm")?;
    drop(sides);
    let pool0 = ["--upstream-pool-idle".as_ref(), "0".as_ref()];
    let ca_pool0 = [ca[0], ca[1], pool0[0], pool0[1]];
    let cold_plain = start("haltd-plain-nopool", &plain_url, &pool0)?;
    let cold_tls = start("haltd-tls-nopool", &tls_url, &ca_pool0)?;
    let cold = seq_probe(
        ctx,
        &cold_plain,
        &cold_tls,
        "new upstream connection per turn",
    )?;
    let report = summarize(ctx, &runs, pooled, cold);
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

fn run_once(ctx: &Context<'_>, side: &Side, n: usize, round: usize, tls: bool) -> Result<Run> {
    let args = ctx.args;
    let tokens = args.tokens.unwrap_or_else(|| default_tokens(n));
    let name = if tls { "tls" } else { "plain" };
    let tag = format!(
        "[upstream TLS: N={n} round {}/{} {name}]",
        round + 1,
        args.rounds
    );
    let url = format!("http://{}", side.haltd.listen);
    let pid = side.haltd.proc.pid();
    let (all0, kids0) = (machine_busy_us(), children_cpu_us());
    let (cpu0, t0) = (ctx.cpu_clock.read_us(pid)?, Instant::now());
    let client = run_client(&ctx.bins.client, &url, n, tokens, args.pace_ms, false)?;
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

/// Sequential time to first byte through `plain` and `tls`, taking turns.
fn seq_probe(ctx: &Context<'_>, plain: &Haltd, tls: &Haltd, what: &str) -> Result<[Pct; 2]> {
    let requests = ctx.args.ttfb_requests.max(20);
    eprintln!("[upstream TLS] sequential time to first byte, {what}: {requests} requests per side");
    let addrs = [plain.listen.as_str(), tls.listen.as_str()];
    let times = seq_ttfb::probe(&addrs, requests, TTFB_WARMUP, 1)?;
    let pct = |t: &[std::time::Duration]| Pct {
        p50: seq_ttfb::percentile_us(t, 50.0),
        p99: seq_ttfb::percentile_us(t, 99.0),
    };
    Ok([pct(&times[0]), pct(&times[1])])
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

fn summarize(ctx: &Context<'_>, runs: &[Run], pooled: [Pct; 2], cold: [Pct; 2]) -> Value {
    let ratio = |a: &Value, b: &Value| match (a.as_f64(), b.as_f64()) {
        (Some(a), Some(b)) if b > 0.0 => Some((a / b * 100.0).round() / 100.0),
        _ => None,
    };
    let results: Vec<Value> = ctx
        .args
        .tls_streams
        .iter()
        .map(|&n| {
            let (p, t) = (medians(runs, n, false), medians(runs, n, true));
            let cpu_ratio = ratio(&t["cpu_us_per_token"], &p["cpu_us_per_token"]);
            json!({"streams": n, "plain": p, "tls": t, "tls_over_plain_cpu": cpu_ratio})
        })
        .collect();
    let pct = |p: Pct| json!({"p50_us": p.p50.map(round1), "p99_us": p.p99.map(round1)});
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
    json!({
        "results": results,
        "sequential_ttfb": {
            "requests_per_side": ctx.args.ttfb_requests.max(20),
            "pool_warm": {"plain": pct(pooled[0]), "tls": pct(pooled[1])},
            "new_connection": {"plain": pct(cold[0]), "tls": pct(cold[1])},
        },
        "problems": problems,
    })
}

fn print(report: &Value) {
    let s = |v: &Value| show(v.as_f64());
    println!(
        "\nTLS to the upstream: haltd in front of a plain and a TLS upstream, medians over the \
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
    let q = &report["sequential_ttfb"];
    for key in ["pool_warm", "new_connection"] {
        println!(
            "sequential first byte, {key}: plain p50 {} p99 {} | tls p50 {} p99 {} (µs)",
            s(&q[key]["plain"]["p50_us"]),
            s(&q[key]["plain"]["p99_us"]),
            s(&q[key]["tls"]["p50_us"]),
            s(&q[key]["tls"]["p99_us"]),
        );
    }
}
