//! Tests of the timing detectors: the compute budget, the latency anomaly detector and its
//! baseline, the FHR timing fields.

use std::sync::Arc;

use super::*;
use crate::{
    codes::FailureCode,
    detect::{Detector, Finding, TokenObs},
};

use proptest::prelude::*;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

const MS: u64 = 1_000_000;

fn tok(index: u64, now_ns: u64) -> TokenObs<'static> {
    TokenObs {
        index,
        text: "x",
        logprob: None,
        now_ns,
    }
}

fn is_breach(f: &Finding) -> bool {
    matches!(f, Finding::Breach { .. })
}

// ---- compute budget ----

#[test]
fn budget_trips_exactly_at_max_tokens_plus_one() {
    let cfg = ComputeBudgetConfig {
        max_tokens: 10,
        max_wall_ms: 0,
    };
    let mut d = ComputeBudget::new(&cfg);
    for i in 0..10 {
        assert_eq!(d.observe(&tok(i, i * MS)), Finding::Clear, "token {i}");
    }
    let f = d.observe(&tok(10, 10 * MS));
    assert!(is_breach(&f), "{f:?}");
    assert!(is_breach(&d.observe(&tok(11, 11 * MS))), "the breach holds");
    let s = d.budget_summary();
    assert!(s.breached);
    assert_eq!(s.breach_limit, Some(BudgetLimit::Tokens));
    assert_eq!(s.breach_token_index, Some(10));
    assert_eq!(s.tokens, 12);
    assert_eq!(d.code(), FailureCode::ComputeBudgetExceeded);
    assert_eq!(d.summary()["breach_limit"], "tokens");
}

#[test]
fn budget_trips_first_token_after_max_wall_from_first_token() {
    let cfg = ComputeBudgetConfig {
        max_tokens: 0,
        max_wall_ms: 100,
    };
    let mut d = ComputeBudget::new(&cfg);
    let t0 = 5_000 * MS;
    assert_eq!(d.observe(&tok(0, t0)), Finding::Clear);
    assert_eq!(d.deadline_ns(), Some(t0 + 100 * MS));
    assert_eq!(d.observe(&tok(1, t0 + 50 * MS)), Finding::Clear);
    // Exactly at the limit is within it.
    assert_eq!(d.observe(&tok(2, t0 + 100 * MS)), Finding::Clear);
    assert!(is_breach(&d.observe(&tok(3, t0 + 100 * MS + 1))));
    let s = d.budget_summary();
    assert_eq!(s.breach_limit, Some(BudgetLimit::WallTime));
    assert_eq!(s.breach_token_index, Some(3));
}

#[test]
fn budget_wall_time_counts_from_given_start() {
    let cfg = ComputeBudgetConfig {
        max_tokens: 0,
        max_wall_ms: 100,
    };
    let start = 1_000 * MS;
    let mut d = ComputeBudget::starting_at(&cfg, start);
    assert_eq!(d.deadline_ns(), Some(start + 100 * MS));
    // The first token comes 101 ms after the request: already past the budget.
    let f = d.observe(&tok(0, start + 101 * MS));
    assert!(is_breach(&f), "{f:?}");
    if let Finding::Breach { detail } = f {
        assert!(detail.contains("max_wall_ms 100"), "{detail}");
    }
}

#[test]
fn budget_unlimited_never_trips() {
    let cfg = ComputeBudgetConfig::default();
    assert!(cfg.is_unlimited());
    let mut d = ComputeBudget::new(&cfg);
    for i in 0..10_000 {
        assert_eq!(d.observe(&tok(i, i * 1_000 * MS)), Finding::Clear);
    }
    assert_eq!(d.deadline_ns(), None);
    assert_eq!(d.end_of_turn(u64::MAX), Finding::Clear);
}

#[test]
fn budget_config_serde_and_validation() {
    let cfg: ComputeBudgetConfig = serde_json::from_str(r#"{"max_tokens": 5}"#).expect("valid");
    assert_eq!(
        cfg,
        ComputeBudgetConfig {
            max_tokens: 5,
            max_wall_ms: 0
        }
    );
    assert!(serde_json::from_str::<ComputeBudgetConfig>(r#"{"max_token": 5}"#).is_err());
    let err = ComputeBudgetConfig {
        max_tokens: 0,
        max_wall_ms: u64::MAX,
    }
    .validate()
    .expect_err("invalid");
    assert_eq!(err.key, "detectors.compute_budget.max_wall_ms");
    assert!(err
        .to_string()
        .starts_with("detectors.compute_budget.max_wall_ms = "));
    assert!(ComputeBudgetConfig {
        max_tokens: 1,
        max_wall_ms: ComputeBudgetConfig::MAX_WALL_MS
    }
    .validate()
    .is_ok());
}

// ---- latency anomaly: config ----

#[test]
fn latency_config_defaults_serde_and_validation() {
    let d = LatencyAnomalyConfig::default();
    assert_eq!(d.clone().validate(), Ok(d.clone()));
    let cfg: LatencyAnomalyConfig =
        serde_json::from_str(r#"{"method": "ewma", "direction": "up", "h": 5}"#).expect("valid");
    assert_eq!(cfg.method, Method::Ewma);
    assert_eq!(cfg.direction, Direction::Up);
    assert_eq!(cfg.h, 5.0);
    assert_eq!(cfg.k, d.k);
    assert!(serde_json::from_str::<LatencyAnomalyConfig>(r#"{"window": 3}"#).is_err());
    assert!(serde_json::from_str::<LatencyAnomalyConfig>(r#"{"method": "pr"}"#).is_err());
    let back: LatencyAnomalyConfig =
        serde_json::from_value(serde_json::to_value(&d).expect("valid")).expect("valid");
    assert_eq!(back, d);
}

#[test]
fn latency_config_validation_names_the_key() {
    let d = LatencyAnomalyConfig::default();
    let bad = |c: LatencyAnomalyConfig| c.validate().expect_err("invalid").key;
    assert_eq!(
        bad(LatencyAnomalyConfig { k: -1.0, ..d }),
        "detectors.latency_anomaly.k"
    );
    assert_eq!(
        bad(LatencyAnomalyConfig { h: 0.0, ..d }),
        "detectors.latency_anomaly.h"
    );
    assert_eq!(
        bad(LatencyAnomalyConfig { h: f64::NAN, ..d }),
        "detectors.latency_anomaly.h"
    );
    assert_eq!(
        bad(LatencyAnomalyConfig { lambda: 0.0, ..d }),
        "detectors.latency_anomaly.lambda"
    );
    assert_eq!(
        bad(LatencyAnomalyConfig { lambda: 1.5, ..d }),
        "detectors.latency_anomaly.lambda"
    );
    assert_eq!(
        bad(LatencyAnomalyConfig {
            l: f64::INFINITY,
            ..d
        }),
        "detectors.latency_anomaly.l"
    );
    assert_eq!(
        bad(LatencyAnomalyConfig {
            warmup_samples: 1,
            ..d
        }),
        "detectors.latency_anomaly.warmup_samples"
    );
    assert_eq!(
        bad(LatencyAnomalyConfig {
            baseline_alpha: 1.0,
            ..d
        }),
        "detectors.latency_anomaly.baseline_alpha"
    );
    assert_eq!(
        bad(LatencyAnomalyConfig {
            warmup_turns: 1,
            ..d
        }),
        "detectors.latency_anomaly.warmup_turns"
    );
    assert_eq!(
        bad(LatencyAnomalyConfig {
            turn_alpha: 0.0,
            ..d
        }),
        "detectors.latency_anomaly.turn_alpha"
    );
    assert_eq!(
        bad(LatencyAnomalyConfig {
            turn_allowance: -1.0,
            ..d
        }),
        "detectors.latency_anomaly.turn_allowance"
    );
    assert_eq!(
        bad(LatencyAnomalyConfig { z_clip: 0.5, ..d }),
        "detectors.latency_anomaly.z_clip"
    );
    assert_eq!(
        bad(LatencyAnomalyConfig {
            min_sigma: 0.0,
            ..d
        }),
        "detectors.latency_anomaly.min_sigma"
    );
}

// ---- latency anomaly: simulation helpers ----

/// Standard normal by Box–Muller (no extra crate).
fn normal(rng: &mut StdRng) -> f64 {
    let u1: f64 = 1.0 - rng.random::<f64>(); // (0, 1]
    let u2: f64 = rng.random::<f64>();
    (-2.0 * u1.ln()).sqrt() * (std::f64::consts::TAU * u2).cos()
}

/// Lognormal gap with median `median_ns` and log-sd `sigma`.
fn lognormal_gap(rng: &mut StdRng, median_ns: f64, sigma: f64) -> u64 {
    (median_ns * (sigma * normal(rng)).exp()) as u64
}

/// Runs one turn over `gaps` (token 0 at t = 1 s, token i after gap i-1); returns the
/// detector (ended cleanly if it never breached, as the data plane would in observe
/// mode) and the index of its first breaching token.
fn run_turn(
    cfg: &LatencyAnomalyConfig,
    base: &Arc<LatencyBaseline>,
    gaps: impl IntoIterator<Item = u64>,
    end_clean: bool,
) -> (LatencyAnomaly, Option<u64>) {
    let mut d = LatencyAnomaly::new(cfg, Arc::clone(base));
    let mut now = 1_000 * MS;
    let mut first = None;
    if is_breach(&d.observe(&tok(0, now))) {
        first = Some(0);
    }
    for (i, g) in gaps.into_iter().enumerate() {
        now = now.saturating_add(g);
        let index = i as u64 + 1;
        if is_breach(&d.observe(&tok(index, now))) && first.is_none() {
            first = Some(index);
        }
    }
    if end_clean {
        assert_eq!(d.end_of_turn(now), Finding::Clear);
    }
    (d, first)
}

const MEDIAN_NS: f64 = 20.0 * MS as f64;
const SIGMA: f64 = 0.5;
const TURN_GAPS: usize = 255; // 256-token turns

fn stationary(rng: &mut StdRng, n: usize) -> Vec<u64> {
    (0..n)
        .map(|_| lognormal_gap(rng, MEDIAN_NS, SIGMA))
        .collect()
}

fn warmed(cfg: &LatencyAnomalyConfig, rng: &mut StdRng) -> Arc<LatencyBaseline> {
    let base = Arc::new(LatencyBaseline::new());
    for _ in 0..cfg.warmup_turns.max(12) {
        let (_, first) = run_turn(cfg, &base, stationary(rng, TURN_GAPS), true);
        assert_eq!(first, None, "warm-up turns never breach");
    }
    let b = base.snapshot();
    assert!(b.samples >= cfg.warmup_samples && b.turns >= cfg.warmup_turns);
    base
}

/// A synthetic node: lognormal gaps (median 20 ms, log-sd 0.5), each turn's speed scaled
/// by a lognormal factor of log-sd `between`, a fraction `outliers` of gaps 20× too long.
#[derive(Clone, Copy, Debug)]
struct Node {
    turn_gaps: usize,
    between: f64,
    outliers: f64,
}

const STATIONARY: Node = Node {
    turn_gaps: TURN_GAPS,
    between: 0.0,
    outliers: 0.0,
};

impl Node {
    fn turn(&self, rng: &mut StdRng) -> Vec<u64> {
        let speed = (self.between * normal(rng)).exp();
        (0..self.turn_gaps)
            .map(|_| {
                let g = lognormal_gap(rng, MEDIAN_NS * speed, SIGMA);
                if self.outliers > 0.0 && rng.random::<f64>() < self.outliers {
                    g.saturating_mul(20)
                } else {
                    g
                }
            })
            .collect()
    }
}

/// Fraction of `turns` turns of `node` with a breach, after a warm-up on the same node,
/// the baseline learning from clean turns as in the daemon.
fn false_alarm_rate(cfg: &LatencyAnomalyConfig, node: Node, turns: usize, seed: u64) -> f64 {
    let mut rng = StdRng::seed_from_u64(seed);
    let base = Arc::new(LatencyBaseline::new());
    for _ in 0..cfg.warmup_turns.max(12) {
        run_turn(cfg, &base, node.turn(&mut rng), true);
    }
    let mut alarms = 0;
    for _ in 0..turns {
        let (_, first) = run_turn(cfg, &base, node.turn(&mut rng), true);
        alarms += usize::from(first.is_some());
    }
    alarms as f64 / turns as f64
}

/// Detection delays (tokens after the change) of a step change ×`factor` of every gap
/// from token 20 on, over `trials` 256-token turns; `None` for a turn where it was missed
/// or came before the change.
fn detection_delays(
    cfg: &LatencyAnomalyConfig,
    factor: f64,
    trials: usize,
    seed: u64,
) -> Vec<Option<u64>> {
    const CHANGE_AT: u64 = 20;
    let mut rng = StdRng::seed_from_u64(seed);
    let base = warmed(cfg, &mut rng);
    (0..trials)
        .map(|_| {
            let gaps: Vec<u64> = (1..=TURN_GAPS as u64)
                .map(|index| {
                    let g = lognormal_gap(&mut rng, MEDIAN_NS, SIGMA);
                    if index >= CHANGE_AT {
                        (g as f64 * factor) as u64
                    } else {
                        g
                    }
                })
                .collect();
            let before = base.snapshot();
            let (mut d, first) = run_turn(cfg, &base, gaps, false);
            d.end_of_turn(0);
            if first.is_some() {
                assert_eq!(
                    base.snapshot(),
                    before,
                    "a breaching turn taught the baseline"
                );
            }
            first.and_then(|i| i.checked_sub(CHANGE_AT))
        })
        .collect()
}

/// (missed, mean delay, max delay)
fn delay_stats(delays: &[Option<u64>]) -> (usize, f64, u64) {
    let hits: Vec<u64> = delays.iter().flatten().copied().collect();
    let mean = hits.iter().sum::<u64>() as f64 / hits.len().max(1) as f64;
    let max = hits.iter().copied().max().unwrap_or(u64::MAX);
    (delays.len() - hits.len(), mean, max)
}

// ---- latency anomaly: behaviour ----

#[test]
fn cusum_false_alarm_rate_on_stationary_lognormal_is_low() {
    let cfg = LatencyAnomalyConfig::default();
    let rate = false_alarm_rate(&cfg, STATIONARY, 2_000, 0x5eed_0001);
    eprintln!("cusum defaults: false alarms on {rate:.4} of 2000 stationary 256-token turns");
    assert!(rate < 0.02, "false-alarm rate {rate}");
    let long = Node {
        turn_gaps: 1023,
        ..STATIONARY
    };
    let rate = false_alarm_rate(&cfg, long, 500, 0x5eed_0011);
    eprintln!("cusum defaults: false alarms on {rate:.4} of 500 stationary 1024-token turns");
    assert!(rate < 0.02, "false-alarm rate {rate}");
}

#[test]
fn ewma_false_alarm_rate_on_stationary_lognormal_is_low() {
    let cfg = LatencyAnomalyConfig {
        method: Method::Ewma,
        ..LatencyAnomalyConfig::default()
    };
    let rate = false_alarm_rate(&cfg, STATIONARY, 2_000, 0x5eed_0002);
    eprintln!("ewma defaults: false alarms on {rate:.4} of 2000 stationary 256-token turns");
    assert!(rate < 0.02, "false-alarm rate {rate}");
}

/// Turns at different speeds (load) and stray long gaps are not anomalies.
#[test]
fn cusum_tolerates_speed_spread_between_turns_and_outliers() {
    let cfg = LatencyAnomalyConfig::default();
    let spread = Node {
        between: 0.2,
        ..STATIONARY
    };
    let rate = false_alarm_rate(&cfg, spread, 2_000, 0x5eed_0006);
    eprintln!("cusum defaults: false alarms on {rate:.4} of turns with speed spread 0.2");
    assert!(rate < 0.02, "false-alarm rate {rate}");
    // Without the turn allowance, the same node alarms all the time.
    let strict = LatencyAnomalyConfig {
        turn_allowance: 0.0,
        ..cfg
    };
    let rate0 = false_alarm_rate(&strict, spread, 500, 0x5eed_0006);
    eprintln!("cusum, turn_allowance 0: false alarms on {rate0:.4} of the same turns");
    assert!(rate0 > 5.0 * rate.max(0.01), "{rate0} vs {rate}");

    let hiccups = Node {
        outliers: 0.01,
        ..STATIONARY
    };
    let rate = false_alarm_rate(&cfg, hiccups, 2_000, 0x5eed_0007);
    eprintln!("cusum defaults: false alarms on {rate:.4} of turns with 1 % of gaps x20");
    assert!(rate < 0.02, "false-alarm rate {rate}");
}

#[test]
fn cusum_detects_fourfold_slowdown_within_15_tokens() {
    let cfg = LatencyAnomalyConfig::default();
    let delays = detection_delays(&cfg, 4.0, 500, 0x5eed_0003);
    let (missed, mean, max) = delay_stats(&delays);
    eprintln!("cusum, gaps x4 from token 20: missed {missed}/500, delay mean {mean:.2} max {max}");
    // A false alarm before the change counts as a miss here; allow for the rare one.
    assert!(missed <= 5, "missed {missed}");
    assert!(max <= 15, "max delay {max}");
}

#[test]
fn cusum_detects_fourfold_speedup_within_15_tokens() {
    let cfg = LatencyAnomalyConfig::default();
    let delays = detection_delays(&cfg, 0.25, 500, 0x5eed_0004);
    let (missed, mean, max) = delay_stats(&delays);
    eprintln!("cusum, gaps /4 from token 20: missed {missed}/500, delay mean {mean:.2} max {max}");
    assert!(missed <= 5, "missed {missed}");
    assert!(max <= 15, "max delay {max}");
}

#[test]
fn ewma_detects_fourfold_slowdown_within_15_tokens() {
    let cfg = LatencyAnomalyConfig {
        method: Method::Ewma,
        ..LatencyAnomalyConfig::default()
    };
    let delays = detection_delays(&cfg, 4.0, 500, 0x5eed_0005);
    let (missed, mean, max) = delay_stats(&delays);
    eprintln!("ewma, gaps x4 from token 20: missed {missed}/500, delay mean {mean:.2} max {max}");
    assert!(missed <= 5, "missed {missed}");
    assert!(max <= 15, "max delay {max}");
}

#[test]
fn direction_restricts_what_counts() {
    let mut rng = StdRng::seed_from_u64(7);
    for (direction, factor, expect) in [
        (Direction::Up, 4.0, true),
        (Direction::Up, 0.25, false),
        (Direction::Down, 4.0, false),
        (Direction::Down, 0.25, true),
    ] {
        let cfg = LatencyAnomalyConfig {
            direction,
            ..LatencyAnomalyConfig::default()
        };
        let base = warmed(&cfg, &mut rng);
        let gaps: Vec<u64> = (0..100)
            .map(|_| (lognormal_gap(&mut rng, MEDIAN_NS, SIGMA) as f64 * factor) as u64)
            .collect();
        let (d, first) = run_turn(&cfg, &base, gaps, false);
        assert_eq!(first.is_some(), expect, "{direction:?} x{factor}");
        // Both sides are still measured.
        let s = d.timing_summary();
        assert!(s.cusum_up_max > cfg.h || s.cusum_down_max > cfg.h);
    }
}

#[test]
fn warm_up_is_clear_and_says_so() {
    let cfg = LatencyAnomalyConfig {
        warmup_samples: 100,
        warmup_turns: 2,
        ..LatencyAnomalyConfig::default()
    };
    let base = Arc::new(LatencyBaseline::new());
    // Wildly varying gaps during warm-up: never a breach, never Failed.
    let gaps: Vec<u64> = (0..60)
        .map(|i| if i % 2 == 0 { 1 } else { 10_000 * MS })
        .collect();
    let (d, first) = run_turn(&cfg, &base, gaps, true);
    assert_eq!(first, None);
    let s = d.timing_summary();
    assert_eq!(s.rts_mode, RtsMode::WarmingUp);
    assert!(!s.judged);
    assert!(!s.tig_breach);
    assert_eq!(
        s.note.as_deref(),
        Some("warming up: baseline has 0 of 100 gaps, 0 of 2 turns")
    );
    assert_eq!(d.summary()["rts_mode"], "warming_up");
    assert_eq!(base.snapshot().samples, 60);

    // 60 + 60 >= 100: the third turn is judged.
    let mut rng = StdRng::seed_from_u64(9);
    base.reset();
    run_turn(&cfg, &base, stationary(&mut rng, 60), true);
    let (d, _) = run_turn(&cfg, &base, stationary(&mut rng, 60), true);
    assert_eq!(d.timing_summary().rts_mode, RtsMode::WarmingUp);
    let (d, first) = run_turn(&cfg, &base, stationary(&mut rng, 60), true);
    assert!(d.timing_summary().judged);
    assert_eq!(first, None);
    assert_eq!(d.timing_summary().rts_mode, RtsMode::Normal);
    assert_eq!(d.timing_summary().note, None);
}

#[test]
fn tripped_or_dropped_turns_do_not_teach_the_baseline() {
    let cfg = LatencyAnomalyConfig::default();
    let mut rng = StdRng::seed_from_u64(11);
    let base = warmed(&cfg, &mut rng);
    let before = base.snapshot();
    // Observe mode: the turn breaches, goes on and ends "cleanly" for the data plane.
    let slow: Vec<u64> = (0..TURN_GAPS).map(|_| 10 * MEDIAN_NS as u64).collect();
    let (d, first) = run_turn(&cfg, &base, slow.clone(), true);
    assert!(first.is_some());
    assert_eq!(base.snapshot(), before);
    let s = d.timing_summary();
    assert_eq!(s.rts_mode, RtsMode::Breach);
    assert!(s.tig_breach);
    assert!(s.breaches > 0);
    // Hard mode elsewhere: the turn is dropped without end_of_turn.
    drop(run_turn(&cfg, &base, stationary(&mut rng, 100), false));
    assert_eq!(base.snapshot(), before);
    // A clean turn does teach it, once.
    let (mut d, _) = run_turn(&cfg, &base, stationary(&mut rng, 100), true);
    let after = base.snapshot();
    assert_eq!(after.samples, before.samples + 100);
    assert_eq!(after.turns, before.turns + 1);
    d.end_of_turn(0);
    assert_eq!(base.snapshot(), after, "end_of_turn twice folds once");
    // Even many tripped turns leave the baseline as it was: a slow source cannot teach it
    // that slow is normal by tripping.
    for _ in 0..50 {
        run_turn(&cfg, &base, slow.clone(), true);
    }
    assert_eq!(base.snapshot(), after);
}

#[test]
fn baseline_learns_mean_and_spread() {
    let cfg = LatencyAnomalyConfig::default();
    let mut rng = StdRng::seed_from_u64(13);
    let base = Arc::new(LatencyBaseline::new());
    for _ in 0..40 {
        run_turn(&cfg, &base, stationary(&mut rng, TURN_GAPS), true);
    }
    let s = base.snapshot();
    let rel = (s.median_gap_ns() / MEDIAN_NS - 1.0).abs();
    assert!(rel < 0.1, "median {} vs {MEDIAN_NS}", s.median_gap_ns());
    assert!((s.sd_within() - SIGMA).abs() < 0.05, "{s:?}");
    assert!(s.sd_between() < 0.05, "{s:?}");
    // Turns at different speeds: the spread between them is learned apart.
    base.reset();
    for _ in 0..200 {
        let speed = (0.2 * normal(&mut rng)).exp();
        let gaps = (0..TURN_GAPS).map(|_| lognormal_gap(&mut rng, MEDIAN_NS * speed, SIGMA));
        run_turn(&cfg, &base, gaps.collect::<Vec<_>>(), true);
    }
    let s = base.snapshot();
    assert!((s.sd_within() - SIGMA).abs() < 0.05, "{s:?}");
    assert!((s.sd_between() - 0.2).abs() < 0.08, "{s:?}");
    // The first turn is taken as it is (no pull towards the initial zero).
    base.reset();
    run_turn(&cfg, &base, vec![5 * MS; 10], true);
    let s = base.snapshot();
    assert!((s.median_gap_ns() / (5 * MS) as f64 - 1.0).abs() < 1e-9);
    assert!(s.var_within.abs() < 1e-12 && s.var_between == 0.0);
}

#[test]
fn summary_fields() {
    let cfg = LatencyAnomalyConfig::default();
    let base = Arc::new(LatencyBaseline::new());
    let gaps: Vec<u64> = (0..99)
        .map(|i| if i == 50 { 500 * MS } else { 10 * MS })
        .collect();
    let (d, _) = run_turn(&cfg, &base, gaps, true);
    let s = d.timing_summary();
    assert_eq!(s.tokens, 100);
    assert_eq!(s.gaps, 99);
    assert_eq!(s.mean_gap_ns, Some((98 * 10 + 500) * MS / 99));
    assert_eq!(s.latency_bucket, Some("le_100ms"));
    assert_eq!(s.max_gap_ns, Some(500 * MS));
    // 99th percentile of 99 gaps is the 99th smallest: the 500 ms one (clamped to max).
    assert_eq!(s.p99_gap_ns, Some(500 * MS));
    let (d, _) = run_turn(&cfg, &base, vec![10 * MS; 200], true);
    let p99 = d.timing_summary().p99_gap_ns.expect("valid");
    assert!((10 * MS..=11 * MS).contains(&p99), "{p99}");

    let (d, _) = run_turn(&cfg, &base, [], true);
    let s = d.timing_summary();
    assert_eq!((s.tokens, s.gaps), (1, 0));
    assert_eq!(
        (s.mean_gap_ns, s.p99_gap_ns, s.latency_bucket),
        (None, None, None)
    );
    let v = d.summary();
    assert_eq!(v["latency_bucket"], serde_json::Value::Null);
    assert_eq!(v["method"], "cusum");
    assert_eq!(v["direction"], "both");
}

#[test]
fn latency_bucket_edges() {
    assert_eq!(latency_bucket(0), "le_1ms");
    assert_eq!(latency_bucket(1_000_000), "le_1ms");
    assert_eq!(latency_bucket(1_000_001), "le_10ms");
    assert_eq!(latency_bucket(10_000_000), "le_10ms");
    assert_eq!(latency_bucket(100_000_000), "le_100ms");
    assert_eq!(latency_bucket(100_000_001), "gt_100ms");
    assert_eq!(latency_bucket(u64::MAX), "gt_100ms");
    for g in [0, 5_000_000, 50_000_000, u64::MAX] {
        assert!(LATENCY_BUCKETS.contains(&latency_bucket(g)));
    }
}

/// A latency summary of a three-token turn, for `fhr_timing_fields`.
fn timing_summary(rts_mode: RtsMode, tig_breach: bool) -> TimingSummary {
    TimingSummary {
        rts_mode,
        latency_bucket: Some("le_10ms"),
        tig_breach,
        judged: true,
        note: None,
        method: Method::Cusum,
        direction: Direction::Both,
        tokens: 3,
        gaps: 2,
        mean_gap_ns: Some(5 * MS),
        p99_gap_ns: Some(5 * MS),
        max_gap_ns: Some(5 * MS),
        cusum_up_max: 0.0,
        cusum_down_max: 0.0,
        ewma_up_max: 0.0,
        ewma_down_max: 0.0,
        turn_allowance_sd: 0.0,
        breaches: 0,
        first_breach_index: None,
        baseline: BaselineSnapshot::default(),
    }
}

/// A budget summary of a two-token turn, breached or not, for `fhr_timing_fields`.
fn budget_summary(breached: bool) -> BudgetSummary {
    BudgetSummary {
        max_tokens: 1,
        max_wall_ms: 0,
        tokens: 2,
        wall_ms: Some(1.0),
        breached,
        breach_limit: breached.then_some(BudgetLimit::Tokens),
        breach_token_index: breached.then_some(1),
    }
}

#[test]
fn fhr_timing_fields() {
    let normal = timing_summary(RtsMode::Normal, false);
    let warming = timing_summary(RtsMode::WarmingUp, false);
    let breach = timing_summary(RtsMode::Breach, true);
    let f = fhr_timing(Some(&normal), Some(&budget_summary(false)));
    assert_eq!(
        f,
        FhrTiming {
            rts_mode: RtsMode::Normal,
            latency_bucket: Some("le_10ms"),
            tig_breach: false
        }
    );
    assert_eq!(
        fhr_timing(Some(&warming), None).rts_mode,
        RtsMode::WarmingUp
    );
    let f = fhr_timing(Some(&breach), None);
    assert_eq!((f.rts_mode, f.tig_breach), (RtsMode::Breach, true));
    let f = fhr_timing(Some(&normal), Some(&budget_summary(true)));
    assert_eq!((f.rts_mode, f.tig_breach), (RtsMode::Breach, true));
    let f = fhr_timing(None, None);
    assert_eq!(
        (f.rts_mode, f.tig_breach, f.latency_bucket),
        (RtsMode::Off, false, None)
    );
    let f = fhr_timing(None, Some(&budget_summary(true)));
    assert_eq!((f.rts_mode, f.tig_breach), (RtsMode::Breach, true));
    // The same from the serialised summaries.
    let json = |s: &TimingSummary| serde_json::to_value(s).expect("valid");
    let bjson = |b: bool| serde_json::to_value(budget_summary(b)).expect("valid");
    for (l, b) in [
        (Some(&normal), Some(false)),
        (Some(&warming), None),
        (Some(&breach), Some(false)),
        (Some(&normal), Some(true)),
        (None, None),
        (None, Some(true)),
    ] {
        let from_json = fhr_timing_from_json(l.map(json).as_ref(), b.map(bjson).as_ref());
        assert_eq!(
            from_json,
            fhr_timing(l, b.map(budget_summary).as_ref()),
            "{l:?} {b:?}"
        );
    }
    let odd = serde_json::json!({"rts_mode": "weird", "tig_breach": true});
    assert_eq!(
        fhr_timing_from_json(Some(&odd), None).rts_mode,
        RtsMode::Off
    );
    let names: Vec<&str> = RtsMode::ALL.iter().map(|m| m.as_str()).collect();
    assert_eq!(names, ["normal", "warming_up", "breach", "off"]);
    assert_eq!(
        serde_json::to_value(RtsMode::WarmingUp).expect("valid"),
        "warming_up"
    );
}

fn assert_finite_summary(s: &TimingSummary) {
    for v in [
        s.cusum_up_max,
        s.cusum_down_max,
        s.ewma_up_max,
        s.ewma_down_max,
        s.baseline.mean_log_gap,
        s.baseline.var_within,
        s.baseline.var_between,
        s.turn_allowance_sd,
    ] {
        assert!(v.is_finite(), "{s:?}");
    }
}

fn arb_gap() -> impl Strategy<Value = u64> {
    prop_oneof![
        Just(0_u64),
        Just(1_u64),
        Just(u64::MAX),
        0_u64..1_000,
        0_u64..10_000_000_000,
        any::<u64>(),
    ]
}

fn arb_config() -> impl Strategy<Value = LatencyAnomalyConfig> {
    (
        prop_oneof![Just(Method::Cusum), Just(Method::Ewma)],
        prop_oneof![
            Just(Direction::Up),
            Just(Direction::Down),
            Just(Direction::Both)
        ],
        0.0..3.0_f64,
        0.01..20.0_f64,
        0.001..=1.0_f64,
        0.1..10.0_f64,
        (2_u64..50, 2_u64..5),
        1e-6..0.999_f64,
        1e-6..0.999_f64,
        0.0..5.0_f64,
        1e-6..1.0_f64,
    )
        .prop_map(
            |(
                method,
                direction,
                k,
                h,
                lambda,
                l,
                (warmup_samples, warmup_turns),
                baseline_alpha,
                turn_alpha,
                turn_allowance,
                min_sigma,
            )| {
                LatencyAnomalyConfig {
                    method,
                    direction,
                    k,
                    h,
                    lambda,
                    l,
                    warmup_samples,
                    warmup_turns,
                    baseline_alpha,
                    turn_alpha,
                    turn_allowance,
                    z_clip: k + 0.5,
                    min_sigma,
                }
            },
        )
}

/// The numbers behind the defaults (release: `cargo test --release -p haltd -- --ignored
/// tuning_table --nocapture`): false alarms per turn on several synthetic nodes, and
/// detection delays of step changes, for the defaults and a few alternatives.
#[test]
#[ignore = "prints a tuning table; run in release"]
fn tuning_table() {
    let d = LatencyAnomalyConfig::default();
    let configs = [
        ("defaults", d.clone()),
        ("k 0.5 h 8", LatencyAnomalyConfig { k: 0.5, ..d }),
        (
            "k 0.5 h 10",
            LatencyAnomalyConfig {
                k: 0.5,
                h: 10.0,
                ..d
            },
        ),
        (
            "allowance 0",
            LatencyAnomalyConfig {
                turn_allowance: 0.0,
                ..d
            },
        ),
        ("z_clip 5", LatencyAnomalyConfig { z_clip: 5.0, ..d }),
        (
            "ewma",
            LatencyAnomalyConfig {
                method: Method::Ewma,
                ..d
            },
        ),
    ];
    let nodes = [
        ("256", STATIONARY),
        (
            "1024",
            Node {
                turn_gaps: 1023,
                ..STATIONARY
            },
        ),
        (
            "4096",
            Node {
                turn_gaps: 4095,
                ..STATIONARY
            },
        ),
        (
            "256 spread 0.2",
            Node {
                between: 0.2,
                ..STATIONARY
            },
        ),
        (
            "256 spread 0.3",
            Node {
                between: 0.3,
                ..STATIONARY
            },
        ),
        (
            "256 outliers 1%",
            Node {
                outliers: 0.01,
                ..STATIONARY
            },
        ),
    ];
    for (name, cfg) in configs {
        let mut line = format!("{name:12}");
        for (node_name, node) in nodes {
            let turns = 2_000_000 / (node.turn_gaps + 1);
            let fa = false_alarm_rate(&cfg, node, turns, 5);
            line += &format!(" | fa[{node_name}] {:.2} %", fa * 100.0);
        }
        for f in [4.0, 2.0, 0.25] {
            let (m, mean, max) = delay_stats(&detection_delays(&cfg, f, 500, 3));
            line += &format!(" | x{f}: missed {m}, delay mean {mean:.1} max {max}");
        }
        eprintln!("{line}");
    }
}

proptest! {
    /// Arbitrary gaps (zeros, huge values, u64 overflow of the clock) in several turns,
    /// arbitrary valid configuration: every statistic and the baseline stay finite, the
    /// detector never answers `Failed`, and the summary serialises.
    #[test]
    fn statistics_stay_finite(
        cfg in arb_config(),
        turns in proptest::collection::vec(proptest::collection::vec(arb_gap(), 0..80), 1..6),
        clean in proptest::collection::vec(any::<bool>(), 6),
    ) {
        prop_assert_eq!(cfg.clone().validate(), Ok(cfg.clone()));
        let base = Arc::new(LatencyBaseline::new());
        for (t, gaps) in turns.into_iter().enumerate() {
            let mut d = LatencyAnomaly::new(&cfg, Arc::clone(&base));
            let mut now = 0_u64;
            for (i, g) in std::iter::once(0).chain(gaps).enumerate() {
                now = now.saturating_add(g);
                let f = d.observe(&tok(i as u64, now));
                prop_assert!(!matches!(f, Finding::Failed { .. }), "Failed: {:?}", f);
            }
            if clean[t] {
                d.end_of_turn(now);
            }
            let s = d.timing_summary();
            assert_finite_summary(&s);
            prop_assert!(s.mean_gap_ns.is_none() == (s.gaps == 0));
            prop_assert!(d.summary().is_object());
            let b = base.snapshot();
            prop_assert!(b.mean_log_gap.is_finite());
            prop_assert!(b.var_within.is_finite() && b.var_within >= 0.0);
            prop_assert!(b.var_between.is_finite() && b.var_between >= 0.0);
        }
    }

    /// Clocks that go backwards or jump are taken as they come (saturating), never a
    /// panic or a non-finite statistic; a budget breach, once there, holds.
    #[test]
    fn arbitrary_timestamps(
        stamps in proptest::collection::vec(any::<u64>(), 1..100),
        max_tokens in 0_u64..50,
        max_wall_ms in 0_u64..1_000_000,
    ) {
        let cfg = LatencyAnomalyConfig {
            warmup_samples: 2,
            warmup_turns: 2,
            ..LatencyAnomalyConfig::default()
        };
        let base = Arc::new(LatencyBaseline::new());
        run_turn(&cfg, &base, [10 * MS, 12 * MS, 9 * MS], true);
        run_turn(&cfg, &base, [11 * MS, 14 * MS, 8 * MS], true);
        let mut d = LatencyAnomaly::new(&cfg, Arc::clone(&base));
        let mut b = ComputeBudget::new(&ComputeBudgetConfig { max_tokens, max_wall_ms });
        let mut breached = false;
        for (i, &now) in stamps.iter().enumerate() {
            d.observe(&tok(i as u64, now));
            let f = b.observe(&tok(i as u64, now));
            prop_assert!(!breached || is_breach(&f), "breach did not hold");
            breached |= is_breach(&f);
            if max_tokens != 0 && i as u64 >= max_tokens {
                prop_assert!(breached);
            }
        }
        assert_finite_summary(&d.timing_summary());
        prop_assert_eq!(b.budget_summary().breached, breached);
    }

    /// Token budget: breach exactly from index max_tokens on, whatever the timing.
    #[test]
    fn budget_token_limit_is_exact(max_tokens in 1_u64..200, n in 0_u64..400) {
        let mut b = ComputeBudget::new(&ComputeBudgetConfig { max_tokens, max_wall_ms: 0 });
        for i in 0..n {
            prop_assert_eq!(is_breach(&b.observe(&tok(i, i))), i >= max_tokens);
        }
    }
}

/// Per-token cost of `observe` on the judged path (release: `cargo test --release -p haltd
/// -- --ignored per_token_cost --nocapture`). The `Clear` path does no allocation: it
/// touches only the detector's fields (the histogram is an inline array).
#[test]
#[ignore = "timing measurement; run in release"]
fn per_token_cost() {
    use std::time::Instant;
    let mut rng = StdRng::seed_from_u64(17);
    for method in [Method::Cusum, Method::Ewma] {
        let cfg = LatencyAnomalyConfig {
            method,
            ..LatencyAnomalyConfig::default()
        };
        let base = warmed(&cfg, &mut rng);
        const N: usize = 1 << 20;
        let stamps: Vec<u64> = {
            let mut now = 0_u64;
            (0..N)
                .map(|_| {
                    now += lognormal_gap(&mut rng, MEDIAN_NS, SIGMA);
                    now
                })
                .collect()
        };
        let mut samples = Vec::with_capacity(64);
        for _ in 0..64 {
            let mut d = LatencyAnomaly::new(&cfg, Arc::clone(&base));
            let chunk = N / 64;
            let start = Instant::now();
            let mut breaches = 0_u64;
            for (i, &now) in stamps.iter().take(chunk).enumerate() {
                breaches += u64::from(is_breach(&d.observe(&tok(i as u64, now))));
            }
            let ns = start.elapsed().as_nanos() as f64 / chunk as f64;
            samples.push(ns);
            std::hint::black_box((breaches, d.timing_summary()));
        }
        samples.sort_by(f64::total_cmp);
        // Chunks of 16384 tokens; the fastest chunk is the cost without interference from
        // other processes, the median the typical one.
        eprintln!(
            "latency_anomaly ({method:?}) observe: ns/token over 64 chunks: min {:.1}, \
             median {:.1}, max {:.1}",
            samples[0], samples[32], samples[63]
        );
        let mut b = ComputeBudget::new(&ComputeBudgetConfig {
            max_tokens: u64::MAX,
            max_wall_ms: ComputeBudgetConfig::MAX_WALL_MS,
        });
        let start = Instant::now();
        for (i, &now) in stamps.iter().enumerate() {
            std::hint::black_box(b.observe(&tok(i as u64, now)));
        }
        eprintln!(
            "compute_budget observe: {:.1} ns/token",
            start.elapsed().as_nanos() as f64 / N as f64
        );
    }
}
