//! `bench-detectors`: what the detectors cost per token on the data plane, against the bare
//! stream, in one run (issue 4, point 8; target: all built-in detectors together under 10 µs
//! per token at p99).
//!
//! ```text
//! bench-detectors [--turns 200] [--tokens 256] [--rounds 3] [--warmup-turns 16]
//!     [--gap-ms 20] [--gap-log-sd 0.1] [--evict-kib 256] [--latency-mode hard] [--out FILE]
//! ```
//!
//! No root, no network, no daemon: the detectors run in this process exactly as a data-plane
//! worker runs them. Tokens come from the built-in model (`--turns` turns of `--tokens` tokens
//! each, `ignore_eos`, a different prompt and seed per turn) and are generated into memory
//! before anything is timed, so the model's sampling cost is not measured. Each token carries
//! a synthetic `CLOCK_MONOTONIC` arrival time advancing `--gap-ms` per token with lognormal
//! jitter (`--gap-log-sd`), so the timing detectors see realistic gaps.
//!
//! Configurations, each measured over the same tokens:
//!
//! - `bare`: the loop itself: a `TokenObs` built and handed to `black_box`, nothing judged
//!   (the timer's own cost and the loop's; every other row includes it too);
//! - `none`: a turn governor from a configuration with every detector off: what the data plane
//!   does per token when no detector is configured;
//! - one row per built-in detector alone (the others `off`): `halt_monitor` (probability
//!   scorer, `hard_limit` 0.01), `surprise` (hard, default window and statistic, threshold
//!   24 bits so that normal text never trips it), `compute_budget` (hard, limits never
//!   reached: 1 000 000 tokens, 1 h), `latency_anomaly` (default settings, baseline warmed up
//!   first), `exfil` (hard, default rules);
//! - `all`: all five together, as the data plane runs them;
//! - `all_evicted`: the same, but before each token (untimed) the bench writes over
//!   `--evict-kib` (default 256) KiB of memory, one byte per cache line, as the data plane's
//!   work between two tokens of a stream (other streams, I/O, SSE framing) would: the
//!   detectors then start each token with their state and code out of L1 (the other rows
//!   measure a hot loop, the best case). Not part of the target.
//!
//! Every configuration is built with `DetectorsConfig::load` from a TOML text (printed with
//! `--show-config`) and `Detectors::new`, as `haltd serve --config` does; no detector has a
//! `deadline_us`, as by default, so the governor reads no clock of its own. Per turn the bench
//! calls `Detectors::turn` (timed: per-turn setup), then per token
//! `TurnGovernor::on_token(&obs, monotonic_ns)` (timed: the per-token figure), then
//! `TurnGovernor::on_end` (timed: turn end) and `TurnGovernor::summary` plus the governor's
//! drop (timed: what the turn record's detector summaries cost). Before the timed rounds each
//! configuration runs `--warmup-turns` untimed turns of other text, which warms the latency
//! baseline (it needs 256 gaps and 8 clean turns by default: the report counts the turns it
//! judged, `latency_rts_modes`) and the caches.
//!
//! A hard trip ends a governor's turn as on the data plane: the tripping token's time counts,
//! and the governor is dropped without `on_end`. The HaltMonitor at 0.01 does trip on the
//! built-in model's text (about 3 % of its sampled tokens have p < 0.01, and every 256-token
//! turn has some): the rest of the turn's tokens then go to a fresh governor, as a new turn,
//! so every configuration judges the same 51 200 tokens. Trips are counted per detector, and
//! the tokens are also reported by kind: `first` (a governor turn's first token), `trip` (the
//! token that tripped: every detector ran on it, and the trip's detail string was formatted)
//! and `steady` (the rest).
//!
//! Each token is timed on its own with `Instant` (`CLOCK_MONOTONIC` through the vDSO): the
//! pair of clock reads is most of `bare` (about 20 ns), and is in every other row too. Per
//! configuration and round the bench takes p50, p90, p99, p99.9, max and mean per token
//! (nearest rank); the report is the median of each over the rounds (`--rounds`), the
//! configurations' order rotated from round to round. `net` is a configuration's figure
//! minus `bare`'s. The tails (p99.9, max) are mostly the machine: interrupts, preemption and
//! cache pollution by other processes; the bench reports how busy other processes kept the
//! CPUs while it ran (`others_cpu_pct`, from `/proc/stat` less its own `getrusage`).
//!
//! Like the data plane with the built-in model, a governor whose scanner still holds text
//! after a token looks ahead at the next token (`TurnGovernor::look_ahead`, the end of the
//! turn after its last token); that is timed with the token.
//!
//! It also reports how much text the exfiltration scanner holds back over the built-in text:
//! after each token, the bytes not yet released and the tokens they touch (a token is held
//! until its last byte is released), from an `ExfilScanner` run on every timed turn
//! (`ExfilScanner::held_bytes`), after the token's push alone and after the look-ahead, and
//! from the `all` governor's `Gate::Release` answers and look-aheads (pushed minus released;
//! checked equal to the scanner's in the `exfil` configuration).
//!
//! Output: a table on stdout, progress on stderr, and the same numbers as JSON in
//! `target/bench/detectors.json` (`--out` to change). A benchmark reports: missing the target
//! prints MISS and does not fail the run; it fails only if the setup does (a config refused,
//! the model giving short turns, the hold-back cross-check failing). About 1 s in all.
//!
//! # Report file
//!
//! ```text
//! {
//!   "bench": "detectors",
//!   "target_p99_us": 10.0,
//!   "target": {"config": "all", "p99_us", "net_p99_us", "verdict": "PASS" | "MISS"},
//!   "machine": {"nproc", "kernel", "cpu", "loadavg_before", "others_cpu_pct"},
//!   "rounds_s": 0.23,                       // wall time of the timed rounds
//!   "params": {"turns", "tokens_per_turn", "tokens_per_config", "rounds", "warmup_turns",
//!              "gap_ms", "gap_log_sd", "ttft_ms", "hard_limit", "surprise_threshold_bits",
//!              "latency_mode", "evict_kib", "timer"},
//!   "text": {"tokens", "token_bytes": PCT, "surprise_bits": {"p50", "p99", "max", "mean"},
//!            "tokens_below_hard_limit_pct", "turns_with_a_token_below_hard_limit"},
//!   "wall_s": 0.4,
//!   "results": [                            // bare, none, halt_monitor, surprise, compute_budget,
//!     {"config": "all",                     //   latency_anomaly, exfil, all, all_evicted
//!      "detectors": ["halt_monitor", ...],  // null for bare
//!      "evict_kib": null,                   // 256 for all_evicted
//!      "config_toml": "...",                // null for bare
//!      "per_token_ns": PCT,                 // medians over the rounds
//!      "net_per_token_ns": PCT,             // minus bare's, figure by figure
//!      "by_kind_ns": {"steady": PCT, "first": PCT, "trip": PCT | null},
//!      "rounds_per_token_ns": [PCT, ...],   // each round's own
//!      "turn_setup_ns": PCT | null,         // Detectors::turn
//!      "turn_end_ns": PCT | null,           // TurnGovernor::on_end (untripped turns)
//!      "turn_summary_ns": PCT | null,       // TurnGovernor::summary + drop
//!      "governor_turns": 1781,              // turns the governor judged (trips split turns)
//!      "trips": {"halt_monitor": 1587},     // hard trips per detector, first round
//!      "latency_rts_modes": {"normal": 1781}}
//!   ],
//!   "exfil_holdback": {
//!     "scanner": HOLD, "scanner_look_ahead": HOLD, "governed_all": HOLD,
//!     "scanner_turn_peak_bytes": PCT, "scanner_breaches": 0, "max_holdback_bytes": 512}
//! }
//! PCT  = {"n", "p50", "p90", "p99", "p999", "max", "mean"}   (ns, or bytes/tokens)
//! HOLD = {"tokens", "held_bytes": PCT, "held_tokens": PCT, "tokens_with_holdback_pct"}
//! ```

use std::{
    collections::{BTreeMap, VecDeque},
    fs,
    hint::black_box,
    path::{Path, PathBuf},
    sync::Arc,
    thread,
    time::Instant,
};

use anyhow::{anyhow, ensure, Context, Result};
use clap::Parser;
use haltd::{
    clock::monotonic_ns,
    detect::{
        exfil::{Ahead, ExfilConfig, ExfilRules, ExfilScanner, ExfilStep},
        pipeline::{Detectors, DetectorsConfig, Gate, TurnGovernor},
        TokenObs,
    },
    source::builtin::BuiltinModel,
};
use serde_json::{json, Value};

/// The target of issue 4, point 8: all built-in detectors' cost per token at p99, in µs.
const TARGET_P99_US: f64 = 10.0;
/// HaltMonitor limit (probability scorer) in every configuration that runs it.
const HARD_LIMIT: f64 = 0.01;
/// Surprise threshold: far above any 16-token mean of the built-in model's text.
const SURPRISE_THRESHOLD_BITS: f64 = 24.0;
/// Share of the CPUs (percent) other processes may use during the rounds before it is flagged.
const OTHERS_WARN_PCT: f64 = 5.0;
/// Time to first token of each synthetic turn.
const TTFT_NS: u64 = 50_000_000;
/// Pause between synthetic turns.
const TURN_PAUSE_NS: u64 = 100_000_000;

/// Detector cost per token, all built-in detectors against the bare stream.
#[derive(Debug, Parser)]
#[command(name = "bench-detectors")]
struct Args {
    /// Timed turns (each a different prompt and seed).
    #[arg(long, default_value_t = 200)]
    turns: usize,
    /// Tokens per turn.
    #[arg(long, default_value_t = 256)]
    tokens: u32,
    /// Rounds; the report takes the median of each figure over them.
    #[arg(long, default_value_t = 3)]
    rounds: usize,
    /// Untimed turns per configuration before the first round (warms the latency baseline).
    #[arg(long, default_value_t = 16)]
    warmup_turns: usize,
    /// Mean gap between tokens of the synthetic clock, in milliseconds.
    #[arg(long, default_value_t = 20.0)]
    gap_ms: f64,
    /// Standard deviation of the log of the gap (lognormal jitter; 0.1 ≈ 10 %).
    #[arg(long, default_value_t = 0.1)]
    gap_log_sd: f64,
    /// Memory written over before each token in the `all_evicted` configuration, in KiB.
    #[arg(long, default_value_t = 256)]
    evict_kib: usize,
    /// Mode of the latency-anomaly detector: `hard` or `observe`.
    #[arg(long, default_value = "hard")]
    latency_mode: String,
    /// Print each configuration's TOML and exit.
    #[arg(long)]
    show_config: bool,
    /// JSON report (default: `bench/detectors.json` in the target directory this binary was
    /// built into, i.e. `target/bench/detectors.json`).
    #[arg(long)]
    out: Option<PathBuf>,
}

/// One pre-generated token: its text, logprob and arrival time relative to its turn's start.
#[derive(Debug, Clone, Copy)]
struct Tok {
    text: &'static str,
    logprob: f32,
    at_ns: u64,
}

#[derive(Debug)]
struct Turn {
    id: String,
    toks: Vec<Tok>,
}

/// The detectors a configuration turns on (`None`: the bare loop, no governor at all).
#[derive(Debug, Clone, Copy)]
struct Cfg {
    name: &'static str,
    on: Option<&'static [&'static str]>,
    /// Write over `--evict-kib` of memory before each token (untimed).
    evict: bool,
}

const ALL: [&str; 5] = [
    "halt_monitor",
    "surprise",
    "compute_budget",
    "latency_anomaly",
    "exfil",
];

const CONFIGS: [Cfg; 9] = [
    Cfg {
        name: "bare",
        on: None,
        evict: false,
    },
    Cfg {
        name: "none",
        on: Some(&[]),
        evict: false,
    },
    Cfg {
        name: "halt_monitor",
        on: Some(&["halt_monitor"]),
        evict: false,
    },
    Cfg {
        name: "surprise",
        on: Some(&["surprise"]),
        evict: false,
    },
    Cfg {
        name: "compute_budget",
        on: Some(&["compute_budget"]),
        evict: false,
    },
    Cfg {
        name: "latency_anomaly",
        on: Some(&["latency_anomaly"]),
        evict: false,
    },
    Cfg {
        name: "exfil",
        on: Some(&["exfil"]),
        evict: false,
    },
    Cfg {
        name: "all",
        on: Some(&ALL),
        evict: false,
    },
    Cfg {
        name: "all_evicted",
        on: Some(&ALL),
        evict: true,
    },
];

/// The config file text for a configuration: every detector's table, `off` unless in `on`.
fn config_toml(on: &[&str], latency_mode: &str) -> String {
    let mode = |d: &str| if on.contains(&d) { "hard" } else { "off" };
    let mut s = String::new();
    for d in ALL {
        s.push_str(&format!("[detectors.{d}]\n"));
        if !on.contains(&d) {
            s.push_str("mode = \"off\"\n\n");
            continue;
        }
        match d {
            "halt_monitor" => s.push_str(&format!(
                "mode = \"{}\"\nhard_limit = {HARD_LIMIT}\nscorer = \"probability\"\n",
                mode(d)
            )),
            "surprise" => s.push_str(&format!(
                "mode = \"{}\"\nthreshold_bits = {SURPRISE_THRESHOLD_BITS:.1}\n",
                mode(d)
            )),
            "compute_budget" => s.push_str(&format!(
                "mode = \"{}\"\nmax_tokens = 1000000\nmax_wall_ms = 3600000\n",
                mode(d)
            )),
            "latency_anomaly" => s.push_str(&format!("mode = \"{latency_mode}\"\n")),
            _ => s.push_str(&format!("mode = \"{}\"\n", mode(d))),
        }
        s.push('\n');
    }
    s
}

fn build_detectors(text: &str) -> Result<Detectors> {
    // The table's type is `toml::Table`, inferred from `DetectorsConfig::load`.
    let table = text
        .parse()
        .map_err(|e| anyhow!("bench config is not valid TOML: {e}"))?;
    let cfg = DetectorsConfig::load(Some(&table), 0.0).context("bench detector config")?;
    Detectors::new(cfg).context("building the detectors")
}

/// splitmix64, for the synthetic clock's jitter.
struct Rng(u64);

impl Rng {
    fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in (0, 1].
    fn unit(&mut self) -> f64 {
        ((self.next_u64() >> 11) as f64 + 1.0) / (1u64 << 53) as f64
    }

    /// Standard normal (Box–Muller).
    fn normal(&mut self) -> f64 {
        let (u, v) = (self.unit(), self.unit());
        (-2.0 * u.ln()).sqrt() * (std::f64::consts::TAU * v).cos()
    }
}

/// `n` turns of `tokens` tokens from the built-in model, prompts and seeds from `tag`.
fn generate(tag: &str, n: usize, tokens: u32, gap_ms: f64, log_sd: f64) -> Result<Vec<Turn>> {
    let model = BuiltinModel::get();
    let mut rng = Rng(0x6465_7465_6374_6f72 ^ u64::from(tokens) ^ (n as u64) << 32);
    let gap_ns = gap_ms * 1e6;
    (0..n)
        .map(|i| {
            let prompt = format!("{tag} turn {i}: tell me about the river and the town");
            let mut s = model
                .stream(&prompt, Some(i as u64), tokens)
                .with_ignore_eos(true);
            let mut toks = Vec::with_capacity(tokens as usize);
            let mut at = TTFT_NS;
            while let Some(t) = s.next_token(0) {
                toks.push(Tok {
                    text: t.text,
                    logprob: t.logprob,
                    at_ns: at,
                });
                at += (gap_ns * (log_sd * rng.normal()).exp()).round().max(1.0) as u64;
            }
            ensure!(
                toks.len() == tokens as usize,
                "{tag} turn {i}: the built-in model gave {} of {tokens} tokens",
                toks.len()
            );
            Ok(Turn {
                id: format!("bench-{tag}-{i}"),
                toks,
            })
        })
        .collect()
}

/// What one configuration measured in one round.
#[derive(Debug, Default)]
struct Samples {
    token_ns: Vec<u64>,
    /// The same tokens by kind: a governor turn's first token, a token that tripped, the rest.
    first_ns: Vec<u64>,
    trip_ns: Vec<u64>,
    steady_ns: Vec<u64>,
    setup_ns: Vec<u64>,
    end_ns: Vec<u64>,
    summary_ns: Vec<u64>,
    /// Hard trips per detector.
    trips: BTreeMap<String, u64>,
    /// Turns the governor judged (a trip splits a bench turn into two).
    turns: u64,
    /// Latency detector's `rts_mode` per governor turn (from the turn summaries).
    rts_modes: BTreeMap<String, u64>,
    /// After each token: bytes pushed to the scanner and not yet released (configurations
    /// with exfil), and the tokens they span.
    held_bytes: Vec<u64>,
    held_tokens: Vec<u64>,
}

/// The synthetic clock: turns follow one another on it, never going back.
struct Clock {
    now_ns: u64,
}

/// Runs `turns` through `det` (`None`: the bare loop), recording the times into `s`; with
/// `evict`, writes over it before each token.
fn run_turns(
    det: Option<&Detectors>,
    turns: &[Turn],
    clock: &mut Clock,
    s: &mut Samples,
    mut evict: Option<&mut [u8]>,
) {
    for turn in turns {
        let Some(det) = det else {
            run_bare(turn, clock, s);
            continue;
        };
        let mut from = 0;
        let mut part = 0;
        while from < turn.toks.len() {
            let toks = &turn.toks[from..];
            let start = clock.now_ns;
            let id = if part == 0 {
                turn.id.clone()
            } else {
                format!("{}-{part}", turn.id)
            };
            let t0 = Instant::now();
            let gov = det.turn(&id, start);
            s.setup_ns.push(elapsed_ns(t0));
            s.turns += 1;
            let mut gov = match gov {
                Ok(g) => g,
                Err(t) => {
                    *s.trips.entry(format!("{}(turn)", t.detector)).or_default() += 1;
                    break;
                }
            };
            let tripped_at = run_tokens(&mut gov, toks, start, clock, s, evict.as_deref_mut());
            clock.now_ns += TURN_PAUSE_NS;
            match tripped_at {
                Some(i) => {
                    end_tripped_part(gov, s);
                    from += i + 1;
                    part += 1;
                }
                None => {
                    end_turn(gov, clock, s);
                    break;
                }
            }
        }
    }
}

/// One part of a turn through its governor, token by token, from `start` on the synthetic
/// clock; returns the index of the token that tripped it, if one did.
fn run_tokens(
    gov: &mut TurnGovernor,
    toks: &[Tok],
    start: u64,
    clock: &mut Clock,
    s: &mut Samples,
    mut evict: Option<&mut [u8]>,
) -> Option<usize> {
    let mut pushed = 0u64;
    let mut released = 0u64;
    let mut ends: VecDeque<u64> = VecDeque::new();
    let mut tripped_at = None;
    let base = toks[0].at_ns;
    for (i, tok) in toks.iter().enumerate() {
        let now = start + (tok.at_ns - base) + TTFT_NS;
        if let Some(buf) = evict.as_deref_mut() {
            evict_caches(buf, i as u8);
        }
        let t0 = Instant::now();
        let obs = TokenObs {
            index: i as u64,
            text: tok.text,
            logprob: Some(tok.logprob),
            now_ns: now,
        };
        let mut gate = gov.on_token(&obs, monotonic_ns);
        if let Gate::Release(n) = &mut gate {
            // Text still held: the data plane looks at the built-in model's next token.
            if released + (*n as u64) < pushed + tok.text.len() as u64 {
                let next = toks.get(i + 1).map_or(Ahead::End, |t| Ahead::Text(t.text));
                *n += gov.look_ahead(next);
            }
        }
        let ns = elapsed_ns(t0);
        s.token_ns.push(ns);
        if i == 0 {
            s.first_ns.push(ns);
        } else if matches!(gate, Gate::Trip(_)) {
            s.trip_ns.push(ns);
        } else {
            s.steady_ns.push(ns);
        }
        clock.now_ns = now;
        match gate {
            Gate::Trip(t) => {
                *s.trips.entry(t.detector.to_string()).or_default() += 1;
                tripped_at = Some(i);
                break;
            }
            Gate::Release(n) => {
                pushed += tok.text.len() as u64;
                ends.push_back(pushed);
                released = (released + n as u64).min(pushed);
                while ends.front().is_some_and(|&e| e <= released) {
                    ends.pop_front();
                }
                s.held_bytes.push(pushed - released);
                s.held_tokens.push(ends.len() as u64);
            }
        }
    }
    tripped_at
}

/// A tripped part: the data plane drops a tripped turn's governor without `on_end`.
fn end_tripped_part(gov: TurnGovernor, s: &mut Samples) {
    if let Some(m) = rts_mode(&gov.summary()) {
        *s.rts_modes.entry(m).or_default() += 1;
    }
    drop(gov);
}

/// A turn that ran to its end: `on_end`, then the turn record's detector summaries and the
/// governor's drop, each timed.
fn end_turn(mut gov: TurnGovernor, clock: &Clock, s: &mut Samples) {
    let t0 = Instant::now();
    let end = gov.on_end(clock.now_ns);
    s.end_ns.push(elapsed_ns(t0));
    if let Gate::Trip(t) = black_box(end) {
        *s.trips.entry(format!("{}(end)", t.detector)).or_default() += 1;
    }
    let t0 = Instant::now();
    let summary = gov.summary();
    drop(gov);
    s.summary_ns.push(elapsed_ns(t0));
    if let Some(m) = rts_mode(&summary) {
        *s.rts_modes.entry(m).or_default() += 1;
    }
}

/// What the data plane does between two tokens of a stream (other streams, I/O, framing)
/// pushes the detectors' state and code out of the nearest caches: writing over `buf`, one
/// byte per cache line, does the same here.
fn evict_caches(buf: &mut [u8], v: u8) {
    for b in buf.iter_mut().step_by(64) {
        *b = b.wrapping_add(v);
    }
    black_box(buf);
}

/// The bare loop: the same per-token work minus the governor.
fn run_bare(turn: &Turn, clock: &mut Clock, s: &mut Samples) {
    let start = clock.now_ns;
    s.turns += 1;
    for (i, tok) in turn.toks.iter().enumerate() {
        let now = start + tok.at_ns;
        let t0 = Instant::now();
        let obs = TokenObs {
            index: i as u64,
            text: tok.text,
            logprob: Some(tok.logprob),
            now_ns: now,
        };
        let gate = Gate::Release(black_box(&obs).text.len());
        let ns = elapsed_ns(t0);
        s.token_ns.push(ns);
        if i == 0 {
            s.first_ns.push(ns);
        } else {
            s.steady_ns.push(ns);
        }
        black_box(gate);
        clock.now_ns = now;
    }
    clock.now_ns += TURN_PAUSE_NS;
}

fn rts_mode(summary: &Value) -> Option<String> {
    summary
        .get("latency_anomaly")?
        .get("summary")?
        .get("rts_mode")?
        .as_str()
        .map(str::to_owned)
}

fn elapsed_ns(t0: Instant) -> u64 {
    u64::try_from(t0.elapsed().as_nanos()).unwrap_or(u64::MAX)
}

/// Percentiles of one sample set (nearest rank), in ns.
#[derive(Debug, Clone, Copy, Default)]
struct Pct {
    n: usize,
    p50: f64,
    p90: f64,
    p99: f64,
    p999: f64,
    max: f64,
    mean: f64,
}

const PCT_FIELDS: [&str; 6] = ["p50", "p90", "p99", "p999", "max", "mean"];

impl Pct {
    fn of(v: &[u64]) -> Pct {
        if v.is_empty() {
            return Pct::default();
        }
        let mut s = v.to_vec();
        s.sort_unstable();
        let rank = |q: f64| s[((q * s.len() as f64).ceil() as usize).clamp(1, s.len()) - 1] as f64;
        Pct {
            n: s.len(),
            p50: rank(0.50),
            p90: rank(0.90),
            p99: rank(0.99),
            p999: rank(0.999),
            max: s[s.len() - 1] as f64,
            mean: s.iter().map(|&x| x as f64).sum::<f64>() / s.len() as f64,
        }
    }

    fn get(&self, f: &str) -> f64 {
        match f {
            "p50" => self.p50,
            "p90" => self.p90,
            "p99" => self.p99,
            "p999" => self.p999,
            "max" => self.max,
            _ => self.mean,
        }
    }

    fn set(&mut self, f: &str, v: f64) {
        match f {
            "p50" => self.p50 = v,
            "p90" => self.p90 = v,
            "p99" => self.p99 = v,
            "p999" => self.p999 = v,
            "max" => self.max = v,
            _ => self.mean = v,
        }
    }

    /// Median of each figure over rounds.
    fn median(rounds: &[Pct]) -> Pct {
        let mut out = Pct {
            n: rounds.iter().map(|p| p.n).max().unwrap_or(0),
            ..Pct::default()
        };
        for f in PCT_FIELDS {
            let mut v: Vec<f64> = rounds.iter().map(|p| p.get(f)).collect();
            v.sort_by(f64::total_cmp);
            out.set(f, v.get(v.len() / 2).copied().unwrap_or(0.0));
        }
        out
    }

    fn minus(&self, other: &Pct) -> Pct {
        let mut out = Pct {
            n: self.n,
            ..Pct::default()
        };
        for f in PCT_FIELDS {
            out.set(f, self.get(f) - other.get(f));
        }
        out
    }

    /// `{"n", "p50", ...}` with `scale` applied (1e-3: ns → µs), rounded.
    fn to_json(self, scale: f64, digits: i32) -> Value {
        let r = |v: f64| {
            let m = 10f64.powi(digits);
            (v * scale * m).round() / m
        };
        json!({
            "n": self.n, "p50": r(self.p50), "p90": r(self.p90), "p99": r(self.p99),
            "p999": r(self.p999), "max": r(self.max), "mean": r(self.mean),
        })
    }
}

/// One configuration across the rounds.
struct Row {
    cfg: Cfg,
    toml: Option<String>,
    token: Vec<Pct>,
    first: Vec<Pct>,
    trip: Vec<Pct>,
    steady: Vec<Pct>,
    setup: Vec<Pct>,
    end: Vec<Pct>,
    summary: Vec<Pct>,
    trips: BTreeMap<String, u64>,
    turns: u64,
    rts_modes: BTreeMap<String, u64>,
    held_bytes: Vec<u64>,
    held_tokens: Vec<u64>,
}

fn check_args(args: &Args) -> Result<()> {
    ensure!(
        args.turns > 0 && args.tokens > 0 && args.rounds > 0,
        "--turns, --tokens and --rounds must be positive"
    );
    ensure!(
        args.gap_ms > 0.0 && args.gap_log_sd >= 0.0 && args.gap_log_sd < 2.0,
        "--gap-ms must be positive and --gap-log-sd in [0, 2)"
    );
    ensure!(
        matches!(args.latency_mode.as_str(), "hard" | "observe"),
        "--latency-mode must be hard or observe"
    );
    Ok(())
}

/// One configuration's detectors (none for the bare loop) run untimed over the warm-up turns
/// (which teaches the latency baseline), with their clock and an empty row.
fn warm_up(c: Cfg, latency_mode: &str, warm: &[Turn]) -> Result<(Option<Detectors>, Clock, Row)> {
    let toml = c.on.map(|on| config_toml(on, latency_mode));
    let det = toml.as_deref().map(build_detectors).transpose()?;
    let mut clock = Clock {
        now_ns: monotonic_ns(),
    };
    // Warm-up: untimed (the samples are dropped), teaches the latency baseline.
    let mut s = Samples::default();
    run_turns(det.as_ref(), warm, &mut clock, &mut s, None);
    eprintln!(
        "[bench-detectors] {}: {} warm-up turns{}",
        c.name,
        warm.len(),
        if s.trips.is_empty() {
            String::new()
        } else {
            format!(", trips {:?}", s.trips)
        }
    );
    let row = Row {
        cfg: c,
        toml,
        token: Vec::new(),
        first: Vec::new(),
        trip: Vec::new(),
        steady: Vec::new(),
        setup: Vec::new(),
        end: Vec::new(),
        summary: Vec::new(),
        trips: BTreeMap::new(),
        turns: 0,
        rts_modes: BTreeMap::new(),
        held_bytes: Vec::new(),
        held_tokens: Vec::new(),
    };
    Ok((det, clock, row))
}

fn main() -> Result<()> {
    let args = Args::parse();
    check_args(&args)?;
    if args.show_config {
        for c in CONFIGS {
            if let Some(on) = c.on {
                println!("# {}\n{}", c.name, config_toml(on, &args.latency_mode));
            }
        }
        return Ok(());
    }
    let wall = Instant::now();
    let out = match &args.out {
        Some(p) => p.clone(),
        None => default_out(
            std::env::current_exe()?
                .parent()
                .unwrap_or_else(|| Path::new(".")),
        ),
    };
    let (turns, warm, n_tokens) = prepare_turns(&args)?;
    let text_stats = text_stats(&turns);
    let timed = run_rounds(&args, &turns, &warm)?;
    let rows = &timed.rows;

    // The scanner on its own over the same text: the hold-back without any trip in the way,
    // and a check of the governor-derived figures.
    let direct = scan_direct(&turns)?;
    if let Some(ex) = rows.iter().find(|r| r.cfg.name == "exfil") {
        if ex.trips.is_empty() {
            ensure!(
                ex.held_bytes == direct.ahead_bytes,
                "held bytes from the governor's releases differ from ExfilScanner::held_bytes"
            );
        }
    }

    let bare = Pct::median(&rows[0].token);
    let results = print_token_table(&args, rows, &bare, n_tokens);
    print_kind_table(rows);
    let all = rows
        .iter()
        .find(|r| r.cfg.name == "all")
        .map(|r| Pct::median(&r.token))
        .unwrap_or_default();
    let all_p99_us = all.p99 / 1e3;
    let verdict = if all_p99_us < TARGET_P99_US {
        "PASS"
    } else {
        "MISS"
    };
    println!(
        "target: all built-in detectors p99 {all_p99_us:.2} µs per token (net of the bare loop \
         {:.2} µs) < {TARGET_P99_US} µs: {verdict}",
        (all.p99 - bare.p99) / 1e3
    );
    print_holdback(&direct);

    let target = json!({
        "config": "all",
        "p99_us": (all_p99_us * 1000.0).round() / 1000.0,
        "net_p99_us": ((all.p99 - bare.p99) / 1e3 * 1000.0).round() / 1000.0,
        "verdict": verdict,
    });
    let mut report = report_json(&args, &timed, &direct, n_tokens, target);
    report["text"] = text_stats;
    report["wall_s"] = json!((wall.elapsed().as_secs_f64() * 10.0).round() / 10.0);
    report["results"] = Value::Array(results);
    write_report(&out, &report, wall)
}

/// Trains the built-in model (timed, so its cost is not in the rounds) and generates the
/// timed and warm-up turns; returns them with the timed token count.
fn prepare_turns(args: &Args) -> Result<(Vec<Turn>, Vec<Turn>, usize)> {
    let t0 = Instant::now();
    let _ = BuiltinModel::get();
    eprintln!(
        "[bench-detectors] built-in model trained in {:.2} s",
        t0.elapsed().as_secs_f64()
    );
    let t0 = Instant::now();
    let turns = generate(
        "bench",
        args.turns,
        args.tokens,
        args.gap_ms,
        args.gap_log_sd,
    )?;
    let warm = generate(
        "warmup",
        args.warmup_turns,
        args.tokens,
        args.gap_ms,
        args.gap_log_sd,
    )?;
    let n_tokens: usize = turns.iter().map(|t| t.toks.len()).sum();
    eprintln!(
        "[bench-detectors] generated {} timed turns ({n_tokens} tokens) and {} warm-up turns in \
         {:.2} s",
        turns.len(),
        warm.len(),
        t0.elapsed().as_secs_f64()
    );
    Ok((turns, warm, n_tokens))
}

/// What the timed rounds measured, with the state of the machine around them.
struct Timed {
    rows: Vec<Row>,
    machine: (usize, String, String),
    loadavg: String,
    others_pct: Option<f64>,
    rounds_s: f64,
}

/// Warms every configuration up, then runs the timed rounds (the configurations in a
/// rotating order) and warns when other processes kept the machine busy meanwhile.
fn run_rounds(args: &Args, turns: &[Turn], warm: &[Turn]) -> Result<Timed> {
    let mut rows: Vec<Row> = Vec::new();
    let mut dets: Vec<Option<Detectors>> = Vec::new();
    let mut clocks: Vec<Clock> = Vec::new();
    for c in CONFIGS {
        let (det, clock, row) = warm_up(c, &args.latency_mode, warm)?;
        dets.push(det);
        clocks.push(clock);
        rows.push(row);
    }

    let machine = machine();
    let loadavg = fs::read_to_string("/proc/loadavg")
        .map_or_else(|_| "unknown".to_owned(), |s| s.trim().to_owned());
    let mut evict_buf = vec![1u8; args.evict_kib * 1024];
    let cpu0 = CpuTimes::now();
    let rounds_t0 = Instant::now();
    for round in 0..args.rounds {
        for k in 0..CONFIGS.len() {
            let i = (k + round) % CONFIGS.len();
            let mut s = Samples::default();
            let t0 = Instant::now();
            let evict = CONFIGS[i].evict.then_some(evict_buf.as_mut_slice());
            run_turns(dets[i].as_ref(), turns, &mut clocks[i], &mut s, evict);
            record_round(round, &mut rows[i], s, t0);
        }
    }

    let rounds_s = rounds_t0.elapsed().as_secs_f64();
    let others_pct = cpu0.and_then(|c| c.others_pct(machine.0));
    eprintln!(
        "[bench-detectors] timed rounds took {rounds_s:.2} s; other processes used {} of the \
         machine's {} CPUs meanwhile (load average before: {loadavg})",
        others_pct.map_or_else(|| "?".to_owned(), |p| format!("{p:.0} %")),
        machine.0
    );
    if others_pct.is_some_and(|p| p > OTHERS_WARN_PCT) {
        eprintln!(
            "[bench-detectors] warning: the machine was busy with other work; the tails \
             (p99.9, max) show it most"
        );
    }
    Ok(Timed {
        rows,
        machine,
        loadavg,
        others_pct,
        rounds_s,
    })
}

/// Logs one configuration's round and adds its samples to its row (the counts from the first
/// round only: every round runs the same turns).
fn record_round(round: usize, row: &mut Row, s: Samples, t0: Instant) {
    let p = Pct::of(&s.token_ns);
    eprintln!(
        "[bench-detectors] round {round} {:<16} {:>7} tokens p50 {:>6.0} ns p99 {:>6.0} \
         ns max {:>8.0} ns ({:.2} s){}",
        row.cfg.name,
        p.n,
        p.p50,
        p.p99,
        p.max,
        t0.elapsed().as_secs_f64(),
        if s.trips.is_empty() {
            String::new()
        } else {
            format!(" trips {:?}", s.trips)
        }
    );
    row.token.push(p);
    row.first.push(Pct::of(&s.first_ns));
    row.trip.push(Pct::of(&s.trip_ns));
    row.steady.push(Pct::of(&s.steady_ns));
    row.setup.push(Pct::of(&s.setup_ns));
    row.end.push(Pct::of(&s.end_ns));
    row.summary.push(Pct::of(&s.summary_ns));
    if round == 0 {
        row.trips = s.trips;
        row.turns = s.turns;
        row.rts_modes = s.rts_modes;
        row.held_bytes = s.held_bytes;
        row.held_tokens = s.held_tokens;
    }
}

/// Prints the cost per token of every configuration; returns each one's JSON result.
fn print_token_table(args: &Args, rows: &[Row], bare: &Pct, n_tokens: usize) -> Vec<Value> {
    let mut results = Vec::new();
    println!();
    println!(
        "detector cost per token: median over {} rounds of {} turns x {} tokens ({} tokens per \
         configuration); ns",
        args.rounds, args.turns, args.tokens, n_tokens
    );
    println!(
        "{:<16} {:>7} {:>7} {:>7} {:>7} {:>8} {:>7} | {:>7} {:>7} | {:>8} {:>8} | {:>8} {:>8} | {:>8} | trips",
        "config",
        "p50",
        "p90",
        "p99",
        "p99.9",
        "max",
        "mean",
        "net p50",
        "net p99",
        "setup50",
        "setup99",
        "end50",
        "end99",
        "summ50"
    );
    for r in rows {
        let tok = Pct::median(&r.token);
        let net = tok.minus(bare);
        let setup = Pct::median(&r.setup);
        let end = Pct::median(&r.end);
        let summary = Pct::median(&r.summary);
        let trips = if r.trips.is_empty() {
            "-".to_owned()
        } else {
            r.trips
                .iter()
                .map(|(k, v)| format!("{k}:{v}"))
                .collect::<Vec<_>>()
                .join(",")
        };
        let dash = |p: &Pct, v: f64| {
            if p.n == 0 {
                "-".to_owned()
            } else {
                format!("{v:.0}")
            }
        };
        println!(
            "{:<16} {:>7.0} {:>7.0} {:>7.0} {:>7.0} {:>8.0} {:>7.0} | {:>7.0} {:>7.0} | {:>8} {:>8} | {:>8} {:>8} | {:>8} | {trips}",
            r.cfg.name,
            tok.p50,
            tok.p90,
            tok.p99,
            tok.p999,
            tok.max,
            tok.mean,
            net.p50,
            net.p99,
            dash(&setup, setup.p50),
            dash(&setup, setup.p99),
            dash(&end, end.p50),
            dash(&end, end.p99),
            dash(&summary, summary.p50),
        );
        results.push(row_json(args, r, &tok, &net));
    }
    results
}

/// One configuration's result in the JSON report.
fn row_json(args: &Args, r: &Row, tok: &Pct, net: &Pct) -> Value {
    let setup = Pct::median(&r.setup);
    let end = Pct::median(&r.end);
    let summary = Pct::median(&r.summary);
    json!({
        "config": r.cfg.name,
        "detectors": r.cfg.on,
        "evict_kib": r.cfg.evict.then_some(args.evict_kib),
        "config_toml": r.toml,
        "per_token_ns": tok.to_json(1.0, 0),
        "net_per_token_ns": net.to_json(1.0, 0),
        "by_kind_ns": {
            "steady": Pct::median(&r.steady).to_json(1.0, 0),
            "first": Pct::median(&r.first).to_json(1.0, 0),
            "trip": (Pct::median(&r.trip).n > 0).then(|| Pct::median(&r.trip).to_json(1.0, 0)),
        },
        "rounds_per_token_ns": r.token.iter().map(|p| p.to_json(1.0, 0)).collect::<Vec<_>>(),
        "turn_setup_ns": (setup.n > 0).then(|| setup.to_json(1.0, 0)),
        "turn_end_ns": (end.n > 0).then(|| end.to_json(1.0, 0)),
        "turn_summary_ns": (summary.n > 0).then(|| summary.to_json(1.0, 0)),
        "governor_turns": r.turns,
        "trips": r.trips,
        "latency_rts_modes": r.rts_modes,
    })
}

/// Prints the cost per token by kind of token (steady, a turn's first, the tripping one).
fn print_kind_table(rows: &[Row]) {
    println!();
    println!(
        "by kind of token (ns): steady = not a turn's first token, no trip; first = a governor \
         turn's first token; trip = the token that tripped"
    );
    println!(
        "{:<16} {:>7} {:>7} {:>7} {:>7} | {:>6} {:>7} {:>7} | {:>6} {:>7} {:>7}",
        "config",
        "steady n",
        "p50",
        "p99",
        "p99.9",
        "first n",
        "p50",
        "p99",
        "trip n",
        "p50",
        "p99"
    );
    for r in rows {
        let (st, fi, tr) = (
            Pct::median(&r.steady),
            Pct::median(&r.first),
            Pct::median(&r.trip),
        );
        println!(
            "{:<16} {:>7} {:>7.0} {:>7.0} {:>7.0} | {:>6} {:>7.0} {:>7.0} | {:>6} {:>7.0} {:>7.0}",
            r.cfg.name, st.n, st.p50, st.p99, st.p999, fi.n, fi.p50, fi.p99, tr.n, tr.p50, tr.p99
        );
    }
}

/// Prints the exfil scanner's hold-back over the timed text, after each token's push and
/// after the look-ahead at the next token.
fn print_holdback(direct: &Direct) {
    let line = |what: &str, bytes: &[u64], tokens: &[u64]| {
        let (dh, dt) = (Pct::of(bytes), Pct::of(tokens));
        println!(
            "exfil hold-back {what} (ExfilScanner, default rules, {} tokens): bytes p50 {:.0} \
             p99 {:.0} max {:.0}; tokens p50 {:.0} p99 {:.0} max {:.0}; {:.1} % of tokens leave \
             something held",
            dh.n,
            dh.p50,
            dh.p99,
            dh.max,
            dt.p50,
            dt.p99,
            dt.max,
            100.0 * bytes.iter().filter(|&&b| b > 0).count() as f64 / bytes.len().max(1) as f64,
        );
    };
    line(
        "after each token's push",
        &direct.held_bytes,
        &direct.held_tokens,
    );
    line(
        "after the look-ahead at the next token",
        &direct.ahead_bytes,
        &direct.ahead_tokens,
    );
    println!(
        "exfil turn peak p50 {:.0} max {:.0} bytes; breaches {}",
        Pct::of(&direct.turn_peak).p50,
        Pct::of(&direct.turn_peak).max,
        direct.breaches,
    );
}

/// The JSON report but for the text statistics, the wall time and the results, which the
/// caller adds.
fn report_json(
    args: &Args,
    timed: &Timed,
    direct: &Direct,
    n_tokens: usize,
    target: Value,
) -> Value {
    let governed = timed
        .rows
        .iter()
        .find(|r| r.cfg.name == "all")
        .map(|r| holdback_json(&r.held_bytes, &r.held_tokens))
        .unwrap_or(Value::Null);
    let machine = &timed.machine;
    json!({
        "bench": "detectors",
        "target_p99_us": TARGET_P99_US,
        "target": target,
        "machine": {
            "nproc": machine.0, "kernel": machine.1, "cpu": machine.2,
            "loadavg_before": timed.loadavg,
            "others_cpu_pct": timed.others_pct.map(|p| (p * 10.0).round() / 10.0),
        },
        "rounds_s": (timed.rounds_s * 100.0).round() / 100.0,
        "params": {
            "turns": args.turns,
            "tokens_per_turn": args.tokens,
            "tokens_per_config": n_tokens,
            "rounds": args.rounds,
            "warmup_turns": args.warmup_turns,
            "gap_ms": args.gap_ms,
            "gap_log_sd": args.gap_log_sd,
            "ttft_ms": TTFT_NS as f64 / 1e6,
            "hard_limit": HARD_LIMIT,
            "surprise_threshold_bits": SURPRISE_THRESHOLD_BITS,
            "latency_mode": args.latency_mode,
            "evict_kib": args.evict_kib,
            "timer": "std::time::Instant (CLOCK_MONOTONIC, vDSO), one pair of reads per token",
        },
        "exfil_holdback": {
            "scanner": holdback_json(&direct.held_bytes, &direct.held_tokens),
            "scanner_look_ahead": holdback_json(&direct.ahead_bytes, &direct.ahead_tokens),
            "scanner_turn_peak_bytes": Pct::of(&direct.turn_peak).to_json(1.0, 0),
            "scanner_breaches": direct.breaches,
            "max_holdback_bytes": ExfilConfig::default().max_holdback_bytes,
            "governed_all": governed,
        },
    })
}

fn write_report(out: &Path, report: &Value, wall: Instant) -> Result<()> {
    if let Some(dir) = out.parent() {
        fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    }
    fs::write(out, serde_json::to_string_pretty(report)? + "\n")
        .with_context(|| format!("writing {}", out.display()))?;
    eprintln!(
        "[bench-detectors] report written to {} ({:.1} s)",
        out.display(),
        wall.elapsed().as_secs_f64()
    );
    Ok(())
}

fn holdback_json(bytes: &[u64], tokens: &[u64]) -> Value {
    json!({
        "tokens": bytes.len(),
        "held_bytes": Pct::of(bytes).to_json(1.0, 1),
        "held_tokens": Pct::of(tokens).to_json(1.0, 2),
        "tokens_with_holdback_pct":
            (1000.0 * bytes.iter().filter(|&&b| b > 0).count() as f64 / bytes.len().max(1) as f64)
                .round() / 10.0,
    })
}

struct Direct {
    /// After each token's push.
    held_bytes: Vec<u64>,
    held_tokens: Vec<u64>,
    /// After each token's push and the look-ahead at the next token.
    ahead_bytes: Vec<u64>,
    ahead_tokens: Vec<u64>,
    turn_peak: Vec<u64>,
    breaches: u64,
}

/// The scanner alone over every timed turn, untimed: held bytes and tokens after each push,
/// and after the look-ahead that follows it.
fn scan_direct(turns: &[Turn]) -> Result<Direct> {
    let rules = Arc::new(ExfilRules::new(&ExfilConfig::default()).context("exfil rules")?);
    let mut d = Direct {
        held_bytes: Vec::new(),
        held_tokens: Vec::new(),
        ahead_bytes: Vec::new(),
        ahead_tokens: Vec::new(),
        turn_peak: Vec::new(),
        breaches: 0,
    };
    let mut sc = ExfilScanner::new(rules);
    for turn in turns {
        sc.reset();
        let mut pushed = 0u64;
        let mut ends: VecDeque<u64> = VecDeque::new();
        // Tokens still held after `released` bytes went out.
        let held_tokens = |ends: &mut VecDeque<u64>, released: u64| {
            while ends.front().is_some_and(|&e| e <= released) {
                ends.pop_front();
            }
            ends.len() as u64
        };
        for (i, tok) in turn.toks.iter().enumerate() {
            if let ExfilStep::Breach(_) = sc.push(tok.text) {
                d.breaches += 1;
            }
            pushed += tok.text.len() as u64;
            ends.push_back(pushed);
            d.held_bytes.push(sc.held_bytes() as u64);
            d.held_tokens
                .push(held_tokens(&mut ends, sc.released_bytes() as u64));
            let next = turn
                .toks
                .get(i + 1)
                .map_or(Ahead::End, |t| Ahead::Text(t.text));
            sc.look_ahead(next);
            d.ahead_bytes.push(sc.held_bytes() as u64);
            d.ahead_tokens
                .push(held_tokens(&mut ends, sc.released_bytes() as u64));
        }
        d.turn_peak.push(sc.peak_held_bytes() as u64);
        while let ExfilStep::Breach(_) = sc.finish() {
            d.breaches += 1;
        }
    }
    Ok(d)
}

/// What the text looks like to the detectors: token sizes and probabilities.
fn text_stats(turns: &[Turn]) -> Value {
    let toks: Vec<&Tok> = turns.iter().flat_map(|t| &t.toks).collect();
    let n = toks.len().max(1) as f64;
    let below = |p: f64| {
        toks.iter()
            .filter(|t| f64::from(t.logprob).exp() < p)
            .count()
    };
    let turns_below = turns
        .iter()
        .filter(|t| {
            t.toks
                .iter()
                .any(|k| f64::from(k.logprob).exp() < HARD_LIMIT)
        })
        .count();
    let bytes: Vec<u64> = toks.iter().map(|t| t.text.len() as u64).collect();
    let bits: Vec<u64> = toks
        .iter()
        .map(|t| (-f64::from(t.logprob) / std::f64::consts::LN_2 * 1000.0).round() as u64)
        .collect();
    let b = Pct::of(&bits);
    let v = json!({
        "tokens": toks.len(),
        "token_bytes": Pct::of(&bytes).to_json(1.0, 1),
        "surprise_bits": {"p50": b.p50 / 1e3, "p99": b.p99 / 1e3, "max": b.max / 1e3, "mean": (b.mean / 1e3 * 1000.0).round() / 1000.0},
        "tokens_below_hard_limit_pct": (1000.0 * below(HARD_LIMIT) as f64 / n).round() / 10.0,
        "turns_with_a_token_below_hard_limit": turns_below,
    });
    eprintln!("[bench-detectors] text: {v}");
    v
}

/// `target/bench/detectors.json` when this binary lies in `target/<profile>/`.
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
    target.join("bench").join("detectors.json")
}

fn machine() -> (usize, String, String) {
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
    (nproc, kernel, cpu)
}

/// CPU time of the whole machine (busy, from `/proc/stat`) and of this process (`getrusage`),
/// in seconds: how busy the other processes kept the machine while the rounds ran.
#[derive(Debug, Clone, Copy)]
struct CpuTimes {
    machine_busy_s: f64,
    own_s: f64,
    at: Instant,
}

impl CpuTimes {
    fn now() -> Option<CpuTimes> {
        let stat = fs::read_to_string("/proc/stat").ok()?;
        let fields: Vec<f64> = stat
            .lines()
            .next()?
            .split_whitespace()
            .skip(1)
            .map(|f| f.parse().unwrap_or(0.0))
            .collect();
        // user nice system idle iowait irq softirq steal (guest time is inside user).
        let busy: f64 = fields
            .iter()
            .take(8)
            .enumerate()
            .filter(|(i, _)| *i != 3 && *i != 4)
            .map(|(_, v)| v)
            .sum();
        // SAFETY: sysconf has no memory effects.
        let tck = unsafe { libc::sysconf(libc::_SC_CLK_TCK) };
        // SAFETY: an all-zero rusage is a valid value for getrusage to overwrite.
        let mut ru: libc::rusage = unsafe { std::mem::zeroed() };
        // SAFETY: `ru` is a valid, writable rusage that outlives the call.
        if tck <= 0 || unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut ru) } != 0 {
            return None;
        }
        let tv = |t: libc::timeval| t.tv_sec as f64 + t.tv_usec as f64 / 1e6;
        Some(CpuTimes {
            machine_busy_s: busy / tck as f64,
            own_s: tv(ru.ru_utime) + tv(ru.ru_stime),
            at: Instant::now(),
        })
    }

    /// Percent of all CPUs that other processes used since `self`.
    fn others_pct(&self, nproc: usize) -> Option<f64> {
        let now = CpuTimes::now()?;
        let wall = now.at.duration_since(self.at).as_secs_f64();
        let others = (now.machine_busy_s - self.machine_busy_s) - (now.own_s - self.own_s);
        (wall > 0.0 && nproc > 0)
            .then(|| (100.0 * others / (wall * nproc as f64)).clamp(0.0, 100.0))
    }
}
