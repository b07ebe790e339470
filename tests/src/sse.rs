//! An SSE client for haltd's OpenAI-style streams, parsing per the HTML Living Standard
//! ("Server-sent events", event stream interpretation): lines end in CRLF, LF or CR; a blank
//! line dispatches the event; `data:` lines are joined with `\n`; lines starting with `:` are
//! comments; one space after the colon is dropped. Events are handed to a callback as they
//! arrive, so a test can act (trip the stream) after k tokens.

use std::{
    io::Read,
    time::{Duration, Instant},
};

use anyhow::{Context, Result};
use serde_json::Value;

use crate::http::{agent, header};

/// What an event's `data` is, for haltd's OpenAI-style streams.
#[derive(Debug, Clone, PartialEq)]
pub enum EventKind {
    /// A chunk with non-empty `choices[0].delta.content` (chat) or `choices[0].text`
    /// (completions) and no `finish_reason`.
    Token(String),
    /// A chat chunk with non-empty `choices[0].delta.reasoning_content` and no content or
    /// `finish_reason`: a reasoning token frame.
    Reasoning(String),
    /// A chunk with a non-null `finish_reason`; `content` is whatever content it carried.
    Final {
        finish_reason: String,
        content: Option<String>,
    },
    /// A top-level `error` object (haltd's typed halt event, or another error).
    Error(Value),
    /// `[DONE]`.
    Done,
    /// Valid JSON of another shape (e.g. a role-only first chunk).
    Other(Value),
    /// Not JSON and not `[DONE]`.
    Malformed,
}

/// One dispatched event.
#[derive(Debug, Clone)]
pub struct SseEvent {
    /// The `event:` field, if any.
    pub event: Option<String>,
    pub data: String,
    pub kind: EventKind,
    /// When the client parsed it.
    pub at: Instant,
}

/// Incremental SSE parser: feed it bytes, get complete events back.
#[derive(Debug, Default)]
pub struct SseParser {
    line: Vec<u8>,
    /// The previous byte was a CR, so an LF right after it ends nothing.
    after_cr: bool,
    data: String,
    has_data: bool,
    event: Option<String>,
    /// Comment lines seen (e.g. `: haltd-halt ...`).
    pub comments: Vec<String>,
    started: bool,
}

impl SseParser {
    pub fn feed(&mut self, bytes: &[u8]) -> Vec<(Option<String>, String)> {
        let mut out = Vec::new();
        for &b in bytes {
            match b {
                b'\n' if self.after_cr => self.after_cr = false,
                b'\r' | b'\n' => {
                    self.after_cr = b == b'\r';
                    let line = std::mem::take(&mut self.line);
                    if let Some(ev) = self.line_done(&line) {
                        out.push(ev);
                    }
                }
                _ => {
                    self.after_cr = false;
                    self.line.push(b);
                }
            }
        }
        out
    }

    fn line_done(&mut self, raw: &[u8]) -> Option<(Option<String>, String)> {
        let mut line = String::from_utf8_lossy(raw).into_owned();
        if !self.started {
            self.started = true;
            if let Some(rest) = line.strip_prefix('\u{feff}') {
                line = rest.to_owned();
            }
        }
        if line.is_empty() {
            let event = self.event.take();
            if !std::mem::take(&mut self.has_data) {
                self.data.clear();
                return None;
            }
            let mut data = std::mem::take(&mut self.data);
            if data.ends_with('\n') {
                data.pop();
            }
            return Some((event, data));
        }
        if let Some(comment) = line.strip_prefix(':') {
            self.comments.push(comment.to_owned());
            return None;
        }
        let (field, value) = match line.split_once(':') {
            Some((f, v)) => (f, v.strip_prefix(' ').unwrap_or(v)),
            None => (line.as_str(), ""),
        };
        match field {
            "data" => {
                self.data.push_str(value);
                self.data.push('\n');
                self.has_data = true;
            }
            "event" => self.event = Some(value.to_owned()),
            _ => {} // id, retry and unknown fields do not matter here
        }
        None
    }
}

/// Classifies one event's data.
pub fn classify(data: &str) -> EventKind {
    if data == "[DONE]" {
        return EventKind::Done;
    }
    let Ok(v) = serde_json::from_str::<Value>(data) else {
        return EventKind::Malformed;
    };
    if let Some(err) = v.get("error").filter(|e| e.is_object()) {
        return EventKind::Error(err.clone());
    }
    let choice = &v["choices"][0];
    let content = choice["delta"]["content"]
        .as_str()
        .or_else(|| choice["text"].as_str());
    if let Some(reason) = choice["finish_reason"].as_str() {
        return EventKind::Final {
            finish_reason: reason.to_owned(),
            content: content.map(str::to_owned),
        };
    }
    let reasoning = choice["delta"]["reasoning_content"].as_str();
    match (content, reasoning) {
        (Some(text), _) if !text.is_empty() => EventKind::Token(text.to_owned()),
        (_, Some(text)) if !text.is_empty() => EventKind::Reasoning(text.to_owned()),
        _ => EventKind::Other(v),
    }
}

/// What the callback learns besides the event.
#[derive(Debug)]
pub struct Progress<'a> {
    pub stream_id: &'a str,
    /// Token events received so far, this one included.
    pub tokens: usize,
}

/// Everything a stream delivered, as the client saw it.
#[derive(Debug)]
pub struct StreamOutcome {
    pub status: u16,
    /// The `x-haltd-mode` response header (`degraded` in degraded safe mode).
    pub mode_header: Option<String>,
    pub stream_id: String,
    pub content_type: Option<String>,
    pub events: Vec<SseEvent>,
    /// Token events received (content; reasoning frames are counted apart).
    pub tokens: usize,
    pub text: String,
    /// Reasoning token events (`delta.reasoning_content`) received, and their text.
    pub reasoning_tokens: usize,
    pub reasoning: String,
    pub finish_reason: Option<String>,
    /// Content the final chunk carried.
    pub final_content: Option<String>,
    pub error: Option<Value>,
    /// When `[DONE]` arrived.
    pub done_at: Option<Instant>,
    /// Events after `[DONE]` (must be none).
    pub events_after_done: usize,
    /// Events with data that is neither JSON nor `[DONE]`.
    pub malformed: usize,
    /// Comment lines (`: ...`).
    pub comments: Vec<String>,
    /// The read error that ended the body, if it did not end cleanly.
    pub read_error: Option<String>,
    /// Non-SSE body (an error response), as text.
    pub body: Option<String>,
    pub started: Instant,
    /// When the body ended (EOF or error).
    pub ended: Instant,
}

impl StreamOutcome {
    /// When the stream ended for the user: `[DONE]`, else the end of the body.
    pub fn end_at(&self) -> Instant {
        self.done_at.unwrap_or(self.ended)
    }

    /// Whether it ended like a halted stream: a `content_filter` final chunk without content,
    /// an `error` of type `halted` with `code`, then `[DONE]`, in that order and nothing after.
    pub fn halted_cleanly(&self, code: &str) -> Result<()> {
        let kinds: Vec<&EventKind> = self.events.iter().map(|e| &e.kind).collect();
        let n = kinds.len();
        anyhow::ensure!(n >= 3, "only {n} events: {kinds:?}");
        match (kinds[n - 3], kinds[n - 2], kinds[n - 1]) {
            (
                EventKind::Final {
                    finish_reason,
                    content,
                },
                EventKind::Error(err),
                EventKind::Done,
            ) => {
                anyhow::ensure!(
                    finish_reason == "content_filter",
                    "finish_reason {finish_reason:?}"
                );
                anyhow::ensure!(
                    content.as_deref().unwrap_or("").is_empty(),
                    "final chunk carries content {content:?}"
                );
                anyhow::ensure!(err["type"] == "halted", "error type {}", err["type"]);
                anyhow::ensure!(
                    err["code"] == code,
                    "error code {} (expected {code})",
                    err["code"]
                );
                anyhow::ensure!(
                    err["stream_id"] == self.stream_id.as_str(),
                    "error stream_id {} != {}",
                    err["stream_id"],
                    self.stream_id
                );
                Ok(())
            }
            other => anyhow::bail!(
                "stream does not end with content_filter, error, [DONE]: last three {other:?}"
            ),
        }
    }
}

impl StreamOutcome {
    /// The id of the first tool call the stream sent, if any.
    pub fn first_tool_call_id(&self) -> Option<String> {
        self.events
            .iter()
            .filter_map(|e| serde_json::from_str::<Value>(&e.data).ok())
            .find_map(|v| {
                v.pointer("/choices/0/delta/tool_calls/0/id")
                    .and_then(Value::as_str)
                    .map(str::to_owned)
            })
    }

    /// An outcome with the response head read and nothing of the body yet.
    pub(crate) fn new(
        status: u16,
        stream_id: String,
        content_type: Option<String>,
        mode_header: Option<String>,
        started: Instant,
    ) -> Self {
        StreamOutcome {
            mode_header,
            status,
            stream_id,
            content_type,
            events: Vec::new(),
            tokens: 0,
            text: String::new(),
            reasoning_tokens: 0,
            reasoning: String::new(),
            finish_reason: None,
            final_content: None,
            error: None,
            done_at: None,
            events_after_done: 0,
            malformed: 0,
            comments: Vec::new(),
            read_error: None,
            body: None,
            started,
            ended: started,
        }
    }

    /// Counts one event into the totals (before it is stored).
    pub(crate) fn count(&mut self, ev: &SseEvent) {
        if self.done_at.is_some() {
            self.events_after_done += 1;
        }
        match &ev.kind {
            EventKind::Token(t) => {
                self.tokens += 1;
                self.text.push_str(t);
            }
            EventKind::Reasoning(t) => {
                self.reasoning_tokens += 1;
                self.reasoning.push_str(t);
            }
            EventKind::Final {
                finish_reason,
                content,
            } => {
                self.finish_reason = Some(finish_reason.clone());
                self.final_content.clone_from(content);
            }
            EventKind::Error(e) => self.error = Some(e.clone()),
            EventKind::Done => self.done_at = self.done_at.or(Some(ev.at)),
            EventKind::Other(_) => {}
            EventKind::Malformed => self.malformed += 1,
        }
    }
}

/// POSTs `body` to `url` from the current thread's namespace and reads an SSE response
/// incrementally, calling `on_event` for every event as it arrives.
pub fn stream(
    url: &str,
    body: &Value,
    timeout: Duration,
    on_event: impl FnMut(&Progress<'_>, &SseEvent),
) -> Result<StreamOutcome> {
    let key = fresh_key();
    stream_with(url, body, &[("authorization", &key)], timeout, on_event)
}

/// An `on_event` callback that sends the stream's id once, at its first event: how a test
/// learns which stream to trip while the stream runs on another thread.
pub fn report_stream_id(
    tx: std::sync::mpsc::Sender<String>,
) -> impl FnMut(&Progress<'_>, &SseEvent) {
    let mut sent = false;
    move |p, _| {
        if !sent {
            sent = tx.send(p.stream_id.to_owned()).is_ok();
        }
    }
}

/// A new API key: every request made without one is its own conversation, so a trip in one
/// test stream puts only that key into degraded safe mode, not the streams that follow.
pub fn fresh_key() -> String {
    static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);
    let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    format!("Bearer haltd-test-{}-{n}", std::process::id())
}

/// The header lines (without the last CRLF) of a raw request carrying `auth`: `authorization`
/// and the harness's tenant header with it ([`crate::daemon::TEST_TENANT_HEADER`]).
pub fn auth_lines(auth: &str) -> String {
    format!(
        "authorization: {auth}\r\n{}: {auth}",
        crate::daemon::TEST_TENANT_HEADER
    )
}

/// [`stream`] with extra request headers (e.g. `authorization`).
pub fn stream_with(
    url: &str,
    body: &Value,
    headers: &[(&str, &str)],
    timeout: Duration,
    mut on_event: impl FnMut(&Progress<'_>, &SseEvent),
) -> Result<StreamOutcome> {
    let started = Instant::now();
    let mut req = agent(timeout)
        .post(url)
        .header("content-type", "application/json");
    for (k, v) in headers {
        req = req.header(*k, *v);
    }
    if let Some(tenant) = crate::daemon::tenant_of(headers) {
        req = req.header(crate::daemon::TEST_TENANT_HEADER, tenant);
    }
    let resp = req.send_json(body).with_context(|| format!("POST {url}"))?;
    let status = resp.status().as_u16();
    let stream_id = header(&resp, "x-haltd-stream-id").unwrap_or_default();
    let content_type = header(&resp, "content-type");
    let mode_header = header(&resp, "x-haltd-mode");
    let mut out = StreamOutcome::new(
        status,
        stream_id,
        content_type.clone(),
        mode_header,
        started,
    );
    let mut reader = resp.into_body().into_reader();
    if !content_type.is_some_and(|ct| ct.starts_with("text/event-stream")) {
        let mut text = String::new();
        if let Err(e) = reader.read_to_string(&mut text) {
            out.read_error = Some(e.to_string());
        }
        out.body = Some(text);
        out.ended = Instant::now();
        return Ok(out);
    }
    let mut parser = SseParser::default();
    let mut buf = [0_u8; 8192];
    loop {
        let n = match reader.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => n,
            Err(e) => {
                out.read_error = Some(e.to_string());
                break;
            }
        };
        for (event, data) in parser.feed(&buf[..n]) {
            let kind = classify(&data);
            let ev = SseEvent {
                event,
                data,
                kind,
                at: Instant::now(),
            };
            out.count(&ev);
            on_event(
                &Progress {
                    stream_id: &out.stream_id,
                    tokens: out.tokens,
                },
                &ev,
            );
            out.events.push(ev);
        }
    }
    out.comments = parser.comments;
    out.ended = Instant::now();
    Ok(out)
}

/// A chat-completions request body for the built-in source.
pub fn chat_body(prompt: &str, max_tokens: u32, stream: bool) -> Value {
    serde_json::json!({
        "model": "builtin",
        "stream": stream,
        "max_tokens": max_tokens,
        "messages": [{ "role": "user", "content": prompt }],
    })
}

/// A non-streaming POST: (status, `x-haltd-stream-id`, body text).
pub fn post(url: &str, body: &Value, timeout: Duration) -> Result<(u16, String, String)> {
    let key = fresh_key();
    let mut resp = agent(timeout)
        .post(url)
        .header("content-type", "application/json")
        .header("authorization", &key)
        .header(crate::daemon::TEST_TENANT_HEADER, &key)
        .send_json(body)
        .with_context(|| format!("POST {url}"))?;
    let id = header(&resp, "x-haltd-stream-id").unwrap_or_default();
    let text = resp
        .body_mut()
        .with_config()
        .limit(64 << 20)
        .read_to_string()
        .context("reading the body")?;
    Ok((resp.status().as_u16(), id, text))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_per_spec() {
        let mut p = SseParser::default();
        let mut evs = p.feed(b"\xef\xbb\xbfdata: a\r\ndata:b\r\n\r\n: comment\n");
        evs.extend(p.feed(b"event: x\ndata\n\ndata: [DO"));
        evs.extend(p.feed(b"NE]\r\r"));
        evs.extend(p.feed(b"id: 1\n\ndata: incomplete"));
        assert_eq!(
            evs,
            vec![
                (None, "a\nb".to_owned()),
                (Some("x".to_owned()), String::new()),
                (None, "[DONE]".to_owned())
            ]
        );
        assert_eq!(p.comments, vec![" comment".to_owned()]);
    }

    #[test]
    fn classifies_chunks() {
        assert_eq!(
            classify(r#"{"choices":[{"delta":{"content":"hi"},"finish_reason":null}]}"#),
            EventKind::Token("hi".into())
        );
        assert_eq!(
            classify(r#"{"choices":[{"text":"x","finish_reason":null}]}"#),
            EventKind::Token("x".into())
        );
        assert!(matches!(
            classify(r#"{"choices":[{"delta":{"role":"assistant"}}]}"#),
            EventKind::Other(_)
        ));
        assert_eq!(
            classify(r#"{"choices":[{"delta":{},"finish_reason":"content_filter"}]}"#),
            EventKind::Final {
                finish_reason: "content_filter".into(),
                content: None
            }
        );
        assert!(matches!(
            classify(r#"{"error":{"type":"halted"}}"#),
            EventKind::Error(_)
        ));
        assert_eq!(classify("[DONE]"), EventKind::Done);
        assert_eq!(classify("nope"), EventKind::Malformed);
    }
}
