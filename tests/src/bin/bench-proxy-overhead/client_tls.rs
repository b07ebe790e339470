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
//! Then the time to first byte of a kept connection against a new one
//! (`haltd_tests::seq_ttfb::keepalive_probe_over`, `--ttfb-requests` pairs, at least 20, one
//! request at a time), through both haltds: on a new connection from the connect (TCP, and
//! for TLS the whole handshake) and from the request's write, and on a connection kept from
//! the previous request (HTTP keep-alive: no connect, no handshake).
//!
//! The report's `client_tls` has the medians over the rounds per N and the probe; a run with
//! stream errors is listed in `problems`, which fails the bench.

use std::{ffi::OsStr, time::Duration};

use haltd_tests::{seq_ttfb, tls::TestPki, tls_client::client_config};

use super::{
    json, round1, show, start_haltd, tls_compare, Pct, Result, Upstream, Value, TTFB_WARMUP,
};
use tls_compare::{Context, Side};

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
        tls_compare::side(ctx, start("haltd-plain-clients", &[])?)?,
        tls_compare::side(ctx, start("haltd-client-tls", &tls_flags)?)?,
    ];
    let ca = pki.ca.display().to_string();
    let runs = tls_compare::runs(ctx, "client TLS", &sides, |tls, side| {
        let scheme = if tls { "https" } else { "http" };
        let extra = if tls {
            vec!["--tls-ca".to_owned(), ca.clone()]
        } else {
            Vec::new()
        };
        (format!("{scheme}://{}", side.haltd.listen), extra)
    })?;
    let kept = kept_probe(ctx, &sides, &pki)?;
    let report = json!({
        "results": tls_compare::results(ctx, &runs),
        "keepalive_ttfb": kept,
        "problems": tls_compare::problems(&runs),
    });
    print(&report);
    Ok(report)
}

/// Time to first byte on a new connection against a kept one, through each side.
fn kept_probe(ctx: &Context<'_>, sides: &[Side; 2], pki: &TestPki) -> Result<Value> {
    let requests = ctx.args.ttfb_requests.max(20);
    eprintln!(
        "[client TLS] time to first byte, new against kept connections: {requests} pairs per side"
    );
    let cfg = client_config(&pki.ca)?;
    let pct = |t: &[Duration]| {
        let p = Pct {
            p50: seq_ttfb::percentile_us(t, 50.0),
            p99: seq_ttfb::percentile_us(t, 99.0),
        };
        json!({"p50_us": p.p50.map(round1), "p99_us": p.p99.map(round1)})
    };
    let mut out = json!({"pairs_per_side": requests});
    for (side, tls) in sides.iter().zip([None, Some(&cfg)]) {
        let t = seq_ttfb::keepalive_probe_over(&side.haltd.listen, tls, requests, TTFB_WARMUP, 1)?;
        out[if tls.is_some() { "tls" } else { "plain" }] = json!({
            "new_from_connect": pct(&t.new_from_connect),
            "new_from_write": pct(&t.new_from_write),
            "reused": pct(&t.reused),
        });
    }
    Ok(out)
}

fn print(report: &Value) {
    let s = |v: &Value| show(v.as_f64());
    tls_compare::print_table(
        "TLS for clients: haltd serving plain HTTP and TLS to the same load",
        report,
    );
    let k = &report["keepalive_ttfb"];
    for side in ["plain", "tls"] {
        let q = &k[side];
        println!(
            "first byte {side}: new connection from connect p50 {} p99 {}, from write p50 {} | \
             kept connection p50 {} p99 {} (µs)",
            s(&q["new_from_connect"]["p50_us"]),
            s(&q["new_from_connect"]["p99_us"]),
            s(&q["new_from_write"]["p50_us"]),
            s(&q["reused"]["p50_us"]),
            s(&q["reused"]["p99_us"]),
        );
    }
}
