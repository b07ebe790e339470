//! The inter-token latency anomaly detector, its shared baseline and the timing summary a
//! turn record carries.

use std::fmt;
use std::sync::{Arc, Mutex, PoisonError};

use serde::{Deserialize, Serialize};

use crate::{
    codes::FailureCode,
    detect::{
        timing::common::{check_f64, latency_bucket, TimingConfigError, GAP_FLOOR_NS, NS_PER_MS},
        Detector, DetectorId, Finding, TokenObs,
    },
};

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
/// Buckets from 2^9 ns to 2^41 ns (about 37 minutes, longer than any gap a turn can live
/// through: longer gaps count in the top bucket). Every open stream carries one: 1 KiB.
const HIST_BUCKETS: usize = 256;

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

    /// This detector's part of `rts_mode` now: a breach, else whether it judges at all.
    fn rts_mode(&self) -> RtsMode {
        if self.breaches > 0 {
            RtsMode::Breach
        } else if !self.warm {
            RtsMode::WarmingUp
        } else {
            RtsMode::Normal
        }
    }

    pub fn timing_summary(&self) -> TimingSummary {
        let gaps = self.gaps();
        let mean_gap_ns = (gaps > 0)
            .then(|| u64::try_from(self.gap_sum_ns / u128::from(gaps)).unwrap_or(u64::MAX));
        let rts_mode = self.rts_mode();
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

    fn timing_state(&self) -> Option<super::TimingState> {
        Some(super::TimingState::Latency {
            rts_mode: self.rts_mode(),
            breach: self.breaches > 0,
        })
    }
}
