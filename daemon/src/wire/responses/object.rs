//! The Response object of a Responses stream's lifecycle events and of a batch body, as a
//! `serde_json` Value (the rare halted response, which adds fields of its own) and written
//! directly into a frame buffer (the start events and the end of every stream, which the
//! 1-token profile showed building Values: docs/bench.md, "Responses beside chat").
//!
//! The direct writers put the keys in the order a Value's map writes them (sorted: serde_json
//! without `preserve_order`), so both ways give the same bytes.

use serde_json::{json, Value};

use crate::wire::{
    json_write::{write_hex8, write_str, write_u64},
    stream_id::StreamId,
};

/// The response id: `resp_` and the stream id.
pub fn response_id(stream_id: StreamId) -> String {
    format!("resp_{stream_id}")
}

/// The Response object: the fields the openai SDK's `Response` model requires, with what
/// haltd does not echo from the request at its default (`tools: []`, `tool_choice: "auto"`),
/// and `store: false` (haltd keeps none).
pub fn response_object(
    stream_id: StreamId,
    created: u64,
    model: &str,
    status: &str,
    output: Vec<Value>,
    usage: Option<Value>,
) -> Value {
    json!({
        "id": response_id(stream_id),
        "object": "response",
        "created_at": created,
        "status": status,
        "background": false,
        "error": null,
        "incomplete_details": null,
        "instructions": null,
        "max_output_tokens": null,
        "metadata": {},
        "model": model,
        "output": output,
        "parallel_tool_calls": true,
        "previous_response_id": null,
        "store": false,
        "temperature": null,
        "text": {"format": {"type": "text"}},
        "tool_choice": "auto",
        "tools": [],
        "top_p": null,
        "truncation": "disabled",
        "usage": usage,
    })
}

/// The `usage` object: input, output and reasoning tokens (no cached tokens: the backend's
/// caching is its own).
pub fn usage(input: u64, output: u64, reasoning: u64) -> Value {
    json!({
        "input_tokens": input,
        "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
        "output_tokens": output,
        "output_tokens_details": {"reasoning_tokens": reasoning.min(output)},
        "total_tokens": input.saturating_add(output),
    })
}

/// What a Response says of itself apart from its output and usage.
#[derive(Clone, Copy, Debug)]
pub struct Head<'a> {
    pub stream_id: StreamId,
    pub created: u64,
    pub model: &'a str,
    pub status: &'a str,
    /// `incomplete_details.reason`, or none (`null`).
    pub incomplete: Option<&'a str>,
}

/// [`response_object`] written directly: `output` writes the items of the `output` array
/// (without its brackets); `usage` is (input, output, reasoning) tokens, or `null` when none.
pub fn write_response(
    out: &mut Vec<u8>,
    head: Head<'_>,
    output: impl FnOnce(&mut Vec<u8>),
    usage: Option<(u64, u64, u64)>,
) {
    out.extend_from_slice(b"{\"background\":false,\"created_at\":");
    write_u64(out, head.created);
    out.extend_from_slice(b",\"error\":null,\"id\":\"resp_hs_");
    write_hex8(out, head.stream_id.generation);
    write_hex8(out, head.stream_id.slot);
    out.extend_from_slice(b"\",\"incomplete_details\":");
    match head.incomplete {
        Some(reason) => {
            out.extend_from_slice(b"{\"reason\":");
            write_str(out, reason);
            out.push(b'}');
        }
        None => out.extend_from_slice(b"null"),
    }
    out.extend_from_slice(
        b",\"instructions\":null,\"max_output_tokens\":null,\"metadata\":{},\"model\":",
    );
    write_str(out, head.model);
    out.extend_from_slice(b",\"object\":\"response\",\"output\":[");
    output(out);
    out.extend_from_slice(
        b"],\"parallel_tool_calls\":true,\"previous_response_id\":null,\"status\":",
    );
    write_str(out, head.status);
    out.extend_from_slice(
        b",\"store\":false,\"temperature\":null,\"text\":{\"format\":{\"type\":\"text\"}},\
          \"tool_choice\":\"auto\",\"tools\":[],\"top_p\":null,\"truncation\":\"disabled\",\
          \"usage\":",
    );
    match usage {
        Some((input, output, reasoning)) => write_usage(out, input, output, reasoning),
        None => out.extend_from_slice(b"null"),
    }
    out.push(b'}');
}

/// [`usage`] written directly.
fn write_usage(out: &mut Vec<u8>, input: u64, output: u64, reasoning: u64) {
    out.extend_from_slice(b"{\"input_tokens\":");
    write_u64(out, input);
    out.extend_from_slice(
        b",\"input_tokens_details\":{\"cache_write_tokens\":0,\"cached_tokens\":0},\
          \"output_tokens\":",
    );
    write_u64(out, output);
    out.extend_from_slice(b",\"output_tokens_details\":{\"reasoning_tokens\":");
    write_u64(out, reasoning.min(output));
    out.extend_from_slice(b"},\"total_tokens\":");
    write_u64(out, input.saturating_add(output));
    out.push(b'}');
}
