//! SSE chunks and JSON bodies out (docs/wire-format.md): one token event per frame, the final
//! events of a stream, and the whole body of a batch response. [`bound`] is the bound on one token
//! event (the kernel gate's per-stream byte size); the terminal event of a halted stream is
//! [`crate::wire::terminal`].
//!
//! Token chunks are written straight into the connection's reused buffer (no allocation per
//! token once the buffer has grown); the rarer shapes (batch bodies) use `serde_json::Value`.

use std::{
    cell::{Cell, RefCell},
    io::Write as _,
    sync::Arc,
};

use serde_json::{json, Value};

pub use crate::wire::token::{
    Channel, Token, ToolCallDelta, MAX_TOKEN_TEXT_BYTES, MAX_TOOL_CALL_ID_BYTES,
    MAX_TOOL_NAME_BYTES,
};
use crate::wire::{
    endpoint::Endpoint,
    json_write::{write_hex8, write_logprob, write_str, write_u64},
    messages::encode::{self as messages, Blocks},
    responses::encode::{self as responses, Output},
    stream_id::StreamId,
    text::truncate_text,
};

pub mod bound;

/// Highest `top_logprobs` / `logprobs` accepted (the OpenAI limit).
pub const MAX_TOP_LOGPROBS: u32 = 20;

/// A JSON array of numbers.
fn write_numbers(out: &mut Vec<u8>, items: impl IntoIterator<Item = u64>) {
    out.push(b'[');
    for (i, n) in items.into_iter().enumerate() {
        if i > 0 {
            out.push(b',');
        }
        write_u64(out, n);
    }
    out.push(b']');
}

/// A token's UTF-8 bytes, as OpenAI's `bytes` field.
fn write_bytes(out: &mut Vec<u8>, s: &str) {
    write_numbers(out, s.bytes().map(u64::from));
}

/// Encodes the chunks of one turn. Holds the id and `created` stamp shared by its chunks.
#[derive(Debug, Clone)]
pub struct ChunkEncoder {
    pub endpoint: Endpoint,
    pub stream_id: StreamId,
    pub created: u64,
    /// The model name the chunks carry: the builtin's, or the one the client asked the
    /// upstream for (client input: always written JSON-escaped).
    pub model: Arc<str>,
    pub logprobs: bool,
    /// Alternatives per token (at most [`MAX_TOP_LOGPROBS`] are written).
    pub top_logprobs: u32,
    /// The stream may carry tool-call frames (a proxied chat turn outside degraded mode):
    /// [`ChunkEncoder::max_event_bytes`] covers them too.
    pub tool_calls: bool,
    /// The stream may carry reasoning frames (a proxied chat turn): the bound is measured on
    /// a `reasoning_content` delta, whose key is the longer.
    pub reasoning: bool,
    /// A Messages stream's open block ([`crate::wire::messages::encode`]); unused by chat
    /// and completions, whose chunks carry no state.
    pub blocks: Cell<Blocks>,
    /// A Responses stream's sequence number and output items
    /// ([`crate::wire::responses::encode`]); unused by the other endpoints.
    pub output: RefCell<Output>,
}

impl ChunkEncoder {
    fn id_prefix(&self) -> &'static str {
        match self.endpoint {
            Endpoint::Chat => "chatcmpl-",
            Endpoint::Completion => "cmpl-",
            Endpoint::Messages => "msg_",
            Endpoint::Responses => "resp_",
        }
    }

    /// Alternatives written per token.
    fn top_n(&self) -> usize {
        self.top_logprobs.min(MAX_TOP_LOGPROBS) as usize
    }

    fn chunk_head(&self, out: &mut Vec<u8>) {
        let object = match self.endpoint {
            Endpoint::Chat | Endpoint::Messages | Endpoint::Responses => "chat.completion.chunk",
            Endpoint::Completion => "text_completion",
        };
        // As `{"id":"<prefix><stream id>","object":...,"created":...,"model":` written with
        // `fmt`, which was a tenth of a frame's encoding.
        out.extend_from_slice(b"{\"id\":\"");
        out.extend_from_slice(self.id_prefix().as_bytes());
        out.extend_from_slice(b"hs_");
        write_hex8(out, self.stream_id.generation);
        write_hex8(out, self.stream_id.slot);
        out.extend_from_slice(b"\",\"object\":\"");
        out.extend_from_slice(object.as_bytes());
        out.extend_from_slice(b"\",\"created\":");
        write_u64(out, self.created);
        out.extend_from_slice(b",\"model\":");
        write_str(out, &self.model);
        out.extend_from_slice(b",\"choices\":[");
    }

    /// One SSE event carrying one token (a token frame): its text, at most
    /// [`MAX_TOKEN_TEXT_BYTES`], and its logprobs when asked. `text_offset` is the token's byte
    /// offset in the completion text; `first` adds the chat role; `channel` names the chat
    /// delta's field. At most [`ChunkEncoder::max_event_bytes`] bytes.
    pub fn token_event(
        &self,
        out: &mut Vec<u8>,
        tok: Token<'_>,
        text_offset: usize,
        first: bool,
        channel: Channel,
    ) {
        debug_assert!(
            tok.text.len() <= MAX_TOKEN_TEXT_BYTES,
            "token frames are split"
        );
        self.content_event(out, tok.text, &[tok], &[text_offset], first, channel);
    }

    /// One SSE event carrying text whose token is not known (a frame of the one-token-per-
    /// character rule): `logprobs` is `null` even when the client asked for them. At most
    /// [`ChunkEncoder::max_event_bytes`] bytes for a text of at most [`MAX_TOKEN_TEXT_BYTES`].
    pub fn text_event(&self, out: &mut Vec<u8>, text: &str, first: bool, channel: Channel) {
        debug_assert!(text.len() <= MAX_TOKEN_TEXT_BYTES, "text frames are split");
        match self.endpoint {
            Endpoint::Messages => return messages::text_delta(self.messages(), out, text, channel),
            Endpoint::Responses => {
                return responses::text_delta(self.responses(), out, text, channel, None)
            }
            Endpoint::Chat | Endpoint::Completion => {}
        }
        out.extend_from_slice(b"data: ");
        self.chunk_head(out);
        match self.endpoint {
            Endpoint::Chat | Endpoint::Messages | Endpoint::Responses => {
                out.extend_from_slice(b"{\"index\":0,\"delta\":{");
                if first {
                    out.extend_from_slice(b"\"role\":\"assistant\",");
                }
                out.extend_from_slice(channel.delta_key());
                write_str(out, text);
                out.extend_from_slice(b"},\"logprobs\":null");
            }
            Endpoint::Completion => {
                out.extend_from_slice(b"{\"index\":0,\"text\":");
                write_str(out, text);
                out.extend_from_slice(b",\"logprobs\":null");
            }
        }
        out.extend_from_slice(b",\"finish_reason\":null}]}\n\n");
    }

    /// One SSE event carrying `text`, made of `toks` (whose logprobs it carries when asked;
    /// `offsets` are their byte offsets in the completion text). `first` adds the chat role;
    /// `channel` names the chat delta's field. With one token of at most
    /// [`MAX_TOKEN_TEXT_BYTES`] this is a token frame; with more (a batch response served as
    /// SSE) it is not bounded.
    pub fn content_event(
        &self,
        out: &mut Vec<u8>,
        text: &str,
        toks: &[Token<'_>],
        offsets: &[usize],
        first: bool,
        channel: Channel,
    ) {
        match self.endpoint {
            // The Messages API has no logprobs.
            Endpoint::Messages => return messages::text_delta(self.messages(), out, text, channel),
            Endpoint::Responses => {
                let logprobs = self.logprobs.then_some((toks, self.top_n()));
                return responses::text_delta(self.responses(), out, text, channel, logprobs);
            }
            Endpoint::Chat | Endpoint::Completion => {}
        }
        out.extend_from_slice(b"data: ");
        self.chunk_head(out);
        match self.endpoint {
            Endpoint::Chat | Endpoint::Messages | Endpoint::Responses => {
                out.extend_from_slice(b"{\"index\":0,\"delta\":{");
                if first {
                    out.extend_from_slice(b"\"role\":\"assistant\",");
                }
                out.extend_from_slice(channel.delta_key());
                write_str(out, text);
                out.extend_from_slice(b"},\"logprobs\":");
                if self.logprobs {
                    out.extend_from_slice(b"{\"content\":[");
                    for (i, t) in toks.iter().enumerate() {
                        if i > 0 {
                            out.push(b',');
                        }
                        self.chat_logprob_entry(out, *t);
                    }
                    out.extend_from_slice(b"]}");
                } else {
                    out.extend_from_slice(b"null");
                }
            }
            Endpoint::Completion => {
                out.extend_from_slice(b"{\"index\":0,\"text\":");
                write_str(out, text);
                out.extend_from_slice(b",\"logprobs\":");
                if self.logprobs {
                    self.completion_logprobs(out, toks, offsets);
                } else {
                    out.extend_from_slice(b"null");
                }
            }
        }
        out.extend_from_slice(b",\"finish_reason\":null}]}\n\n");
    }

    /// One SSE event carrying one call's tool-call delta (chat). Tool-call frames carry no
    /// logprobs. At most [`ChunkEncoder::max_event_bytes`] bytes when the encoder has
    /// `tool_calls` and the delta keeps to the caps of [`ToolCallDelta`].
    pub fn tool_call_event(&self, out: &mut Vec<u8>, call: ToolCallDelta<'_>, first: bool) {
        match self.endpoint {
            Endpoint::Messages => return messages::tool_delta(self.messages(), out, call),
            Endpoint::Responses => return responses::tool_delta(self.responses(), out, call),
            Endpoint::Chat | Endpoint::Completion => {}
        }
        out.extend_from_slice(b"data: ");
        self.chunk_head(out);
        out.extend_from_slice(b"{\"index\":0,\"delta\":{");
        if first {
            out.extend_from_slice(b"\"role\":\"assistant\",");
        }
        let _ = write!(out, "\"tool_calls\":[{{\"index\":{}", call.index);
        if let Some(id) = call.id {
            out.extend_from_slice(b",\"id\":");
            write_str(out, id);
            out.extend_from_slice(b",\"type\":\"function\"");
        }
        out.extend_from_slice(b",\"function\":{");
        if let Some(name) = call.name {
            out.extend_from_slice(b"\"name\":");
            write_str(out, name);
            out.push(b',');
        }
        out.extend_from_slice(b"\"arguments\":");
        write_str(out, call.arguments);
        out.extend_from_slice(b"}}]},\"logprobs\":null,\"finish_reason\":null}]}\n\n");
    }

    fn chat_logprob_entry(&self, out: &mut Vec<u8>, tok: Token<'_>) {
        out.extend_from_slice(b"{\"token\":");
        write_str(out, tok.text);
        out.extend_from_slice(b",\"logprob\":");
        write_logprob(out, tok.logprob);
        out.extend_from_slice(b",\"bytes\":");
        write_bytes(out, tok.text);
        out.extend_from_slice(b",\"top_logprobs\":[");
        for (i, (t, lp)) in tok.top.iter().take(self.top_n()).enumerate() {
            if i > 0 {
                out.push(b',');
            }
            let t = truncate_text(t, MAX_TOKEN_TEXT_BYTES);
            out.extend_from_slice(b"{\"token\":");
            write_str(out, t);
            out.extend_from_slice(b",\"logprob\":");
            write_logprob(out, *lp);
            out.extend_from_slice(b",\"bytes\":");
            write_bytes(out, t);
            out.push(b'}');
        }
        out.extend_from_slice(b"]}");
    }

    fn completion_logprobs(&self, out: &mut Vec<u8>, toks: &[Token<'_>], offsets: &[usize]) {
        out.extend_from_slice(b"{\"tokens\":[");
        for (i, t) in toks.iter().enumerate() {
            if i > 0 {
                out.push(b',');
            }
            write_str(out, t.text);
        }
        out.extend_from_slice(b"],\"token_logprobs\":[");
        for (i, t) in toks.iter().enumerate() {
            if i > 0 {
                out.push(b',');
            }
            write_logprob(out, t.logprob);
        }
        out.extend_from_slice(b"],\"top_logprobs\":[");
        for (i, t) in toks.iter().enumerate() {
            if i > 0 {
                out.push(b',');
            }
            out.push(b'{');
            // A JSON object cannot hold the same key twice; keep the first (most likely).
            // Keys are cut to the cap first, so two alternatives that share their first
            // MAX_TOKEN_TEXT_BYTES bytes are one key.
            let cut = |a: &str| -> usize { a.floor_char_boundary(MAX_TOKEN_TEXT_BYTES) };
            let mut written = 0;
            for (j, (alt, lp)) in t.top.iter().take(self.top_n()).enumerate() {
                let alt = &alt[..cut(alt)];
                if t.top[..j].iter().any(|(a, _)| &a[..cut(a)] == alt) {
                    continue;
                }
                if written > 0 {
                    out.push(b',');
                }
                write_str(out, alt);
                out.push(b':');
                write_logprob(out, *lp);
                written += 1;
            }
            out.push(b'}');
        }
        out.extend_from_slice(b"],\"text_offset\":");
        write_numbers(out, offsets.iter().map(|&o| o as u64));
        out.push(b'}');
    }

    /// The Messages writers' view of this encoder.
    fn messages(&self) -> messages::Stream<'_> {
        messages::Stream {
            stream_id: self.stream_id,
            model: &self.model,
            blocks: &self.blocks,
        }
    }

    /// The Responses writers' view of this encoder.
    fn responses(&self) -> responses::Stream<'_> {
        responses::Stream {
            stream_id: self.stream_id,
            created: self.created,
            model: &self.model,
            output: &self.output,
        }
    }

    /// The next `sequence_number` of a Responses stream (0 on the other endpoints): the events
    /// written so far, which the halt core numbers the terminal after.
    pub fn next_sequence(&self) -> u64 {
        self.output.borrow().sequence
    }

    /// What a stream writes right after its response head: `message_start` on a Messages
    /// stream, `response.created` and `response.in_progress` on a Responses stream, nothing
    /// on the others.
    pub fn stream_start(&self, out: &mut Vec<u8>) {
        match self.endpoint {
            Endpoint::Messages => messages::message_start(self.messages(), out),
            Endpoint::Responses => responses::stream_start(self.responses(), out),
            Endpoint::Chat | Endpoint::Completion => {}
        }
    }

    /// The SSE event of the final chunk: no content, `finish_reason` set.
    pub(super) fn final_chunk(&self, out: &mut Vec<u8>, finish_reason: &str) {
        out.extend_from_slice(b"data: ");
        self.chunk_head(out);
        match self.endpoint {
            Endpoint::Chat | Endpoint::Messages | Endpoint::Responses => {
                out.extend_from_slice(b"{\"index\":0,\"delta\":{},\"logprobs\":null")
            }
            Endpoint::Completion => {
                out.extend_from_slice(b"{\"index\":0,\"text\":\"\",\"logprobs\":null")
            }
        }
        // The reason may come from an upstream: escaped like any string.
        out.extend_from_slice(b",\"finish_reason\":");
        write_str(out, finish_reason);
        out.extend_from_slice(b"}]}\n\n");
    }

    /// A chunk with no choices that carries `value` under `field` (haltd's annotations after
    /// a reply, e.g. `haltd_grounding`): shaped like the usage chunk, so OpenAI clients take
    /// it as one more chunk with nothing to show.
    pub fn annotation_event(&self, out: &mut Vec<u8>, field: &str, value: &serde_json::Value) {
        match self.endpoint {
            Endpoint::Messages => return messages::annotation(self.messages(), out, field, value),
            Endpoint::Responses => {
                return responses::annotation(self.responses(), out, field, value)
            }
            Endpoint::Chat | Endpoint::Completion => {}
        }
        out.extend_from_slice(b"data: ");
        self.chunk_head(out);
        out.extend_from_slice(b"],");
        write_str(out, field);
        out.push(b':');
        let _ = serde_json::to_writer(&mut *out, value);
        out.extend_from_slice(b"}\n\n");
    }

    /// The last frame of a stream that ends normally: final chunk, optional usage chunk, `[DONE]`.
    pub fn finish_events(&self, out: &mut Vec<u8>, finish_reason: &str, usage: Option<(u64, u64)>) {
        match self.endpoint {
            Endpoint::Messages => {
                return messages::finish(self.messages(), out, finish_reason, usage)
            }
            Endpoint::Responses => {
                return responses::finish(self.responses(), out, finish_reason, usage)
            }
            Endpoint::Chat | Endpoint::Completion => {}
        }
        self.final_chunk(out, finish_reason);
        if let Some((prompt, completion)) = usage {
            out.extend_from_slice(b"data: ");
            self.chunk_head(out);
            let _ = write!(
                out,
                "],\"usage\":{{\"prompt_tokens\":{prompt},\"completion_tokens\":{completion},\"total_tokens\":{}}}}}\n\n",
                prompt + completion
            );
        }
        out.extend_from_slice(b"data: [DONE]\n\n");
    }

    /// A whole batch (`stream: false`) response body. `reasoning` is the chat message's
    /// `reasoning_content` (left out when empty).
    pub fn batch_body(
        &self,
        (text, reasoning): (&str, &str),
        toks: &[Token<'_>],
        offsets: &[usize],
        finish_reason: &str,
        (prompt_tokens, completion_tokens): (u64, u64),
        tool_calls: Option<&Value>,
    ) -> Vec<u8> {
        let usage = (prompt_tokens, completion_tokens);
        match self.endpoint {
            Endpoint::Messages => {
                return messages::batch_body(
                    self.messages(),
                    (text, reasoning),
                    finish_reason,
                    usage,
                    tool_calls,
                )
            }
            Endpoint::Responses => {
                return responses::batch_body(
                    self.responses(),
                    (text, reasoning),
                    finish_reason,
                    usage,
                    tool_calls,
                )
            }
            Endpoint::Chat | Endpoint::Completion => {}
        }
        let mut logprobs = Vec::new();
        let logprobs: Value = if self.logprobs {
            match self.endpoint {
                Endpoint::Chat | Endpoint::Messages | Endpoint::Responses => {
                    logprobs.extend_from_slice(b"{\"content\":[");
                    for (i, t) in toks.iter().enumerate() {
                        if i > 0 {
                            logprobs.push(b',');
                        }
                        self.chat_logprob_entry(&mut logprobs, *t);
                    }
                    logprobs.extend_from_slice(b"]}");
                }
                Endpoint::Completion => self.completion_logprobs(&mut logprobs, toks, offsets),
            }
            serde_json::from_slice(&logprobs).unwrap_or(Value::Null)
        } else {
            Value::Null
        };
        let choice = match self.endpoint {
            Endpoint::Chat | Endpoint::Messages | Endpoint::Responses => {
                let mut message = json!({"role": "assistant", "content": text});
                if !reasoning.is_empty() {
                    message["reasoning_content"] = reasoning.into();
                }
                if let Some(calls) = tool_calls {
                    message["tool_calls"] = calls.clone();
                }
                json!({"index": 0, "message": message, "logprobs": logprobs, "finish_reason": finish_reason})
            }
            Endpoint::Completion => {
                json!({"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish_reason})
            }
        };
        let object = match self.endpoint {
            Endpoint::Chat | Endpoint::Messages | Endpoint::Responses => "chat.completion",
            Endpoint::Completion => "text_completion",
        };
        json!({
            "id": format!("{}{}", self.id_prefix(), self.stream_id),
            "object": object,
            "created": self.created,
            "model": &*self.model,
            "choices": [choice],
            "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens, "total_tokens": prompt_tokens + completion_tokens},
        })
        .to_string()
        .into_bytes()
    }
}

/// An encoder for tests: stream 7 (generation 3), a fixed `created`, no logprobs, no tool
/// calls and no reasoning; a test sets what it varies with struct update syntax.
#[cfg(test)]
pub(crate) fn test_encoder(endpoint: Endpoint, model: &str) -> ChunkEncoder {
    ChunkEncoder {
        endpoint,
        stream_id: StreamId {
            slot: 7,
            generation: 3,
        },
        created: 1_700_000_000,
        model: model.into(),
        logprobs: false,
        top_logprobs: 0,
        tool_calls: false,
        reasoning: false,
        blocks: Cell::default(),
        output: RefCell::default(),
    }
}

#[cfg(test)]
mod tests;
