//! TEMPORARY: replaced by the translation module on branch msg-request.

use serde_json::{json, Value};

use crate::wire::http::HttpError;

/// Translates a Messages API request body into the chat-completions body haltd governs.
pub fn to_chat(body: &Value) -> Result<Value, HttpError> {
    let mut messages = Vec::new();
    if let Some(s) = body["system"].as_str() {
        messages.push(json!({"role": "system", "content": s}));
    }
    for m in body["messages"].as_array().into_iter().flatten() {
        messages.push(json!({"role": m["role"], "content": m["content"]}));
    }
    let mut out =
        json!({"model": body["model"], "max_tokens": body["max_tokens"], "messages": messages});
    if body["stream"] == true {
        out["stream"] = true.into();
        out["stream_options"] = json!({"include_usage": true});
    }
    Ok(out)
}
