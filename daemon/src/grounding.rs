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
//! [`Grounder`], the data plane runs it off the worker thread. [`Grounding::from_config`]
//! builds haltd's grounder from `[grounding]` ([`config`]): the [`router::Router`] over the
//! [`memory`], [`tool`] and [`web`] arms (docs/grounding.md).
//!
//! | module | job |
//! |---|---|
//! | [`scan`] | the span as tokens |
//! | [`classify`] | the span's class ([`SpanClass`]) |
//! | [`check`] | what the evaluator can check in a span |
//! | [`evaluator`] | fend runs a check (confidence 1.0) |
//! | [`arm`] | the [`arm::Arm`] trait, evidence capping |
//! | [`memory`], [`tool`], [`web`] | the arms |
//! | [`http`] | the arms' HTTP client |
//! | [`router`] | arm order, deadlines, the round |
//! | [`config`] | `[grounding]` |

use std::{sync::Arc, time::Instant};

use serde::{Deserialize, Serialize};

pub mod arm;
pub mod check;
pub mod classify;
pub mod config;
pub mod evaluator;
pub mod evidence;
pub mod http;
pub mod memory;
pub mod metrics;
pub mod plan;
pub mod resume_request;
pub mod router;
pub mod scan;
#[cfg(test)]
mod test_server;
pub mod tool;
pub mod web;

pub use config::GroundingConfig;

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
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
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

/// Why haltd's grounder could not be built.
#[derive(Debug, thiserror::Error)]
pub enum GroundingError {
    /// The memory store could not be indexed.
    #[error("grounding.memory.dir: {0}")]
    Memory(#[from] memory::MemoryError),
    /// An HTTP tool's pattern does not compile.
    #[error("grounding.tool.http.{0}")]
    Pattern(#[from] tool::PatternError),
}

/// Builds haltd's grounder.
#[derive(Debug)]
pub struct Grounding;

impl Grounding {
    /// The router over the arms `cfg` configures (validated by [`GroundingConfig::load`]),
    /// counting its attempts on `metrics` (`None`: uncounted). Indexes the memory store, so
    /// it reads the disk: call it at start, not per round.
    pub fn from_config(
        cfg: &GroundingConfig,
        metrics: Option<crate::grounding::metrics::GroundingMetrics>,
    ) -> Result<Arc<dyn Grounder>, GroundingError> {
        let mut arms = router::Arms::default();
        if let Some(dir) = &cfg.memory.dir {
            let memory = memory::MemoryArm::open(dir, cfg.memory.floor, cfg.memory.max_results)?;
            tracing::info!(dir = %dir.display(), passages = memory.passages(), "grounding memory indexed");
            arms.memory = Some(Arc::new(memory));
        }
        if let Some(tool) = tool::ToolArm::new(&cfg.tool, http::agent())? {
            arms.tool = Some(Arc::new(tool));
        }
        if let Some(endpoint) = &cfg.web.endpoint {
            arms.web = Some(Arc::new(web::WebArm::new(
                endpoint,
                cfg.web.max_results,
                http::agent(),
            )));
        }
        let policy = router::Policy {
            arm_deadline: cfg.arm_deadline(),
            round_deadline: cfg.round_deadline(),
            order_computable: cfg.order_computable.clone(),
            order_other: cfg.order_other.clone(),
        };
        Ok(Arc::new(router::Router::new(arms, policy, metrics)))
    }
}

#[cfg(test)]
mod tests;
