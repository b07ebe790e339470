//! The native readers on the events of each surface, as a backend writes them.

use serde_json::json;

use super::*;
use crate::upstream::{ChunkReader, SseEvent, UpstreamError};

/// What each event of `events` (their data) reads as: the chunk, or the end / error.
fn read_all(surface: UpstreamSurface, events: &[Value]) -> Vec<Result<Parsed, ChunkError>> {
    let mut r = ChunkReader::native(surface);
    events
        .iter()
        .map(|e| {
            let ev = SseEvent {
                event: e["type"].as_str().map(str::to_owned),
                data: e.to_string(),
                ..SseEvent::default()
            };
            r.read(crate::wire::Endpoint::Chat, ev.view())
        })
        .collect()
}

/// The chunks a stream reads as, with whether it ended.
fn chunks(surface: UpstreamSurface, events: &[Value]) -> (Vec<UpstreamChunk>, bool) {
    let mut r = ChunkReader::native(surface);
    let mut out = Vec::new();
    for e in events {
        let ev = SseEvent {
            event: e["type"].as_str().map(str::to_owned),
            data: e.to_string(),
            ..SseEvent::default()
        };
        match r.read(crate::wire::Endpoint::Chat, ev.view()) {
            Ok(Parsed::Chunk) => out.push(r.chunk().clone()),
            Ok(Parsed::Done) => return (out, true),
            other => panic!("{e}: {other:?}"),
        }
    }
    let ended = r.ended();
    (out, ended)
}

fn text_of(c: &[UpstreamChunk]) -> (String, String) {
    (
        c.iter().map(|c| c.content.as_str()).collect(),
        c.iter().map(|c| c.reasoning.as_str()).collect(),
    )
}

#[test]
fn a_responses_stream_reads_as_chat_chunks() {
    let lp = |t: &str| json!([{"token": t, "logprob": -0.1, "bytes": [], "top_logprobs": [{"token": t, "logprob": -0.1}]}]);
    let events = [
        json!({"type": "response.created", "sequence_number": 0, "response": {"id": "resp_1", "model": "m", "status": "in_progress"}}),
        json!({"type": "response.in_progress", "sequence_number": 1, "response": {"id": "resp_1", "model": "m"}}),
        json!({"type": "response.output_item.added", "output_index": 0, "item": {"type": "reasoning", "id": "rs_1"}}),
        json!({"type": "response.reasoning_text.delta", "item_id": "rs_1", "delta": "Think"}),
        json!({"type": "response.reasoning_text.done", "item_id": "rs_1", "text": "Think"}),
        json!({"type": "response.output_item.added", "output_index": 1, "item": {"type": "message", "id": "msg_1"}}),
        json!({"type": "response.content_part.added", "item_id": "msg_1", "part": {"type": "output_text", "text": ""}}),
        json!({"type": "response.output_text.delta", "item_id": "msg_1", "delta": "Hel", "logprobs": lp("Hel")}),
        json!({"type": "response.output_text.delta", "item_id": "msg_1", "delta": "lo", "logprobs": lp("lo")}),
        json!({"type": "response.output_text.done", "item_id": "msg_1", "text": "Hello"}),
        json!({"type": "response.completed", "response": {"id": "resp_1", "status": "completed",
            "usage": {"input_tokens": 7, "output_tokens": 3}}}),
    ];
    let (c, ended) = chunks(UpstreamSurface::Responses, &events);
    assert!(ended, "response.completed ends the stream");
    assert_eq!(text_of(&c), ("Hello".to_owned(), "Think".to_owned()));
    assert!(c[0].role);
    assert_eq!(c[0].model.as_deref(), Some("m"));
    let hel = c.iter().find(|c| c.content == "Hel").expect("Hel");
    assert!(hel.tokens_match_content());
    assert_eq!(hel.tokens[0].logprob, Some(-0.1));
    assert_eq!(hel.tokens[0].top, vec![("Hel".to_owned(), -0.1)]);
    let last = c.last().expect("last");
    assert_eq!(last.finish_reason, Some(FinishReason::Stop));
    assert_eq!(
        last.usage,
        Some(Usage {
            prompt_tokens: 7,
            completion_tokens: 3
        })
    );
}

#[test]
fn responses_function_calls_become_tool_call_deltas() {
    let events = [
        json!({"type": "response.output_item.added", "output_index": 0,
            "item": {"type": "function_call", "id": "fc_1", "call_id": "call_1", "name": "get_weather", "arguments": ""}}),
        json!({"type": "response.function_call_arguments.delta", "item_id": "fc_1", "output_index": 0, "delta": "{\"a\":"}),
        json!({"type": "response.function_call_arguments.delta", "item_id": "fc_1", "output_index": 0, "delta": "1}"}),
        json!({"type": "response.function_call_arguments.done", "item_id": "fc_1", "output_index": 0, "arguments": "{\"a\":1}"}),
        // A second call whose arguments come whole, only in `.done`.
        json!({"type": "response.output_item.added", "output_index": 1,
            "item": {"type": "function_call", "id": "fc_2", "call_id": "call_2", "name": "f"}}),
        json!({"type": "response.function_call_arguments.done", "item_id": "fc_2", "output_index": 1, "arguments": "{}"}),
        json!({"type": "response.completed", "response": {"status": "completed", "usage": {"input_tokens": 1, "output_tokens": 2}}}),
    ];
    let (c, _) = chunks(UpstreamSurface::Responses, &events);
    let calls: Vec<&Value> = c.iter().filter_map(|c| c.tool_calls.as_ref()).collect();
    assert_eq!(
        calls,
        [
            &json!([{"index": 0, "id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": ""}}]),
            &json!([{"index": 0, "function": {"arguments": "{\"a\":"}}]),
            &json!([{"index": 0, "function": {"arguments": "1}"}}]),
            &json!([{"index": 1, "id": "call_2", "type": "function", "function": {"name": "f", "arguments": ""}}]),
            &json!([{"index": 1, "function": {"arguments": "{}"}}]),
        ]
    );
    assert_eq!(
        c.last().and_then(|c| c.finish_reason.clone()),
        Some(FinishReason::ToolCalls)
    );
}

#[test]
fn responses_ends_errors_and_refusals() {
    let incomplete = json!({"type": "response.incomplete", "response": {"status": "incomplete",
        "incomplete_details": {"reason": "max_output_tokens"}, "usage": {"input_tokens": 1, "output_tokens": 4}}});
    let (c, ended) = chunks(UpstreamSurface::Responses, &[incomplete]);
    assert!(ended);
    assert_eq!(c[0].finish_reason, Some(FinishReason::Length));
    // vLLM: `response.completed` with the status `incomplete`.
    let vllm = json!({"type": "response.completed", "response": {"status": "incomplete",
        "incomplete_details": {"reason": "max_output_tokens"}, "usage": {"input_tokens": 1, "output_tokens": 4}}});
    let (c, ended) = chunks(UpstreamSurface::Responses, &[vllm]);
    assert!(ended);
    assert_eq!(c[0].finish_reason, Some(FinishReason::Length));
    let failed = json!({"type": "response.failed", "response": {"status": "failed",
        "error": {"code": "server_error", "message": "engine died"}}});
    let error = json!({"type": "error", "code": "429", "message": "slow down"});
    let r = read_all(UpstreamSurface::Responses, &[failed, error]);
    assert!(
        matches!(&r[0], Ok(Parsed::Error(UpstreamError { message, .. })) if message == "engine died"),
        "{r:?}"
    );
    assert!(
        matches!(&r[1], Ok(Parsed::Error(UpstreamError { message, status: None, .. })) if message == "slow down"),
        "{r:?}"
    );
    // Arguments for a call never opened, a delta without its text, not JSON: malformed.
    let bad = [
        json!({"type": "response.function_call_arguments.delta", "item_id": "nope", "delta": "x"}),
        json!({"type": "response.output_text.delta"}),
        json!({"type": "response.output_text.delta", "delta": "x", "logprobs": [{"token": "x", "logprob": 2.0}]}),
    ];
    for (e, r) in bad.iter().zip(read_all(UpstreamSurface::Responses, &bad)) {
        assert!(r.is_err(), "{e}: {r:?}");
    }
    let refusal = json!({"type": "response.refusal.delta", "delta": "I can't"});
    let (c, _) = chunks(UpstreamSurface::Responses, &[refusal]);
    assert_eq!(c[0].content, "I can't");
}

#[test]
fn a_messages_stream_reads_as_chat_chunks() {
    let events = [
        json!({"type": "message_start", "message": {"id": "msg_1", "model": "m", "usage": {"input_tokens": 9, "output_tokens": 1}}}),
        json!({"type": "ping"}),
        json!({"type": "content_block_start", "index": 0, "content_block": {"type": "thinking", "thinking": ""}}),
        json!({"type": "content_block_delta", "index": 0, "delta": {"type": "thinking_delta", "thinking": "Hmm"}}),
        json!({"type": "content_block_delta", "index": 0, "delta": {"type": "signature_delta", "signature": "s"}}),
        json!({"type": "content_block_stop", "index": 0}),
        json!({"type": "content_block_start", "index": 1, "content_block": {"type": "text", "text": ""}}),
        json!({"type": "content_block_delta", "index": 1, "delta": {"type": "text_delta", "text": "Hi"}}),
        json!({"type": "content_block_stop", "index": 1}),
        json!({"type": "content_block_start", "index": 2, "content_block": {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {}}}),
        json!({"type": "content_block_delta", "index": 2, "delta": {"type": "input_json_delta", "partial_json": "{\"a\": 1}"}}),
        json!({"type": "content_block_stop", "index": 2}),
        json!({"type": "message_delta", "delta": {"stop_reason": "tool_use"}, "usage": {"output_tokens": 5}}),
        json!({"type": "message_stop"}),
    ];
    let (c, ended) = chunks(UpstreamSurface::Messages, &events);
    assert!(ended, "message_stop ends the stream");
    assert_eq!(text_of(&c), ("Hi".to_owned(), "Hmm".to_owned()));
    assert!(c[0].role && c[0].id.as_deref() == Some("msg_1"));
    let calls: Vec<&Value> = c.iter().filter_map(|c| c.tool_calls.as_ref()).collect();
    assert_eq!(
        calls,
        [
            &json!([{"index": 0, "id": "toolu_1", "type": "function", "function": {"name": "get_weather", "arguments": ""}}]),
            &json!([{"index": 0, "function": {"arguments": "{\"a\": 1}"}}]),
        ]
    );
    let last = c.last().expect("message_delta");
    assert_eq!(last.finish_reason, Some(FinishReason::ToolCalls));
    assert_eq!(
        last.usage,
        Some(Usage {
            prompt_tokens: 9,
            completion_tokens: 5
        })
    );
    assert!(
        c.iter().all(|c| c.tokens.is_empty()),
        "Messages has no logprobs"
    );
}

#[test]
fn messages_stop_reasons_and_errors() {
    for (reason, want) in [
        ("end_turn", FinishReason::Stop),
        ("stop_sequence", FinishReason::Stop),
        ("max_tokens", FinishReason::Length),
        ("refusal", FinishReason::ContentFilter),
        ("pause_turn", FinishReason::Other("pause_turn".to_owned())),
    ] {
        let e = json!({"type": "message_delta", "delta": {"stop_reason": reason}, "usage": {"output_tokens": 1}});
        let (c, _) = chunks(UpstreamSurface::Messages, &[e]);
        assert_eq!(c[0].finish_reason, Some(want), "{reason}");
    }
    let err =
        json!({"type": "error", "error": {"type": "overloaded_error", "message": "Overloaded"}});
    let r = read_all(UpstreamSurface::Messages, &[err]);
    assert!(
        matches!(&r[0], Ok(Parsed::Error(UpstreamError { message, kind: Some(k), .. }))
            if message == "Overloaded" && k == "overloaded_error"),
        "{r:?}"
    );
    let bad = [
        json!({"type": "content_block_delta", "index": 5, "delta": {"type": "input_json_delta", "partial_json": "{"}}),
        json!({"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta"}}),
        json!({"type": "message_delta", "delta": {}, "usage": {"output_tokens": "many"}}),
        json!([1, 2]),
    ];
    for (e, r) in bad.iter().zip(read_all(UpstreamSurface::Messages, &bad)) {
        assert!(r.is_err(), "{e}: {r:?}");
    }
}

#[test]
fn a_call_opened_twice_or_past_the_limit_is_malformed() {
    let open = |i: u32| json!({"type": "content_block_start", "index": i, "content_block": {"type": "tool_use", "id": format!("t{i}"), "name": "f", "input": {}}});
    let r = read_all(UpstreamSurface::Messages, &[open(0), open(0)]);
    assert!(r[0].is_ok() && r[1].is_err(), "{r:?}");
    let many: Vec<Value> = (0..=MAX_TOOL_CALLS).map(open).collect();
    let r = read_all(UpstreamSurface::Messages, &many);
    assert!(r[..MAX_TOOL_CALLS as usize].iter().all(Result::is_ok));
    assert!(r[MAX_TOOL_CALLS as usize].is_err());
}
