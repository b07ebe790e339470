//! HTTP/1.1 on the data plane: request heads parsed with `httparse`, response heads written
//! into the connection's own buffer.
//!
//! A connection is kept for the next request only after a turn that ended normally, and only
//! when the client did not say `connection: close` (HTTP/1.1 connections persist unless one
//! side says otherwise, RFC 9112 §9.3; [`RequestHead::keep_alive`]); every other response says
//! `connection: close` ([`Persist`]). A kept streaming response is sent
//! with chunked framing, one chunk per frame ([`chunk_in_place`]), so that its end is not the
//! end of the connection (docs/wire-format.md "Persistent connections").

use std::io::Write as _;

use crate::{
    credential::Credential,
    wire::{endpoint::Endpoint, secret::Secret, stream_id::StreamId},
};

/// Most headers a request may carry.
pub const MAX_HEADERS: usize = 64;
/// Largest request head (request line + headers).
pub const MAX_HEAD_BYTES: usize = 16 * 1024;

/// A request whose head has been parsed.
#[derive(Debug, Clone)]
pub struct RequestHead {
    pub method: String,
    pub path: String,
    /// Bytes of the head, including the blank line; the body starts here.
    pub head_len: usize,
    pub content_length: usize,
    pub expect_continue: bool,
    /// The client lets haltd keep the connection: no `connection` header with the `close`
    /// option (HTTP/1.1's default).
    pub keep_alive: bool,
    /// The `Authorization` value, passed through to an upstream and never logged (its
    /// `Debug` is redacted).
    pub authorization: Option<Secret>,
    /// The value of the header `--identity-header` names, if configured and present.
    pub identity: Option<Secret>,
    /// The bearer token of `Authorization` or `x-api-key` (`credential.rs`).
    pub bearer: Option<Secret>,
    /// The client's `x-request-id`, if one well-formed one came (`crate::wire::trace`); a
    /// missing or malformed one is replaced by a generated id.
    pub request_id: Option<String>,
    /// The client's `traceparent`, if one came in the W3C format: passed to the upstream.
    pub traceparent: Option<String>,
    /// The client's `x-haltd-conversation-id` (TokenCircuit's conversation identity,
    /// `circuit::store`): 1 to 128 visible ASCII bytes.
    pub conversation_id: Option<String>,
    /// The request's `anthropic-version` (the Anthropic SDKs send it on every request).
    /// Accepted with any value; it picks the Anthropic form where a path has two, and goes
    /// upstream with a passed-through Messages request (`--upstream-surfaces`), as does
    /// `anthropic-beta`.
    pub anthropic_version: Option<String>,
    /// The request's `anthropic-beta`.
    pub anthropic_beta: Option<String>,
}

impl RequestHead {
    /// What names the request's identity (`credential.rs`): the `--identity-header` value,
    /// else the bearer token, else nothing.
    pub fn credential(&self) -> Credential<'_> {
        Credential::of(
            self.identity.as_ref().map(Secret::as_str),
            self.bearer.as_ref().map(Secret::as_str),
        )
    }

    /// The headers a Messages request passed through to its backend carries as they came:
    /// the client's `x-api-key` (when its credential came that way, not as `Authorization`),
    /// `anthropic-version` and `anthropic-beta`.
    pub fn messages_headers(&self) -> Vec<(&'static str, String)> {
        let key = match (&self.authorization, &self.bearer) {
            (None, Some(k)) => Some(k.as_str().to_owned()),
            _ => None,
        };
        [
            ("x-api-key", key),
            ("anthropic-version", self.anthropic_version.clone()),
            ("anthropic-beta", self.anthropic_beta.clone()),
        ]
        .into_iter()
        .filter_map(|(n, v)| Some((n, v?)))
        .collect()
    }
}

/// A request the data plane refuses, with the status it answers.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{status} {message}")]
pub struct HttpError {
    pub status: u16,
    /// OpenAI-style error type (`invalid_request_error`, ...).
    pub kind: &'static str,
    pub code: Option<&'static str>,
    pub message: String,
    /// For 405: the methods the path accepts (the `allow` header).
    pub allow: Option<&'static str>,
    /// For a 503 worth retrying soon: the `retry-after` header, in seconds.
    pub retry_after: Option<&'static str>,
    /// `x-should-retry: false`: the same request gets the same answer (TokenCircuit's 409),
    /// and the OpenAI and Anthropic SDKs, which retry a 409 by default, read this header.
    pub no_retry: bool,
    /// An extra member of the error object (TokenCircuit's `tool_circuit` artifact).
    pub detail: Option<(&'static str, Box<serde_json::Value>)>,
}

impl HttpError {
    pub fn new(status: u16, kind: &'static str, message: impl Into<String>) -> Self {
        HttpError {
            status,
            kind,
            code: None,
            message: message.into(),
            allow: None,
            retry_after: None,
            no_retry: false,
            detail: None,
        }
    }
    /// 405 for `method` on a path that only takes `allow`.
    pub fn method_not_allowed(method: &str, allow: &'static str) -> Self {
        let mut e = Self::new(
            405,
            "invalid_request_error",
            format!(
                "{} is not allowed here; use {allow}",
                method.chars().take(32).collect::<String>()
            ),
        );
        e.allow = Some(allow);
        e
    }
    pub fn bad_request(message: impl Into<String>) -> Self {
        Self::new(400, "invalid_request_error", message)
    }
    pub fn with_code(mut self, code: &'static str) -> Self {
        self.code = Some(code);
        self
    }
    /// Says `retry-after: SECONDS`.
    pub fn with_retry_after(mut self, seconds: &'static str) -> Self {
        self.retry_after = Some(seconds);
        self
    }

    /// Says `x-should-retry: false` (see [`HttpError::no_retry`]).
    pub fn without_retry(mut self) -> Self {
        self.no_retry = true;
        self
    }

    /// Adds the member `name` to the error object.
    pub fn with_detail(mut self, name: &'static str, value: serde_json::Value) -> Self {
        self.detail = Some((name, Box::new(value)));
        self
    }
}

/// `seconds` as a `retry-after` value: 1 to 60 (a minute's window is the longest wait haltd
/// asks for; more is said as 60).
pub fn retry_after_seconds(seconds: u64) -> &'static str {
    const SECONDS: [&str; 60] = [
        "1", "2", "3", "4", "5", "6", "7", "8", "9", "10", "11", "12", "13", "14", "15", "16",
        "17", "18", "19", "20", "21", "22", "23", "24", "25", "26", "27", "28", "29", "30", "31",
        "32", "33", "34", "35", "36", "37", "38", "39", "40", "41", "42", "43", "44", "45", "46",
        "47", "48", "49", "50", "51", "52", "53", "54", "55", "56", "57", "58", "59", "60",
    ];
    let i = usize::try_from(seconds.clamp(1, 60) - 1).unwrap_or(59);
    SECONDS[i]
}

/// The path (without its query) of a request whose request line arrived whole, however the
/// rest of its head turns out: which surface a refused head (two credentials, a body too
/// large) is answered for, in that surface's error schema. `None` without a whole line, or
/// for a line that is not `METHOD SP /path SP VERSION`.
pub fn request_path(buf: &[u8]) -> Option<&str> {
    let line = &buf[..buf.iter().position(|&b| b == b'\n')?];
    let line = line.strip_suffix(b"\r").unwrap_or(line);
    let mut parts = line.split(|&b| b == b' ');
    let (_method, target, _version) = (parts.next()?, parts.next()?, parts.next()?);
    if parts.next().is_some() || !target.starts_with(b"/") {
        return None;
    }
    let path = target.split(|&b| b == b'?').next()?;
    std::str::from_utf8(path).ok()
}

/// Parses the head of a request from what has arrived so far.
///
/// `Ok(None)` means more bytes are needed. Errors carry the status to answer.
pub fn parse_head(buf: &[u8], max_body: usize) -> Result<Option<RequestHead>, HttpError> {
    parse_head_with(buf, max_body, None)
}

/// [`parse_head`], also keeping the value of the header named `identity_header`
/// (`--identity-header`; at most one such header, visible ASCII).
pub fn parse_head_with(
    buf: &[u8],
    max_body: usize,
    identity_header: Option<&str>,
) -> Result<Option<RequestHead>, HttpError> {
    let mut headers = [httparse::EMPTY_HEADER; MAX_HEADERS];
    let mut req = httparse::Request::new(&mut headers);
    let head_len = match req.parse(buf) {
        Ok(httparse::Status::Complete(n)) => n,
        Ok(httparse::Status::Partial) => {
            if buf.len() > MAX_HEAD_BYTES {
                return Err(HttpError::new(
                    431,
                    "invalid_request_error",
                    "request head larger than 16 KiB",
                ));
            }
            return Ok(None);
        }
        Err(httparse::Error::TooManyHeaders) => {
            return Err(HttpError::new(
                431,
                "invalid_request_error",
                format!("more than {MAX_HEADERS} headers"),
            ))
        }
        Err(e) => {
            return Err(HttpError::bad_request(format!(
                "malformed HTTP request: {e}"
            )))
        }
    };
    if head_len > MAX_HEAD_BYTES {
        return Err(HttpError::new(
            431,
            "invalid_request_error",
            "request head larger than 16 KiB",
        ));
    }
    let method = req.method.unwrap_or_default().to_owned();
    let path = req.path.unwrap_or_default().to_owned();
    if req.version != Some(1) {
        return Err(HttpError::new(
            505,
            "invalid_request_error",
            "only HTTP/1.1 is served",
        ));
    }
    let fields = HeadFields::read(req.headers)?;
    let bearer = crate::credential::bearer(
        fields.authorization.as_ref().map(Secret::as_str),
        fields.api_key.as_ref().map(Secret::as_str),
    )
    .map_err(|e| HttpError::bad_request(e.to_string()))?
    .map(Secret::new);
    let identity = identity_header
        .map(|name| identity_value(req.headers, name))
        .transpose()?
        .flatten();
    let (expect_continue, authorization) = (fields.expect_continue, fields.authorization);
    // HTTP/1.1 (the only version served) persists unless the client says `close`; an
    // explicit `keep-alive` option changes nothing.
    let keep_alive = !fields.close;
    let content_length = fields.content_length.unwrap_or(0);
    if content_length > max_body {
        return Err(HttpError::new(
            413,
            "invalid_request_error",
            format!("request body of {content_length} bytes exceeds the limit of {max_body} bytes"),
        ));
    }
    Ok(Some(RequestHead {
        method,
        path,
        head_len,
        content_length,
        expect_continue,
        keep_alive,
        authorization,
        identity,
        bearer,
        request_id: fields.request_id.flatten(),
        traceparent: fields.traceparent.flatten(),
        conversation_id: fields.conversation_id,
        anthropic_version: fields.anthropic_version,
        anthropic_beta: fields.anthropic_beta,
    }))
}

/// The value of the one header called `name`, if any.
fn identity_value(
    headers: &[httparse::Header<'_>],
    name: &str,
) -> Result<Option<Secret>, HttpError> {
    let mut found = None;
    for h in headers.iter().filter(|h| h.name.eq_ignore_ascii_case(name)) {
        if found.is_some() {
            return Err(HttpError::bad_request(format!(
                "more than one {name} header"
            )));
        }
        let v = std::str::from_utf8(h.value)
            .ok()
            .filter(|v| {
                v.bytes()
                    .all(|b| b == b' ' || b == b'\t' || b.is_ascii_graphic())
            })
            .ok_or_else(|| {
                HttpError::bad_request(format!(
                    "the {name} header holds bytes other than visible ASCII"
                ))
            })?;
        found = Some(Secret::new(v.trim().to_owned()));
    }
    Ok(found)
}

/// The header fields haltd acts on.
#[derive(Default)]
struct HeadFields {
    content_length: Option<usize>,
    expect_continue: bool,
    /// The `connection` header (any of them) has the `close` option.
    close: bool,
    authorization: Option<Secret>,
    /// `x-api-key`: the same credential as `Authorization: Bearer` (`credential.rs`).
    api_key: Option<Secret>,
    /// `x-request-id` and `traceparent`: `Some(None)` once one was seen that is not accepted
    /// (malformed, or a second one), which stays not accepted.
    request_id: Option<Option<String>>,
    traceparent: Option<Option<String>>,
    conversation_id: Option<String>,
    anthropic_version: Option<String>,
    anthropic_beta: Option<String>,
}

/// A correlation header: the first well-formed one is kept, a second one voids it.
fn correlate(slot: &mut Option<Option<String>>, value: Option<String>) {
    *slot = match slot {
        None => Some(value),
        Some(_) => Some(None),
    };
}

impl HeadFields {
    /// `x-haltd-conversation-id`: it names whose backoff clock a turn is judged by, so one
    /// that cannot be used is refused, not ignored.
    fn conversation(&mut self, value: &[u8]) -> Result<(), HttpError> {
        if self.conversation_id.is_some() {
            return Err(HttpError::bad_request(
                "more than one x-haltd-conversation-id header",
            ));
        }
        let v = crate::wire::trace::accept_request_id(value.trim_ascii()).ok_or_else(|| {
            HttpError::bad_request("x-haltd-conversation-id must be 1 to 128 visible ASCII bytes")
        })?;
        self.conversation_id = Some(v);
        Ok(())
    }

    /// `authorization` and `x-api-key`, kept for the credential rule (`credential.rs`);
    /// whether `h` was one of them.
    fn credential_header(&mut self, h: &httparse::Header<'_>) -> Result<bool, HttpError> {
        if h.name.eq_ignore_ascii_case("authorization") {
            if self.authorization.is_some() {
                return Err(HttpError::bad_request("more than one authorization header"));
            }
            // Visible ASCII and spaces only: the value is copied into the upstream request.
            let v = std::str::from_utf8(h.value)
                .ok()
                .filter(|v| v.bytes().all(|b| b == b' ' || b.is_ascii_graphic()))
                .ok_or_else(|| {
                    HttpError::bad_request(
                        "the authorization header holds bytes other than visible ASCII",
                    )
                })?;
            self.authorization = Some(Secret::new(v.trim().to_owned()));
            return Ok(true);
        }
        if h.name.eq_ignore_ascii_case("x-api-key") {
            if self.api_key.is_some() {
                return Err(HttpError::bad_request("more than one x-api-key header"));
            }
            let v = std::str::from_utf8(h.value).map_err(|_| {
                HttpError::bad_request("the x-api-key header holds bytes other than ASCII")
            })?;
            self.api_key = Some(Secret::new(v.trim().to_owned()));
            return Ok(true);
        }
        Ok(false)
    }

    /// Reads them from a parsed head, refusing what haltd does not serve.
    fn read(headers: &[httparse::Header<'_>]) -> Result<Self, HttpError> {
        let mut f = HeadFields::default();
        for h in headers {
            if f.credential_header(h)? {
                continue;
            }
            if h.name.eq_ignore_ascii_case("x-request-id") {
                correlate(
                    &mut f.request_id,
                    crate::wire::trace::accept_request_id(h.value.trim_ascii()),
                );
                continue;
            }
            if h.name
                .eq_ignore_ascii_case(crate::circuit::store::CONVERSATION_HEADER)
            {
                f.conversation(h.value)?;
                continue;
            }
            if h.name.eq_ignore_ascii_case("anthropic-version") {
                f.anthropic_version = Some(String::from_utf8_lossy(h.value).trim().to_owned());
                continue;
            }
            if h.name.eq_ignore_ascii_case("anthropic-beta") {
                // Several values are one comma-separated list.
                let v = String::from_utf8_lossy(h.value).trim().to_owned();
                f.anthropic_beta = Some(match f.anthropic_beta.take() {
                    Some(before) => format!("{before},{v}"),
                    None => v,
                });
                continue;
            }
            if h.name.eq_ignore_ascii_case("traceparent") {
                correlate(
                    &mut f.traceparent,
                    crate::wire::trace::accept_traceparent(h.value.trim_ascii()),
                );
                continue;
            }
            if h.name.eq_ignore_ascii_case("content-length") {
                let v = std::str::from_utf8(h.value)
                    .ok()
                    .map(str::trim)
                    .filter(|v| !v.is_empty() && v.bytes().all(|b| b.is_ascii_digit()))
                    .and_then(|v| v.parse::<usize>().ok())
                    .ok_or_else(|| {
                        HttpError::bad_request("content-length is not a decimal number")
                    })?;
                if f.content_length.is_some_and(|prev| prev != v) {
                    return Err(HttpError::bad_request("conflicting content-length headers"));
                }
                f.content_length = Some(v);
            } else if h.name.eq_ignore_ascii_case("transfer-encoding") {
                return Err(HttpError::new(
                    411,
                    "invalid_request_error",
                    "transfer-encoding request bodies are not accepted; send content-length",
                ));
            } else if h.name.eq_ignore_ascii_case("connection") {
                for option in h.value.split(|&b| b == b',') {
                    let option = option.trim_ascii();
                    f.close |= option.eq_ignore_ascii_case(b"close");
                }
            } else if h.name.eq_ignore_ascii_case("expect") {
                if h.value.eq_ignore_ascii_case(b"100-continue") {
                    f.expect_continue = true;
                } else {
                    return Err(HttpError::new(
                        417,
                        "invalid_request_error",
                        "unsupported expectation",
                    ));
                }
            }
        }
        Ok(f)
    }
}

/// Reason phrase of the statuses haltd sends.
pub fn reason(status: u16) -> &'static str {
    match status {
        100 => "Continue",
        200 => "OK",
        400 => "Bad Request",
        404 => "Not Found",
        405 => "Method Not Allowed",
        408 => "Request Timeout",
        411 => "Length Required",
        413 => "Content Too Large",
        415 => "Unsupported Media Type",
        417 => "Expectation Failed",
        401 => "Unauthorized",
        403 => "Forbidden",
        409 => "Conflict",
        422 => "Unprocessable Content",
        429 => "Too Many Requests",
        502 => "Bad Gateway",
        504 => "Gateway Timeout",
        431 => "Request Header Fields Too Large",
        500 => "Internal Server Error",
        503 => "Service Unavailable",
        505 => "HTTP Version Not Supported",
        _ => "Unknown",
    }
}

/// What a response says about its connection.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Persist {
    /// `connection: close`: the connection closes after this response (without a
    /// `content-length`, the body runs until then).
    Close,
    /// `connection: keep-alive`: the next request may follow on this connection. A response
    /// without a `content-length` is chunked ([`chunk_in_place`]).
    KeepAlive,
}

/// Writes a response head that closes the connection. `content_length: None` means the body
/// runs until close (SSE).
pub fn write_head(
    out: &mut Vec<u8>,
    status: u16,
    content_type: &str,
    content_length: Option<usize>,
    stream_id: Option<StreamId>,
    extra: &[(&str, &str)],
) {
    write_head_persist(
        out,
        status,
        content_type,
        content_length,
        stream_id,
        extra,
        Persist::Close,
    );
}

/// [`write_head`] saying `persist`.
pub fn write_head_persist(
    out: &mut Vec<u8>,
    status: u16,
    content_type: &str,
    content_length: Option<usize>,
    stream_id: Option<StreamId>,
    extra: &[(&str, &str)],
    persist: Persist,
) {
    // Writes into a Vec cannot fail.
    let _ = write!(out, "HTTP/1.1 {status} {}\r\n", reason(status));
    write_fields(out, content_type, content_length, stream_id, extra, persist);
}

/// The header fields and blank line of a response that closes the connection, after a
/// status line written by the caller.
pub fn write_head_fields(
    out: &mut Vec<u8>,
    content_type: &str,
    content_length: Option<usize>,
    stream_id: Option<StreamId>,
    extra: &[(&str, &str)],
) {
    write_fields(
        out,
        content_type,
        content_length,
        stream_id,
        extra,
        Persist::Close,
    );
}

fn write_fields(
    out: &mut Vec<u8>,
    content_type: &str,
    content_length: Option<usize>,
    stream_id: Option<StreamId>,
    extra: &[(&str, &str)],
    persist: Persist,
) {
    let _ = write!(out, "content-type: {content_type}\r\n");
    if let Some(n) = content_length {
        let _ = write!(out, "content-length: {n}\r\n");
    } else {
        out.extend_from_slice(b"cache-control: no-cache\r\n");
    }
    if let Some(id) = stream_id {
        let _ = write!(out, "x-haltd-stream-id: {id}\r\n");
    }
    for (k, v) in extra {
        let _ = write!(out, "{k}: {v}\r\n");
    }
    match (persist, content_length) {
        (Persist::Close, _) => out.extend_from_slice(b"connection: close\r\n\r\n"),
        (Persist::KeepAlive, Some(_)) => out.extend_from_slice(b"connection: keep-alive\r\n\r\n"),
        (Persist::KeepAlive, None) => {
            out.extend_from_slice(b"transfer-encoding: chunked\r\nconnection: keep-alive\r\n\r\n")
        }
    }
}

/// The last chunk of a chunked body (no trailers).
pub const LAST_CHUNK: &[u8] = b"0\r\n\r\n";

/// Hex digits of `n` (at least one).
const fn hex_digits(n: u64) -> u32 {
    if n == 0 {
        1
    } else {
        (64 - n.leading_zeros()).div_ceil(4)
    }
}

/// What chunked framing adds to a payload of at most `max_payload` bytes: the size in hex and
/// two CRLFs. A frame of a chunked stream is at most its payload's bound plus this.
pub const fn chunk_overhead(max_payload: u32) -> u32 {
    hex_digits(max_payload as u64) + 4
}

/// Makes `out[start..]` one chunk of a chunked body: its size in hex and CRLF before it, CRLF
/// after it. Moves the payload within the buffer; allocates only if the buffer must grow.
pub fn chunk_in_place(out: &mut Vec<u8>, start: usize) {
    let len = out.len() - start;
    let digits = hex_digits(len as u64) as usize;
    let size_line = digits + 2;
    out.reserve(size_line + 2);
    out.resize(out.len() + size_line, 0);
    out.copy_within(start..start + len, start + size_line);
    for (i, b) in out[start..start + digits].iter_mut().enumerate() {
        let nibble = (len >> (4 * (digits - 1 - i))) & 0xf;
        *b = b"0123456789abcdef"[nibble];
    }
    out[start + digits..start + size_line].copy_from_slice(b"\r\n");
    out.extend_from_slice(b"\r\n");
}

/// A whole JSON error response in the error shape of `schema`, the surface the request came
/// in on (OpenAI's for chat and completions, Anthropic's for Messages).
/// `request_id` is echoed as `x-request-id`.
pub fn write_error_response(
    out: &mut Vec<u8>,
    err: &HttpError,
    stream_id: Option<StreamId>,
    request_id: Option<&str>,
    schema: Endpoint,
) {
    let body = match schema {
        Endpoint::Messages => {
            // Anthropic's shape: `{"type":"error","error":{type, message}}`, with haltd's
            // code and detail inside the error object.
            let mut body = serde_json::json!({"type": "error", "error": {
                "type": crate::wire::messages::terminal::error_type(err.status),
                "message": err.message,
            }});
            if let Some(code) = err.code {
                body["error"]["code"] = code.into();
            }
            if let Some((name, value)) = &err.detail {
                body["error"][*name] = (**value).clone();
            }
            body
        }
        Endpoint::Chat | Endpoint::Completion | Endpoint::Responses => {
            let mut body = serde_json::json!({
                "error": {
                    "message": err.message,
                    "type": err.kind,
                    "param": null,
                    "code": err.code,
                }
            });
            if let Some((name, value)) = &err.detail {
                body["error"][*name] = (**value).clone();
            }
            body
        }
    };
    let body = body.to_string();
    let extra = [
        ("allow", err.allow),
        ("retry-after", err.retry_after),
        ("x-should-retry", err.no_retry.then_some("false")),
        ("x-request-id", request_id),
    ];
    let mut headers = [("", ""); 4];
    let mut n = 0;
    for (name, value) in extra {
        if let Some(value) = value {
            headers[n] = (name, value);
            n += 1;
        }
    }
    write_head(
        out,
        err.status,
        "application/json",
        Some(body.len()),
        stream_id,
        &headers[..n],
    );
    out.extend_from_slice(body.as_bytes());
}

#[cfg(test)]
mod tests;
