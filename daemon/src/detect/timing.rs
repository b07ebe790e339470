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

use serde::Serialize;

mod budget;
mod common;
mod latency;

pub use budget::{BudgetLimit, BudgetSummary, ComputeBudget, ComputeBudgetConfig};
pub use common::{latency_bucket, TimingConfigError, GAP_FLOOR_NS, LATENCY_BUCKETS};
pub use latency::{
    BaselineSnapshot, Direction, LatencyAnomaly, LatencyAnomalyConfig, LatencyBaseline, Method,
    RtsMode, TimingSummary,
};

/// A timing detector's part of the FHR timing fields now ([`Detector::timing_state`]).
///
/// [`Detector::timing_state`]: crate::detect::Detector::timing_state
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TimingState {
    /// The latency detector: its `rts_mode` and whether it breached.
    Latency { rts_mode: RtsMode, breach: bool },
    /// The compute budget: whether it breached.
    Budget { breached: bool },
}

/// The timing fields in force for a turn so far, which every record of the turn carries, its
/// incident record included ([`crate::detect::TurnDetectors::timing_now`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TurnTiming {
    pub rts_mode: RtsMode,
    pub tig_breach: bool,
    /// The codes of the timing detectors that breached in the turn (in any mode: an
    /// observe-mode or not yet debounced breach counts), once each.
    pub incidents: Vec<crate::codes::FailureCode>,
}

impl TurnTiming {
    /// The record's `timing_incidents[]`: the timing findings, then `WATCHDOG_TRIP` when the
    /// turn halted.
    pub fn incidents_field(&self, halted: bool) -> Vec<String> {
        let mut v: Vec<String> = self
            .incidents
            .iter()
            .map(|c| c.as_str().to_owned())
            .collect();
        if halted {
            v.push(crate::codes::FailureCode::WatchdogTrip.as_str().to_owned());
        }
        v
    }

    /// Writes these fields into a record of the turn.
    pub fn fill(&self, rec: &mut crate::ledger::Record) {
        rec.rts_mode = self.rts_mode.as_str().to_owned();
        rec.tig_breach = self.tig_breach;
        rec.timing_incidents = self.incidents_field(rec.watchdog_trip);
    }
}

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

pub(crate) fn combine(
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
mod tests;
