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
//! Per event the upstream's JSON is read by the turn's one [`ChunkReader`] (typed visitors into
//! a chunk whose buffers it reuses), from an event the SSE parser lends
//! ([`crate::upstream::SseParser::next_event_ref`]). An item's text and tokens are not copied
//! out of the chunk: the chunk's buffers are swapped for spare ones from a small [`Spares`]
//! pool, which the pipeline refills once a token's frame is encoded
//! ([`TokenSource::recycle`]). A chunk's `reasoning_content` becomes items of its own channel
//! ([`Channel::Reasoning`]), ahead of its content, taken exactly as content is: the detectors
//! and the scanner see reasoning tokens as they see any. Once the pool and the reader's buffers have grown, a plain token
//! (one token per chunk, spelled by its text) allocates nothing here. A tool-call delta, a
//! chunk of several tokens and text the scanner holds back still allocate.

use std::{borrow::Cow, collections::VecDeque};

use serde_json::{json, Value};

use super::{Ending, Polled, Produced, SourceFailure, TokenSource, Tokens};
use crate::{
    upstream::metrics::ToolCallKind,
    upstream::{
        chunk::tokens_spell, framing::Split, ChunkReader, FinishReason, Parsed, SseEventRef,
        UpToken, UpstreamChunk, UpstreamError, UpstreamFailureKind,
    },
    wire::{self, Channel, Endpoint},
};

/// Items parsed but not yet taken before haltd stops reading the upstream (TCP then pushes
/// back on it): a slow client slows the generation instead of growing memory.
pub const MAX_QUEUED_ITEMS: usize = 256;

/// Spare buffers kept per pool: a few, since a streaming turn has one or two items in flight
/// (more are dropped; a burst that queued more grows them again).
const MAX_SPARES: usize = 8;

/// Text and token buffers handed back by the pipeline ([`TokenSource::recycle`]), swapped
/// into the [`ChunkReader`]'s chunk for the next event so that its buffers (a token's text and
/// alternatives included) are reused rather than allocated anew.
#[derive(Debug, Default)]
struct Spares {
    texts: Vec<String>,
    tokens: Vec<Vec<UpToken>>,
}

impl Spares {
    /// A spare text buffer (the reader clears it before it writes), or a new empty one (no
    /// allocation until written).
    fn text(&mut self) -> String {
        self.texts.pop().unwrap_or_default()
    }

    /// A spare token list; its tokens keep their buffers for the reader to overwrite.
    fn tokens(&mut self) -> Vec<UpToken> {
        self.tokens.pop().unwrap_or_default()
    }

    fn put(&mut self, text: String, tokens: Vec<UpToken>) {
        if self.texts.len() < MAX_SPARES && text.capacity() > 0 {
            self.texts.push(text);
        }
        if self.tokens.len() < MAX_SPARES && tokens.capacity() > 0 {
            self.tokens.push(tokens);
        }
    }
}

/// One thing the upstream said, in the order the client sees it.
#[derive(Debug)]
enum Item {
    /// Text and its tokens (a [`Produced`] when polled; kept small while queued).
    Content {
        text: String,
        tokens: Vec<UpToken>,
        split: Split,
        channel: Channel,
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
    Broken(UpstreamFailureKind, String),
}

/// The parsed side of a proxied turn's upstream stream.
#[derive(Debug, Default)]
pub struct UpstreamSource {
    items: VecDeque<Item>,
    /// `[DONE]`, an error event or a break in the stream is queued: nothing after it is read.
    saw_done: bool,
    finish: Option<FinishReason>,
    usage: Option<(u64, u64)>,
    /// Tool-call deltas merged by index (the batch body, and the record).
    tools: Vec<Value>,
    /// The model the upstream says it answered with (its chunks' `model`).
    model: Option<String>,
    /// Degraded safe mode: tool calls are not emitted, and a `tool_calls` finish is a `stop`.
    degraded: bool,
    /// Reads this turn's events, reusing its chunk's buffers from one event to the next.
    /// Boxed (once per turn) so that a turn's source stays as small as the built-in one.
    reader: Box<ChunkReader>,
    spares: Spares,
}

impl UpstreamSource {
    pub fn new(degraded: bool) -> Self {
        Self {
            degraded,
            ..Self::default()
        }
    }

    /// The source of a turn passed through to a backend that serves `surface` itself: its
    /// stream is read in that surface's events (`upstream/chunk/native.rs`); `None`: a
    /// translated turn ([`UpstreamSource::new`]).
    pub fn native(degraded: bool, surface: Option<crate::upstream::UpstreamSurface>) -> Self {
        Self {
            degraded,
            reader: Box::new(surface.map_or_else(ChunkReader::default, ChunkReader::native)),
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

    /// A new response continues the turn (a grounded continuation, `dataplane/ground.rs`):
    /// nothing queued, and its own end, finish reason and usage to come.
    pub fn restart(&mut self) {
        self.items.clear();
        self.saw_done = false;
        self.finish = None;
        self.usage = None;
    }

    /// Queues what one SSE event says. Returns `false` when the stream broke (nothing after
    /// it is read).
    pub fn push_event(&mut self, endpoint: Endpoint, ev: SseEventRef<'_>, arrived_ns: u64) -> bool {
        match self.reader.read(endpoint, ev) {
            Ok(Parsed::Chunk) => {
                let c = self.reader.chunk_mut();
                if self.model.is_none() {
                    self.model.clone_from(&c.model);
                }
                push_chunk(&mut self.items, &mut self.spares, c, arrived_ns);
                if self.reader.ended() {
                    // A native stream's terminal event: its API sends no `[DONE]`.
                    self.push_done();
                }
            }
            Ok(Parsed::Done) => self.push_done(),
            Ok(Parsed::Error(e)) => {
                // An error event ends the stream: nothing after it is read, and the close that
                // follows it is no early EOF (the error fails the turn, typed).
                self.items.push_back(Item::Error(e));
                self.saw_done = true;
                return false;
            }
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
        self.push_failure(UpstreamFailureKind::Malformed, msg);
    }

    /// The stream ends here with the failure `kind` (e.g. the upstream closed it early):
    /// what came before it still goes out, then the turn fails.
    pub fn push_failure(&mut self, kind: UpstreamFailureKind, msg: String) {
        self.items.push_back(Item::Broken(kind, msg));
        self.saw_done = true;
    }

    /// Merges a tool-call delta into the turn's calls; returns the calls it started.
    pub fn merge_tool_calls(&mut self, delta: &Value) -> Vec<Value> {
        merge_tool_calls(&mut self.tools, delta)
    }

    /// The turn's tool calls so far, merged (`{id, type, function: {name, arguments}}`).
    pub fn tool_calls(&self) -> &[Value] {
        &self.tools
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
                    channel,
                    arrived_ns,
                } => {
                    return Polled::Text(Produced {
                        text: Cow::Owned(text),
                        tokens: Tokens::Upstream(tokens),
                        split,
                        channel,
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
                Item::Broken(kind, msg) => return failed(kind, msg, Some(200), None),
                Item::Done => return Polled::End,
            }
        }
    }

    fn paced(&self) -> bool {
        false
    }

    fn recycle(&mut self, p: Produced) {
        if let (Cow::Owned(text), Tokens::Upstream(tokens)) = (p.text, p.tokens) {
            self.spares.put(text, tokens);
        }
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
pub fn count_suppressed(metrics: &crate::upstream::metrics::UpstreamMetrics, delta: &Value) {
    let n = delta.as_array().map_or(0, |l| {
        l.iter()
            .filter(|d| d.get("id").is_some_and(|i| !i.is_null()))
            .count()
    }) as u64;
    metrics.tool_calls(ToolCallKind::Suppressed, n);
}

fn content(
    text: String,
    tokens: Vec<UpToken>,
    (split, channel): (Split, Channel),
    arrived_ns: u64,
) -> Item {
    Item::Content {
        text,
        tokens,
        split,
        channel,
        arrived_ns,
    }
}

/// Splits an upstream chunk into items ([`crate::upstream::framing`]): its reasoning first
/// (`reasoning_content`, framed as content is, in its own channel), then its content, one
/// item per token when the tokens spell the text exactly (vLLM may put several tokens in one
/// chunk), else one item for the text, framed per character; a tool-call delta is its own
/// item. Every item arrived at `arrived_ns` (the receive that completed the chunk's event).
/// The text and tokens leave the reader's chunk by a swap with spare buffers, not a copy.
fn push_chunk(
    items: &mut VecDeque<Item>,
    spares: &mut Spares,
    c: &mut UpstreamChunk,
    arrived_ns: u64,
) {
    if !c.reasoning.is_empty() && c.content.is_empty() && c.tool_calls.is_none() {
        // A reasoning chunk (the usual shape): its tokens are the reasoning's. The two
        // buffers trade places, so the reasoning is taken as content is.
        std::mem::swap(&mut c.content, &mut c.reasoning);
        let (text, tokens) = take_text(spares, c);
        push_text(
            items,
            spares,
            (text, tokens),
            Channel::Reasoning,
            arrived_ns,
        );
    } else {
        if !c.reasoning.is_empty() {
            push_leading_reasoning(items, spares, c, arrived_ns);
        }
        push_content(items, spares, c, arrived_ns);
    }
    if let Some(r) = c.finish_reason.take() {
        items.push_back(Item::Finish(r));
    }
    if let Some(u) = c.usage.take() {
        items.push_back(Item::Usage(u.prompt_tokens, u.completion_tokens));
    }
}

/// The chunk's content and tool calls (its reasoning is taken).
fn push_content(
    items: &mut VecDeque<Item>,
    spares: &mut Spares,
    c: &mut UpstreamChunk,
    arrived_ns: u64,
) {
    match c.tool_calls.take() {
        // A tool-call chunk: its logprobs belong to the call's tokens.
        Some(calls) if c.content.is_empty() => {
            let tokens = std::mem::replace(&mut c.tokens, spares.tokens());
            items.push_back(Item::ToolCalls(calls, tokens, arrived_ns));
        }
        calls => {
            if !c.content.is_empty() || !c.tokens.is_empty() {
                let (text, tokens) = take_text(spares, c);
                push_text(items, spares, (text, tokens), Channel::Content, arrived_ns);
            }
            // Content and a tool call in one chunk (rare): the call after the text, its
            // arguments per character.
            if let Some(calls) = calls {
                items.push_back(Item::ToolCalls(calls, Vec::new(), arrived_ns));
            }
        }
    }
}

/// The chunk's content and tokens, swapped out for spare buffers.
fn take_text(spares: &mut Spares, c: &mut UpstreamChunk) -> (String, Vec<UpToken>) {
    (
        std::mem::replace(&mut c.content, spares.text()),
        std::mem::replace(&mut c.tokens, spares.tokens()),
    )
}

/// Queues one channel's text: per token when its tokens spell it (one item per token),
/// else one item framed per character that keeps the tokens for the detectors.
fn push_text(
    items: &mut VecDeque<Item>,
    spares: &mut Spares,
    (text, mut tokens): (String, Vec<UpToken>),
    channel: Channel,
    arrived_ns: u64,
) {
    let spelled = tokens_spell(&tokens, &text);
    if spelled && tokens.len() == 1 {
        // The common case: the text is the token's text, moved, not copied.
        items.push_back(content(text, tokens, (Split::Token, channel), arrived_ns));
    } else if spelled {
        // Several tokens in one chunk (rarer): one item each. Allocates the lists.
        for t in tokens.drain(..) {
            let mut piece = spares.text();
            piece.clear();
            piece.push_str(&t.text);
            items.push_back(content(piece, vec![t], (Split::Token, channel), arrived_ns));
        }
        spares.put(text, tokens);
    } else {
        items.push_back(content(text, tokens, (Split::Chars, channel), arrived_ns));
    }
}

/// Reasoning that shares its chunk with content or a tool call (rare: the turn from
/// thinking to answering inside one chunk). The leading tokens whose texts fit in the
/// reasoning's length are its own; the rest stay for what follows. (Allocates the split.)
fn push_leading_reasoning(
    items: &mut VecDeque<Item>,
    spares: &mut Spares,
    c: &mut UpstreamChunk,
    arrived_ns: u64,
) {
    let mut len = 0;
    let k = c
        .tokens
        .iter()
        .take_while(|t| {
            len += t.text.len();
            len <= c.reasoning.len()
        })
        .count();
    let rest = c.tokens.split_off(k);
    let tokens = std::mem::replace(&mut c.tokens, rest);
    let text = std::mem::replace(&mut c.reasoning, spares.text());
    push_text(
        items,
        spares,
        (text, tokens),
        Channel::Reasoning,
        arrived_ns,
    );
}

/// Merges one tool-call delta list into `tools` (by `index`); returns the calls it started
/// (`{index, id, name}`), which are the ones a frame carrying this delta dispatches.
///
/// Backends shape these deltas two ways: OpenAI and vLLM name a call in its first delta only
/// and then send argument pieces; llama.cpp's server repeats `id`, `type` and the whole `name`
/// in every delta beside its argument piece. So `arguments` pieces are appended, while a `name`
/// equal to the name so far is that repetition and changes nothing (a name sent in pieces
/// still joins, unless a piece repeats the whole of what came before it, which no backend
/// here does).
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
                let Some(piece) = f.get(key).and_then(Value::as_str) else {
                    continue;
                };
                let cur = t["function"][key].as_str().unwrap_or("");
                if key == "name" && piece == cur {
                    continue;
                }
                t["function"][key] = format!("{cur}{piece}").into();
            }
        }
        if fresh && !t["id"].is_null() {
            started.push(json!({"index": index, "id": t["id"], "name": t["function"]["name"]}));
        }
    }
    started
}

#[cfg(test)]
mod tests;
