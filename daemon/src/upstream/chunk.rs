//! One upstream SSE event, read as what the proxy needs: the text, the tokens with their
//! logprobs, the finish reason, usage, or the upstream's own error.
//!
//! The backends agree on the OpenAI chunk shape but differ in the details this module
//! absorbs, so the proxy sees one shape:
//!
//! * logprobs come in the chat shape (`logprobs.content[] = {token, logprob, bytes,
//!   top_logprobs[]}`; OpenAI, vLLM, newer llama.cpp on both endpoints) or the completions
//!   shape (`logprobs.tokens[]`, `token_logprobs[]`, `top_logprobs[]` of `{token: logprob}`
//!   maps; vLLM, OpenAI). The shape is read from the object, not assumed from the endpoint.
//! * vLLM writes `-9999.0` for a log-probability of −∞; llama.cpp writes `null` (its JSON
//!   library's encoding of a non-finite float); some tokens (an echoed prompt's first) have
//!   none. A missing logprob is kept as `None`: the caller decides, and fails closed.
//! * errors arrive as `data: {"error": {...}}` (vLLM, llama.cpp, Ollama), as a bare
//!   `{"object": "error", ...}` (older vLLM), or in the non-standard `error:` SSE field (older
//!   llama.cpp). All become [`UpstreamError`], with an HTTP status when the code is one.
//! * finish reasons include vLLM's `abort` and `error` and older llama.cpp's `eos`.
//!
//! A logprob that cannot be one (positive, not a number) is an error, not a value to clamp:
//! the detectors' thresholds are only meaningful on real log-probabilities.
//!
//! This runs once per upstream token, so the chunk's JSON is read by typed visitors
//! (`chunk/de.rs`, `shape.rs`, `logprobs.rs`) straight into an [`UpstreamChunk`], with no
//! `serde_json::Value` in between; a [`ChunkReader`] keeps that chunk and reuses its buffers
//! from one event to the next, so that reading a token allocates nothing. The read accepts and
//! refuses exactly what the `Value` read it replaced did, with the same errors: the tests
//! keep that read as a reference and compare the two on generated chunks.

use serde_json::{Map, Value};

mod de;
mod logprobs;
pub mod native;
mod shape;

use crate::{
    upstream::sse::{SseEvent, SseEventRef},
    wire::{truncate_chars, Endpoint},
};

/// Longest upstream error message kept (client-facing and recorded).
pub const MAX_ERROR_MESSAGE_CHARS: usize = 500;
/// A logprob at or below this is −∞ (vLLM's sentinel; JSON has no infinity).
pub const NEG_INF_SENTINEL: f64 = -9999.0;
/// Largest logprob accepted as 0 (rounding in the upstream's float formatting).
pub const LOGPROB_EPSILON: f64 = 1e-6;

/// One upstream SSE event, interpreted.
#[derive(Debug, Clone, PartialEq)]
pub enum UpstreamEvent {
    Chunk(UpstreamChunk),
    /// `data: [DONE]`.
    Done,
    /// The upstream reported an error in the stream.
    Error(UpstreamError),
}

/// An error the upstream reported, in a stream or as an error response body.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct UpstreamError {
    /// At most [`MAX_ERROR_MESSAGE_CHARS`] characters.
    pub message: String,
    /// The error's `type` (`BadRequestError`, `server_error`, ...).
    pub kind: Option<String>,
    /// The error's `code`, a number written as a string when numeric.
    pub code: Option<String>,
    /// An HTTP status: the response's own, or a numeric `code` in 400..=599.
    pub status: Option<u16>,
}

/// Token usage of the turn, from the last chunk.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Usage {
    pub prompt_tokens: u64,
    pub completion_tokens: u64,
}

/// One token with its logprob and alternatives.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct UpToken {
    pub text: String,
    /// `None` when the upstream gave none (`null` or absent); −∞ for vLLM's `-9999.0`.
    pub logprob: Option<f32>,
    /// Alternatives, most likely first, at most [`crate::wire::MAX_TOP_LOGPROBS`]. A `null` alternative
    /// logprob (llama.cpp's −∞) is −∞.
    pub top: Vec<(String, f32)>,
}

/// Why a finish reason ended the generation.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum FinishReason {
    Stop,
    Length,
    ToolCalls,
    FunctionCall,
    ContentFilter,
    /// vLLM: the request was aborted (e.g. the engine shut down).
    Abort,
    /// vLLM: the generation failed.
    Error,
    /// Older llama.cpp: end of sequence (OpenAI's `stop`).
    Eos,
    /// Any other value, kept (truncated to 64 characters).
    Other(String),
}

impl FinishReason {
    /// Reads a wire value.
    pub fn from_wire(s: &str) -> Self {
        match s {
            "stop" => FinishReason::Stop,
            "length" => FinishReason::Length,
            "tool_calls" => FinishReason::ToolCalls,
            "function_call" => FinishReason::FunctionCall,
            "content_filter" => FinishReason::ContentFilter,
            "abort" => FinishReason::Abort,
            "error" => FinishReason::Error,
            "eos" => FinishReason::Eos,
            other => FinishReason::Other(truncate_chars(other, 64)),
        }
    }

    /// The value to send to the client (`eos` becomes `stop`; the rest as received).
    pub fn as_str(&self) -> &str {
        match self {
            FinishReason::Stop | FinishReason::Eos => "stop",
            FinishReason::Length => "length",
            FinishReason::ToolCalls => "tool_calls",
            FinishReason::FunctionCall => "function_call",
            FinishReason::ContentFilter => "content_filter",
            FinishReason::Abort => "abort",
            FinishReason::Error => "error",
            FinishReason::Other(s) => s,
        }
    }

    /// Whether the upstream ended the generation by failing (`abort`, `error`).
    pub fn is_upstream_failure(&self) -> bool {
        matches!(self, FinishReason::Abort | FinishReason::Error)
    }
}

/// One chunk of the first choice.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct UpstreamChunk {
    pub id: Option<String>,
    pub model: Option<String>,
    /// The delta carried a `role` (the first chunk of a chat stream).
    pub role: bool,
    /// Chat `delta.content`, completions `text`; `null` or absent is `""`.
    pub content: String,
    /// `delta.reasoning_content` (vLLM) or `delta.reasoning` (Ollama, newer vLLM); else `""`.
    pub reasoning: String,
    /// `delta.tool_calls` as received.
    pub tool_calls: Option<Value>,
    pub tokens: Vec<UpToken>,
    pub finish_reason: Option<FinishReason>,
    pub usage: Option<Usage>,
    /// `choices[0].index`.
    pub choice_index: u32,
    /// The chunk held more than one choice (only the first is read).
    pub extra_choices: bool,
}

impl UpstreamChunk {
    /// Whether `tokens` is non-empty and their texts concatenate exactly to `content`.
    ///
    /// Upstreams may put several tokens in one chunk (vLLM under load, speculative decoding).
    /// When this holds, the proxy emits one frame per token (a token longer than the cap in
    /// pieces); when it does not (detokenisation held bytes back, tokens written as
    /// `bytes:`/`token_id:` forms, reasoning tokens, no logprobs at all), one frame per
    /// character of the content ([`super::framing`]).
    pub fn tokens_match_content(&self) -> bool {
        tokens_spell(&self.tokens, &self.content)
    }
}

/// Why an upstream event cannot be read. The upstream's fault; the stream ends as an
/// upstream failure.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ChunkError {
    #[error("upstream event is not valid JSON: {reason}")]
    Json { reason: String },
    #[error("malformed upstream chunk: {what}")]
    Malformed { what: String },
    #[error("upstream {field} = {value} is not a log-probability")]
    BadLogprob { field: String, value: String },
}

fn malformed(what: impl Into<String>) -> ChunkError {
    ChunkError::Malformed { what: what.into() }
}

/// Reads one SSE event of an `endpoint` stream into a new chunk. Allocates the chunk's
/// strings; [`ChunkReader`] reuses them.
pub fn parse_event(endpoint: Endpoint, ev: &SseEvent) -> Result<UpstreamEvent, ChunkError> {
    let mut reader = ChunkReader::default();
    Ok(match reader.read(endpoint, ev.view())? {
        Parsed::Chunk => UpstreamEvent::Chunk(reader.chunk),
        Parsed::Done => UpstreamEvent::Done,
        Parsed::Error(e) => UpstreamEvent::Error(e),
    })
}

/// What [`ChunkReader::read`] read.
#[derive(Debug, Clone, PartialEq)]
pub enum Parsed {
    /// A chunk, in [`ChunkReader::chunk`].
    Chunk,
    /// `data: [DONE]`.
    Done,
    /// The upstream reported an error in the stream.
    Error(UpstreamError),
}

/// Reads the events of one stream into one [`UpstreamChunk`] whose buffers it reuses: once
/// they have grown to the stream's chunk size, reading a chunk allocates nothing (a tool-call
/// delta, an unknown finish reason and an error still do).
#[derive(Debug, Default)]
pub struct ChunkReader {
    chunk: UpstreamChunk,
    scratch: de::Scratch,
    /// A surface the backend serves natively: its events, read by their own reader.
    native: Option<native::NativeReader>,
}

impl ChunkReader {
    /// A reader of a stream in `surface`'s own events (`--upstream-surfaces`), not chat's.
    pub fn native(surface: crate::upstream::native::UpstreamSurface) -> Self {
        ChunkReader {
            native: Some(native::NativeReader::new(surface)),
            ..ChunkReader::default()
        }
    }

    /// Whether a native stream's terminal event was read (those APIs send no `[DONE]`).
    pub fn ended(&self) -> bool {
        self.native
            .as_ref()
            .is_some_and(native::NativeReader::ended)
    }

    /// Reads one SSE event of an `endpoint` stream. After [`Parsed::Chunk`] the chunk is in
    /// [`ChunkReader::chunk`]; after anything else it holds no chunk worth reading.
    pub fn read(&mut self, endpoint: Endpoint, ev: SseEventRef<'_>) -> Result<Parsed, ChunkError> {
        if let Some(raw) = ev.error_field {
            return Ok(Parsed::Error(error_from_text(raw)));
        }
        let data = ev.data.trim_ascii();
        if ev.event == Some("error") {
            return Ok(Parsed::Error(error_from_text(data)));
        }
        if data == "[DONE]" {
            return Ok(Parsed::Done);
        }
        if let Some(n) = &mut self.native {
            return n.read(data, &mut self.chunk, &mut self.scratch);
        }
        match shape::read(endpoint, data, &mut self.chunk, &mut self.scratch)? {
            de::Top::Chunk => Ok(Parsed::Chunk),
            de::Top::NotObject => Err(malformed("chunk is not a JSON object")),
            // An error object (rare): read again, whole, as the error it is.
            de::Top::Error => match serde_json::from_str(data) {
                Ok(Value::Object(obj)) => Ok(Parsed::Error(error_from_object(&obj))),
                Ok(_) => Err(malformed("chunk is not a JSON object")),
                Err(e) => Err(ChunkError::Json {
                    reason: e.to_string(),
                }),
            },
        }
    }

    /// The chunk last read.
    pub fn chunk(&self) -> &UpstreamChunk {
        &self.chunk
    }

    /// The chunk last read, to take parts of (what is taken is not reused).
    pub fn chunk_mut(&mut self) -> &mut UpstreamChunk {
        &mut self.chunk
    }
}

impl UpstreamError {
    /// The error in a non-2xx response body: the OpenAI error object when the body has one,
    /// else the body's text. `status` is the response's.
    pub fn from_body(status: u16, body: &[u8]) -> Self {
        let text = String::from_utf8_lossy(body);
        let mut e = if text.trim().is_empty() {
            UpstreamError {
                message: format!("upstream answered {status} with an empty body"),
                ..UpstreamError::default()
            }
        } else {
            error_from_text(&text)
        };
        e.status = Some(status);
        e
    }
}

/// An error payload that may or may not be JSON (the `error:` field, `event: error` data).
fn error_from_text(raw: &str) -> UpstreamError {
    let raw = raw.trim();
    match serde_json::from_str::<Value>(raw) {
        Ok(Value::Object(obj)) => error_from_object(&obj),
        _ => UpstreamError {
            message: if raw.is_empty() {
                "upstream reported an error without a message".to_owned()
            } else {
                truncate_chars(raw, MAX_ERROR_MESSAGE_CHARS)
            },
            ..UpstreamError::default()
        },
    }
}

/// `{"error": {...}}`, `{"error": "text"}`, or the error fields at the top level.
fn error_from_object(obj: &Map<String, Value>) -> UpstreamError {
    let fields = match obj.get("error") {
        Some(Value::Object(inner)) => inner,
        Some(Value::String(s)) => {
            return UpstreamError {
                message: truncate_chars(s, MAX_ERROR_MESSAGE_CHARS),
                ..UpstreamError::default()
            }
        }
        _ => obj,
    };
    let message = ["message", "detail", "error"]
        .iter()
        .find_map(|k| fields.get(*k).and_then(Value::as_str))
        .map_or_else(
            || "upstream reported an error without a message".to_owned(),
            |m| truncate_chars(m, MAX_ERROR_MESSAGE_CHARS),
        );
    let kind = fields
        .get("type")
        .and_then(Value::as_str)
        .map(|t| truncate_chars(t, 64));
    let (code, status) = match fields.get("code") {
        Some(Value::String(s)) => (Some(truncate_chars(s, 64)), None),
        Some(Value::Number(n)) => (
            Some(n.to_string()),
            n.as_u64()
                .and_then(|c| u16::try_from(c).ok())
                .filter(|c| (400..=599).contains(c)),
        ),
        _ => (None, None),
    };
    UpstreamError {
        message,
        kind,
        code,
        status,
    }
}

/// Whether `tokens` is non-empty and their texts concatenate exactly to `text`.
pub fn tokens_spell(tokens: &[UpToken], text: &str) -> bool {
    if tokens.is_empty() {
        return false;
    }
    let mut rest = text;
    for t in tokens {
        match rest.strip_prefix(t.text.as_str()) {
            Some(r) => rest = r,
            None => return false,
        }
    }
    rest.is_empty()
}

#[cfg(test)]
mod tests;
