//! A Responses API request body, translated into the chat-completions body haltd governs
//! (docs/wire-format.md, "Responses API requests").
//!
//! The translation fails closed, as the Messages API's does: a field, input item or content
//! part haltd cannot honour is refused with a 400 whose message starts with its path
//! (`input[2].type: ...`, `tools[0].type: ...`); only what cannot change the generation is
//! accepted and left out. [`FIELDS`] says what becomes of each top-level field, and
//! `request/input.rs` of each input item. As in the chat API, `null` counts as absent.
//!
//! haltd keeps no state between requests: no stored response, conversation, prompt template
//! or file. What refers to one is refused (`previous_response_id` with its own code,
//! [`CODE_PREVIOUS_RESPONSE_NOT_SUPPORTED`], so that a client can tell it apart and send the
//! whole conversation instead), and `store` is accepted with the answer saying
//! `"store": false`. Built-in tools (web search, file search, code interpreter, MCP, ...) run
//! on OpenAI's servers: haltd serves function tools, which the client runs and TokenCircuit
//! governs.

mod input;

use serde_json::{json, Value};

use crate::wire::{
    encode::MAX_TOP_LOGPROBS,
    endpoint::MAX_MAX_TOKENS,
    fields::{
        as_object, as_str, bad, check_fields, field, join, one_of, only, opt_bool, opt_str, quote,
        required, required_str, within_nesting, FieldRule, Object, QUOTED_CHARS,
    },
    http::HttpError,
    text::truncate_chars,
};
use FieldRule::{Accepted, Refused, Translated};

#[cfg(test)]
mod tests;

/// The error code of a request with `previous_response_id`: haltd keeps no responses, and the
/// client should send the whole conversation in `input`.
pub const CODE_PREVIOUS_RESPONSE_NOT_SUPPORTED: &str = "previous_response_not_supported";

/// Why `previous_response_id` is refused.
const NO_STORED_RESPONSES: &str =
    "haltd keeps no responses; send the whole conversation in `input`";

/// Prompt caching is the backend's own, whatever the client asks of OpenAI's.
const CACHING: &str = "prompt caching is the backend's own";

/// Every top-level request field of the Responses API (openai-python's
/// `ResponseCreateParams`) and what haltd does with it, in the order of the table in
/// docs/wire-format.md. A field not listed is refused as unknown.
pub const FIELDS: &[(&str, FieldRule)] = &[
    ("model", Translated("`model`")),
    ("input", Translated("`messages`, item by item")),
    ("instructions", Translated("a first `system` message")),
    (
        "max_output_tokens",
        Translated("`max_tokens` (1 to 1000000)"),
    ),
    (
        "stream",
        Translated("`stream`; `true` adds `stream_options.include_usage: true`"),
    ),
    (
        "stream_options",
        Accepted("`include_obfuscation` pads events; haltd writes none, whatever it says"),
    ),
    ("temperature", Translated("`temperature`")),
    ("top_p", Translated("`top_p`")),
    (
        "top_logprobs",
        Translated("`top_logprobs`, when `include` asks for logprobs"),
    ),
    ("tools", Translated("`tools` of type `function`")),
    ("tool_choice", Translated("`tool_choice`")),
    ("parallel_tool_calls", Translated("`parallel_tool_calls`")),
    (
        "max_tool_calls",
        Accepted("it bounds calls to built-in tools, and haltd runs none"),
    ),
    ("text", Translated("`response_format`, from `format`")),
    ("reasoning", Translated("`reasoning_effort`, from `effort`")),
    (
        "include",
        Translated("`logprobs: true`, for `message.output_text.logprobs`"),
    ),
    ("user", Translated("`user`")),
    (
        "metadata",
        Accepted("haltd stores no response to attach it to"),
    ),
    (
        "store",
        Accepted("haltd keeps no responses; the response says `\"store\": false`"),
    ),
    (
        "truncation",
        Accepted("`disabled`, the default; haltd does not drop input items"),
    ),
    (
        "background",
        Accepted("`false`; haltd answers in the request that asks"),
    ),
    (
        "safety_identifier",
        Accepted("it is for OpenAI's abuse monitoring"),
    ),
    ("prompt_cache_key", Accepted(CACHING)),
    ("prompt_cache_retention", Accepted(CACHING)),
    ("prompt_cache_options", Accepted(CACHING)),
    ("previous_response_id", Refused(NO_STORED_RESPONSES)),
    (
        "conversation",
        Refused("haltd keeps no conversations; send the whole conversation in `input`"),
    ),
    (
        "prompt",
        Refused("haltd keeps no prompt templates; send `instructions` and `input`"),
    ),
    (
        "context_management",
        Refused("haltd does not compact the conversation it is sent"),
    ),
    (
        "service_tier",
        Refused("haltd has no capacity tiers to choose from"),
    ),
    (
        "moderation",
        Refused("haltd runs no moderation model; its own detectors govern the stream"),
    ),
    (
        "access_programs",
        Refused("OpenAI's access programs choose among its models' tiers; the backend has none"),
    ),
    (
        "background_options",
        Refused("haltd runs nothing in the background; it answers in the request that asks"),
    ),
    (
        "image",
        Refused("the backend takes no request-level image options"),
    ),
];

/// `include` values that ask for the output of a built-in tool, which haltd does not run.
const BUILT_IN_INCLUDES: &[&str] = &[
    "file_search_call.results",
    "web_search_call.results",
    "web_search_call.action.sources",
    "code_interpreter_call.outputs",
    "computer_call_output.output.image_url",
];

/// The `reasoning.effort` values of the API, sent as chat's `reasoning_effort` for the
/// backend to take or refuse.
const EFFORTS: &[&str] = &["none", "minimal", "low", "medium", "high", "xhigh", "max"];

/// Translates a Responses API request body into the chat-completions body haltd governs.
///
/// Errors are 400s whose message starts with the path of the field at fault
/// (`input: required`, `tools[1].type: ...`); `previous_response_id` is refused with the code
/// [`CODE_PREVIOUS_RESPONSE_NOT_SUPPORTED`].
pub fn to_chat(body: &Value) -> Result<Value, HttpError> {
    let req = body
        .as_object()
        .ok_or_else(|| HttpError::bad_request("request body must be a JSON object"))?;
    // Before any other check, so that a client that relies on stored responses learns so
    // first, by its code.
    if field(req, "previous_response_id").is_some() {
        return Err(previous_response_not_supported());
    }
    check_fields(req, FIELDS)?;
    let mut chat = Object::new();
    chat.insert("model".into(), model(req)?.into());
    if let Some(n) = max_output_tokens(req)? {
        chat.insert("max_tokens".into(), n.into());
    }
    let mut messages = Vec::new();
    if let Some(s) = opt_str(req, "instructions", "")? {
        messages.push(json!({"role": "system", "content": s}));
    }
    input::push(required(req, "input", "")?, &mut messages)?;
    chat.insert("messages".into(), Value::Array(messages));
    sampling(req, &mut chat)?;
    logprobs(req, &mut chat)?;
    tools(req, &mut chat)?;
    if let Some(v) = field(req, "text") {
        text(v, &mut chat)?;
    }
    if let Some(v) = field(req, "reasoning") {
        reasoning(v, &mut chat)?;
    }
    if let Some(user) = opt_str(req, "user", "")? {
        chat.insert("user".into(), user.into());
    }
    check_accepted(req)?;
    within_nesting(Value::Object(chat))
}

/// The refusal of `previous_response_id`, with its code.
fn previous_response_not_supported() -> HttpError {
    bad(
        "previous_response_id",
        format!("not supported: {NO_STORED_RESPONSES}"),
    )
    .with_code(CODE_PREVIOUS_RESPONSE_NOT_SUPPORTED)
}

fn model(req: &Object) -> Result<&str, HttpError> {
    match required_str(req, "model", "")? {
        "" => Err(bad("model", "must not be empty")),
        m => Ok(m),
    }
}

/// `max_output_tokens`, when given: chat's `max_tokens`. Without it the turn takes the chat
/// path's default, as a chat request without `max_tokens` does.
fn max_output_tokens(req: &Object) -> Result<Option<u64>, HttpError> {
    match field(req, "max_output_tokens").map(Value::as_u64) {
        None => Ok(None),
        Some(Some(n)) if (1..=u64::from(MAX_MAX_TOKENS)).contains(&n) => Ok(Some(n)),
        Some(_) => Err(bad(
            "max_output_tokens",
            format!("must be an integer from 1 to {MAX_MAX_TOKENS}"),
        )),
    }
}

/// `stream`, `temperature` and `top_p`.
fn sampling(req: &Object, chat: &mut Object) -> Result<(), HttpError> {
    if let Some(stream) = opt_bool(req, "stream", "")? {
        chat.insert("stream".into(), stream.into());
        // The Responses stream ends with the usage (`response.completed`).
        if stream {
            chat.insert("stream_options".into(), json!({"include_usage": true}));
        }
    }
    for name in ["temperature", "top_p"] {
        if let Some(v) = field(req, name) {
            if !v.is_number() {
                return Err(bad(name, "must be a number"));
            }
            chat.insert(name.into(), v.clone());
        }
    }
    Ok(())
}

/// `include` and `top_logprobs`: logprobs come back only when `include` asks for them, so
/// `top_logprobs` is sent only then (chat refuses `top_logprobs` without `logprobs: true`).
fn logprobs(req: &Object, chat: &mut Object) -> Result<(), HttpError> {
    let mut asked = false;
    if let Some(v) = field(req, "include") {
        let list = v
            .as_array()
            .ok_or_else(|| bad("include", "must be an array of strings"))?;
        for (k, item) in list.iter().enumerate() {
            let path = format!("include[{k}]");
            match as_str(item, &path)? {
                "message.output_text.logprobs" => asked = true,
                // Reasoning items come back without `encrypted_content`, and earlier
                // reasoning sent back is left out anyway; haltd keeps no input to show.
                "reasoning.encrypted_content" | "message.input_image.image_url" => {}
                s if BUILT_IN_INCLUDES.contains(&s) => {
                    return Err(bad(
                        &path,
                        format!(
                            "{} is the output of a built-in tool, which haltd does not run",
                            quote(s)
                        ),
                    ))
                }
                other => return Err(bad(&path, format!("unknown value {}", quote(other)))),
            }
        }
    }
    let top = match field(req, "top_logprobs") {
        None => None,
        Some(v) => match v.as_u64() {
            Some(n) if n <= u64::from(MAX_TOP_LOGPROBS) => Some(n),
            _ => {
                return Err(bad(
                    "top_logprobs",
                    format!("must be an integer from 0 to {MAX_TOP_LOGPROBS}"),
                ))
            }
        },
    };
    if asked {
        chat.insert("logprobs".into(), true.into());
        if let Some(n) = top {
            chat.insert("top_logprobs".into(), n.into());
        }
    }
    Ok(())
}

/// `tools`, `tool_choice` and `parallel_tool_calls`.
fn tools(req: &Object, chat: &mut Object) -> Result<(), HttpError> {
    if let Some(v) = field(req, "tools") {
        let list = v
            .as_array()
            .ok_or_else(|| bad("tools", "must be an array of tools"))?;
        let tools = list
            .iter()
            .enumerate()
            .map(|(i, t)| tool(t, &format!("tools[{i}]")))
            .collect::<Result<Vec<_>, _>>()?;
        chat.insert("tools".into(), Value::Array(tools));
    }
    if let Some(v) = field(req, "tool_choice") {
        chat.insert("tool_choice".into(), tool_choice(v)?);
    }
    if let Some(parallel) = opt_bool(req, "parallel_tool_calls", "")? {
        chat.insert("parallel_tool_calls".into(), parallel.into());
    }
    Ok(())
}

/// A function tool as a chat function; any other type is a tool haltd does not serve.
fn tool(v: &Value, path: &str) -> Result<Value, HttpError> {
    let t = as_object(v, path)?;
    match required_str(t, "type", path)? {
        "function" => {}
        other => {
            return Err(bad(
                &join(path, "type"),
                format!(
                "{} tools are not supported: haltd serves function tools, which the client runs",
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
            "parameters",
            "strict",
            "defer_loading",
            "allowed_callers",
            "output_schema",
        ],
    )?;
    let mut function = json!({"name": required_str(t, "name", path)?});
    if let Some(d) = opt_str(t, "description", path)? {
        function["description"] = d.into();
    }
    if let Some(p) = field(t, "parameters") {
        as_object(p, &join(path, "parameters"))?;
        function["parameters"] = p.clone();
    }
    if let Some(strict) = opt_bool(t, "strict", path)? {
        function["strict"] = strict.into();
    }
    if opt_bool(t, "defer_loading", path)? == Some(true) {
        return Err(bad(
            &join(path, "defer_loading"),
            "not supported: deferred tools are loaded by OpenAI's tool search",
        ));
    }
    if let Some(callers) = field(t, "allowed_callers") {
        allowed_callers(callers, &join(path, "allowed_callers"))?;
    }
    if field(t, "output_schema").is_some() {
        return Err(bad(
            &join(path, "output_schema"),
            "not supported: a chat function has no schema of its output",
        ));
    }
    Ok(json!({"type": "function", "function": function}))
}

/// `allowed_callers`: the model calls the tool itself (`direct`); programmatic calls come
/// from code OpenAI runs.
fn allowed_callers(v: &Value, path: &str) -> Result<(), HttpError> {
    let list = v
        .as_array()
        .ok_or_else(|| bad(path, "must be an array of strings"))?;
    for (k, c) in list.iter().enumerate() {
        let path = format!("{path}[{k}]");
        if one_of(c, &path, &["direct", "programmatic"])? == "programmatic" {
            return Err(bad(
                &path,
                "\"programmatic\" is not supported: programmatic tool calling runs on OpenAI's servers",
            ));
        }
    }
    Ok(())
}

/// `tool_choice`: a mode, or a function by name.
fn tool_choice(v: &Value) -> Result<Value, HttpError> {
    const PATH: &str = "tool_choice";
    let c = match v {
        Value::String(_) => return one_of(v, PATH, &["auto", "none", "required"]).map(Value::from),
        Value::Object(c) => c,
        _ => return Err(bad(PATH, "must be a string or an object")),
    };
    match required_str(c, "type", PATH)? {
        "function" => {
            only(c, PATH, &["type", "name"])?;
            let name = required_str(c, "name", PATH)?;
            Ok(json!({"type": "function", "function": {"name": name}}))
        }
        "allowed_tools" => Err(bad(
            "tool_choice.type",
            "\"allowed_tools\" is not supported: send only the allowed tools in `tools`",
        )),
        other => Err(bad(
            "tool_choice.type",
            format!(
                "{} is not supported: haltd serves function tools only",
                quote(other)
            ),
        )),
    }
}

/// `text`: `format` as chat's `response_format`; `verbosity` only at its default.
fn text(v: &Value, chat: &mut Object) -> Result<(), HttpError> {
    let t = as_object(v, "text")?;
    only(t, "text", &["format", "verbosity"])?;
    if let Some(v) = field(t, "verbosity") {
        let verbosity = one_of(v, "text.verbosity", &["low", "medium", "high"])?;
        if verbosity != "medium" {
            return Err(bad(
                "text.verbosity",
                format!(
                    "{} is not supported: chat backends take no verbosity; send \"medium\" or nothing",
                    quote(verbosity)
                ),
            ));
        }
    }
    let Some(f) = field(t, "format") else {
        return Ok(());
    };
    const PATH: &str = "text.format";
    let f = as_object(f, PATH)?;
    match required_str(f, "type", PATH)? {
        "text" => only(f, PATH, &["type"]),
        "json_object" => {
            only(f, PATH, &["type"])?;
            chat.insert("response_format".into(), json!({"type": "json_object"}));
            Ok(())
        }
        "json_schema" => {
            only(
                f,
                PATH,
                &["type", "name", "schema", "description", "strict"],
            )?;
            let schema = required(f, "schema", PATH)?;
            as_object(schema, "text.format.schema")?;
            let mut js = json!({"name": required_str(f, "name", PATH)?, "schema": schema});
            if let Some(d) = opt_str(f, "description", PATH)? {
                js["description"] = d.into();
            }
            if let Some(strict) = opt_bool(f, "strict", PATH)? {
                js["strict"] = strict.into();
            }
            chat.insert(
                "response_format".into(),
                json!({"type": "json_schema", "json_schema": js}),
            );
            Ok(())
        }
        other => Err(bad(
            "text.format.type",
            format!(
                "must be \"text\", \"json_schema\" or \"json_object\", not {}",
                quote(other)
            ),
        )),
    }
}

/// `reasoning`: `effort` as chat's `reasoning_effort`. A summary is accepted (the backend's
/// reasoning streams whatever it says); earlier reasoning is never sent back, so only the
/// default `context` is, and only the `standard` mode.
fn reasoning(v: &Value, chat: &mut Object) -> Result<(), HttpError> {
    const PATH: &str = "reasoning";
    let r = as_object(v, PATH)?;
    only(
        r,
        PATH,
        &["effort", "summary", "generate_summary", "context", "mode"],
    )?;
    if let Some(e) = field(r, "effort") {
        let effort = one_of(e, "reasoning.effort", EFFORTS)?;
        chat.insert("reasoning_effort".into(), effort.into());
    }
    for name in ["summary", "generate_summary"] {
        if let Some(s) = field(r, name) {
            one_of(s, &join(PATH, name), &["auto", "concise", "detailed"])?;
        }
    }
    if let Some(c) = field(r, "context") {
        let context = one_of(
            c,
            "reasoning.context",
            &["auto", "current_turn", "all_turns"],
        )?;
        if context != "auto" {
            return Err(bad(
                "reasoning.context",
                format!(
                    "{} is not supported: haltd sends no earlier reasoning to the backend",
                    quote(context)
                ),
            ));
        }
    }
    match opt_str(r, "mode", PATH)? {
        None | Some("standard") => Ok(()),
        Some(other) => Err(bad(
            "reasoning.mode",
            format!(
                "{} is not supported: the backend has one mode, \"standard\"",
                quote(other)
            ),
        )),
    }
}

/// The accepted fields that are left out of the chat body, checked for their shape; what
/// haltd cannot honour of them is refused.
fn check_accepted(req: &Object) -> Result<(), HttpError> {
    if let Some(v) = field(req, "metadata") {
        metadata(v)?;
    }
    opt_bool(req, "store", "")?;
    if let Some(v) = field(req, "truncation") {
        if one_of(v, "truncation", &["auto", "disabled"])? == "auto" {
            return Err(bad(
                "truncation",
                "\"auto\" is not supported: haltd does not drop input items to fit the context \
                 window; send \"disabled\" (the backend refuses an input too long)",
            ));
        }
    }
    if opt_bool(req, "background", "")? == Some(true) {
        return Err(bad(
            "background",
            "true is not supported: haltd streams or answers in the request that asks, and \
             keeps no response to poll",
        ));
    }
    if field(req, "max_tool_calls").is_some_and(|v| v.as_u64().is_none()) {
        return Err(bad("max_tool_calls", "must be a non-negative integer"));
    }
    opt_str(req, "safety_identifier", "")?;
    opt_str(req, "prompt_cache_key", "")?;
    if let Some(v) = field(req, "prompt_cache_retention") {
        one_of(v, "prompt_cache_retention", &["in_memory", "24h"])?;
    }
    if let Some(v) = field(req, "prompt_cache_options") {
        const PATH: &str = "prompt_cache_options";
        let o = as_object(v, PATH)?;
        only(o, PATH, &["mode", "ttl"])?;
        if let Some(m) = field(o, "mode") {
            one_of(m, "prompt_cache_options.mode", &["implicit", "explicit"])?;
        }
        if let Some(t) = field(o, "ttl") {
            one_of(t, "prompt_cache_options.ttl", &["30m"])?;
        }
    }
    if let Some(v) = field(req, "stream_options") {
        let o = as_object(v, "stream_options")?;
        only(o, "stream_options", &["include_obfuscation"])?;
        opt_bool(o, "include_obfuscation", "stream_options")?;
    }
    Ok(())
}

/// `metadata`: at most 16 string values, keys of at most 64 characters and values of at most
/// 512, as the API has it.
fn metadata(v: &Value) -> Result<(), HttpError> {
    let m = as_object(v, "metadata")?;
    if m.len() > 16 {
        return Err(bad("metadata", "must have at most 16 members"));
    }
    for (k, v) in m {
        let path = join("metadata", &truncate_chars(k, QUOTED_CHARS));
        if k.chars().count() > 64 {
            return Err(bad(&path, "a key must be at most 64 characters"));
        }
        if as_str(v, &path)?.chars().count() > 512 {
            return Err(bad(&path, "must be at most 512 characters"));
        }
    }
    Ok(())
}
