//! The one trait every grounding arm implements, and the one shape its answer takes.
//!
//! An arm answers with snippets (an empty list when it found nothing usable) or an
//! [`ArmError`]. It is given the span's class and a deadline: it sets its own I/O timeouts
//! from that deadline so that it ends soon after it, but the router does not rely on that
//! (DNS, for one, has no timeout an arm can set): it waits for the arm on another thread and
//! stops waiting at the deadline ([`super::router`]).

use std::time::Instant;

use super::{ArmKind, Snippet, SpanClass, SpanQuery};

pub use super::evidence::{cap_evidence, MAX_EVIDENCE_CHARS};

/// Why an arm failed.
#[derive(Debug, thiserror::Error)]
pub enum ArmError {
    /// An HTTP exchange (a registered tool, the search endpoint) failed.
    #[error("{what}: {source}")]
    Http {
        what: String,
        #[source]
        source: Box<ureq::Error>,
    },
    /// The other side answered something this arm cannot read.
    #[error("{what}: {reason}")]
    BadAnswer { what: String, reason: String },
    /// The evaluator could not run the span's check.
    #[error(transparent)]
    Evaluator(#[from] super::evaluator::EvalError),
    /// The full-text index failed.
    #[error("memory index: {0}")]
    Index(#[from] tantivy::TantivyError),
}

/// A grounding arm.
pub trait Arm: Send + Sync {
    /// Which arm this is.
    fn kind(&self) -> ArmKind;
    /// Evidence about `query`, found by `deadline` (see the module doc).
    fn search(
        &self,
        query: &SpanQuery,
        class: SpanClass,
        deadline: Instant,
    ) -> Result<Vec<Snippet>, ArmError>;
}
