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

use crate::codes::FailureCode;
use scorer::{ScoreWait, Woke};

/// Which detector (or end-of-turn check) judged a stream: its config key
/// (`[detectors.<name>]`), `detector` metric label, `detector_refs` entry and the terminal
/// event's `detector.name`, all spelled by [`DetectorId::as_str`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize)]
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
                    let t0 = if a.policy.deadline_ns > 0 { clock() } else { 0 };
                    (a.detector.start(tok), t0)
                }
            };
            let finding = match observed {
                Observed::Done(f) => f,
                Observed::Wait(w) => {
                    self.started_ns = t0;
                    return Step::Wait(w);
                }
            };
            let finding = Self::timed(a, finding, t0, &clock);
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
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Breaches on tokens whose text is "bad", fails on "err".
    #[derive(Debug)]
    struct Words;

    impl Detector for Words {
        fn id(&self) -> DetectorId {
            DetectorId::Surprise
        }
        fn code(&self) -> FailureCode {
            FailureCode::ExfilAlert
        }
        fn observe(&mut self, tok: &TokenObs<'_>) -> Finding {
            match tok.text {
                "bad" => Finding::Breach {
                    detail: "bad word".into(),
                },
                "err" => Finding::Failed {
                    kind: FailureKind::ScorerIo,
                    detail: "broken".into(),
                },
                _ => Finding::Clear,
            }
        }
    }

    fn tok(text: &str) -> TokenObs<'_> {
        TokenObs {
            index: 0,
            text,
            logprob: None,
            now_ns: 0,
        }
    }

    fn set(mode: DetectorMode, debounce: u32) -> TurnDetectors {
        let mut d = TurnDetectors::new();
        d.add(
            Box::new(Words),
            Policy {
                mode,
                debounce,
                deadline_ns: 0,
            },
        );
        d
    }

    /// Waits on every token (as an external scorer does); judges it when resumed: clear when
    /// its socket is ready, a scorer timeout when the wait timed out.
    #[derive(Debug)]
    struct Waits(std::sync::Arc<std::sync::Mutex<Vec<&'static str>>>);

    impl Detector for Waits {
        fn id(&self) -> DetectorId {
            DetectorId::HaltMonitor
        }
        fn code(&self) -> FailureCode {
            FailureCode::CoherenceBelowThreshold
        }
        fn observe(&mut self, _tok: &TokenObs<'_>) -> Finding {
            Finding::Clear
        }
        fn start(&mut self, _tok: &TokenObs<'_>) -> Observed {
            self.0.lock().expect("log").push("wait");
            let (a, _b) = std::os::unix::net::UnixStream::pair().expect("socket pair");
            Observed::Wait(ScoreWait {
                fd: a.into(),
                interest: scorer::Interest::Readable,
                deadline: std::time::Instant::now(),
            })
        }
        fn resume(&mut self, woke: Woke) -> Observed {
            self.0.lock().expect("log").push("resumed");
            Observed::Done(match woke {
                Woke::Ready(_) => Finding::Clear,
                _ => Finding::Failed {
                    kind: FailureKind::ScorerTimeout,
                    detail: "late".into(),
                },
            })
        }
    }

    /// Logs each token it sees, after the detector before it.
    #[derive(Debug)]
    struct After(std::sync::Arc<std::sync::Mutex<Vec<&'static str>>>, Words);

    impl Detector for After {
        fn id(&self) -> DetectorId {
            self.1.id()
        }
        fn code(&self) -> FailureCode {
            self.1.code()
        }
        fn observe(&mut self, tok: &TokenObs<'_>) -> Finding {
            self.0.lock().expect("log").push("after");
            self.1.observe(tok)
        }
    }

    #[test]
    fn a_waiting_detector_parks_the_token_and_the_rest_run_after_it_in_order() {
        let log = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
        let mut d = TurnDetectors::new();
        d.add(Box::new(Waits(log.clone())), Policy::default());
        d.add(Box::new(After(log.clone(), Words)), Policy::default());
        let Step::Wait(w) = d.begin(&tok("bad"), || 0) else {
            panic!("the first detector waits");
        };
        assert_eq!(
            *log.lock().expect("log"),
            ["wait"],
            "nothing after it ran yet"
        );
        // The wait ended in time: the second detector judges the same token (a breach, hard).
        let Step::Done(Some(t)) = d.resume(&tok("bad"), Woke::Ready(w.fd), || 0) else {
            panic!("the second detector trips");
        };
        assert_eq!(t.code, FailureCode::ExfilAlert);
        assert_eq!(*log.lock().expect("log"), ["wait", "resumed", "after"]);
        // Timed out: the first detector's failure is the trip, and the second still ran.
        let Step::Wait(w) = d.begin(&tok("ok"), || 0) else {
            panic!("waits again");
        };
        let Step::Done(Some(t)) = d.resume(&tok("ok"), Woke::TimedOut(w.fd), || 0) else {
            panic!("fails closed");
        };
        assert_eq!(t.detector, DetectorId::HaltMonitor);
        assert_eq!(t.kind, TripKind::Failed(FailureKind::ScorerTimeout));
        assert_eq!(log.lock().expect("log").len(), 6);
        assert_eq!(log.lock().expect("log")[5], "after");
    }

    #[test]
    fn hard_trips_after_k_consecutive_breaches() {
        let mut d = set(DetectorMode::Hard, 2);
        assert_eq!(d.observe(&tok("bad"), || 0), None);
        assert_eq!(d.observe(&tok("ok"), || 0), None, "streak resets");
        assert_eq!(d.observe(&tok("bad"), || 0), None);
        let t = d.observe(&tok("bad"), || 0).expect("second in a row trips");
        assert_eq!(t.code, FailureCode::ExfilAlert);
    }

    #[test]
    fn failures_trip_at_once_with_their_own_code_even_debounced() {
        let mut d = set(DetectorMode::Hard, 5);
        let t = d.observe(&tok("err"), || 0).expect("fail closed");
        assert_eq!(t.code, FailureCode::DetectorFailure);
        assert_eq!(t.kind, TripKind::Failed(FailureKind::ScorerIo));
    }

    #[test]
    fn observe_mode_records_and_never_trips() {
        let mut d = set(DetectorMode::Observe, 1);
        for w in ["bad", "err", "bad"] {
            assert_eq!(d.observe(&tok(w), || 0), None);
        }
        assert_eq!(d.observed().len(), 3);
        assert_eq!(d.summary()["surprise"]["breaches"], 2);
    }

    #[test]
    fn intervene_mode_asks_for_a_round_instead_of_tripping_once_per_debounced_breach() {
        let mut d = set(DetectorMode::Intervene, 2);
        assert!(d.intervenes());
        assert_eq!(d.observe(&tok("bad"), || 0), None);
        assert_eq!(
            d.take_intervention(),
            None,
            "debounced: one breach is not enough"
        );
        assert_eq!(d.observe(&tok("bad"), || 0), None, "never a trip");
        let t = d.take_intervention().expect("two in a row ask for a round");
        assert_eq!(
            (t.detector, t.kind),
            (DetectorId::Surprise, TripKind::Breach)
        );
        assert_eq!(d.take_intervention(), None, "taken once");
        // The streak starts again after a request.
        assert_eq!(d.observe(&tok("bad"), || 0), None);
        assert_eq!(d.take_intervention(), None);
        assert_eq!(d.refs().collect::<Vec<_>>(), ["surprise:intervene"]);
        assert_eq!(
            d.observed().len(),
            1,
            "recorded like an observe-mode breach"
        );
    }

    #[test]
    fn an_intervene_mode_failure_is_recorded_and_changes_nothing() {
        // A backend without logprobs: the surprise detector fails on every token; in
        // intervene mode that neither trips nor asks for a round (spec 003's no-op).
        let mut d = set(DetectorMode::Intervene, 1);
        for _ in 0..3 {
            assert_eq!(d.observe(&tok("err"), || 0), None);
        }
        assert_eq!(d.take_intervention(), None);
        assert_eq!(d.observed().len(), 3);
        assert_eq!(d.summary()["surprise"]["failures"], 3);
    }

    #[test]
    fn a_rewind_drops_a_pending_request_and_the_streak() {
        let mut d = set(DetectorMode::Intervene, 2);
        assert_eq!(d.observe(&tok("bad"), || 0), None);
        d.rewound();
        assert_eq!(d.observe(&tok("bad"), || 0), None);
        assert_eq!(
            d.take_intervention(),
            None,
            "the streak began again at the rewind"
        );
    }

    #[test]
    fn detector_ids_are_spelled_alike_in_json_and_config() {
        for id in DetectorId::ALL {
            assert_eq!(
                serde_json::to_value(id).expect("json"),
                serde_json::Value::from(id.as_str())
            );
            assert_eq!(id.to_string(), id.as_str());
        }
        assert_eq!(DetectorId::HaltMonitor.as_str(), "halt_monitor");
    }

    #[test]
    fn off_detectors_do_not_run() {
        let d = set(DetectorMode::Off, 1);
        assert!(d.is_empty());
    }

    #[test]
    fn a_missed_deadline_is_a_failure() {
        let mut d = TurnDetectors::new();
        d.add(
            Box::new(Words),
            Policy {
                mode: DetectorMode::Hard,
                debounce: 1,
                deadline_ns: 1_000,
            },
        );
        let ticks = std::cell::Cell::new(0u64);
        let clock = || {
            ticks.set(ticks.get() + 5_000);
            ticks.get()
        };
        let t = d.observe(&tok("ok"), clock).expect("too slow");
        assert_eq!(t.code, FailureCode::DetectorFailure);
        assert_eq!(t.kind, TripKind::Failed(FailureKind::DeadlineMissed));
        assert!(t.detail.contains("deadline"), "{}", t.detail);
    }
}
