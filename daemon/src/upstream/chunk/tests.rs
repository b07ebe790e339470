//! Tests of [`super::parse_event`]: the backends' chunk shapes, errors and refusals.
use serde_json::{json, Map, Value};

use super::*;
use crate::wire::MAX_TOP_LOGPROBS;

mod differential;
mod reference;

fn ev(data: &str) -> SseEvent {
    SseEvent {
        data: data.into(),
        ..SseEvent::default()
    }
}

fn chunk(endpoint: Endpoint, data: &str) -> UpstreamChunk {
    match parse_event(endpoint, &ev(data)) {
        Ok(UpstreamEvent::Chunk(c)) => c,
        other => panic!("{data}: {other:?}"),
    }
}

fn error(endpoint: Endpoint, e: &SseEvent) -> UpstreamError {
    match parse_event(endpoint, e) {
        Ok(UpstreamEvent::Error(e)) => e,
        other => panic!("{e:?}: {other:?}"),
    }
}

fn refused(endpoint: Endpoint, data: &str) -> ChunkError {
    match parse_event(endpoint, &ev(data)) {
        Err(e) => e,
        Ok(other) => panic!("{data}: accepted as {other:?}"),
    }
}

#[test]
fn vllm_chat_stream() {
    let first = chunk(
        Endpoint::Chat,
        r#"{"id":"chatcmpl-b8a3f1","object":"chat.completion.chunk","created":1718000000,"model":"meta-llama/Llama-3.1-8B-Instruct","choices":[{"index":0,"delta":{"role":"assistant","content":""},"logprobs":null,"finish_reason":null}]}"#,
    );
    assert!(first.role);
    assert_eq!(first.content, "");
    assert_eq!(first.id.as_deref(), Some("chatcmpl-b8a3f1"));
    assert_eq!(
        first.model.as_deref(),
        Some("meta-llama/Llama-3.1-8B-Instruct")
    );
    assert!(first.tokens.is_empty());
    assert!(!first.tokens_match_content());

    let tok = chunk(
        Endpoint::Chat,
        r#"{"id":"chatcmpl-b8a3f1","object":"chat.completion.chunk","created":1718000000,"model":"m","choices":[{"index":0,"delta":{"content":" Paris"},"logprobs":{"content":[{"token":" Paris","logprob":-0.0012,"bytes":[32,80,97,114,105,115],"top_logprobs":[{"token":" Paris","logprob":-0.0012,"bytes":[32,80,97,114,105,115]},{"token":" Lyon","logprob":-7.25,"bytes":[32,76,121,111,110]},{"token":" the","logprob":-9999.0,"bytes":[32,116,104,101]}]}]},"finish_reason":null}]}"#,
    );
    assert!(!tok.role);
    assert_eq!(tok.content, " Paris");
    assert_eq!(
        tok.tokens,
        vec![UpToken {
            text: " Paris".into(),
            logprob: Some(-0.0012),
            top: vec![
                (" Paris".into(), -0.0012),
                (" Lyon".into(), -7.25),
                (" the".into(), f32::NEG_INFINITY)
            ],
        }]
    );
    assert!(tok.tokens_match_content());

    let last = chunk(
        Endpoint::Chat,
        r#"{"id":"chatcmpl-b8a3f1","object":"chat.completion.chunk","created":1718000000,"model":"m","choices":[{"index":0,"delta":{"content":""},"logprobs":null,"finish_reason":"stop","stop_reason":null}]}"#,
    );
    assert_eq!(last.finish_reason, Some(FinishReason::Stop));
    assert_eq!(last.usage, None);

    let usage = chunk(
        Endpoint::Chat,
        r#"{"id":"chatcmpl-b8a3f1","object":"chat.completion.chunk","created":1718000000,"model":"m","choices":[],"usage":{"prompt_tokens":12,"total_tokens":20,"completion_tokens":8}}"#,
    );
    assert_eq!(
        usage.usage,
        Some(Usage {
            prompt_tokens: 12,
            completion_tokens: 8
        })
    );
    assert_eq!(usage.finish_reason, None);
    assert_eq!(usage.content, "");

    assert_eq!(
        parse_event(Endpoint::Chat, &ev("[DONE]")),
        Ok(UpstreamEvent::Done)
    );
    assert_eq!(
        parse_event(Endpoint::Completion, &ev(" [DONE]\t")),
        Ok(UpstreamEvent::Done)
    );
}

#[test]
fn done_detection_is_exact() {
    for not_done in ["[done]", "[DONE]x", "\"[DONE]\"", "[ DONE ]"] {
        assert!(
            !matches!(
                parse_event(Endpoint::Chat, &ev(not_done)),
                Ok(UpstreamEvent::Done)
            ),
            "{not_done}"
        );
    }
}

#[test]
fn several_tokens_in_one_chunk() {
    let c = chunk(
        Endpoint::Chat,
        r#"{"choices":[{"index":0,"delta":{"content":"Hello world"},"logprobs":{"content":[{"token":"Hello","logprob":-0.1,"top_logprobs":[]},{"token":" world","logprob":-0.2,"top_logprobs":[]}]},"finish_reason":null}]}"#,
    );
    assert_eq!(c.tokens.len(), 2);
    assert!(c.tokens_match_content());
    let mut c2 = c.clone();
    c2.content = "Hello worl".into();
    assert!(!c2.tokens_match_content());
    c2.content = "Hello world!".into();
    assert!(!c2.tokens_match_content());
    // vLLM's byte-fallback token forms do not match the detokenised text.
    let c3 = chunk(
        Endpoint::Chat,
        r#"{"choices":[{"index":0,"delta":{"content":"é"},"logprobs":{"content":[{"token":"bytes:\\xc3","logprob":-1.0},{"token":"bytes:\\xa9","logprob":-0.5}]}}]}"#,
    );
    assert!(!c3.tokens_match_content());
    assert_eq!(c3.tokens[0].top, vec![]);
}

#[test]
fn vllm_completions_stream() {
    let c = chunk(
        Endpoint::Completion,
        r#"{"id":"cmpl-5f1c","object":"text_completion","created":1718000000,"model":"m","choices":[{"index":0,"text":" upon a","logprobs":{"text_offset":[9,14],"token_logprobs":[-0.31,-0.05],"tokens":[" upon"," a"],"top_logprobs":[{" a":-2.2," upon":-0.31," in":-3.0},null]},"finish_reason":null,"stop_reason":null}],"usage":null}"#,
    );
    assert_eq!(c.content, " upon a");
    assert_eq!(c.tokens.len(), 2);
    assert_eq!(c.tokens[0].logprob, Some(-0.31));
    assert_eq!(
        c.tokens[0].top,
        vec![
            (" upon".into(), -0.31),
            (" a".into(), -2.2),
            (" in".into(), -3.0)
        ],
        "sorted most likely first"
    );
    assert_eq!(c.tokens[1].top, vec![]);
    assert!(c.tokens_match_content());
    assert!(!c.role);

    let last = chunk(
        Endpoint::Completion,
        r#"{"id":"cmpl-5f1c","object":"text_completion","created":1718000000,"model":"m","choices":[{"index":0,"text":"","logprobs":null,"finish_reason":"length","stop_reason":null}],"usage":{"prompt_tokens":4,"completion_tokens":16,"total_tokens":20}}"#,
    );
    assert_eq!(last.finish_reason, Some(FinishReason::Length));
    assert_eq!(last.usage.map(|u| u.completion_tokens), Some(16));
}

#[test]
fn echoed_prompt_token_has_no_logprob() {
    let c = chunk(
        Endpoint::Completion,
        r#"{"choices":[{"index":0,"text":"Hi there","logprobs":{"tokens":["Hi"," there"],"token_logprobs":[null,-1.5],"top_logprobs":[null,{" there":-1.5}]}}]}"#,
    );
    assert_eq!(c.tokens[0].logprob, None);
    assert_eq!(c.tokens[1].logprob, Some(-1.5));
}

#[test]
fn openai_chat_stream() {
    let c = chunk(
        Endpoint::Chat,
        r#"{"id":"chatcmpl-123","object":"chat.completion.chunk","created":1694268190,"model":"gpt-4o-mini","system_fingerprint":"fp_44709d6fcb","choices":[{"index":0,"delta":{"role":"assistant","content":null,"refusal":null},"logprobs":{"content":[],"refusal":null},"finish_reason":null}],"usage":null}"#,
    );
    assert!(c.role);
    assert_eq!(c.content, "");
    assert!(c.tokens.is_empty());

    let tc = chunk(
        Endpoint::Chat,
        r#"{"id":"chatcmpl-123","object":"chat.completion.chunk","created":1694268190,"model":"gpt-4o-mini","choices":[{"index":0,"delta":{"tool_calls":[{"index":0,"id":"call_abc","type":"function","function":{"name":"get_weather","arguments":""}}]},"logprobs":null,"finish_reason":null}]}"#,
    );
    assert_eq!(
        tc.tool_calls,
        Some(
            json!([{"index":0,"id":"call_abc","type":"function","function":{"name":"get_weather","arguments":""}}])
        )
    );
    let end = chunk(
        Endpoint::Chat,
        r#"{"id":"chatcmpl-123","choices":[{"index":0,"delta":{},"logprobs":null,"finish_reason":"tool_calls"}]}"#,
    );
    assert_eq!(end.finish_reason, Some(FinishReason::ToolCalls));
    assert_eq!(end.tool_calls, None);
}

#[test]
fn llama_cpp_chat_stream() {
    let c = chunk(
        Endpoint::Chat,
        r#"{"choices":[{"finish_reason":null,"index":0,"delta":{"content":"Hello"},"logprobs":{"content":[{"id":9906,"token":"Hello","bytes":[72,101,108,108,111],"logprob":-0.05,"top_logprobs":[{"id":9906,"token":"Hello","bytes":[72,101,108,108,111],"logprob":-0.05},{"id":13347,"token":"Hi","bytes":[72,105],"logprob":null}]}]}}],"created":1736000000,"id":"chatcmpl-aB3","model":"gpt-3.5-turbo","system_fingerprint":"b4500-6d5b1f1a","object":"chat.completion.chunk"}"#,
    );
    assert_eq!(c.content, "Hello");
    assert_eq!(c.tokens[0].logprob, Some(-0.05));
    assert_eq!(
        c.tokens[0].top,
        vec![("Hello".into(), -0.05), ("Hi".into(), f32::NEG_INFINITY)]
    );
    // The last chunk carries choices and usage together.
    let last = chunk(
        Endpoint::Chat,
        r#"{"choices":[{"finish_reason":"stop","index":0,"delta":{}}],"created":1736000000,"id":"chatcmpl-aB3","model":"gpt-3.5-turbo","object":"chat.completion.chunk","usage":{"completion_tokens":10,"prompt_tokens":5,"total_tokens":15},"timings":{"prompt_n":5,"predicted_n":10}}"#,
    );
    assert_eq!(last.finish_reason, Some(FinishReason::Stop));
    assert_eq!(
        last.usage,
        Some(Usage {
            prompt_tokens: 5,
            completion_tokens: 10
        })
    );
    // llama.cpp's completions endpoint with chat-shaped logprobs.
    let c = chunk(
        Endpoint::Completion,
        r#"{"choices":[{"text":" there","index":0,"logprobs":{"content":[{"id":1,"token":" there","bytes":[32],"logprob":-0.7,"top_logprobs":[]}]},"finish_reason":null}],"object":"text_completion"}"#,
    );
    assert_eq!(c.content, " there");
    assert_eq!(c.tokens[0].logprob, Some(-0.7));
    assert!(c.tokens_match_content());
    // A null logprob (llama.cpp's -inf) is left to the caller.
    let c = chunk(
        Endpoint::Chat,
        r#"{"choices":[{"index":0,"delta":{"content":"x"},"logprobs":{"content":[{"token":"x","logprob":null}]}}]}"#,
    );
    assert_eq!(c.tokens[0].logprob, None);
}

#[test]
fn ollama_reasoning() {
    let c = chunk(
        Endpoint::Chat,
        r#"{"id":"chatcmpl-640","object":"chat.completion.chunk","created":1740000000,"model":"qwen3","system_fingerprint":"fp_ollama","choices":[{"index":0,"delta":{"role":"assistant","content":"","reasoning":"Let me think"},"finish_reason":null}]}"#,
    );
    assert_eq!(c.reasoning, "Let me think");
    let c = chunk(
        Endpoint::Chat,
        r#"{"choices":[{"index":0,"delta":{"reasoning_content":"step 1","content":null}}]}"#,
    );
    assert_eq!(c.reasoning, "step 1");
    assert_eq!(c.content, "");
}

#[test]
fn finish_reasons() {
    for (wire, client) in [
        ("stop", "stop"),
        ("length", "length"),
        ("tool_calls", "tool_calls"),
        ("function_call", "function_call"),
        ("content_filter", "content_filter"),
        ("abort", "abort"),
        ("error", "error"),
        ("eos", "stop"),
        ("recitation", "recitation"),
    ] {
        let fr = FinishReason::from_wire(wire);
        assert_eq!(fr.as_str(), client);
        assert_eq!(fr.is_upstream_failure(), matches!(wire, "abort" | "error"));
    }
    assert_eq!(
        FinishReason::from_wire("eos"),
        FinishReason::Eos,
        "kept distinct for records"
    );
    assert_eq!(
        FinishReason::from_wire(&"x".repeat(100)),
        FinishReason::Other("x".repeat(64))
    );
    let c = chunk(
        Endpoint::Chat,
        r#"{"choices":[{"index":0,"delta":{"content":""},"finish_reason":"abort"}]}"#,
    );
    assert_eq!(c.finish_reason, Some(FinishReason::Abort));
}

#[test]
fn vllm_errors() {
    let e = error(
        Endpoint::Chat,
        &ev(
            r#"{"error":{"object":"error","message":"This model's maximum context length is 4096 tokens.","type":"BadRequestError","param":null,"code":400}}"#,
        ),
    );
    assert_eq!(
        e,
        UpstreamError {
            message: "This model's maximum context length is 4096 tokens.".into(),
            kind: Some("BadRequestError".into()),
            code: Some("400".into()),
            status: Some(400),
        }
    );
    let e = error(
        Endpoint::Completion,
        &ev(
            r#"{"object":"error","message":"engine dead","type":"InternalServerError","param":null,"code":500}"#,
        ),
    );
    assert_eq!(e.message, "engine dead");
    assert_eq!(e.status, Some(500));
    // Ollama: code null.
    let e = error(
        Endpoint::Chat,
        &ev(
            r#"{"error":{"message":"model not found","type":"api_error","param":null,"code":null}}"#,
        ),
    );
    assert_eq!(e.kind.as_deref(), Some("api_error"));
    assert_eq!((e.code, e.status), (None, None));
    // A string code and a code that is no HTTP status.
    let e = error(
        Endpoint::Chat,
        &ev(
            r#"{"error":{"message":"slow down","type":"rate_limit","code":"rate_limit_exceeded"}}"#,
        ),
    );
    assert_eq!(e.code.as_deref(), Some("rate_limit_exceeded"));
    assert_eq!(e.status, None);
    let e = error(
        Endpoint::Chat,
        &ev(r#"{"error":{"message":"x","code":1003}}"#),
    );
    assert_eq!((e.code.as_deref(), e.status), (Some("1003"), None));
    let e = error(Endpoint::Chat, &ev(r#"{"error":"plain text error"}"#));
    assert_eq!(e.message, "plain text error");
    let e = error(Endpoint::Chat, &ev(r#"{"error":{}}"#));
    assert_eq!(e.message, "upstream reported an error without a message");
}

#[test]
fn llama_cpp_error_field() {
    let e = error(
        Endpoint::Chat,
        &SseEvent {
            error_field: Some(
                r#"{"code":500,"message":"the request exceeds the available context size","type":"exceed_context_size_error"}"#.into(),
            ),
            ..SseEvent::default()
        },
    );
    assert_eq!(e.message, "the request exceeds the available context size");
    assert_eq!(e.kind.as_deref(), Some("exceed_context_size_error"));
    assert_eq!(e.status, Some(500));
    // Wrapped, or not JSON at all.
    let e = error(
        Endpoint::Chat,
        &SseEvent {
            error_field: Some(r#"{"error":{"code":503,"message":"Loading model"}}"#.into()),
            ..SseEvent::default()
        },
    );
    assert_eq!((e.message.as_str(), e.status), ("Loading model", Some(503)));
    let e = error(
        Endpoint::Chat,
        &SseEvent {
            error_field: Some("out of memory".into()),
            data: "ignored".into(),
            ..SseEvent::default()
        },
    );
    assert_eq!(e.message, "out of memory");
    // `event: error` with the payload in data.
    let e = error(
        Endpoint::Chat,
        &SseEvent {
            event: Some("error".into()),
            data: r#"{"message":"boom"}"#.into(),
            error_field: None,
        },
    );
    assert_eq!(e.message, "boom");
}

#[test]
fn error_messages_are_truncated() {
    let long = "é".repeat(2000);
    let e = error(
        Endpoint::Chat,
        &ev(&json!({"error": {"message": long}}).to_string()),
    );
    assert_eq!(e.message.chars().count(), MAX_ERROR_MESSAGE_CHARS);
    let e = error(
        Endpoint::Chat,
        &SseEvent {
            error_field: Some("x".repeat(1000)),
            ..SseEvent::default()
        },
    );
    assert_eq!(e.message.len(), MAX_ERROR_MESSAGE_CHARS);
}

#[test]
fn error_bodies() {
    let e = UpstreamError::from_body(
        400,
        br#"{"object":"error","message":"The model `x` does not exist.","type":"NotFoundError","param":null,"code":404}"#,
    );
    assert_eq!(e.message, "The model `x` does not exist.");
    assert_eq!(
        e.status,
        Some(400),
        "the response status wins over the code"
    );
    let e = UpstreamError::from_body(422, br#"{"detail":"Field required"}"#);
    assert_eq!(e.message, "Field required");
    let e = UpstreamError::from_body(502, b"<html>Bad Gateway</html>\n");
    assert_eq!(e.message, "<html>Bad Gateway</html>");
    assert_eq!(e.status, Some(502));
    let e = UpstreamError::from_body(503, b" \r\n");
    assert_eq!(e.message, "upstream answered 503 with an empty body");
    let e = UpstreamError::from_body(401, br#"{"error":"unauthorized"}"#);
    assert_eq!(e.message, "unauthorized");
}

#[test]
fn logprob_values() {
    let lp = |v: Value| {
        parse_event(
            Endpoint::Chat,
            &ev(&json!({"choices":[{"index":0,"delta":{"content":"a"},"logprobs":{"content":[{"token":"a","logprob":v}]}}]}).to_string()),
        )
    };
    let got = |v: Value| match lp(v) {
        Ok(UpstreamEvent::Chunk(c)) => c.tokens[0].logprob,
        other => panic!("{other:?}"),
    };
    assert_eq!(got(json!(-9999.0)), Some(f32::NEG_INFINITY));
    assert_eq!(got(json!(-100000.0)), Some(f32::NEG_INFINITY));
    assert_eq!(got(json!(-1e300)), Some(f32::NEG_INFINITY));
    assert_eq!(got(json!(-9998.5)), Some(-9998.5));
    assert_eq!(got(json!(0)), Some(0.0));
    assert_eq!(got(json!(5e-7)), Some(0.0));
    assert_eq!(got(json!(-3)), Some(-3.0));
    assert_eq!(got(Value::Null), None);
    for bad in [
        json!(0.5),
        json!(1),
        json!("-0.1"),
        json!(true),
        json!([-1.0]),
    ] {
        match lp(bad.clone()) {
            Err(ChunkError::BadLogprob { field, .. }) => {
                assert_eq!(field, "choices[0].logprobs.content[0].logprob");
            }
            other => panic!("{bad}: {other:?}"),
        }
    }
    assert_eq!(
        lp(json!(0.5)).expect_err("positive").to_string(),
        "upstream choices[0].logprobs.content[0].logprob = 0.5 is not a log-probability"
    );
    // Alternatives and completions logprobs are checked too.
    let e = refused(
        Endpoint::Chat,
        r#"{"choices":[{"index":0,"delta":{"content":"a"},"logprobs":{"content":[{"token":"a","logprob":-1,"top_logprobs":[{"token":"b","logprob":2}]}]}}]}"#,
    );
    assert!(
        matches!(&e, ChunkError::BadLogprob { field, .. } if field == "choices[0].logprobs.content[0].top_logprobs[0].logprob"),
        "{e:?}"
    );
    let e = refused(
        Endpoint::Completion,
        r#"{"choices":[{"index":0,"text":"a","logprobs":{"tokens":["a"],"token_logprobs":[0.3]}}]}"#,
    );
    assert!(
        matches!(&e, ChunkError::BadLogprob { field, .. } if field == "choices[0].logprobs.token_logprobs[0]"),
        "{e:?}"
    );
}

#[test]
fn top_logprobs_are_capped() {
    let alts: Vec<Value> = (0..30)
        .map(|i| json!({"token": format!("t{i}"), "logprob": -f64::from(i)}))
        .collect();
    let c = chunk(
        Endpoint::Chat,
        &json!({"choices":[{"index":0,"delta":{"content":"t0"},"logprobs":{"content":[{"token":"t0","logprob":0.0,"top_logprobs":alts}]}}]}).to_string(),
    );
    assert_eq!(c.tokens[0].top.len(), MAX_TOP_LOGPROBS as usize);
    let map: Map<String, Value> = (0..30)
        .map(|i| (format!("t{i}"), json!(-f64::from(i))))
        .collect();
    let c = chunk(
        Endpoint::Completion,
        &json!({"choices":[{"index":0,"text":"t0","logprobs":{"tokens":["t0"],"token_logprobs":[0.0],"top_logprobs":[map]}}]}).to_string(),
    );
    let top = &c.tokens[0].top;
    assert_eq!(top.len(), MAX_TOP_LOGPROBS as usize);
    assert_eq!(top[0], ("t0".into(), 0.0));
    assert_eq!(top[19], ("t19".into(), -19.0));
}

#[test]
fn choices_and_index() {
    let c = chunk(
        Endpoint::Chat,
        r#"{"choices":[{"index":1,"delta":{"content":"b"}},{"index":0,"delta":{"content":"a"}}]}"#,
    );
    assert_eq!(c.choice_index, 1);
    assert!(c.extra_choices);
    assert_eq!(c.content, "b");
    let c = chunk(Endpoint::Completion, r#"{"choices":[{"text":"a"}]}"#);
    assert_eq!(c.choice_index, 0);
    assert!(!c.extra_choices);
}

#[test]
fn malformed_chunks() {
    let cases: &[(Endpoint, &str, &str)] = &[
        (Endpoint::Chat, "[1,2]", "malformed upstream chunk: chunk is not a JSON object"),
        (Endpoint::Chat, "42", "malformed upstream chunk: chunk is not a JSON object"),
        (Endpoint::Chat, r#"{"choices":{}}"#, "malformed upstream chunk: choices is not an array"),
        (Endpoint::Chat, r#"{"id":"x"}"#, "malformed upstream chunk: chunk has no choices and no usage"),
        (Endpoint::Chat, r#"{"choices":[]}"#, "malformed upstream chunk: chunk has no choices and no usage"),
        (Endpoint::Chat, r#"{"choices":[],"usage":null}"#, "malformed upstream chunk: chunk has no choices and no usage"),
        (Endpoint::Chat, r#"{"choices":[],"usage":7}"#, "malformed upstream chunk: usage is not an object"),
        (Endpoint::Chat, r#"{"choices":[],"usage":{"prompt_tokens":1}}"#, "malformed upstream chunk: usage.completion_tokens is not a non-negative integer"),
        (Endpoint::Chat, r#"{"choices":[null]}"#, "malformed upstream chunk: choices[0] is not an object"),
        (Endpoint::Chat, r#"{"choices":[{"index":-1}]}"#, "malformed upstream chunk: choices[0].index is not a non-negative integer"),
        (Endpoint::Chat, r#"{"choices":[{"delta":"hi"}]}"#, "malformed upstream chunk: choices[0].delta is not an object"),
        (Endpoint::Chat, r#"{"choices":[{"delta":{"content":["a"]}}]}"#, "malformed upstream chunk: choices[0].delta.content is not a string"),
        (Endpoint::Chat, r#"{"choices":[{"delta":{},"finish_reason":1}]}"#, "malformed upstream chunk: choices[0].finish_reason is not a string"),
        (Endpoint::Chat, r#"{"choices":[{"delta":{},"logprobs":[]}]}"#, "malformed upstream chunk: choices[0].logprobs is not an object"),
        (Endpoint::Chat, r#"{"choices":[{"delta":{},"logprobs":{"content":{}}}]}"#, "malformed upstream chunk: choices[0].logprobs.content is not an array"),
        (Endpoint::Chat, r#"{"choices":[{"delta":{},"logprobs":{"content":[{"logprob":-1}]}}]}"#, "malformed upstream chunk: choices[0].logprobs.content[0].token is not a string"),
        (Endpoint::Chat, r#"{"choices":[{"delta":{},"logprobs":{"content":[{"token":"a","top_logprobs":[1]}]}}]}"#, "malformed upstream chunk: choices[0].logprobs.content[0].top_logprobs[0] is not an object"),
        (Endpoint::Completion, r#"{"choices":[{"text":5}]}"#, "malformed upstream chunk: choices[0].text is not a string"),
        (Endpoint::Completion, r#"{"choices":[{"text":"a","logprobs":{"tokens":["a","b"],"token_logprobs":[-1]}}]}"#, "malformed upstream chunk: choices[0].logprobs.token_logprobs and choices[0].logprobs.tokens differ in length"),
        (Endpoint::Completion, r#"{"choices":[{"text":"a","logprobs":{"tokens":[1]}}]}"#, "malformed upstream chunk: choices[0].logprobs.tokens[0] is not a string"),
        (Endpoint::Completion, r#"{"choices":[{"text":"a","logprobs":{"tokens":["a"],"top_logprobs":[[]]}}]}"#, "malformed upstream chunk: choices[0].logprobs.top_logprobs[0] is not an object"),
    ];
    for (endpoint, data, msg) in cases {
        assert_eq!(refused(*endpoint, data).to_string(), *msg, "{data}");
    }
    let e = refused(Endpoint::Chat, "{\"choices\":[");
    assert!(
        e.to_string()
            .starts_with("upstream event is not valid JSON: EOF while parsing"),
        "{e}"
    );
    // vLLM's -Infinity would be invalid JSON; vLLM writes -9999.0 instead.
    assert!(matches!(
        refused(
            Endpoint::Chat,
            r#"{"choices":[{"logprobs":{"content":[{"token":"a","logprob":-Infinity}]}}]}"#
        ),
        ChunkError::Json { .. }
    ));
}

proptest::proptest! {
    #[test]
    fn never_panics_on_any_text(data in "\\PC{0,200}", err in proptest::option::of("\\PC{0,50}")) {
        let e = SseEvent { event: None, data, error_field: err };
        let _ = parse_event(Endpoint::Chat, &e);
        let _ = parse_event(Endpoint::Completion, &e);
    }

    #[test]
    fn logprobs_are_never_positive_or_nan(
        lps in proptest::collection::vec(proptest::num::f64::ANY, 1..6),
    ) {
        let entries: Vec<Value> = lps.iter().map(|l| json!({"token": "t", "logprob": l})).collect();
        let data = json!({"choices":[{"index":0,"delta":{"content":"t"},"logprobs":{"content":entries}}]}).to_string();
        if let Ok(UpstreamEvent::Chunk(c)) = parse_event(Endpoint::Chat, &ev(&data)) {
            for t in &c.tokens {
                if let Some(l) = t.logprob {
                    proptest::prop_assert!(!l.is_nan() && l <= 0.0);
                }
            }
        }
    }
}
