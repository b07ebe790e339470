//! `POST /v1/messages`: Anthropic's Messages API in the shapes vLLM writes it
//! (vllm/entrypoints/anthropic/serving.py, `message_stream_converter`, which turns its chat
//! completion stream into Messages events; api_router.py for the errors). See the crate docs
//! for the event sequence.

use serde_json::{json, Map, Value};

use super::{
    call_args,
    native::{Events, Shape, Whole},
    Kind, Plan, Tok,
};

/// The text a directive is looked for in: the last message's `content`, a string or its
/// `text` blocks and `tool_result` blocks' content (a string or `text` blocks) joined, as
/// chat reads its last message, a tool message included.
pub(super) fn request_text(body: &Map<String, Value>) -> String {
    fn texts<'a>(blocks: &'a [Value], out: &mut Vec<&'a str>) {
        for b in blocks {
            match (b.get("type").and_then(Value::as_str), b.get("content")) {
                (Some("text"), _) => out.extend(b.get("text").and_then(Value::as_str)),
                (Some("tool_result"), Some(Value::String(s))) => out.push(s),
                (Some("tool_result"), Some(Value::Array(inner))) => texts(inner, out),
                _ => {}
            }
        }
    }
    let content = body
        .get("messages")
        .and_then(Value::as_array)
        .and_then(|m| m.last())
        .and_then(|m| m.get("content"));
    match content {
        Some(Value::String(s)) => s.clone(),
        Some(Value::Array(blocks)) => {
            let mut out = Vec::new();
            texts(blocks, &mut out);
            out.join("\n")
        }
        _ => String::new(),
    }
}

/// Anthropic's error `type` for an HTTP status.
fn error_type(code: u16) -> &'static str {
    match code {
        400 => "invalid_request_error",
        401 => "authentication_error",
        403 => "permission_error",
        404 => "not_found_error",
        413 => "request_too_large",
        429 => "rate_limit_error",
        503 | 529 => "overloaded_error",
        c if c < 500 => "invalid_request_error",
        _ => "api_error",
    }
}

/// Anthropic's error body, `{"type":"error","error":{"type":..,"message":..}}`.
pub(super) fn error_json(code: u16, msg: &str) -> String {
    typed(
        "error",
        &json!({"error": {"type": error_type(code), "message": msg}}),
    )
}

/// `body` as JSON with `"type": kind` first, as Anthropic's API and vLLM write it.
fn typed(kind: &str, body: &Value) -> String {
    let rest = body.to_string();
    let rest = rest.strip_prefix('{').unwrap_or(&rest);
    let sep = if rest == "}" { "" } else { "," };
    format!("{{\"type\":{}{sep}{rest}", Value::from(kind))
}

/// The message's `stop_reason` for the script's finish (vLLM maps only these three; any other
/// finish is null).
fn stop_reason(p: &Plan) -> Value {
    match p.finish_reason() {
        "stop" => "end_turn".into(),
        "length" => "max_tokens".into(),
        "tool_calls" => "tool_use".into(),
        _ => Value::Null,
    }
}

/// The content block open in the stream.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Open {
    None,
    Thinking,
    Text,
    Tool(usize),
}

/// A streamed Message's events.
#[derive(Debug)]
pub(super) struct Stream<'p> {
    p: &'p Plan,
    /// The open (or next) content block's index.
    index: usize,
    open: Open,
}

impl<'p> Stream<'p> {
    pub(super) fn new(p: &'p Plan) -> Self {
        Self {
            p,
            index: 0,
            open: Open::None,
        }
    }

    fn emit(ev: &mut Events, kind: &str, body: &Value) {
        ev.push(format!("event: {kind}\ndata: {}\n\n", typed(kind, body)));
    }

    /// Opens `want` unless it is open already, closing whatever else was.
    fn open(&mut self, ev: &mut Events, want: Open) {
        if self.open == want {
            return;
        }
        self.close(ev);
        self.open = want;
        let block = match want {
            Open::None => return,
            Open::Thinking => json!({"type": "thinking", "thinking": ""}),
            Open::Text => json!({"type": "text", "text": ""}),
            Open::Tool(call) => json!({"type": "tool_use", "id": tool_id(self.p, call),
                                       "name": self.p.script.fn_name, "input": {}}),
        };
        Self::emit(
            ev,
            "content_block_start",
            &json!({"index": self.index, "content_block": block}),
        );
    }

    /// Ends the open block (a thinking block gets its signature first, as vLLM sends it).
    fn close(&mut self, ev: &mut Events) {
        match self.open {
            Open::None => return,
            Open::Thinking => {
                let delta = json!({"type": "signature_delta",
                                   "signature": signature(self.p, self.index)});
                Self::emit(
                    ev,
                    "content_block_delta",
                    &json!({"index": self.index, "delta": delta}),
                );
            }
            Open::Text | Open::Tool(_) => {}
        }
        Self::emit(ev, "content_block_stop", &json!({"index": self.index}));
        self.index += 1;
        self.open = Open::None;
    }

    fn delta(&self, ev: &mut Events, delta: &Value) {
        Self::emit(
            ev,
            "content_block_delta",
            &json!({"index": self.index, "delta": delta}),
        );
    }
}

impl Shape for Stream<'_> {
    fn start(&mut self, ev: &mut Events) {
        let message = json!({"id": self.p.id, "type": "message", "role": "assistant",
                             "content": [], "model": self.p.model, "stop_reason": null,
                             "stop_sequence": null,
                             "usage": {"input_tokens": self.p.prompt_tokens,
                                       "output_tokens": 0}});
        Self::emit(ev, "message_start", &json!({"message": message}));
        if self.p.script.ping {
            Self::emit(ev, "ping", &json!({}));
        }
    }

    fn tokens(&mut self, ev: &mut Events, reasoning: bool, texts: &str, _toks: &[Tok]) {
        if reasoning {
            self.open(ev, Open::Thinking);
            self.delta(ev, &json!({"type": "thinking_delta", "thinking": texts}));
        } else {
            self.open(ev, Open::Text);
            self.delta(ev, &json!({"type": "text_delta", "text": texts}));
        }
    }

    fn call_start(&mut self, ev: &mut Events, call: usize) {
        self.open(ev, Open::Tool(call));
    }

    fn call_args(&mut self, ev: &mut Events, piece: &str) {
        self.delta(
            ev,
            &json!({"type": "input_json_delta", "partial_json": piece}),
        );
    }

    fn finish(&mut self, ev: &mut Events, output_tokens: usize) {
        self.close(ev);
        let delta = json!({"stop_reason": stop_reason(self.p), "stop_sequence": null});
        let usage = json!({"input_tokens": self.p.prompt_tokens, "output_tokens": output_tokens});
        Self::emit(
            ev,
            "message_delta",
            &json!({"delta": delta, "usage": usage}),
        );
        Self::emit(ev, "message_stop", &json!({}));
    }

    fn error(&mut self, ev: &mut Events, _output_tokens: usize) {
        let error = json!({"type": error_type(self.p.script.code),
                           "message": self.p.error_message()});
        Self::emit(ev, "error", &json!({"error": error}));
    }
}

/// The batch answer: one Message object with the turn's content blocks.
pub(super) fn batch_body(p: &Plan, output_tokens: usize) -> String {
    let s = &p.script;
    let whole = Whole::of(p);
    let mut content = Vec::new();
    if !whole.reasoning.is_empty() {
        content.push(json!({"type": "thinking", "thinking": whole.reasoning,
                            "signature": signature(p, content.len())}));
    }
    if !whole.answer.is_empty() {
        content.push(json!({"type": "text", "text": whole.answer}));
    }
    if s.kind == Kind::ToolCall {
        for (call, args) in call_args(s) {
            // Arguments that are not JSON (a test's broken `args=`) stay a string.
            let input = serde_json::from_str(args).unwrap_or_else(|_| Value::from(args));
            content.push(json!({"type": "tool_use", "id": tool_id(p, call),
                                "name": s.fn_name, "input": input}));
        }
    }
    let message = json!({"id": p.id, "role": "assistant", "content": content,
                         "model": p.model, "stop_reason": stop_reason(p),
                         "stop_sequence": null,
                         "usage": {"input_tokens": p.prompt_tokens,
                                   "output_tokens": output_tokens}});
    typed("message", &message)
}

/// Tool call `call`'s id: chat's tool call id for the same request, as vLLM passes it on.
fn tool_id(p: &Plan, call: usize) -> String {
    format!("call_{}_{call}", p.seq)
}

/// Thinking block `index`'s signature (vLLM's is a random hex string).
fn signature(p: &Plan, index: usize) -> String {
    format!("sig_{}_{index}", p.seq)
}
