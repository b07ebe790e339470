//! What the data plane needs to run grounding rounds, and what a round leaves in the turn's
//! receipt (issue 16 points 4 and 5).
//!
//! [`GroundPlan`] is built once at start from the configuration: the [`Grounder`] (the router
//! and its arms), at most how many rounds a reply gets, each round's deadline, and how the
//! upstream continues a reply ([`Continuation`]). The data plane runs each round off its
//! worker thread (`dataplane/ground.rs`) and appends a [`RoundRecord`] per round to the turn's
//! record.

use std::{fmt, str::FromStr, sync::Arc, time::Duration};

use serde::{Deserialize, Serialize};

use super::{ArmKind, Attempt, Grounder, GroundingConfig, Round, Snippet, SpanClass};

/// Default rounds per reply (spec 003: "Max N intervention rounds per reply (default 2)").
pub const DEFAULT_MAX_ROUNDS: u32 = 2;

/// How an upstream continues a reply whose end was rewound (issue 16 point 3).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Continuation {
    /// vLLM: the kept prefix as the last, assistant message, with
    /// `continue_final_message: true` and `add_generation_prompt: false`.
    Vllm,
    /// llama.cpp's server: the kept prefix as the last, assistant message (its prefill).
    LlamaCpp,
    /// No decode control: the post-hoc fallback (one grounded revise pass after the stream,
    /// delivered as an annotation event; docs/wire-format.md).
    #[default]
    None,
}

impl Continuation {
    /// Whether a turn is resumed as a continuation: only a chat-shaped one (its request
    /// is a chat body haltd can extend), and only with decode control. A turn passed through
    /// to its backend's own surface (`--upstream-surfaces`) never is: it takes the post-hoc
    /// fallback.
    pub fn resumes(self, chat_shaped: bool) -> bool {
        chat_shaped && self != Continuation::None
    }

    pub const fn as_str(self) -> &'static str {
        match self {
            Continuation::Vllm => "vllm",
            Continuation::LlamaCpp => "llama_cpp",
            Continuation::None => "none",
        }
    }
}

impl fmt::Display for Continuation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A `continuation` value that is none of the three.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("continuation {0:?} is not one of \"vllm\", \"llama_cpp\", \"none\"")]
pub struct UnknownContinuation(pub String);

impl FromStr for Continuation {
    type Err = UnknownContinuation;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "vllm" => Ok(Continuation::Vllm),
            "llama_cpp" | "llama-cpp" => Ok(Continuation::LlamaCpp),
            "none" => Ok(Continuation::None),
            other => Err(UnknownContinuation(other.to_owned())),
        }
    }
}

/// Everything a worker needs to ground a turn.
#[derive(Clone)]
pub struct GroundPlan {
    pub grounder: Arc<dyn Grounder>,
    /// Rounds per reply at most.
    pub max_rounds: u32,
    /// Each round's deadline.
    pub round_deadline: Duration,
    /// How a proxied reply is continued (the built-in source always can).
    pub continuation: Continuation,
    /// The arm orders in force (for the receipt): computable spans, the others.
    pub order_computable: Vec<ArmKind>,
    pub order_other: Vec<ArmKind>,
}

impl GroundPlan {
    /// haltd's grounder over the arms `cfg` configures ([`super::Grounding::from_config`]:
    /// indexes the memory store, so at start only), with the round limit, deadline,
    /// continuation and orders of `cfg`.
    pub fn from_config(
        cfg: &GroundingConfig,
        metrics: Option<crate::grounding::metrics::GroundingMetrics>,
    ) -> Result<Self, super::GroundingError> {
        Ok(GroundPlan {
            grounder: super::Grounding::from_config(cfg, metrics)?,
            max_rounds: cfg.max_rounds,
            round_deadline: cfg.round_deadline(),
            continuation: cfg.continuation,
            order_computable: cfg.order_computable.clone(),
            order_other: cfg.order_other.clone(),
        })
    }
}

impl fmt::Debug for GroundPlan {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("GroundPlan")
            .field("max_rounds", &self.max_rounds)
            .field("round_deadline", &self.round_deadline)
            .field("continuation", &self.continuation)
            .finish_non_exhaustive()
    }
}

/// What a round came to, as the turn saw it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum RoundOutcome {
    /// Evidence found; the held span was rewound and the reply resumed with it in context.
    Rewound,
    /// Evidence found without continuation: delivered after the reply (the post-hoc fallback).
    Annotated,
    /// Nothing found (or every arm timed out or failed): the reply went on unmodified.
    Empty,
    /// The round ran past its deadline: the reply went on unmodified.
    Timeout,
    /// A halt came first (detector, admin, watchdog): the round's result was dropped.
    Cancelled,
}

impl RoundOutcome {
    pub const fn as_str(self) -> &'static str {
        match self {
            RoundOutcome::Rewound => "rewound",
            RoundOutcome::Annotated => "annotated",
            RoundOutcome::Empty => "empty",
            RoundOutcome::Timeout => "timeout",
            RoundOutcome::Cancelled => "cancelled",
        }
    }
}

/// One round's convergence record (spec 003): the claim (the span), the evidence, the best
/// confidence and its source, the arm that grounded it, how long the round took, and what
/// the turn did with it.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct RoundRecord {
    /// The high-surprise span (left out of the record unless `--record-token-text`; its
    /// length is kept).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub claim: Option<String>,
    pub claim_bytes: usize,
    pub evidence: Vec<Snippet>,
    /// The highest confidence among the evidence (0 when none).
    pub confidence: f32,
    /// The source of that evidence; empty when none.
    pub source: String,
    /// The arm that grounded the span; `None` when none did.
    pub arm: Option<ArmKind>,
    pub took_ms: u64,
    pub class: Option<SpanClass>,
    /// Every arm tried, in order, with its outcome.
    pub attempts: Vec<Attempt>,
    pub outcome: RoundOutcome,
    /// Tokens dropped from the window start (0 unless rewound).
    pub rewound_tokens: usize,
    /// Bytes of the reply kept before the resumed text.
    pub kept_bytes: usize,
}

impl RoundRecord {
    /// The record of a round that answered `round` after `took`; `outcome` says what the
    /// turn did.
    pub fn of(span: &str, round: &Round, took: Duration, outcome: RoundOutcome) -> Self {
        let best = round
            .snippets
            .iter()
            .max_by(|a, b| a.confidence.total_cmp(&b.confidence));
        let arm = round
            .attempts
            .iter()
            .find(|a| a.outcome == super::ArmOutcome::Grounded)
            .map(|a| a.arm);
        RoundRecord {
            claim: Some(span.to_owned()),
            claim_bytes: span.len(),
            evidence: round.snippets.clone(),
            confidence: best.map_or(0.0, |s| s.confidence),
            source: best.map(|s| s.source.clone()).unwrap_or_default(),
            arm,
            took_ms: took.as_millis() as u64,
            class: Some(round.class),
            attempts: round.attempts.clone(),
            outcome,
            rewound_tokens: 0,
            kept_bytes: 0,
        }
    }

    /// A round whose result never came back in time, or was dropped for a halt.
    pub fn without_result(span: &str, took: Duration, outcome: RoundOutcome) -> Self {
        RoundRecord {
            claim: Some(span.to_owned()),
            claim_bytes: span.len(),
            evidence: Vec::new(),
            confidence: 0.0,
            source: String::new(),
            arm: None,
            took_ms: took.as_millis() as u64,
            class: None,
            attempts: Vec::new(),
            outcome,
            rewound_tokens: 0,
            kept_bytes: 0,
        }
    }
}

/// The grounding context as the continuation sees it: one bracketed segment, the snippets as
/// `[claim, evidence, confidence, source]` lines, never raw prose (spec 003).
pub fn bracketed(snippets: &[Snippet]) -> String {
    let mut s = String::from("[grounding]\n");
    for sn in snippets {
        let line = serde_json::json!([sn.claim, sn.evidence, sn.confidence, sn.source]);
        s.push_str(&line.to_string());
        s.push('\n');
    }
    s.push_str("[/grounding]");
    s
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::grounding::ArmOutcome;

    fn snippet(conf: f32, source: &str) -> Snippet {
        Snippet {
            claim: "c".into(),
            evidence: "e".into(),
            confidence: conf,
            source: source.into(),
        }
    }

    #[test]
    fn continuation_spellings() {
        for c in [
            Continuation::Vllm,
            Continuation::LlamaCpp,
            Continuation::None,
        ] {
            assert_eq!(c.as_str().parse::<Continuation>(), Ok(c));
        }
        assert!("openai".parse::<Continuation>().is_err());
    }

    #[test]
    fn a_record_names_the_grounding_arm_and_its_best_evidence() {
        let round = Round {
            class: SpanClass::EntityShaped,
            attempts: vec![
                Attempt {
                    arm: ArmKind::Memory,
                    outcome: ArmOutcome::Empty,
                    took_ms: 1,
                    detail: String::new(),
                },
                Attempt {
                    arm: ArmKind::Web,
                    outcome: ArmOutcome::Grounded,
                    took_ms: 3,
                    detail: String::new(),
                },
            ],
            snippets: vec![snippet(0.4, "a"), snippet(0.9, "b")],
        };
        let r = RoundRecord::of(
            "span",
            &round,
            Duration::from_millis(5),
            RoundOutcome::Rewound,
        );
        assert_eq!(r.arm, Some(ArmKind::Web));
        assert_eq!((r.confidence, r.source.as_str()), (0.9, "b"));
        assert_eq!((r.took_ms, r.claim_bytes), (5, 4));
        let v = serde_json::to_value(&r).expect("json");
        assert_eq!(v["outcome"], "rewound");
        assert_eq!(v["attempts"][1]["arm"], "web");
    }

    #[test]
    fn the_bracketed_segment_holds_only_snippet_tuples() {
        let s = bracketed(&[snippet(1.0, "calc")]);
        assert_eq!(s, "[grounding]\n[\"c\",\"e\",1.0,\"calc\"]\n[/grounding]");
    }

    #[test]
    fn only_a_chat_shaped_turn_with_decode_control_resumes() {
        for c in [Continuation::Vllm, Continuation::LlamaCpp] {
            assert!(c.resumes(true), "{c}");
            assert!(!c.resumes(false), "{c}: a passed-through turn resumed");
        }
        assert!(!Continuation::None.resumes(true));
        assert!(!Continuation::None.resumes(false));
    }
}
