//! The reference: how chunks were read before the typed read, through a `serde_json::Value`.
//! The property tests check that the typed read accepts, refuses and reads exactly as this.

use serde_json::{Map, Value};

use super::super::{
    error_from_object, error_from_text, malformed, ChunkError, FinishReason, UpToken,
    UpstreamChunk, UpstreamEvent, Usage, LOGPROB_EPSILON, NEG_INF_SENTINEL,
};
use crate::{
    upstream::sse::SseEvent,
    wire::{truncate_chars, Endpoint, MAX_TOP_LOGPROBS},
};

/// Reads one SSE event of an `endpoint` stream.
pub(super) fn parse_event(endpoint: Endpoint, ev: &SseEvent) -> Result<UpstreamEvent, ChunkError> {
    if let Some(raw) = &ev.error_field {
        return Ok(UpstreamEvent::Error(error_from_text(raw)));
    }
    let data = ev.data.trim_ascii();
    if ev.event.as_deref() == Some("error") {
        return Ok(UpstreamEvent::Error(error_from_text(data)));
    }
    if data == "[DONE]" {
        return Ok(UpstreamEvent::Done);
    }
    let value: Value = serde_json::from_str(data).map_err(|e| ChunkError::Json {
        reason: e.to_string(),
    })?;
    let Value::Object(obj) = &value else {
        return Err(malformed("chunk is not a JSON object"));
    };
    if is_error_object(obj) {
        return Ok(UpstreamEvent::Error(error_from_object(obj)));
    }
    parse_chunk(endpoint, obj).map(UpstreamEvent::Chunk)
}

fn is_error_object(obj: &Map<String, Value>) -> bool {
    obj.get("error").is_some_and(|e| !e.is_null())
        || obj.get("object").and_then(Value::as_str) == Some("error")
}

/// A string field; `null` or absent is `""`.
fn opt_text(obj: &Map<String, Value>, key: &str, path: &str) -> Result<String, ChunkError> {
    match obj.get(key) {
        None | Some(Value::Null) => Ok(String::new()),
        Some(Value::String(s)) => Ok(s.clone()),
        Some(_) => Err(malformed(format!("{path} is not a string"))),
    }
}

fn count(obj: &Map<String, Value>, key: &str) -> Result<u64, ChunkError> {
    obj.get(key)
        .and_then(Value::as_u64)
        .ok_or_else(|| malformed(format!("usage.{key} is not a non-negative integer")))
}

fn excerpt(v: &Value) -> String {
    truncate_chars(&v.to_string(), 32)
}

/// A token's logprob: `None` for `null`/absent, −∞ for the sentinel, an error if it is not
/// a log-probability.
fn logprob(v: Option<&Value>, field: impl Fn() -> String) -> Result<Option<f32>, ChunkError> {
    let x = match v {
        None | Some(Value::Null) => return Ok(None),
        Some(Value::Number(n)) => n.as_f64(),
        Some(_) => None,
    };
    match x {
        Some(x) if x.is_nan() || x > LOGPROB_EPSILON => Err(ChunkError::BadLogprob {
            field: field(),
            value: x.to_string(),
        }),
        Some(x) if x <= NEG_INF_SENTINEL => Ok(Some(f32::NEG_INFINITY)),
        // `as` saturates: a finite f64 below f32::MIN becomes -inf, which it is in effect.
        Some(x) => Ok(Some(x.min(0.0) as f32)),
        None => Err(ChunkError::BadLogprob {
            field: field(),
            value: v.map(excerpt).unwrap_or_default(),
        }),
    }
}

fn top_logprob(v: Option<&Value>, field: impl Fn() -> String) -> Result<f32, ChunkError> {
    Ok(logprob(v, field)?.unwrap_or(f32::NEG_INFINITY))
}

fn parse_chunk(endpoint: Endpoint, obj: &Map<String, Value>) -> Result<UpstreamChunk, ChunkError> {
    let id = obj
        .get("id")
        .and_then(Value::as_str)
        .map(|s| truncate_chars(s, 128));
    let model = obj
        .get("model")
        .and_then(Value::as_str)
        .map(|s| truncate_chars(s, 256));
    let usage = match obj.get("usage") {
        None | Some(Value::Null) => None,
        Some(Value::Object(u)) => Some(Usage {
            prompt_tokens: count(u, "prompt_tokens")?,
            completion_tokens: count(u, "completion_tokens")?,
        }),
        Some(_) => return Err(malformed("usage is not an object")),
    };
    let choices: &[Value] = match obj.get("choices") {
        None | Some(Value::Null) => &[],
        Some(Value::Array(a)) => a,
        Some(_) => return Err(malformed("choices is not an array")),
    };
    let Some(first) = choices.first() else {
        if usage.is_none() {
            return Err(malformed("chunk has no choices and no usage"));
        }
        return Ok(UpstreamChunk {
            id,
            model,
            usage,
            ..UpstreamChunk::default()
        });
    };
    let Value::Object(choice) = first else {
        return Err(malformed("choices[0] is not an object"));
    };
    let choice_index = match choice.get("index") {
        None | Some(Value::Null) => 0,
        Some(v) => v
            .as_u64()
            .and_then(|i| u32::try_from(i).ok())
            .ok_or_else(|| malformed("choices[0].index is not a non-negative integer"))?,
    };
    let finish_reason = match choice.get("finish_reason") {
        None | Some(Value::Null) => None,
        Some(Value::String(s)) => Some(FinishReason::from_wire(s)),
        Some(_) => return Err(malformed("choices[0].finish_reason is not a string")),
    };
    let mut chunk = UpstreamChunk {
        id,
        model,
        finish_reason,
        usage,
        choice_index,
        extra_choices: choices.len() > 1,
        ..UpstreamChunk::default()
    };
    read_choice(endpoint, choice, &mut chunk)?;
    Ok(chunk)
}

/// The text and logprobs of `choices[0]` (`delta` for chat, `text` for completions).
fn read_choice(
    endpoint: Endpoint,
    choice: &Map<String, Value>,
    chunk: &mut UpstreamChunk,
) -> Result<(), ChunkError> {
    match endpoint.request_shape() {
        Endpoint::Chat | Endpoint::Messages | Endpoint::Responses => match choice.get("delta") {
            None | Some(Value::Null) => {}
            Some(Value::Object(delta)) => {
                chunk.role = delta.get("role").is_some_and(Value::is_string);
                chunk.content = opt_text(delta, "content", "choices[0].delta.content")?;
                chunk.reasoning = opt_text(
                    delta,
                    "reasoning_content",
                    "choices[0].delta.reasoning_content",
                )?;
                if chunk.reasoning.is_empty() {
                    chunk.reasoning = opt_text(delta, "reasoning", "choices[0].delta.reasoning")?;
                }
                chunk.tool_calls = delta.get("tool_calls").filter(|t| !t.is_null()).cloned();
            }
            Some(_) => return Err(malformed("choices[0].delta is not an object")),
        },
        Endpoint::Completion => {
            chunk.content = opt_text(choice, "text", "choices[0].text")?;
        }
    }
    chunk.tokens = match choice.get("logprobs") {
        None | Some(Value::Null) => Vec::new(),
        Some(Value::Object(lp)) if lp.contains_key("content") => chat_logprobs(lp)?,
        Some(Value::Object(lp)) => completion_logprobs(lp)?,
        Some(_) => return Err(malformed("choices[0].logprobs is not an object")),
    };
    Ok(())
}

/// `logprobs.content[] = {token, logprob, bytes, top_logprobs: [{token, logprob, bytes}]}`.
fn chat_logprobs(lp: &Map<String, Value>) -> Result<Vec<UpToken>, ChunkError> {
    const AT: &str = "choices[0].logprobs.content";
    let entries: &[Value] = match lp.get("content") {
        None | Some(Value::Null) => &[],
        Some(Value::Array(a)) => a,
        Some(_) => return Err(malformed(format!("{AT} is not an array"))),
    };
    let mut tokens = Vec::with_capacity(entries.len());
    for (i, e) in entries.iter().enumerate() {
        let Value::Object(e) = e else {
            return Err(malformed(format!("{AT}[{i}] is not an object")));
        };
        let text = e
            .get("token")
            .and_then(Value::as_str)
            .ok_or_else(|| malformed(format!("{AT}[{i}].token is not a string")))?;
        let logprob = logprob(e.get("logprob"), || format!("{AT}[{i}].logprob"))?;
        let alts: &[Value] = match e.get("top_logprobs") {
            None | Some(Value::Null) => &[],
            Some(Value::Array(a)) => a,
            Some(_) => return Err(malformed(format!("{AT}[{i}].top_logprobs is not an array"))),
        };
        let mut top = Vec::with_capacity(alts.len().min(MAX_TOP_LOGPROBS as usize));
        for (j, a) in alts.iter().take(MAX_TOP_LOGPROBS as usize).enumerate() {
            let at = || format!("{AT}[{i}].top_logprobs[{j}]");
            let Value::Object(a) = a else {
                return Err(malformed(format!("{} is not an object", at())));
            };
            let t = a
                .get("token")
                .and_then(Value::as_str)
                .ok_or_else(|| malformed(format!("{}.token is not a string", at())))?;
            let l = top_logprob(a.get("logprob"), || format!("{}.logprob", at()))?;
            top.push((t.to_owned(), l));
        }
        tokens.push(UpToken {
            text: text.to_owned(),
            logprob,
            top,
        });
    }
    Ok(tokens)
}

/// `logprobs = {tokens[], token_logprobs[], top_logprobs[] of {token: logprob} or null}`.
fn completion_logprobs(lp: &Map<String, Value>) -> Result<Vec<UpToken>, ChunkError> {
    const AT: &str = "choices[0].logprobs";
    let array = |key: &str| -> Result<Option<&[Value]>, ChunkError> {
        match lp.get(key) {
            None | Some(Value::Null) => Ok(None),
            Some(Value::Array(a)) => Ok(Some(a)),
            Some(_) => Err(malformed(format!("{AT}.{key} is not an array"))),
        }
    };
    let Some(texts) = array("tokens")? else {
        return Ok(Vec::new());
    };
    let lps = array("token_logprobs")?;
    let tops = array("top_logprobs")?;
    for (key, other) in [("token_logprobs", lps), ("top_logprobs", tops)] {
        if other.is_some_and(|o| o.len() != texts.len()) {
            return Err(malformed(format!(
                "{AT}.{key} and {AT}.tokens differ in length"
            )));
        }
    }
    let mut tokens = Vec::with_capacity(texts.len());
    for (i, t) in texts.iter().enumerate() {
        let text = t
            .as_str()
            .ok_or_else(|| malformed(format!("{AT}.tokens[{i}] is not a string")))?;
        let logprob = logprob(lps.and_then(|l| l.get(i)), || {
            format!("{AT}.token_logprobs[{i}]")
        })?;
        let mut top = match tops.and_then(|t| t.get(i)) {
            None | Some(Value::Null) => Vec::new(),
            Some(Value::Object(m)) => m
                .iter()
                .map(|(alt, l)| {
                    top_logprob(Some(l), || format!("{AT}.top_logprobs[{i}][{alt:?}]"))
                        .map(|l| (alt.clone(), l))
                })
                .collect::<Result<Vec<_>, _>>()?,
            Some(_) => {
                return Err(malformed(format!(
                    "{AT}.top_logprobs[{i}] is not an object"
                )))
            }
        };
        // JSON objects are unordered (and serde_json sorts keys): restore likelihood order.
        top.sort_by(|a, b| b.1.total_cmp(&a.1));
        top.truncate(MAX_TOP_LOGPROBS as usize);
        tokens.push(UpToken {
            text: text.to_owned(),
            logprob,
            top,
        });
    }
    Ok(tokens)
}
