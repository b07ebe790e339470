//! The upstream source: what an OpenAI-compatible upstream streamed for a proxied turn, as
//! the pipeline takes it.
//!
//! The data plane's socket I/O (`dataplane/upstream_io.rs`) feeds each SSE event here
//! ([`UpstreamSource::push_event`]); the event becomes queued [`Item`]s ([`push_chunk`]: one
//! per token when the logprob tokens spell the text, else the text framed per character; a
//! tool-call delta on its own), and [`TokenSource::poll`] hands them to the pipeline in order.
//! Items that are not text (finish reason, usage) are absorbed here and come back in
//! [`TokenSource::ending`]; an error event, a malformed one, or a `finish_reason` of `error`
//! or `abort` is a [`Polled::Failed`].
//!
//! Per event the upstream's JSON is parsed into owned values (`serde_json`): this allocates per
//! token, unlike the built-in source; it is bounded by the event size limit.

use std::{borrow::Cow, collections::VecDeque};

use serde_json::{json, Value};

use super::{Ending, Polled, Produced, SourceFailure, TokenSource, Tokens};
use crate::{
    metrics::upstream::ToolCallKind,
    upstream::{
        self, framing::Split, FinishReason, SseEvent, UpToken, UpstreamError, UpstreamEvent,
        UpstreamFailureKind,
    },
    wire::{self, Endpoint},
};

/// Items parsed but not yet taken before haltd stops reading the upstream (TCP then pushes
/// back on it): a slow client slows the generation instead of growing memory.
pub const MAX_QUEUED_ITEMS: usize = 256;

/// One thing the upstream said, in the order the client sees it.
#[derive(Debug)]
enum Item {
    /// Text and its tokens (a [`Produced`] when polled; kept small while queued).
    Content {
        text: String,
        tokens: Vec<UpToken>,
        split: Split,
        arrived_ns: u64,
    },
    /// A tool-call delta, with the logprobs of its tokens (scored like content) and its
    /// arrival.
    ToolCalls(Value, Vec<UpToken>, u64),
    Finish(FinishReason),
    Usage(u64, u64),
    Done,
    Error(UpstreamError),
    /// The stream broke here (malformed event): what came before it is still emitted.
    Broken(String),
}

/// The parsed side of a proxied turn's upstream stream.
#[derive(Debug, Default)]
pub struct UpstreamSource {
    items: VecDeque<Item>,
    /// `[DONE]` (or a break in the stream) is queued: nothing after it is read.
    saw_done: bool,
    finish: Option<FinishReason>,
    usage: Option<(u64, u64)>,
    /// Tool-call deltas merged by index (the batch body, and the record).
    tools: Vec<Value>,
    /// The model the upstream says it answered with (its chunks' `model`).
    model: Option<String>,
    /// Degraded safe mode: tool calls are not emitted, and a `tool_calls` finish is a `stop`.
    degraded: bool,
}

impl UpstreamSource {
    pub fn new(degraded: bool) -> Self {
        Self {
            degraded,
            ..Self::default()
        }
    }

    /// Whether the I/O should read more: nothing ends the stream yet and the queue has room.
    pub fn wants_more(&self) -> bool {
        !self.saw_done && self.items.len() < MAX_QUEUED_ITEMS
    }

    pub fn saw_done(&self) -> bool {
        self.saw_done
    }

    pub fn has_items(&self) -> bool {
        !self.items.is_empty()
    }

    pub fn queued(&self) -> usize {
        self.items.len()
    }

    /// A finish reason arrived (absorbed or still queued).
    pub fn has_finish(&self) -> bool {
        self.finish.is_some() || self.items.iter().any(|i| matches!(i, Item::Finish(_)))
    }

    pub fn finish(&self) -> Option<&FinishReason> {
        self.finish.as_ref()
    }

    pub fn model(&self) -> Option<&str> {
        self.model.as_deref()
    }

    /// Drops what is queued (the exchange ended: cancelled or failed).
    pub fn clear(&mut self) {
        self.items.clear();
    }

    /// Queues what one SSE event says. Returns `false` when the stream broke (nothing after
    /// it is read).
    pub fn push_event(&mut self, endpoint: Endpoint, ev: &SseEvent, arrived_ns: u64) -> bool {
        match upstream::parse_event(endpoint, ev) {
            Ok(UpstreamEvent::Chunk(c)) => {
                if self.model.is_none() {
                    self.model.clone_from(&c.model);
                }
                push_chunk(&mut self.items, c, arrived_ns);
            }
            Ok(UpstreamEvent::Done) => self.push_done(),
            Ok(UpstreamEvent::Error(e)) => self.items.push_back(Item::Error(e)),
            Err(e) => {
                self.push_broken(format!("malformed upstream event: {e}"));
                return false;
            }
        }
        true
    }

    /// The end of the stream (`[DONE]`, or a final chunk and a close).
    pub fn push_done(&mut self) {
        self.saw_done = true;
        self.items.push_back(Item::Done);
    }

    /// The stream broke here: what came before it still goes out.
    pub fn push_broken(&mut self, msg: String) {
        self.items.push_back(Item::Broken(msg));
        self.saw_done = true;
    }

    /// Merges a tool-call delta into the turn's calls; returns the calls it started.
    pub fn merge_tool_calls(&mut self, delta: &Value) -> Vec<Value> {
        merge_tool_calls(&mut self.tools, delta)
    }
}

impl TokenSource for UpstreamSource {
    fn poll(&mut self) -> Polled {
        loop {
            let Some(item) = self.items.pop_front() else {
                return Polled::Pending;
            };
            match item {
                Item::Content {
                    text,
                    tokens,
                    split,
                    arrived_ns,
                } => {
                    return Polled::Text(Produced {
                        text: Cow::Owned(text),
                        tokens: Tokens::Upstream(tokens),
                        split,
                        arrived_ns,
                    })
                }
                Item::ToolCalls(delta, tokens, arrived_ns) => {
                    return Polled::ToolCalls {
                        delta,
                        tokens,
                        arrived_ns,
                    }
                }
                Item::Finish(r) if self.degraded && r == FinishReason::ToolCalls => {
                    // No tool call reached the client: the turn simply ended.
                    self.finish = Some(FinishReason::Stop);
                }
                Item::Finish(r) if matches!(r, FinishReason::Error | FinishReason::Abort) => {
                    let what = r.as_str();
                    return failed(
                        UpstreamFailureKind::ErrorEvent,
                        format!("the upstream ended the generation with finish_reason {what:?}"),
                        None,
                        None,
                    );
                }
                Item::Finish(r) => self.finish = Some(r),
                Item::Usage(p, c) => self.usage = Some((p, c)),
                Item::Error(e) => {
                    let quote = wire::truncate_chars(&e.message, 500);
                    let msg = format!("the upstream sent an error event: {quote}");
                    return failed(UpstreamFailureKind::ErrorEvent, msg, e.status, Some(quote));
                }
                Item::Broken(msg) => {
                    return failed(UpstreamFailureKind::Malformed, msg, Some(200), None)
                }
                Item::Done => return Polled::End,
            }
        }
    }

    fn paced(&self) -> bool {
        false
    }

    fn ending(&self) -> Ending {
        Ending {
            reason: Cow::Owned(
                self.finish
                    .as_ref()
                    .map_or("stop", FinishReason::as_str)
                    .to_owned(),
            ),
            usage: self.usage,
            tools: if self.degraded {
                Vec::new()
            } else {
                self.tools.clone()
            },
        }
    }
}

fn failed(
    kind: UpstreamFailureKind,
    message: String,
    status: Option<u16>,
    quote: Option<String>,
) -> Polled {
    Polled::Failed(SourceFailure {
        kind,
        message,
        status,
        quote,
    })
}

/// Counts the tool calls a degraded turn suppresses: each delta entry that starts one (with
/// its id) once.
pub fn count_suppressed(metrics: &crate::metrics::Metrics, delta: &Value) {
    let n = delta.as_array().map_or(0, |l| {
        l.iter()
            .filter(|d| d.get("id").is_some_and(|i| !i.is_null()))
            .count()
    }) as u64;
    metrics.upstream.tool_calls(ToolCallKind::Suppressed, n);
}

fn content(text: String, tokens: Vec<UpToken>, split: Split, arrived_ns: u64) -> Item {
    Item::Content {
        text,
        tokens,
        split,
        arrived_ns,
    }
}

/// Splits an upstream chunk into items ([`upstream::framing`]): one per token when the tokens
/// spell the content exactly (vLLM may put several tokens in one chunk), else one for the
/// content, framed per character; a tool-call delta is its own item. Every item arrived at
/// `arrived_ns` (the receive that completed the chunk's event).
fn push_chunk(items: &mut VecDeque<Item>, c: upstream::UpstreamChunk, arrived_ns: u64) {
    let spelled = c.tokens_match_content();
    let upstream::UpstreamChunk {
        content: text,
        tokens,
        tool_calls,
        finish_reason,
        usage,
        ..
    } = c;
    match tool_calls {
        // A tool-call chunk: its logprobs belong to the call's tokens.
        Some(calls) if text.is_empty() => {
            items.push_back(Item::ToolCalls(calls, tokens, arrived_ns));
        }
        calls => {
            if spelled && tokens.len() == 1 {
                // The common case: the content is the token's text, moved, not copied.
                items.push_back(content(text, tokens, Split::Token, arrived_ns));
            } else if spelled {
                for t in tokens {
                    items.push_back(content(t.text.clone(), vec![t], Split::Token, arrived_ns));
                }
            } else if !text.is_empty() || !tokens.is_empty() {
                items.push_back(content(text, tokens, Split::Chars, arrived_ns));
            }
            // Content and a tool call in one chunk (rare): the call after the text, its
            // arguments per character.
            if let Some(calls) = calls {
                items.push_back(Item::ToolCalls(calls, Vec::new(), arrived_ns));
            }
        }
    }
    if let Some(r) = finish_reason {
        items.push_back(Item::Finish(r));
    }
    if let Some(u) = usage {
        items.push_back(Item::Usage(u.prompt_tokens, u.completion_tokens));
    }
}

/// Merges one tool-call delta list into `tools` (by `index`); returns the calls it started
/// (`{index, id, name}`), which are the ones a frame carrying this delta dispatches.
fn merge_tool_calls(tools: &mut Vec<Value>, delta: &Value) -> Vec<Value> {
    let mut started = Vec::new();
    let Some(list) = delta.as_array() else {
        return started;
    };
    for d in list {
        let index = d.get("index").and_then(Value::as_u64).unwrap_or(0) as usize;
        while tools.len() <= index {
            tools.push(
                json!({"id": null, "type": "function", "function": {"name": "", "arguments": ""}}),
            );
        }
        let t = &mut tools[index];
        let fresh = t["id"].is_null();
        if let Some(id) = d.get("id").and_then(Value::as_str) {
            t["id"] = id.into();
        }
        if let Some(f) = d.get("function") {
            for key in ["name", "arguments"] {
                if let Some(piece) = f.get(key).and_then(Value::as_str) {
                    let cur = t["function"][key].as_str().unwrap_or("").to_owned();
                    t["function"][key] = (cur + piece).into();
                }
            }
        }
        if fresh && !t["id"].is_null() {
            started.push(json!({"index": index, "id": t["id"], "name": t["function"]["name"]}));
        }
    }
    started
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tool_call_deltas_merge_by_index() {
        let mut tools = Vec::new();
        let s1 = merge_tool_calls(
            &mut tools,
            &json!([{"index": 0, "id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": ""}}]),
        );
        assert_eq!(s1.len(), 1);
        assert_eq!(s1[0]["name"], "get_weather");
        let s2 = merge_tool_calls(
            &mut tools,
            &json!([{"index": 0, "function": {"arguments": "{\"city\":"}}]),
        );
        assert!(s2.is_empty());
        merge_tool_calls(
            &mut tools,
            &json!([{"index": 0, "function": {"arguments": "\"Oslo\"}"}}]),
        );
        let s3 = merge_tool_calls(
            &mut tools,
            &json!([{"index": 1, "id": "call_2", "function": {"name": "f", "arguments": "{}"}}]),
        );
        assert_eq!(s3[0]["index"], 1);
        assert_eq!(tools[0]["function"]["arguments"], "{\"city\":\"Oslo\"}");
        assert_eq!(tools[1]["id"], "call_2");
    }
}
