//! The diagnostic artifact: the formal record of a circuit transition, attached to every
//! intervention (the terminal event's error object, haltd's own answer, the ledger).

use serde::{Deserialize, Serialize};

use super::canonical::normalize_text;
use super::class::{FailureClass, NextAction};
use super::key::EquivalenceKey;
use super::policy::PolicyInForce;

/// How many receipts an artifact keeps (the spec: the last 3 error strings).
pub const RECEIPTS: usize = 3;
/// The longest receipt kept, in bytes: error strings can be whole tracebacks.
pub const RECEIPT_BYTES: usize = 240;

/// Spec 002's `DiagnosticArtifact`, plus the next allowed action and the policy in force.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct DiagnosticArtifact {
    pub equivalence_key: EquivalenceKey,
    pub failure_class: FailureClass,
    pub next_action: NextAction,
    /// The class's budget in force.
    pub budget: u32,
    pub budget_exhausted: bool,
    /// Budget units charged on this key so far (a retry costs one; a transient retry before
    /// its backoff elapsed costs two).
    pub retry_count: u32,
    /// The last [`RECEIPTS`] error strings of the key, oldest first, each trimmed to
    /// [`RECEIPT_BYTES`].
    pub sample_receipts: Vec<String>,
    /// Why continuing is (un)safe.
    pub safety_justification: String,
    /// The budgets and backoff the judgment used.
    pub policy: PolicyInForce,
    /// haltd answered without the model: the tokens it did not generate, estimated as the
    /// conversation's mean tokens per turn that haltd streamed (absent when not answered,
    /// or when no earlier turn of the conversation is known).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tokens_saved: Option<u64>,
}

impl DiagnosticArtifact {
    /// A short summary the model can read and act on (the forced summary's cue).
    pub fn summary(&self) -> String {
        let key = &self.equivalence_key;
        let resource = key
            .resource_class
            .as_deref()
            .map(|r| format!(" on {r}"))
            .unwrap_or_default();
        format!(
            "haltd TokenCircuit: the tool `{}`{resource} is stopped after a {} failure \
             (budget {}, used {}). {} Do not call it again for this; summarize for the \
             user what failed and what they can do.",
            key.tool_name,
            self.failure_class,
            self.budget,
            self.retry_count,
            self.safety_justification,
        )
    }
}

/// A receipt: the error string, whitespace-normalized and trimmed to [`RECEIPT_BYTES`].
pub fn receipt(content: &str) -> String {
    let mut text = normalize_text(content);
    if text.len() > RECEIPT_BYTES {
        let mut end = RECEIPT_BYTES;
        while !text.is_char_boundary(end) {
            end -= 1;
        }
        text.truncate(end);
        text.push('…');
    }
    text
}

/// The error of a call the circuit forbids.
#[derive(Debug, thiserror::Error)]
pub enum CircuitError {
    /// The call's key has no budget left.
    #[error("tool circuit open for {}: {}", artifact.equivalence_key, artifact.safety_justification)]
    Open { artifact: Box<DiagnosticArtifact> },
}

impl CircuitError {
    pub fn artifact(&self) -> &DiagnosticArtifact {
        match self {
            CircuitError::Open { artifact } => artifact,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn receipts_are_trimmed_on_a_char_boundary() {
        let long = "é".repeat(RECEIPT_BYTES);
        let r = receipt(&long);
        assert!(r.len() <= RECEIPT_BYTES + '…'.len_utf8());
        assert!(r.ends_with('…'));
        assert_eq!(receipt("  a \n b "), "a b");
    }
}
