//! Turning a client's request ([`ClientRequest`], parsed once) into the request haltd sends
//! upstream.
//!
//! The client's JSON object is forwarded with every field it set (sampling parameters, stop
//! strings, vendor extensions such as vLLM's `ignore_eos`), except the few haltd must own:
//!
//! * `stream: true` and `stream_options.include_usage: true`, always: haltd streams from the
//!   upstream even for a client's batch request, so detectors see each token as it is made and
//!   a trip can cancel the generation; usage comes in the last chunk for the records.
//! * logprobs always on (chat: `logprobs: true`; completions: `logprobs >= 1`): the monitors
//!   score every token. What the client itself asked for is kept in [`Ask`], so the proxy
//!   returns logprobs only to a client that asked.
//! * `n` other than 1, `best_of` above 1 and a batch of prompts are refused: haltd governs one
//!   choice per stream, and its halt budget is per connection.
//! * In degraded mode, tool definitions are removed (the turn runs without tools).
//!
//! Validation here is only what haltd relies on; everything else is the upstream's to judge,
//! and its error comes back to the client as it is.

use std::io::Write as _;

use serde_json::{Map, Value};

pub use crate::upstream::degraded::DegradedShape;
use crate::{
    upstream::{
        native::{self, UpstreamSurface},
        url::UpstreamUrl,
    },
    wire::{request::Ask, ClientRequest, Endpoint, HttpError, MAX_TOP_LOGPROBS},
};

/// API path of chat completions.
pub const CHAT_PATH: &str = "/v1/chat/completions";
/// API path of (legacy) completions.
pub const COMPLETIONS_PATH: &str = "/v1/completions";
/// API path of the model list (health checks, model discovery).
pub const MODELS_PATH: &str = "/v1/models";

/// Highest `logprobs` a completions request may ask for (the OpenAI limit).
pub const MAX_COMPLETION_LOGPROBS: u64 = 5;

/// Error code when a request asks for more than one choice.
pub const CODE_N_NOT_SUPPORTED: &str = "n_not_supported";

/// Request fields that define or select tools; removed in degraded mode.
pub const TOOL_FIELDS: [&str; 5] = [
    "tools",
    "tool_choice",
    "functions",
    "function_call",
    "parallel_tool_calls",
];

/// The proxy's view of a client's request: what to answer in kind, and the body to send
/// upstream.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UpstreamTurn {
    pub ask: Ask,
    /// The model the client asked the upstream for (the chunks carry it).
    pub model: String,
    /// Whether the request carried tool definitions or a tool choice (any of
    /// [`TOOL_FIELDS`] with a value other than `null` or `[]`), in either mode.
    pub tools_requested: bool,
    /// The upstream request body (always `stream: true`, logprobs on).
    pub body: Vec<u8>,
    /// The surface the request is passed through as (`--upstream-surfaces`): the body is
    /// the client's own and goes to that surface's path; `None`: shaped as chat or
    /// completions.
    pub native: Option<UpstreamSurface>,
}

impl UpstreamTurn {
    /// The backend's path for the turn.
    pub fn api_path(&self) -> &'static str {
        match (self.native, self.ask.endpoint.request_shape()) {
            (Some(s), _) => s.api_path(),
            (None, Endpoint::Completion) => COMPLETIONS_PATH,
            (None, _) => CHAT_PATH,
        }
    }
}

fn type_error(field: &str, expected: &str) -> HttpError {
    HttpError::bad_request(format!("{field} must be {expected}"))
}

/// A field's value; `null` counts as absent, as the OpenAI API treats it.
fn field<'a>(obj: &'a Map<String, Value>, name: &str) -> Option<&'a Value> {
    obj.get(name).filter(|v| !v.is_null())
}

fn opt_bool(obj: &Map<String, Value>, name: &str) -> Result<Option<bool>, HttpError> {
    match field(obj, name) {
        None => Ok(None),
        Some(Value::Bool(b)) => Ok(Some(*b)),
        Some(_) => Err(type_error(name, "true or false")),
    }
}

/// A non-negative integer field. Integral floats (`1.0`) are refused, as OpenAI does.
fn opt_uint(obj: &Map<String, Value>, name: &str) -> Result<Option<u64>, HttpError> {
    match field(obj, name) {
        None => Ok(None),
        Some(v) => v
            .as_u64()
            .map(Some)
            .ok_or_else(|| type_error(name, "a non-negative integer")),
    }
}

fn one_choice_only(what: String) -> HttpError {
    HttpError::bad_request(format!(
        "{what} is not supported: haltd governs one choice per stream so that the halt budget holds per connection; send separate requests instead"
    ))
    .with_code(CODE_N_NOT_SUPPORTED)
}

fn check_choices(obj: &Map<String, Value>) -> Result<(), HttpError> {
    match opt_uint(obj, "n")? {
        None | Some(1) => {}
        Some(n) => return Err(one_choice_only(format!("n = {n}"))),
    }
    match opt_uint(obj, "best_of")? {
        None | Some(1) => {}
        Some(0) => return Err(HttpError::bad_request("best_of must be at least 1")),
        Some(b) => return Err(one_choice_only(format!("best_of = {b}"))),
    }
    Ok(())
}

fn check_messages(obj: &Map<String, Value>) -> Result<(), HttpError> {
    match obj.get("messages") {
        None | Some(Value::Null) => Err(HttpError::bad_request("messages is required")),
        Some(Value::Array(m)) if m.is_empty() => {
            Err(HttpError::bad_request("messages must not be empty"))
        }
        Some(Value::Array(m)) => match m.iter().position(|m| !m.is_object()) {
            Some(i) => Err(type_error(&format!("messages[{i}]"), "an object")),
            None => Ok(()),
        },
        Some(_) => Err(type_error("messages", "an array of message objects")),
    }
}

fn is_token_ids(v: &Value) -> bool {
    v.as_array()
        .is_some_and(|a| !a.is_empty() && a.iter().all(|t| t.as_u64().is_some()))
}

/// Completions `prompt`: a string, one tokenised prompt (an array of token ids), or a batch of
/// exactly one of either. A longer batch would make one choice per prompt.
fn check_prompt(obj: &Map<String, Value>) -> Result<(), HttpError> {
    const SHAPE: &str =
        "a string, an array of token ids, or an array holding one string or one token-id array";
    match obj.get("prompt") {
        None | Some(Value::Null) => Err(HttpError::bad_request("prompt is required")),
        Some(Value::String(_)) => Ok(()),
        Some(Value::Array(a)) if a.is_empty() => {
            Err(HttpError::bad_request("prompt must not be empty"))
        }
        Some(v @ Value::Array(a)) => {
            if is_token_ids(v) {
                return Ok(());
            }
            if !a.iter().all(|p| p.is_string() || is_token_ids(p)) {
                return Err(type_error("prompt", SHAPE));
            }
            if a.len() > 1 {
                return Err(one_choice_only(format!("a batch of {} prompts", a.len())));
            }
            Ok(())
        }
        Some(_) => Err(type_error("prompt", SHAPE)),
    }
}

/// Validates a client's request for forwarding and builds the upstream body from it.
///
/// Errors are 400s naming the field; a request for more than one choice is refused with code
/// [`CODE_N_NOT_SUPPORTED`]. A degraded turn (`Some`) is shaped as [`DegradedShape`] says.
pub fn prepare_turn(
    req: ClientRequest,
    degraded: Option<DegradedShape<'_>>,
) -> Result<UpstreamTurn, HttpError> {
    // The client's surface answers; the body is shaped as its request shape (a Messages
    // request was translated to chat when it was parsed).
    let surface = req.endpoint;
    let endpoint = surface.request_shape();
    let (json, native) = req.into_parts();
    let Value::Object(mut obj) = json else {
        return Err(HttpError::bad_request("request body must be a JSON object"));
    };
    let model = required_model(&obj)?;
    let stream = opt_bool(&obj, "stream")?.unwrap_or(false);
    check_choices(&obj)?;
    let include_usage = include_usage(&obj)?;
    let (logprobs, top_logprobs) = match endpoint {
        Endpoint::Chat | Endpoint::Messages | Endpoint::Responses => {
            check_messages(&obj)?;
            chat_logprobs(&obj)?
        }
        Endpoint::Completion => {
            check_prompt(&obj)?;
            completion_logprobs(&obj)?
        }
    };
    let tools_requested = TOOL_FIELDS.iter().any(|f| match obj.get(*f) {
        None | Some(Value::Null) => false,
        Some(Value::Array(a)) => !a.is_empty(),
        Some(_) => true,
    });
    let passed = native.and_then(|n| Some((UpstreamSurface::of(surface)?, n)));
    let (native, sent) = match passed {
        // The translation was checked above; the client's own body goes upstream.
        Some((s, Value::Object(mut own))) => {
            native::native_body(s, &mut own, top_logprobs, degraded);
            (Some(s), Value::Object(own))
        }
        _ => {
            if let Some(shape) = degraded {
                shape_degraded(&mut obj, endpoint, shape);
            }
            own_streaming_fields(&mut obj, endpoint, top_logprobs);
            (None, Value::Object(obj))
        }
    };
    let body = serde_json::to_vec(&sent).map_err(|e| {
        HttpError::new(
            500,
            "server_error",
            format!("cannot serialise the upstream request: {e}"),
        )
    })?;
    Ok(UpstreamTurn {
        ask: Ask {
            endpoint: surface,
            stream,
            logprobs,
            top_logprobs,
            include_usage,
        },
        model,
        tools_requested,
        body,
        native,
    })
}

/// [`DegradedShape`] on a request shaped as chat or completions.
fn shape_degraded(obj: &mut Map<String, Value>, endpoint: Endpoint, shape: DegradedShape<'_>) {
    for f in TOOL_FIELDS {
        obj.remove(f);
    }
    obj.insert("temperature".into(), Value::from(0));
    if shape.instruction.is_empty() || endpoint == Endpoint::Completion {
        return;
    }
    if let Some(Value::Array(messages)) = obj.get_mut("messages") {
        let first = serde_json::json!({"role": "system", "content": shape.instruction});
        messages.insert(0, first);
    }
}

/// `model`: required by the upstream, which serves requests by name.
fn required_model(obj: &Map<String, Value>) -> Result<String, HttpError> {
    match obj.get("model") {
        None | Some(Value::Null) => Err(HttpError::bad_request(
            "model is required: the upstream serves requests by model name",
        )),
        Some(Value::String(m)) if m.is_empty() => {
            Err(HttpError::bad_request("model must not be empty"))
        }
        Some(Value::String(m)) => Ok(m.clone()),
        Some(_) => Err(type_error("model", "a string")),
    }
}

/// `stream_options.include_usage`.
fn include_usage(obj: &Map<String, Value>) -> Result<bool, HttpError> {
    match field(obj, "stream_options") {
        None => Ok(false),
        Some(Value::Object(o)) => match field(o, "include_usage") {
            None => Ok(false),
            Some(Value::Bool(b)) => Ok(*b),
            Some(_) => Err(type_error("stream_options.include_usage", "true or false")),
        },
        Some(_) => Err(type_error("stream_options", "an object")),
    }
}

/// Chat `logprobs` and `top_logprobs`, as the client asked.
fn chat_logprobs(obj: &Map<String, Value>) -> Result<(bool, u32), HttpError> {
    let logprobs = opt_bool(obj, "logprobs")?.unwrap_or(false);
    let top = match opt_uint(obj, "top_logprobs") {
        Ok(t) => t.unwrap_or(0),
        Err(_) => {
            return Err(type_error(
                "top_logprobs",
                &format!("an integer from 0 to {MAX_TOP_LOGPROBS}"),
            ))
        }
    };
    if top > u64::from(MAX_TOP_LOGPROBS) {
        return Err(HttpError::bad_request(format!(
            "top_logprobs must be at most {MAX_TOP_LOGPROBS}"
        )));
    }
    if top > 0 && !logprobs {
        return Err(HttpError::bad_request(
            "top_logprobs requires logprobs: true",
        ));
    }
    // Bounded by MAX_TOP_LOGPROBS just above.
    Ok((logprobs, u32::try_from(top).unwrap_or(MAX_TOP_LOGPROBS)))
}

/// Completions `logprobs` (given at all, and how many alternatives), as the client asked.
fn completion_logprobs(obj: &Map<String, Value>) -> Result<(bool, u32), HttpError> {
    let range = || {
        type_error(
            "logprobs",
            &format!("an integer from 0 to {MAX_COMPLETION_LOGPROBS} for completions"),
        )
    };
    match opt_uint(obj, "logprobs").map_err(|_| range())? {
        None => Ok((false, 0)),
        Some(lp) if lp > MAX_COMPLETION_LOGPROBS => Err(range()),
        Some(lp) => Ok((true, u32::try_from(lp).unwrap_or(0))),
    }
}

/// The fields haltd owns in every upstream request: streaming with usage, logprobs on.
fn own_streaming_fields(obj: &mut Map<String, Value>, endpoint: Endpoint, top_logprobs: u32) {
    obj.insert("stream".into(), Value::Bool(true));
    let mut so = Map::new();
    so.insert("include_usage".into(), Value::Bool(true));
    obj.insert("stream_options".into(), Value::Object(so));
    match endpoint {
        Endpoint::Chat | Endpoint::Messages | Endpoint::Responses => {
            obj.insert("logprobs".into(), Value::Bool(true));
            obj.insert("top_logprobs".into(), Value::from(top_logprobs));
        }
        Endpoint::Completion => {
            obj.insert("logprobs".into(), Value::from(top_logprobs.max(1)));
        }
    }
}

/// Whether `v` may be written as an HTTP header value: visible ASCII, space and tab only
/// (no CR, LF, NUL or other control bytes, no non-ASCII).
pub fn valid_header_value(v: &str) -> bool {
    v.bytes().all(|b| b == b'\t' || (b' '..=b'~').contains(&b))
}

fn valid_method(m: &str) -> bool {
    !m.is_empty() && m.bytes().all(|b| b.is_ascii_uppercase())
}

/// Writes an HTTP/1.1 request (head and body) into `out`.
///
/// HTTP/1.1 keep-alive (no `connection: close`): the data plane's upstream pool reuses a
/// connection whose response ended cleanly, and closes any other (closing it is how a trip
/// cancels the generation, so a cancelled turn's connection is never reused). `authorization` is written
/// verbatim; the caller validates it with [`valid_header_value`], and a value that fails that
/// check is left out here rather than written (the upstream then answers 401, never a header
/// injection).
pub fn write_http_request(
    out: &mut Vec<u8>,
    url: &UpstreamUrl,
    method: &str,
    api_path: &str,
    authorization: Option<&str>,
    body: Option<&[u8]>,
) {
    write_http_request_with(out, url, (method, api_path), authorization, &[], body);
}

/// [`write_http_request`] with `extra` header fields (the correlation headers a turn sends:
/// `x-request-id`, `x-haltd-stream-id`, `traceparent`); a field whose value fails
/// [`valid_header_value`] is left out.
pub fn write_http_request_with(
    out: &mut Vec<u8>,
    url: &UpstreamUrl,
    (method, api_path): (&str, &str),
    authorization: Option<&str>,
    extra: &[(&str, &str)],
    body: Option<&[u8]>,
) {
    debug_assert!(valid_method(method), "bad method {method:?}");
    let target = url.path_for(api_path);
    debug_assert!(
        target.bytes().all(|b| b.is_ascii_graphic()),
        "bad request target {target:?}"
    );
    // A turn's POST reads a stream, anything else JSON; an `accept` in `extra` (a JSON POST,
    // the escalation) says otherwise.
    let asked = extra.iter().find(|(n, _)| n.eq_ignore_ascii_case("accept"));
    let accept = match asked {
        Some((_, v)) => v,
        None if method == "POST" => "text/event-stream",
        None => "application/json",
    };
    // Writes into a Vec cannot fail.
    let _ = write!(
        out,
        "{method} {target} HTTP/1.1\r\nhost: {}\r\nuser-agent: haltd/{}\r\naccept: {accept}\r\naccept-encoding: identity\r\n",
        url.host_header(),
        env!("CARGO_PKG_VERSION"),
    );
    if let Some(auth) = authorization.filter(|a| valid_header_value(a)) {
        out.extend_from_slice(b"authorization: ");
        out.extend_from_slice(auth.as_bytes());
        out.extend_from_slice(b"\r\n");
    }
    let rest = extra
        .iter()
        .filter(|(n, _)| !n.eq_ignore_ascii_case("accept"));
    for (name, value) in rest.filter(|(_, v)| valid_header_value(v)) {
        let _ = write!(out, "{name}: {value}\r\n");
    }
    if let Some(body) = body {
        let _ = write!(
            out,
            "content-type: application/json\r\ncontent-length: {}\r\n",
            body.len()
        );
    }
    out.extend_from_slice(b"\r\n");
    if let Some(body) = body {
        out.extend_from_slice(body);
    }
}

#[cfg(test)]
mod tests;
