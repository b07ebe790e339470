//! The halted end of a Messages stream and Messages error bodies (docs/wire-format.md,
//! "Messages API").
//!
//! A halt ends the stream as Anthropic's own streaming classifiers do: a `message_delta` whose
//! `stop_reason` is `"refusal"`, then `message_stop`. haltd's halt object (code, stream id,
//! trip index, post-trip tokens) rides on the `message_delta` as `haltd`. An upstream failure
//! is an `error` event instead (`api_error`), which the SDKs raise as an exception. The frame
//! still begins with the SSE comment that carries the nonce at byte 31
//! ([`haltd_common::SSE_TERMINAL_PREFIX`]), written by [`crate::wire::terminal::Halt`].

use serde_json::{json, Value};

use crate::{
    codes::FailureCode,
    wire::messages::encode::{self, Stream},
};

/// What the halted end of a Messages stream says (the halt core's [`crate::wire::Halt`]
/// lends it).
#[derive(Debug)]
pub struct HaltedEnd<'a> {
    pub code: FailureCode,
    /// haltd's halt object (`Halt::error_object`).
    pub halt: Value,
    /// The trip's token index plus the post-trip tokens: the stream's `output_tokens`.
    pub output_tokens: u64,
    pub stream: Stream<'a>,
}

/// The events after the nonce line of a halted Messages stream. `with_start` writes
/// `message_start` first (a whole response: no head, so no `message_start`, went out before).
pub fn halt_events(end: HaltedEnd<'_>, out: &mut Vec<u8>, with_start: bool) {
    if with_start {
        encode::message_start(end.stream, out);
    }
    if end.code == FailureCode::UpstreamFailure {
        let body = json!({"type": "error", "error": {
            "type": "api_error",
            "message": format!("stream halted by haltd: {}", end.code.as_str()),
            "haltd": end.halt,
        }});
        out.extend_from_slice(b"event: error\ndata: ");
        let _ = serde_json::to_writer(&mut *out, &body);
        out.extend_from_slice(b"\n\n");
        return;
    }
    let delta = json!({
        "type": "message_delta",
        "delta": {"stop_reason": "refusal", "stop_sequence": null},
        "usage": {"output_tokens": end.output_tokens},
        "haltd": end.halt,
    });
    out.extend_from_slice(b"event: message_delta\ndata: ");
    let _ = serde_json::to_writer(&mut *out, &delta);
    out.extend_from_slice(b"\n\n");
    out.extend_from_slice(encode::MESSAGE_STOP);
}

/// The degraded-safe batch body of a halted Messages turn: no content, `stop_reason:
/// "refusal"`, haltd's halt object as `haltd`.
pub fn degraded_body(end: HaltedEnd<'_>) -> Vec<u8> {
    json!({
        "id": format!("msg_{}", end.stream.stream_id),
        "type": "message",
        "role": "assistant",
        "model": end.stream.model,
        "content": [],
        "stop_reason": "refusal",
        "stop_sequence": null,
        "usage": {"input_tokens": 0, "output_tokens": 0},
        "haltd": end.halt,
    })
    .to_string()
    .into_bytes()
}

/// The Messages error `type` for a status (Anthropic's error types, by which its SDKs
/// pick an exception class together with the status).
pub fn error_type(status: u16) -> &'static str {
    match status {
        401 => "authentication_error",
        403 => "permission_error",
        404 => "not_found_error",
        413 => "request_too_large",
        429 => "rate_limit_error",
        503 | 529 => "overloaded_error",
        500..=599 => "api_error",
        _ => "invalid_request_error",
    }
}
