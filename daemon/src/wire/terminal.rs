//! The terminal event of a halted stream (docs/wire-format.md): the final chunk with
//! `finish_reason: "content_filter"`, the typed error object and `[DONE]`, written so the kernel
//! gate recognises it by the trip's nonce at byte 31 ([`haltd_common::NONCE_OFFSET`]).

use std::{io::Write as _, sync::Arc};

use haltd_common::{HTTP_TERMINAL_PREFIX, SSE_TERMINAL_PREFIX};
use serde_json::{json, Value};

use crate::{
    codes::FailureCode,
    wire::{
        encode::ChunkEncoder,
        endpoint::Endpoint,
        http::write_head_fields,
        messages::terminal::HaltedEnd,
        responses::terminal::{self as responses, EVENTS_PER_TOKEN},
        stream_id::{nonce_hex, StreamId},
    },
};

/// Everything the terminal frame of a halted stream says.
#[derive(Debug, Clone)]
pub struct Halt {
    pub stream_id: StreamId,
    pub endpoint: Endpoint,
    pub created: u64,
    pub model: Arc<str>,
    pub code: FailureCode,
    pub trip_token_index: u64,
    pub post_trip_tokens: u64,
    pub nonce: u64,
    /// The turn ran in degraded safe mode (`x-haltd-mode: degraded` on a whole response).
    pub degraded: bool,
    /// Extra detail for the error object, e.g. `upstream: {kind, message}` of an
    /// UPSTREAM_FAILURE.
    pub detail: Vec<(&'static str, Value)>,
    /// The request's id, echoed as `x-request-id` in a whole response's head.
    pub request_id: Option<Arc<str>>,
    /// A Responses stream's next `sequence_number` at the trip (0 on the other endpoints):
    /// the terminal event's, before [`EVENTS_PER_TOKEN`] per post-trip token is added.
    pub sequence: u64,
}

impl Halt {
    /// The error object of the halted end of a stream (docs/wire-format.md).
    pub fn error_object(&self) -> Value {
        let mut obj = json!({
            "type": "halted",
            "code": self.code.as_str(),
            "message": format!("stream halted by haltd: {}", self.code.as_str()),
            "stream_id": self.stream_id.to_string(),
            "trip_token_index": self.trip_token_index,
            "post_trip_tokens": self.post_trip_tokens,
        });
        for (k, v) in &self.detail {
            obj[*k] = v.clone();
        }
        obj
    }

    /// What the Messages writers need of this halt.
    fn ended<'a>(&self, stream: crate::wire::messages::encode::Stream<'a>) -> HaltedEnd<'a> {
        HaltedEnd {
            code: self.code,
            halt: self.error_object(),
            output_tokens: self.trip_token_index + self.post_trip_tokens,
            stream,
        }
    }

    fn messages_end<'a>(&self, enc: &'a ChunkEncoder) -> HaltedEnd<'a> {
        self.ended(crate::wire::messages::encode::Stream {
            stream_id: enc.stream_id,
            model: &enc.model,
            blocks: &enc.blocks,
        })
    }

    /// What the Responses writers need of this halt.
    fn responses_end(&self) -> responses::HaltedEnd<'_> {
        responses::HaltedEnd {
            code: self.code,
            halt: self.error_object(),
            output_tokens: self.trip_token_index + self.post_trip_tokens,
            sequence: self.sequence + EVENTS_PER_TOKEN * self.post_trip_tokens,
            stream_id: self.stream_id,
            created: self.created,
            model: &self.model,
        }
    }

    /// The events after the nonce line; `whole` when no head (so no `message_start` of a
    /// Messages stream, no `response.created` of a Responses stream) went out before.
    fn sse_events(&self, out: &mut Vec<u8>, whole: bool) {
        if self.endpoint == Endpoint::Responses {
            return responses::halt_events(self.responses_end(), out, whole);
        }
        let enc = ChunkEncoder {
            endpoint: self.endpoint,
            stream_id: self.stream_id,
            created: self.created,
            model: Arc::clone(&self.model),
            logprobs: false,
            top_logprobs: 0,
            tool_calls: false,
            reasoning: false,
            blocks: std::cell::Cell::default(),
            output: std::cell::RefCell::default(),
        };
        if self.endpoint == Endpoint::Messages {
            let end = self.messages_end(&enc);
            return crate::wire::messages::terminal::halt_events(end, out, whole);
        }
        enc.final_chunk(out, "content_filter");
        let _ = write!(out, "data: {}\n\n", json!({ "error": self.error_object() }));
        out.extend_from_slice(b"data: [DONE]\n\n");
    }

    /// The terminal frame of a streaming response whose head was already sent: an SSE
    /// comment carrying the nonce at the offset the gate checks, then the final chunk with
    /// `finish_reason: "content_filter"`, the error event and `[DONE]`.
    pub fn sse_terminal(&self, out: &mut Vec<u8>) {
        out.extend_from_slice(SSE_TERMINAL_PREFIX);
        out.extend_from_slice(&nonce_hex(self.nonce));
        out.push(b'\n');
        self.sse_events(out, false);
    }

    /// [`Halt::sse_terminal`] for a chunked response (a kept connection, docs/wire-format.md
    /// "Persistent connections"): one chunk whose size line, written as 8 hex digits, is part
    /// of the 31 bytes before the nonce, so the nonce is still at
    /// [`haltd_common::NONCE_OFFSET`]; then the last chunk, so the response is complete. The
    /// connection closes after it.
    pub fn sse_terminal_chunked(&self, out: &mut Vec<u8>) {
        const SIZE_LINE: usize = 10;
        let start = out.len();
        out.extend_from_slice(b"00000000\r\n");
        out.extend_from_slice(&SSE_TERMINAL_PREFIX[..SSE_TERMINAL_PREFIX.len() - SIZE_LINE]);
        out.extend_from_slice(&nonce_hex(self.nonce));
        out.push(b'\n');
        self.sse_events(out, false);
        let payload = out.len() - start - SIZE_LINE;
        let size = format!("{payload:08x}");
        out[start..start + 8].copy_from_slice(size.as_bytes());
        out.extend_from_slice(b"\r\n");
        out.extend_from_slice(crate::wire::http::LAST_CHUNK);
    }

    /// The terminal frame when no response head went out yet: a whole response whose first
    /// header carries the nonce. `stream` picks an SSE body or the degraded-safe JSON body.
    pub fn http_terminal(&self, out: &mut Vec<u8>, stream: bool) {
        out.extend_from_slice(HTTP_TERMINAL_PREFIX);
        out.extend_from_slice(&nonce_hex(self.nonce));
        out.extend_from_slice(b"\r\n");
        let code = self.code.as_str();
        let mut headers = [("x-haltd-halted", code), ("", ""), ("", "")];
        let mut n = 1;
        if self.degraded {
            headers[n] = ("x-haltd-mode", "degraded");
            n += 1;
        }
        if let Some(rid) = self.request_id.as_deref() {
            headers[n] = ("x-request-id", rid);
            n += 1;
        }
        let extra = &headers[..n];
        if stream {
            write_head_fields(out, "text/event-stream", None, Some(self.stream_id), extra);
            self.sse_events(out, true);
        } else {
            let body = self.degraded_body();
            write_head_fields(
                out,
                "application/json",
                Some(body.len()),
                Some(self.stream_id),
                extra,
            );
            out.extend_from_slice(&body);
        }
    }

    /// The degraded-safe batch response: no content, `finish_reason: "content_filter"` and
    /// the error object, in the endpoint's response shape.
    pub fn degraded_body(&self) -> Vec<u8> {
        let (id, object, choice) = match self.endpoint {
            Endpoint::Responses => return responses::degraded_body(self.responses_end()),
            Endpoint::Messages => {
                let blocks = std::cell::Cell::default();
                let stream = crate::wire::messages::encode::Stream {
                    stream_id: self.stream_id,
                    model: &self.model,
                    blocks: &blocks,
                };
                return crate::wire::messages::terminal::degraded_body(self.ended(stream));
            }
            Endpoint::Chat => (
                format!("chatcmpl-{}", self.stream_id),
                "chat.completion",
                json!({"index": 0, "message": {"role": "assistant", "content": ""}, "logprobs": null, "finish_reason": "content_filter"}),
            ),
            Endpoint::Completion => (
                format!("cmpl-{}", self.stream_id),
                "text_completion",
                json!({"index": 0, "text": "", "logprobs": null, "finish_reason": "content_filter"}),
            ),
        };
        json!({
            "id": id,
            "object": object,
            "created": self.created,
            "model": &*self.model,
            "choices": [choice],
            "usage": {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0},
            "error": self.error_object(),
        })
        .to_string()
        .into_bytes()
    }
}

#[cfg(test)]
mod tests;
