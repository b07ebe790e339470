//! The stream of a surface the backend serves natively (`--upstream-surfaces`,
//! `crate::upstream::native`), read into the same [`UpstreamChunk`] as a chat chunk, so that
//! everything after the reader (framing, detectors, TokenCircuit, the encoders) is the one
//! path every turn takes.
//!
//! - **Responses** (OpenAI's events, as vLLM writes them): `response.output_text.delta` is
//!   content, with its `logprobs` entries (the chat shape: `{token, logprob, top_logprobs}`)
//!   as tokens; `response.reasoning_text.delta` (and a reasoning summary's text) is
//!   reasoning; a `function_call` item's `output_item.added` is a tool call's header delta
//!   (`id` its `call_id`, its `name`), `response.function_call_arguments.delta` its
//!   arguments (a call whose arguments came only whole, in `.done`, gets them there);
//!   `response.completed` / `response.incomplete` are the finish reason and the usage, and
//!   end the stream ([`NativeReader::ended`]: the API sends no `[DONE]`); `response.failed`
//!   and `error` are the upstream's error. A refusal's text is content.
//! - **Messages** (Anthropic's events): `message_start` gives the prompt's tokens; a
//!   `tool_use` block's `content_block_start` is a tool call's header delta;
//!   `content_block_delta` is content (`text_delta`), reasoning (`thinking_delta`) or a
//!   call's arguments (`input_json_delta`); `message_delta` is the finish reason
//!   (`end_turn`/`stop_sequence` stop, `max_tokens` length, `tool_use` tool calls,
//!   `refusal` content filter) and the usage; `message_stop` is the end; `error` the
//!   upstream's error. The API has no logprobs: text is framed per character, and a monitor
//!   that needs logprobs fails closed as for any backend without them.
//!
//! Every other event (`.done`, `content_part.*`, `ping`, `signature_delta`, ...) says
//! nothing new: it reads as an empty chunk. Nothing of the backend's stream reaches the
//! client except what is read here and encoded again, so an event this reader does not know
//! is dropped, never relayed unpoliced.
//!
//! Unlike the chat reader, this one reads each event into a `serde_json::Value`: it
//! allocates per event (a pass-through turn costs more than a translated one, measured in
//! docs/bench.md).

use serde::de::DeserializeSeed;
use serde_json::{json, Value};

use super::{
    de::{Any, Scratch},
    error_from_object,
    logprobs::LogprobsShape,
    malformed, ChunkError, FinishReason, Parsed, UpstreamChunk, Usage,
};
use crate::upstream::{framing::MAX_TOOL_CALLS, native::UpstreamSurface};

/// The state of one native stream: the calls opened so far and what the stream said of its
/// usage before its end.
#[derive(Debug)]
pub struct NativeReader {
    surface: UpstreamSurface,
    /// Per tool call (its chat `index` is its position): the key the backend names it by
    /// (Responses: the item's `id`; Messages: the content block's `index`), and whether
    /// arguments came for it.
    calls: Vec<(String, bool)>,
    /// Messages: `input_tokens` of `message_start`.
    prompt_tokens: u64,
    /// The terminal event was read.
    ended: bool,
}

impl NativeReader {
    pub fn new(surface: UpstreamSurface) -> Self {
        NativeReader {
            surface,
            calls: Vec::new(),
            prompt_tokens: 0,
            ended: false,
        }
    }

    /// Whether the stream's terminal event (`response.completed`, `response.incomplete`)
    /// was read: nothing follows it, and the API sends no `[DONE]`.
    pub fn ended(&self) -> bool {
        self.ended
    }

    /// Reads one event's data into `out` (reset first).
    pub(super) fn read(
        &mut self,
        data: &str,
        out: &mut UpstreamChunk,
        scratch: &mut Scratch,
    ) -> Result<Parsed, ChunkError> {
        let v: Value = serde_json::from_str(data).map_err(|e| ChunkError::Json {
            reason: e.to_string(),
        })?;
        if !v.is_object() {
            return Err(malformed("event is not a JSON object"));
        }
        reset(out);
        let kind = v["type"].as_str().unwrap_or_default();
        match self.surface {
            UpstreamSurface::Responses => self.responses(kind, &v, out, scratch),
            UpstreamSurface::Messages => self.messages(kind, &v, out),
        }
    }

    fn responses(
        &mut self,
        kind: &str,
        v: &Value,
        out: &mut UpstreamChunk,
        scratch: &mut Scratch,
    ) -> Result<Parsed, ChunkError> {
        match kind {
            "response.created" | "response.in_progress" => {
                out.role = true;
                set_str(&mut out.id, &v["response"]["id"], 128);
                set_str(&mut out.model, &v["response"]["model"], 256);
            }
            "response.output_text.delta" | "response.refusal.delta" => {
                out.content.push_str(text(v, "delta")?);
                if let Some(lp) = v.get("logprobs").filter(|l| !l.is_null()) {
                    let wrapped = json!({ "content": lp });
                    let shape = LogprobsShape {
                        tokens: &mut out.tokens,
                        scratch,
                    };
                    Any(shape)
                        .deserialize(&wrapped)
                        .map_err(|e| malformed(format!("logprobs: {e}")))??;
                }
            }
            "response.reasoning_text.delta"
            | "response.reasoning.delta"
            | "response.reasoning_summary_text.delta" => {
                out.reasoning.push_str(text(v, "delta")?);
            }
            "response.output_item.added" if v["item"]["type"] == "function_call" => {
                let item = &v["item"];
                let key = item_key(item["id"].as_str(), &v["output_index"]);
                let id = item["call_id"].as_str().or(item["id"].as_str());
                let args = item["arguments"].as_str().unwrap_or_default();
                self.open_call(out, key, id, &item["name"], args)?;
            }
            "response.function_call_arguments.delta" => {
                let key = item_key(v["item_id"].as_str(), &v["output_index"]);
                self.arguments(out, &key, text(v, "delta")?)?;
            }
            "response.function_call_arguments.done" => {
                let key = item_key(v["item_id"].as_str(), &v["output_index"]);
                let whole = v["arguments"].as_str().unwrap_or_default();
                if self.call(&key).is_some_and(|i| !self.calls[i].1) && !whole.is_empty() {
                    self.arguments(out, &key, whole)?;
                }
            }
            "response.completed" | "response.incomplete" => {
                let r = &v["response"];
                out.finish_reason = Some(self.responses_finish(kind, r));
                out.usage = usage(&r["usage"], "input_tokens", "output_tokens", 0)?;
                self.ended = true;
            }
            "response.failed" => {
                let e = &v["response"]["error"];
                let obj = e.as_object().cloned().unwrap_or_default();
                return Ok(Parsed::Error(error_from_object(&obj)));
            }
            "error" => return Ok(Parsed::Error(error_object(v))),
            _ => {}
        }
        Ok(Parsed::Chunk)
    }

    /// The finish reason of a terminal event. vLLM ends a Response cut by its length with
    /// `response.completed` whose `status` is `incomplete`: the status decides, not the name.
    fn responses_finish(&self, kind: &str, r: &Value) -> FinishReason {
        let incomplete = kind == "response.incomplete" || r["status"] == "incomplete";
        if !incomplete {
            return if self.calls.is_empty() {
                FinishReason::Stop
            } else {
                FinishReason::ToolCalls
            };
        }
        match r["incomplete_details"]["reason"].as_str() {
            Some("max_output_tokens") => FinishReason::Length,
            Some("content_filter") => FinishReason::ContentFilter,
            Some(other) => FinishReason::Other(crate::wire::truncate_chars(other, 64)),
            None => FinishReason::Other("incomplete".to_owned()),
        }
    }

    fn messages(
        &mut self,
        kind: &str,
        v: &Value,
        out: &mut UpstreamChunk,
    ) -> Result<Parsed, ChunkError> {
        match kind {
            "message_start" => {
                let m = &v["message"];
                out.role = true;
                set_str(&mut out.id, &m["id"], 128);
                set_str(&mut out.model, &m["model"], 256);
                self.prompt_tokens = m["usage"]["input_tokens"].as_u64().unwrap_or(0);
            }
            "content_block_start" => {
                let b = &v["content_block"];
                let key = item_key(None, &v["index"]);
                match b["type"].as_str() {
                    Some("text") => out.content.push_str(b["text"].as_str().unwrap_or("")),
                    Some("thinking") => {
                        out.reasoning.push_str(b["thinking"].as_str().unwrap_or(""));
                    }
                    Some("tool_use") => {
                        // `input` is `{}` here; the arguments follow as JSON deltas.
                        self.open_call(out, key, b["id"].as_str(), &b["name"], "")?;
                    }
                    _ => {}
                }
            }
            "content_block_delta" => {
                let d = &v["delta"];
                match d["type"].as_str() {
                    Some("text_delta") => out.content.push_str(text(d, "text")?),
                    Some("thinking_delta") => out.reasoning.push_str(text(d, "thinking")?),
                    Some("input_json_delta") => {
                        let key = item_key(None, &v["index"]);
                        self.arguments(out, &key, text(d, "partial_json")?)?;
                    }
                    _ => {}
                }
            }
            "message_delta" => {
                if let Some(r) = v["delta"]["stop_reason"].as_str() {
                    out.finish_reason = Some(match r {
                        "end_turn" | "stop_sequence" => FinishReason::Stop,
                        "max_tokens" => FinishReason::Length,
                        "tool_use" => FinishReason::ToolCalls,
                        "refusal" => FinishReason::ContentFilter,
                        other => FinishReason::Other(crate::wire::truncate_chars(other, 64)),
                    });
                }
                out.usage = usage(
                    &v["usage"],
                    "input_tokens",
                    "output_tokens",
                    self.prompt_tokens,
                )?;
            }
            "message_stop" => return Ok(Parsed::Done),
            "error" => return Ok(Parsed::Error(error_object(v))),
            _ => {}
        }
        Ok(Parsed::Chunk)
    }

    /// The chat index of the call the backend names `key`.
    fn call(&self, key: &str) -> Option<usize> {
        self.calls.iter().position(|(k, _)| k == key)
    }

    /// A new call: its header delta (`id`, `type`, `name`, the arguments given so far).
    fn open_call(
        &mut self,
        out: &mut UpstreamChunk,
        key: String,
        id: Option<&str>,
        name: &Value,
        args: &str,
    ) -> Result<(), ChunkError> {
        if self.calls.len() >= MAX_TOOL_CALLS as usize {
            return Err(malformed(format!("more than {MAX_TOOL_CALLS} tool calls")));
        }
        if self.call(&key).is_some() {
            return Err(malformed(format!("tool call {key} opened twice")));
        }
        let name = name
            .as_str()
            .ok_or_else(|| malformed("a tool call without a name"))?;
        let index = self.calls.len();
        self.calls.push((key, !args.is_empty()));
        out.tool_calls = Some(json!([{
            "index": index,
            "id": id,
            "type": "function",
            "function": {"name": name, "arguments": args},
        }]));
        Ok(())
    }

    /// Arguments of the call named `key`.
    fn arguments(
        &mut self,
        out: &mut UpstreamChunk,
        key: &str,
        args: &str,
    ) -> Result<(), ChunkError> {
        let index = self
            .call(key)
            .ok_or_else(|| malformed(format!("arguments for tool call {key}, never opened")))?;
        self.calls[index].1 |= !args.is_empty();
        out.tool_calls = Some(json!([{"index": index, "function": {"arguments": args}}]));
        Ok(())
    }
}

/// Everything a chunk says, back to nothing (id and model are kept, as the chat reader keeps
/// them from chunk to chunk).
fn reset(out: &mut UpstreamChunk) {
    out.role = false;
    out.content.clear();
    out.reasoning.clear();
    out.tool_calls = None;
    out.tokens.clear();
    out.finish_reason = None;
    out.usage = None;
    out.choice_index = 0;
    out.extra_choices = false;
}

/// A text field of an event; a delta without its text is malformed.
fn text<'v>(v: &'v Value, field: &str) -> Result<&'v str, ChunkError> {
    v[field]
        .as_str()
        .ok_or_else(|| malformed(format!("{} without a string {field}", v["type"])))
}

/// How a call is named: the item's id, else its place in the output.
fn item_key(id: Option<&str>, index: &Value) -> String {
    match id {
        Some(id) => id.to_owned(),
        None => format!("#{index}"),
    }
}

fn set_str(dst: &mut Option<String>, v: &Value, max: usize) {
    if let Some(s) = v.as_str() {
        *dst = Some(crate::wire::truncate_chars(s, max));
    }
}

/// A usage object (absent or null: none); `prompt` stands in for a missing input count.
fn usage(v: &Value, input: &str, output: &str, prompt: u64) -> Result<Option<Usage>, ChunkError> {
    if v.is_null() {
        return Ok(None);
    }
    let count = |f: &str, default: Option<u64>| match &v[f] {
        Value::Null => default.ok_or_else(|| malformed(format!("usage without {f}"))),
        n => n
            .as_u64()
            .ok_or_else(|| malformed(format!("usage.{f} is not a count"))),
    };
    Ok(Some(Usage {
        prompt_tokens: count(input, Some(prompt))?,
        completion_tokens: count(output, None)?,
    }))
}

/// An `error` event's object: `{"type": "error", "error": {...}}` (Anthropic) or the error's
/// fields at the top (OpenAI's `{"type": "error", "code", "message"}`).
fn error_object(v: &Value) -> super::UpstreamError {
    let obj = v.as_object().cloned().unwrap_or_default();
    let mut obj = obj;
    if obj.get("error").is_none() {
        // The top-level `type` is the event's, not the error's kind.
        obj.remove("type");
    }
    error_from_object(&obj)
}

#[cfg(test)]
mod tests;
