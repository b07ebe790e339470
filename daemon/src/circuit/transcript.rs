//! Rebuilding a conversation's circuit from a request's own transcript.
//!
//! Every chat request carries the whole history: the assistant messages with their
//! `tool_calls` and the `role: "tool"` results with their `tool_call_id`. Replaying it
//! through the state machine gives the circuit's state with no store, so it survives a
//! restart. What the transcript does not carry is time: haltd keeps a [`Timeline`] (when a
//! call went out, when its failed result arrived) in memory for the backoff clock; without
//! it, past retries are charged one unit each. Nor does it say whether a call reached the
//! client: the timeline keeps which released calls the kernel accepted ([`Timeline::dispatched`]).

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::Instant;

use serde_json::Value;

use super::machine::{Circuit, ToolCall};
use super::memory::{FailedCall, Memory};
use super::policy::CircuitPolicy;

/// The backoff clock: instants haltd saw, by tool-call id; and which calls reached the
/// client.
#[derive(Clone, Debug, Default)]
pub struct Timeline {
    /// When haltd let a call out to the client (released it from its hold, after judging it).
    pub emitted: HashMap<String, Instant>,
    /// When a request carrying a call's result arrived.
    pub arrived: HashMap<String, Instant>,
    /// The calls of `emitted` whose first frame the kernel accepted (the TURN-ACID record's
    /// dispatched calls, `dataplane/conn/send.rs`): always a subset of `emitted`.
    pub delivered: HashSet<String>,
}

impl Timeline {
    /// Whether call `id` counts as dispatched when its result comes back. Only a call haltd
    /// released but whose frame the kernel never accepted (the stream was halted first) is
    /// known undelivered; one haltd does not know (never released here: another instance,
    /// a restart, an evicted conversation) counts as dispatched, failing closed.
    pub fn dispatched(&self, id: &str) -> bool {
        !self.emitted.contains_key(id) || self.delivered.contains(id)
    }
}

/// A transcript haltd cannot replay.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum TranscriptError {
    #[error("message {index}: a tool call has no {field}")]
    ToolCallField { index: usize, field: &'static str },
    #[error("message {index}: a tool result has no string tool_call_id")]
    ToolCallId { index: usize },
}

/// Replays `messages` (a chat request's `messages` array) into a circuit.
pub fn rebuild(
    policy: Arc<CircuitPolicy>,
    messages: &[Value],
    timeline: &Timeline,
) -> Result<Circuit, TranscriptError> {
    rebuild_with(policy, messages, timeline, &Memory::default()).map(|(c, _)| c)
}

/// Replays the failed calls `memory` holds that `messages` no longer carries (trimmed or
/// flattened away), oldest first, then `messages` itself. Returns the circuit and the failed
/// calls `messages` shows, for the store to remember.
pub fn rebuild_with(
    policy: Arc<CircuitPolicy>,
    messages: &[Value],
    timeline: &Timeline,
    memory: &Memory,
) -> Result<(Circuit, Vec<FailedCall>), TranscriptError> {
    let mut circuit = Circuit::new(policy);
    let answered: HashSet<&str> = answered_ids(messages).into_iter().collect();
    let called: HashSet<&str> = call_ids(messages).collect();
    // Calls the transcript no longer carries: replayed from memory, with their result unless
    // the transcript still carries it (it then comes from the transcript, in its place).
    for f in memory.calls().filter(|f| !called.contains(f.id.as_str())) {
        let call = ToolCall {
            id: &f.id,
            name: &f.name,
            arguments: &f.arguments,
        };
        circuit.record_call(call, timeline.emitted.get(call.id).copied());
        if !answered.contains(call.id) {
            let arrived = timeline.arrived.get(call.id).copied();
            circuit.record_result(call.id, &f.result, arrived, timeline.dispatched(call.id));
        }
    }
    let mut calls: HashMap<&str, ToolCall<'_>> = HashMap::new();
    let mut failed = Vec::new();
    for (index, message) in messages.iter().enumerate() {
        match message.get("role").and_then(Value::as_str) {
            Some("assistant") => {
                let list = message.get("tool_calls").and_then(Value::as_array);
                for call in list.into_iter().flatten() {
                    let call = tool_call(call, index)?;
                    calls.insert(call.id, call);
                    circuit.record_call(call, timeline.emitted.get(call.id).copied());
                }
            }
            Some("tool") => {
                let id = message
                    .get("tool_call_id")
                    .and_then(Value::as_str)
                    .ok_or(TranscriptError::ToolCallId { index })?;
                let content = content_text(message.get("content"));
                // Its id came back: dispatched if it was delivered too (or haltd cannot tell).
                let arrived = timeline.arrived.get(id).copied();
                let class = circuit.record_result(id, &content, arrived, timeline.dispatched(id));
                if let (Some(_), Some(c)) = (class, calls.get(id)) {
                    failed.push(FailedCall::new(id, c.name, c.arguments, &content));
                }
            }
            _ => {}
        }
    }
    Ok((circuit, failed))
}

/// A tool call of an assistant message (`{id, type, function: {name, arguments}}`).
pub fn tool_call(call: &Value, index: usize) -> Result<ToolCall<'_>, TranscriptError> {
    fn field<'a>(
        v: Option<&'a Value>,
        index: usize,
        field: &'static str,
    ) -> Result<&'a str, TranscriptError> {
        v.and_then(Value::as_str)
            .ok_or(TranscriptError::ToolCallField { index, field })
    }
    let function = call.get("function");
    Ok(ToolCall {
        id: field(call.get("id"), index, "id")?,
        name: field(function.and_then(|f| f.get("name")), index, "function.name")?,
        arguments: function
            .and_then(|f| f.get("arguments"))
            .and_then(Value::as_str)
            .unwrap_or(""),
    })
}

/// A message's content as text: a string, or the text parts of a content array.
pub fn content_text(content: Option<&Value>) -> String {
    match content {
        Some(Value::String(s)) => s.clone(),
        Some(Value::Array(parts)) => parts
            .iter()
            .filter_map(|p| p.get("text").and_then(Value::as_str))
            .collect::<Vec<_>>()
            .join("\n"),
        _ => String::new(),
    }
}

/// The ids of the tool calls the transcript's assistant messages carry.
fn call_ids(messages: &[Value]) -> impl Iterator<Item = &str> {
    messages
        .iter()
        .filter(|m| m.get("role").and_then(Value::as_str) == Some("assistant"))
        .filter_map(|m| m.get("tool_calls").and_then(Value::as_array))
        .flatten()
        .filter_map(|c| c.get("id").and_then(Value::as_str))
}

/// The ids of the tool calls the transcript's results answer.
pub fn answered_ids(messages: &[Value]) -> Vec<&str> {
    messages
        .iter()
        .filter(|m| m.get("role").and_then(Value::as_str) == Some("tool"))
        .filter_map(|m| m.get("tool_call_id").and_then(Value::as_str))
        .collect()
}
