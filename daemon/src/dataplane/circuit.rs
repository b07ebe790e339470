//! TokenCircuit in the turn pipeline (spec 002, docs/tokencircuit.md).
//!
//! A proxied chat turn with `[tool_circuit] enabled` starts with its conversation's circuit,
//! rebuilt from the request's own transcript (`circuit::transcript`). The model's tool-call
//! deltas are observed and scanned like any output, then held here instead of queued for
//! the client: only when the turn's text is complete is every call whole and judged. A call
//! its key's budget forbids halts the stream with `TOOL_CIRCUIT_OPEN` and the diagnostic
//! artifact in the error object, through the same trip as any other halt (kernel-enforced,
//! the incident recorded), before a byte of any held call reached the client; otherwise the
//! held deltas go out in order, framed as they would have been.

use std::{io, sync::Arc};

use serde_json::Value;

use super::Worker;
use crate::{
    circuit::{
        transcript::{rebuild, tool_call, Timeline},
        Circuit, CircuitPolicy, Verdict,
    },
    codes::FailureCode,
    stream::Initiator,
    upstream::{framing::ToolCallPart, UpToken},
    wire::HttpError,
};

/// A tool-call delta held until its turn's calls are judged.
#[derive(Debug)]
struct HeldDelta {
    parts: Vec<ToolCallPart>,
    tokens: Vec<UpToken>,
    started: Vec<Value>,
    arrived_ns: u64,
    /// Where its text ended in the scanned output.
    scanned: usize,
}

/// A turn's circuit and the deltas it holds.
#[derive(Debug)]
pub(super) struct TurnCircuit {
    circuit: Circuit,
    held: Vec<HeldDelta>,
    judged: bool,
}

impl TurnCircuit {
    /// The circuit of a chat request's conversation, rebuilt from its `messages`. A
    /// transcript haltd cannot replay (a tool call without an id or name, a tool result
    /// without a `tool_call_id`) is refused: its calls could not be judged.
    pub(super) fn of_request(policy: &Arc<CircuitPolicy>, json: &Value) -> Result<Self, HttpError> {
        let messages = json
            .get("messages")
            .and_then(Value::as_array)
            .map_or(&[][..], Vec::as_slice);
        let circuit = rebuild(Arc::clone(policy), messages, &Timeline::default())
            .map_err(|e| HttpError::bad_request(format!("messages: {e}")))?;
        Ok(TurnCircuit {
            circuit,
            held: Vec::new(),
            judged: false,
        })
    }

    /// A request whose conversation has used up a key's budget. permission/auth and
    /// invariant_violation: haltd answers itself, without calling the model (409, type
    /// `tool_circuit_open`, code `TOOL_CIRCUIT_OPEN`, the artifact as `tool_circuit` and a
    /// summary the model can read as the message). Any other class: the turn is forwarded
    /// with the exhausted tools removed from `tools` (and from `tool_choice` when it names
    /// one) and a system message saying why, so the model can summarize instead of retrying.
    pub(super) fn apply_exhausted(&self, body: &mut Value) -> Result<(), HttpError> {
        let exhausted = self.circuit.exhausted();
        if let Some(a) = exhausted.iter().find(|a| a.failure_class.fails_closed()) {
            let artifact = serde_json::to_value(a).unwrap_or(Value::Null);
            return Err(HttpError::new(409, "tool_circuit_open", a.summary())
                .with_code("TOOL_CIRCUIT_OPEN")
                .with_detail("tool_circuit", artifact));
        }
        if exhausted.is_empty() {
            return Ok(());
        }
        let names: Vec<&str> = exhausted
            .iter()
            .map(|a| a.equivalence_key.tool_name.as_str())
            .collect();
        let named = |t: &Value| {
            t.pointer("/function/name")
                .and_then(Value::as_str)
                .is_some_and(|n| names.contains(&n))
        };
        if let Some(tools) = body.get_mut("tools").and_then(Value::as_array_mut) {
            tools.retain(|t| !named(t));
        }
        let no_tools = body
            .get("tools")
            .and_then(Value::as_array)
            .is_some_and(Vec::is_empty);
        if let (Some(obj), true) = (body.as_object_mut(), no_tools) {
            // An empty list is refused by some backends: no tools at all, then.
            obj.remove("tools");
            obj.remove("tool_choice");
        } else if body.get("tool_choice").is_some_and(named) {
            body["tool_choice"] = Value::from("auto");
        }
        let note: Vec<String> = exhausted.iter().map(|a| a.summary()).collect();
        if let Some(messages) = body.get_mut("messages").and_then(Value::as_array_mut) {
            messages.push(serde_json::json!({"role": "system", "content": note.join("\n")}));
        }
        Ok(())
    }

    /// Holds an observed, scanned tool-call delta (allocates per delta: the deltas of the
    /// turn's tool calls are kept until its end).
    pub(super) fn hold(
        &mut self,
        parts: Vec<ToolCallPart>,
        tokens: Vec<UpToken>,
        started: Vec<Value>,
        arrived_ns: u64,
        scanned: usize,
    ) {
        self.held.push(HeldDelta {
            parts,
            tokens,
            started,
            arrived_ns,
            scanned,
        });
    }

    /// Judges the turn's merged calls in order; the first denial, if any.
    fn judge(&mut self, calls: &[Value]) -> Option<Verdict> {
        for (index, call) in calls.iter().enumerate() {
            // A call without an id or name cannot be judged: fail closed.
            let Ok(call) = tool_call(call, index) else {
                return Some(Verdict::Deny(Box::new(self.unjudgeable(call))));
            };
            let verdict = self.circuit.judge(call, None);
            if let Verdict::Deny(_) = verdict {
                return Some(verdict);
            }
            self.circuit.record_call(call, None);
        }
        None
    }

    fn unjudgeable(&self, call: &Value) -> crate::circuit::DiagnosticArtifact {
        let name = call["function"]["name"].as_str().unwrap_or("").to_owned();
        crate::circuit::DiagnosticArtifact {
            equivalence_key: crate::circuit::EquivalenceKey {
                tool_name: name,
                resource_class: None,
                auth_scope: None,
                error_class: crate::circuit::FailureClass::InvariantViolation,
                side_effect_boundary: false,
            },
            failure_class: crate::circuit::FailureClass::InvariantViolation,
            next_action: crate::circuit::NextAction::FailClosed,
            budget: 0,
            budget_exhausted: true,
            retry_count: 0,
            sample_receipts: Vec::new(),
            safety_justification: "the model emitted a tool call without an id or a name: \
                                   it cannot be judged, so it is not sent"
                .to_owned(),
            policy: self.circuit.policy().in_force(),
        }
    }
}

/// Counts a request TokenCircuit answered without the model (its 409), by class.
pub(super) fn count_answer(metrics: &crate::metrics::Metrics, e: &HttpError) {
    if e.code != Some("TOOL_CIRCUIT_OPEN") {
        return;
    }
    let class = e
        .detail
        .as_ref()
        .and_then(|(_, a)| serde_json::from_value(a["failure_class"].clone()).ok());
    if let Some(class) = class {
        metrics.circuit.tripped(class);
    }
}

impl Worker {
    /// At the end of the turn's text: judge every call; a forbidden one halts the stream
    /// (returns false), else the held deltas are queued for the client.
    pub(super) fn circuit_at_end(&mut self, key: usize) -> io::Result<bool> {
        let Some(turn) = self.conns[key].turn.as_mut() else {
            return Ok(false);
        };
        let Some(tc) = turn.circuit.as_mut().filter(|c| !c.judged) else {
            return Ok(true);
        };
        tc.judged = true;
        let calls = turn
            .source
            .upstream()
            .map(|s| s.tool_calls().to_vec())
            .unwrap_or_default();
        if let Some(Verdict::Deny(artifact)) = tc.judge(&calls) {
            tc.held.clear();
            self.circuit_trip(key, &artifact)?;
            return Ok(false);
        }
        for d in std::mem::take(&mut tc.held) {
            turn.hold.push_tool_calls_ending(
                d.parts,
                d.tokens,
                &d.started,
                d.arrived_ns,
                d.scanned,
            );
        }
        Ok(true)
    }

    /// Halts the stream with `TOOL_CIRCUIT_OPEN`, the artifact in the error object. Not a
    /// breach: the key is not degraded (`modes::cause_degrades`).
    fn circuit_trip(
        &mut self,
        key: usize,
        artifact: &crate::circuit::DiagnosticArtifact,
    ) -> io::Result<()> {
        let shared = Arc::clone(&self.shared);
        let id = self.conns[key].id;
        tracing::info!(stream_id = %id, key = %artifact.equivalence_key, justification = %artifact.safety_justification, "tool circuit open: the call is not sent");
        shared.metrics.circuit.tripped(artifact.failure_class);
        shared.meta(id.slot).tool_circuit = serde_json::to_value(artifact).ok();
        let _ = shared.trip_by(id, FailureCode::ToolCircuitOpen, Initiator::Detector);
        self.halt(key)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn body(result: &str) -> Value {
        serde_json::json!({
            "model": "m",
            "tools": [
                {"type": "function", "function": {"name": "search"}},
                {"type": "function", "function": {"name": "other"}},
            ],
            "tool_choice": {"type": "function", "function": {"name": "search"}},
            "messages": [
                {"role": "user", "content": "find it"},
                {"role": "assistant", "tool_calls": [
                    {"id": "a", "type": "function",
                     "function": {"name": "search", "arguments": "{\"q\":1}"}}]},
                {"role": "tool", "tool_call_id": "a", "content": result},
                {"role": "assistant", "tool_calls": [
                    {"id": "b", "type": "function",
                     "function": {"name": "search", "arguments": "{\"q\":2}"}}]},
                {"role": "tool", "tool_call_id": "b", "content": result},
            ],
        })
    }

    fn apply(result: &str) -> (Result<(), HttpError>, Value) {
        let policy = Arc::new(CircuitPolicy::default());
        let mut b = body(result);
        let c = TurnCircuit::of_request(&policy, &b).expect("replayable");
        (c.apply_exhausted(&mut b), b)
    }

    #[test]
    fn a_fail_closed_budget_is_answered_without_the_model() {
        let (r, _) = apply("PermissionError: denied");
        let e = r.expect_err("answered by haltd");
        assert_eq!((e.status, e.code), (409, Some("TOOL_CIRCUIT_OPEN")));
        assert!(e.message.contains("`search`"), "{}", e.message);
        let (name, artifact) = e.detail.expect("the artifact");
        assert_eq!(name, "tool_circuit");
        assert_eq!(artifact["failure_class"], "permission/auth");
    }

    #[test]
    fn another_exhausted_budget_forwards_without_the_tool() {
        let (r, b) = apply("ValidationError: q must be a string");
        assert_eq!(r, Ok(()));
        let tools: Vec<&str> = b["tools"]
            .as_array()
            .expect("tools")
            .iter()
            .filter_map(|t| t.pointer("/function/name").and_then(Value::as_str))
            .collect();
        assert_eq!(tools, ["other"]);
        assert_eq!(b["tool_choice"], "auto");
        let last = b["messages"]
            .as_array()
            .and_then(|m| m.last())
            .expect("a note");
        assert_eq!(last["role"], "system");
        assert!(last["content"]
            .as_str()
            .is_some_and(|s| s.contains("validation")));
    }

    #[test]
    fn open_but_not_exhausted_changes_nothing() {
        let policy = Arc::new(CircuitPolicy::default());
        let mut b = body("HTTP 503");
        let before = b.clone();
        let c = TurnCircuit::of_request(&policy, &b).expect("replayable");
        assert_eq!(c.apply_exhausted(&mut b), Ok(()));
        assert_eq!(b, before);
    }

    #[test]
    fn a_transcript_that_cannot_be_replayed_is_refused() {
        let policy = Arc::new(CircuitPolicy::default());
        let b = serde_json::json!({"messages": [{"role": "tool", "content": "x"}]});
        let e = TurnCircuit::of_request(&policy, &b).expect_err("no tool_call_id");
        assert_eq!(e.status, 400);
    }
}
