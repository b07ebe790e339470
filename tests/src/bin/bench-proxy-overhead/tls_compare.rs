//! What the `--client-tls` and `--upstream-tls` comparisons share: two haltds under the same
//! load, one with TLS on the side under test; each side's idle CPU rate, one client run through
//! a side (that haltd's CPU time per token net of idle, latency, first byte, the machine's other
//! load), the medians over the rounds and the table they print.

use super::{
    children_cpu_us, default_tokens, json, machine_busy_us, median, round1, run_client_with, show,
    thread, Args, Bins, ClientReport, CpuClock, Haltd, Instant, Path, Result, Value, IDLE_WINDOW,
    SETTLE,
};

/// What a comparison needs from the bench.
pub(super) struct Context<'a> {
    pub(super) args: &'a Args,
    pub(super) bins: &'a Bins,
    pub(super) dir: &'a Path,
    pub(super) cpu_clock: CpuClock,
    pub(super) nproc: usize,
}

/// One haltd of the comparison.
pub(super) struct Side {
    pub(super) haltd: Haltd,
    /// Its CPU rate with nothing open, µs/s.
    idle_us_per_s: f64,
}

/// One client run through one side.
pub(super) struct Run {
    streams: usize,
    tls: bool,
    client: ClientReport,
    /// That haltd's CPU time over the run less its idle rate over the window, µs.
    net_cpu_us: f64,
    others_pct: f64,
}

/// A started haltd and its idle CPU rate.
pub(super) fn side(ctx: &Context<'_>, haltd: Haltd) -> Result<Side> {
    let pid = haltd.proc.pid();
    let (c0, t0) = (ctx.cpu_clock.read_us(pid)?, Instant::now());
    thread::sleep(IDLE_WINDOW);
    let idle_us_per_s = (ctx.cpu_clock.read_us(pid)? - c0) / t0.elapsed().as_secs_f64();
    Ok(Side {
        haltd,
        idle_us_per_s,
    })
}

/// For each of `--tls-streams` and each round, one run through each of `sides` (plain, TLS;
/// the order alternating from round to round); `client` gives a side's URL and `bench-proxy`
/// arguments.
pub(super) fn runs(
    ctx: &Context<'_>,
    what: &str,
    sides: &[Side; 2],
    client: impl Fn(bool, &Side) -> (String, Vec<String>),
) -> Result<Vec<Run>> {
    let mut runs = Vec::new();
    for &n in &ctx.args.tls_streams {
        for round in 0..ctx.args.rounds {
            for k in 0..2 {
                let tls = (k + round) % 2 == 1;
                let side = &sides[usize::from(tls)];
                let (url, extra) = client(tls, side);
                runs.push(run_once(ctx, what, side, n, round, tls, &url, &extra)?);
            }
        }
    }
    Ok(runs)
}

#[expect(
    clippy::too_many_arguments,
    reason = "one run's coordinates, each used once"
)]
fn run_once(
    ctx: &Context<'_>,
    what: &str,
    side: &Side,
    n: usize,
    round: usize,
    tls: bool,
    url: &str,
    extra: &[String],
) -> Result<Run> {
    let args = ctx.args;
    let tokens = args.tokens.unwrap_or_else(|| default_tokens(n));
    let name = if tls { "tls" } else { "plain" };
    let tag = format!("[{what}: N={n} round {}/{} {name}]", round + 1, args.rounds);
    let extra: Vec<&str> = extra.iter().map(String::as_str).collect();
    let pid = side.haltd.proc.pid();
    let (all0, kids0) = (machine_busy_us(), children_cpu_us());
    let (cpu0, t0) = (ctx.cpu_clock.read_us(pid)?, Instant::now());
    let client = run_client_with(&ctx.bins.client, url, n, tokens, args.pace_ms, &extra)?;
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

/// Per stream count: both sides' medians, the CPU ratio TLS / plain and the latency TLS adds.
pub(super) fn results(ctx: &Context<'_>, runs: &[Run]) -> Vec<Value> {
    let ratio = |a: &Value, b: &Value| match (a.as_f64(), b.as_f64()) {
        (Some(a), Some(b)) if b > 0.0 => Some((a / b * 100.0).round() / 100.0),
        _ => None,
    };
    let diff = |a: &Value, b: &Value| match (a.as_f64(), b.as_f64()) {
        (Some(a), Some(b)) => Some(round1(a - b)),
        _ => None,
    };
    ctx.args
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
        .collect()
}

/// The runs with stream errors or no tokens, one line each (they fail the bench).
pub(super) fn problems(runs: &[Run]) -> Vec<String> {
    runs.iter()
        .filter(|r| r.client.errors > 0 || r.client.tokens == 0)
        .map(|r| {
            let side = if r.tls { "tls" } else { "plain" };
            format!(
                "N={} {side}: {} errors, {} tokens",
                r.streams, r.client.errors, r.client.tokens
            )
        })
        .collect()
}

/// Prints `title` and the table of `report["results"]`.
pub(super) fn print_table(title: &str, report: &Value) {
    let s = |v: &Value| show(v.as_f64());
    println!(
        "\n{title}, medians over the rounds (CPU µs/token net of idle; latency and first byte µs)"
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
