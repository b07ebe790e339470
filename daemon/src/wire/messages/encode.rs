//! The Messages stream (docs/wire-format.md, "Messages API"): what a [`ChunkEncoder`] whose
//! endpoint is [`Endpoint::Messages`] writes instead of chat chunks.
//!
//! ```text
//! event: message_start         (with the response head: id, model, empty content)
//! event: content_block_start   (a block opens: text, thinking or tool_use)
//! event: content_block_delta   (text_delta, thinking_delta, input_json_delta: one per token)
//! event: content_block_stop    (the block closes when the next one opens, or at the end)
//! event: message_delta         (stop_reason, usage)
//! event: message_stop
//! ```
//!
//! A chat stream's frames carry no state: each chunk stands alone. A Messages stream's do: a
//! token whose channel differs from the open block's closes it and opens the next in the same
//! frame. The encoder keeps which block is open in [`Blocks`] (a `Cell`, since a turn owns its
//! encoder and writes its frames one at a time), and the kernel bound
//! ([`max_event_bytes`]) is measured on the largest such frame: a block's stop, the next
//! block's start and the delta.
//!
//! Frames on the hot path are written straight into the connection's buffer, as chat's are.

use std::{cell::Cell, io::Write as _};

use serde_json::{json, Value};

use crate::wire::{
    json_write::{write_str, write_u64, ESCAPED_PER_BYTE},
    stream_id::StreamId,
    token::{
        Channel, ToolCallDelta, MAX_TOKEN_TEXT_BYTES, MAX_TOOL_CALL_ID_BYTES, MAX_TOOL_NAME_BYTES,
    },
};

/// What a Messages stream's events are written from: the stream id (the message id is
/// `msg_` and it), the model, and the open block. The chat encoder
/// ([`crate::wire::ChunkEncoder`]) lends its fields.
#[derive(Clone, Copy, Debug)]
pub struct Stream<'a> {
    pub stream_id: StreamId,
    pub model: &'a str,
    pub blocks: &'a Cell<Blocks>,
}

/// The kind of content block a frame writes into.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum BlockKind {
    /// No block is open.
    #[default]
    None,
    Text,
    Thinking,
    /// A `tool_use` block, for the chat tool call of this index.
    ToolUse(u32),
}

/// Where a Messages stream stands: whether `message_start` went out, which block is open,
/// and how many blocks were opened (the next block's index).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Blocks {
    pub started: bool,
    pub open: BlockKind,
    pub opened: u32,
}

/// `stop_reason` for a chat `finish_reason`. A stop sequence ends a chat turn as `"stop"`
/// without saying which, so it is reported as `end_turn`.
pub fn stop_reason(finish_reason: &str) -> &'static str {
    match finish_reason {
        "length" => "max_tokens",
        "tool_calls" | "function_call" => "tool_use",
        "content_filter" => "refusal",
        _ => "end_turn",
    }
}

/// The message id: `msg_` and the stream id.
fn write_message_id(stream: Stream<'_>, out: &mut Vec<u8>) {
    let _ = write!(out, "\"msg_{}\"", stream.stream_id);
}

/// `message_start`, once per stream (with the response head, or before the first event of a
/// stream whose head went out another way).
pub fn message_start(stream: Stream<'_>, out: &mut Vec<u8>) {
    let mut b = stream.blocks.get();
    if b.started {
        return;
    }
    b.started = true;
    stream.blocks.set(b);
    out.extend_from_slice(
        b"event: message_start\ndata: {\"type\":\"message_start\",\"message\":{\"id\":",
    );
    write_message_id(stream, out);
    out.extend_from_slice(b",\"type\":\"message\",\"role\":\"assistant\",\"model\":");
    write_str(out, stream.model);
    out.extend_from_slice(
        b",\"content\":[],\"stop_reason\":null,\"stop_sequence\":null,\"usage\":{\"input_tokens\":0,\"output_tokens\":0}}}\n\n",
    );
}

fn block_stop(out: &mut Vec<u8>, index: u32) {
    out.extend_from_slice(
        b"event: content_block_stop\ndata: {\"type\":\"content_block_stop\",\"index\":",
    );
    write_u64(out, u64::from(index));
    out.extend_from_slice(b"}\n\n");
}

/// Closes the open block, if any.
fn close(stream: Stream<'_>, out: &mut Vec<u8>) {
    let mut b = stream.blocks.get();
    if b.open != BlockKind::None {
        block_stop(out, b.opened.saturating_sub(1));
        b.open = BlockKind::None;
        stream.blocks.set(b);
    }
}

/// Makes `kind` the open block: closes another and starts it (`tool` names a tool_use
/// block's id and name). Returns the open block's index.
fn open(stream: Stream<'_>, out: &mut Vec<u8>, kind: BlockKind, tool: (&str, &str)) -> u32 {
    message_start(stream, out);
    let b = stream.blocks.get();
    if b.open == kind {
        return b.opened.saturating_sub(1);
    }
    close(stream, out);
    let mut b = stream.blocks.get();
    let index = b.opened;
    out.extend_from_slice(
        b"event: content_block_start\ndata: {\"type\":\"content_block_start\",\"index\":",
    );
    write_u64(out, u64::from(index));
    out.extend_from_slice(b",\"content_block\":");
    match kind {
        BlockKind::Text | BlockKind::None => {
            out.extend_from_slice(b"{\"type\":\"text\",\"text\":\"\"}")
        }
        BlockKind::Thinking => {
            out.extend_from_slice(b"{\"type\":\"thinking\",\"thinking\":\"\",\"signature\":\"\"}")
        }
        BlockKind::ToolUse(_) => {
            out.extend_from_slice(b"{\"type\":\"tool_use\",\"id\":");
            write_str(out, tool.0);
            out.extend_from_slice(b",\"name\":");
            write_str(out, tool.1);
            out.extend_from_slice(b",\"input\":{}}");
        }
    }
    out.extend_from_slice(b"}\n\n");
    b.open = kind;
    b.opened = index.saturating_add(1);
    stream.blocks.set(b);
    index
}

fn delta_head(out: &mut Vec<u8>, index: u32) {
    out.extend_from_slice(
        b"event: content_block_delta\ndata: {\"type\":\"content_block_delta\",\"index\":",
    );
    write_u64(out, u64::from(index));
}

/// A token's text: a `text_delta` (content) or `thinking_delta` (reasoning), in a block of
/// its kind.
pub fn text_delta(stream: Stream<'_>, out: &mut Vec<u8>, text: &str, channel: Channel) {
    let (kind, head): (_, &[u8]) = match channel {
        Channel::Content => (
            BlockKind::Text,
            b",\"delta\":{\"type\":\"text_delta\",\"text\":",
        ),
        Channel::Reasoning => (
            BlockKind::Thinking,
            b",\"delta\":{\"type\":\"thinking_delta\",\"thinking\":",
        ),
    };
    let index = open(stream, out, kind, ("", ""));
    delta_head(out, index);
    out.extend_from_slice(head);
    write_str(out, text);
    out.extend_from_slice(b"}}\n\n");
}

/// A chat tool-call frame: its header opens a `tool_use` block (id and name); a piece of its
/// arguments is an `input_json_delta` in that block. A piece for a call whose block is not
/// open opens one with what is known (an upstream that never sent the header: empty id and
/// name). A header for the call whose block is already open (an upstream that repeats it)
/// is a `ping`, which clients skip: every frame carries an event.
pub fn tool_delta(stream: Stream<'_>, out: &mut Vec<u8>, call: ToolCallDelta<'_>) {
    let kind = BlockKind::ToolUse(call.index);
    let before = out.len();
    let index = open(
        stream,
        out,
        kind,
        (call.id.unwrap_or_default(), call.name.unwrap_or_default()),
    );
    if call.arguments.is_empty() {
        if out.len() == before {
            out.extend_from_slice(PING);
        }
        return;
    }
    delta_head(out, index);
    out.extend_from_slice(b",\"delta\":{\"type\":\"input_json_delta\",\"partial_json\":");
    write_str(out, call.arguments);
    out.extend_from_slice(b"}}\n\n");
}

/// The end of a stream that ends normally: the open block's stop, `message_delta` with the
/// stop reason and usage, `message_stop`.
pub fn finish(
    stream: Stream<'_>,
    out: &mut Vec<u8>,
    finish_reason: &str,
    usage: Option<(u64, u64)>,
) {
    message_start(stream, out);
    close(stream, out);
    let (input, output) = usage.unwrap_or_default();
    out.extend_from_slice(
        b"event: message_delta\ndata: {\"type\":\"message_delta\",\"delta\":{\"stop_reason\":\"",
    );
    out.extend_from_slice(stop_reason(finish_reason).as_bytes());
    out.extend_from_slice(b"\",\"stop_sequence\":null},\"usage\":{\"input_tokens\":");
    write_u64(out, input);
    out.extend_from_slice(b",\"output_tokens\":");
    write_u64(out, output);
    out.extend_from_slice(b"}}\n\n");
    out.extend_from_slice(MESSAGE_STOP);
}

/// The event Messages clients skip.
const PING: &[u8] = b"event: ping\ndata: {\"type\":\"ping\"}\n\n";

/// The last event of every Messages stream.
pub const MESSAGE_STOP: &[u8] = b"event: message_stop\ndata: {\"type\":\"message_stop\"}\n\n";

/// haltd's annotation after a reply (e.g. `haltd_grounding`) as an event of its own name,
/// which Messages clients skip (the SDKs read only the event types they know).
pub fn annotation(stream: Stream<'_>, out: &mut Vec<u8>, field: &str, value: &Value) {
    message_start(stream, out);
    let _ = write!(out, "event: {field}\ndata: ");
    let _ = serde_json::to_writer(&mut *out, &json!({"type": field, field: value}));
    out.extend_from_slice(b"\n\n");
}

/// A whole Messages response body (`stream: false`): thinking, text and `tool_use` blocks
/// from the chat turn's reasoning, text and tool calls.
pub fn batch_body(
    stream: Stream<'_>,
    (text, reasoning): (&str, &str),
    finish_reason: &str,
    (input_tokens, output_tokens): (u64, u64),
    tool_calls: Option<&Value>,
) -> Vec<u8> {
    let mut content = Vec::new();
    if !reasoning.is_empty() {
        content.push(json!({"type": "thinking", "thinking": reasoning, "signature": ""}));
    }
    if !text.is_empty() || tool_calls.is_none() {
        content.push(json!({"type": "text", "text": text}));
    }
    for call in tool_calls.and_then(Value::as_array).into_iter().flatten() {
        content.push(tool_use_block(call));
    }
    json!({
        "id": format!("msg_{}", stream.stream_id),
        "type": "message",
        "role": "assistant",
        "model": stream.model,
        "content": content,
        "stop_reason": stop_reason(finish_reason),
        "stop_sequence": null,
        "usage": {"input_tokens": input_tokens, "output_tokens": output_tokens},
    })
    .to_string()
    .into_bytes()
}

/// A chat `tool_calls` entry as a `tool_use` block: its arguments parsed as the input (a
/// string that is not JSON stays a string, so nothing the model wrote is lost).
fn tool_use_block(call: &Value) -> Value {
    let args = call["function"]["arguments"].as_str().unwrap_or_default();
    let input = if args.trim().is_empty() {
        json!({})
    } else {
        serde_json::from_str(args).unwrap_or_else(|_| Value::String(args.to_owned()))
    };
    json!({
        "type": "tool_use",
        "id": call["id"],
        "name": call["function"]["name"],
        "input": input,
    })
}

/// An upper bound on any token frame of a Messages stream (`E`): the largest block stop, a
/// block start and the delta, each text at its cap escaped at [`ESCAPED_PER_BYTE`]. Measured
/// by writing the templates with the encoder itself, every block index at ten digits.
pub fn max_event_bytes(stream_id: StreamId, model: &str) -> usize {
    let blocks = Cell::new(Blocks::default());
    let template = Stream {
        stream_id,
        model,
        blocks: &blocks,
    };
    let mut out = Vec::with_capacity(512);
    let mut worst = |write: &dyn Fn(&mut Vec<u8>)| {
        out.clear();
        // A tool_use block is open, so every frame closes it and opens its own.
        blocks.set(Blocks {
            started: true,
            open: BlockKind::ToolUse(u32::MAX - 1),
            opened: u32::MAX,
        });
        write(&mut out);
        out.len()
    };
    let thinking = worst(&|o| text_delta(template, o, "", Channel::Reasoning));
    let text = worst(&|o| text_delta(template, o, "", Channel::Content));
    // One byte of arguments (a NUL, escaped to 6) so that the delta is written; it is
    // counted back below.
    let tool = worst(&|o| {
        let call = ToolCallDelta {
            index: u32::MAX,
            id: Some(""),
            name: Some(""),
            arguments: "\u{0}",
        };
        tool_delta(template, o, call);
    }) - ESCAPED_PER_BYTE;
    let texts = thinking.max(text) + ESCAPED_PER_BYTE * MAX_TOKEN_TEXT_BYTES;
    let tools = tool
        + ESCAPED_PER_BYTE * (MAX_TOOL_CALL_ID_BYTES + MAX_TOOL_NAME_BYTES + MAX_TOKEN_TEXT_BYTES);
    texts.max(tools)
}

#[cfg(test)]
mod tests;
