//! TokenCircuit in the turn pipeline (spec 002, docs/tokencircuit.md).
//!
//! A proxied chat turn with `[tool_circuit] enabled` starts with its conversation's circuit,
//! rebuilt from the request's own transcript (`circuit::transcript`) and its conversation's
//! backoff clock (`circuit::store`). The model's tool-call deltas are observed and scanned
//! like any output, then held here instead of queued for the client, per call: a call is
//! whole once a later call starts (calls stream in index order) or the turn's text ends,
//! and is judged then. A call its key's budget forbids halts the stream with
//! `TOOL_CIRCUIT_OPEN` and the diagnostic artifact in the error object, through the same
//! trip as any other halt (kernel-enforced, the incident recorded), before a byte of it
//! reached the client; an allowed call's held deltas go out at once, in order, framed as
//! they would have been.

use std::{io, sync::Arc, time::Instant};

use serde_json::Value;

use crate::dataplane::turn::circuit_record;
use crate::dataplane::turn::own_trip;
use crate::dataplane::turn::Turn;
use crate::dataplane::Step;
use crate::{
    circuit::{
        dispatched::{arguments_digest, Dispatched, DispatchedCall, Guard, Outcome},
        store::{ConversationId, ConversationStore},
        transcript::{answered_ids, rebuild_with, tool_call},
        Circuit, CircuitPolicy, Verdict,
    },
    codes::FailureCode,
    modes::KeyId,
    stream::Initiator,
    upstream::{framing::ToolCallPart, UpToken},
    wire::HttpError,
};

/// The kernel accepted the frame (streaming) or the response (batch) that carried the tool
/// calls `calls` (`{index, id, name}`, the TURN-ACID record's dispatched calls): they
/// reached the client. A call released but never noted here was halted before it was
/// delivered; its result, if one ever comes back, is not a dispatched call's.
pub(in crate::dataplane) fn delivered(
    store: &ConversationStore,
    circuit: Option<&TurnCircuit>,
    calls: &[Value],
) {
    let Some(tc) = circuit else {
        return;
    };
    let ids = calls
        .iter()
        .filter_map(|c| c.get("id").and_then(Value::as_str));
    store.delivered(&tc.conversation, ids, Instant::now());
}

/// A tool-call delta held until its turn's calls are judged.
#[derive(Debug)]
struct HeldDelta {
    parts: Vec<ToolCallPart>,
    tokens: Vec<UpToken>,
    started: Vec<Value>,
    arrived_ns: u64,
    /// Where its text ended in the scanned output.
    scanned: usize,
    /// The highest call index among its parts: it goes out once that call is judged.
    last_call: u32,
}

/// A turn's circuit and the deltas it holds.
#[derive(Debug)]
pub(in crate::dataplane) struct TurnCircuit {
    circuit: Circuit,
    conversation: ConversationId,
    /// Held deltas, in order (released from the front).
    held: std::collections::VecDeque<HeldDelta>,
    /// Calls judged and let out so far (by index: calls `0..judged_calls`).
    judged_calls: usize,
    /// The highest call index seen: every call below it is complete (calls stream in order).
    newest_call: usize,
    /// The end of the turn was judged.
    judged: bool,
    /// A delta added to a call already judged (calls must stream in index order): what was
    /// judged is not what would go out, so the turn fails closed.
    out_of_order: bool,
}

/// A request's arrival, as the conversation store needs it.
pub(in crate::dataplane) struct Arrival<'a> {
    pub store: &'a ConversationStore,
    /// The client's `x-haltd-conversation-id`.
    pub header: Option<&'a str>,
    pub key: KeyId,
    pub now: Instant,
}

impl TurnCircuit {
    /// The conversation the turn belongs to.
    pub(in crate::dataplane) fn conversation(&self) -> &ConversationId {
        &self.conversation
    }

    /// The circuit of a chat request's conversation, rebuilt from its `messages` with the
    /// conversation's backoff clock (the results it carries for the first time arrived
    /// now). A transcript haltd cannot replay (a tool call without an id or name, a tool
    /// result without a `tool_call_id`) is refused: its calls could not be judged.
    pub(in crate::dataplane) fn of_request(
        policy: &Arc<CircuitPolicy>,
        json: &Value,
        at: &Arrival<'_>,
    ) -> Result<Self, HttpError> {
        let messages = json
            .get("messages")
            .and_then(Value::as_array)
            .map_or(&[][..], Vec::as_slice);
        let conversation = ConversationId::of(at.header, &at.key.fingerprint(), messages);
        let (timeline, memory) = at
            .store
            .arrive(&conversation, &answered_ids(messages), at.now);
        // The failed calls the store remembers come first: a transcript that trimmed or
        // flattened them away does not restore a budget (`circuit/memory.rs`).
        let (circuit, failed) = rebuild_with(Arc::clone(policy), messages, &timeline, &memory)
            .map_err(|e| HttpError::bad_request(format!("messages: {e}")))?;
        at.store.remember(&conversation, failed, at.now);
        at.store
            .observe(&conversation, circuit.open_artifacts(), at.now);
        Ok(TurnCircuit {
            circuit,
            conversation,
            held: std::collections::VecDeque::new(),
            judged_calls: 0,
            newest_call: 0,
            judged: false,
            out_of_order: false,
        })
    }

    /// A request whose conversation has used up a key's budget. permission/auth and
    /// invariant_violation: haltd answers itself, without calling the model (409, type
    /// `tool_circuit_open`, code `TOOL_CIRCUIT_OPEN`, the artifact as `tool_circuit` and a
    /// summary the model can read as the message; `x-should-retry: false`). Any other class: the turn is forwarded
    /// with the exhausted tools removed from `tools` (and from `tool_choice` when it names
    /// one) and a system message saying why, so the model can summarize instead of retrying.
    pub(in crate::dataplane) fn apply_exhausted(
        &self,
        req: &mut crate::wire::ClientRequest,
        at: &Arrival<'_>,
    ) -> Result<(), Box<Refusal>> {
        let exhausted = self.circuit.exhausted();
        if let Some(a) = exhausted.iter().find(|a| a.failure_class.fails_closed()) {
            let mut a = a.clone();
            a.tokens_saved = at.store.answered(&self.conversation, at.now);
            let a = &a;
            at.store.intervened(&self.conversation, a.clone(), at.now);
            let artifact = serde_json::to_value(a).unwrap_or(Value::Null);
            return Err(Box::new(Refusal {
                // Not to be retried: the conversation's history keeps the failure, so a
                // retry gets this answer again (and would count it again).
                error: HttpError::new(409, "tool_circuit_open", a.summary())
                    .with_code("TOOL_CIRCUIT_OPEN")
                    .without_retry()
                    .with_detail("tool_circuit", artifact),
                answered: Some(Box::new((self.conversation.clone(), a.clone()))),
            }));
        }
        if exhausted.is_empty() {
            return Ok(());
        }
        let surface = req.endpoint;
        let body = req.json_mut();
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
        // Passed through: the same edit, in the surface's own fields.
        if let (Some(surface), Some(own)) = (
            crate::upstream::UpstreamSurface::of(surface),
            req.native_mut(),
        ) {
            crate::upstream::native::withhold_tools(surface, own, &names, &note.join("\n"));
        }
        Ok(())
    }

    /// Holds an observed, scanned tool-call delta (allocates per delta: a call's deltas are
    /// kept until it is complete and judged).
    pub(in crate::dataplane) fn hold(
        &mut self,
        parts: Vec<ToolCallPart>,
        tokens: Vec<UpToken>,
        started: Vec<Value>,
        arrived_ns: u64,
        scanned: usize,
    ) {
        let last_call = parts.iter().map(|p| p.index).max().unwrap_or(0);
        // An empty piece changes nothing: some servers close a call with one.
        let late = |p: &ToolCallPart| p.has_header() || !p.arguments.is_empty();
        if parts
            .iter()
            .any(|p| (p.index as usize) < self.judged_calls && late(p))
        {
            self.out_of_order = true;
        }
        self.newest_call = self.newest_call.max(last_call as usize);
        self.held.push_back(HeldDelta {
            parts,
            tokens,
            started,
            arrived_ns,
            scanned,
            last_call,
        });
    }

    /// The calls complete but not judged yet: those below the newest call seen, or, at the
    /// end of the turn (`all`), every one left.
    fn complete(&self, merged: &[Value], all: bool) -> std::ops::Range<usize> {
        let end = if all {
            merged.len()
        } else {
            self.newest_call.min(merged.len())
        };
        self.judged_calls.min(end)..end
    }

    /// The held deltas whose calls are all judged (`all`: every call is), in order.
    fn releasable(&mut self, all: bool) -> Vec<HeldDelta> {
        let mut out = Vec::new();
        while self
            .held
            .front()
            .is_some_and(|d| all || (d.last_call as usize) < self.judged_calls)
        {
            out.extend(self.held.pop_front());
        }
        out
    }

    /// Judges the turn's merged calls in order, emitted at `now` (a transient retry before
    /// its backoff elapsed is charged double); the first denial, if any. `calls` are the
    /// calls from index `judged_calls` on.
    fn judge(&mut self, calls: &[Value], dispatched: &Dispatched, now: Instant) -> Option<Verdict> {
        for (index, call) in calls.iter().enumerate() {
            // A call without an id or name cannot be judged: fail closed.
            let Ok(call) = tool_call(call, index) else {
                let name = call["function"]["name"].as_str().unwrap_or("");
                let why = "the model emitted a tool call without an id or a name: it cannot \
                           be judged, so it is not sent";
                return Some(Verdict::Deny(Box::new(self.unjudgeable(name, why))));
            };
            // A retry of a failed turn's dispatched call waits for its reconciliation.
            let digest = arguments_digest(call.arguments);
            let guard = dispatched.guard(&self.conversation, call.name, &digest);
            if let Guard::Refused(d) = &guard {
                return Some(Verdict::Deny(Box::new(self.unreconciled(d))));
            }
            let verdict = self.circuit.judge(call, Some(now));
            if let Verdict::Deny(_) = verdict {
                return Some(verdict);
            }
            if let Guard::RetryOnce(reference) = guard {
                dispatched.retried(&reference);
            }
            self.circuit.record_call(call, Some(now));
            self.judged_calls += 1;
        }
        None
    }

    /// The artifact of a retry of a dispatched call `d` that is not reconciled, or was
    /// reconciled `done` or `compensated`: an ambiguous effect past its boundary.
    fn unreconciled(&self, d: &DispatchedCall) -> crate::circuit::DiagnosticArtifact {
        let class = crate::circuit::FailureClass::AmbiguousEffect;
        let why = match d.outcome {
            None => format!(
                "call {} ({}) with these arguments was delivered in a turn that failed (stream \
                 {}); it may have taken effect, so a retry waits until an operator reconciles \
                 it: haltctl reconcile {} --outcome done|not_done|compensated",
                d.call_id, d.tool, d.stream_id, d.reference
            ),
            Some(Outcome::Done) => format!(
                "call {} ({}) was reconciled as done: it took effect, and a retry would \
                 duplicate it",
                d.call_id, d.tool
            ),
            Some(o) => format!(
                "call {} ({}) was reconciled as {}: a retry would redo what was undone",
                d.call_id,
                d.tool,
                o.as_str()
            ),
        };
        crate::circuit::DiagnosticArtifact {
            equivalence_key: crate::circuit::EquivalenceKey {
                tool_name: d.tool.clone(),
                resource_class: None,
                auth_scope: None,
                error_class: class,
                side_effect_boundary: true,
            },
            failure_class: class,
            next_action: class.next_action(),
            budget: self.circuit.policy().budgets.of(class),
            budget_exhausted: true,
            retry_count: 0,
            sample_receipts: Vec::new(),
            safety_justification: why,
            policy: self.circuit.policy().in_force(),
            tokens_saved: None,
        }
    }

    /// The artifact of a call that cannot be judged: fail closed, as an invariant violation.
    fn unjudgeable(&self, name: &str, why: &str) -> crate::circuit::DiagnosticArtifact {
        crate::circuit::DiagnosticArtifact {
            equivalence_key: crate::circuit::EquivalenceKey {
                tool_name: name.to_owned(),
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
            safety_justification: why.to_owned(),
            policy: self.circuit.policy().in_force(),
            tokens_saved: None,
        }
    }
}

/// A request refused before the model was called: an invalid request, or one TokenCircuit
/// answered itself (with the conversation and the artifact).
#[derive(Debug)]
pub(in crate::dataplane) struct Refusal {
    pub error: HttpError,
    pub answered: Option<Box<(ConversationId, crate::circuit::DiagnosticArtifact)>>,
}

impl From<HttpError> for Box<Refusal> {
    fn from(error: HttpError) -> Self {
        Box::new(Refusal {
            error,
            answered: None,
        })
    }
}

impl Refusal {
    /// Counts and records a request TokenCircuit answered without the model (its 409), by
    /// class; the error to answer.
    pub(in crate::dataplane) fn settle(
        self,
        shared: &crate::halt::HaltCore,
        stream_id: String,
    ) -> HttpError {
        if let Some((conv, artifact)) = self.answered.as_deref() {
            shared.metrics.circuit.tripped(artifact.failure_class);
            shared
                .metrics
                .circuit
                .saved(artifact.tokens_saved.unwrap_or(0));
            let action = circuit_record::Action::Answered;
            circuit_record::record(shared, conv, action, artifact, Some(stream_id));
        }
        self.error
    }
}

/// What judging a turn's held tool calls found (`judge_held`).
#[derive(Debug)]
pub(in crate::dataplane) enum CircuitJudged {
    /// Nothing to judge yet, or every call judged is allowed (its held deltas are queued).
    Pass,
    /// A call is forbidden: its conversation and the artifact; the stream must halt with
    /// `TOOL_CIRCUIT_OPEN`, and nothing held goes out.
    Denied(Box<(ConversationId, crate::circuit::DiagnosticArtifact)>),
}

/// Judges the calls the turn's held deltas show complete (a later call started, or, `at_end`,
/// every call left) against the conversation's circuit, in order, at `now`; the held deltas
/// of allowed calls join the hold queue for the client, and a denial drops them all. The
/// store learns what was judged, let out or denied. No I/O: the caller records a denial and
/// halts.
pub(in crate::dataplane) fn judge_held(
    turn: &mut Turn,
    store: &ConversationStore,
    at_end: bool,
    now: Instant,
) -> CircuitJudged {
    let Some(tc) = turn.circuit.as_mut().filter(|c| !c.judged) else {
        return CircuitJudged::Pass;
    };
    tc.judged = at_end;
    let merged = turn.source.upstream().map_or(&[][..], |s| s.tool_calls());
    let range = tc.complete(merged, at_end);
    if range.is_empty() && !at_end && !tc.out_of_order {
        return CircuitJudged::Pass;
    }
    // Per judged call (never per token): the calls are copied out and the store's lock taken.
    let calls = merged[range].to_vec();
    let denied = if tc.out_of_order {
        let why = "the model added to a tool call after a later call had started: the call \
                   was judged as it stood, so the rest is not sent";
        Some(Verdict::Deny(Box::new(tc.unjudgeable("", why))))
    } else {
        tc.judge(&calls, &store.dispatched, now)
    };
    store.observe(&tc.conversation, tc.circuit.open_artifacts(), now);
    if at_end || denied.is_some() {
        // The turn's generation is over: its tokens feed the tokens-saved estimate.
        store.generated(&tc.conversation, turn.tokens_generated, now);
    }
    if let Some(Verdict::Deny(artifact)) = denied {
        tc.held.clear();
        tc.judged = true;
        store.intervened(&tc.conversation, (*artifact).clone(), now);
        return CircuitJudged::Denied(Box::new((tc.conversation.clone(), *artifact)));
    }
    // Let out now: the instant the backoff clock measures the next retry from. Delivered once
    // the kernel accepts the frame that starts it (`delivered`).
    let ids = calls
        .iter()
        .filter_map(|c| c.get("id").and_then(Value::as_str));
    store.emitted(&tc.conversation, ids, now);
    for d in tc.releasable(at_end) {
        turn.hold
            .push_tool_calls_ending(d.parts, d.tokens, &d.started, d.arrived_ns, d.scanned);
    }
    CircuitJudged::Pass
}

impl Step<'_> {
    /// After a held tool-call delta: the calls it shows complete (a later call started) are
    /// judged, and the held deltas of judged calls go out, so a call streams as soon as it
    /// is whole. A forbidden call halts the stream (returns false) before any of it is sent.
    pub(in crate::dataplane) fn circuit_release(&mut self) -> io::Result<bool> {
        self.circuit_judge(false)
    }

    /// At the end of the turn's text: judge every call left; a forbidden one halts the
    /// stream (returns false), else the held deltas are queued for the client.
    pub(in crate::dataplane) fn circuit_at_end(&mut self) -> io::Result<bool> {
        self.circuit_judge(true)
    }

    fn circuit_judge(&mut self, at_end: bool) -> io::Result<bool> {
        let Some(turn) = self.conn.turn.as_mut() else {
            return Ok(false);
        };
        let store = &self.io.shared.circuits;
        let CircuitJudged::Denied(denied) = judge_held(turn, store, at_end, Instant::now()) else {
            return Ok(true);
        };
        let (conversation, artifact) = *denied;
        let action = circuit_record::Action::Halted;
        let id = Some(self.conn.id.to_string());
        circuit_record::record(&self.io.shared, &conversation, action, &artifact, id);
        self.circuit_trip(&artifact)?;
        Ok(false)
    }

    /// Halts the stream with `TOOL_CIRCUIT_OPEN`, the artifact in the error object. Not a
    /// breach: the key is not degraded (`modes::cause_degrades`).
    fn circuit_trip(&mut self, artifact: &crate::circuit::DiagnosticArtifact) -> io::Result<()> {
        let shared = Arc::clone(&self.io.shared);
        let id = self.conn.id;
        tracing::info!(stream_id = %id, key = %artifact.equivalence_key, justification = %artifact.safety_justification, "tool circuit open: the call is not sent");
        shared.metrics.circuit.tripped(artifact.failure_class);
        shared.meta(id.slot).tool_circuit = serde_json::to_value(artifact).ok();
        let own = own_trip::trip_own(
            &shared,
            id,
            FailureCode::ToolCircuitOpen,
            Initiator::Detector,
        );
        if let own_trip::OwnTrip::AlreadyTripped(first) = own {
            // Another cause came first: its record must not carry this artifact as the cause.
            if first != FailureCode::ToolCircuitOpen {
                shared.meta(id.slot).tool_circuit = None;
            }
        }
        self.halt()
    }
}

#[cfg(test)]
mod tests;
