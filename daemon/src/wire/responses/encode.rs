//! The Responses stream (docs/wire-format.md, "Responses API"): what a [`ChunkEncoder`] whose
//! endpoint is [`Endpoint::Responses`] writes instead of chat chunks.
//!
//! ```text
//! event: response.created                 (with the response head: seq 0, status in_progress)
//! event: response.in_progress             (with the head too: seq 1)
//! event: response.output_item.added       (an item opens: message, reasoning or function_call)
//! event: response.content_part.added      (its part: output_text or reasoning_text)
//! event: response.output_text.delta       (one per token; reasoning_text.delta for reasoning,
//!                                          function_call_arguments.delta for a call)
//! event: response.output_text.done        (at the end, for every item, in output order:
//! event: response.content_part.done        the whole text of the item, its part, the item)
//! event: response.output_item.done
//! event: response.completed               (the whole response: output and usage)
//! ```
//!
//! Every event carries `type` (its name) and `sequence_number`, counted from 0 over the whole
//! stream, so the encoder keeps state ([`Output`], in a `RefCell` since a turn owns its encoder
//! and writes its frames one at a time): the next sequence number and the output items.
//!
//! **Items close at the end, not when the next one opens.** The API's `.done` events repeat an
//! item's whole text (three times: the text, its part, the item). Written in the token frame
//! that opens the next item they would make that frame as large as the item before it, and a
//! token frame must stay within [`max_event_bytes`], the kernel's per-frame bound (`E`, the
//! post-trip byte ceiling is B × E). So a token frame only opens items and carries a delta (at
//! most [`EVENTS_PER_TOKEN`] events: `output_item.added`, `content_part.added`, the delta), and
//! the final frame, which no trip lets out, closes every item in output order. Clients key
//! deltas and `.done` events by `output_index` (the openai SDK's stream accumulator does), so
//! an item that stays open while the next streams is read as OpenAI's own are.
//!
//! **The hot path keeps each item's text.** The `.done` events and `response.completed` carry
//! every item's whole text, which the stream cannot take back from the client: each delta is
//! appended to its item's `String` (amortised: no allocation per token once it has grown, as
//! the connection's frame buffer). A turn's text is held once more in memory, as a batch turn
//! holds it. Logprobs ride on each `output_text.delta` only; the `.done` events say `[]`.

use std::{cell::RefCell, ops::Range};

use serde_json::Value;

use crate::wire::{
    json_write::{write_hex8, write_logprob, write_str, write_u64, LONGEST_LOGPROB},
    responses::object::{write_response, Head},
    stream_id::StreamId,
    text::truncate_text,
    token::{
        Channel, Token, ToolCallDelta, MAX_TOKEN_TEXT_BYTES, MAX_TOOL_CALL_ID_BYTES,
        MAX_TOOL_NAME_BYTES,
    },
};

/// Most events one token frame writes: an item's `output_item.added`, its
/// `content_part.added` and the delta. The halt core counts the terminal's `sequence_number`
/// with it (`halt/terminal.rs`): after the trip at most this many events per post-trip token.
pub const EVENTS_PER_TOKEN: u64 = 3;

/// What a Responses stream's events are written from; the chat encoder
/// ([`crate::wire::ChunkEncoder`]) lends its fields.
#[derive(Clone, Copy, Debug)]
pub struct Stream<'a> {
    pub stream_id: StreamId,
    pub created: u64,
    pub model: &'a str,
    pub output: &'a RefCell<Output>,
}

/// The kind of an output item.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum ItemKind {
    /// A `message` with one `output_text` part.
    Message,
    /// A `reasoning` item with one `reasoning_text` part.
    Reasoning,
    /// A `function_call`, for the chat tool call of this index.
    FunctionCall(u32),
}

impl ItemKind {
    fn id_prefix(self) -> &'static [u8] {
        match self {
            ItemKind::Message => b"msg_",
            ItemKind::Reasoning => b"rs_",
            ItemKind::FunctionCall(_) => b"fc_",
        }
    }
}

/// One output item: its kind, what it has said so far (text, reasoning or arguments) and, for
/// a call, its `call_id` and name.
#[derive(Clone, Debug)]
struct Item {
    kind: ItemKind,
    text: String,
    call: Option<(String, String)>,
}

/// Where a Responses stream stands: whether its start events went out, the next
/// `sequence_number`, the reasoning deltas (usage's `reasoning_tokens`) and the items.
#[derive(Clone, Debug, Default)]
pub struct Output {
    pub started: bool,
    pub sequence: u64,
    pub reasoning_tokens: u64,
    items: Vec<Item>,
}

impl Output {
    /// The next sequence number, counted.
    fn next(&mut self) -> u64 {
        let n = self.sequence;
        self.sequence += 1;
        n
    }
}

/// `event: NAME\ndata: {"type":"NAME","sequence_number":N` (the caller writes the rest).
fn event_head(out: &mut Vec<u8>, name: &str, seq: u64) {
    out.extend_from_slice(b"event: ");
    out.extend_from_slice(name.as_bytes());
    out.extend_from_slice(b"\ndata: {\"type\":\"");
    out.extend_from_slice(name.as_bytes());
    out.extend_from_slice(b"\",\"sequence_number\":");
    write_u64(out, seq);
}

/// An event whose data is `{"type", "sequence_number"}` and the members of `rest` (an
/// object), for the rarer events written with `serde_json`.
pub fn write_event(out: &mut Vec<u8>, name: &str, seq: u64, rest: &Value) {
    event_head(out, name, seq);
    if let Some(map) = rest.as_object() {
        for (k, v) in map {
            out.push(b',');
            write_str(out, k);
            out.push(b':');
            let _ = serde_json::to_writer(&mut *out, v);
        }
    }
    out.extend_from_slice(b"}\n\n");
}

/// An item's id (`msg_`, `rs_` or `fc_`, the stream id, its output index), quoted.
fn write_item_id(out: &mut Vec<u8>, stream_id: StreamId, kind: ItemKind, index: u32) {
    out.push(b'"');
    out.extend_from_slice(kind.id_prefix());
    out.extend_from_slice(b"hs_");
    write_hex8(out, stream_id.generation);
    write_hex8(out, stream_id.slot);
    out.push(b'_');
    write_u64(out, u64::from(index));
    out.push(b'"');
}

/// `response.created` and `response.in_progress`, sequence numbers 0 and 1, each with the
/// response head (in progress, no output, no usage), written once and copied.
pub fn write_start_events(out: &mut Vec<u8>, stream_id: StreamId, created: u64, model: &str) {
    let head = Head {
        stream_id,
        created,
        model,
        status: "in_progress",
        incomplete: None,
    };
    event_head(out, "response.created", 0);
    out.extend_from_slice(b",\"response\":");
    let start = out.len();
    write_response(out, head, |_| {}, None);
    let response = start..out.len();
    out.extend_from_slice(b"}\n\n");
    event_head(out, "response.in_progress", 1);
    out.extend_from_slice(b",\"response\":");
    out.extend_from_within(response);
    out.extend_from_slice(b"}\n\n");
}

/// The start events, once per stream (with the response head, or before the first event of a
/// stream whose head went out another way).
pub fn stream_start(stream: Stream<'_>, out: &mut Vec<u8>) {
    let mut o = stream.output.borrow_mut();
    if o.started {
        return;
    }
    o.started = true;
    o.sequence = 2;
    write_start_events(out, stream.stream_id, stream.created, stream.model);
}

/// `response.output_item.added` for a new item at `index` (in progress, empty), and for a
/// message or reasoning item its part's `response.content_part.added`.
fn item_added(
    out: &mut Vec<u8>,
    (stream_id, seq): (StreamId, &mut u64),
    kind: ItemKind,
    index: u32,
    call: (&str, &str),
) {
    event_head(out, "response.output_item.added", *seq);
    *seq += 1;
    out.extend_from_slice(b",\"output_index\":");
    write_u64(out, u64::from(index));
    out.extend_from_slice(b",\"item\":{\"id\":");
    write_item_id(out, stream_id, kind, index);
    let part: &[u8] = match kind {
        ItemKind::Message => {
            out.extend_from_slice(
                b",\"type\":\"message\",\"status\":\"in_progress\",\"role\":\"assistant\",\"content\":[]}}\n\n",
            );
            b"{\"type\":\"output_text\",\"text\":\"\",\"annotations\":[],\"logprobs\":[]}"
        }
        ItemKind::Reasoning => {
            out.extend_from_slice(
                b",\"type\":\"reasoning\",\"status\":\"in_progress\",\"summary\":[],\"content\":[]}}\n\n",
            );
            b"{\"type\":\"reasoning_text\",\"text\":\"\"}"
        }
        ItemKind::FunctionCall(_) => {
            out.extend_from_slice(
                b",\"type\":\"function_call\",\"status\":\"in_progress\",\"call_id\":",
            );
            write_str(out, call.0);
            out.extend_from_slice(b",\"name\":");
            write_str(out, call.1);
            out.extend_from_slice(b",\"arguments\":\"\"}}\n\n");
            return;
        }
    };
    event_head(out, "response.content_part.added", *seq);
    *seq += 1;
    item_ref(out, stream_id, kind, index, true);
    out.extend_from_slice(b",\"part\":");
    out.extend_from_slice(part);
    out.extend_from_slice(b"}\n\n");
}

/// `,"item_id":…,"output_index":…` and `,"content_index":0` when `part`.
fn item_ref(out: &mut Vec<u8>, stream_id: StreamId, kind: ItemKind, index: u32, part: bool) {
    out.extend_from_slice(b",\"item_id\":");
    write_item_id(out, stream_id, kind, index);
    out.extend_from_slice(b",\"output_index\":");
    write_u64(out, u64::from(index));
    if part {
        out.extend_from_slice(b",\"content_index\":0");
    }
}

/// The index of the item a delta of `kind` goes in: the last item when it is of that kind (a
/// call's item wherever it is), else a new one, whose added events are written.
fn item_for(
    stream: Stream<'_>,
    o: &mut Output,
    out: &mut Vec<u8>,
    kind: ItemKind,
    call: (&str, &str),
) -> usize {
    let found = match kind {
        ItemKind::FunctionCall(_) => o.items.iter().rposition(|i| i.kind == kind),
        _ => o
            .items
            .len()
            .checked_sub(1)
            .filter(|&i| o.items[i].kind == kind),
    };
    if let Some(i) = found {
        return i;
    }
    let index = o.items.len();
    let at = u32::try_from(index).unwrap_or(u32::MAX);
    item_added(out, (stream.stream_id, &mut o.sequence), kind, at, call);
    let call =
        matches!(kind, ItemKind::FunctionCall(_)).then(|| (call.0.to_owned(), call.1.to_owned()));
    o.items.push(Item {
        kind,
        text: String::new(),
        call,
    });
    index
}

/// A token's text: an `output_text.delta` (content, with its logprobs when `logprobs` has
/// `top_logprobs` alternatives to write) or a `reasoning_text.delta` (reasoning), in an item
/// of its kind.
pub fn text_delta(
    stream: Stream<'_>,
    out: &mut Vec<u8>,
    text: &str,
    channel: Channel,
    logprobs: Option<(&[Token<'_>], usize)>,
) {
    stream_start(stream, out);
    let mut o = stream.output.borrow_mut();
    let kind = match channel {
        Channel::Content => ItemKind::Message,
        Channel::Reasoning => ItemKind::Reasoning,
    };
    let i = item_for(stream, &mut o, out, kind, ("", ""));
    let seq = o.next();
    if channel == Channel::Reasoning {
        o.reasoning_tokens += 1;
    }
    o.items[i].text.push_str(text);
    drop(o);
    let name = match channel {
        Channel::Content => "response.output_text.delta",
        Channel::Reasoning => "response.reasoning_text.delta",
    };
    let index = u32::try_from(i).unwrap_or(u32::MAX);
    delta_event(out, (stream.stream_id, seq), name, kind, index, text);
    if channel == Channel::Content {
        out.extend_from_slice(b",\"logprobs\":");
        write_logprobs(out, logprobs);
    }
    out.extend_from_slice(b"}\n\n");
}

/// A delta event, open: its head, the item it goes in and `delta`.
fn delta_event(
    out: &mut Vec<u8>,
    (stream_id, seq): (StreamId, u64),
    name: &str,
    kind: ItemKind,
    index: u32,
    delta: &str,
) {
    event_head(out, name, seq);
    let part = !matches!(kind, ItemKind::FunctionCall(_));
    item_ref(out, stream_id, kind, index, part);
    out.extend_from_slice(b",\"delta\":");
    write_str(out, delta);
}

/// A delta's `logprobs`: one entry per token (token, logprob, bytes, top alternatives cut to
/// [`MAX_TOKEN_TEXT_BYTES`]), or `[]`.
fn write_logprobs(out: &mut Vec<u8>, logprobs: Option<(&[Token<'_>], usize)>) {
    out.push(b'[');
    if let Some((toks, top)) = logprobs {
        for (i, t) in toks.iter().enumerate() {
            if i > 0 {
                out.push(b',');
            }
            logprob_entry(out, t.text, t.logprob);
            out.pop();
            out.extend_from_slice(b",\"top_logprobs\":[");
            for (j, (alt, lp)) in t.top.iter().take(top).enumerate() {
                if j > 0 {
                    out.push(b',');
                }
                logprob_entry(out, truncate_text(alt, MAX_TOKEN_TEXT_BYTES), *lp);
            }
            out.extend_from_slice(b"]}");
        }
    }
    out.push(b']');
}

/// `{"token":…,"logprob":…,"bytes":[…]}`.
fn logprob_entry(out: &mut Vec<u8>, token: &str, lp: f32) {
    out.extend_from_slice(b"{\"token\":");
    write_str(out, token);
    out.extend_from_slice(b",\"logprob\":");
    write_logprob(out, lp);
    out.extend_from_slice(b",\"bytes\":[");
    for (i, b) in token.bytes().enumerate() {
        if i > 0 {
            out.push(b',');
        }
        write_u64(out, u64::from(b));
    }
    out.extend_from_slice(b"]}");
}

/// A chat tool-call frame: its header opens a `function_call` item (call id and name); a
/// piece of its arguments is a `function_call_arguments.delta` in that item. A piece for a
/// call with no item opens one with what is known (an upstream that never sent the header:
/// empty id and name). A header for a call whose item is open (an upstream that repeats it)
/// is an empty delta: every frame carries an event.
pub fn tool_delta(stream: Stream<'_>, out: &mut Vec<u8>, call: ToolCallDelta<'_>) {
    stream_start(stream, out);
    let mut o = stream.output.borrow_mut();
    let kind = ItemKind::FunctionCall(call.index);
    let before = out.len();
    let head = (call.id.unwrap_or_default(), call.name.unwrap_or_default());
    let i = item_for(stream, &mut o, out, kind, head);
    if call.arguments.is_empty() && out.len() > before {
        return;
    }
    o.items[i].text.push_str(call.arguments);
    let seq = o.next();
    drop(o);
    let index = u32::try_from(i).unwrap_or(u32::MAX);
    let name = "response.function_call_arguments.delta";
    delta_event(
        out,
        (stream.stream_id, seq),
        name,
        kind,
        index,
        call.arguments,
    );
    out.extend_from_slice(b"}\n\n");
}

/// A text already written at `at` (escaped, quoted) is copied; else `text` is written.
fn put_text(out: &mut Vec<u8>, text: &str, at: Option<&Range<usize>>) {
    match at {
        Some(r) => out.extend_from_within(r.clone()),
        None => write_str(out, text),
    }
}

/// The part of a message or reasoning item (its `content[0]`), whole.
fn write_part(out: &mut Vec<u8>, kind: ItemKind, text: &str, at: Option<&Range<usize>>) {
    if kind == ItemKind::Message {
        out.extend_from_slice(b"{\"annotations\":[],\"logprobs\":[],\"text\":");
        put_text(out, text, at);
        out.extend_from_slice(b",\"type\":\"output_text\"}");
    } else {
        out.extend_from_slice(b"{\"text\":");
        put_text(out, text, at);
        out.extend_from_slice(b",\"type\":\"reasoning_text\"}");
    }
}

/// An item as `output` lists it, completed (its text copied from `at` when written there).
fn write_item(
    out: &mut Vec<u8>,
    stream_id: StreamId,
    index: usize,
    item: &Item,
    at: Option<&Range<usize>>,
) {
    let idx = u32::try_from(index).unwrap_or(u32::MAX);
    let (call_id, name) = item.call.as_ref().map_or(("", ""), |(c, n)| (c, n));
    match item.kind {
        ItemKind::Message | ItemKind::Reasoning => {
            out.extend_from_slice(b"{\"content\":[");
            write_part(out, item.kind, &item.text, at);
            out.extend_from_slice(b"],\"id\":");
            write_item_id(out, stream_id, item.kind, idx);
            out.extend_from_slice(if item.kind == ItemKind::Message {
                b",\"role\":\"assistant\",\"status\":\"completed\",\"type\":\"message\"}"
            } else {
                b",\"status\":\"completed\",\"summary\":[],\"type\":\"reasoning\"}"
            });
        }
        ItemKind::FunctionCall(_) => {
            out.extend_from_slice(b"{\"arguments\":");
            put_text(out, &item.text, at);
            out.extend_from_slice(b",\"call_id\":");
            write_str(out, call_id);
            out.extend_from_slice(b",\"id\":");
            write_item_id(out, stream_id, item.kind, idx);
            out.extend_from_slice(b",\"name\":");
            write_str(out, name);
            out.extend_from_slice(b",\"status\":\"completed\",\"type\":\"function_call\"}");
        }
    }
}

/// The `.done` events of one item: its text's, its part's, its own. The item's text is
/// escaped once and copied; returns where the item itself was written, for the response.
fn item_done(
    out: &mut Vec<u8>,
    o: &mut Output,
    stream_id: StreamId,
    index: usize,
    item: &Item,
) -> Range<usize> {
    let idx = u32::try_from(index).unwrap_or(u32::MAX);
    let text = if let ItemKind::FunctionCall(_) = item.kind {
        event_head(out, "response.function_call_arguments.done", o.next());
        out.extend_from_slice(b",\"arguments\":");
        let start = out.len();
        write_str(out, &item.text);
        let text = start..out.len();
        out.extend_from_slice(b",\"item_id\":");
        write_item_id(out, stream_id, item.kind, idx);
        out.extend_from_slice(b",\"name\":");
        write_str(out, item.call.as_ref().map_or("", |c| c.1.as_str()));
        out.extend_from_slice(b",\"output_index\":");
        write_u64(out, u64::from(idx));
        out.extend_from_slice(b"}\n\n");
        text
    } else {
        let message = item.kind == ItemKind::Message;
        let name = if message {
            "response.output_text.done"
        } else {
            "response.reasoning_text.done"
        };
        event_head(out, name, o.next());
        part_ref(out, stream_id, item.kind, idx);
        if message {
            out.extend_from_slice(b",\"logprobs\":[]");
        }
        out.extend_from_slice(b",\"output_index\":");
        write_u64(out, u64::from(idx));
        out.extend_from_slice(b",\"text\":");
        let start = out.len();
        write_str(out, &item.text);
        let text = start..out.len();
        out.extend_from_slice(b"}\n\n");
        event_head(out, "response.content_part.done", o.next());
        part_ref(out, stream_id, item.kind, idx);
        out.extend_from_slice(b",\"output_index\":");
        write_u64(out, u64::from(idx));
        out.extend_from_slice(b",\"part\":");
        write_part(out, item.kind, &item.text, Some(&text));
        out.extend_from_slice(b"}\n\n");
        text
    };
    event_head(out, "response.output_item.done", o.next());
    out.extend_from_slice(b",\"item\":");
    let start = out.len();
    write_item(out, stream_id, index, item, Some(&text));
    let written = start..out.len();
    out.extend_from_slice(b",\"output_index\":");
    write_u64(out, u64::from(idx));
    out.extend_from_slice(b"}\n\n");
    written
}

/// `,"content_index":0,"item_id":…` (a `.done` event's keys are in a Value's order).
fn part_ref(out: &mut Vec<u8>, stream_id: StreamId, kind: ItemKind, index: u32) {
    out.extend_from_slice(b",\"content_index\":0,\"item_id\":");
    write_item_id(out, stream_id, kind, index);
}

/// The end of a stream that ends normally: every item's `.done` events, in output order, then
/// `response.completed` (or `response.incomplete` with reason `max_output_tokens` for a turn
/// cut by its `max_tokens`) with the whole output (copied from the `output_item.done` events)
/// and the usage.
pub fn finish(
    stream: Stream<'_>,
    out: &mut Vec<u8>,
    finish_reason: &str,
    counts: Option<(u64, u64)>,
) {
    stream_start(stream, out);
    let mut o = stream.output.borrow_mut();
    let items = std::mem::take(&mut o.items);
    let written: Vec<Range<usize>> = items
        .iter()
        .enumerate()
        .map(|(i, item)| item_done(out, &mut o, stream.stream_id, i, item))
        .collect();
    let (input, output_tokens) = counts.unwrap_or_default();
    let usage = (input, output_tokens, o.reasoning_tokens);
    let (name, head) = end_head(stream, finish_reason);
    event_head(out, name, o.next());
    out.extend_from_slice(b",\"response\":");
    let output = |out: &mut Vec<u8>| {
        for (k, r) in written.into_iter().enumerate() {
            if k > 0 {
                out.push(b',');
            }
            out.extend_from_within(r);
        }
    };
    write_response(out, head, output, Some(usage));
    out.extend_from_slice(b"}\n\n");
}

/// The event and the head of the response that ends a turn: `completed`, or `incomplete`
/// (`max_output_tokens`) when the chat turn ended for `length`.
fn end_head<'a>(stream: Stream<'a>, finish_reason: &str) -> (&'static str, Head<'a>) {
    let length = finish_reason == "length";
    let head = Head {
        stream_id: stream.stream_id,
        created: stream.created,
        model: stream.model,
        status: if length { "incomplete" } else { "completed" },
        incomplete: length.then_some("max_output_tokens"),
    };
    let name = if length {
        "response.incomplete"
    } else {
        "response.completed"
    };
    (name, head)
}

/// haltd's annotation after a reply (e.g. `haltd_grounding`) as an event of its own name,
/// which Responses clients skip (the openai SDK's stream accumulator reads only the event
/// types it knows).
pub fn annotation(stream: Stream<'_>, out: &mut Vec<u8>, field: &str, value: &Value) {
    stream_start(stream, out);
    let seq = stream.output.borrow_mut().next();
    let mut rest = serde_json::Map::new();
    rest.insert(field.to_owned(), value.clone());
    write_event(out, field, seq, &Value::Object(rest));
}

/// A whole Response (`stream: false`): a reasoning item, a message and `function_call` items
/// from the chat turn's reasoning, text and tool calls.
pub fn batch_body(
    stream: Stream<'_>,
    (text, reasoning): (&str, &str),
    finish_reason: &str,
    (input_tokens, output_tokens): (u64, u64),
    tool_calls: Option<&Value>,
) -> Vec<u8> {
    let mut items = Vec::new();
    if !reasoning.is_empty() {
        items.push(Item {
            kind: ItemKind::Reasoning,
            text: reasoning.to_owned(),
            call: None,
        });
    }
    if !text.is_empty() || tool_calls.is_none() {
        items.push(Item {
            kind: ItemKind::Message,
            text: text.to_owned(),
            call: None,
        });
    }
    for (k, call) in tool_calls
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
        .enumerate()
    {
        let f = &call["function"];
        let s = |v: &Value| v.as_str().unwrap_or_default().to_owned();
        items.push(Item {
            kind: ItemKind::FunctionCall(u32::try_from(k).unwrap_or(u32::MAX)),
            text: s(&f["arguments"]),
            call: Some((s(&call["id"]), s(&f["name"]))),
        });
    }
    let output = |out: &mut Vec<u8>| {
        for (i, item) in items.iter().enumerate() {
            if i > 0 {
                out.push(b',');
            }
            write_item(out, stream.stream_id, i, item, None);
        }
    };
    let mut out = Vec::with_capacity(1024);
    // Reasoning is not counted apart in a batch turn: the upstream's usage does not say.
    let usage = (input_tokens, output_tokens, 0);
    write_response(
        &mut out,
        end_head(stream, finish_reason).1,
        output,
        Some(usage),
    );
    out
}

/// An upper bound on any token frame of a Responses stream (`E`): a new item's added events
/// and its delta, written by the writers themselves with every number at its widest
/// (sequence numbers at 20 digits, output indexes at 10) and every text at its cap made of
/// U+001F, the byte whose JSON escape and `bytes` entry are the longest together (`\u001f`
/// and `31,`, `ESCAPED_AND_BYTES_PER_BYTE` of `wire/encode/bound.rs`), with `top`
/// alternatives per token when logprobs are asked, each with the longest logprob.
pub fn max_event_bytes(stream_id: StreamId, top: Option<usize>) -> usize {
    let worst = "\u{1f}".repeat(MAX_TOKEN_TEXT_BYTES);
    let alts: Vec<(&str, f32)> = vec![(worst.as_str(), LONGEST_LOGPROB); top.unwrap_or(0)];
    let tok = Token {
        text: &worst,
        logprob: LONGEST_LOGPROB,
        top: &alts,
    };
    let idx = u32::MAX;
    let mut widest = 0;
    for kind in [
        ItemKind::Message,
        ItemKind::Reasoning,
        ItemKind::FunctionCall(idx),
    ] {
        let mut out = Vec::with_capacity(4096);
        let mut seq = u64::MAX - 4;
        let call_id = "\u{1f}".repeat(MAX_TOOL_CALL_ID_BYTES);
        let name = "\u{1f}".repeat(MAX_TOOL_NAME_BYTES);
        item_added(
            &mut out,
            (stream_id, &mut seq),
            kind,
            idx,
            (&call_id, &name),
        );
        let name = match kind {
            ItemKind::Message => "response.output_text.delta",
            ItemKind::Reasoning => "response.reasoning_text.delta",
            ItemKind::FunctionCall(_) => "response.function_call_arguments.delta",
        };
        delta_event(&mut out, (stream_id, seq), name, kind, idx, &worst);
        if kind == ItemKind::Message {
            out.extend_from_slice(b",\"logprobs\":");
            write_logprobs(&mut out, top.map(|k| (std::slice::from_ref(&tok), k)));
        }
        out.extend_from_slice(b"}\n\n");
        widest = widest.max(out.len());
    }
    widest
}

#[cfg(test)]
pub(crate) mod tests;
