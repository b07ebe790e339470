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
    json, round1, show, start_haltd, start_upstream, tls_compare, Haltd, Pct, Result, Upstream,
    Value, TTFB_WARMUP,
};
use tls_compare::{Context, Run};

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
        tls_compare::side(ctx, start("haltd-plain", &plain_url, &[])?)?,
        tls_compare::side(ctx, start("haltd-tls", &tls_url, &ca)?)?,
    ];
    let runs = tls_compare::runs(ctx, "upstream TLS", &sides, |_, side| {
        (format!("http://{}", side.haltd.listen), Vec::new())
    })?;
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

fn summarize(ctx: &Context<'_>, runs: &[Run], pooled: [Pct; 2], cold: [Pct; 2]) -> Value {
    let pct = |p: Pct| json!({"p50_us": p.p50.map(round1), "p99_us": p.p99.map(round1)});
    json!({
        "results": tls_compare::results(ctx, runs),
        "sequential_ttfb": {
            "requests_per_side": ctx.args.ttfb_requests.max(20),
            "pool_warm": {"plain": pct(pooled[0]), "tls": pct(pooled[1])},
            "new_connection": {"plain": pct(cold[0]), "tls": pct(cold[1])},
        },
        "problems": tls_compare::problems(runs),
    })
}

fn print(report: &Value) {
    let s = |v: &Value| show(v.as_f64());
    tls_compare::print_table(
        "TLS to the upstream: haltd in front of a plain and a TLS upstream",
        report,
    );
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
