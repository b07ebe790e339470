//! Tests of [`ChunkEncoder::max_event_bytes`]: safe (a property test over random tokens and
//! encoders) and tight (worst-case events reach it).

use std::{cell::Cell, sync::Arc};

use proptest::{
    prelude::*,
    test_runner::{Config, TestRunner},
};
use serde_json::Value;

use super::*;
use crate::wire::{json_write::write_logprob, stream_id::StreamId, text::truncate_text};

fn encoder(
    endpoint: Endpoint,
    logprobs: bool,
    top_logprobs: u32,
    model: &str,
    tool_calls: bool,
) -> ChunkEncoder {
    ChunkEncoder {
        logprobs,
        top_logprobs,
        tool_calls,
        ..crate::wire::encode::test_encoder(endpoint, model)
    }
}

/// The channel a worst-case frame of `enc` uses: reasoning where the stream may carry it.
fn longest_channel(enc: &ChunkEncoder) -> Channel {
    if enc.reasoning && enc.endpoint == Endpoint::Chat {
        Channel::Reasoning
    } else {
        Channel::Content
    }
}

fn token_len(enc: &ChunkEncoder, tok: Token<'_>, offset: usize, first: bool) -> usize {
    let mut out = Vec::new();
    enc.token_event(&mut out, tok, offset, first, longest_channel(enc));
    assert_valid_event(&out);
    out.len()
}

fn tool_len(enc: &ChunkEncoder, call: ToolCallDelta<'_>, first: bool) -> usize {
    let mut out = Vec::new();
    enc.tool_call_event(&mut out, call, first);
    assert_valid_event(&out);
    out.len()
}

/// One `data: {json}\n\n` event.
fn assert_valid_event(frame: &[u8]) {
    let body = frame
        .strip_prefix(b"data: ")
        .and_then(|b| b.strip_suffix(b"\n\n"))
        .expect("one SSE event");
    serde_json::from_slice::<Value>(body).expect("valid JSON");
}

#[test]
fn no_f32_logprob_is_written_longer_than_the_bound() {
    // Every sign and binade, with mantissas at their ends, middles and a spread between
    // (the exhaustive scan over all 2^32 values was done once, offline: the longest is
    // −1e-45 at 48 bytes).
    let mut longest = 0;
    let mut out = Vec::new();
    for sign in [0u32, 1 << 31] {
        for exp in 0u32..=255 {
            for m in (0u32..(1 << 23))
                .step_by(65_537)
                .chain([1, 2, 3, 0x40_0000, 0x7f_fffe, 0x7f_ffff])
            {
                out.clear();
                write_logprob(&mut out, f32::from_bits(sign | exp << 23 | m));
                longest = longest.max(out.len());
                assert!(
                    out.len() <= MAX_LOGPROB_BYTES,
                    "{:?}",
                    String::from_utf8_lossy(&out)
                );
            }
        }
    }
    out.clear();
    write_logprob(&mut out, LONGEST_LOGPROB);
    assert_eq!(out.len(), MAX_LOGPROB_BYTES);
    assert_eq!(longest, MAX_LOGPROB_BYTES);
    for special in [f32::NAN, f32::INFINITY, f32::NEG_INFINITY] {
        out.clear();
        write_logprob(&mut out, special);
        assert_eq!(out, b"-9999.0");
    }
}

/// The closed forms of `F - H` in the module docs and docs/wire-format.md.
#[test]
fn the_fixed_part_is_the_documented_formula() {
    let l = MAX_LOGPROB_BYTES;
    for model in ["builtin", "scripted", "a \"quoted\"\u{1}model"] {
        let escaped = serde_json::to_string(model).expect("string").len();
        for k in 0..=MAX_TOP_LOGPROBS as usize {
            let some = usize::from(k > 0);
            for (endpoint, lp, head, fixed) in [
                (Endpoint::Chat, false, 107, 94),
                (Endpoint::Completion, false, 97, 62),
                (Endpoint::Chat, true, 107, 156 + l + k * (35 + l) - some),
                (Endpoint::Completion, true, 97, 150 + l + k * (4 + l) - some),
            ] {
                for reasoning in [false, true] {
                    let mut enc = encoder(endpoint, lp, k as u32, model, false);
                    enc.reasoning = reasoning;
                    // `"reasoning_content":` is 10 bytes longer than `"content":`.
                    let more = if reasoning && endpoint == Endpoint::Chat {
                        10
                    } else {
                        0
                    };
                    assert_eq!(enc.head_bytes(), head + 10 + escaped, "{endpoint:?}");
                    assert_eq!(
                        enc.token_event_fixed_bytes() - enc.head_bytes(),
                        fixed + more,
                        "{endpoint:?} logprobs {lp} k {k} reasoning {reasoning}"
                    );
                }
            }
        }
        let enc = encoder(Endpoint::Chat, false, 0, model, true);
        assert_eq!(
            enc.max_tool_call_event_bytes() - enc.head_bytes(),
            181 + 6 * (MAX_TOOL_CALL_ID_BYTES + MAX_TOOL_NAME_BYTES)
        );
    }
}

/// The values quoted in docs/wire-format.md (created = 10 digits).
#[test]
fn example_bounds() {
    let e =
        |endpoint, lp, k, model, tools| encoder(endpoint, lp, k, model, tools).max_event_bytes();
    assert_eq!(e(Endpoint::Chat, false, 0, "builtin", false), 604);
    assert_eq!(e(Endpoint::Chat, true, 0, "builtin", false), 1290);
    assert_eq!(e(Endpoint::Chat, true, 5, "builtin", false), 4584);
    assert_eq!(e(Endpoint::Chat, true, 20, "builtin", false), 14469);
    assert_eq!(e(Endpoint::Completion, false, 0, "builtin", false), 562);
    assert_eq!(e(Endpoint::Completion, true, 5, "builtin", false), 3261);
    assert_eq!(e(Endpoint::Completion, true, 20, "builtin", false), 9801);
    // A proxied chat turn that may carry tool calls: the header frame is the larger.
    assert_eq!(e(Endpoint::Chat, false, 0, "scripted", true), 1460);
    assert_eq!(e(Endpoint::Chat, true, 5, "scripted", true), 4585);
    // And reasoning: 10 bytes more on a token frame.
    let mut proxied = encoder(Endpoint::Chat, true, 5, "scripted", true);
    proxied.reasoning = true;
    assert_eq!(proxied.max_event_bytes(), 4595);
}

/// Characters whose JSON escape is `\u00XX` (6 bytes).
fn six_byte_escapes() -> impl DoubleEndedIterator<Item = char> {
    (0u8..0x20)
        .filter(|b| !matches!(b, 0x08 | 0x09 | 0x0a | 0x0c | 0x0d))
        .map(char::from)
}

/// Worst-case events reach the bound: it is tight, not just safe.
#[test]
fn worst_case_events_reach_the_bound() {
    // \u{1f}: 6 bytes escaped and `31,` in a bytes array, the most any byte costs.
    let worst = "\u{1f}".repeat(MAX_TOKEN_TEXT_BYTES);
    // Completions alternatives are object keys: distinct, each of 6-byte escapes.
    let distinct: Vec<String> = six_byte_escapes()
        .rev()
        .map(|c| c.to_string().repeat(MAX_TOKEN_TEXT_BYTES))
        .collect();
    assert!(distinct.len() >= MAX_TOP_LOGPROBS as usize);
    let mut lowest = f64::MAX;
    for endpoint in [Endpoint::Chat, Endpoint::Completion] {
        for lp in [false, true] {
            for k in 0..=MAX_TOP_LOGPROBS {
                for (tools, reasoning) in [(false, false), (true, false), (true, true)] {
                    let mut enc = encoder(endpoint, lp, k, "m\u{1}\"", tools);
                    enc.reasoning = reasoning;
                    let top: Vec<(&str, f32)> = match endpoint {
                        Endpoint::Chat | Endpoint::Messages | Endpoint::Responses => {
                            vec![(worst.as_str(), LONGEST_LOGPROB); k as usize]
                        }
                        Endpoint::Completion => distinct
                            .iter()
                            .take(k as usize)
                            .map(|a| (a.as_str(), LONGEST_LOGPROB))
                            .collect(),
                    };
                    let tok = Token {
                        text: &worst,
                        logprob: LONGEST_LOGPROB,
                        top: &top,
                    };
                    let token = token_len(&enc, tok, usize::MAX, true);
                    let bound = enc.max_token_event_bytes();
                    assert!(token <= bound);
                    // Slack: the last entry of each bytes array has no comma.
                    let slack = if endpoint == Endpoint::Chat && lp {
                        1 + k as usize
                    } else {
                        0
                    };
                    assert_eq!(token + slack, bound, "{endpoint:?} logprobs {lp} k {k}");
                    let mut most = token;
                    if tools && endpoint == Endpoint::Chat {
                        let id = "\u{1f}".repeat(MAX_TOOL_CALL_ID_BYTES);
                        let name = "\u{1f}".repeat(MAX_TOOL_NAME_BYTES);
                        let header = ToolCallDelta {
                            index: u32::MAX,
                            id: Some(&id),
                            name: Some(&name),
                            arguments: "",
                        };
                        let tool = tool_len(&enc, header, true);
                        assert_eq!(tool, enc.max_tool_call_event_bytes());
                        most = most.max(tool);
                    }
                    let e = enc.max_event_bytes() as usize;
                    assert!(most <= e);
                    lowest = lowest.min(most as f64 / e as f64);
                }
            }
        }
    }
    eprintln!("worst-case event / max_event_bytes: at least {lowest:.4}");
    assert!(lowest >= 0.99, "{lowest}");
}

fn any_char() -> impl Strategy<Value = char> {
    prop_oneof![
        3 => (0u8..0x20).prop_map(char::from),
        1 => Just('"'),
        1 => Just('\\'),
        1 => Just('\u{7f}'),
        2 => proptest::char::range(' ', '~'),
        2 => proptest::char::any(),
        1 => prop_oneof![Just('é'), Just('€'), Just('𝄞'), Just('\u{2028}')],
    ]
}

/// Strings of up to `max` bytes.
fn text(max: usize) -> impl Strategy<Value = String> {
    proptest::collection::vec(any_char(), 0..=max).prop_map(move |cs| {
        let s: String = cs.into_iter().collect();
        truncate_text(&s, max).to_owned()
    })
}

fn logprob() -> impl Strategy<Value = f32> {
    prop_oneof![
        any::<u32>().prop_map(f32::from_bits),
        (0u32..0x80_0000).prop_map(|m| f32::from_bits(0x8000_0000 | m)),
        (0.0f32..50.0).prop_map(|x| -x),
        prop_oneof![
            Just(f32::NEG_INFINITY),
            Just(f32::INFINITY),
            Just(f32::NAN),
            Just(f32::MIN),
            Just(f32::MAX),
            Just(LONGEST_LOGPROB),
            Just(-0.0),
        ],
    ]
}

/// Alternatives, some longer than the cap (truncated by the encoder), some sharing their first
/// 64 bytes (one key after truncation), some repeated; more than any `top_logprobs` at times.
fn alternatives() -> impl Strategy<Value = Vec<(String, f32)>> {
    let alt = prop_oneof![
        4 => text(MAX_TOKEN_TEXT_BYTES),
        1 => text(3 * MAX_TOKEN_TEXT_BYTES),
        1 => text(8).prop_map(|s| "\u{1f}".repeat(MAX_TOKEN_TEXT_BYTES) + &s),
        1 => Just(String::new()),
        1 => Just("a".to_owned()),
    ];
    proptest::collection::vec((alt, logprob()), 0..=MAX_TOP_LOGPROBS as usize + 4)
}

fn any_encoder() -> impl Strategy<Value = ChunkEncoder> {
    (
        any::<bool>(),
        any::<bool>(),
        prop_oneof![0u32..=MAX_TOP_LOGPROBS, Just(MAX_TOP_LOGPROBS + 5)],
        text(48),
        (any::<u32>(), any::<u32>(), any::<u64>()),
        (any::<bool>(), any::<bool>()),
    )
        .prop_map(
            |(
                chat,
                logprobs,
                top_logprobs,
                model,
                (slot, generation, created),
                (tool_calls, reasoning),
            )| {
                ChunkEncoder {
                    endpoint: if chat {
                        Endpoint::Chat
                    } else {
                        Endpoint::Completion
                    },
                    stream_id: StreamId { slot, generation },
                    created,
                    model: Arc::from(model.as_str()),
                    logprobs,
                    top_logprobs,
                    tool_calls,
                    reasoning,
                    blocks: std::cell::Cell::default(),
                    output: std::cell::RefCell::default(),
                }
            },
        )
}

#[derive(Debug)]
struct Case {
    enc: ChunkEncoder,
    text: String,
    logprob: f32,
    top: Vec<(String, f32)>,
    offset: usize,
    first: bool,
    call: (u32, Option<String>, Option<String>, String),
}

fn any_case() -> impl Strategy<Value = Case> {
    (
        any_encoder(),
        text(MAX_TOKEN_TEXT_BYTES),
        logprob(),
        alternatives(),
        any::<usize>(),
        any::<bool>(),
        (
            any::<u32>(),
            proptest::option::of(text(MAX_TOOL_CALL_ID_BYTES)),
            proptest::option::of(text(MAX_TOOL_NAME_BYTES)),
            text(MAX_TOKEN_TEXT_BYTES),
        ),
    )
        .prop_map(|(enc, text, logprob, top, offset, first, call)| Case {
            enc,
            text,
            logprob,
            top,
            offset,
            first,
            call,
        })
}

/// Every event an encoder writes for tokens within the caps fits its `max_event_bytes`;
/// prints how close the random cases came.
#[test]
fn every_event_fits_the_bound() {
    let mut runner = TestRunner::new(Config {
        cases: 2000,
        ..Config::default()
    });
    let closest = Cell::new(0.0f64);
    runner
        .run(&any_case(), |c| {
            let e = c.enc.max_event_bytes() as usize;
            let top: Vec<(&str, f32)> = c.top.iter().map(|(s, l)| (s.as_str(), *l)).collect();
            let tok = Token {
                text: &c.text,
                logprob: c.logprob,
                top: &top,
            };
            let mut most = token_len(&c.enc, tok, c.offset, c.first);
            prop_assert!(most <= c.enc.max_token_event_bytes());
            // Content frames fit too where reasoning is the longer template.
            for channel in [Channel::Content, longest_channel(&c.enc)] {
                let mut out = Vec::new();
                c.enc.token_event(&mut out, tok, c.offset, c.first, channel);
                prop_assert!(out.len() <= c.enc.max_token_event_bytes());
                out.clear();
                c.enc.text_event(&mut out, &c.text, c.first, channel);
                assert_valid_event(&out);
                prop_assert!(out.len() <= c.enc.max_token_event_bytes());
                most = most.max(out.len());
            }
            if c.enc.tool_calls && c.enc.endpoint == Endpoint::Chat {
                let (index, id, name, args) = &c.call;
                let header = ToolCallDelta {
                    index: *index,
                    id: id.as_deref(),
                    name: name.as_deref(),
                    arguments: "",
                };
                let piece = ToolCallDelta {
                    index: *index,
                    id: None,
                    name: None,
                    arguments: args,
                };
                for call in [header, piece] {
                    let n = tool_len(&c.enc, call, c.first);
                    prop_assert!(n <= c.enc.max_tool_call_event_bytes());
                    most = most.max(n);
                }
            }
            prop_assert!(most <= e, "{most} > {e}");
            closest.set(closest.get().max(most as f64 / e as f64));
            Ok(())
        })
        .expect("every event fits max_event_bytes");
    eprintln!(
        "random events / max_event_bytes: at most {:.4}",
        closest.get()
    );
}

/// One token frame of a Responses stream: content or reasoning text (with its logprobs), a
/// tool call's header (index, id, name) or a piece of its arguments.
#[derive(Debug, Clone)]
enum ResponsesFrame {
    Text(Channel, String, f32, Vec<(String, f32)>),
    Header(u32, String, String),
    Args(u32, String),
}

fn responses_frame() -> impl Strategy<Value = ResponsesFrame> {
    let channel = prop_oneof![Just(Channel::Content), Just(Channel::Reasoning)];
    prop_oneof![
        (
            channel,
            text(MAX_TOKEN_TEXT_BYTES),
            logprob(),
            alternatives()
        )
            .prop_map(|(c, t, l, a)| ResponsesFrame::Text(c, t, l, a)),
        (
            0u32..3,
            text(MAX_TOOL_CALL_ID_BYTES),
            text(MAX_TOOL_NAME_BYTES)
        )
            .prop_map(|(i, id, name)| ResponsesFrame::Header(i, id, name)),
        (0u32..3, text(MAX_TOKEN_TEXT_BYTES)).prop_map(|(i, a)| ResponsesFrame::Args(i, a)),
    ]
}

/// Every token frame of a Responses stream, whatever came before it (items opened by channel
/// switches and calls, logprobs asked or not), fits the encoder's `max_event_bytes`; every
/// event of the stream is JSON, and the stream's sequence numbers count from 0.
#[test]
fn every_responses_frame_fits_the_bound() {
    let mut runner = TestRunner::new(Config {
        cases: 300,
        ..Config::default()
    });
    let closest = Cell::new(0.0f64);
    let case = (
        any::<bool>(),
        prop_oneof![0u32..=MAX_TOP_LOGPROBS, Just(MAX_TOP_LOGPROBS + 5)],
        (any::<u32>(), any::<u32>()),
        proptest::collection::vec(responses_frame(), 1..40),
    );
    runner
        .run(
            &case,
            |(logprobs, top_logprobs, (slot, generation), frames)| {
                let enc = ChunkEncoder {
                    logprobs,
                    top_logprobs,
                    tool_calls: true,
                    reasoning: true,
                    stream_id: StreamId { slot, generation },
                    ..crate::wire::encode::test_encoder(Endpoint::Responses, "m\u{1}\"")
                };
                let e = enc.max_event_bytes() as usize;
                let mut all = Vec::new();
                enc.stream_start(&mut all);
                for f in &frames {
                    let mut out = Vec::new();
                    match f {
                        ResponsesFrame::Text(channel, text, lp, alts) => {
                            let top: Vec<(&str, f32)> =
                                alts.iter().map(|(s, l)| (s.as_str(), *l)).collect();
                            let tok = Token {
                                text,
                                logprob: *lp,
                                top: &top,
                            };
                            enc.token_event(&mut out, tok, 0, false, *channel);
                        }
                        ResponsesFrame::Header(index, id, name) => {
                            let call = ToolCallDelta {
                                index: *index,
                                id: Some(id),
                                name: Some(name),
                                arguments: "",
                            };
                            enc.tool_call_event(&mut out, call, false);
                        }
                        ResponsesFrame::Args(index, args) => {
                            let call = ToolCallDelta {
                                index: *index,
                                id: None,
                                name: None,
                                arguments: args,
                            };
                            enc.tool_call_event(&mut out, call, false);
                        }
                    }
                    prop_assert!(!out.is_empty(), "every frame carries an event");
                    prop_assert!(out.len() <= e, "{} > {e}: {f:?}", out.len());
                    closest.set(closest.get().max(out.len() as f64 / e as f64));
                    all.extend_from_slice(&out);
                }
                enc.finish_events(&mut all, "stop", Some((1, frames.len() as u64)));
                let ev = crate::wire::responses::encode::tests::events(&all);
                for (i, (_, data)) in ev.iter().enumerate() {
                    prop_assert_eq!(&data["sequence_number"], &Value::from(i));
                }
                crate::wire::responses::encode::tests::check_required(&ev);
                Ok(())
            },
        )
        .expect("every Responses frame fits max_event_bytes");
    eprintln!(
        "random Responses frames / max_event_bytes: at most {:.4}",
        closest.get()
    );
}

#[test]
fn the_responses_bound_is_one_per_top_whatever_the_stream() {
    // The cache holds one bound per `top`: right only if nothing else changes it.
    let ids = [
        StreamId {
            slot: 0,
            generation: 0,
        },
        StreamId {
            slot: u32::MAX,
            generation: u32::MAX,
        },
    ];
    for top in std::iter::once(None).chain((0..=MAX_TOP_LOGPROBS as usize).map(Some)) {
        let fresh: Vec<usize> = ids
            .iter()
            .map(|&id| crate::wire::responses::encode::max_event_bytes(id, top))
            .collect();
        assert_eq!(fresh[0], fresh[1], "top {top:?}");
        for id in ids {
            // Twice: computed, then from the cache.
            for _ in 0..2 {
                assert_eq!(responses_bound(id, top) as usize, fresh[0], "top {top:?}");
            }
        }
    }
    // A `top` past the cap is the cap's (the encoder writes at most that many).
    let cap = Some(MAX_TOP_LOGPROBS as usize);
    assert_eq!(
        responses_bound(ids[0], Some(1000)),
        responses_bound(ids[0], cap)
    );
}
