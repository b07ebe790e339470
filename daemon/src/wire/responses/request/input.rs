//! The `input` of a Responses API request as chat messages, item by item:
//!
//! | item | chat |
//! |---|---|
//! | a string (the whole `input`) | one `user` message |
//! | `message` (`type` may be left out), role `user` | a `user` message |
//! | `message`, role `system` or `developer` | a `system` message: chat templates of open models know no developer role |
//! | `message`, role `assistant` | an `assistant` message |
//! | `function_call` | an entry of an assistant message's `tool_calls`: `call_id` its `id`, `arguments` kept as the string it is. Function calls that follow an assistant message (or each other), with only reasoning between, join it: one assistant turn of text and calls is one chat message |
//! | `function_call_output` | a `tool` message, `call_id` its `tool_call_id`, its text parts concatenated |
//! | `reasoning` | left out: the backend's chat template takes no earlier reasoning |
//!
//! A message's `content` is a string or an array of parts, translated as the Messages API's
//! blocks are: texts only become one string, concatenated; with an image, an array of chat
//! parts. Parts: `input_text` (user, system, developer), `input_image` with an `image_url`
//! (user), `output_text` and `refusal` (assistant, as text). Any other item or part is
//! refused: files, item references (haltd keeps no items) and the items of built-in tools.
//! Unlike the Messages API, a final assistant message is not a prefill: the Responses API
//! answers it with a new message, as chat does.

use serde_json::{json, Value};

use crate::wire::{
    chat_content::{content, Part},
    fields::{
        as_object, bad, field, join, one_of, only, opt_str, quote, required, required_str, Object,
    },
    http::HttpError,
};

/// The chat role a Responses message is written with.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Role {
    User,
    /// `system` or `developer`.
    System,
    Assistant,
}

impl Role {
    fn chat(self) -> &'static str {
        match self {
            Role::User => "user",
            Role::System => "system",
            Role::Assistant => "assistant",
        }
    }
}

/// Appends the chat messages of `input` (a string or an array of items) to `out`.
pub fn push(input: &Value, out: &mut Vec<Value>) -> Result<(), HttpError> {
    let items = match input {
        Value::String(s) => {
            out.push(json!({"role": "user", "content": s}));
            return Ok(());
        }
        Value::Array(items) if items.is_empty() => {
            return Err(bad("input", "must not be empty"));
        }
        Value::Array(items) => items,
        _ => return Err(bad("input", "must be a string or an array of input items")),
    };
    let start = out.len();
    // Whether the last message is the assistant's and a function call may join it.
    let mut calls_join = false;
    for (i, item) in items.iter().enumerate() {
        let path = format!("input[{i}]");
        let obj = as_object(item, &path)?;
        let kind = match opt_str(obj, "type", &path)? {
            Some(kind) => kind,
            None if field(obj, "role").is_some() => "message",
            None => return Err(bad(&join(&path, "type"), "required")),
        };
        match kind {
            "message" => {
                let (role, message) = message(obj, &path)?;
                out.push(message);
                calls_join = role == Role::Assistant;
            }
            "function_call" => {
                let call = tool_call(obj, &path)?;
                match out.last_mut() {
                    Some(Value::Object(m)) if calls_join => match m.get_mut("tool_calls") {
                        Some(Value::Array(calls)) => calls.push(call),
                        _ => {
                            m.insert("tool_calls".into(), json!([call]));
                        }
                    },
                    _ => out.push(json!({"role": "assistant", "content": "", "tool_calls": [call]})),
                }
                calls_join = true;
            }
            "function_call_output" => {
                out.push(tool_message(obj, &path)?);
                calls_join = false;
            }
            // The backend's chat template takes no earlier reasoning.
            "reasoning" => check_reasoning(obj, &path)?,
            "item_reference" => {
                return Err(bad(
                    &join(&path, "type"),
                    "\"item_reference\" items are not supported: haltd keeps no items; send the item itself",
                ))
            }
            other => {
                return Err(bad(
                    &join(&path, "type"),
                    format!(
                        "{} items are not supported: haltd takes messages, function calls, \
                         their outputs and reasoning",
                        quote(other)
                    ),
                ))
            }
        }
    }
    if out.len() == start {
        return Err(bad(
            "input",
            "holds no message, function call or function call output",
        ));
    }
    Ok(())
}

/// A `message` item as a chat message; `id`, `status` and `phase` are left out.
fn message(m: &Object, path: &str) -> Result<(Role, Value), HttpError> {
    only(
        m,
        path,
        &["type", "role", "content", "id", "status", "phase"],
    )?;
    let role = match required_str(m, "role", path)? {
        "user" => Role::User,
        "system" | "developer" => Role::System,
        "assistant" => Role::Assistant,
        other => {
            return Err(bad(
                &join(path, "role"),
                format!(
                    "must be \"user\", \"system\", \"developer\" or \"assistant\", not {}",
                    quote(other)
                ),
            ))
        }
    };
    for name in ["id", "status", "phase"] {
        opt_str(m, name, path)?;
    }
    let content = match required(m, "content", path)? {
        Value::String(s) => Value::String(s.clone()),
        Value::Array(parts) => content(
            parts
                .iter()
                .enumerate()
                .map(|(k, p)| part(p, &format!("{path}.content[{k}]"), role))
                .collect::<Result<_, _>>()?,
        ),
        _ => {
            return Err(bad(
                &join(path, "content"),
                "must be a string or an array of content parts",
            ))
        }
    };
    Ok((role, json!({"role": role.chat(), "content": content})))
}

/// The content part `v` of a `role` message, at `path`.
fn part(v: &Value, path: &str, role: Role) -> Result<Part, HttpError> {
    let p = as_object(v, path)?;
    let kind = required_str(p, "type", path)?;
    let only_in = |whose: &str| {
        bad(
            &join(path, "type"),
            format!(
                "{} parts are only accepted in {whose} messages",
                quote(kind)
            ),
        )
    };
    match (kind, role) {
        ("input_text", Role::User | Role::System) => {
            only(p, path, &["type", "text", "prompt_cache_breakpoint"])?;
            cache_breakpoint(p, path)?;
            Ok(Part::Text(required_str(p, "text", path)?.to_owned()))
        }
        ("input_image", Role::User) => image(p, path).map(Part::Image),
        // Annotations and logprobs of an earlier answer are left out.
        ("output_text", Role::Assistant) => {
            only(p, path, &["type", "text", "annotations", "logprobs"])?;
            for name in ["annotations", "logprobs"] {
                if field(p, name).is_some_and(|v| !v.is_array()) {
                    return Err(bad(&join(path, name), "must be an array"));
                }
            }
            Ok(Part::Text(required_str(p, "text", path)?.to_owned()))
        }
        // What the model said when it refused is what it said.
        ("refusal", Role::Assistant) => {
            only(p, path, &["type", "refusal"])?;
            Ok(Part::Text(required_str(p, "refusal", path)?.to_owned()))
        }
        ("input_text", Role::Assistant) => Err(only_in("user, system and developer")),
        ("input_image", _) => Err(only_in("user")),
        ("output_text" | "refusal", _) => Err(only_in("assistant")),
        _ => Err(bad(
            &join(path, "type"),
            format!("{} parts are not supported", quote(kind)),
        )),
    }
}

/// `prompt_cache_breakpoint` of a part, accepted and left out (prompt caching is the
/// backend's own): an object when present.
fn cache_breakpoint(p: &Object, path: &str) -> Result<(), HttpError> {
    match field(p, "prompt_cache_breakpoint") {
        Some(v) => as_object(v, &join(path, "prompt_cache_breakpoint")).map(drop),
        None => Ok(()),
    }
}

/// An `input_image` part's chat `image_url` object: its URL (a `data:` URL or a link), and
/// its `detail` when chat has it.
fn image(p: &Object, path: &str) -> Result<Value, HttpError> {
    only(
        p,
        path,
        &[
            "type",
            "image_url",
            "file_id",
            "detail",
            "prompt_cache_breakpoint",
        ],
    )?;
    cache_breakpoint(p, path)?;
    if field(p, "file_id").is_some() {
        return Err(bad(
            &join(path, "file_id"),
            "not supported: haltd keeps no files; send `image_url`",
        ));
    }
    let mut image = json!({"url": required_str(p, "image_url", path)?});
    if let Some(d) = field(p, "detail") {
        let detail_path = join(path, "detail");
        match one_of(d, &detail_path, &["auto", "low", "high", "original"])? {
            "original" => {
                return Err(bad(
                    &detail_path,
                    "\"original\" is not supported: chat images take \"auto\", \"low\" or \"high\"",
                ))
            }
            detail => image["detail"] = detail.into(),
        }
    }
    Ok(image)
}

/// The members a `function_call` and a `function_call_output` share, checked and left out:
/// `id` and `status` (strings), `caller` (the model itself, `direct`). A `namespace` is
/// refused, as namespaced tools are.
fn check_call(c: &Object, path: &str) -> Result<(), HttpError> {
    opt_str(c, "id", path)?;
    opt_str(c, "status", path)?;
    if field(c, "namespace").is_some() {
        return Err(bad(
            &join(path, "namespace"),
            "not supported: haltd serves function tools without namespaces",
        ));
    }
    if let Some(v) = field(c, "caller") {
        let caller_path = join(path, "caller");
        let caller = as_object(v, &caller_path)?;
        match required_str(caller, "type", &caller_path)? {
            "direct" => only(caller, &caller_path, &["type"])?,
            other => {
                return Err(bad(
                    &join(&caller_path, "type"),
                    format!(
                        "{} is not supported: programmatic tool calling runs on OpenAI's servers",
                        quote(other)
                    ),
                ))
            }
        }
    }
    Ok(())
}

/// A `function_call` item as a chat tool call: `call_id` its `id`, `arguments` as sent.
fn tool_call(c: &Object, path: &str) -> Result<Value, HttpError> {
    only(
        c,
        path,
        &[
            "type",
            "id",
            "call_id",
            "name",
            "arguments",
            "status",
            "namespace",
            "caller",
        ],
    )?;
    check_call(c, path)?;
    let id = required_str(c, "call_id", path)?;
    let name = required_str(c, "name", path)?;
    let arguments = required_str(c, "arguments", path)?;
    Ok(json!({
        "id": id,
        "type": "function",
        "function": {"name": name, "arguments": arguments},
    }))
}

/// A `function_call_output` item as a chat `tool` message: `output`, or the texts of its
/// `input_text` parts concatenated. Its `name` is left out (chat's tool message has none).
fn tool_message(o: &Object, path: &str) -> Result<Value, HttpError> {
    only(
        o,
        path,
        &[
            "type",
            "id",
            "call_id",
            "output",
            "status",
            "name",
            "namespace",
            "caller",
        ],
    )?;
    check_call(o, path)?;
    opt_str(o, "name", path)?;
    let id = required_str(o, "call_id", path)?;
    let output_path = join(path, "output");
    let text = match required(o, "output", path)? {
        Value::String(s) => s.clone(),
        Value::Array(parts) => parts
            .iter()
            .enumerate()
            .map(|(k, p)| output_text(p, &format!("{output_path}[{k}]")))
            .collect::<Result<String, _>>()?,
        _ => {
            return Err(bad(
                &output_path,
                "must be a string or an array of content parts",
            ))
        }
    };
    Ok(json!({"role": "tool", "tool_call_id": id, "content": text}))
}

/// A part of a function call's output, which must be `input_text`: its text.
fn output_text<'a>(v: &'a Value, path: &str) -> Result<&'a str, HttpError> {
    let p = as_object(v, path)?;
    match required_str(p, "type", path)? {
        "input_text" => {
            only(p, path, &["type", "text", "prompt_cache_breakpoint"])?;
            cache_breakpoint(p, path)?;
            required_str(p, "text", path)
        }
        other => Err(bad(
            &join(path, "type"),
            format!(
                "{} parts are not supported in a function call output: a chat tool message \
                 carries text",
                quote(other)
            ),
        )),
    }
}

/// A `reasoning` item: checked for its shape, then left out.
fn check_reasoning(r: &Object, path: &str) -> Result<(), HttpError> {
    only(
        r,
        path,
        &[
            "type",
            "id",
            "summary",
            "content",
            "encrypted_content",
            "status",
        ],
    )?;
    for name in ["summary", "content"] {
        if field(r, name).is_some_and(|v| !v.is_array()) {
            return Err(bad(&join(path, name), "must be an array"));
        }
    }
    for name in ["id", "encrypted_content", "status"] {
        opt_str(r, name, path)?;
    }
    Ok(())
}
