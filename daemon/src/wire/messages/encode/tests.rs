use proptest::prelude::*;
use serde_json::Value;

use super::*;
use crate::wire::{
    encode::{test_encoder, ChunkEncoder},
    endpoint::Endpoint,
    http::chunk_in_place,
};

fn enc(endpoint: Endpoint, model: &str) -> ChunkEncoder {
    ChunkEncoder {
        tool_calls: true,
        reasoning: true,
        ..test_encoder(endpoint, model)
    }
}

/// The events of a Messages stream: (event name, data JSON); every data's `type` is its
/// event's name.
fn events(bytes: &[u8]) -> Vec<(String, Value)> {
    let text = std::str::from_utf8(bytes).expect("utf-8");
    assert!(text.ends_with("\n\n"), "whole events: {text:?}");
    text.split("\n\n")
        .filter(|e| !e.is_empty())
        .map(|e| {
            let (name, data) = e.split_once('\n').expect("event and data lines");
            let name = name.strip_prefix("event: ").expect("event line").to_owned();
            let data: Value = serde_json::from_str(data.strip_prefix("data: ").expect("data"))
                .expect("data is JSON");
            assert_eq!(data["type"], name.as_str(), "{e}");
            (name, data)
        })
        .collect()
}

fn names(ev: &[(String, Value)]) -> Vec<&str> {
    ev.iter().map(|(n, _)| n.as_str()).collect()
}

/// A reasoning token, two text tokens, a tool call's header and arguments, the end.
fn a_whole_stream(e: &ChunkEncoder) -> Vec<u8> {
    let mut out = Vec::new();
    e.stream_start(&mut out);
    e.stream_start(&mut out);
    e.text_event(&mut out, "hmm", true, Channel::Reasoning);
    e.text_event(&mut out, "Hi", false, Channel::Content);
    e.text_event(&mut out, " there", false, Channel::Content);
    let header = ToolCallDelta {
        index: 0,
        id: Some("call_1"),
        name: Some("get"),
        arguments: "",
    };
    e.tool_call_event(&mut out, header, false);
    let args = ToolCallDelta {
        arguments: "{\"a\":1}",
        id: None,
        name: None,
        ..header
    };
    e.tool_call_event(&mut out, args, false);
    e.finish_events(&mut out, "tool_calls", Some((5, 9)));
    out
}

#[test]
fn a_stream_opens_and_closes_blocks_in_order() {
    let ev = events(&a_whole_stream(&enc(Endpoint::Messages, "m")));
    assert_eq!(
        names(&ev),
        [
            "message_start",
            "content_block_start",
            "content_block_delta",
            "content_block_stop",
            "content_block_start",
            "content_block_delta",
            "content_block_delta",
            "content_block_stop",
            "content_block_start",
            "content_block_delta",
            "content_block_stop",
            "message_delta",
            "message_stop"
        ]
    );
    assert_eq!(ev[0].1["message"]["id"], "msg_hs_0000000300000007");
    assert_eq!(ev[1].1["content_block"]["type"], "thinking");
    assert_eq!(ev[2].1["delta"]["thinking"], "hmm");
    assert_eq!(ev[4].1["index"], 1);
    assert_eq!(ev[6].1["delta"]["text"], " there");
    assert_eq!(ev[8].1["content_block"]["id"], "call_1");
    assert_eq!(ev[9].1["delta"]["partial_json"], "{\"a\":1}");
    assert_eq!(ev[10].1["index"], 2);
    assert_eq!(ev[11].1["delta"]["stop_reason"], "tool_use");
    assert_eq!(ev[11].1["usage"]["output_tokens"], 9);
    assert_eq!(ev[11].1["usage"]["input_tokens"], 5);
}

#[test]
fn an_empty_reply_still_starts_and_stops_its_message() {
    let e = enc(Endpoint::Messages, "m");
    let mut out = Vec::new();
    e.finish_events(&mut out, "length", None);
    let ev = events(&out);
    assert_eq!(
        names(&ev),
        ["message_start", "message_delta", "message_stop"]
    );
    assert_eq!(ev[1].1["delta"]["stop_reason"], "max_tokens");
}

#[test]
fn a_batch_body_is_one_message_with_its_blocks() {
    let e = enc(Endpoint::Messages, "m");
    let calls = serde_json::json!([{"id": "c1", "type": "function",
        "function": {"name": "f", "arguments": "{\"x\":[1]}"}},
        {"id": "c2", "type": "function", "function": {"name": "g", "arguments": "not json"}}]);
    let body = e.batch_body(
        ("answer", "why"),
        &[],
        &[],
        "tool_calls",
        (3, 4),
        Some(&calls),
    );
    let v: Value = serde_json::from_slice(&body).expect("json");
    assert_eq!(v["type"], "message");
    assert_eq!(v["content"][0]["type"], "thinking");
    assert_eq!(v["content"][1]["text"], "answer");
    assert_eq!(v["content"][2]["input"]["x"][0], 1);
    assert_eq!(v["content"][3]["input"], "not json");
    assert_eq!(v["stop_reason"], "tool_use");
    assert_eq!(v["usage"]["output_tokens"], 4);
}

const OPEN: [BlockKind; 4] = [
    BlockKind::None,
    BlockKind::Text,
    BlockKind::Thinking,
    BlockKind::ToolUse(0),
];

/// A token frame of `e` with the block `open` open: `kind` 0 text, 1 thinking, 2 a tool
/// call's header (id and name `name`), 3 a piece of a tool call's arguments.
/// On a Responses stream (which has no blocks), the start events and a token of the kind
/// `open` names go before it, so the frame is a token frame after an item of that kind.
fn frame(e: &ChunkEncoder, open: BlockKind, (kind, text, name): (u8, &str, &str)) -> Vec<u8> {
    if e.endpoint == Endpoint::Responses {
        let mut before = Vec::new();
        e.stream_start(&mut before);
        let call = ToolCallDelta {
            index: 0,
            id: Some("c"),
            name: Some("f"),
            arguments: "",
        };
        match open {
            BlockKind::None => {}
            BlockKind::Text => e.text_event(&mut before, "a", true, Channel::Content),
            BlockKind::Thinking => e.text_event(&mut before, "a", true, Channel::Reasoning),
            BlockKind::ToolUse(_) => e.tool_call_event(&mut before, call, true),
        }
    }
    e.blocks.set(Blocks {
        started: true,
        open,
        opened: 1,
    });
    let mut out = Vec::new();
    let call = |index, id, arguments| ToolCallDelta {
        index,
        id,
        name: id,
        arguments,
    };
    match kind % 4 {
        0 => e.text_event(&mut out, text, true, Channel::Content),
        1 => e.text_event(&mut out, text, false, Channel::Reasoning),
        2 => e.tool_call_event(&mut out, call(0, Some(name), ""), true),
        _ => e.tool_call_event(&mut out, call(1, None, text), false),
    }
    out
}

fn short(s: &str, cap: usize) -> &str {
    &s[..s.floor_char_boundary(cap)]
}

/// The frame's bytes after a chunk's size line (all of it when plain).
fn payload(f: &[u8], chunked: bool) -> &[u8] {
    if chunked {
        &f[f.iter().position(|&b| b == b'\n').map_or(0, |p| p + 1)..]
    } else {
        f
    }
}

proptest! {
    /// No token frame of any surface, plain or chunked, can carry model- or client-chosen
    /// bytes where the kernel gate looks for a terminal's nonce (bytes 31 to 46): those
    /// bytes are the same whatever the text, the model name or the tool's id and name (a
    /// chunk's size line, hex digits haltd writes, shifts them by its own length only).
    #[test]
    fn no_frame_carries_chosen_bytes_at_the_nonce(
        text in ".{0,64}", model in ".{0,80}", name in "[ -~]{0,64}", kind in 0u8..4,
        open in 0usize..4, chunked: bool,
    ) {
        use haltd_common::{NONCE_LEN, NONCE_OFFSET};
        let text = short(&text, MAX_TOKEN_TEXT_BYTES);
        let endpoints = [
            Endpoint::Chat,
            Endpoint::Completion,
            Endpoint::Messages,
            Endpoint::Responses,
        ];
        for endpoint in endpoints {
            let kind = if endpoint == Endpoint::Completion { 0 } else { kind };
            let mut chosen = frame(&enc(endpoint, &model), OPEN[open], (kind, text, &name));
            let mut fixed = frame(&enc(endpoint, "m"), OPEN[open], (kind, "", ""));
            if chunked {
                chunk_in_place(&mut chosen, 0);
                chunk_in_place(&mut fixed, 0);
            }
            let line = chosen.len() - payload(&chosen, chunked).len();
            prop_assert!(line <= 10);
            // Bytes 31..47 of the frame are payload bytes from (31 - line) on: compare them
            // (a frame too short to reach them, a ping, cannot carry a nonce at all).
            let at = |f: &[u8]| -> Vec<u8> {
                let p = payload(f, chunked);
                p.iter().skip(NONCE_OFFSET - line).take(NONCE_LEN).copied().collect()
            };
            prop_assert_eq!(at(&chosen), at(&fixed), "{:?}", endpoint);
        }
    }

    /// Every Messages token frame keeps to the kernel's per-frame bound.
    #[test]
    fn every_messages_frame_is_within_its_bound(
        text in ".{0,64}", name in ".{0,64}", kind in 0u8..4, open in 0usize..4,
    ) {
        let e = enc(Endpoint::Messages, "m\u{1}\"");
        let bound = e.max_event_bytes() as usize;
        let text = short(&text, MAX_TOKEN_TEXT_BYTES);
        let name = short(&name, MAX_TOOL_NAME_BYTES);
        let f = frame(&e, OPEN[open], (kind, text, name));
        prop_assert!(f.len() <= bound, "{} > {}", f.len(), bound);
    }
}

#[test]
fn the_worst_messages_frame_reaches_the_bound() {
    let e = enc(Endpoint::Messages, "m");
    let bound = e.max_event_bytes() as usize;
    let ctl = "\u{1f}".repeat(MAX_TOKEN_TEXT_BYTES);
    let id = "\u{1f}".repeat(MAX_TOOL_CALL_ID_BYTES);
    let name = "\u{1f}".repeat(MAX_TOOL_NAME_BYTES);
    e.blocks.set(Blocks {
        started: true,
        open: BlockKind::ToolUse(u32::MAX - 1),
        opened: u32::MAX,
    });
    let mut out = Vec::new();
    let call = ToolCallDelta {
        index: u32::MAX,
        id: Some(&id),
        name: Some(&name),
        arguments: &ctl,
    };
    e.tool_call_event(&mut out, call, false);
    assert_eq!(
        out.len(),
        bound,
        "the bound is exact for the worst tool frame"
    );
}
