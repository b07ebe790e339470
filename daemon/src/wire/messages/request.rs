//! A Messages API request body, translated into the chat-completions body haltd governs
//! (docs/wire-format.md, "Messages API requests").
//!
//! The translation fails closed. A field or content block haltd cannot honour is refused with
//! a 400 whose message starts with its path (`messages[2].content[0].type: ...`); only what
//! cannot change the generation is accepted and left out: prompt-cache markers (caching is the
//! backend's own), citations attached to earlier text, earlier thinking, and the thinking
//! configuration. [`FIELDS`] says what becomes of each top-level field. Content blocks:
//!
//! | block | in | chat |
//! |---|---|---|
//! | `text` | both | text; a message of text blocks only has their texts, concatenated, as its `content` string |
//! | `image` | user | an `image_url` part (a `data:` URL for base64 data); the message's `content` becomes an array of parts |
//! | `tool_use` | assistant | an entry of the message's `tool_calls`, `input` serialised as `arguments` |
//! | `tool_result` | user | a `tool` message, placed before the rest of the user message; `is_error: true` prefixes its text with `Error: ` |
//! | `thinking`, `redacted_thinking` | assistant | left out: the backend's chat template takes no earlier thinking |
//!
//! Any other block type is refused. A final assistant message is a prefill, which the
//! generation continues: the body says so to vLLM (`continue_final_message: true`,
//! `add_generation_prompt: false`); llama.cpp's server continues a final assistant message by
//! itself. As in the chat API, `null` counts as absent.

use serde_json::{json, Value};

use crate::wire::{
    chat_content::{content, Part},
    endpoint::MAX_MAX_TOKENS,
    fields::{
        as_object, as_str, bad, check_fields, field, join, only, opt_bool, opt_str, quote,
        required, required_str, within_nesting, FieldRule, Object,
    },
    http::HttpError,
};
use FieldRule::{Accepted, Refused, Translated};

#[cfg(test)]
mod tests;

/// The image media types the Messages API takes, and so the `data:` URLs haltd writes.
const IMAGE_TYPES: [&str; 4] = ["image/jpeg", "image/png", "image/gif", "image/webp"];

/// Every top-level request field of the Messages API and what haltd does with it, in the
/// order of the table in docs/wire-format.md. A field not listed is refused as unknown.
pub const FIELDS: &[(&str, FieldRule)] = &[
    ("model", Translated("`model`")),
    ("max_tokens", Translated("`max_tokens` (1 to 1000000)")),
    ("messages", Translated("`messages`, block by block")),
    (
        "system",
        Translated("a first `system` message, text blocks joined with a newline"),
    ),
    (
        "stream",
        Translated("`stream`; `true` adds `stream_options.include_usage: true`"),
    ),
    ("stop_sequences", Translated("`stop`")),
    ("temperature", Translated("`temperature`")),
    ("top_p", Translated("`top_p`")),
    (
        "top_k",
        Translated("`top_k` (a vLLM and llama.cpp extension)"),
    ),
    ("tools", Translated("`tools` of type `function`")),
    (
        "tool_choice",
        Translated("`tool_choice`, and `parallel_tool_calls: false`"),
    ),
    ("metadata", Translated("`user`, from `user_id`")),
    (
        "thinking",
        Accepted(
            "the backend's reasoning streams as thinking blocks whatever this says; \
             `budget_tokens` is not enforced",
        ),
    ),
    (
        "cache_control",
        Accepted("prompt caching is the backend's own"),
    ),
    (
        "service_tier",
        Refused("haltd has no capacity tiers to choose from"),
    ),
    (
        "container",
        Refused("containers belong to Anthropic's code execution tool"),
    ),
    (
        "mcp_servers",
        Refused("haltd calls no MCP server; tools run on the client"),
    ),
    (
        "context_management",
        Refused("haltd does not edit the conversation it is sent"),
    ),
    (
        "inference_geo",
        Refused("the backend runs where it is deployed"),
    ),
    (
        "output_config",
        Refused("effort and structured output have no chat translation here"),
    ),
    (
        "output_format",
        Refused("structured output has no chat translation here"),
    ),
];

/// Translates a Messages API request body into the chat-completions body haltd governs.
///
/// Errors are 400s whose message starts with the path of the field at fault
/// (`max_tokens: required`, `tools[1].type: ...`).
pub fn to_chat(body: &Value) -> Result<Value, HttpError> {
    let req = body
        .as_object()
        .ok_or_else(|| HttpError::bad_request("request body must be a JSON object"))?;
    check_fields(req, FIELDS)?;
    let mut chat = Object::new();
    chat.insert("model".into(), model(req)?.into());
    chat.insert("max_tokens".into(), max_tokens(req)?.into());
    let mut messages = Vec::new();
    if let Some(s) = field(req, "system") {
        messages.push(json!({"role": "system", "content": system(s)?}));
    }
    let prefill = push_messages(req, &mut messages)?;
    chat.insert("messages".into(), Value::Array(messages));
    if prefill {
        chat.insert("continue_final_message".into(), true.into());
        chat.insert("add_generation_prompt".into(), false.into());
    }
    sampling(req, &mut chat)?;
    if let Some(v) = field(req, "metadata") {
        metadata(v, &mut chat)?;
    }
    if let Some(v) = field(req, "tools") {
        chat.insert("tools".into(), tools(v)?);
    }
    if let Some(v) = field(req, "tool_choice") {
        tool_choice(v, &mut chat)?;
    }
    if let Some(v) = field(req, "thinking") {
        check_thinking(v)?;
    }
    cache_control(req, "")?;
    within_nesting(Value::Object(chat))
}

/// `cache_control` of `obj`, accepted and left out: an object when present.
fn cache_control(obj: &Object, path: &str) -> Result<(), HttpError> {
    match field(obj, "cache_control") {
        Some(v) => as_object(v, &join(path, "cache_control")).map(drop),
        None => Ok(()),
    }
}

fn model(req: &Object) -> Result<&str, HttpError> {
    match required_str(req, "model", "")? {
        "" => Err(bad("model", "must not be empty")),
        m => Ok(m),
    }
}

fn max_tokens(req: &Object) -> Result<u64, HttpError> {
    match required(req, "max_tokens", "")?.as_u64() {
        Some(n) if (1..=u64::from(MAX_MAX_TOKENS)).contains(&n) => Ok(n),
        _ => Err(bad(
            "max_tokens",
            format!("must be an integer from 1 to {MAX_MAX_TOKENS}"),
        )),
    }
}

/// `system`: a string, or text blocks joined with a newline.
fn system(v: &Value) -> Result<String, HttpError> {
    match v {
        Value::String(s) => Ok(s.clone()),
        Value::Array(blocks) => blocks
            .iter()
            .enumerate()
            .map(|(k, b)| text_only(b, &format!("system[{k}]")))
            .collect::<Result<Vec<_>, _>>()
            .map(|texts| texts.join("\n")),
        _ => Err(bad("system", "must be a string or an array of text blocks")),
    }
}

/// A block that must be a `text` block (in `system` and in tool results): its text.
fn text_only<'a>(v: &'a Value, path: &str) -> Result<&'a str, HttpError> {
    let b = as_object(v, path)?;
    match required_str(b, "type", path)? {
        "text" => text_block(b, path),
        other => Err(bad(
            &join(path, "type"),
            format!("must be \"text\", not {}", quote(other)),
        )),
    }
}

/// A `text` block's text; its `cache_control` and `citations` are left out.
fn text_block<'a>(b: &'a Object, path: &str) -> Result<&'a str, HttpError> {
    only(b, path, &["type", "text", "cache_control", "citations"])?;
    cache_control(b, path)?;
    if field(b, "citations").is_some_and(|c| !c.is_array()) {
        return Err(bad(&join(path, "citations"), "must be an array"));
    }
    required_str(b, "text", path)
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Role {
    User,
    Assistant,
}

/// A message's content blocks, sorted into where chat takes them.
#[derive(Default)]
struct Blocks {
    parts: Vec<Part>,
    tool_calls: Vec<Value>,
    /// `tool` messages.
    tool_results: Vec<Value>,
}

/// Translates `messages` onto `out`; says whether the last one is the assistant's (a prefill).
fn push_messages(req: &Object, out: &mut Vec<Value>) -> Result<bool, HttpError> {
    let list = match required(req, "messages", "")? {
        Value::Array(l) if l.is_empty() => return Err(bad("messages", "must not be empty")),
        Value::Array(l) => l,
        _ => return Err(bad("messages", "must be an array of messages")),
    };
    let mut role = Role::User;
    for (i, m) in list.iter().enumerate() {
        let path = format!("messages[{i}]");
        let m = as_object(m, &path)?;
        only(m, &path, &["role", "content"])?;
        role = match required_str(m, "role", &path)? {
            "user" => Role::User,
            "assistant" => Role::Assistant,
            other => {
                return Err(bad(
                    &join(&path, "role"),
                    format!("must be \"user\" or \"assistant\", not {}", quote(other)),
                ))
            }
        };
        let mut blocks = Blocks::default();
        match required(m, "content", &path)? {
            Value::String(s) => blocks.parts.push(Part::Text(s.clone())),
            Value::Array(list) => {
                for (j, b) in list.iter().enumerate() {
                    blocks.add(b, &format!("{path}.content[{j}]"), role)?;
                }
            }
            _ => {
                return Err(bad(
                    &join(&path, "content"),
                    "must be a string or an array of content blocks",
                ))
            }
        }
        blocks.push_to(role, out);
    }
    Ok(role == Role::Assistant)
}

impl Blocks {
    /// Sorts in the content block `v` of a `role` message, at `path`.
    fn add(&mut self, v: &Value, path: &str, role: Role) -> Result<(), HttpError> {
        let b = as_object(v, path)?;
        let kind = required_str(b, "type", path)?;
        let only_in = |whose: &str| {
            bad(
                &join(path, "type"),
                format!(
                    "{} blocks are only accepted in {whose} messages",
                    quote(kind)
                ),
            )
        };
        match (kind, role) {
            ("text", _) => self.parts.push(Part::Text(text_block(b, path)?.to_owned())),
            ("image", Role::User) => self
                .parts
                .push(Part::Image(json!({"url": image_url(b, path)?}))),
            ("tool_result", Role::User) => self.tool_results.push(tool_message(b, path)?),
            ("tool_use", Role::Assistant) => self.tool_calls.push(tool_call(b, path)?),
            // The backend's chat template takes no earlier thinking.
            ("thinking" | "redacted_thinking", Role::Assistant) => {}
            ("image" | "tool_result", Role::Assistant) => return Err(only_in("user")),
            ("tool_use" | "thinking" | "redacted_thinking", Role::User) => {
                return Err(only_in("assistant"))
            }
            _ => {
                return Err(bad(
                    &join(path, "type"),
                    format!("{} blocks are not supported", quote(kind)),
                ))
            }
        }
        Ok(())
    }

    /// The chat messages of one Messages message: its tool results first (chat wants them
    /// right after the assistant's calls), then the rest, unless tool results were all.
    fn push_to(self, role: Role, out: &mut Vec<Value>) {
        let results_only = !self.tool_results.is_empty() && self.parts.is_empty();
        out.extend(self.tool_results);
        match role {
            Role::User if results_only => {}
            Role::User => out.push(json!({"role": "user", "content": content(self.parts)})),
            Role::Assistant => {
                let mut m = json!({"role": "assistant", "content": content(self.parts)});
                if !self.tool_calls.is_empty() {
                    m["tool_calls"] = Value::Array(self.tool_calls);
                }
                out.push(m);
            }
        }
    }
}

/// An `image` block's URL: the `url` source's, or a `data:` URL of base64 data.
fn image_url(b: &Object, path: &str) -> Result<String, HttpError> {
    only(b, path, &["type", "source", "cache_control"])?;
    cache_control(b, path)?;
    let source = required(b, "source", path)?;
    let path = join(path, "source");
    let source = as_object(source, &path)?;
    match required_str(source, "type", &path)? {
        "base64" => {
            only(source, &path, &["type", "media_type", "data"])?;
            let media_type = required_str(source, "media_type", &path)?;
            if !IMAGE_TYPES.contains(&media_type) {
                return Err(bad(
                    &join(&path, "media_type"),
                    format!("must be one of {}", IMAGE_TYPES.join(", ")),
                ));
            }
            let data = required_str(source, "data", &path)?;
            Ok(format!("data:{media_type};base64,{data}"))
        }
        "url" => {
            only(source, &path, &["type", "url"])?;
            Ok(required_str(source, "url", &path)?.to_owned())
        }
        other => Err(bad(
            &join(&path, "type"),
            format!("{} image sources are not supported", quote(other)),
        )),
    }
}

/// A `tool_use` block as a chat tool call, `input` serialised as the `arguments` string.
fn tool_call(b: &Object, path: &str) -> Result<Value, HttpError> {
    only(b, path, &["type", "id", "name", "input", "cache_control"])?;
    cache_control(b, path)?;
    let id = required_str(b, "id", path)?;
    let name = required_str(b, "name", path)?;
    let input = required(b, "input", path)?;
    as_object(input, &join(path, "input"))?;
    Ok(json!({
        "id": id,
        "type": "function",
        "function": {"name": name, "arguments": input.to_string()},
    }))
}

/// A `tool_result` block as a chat `tool` message: its text blocks concatenated, after
/// `Error: ` when `is_error` is true.
fn tool_message(b: &Object, path: &str) -> Result<Value, HttpError> {
    only(
        b,
        path,
        &[
            "type",
            "tool_use_id",
            "content",
            "is_error",
            "cache_control",
        ],
    )?;
    cache_control(b, path)?;
    let id = required_str(b, "tool_use_id", path)?;
    let content_path = join(path, "content");
    let mut text = match field(b, "content") {
        None => String::new(),
        Some(Value::String(s)) => s.clone(),
        Some(Value::Array(blocks)) => blocks
            .iter()
            .enumerate()
            .map(|(k, v)| text_only(v, &format!("{content_path}[{k}]")))
            .collect::<Result<String, _>>()?,
        Some(_) => {
            return Err(bad(
                &content_path,
                "must be a string or an array of text blocks",
            ))
        }
    };
    if opt_bool(b, "is_error", path)? == Some(true) {
        text.insert_str(0, "Error: ");
    }
    Ok(json!({"role": "tool", "tool_call_id": id, "content": text}))
}

/// `stream`, `stop_sequences`, `temperature`, `top_p` and `top_k`.
fn sampling(req: &Object, chat: &mut Object) -> Result<(), HttpError> {
    if let Some(stream) = opt_bool(req, "stream", "")? {
        chat.insert("stream".into(), stream.into());
        if stream {
            chat.insert("stream_options".into(), json!({"include_usage": true}));
        }
    }
    if let Some(v) = field(req, "stop_sequences") {
        let list = v
            .as_array()
            .ok_or_else(|| bad("stop_sequences", "must be an array of strings"))?;
        for (k, s) in list.iter().enumerate() {
            as_str(s, &format!("stop_sequences[{k}]"))?;
        }
        chat.insert("stop".into(), v.clone());
    }
    for name in ["temperature", "top_p"] {
        if let Some(v) = field(req, name) {
            if !v.is_number() {
                return Err(bad(name, "must be a number"));
            }
            chat.insert(name.into(), v.clone());
        }
    }
    if let Some(v) = field(req, "top_k") {
        if v.as_u64().is_none() {
            return Err(bad("top_k", "must be a non-negative integer"));
        }
        chat.insert("top_k".into(), v.clone());
    }
    Ok(())
}

/// `metadata.user_id` as chat's `user`.
fn metadata(v: &Value, chat: &mut Object) -> Result<(), HttpError> {
    let m = as_object(v, "metadata")?;
    only(m, "metadata", &["user_id"])?;
    if let Some(user) = opt_str(m, "user_id", "metadata")? {
        chat.insert("user".into(), user.into());
    }
    Ok(())
}

/// `tools` as chat functions; a server tool (a `type` other than `custom`) is refused.
fn tools(v: &Value) -> Result<Value, HttpError> {
    let list = v
        .as_array()
        .ok_or_else(|| bad("tools", "must be an array of tools"))?;
    list.iter()
        .enumerate()
        .map(|(i, t)| tool(t, &format!("tools[{i}]")))
        .collect::<Result<Vec<_>, _>>()
        .map(Value::Array)
}

fn tool(v: &Value, path: &str) -> Result<Value, HttpError> {
    let t = as_object(v, path)?;
    match opt_str(t, "type", path)? {
        None | Some("custom") => {}
        Some(other) => {
            return Err(bad(
                &join(path, "type"),
                format!(
                    "{} is an Anthropic server tool; haltd serves client tools (\"custom\") only",
                    quote(other)
                ),
            ))
        }
    }
    only(
        t,
        path,
        &[
            "type",
            "name",
            "description",
            "input_schema",
            "cache_control",
        ],
    )?;
    cache_control(t, path)?;
    let name = required_str(t, "name", path)?;
    let schema = required(t, "input_schema", path)?;
    as_object(schema, &join(path, "input_schema"))?;
    let mut function = json!({"name": name, "parameters": schema});
    if let Some(d) = opt_str(t, "description", path)? {
        function["description"] = d.into();
    }
    Ok(json!({"type": "function", "function": function}))
}

/// `tool_choice`, and `disable_parallel_tool_use: true` as `parallel_tool_calls: false`.
fn tool_choice(v: &Value, chat: &mut Object) -> Result<(), HttpError> {
    const PATH: &str = "tool_choice";
    let c = as_object(v, PATH)?;
    let choice = match required_str(c, "type", PATH)? {
        "auto" => {
            only(c, PATH, &["type", "disable_parallel_tool_use"])?;
            json!("auto")
        }
        "any" => {
            only(c, PATH, &["type", "disable_parallel_tool_use"])?;
            json!("required")
        }
        "tool" => {
            only(c, PATH, &["type", "name", "disable_parallel_tool_use"])?;
            json!({"type": "function", "function": {"name": required_str(c, "name", PATH)?}})
        }
        "none" => {
            only(c, PATH, &["type"])?;
            json!("none")
        }
        other => {
            return Err(bad(
                "tool_choice.type",
                format!(
                    "must be \"auto\", \"any\", \"tool\" or \"none\", not {}",
                    quote(other)
                ),
            ))
        }
    };
    chat.insert("tool_choice".into(), choice);
    if opt_bool(c, "disable_parallel_tool_use", PATH)? == Some(true) {
        chat.insert("parallel_tool_calls".into(), false.into());
    }
    Ok(())
}

/// `thinking`: checked, not sent (the backend streams its reasoning whatever this says).
fn check_thinking(v: &Value) -> Result<(), HttpError> {
    const PATH: &str = "thinking";
    let t = as_object(v, PATH)?;
    match required_str(t, "type", PATH)? {
        "enabled" => {
            only(t, PATH, &["type", "budget_tokens", "display"])?;
            let budget = required(t, "budget_tokens", PATH)?;
            if budget.as_u64().is_none_or(|n| n == 0) {
                return Err(bad("thinking.budget_tokens", "must be a positive integer"));
            }
        }
        "adaptive" => only(t, PATH, &["type", "display"])?,
        "disabled" => only(t, PATH, &["type"])?,
        other => {
            return Err(bad(
                "thinking.type",
                format!(
                    "must be \"enabled\", \"adaptive\" or \"disabled\", not {}",
                    quote(other)
                ),
            ))
        }
    }
    match opt_str(t, "display", PATH)? {
        None | Some("summarized" | "omitted") => Ok(()),
        Some(_) => Err(bad(
            "thinking.display",
            "must be \"summarized\" or \"omitted\"",
        )),
    }
}
