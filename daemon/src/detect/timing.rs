//! Timing detectors (issue 4 point 5; spec 000 §3.1, §6.1 and the AD-10 names): a per-turn
//! compute budget ([`ComputeBudget`], `COMPUTE_BUDGET_EXCEEDED`), an inter-token latency
//! anomaly detector against a baseline learned across turns ([`LatencyAnomaly`],
//! `TIMING_DISTRIBUTION_ANOMALY`), and the FHR timing fields `rts_mode`, `latency_bucket` and
//! `tig_breach` ([`fhr_timing`]).
//!
//! Everything here is pure and I/O-free: time comes in as [`TokenObs::now_ns`]
//! (`CLOCK_MONOTONIC`), never from a clock read here.
//!
//! # Lifecycle
//!
//! One detector value per turn: the data plane builds it when the turn starts, feeds it every
//! token, calls [`Detector::end_of_turn`] when the turn ended without a trip, and reads
//! [`Detector::summary`] for the turn record. The latency baseline outlives turns: it is one
//! [`LatencyBaseline`] per daemon (per token source), shared as an `Arc`.
//!
//! # The latency model
//!
//! The statistic is the natural log of the inter-token gap, `x = ln(max(gap_ns, 1 µs))`:
//! inter-token gaps are positive and right-skewed, close to lognormal, so their logs are close
//! to normal and a slow-down by a factor `f` is the same shift `ln f` at every base speed.
//! Gaps under 1 µs (tokens that arrived in the same read) are floored, so a zero gap has a
//! finite log. The first token of a turn has no gap (time to first token is not an
//! inter-token gap) and is not judged. Gaps are measured where the data plane stamps
//! `now_ns`, on arrival from the source: a transport that delivers tokens in bursts widens
//! the learned spread and so blunts the detector, it does not make it trip.
//!
//! **Baseline.** [`LatencyBaseline`] models a gap as `x = mu + b + e`: `mu` the node's level,
//! `b` the turn's own offset (a node's speed depends on its load, which differs from turn to
//! turn), `e` the token-to-token noise. It keeps an EWMA of `mu` and of the within-turn
//! variance `var(e)`, both with per-gap weight `baseline_alpha` (memory about
//! `1 / baseline_alpha` gaps whatever the turn lengths), an EWMA of the between-turn variance
//! `var(b)` with per-turn weight `turn_alpha`, and how many gaps and turns it has seen. A
//! turn folds in at its end as one block: with `n` gaps of mean `m` and variance `v`, weight
//! `w = 1 - (1 - baseline_alpha)^n` (at least `n / (seen + n)`, so the first turns give a
//! plain average instead of a pull towards the zero it started from); `mu += w (m - mu)`,
//! `var(e) += w (v - var(e))`, and `var(b)` moves towards `(m - mu)^2 - var(e) / n` (the
//! turn's offset with the noise of a mean of `n` gaps taken out).
//!
//! Only turns that ended cleanly teach the baseline: a turn is folded in by
//! [`Detector::end_of_turn`], which the data plane calls only for turns that were not tripped,
//! and only if this detector did not breach in it (observe mode included). A turn that was
//! dropped (tripped by any detector, cancelled, failed) never calls it and so leaves the
//! baseline as it was: a source that is slow on purpose cannot teach it that slow is normal
//! by tripping. Gaps are winsorised to the chart's clip (below) before they are folded in, so
//! one huge stall cannot blow up the variance.
//!
//! **Locking.** The baseline is a `Mutex` around five numbers. It is taken twice per turn:
//! once when the detector is built (a snapshot, which is then frozen for the turn) and once at
//! the end of a clean turn (the fold). Never per token: `observe` touches only the detector's
//! own fields, does not allocate on its `Clear` path (the gap histogram is an inline array),
//! and costs about 20 ns per token (the ignored `per_token_cost` test, release build). A
//! poisoned mutex is used as it is: the state is plain numbers, written in one assignment.
//!
//! **Warm-up.** Until the baseline has seen `warmup_samples` gaps and `warmup_turns` turns
//! the detector judges nothing: it answers `Clear` for every token (never `Failed`), still
//! learns from the turn, and its summary says `rts_mode = "warming_up"` with a note of how
//! far it got.
//!
//! **Per turn.** Each gap is standardised against the frozen baseline,
//! `z = (x - mu) / max(sd(e), min_sigma)`. A turn's level may sit up to
//! `a = turn_allowance * sd(b) / sd(e)` (standard deviations of `e`) from `mu` without
//! counting: that is the normal spread between turns. `z` is clipped to `± (z_clip + a)` and
//! fed to two charts, both starting at zero each turn:
//!
//! - a two-sided CUSUM, `S+ = max(0, S+ + z - a - k)`, `S- = max(0, S- - z - a - k)`; it
//!   breaches while `S > h`;
//! - an EWMA chart, `e = (1 - lambda) e + lambda z`; it breaches while `|e| - a` is past the
//!   exact (time-varying) limit `l * sqrt(lambda / (2 - lambda) * (1 - (1 - lambda)^(2t)))`.
//!
//! Both are computed (both show in the summary, for the dashboards' CUSUM/EWMA traces); the
//! configured `method` decides. `direction` says which side counts: `up` is latency going up
//! (a slow-down, a stall building up), `down` is latency going down (a speed-up), `both` is
//! either (a timing channel modulates both ways). The breach is not latched: the detector
//! reports `Breach` for every token while the statistic is past its limit, so the data
//! plane's debounce (K consecutive breaching tokens) applies as for any detector, and a turn
//! with any breaching token counts as `tig_breach`.
//!
//! **Defaults and why** (measured by the tests on lognormal gaps, log-sd 0.5, learned
//! baseline; `cargo test --release -p haltd -- --ignored tuning_table --nocapture` prints the
//! whole table). `method = "cusum"`: for a sustained step in the gap distribution
//! (throttling, a noisy neighbour, a modulated channel) CUSUM is the optimal sequential test
//! (Lorden, Moustakides) and its parameters read in standard deviations; the EWMA chart is
//! kept as an option (same false alarms, slower on moderate shifts). `k = 0.75, h = 8`: no
//! false alarm in 2000 stationary 256-token turns and about 0.3 % of 4096-token ones, while a
//! 4× slow-down or speed-up is caught within 8 tokens (mean 4.5). The textbook `k = 0.5,
//! h = 8` false-alarms on about 4.5 % of 1024-token and 21 % of 4096-token turns: turns of
//! reasoning models are long. `turn_allowance = 2.5`: without it, turns whose speed varies by
//! ±20 % (log-sd 0.2) between them false-alarm on over a third of turns; with it, on under
//! 0.5 %, at the price of a slower catch where the spread between turns is large (it is
//! learned: on a steady node the allowance is near zero). `lambda = 0.2, l = 4.5`: the EWMA
//! chart at a similar false-alarm rate. `direction = "both"`. `warmup_samples = 256` gaps and
//! `warmup_turns = 8` (the within spread is then known to about 5 %, the between spread
//! roughly). `baseline_alpha = 0.001` per gap (memory about 1000 gaps, a few turns) and
//! `turn_alpha = 0.05` per turn (about 20 turns): the baseline follows a node whose speed
//! changes over minutes (new model, new load) but not within a turn. `z_clip = 3`: one
//! outlier gap adds at most `z_clip - k = 2.25` to the CUSUM, so a single scheduler hiccup or
//! GC pause never trips alone (with 1 % of gaps 20× too long: no false alarm in 2000 turns,
//! against 3 % with a clip of 5). `min_sigma = 0.05`: a source with almost no jitter (the
//! built-in one is timer-driven) would otherwise make every microsecond of jitter look like
//! many standard deviations.
//!
//! # Compute budget
//!
//! [`ComputeBudget`] caps a turn's tokens (`max_tokens`) and wall time (`max_wall_ms`,
//! measured from the turn's first token, or from a start time given at construction such as
//! the request's arrival). It breaches on the first token past either limit: token number
//! `max_tokens + 1` (index `max_tokens`), or the first token that arrives more than
//! `max_wall_ms` after the start. It judges tokens, so a source that stalls and sends nothing
//! is the upstream deadlines' business; [`ComputeBudget::deadline_ns`] gives the instant a
//! caller can arm a timer for. `0` means unlimited for both.
//!
//! # FHR fields
//!
//! [`fhr_timing`] gives the record's `rts_mode`, `latency_bucket` and `tig_breach` from the
//! two detectors' summaries. `rts_mode` values ([`RtsMode`]):
//!
//! | value | meaning |
//! |---|---|
//! | `"normal"` | the latency detector judged the turn and found nothing, and no budget breach |
//! | `"warming_up"` | the latency baseline has seen too few gaps or turns: timing was not judged |
//! | `"breach"` | a timing detector (latency anomaly or compute budget) breached in this turn; `tig_breach` is true |
//! | `"off"` | the latency detector is off: timing was not judged |
//!
//! `runtime_mode` already says `full`/`degraded`, so `rts_mode` does not repeat it: it says
//! what the timing-integrity gate made of this turn. Records that are not about a turn
//! (lifecycle) keep `"normal"`.

use std::fmt;
use std::sync::{Arc, Mutex, PoisonError};

use serde::{Deserialize, Serialize};
use thiserror::Error;

use super::{Detector, DetectorId, Finding, TokenObs};
use crate::codes::FailureCode;

/// Every value [`latency_bucket`] gives.
pub const LATENCY_BUCKETS: [&str; 4] = ["le_1ms", "le_10ms", "le_100ms", "gt_100ms"];

/// Mean inter-token latency bucket of a turn (FHR `latency_bucket`): `le_1ms`, `le_10ms`,
/// `le_100ms` or `gt_100ms`.
pub fn latency_bucket(mean_gap_ns: u64) -> &'static str {
    match mean_gap_ns {
        0..=1_000_000 => "le_1ms",
        1_000_001..=10_000_000 => "le_10ms",
        10_000_001..=100_000_000 => "le_100ms",
        _ => "gt_100ms",
    }
}

/// Gaps are floored here before their log is taken: below it, tokens arrived together.
pub const GAP_FLOOR_NS: u64 = 1_000;

const NS_PER_MS: u64 = 1_000_000;

/// A configuration value out of range; `key` is the config key (`section.field`).
#[derive(Debug, Error, Clone, PartialEq, Eq)]
#[error("{key} = {value}: {expected}")]
pub struct TimingConfigError {
    pub key: &'static str,
    pub value: String,
    pub expected: &'static str,
}

fn check_f64(
    key: &'static str,
    value: f64,
    ok: bool,
    expected: &'static str,
) -> Result<(), TimingConfigError> {
    if value.is_finite() && ok {
        Ok(())
    } else {
        Err(TimingConfigError {
            key,
            value: value.to_string(),
            expected,
        })
    }
}

// ---------------------------------------------------------------------------------------
// Compute budget
// ---------------------------------------------------------------------------------------

/// `[detectors.compute_budget]`: the per-turn compute budget. `0` means unlimited.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ComputeBudgetConfig {
    /// Most tokens a turn may generate; token `max_tokens + 1` breaches. Default 0
    /// (unlimited).
    pub max_tokens: u64,
    /// Most wall time, in ms, from the turn's start (its first token unless the data plane
    /// gives the request's arrival) to a token; the first token later than that breaches.
    /// Default 0 (unlimited).
    pub max_wall_ms: u64,
}

impl ComputeBudgetConfig {
    /// Largest `max_wall_ms` whose value in ns fits a `u64` (about 584 years).
    pub const MAX_WALL_MS: u64 = u64::MAX / NS_PER_MS;

    pub fn validate(self) -> Result<Self, TimingConfigError> {
        if self.max_wall_ms > Self::MAX_WALL_MS {
            return Err(TimingConfigError {
                key: "detectors.compute_budget.max_wall_ms",
                value: self.max_wall_ms.to_string(),
                expected: "at most 18446744073709 (u64 nanoseconds); 0 means unlimited",
            });
        }
        Ok(self)
    }

    /// Whether neither limit is set (the detector can never breach).
    pub fn is_unlimited(&self) -> bool {
        self.max_tokens == 0 && self.max_wall_ms == 0
    }
}

/// Which limit a compute budget breach passed.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum BudgetLimit {
    Tokens,
    WallTime,
}

/// What [`ComputeBudget`] saw in a turn.
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct BudgetSummary {
    pub max_tokens: u64,
    pub max_wall_ms: u64,
    /// Tokens observed.
    pub tokens: u64,
    /// From the start to the last token observed; `None` before the first token.
    pub wall_ms: Option<f64>,
    pub breached: bool,
    pub breach_limit: Option<BudgetLimit>,
    pub breach_token_index: Option<u64>,
}

/// Per-turn compute budget in tokens and wall time (`COMPUTE_BUDGET_EXCEEDED`).
#[derive(Debug, Clone)]
pub struct ComputeBudget {
    max_tokens: u64,
    max_wall_ms: u64,
    /// `max_wall_ms` in ns; 0 = unlimited.
    max_wall_ns: u64,
    start_ns: Option<u64>,
    tokens: u64,
    last_ns: Option<u64>,
    breach: Option<(BudgetLimit, u64)>,
}

impl ComputeBudget {
    /// A budget whose wall time runs from the turn's first token.
    pub fn new(cfg: &ComputeBudgetConfig) -> Self {
        Self {
            max_tokens: cfg.max_tokens,
            max_wall_ms: cfg.max_wall_ms,
            max_wall_ns: cfg.max_wall_ms.saturating_mul(NS_PER_MS),
            start_ns: None,
            tokens: 0,
            last_ns: None,
            breach: None,
        }
    }

    /// A budget whose wall time runs from `start_ns` (`CLOCK_MONOTONIC`, e.g. when the
    /// request arrived), so time to the first token counts.
    pub fn starting_at(cfg: &ComputeBudgetConfig, start_ns: u64) -> Self {
        Self {
            start_ns: Some(start_ns),
            ..Self::new(cfg)
        }
    }

    /// The last instant (`CLOCK_MONOTONIC` ns) a token may arrive within the wall budget;
    /// `None` when unlimited or not started yet. For a caller that wants a timer too.
    pub fn deadline_ns(&self) -> Option<u64> {
        if self.max_wall_ns == 0 {
            return None;
        }
        self.start_ns.map(|s| s.saturating_add(self.max_wall_ns))
    }

    pub fn budget_summary(&self) -> BudgetSummary {
        let wall_ms = match (self.start_ns, self.last_ns) {
            (Some(s), Some(l)) => Some(l.saturating_sub(s) as f64 / NS_PER_MS as f64),
            _ => None,
        };
        BudgetSummary {
            max_tokens: self.max_tokens,
            max_wall_ms: self.max_wall_ms,
            tokens: self.tokens,
            wall_ms,
            breached: self.breach.is_some(),
            breach_limit: self.breach.map(|(l, _)| l),
            breach_token_index: self.breach.map(|(_, i)| i),
        }
    }

    fn detail(&self, limit: BudgetLimit, index: u64, now_ns: u64) -> String {
        match limit {
            BudgetLimit::Tokens => format!(
                "token budget: token {} is past max_tokens {}",
                index.saturating_add(1),
                self.max_tokens
            ),
            BudgetLimit::WallTime => {
                let elapsed = now_ns.saturating_sub(self.start_ns.unwrap_or(now_ns));
                format!(
                    "wall-time budget: token {} arrived {:.3} ms after the turn's start, past \
                     max_wall_ms {}",
                    index.saturating_add(1),
                    elapsed as f64 / NS_PER_MS as f64,
                    self.max_wall_ms
                )
            }
        }
    }
}

impl Detector for ComputeBudget {
    fn id(&self) -> DetectorId {
        DetectorId::ComputeBudget
    }

    fn code(&self) -> FailureCode {
        FailureCode::ComputeBudgetExceeded
    }

    fn observe(&mut self, tok: &TokenObs<'_>) -> Finding {
        self.tokens = self.tokens.saturating_add(1);
        self.last_ns = Some(tok.now_ns);
        let start = *self.start_ns.get_or_insert(tok.now_ns);
        if let Some((limit, index)) = self.breach {
            // The condition holds for every later token of the turn.
            return Finding::Breach {
                detail: self.detail(limit, index.max(tok.index), tok.now_ns),
            };
        }
        let limit = if self.max_tokens != 0 && tok.index >= self.max_tokens {
            BudgetLimit::Tokens
        } else if self.max_wall_ns != 0 && tok.now_ns.saturating_sub(start) > self.max_wall_ns {
            BudgetLimit::WallTime
        } else {
            return Finding::Clear;
        };
        self.breach = Some((limit, tok.index));
        Finding::Breach {
            detail: self.detail(limit, tok.index, tok.now_ns),
        }
    }

    fn summary(&self) -> serde_json::Value {
        serde_json::to_value(self.budget_summary()).unwrap_or(serde_json::Value::Null)
    }
}

// ---------------------------------------------------------------------------------------
// Latency anomaly: configuration
// ---------------------------------------------------------------------------------------

/// Which chart decides a latency breach.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Method {
    /// Two-sided CUSUM on standardised log-gaps (`k`, `h`).
    #[default]
    Cusum,
    /// EWMA control chart on standardised log-gaps (`lambda`, `l`).
    Ewma,
}

/// Which change of the inter-token latency counts.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Direction {
    /// Latency up: tokens slower than the baseline (slow-down, stall building up).
    Up,
    /// Latency down: tokens faster than the baseline (speed-up).
    Down,
    /// Either (a timing channel modulates both ways).
    #[default]
    Both,
}

impl Direction {
    fn up(self) -> bool {
        matches!(self, Direction::Up | Direction::Both)
    }

    fn down(self) -> bool {
        matches!(self, Direction::Down | Direction::Both)
    }
}

/// `[detectors.latency_anomaly]`: inter-token latency anomaly against a learned baseline.
/// Units: `k`, `h`, `l`, `z_clip` are in standard deviations of the log-gap within a turn,
/// `turn_allowance` in standard deviations of turns' levels, `min_sigma` in log units (0.05 ≈
/// 5 % jitter). The module documentation explains the model and the defaults.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct LatencyAnomalyConfig {
    /// `"cusum"` (default) or `"ewma"`: which chart decides.
    pub method: Method,
    /// `"up"` (slow-down), `"down"` (speed-up) or `"both"` (default).
    pub direction: Direction,
    /// CUSUM reference value (allowance per gap), default 0.75.
    pub k: f64,
    /// CUSUM decision threshold, default 8.
    pub h: f64,
    /// EWMA smoothing weight in (0, 1], default 0.2.
    pub lambda: f64,
    /// EWMA control-limit width, default 4.5.
    pub l: f64,
    /// Gaps the baseline must have seen before the detector judges, default 256 (at least 2).
    pub warmup_samples: u64,
    /// Clean turns the baseline must have seen before the detector judges, default 8 (at
    /// least 2: the spread between turns needs two).
    pub warmup_turns: u64,
    /// Per-gap weight of the baseline's mean and within-turn variance, in (0, 1), default
    /// 0.001 (memory ≈ 1000 gaps).
    pub baseline_alpha: f64,
    /// Per-turn weight of the baseline's between-turn variance, in (0, 1), default 0.05
    /// (memory ≈ 20 turns).
    pub turn_alpha: f64,
    /// How far a whole turn's level may sit from the baseline's mean without counting, in
    /// between-turn standard deviations, default 2.5 (≥ 0).
    pub turn_allowance: f64,
    /// Standardised gaps beyond the turn allowance are clipped to this, default 3 (must be
    /// above `k`).
    pub z_clip: f64,
    /// Floor of the baseline's within-turn standard deviation of log-gaps, default 0.05.
    pub min_sigma: f64,
}

impl Default for LatencyAnomalyConfig {
    fn default() -> Self {
        Self {
            method: Method::Cusum,
            direction: Direction::Both,
            k: 0.75,
            h: 8.0,
            lambda: 0.2,
            l: 4.5,
            warmup_samples: 256,
            warmup_turns: 8,
            baseline_alpha: 0.001,
            turn_alpha: 0.05,
            turn_allowance: 2.5,
            z_clip: 3.0,
            min_sigma: 0.05,
        }
    }
}

impl LatencyAnomalyConfig {
    pub fn validate(self) -> Result<Self, TimingConfigError> {
        check_f64(
            "detectors.latency_anomaly.k",
            self.k,
            self.k >= 0.0,
            "a finite number >= 0",
        )?;
        check_f64(
            "detectors.latency_anomaly.h",
            self.h,
            self.h > 0.0,
            "a finite number > 0",
        )?;
        check_f64(
            "detectors.latency_anomaly.lambda",
            self.lambda,
            self.lambda > 0.0 && self.lambda <= 1.0,
            "a number in (0, 1]",
        )?;
        check_f64(
            "detectors.latency_anomaly.l",
            self.l,
            self.l > 0.0,
            "a finite number > 0",
        )?;
        if self.warmup_samples < 2 {
            return Err(TimingConfigError {
                key: "detectors.latency_anomaly.warmup_samples",
                value: self.warmup_samples.to_string(),
                expected: "at least 2 (a variance needs two gaps)",
            });
        }
        check_f64(
            "detectors.latency_anomaly.baseline_alpha",
            self.baseline_alpha,
            self.baseline_alpha > 0.0 && self.baseline_alpha < 1.0,
            "a number in (0, 1)",
        )?;
        if self.warmup_turns < 2 {
            return Err(TimingConfigError {
                key: "detectors.latency_anomaly.warmup_turns",
                value: self.warmup_turns.to_string(),
                expected: "at least 2 (the spread between turns needs two)",
            });
        }
        check_f64(
            "detectors.latency_anomaly.turn_alpha",
            self.turn_alpha,
            self.turn_alpha > 0.0 && self.turn_alpha < 1.0,
            "a number in (0, 1)",
        )?;
        check_f64(
            "detectors.latency_anomaly.turn_allowance",
            self.turn_allowance,
            self.turn_allowance >= 0.0,
            "a finite number >= 0",
        )?;
        check_f64(
            "detectors.latency_anomaly.z_clip",
            self.z_clip,
            self.z_clip > self.k,
            "a finite number above k",
        )?;
        check_f64(
            "detectors.latency_anomaly.min_sigma",
            self.min_sigma,
            self.min_sigma > 0.0,
            "a finite number > 0",
        )?;
        Ok(self)
    }
}

// ---------------------------------------------------------------------------------------
// Latency anomaly: the baseline shared between turns
// ---------------------------------------------------------------------------------------

/// The baseline's state, in log inter-token gaps (ln ns): an EWMA mean, the EWMA variance
/// of gaps within a turn, and the EWMA variance of turns' mean levels around the mean.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize)]
pub struct BaselineSnapshot {
    /// Gaps folded in so far (saturating); compared with `warmup_samples`.
    pub samples: u64,
    /// Turns folded in so far; compared with `warmup_turns`.
    pub turns: u64,
    pub mean_log_gap: f64,
    /// Variance of log-gaps around their turn's level.
    pub var_within: f64,
    /// Variance of turns' mean log-gaps around `mean_log_gap` (sampling noise removed).
    pub var_between: f64,
}

impl BaselineSnapshot {
    pub fn sd_within(&self) -> f64 {
        self.var_within.max(0.0).sqrt()
    }

    pub fn sd_between(&self) -> f64 {
        self.var_between.max(0.0).sqrt()
    }

    /// The baseline's typical gap, `exp(mean_log_gap)` (the median of a lognormal), in ns.
    pub fn median_gap_ns(&self) -> f64 {
        self.mean_log_gap.exp()
    }

    /// This baseline with a clean turn's gaps folded in (see the module documentation).
    fn folded(self, turn: &LogGapStats, alpha: f64, turn_alpha: f64) -> Self {
        if turn.n == 0 {
            return self;
        }
        let n = turn.n as f64;
        let turn_var = (turn.m2 / n).max(0.0);
        let (mean, var_within, var_between) = if self.turns == 0 {
            (turn.mean, turn_var, 0.0)
        } else {
            let ewma_w = -((n * (-alpha).ln_1p()).exp_m1());
            let plain_w = n / (self.samples as f64 + n);
            let w = ewma_w.max(plain_w).clamp(0.0, 1.0);
            let d = turn.mean - self.mean_log_gap;
            // The turn's level is off by its own offset plus the noise of a mean of n gaps.
            let offset2 = (d * d - self.var_within / n).max(0.0);
            let wb = turn_alpha.max(1.0 / self.turns as f64).clamp(0.0, 1.0);
            (
                self.mean_log_gap + w * d,
                self.var_within + w * (turn_var - self.var_within),
                self.var_between + wb * (offset2 - self.var_between),
            )
        };
        if !(mean.is_finite() && var_within.is_finite() && var_between.is_finite()) {
            return self; // cannot happen for finite inputs; never store a non-finite baseline
        }
        Self {
            samples: self.samples.saturating_add(turn.n),
            turns: self.turns.saturating_add(1),
            mean_log_gap: mean,
            var_within: var_within.max(0.0),
            var_between: var_between.max(0.0),
        }
    }
}

/// The inter-token latency baseline, learned across the clean turns of the daemon. One per
/// token source, shared by every turn's [`LatencyAnomaly`] through an `Arc`. The mutex is
/// taken twice per turn (snapshot at the start, fold at a clean end), never per token.
#[derive(Debug, Default)]
pub struct LatencyBaseline {
    state: Mutex<BaselineSnapshot>,
}

impl LatencyBaseline {
    pub fn new() -> Self {
        Self::default()
    }

    /// The current baseline (for metrics and the admin API too).
    pub fn snapshot(&self) -> BaselineSnapshot {
        *self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Forgets everything: the detector warms up again (e.g. after the source changed).
    pub fn reset(&self) {
        *self.state.lock().unwrap_or_else(PoisonError::into_inner) = BaselineSnapshot::default();
    }

    fn fold(&self, turn: &LogGapStats, alpha: f64, turn_alpha: f64) {
        let mut state = self.state.lock().unwrap_or_else(PoisonError::into_inner);
        *state = state.folded(turn, alpha, turn_alpha);
    }
}

/// Welford running mean and sum of squared deviations of one turn's log-gaps.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
struct LogGapStats {
    n: u64,
    mean: f64,
    m2: f64,
}

impl LogGapStats {
    fn push(&mut self, x: f64) {
        self.n = self.n.saturating_add(1);
        let d = x - self.mean;
        self.mean += d / self.n as f64;
        self.m2 += d * (x - self.mean);
    }
}

// ---------------------------------------------------------------------------------------
// Latency anomaly: the per-turn detector
// ---------------------------------------------------------------------------------------

/// Sub-buckets per octave of the gap histogram (p99 to within 2^(1/8) ≈ 9 %).
const HIST_SUB: f64 = 8.0;
/// log2 of the lowest bucket's lower edge (512 ns, below [`GAP_FLOOR_NS`]).
const HIST_MIN_LOG2: f64 = 9.0;
/// Buckets from 2^9 ns to 2^64 ns.
const HIST_BUCKETS: usize = 441;

/// Fixed log-scale histogram of a turn's gaps: no allocation per token.
#[derive(Clone)]
struct GapHistogram([u32; HIST_BUCKETS]);

impl GapHistogram {
    fn bucket(log2_gap: f64) -> usize {
        let b = ((log2_gap - HIST_MIN_LOG2) * HIST_SUB).floor();
        // `as` saturates (NaN to 0); the clamp keeps the index in range.
        (b.max(0.0) as usize).min(HIST_BUCKETS - 1)
    }

    fn add(&mut self, log2_gap: f64) {
        let c = &mut self.0[Self::bucket(log2_gap)];
        *c = c.saturating_add(1);
    }

    /// Upper edge (ns) of the bucket holding the `q` quantile of `n` gaps.
    fn quantile_ns(&self, q: f64, n: u64) -> Option<u64> {
        if n == 0 {
            return None;
        }
        let rank = ((q * n as f64).ceil() as u64).clamp(1, n);
        let mut seen = 0_u64;
        for (i, c) in self.0.iter().enumerate() {
            seen += u64::from(*c);
            if seen >= rank {
                let edge = ((i + 1) as f64 / HIST_SUB + HIST_MIN_LOG2).exp2();
                return Some(edge.min(u64::MAX as f64) as u64);
            }
        }
        None
    }
}

impl fmt::Debug for GapHistogram {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let n: u64 = self.0.iter().map(|c| u64::from(*c)).sum();
        write!(f, "GapHistogram({n} gaps)")
    }
}

/// What the timing-integrity gate made of a turn (FHR `rts_mode`; module documentation).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum RtsMode {
    Normal,
    WarmingUp,
    Breach,
    Off,
}

impl RtsMode {
    pub const ALL: [RtsMode; 4] = [
        RtsMode::Normal,
        RtsMode::WarmingUp,
        RtsMode::Breach,
        RtsMode::Off,
    ];

    pub fn parse(s: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|m| m.as_str() == s)
    }

    pub const fn as_str(self) -> &'static str {
        match self {
            RtsMode::Normal => "normal",
            RtsMode::WarmingUp => "warming_up",
            RtsMode::Breach => "breach",
            RtsMode::Off => "off",
        }
    }
}

impl fmt::Display for RtsMode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// What [`LatencyAnomaly`] saw in a turn ([`Detector::summary`] serialises it).
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct TimingSummary {
    /// `normal`, `warming_up` or `breach` (this detector's part of FHR `rts_mode`).
    pub rts_mode: RtsMode,
    /// Bucket of the mean gap ([`latency_bucket`]); `None` for a turn with under two tokens.
    pub latency_bucket: Option<&'static str>,
    /// A latency breach happened in this turn (any token, any mode).
    pub tig_breach: bool,
    /// Whether the baseline was warm, i.e. the turn was judged.
    pub judged: bool,
    /// Set while warming up: how far the baseline got.
    pub note: Option<String>,
    pub method: Method,
    pub direction: Direction,
    pub tokens: u64,
    pub gaps: u64,
    pub mean_gap_ns: Option<u64>,
    /// Upper edge of the histogram bucket (≈ 9 % wide) holding the 99th percentile.
    pub p99_gap_ns: Option<u64>,
    pub max_gap_ns: Option<u64>,
    /// Largest CUSUM values of the turn (standard deviations; `h` is the limit).
    pub cusum_up_max: f64,
    pub cusum_down_max: f64,
    /// Largest EWMA excursions of the turn as a fraction of the control limit (1 = on it).
    pub ewma_up_max: f64,
    pub ewma_down_max: f64,
    /// The dead zone of both charts for this turn, in within-turn standard deviations.
    pub turn_allowance_sd: f64,
    /// Tokens for which this detector answered `Breach`.
    pub breaches: u64,
    pub first_breach_index: Option<u64>,
    /// The baseline the turn was judged against (frozen when the turn started).
    pub baseline: BaselineSnapshot,
}

/// Inter-token latency anomaly against a learned baseline (`TIMING_DISTRIBUTION_ANOMALY`).
/// One per turn; see the module documentation.
#[derive(Debug)]
pub struct LatencyAnomaly {
    cfg: LatencyAnomalyConfig,
    baseline: Arc<LatencyBaseline>,
    snap: BaselineSnapshot,
    warm: bool,
    mu: f64,
    inv_sd: f64,
    /// The turn allowance in within-turn standard deviations, `turn_allowance * sd_between /
    /// sd_within`: the dead zone of both charts.
    allow: f64,
    /// Clip of the standardised gap, `z_clip + allow`.
    zc: f64,
    /// Winsorising bounds for the fold, `mu ± zc * sd`.
    lo: f64,
    hi: f64,
    /// `(1 - lambda)^2`, and its running power `(1 - lambda)^(2t)` (0 once negligible).
    ewma_r2: f64,
    ewma_r2_pow: f64,
    ewma_var_inf: f64,
    /// `1 / limit` of the EWMA chart at the current gap.
    ewma_inv_limit: f64,

    tokens: u64,
    prev_ns: Option<u64>,
    gap_sum_ns: u128,
    max_gap_ns: u64,
    hist: GapHistogram,
    turn: LogGapStats,

    cusum_up: f64,
    cusum_down: f64,
    cusum_up_max: f64,
    cusum_down_max: f64,
    ewma: f64,
    ewma_up_max: f64,
    ewma_down_max: f64,
    breaches: u64,
    first_breach_index: Option<u64>,
    ended: bool,
}

impl LatencyAnomaly {
    /// A detector for one turn, judging against a snapshot of `baseline` taken now.
    /// `cfg` should have passed [`LatencyAnomalyConfig::validate`].
    pub fn new(cfg: &LatencyAnomalyConfig, baseline: Arc<LatencyBaseline>) -> Self {
        let snap = baseline.snapshot();
        // The last floor only matters for a config that skipped validate (min_sigma 0).
        let sd = snap.sd_within().max(cfg.min_sigma).max(1e-9);
        let allow = cfg.turn_allowance * snap.sd_between() / sd;
        let zc = cfg.z_clip + allow;
        let one_minus = 1.0 - cfg.lambda;
        Self {
            cfg: cfg.clone(),
            baseline,
            snap,
            warm: snap.samples >= cfg.warmup_samples && snap.turns >= cfg.warmup_turns,
            mu: snap.mean_log_gap,
            inv_sd: 1.0 / sd,
            allow,
            zc,
            lo: snap.mean_log_gap - zc * sd,
            hi: snap.mean_log_gap + zc * sd,
            ewma_r2: one_minus * one_minus,
            ewma_r2_pow: 1.0,
            ewma_var_inf: cfg.lambda / (2.0 - cfg.lambda),
            ewma_inv_limit: 0.0,
            tokens: 0,
            prev_ns: None,
            gap_sum_ns: 0,
            max_gap_ns: 0,
            hist: GapHistogram([0; HIST_BUCKETS]),
            turn: LogGapStats::default(),
            cusum_up: 0.0,
            cusum_down: 0.0,
            cusum_up_max: 0.0,
            cusum_down_max: 0.0,
            ewma: 0.0,
            ewma_up_max: 0.0,
            ewma_down_max: 0.0,
            breaches: 0,
            first_breach_index: None,
            ended: false,
        }
    }

    fn gaps(&self) -> u64 {
        self.tokens.saturating_sub(1)
    }

    pub fn timing_summary(&self) -> TimingSummary {
        let gaps = self.gaps();
        let mean_gap_ns = (gaps > 0)
            .then(|| u64::try_from(self.gap_sum_ns / u128::from(gaps)).unwrap_or(u64::MAX));
        let rts_mode = if self.breaches > 0 {
            RtsMode::Breach
        } else if !self.warm {
            RtsMode::WarmingUp
        } else {
            RtsMode::Normal
        };
        let note = (!self.warm).then(|| {
            format!(
                "warming up: baseline has {} of {} gaps, {} of {} turns",
                self.snap.samples, self.cfg.warmup_samples, self.snap.turns, self.cfg.warmup_turns
            )
        });
        TimingSummary {
            rts_mode,
            latency_bucket: mean_gap_ns.map(latency_bucket),
            tig_breach: self.breaches > 0,
            judged: self.warm,
            note,
            method: self.cfg.method,
            direction: self.cfg.direction,
            tokens: self.tokens,
            gaps,
            mean_gap_ns,
            p99_gap_ns: self
                .hist
                .quantile_ns(0.99, gaps)
                .map(|p| p.min(self.max_gap_ns)),
            max_gap_ns: (gaps > 0).then_some(self.max_gap_ns),
            cusum_up_max: self.cusum_up_max,
            cusum_down_max: self.cusum_down_max,
            ewma_up_max: self.ewma_up_max,
            ewma_down_max: self.ewma_down_max,
            turn_allowance_sd: self.allow,
            breaches: self.breaches,
            first_breach_index: self.first_breach_index,
            baseline: self.snap,
        }
    }

    #[cold]
    fn breach(&mut self, index: u64, up: bool, stat: f64, gap_ns: u64) -> Finding {
        self.breaches += 1;
        self.first_breach_index.get_or_insert(index);
        let (what, limit) = match self.cfg.method {
            Method::Cusum => ("CUSUM", self.cfg.h),
            Method::Ewma => ("EWMA/limit", 1.0),
        };
        Finding::Breach {
            detail: format!(
                "inter-token latency {}: {what} {stat:.2} > {limit} after {} gaps (last gap \
                 {:.3} ms; baseline median {:.3} ms, log-sd within {:.3}, between {:.3})",
                if up { "up" } else { "down" },
                self.gaps(),
                gap_ns as f64 / NS_PER_MS as f64,
                self.snap.median_gap_ns() / NS_PER_MS as f64,
                self.snap.sd_within(),
                self.snap.sd_between(),
            ),
        }
    }
}

impl Detector for LatencyAnomaly {
    fn id(&self) -> DetectorId {
        DetectorId::LatencyAnomaly
    }

    fn code(&self) -> FailureCode {
        FailureCode::TimingDistributionAnomaly
    }

    fn observe(&mut self, tok: &TokenObs<'_>) -> Finding {
        self.tokens = self.tokens.saturating_add(1);
        let Some(prev) = self.prev_ns.replace(tok.now_ns) else {
            return Finding::Clear; // the first token has no gap
        };
        let gap = tok.now_ns.saturating_sub(prev);
        self.gap_sum_ns = self.gap_sum_ns.saturating_add(u128::from(gap));
        self.max_gap_ns = self.max_gap_ns.max(gap);
        let x = (gap.max(GAP_FLOOR_NS) as f64).ln();
        self.hist.add(x * std::f64::consts::LOG2_E);
        if !self.warm {
            self.turn.push(x);
            return Finding::Clear;
        }
        self.turn.push(x.clamp(self.lo, self.hi));

        let c = &self.cfg;
        let z = ((x - self.mu) * self.inv_sd).clamp(-self.zc, self.zc);
        let slack = c.k + self.allow;
        self.cusum_up = (self.cusum_up + z - slack).max(0.0);
        self.cusum_down = (self.cusum_down - z - slack).max(0.0);
        self.cusum_up_max = self.cusum_up_max.max(self.cusum_up);
        self.cusum_down_max = self.cusum_down_max.max(self.cusum_down);

        self.ewma += c.lambda * (z - self.ewma);
        if self.ewma_r2_pow != 0.0 {
            // The limit widens to its asymptote within a few dozen gaps; after that it is a
            // constant and costs no square root or division per gap.
            self.ewma_r2_pow *= self.ewma_r2;
            if self.ewma_r2_pow < 1e-12 {
                self.ewma_r2_pow = 0.0;
            }
            let limit = c.l * (self.ewma_var_inf * (1.0 - self.ewma_r2_pow)).sqrt();
            // > 0 from the first gap on (lambda > 0); max() guards a zero anyway.
            self.ewma_inv_limit = 1.0 / limit.max(f64::MIN_POSITIVE);
        }
        let up_ratio = (self.ewma - self.allow) * self.ewma_inv_limit;
        let down_ratio = (-self.ewma - self.allow) * self.ewma_inv_limit;
        self.ewma_up_max = self.ewma_up_max.max(up_ratio);
        self.ewma_down_max = self.ewma_down_max.max(down_ratio);

        let (up, down, limit) = match c.method {
            Method::Cusum => (self.cusum_up, self.cusum_down, c.h),
            Method::Ewma => (up_ratio, down_ratio, 1.0),
        };
        if up > limit && c.direction.up() {
            return self.breach(tok.index, true, up, gap);
        }
        if down > limit && c.direction.down() {
            return self.breach(tok.index, false, down, gap);
        }
        Finding::Clear
    }

    /// Folds this turn into the baseline, unless this detector breached in it.
    fn end_of_turn(&mut self, _now_ns: u64) -> Finding {
        if !self.ended && self.breaches == 0 {
            self.baseline
                .fold(&self.turn, self.cfg.baseline_alpha, self.cfg.turn_alpha);
        }
        self.ended = true;
        Finding::Clear
    }

    fn summary(&self) -> serde_json::Value {
        serde_json::to_value(self.timing_summary()).unwrap_or(serde_json::Value::Null)
    }
}

// ---------------------------------------------------------------------------------------
// FHR timing fields
// ---------------------------------------------------------------------------------------

/// The FHR timing fields of a turn record.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct FhrTiming {
    pub rts_mode: RtsMode,
    /// `None` when the latency detector is off or the turn had under two tokens: the caller
    /// then keeps its own ([`latency_bucket`] of its gap sum).
    pub latency_bucket: Option<&'static str>,
    pub tig_breach: bool,
}

/// `rts_mode`, `latency_bucket` and `tig_breach` from the turn's timing detectors (`None`:
/// that detector is off). `tig_breach` is true when either breached in the turn, in any mode.
pub fn fhr_timing(latency: Option<&TimingSummary>, budget: Option<&BudgetSummary>) -> FhrTiming {
    combine(
        latency.map(|l| (l.rts_mode, l.latency_bucket, l.tig_breach)),
        budget.is_some_and(|b| b.breached),
    )
}

/// [`fhr_timing`] from the detectors' serialised summaries ([`Detector::summary`], e.g. the
/// `summary` members of the turn's detector set), for a caller that holds them as
/// `Box<dyn Detector>`. A latency summary whose `rts_mode` is not one of ours counts as off.
pub fn fhr_timing_from_json(
    latency: Option<&serde_json::Value>,
    budget: Option<&serde_json::Value>,
) -> FhrTiming {
    let latency = latency.and_then(|v| {
        let mode = RtsMode::parse(v.get("rts_mode")?.as_str()?)?;
        let bucket = v
            .get("latency_bucket")
            .and_then(|b| b.as_str())
            .and_then(|b| LATENCY_BUCKETS.into_iter().find(|k| *k == b));
        let breach = v.get("tig_breach").and_then(|b| b.as_bool()) == Some(true);
        Some((mode, bucket, breach))
    });
    let budget_breach = budget.and_then(|v| v.get("breached")?.as_bool()) == Some(true);
    combine(latency, budget_breach)
}

fn combine(
    latency: Option<(RtsMode, Option<&'static str>, bool)>,
    budget_breach: bool,
) -> FhrTiming {
    let tig_breach = budget_breach || latency.is_some_and(|(_, _, b)| b);
    let rts_mode = match latency {
        _ if tig_breach => RtsMode::Breach,
        None => RtsMode::Off,
        Some((mode, _, _)) => mode,
    };
    FhrTiming {
        rts_mode,
        latency_bucket: latency.and_then(|(_, b, _)| b),
        tig_breach,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
            serde_json::from_str(r#"{"method": "ewma", "direction": "up", "h": 5}"#)
                .expect("valid");
        assert_eq!(cfg.method, Method::Ewma);
        assert_eq!(cfg.direction, Direction::Up);
        assert_eq!(cfg.h, 5.0);
        assert_eq!(cfg.k, d.k);
        assert!(serde_json::from_str::<LatencyAnomalyConfig>(r#"{"window": 3}"#).is_err());
        assert!(serde_json::from_str::<LatencyAnomalyConfig>(r#"{"method": "pr"}"#).is_err());
        let back: LatencyAnomalyConfig =
            serde_json::from_value(serde_json::to_value(&d).expect("valid")).expect("valid");
        assert_eq!(back, d);

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
        eprintln!(
            "cusum, gaps x4 from token 20: missed {missed}/500, delay mean {mean:.2} max {max}"
        );
        // A false alarm before the change counts as a miss here; allow for the rare one.
        assert!(missed <= 5, "missed {missed}");
        assert!(max <= 15, "max delay {max}");
    }

    #[test]
    fn cusum_detects_fourfold_speedup_within_15_tokens() {
        let cfg = LatencyAnomalyConfig::default();
        let delays = detection_delays(&cfg, 0.25, 500, 0x5eed_0004);
        let (missed, mean, max) = delay_stats(&delays);
        eprintln!(
            "cusum, gaps /4 from token 20: missed {missed}/500, delay mean {mean:.2} max {max}"
        );
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
        eprintln!(
            "ewma, gaps x4 from token 20: missed {missed}/500, delay mean {mean:.2} max {max}"
        );
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

    #[test]
    fn fhr_timing_fields() {
        let summary = |rts_mode, tig_breach| TimingSummary {
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
        };
        let budget = |breached| BudgetSummary {
            max_tokens: 1,
            max_wall_ms: 0,
            tokens: 2,
            wall_ms: Some(1.0),
            breached,
            breach_limit: breached.then_some(BudgetLimit::Tokens),
            breach_token_index: breached.then_some(1),
        };
        let normal = summary(RtsMode::Normal, false);
        let warming = summary(RtsMode::WarmingUp, false);
        let breach = summary(RtsMode::Breach, true);
        let f = fhr_timing(Some(&normal), Some(&budget(false)));
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
        let f = fhr_timing(Some(&normal), Some(&budget(true)));
        assert_eq!((f.rts_mode, f.tig_breach), (RtsMode::Breach, true));
        let f = fhr_timing(None, None);
        assert_eq!(
            (f.rts_mode, f.tig_breach, f.latency_bucket),
            (RtsMode::Off, false, None)
        );
        let f = fhr_timing(None, Some(&budget(true)));
        assert_eq!((f.rts_mode, f.tig_breach), (RtsMode::Breach, true));
        // The same from the serialised summaries.
        let json = |s: &TimingSummary| serde_json::to_value(s).expect("valid");
        let bjson = |b: bool| serde_json::to_value(budget(b)).expect("valid");
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
                fhr_timing(l, b.map(budget).as_ref()),
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
}
