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

    /// The events after the nonce line; `whole` when no head (so no `message_start` of a
    /// Messages stream) went out before.
    fn sse_events(&self, out: &mut Vec<u8>, whole: bool) {
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
mod tests {
    use haltd_common::{NONCE_LEN, NONCE_OFFSET};

    use super::*;

    fn id() -> StreamId {
        StreamId {
            slot: 3,
            generation: 9,
        }
    }

    fn halt() -> Halt {
        Halt {
            stream_id: id(),
            endpoint: Endpoint::Chat,
            created: 1,
            model: "builtin".into(),
            code: FailureCode::OperatorTrip,
            trip_token_index: 12,
            post_trip_tokens: 2,
            nonce: 0xfeed_f00d_0000_0001,
            degraded: false,
            detail: Vec::new(),
            request_id: None,
        }
    }

    #[test]
    fn terminal_frames_carry_the_nonce_where_the_gate_looks() {
        for endpoint in [Endpoint::Chat, Endpoint::Completion, Endpoint::Messages] {
            for code in [FailureCode::OperatorTrip, FailureCode::UpstreamFailure] {
                let h = Halt {
                    endpoint,
                    code,
                    ..halt()
                };
                nonce_at_the_offset(&h);
            }
        }
    }

    fn nonce_at_the_offset(h: &Halt) {
        for frame in [
            {
                let mut o = Vec::new();
                h.sse_terminal(&mut o);
                o
            },
            {
                let mut o = Vec::new();
                h.sse_terminal_chunked(&mut o);
                o
            },
            {
                let mut o = Vec::new();
                h.http_terminal(&mut o, true);
                o
            },
            {
                let mut o = Vec::new();
                h.http_terminal(&mut o, false);
                o
            },
        ] {
            assert_eq!(
                &frame[NONCE_OFFSET..NONCE_OFFSET + NONCE_LEN],
                b"feedf00d00000001"
            );
        }
    }

    #[test]
    fn sse_terminal_is_content_filter_then_error_then_done() {
        let mut o = Vec::new();
        halt().sse_terminal(&mut o);
        let text = String::from_utf8(o).expect("utf8");
        let events: Vec<&str> = text.split("\n\n").filter(|e| !e.is_empty()).collect();
        assert_eq!(events.len(), 3, "{text}");
        let first = events[0]
            .lines()
            .find(|l| l.starts_with("data: "))
            .expect("data line");
        let chunk: Value = serde_json::from_str(&first[6..]).expect("json");
        assert_eq!(chunk["choices"][0]["finish_reason"], "content_filter");
        let err: Value = serde_json::from_str(&events[1][6..]).expect("json");
        assert_eq!(err["error"]["type"], "halted");
        assert_eq!(err["error"]["code"], "OPERATOR_TRIP");
        assert_eq!(err["error"]["trip_token_index"], 12);
        assert_eq!(err["error"]["post_trip_tokens"], 2);
        assert_eq!(events[2], "data: [DONE]");
    }

    #[test]
    fn the_chunked_terminal_is_one_chunk_then_the_last_chunk() {
        let (mut plain, mut chunked) = (Vec::new(), Vec::new());
        halt().sse_terminal(&mut plain);
        halt().sse_terminal_chunked(&mut chunked);
        let size_end = chunked
            .windows(2)
            .position(|w| w == b"\r\n")
            .expect("size line");
        assert_eq!(size_end, 8);
        let size = usize::from_str_radix(std::str::from_utf8(&chunked[..8]).expect("hex"), 16)
            .expect("hex size");
        let payload = &chunked[10..10 + size];
        assert_eq!(&chunked[10 + size..], b"\r\n0\r\n\r\n");
        // The payload is the plain terminal with ten fewer spaces before the nonce.
        assert!(payload.starts_with(b": haltd-halt "));
        assert_eq!(payload.len() + 10, plain.len());
        assert_eq!(&payload[21..], &plain[31..]);
    }

    /// The SSE events of a frame (after the nonce comment): (event name, data JSON).
    fn messages_events(frame: &[u8]) -> Vec<(String, Value)> {
        let text = std::str::from_utf8(frame).expect("utf8");
        let sse = text.split_once("\r\n\r\n").map_or(text, |(_, body)| body);
        sse.split("\n\n")
            .filter(|e| !e.trim().is_empty())
            .map(|e| {
                let mut lines = e.lines().filter(|l| !l.starts_with(':'));
                let name = lines.next().and_then(|l| l.strip_prefix("event: "));
                let data = lines.next().and_then(|l| l.strip_prefix("data: "));
                let data: Value = serde_json::from_str(data.expect("data")).expect("json");
                (name.expect("event").to_owned(), data)
            })
            .collect()
    }

    #[test]
    fn a_halted_messages_stream_ends_with_a_refusal_and_message_stop() {
        let h = Halt {
            endpoint: Endpoint::Messages,
            ..halt()
        };
        let mut sse = Vec::new();
        h.sse_terminal(&mut sse);
        let ev = messages_events(&sse);
        let names: Vec<&str> = ev.iter().map(|(n, _)| n.as_str()).collect();
        assert_eq!(names, ["message_delta", "message_stop"]);
        assert_eq!(ev[0].1["delta"]["stop_reason"], "refusal");
        assert_eq!(ev[0].1["haltd"]["code"], "OPERATOR_TRIP");
        assert_eq!(ev[0].1["haltd"]["post_trip_tokens"], 2);
        assert_eq!(ev[0].1["usage"]["output_tokens"], 14);
        // A whole response: no head went out before, so message_start comes first.
        let mut whole = Vec::new();
        h.http_terminal(&mut whole, true);
        let ev = messages_events(&whole);
        let names: Vec<&str> = ev.iter().map(|(n, _)| n.as_str()).collect();
        assert_eq!(names, ["message_start", "message_delta", "message_stop"]);
        let failed = Halt {
            code: FailureCode::UpstreamFailure,
            ..h.clone()
        };
        let mut sse = Vec::new();
        failed.sse_terminal(&mut sse);
        let ev = messages_events(&sse);
        assert_eq!(ev.len(), 1);
        assert_eq!(ev[0].0, "error");
        assert_eq!(ev[0].1["error"]["type"], "api_error");
        assert_eq!(ev[0].1["error"]["haltd"]["code"], "UPSTREAM_FAILURE");
        let v: Value = serde_json::from_slice(&h.degraded_body()).expect("json");
        assert_eq!(v["type"], "message");
        assert_eq!(v["content"], serde_json::json!([]));
        assert_eq!(v["stop_reason"], "refusal");
        assert_eq!(v["haltd"]["code"], "OPERATOR_TRIP");
    }

    #[test]
    fn degraded_batch_body_has_no_content_and_the_error() {
        let v: Value = serde_json::from_slice(&halt().degraded_body()).expect("json");
        assert_eq!(v["choices"][0]["message"]["content"], "");
        assert_eq!(v["choices"][0]["finish_reason"], "content_filter");
        assert_eq!(v["error"]["code"], "OPERATOR_TRIP");
    }
}
