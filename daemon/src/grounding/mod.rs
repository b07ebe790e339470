//! Grounding (spec 003, the intervention; issue 16): what a grounding round is, as the data
//! plane sees it.
//!
//! When the surprise detector runs in `intervene` mode and the rolling surprise crosses its
//! threshold, the turn pauses and asks a [`Grounder`] for evidence about the high-surprise
//! span. The grounder classifies the span ([`SpanClass`]), tries its arms in the order the
//! class calls for (memory → tool → web for computable spans, memory → web → tool otherwise),
//! each under a hard deadline, and answers with a [`Round`]: the attempts it made and the
//! evidence it found, only ever as [`Snippet`]s (claim, evidence, confidence, source), never
//! raw prose. The data plane then rewinds the span and resumes the generation with the
//! snippets in context, or resumes unmodified when the round found nothing.
//!
//! This module holds the types both sides share; the arms and the router implement
//! [`Grounder`], the data plane runs it off the worker thread.

use std::time::Instant;

use serde::Serialize;

/// How the router classifies a high-surprise span (spec 003, "Arbitration").
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum SpanClass {
    /// Arithmetic, dates, units, code or file facts, live status: a tool can check it.
    Computable,
    /// Shaped like an entity, a number or a date: the web may know it.
    EntityShaped,
    /// Anything else.
    Other,
}

/// One grounding arm.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum ArmKind {
    /// The operator's local document store (Remember).
    Memory,
    /// The shell-free evaluator and operator-registered HTTP tools (Act).
    Tool,
    /// The operator's SearxNG-compatible search endpoint (Observe).
    Web,
}

/// What one arm's attempt came to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum ArmOutcome {
    /// It returned at least one snippet above its floor.
    Grounded,
    /// It answered, with nothing usable.
    Empty,
    /// Its deadline fired while it was running.
    Timeout,
    /// It failed (its error is in [`Attempt::detail`]).
    Failed,
    /// Not configured (or off): skipped.
    Skipped,
}

/// One piece of evidence, the only form grounding takes on its way into the context.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Snippet {
    /// What is claimed (the span, or the part of it the evidence speaks to).
    pub claim: String,
    /// The evidence, short.
    pub evidence: String,
    /// 0..=1; a verified tool result is 1.0 (`observable: 1.0`).
    pub confidence: f32,
    /// Where it came from (document path, tool name, URL).
    pub source: String,
}

/// One arm's attempt within a round.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Attempt {
    pub arm: ArmKind,
    pub outcome: ArmOutcome,
    pub took_ms: u64,
    /// Why it failed or was skipped; empty otherwise.
    pub detail: String,
}

/// The span a round is about, with the text around it.
#[derive(Debug, Clone, PartialEq)]
pub struct SpanQuery {
    /// The high-surprise span (the window's text).
    pub span: String,
    /// The reply's text before the span (the kept prefix), for context.
    pub context: String,
    /// The user's last message, for context.
    pub prompt: String,
}

/// What a grounding round found.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Round {
    pub class: SpanClass,
    /// The arm order tried, in order, with each outcome.
    pub attempts: Vec<Attempt>,
    /// The evidence kept (from the first arm that grounded the span).
    pub snippets: Vec<Snippet>,
}

/// Finds evidence for a span. Blocking: the data plane calls it off its worker threads.
/// It must return by `deadline` (an arm still running then counts as [`ArmOutcome::Timeout`]
/// and its result is dropped).
pub trait Grounder: Send + Sync {
    fn ground(&self, query: &SpanQuery, deadline: Instant) -> Round;
}
