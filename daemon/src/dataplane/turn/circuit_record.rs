//! TokenCircuit's ledger records (docs/fhr-schema.md, `tool_circuit`).
//!
//! Every intervention is recorded with its diagnostic artifact: a halt with
//! `TOOL_CIRCUIT_OPEN` (next to the halt's own incident record) and a request haltd answered
//! without the model (which has no other record: no stream was opened). An
//! invariant_violation is recorded at severity `page`: a human must look, and the alert
//! `HaltdToolCircuitInvariantViolation` fires on its metric. The artifact's receipts are
//! tool output, i.e. prompt text: the record keeps their length and SHA-256 only, unless
//! `--record-token-text`.

use serde::Serialize;
use serde_json::{json, Value};

use crate::{
    circuit::{store::ConversationId, DiagnosticArtifact, FailureClass},
    halt::HaltCore,
    ledger::{Record, RecordKind},
};

/// What haltd did.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub(in crate::dataplane) enum Action {
    /// The stream halted before the forbidden call reached the client.
    Halted,
    /// haltd answered the request itself, without calling the model.
    Answered,
}

/// How urgent the record is.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
enum Severity {
    /// An expected intervention: the circuit did its job.
    Info,
    /// invariant_violation: page a human.
    Page,
}

/// The record of one intervention. `record_text`: keep the receipts as they came.
pub(in crate::dataplane) fn build(
    conv: &ConversationId,
    action: Action,
    artifact: &DiagnosticArtifact,
    stream_id: Option<String>,
    record_text: bool,
) -> Record {
    let severity = if artifact.failure_class == FailureClass::InvariantViolation {
        Severity::Page
    } else {
        Severity::Info
    };
    let mut artifact = artifact.clone();
    if !record_text {
        for r in &mut artifact.sample_receipts {
            *r = crate::sampling::withheld(r);
        }
    }
    let key = &artifact.equivalence_key;
    let prefix = if severity == Severity::Page {
        "PAGE: "
    } else {
        ""
    };
    let message = format!(
        "{prefix}tool circuit open for {key} ({}): {}",
        match action {
            Action::Halted => "stream halted before the call was sent",
            Action::Answered => "answered without the model",
        },
        artifact.safety_justification
    );
    Record {
        kind: RecordKind::ToolCircuit,
        turn_id: stream_id.clone(),
        stream_id,
        conversation: Some(conv.key.clone()),
        message: Some(message),
        tool_circuit: Some(json!({
            "action": action,
            "severity": severity,
            "conversation": {"id": conv.id, "source": conv.source},
            "artifact": serde_json::to_value(&artifact).unwrap_or(Value::Null),
        })),
        ..Record::default()
    }
}

/// Queues the record of an intervention (never waits for the disk: the halt's own
/// incident record is what the terminal event waits for).
pub(in crate::dataplane) fn record(
    shared: &HaltCore,
    conv: &ConversationId,
    action: Action,
    artifact: &DiagnosticArtifact,
    stream_id: Option<String>,
) {
    let mut rec = build(
        conv,
        action,
        artifact,
        stream_id,
        shared.cfg.sampling.record_token_text,
    );
    rec.kernel_gate = shared.kernel_gate_label().to_owned();
    if artifact.failure_class == FailureClass::InvariantViolation {
        tracing::error!(key = %artifact.equivalence_key, conversation = %conv.id, "tool circuit: invariant violation, page a human");
    }
    shared.record(rec);
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;
    use crate::circuit::{transcript::rebuild, CircuitPolicy};

    fn artifact(result: &str) -> DiagnosticArtifact {
        let messages = [
            json!({"role": "assistant", "tool_calls": [{"id": "a", "type": "function",
                   "function": {"name": "run_sql", "arguments": "{}"}}]}),
            json!({"role": "tool", "tool_call_id": "a", "content": result}),
        ];
        let c = rebuild(
            Arc::new(CircuitPolicy::default()),
            &messages,
            &Default::default(),
        )
        .expect("replayable");
        c.exhausted().pop().expect("exhausted")
    }

    #[test]
    fn an_invariant_violation_is_a_page_and_receipts_are_withheld() {
        let conv = ConversationId::of(Some("c-1"), "00000000000000aa", &[]);
        let a = artifact("IntegrityError: duplicate key");
        assert_eq!(a.failure_class, FailureClass::InvariantViolation);
        let r = build(&conv, Action::Answered, &a, None, false);
        assert_eq!(r.kind, RecordKind::ToolCircuit);
        assert_eq!(r.conversation.as_deref(), Some("00000000000000aa"));
        let tc = r.tool_circuit.expect("tool_circuit");
        assert_eq!(tc["severity"], "page");
        assert_eq!(tc["action"], "answered");
        assert_eq!(tc["conversation"]["id"], "c-1");
        assert_eq!(tc["artifact"]["failure_class"], "invariant_violation");
        let receipt = tc["artifact"]["sample_receipts"][0].as_str().unwrap_or("");
        assert!(receipt.starts_with("[withheld: "), "{receipt}");
        assert!(r.message.is_some_and(|m| m.starts_with("PAGE: ")));
        let v = serde_json::to_value(Record {
            kind: RecordKind::ToolCircuit,
            ..Record::default()
        })
        .expect("serializes");
        assert_eq!(v["kind"], "tool_circuit");
    }

    #[test]
    fn other_classes_are_info_and_text_is_kept_when_asked() {
        let conv = ConversationId::of(None, "00000000000000aa", &[]);
        let a = artifact("PermissionError: denied");
        let r = build(&conv, Action::Halted, &a, Some("hs_1".into()), true);
        let tc = r.tool_circuit.expect("tool_circuit");
        assert_eq!(
            (tc["severity"].as_str(), tc["action"].as_str()),
            (Some("info"), Some("halted"))
        );
        assert_eq!(tc["conversation"]["source"], "digest");
        assert_eq!(
            tc["artifact"]["sample_receipts"][0],
            "PermissionError: denied"
        );
        assert_eq!(r.stream_id.as_deref(), Some("hs_1"));
        assert!(r
            .message
            .is_some_and(|m| m.starts_with("tool circuit open")));
    }
}
