//! The Anthropic Messages API and the OpenAI Responses API beside chat on the same haltd
//! (issue 34, point 7, and issue 35, point 6: what each surface adds per token and to the
//! first byte, against chat; target: within 10 %). On by default; `--no-messages` leaves it
//! out (both surfaces).
//!
//! It runs on the bench's own upstream and haltd, after the overhead runs (nginx stopped).
//! First the unloaded time to first byte: `--messages-rounds` rounds, each of
//! `--ttfb-requests` sequential requests per route (`haltd_tests::seq_ttfb::probe_apis`, routes
//! taking turns request by request, the surfaces behind direct in alternating order): the
//! upstream directly (chat), haltd on chat, on Messages and on Responses; a route's added
//! time is its p50 (p99) less direct's in the same round. Then, per `--messages-streams`
//! count, `--messages-rounds` rounds of `bench-proxy` runs: direct, then chat, Messages and
//! Responses through haltd in an order that rotates from round to round. A surface's added
//! latency per token is its run's p50 (p99) less the direct run's of the same round; haltd's
//! CPU per token is net of its rate during that direct run.
//!
//! Each figure is the median over the rounds with its min–max. A surface passes against chat
//! when its median is at most 1.10 × chat's (or, for the added times, which scatter, inside
//! chat's min–max); the instruction counts of `bench-token-instructions` are the steady CPU
//! comparison. The report's `surfaces` has the figures per N, the first-byte figures, every
//! run, and `problems` (stream errors, no tokens), which fail the bench.

use haltd_tests::seq_ttfb::{self, Api};

use super::{
    children_cpu_us, default_tokens, json, machine_busy_us, median, round1, run_client_with,
    run_problem, show, thread, Args, ClientReport, Instant, Path, Result, Rig, Route, Value,
    SETTLE, TTFB_WARMUP,
};

/// A surface's figure over chat's, at most (issues 34 and 35).
const TARGET_RATIO: f64 = 1.10;

/// Where a run's client goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Leg {
    /// The upstream reached directly (chat: the upstream speaks no Messages).
    Direct,
    /// haltd, `POST /v1/chat/completions`.
    Chat,
    /// haltd, `POST /v1/messages`.
    Messages,
    /// haltd, `POST /v1/responses`.
    Responses,
}

/// The surfaces compared with chat.
const OTHERS: [Leg; 2] = [Leg::Messages, Leg::Responses];

impl Leg {
    fn name(self) -> &'static str {
        match self {
            Self::Direct => "direct",
            Self::Chat => "chat",
            Self::Messages => "messages",
            Self::Responses => "responses",
        }
    }
}

/// One `bench-proxy` run.
struct Run {
    streams: usize,
    round: usize,
    leg: Leg,
    client: ClientReport,
    window_s: f64,
    haltd_cpu_us: f64,
    others_pct: f64,
}

/// Median, min and max over the rounds.
#[derive(Debug, Clone, Copy)]
struct Spread {
    med: f64,
    min: f64,
    max: f64,
}

impl Spread {
    fn of(v: Vec<f64>) -> Option<Self> {
        let min = v.iter().copied().min_by(f64::total_cmp)?;
        let max = v.iter().copied().max_by(f64::total_cmp)?;
        Some(Self {
            med: median(v)?,
            min,
            max,
        })
    }

    fn show(s: Option<Self>) -> String {
        s.map_or_else(
            || "-".to_owned(),
            |s| format!("{:.1} ({:.1}–{:.1})", s.med, s.min, s.max),
        )
    }

    fn to_json(s: Option<Self>) -> Value {
        s.map_or(
            Value::Null,
            |s| json!({"median": round1(s.med), "min": round1(s.min), "max": round1(s.max)}),
        )
    }
}

/// Messages against chat on one figure: the ratio of the medians and whether it passes
/// (at most [`TARGET_RATIO`], or with `lenient`, inside chat's min–max). No ratio when
/// chat's median is not positive.
fn compare(chat: Option<Spread>, messages: Option<Spread>, lenient: bool) -> Value {
    let (Some(c), Some(m)) = (chat, messages) else {
        return json!({"ratio": null, "pass": null});
    };
    let ratio = (c.med > 0.0).then(|| m.med / c.med);
    let inside =
        lenient && ratio.is_some_and(|r| r > TARGET_RATIO) && (c.min..=c.max).contains(&m.med);
    let pass = ratio.map(|r| r <= TARGET_RATIO || inside);
    json!({"ratio": ratio.map(|r| (r * 1000.0).round() / 1000.0), "pass": pass, "inside_chat_min_max": inside})
}

fn verdict(v: &Value) -> String {
    let ratio = v["ratio"]
        .as_f64()
        .map_or_else(|| "-".to_owned(), |r| format!("{r:.3}"));
    let pass = match v["pass"].as_bool() {
        Some(true) if v["inside_chat_min_max"] == true => "PASS (inside chat's min–max)",
        Some(true) => "PASS",
        Some(false) => "MISS",
        None => "-",
    };
    format!("{ratio} {pass}")
}

/// Runs the comparison on `rig`'s upstream and haltd; the report's `messages`.
pub(super) fn run(args: &Args, rig: &mut Rig, client_bin: &Path) -> Result<Value> {
    let ttfb = ttfb_rounds(args, rig)?;
    let mut runs = Vec::new();
    for &n in &args.messages_streams {
        for round in 0..args.messages_rounds {
            // Direct first; the surfaces in an order that rotates from round to round.
            let mut surfaces = [Leg::Chat, Leg::Messages, Leg::Responses];
            surfaces.rotate_left(round % 3);
            for leg in std::iter::once(Leg::Direct).chain(surfaces) {
                let at = Place {
                    streams: n,
                    round,
                    leg,
                };
                runs.push(run_once(args, rig, client_bin, at)?);
                rig.check_alive()?;
            }
        }
    }
    let results: Vec<Value> = args
        .messages_streams
        .iter()
        .map(|&n| summarize(&runs, n))
        .collect();
    let report = json!({
        "rounds": args.messages_rounds,
        "target_ratio": TARGET_RATIO,
        "results": results,
        "ttfb": ttfb,
        "runs": runs.iter().map(run_json).collect::<Vec<_>>(),
        "problems": problems(&runs),
    });
    print(args, &report);
    Ok(report)
}

/// The unloaded time to first byte, `--messages-rounds` rounds; what chat and Messages add
/// over direct, per round, then the medians.
fn ttfb_rounds(args: &Args, rig: &Rig) -> Result<Value> {
    if args.ttfb_requests == 0 {
        return Ok(json!({"skipped": "--ttfb-requests 0"}));
    }
    let (direct, via) = (rig.url(Route::Direct)?, rig.url(Route::Via)?);
    let addr = |u: &str| u.trim_start_matches("http://").to_owned();
    let (direct, via) = (addr(&direct), addr(&via));
    let routes = [
        (direct.as_str(), Api::Chat),
        (via.as_str(), Api::Chat),
        (via.as_str(), Api::Messages),
        (via.as_str(), Api::Responses),
    ];
    // Per surface (chat, messages, responses): the added p50 and p99 of each round.
    let mut added: [[Vec<f64>; 2]; 3] = Default::default();
    for round in 0..args.messages_rounds {
        eprintln!(
            "[messages: time to first byte, round {}/{}] {} requests per route",
            round + 1,
            args.messages_rounds,
            args.ttfb_requests
        );
        let times = seq_ttfb::probe_apis(&routes, args.ttfb_requests, TTFB_WARMUP, 1)?;
        let pct = |i: usize, p: f64| seq_ttfb::percentile_us(&times[i], p);
        for (s, surface) in added.iter_mut().enumerate() {
            for (k, p) in [50.0, 99.0].into_iter().enumerate() {
                if let (Some(v), Some(d)) = (pct(s + 1, p), pct(0, p)) {
                    surface[k].push(v - d);
                }
            }
        }
    }
    let rounded = |v: &[f64]| v.iter().copied().map(round1).collect::<Vec<_>>();
    let names = ["chat", "messages", "responses"];
    let mut per_round = serde_json::Map::new();
    for (name, a) in names.iter().zip(&added) {
        per_round.insert(
            (*name).to_owned(),
            json!({"added_p50_us": rounded(&a[0]), "added_p99_us": rounded(&a[1])}),
        );
    }
    let spreads = added.map(|[p50, p99]| (Spread::of(p50), Spread::of(p99)));
    let mut out = json!({
        "requests_per_route_per_round": args.ttfb_requests,
        "per_round": per_round,
    });
    for (name, s) in names.iter().zip(&spreads) {
        out[*name] =
            json!({"added_p50_us": Spread::to_json(s.0), "added_p99_us": Spread::to_json(s.1)});
    }
    let chat = spreads[0];
    for (name, s) in names.iter().zip(&spreads).skip(1) {
        out[format!("{name}_over_chat_p50")] = compare(chat.0, s.0, true);
        out[format!("{name}_over_chat_p99")] = compare(chat.1, s.1, true);
    }
    Ok(out)
}

/// Where a run stands in the comparison.
#[derive(Debug, Clone, Copy)]
struct Place {
    streams: usize,
    round: usize,
    leg: Leg,
}

/// One `bench-proxy` run at `at` (its stream count, round and leg), with haltd's CPU time
/// meanwhile.
fn run_once(args: &Args, rig: &Rig, client_bin: &Path, at: Place) -> Result<Run> {
    let Place {
        streams: n,
        round,
        leg,
    } = at;
    let tokens = args.tokens.unwrap_or_else(|| default_tokens(n));
    let url = rig.url(if leg == Leg::Direct {
        Route::Direct
    } else {
        Route::Via
    })?;
    let extra: &[&str] = match leg {
        Leg::Messages => &["--endpoint", "messages"],
        Leg::Responses => &["--endpoint", "responses"],
        Leg::Direct | Leg::Chat => &[],
    };
    let tag = format!(
        "[surfaces: N={n} round {}/{} {}]",
        round + 1,
        args.messages_rounds,
        leg.name()
    );
    let (all0, kids0) = (machine_busy_us(), children_cpu_us());
    // haltd's and the upstream's (nginx is stopped).
    let ((h0, _, u0), t0) = (rig.cpu_us()?, Instant::now());
    let client = run_client_with(client_bin, &url, n, tokens, args.pace_ms, extra)?;
    thread::sleep(SETTLE);
    let window_s = t0.elapsed().as_secs_f64();
    let (h1, _, u1) = rig.cpu_us()?;
    let haltd_cpu_us = h1 - h0;
    let capacity_us = window_s * 1e6 * rig.nproc.max(1) as f64;
    // The bench's processes: haltd, the upstream and the client (a waited-for child).
    let ours = haltd_cpu_us + (u1 - u0) + children_cpu_us() - kids0;
    let others_pct = ((machine_busy_us() - all0 - ours) / capacity_us * 100.0).max(0.0);
    eprintln!(
        "{tag} {} tokens, {} errors; latency µs p50 {} p99 {}; first byte µs p50 {}; \
         haltd CPU {:.1} µs/token; others {others_pct:.0}% of the CPUs",
        client.tokens,
        client.errors,
        show(client.p50_us),
        show(client.p99_us),
        show(client.ttfb_p50_us),
        haltd_cpu_us / client.tokens.max(1) as f64,
    );
    Ok(Run {
        streams: n,
        round,
        leg,
        client,
        window_s,
        haltd_cpu_us,
        others_pct,
    })
}

/// A run's figures against its round's direct run: added p50, added p99, haltd's CPU per
/// token net of its rate during the direct run.
fn against_direct(runs: &[Run], r: &Run) -> (Option<f64>, Option<f64>, Option<f64>) {
    let Some(d) = runs
        .iter()
        .find(|d| d.leg == Leg::Direct && d.streams == r.streams && d.round == r.round)
    else {
        return (None, None, None);
    };
    let minus = |a: Option<f64>, b: Option<f64>| Some(a? - b?);
    let cpu = (r.client.tokens > 0 && d.window_s > 0.0).then(|| {
        (r.haltd_cpu_us - d.haltd_cpu_us / d.window_s * r.window_s) / r.client.tokens as f64
    });
    (
        minus(r.client.p50_us, d.client.p50_us),
        minus(r.client.p99_us, d.client.p99_us),
        cpu,
    )
}

/// One stream count's figures per surface, and each surface against chat.
fn summarize(runs: &[Run], n: usize) -> Value {
    let spreads = |leg: Leg| {
        let mine: Vec<_> = runs
            .iter()
            .filter(|r| r.streams == n && r.leg == leg)
            .map(|r| against_direct(runs, r))
            .collect();
        [
            Spread::of(mine.iter().filter_map(|f| f.0).collect()),
            Spread::of(mine.iter().filter_map(|f| f.1).collect()),
            Spread::of(mine.iter().filter_map(|f| f.2).collect()),
        ]
    };
    let c = spreads(Leg::Chat);
    let side = |s: &[Option<Spread>; 3]| {
        json!({
            "added_p50_us": Spread::to_json(s[0]),
            "added_p99_us": Spread::to_json(s[1]),
            "haltd_cpu_net_us_per_token": Spread::to_json(s[2]),
        })
    };
    let others = runs
        .iter()
        .filter(|r| r.streams == n)
        .map(|r| r.others_pct)
        .max_by(f64::total_cmp);
    let mut out = json!({
        "streams": n,
        "chat": side(&c),
        "others_pct_max": others.map(round1),
    });
    for leg in OTHERS {
        let (name, m) = (leg.name(), spreads(leg));
        out[name] = side(&m);
        out[format!("{name}_over_chat_added_p50")] = compare(c[0], m[0], true);
        out[format!("{name}_over_chat_added_p99")] = compare(c[1], m[1], true);
        out[format!("{name}_over_chat_cpu")] = compare(c[2], m[2], false);
    }
    out
}

fn run_json(r: &Run) -> Value {
    json!({
        "streams": r.streams,
        "round": r.round + 1,
        "leg": r.leg.name(),
        "tokens": r.client.tokens,
        "errors": r.client.errors,
        "p50_us": r.client.p50_us,
        "p99_us": r.client.p99_us,
        "ttfb_p50_us": r.client.ttfb_p50_us,
        "haltd_cpu_us": r.haltd_cpu_us.round(),
        "window_s": (r.window_s * 1000.0).round() / 1000.0,
        "others_pct": round1(r.others_pct),
    })
}

/// The runs with stream errors or no tokens, one line each (they fail the bench).
fn problems(runs: &[Run]) -> Vec<String> {
    runs.iter()
        .filter_map(|r| run_problem(r.streams, r.round, r.leg.name(), &r.client))
        .collect()
}

/// The JSON figure `v` (`{median, min, max}`) as `med (min–max)`.
fn spread_text(v: &Value) -> String {
    match (v["median"].as_f64(), v["min"].as_f64(), v["max"].as_f64()) {
        (Some(med), Some(min), Some(max)) => Spread::show(Some(Spread { med, min, max })),
        _ => "-".to_owned(),
    }
}

fn print(args: &Args, report: &Value) {
    println!(
        "\nMessages and Responses beside chat on one haltd (issues 34 and 35; target: each \
         within {:.0} % of chat): medians (min–max) of {} rounds; each round direct, then \
         chat, Messages and Responses in rotating order; added = through haltd − direct in the \
         same round, µs; CPU µs/token net of haltd's rate during the direct run",
        (TARGET_RATIO - 1.0) * 100.0,
        args.messages_rounds
    );
    println!(
        "{:>7} | {:<9} | {:>26} | {:>26} | {:>22}",
        "streams", "surface", "added p50", "added p99", "haltd CPU"
    );
    for r in report["results"].as_array().into_iter().flatten() {
        for surface in ["chat", "messages", "responses"] {
            let s = &r[surface];
            println!(
                "{:>7} | {surface:<9} | {:>26} | {:>26} | {:>22}",
                r["streams"].as_u64().unwrap_or_default(),
                spread_text(&s["added_p50_us"]),
                spread_text(&s["added_p99_us"]),
                spread_text(&s["haltd_cpu_net_us_per_token"]),
            );
        }
        for leg in OTHERS {
            let name = leg.name();
            println!(
                "{:>7} | {name}/chat: added p50 {}, added p99 {}, CPU {}{}",
                r["streams"].as_u64().unwrap_or_default(),
                verdict(&r[format!("{name}_over_chat_added_p50")]),
                verdict(&r[format!("{name}_over_chat_added_p99")]),
                verdict(&r[format!("{name}_over_chat_cpu")]),
                r["others_pct_max"]
                    .as_f64()
                    .filter(|&o| o > super::OTHERS_WARN_PCT)
                    .map_or_else(String::new, |o| format!(
                        " (other processes used up to {o:.0}% of the CPUs: disturbed)"
                    )),
            );
        }
    }
    let t = &report["ttfb"];
    if t["chat"].is_object() {
        println!(
            "unloaded time to first byte haltd adds, {} sequential requests per route per round \
             (µs): chat p50 {} p99 {}",
            t["requests_per_route_per_round"],
            spread_text(&t["chat"]["added_p50_us"]),
            spread_text(&t["chat"]["added_p99_us"]),
        );
        for name in ["messages", "responses"] {
            println!(
                "  {name} p50 {} p99 {} | {name}/chat p50 {}, p99 {}",
                spread_text(&t[name]["added_p50_us"]),
                spread_text(&t[name]["added_p99_us"]),
                verdict(&t[format!("{name}_over_chat_p50")]),
                verdict(&t[format!("{name}_over_chat_p99")]),
            );
        }
    }
}
