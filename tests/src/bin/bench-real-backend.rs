//! What haltd adds in front of a real inference server (issue 17, point 4): llama.cpp's
//! OpenAI server (`llama-cpp-python`, pinned by `cargo xtask setup`, serving the tiny seeded
//! model) beside the scripted upstream, measured the same way in the same run.
//!
//! For each backend it starts the server and one `haltd serve --source openai` in front of
//! it in a fresh namespace pair, then sends `--requests` streamed chat requests per route, one
//! at a time, the routes taking turns (direct, via haltd, direct, ...), after `--warmup`
//! unmeasured ones per route. llama.cpp's server runs one generation at a time, so requests
//! are sequential: concurrency would only queue them. All clients run in the server's
//! namespace, so both routes are local connections (haltd's address there is its own).
//!
//! - Both routes get the same request body, as haltd forwards it (`logprobs: true`,
//!   `top_logprobs: 0`, `stream_options.include_usage`; docs/wire-format.md), so the server
//!   does the same work for each: left to its default, llama.cpp's server computes top
//!   alternatives the forwarded request does not ask for, and the direct route costs it more.
//! - The llama request asks for `--tokens` tokens with greedy decoding (`temperature: 0`), so
//!   every request generates the same text on both routes.
//! - The scripted upstream streams as many tokens at the pace llama.cpp's server showed (the
//!   median gap between its tokens on the direct route, rounded to whole milliseconds, at
//!   least 1), so the two backends give haltd the same work at the same rate.
//!
//! Per request the client records the time to the first token event (`ttft`, from just before
//! the connect), the time to `[DONE]` (`total`), the token events, and haltd's and the
//! server's CPU time over the request (the kernel's per-process CPU clock). Reported per
//! backend: medians of ttft and total per route and their difference (haltd's added time),
//! the median gap between tokens per route, and haltd's CPU per token, net of its rate during
//! the direct requests (its background: the watchdog's beats).
//!
//! A real server does not stamp its tokens, so the per-token latency haltd adds (the figure
//! of `bench-proxy-overhead`, which needs the scripted upstream's stamps) is not measured
//! against it; the time to first token and to the end are, and for a proxy that forwards each
//! token as it comes, the added time to the end is the last token's added latency.
//!
//! Prints a table and writes the same as JSON to `target/bench/real-backend.json` (`--out`).
//! Needs root (namespaces, the gate), `HALTD_BIN`, `HALTD_PYTHON` and `HALTD_LLAMA_MODEL`
//! (`cargo xtask bench` sets them). Reports, never fails on a figure; fails if a request
//! fails or a process exits.

use std::{path::PathBuf, time::Instant};

use anyhow::{ensure, Context, Result};
use clap::Parser;
use haltd_tests::bench_files::{sibling, write_report};
use haltd_tests::{
    in_netns, llama::LLAMA_MODEL_ALIAS, proc_cpu::process_cpu_ns, rig::Rig, sse, StreamOutcome,
};
use serde_json::{json, Value};

#[derive(Debug, Parser)]
#[command(about = "haltd in front of llama.cpp's server and the scripted upstream")]
struct Args {
    /// Measured requests per route and backend.
    #[arg(long, default_value_t = 20)]
    requests: usize,
    /// Unmeasured requests per route first.
    #[arg(long, default_value_t = 3)]
    warmup: usize,
    /// Tokens per request (`max_tokens`; llama.cpp may add up to 3 to finish a character).
    #[arg(long, default_value_t = 64)]
    tokens: u32,
    /// Where the JSON report goes (default `target/bench/real-backend.json`).
    #[arg(long)]
    out: Option<PathBuf>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Route {
    Direct,
    Via,
}

/// One measured request.
#[derive(Debug, Clone)]
struct Sample {
    ttft_us: f64,
    total_us: f64,
    tokens: usize,
    gap_us: Option<f64>,
    haltd_cpu_ns: u64,
    server_cpu_ns: u64,
    wall_ns: u64,
}

/// A backend under haltd: its rig, its process, and the request body it answers.
struct Bench<U> {
    rig: Rig<U>,
    server_pid: u32,
    body: Value,
}

impl<U> Bench<U> {
    fn url(&self, route: Route) -> String {
        match route {
            Route::Direct => format!(
                "http://127.0.0.1:{}/v1/chat/completions",
                haltd_tests::PORT_UPSTREAM
            ),
            Route::Via => self.rig.url("/v1/chat/completions"),
        }
    }

    fn request(&self, route: Route) -> Result<Sample> {
        let haltd_pid = self.rig.haltd.pid().context("haltd exited")?;
        let (url, body) = (self.url(route), self.body.clone());
        let cpu = |pid| process_cpu_ns(pid);
        let (h0, s0, t0) = (cpu(haltd_pid)?, cpu(self.server_pid)?, Instant::now());
        let o = in_netns(&self.rig.pair.srv, move || {
            sse::stream_with(
                &url,
                &body,
                &[],
                std::time::Duration::from_secs(60),
                |_, _| {},
            )
        })?;
        let wall_ns = t0.elapsed().as_nanos() as u64;
        let (h1, s1) = (cpu(haltd_pid)?, cpu(self.server_pid)?);
        let s = sample(&o, route, h1 - h0, s1 - s0, wall_ns)?;
        // The tiny model never ends early (no EOS): fewer frames than asked is a reply cut
        // short, which would make the two routes' figures incomparable.
        let asked = self.body["max_tokens"].as_u64().unwrap_or_default() as usize;
        ensure!(
            s.tokens >= asked,
            "{route:?}: the reply was cut short, {} token frames of the {asked} asked \
             (llama_cpp.server interrupts its generation on any new request unless started \
             with --interrupt_requests False)",
            s.tokens
        );
        Ok(s)
    }

    /// `warmup` then `n` requests per route, alternating.
    fn run(&self, warmup: usize, n: usize) -> Result<(Vec<Sample>, Vec<Sample>)> {
        let (mut direct, mut via) = (Vec::new(), Vec::new());
        for i in 0..warmup + n {
            for route in [Route::Direct, Route::Via] {
                let s = self.request(route)?;
                if i >= warmup {
                    match route {
                        Route::Direct => direct.push(s),
                        Route::Via => via.push(s),
                    }
                }
            }
            eprint!("\r  {} of {} request pairs", i + 1, warmup + n);
        }
        eprintln!();
        Ok((direct, via))
    }
}

fn sample(
    o: &StreamOutcome,
    route: Route,
    haltd: u64,
    server: u64,
    wall_ns: u64,
) -> Result<Sample> {
    ensure!(
        o.status == 200 && o.error.is_none() && o.done_at.is_some() && o.read_error.is_none(),
        "{route:?} request did not end normally: status {} error {:?} body {:?}",
        o.status,
        o.error,
        o.body
    );
    // Every token frame, the empty ones llama.cpp sends for byte fragments included (a
    // chunk with a `content` string and no finish reason), as the client parsed it.
    let at: Vec<Instant> = o
        .events
        .iter()
        .filter(|e| is_token_frame(&e.data))
        .map(|e| e.at)
        .collect();
    let first = *at.first().context("no token event")?;
    let gaps: Vec<f64> = at.windows(2).map(|w| us(w[1] - w[0])).collect();
    Ok(Sample {
        ttft_us: us(first - o.started),
        total_us: us(o.done_at.context("no [DONE]")? - o.started),
        tokens: at.len(),
        gap_us: median(gaps),
        haltd_cpu_ns: haltd,
        server_cpu_ns: server,
        wall_ns,
    })
}

fn is_token_frame(data: &str) -> bool {
    let Ok(v) = serde_json::from_str::<Value>(data) else {
        return false;
    };
    let c = &v["choices"][0];
    c["finish_reason"].is_null() && c["delta"]["content"].is_string()
}

fn us(d: std::time::Duration) -> f64 {
    d.as_secs_f64() * 1e6
}

use haltd_tests::stats::median;

fn med(s: &[Sample], f: impl Fn(&Sample) -> Option<f64>) -> Option<f64> {
    median(s.iter().filter_map(f).collect())
}

/// The figures of one backend, as JSON.
fn report(name: &str, direct: &[Sample], via: &[Sample]) -> Value {
    let ttft = (
        med(direct, |s| Some(s.ttft_us)),
        med(via, |s| Some(s.ttft_us)),
    );
    let total = (
        med(direct, |s| Some(s.total_us)),
        med(via, |s| Some(s.total_us)),
    );
    let diff = |(d, v): (Option<f64>, Option<f64>)| d.zip(v).map(|(d, v)| v - d);
    // haltd's background: its CPU rate while it carried nothing (the direct requests).
    let bg_ns_per_s = {
        let (cpu, wall) = direct.iter().fold((0u64, 0u64), |(c, w), s| {
            (c + s.haltd_cpu_ns, w + s.wall_ns)
        });
        if wall == 0 {
            0.0
        } else {
            cpu as f64 / (wall as f64 / 1e9)
        }
    };
    let per_token = |s: &Sample, cpu: f64| (s.tokens > 0).then(|| cpu / s.tokens as f64 / 1000.0);
    let haltd_cpu = med(via, |s| per_token(s, s.haltd_cpu_ns as f64));
    let haltd_net = med(via, |s| {
        let bg = bg_ns_per_s * s.wall_ns as f64 / 1e9;
        per_token(s, (s.haltd_cpu_ns as f64 - bg).max(0.0))
    });
    json!({
        "backend": name,
        "requests_per_route": direct.len(),
        "tokens_per_request": med(via, |s| Some(s.tokens as f64)),
        "ttft_direct_p50_us": ttft.0, "ttft_via_p50_us": ttft.1, "ttft_added_p50_us": diff(ttft),
        "total_direct_p50_us": total.0, "total_via_p50_us": total.1, "total_added_p50_us": diff(total),
        "gap_direct_p50_us": med(direct, |s| s.gap_us), "gap_via_p50_us": med(via, |s| s.gap_us),
        "haltd_cpu_us_per_token": haltd_cpu,
        "haltd_cpu_net_us_per_token": haltd_net,
        "haltd_background_cpu_us_per_s": bg_ns_per_s / 1000.0,
        "server_cpu_us_per_token_direct": med(direct, |s| per_token(s, s.server_cpu_ns as f64)),
        "server_cpu_us_per_token_via": med(via, |s| per_token(s, s.server_cpu_ns as f64)),
    })
}

fn llama_body(tokens: u32) -> Value {
    json!({
        "model": LLAMA_MODEL_ALIAS,
        "stream": true,
        "max_tokens": tokens,
        "temperature": 0.0,
        "logprobs": true,
        "top_logprobs": 0,
        "stream_options": {"include_usage": true},
        "messages": [{"role": "user", "content": "Tell me about rivers."}],
    })
}

fn scripted_body(tokens: u32, pace_ms: u64) -> Value {
    json!({
        "model": "scripted",
        "stream": true,
        "logprobs": true,
        "top_logprobs": 0,
        "stream_options": {"include_usage": true},
        "messages": [{"role": "user", "content": format!("[[script:normal tokens={tokens} pace_ms={pace_ms}]]")}],
    })
}

fn main() -> Result<()> {
    let args = Args::parse();
    let haltd_args = ["--ledger-no-fsync"];
    eprintln!(
        "bench-real-backend: llama.cpp's server (llama-cpp-python), {} tokens per request",
        args.tokens
    );
    let llama = {
        let rig = Rig::start_llama(&[], &haltd_args)?;
        Bench {
            server_pid: rig.up.pid,
            rig,
            body: llama_body(args.tokens),
        }
    };
    let (ld, lv) = llama.run(args.warmup, args.requests)?;
    drop(llama);
    let llama_report = report("llama.cpp", &ld, &lv);
    let pace_ms = llama_report["gap_direct_p50_us"]
        .as_f64()
        .map_or(1, |g| ((g / 1000.0).round() as u64).max(1));
    eprintln!(
        "bench-real-backend: the scripted upstream at llama.cpp's pace, {pace_ms} ms per token"
    );
    let scripted = {
        let upstream_bin = sibling("scripted-upstream")?;
        let rig = Rig::start(&upstream_bin, &haltd_args)?;
        let server_pid = rig.up.pid().context("the scripted upstream exited")?;
        Bench {
            server_pid,
            rig,
            body: scripted_body(args.tokens, pace_ms),
        }
    };
    let (sd, sv) = scripted.run(args.warmup, args.requests)?;
    drop(scripted);
    let scripted_report = report("scripted", &sd, &sv);
    let out = json!({
        "bench": "real_backend",
        "requests": args.requests, "warmup": args.warmup, "max_tokens": args.tokens,
        "scripted_pace_ms": pace_ms,
        "machine": {"nproc": std::thread::available_parallelism().map_or(0, |n| n.get())},
        "results": [llama_report, scripted_report],
    });
    print_table(&out);
    write_report(args.out, "real-backend.json", &out)
}

fn print_table(out: &Value) {
    let f = |v: &Value| v.as_f64().map_or("-".to_owned(), |x| format!("{x:.1}"));
    println!(
        "haltd in front of a real server: {} sequential streamed requests per route (direct, via haltd, alternating), medians; scripted upstream at {} ms per token",
        out["requests"], out["scripted_pace_ms"]
    );
    println!("backend    | tok/req |  ttft dir  ttft via   added |  end dir   end via   added |  gap dir  gap via | haltd µs/tok  net | server µs/tok dir via");
    for r in out["results"].as_array().into_iter().flatten() {
        println!(
            "{:<10} | {:>7} | {:>9} {:>9} {:>7} | {:>8} {:>9} {:>7} | {:>8} {:>8} | {:>12} {:>4} | {:>13} {:>4}",
            r["backend"].as_str().unwrap_or("?"),
            f(&r["tokens_per_request"]),
            f(&r["ttft_direct_p50_us"]),
            f(&r["ttft_via_p50_us"]),
            f(&r["ttft_added_p50_us"]),
            f(&r["total_direct_p50_us"]),
            f(&r["total_via_p50_us"]),
            f(&r["total_added_p50_us"]),
            f(&r["gap_direct_p50_us"]),
            f(&r["gap_via_p50_us"]),
            f(&r["haltd_cpu_us_per_token"]),
            f(&r["haltd_cpu_net_us_per_token"]),
            f(&r["server_cpu_us_per_token_direct"]),
            f(&r["server_cpu_us_per_token_via"]),
        );
    }
    println!("(µs; ttft from before the connect to the first token event, end to [DONE]; added = via − direct)");
}
