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

use crate::{
    upstream::url::UpstreamUrl,
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
/// [`CODE_N_NOT_SUPPORTED`]. `degraded` removes every field in [`TOOL_FIELDS`].
pub fn prepare_turn(req: ClientRequest, degraded: bool) -> Result<UpstreamTurn, HttpError> {
    let endpoint = req.endpoint;
    let Value::Object(mut obj) = req.into_json() else {
        return Err(HttpError::bad_request("request body must be a JSON object"));
    };
    let model = required_model(&obj)?;
    let stream = opt_bool(&obj, "stream")?.unwrap_or(false);
    check_choices(&obj)?;
    let include_usage = include_usage(&obj)?;
    let (logprobs, top_logprobs) = match endpoint {
        Endpoint::Chat => {
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
    if degraded {
        for f in TOOL_FIELDS {
            obj.remove(f);
        }
    }
    own_streaming_fields(&mut obj, endpoint, top_logprobs);
    let body = serde_json::to_vec(&Value::Object(obj)).map_err(|e| {
        HttpError::new(
            500,
            "server_error",
            format!("cannot serialise the upstream request: {e}"),
        )
    })?;
    Ok(UpstreamTurn {
        ask: Ask {
            endpoint,
            stream,
            logprobs,
            top_logprobs,
            include_usage,
        },
        model,
        tools_requested,
        body,
    })
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
        Endpoint::Chat => {
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
    let accept = if method == "POST" {
        "text/event-stream"
    } else {
        "application/json"
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
    for (name, value) in extra.iter().filter(|(_, v)| valid_header_value(v)) {
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
mod tests {
    use serde_json::json;

    use super::*;

    /// The client's request parsed, then prepared for the upstream.
    fn prepare(endpoint: Endpoint, body: &[u8], degraded: bool) -> Result<UpstreamTurn, HttpError> {
        prepare_turn(ClientRequest::parse(endpoint, body)?, degraded)
    }

    /// What the client asked for (with the model and tools) and the upstream body.
    fn prep(endpoint: Endpoint, body: Value, degraded: bool) -> (ClientAsk, Value) {
        let up = prepare(endpoint, body.to_string().as_bytes(), degraded)
            .unwrap_or_else(|e| panic!("{body}: {e}"));
        let ask = ClientAsk {
            endpoint: up.ask.endpoint,
            stream: up.ask.stream,
            logprobs: up.ask.logprobs,
            top_logprobs: up.ask.top_logprobs,
            include_usage: up.ask.include_usage,
            model: up.model,
            tools_requested: up.tools_requested,
        };
        (
            ask,
            serde_json::from_slice(&up.body).expect("upstream body is JSON"),
        )
    }

    /// The fields of [`UpstreamTurn`] other than the body, flat, for comparisons.
    #[derive(Debug, PartialEq, Eq)]
    struct ClientAsk {
        endpoint: Endpoint,
        stream: bool,
        logprobs: bool,
        top_logprobs: u32,
        include_usage: bool,
        model: String,
        tools_requested: bool,
    }

    fn refuse(endpoint: Endpoint, body: &str) -> HttpError {
        match prepare(endpoint, body.as_bytes(), false) {
            Ok(up) => panic!("{body} accepted as {up:?}"),
            Err(e) => e,
        }
    }

    #[test]
    fn one_parse_serves_both_sources_and_they_read_the_same_ask() {
        let chat = json!({"model": "builtin", "messages": [{"role": "user", "content": "hi"}],
                          "stream": true, "logprobs": true, "top_logprobs": 2,
                          "stream_options": {"include_usage": true}});
        let cmpl = json!({"model": "builtin", "prompt": "x", "logprobs": 3});
        for (endpoint, body) in [(Endpoint::Chat, chat), (Endpoint::Completion, cmpl)] {
            let req = ClientRequest::parse(endpoint, body.to_string().as_bytes()).expect("parses");
            let builtin = req
                .builtin_turn("builtin")
                .expect("the built-in source takes it");
            let up = prepare_turn(req, false).expect("the proxy takes it");
            assert_eq!(builtin.ask, up.ask, "{body}");
        }
    }

    #[test]
    fn chat_batch_request_is_streamed_upstream_with_logprobs() {
        let body = json!({
            "model": "meta-llama/Llama-3.1-8B-Instruct",
            "messages": [{"role": "user", "content": "hi"}],
            "temperature": 0.7,
            "seed": 42,
            "stop": ["\n\n"],
            "ignore_eos": true,
            "max_tokens": 64,
        });
        let (ask, up) = prep(Endpoint::Chat, body.clone(), false);
        assert_eq!(
            ask,
            ClientAsk {
                endpoint: Endpoint::Chat,
                stream: false,
                logprobs: false,
                top_logprobs: 0,
                include_usage: false,
                model: "meta-llama/Llama-3.1-8B-Instruct".into(),
                tools_requested: false,
            }
        );
        let mut expected = body;
        expected["stream"] = json!(true);
        expected["stream_options"] = json!({"include_usage": true});
        expected["logprobs"] = json!(true);
        expected["top_logprobs"] = json!(0);
        assert_eq!(up, expected);
    }

    #[test]
    fn chat_client_logprobs_and_usage_are_remembered() {
        let (ask, up) = prep(
            Endpoint::Chat,
            json!({"model": "m", "messages": [{"role": "user", "content": "x"}], "stream": true,
                   "logprobs": true, "top_logprobs": 3,
                   "stream_options": {"include_usage": true, "continuous_usage_stats": true}}),
            false,
        );
        assert!(ask.stream && ask.logprobs && ask.include_usage);
        assert_eq!(ask.top_logprobs, 3);
        assert_eq!(up["top_logprobs"], json!(3));
        assert_eq!(up["logprobs"], json!(true));
        assert_eq!(up["stream_options"], json!({"include_usage": true}));
    }

    #[test]
    fn nulls_count_as_absent() {
        let (ask, up) = prep(
            Endpoint::Chat,
            json!({"model": "m", "messages": [{"role": "user", "content": "x"}], "stream": null,
                   "n": null, "logprobs": null, "top_logprobs": null, "stream_options": null,
                   "tools": null}),
            false,
        );
        assert!(!ask.stream && !ask.logprobs && !ask.include_usage && !ask.tools_requested);
        assert_eq!(up["n"], Value::Null);
        assert_eq!(up["stream"], json!(true));
    }

    #[test]
    fn completions_logprobs_at_least_one_upstream() {
        let (ask, up) = prep(
            Endpoint::Completion,
            json!({"model": "m", "prompt": "Once upon", "max_tokens": 5}),
            false,
        );
        assert!(!ask.logprobs);
        assert_eq!(ask.top_logprobs, 0);
        assert_eq!(up["logprobs"], json!(1));
        assert_eq!(up["stream"], json!(true));
        assert!(up.get("top_logprobs").is_none());

        let (ask, up) = prep(
            Endpoint::Completion,
            json!({"model": "m", "prompt": "x", "logprobs": 0}),
            false,
        );
        assert!(ask.logprobs);
        assert_eq!(ask.top_logprobs, 0);
        assert_eq!(up["logprobs"], json!(1));

        let (ask, up) = prep(
            Endpoint::Completion,
            json!({"model": "m", "prompt": "x", "logprobs": 5, "echo": false}),
            false,
        );
        assert_eq!(ask.top_logprobs, 5);
        assert_eq!(up["logprobs"], json!(5));
        assert_eq!(up["echo"], json!(false));
    }

    #[test]
    fn completions_prompt_shapes() {
        for p in [
            json!("text"),
            json!(""),
            json!(["one prompt"]),
            json!([1, 2, 3]),
            json!([[1, 2, 3]]),
        ] {
            let (_, up) = prep(
                Endpoint::Completion,
                json!({"model": "m", "prompt": p}),
                false,
            );
            assert_eq!(up["prompt"], p, "prompt passes through unchanged");
        }
        let e = refuse(Endpoint::Completion, r#"{"model":"m","prompt":["a","b"]}"#);
        assert_eq!(e.code, Some(CODE_N_NOT_SUPPORTED));
        assert!(e.message.contains("a batch of 2 prompts"), "{}", e.message);
        let e = refuse(Endpoint::Completion, r#"{"model":"m","prompt":[[1],[2]]}"#);
        assert_eq!(e.code, Some(CODE_N_NOT_SUPPORTED));
        for bad in [
            r#"{"model":"m"}"#,
            r#"{"model":"m","prompt":null}"#,
            r#"{"model":"m","prompt":[]}"#,
            r#"{"model":"m","prompt":7}"#,
            r#"{"model":"m","prompt":[1,"a"]}"#,
            r#"{"model":"m","prompt":[-1]}"#,
            r#"{"model":"m","prompt":[{"a":1}]}"#,
        ] {
            let e = refuse(Endpoint::Completion, bad);
            assert_eq!(e.status, 400);
            assert!(e.message.contains("prompt"), "{bad}: {}", e.message);
        }
    }

    #[test]
    fn n_and_best_of() {
        for ok in [r#""n":1"#, r#""best_of":1"#, r#""n":null"#] {
            let body = format!(r#"{{"model":"m","prompt":"x",{ok}}}"#);
            prepare(Endpoint::Completion, body.as_bytes(), false).expect(ok);
        }
        let e = refuse(
            Endpoint::Chat,
            r#"{"model":"m","messages":[{"role":"user","content":"x"}],"n":2}"#,
        );
        assert_eq!(e.status, 400);
        assert_eq!(e.code, Some(CODE_N_NOT_SUPPORTED));
        assert_eq!(
            e.message,
            "n = 2 is not supported: haltd governs one choice per stream so that the halt budget holds per connection; send separate requests instead"
        );
        let e = refuse(Endpoint::Completion, r#"{"model":"m","prompt":"x","n":0}"#);
        assert_eq!(e.code, Some(CODE_N_NOT_SUPPORTED));
        let e = refuse(
            Endpoint::Completion,
            r#"{"model":"m","prompt":"x","best_of":3}"#,
        );
        assert_eq!(e.code, Some(CODE_N_NOT_SUPPORTED));
        assert!(e.message.starts_with("best_of = 3"));
        let e = refuse(
            Endpoint::Completion,
            r#"{"model":"m","prompt":"x","best_of":0}"#,
        );
        assert_eq!(e.code, None);
        let e = refuse(
            Endpoint::Completion,
            r#"{"model":"m","prompt":"x","n":"2"}"#,
        );
        assert_eq!(e.message, "n must be a non-negative integer");
        let e = refuse(
            Endpoint::Completion,
            r#"{"model":"m","prompt":"x","n":1.5}"#,
        );
        assert_eq!(e.message, "n must be a non-negative integer");
    }

    /// Each case is refused with 400, `invalid_request_error` and exactly this message.
    fn assert_refusals(cases: Vec<(Endpoint, String, &str)>) {
        for (ep, body, msg) in cases {
            let e = refuse(ep, &body);
            assert_eq!(e.status, 400, "{body}");
            assert_eq!(e.kind, "invalid_request_error");
            assert_eq!(e.message, msg, "{body}");
        }
    }

    #[test]
    fn type_errors_name_the_field() {
        let cases: Vec<(Endpoint, String, &str)> = vec![
            (
                Endpoint::Chat,
                "[]".into(),
                "request body must be a JSON object",
            ),
            (
                Endpoint::Chat,
                "\"x\"".into(),
                "request body must be a JSON object",
            ),
            (
                Endpoint::Chat,
                r#"{"messages":[{}]}"#.into(),
                "model is required: the upstream serves requests by model name",
            ),
            (
                Endpoint::Chat,
                r#"{"model":1,"messages":[{}]}"#.into(),
                "model must be a string",
            ),
            (
                Endpoint::Chat,
                r#"{"model":"","messages":[{}]}"#.into(),
                "model must not be empty",
            ),
            (
                Endpoint::Chat,
                r#"{"model":"m"}"#.into(),
                "messages is required",
            ),
            (
                Endpoint::Chat,
                r#"{"model":"m","messages":[]}"#.into(),
                "messages must not be empty",
            ),
            (
                Endpoint::Chat,
                r#"{"model":"m","messages":"hi"}"#.into(),
                "messages must be an array of message objects",
            ),
            (
                Endpoint::Chat,
                r#"{"model":"m","messages":[{},"x"]}"#.into(),
                "messages[1] must be an object",
            ),
        ];
        assert_refusals(cases);
    }

    #[test]
    fn option_type_errors_name_the_field() {
        let chat = |extra: &str| {
            format!(r#"{{"model":"m","messages":[{{"role":"user","content":"x"}}]{extra}}}"#)
        };
        let cases: Vec<(Endpoint, String, &str)> = vec![
            (
                Endpoint::Chat,
                chat(r#","stream":"yes""#),
                "stream must be true or false",
            ),
            (
                Endpoint::Chat,
                chat(r#","logprobs":1"#),
                "logprobs must be true or false",
            ),
            (
                Endpoint::Chat,
                chat(r#","logprobs":true,"top_logprobs":21"#),
                "top_logprobs must be at most 20",
            ),
            (
                Endpoint::Chat,
                chat(r#","logprobs":true,"top_logprobs":-1"#),
                "top_logprobs must be an integer from 0 to 20",
            ),
            (
                Endpoint::Chat,
                chat(r#","logprobs":true,"top_logprobs":"3""#),
                "top_logprobs must be an integer from 0 to 20",
            ),
            (
                Endpoint::Chat,
                chat(r#","top_logprobs":2"#),
                "top_logprobs requires logprobs: true",
            ),
            (
                Endpoint::Chat,
                chat(r#","stream_options":true"#),
                "stream_options must be an object",
            ),
            (
                Endpoint::Chat,
                chat(r#","stream_options":{"include_usage":"y"}"#),
                "stream_options.include_usage must be true or false",
            ),
            (
                Endpoint::Completion,
                r#"{"model":"m","prompt":"x","logprobs":6}"#.into(),
                "logprobs must be an integer from 0 to 5 for completions",
            ),
            (
                Endpoint::Completion,
                r#"{"model":"m","prompt":"x","logprobs":true}"#.into(),
                "logprobs must be an integer from 0 to 5 for completions",
            ),
        ];
        assert_refusals(cases);
    }

    #[test]
    fn invalid_json_carries_serdes_message() {
        let e = refuse(Endpoint::Chat, r#"{"model":"m","#);
        assert_eq!(e.status, 400);
        assert!(
            e.message.starts_with("invalid JSON body: "),
            "{}",
            e.message
        );
        assert!(e.message.contains("line 1"), "{}", e.message);
        let e = refuse(Endpoint::Chat, "");
        assert!(e.message.starts_with("invalid JSON body: "));
    }

    #[test]
    fn tools_removed_only_when_degraded() {
        let body = json!({
            "model": "m",
            "messages": [{"role": "user", "content": "weather?"}],
            "tools": [{"type": "function", "function": {"name": "get_weather", "parameters": {}}}],
            "tool_choice": "auto",
            "parallel_tool_calls": false,
            "functions": [{"name": "f"}],
            "function_call": "auto",
        });
        let (ask, up) = prep(Endpoint::Chat, body.clone(), false);
        assert!(ask.tools_requested);
        for f in TOOL_FIELDS {
            assert_eq!(up[f], body[f], "{f} passes through in full mode");
        }
        let (ask, up) = prep(Endpoint::Chat, body, true);
        assert!(ask.tools_requested);
        for f in TOOL_FIELDS {
            assert!(up.get(f).is_none(), "{f} removed in degraded mode");
        }
        assert_eq!(up["messages"][0]["content"], json!("weather?"));

        let (ask, _) = prep(
            Endpoint::Chat,
            json!({"model": "m", "messages": [{}], "tools": []}),
            true,
        );
        assert!(!ask.tools_requested, "an empty tool list requests nothing");
        let (ask, up) = prep(
            Endpoint::Chat,
            json!({"model": "m", "messages": [{}], "tool_choice": "none"}),
            true,
        );
        assert!(ask.tools_requested);
        assert!(up.get("tool_choice").is_none());
    }

    fn url() -> UpstreamUrl {
        UpstreamUrl::parse("http://127.0.0.1:8000/v1").expect("url")
    }

    #[test]
    fn http_request_post() {
        let mut out = Vec::new();
        write_http_request(
            &mut out,
            &url(),
            "POST",
            CHAT_PATH,
            Some("Bearer sk-abc"),
            Some(br#"{"a":1}"#),
        );
        let text = String::from_utf8(out.clone()).expect("ascii");
        assert_eq!(
            text,
            format!(
                "POST /v1/chat/completions HTTP/1.1\r\nhost: 127.0.0.1:8000\r\nuser-agent: haltd/{}\r\naccept: text/event-stream\r\naccept-encoding: identity\r\nauthorization: Bearer sk-abc\r\ncontent-type: application/json\r\ncontent-length: 7\r\n\r\n{{\"a\":1}}",
                env!("CARGO_PKG_VERSION")
            )
        );
        // The head parses as a request with exactly these headers.
        let mut headers = [httparse::EMPTY_HEADER; 16];
        let mut req = httparse::Request::new(&mut headers);
        let n = match req.parse(&out) {
            Ok(httparse::Status::Complete(n)) => n,
            other => panic!("{other:?}"),
        };
        assert_eq!(&out[n..], br#"{"a":1}"#);
    }

    #[test]
    fn http_request_get_with_prefix() {
        let mut out = Vec::new();
        let u = UpstreamUrl::parse("http://[::1]/ollama/v1").expect("url");
        write_http_request(&mut out, &u, "GET", MODELS_PATH, None, None);
        let text = String::from_utf8(out).expect("ascii");
        assert!(
            text.starts_with("GET /ollama/v1/models HTTP/1.1\r\nhost: [::1]\r\n"),
            "{text}"
        );
        assert!(text.contains("accept: application/json\r\n"));
        assert!(!text.contains("authorization"));
        assert!(!text.contains("content-length"));
        // Keep-alive: the upstream pool reuses the connection.
        assert!(!text.contains("connection:"));
        assert!(text.ends_with("accept-encoding: identity\r\n\r\n"));
    }

    #[test]
    fn http_request_never_injects_headers() {
        for bad in [
            "Bearer x\r\nx-injected: 1",
            "Bearer x\nx-injected: 1",
            "Bearer x\r",
            "Bearer \0x",
            "Bearer \u{7f}",
            "Bearer clé",
        ] {
            assert!(!valid_header_value(bad), "{bad:?}");
            let mut out = Vec::new();
            write_http_request(&mut out, &url(), "POST", CHAT_PATH, Some(bad), Some(b"{}"));
            let text = String::from_utf8_lossy(&out);
            assert!(!text.contains("injected"), "{text}");
            assert!(!text.contains("authorization"), "{text}");
        }
        let mut out = Vec::new();
        write_http_request_with(
            &mut out,
            &url(),
            ("POST", CHAT_PATH),
            None,
            &[
                ("x-request-id", "r-1"),
                ("traceparent", "bad\r\ninjected: 1"),
            ],
            Some(b"{}"),
        );
        let text = String::from_utf8_lossy(&out);
        assert!(text.contains("\r\nx-request-id: r-1\r\n"), "{text}");
        assert!(!text.contains("injected"), "{text}");
        assert!(valid_header_value("Bearer sk-proj-AZaz09_-.~+/="));
        assert!(valid_header_value("Basic\tabc"));
    }

    proptest::proptest! {
        #[test]
        fn prepare_never_panics(body in proptest::collection::vec(proptest::num::u8::ANY, 0..256)) {
            let _ = prepare(Endpoint::Chat, &body, false);
            let _ = prepare(Endpoint::Completion, &body, true);
        }

        #[test]
        fn upstream_body_always_streams_with_logprobs(
            stream in proptest::option::of(proptest::bool::ANY),
            logprobs in proptest::option::of(proptest::bool::ANY),
            top in 0u32..=20,
            clp in proptest::option::of(0u32..=5),
            degraded in proptest::bool::ANY,
        ) {
            let mut chat = json!({"model": "m", "messages": [{"role": "user", "content": "x"}]});
            if let Some(s) = stream { chat["stream"] = json!(s); }
            if let Some(l) = logprobs { chat["logprobs"] = json!(l); }
            if logprobs == Some(true) { chat["top_logprobs"] = json!(top); }
            let (ask, up) = prep(Endpoint::Chat, chat, degraded);
            proptest::prop_assert_eq!(ask.stream, stream.unwrap_or(false));
            proptest::prop_assert_eq!(&up["stream"], &json!(true));
            proptest::prop_assert_eq!(&up["logprobs"], &json!(true));
            proptest::prop_assert_eq!(&up["stream_options"]["include_usage"], &json!(true));

            let mut cmpl = json!({"model": "m", "prompt": "x"});
            if let Some(l) = clp { cmpl["logprobs"] = json!(l); }
            let (ask, up) = prep(Endpoint::Completion, cmpl, degraded);
            proptest::prop_assert_eq!(ask.logprobs, clp.is_some());
            proptest::prop_assert_eq!(&up["logprobs"], &json!(clp.unwrap_or(0).max(1)));
        }
    }
}
