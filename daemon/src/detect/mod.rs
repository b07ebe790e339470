//! Detectors: everything that can trip a stream from what its tokens say (issue 4; spec 000
//! §3 and §5, specs 001, 003, 004).
//!
//! Every detector feeds the same trip path ([`crate::shared::Shared::trip`]), so the
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

pub mod exfil;
pub mod scorer;
pub mod surprise;
pub mod timing;
