//! Detectors: everything that can trip a stream from what its tokens say (issue 4; spec 000
//! §3 and §5, specs 001, 003, 004).
//!
//! Every detector feeds the same trip path ([`crate::halt::HaltCore::trip`]), so the
//! kernel-enforced budget of B post-trip frames holds for all of them.
//!
//! Per token, the data plane hands each enabled detector a [`TokenObs`] *before* the token is
//! accounted or sent; a detector answers with a [`Finding`]. Per detector, the configuration
//! ([`DetectorMode`]) decides what a breach does: `hard` trips the stream (after `debounce`
//! consecutive breaching tokens), `observe` only counts and records it, `off` skips the
//! detector. A detector that fails (an error, input it needs but did not get, or a missed
//! deadline) trips with `DETECTOR_FAILURE` in hard mode: fail closed.
//!
//! The exfiltration scanner is different in kind: it decides how much of the text may be
//! *released*, holding back a token that could be the start of a secret until that is
//! decided ([`exfil`]).

use std::fmt;

use prometheus_client::encoding::{EncodeLabelValue, LabelValueEncoder};
use serde::{Deserialize, Serialize};

use crate::{codes::FailureCode, progress::Check};
use scorer::{ScoreWait, Woke};

/// Which detector (or end-of-turn check) judged a stream: its config key
/// (`[detectors.<name>]`), `detector` metric label, `detector_refs` entry and the terminal
/// event's `detector.name`, all spelled by [`DetectorId::as_str`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum DetectorId {
    /// The HaltMonitor of spec 001, fed by its scorer.
    HaltMonitor,
    Surprise,
    ComputeBudget,
    LatencyAnomaly,
    /// The exfiltration scanner.
    Exfil,
    /// SafetyCheck at the end of a turn (spec 004).
    Safety,
}

impl DetectorId {
    /// Every detector, in the order they run on a token (SafetyCheck runs at the turn's end).
    pub const ALL: [DetectorId; 6] = [
        DetectorId::HaltMonitor,
        DetectorId::Surprise,
        DetectorId::ComputeBudget,
        DetectorId::LatencyAnomaly,
        DetectorId::Exfil,
        DetectorId::Safety,
    ];

    pub const fn as_str(self) -> &'static str {
        match self {
            DetectorId::HaltMonitor => "halt_monitor",
            DetectorId::Surprise => "surprise",
            DetectorId::ComputeBudget => "compute_budget",
            DetectorId::LatencyAnomaly => "latency_anomaly",
            DetectorId::Exfil => "exfil",
            DetectorId::Safety => "safety",
        }
    }
}

impl DetectorId {
    /// The check a worker records while this detector runs ([`crate::progress`]).
    pub const fn check(self) -> Check {
        match self {
            DetectorId::HaltMonitor => Check::HaltMonitor,
            DetectorId::Surprise => Check::Surprise,
            DetectorId::ComputeBudget => Check::ComputeBudget,
            DetectorId::LatencyAnomaly => Check::LatencyAnomaly,
            DetectorId::Exfil => Check::Exfil,
            DetectorId::Safety => Check::Safety,
        }
    }

    /// The detector a worker's recorded check names, if it is one.
    pub const fn of_check(check: Check) -> Option<Self> {
        match check {
            Check::None => None,
            Check::HaltMonitor => Some(DetectorId::HaltMonitor),
            Check::Surprise => Some(DetectorId::Surprise),
            Check::ComputeBudget => Some(DetectorId::ComputeBudget),
            Check::LatencyAnomaly => Some(DetectorId::LatencyAnomaly),
            Check::Exfil => Some(DetectorId::Exfil),
            Check::Safety => Some(DetectorId::Safety),
        }
    }
}

impl fmt::Display for DetectorId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl EncodeLabelValue for DetectorId {
    fn encode(&self, encoder: &mut LabelValueEncoder<'_>) -> fmt::Result {
        fmt::Write::write_str(encoder, self.as_str())
    }
}

/// Why a detector could not judge a token ([`Finding::Failed`], a `DETECTOR_FAILURE` trip in
/// hard mode), or, for [`FailureKind::Unscorable`], why the HaltMonitor halts on a token it
/// cannot score ([`Finding::Unscorable`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum FailureKind {
    /// The token has no logprob, or one that is not a log-probability (NaN, positive), and
    /// the detector needs one.
    Unscorable,
    /// `observe` took longer than the detector's `deadline_us`.
    DeadlineMissed,
    /// The external scorer's socket could not be connected, or the scorer closed it.
    ScorerUnreachable,
    /// The external scorer did not reply within its per-token deadline.
    ScorerTimeout,
    /// The external scorer's reply was not one line of `{"score": <finite number>}`.
    ScorerBadReply,
    /// Any other I/O error on the scorer's socket.
    ScorerIo,
    /// The detector could not be set up for the turn (its scorer or its monitor).
    Setup,
}

/// What a [`Trip`] (or an observe-mode finding) says about the stream.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum TripKind {
    /// The detector's condition held on what it measured.
    Breach,
    /// A token that cannot be scored, counted as a breach (the HaltMonitor: spec 001 halts on
    /// it as on a failing score, with the detector's own code).
    Unscorable,
    /// The detector could not judge: `DETECTOR_FAILURE` (fail closed).
    Failed(FailureKind),
}

/// What a detector's breach does.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum DetectorMode {
    /// A breach (after debounce) trips the stream with the detector's failure code.
    #[default]
    Hard,
    /// A breach is counted and recorded; the stream goes on.
    Observe,
    /// A breach (after debounce) asks for a grounding round instead of a halt (spec 003,
    /// the intervention; only the surprise detector takes it): the turn pauses, is grounded,
    /// rewound and resumed ([`TurnDetectors::take_intervention`]). A failure (no logprobs)
    /// is recorded as in `observe`: a backend without logprobs sees no change.
    Intervene,
    /// The detector does not run.
    Off,
}

impl DetectorMode {
    /// The config spelling.
    pub const fn as_str(self) -> &'static str {
        match self {
            DetectorMode::Hard => "hard",
            DetectorMode::Observe => "observe",
            DetectorMode::Intervene => "intervene",
            DetectorMode::Off => "off",
        }
    }
}

/// One token as the detectors see it, before it is emitted.
#[derive(Clone, Copy, Debug)]
pub struct TokenObs<'a> {
    /// 0-based index of the token in the turn.
    pub index: u64,
    pub text: &'a str,
    /// Natural-log probability of the token; `None` when the source gave none.
    pub logprob: Option<f32>,
    /// `CLOCK_MONOTONIC` ns when the token arrived from its source.
    pub now_ns: u64,
}

/// What a detector says about one token (or about the turn at its end).
#[derive(Clone, Debug, PartialEq)]
pub enum Finding {
    Clear,
    /// The detector's condition holds; `detail` says what it measured (no token text).
    Breach {
        detail: String,
    },
    /// The token cannot be scored and the detector treats that as a breach of its own (the
    /// HaltMonitor); debounced and counted like a breach.
    Unscorable {
        detail: String,
    },
    /// The detector could not judge this token (an error, or input it needs is missing):
    /// fail closed in hard mode.
    Failed {
        kind: FailureKind,
        detail: String,
    },
}

/// A per-token detector.
pub trait Detector: Send + fmt::Debug {
    /// Which detector this is: config key, metric label, `detector_refs` entry.
    fn id(&self) -> DetectorId;
    /// The failure code a hard breach trips with.
    fn code(&self) -> FailureCode;
    /// Looks at the next token. Must be cheap: it runs on the data plane, per token.
    fn observe(&mut self, tok: &TokenObs<'_>) -> Finding;
    /// Looks at the next token without blocking: the data plane's way in. A detector that
    /// waits on a socket (the HaltMonitor with an external scorer) hands the wait back
    /// ([`Observed::Wait`]) and gets [`resume`](Self::resume) when it ends; the others keep
    /// the default, which is [`observe`](Self::observe).
    fn start(&mut self, tok: &TokenObs<'_>) -> Observed {
        Observed::Done(self.observe(tok))
    }
    /// Goes on with the token [`start`](Self::start) began, after its wait ended.
    fn resume(&mut self, woke: Woke) -> Observed {
        drop(woke);
        Observed::Done(Finding::Failed {
            kind: FailureKind::ScorerIo,
            detail: "resumed with no wait in progress".to_owned(),
        })
    }
    /// At the end of a turn that was not tripped.
    fn end_of_turn(&mut self, _now_ns: u64) -> Finding {
        Finding::Clear
    }
    /// A timing detector's part of the turn's timing fields now; `None` for the others.
    fn timing_state(&self) -> Option<timing::TimingState> {
        None
    }
    /// What the detector saw in this turn, for the turn record.
    fn summary(&self) -> serde_json::Value {
        serde_json::Value::Null
    }
    /// The turn's last tokens were dropped unsent (a grounding round rewound them): forget
    /// what depends on them. Default: nothing (what was spent stays spent).
    fn rewind(&mut self) {}
}

/// A detector's verdict on a token, or the wait it needs first.
#[derive(Debug)]
pub enum Observed {
    Done(Finding),
    Wait(ScoreWait),
}

/// Where [`TurnDetectors`] stand with a token: judged by all (the first hard trip, if any),
/// or waiting for one detector, whose successors run once it is resumed.
#[derive(Debug)]
pub enum Step {
    Done(Option<Trip>),
    Wait(ScoreWait),
}

pub mod config;
pub mod exfil;
pub mod metrics;
pub mod pipeline;
pub mod scorer;
pub mod surprise;
pub mod timing;

/// How one detector's findings are acted on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Policy {
    pub mode: DetectorMode,
    /// Consecutive breaching tokens before a hard trip (K ≥ 1; spec 000 §5 hysteresis). A
    /// failed check is never debounced.
    pub debounce: u32,
    /// Most time one `observe` may take; longer counts as a failure (fail closed). 0: none.
    pub deadline_ns: u64,
}

impl Default for Policy {
    fn default() -> Self {
        Policy {
            mode: DetectorMode::Hard,
            debounce: 1,
            deadline_ns: 0,
        }
    }
}

/// Why a detector trips a stream.
#[derive(Clone, Debug, PartialEq)]
pub struct Trip {
    pub detector: DetectorId,
    pub code: FailureCode,
    pub kind: TripKind,
    pub detail: String,
}

#[derive(Debug)]
struct Armed {
    detector: Box<dyn Detector>,
    policy: Policy,
    streak: u32,
    breaches: u64,
    failures: u64,
    worst_ns: u64,
}

/// The detectors of one turn, with their policies: what the data plane calls per token.
#[derive(Debug, Default)]
pub struct TurnDetectors {
    armed: Vec<Armed>,
    /// Observe-mode breaches and failures seen this turn (for the record and metrics).
    observed: Vec<Trip>,
    /// An intervene-mode breach not taken yet ([`TurnDetectors::take_intervention`]).
    intervention: Option<Trip>,
    /// The token under way ([`TurnDetectors::begin`]): the next detector to judge it, the
    /// first hard trip so far, and when the waiting detector started (for its deadline).
    cursor: usize,
    trip: Option<Trip>,
    started_ns: u64,
    /// Test fault (`--fault detector-hang=NAME`): this detector hangs its worker.
    hang: Option<DetectorId>,
    /// Breaches seen so far (any detector, any mode): the timing fields may have changed
    /// when this moves ([`TurnDetectors::timing_now`]).
    breaches_seen: u32,
    /// `breaches_seen` when the timing fields were last handed out.
    published: Option<u32>,
}

/// Observe-mode findings kept per turn for the record: enough to see what happened, bounded.
const MAX_OBSERVED: usize = 32;

impl TurnDetectors {
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds a detector unless its mode is `off`.
    pub fn add(&mut self, detector: Box<dyn Detector>, policy: Policy) {
        if policy.mode == DetectorMode::Off {
            return;
        }
        self.armed.push(Armed {
            detector,
            policy: Policy {
                debounce: policy.debounce.max(1),
                ..policy
            },
            streak: 0,
            breaches: 0,
            failures: 0,
            worst_ns: 0,
        });
    }

    pub fn is_empty(&self) -> bool {
        self.armed.is_empty()
    }

    /// The test fault `--fault detector-hang=NAME`: `id` never returns, once.
    pub fn hang_on(&mut self, id: Option<DetectorId>) {
        self.hang = id;
    }

    /// Runs every detector on `tok`; the first hard trip wins (in configuration order). Every
    /// detector sees every token up to the trip, so their summaries stay comparable. A
    /// detector that waits (an external scorer) blocks this thread; the data plane uses
    /// [`begin`](Self::begin) instead.
    pub fn observe(&mut self, tok: &TokenObs<'_>, clock: impl Fn() -> u64) -> Option<Trip> {
        let mut trip = None;
        for a in &mut self.armed {
            let t0 = if a.policy.deadline_ns > 0 { clock() } else { 0 };
            let finding = a.detector.observe(tok);
            let finding = Self::timed(a, finding, t0, &clock);
            let found = (&mut trip, &mut self.intervention);
            Self::record(a, finding, found, &mut self.observed);
        }
        trip
    }

    /// Runs the detectors on `tok` like [`observe`](Self::observe), in the same order, but
    /// never blocks: a detector that must wait hands the wait back ([`Step::Wait`]); once it
    /// ends, [`resume`](Self::resume) (with the same token) goes on from that detector.
    pub fn begin(&mut self, tok: &TokenObs<'_>, clock: impl Fn() -> u64) -> Step {
        self.cursor = 0;
        self.trip = None;
        self.run(tok, None, clock)
    }

    /// Goes on with the token of [`begin`](Self::begin) after the wait it returned ended.
    pub fn resume(&mut self, tok: &TokenObs<'_>, woke: Woke, clock: impl Fn() -> u64) -> Step {
        self.run(tok, Some(woke), clock)
    }

    fn run(&mut self, tok: &TokenObs<'_>, mut woke: Option<Woke>, clock: impl Fn() -> u64) -> Step {
        while let Some(a) = self.armed.get_mut(self.cursor) {
            let (observed, t0) = match woke.take() {
                Some(w) => (a.detector.resume(w), self.started_ns),
                None => {
                    // For the watchdog: a detector that never returns is named by it.
                    let id = a.detector.id();
                    crate::progress::running(id.check());
                    if self.hang == Some(id) && tok.index >= crate::progress::HANG_AT_TOKEN {
                        crate::progress::hang_once(id.check());
                    }
                    let t0 = if a.policy.deadline_ns > 0 { clock() } else { 0 };
                    (a.detector.start(tok), t0)
                }
            };
            crate::progress::running(Check::None);
            let finding = match observed {
                Observed::Done(f) => f,
                Observed::Wait(w) => {
                    self.started_ns = t0;
                    return Step::Wait(w);
                }
            };
            let finding = Self::timed(a, finding, t0, &clock);
            if matches!(finding, Finding::Breach { .. }) {
                self.breaches_seen = self.breaches_seen.wrapping_add(1);
            }
            let found = (&mut self.trip, &mut self.intervention);
            Self::record(a, finding, found, &mut self.observed);
            self.cursor += 1;
        }
        self.cursor = 0;
        Step::Done(self.trip.take())
    }

    /// A finding that took longer than the detector's deadline (from `t0`) is a failure,
    /// unless it is already a breach.
    fn timed(a: &mut Armed, finding: Finding, t0: u64, clock: &impl Fn() -> u64) -> Finding {
        if a.policy.deadline_ns == 0 {
            return finding;
        }
        let took = clock().saturating_sub(t0);
        a.worst_ns = a.worst_ns.max(took);
        if took > a.policy.deadline_ns
            && !matches!(finding, Finding::Breach { .. } | Finding::Unscorable { .. })
        {
            return Finding::Failed {
                kind: FailureKind::DeadlineMissed,
                detail: format!(
                    "took {} µs, over its deadline of {} µs",
                    took / 1000,
                    a.policy.deadline_ns / 1000
                ),
            };
        }
        finding
    }

    /// Judges `finding`: a hard trip becomes `trip` unless one came first; an intervene-mode
    /// breach becomes the intervention asked for (and is kept for the record, as an
    /// observe-mode one is).
    fn record(
        a: &mut Armed,
        finding: Finding,
        (trip, intervention): (&mut Option<Trip>, &mut Option<Trip>),
        observed: &mut Vec<Trip>,
    ) {
        let Some(t) = Self::judge(a, finding) else {
            return;
        };
        match a.policy.mode {
            DetectorMode::Hard => {
                if trip.is_none() {
                    *trip = Some(t);
                }
                return;
            }
            DetectorMode::Intervene if t.kind == TripKind::Breach => {
                // Debounce again from zero: the next request needs `debounce` new breaches.
                a.streak = 0;
                if intervention.is_none() {
                    *intervention = Some(t.clone());
                }
            }
            _ => {}
        }
        if observed.len() < MAX_OBSERVED {
            observed.push(t);
        }
    }

    /// The intervene-mode breach of the tokens judged so far, once: the data plane pauses
    /// the turn for a grounding round. A hard trip of the same token wins (the caller checks
    /// the trip first and drops this).
    pub fn take_intervention(&mut self) -> Option<Trip> {
        self.intervention.take()
    }

    /// Whether any detector runs in intervene mode (the turn holds its last tokens back).
    pub fn intervenes(&self) -> bool {
        self.armed
            .iter()
            .any(|a| a.policy.mode == DetectorMode::Intervene)
    }

    /// The turn's text was rewound (its last, unsent tokens dropped): every detector forgets
    /// what it can of them ([`Detector::rewind`]) and breach streaks start again.
    pub fn rewound(&mut self) {
        self.intervention = None;
        for a in &mut self.armed {
            a.streak = 0;
            a.detector.rewind();
        }
    }

    /// At the end of a turn that was not tripped: the detectors' end-of-turn verdicts.
    pub fn end_of_turn(&mut self, now_ns: u64) -> Option<Trip> {
        let mut trip = None;
        for a in &mut self.armed {
            let finding = a.detector.end_of_turn(now_ns);
            if matches!(finding, Finding::Breach { .. }) {
                self.breaches_seen = self.breaches_seen.wrapping_add(1);
            }
            // End-of-turn findings are not debounced: there is no next token.
            a.streak = a.policy.debounce.saturating_sub(1);
            if let Some(t) = Self::judge(a, finding) {
                // Intervene mode acts on tokens, not on the whole turn: recorded here.
                if a.policy.mode == DetectorMode::Hard {
                    trip = trip.or(Some(t));
                } else if self.observed.len() < MAX_OBSERVED {
                    self.observed.push(t);
                }
            }
        }
        trip
    }

    fn judge(a: &mut Armed, finding: Finding) -> Option<Trip> {
        match finding {
            Finding::Clear => {
                a.streak = 0;
                None
            }
            Finding::Breach { detail } => Self::breach(a, TripKind::Breach, detail),
            Finding::Unscorable { detail } => Self::breach(a, TripKind::Unscorable, detail),
            // Fail closed: a detector that cannot judge trips at once, with its own code.
            Finding::Failed { kind, detail } => {
                a.failures += 1;
                Some(Trip {
                    detector: a.detector.id(),
                    code: FailureCode::DetectorFailure,
                    kind: TripKind::Failed(kind),
                    detail,
                })
            }
        }
    }

    /// A breach of `a`'s condition: counted, and a trip once it held `debounce` tokens in a
    /// row.
    fn breach(a: &mut Armed, kind: TripKind, detail: String) -> Option<Trip> {
        a.breaches += 1;
        a.streak += 1;
        (a.streak >= a.policy.debounce).then(|| Trip {
            detector: a.detector.id(),
            code: a.detector.code(),
            kind,
            detail,
        })
    }

    /// `detector_refs[]` entries: `name:mode`.
    pub fn refs(&self) -> impl Iterator<Item = String> + '_ {
        self.armed
            .iter()
            .map(|a| format!("{}:{}", a.detector.id(), a.policy.mode.as_str()))
    }

    /// Per-detector summary for the turn record.
    pub fn summary(&self) -> serde_json::Value {
        let mut m = serde_json::Map::new();
        for a in &self.armed {
            m.insert(
                a.detector.id().as_str().to_owned(),
                serde_json::json!({
                    "mode": a.policy.mode,
                    "breaches": a.breaches,
                    "failures": a.failures,
                    "worst_us": (a.policy.deadline_ns > 0).then(|| a.worst_ns as f64 / 1e3),
                    "summary": a.detector.summary(),
                }),
            );
        }
        if !self.observed.is_empty() {
            m.insert(
                "observed".to_owned(),
                serde_json::Value::Array(
                    self.observed
                        .iter()
                        .map(|t| serde_json::json!({"detector": t.detector.as_str(), "code": t.code.as_str(), "detail": t.detail}))
                        .collect(),
                ),
            );
        }
        serde_json::Value::Object(m)
    }

    /// Observe-mode findings of this turn.
    pub fn observed(&self) -> &[Trip] {
        &self.observed
    }

    /// What each armed detector did in the turn, for the per-route counters: its id, mode,
    /// findings (breaches and failures to judge) and whether it is `tripped_by`.
    pub fn judged(
        &self,
        tripped_by: Option<DetectorId>,
    ) -> impl Iterator<Item = (DetectorId, DetectorMode, u64, bool)> + '_ {
        self.armed.iter().map(move |a| {
            let id = a.detector.id();
            (
                id,
                a.policy.mode,
                a.breaches + a.failures,
                tripped_by == Some(id),
            )
        })
    }

    /// The timing fields ([`Self::timing_now`]) when they may have changed since the last
    /// call (a detector breached meanwhile), and at the first call. One comparison otherwise:
    /// the data plane asks per token.
    pub fn timing_if_changed(&mut self) -> Option<timing::TurnTiming> {
        if self.published == Some(self.breaches_seen) {
            return None;
        }
        self.published = Some(self.breaches_seen);
        Some(self.timing_now())
    }

    /// The timing fields in force now: `rts_mode` and `tig_breach` as the turn record's
    /// ([`timing::fhr_timing`]), and the timing detectors that breached so far.
    pub fn timing_now(&self) -> timing::TurnTiming {
        let (mut latency, mut budget) = (None, false);
        let mut incidents = Vec::new();
        for a in &self.armed {
            match a.detector.timing_state() {
                Some(timing::TimingState::Latency { rts_mode, breach }) => {
                    latency = Some((rts_mode, None, breach));
                }
                Some(timing::TimingState::Budget { breached }) => budget |= breached,
                None => continue,
            }
            if a.breaches > 0 {
                incidents.push(a.detector.code());
            }
        }
        let fhr = timing::combine(latency, budget);
        timing::TurnTiming {
            rts_mode: fhr.rts_mode,
            tig_breach: fhr.tig_breach,
            incidents,
        }
    }
}

#[cfg(test)]
mod tests;
