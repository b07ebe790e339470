use serde_json::Value;

mod reference;

use super::*;
use crate::wire::{
    encode::{test_encoder, ChunkEncoder},
    endpoint::Endpoint,
};

fn enc() -> ChunkEncoder {
    ChunkEncoder {
        tool_calls: true,
        reasoning: true,
        ..test_encoder(Endpoint::Responses, "m")
    }
}

/// The events of a Responses stream: (event name, data JSON); every data's `type` is its
/// event's name.
pub(crate) fn events(bytes: &[u8]) -> Vec<(String, Value)> {
    let text = std::str::from_utf8(bytes).expect("utf-8");
    assert!(text.ends_with("\n\n"), "whole events: {text:?}");
    text.split("\n\n")
        .filter(|e| !e.is_empty())
        .map(|e| {
            let mut lines = e.lines().filter(|l| !l.starts_with(':'));
            let name = lines.next().and_then(|l| l.strip_prefix("event: "));
            let data = lines.next().and_then(|l| l.strip_prefix("data: "));
            let data: Value = serde_json::from_str(data.expect("a data line")).expect("JSON");
            let name = name.expect("an event line").to_owned();
            assert_eq!(data["type"], name.as_str(), "{e}");
            (name, data)
        })
        .collect()
}

fn names(ev: &[(String, Value)]) -> Vec<&str> {
    ev.iter().map(|(n, _)| n.as_str()).collect()
}

/// The sequence numbers are 0, 1, 2, ... in the order written.
fn assert_numbered(ev: &[(String, Value)]) {
    for (i, (name, data)) in ev.iter().enumerate() {
        assert_eq!(data["sequence_number"], i as u64, "{name} is event {i}");
    }
}

fn header<'a>(index: u32, id: &'a str, name: &'a str) -> ToolCallDelta<'a> {
    ToolCallDelta {
        index,
        id: Some(id),
        name: Some(name),
        arguments: "",
    }
}

fn args(index: u32, arguments: &str) -> ToolCallDelta<'_> {
    ToolCallDelta {
        index,
        id: None,
        name: None,
        arguments,
    }
}

/// Reasoning, two text tokens, a call's header and two pieces of its arguments, the end.
fn a_whole_stream(e: &ChunkEncoder) -> Vec<u8> {
    let mut out = Vec::new();
    e.stream_start(&mut out);
    e.stream_start(&mut out);
    e.text_event(&mut out, "hmm", true, Channel::Reasoning);
    e.text_event(&mut out, "Hi", false, Channel::Content);
    e.text_event(&mut out, " there", false, Channel::Content);
    e.tool_call_event(&mut out, header(0, "call_1", "get"), false);
    e.tool_call_event(&mut out, args(0, "{\"a\":"), false);
    e.tool_call_event(&mut out, args(0, "1}"), false);
    e.finish_events(&mut out, "tool_calls", Some((7, 6)));
    out
}

#[test]
fn a_stream_is_numbered_from_zero_and_every_type_is_its_event() {
    let e = enc();
    let ev = events(&a_whole_stream(&e));
    assert_numbered(&ev);
    assert_eq!(
        names(&ev),
        [
            "response.created",
            "response.in_progress",
            "response.output_item.added",
            "response.content_part.added",
            "response.reasoning_text.delta",
            "response.output_item.added",
            "response.content_part.added",
            "response.output_text.delta",
            "response.output_text.delta",
            "response.output_item.added",
            "response.function_call_arguments.delta",
            "response.function_call_arguments.delta",
            "response.reasoning_text.done",
            "response.content_part.done",
            "response.output_item.done",
            "response.output_text.done",
            "response.content_part.done",
            "response.output_item.done",
            "response.function_call_arguments.done",
            "response.output_item.done",
            "response.completed",
        ]
    );
    assert_eq!(e.next_sequence(), ev.len() as u64);
}

#[test]
fn deltas_name_their_item_and_the_end_repeats_the_whole_text() {
    let ev = events(&a_whole_stream(&enc()));
    let by = |name: &str| -> Vec<&Value> {
        ev.iter()
            .filter(|(n, _)| n == name)
            .map(|(_, d)| d)
            .collect()
    };
    let added = by("response.output_item.added");
    assert_eq!(added[0]["item"]["type"], "reasoning");
    assert_eq!(added[1]["item"]["type"], "message");
    assert_eq!(added[1]["item"]["role"], "assistant");
    assert_eq!(added[1]["item"]["status"], "in_progress");
    assert_eq!(added[2]["item"]["type"], "function_call");
    assert_eq!(added[2]["item"]["call_id"], "call_1");
    assert_eq!(added[2]["item"]["name"], "get");
    assert_eq!(added[2]["item"]["arguments"], "");
    for (i, a) in added.iter().enumerate() {
        assert_eq!(a["output_index"], i);
    }
    let text = by("response.output_text.delta");
    assert_eq!(text[0]["item_id"], added[1]["item"]["id"]);
    assert_eq!(text[0]["output_index"], 1);
    assert_eq!(text[0]["content_index"], 0);
    assert_eq!(text[0]["delta"], "Hi");
    assert_eq!(text[0]["logprobs"], serde_json::json!([]));
    assert_eq!(by("response.output_text.done")[0]["text"], "Hi there");
    assert_eq!(by("response.reasoning_text.done")[0]["text"], "hmm");
    let call = by("response.function_call_arguments.done");
    assert_eq!(call[0]["arguments"], "{\"a\":1}");
    assert_eq!(call[0]["item_id"], added[2]["item"]["id"]);
    let parts = by("response.content_part.done");
    assert_eq!(parts[1]["part"]["type"], "output_text");
    assert_eq!(parts[1]["part"]["text"], "Hi there");
    let done = by("response.output_item.done");
    assert_eq!(done[2]["item"]["status"], "completed");
    assert_eq!(done[2]["item"]["arguments"], "{\"a\":1}");
    let completed = &by("response.completed")[0]["response"];
    assert_eq!(completed["id"], "resp_hs_0000000300000007");
    assert_eq!(completed["status"], "completed");
    assert_eq!(completed["store"], false);
    let output = completed["output"].as_array().expect("output");
    assert_eq!(output.len(), 3);
    for (i, item) in output.iter().enumerate() {
        assert_eq!(item, &done[i]["item"], "item {i}");
    }
    assert_eq!(output[1]["content"][0]["text"], "Hi there");
    let usage = &completed["usage"];
    assert_eq!(usage["input_tokens"], 7);
    assert_eq!(usage["output_tokens"], 6);
    assert_eq!(usage["total_tokens"], 13);
    assert_eq!(usage["output_tokens_details"]["reasoning_tokens"], 1);
    assert_eq!(usage["input_tokens_details"]["cached_tokens"], 0);
}

/// The fields openai-python 3.57's models require (no default) of each shape haltd writes.
const RESPONSE_REQUIRED: &[&str] = &[
    "id",
    "created_at",
    "model",
    "object",
    "output",
    "parallel_tool_calls",
    "tool_choice",
    "tools",
];

fn required_of(name: &str) -> &'static [&'static str] {
    match name {
        "response.created"
        | "response.in_progress"
        | "response.completed"
        | "response.incomplete"
        | "response.failed" => &["response", "sequence_number", "type"],
        "response.output_item.added" | "response.output_item.done" => {
            &["item", "output_index", "sequence_number", "type"]
        }
        "response.content_part.added" | "response.content_part.done" => &[
            "content_index",
            "item_id",
            "output_index",
            "part",
            "sequence_number",
            "type",
        ],
        "response.output_text.delta" => &[
            "content_index",
            "delta",
            "item_id",
            "logprobs",
            "output_index",
            "sequence_number",
            "type",
        ],
        "response.output_text.done" => &[
            "content_index",
            "item_id",
            "logprobs",
            "output_index",
            "sequence_number",
            "text",
            "type",
        ],
        "response.reasoning_text.delta" => &[
            "content_index",
            "delta",
            "item_id",
            "output_index",
            "sequence_number",
            "type",
        ],
        "response.reasoning_text.done" => &[
            "content_index",
            "item_id",
            "output_index",
            "sequence_number",
            "text",
            "type",
        ],
        "response.function_call_arguments.delta" => &[
            "delta",
            "item_id",
            "output_index",
            "sequence_number",
            "type",
        ],
        "response.function_call_arguments.done" => &[
            "arguments",
            "item_id",
            "output_index",
            "sequence_number",
            "type",
        ],
        "error" => &["message", "sequence_number", "type"],
        other => panic!("no model for {other}"),
    }
}

fn item_required(item: &Value) -> &'static [&'static str] {
    match item["type"].as_str() {
        Some("message") => &["id", "content", "role", "status", "type"],
        Some("reasoning") => &["id", "summary", "type"],
        Some("function_call") => &["arguments", "call_id", "name", "type"],
        other => panic!("no item model for {other:?}"),
    }
}

fn has(v: &Value, keys: &[&str], what: &str) {
    for k in keys {
        assert!(v.get(k).is_some(), "{what} lacks {k}: {v}");
    }
}

/// Checks a Response object against the SDK's required fields, its usage's and items'.
pub(crate) fn check_response(r: &Value) {
    has(r, RESPONSE_REQUIRED, "Response");
    assert_eq!(r["object"], "response");
    if !r["usage"].is_null() {
        let u = &r["usage"];
        has(
            u,
            &[
                "input_tokens",
                "input_tokens_details",
                "output_tokens",
                "output_tokens_details",
                "total_tokens",
            ],
            "usage",
        );
        has(
            &u["input_tokens_details"],
            &["cached_tokens", "cache_write_tokens"],
            "input_tokens_details",
        );
        has(
            &u["output_tokens_details"],
            &["reasoning_tokens"],
            "details",
        );
    }
    for item in r["output"].as_array().expect("output") {
        has(item, item_required(item), "item");
    }
}

/// Checks every event of a stream against the SDK's required fields.
pub(crate) fn check_required(ev: &[(String, Value)]) {
    for (name, data) in ev {
        has(data, required_of(name), name);
        if let Some(r) = data.get("response") {
            check_response(r);
        }
        if let Some(item) = data.get("item") {
            has(item, item_required(item), name);
        }
        if let Some(part) = data.get("part") {
            has(part, &["text", "type"], name);
            if part["type"] == "output_text" {
                has(part, &["annotations"], name);
            }
        }
    }
}

#[test]
fn every_event_has_the_fields_the_sdk_requires() {
    check_required(&events(&a_whole_stream(&enc())));
    let mut out = Vec::new();
    let e = enc();
    e.stream_start(&mut out);
    e.finish_events(&mut out, "length", None);
    let ev = events(&out);
    check_required(&ev);
    assert_eq!(names(&ev).last(), Some(&"response.incomplete"));
    let r = &ev.last().expect("end").1["response"];
    assert_eq!(r["incomplete_details"]["reason"], "max_output_tokens");
}

#[test]
fn logprobs_ride_on_the_text_delta() {
    let e = ChunkEncoder {
        logprobs: true,
        top_logprobs: 2,
        ..enc()
    };
    let mut out = Vec::new();
    e.stream_start(&mut out);
    out.clear();
    let top = [("Hi", -0.1f32), ("Ho", -2.5), ("He", -3.0)];
    let tok = Token {
        text: "Hi",
        logprob: -0.1,
        top: &top,
    };
    e.token_event(&mut out, tok, 0, true, Channel::Content);
    let ev = events(&out);
    let lp = &ev[2].1["logprobs"];
    assert_eq!(lp[0]["token"], "Hi");
    assert_eq!(lp[0]["bytes"], serde_json::json!([72, 105]));
    assert_eq!(lp[0]["top_logprobs"].as_array().map(Vec::len), Some(2));
    assert_eq!(lp[0]["top_logprobs"][1]["token"], "Ho");
}

#[test]
fn a_repeated_header_is_an_empty_delta_and_a_piece_without_one_opens_its_call() {
    let e = enc();
    let mut out = Vec::new();
    e.stream_start(&mut out);
    out.clear();
    e.tool_call_event(&mut out, header(0, "call_1", "get"), true);
    assert_eq!(names(&events(&out)), ["response.output_item.added"]);
    out.clear();
    e.tool_call_event(&mut out, header(0, "call_1", "get"), false);
    let ev = events(&out);
    assert_eq!(names(&ev), ["response.function_call_arguments.delta"]);
    assert_eq!(ev[0].1["delta"], "");
    out.clear();
    e.tool_call_event(&mut out, args(1, "{}"), false);
    let ev = events(&out);
    assert_eq!(
        names(&ev),
        [
            "response.output_item.added",
            "response.function_call_arguments.delta"
        ]
    );
    assert_eq!(ev[0].1["item"]["call_id"], "");
    assert_eq!(ev[0].1["output_index"], 1);
    // A piece of the first call again goes to its item, though another opened since.
    out.clear();
    e.tool_call_event(&mut out, args(0, "{}"), false);
    let ev = events(&out);
    assert_eq!(ev[0].1["output_index"], 0);
}

#[test]
fn a_batch_body_is_one_response() {
    let e = enc();
    let calls = serde_json::json!([{"id": "call_9", "type": "function",
        "function": {"name": "get", "arguments": "{\"a\":1}"}}]);
    let body = e.batch_body(("Hi", "hmm"), &[], &[], "tool_calls", (3, 4), Some(&calls));
    let r: Value = serde_json::from_slice(&body).expect("JSON");
    check_response(&r);
    assert_eq!(r["status"], "completed");
    let types: Vec<&str> = r["output"]
        .as_array()
        .expect("output")
        .iter()
        .filter_map(|i| i["type"].as_str())
        .collect();
    assert_eq!(types, ["reasoning", "message", "function_call"]);
    assert_eq!(r["output"][2]["call_id"], "call_9");
    assert_eq!(r["output"][2]["arguments"], "{\"a\":1}");
    assert_eq!(r["usage"]["total_tokens"], 7);
    let cut = e.batch_body(("Hi", ""), &[], &[], "length", (3, 4), None);
    let r: Value = serde_json::from_slice(&cut).expect("JSON");
    assert_eq!(r["status"], "incomplete");
    assert_eq!(r["incomplete_details"]["reason"], "max_output_tokens");
}

#[test]
fn an_annotation_is_an_event_of_its_own_name_numbered_in_turn() {
    let e = enc();
    let mut out = Vec::new();
    e.stream_start(&mut out);
    e.annotation_event(
        &mut out,
        "haltd_grounding",
        &serde_json::json!({"ok": true}),
    );
    let ev = events(&out);
    assert_numbered(&ev);
    assert_eq!(ev[2].1["haltd_grounding"]["ok"], true);
}
