//! The one trait every grounding arm implements, and the one shape its answer takes.
//!
//! An arm answers with snippets (an empty list when it found nothing usable) or an
//! [`ArmError`]. It is given the span's class and a deadline: it sets its own I/O timeouts
//! from that deadline so that it ends soon after it, but the router does not rely on that
//! (DNS, for one, has no timeout an arm can set): it waits for the arm on another thread and
//! stops waiting at the deadline ([`super::router`]).

use std::time::Instant;

use super::{ArmKind, Snippet, SpanClass, SpanQuery};

/// The longest evidence a snippet carries, in characters: grounding enters the context as
/// short evidence, never as a document.
pub const MAX_EVIDENCE_CHARS: usize = 400;

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

/// `text` on one line, without control characters, at most [`MAX_EVIDENCE_CHARS`]
/// characters (cut ones end in `…`).
pub fn cap_evidence(text: &str) -> String {
    let flat = text.split_whitespace().collect::<Vec<_>>().join(" ");
    let flat: String = flat.chars().filter(|c| !c.is_control()).collect();
    if flat.chars().count() <= MAX_EVIDENCE_CHARS {
        return flat;
    }
    let mut cut: String = flat.chars().take(MAX_EVIDENCE_CHARS - 1).collect();
    cut.push('…');
    cut
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn evidence_is_one_capped_line() {
        assert_eq!(cap_evidence(" a\n\tb\u{7}c  "), "a bc");
        let long = "é".repeat(MAX_EVIDENCE_CHARS + 10);
        let capped = cap_evidence(&long);
        assert_eq!(capped.chars().count(), MAX_EVIDENCE_CHARS);
        assert!(capped.ends_with('…'));
        assert_eq!(
            cap_evidence(&"x".repeat(MAX_EVIDENCE_CHARS))
                .chars()
                .count(),
            MAX_EVIDENCE_CHARS
        );
    }
}
