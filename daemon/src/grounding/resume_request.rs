//! The upstream request that resumes a rewound reply with grounding in context (spec 003,
//! "Resume semantics"; issue 16 point 4): the running request is cancelled and this one is
//! sent instead.
//!
//! It is the request the upstream got (every field the client set, haltd's own streaming
//! and logprob fields included) with three changes:
//!
//! - **the grounding** as one bracketed system segment ([`super::plan::bracketed`]): appended
//!   to the first message when that is a system message, else a system message put first
//!   (chat templates that accept a system message only at the start accept it there);
//! - **the kept prefix** (the reply up to the window start) as the assistant's continuation:
//!   chat: a last `assistant` message; vLLM is told to continue it
//!   (`continue_final_message: true`, `add_generation_prompt: false`), llama.cpp's server
//!   continues a last assistant message by itself (its prefill). Completions: the prefix is
//!   appended to the prompt and the segment put before it, for either shape;
//! - **the length budget**: `max_tokens` (and `max_completion_tokens`) less the tokens kept, so
//!   the reply as a whole stays within what the client asked for.
//!
//! The upstream then streams only the new text, which the data plane splices after the kept
//! prefix.

use serde_json::{json, Map, Value};

use super::plan::Continuation;
use crate::wire::Endpoint;

/// Why a request cannot be resumed (the reply then goes on unmodified).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ResumeError {
    #[error("the upstream has no continuation (continuation = \"none\")")]
    NoContinuation,
    #[error("the upstream request is not a JSON object")]
    NotAnObject,
    #[error("the request has no messages array")]
    NoMessages,
    #[error("the prompt is not one string (token ids cannot be continued with text)")]
    PromptNotText,
}

/// The body that resumes `original` (the upstream request body as sent) after `kept` (its
/// `kept_tokens` tokens) with `segment` (the bracketed grounding) in context.
pub fn resume_body(
    original: &[u8],
    endpoint: Endpoint,
    shape: Continuation,
    segment: &str,
    (kept, kept_tokens): (&str, u64),
) -> Result<Vec<u8>, ResumeError> {
    if shape == Continuation::None {
        return Err(ResumeError::NoContinuation);
    }
    let Ok(Value::Object(mut obj)) = serde_json::from_slice::<Value>(original) else {
        return Err(ResumeError::NotAnObject);
    };
    match endpoint.request_shape() {
        Endpoint::Chat | Endpoint::Messages | Endpoint::Responses => {
            resume_chat(&mut obj, shape, segment, kept)?
        }
        Endpoint::Completion => resume_completion(&mut obj, segment, kept)?,
    }
    for budget in ["max_tokens", "max_completion_tokens"] {
        if let Some(n) = obj.get(budget).and_then(Value::as_u64) {
            obj.insert(
                budget.into(),
                Value::from(n.saturating_sub(kept_tokens).max(1)),
            );
        }
    }
    Ok(serde_json::to_vec(&Value::Object(obj)).unwrap_or_default())
}

fn resume_chat(
    obj: &mut Map<String, Value>,
    shape: Continuation,
    segment: &str,
    kept: &str,
) -> Result<(), ResumeError> {
    let Some(Value::Array(messages)) = obj.get_mut("messages") else {
        return Err(ResumeError::NoMessages);
    };
    match messages.first_mut() {
        Some(Value::Object(first))
            if first.get("role").and_then(Value::as_str) == Some("system")
                && first.get("content").is_some_and(Value::is_string) =>
        {
            let content = first.get("content").and_then(Value::as_str).unwrap_or("");
            let joined = format!("{content}\n\n{segment}");
            first.insert("content".into(), Value::String(joined));
        }
        _ => messages.insert(0, json!({"role": "system", "content": segment})),
    }
    messages.push(json!({"role": "assistant", "content": kept}));
    if shape == Continuation::Vllm {
        obj.insert("continue_final_message".into(), Value::Bool(true));
        obj.insert("add_generation_prompt".into(), Value::Bool(false));
    }
    Ok(())
}

fn resume_completion(
    obj: &mut Map<String, Value>,
    segment: &str,
    kept: &str,
) -> Result<(), ResumeError> {
    let prompt = match obj.get("prompt") {
        Some(Value::String(p)) => p.clone(),
        Some(Value::Array(a)) if a.len() == 1 && a[0].is_string() => {
            a[0].as_str().unwrap_or("").to_owned()
        }
        _ => return Err(ResumeError::PromptNotText),
    };
    obj.insert(
        "prompt".into(),
        Value::String(format!("{segment}\n\n{prompt}{kept}")),
    );
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    const SEG: &str = "[grounding]\n[\"c\",\"e\",1.0,\"s\"]\n[/grounding]";

    fn body(v: Value) -> Vec<u8> {
        serde_json::to_vec(&v).expect("json")
    }

    fn parse(b: &[u8]) -> Value {
        serde_json::from_slice(b).expect("json")
    }

    #[test]
    fn vllm_continues_the_final_assistant_message_with_the_segment_as_system() {
        let orig = body(json!({"model": "m", "stream": true, "max_tokens": 50,
            "messages": [{"role": "user", "content": "q"}]}));
        let out = parse(
            &resume_body(
                &orig,
                Endpoint::Chat,
                Continuation::Vllm,
                SEG,
                ("The ans", 3),
            )
            .expect("resumable"),
        );
        assert_eq!(
            out["messages"],
            json!([{"role": "system", "content": SEG},
                {"role": "user", "content": "q"},
                {"role": "assistant", "content": "The ans"}])
        );
        assert_eq!(out["continue_final_message"], true);
        assert_eq!(out["add_generation_prompt"], false);
        assert_eq!(out["max_tokens"], 47);
        assert_eq!(
            (out["model"].as_str(), out["stream"].as_bool()),
            (Some("m"), Some(true))
        );
    }

    #[test]
    fn llama_cpp_prefills_the_assistant_message_without_vllm_flags() {
        let orig = body(json!({"model": "m", "messages": [
            {"role": "system", "content": "be brief"}, {"role": "user", "content": "q"}]}));
        let out = parse(
            &resume_body(
                &orig,
                Endpoint::Chat,
                Continuation::LlamaCpp,
                SEG,
                ("Pre", 1),
            )
            .expect("resumable"),
        );
        let m = out["messages"].as_array().expect("messages");
        assert_eq!(m.len(), 3);
        assert_eq!(m[0]["content"], format!("be brief\n\n{SEG}"));
        assert_eq!(m[2], json!({"role": "assistant", "content": "Pre"}));
        assert!(out.get("continue_final_message").is_none());
        assert!(out.get("add_generation_prompt").is_none());
        assert!(
            out.get("max_tokens").is_none(),
            "no budget asked, none added"
        );
    }

    #[test]
    fn completions_continue_the_prompt() {
        let orig = body(json!({"model": "m", "prompt": "Q: x\nA:", "max_tokens": 2}));
        let out = parse(
            &resume_body(
                &orig,
                Endpoint::Completion,
                Continuation::Vllm,
                SEG,
                (" y", 5),
            )
            .expect("resumable"),
        );
        assert_eq!(out["prompt"], format!("{SEG}\n\nQ: x\nA: y"));
        assert_eq!(out["max_tokens"], 1, "never 0");
    }

    #[test]
    fn what_cannot_be_resumed_says_why() {
        let chat = body(json!({"model": "m", "messages": []}));
        assert_eq!(
            resume_body(&chat, Endpoint::Chat, Continuation::None, SEG, ("", 0)),
            Err(ResumeError::NoContinuation)
        );
        let ids = body(json!({"model": "m", "prompt": [1, 2, 3]}));
        assert_eq!(
            resume_body(&ids, Endpoint::Completion, Continuation::Vllm, SEG, ("", 0)),
            Err(ResumeError::PromptNotText)
        );
        assert_eq!(
            resume_body(b"[1]", Endpoint::Chat, Continuation::Vllm, SEG, ("", 0)),
            Err(ResumeError::NotAnObject)
        );
    }
}
