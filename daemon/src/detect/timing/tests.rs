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

// Simulated turns shared by the latency tests and the tuning table.
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

mod budget;
mod latency;
mod props;
mod record;
