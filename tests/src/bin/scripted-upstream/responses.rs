//! `POST /v1/responses`: OpenAI's Responses API in the shapes vLLM's simple (non-harmony) path
//! writes them (vllm/entrypoints/openai/responses/streaming_events.py, its
//! `SimpleStreamingEventProcessor`, and serving.py's `responses_stream_generator`). See the
//! crate docs for the event sequence.

use serde_json::{json, Map, Value};

use super::{
    native::{Events, Shape, Whole},
    write_logprobs, Lp, Plan, Tok,
};

/// Whether a request asks for the answer's logprobs (vLLM's `is_include_output_logprobs`).
pub(super) fn wants_logprobs(body: &Map<String, Value>) -> bool {
    body.get("include")
        .and_then(Value::as_array)
        .is_some_and(|i| i.iter().any(|v| v == "message.output_text.logprobs"))
}

/// The text a directive is looked for in: `input` as a string, or its last item (trailing
/// system and developer messages without a directive skipped, as chat skips a proxy's note):
/// a message's `content` (a string, or its `input_text` / `output_text` parts joined), a
/// `function_call_output`'s `output` (as chat reads a tool message's content).
pub(super) fn request_text(body: &Map<String, Value>) -> String {
    let items = match body.get("input") {
        Some(Value::String(s)) => return s.clone(),
        Some(Value::Array(items)) => items,
        _ => return String::new(),
    };
    let note = |i: &&Value| {
        matches!(
            i.get("role").and_then(Value::as_str),
            Some("system" | "developer")
        ) && !i.to_string().contains("[[script:")
    };
    let Some(item) = items.iter().rev().find(|i| !note(i)).or(items.last()) else {
        return String::new();
    };
    let content = if item.get("type").and_then(Value::as_str) == Some("function_call_output") {
        item.get("output")
    } else {
        item.get("content")
    };
    match content {
        Some(Value::String(s)) => s.clone(),
        Some(Value::Array(parts)) => parts
            .iter()
            .filter(|p| {
                matches!(
                    p.get("type").and_then(Value::as_str),
                    Some("input_text" | "output_text" | "text")
                )
            })
            .filter_map(|p| p.get("text").and_then(Value::as_str))
            .collect::<Vec<_>>()
            .join("\n"),
        _ => String::new(),
    }
}

/// The item open in the stream.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Open {
    None,
    Reasoning,
    Text,
    Call(usize),
}

/// A streamed Response's events.
#[derive(Debug)]
pub(super) struct Stream<'p> {
    p: &'p Plan,
    /// The next event's `sequence_number`.
    seq: u64,
    open: Open,
    /// The items done so far; the open item's `output_index` is their count.
    output: Vec<Value>,
    /// The open item's text so far (answer, reasoning or arguments).
    text: String,
    /// The answer's logprob entries so far.
    logprobs: Vec<Value>,
    reasoning_tokens: usize,
}

impl<'p> Stream<'p> {
    pub(super) fn new(p: &'p Plan) -> Self {
        Self {
            p,
            seq: 0,
            open: Open::None,
            output: Vec::new(),
            text: String::new(),
            logprobs: Vec::new(),
            reasoning_tokens: 0,
        }
    }

    fn emit(&mut self, ev: &mut Events, kind: &str, mut body: Value) {
        body["type"] = kind.into();
        body["sequence_number"] = self.seq.into();
        self.seq += 1;
        ev.push(format!("event: {kind}\ndata: {body}\n\n"));
    }

    fn index(&self) -> usize {
        self.output.len()
    }

    fn item_id(&self) -> String {
        item_id(self.p, self.index())
    }

    /// Opens `want` unless it is open already, closing whatever else was.
    fn open(&mut self, ev: &mut Events, want: Open) {
        if self.open == want {
            return;
        }
        self.close(ev);
        self.open = want;
        let (id, index) = (self.item_id(), self.index());
        match want {
            Open::None => {}
            Open::Reasoning => {
                let item = json!({"id": id, "type": "reasoning", "summary": [],
                                  "status": "in_progress"});
                self.emit(
                    ev,
                    "response.output_item.added",
                    json!({"output_index": index, "item": item}),
                );
                self.emit(
                    ev,
                    "response.reasoning_part.added",
                    json!({"output_index": index, "item_id": id, "content_index": 0,
                                 "part": {"type": "reasoning_text", "text": ""}}),
                );
            }
            Open::Text => {
                let item = json!({"id": id, "type": "message", "role": "assistant",
                                  "content": [], "status": "in_progress"});
                self.emit(
                    ev,
                    "response.output_item.added",
                    json!({"output_index": index, "item": item}),
                );
                self.emit(
                    ev,
                    "response.content_part.added",
                    json!({"output_index": index, "item_id": id, "content_index": 0,
                                 "part": {"type": "output_text", "text": "", "annotations": [],
                                          "logprobs": []}}),
                );
            }
            Open::Call(call) => {
                let item = json!({"id": id, "type": "function_call",
                                  "call_id": call_id(self.p, call),
                                  "name": self.p.script.fn_name, "arguments": "",
                                  "status": "in_progress"});
                self.emit(
                    ev,
                    "response.output_item.added",
                    json!({"output_index": index, "item": item}),
                );
            }
        }
    }

    /// The open item's done events; the item joins `output`.
    fn close(&mut self, ev: &mut Events) {
        let (id, index) = (self.item_id(), self.index());
        let text = std::mem::take(&mut self.text);
        let item = match self.open {
            Open::None => return,
            Open::Reasoning => {
                self.emit(
                    ev,
                    "response.reasoning_text.done",
                    json!({"output_index": index, "item_id": id, "content_index": 0,
                                 "text": text}),
                );
                self.emit(
                    ev,
                    "response.reasoning_part.done",
                    json!({"output_index": index, "item_id": id, "content_index": 0,
                                 "part": {"type": "reasoning_text", "text": text}}),
                );
                reasoning_item(&id, &text)
            }
            Open::Text => {
                let logprobs = match self.p.lp {
                    Lp::Responses { .. } => Value::Array(std::mem::take(&mut self.logprobs)),
                    _ => Value::Null,
                };
                self.emit(
                    ev,
                    "response.output_text.done",
                    json!({"output_index": index, "item_id": id, "content_index": 0,
                                 "text": text, "logprobs": []}),
                );
                self.emit(
                    ev,
                    "response.content_part.done",
                    json!({"output_index": index, "item_id": id, "content_index": 0,
                                 "part": {"type": "output_text", "text": text,
                                          "annotations": []}}),
                );
                message_item(&id, &text, logprobs)
            }
            Open::Call(call) => {
                self.emit(
                    ev,
                    "response.function_call_arguments.done",
                    json!({"output_index": index, "item_id": id, "arguments": text,
                                 "name": self.p.script.fn_name}),
                );
                call_item(self.p, &id, call, &text)
            }
        };
        self.emit(
            ev,
            "response.output_item.done",
            json!({"output_index": index, "item": item}),
        );
        self.output.push(item);
        self.open = Open::None;
    }
}

impl Shape for Stream<'_> {
    fn start(&mut self, ev: &mut Events) {
        let initial = response(self.p, "in_progress", Value::Null, Vec::new(), Value::Null);
        self.emit(ev, "response.created", json!({"response": initial}));
        self.emit(ev, "response.in_progress", json!({"response": initial}));
    }

    fn tokens(&mut self, ev: &mut Events, reasoning: bool, texts: &str, toks: &[Tok]) {
        if reasoning {
            self.open(ev, Open::Reasoning);
            let (id, index) = (self.item_id(), self.index());
            self.reasoning_tokens += toks.len();
            self.text.push_str(texts);
            self.emit(
                ev,
                "response.reasoning_text.delta",
                json!({"output_index": index, "item_id": id, "content_index": 0,
                             "delta": texts}),
            );
            return;
        }
        // Opening the answer closes the reasoning: the answer is the next item.
        self.open(ev, Open::Text);
        let (id, index) = (self.item_id(), self.index());
        let entries = logprob_entries(self.p, texts, toks);
        self.logprobs.extend(entries.iter().cloned());
        self.text.push_str(texts);
        self.emit(
            ev,
            "response.output_text.delta",
            json!({"output_index": index, "item_id": id, "content_index": 0,
                         "delta": texts, "logprobs": entries}),
        );
    }

    fn call_start(&mut self, ev: &mut Events, call: usize) {
        self.open(ev, Open::Call(call));
    }

    fn call_args(&mut self, ev: &mut Events, piece: &str) {
        let (id, index) = (self.item_id(), self.index());
        self.text.push_str(piece);
        self.emit(
            ev,
            "response.function_call_arguments.delta",
            json!({"output_index": index, "item_id": id, "delta": piece}),
        );
    }

    fn finish(&mut self, ev: &mut Events, output_tokens: usize) {
        self.close(ev);
        let (status, details) = status(self.p);
        let usage = usage(self.p, output_tokens, self.reasoning_tokens);
        let done = response(
            self.p,
            status,
            details,
            std::mem::take(&mut self.output),
            usage,
        );
        // vLLM ends an incomplete response with `response.completed` too.
        self.emit(ev, "response.completed", json!({"response": done}));
    }

    fn error(&mut self, ev: &mut Events, output_tokens: usize) {
        let code = self.p.script.code.to_string();
        let message = self.p.error_message();
        if self.p.script.failed {
            let usage = usage(self.p, output_tokens, self.reasoning_tokens);
            let mut failed = response(
                self.p,
                "failed",
                Value::Null,
                std::mem::take(&mut self.output),
                usage,
            );
            failed["error"] = json!({"code": code, "message": message});
            self.emit(ev, "response.failed", json!({"response": failed}));
        } else {
            self.emit(
                ev,
                "error",
                json!({"code": code, "message": message, "param": null}),
            );
        }
    }
}

/// The batch answer: one Response object with the turn's items.
pub(super) fn batch_body(p: &Plan, output_tokens: usize) -> String {
    let s = &p.script;
    let whole = Whole::of(p);
    let mut output = Vec::new();
    if !whole.reasoning.is_empty() {
        output.push(reasoning_item(&item_id(p, output.len()), &whole.reasoning));
    }
    if !whole.answer.is_empty() {
        let logprobs = match p.lp {
            Lp::Responses { .. } => {
                Value::Array(logprob_entries(p, &whole.answer, &whole.answer_toks))
            }
            _ => Value::Null,
        };
        output.push(message_item(
            &item_id(p, output.len()),
            &whole.answer,
            logprobs,
        ));
    }
    if s.kind == super::Kind::ToolCall {
        for (call, args) in super::call_args(s) {
            output.push(call_item(p, &item_id(p, output.len()), call, args));
        }
    }
    let (status, details) = status(p);
    let usage = usage(p, output_tokens, s.reasoning.min(s.tokens));
    response(p, status, details, output, usage).to_string()
}

/// Output item `index`'s id (vLLM's are random; these say which request and item they are).
fn item_id(p: &Plan, index: usize) -> String {
    format!("item_{}_{index}", p.seq)
}

/// Tool call `call`'s `call_id`: chat's tool call id for the same request.
fn call_id(p: &Plan, call: usize) -> String {
    format!("call_{}_{call}", p.seq)
}

fn reasoning_item(id: &str, text: &str) -> Value {
    json!({"id": id, "type": "reasoning", "summary": [],
           "content": [{"type": "reasoning_text", "text": text}], "status": "completed"})
}

fn message_item(id: &str, text: &str, logprobs: Value) -> Value {
    json!({"id": id, "type": "message", "role": "assistant", "status": "completed",
           "content": [{"type": "output_text", "text": text, "annotations": [],
                        "logprobs": logprobs}]})
}

fn call_item(p: &Plan, id: &str, call: usize, arguments: &str) -> Value {
    json!({"id": id, "type": "function_call", "call_id": call_id(p, call),
           "name": p.script.fn_name, "arguments": arguments, "status": "completed"})
}

/// The logprob entries of `toks` (`[]` unless the request asked for them).
fn logprob_entries(p: &Plan, texts: &str, toks: &[Tok]) -> Vec<Value> {
    if !matches!(p.lp, Lp::Responses { .. }) {
        return Vec::new();
    }
    let mut s = String::new();
    write_logprobs(&mut s, p, texts, toks, 0);
    // Written by chat's own entry writer: always a JSON array.
    match serde_json::from_str(&s) {
        Ok(Value::Array(a)) => a,
        _ => Vec::new(),
    }
}

/// The Response's `status` and `incomplete_details` for the script's finish.
fn status(p: &Plan) -> (&'static str, Value) {
    match p.finish_reason() {
        "length" => ("incomplete", json!({"reason": "max_output_tokens"})),
        "content_filter" => ("incomplete", json!({"reason": "content_filter"})),
        _ => ("completed", Value::Null),
    }
}

fn usage(p: &Plan, output_tokens: usize, reasoning_tokens: usize) -> Value {
    json!({"input_tokens": p.prompt_tokens, "input_tokens_details": {"cached_tokens": 0},
           "output_tokens": output_tokens,
           "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
           "total_tokens": p.prompt_tokens + output_tokens})
}

/// A Response object (`usage` null while in progress).
fn response(p: &Plan, status: &str, details: Value, output: Vec<Value>, usage: Value) -> Value {
    json!({"id": p.id, "object": "response", "created_at": p.created, "model": p.model,
           "status": status, "incomplete_details": details, "error": null,
           "output": output, "usage": usage, "instructions": null, "metadata": {},
           "parallel_tool_calls": true, "tool_choice": "auto", "tools": [],
           "temperature": 1.0, "top_p": 1.0, "max_output_tokens": null,
           "previous_response_id": null, "reasoning": null, "store": false,
           "text": {"format": {"type": "text"}}, "truncation": "disabled",
           "background": false})
}
