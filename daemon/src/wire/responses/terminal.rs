//! The halted end of a Responses stream and a halted Response (docs/wire-format.md,
//! "Responses API").
//!
//! A halt ends the stream as the API ends a response cut short: `response.incomplete`, whose
//! response has `status: "incomplete"` and `incomplete_details.reason: "content_filter"`, and
//! carries haltd's halt object (code, stream id, trip index, post-trip tokens) as `haltd`.
//! Its usage says the output tokens the client got (τ plus the post-trip tokens). An upstream
//! failure is an `error` event instead, with haltd's halt object as its `error` member: the
//! openai SDK raises any event with an `error` member as `APIError` (message and body from it),
//! as it does chat's error event. The frame still begins with the SSE comment that carries the
//! nonce at byte 31 ([`haltd_common::SSE_TERMINAL_PREFIX`]), written by
//! [`crate::wire::terminal::Halt`].
//!
//! The terminal is encoded at the trip, and the events before it (a token frame writes at most
//! [`EVENTS_PER_TOKEN`] events) may still go out after the trip, up to B tokens: its
//! `sequence_number` is the stream's next one at the trip plus [`EVENTS_PER_TOKEN`] per
//! post-trip token, a count field of the prepared terminal (`halt/terminal.rs`). It is always
//! above every number sent before it, and the next one when no token followed the trip.

use serde_json::{json, Value};

use crate::{
    codes::FailureCode,
    wire::{
        responses::{
            encode::{write_event, write_start_events},
            object::{response_object, usage},
        },
        stream_id::StreamId,
    },
};

pub use crate::wire::responses::encode::EVENTS_PER_TOKEN;

/// What the halted end of a Responses stream says (the halt core's
/// [`crate::wire::Halt`] lends it).
#[derive(Debug)]
pub struct HaltedEnd<'a> {
    pub code: FailureCode,
    /// haltd's halt object (`Halt::error_object`).
    pub halt: Value,
    /// The trip's token index plus the post-trip tokens: the response's `output_tokens`.
    pub output_tokens: u64,
    /// The terminal event's `sequence_number` when the stream's head went out.
    pub sequence: u64,
    pub stream_id: StreamId,
    pub created: u64,
    pub model: &'a str,
}

/// The halted Response: no output haltd can vouch for, `status: "incomplete"` for a halt and
/// `"failed"` with an `error` for an upstream failure, haltd's halt object as `haltd`.
fn halted_response(end: &HaltedEnd<'_>) -> Value {
    let status = if end.code == FailureCode::UpstreamFailure {
        "failed"
    } else {
        "incomplete"
    };
    let n = end.output_tokens;
    let mut r = response_object(
        end.stream_id,
        end.created,
        end.model,
        status,
        Vec::new(),
        Some(usage(0, n, 0)),
    );
    if end.code == FailureCode::UpstreamFailure {
        r["error"] = json!({
            "code": "server_error",
            "message": format!("stream halted by haltd: {}", end.code.as_str()),
        });
    } else {
        r["incomplete_details"] = json!({"reason": "content_filter"});
    }
    r["haltd"] = end.halt.clone();
    r
}

/// The events after the nonce line of a halted Responses stream. `whole` writes the start
/// events first (a whole response: no head, so none of them, went out before), and numbers
/// the terminal after them.
pub fn halt_events(end: HaltedEnd<'_>, out: &mut Vec<u8>, whole: bool) {
    let seq = if whole {
        write_start_events(out, end.stream_id, end.created, end.model);
        2
    } else {
        end.sequence
    };
    if end.code == FailureCode::UpstreamFailure {
        let rest = json!({
            "code": "server_error",
            "message": format!("stream halted by haltd: {}", end.code.as_str()),
            "param": null,
            "error": end.halt,
        });
        return write_event(out, "error", seq, &rest);
    }
    write_event(
        out,
        "response.incomplete",
        seq,
        &json!({ "response": halted_response(&end) }),
    );
}

/// The degraded-safe body of a halted Responses turn (`stream: false`): the halted Response.
pub fn degraded_body(end: HaltedEnd<'_>) -> Vec<u8> {
    halted_response(&end).to_string().into_bytes()
}
