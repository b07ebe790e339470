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

use serde::{Deserialize, Serialize};

use crate::codes::FailureCode;

/// What a detector's breach does.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum DetectorMode {
    /// A breach (after debounce) trips the stream with the detector's failure code.
    #[default]
    Hard,
    /// A breach is counted and recorded; the stream goes on.
    Observe,
    /// The detector does not run.
    Off,
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
    /// The detector could not judge this token (an error, or input it needs is missing):
    /// fail closed in hard mode.
    Failed {
        detail: String,
    },
}

/// A per-token detector.
pub trait Detector: Send + fmt::Debug {
    /// Stable name: config key, metric label, `detector_refs` entry.
    fn name(&self) -> &'static str;
    /// The failure code a hard breach trips with.
    fn code(&self) -> FailureCode;
    /// Looks at the next token. Must be cheap: it runs on the data plane, per token.
    fn observe(&mut self, tok: &TokenObs<'_>) -> Finding;
    /// At the end of a turn that was not tripped.
    fn end_of_turn(&mut self, _now_ns: u64) -> Finding {
        Finding::Clear
    }
    /// What the detector saw in this turn, for the turn record.
    fn summary(&self) -> serde_json::Value {
        serde_json::Value::Null
    }
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
    pub detector: &'static str,
    pub code: FailureCode,
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
    /// detector sees every token up to the trip, so their summaries stay comparable.
    pub fn observe(&mut self, tok: &TokenObs<'_>, clock: impl Fn() -> u64) -> Option<Trip> {
        let mut trip = None;
        for a in &mut self.armed {
            let t0 = if a.policy.deadline_ns > 0 { clock() } else { 0 };
            let mut finding = a.detector.observe(tok);
            if a.policy.deadline_ns > 0 {
                let took = clock().saturating_sub(t0);
                a.worst_ns = a.worst_ns.max(took);
                if took > a.policy.deadline_ns && !matches!(finding, Finding::Breach { .. }) {
                    finding = Finding::Failed {
                        detail: format!(
                            "took {} µs, over its deadline of {} µs",
                            took / 1000,
                            a.policy.deadline_ns / 1000
                        ),
                    };
                }
            }
            let t = Self::judge(a, finding);
            if let Some(t) = t {
                if a.policy.mode == DetectorMode::Hard {
                    trip = trip.or(Some(t));
                } else if self.observed.len() < MAX_OBSERVED {
                    self.observed.push(t);
                }
            }
        }
        trip
    }

    /// At the end of a turn that was not tripped: the detectors' end-of-turn verdicts.
    pub fn end_of_turn(&mut self, now_ns: u64) -> Option<Trip> {
        let mut trip = None;
        for a in &mut self.armed {
            let finding = a.detector.end_of_turn(now_ns);
            // End-of-turn findings are not debounced: there is no next token.
            a.streak = a.policy.debounce.saturating_sub(1);
            if let Some(t) = Self::judge(a, finding) {
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
            Finding::Breach { detail } => {
                a.breaches += 1;
                a.streak += 1;
                (a.streak >= a.policy.debounce).then(|| Trip {
                    detector: a.detector.name(),
                    code: a.detector.code(),
                    detail,
                })
            }
            // Fail closed: a detector that cannot judge trips at once, with its own code.
            Finding::Failed { detail } => {
                a.failures += 1;
                Some(Trip {
                    detector: a.detector.name(),
                    code: FailureCode::DetectorFailure,
                    detail,
                })
            }
        }
    }

    /// `detector_refs[]` entries: `name:mode`.
    pub fn refs(&self) -> impl Iterator<Item = String> + '_ {
        self.armed.iter().map(|a| {
            let mode = match a.policy.mode {
                DetectorMode::Hard => "hard",
                DetectorMode::Observe => "observe",
                DetectorMode::Off => "off",
            };
            format!("{}:{mode}", a.detector.name())
        })
    }

    /// Per-detector summary for the turn record.
    pub fn summary(&self) -> serde_json::Value {
        let mut m = serde_json::Map::new();
        for a in &self.armed {
            m.insert(
                a.detector.name().to_owned(),
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
                        .map(|t| serde_json::json!({"detector": t.detector, "code": t.code.as_str(), "detail": t.detail}))
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
        fn name(&self) -> &'static str {
            "words"
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
    }

    #[test]
    fn observe_mode_records_and_never_trips() {
        let mut d = set(DetectorMode::Observe, 1);
        for w in ["bad", "err", "bad"] {
            assert_eq!(d.observe(&tok(w), || 0), None);
        }
        assert_eq!(d.observed().len(), 3);
        assert_eq!(d.summary()["words"]["breaches"], 2);
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
        assert!(t.detail.contains("deadline"), "{}", t.detail);
    }
}
