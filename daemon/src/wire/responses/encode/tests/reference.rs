//! The Responses encoder's start and end events as they were built before they were written
//! directly (with `serde_json` Values), kept as the reference the direct writers must match:
//! the same events in the same order, each one's data the same JSON, byte for byte. The Value
//! builders of the object and its usage are `object.rs`'s own, which the halted response
//! still uses.

use serde_json::{json, Value};

use super::super::*;
use super::events;
use crate::wire::responses::object::{response_object, usage};

fn write_event(out: &mut Vec<u8>, name: &str, seq: u64, rest: &Value) {
    event_head(out, name, seq);
    if let Some(map) = rest.as_object() {
        for (k, v) in map {
            out.push(b',');
            write_str(out, k);
            out.push(b':');
            let _ = serde_json::to_writer(&mut *out, v);
        }
    }
    out.extend_from_slice(b"}\n\n");
}

fn write_start_events(out: &mut Vec<u8>, stream_id: StreamId, created: u64, model: &str) {
    let response = response_object(stream_id, created, model, "in_progress", Vec::new(), None);
    let rest = json!({ "response": response });
    write_event(out, "response.created", 0, &rest);
    write_event(out, "response.in_progress", 1, &rest);
}

fn item_id(stream_id: StreamId, kind: ItemKind, index: u32) -> String {
    let mut out = Vec::with_capacity(40);
    write_item_id(&mut out, stream_id, kind, index);
    String::from_utf8_lossy(&out[1..out.len() - 1]).into_owned()
}

fn item_value(stream_id: StreamId, index: usize, item: &Item, status: &str) -> Value {
    let at = u32::try_from(index).unwrap_or(u32::MAX);
    let id = item_id(stream_id, item.kind, at);
    match item.kind {
        ItemKind::Message => json!({
            "id": id, "type": "message", "status": status, "role": "assistant",
            "content": [{"type": "output_text", "text": item.text, "annotations": [], "logprobs": []}],
        }),
        ItemKind::Reasoning => json!({
            "id": id, "type": "reasoning", "status": status, "summary": [],
            "content": [{"type": "reasoning_text", "text": item.text}],
        }),
        ItemKind::FunctionCall(_) => {
            let (call_id, name) = item.call.clone().unwrap_or_default();
            json!({
                "id": id, "type": "function_call", "status": status,
                "call_id": call_id, "name": name, "arguments": item.text,
            })
        }
    }
}

fn item_done(out: &mut Vec<u8>, o: &mut Output, stream_id: StreamId, index: usize, item: &Item) {
    let at = u32::try_from(index).unwrap_or(u32::MAX);
    let id = item_id(stream_id, item.kind, at);
    let value = item_value(stream_id, index, item, "completed");
    let part = || json!({"item_id": id, "output_index": at, "content_index": 0});
    match item.kind {
        ItemKind::Message | ItemKind::Reasoning => {
            let (name, mut done) = if item.kind == ItemKind::Message {
                ("response.output_text.done", part())
            } else {
                ("response.reasoning_text.done", part())
            };
            done["text"] = item.text.as_str().into();
            if item.kind == ItemKind::Message {
                done["logprobs"] = json!([]);
            }
            write_event(out, name, o.next(), &done);
            let mut p = part();
            p["part"] = value["content"][0].clone();
            write_event(out, "response.content_part.done", o.next(), &p);
        }
        ItemKind::FunctionCall(_) => {
            let done = json!({
                "item_id": id, "output_index": at,
                "name": value["name"], "arguments": item.text,
            });
            write_event(
                out,
                "response.function_call_arguments.done",
                o.next(),
                &done,
            );
        }
    }
    let done = json!({"output_index": at, "item": value});
    write_event(out, "response.output_item.done", o.next(), &done);
}

fn finish(stream: Stream<'_>, out: &mut Vec<u8>, finish_reason: &str, counts: Option<(u64, u64)>) {
    reference_start(stream, out);
    let mut o = stream.output.borrow_mut();
    let items = std::mem::take(&mut o.items);
    for (i, item) in items.iter().enumerate() {
        item_done(out, &mut o, stream.stream_id, i, item);
    }
    let output = items
        .iter()
        .enumerate()
        .map(|(i, item)| item_value(stream.stream_id, i, item, "completed"))
        .collect();
    let (input, output_tokens) = counts.unwrap_or_default();
    let usage = usage(input, output_tokens, o.reasoning_tokens);
    let (name, response) = end_response(stream, finish_reason, output, usage);
    let seq = o.next();
    write_event(out, name, seq, &json!({ "response": response }));
}

fn reference_start(stream: Stream<'_>, out: &mut Vec<u8>) {
    let mut o = stream.output.borrow_mut();
    if o.started {
        return;
    }
    o.started = true;
    o.sequence = 2;
    write_start_events(out, stream.stream_id, stream.created, stream.model);
}

fn end_response(
    stream: Stream<'_>,
    finish_reason: &str,
    output: Vec<Value>,
    usage: Value,
) -> (&'static str, Value) {
    let (id, created, model) = (stream.stream_id, stream.created, stream.model);
    if finish_reason == "length" {
        let mut r = response_object(id, created, model, "incomplete", output, Some(usage));
        r["incomplete_details"] = json!({"reason": "max_output_tokens"});
        return ("response.incomplete", r);
    }
    let r = response_object(id, created, model, "completed", output, Some(usage));
    ("response.completed", r)
}

fn batch_body(
    stream: Stream<'_>,
    (text, reasoning): (&str, &str),
    finish_reason: &str,
    (input_tokens, output_tokens): (u64, u64),
    tool_calls: Option<&Value>,
) -> Vec<u8> {
    let mut items = Vec::new();
    if !reasoning.is_empty() {
        items.push(Item {
            kind: ItemKind::Reasoning,
            text: reasoning.to_owned(),
            call: None,
        });
    }
    if !text.is_empty() || tool_calls.is_none() {
        items.push(Item {
            kind: ItemKind::Message,
            text: text.to_owned(),
            call: None,
        });
    }
    for (k, call) in tool_calls
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
        .enumerate()
    {
        let f = &call["function"];
        let s = |v: &Value| v.as_str().unwrap_or_default().to_owned();
        items.push(Item {
            kind: ItemKind::FunctionCall(u32::try_from(k).unwrap_or(u32::MAX)),
            text: s(&f["arguments"]),
            call: Some((s(&call["id"]), s(&f["name"]))),
        });
    }
    let output = items
        .iter()
        .enumerate()
        .map(|(i, item)| item_value(stream.stream_id, i, item, "completed"))
        .collect();
    let usage = usage(input_tokens, output_tokens, 0);
    end_response(stream, finish_reason, output, usage)
        .1
        .to_string()
        .into_bytes()
}

/// Text needing every kind of JSON escape: quotes, backslashes, control characters,
/// non-ASCII.
const ODD: &str = "say \"hi\" \\ back\n\t\u{1}\u{1f}\u{7f} é ✓ 😀 </script>";

/// One step of a stream.
enum Step<'a> {
    Text(&'a str, Channel),
    Logprob(&'a str),
    Call(u32, Option<(&'a str, &'a str)>, &'a str),
}

/// The stream's steps, then its end both ways: the writers' bytes and the reference's.
fn both(model: &str, steps: &[Step<'_>], reason: &str, counts: Option<(u64, u64)>) -> [Vec<u8>; 2] {
    let output = RefCell::new(Output::default());
    let stream = Stream {
        stream_id: StreamId {
            slot: 0xdead_beef,
            generation: 12,
        },
        created: 1_700_000_123,
        model,
        output: &output,
    };
    let mut out = Vec::new();
    stream_start(stream, &mut out);
    let mut reference = Vec::new();
    write_start_events(&mut reference, stream.stream_id, stream.created, model);
    let mut direct = Vec::new();
    super::super::write_start_events(&mut direct, stream.stream_id, stream.created, model);
    assert_eq!(direct, reference, "write_start_events");
    assert_eq!(out, reference, "start events");
    let alts = [("a\"", -0.5_f32), ("é", f32::NEG_INFINITY)];
    for step in steps {
        match *step {
            Step::Text(t, ch) => text_delta(stream, &mut out, t, ch, None),
            Step::Logprob(t) => {
                let tok = Token {
                    text: t,
                    logprob: -0.25,
                    top: &alts,
                };
                text_delta(stream, &mut out, t, Channel::Content, Some((&[tok], 2)));
            }
            Step::Call(index, head, arguments) => {
                let call = ToolCallDelta {
                    index,
                    id: head.map(|h| h.0),
                    name: head.map(|h| h.1),
                    arguments,
                };
                tool_delta(stream, &mut out, call);
            }
        }
    }
    let mut reference = out.clone();
    let copy = RefCell::new(output.borrow().clone());
    super::super::finish(stream, &mut out, reason, counts);
    let old = Stream {
        output: &copy,
        ..stream
    };
    finish(old, &mut reference, reason, counts);
    assert_eq!(output.borrow().sequence, copy.borrow().sequence);
    [out, reference]
}

/// The same events, in the same order, with the same data, and the same bytes.
fn assert_same([new, old]: &[Vec<u8>; 2]) {
    let (n, o) = (events(new), events(old));
    assert_eq!(n.len(), o.len());
    for (a, b) in n.iter().zip(&o) {
        assert_eq!(a, b);
    }
    assert_eq!(
        String::from_utf8_lossy(new),
        String::from_utf8_lossy(old),
        "byte for byte"
    );
}

#[test]
fn the_direct_writers_write_what_the_values_did() {
    use Channel::{Content, Reasoning};
    let text = [Step::Text("Hello", Content), Step::Text(", world", Content)];
    let reasoning = [
        Step::Text("think", Reasoning),
        Step::Text(ODD, Reasoning),
        Step::Text("Yes.", Content),
        Step::Text(ODD, Content),
    ];
    let calls = [
        Step::Text("Calling.", Content),
        Step::Call(0, Some(("call_\"1\"", "get_weather")), ""),
        Step::Call(1, Some(("call_2", "lookup\\é")), ""),
        Step::Call(0, None, "{\"city\":"),
        Step::Call(1, None, "{\"q\":\"\\u0001 ✓\"}"),
        Step::Call(0, None, "\"Paris\"}"),
        Step::Call(2, None, "{}"),
    ];
    let logprobs = [
        Step::Logprob("a"),
        Step::Logprob(ODD),
        Step::Text("b", Content),
    ];
    let odd_model = "model \"x\" \\ \u{1} é";
    for (model, steps) in [
        ("m", &[][..]),
        ("gpt-4o", &text[..]),
        (odd_model, &reasoning[..]),
        ("m", &calls[..]),
        (odd_model, &logprobs[..]),
    ] {
        for reason in ["stop", "length", "tool_calls"] {
            for counts in [None, Some((7, 3)), Some((u64::MAX / 4, 1))] {
                assert_same(&both(model, steps, reason, counts));
            }
        }
    }
}

#[test]
fn a_batch_body_is_what_the_values_made() {
    let output = RefCell::new(Output::default());
    let calls = json!([
        {"id": "call_1", "function": {"name": "get", "arguments": "{\"a\":1}"}},
        {"id": "c\"2", "function": {"name": "é\\", "arguments": ODD}},
        {"function": {}},
    ]);
    for model in ["m", "model \"x\" \\ \u{1} é"] {
        let stream = Stream {
            stream_id: StreamId {
                slot: 1,
                generation: 0xffff_ffff,
            },
            created: 5,
            model,
            output: &output,
        };
        for parts in [("", ""), ("Hi", ""), (ODD, "think"), ("", ODD)] {
            for reason in ["stop", "length"] {
                for tools in [None, Some(&calls)] {
                    let new = super::super::batch_body(stream, parts, reason, (3, 4), tools);
                    let old = batch_body(stream, parts, reason, (3, 4), tools);
                    let (a, b): (Value, Value) = (
                        serde_json::from_slice(&new).expect("JSON"),
                        serde_json::from_slice(&old).expect("JSON"),
                    );
                    assert_eq!(a, b);
                    assert_eq!(String::from_utf8_lossy(&new), String::from_utf8_lossy(&old));
                }
            }
        }
    }
}
